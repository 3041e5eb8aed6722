#!/usr/bin/env bash
# Session 7: ncu stall samples + speed-of-light of one gemm_fp4 launch (the build on the machine).
#   FMT=fp4 M=128 K=4096 N=12288 bash docs/cuda_results/session7/scripts/exp_prof.sh
# (KERNEL: the ncu kernel-name regex; TAG: a prefix for the output names, added in session 8.)
set -uo pipefail
cd "$(dirname "$0")/../../../.."
OUT="${OUT:-/tmp/out}"; export PYTHONPATH=$PWD
tag="${TAG:-}${M:-128}_${K:-4096}x${N:-12288}"
timeout 240 ncu --kernel-name "regex:${KERNEL:-wgmma_kernel}" --launch-skip 2 --launch-count 1 --section SpeedOfLight \
  --section SourceCounters --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --metrics regex:smsp__pcsamp_warps_issue_stalled_.* -o "$OUT/prof_$tag" \
  python scripts/cuda_profile_one.py "${FMT:-fp4}" "${M:-128}" "${K:-4096}" "${N:-12288}" > "$OUT/ncu_$tag.log" 2>&1
ncu -i "$OUT/prof_$tag.ncu-rep" --page details > "$OUT/details_$tag.txt" 2>&1
ncu -i "$OUT/prof_$tag.ncu-rep" --page raw --csv 2>/dev/null | python3 -c "
import sys,csv
rows=list(csv.reader(sys.stdin)); h=rows[0]; v=rows[-1]
for k,x in zip(h,v):
    if 'pcsamp_warps_issue_stalled' in k and 'not_issued' not in k and x not in ('','0'):
        print(k.replace('smsp__pcsamp_warps_issue_stalled_',''), x)
" > "$OUT/stall_totals_$tag.txt"
ncu -i "$OUT/prof_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/src_$tag.csv" 2>&1
python3 scripts/ncu_stall_lines.py "$OUT/src_$tag.csv" > "$OUT/top_stalls_$tag.txt"
grep -E "Duration|Throughput|Pipe|Busy|Bandwidth|Warp Cycles|Registers|Shared Memory" "$OUT/details_$tag.txt" | head -40
sort -k2 -n -r "$OUT/stall_totals_$tag.txt" | head -12
cat "$OUT/top_stalls_$tag.txt"
