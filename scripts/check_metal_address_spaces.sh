#!/usr/bin/env bash
# Address-space check of the Metal kernels on a machine without Apple's compiler.
#
# clang -fsyntax-only type-checks metal/*.metal as C++ over scripts/metal_ascheck/metal_stdlib,
# where MSL's `device`, `constant` and `threadgroup` are distinct clang address spaces (1, 2, 3)
# and `thread` is the default one. Every kernel template is explicitly instantiated (half and
# float; bfloat shares the same template code), so a device/threadgroup/thread pointer mix-up is
# an error here as it is in Apple's metal compiler. It does not check anything else Apple's
# compiler would (MSL-only builtins, attributes): see docs/limitations.md.
#
#   scripts/check_metal_address_spaces.sh              check metal/*.metal
#   scripts/check_metal_address_spaces.sh --self-test  also prove that injected mix-ups fail
#
# Needs clang (Debian: apt-get install -y clang). Exit status 0 = clean.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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

# aarch64: clang has _Float16 there (the Metal `half`); -nostdinc: the shim needs no libc.
check() {
  "$CLANG" -target aarch64-unknown-linux-gnu -nostdinc -fsyntax-only -std=c++17 -x c++ \
    -Wno-unknown-attributes -D__METAL_VERSION__=300 \
    -I "$ROOT/scripts/metal_ascheck" -I "$ROOT/csrc/include" "$1"
}

status=0
for f in "$ROOT"/metal/*.metal; do
  if check "$f"; then
    echo "address spaces OK: ${f#$ROOT/}"
  else
    echo "address-space check FAILED: ${f#$ROOT/}" >&2
    status=1
  fi
done

if [[ "${1:-}" == "--self-test" ]]; then
  # Each mix-up below is a one-line edit of metal/quant_gemm.metal; the check must reject it.
  src="$ROOT/metal/quant_gemm.metal"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  mixups=(
    # a threadgroup tile parameter declared as device memory
    's/threadgroup T\* a_tile, threadgroup T\* b_stage/device T* a_tile, threadgroup T* b_stage/'
    # the epilogue stage (threadgroup) taken as a thread pointer
    's/frag, threadgroup float\* stage/frag, thread float* stage/'
    # a device activation row read through a threadgroup pointer
    's/device const T\* a = A + m/threadgroup const T* a = A + m/'
    # the decode partial sums written to device memory through the threadgroup array's type
    's/device float\* workspace \[\[buffer(6)\]\], constant QuantGemmParams& p \[\[buffer(7)\]\],$/threadgroup float* workspace [[buffer(6)]], constant QuantGemmParams\& p [[buffer(7)]],/'
  )
  for m in "${mixups[@]}"; do
    sed "$m" "$src" > "$tmp/mixup.metal"
    if cmp -s "$src" "$tmp/mixup.metal"; then
      echo "self-test: mix-up '$m' did not apply to the source (update the self-test)" >&2
      status=1
    elif check "$tmp/mixup.metal" > "$tmp/log" 2>&1; then
      echo "self-test FAILED: mix-up '$m' was accepted" >&2
      status=1
    else
      echo "self-test OK: mix-up rejected: $(grep -m1 'error:' "$tmp/log" | sed 's/^[^:]*:[0-9]*:[0-9]*: //')"
    fi
  done
fi
exit $status
