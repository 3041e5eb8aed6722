"""``RansLinear``: a ``MarlinLinear`` whose 4-bit codes are stored rANS-coded (lossless)."""

import math
from typing import Optional, Tuple

import torch
from torch import nn

from .. import ops
from ..metal_fallback import run as _run
from ..formats import rans as rans_format
from .marlin import MarlinLinear, _flatten, validate_loaded

_GEMM_RANS = torch.ops.marlin.gemm_rans.default
_CODE_BUFFERS = ("rans_words", "rans_word_offsets", "rans_states", "rans_freqs")
_UNCODED_BUFFERS = ("scales", "zeros", "offsets", "bias", "input_perm")  # MarlinLinear's, minus B_packed


class RansLinear(nn.Module):
    """``y = x @ W^T + b`` with the codes of an FP4, INT4 (u4) or affine layer stored rANS-coded.

    The coding is lossless (docs/formats.md, "rANS-coded 4-bit codes"): the outputs equal the
    ``MarlinLinear``'s up to fp32 summation order and :meth:`to_marlin` gives its buffers back bit
    for bit. Buffers: ``rans_words`` int16 ``[W]``, ``rans_word_offsets`` int32 ``[T + 1]``,
    ``rans_states`` int32 ``[T, 32]``, ``rans_freqs`` int16 ``[T, 16]`` (``T`` tiles of
    ``channels_per_tile`` output channels), and the uncoded layer's ``scales``, ``zeros`` (u4),
    ``offsets`` (affine), ``bias`` and ``input_perm`` (act-order) as they are. The op decodes in
    registers and multiplies for up to 16 rows, and decodes the codes once per call for more
    (see :func:`torch_marlin.plan_rans_gemm`). Loading a state dict checks every stream (a full
    decode on the CPU): a corrupted checkpoint raises instead of computing wrong outputs.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, format: str = "fp4",
                 group_size: int = 128, channels_per_tile: Optional[int] = None, n_words: int = 0,
                 dtype: torch.dtype = torch.float16, device=None, act_order: bool = False):
        super().__init__()
        try:
            rans_format.check_group_size(group_size, in_features)
        except ValueError as e:
            raise ValueError(f"RansLinear: {e}") from None
        # The uncoded layer's buffers and checks, minus the codes.
        template = MarlinLinear(in_features, out_features, bias=bias, format=format, group_size=group_size,
                                dtype=dtype, device="meta", act_order=act_order)
        self.in_features, self.out_features = in_features, out_features
        self.format, self.group_size = format, group_size
        C = rans_format.default_channels_per_tile(in_features) if channels_per_tile is None else int(channels_per_tile)
        if C <= 0:
            raise ValueError(f"RansLinear: channels_per_tile must be positive, got {C}")
        if n_words < 0 or n_words % rans_format.STREAM_ALIGN_WORDS:
            raise ValueError(f"RansLinear: n_words must be a non-negative multiple of "
                             f"{rans_format.STREAM_ALIGN_WORDS}, got {n_words}")
        self.channels_per_tile = C
        T = math.ceil(out_features / C)
        self.register_buffer("rans_words", torch.zeros(n_words, dtype=torch.int16, device=device))
        self.register_buffer("rans_word_offsets", torch.zeros(T + 1, dtype=torch.int32, device=device))
        self.register_buffer("rans_states", torch.full((T, rans_format.LANES), rans_format.STATE_LOW,
                                                       dtype=torch.int32, device=device))
        freqs = torch.zeros(T, rans_format.SYMBOLS, dtype=torch.int16, device=device)
        freqs[:, 0] = rans_format.PROB_SCALE
        self.register_buffer("rans_freqs", freqs)
        for name in _UNCODED_BUFFERS:
            buf = getattr(template, name)
            if buf is None:
                setattr(self, name, None)
            else:
                self.register_buffer(name, torch.empty(buf.shape, dtype=buf.dtype, device=device))
        if self.scales is not None:
            self.scales.fill_(1)
        if self.zeros is not None:
            self.zeros.fill_(8)
        if self.offsets is not None:
            self.offsets.zero_()
        if self.bias is not None:
            self.bias.zero_()
        if self.input_perm is not None:
            self.input_perm.copy_(torch.arange(in_features, device=device))
        self.register_load_state_dict_post_hook(validate_loaded)

    # ---- conversion -------------------------------------------------------------------------

    @classmethod
    def from_marlin(cls, layer: MarlinLinear, channels_per_tile: Optional[int] = None) -> "RansLinear":
        """A lossless rANS-coded copy of ``layer`` on the same device (encoded on the CPU)."""
        if not isinstance(layer, MarlinLinear):
            raise TypeError(f"RansLinear.from_marlin expects a MarlinLinear, got {type(layer).__name__}")
        try:
            rans_format.check_group_size(layer.group_size, layer.in_features)
        except ValueError as e:
            raise ValueError(f"RansLinear.from_marlin: {e}") from None
        C = rans_format.default_channels_per_tile(layer.in_features) if channels_per_tile is None \
            else int(channels_per_tile)
        words, offsets, states, freqs = torch.ops.marlin.rans_encode(layer.B_packed.detach().cpu(), C)
        device = layer.B_packed.device
        mod = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, format=layer.format,
                  group_size=layer.group_size, channels_per_tile=C, n_words=words.numel(),
                  dtype=layer.scales.dtype, device=device, act_order=layer.input_perm is not None)
        with torch.no_grad():
            for name, t in zip(_CODE_BUFFERS, (words, offsets, states, freqs)):
                mod._buffers[name] = t.to(device)
            for name in _UNCODED_BUFFERS:
                if getattr(layer, name) is not None:
                    mod._buffers[name].copy_(getattr(layer, name))
        mod.train(layer.training)
        return mod

    def decoded_codes(self) -> torch.Tensor:
        """``B_packed`` int32 ``[K/8, N]`` decoded by the ``rans_decode`` op on the layer's device."""
        return ops.rans_decode(self.rans_words, self.rans_word_offsets, self.rans_states, self.rans_freqs,
                               self.in_features, self.out_features, self.channels_per_tile)

    def to_marlin(self) -> MarlinLinear:
        """The uncoded layer back, bit for bit."""
        mod = MarlinLinear(self.in_features, self.out_features, bias=self.bias is not None, format=self.format,
                           group_size=self.group_size, dtype=self.scales.dtype, device=self.scales.device,
                           act_order=self.input_perm is not None)
        with torch.no_grad():
            mod.B_packed.copy_(self.decoded_codes())
            for name in _UNCODED_BUFFERS:
                if getattr(mod, name) is not None:
                    getattr(mod, name).copy_(self._buffers[name])
        mod.train(self.training)
        return mod

    # ---- the checkpoint entry and fusion (torch_marlin/registry.py) ----------------------------

    def checkpoint_entry(self) -> dict:
        """The uncoded layer's entry, marked ``"type": "RansLinear"``, with the coding's sizes."""
        return dict(MarlinLinear.checkpoint_entry(self), type="RansLinear", channels_per_tile=self.channels_per_tile,
                    n_words=self.rans_words.numel())

    @classmethod
    def from_checkpoint_entry(cls, entry: dict, device) -> "RansLinear":
        return cls(entry["in_features"], entry["out_features"], bias=entry["bias"], format=entry["format"],
                   group_size=entry["group_size"], channels_per_tile=entry["channels_per_tile"],
                   n_words=entry["n_words"], dtype=getattr(torch, entry["dtype"]), device=device,
                   act_order=entry.get("act_order", False))

    @classmethod
    def concat(cls, layers) -> Tuple[Optional["RansLinear"], Optional[str]]:
        """The members decoded, concatenated as :meth:`MarlinLinear.concat` does, coded again."""
        fused, why = MarlinLinear.concat([m.to_marlin() for m in layers])
        if fused is None:
            return None, why
        return cls.from_marlin(fused), None

    # ---- sizes and checks -------------------------------------------------------------------

    def code_bits_per_weight(self) -> float:
        """Bits stored for the codes (streams with padding, lane states, frequency tables, offsets;
        not scales, zeros, offsets or bias) per weight."""
        bits = rans_format.code_bits(self.rans_words.numel(), self.rans_states.shape[0])
        return bits / (self.in_features * self.out_features)

    def validate(self) -> None:
        """Decodes every stream on the CPU: raises ValueError naming the first corrupted tile."""
        MarlinLinear.validate(self)
        if self.rans_words.device.type != "meta":
            torch.ops.marlin.rans_decode(*(self._buffers[n].cpu() for n in _CODE_BUFFERS), self.in_features,
                                         self.out_features, self.channels_per_tile)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The word count is the checkpoint's, not the constructor's: take the stored stream's size.
        key = prefix + "rans_words"
        if key in state_dict and state_dict[key].shape != self.rans_words.shape:
            self._buffers["rans_words"] = torch.empty_like(state_dict[key], device=self.rans_words.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- compute ----------------------------------------------------------------------------

    def dequantized_weight(self) -> torch.Tensor:
        """The dense fp32 weight ``[out_features, in_features]`` (tests and debugging)."""
        return self.to_marlin().dequantized_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 and x.shape[1] == self.in_features else _flatten(x, self.in_features, "RansLinear")
        buffers = self._buffers
        perm = buffers.get("input_perm")
        if perm is not None:
            x2 = x2.index_select(1, perm)
        cast = {}
        for name in ("scales", "offsets", "bias"):
            t = buffers.get(name)
            cast[name] = t if t is None or t.dtype == x.dtype else t.to(x.dtype)
        y = _run(_GEMM_RANS, x2, buffers["rans_words"], buffers["rans_word_offsets"], buffers["rans_states"],
                       buffers["rans_freqs"], cast["scales"], buffers.get("zeros"), cast["offsets"], self.format,
                       self.in_features, self.out_features, self.group_size, self.channels_per_tile, cast["bias"])
        if x2 is not x:
            y = y.reshape(*x.shape[:-1], self.out_features)
        if torch.is_grad_enabled():
            y = ops.frozen_weight_linear(y, x, buffers.get("bias"), self._dense_weight, "RansLinear",
                                         self._quantized_tensors())
        return y

    def _quantized_tensors(self) -> dict:
        tensors = {name: self._buffers[name] for name in _CODE_BUFFERS}
        tensors.update(scales=self.scales, zeros=self.zeros, offsets=self.offsets)
        return tensors

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.to_marlin()._dense_weight(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format}, group_size={self.group_size}, channels_per_tile={self.channels_per_tile}, "
                f"{'act_order=True, ' if self.input_perm is not None else ''}scales_dtype={self.scales.dtype}, "
                f"code_bits_per_weight={self.code_bits_per_weight():.3f}")

