"""The macOS build steps (csrc/mps/build_metal.py, csrc/mps/embed_metal.py) run on Linux against
stand-ins: an ``xcrun`` script on PATH that logs its arguments and writes marker files, and
compiler scripts that pass or fail the MPS probe. Checked: one metal + one metallib command per
.metal file with -std=metal3.1 and the project include dir (-Werror only in the developer check), one library per file named
after its source hash, exactly one warning line and no library when the ``metal`` tool is missing,
a failing file leaving the others built, TORCH_MARLIN_NO_MPS=1 building no MPS sources, a failed
probe saying in one line that the MPS backend was not built and why. Also: the kernel -> file
table the MPS backend reads agrees with the kernels the Metal-on-CPU harness registers, and the
harness executor's includes satisfy macOS's <ucontext.h>. < 10 s once the harness is built."""

import json
import os
import re
import stat
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "mps"))

import build_metal  # noqa: E402
import embed_metal  # noqa: E402

METAL_DIR = os.path.join(ROOT, "metal")
INCLUDE_DIR = os.path.join(ROOT, "csrc", "include")

FAKE_XCRUN = r'''#!/usr/bin/env python3
# Stand-in for Apple's xcrun: logs argv, honours FAKE_XCRUN_NO_METAL / FAKE_XCRUN_FAIL.
import json, os, re, sys
args = sys.argv[1:]
with open(os.environ["FAKE_XCRUN_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
assert args[:2] == ["-sdk", "macosx"], args
tool, rest = args[2], args[3:]
if tool == "metal":
    if os.environ.get("FAKE_XCRUN_NO_METAL"):
        sys.stderr.write('xcrun: error: unable to find utility "metal", not a developer tool or in PATH\n')
        sys.exit(72)
    if rest == ["--version"]:
        print("Apple metal version 0 (stand-in)")
        sys.exit(0)
    src, air = rest[rest.index("-c") + 1], rest[rest.index("-o") + 1]
    includes = [rest[i + 1] for i, a in enumerate(rest) if a == "-I"]
    if os.path.basename(src) in os.environ.get("FAKE_XCRUN_FAIL", "").split(","):
        sys.stderr.write(src + ":1:1: error: planted failure\n1 error generated.\n")
        sys.exit(1)
    for inc in re.findall(r'#include "([^"]+)"', open(src).read()):
        if not any(os.path.exists(os.path.join(d, inc)) for d in includes):
            sys.stderr.write(src + ": fatal error: '" + inc + "' file not found\n")
            sys.exit(1)
    open(air, "w").write("AIR " + src)
elif tool == "metallib":
    air, out = rest[0], rest[rest.index("-o") + 1]
    open(out, "w").write("METALLIB " + open(air).read())
else:
    sys.exit("unknown tool " + tool)
'''


def _script(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


@pytest.fixture
def xcrun(tmp_path, monkeypatch):
    """PATH gets a stand-in xcrun; returns a function giving the logged argument lists."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "xcrun", FAKE_XCRUN)
    log = tmp_path / "xcrun.log"
    log.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(log))
    monkeypatch.delenv("FAKE_XCRUN_NO_METAL", raising=False)
    monkeypatch.delenv("FAKE_XCRUN_FAIL", raising=False)
    return lambda: [json.loads(l) for l in log.read_text().splitlines()]


def _stderr_lines(capsys):
    return [l for l in capsys.readouterr().err.splitlines() if l.strip()]


def test_compile_commands():
    metal, metallib = build_metal.metal_compile_commands("metal/decode.metal", "csrc/include", "d.air", "d.metallib")
    assert metal[:4] == ["xcrun", "-sdk", "macosx", "metal"]
    for flag in ("-std=metal3.1", "-mmacosx-version-min=14.0", "-fno-fast-math"):
        assert flag in metal, flag
    # A user's build survives a newer Xcode's new warning; the developer check does not.
    assert "-Werror" not in metal
    strict, _ = build_metal.metal_compile_commands("metal/decode.metal", "csrc/include", "d.air", "d.metallib",
                                                   werror=True)
    assert "-Werror" in strict and strict[-4:] == metal[-4:]
    assert metal[metal.index("-I") + 1] == "csrc/include"
    assert metal[-4:] == ["-c", "metal/decode.metal", "-o", "d.air"]
    assert metallib == ["xcrun", "-sdk", "macosx", "metallib", "d.air", "-o", "d.metallib"]


def test_one_metallib_per_file(xcrun, tmp_path, capsys):
    out = tmp_path / "metallib"
    out.mkdir()
    (out / "decode-0000000000000000.metallib").write_text("from other sources")
    built = build_metal.build_metallibs(METAL_DIR, INCLUDE_DIR, str(out))
    assert _stderr_lines(capsys) == []
    sources = embed_metal.library_sources(METAL_DIR, INCLUDE_DIR)
    expected = sorted(embed_metal.metallib_name(n, s) for n, s in sources.items())
    assert sorted(os.path.basename(p) for p in built) == expected
    assert sorted(os.listdir(out)) == expected, "the library of other sources must be gone"
    for name in sources:
        lib = out / embed_metal.metallib_name(name, sources[name])
        assert lib.read_text() == f"METALLIB AIR {os.path.join(METAL_DIR, name)}"
    calls = xcrun()
    assert calls[0] == ["-sdk", "macosx", "metal", "--version"]
    compiles = [c for c in calls[1:] if c[2] == "metal"]
    links = [c for c in calls[1:] if c[2] == "metallib"]
    assert sorted(c[c.index("-c") + 1] for c in compiles) == sorted(os.path.join(METAL_DIR, n) for n in sources)
    assert len(links) == len(sources)
    for c in compiles:
        assert "-std=metal3.1" in c and "-Werror" not in c and c[c.index("-I") + 1] == INCLUDE_DIR


def test_metallib_names_follow_the_source():
    a = embed_metal.metallib_name("decode.metal", "kernel void f() {}\n")
    b = embed_metal.metallib_name("decode.metal", "kernel void g() {}\n")
    assert re.fullmatch(r"decode-[0-9a-f]{16}\.metallib", a) and a != b


@pytest.mark.parametrize("how", ["metal tool missing", "no xcrun at all"])
def test_missing_metal_tool_falls_back_with_one_line(xcrun, tmp_path, monkeypatch, capsys, how):
    if how == "metal tool missing":
        monkeypatch.setenv("FAKE_XCRUN_NO_METAL", "1")
    else:
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "metallib"
    out.mkdir()
    (out / "decode-0000000000000000.metallib").write_text("stale")
    assert build_metal.build_metallibs(METAL_DIR, INCLUDE_DIR, str(out)) == []
    lines = _stderr_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("torch_marlin: ") and "run time" in lines[0]
    assert ("unable to find utility" in lines[0]) == (how == "metal tool missing"), lines[0]
    assert os.listdir(out) == [], "a library left from an earlier build must not be loaded"
    if how == "metal tool missing":
        assert xcrun() == [["-sdk", "macosx", "metal", "--version"]]


def test_failing_file_leaves_the_others(xcrun, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_XCRUN_FAIL", "decode.metal")
    built = build_metal.build_metallibs(METAL_DIR, INCLUDE_DIR, str(tmp_path / "metallib"))
    names = [os.path.basename(p).split("-")[0] for p in built]
    assert "decode" not in names
    assert sorted(names) == sorted(os.path.splitext(n)[0] for n in embed_metal.library_sources(METAL_DIR, INCLUDE_DIR)
                                   if n != "decode.metal")
    lines = _stderr_lines(capsys)
    assert len(lines) == 1 and "metal/decode.metal" in lines[0] and "planted failure" in lines[0], lines


def test_developer_check_fails_naming_the_file_with_its_log(xcrun, tmp_path, monkeypatch, capsys):
    assert build_metal.check_metallibs(METAL_DIR, INCLUDE_DIR, str(tmp_path / "ok")) == 0
    assert all("-Werror" in c for c in xcrun() if c[2] == "metal" and c[3] != "--version")
    capsys.readouterr()
    monkeypatch.setenv("FAKE_XCRUN_FAIL", "decode.metal")
    assert build_metal.check_metallibs(METAL_DIR, INCLUDE_DIR, str(tmp_path / "bad")) == 1
    err = capsys.readouterr().err
    assert "==== metal/decode.metal did not build with -Werror:" in err
    assert "1 error generated." in err, "the whole compiler log, not only its first error line"
    n = len(embed_metal.metal_files(METAL_DIR))
    assert f"{n - 1} of {n} Metal libraries built" in err
    monkeypatch.setenv("FAKE_XCRUN_NO_METAL", "1")
    assert build_metal.check_metallibs(METAL_DIR, INCLUDE_DIR, str(tmp_path / "none")) == 1


def test_arch_flags_on_apple_silicon_only():
    assert build_metal.arch_flags({}, "darwin", "arm64") == "-arch arm64"
    assert build_metal.arch_flags({"ARCHFLAGS": "-arch x86_64"}, "darwin", "arm64") is None
    assert build_metal.arch_flags({}, "darwin", "x86_64") is None
    assert build_metal.arch_flags({}, "linux", "aarch64") is None


def test_stand_in_needs_the_include_dir(xcrun, tmp_path, monkeypatch, capsys):
    # The stand-in resolves #include "torch_marlin/..." through the -I dirs: without the project's
    # include dir on the command every file fails, so the builds that pass above do pass it.
    commands = build_metal.metal_compile_commands

    def without_include(src, include_dir, air, metallib, werror=False):
        metal, metallib_cmd = commands(src, include_dir, air, metallib, werror)
        i = metal.index("-I")
        return [metal[:i] + metal[i + 2:], metallib_cmd]

    monkeypatch.setattr(build_metal, "metal_compile_commands", without_include)
    built = build_metal.build_metallibs(METAL_DIR, INCLUDE_DIR, str(tmp_path / "metallib"))
    lines = _stderr_lines(capsys)
    assert built == [] and len(lines) == len(embed_metal.metal_files(METAL_DIR))
    assert all("file not found" in l for l in lines), lines


def test_install_metallibs(tmp_path):
    built_dir, dest = tmp_path / "build", tmp_path / "pkg" / "metallib"
    built_dir.mkdir()
    dest.mkdir(parents=True)
    (dest / "old-0000000000000000.metallib").write_text("old")
    (dest / "README").write_text("kept")
    built = []
    for n in ("a-1111111111111111.metallib", "b-2222222222222222.metallib"):
        (built_dir / n).write_text(n)
        built.append(str(built_dir / n))
    installed = build_metal.install_metallibs(built, str(dest))
    assert sorted(os.listdir(dest)) == ["README", "a-1111111111111111.metallib", "b-2222222222222222.metallib"]
    assert [os.path.basename(p) for p in installed] == ["a-1111111111111111.metallib", "b-2222222222222222.metallib"]
    assert (dest / "a-1111111111111111.metallib").read_text() == "a-1111111111111111.metallib"


# ---- whether the MPS sources are built --------------------------------------------------------

def _must_not_probe():
    raise AssertionError("the probe must not run")


def test_no_mps_env_builds_no_mps_sources(capsys):
    assert build_metal.mps_build(ROOT, platform="darwin", environ={"TORCH_MARLIN_NO_MPS": "1"},
                                 probe=_must_not_probe) is None
    assert _stderr_lines(capsys) == []


def test_not_macos_builds_no_mps_sources(capsys):
    assert build_metal.mps_build(ROOT, platform="linux", environ={}, probe=_must_not_probe) is None
    assert _stderr_lines(capsys) == []


def test_macos_builds_every_mps_source(capsys):
    mps = build_metal.mps_build(ROOT, platform="darwin", environ={}, probe=lambda: None)
    assert _stderr_lines(capsys) == []
    expected = sorted(os.path.join("csrc", "mps", f) for f in os.listdir(os.path.join(ROOT, "csrc", "mps"))
                      if f.endswith(".mm"))
    assert mps["sources"] == expected and expected
    assert ("TM_WITH_MPS", "1") in mps["define_macros"]
    assert mps["extra_link_args"] == ["-framework", "Metal", "-framework", "Foundation", "-framework", "IOKit"]
    header = os.path.join(mps["include_dirs"][0], build_metal.GENERATED_HEADER)
    assert os.path.exists(header)
    assert '#include "metal_library_sources.h"' in open(os.path.join(ROOT, "csrc", "mps", "mps_encoder.mm")).read()


def test_failed_probe_says_so_in_one_line(tmp_path, capsys):
    cxx = _script(tmp_path / "cxx", "#!/bin/sh\necho \"probe.mm:1:9: fatal error: 'Metal/Metal.h' file not found\" >&2\n"
                  "echo '1 error generated.' >&2\nexit 1\n")
    torch_inc = tmp_path / "include"
    (torch_inc / "ATen" / "mps").mkdir(parents=True)
    (torch_inc / "ATen" / "mps" / "MPSStream.h").write_text("")
    probe = lambda: build_metal.probe_mps([cxx], [str(torch_inc)], torch_has_mps=True)  # noqa: E731
    assert build_metal.mps_build(ROOT, platform="darwin", environ={}, probe=probe) is None
    lines = _stderr_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("torch_marlin: the MPS backend was not built: ")
    assert "'Metal/Metal.h' file not found" in lines[0] and "TORCH_MARLIN_NO_MPS=1" in lines[0]


def test_probe_reasons(tmp_path):
    ok = _script(tmp_path / "ok", "#!/bin/sh\nexit 0\n")
    torch_inc = tmp_path / "include"
    torch_inc.mkdir()
    assert "without MPS" in build_metal.probe_mps([ok], [str(torch_inc)], torch_has_mps=False)
    assert "MPSStream.h" in build_metal.probe_mps([ok], [str(torch_inc)], torch_has_mps=True)
    (torch_inc / "ATen" / "mps").mkdir(parents=True)
    (torch_inc / "ATen" / "mps" / "MPSStream.h").write_text("")
    assert build_metal.probe_mps([ok], [str(torch_inc)], torch_has_mps=True) is None
    missing = str(tmp_path / "no-such-compiler")
    assert "not found" in build_metal.probe_mps([missing], [str(torch_inc)], torch_has_mps=True)


# ---- the kernel -> file table ---------------------------------------------------------------------

def _registered(mod):
    return {n for n in mod.kernel_names() if not n.startswith("barrier_switch:")}


def test_kernel_table_matches_the_harness():
    """Every kernel the harness registers from a .metal file is in the table under that file, and
    nothing else is; a kernel needs MSL 3.1 exactly when it is a bfloat instantiation."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import metal_emu
    import trellis_metal_emu

    table = embed_metal.kernel_files(METAL_DIR, INCLUDE_DIR)
    by_file = {}
    for kernel, name, version in table:
        by_file.setdefault(name, set()).add(kernel)
        assert (version == 310) == ("bfloat" in kernel), (kernel, version)
    # The executor's own test kernels (not a product file) register under names of their own.
    selftest = set(re.findall(r'TM_INSTANTIATE_PLAIN\("([^"]+)"', open(metal_emu.SELFTEST_SOURCE).read()))
    assert selftest
    quant = set().union(*(by_file[os.path.basename(p)] for p in metal_emu.QUANT_SOURCES))
    assert _registered(metal_emu.load()) == quant | selftest
    trellis = set().union(*(by_file[os.path.basename(p)] for p in trellis_metal_emu.SOURCES))
    assert _registered(trellis_metal_emu.load()) == trellis
    assert set(by_file) == {os.path.basename(p) for p in metal_emu.QUANT_SOURCES + trellis_metal_emu.SOURCES}


def test_duplicate_kernel_name_is_refused(tmp_path):
    for n in ("a.metal", "b.metal"):
        (tmp_path / n).write_text('#include <metal_stdlib>\nTM_INSTANTIATE("same_" "name", f<half>)\n')
    with pytest.raises(ValueError, match="same_name"):
        embed_metal.kernel_files(str(tmp_path), INCLUDE_DIR)


# ---- the harness executor on macOS ----------------------------------------------------------------

RUNTIME = os.path.join(ROOT, "csrc", "metal_emu", "runtime.cpp")
_SYSTEM_INCLUDE = re.compile(r"^\s*#\s*include\s*<([^>]+)>", re.MULTILINE)


def _preprocess_as_macos(source, tmp_path):
    """``c++ -E -D__APPLE__`` of ``source`` over stand-ins of every system header it reaches: like
    macOS, <ucontext.h> is an #error unless _XOPEN_SOURCE was defined before the first system
    header. Returns the completed process."""
    stubs = tmp_path / "stubs"
    first = textwrap.dedent("""\
        #ifndef TM_STUB_FIRST_SYSTEM_HEADER
        #define TM_STUB_FIRST_SYSTEM_HEADER
        #ifndef _XOPEN_SOURCE
        #define TM_STUB_NO_XOPEN_AT_FIRST_HEADER
        #endif
        #endif
        """)
    emu = os.path.join(ROOT, "csrc", "metal_emu")
    headers = set()
    for path in (source, os.path.join(emu, "runtime.h"), os.path.join(emu, "metal_stdlib")):
        headers |= set(_SYSTEM_INCLUDE.findall(open(path).read()))
    for h in headers:
        p = stubs / h
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(first)
    (stubs / "ucontext.h").write_text(first + "#ifdef TM_STUB_NO_XOPEN_AT_FIRST_HEADER\n"
                                      "#error The deprecated ucontext routines require _XOPEN_SOURCE to be defined\n"
                                      "#endif\n")
    return subprocess.run(["c++", "-E", "-x", "c++", "-nostdinc", "-D__APPLE__", "-I", str(stubs), "-I", emu, source],
                          capture_output=True, text=True)


def test_harness_runtime_includes_on_macos(tmp_path):
    r = _preprocess_as_macos(RUNTIME, tmp_path)
    assert r.returncode == 0, r.stderr
    # The stand-ins have teeth: without the _XOPEN_SOURCE definition the same run fails.
    bare = tmp_path / "runtime_without_xopen.cpp"
    text = open(RUNTIME).read()
    assert "#define _XOPEN_SOURCE" in text
    bare.write_text(text.replace("#define _XOPEN_SOURCE", "#define TM_NOT_XOPEN_SOURCE"))
    r = _preprocess_as_macos(str(bare), tmp_path)
    assert r.returncode != 0 and "require _XOPEN_SOURCE" in r.stderr, r.stderr
