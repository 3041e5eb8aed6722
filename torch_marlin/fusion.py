"""Fusing sibling projections that read the same input into one quantized GEMM.

Attention's q/k/v projections and the MLP's gate/up projections all multiply the same activations.
:func:`fuse_projections` concatenates each such group of quantized layers along N into one layer
of the same type (``qkv_proj`` / ``gate_up_proj`` on the parent module) and gives the parent a
fused forward: the parent's class becomes a subclass of its own whose ``forward`` runs the fused
layer on the input and passes its output to the family's own forward, in which every member
projection is now a :class:`ColumnSlice`, a stateless module returning its columns of that output
as a view. So one GEMM runs per group, the family's code (rotary embeddings, q/k norms, the
attention interface, the activation) runs unchanged, and nothing is kept between calls:
``torch.compile`` traces a fused decoder layer into one graph.

This needs the parent's forward to use its input only through the member projections and for its
leading (batch and sequence) shape. That holds for the transformers families in
:data:`SUPPORTED` (their attention and MLP forwards read that way); other modules with the same
attribute names are left unfused with the reason. Phi-3 ships its projections fused already
(``qkv_proj``, ``gate_up_proj`` in float): quantized, they are one GEMM each with nothing to do.

Each part keeps its own per-group quantization (groups run along K within a column, so columns of
different parts never share a scale): the fused layer's outputs equal the separate layers' outputs
up to fp32 summation order. How one layer type concatenates is its class's ``concat``
(torch_marlin/registry.py), so every format fuses the same way. :func:`torch_marlin.save_quantized`
writes a fused model with its members' keys (the fused layers cut back apart along N,
:func:`unfused_members`), so a checkpoint loads the same fused or not.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .registry import layer_format_of

# (member attribute names, fused attribute name) of Llama-style decoder layers.
QKV: Tuple[Tuple[str, ...], str] = (("q_proj", "k_proj", "v_proj"), "qkv_proj")
GATE_UP: Tuple[Tuple[str, ...], str] = (("gate_proj", "up_proj"), "gate_up_proj")
GROUPS: Tuple[Tuple[Tuple[str, ...], str], ...] = (QKV, GATE_UP)


def _families(modules: Sequence[Tuple[str, str]]) -> Dict[str, Tuple[Tuple[str, ...], str]]:
    table = {}
    for package, prefix in modules:
        where = f"transformers.models.{package}.modeling_{package}."
        table[where + prefix + "Attention"] = QKV
        table[where + prefix + "MLP"] = GATE_UP
    return table


#: Module classes (``module.qualname``) whose forward takes the fused output: each family's
#: attention and MLP read their input only through the projections and for its leading shape
#: (checked in transformers' modeling code; tests/test_fusion.py runs each family fused against
#: unfused). Subclasses are not included: they may override the forward.
SUPPORTED: Dict[str, Tuple[Tuple[str, ...], str]] = _families((
    ("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("gemma", "Gemma"),
    ("gemma2", "Gemma2"), ("gemma3", "Gemma3"), ("smollm3", "SmolLM3")))


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class FusedForward:
    """Mixin placed before a supported family's attention or MLP class: its forward runs the fused
    layer (class attribute ``fused_layer``) once and hands the output to the family's forward,
    whose member projections are :class:`ColumnSlice` modules cutting their columns from it."""

    fused_layer: str = ""

    def forward(self, hidden_states, *args, **kwargs):
        return super().forward(getattr(self, self.fused_layer)(hidden_states), *args, **kwargs)


_FUSED_CLASSES: Dict[type, type] = {}


def fused_class(cls: type, fused_layer: str) -> type:
    """The subclass of ``cls`` with :class:`FusedForward`'s forward (one per class)."""
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (FusedForward, cls),
                                   {"fused_layer": fused_layer, "__module__": __name__})
    return _FUSED_CLASSES[cls]


class ColumnSlice(nn.Module):
    """Stands in for one member projection of a fused group inside its parent's fused forward: it
    is called with the fused layer's output and returns columns ``[start, start + out_features)``
    of it, as a view. Holds no weights and no state."""

    def __init__(self, fused_name: str, start: int, in_features: int, out_features: int, fused_features: int):
        super().__init__()
        self.fused_name, self.start = fused_name, start
        self.in_features, self.out_features, self.fused_features = in_features, out_features, fused_features

    def forward(self, fused_output: torch.Tensor) -> torch.Tensor:
        if fused_output.shape[-1] != self.fused_features:
            raise ValueError(f"{type(self).__name__} of {self.fused_name} takes that fused layer's output "
                             f"(last dimension {self.fused_features}), got shape {tuple(fused_output.shape)}: "
                             "call the parent module, not the member projection")
        return fused_output.narrow(-1, self.start, self.out_features)

    def extra_repr(self) -> str:
        return (f"{self.fused_name}[..., {self.start}:{self.start + self.out_features}], "
                f"in_features={self.in_features}")


def fuse_projections(model: nn.Module) -> Tuple[List[Tuple[str, Tuple[str, ...]]], List[Tuple[str, str]]]:
    """Fuses every group of quantized sibling projections of ``model`` in place (see the module
    docstring). Returns ``(fused, unfused)``: ``fused`` lists (fused layer name, member names);
    ``unfused`` lists (group prefix, reason) for groups found but left as they were (a module class
    not in :data:`SUPPORTED`, members of different layer types or options, float members, formats
    whose parts cannot share one layer)."""
    fused: List[Tuple[str, Tuple[str, ...]]] = []
    unfused: List[Tuple[str, str]] = []
    for parent_name, parent in list(model.named_modules()):
        for members, fused_attr in GROUPS:
            mods = [getattr(parent, m, None) for m in members]
            if not all(isinstance(m, nn.Module) for m in mods):
                continue
            prefix = f"{parent_name}." if parent_name else ""
            reason = _why_not(parent, members, mods, fused_attr)
            layer = None
            if reason is None:
                layer, reason = layer_format_of(mods[0]).concat(mods)
            if layer is None:
                unfused.append((prefix + "{" + ",".join(members) + "}", reason))
                continue
            layer.train(mods[0].training)
            setattr(parent, fused_attr, layer)
            start = 0
            for name, mod in zip(members, mods):
                setattr(parent, name, ColumnSlice(prefix + fused_attr, start, mod.in_features, mod.out_features,
                                                  layer.out_features))
                start += mod.out_features
            parent.__class__ = fused_class(type(parent), fused_attr)
            fused.append((prefix + fused_attr, tuple(prefix + m for m in members)))
    return fused, unfused


def _why_not(parent: nn.Module, members: Sequence[str], mods: Sequence[nn.Module], fused_attr: str) -> Optional[str]:
    if isinstance(parent, FusedForward) or any(isinstance(m, ColumnSlice) for m in mods):
        return "already fused"
    if SUPPORTED.get(_class_key(type(parent))) != (tuple(members), fused_attr):
        return (f"{type(parent).__name__} is not a module whose forward is known to take a fused output "
                "(torch_marlin.fusion.SUPPORTED lists the transformers families that fuse)")
    types = [layer_format_of(m) for m in mods]
    if any(t is None for t in types):
        kinds = ", ".join(type(m).__name__ for m in mods)
        return f"not all members are quantized layers ({kinds})"
    if len({t.name for t in types}) != 1:
        return "members have different formats (" + ", ".join(t.name for t in types) + ")"
    if hasattr(parent, fused_attr):
        return f"the module already has an attribute '{fused_attr}'"
    return None


def unfused_members(model: nn.Module) -> Dict[str, Dict[str, nn.Module]]:
    """For every fused layer of ``model``: its name -> {member name: the member as a layer of its
    own}, cut back out of the fused layer along N (new modules; the model is left as it is). What
    :func:`torch_marlin.save_quantized` writes in the fused layers' place. Raises ValueError for a
    fused layer whose buffers are not all laid out with ``out_features`` last (trellis tiles,
    entropy-coded streams)."""
    out: Dict[str, Dict[str, nn.Module]] = {}
    for parent_name, parent in model.named_modules():
        if not isinstance(parent, FusedForward):
            continue
        prefix = f"{parent_name}." if parent_name else ""
        layer = getattr(parent, parent.fused_layer)
        slices = sorted(((n, m) for n, m in parent.named_children() if isinstance(m, ColumnSlice)),
                        key=lambda nm: nm[1].start)
        parts, why = split_out_features(layer, [m.out_features for _, m in slices])
        if parts is None:
            raise ValueError(f"{prefix}{parent.fused_layer} cannot be cut back into its members ({why}): save the "
                             "model before fusing it (patch_model without fuse=True) and fuse after loading")
        out[prefix + parent.fused_layer] = {prefix + n: p for (n, _), p in zip(slices, parts)}
    return out


def split_out_features(fused: nn.Module, widths: Sequence[int]) -> Tuple[Optional[List[nn.Module]], Optional[str]]:
    """The inverse of a layer class's ``concat`` where every buffer has ``out_features`` last (an
    act-order ``input_perm``, shared by the members, is copied whole): layers of the given widths
    holding consecutive column blocks of ``fused``, or ``(None, reason)``."""
    if layer_format_of(fused) is None:
        return None, f"{type(fused).__name__} is not a quantized layer"
    if sum(widths) != fused.out_features:
        return None, f"the members' widths {list(widths)} do not add up to out_features={fused.out_features}"
    entry = fused.checkpoint_entry()
    device = next(fused.buffers()).device
    parts, start = [], 0
    for width in widths:
        part = type(fused).from_checkpoint_entry(dict(entry, out_features=width), device)
        with torch.no_grad():
            for name, buf in part.named_buffers(recurse=False):
                src = getattr(fused, name)
                if name == "input_perm":
                    buf.copy_(src)
                elif src.shape[-1] != fused.out_features or buf.shape[:-1] != src.shape[:-1]:
                    return None, f"{type(fused).__name__} buffer '{name}' is not laid out with out_features last"
                else:
                    buf.copy_(src.narrow(-1, start, width))
        if hasattr(part, "validate"):
            part.validate()
        part.train(fused.training)
        parts.append(part)
        start += width
    return parts, None
