"""scripts/bench_e2e.py runs end to end on the CPU with a tiny Llama shape and prints its table and,
with --profile, each run's decode step broken down (scripts/step_profile.py)."""

import os
import re
import subprocess
import sys

from optional_packages import require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_e2e.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_tiny_run_on_cpu_prints_the_table_and_the_step_profile():
    require("transformers")
    args = ["--device", "cpu", "--layers", "2", "--hidden", "128", "--intermediate", "256", "--heads", "4",
            "--kv-heads", "2", "--vocab", "256", "--prompt", "2", "--new-tokens", "8", "--batch", "1,2",
            "--formats", "float,u4,no_linear", "--group-size", "64", "--fuse", "--modes", "eager,graph,compile",
            "--profile", "--profile-steps", "2"]
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| format"))
    end = next(i for i in range(head + 2, len(lines)) if not lines[i].startswith("|"))
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[head + 2:end]]
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

    profiles = profile_tables(lines)
    assert sorted(profiles) == sorted(f"{f} eager batch {b}" for f in ("float32", "u4 fused", "no_linear")
                                      for b in (1, 2))
    fused = profiles["u4 fused eager batch 2"]
    # Every linear layer of the step, by layer and shape: 2 layers' fused q/k/v (128 + 2 x 64 kv
    # columns), o, fused gate/up, down; lm_head in float.
    assert fused["gemms"] == {("qkv_proj u4", "128x256"): 2, ("o_proj u4", "128x128"): 2,
                              ("gate_up_proj u4", "128x512"): 2, ("down_proj u4", "256x128"): 2,
                              ("lm_head float32", "128x256"): 1}
    assert profiles["float32 eager batch 1"]["gemms"][("k_proj float32", "128x64")] == 2
    assert not profiles["no_linear eager batch 1"]["gemms"] or \
        set(profiles["no_linear eager batch 1"]["gemms"]) == {("lm_head float32", "128x256")}
    for name, p in profiles.items():
        assert all(us > 0 for us in p["in_model"] + p["alone"]), name
        # The step's kernels are the GEMMs plus the other kernels (rounded to 0.1 us each).
        assert abs(p["kernels"] - p["gemm_total"] - p["other_total"]) <= 0.2 + 1e-3 * p["kernels"], name
        assert abs(p["step"] - p["kernels"] - p["idle"]) <= 0.2, name


def profile_tables(lines):
    out = {}
    for i, line in enumerate(lines):
        m = re.match(r"step profile: (.*): ([\d.]+) us a step \(timed run\), kernels ([\d.]+) us .*idle (-?[\d.]+) us",
                     line)
        if not m or m.group(1) in out:  # printed twice: as each run ends and after the table
            continue
        p = {"step": float(m.group(2)), "kernels": float(m.group(3)), "idle": float(m.group(4)), "gemms": {},
             "in_model": [], "alone": []}
        for row in lines[i + 3:]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.split("|")[1:-1]]
            if cells[0] == "GEMMs (all linear layers)":
                p["gemm_total"] = float(cells[6])
            elif cells[0] == "other kernels":
                p["other_total"] = float(cells[6])
            elif cells[1]:  # a layer shape
                p["gemms"][(cells[0], cells[1])] = int(cells[2])
                p["in_model"].append(float(cells[3]))
                p["alone"].append(float(cells[4]))
        out[m.group(1)] = p
    return out


def test_gemm_kernels_are_matched_to_calls_in_order_with_their_helpers():
    from step_profile import Call, Event, Signature, assign

    calls = [Call("l.q_proj", None, "fp4", 1, 64, 64), Call("l.o_proj", None, "fp4", 1, 64, 32)]
    sigs = {calls[0].key: Signature("gemm_a", ("Memset",), 2.0), calls[1].key: Signature("gemm_b", (), 1.0)}
    events = [Event(n, t, 1.0) for t, n in enumerate(["norm", "Memset", "gemm_a", "rope", "gemm_b", "add",
                                                      "Memset", "gemm_a", "gemm_b"])]
    assigned, note = assign(events, calls, sigs, steps=2)
    assert note is None and assigned == [[2, 1], [4], [7, 6], [8]]
    # A GEMM kernel more than calls (another user of the name): totals only, with the reason.
    assigned, note = assign(events + [Event("gemm_b", 99, 1.0)], calls, sigs, steps=2)
    assert assigned is None and "5 GEMM kernels in the trace for 4 linear layer calls" in note
    # Out of order: the first call's kernel is not the one it runs alone.
    swapped = [Event(n, t, 1.0) for t, n in enumerate(["gemm_b", "gemm_a", "gemm_b", "gemm_a"])]
    assigned, note = assign(swapped, calls, sigs, steps=2)
    assert assigned is None and "call 0 (l.q_proj) ran gemm_b" in note


def test_profile_table_names_the_other_kernels_in_full():
    from step_profile import StepProfile, format_profile

    attention = "triton_poi_fused__scaled_dot_product_flash_attention_for_cpu_repeat_kv_0"
    templated = "void at::native::elementwise_kernel<128, 2, " + "x" * 200 + ">"
    p = StepProfile(steps=2, step_us=30.0, kernel_us=27.0,
                    groups=[(("qkv_proj", "fp4", 1, 4096, 6144), 32, 0.5, 0.5)],
                    other=[(attention, 2, 8.0), (templated, 4, 3.0)])
    lines = format_profile("fp4 compile batch 1", p).splitlines()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("| ")]
    parts = [r[0] for r in rows]
    assert attention in parts  # in full: 72 characters, past the 34 a GEMM label needs
    long_row = next(x for x in parts if x.startswith("void at::native::elementwise_kernel"))
    assert long_row.endswith("...") and len(long_row) == 88  # capped with the indent at 90
    assert len({len(line) for line in lines if line.startswith("|")}) == 1  # one column width
    assert rows[-1][0] == "idle, < 0 overlap (step - kernels)" and float(rows[-1][6]) == 3.0
