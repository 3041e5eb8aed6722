// MSL vector types (uint2, uint4, half4, float4, ...) for the two clang builds that measure loads:
// the load-tracing build of the harness (tests/metal_load_trace.py) and the static IR report
// (scripts/dev/metal_ir_report.py, through scripts/dev/metal_irshim/metal_stdlib). Each type is a
// clang ext_vector, so reading a `device const uint4*` element is ONE 16-byte load in the IR, as
// in Apple's compiler (a struct of four scalars would be split into four 4-byte loads), and
// components, swizzles and element-wise arithmetic work in every address space.
// MSL's constructors are function-like macros of the same name: uint4(x) splats a scalar or
// converts a vector element by element, uint4(a, b, c, d) takes the components.
// Include after `half` is defined. clang only; the g++ harness keeps the structs of metal_stdlib.
#pragma once

#if !defined(__clang__)
#error "msl_vectors_clang.h needs clang (ext_vector_type)"
#endif

template <class T>
struct tm_vec_info {
  static constexpr int size = 0;
  typedef T element;
};
template <class T, int N>
struct tm_vec_info<T __attribute__((ext_vector_type(N)))> {
  static constexpr int size = N;
  typedef T element;
};

template <class V, class A>
inline V tm_vec_make(A a) {
  typedef typename tm_vec_info<V>::element E;
  if constexpr (tm_vec_info<A>::size > 0) {
    return __builtin_convertvector(a, V);
  } else {
    return (V)(E(a));
  }
}
template <class V, class A0, class A1, class... A>
inline V tm_vec_make(A0 a0, A1 a1, A... a) {
  typedef typename tm_vec_info<V>::element E;
  return V{E(a0), E(a1), E(a)...};
}

#define TM_VEC_TYPES(T, name)                                  \
  typedef T name##2 __attribute__((ext_vector_type(2)));       \
  typedef T name##4 __attribute__((ext_vector_type(4)));
TM_VEC_TYPES(unsigned int, uint)
TM_VEC_TYPES(int, int)
TM_VEC_TYPES(unsigned short, ushort)
TM_VEC_TYPES(short, short)
TM_VEC_TYPES(unsigned char, uchar)
TM_VEC_TYPES(char, char)
TM_VEC_TYPES(float, float)
TM_VEC_TYPES(half, half)
#undef TM_VEC_TYPES

#define uint2(...) tm_vec_make<uint2>(__VA_ARGS__)
#define uint4(...) tm_vec_make<uint4>(__VA_ARGS__)
#define int2(...) tm_vec_make<int2>(__VA_ARGS__)
#define int4(...) tm_vec_make<int4>(__VA_ARGS__)
#define ushort2(...) tm_vec_make<ushort2>(__VA_ARGS__)
#define ushort4(...) tm_vec_make<ushort4>(__VA_ARGS__)
#define short2(...) tm_vec_make<short2>(__VA_ARGS__)
#define short4(...) tm_vec_make<short4>(__VA_ARGS__)
#define uchar2(...) tm_vec_make<uchar2>(__VA_ARGS__)
#define uchar4(...) tm_vec_make<uchar4>(__VA_ARGS__)
#define char2(...) tm_vec_make<char2>(__VA_ARGS__)
#define char4(...) tm_vec_make<char4>(__VA_ARGS__)
#define float2(...) tm_vec_make<float2>(__VA_ARGS__)
#define float4(...) tm_vec_make<float4>(__VA_ARGS__)
#define half2(...) tm_vec_make<half2>(__VA_ARGS__)
#define half4(...) tm_vec_make<half4>(__VA_ARGS__)
