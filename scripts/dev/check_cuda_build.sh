#!/usr/bin/env bash
# Compile-checks the CUDA sources with nvcc on a machine without a GPU (and with a CPU-only torch):
# catches CUDA build breaks in CI. Needs nvcc on PATH (or CUDA_HOME); skips with a message if absent.
# Usage: scripts/dev/check_cuda_build.sh [arch ...]   (default: sm_80 sm_90a, setup.py's default targets)
# CUDA_CHECK_JOBS=N: nvcc processes at once (default: one per core).
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ] && [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
if [ -z "$NVCC" ]; then echo "check_cuda_build: nvcc not found, skipping"; exit 0; fi
PY="${PYTHON:-python}"
TORCH_INC=$("$PY" -c 'from torch.utils import cpp_extension as c; print(" ".join("-I" + p for p in c.include_paths()))')
ARCHS=("$@"); [ ${#ARCHS[@]} -eq 0 ] && ARCHS=(sm_80 sm_90a)
OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT
# A CPU-only torch ships c10/cuda headers without the one its CMake generates for CUDA builds;
# supply it (same content as a CUDA build's) when missing so the sources compile here.
SHIM=""
if ! "$PY" -c 'import os,sys; from torch.utils import cpp_extension as c; sys.exit(0 if any(os.path.exists(os.path.join(p, "c10/cuda/impl/cuda_cmake_macros.h")) for p in c.include_paths()) else 1)'; then
  mkdir -p "$OUT/shim/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$OUT/shim/c10/cuda/impl/cuda_cmake_macros.h"
  SHIM="-I$OUT/shim"
fi
# One nvcc per (source, arch), as many at once as there are cores: the sm_90a passes dominate.
# -cubin: the CUDA front end parses and checks the whole source (host code included) and the device
# code is compiled and assembled by ptxas (inline PTX checked), but the host object is not built:
# g++ over the ATen headers was three quarters of the time. The device code is optimized at -O1
# (cicc and ptxas): this looks for build breaks, not speed, and -O3 cost a third more time on the
# wgmma kernels. The GPU machine's setup.py build is the full, optimized compile.
compile_one() {
  local src=$1 arch=$2 extra=""
  [ "$arch" = sm_90a ] && extra="-DTM_CUDA_SM90A"  # as setup.py defines for 9.0a
  echo "nvcc -arch=$arch $src"
  # shellcheck disable=SC2086
  "$NVCC" -std=c++20 -Xcicc -O1 -Xptxas -O1 --expt-relaxed-constexpr -arch="$arch" -cubin "$src" -I csrc \
    -I csrc/include $TORCH_INC $SHIM -DTM_WITH_CUDA $extra -o "$OUT/$(basename "$src" .cu)_$arch.cubin"
}
export -f compile_one; export NVCC TORCH_INC SHIM OUT
for src in csrc/cuda/*.cu; do for arch in "${ARCHS[@]}"; do echo "$src $arch"; done; done |
  xargs -P "${CUDA_CHECK_JOBS:-$(nproc)}" -n 2 bash -c 'compile_one "$0" "$1"'
for src in scripts/dev/*.cu; do  # standalone GPU microbenchmarks (no torch)
  echo "nvcc -arch=sm_90 $src"
  "$NVCC" -std=c++17 -O3 -arch=sm_90 -c "$src" -o "$OUT/$(basename "$src" .cu).o"
done
echo "check_cuda_build: OK"
