"""``patch_model``: swap a model's ``nn.Linear`` layers for quantized ones, in place.

The quantized layer types live in one small table (:data:`LAYER_TYPES`), so a new format plugs in
by adding a row: how to quantize an ``nn.Linear`` into it, how to build an empty one of a given
shape (used by :func:`torch_marlin.load_quantized`), and how to describe one in a checkpoint's JSON.
Nothing here imports ``transformers``: it works on any ``nn.Module``.
"""

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import calibration as calibration_mod
from .formats.trellis import hadamard_block
from .fusion import GROUPS as FUSE_GROUPS, concat_out_features, fuse_projections
from .modules import MarlinLinear, RansLinear, TrellisLinear
from .modules.rans import coding_unsupported

DEFAULT_SKIP = ("lm_head",)
# patch_model(quantize_lm_head=True): the output projection's format and group size, chosen on
# SmolLM2-135M (docs/formats.md, "Quantized lm_head") for its perplexity and top-1 agreement per byte.
LM_HEAD_FORMAT, LM_HEAD_GROUP_SIZE = "u4", 64
MARLIN_FORMATS = ("fp4", "u4", "affine")
METHODS = ("rtn", "gptq")


# ----------------------------------------------------------------------------------------------
# The layer-type table
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerType:
    """How one quantized layer class is made, rebuilt and described.

    ``quantize(linear, group_size, dtype, **opts)`` returns the quantized module.
    ``empty(config: dict, device)`` builds an uninitialized module from a checkpoint entry.
    ``describe(module)`` returns that checkpoint entry (JSON-able dict).
    ``check_shapes(config, tensors)`` raises ValueError when tensors disagree with the entry.
    ``supports(linear, group_size)`` returns None or why that layer cannot take this format.
    ``concat(modules)`` returns ``(fused module, None)``: one layer computing the members' outputs
    side by side (torch_marlin/fusion.py), or ``(None, reason)`` when they cannot share one.
    ``shared_options(module)`` returns the quantizer options that make a layer fusable with
    ``module`` (patch_model(fuse=True) passes them when quantizing the rest of a fused group).
    """
    name: str
    module_class: Callable[[], type]
    quantize: Callable
    empty: Callable
    describe: Callable
    check_shapes: Callable
    supports: Callable          # (linear, group_size) -> None, or the reason it cannot be converted
    options: Tuple[str, ...]    # keyword options patch_model passes on to ``quantize``
    concat: Optional[Callable] = None          # default: every buffer concatenated along out_features
    shared_options: Callable = lambda module: {}

    def __post_init__(self):
        if self.concat is None:
            object.__setattr__(self, "concat", lambda mods: concat_out_features(mods, self.describe, self.empty))


def _marlin_quantize(fmt):
    def quantize(linear: nn.Linear, group_size: int, dtype: torch.dtype, symmetric: bool = False, **calibrated):
        return MarlinLinear.from_linear(linear, format=fmt, group_size=group_size, dtype=dtype,
                                        symmetric=symmetric, **calibrated)
    return quantize


def _marlin_empty(cfg: dict, device) -> MarlinLinear:
    return MarlinLinear(cfg["in_features"], cfg["out_features"], bias=cfg["bias"], format=cfg["format"],
                        group_size=cfg["group_size"], dtype=getattr(torch, cfg["dtype"]), device=device,
                        act_order=cfg.get("act_order", False))


def _marlin_describe(mod: MarlinLinear) -> dict:
    return {"type": "MarlinLinear", "format": mod.format, "group_size": mod.group_size,
            "in_features": mod.in_features, "out_features": mod.out_features,
            "bias": mod.bias is not None, "dtype": str(mod.scales.dtype).replace("torch.", ""),
            "act_order": mod.input_perm is not None}


def _marlin_check_shapes(cfg: dict, tensors: Dict[str, Tuple[Tuple[int, ...], str]]) -> None:
    """``tensors`` maps buffer name -> (shape, dtype string) as found in the checkpoint."""
    K, N, g = cfg["in_features"], cfg["out_features"], cfg["group_size"]
    if K % 8 != 0 or g <= 0 or g % 8 != 0 or K % g != 0:
        raise ValueError(f"in_features={K} / group_size={g} are not a valid MarlinLinear shape "
                         "(in_features multiple of 8, group_size a multiple of 8 dividing it)")
    expected = {"B_packed": ((K // 8, N), "int32"), "scales": ((K // g, N), cfg["dtype"])}
    if cfg["format"] == "u4":
        expected["zeros"] = ((K // g, N), "uint8")
    if cfg["format"] == "affine":
        expected["offsets"] = ((K // g, N), cfg["dtype"])
    if cfg["bias"]:
        expected["bias"] = ((N,), cfg["dtype"])
    if cfg.get("act_order", False):
        expected["input_perm"] = ((K,), "int64")
    _check_expected(expected, tensors, f"format={cfg['format']}, in_features={K}, out_features={N}, "
                                       f"group_size={g}, bias={cfg['bias']}, dtype={cfg['dtype']}")


def _marlin_supports(linear: nn.Linear, group_size: int) -> Optional[str]:
    if linear.in_features % 8 != 0 or linear.in_features % group_size != 0:
        return f"in_features={linear.in_features} is not a multiple of group_size={group_size}"
    return None


def _check_expected(expected: dict, tensors: dict, what: str) -> None:
    for key, (shape, dtype) in expected.items():
        if key not in tensors:
            raise ValueError(f"tensor '{key}' is missing ({what})")
        got_shape, got_dtype = tensors[key]
        if tuple(got_shape) != shape or got_dtype != dtype:
            raise ValueError(f"tensor '{key}' has shape {tuple(got_shape)} dtype {got_dtype}, but the config "
                             f"({what}) implies shape {shape} dtype {dtype}")
    extra = set(tensors) - set(expected)
    if extra:
        raise ValueError(f"unexpected tensors {sorted(extra)} ({what})")


def _trellis_quantize(linear: nn.Linear, group_size: int, dtype: torch.dtype, bits: int = 3, rotate: bool = True,
                      seed: int = 0, grid: Optional[torch.Tensor] = None, **calibrated):
    return TrellisLinear.from_linear(linear, bits=bits, group_size=group_size, rotate=rotate, dtype=dtype,
                                     seed=seed, grid=grid, **calibrated)


def _trellis_concat(mods):
    """Trellis layers share one codebook (``grid``) and input signs (``su``): members fuse when
    those agree (patch_model(fuse=True) quantizes a group with its first member's codebook, and
    one seed gives one ``su`` per K), every N is a whole number of 16-column tiles (indices are
    packed per 16 x 16 tile) and, when rotated, the fused N has each member's Hadamard block along
    N, so the output rotation acts on each member's columns alone."""
    first = mods[0]
    total = sum(m.out_features for m in mods)
    cfg = dict(_trellis_describe(first), out_features=total)
    if any(dict(_trellis_describe(m), out_features=total) != cfg for m in mods):
        return None, "members differ in bits, group size, rotation, bias or dtype"
    if len({m.grid.device for m in mods}) != 1:
        return None, "members are on different devices"
    for m in mods[1:]:
        if not (torch.equal(m.grid, first.grid) and torch.equal(m.su, first.su)):
            return None, "members have different codebooks or input signs (quantize them with fuse=True)"
    if any(m.out_features % 16 for m in mods):
        return None, "trellis members fuse only with out_features multiples of 16"
    if first.rotate and any(hadamard_block(m.out_features) != hadamard_block(total) for m in mods):
        return None, "the members' output rotations have different block sizes"
    fused = _trellis_empty(cfg, first.grid.device)
    with torch.no_grad():
        fused.packed_indices.copy_(torch.cat([m.canonical_indices() for m in mods], dim=1))
        fused.scales.copy_(torch.cat([m.scales for m in mods], dim=-1))
        fused.sv.copy_(torch.cat([m.sv for m in mods], dim=-1))
        fused.grid.copy_(first.grid)
        fused.su.copy_(first.su)
        if first.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in mods], dim=-1))
    fused.validate()
    fused._sync_index_layout()
    return fused, None


def _trellis_empty(cfg: dict, device):
    return TrellisLinear(cfg["in_features"], cfg["out_features"], bits=cfg["bits"], group_size=cfg["group_size"],
                            bias=cfg["bias"], rotate=cfg["rotate"], dtype=getattr(torch, cfg["dtype"]), device=device)


def _trellis_describe(mod) -> dict:
    # Only the bias follows the module dtype; the trellis scales/grid/signs are always fp32.
    dtype = mod.bias.dtype if mod.bias is not None else torch.float32
    return {"type": "TrellisLinear", "format": "trellis", "bits": mod.bits, "group_size": mod.group_size,
            "rotate": bool(mod.rotate), "in_features": mod.in_features, "out_features": mod.out_features,
            "bias": mod.bias is not None, "dtype": str(dtype).replace("torch.", "")}


def _trellis_check_shapes(cfg: dict, tensors) -> None:
    K, N, g = cfg["in_features"], cfg["out_features"], cfg["group_size"]
    bits = cfg.get("bits")
    if bits not in (2, 3, 4) or "rotate" not in cfg:
        raise ValueError(f"a trellis layer needs bits in (2, 3, 4) and rotate, got bits={bits!r}")
    if g <= 0 or g % 16 != 0:
        raise ValueError(f"group_size={g} is not a positive multiple of 16")
    expected = {"packed_indices": (((K + 15) // 16, (N + 15) // 16, 32 * bits), "uint8"),
                "scales": (((K + g - 1) // g, N), "float32"), "grid": ((1 << bits,), "float32"),
                "su": ((K,), "float32"), "sv": ((N,), "float32")}
    if cfg["bias"]:
        expected["bias"] = ((N,), cfg["dtype"])
    _check_expected(expected, tensors, f"in_features={K}, out_features={N}, bits={bits}, group_size={g}, "
                                       f"bias={cfg['bias']}, dtype={cfg['dtype']}")


def _trellis_supports(linear: nn.Linear, group_size: int) -> Optional[str]:
    # The trellis format pads K and N to 16x16 tiles itself; only the group size is constrained.
    if group_size % 16 != 0:
        return f"trellis needs group_size a multiple of 16, got {group_size}"
    return None


LAYER_TYPES: Dict[str, LayerType] = {
    "fp4": LayerType("fp4", lambda: MarlinLinear, _marlin_quantize("fp4"), _marlin_empty, _marlin_describe,
                     _marlin_check_shapes, _marlin_supports, ()),
    "u4": LayerType("u4", lambda: MarlinLinear, _marlin_quantize("u4"), _marlin_empty, _marlin_describe,
                    _marlin_check_shapes, _marlin_supports, ("symmetric",)),
    "affine": LayerType("affine", lambda: MarlinLinear, _marlin_quantize("affine"), _marlin_empty, _marlin_describe,
                        _marlin_check_shapes, _marlin_supports, ()),
    "trellis": LayerType("trellis", lambda: TrellisLinear, _trellis_quantize, _trellis_empty, _trellis_describe,
                         _trellis_check_shapes, _trellis_supports, ("bits", "rotate", "seed"), _trellis_concat,
                         lambda module: {"grid": module.grid}),
}
FORMATS = tuple(LAYER_TYPES)


def _rans_empty(cfg: dict, device) -> RansLinear:
    return RansLinear(cfg["in_features"], cfg["out_features"], bias=cfg["bias"], format=cfg["format"],
                      group_size=cfg["group_size"], channels_per_tile=cfg["channels_per_tile"],
                      n_words=cfg["n_words"], dtype=getattr(torch, cfg["dtype"]), device=device,
                      act_order=cfg.get("act_order", False))


def _rans_describe(mod: RansLinear) -> dict:
    return dict(_marlin_describe(mod), type="RansLinear", channels_per_tile=mod.channels_per_tile,
                n_words=mod.rans_words.numel())


def _rans_check_shapes(cfg: dict, tensors) -> None:
    K, N, g = cfg["in_features"], cfg["out_features"], cfg["group_size"]
    C, W = cfg.get("channels_per_tile"), cfg.get("n_words")
    if not isinstance(C, int) or C <= 0 or not isinstance(W, int) or W < 0:
        raise ValueError(f"an entropy-coded layer needs channels_per_tile > 0 and n_words >= 0, got {C!r}, {W!r}")
    why = coding_unsupported(K, g)
    if why is not None:
        raise ValueError(why)
    T = -(-N // C)
    coded = {"rans_words": ((W,), "int16"), "rans_word_offsets": ((T + 1,), "int32"),
             "rans_states": ((T, 32), "int32"), "rans_freqs": ((T, 16), "int16")}
    # The uncoded layer's tensors, with the codes in place of B_packed.
    uncoded = dict(tensors)
    uncoded["B_packed"] = ((K // 8, N), "int32")
    for key in coded:
        uncoded.pop(key, None)
    _marlin_check_shapes(cfg, uncoded)
    _check_expected(coded, {k: tensors[k] for k in coded if k in tensors},
                    f"entropy-coded {cfg['format']}, in_features={K}, out_features={N}, channels_per_tile={C}")


def _rans_concat(mods):
    """Fused rANS layers: the members decoded, concatenated as MarlinLinear, coded again."""
    fused, why = LAYER_TYPES[mods[0].format].concat([m.to_marlin() for m in mods])
    if fused is None:
        return None, why
    return RansLinear.from_marlin(fused), None


#: Entropy-coded MarlinLinear layers (``patch_model(entropy_coding=True)``): not a format of their
#: own, so not in LAYER_TYPES; checkpoints mark them with ``"type": "RansLinear"``.
RANS_LAYER_TYPE = LayerType("rans", lambda: RansLinear, None, _rans_empty, _rans_describe, _rans_check_shapes,
                            lambda linear, group_size: coding_unsupported(linear.in_features, group_size), (),
                            _rans_concat)


def layer_type_for_entry(entry: dict) -> LayerType:
    """The table row that rebuilds a checkpoint's layer entry; ValueError for an unknown one."""
    if not isinstance(entry, dict) or entry.get("format") not in LAYER_TYPES:
        raise ValueError(f"no valid format (one of {FORMATS}): {entry!r}")
    if entry.get("type") == "RansLinear":
        if entry["format"] not in MARLIN_FORMATS:
            raise ValueError(f"entropy-coded layers have a format in {MARLIN_FORMATS}, got {entry['format']!r}")
        return RANS_LAYER_TYPE
    return LAYER_TYPES[entry["format"]]


def layer_type_of(module: nn.Module) -> Optional[LayerType]:
    """The table row describing an already-quantized module, or None for anything else."""
    if isinstance(module, RansLinear):
        return RANS_LAYER_TYPE
    if isinstance(module, MarlinLinear):
        return LAYER_TYPES[module.format]
    if isinstance(module, TrellisLinear):
        return LAYER_TYPES["trellis"]
    return None


def quantized_layer_entry(module: nn.Module) -> Optional[dict]:
    """JSON-able description of a quantized module (the checkpoint's per-layer config)."""
    lt = layer_type_of(module)
    return None if lt is None else lt.describe(module)


# ----------------------------------------------------------------------------------------------
# patch_model
# ----------------------------------------------------------------------------------------------

@dataclass
class PatchReport:
    """What :func:`patch_model` did. ``replaced``: (name, in_features, out_features) per layer;
    ``skipped``: (name, reason); bytes of the weights before (float) and after (quantized)."""
    format: str
    group_size: int
    replaced: List[Tuple[str, int, int]] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)
    float_bytes: int = 0
    quantized_bytes: int = 0
    method: str = "rtn"
    uncalibrated: List[str] = field(default_factory=list)
    fused: List[Tuple[str, Tuple[str, ...]]] = field(default_factory=list)  # (fused layer, members)
    unfused: List[Tuple[str, str]] = field(default_factory=list)             # (group, reason)
    entropy_coded: List[Tuple[str, int, float]] = field(default_factory=list)  # (layer, weights, code bits/weight)
    not_entropy_coded: List[Tuple[str, str]] = field(default_factory=list)     # (layer, reason)

    def __str__(self) -> str:
        how = "" if self.method == "rtn" else f" method={self.method}"
        lines = [f"patch_model: format={self.format} group_size={self.group_size}{how}: "
                 f"replaced {len(self.replaced)} Linear layers, skipped {len(self.skipped)}"]
        if self.replaced:
            ratio = self.float_bytes / max(self.quantized_bytes, 1)
            lines.append(f"  replaced weights: {self.float_bytes / 2**20:.2f} MiB -> "
                         f"{self.quantized_bytes / 2**20:.2f} MiB ({ratio:.1f}x smaller)")
        for name, reason in self.skipped:
            lines.append(f"  skipped {name}: {reason}")
        if self.uncalibrated:
            lines.append(f"  not reached by the calibration inputs (round to nearest): {', '.join(self.uncalibrated)}")
        if self.fused or self.unfused:
            lines.append(f"  fused {len(self.fused)} projection groups into one GEMM each")
        for group, reason in self.unfused:
            lines.append(f"  not fused {group}: {reason}")
        if self.entropy_coded:
            weights = sum(n for _, n, _ in self.entropy_coded)
            bits = sum(n * b for _, n, b in self.entropy_coded) / weights
            lines.append(f"  entropy-coded {len(self.entropy_coded)} layers: codes at {bits:.3f} bits per weight "
                         "(4 uncoded)")
        for name, reason in self.not_entropy_coded:
            lines.append(f"  not entropy-coded {name}: {reason}")
        return "\n".join(lines)


def resolve_device(device) -> Optional[torch.device]:
    """``"auto"`` -> mps if available, else cuda, else cpu; None stays None (leave in place)."""
    if device is None:
        return None
    if isinstance(device, str) and device == "auto":
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    return torch.device(device)


def _matches(name: str, patterns: Iterable[str]) -> Optional[str]:
    """A pattern matches a module name exactly, as its last dotted component(s), or as a glob."""
    for p in patterns:
        if name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p):
            return p
    return None


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _module_bytes(mod: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(mod.parameters(recurse=False)) +
               list(mod.buffers(recurse=False)) if t is not None)


def patch_model(model: nn.Module, format: str = "fp4", group_size: int = 128,
                skip: Sequence[str] = DEFAULT_SKIP, device=None, dtype: Optional[torch.dtype] = None,
                strict: bool = False, progress: bool = True, method: str = "rtn", calibration=None,
                act_order: bool = True, damp: float = 0.01, fuse: bool = False, entropy_coding: bool = False,
                quantize_lm_head: bool = False, **format_options) -> PatchReport:
    """Replaces ``model``'s ``nn.Linear`` layers with quantized ones, in place; returns a report.

    ``format``: ``"fp4"``, ``"u4"`` or ``"affine"`` (MarlinLinear), ``"trellis"`` (TrellisLinear).
    ``skip``: module names to keep in float: exact names, trailing components (``"lm_head"``,
    ``"pooler.dense"``) or globs (``"*.attention.*"``). Layers sharing their weight with another
    module (e.g. an ``lm_head`` tied to the embeddings) are always kept, since quantizing one would
    silently untie them. Layers whose ``in_features`` the group size does not divide are skipped
    with a reason in the report, or raise ``ValueError`` when ``strict``.
    ``device``: None leaves the model where it is; ``"auto"`` picks mps > cuda > cpu; else a device.
    The model is moved first, so quantization runs there. ``dtype``: dtype of scales/bias
    (default: each layer's own dtype, so an fp32 model runs fp32 activations without casts).
    ``progress``: tqdm bar over the layers. ``format_options`` go to the format's quantizer:
    u4 ``symmetric`` (zero point fixed at 8); trellis ``bits`` (2/3/4), ``rotate``, ``seed``.

    ``method``: ``"rtn"`` (round to nearest with least-squares scale search, no data) or
    ``"gptq"`` (error feedback with each layer's input Hessian; trellis layers run it on their
    rotated weights, i.e. LDLQ). ``calibration`` (gptq): an iterable of model inputs, each a tensor
    of input ids, a dict of keyword arguments (as a tokenizer returns; an ``attention_mask`` in it
    keeps padding out of the Hessians) or a tuple of positional arguments. Layers are calibrated
    in call order, each on the outputs of the already-quantized layers before it
    (torch_marlin/calibration.py); layers the calibration never reaches fall back to rtn and are
    listed in the report. ``act_order`` and ``damp``: GPTQ options (torch_marlin/formats/gptq_solver.py).

    ``fuse``: after quantizing, sibling projections that read the same input (q/k/v, gate/up) run
    as one quantized GEMM each, N concatenated (:func:`torch_marlin.fusion.fuse_projections`); the
    members of a group are quantized exactly as unfused ones, except that a format whose members
    must share state to fuse (trellis: one codebook) quantizes the rest of a group with its first
    member's. Only the transformers families of :data:`torch_marlin.fusion.SUPPORTED` fuse; the
    report's ``unfused`` says why a group was not.

    ``quantize_lm_head``: quantize the output projection too (``model.get_output_embeddings()``, else
    a Linear named ``lm_head``; even where ``skip`` names it), in :data:`LM_HEAD_FORMAT` with
    :data:`LM_HEAD_GROUP_SIZE` whatever ``format`` is. One tied to the input embeddings is untied
    first: the embeddings keep their float weights. Off by default: the output projection is the
    layer whose error every token's choice sees directly.

    ``entropy_coding`` (fp4, u4, affine): after quantizing, each layer's 4-bit codes are stored
    rANS-coded (:class:`torch_marlin.RansLinear`, lossless: the same outputs up to fp32 summation
    order, fewer bytes). Layers the coding does not support (``in_features`` or ``group_size`` not a
    multiple of 32) stay uncoded and are listed in the report.
    """
    if format not in LAYER_TYPES:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(skip, str):
        skip = [skip]
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 8 != 0:
        raise ValueError(f"group_size must be a positive multiple of 8, got {group_size!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "rtn" and calibration is not None:
        raise ValueError("calibration is only used by method='gptq'; pass method='gptq' or drop calibration")
    batches = calibration_mod.as_batches(calibration) if method == "gptq" else None
    if not isinstance(damp, (int, float)) or damp < 0:
        raise ValueError(f"damp must be a number >= 0, got {damp!r}")
    if entropy_coding and format not in MARLIN_FORMATS:
        raise ValueError(f"entropy_coding applies to the formats {MARLIN_FORMATS}, got format={format!r}")
    lt = LAYER_TYPES[format]
    bad = sorted(set(format_options) - set(lt.options))
    if bad:
        raise TypeError(f"format={format!r} takes options {list(lt.options)}, got unexpected {bad}")
    lt.module_class()  # raises a clear error when the module is not part of this build (trellis)
    head = _output_projection(model) if quantize_lm_head else None
    if quantize_lm_head and head is None:
        raise ValueError("quantize_lm_head=True: the model has no output projection (an nn.Linear from "
                         "get_output_embeddings() or named lm_head)")
    dev = resolve_device(device)
    if dev is not None:
        model.to(dev)

    # Weights shared with other modules (tied embeddings): count users of every parameter.
    users: Dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1

    report = PatchReport(format=format, group_size=group_size, method=method)
    todo = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:  # subclasses (e.g. already-quantized wrappers) are left alone
            continue
        pattern = _matches(name, skip)
        reason = (LAYER_TYPES[LM_HEAD_FORMAT] if mod is head else lt).supports(
            mod, LM_HEAD_GROUP_SIZE if mod is head else group_size)
        if pattern is not None and mod is not head:
            report.skipped.append((name, f"matches skip pattern {pattern!r}"))
        elif users.get(id(mod.weight), 0) > 1 and mod is not head:
            report.skipped.append((name, "weight is shared with another module (tied)"))
        elif reason is not None:
            if strict:
                raise ValueError(f"{name}: {reason}; pass skip=[...] or another group_size")
            report.skipped.append((name, reason))
        else:
            todo.append((name, mod))

    if head is not None and users.get(id(head.weight), 0) > 1 and any(lin is head for _, lin in todo):
        # Tied to the input embeddings: the projection gets its own copy (GPTQ rewrites the weight it
        # quantizes in place; the embeddings must keep theirs) and the config says the two are apart.
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
        config = getattr(model, "config", None)
        for cfg in {id(c): c for c in (config, getattr(config, "get_text_config", lambda **k: None)())
                    if c is not None}.values():
            if hasattr(cfg, "tie_word_embeddings"):
                cfg.tie_word_embeddings = False
    leader_of = _fuse_leaders([name for name, _ in todo]) if fuse else {}
    quantized: Dict[str, nn.Module] = {}
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(todo), desc=f"quantizing to {format} g{group_size} ({method})", unit="layer")

    def quantize(name: str, lin: nn.Linear, **calibrated) -> nn.Module:
        layer_dtype = dtype if dtype is not None else lin.weight.dtype
        if lin is head:
            new = LAYER_TYPES[LM_HEAD_FORMAT].quantize(lin, LM_HEAD_GROUP_SIZE, layer_dtype, **calibrated)
            return finish(name, lin, new)
        leader = quantized.get(leader_of.get(name, name))
        shared = lt.shared_options(leader) if leader is not None else {}
        new = lt.quantize(lin, group_size, layer_dtype, **format_options, **shared, **calibrated)
        return finish(name, lin, new)

    def finish(name: str, lin: nn.Linear, new: nn.Module) -> nn.Module:
        quantized[name] = new
        new.train(lin.training)
        report.float_bytes += _module_bytes(lin)
        report.quantized_bytes += _module_bytes(new)
        report.replaced.append((name, lin.in_features, lin.out_features))
        if bar is not None:
            bar.update(1)
        return new

    with torch.no_grad():
        if method == "rtn":
            for name, lin in todo:
                _set_submodule(model, name, quantize(name, lin))
        else:
            was_training = model.training
            model.eval()  # no dropout while measuring the inputs
            done = []
            try:
                layers = dict(todo)
                for names, H in calibration_mod.calibrated_layers(model, layers, batches):
                    for name in sorted(names, key=lambda n: leader_of.get(n, n) != n):  # group leaders first
                        lin = layers[name]
                        if H is None:
                            report.uncalibrated.append(name)
                            new = quantize(name, lin)
                        else:
                            new = quantize(name, lin, hessian=H, act_order=act_order, damp=damp)
                        # Later steps see this layer's quantized weights. Through a dense matmul on the
                        # dequantized weight (same values as the kernels; far faster on CPU than
                        # re-running the quantized kernels once per later step).
                        lin.weight.copy_(new.dequantized_weight().to(lin.weight.dtype))
                        done.append((name, new))
                    del H  # one Hessian at a time: drop this one before the next is collected
                for name, new in done:
                    _set_submodule(model, name, new)
            finally:
                model.train(was_training)
    if bar is not None:
        bar.close()
    if entropy_coding:
        _entropy_code(model, quantized, report, progress)
    if fuse:
        report.fused, report.unfused = fuse_projections(model)
    return report


def _output_projection(model: nn.Module) -> Optional[nn.Linear]:
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else getattr(model, "lm_head", None)
    return out if type(out) is nn.Linear else None


def entropy_code(model: nn.Module, progress: bool = True, report: Optional[PatchReport] = None) -> PatchReport:
    """Replaces every ``MarlinLinear`` of ``model`` that the coding supports by its rANS-coded copy
    (:class:`torch_marlin.RansLinear`), in place, e.g. after :func:`torch_marlin.from_pretrained`;
    returns ``report`` (a new one when None) with ``entropy_coded`` / ``not_entropy_coded`` filled."""
    if report is None:
        report = PatchReport(format="", group_size=0)
    layers = {name: mod for name, mod in model.named_modules() if type(mod) is MarlinLinear}
    _entropy_code(model, layers, report, progress)
    return report


def _entropy_code(model: nn.Module, quantized: Dict[str, nn.Module], report: PatchReport, progress: bool) -> None:
    bar = None
    if progress and quantized:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(quantized), desc="entropy coding", unit="layer")
    for name, mod in quantized.items():
        why = coding_unsupported(mod.in_features, mod.group_size)
        if why is not None:
            report.not_entropy_coded.append((name, why))
        else:
            coded = RansLinear.from_marlin(mod)
            report.quantized_bytes += _module_bytes(coded) - _module_bytes(mod)
            report.entropy_coded.append((name, mod.in_features * mod.out_features, coded.code_bits_per_weight()))
            _set_submodule(model, name, coded)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def _fuse_leaders(names: Sequence[str]) -> Dict[str, str]:
    """Member name -> the first member's name, for every complete fusion group among ``names``."""
    present = set(names)
    leaders: Dict[str, str] = {}
    for name in names:
        parent, _, attr = name.rpartition(".")
        prefix = parent + "." if parent else ""
        for members, _ in FUSE_GROUPS:
            if attr in members and all(prefix + m in present for m in members):
                leaders[name] = prefix + members[0]
    return leaders
