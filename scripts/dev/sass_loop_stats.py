"""Instructions per 32-row chunk in the steady-state loop of each CUDA decode kernel, from SASS.

    python scripts/dev/sass_loop_stats.py quant_gemm.sass

Make the SASS with `cuobjdump -sass` on the built extension or on a cubin (`nvcc -cubin
-gencode=arch=compute_90,code=sm_90 ...`; without a CUDA toolkit's cuobjdump, the PyPI wheel
nvidia-cuda-cuobjdump carries one). For each decode_kernel instantiation it picks the HMMA loop
with the fewest conditionally executed instructions (the unpredicated steady-state loop) and
prints the instructions per chunk that always run and, separately, those under a branch (the
per-group scale flush, which runs once per group_size / 32 chunks).
"""
import re
import sys


def parse(text):
    for f in re.split(r"\n\s*Function : ", text)[1:]:
        name = f.split("\n", 1)[0].strip()
        ins = [(int(m.group(1), 16), m.group(2).strip())
               for m in (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln) for ln in f.split("\n")) if m]
        yield name, ins


def steady_loop(ins):
    idx = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, s) in enumerate(ins):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", s)
        if not (m and int(m.group(1), 16) < a and int(m.group(1), 16) in idx):
            continue
        b = idx[int(m.group(1), 16)]
        mma = sum("HMMA" in x for _, x in ins[b:i + 1])
        if not mma:
            continue
        cond = set()
        for k in range(b, i + 1):
            mm = re.match(r"@!?P\d+ BRA.*?0x([0-9a-f]+)", ins[k][1])
            tgt = idx.get(int(mm.group(1), 16)) if mm else None
            if tgt and k < tgt <= i:
                cond.update(range(k + 1, tgt))
        cand = (len(cond), i + 1 - b - len(cond), mma)
        if best is None or cand[0] < best[0]:
            best = cand
    return best


def main():
    for name, ins in parse(open(sys.argv[1]).read()):
        if "decode_kernel" not in name:
            continue
        found = steady_loop(ins)
        if not found:
            continue
        cond, uncond, mma = found
        nt = int(re.search(r"Li(\d)E", name).group(1))
        chunks = mma / (4 * nt)  # 4 mmas per chunk and n8 tile
        # decode_kernel<T, FMT, NT, kScaleGroupSums, WARPS, kCluster>
        m = re.search(r"decode_kernelI(\w+?)Lj(\d)ELi(\d)ELb(\d)ELi(\d)ELb(\d)E", name)
        dtype = "bf16" if "bfloat16" in m.group(1) else "fp16"
        fmt = ("fp4", "u4", "affine")[int(m.group(2))]
        short = (f"decode_kernel<{dtype}, {fmt}, NT={nt}, group_sums={m.group(4)}, warps={m.group(5)}, "
                 f"cluster={m.group(6)}>")
        print(f"{short}: {uncond / chunks:5.0f} per chunk + {cond / chunks:4.0f} under a branch")


if __name__ == "__main__":
    main()
