"""``scripts/bench_e2e.py --tp N``: the decode step of a Llama-shaped model on N tensor-parallel ranks
against the same model on one rank (rank 0 alone, same session), with the all-reduce time per step.

Launched through ``torchrun --nproc-per-node N`` or spawning its own N ranks (a free port on
127.0.0.1); NCCL on CUDA (one GPU per rank), gloo on the CPU. Every rank builds the same model
(same seed), then shards it with the model's own plan (:func:`torch_marlin.distributed.parallelize`).
Quantized layers hold random codes and scales: a decode step's speed does not depend on their
values, and a 70B-shaped slice is built in seconds instead of quantized for minutes.

The all-reduce column is the time of the step's collectives alone: ``2 x layers`` all-reduces of
one decode step's ``[batch, hidden]`` activations (attention and MLP outputs), timed back to back on
the same ranks right after the decode runs.
"""

import copy
import os
import socket
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

# (hidden, intermediate, heads, kv heads, vocab): a slice of Llama-3-70B, on CUDA; a small shape elsewhere.
SHAPE_70B = (8192, 28672, 64, 8, 128256)
SHAPE_SMALL = (1024, 2816, 16, 8, 32000)
MAX_LAYERS = 80
MEMORY_SHARE = 0.55  # of one GPU for the float16 model on one rank (the largest), the rest for the cache and the run


def random_quantized_layer(fmt: str, linear: nn.Linear, group_size: int, generator: torch.Generator) -> nn.Module:
    """A quantized layer of ``linear``'s shape with random codes and small random scales, on its device."""
    from .. import MarlinLinear, TrellisLinear
    from ..formats import trellis as trellis_fmt

    K, N, device = linear.in_features, linear.out_features, linear.weight.device
    dtype = linear.weight.dtype

    def rand(shape, dtype=torch.float32, high=None):
        if high is None:
            return torch.rand(shape, generator=generator).to(device=device, dtype=dtype)
        return torch.randint(0, high, shape, generator=generator).to(device=device, dtype=dtype)

    if fmt == "trellis":
        layer = TrellisLinear(K, N, bits=3, group_size=group_size, bias=linear.bias is not None, dtype=dtype,
                              device=device)
        layer.packed_indices.copy_(rand(layer.packed_indices.shape, torch.uint8, 256))
        layer.scales.copy_(rand(layer.scales.shape) * 0.02 + 0.01)
        layer.grid.copy_(torch.linspace(-2, 2, 8, device=device))
        layer.su.copy_(trellis_fmt.random_signs(K, generator).to(device))
        layer.sv.copy_(trellis_fmt.random_signs(N, generator).to(device))
        layer.use_device_layout()
    else:
        layer = MarlinLinear(K, N, bias=linear.bias is not None, format=fmt, group_size=group_size, dtype=dtype,
                             device=device)
        layer.B_packed.copy_(torch.randint(-2**31, 2**31 - 1, layer.B_packed.shape, generator=generator,
                                           dtype=torch.int32).to(device))
        layer.scales.copy_(rand(layer.scales.shape, dtype) * 0.004 + 0.002)
        if fmt == "u4":
            layer.zeros.copy_(rand(layer.zeros.shape, torch.uint8, 16))
        if fmt == "affine":
            layer.offsets.copy_((rand(layer.offsets.shape) - 0.5).to(dtype) * 0.02)
    if linear.bias is not None:
        layer.bias.copy_(linear.bias.detach())
    return layer


def randomize_linears(model: nn.Module, fmt: str, group_size: int, seed: int) -> nn.Module:
    """Replaces every decoder-layer ``nn.Linear`` by a random ``fmt`` layer, one at a time (the float
    weight freed as its replacement is made)."""
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for name, child in list(layer.named_modules()):
            if type(child) is nn.Linear:
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, attr,
                        random_quantized_layer(fmt, child, group_size, generator))
    return model


def default_layers(device: torch.device, hidden: int, intermediate: int, heads: int, kv_heads: int) -> int:
    """As many decoder layers as fit a float16 model on one rank (the one-rank baseline's largest)."""
    if device.type != "cuda":
        return 4
    head_dim = hidden // heads
    per_layer = 2 * (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate)
    total = torch.cuda.get_device_properties(device).total_memory
    return max(1, min(MAX_LAYERS, int(MEMORY_SHARE * total) // per_layer))


def allreduce_ms(shape, dtype, device, count: int, reps: int = 5) -> float:
    """Milliseconds of ``count`` back-to-back all-reduces of ``shape`` (best of ``reps``)."""
    x = torch.ones(shape, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(x)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_tp(args, parser, argv, build_model: Callable, llama_config: Callable, time_generation: Callable
             ) -> Optional[list]:
    """Runs the comparison on ``args.tp`` ranks (bench_e2e's arguments, parser and command line; its
    model builder, config and timing are passed in). Without ``--formats`` / ``--batch`` on the
    command line: float and fp4, batch 1 and 16. Returns rank 0's rows: (format, mode, batch, ranks,
    step ms, tok/s, all-reduce ms per step)."""
    if args.tp < 2:
        parser.error(f"--tp needs at least 2 ranks, got {args.tp}")
    given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}
    if "--formats" not in given:
        args.formats = "float,fp4"
    if "--batch" not in given:
        args.batch = [1, 16]
    bad = [f for f in args.formats.split(",") if f not in ("float", "fp4", "u4", "affine", "trellis")]
    if bad:
        parser.error(f"--tp runs float and the quantized formats, not {bad}")
    if "WORLD_SIZE" in os.environ:  # torchrun
        if int(os.environ["WORLD_SIZE"]) != args.tp:
            raise ValueError(f"--tp {args.tp} but torchrun started {os.environ['WORLD_SIZE']} ranks")
        return _rank_main(int(os.environ["RANK"]), args, build_model, llama_config, time_generation)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_spawned, args=(rank, port, args, build_model, llama_config, time_generation, results))
             for rank in range(args.tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"bench --tp: a rank failed (exit codes {[p.exitcode for p in procs]})")
    return results.get()


def _spawned(rank, port, args, build_model, llama_config, time_generation, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.tp), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    rows = _rank_main(rank, args, build_model, llama_config, time_generation)
    if rank == 0:
        results.put(rows)


def _rank_main(rank, args, build_model, llama_config, time_generation) -> Optional[List[tuple]]:
    from ..fusion import fuse_projections
    from ..patching import resolve_device
    from . import auto_plan, parallelize
    from .loading import init_tp_mesh, local_device

    wanted = resolve_device(args.device)
    if wanted.type not in ("cuda", "cpu"):
        raise ValueError(f"--tp runs on CUDA (NCCL) or the CPU (gloo), not {wanted.type}")
    owns_group = not dist.is_initialized()
    mesh = init_tp_mesh(wanted)
    device = local_device(mesh)
    world = mesh.size()
    shape = SHAPE_70B if device.type == "cuda" else SHAPE_SMALL
    for name, default in zip(("hidden", "intermediate", "heads", "kv_heads", "vocab"), shape):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.layers is None:
        args.layers = default_layers(device, args.hidden, args.intermediate, args.heads, args.kv_heads)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[
        args.dtype or ("float32" if device.type == "cpu" else "float16")]
    formats = [f for f in args.formats.split(",") if f]
    modes = [m for m in args.modes.split(",") if m in ("eager", "graph")]
    run_modes = [{"eager": "eager", "graph": "cuda_graph"}[m] for m in modes if m == "eager" or device.type == "cuda"]
    config = llama_config(args)
    rows = []

    def build(fmt):  # a config per model: sharding makes its head counts per rank
        model = build_model(copy.deepcopy(config), dtype, device, args.seed)
        return model if fmt == "float" else randomize_linears(model, fmt, args.group_size, args.seed)

    def build_one_rank(fmt):
        model = build(fmt)
        if args.fuse and fmt != "float":
            fuse_projections(model)
        return model

    def measure(model, fmt, ranks):
        for batch in args.batch:
            for mode in run_modes:
                tok_s = time_generation(model, device, batch, args.prompt, args.new_tokens, mode, args.seed)[1]
                comm = allreduce_ms((batch, args.hidden), dtype, device, 2 * args.layers) if ranks > 1 else 0.0
                label = str(dtype).replace("torch.", "") if fmt == "float" else fmt
                rows.append((label, mode, batch, ranks, batch / tok_s * 1e3, tok_s, comm))
                if rank == 0:
                    print(f"{label} {mode} batch {batch} ranks {ranks}: {batch / tok_s * 1e3:.2f} ms/step"
                          f"{f', all-reduce {comm:.2f} ms' if ranks > 1 else ''}", flush=True)

    for fmt in formats:
        if rank == 0:  # the one-rank baseline: rank 0 alone, the others wait
            model = build_one_rank(fmt)
            measure(model, fmt, 1)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
        model = build(fmt)
        model = parallelize(model, mesh, auto_plan(model, local_float=True))  # float16 rows without DTensor calls
        if args.fuse and fmt != "float":  # each rank fuses its shards of q/k/v and gate/up
            fuse_projections(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        measure(model, fmt, world)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()
    if rank != 0:
        return None
    _print_table(rows, args, device, dtype, world)
    return rows


def _print_table(rows, args, device, dtype, world):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (gloo)"
    print(f"\n{world} x {name}, {dtype}, {args.layers} layers, hidden {args.hidden}, intermediate "
          f"{args.intermediate}, heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, group size {args.group_size}")
    head = (f"| {'format':<8} | {'mode':<10} | {'batch':>5} | {'ranks':>5} | {'ms/step':>8} | {'tok/s':>9} | "
            f"{'vs 1 rank':>9} | {'all-reduce ms':>13} | {'all-reduce %':>12} |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    one = {(f, m, b): ms for f, m, b, r, ms, _, _ in rows if r == 1}
    for fmt, mode, batch, ranks, ms, tok_s, comm in rows:
        base = one.get((fmt, mode, batch))
        speedup = f"{base / ms:.2f}x" if base else "-"
        share = f"{comm / ms:.0%}" if ranks > 1 else "-"
        print(f"| {fmt:<8} | {mode:<10} | {batch:>5} | {ranks:>5} | {ms:>8.2f} | {tok_s:>9.1f} | {speedup:>9} | "
              f"{comm:>13.2f} | {share:>12} |")
