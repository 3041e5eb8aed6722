"""The Metal dispatch description (csrc/plan/metal_dispatch.h) is what both the MPS backend and the
Metal-on-CPU harness run, and it matches the kernels it names.

- every buffer list equals the kernel's [[buffer(i)]] declarations parsed from metal/*.metal
  (names in slot order, the params struct last), over every plan path of every op;
- absent optional buffers get the documented stand-ins;
- a description with two slots swapped makes a GEMM fail in the harness (so a wrong order in the
  shared description could not pass the harness tests);
- the MPS units and the harness bindings build their dispatches only through the description.

Needs the harness builds (shared with test_metal_harness.py / test_trellis_metal.py).
"""

import glob
import os
import re

import pytest
import torch

from torch_marlin.formats import dequant_fp4_reference, quantize_fp4

import metal_emu
import trellis_metal_emu

ROOT = metal_emu.ROOT
DTYPES = ["float16", "bfloat16", "float32"]

_KERNEL_RE = re.compile(r"\[\[kernel\]\]\s+void\s+(\w+)\s*\((.*?)\)\s*\{", re.DOTALL)
_BUFFER_RE = re.compile(r"^(.*?)\b(\w+)\s*\[\[buffer\((\d+)\)\]\]$", re.DOTALL)
_INSTANTIATE_RE = re.compile(r'TM_INSTANTIATE\w*\(\s*"(\w+)"[^,]*,\s*(\w+)')
_SUFFIX_RE = re.compile(r"^(_(fp4|u4|affine))?(_(half|float|bfloat))?$")


def kernel_declarations():
    """{template name: [(type, name), ...] in [[buffer(i)]] order} and [(host-name stem, template)]."""
    decls, stems = {}, []
    for path in sorted(glob.glob(os.path.join(metal_emu.METAL_DIR, "*.metal"))):
        src = metal_emu.inlined(path)
        for m in _KERNEL_RE.finditer(src):
            slots = []
            for param in m.group(2).split(","):
                b = _BUFFER_RE.match(param.strip())
                if b:
                    slots.append((int(b.group(3)), " ".join(b.group(1).split()), b.group(2)))
            assert [s[0] for s in slots] == list(range(len(slots))), (m.group(1), slots)
            decls[m.group(1)] = [(t, n) for _, t, n in slots]
        stems += [(s.rstrip("_"), t) for s, t in _INSTANTIATE_RE.findall(src)]
    return decls, stems


DECLS, STEMS = kernel_declarations()


def declaration_of(host_name):
    """The [[buffer(i)]] list of the template a host name instantiates (the longest stem wins)."""
    matches = [(s, t) for s, t in STEMS if host_name.startswith(s) and _SUFFIX_RE.match(host_name[len(s):])]
    assert matches, f"no TM_INSTANTIATE names {host_name}"
    return DECLS[max(matches, key=lambda st: len(st[0]))[1]]


# Documented stand-ins for optional buffers the call does not have (metal_dispatch.h).
STAND_INS = {"zeros_or_offsets": "scales", "bias": "C", "workspace": "C"}


def slot_matches(buffer, param, buffers):
    # The tiled MoE kernels take one weight set under generic names (packed, scales, ...); the
    # description names the set it binds (g_ gate, u_ up, d_ down).
    if buffer == param or buffer in ("g_" + param, "u_" + param, "d_" + param):
        return True
    # The staged rANS GEMM decodes into the scratch that the following GEMM reads as its B.
    if (param, buffer) == ("B_packed", "B"):
        return True
    return STAND_INS.get(param) == buffer and param not in buffers


def assert_matches_declaration(dispatch):
    decl = declaration_of(dispatch["kernel"])
    buffers = dispatch["buffers"]
    assert len(decl) == len(buffers) + 1, (dispatch["kernel"], buffers, decl)
    for slot, (buf, (_, param)) in enumerate(zip(buffers, decl)):
        assert slot_matches(buf, param, buffers), \
            f"{dispatch['kernel']}: [[buffer({slot})]] is '{param}', bound '{buf}'"
    params_type, _ = decl[-1]
    assert params_type == f"constant {dispatch['params_type']}&", (dispatch["kernel"], params_type)
    assert dispatch["params_bytes"] == {"QuantGemmParams": 48, "QuantReduceParams": 16,
                                        "TrellisParams": 92, "RansParams": 44}[dispatch["params_type"]]


@pytest.fixture(scope="module")
def emu():
    mod = metal_emu.load()
    yield mod
    mod.set_dropped_barrier("")


@pytest.fixture(scope="module")
def trellis_emu():
    return trellis_metal_emu.load()


def test_every_metal_file_is_in_a_harness():
    files = set(glob.glob(os.path.join(metal_emu.METAL_DIR, "*.metal")))
    assert files == set(metal_emu.QUANT_SOURCES) | set(trellis_metal_emu.SOURCES)


def test_parser_sees_every_kernel():
    assert {"marlin_gemv", "marlin_gemm_fused", "marlin_gemm", "marlin_gemm_striped", "marlin_reduce_partials",
            "dequant_kernel", "gemm_trellis_packed_decode", "gemm_trellis_packed", "dequant_trellis_kernel",
            "moe_trellis_gate_up", "moe_trellis_down", "moe_trellis_combine", "moe_trellis_tiled_gate",
            "moe_trellis_tiled_up", "moe_trellis_tiled_down", "rans_gemv", "rans_decode_packed"} <= set(DECLS)
    assert declaration_of("marlin_gemm_fused_u4_bfloat")[0] == ("device const T*", "A")
    assert declaration_of("marlin_gemm_u4_half") is DECLS["marlin_gemm"]
    assert declaration_of("dequant_fp4_float") is DECLS["dequant_kernel"]


# (family, M, K, N, group_size, compute_units): every plan path, with and without K slices.
QUANT_PLANS = [("decode", 4, 512, 96, 64, 0), ("decode", 1, 8192, 256, 128, 0), ("decode", 3, 512, 90, 64, 0), ("fused_tiles", 70, 256, 96, 32, 0),
               ("staged_tiles", 70, 256, 96, 32, 0), ("striped", 64, 8192, 256, 128, 0), ("auto", 17, 256, 96, 64, 0),
               ("auto", 64, 8192, 256, 128, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family,M,K,N,gs,cu", QUANT_PLANS)
def test_quant_descriptions_match_kernels(emu, dtype, family, M, K, N, gs, cu):
    for fmt in ("fp4", "u4", "affine"):
        ds = emu.describe_gemm(fmt, M, K, N, gs, dtype, True, True, family, cu)
        for d in ds:
            assert_matches_declaration(d)
        split_k = any(d["kernel"].startswith("marlin_reduce_partials_") for d in ds)
        assert len(ds) == (2 if split_k else 1)
        if split_k:
            assert "workspace" in ds[0]["buffers"] and ds[1]["buffers"] == ["workspace", "bias", "C"]
        for d in emu.describe_dequant(fmt, K, N, gs, dtype, True):
            assert_matches_declaration(d)


def test_quant_descriptions_cover_k_slices(emu):
    kernels = [d["kernel"] for v, M, K, N, gs, cu in QUANT_PLANS for d in emu.describe_gemm("fp4", M, K, N, gs,
                                                                                            "float16", True, True, v, cu)]
    assert "marlin_reduce_partials_half" in kernels
    assert {"marlin_gemv_m4_fp4_half", "marlin_gemv_m1_fp4_half", "marlin_gemm_fused_fp4_half", "marlin_gemm_fp4_half",
            "marlin_gemm_striped_fp4_half"} <= set(kernels)


def test_quant_stand_ins(emu):
    # FP4 without bias, one K slice: zeros_or_offsets <- scales, bias <- C, workspace <- C (bound, never read).
    (d,) = emu.describe_gemm("fp4", 70, 256, 96, 32, "float16", False, False, "fused_tiles", 0)
    assert d["buffers"] == ["A", "B", "scales", "scales", "C", "C", "C"]
    ds = emu.describe_gemm("fp4", 1, 8192, 256, 128, "float16", False, False, "decode", 0)
    assert ds[0]["buffers"] == ["A", "B", "scales", "scales", "C", "C", "workspace"]
    assert ds[1]["buffers"] == ["workspace", "C", "C"]
    (d,) = emu.describe_dequant("fp4", 256, 96, 32, "float16", False)
    assert d["buffers"] == ["B", "scales", "scales", "W"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_trellis_descriptions_match_kernels(trellis_emu, dtype):
    for family, M in (("decode", 5), ("staged_tiles", 70), ("auto", 1), ("auto", 17)):
        for d in trellis_emu.describe_gemm(M, 200, 77, 3, 32, dtype, family):
            assert_matches_declaration(d)
    for d in trellis_emu.describe_dequant(200, 77, 3, 32):
        assert_matches_declaration(d)
    for tokens, top_k in ((3, 2), (40, 2)):  # GEMV stages only; and the tiled stages too
        ds = trellis_emu.describe_moe(tokens, 72, 112, 6, top_k, 3, 32, dtype)
        stems = [d["kernel"].rsplit("_", 1)[0] for d in ds]
        expected = ["moe_trellis_gate_up", "moe_trellis_down", "moe_trellis_combine"]
        if tokens * top_k > 16:
            expected = ["moe_trellis_gate_up", "moe_trellis_tiled_gate", "moe_trellis_tiled_up", "moe_trellis_down",
                        "moe_trellis_tiled_down", "moe_trellis_combine"]
        assert stems == expected
        for d in ds:
            assert_matches_declaration(d)
        by_stem = dict(zip(stems, ds))
        if "moe_trellis_tiled_up" in by_stem:
            # The tiled stages bind the weight set they compute with (generic names in the kernel).
            assert by_stem["moe_trellis_tiled_gate"]["buffers"][3] == "g_packed"
            assert by_stem["moe_trellis_tiled_up"]["buffers"][3:8] == ["u_packed", "u_scales", "u_grid", "u_su",
                                                                      "u_sv"]
            assert by_stem["moe_trellis_tiled_down"]["buffers"][0] == "rows_h"
            assert by_stem["moe_trellis_tiled_down"]["buffers"][3] == "d_packed"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rans_descriptions_match_kernels(emu, dtype):
    # M <= 16: the fused GEMV alone; M > 16: the decode into B, then gemm_<fmt>'s own dispatches
    # on it (K = 8192, N = 256, M = 64: the striped plan with its K-slice reduction).
    for M, K, N in ((1, 512, 77), (5, 512, 77), (16, 512, 77), (17, 512, 77), (64, 8192, 256)):
        for fmt in ("fp4", "u4", "affine"):
            ds = emu.describe_gemm_rans(fmt, M, K, N, 128, 3, dtype, True, fmt != "fp4")
            for d in ds:
                assert_matches_declaration(d)
            if M <= 16:
                assert len(ds) == 1 and ds[0]["kernel"].startswith("rans_gemv_m")
            else:
                assert ds[0]["kernel"] == "rans_decode_packed" and ds[0]["buffers"][-1] == "B"
                assert ds[1:] == emu.describe_gemm(fmt, M, K, N, 128, dtype, True, fmt != "fp4")
    (d,) = emu.describe_rans_decode(512, 77, 3)
    assert_matches_declaration(d)
    assert d["buffers"] == ["words", "word_offsets", "states", "freqs", "B_packed"] and d["grid"] == (26, 1, 1)


def test_declaration_check_catches_a_swap(emu, trellis_emu):
    for d in (emu.describe_gemm("u4", 64, 8192, 256, 128, "float16", True, True, "striped", 0)[1],
              trellis_emu.describe_moe(40, 72, 112, 6, 2, 3, 32, "float16")[2]):
        assert_matches_declaration(d)
        swapped = dict(d, buffers=[d["buffers"][1], d["buffers"][0]] + d["buffers"][2:])
        with pytest.raises(AssertionError, match=r"\[\[buffer\(0\)\]\]"):
            assert_matches_declaration(swapped)


def test_permuted_description_fails_a_gemm(emu):
    # A and C have the same size when K == N, so the swap stays in bounds: the kernel reads the
    # NaN-filled output as activations and writes the result over A.
    M, K, N, gs = 20, 128, 128, 32
    g = torch.Generator().manual_seed(0)
    B, s = quantize_fp4(torch.randn(K, N, generator=g), gs, scale_dtype=torch.float16)
    A = torch.randn(M, K, generator=g).half()
    ref = A.float() @ dequant_fp4_reference(B, s, gs)
    for family in ("decode", "fused_tiles"):
        m = 4 if family == "decode" else M
        C, _ = emu.gemm("fp4", A[:m], B, s, None, None, gs, family, 0, "forward", 0, 1, "", [])
        assert torch.allclose(C.float(), ref[:m], rtol=2e-3, atol=2e-2)
        C, _ = emu.gemm("fp4", A[:m].clone(), B, s, None, None, gs, family, 0, "forward", 0, 1, "", [0, 5])
        assert not torch.allclose(C.float(), ref[:m], rtol=2e-3, atol=2e-2, equal_nan=False)


def test_mps_units_and_harness_use_the_description():
    def read(*parts):
        with open(os.path.join(ROOT, *parts)) as f:
            return f.read()

    quant_mm, trellis_mm = read("csrc", "mps", "quant_gemm_mps.mm"), read("csrc", "mps", "trellis_mps.mm")
    rans_mm, rans_emu = read("csrc", "mps", "rans_mps.mm"), read("csrc", "metal_emu", "rans_bindings.cpp")
    quant_emu, trellis_emu_src = read("csrc", "metal_emu", "bindings.cpp"), read("csrc", "metal_emu",
                                                                                   "trellis_bindings.cpp")
    for fn in ("quant_gemm_dispatches(", "quant_dequant_dispatches("):
        assert fn in quant_mm and fn in quant_emu, fn
    for fn in ("trellis_gemm_dispatches(", "trellis_dequant_dispatches(", "trellis_moe_dispatches("):
        assert fn in trellis_mm and fn in trellis_emu_src, fn
    for fn in ("rans_gemm_dispatches(", "rans_decode_dispatches("):
        assert fn in rans_mm and fn in rans_emu, fn
    # Only the shared encoder binds buffers; the op units hand it the description's list.
    for src in (quant_mm, trellis_mm, rans_mm):
        assert "setBuffer" not in src and "mps_encode(" in src
    assert "setBuffer" in read("csrc", "mps", "mps_encoder.mm")
