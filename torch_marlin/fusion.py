"""Fusing sibling projections that read the same input into one quantized GEMM.

Attention's q/k/v projections and the MLP's gate/up projections all multiply the same activations.
:func:`fuse_projections` concatenates each such group of quantized layers along N into one layer
of the same type (``qkv_proj`` / ``gate_up_proj`` on the parent module) and puts a
:class:`FusedSlice` in each projection's place. The model's own code still calls ``self.q_proj(x)``,
``self.k_proj(x)``, ...: the first call of a group runs the fused layer once and every slice returns
its columns of that output as a view; the others reuse it while the input is the same tensor object,
unmodified. So no model code changes, and an input that is not the one cached (a model that feeds
its projections different tensors) just runs the fused GEMM again: slower, never wrong.

Each part keeps its own per-group quantization (groups run along K within a column, so columns of
different parts never share a scale): the fused layer's outputs equal the separate layers' outputs
up to fp32 summation order. How one layer type concatenates is its class's ``concat``
(torch_marlin/registry.py), so every format fuses the same way.
Fusion is a runtime transformation: save checkpoints unfused and fuse after loading.
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from .registry import layer_format_of as layer_type_of

# (member attribute names, fused attribute name): the projections of Llama, Mistral, Qwen, SmolLM,
# Gemma and Phi-3-style decoder layers (the latter already fused in float).
GROUPS: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
)


def _version(x: torch.Tensor) -> int:
    # Inference tensors keep no version counter; within one forward nothing modifies a projection's
    # input in place between its sibling calls, so their identity suffices.
    return -1 if x.is_inference() else x._version


class _SharedOutput:
    """The fused layer's latest output, handed out once to each slice while the input is the same
    tensor object at the same version. Not a module: slices refer to it without registering the
    fused layer a second time (its parent owns it once, so ``state_dict`` holds it once)."""

    def __init__(self, layer: nn.Module, parts: int):
        self.layer, self.parts = layer, parts
        self._clear()

    def _clear(self):
        self.x, self.version, self.y, self.taken = None, -1, None, 0

    def output_for(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self.x is not x or self.version != _version(x) or self.taken & (1 << index):
            self.x, self.version, self.y, self.taken = x, _version(x), self.layer(x), 0
        y = self.y
        self.taken |= 1 << index
        if self.taken == (1 << self.parts) - 1:
            self._clear()  # every slice has its view: keep neither the input nor the output alive
        return y


class FusedSlice(nn.Module):
    """Stands in for one projection of a fused group: columns ``[start, start + out_features)`` of
    the shared fused layer's output, as a view."""

    def __init__(self, shared: _SharedOutput, index: int, start: int, in_features: int, out_features: int,
                 fused_name: str):
        super().__init__()
        self._shared = shared
        self.index, self.start = index, start
        self.in_features, self.out_features = in_features, out_features
        self.fused_name = fused_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.output_for(x, self.index).narrow(-1, self.start, self.out_features)

    def extra_repr(self) -> str:
        return (f"{self.fused_name}[..., {self.start}:{self.start + self.out_features}], "
                f"in_features={self.in_features}")


def fuse_projections(model: nn.Module, groups: Sequence[Tuple[Sequence[str], str]] = GROUPS
                     ) -> Tuple[List[Tuple[str, Tuple[str, ...]]], List[Tuple[str, str]]]:
    """Fuses every group of quantized sibling projections of ``model`` in place.

    ``groups``: (member attribute names, fused attribute name) pairs, matched on every module.
    Returns ``(fused, unfused)``: ``fused`` lists (fused layer name, member names); ``unfused``
    lists (group prefix, reason) for groups found but left as they were (members of different
    layer types or options, float members, formats whose parts cannot share one layer)."""
    fused: List[Tuple[str, Tuple[str, ...]]] = []
    unfused: List[Tuple[str, str]] = []
    for parent_name, parent in list(model.named_modules()):
        for members, fused_attr in groups:
            mods = [getattr(parent, m, None) for m in members]
            if not all(isinstance(m, nn.Module) for m in mods):
                continue
            prefix = f"{parent_name}." if parent_name else ""
            reason = _why_not(parent, members, mods, fused_attr)
            layer = None
            if reason is None:
                layer, reason = layer_type_of(mods[0]).concat(mods)
            if layer is None:
                unfused.append((prefix + "{" + ",".join(members) + "}", reason))
                continue
            layer.train(mods[0].training)
            setattr(parent, fused_attr, layer)
            shared = _SharedOutput(layer, len(mods))
            start = 0
            for i, (name, mod) in enumerate(zip(members, mods)):
                setattr(parent, name, FusedSlice(shared, i, start, mod.in_features, mod.out_features,
                                                 prefix + fused_attr))
                start += mod.out_features
            fused.append((prefix + fused_attr, tuple(prefix + m for m in members)))
    return fused, unfused


def _why_not(parent: nn.Module, members: Sequence[str], mods: Sequence[nn.Module], fused_attr: str) -> Optional[str]:
    if any(isinstance(m, FusedSlice) for m in mods):
        return "already fused"
    types = [layer_type_of(m) for m in mods]
    if any(t is None for t in types):
        kinds = ", ".join(type(m).__name__ for m in mods)
        return f"not all members are quantized layers ({kinds})"
    if len({t.name for t in types}) != 1:
        return "members have different formats (" + ", ".join(t.name for t in types) + ")"
    if hasattr(parent, fused_attr):
        return f"the module already has an attribute '{fused_attr}'"
    return None
