"""Calibration for ``patch_model(method="gptq")``: each layer's input Hessian, layer by layer.

Layers are calibrated in the order the model calls them, so every layer sees inputs produced by
the already-quantized layers before it (its quantizer corrects for their errors too). Layers
called back to back on the same input tensor (attention's query/key/value, an MLP's gate/up)
form one step and share one Hessian. A step runs the calibration batches through the model only
up to its layers: a hook on the first layer of the next step stops the forward pass there. Only
one step's Hessian is held at a time.

Tokens that an ``attention_mask`` in the batch marks as padding are left out of the Hessians.
"""

from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import torch
from torch import nn


class _StopForward(Exception):
    """Raised by a hook to end a calibration forward pass once the current step has its inputs."""


def as_batches(calibration) -> List:
    """The calibration iterable as a list (it is replayed once per step), checked."""
    if calibration is None:
        raise ValueError("method='gptq' needs calibration=batches: an iterable of model inputs (a tensor of "
                         "input ids, or a dict of keyword arguments as a tokenizer returns)")
    if isinstance(calibration, (torch.Tensor, Mapping)):
        calibration = [calibration]
    batches = list(calibration)
    if not batches:
        raise ValueError("calibration is empty: pass at least one batch of model inputs")
    for i, b in enumerate(batches):
        if not isinstance(b, (torch.Tensor, Mapping, tuple, list)):
            raise TypeError(f"calibration batch {i} must be a tensor, a dict of keyword arguments or a tuple of "
                            f"positional arguments, got {type(b).__name__}")
    return batches


def _to(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) and device is not None else x


def _run(model: nn.Module, batch, device) -> None:
    try:
        if isinstance(batch, Mapping):
            model(**{k: _to(v, device) for k, v in batch.items()})
        elif isinstance(batch, (tuple, list)):
            model(*[_to(v, device) for v in batch])
        else:
            model(_to(batch, device))
    except _StopForward:
        pass


def _token_mask(batch) -> Optional[torch.Tensor]:
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return batch["attention_mask"].bool()
    return None


def _model_device(model: nn.Module):
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def trace_steps(model: nn.Module, layers: Dict[str, nn.Module], batch) -> List[List[str]]:
    """Calibration steps: ``layers`` in the order of their first call on ``batch``, consecutive
    calls on the same input tensor grouped. Layers the batch never reaches are left out."""
    calls: List = []
    seen = set()
    handles = []

    def hook(name):
        def pre(mod, args):
            if name not in seen and args:
                seen.add(name)
                calls.append((name, args[0]))
        return pre

    for name, mod in layers.items():
        handles.append(mod.register_forward_pre_hook(hook(name)))
    try:
        _run(model, batch, _model_device(model))
    finally:
        for h in handles:
            h.remove()
    steps: List[List[str]] = []
    prev = None
    for name, x in calls:
        if steps and x is prev:
            steps[-1].append(name)
        else:
            steps.append([name])
        prev = x
    return steps


def collect_hessian(model: nn.Module, layer: nn.Module, batches: Sequence, stop_at: Optional[nn.Module] = None,
                    device=None) -> torch.Tensor:
    """``H = X^T X / rows`` (fp32 ``[K, K]``) over every input row ``layer`` gets from ``batches``.
    ``stop_at``: a module whose call ends each forward pass early (the next step's first layer)."""
    device = device if device is not None else _model_device(model)
    K = layer.in_features
    H = torch.zeros(K, K, dtype=torch.float32, device=layer.weight.device)
    rows = [0]
    mask: List[Optional[torch.Tensor]] = [None]

    def pre(mod, args):
        if not args:  # called with keyword arguments only: trace_steps never listed such a layer
            return
        x = args[0].detach()
        x2 = x.reshape(-1, K).to(torch.float32)
        m = mask[0]
        if m is not None and tuple(x.shape[:-1]) == tuple(m.shape):
            x2 = x2[m.reshape(-1).to(x2.device)]
        H.addmm_(x2.t(), x2)
        rows[0] += x2.shape[0]

    def stop(mod, args):
        raise _StopForward

    handles = [layer.register_forward_pre_hook(pre)]
    if stop_at is not None:
        handles.append(stop_at.register_forward_pre_hook(stop))
    try:
        for b in batches:
            mask[0] = _token_mask(b)
            _run(model, b, device)
    finally:
        for h in handles:
            h.remove()
    if rows[0] == 0:
        raise ValueError("the calibration batches produced no input rows for a layer (all tokens masked?)")
    return H / rows[0]


def calibrated_layers(model: nn.Module, layers: Dict[str, nn.Module], batches: Sequence) -> Iterable:
    """Yields ``(names, H)`` per step, in call order; the caller swaps the step's layers for
    quantized ones before the next step runs. Layers never reached come last with ``H = None``."""
    steps = trace_steps(model, layers, batches[0])
    reached = {n for s in steps for n in s}
    for i, names in enumerate(steps):
        stop_at = layers[steps[i + 1][0]] if i + 1 < len(steps) else None
        H = collect_hessian(model, layers[names[0]], batches, stop_at)
        yield names, H
        del H
    rest = [n for n in layers if n not in reached]
    if rest:
        yield rest, None
