"""torch.compile of a patched model's decode step (torch_marlin.generation.StaticDecoder(compile=True)).

A 4-layer model, quantized, fused or not, decodes greedily under compile: dynamo must trace the
step into one graph (every layer, the cache update, the greedy choice) at the first step and never
again: later steps (other positions) and later generations (other prompt lengths: the prompt runs
eagerly) reuse it. Asserted on dynamo's counters with ``error_on_recompile``. The logits equal the
eager decoder's (the same kernels on the same inputs; only the elementwise work around them is
traced), step by step with both fed the same tokens; on the CPU (fp32) the generated tokens too.
On the CPU the backend is aot_eager (dynamo and AOT autograd trace everything inductor would get,
without its C++ compile); on CUDA inductor, with the step captured as a CUDA graph too.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import torch_marlin
from torch_marlin.generation import GREEDY_CHUNK, StaticDecoder, greedy_tokens

from tiny_models import tiny_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def prompt(length, batch=2, seed=0, device="cpu"):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,fuse", [("float", False), ("fp4", False), ("u4", True)])
def test_decode_step_compiles_once(device, fmt, fuse):
    dtype = torch.float32 if device == "cpu" else torch.float16
    model = tiny_model("llama", layers=4).to(device, dtype)
    if fmt != "float":
        report = torch_marlin.patch_model(model, format=fmt, group_size=32, progress=False, fuse=fuse)
        assert len(report.fused) == (8 if fuse else 0) and not report.unfused
    cuda = device == "cuda"
    options = {"fullgraph": True} if cuda else {"fullgraph": True, "backend": "aot_eager"}
    eager = StaticDecoder(model, 2, 24)
    torch._dynamo.reset()
    counters.clear()
    compiled = StaticDecoder(model, 2, 24, cuda_graph=cuda, compile=True, compile_options=options)
    first = compiled.generate(prompt(5, device=device), 4)  # warm-up: the one compilation
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    if not cuda:  # fp32, the same ops: the same tokens
        assert torch.equal(first, eager.generate(prompt(5, device=device), 4))
    counters.clear()
    # Another prompt length, then steps at new positions, both decoders fed the eager tokens. The
    # logits agree to fp32 rounding on the CPU; on CUDA inductor fuses the fp16 elementwise work
    # (norms, rotary embeddings) with fewer roundings than eager, hence 1 % of the largest logit.
    ids = prompt(7, seed=1, device=device)
    with torch._dynamo.config.patch(error_on_recompile=True):
        token = eager.prefill(ids)
        compiled.prefill(ids)
        for position in range(7, 16):
            expected = eager.step(token, position).clone()
            compiled.step(token, position)
            scale = eager.logits.abs().max().item()
            err = (compiled.logits.float() - eager.logits.float()).abs().max().item()
            assert err <= (1e-2 if cuda else 1e-5) * scale, (position, err / scale)
            token = expected
    assert not counters["stats"]["unique_graphs"] and not counters["recompiles"], dict(counters)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_tokens_is_argmax(device, dtype):
    # The decoders' greedy choice (two reductions over chunks) picks argmax's index: the same first
    # index among ties (within a chunk and across chunks), a padded last chunk (vocabularies that
    # are not a multiple of the chunk), the first NaN, a row of -inf; eagerly and compiled.
    gen = torch.Generator().manual_seed(0)
    cases = []
    for vocab in (7, GREEDY_CHUNK, GREEDY_CHUNK + 1, 5000):
        cases.append(torch.randn(3, vocab, generator=gen))
        cases.append(torch.randint(0, 3, (3, vocab), generator=gen).float())  # ties in every chunk
    nan = torch.randn(2, 5000, generator=gen)
    nan[0, 4000] = nan[0, 10] = nan[1, 3000] = float("nan")
    cases += [nan, torch.full((2, 3000), float("-inf"))]
    options = {"fullgraph": True} if device == "cuda" else {"fullgraph": True, "backend": "aot_eager"}
    torch._dynamo.reset()
    compiled = torch.compile(greedy_tokens, dynamic=False, **options)
    for logits in cases:
        logits = logits.to(device, dtype)
        expected = logits.argmax(-1)
        assert torch.equal(greedy_tokens(logits), expected)
        assert torch.equal(compiled(logits), expected)


def test_compile_options_dependent_launch():
    # Inductor's dependent launch is on unless the caller picks another backend or a mode (which
    # torch.compile takes instead of options) or sets it; the caller's other options are kept.
    from torch._inductor import config as inductor_config

    from torch_marlin.generation import _compile_options

    if not hasattr(inductor_config.triton, "enable_pdl"):
        assert _compile_options(None) == {}
        return
    assert _compile_options(None) == {"options": {"triton.enable_pdl": True}}
    assert _compile_options({"fullgraph": True, "options": {"max_autotune": True}}) == {
        "fullgraph": True, "options": {"triton.enable_pdl": True, "max_autotune": True}}
    assert _compile_options({"options": {"triton.enable_pdl": False}}) == {"options": {"triton.enable_pdl": False}}
    assert _compile_options({"backend": "aot_eager"}) == {"backend": "aot_eager"}
    assert _compile_options({"mode": "reduce-overhead"}) == {"mode": "reduce-overhead"}


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="compile_options is given but compile=False"):
        StaticDecoder(model, 1, 8, compile_options={"backend": "eager"})
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        StaticDecoder(model, 0, 8)
    with pytest.raises(ValueError, match="max_length must be an int >= 2"):
        StaticDecoder(model, 1, 1)
    with pytest.raises(TypeError, match="model must be a Hugging Face causal LM"):
        StaticDecoder(torch.nn.Linear(2, 2), 1, 8)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_decoder_matches_full_forward(family):
    # The decoder's cache (full-attention layers after the first write at the decoder's positions)
    # against the model's own forward over the whole sequence without a cache: the same logits at
    # every step, and every layer reports the sequence's length. gemma2 mixes sliding-window layers
    # (left as transformers builds them) with full ones.
    model = tiny_model(family, layers=4)
    ids = prompt(5)
    fed = prompt(6, seed=2)
    options = {"fullgraph": True, "backend": "aot_eager"}
    for dec in (StaticDecoder(model, 2, 24), StaticDecoder(model, 2, 24, compile=True, compile_options=options)):
        torch._dynamo.reset()
        dec.prefill(ids)
        seq = ids
        for i in range(fed.shape[1]):
            dec.step(fed[:, i], seq.shape[1])
            seq = torch.cat([seq, fed[:, i:i + 1]], dim=1)
            with torch.no_grad():
                expected = model(input_ids=seq, use_cache=False).logits[:, -1]
            torch.testing.assert_close(dec.logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
        lengths = {dec.cache.get_seq_length(i) for i in range(len(dec.cache.layers))}
        assert {int(n) for n in lengths} == {seq.shape[1]}, lengths
