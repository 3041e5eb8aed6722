#!/usr/bin/env bash
# Address-space check of the Metal kernels on a machine without Apple's compiler.
#
# clang -fsyntax-only type-checks every metal/*.metal file (each compiles on its own, with the
# MSL headers of csrc/include/torch_marlin/) and the concatenated library the MPS build embeds
# (csrc/mps/embed_metal.py) as C++ over scripts/dev/metal_ascheck/metal_stdlib, where MSL's
# `device`, `constant` and `threadgroup` are distinct clang address spaces (1, 2, 3) and `thread`
# is the default one. Every kernel template is explicitly instantiated, so a device/threadgroup/
# thread pointer mix-up is an error here as it is in Apple's metal compiler. Each file is checked
# twice: as MSL 3.0 (half and float, what macOS 13 compiles) and as MSL 3.1, where the bfloat
# instantiations and their own overloads (bfloat loads, bfloat4 vectors) join in. It does not check anything else Apple's compiler would
# (MSL-only builtins, attributes): see docs/limitations.md.
#
#   scripts/dev/check_metal_address_spaces.sh              check metal/*.metal
#   scripts/dev/check_metal_address_spaces.sh --self-test  also prove that injected mix-ups fail
#
# Needs clang (Debian: apt-get install -y clang) and python3. Exit status 0 = clean.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SHIM="$ROOT/scripts/dev/metal_ascheck"
CLANG="${CLANGXX:-}"
if [[ -z "$CLANG" ]]; then
  for c in clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
    if command -v "$c" >/dev/null 2>&1; then CLANG="$c"; break; fi
  done
fi
if [[ -z "$CLANG" ]]; then
  echo "check_metal_address_spaces: clang++ not found (Debian: apt-get install -y clang)" >&2
  exit 2
fi

# check FILE INCLUDE_DIR, as MSL 3.0 and as MSL 3.1. aarch64: clang has _Float16 there (the Metal
# `half`); -nostdinc: the shim needs no libc.
check() {
  local version
  for version in 300 310; do
    "$CLANG" -target aarch64-unknown-linux-gnu -nostdinc -fsyntax-only -std=c++17 -x c++ \
      -Wno-unknown-attributes -D__METAL_VERSION__=$version -I "$SHIM" -I "$2" "$1" || return 1
  done
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

status=0
for f in "$ROOT"/metal/*.metal; do
  if check "$f" "$ROOT/csrc/include"; then
    echo "address spaces OK: ${f#$ROOT/}"
  else
    echo "address-space check FAILED: ${f#$ROOT/}" >&2
    status=1
  fi
done
python3 "$ROOT/csrc/mps/embed_metal.py" > "$tmp/library.metal"
if check "$tmp/library.metal" "$ROOT/csrc/include"; then
  echo "address spaces OK: the concatenated library (csrc/mps/embed_metal.py)"
else
  echo "address-space check FAILED: the concatenated library (csrc/mps/embed_metal.py)" >&2
  status=1
fi

if [[ "${1:-}" == "--self-test" ]]; then
  # Each mix-up is a one-line edit of one kernel source or MSL header ("file|sed expression");
  # the check of a copy of metal/ and csrc/include/ with that edit must fail.
  mixups=(
    # a threadgroup stage parameter declared as device memory
    'csrc/include/torch_marlin/fused_tile_msl.h|s/threadgroup T\* sa, threadgroup T\* sb/device T* sa, threadgroup T* sb/'
    # the epilogue stage (threadgroup) taken as a thread pointer
    'csrc/include/torch_marlin/quant_gemm_msl.h|s/frag, threadgroup float\* stage/frag, thread float* stage/'
    # the staged activations (threadgroup) read through a device pointer
    'metal/decode.metal|s/float4 zb, threadgroup const float\* a, uint a_stride/float4 zb, device const float* a, uint a_stride/'
    # the decode partial sums written to device memory through the threadgroup array's type
    'metal/decode.metal|s/device float\* workspace \[\[buffer(6)\]\], constant QuantGemmParams& p \[\[buffer(7)\]\],$/threadgroup float* workspace [[buffer(6)]], constant QuantGemmParams\& p [[buffer(7)]],/'
    # the trellis simdgroups' threadgroup partials read as device memory
    'csrc/include/torch_marlin/trellis_msl.h|s/inline float tr_meet(threadgroup const float\* partial/inline float tr_meet(device const float* partial/'
    # the bfloat activations' load (MSL 3.1 only) taking a threadgroup pointer
    'metal/decode.metal|s/inline float4 gemv_load4(device const bfloat\* p)/inline float4 gemv_load4(threadgroup const bfloat* p)/'
  )
  for m in "${mixups[@]}"; do
    file="${m%%|*}"
    expr="${m#*|}"
    rm -rf "$tmp/tree" && mkdir -p "$tmp/tree/csrc"
    cp -r "$ROOT/metal" "$tmp/tree/metal"
    cp -r "$ROOT/csrc/include" "$tmp/tree/csrc/include"
    sed "$expr" "$ROOT/$file" > "$tmp/tree/$file"
    if cmp -s "$ROOT/$file" "$tmp/tree/$file"; then
      echo "self-test: mix-up '$expr' did not apply to $file (update the self-test)" >&2
      status=1
      continue
    fi
    rejected=0
    : > "$tmp/log"
    for f in "$tmp"/tree/metal/*.metal; do
      check "$f" "$tmp/tree/csrc/include" >> "$tmp/log" 2>&1 || rejected=1
    done
    if [[ $rejected == 0 ]]; then
      echo "self-test FAILED: mix-up in $file was accepted: '$expr'" >&2
      status=1
    else
      echo "self-test OK: mix-up rejected ($file): $(grep -m1 'error:' "$tmp/log" | sed 's/^[^:]*:[0-9]*:[0-9]*: //')"
    fi
  done
fi
exit $status
