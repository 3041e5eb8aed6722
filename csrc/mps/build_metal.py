"""macOS build steps of the MPS backend: whether to build it, and the prebuilt Metal libraries.

setup.py calls these; tests/test_build_metal.py runs them on Linux with stand-in ``xcrun`` and
compiler scripts. Every message is one line on stderr starting with ``torch_marlin:``.

- ``mps_build(...)``: the MPS sources, macros, link flags and generated header for the extension,
  or nothing: not macOS, ``TORCH_MARLIN_NO_MPS=1`` (silently), or a failed probe (one line saying
  that the MPS backend was not built and why).
- ``build_metallibs(...)``: one ``<stem>-<hash>.metallib`` per metal/*.metal file, compiled with
  Apple's toolchain (``xcrun metal -std=metal3.1``, then ``xcrun metallib``) for macOS 14 and
  later. Without the ``metal`` tool (Command Line Tools only, or the Metal toolchain not
  installed) it prints one line and builds nothing: the backend then compiles the embedded
  sources at run time. A file that does not compile gets one line and no library; its kernels are
  compiled at run time, the other files' libraries are unaffected. Warnings do not fail a user's
  build (a newer Xcode's new warning must not drop a library).
- ``python csrc/mps/build_metal.py --check [OUT_DIR]``: the developer check (and the macOS
  workflow's): every file with ``-Werror``, exit status 1 naming each file that did not build,
  with the compiler's log, or when the ``metal`` tool is missing.
- ``arch_flags(...)``: ``ARCHFLAGS`` for the extension build: arm64 only on Apple silicon (a
  universal2 Python would otherwise also compile an x86_64 slice, which torch's arm64-only
  libraries cannot link).
- ``install_metallibs(...)``: mirrors the built libraries into the package folder (in-place
  builds), removing libraries of older sources.

The extension finds the libraries in ``METALLIB_DIR`` beside itself (csrc/mps/mps_encoder.mm).
"""

import glob
import os
import shutil
import subprocess
import sys
import tempfile

import embed_metal

NO_MPS_ENV = "TORCH_MARLIN_NO_MPS"
METALLIB_DIR = "metallib"  # beside the compiled extension, inside the torch_marlin package
MSL_STD = "metal3.1"       # bfloat; the run-time fallback uses 3.0 on macOS 13
METALLIB_MIN_MACOS = "14.0"  # without it the library is tagged with the build machine's macOS
GENERATED_HEADER = "metal_library_sources.h"
XCRUN = ["xcrun", "-sdk", "macosx"]

_PROBE_SOURCE = """\
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
int main() { return MTLSizeMake(1, 1, 1).width == 1 ? 0 : 1; }
"""


def warn(message):
    print(f"torch_marlin: {message}", file=sys.stderr, flush=True)


def _first_error_line(text):
    lines = [l.strip() for l in (text or "").splitlines() if l.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[0] if lines else "no output"


def _run(cmd, run, full_log=None):
    """(ok, first error line) of one command; a missing executable is a failure, not an exception.
    ``full_log``: a list that gets the command's whole output when it fails."""
    try:
        r = run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        return False, f"{cmd[0]} not found"
    if r.returncode != 0:
        output = (r.stderr or "") + "\n" + (r.stdout or "")
        if full_log is not None:
            full_log.append(output.strip())
        return False, _first_error_line(output)
    return True, ""


def arch_flags(environ=os.environ, platform=sys.platform, machine=None):
    """The ``ARCHFLAGS`` value the extension build should use, or None to leave it alone: on an
    arm64 Mac without ``ARCHFLAGS`` set, ``-arch arm64``."""
    machine = machine or os.uname().machine
    if platform != "darwin" or "ARCHFLAGS" in environ or machine != "arm64":
        return None
    return "-arch arm64"


# ---- should the MPS backend be built? ---------------------------------------------------------

def probe_mps(cxx, torch_include_dirs, torch_has_mps, run=subprocess.run):
    """None when the MPS sources can build, else why not (one line): torch without MPS, torch
    headers without ATen/mps, or a compiler that cannot compile Objective-C++ against Metal."""
    if not torch_has_mps:
        return "the installed torch was built without MPS"
    if not any(os.path.exists(os.path.join(d, "ATen", "mps", "MPSStream.h")) for d in torch_include_dirs):
        return "the installed torch ships no ATen/mps/MPSStream.h"
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe.mm")
        with open(probe, "w") as f:
            f.write(_PROBE_SOURCE)
        ok, error = _run(list(cxx) + ["-x", "objective-c++", "-fsyntax-only", probe], run)
    if not ok:
        return f"{' '.join(cxx)} cannot compile Objective-C++ against the Metal SDK ({error})"
    return None


def mps_build(root, platform=sys.platform, environ=os.environ, probe=None):
    """What the extension needs for the MPS backend: a dict with ``sources``, ``define_macros``,
    ``include_dirs`` and ``extra_link_args``, or None when it is not built (see the module doc).
    ``probe()`` returns None or the reason the MPS sources cannot build (default: probe_mps with
    $CXX or c++ and the installed torch)."""
    if platform != "darwin" or environ.get(NO_MPS_ENV) == "1":
        return None
    reason = (probe or _probe_installed_torch)()
    if reason:
        warn(f"the MPS backend was not built: {reason} ({NO_MPS_ENV}=1 skips it without this message)")
        return None
    gen_dir = os.path.join(root, "build", "generated")
    embed_metal.write_header(os.path.join(root, "metal"), os.path.join(root, "csrc", "include"),
                             os.path.join(gen_dir, GENERATED_HEADER))
    sources = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "csrc", "mps", "*.mm")))
    return {
        "sources": sources,
        "define_macros": [("TM_WITH_MPS", "1")],
        "include_dirs": [gen_dir],
        "extra_link_args": ["-framework", "Metal", "-framework", "Foundation", "-framework", "IOKit"],
    }


def _probe_installed_torch():
    import torch
    from torch.utils import cpp_extension
    return probe_mps(embed_metal.cxx_command(), cpp_extension.include_paths(), torch.backends.mps.is_built())


# ---- prebuilt Metal libraries -----------------------------------------------------------------

def metal_toolchain(run=subprocess.run):
    """None when ``xcrun metal`` runs, else why not (one line)."""
    ok, error = _run(XCRUN + ["metal", "--version"], run)
    return None if ok else error


def metal_compile_commands(src, include_dir, air, metallib, werror=False):
    """The two commands that build one .metal file into ``metallib``: MSL 3.1 for macOS 14+,
    IEEE math (the kernels are checked bit-for-bit against CPU references; the run-time fallback
    sets the same), project headers from ``include_dir``; warnings as errors with ``werror`` (the
    developer check only)."""
    return [
        XCRUN + ["metal", f"-std={MSL_STD}", f"-mmacosx-version-min={METALLIB_MIN_MACOS}"]
        + (["-Werror"] if werror else []) + ["-fno-fast-math", "-I", include_dir, "-c", src, "-o", air],
        XCRUN + ["metallib", air, "-o", metallib],
    ]


def build_metallibs(metal_dir, include_dir, out_dir, run=subprocess.run, log=warn, werror=False, failures=None):
    """Builds every metal/*.metal file into ``out_dir``/<stem>-<hash>.metallib; returns the paths
    built. Libraries of other sources in ``out_dir`` are removed first, so none is stale.
    ``failures``: a dict that gets ``{file name: the compiler's whole log}`` of each file that did
    not build (``""`` for every file when the ``metal`` tool is missing)."""
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, "*.metallib")):
        os.remove(old)
    reason = metal_toolchain(run)
    if reason:
        log(f"Apple's Metal compiler is not available ({reason}): the Metal kernels will be compiled "
            "from the embedded source at run time (full Xcode or its Metal toolchain prebuilds them)")
        if failures is not None:
            failures.update({os.path.basename(f): reason for f in embed_metal.metal_files(metal_dir)})
        return []
    sources = embed_metal.library_sources(metal_dir, include_dir)
    built = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(sources):
            lib = os.path.join(out_dir, embed_metal.metallib_name(name, sources[name]))
            air = os.path.join(tmp, os.path.splitext(name)[0] + ".air")
            full_log = []
            for cmd in metal_compile_commands(os.path.join(metal_dir, name), include_dir, air, lib, werror):
                ok, error = _run(cmd, run, full_log)
                if not ok:
                    log(f"metal/{name} did not build ({error}): its kernels will be compiled at run time")
                    if failures is not None:
                        failures[name] = "\n".join(full_log) or error
                    if os.path.exists(lib):
                        os.remove(lib)
                    break
            else:
                built.append(lib)
    return built


def install_metallibs(built, dest_dir):
    """Copies the built libraries into ``dest_dir``, removing every other .metallib there."""
    os.makedirs(dest_dir, exist_ok=True)
    names = {os.path.basename(p) for p in built}
    for old in glob.glob(os.path.join(dest_dir, "*.metallib")):
        if os.path.basename(old) not in names:
            os.remove(old)
    for path in built:
        dest = os.path.join(dest_dir, os.path.basename(path))
        if os.path.abspath(path) != os.path.abspath(dest):
            shutil.copyfile(path, dest)
    return [os.path.join(dest_dir, n) for n in sorted(names)]


def check_metallibs(metal_dir, include_dir, out_dir, run=subprocess.run, log=warn):
    """The developer check: every metal/*.metal file must build with ``-Werror``. Returns the exit
    status (0 when all did), after printing each failing file's whole compiler log."""
    failures = {}
    built = build_metallibs(metal_dir, include_dir, out_dir, run, log, werror=True, failures=failures)
    expected = embed_metal.metal_files(metal_dir)
    for name in sorted(failures):
        print(f"==== metal/{name} did not build with -Werror:\n{failures[name]}", file=sys.stderr)
    print(f"torch_marlin: {len(built)} of {len(expected)} Metal libraries built with -Werror in {out_dir}",
          file=sys.stderr)
    return 0 if len(built) == len(expected) and not failures else 1


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Developer check: every metal/*.metal file builds with "
                                                 "Apple's compiler and -Werror.")
    parser.add_argument("--check", action="store_true", required=True)
    parser.add_argument("out_dir", nargs="?", help="where the libraries go (default: a temporary folder)")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(check_metallibs(os.path.join(root, "metal"), os.path.join(root, "csrc", "include"),
                                 args.out_dir or tmp))
