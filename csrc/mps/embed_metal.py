"""Embeds the Metal kernel sources into a C++ header (setup.py calls it on macOS).

    write_header(metal_dir, include_dir, out_header)

Every metal/*.metal file is self-contained and becomes a Metal library of its own, so one file
that fails to compile leaves the others' kernels usable. ``file_source(path, include_dir)`` gives
one file with every ``#include "torch_marlin/..."`` it reaches inlined from include_dir (each
header once, ``#pragma once`` dropped): what the run-time compiler gets, with no include paths.
``library_sources`` maps every file to that text; ``inlined_source`` concatenates the files
(sorted), each header still inlined once (the address-space check reads it).

``kernel_names(path, include_dir)`` lists the host names a file instantiates and the MSL version
each needs, by running the file through the C preprocessor with ``TM_INSTANTIATE`` redefined to
print its name: the MPS backend learns from that table which library holds a kernel without
loading the others.

``write_header`` writes ``out_header`` defining, in namespace torch_marlin,

    struct MetalSourceFile { name, metallib, source };     // metal_source_files()[kMetalSourceFileCount]
    struct MetalKernelFile { kernel, file, msl_version };  // metal_kernel_files()[kMetalKernelCount]

``metallib`` is the name of the file's prebuilt library, ``<stem>-<hash>.metallib`` with the hash
of the self-contained source (csrc/mps/build_metal.py builds it under that name), so a library
left over from other sources is never loaded. Sources are emitted as adjacent raw-string chunks
(every compiler accepts long literals that way). The header is rewritten only when its content
changes, so unchanged kernels do not rebuild.

Run directly to print the concatenated source, or write the header:
``python csrc/mps/embed_metal.py [--header OUT]``.
"""

import glob
import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile

_INCLUDE = re.compile(r'^\s*#\s*include\s+"(torch_marlin/[^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")
_CHUNK = 8000  # characters per raw-string piece
_HASH_CHARS = 16

# MSL versions the kernels are preprocessed for: 3.0 (macOS 13) and 3.1 (macOS 14, bfloat). A
# kernel present only at 310 needs MSL 3.1.
MSL_VERSIONS = (300, 310)
_NAME_BEGIN, _NAME_END = "__tm_kernel_name_begin", "__tm_kernel_name_end"
_NAME = re.compile(_NAME_BEGIN + r'((?:\s*"(?:[^"\\\n]|\\.)*")+)\s*' + _NAME_END)
_STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"')


def _inline(path, include_dir, seen, out):
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        m = _INCLUDE.match(line)
        if m:
            header = os.path.join(include_dir, m.group(1))
            if not os.path.exists(header):
                raise FileNotFoundError(f"{path}: included header {m.group(1)} not found under {include_dir}")
            if header not in seen:
                seen.add(header)
                out.append(f"// ---- begin {m.group(1)} (inlined) ----")
                _inline(header, include_dir, seen, out)
                out.append(f"// ---- end {m.group(1)} ----")
            continue
        if _PRAGMA_ONCE.match(line):
            continue
        out.append(line)


def metal_files(metal_dir):
    files = sorted(glob.glob(os.path.join(metal_dir, "*.metal")))
    if not files:
        raise FileNotFoundError(f"no .metal files in {metal_dir}")
    return files


def file_source(path, include_dir):
    """One .metal file with its project headers inlined: compiles on its own."""
    out = []
    _inline(path, include_dir, set(), out)
    return "\n".join(out) + "\n"


def library_sources(metal_dir, include_dir):
    """{file name: self-contained source} for every .metal file (one library per file)."""
    return {os.path.basename(f): file_source(f, include_dir) for f in metal_files(metal_dir)}


def inlined_source(metal_dir, include_dir):
    """All .metal files concatenated in name order, each header inlined once."""
    seen, out = set(), []
    for f in metal_files(metal_dir):
        out.append(f"// ==== {os.path.basename(f)} ====")
        _inline(f, include_dir, seen, out)
    return "\n".join(out) + "\n"


def metallib_name(name, source):
    """``<stem>-<hash of the self-contained source>.metallib`` for the .metal file ``name``."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:_HASH_CHARS]
    return f"{os.path.splitext(name)[0]}-{digest}.metallib"


def cxx_command():
    """The C++ compiler the build steps run (the preprocessor here): $CXX, else ``c++``."""
    return shlex.split(os.environ.get("CXX") or "c++")


def kernel_names(path, include_dir, cpp=None):
    """[(host name, MSL version it needs)] of the kernels ``path`` instantiates, in source order.

    The file goes through ``cpp -E`` (default: cxx_command()) once per MSL_VERSIONS entry, with
    ``__METAL_VERSION__`` set, an empty <metal_stdlib> and TM_INSTANTIATE(name, ...) expanding to
    the name between two markers; the name's adjacent string literals are joined."""
    cpp = list(cpp) if cpp else cxx_command()
    first_version = {}
    with tempfile.TemporaryDirectory() as stub_dir:
        open(os.path.join(stub_dir, "metal_stdlib"), "w").close()
        for version in MSL_VERSIONS:
            cmd = cpp + ["-E", "-P", "-x", "c++", "-nostdinc", f"-D__METAL_VERSION__={version}",
                         f"-DTM_INSTANTIATE(name, ...)={_NAME_BEGIN} name {_NAME_END}",
                         "-I", stub_dir, "-I", include_dir, path]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"preprocessing {path} failed ({shlex.join(cmd)}):\n{r.stderr}")
            for m in _NAME.finditer(r.stdout):
                name = "".join(_STRING.findall(m.group(1)))
                first_version.setdefault(name, version)
    return list(first_version.items())


def kernel_files(metal_dir, include_dir, cpp=None):
    """[(host name, file name, MSL version)] of every kernel; a name defined twice is an error."""
    out, where = [], {}
    for path in metal_files(metal_dir):
        name = os.path.basename(path)
        for kernel, version in kernel_names(path, include_dir, cpp):
            if kernel in where:
                raise ValueError(f"kernel '{kernel}' is instantiated in both {where[kernel]} and {name}")
            where[kernel] = name
            out.append((kernel, name, version))
    if not out:
        raise ValueError(f"no TM_INSTANTIATE kernels found in {metal_dir}")
    return out


def _delimiter(text):
    for i in range(1000):
        d = f"TMSRC{i}"
        if f"){d}\"" not in text:
            return d
    raise RuntimeError("no raw-string delimiter found")


def _raw_string(text, indent):
    d = _delimiter(text)
    pieces = [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)]
    return "\n".join(f'{indent}R"{d}({p}){d}"' for p in pieces)


def header_text(sources, kernels):
    """The header for ``sources`` ({file name: self-contained source}) and ``kernels``
    ([(host name, file name, MSL version)])."""
    names = sorted(sources)
    index = {n: i for i, n in enumerate(names)}
    files = "\n".join(
        f'      {{"{n}", "{metallib_name(n, sources[n])}",\n{_raw_string(sources[n], "       ")}}},' for n in names)
    table = "\n".join(f'      {{"{k}", {index[f]}, {v}}},  // {f}' for k, f, v in kernels)
    return (
        "// Generated by csrc/mps/embed_metal.py from metal/*.metal: do not edit.\n"
        "#pragma once\n\n"
        "namespace torch_marlin {\n\n"
        "// One Metal library per metal/*.metal file.\n"
        "struct MetalSourceFile {\n"
        "  const char* name;      // the .metal file\n"
        "  const char* metallib;  // its prebuilt library: <stem>-<hash of source>.metallib\n"
        "  const char* source;    // its self-contained source (project headers inlined)\n"
        "};\n\n"
        "struct MetalKernelFile {\n"
        "  const char* kernel;  // host name\n"
        "  int file;            // index into metal_source_files()\n"
        "  int msl_version;     // the MSL version it needs: 300 (3.0) or 310 (3.1, bfloat)\n"
        "};\n\n"
        f"inline constexpr int kMetalSourceFileCount = {len(names)};\n"
        f"inline constexpr int kMetalKernelCount = {len(kernels)};\n\n"
        "inline const MetalSourceFile* metal_source_files() {\n"
        "  static const MetalSourceFile files[] = {\n"
        f"{files}\n"
        "  };\n"
        "  return files;\n"
        "}\n\n"
        "inline const MetalKernelFile* metal_kernel_files() {\n"
        "  static const MetalKernelFile kernels[] = {\n"
        f"{table}\n"
        "  };\n"
        "  return kernels;\n"
        "}\n\n"
        "}  // namespace torch_marlin\n"
    )


def write_header(metal_dir, include_dir, out_header, cpp=None):
    text = header_text(library_sources(metal_dir, include_dir), kernel_files(metal_dir, include_dir, cpp))
    os.makedirs(os.path.dirname(os.path.abspath(out_header)), exist_ok=True)
    if os.path.exists(out_header):
        with open(out_header) as f:
            if f.read() == text:
                return out_header
    with open(out_header, "w") as f:
        f.write(text)
    return out_header


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    metal_dir, include_dir = os.path.join(root, "metal"), os.path.join(root, "csrc", "include")
    if len(sys.argv) == 3 and sys.argv[1] == "--header":
        print(write_header(metal_dir, include_dir, sys.argv[2]))
    else:
        sys.stdout.write(inlined_source(metal_dir, include_dir))
