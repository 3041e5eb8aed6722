"""ParallelStyles that put the quantized layers on ``torch.distributed.tensor.parallel``.

``QuantizedColwiseParallel`` and ``QuantizedRowwiseParallel`` subclass PyTorch's ``ColwiseParallel``
and ``RowwiseParallel``: in a plan for ``parallelize_module`` they shard a torch_marlin layer in place
with its rule (torch_marlin/distributed/rules.py) and run it on local tensors, and hand any other
module (``nn.Linear``, ``nn.Embedding``) to PyTorch's own style, so one plan covers a model whose
float and quantized layers sit side by side. Input and output layouts mean what they mean in
PyTorch: column-parallel takes a replicated input and gives ``Shard(-1)`` (local columns) by default;
row-parallel takes ``Shard(-1)`` and gives ``Replicate()``, summing the ranks' partial outputs with one
all-reduce (a reduce-scatter for ``Shard`` outputs).

The layer computes on plain local tensors, so the step stays free of DTensor dispatch on the hot
path: a plain input is taken as already laid out as ``input_layouts`` says, a DTensor input is
redistributed first.
"""

from typing import Optional, Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .layers import rule_of, shard_layer
from .rules import SHARDED_ATTR, become


def _rank_world(mesh) -> tuple:
    if mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D device mesh, got {mesh.ndim} dimensions "
                         "(pass mesh['tp'])")
    return mesh.get_local_rank(), mesh.size()


def shard_in_place(module: nn.Module, style: str, rank: int, world: int, name: Optional[str] = None,
                   splits: Optional[Sequence[int]] = None, local_float: bool = False) -> nn.Module:
    """Shards a quantized layer in place (unless it already is rank ``rank`` of ``world``'s
    ``style`` shard) and marks it."""
    done = getattr(module, SHARDED_ATTR, None)
    if done is not None:
        if done != (style, rank, world):
            raise ValueError(f"{name or type(module).__name__} is already sharded as {done}, not "
                             f"{(style, rank, world)}")
        return module
    become(module, shard_layer(module, style, rank, world, name or type(module).__name__, splits, local_float))
    setattr(module, SHARDED_ATTR, (style, rank, world))
    return module


def refuse_fused_slice(module: nn.Module, name: Optional[str] = None) -> None:
    from ..fusion import ColumnSlice

    if isinstance(module, ColumnSlice):
        raise ValueError(f"{name or 'this module'} is a slice of the fused layer {module.fused_name}: shard the model "
                         "before fusing (torch_marlin.fusion.fuse_projections after parallelize_module fuses each "
                         "rank's shards)")


def local_colwise_input(input_layout, mod, inputs, mesh):
    x = inputs[0]
    if isinstance(x, DTensor):
        x = x.redistribute(placements=[Replicate()]).to_local()
    elif input_layout != Replicate():
        x = DTensor.from_local(x, mesh, [input_layout], run_check=False)
        x = x.redistribute(placements=[Replicate()]).to_local()
    return (x, *inputs[1:])


def colwise_output(output_layout, use_local_output, mod, y, mesh):
    if use_local_output and output_layout == Shard(-1):
        return y
    out = DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
    layout = Shard(y.dim() - 1) if output_layout == Shard(-1) else output_layout
    if out.placements != (layout,):
        out = out.redistribute(placements=[layout])
    return out.to_local() if use_local_output else out


def local_rowwise_input(input_layout, mod, inputs, mesh):
    x = inputs[0]
    if isinstance(x, DTensor):
        x = x.redistribute(placements=[Shard(x.dim() - 1)]).to_local()
    elif input_layout == Replicate():
        rank, _ = _rank_world(mesh)
        x = x.narrow(-1, rank * mod.in_features, mod.in_features)
    return (x, *inputs[1:])


def rowwise_output(output_layout, use_local_output, mod, y, mesh):
    if output_layout == Replicate() and use_local_output and not y.requires_grad:
        # The decode step's one collective per row-parallel layer: no DTensor dispatch around it.
        dist.all_reduce(y, group=mesh.get_group())
        return y
    out = DTensor.from_local(y, mesh, [Partial()], run_check=False)
    if output_layout != Replicate():
        output_layout = Shard(output_layout.dim % y.dim()) if isinstance(output_layout, Shard) else output_layout
    out = out.redistribute(placements=[output_layout])
    return out.to_local() if use_local_output else out


def install_local_forward(module: nn.Module, mesh, style: str, input_layout, output_layout, use_local_output: bool):
    """Input and output hooks for a sharded quantized layer. Not PyTorch's ``distribute_module``,
    which makes every buffer a replicated DTensor: these buffers already hold this rank's shard."""
    inp, out = (local_colwise_input, colwise_output) if style == "colwise" else (local_rowwise_input, rowwise_output)
    module.register_forward_pre_hook(lambda mod, inputs: inp(input_layout, mod, inputs, mesh))
    module.register_forward_hook(lambda mod, inputs, y: out(output_layout, use_local_output, mod, y, mesh))
    return module


class _LocalStyle:
    """The shared ``_apply`` of the two styles: our layers (and float Linears with ``local_float``)
    sharded in place and run locally; anything else handed to PyTorch's style."""
    kind = ""

    def _init_local(self, splits, local_float):
        self.splits = None if splits is None else tuple(int(s) for s in splits)
        self.local_float = local_float

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        refuse_fused_slice(module)
        if rule_of(module, self.local_float) is None:
            return super()._apply(module, device_mesh)
        rank, world = _rank_world(device_mesh)
        shard_in_place(module, self.kind, rank, world, splits=self.splits, local_float=self.local_float)
        return install_local_forward(module, device_mesh, self.kind, self.input_layouts[0], self.output_layouts[0],
                                     self.use_local_output)


class QuantizedColwiseParallel(_LocalStyle, ColwiseParallel):
    """``ColwiseParallel`` that also shards torch_marlin layers. ``splits``: the members' widths of a
    layer that holds several projections side by side along N (a checkpoint's fused q/k/v or gate/up
    whose model splits the output itself), split one by one so each rank keeps its heads of every
    member.
    ``local_float``: float ``nn.Linear`` layers too are sharded and run on local tensors (inference:
    no DTensor dispatch per call) instead of by PyTorch's DTensor ``ColwiseParallel``."""
    kind = "colwise"

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 splits: Optional[Sequence[int]] = None, local_float: bool = False):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._init_local(splits, local_float)


class QuantizedRowwiseParallel(_LocalStyle, RowwiseParallel):
    """``RowwiseParallel`` that also shards torch_marlin layers (bias kept by rank 0 alone);
    ``local_float`` as for :class:`QuantizedColwiseParallel`."""
    kind = "rowwise"

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 local_float: bool = False):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self._init_local(None, local_float)


#: transformers' plan style names -> our styles (the styles a decoder's q/k/v/o and MLP plans use).
HF_STYLE_NAMES = {
    "colwise": lambda **kw: QuantizedColwiseParallel(**kw),
    "rowwise": lambda **kw: QuantizedRowwiseParallel(**kw),
    "colwise_rep": lambda **kw: QuantizedColwiseParallel(output_layouts=Replicate(), **kw),
    "colwise_gather_output": lambda **kw: QuantizedColwiseParallel(output_layouts=Replicate(), **kw),
    "rowwise_rep": lambda **kw: QuantizedRowwiseParallel(input_layouts=Replicate(), **kw),
    "rowwise_split_input": lambda **kw: QuantizedRowwiseParallel(input_layouts=Replicate(), **kw),
}


def auto_plan(model: nn.Module, local_float: bool = False) -> dict:
    """A ``parallelize_module`` plan from a transformers model's own tensor-parallel plan
    (``config.base_model_tp_plan``, under the base model's prefix): our styles for the styles it
    names (``local_float`` passed on). Entries in other styles (embedding, sequence or expert
    styles) are left out: those modules stay whole on every rank."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in its config (base_model_tp_plan); "
                         "pass a plan: {module pattern: QuantizedColwiseParallel() / QuantizedRowwiseParallel()}")
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):
        prefix = ""
    return {(f"{prefix}.{k}" if prefix else k): HF_STYLE_NAMES[v](local_float=local_float) for k, v in plan.items()
            if v in HF_STYLE_NAMES}


def heads_per_rank(model: nn.Module, world: int) -> None:
    """Sets the model config's head counts to one rank's (column-parallel q/k/v keep
    ``heads / world`` heads), so caches built from the config (``StaticCache``) get local shapes.
    The attention modules already reshape by their input width. ShardError when heads do not split."""
    from .rules import ShardError

    config = model.config
    for attr in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, attr, None)
        if n is not None and n % world:
            raise ShardError(f"{type(model).__name__}: {attr}={n} does not split over world size {world}")
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    config.num_attention_heads //= world
    if getattr(config, "num_key_value_heads", None):
        config.num_key_value_heads //= world


def parallelize(model: nn.Module, mesh, plan="auto") -> nn.Module:
    """``parallelize_module(model, mesh, plan)`` with ``plan="auto"`` from :func:`auto_plan`, and
    PyTorch's own ``ColwiseParallel`` / ``RowwiseParallel`` in a plan taken as ours (so a plan written
    for the float model shards the quantized one); every shard the plan asks for is checked before
    any is made, and when the key projections are split, the config's head counts are made per rank
    (:func:`heads_per_rank`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    _, world = _rank_world(mesh)
    plan = auto_plan(model) if check_plan(plan) == "auto" else {k: _accepting_ours(v) for k, v in plan.items()}
    for name, module in model.named_modules():  # refuse before sharding anything
        style = _style_for(name, plan)
        if style is not None:
            refuse_fused_slice(module, name)
        rule = rule_of(module, style.local_float) if isinstance(style, _LocalStyle) else None
        if rule is not None and getattr(module, SHARDED_ATTR, None) is None:
            rule.check(module, style.kind, world, name, style.splits)
    parallelize_module(model, mesh, plan)
    # Column-parallel key projections leave each rank its share of the heads.
    splits_heads = any(k.rpartition(".")[2] in ("k_proj", "qkv_proj") and isinstance(s, ColwiseParallel)
                       for k, s in plan.items())
    if splits_heads and hasattr(getattr(model, "config", None), "num_attention_heads"):
        heads_per_rank(model, world)
    return model


def _accepting_ours(style):
    """PyTorch's own ``ColwiseParallel`` / ``RowwiseParallel`` as ours (same layouts): the same for
    ``nn.Linear``, and able to shard torch_marlin layers."""
    layouts = lambda: dict(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],  # noqa: E731
                           use_local_output=style.use_local_output)
    if type(style) is ColwiseParallel:
        return QuantizedColwiseParallel(**layouts())
    if type(style) is RowwiseParallel:
        return QuantizedRowwiseParallel(**layouts())
    return style


def check_plan(plan):
    """``plan`` itself when it is ``"auto"`` or a dict of module patterns to ParallelStyles, else TypeError."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if plan == "auto" or (isinstance(plan, dict) and all(isinstance(k, str) and isinstance(v, ParallelStyle)
                                                          for k, v in plan.items())):
        return plan
    raise TypeError(f"tp_plan must be 'auto' or a dict of module patterns to ParallelStyles "
                    f"(QuantizedColwiseParallel(), QuantizedRowwiseParallel(), ...), got {plan!r}")


def _style_for(name: str, plan: dict):
    from fnmatch import fnmatch

    parts = name.split(".")
    for pattern, style in plan.items():
        pat = pattern.split(".")
        if len(pat) == len(parts) and all(fnmatch(p, q) for p, q in zip(parts, pat)):
            return style
    return None
