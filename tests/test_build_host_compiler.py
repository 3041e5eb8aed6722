"""The CUDA build's host-compiler choice (csrc/cuda/host_compiler.py) with the compiler probe and
``which`` faked: g++-12 over a default g++ 13+, a one-line warning naming the fix when g++-12 is
missing or CXX names a g++ 13+, nothing when CXX names another compiler, the default is older or
clang, or the platform is not Linux.
The real probe runs against this machine's compilers. No GPU needed."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "cuda"))

import host_compiler  # noqa: E402


def which_of(*present):
    return lambda name: f"/usr/bin/{name}" if name in present else None


def choose(environ=None, platform="linux", major=13, present=("g++-12", "gcc-12"), **kwargs):
    return host_compiler.choose_host_compiler(environ or {}, platform, probe=lambda cxx: major,
                                              which=which_of(*present), **kwargs)


def test_gxx13_default_with_gxx12_installed_builds_with_gxx12():
    env, msg = choose(major=13)
    assert env == {"CC": "gcc-12", "CXX": "g++-12"}
    assert msg.startswith("torch_marlin: building with g++-12") and "g++ 13" in msg and "\n" not in msg


@pytest.mark.parametrize("major", [13, 14])
def test_gxx13_default_without_gxx12_warns_what_to_do(major):
    env, msg = choose(major=major, present=())
    assert env == {}
    assert msg.startswith("torch_marlin: warning:") and f"g++ {major}" in msg and "\n" not in msg
    assert "install g++-12" in msg and "CXX=g++-12" in msg


def test_a_chosen_gxx13_is_kept_with_a_warning():
    env, msg = choose(environ={"CXX": "/opt/gcc/bin/g++"}, major=13)
    assert env == {}
    assert msg.startswith("torch_marlin: warning: CXX=/opt/gcc/bin/g++ is g++ 13") and "\n" not in msg
    assert "CXX=g++-12 CC=gcc-12" in msg


def test_the_check_scripts_replace_a_chosen_gxx13():
    env, msg = choose(environ={"CXX": "/opt/gcc/bin/g++"}, major=13, replace_chosen=True)
    assert env == {"CC": "gcc-12", "CXX": "g++-12"}
    assert msg.startswith("torch_marlin: building with g++-12, not CXX=/opt/gcc/bin/g++ (g++ 13)")
    # Without g++-12 they keep it, with the warning; a compiler that is not g++ 13+ is left alone.
    assert choose(environ={"CXX": "g++"}, major=13, present=(), replace_chosen=True)[0] == {}
    assert choose(environ={"CXX": "g++-12"}, major=12, replace_chosen=True) == ({}, None)


def test_the_command_line_prints_the_exports(tmp_path):
    # Fake compilers on PATH: a g++ 13 named by CXX, and g++-12 / gcc-12.
    for name, major in (("g++-13", 13), ("g++-12", 12), ("gcc-12", 12)):
        f = tmp_path / name
        f.write_text(f"#!/bin/sh\necho '#define __GNUC__ {major}'\n")
        f.chmod(0o755)
    env = dict(os.environ, CXX=str(tmp_path / "g++-13"), PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "csrc", "cuda", "host_compiler.py")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines() == ["export CC=gcc-12", "export CXX=g++-12"]
    assert "building with g++-12" in r.stderr


@pytest.mark.parametrize("kwargs", [
    dict(environ={"CXX": "clang++"}, major=None),  # the user chose
    dict(environ={"CXX": "g++-12"}, major=12),
    dict(major=12),                    # a compiler whose builds raise
    dict(major=11),
    dict(major=None),                  # clang or no working c++
    dict(platform="darwin"),
    dict(platform="win32"),
])
def test_no_change_otherwise(kwargs):
    assert choose(**kwargs) == ({}, None)


def test_probe_reads_the_real_compiler():
    if shutil.which("c++") is None:
        pytest.skip("no c++ on this machine")
    out = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout
    major = host_compiler.gcc_major("c++")
    if "clang" in out.lower():
        assert major is None
    else:
        assert major is not None and str(major) in out


def test_probe_of_a_missing_compiler_is_none():
    assert host_compiler.gcc_major("/nonexistent/g++") is None
