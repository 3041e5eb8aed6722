"""Host compiler for the CUDA build on Linux (setup.py; tests/test_build_host_compiler.py).

With torch's CUDA wheels, an extension compiled by g++ 13 (Ubuntu 24.04's default) can turn every
C++ exception into a segfault: a bad argument crashes the process instead of raising in Python
(docs/limitations.md). g++-12 builds an extension whose errors reach Python. When CXX is not set
and the default compiler is g++ 13 or newer, ``choose_host_compiler`` picks g++-12 where it is
installed, else says in one line what to do; a ``CXX`` that names g++ 13 or newer is kept and gets
the same warning. torch's cpp_extension hands ``CC`` to nvcc as ``-ccbin``, so one variable covers
both compilers.
"""

import re
import shutil
import subprocess
from typing import Callable, Dict, Optional, Tuple

FIRST_BAD_GCC = 13


def gcc_major(compiler: str) -> Optional[int]:
    """The GCC major version of ``compiler`` from its predefined macros; None for clang, a missing
    compiler or one that fails."""
    try:
        out = subprocess.run([compiler, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if "__clang__" in out:
        return None
    m = re.search(r"#define __GNUC__ (\d+)", out)
    return int(m.group(1)) if m else None


def choose_host_compiler(environ, platform: str, probe: Callable[[str], Optional[int]] = gcc_major,
                         which: Callable[[str], Optional[str]] = shutil.which, replace_chosen: bool = False
                         ) -> Tuple[Dict[str, str], Optional[str]]:
    """``(environment updates, one-line message or None)`` for a CUDA build. ``replace_chosen``: a
    ``CXX`` naming g++ 13+ is replaced by g++-12 where installed (the GPU check scripts) instead of
    only warned about (setup.py)."""
    if not platform.startswith("linux"):
        return {}, None
    if environ.get("CXX"):
        # The user's choice stands for setup.py; a g++ 13+ gets the warning, since an image may set
        # CXX itself.
        cxx = environ["CXX"]
        major = probe(cxx)
        if major is None or major < FIRST_BAD_GCC:
            return {}, None
        if replace_chosen and which("g++-12") and which("gcc-12"):
            return ({"CC": "gcc-12", "CXX": "g++-12"},
                    f"torch_marlin: building with g++-12, not CXX={cxx} (g++ {major}): its CUDA builds can "
                    "segfault on any error instead of raising")
        return {}, (f"torch_marlin: warning: CXX={cxx} is g++ {major}, whose CUDA builds can segfault on any "
                    "error instead of raising; CXX=g++-12 CC=gcc-12 avoids it (docs/limitations.md)")
    major = probe("c++")  # the compiler cpp_extension uses when CXX is not set
    if major is None or major < FIRST_BAD_GCC:
        return {}, None
    if which("g++-12") and which("gcc-12"):
        return ({"CC": "gcc-12", "CXX": "g++-12"},
                f"torch_marlin: building with g++-12, not the default g++ {major}: extensions built by g++ "
                f"{FIRST_BAD_GCC}+ against torch's CUDA wheels can segfault on any error instead of raising "
                "(set CXX to choose another compiler)")
    return {}, (f"torch_marlin: warning: the default compiler is g++ {major}, whose CUDA builds can segfault on "
                "any error instead of raising; install g++-12 (apt install g++-12) and rebuild, or set CXX=g++-12 "
                "CC=gcc-12 (docs/limitations.md)")


if __name__ == "__main__":
    # `eval "$(python csrc/cuda/host_compiler.py)"` in the GPU check scripts: the exports of the
    # choice (replacing a chosen g++ 13+), its message on stderr.
    import os
    import sys

    env, message = choose_host_compiler(os.environ, sys.platform, replace_chosen=True)
    if message:
        print(message, file=sys.stderr)
    for name, value in env.items():
        print(f"export {name}={value}")
