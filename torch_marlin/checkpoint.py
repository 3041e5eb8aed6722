"""Quantized checkpoints: ``save_quantized(model, dir)`` / ``load_quantized(dir)``.

A checkpoint directory holds
  ``model.safetensors``   every tensor of the patched model's ``state_dict`` (quantized buffers of
                          the MarlinLinear layers plus the float tensors of everything else), with
                          tied tensors stored once;
  ``torch_marlin.json``   the per-layer config (type, format, group size, shape, dtype, bias), the
                          tied-tensor aliases, the model class, and the size and SHA-256 of the
                          tensor file, so a truncated or corrupted file is caught before loading;
  ``config.json`` etc.    for Hugging Face models, the model config with a ``quantization_config`` of
                          ``quant_method: "torch_marlin"`` listing the layers (so transformers'
                          ``AutoModel*.from_pretrained(dir)`` loads it, see torch_marlin/hf_quantizer.py),
                          and the tokenizer files when a tokenizer is passed, so
                          ``load_quantized(dir)`` needs nothing else.
Loading rebuilds the float skeleton from the config, swaps in empty quantized layers of the
recorded shapes and loads the tensors: the original float weights are never needed.
"""

import copy
import hashlib
import json
import os
from typing import Dict, Optional

import torch
from torch import nn

from .patching import resolve_device
from .registry import (check_entry_tensors, checkpoint_entry, empty_layer, layer_format_for_entry, layer_format_of,
                       use_device_layouts)
from .version import __version__

CONFIG_NAME = "torch_marlin.json"
WEIGHTS_NAME = "model.safetensors"
CHECKPOINT_VERSION = 1


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _dedup_tied(sd: Dict[str, torch.Tensor]):
    """safetensors refuses tensors sharing memory: keep the first name, record the others as aliases."""
    seen: Dict[tuple, str] = {}
    out, tied = {}, {}
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) \
            if t.device.type != "meta" and t.numel() else None
        if key is not None and key in seen:
            tied[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        out[name] = t.detach().contiguous().cpu()
    return out, tied


def save_quantized(model: nn.Module, directory: str, tokenizer=None) -> str:
    """Writes the patched ``model`` (see :func:`torch_marlin.patch_model`) to ``directory``.

    Returns the path of the JSON config. Hugging Face models also get their ``config.json``
    (without any ``quantization_config`` of the float source, e.g. GGUF) and, when ``tokenizer``
    is given, the tokenizer files, so :func:`load_quantized` can rebuild them from the directory alone.
    """
    from safetensors.torch import save_file

    from .distributed.rules import SHARDED_ATTR
    from .fusion import unfused_members

    # A rank's layers hold its shards only: written as they are, they would load as a smaller model.
    for name, mod in model.named_modules():
        shard = getattr(mod, SHARDED_ATTR, None)
        if shard is not None:
            style, rank, world = shard
            raise ValueError(f"{name} is a tensor-parallel shard ({style}, rank {rank} of {world}): save_quantized "
                             "writes whole layers; save from a one-process model (docs/distributed.md)")

    # Fused projections are written as their members, so the checkpoint loads fused or not.
    members = unfused_members(model)
    layers = {}
    for name, mod in model.named_modules():
        for member, layer in members.get(name, {}).items():
            layers[member] = checkpoint_entry(layer)
        entry = None if name in members else checkpoint_entry(mod)
        if entry is not None:
            layers[name] = entry
    if not layers:
        raise ValueError("model has no quantized layers: call torch_marlin.patch_model(model, ...) first")

    state = model.state_dict()
    for fused_name, parts in members.items():
        for key in [k for k in state if k.startswith(fused_name + ".")]:
            del state[key]
        for member, layer in parts.items():
            state.update({f"{member}.{k}": v for k, v in layer.state_dict().items()})
    os.makedirs(directory, exist_ok=True)
    tensors, tied = _dedup_tied(state)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    save_file(tensors, weights_path, metadata={"format": "pt", "producer": "torch_marlin"})

    hf_config = getattr(model, "config", None)
    if hf_config is not None and hasattr(hf_config, "save_pretrained"):
        cfg = copy.deepcopy(hf_config)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config  # the float source's (e.g. GGUF) quantization, not ours
        # transformers' AutoModel*.from_pretrained(directory) reads this (torch_marlin/hf_quantizer.py).
        cfg.quantization_config = {"quant_method": "torch_marlin", "format": next(iter(layers.values()))["format"],
                                   "group_size": next(iter(layers.values()))["group_size"], "layers": layers}
        cfg.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)

    config = {
        "torch_marlin_checkpoint": CHECKPOINT_VERSION,
        "torch_marlin_version": __version__,
        "model_class": type(model).__name__,
        "model_module": type(model).__module__,
        "weights": {"file": WEIGHTS_NAME, "num_bytes": os.path.getsize(weights_path),
                    "sha256": _sha256(weights_path)},
        "tied": tied,
        "layers": layers,
    }
    config_path = os.path.join(directory, CONFIG_NAME)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1, sort_keys=False)
    return config_path


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: not a torch_marlin checkpoint directory (see save_quantized)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON (truncated or corrupted?): {e}") from e
    if not isinstance(cfg, dict) or cfg.get("torch_marlin_checkpoint") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: expected torch_marlin_checkpoint={CHECKPOINT_VERSION}, got "
                         f"{cfg.get('torch_marlin_checkpoint') if isinstance(cfg, dict) else cfg!r}")
    for key in ("weights", "layers", "tied", "model_class"):
        if key not in cfg:
            raise ValueError(f"{path}: missing key '{key}'")
    for name, entry in cfg["layers"].items():
        try:
            layer_format_for_entry(entry)
        except ValueError as e:
            raise ValueError(f"{path}: layer '{name}' has {e}") from e
        missing = [k for k in ("in_features", "out_features", "group_size", "bias", "dtype") if k not in entry]
        if missing:
            raise ValueError(f"{path}: layer '{name}' is missing {missing}")
        if entry["dtype"] not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"{path}: layer '{name}' has dtype {entry['dtype']!r}, expected float16/bfloat16/float32")
    return cfg


def _open_weights(directory: str, cfg: dict):
    """``(path, {name: (shape, dtype string)})`` from the tensor file's safetensors header."""
    from safetensors import safe_open

    w = cfg["weights"]
    path = os.path.join(directory, w["file"])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found (named by {CONFIG_NAME})")
    try:
        with safe_open(path, framework="pt") as f:
            header = {}
            for k in f.keys():
                sl = f.get_slice(k)
                header[k] = (tuple(sl.get_shape()), _st_dtype(sl.get_dtype()))
    except Exception as e:  # safetensors raises its own error type for bad headers
        size = os.path.getsize(path)
        why = (f"{size} bytes where {CONFIG_NAME} records {w['num_bytes']}: truncated" if size < w["num_bytes"]
               else "truncated or corrupted?")
        raise ValueError(f"{path} is not a readable safetensors file ({why}): {e}") from e
    return path, header


def _check_weights_file(path: str, cfg: dict, verify: bool) -> None:
    """The tensor file is the one that was saved: its size and (``verify``) SHA-256. Checked after
    the tensors' names and shapes, so a file that lacks a tensor is reported by that tensor's name
    (a truncated file fails earlier: its header no longer covers the file)."""
    w = cfg["weights"]
    size = os.path.getsize(path)
    if size != w["num_bytes"]:
        raise ValueError(f"{path} is {size} bytes but {CONFIG_NAME} records {w['num_bytes']}: "
                         "the file is not the one that was saved")
    if verify and _sha256(path) != w["sha256"]:
        raise ValueError(f"{path} is corrupted: its SHA-256 does not match the one in {CONFIG_NAME} "
                         "(pass verify=False to skip this check)")


_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I32": "int32",
              "I64": "int64", "U8": "uint8", "I8": "int8", "I16": "int16", "BOOL": "bool"}


def _st_dtype(s: str) -> str:
    return _ST_DTYPES.get(s, s)


def _build_hf_skeleton(directory: str, cfg: dict) -> nn.Module:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("load_quantized without model= rebuilds a Hugging Face model and needs the "
                          "'transformers' package; or pass model= (a float model of the same architecture)") from e
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise FileNotFoundError(f"{directory}/config.json not found: the checkpoint is not of a Hugging Face model; "
                                "pass model= (a float model of the same architecture) to load_quantized")
    cls = getattr(transformers, cfg["model_class"], None)
    if cls is None:
        raise ValueError(f"transformers has no class {cfg['model_class']!r} (named in {CONFIG_NAME})")
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    return cls(hf_config)


def check_layer_shapes(cfg: dict, header: dict, path: str) -> None:
    """Config vs tensors, layer by layer, before building anything."""
    for name, entry in cfg["layers"].items():
        prefix = name + "."
        tensors = {k[len(prefix):]: v for k, v in header.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        try:
            check_entry_tensors(entry, tensors)
        except ValueError as e:
            raise ValueError(f"{path}: layer '{name}': {e}") from e
    for alias, target in cfg["tied"].items():
        if target not in header:
            raise ValueError(f"{CONFIG_NAME}: tied tensor '{alias}' points at '{target}', which {path} lacks")


def load_quantized(directory: str, model: Optional[nn.Module] = None, device=None, verify: bool = True) -> nn.Module:
    """Rebuilds a model saved by :func:`save_quantized`; returns it in eval mode.

    ``model``: a float skeleton of the same architecture (any initialization: its Linear weights are
    replaced, everything else is overwritten). Default: rebuilt from ``config.json`` with
    ``transformers`` (class recorded in the checkpoint). ``device``: None (cpu), ``"auto"`` or a
    device. ``verify``: check the tensor file's SHA-256. Raises ``FileNotFoundError`` for missing
    files and ``ValueError`` for a truncated/corrupted file or a config that disagrees with the
    tensors or with the model.
    """
    cfg = _read_config(directory)
    path, header = _open_weights(directory, cfg)

    check_layer_shapes(cfg, header, path)

    if model is None:
        model = _build_hf_skeleton(directory, cfg)
    for name, entry in cfg["layers"].items():
        try:
            old = model.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"{CONFIG_NAME} names layer '{name}', which the model does not have") from e
        in_f = getattr(old, "in_features", None)
        out_f = getattr(old, "out_features", None)
        if not (isinstance(old, nn.Linear) or layer_format_of(old) is not None) or \
                (in_f, out_f) != (entry["in_features"], entry["out_features"]):
            raise ValueError(f"{CONFIG_NAME}: layer '{name}' is {entry['in_features']}->{entry['out_features']}, "
                             f"the model has {type(old).__name__} {in_f}->{out_f} there")
        new = empty_layer(entry, "cpu")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    missing = sorted(set(model.state_dict()) - set(header) - set(cfg["tied"]))
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} tensor(s) of the model: {', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''}")
    _check_weights_file(path, cfg, verify)

    from safetensors.torch import load_file
    try:
        sd = load_file(path)
    except Exception as e:
        raise ValueError(f"{path} could not be read (truncated or corrupted?): {e}") from e
    for alias, target in cfg["tied"].items():
        sd[alias] = sd[target]
    # load_state_dict copies into the skeleton's tensors and would silently convert an fp16/bf16
    # checkpoint to the skeleton's fp32; cast those tensors first (in place of .data, so tied
    # parameters stay one Parameter object).
    for key, t in list(model.state_dict(keep_vars=True).items()):
        src = sd.get(key)
        if src is not None and t.is_floating_point() and src.is_floating_point() and t.dtype != src.dtype:
            t.data = t.data.to(src.dtype)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path} does not match the model rebuilt from {directory}: {e}") from e
    dev = resolve_device(device)
    if dev is not None:
        model.to(dev)
        use_device_layouts(model)
    return model.eval()
