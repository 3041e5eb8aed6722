# EXPERIMENT (untracked): build, time, and profile the wgmma kernel's stalls per SASS instruction.
STEPS=build TORCH_CUDA_ARCH_LIST=9.0a bash scripts/run_cuda_checks.sh 2>&1 | tail -1
export PYTHONPATH=$PWD
timeout 300 python exp_wg.py ${SHAPES:-4096x4096,4096x12288,28672x8192} ${MS:-64,128,256,1024,4096} > $OUT/timing.txt 2>&1
if [ -n "${PROF:-}" ]; then
export TM_EXP_FORCE=tiled
timeout 200 ncu --kernel-name regex:wgmma_kernel --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats --metrics regex:smsp__pcsamp_warps_issue_stalled_.* -o $OUT/prof python scripts/cuda_profile_one.py fp4 1024 4096 4096 > $OUT/ncu_prof.log 2>&1
ncu -i $OUT/prof.ncu-rep --page raw --csv 2>/dev/null | python3 -c "
import sys,csv
rows=list(csv.reader(sys.stdin)); h=rows[0]; v=rows[-1]
for k,x in zip(h,v):
    if 'pcsamp_warps_issue_stalled' in k and 'not_issued' not in k and x not in ('','0'):
        print(k.replace('smsp__pcsamp_warps_issue_stalled_',''), x)
" > $OUT/stall_totals.txt
ncu -i $OUT/prof.ncu-rep --page source --csv --print-source sass > $OUT/src.csv 2>&1
python3 scripts/ncu_stall_lines.py $OUT/src.csv > $OUT/top_stalls.txt
tr '\n' ';' < $OUT/stall_totals.txt; echo; cat $OUT/top_stalls.txt
fi
grep -v "^OK" $OUT/timing.txt
