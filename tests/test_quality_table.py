"""The reference schemes of scripts/quality_table.py (MLX affine, GGUF Q4_0 / Q4_K, NVFP4) on
synthetic weights: values on each format's grid, bits per weight as the formats define them."""

import os
import sys

import pytest
import torch

from optional_packages import require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


@pytest.fixture(scope="module")
def qt():
    require("transformers")
    import quality_table
    return quality_table


def weights(out_f=48, in_f=512, seed=0):
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.03


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_nvfp4_grid_and_bits(qt):
    from torch_marlin.formats.fp4 import E2M1_VALUES
    w = weights()
    deq, bpw = qt.nvfp4(w)
    assert bpw == pytest.approx(4.5 + 32 / w.numel())
    # Per block of 16: every value is an E2M1 level times one block scale; the block's largest
    # magnitude maps near the top level 6.
    blocks = deq.reshape(-1, 16)
    s = blocks.abs().amax(1, keepdim=True) / 6
    levels = (blocks / torch.where(s > 0, s, torch.ones_like(s))).abs()
    assert torch.allclose(levels, E2M1_VALUES[:8][torch.bucketize(levels, (E2M1_VALUES[1:8] + E2M1_VALUES[:7]) / 2)],
                          atol=1e-4)
    assert rel(deq, w) < 0.12


def test_q4_k_is_4_5_bits_and_close(qt):
    w = weights()
    deq, bpw = qt.q4_k(w)
    assert bpw == pytest.approx(4.5)
    # Every 32-weight sub-block holds at most 16 distinct values (scale * q - min, q in 0..15).
    assert max(len(torch.unique(b)) for b in deq.reshape(-1, 32)) <= 16
    assert rel(deq, w) < 0.12
    padded, bpw_pad = qt.q4_k(weights(in_f=384))
    assert padded.shape == (48, 384) and bpw_pad == pytest.approx(4.5 * 512 / 384)


def test_q4_0_matches_gguf_dequantize(qt):
    require("gguf")
    w = weights()
    deq, bpw = qt.gguf_q4_0(w)
    assert bpw == 4.5 and deq.shape == w.shape
    assert max(len(torch.unique(b)) for b in deq.reshape(-1, 32)) <= 16 and rel(deq, w) < 0.15


def test_mlx_affine(qt):
    require("mlx")
    w = weights()
    for bits, bound in ((4, 0.12), (3, 0.25)):
        deq, bpw = qt.mlx_affine(w, bits)
        assert bpw == bits + 0.5
        assert max(len(torch.unique(b)) for b in deq.reshape(-1, 64)) <= 2 ** bits and rel(deq, w) < bound
