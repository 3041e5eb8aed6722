"""Loaders of other tools' quantized layers (torch_marlin/loaders/): each MarlinLinear against the
source tool's own dequantization (and matmul where the tool has one), bad tensors named in errors.

Fixtures come from the tools themselves where they run here: mlx (``mx.quantize``,
``mx.dequantize``, ``mx.quantized_matmul``), gguf-py (``gguf.quants.quantize`` / ``dequantize``;
Q4_K has no quantizer in gguf-py, so its blocks are random bytes with finite fp16 super-scales,
which are all valid Q4_K blocks), compressed-tensors (``pack_to_int32`` and its ``dequantize``) and
transformers' gpt-oss MXFP4 dequantizer. GPTQ (act-order) and AWQ have no package that installs
without pulling a torch build, so their tensors are packed here from the published layouts
(docs/formats.md) and checked against ``(q - z) * s`` computed from the unpacked integers.
"""

import numpy as np
import pytest
import torch

from torch_marlin import MarlinLinear
from torch_marlin.loaders import CheckpointError
from torch_marlin.loaders.awq import AWQ_ORDER, from_awq
from torch_marlin.loaders.common import build_marlin_linear
from torch_marlin.loaders.compressed_tensors import from_compressed_tensors
from torch_marlin.loaders.gguf import from_gguf, gguf_unpack
from torch_marlin.loaders.gptq import marlin_linear_from_gptq
from torch_marlin.loaders.mlx import from_mlx, mlx_codes
from torch_marlin.loaders.mxfp4 import from_mxfp4
from torch_marlin.formats.int4_packing import pack_int4

from optional_packages import require
from reference import assert_gemm_close

N, K = 64, 256


def assert_weight_close(mod, want: torch.Tensor, exact: bool = False):
    """``mod``'s weight against the source's dequantized ``want`` ``[N, K]``. Scales and offsets are
    rounded once to the module's 16-bit dtype (relative error 2^-11 for fp16, 2^-8 for bf16), so
    each weight can be off by that fraction of its scaled code plus its offset, both at most the
    row's largest magnitude: 2 * rounding * row max. A wrong nibble order or group mapping is off
    by whole scale steps."""
    got = mod.dequantized_weight().to(torch.float64)
    want = want.to(torch.float64)
    if exact:
        assert torch.equal(got, want)
        return
    unit = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[mod.scales.dtype]
    tol = 2 * unit * want.abs().amax(dim=1, keepdim=True) + 1e-12
    err = (got - want).abs()
    assert bool((err <= tol).all()), f"max error {float(err.max()):.3g} vs tolerance {float(tol.max()):.3g}"


def assert_forward_matches(mod, bias=None):
    """The kernels on 3-D fp32 input against plain torch on the module's own dequantized weight."""
    x = torch.randn(2, 3, mod.in_features)
    y = mod(x)
    b = None if mod.bias is None else mod.bias.float()
    assert_gemm_close(y.reshape(-1, mod.out_features), x.reshape(-1, mod.in_features),
                      mod.dequantized_weight().t().contiguous(), b)


# ---------------------------------------------------------------------------------------------- MLX

def mlx_layer(group_size, mode="affine"):
    require("mlx")
    import mlx.core as mx

    mx.random.seed(0)
    w = mx.random.normal((N, K)) * 0.05
    out = mx.quantize(w, group_size=group_size, bits=4, mode=mode)
    as_torch = [torch.from_numpy(np.array(t.astype(mx.float32) if t.dtype == mx.bfloat16 else t)) for t in out]
    return mx, out, as_torch


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_mlx_affine_codes_match_mlx_dequantize(group_size):
    mx, (wq, s, b), (twq, ts, tb) = mlx_layer(group_size)
    codes = mlx_codes(twq.view(torch.int32))
    g = lambda t: t.repeat_interleave(group_size, dim=1)  # noqa: E731
    mine = codes.float() * g(ts) + g(tb)
    want = torch.from_numpy(np.array(mx.dequantize(wq, s, b, group_size=group_size, bits=4)))
    torch.testing.assert_close(mine, want, rtol=0, atol=1e-6)  # two fp32 roundings in either order


def test_mlx_affine_layer_matches_mlx_quantized_matmul():
    mx, (wq, s, b), (twq, ts, tb) = mlx_layer(64)
    bias = torch.randn(N) * 0.1
    mod = from_mlx(twq.view(torch.int32), ts, tb, group_size=64, bias=bias, dtype=torch.float32)
    assert mod.format == "affine" and mod.group_size == 64
    want_w = torch.from_numpy(np.array(mx.dequantize(wq, s, b, group_size=64, bits=4)))
    assert_weight_close(mod, want_w)
    x = np.random.default_rng(0).standard_normal((5, K)).astype(np.float32)
    want = np.array(mx.quantized_matmul(mx.array(x), wq, s, b, transpose=True, group_size=64, bits=4))
    y = mod(torch.from_numpy(x)) - bias
    # fp32 both ways, sums of 256 products in different orders: a few ulps of the row's |x| @ |w|.
    torch.testing.assert_close(y, torch.from_numpy(want), rtol=1e-5, atol=1e-5)


def test_mlx_mxfp4_layer_matches_mlx_dequantize():
    mx, (wq, s), (twq, ts) = mlx_layer(32, mode="mxfp4")
    mod = from_mlx(twq.view(torch.int32), ts.to(torch.uint8), None, group_size=32, mode="mxfp4")
    assert mod.format == "fp4" and mod.scales.dtype == torch.bfloat16
    want = torch.from_numpy(np.array(mx.dequantize(wq, s, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)))
    assert_weight_close(mod, want, exact=True)  # power-of-two scales: exact in bf16
    assert_forward_matches(mod)


def test_mlx_rejects_bad_tensors():
    _, _, (twq, ts, tb) = mlx_layer(64)
    with pytest.raises(ValueError, match="bits must be 4"):
        from_mlx(twq.view(torch.int32), ts, tb, group_size=64, bits=8)
    with pytest.raises(CheckpointError, match=r"scales must have shape \(64, 4\)"):
        from_mlx(twq.view(torch.int32), ts[:, :2], tb, group_size=64)
    with pytest.raises(CheckpointError, match="int32"):
        from_mlx(twq.to(torch.int64), ts, tb, group_size=64)


# ---------------------------------------------------------------------------------------------- GGUF

def gguf_tensor(type_name, seed=0):
    require("gguf")
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[type_name]
    if type_name == "Q4_K":
        raw = rng.integers(0, 256, (N, K // 256 * 144), dtype=np.uint8).reshape(N, K // 256, 144)
        raw[..., 0:4] = rng.uniform(1e-3, 2e-2, (N, K // 256, 2)).astype(np.float16).view(np.uint8)
        return t, raw.reshape(N, -1)
    return t, quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float32), t)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "MXFP4"])
def test_gguf_unpack_matches_gguf_dequantize(type_name):
    t, data = gguf_tensor(type_name)  # skips without gguf
    from gguf.quants import dequantize

    fmt, codes, scales, extra = gguf_unpack(data, t, (N, K))
    g = K // scales.shape[1]
    if fmt == "fp4":
        from torch_marlin.formats import E2M1_VALUES
        mine = E2M1_VALUES[codes.long()] * scales.repeat_interleave(g, 1)
    elif fmt == "u4":
        mine = (codes.float() - extra.float().repeat_interleave(g, 1)) * scales.repeat_interleave(g, 1)
    else:
        mine = codes.float() * scales.repeat_interleave(g, 1) + extra.repeat_interleave(g, 1)
    torch.testing.assert_close(mine, torch.from_numpy(dequantize(data, t)), rtol=0, atol=0)


@pytest.mark.parametrize("type_name, fmt", [("Q4_0", "u4"), ("Q4_1", "affine"), ("Q4_K", "affine"), ("MXFP4", "fp4")])
def test_gguf_layer_matches_gguf_dequantize(type_name, fmt):
    t, data = gguf_tensor(type_name)  # skips without gguf
    from gguf.quants import dequantize

    bias = torch.randn(N).half()
    mod = from_gguf(data, type_name if type_name != "Q4_1" else t, (N, K), bias=bias)
    assert mod.format == fmt and mod.group_size == 32
    # Q4_0 and MXFP4 keep their scales exactly (fp16 d; powers of two in bf16).
    assert_weight_close(mod, torch.from_numpy(dequantize(data, t)), exact=type_name in ("Q4_0", "MXFP4"))
    assert_forward_matches(mod)


def test_gguf_rejects_bad_data():
    t, data = gguf_tensor("Q4_0")
    with pytest.raises(CheckpointError, match=r"blk.0.attn_q.weight: Q4_0 of shape \(64, 256\) needs 9216 bytes"):
        from_gguf(data.reshape(-1)[:-5], t, (N, K), name="blk.0.attn_q.weight")
    with pytest.raises(CheckpointError, match="multiple of 32"):
        from_gguf(data, t, (N * 2, K // 2 + 4))
    with pytest.raises(ValueError, match="Q8_0 is not supported"):
        from_gguf(data, "Q8_0", (N, K))
    bad = data.copy().reshape(N, -1, 18)
    bad[3, 2, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(CheckpointError, match="scales: contains inf or NaN"):
        from_gguf(bad.reshape(N, -1), t, (N, K))


# ---------------------------------------------------------------------------------------------- GPTQ act-order

def pack_cols(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """uint codes ``[R, C]`` -> int32 ``[R, C/8]``: nibble ``i`` of word ``j`` holds column ``8j + order[i]``."""
    R, C = v.shape
    v = v.to(torch.int64).reshape(R, C // 8, 8)[..., list(order)]
    w = (v << (4 * torch.arange(8))).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_act_order_matches_g_idx_dequant(checkpoint_format):
    g = torch.Generator().manual_seed(0)
    gs, G = 32, K // 32
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (G, N), generator=g)
    s = (torch.rand(G, N, generator=g) * 0.02 + 0.001).half()
    # Act-order: quantization went through the columns by decreasing Hessian diagonal, so group
    # j holds the inputs at ranks j*gs .. (j+1)*gs - 1 of that order.
    order = torch.randperm(K, generator=g)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // gs).to(torch.int32)
    stored_z = (z - (1 if checkpoint_format == "gptq" else 0)) & 15
    bias = torch.randn(N).half()
    mod = marlin_linear_from_gptq(pack_int4(q), pack_cols(stored_z), s, g_idx, bias, desc_act=True,
                                  checkpoint_format=checkpoint_format)
    assert mod.input_perm is not None
    gi = g_idx.long()
    want = ((q.float() - z[gi].float()) * s.float()[gi]).t()
    assert_weight_close(mod, want, exact=True)
    # The forward gathers the inputs in the stored order: against the original-order weight.
    x = torch.randn(3, 5, K)
    assert_gemm_close(mod(x).reshape(-1, N), x.reshape(-1, K), want.t().contiguous(), bias.float())
    # The input's gradient goes through the same permutation.
    xg = torch.randn(4, K, requires_grad=True)
    mod(xg).sum().backward()
    torch.testing.assert_close(xg.grad, want.sum(0).expand_as(xg), rtol=1e-4, atol=1e-5)
    # state_dict round trip keeps the permutation.
    fresh = MarlinLinear(K, N, bias=True, format="u4", group_size=gs, act_order=True)
    fresh.load_state_dict(mod.state_dict())
    assert torch.equal(fresh(x), mod(x))
    bad = mod.state_dict()
    bad["input_perm"] = torch.zeros(K, dtype=torch.int64)
    with pytest.raises(ValueError, match="input_perm must be a permutation"):
        fresh.load_state_dict(bad)


# ---------------------------------------------------------------------------------------------- AWQ

def test_awq_matches_interleaved_reference():
    g = torch.Generator().manual_seed(1)
    gs, G = 64, K // 64
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (G, N), generator=g)
    s = (torch.rand(G, N, generator=g) * 0.02 + 0.001).half()
    mod = from_awq(pack_cols(q, AWQ_ORDER), pack_cols(z, AWQ_ORDER), s, group_size=gs)
    assert mod.format == "u4" and mod.group_size == gs
    assert_weight_close(mod, ((q.float() - z.float().repeat_interleave(gs, 0)) * s.float().repeat_interleave(gs, 0)).t(),
                        exact=True)
    assert_forward_matches(mod)
    with pytest.raises(CheckpointError, match=r"qzeros must have shape \(4, 8\)"):
        from_awq(pack_cols(q, AWQ_ORDER), pack_cols(z, AWQ_ORDER)[:2], s)


# ---------------------------------------------------------------------------------------------- compressed-tensors

@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_matches_its_dequantize(symmetric):
    require("compressed_tensors")
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    g = torch.Generator().manual_seed(2)
    gs, G = 32, K // 32
    q = torch.randint(-8, 8, (N, K), generator=g).to(torch.int8)
    s = (torch.rand(N, G, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    zp = None if symmetric else torch.randint(-8, 8, (N, G), generator=g).to(torch.int8)
    packed_zp = None if symmetric else pack_to_int32(zp, 4, packed_dim=0)
    mod = from_compressed_tensors(pack_to_int32(q, 4), s, packed_zp, torch.tensor([N, K]))
    assert mod.format == "u4" and mod.group_size == gs and mod.scales.dtype == torch.bfloat16
    # compressed-tensors rounds its products to the scale dtype (bf16): not bit-exact against our fp32.
    assert_weight_close(mod, dequantize(q, s, zp, dtype=torch.float32))
    assert_forward_matches(mod)
    with pytest.raises(CheckpointError, match=r"layers.0.mlp.up_proj.weight_shape: \(64, 200\) disagrees"):
        from_compressed_tensors(pack_to_int32(q, 4), s, packed_zp, torch.tensor([N, 200]),
                                name="layers.0.mlp.up_proj")


# ---------------------------------------------------------------------------------------------- gpt-oss MXFP4

def test_gpt_oss_mxfp4_matches_transformers_dequant():
    require("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (N, K // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 132, (N, K // 32), generator=g, dtype=torch.uint8)
    mod = from_mxfp4(blocks, scales)
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t()  # [N, K]
    assert_weight_close(mod, want, exact=True)
    assert_forward_matches(mod)
    with pytest.raises(CheckpointError, match="E8M0 value 255 is NaN"):
        from_mxfp4(blocks, torch.full_like(scales, 255))
    with pytest.raises(CheckpointError, match="overflow torch.float16"):
        from_mxfp4(blocks, torch.full_like(scales, 127 + 20), dtype=torch.float16)


# ---------------------------------------------------------------------------------------------- the common constructor

def test_build_marlin_linear_names_the_bad_tensor():
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    s = torch.rand(N, K // 32)
    with pytest.raises(CheckpointError, match=r"model.layers.3.q_proj: 4-bit codes must be in 0..15"):
        build_marlin_linear("fp4", codes.to(torch.int32) + 1, s, name="model.layers.3.q_proj")
    with pytest.raises(CheckpointError, match=r"q: scales must be \[N=64, K/group_size\]"):
        build_marlin_linear("fp4", codes, s[:10], name="q")
    with pytest.raises(CheckpointError, match=r"q: zeros must be an integer tensor of shape \(64, 8\)"):
        build_marlin_linear("u4", codes, s, zeros=torch.ones(N, 4, dtype=torch.uint8), name="q")
    with pytest.raises(ValueError, match="format 'u4' takes zeros"):
        build_marlin_linear("u4", codes, s, name="q")
    with pytest.raises(CheckpointError, match="group size K/3"):
        build_marlin_linear("fp4", codes, torch.rand(N, 3), name="q")
    with pytest.raises(CheckpointError, match=r"q: bias: expected shape \(64,\)"):
        build_marlin_linear("fp4", codes, s, bias=torch.zeros(3), name="q")
