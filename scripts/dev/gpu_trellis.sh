#!/usr/bin/env bash
# The CUDA trellis kernels on a GPU machine, in one go (docs/trellis.md, "CUDA"): build (sm_90a) ->
# the trellis op tests on CUDA -> compute-sanitizer memcheck + racecheck of
# scripts/dev/cuda_sanitize_trellis.py -> the trellis benchmark (scripts/dev/bench_cuda.py --trellis).
# Logs go to $OUT (default ./cuda_results). STEPS=build,test,sanitize,bench selects steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/cuda_results}"; mkdir -p "$OUT"
STEPS="${STEPS:-build,test,sanitize,bench}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
has() { [[ ",$STEPS," == *",$1,"* ]]; }
eval "$(python csrc/cuda/host_compiler.py)"  # g++-12 over a g++ 13+ (docs/limitations.md)
if has build; then
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
  ( time TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}" \
      python setup.py build_ext --inplace ) > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  tail -3 "$OUT/build.log"
fi
if has test; then
  timeout "${TEST_TIMEOUT:-240}" python -m pytest tests/test_trellis_ops.py tests/test_opcheck.py tests/test_cuda_graphs.py \
    -k "cuda and trellis and not metal_emu" -q --maxfail=20 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test_trellis_cuda.log" | tail -30
fi
if has sanitize; then
  python scripts/dev/cuda_sanitize_trellis.py 2>&1 | tee "$OUT/trellis_subset.log" | tail -20
  for tool in memcheck racecheck; do
    args=(); [ "$tool" = racecheck ] && args=(--no-blas)  # racecheck flags cuBLAS's own kernels
    timeout "${SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      python scripts/dev/cuda_sanitize_trellis.py "${args[@]}" > "$OUT/sanitize_trellis_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; tail -4 "$OUT/sanitize_trellis_$tool.log"
  done
fi
if has bench; then
  timeout "${BENCH_TIMEOUT:-200}" python scripts/dev/bench_cuda.py --trellis --out "$OUT" \
    --shapes "${BENCH_SHAPES:-4096x4096,4096x14336,14336x4096}" --ms "${BENCH_MS:-1,16,64,256,1024,4096}" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench_trellis.log" | grep -v '^|'
fi
