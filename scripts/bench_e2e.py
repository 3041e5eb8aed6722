#!/usr/bin/env python
"""End-to-end greedy decoding speed of a Llama-shaped model: float against each quantized format.

  python scripts/bench_e2e.py                                  # CUDA: Llama-3-8B shape, 32 layers
  python scripts/bench_e2e.py --batch 1,4,16 --formats float,fp4,u4
  python scripts/bench_e2e.py --device cpu --layers 2 --hidden 256 --intermediate 512 --new-tokens 8

The model is transformers' LlamaForCausalLM built from a config with random weights (no download):
the speed of a decode step does not depend on the weights' values. For each format (``float``:
the model as built; the quantized formats: torch_marlin.patch_model, lm_head kept in float), batch
size and mode it prefills a random prompt and decodes --new-tokens tokens greedily over a static KV
cache (torch_marlin.generation.StaticDecoder), after one untimed warm-up generation. Modes:
``eager``; ``graph``: the decode step captured once as a CUDA graph and replayed (CUDA),
the decode step compiled (MPS), none on the CPU; ``compile``: the decode step compiled by
torch.compile (StaticDecoder(compile=True): inductor fuses the norms, rotary embeddings and
elementwise work around the quantized ops, which it calls as they are; the prompt runs eagerly),
on CUDA also captured as a CUDA graph; the same as ``graph`` on MPS; none on the CPU.
The default runs eager and graph; compile costs a compilation per model and batch size (about a
minute for the 32-layer shape).

``--profile`` prints, after each timed run, where one decode step's time goes (scripts/step_profile.py):
each linear layer's GEMM by layer and shape next to the same layer timed alone in this process,
the other kernels, and the idle time between kernels (the step's time minus its kernels' times).
On CUDA from the kernels' device times (torch.profiler); on the CPU from the outermost ops' CPU
times; on MPS the benchmark runs but is not broken down (torch.profiler has no MPS kernel times).

``no_linear`` is the float model with every linear layer of its decoder layers answering with
zeros without computing (a view of a buffer: no kernel): its step time is what the model spends
outside those layers (norms, rotary embeddings, attention over the cache, residual adds, the
embedding lookup and lm_head), the part no GEMM kernel can speed up.

Each row stands beside the weight-read floor: the bytes a decode step must read (every weight and
buffer the step uses, embeddings excluded but for the looked-up rows; the KV cache is left out) at
the read bandwidth measured in this process (a large device-to-device copy, counting the bytes read
and written). tok/s counts every sequence of the batch.
"""

import argparse
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing
sys.path.insert(0, HERE)

from step_profile import format_profile, profile_step  # noqa: E402  (scripts/step_profile.py)
from torch_marlin.generation import StaticDecoder  # noqa: E402
from torch_marlin.patching import patch_model, resolve_device  # noqa: E402
from torch_marlin.registry import LAYER_FORMATS  # noqa: E402

SHAPES = {  # defaults per device type: (layers, hidden, intermediate, heads, kv heads, vocab)
    "cuda": (32, 4096, 14336, 32, 8, 128256),  # Llama-3-8B
    "other": (16, 2048, 8192, 32, 8, 128256),  # Llama-3.2-1B
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def int_list(text):
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cuda, mps, cpu or auto (mps > cuda > cpu)")
    p.add_argument("--layers", type=int, help="decoder layers (default: 32 on CUDA, 16 elsewhere)")
    p.add_argument("--hidden", type=int, help="hidden size (default: 4096 on CUDA, 2048 elsewhere)")
    p.add_argument("--intermediate", type=int, help="MLP size (default: 14336 on CUDA, 8192 elsewhere)")
    p.add_argument("--heads", type=int, help="attention heads (default 32)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default 8)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default 128256)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--batch", type=int_list, default=[1], help="batch sizes, comma-separated")
    p.add_argument("--formats", default=",".join(("float",) + tuple(LAYER_FORMATS)),
                   help="comma-separated: float, no_linear and any of " + ", ".join(LAYER_FORMATS))
    p.add_argument("--modes", default="eager,graph", help="comma-separated: eager, graph, compile")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), help="activations (default: float16, float32 on the CPU)")
    p.add_argument("--fuse", action="store_true", help="quantized models with fused q/k/v and gate/up GEMMs")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantized models with lm_head quantized too (patch_model(quantize_lm_head=True))")
    p.add_argument("--profile", action="store_true",
                   help="after each timed run, one decode step's time by part (scripts/step_profile.py)")
    p.add_argument("--profile-steps", type=int, default=3, help="decode steps profiled per run (--profile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel ranks: the decode step on N ranks against one "
                   "rank, all-reduce time shown (torch_marlin/distributed/bench.py; docs/distributed.md)")
    return p


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.new_tokens,
                       tie_word_embeddings=False)


def build_model(config, dtype, device, seed):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialize in the target dtype, on the device: no fp32 copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


class SkippedLinear(nn.Module):
    """Stands in for an nn.Linear in the ``no_linear`` model: returns zeros of the output's shape as
    a view of a buffer kept for the largest row count seen, so no kernel runs for the layer."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.zeros = None

    def forward(self, x):
        rows = x.numel() // self.in_features
        if self.zeros is None or self.zeros.shape[0] < rows or self.zeros.device != x.device:
            self.zeros = torch.zeros(rows, self.out_features, dtype=x.dtype, device=x.device)
        return self.zeros[:rows].view(*x.shape[:-1], self.out_features)


def skip_linears(model: nn.Module):
    """Replaces every nn.Linear of the decoder layers with a SkippedLinear (the ``no_linear`` model)."""
    for layer in model.model.layers:
        for name, child in list(layer.named_modules()):
            if isinstance(child, nn.Linear):
                parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
                setattr(parent, name.rpartition(".")[2], SkippedLinear(child))
    return model


def step_bytes(model: nn.Module) -> int:
    """Bytes of weights and buffers one decode step reads (the input embedding table only when it
    is also the output projection)."""
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    weight = getattr(out, "weight", None)  # a quantized lm_head has none
    tied = isinstance(weight, torch.Tensor) and weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or (t is emb and not tied):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def read_bandwidth(device, reps=5) -> float:
    """Bytes per second of a large copy (bytes read + bytes written), best of ``reps``: 1 GiB on a
    GPU, 256 MiB on the CPU (both far past the last-level cache)."""
    n = ((1024 if device.type != "cpu" else 256) << 20) // 2
    src = torch.ones(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 2 / best


def format_unsupported(fmt, device, dtype, group_size):
    """None, or why ``fmt`` cannot run on ``device`` (a tiny layer of it is tried there)."""
    try:
        lin = nn.Linear(group_size, 16, bias=False, device=device, dtype=dtype)
        layer = LAYER_FORMATS[fmt].quantize(lin, group_size, dtype)
        with torch.inference_mode():
            layer(torch.zeros(1, group_size, device=device, dtype=dtype))
        return None
    except (NotImplementedError, RuntimeError) as e:  # no kernel for the device, or not in this build
        return str(e).splitlines()[0][:100]


def run_mode_of(mode, device):
    """What a --modes entry runs on this device (None: not offered there)."""
    if mode == "eager":
        return "eager"
    if mode == "graph":
        return {"cuda": "cuda_graph", "mps": "compile"}.get(device.type)
    return {"cuda": "compile_cuda_graph", "mps": "compile"}.get(device.type)


def time_generation(model, device, batch, prompt, new_tokens, mode, seed):
    """(prefill seconds, decode tokens per second, the decoder, its prompt) of one timed run after a
    warm-up run."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device,
                        generator=torch.Generator(device=device).manual_seed(seed))
    compiled = mode in ("compile", "compile_cuda_graph")
    if compiled:
        # Each run compiles its own decoder; the graphs of earlier runs (other models, batch sizes)
        # are dropped so they do not count against dynamo's recompile limit.
        torch._dynamo.reset()
    dec = StaticDecoder(model, batch, prompt + new_tokens, cuda_graph=mode in ("cuda_graph", "compile_cuda_graph"),
                        compile=compiled)
    dec.generate(ids, min(new_tokens, 3))  # warm-up: kernels, plans, the compilation, the graph capture
    sync(device)
    t0 = time.perf_counter()
    token = dec.prefill(ids)
    sync(device)
    t1 = time.perf_counter()
    for i in range(1, new_tokens):
        token = dec.step(token, prompt + i - 1)
    sync(device)
    t2 = time.perf_counter()
    return t1 - t0, batch * (new_tokens - 1) / (t2 - t1), dec, ids


def profile_run(model, dec, ids, steps, step_s, device, dtype):
    """One decode step's breakdown (scripts/step_profile.py) on the timed run's decoder."""
    prompt = ids.shape[1]
    token = dec.prefill(ids)
    position = [prompt]

    def step():
        dec.step(token, position[0])
        position[0] += 1

    steps = max(1, min(steps, (dec.max_length - prompt - 1) // 2))  # a warm-up pass, then the profiled one
    return profile_step(model, step, ids.shape[0], steps, step_s * 1e6, device, dtype)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.tp:
        from torch_marlin.distributed.bench import bench_tp
        return bench_tp(args, build_parser(), argv, build_model, llama_config, time_generation)
    device = resolve_device(args.device)
    shape = SHAPES["cuda" if device.type == "cuda" else "other"]
    for name, default in zip(("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"), shape):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.new_tokens < 2:
        build_parser().error("--new-tokens must be at least 2 (one prefill token, then decode steps)")
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "float16")]
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in ("float", "no_linear") and f not in LAYER_FORMATS]
    modes = [m for m in args.modes.split(",") if m]
    if bad or not formats or any(m not in ("eager", "graph", "compile") for m in modes) or not modes:
        build_parser().error(f"--formats takes float, no_linear and {', '.join(LAYER_FORMATS)}; "
                             "--modes eager, graph and compile")
    from tqdm.auto import tqdm

    config = llama_config(args)
    bandwidth = read_bandwidth(device)
    rows, notes, profiles = [], [], []
    runs = [(f, b, m) for f in formats for b in args.batch for m in modes]
    bar = tqdm(total=len(runs), desc="bench_e2e", unit="run")
    for fmt in formats:
        why = None if fmt in ("float", "no_linear") else format_unsupported(fmt, device, dtype, args.group_size)
        if why is not None:
            notes.append(f"{fmt}: not run on {device.type} ({why})")
            bar.update(len(args.batch) * len(modes))
            continue
        bar.set_postfix_str(f"building {fmt}")
        model = build_model(config, dtype, device, args.seed)
        if fmt == "no_linear":
            skip_linears(model)
        elif fmt != "float":
            patch_model(model, format=fmt, group_size=args.group_size, progress=False, fuse=args.fuse,
                        quantize_lm_head=args.quantize_lm_head)
        nbytes = step_bytes(model)
        label = str(dtype).replace("torch.", "") if fmt == "float" else fmt
        for batch in args.batch:
            for mode in modes:
                run_mode = run_mode_of(mode, device)
                bar.set_postfix_str(f"{fmt} batch {batch} {mode}")
                if run_mode is None:
                    notes.append(f"{mode}: no {mode} mode on {device.type}")
                else:
                    try:
                        prefill_s, tok_s, dec, ids = time_generation(model, device, batch, args.prompt,
                                                                     args.new_tokens, run_mode, args.seed)
                        floor = batch * bandwidth / nbytes
                        rows.append((label, run_mode, batch, prefill_s * 1e3, tok_s, floor, nbytes))
                        bar.write(f"{label} {run_mode} batch {batch}: prefill {prefill_s * 1e3:.1f} ms, "
                                  f"{tok_s:.1f} tok/s (floor {floor:.1f})")
                    except Exception as e:  # a mode that fails on this backend is a result too
                        notes.append(f"{fmt} batch {batch} {run_mode}: failed ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:120]})")
                        dec = None
                    if dec is not None and args.profile:
                        what = f"{label}{' fused' if args.fuse and fmt in LAYER_FORMATS else ''} {run_mode} batch {batch}"
                        if device.type not in ("cuda", "cpu"):
                            notes.append(f"--profile: no kernel times on {device.type} (timed, not broken down)")
                        else:
                            try:
                                prof = profile_run(model, dec, ids, args.profile_steps, batch / tok_s, device, dtype)
                                profiles.append(format_profile(what, prof))
                                bar.write(profiles[-1])
                            except Exception as e:
                                notes.append(f"--profile {what}: failed ({type(e).__name__}: "
                                             f"{str(e).splitlines()[0][:120]})")
                    dec = None
                bar.update(1)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"\n{name}, {dtype}, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, prompt {args.prompt}, {args.new_tokens} new "
          f"tokens, group size {args.group_size}{', fused projections' if args.fuse else ''}"
          f"{', lm_head quantized' if args.quantize_lm_head else ''}; read bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s")
    head = f"| {'format':<8} | {'mode':<10} | {'batch':>5} | {'prefill ms':>10} | {'decode tok/s':>12} | " \
           f"{'floor tok/s':>11} | {'of floor':>8} | {'MiB/step':>8} |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for fmt, mode, batch, prefill_ms, tok_s, floor, nbytes in rows:
        print(f"| {fmt:<8} | {mode:<10} | {batch:>5} | {prefill_ms:>10.1f} | {tok_s:>12.1f} | {floor:>11.1f} | "
              f"{tok_s / floor:>7.1%} | {nbytes / 2**20:>8.1f} |")
    for note in dict.fromkeys(notes):
        print(f"note: {note}")
    for text in profiles:
        print(text)
    return rows


if __name__ == "__main__":
    main()
