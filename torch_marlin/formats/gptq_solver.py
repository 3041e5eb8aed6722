"""GPTQ / LDLQ error feedback for every format, with the layer's input Hessian.

For a layer ``y = x @ W`` (``W`` is ``[K, N]``, the transpose of ``nn.Linear.weight``) and
calibration inputs ``X``, the output error of a quantized ``W_hat`` is
``||X (W - W_hat)||^2 = tr((W - W_hat)^T H (W - W_hat))`` with ``H = X^T X`` ``[K, K]``. GPTQ
quantizes the rows of ``W`` one at a time and spreads each row's rounding error over the rows not
yet quantized, in the direction that cancels it best under ``H`` (the Cholesky factor of
``H^-1``). LDLQ (QTIP / EXL3) is the same recursion; trellis layers run it on their rotated
weight with the rotated Hessian.

Options:

* ``damp``: ``H += damp * mean(diag(H)) * I`` (conditioning, and room for inputs the calibration
  never excited);
* ``act_order``: visit rows by decreasing ``diag(H)``, so the most active inputs are quantized
  while the most error can still be fed forward. The stored format keeps groups as consecutive
  rows of K, so with act-order every group's parameters are fitted up front (static groups);
  without it each group is fitted when its first row is reached, on the rows as updated so far;
* ``block_size``: rows per lazy-update block (updates outside the block are applied once per
  block as one matrix product).

The per-group parameters come from the format's quantizer (torch_marlin/formats/group_quant.py),
with the squared error weighted by ``diag(H)``.
"""

from typing import Dict, List, Optional

import torch

from .int4_packing import group_view

DEFAULT_DAMP = 0.01
DEFAULT_BLOCK = 128


def check_hessian(hessian: torch.Tensor, K: int) -> None:
    if not isinstance(hessian, torch.Tensor) or hessian.dim() != 2 or tuple(hessian.shape) != (K, K):
        shape = tuple(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian).__name__
        raise ValueError(f"hessian must be a [K, K] = [{K}, {K}] tensor (in_features squared), got {shape}")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian contains non-finite values")


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damping)^-1``, raising the damping until it factorizes.
    Factorized on the CPU for MPS tensors (not every linalg routine has an MPS kernel)."""
    if H.device.type == "mps":
        return _inverse_cholesky(H.cpu(), damp).to(H.device)
    mean_diag = float(torch.diagonal(H).mean())
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    d = damp
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(H + d * mean_diag * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U
        d = max(d * 10, 1e-4)
    raise ValueError("hessian is not positive definite even after damping; check the calibration inputs")


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, quantizer, act_order: bool = True,
                  damp: float = DEFAULT_DAMP, block_size: int = DEFAULT_BLOCK, progress: bool = False):
    """Quantizes ``w`` ``[K, N]`` with error feedback under ``hessian`` ``[K, K]``.

    ``quantizer``: an object with ``fit(rows, weight) -> params``, ``row_params(params)`` (one
    group's parameters readied for single rows) and ``quantize_row(row, ready) -> (codes,
    dequantized)`` (torch_marlin/formats/group_quant.py). The last group may be short
    (``K`` need not be a multiple of ``group_size``). Returns ``(codes int64 [K, N], params)``,
    ``params`` a dict of ``[ceil(K / group_size), N]`` tensors. ``progress``: a tqdm bar over the rows.
    """
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {tuple(w.shape)}")
    K, N = w.shape
    check_hessian(hessian, K)
    if damp < 0:
        raise ValueError(f"damp must be >= 0, got {damp}")
    dev = w.device
    W = w.detach().to(torch.float32).clone()
    H = hessian.detach().to(device=dev, dtype=torch.float32).clone()
    diag = torch.diagonal(H)
    dead = diag <= 0
    if bool(dead.all()):
        H = torch.eye(K, device=dev)
    else:
        # Inputs the calibration never excited: any value is as good; keep them out of the factorization.
        H[dead, dead] = diag[~dead].mean()
    diag = torch.diagonal(H).clone()
    G = (K + group_size - 1) // group_size
    row_weight = diag.unsqueeze(1)

    params: List[Dict[str, torch.Tensor]] = [None] * G

    def fit(g: int, rows: torch.Tensor):
        lo, hi = g * group_size, min((g + 1) * group_size, K)
        params[g] = quantizer.fit(rows, row_weight[lo:hi] / row_weight[lo:hi].mean())

    if act_order:
        perm = torch.argsort(diag, descending=True, stable=True)
        if K % group_size == 0:  # all groups in one call
            rw = (row_weight / row_weight.mean()).reshape(G, group_size, 1)
            both = quantizer.fit(W.reshape(G, group_size, N), rw)
            params = [{k: v[g] for k, v in both.items()} for g in range(G)]
        else:
            for g in range(G):
                fit(g, W[g * group_size:(g + 1) * group_size])
    else:
        perm = torch.arange(K, device=dev)
        block_size = max(group_size, (block_size // group_size) * group_size)
    U = _inverse_cholesky(H[perm][:, perm], damp)
    W = W[perm]
    group_of = (perm // group_size).tolist()
    codes = torch.empty(K, N, dtype=torch.int64, device=dev)
    prepared: List = [None] * G
    bar = _bar(progress, K, "row", f"GPTQ {K}x{N}")

    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        inv_d = (1.0 / torch.diagonal(U1)).tolist()
        for i in range(i2 - i1):
            g = group_of[i1 + i]
            if prepared[g] is None:
                if params[g] is None:  # no act-order: rows i1 + i .. of this group are all in this block
                    fit(g, W1[i:i + group_size])
                prepared[g] = quantizer.row_params(params[g])
            c, q = quantizer.quantize_row(W1[i], prepared[g])
            codes[i1 + i] = c
            err = E1[i]
            torch.sub(W1[i], q, out=err)
            err.mul_(inv_d[i])
            W1[i + 1:].addr_(U1[i, i + 1:], err, alpha=-1)
        W[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1)
        if bar is not None:
            bar.update(i2 - i1)
    if bar is not None:
        bar.close()

    out = torch.empty_like(codes)
    out[perm] = codes
    stacked = {k: torch.stack([p[k] for p in params]) for k in params[0]}
    return out, stacked


def check_finite_weight(w: torch.Tensor) -> None:
    """ValueError naming the first inf or NaN of a ``[K, N]`` weight: no 4-bit grid holds it, and
    its group's scale would be inf or NaN."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        k, n = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"the weight has {int(bad.sum())} non-finite values (inf or NaN); the first, {float(w[k, n])}, "
                         f"is weight[{n}, {k}] (output {n}, input {k}): quantizing needs finite weights")


# Layers from this size on take seconds to quantize on a CPU: from_linear shows a bar for them
# unless told otherwise, as patch_model shows one over the layers.
PROGRESS_MIN_WEIGHTS = 1 << 24


def progress_default(progress: Optional[bool], weights: int) -> bool:
    """``progress`` as given, or (``None``) whether a layer of ``weights`` weights gets a bar."""
    return weights >= PROGRESS_MIN_WEIGHTS if progress is None else bool(progress)


def _bar(progress: bool, total: int, unit: str, desc: str):
    if not progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit=unit, desc=desc, leave=False)


# Columns per step of round to nearest's progress bar: 16 steps. Each (group, column) is fitted on
# its own, so fitting the columns in slices gives the same parameters as one call.
PROGRESS_STEPS = 16


def quantize_weight(w: torch.Tensor, group_size: int, quantizer, hessian: Optional[torch.Tensor] = None,
                    progress: bool = False, **gptq_options):
    """Codes ``[K, N]`` and per-group parameters of a ``[K, N]`` float weight with ``quantizer``:
    round to nearest (codes against the parameters as stored, so dequantizing uses exactly what the
    kernels see), or GPTQ error feedback when ``hessian`` ``[K, K]`` is given. ``progress``: a tqdm
    bar over the columns (round to nearest) or the rows (GPTQ)."""
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {tuple(w.shape)}")
    wf = w.detach().to(torch.float32)
    check_finite_weight(wf)
    if hessian is not None:
        return gptq_quantize(wf, hessian, group_size, quantizer, progress=progress, **gptq_options)
    g = group_view(wf, group_size)
    K, N = wf.shape
    bar = _bar(progress, N, "column", f"quantizing {K}x{N}")
    if bar is None:
        params = quantizer.fit(g)
    else:
        step = -(-N // PROGRESS_STEPS)
        parts = []
        for n in range(0, N, step):
            parts.append(quantizer.fit(g[..., n:n + step]))
            bar.update(min(step, N - n))
        bar.close()
        params = {k: torch.cat([p[k] for p in parts], dim=-1) for k in parts[0]}
    return quantizer.quantize(g, params)[0].reshape_as(wf), params
