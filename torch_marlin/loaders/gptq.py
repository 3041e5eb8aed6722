"""Import of GPTQ 4-bit checkpoints (the HF / AutoGPTQ / GPTQModel tensor layout) into MarlinLinear u4.

No requantization: GPTQ's ``qweight`` int32 ``[K/8, N]`` (8 codes along K per word, LSB first) *is*
MarlinLinear's ``B_packed``, and its ``scales`` ``[K/g, N]`` are used as they are. Only the zero
points change container: GPTQ packs them as int32 ``qzeros [K/g, N/8]`` (8 zero points along N per
word, LSB first); MarlinLinear keeps one uint8 per group and column.

Zero-point convention (the one thing to get right). The original GPTQ packers ("checkpoint_format"
``"gptq"``, a.k.a. v1, what almost every checkpoint on the hub uses) store ``zero - 1`` in
``qzeros``; the kernel reading them adds the 1 back: ``w = (q - (qzeros_code + 1)) * scale``. So a
symmetric 4-bit checkpoint has ``qzeros`` nibbles of 7 for a true zero point of 8. GPTQModel's
``"gptq_v2"`` format stores the zero point itself. We read ``checkpoint_format`` (default
``"gptq"``) and compute ``zero = (code + offset) & 15`` with offset 1 for v1 and 0 for v2; the mask
makes a v1 zero point of 0 (stored as 15 after wrapping) come back as 0.

Act-order checkpoints (``desc_act=True``) give each input row ``k`` its group through ``g_idx[k]``,
so a group is not a run of consecutive rows. Every group still holds ``group_size`` rows, so one
stable sort of K by ``g_idx`` makes the groups consecutive: the layer stores its rows in that order
and gathers the activations in the same order (``MarlinLinear(act_order=True)``), which keeps
``w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]`` exactly.
"""

from typing import Dict, Mapping, Optional

import torch
from torch import nn

from ..formats.int4_packing import unpack_int4
from ..modules import MarlinLinear
from .common import build_marlin_linear, group_permutation, unpack_words

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}


def gptq_zeros(qzeros: torch.Tensor, checkpoint_format: str = "gptq") -> torch.Tensor:
    """Unpacks GPTQ ``qzeros`` int32 ``[K/g, N/8]`` to true zero points, uint8 ``[K/g, N]``."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {tuple(CHECKPOINT_FORMATS)}, got {checkpoint_format!r}")
    if qzeros.dim() != 2 or qzeros.dtype != torch.int32:
        raise ValueError(f"qzeros must be a 2-D int32 tensor [K/group_size, N/8], got {qzeros.dtype} "
                         f"{tuple(qzeros.shape)}")
    z = unpack_words(qzeros).to(torch.int32)
    return ((z + CHECKPOINT_FORMATS[checkpoint_format]) & 15).to(torch.uint8)


def marlin_linear_from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                            g_idx: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, *,
                            bits: int = 4, group_size: Optional[int] = None, desc_act: bool = False,
                            checkpoint_format: str = "gptq", name: str = "weight") -> MarlinLinear:
    """Builds a u4 :class:`MarlinLinear` from one GPTQ layer's tensors, bit for bit (no requantizing).

    ``qweight`` int32 ``[K/8, N]``, ``qzeros`` int32 ``[K/g, N/8]``, ``scales`` ``[K/g, N]``
    (fp16/bf16/fp32: becomes the layer's dtype), ``g_idx`` int32 ``[K]`` (the group of each input
    row; optional when it is ``k // g``, required with ``desc_act``), ``bias`` ``[N]``.
    ``group_size`` defaults to ``K / scales.shape[0]`` (GPTQ's ``group_size=-1``, one group over K,
    is ``scales.shape[0] == 1``). Symmetric and asymmetric
    checkpoints load the same way: the zero points come from ``qzeros`` either way.
    ``checkpoint_format``: ``"gptq"`` (stored zero - 1, the common case) or ``"gptq_v2"``.
    """
    if bits != 4:
        raise ValueError(f"{name}: bits must be 4 (MarlinLinear u4), got {bits}")
    if desc_act and g_idx is None:
        raise ValueError(f"{name}: desc_act=True (act-order) needs g_idx, the group of every input row")
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"{name}: qweight must be a 2-D int32 tensor [K/8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    if scales.dim() != 2 or not scales.is_floating_point() or scales.shape[1] != N:
        raise ValueError(f"{name}: scales must be a 2-D float tensor [K/group_size, N={N}], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    G = scales.shape[0]
    if G == 0 or K % G != 0:
        raise ValueError(f"{name}: scales has {G} groups, which does not divide K={K}")
    if group_size is None or group_size == -1:
        group_size = K // G
    if group_size * G != K:
        raise ValueError(f"{name}: group_size={group_size} disagrees with scales: K={K} / {G} groups = {K // G}")
    if N % 8 != 0 or qzeros.dim() != 2 or tuple(qzeros.shape) != (G, N // 8):
        raise ValueError(f"{name}: qzeros must have shape [K/group_size, N/8] = [{G}, {N / 8:g}], got {tuple(qzeros.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"{name}: bias must have shape [N={N}], got {tuple(bias.shape)}")
    perm = None if g_idx is None else group_permutation(g_idx, K, G)

    zeros = gptq_zeros(qzeros, checkpoint_format)
    codes = unpack_int4(qweight)
    if perm is not None:
        codes = codes[perm]
    return build_marlin_linear("u4", codes.t(), scales.t(), zeros=zeros.t(), bias=bias, dtype=scales.dtype,
                               input_perm=perm, device=qweight.device, name=name)


def import_gptq(model: nn.Module, state_dict: Mapping[str, torch.Tensor], quantization_config: Mapping,
                strict: bool = True):
    """Loads a GPTQ checkpoint's ``state_dict`` into a float skeleton ``model``, in place.

    Every ``nn.Linear`` named ``X`` with ``X.qweight`` in ``state_dict`` becomes a u4 MarlinLinear
    built by :func:`marlin_linear_from_gptq`; all other tensors load with ``load_state_dict``.
    ``quantization_config`` is the HF ``quantization_config`` dict (``bits``, ``group_size``,
    ``desc_act``, optional ``checkpoint_format``). ``strict``: every model tensor must be provided
    and no tensor may be left unused. Returns the list of replaced layer names.
    """
    qc = dict(quantization_config)
    method = qc.get("quant_method", "gptq")
    if method != "gptq":
        raise ValueError(f"quantization_config.quant_method must be 'gptq', got {method!r}")
    bits, desc_act = qc.get("bits", 4), bool(qc.get("desc_act", False))
    group_size = qc.get("group_size", None)
    fmt = qc.get("checkpoint_format", "gptq")

    used = set()
    replaced = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or f"{name}.qweight" not in state_dict:
            continue
        t = {k: state_dict.get(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx", "bias")}
        if t["qzeros"] is None or t["scales"] is None:
            raise ValueError(f"{name}: GPTQ layer needs qweight, qzeros and scales; found "
                             f"{sorted(k for k, v in t.items() if v is not None)}")
        new = marlin_linear_from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], t["bias"], bits=bits,
                                      group_size=group_size, desc_act=desc_act, checkpoint_format=fmt, name=name)
        if (new.in_features, new.out_features) != (mod.in_features, mod.out_features):
            raise ValueError(f"{name}: GPTQ tensors give in={new.in_features} out={new.out_features}, the model's "
                             f"Linear has in={mod.in_features} out={mod.out_features}")
        if (t["bias"] is None) != (mod.bias is None) and strict:
            raise ValueError(f"{name}: the model's Linear has bias={mod.bias is not None}, the checkpoint "
                             f"{'has' if t['bias'] is not None else 'has no'} bias")
        used.update(f"{name}.{k}" for k, v in t.items() if v is not None)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced.append(name)
    if not replaced:
        raise ValueError("no '<layer>.qweight' tensor in state_dict matches an nn.Linear of the model")

    rest: Dict[str, torch.Tensor] = {k: v for k, v in state_dict.items() if k not in used}
    quant_keys = {f"{n}.{b}" for n in replaced for b in ("B_packed", "scales", "zeros", "bias")}
    result = model.load_state_dict(rest, strict=False)
    missing = [k for k in result.missing_keys if k not in quant_keys]
    if strict and (missing or result.unexpected_keys):
        raise ValueError(f"GPTQ state_dict does not match the model: missing {missing[:10]}, "
                         f"unexpected {list(result.unexpected_keys)[:10]}")
    return replaced
