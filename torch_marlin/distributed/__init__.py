"""Tensor parallelism for the quantized layers on PyTorch's distributed engine and transformers'
``tp_plan`` (docs/distributed.md): sharding rules per layer class (:mod:`.rules`), ParallelStyles for
``parallelize_module`` (:mod:`.styles`), sharded loading of checkpoints (:mod:`.loading`)."""

from .rules import RULES, ShardError, ShardRule, Split, rule_of, shard_layer
from .styles import (QuantizedColwiseParallel, QuantizedRowwiseParallel, auto_plan, heads_per_rank, parallelize,
                     shard_in_place)

__all__ = ["RULES", "ShardError", "ShardRule", "Split", "rule_of", "shard_layer", "QuantizedColwiseParallel",
           "QuantizedRowwiseParallel", "auto_plan", "heads_per_rank", "parallelize", "shard_in_place"]
