"""Which rule shards a layer: its format's ``shard`` entry in the registry (torch_marlin/registry.py),
the refusal for ``TrellisMoE``, and with ``local_float`` the float ``nn.Linear`` rule."""

from typing import Optional, Sequence

from torch import nn

from ..modules import TrellisMoE
from ..registry import layer_format_of
from .rules import LOCAL_FLOAT, MOE, ShardRule


def rule_of(layer: nn.Module, local_float: bool = False) -> Optional[ShardRule]:
    """The sharding rule of a quantized layer (and with ``local_float`` of an ``nn.Linear``), or None
    for any other module."""
    if local_float and type(layer) is nn.Linear:
        return LOCAL_FLOAT
    if isinstance(layer, TrellisMoE):
        return MOE
    fmt = layer_format_of(layer)
    return None if fmt is None else fmt.shard


def shard_layer(layer: nn.Module, style: str, rank: int, world: int, name: str = "layer",
                splits: Optional[Sequence[int]] = None, local_float: bool = False) -> nn.Module:
    """Rank ``rank`` of ``world``'s share of ``layer``, a new layer of the same class: ``"colwise"``
    computes its ``out_features / world`` columns of the output (per member of a fused layer when
    ``splits`` gives the members' widths), ``"rowwise"`` a partial output from its
    ``in_features / world`` slice of the input, to be summed over the ranks. ShardError when the
    layer cannot be split so. ``local_float``: an ``nn.Linear`` is split the same way."""
    rule = rule_of(layer, local_float)
    if rule is None:
        raise TypeError(f"{name}: {type(layer).__name__} is not a torch_marlin quantized layer")
    return rule(layer, style, rank, world, name, splits)
