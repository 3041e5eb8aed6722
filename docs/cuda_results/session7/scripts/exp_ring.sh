#!/usr/bin/env bash
# Session 7: the wgmma kernel's weight-ring depth. For each "W128 W256" pair: set
# WgSmem::kWStages, widen the wgmma policy to 32 < M <= 512 with any tile count (so M = 64 and the
# 4096-column layers take it), rebuild (sm_90a), run the wgmma tests, time exp_ring.py.
#   VARIANTS="4:4 12:6" bash docs/cuda_results/session7/scripts/exp_ring.sh
set -uo pipefail
cd "$(dirname "$0")/../../../.."
OUT="${OUT:-/tmp/out}"; export PYTHONPATH=$PWD
cp csrc/cuda/quant_gemm.cu /tmp/qg.cu.orig; cp csrc/plan/plan.cpp /tmp/plan.cpp.orig
sed -i 's/constexpr int64_t kCudaWgmmaMinM = 64;/constexpr int64_t kCudaWgmmaMinM = 32;/; s/constexpr int64_t kCudaWgmmaMinTiles = 64;/constexpr int64_t kCudaWgmmaMinTiles = 1;/' csrc/plan/plan.cpp
# WIDE=1: also above 512 rows and past one wave of 256-row tiles.
[ -n "${WIDE:-}" ] && sed -i 's/constexpr int64_t kCudaWgmmaMaxM = 512;/constexpr int64_t kCudaWgmmaMaxM = 1 << 20;/; s/(M <= 256 || tiles <= caps.compute_units)/true/' csrc/plan/plan.cpp
for v in ${VARIANTS:-12:6}; do  # "W128:W256"; a tag without ":" keeps the source as it is
  w128=${v%:*}; w256=${v#*:}
  cp /tmp/qg.cu.orig csrc/cuda/quant_gemm.cu
  sed -i "s/static constexpr int kWStages = BM == 128 ? [0-9]* : [0-9]*;/static constexpr int kWStages = BM == 128 ? $w128 : $w256;/" csrc/cuda/quant_gemm.cu
  grep -n "kWStages = " csrc/cuda/quant_gemm.cu
  rm -rf build torch_marlin/_C*.so
  TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 python setup.py build_ext --inplace > "$OUT/build_${w128}_${w256}.log" 2>&1 || { tail -30 "$OUT/build_${w128}_${w256}.log"; exit 1; }
  python -m pytest tests/test_cuda.py -q -k "wgmma" 2>&1 | tail -2
  python docs/cuda_results/session7/scripts/exp_ring.py "W$w128/$w256" ${MS:-64,96,128,256,512,1024} 2>&1 | tee -a "$OUT/exp_ring.txt"
done
cp /tmp/qg.cu.orig csrc/cuda/quant_gemm.cu; cp /tmp/plan.cpp.orig csrc/plan/plan.cpp
