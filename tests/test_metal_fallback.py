"""The plain-torch fallback (torch_marlin/metal_fallback.py), run on the CPU: each op's CPU kernel is
replaced by one that raises NotImplementedError (what the MPS backend raises when a Metal library
or pipeline fails, and the dispatcher when the extension has no MPS kernels), and the CPU is made
a fallback device. Checked: every layer type and op still gives the plain-torch reference's
answer, one MetalFallbackWarning per process naming the op and how to report, ``unavailable()``
listing each op that fell back; off the fallback devices the error propagates unchanged, and bad
input still raises its own error. A few seconds."""

import warnings

import pytest
import torch
from torch import nn

from torch_marlin import MarlinLinear, RansLinear, metal_fallback, ops, selfcheck
from torch_marlin.formats import trellis as trellis_format

# rans_decode's fallback is the CPU's own rANS decoder, which must keep working here.
FALLBACK_OPS = tuple(n for n in metal_fallback.TORCH_PATHS if n != "rans_decode")


@pytest.fixture
def broken_native(monkeypatch):
    """Every op in ``FALLBACK_OPS`` raises NotImplementedError on the CPU; the CPU falls back."""
    lib = torch.library.Library("marlin", "IMPL")

    def raiser(name):
        def kernel(*args, **kwargs):
            raise NotImplementedError(f"torch_marlin: Metal kernel for '{name}' is unavailable: metal/planted.metal "
                                      "did not load: compiling its source failed:\nplanted.metal:1:1: error: planted")
        return kernel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "overriding a previously registered kernel"
        for name in FALLBACK_OPS:
            lib.impl(name, raiser(name), "CPU")
    monkeypatch.setattr(metal_fallback, "FALLBACK_DEVICES", ("mps", "cpu"))
    monkeypatch.setattr(metal_fallback, "_unavailable", {})
    monkeypatch.setattr(metal_fallback, "_warned", [])
    yield
    lib._destroy()  # the C++ kernels are back


def _tolerance(x, W, ref):
    """The fallback's weights are the reference's fp32 values (affine: one more fp32 rounding, the
    +2 terms); it sums K fp32 products ((K + 2) 2^-24 |x| @ |W|) and rounds once to the activation
    dtype (2u |ref|, covering the reference's own rounding)."""
    u = selfcheck.UNIT_ROUNDOFF[x.dtype]
    return 2 * u * ref.abs() + (x.double().abs() @ W.abs()) * (x.shape[-1] + 2) * 2.0**-24 + 1e-6


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_marlin_and_rans_layers_fall_back(broken_native, fmt, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    layer = MarlinLinear.from_linear(linear, format=fmt, group_size=64, dtype=dtype if dtype != torch.float32 else None)
    rans = RansLinear.from_marlin(layer)
    x = torch.randn(2, 3, 256).to(dtype)
    W = layer.dequantized_weight().double()  # [N, K], from the formats' references
    ref = x.double() @ W.t() + layer.bias.double()
    tol = _tolerance(x.reshape(-1, 256), W.t(), ref.reshape(-1, 96)).reshape(ref.shape)
    with pytest.warns(metal_fallback.MetalFallbackWarning) as record, torch.no_grad():
        y = layer(x)
        y_rans = rans(x)
    assert len(record) == 1, [str(w.message) for w in record]  # one per process, not one per op or call
    message = str(record[0].message)
    assert f"marlin::gemm_{fmt}" in message and "metal/planted.metal" in message and "planted" in message
    assert "python -m torch_marlin.selfcheck --device mps" in message and "open an issue" in message
    for out in (y, y_rans):
        assert out.dtype == dtype and out.shape == (2, 3, 96)
        assert ((out.double() - ref).abs() <= tol).all()
    assert set(metal_fallback.unavailable()) == {f"gemm_{fmt}", "gemm_rans"}
    assert "metal/planted.metal" in metal_fallback.unavailable()[f"gemm_{fmt}"]


def test_trellis_ops_fall_back(broken_native):
    gen = torch.Generator().manual_seed(1)
    K, N, bits, gs = 200, 77, 3, 128
    t = selfcheck.random_trellis(K, N, bits, gs, gen)
    W = selfcheck.trellis_dense(t, K, N, bits, gs)
    A = torch.randn(5, K, generator=gen).half()
    with pytest.warns(metal_fallback.MetalFallbackWarning):
        out = ops.gemm_trellis(A, *t, K, N, bits, gs)
        W_out = ops.dequant_trellis(*t, K, N, bits, gs)
    assert out.dtype == torch.float16
    ref = A.double() @ W
    assert ((out.double() - ref).abs() <= _tolerance(A, W, ref)).all()
    assert torch.equal(W_out, trellis_format.dequant_trellis_reference(*t, K, N, bits, gs))

    H, I, E, top_k = 64, 48, 4, 2
    gate, up, down = (selfcheck.random_trellis(k, n, bits, 32, gen, experts=E) for k, n in ((H, I), (H, I), (I, H)))
    ids = torch.tensor([[0, 3], [3, 1], [1, 0]])
    probs = torch.softmax(torch.randn(3, top_k, generator=gen), -1)
    x = torch.randn(3, H, generator=gen)
    y = ops.moe_trellis(x, gate, up, down, ids, probs, I, bits, 32)
    ref = selfcheck.moe_reference(x, gate, up, down, ids, probs, H, I, bits, 32)
    # fp32 throughout: three fp32 matmuls of <= 64 terms and the SwiGLU, relative to the output scale.
    assert y.dtype == torch.float32 and torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    assert {"gemm_trellis", "dequant_trellis", "moe_trellis"} <= set(metal_fallback.unavailable())


def test_dequant_ops_fall_back(broken_native):
    torch.manual_seed(2)
    layer = MarlinLinear.from_linear(nn.Linear(128, 40), format="affine", group_size=32)
    with pytest.warns(metal_fallback.MetalFallbackWarning):
        W = ops.dequant_affine(layer.B_packed, layer.scales, layer.offsets, 32)
    ref = layer.dequantized_weight().t().to(torch.float16)
    # fp32 q * s + b rounded twice (fp32, then fp16) against once: at most one fp16 ulp apart.
    assert W.dtype == torch.float16 and ((W.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-10 + 1e-7).all()


def test_other_devices_and_bad_input_do_not_fall_back(broken_native, monkeypatch):
    layer = MarlinLinear(128, 16, format="fp4", group_size=64)
    x = torch.randn(2, 128).half()
    with pytest.raises(ValueError, match="in_features"):  # bad input: its own error, no fallback
        layer(torch.randn(2, 100).half())
    monkeypatch.setattr(metal_fallback, "FALLBACK_DEVICES", ("mps",))
    with warnings.catch_warnings():
        warnings.simplefilter("error", metal_fallback.MetalFallbackWarning)
        with pytest.raises(NotImplementedError, match="planted"):
            layer(x)
    assert metal_fallback.unavailable() == {}


def test_fallback_calls_are_counted(broken_native):
    B, s = torch.zeros(16, 8, dtype=torch.int32), torch.ones(2, 8, dtype=torch.float16)
    before = metal_fallback.fallback_calls()[0]
    with pytest.warns(metal_fallback.MetalFallbackWarning):
        out = ops.dequant_fp4(B, s, 64)
        ops.dequant_fp4(B, s, 64)  # tried natively again, falls back again
    count, why = metal_fallback.fallback_calls()
    assert count == before + 2 and "metal/planted.metal" in why
    assert torch.equal(out, torch.zeros(128, 8, dtype=torch.float16))
