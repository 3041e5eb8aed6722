"""Where one decode step's time goes: the breakdown ``scripts/bench_e2e.py --profile`` prints.

A few decode steps of a StaticDecoder run under torch.profiler, as the benchmark ran them (eager,
replayed CUDA graph, compiled). The step's kernels are split into
  - each linear layer's GEMM, grouped by layer and shape (``qkv_proj fp4 4096x6144``), next to the
    same layer's time measured alone in the same process: the model's own layers of that shape
    called in turn, a small kernel after each call as in the model (each one's weights cold when
    its turn comes, as in the model; lm_head alone), so in/alone > 1 is time the model loses
    around that GEMM;
  - the other kernels (norms, rotary embeddings, attention, residual adds, argmax, casts, copies),
    the largest by name;
  - idle: the step's time in the benchmark minus the sum of its kernels' times, i.e. the gaps
    between kernels (launch latency, host work the device waits for). Below zero where kernels
    overlap: a kernel launched dependent on the previous one (programmatic dependent launch: the
    library's kernels, and inductor's in StaticDecoder's compiled step) starts before that one
    ends, and its time in the trace includes its wait for it.
On CUDA the times are the kernels' device times from the trace (CUPTI; kernels inside a replayed
CUDA graph included). On the CPU the "kernels" are the outermost aten / marlin ops (their CPU
time); the work of inductor's generated C++ and Python between ops count as idle there.

GEMM kernels are told apart by name and order: the layers' call order comes from one eager
forward with hooks, each layer's kernels (e.g. a memset of its K-slice counters, then the GEMM)
from its run alone; in the step's trace the k-th GEMM kernel is the k-th call's. When the counts
disagree (a kernel name shared with non-GEMM work) the table says so and gives totals only.
"""

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from torch_marlin.registry import layer_format_of

CPU_GEMM_OPS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul")


@dataclass
class Call:
    """One linear layer's call in a decode step."""
    name: str
    module: nn.Module
    kind: str  # the quantized format, or the float weight's dtype
    M: int
    K: int
    N: int

    @property
    def key(self) -> Tuple[str, str, int, int, int]:
        return self.name.rpartition(".")[2], self.kind, self.M, self.K, self.N


@dataclass
class Event:
    name: str
    start: float  # us
    duration: float  # us


@dataclass
class Signature:
    """The kernels one call of a layer shape runs alone: its main (longest) kernel and the helper
    kernels launched right before it; the time of one call."""
    main: str
    helpers: Tuple[str, ...]
    us_per_call: float


@dataclass
class StepProfile:
    steps: int
    step_us: float
    kernel_us: float
    groups: List[Tuple[Tuple[str, str, int, int, int], int, float, float]] = field(default_factory=list)
    other: List[Tuple[str, int, float]] = field(default_factory=list)  # (name, calls a step, us a step)
    note: Optional[str] = None


def is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear or layer_format_of(module) is not None


def kind_of(module: nn.Module) -> str:
    lt = layer_format_of(module)
    if lt is not None:
        return lt.name
    return str(module.weight.dtype).replace("torch.", "")


def linear_calls(model: nn.Module, batch: int, device: torch.device) -> List[Call]:
    """The linear layers one decode step calls, in call order (one eager forward of one token per
    sequence with hooks; the decode step calls the same layers in the same order)."""
    names = {m: n for n, m in model.named_modules() if is_linear(m)}
    calls: List[Call] = []

    def hook(module, args, output):
        x = args[0]
        calls.append(Call(names[module], module, kind_of(module), x.numel() // module.in_features,
                          module.in_features, module.out_features))

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device), use_cache=False,
                  logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return calls


def kernel_events(prof, device: torch.device) -> List[Event]:
    """The trace's kernels in start order: device kernels on CUDA, outermost ops on the CPU."""
    from torch.autograd import DeviceType

    events = []
    if device.type == "cuda":
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                events.append(Event(e.name, e.time_range.start, e.time_range.elapsed_us()))
    else:
        for e in prof.events():
            if e.device_type != DeviceType.CPU or "::" not in e.name:
                continue
            parent = e.cpu_parent
            while parent is not None and "::" not in parent.name:
                parent = parent.cpu_parent
            if parent is None:
                events.append(Event(e.name, e.time_range.start, e.cpu_time_total))
    return sorted(events, key=lambda e: e.start)


def profiled(fn, device: torch.device) -> List[Event]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    return kernel_events(prof, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def is_gemm_event(name: str, device: torch.device) -> bool:
    # On the CPU a layer alone also runs views and reshapes, which the rest of the model runs too.
    return device.type == "cuda" or name.startswith("marlin::") or name in CPU_GEMM_OPS


def isolated_signature(modules: List[nn.Module], M: int, device: torch.device, dtype: torch.dtype,
                       reps: int) -> Signature:
    """Each module of one layer shape called in turn ``reps`` times on one input."""
    x = torch.randn(M, modules[0].in_features, device=device, dtype=dtype)
    # A GEMM kernel that lets its successor launch early (programmatic dependent launch, as the
    # decode kernels do) would overlap the next call's kernel when they run back to back, and the
    # trace would count that kernel's wait for it as its time. A small kernel between calls keeps
    # them apart, as the model's norms and activations do; its kernels are left out.
    spacer = torch.zeros(1, device=device) if device.type == "cuda" else None
    spacer_kernels = {e.name for e in profiled(spacer.zero_, device)} if spacer is not None else set()

    def run():
        with torch.inference_mode():
            for _ in range(reps):
                for m in modules:
                    m(x)
                    if spacer is not None:
                        spacer.zero_()

    run()  # warm-up: plans, lazy initializations
    events = [e for e in profiled(run, device) if is_gemm_event(e.name, device) and e.name not in spacer_kernels]
    calls = reps * len(modules)
    per_name = defaultdict(float)
    for e in events:
        per_name[e.name] += e.duration
    counts = Counter(e.name for e in events)
    main = max(per_name, key=per_name.get)
    # Helpers: kernels launched once per call right before the main one (a memset of K-slice counters).
    helpers = tuple(n for n in counts if n != main and counts[n] == calls)
    return Signature(main, helpers, sum(per_name[n] for n in (main,) + helpers) / calls)


def short(name: str, width: int = 70) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def profile_step(model: nn.Module, step, batch: int, steps: int, step_us: float, device: torch.device,
                 dtype: torch.dtype, reps: int = 3) -> StepProfile:
    """Profiles ``step()`` (one decode step of the benchmark's decoder) ``steps`` times; ``step_us``
    is the step's time in the timed run (the idle time is measured against it)."""
    calls = linear_calls(model, batch, device)
    by_key: Dict[tuple, List[nn.Module]] = defaultdict(list)
    for c in calls:
        if c.module not in by_key[c.key]:
            by_key[c.key].append(c.module)
    signatures = {key: isolated_signature(mods, key[2], device, dtype, reps) for key, mods in by_key.items()}

    def run():
        for _ in range(steps):
            step()

    run()
    events = profiled(run, device)
    kernel_us = sum(e.duration for e in events) / steps
    result = StepProfile(steps, step_us, kernel_us)
    assigned, note = assign(events, calls, signatures, steps)
    result.note = note
    taken = set()
    if assigned is not None:
        per_key = defaultdict(lambda: [0, 0.0])
        for call, idxs in zip(calls * steps, assigned):
            per_key[call.key][0] += 1
            per_key[call.key][1] += sum(events[i].duration for i in idxs)
            taken.update(idxs)
        for key, (n, total) in per_key.items():
            result.groups.append((key, n // steps, total / n, signatures[key].us_per_call))
    else:
        gemm_names = {n for s in signatures.values() for n in (s.main,) + s.helpers}
        taken = {i for i, e in enumerate(events) if e.name in gemm_names}
    other = defaultdict(lambda: [0, 0.0])
    for i, e in enumerate(events):
        if i not in taken:
            other[e.name][0] += 1
            other[e.name][1] += e.duration
    result.other = sorted(((n, c // steps, t / steps) for n, (c, t) in other.items()), key=lambda r: -r[2])
    if assigned is None:
        result.groups = [(("linear layers (all)", "", 0, 0, 0), len(calls),
                          sum(events[i].duration for i in taken) / steps / max(len(calls), 1), float("nan"))]
    return result


def assign(events: List[Event], calls: List[Call], signatures, steps: int):
    """Event indices of each call of ``calls`` repeated ``steps`` times, or (None, why)."""
    mains = {s.main for s in signatures.values()}
    found = sum(e.name in mains for e in events)
    if found != steps * len(calls):
        return None, (f"{found} GEMM kernels in the trace for {steps * len(calls)} linear layer calls (a kernel name "
                      "shared with other work, or kernels the trace missed): GEMM totals only")
    order = calls * steps
    out, j, claimed = [], 0, set()
    for i, e in enumerate(events):
        if e.name not in mains:
            continue
        sig = signatures[order[j].key]
        if e.name != sig.main:
            return None, f"call {j} ({order[j].name}) ran {short(e.name, 40)}, alone it runs {short(sig.main, 40)}"
        idxs = [i]
        back = i - 1
        for helper in reversed(sig.helpers):  # helpers run right before their GEMM
            while back >= 0 and (back in claimed or events[back].name != helper) and i - back <= 4:
                back -= 1
            if back >= 0 and events[back].name == helper and back not in claimed:
                idxs.append(back)
                back -= 1
        claimed.update(idxs)
        out.append(idxs)
        j += 1
    return out, None


def format_profile(label: str, p: StepProfile, top: int = 6, name_width: int = 90) -> str:
    """The profile as a markdown table. The part column is as wide as the longest label, the other
    kernels' names at most ``name_width`` characters (inductor's and cuDNN's kernel names say which
    part of the model each is, so they are not cut short where they fit)."""
    idle = p.step_us - p.kernel_us
    lines = [f"\nstep profile: {label}: {p.step_us:.1f} us a step (timed run), kernels {p.kernel_us:.1f} us "
             f"({p.kernel_us / p.step_us:.1%}), idle {idle:.1f} us ({p.steps} steps profiled)"]
    gemm_rows = sorted(p.groups, key=lambda g: -g[1] * g[2])
    gemm_labels = [short(f"{role} {kind}".strip(), name_width) for (role, kind, *_), *_ in gemm_rows]
    other_labels = ["  " + short(name, name_width - 2) for name, _, _ in p.other[:top]]
    gemms_total, others_total = "GEMMs (all linear layers)", "other kernels"
    idle_row = "idle, < 0 overlap (step - kernels)"
    w = max(len(x) for x in gemm_labels + other_labels + [gemms_total, others_total, idle_row, "part"])
    head = f"| {'part':<{w}} | {'K x N':>12} | {'calls':>5} | {'in model us':>11} | {'alone us':>8} | " \
           f"{'in/alone':>8} | {'us a step':>9} |"
    lines += [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    gemm = 0.0
    for ((role, kind, M, K, N), n, in_model, alone), part in zip(gemm_rows, gemm_labels):
        gemm += n * in_model
        shape = f"{K}x{N}" if K else ""
        ratio = in_model / alone if alone == alone and alone > 0 else float("nan")
        lines.append(f"| {part:<{w}} | {shape:>12} | {n:>5} | {in_model:>11.2f} | "
                     f"{alone:>8.2f} | {ratio:>8.2f} | {n * in_model:>9.1f} |")
    others = sum(t for _, _, t in p.other)
    lines.append(f"| {gemms_total:<{w}} | {'':>12} | {sum(g[1] for g in p.groups):>5} | {'':>11} | "
                 f"{'':>8} | {'':>8} | {gemm:>9.1f} |")
    lines.append(f"| {others_total:<{w}} | {'':>12} | {sum(c for _, c, _ in p.other):>5} | {'':>11} | {'':>8} | "
                 f"{'':>8} | {others:>9.1f} |")
    for (name, n, t), part in zip(p.other[:top], other_labels):
        lines.append(f"| {part:<{w}} | {'':>12} | {n:>5} | {t / max(n, 1):>11.2f} | {'':>8} | {'':>8} | "
                     f"{t:>9.1f} |")
    lines.append(f"| {idle_row:<{w}} | {'':>12} | {'':>5} | {'':>11} | {'':>8} | {'':>8} | "
                 f"{idle:>9.1f} |")
    if p.note:
        lines.append(f"note: {p.note}")
    return "\n".join(lines)
