"""``MarlinLinear``: a drop-in ``nn.Linear`` with FP4 E2M1, INT4 (zero-point) or affine INT4 weights."""

from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from .. import ops
from ..dtypes import check_float_dtype
from ..metal_fallback import run as _run
from ..formats import int4_packing
from ..formats.gptq_solver import progress_default
from ..formats.affine import dequant_affine_reference, quantize_affine
from ..formats.fp4 import dequant_fp4_reference, quantize_fp4
from ..formats.u4 import dequant_u4_reference, quantize_u4

FORMATS = ("fp4", "u4", "affine")
_GEMM_FP4 = torch.ops.marlin.gemm_fp4.default
_GEMM_U4 = torch.ops.marlin.gemm_u4.default
_GEMM_AFFINE = torch.ops.marlin.gemm_affine.default


def _flatten(x: torch.Tensor, in_features: int, name: str) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"{name}: input must have last dimension in_features={in_features}, got shape {tuple(x.shape)}")
    return x.reshape(-1, in_features)


def validate_loaded(module: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook of the quantized modules: checks what was loaded. A module-level
    function, not a lambda, so that a patched model pickles (torch.save(model))."""
    module.validate()


class MarlinLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` stored as 4-bit codes, per-group scales (and zero points or
    offsets).

    Buffers (all persistent, so ``state_dict`` round-trips): ``B_packed`` int32 ``[K/8, N]``,
    ``scales`` ``[K/group_size, N]``, ``zeros`` uint8 ``[K/group_size, N]`` (``u4`` only),
    ``offsets`` ``[K/group_size, N]`` in the scales' dtype (``affine`` only, ``w = scale * q +
    offset``) and ``bias`` ``[N]``; with ``act_order=True`` also ``input_perm`` int64 ``[K]``.
    ``K = in_features``, ``N = out_features``. Any leading batch dimensions;
    fp16, bf16 or fp32 inputs (scales and bias follow the input dtype). The op picks the decode
    kernel for small M (<= 16 rows on Metal, 8 on CPU, 16 to 128 on CUDA by GPU, shape and group
    size) and the prefill kernel above (see :func:`torch_marlin.plan_gemm`). The weights are frozen:
    the backward pass gives the input (and a bias set to require grad) their gradients, so adapters
    train on top of the layer; quantized tensors that require grad raise.

    ``act_order=True`` (checkpoints whose groups are not consecutive rows of K, e.g. GPTQ with
    ``desc_act``): the stored rows of K are the original ones in the order ``input_perm``, chosen so
    every group is consecutive; ``forward`` gathers ``x[..., input_perm]`` before the GEMM. That
    gather moves ``M*K`` values against the GEMM's ``M*K*N`` multiply-adds, and unlike permuting
    the producing layer's outputs it stays correct across residual adds and norms.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, format: str = "fp4",
                 group_size: int = 128, dtype: torch.dtype = torch.float16, device=None, act_order: bool = False):
        super().__init__()
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        int4_packing.check_group_size(group_size, in_features)
        check_float_dtype(dtype)
        if out_features <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.format, self.group_size = format, group_size
        K, N, G = in_features, out_features, in_features // group_size
        self.register_buffer("B_packed", torch.zeros(K // 8, N, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(G, N, dtype=dtype, device=device))
        if format == "u4":
            self.register_buffer("zeros", torch.full((G, N), 8, dtype=torch.uint8, device=device))
        else:
            self.zeros = None
        if format == "affine":
            self.register_buffer("offsets", torch.zeros(G, N, dtype=dtype, device=device))
        else:
            self.offsets = None
        if bias:
            self.register_buffer("bias", torch.zeros(N, dtype=dtype, device=device))
        else:
            self.bias = None
        if act_order:
            self.register_buffer("input_perm", torch.arange(K, dtype=torch.int64, device=device))
        else:
            self.input_perm = None
        self.register_load_state_dict_post_hook(validate_loaded)

    def validate(self) -> None:
        """Zero points must be 0..15: the kernels read a byte's low 4 bits (docs/formats.md), so a
        larger value would run as a different zero point than the one stored."""
        if self.zeros is not None and self.zeros.numel() and int(self.zeros.max()) > 15:
            raise ValueError(f"MarlinLinear: zeros must be in 0..15 (4-bit zero points), got a maximum of "
                             f"{int(self.zeros.max())}")
        perm = self.input_perm
        if perm is not None and perm.device.type != "meta" and perm.numel() and not torch.equal(
                torch.sort(perm).values, torch.arange(self.in_features, device=perm.device)):
            raise ValueError(f"MarlinLinear: input_perm must be a permutation of 0..{self.in_features - 1}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str = "fp4", group_size: int = 128,
                    dtype: Optional[torch.dtype] = None, symmetric: bool = False,
                    hessian: Optional[torch.Tensor] = None, act_order: bool = True,
                    damp: float = 0.01, progress: Optional[bool] = None) -> "MarlinLinear":
        """Quantizes ``linear``. ``dtype`` of scales/bias defaults to the layer's dtype when it is a
        16-bit float, else float16. ``symmetric`` applies to u4.

        Without ``hessian``: round to nearest with least-squares scale (and zero point or offset)
        search per group (affine: from the group's min / max, torch_marlin/formats/affine.py).
        With ``hessian`` ``[in_features, in_features]`` (the second moment ``X^T X`` of the
        layer's inputs, see :func:`torch_marlin.calibration.collect_hessian`): GPTQ error feedback,
        ``act_order`` and ``damp`` as in torch_marlin/formats/gptq_solver.py. ``progress``: a tqdm
        bar while the layer quantizes (seconds per 10^7 weights on a few CPU cores); ``None``: one
        for layers of at least 2^24 weights (torch_marlin/formats/gptq_solver.py PROGRESS_MIN_WEIGHTS).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if dtype is None:
            dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float16
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, format=format,
                  group_size=group_size, dtype=dtype, device=w.device)
        wt = w.t().to(torch.float32)  # [K, N]
        gptq = {"progress": progress_default(progress, w.numel())}
        if hessian is not None:
            gptq.update(hessian=hessian, act_order=act_order, damp=damp)
        if format == "fp4":
            B, s = quantize_fp4(wt, group_size, scale_dtype=dtype, **gptq)
        elif format == "affine":
            B, s, b = quantize_affine(wt, group_size, scale_dtype=dtype, **gptq)
            mod.offsets.copy_(b)
        else:
            B, s, z = quantize_u4(wt, group_size, symmetric=symmetric, scale_dtype=dtype, **gptq)
            mod.zeros.copy_(z)
        mod.B_packed.copy_(B)
        mod.scales.copy_(s)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(dtype))
        return mod

    # ---- the checkpoint entry and fusion (torch_marlin/registry.py) ----------------------------

    def checkpoint_entry(self) -> dict:
        """The layer's JSON-able description in a checkpoint (``torch_marlin.json``)."""
        return {"type": "MarlinLinear", "format": self.format, "group_size": self.group_size,
                "in_features": self.in_features, "out_features": self.out_features,
                "bias": self.bias is not None, "dtype": str(self.scales.dtype).replace("torch.", ""),
                "act_order": self.input_perm is not None}

    @classmethod
    def from_checkpoint_entry(cls, entry: dict, device) -> "MarlinLinear":
        """An empty layer of the shape :meth:`checkpoint_entry` describes, for its tensors to load into."""
        return cls(entry["in_features"], entry["out_features"], bias=entry["bias"], format=entry["format"],
                   group_size=entry["group_size"], dtype=getattr(torch, entry["dtype"]), device=device,
                   act_order=entry.get("act_order", False))

    @classmethod
    def concat(cls, layers: Sequence["MarlinLinear"]) -> Tuple[Optional["MarlinLinear"], Optional[str]]:
        """``(one layer computing the members' outputs side by side, None)``, or ``(None, reason)``.
        Groups run along K within a column, so the members' buffers concatenate along
        ``out_features``; act-order members fuse when they gather their inputs in one order (GPTQ
        orders rows by the input Hessian, which siblings reading one input share)."""
        entries = [m.checkpoint_entry() for m in layers]
        rest = [{k: v for k, v in e.items() if k != "out_features"} for e in entries]
        if any(r != rest[0] for r in rest[1:]):
            diff = sorted(k for k in rest[0] if any(r.get(k) != rest[0][k] for r in rest[1:]))
            return None, f"members differ in {diff}"
        devices = {b.device for m in layers for b in m.buffers()}
        if len(devices) != 1:
            return None, f"members are on different devices {sorted(map(str, devices))}"
        perm = layers[0].input_perm
        if perm is not None and any(not torch.equal(m.input_perm, perm) for m in layers[1:]):
            return None, "members gather their inputs in different orders (act-order input_perm)"
        fused = cls.from_checkpoint_entry(dict(entries[0], out_features=sum(e["out_features"] for e in entries)),
                                          devices.pop())
        with torch.no_grad():
            for name, buffer in fused.named_buffers(recurse=False):
                if name == "input_perm":
                    buffer.copy_(perm)
                else:
                    buffer.copy_(torch.cat([getattr(m, name) for m in layers], dim=-1))
        fused.validate()
        return fused, None

    def dequantized_weight(self) -> torch.Tensor:
        """The dense fp32 weight ``[out_features, in_features]`` in the original input order (for
        tests and debugging)."""
        if self.format == "fp4":
            w = dequant_fp4_reference(self.B_packed, self.scales, self.group_size)
        elif self.format == "affine":
            w = dequant_affine_reference(self.B_packed, self.scales, self.offsets, self.group_size)
        else:
            w = dequant_u4_reference(self.B_packed, self.scales, self.zeros, self.group_size)
        if self.input_perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.input_perm, w)
        return w.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Per-call host work is what a decode step pays per layer: buffers are read from _buffers
        # directly (not through nn.Module.__getattr__), the op overload is called without the
        # packet's resolution, and 2-D inputs skip the reshapes.
        x2 = x if x.dim() == 2 and x.shape[1] == self.in_features else _flatten(x, self.in_features, "MarlinLinear")
        buffers = self._buffers
        perm = buffers.get("input_perm")
        if perm is not None:
            x2 = x2.index_select(1, perm)
        scales = buffers["scales"]
        if scales.dtype != x.dtype:
            scales = scales.to(x.dtype)
        bias = buffers.get("bias")
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if self.format == "fp4":
            y = _run(_GEMM_FP4, x2, buffers["B_packed"], scales, self.group_size, bias)
        elif self.format == "affine":
            offsets = buffers["offsets"]
            if offsets.dtype != x.dtype:
                offsets = offsets.to(x.dtype)
            y = _run(_GEMM_AFFINE, x2, buffers["B_packed"], scales, offsets, self.group_size, bias)
        else:
            y = _run(_GEMM_U4, x2, buffers["B_packed"], scales, buffers["zeros"], self.group_size, bias)
        if x2 is not x:
            y = y.reshape(*x.shape[:-1], self.out_features)
        if torch.is_grad_enabled():  # gradient bookkeeping only where a backward pass can follow
            y = ops.frozen_weight_linear(y, x, buffers.get("bias"), self._dense_weight, "MarlinLinear",
                                         self._quantized_tensors())
        return y

    def _quantized_tensors(self) -> dict:
        return {"B_packed": self.B_packed, "scales": self.scales, "zeros": self.zeros,
                "offsets": self.offsets}

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``W`` ``[out_features, in_features]`` rebuilt by the dequant op on the layer's device,
        from the scales in ``dtype`` as the forward pass uses them."""
        scales = self.scales.to(dtype)
        if self.format == "fp4":
            w = ops.dequant_fp4(self.B_packed, scales, self.group_size)
        elif self.format == "affine":
            w = ops.dequant_affine(self.B_packed, scales, self.offsets.to(dtype), self.group_size)
        else:
            w = ops.dequant_u4(self.B_packed, scales, self.zeros, self.group_size)
        if self.input_perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.input_perm, w)
        return w.t()

    def extra_repr(self) -> str:
        # Per group and column: the scale, and the offset (affine; u4's zero point is 4 bits of a byte).
        group_bits = 8 * self.scales.element_size() * (2 if self.format == "affine" else 1)
        bits = 4 * self.in_features * self.out_features + group_bits * (self.in_features // self.group_size) * self.out_features
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format}, group_size={self.group_size}, "
                f"{'act_order=True, ' if self.input_perm is not None else ''}scales_dtype={self.scales.dtype}, "
                f"bits_per_weight={bits / (self.in_features * self.out_features):.3f}")
