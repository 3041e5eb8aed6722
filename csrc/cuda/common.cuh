// Device helpers shared by the CUDA kernel families of the FP4 E2M1 / INT4 op family (docs/cuda.md
// explains the design): per-dtype mma and dequant bit tricks, the K-slice arrival of the
// global-memory reduction, programmatic dependent launch, and the sm_90a pieces both wgmma kernels
// use (wgmma fences, mbarrier and TMA wrappers, natural-order dequant, the cluster epilogue).
//
// The mma K-permutation trick. A lane (g = lane/4, t = lane%4) of m16n8k16 holds B at logical
// k = {2t, 2t+1, 2t+8, 2t+9} of column g (and A at the same k of rows g and g+8). The order of k
// inside an mma does not matter as long as both operands use the same order, so over a 32-row K
// chunk lane t takes the physical rows 8t..8t+7: exactly one packed word per column. Two k16 steps
// consume it: the first gets the nibble pairs (0,4), (1,5), the second (2,6), (3,7) ((p, p+4)
// pairs sit 16 bits apart, so one shift aligns both halves of a half2). The lane's activation
// fragment is then one 16-byte load of A[row][k0+8t .. k0+8t+7], regrouped with byte permutes.
// The decode kernel makes the weights the mma's A operand: its rows g and g+8 are two of the
// lane's 4 columns, so one 16-byte load of 4 columns feeds 4 mmas per 8 activation rows.
#pragma once

#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "torch_marlin/quant_gemm_params.h"

// Each kernel file uses a subset of these helpers; nvcc warns about every unreferenced one (177),
// and the sm_90a helpers are referenced only from kernel bodies that compile for sm_90a alone
// (__CUDA_ARCH_FEAT_SM90_ALL).
#pragma nv_diagnostic push
#pragma nv_diag_suppress 177

namespace torch_marlin {
namespace {

using u32 = uint32_t;

// ---------------------------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------------------------

template <int SHIFT>
__device__ __forceinline__ u32 shift_left(u32 x) {
  if constexpr (SHIFT >= 0) return x << SHIFT;
  else return x >> (-SHIFT);
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) { return __byte_perm(a, b, sel); }

// Per-dtype pieces: the mma instruction, pair construction and the dequant bit tricks.
template <typename T>
struct Tr;

template <>
struct Tr<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ T2 dup(__half x) { return __half2half2(x); }
  // FP4 nibbles p and p+4 of w -> the E2M1 bit pattern scaled by 2^-14 (sign -> bit 15, e e m ->
  // exponent bits 1..0 and the top mantissa bit; E = 0 lands on fp16 subnormals, which is exactly
  // the E2M1 subnormal 0.5). Multiplying by 2^14 is exact.
  template <int P>
  static __device__ __forceinline__ u32 fp4_bits(u32 w) {
    return (shift_left<12 - 4 * P>(w) & 0x80008000u) | (shift_left<9 - 4 * P>(w) & 0x0E000E00u);
  }
  static constexpr unsigned short kFp4Rescale = 0x7400;  // 2^14
  static constexpr u32 kMagic = 0x64006400u;             // 1024.0: OR a nibble into the mantissa
  static constexpr float kMagicF = 1024.0f;
};

template <>
struct Tr<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ T2 dup(__nv_bfloat16 x) { return __bfloat162bfloat162(x); }
  // bf16: e e m -> bits 8..6 (exponent bits 1..0, top mantissa bit): value * 2^-126.
  template <int P>
  static __device__ __forceinline__ u32 fp4_bits(u32 w) {
    return (shift_left<12 - 4 * P>(w) & 0x80008000u) | (shift_left<6 - 4 * P>(w) & 0x01C001C0u);
  }
  static constexpr unsigned short kFp4Rescale = 0x7E80;  // 2^126
  static constexpr u32 kMagic = 0x43004300u;             // 128.0 (7 mantissa bits hold 0..15)
  static constexpr float kMagicF = 128.0f;
};

template <typename T2>
__device__ __forceinline__ u32 as_u32(T2 v) {
  return *reinterpret_cast<u32*>(&v);
}
template <typename T2>
__device__ __forceinline__ T2 as_t2(u32 v) {
  return *reinterpret_cast<T2*>(&v);
}

// T <-> fp32 for kernels instantiated for float as well as fp16 / bf16.
template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else return Tr<T>::to_f(v);
}
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else return Tr<T>::from_f(v);
}

// Shared-memory loads by shared-window address: a generic pointer would cost an address
// conversion per load. The u8 / u16 / v4 loads are volatile, which keeps them behind the cp.async
// waits of a ring they read (rans.cu); lds_u32 is free to move, for tables written before the
// block's loop (trellis_decode.cu).
__device__ __forceinline__ u32 smem_u32(const void* p) { return u32(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ u32 lds_u8(u32 a) {
  u32 v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ u32 lds_u16(u32 a) {
  u32 v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint4 lds_v4(u32 a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ u32 lds_u32(u32 a) {
  u32 v;
  asm("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}

template <typename T>
__device__ __forceinline__ T t_from_bits(unsigned short b) {
  return *reinterpret_cast<T*>(&b);
}

// magic + zero point (the value a U4 dequant subtracts from magic | nibble) from the low byte of z.
// Zero points are 0..15 (docs/formats.md); the kernels use the byte's low 4 bits, as the CPU and
// Metal kernels do, so an out-of-range byte gives the same value on every backend. One int -> float
// -> T conversion a zero point (a byte-permute form was no faster: benchmarks/notes/cuda-tuning.md
// U4-ZERO-CONVERT).
template <typename T>
__device__ __forceinline__ T magic_zero(u32 z) {
  return Tr<T>::from_f(Tr<T>::kMagicF + float(z & 0xFu));
}

// Per-column dequant constants for one group: the scale pair and, for U4, the (magic + zero)
// pair, for affine the offset pair.
template <typename T>
struct ColQ {
  typename Tr<T>::T2 s2, z2;
};

// Dequantizes the nibble pair (P, P+4) of word w into a 2 x T register (lo = nibble P).
template <typename T, u32 FMT, int P>
__device__ __forceinline__ u32 dequant_pair(u32 w, const ColQ<T>& q) {
  using T2 = typename Tr<T>::T2;
  if constexpr (FMT == TM_FORMAT_FP4) {
    const T2 r = Tr<T>::dup(t_from_bits<T>(Tr<T>::kFp4Rescale));
    const T2 v = as_t2<T2>(Tr<T>::template fp4_bits<P>(w));
    return as_u32(__hmul2(__hmul2(v, r), q.s2));
  } else if constexpr (FMT == TM_FORMAT_AFFINE) {
    // (magic | q) - magic = q exactly; then q * s + b rounded once, as the reference rounds it.
    const u32 x = (shift_left<-4 * P>(w) & 0x000F000Fu) | Tr<T>::kMagic;
    return as_u32(__hfma2(__hsub2(as_t2<T2>(x), as_t2<T2>(Tr<T>::kMagic)), q.s2, q.z2));
  } else {
    const u32 x = (shift_left<-4 * P>(w) & 0x000F000Fu) | Tr<T>::kMagic;
    return as_u32(__hmul2(__hsub2(as_t2<T2>(x), q.z2), q.s2));
  }
}


// Four columns' constants from 4 scales (8 bytes) and 4 zero points (4 bytes, U4) or 4 offsets
// (8 bytes, affine).
template <typename T, u32 FMT>
__device__ __forceinline__ void make_colq(ColQ<T> (&q)[4], uint2 s4, u32 z4, uint2 b4 = make_uint2(0u, 0u)) {
  const T* s = reinterpret_cast<const T*>(&s4);
  const T* b = reinterpret_cast<const T*>(&b4);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    q[j].s2 = Tr<T>::dup(s[j]);
    if constexpr (FMT == TM_FORMAT_U4) {
      q[j].z2 = Tr<T>::dup(magic_zero<T>(z4 >> (8 * j)));
    } else if constexpr (FMT == TM_FORMAT_AFFINE) {
      q[j].z2 = Tr<T>::dup(b[j]);
    }
  }
}


// Four packed words (4 columns x 8 rows of k) -> b[j][P] = the scaled nibble pair (P, P+4) of
// column j.
template <typename T, u32 FMT>
__device__ __forceinline__ void dequant_words(u32 (&b)[4][4], const uint4& words, const ColQ<T> (&q)[4]) {
  const u32 w[4] = {words.x, words.y, words.z, words.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    b[j][0] = dequant_pair<T, FMT, 0>(w[j], q[j]);
    b[j][1] = dequant_pair<T, FMT, 1>(w[j], q[j]);
    b[j][2] = dequant_pair<T, FMT, 2>(w[j], q[j]);
    b[j][3] = dequant_pair<T, FMT, 3>(w[j], q[j]);
  }
}

// bar.sync over threads 0 .. nthreads - 1 of the block (a multiple of 32): wgmma_ws's consumer
// warpgroups synchronize without its producer.
__device__ __forceinline__ void named_barrier(u32 id, u32 nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

// K-parallel arrival, after a block has written its fp32 partial tile to global memory: true for
// the last of the k_parallel blocks of output tile `tile` to arrive (a per-tile counter), which
// then sums every slice's partials in slice order, so the result is bitwise
// reproducible whichever block comes last and no second launch is needed. Counters live in the
// call's workspace and start at zero (launch.cu zeroed_tile_counters). Threads 0 .. nthreads - 1
// take part, synchronized by named barrier bar_id.
__device__ bool last_arrival(u32 k_parallel, int* counters, u32 tile, u32 tid, u32 nthreads, u32 bar_id) {
  __shared__ int is_last;
  __threadfence();  // this block's partials are visible device-wide before it is counted
  named_barrier(bar_id, nthreads);
  if (tid == 0) {
    is_last = atomicAdd(counters + tile, 1) == int(k_parallel) - 1;
  }
  named_barrier(bar_id, nthreads);
  if (!is_last) return false;
  __threadfence();
  return true;
}

// The portable reference dequant of one code (fp32 paths: simt, dequant to float); z is the zero
// point (U4) or the offset (affine).
template <u32 FMT>
__device__ __forceinline__ float dequant_scalar(u32 code, float s, float z) {
  if constexpr (FMT == TM_FORMAT_FP4) return fp4_e2m1_to_float(code) * s;
  else if constexpr (FMT == TM_FORMAT_AFFINE) return fmaf(float(code), s, z);
  else return (float(code) - z) * s;
}

// Programmatic dependent launch (PDL; GemmPlan::dependent_launch, which the planner sets for
// decode on the devices that run clusters and for wgmma_ws; benchmarks/notes/cuda-tuning.md CUDA-PDL): a
// kernel launched with it may start while the previous kernel on the stream still runs, once
// every block of that kernel has called pdl_launch_dependents() (the first thread of a block to
// call it counts for the block) or exited; pdl_wait() then blocks until that kernel has finished
// and its writes are visible. pdl_wait() is a no-op for a kernel launched without PDL.
// The protocol every kernel here keeps, because the next kernel need not be ours:
//  - pdl_launch_dependents() comes after the kernel's own pdl_wait() (launched without PDL, the
//    kernels before it have finished: anywhere);
//  - the last kernel of an op's call calls it only once it no longer touches the call's workspace
//    (a kernel followed by another of its call, which waits before it reads, may call it earlier).
// Inductor's kernels launched with PDL (torch._inductor.config.triton.enable_pdl; StaticDecoder's
// compiled step) read, before their wait, buffers that the previous kernel neither reads nor
// writes, and may write there. After a trigger kept to the protocol every kernel before the
// triggering one has finished, and the workspace, freed when the op returns and so the next
// kernel's to take, is no longer used.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// ---------------------------------------------------------------------------------------------
// sm_90a: wgmma, mbarrier, TMA (the wgmma and wgmma_ws kernels)
// ---------------------------------------------------------------------------------------------
constexpr int kWgKStep = int(TM_CUDA_WGMMA_K_STEP);  // K rows of one pipeline stage

// Eight accumulator operands d[i .. i + 7] of a wgmma asm statement (the SS and RS forms below).
#define TM_D8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wg_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps the compiler from moving accesses of r across the asynchronous wgmma boundaries.
__device__ __forceinline__ void wg_pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// Makes this thread's generic-proxy shared-memory stores visible to wgmma (the async proxy).
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
// 16 bytes global -> shared, bypassing L1; src_bytes < 16 zero-fills the rest (0: reads nothing, so
// src need only be a valid address).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes = 16u) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// mbarrier and TMA (cp.async.bulk.tensor) wrappers: shared-memory addresses as u32.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Spins until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One 2-D TMA box at coordinates (c0 innermost, c1) into dst, completing bytes on bar.
__device__ __forceinline__ void tma_load_2d(u32 dst, const CUtensorMap* map, u32 c0, u32 c1, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// bytes (a multiple of 16) of contiguous global memory into dst (both 16-byte aligned), completing
// on bar: a plain bulk copy, no tensor map.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// The box at (c0, c1) of a tensor map into L2 only (no shared memory, no barrier).
__device__ __forceinline__ void tma_prefetch_l2_2d(const CUtensorMap* map, u32 c0, u32 c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(map), "r"(c0), "r"(c1)
               : "memory");
}

// K-major, no-swizzle shared-memory matrix descriptor: lbo = bytes between the two core matrices
// of a k16 step (adjacent in k), sbo = bytes between core matrices 8 rows apart.
__device__ __forceinline__ uint64_t wg_desc(u32 smem_addr, u32 lbo, u32 sbo) {
  return uint64_t((smem_addr & 0x3FFFFu) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32);
}

// The RS form: the A operand (64 rows x k16) from registers, B from shared memory (the wgmma_ws
// kernel and the trellis wgmma kernel keep their dequantized weights in registers as A).
#define TM_WGMMA_RS64(TY)                                                                        \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "                       \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
               "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"                                                     \
               : TM_D8(0), TM_D8(8), TM_D8(16), TM_D8(24)  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
#define TM_WGMMA_RS128(TY)                                                                        \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                       \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
               "{%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"                                                     \
               : TM_D8(0), TM_D8(8), TM_D8(16), TM_D8(24), TM_D8(32), TM_D8(40), TM_D8(48), TM_D8(56)  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
#define TM_WGMMA_RS256(TY)                                                                        \
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "                       \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "  \
               "{%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"                                                     \
               : TM_D8(0), TM_D8(8), TM_D8(16), TM_D8(24), TM_D8(32), TM_D8(40), TM_D8(48), TM_D8(56), TM_D8(64), TM_D8(72), TM_D8(80), TM_D8(88), TM_D8(96), TM_D8(104), TM_D8(112), TM_D8(120)  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))

// d[BN / 2] += A (64 x 16, registers) x B (16 x BN, shared memory descriptor, K-major).
template <typename T, int BN>
__device__ __forceinline__ void wgmma_rs(float* d, const u32 (&a)[4], uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kH = std::is_same<T, __half>::value;
  if constexpr (BN == 64) {
    if constexpr (kH) TM_WGMMA_RS64("f16");
    else TM_WGMMA_RS64("bf16");
  } else if constexpr (BN == 128) {
    if constexpr (kH) TM_WGMMA_RS128("f16");
    else TM_WGMMA_RS128("bf16");
  } else {
    if constexpr (kH) TM_WGMMA_RS256("f16");
    else TM_WGMMA_RS256("bf16");
  }
#endif
}
#undef TM_WGMMA_RS64
#undef TM_WGMMA_RS128
#undef TM_WGMMA_RS256

// FP4 word -> its 8 unscaled values in natural k order, h[i] = (k 2i, k 2i + 1), by table lookup:
// a byte permute picks 4 of 8 table bytes by the low 3 bits of 4 selector nibbles, so one prmt
// turns 4 codes' magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) into the high bytes of their exact fp16
// (low bytes all 0) or bf16 values; the signs are ORed into those bytes and a second prmt places
// the bytes in k order. 19 instructions a word against 28 for the shift/mask form with its 2^-14
// rescale (the wgmma kernels are issue-bound). Products with the scale are the same single
// rounding of value x scale as the shift/mask form.
template <typename T>
__device__ __forceinline__ void fp4_natural(u32 w, u32 (&h)[4]) {
  const u32 idx_lo = w & 0x77777777u, idx_hi = idx_lo >> 16;  // magnitudes of codes 0..3, 4..7
  // Byte j bit 7 = sign of code 2j (even) / 2j + 1 (odd), then in code order 0..3 and 4..7.
  const u32 even = (w << 4) & 0x80808080u, odd = w & 0x80808080u;
  const u32 sign_lo = prmt(even, odd, 0x5140), sign_hi = prmt(even, odd, 0x7362);
  if constexpr (std::is_same<T, __half>::value) {
    constexpr u32 kHi0 = 0x3E3C3800u, kHi1 = 0x46444240u;  // fp16 high bytes of magnitudes 0..7
    const u32 lo4 = prmt(kHi0, kHi1, idx_lo) | sign_lo, hi4 = prmt(kHi0, kHi1, idx_hi) | sign_hi;
    h[0] = prmt(lo4, 0u, 0x1404);  // (k0, k1): bytes 0, hi(k0), 0, hi(k1)
    h[1] = prmt(lo4, 0u, 0x3424);
    h[2] = prmt(hi4, 0u, 0x1404);
    h[3] = prmt(hi4, 0u, 0x3424);
  } else {
    constexpr u32 kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;  // bf16 high bytes
    constexpr u32 kLo0 = 0xC0800000u, kLo1 = 0xC0804000u;  // bf16 low bytes
    const u32 lo4h = prmt(kHi0, kHi1, idx_lo) | sign_lo, hi4h = prmt(kHi0, kHi1, idx_hi) | sign_hi;
    const u32 lo4l = prmt(kLo0, kLo1, idx_lo), hi4l = prmt(kLo0, kLo1, idx_hi);
    h[0] = prmt(lo4l, lo4h, 0x5140);  // (k0, k1): lo(k0), hi(k0), lo(k1), hi(k1)
    h[1] = prmt(lo4l, lo4h, 0x7362);
    h[2] = prmt(hi4l, hi4h, 0x5140);
    h[3] = prmt(hi4l, hi4h, 0x7362);
  }
}

// U4 / affine word -> 8 values in natural k order: the pairs (k p, k p + 4) dequantized with q
// (whose two halves may belong to different columns: lo for k 0..3, hi for k 4..7), then regrouped.
template <typename T, u32 FMT>
__device__ __forceinline__ uint4 int4_natural(u32 w, const ColQ<T>& q) {
  static_assert(FMT == TM_FORMAT_U4 || FMT == TM_FORMAT_AFFINE, "the magic-number formats");
  const u32 d0 = dequant_pair<T, FMT, 0>(w, q), d1 = dequant_pair<T, FMT, 1>(w, q);
  const u32 d2 = dequant_pair<T, FMT, 2>(w, q), d3 = dequant_pair<T, FMT, 3>(w, q);
  // d_p = (k p, k p + 4): regroup into (0, 1), (2, 3), (4, 5), (6, 7).
  return make_uint4(prmt(d0, d1, 0x5410), prmt(d2, d3, 0x5410), prmt(d0, d1, 0x7632), prmt(d2, d3, 0x7632));
}

// Stores an output pair C[row][col, col + 1] (just col unless pair): one 4-byte store when the row
// stride keeps it aligned (N even; col is even in both wgmma epilogues).
template <typename T>
__device__ __forceinline__ void store_c_pair(T* dst, float v0, float v1, bool pair, u32 N) {
  if (pair && N % 2u == 0u) {
    typename Tr<T>::T2 v;
    v.x = Tr<T>::from_f(v0);
    v.y = Tr<T>::from_f(v1);
    *reinterpret_cast<typename Tr<T>::T2*>(dst) = v;
  } else {
    dst[0] = Tr<T>::from_f(v0);
    if (pair) dst[1] = Tr<T>::from_f(v1);
  }
}

// K-slice epilogue of the wgmma kernels (ReduceKind::Cluster): the slices of an
// output tile run as one cluster (dims (1, 1, k_parallel): cluster rank = slice) and every block
// has left its fp32 partial tile part[rows][TN] in its own shared memory. After a cluster barrier
// block r sums rows [r rows / kp, (r + 1) rows / kp) over all blocks' tiles in slice order
// (deterministic), adds the bias and writes C; a second barrier keeps every block resident until
// the others have read its shared memory. Threads tid = 0 .. nthreads - 1 share the sums; every
// other thread of the cluster must pass the two barriers too.
template <typename T, int TN>
__device__ void wgmma_cluster_reduce(const QuantGemmParams& p, const float* part, u32 rows, u32 m0, u32 n0,
                                     const T* bias, T* C, u32 tid, u32 nthreads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const u32 kp = p.k_parallel, rank = cluster.block_rank();
  const u32 rows_per = (rows + kp - 1u) / kp;
  const u32 r_end = min(rows, (rank + 1u) * rows_per);
  constexpr u32 kQuads = u32(TN) / 4u;  // 4 columns a thread and step
  for (u32 v = rank * rows_per * kQuads + tid; v < r_end * kQuads; v += nthreads) {
    const u32 r = v / kQuads, c4 = 4u * (v % kQuads);
    const u32 row = m0 + r, col = n0 + c4;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (u32 sl = 0; sl < kp; ++sl) {
      const float4 x = *reinterpret_cast<const float4*>(cluster.map_shared_rank(part, sl) + r * TN + c4);
      sum.x += x.x;
      sum.y += x.y;
      sum.z += x.z;
      sum.w += x.w;
    }
    if (row >= p.M) continue;
    const float v4[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (u32 q = 0; q < 4u; ++q)
      if (col + q < p.N) C[size_t(row) * p.N + col + q] = Tr<T>::from_f(v4[q] + (p.has_bias ? Tr<T>::to_f(bias[col + q]) : 0.f));
  }
  cluster.sync();
#else
  __trap();
#endif
}

}  // namespace
}  // namespace torch_marlin

#pragma nv_diagnostic pop
