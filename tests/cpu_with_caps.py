"""The CPU ops planned with caps the test chooses (test-time only; never part of ``torch_marlin._C``).

``load()`` JIT-builds (torch.utils.cpp_extension.load, cached under build/cpu_with_caps/) the module of
csrc/testing/cpu_with_caps.cpp, linked against the imported ``torch_marlin._C``, whose checks, planner
and CPU kernels it calls. It exposes

  gemm_trellis_cpu_with_caps(caps, A, packed_indices, scales, grid, su, sv, K, N, bits, group_size)
  gemm_rans_cpu_with_caps(caps, A, words, word_offsets, states, freqs, scales, zeros, offsets, format, K, N,
                          group_size, channels_per_tile, bias=None)
  rans_decode_cpu_with_caps(caps, words, word_offsets, states, freqs, K, N, channels_per_tile)

``caps`` as for ``torch_marlin.plan_gemm``: ``avx2=False`` / ``avx512=False`` run the portable kernels on
any machine; a kernel this build or CPU lacks is refused with a ValueError.
"""

import os

from torch.utils import cpp_extension

import metal_emu
import torch_marlin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "csrc", "testing", "cpu_with_caps.cpp")
BUILD_DIR = os.path.join(ROOT, "build", "cpu_with_caps")

_module = None


def load(verbose=False):
    """Builds (or reuses) the module; about a minute on 2 cores the first time."""
    global _module
    if _module is None:
        extension = torch_marlin._C.__file__
        with metal_emu.build_lock(BUILD_DIR):
            _module = cpp_extension.load(
                name="tm_cpu_with_caps",
                sources=[SOURCE],
                extra_include_paths=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")],
                extra_ldflags=[extension, "-Wl,-rpath," + os.path.dirname(extension)],
                build_directory=BUILD_DIR,
                verbose=verbose,
            )
    return _module
