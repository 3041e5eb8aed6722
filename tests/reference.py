"""Independent references and tolerances shared by the op test files.

The reference of every GEMM is ``torch.matmul`` in fp32 on a weight dequantized by the plain torch
functions of ``torch_marlin.formats`` (never by the kernels under test).
"""

import torch

from torch_marlin.formats import dequant_fp4_reference, dequant_u4_reference, quantize_fp4, quantize_u4

# Unit roundoff of the output dtype: a correctly accumulated result rounded once to the output
# dtype is within |ref| * u of the exact value.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def make_weights(fmt: str, K: int, N: int, group_size: int, dtype: torch.dtype, device="cpu"):
    """Random quantized weights plus their fp32 dense reference ``[K, N]``."""
    w = torch.randn(K, N)
    if fmt == "fp4":
        B, s = quantize_fp4(w, group_size, scale_dtype=dtype)
        ref = dequant_fp4_reference(B, s, group_size)
        return {"B": B.to(device), "scales": s.to(device), "zeros": None, "ref": ref}
    B, s, z = quantize_u4(w, group_size, scale_dtype=dtype)
    ref = dequant_u4_reference(B, s, z, group_size)
    return {"B": B.to(device), "scales": s.to(device), "zeros": z.to(device), "ref": ref}


def reference_gemm(A: torch.Tensor, W: torch.Tensor, bias=None) -> torch.Tensor:
    out = A.float().cpu() @ W.float().cpu()
    if bias is not None:
        out = out + bias.float().cpu()
    return out


def assert_gemm_close(out: torch.Tensor, A: torch.Tensor, W: torch.Tensor, bias=None):
    """Error bound: one rounding of the result to the output dtype (|ref| * u), plus the fp32
    accumulation error of a K-term dot product in any summation order (K * 2^-24 * sum|a||w|,
    the standard worst-case bound), plus the rounding of the bias add."""
    ref = reference_gemm(A, W, bias)
    out = out.float().cpu()
    assert out.shape == ref.shape
    K = A.shape[1]
    mag = A.float().abs().cpu() @ W.float().abs().cpu()
    tol = ref.abs() * UNIT_ROUNDOFF[A.dtype] * 2 + mag * (K * 2.0**-24) + 1e-6
    if bias is not None:
        tol = tol + bias.float().abs().cpu() * UNIT_ROUNDOFF[A.dtype]
    err = (out - ref).abs()
    assert torch.isfinite(out).all()
    worst = (err - tol).max().item() if err.numel() else -1.0
    assert worst <= 0, f"max error {err.max().item():.3g} exceeds bound (worst excess {worst:.3g})"
