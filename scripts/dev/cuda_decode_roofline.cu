// What bounds the M = 1 decode kernel: its weight stream (each warp a run of 4-row x 128-byte chunks
// through a 4-deep register ring, the layout and access order of csrc/cuda/decode.cu) with a
// synthetic per-chunk workload in place of the dequant, timed over a grid of
//   - ALU instructions a chunk: lop3 chains from the chunk's words to the 16 mma operand registers,
//     as the unpack does, then the 4 m16n8k16 mmas of one n8 tile (32, 64, 80 or 96; with 64 the
//     loop is 85 SASS instructions a chunk, the decode kernel's 86); with 0 the chunk is only
//     folded into a checksum (the stream alone),
//   - warps a block (the block's K split: 2, 4 or 8) and resident warps per SM, capped by dynamic
//     shared memory at 16 (what the decode kernel's 128-register bound allows), 24 or 32.
// The synthetic kernels are compiled to at most 64 registers (no spills), so the cap is the only
// occupancy limit. Each row is 32 back-to-back launches over 8 rotated copies of the weights
// (L2 cold) captured in one CUDA graph, best of 9 replays, and its time over the stream's alone
// (no work, 2-warp blocks: the first row).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a scripts/dev/cuda_decode_roofline.cu -maxrregcount=64 -o /tmp/roof && /tmp/roof [K N]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

using u32 = uint32_t;

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p)
               : "memory");
  return r;
}

__device__ __forceinline__ u32 lop3(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

constexpr int kDepth = 4;  // the decode kernel's ring (kDecDepth)

// ALU: lop3 instructions a chunk (16 chains of ALU / 16, one per mma operand register), then 4 mmas;
// ALU = 0: the stream alone.
template <int ALU>
__global__ void stream_decode(const u32* B, u32 rows, u32 Np, u32 salt, u32* out) {
  extern __shared__ unsigned char cap[];  // occupancy cap only
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int warps = blockDim.x >> 5;
  const u32 chunks = rows / 4, per_warp = (chunks + warps - 1) / warps, c0 = warp * per_warp;
  const int n = c0 < chunks ? int(min(per_warp, chunks - c0)) : 0;
  const uint4* p = reinterpret_cast<const uint4*>(B + size_t(4 * c0 + t) * Np + blockIdx.x * 32 + 4 * g);
  uint4 ring[kDepth];
#pragma unroll
  for (int d = 0; d < kDepth; ++d) ring[d] = d < n ? ldg_stream(p + size_t(d) * Np) : make_uint4(0, 0, 0, 0);
  const uint4* q = p + size_t(kDepth) * Np;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  u32 x = 0;
  auto work = [&](const uint4& w) {
    if constexpr (ALU == 0) {
      x ^= w.x + w.y * 3 + w.z * 5 + w.w * 7;
    } else {
      const u32 src[4] = {w.x, w.y, w.z, w.w};
      u32 b[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        b[r] = src[r & 3];
#pragma unroll
        for (int s = 0; s < ALU / 16; ++s) b[r] = lop3(b[r], salt + r, src[(r + s + 1) & 3]);
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const u32 a[4] = {b[4 * s], b[4 * s + 1], b[4 * s + 2], b[4 * s + 3]};
        mma(acc, a, salt, salt + s);
      }
    }
  };
  int i0 = 0;
  for (; i0 + 2 * kDepth <= n; i0 += kDepth) {
#pragma unroll
    for (int u = 0; u < kDepth; ++u) {
      const uint4 w = ring[u];
      ring[u] = ldg_stream(q);
      q += Np;
      work(w);
    }
  }
  for (; i0 < n; i0 += kDepth) {
#pragma unroll
    for (int u = 0; u < kDepth; ++u) {
      if (i0 + u >= n) break;
      const uint4 w = ring[u];
      if (i0 + u + kDepth < n) ring[u] = ldg_stream(q);
      q += Np;
      work(w);
    }
  }
  if (x == 0x12345678u || acc[0] + acc[1] + acc[2] + acc[3] == 1234.5f) out[0] = x + (cap[0] & 0);
}

struct Bench {
  int copies = 8, launches = 32;
  size_t bytes;
  std::vector<u32*> bufs;
  u32* out;
  cudaStream_t stream;
  cudaEvent_t e0, e1;

  explicit Bench(size_t b) : bytes(b) {
    for (int c = 0; c < copies; ++c) {
      u32* p;
      CHECK(cudaMalloc(&p, bytes));
      CHECK(cudaMemset(p, c + 1, bytes));
      bufs.push_back(p);
    }
    CHECK(cudaMalloc(&out, 4));
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
  }

  // us per launch: `launch(copy)` captured `launches` times over rotated copies, best of 9 replays.
  template <typename F>
  float time(F launch) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < launches; ++l) launch(l % copies);
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    float best = 1e30f;
    for (int r = 0; r < 10; ++r) {
      CHECK(cudaEventRecord(e0, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r > 0 && ms < best) best = ms;
    }
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return best * 1e3f / launches;
  }
};

template <int ALU>
float row(Bench& b, u32 rows, u32 Np, int warps, int cap_warps, int sms, float stream_us) {
  auto kernel = stream_decode<ALU>;
  int smem_per_sm = 0;
  CHECK(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
  const int blocks_per_sm = cap_warps / warps;
  // Per block: the SM's shared memory over the allowed blocks, less the 1 KB the driver reserves.
  const int smem = smem_per_sm / blocks_per_sm - 1024;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int resident = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, warps * 32, smem));
  const u32 grid = Np / 32;
  const float us = b.time([&](int c) {
    kernel<<<grid, warps * 32, smem, b.stream>>>(b.bufs[c], rows, Np, 0x9E3779B9u, b.out);
  });
  cudaFuncAttributes fa;
  CHECK(cudaFuncGetAttributes(&fa, kernel));
  if (stream_us <= 0.f) stream_us = us;
  printf("alu %2d  warps/block %d  cap %2d (resident %2d, grid %5.1f/SM, %2d regs)  %7.2f us  %5.2fx the stream\n",
         ALU, warps, cap_warps, resident * warps, double(grid) * warps / sms, fa.numRegs, us, us / stream_us);
  return us;
}

template <int ALU>
float sweep(Bench& b, u32 rows, u32 Np, int sms, float stream_us) {
  for (int warps : {2, 4, 8})
    for (int cap : {16, 24, 32}) {
      const float us = row<ALU>(b, rows, Np, warps, cap, sms, stream_us);
      if (stream_us <= 0.f) stream_us = us;
    }
  return stream_us;
}

int main(int argc, char** argv) {
  const u32 K = argc > 2 ? atoi(argv[1]) : 4096, N = argc > 2 ? atoi(argv[2]) : 28672;
  const u32 rows = K / 8;
  const size_t bytes = size_t(rows) * N * 4;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Bench b(bytes);
  printf("K %u x N %u at 4 bits: %.1f MB, ring 4 deep\n", K, N, bytes / 1e6);
  const float stream_us = sweep<0>(b, rows, N, sms, 0.f);
  sweep<32>(b, rows, N, sms, stream_us);
  sweep<64>(b, rows, N, sms, stream_us);
  sweep<80>(b, rows, N, sms, stream_us);
  sweep<96>(b, rows, N, sms, stream_us);
  return 0;
}
