"""``TrellisLinear`` and ``TrellisMoE``: modules over the trellis codebook ops.

Both keep the quantized tensors as persistent buffers (``state_dict`` round-trips) and validate
them on construction from float weights and on ``load_state_dict``. The kernel choice (decode for
M <= 16 rows, prefill above) is made by the op's planner (see :func:`torch_marlin.planner.plan_trellis`).

Rotation (``rotate=True``, the default): the stored matrix is the quantization of a randomized
Hadamard transform of the weight, and the module applies the matching transforms to the
activations, so the layer computes the original linear map (docs/formats.md, "Trellis").

Index layout: ``TrellisLinear`` holds ``packed_indices`` either as the canonical tiles or, on CUDA,
in the lane layout its decode kernel reads fastest (docs/trellis.md, "CUDA lane layout"). The layout
is set where the layer gets its indices: ``from_linear``, ``load_state_dict`` and fusion put them in
the layout :func:`torch_marlin.planner.trellis_index_layout` picks for the layer's device. It does
not change in ``forward`` or on ``.to()``: after moving a layer to another device,
:meth:`TrellisLinear.use_device_layout` converts it (``load_quantized`` and the transformers
integration do so after placing a model). ``state_dict`` always holds the canonical tiles.
"""

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, planner
from ..dtypes import check_float_dtype
from ..formats import trellis as fmt
from ..formats.gptq_solver import progress_default
from .marlin import validate_loaded

_PARTS = ("packed_indices", "scales", "grid", "su", "sv")


def _device_index_layout(K: int, N: int, bits: int, device: torch.device) -> Optional[str]:
    """The planner's index layout for a layer on ``device``; None on a device without a torch_marlin
    backend (the meta device while loading), which keeps the layout it has."""
    try:
        planner.backend_of(device)
    except ValueError:
        return None
    return planner.trellis_index_layout(K, N, bits, device)


def _as_weight(w, name: str) -> torch.Tensor:
    """nn.Linear or a ``[out, in]`` tensor -> the detached fp32 ``[out, in]`` weight."""
    if isinstance(w, nn.Linear):
        w = w.weight
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError(f"{name} must be nn.Linear or a 2-D [out_features, in_features] tensor")
    return w.detach().to(torch.float32)


def prepare_loaded(module: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook of TrellisLinear: checks what was loaded and moves the indices to the
    device's layout (a module-level function, so that a patched model pickles)."""
    module._validate_and_use_device_layout()


class TrellisLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` stored in the trellis format (2/3/4-bit codebook indices).

    Buffers: ``packed_indices`` uint8 ``[ceil(K/16), ceil(N/16), 32*bits]``, ``scales`` f32
    ``[ceil(K/group_size), N]``, ``grid`` f32 ``[2**bits]``, ``su`` f32 ``[K]``, ``sv`` f32 ``[N]``
    and ``bias`` ``[N]``; ``K = in_features``, ``N = out_features``.

    ``dtype`` is the bias dtype (the other buffers are always fp32). The constructor's default,
    float32, holds any layer's bias exactly, so ``load_state_dict`` of any ``from_linear`` result
    into ``TrellisLinear(...)`` reproduces its outputs; ``from_linear`` keeps the layer's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bits: int = 3, group_size: int = 128,
                 bias: bool = True, rotate: bool = True, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        fmt.check_bits(bits)
        fmt.check_group_size(group_size)
        check_float_dtype(dtype)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"in_features and out_features must be positive, got {in_features}, {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.rotate = bits, group_size, rotate
        K, N = in_features, out_features
        self.register_buffer("packed_indices", torch.zeros((K + 15) // 16, (N + 15) // 16,
                                                           fmt.packed_bytes_per_tile(bits), dtype=torch.uint8,
                                                           device=device))
        self.register_buffer("scales", torch.ones(fmt.num_groups(K, group_size), N, device=device))
        self.register_buffer("grid", torch.linspace(-1, 1, 1 << bits, device=device))
        self.register_buffer("su", torch.ones(K, device=device))
        self.register_buffer("sv", torch.ones(N, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(N, dtype=dtype, device=device))
        else:
            self.bias = None
        self._lanes_shape = fmt.lanes_shape(K, N, bits)
        self.register_load_state_dict_post_hook(prepare_loaded)

    @property
    def index_layout(self) -> str:
        """``"lanes"`` when ``packed_indices`` holds the CUDA lane layout, else ``"tiles"`` (canonical)."""
        return "lanes" if tuple(self.packed_indices.shape) == self._lanes_shape else "tiles"

    def canonical_indices(self) -> torch.Tensor:
        """``packed_indices`` in the canonical tiles layout (converted when the buffer holds lanes)."""
        if self.index_layout == "lanes":
            return fmt.lanes_to_tiles(self.packed_indices, self.in_features, self.out_features, self.bits)
        return self.packed_indices

    def _set_index_layout(self, layout: str) -> None:
        """Replaces ``packed_indices`` by its ``layout`` (``"tiles"`` or ``"lanes"``) form, same device."""
        if layout not in ("tiles", "lanes"):
            raise ValueError(f"layout must be 'tiles' or 'lanes', got {layout!r}")
        if layout == self.index_layout:
            return
        convert = fmt.tiles_to_lanes if layout == "lanes" else fmt.lanes_to_tiles
        self.packed_indices = convert(self.packed_indices, self.in_features, self.out_features, self.bits)

    def use_device_layout(self) -> None:
        """Puts ``packed_indices`` in the layout the op reads fastest on the layer's device (the lane
        layout on CUDA where the planner picks it, else the canonical tiles)."""
        wanted = _device_index_layout(self.in_features, self.out_features, self.bits, self.packed_indices.device)
        if wanted is not None:
            self._set_index_layout(wanted)

    def _validate_and_use_device_layout(self) -> None:
        self.validate()
        self.use_device_layout()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "packed_indices"
        if key in destination and self.index_layout == "lanes":
            destination[key] = self.canonical_indices()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # State dicts hold canonical tiles: load into tiles; the post hook validates, then sets the layout.
        self._set_index_layout("tiles")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def validate(self) -> None:
        fmt.validate_trellis(self.canonical_indices(), self.scales, self.grid, self.su, self.sv, self.in_features,
                             self.out_features, self.bits, self.group_size, name="TrellisLinear")

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 3, group_size: int = 128, rotate: bool = True,
                    dtype: Optional[torch.dtype] = None, seed: int = 0, hessian: Optional[torch.Tensor] = None,
                    act_order: bool = True, damp: float = 0.01,
                    grid: Optional[torch.Tensor] = None, progress: Optional[bool] = None) -> "TrellisLinear":
        """Quantizes ``linear`` (:func:`torch_marlin.formats.trellis.quantize_trellis`). With
        ``hessian`` ``[in_features, in_features]`` (the second moment ``X^T X`` of the layer's
        inputs) the indices and scales come from LDLQ error feedback under the rotated Hessian.
        ``grid``: a ``[2**bits]`` codebook to quantize with instead of fitting one (layers with one
        codebook can run as one fused layer, torch_marlin/fusion.py). ``progress`` as for
        :meth:`torch_marlin.MarlinLinear.from_linear`."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if dtype is None:
            dtype = w.dtype if w.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16
        mod = cls(linear.in_features, linear.out_features, bits, group_size, linear.bias is not None, rotate, dtype,
                  w.device)
        gptq = {} if hessian is None else {"hessian": hessian, "act_order": act_order, "damp": damp}
        q = fmt.quantize_trellis(w.t().to(torch.float32), bits, group_size, rotate=rotate, seed=seed,
                                 grid=None if grid is None else grid.to(device=w.device, dtype=torch.float32),
                                 progress=progress_default(progress, w.numel()), **gptq)
        for p in _PARTS:
            getattr(mod, p).copy_(q[p])
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().to(dtype))
        mod.validate()
        mod.use_device_layout()
        return mod

    # ---- the checkpoint entry and fusion (torch_marlin/registry.py) ----------------------------

    def checkpoint_entry(self) -> dict:
        """The layer's JSON-able description in a checkpoint (``torch_marlin.json``)."""
        # Only the bias follows the module dtype; the trellis scales/grid/signs are always fp32.
        dtype = self.bias.dtype if self.bias is not None else torch.float32
        return {"type": "TrellisLinear", "format": "trellis", "bits": self.bits, "group_size": self.group_size,
                "rotate": bool(self.rotate), "in_features": self.in_features, "out_features": self.out_features,
                "bias": self.bias is not None, "dtype": str(dtype).replace("torch.", "")}

    @classmethod
    def from_checkpoint_entry(cls, entry: dict, device) -> "TrellisLinear":
        """An empty layer of the shape :meth:`checkpoint_entry` describes, for its tensors to load into."""
        return cls(entry["in_features"], entry["out_features"], bits=entry["bits"], group_size=entry["group_size"],
                   bias=entry["bias"], rotate=entry["rotate"], dtype=getattr(torch, entry["dtype"]), device=device)

    @classmethod
    def concat(cls, layers: Sequence["TrellisLinear"]) -> Tuple[Optional["TrellisLinear"], Optional[str]]:
        """``(one layer computing the members' outputs side by side, None)``, or ``(None, reason)``.

        Trellis layers share one codebook (``grid``) and input signs (``su``): members fuse when
        those agree (patch_model(fuse=True) quantizes a group with its first member's codebook, and
        one seed gives one ``su`` per K), every N is a whole number of 16-column tiles (indices are
        packed per 16 x 16 tile) and, when rotated, the fused N has each member's Hadamard block along
        N, so the output rotation acts on each member's columns alone."""
        first = layers[0]
        total = sum(m.out_features for m in layers)
        entry = dict(first.checkpoint_entry(), out_features=total)
        if any(dict(m.checkpoint_entry(), out_features=total) != entry for m in layers):
            return None, "members differ in bits, group size, rotation, bias or dtype"
        if len({m.grid.device for m in layers}) != 1:
            return None, "members are on different devices"
        for m in layers[1:]:
            if not (torch.equal(m.grid, first.grid) and torch.equal(m.su, first.su)):
                return None, "members have different codebooks or input signs (quantize them with fuse=True)"
        if any(m.out_features % fmt.TILE for m in layers):
            return None, "trellis members fuse only with out_features multiples of 16"
        if first.rotate and any(fmt.hadamard_block(m.out_features) != fmt.hadamard_block(total) for m in layers):
            return None, "the members' output rotations have different block sizes"
        fused = cls.from_checkpoint_entry(entry, first.grid.device)
        with torch.no_grad():
            fused.packed_indices.copy_(torch.cat([m.canonical_indices() for m in layers], dim=1))
            fused.scales.copy_(torch.cat([m.scales for m in layers], dim=-1))
            fused.sv.copy_(torch.cat([m.sv for m in layers], dim=-1))
            fused.grid.copy_(first.grid)
            fused.su.copy_(first.su)
            if first.bias is not None:
                fused.bias.copy_(torch.cat([m.bias for m in layers], dim=-1))
        fused.validate()
        fused.use_device_layout()
        return fused, None

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 ``[out_features, in_features]`` weight the layer applies (rotation undone)."""
        q = {p: getattr(self, p) for p in _PARTS}
        q.update(packed_indices=self.canonical_indices(), K=self.in_features, N=self.out_features, bits=self.bits,
                 group_size=self.group_size)
        return fmt.effective_weight(q, self.rotate).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"TrellisLinear: input must have last dimension in_features={self.in_features}, "
                             f"got shape {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)
        if self.rotate:
            # Rotate in fp32 and round once to the activation dtype the kernel reads.
            x2 = fmt.rotate_input(x2.float(), self.su).to(x.dtype)
        y = ops.gemm_trellis(x2, self.packed_indices, self.scales, self.grid, self.su, self.sv, self.in_features,
                             self.out_features, self.bits, self.group_size)
        if self.rotate:
            y = fmt.rotate_output(y.float(), self.sv).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        # The bias was added above, so autograd already gives it its gradient.
        return ops.frozen_weight_linear(y.reshape(*x.shape[:-1], self.out_features), x, None, self._dense_weight,
                                        "TrellisLinear", {p: getattr(self, p) for p in _PARTS})

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 ``[out_features, in_features]`` map the layer applies, rotation included, rebuilt
        by the dequant op on the layer's device (``dtype`` unused: the trellis buffers are fp32)."""
        w = ops.dequant_trellis(*(getattr(self, p) for p in _PARTS), self.in_features, self.out_features, self.bits,
                                self.group_size)
        return (fmt.undo_rotation(w, self.su, self.sv) if self.rotate else w).t()

    def extra_repr(self) -> str:
        bpw = self.bits + 32 / self.group_size
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"bits={self.bits}, group_size={self.group_size}, rotate={self.rotate}, bits_per_weight~{bpw:.2f}")


class TrellisMoE(nn.Module):
    """Mixture of SwiGLU experts with trellis weights: router logits -> softmax -> top_k ->
    ``moe_trellis`` (token routing, fused ``silu(gate) * up``, down, probability-weighted sum).

    Per-expert buffers ``{gate,up,down}_{packed_indices,scales,grid,su,sv}`` with a leading expert
    dim; gate/up are ``W[hidden, intermediate]``, down ``W[intermediate, hidden]``. The router is a
    float ``nn.Linear(hidden, num_experts, bias=False)``. With ``rotate``, the input side of
    gate/up and the output side of down are Hadamard-rotated with the shared sign vectors
    ``rot_in`` / ``rot_out`` (both ``[hidden]``), applied once per call outside the kernel; the
    intermediate side is not rotated because SwiGLU is elementwise in the original basis.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 2, bits: int = 3,
                 group_size: int = 128, rotate: bool = True, norm_topk_prob: bool = True,
                 dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        fmt.check_bits(bits)
        fmt.check_group_size(group_size)
        check_float_dtype(dtype)
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..num_experts={num_experts}, got {top_k}")
        H, I, E = hidden_size, intermediate_size, num_experts
        self.hidden_size, self.intermediate_size, self.num_experts = H, I, E
        self.top_k, self.bits, self.group_size = top_k, bits, group_size
        self.rotate, self.norm_topk_prob = rotate, norm_topk_prob
        self.router = nn.Linear(H, E, bias=False, device=device, dtype=dtype)
        for proj, (K, N) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H))):
            self.register_buffer(f"{proj}_packed_indices", torch.zeros(
                E, (K + 15) // 16, (N + 15) // 16, fmt.packed_bytes_per_tile(bits), dtype=torch.uint8, device=device))
            self.register_buffer(f"{proj}_scales", torch.ones(E, fmt.num_groups(K, group_size), N, device=device))
            self.register_buffer(f"{proj}_grid", torch.linspace(-1, 1, 1 << bits, device=device).repeat(E, 1))
            self.register_buffer(f"{proj}_su", torch.ones(E, K, device=device))
            self.register_buffer(f"{proj}_sv", torch.ones(E, N, device=device))
        self.register_buffer("rot_in", torch.ones(H, device=device))
        self.register_buffer("rot_out", torch.ones(H, device=device))
        self.register_load_state_dict_post_hook(validate_loaded)

    def _proj(self, proj: str):
        return tuple(getattr(self, f"{proj}_{p}") for p in _PARTS)

    def _shape(self, proj: str):
        return (self.hidden_size, self.intermediate_size) if proj != "down" else (self.intermediate_size,
                                                                                  self.hidden_size)

    def validate(self) -> None:
        for proj in ("gate", "up", "down"):
            K, N = self._shape(proj)
            t = self._proj(proj)
            for e in range(self.num_experts):
                fmt.validate_trellis(*(x[e] for x in t), K, N, self.bits, self.group_size,
                                     name=f"TrellisMoE {proj} expert {e}")
        for name in ("rot_in", "rot_out"):
            v = getattr(self, name)
            if tuple(v.shape) != (self.hidden_size,) or not bool(torch.isfinite(v).all()):
                raise ValueError(f"TrellisMoE: {name} must be a finite [{self.hidden_size}] vector")

    @classmethod
    def from_experts(cls, gate: Sequence, up: Sequence, down: Sequence, router, top_k: int = 2, bits: int = 3,
                     group_size: int = 128, rotate: bool = True, norm_topk_prob: bool = True,
                     dtype: torch.dtype = torch.float16, seed: int = 0) -> "TrellisMoE":
        """Quantizes float experts. ``gate``/``up``: per expert an ``nn.Linear(hidden, intermediate)``
        or its ``[intermediate, hidden]`` weight; ``down``: ``nn.Linear(intermediate, hidden)`` or
        ``[hidden, intermediate]``; ``router``: ``nn.Linear(hidden, E)`` or ``[E, hidden]``."""
        E = len(gate)
        if not (len(up) == E and len(down) == E and E > 0):
            raise ValueError(f"gate, up and down must list the same positive number of experts, got "
                             f"{len(gate)}, {len(up)}, {len(down)}")
        g0 = _as_weight(gate[0], "gate[0]")
        I, H = g0.shape
        rw = _as_weight(router, "router")
        if tuple(rw.shape) != (E, H):
            raise ValueError(f"router weight must be [{E}, {H}], got {tuple(rw.shape)}")
        mod = cls(H, I, E, top_k, bits, group_size, rotate, norm_topk_prob, dtype, device=g0.device)
        mod.router.weight.data.copy_(rw.to(dtype))
        gen = torch.Generator().manual_seed(seed)
        if rotate:
            mod.rot_in.copy_(fmt.random_signs(H, gen))
            mod.rot_out.copy_(fmt.random_signs(H, gen))
        for proj, mats, (K, N) in (("gate", gate, (H, I)), ("up", up, (H, I)), ("down", down, (I, H))):
            for e in range(E):
                w = _as_weight(mats[e], f"{proj}[{e}]").t()  # [K, N]
                if tuple(w.shape) != (K, N):
                    raise ValueError(f"{proj}[{e}] must map {K} -> {N} features, got weight {tuple(w.t().shape)}")
                if rotate and proj != "down":
                    w = fmt.block_hadamard(w * mod.rot_in[:, None], 0)  # H D_r W: x D_r H @ (H D_r W) = x W
                elif rotate:
                    w = fmt.block_hadamard(w * mod.rot_out[None, :], 1)  # W D_c H: (h W D_c H) H D_c = h W
                q = fmt.quantize_trellis(w, bits, group_size, rotate=False, seed=seed + e)
                for p in _PARTS:
                    getattr(mod, f"{proj}_{p}")[e].copy_(q[p])
        mod.validate()
        return mod

    def expert_weights(self, proj: str, e: int) -> torch.Tensor:
        """The fp32 ``[K, N]`` matrix expert ``e``'s ``proj`` applies (rotation undone)."""
        K, N = self._shape(proj)
        w = fmt.dequant_trellis_reference(*(x[e] for x in self._proj(proj)), K, N, self.bits, self.group_size)
        if self.rotate and proj != "down":
            w = fmt.block_hadamard(w, 0) * self.rot_in[:, None]
        elif self.rotate:
            w = fmt.block_hadamard(w, 1) * self.rot_out[None, :]
        return w

    def route(self, x2: torch.Tensor):
        """``(expert_ids int64 [T, top_k], expert_probs f32 [T, top_k])`` from the router."""
        logits = self.router(x2).detach().float()  # inference only: the trellis ops have no autograd
        probs = F.softmax(logits, dim=-1)
        p, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            p = p / p.sum(-1, keepdim=True)
        return ids, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"TrellisMoE: input must have last dimension hidden_size={self.hidden_size}, "
                             f"got shape {tuple(x.shape)}")
        x2 = x.reshape(-1, self.hidden_size)
        ids, p = self.route(x2)
        xr = fmt.rotate_input(x2.float(), self.rot_in).to(x.dtype) if self.rotate else x2
        y = ops.moe_trellis(xr, self._proj("gate"), self._proj("up"), self._proj("down"), ids, p,
                            self.intermediate_size, self.bits, self.group_size)
        if self.rotate:
            y = fmt.rotate_output(y.float(), self.rot_out).to(x.dtype)
        return ops.no_input_gradient(y.reshape(x.shape), x, "TrellisMoE")
