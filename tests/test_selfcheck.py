"""``python -m torch_marlin.selfcheck`` on the CPU: every row passes, every CPU kernel family runs, the
benchmark tables hold positive numbers; a corrupted op fails the check; a missing device is a usage
error."""

import json
import os
import subprocess
import sys

import pytest
import torch

from torch_marlin import ops, selfcheck

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
    assert ops_run == {"gemm_fp4", "gemm_u4", "dequant_fp4", "dequant_u4", "gemm_trellis", "dequant_trellis",
                       "moe_trellis"}
    for op in ("gemm_fp4", "gemm_u4", "gemm_trellis", "moe_trellis"):
        for dtype in ("float16", "bfloat16", "float32"):
            families = {r["family"] for r in rows if r["op"] == op and r["dtype"] == dtype}
            assert families == {"decode", "dequant_blas"}, (op, dtype, families)
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
    assert "FAIL  gemm_fp4" in text and "selfcheck: FAIL" in text


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an Apple GPU")
def test_missing_device_is_a_usage_error(capsys):
    assert selfcheck.main(["--device", "mps", "--no-bench"]) == 2
    err = capsys.readouterr().err
    assert "--device mps" in err and "no mps device" in err


def test_bad_option_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        selfcheck.main(["--device", "tpu"])
    assert e.value.code == 2
