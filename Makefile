# make run   [ARGS="--model smollm2 --format u4 --group-size 64"]   the main job, scripts/patch_hf_model.py
# make test  [ARGS="tests/test_cli.py -k save"]                     the tests (pytest, two processes)
# make setup                                                        only the set-up
# Each brings .venv up to date first (Python >= 3.11, the pinned packages, the C++ extension) and
# skips what is already done: scripts/venv.sh says how. PYTHON=python3.12 picks the interpreter.
.PHONY: run test setup
run test setup:
	@PYTHON="$(PYTHON)" sh scripts/venv.sh $@ $(ARGS)
