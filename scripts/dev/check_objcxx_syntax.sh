#!/usr/bin/env bash
# Objective-C++ check of the MPS backend (csrc/mps/*.mm) on a machine without Apple's SDK.
#
# The .mm files build only on macOS, so without this check a typo in a Metal call or a wrong
# argument type would first show on a Mac. clang type-checks each file here as Objective-C++
# (-fsyntax-only: nothing is compiled or linked) against
#   - torch's real ATen/mps headers (MPSDevice.h, MPSStream.h ship in every torch wheel);
#   - scripts/dev/objcxx_shim/: declarations of the Foundation, Metal, MetalPerformanceShaders,
#     MetalPerformanceShadersGraph and libdispatch API that the .mm files and those torch headers
#     use, written from Apple's public documentation with the documented signatures;
#   - the generated kernel-source header, written by the same embedding step setup.py runs on macOS;
#   - setup.py's macOS macro (TM_WITH_MPS=1) and its C++ standard (cpp_extension's default, C++20,
#     when setup.py names none), with Apple's Objective-C runtime semantics and blocks.
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
# (write_header is the entry point setup.py calls; the module lives beside the MPS sources or
# in scripts/).
TORCH_INCLUDES="$("$PYTHON" -c 'from torch.utils import cpp_extension; print("\n".join(cpp_extension.include_paths()))')"
"$PYTHON" - "$ROOT" "$tmp/generated" <<'EOF'
import os, sys
root, out = sys.argv[1], sys.argv[2]
for d in ("csrc/mps", "scripts"):
    if os.path.exists(os.path.join(root, d, "embed_metal.py")):
        sys.path.insert(0, os.path.join(root, d))
        break
else:
    sys.exit("check_objcxx_syntax: embed_metal.py not found (csrc/mps/ or scripts/)")
import embed_metal
embed_metal.write_header(os.path.join(root, "metal"), os.path.join(root, "csrc", "include"),
                         os.path.join(out, "metal_library_source.h"))
EOF

args=(-x objective-c++ -fsyntax-only -fblocks -std="$CXX_STD" -fobjc-runtime=macosx-13.0
      -Werror -ferror-limit=0 -DTM_WITH_MPS=1 -isystem "$SHIM")
while IFS= read -r inc; do [[ -n "$inc" ]] && args+=(-isystem "$inc"); done <<<"$TORCH_INCLUDES"
args+=(-I "$ROOT/csrc" -I "$ROOT/csrc/include" -I "$tmp/generated")

check() { "$CLANG" "${args[@]}" "$@"; }
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

if [[ "${1:-}" == "--self-test" ]]; then
  # Each mistake is a one-line edit of csrc/mps/quant_gemm_mps.mm. All are planted in one copy
  # (one compile: clang reports every error); each planted line must carry an error of its own.
  src="$ROOT/csrc/mps/quant_gemm_mps.mm"
  mistakes=(
    # a misspelled selector
    's/\[enc setComputePipelineState:pso\]/[enc setComputePipeline:pso]/'
    # an argument of the wrong protocol type: the library where the function belongs
    's/newComputePipelineStateWithFunction:fn error:&err/newComputePipelineStateWithFunction:lib error:\&err/'
    # a misspelled property
    's/opts\.fastMathEnabled = NO;/opts.fastMath = NO;/'
    # the params struct by value where setBytes: takes a pointer
    's/\[enc setBytes:prm length:/[enc setBytes:*prm length:/'
    # an NSString where the message needs a C string
    's/err ? err\.localizedDescription\.UTF8String : "unknown error"/err ? err.localizedDescription : "unknown error"/'
    # the Metal command queue where dispatch_sync needs the stream's dispatch queue
    's/dispatch_sync(stream->queue(), /dispatch_sync(stream->commandQueue(), /'
  )
  planted="$tmp/quant_gemm_mps.mm"
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
fi

exit $status
