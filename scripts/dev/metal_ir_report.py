#!/usr/bin/env python3
"""Static load profile of the Metal kernels from clang's optimized LLVM IR (no Mac needed).

Every metal/*.metal file (or the files given) is compiled by clang++ -O2 for aarch64 to LLVM IR
over scripts/dev/metal_irshim/metal_stdlib, which is the address-space check's shim
(scripts/dev/metal_ascheck/: `device` / `constant` / `threadgroup` are address spaces 1 / 2 / 3,
threadgroup arrays are address-space-3 globals) plus min/max definitions, the vector types of
csrc/metal_emu/msl_vectors_clang.h (a uint4 load is one 16-byte load) and a table of the
instantiated kernels by host name. Apple's compiler front end is clang too, so this is a proxy for
what it receives, not a measure of speed: Apple's backend schedules, vectorizes and caches on its
own. bfloat kernels are compiled too (MSL 3.1; bfloat is a distinct 2-byte type here).

Per instantiated kernel (every format / dtype):

  device loads   load instructions from address space 1 (device buffers) in the main loops, by
                 width: "4Bx1 2Bx9" = one 4-byte and nine 2-byte loads in the loop body (static:
                 an instruction in a nested loop counts once); simdgroup_load from device memory
                 counts as a load of 2 elements (what one lane holds)
  weight B/load  bytes per load instruction of the weight buffer in the main loops (mean), and the
                 widest weight load anywhere in the kernel
  const loads    address-space-2 loads in the main loops (the params struct, constant tables)
  div main/loop  integer divisions and remainders by a non-constant (udiv/sdiv/urem/srem) in the
                 main loops / in any loop
  tg bytes       threadgroup memory: the address-space-3 globals the kernel (or a function it
                 calls) references
  barriers/step  threadgroup_barrier + simdgroup_barrier calls in the body of the main loop (the
                 one with the most; "tg+sg")
  dyn idx        addresses into a per-thread array (an alloca: accumulators, simdgroup_matrix
                 fragments) computed from a run-time index, anywhere in the kernel: such an array
                 cannot live in registers (on a GPU it goes to memory). A loop over such an array
                 needs a constant trip count, fully unrolled (TM_UNROLL, msl_kernel.h), with any
                 run-time bound as a guard inside.

The weight buffer is the kernel parameter named `B` (FP4 / INT4: packed words), `words` (the
rANS word stream) or ending in `packed` (trellis: packed, g_packed, u_packed, d_packed); a load belongs to it when its address
derives (getelementptr / bitcast / phi / select) from that parameter.

Main loops. Loops are the natural loops of the optimized IR (back edges to a dominating block;
loops sharing a header are one loop). Each top-level loop nest that contains a weight load gives
one main loop: start at its outermost loop and step into the child loop that holds all of the
current loop's weight loads, as long as that child has a barrier itself or the current loop has
none (so a cooperative copy loop inside a barriered K loop is not taken for the K loop). For the
decode kernels that is the K loop; for the 64x64 tile kernels the 8-row step (fused / striped) or
the K-block loop (staged, trellis prefill).

  scripts/dev/metal_ir_report.py                   markdown table of every kernel of metal/*.metal
  scripts/dev/metal_ir_report.py --json            the same as JSON
  scripts/dev/metal_ir_report.py metal/decode.metal --kernel marlin_gemv_m1_fp4_half
  scripts/dev/metal_ir_report.py --dump-ir DIR     also keep the .ll files

Needs clang++ (Debian: apt-get install -y clang); exit status 2 when it is missing.
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIM = os.path.join(ROOT, "scripts", "dev", "metal_irshim")
INCLUDE = os.path.join(ROOT, "csrc", "include")

CLANG_FLAGS = [
    "-target", "aarch64-unknown-linux-gnu", "-nostdinc", "-std=c++17", "-x", "c++", "-O2", "-S", "-emit-llvm",
    "-fdeclspec", "-fno-discard-value-names", "-Wno-unknown-attributes", "-D__METAL_VERSION__=310",
    # one vector load stays one load; every helper is inlined into its kernel, so a load's address
    # can be traced back to the kernel's [[buffer(i)]] parameter
    "-mllvm", "-disable-vector-combine", "-mllvm", "-inline-threshold=100000",
]


def is_weight(param):
    return param in ("B", "words") or param.endswith("packed")


def find_clang():
    for c in [os.environ.get("CLANGXX", ""), "clang++"] + [f"clang++-{v}" for v in range(20, 13, -1)]:
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def compile_to_ir(clang, path, extra_flags=()):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "k.ll")
        cmd = [clang, *CLANG_FLAGS, *extra_flags, "-I", SHIM, "-I", INCLUDE, path, "-o", out]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"clang failed on {path}:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
        with open(out) as f:
            return f.read()


# ---- LLVM IR (textual, LLVM 14 typed pointers) ---------------------------------------------------

_PRIM_BYTES = {"half": 2, "bfloat": 2, "float": 4, "double": 8, "ptr": 8}


def split_top(s, sep=","):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "[{<(":
            depth += 1
        elif ch in "]}>)":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class Module:
    def __init__(self, text):
        self.text = text
        self.types = {}
        for m in re.finditer(r"^(%[\w.:\"$<>, -]+?) = type (.*)$", text, re.MULTILINE):
            self.types[m.group(1)] = m.group(2).strip()
        self.strings = {m.group(1): m.group(2) for m in
                        re.finditer(r'^(@\.str[\w.]*) = .*? c"((?:[^"\\]|\\..)*)\\00"', text, re.MULTILINE)}
        self.tg_globals = {}
        for m in re.finditer(r"^(@[\w.$]+) = .*?addrspace\(3\) global (.*?)(?: undef| zeroinitializer|,)",
                             text, re.MULTILINE):
            self.tg_globals[m.group(1)] = self.type_bytes(m.group(2).strip())
        self.functions = {}
        for m in re.finditer(r"^define [^@]*(@[\w.$]+)\(", text, re.MULTILINE):
            depth, i = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            params = text[m.end():i - 1]
            body_start = text.index("{\n", i) + 2
            body_end = text.index("\n}", body_start)
            self.functions[m.group(1)] = Function(m.group(1), params, text[body_start:body_end])
        self.kernels = {}
        for m in re.finditer(r"^@[\w.$]*tm_ir_kernel_\d+ = .*$", text, re.MULTILINE):
            line = m.group(0)
            s = re.search(r"(@\.str[\w.]*)", line)
            f = re.findall(r"(@[\w.$]+) to i8\*", line)
            if s and f and s.group(1) in self.strings:
                self.kernels[self.strings[s.group(1)]] = f[-1]

    def type_bytes(self, t):
        t = t.strip()
        if t.endswith("*"):
            return 8
        m = re.fullmatch(r"i(\d+)", t)
        if m:
            return max(1, int(m.group(1)) // 8)
        if t in _PRIM_BYTES:
            return _PRIM_BYTES[t]
        m = re.fullmatch(r"[\[<](\d+) x (.*)[\]>]", t)
        if m:
            return int(m.group(1)) * self.type_bytes(m.group(2))
        if t.startswith("%") and t in self.types:
            return self.type_bytes(self.types[t])
        if t.startswith("{") or t.startswith("<{"):
            inner = t.strip("<>{} ")
            return sum(self.type_bytes(x) for x in split_top(inner)) if inner else 0
        return 0


class Block:
    def __init__(self, label):
        self.label = label
        self.lines = []
        self.succs = []


class Function:
    def __init__(self, name, params, body):
        self.name = name
        self.params = []
        for p in split_top(params):
            m = re.search(r"(%[\w.$-]+)$", p)
            self.params.append(m.group(1) if m else None)
        self.blocks = []
        cur = Block("%entry0")
        for line in body.splitlines():
            m = re.match(r"^([\w.$-]+):", line)
            if m:
                self.blocks.append(cur)
                cur = Block("%" + m.group(1))
            elif line.strip() and not line.strip().startswith(";"):
                cur.lines.append(line.strip())
        self.blocks.append(cur)
        self.blocks = [b for b in self.blocks if b.lines]
        self.by_label = {b.label: b for b in self.blocks}
        for b in self.blocks:
            for line in b.lines:
                b.succs += ["%" + x for x in re.findall(r"label %([\w.$-]+)", line)]
        self.defs = {}
        for b in self.blocks:
            for line in b.lines:
                m = re.match(r"^(%[\w.$-]+) = (.*)$", line)
                if m:
                    self.defs[m.group(1)] = m.group(2)

    # -- provenance of a pointer value: the kernel parameters it derives from
    def bases(self, value, seen=None):
        seen = set() if seen is None else seen
        if value in seen:
            return set()
        seen.add(value)
        if value in self.params:
            return {value}
        d = self.defs.get(value)
        if d is None:
            return set()
        ops = []
        if d.startswith("phi "):
            ops = re.findall(r"\[\s*(%[\w.$-]+)\s*,", d)
        elif re.match(r"(getelementptr|bitcast|addrspacecast|select)\b", d):
            ops = re.findall(r"\*\s+(%[\w.$-]+)", d)
        out = set()
        for o in ops:
            out |= self.bases(o, seen)
        return out

    # -- natural loops
    def loops(self):
        labels = [b.label for b in self.blocks]
        if not labels:
            return []
        preds = {l: [] for l in labels}
        for b in self.blocks:
            for s in b.succs:
                if s in preds:
                    preds[s].append(b.label)
        order, seen = [], set()

        def dfs(l):
            stack = [(l, iter(self.by_label[l].succs))]
            seen.add(l)
            while stack:
                node, it = stack[-1]
                nxt = next((s for s in it if s in self.by_label and s not in seen), None)
                if nxt is None:
                    order.append(node)
                    stack.pop()
                else:
                    seen.add(nxt)
                    stack.append((nxt, iter(self.by_label[nxt].succs)))

        dfs(labels[0])
        rpo = order[::-1]
        index = {l: i for i, l in enumerate(rpo)}
        idom = {rpo[0]: rpo[0]}
        changed = True
        while changed:
            changed = False
            for l in rpo[1:]:
                ps = [p for p in preds[l] if p in idom]
                if not ps:
                    continue
                new = ps[0]
                for p in ps[1:]:
                    a, b = p, new
                    while a != b:
                        while index[a] > index[b]:
                            a = idom[a]
                        while index[b] > index[a]:
                            b = idom[b]
                    new = a
                if idom.get(l) != new:
                    idom[l] = new
                    changed = True

        def dominates(h, n):
            while True:
                if n == h:
                    return True
                if n not in idom or idom[n] == n:
                    return False
                n = idom[n]

        bodies = {}
        for l in rpo:
            for s in self.by_label[l].succs:
                if s in index and dominates(s, l):
                    body = bodies.setdefault(s, {s})
                    work = [l]
                    while work:
                        n = work.pop()
                        if n not in body:
                            body.add(n)
                            work += [p for p in preds[n] if p in index]
        return [frozenset(b) for b in bodies.values()]


_LOAD_RE = re.compile(r"^(%[\w.$-]+) = load (?:volatile )?(.*)$")
_DIV_RE = re.compile(r"^%[\w.$-]+ = (udiv|sdiv|urem|srem)(?: exact)? \S+ (\S+), (\S+)")


def line_facts(mod, fn, line):
    """(kind, details) of one instruction: ("load", (space, width, bases)), ("div", None),
    ("tg_barrier"|"sg_barrier", None) or (None, None)."""
    m = _LOAD_RE.match(line)
    if m:
        parts = split_top(m.group(2))
        ty = parts[0]
        ptr = parts[1] if len(parts) > 1 else ""
        sp = re.search(r"addrspace\((\d+)\)\*", ptr)
        space = int(sp.group(1)) if sp else 0
        pv = re.search(r"(%[\w.$-]+)\s*$", ptr)
        bases = fn.bases(pv.group(1)) if pv else set()
        return "load", (space, mod.type_bytes(ty), bases)
    m = _DIV_RE.match(line)
    if m and not re.fullmatch(r"-?\d+", m.group(3)) and "<" not in m.group(3):
        return "div", None
    if " call " in f" {line}" or line.startswith("call ") or " = call " in line or "tail call" in line:
        callee = re.search(r"@([\w.$]+)\(", line)
        name = callee.group(1) if callee else ""
        if "threadgroup_barrier" in name:
            return "tg_barrier", None
        if "simdgroup_barrier" in name:
            return "sg_barrier", None
        if "simdgroup_load" in name:
            args = line[line.index(name) + len(name):]
            dev = re.search(r"(\w+) addrspace\(1\)\* (?:noundef )?(%[\w.$-]+)", args)
            if dev:
                return "load", (1, 2 * mod.type_bytes(dev.group(1)), fn.bases(dev.group(2)))
    return None, None


def tg_bytes(mod, fname, seen=None):
    seen = set() if seen is None else seen
    if fname in seen or fname not in mod.functions:
        return set()
    seen.add(fname)
    fn = mod.functions[fname]
    used = set()
    for b in fn.blocks:
        for line in b.lines:
            for g in re.findall(r"(@[\w.$]+)", line):
                if g in mod.tg_globals:
                    used.add(g)
                elif g in mod.functions:
                    used |= tg_bytes(mod, g, seen)
    return used


_ALLOCA_RE = re.compile(r"^\s*(%[\w.$-]+) = alloca \[")
_GEP_RE = re.compile(r"^\s*%[\w.$-]+ = getelementptr (?:inbounds )?(.*)$")


def dynamic_thread_array_indices(fn):
    """getelementptrs into an alloca'd array with a non-constant index (operand 2 on)."""
    arrays, count = set(), 0
    for b in fn.blocks:
        for line in b.lines:
            m = _ALLOCA_RE.match(line)
            if m:
                arrays.add(m.group(1))
    for b in fn.blocks:
        for line in b.lines:
            m = _GEP_RE.match(line)
            if not m:
                continue
            ops = split_top(m.group(1))
            if len(ops) < 3 or ops[1].split()[-1] not in arrays:
                continue
            if any(o.split()[-1].startswith("%") for o in ops[2:]):
                count += 1
    return count


def analyze_kernel(mod, host_name, fname):
    fn = mod.functions[fname]
    param_names = {p: p.lstrip("%") for p in fn.params if p}
    facts = {}  # label -> list of (kind, details)
    for b in fn.blocks:
        facts[b.label] = [line_facts(mod, fn, line) for line in b.lines]

    def weight_load(f):
        return f[0] == "load" and f[1][0] == 1 and any(is_weight(param_names.get(x, "")) for x in f[1][2])

    loops = fn.loops()
    children = {l: [c for c in loops if c < l and not any(c < m < l for m in loops)] for l in loops}
    top = [l for l in loops if not any(l < m for m in loops)]

    def weight_blocks(l):
        return {b for b in l if any(weight_load(f) for f in facts[b])}

    def has_barrier(blocks):
        return any(f[0] in ("tg_barrier", "sg_barrier") for b in blocks for f in facts[b])

    mains = []
    for l in top:
        wb = weight_blocks(l)
        if not wb:
            continue
        cur = l
        while True:
            nxt = [c for c in children[cur] if wb <= c]
            if len(nxt) != 1:
                break
            c = nxt[0]
            if has_barrier(cur) and not has_barrier(c):
                break
            cur = c
        mains.append(cur)
    main_blocks = set().union(*mains) if mains else set()
    loop_blocks = set().union(*loops) if loops else set()

    widths, weight_widths, const_loads, div_main, div_loops = {}, [], 0, 0, 0
    all_weight_widths = []
    for b in fn.blocks:
        for f in facts[b.label]:
            if weight_load(f):
                all_weight_widths.append(f[1][1])
            if b.label in loop_blocks and f[0] == "div":
                div_loops += 1
            if b.label not in main_blocks:
                continue
            if f[0] == "load" and f[1][0] == 1:
                widths[f[1][1]] = widths.get(f[1][1], 0) + 1
                if weight_load(f):
                    weight_widths.append(f[1][1])
            elif f[0] == "load" and f[1][0] == 2:
                const_loads += 1
            elif f[0] == "div":
                div_main += 1
    barriers = (0, 0)
    for m in mains:
        tg = sum(1 for b in m for f in facts[b] if f[0] == "tg_barrier")
        sg = sum(1 for b in m for f in facts[b] if f[0] == "sg_barrier")
        if tg + sg > sum(barriers):
            barriers = (tg, sg)
    return dict(
        kernel=host_name,
        main_loops=len(mains),
        device_loads={str(w): n for w, n in sorted(widths.items(), reverse=True)},
        weight_loads_in_main=len(weight_widths),
        weight_bytes_per_load=sum(weight_widths) / len(weight_widths) if weight_widths else None,
        max_weight_load=max(all_weight_widths, default=0),
        const_loads=const_loads,
        div_main=div_main,
        div_loops=div_loops,
        tg_bytes=sum(mod.tg_globals[g] for g in tg_bytes(mod, fname)),
        tg_barriers_per_step=barriers[0],
        sg_barriers_per_step=barriers[1],
        dynamic_thread_array_index=dynamic_thread_array_indices(fn),
    )


def analyze_file(clang, path, extra_flags=()):
    mod = Module(compile_to_ir(clang, path, extra_flags))
    rel = os.path.relpath(path, ROOT)
    out = []
    for host, fname in sorted(mod.kernels.items()):
        if fname in mod.functions:
            r = analyze_kernel(mod, host, fname)
            r["file"] = rel
            out.append(r)
    return out, mod


def markdown(rows):
    head = ("| file | kernel | device loads in main loop | weight B/load (max) | const loads | div main/loops "
            "| tg bytes | barriers/step tg+sg | dyn idx |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        loads = " ".join(f"{w}Bx{n}" for w, n in r["device_loads"].items()) or "-"
        wpl = "-" if r["weight_bytes_per_load"] is None else f"{r['weight_bytes_per_load']:.3g}"
        lines.append(f"| {r['file']} | {r['kernel']} | {loads} | {wpl} ({r['max_weight_load']}) | {r['const_loads']} "
                     f"| {r['div_main']}/{r['div_loops']} | {r['tg_bytes']} "
                     f"| {r['tg_barriers_per_step']}+{r['sg_barriers_per_step']} | {r['dynamic_thread_array_index']} |")
    return "\n".join(lines)


def report(paths=None, kernel=None):
    clang = find_clang()
    if clang is None:
        raise FileNotFoundError("clang++ not found (Debian: apt-get install -y clang)")
    paths = paths or sorted(glob.glob(os.path.join(ROOT, "metal", "*.metal")))
    rows = []
    for p in paths:
        rows += analyze_file(clang, os.path.abspath(p))[0]
    if kernel:
        rows = [r for r in rows if r["kernel"] == kernel or re.fullmatch(kernel, r["kernel"])]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help=".metal files (default: metal/*.metal)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    ap.add_argument("--kernel", help="only this host name (or regular expression)")
    ap.add_argument("--dump-ir", metavar="DIR", help="write each file's optimized IR to DIR/<stem>.ll")
    a = ap.parse_args(argv)
    try:
        rows = report(a.files, a.kernel)
    except FileNotFoundError as e:
        print(f"metal_ir_report: {e}", file=sys.stderr)
        return 2
    if a.dump_ir:
        os.makedirs(a.dump_ir, exist_ok=True)
        clang = find_clang()
        for p in a.files or sorted(glob.glob(os.path.join(ROOT, "metal", "*.metal"))):
            stem = os.path.splitext(os.path.basename(p))[0]
            with open(os.path.join(a.dump_ir, stem + ".ll"), "w") as f:
                f.write(compile_to_ir(clang, os.path.abspath(p)))
    print(json.dumps(rows, indent=1) if a.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
