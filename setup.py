"""Builds torch_marlin._C against the installed torch.

    pip install --no-build-isolation -e .

CPU sources always; the MPS sources (csrc/mps/*.mm, with the metal/ kernels embedded as source)
on macOS, unless TORCH_MARLIN_NO_MPS=1; the CUDA sources only when the installed torch has CUDA and
nvcc is found (TORCH_MARLIN_NO_CUDA=1 skips them even then), on Linux with g++-12 when CXX is not
set and the default compiler is g++ 13 or newer (csrc/cuda/host_compiler.py says why). On macOS the build also compiles each
metal/*.metal file into a Metal library installed as torch_marlin/metallib/<stem>-<hash>.metallib,
when Apple's Metal compiler is there (csrc/mps/build_metal.py, docs/metal.md "Building on macOS").
The C++ standard is the one torch's cpp_extension picks for the installed torch.
"""

import glob
import os
import platform
import sys

from setuptools import find_packages, setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "csrc", "mps"))
sys.path.insert(0, os.path.join(ROOT, "csrc", "cuda"))
import build_metal  # noqa: E402  (csrc/mps/build_metal.py: the macOS build steps)
import host_compiler  # noqa: E402  (csrc/cuda/host_compiler.py: g++-12 over g++ 13+ for CUDA builds)

METAL_DIR = os.path.join(ROOT, "metal")
METAL_INCLUDE_DIR = os.path.join(ROOT, "csrc", "include")


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def want_cuda():
    if os.environ.get("TORCH_MARLIN_NO_CUDA") == "1":
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def sm90a_requested(arch_list):
    """True when TORCH_CUDA_ARCH_LIST builds sm_90a (the wgmma kernel). An sm_90 cubin beside it
    would leave the driver two candidates for an H100, one with the kernel compiled out: refused."""
    archs = [a.strip() for a in arch_list.replace(" ", ";").split(";") if a.strip()]
    has_90a = any(a.startswith("9.0a") for a in archs)
    if has_90a and any(a in ("9.0", "9.0+PTX") for a in archs):
        raise SystemExit(f"TORCH_CUDA_ARCH_LIST={arch_list!r} lists both 9.0 and 9.0a: keep 9.0a only "
                         "(it runs on every compute capability 9.0 GPU and has the wgmma kernel)")
    return has_90a


def build_extension():
    sources = rel("csrc/ops/*.cpp") + rel("csrc/plan/*.cpp") + rel("csrc/cpu/*.cpp")
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc/include")]
    # No -std: cpp_extension adds the standard the installed torch is built with (C++20 for torch
    # 2.13, C++17 before), to both compilers; a lower one here would be below torch's own.
    cxx = ["-O3"]
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    define_macros = []
    extra_link = []

    mps = build_metal.mps_build(ROOT)
    if mps is not None:
        sources += mps["sources"]
        include_dirs += mps["include_dirs"]
        define_macros += mps["define_macros"]
        extra_link += mps["extra_link_args"]
    if sys.platform != "darwin" and platform.machine() in ("x86_64", "AMD64"):
        # The CPU kernels are written for the compiler's auto-vectorizer; AVX2+FMA is the floor of
        # every x86-64 machine that runs LLMs. TORCH_MARLIN_CPU_BASELINE=1 builds for plain x86-64.
        if os.environ.get("TORCH_MARLIN_CPU_BASELINE") != "1":
            cxx += ["-mavx2", "-mfma", "-mf16c"]
    if sys.platform.startswith("linux") and "parallel backend: OpenMP" in torch.__config__.parallel_info():
        # ATen's OpenMP backend inlines at::parallel_for's `omp parallel` region into each caller:
        # without -fopenmp the CPU kernels run every task on the calling thread. Compiled with it but
        # not linked with it, the GOMP symbols resolve to the libgomp torch already loaded, so one
        # thread pool serves both and torch.set_num_threads governs our kernels too.
        cxx += ["-fopenmp"]
    # No flag for the AVX-512 trellis decode kernel (csrc/cpu/trellis_decode_avx512.cpp): its
    # functions carry target attributes, so the rest of the build keeps the ISA above, and the file
    # compiles to nothing except on x86-64 with GCC or Clang. It runs only where the planner saw
    # the CPU run AVX-512 (caps avx512).

    ext_cls = cpp_extension.CppExtension
    if want_cuda():
        env, message = host_compiler.choose_host_compiler(os.environ, sys.platform)
        os.environ.update(env)
        if message:
            print(message, file=sys.stderr)
        sources += rel("csrc/cuda/*.cu")
        define_macros.append(("TM_WITH_CUDA", "1"))
        # sm_90a (not sm_90): the wgmma kernel needs the arch-specific target. Its cubin loads on
        # compute capability 9.0 only (H100/H200), which is all a plain sm_90 cubin served too.
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not arch:
            arch = os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0a"
        if sm90a_requested(arch):
            define_macros.append(("TM_CUDA_SM90A", "1"))
        ext_cls = cpp_extension.CUDAExtension

    return mps is not None, ext_cls(
        name="torch_marlin._C",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=extra_link,
    )


class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's build_ext, then (MPS builds) the prebuilt Metal libraries beside the extension:
    <build_lib>/torch_marlin/metallib/, mirrored into the source tree for in-place and editable
    builds (the extension looks for them next to itself)."""

    def run(self):
        super().run()
        if not WITH_MPS:
            return
        built = build_metal.build_metallibs(METAL_DIR, METAL_INCLUDE_DIR, self._metallib_dir(self.build_lib))
        if self.inplace:
            build_metal.install_metallibs(built, self._metallib_dir(ROOT))
        self._metallibs = built

    @staticmethod
    def _metallib_dir(base):
        return os.path.join(base, "torch_marlin", build_metal.METALLIB_DIR)

    def get_outputs(self):
        built = getattr(self, "_metallibs", [])
        return super().get_outputs() + ([] if self.inplace else built)

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            for path in getattr(self, "_metallibs", []):
                mapping[path] = os.path.join(self._metallib_dir(ROOT), os.path.basename(path))
        return mapping


# A universal2 Python would also compile an x86_64 slice, which torch's arm64 libraries cannot link.
if build_metal.arch_flags() is not None:
    os.environ["ARCHFLAGS"] = build_metal.arch_flags()
WITH_MPS, EXTENSION = build_extension()

setup(
    name="torch_marlin",
    version="0.1.0",
    description="Weight-quantized (FP4 / INT4 / trellis) GEMM kernels for PyTorch: Metal, CUDA and CPU",
    packages=find_packages(include=["torch_marlin", "torch_marlin.*"]),
    python_requires=">=3.11",
    # torch is installed first (README): with it present, this range installs nothing more. Never
    # run `pip install .` on a machine without torch unless a CUDA torch download is what you want.
    install_requires=["torch>=2.4", "numpy>=1.24", "safetensors>=0.4", "tqdm>=4.60"],
    ext_modules=[EXTENSION],
    cmdclass={"build_ext": BuildExtension},
    zip_safe=False,
)
