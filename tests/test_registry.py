"""The format table (torch_marlin/registry.py): what every entry promises patch_model, checkpoints
and fusion, checked for every format the same way (a new format gets these checks by its entry)."""

import pytest
import torch
from torch import nn

from torch_marlin import registry
from torch_marlin.modules import RansLinear

FORMATS = list(registry.LAYER_FORMATS)


def quantized(name: str, in_features: int = 64, out_features: int = 48, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return registry.layer_format(name).quantize(nn.Linear(in_features, out_features, bias=bias), 32, torch.float32)


def header(module: nn.Module) -> dict:
    """``{buffer: (shape, dtype name)}``, as load_quantized reads a checkpoint's safetensors header."""
    return {k: (tuple(t.shape), str(t.dtype).replace("torch.", "")) for k, t in module.state_dict().items()}


@pytest.mark.parametrize("name", FORMATS)
def test_entry_round_trip(name):
    layer = quantized(name)
    fmt = registry.layer_format(name)
    assert registry.layer_format_of(layer) is fmt
    entry = registry.checkpoint_entry(layer)
    assert entry["format"] == name and registry.layer_format_for_entry(entry) is fmt
    registry.check_entry_tensors(entry, header(layer))  # the layer's own tensors are what its entry implies
    empty = registry.empty_layer(entry, "cpu")
    empty.load_state_dict(layer.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(empty(x), layer(x))
    # Tensors that disagree with the entry are named.
    wrong = dict(header(layer), scales=((1, 48), "float32"))
    with pytest.raises(ValueError, match="tensor 'scales' has shape \\(1, 48\\)"):
        registry.check_entry_tensors(entry, wrong)
    with pytest.raises(ValueError, match="unexpected tensors \\['extra'\\]"):
        registry.check_entry_tensors(entry, dict(header(layer), extra=((1,), "int32")))
    no_bias = {k: v for k, v in header(layer).items() if k != "bias"}
    with pytest.raises(ValueError, match="tensor 'bias' is missing"):
        registry.check_entry_tensors(entry, no_bias)


@pytest.mark.parametrize("name", FORMATS)
def test_entry_missing_a_key_is_a_value_error(name):
    entry = registry.checkpoint_entry(quantized(name))
    del entry["in_features"]
    with pytest.raises(ValueError, match="needs the key 'in_features'"):
        registry.empty_layer(entry, "meta")
    with pytest.raises(ValueError, match="wrong type"):
        registry.empty_layer(dict(registry.checkpoint_entry(quantized(name)), dtype="float99"), "meta")


def test_entropy_coded_entry():
    layer = RansLinear.from_marlin(quantized("u4"))
    entry = registry.checkpoint_entry(layer)
    assert entry["type"] == "RansLinear" and entry["format"] == "u4"
    assert registry.layer_format_of(layer) is registry.ENTROPY_CODED
    assert registry.layer_format_for_entry(entry) is registry.ENTROPY_CODED
    registry.check_entry_tensors(entry, header(layer))
    with pytest.raises(ValueError, match="entropy-coded layers have a format in"):
        registry.layer_format_for_entry(dict(entry, format="trellis"))


@pytest.mark.parametrize("name", FORMATS)
def test_concat_matches_the_members(name):
    # Members of one width: a rotated trellis member's output rotation must be the fused one's.
    parts = [quantized(name, out_features=64)]
    leader_options = registry.layer_format(name).shared_options(parts[0])
    for seed in (1, 2):
        torch.manual_seed(seed)
        parts.append(registry.layer_format(name).quantize(nn.Linear(64, 64), 32, torch.float32, **leader_options))
    fused, reason = registry.layer_format(name).concat(parts)
    assert reason is None
    x = torch.randn(5, 64)
    # Each output column is computed from the same codes and scales as in its member; only the
    # kernels' summation order may differ.
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)


def test_group_size_rules():
    assert registry.layer_format("fp4").unsupported(40, 32) == "in_features=40 is not a multiple of group_size=32"
    assert registry.layer_format("u4").unsupported(64, 32) is None
    assert registry.layer_format("trellis").unsupported(40, 32) is None  # trellis pads K to whole tiles
    assert registry.ENTROPY_CODED.unsupported(48, 32) == \
        "rANS coding needs K (in_features) to be a positive multiple of 32, got 48"
    assert registry.ENTROPY_CODED.unsupported(64, 16) == "group_size=16 is not a multiple of 32"
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8, got 12"):
        registry.layer_format("affine").check_group_size(12)
    with pytest.raises(ValueError, match="positive multiple of 16"):
        registry.layer_format("trellis").check_group_size(24)
    with pytest.raises(ValueError, match="format must be one of"):
        registry.layer_format("int3")


def test_act_order_members_fuse_with_one_input_order():
    from torch_marlin import MarlinLinear
    from torch_marlin.loaders import build_marlin_linear

    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(64, generator=g)

    def member(n, input_perm):
        codes = torch.randint(0, 16, (n, 64), generator=g)
        scales = torch.rand(n, 2, generator=g) + 0.5
        zeros = torch.randint(0, 16, (n, 2), generator=g)
        return build_marlin_linear("u4", codes, scales, zeros=zeros, input_perm=input_perm, dtype=torch.float32)

    # Square members (q/k/v of multi-head attention): input_perm is as long as out_features.
    parts = [member(64, perm), member(64, perm), member(32, perm)]
    fused, reason = MarlinLinear.concat(parts)
    assert reason is None and torch.equal(fused.input_perm, perm)
    x = torch.randn(3, 64)
    # The same codes and scales per column: only the kernels' fp32 summation order may differ.
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)
    fused, reason = MarlinLinear.concat([parts[0], member(64, torch.randperm(64, generator=g))])
    assert fused is None and reason == "members gather their inputs in different orders (act-order input_perm)"
