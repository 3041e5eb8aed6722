"""``python -m torch_marlin.selfcheck`` on the CPU: every row passes, every op and CPU kernel family runs,
the benchmark tables hold positive numbers; a corrupted op fails the check; an op whose native kernel
raises NotImplementedError on a fallback device shows as FALLBACK rows and in the paths table (what a
Mac whose Metal library did not compile prints); bfloat16 is skipped on macOS 13's mps; the GPU core
count is read from the IOKit registry's output; a missing device is a usage error."""

import json
import os
import subprocess
import sys

import types
import warnings

import pytest
import torch

from torch_marlin import metal_fallback, ops, selfcheck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cpu_quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("selfcheck") / "result.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "torch_marlin.selfcheck", "--device", "cpu", "--quick",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_cpu_quick_passes(cpu_quick):
    proc, result = cpu_quick
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = result["correctness"]
    assert rows and all(r["status"] == "PASS" for r in rows)
    assert result["failures"] == 0
    assert "selfcheck: PASS" in proc.stdout
    assert result["header"]["device"] == "cpu" and result["header"]["caps"]["backend"] == "cpu"


def test_cpu_quick_covers_every_op_and_family(cpu_quick):
    rows = cpu_quick[1]["correctness"]
    ops_run = {r["op"] for r in rows}
    assert ops_run == {"gemm_fp4", "gemm_u4", "gemm_affine", "dequant_fp4", "dequant_u4", "dequant_affine",
                       "gemm_trellis", "dequant_trellis", "moe_trellis", "gemm_rans", "rans_decode"}
    assert ops_run == set(metal_fallback.TORCH_PATHS), "every op with a fallback has a row"
    for op in ("gemm_fp4", "gemm_u4", "gemm_affine", "gemm_trellis", "moe_trellis"):
        for dtype in ("float16", "bfloat16", "float32"):
            families = {r["family"] for r in rows if r["op"] == op and r["dtype"] == dtype}
            assert families == {"decode", "dequant_blas"}, (op, dtype, families)
    for dtype in ("float16", "bfloat16", "float32"):
        families = {r["family"] for r in rows if r["op"] == "gemm_rans" and r["dtype"] == dtype}
        assert families == {"decode", "staged/dequant_blas"}, (dtype, families)
    assert all(r["path"] == "native" for r in rows)
    assert {p["op"] for p in cpu_quick[1]["paths"]} == ops_run
    assert all(p["fallback"] == "-" for p in cpu_quick[1]["paths"])
    kernels = {r["kernel"] for r in rows}
    assert {"cpu_trellis_prefill", "cpu_dequant_blas"} <= kernels
    assert kernels & {"cpu_trellis_decode", "cpu_trellis_decode_avx2", "cpu_trellis_decode_avx512"}


def test_cpu_quick_benchmark_tables(cpu_quick):
    result = cpu_quick[1]
    shapes = {(K * 4, N * 4) for K, N in ((r["K"], r["N"]) for r in result["bandwidth"])}
    assert shapes == set(selfcheck.LLAMA3_8B_SHAPES)
    assert {r["format"] for r in result["bandwidth"]} == {"fp4 g128", "u4 g128"}
    assert result["bandwidth_reference"]["gbps"] > 0
    for r in result["bandwidth"]:
        assert r["gbps"] > 0 and r["fraction"] > 0 and r["copies"] >= 1
    assert result["prefill"]
    for r in result["prefill"]:
        assert r["ours_ms"] > 0 and r["matmul_ms"] > 0 and r["ratio"] > 0
    assert "bandwidth at M = 1" in cpu_quick[0].stdout and "prefill" in cpu_quick[0].stdout


def test_planted_mismatch_fails(monkeypatch, capsys, tmp_path):
    real = ops.gemm_fp4

    def corrupted_gemm_fp4(A, B, scales, group_size, bias=None):
        out = real(A, B, scales, group_size, bias)
        out[..., -1] += 1.0  # one column wrong
        return out

    monkeypatch.setattr(ops, "gemm_fp4", corrupted_gemm_fp4)
    out_file = tmp_path / "r.json"
    status = selfcheck.main(["--device", "cpu", "--quick", "--no-bench", "--json", str(out_file)])
    assert status == 1
    rows = json.loads(out_file.read_text())["correctness"]
    failed = [r for r in rows if r["status"] == "FAIL"]
    assert failed and all(r["op"] == "gemm_fp4" for r in failed)
    assert all(r["status"] == "PASS" for r in rows if r["op"] != "gemm_fp4")
    text = capsys.readouterr().out
    assert "FAIL     gemm_fp4" in text and "selfcheck: FAIL" in text


def test_fallback_rows_are_reported(monkeypatch, capsys, tmp_path):
    # What a Mac prints when metal/trellis_gemm.metal does not compile: the op's native kernel raises
    # NotImplementedError with the compiler's log, the plain-torch path answers, the row says so.
    lib = torch.library.Library("marlin", "IMPL")

    def broken(*args):
        raise NotImplementedError("torch_marlin: Metal kernel 'gemm_trellis_half' is unavailable: "
                                  "metal/trellis_gemm.metal did not load: compiling its source failed:\nerror: planted")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("gemm_trellis", broken, "CPU")
        monkeypatch.setattr(metal_fallback, "FALLBACK_DEVICES", ("mps", "cpu"))
        monkeypatch.setattr(metal_fallback, "_unavailable", {})
        out_file = tmp_path / "r.json"
        try:
            status = selfcheck.main(["--device", "cpu", "--quick", "--no-bench", "--json", str(out_file)])
        finally:
            lib._destroy()
    assert status == 1
    result = json.loads(out_file.read_text())
    trellis = [r for r in result["correctness"] if r["op"] == "gemm_trellis"]
    assert trellis and all(r["status"] == "FALLBACK" and r["path"] == "fallback" for r in trellis)
    assert all("metal/trellis_gemm.metal" in r["fallback_reason"] for r in trellis)
    assert all(r["status"] == "PASS" for r in result["correctness"] if r["op"] != "gemm_trellis")
    path = next(p for p in result["paths"] if p["op"] == "gemm_trellis")
    assert path["native"] == "-" and path["fallback"] == "decode, dequant_blas"
    assert "metal/trellis_gemm.metal" in path["reason"]
    text = capsys.readouterr().out
    assert "FALLBACK gemm_trellis" in text and "error: planted" in text  # the full native error
    assert "selfcheck: FAIL" in text and "plain-torch fallback" in text and "open an issue" in text


def test_bfloat16_skipped_on_macos_13(monkeypatch):
    monkeypatch.setattr(selfcheck, "macos_version", lambda: (13, 6))
    assert list(selfcheck.skipped_dtypes("mps")) == [torch.bfloat16]
    assert "macOS 14" in selfcheck.skipped_dtypes("mps")[torch.bfloat16]
    assert selfcheck.skipped_dtypes("cpu") == {}
    monkeypatch.setattr(selfcheck, "macos_version", lambda: (14, 0))
    assert selfcheck.skipped_dtypes("mps") == {}


def test_gpu_cores_from_the_registry(monkeypatch):
    ioreg = ('+-o AGXAcceleratorG15X  <class AGXAcceleratorG15X, id 0x1000003b6, registered>\n'
             '    {\n      "gpu-core-count" = 30\n      "model" = "Apple M3 Max"\n    }\n')
    monkeypatch.setattr(selfcheck.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(selfcheck.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=ioreg))
    assert selfcheck.registry_gpu_cores() == 30
    # A binned M3 Max is rated by its core count, not its name.
    assert selfcheck.apple_rated_gbps("Apple M3 Max", 30) == 300
    assert selfcheck.apple_rated_gbps("Apple M3 Max", 40) == 400
    monkeypatch.setattr(selfcheck.subprocess, "run", lambda *a, **k: types.SimpleNamespace(stdout=""))
    assert selfcheck.registry_gpu_cores() is None


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an Apple GPU")
def test_missing_device_is_a_usage_error(capsys):
    assert selfcheck.main(["--device", "mps", "--no-bench"]) == 2
    err = capsys.readouterr().err
    assert "--device mps" in err and "no mps device" in err


def test_bad_option_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        selfcheck.main(["--device", "tpu"])
    assert e.value.code == 2
