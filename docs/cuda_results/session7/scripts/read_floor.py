"""Session 7: the floor under the M <= 16 targets. How long does merely *reading* a weight take?

    python docs/cuda_results/session7/scripts/read_floor.py

For each issue shape, times (CUDA events, 256 MB memset flush before every call, median of 21,
as scripts/bench_cuda.py) a plain streaming-read kernel (16-byte __ldg loads, 4 in flight per
thread per iteration, grid-stride; best of several grid sizes) over (a) the FP4 weight's bytes
(packed codes + group-128 scales) and (b) the fp16 weight's bytes, plus an empty kernel, cuBLAS
fp16 at M = 1 and gemm_fp4 at M = 1. t_cuBLAS / t_read(FP4 bytes) bounds the speed-up any FP4
kernel can show over cuBLAS at M = 1 under this timing.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import memset_flush, timed, weights  # noqa: E402

SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
__global__ void read_kernel(const uint4* __restrict__ p, long n, unsigned* out) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const long stride = long(gridDim.x) * blockDim.x;
  long i = long(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
    acc.x ^= a.x ^ b.x ^ c.x ^ d.x; acc.y ^= a.y ^ b.y ^ c.y ^ d.y;
    acc.z ^= a.z ^ b.z ^ c.z ^ d.z; acc.w ^= a.w ^ b.w ^ c.w ^ d.w;
  }
  for (; i < n; i += stride) { uint4 a = __ldg(p + i); acc.x ^= a.x; acc.y ^= a.y; acc.z ^= a.z; acc.w ^= a.w; }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9E3779B9u) out[0] = 1u;  // keeps the loads
}
__global__ void empty_kernel() {}
void read_bytes(torch::Tensor src, torch::Tensor out, int64_t blocks, int64_t threads) {
  read_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(src.data_ptr()), src.numel() / 16, reinterpret_cast<unsigned*>(out.data_ptr()));
}
void empty() { empty_kernel<<<1, 32, 0, c10::cuda::getCurrentCUDAStream()>>>(); }
"""
CPP = "void read_bytes(torch::Tensor src, torch::Tensor out, int64_t blocks, int64_t threads); void empty();"
SHAPES = [(4096, 12288), (4096, 4096), (4096, 21504), (10752, 4096), (28672, 8192)]


def weight_bytes(K, N):
    """Bytes of a K x N weight as FP4 (packed codes + group-128 fp16 scales) and as fp16."""
    return K * N // 2 + (K // 128) * N * 2, K * N * 2


def shape_reads(read_time):
    """(K, N, FP4 bytes, fp16 bytes, (FP4 read us, bps, threads), fp16 read us) over SHAPES;
    read_time(nbytes) -> best_grid's triple."""
    for K, N in SHAPES:
        b4, b16 = weight_bytes(K, N)
        yield K, N, b4, b16, read_time(b4), read_time(b16)[0]


def best_grid(time_grid):
    """(us, blocks per SM, threads a block) of the fastest read grid; time_grid(bps, threads) times one."""
    return min((time_grid(bps, thr), bps, thr) for bps in (1, 2, 4, 8) for thr in (256, 512, 1024)
               if bps * thr <= 2048)


def main():
    ext = load_inline("read_floor", CPP, cuda_sources=SRC, functions=["read_bytes", "empty"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = memset_flush()
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"empty kernel: {timed(ext.empty, flush, reps=21):.2f} us")

    def read_time(nbytes):
        src = torch.randint(0, 256, (nbytes // 16 * 16,), dtype=torch.uint8, device="cuda")
        return best_grid(lambda bps, thr: timed(lambda: ext.read_bytes(src, out, sms * bps, thr), flush, reps=21))

    print(f"{'K x N':>12} {'FP4 MB':>7} {'read us (grid)':>16} {'fp16 MB':>8} {'read us':>8} {'cuBLAS':>7} "
          f"{'fp4':>7} {'cuBLAS/read4':>12} {'fp4/read4':>9}")
    for K, N, b4, b16, (r4, bps, thr), r16 in shape_reads(read_time):
        B, s, W16 = weights(K, N)
        A = torch.randn(1, K, device="cuda", dtype=torch.float16)
        tc = timed(lambda: F.linear(A, W16), flush, reps=21)
        tf = timed(lambda: torch.ops.marlin.gemm_fp4(A, B, s, 128), flush, reps=21)
        print(f"{K:>5}x{N:<6} {b4 / 1e6:7.1f} {r4:8.2f} ({bps}x{thr:4d}) {b16 / 1e6:8.1f} {r16:8.2f} {tc:7.2f} "
              f"{tf:7.2f} {tc / r4:11.2f}x {tf / r4:8.2f}x", flush=True)
        del B, s, W16
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
