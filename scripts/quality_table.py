#!/usr/bin/env python
"""Quantization quality table: our formats (round to nearest and calibrated) beside MLX, GGUF and
NVFP4, on the same model and the same evaluation texts, in one run.

  python scripts/quality_table.py                      # MiniLM, every row (minutes on 2 cores)
  python scripts/quality_table.py --rows "fp4 g128" "u4 g128 gptq" mlx4 q4_0
  python scripts/quality_table.py --model smollm2      # group size 64 (576 = 9 * 64)

Metric: MiniLM (encoder): cosine of the sentence embeddings vs the float model over
scripts/data/sentences.txt, mean / min. SmolLM2 (causal LM): perplexity on
scripts/data/smollm2_eval.txt and top-1 next-token agreement with the float model.
Calibrated rows use the first --calibration-samples lines of scripts/data/calibration.txt, none of
which are evaluation texts.

Bits per weight, counted the same way for every row: every stored bit of the quantized weights
(codes, scales, zeros / minimums, codebooks, sign vectors; not biases) over all the quantized
layers, divided by their number of weights. Ours are counted from the buffers as stored (scales
in fp16; trellis scales, codebook and signs in fp32; u4 zero points one byte each); the others
from their formats' definitions:

* MLX affine (``mx.quantize``, mlx[cpu]): codes + fp16 scale and bias per group of 64;
* GGUF Q4_0 (gguf-py's quantizer): 18 bytes per 32 weights; Q4_K: 144 bytes per 256 weights.
  gguf-py quantizes Q4_0 but only dequantizes Q4_K, so Q4_K here is llama.cpp's reference
  algorithm (quantize_row_q4_K_ref: per 32 weights a scale and a minimum fitted by the k-quants
  search, both coded in 6 bits against fp16 super-block factors) written in torch. Rows whose
  length is not a multiple of 256 are zero-padded to one (padding counted in the bits);
* NVFP4: E2M1 codes, an FP8 E4M3 scale per 16 weights, an fp32 scale per tensor.

Every layer is quantized the way patch_model does it (the same Linear layers, lm_head kept in
float); the reference formats replace each weight by its dequantized values.
"""

import argparse
import copy
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch_marlin  # noqa: E402
import evaluation  # noqa: E402  (scripts/evaluation.py)
from torch_marlin.formats.u4 import ZeroPointQuantizer  # noqa: E402

OURS = {  # name -> (format, options)
    "fp4": ("fp4", {}), "u4": ("u4", {}), "u4 sym": ("u4", {"symmetric": True}), "affine": ("affine", {}),
    "trellis4": ("trellis", {"bits": 4}), "trellis3": ("trellis", {"bits": 3}), "trellis2": ("trellis", {"bits": 2}),
}
REFS = ("mlx4", "mlx3", "q4_0", "q4_k", "nvfp4")


def default_rows(g):
    rows = []
    for name in ("fp4", "u4", "affine", "u4 sym", "trellis4", "trellis3", "trellis2"):
        sizes = (g, g // 2) if name in ("fp4", "u4", "affine") and g >= 128 else (g,)
        for gs in sizes:
            rows += [f"{name} g{gs}", f"{name} g{gs} gptq"]
    return rows + list(REFS)


# ---- reference formats (dequantized weights, and bits per weight) ---------------------------------

def mlx_affine(w: torch.Tensor, bits: int, group: int = 64):
    import mlx.core as mx
    import numpy as np
    a = mx.array(w.float().cpu().numpy())
    q, s, b = mx.quantize(a, group_size=group, bits=bits)
    d = mx.dequantize(q, s, b, group_size=group, bits=bits)
    return torch.from_numpy(np.array(d, dtype=np.float32)), bits + 32 / group


def gguf_q4_0(w: torch.Tensor):
    import gguf
    from gguf.quants import dequantize, quantize
    t = gguf.GGMLQuantizationType.Q4_0
    d = dequantize(quantize(w.float().cpu().numpy(), t), t)
    return torch.from_numpy(d.copy()).reshape(w.shape), 18 * 8 / 32


def q4_k(w: torch.Tensor):
    """llama.cpp quantize_row_q4_K_ref, dequantized: 256-weight super-blocks of 8 x 32."""
    out_f, in_f = w.shape
    pad = (-in_f) % 256
    x = torch.nn.functional.pad(w.float(), (0, pad)).reshape(-1, 8, 32)  # [blocks, 8, 32]
    # Per 32 weights: scale and minimum (w ~ scale * q - min, q in 0..15) by the k-quants search.
    fit = ZeroPointQuantizer(torch.float32).fit(x.reshape(-1, 32, 1))
    scale = fit["scales"].reshape(-1, 8)
    mn = (fit["zeros"] * fit["scales"]).reshape(-1, 8)  # = -offset >= 0
    # Six-bit codes for the 8 scales and 8 minimums against fp16 super-block factors.
    d = (scale.amax(1) / 63).half().float()
    dmin = (mn.amax(1) / 63).half().float()
    ls = torch.round(scale / torch.where(d > 0, d, torch.ones_like(d))[:, None]).clamp(0, 63)
    lm = torch.round(mn / torch.where(dmin > 0, dmin, torch.ones_like(dmin))[:, None]).clamp(0, 63)
    s_q, m_q = (d[:, None] * ls)[..., None], (dmin[:, None] * lm)[..., None]
    q = torch.round((x + m_q) / torch.where(s_q > 0, s_q, torch.ones_like(s_q))).clamp(0, 15)
    deq = (s_q * q - m_q).reshape(out_f, in_f + pad)[:, :in_f]
    return deq, 144 * 8 / 256 * (in_f + pad) / in_f


def nvfp4(w: torch.Tensor):
    """NVFP4: E2M1 values, E4M3 scale per 16 weights along K, one fp32 scale per tensor."""
    from torch_marlin.formats.fp4 import E2M1_VALUES
    x = w.float().reshape(w.shape[0], -1, 16)
    g = float(w.abs().max()) / (6 * 448) or 1.0
    s = (x.abs().amax(-1) / 6 / g).to(torch.float8_e4m3fn).float() * g
    sd = torch.where(s > 0, s, torch.ones_like(s))[..., None]
    mags = E2M1_VALUES[:8].to(x.device)
    code = torch.bucketize((x / sd).abs().contiguous(), (mags[1:] + mags[:-1]) / 2)
    deq = torch.sign(x) * mags[code] * s[..., None]
    return deq.reshape(w.shape), 4 + 8 / 16 + 32 / w.numel()


def apply_reference(model, name, skip):
    """Replaces every quantizable Linear weight by its ``name``-format dequantized values; bits/weight."""
    bits = n = 0
    for mname, mod in model.named_modules():
        if type(mod) is not nn.Linear or any(mname == s or mname.endswith("." + s) for s in skip):
            continue
        w = mod.weight.detach()
        if name.startswith("mlx"):
            deq, b = mlx_affine(w, int(name[3:]))
        elif name == "q4_0":
            deq, b = gguf_q4_0(w)
        elif name == "q4_k":
            deq, b = q4_k(w)
        else:
            deq, b = nvfp4(w)
        with torch.no_grad():
            mod.weight.copy_(deq.to(w.dtype))
        bits += b * w.numel()
        n += w.numel()
    return bits / n


def stored_bits(model):
    bits = n = 0
    for mod in model.modules():
        if torch_marlin.registry.layer_format_of(mod) is not None:
            bits += sum(t.numel() * t.element_size() * 8 for name, t in mod.named_buffers(recurse=False)
                        if name != "bias")
            n += mod.in_features * mod.out_features
    return bits / n


# ---- evaluation ---------------------------------------------------------------------------------

class Evaluator:
    def __init__(self, model, tok, kind):
        self.model, self.tok, self.kind = model, tok, kind
        if kind == evaluation.ENCODER:
            self.sentences = evaluation.read_lines(os.path.join(HERE, "data", "sentences.txt"))
            self.ref = evaluation.sentence_embeddings(model, tok, self.sentences)
        else:
            with open(os.path.join(HERE, "data", "smollm2_eval.txt")) as f:
                self.text = f.read().strip()
            self.ids, self.ref = evaluation.causal_lm_logits(model, tok, self.text)

    def header(self):
        if self.kind == evaluation.ENCODER:
            return f"cosine mean / min ({len(self.sentences)} sentences)"
        return f"perplexity / top-1 agreement ({self.ids.numel()} tokens; float {self.float_metric()})"

    def float_metric(self):
        return f"{evaluation.perplexity(self.ids, self.ref):.2f}"

    def __call__(self, m):
        if self.kind == evaluation.ENCODER:
            cos = (evaluation.sentence_embeddings(m, self.tok, self.sentences) * self.ref).sum(-1)
            return f"{cos.mean():.4f} / {cos.min():.4f}"
        _, lq = evaluation.causal_lm_logits(m, self.tok, self.text)
        agree = (lq.argmax(-1) == self.ref.argmax(-1)).float().mean()
        return f"{evaluation.perplexity(self.ids, lq):.2f} / {agree * 100:.1f}%"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm", help="'minilm' (default), 'smollm2', or a local HF dir / .gguf file")
    p.add_argument("--group-size", type=int, default=None, help="our formats' largest group size (default 128; "
                                                                 "64 for smollm2)")
    p.add_argument("--rows", nargs="*", default=None,
                   help="rows to run, e.g. 'fp4 g128' 'u4 g64 gptq' 'u4 sym g128' 'trellis3 g128 gptq' mlx4 mlx3 "
                        "q4_0 q4_k nvfp4 (default: all)")
    p.add_argument("--calibration", default=os.path.join(HERE, "data", "calibration.txt"),
                   help="calibration text, one sample per line (default scripts/data/calibration.txt)")
    p.add_argument("--calibration-samples", type=int, default=128)
    p.add_argument("--skip", nargs="*", default=["lm_head"], help="Linear layers kept in float (default lm_head)")
    p.add_argument("--device", default="cpu",
                   help="where the models run and ours are quantized and calibrated (cpu, cuda, mps; the "
                        "reference formats are computed with their tools on the CPU)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    aliases = {"minilm": evaluation.minilm_path, "smollm2": evaluation.smollm2_gguf_path}
    path = aliases[args.model]() if args.model in aliases else args.model
    fm, tok, kind = evaluation.load_hf_model(path)
    fm.to(args.device)
    g = args.group_size or (64 if args.model == "smollm2" else 128)
    rows = args.rows or default_rows(g)
    ev = Evaluator(fm, tok, kind)
    lines = evaluation.read_lines(args.calibration)[:args.calibration_samples]
    calib = evaluation.calibration_batches(tok, lines)

    from tqdm.auto import tqdm
    results = []
    for row in tqdm(rows, desc="quality table", unit="row"):
        m = copy.deepcopy(fm)
        t0 = time.perf_counter()
        if row in REFS:
            bpw = apply_reference(m, row, args.skip)
        else:
            parts = row.split()
            gptq = parts[-1] == "gptq"
            parts = parts[:-1] if gptq else parts
            name, gs = " ".join(parts[:-1]), parts[-1]
            if name not in OURS or not gs.startswith("g"):
                raise SystemExit(f"unknown row {row!r}: expected '<{'|'.join(OURS)}> g<size> [gptq]' or one of {REFS}")
            fmt, opts = OURS[name]
            torch_marlin.patch_model(m, format=fmt, group_size=int(gs[1:]), skip=args.skip, dtype=torch.float16,
                                     progress=False, method="gptq" if gptq else "rtn",
                                     calibration=calib if gptq else None, **opts)
            bpw = stored_bits(m)
        seconds = time.perf_counter() - t0
        results.append((row, f"{bpw:.3f}", ev(m), f"{seconds:.1f}"))
        tqdm.write(" | ".join(results[-1]))  # each row as it finishes: a long run shows its progress
        del m

    print(f"\nmodel: {path}")
    where = torch.cuda.get_device_name() if fm.device.type == "cuda" else fm.device.type
    print(f"calibrated rows: {len(lines)} samples of {os.path.relpath(args.calibration)}; torch {torch.__version__}, "
          f"on {where}, {torch.get_num_threads()} CPU threads\n")
    header = ("scheme", "bits/weight", ev.header(), "quantize s")
    widths = [max(len(str(r[i])) for r in [header] + results) for i in range(4)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in results:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()
