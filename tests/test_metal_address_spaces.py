"""metal/*.metal type-checks with MSL address spaces kept apart, and the check rejects injected
device/threadgroup/thread pointer mix-ups (scripts/check_metal_address_spaces.sh). Needs clang
(CI installs the Debian package `clang`); < 2 s."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "check_metal_address_spaces.sh")
HAVE_CLANG = any(shutil.which(c) for c in ["clang++"] + [f"clang++-{v}" for v in range(14, 20)])


@pytest.mark.skipif(not HAVE_CLANG, reason="clang++ not installed (apt-get install -y clang)")
def test_address_spaces_and_self_test():
    r = subprocess.run(["bash", SCRIPT, "--self-test"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "address spaces OK: metal/quant_gemm.metal" in r.stdout
    assert r.stdout.count("self-test OK: mix-up rejected") >= 4
