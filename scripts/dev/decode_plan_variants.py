"""Candidate CUDA decode-planner constants for M = 1, applied to csrc/plan/plan_cuda.cpp one at a time
by scripts/dev/gpu_decode.sh (rebuild, time the Llama-3-8B layer shapes, restore). A tuning aid:
the product keeps one planner; the variant that measures best becomes its constants.

    python scripts/dev/decode_plan_variants.py --list
    python scripts/dev/decode_plan_variants.py --check            # every variant applies to the source
    python scripts/dev/decode_plan_variants.py --apply NAME       # edits csrc/plan/plan_cuda.cpp in place
    python scripts/dev/decode_plan_variants.py --show M K N       # the decode grid each variant plans

At M = 1 the decode kernel runs 8-row tiles, 2 blocks per SM (264 slots on 132 SMs), 32 columns a
block; K slices fill the slots in one wave, slices of at least 1024 rows, up to 2 summed through a
cluster, more through global memory (a memset of the tile counters, then the last block's sum).
  4096x1024: 32 tiles x 4 slices = 128 blocks, 1 per SM on 128 SMs (half the slots idle); global sum.
  4096x4096: 128 x 2 = 256 blocks; 14336x4096: 128 x 2, slices of 7168.
  4096x6144 (fused q/k/v): 192 x 1 = 192 blocks: 73 % of the slots, 60 SMs with 2 blocks, 72 with 1.
  4096x14336 / 4096x28672: 448 / 896 x 1 (1.7 / 3.4 waves of slots).
Bytes in flight set the bandwidth of this latency-bound kernel (a lane keeps 4 16-byte loads in
flight: 2 KB a warp), so idle slots cost bandwidth directly. Earlier evidence
(benchmarks/notes/cuda-tuning.md): CUDA-DECODE-SLICES found slices of >= 512 rows no faster on
4096x4096 and a second wave slower on 28672x8192; CUDA-DECODE-CLUSTER found 8-slice clusters up to
30 % slower on 8192x1024. Those were not the fused 4096x6144 nor rotated graphs at M = 1 with PDL,
which these variants time (--list names them).
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = os.path.join(ROOT, "csrc", "plan", "plan_cuda.cpp")

SLICES = "constexpr CudaSliceRule kCudaDecodeSlices{1024, 16, 32 * TM_CUDA_DECODE_WARPS};"
DECODE_CALL = ("cuda_tile_slices(cuda_tiles(p), K, int64_t(caps.compute_units) * blocks_per_sm, "
               "kCudaDecodeSlices)")
CLUSTER = "p.params.k_parallel <= TM_CUDA_DECODE_MAX_CLUSTER_SLICES"
FILL_FN = """// K slices that fill every resident slot, a partial second wave allowed.
int64_t cuda_decode_fill_slices(int64_t tiles, int64_t K, int64_t slots, const CudaSliceRule& rule) {
  const int64_t by_slots = std::max<int64_t>(1, (slots + tiles - 1) / tiles);
  const int64_t by_k = std::max<int64_t>(1, K / rule.min_slice);
  return std::min<int64_t>({by_slots, by_k, rule.max_slices});
}

void plan_decode("""

# name -> (what it changes, [(old text, new text)])
VARIANTS = {
    "baseline": ("the planner as it is", []),
    "slice512": ("decode K slices of at least 512 rows (4096x1024: 8 slices, 256 blocks)",
                 [(SLICES, SLICES.replace("{1024,", "{512,"))]),
    "fill": ("K slices rounded up to fill every slot (4096x6144: 2 slices, 384 blocks; 4096x4096 and "
             "14336x4096: 3)", [("void plan_decode(", FILL_FN),
                                (DECODE_CALL, DECODE_CALL.replace("cuda_tile_slices", "cuda_decode_fill_slices"))]),
    "cluster4": ("up to 4 K slices summed through a cluster (no memset, no global round trip: 4096x1024)",
                 [(CLUSTER, "p.params.k_parallel <= 4")]),
    "fill_cluster4": ("fill and cluster4 (4096x4096 / 14336x4096: 3 slices through a cluster; 4096x6144: 2)",
                      [("void plan_decode(", FILL_FN),
                       (DECODE_CALL, DECODE_CALL.replace("cuda_tile_slices", "cuda_decode_fill_slices")),
                       (CLUSTER, "p.params.k_parallel <= 4")]),
}


def apply(source: str, name: str) -> str:
    for old, new in VARIANTS[name][1]:
        if source.count(old) != 1:
            raise ValueError(f"variant {name}: {old[:60]!r}... occurs {source.count(old)} times in plan_cuda.cpp "
                             "(the planner changed: update scripts/dev/decode_plan_variants.py)")
        source = source.replace(old, new)
    return source


def decode_grid(name: str, M: int, K: int, N: int, sms: int = 132):
    """(tiles, K slices, reduce) that plan_decode makes under a variant: a model of the C++ for --show."""
    min_slice = 512 if "slice512" in name else 1024
    cluster_max = 4 if "cluster4" in name else 2
    tile_m = 8 if M <= 8 else 16 if M <= 16 else 32 if M <= 32 else 64
    slots = sms * (1 if tile_m == 64 else 2)
    tiles = -(-M // tile_m) * -(-N // 32)
    by_slots = -(-slots // tiles) if name.startswith("fill") else slots // tiles
    kp = min(max(1, by_slots), max(1, K // min_slice), 16)
    return tiles, kp, "none" if kp == 1 else "cluster" if kp <= cluster_max else "global"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--apply", metavar="NAME", choices=list(VARIANTS))
    ap.add_argument("--show", nargs=3, type=int, metavar=("M", "K", "N"))
    args = ap.parse_args(argv)
    if args.list:
        for name, (what, _) in VARIANTS.items():
            print(f"{name}: {what}")
    if args.check or args.apply:
        with open(PLAN) as f:
            source = f.read()
        for name in VARIANTS if args.check else [args.apply]:
            try:
                edited = apply(source, name)
            except ValueError as e:
                sys.exit(str(e))
            if args.check:
                print(f"{name}: applies ({len(VARIANTS[name][1])} edits)")
        if args.apply:
            with open(PLAN, "w") as f:
                f.write(edited)
            print(f"applied {args.apply}: {VARIANTS[args.apply][0]}")
    if args.show:
        M, K, N = args.show
        for name in VARIANTS:
            tiles, kp, reduce = decode_grid(name, M, K, N)
            print(f"{name:>18}: {tiles} tiles x {kp} slices = {tiles * kp} blocks, slices of {K // kp}, sum {reduce}")


if __name__ == "__main__":
    main()
