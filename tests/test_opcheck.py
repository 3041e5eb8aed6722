"""``torch.library.opcheck`` on every ``torch.ops.marlin`` op, on every backend whose dispatcher
runs it (CPU always; CUDA and MPS where present): the schema, the fake kernel against the real
one (shapes, dtypes, strides, symbolic sizes), the autograd registration and AOT dispatch.

Every floating-point input requires grad, so the autograd registration check has something to
check: the ops are inference-only and fall through at the Autograd key (torch_marlin/ops.py).
"""

import itertools

import pytest
import torch

from backends import DEVICE_BACKENDS
from reference import make_weights, moe_case, random_trellis

# torch warns (at backward) about an op without an autograd kernel; here that is a failure.
pytestmark = pytest.mark.filterwarnings("error:.*an autograd kernel was not registered:UserWarning")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def device_cases(values):
    out = []
    for b in DEVICE_BACKENDS:
        for v in values:
            vid = "-".join(str(x).replace("torch.", "") for x in v)
            out.append(pytest.param(b.values[0], *v, id=f"{b.id}-{vid}", marks=b.marks))
    return out


def opcheck(backend, op, args):
    backend.require(op)
    dev = backend.device
    moved = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    moved = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in moved)
    torch.library.opcheck(getattr(torch.ops.marlin, op).default, moved)


@pytest.mark.parametrize("backend, fmt, dtype, M, with_bias", device_cases(list(itertools.product(
    ["fp4", "u4", "affine"], DTYPES, [0, 5], [False, True]))))
def test_gemm(backend, fmt, dtype, M, with_bias):
    K, N, g = 128, 48, 32
    w = make_weights(fmt, K, N, g, dtype)
    A = torch.randn(M, K).to(dtype)
    bias = torch.randn(N).to(dtype) if with_bias else None
    if fmt == "fp4":
        opcheck(backend, "gemm_fp4", (A, w["B"], w["scales"], g, bias))
    elif fmt == "affine":
        opcheck(backend, "gemm_affine", (A, w["B"], w["scales"], w["offsets"], g, bias))
    else:
        opcheck(backend, "gemm_u4", (A, w["B"], w["scales"], w["zeros"], g, bias))


@pytest.mark.parametrize("backend, fmt, dtype", device_cases(list(itertools.product(["fp4", "u4", "affine"], DTYPES))))
def test_dequant(backend, fmt, dtype):
    K, N, g = 128, 48, 32
    w = make_weights(fmt, K, N, g, dtype)
    if fmt == "fp4":
        opcheck(backend, "dequant_fp4", (w["B"], w["scales"], g))
    elif fmt == "affine":
        opcheck(backend, "dequant_affine", (w["B"], w["scales"], w["offsets"], g))
    else:
        opcheck(backend, "dequant_u4", (w["B"], w["scales"], w["zeros"], g))


@pytest.mark.parametrize("backend, dtype, M", device_cases(list(itertools.product(DTYPES, [0, 5]))))
def test_gemm_trellis(backend, dtype, M):
    K, N, bits, gs = 64, 48, 3, 32
    t = random_trellis(K, N, bits, gs)
    opcheck(backend, "gemm_trellis", (torch.randn(M, K).to(dtype), *t, K, N, bits, gs))


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_dequant_trellis(backend):
    K, N, bits, gs = 64, 48, 3, 32
    opcheck(backend, "dequant_trellis", (*random_trellis(K, N, bits, gs), K, N, bits, gs))


@pytest.mark.parametrize("backend, dtype, T", device_cases(list(itertools.product(DTYPES, [0, 3]))))
def test_moe_trellis(backend, dtype, T):
    H, I, E, top_k, bits, gs = 64, 48, 3, 2, 3, 32
    gate, up, down, ids, probs = moe_case(max(T, 1), H, I, E, top_k, bits, gs, "random")
    x = torch.randn(T, H).to(dtype)
    opcheck(backend, "moe_trellis", (x, *gate, *up, *down, ids[:T], probs[:T], I, bits, gs))


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_outputs_never_require_grad(backend):
    w = make_weights("fp4", 64, 16, 32, torch.float32)
    A = torch.randn(3, 64, device=backend.device, requires_grad=True)
    y = torch.ops.marlin.gemm_fp4(A, w["B"].to(backend.device), w["scales"].to(backend.device), 32)
    assert not y.requires_grad and y.grad_fn is None


def rans_layer(fmt, dtype, K=64, N=10, gs=32, C=3):
    from torch_marlin.formats import unpack_int4
    from torch_marlin.formats import rans

    w = make_weights(fmt, K, N, gs, dtype)
    e = rans.encode(unpack_int4(w["B"]).numpy(), C)
    codes = tuple(torch.from_numpy(e[k].copy()) for k in ("words", "word_offsets", "states", "freqs"))
    return w, codes


@pytest.mark.parametrize("backend, fmt, dtype, M", device_cases(list(itertools.product(
    ["fp4", "u4", "affine"], DTYPES, [0, 5, 20]))))
def test_gemm_rans(backend, fmt, dtype, M):
    K, N, gs, C = 64, 10, 32, 3
    w, codes = rans_layer(fmt, dtype, K, N, gs, C)
    bias = torch.randn(N).to(dtype) if M == 5 else None
    opcheck(backend, "gemm_rans", (torch.randn(M, K).to(dtype), *codes, w["scales"], w["zeros"] if fmt == "u4" else None,
                                   w["offsets"] if fmt == "affine" else None, fmt, K, N, gs, C, bias))


@pytest.mark.parametrize("backend", DEVICE_BACKENDS)
def test_rans_decode(backend):
    _, codes = rans_layer("fp4", torch.float32)
    opcheck(backend, "rans_decode", (*codes, 64, 10, 3))


def test_rans_encode():
    w = make_weights("fp4", 64, 10, 32, torch.float32)
    torch.library.opcheck(torch.ops.marlin.rans_encode.default, (w["B"], 3))
