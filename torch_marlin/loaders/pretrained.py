"""``torch_marlin.from_pretrained(path)``: a transformers model from a quantized checkpoint made by
another tool, every quantized Linear a :class:`MarlinLinear` built from the stored codes (no float
copy of those weights is ever made, no requantizing).

Detected from the checkpoint itself:

* a directory whose ``config.json`` has ``quantization_config.quant_method`` ``"gptq"``, ``"awq"``
  or ``"compressed-tensors"`` (safetensors weights, one file or sharded with an index);
* an MLX directory (``mlx_lm.convert -q``): ``config.json`` with a ``"quantization"`` key;
* a torch_marlin checkpoint (``torch_marlin.json``, see :func:`torch_marlin.save_quantized`);
* a ``.gguf`` file: tensors of type Q4_0, Q4_1, Q4_K and MXFP4 become MarlinLinear, all others
  (F16, Q6_K, Q8_0, ...) are dequantized by gguf-py into ordinary float modules.

The model is built from its config with its parameters on the meta device
(``accelerate.init_empty_weights``), quantized Linears are swapped for MarlinLinear, and the
other tensors are assigned from the file. A missing, misshapen or truncated tensor raises a
``ValueError`` naming it.
"""

import json
import os
from typing import Callable, Dict, Mapping, Optional

import torch
from torch import nn

from ..dtypes import check_float_dtype
from ..patching import resolve_device
from .common import CheckpointError

SOURCES = ("gptq", "awq", "compressed-tensors", "mlx", "gguf", "torch_marlin")


# ---------------------------------------------------------------------------------------------- detection

def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} could not be read as JSON: {e}") from e


def detect(path: str) -> str:
    """Which source format ``path`` holds (one of :data:`SOURCES`), or a ``ValueError`` saying why none."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf"
        raise ValueError(f"{path}: a file that is not .gguf; expected a model directory or a .gguf file")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist")
    from ..checkpoint import CONFIG_NAME

    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return "torch_marlin"
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found: not a Hugging Face model directory")
    cfg = _read_json(cfg_path)
    qc = cfg.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method in ("gptq", "awq", "compressed-tensors"):
        return method
    if isinstance(cfg.get("quantization"), dict):
        return "mlx"
    raise ValueError(f"{cfg_path}: no quantization this loader reads (quantization_config.quant_method "
                     f"{method!r}; expected gptq, awq or compressed-tensors, or MLX's 'quantization' key)")


# ---------------------------------------------------------------------------------------------- safetensors

class SafetensorsDir:
    """The tensors of a directory's ``model.safetensors`` or of its shards (``*.safetensors.index.json``)."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        index = [f for f in os.listdir(directory) if f.endswith(".safetensors.index.json")]
        if index:
            weight_map = _read_json(os.path.join(directory, index[0])).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory}: no .safetensors files")
        self.where: Dict[str, object] = {}
        self._handles = []
        for f in files:
            path = os.path.join(directory, f)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found (named by the safetensors index)")
            try:
                h = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted?): {e}") from e
            self._handles.append(h)
            for k in h.keys():
                self.where[k] = (h, path)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self):
        return self.where.keys()

    def get(self, name: str) -> Optional[torch.Tensor]:
        if name not in self.where:
            return None
        h, path = self.where[name]
        try:
            t = h.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{path}: tensor '{name}' could not be read (truncated or corrupted?): {e}") from e
        if getattr(torch, "uint32", None) is not None and t.dtype == torch.uint32:
            t = t.view(torch.int32)
        return t


# ---------------------------------------------------------------------------------------------- per-format layers

def _need(t: Dict[str, Optional[torch.Tensor]], name: str, *keys: str) -> None:
    missing = [k for k in keys if t.get(k) is None]
    if missing:
        raise CheckpointError(f"{name}: quantized layer is missing tensor(s) {', '.join(f'{name}.{k}' for k in missing)}")


def _gptq(qc: Mapping) -> Callable:
    from .gptq import marlin_linear_from_gptq

    def build(t, name, dtype):
        _need(t, name, "qweight", "qzeros", "scales")
        s = t["scales"] if dtype is None else t["scales"].to(dtype)
        return marlin_linear_from_gptq(t["qweight"], t["qzeros"], s, t.get("g_idx"), t.get("bias"),
                                       bits=qc.get("bits", 4), group_size=qc.get("group_size"),
                                       desc_act=bool(qc.get("desc_act", False)),
                                       checkpoint_format=qc.get("checkpoint_format", "gptq"), name=name)
    return build


def _awq(qc: Mapping) -> Callable:
    from .awq import from_awq

    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or not qc.get("zero_point", True):
        raise ValueError(f"AWQ version={version!r} zero_point={qc.get('zero_point')!r}: only the GEMM layout with "
                         "zero points is supported")

    def build(t, name, dtype):
        _need(t, name, "qweight", "qzeros", "scales")
        return from_awq(t["qweight"], t["qzeros"], t["scales"], t.get("bias"), bits=qc.get("bits", qc.get("w_bit", 4)),
                        group_size=qc.get("group_size", qc.get("q_group_size")), dtype=dtype, name=name)
    return build


def _compressed_tensors(qc: Mapping) -> Callable:
    from .compressed_tensors import check_scheme, from_compressed_tensors

    check_scheme(qc)

    def build(t, name, dtype):
        _need(t, name, "weight_packed", "weight_scale")
        return from_compressed_tensors(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"),
                                       t.get("weight_shape"), t.get("weight_g_idx"), t.get("bias"), dtype=dtype,
                                       name=name)
    return build


def _mlx(qc: Mapping) -> Callable:
    from .mlx import from_mlx

    def build(t, name, dtype):
        layer = qc.get(name, {})
        layer = layer if isinstance(layer, Mapping) else {}
        _need(t, name, "weight", "scales")
        mode = layer.get("mode", qc.get("mode", "affine"))
        return from_mlx(t["weight"], t["scales"], t.get("biases"), int(layer.get("group_size", qc.get("group_size", 64))),
                        int(layer.get("bits", qc.get("bits", 4))), t.get("bias"), mode=mode, dtype=dtype, name=name)
    return build


# marker tensor that says a Linear is quantized, every tensor name its layer may have, builder factory
LAYOUTS = {
    "gptq": ("qweight", ("qweight", "qzeros", "scales", "g_idx", "bias"), _gptq),
    "awq": ("qweight", ("qweight", "qzeros", "scales", "bias"), _awq),
    "compressed-tensors": ("weight_packed", ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                                             "weight_g_idx", "bias"), _compressed_tensors),
    "mlx": ("scales", ("weight", "scales", "biases", "bias"), _mlx),
}


# ---------------------------------------------------------------------------------------------- model assembly

def _empty_model(config, trust_remote_code: bool = False) -> nn.Module:
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _check_shape(name: str, new: nn.Module, old: nn.Linear) -> None:
    if (new.in_features, new.out_features) != (old.in_features, old.out_features):
        raise CheckpointError(f"{name}: the checkpoint's tensors give in_features={new.in_features}, "
                              f"out_features={new.out_features}; the model's config has {old.in_features} -> "
                              f"{old.out_features}")
    if (new.bias is None) != (old.bias is None):
        raise CheckpointError(f"{name}: the model's Linear has bias={old.bias is not None}, the checkpoint "
                              f"{'has no' if new.bias is None else 'has a'} '{name}.bias'")


def _finish(model: nn.Module, rest: Dict[str, torch.Tensor], where: str, dtype, device) -> nn.Module:
    """Assigns the float tensors, ties embeddings, checks nothing is left on the meta device."""
    expected = dict(model.state_dict(keep_vars=True))
    for k, v in rest.items():
        if k not in expected:
            continue
        want = expected[k]
        if tuple(want.shape) != tuple(v.shape):
            raise CheckpointError(f"{where}: tensor '{k}' has shape {tuple(v.shape)}, the model expects "
                                  f"{tuple(want.shape)}")
        if dtype is not None and v.is_floating_point():
            rest[k] = v.to(dtype)
    model.load_state_dict({k: v for k, v in rest.items() if k in expected}, strict=False, assign=True)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if getattr(model.config, "tie_word_embeddings", False) and type(out_emb) is nn.Linear and in_emb is not None \
            and out_emb.weight.device.type == "meta":
        out_emb.weight = in_emb.weight
    left = [k for k, t in model.state_dict(keep_vars=True).items() if t is not None and t.device.type == "meta"]
    if left:
        raise CheckpointError(f"{where}: the checkpoint has no tensor for {', '.join(left[:8])}"
                              f"{' ...' if len(left) > 8 else ''}")
    dev = resolve_device(device)
    if dev is not None:
        model.to(dev)
    return model.eval()


def _hf_config(path: str):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the source's; the model here is built plain, then filled
    return config


def _load_dir(path: str, source: str, device, dtype) -> nn.Module:
    raw = _read_json(os.path.join(path, "config.json"))
    qc = raw.get("quantization") if source == "mlx" else raw.get("quantization_config")
    marker, names, factory = LAYOUTS[source]
    build = factory(qc)
    tensors = SafetensorsDir(path)
    model = _empty_model(_hf_config(path))
    used = set()
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, (nn.Linear, nn.Embedding)) or f"{name}.{marker}" not in tensors:
            continue
        t = {k: tensors.get(f"{name}.{k}") for k in names}
        used.update(f"{name}.{k}" for k, v in t.items() if v is not None)
        if isinstance(mod, nn.Embedding):
            # Quantized embeddings (MLX quantizes them too) are a lookup table, not a GEMM: dequantized.
            emb = build(t, name, dtype)
            w = emb.dequantized_weight().to(dtype or emb.scales.dtype)
            mod.weight = nn.Parameter(w, requires_grad=False)
            continue
        new = build(t, name, dtype)
        _check_shape(name, new, mod)
        _set_submodule(model, name, new)
    rest = {k: tensors.get(k) for k in tensors.keys() if k not in used}
    return _finish(model, rest, path, dtype, device)


# ---------------------------------------------------------------------------------------------- GGUF

def _row_permutation(processor, gguf_name: str, rows: int, key_map, parsed) -> Optional[torch.Tensor]:
    """How transformers' GGUF tensor processor reorders this tensor's rows (Llama's q/k
    un-permutation), found by passing it the row indices; None when it leaves them in place."""
    import numpy as np

    idx = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    out = processor.process(weights=idx, name=gguf_name, tensor_key_mapping=key_map, parsed_parameters=parsed)
    w = np.asarray(out.weights)
    if w.shape != (rows, 1) or not np.array_equal(np.sort(w[:, 0]), np.arange(rows)):
        raise ValueError(f"{gguf_name}: transformers' GGUF processor reshapes this tensor to {w.shape}; only row "
                         "reorderings can be applied to quantized blocks")
    perm = torch.from_numpy(w[:, 0].copy())
    return None if torch.equal(perm, torch.arange(rows)) else perm


def _load_gguf(path: str, device, dtype) -> nn.Module:
    import gguf
    import numpy as np
    import transformers
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from .common import build_marlin_linear
    from .gguf import TYPES, gguf_unpack

    d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError / struct errors / numpy errors on bad files
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupted?): {e}") from e
    config = transformers.AutoConfig.from_pretrained(d, gguf_file=f)
    model = _empty_model(config)
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    parsed = {"config": config.to_dict()}
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    key_map = get_gguf_hf_weights_map(model, processor)
    modules = dict(model.named_modules())
    rest, pending = {}, {}
    for tensor in reader.tensors:
        gname, ttype = tensor.name, tensor.tensor_type
        shape = tuple(int(v) for v in reversed(tensor.shape.tolist()))  # GGUF lists ne0 (K) first
        hf_key = key_map.get(gname, "")
        hf = hf_key[:-len(".weight")] if gname.endswith(".weight") and hf_key.endswith(".weight") else None
        if ttype.name in TYPES and isinstance(modules.get(hf), nn.Linear) and len(shape) == 2:
            pending[hf] = (gname, gguf_unpack(tensor.data, ttype, shape, gname),
                           _row_permutation(processor, gname, shape[0], key_map, parsed))
            continue
        try:
            weights = gguf.quants.dequantize(tensor.data, ttype)
        except Exception as e:
            raise ValueError(f"{path}: tensor '{gname}' ({ttype.name}) could not be decoded: {e}") from e
        out = processor.process(weights=weights, name=gname, tensor_key_mapping=key_map, parsed_parameters=parsed)
        if out.name in key_map:
            rest[key_map[out.name]] = torch.from_numpy(np.array(out.weights))
    for hf, (gname, (fmt, codes, scales, extra), perm) in pending.items():
        if perm is not None:
            codes, scales = codes[perm], scales[perm]
            extra = None if extra is None else extra[perm]
        kw = {"zeros": extra} if fmt == "u4" else {"offsets": extra} if fmt == "affine" else {}
        new = build_marlin_linear(fmt, codes, scales, bias=rest.pop(f"{hf}.bias", None),
                                  dtype=dtype or (torch.bfloat16 if fmt == "fp4" else torch.float16), name=gname, **kw)
        _check_shape(hf, new, modules[hf])
        _set_submodule(model, hf, new)
    return _finish(model, rest, path, dtype, device)


# ---------------------------------------------------------------------------------------------- entry point

def from_pretrained(path: str, device=None, dtype: Optional[torch.dtype] = None, tp_plan=None) -> nn.Module:
    """The transformers causal LM stored at ``path`` (a directory or a ``.gguf`` file) with its
    quantized Linears as :class:`MarlinLinear`, in eval mode. ``device``: None (cpu), ``"auto"``
    or a device. ``dtype``: of the float tensors and of the scales (default: as stored; GGUF
    scales float16, MXFP4's bfloat16).

    ``tp_plan``: ``"auto"`` (the model's own tensor-parallel plan) or a ``parallelize_module`` plan
    runs the model tensor-parallel over every rank of ``torchrun`` (docs/distributed.md), each on its
    own device (``device`` is then ignored). A torch_marlin checkpoint is read in pieces, each rank
    only its shards; other sources are loaded whole, then sharded."""
    path = os.fspath(path)
    if dtype is not None:
        check_float_dtype(dtype)
    if tp_plan is not None:
        from ..distributed import loading, parallelize

        loading.check_plan(tp_plan)  # before anything is read
        if detect(path) == "torch_marlin":
            model = loading.load_quantized_tp(path, tp_plan)
            return model.to(dtype) if dtype is not None else model
        mesh = loading.init_tp_mesh()
        return parallelize(from_pretrained(path, device=loading.local_device(mesh), dtype=dtype), mesh, tp_plan)
    source = detect(path)
    if source == "torch_marlin":
        from ..checkpoint import load_quantized

        model = load_quantized(path, device=device)
        return model.to(dtype) if dtype is not None else model
    if source == "gguf":
        return _load_gguf(path, device, dtype)
    return _load_dir(path, source, device, dtype)
