"""Trellis codebook weights (an EXL3-style container: codebook indices, group scales, sign vectors).

Layout (docs/formats.md, "Trellis"), for a weight ``W[K, N]`` (the transpose of ``nn.Linear.weight``):

- ``packed_indices`` uint8 ``[ceil(K/16), ceil(N/16), 16*16*bits/8]``: the weight is cut into 16x16
  tiles; inside a tile the 256 indices are row-major (``i = local_k * 16 + local_n``) and form a
  little-endian bit stream, index ``i`` at bits ``[i*bits, (i+1)*bits)`` (LSB first; 3-bit indices
  cross byte boundaries). One tile row is ``2*bits`` whole bytes. Edge tiles are zero padded.
- ``scales`` f32 ``[ceil(K/group_size), N]``, ``group_size`` a positive multiple of 16 (so a 16x16
  tile never straddles two groups).
- ``grid`` f32 ``[2**bits]``: the codebook.
- ``su`` f32 ``[K]``, ``sv`` f32 ``[N]``: sign vectors (any finite values are accepted).

``w[k, n] = grid[idx[k, n]] * scales[k // group_size, n] * su[k] * sv[n]``.

CUDA lane layout (:func:`tiles_to_lanes`, docs/trellis.md, "CUDA lane layout"): a bit permutation
of ``packed_indices``, uint8 ``[ceil(tk/8), tn, 256*bits]`` (``tk, tn`` the tile counts), made at
load time on CUDA only and never stored. Chunk ``(s, n)`` holds tile rows ``8s .. 8s+7`` (rows past
``tk`` zero); lane ``l`` owns its bytes ``[l*8*bits, (l+1)*8*bits)``, a little-endian stream of 32
fields of ``2*bits`` bits. Field ``f = 4*j + p`` (``j`` the tile row in the chunk), with
``g, t = l // 4, l % 4``, column ``c = 2*g + (p & 1)`` and row ``r0 = 4*t + 2*(p >> 1)``, is
``idx[r0][c] | idx[r0 + 1][c] << bits``: the two indices of one MMA register, so the decode kernel
extracts a register with a shift and a mask instead of gathering bits from two tile rows.

The quantizer (:func:`quantize_trellis`) adds an optional randomized Hadamard rotation for
incoherence; the layer then computes ``y = (((x * su) @ H_K) @ W_deq) @ H_N * sv`` — see
:func:`rotate_input` / :func:`rotate_output` and docs/formats.md for why that equals ``x @ W``.
Everything here is plain torch: it is the independent reference the kernels are tested against.
"""

import functools
import math
from typing import Optional

import torch

from .gptq_solver import check_finite_weight

TILE = 16
TILE_ELEMS = TILE * TILE
LANE_CHUNK_TILES = 8  # tile rows per chunk of the CUDA lane layout
LANE_COUNT = 32  # lanes per chunk: one warp
BITS = (2, 3, 4)
MAX_HADAMARD_BLOCK = 128


def packed_bytes_per_tile(bits: int) -> int:
    check_bits(bits)
    return TILE_ELEMS * bits // 8


def check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")


def check_group_size(group_size: int, in_features: Optional[int] = None) -> None:
    """Any ``in_features`` takes the format (K is padded to whole tiles); only the group size is constrained."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % TILE != 0:
        raise ValueError(f"group_size must be a positive multiple of 16 (a 16x16 tile never straddles groups), "
                         f"got {group_size}")


def num_groups(K: int, group_size: int) -> int:
    return (K + group_size - 1) // group_size


# ---- packing --------------------------------------------------------------------------------------

def pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs indices ``[K, N]`` (integers in ``0 .. 2**bits - 1``) into uint8
    ``[ceil(K/16), ceil(N/16), 32*bits]``."""
    check_bits(bits)
    if idx.dim() != 2:
        raise ValueError(f"idx must be 2-D [K, N], got shape {tuple(idx.shape)}")
    K, N = idx.shape
    i = idx.to(torch.int64)
    if i.numel() and (int(i.min()) < 0 or int(i.max()) >= (1 << bits)):
        raise ValueError(f"idx must be in 0..{(1 << bits) - 1} for bits={bits}")
    tk, tn = (K + TILE - 1) // TILE, (N + TILE - 1) // TILE
    padded = torch.zeros(tk * TILE, tn * TILE, dtype=torch.int64, device=idx.device)
    padded[:K, :N] = i
    # [tk, 16, tn, 16] -> [tk, tn, 256] with the tile row-major.
    tiles = padded.reshape(tk, TILE, tn, TILE).permute(0, 2, 1, 3).reshape(tk, tn, TILE_ELEMS)
    # Bit stream: expand every index to its `bits` bits (LSB first), then group 8 bits per byte.
    shifts = torch.arange(bits, device=idx.device)
    bitstream = ((tiles.unsqueeze(-1) >> shifts) & 1).reshape(tk, tn, TILE_ELEMS * bits // 8, 8)
    weights = (1 << torch.arange(8, device=idx.device))
    return (bitstream * weights).sum(-1).to(torch.uint8)


def unpack_indices(packed: torch.Tensor, K: int, N: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: uint8 tiles -> int64 indices ``[K, N]``."""
    check_bits(bits)
    tk, tn = (K + TILE - 1) // TILE, (N + TILE - 1) // TILE
    expected = (tk, tn, packed_bytes_per_tile(bits))
    if packed.dtype != torch.uint8 or tuple(packed.shape) != expected:
        raise ValueError(f"packed_indices must be uint8 of shape {expected} for K={K}, N={N}, bits={bits}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    b = packed.to(torch.int64)
    bitstream = ((b.unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1).reshape(tk, tn, TILE_ELEMS, bits)
    tiles = (bitstream << torch.arange(bits, device=packed.device)).sum(-1)
    return tiles.reshape(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)[:K, :N]


# ---- CUDA lane layout ------------------------------------------------------------------------------

def lanes_shape(K: int, N: int, bits: int) -> tuple:
    """Shape of the lane layout of a ``[K, N]`` weight: ``(ceil(ceil(K/16) / 8), ceil(N/16), 256*bits)``."""
    check_bits(bits)
    _check_dims(K, N)
    tk, tn = (K + TILE - 1) // TILE, (N + TILE - 1) // TILE
    return ((tk + LANE_CHUNK_TILES - 1) // LANE_CHUNK_TILES, tn, LANE_CHUNK_TILES * packed_bytes_per_tile(bits))


def _check_dims(K: int, N: int) -> None:
    for name, v in (("K", K), ("N", N)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def _check_uint8(t, name: str, shape: tuple, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a uint8 tensor of shape {shape} ({what}), got {type(t).__name__}")
    if t.dtype != torch.uint8 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be uint8 of shape {shape} ({what}), got {t.dtype} {tuple(t.shape)}")


@functools.lru_cache(maxsize=None)
def _lane_bit_source(bits: int) -> torch.Tensor:
    """For every bit ``q`` of a lane-layout chunk, the bit of the chunk's 8 canonical tiles (tile
    ``j``'s stream at offset ``j * 256*bits``) it holds: int64 ``[2048*bits]``, a permutation."""
    chunk_bits = LANE_CHUNK_TILES * TILE_ELEMS * bits
    lane_bits = chunk_bits // LANE_COUNT
    q = torch.arange(chunk_bits)
    lane, in_lane = q // lane_bits, q % lane_bits
    field, bit = in_lane // (2 * bits), in_lane % (2 * bits)
    j, p = field // 4, field % 4
    g, t = lane // 4, lane % 4
    col = 2 * g + (p & 1)
    row = 4 * t + 2 * (p >> 1) + bit // bits
    return j * (TILE_ELEMS * bits) + (row * TILE + col) * bits + bit % bits


@functools.lru_cache(maxsize=None)
def _lane_bit_inverse(bits: int) -> torch.Tensor:
    return torch.argsort(_lane_bit_source(bits))


# Chunks permuted per step: bounds the bit-expanded temporaries (8 bytes per byte, twice) to ~64 MiB
# whatever the layer size.
_CHUNK_BYTES_PER_STEP = 4 << 20


def _permute_chunk_bits(chunks: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``chunks`` uint8 ``[S, tn, B]`` -> uint8 ``[S, tn, B]`` whose bit ``q`` of every chunk is its
    bit ``source[q]``."""
    S, tn, B = chunks.shape
    out = torch.empty_like(chunks)
    shifts = torch.arange(8, dtype=torch.uint8, device=chunks.device)
    source = source.to(chunks.device)
    step = max(1, _CHUNK_BYTES_PER_STEP // max(1, tn * B))
    for s0 in range(0, S, step):
        part = chunks[s0:s0 + step]
        bitstream = ((part.unsqueeze(-1) >> shifts) & 1).reshape(*part.shape[:2], B * 8)
        moved = bitstream[..., source].reshape(*part.shape[:2], B, 8) << shifts
        byte = moved[..., 0]
        for b in range(1, 8):
            byte = byte | moved[..., b]
        out[s0:s0 + step] = byte
    return out


def tiles_to_lanes(packed: torch.Tensor, K: int, N: int, bits: int) -> torch.Tensor:
    """Canonical ``packed_indices`` ``[ceil(K/16), ceil(N/16), 32*bits]`` -> the CUDA lane layout
    :func:`lanes_shape` (module docstring), on ``packed``'s device; tile rows past the last are zero."""
    check_bits(bits)
    _check_dims(K, N)
    tk, tn = (K + TILE - 1) // TILE, (N + TILE - 1) // TILE
    _check_uint8(packed, "packed", (tk, tn, packed_bytes_per_tile(bits)), f"canonical tiles of K={K}, N={N}, "
                                                                           f"bits={bits}")
    S = lanes_shape(K, N, bits)[0]
    tiles = packed
    if S * LANE_CHUNK_TILES != tk:
        tiles = torch.zeros(S * LANE_CHUNK_TILES, tn, packed.shape[-1], dtype=torch.uint8, device=packed.device)
        tiles[:tk] = packed
    # [S, 8, tn, 32*bits] -> [S, tn, 8 * 32*bits]: a chunk's 8 tile streams one after the other.
    chunks = tiles.reshape(S, LANE_CHUNK_TILES, tn, -1).permute(0, 2, 1, 3).reshape(S, tn, -1)
    return _permute_chunk_bits(chunks, _lane_bit_source(bits))


def lanes_to_tiles(lanes: torch.Tensor, K: int, N: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`tiles_to_lanes`: the canonical ``[ceil(K/16), ceil(N/16), 32*bits]`` tiles."""
    check_bits(bits)
    _check_dims(K, N)
    shape = lanes_shape(K, N, bits)
    _check_uint8(lanes, "lanes", shape, f"lane layout of K={K}, N={N}, bits={bits}")
    tk = (K + TILE - 1) // TILE
    S, tn, _ = shape
    chunks = _permute_chunk_bits(lanes, _lane_bit_inverse(bits))
    tiles = chunks.reshape(S, tn, LANE_CHUNK_TILES, -1).permute(0, 2, 1, 3).reshape(S * LANE_CHUNK_TILES, tn, -1)
    return tiles[:tk].contiguous()


def dequant_trellis_reference(packed: torch.Tensor, scales: torch.Tensor, grid: torch.Tensor, su: torch.Tensor,
                              sv: torch.Tensor, K: int, N: int, bits: int, group_size: int) -> torch.Tensor:
    """Dense fp32 ``[K, N]``: ``grid[idx] * scales[k // group_size, n] * su[k] * sv[n]``."""
    idx = unpack_indices(packed, K, N, bits)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)[:K]
    return grid.to(torch.float32)[idx] * s * su.to(torch.float32)[:, None] * sv.to(torch.float32)[None, :]


# ---- validation (host side, at construction / load) ------------------------------------------------

def validate_trellis(packed: torch.Tensor, scales: torch.Tensor, grid: torch.Tensor, su: torch.Tensor,
                     sv: torch.Tensor, K: int, N: int, bits: int, group_size: int, name: str = "trellis") -> None:
    """Raises ValueError/TypeError naming the offending tensor. Indices are < 2**bits by
    construction (the packing has exactly `bits` bits per index); values must be finite."""
    check_bits(bits)
    check_group_size(group_size)
    if K <= 0 or N <= 0:
        raise ValueError(f"{name}: K and N must be positive, got K={K}, N={N}")
    shapes = {
        "packed_indices": ((K + 15) // 16, (N + 15) // 16, packed_bytes_per_tile(bits)),
        "scales": (num_groups(K, group_size), N),
        "grid": (1 << bits,),
        "su": (K,),
        "sv": (N,),
    }
    for tname, t in (("packed_indices", packed), ("scales", scales), ("grid", grid), ("su", su), ("sv", sv)):
        if tuple(t.shape) != shapes[tname]:
            raise ValueError(f"{name}: {tname} must have shape {shapes[tname]}, got {tuple(t.shape)}")
        want = torch.uint8 if tname == "packed_indices" else torch.float32
        if t.dtype != want:
            raise TypeError(f"{name}: {tname} must be {want}, got {t.dtype}")
        if tname != "packed_indices" and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: {tname} contains non-finite values")


# ---- randomized block Hadamard rotation -------------------------------------------------------------

def hadamard_block(dim: int) -> int:
    """Block size of the rotation along a dimension: the largest power of two dividing ``dim``,
    at most 128 (1 means no rotation, e.g. an odd dimension)."""
    b = 1
    while b < MAX_HADAMARD_BLOCK and dim % (2 * b) == 0:
        b *= 2
    return b


def hadamard_matrix(b: int, device=None) -> torch.Tensor:
    """Orthonormal, symmetric Sylvester Hadamard matrix of order ``b`` (a power of two): H @ H = I."""
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(b)


def block_hadamard(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Multiplies ``x`` along ``dim`` by the block-diagonal Hadamard ``H`` (blocks of
    :func:`hadamard_block`). ``H`` is symmetric and orthonormal, so applying it twice is the identity."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    b = hadamard_block(n)
    if b > 1:
        h = hadamard_matrix(b, x.device).to(x.dtype)
        x = (x.reshape(*x.shape[:-1], n // b, b) @ h).reshape(*x.shape[:-1], n)
    return x.movedim(-1, dim)


def rotate_input(x: torch.Tensor, su: torch.Tensor) -> torch.Tensor:
    """``x -> (x * su) @ H_K`` along the last dimension (the layer's input transform)."""
    return block_hadamard(x * su.to(x.dtype), -1)


def rotate_output(y: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    """``y -> (y @ H_N) * sv`` along the last dimension (the layer's output transform)."""
    return block_hadamard(y, -1) * sv.to(y.dtype)


def random_signs(n: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    return (torch.randint(0, 2, (n,), generator=generator) * 2 - 1).to(torch.float32)


# ---- codebook fit and quantizer ----------------------------------------------------------------------

def fit_lloyd_max(samples: torch.Tensor, levels: int, iters: int = 40) -> torch.Tensor:
    """Lloyd-Max quantizer levels (sorted, f32) minimizing the mean squared error on ``samples``:
    alternate nearest-level assignment and centroid update, starting from equal-mass quantiles."""
    x = samples.reshape(-1).to(torch.float32)
    x = x[torch.isfinite(x)]
    if x.numel() == 0:
        raise ValueError("fit_lloyd_max: no finite samples")
    q = (torch.arange(levels, dtype=torch.float32) + 0.5) / levels
    c = torch.quantile(x[: 1 << 24].cpu(), q).to(x.device)
    xs, _ = torch.sort(x)
    # Prefix sums of the sorted samples (fp64: long sums) give every cell's mass in O(levels).
    csum = torch.cat([xs.new_zeros(1, dtype=torch.float64), torch.cumsum(xs.double(), 0)])
    for _ in range(iters):
        # Decision thresholds are the midpoints; with sorted data each cell is a contiguous range.
        edges = torch.searchsorted(xs, (c[1:] + c[:-1]) / 2)
        bounds = torch.cat([edges.new_zeros(1), edges, edges.new_full((1,), xs.numel())])
        cnt = (bounds[1:] - bounds[:-1]).double()
        sums = csum[bounds[1:]] - csum[bounds[:-1]]
        new_c = torch.where(cnt > 0, sums / cnt.clamp(min=1), c.double()).float()
        if torch.allclose(new_c, c, atol=1e-7, rtol=0):
            c = new_c
            break
        c, _ = torch.sort(new_c)
    return c


def _nearest(z: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook level (grid sorted ascending) for every element of ``z``."""
    mids = (grid[1:] + grid[:-1]) / 2
    return torch.bucketize(z.contiguous(), mids)


class TrellisQuantizer:
    """Per-group scales for a fixed codebook (the GPTQ / LDLQ group fit): starting from the group's
    RMS, least-squares refits ``s = <w, c> / <c, c>`` on the nearest levels, keeping the best."""

    def __init__(self, grid: torch.Tensor, iters: int = 4):
        self.grid, self.iters = grid, iters
        self.mids = (grid[1:] + grid[:-1]) / 2

    def levels(self, x: torch.Tensor):
        idx = torch.bucketize(x.contiguous(), self.mids)
        return idx, self.grid[idx]

    def fit(self, g: torch.Tensor, weight: Optional[torch.Tensor] = None):
        g = g.to(torch.float32)
        wt = torch.ones_like(g[..., :1]) if weight is None else weight
        rms = (g * g).mean(-2).sqrt()
        s = torch.where(rms > 0, rms, torch.ones_like(rms))
        best, best_err = s, None
        for _ in range(self.iters + 1):
            c = self.levels(g / s.unsqueeze(-2))[1]
            err = (wt * (g - c * s.unsqueeze(-2)) ** 2).sum(-2)
            if best_err is None:
                best_err = err
            better = err < best_err
            best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
            num, den = (wt * g * c).sum(-2), (wt * c * c).sum(-2)
            new = torch.where(den > 0, num / den.clamp(min=1e-30), s)
            s = torch.where(new > 0, new, s)  # a negative LS scale (degenerate group): keep the last one
        return {"scales": best}

    def quantize(self, x: torch.Tensor, params):
        s = params["scales"].unsqueeze(-2)
        idx, vals = self.levels(x.to(torch.float32) / s)
        return idx, vals * s

    def row_params(self, params):
        s = params["scales"]
        return s, 1.0 / s

    def quantize_row(self, x: torch.Tensor, ready):
        s, inv = ready
        idx, vals = self.levels(x * inv)
        return idx, vals * s


def rotate_hessian(hessian: torch.Tensor, su: torch.Tensor) -> torch.Tensor:
    """The input Hessian of the rotated weight: with ``M = D_u H_K D_u`` (orthogonal, symmetric)
    the layer's rotated inputs are ``x M``, so ``H_rot = M H M``."""
    a = hessian.to(torch.float32) * su[:, None] * su[None, :]
    a = block_hadamard(block_hadamard(a, 0), 1)
    return a * su[:, None] * su[None, :]


def quantize_trellis(w: torch.Tensor, bits: int = 3, group_size: int = 128, rotate: bool = True,
                     grid: Optional[torch.Tensor] = None, seed: int = 0, scale_iters: int = 6,
                     fit_samples: int = 1 << 20, hessian: Optional[torch.Tensor] = None, progress: bool = False,
                     **gptq_options):
    """Quantizes a ``[K, N]`` float weight (``nn.Linear.weight.t()``) to the trellis format.

    1. Incoherence (``rotate=True``): random signs ``su``/``sv`` and the block Hadamard ``H``;
       the matrix quantized is ``Q = D_u H_K D_u W D_v H_N D_v`` (see docs/formats.md). With
       ``rotate=False`` ``su = sv = 1`` and ``Q = W``.
    2. Per group (``group_size`` rows of K) and column: normalize by the RMS of the group.
    3. Codebook: Lloyd-Max levels fitted to the normalized values (or the given ``grid``).
    4. Alternating least squares, ``scale_iters`` rounds: assign nearest levels, refit each
       group's scale (``s = <q, c> / <c, c>``), refit the codebook for the scales (each level the
       scale-weighted mean of its values; not when ``grid`` is given).
    5. With ``hessian`` ``[K, K]`` (the layer's input second moment): the indices and scales are
       chosen again by LDLQ / GPTQ error feedback (torch_marlin/formats/gptq_solver.py) under
       the rotated Hessian, with the codebook of step 4. ``gptq_options``: ``act_order``,
       ``damp``, ``block_size``. The indices are independent per element, so the nearest level
       inside the error-feedback recursion is the exact per-element choice.

    Returns a dict with ``packed_indices, scales, grid, su, sv, K, N, bits, group_size``.
    """
    check_bits(bits)
    check_group_size(group_size)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {tuple(w.shape)}")
    check_finite_weight(w)
    K, N = w.shape
    dev = w.device
    gen = torch.Generator().manual_seed(seed)
    if rotate:
        su, sv = random_signs(K, gen).to(dev), random_signs(N, gen).to(dev)
        q = w.detach().to(torch.float32) * su[:, None]
        q = block_hadamard(q, 0) * su[:, None]
        q = q * sv[None, :]
        q = block_hadamard(q, 1) * sv[None, :]
    else:
        su, sv = torch.ones(K, device=dev), torch.ones(N, device=dev)
        q = w.detach().to(torch.float32)
    G = num_groups(K, group_size)
    Kp = G * group_size
    qp = torch.zeros(Kp, N, device=dev)
    qp[:K] = q
    mask = torch.zeros(Kp, 1, device=dev)
    mask[:K] = 1
    g = qp.reshape(G, group_size, N)
    gm = mask.reshape(G, group_size, 1)
    count = gm.sum(1)  # [G, 1] real rows per group
    rms = ((g * g).sum(1) / count).sqrt()
    scales = torch.where(rms > 0, rms, torch.ones_like(rms))
    fit_grid = grid is None
    if fit_grid:
        z = (g / scales[:, None, :])[gm.expand_as(g) > 0]
        if z.numel() > fit_samples:
            z = z[torch.randperm(z.numel(), generator=gen)[:fit_samples].to(dev)]
        grid = fit_lloyd_max(z, 1 << bits)
    grid = grid.to(device=dev, dtype=torch.float32)
    if tuple(grid.shape) != (1 << bits,):
        raise ValueError(f"grid must have shape ({1 << bits},), got {tuple(grid.shape)}")
    grid, _ = torch.sort(grid)
    from .gptq_solver import _bar
    bar = _bar(progress and hessian is None, scale_iters + 1, "pass", f"trellis {K}x{N}")
    for it in range(scale_iters + 1):
        if bar is not None:
            bar.update(1)
        idx = _nearest(g / scales[:, None, :], grid)
        c = grid[idx] * gm
        num, den = (g * c).sum(1), (c * c).sum(1)
        new_scales = torch.where(den > 0, num / den.clamp(min=1e-30), scales)
        # A negative LS scale is possible for a degenerate group; keep the previous one.
        scales = torch.where(new_scales > 0, new_scales, scales)
        if fit_grid and it < scale_iters:
            # Each level: argmin_v sum (q - v s)^2 over its members = sum(s q) / sum(s^2).
            sb = scales[:, None, :] * gm
            flat = idx.reshape(-1)
            num = torch.zeros_like(grid).index_add_(0, flat, (sb * g).reshape(-1))
            den = torch.zeros_like(grid).index_add_(0, flat, (sb * sb).reshape(-1))
            grid, _ = torch.sort(torch.where(den > 0, num / den.clamp(min=1e-30), grid))
    if hessian is not None:
        from .gptq_solver import check_hessian, gptq_quantize
        check_hessian(hessian, K)
        h = rotate_hessian(hessian.to(dev), su) if rotate else hessian.to(dev)
        idx, params = gptq_quantize(q, h, group_size, TrellisQuantizer(grid), progress=progress, **gptq_options)
        scales = params["scales"]
    else:
        idx = _nearest(g / scales[:, None, :], grid).reshape(Kp, N)[:K]
    if bar is not None:
        bar.close()
    return {
        "packed_indices": pack_indices(idx, bits),
        "scales": scales.contiguous(),
        "grid": grid.contiguous(),
        "su": su.contiguous(),
        "sv": sv.contiguous(),
        "K": K,
        "N": N,
        "bits": bits,
        "group_size": group_size,
    }


def effective_weight(q: dict, rotate: bool = True) -> torch.Tensor:
    """The ``[K, N]`` linear map a quantized layer computes (undoing the rotation), for SQNR."""
    w = dequant_trellis_reference(q["packed_indices"], q["scales"], q["grid"], q["su"], q["sv"], q["K"], q["N"],
                                  q["bits"], q["group_size"])
    return undo_rotation(w, q["su"], q["sv"]) if rotate else w


def undo_rotation(w: torch.Tensor, su: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    """The linear map of a rotated layer from its stored ``[K, N]`` matrix:
    ``y = (x D_u H_K) W (H_N D_v)``, so ``W_eff = D_u H_K W H_N D_v``."""
    w = block_hadamard(w, 0) * su.to(w.dtype)[:, None]
    return block_hadamard(w, 1) * sv.to(w.dtype)[None, :]


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    w = w.to(torch.float64)
    err = (w - w_hat.to(torch.float64)).pow(2).sum()
    return float(10 * torch.log10(w.pow(2).sum() / err))


def quantize_rtn_int(w: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """Round-to-nearest asymmetric integer quantization per group along K (scale + zero point),
    returned dequantized: the baseline the trellis quantizer is compared against."""
    K, N = w.shape
    G = num_groups(K, group_size)
    wp = torch.zeros(G * group_size, N)
    wp[:K] = w.float()
    g = wp.reshape(G, group_size, N)
    valid = (torch.arange(G * group_size) < K).reshape(G, group_size, 1)
    lo = torch.where(valid, g, torch.full_like(g, float("inf"))).amin(1).clamp(max=0)
    hi = torch.where(valid, g, torch.full_like(g, float("-inf"))).amax(1).clamp(min=0)
    qmax = (1 << bits) - 1
    # Scales and zeros stored in fp16 like a real RTN checkpoint (GPTQ / AWQ containers).
    s = ((hi - lo) / qmax).half().float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    z = torch.round(-lo / s).clamp(0, qmax)
    qv = torch.round(g / s[:, None] + z[:, None]).clamp(0, qmax)
    return ((qv - z[:, None]) * s[:, None]).reshape(-1, N)[:K]
