"""csrc/mps/*.mm type-check as Objective-C++ against torch's ATen/mps headers and declarations of
Apple's API written from its documentation, and the check rejects planted mistakes (misspelled
selector or property, arguments of the wrong type): scripts/dev/check_objcxx_syntax.sh. Needs
clang (CI installs the Debian package `clang`); about 35 s of CPU (three parses of ATen)."""

import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "dev", "check_objcxx_syntax.sh")
HAVE_CLANG = any(shutil.which(c) for c in ["clang"] + [f"clang-{v}" for v in range(14, 20)])


@pytest.mark.skipif(not HAVE_CLANG, reason="clang not installed (apt-get install -y clang)")
def test_objcxx_syntax_and_self_test():
    r = subprocess.run(["bash", SCRIPT, "--self-test"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "mps", "*.mm")))
    assert sources
    for path in sources:
        assert f"objective-c++ OK: {os.path.relpath(path, ROOT)}" in r.stdout, r.stdout
    assert r.stdout.count("self-test OK: mistake rejected") == 6, r.stdout
    assert "FAILED" not in r.stdout + r.stderr
