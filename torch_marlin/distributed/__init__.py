"""Tensor parallelism for the quantized layers on PyTorch's distributed engine and transformers'
``tp_plan`` (docs/distributed.md): sharding rules per layer class (:mod:`.rules`, named by each
format's registry entry), ParallelStyles for ``parallelize_module`` (:mod:`.styles`), sharded
loading of checkpoints (:mod:`.loading`), transformers' hooks (:mod:`.hf`).

The names below load on first use: the format registry imports the rules at ``import
torch_marlin``, which must not pull in ``torch.distributed.tensor``."""

from .rules import ShardError, ShardRule, Split

_LAZY = {"rule_of": "layers", "shard_layer": "layers", "QuantizedColwiseParallel": "styles",
         "QuantizedRowwiseParallel": "styles", "auto_plan": "styles", "heads_per_rank": "styles",
         "parallelize": "styles", "shard_in_place": "styles"}

__all__ = ["ShardError", "ShardRule", "Split", *_LAZY]


def __getattr__(name):
    import importlib

    if name in ("layers", "styles"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
