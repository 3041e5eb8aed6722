"""Fused projections (torch_marlin/fusion.py, patch_model(fuse=True)).

Reference: the same model quantized and left unfused. Each fused part keeps its own per-group
quantization, so a fused layer computes exactly the parts' products; only the kernels' fp32
summation order may differ (a different N can give a different K split), hence 1e-5 of the largest
output in fp32 (a few ulps of fp32 summed over K = 64..128 terms, far above that rounding and far
below any wrong column or scale). Tiny random transformers models of every supported family
(tests/tiny_models.py) check each family's attention and MLP forward taking the fused output.
"""

import copy

import pytest
import torch
from torch import nn

import torch_marlin
from torch_marlin.fusion import SUPPORTED, ColumnSlice, FusedForward, fuse_projections, unfused_members
from torch_marlin.registry import LAYER_FORMATS

from tiny_models import FAMILIES, tiny_model


def close(a, b, rel=1e-5):
    scale = max(b.abs().max().item(), 1e-6)
    assert (a - b).abs().max().item() <= rel * scale, (a - b).abs().max().item() / scale


def ids(batch=2, length=9, vocab=128, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_family_equals_unfused(family):
    # fp4 and u4 fuse through the same generic concatenation; u4 (zero points too) covers both.
    unfused = tiny_model(family, layers=2)
    torch_marlin.patch_model(unfused, format="u4", group_size=32, progress=False)
    fused = copy.deepcopy(unfused)
    names, skipped = fuse_projections(fused)  # what patch_model(fuse=True) does after quantizing
    assert len(names) == 4 and not skipped  # q/k/v and gate/up of both layers
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert isinstance(attn, FusedForward) and isinstance(attn.q_proj, ColumnSlice)
    assert attn.qkv_proj.out_features == 64 + 2 * 32 and mlp.gate_up_proj.out_features == 2 * 128
    assert not list(attn.q_proj.buffers()) and "q_proj.B_packed" not in dict(attn.named_buffers())
    with torch.inference_mode():
        close(fused(ids()).logits, unfused(ids()).logits)


@pytest.mark.parametrize("fmt", [f for f in LAYER_FORMATS if f != "u4"])
def test_every_format_fuses_a_llama(fmt):
    unfused = tiny_model("llama")
    options = {"rotate": False} if fmt == "trellis" else {}  # 32-wide k/v parts: their own rotation blocks
    torch_marlin.patch_model(unfused, format=fmt, group_size=32, progress=False, **options)
    fused = tiny_model("llama")
    report = torch_marlin.patch_model(fused, format=fmt, group_size=32, progress=False, fuse=True, **options)
    assert len(report.fused) == 2 and not report.unfused
    # trellis: the k/v parts share q's codebook when fused, so compare the fused model with its
    # own members instead of with separately quantized ones.
    reference = unfused if fmt != "trellis" else None
    with torch.inference_mode():
        out = fused(ids()).logits
        if reference is not None:
            close(out, reference(ids()).logits)
        attn = fused.model.layers[0].self_attn
        x = torch.randn(2, 3, 64)
        y = attn.qkv_proj(x)
        assert torch.equal(attn.k_proj(y), y[..., 64:96]) and torch.equal(attn.v_proj(y), y[..., 96:])


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


class Block(nn.Module):
    """Attention-like projections with the names of a supported family, in a class that is not one."""

    def __init__(self, d=128):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, 64), nn.Linear(d, 64)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def test_unknown_module_classes_are_left_unfused_with_the_reason():
    model = Block().eval()
    report = torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, fuse=True)
    assert not report.fused and len(report.unfused) == 1
    assert "Block is not a module whose forward is known" in report.unfused[0][1]
    assert type(model) is Block and isinstance(model.q_proj, torch_marlin.MarlinLinear)
    # A subclass of a supported family may override its forward: not fused either.
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    attn.__class__ = type("MyAttention", (type(attn),), {})
    report = torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, fuse=True)
    assert [f for f, _ in report.fused] == ["model.layers.0.mlp.gate_up_proj"]
    assert "MyAttention" in report.unfused[0][1]
    assert all(key in SUPPORTED for key in ("transformers.models.llama.modeling_llama.LlamaAttention",
                                             "transformers.models.gemma3.modeling_gemma3.Gemma3MLP"))


def test_members_that_differ_are_left_unfused():
    model = tiny_model("llama")
    torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, skip=["v_proj", "lm_head"])
    fused, unfused = fuse_projections(model)
    assert [f for f, _ in fused] == ["model.layers.0.mlp.gate_up_proj"]
    assert "not all members are quantized" in unfused[0][1]
    a = tiny_model("llama").model.layers[0].self_attn
    a.q_proj = torch_marlin.MarlinLinear.from_linear(a.q_proj, format="fp4", group_size=32)
    a.k_proj = torch_marlin.MarlinLinear.from_linear(a.k_proj, format="fp4", group_size=64)
    a.v_proj = torch_marlin.MarlinLinear.from_linear(a.v_proj, format="fp4", group_size=32)
    fused, unfused = fuse_projections(a)
    assert not fused and "group_size" in unfused[0][1]


def test_fusing_twice_and_calling_a_member_on_the_input_are_caught():
    model = tiny_model("llama")
    torch_marlin.patch_model(model, format="u4", group_size=32, progress=False, fuse=True)
    fused, unfused = fuse_projections(model)
    assert not fused and {r for _, r in unfused} == {"already fused"}
    with pytest.raises(ValueError, match="takes that fused layer's output"):
        model.model.layers[0].self_attn.k_proj(torch.randn(1, 64))


def test_fused_decoder_layer_compiles_to_one_graph():
    require_compile()
    model = tiny_model("qwen3")  # q/k norms between the projections and attention
    torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, fuse=True)
    layer = model.model.layers[0]
    x = torch.randn(2, 5, 64)
    positions = torch.arange(5).expand(2, 5)
    rotary = model.model.rotary_emb(x, positions)
    with torch.inference_mode():
        expected = layer(x, position_embeddings=rotary)
        # aot_eager: dynamo and AOT autograd trace the whole layer (a graph break or an untraceable
        # op fails fullgraph) without inductor's C++ compile, seconds on the CPU.
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, position_embeddings=rotary)
    close(got, expected)


def require_compile():
    if not hasattr(torch, "compile"):
        pytest.skip("torch.compile is not available")


def test_save_quantized_writes_the_members_and_loads_fused_or_not(tmp_path):
    model = tiny_model("qwen2")  # biased q/k/v: the bias is cut back apart too
    torch_marlin.patch_model(model, format="u4", group_size=32, progress=False, fuse=True)
    torch_marlin.save_quantized(model, str(tmp_path))
    loaded = torch_marlin.load_quantized(str(tmp_path))
    attn = loaded.model.layers[0].self_attn
    assert isinstance(attn.q_proj, torch_marlin.MarlinLinear) and not hasattr(attn, "qkv_proj")
    with torch.inference_mode():
        close(loaded(ids()).logits, model(ids()).logits)
        fuse_projections(loaded)
        assert torch.equal(loaded(ids()).logits, model(ids()).logits)  # the same buffers, concatenated again
    assert isinstance(model.model.layers[0].self_attn.q_proj, ColumnSlice)  # saving left the model fused


def test_a_fused_model_copies():
    model = tiny_model("gemma2")
    torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, fuse=True)
    other = copy.deepcopy(model)
    attn, original = other.model.layers[0].self_attn, model.model.layers[0].self_attn
    assert type(attn) is type(original) and attn.qkv_proj is not original.qkv_proj
    with torch.inference_mode():
        assert torch.equal(other(ids()).logits, model(ids()).logits)


def test_save_refuses_a_fused_layer_that_cannot_be_cut_apart(tmp_path):
    model = tiny_model("llama")
    torch_marlin.patch_model(model, format="trellis", group_size=32, progress=False, fuse=True, rotate=False)
    with pytest.raises(ValueError, match="qkv_proj cannot be cut back into its members .*save the model before fusing"):
        unfused_members(model)
    with pytest.raises(ValueError, match="cannot be cut back"):
        torch_marlin.save_quantized(model, str(tmp_path))
    assert not (tmp_path / "model.safetensors").exists()
