"""``patch_model``: swap a model's ``nn.Linear`` layers for quantized ones, in place.

What each format is (its layer class, quantizer options, group-size rule) is its entry in
torch_marlin/registry.py; this module only walks the model. Nothing here imports
``transformers``: it works on any ``nn.Module``.
"""

import fnmatch
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import calibration as calibration_mod
from .dtypes import check_float_dtype
from .fusion import GROUPS as FUSE_GROUPS, fuse_projections
from .modules import MarlinLinear, RansLinear
from .registry import ENTROPY_CODED, ENTROPY_CODED_FORMATS, LayerFormat, layer_format

DEFAULT_SKIP = ("lm_head",)
# patch_model(quantize_lm_head=True): the output projection's format and group size, chosen on
# SmolLM2-135M (docs/formats.md, "Quantized lm_head") for its perplexity and top-1 agreement per byte.
LM_HEAD_FORMAT, LM_HEAD_GROUP_SIZE = "u4", 32
METHODS = ("rtn", "gptq")


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
    operation: str = "patch_model"  # or "entropy_code": a report of entropy_code alone
    # (layer, in_features) of the skipped layers the format cannot take at this group size
    unsupported: List[Tuple[str, int]] = field(default_factory=list)
    already_entropy_coded: int = 0  # entropy_code: RansLinear layers the model held before the call

    def __str__(self) -> str:
        how = "" if self.method == "rtn" else f" method={self.method}"
        if self.operation == "entropy_code":
            found = len(self.entropy_coded) + len(self.not_entropy_coded)
            group = f"group_size={self.group_size}" if self.group_size else "mixed group sizes"
            lines = [f"entropy_code: {found} MarlinLinear layers ({self.format}, {group})" if found else
                     "entropy_code: no MarlinLinear layer left to code"]
            if self.already_entropy_coded:
                lines[0] += f"; {self.already_entropy_coded} layers were entropy-coded already"
        else:
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

    def unsupported_warning(self) -> Optional[str]:
        """One line when layers stay in float because the group size does not fit their width
        (None when none did), with the largest smaller group size that fits them all."""
        if not self.unsupported:
            return None
        fmt = layer_format(self.format)
        widths = {k for _, k in self.unsupported}
        fits = next((g for g in (128, 64, 32, 16, 8) if g < self.group_size
                     and all(fmt.unsupported(k, g) is None for k in widths)), None)
        names = ", ".join(n for n, _ in self.unsupported[:3]) + (", ..." if len(self.unsupported) > 3 else "")
        return (f"{len(self.unsupported)} of {len(self.unsupported) + len(self.replaced)} Linear layers stay in "
                f"float: group_size={self.group_size} does not fit their in_features ({names}); "
                + (f"group_size={fits} quantizes them" if fits else "no smaller group size fits them all"))


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


def module_bytes(mod: nn.Module) -> int:
    """Bytes of ``mod``'s own parameters and buffers (not its children's): a layer's size in a report."""
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
    fmt = layer_format(format)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    skip = [skip] if isinstance(skip, str) else skip
    fmt.check_group_size(group_size)
    if dtype is not None:
        check_float_dtype(dtype)
    batches = _check_method(method, calibration, damp)
    if entropy_coding and format not in ENTROPY_CODED_FORMATS:
        raise ValueError(f"entropy_coding applies to the formats {ENTROPY_CODED_FORMATS}, got format={format!r}")
    bad = sorted(set(format_options) - set(fmt.options))
    if bad:
        raise TypeError(f"format={format!r} takes options {list(fmt.options)}, got unexpected {bad}")
    head = _output_projection(model) if quantize_lm_head else None
    if quantize_lm_head and head is None:
        raise ValueError("quantize_lm_head=True: the model has no output projection (an nn.Linear from "
                         "get_output_embeddings() or named lm_head)")
    dev = resolve_device(device)
    if dev is not None:
        model.to(dev)

    report = PatchReport(format=format, group_size=group_size, method=method)
    todo = _layers_to_quantize(model, fmt, group_size, skip, strict, report, head)
    if any(lin is head for _, lin in todo):
        _untie(model, head)
    quantize = _LayerQuantizer(fmt, group_size, dtype, format_options, report,
                               _fuse_leaders([name for name, _ in todo]) if fuse else {}, len(todo) if progress else 0,
                               head)
    with torch.no_grad():
        if method == "rtn":
            for name, lin in todo:
                _set_submodule(model, name, quantize(name, lin))
        else:
            _quantize_calibrated(model, todo, batches, quantize, act_order, damp)
    quantize.close()
    if entropy_coding:
        _entropy_code(model, quantize.done, report, progress)
    if fuse:
        report.fused, report.unfused = fuse_projections(model)
    return report


def _check_method(method: str, calibration, damp) -> Optional[list]:
    """The calibration batches of ``method="gptq"`` (None for rtn), the arguments checked."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "rtn" and calibration is not None:
        raise ValueError("calibration is only used by method='gptq'; pass method='gptq' or drop calibration")
    batches = calibration_mod.as_batches(calibration) if method == "gptq" else None
    if not isinstance(damp, (int, float)) or damp < 0:
        raise ValueError(f"damp must be a number >= 0, got {damp!r}")
    return batches


def _layers_to_quantize(model: nn.Module, fmt: LayerFormat, group_size: int, skip: Sequence[str], strict: bool,
                        report: "PatchReport", head: Optional[nn.Linear] = None) -> List[Tuple[str, nn.Linear]]:
    """``(name, layer)`` of every ``nn.Linear`` to quantize; the others go to ``report.skipped``.
    ``head``: the output projection to quantize in the lm_head format, tied or named in ``skip``."""
    # Weights shared with other modules (tied embeddings): count users of every parameter.
    users: Dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    todo = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:  # subclasses (e.g. already-quantized wrappers) are left alone
            continue
        pattern = _matches(name, skip)
        reason = (layer_format(LM_HEAD_FORMAT).unsupported(mod.in_features, LM_HEAD_GROUP_SIZE) if mod is head
                  else fmt.unsupported(mod.in_features, group_size))
        if pattern is not None and mod is not head:
            report.skipped.append((name, f"matches skip pattern {pattern!r}"))
        elif users.get(id(mod.weight), 0) > 1 and mod is not head:
            report.skipped.append((name, "weight is shared with another module (tied)"))
        elif reason is not None:
            if strict:
                raise ValueError(f"{name}: {reason}; pass skip=[...] or another group_size")
            report.skipped.append((name, reason))
            report.unsupported.append((name, mod.in_features))
        else:
            todo.append((name, mod))
    return todo


def _output_projection(model: nn.Module) -> Optional[nn.Linear]:
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else getattr(model, "lm_head", None)
    return out if type(out) is nn.Linear else None


def _untie(model: nn.Module, head: nn.Linear) -> None:
    """Gives ``head`` its own copy of a weight it shares (tied input embeddings): GPTQ rewrites the
    weight it quantizes in place, and the embeddings keep theirs; the config says the two are apart."""
    if not any(p is head.weight for m in model.modules() if m is not head for p in m.parameters(recurse=False)):
        return
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    for cfg in {id(c): c for c in (config, text) if c is not None}.values():
        if hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False


class _LayerQuantizer:
    """Quantizes one layer at a time into ``fmt``, recording it in the report and the progress bar.
    A member of a fusion group gets the options its group's first member shares (``leaders``:
    member name -> first member's name). ``progress_total``: layers the progress bar counts (0: no bar).
    ``head``: the output projection, quantized in LM_HEAD_FORMAT with LM_HEAD_GROUP_SIZE."""

    def __init__(self, fmt: LayerFormat, group_size: int, dtype: Optional[torch.dtype], options: dict,
                 report: "PatchReport", leaders: Dict[str, str], progress_total: int,
                 head: Optional[nn.Linear] = None):
        self.fmt, self.group_size, self.dtype, self.options = fmt, group_size, dtype, options
        self.report, self.leaders, self.head = report, leaders, head
        self.done: Dict[str, nn.Module] = {}
        self.bar = None
        if progress_total:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=progress_total, unit="layer",
                            desc=f"quantizing to {fmt.name} g{group_size} ({report.method})")

    def leader_first(self, name: str) -> bool:
        return self.leaders.get(name, name) == name

    def __call__(self, name: str, lin: nn.Linear, **calibrated) -> nn.Module:
        leader = self.done.get(self.leaders.get(name, name))
        shared = self.fmt.shared_options(leader) if leader is not None else {}
        dtype = self.dtype if self.dtype is not None else lin.weight.dtype
        if lin is self.head:
            new = layer_format(LM_HEAD_FORMAT).quantize(lin, LM_HEAD_GROUP_SIZE, dtype, progress=False, **calibrated)
        else:  # patch_model's own bar counts the layers: none per layer
            new = self.fmt.quantize(lin, self.group_size, dtype, progress=False, **self.options, **shared,
                                    **calibrated)
        new.train(lin.training)
        self.done[name] = new
        self.report.float_bytes += module_bytes(lin)
        self.report.quantized_bytes += module_bytes(new)
        self.report.replaced.append((name, lin.in_features, lin.out_features))
        if self.bar is not None:
            self.bar.update(1)
        return new

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _quantize_calibrated(model: nn.Module, todo: List[Tuple[str, nn.Linear]], batches: list,
                         quantize: _LayerQuantizer, act_order: bool, damp: float) -> None:
    """GPTQ: each layer quantized with the Hessian of its inputs, in call order (torch_marlin/calibration.py)."""
    was_training = model.training
    model.eval()  # no dropout while measuring the inputs
    done = []
    try:
        layers = dict(todo)
        for names, H in calibration_mod.calibrated_layers(model, layers, batches):
            for name in sorted(names, key=lambda n: not quantize.leader_first(n)):  # group leaders first
                lin = layers[name]
                if H is None:
                    quantize.report.uncalibrated.append(name)
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


def entropy_code(model: nn.Module, progress: bool = True, report: Optional[PatchReport] = None) -> PatchReport:
    """Replaces every ``MarlinLinear`` of ``model`` that the coding supports by its rANS-coded copy
    (:class:`torch_marlin.RansLinear`), in place, e.g. after :func:`torch_marlin.from_pretrained`;
    returns ``report`` (a new one when None) with ``entropy_coded`` / ``not_entropy_coded`` filled.
    A model with neither ``MarlinLinear`` nor ``RansLinear`` layers (a float model) raises ``ValueError``."""
    layers = {name: mod for name, mod in model.named_modules() if type(mod) is MarlinLinear}
    if report is None:
        coded = sum(isinstance(mod, RansLinear) for mod in model.modules())
        if not layers and not coded:
            raise ValueError("entropy_code: the model has no MarlinLinear layer to code (a float model?); quantize "
                             "it first with torch_marlin.patch_model(model, format=...), or load a quantized "
                             "checkpoint with torch_marlin.from_pretrained or load_quantized")
        group_sizes = {mod.group_size for mod in layers.values()}
        report = PatchReport(format=", ".join(sorted({mod.format for mod in layers.values()})),
                             group_size=group_sizes.pop() if len(group_sizes) == 1 else 0,
                             operation="entropy_code", already_entropy_coded=coded)
    _entropy_code(model, layers, report, progress)
    return report


def _entropy_code(model: nn.Module, quantized: Dict[str, nn.Module], report: PatchReport, progress: bool) -> None:
    bar = None
    if progress and quantized:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(quantized), desc="entropy coding", unit="layer")
    for name, mod in quantized.items():
        why = ENTROPY_CODED.unsupported(mod.in_features, mod.group_size)
        if why is not None:
            report.not_entropy_coded.append((name, why))
        else:
            coded = RansLinear.from_marlin(mod)
            report.quantized_bytes += module_bytes(coded) - module_bytes(mod)
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
