#!/usr/bin/env bash
# Everything the CUDA backend needs on a GPU machine, in one go (docs/cuda.md):
#   build (sm_90a unless TORCH_CUDA_ARCH_LIST says otherwise; g++-12 where installed, see below) ->
#   the CUDA tests and every backend-parametrized test on CUDA ->
#   compute-sanitizer memcheck + racecheck on scripts/dev/cuda_sanitize_subset.py -> benchmark.
# Logs go to $OUT (default ./cuda_results). STEPS=build,test,sanitize,bench selects steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/cuda_results}"; mkdir -p "$OUT"
STEPS="${STEPS:-build,test,sanitize,bench}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
has() { [[ ",$STEPS," == *",$1,"* ]]; }
eval "$(python csrc/cuda/host_compiler.py)"  # g++-12 over a g++ 13+ (docs/limitations.md)
if has build; then
  echo "host compiler: ${CXX:-default}" | tee "$OUT/gpu.txt"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/gpu.txt"
  python -c 'import torch; print(torch.__version__, torch.version.cuda)' | tee -a "$OUT/gpu.txt"
  ( time TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}" \
      python setup.py build_ext --inplace ) > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  tail -3 "$OUT/build.log"
fi
if has test; then
  # The harness-backend cases (metal_emu) need no GPU and run in CI.
  python -m pytest tests/test_cuda.py tests/test_gemm.py tests/test_trellis_ops.py tests/test_opcheck.py \
    tests/test_planner.py tests/test_quant_gemm.py tests/test_modules.py tests/test_trellis.py tests/test_gradients.py tests/test_quantizers.py \
    -k "not metal_emu" \
    -q --maxfail=30 --durations=5 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test_cuda.log" | tail -25
fi
if has sanitize; then
  # racecheck skips the dequant_blas cases: our dequant kernel uses no shared memory, and racecheck
  # reports hazards inside cuBLAS's Hopper GEMM kernels (nvjet_*), which are not ours to fix.
  for tool in memcheck racecheck; do
    args=(); [ "$tool" = racecheck ] && args=(--no-blas)
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      python scripts/dev/cuda_sanitize_subset.py "${args[@]}" > "$OUT/sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; tail -4 "$OUT/sanitize_$tool.log"
  done
fi
if has bench; then
  python scripts/dev/bench_cuda.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_cuda.log" | grep -v '^|'
fi
