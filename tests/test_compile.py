"""torch.compile of a patched model's decode step (torch_marlin.generation.StaticDecoder(compile=True)).

A 4-layer model, quantized, fused or not, decodes greedily under compile: dynamo must trace the
step into one graph (every layer, the cache update, the greedy choice) at the first step and never
again: later steps (other positions) and later generations (other prompt lengths: the prompt runs
eagerly) reuse it. Asserted on dynamo's counters with ``error_on_recompile``. The tokens equal the
eager decoder's: the same kernels run on the same inputs, only the elementwise work around them is
traced (fp32 on the CPU: random-weight logits are far apart at the argmax, ties do not occur).
On the CPU the backend is aot_eager (dynamo and AOT autograd trace everything inductor would get,
without its C++ compile); on CUDA inductor, with the step captured as a CUDA graph too.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import torch_marlin
from torch_marlin.generation import StaticDecoder

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
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = compiled.generate(prompt(7, seed=1, device=device), 9)  # other positions, another prompt length
    assert not counters["stats"]["unique_graphs"] and not counters["recompiles"], dict(counters)
    assert torch.equal(first, eager.generate(prompt(5, device=device), 4))
    assert torch.equal(second, eager.generate(prompt(7, seed=1, device=device), 9))


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
