"""Tensor parallelism for the quantized layers, on torch.distributed.

Two ways to split a layer ``y = x @ W^T + b`` (``W`` is ``[N, K]``, stored ``[K, N]``) over ``world`` ranks:

* ``"colwise"``: each rank holds ``N / world`` output columns and computes those columns of ``y`` from
  the whole input. Every quantized tensor keeps ``N`` as its last dimension, so a rank takes whole
  columns with their scales, zero points, offsets and bias. A fused layer (q/k/v, gate/up, side by
  side along N) is split per member (``splits``), so each rank keeps its heads of every member.
* ``"rowwise"``: each rank holds ``K / world`` input features and computes a partial ``y`` from its
  slice of the input; the ranks' partial outputs are summed (all-reduce). The slice must hold whole
  quantization groups. The bias is added once: rank 0 keeps it, the other ranks' shards have none.

:class:`ShardRule` says, per layer class, which tensors split along which dimension and how a rank's
pieces become its layer; each format's entry in torch_marlin/registry.py names its rule
(``shard``). What a format cannot split raises :class:`ShardError` naming the layer, the
dimension and the world size, and saying what to do instead. The same rule serves three entry
points: a whole layer (:func:`torch_marlin.distributed.shard_layer`), the loaders (each rank reads
only its pieces of the checkpoint, :func:`read_pieces`) and the ParallelStyles
(torch_marlin/distributed/styles.py), which plug our layers into
``torch.distributed.tensor.parallel.parallelize_module``.

docs/distributed.md says what shards how.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..formats import trellis as trellis_fmt
from ..modules import MarlinLinear, RansLinear, TrellisLinear

#: Set on a sharded layer: (style, rank, world). A layer loaded already sharded carries it too, so a
#: style applied to it later only installs the hooks, and save_quantized refuses the model.
SHARDED_ATTR = "tp_shard"

STYLES = ("colwise", "rowwise")


class ShardError(ValueError):
    """A layer that cannot be split as asked: the message names the layer, the dimension, the world
    size, why, and what to use instead."""


@dataclass(frozen=True)
class Split:
    """How one tensor splits: along ``dim``, whose elements each cover ``unit`` features (8 rows of K
    per int32 of ``B_packed``, a group of rows per scale, 16 columns per trellis tile)."""
    dim: int
    unit: int = 1


def feature_ranges(features: int, rank: int, world: int, splits: Optional[Sequence[int]] = None
                   ) -> List[Tuple[int, int]]:
    """The feature ranges ``[start, stop)`` rank ``rank`` holds of a dimension of ``features``:
    one contiguous range, or one per member of ``splits`` (member widths summing to ``features``)."""
    members = list(splits) if splits else [features]
    out, start = [], 0
    for width in members:
        part = width // world
        out.append((start + rank * part, start + (rank + 1) * part))
        start += width
    return out


def element_ranges(split: Split, ranges: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    return [(a // split.unit, b // split.unit) for a, b in ranges]


def take(t: torch.Tensor, split: Optional[Split], ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """The piece of ``t`` a rank holds (the whole tensor for ``split=None``)."""
    if split is None:
        return t
    parts = [t.narrow(split.dim, a, b - a) for a, b in element_ranges(split, ranges)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, split.dim)).contiguous()


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def _divides(name: str, what: str, size: int, world: int, multiple: int = 1, why: str = "") -> int:
    """``size / world``, or ShardError when it is not a whole multiple of ``multiple``."""
    if size % world or (size // world) % multiple:
        need = f"a multiple of {world}" if multiple == 1 else f"a multiple of {world} x {multiple} ({why})"
        raise ShardError(f"{name}: {what}={size} does not split over world size {world}: it must be {need}")
    return size // world


def _check_members(name: str, n: int, world: int, splits: Optional[Sequence[int]], multiple: int = 1,
                   why: str = "") -> None:
    if splits is not None and sum(splits) != n:
        raise ValueError(f"{name}: splits {list(splits)} must sum to out_features={n}")
    for i, width in enumerate(splits or [n]):
        what = "out_features" if splits is None else f"out_features of fused member {i}"
        _divides(name, what, width, world, multiple, why)


class ShardRule:
    """How one layer class splits. ``check`` raises before any work; ``splits_of`` says which
    tensor splits along which dimension (None: every rank needs all of it); ``build`` makes a rank's
    layer from its pieces (``tensors``: buffer name -> piece, on the device the layer will live on)."""

    def check(self, layer: nn.Module, style: str, world: int, name: str,
              splits: Optional[Sequence[int]] = None) -> None:
        raise NotImplementedError

    def splits_of(self, layer: nn.Module, style: str) -> Dict[str, Optional[Split]]:
        raise NotImplementedError

    def build(self, layer: nn.Module, tensors: Dict[str, torch.Tensor], style: str, rank: int, world: int,
              name: str) -> nn.Module:
        raise NotImplementedError

    def features(self, layer: nn.Module, style: str) -> int:
        return layer.out_features if style == "colwise" else layer.in_features

    def __call__(self, layer: nn.Module, style: str, rank: int, world: int, name: str = "layer",
                 splits: Optional[Sequence[int]] = None) -> nn.Module:
        """Rank ``rank`` of ``world``'s share of the whole ``layer``
        (:func:`torch_marlin.distributed.shard_layer`)."""
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
            raise ValueError(f"{name}: need 0 <= rank < world, got rank={rank!r}, world={world!r}")
        self.check(layer, style, world, name, splits)
        pieces = shard_tensors(self, layer, buffers_of(layer), style, rank, world, splits)
        return self.build(layer, pieces, style, rank, world, name)


# ---------------------------------------------------------------------------------------------- MarlinLinear

class MarlinShardRule(ShardRule):
    """fp4 / u4 / affine: columns with their scales (zero points, offsets, bias); rows in whole groups.
    Act-order layers (``input_perm``): column shards keep the whole permutation; a row shard keeps
    the groups whose rows lie in its slice of the original input order, with the permutation
    rebased to that slice, which needs every group inside one rank's slice."""

    def check(self, layer, style, world, name, splits=None):
        _check_style(style)
        if style == "colwise":
            _check_members(name, layer.out_features, world, splits)
        else:
            _divides(name, "in_features", layer.in_features, world, layer.group_size,
                     f"whole quantization groups of group_size={layer.group_size}")

    def splits_of(self, layer, style):
        names = [n for n in ("B_packed", "scales", "zeros", "offsets", "bias", "input_perm")
                 if layer._buffers.get(n) is not None]
        if style == "colwise":
            return {n: (None if n == "input_perm" else Split(0 if n == "bias" else 1)) for n in names}
        if layer._buffers.get("input_perm") is not None:
            return {n: None for n in names}  # regrouped per rank in build, from the whole tensors
        g = layer.group_size
        return {n: (None if n == "bias" else Split(0, 8 if n == "B_packed" else g)) for n in names}

    def build(self, layer, tensors, style, rank, world, name):
        K, N = layer.in_features, layer.out_features
        perm = tensors.get("input_perm")
        if style == "rowwise":
            if perm is not None:
                tensors = self._act_order_rows(tensors, K, layer.group_size, rank, world, name)
            if rank != 0:
                tensors = {k: v for k, v in tensors.items() if k != "bias"}
        k_local = tensors["B_packed"].shape[0] * 8
        n_local = tensors["B_packed"].shape[1]
        return self._assemble(layer, tensors, k_local, n_local)

    @staticmethod
    def _assemble(layer, tensors, k_local, n_local) -> MarlinLinear:
        scales = tensors["scales"]
        mod = MarlinLinear(k_local, n_local, bias="bias" in tensors, format=layer.format, group_size=layer.group_size,
                           dtype=scales.dtype, device=scales.device, act_order="input_perm" in tensors)
        with torch.no_grad():
            for key, t in tensors.items():
                getattr(mod, key).copy_(t)
        mod.validate()
        return mod.train(layer.training)

    @staticmethod
    def _act_order_rows(tensors, K, g, rank, world, name):
        perm = tensors["input_perm"]
        k_local = K // world
        owner = (perm // k_local).reshape(K // g, g)
        mixed = (owner != owner[:, :1]).any(1)
        if bool(mixed.any()):
            j = int(mixed.nonzero()[0])
            ranks = sorted(set(owner[j].tolist()))
            raise ShardError(f"{name}: row-parallel over world size {world} needs every act-order group inside one "
                             f"rank's slice of in_features={K}, but group {j} holds input rows of ranks {ranks}. "
                             "Shard this layer column-parallel, keep it replicated, or use a checkpoint quantized "
                             "without act-order (GPTQ desc_act=False)")
        mine = owner[:, 0] == rank
        rows = mine.repeat_interleave(g)
        out = {"input_perm": perm[rows] - rank * k_local,
               "B_packed": tensors["B_packed"][mine.repeat_interleave(g // 8)]}
        for key in ("scales", "zeros", "offsets"):
            if key in tensors:
                out[key] = tensors[key][mine]
        if "bias" in tensors:
            out["bias"] = tensors["bias"]
        return out


# ---------------------------------------------------------------------------------------------- RansLinear

class RansShardRule(ShardRule):
    """rANS-coded layers: each stream codes all K rows of a tile of output channels, so a rank
    reads the whole streams, decodes them (lossless), takes its MarlinLinear shard and codes it
    again with the same ``channels_per_tile``."""

    def check(self, layer, style, world, name, splits=None):
        # A row shard holds whole groups, and rANS coding needs group sizes in multiples of its 32
        # lanes: every shard the MarlinLinear rule allows can be coded again.
        MARLIN.check(layer, style, world, name, splits)

    def splits_of(self, layer, style):
        return {n: None for n, t in layer._buffers.items() if t is not None}

    def build(self, layer, tensors, style, rank, world, name):
        full = RansLinear(layer.in_features, layer.out_features, bias="bias" in tensors, format=layer.format,
                          group_size=layer.group_size, channels_per_tile=layer.channels_per_tile,
                          n_words=tensors["rans_words"].numel(), dtype=tensors["scales"].dtype,
                          device=tensors["scales"].device, act_order="input_perm" in tensors)
        with torch.no_grad():
            for key, t in tensors.items():
                full._buffers[key].copy_(t)
        marlin = full.to_marlin()
        pieces = shard_tensors(MARLIN, marlin, dict(marlin.named_buffers()), style, rank, world)
        shard = MARLIN.build(marlin, pieces, style, rank, world, name)
        return RansLinear.from_marlin(shard, layer.channels_per_tile).train(layer.training)


# ---------------------------------------------------------------------------------------------- TrellisLinear

class TrellisShardRule(ShardRule):
    """Trellis: indices are packed per 16 x 16 tile, so a shard holds whole tiles (N / world or
    K / world a multiple of 16); row shards also hold whole groups. The rotation is a block Hadamard
    transform with random signs along K (``su``, input) and N (``sv``, output): a shard takes its
    signs and must hold whole Hadamard blocks, so its own rotation is the full layer's rotation
    restricted to its features. Row shards apply the output rotation to their partial sums, which
    is exact because it is linear. The codebook (``grid``) is shared by all ranks."""

    def check(self, layer, style, world, name, splits=None):
        _check_style(style)
        dim = "out_features" if style == "colwise" else "in_features"
        size = self.features(layer, style)
        if style == "colwise":
            _check_members(name, size, world, splits, trellis_fmt.TILE, "whole 16 x 16 index tiles")
        else:
            tile = math.lcm(trellis_fmt.TILE, layer.group_size)
            _divides(name, dim, size, world, tile, f"whole index tiles and groups of group_size={layer.group_size}")
        if layer.rotate:
            block = trellis_fmt.hadamard_block(size)
            for a, b in feature_ranges(size, 0, world, splits if style == "colwise" else None):
                if (b - a) % block:
                    raise ShardError(f"{name}: the {'output' if style == 'colwise' else 'input'} rotation mixes "
                                     f"{dim} in Hadamard blocks of {block}; a shard of {b - a} over world size "
                                     f"{world} would split them. Use a world size that leaves whole blocks, "
                                     "shard this layer the other way, keep it replicated, or quantize with "
                                     "rotate=False")

    def splits_of(self, layer, style):
        g = layer.group_size
        if style == "colwise":
            plan = {"packed_indices": Split(1, trellis_fmt.TILE), "scales": Split(1), "sv": Split(0), "bias": Split(0),
                    "grid": None, "su": None}
        else:
            plan = {"packed_indices": Split(0, trellis_fmt.TILE), "scales": Split(0, g), "su": Split(0), "bias": None,
                    "grid": None, "sv": None}
        return {k: v for k, v in plan.items() if layer._buffers.get(k) is not None}

    def build(self, layer, tensors, style, rank, world, name):
        if style == "rowwise" and rank != 0:
            tensors = {k: v for k, v in tensors.items() if k != "bias"}
        k_local, n_local = tensors["su"].numel(), tensors["sv"].numel()
        bias = tensors.get("bias")
        mod = TrellisLinear(k_local, n_local, bits=layer.bits, group_size=layer.group_size, bias=bias is not None,
                            rotate=layer.rotate, dtype=torch.float32 if bias is None else bias.dtype,
                            device=tensors["grid"].device)
        with torch.no_grad():
            for key, t in tensors.items():
                getattr(mod, key).copy_(t)
        mod.validate()
        mod.use_device_layout()
        return mod.train(layer.training)

    def canonical(self, layer: TrellisLinear) -> Dict[str, torch.Tensor]:
        out = dict(layer.named_buffers(recurse=False))
        out["packed_indices"] = layer.canonical_indices()
        return out


class FloatLinearRule(ShardRule):
    """A float ``nn.Linear`` (weight ``[N, K]``) computed locally like the quantized layers (no
    DTensor dispatch per call): for inference plans that keep some layers in float."""

    def check(self, layer, style, world, name, splits=None):
        _check_style(style)
        if style == "colwise":
            _check_members(name, layer.out_features, world, splits)
        else:
            _divides(name, "in_features", layer.in_features, world)

    def splits_of(self, layer, style):
        plan = {"weight": Split(0 if style == "colwise" else 1), "bias": Split(0) if style == "colwise" else None}
        return {k: v for k, v in plan.items() if getattr(layer, k) is not None}

    def build(self, layer, tensors, style, rank, world, name):
        if style == "rowwise" and rank != 0:
            tensors = {k: v for k, v in tensors.items() if k != "bias"}
        w = tensors["weight"]
        mod = nn.Linear(w.shape[1], w.shape[0], bias="bias" in tensors, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            for key, t in tensors.items():
                getattr(mod, key).copy_(t)
        return mod.requires_grad_(layer.weight.requires_grad).train(layer.training)


class RefusedRule(ShardRule):
    def __init__(self, why: str):
        self.why = why

    def check(self, layer, style, world, name, splits=None):
        raise ShardError(f"{name}: {type(layer).__name__} cannot be split over world size {world}: {self.why}")


MARLIN = MarlinShardRule()
RANS = RansShardRule()
TRELLIS = TrellisShardRule()
MOE = RefusedRule("expert tensors are not sharded (their SwiGLU intermediate is rotated per expert in the MoE "
                  "kernel); leave the MoE block out of the tensor-parallel plan so every rank holds it whole")
LOCAL_FLOAT = FloatLinearRule()


def buffers_of(layer: nn.Module) -> Dict[str, torch.Tensor]:
    """The layer's tensors as its checkpoint holds them (trellis indices in canonical tiles)."""
    if isinstance(layer, TrellisLinear):
        return TRELLIS.canonical(layer)
    tensors = dict(layer.named_parameters(recurse=False))
    tensors.update(layer.named_buffers(recurse=False))
    return {k: v.detach() for k, v in tensors.items() if v is not None}


def shard_tensors(rule: ShardRule, layer: nn.Module, tensors: Dict[str, torch.Tensor], style: str, rank: int,
                  world: int, splits: Optional[Sequence[int]] = None) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s pieces of a layer's whole tensors."""
    ranges = feature_ranges(rule.features(layer, style), rank, world, splits if style == "colwise" else None)
    plan = rule.splits_of(layer, style)
    return {k: take(tensors[k], plan[k], ranges) for k in plan}


def read_pieces(rule: ShardRule, layer: nn.Module, read: Callable[[str, Optional[Split], list], torch.Tensor],
                style: str, rank: int, world: int) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s pieces read from storage: ``read(buffer name, split, element ranges)`` returns
    the piece (the whole tensor for ``split=None``), so a loader reads only what the rank keeps."""
    ranges = feature_ranges(rule.features(layer, style), rank, world)
    return {k: read(k, s, None if s is None else element_ranges(s, ranges))
            for k, s in rule.splits_of(layer, style).items()}


def become(layer: nn.Module, shard: nn.Module) -> nn.Module:
    """Turns ``layer`` into ``shard`` in place (same class), keeping the hooks installed on it, for
    engines that parallelize a module object without replacing it."""
    if type(layer) is not type(shard):
        raise TypeError(f"cannot turn a {type(layer).__name__} into a {type(shard).__name__}")
    for key, value in vars(shard).items():
        if "hook" not in key:
            layer.__dict__[key] = value
    return layer
