"""metal/*.metal (each file alone, and the concatenated library) type-checks with MSL address
spaces kept apart, and the check rejects injected device/threadgroup/thread pointer mix-ups
(scripts/dev/check_metal_address_spaces.sh). Needs clang (CI installs the Debian package `clang`);
a few seconds."""

import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "dev", "check_metal_address_spaces.sh")
HAVE_CLANG = any(shutil.which(c) for c in ["clang++"] + [f"clang++-{v}" for v in range(14, 20)])


@pytest.mark.skipif(not HAVE_CLANG, reason="clang++ not installed (apt-get install -y clang)")
def test_address_spaces_and_self_test():
    r = subprocess.run(["bash", SCRIPT, "--self-test"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(glob.glob(os.path.join(ROOT, "metal", "*.metal")))
    assert len(files) >= 8
    for f in files:
        assert f"address spaces OK: metal/{os.path.basename(f)}" in r.stdout
    assert "address spaces OK: the concatenated library" in r.stdout
    assert r.stdout.count("self-test OK: mix-up rejected") >= 6
