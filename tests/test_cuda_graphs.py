"""Graph safety of the ops and the plan cache.

CPU (every run): the plan cache the ops use returns the planner's own plan for every key it holds,
keys include the device caps, an op call plans once per shape, and the CUDA K-parallel plans keep
their tile counters inside the call's workspace (no buffer outlives a call).

CUDA (skipped without a device): torch.compile(mode="reduce-overhead", fullgraph=True) over a stack
of quantized layers at decode (M = 1) and prefill (M = 64) sizes equals eager; a tiny Llama's decode
step captured with torch.cuda.CUDAGraph (torch_marlin.generation.StaticDecoder), float, quantized
and with fused projections, gives the eager logits and tokens; gemm_rans (fused and staged) captured
in a CUDA graph replays the eager result.
"""


import pytest
import torch
from torch import nn

import torch_marlin
from torch_marlin import MarlinLinear, TrellisLinear, _C

from backends import CUDA as CUDA_BACKEND
from optional_packages import require

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
H100_CAPS = dict(compute_units=132, wgmma=True, thread_block_clusters=True)


# ---- plan cache (CPU) -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,caps", [
    ("cpu", {}), ("cpu", dict(compute_units=7)), ("metal", {}), ("cuda", H100_CAPS),
    ("cuda", dict(compute_units=108)),  # no clusters, no wgmma: the portable kernels, last_block sums
])
@pytest.mark.parametrize("fmt", ["fp4", "u4"])
@pytest.mark.parametrize("M,K,N,group_size,dtype", [
    (1, 4096, 4096, 128, "float16"), (4, 8192, 1024, 128, "bfloat16"), (64, 4096, 12288, 64, "float16"),
    (300, 1024, 200, 32, "float32"), (17, 520, 24, 8, "float16"),
])
def test_cached_plan_equals_fresh_plan(backend, caps, fmt, M, K, N, group_size, dtype):
    fresh = _C.plan_quant_gemm(fmt, M, K, N, group_size, dtype, backend, caps, True)
    assert _C.cached_plan_quant_gemm(fmt, M, K, N, group_size, dtype, backend, caps, True) == fresh
    assert _C.cached_plan_quant_gemm(fmt, M, K, N, group_size, dtype, backend, caps, True) == fresh  # a hit


@pytest.mark.parametrize("backend", ["cpu", "metal", "cuda"])
@pytest.mark.parametrize("M", [1, 16, 40])
def test_cached_trellis_plan_equals_fresh_plan(backend, M):
    fresh = _C.plan_trellis_gemm(M, 512, 384, 3, 128, "float16", backend, {})
    assert _C.cached_plan_trellis_gemm(M, 512, 384, 3, 128, "float16", backend, {}) == fresh


def test_plan_cache_key_includes_caps_and_arguments():
    _C.clear_plan_cache()
    a = _C.cached_plan_quant_gemm("fp4", 1, 4096, 4096, 128, "float16", "cuda", H100_CAPS)
    b = _C.cached_plan_quant_gemm("fp4", 1, 4096, 4096, 128, "float16", "cuda", dict(compute_units=108))
    c = _C.cached_plan_quant_gemm("fp4", 1, 4096, 4096, 128, "float16", "cuda", H100_CAPS, True)
    d = _C.cached_plan_quant_gemm("u4", 1, 4096, 4096, 128, "float16", "cuda", H100_CAPS)
    assert _C.plan_cache_size() == 4
    assert (a["compute_units"], b["compute_units"]) == (132, 108) and a["reduce"] != b["reduce"]
    assert c == _C.plan_quant_gemm("fp4", 1, 4096, 4096, 128, "float16", "cuda", H100_CAPS, True)
    assert d["format"] == "u4"


def test_op_plans_once_per_shape():
    torch.manual_seed(0)
    layer = MarlinLinear.from_linear(nn.Linear(64, 48), format="u4", group_size=32, dtype=torch.float32)
    x = torch.randn(3, 64)
    _C.clear_plan_cache()
    with torch.inference_mode():
        y0 = layer(x)
        assert _C.plan_cache_size() == 1
        y1 = layer(x)
        assert _C.plan_cache_size() == 1 and torch.equal(y0, y1)
        layer(x[:1])
        assert _C.plan_cache_size() == 2
    # The op's cached plan is the one torch_marlin.plan_gemm describes for this device.
    cached = _C.cached_plan_quant_gemm("u4", 3, 64, 48, 32, "float32", "cpu", _C.device_caps("cpu"), True)
    assert cached == torch_marlin.plan_gemm("u4", 3, 64, 48, 32, dtype=torch.float32, device="cpu", has_bias=True)


def test_last_block_counters_live_in_the_workspace():
    # Decode with 8 K slices and no clusters sums through global memory: its per-tile arrival
    # counters follow the fp32 partials in the call's workspace instead of a buffer kept across calls.
    M, K, N = 4, 8192, 1024
    p = torch_marlin.plan_gemm("fp4", M, K, N, 128, device="cuda", caps=dict(compute_units=132))
    assert p["reduce"] == "last_block" and p["k_parallel"] > 1
    assert p["counters_offset"] == p["k_parallel"] * M * N * 4
    assert p["workspace_bytes"] == p["counters_offset"] + p["m_tiles"] * p["n_tiles"] * 4
    q = torch_marlin.plan_gemm("fp4", 1, 4096, 4096, 128, device="cuda", caps=H100_CAPS)
    assert q["reduce"] == "cluster" and q["counters_offset"] == q["workspace_bytes"] == 0


# ---- CUDA: torch.compile reduce-overhead and explicit capture --------------------------------------

def quantized_stack(make_layer, depth=4, features=4096):
    torch.manual_seed(0)
    layers = [make_layer(nn.Linear(features, features, bias=False, device="cuda", dtype=torch.float16))
              for _ in range(depth)]
    return nn.Sequential(*layers).eval()


LAYERS = {
    "fp4": lambda lin: MarlinLinear.from_linear(lin, format="fp4", group_size=128),
    "u4": lambda lin: MarlinLinear.from_linear(lin, format="u4", group_size=128),
    "trellis": lambda lin: TrellisLinear.from_linear(lin, bits=3, group_size=128),
}


@CUDA
@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize("fmt", list(LAYERS))
def test_compile_reduce_overhead_stack(fmt, M):
    if fmt == "trellis":
        CUDA_BACKEND.require("gemm_trellis")
    model = quantized_stack(LAYERS[fmt])
    x = torch.randn(M, 4096, device="cuda", dtype=torch.float16) / 8
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        ref = model(x)
        for _ in range(3):  # warm-up, record, replay
            out = compiled(x).clone()
        x2 = torch.randn_like(x) / 8  # a replay on new input values
        out2 = compiled(x2).clone()
        ref2 = model(x2)
    # Trellis layers add fp32 rotations (torch ops that inductor compiles) and, above 16 rows, a
    # cuBLAS GEMM on the dense weight: either may sum in another order compiled / captured than
    # eagerly, which after the fp16 rounding moves outputs by an ulp or two of the largest (2^-10).
    rel = 2e-3 if fmt == "trellis" else 1e-3
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= rel * scale
    assert (out2 - ref2).abs().max().item() <= rel * ref2.abs().max().item()


def tiny_llama(dtype=torch.float16):
    require("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()


@CUDA
@pytest.mark.parametrize("fmt,fuse", [("float", False), ("fp4", False), ("u4", False), ("fp4", True),
                                      ("u4", True)])
def test_captured_llama_decode_step_equals_eager(fmt, fuse):
    from torch_marlin.generation import StaticDecoder

    model = tiny_llama()
    if fmt != "float":
        torch_marlin.patch_model(model, format=fmt, group_size=64, progress=False, fuse=fuse)
    ids = torch.randint(0, 512, (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    eager = StaticDecoder(model, 2, 24, cuda_graph=False)
    graphed = StaticDecoder(model, 2, 24, cuda_graph=True)
    tok_e = eager.prefill(ids)
    tok_g = graphed.prefill(ids)
    for i in range(12):
        pos = ids.shape[1] + i
        tok_e = eager.step(tok_e, pos).clone()
        tok_g = graphed.step(tok_g, pos).clone()
        # Same kernels on the same inputs: the replay reproduces the eager step.
        torch.testing.assert_close(graphed.logits, eager.logits, rtol=1e-3, atol=1e-3)
        assert torch.equal(tok_e, tok_g)
    # A second generation reuses the captured graph over the reset cache.
    assert torch.equal(graphed.generate(ids, 6), eager.generate(ids, 6))


@CUDA
@pytest.mark.parametrize("M", [1, 24])  # the fused decode GEMV; the staged decode + dense GEMM
def test_captured_gemm_rans_equals_eager(M):
    import numpy as np

    from torch_marlin.formats import rans

    K, N, gs, C = 256, 200, 64, 3
    g = torch.Generator().manual_seed(M)
    codes = (torch.randn(K, N, generator=g) * 1.5 + 7.5).round().clamp(0, 15).to(torch.uint8)
    e = rans.encode(codes.numpy(), C)
    coded = [torch.from_numpy(np.ascontiguousarray(e[k])).cuda() for k in ("words", "word_offsets", "states", "freqs")]
    scales = (torch.rand(K // gs, N, generator=g) * 0.02 + 0.001).half().cuda()
    zeros = torch.randint(0, 16, (K // gs, N), generator=g, dtype=torch.uint8).cuda()
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)

    def call():
        return torch.ops.marlin.gemm_rans(x, *coded, scales, zeros, None, "u4", K, N, gs, C, None)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    x.copy_(torch.randn(M, K, device="cuda", dtype=torch.float16))  # a replay on new input values
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call())
