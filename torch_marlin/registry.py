"""The quantized layer formats, one entry each: what ``patch_model(format=...)``, checkpoints,
fusion and tensor-parallel sharding know about a format.

A format is a layer class plus the options that make it (vLLM's "a config plus a kernel class"):
the reference packing and quantizer live in ``torch_marlin/formats/<name>.py``, the layer in
``torch_marlin/modules/``, and the entry here ties them to the format string. Every layer class
provides

* ``from_linear(linear, group_size=..., dtype=..., **options)``: quantizes an ``nn.Linear``;
* ``checkpoint_entry()``: the JSON-able description a checkpoint stores per layer;
* ``from_checkpoint_entry(entry, device)``: an empty layer of that description (loading);
* ``concat(layers)`` (classmethod): ``(fused layer, None)``, one layer computing the members' outputs
  side by side (torch_marlin/fusion.py), or ``(None, reason)``.

docs/architecture.md, "Adding a format", lists the files a new format touches.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from .distributed import rules as sharding
from .formats import int4_packing
from .formats import rans as rans_format
from .formats import trellis as trellis_format
from .modules import MarlinLinear, RansLinear, TrellisLinear


def _no_shared_options(leader: nn.Module) -> dict:
    return {}


@dataclass(frozen=True)
class LayerFormat:
    """One quantized layer format.

    ``check_group_size(group_size, in_features=None)`` raises ``ValueError`` when the format cannot
    take that group size (or a layer of that width). ``layer_options``: the keyword arguments that
    select this format in ``layer`` (MarlinLinear's ``format``). ``options``: the quantizer options
    ``patch_model`` accepts for it. ``shared_options(leader)``: the options that make a layer fusable
    with ``leader``, the first quantized member of its fusion group (trellis: one codebook).
    ``shard``: how a layer splits across tensor-parallel ranks, a
    :class:`torch_marlin.distributed.rules.ShardRule` (``shard(layer, style, rank, world)`` is a
    rank's layer); None where the format has no rule.
    """
    name: str
    layer: type
    check_group_size: Callable[..., None]
    layer_options: Mapping[str, object] = field(default_factory=dict)
    options: Tuple[str, ...] = ()
    shared_options: Callable[[nn.Module], dict] = _no_shared_options
    shard: Optional[Callable] = None

    def quantize(self, linear: nn.Linear, group_size: int, dtype: torch.dtype, **options) -> nn.Module:
        """``linear`` quantized to this format (``options``: those of :attr:`options`, and the
        calibration's ``hessian``, ``act_order``, ``damp``)."""
        return self.layer.from_linear(linear, group_size=group_size, dtype=dtype, **self.layer_options, **options)

    def concat(self, layers) -> Tuple[Optional[nn.Module], Optional[str]]:
        """``(fused layer, None)`` computing the members' outputs side by side, or ``(None, reason)``."""
        return self.layer.concat(layers)

    def unsupported(self, in_features: int, group_size: int) -> Optional[str]:
        """Why a layer of ``in_features`` inputs cannot take this format and group size (None when it can)."""
        try:
            self.check_group_size(group_size, in_features)
        except ValueError as e:
            return str(e)
        return None

    def describes(self, module: nn.Module) -> bool:
        return isinstance(module, self.layer) and all(getattr(module, k) == v for k, v in self.layer_options.items())


LAYER_FORMATS: Dict[str, LayerFormat] = {f.name: f for f in (
    LayerFormat("fp4", MarlinLinear, int4_packing.check_group_size, {"format": "fp4"}, shard=sharding.MARLIN),
    LayerFormat("u4", MarlinLinear, int4_packing.check_group_size, {"format": "u4"}, options=("symmetric",),
                shard=sharding.MARLIN),
    LayerFormat("affine", MarlinLinear, int4_packing.check_group_size, {"format": "affine"}, shard=sharding.MARLIN),
    LayerFormat("trellis", TrellisLinear, trellis_format.check_group_size, options=("bits", "rotate", "seed"),
                shared_options=lambda leader: {"grid": leader.grid}, shard=sharding.TRELLIS),
)}
FORMATS = tuple(LAYER_FORMATS)

#: MarlinLinear layers with their 4-bit codes rANS-coded (``patch_model(entropy_coding=True)``): not a
#: format of their own (each keeps its fp4 / u4 / affine ``format``), so not in LAYER_FORMATS;
#: checkpoints mark them with ``"type": "RansLinear"``.
ENTROPY_CODED = LayerFormat("rans", RansLinear, rans_format.check_group_size, shard=sharding.RANS)
ENTROPY_CODED_FORMATS = tuple(name for name, f in LAYER_FORMATS.items() if f.layer is MarlinLinear)


def layer_format(name: str) -> LayerFormat:
    """The entry of format ``name``; ValueError naming the formats for an unknown one."""
    if name not in LAYER_FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {name!r}")
    return LAYER_FORMATS[name]


def layer_format_of(module: nn.Module) -> Optional[LayerFormat]:
    """The entry describing an already-quantized module, or None for anything else."""
    for f in (ENTROPY_CODED, *LAYER_FORMATS.values()):
        if f.describes(module):
            return f
    return None


def checkpoint_entry(module: nn.Module) -> Optional[dict]:
    """JSON-able description of a quantized module (the checkpoint's per-layer entry), or None."""
    return None if layer_format_of(module) is None else module.checkpoint_entry()


def layer_format_for_entry(entry: dict) -> LayerFormat:
    """The entry that rebuilds a checkpoint's layer entry; ValueError for an unknown one."""
    if not isinstance(entry, dict) or entry.get("format") not in LAYER_FORMATS:
        raise ValueError(f"no valid format (one of {FORMATS}): {entry!r}")
    if entry.get("type") == "RansLinear":
        if entry["format"] not in ENTROPY_CODED_FORMATS:
            raise ValueError(f"entropy-coded layers have a format in {ENTROPY_CODED_FORMATS}, got {entry['format']!r}")
        return ENTROPY_CODED
    return LAYER_FORMATS[entry["format"]]


def empty_layer(entry: dict, device) -> nn.Module:
    """An empty layer of a checkpoint entry, for its tensors to load into; ValueError when the
    entry is incomplete or describes an impossible layer."""
    layer = layer_format_for_entry(entry).layer
    try:
        return layer.from_checkpoint_entry(entry, device)
    except KeyError as e:
        raise ValueError(f"a {layer.__name__} entry needs the key {e}: {entry!r}") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"a {layer.__name__} entry has a value of the wrong type ({e}): {entry!r}") from None


def check_entry_tensors(entry: dict, tensors: Dict[str, Tuple[Tuple[int, ...], str]]) -> None:
    """Raises ValueError when ``tensors`` (buffer name -> (shape, dtype name), as a checkpoint
    holds them) are not exactly those of the layer ``entry`` describes: the tensors of an empty
    layer of that entry, built on the meta device."""
    expected = {name: (tuple(t.shape), str(t.dtype).replace("torch.", ""))
                for name, t in empty_layer(entry, "meta").state_dict().items()}
    what = ", ".join(f"{k}={v}" for k, v in entry.items() if k != "type")
    for name, (shape, dtype) in expected.items():
        if name not in tensors:
            raise ValueError(f"tensor '{name}' is missing ({what})")
        got_shape, got_dtype = tensors[name]
        if tuple(got_shape) != shape or got_dtype != dtype:
            raise ValueError(f"tensor '{name}' has shape {tuple(got_shape)} dtype {got_dtype}, but the config "
                             f"({what}) implies shape {shape} dtype {dtype}")
    extra = set(tensors) - set(expected)
    if extra:
        raise ValueError(f"unexpected tensors {sorted(extra)} ({what})")


def use_device_layouts(model: nn.Module) -> None:
    """Puts every layer's tensors in the layout its device's kernels read fastest (trellis indices:
    the CUDA lane layout); loading calls it once the model is on its device."""
    for module in model.modules():
        if isinstance(module, TrellisLinear):
            module.use_device_layout()
