#!/usr/bin/env bash
# Objective-C++ check of the MPS backend (csrc/mps/*.mm) on a machine without Apple's SDK.
#
# The .mm files build only on macOS, so without this check a typo in a Metal call or a wrong
# argument type would first show on a Mac. clang type-checks each file here as Objective-C++
# (-fsyntax-only: nothing is compiled or linked) against
#   - torch's real ATen/mps headers (MPSDevice.h, MPSStream.h ship in every torch wheel);
#   - scripts/dev/objcxx_shim/: declarations of the Foundation, Core Foundation, IOKit, Metal,
#     MetalPerformanceShaders, MetalPerformanceShadersGraph and libdispatch API that the .mm files and those torch headers
#     use, written from Apple's public documentation with the documented signatures;
#   - the generated kernel-source header, written by the same embedding step setup.py runs on macOS;
#   - setup.py's macOS macro (TM_WITH_MPS=1) and its C++ standard (cpp_extension's default, C++20,
#     when setup.py names none), with Apple's Objective-C runtime semantics and blocks;
#   - the newest SDK the shim describes, and again, for the files that guard declarations by SDK
#     version (__MAC_OS_X_VERSION_MAX_ALLOWED), the macOS 13 SDK: both must compile.
# Warnings are errors: clang only warns on a message to an undeclared selector or an argument of
# the wrong Objective-C type, and both are bugs here. A Metal call that the shim does not declare
# fails too: add its documented declaration to the shim. The check cannot see what only runs on a
# Mac (Metal compiler messages, API availability at run time, encoder rules).
#
#   scripts/dev/check_objcxx_syntax.sh              check csrc/mps/*.mm
#   scripts/dev/check_objcxx_syntax.sh --self-test  also prove that planted mistakes fail
#
# Needs clang (Debian: apt-get install -y clang) and the installed torch; exits 0 with a
# message when clang is absent. Exit status 0 = clean.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SHIM="$ROOT/scripts/dev/objcxx_shim"
CLANG="${CLANG:-}"
if [[ -z "$CLANG" ]]; then
  for c in clang clang-19 clang-18 clang-17 clang-16 clang-15 clang-14; do
    if command -v "$c" >/dev/null 2>&1; then CLANG="$c"; break; fi
  done
fi
if [[ -z "$CLANG" ]]; then
  echo "check_objcxx_syntax: SKIPPED, clang not found (Debian: apt-get install -y clang)"
  exit 0
fi
PYTHON="${PYTHON:-python}"

# The C++ standard of the real build: setup.py's `cxx` flags, else what cpp_extension adds.
CXX_STD="$(sed -n 's/^ *cxx = \[.*"-std=\(c++[0-9a-z]*\)".*/\1/p' "$ROOT/setup.py" | head -n 1)"
CXX_STD="${CXX_STD:-c++20}"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# torch's include directories, and the kernel-source header through setup.py's embedding step
# (write_header is the entry point setup.py's macOS build calls, csrc/mps/build_metal.py).
TORCH_INCLUDES="$("$PYTHON" -c 'from torch.utils import cpp_extension; print("\n".join(cpp_extension.include_paths()))')"
"$PYTHON" - "$ROOT" "$tmp/generated" <<'EOF'
import os, sys
root, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(root, "csrc", "mps"))
import build_metal
import embed_metal
embed_metal.write_header(os.path.join(root, "metal"), os.path.join(root, "csrc", "include"),
                         os.path.join(out, build_metal.GENERATED_HEADER))
EOF

args=(-x objective-c++ -fsyntax-only -fblocks -std="$CXX_STD" -fobjc-runtime=macosx-13.0
      -Werror -ferror-limit=0 -DTM_WITH_MPS=1 -isystem "$SHIM")
while IFS= read -r inc; do [[ -n "$inc" ]] && args+=(-isystem "$inc"); done <<<"$TORCH_INCLUDES"
args+=(-I "$ROOT/csrc" -I "$ROOT/csrc/include" -I "$tmp/generated")

# Nearly all of a parse is ATen. The headers every .mm file starts from (mps_encoder.mm's order:
# Foundation, Metal, ATen) are parsed once per SDK version into a precompiled header that each
# check of that version loads first; the files' own includes of them are then no-ops.
MACOS13=-D__MAC_OS_X_VERSION_MAX_ALLOWED=130000
printf '#import <Foundation/Foundation.h>\n#import <Metal/Metal.h>\n#include <ATen/ATen.h>\n' >"$tmp/prefix.h"
pch_args=()
for a in "${args[@]}"; do
  case "$a" in
    objective-c++) pch_args+=(objective-c++-header) ;;
    -fsyntax-only) ;;
    *) pch_args+=("$a") ;;
  esac
done
"$CLANG" "${pch_args[@]}" "$tmp/prefix.h" -o "$tmp/prefix.pch"
"$CLANG" "${pch_args[@]}" "$MACOS13" "$tmp/prefix.h" -o "$tmp/prefix_macos13.pch"

check() { "$CLANG" "${args[@]}" -include-pch "$tmp/prefix.pch" "$@"; }
check_macos13() { "$CLANG" "${args[@]}" "$MACOS13" -include-pch "$tmp/prefix_macos13.pch" "$@"; }

echo "objective-c++ check: $("$CLANG" --version | sed -n 1p), -std=$CXX_STD"

status=0
for f in "$ROOT"/csrc/mps/*.mm; do
  if check "$f"; then
    echo "objective-c++ OK: ${f#$ROOT/}"
  else
    echo "objective-c++ check FAILED: ${f#$ROOT/}" >&2
    status=1
  fi
done
for f in $(grep -l "__MAC_OS_X_VERSION_MAX_ALLOWED" "$ROOT"/csrc/mps/*.mm || true); do
  if check_macos13 "$f"; then
    echo "objective-c++ OK (macOS 13 SDK): ${f#$ROOT/}"
  else
    echo "objective-c++ check FAILED (macOS 13 SDK): ${f#$ROOT/}" >&2
    status=1
  fi
done

if [[ "${1:-}" == "--self-test" ]]; then
  # Each mistake is a one-line edit of csrc/mps/mps_encoder.mm (where the Metal calls are). All
  # are planted in one copy (one compile: clang reports every error); each planted line must carry
  # an error of its own.
  src="$ROOT/csrc/mps/mps_encoder.mm"
  mistakes=(
    # a misspelled selector
    's/\[enc setComputePipelineState:(\*psos)\[k\]\]/[enc setComputePipeline:(*psos)[k]]/'
    # an argument of the wrong protocol type: the library where the function belongs
    's/newComputePipelineStateWithFunction:fn error:&err/newComputePipelineStateWithFunction:lib error:\&err/'
    # a misspelled property
    's/opts\.fastMathEnabled = NO;/opts.fastMath = NO;/'
    # the params vector where setBytes: takes a pointer to its bytes
    's/\[enc setBytes:d\.params\.data() length:/[enc setBytes:d.params length:/'
    # an NSString where a std::string needs a C string
    's/err\.localizedDescription\.UTF8String : "no message"/err.localizedDescription : "no message"/'
    # the Metal command queue where dispatch_sync needs the stream's dispatch queue
    's/dispatch_sync(stream->queue(), /dispatch_sync(stream->commandQueue(), /'
    # a path string where the library loader takes a file URL
    's/newLibraryWithURL:url error:/newLibraryWithURL:path error:/'
    # a C string where the registry takes a CFString key
    's/CFSTR("gpu-core-count")/"gpu-core-count"/'
    # a family number where supportsFamily: takes an MTLGPUFamily
    's/supportsFamily:MTLGPUFamilyApple7/supportsFamily:7/'
  )
  planted="$tmp/mps_encoder.mm"
  cp "$src" "$planted"
  lines=()
  for m in "${mistakes[@]}"; do
    cp "$planted" "$tmp/before.mm"
    sed -i "$m" "$planted"
    changed="$( (diff "$tmp/before.mm" "$planted" || true) | sed -n 's/^\([0-9]*\)c[0-9]*$/\1/p')"
    if [[ ! "$changed" =~ ^[0-9]+$ ]]; then
      echo "self-test FAILED: the edit '$m' must change exactly one line of ${src#$ROOT/}" >&2
      exit 1
    fi
    lines+=("$changed")
  done
  log="$tmp/planted.log"
  if check "$planted" >"$log" 2>&1; then
    echo "self-test FAILED: the copy with planted mistakes passed the check" >&2
    exit 1
  fi
  for i in "${!mistakes[@]}"; do
    if grep -q "^$planted:${lines[$i]}:[0-9]*: error:" "$log"; then
      echo "self-test OK: mistake rejected (line ${lines[$i]}: ${mistakes[$i]})"
    else
      echo "self-test FAILED: no error at line ${lines[$i]} for '${mistakes[$i]}'" >&2
      cat "$log" >&2
      status=1
    fi
  done

  # An SDK guard dropped: the macOS 15 declarations (mathMode) reach the macOS 13 SDK pass,
  # which must reject them.
  unguarded="$tmp/mps_encoder_unguarded.mm"
  sed 's/^#if TM_SDK_HAS_MATH_MODE$/#if 1/' "$src" >"$unguarded"
  if cmp -s "$src" "$unguarded"; then
    echo "self-test FAILED: no '#if TM_SDK_HAS_MATH_MODE' guard in ${src#$ROOT/}" >&2
    exit 1
  fi
  if check_macos13 "$unguarded" >"$log" 2>&1; then
    echo "self-test FAILED: the copy without its SDK guard passed the macOS 13 SDK check" >&2
    status=1
  elif grep -q "error:.*\(mathMode\|MTLMathMode\)" "$log"; then
    echo "self-test OK: SDK guard removal rejected (macOS 13 SDK)"
  else
    echo "self-test FAILED: the unguarded copy failed for another reason" >&2
    cat "$log" >&2
    status=1
  fi
fi

exit $status
