"""Gradients through the quantized layers with frozen weights (adapter training): the input's
gradient equals ``grad_y @ W`` for the layer's dense weight, on every device the modules run on;
a bias set to require grad gets its gradient; quantized tensors that require grad raise.

The reference is plain torch autograd through ``x @ W^T`` with ``W`` from the module's plain-torch
``dequantized_weight()`` (not the dequant op the backward pass uses)."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_marlin.modules.trellis as tm
from torch_marlin import MarlinLinear

from backends import CPU, CUDA, MPS

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    pytest.param("mps", marks=pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU")),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to the gradient's largest entry: fp32 differs from the fp64 reference by summation order
# only; 16-bit gradients are rounded to their dtype (2^-8 for bf16) and the weight is used in it.
RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def linear(K, N, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
    return lin


LAYERS = {
    "fp4": lambda lin, dtype: MarlinLinear.from_linear(lin, format="fp4", group_size=32, dtype=dtype),
    "u4": lambda lin, dtype: MarlinLinear.from_linear(lin, format="u4", group_size=32, dtype=dtype),
    "affine": lambda lin, dtype: MarlinLinear.from_linear(lin, format="affine", group_size=32, dtype=dtype),
    "trellis3": lambda lin, dtype: tm.TrellisLinear.from_linear(lin.to(dtype), bits=3, group_size=32),
    "trellis4 unrotated": lambda lin, dtype: tm.TrellisLinear.from_linear(lin.to(dtype), bits=4, group_size=32,
                                                                          rotate=False),
}


@functools.lru_cache(maxsize=None)
def quantized(kind, scale_dtype, K, N, bias):
    return LAYERS[kind](linear(K, N, bias), scale_dtype)


def make(kind, dtype, device, K=96, N=40, bias=True):
    """A fresh copy of a quantized layer on ``device`` (16-bit scales for MarlinLinear in 16-bit
    dtypes, fp16 for fp32: the gradient uses the weight at that precision); skips where the
    device has no kernels for the layer."""
    {"cpu": CPU, "cuda": CUDA, "mps": MPS}[device].require("gemm_trellis" if kind.startswith("trellis") else "gemm_u4")
    scale_dtype = dtype if dtype != torch.float32 else torch.float16
    return copy.deepcopy(quantized(kind, scale_dtype, K, N, bias)).to(device)


def assert_close_rel(actual, expected, dtype):
    expected = expected.double()
    tol = RTOL[dtype] * float(expected.abs().max())
    err = float((actual.double() - expected).abs().max())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("rows", [(2, 3), (5, 7)], ids=["decode", "prefill"])  # 6 and 35 rows: both kernel paths
def test_input_gradient_matches_dense_weight(kind, dtype, device, rows):
    q = make(kind, dtype, device)
    x = torch.randn(*rows, 96, device=device).to(dtype).requires_grad_(True)
    g = torch.randn(*rows, 40, device=device).to(dtype)
    (q(x) * g).sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype and x.grad.shape == x.shape
    W = q.dequantized_weight().double().cpu()  # [N, K], plain torch
    assert_close_rel(x.grad.cpu(), g.double().cpu() @ W, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_trainable_bias_gets_its_gradient_and_weights_get_none(kind, device):
    q = make(kind, torch.float32, device)
    q.bias.requires_grad_(True)
    x = torch.randn(5, 96, device=device)  # no input gradient wanted: only the bias trains
    g = torch.randn(5, 40, device=device)
    (q(x) * g).sum().backward()
    assert q.bias.grad.dtype == q.bias.dtype
    torch.testing.assert_close(q.bias.grad.cpu(), g.sum(0).to(q.bias.dtype).cpu())
    for name, t in q.named_buffers():
        if name != "bias":
            assert t.grad is None, name


@pytest.mark.parametrize("device", DEVICES)
def test_lora_adapter_on_a_quantized_base_trains(device):
    """A low-rank adapter beside a frozen u4 layer: its gradients equal those of the same adapter
    beside the dense dequantized weight, and a few steps of SGD lower the loss."""
    torch.manual_seed(0)
    q = make("u4", torch.float32, device, K=64, N=32)
    W = q.dequantized_weight().to(device)
    a = (0.01 * torch.randn(4, 64, device=device)).requires_grad_(True)
    b = torch.zeros(32, 4, device=device, requires_grad=True)
    x, target = torch.randn(16, 64, device=device), torch.randn(16, 32, device=device)

    def loss_fn(base):
        return F.mse_loss(base(x.requires_grad_(False)) + x @ a.t() @ b.t(), target)

    loss_fn(q).backward()
    grads = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    loss_fn(lambda t: F.linear(t, W, q.bias.float())).backward()
    for got, want in zip(grads, (a.grad, b.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    opt = torch.optim.SGD([a, b], lr=0.5)
    first = loss_fn(q).item()
    for _ in range(10):
        opt.zero_grad()
        loss_fn(q).backward()
        opt.step()
    assert loss_fn(q).item() < first


@pytest.mark.parametrize("kind, tensor", [("fp4", "scales"), ("u4", "scales"), ("affine", "offsets"), ("trellis3", "scales"),
                                          ("trellis3", "grid")])
def test_gradient_of_quantized_weights_raises(kind, tensor):
    q = make(kind, torch.float32, "cpu")
    getattr(q, tensor).requires_grad_(True)
    layer = type(q).__name__
    with pytest.raises(RuntimeError, match=f"{layer}: {tensor} requires grad, but the quantized weights are frozen"):
        q(torch.randn(2, 96))
    with torch.no_grad():  # inference is unaffected
        assert q(torch.randn(2, 96)).shape == (2, 40)


def test_no_graph_is_recorded_without_gradients():
    q = make("fp4", torch.float32, "cpu")
    x = torch.randn(2, 96)
    assert q(x).grad_fn is None
    assert q(x.requires_grad_(True)).grad_fn is not None


def test_trellis_moe_backward_raises_instead_of_no_gradient():
    H, I, E = 64, 32, 2
    lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
    moe = tm.TrellisMoE.from_experts([lin(H, I) for _ in range(E)], [lin(H, I) for _ in range(E)],
                                     [lin(I, H) for _ in range(E)], lin(H, E), top_k=1, bits=3, group_size=32,
                                     dtype=torch.float32)
    x = torch.randn(3, H, requires_grad=True)
    with pytest.raises(RuntimeError, match="TrellisMoE: has no gradient with respect to its input"):
        moe(x).sum().backward()
