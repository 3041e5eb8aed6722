"""Python faces of the ``torch.ops.marlin`` ops, their fake (meta) kernels and their autograd key.

The fake kernels only compute output shapes and dtypes, so ``torch.compile`` can trace modules
that call the ops, with symbolic M included. Argument checking lives in the C++ op.

The ops themselves have no gradient formula: each gets a fallthrough kernel at the Autograd key,
so their outputs never require grad and the call costs nothing extra, instead of torch's
not-implemented fallback, which records a node that warns at backward and returns no gradient.
The modules give their input a gradient through :func:`frozen_weight_linear`: the weights are
frozen quantized buffers, so the backward pass needs only ``grad_y @ W``, computed from the
dense weight the dequant op rebuilds on the layer's device (an adapter such as LoRA on top of a
quantized base trains this way).
"""

from typing import Optional

import torch

from . import _C  # noqa: F401  (the ops must be registered before register_fake)
from .metal_fallback import run as _run  # mps: the plain-torch path when a Metal kernel cannot run

OPS = ("gemm_fp4", "gemm_u4", "dequant_fp4", "dequant_u4", "gemm_affine", "dequant_affine", "gemm_trellis", "dequant_trellis", "moe_trellis",
       "rans_encode", "rans_decode", "gemm_rans")

_autograd = torch.library.Library("marlin", "IMPL")
for _op in OPS:
    _autograd.impl(_op, torch.library.fallthrough_kernel, "Autograd")


class _FrozenWeightLinear(torch.autograd.Function):
    """``y`` (already computed by a quantized op) recorded as ``x @ W^T (+ bias)``: the backward
    pass gives ``x`` the gradient ``grad_y @ W`` and a trainable bias ``grad_y`` summed over rows.
    ``dense_weight(dtype)`` returns ``W`` ``[N, K]`` on ``x``'s device, from scales in ``dtype`` (the
    gradient's, as the forward pass casts them to the input's); it runs only in the backward pass,
    so the forward pass keeps the fused kernel and allocates nothing extra."""

    @staticmethod
    def forward(ctx, y, x, bias, dense_weight):
        ctx.dense_weight = dense_weight
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_bias = None
        g = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            # In the gradient's dtype: matmul accumulates 16-bit products in fp32.
            w = ctx.dense_weight(g.dtype)
            grad_x = (g @ w.to(g.dtype)).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[2]:
            grad_bias = g.float().sum(0).to(ctx.bias_dtype)
        # y's own history (a bias added after the op, in the trellis module) gets the gradient as is.
        return grad if ctx.needs_input_grad[0] else None, grad_x, grad_bias, None


def frozen_weight_linear(y: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], dense_weight,
                         layer: str, quantized: dict) -> torch.Tensor:
    """``y``, with ``x`` (and a bias that requires grad) given gradients as for ``x @ W^T + bias``.

    ``quantized`` names the layer's quantized tensors: none may require grad (they are codes and
    their scales, which a gradient step cannot update), so asking for their gradient raises here,
    naming the tensor, instead of training nothing."""
    if not torch.is_grad_enabled():
        return y
    for name, t in quantized.items():
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"{layer}: {name} requires grad, but the quantized weights are frozen: train an adapter on top "
                f"of the layer (LoRA) and call {name}.requires_grad_(False)")
    trainable_bias = bias is not None and bias.requires_grad
    if not (x.requires_grad or trainable_bias):
        return y
    return _FrozenWeightLinear.apply(y, x, bias if trainable_bias else None, dense_weight)


class _NoInputGradient(torch.autograd.Function):
    """Identity on the layer's output, recorded against its input: the backward pass raises."""

    @staticmethod
    def forward(ctx, y, x, layer):
        ctx.layer = layer
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            f"{ctx.layer}: has no gradient with respect to its input (only MarlinLinear and TrellisLinear do). "
            "Run it under torch.no_grad() or torch.inference_mode(), or detach its input.")


def no_input_gradient(y: torch.Tensor, x: torch.Tensor, layer: str) -> torch.Tensor:
    """``y`` unchanged, except that when ``x`` requires grad, a backward pass through ``y`` raises
    (naming ``layer``) instead of silently giving ``x`` no gradient."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _NoInputGradient.apply(y, x, layer)
    return y


def check_same_device(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """Tensors on different devices would otherwise reach the Meta/fake kernel silently (the
    dispatcher prefers Meta when any argument is a meta tensor)."""
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                             "all tensors must be on one device")


@torch.library.register_fake("marlin::gemm_fp4")
def _gemm_fp4_fake(A, B_packed, scales, group_size, bias=None):
    check_same_device("gemm_fp4", "A", A, B_packed=B_packed, scales=scales, bias=bias)
    return A.new_empty((A.shape[0], B_packed.shape[1]))


@torch.library.register_fake("marlin::gemm_u4")
def _gemm_u4_fake(A, B_packed, scales, zeros, group_size, bias=None):
    check_same_device("gemm_u4", "A", A, B_packed=B_packed, scales=scales, zeros=zeros, bias=bias)
    return A.new_empty((A.shape[0], B_packed.shape[1]))


@torch.library.register_fake("marlin::dequant_fp4")
def _dequant_fp4_fake(B_packed, scales, group_size):
    check_same_device("dequant_fp4", "B_packed", B_packed, scales=scales)
    return scales.new_empty((B_packed.shape[0] * 8, B_packed.shape[1]))


@torch.library.register_fake("marlin::dequant_u4")
def _dequant_u4_fake(B_packed, scales, zeros, group_size):
    check_same_device("dequant_u4", "B_packed", B_packed, scales=scales, zeros=zeros)
    return scales.new_empty((B_packed.shape[0] * 8, B_packed.shape[1]))


@torch.library.register_fake("marlin::gemm_affine")
def _gemm_affine_fake(A, B_packed, scales, offsets, group_size, bias=None):
    check_same_device("gemm_affine", "A", A, B_packed=B_packed, scales=scales, offsets=offsets, bias=bias)
    return A.new_empty((A.shape[0], B_packed.shape[1]))


@torch.library.register_fake("marlin::dequant_affine")
def _dequant_affine_fake(B_packed, scales, offsets, group_size):
    check_same_device("dequant_affine", "B_packed", B_packed, scales=scales, offsets=offsets)
    return scales.new_empty((B_packed.shape[0] * 8, B_packed.shape[1]))


def gemm_fp4(A: torch.Tensor, B_packed: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``A[M, K] @ dequant_fp4(B_packed, scales)[K, N] (+ bias)`` in A's dtype, fp32 accumulation."""
    return _run(torch.ops.marlin.gemm_fp4.default, A, B_packed, scales, group_size, bias)


def gemm_u4(A: torch.Tensor, B_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group_size: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``A[M, K] @ dequant_u4(B_packed, scales, zeros)[K, N] (+ bias)``."""
    return _run(torch.ops.marlin.gemm_u4.default, A, B_packed, scales, zeros, group_size, bias)


def dequant_fp4(B_packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return _run(torch.ops.marlin.dequant_fp4.default, B_packed, scales, group_size)


def dequant_u4(B_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    return _run(torch.ops.marlin.dequant_u4.default, B_packed, scales, zeros, group_size)


def gemm_affine(A: torch.Tensor, B_packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                group_size: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``A[M, K] @ dequant_affine(B_packed, scales, offsets)[K, N] (+ bias)``."""
    return _run(torch.ops.marlin.gemm_affine.default, A, B_packed, scales, offsets, group_size, bias)


def dequant_affine(B_packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """``W[k, n] = scales[g, n] * q[k, n] + offsets[g, n]``, ``g = k // group_size``, in scales' dtype."""
    return _run(torch.ops.marlin.dequant_affine.default, B_packed, scales, offsets, group_size)


# ---- trellis codebook family (csrc/ops/trellis.cpp) ----------------------------------------------

_TRELLIS_PARTS = ("packed_indices", "scales", "grid", "su", "sv")


@torch.library.register_fake("marlin::gemm_trellis")
def _gemm_trellis_fake(A, packed_indices, scales, grid, su, sv, K, N, bits, group_size):
    check_same_device("gemm_trellis", "A", A, **dict(zip(_TRELLIS_PARTS, (packed_indices, scales, grid, su, sv))))
    return A.new_empty((A.shape[0], N))


@torch.library.register_fake("marlin::dequant_trellis")
def _dequant_trellis_fake(packed_indices, scales, grid, su, sv, K, N, bits, group_size):
    check_same_device("dequant_trellis", "packed_indices", packed_indices, scales=scales, grid=grid, su=su, sv=sv)
    return scales.new_empty((K, N))


@torch.library.register_fake("marlin::moe_trellis")
def _moe_trellis_fake(x, *args):
    names = [f"{proj}_{part}" for proj in ("gate", "up", "down") for part in _TRELLIS_PARTS]
    names += ["expert_ids", "expert_probs"]
    check_same_device("moe_trellis", "x", x, **dict(zip(names, args)))
    return x.new_empty(x.shape)


def gemm_trellis(A, packed_indices, scales, grid, su, sv, K: int, N: int, bits: int, group_size: int):
    """``A[M, K] @ W[K, N]``, ``W = grid[idx] * scales * su * sv`` (docs/formats.md), A's dtype out."""
    return _run(torch.ops.marlin.gemm_trellis.default, A, packed_indices, scales, grid, su, sv, K, N, bits, group_size)


def dequant_trellis(packed_indices, scales, grid, su, sv, K: int, N: int, bits: int, group_size: int):
    """Dense f32 ``W[K, N]`` of a trellis matrix."""
    return _run(torch.ops.marlin.dequant_trellis.default, packed_indices, scales, grid, su, sv, K, N, bits, group_size)


def moe_trellis(x, gate, up, down, expert_ids, expert_probs, intermediate_size: int, bits: int, group_size: int):
    """Routed SwiGLU MoE. ``gate``/``up``/``down`` are 5-tuples ``(packed_indices, scales, grid, su, sv)``
    with a leading expert dimension; gate/up are ``W[hidden, intermediate]``, down ``W[intermediate, hidden]``.
    ``y[t] = sum_j expert_probs[t, j] * (silu(x_t @ G_e) * (x_t @ U_e)) @ D_e``, ``e = expert_ids[t, j]``."""
    return _run(torch.ops.marlin.moe_trellis.default, x, *gate, *up, *down, expert_ids, expert_probs, intermediate_size, bits,
                                        group_size)


# ---- rANS-coded 4-bit codes (csrc/ops/rans.cpp; docs/formats.md, "rANS-coded 4-bit codes") ---------

def _rans_tiles(K, N, channels_per_tile):
    C = channels_per_tile if channels_per_tile > 0 else max(1, -(-32 * 1024 // K))
    return -(-N // C)


@torch.library.register_fake("marlin::rans_encode")
def _rans_encode_fake(B_packed, channels_per_tile):
    K, N = B_packed.shape[0] * 8, B_packed.shape[1]
    T = _rans_tiles(K, N, channels_per_tile)
    W = torch.library.get_ctx().new_dynamic_size()  # the coded length depends on the codes
    return (B_packed.new_empty((W,), dtype=torch.int16), B_packed.new_empty((T + 1,), dtype=torch.int32),
            B_packed.new_empty((T, 32), dtype=torch.int32), B_packed.new_empty((T, 16), dtype=torch.int16))


@torch.library.register_fake("marlin::rans_decode")
def _rans_decode_fake(words, word_offsets, states, freqs, K, N, channels_per_tile):
    check_same_device("rans_decode", "words", words, word_offsets=word_offsets, states=states, freqs=freqs)
    return words.new_empty((K // 8, N), dtype=torch.int32)


@torch.library.register_fake("marlin::gemm_rans")
def _gemm_rans_fake(A, words, word_offsets, states, freqs, scales, zeros, offsets, format, K, N, group_size,
                    channels_per_tile, bias=None):
    check_same_device("gemm_rans", "A", A, words=words, word_offsets=word_offsets, states=states, freqs=freqs,
                      scales=scales, zeros=zeros, offsets=offsets, bias=bias)
    return A.new_empty((A.shape[0], N))


def rans_encode(B_packed: torch.Tensor, channels_per_tile: Optional[int] = None):
    """``(words, word_offsets, states, freqs)`` of the codes of ``B_packed`` int32 ``[K/8, N]`` (CPU),
    bit for bit :func:`torch_marlin.formats.rans.encode`; ``None``: the default tile width."""
    return torch.ops.marlin.rans_encode(B_packed, 0 if channels_per_tile is None else channels_per_tile)


def rans_decode(words, word_offsets, states, freqs, K: int, N: int, channels_per_tile: int) -> torch.Tensor:
    """``B_packed`` int32 ``[K/8, N]`` from a coded layer. On the CPU every stream is checked: a corrupted
    one raises ValueError naming its tile."""
    return _run(torch.ops.marlin.rans_decode.default, words, word_offsets, states, freqs, K, N, channels_per_tile)


def gemm_rans(A, words, word_offsets, states, freqs, scales, zeros, offsets, format: str, K: int, N: int,
              group_size: int, channels_per_tile: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``A[M, K] @ W[K, N] (+ bias)`` with ``W`` the ``format`` (``"fp4"``, ``"u4"`` with ``zeros``,
    ``"affine"`` with ``offsets``) dequantization of the decoded codes: the values of ``gemm_fp4`` /
    ``gemm_u4`` / ``gemm_affine`` on ``rans_decode``'s ``B_packed``, up to fp32 summation order."""
    return _run(torch.ops.marlin.gemm_rans.default, A, words, word_offsets, states, freqs, scales, zeros, offsets, format, K, N,
                                      group_size, channels_per_tile, bias)
