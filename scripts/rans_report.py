"""How many bits the rANS coding stores per 4-bit code, beside the codes' order-0 entropy.

  python scripts/rans_report.py                                  # MiniLM, Gaussian and Student-t layers
  python scripts/rans_report.py --models smollm2 --device cuda   # quantize on a GPU (encoding runs on the CPU)
  python scripts/rans_report.py --models minilm --per-layer

For every model and every scheme (fp4, u4 asymmetric, u4 symmetric at each group size) each
``nn.Linear`` is quantized the way ``patch_model`` does it (round to nearest, lm_head kept) and
coded with ``RansLinear.from_marlin``. Printed per scheme, over all of a model's coded layers
weighted by their weights:

* ``entropy``: the order-0 entropy of each layer's codes (its 16-bin histogram), in bits per code;
* ``coded``: ``RansLinear.code_bits_per_weight()``: streams with padding, lane states, frequency
  tables and offsets, everything stored for the codes;
* ``overhead``: coded minus entropy; ``saved``: the fraction of the 4-bit codes' bytes saved.

Scales, zero points and biases are stored as they are and counted in none of these columns.
``--per-layer`` adds one row per layer. Synthetic layers (``gaussian``, ``student-t`` with 4 degrees
of freedom) are 4096 x 4096 with a fixed seed.
"""

import argparse
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch_marlin  # noqa: E402
import evaluation  # noqa: E402  (scripts/evaluation.py)
from torch_marlin.formats import int4_packing, rans as rans_format  # noqa: E402

SCHEMES = {"fp4": ("fp4", {}), "u4": ("u4", {}), "u4 sym": ("u4", {"symmetric": True})}
MODELS = ("minilm", "smollm2", "gaussian", "student-t")


def model_layers(name: str):
    """``(layer name, nn.Linear)`` pairs of a model, lm_head excluded."""
    if name in ("gaussian", "student-t"):
        gen = torch.Generator().manual_seed(0)
        if name == "gaussian":
            w = torch.randn(4096, 4096, generator=gen)
        else:
            w = torch.distributions.StudentT(4.0).sample((4096, 4096))
        lin = nn.Linear(4096, 4096, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        return [(name, lin)]
    path = evaluation.minilm_path() if name == "minilm" else evaluation.smollm2_gguf_path()
    model, _, _ = evaluation.load_hf_model(path)
    return [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and not n.endswith("lm_head")]


def measure(layers, scheme: str, group_size: int, device: torch.device):
    """Rows ``(layer, weights, entropy, coded bits)`` for every layer this group size fits."""
    fmt, opts = SCHEMES[scheme]
    rows = []
    for name, lin in layers:
        if lin.in_features % group_size or lin.in_features % rans_format.LANES:
            continue
        q = torch_marlin.MarlinLinear.from_linear(lin.to(device), format=fmt, group_size=group_size,
                                                  dtype=torch.float16, **opts).cpu()
        coded = torch_marlin.RansLinear.from_marlin(q)
        codes = int4_packing.unpack_int4(q.B_packed).numpy()
        rows.append((name, codes.size, rans_format.order0_entropy(codes), coded.code_bits_per_weight()))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", nargs="+", default=["minilm", "gaussian", "student-t"], choices=MODELS)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--group-sizes", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--device", default="cpu", help="where the quantizer runs (encoding is on the CPU)")
    p.add_argument("--per-layer", action="store_true", help="one row per layer as well")
    args = p.parse_args(argv)
    for g in args.group_sizes:
        if g <= 0 or g % rans_format.LANES:
            p.error(f"--group-sizes: coded layers need multiples of {rans_format.LANES}, got {g}")
    device = torch.device(args.device)
    print(f"torch_marlin {torch_marlin.__version__}, torch {torch.__version__}, quantizing on {device}")
    header = f"| {'model':<9} | {'scheme':<14} | layers | entropy | coded | overhead | saved |"
    for model in args.models:
        layers = model_layers(model)
        print(f"\n{model}: {len(layers)} layers, {sum(l.weight.numel() for _, l in layers) / 1e6:.1f}M weights")
        print(header)
        print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
        per_layer = []
        for scheme in args.schemes:
            for g in args.group_sizes:
                t0 = time.perf_counter()
                rows = measure(layers, scheme, g, device)
                if not rows:
                    print(f"| {model:<9} | {scheme + ' g' + str(g):<14} | none: group size does not divide in_features |")
                    continue
                n = sum(r[1] for r in rows)
                ent = sum(r[1] * r[2] for r in rows) / n
                bits = sum(r[1] * r[3] for r in rows) / n
                print(f"| {model:<9} | {scheme + ' g' + str(g):<14} | {len(rows):>6} | {ent:7.3f} | {bits:5.3f} | "
                      f"{bits - ent:8.3f} | {1 - bits / 4:5.1%} |   ({time.perf_counter() - t0:.0f} s)", flush=True)
                per_layer += [(scheme + " g" + str(g),) + r for r in rows]
        if args.per_layer:
            print(f"\n| scheme | layer | entropy | coded | overhead |\n|---|---|---|---|---|")
            for scheme, name, _, ent, bits in per_layer:
                print(f"| {scheme} | {name} | {ent:.3f} | {bits:.3f} | {bits - ent:.3f} |")


if __name__ == "__main__":
    main()
