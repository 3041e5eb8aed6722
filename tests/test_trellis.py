"""Trellis format (index packing, quantizer quality), the CPU ops' argument checks, the modules
TrellisLinear / TrellisMoE, debug logging and torch.compile. The ops' correctness on every backend
is in tests/test_trellis_ops.py.

Module tolerances: the kernels accumulate in fp32 and round the result once to the activation
dtype (half an ulp: 2^-11 fp16, 2^-8 bf16), so the check is
|C - ref| <= eps_dtype * (|ref| + max|ref| * 2^-3) with eps = 2^-10 (fp16), 2^-7 (bf16), 1e-5 (fp32),
i.e. ~2x the rounding bound plus an absolute floor for entries near zero after cancellation.
"""

import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_marlin as tm
from torch_marlin import ops
from torch_marlin.formats import trellis as fmt

# tests/test_trellis_metal.py imports these three from here.
from reference import moe_case, moe_reference, random_trellis  # noqa: F401

EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def assert_close_to(out, ref, dtype):
    eps = EPS[dtype]
    out = out.double()
    ref = ref.double()
    tol = eps * (ref.abs() + ref.abs().max() * 0.125) + 1e-6
    err = (out - ref).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3e}, max |ref| {ref.abs().max().item():.3e}"


# ---- format ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("K,N", [(16, 16), (37, 19), (200, 77)])
def test_pack_unpack_roundtrip(bits, K, N):
    idx = torch.randint(0, 1 << bits, (K, N))
    packed = fmt.pack_indices(idx, bits)
    assert packed.shape == ((K + 15) // 16, (N + 15) // 16, 32 * bits) and packed.dtype == torch.uint8
    assert torch.equal(fmt.unpack_indices(packed, K, N, bits), idx)


def test_bit_layout_3bit_lsb_first_crosses_bytes():
    # Tile-row-major indices; index i occupies bits [3i, 3i+3) of the tile's little-endian stream.
    idx = torch.zeros(16, 16, dtype=torch.int64)
    idx[0, 0], idx[0, 1], idx[0, 2] = 5, 3, 6  # bits: 101 | 011 | 110 -> byte0 = 0b10_011_101, byte1 bit0 = 1
    idx[1, 0] = 7  # row 1 starts at bit 48 = byte 6
    p = fmt.pack_indices(idx, 3)[0, 0]
    assert p[0].item() == 0b10011101 and p[1].item() == 0b1 and p[6].item() == 0b111
    assert int(p[2:6].sum()) == 0 and int(p[7:].sum()) == 0


def test_bit_layout_2bit_and_4bit():
    idx = torch.zeros(16, 16, dtype=torch.int64)
    idx[0, :4] = torch.tensor([1, 2, 3, 0])
    assert fmt.pack_indices(idx, 2)[0, 0, 0].item() == 1 | (2 << 2) | (3 << 4)
    idx[0, :2] = torch.tensor([9, 4])
    assert fmt.pack_indices(idx, 4)[0, 0, 0].item() == 9 | (4 << 4)


# ---- error cases ----------------------------------------------------------------------------------

def test_gemm_errors_name_the_argument():
    K, N, bits, gs = 64, 48, 3, 32
    p, s, g, su, sv = random_trellis(K, N, bits, gs)
    A = torch.randn(2, K)
    cases = [
        ((A.int(), p, s, g, su, sv, K, N, bits, gs), TypeError, "A must be float16"),
        ((A, p.int(), s, g, su, sv, K, N, bits, gs), TypeError, "packed_indices must be uint8"),
        ((A, p[:, :1], s, g, su, sv, K, N, bits, gs), ValueError, "packed_indices must have shape"),
        ((A, p, s[:1], g, su, sv, K, N, bits, gs), ValueError, "scales must have shape"),
        ((A, p, s.half(), g, su, sv, K, N, bits, gs), TypeError, "scales must be float32"),
        ((A, p, s, g[:4], su, sv, K, N, bits, gs), ValueError, "grid must have shape"),
        ((A, p, s, g, su[:3], sv, K, N, bits, gs), ValueError, "su must have shape"),
        ((A, p, s, g, su, sv[:3], K, N, bits, gs), ValueError, "sv must have shape"),
        ((A, p, s, g, su, sv, K, N, 5, gs), ValueError, "bits must be 2, 3 or 4"),
        ((A, p, s, g, su, sv, K, N, bits, 24), ValueError, "group_size must be a positive multiple of 16"),
        ((A[:, :10], p, s, g, su, sv, K, N, bits, gs), ValueError, "A must have K = 64"),
        ((A[0], p, s, g, su, sv, K, N, bits, gs), ValueError, "A must be 2-D"),
        ((A, p.to("meta"), s, g, su, sv, K, N, bits, gs), ValueError, "packed_indices is on meta but A is on cpu"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            ops.gemm_trellis(*args)
    with pytest.raises(ValueError, match="packed_indices must have shape"):
        ops.dequant_trellis(p, s, g, su, sv, K + 16, N, bits, gs)
    with pytest.raises(ValueError, match="grid is on meta but packed_indices is on cpu"):
        ops.dequant_trellis(p, s, g.to("meta"), su, sv, K, N, bits, gs)


def test_moe_errors_name_the_argument():
    T, H, I, E, top_k, bits, gs = 4, 32, 32, 3, 2, 2, 32
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, "random")
    x = torch.randn(T, H)
    run = lambda **kw: ops.moe_trellis(kw.get("x", x), kw.get("gate", gate), up, kw.get("down", down),  # noqa: E731
                                       kw.get("ids", ids), kw.get("probs", probs), I, bits, gs)
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 3\)"):
        run(ids=ids.clone().fill_(3))
    with pytest.raises(ValueError, match=r"expert_ids must be in \[0, 3\)"):
        run(ids=ids.clone().fill_(-1))
    with pytest.raises(ValueError, match="expert_probs must have expert_ids' shape"):
        run(probs=probs[:, :1])
    with pytest.raises(TypeError, match="expert_ids must be int64 or int32"):
        run(ids=ids.float())
    with pytest.raises(ValueError, match="expert_ids must have shape"):
        run(ids=ids[:2])
    with pytest.raises(ValueError, match="down_scales must have shape"):
        run(down=(down[0], down[1][:, :, :1], *down[2:]))
    with pytest.raises(ValueError, match="gate_packed_indices must have shape"):
        run(gate=(gate[0][:, :1], *gate[1:]))
    with pytest.raises(ValueError, match="expert_ids is on meta but x is on cpu"):
        run(ids=ids.to("meta"))
    with pytest.raises(ValueError, match="top_k"):
        run(ids=torch.zeros(T, 4, dtype=torch.long), probs=torch.ones(T, 4))


# ---- modules --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_trellis_linear(rotate, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(192, 80)
    m = tm.TrellisLinear.from_linear(lin, bits=4, group_size=32, rotate=rotate, dtype=dtype)
    W = m.dequantized_weight().double()
    for shape in ((1, 192), (3, 5, 192), (40, 192)):
        x = torch.randn(*shape).to(dtype)
        y = m(x)
        assert y.shape == (*shape[:-1], 80) and y.dtype == dtype
        ref = x.double() @ W.t() + lin.bias.detach().to(dtype).double()
        # With rotation the input is rotated in fp32 and rounded once to dtype, and the output is
        # rotated after the kernel's dtype rounding: a few extra roundings, so 4x the tolerance.
        if rotate and dtype != torch.float32:
            err, scale = (y.double() - ref).abs().max(), ref.abs().max()
            assert err <= 6 * EPS[dtype] * scale, (err, scale)
        else:
            assert_close_to(y, ref, dtype)
    # Quantization quality sanity: 4-bit layer vs the float layer.
    x = torch.randn(64, 192)
    assert fmt.sqnr_db(lin(x).detach(), m.float()(x.to(dtype)).float() if dtype == torch.float32 else
                       m(x.to(dtype)).float()) > 15


def test_trellis_linear_state_dict_and_validation():
    lin = nn.Linear(64, 40, bias=False)
    m = tm.TrellisLinear.from_linear(lin, bits=3, group_size=32, dtype=torch.float32)
    m2 = tm.TrellisLinear(64, 40, bits=3, group_size=32, bias=False, dtype=torch.float32)
    m2.load_state_dict(m.state_dict())
    x = torch.randn(7, 64)
    assert torch.equal(m2(x), m(x))
    bad = {k: v.clone() for k, v in m.state_dict().items()}
    bad["scales"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="scales contains non-finite"):
        m2.load_state_dict(bad)
    bad = {k: v.clone() for k, v in m.state_dict().items()}
    bad["su"][3] = float("inf")
    with pytest.raises(ValueError, match="su contains non-finite"):
        m2.load_state_dict(bad)
    with pytest.raises(ValueError, match="group_size"):
        tm.TrellisLinear(64, 40, bits=3, group_size=8)
    with pytest.raises(ValueError, match="bits"):
        tm.TrellisLinear(64, 40, bits=5)
    with pytest.raises(ValueError, match="in_features=64"):
        m(torch.randn(3, 65))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_trellis_linear_default_module_loads_any_from_linear_exactly(dtype):
    # The bias is the only buffer that follows the dtype; the default module holds it in fp32,
    # which represents every fp16/bf16/fp32 value, so the loaded module computes the same outputs.
    lin = nn.Linear(64, 40).to(dtype)
    with torch.no_grad():
        lin.bias.mul_(100).add_(1 / 3)  # values fp16 cannot hold exactly, should fp32 be rounded down
    m = tm.TrellisLinear.from_linear(lin, bits=3, group_size=32)
    assert m.bias.dtype == dtype
    m2 = tm.TrellisLinear(64, 40, bits=3, group_size=32)
    assert m2.bias.dtype == torch.float32
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.bias.to(dtype), m.bias)
    x = torch.randn(5, 64).to(dtype)
    assert torch.equal(m2(x), m(x))


def test_trellis_moe_module():
    torch.manual_seed(1)
    H, I, E = 64, 96, 4
    gate = [nn.Linear(H, I, bias=False) for _ in range(E)]
    up = [nn.Linear(H, I, bias=False) for _ in range(E)]
    down = [nn.Linear(I, H, bias=False) for _ in range(E)]
    router = nn.Linear(H, E, bias=False)
    moe = tm.TrellisMoE.from_experts(gate, up, down, router, top_k=2, bits=4, group_size=32, dtype=torch.float32)
    x = torch.randn(2, 9, H)
    y = moe(x)
    x2 = x.reshape(-1, H)
    ids, p = moe.route(x2)
    exact = torch.zeros(x2.shape[0], H, dtype=torch.float64)
    fp = torch.zeros(x2.shape[0], H)
    for t in range(x2.shape[0]):
        for j in range(2):
            e = int(ids[t, j])
            h = F.silu(x2[t].double() @ moe.expert_weights("gate", e).double()) * (
                x2[t].double() @ moe.expert_weights("up", e).double())
            exact[t] += float(p[t, j]) * (h @ moe.expert_weights("down", e).double())
            fp[t] += p[t, j] * down[e](F.silu(gate[e](x2[t])) * up[e](x2[t]))
    # Module = kernel + fp32 rotations: fp32 rounding only.
    torch.testing.assert_close(y.reshape(-1, H).double(), exact, rtol=1e-4, atol=1e-5 * float(exact.abs().max()))
    assert fmt.sqnr_db(fp.detach(), y.reshape(-1, H).detach()) > 12  # 4-bit experts vs float experts
    m2 = tm.TrellisMoE(H, I, E, top_k=2, bits=4, group_size=32, dtype=torch.float32)
    m2.load_state_dict(moe.state_dict())
    assert torch.equal(m2(x), y)
    buf = io.BytesIO()  # torch.save(module) pickles it, load_state_dict hooks included
    torch.save(moe, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x), y)


# ---- quantizer quality (SQNR report) --------------------------------------------------------------

def realistic_weight(K, N, seed=0):
    """LLM-like weight [K, N]: Student-t (df=4) entries, log-normal per-output-channel scale and
    1% of input channels 8x larger (the outlier channels activation-aware methods worry about)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(4.0)
    torch.manual_seed(seed)
    w = t.sample((K, N)) * 0.02
    w *= torch.exp(0.3 * torch.randn(1, N, generator=g))
    w[torch.randperm(K, generator=g)[:K // 100]] *= 8
    return w


def test_sqnr_report_beats_rtn():
    w = realistic_weight(512, 512)
    rows = []
    res = {}
    for bits in (2, 3, 4):
        tr = fmt.sqnr_db(w, fmt.effective_weight(fmt.quantize_trellis(w, bits, 128, rotate=True)))
        tr_nr = fmt.sqnr_db(w, fmt.effective_weight(fmt.quantize_trellis(w, bits, 128, rotate=False), rotate=False))
        rtn = fmt.sqnr_db(w, fmt.quantize_rtn_int(w, bits, 128))
        res[bits] = (tr, tr_nr, rtn)
        rows.append(f"bits={bits} g128: trellis(rot) {tr:6.2f} dB | trellis(no rot) {tr_nr:6.2f} dB | RTN INT{bits} {rtn:6.2f} dB")
    print("\n" + "\n".join(rows))
    assert res[3][0] > res[3][2] + 3.0, res  # 3-bit trellis beats RTN INT3 g128 by 3 dB
    assert res[4][0] > res[4][2], res
    assert res[2][0] > res[2][2], res


# ---- plumbing -------------------------------------------------------------------------------------

def cpu_decode_kernel():
    """The CPU decode kernel the planner names for this machine's caps."""
    caps = tm._C.device_caps("cpu")
    if caps["avx512"]:
        return "cpu_trellis_decode_avx512"
    return "cpu_trellis_decode_avx2" if caps["avx2"] else "cpu_trellis_decode"


def debug_log_of(code):
    """stderr of `python -c code` with TORCH_MARLIN_DEBUG=1 (the ops log every dispatch there)."""
    env = dict(os.environ, TORCH_MARLIN_DEBUG="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_debug_logging():
    log = debug_log_of("import torch, torch_marlin; from torch_marlin.formats import trellis as f\n"
                       "q = f.quantize_trellis(torch.randn(32, 32), 2, 32)\n"
                       "torch_marlin.ops.gemm_trellis(torch.randn(3, 32), q['packed_indices'], q['scales'], "
                       "q['grid'], q['su'], q['sv'], 32, 32, 2, 32)\n")
    # N = 32: two tasks of one tile column each (one per thread), or one task on one thread.
    decode = cpu_decode_kernel()
    assert f"kernel={decode} grid=(" in log
    for name in ("A:", "scales:", "grid:", "su:", "sv:"):
        assert name in log
    assert "has_nan=False" in log and "min=" in log


def test_modules_trace_with_torch_compile():
    # fullgraph: the rotations are plain torch ops and the trellis ops have fake kernels, so
    # dynamo/AOT trace the modules without graph breaks (aot_eager: no inductor compile time).
    torch.manual_seed(0)
    lin = tm.TrellisLinear.from_linear(nn.Linear(64, 48), bits=3, group_size=32, dtype=torch.float32)
    x = torch.randn(5, 64)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), lin(x))
    H, I, E = 32, 48, 3
    moe = tm.TrellisMoE.from_experts([nn.Linear(H, I, bias=False) for _ in range(E)],
                                     [nn.Linear(H, I, bias=False) for _ in range(E)],
                                     [nn.Linear(I, H, bias=False) for _ in range(E)],
                                     nn.Linear(H, E, bias=False), top_k=2, bits=4, group_size=32,
                                     dtype=torch.float32)
    xm = torch.randn(6, H)
    torch.testing.assert_close(torch.compile(moe, fullgraph=True, backend="aot_eager")(xm), moe(xm))


def test_trellis_linear_dispatches_decode_then_prefill():
    # The module calls the op; the op's planner picks decode for M <= 16 rows (after flattening
    # leading dims) and prefill above. The debug log names the kernel each call ran.
    log = debug_log_of("import torch, torch_marlin\n"
                       "m = torch_marlin.TrellisLinear.from_linear(torch.nn.Linear(64, 32), bits=2, group_size=32,"
                       " dtype=torch.float32)\n"
                       "m(torch.randn(2, 8, 64)); m(torch.randn(3, 6, 64))\n")
    kernels = [line.split("kernel=")[1].split()[0] for line in log.splitlines() if "kernel=" in line]
    decode = cpu_decode_kernel()
    assert kernels == [decode, "cpu_trellis_prefill"], kernels
