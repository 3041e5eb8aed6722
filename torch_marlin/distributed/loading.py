"""Loading a torch_marlin checkpoint tensor-parallel: each rank reads only its pieces of the quantized
layers in the plan (safetensors ``get_slice``), builds its shards, and installs the plan's hooks.

    # torchrun --nproc-per-node 2 script.py
    model = torch_marlin.from_pretrained(checkpoint_dir, tp_plan="auto")
"""

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .layers import rule_of
from .rules import SHARDED_ATTR, Split, read_pieces
from .styles import _style_for, auto_plan, check_plan, parallelize


def init_tp_mesh(device: Optional[torch.device] = None):
    """The 1-D mesh of every rank: joins the process group that ``torchrun`` describes in the
    environment when none is initialized (NCCL on CUDA, gloo otherwise)."""
    from torch.distributed.device_mesh import init_device_mesh

    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
        raise RuntimeError("tp_plan needs torch.distributed: launch with torchrun --nproc-per-node N, or call "
                           "torch.distributed.init_process_group first")
    if device.type == "cuda":  # one GPU per rank, bound before NCCL starts
        rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else dist.get_rank()
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _read_slice(handle, key: str, split: Optional[Split], ranges) -> torch.Tensor:
    if split is None:
        return handle.get_tensor(key)
    sl = handle.get_slice(key)
    lead = (slice(None),) * split.dim
    parts = [sl[lead + (slice(a, b),)] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, split.dim)


def local_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def load_quantized_tp(directory: str, tp_plan="auto", mesh=None, verify: bool = False) -> nn.Module:
    """A model saved by :func:`torch_marlin.save_quantized`, tensor-parallel over ``mesh`` (default:
    every rank, :func:`init_tp_mesh`) with ``tp_plan`` (``"auto"``: the model's own plan, or a
    ``parallelize_module`` plan). The quantized layers the plan names are read in pieces; the other
    tensors whole. ``verify``: also check the file's SHA-256, which reads the whole file on every rank
    (the size is always checked). Eval mode, on this rank's device."""
    from accelerate import init_empty_weights
    from safetensors import safe_open

    from ..checkpoint import _build_hf_skeleton, _check_weights_file, _open_weights, _read_config, check_layer_shapes
    from ..registry import empty_layer, use_device_layouts

    check_plan(tp_plan)
    mesh = mesh if mesh is not None else init_tp_mesh()
    rank, world = mesh.get_local_rank(), mesh.size()
    device = local_device(mesh)
    cfg = _read_config(directory)
    path, header = _open_weights(directory, cfg)
    check_layer_shapes(cfg, header, path)
    _check_weights_file(path, cfg, verify)
    with init_empty_weights(include_buffers=False):
        model = _build_hf_skeleton(directory, cfg)
    plan = auto_plan(model) if tp_plan == "auto" else tp_plan

    layers = {}
    for name, entry in cfg["layers"].items():  # every shard checked before any tensor is read
        layer = empty_layer(entry, "meta")
        style = _style_for(name, plan)
        kind = getattr(style, "kind", None)  # our styles; a layer under any other style is loaded whole
        if kind is not None:
            rule_of(layer).check(layer, kind, world, name, getattr(style, "splits", None))
        layers[name] = (layer, kind)

    loaded = set()
    with safe_open(path, framework="pt", device="cpu") as f:
        for name, (layer, kind) in layers.items():
            prefix = name + "."
            if kind is None:
                tensors = {k: f.get_tensor(prefix + k) for k, v in layer._buffers.items() if v is not None}
                new = empty_layer(cfg["layers"][name], "cpu")
                new.load_state_dict(tensors, strict=True)
            else:
                rule = rule_of(layer)
                pieces = read_pieces(rule, layer, lambda k, s, r: _read_slice(f, prefix + k, s, r), kind, rank, world)
                new = rule.build(layer, pieces, kind, rank, world, name)
                setattr(new, SHARDED_ATTR, (kind, rank, world))
            loaded.update(prefix + k for k in layer._buffers if layer._buffers[k] is not None)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new.eval())
        rest = {k: f.get_tensor(k) for k in header if k not in loaded}
    for alias, target in cfg["tied"].items():
        if target in rest:
            rest[alias] = rest[target]
    expected = model.state_dict(keep_vars=True)
    missing = [k for k, t in expected.items() if k not in rest and k not in loaded and t.device.type == "meta"]
    if missing:
        raise ValueError(f"{path}: no tensor for {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    model.load_state_dict({k: v for k, v in rest.items() if k in expected}, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.to(device)
    use_device_layouts(model)
    return parallelize(model.eval(), mesh, plan)
