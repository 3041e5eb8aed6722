"""csrc/mps/*.mm type-check as Objective-C++ against torch's ATen/mps headers and declarations of
Apple's API written from its documentation, and the check rejects planted mistakes (misspelled
selector or property, arguments of the wrong type, a dropped SDK guard); the files that guard
declarations by SDK version compile against the macOS 13 SDK's declarations too:
scripts/dev/check_objcxx_syntax.sh. Needs clang (CI installs the Debian package `clang`); about
45 s of CPU (ATen parsed once per SDK version into a precompiled header, then seven checks)."""

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
    guarded = [p for p in sources if "__MAC_OS_X_VERSION_MAX_ALLOWED" in open(p).read()]
    assert guarded, "the SDK guards (csrc/mps/mps_encoder.mm) are gone"
    for path in guarded:
        assert f"objective-c++ OK (macOS 13 SDK): {os.path.relpath(path, ROOT)}" in r.stdout, r.stdout
    assert r.stdout.count("self-test OK: mistake rejected") == 9, r.stdout
    assert "self-test OK: SDK guard removal rejected (macOS 13 SDK)" in r.stdout, r.stdout
    assert "FAILED" not in r.stdout + r.stderr
