#!/usr/bin/env bash
# The CUDA rANS kernels on a GPU machine, in one go (docs/cuda.md "rANS-coded layers"):
#   build -> tests (tests/test_rans_ops.py on CUDA, the gemm_rans graph capture) ->
#   compute-sanitizer memcheck + racecheck on scripts/dev/cuda_rans_subset.py -> ncu --set full
#   of one fused launch at M = 1 on 4096 x 4096 -> benchmark (scripts/dev/bench_cuda_rans.py).
# Logs go to $OUT (default ./cuda_results). STEPS=build,test,sanitize,ncu,bench selects steps.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/cuda_results}"; mkdir -p "$OUT"
STEPS="${STEPS:-build,test,sanitize,ncu,bench}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
has() { [[ ",$STEPS," == *",$1,"* ]]; }
eval "$(python csrc/cuda/host_compiler.py)"  # g++-12 over a g++ 13+ (docs/limitations.md)
if has build; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  ( time TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}" \
      python setup.py build_ext --inplace ) > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  tail -3 "$OUT/build.log"
  grep -A2 "rans" "$OUT/build.log" | grep -E "registers|spill" | sort | uniq -c | head -20
fi
if has test; then
  timeout 300 python -m pytest tests/test_rans_ops.py tests/test_cuda_graphs.py::test_captured_gemm_rans_equals_eager -k cuda -q --maxfail=20 \
    2>&1 | tee "$OUT/test_rans.log" | tail -25
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      python scripts/dev/cuda_rans_subset.py > "$OUT/sanitize_rans_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"; tail -4 "$OUT/sanitize_rans_$tool.log"
  done
fi
if has ncu; then
  # One fused launch at M = 1 with the format's default width (C = 0) and with one channel per tile,
  # and the uncoded FP4 decode kernel on the same shape for comparison.
  for C in 0 1; do
    timeout 150 ncu --set full --import-source yes --kernel-name "regex:gemm_rans_kernel" --launch-skip 2 --launch-count 1 \
      -f -o "$OUT/ncu_gemm_rans_m1_c$C" python scripts/dev/cuda_rans_subset.py --profile fp4 1 4096 4096 "$C" \
      > "$OUT/ncu_gemm_rans_m1_c$C.log" 2>&1
    ncu -i "$OUT/ncu_gemm_rans_m1_c$C.ncu-rep" > "$OUT/ncu_gemm_rans_m1_c$C.txt" 2>&1
    ncu -i "$OUT/ncu_gemm_rans_m1_c$C.ncu-rep" --page source --csv --print-source sass > "$OUT/src_c$C.csv" 2>/dev/null
    python scripts/dev/ncu_stall_lines.py "$OUT/src_c$C.csv" > "$OUT/ncu_gemm_rans_m1_c${C}_stalls.txt" 2>&1
    rm -f "$OUT/src_c$C.csv"
    echo "== gemm_rans M=1 4096x4096 C=$C"
    grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|Executed Ipc A|Issue Slots Busy|Achieved Occupancy|Registers Per|Theoretical Occ|Warp Cycles Per Issued|Block Limit" \
      "$OUT/ncu_gemm_rans_m1_c$C.txt" | head -20
    head -25 "$OUT/ncu_gemm_rans_m1_c${C}_stalls.txt"
  done
  timeout 120 ncu --set full --kernel-name "regex:decode_kernel" --launch-skip 2 --launch-count 1 \
    python scripts/dev/cuda_profile_one.py fp4 1 4096 4096 > "$OUT/ncu_decode_fp4_m1.txt" 2>&1
  echo "== gemm_fp4 decode M=1 4096x4096"
  grep -E "Duration|DRAM Throughput|Executed Ipc A|Achieved Occupancy" "$OUT/ncu_decode_fp4_m1.txt" | head -8
fi
if has bench; then
  timeout 400 python scripts/dev/bench_cuda_rans.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_cuda_rans.log" \
    | grep -v '^|'
fi
