"""patch_model(quantize_lm_head=True): the output projection quantized (LM_HEAD_FORMAT with
LM_HEAD_GROUP_SIZE), untied from the input embeddings without touching them.

Reference: the float model's final hidden states times the quantized head's dequantized weight in
fp32 (the kernels multiply the same dequantized values; only the summation order differs over
K = 64 terms, hence 1e-5 of the largest logit).
"""

import pytest
import torch
import torch.nn.functional as F

import torch_marlin
from torch_marlin.patching import LM_HEAD_FORMAT, LM_HEAD_GROUP_SIZE
from torch_marlin.registry import LAYER_FORMATS, layer_format_of

from tiny_models import tiny_model


def tied_llama():
    model = tiny_model("llama", layers=2)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def ids():
    return torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_tied_head_is_quantized_and_the_embeddings_kept(method):
    model = tied_llama()
    embeddings = model.model.embed_tokens.weight.detach().clone()
    calibration = [ids()] if method == "gptq" else None
    report = torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, quantize_lm_head=True,
                                      method=method, calibration=calibration)
    head = model.lm_head
    assert ("lm_head", 64, 128) in report.replaced
    assert layer_format_of(head).name == LM_HEAD_FORMAT and head.group_size == LM_HEAD_GROUP_SIZE
    # GPTQ rewrites the float weight it quantizes: the embeddings must not have been that weight.
    assert torch.equal(model.model.embed_tokens.weight, embeddings)
    assert model.config.tie_word_embeddings is False
    with torch.inference_mode():
        hidden = model.model(ids()).last_hidden_state
        logits = model(ids()).logits
        expected = F.linear(hidden, head.dequantized_weight().float())
    scale = expected.abs().max().item()
    assert (logits - expected).abs().max().item() <= 1e-5 * scale


def test_default_keeps_the_head_float_and_tied():
    model = tied_llama()
    report = torch_marlin.patch_model(model, format="u4", group_size=32, progress=False)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert ("lm_head", "matches skip pattern 'lm_head'") in report.skipped


def test_quantized_head_survives_save_and_load(tmp_path):
    model = tied_llama()
    torch_marlin.patch_model(model, format="u4", group_size=32, progress=False, quantize_lm_head=True)
    torch_marlin.save_quantized(model, str(tmp_path))
    loaded = torch_marlin.load_quantized(str(tmp_path))
    assert isinstance(loaded.lm_head, LAYER_FORMATS[LM_HEAD_FORMAT].layer)
    assert type(loaded.model.embed_tokens) is torch.nn.Embedding
    with torch.inference_mode():
        assert torch.equal(loaded(ids()).logits, model(ids()).logits)


def test_untied_head_and_bad_input():
    model = tiny_model("llama")  # lm_head not tied
    float_head = model.lm_head.weight.detach().clone()
    torch_marlin.patch_model(model, format="fp4", group_size=32, progress=False, quantize_lm_head=True)
    err = (model.lm_head.dequantized_weight().float() - float_head).abs().max()
    assert 0 < err <= 0.2 * float_head.abs().max()  # quantized from its own weight (4-bit error, not garbage)
    with pytest.raises(ValueError, match="quantize_lm_head=True: the model has no output projection"):
        torch_marlin.patch_model(torch.nn.Sequential(torch.nn.Linear(64, 64)), quantize_lm_head=True, progress=False)
