"""scripts/bench_e2e.py runs end to end on the CPU with a tiny Llama shape and prints its table."""

import os
import subprocess
import sys

from optional_packages import require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_e2e.py")


def test_tiny_run_on_cpu_prints_the_table():
    require("transformers")
    args = ["--device", "cpu", "--layers", "1", "--hidden", "128", "--intermediate", "256", "--heads", "4",
            "--kv-heads", "2", "--vocab", "256", "--prompt", "2", "--new-tokens", "2", "--batch", "1,2",
            "--formats", "float,u4,no_linear", "--group-size", "64", "--fuse", "--modes", "eager,graph,compile"]
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| format"))
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[head + 2:] if line.startswith("|")]
    # float32 (the CPU's dtype), u4 and the model without its linear layers' work, each at batch 1
    # and 2, eager only: neither graph mode runs on the CPU.
    assert [(r[0], r[1], r[2]) for r in rows] == [(f, "eager", b) for f in ("float32", "u4", "no_linear")
                                                  for b in ("1", "2")]
    for row in rows:
        prefill_ms, tok_s, floor = float(row[3]), float(row[4]), float(row[5])
        assert prefill_ms > 0 and tok_s > 0 and floor > 0
    mib = {row[0]: float(row[7]) for row in rows}
    assert mib["u4"] < mib["float32"]  # 4-bit layers read less
    assert mib["no_linear"] < mib["u4"]  # the decoder layers' linear weights are gone
    assert "note: graph: no graph mode on cpu" in lines and "note: compile: no compile mode on cpu" in lines
