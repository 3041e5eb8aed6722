"""The plain-torch path that keeps a model running on ``mps`` when a Metal kernel cannot.

The MPS backend raises ``NotImplementedError`` (and nothing else raises it) when it cannot run a
kernel on this Mac: a ``metal/*.metal`` library that did not compile (the message names the file
and carries the compiler's log), a pipeline that could not be created, a GPU that is not an Apple
GPU, a kernel needing a newer macOS, or an extension built without the MPS backend (then the
dispatcher itself raises it). :func:`run` catches exactly that, on ``mps`` only, and computes the
op with torch ops on the same device instead: the weight dequantized from its codes
(``torch_marlin.formats``, the references the tests hold the kernels to), then ``torch.matmul``
with fp32 accumulation. It is correct and much slower than the fused kernels; the first such
failure of a process gives one :class:`MetalFallbackWarning` that says what failed and how to
report it. ``python -m torch_marlin.selfcheck --device mps`` lists which ops run natively and which
fall back.

Elsewhere (``cpu``, ``cuda``) :func:`run` calls the op and nothing more: the device type is fixed
for a compiled graph, so ``torch.compile`` traces the op with no graph break. On ``mps`` under
``torch.compile`` the decision is the process's: an op that has failed before is traced as its
fallback, any other as the native op.
"""

import warnings

import torch

from .formats.fp4 import dequant_fp4_reference
from .formats.trellis import dequant_trellis_reference
from .formats.int4_packing import unpack_int4
from .formats.u4 import dequant_u4_reference

# Device types whose native-op failures fall back (tests add "cpu" to exercise the logic).
FALLBACK_DEVICES = ("mps",)
REPORT_HINT = ("please report it: run `python -m torch_marlin.selfcheck --device mps --json selfcheck.json` and "
               "open an issue with its output and selfcheck.json (docs/metal.md, \"When the selfcheck fails\")")


class MetalFallbackWarning(RuntimeWarning):
    """A native op could not run on this device; its plain-torch path runs instead."""


_unavailable = {}  # op name -> the native error's message, for the process
_warned = []
_fallback_calls = [0, ""]  # calls that ran a plain-torch path, and the latest native error


def unavailable() -> dict:
    """``{op name: why}`` of the ops that fell back in this process so far."""
    return dict(_unavailable)


def fallback_calls():
    """``(number of calls that ran a plain-torch path so far, the latest one's native error)``."""
    return tuple(_fallback_calls)


def _record(name: str, error: BaseException) -> None:
    message = str(error).strip() or type(error).__name__
    _unavailable.setdefault(name, message)
    _fallback_calls[:] = [_fallback_calls[0] + 1, message]
    if _warned:
        return
    _warned.append(name)
    lines = message.splitlines()
    shown = "\n".join(lines[:40]) + ("\n..." if len(lines) > 40 else "")
    warnings.warn(f"torch_marlin: marlin::{name} cannot run its Metal kernel on this machine:\n{shown}\n"
                  f"This process computes it (and any other op that fails so) with plain torch on the same device "
                  f"(dequantize + torch.matmul): correct, but much slower. To get the fast kernels, {REPORT_HINT}.",
                  MetalFallbackWarning, stacklevel=3)


def run(op, *args):
    """``op(*args)`` (an ``torch.ops.marlin`` overload whose first argument is a tensor on the op's
    device), or on ``mps``, when the native op raises ``NotImplementedError``, its plain-torch path."""
    if args[0].device.type not in FALLBACK_DEVICES:
        return op(*args)
    return _run_or_fall_back(op, args)


def _run_or_fall_back(op, args):
    name = op._opname
    if torch.compiler.is_compiling():
        return TORCH_PATHS[name](*args) if name in _unavailable else op(*args)
    try:
        return op(*args)
    except NotImplementedError as e:
        # Tried again on every call: a failure can be one kernel of the op's family (one shape).
        _record(name, e)
    return TORCH_PATHS[name](*args)


# ---- the plain-torch paths (the ops' schemas, csrc/ops/*.cpp) ---------------------------------------

def _linear(A, W, bias):
    """``A @ W (+ bias)`` accumulated in fp32, in A's dtype (the ops' contract)."""
    y = torch.matmul(A.float(), W)
    if bias is not None:
        y = y + bias.float()
    return y.to(A.dtype)


def _gemm_fp4(A, B_packed, scales, group_size, bias=None):
    return _linear(A, dequant_fp4_reference(B_packed, scales, group_size), bias)


def _gemm_u4(A, B_packed, scales, zeros, group_size, bias=None):
    return _linear(A, dequant_u4_reference(B_packed, scales, zeros, group_size), bias)


def _affine_weight(B_packed, scales, offsets, group_size):
    """``q * scale + offset`` in fp32 (MPS has no float64: the reference's exact product is rounded
    here once more, at most an fp32 ulp away from the kernels' fused multiply-add)."""
    s = scales.float().repeat_interleave(group_size, dim=0)
    b = offsets.float().repeat_interleave(group_size, dim=0)
    return torch.addcmul(b, unpack_int4(B_packed).float(), s)


def _gemm_affine(A, B_packed, scales, offsets, group_size, bias=None):
    return _linear(A, _affine_weight(B_packed, scales, offsets, group_size), bias)


def _dequant_fp4(B_packed, scales, group_size):
    return dequant_fp4_reference(B_packed, scales, group_size).to(scales.dtype)


def _dequant_u4(B_packed, scales, zeros, group_size):
    return dequant_u4_reference(B_packed, scales, zeros, group_size).to(scales.dtype)


def _dequant_affine(B_packed, scales, offsets, group_size):
    return _affine_weight(B_packed, scales, offsets, group_size).to(scales.dtype)


def _gemm_trellis(A, packed, scales, grid, su, sv, K, N, bits, group_size):
    return _linear(A, dequant_trellis_reference(packed, scales, grid, su, sv, K, N, bits, group_size), None)


def _dequant_trellis(packed, scales, grid, su, sv, K, N, bits, group_size):
    return dequant_trellis_reference(packed, scales, grid, su, sv, K, N, bits, group_size)


def _moe_trellis(x, *args):
    """Each routed expert once, on the rows routed to it: ``y[t] = sum_j p[t, j] * (silu(x_t G_e) *
    (x_t U_e)) D_e`` in fp32."""
    gate, up, down = args[0:5], args[5:10], args[10:15]
    expert_ids, expert_probs, intermediate_size, bits, group_size = args[15:]
    T, H = x.shape
    xf = x.float()
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in torch.unique(expert_ids).tolist():
        token, slot = (expert_ids == e).nonzero(as_tuple=True)
        w = [dequant_trellis_reference(*(p[e] for p in proj), k, n, bits, group_size)
             for proj, (k, n) in ((gate, (H, intermediate_size)), (up, (H, intermediate_size)),
                                  (down, (intermediate_size, H)))]
        xe = xf[token]
        h = torch.nn.functional.silu(xe @ w[0]) * (xe @ w[1])
        y.index_add_(0, token, (h @ w[2]) * expert_probs[token, slot].float()[:, None])
    return y.to(x.dtype)


def _decoded_codes(words, word_offsets, states, freqs, K, N, channels_per_tile):
    """``B_packed`` decoded by the CPU's rANS decoder (which checks every stream), on the codes' device."""
    return torch.ops.marlin.rans_decode(words.cpu(), word_offsets.cpu(), states.cpu(), freqs.cpu(), K, N,
                                        channels_per_tile).to(words.device)


def _rans_decode(words, word_offsets, states, freqs, K, N, channels_per_tile):
    return _decoded_codes(words, word_offsets, states, freqs, K, N, channels_per_tile)


def _gemm_rans(A, words, word_offsets, states, freqs, scales, zeros, offsets, format, K, N, group_size,
               channels_per_tile, bias=None):
    B_packed = _decoded_codes(words, word_offsets, states, freqs, K, N, channels_per_tile)
    if format == "fp4":
        return _gemm_fp4(A, B_packed, scales, group_size, bias)
    if format == "u4":
        return _gemm_u4(A, B_packed, scales, zeros, group_size, bias)
    return _gemm_affine(A, B_packed, scales, offsets, group_size, bias)


TORCH_PATHS = {
    "gemm_fp4": _gemm_fp4, "gemm_u4": _gemm_u4, "gemm_affine": _gemm_affine,
    "dequant_fp4": _dequant_fp4, "dequant_u4": _dequant_u4, "dequant_affine": _dequant_affine,
    "gemm_trellis": _gemm_trellis, "dequant_trellis": _dequant_trellis, "moe_trellis": _moe_trellis,
    "rans_decode": _rans_decode, "gemm_rans": _gemm_rans,
}
