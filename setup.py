"""Builds torch_marlin._C against the installed torch.

    pip install --no-build-isolation -e .

CPU sources always; the MPS sources (csrc/mps/*.mm with the metal/ kernels embedded as a string)
only on macOS; the CUDA sources only when the installed torch has CUDA and nvcc is found.
Set TORCH_MARLIN_NO_CUDA=1 to skip CUDA even then.
"""

import glob
import os
import platform
import sys

from setuptools import find_packages, setup

import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "csrc", "mps"))  # embed_metal (the MPS build step)


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
    cxx = ["-O3", "-std=c++17"]
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    define_macros = []
    extra_link = []

    if sys.platform == "darwin":
        import embed_metal  # csrc/mps/embed_metal.py: metal/*.metal -> a C++ string header

        gen_dir = os.path.join(ROOT, "build", "generated")
        embed_metal.write_header(os.path.join(ROOT, "metal"), os.path.join(ROOT, "csrc/include"),
                                 os.path.join(gen_dir, "metal_library_source.h"))
        include_dirs.append(gen_dir)
        sources += rel("csrc/mps/*.mm")
        define_macros.append(("TM_WITH_MPS", "1"))
        extra_link += ["-framework", "Metal", "-framework", "Foundation"]
    elif platform.machine() in ("x86_64", "AMD64"):
        # The CPU kernels are written for the compiler's auto-vectorizer; AVX2+FMA is the floor of
        # every x86-64 machine that runs LLMs. TORCH_MARLIN_CPU_BASELINE=1 builds for plain x86-64.
        if os.environ.get("TORCH_MARLIN_CPU_BASELINE") != "1":
            cxx += ["-mavx2", "-mfma", "-mf16c"]

    ext_cls = cpp_extension.CppExtension
    if want_cuda():
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

    return ext_cls(
        name="torch_marlin._C",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=extra_link,
    )


setup(
    name="torch_marlin",
    version="0.1.0",
    description="Weight-quantized (FP4 / INT4 / trellis) GEMM kernels for PyTorch: Metal, CUDA and CPU",
    packages=find_packages(include=["torch_marlin", "torch_marlin.*"]),
    python_requires=">=3.9",
    # torch is installed first (README): with it present, this range installs nothing more. Never
    # run `pip install .` on a machine without torch unless a CUDA torch download is what you want.
    install_requires=["torch>=2.4", "numpy>=1.24", "safetensors>=0.4", "tqdm>=4.60"],
    ext_modules=[build_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
