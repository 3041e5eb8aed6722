// rANS-coded 4-bit codes: format constants and launch parameters shared byte-for-byte by the host
// (C++), the Metal kernels (MSL, also run by the Metal-on-CPU harness) and the CUDA kernels.
// The format is specified in docs/formats.md, "rANS-coded 4-bit codes".
//
// Same rules as quant_gemm_params.h: fixed-width unsigned fields only, no pointers, no bool, no
// constructors.
#pragma once

#include "torch_marlin/portable.h"

TM_NAMESPACE_BEGIN

#define TM_RANS_PROB_BITS 12u                    // frequencies of a tile sum to 1 << 12
#define TM_RANS_PROB_SCALE 4096u
#define TM_RANS_PROB_MASK 4095u
#define TM_RANS_STATE_LOW 65536u                 // L: states lie in [L, 2^32)
#define TM_RANS_WORD_BITS 16u                    // renormalization reads one 16-bit word
#define TM_RANS_LANES 32u                        // interleaved lane states per tile
#define TM_RANS_SYMBOLS 16u                      // 4-bit codes
#define TM_RANS_STREAM_ALIGN_WORDS 8u            // each tile's stream starts on 16 bytes
#define TM_RANS_MIN_LANE_SYMBOLS 1024u           // default channels_per_tile = ceil(32 * this / K)
// gemm_rans: up to this many rows of A, each tile's codes are decoded and multiplied in one pass
// (the dense weight never exists); above it, decoding is amortized over enough rows that the
// layer is decoded to B_packed once and multiplied by the dense GEMM of its format.
#define TM_RANS_FUSED_MAX_M 16u

// CUDA kernels (csrc/cuda/rans.cu): warps, one per tile, per block.
#define TM_CUDA_RANS_WARPS 4u

// Metal (metal/rans.metal): one simdgroup per tile, its stream staged into a threadgroup ring of
// this many 16-bit words (a power of two, refilled 256 words = one 16-byte load per lane at a time).
#define TM_METAL_RANS_THREADS 32u
#define TM_METAL_RANS_RING_WORDS 512u

// Launch parameters of the rANS kernels (gemm_rans decode, rans_decode to B_packed). The planner
// (plan_rans_gemm) fills it once; every backend reads it.
struct RansParams {
  tm_u32 M;                  // rows of A (0 for rans_decode)
  tm_u32 K;                  // multiple of 32
  tm_u32 N;                  // any positive value
  tm_u32 group_size;         // multiple of 32 dividing K
  tm_u32 n_groups;           // K / group_size
  tm_u32 format;             // TM_FORMAT_FP4, TM_FORMAT_U4 or TM_FORMAT_AFFINE (quant_gemm_params.h)
  tm_u32 channels_per_tile;  // C: output channels per tile
  tm_u32 tiles;              // T = ceil(N / C)
  tm_u32 steps_per_channel;  // K / 32
  tm_u32 has_bias;           // 1 when a bias is added
  tm_u32 n_words;            // W = len(words): GPU kernels clamp every tile's stream to it
};

TM_NAMESPACE_END
