"""``torch_marlin.from_pretrained`` on tiny random Llama checkpoints written in each source format:
logits against the float model whose Linear weights are the source's own dequantization.

Writers: MLX checkpoints with ``mx.quantize`` and ``mx.save_safetensors``; GGUF with gguf-py's
``GGUFWriter`` and ``gguf.quants.quantize``; compressed-tensors with its ``pack_to_int32``. GPTQ
(act-order) and AWQ are packed here from their published layouts (docs/formats.md), no package of
theirs installing without its own torch.
"""

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

import torch_marlin
from torch_marlin import MarlinLinear, RansLinear
from torch_marlin.loaders.awq import AWQ_ORDER
from torch_marlin.formats.int4_packing import pack_int4

from optional_packages import require

H, I, L, NH, NKV, V = 64, 128, 2, 4, 2, 96
GS = 32
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
IDS = torch.tensor([[1, 5, 9, 33, 2, 70, 11]])


@pytest.fixture(scope="module")
def tiny():
    """A random tiny Llama (float32) and its config."""
    require("transformers", "safetensors")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                                   num_attention_heads=NH, num_key_value_heads=NKV, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, cfg


def linears(model):
    return {f"model.layers.{i}.{p}": model.get_submodule(f"model.layers.{i}.{p}") for i in range(L) for p in PROJ}


def write_dir(tmp_path, model, cfg, tensors, quant_key, quant_value):
    """config.json with the source's quantization entry, the float tensors of the non-quantized
    modules and ``tensors``, in model.safetensors."""
    from safetensors.torch import save_file

    cfg.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    raw[quant_key] = quant_value
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    quantized = set(linears(model))
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k.rpartition(".")[0] not in quantized}
    sd.update(tensors)
    save_file(sd, str(tmp_path / "model.safetensors"))


def reference_logits(model, weights):
    """Logits of ``model`` with each named Linear's weight replaced by ``weights[name]`` ([N, K])."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in weights.items():
            ref.get_submodule(name).weight.copy_(w)
        return ref(IDS).logits


def check(loaded, model, weights, fmt, rtol=1e-4):
    for name in weights:
        mod = loaded.get_submodule(name)
        assert isinstance(mod, MarlinLinear) and mod.format == fmt, (name, mod)
    assert not any(t.device.type == "meta" for t in loaded.state_dict().values())
    want = reference_logits(model, weights)
    with torch.no_grad():
        got = loaded(IDS).logits.float()
    # fp32 activations, scales rounded at most once to fp16: the relative weight error is < 2^-10,
    # which moves these O(0.1) logits by far less than 1e-4 of their range.
    err = float((got - want).abs().max())
    assert err <= rtol * float(want.abs().max()) + 1e-6, err


def test_gptq_act_order_checkpoint(tiny, tmp_path):
    model, cfg = tiny
    g = torch.Generator().manual_seed(1)
    tensors, weights = {}, {}
    for name, lin in linears(model).items():
        N, K = lin.out_features, lin.in_features
        q = torch.randint(0, 16, (K, N), generator=g)
        z = torch.randint(1, 16, (K // GS, N), generator=g)
        s = (torch.rand(K // GS, N, generator=g) * 0.02 + 0.005).half()
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[torch.randperm(K, generator=g)] = (torch.arange(K) // GS).to(torch.int32)
        gi = g_idx.long()
        weights[name] = ((q.float() - z[gi].float()) * s.float()[gi]).t()
        tensors.update({f"{name}.qweight": pack_int4(q), f"{name}.qzeros": pack_int4((z - 1).t()).t().contiguous(),
                        f"{name}.scales": s, f"{name}.g_idx": g_idx})
    # qzeros packs 8 zero points along N per word: pack_int4 of the transpose, transposed back.
    write_dir(tmp_path, model, cfg, tensors, "quantization_config",
              {"quant_method": "gptq", "bits": 4, "group_size": GS, "desc_act": True, "sym": False})
    loaded = torch_marlin.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert loaded.get_submodule("model.layers.0.mlp.up_proj").input_perm is not None
    check(loaded, model, weights, "u4")
    # Saved as a torch_marlin checkpoint, the permutation comes back with the layers.
    torch_marlin.save_quantized(loaded, str(tmp_path / "tm"))
    back = torch_marlin.from_pretrained(str(tmp_path / "tm"))
    assert back.get_submodule("model.layers.1.self_attn.k_proj").input_perm is not None
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, loaded(IDS).logits)


def test_awq_checkpoint(tiny, tmp_path):
    model, cfg = tiny

    def pack_awq(v):  # [R, C] -> [R, C/8]; nibble i of word j holds column 8j + AWQ_ORDER[i]
        v = v.to(torch.int64).reshape(v.shape[0], -1, 8)[..., list(AWQ_ORDER)]
        w = (v << (4 * torch.arange(8))).sum(-1)
        return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)

    g = torch.Generator().manual_seed(2)
    tensors, weights = {}, {}
    for name, lin in linears(model).items():
        N, K = lin.out_features, lin.in_features
        q = torch.randint(0, 16, (K, N), generator=g)
        z = torch.randint(0, 16, (K // GS, N), generator=g)
        s = (torch.rand(K // GS, N, generator=g) * 0.02 + 0.005).half()
        weights[name] = ((q - z.repeat_interleave(GS, 0)).float() * s.float().repeat_interleave(GS, 0)).t()
        tensors.update({f"{name}.qweight": pack_awq(q), f"{name}.qzeros": pack_awq(z), f"{name}.scales": s})
    write_dir(tmp_path, model, cfg, tensors, "quantization_config",
              {"quant_method": "awq", "bits": 4, "group_size": GS, "version": "gemm", "zero_point": True})
    check(torch_marlin.from_pretrained(str(tmp_path), dtype=torch.float32), model, weights, "u4")


def test_compressed_tensors_checkpoint(tiny, tmp_path):
    require("compressed_tensors")
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    model, cfg = tiny
    g = torch.Generator().manual_seed(3)
    tensors, weights = {}, {}
    for name, lin in linears(model).items():
        N, K = lin.out_features, lin.in_features
        q = torch.randint(-8, 8, (N, K), generator=g).to(torch.int8)
        s = (torch.rand(N, K // GS, generator=g) * 0.02 + 0.005).half()
        zp = torch.randint(-8, 8, (N, K // GS), generator=g).to(torch.int8)
        weights[name] = dequantize(q, s.float(), zp, dtype=torch.float32)
        tensors.update({f"{name}.weight_packed": pack_to_int32(q, 4), f"{name}.weight_scale": s,
                        f"{name}.weight_zero_point": pack_to_int32(zp, 4, packed_dim=0).contiguous(),
                        f"{name}.weight_shape": torch.tensor([N, K], dtype=torch.int32)})
    scheme = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": GS}
    write_dir(tmp_path, model, cfg, tensors, "quantization_config",
              {"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": None}},
               "ignore": ["lm_head"]})
    check(torch_marlin.from_pretrained(str(tmp_path), dtype=torch.float32), model, weights, "u4")


@pytest.mark.parametrize("mode, fmt", [("affine", "affine"), ("mxfp4", "fp4")])
def test_mlx_checkpoint(tiny, tmp_path, mode, fmt):
    require("mlx")
    import mlx.core as mx

    model, cfg = tiny
    group = 32
    arrays, weights = {}, {}
    for k, v in model.state_dict().items():
        arrays[k] = mx.array(v.numpy())
    for name, lin in linears(model).items():
        w = mx.array(lin.weight.detach().numpy()).astype(mx.float16)
        packed = mx.quantize(w, group_size=group, bits=4, mode=mode)
        del arrays[f"{name}.weight"]
        arrays[f"{name}.weight"], arrays[f"{name}.scales"] = packed[0], packed[1]
        if mode == "affine":
            arrays[f"{name}.biases"] = packed[2]
        deq = mx.dequantize(*packed, group_size=group, bits=4, mode=mode).astype(mx.float32)
        weights[name] = torch.from_numpy(np.array(deq))
    cfg.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    raw["quantization"] = {"group_size": group, "bits": 4, "mode": mode}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), arrays)
    # MLX rounds its dequantized weights to fp16; ours keep fp32 products of the fp16 scales.
    check(torch_marlin.from_pretrained(str(tmp_path), dtype=torch.float32), model, weights, fmt, rtol=2e-3)


def write_gguf(path, model, qtype, truncate=0):
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(H // NH)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([1] * V)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    weights = {}

    def permute(a, heads):  # llama.cpp's convert_hf_to_gguf reorders q/k rows per head
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[f"model.layers.{i}.input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[f"model.layers.{i}.post_attention_layernorm.weight"])
        for hf, gg in names.items():
            a = sd[f"model.layers.{i}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                a = permute(a, NH)
            elif hf == "self_attn.k_proj":
                a = permute(a, NKV)
            q = quantize(a, qtype)
            w.add_tensor(f"blk.{i}.{gg}.weight", q, raw_shape=q.shape, raw_dtype=qtype)
            deq = torch.from_numpy(gguf.quants.dequantize(q, qtype))
            if hf in ("self_attn.q_proj", "self_attn.k_proj"):  # undo the reordering for the reference
                heads = NH if hf == "self_attn.q_proj" else NKV
                deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(deq.shape)
            weights[f"model.layers.{i}.{hf}"] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - truncate)
    return weights


@pytest.mark.parametrize("type_name, fmt", [("Q4_0", "u4"), ("Q4_1", "affine")])
def test_gguf_file(tiny, tmp_path, type_name, fmt):
    require("gguf")
    import gguf

    model, _ = tiny
    path = tmp_path / "tiny.gguf"
    weights = write_gguf(path, model, gguf.GGMLQuantizationType[type_name])
    check(torch_marlin.from_pretrained(str(path), dtype=torch.float32), model, weights, fmt)


def test_bad_checkpoints_name_the_tensor(tiny, tmp_path):
    require("gguf")
    import gguf

    model, cfg = tiny
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, gguf.GGMLQuantizationType.Q4_0, truncate=100)
    with pytest.raises(ValueError, match="tiny.gguf"):
        torch_marlin.from_pretrained(str(path))
    # GPTQ directory with one layer's qzeros missing.
    tensors = {}
    for name, lin in linears(model).items():
        N, K = lin.out_features, lin.in_features
        tensors.update({f"{name}.qweight": torch.zeros(K // 8, N, dtype=torch.int32),
                        f"{name}.qzeros": torch.zeros(K // GS, N // 8, dtype=torch.int32),
                        f"{name}.scales": torch.ones(K // GS, N, dtype=torch.float16)})
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    write_dir(tmp_path, model, cfg, tensors, "quantization_config", {"quant_method": "gptq", "bits": 4,
                                                                      "group_size": GS, "desc_act": False})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.qzeros"):
        torch_marlin.from_pretrained(str(tmp_path))
    tensors["model.layers.1.mlp.down_proj.qzeros"] = torch.zeros(2, 8, dtype=torch.int32)
    write_dir(tmp_path, model, cfg, tensors, "quantization_config", {"quant_method": "gptq", "bits": 4,
                                                                      "group_size": GS, "desc_act": False})
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj: qzeros must have shape"):
        torch_marlin.from_pretrained(str(tmp_path))
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ValueError, match="model.safetensors"):
        torch_marlin.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="no quantization this loader reads"):
        cfg.save_pretrained(tmp_path / "plain")
        torch_marlin.from_pretrained(str(tmp_path / "plain"))


# ---------------------------------------------------------------------------------------------- transformers integration

def test_transformers_loads_saves_and_quantizes_torch_marlin_checkpoints(tiny, tmp_path):
    import copy

    import transformers

    from torch_marlin import TorchMarlinConfig

    model, _ = tiny
    quantized = copy.deepcopy(model)
    torch_marlin.patch_model(quantized, format="u4", group_size=GS, progress=False)
    with torch.no_grad():
        want = quantized(IDS).logits
    torch_marlin.save_quantized(quantized, str(tmp_path / "tm"))

    def logits(m):
        with torch.no_grad():
            return m(IDS).logits

    # A torch_marlin checkpoint through transformers' own from_pretrained, and through ours.
    auto = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tm"))
    assert isinstance(auto.model.layers[1].mlp.down_proj, MarlinLinear)
    assert torch.equal(logits(auto), want)
    assert torch.equal(logits(torch_marlin.from_pretrained(str(tmp_path / "tm"))), want)
    # Quantizing a float checkpoint while loading gives the same layers as patch_model.
    model.save_pretrained(tmp_path / "float")
    on_load = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "float"), quantization_config=TorchMarlinConfig(format="u4", group_size=GS))
    assert isinstance(on_load.model.layers[0].self_attn.q_proj, MarlinLinear)
    assert type(on_load.lm_head) is nn.Linear  # modules_to_not_convert defaults to lm_head
    assert torch.equal(logits(on_load), want)
    # save_pretrained round trip.
    on_load.save_pretrained(tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert isinstance(back.model.layers[0].mlp.gate_proj, MarlinLinear) and torch.equal(logits(back), want)
    with pytest.raises(ValueError, match="format must be one of"):
        TorchMarlinConfig(format="int3")
    # The format's own group-size rule, checked before any weight is read.
    with pytest.raises(ValueError, match="TorchMarlinConfig: group_size must be a positive multiple of 8, got 12"):
        TorchMarlinConfig(format="u4", group_size=12)
    with pytest.raises(ValueError, match="TorchMarlinConfig: group_size must be a positive multiple of 16"):
        TorchMarlinConfig(format="trellis", group_size=24)


def test_transformers_quantizing_warns_when_the_group_size_leaves_layers_float(tiny, tmp_path):
    import transformers

    from torch_marlin import TorchMarlinConfig

    model, _ = tiny
    model.save_pretrained(tmp_path / "float")
    # group_size 128 fits only down_proj (in_features I=128); the other six per block read H=64.
    with pytest.warns(UserWarning, match=r"TorchMarlinConfig: 12 of 14 Linear layers stay in float: group_size=128 "
                                         r"does not fit their in_features \(model.layers.0.self_attn.q_proj, "
                                         r".*\); group_size=64 quantizes them"):
        on_load = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "float"), quantization_config=TorchMarlinConfig(format="u4", group_size=128))
    assert isinstance(on_load.model.layers[0].mlp.down_proj, MarlinLinear)
    assert type(on_load.model.layers[0].mlp.up_proj) is nn.Linear


def test_transformers_loads_entropy_coded_checkpoints(tiny, tmp_path):
    import copy

    import transformers

    model = copy.deepcopy(tiny[0])  # the fixture's float model is shared by the module's tests
    report = torch_marlin.patch_model(model, format="u4", group_size=GS, progress=False, entropy_coding=True)
    assert report.entropy_coded
    with torch.no_grad():
        want = model(IDS).logits
    torch_marlin.save_quantized(model, str(tmp_path))
    auto = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert isinstance(auto.model.layers[1].mlp.down_proj, RansLinear)
    with torch.no_grad():
        assert torch.equal(auto(IDS).logits, want)


def test_transformers_imported_after_torch_marlin_reads_its_checkpoints():
    """``import torch_marlin`` does not import transformers, yet a later ``import transformers``
    registers the integration (else from_pretrained would skip our quant_method and load floats)."""
    require("transformers")
    import subprocess
    import sys

    code = ("import importlib.util, sys, torch_marlin; assert 'transformers' not in sys.modules; "
            "assert importlib.util.find_spec('transformers') is not None; import transformers; "
            "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m; assert 'torch_marlin' in m")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    pytest.param("mps", marks=pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU")),
])
def test_transformers_device_map_places_the_quantized_layers(tiny, tmp_path, device):
    """``device_map=device``: every quantized buffer lands on the device and the logits match the
    CPU model's (other kernels, so up to fp32 summation order)."""
    require("accelerate")
    import copy

    import transformers

    model, _ = tiny
    quantized = copy.deepcopy(model)
    torch_marlin.patch_model(quantized, format="u4", group_size=GS, progress=False)
    with torch.no_grad():
        want = quantized(IDS).logits
    torch_marlin.save_quantized(quantized, str(tmp_path / "tm"))
    auto = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tm"), device_map=device)
    layer = auto.model.layers[0].self_attn.q_proj
    assert isinstance(layer, MarlinLinear)
    assert all(t.device.type == device for t in layer.buffers())
    with torch.no_grad():
        got = auto(IDS.to(device)).logits.cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_cli_detects_quantized_checkpoints_and_compares_with_their_dequantized_weights(tiny, tmp_path):
    """scripts/patch_hf_model.py's path for already-quantized checkpoints: detection (GGUF files only
    with --keep-gguf-quantization, since a GGUF file is otherwise a float source to quantize again)
    and the float reference holding the checkpoint's dequantized weights."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import patch_hf_model

    model, cfg = tiny
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for name, lin in linears(model).items():
        N, K = lin.out_features, lin.in_features
        tensors.update({f"{name}.qweight": pack_int4(torch.randint(0, 16, (K, N), generator=g)),
                        f"{name}.qzeros": torch.full((K // GS, N // 8), 0x77777777, dtype=torch.int32),
                        f"{name}.scales": (torch.rand(K // GS, N, generator=g) * 0.02 + 0.005).half()})
    write_dir(tmp_path, model, cfg, tensors, "quantization_config",
              {"quant_method": "gptq", "bits": 4, "group_size": GS, "desc_act": False})
    args = patch_hf_model.parse_args(["--model", str(tmp_path)])
    assert patch_hf_model.prequantized_source(args, str(tmp_path)) == "gptq"
    model.save_pretrained(tmp_path / "float")
    assert patch_hf_model.prequantized_source(args, str(tmp_path / "float")) is None
    gguf_file = tmp_path / "q.gguf"
    require("gguf")
    import gguf

    write_gguf(gguf_file, model, gguf.GGMLQuantizationType.Q4_0)
    assert patch_hf_model.prequantized_source(args, str(gguf_file)) is None
    keep = patch_hf_model.parse_args(["--model", str(gguf_file), "--keep-gguf-quantization"])
    assert patch_hf_model.prequantized_source(keep, str(gguf_file)) == "gguf"
    qm = torch_marlin.from_pretrained(str(tmp_path), dtype=torch.float32)
    fm = patch_hf_model.dequantized_copy(qm)
    assert type(fm.model.layers[0].mlp.up_proj) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(fm(IDS).logits, qm(IDS).logits, rtol=1e-4, atol=1e-5)
