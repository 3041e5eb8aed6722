# Sourced by the GPU check scripts (run_cuda_checks.sh, gpu_trellis.sh, gpu_rans.sh): build with
# g++-12 where it is installed unless CXX names another compiler that is not g++ 13+. An extension
# built by g++ 13 against torch's CUDA wheels has been seen to segfault on any C++ exception
# (docs/limitations.md), and a GPU image may set CXX to its own g++ 13. setup.py makes the same
# choice when CXX is unset (csrc/cuda/host_compiler.py); exported here so the logs name it. torch's
# cpp_extension passes CC to nvcc as -ccbin.
if command -v g++-12 >/dev/null 2>&1; then
  if [ -z "${CXX:-}" ] || { ! "$CXX" --version 2>/dev/null | grep -qi clang &&
                              [ "$("$CXX" -dumpversion 2>/dev/null | cut -d. -f1)" -ge 13 ] 2>/dev/null; }; then
    export CC=gcc-12 CXX=g++-12
  fi
fi
