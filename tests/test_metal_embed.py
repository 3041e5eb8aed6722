"""csrc/mps/embed_metal.py (setup.py runs it on macOS): the generated header holds exactly every
.metal file's source with the shared headers inlined, the name of its prebuilt library and the
kernel -> file table, compiles as C++, and the inlined sources (the concatenation and every file
alone) still pass the address-space check. < 10 s."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "mps"))

import embed_metal  # noqa: E402

METAL_DIR = os.path.join(ROOT, "metal")
INCLUDE_DIR = os.path.join(ROOT, "csrc", "include")


def test_inlined_source_has_no_project_includes():
    src = embed_metal.inlined_source(METAL_DIR, INCLUDE_DIR)
    assert '#include "torch_marlin/' not in src
    # Every header once in the concatenation, however many files include it.
    assert src.count("struct QuantGemmParams {") == 1 and src.count("struct TrellisParams {") == 1
    assert src.count("inline void prefill_tile_impl(") == 1
    assert "#include <metal_stdlib>" in src
    for name in embed_metal.library_sources(METAL_DIR, INCLUDE_DIR):
        assert f"// ==== {name} ====" in src
    assert 'TM_INSTANTIATE_GEMV_DTYPE(half, half)' in src


def test_each_file_is_self_contained():
    sources = embed_metal.library_sources(METAL_DIR, INCLUDE_DIR)
    assert {"decode.metal", "fused_tiles.metal", "staged_tiles.metal", "striped.metal", "reduce.metal",
            "dequant.metal", "trellis_gemm.metal", "trellis_moe.metal"} <= set(sources)
    for name, src in sources.items():
        assert '#include "torch_marlin/' not in src, name
        assert src.count("#define TM_INSTANTIATE(") == 2, name  # the Apple and the emulator spelling
    assert "prefill_tile_impl" in sources["striped.metal"] and "prefill_tile_impl" not in sources["decode.metal"]


def test_header_roundtrip(tmp_path):
    out = tmp_path / "metal_library_sources.h"
    embed_metal.write_header(METAL_DIR, INCLUDE_DIR, str(out))
    mtime = out.stat().st_mtime_ns
    embed_metal.write_header(METAL_DIR, INCLUDE_DIR, str(out))
    assert out.stat().st_mtime_ns == mtime, "unchanged source must not rewrite the header"
    prog = tmp_path / "dump.cpp"
    prog.write_text(
        '#include <cstdio>\n#include "metal_library_sources.h"\n'
        "using namespace torch_marlin;\n"
        "int main() {\n"
        "  for (int i = 0; i < kMetalSourceFileCount; ++i) {\n"
        "    const MetalSourceFile& f = metal_source_files()[i];\n"
        '    std::printf("FILE %s %s\\n", f.name, f.metallib);\n'
        "    std::fputs(f.source, stdout);\n"
        "  }\n"
        "  for (int i = 0; i < kMetalKernelCount; ++i) {\n"
        "    const MetalKernelFile& k = metal_kernel_files()[i];\n"
        '    std::printf("KERNEL %s %s %d\\n", k.kernel, metal_source_files()[k.file].name, k.msl_version);\n'
        "  }\n"
        "}\n")
    exe = tmp_path / "dump"
    subprocess.run(["g++", "-std=c++17", "-I", str(tmp_path), str(prog), "-o", str(exe)], check=True)
    dumped = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    sources = embed_metal.library_sources(METAL_DIR, INCLUDE_DIR)
    expected = "".join(f"FILE {n} {embed_metal.metallib_name(n, sources[n])}\n{sources[n]}" for n in sorted(sources))
    expected += "".join(f"KERNEL {k} {f} {v}\n" for k, f, v in embed_metal.kernel_files(METAL_DIR, INCLUDE_DIR))
    assert dumped == expected
    assert "KERNEL marlin_gemv_m1_fp4_half decode.metal 300\n" in dumped
    assert "KERNEL marlin_gemv_unaligned_u4_bfloat decode.metal 310\n" in dumped


def _ascheck(path):
    return subprocess.run(["clang++", "-target", "aarch64-unknown-linux-gnu", "-nostdinc", "-fsyntax-only",
                           "-std=c++17", "-x", "c++", "-Wno-unknown-attributes", "-D__METAL_VERSION__=300",
                           "-I", os.path.join(ROOT, "scripts", "dev", "metal_ascheck"), str(path)],
                          capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("clang++") is None, reason="clang++ not installed (apt-get install -y clang)")
def test_inlined_sources_pass_address_space_check(tmp_path):
    f = tmp_path / "inlined.metal"
    f.write_text(embed_metal.inlined_source(METAL_DIR, INCLUDE_DIR))
    r = _ascheck(f)
    assert r.returncode == 0, r.stderr
    for name, src in embed_metal.library_sources(METAL_DIR, INCLUDE_DIR).items():
        f = tmp_path / name
        f.write_text(src)
        r = _ascheck(f)
        assert r.returncode == 0, name + "\n" + r.stderr
