"""RansLinear: lossless coding of a MarlinLinear's codes, outputs, sizes, patch_model, checkpoints."""

import numpy as np
import pytest
import torch
from torch import nn

import torch_marlin
from torch_marlin import MarlinLinear, RansLinear
from torch_marlin.formats import rans as rans_format
from torch_marlin.formats import unpack_int4


def make_linear(K=256, N=70, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen) * 0.02)
        if bias:
            lin.bias.copy_(torch.randn(N, generator=gen) * 0.02)
    return lin


def marlin(fmt="fp4", K=256, N=70, group_size=64, bias=True, **kw):
    return MarlinLinear.from_linear(make_linear(K, N, bias), format=fmt, group_size=group_size, **kw)


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
def test_round_trip_is_bit_exact(fmt):
    q = marlin(fmt)
    coded = RansLinear.from_marlin(q, channels_per_tile=3)  # 70 = 23 tiles of 3 + a tile of 1
    back = coded.to_marlin()
    for name, buf in q.state_dict().items():
        assert torch.equal(back.state_dict()[name], buf), name
    # The independent numpy decoder reads the same streams back to the same codes.
    codes = rans_format.decode(coded.rans_words.numpy(), coded.rans_word_offsets.numpy(), coded.rans_states.numpy(),
                               coded.rans_freqs.numpy(), 256, 70, 3)
    assert np.array_equal(codes, unpack_int4(q.B_packed).numpy())


@pytest.mark.parametrize("fmt", ["fp4", "u4", "affine"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 3), (40,)])  # 6 rows: fused decode; 40: the staged path
def test_outputs_equal_the_uncoded_layer(fmt, dtype, shape):
    # Same codes, scales and bias: the coded op computes the same sums as the uncoded one, up to fp32
    # summation order, then one rounding to dtype: allow a couple of ulps of the output dtype.
    q = marlin(fmt, dtype=dtype if dtype != torch.float32 else torch.float16)
    coded = RansLinear.from_marlin(q)
    x = torch.randn(*shape, 256).to(dtype)
    y, ref = coded(x), q(x)
    assert y.shape == ref.shape == (*shape, 70) and y.dtype == dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y.float(), ref.float(), rtol=4 * eps, atol=4 * eps * ref.abs().max().item())


def test_act_order_and_no_bias():
    q = MarlinLinear(256, 64, bias=False, format="u4", group_size=64, act_order=True)
    with torch.no_grad():
        q.B_packed.random_(-2**31, 2**31 - 1)
        q.scales.uniform_(0.01, 0.02)
        q.zeros.random_(0, 16)
        q.input_perm.copy_(torch.randperm(256, generator=torch.Generator().manual_seed(1)))
    coded = RansLinear.from_marlin(q)
    assert torch.equal(coded.input_perm, q.input_perm) and coded.bias is None
    x = torch.randn(3, 256)
    torch.testing.assert_close(coded(x), q(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(coded.dequantized_weight(), q.dequantized_weight(), rtol=0, atol=0)


def test_code_bits_per_weight_counts_everything_stored():
    q = marlin("u4", K=512, N=256, group_size=128)
    coded = RansLinear.from_marlin(q)
    T = coded.rans_states.shape[0]
    W = coded.rans_words.numel()
    expected = (16 * W + 32 * 32 * T + 16 * 16 * T + 32 * (T + 1)) / (512 * 256)
    assert coded.code_bits_per_weight() == pytest.approx(expected)
    # Gaussian weights quantized by least squares: the codes' entropy is well below 4 bits, and the
    # coding lands within the format's overhead (lane states ~0.03 bits at >= 1024 codes per lane;
    # here each lane holds only 512 * 64 / 32 / ... codes, so allow more).
    entropy = rans_format.order0_entropy(unpack_int4(q.B_packed).numpy())
    assert entropy < 3.9
    assert entropy < coded.code_bits_per_weight() < entropy + 0.15


def test_state_dict_round_trip_and_corruption():
    coded = RansLinear.from_marlin(marlin("fp4"))
    sd = {k: v.clone() for k, v in coded.state_dict().items()}
    fresh = RansLinear(256, 70, format="fp4", group_size=64, channels_per_tile=coded.channels_per_tile)
    fresh.load_state_dict(sd)  # takes the stored stream's length
    x = torch.randn(2, 256)
    assert torch.equal(fresh(x), coded(x))
    sd["rans_words"][sd["rans_words"].numel() // 2] ^= 0x10
    with pytest.raises(ValueError, match="tile"):
        fresh.load_state_dict(sd)


def test_bad_arguments():
    with pytest.raises(ValueError, match="in_features"):
        RansLinear(200, 64, group_size=8)
    with pytest.raises(ValueError, match="group_size"):
        RansLinear(256, 64, group_size=16)
    with pytest.raises(TypeError, match="MarlinLinear"):
        RansLinear.from_marlin(nn.Linear(256, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        RansLinear.from_marlin(marlin("fp4", K=264, group_size=8))
    with pytest.raises(ValueError, match="in_features"):
        RansLinear.from_marlin(marlin("fp4"))(torch.randn(2, 128))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = make_linear(256, 96, seed=1)
        self.b = make_linear(96, 64, seed=2)     # in_features 96 = 3 * 32: coded at group size 32
        self.c = make_linear(64, 40, seed=3)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_patch_model_entropy_coding_and_checkpoint(tmp_path):
    plain, coded = Tiny(), Tiny()
    torch_marlin.patch_model(plain, format="affine", group_size=32, progress=False)
    report = torch_marlin.patch_model(coded, format="affine", group_size=32, progress=False, entropy_coding=True)
    assert [n for n, _, _ in report.entropy_coded] == ["a", "b", "c"]
    assert all(isinstance(m, RansLinear) for m in (coded.a, coded.b, coded.c))
    assert "entropy-coded 3 layers" in str(report)
    x = torch.randn(5, 256)
    torch.testing.assert_close(coded(x), plain(x), rtol=1e-5, atol=1e-6)
    torch_marlin.save_quantized(coded, str(tmp_path))
    loaded = torch_marlin.load_quantized(str(tmp_path), model=Tiny())
    assert isinstance(loaded.b, RansLinear)
    assert torch.equal(loaded(x), coded(x))


def test_entropy_code_reports_what_it_coded():
    m = Tiny()
    with pytest.raises(ValueError, match="no MarlinLinear layer to code.*patch_model"):
        torch_marlin.entropy_code(m, progress=False)  # a float model: nothing quantized to code
    torch_marlin.patch_model(m, format="affine", group_size=32, progress=False)
    text = str(torch_marlin.entropy_code(m, progress=False))
    assert text.startswith("entropy_code: 3 MarlinLinear layers (affine, group_size=32)"), text
    assert "entropy-coded 3 layers" in text and "format=" not in text, text
    again = str(torch_marlin.entropy_code(m, progress=False))
    assert again == "entropy_code: no MarlinLinear layer left to code; 3 layers were entropy-coded already", again


def test_patch_model_entropy_coding_skips_and_rejects():
    m = Tiny()
    report = torch_marlin.patch_model(m, format="fp4", group_size=8, progress=False, entropy_coding=True)
    assert dict(report.not_entropy_coded)["b"].startswith("group_size=8")
    assert isinstance(m.b, MarlinLinear) and not isinstance(m.b, RansLinear)
    with pytest.raises(ValueError, match="entropy_coding"):
        torch_marlin.patch_model(Tiny(), format="trellis", group_size=32, progress=False, entropy_coding=True)
