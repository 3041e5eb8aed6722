"""Quantizes a small stack of Linear layers (a Llama-style MLP block repeated) to FP4 and INT4
with torch_marlin and prints accuracy and speed against the float stack run with torch.matmul.

    python scripts/quantize_demo.py                 # defaults: hidden 1024, 4 blocks, CPU
    python scripts/quantize_demo.py --device cuda --hidden 4096
"""

import argparse
import time

import torch
from torch import nn

from patch_hf_model import positive_int  # scripts/patch_hf_model.py
from torch_marlin import MarlinLinear


class MLPBlock(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def quantize(model: nn.Module, fmt: str, group_size: int, dtype: torch.dtype) -> nn.Module:
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, MarlinLinear.from_linear(child, format=fmt, group_size=group_size, dtype=dtype))
        else:
            quantize(child, fmt, group_size, dtype)
    return model


def timed(fn, device, reps=10):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=positive_int, default=1024,
                    help="hidden size (a multiple of --group-size)")
    ap.add_argument("--blocks", type=positive_int, default=4, help="MLP blocks in the stack")
    ap.add_argument("--group-size", type=positive_int, default=128,
                    help="quantization group size (a multiple of 8 dividing --hidden and the intermediate size)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"])
    args = ap.parse_args(argv)
    # The intermediate size: 8/3 of hidden (Llama's ratio), rounded up to a multiple of 128.
    inter = (args.hidden * 8 // 3 + 127) // 128 * 128
    if args.group_size % 8 or args.hidden % args.group_size or inter % args.group_size:
        ap.error(f"--group-size {args.group_size} must be a multiple of 8 dividing --hidden {args.hidden} and "
                 f"the intermediate size {inter} (e.g. --hidden 1024 --group-size 128)")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "float16"))
    torch.manual_seed(0)

    ref = nn.Sequential(*[MLPBlock(args.hidden, inter) for _ in range(args.blocks)])
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.02)
    ref = ref.to(device=device, dtype=dtype).eval()
    print(f"{args.blocks} MLP blocks, hidden {args.hidden}, intermediate {inter}, {dtype}, {device}, "
          f"group {args.group_size}")
    print(f"| model | weight MB | rel. error vs float | M=1 ms | M=1 speedup | M=64 ms | M=64 speedup |")
    print("|---|---|---|---|---|---|---|")
    xs = {M: torch.randn(M, args.hidden, device=device, dtype=dtype) for M in (1, 64)}
    with torch.no_grad():
        y_ref = ref(xs[64]).float()
        t_ref = {M: timed(lambda: ref(x), device) for M, x in xs.items()}
        mb = sum(p.numel() * p.element_size() for p in ref.parameters()) / 2**20
        print(f"| float (torch.matmul) | {mb:.1f} | 0 | {t_ref[1] * 1e3:.2f} | 1.00x | {t_ref[64] * 1e3:.2f} | 1.00x |")
        for fmt in ("fp4", "u4"):
            import copy
            q = quantize(copy.deepcopy(ref).float().cpu(), fmt, args.group_size, dtype).to(device)
            y = q(xs[64]).float()
            rel = ((y - y_ref).norm() / y_ref.norm()).item()
            t = {M: timed(lambda: q(x), device) for M, x in xs.items()}
            mb = sum(b.numel() * b.element_size() for b in q.buffers()) / 2**20
            print(f"| torch_marlin {fmt} g{args.group_size} | {mb:.1f} | {rel:.4f} | {t[1] * 1e3:.2f} | "
                  f"{t_ref[1] / t[1]:.2f}x | {t[64] * 1e3:.2f} | {t_ref[64] / t[64]:.2f}x |")


if __name__ == "__main__":
    main()
