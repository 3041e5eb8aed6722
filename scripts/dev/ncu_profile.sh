#!/usr/bin/env bash
# ncu on the decode kernel and the dequant kernel of dequant_blas (run after building in place);
# reports to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/cuda_results}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis --section LaunchStats"
prof() {  # name kernel-regex args...
  local name=$1 kre=$2; shift 2
  timeout 120 ncu --kernel-name "regex:$kre" --launch-skip 2 --launch-count 1 $SECTIONS \
    python scripts/dev/cuda_profile_one.py "$@" > "$OUT/ncu_$name.txt" 2>&1
  echo "== $name"; grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Executed Ipc A|Issue Slots Busy|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|Warp Cycles Per Issued" "$OUT/ncu_$name.txt" | head -20
}
prof decode_m1 decode_kernel fp4 1 28672 8192
prof decode_m16 decode_kernel u4 16 4096 4096
prof decode_m64 decode_kernel fp4 64 4096 4096
prof dequant_m4096 dequant_kernel fp4 4096 28672 8192
SO=$(ls torch_marlin/_C*.so | head -1)
cuobjdump -sass "$SO" > /tmp/all.sass 2>/dev/null
python - <<'PY' > "$OUT/sass_kernels.txt"
import re
txt = open('/tmp/all.sass').read()
for name in ['decode_kernelI6__halfLj0E', 'dequant_kernelI6__halfLj0E']:
    i = txt.find(name)
    j = txt.find('Function :', i + 10)
    body = txt[i:j if j > 0 else None]
    print('=' * 20, name, len(body.splitlines()), 'lines')
    print(body)
PY
wc -l "$OUT/sass_kernels.txt"
