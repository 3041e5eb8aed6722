#!/usr/bin/env python
"""How long patch_model takes to quantize a Llama-shaped model, per format and method.

  python scripts/dev/bench_quantize.py --device cuda                       # Llama-3-8B shape, rtn
  python scripts/dev/bench_quantize.py --device cuda --method gptq --layers 2
  python scripts/dev/bench_quantize.py --layers 1 --hidden 256 --intermediate 512   # CPU smoke run

The model is built from a config with random weights (fp16 on GPUs, fp32 on the CPU) directly on
the device; building it is not timed. Each format gets a fresh model. With ``--method gptq`` the
calibration batches are random token ids (the time depends on the shapes, not on the text), and
the time of the calibration forward passes is included. The last column scales the time to the
model's full depth when ``--layers`` is below ``--full-layers``.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch_marlin  # noqa: E402


def build(args, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--formats", nargs="+", default=["fp4", "u4", "trellis"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--method", choices=["rtn", "gptq"], default="rtn")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--full-layers", type=int, default=32, help="depth the last column scales to")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--calibration-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.float16

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"patch_model on {name}, method={args.method}, g{args.group_size}, {args.layers} of "
          f"{args.full_layers} layers, hidden {args.hidden}, intermediate {args.intermediate}")
    print(f"{'format':8} {'layers':>6} {'weights':>14} {'seconds':>9} {'Mweights/s':>11} "
          f"{'s at ' + str(args.full_layers) + ' layers':>16}", flush=True)
    for fmt in args.formats:
        model = build(args, device, dtype)
        n_weights = sum(m.weight.numel() for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
        calibration = None
        if args.method == "gptq":
            g = torch.Generator().manual_seed(1)
            calibration = [torch.randint(0, args.vocab, (1, args.seq_len), generator=g).to(device)
                           for _ in range(args.calibration_samples)]
        sync(device)
        t0 = time.perf_counter()
        report = torch_marlin.patch_model(model, format=fmt, group_size=args.group_size, method=args.method,
                                          calibration=calibration)
        sync(device)
        seconds = time.perf_counter() - t0
        print(f"{fmt:8} {len(report.replaced):6d} {n_weights:14,d} {seconds:9.1f} {n_weights / seconds / 1e6:11.1f} "
              f"{seconds * args.full_layers / args.layers:16.1f}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()



if __name__ == "__main__":
    main()
