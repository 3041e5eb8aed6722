"""scripts/patch_hf_model.py's argument handling: a bad argument, a device this machine lacks or a
model path that does not exist ends with one ``patch_hf_model.py: error: ...`` line on stderr and
exit status 2, before any model is loaded; ``--help`` states every default. Most cases call
``main()`` in-process; two run the script as a user does (a subprocess, ~20 s each on a loaded
2-core machine: importing torch) to show no traceback reaches the terminal. The latency notes are
checked on fake timings."""

import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "patch_hf_model.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def run_cli(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))


def assert_one_line_error(code, stderr, stdout, *fragments):
    assert code == 2, (code, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("patch_hf_model.py: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert "Traceback" not in stderr and stdout == ""


def main_error(capsys, *args):
    import patch_hf_model
    with pytest.raises(SystemExit) as e:
        patch_hf_model.main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.err, out.out


@pytest.mark.parametrize("args, fragments", [
    (["--group-size", "100"], ["--group-size", "positive multiple of 8", "100"]),
    (["--group-size", "0"], ["--group-size", "positive multiple of 8"]),
    (["--group-size", "x"], ["--group-size", "expected an integer"]),
    (["--format", "trellis", "--group-size", "40"], ["trellis needs a positive multiple of 16, got 40"]),
    (["--format", "fp4", "--bits", "3"], ["--bits applies to --format trellis only"]),
    (["--format", "affine", "--bits", "3"], ["--bits applies to --format trellis only (fp4, u4 and affine"]),
    (["--fuse", "--save", "/tmp/x", "--entropy-coding"], ["--fuse with --save", "cannot be cut back"]),
    (["--format", "trellis", "--entropy-coding"], ["--entropy-coding applies to --format fp4, u4 or affine"]),
    (["--repeats", "0"], ["--repeats", "must be positive"]),
    (["--format", "int8"], ["--format", "invalid choice"]),
    (["--model", "/nonexistent/model_dir"], ["--model", "'/nonexistent/model_dir' does not exist",
                                             "minilm, smollm2"]),
    (["--model", ROOT], ["has no config.json"]),
    (["--model", SCRIPT], ["is a file but not a .gguf file"]),
    (["--device", "gpu"], ["--device", "'gpu' is not a device"]),
    (["--device", "meta"], ["no kernels for 'meta'"]),
])
def test_bad_arguments_end_in_one_line(capsys, monkeypatch, args, fragments):
    monkeypatch.setattr(sys, "argv", [SCRIPT])
    if "--device" not in args:
        args = ["--device", "cpu", *args]
    assert_one_line_error(*main_error(capsys, *args), *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_missing_cuda_device_ends_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [SCRIPT])
    assert_one_line_error(*main_error(capsys, "--device", "cuda"), "--device cuda:", "use --device cpu")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_missing_mps_device_ends_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [SCRIPT])
    assert_one_line_error(*main_error(capsys, "--device", "mps"), "--device mps: MPS is not available",
                          "use --device cpu")


@pytest.mark.parametrize("args, fragment", [
    (["--group-size", "100"], "positive multiple of 8"),
    (["--device", "cpu", "--model", "/nonexistent/model_dir"], "does not exist"),
])
def test_script_run_by_a_user_prints_no_traceback(args, fragment):
    r = run_cli(*args)
    assert_one_line_error(r.returncode, r.stderr, r.stdout, fragment)


def test_help_states_every_default():
    import patch_hf_model
    options = [a.option_strings[0] for a in patch_hf_model.build_parser()._actions if a.dest != "help"]
    text = " ".join(patch_hf_model.build_parser().format_help().split())
    text = text[text.index("options:"):]
    assert text.count("(default: ") == len(options) == 18
    for option, default in [("--model", "minilm"), ("--group-size", "128"), ("--skip", "['lm_head']"),
                            ("--repeats", "3")]:
        assert f"(default: {default})" in text[text.index(f"{option} "):].split(" --")[0], option


def test_latency_notes_say_when_and_why_the_quantized_model_is_slower(monkeypatch):
    import patch_hf_model
    timings = iter([(0.010, 0.011), (0.030, 0.031), (0.010, 0.030), (0.010, 0.0105)])  # (min, median) s
    monkeypatch.setattr(patch_hf_model.evaluation, "timed", lambda fn, repeats: next(timings))
    lat = patch_hf_model.Latency(repeats=3)
    rows = []
    lat.measure(rows, "prefill latency, 100 tokens (ms, min / median)", None, None)
    assert rows == [["prefill latency, 100 tokens (ms, min / median)", "10.0 / 11.0", "30.0 / 31.0"]]
    report = types.SimpleNamespace(float_bytes=40 * 2**20, quantized_bytes=6 * 2**20, entropy_coded=[])
    notes = lat.notes(torch.device("cpu"), "fp4", torch.float32, report)
    assert len(notes) == 1
    decode_rows, family = patch_hf_model.kernel_regimes(torch.device("cpu"), "fp4", torch.float32)
    assert (decode_rows, family) == (8, "dequant_blas")  # the CPU policy (torch_marlin/planner.py)
    assert notes[0].startswith("note: the quantized model is slower here (prefill latency, 100 tokens). On the CPU")
    assert "more than 8 rows" in notes[0] and "(dequant_blas)" in notes[0] and "40.0 -> 6.0 MiB" in notes[0]
    # Entropy-coded layers: the rANS decode is named as the cost, not the dense kernels.
    coded = types.SimpleNamespace(float_bytes=40 * 2**20, quantized_bytes=5 * 2**20,
                                  entropy_coded=[("a", 100, 3.9), ("b", 100, 3.8)])
    note = patch_hf_model.why_slower(torch.device("cpu"), "fp4", torch.float32, coded)
    assert note.startswith("The 2 entropy-coded layers decode their rANS-coded") and "dequant_blas" not in note
    assert "40.0 -> 5.0 MiB" in note
    # A noisy pair (median 3x its min) gets its own note; equal speed gets no slower-note.
    lat2 = patch_hf_model.Latency(repeats=3)
    lat2.measure([], "forward latency, 1 sentence (ms, min / median)", None, None)
    notes = lat2.notes(torch.device("cpu"), "fp4", torch.float32, report)
    assert len(notes) == 1 and notes[0].startswith("note: latencies vary up to 3.0x between runs")


def test_progress_bars_off_when_not_a_terminal_and_back_after():
    import io

    import patch_hf_model
    from tqdm.auto import tqdm

    def bar_output():
        out = io.StringIO()
        for _ in tqdm(range(3), desc="converting", file=out, mininterval=0):
            pass
        return out.getvalue()

    assert "converting" in bar_output()
    with patch_hf_model.progress_bars(False):
        assert bar_output() == ""
    assert "converting" in bar_output()


# ---- inputs that would fail late or mislead: each is one line before any model is loaded ----------

def _write_safetensors(path, truncate=False):
    from safetensors.torch import save_file
    save_file({"embeddings.weight": torch.zeros(64, 8)}, str(path))
    if truncate:
        os.truncate(path, os.path.getsize(path) - 100)


def _model_dir(root, name, config, weights=True, tokenizer=True, truncate=False):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(config)
    if weights:
        _write_safetensors(d / "model.safetensors", truncate)
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return str(d)


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    paths = {
        "unrelated": _model_dir(root, "unrelated", '{"name": "my-app", "version": 2}'),
        "mlx_no_tokenizer": _model_dir(root, "mlx", '{"model_type": "llama", "quantization": {"bits": 4}}',
                                       tokenizer=False),
        "no_weights": _model_dir(root, "no_weights", '{"model_type": "bert"}', weights=False),
        "truncated": _model_dir(root, "truncated", '{"model_type": "bert"}', truncate=True),
        "float_dir": _model_dir(root, "float_dir", '{"model_type": "bert"}'),
        "binary": str(root / "calibration.bin"),
        "file": str(root / "a_file"),
        "not_checkpoint": str(root / "not_checkpoint"),
    }
    with open(paths["binary"], "wb") as f:
        f.write(bytes(range(256)) * 4)
    with open(paths["file"], "w") as f:
        f.write("x")
    os.mkdir(paths["not_checkpoint"])
    with open(os.path.join(paths["not_checkpoint"], "notes.txt"), "w") as f:
        f.write("keep me")
    return paths


@pytest.mark.parametrize("args, fragments", [
    (["--model", "{unrelated}"], ["config.json has no model_type", "not a Hugging Face transformers model"]),
    (["--model", "{mlx_no_tokenizer}"], ["has no tokenizer files", "tokenizer.json"]),
    (["--model", "{no_weights}"], ["has no weights", "*.safetensors"]),
    (["--model", "{truncated}"], ["model.safetensors is not a readable safetensors file", "truncated"]),
    (["--model", "{float_dir}", "--keep-gguf-quantization"], ["--keep-gguf-quantization applies to a .gguf"]),
    (["--method", "gptq", "--calibration", "{binary}"], ["--calibration", "is not UTF-8 text", "byte 128"]),
    (["--calibration", "{binary}"], ["--calibration applies to --method gptq"]),
    (["--save", "{file}"], ["--save", "exists and is not a directory"]),
    (["--save", "{file}/out"], ["--save", "is a file, so", "cannot be created"]),
    (["--save", "{not_checkpoint}"], ["--save", "non-empty directory that is not a torch_marlin checkpoint"]),
])
def test_bad_inputs_end_in_one_line_before_loading(capsys, monkeypatch, bad_inputs, args, fragments):
    import patch_hf_model

    monkeypatch.setattr(sys, "argv", [SCRIPT])
    # Nothing may be loaded or quantized before these errors.
    monkeypatch.setattr(patch_hf_model.evaluation, "load_hf_model", lambda *a, **k: pytest.fail("model loaded"))
    args = ["--device", "cpu", *(a.format(**bad_inputs) for a in args)]
    assert_one_line_error(*main_error(capsys, *args), *fragments)
    assert os.listdir(bad_inputs["not_checkpoint"]) == ["notes.txt"]


def test_unwritable_save_path_ends_in_one_line(capsys, monkeypatch, tmp_path):
    import patch_hf_model

    monkeypatch.setattr(sys, "argv", [SCRIPT])
    writable = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else writable(p, mode))
    assert_one_line_error(*main_error(capsys, "--save", str(tmp_path / "new" / "out")),
                          f"--save: '{tmp_path}' is not writable")


def test_truncated_gguf_ends_in_one_line(capsys, monkeypatch, tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.truncate(path, os.path.getsize(path) - 4096)
    monkeypatch.setattr(sys, "argv", [SCRIPT])
    for extra in ([], ["--keep-gguf-quantization"]):
        code, err, out = main_error(capsys, "--device", "cpu", "--model", str(path), *extra)
        # The file is read when the model loads, after the run's header line on stdout.
        assert_one_line_error(code, err, "", f"--model: {path} is not a readable GGUF file (truncated or corrupted?)")
        assert out.startswith("torch_marlin ") and "quantized" not in out


def test_perplexity_needs_two_tokens():
    import evaluation

    logits = torch.randn(3, 10)
    ids = torch.tensor([1, 2, 3])
    expected = torch.exp(torch.nn.functional.cross_entropy(logits[:2], ids[1:]))
    assert evaluation.perplexity(ids, logits) == pytest.approx(float(expected))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        evaluation.perplexity(ids[:1], logits[:1])


@pytest.mark.parametrize("args, fragment", [
    (["--blocks", "0"], "argument --blocks: must be positive, got 0"),
    (["--hidden", "1000"], "--group-size 128 must be a multiple of 8 dividing --hidden 1000"),
    (["--group-size", "12"], "--group-size 12 must be a multiple of 8"),
])
def test_quantize_demo_bad_arguments_end_in_one_line(capsys, args, fragment):
    import quantize_demo

    with pytest.raises(SystemExit) as e:
        quantize_demo.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and fragment in err[-1], err
