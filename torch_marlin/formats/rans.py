"""rANS-coded 4-bit codes: the plain-numpy reference coder (docs/formats.md, "rANS-coded 4-bit codes").

The C++ encoder and every kernel must agree with these two functions bit for bit; the tests compare
against them. They are vectorized over tiles and lanes (numpy), so they are fast enough for test
shapes, not for whole models.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
STATE_LOW = 1 << 16
LANES = 32
SYMBOLS = 16
STREAM_ALIGN_WORDS = 8
MIN_LANE_SYMBOLS = 1024


def default_channels_per_tile(K: int) -> int:
    """Output channels per tile so that each lane decodes at least ``MIN_LANE_SYMBOLS`` codes."""
    check_k(K)
    return max(1, math.ceil(LANES * MIN_LANE_SYMBOLS / K))


def check_k(K: int) -> None:
    if K <= 0 or K % LANES != 0:
        raise ValueError(f"rANS coding needs K (in_features) to be a positive multiple of {LANES}, got {K}")


def check_group_size(group_size: int, in_features: Optional[int] = None) -> None:
    """The layers rANS coding takes, beyond the 4-bit container's rule: the 32 lanes decode 32 rows of
    K a step and a step never straddles a group, so ``in_features`` and ``group_size`` are multiples
    of 32."""
    if in_features is not None:
        check_k(in_features)
    if group_size % LANES != 0:
        raise ValueError(f"group_size={group_size} is not a multiple of {LANES}")


def frequencies(counts: np.ndarray) -> np.ndarray:
    """Quantized frequencies ``[..., 16]`` summing to ``PROB_SCALE`` from symbol counts ``[..., 16]``:
    ``max(1, floor(4096 * n_s / n))`` for present symbols, 0 for absent ones, and the most frequent
    symbol (lowest index on ties) absorbs the difference."""
    counts = np.asarray(counts, dtype=np.int64)
    total = counts.sum(axis=-1, keepdims=True)
    if np.any(total <= 0):
        raise ValueError("every tile must hold at least one symbol")
    freq = np.where(counts > 0, np.maximum(1, (counts * PROB_SCALE) // total), 0)
    top = np.argmax(counts, axis=-1)  # first maximum: lowest index on ties
    fix = PROB_SCALE - freq.sum(axis=-1)
    np.put_along_axis(freq, top[..., None], np.take_along_axis(freq, top[..., None], -1) + fix[..., None], -1)
    return freq


def _tile_symbols(codes: np.ndarray, channels_per_tile: int):
    """Yields ``(first_tile, symbols [tiles, steps, 32])`` for the full tiles and the last partial one,
    in decode order: step ``c * K/32 + j``, lane ``l`` -> ``code[32 j + l, tile * C + c]``."""
    K, N = codes.shape
    C = channels_per_tile
    full = N // C
    if full:
        block = codes[:, : full * C].reshape(K // LANES, LANES, full, C)  # [j, l, t, c]
        yield 0, np.ascontiguousarray(block.transpose(2, 3, 0, 1)).reshape(full, C * (K // LANES), LANES)
    rest = N - full * C
    if rest:
        block = codes[:, full * C :].reshape(K // LANES, LANES, 1, rest)
        yield full, np.ascontiguousarray(block.transpose(2, 3, 0, 1)).reshape(1, rest * (K // LANES), LANES)


def encode(codes, channels_per_tile: int | None = None) -> dict:
    """Codes ``[K, N]`` (values 0..15) -> ``dict(words int16 [W], word_offsets int32 [T+1],
    states int32 [T, 32], freqs int16 [T, 16], channels_per_tile)``."""
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D [K, N], got shape {codes.shape}")
    K, N = codes.shape
    check_k(K)
    if N <= 0:
        raise ValueError("codes must have at least one column")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("codes must be in 0..15")
    C = default_channels_per_tile(K) if channels_per_tile is None else int(channels_per_tile)
    if C <= 0:
        raise ValueError(f"channels_per_tile must be positive, got {C}")
    codes = codes.astype(np.int64)
    T = -(-N // C)
    states = np.zeros((T, LANES), dtype=np.uint64)
    freqs = np.zeros((T, SYMBOLS), dtype=np.int64)
    streams: list[np.ndarray] = [None] * T  # type: ignore[list-item]
    for t0, sym in _tile_symbols(codes, C):
        tiles, steps, _ = sym.shape
        counts = np.stack([(sym == s).sum(axis=(1, 2)) for s in range(SYMBOLS)], axis=-1)
        freq = frequencies(counts)
        cum = np.concatenate([np.zeros((tiles, 1), np.int64), np.cumsum(freq, axis=-1)[:, :-1]], axis=-1)
        f_all = np.take_along_axis(freq, sym.reshape(tiles, -1), 1).reshape(sym.shape).astype(np.uint64)
        c_all = np.take_along_axis(cum, sym.reshape(tiles, -1), 1).reshape(sym.shape).astype(np.uint64)
        x = np.full((tiles, LANES), STATE_LOW, dtype=np.uint64)
        emitted = np.zeros(sym.shape, dtype=bool)
        words = np.zeros(sym.shape, dtype=np.uint16)
        for step in range(steps - 1, -1, -1):
            f, c = f_all[:, step], c_all[:, step]
            emit = x >= (f << np.uint64(20))
            emitted[:, step] = emit
            words[:, step] = (x & np.uint64(0xFFFF)).astype(np.uint16)
            x = np.where(emit, x >> np.uint64(16), x)
            x = ((x // f) << np.uint64(PROB_BITS)) + x % f + c
        states[t0 : t0 + tiles] = x
        freqs[t0 : t0 + tiles] = freq
        for i in range(tiles):
            streams[t0 + i] = words[i][emitted[i]]  # step-major, lanes ascending: decode order
    offsets = np.zeros(T + 1, dtype=np.int64)
    for t, s in enumerate(streams):
        offsets[t + 1] = offsets[t] + -(-len(s) // STREAM_ALIGN_WORDS) * STREAM_ALIGN_WORDS
    if offsets[-1] >= 2**31:
        raise ValueError("the coded layer needs more than 2^31 words; split it")
    all_words = np.zeros(int(offsets[-1]), dtype=np.uint16)
    for t, s in enumerate(streams):
        all_words[offsets[t] : offsets[t] + len(s)] = s
    return dict(
        words=all_words.view(np.int16),
        word_offsets=offsets.astype(np.int32),
        states=states.astype(np.uint32).view(np.int32),
        freqs=freqs.astype(np.int16),
        channels_per_tile=C,
    )


def check_tables(word_offsets, states, freqs, K: int, N: int, channels_per_tile: int, n_words: int) -> None:
    """Structural checks of a coded layer (shapes, table sums, offsets); raises ValueError."""
    check_k(K)
    C = int(channels_per_tile)
    if C <= 0:
        raise ValueError(f"channels_per_tile must be positive, got {C}")
    T = -(-N // C)
    if word_offsets.shape != (T + 1,):
        raise ValueError(f"word_offsets must have shape ({T + 1},) for N={N}, C={C}, got {word_offsets.shape}")
    if states.shape != (T, LANES):
        raise ValueError(f"states must have shape ({T}, {LANES}), got {states.shape}")
    if freqs.shape != (T, SYMBOLS):
        raise ValueError(f"freqs must have shape ({T}, {SYMBOLS}), got {freqs.shape}")
    off = word_offsets.astype(np.int64)
    if off[0] != 0 or np.any(np.diff(off) < 0) or off[-1] != n_words or np.any(off % STREAM_ALIGN_WORDS):
        raise ValueError("word_offsets must start at 0, be non-decreasing multiples of 8 and end at len(words)")
    f = freqs.astype(np.int64)
    if np.any(f < 0) or np.any(f.sum(axis=-1) != PROB_SCALE):
        bad = int(np.nonzero((f < 0).any(-1) | (f.sum(-1) != PROB_SCALE))[0][0])
        raise ValueError(f"freqs of tile {bad} must be non-negative and sum to {PROB_SCALE}")
    if np.any(states.view(np.uint32) < STATE_LOW):
        bad = int(np.nonzero((states.view(np.uint32) < STATE_LOW).any(-1))[0][0])
        raise ValueError(f"states of tile {bad} must be at least {STATE_LOW}")


def decode(words, word_offsets, states, freqs, K: int, N: int, channels_per_tile: int) -> np.ndarray:
    """Inverse of :func:`encode`: codes ``[K, N]`` uint8. Raises ValueError naming the first tile whose
    stream is corrupted (a read past its end, a final state other than ``L``, or leftover words that
    are not zero padding)."""
    words = np.asarray(words).view(np.uint16)
    word_offsets, states, freqs = np.asarray(word_offsets), np.asarray(states), np.asarray(freqs)
    check_tables(word_offsets, states, freqs, K, N, channels_per_tile, len(words))
    C = int(channels_per_tile)
    T = -(-N // C)
    off = word_offsets.astype(np.int64)
    codes = np.zeros((K, N), dtype=np.uint8)
    steps_per_channel = K // LANES
    lane_below = np.tril(np.ones((LANES, LANES), dtype=np.int64), -1)  # [l, l']: l' < l
    for t0, tiles, channels in ((0, N // C, C), (N // C, 1 if N % C else 0, N % C)):
        if tiles == 0:
            continue
        f = freqs[t0 : t0 + tiles].astype(np.int64)
        cum = np.concatenate([np.zeros((tiles, 1), np.int64), np.cumsum(f, axis=-1)[:, :-1]], axis=-1)
        table = np.stack([np.repeat(np.arange(SYMBOLS), fi) for fi in f])  # [tiles, 4096]
        x = states[t0 : t0 + tiles].view(np.uint32).astype(np.int64)
        ptr = off[t0 : t0 + tiles].copy()
        end = off[t0 + 1 : t0 + tiles + 1]
        rows = np.arange(tiles)[:, None]
        out = np.zeros((tiles, channels * steps_per_channel, LANES), dtype=np.uint8)
        for step in range(channels * steps_per_channel):
            slot = x & (PROB_SCALE - 1)
            s = table[rows, slot]
            x = f[rows, s] * (x >> PROB_BITS) + slot - cum[rows, s]
            need = x < STATE_LOW
            idx = ptr[:, None] + need @ lane_below.T
            past = need & (idx >= end[:, None])
            if past.any():
                raise ValueError(f"rANS stream of tile {t0 + int(np.nonzero(past.any(-1))[0][0])} is corrupted "
                                 "(it reads past its end)")
            w = words[np.where(need, idx, 0)].astype(np.int64) if len(words) else np.zeros_like(x)
            x = np.where(need, (x << 16) | w, x)
            ptr += need.sum(axis=-1)
            out[:, step] = s
        for i in range(tiles):
            t = t0 + i
            if np.any(x[i] != STATE_LOW) or np.any(words[ptr[i] : end[i]] != 0) or end[i] - ptr[i] >= STREAM_ALIGN_WORDS:
                raise ValueError(f"rANS stream of tile {t} is corrupted (it does not end in the initial state)")
        # out [tiles, c * steps + j, l] -> code[32 j + l, (t0 + tile) * C + c]
        block = out.reshape(tiles, channels, steps_per_channel, LANES).transpose(2, 3, 0, 1)
        codes[:, t0 * C : t0 * C + tiles * channels] = block.reshape(K, tiles * channels)
    return codes


def order0_entropy(codes) -> float:
    """Order-0 entropy of the codes in bits per code (the whole array's histogram)."""
    counts = np.bincount(np.asarray(codes).reshape(-1).astype(np.int64), minlength=SYMBOLS).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def code_bits(n_words: int, tiles: int) -> int:
    """Bits stored for the codes: words (padding included), lane states, frequencies and offsets."""
    return 16 * n_words + 32 * LANES * tiles + 16 * SYMBOLS * tiles + 32 * (tiles + 1)
