"""Independent references and error bounds shared by the op test files.

The reference of every GEMM is ``torch.matmul`` in fp32 (fp64 for trellis) on a weight dequantized
by the plain torch functions of ``torch_marlin.formats`` (never by the kernels under test).

Error bounds, elementwise, for ``C = A @ W (+ bias)`` with ``mag = |A| @ |W|`` (``sum |a||w|``) and
``u`` the unit roundoff of the activation dtype:

* every backend rounds the result once to the activation dtype (``u |ref|``; 2x for the bias add
  and the final rounding together) and sums in fp32 in some order (``K * 2^-24 * mag``, the
  standard worst-case bound of a K-term sum);
* ``exact_products=False`` (the GPU backends and their CPU emulation): the kernels round each
  dequantized weight (code x scale) to the activation dtype before the multiply (Metal simdgroup
  tiles, CUDA tensor-core operands) and may reduce one level of partial sums in that dtype
  (cuBLAS under torch's default fp16/bf16 reduced-precision reductions): at most two roundings
  of relative size ``u`` per product term, ``2 u mag``; tensor-core fp32 accumulation truncates
  instead of rounding, so its sum term is ``K * 2^-23 * mag``.

Affine weights ``s * q + b`` are summed by some kernels as two terms (``s * sum a q + b * sum a``)
or dequantized in two roundings (``s * q``, then ``+ b``), so their ``mag`` is taken over
``|s q| + |b|`` (:func:`make_weights`' ``"mag"``) instead of ``|w|``: every bound above holds
with it.
"""

import torch
import torch.nn.functional as F

from torch_marlin.formats import (dequant_affine_reference, dequant_fp4_reference, dequant_u4_reference,
                                  quantize_affine, quantize_fp4, quantize_u4, unpack_int4)
from torch_marlin.formats import trellis as trellis_format

# Unit roundoff of the output dtype: a correctly accumulated result rounded once to the output
# dtype is within |ref| * u of the exact value.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


# ---- FP4 / INT4 ------------------------------------------------------------------------------------

def make_weights(fmt: str, K: int, N: int, group_size: int, dtype: torch.dtype, device="cpu"):
    """Random quantized weights plus their fp32 dense reference ``[K, N]`` (plain round to nearest:
    kernels need valid codes, not the best ones, and the scale search only adds time). Affine
    weights also carry ``"mag"``, ``|s q| + |b|`` (the module docstring's error bounds)."""
    w = torch.randn(K, N)
    if fmt == "fp4":
        B, s = quantize_fp4(w, group_size, scale_dtype=dtype, search=False)
        ref = dequant_fp4_reference(B, s, group_size)
        return {"B": B.to(device), "scales": s.to(device), "zeros": None, "ref": ref}
    if fmt == "affine":
        B, s, b = quantize_affine(w + 0.5, group_size, scale_dtype=dtype, search=False)  # offsets of both signs
        ref = dequant_affine_reference(B, s, b, group_size)
        sq = unpack_int4(B).float() * s.float().repeat_interleave(group_size, 0)
        mag = sq.abs() + b.float().abs().repeat_interleave(group_size, 0)
        return {"B": B.to(device), "scales": s.to(device), "offsets": b.to(device), "ref": ref, "mag": mag}
    B, s, z = quantize_u4(w, group_size, scale_dtype=dtype, search=False)
    ref = dequant_u4_reference(B, s, z, group_size)
    return {"B": B.to(device), "scales": s.to(device), "zeros": z.to(device), "ref": ref}


def reference_gemm(A: torch.Tensor, W: torch.Tensor, bias=None) -> torch.Tensor:
    out = A.float().cpu() @ W.float().cpu()
    if bias is not None:
        out = out + bias.float().cpu()
    return out


def gemm_error_bound(A: torch.Tensor, W: torch.Tensor, ref: torch.Tensor, bias=None, exact_products=True,
                     extra_weight_rounding=0.0, W_mag=None) -> torch.Tensor:
    """The elementwise bound of the module docstring. ``extra_weight_rounding``: relative error of
    the reference weight itself against the kernel's (trellis: a few fp32 roundings). ``W_mag``:
    the weight magnitudes of the sum (default ``|W|``; affine: ``|s q| + |b|``)."""
    u = UNIT_ROUNDOFF[A.dtype]
    K = A.shape[1]
    mag = A.double().abs().cpu() @ (W.abs() if W_mag is None else W_mag).double().cpu()
    if exact_products:
        per_term = K * 2.0**-24 + extra_weight_rounding
    else:
        per_term = 2 * u + K * 2.0**-23 + extra_weight_rounding
    tol = ref.double().abs() * u * 2 + mag * per_term + 1e-6
    if bias is not None:
        tol = tol + bias.double().abs().cpu() * u
    return tol


def assert_within(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor):
    out = out.double().cpu()
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    assert torch.isfinite(out).all(), "non-finite output (unwritten element or race)"
    if out.numel() == 0:
        return
    err = (out - ref.double()).abs()
    worst = (err - tol).max().item()
    assert worst <= 0, (f"{int((err > tol).sum())} elements off; max error {err.max().item():.3g}, "
                        f"max |ref| {ref.abs().max().item():.3g} (worst excess {worst:.3g})")


def assert_gemm_close(out: torch.Tensor, A: torch.Tensor, W: torch.Tensor, bias=None, exact_products=True,
                      W_mag=None):
    """``out`` against ``A @ W + bias`` within :func:`gemm_error_bound`."""
    ref = reference_gemm(A, W, bias)
    assert_within(out, ref, gemm_error_bound(A, W, ref, bias, exact_products, W_mag=W_mag))


# ---- trellis -----------------------------------------------------------------------------------------

# Relative error of one reference trellis weight, grid * scale * su * sv in fp32, against the same
# product formed in another order: three roundings.
TRELLIS_WEIGHT_ROUNDING = 3 * 2.0**-24


def random_trellis(K, N, bits, group_size, seed=0, experts=None):
    """Random indices / scales / grid and non-trivial su, sv (any finite values are legal):
    ``(packed_indices, scales, grid, su, sv)``, each with a leading expert dim when ``experts``."""
    g = torch.Generator().manual_seed(seed)

    def one():
        idx = torch.randint(0, 1 << bits, (K, N), generator=g)
        return (trellis_format.pack_indices(idx, bits),
                torch.rand(trellis_format.num_groups(K, group_size), N, generator=g) * 0.2 + 0.01,
                torch.randn(1 << bits, generator=g),
                torch.randn(K, generator=g).sign() * (1 + 0.1 * torch.rand(K, generator=g)),
                torch.randn(N, generator=g).sign() * (1 + 0.1 * torch.rand(N, generator=g)))

    if experts is None:
        return one()
    parts = [one() for _ in range(experts)]
    return tuple(torch.stack([p[i] for p in parts]) for i in range(5))


def dequant_ref(t, K, N, bits, gs):
    """The fp64 copy of the plain-torch dense trellis weight ``[K, N]``."""
    return trellis_format.dequant_trellis_reference(*t, K, N, bits, gs).double()


def assert_trellis_gemm_close(out, A, W, exact_products=True):
    ref = A.double() @ W
    assert_within(out, ref, gemm_error_bound(A, W, ref, exact_products=exact_products,
                                             extra_weight_rounding=TRELLIS_WEIGHT_ROUNDING))


def moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs):
    """Token-by-token float64 reference on dequantized expert weights."""
    E = gate[0].shape[0]
    Wg = [dequant_ref(tuple(p[e] for p in gate), H, I, bits, gs) for e in range(E)]
    Wu = [dequant_ref(tuple(p[e] for p in up), H, I, bits, gs) for e in range(E)]
    Wd = [dequant_ref(tuple(p[e] for p in down), I, H, bits, gs) for e in range(E)]
    xd = x.double()
    y = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(xd[t] @ Wg[e]) * (xd[t] @ Wu[e])
            y[t] += float(probs[t, j]) * (h @ Wd[e])
    return y


def moe_case(T, H, I, E, top_k, bits, gs, routing, seed=0):
    """Random experts and a routing: ``random``, ``some_empty`` (experts E/2.. get no token) or
    ``all_to_one`` (every token's first choice is expert E-1, its second expert 0)."""
    g = torch.Generator().manual_seed(seed)
    gate = random_trellis(H, I, bits, gs, seed=seed + 1, experts=E)
    up = random_trellis(H, I, bits, gs, seed=seed + 2, experts=E)
    down = random_trellis(I, H, bits, gs, seed=seed + 3, experts=E)
    if routing == "all_to_one":
        ids = torch.stack([torch.arange(top_k)] * T) if top_k > 1 else torch.full((T, 1), E - 1)
        ids[:, 0] = E - 1
        if top_k > 1:
            ids[:, 1] = 0
    elif routing == "some_empty":
        ids = torch.stack([torch.randperm(E // 2, generator=g)[:top_k] for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(T)])
    probs = torch.softmax(torch.randn(T, top_k, generator=g), -1)
    return gate, up, down, ids, probs


# MoE output error relative to the output's scale: the kernels work in fp32 and round y once to the
# activation dtype (eps = 2u per element); GPU-style tiles also round x, the SwiGLU activations and
# the weights to that dtype, errors of eps relative to the largest outputs (1.5 eps max|ref|).
MOE_EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 1e-5}


def assert_moe_close(y, ref, dtype, exact_products=True):
    eps = MOE_EPS[dtype]
    ref = ref.double()
    tol = eps * (ref.abs() + ref.abs().max() * (0.125 if exact_products else 1.5)) + 1e-6
    assert y.dtype == dtype
    assert_within(y, ref, tol)
