"""Fused projections (torch_marlin/fusion.py, patch_model(fuse=True)).

Reference: the same quantized layers run one by one. Each fused part keeps its own per-group
quantization, so a fused layer computes exactly the parts' products; only the kernels' fp32
summation order may differ (a different N can give a different K split), hence 1e-5 of the
largest output in fp32. A tiny random Llama built from a config checks the HF attention and MLP
modules calling their fused projections.
"""

import copy

import pytest
import torch
from torch import nn

import torch_marlin
from torch_marlin.fusion import FusedSlice, fuse_projections
from torch_marlin.registry import LAYER_FORMATS

from optional_packages import require

QUANTIZED = [f for f in LAYER_FORMATS]


def close(a, b, rel=1e-5):
    scale = max(b.abs().max().item(), 1e-6)
    assert (a - b).abs().max().item() <= rel * scale, (a - b).abs().max().item() / scale


class Block(nn.Module):
    """Attention-like projections (different widths), called on the same input."""

    def __init__(self, d=128):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, 64), nn.Linear(d, 64)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_fused_block_equals_unfused_parts(fmt):
    torch.manual_seed(0)
    model = Block().eval()
    options = {"rotate": False} if fmt == "trellis" else {}  # 64-wide parts: their own rotation blocks
    report = torch_marlin.patch_model(model, format=fmt, group_size=32, progress=False, fuse=True, **options)
    assert [f for f, _ in report.fused] == ["qkv_proj"] and not report.unfused
    assert all(isinstance(getattr(model, n), FusedSlice) for n in ("q_proj", "k_proj", "v_proj"))
    assert model.qkv_proj.out_features == 256
    x = torch.randn(2, 3, 128)
    with torch.inference_mode():
        q, k, v = model(x)
        # The fused layer's column blocks, each against the part computed alone (the parts are the
        # fused layer's buffers cut back apart along N).
        y = model.qkv_proj(x)
    assert (q.shape, k.shape, v.shape) == ((2, 3, 128), (2, 3, 64), (2, 3, 64))
    assert torch.equal(q, y[..., :128]) and torch.equal(k, y[..., 128:192]) and torch.equal(v, y[..., 192:])


@pytest.mark.parametrize("fmt", ["fp4", "u4"])
def test_fused_layer_equals_separately_quantized_layers(fmt):
    torch.manual_seed(0)
    lins = [nn.Linear(128, n) for n in (128, 64, 64)]
    parts = [LAYER_FORMATS[fmt].quantize(lin, 32, torch.float32) for lin in lins]
    fused, reason = LAYER_FORMATS[fmt].concat(parts)
    assert reason is None
    x = torch.randn(5, 128)
    with torch.inference_mode():
        close(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_trellis_fused_layer_equals_parts_sharing_a_codebook():
    torch.manual_seed(0)
    lins = [nn.Linear(64, 128, bias=False) for _ in range(3)]
    first = LAYER_FORMATS["trellis"].quantize(lins[0], 32, torch.float32)
    parts = [first] + [LAYER_FORMATS["trellis"].quantize(lin, 32, torch.float32, grid=first.grid) for lin in lins[1:]]
    fused, reason = LAYER_FORMATS["trellis"].concat(parts)
    assert reason is None
    x = torch.randn(3, 64)
    with torch.inference_mode():
        close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rel=1e-4)  # + the fp32 output rotation
    # Parts with their own codebooks stay separate, with the reason.
    other = LAYER_FORMATS["trellis"].quantize(lins[1], 32, torch.float32)
    fused, reason = LAYER_FORMATS["trellis"].concat([first, other])
    assert fused is None and "codebooks" in reason


def test_members_that_differ_are_left_unfused():
    torch.manual_seed(0)
    model = Block().eval()
    torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, skip=["v_proj"])
    fused, unfused = fuse_projections(model)
    assert not fused and len(unfused) == 1 and "not all members are quantized" in unfused[0][1]
    a = Block()
    a.q_proj = torch_marlin.MarlinLinear.from_linear(a.q_proj, format="fp4", group_size=32)
    a.k_proj = torch_marlin.MarlinLinear.from_linear(a.k_proj, format="fp4", group_size=64)
    a.v_proj = torch_marlin.MarlinLinear.from_linear(a.v_proj, format="fp4", group_size=32)
    fused, unfused = fuse_projections(a)
    assert not fused and "group_size" in unfused[0][1]


def test_a_different_input_runs_the_fused_layer_again():
    torch.manual_seed(0)
    model = Block().eval()
    torch_marlin.patch_model(model, format="u4", group_size=32, progress=False, fuse=True)
    x1, x2 = torch.randn(4, 128), torch.randn(4, 128)
    with torch.no_grad():
        q1 = model.q_proj(x1)
        k2 = model.k_proj(x2)  # not the cached input: computed for x2
        assert torch.equal(k2, model.qkv_proj(x2)[..., 128:192])
        assert torch.equal(q1, model.qkv_proj(x1)[..., :128])
        model.q_proj(x1)
        x1.add_(1)  # an in-place change of the cached input is seen
        assert torch.equal(model.v_proj(x1), model.qkv_proj(x1)[..., 192:])
        assert not torch.equal(model.v_proj(x1 - 1), model.v_proj(x1))


def tiny_llama():
    require("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_fused_llama_equals_unfused_quantized_llama():
    # fp4 and u4 fuse through the same generic concatenation; u4 (zero points too) covers both.
    unfused = tiny_llama()
    torch_marlin.patch_model(unfused, format="u4", group_size=32, progress=False)
    fused = copy.deepcopy(unfused)
    names, skipped = fuse_projections(fused)  # what patch_model(fuse=True) does after quantizing
    assert len(names) == 2 and not skipped  # q/k/v and gate/up
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedSlice) and attn.qkv_proj.out_features == 64 + 2 * 32
    assert fused.model.layers[0].mlp.gate_up_proj.out_features == 2 * 128
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        close(fused(ids).logits, unfused(ids).logits)


def test_saving_a_fused_model_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Block().eval()
    torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, fuse=True)
    with pytest.raises(ValueError, match="fused projections .*save it unfused"):
        torch_marlin.save_quantized(model, str(tmp_path))
