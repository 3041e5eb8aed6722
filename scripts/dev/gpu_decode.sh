#!/usr/bin/env bash
# Model-level decode speed on a GPU machine (H100 / H200), in one go: build (sm_90a) -> the CUDA tests
# of the decode path, fused projections and the compiled decode step -> the Llama-3-8B layer shapes
# at M = 1 alone (scripts/dev/bench_cuda.py --graph --rotate) -> scripts/bench_e2e.py on the 32-layer
# 8B shape at batch 1, CUDA graph and compile + graph, float16 / fp4 / u4, fused and not, each run
# with its step profile (--profile), and the no_linear model -> (STEPS=batches) eager / graph at
# batch 1, 4, 16, compile at 4 and 16, fused fp4 with lm_head quantized.
# Logs go to $OUT (default ./cuda_results), one file per step. Each step has a time limit so that
# STEPS=build,test,isolated, STEPS=e2e and STEPS=batches each end within 10 minutes
# (run them as separate commands on one machine: the build and inductor's caches carry over); the
# default runs build,test,isolated,e2e in one go (about 15 minutes).
# E2E_ARGS: more bench_e2e.py arguments (a CPU check of the steps: E2E_ARGS="--device cpu --layers 1 ...").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/cuda_results}"; mkdir -p "$OUT"
STEPS="${STEPS:-build,test,isolated,e2e}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
has() { [[ ",$STEPS," == *",$1,"* ]]; }
eval "$(python csrc/cuda/host_compiler.py)"  # g++-12 over a g++ 13+ (docs/limitations.md)
SHAPES="4096x1024,4096x4096,4096x6144,4096x14336,4096x28672,14336x4096,4096x128256"
SCRATCH="$(mktemp -d)"  # bench_cuda.py's csv / md: the logs hold the same rows
build() {  # $1: log file (appended)
  ( time TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}" \
      python setup.py build_ext --inplace ) >> "$1" 2>&1 || { tail -60 "$1"; return 1; }
  tail -3 "$1"
}
e2e() {  # $1: log, $2: time limit (s), then bench_e2e.py arguments
  local log="$1" limit="$2"; shift 2
  echo "== bench_e2e.py $*" | tee -a "$log"
  timeout "$limit" python scripts/bench_e2e.py --prompt 32 --new-tokens "${NEW_TOKENS:-16}" "$@" ${E2E_ARGS:-} 2>&1 \
    | grep -v 'bench_e2e:' | tee -a "$log" | grep -E '^\| (float16|fp4|u4|no_linear) |^note|^step profile'
}
if has build; then
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/build.log"
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/build.log"
  build "$OUT/build.log" || exit 1
fi
if has test; then
  # The captured decode step (float, quantized, fused) against eager; the decode kernels; the compiled
  # decode step (one graph, no recompiles, inductor + CUDA graph) and the fused families.
  timeout "${TEST_TIMEOUT:-200}" python -m pytest tests/test_cuda_graphs.py tests/test_compile.py tests/test_fusion.py \
    -q --maxfail=20 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test.log" | tail -15
  timeout 120 python -m pytest tests/test_cuda.py -k decode -q --maxfail=20 2>&1 | tee -a "$OUT/test.log" | tail -5
fi
if has isolated; then
  timeout 150 python scripts/dev/bench_cuda.py --graph --rotate --ms 1 --shapes "$SHAPES" --out "$SCRATCH" 2>&1 \
    | tee "$OUT/isolated.log" | grep -v '^|'
fi
if has e2e; then
  : > "$OUT/e2e.log"
  e2e "$OUT/e2e.log" 270 --formats float,fp4,u4 --batch 1 --modes graph,compile --profile
  e2e "$OUT/e2e.log" 190 --formats fp4,u4 --fuse --batch 1 --modes graph,compile --profile
  e2e "$OUT/e2e.log" 80 --formats no_linear --batch 1 --modes graph,compile
fi
if has batches; then
  : > "$OUT/batches.log"
  e2e "$OUT/batches.log" 150 --formats float,fp4,u4 --batch 1,4,16 --modes eager,graph
  e2e "$OUT/batches.log" 110 --formats fp4,u4 --fuse --batch 1,4,16 --modes eager,graph
  e2e "$OUT/batches.log" 120 --formats float,fp4 --batch 16 --modes compile
  e2e "$OUT/batches.log" 120 --formats fp4 --fuse --batch 4,16 --modes compile
  e2e "$OUT/batches.log" 90 --formats fp4 --fuse --quantize-lm-head --batch 1 --modes graph,compile --profile
fi
rm -rf "$SCRATCH"
