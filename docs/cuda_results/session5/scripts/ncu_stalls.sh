#!/usr/bin/env bash
# session 5: ncu stall breakdown of the decode kernel at M = 64
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
STEPS=build bash scripts/run_cuda_checks.sh || exit 1
ncu --version | tail -1
cfg="fp4 64 28672 8192"
timeout 200 ncu --kernel-name regex:decode_kernel --launch-skip 2 --launch-count 1 --section WarpStateStats --section SourceCounters --print-details all python scripts/cuda_profile_one.py $cfg > $OUT/ncu_stalls_m64.txt 2>&1
grep -iE "stall|Warp Cycles" $OUT/ncu_stalls_m64.txt | head -60
timeout 200 ncu --kernel-name regex:decode_kernel --launch-skip 2 --launch-count 1 --section SourceCounters --page source --print-source sass --csv python scripts/cuda_profile_one.py $cfg > $OUT/ncu_source_m64.csv 2>&1
wc -l $OUT/ncu_source_m64.csv; head -3 $OUT/ncu_source_m64.csv | cut -c1-600
