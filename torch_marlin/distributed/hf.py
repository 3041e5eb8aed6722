"""transformers' ``tp_plan``: ``AutoModelForCausalLM.from_pretrained(dir, tp_plan="auto")`` under
``torchrun`` on a torch_marlin checkpoint, or on a float checkpoint with
``quantization_config=TorchMarlinConfig(...)``.

Through transformers' public hooks only (the quantizer calls the three functions below; see
torch_marlin/hf_quantizer.py):

* :func:`update_plan` (``HfQuantizer.update_parallel_plan``) renames the model plan's ``colwise`` /
  ``rowwise`` rules of torch_marlin layers (or of the Linears the config will quantize) to styles
  registered in transformers' ``ALL_PARALLEL_STYLES``, subclasses of its ``ColwiseParallel`` /
  ``RowwiseParallel``;
* their ``install_forward`` makes each tensor the layer's rule splits a DTensor placeholder, so
  transformers' loader reads only this rank's piece of it (safetensors ``get_slice``), exactly as
  for its own sharded parameters, and installs the local-compute hooks of
  torch_marlin/distributed/styles.py;
* :func:`localize` (before ``_process_model_after_weight_loading`` quantizes or records layers)
  builds each rank's layer from the loaded pieces with the rule; a float Linear becomes its local
  shard, which is then quantized (each rank quantizes its own columns, or rows in whole groups);
  :func:`rehook` puts the hooks on the layers that quantizing put in those Linears' places.
"""

from typing import Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard
from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel

from .layers import rule_of
from .rules import LOCAL_FLOAT, SHARDED_ATTR, ShardError
from .styles import install_local_forward

PENDING_ATTR = "_torch_marlin_tp_pending"  # (style, mesh, layouts) until the layer is built after loading


class _HfQuantizedStyle:
    kind = ""

    def install_forward(self, module, mesh):
        rule = rule_of(module)
        if rule is None and type(module) is not nn.Linear:
            return super().install_forward(module, mesh)
        rank, world = mesh.get_local_rank(), mesh.size()
        if rule is not None:  # checked with its name by update_plan
            for name, split in rule.splits_of(module, self.kind).items():
                if split is not None:
                    module._buffers[name] = distribute_tensor(module._buffers[name], mesh, [Shard(split.dim)],
                                                              src_data_rank=None)
        layouts = (self.input_layouts, self.output_layouts, self.use_local_output)
        setattr(module, PENDING_ATTR, (self.kind, mesh, layouts))
        return module


class HfQuantizedColwise(_HfQuantizedStyle, ColwiseParallel):
    kind = "colwise"


class HfQuantizedRowwise(_HfQuantizedStyle, RowwiseParallel):
    kind = "rowwise"


STYLES = {
    "colwise": ("torch_marlin_colwise",
                lambda: HfQuantizedColwise(input_layouts=Replicate(), output_layouts=Shard(-1))),
    "rowwise": ("torch_marlin_rowwise",
                lambda: HfQuantizedRowwise(input_layouts=Shard(-1), output_layouts=Replicate())),
    "colwise_gather_output": ("torch_marlin_colwise_rep",
                              lambda: HfQuantizedColwise(input_layouts=Replicate(), output_layouts=Replicate())),
    "colwise_rep": ("torch_marlin_colwise_rep",
                    lambda: HfQuantizedColwise(input_layouts=Replicate(), output_layouts=Replicate())),
    "rowwise_rep": ("torch_marlin_rowwise_rep",
                    lambda: HfQuantizedRowwise(input_layouts=Replicate(), output_layouts=Replicate())),
}
for _name, _make in STYLES.values():
    if _name not in ALL_PARALLEL_STYLES:
        ALL_PARALLEL_STYLES.register(_name, _make())


def update_plan(model: nn.Module, plan: Dict[str, str], will_quantize, group_size: int) -> None:
    """Renames, in place, the rules of ``plan`` (transformers' generic names, ``layers.*.q_proj``)
    that name torch_marlin layers, or Linears ``will_quantize(name, module)`` says the config will
    quantize (in groups of ``group_size``), to our styles; then checks every layer they name splits
    over the world size (ShardError naming the layer before any tensor is read)."""
    ours: Dict[str, bool] = {}
    modules = list(model.named_modules())
    for name, module in modules:
        generic = replace_layer_number_by_wildcard(name)
        quantized = rule_of(module) is not None or (type(module) is nn.Linear and will_quantize(name, module))
        ours[generic] = ours.get(generic, True) and quantized
    renamed = {}
    registered = {name for name, _ in STYLES.values()}
    for key, style in list(plan.items()):
        if ours.get(key, False) and style in registered:  # renamed already
            renamed[key] = "colwise" if isinstance(ALL_PARALLEL_STYLES[style], ColwiseParallel) else "rowwise"
            continue
        if ours.get(key, False) and style not in STYLES:
            raise ShardError(f"tp_plan rule {key!r}: {style!r} on torch_marlin layers is not supported (they take "
                             f"{', '.join(STYLES)}); override the rule with distributed_config="
                             "DistributedConfig(tp_plan={...}) or leave the layer out of the plan")
        if style in STYLES and ours.get(key, False):
            plan[key] = STYLES[style][0]
            renamed[key] = "colwise" if isinstance(ALL_PARALLEL_STYLES[plan[key]], ColwiseParallel) else "rowwise"
    world = model.config.distributed_config.tp_size
    for name, module in modules:
        kind = renamed.get(replace_layer_number_by_wildcard(name))
        if kind is None:
            continue
        rule = rule_of(module, local_float=True)
        rule.check(module, kind, world, name)
        if rule is LOCAL_FLOAT and kind == "rowwise" and (module.in_features // world) % group_size:
            raise ShardError(f"{name}: a row shard of in_features={module.in_features} over world size {world} is "
                             f"not whole groups of group_size={group_size}; pick a group size dividing "
                             f"{module.in_features // world} or another world size")


def _local(t):
    if t is None:
        return None
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.detach() if isinstance(t, nn.Parameter) else t


def localize(model: nn.Module) -> Dict[str, tuple]:
    """After loading: every pending layer becomes this rank's shard. Returns the pending float
    Linears (name -> (style, mesh, layouts)) for :func:`rehook` once they are quantized."""
    from .rules import become

    linears = {}
    for name, module in list(model.named_modules()):
        pending = module.__dict__.pop(PENDING_ATTR, None)
        if pending is None:
            continue
        kind, mesh, layouts = pending
        rank, world = mesh.get_local_rank(), mesh.size()
        if rule_of(module) is not None:
            tensors = {k: _local(v) for k, v in list(module._parameters.items()) + list(module._buffers.items())
                       if v is not None}
            module._parameters.clear()
            become(module, rule_of(module).build(module, tensors, kind, rank, world, name))
            _hook(module, kind, mesh, layouts)
            continue
        weight, bias = _local(module.weight), _local(module.bias)
        if kind == "rowwise" and rank != 0:
            bias = None  # added once, by rank 0
        local = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                          dtype=weight.dtype)
        with torch.no_grad():
            local.weight.copy_(weight)
            if bias is not None:
                local.bias.copy_(bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, local)
        linears[name] = pending
    return linears


def rehook(model: nn.Module, linears: Dict[str, tuple]) -> None:
    """Hooks the layers now standing where :func:`localize` left float shards (quantized, or float
    when the config skipped them)."""
    for name, (kind, mesh, layouts) in linears.items():
        module = model.get_submodule(name)
        if rule_of(module) is None and type(module) is not nn.Linear:
            raise TypeError(f"{name}: expected a quantized layer or nn.Linear after quantizing, got "
                            f"{type(module).__name__}")
        _hook(module, kind, mesh, layouts)


def _hook(module, kind, mesh, layouts):
    input_layout, output_layout, use_local_output = layouts
    setattr(module, SHARDED_ATTR, (kind, mesh.get_local_rank(), mesh.size()))
    install_local_forward(module, mesh, kind, input_layout, output_layout, use_local_output)
