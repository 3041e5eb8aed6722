"""Inputs that used to give a silently wrong layer or a misleading error: each now raises one
ValueError naming the argument (or tensor) and what was expected, before any work is done.

* an integer or bool ``dtype`` (every scale would round to 0 and the layer output only its bias);
* GGUF block data whose rows are another shape with the same byte count;
* a weight with inf or NaN (no 4-bit grid holds it);
* a checkpoint whose tensor file lacks a tensor (reported by name, not as "truncated").
"""

import pytest
import torch
from torch import nn

import torch_marlin
from torch_marlin import MarlinLinear, RansLinear, TrellisLinear, patch_model
from torch_marlin.formats.u4 import dequant_u4_reference
from torch_marlin.loaders import build_marlin_linear, from_gguf, from_mlx

BAD_DTYPES = [torch.int8, torch.int32, torch.bool, torch.float64, int]
DTYPE_ERROR = r"dtype must be torch.float16, torch.bfloat16 or torch.float32, got "


def linear(K=64, N=32, bias=True):
    torch.manual_seed(0)
    return nn.Linear(K, N, bias=bias)


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_non_float_dtype_is_refused_by_every_layer_and_entry_point(dtype):
    lin = linear()
    calls = {
        "MarlinLinear.from_linear": lambda: MarlinLinear.from_linear(lin, format="u4", group_size=32, dtype=dtype),
        "MarlinLinear": lambda: MarlinLinear(64, 32, format="fp4", group_size=32, dtype=dtype),
        "RansLinear": lambda: RansLinear(64, 32, format="fp4", group_size=32, channels_per_tile=16, n_words=0,
                                         dtype=dtype),
        "TrellisLinear": lambda: TrellisLinear(64, 32, dtype=dtype),
        "TrellisLinear.from_linear": lambda: TrellisLinear.from_linear(lin, group_size=32, dtype=dtype),
        "build_marlin_linear": lambda: build_marlin_linear("fp4", torch.zeros(32, 64, dtype=torch.uint8),
                                                           torch.ones(32, 2), dtype=dtype),
        "from_mlx": lambda: from_mlx(torch.zeros(32, 8, dtype=torch.int32), torch.ones(32, 2), torch.zeros(32, 2),
                                     group_size=32, dtype=dtype),
        # Checked before the path is looked at: no FileNotFoundError for a path that does not exist.
        "from_pretrained": lambda: torch_marlin.from_pretrained("/nonexistent/model", dtype=dtype),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match=DTYPE_ERROR) as e:
            call()
        assert repr(dtype) in str(e.value), what


def test_patch_model_refuses_a_non_float_dtype_before_touching_the_model():
    model = nn.Sequential(linear(), nn.ReLU(), linear(32, 64))
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=DTYPE_ERROR + "torch.int8"):
        patch_model(model, format="fp4", group_size=32, dtype=torch.int8, progress=False)
    assert all(type(m) is not MarlinLinear for m in model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_float_dtypes_still_quantize_to_the_reference():
    lin = linear()
    x = torch.randn(3, 64)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        q = MarlinLinear.from_linear(lin, format="u4", group_size=32, dtype=dtype)
        w = dequant_u4_reference(q.B_packed, q.scales.float(), q.zeros, 32)  # [K, N] fp32
        ref = x @ w + q.bias.float()
        # The layer runs fp32 activations here; its scales are the stored (rounded) ones.
        torch.testing.assert_close(q(x).float(), ref, rtol=1e-4, atol=1e-4)
        assert q.scales.dtype == dtype and float(q.scales.abs().min()) > 0


def q4_0_blocks(rows, cols):
    """gguf-py's Q4_0 blocks of a random ``[rows, cols]`` weight: uint8 ``[rows, cols / 32 * 18]``."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0), w


def test_gguf_data_of_another_shape_with_the_same_bytes_is_refused():
    gguf = pytest.importorskip("gguf")
    data, _ = q4_0_blocks(256, 256)
    assert data.shape == (256, 144)
    with pytest.raises(ValueError, match=r"weight: Q4_0 data of shape \(256, 144\) is not the 128 rows of 288 bytes "
                                         r"that shape \(128, 512\) needs"):
        from_gguf(data, "Q4_0", (128, 512))
    # Its own shape loads, as gguf-py's own dequantization of the blocks.
    layer = from_gguf(data, "Q4_0", (256, 256), dtype=torch.float32)
    want = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_0))
    torch.testing.assert_close(layer.dequantized_weight().float(), want, rtol=0, atol=0)
    # Flat bytes carry no shape of their own: only the byte count is checked.
    assert from_gguf(data.reshape(-1), "Q4_0", (256, 256)).out_features == 256
    with pytest.raises(ValueError, match=r"needs 36864 bytes .* got 36846"):
        from_gguf(data.reshape(-1)[:-18], "Q4_0", (256, 256))


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine", "trellis"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weight_is_named(fmt, bad):
    lin = linear()
    with torch.no_grad():
        lin.weight[5, 3] = bad
        lin.weight[7, 40] = bad
    with pytest.raises(ValueError, match=r"the weight has 2 non-finite values \(inf or NaN\); the first, "
                                         rf"{bad}, is weight\[5, 3\] \(output 5, input 3\)"):
        if fmt == "trellis":
            TrellisLinear.from_linear(lin, group_size=32)
        else:
            MarlinLinear.from_linear(lin, format=fmt, group_size=32)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.up(x))


@pytest.mark.parametrize("drop, message", [
    ("up.scales", r"layer 'up': tensor 'scales' is missing"),
    ("norm.weight", r"lacks 1 tensor\(s\) of the model: norm.weight"),
])
def test_load_quantized_names_a_missing_tensor(tmp_path, drop, message):
    from safetensors.torch import load_file, save_file

    from torch_marlin.checkpoint import WEIGHTS_NAME

    model = Small()
    patch_model(model, format="u4", group_size=32, progress=False)
    torch_marlin.save_quantized(model, str(tmp_path))
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    del tensors[drop]
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(ValueError, match=message):
        torch_marlin.load_quantized(str(tmp_path), model=Small())
