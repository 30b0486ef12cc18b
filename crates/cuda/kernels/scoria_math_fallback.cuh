// TEMPORARY stand-in for scoria_math.cuh (branch `math`), used only while that header
// is absent: the same names, libm-style formulas. NOT bit-identical to the CPU; the
// kernels include the real header as soon as it exists (see sc_math.cuh).
#pragma once

#include <math.h>

__device__ __forceinline__ float sc_exp(float x) { return expf(x); }
__device__ __forceinline__ float sc_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ float sc_sigmoid(float x) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, sc_exp(-x)));
}
__device__ __forceinline__ float sc_silu(float x) {
  return __fdiv_rn(x, __fadd_rn(1.0f, sc_exp(-x)));
}
__device__ __forceinline__ float sc_softplus(float x) {
  return x > 20.0f ? x : sc_log1p(sc_exp(x));
}
// The canonical combine of 32 lane accumulators: acc[l] += acc[l+w] for w = 16..1;
// lane 0 holds the result.
__device__ __forceinline__ float sc_warp_sum(float acc) {
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, w));
  return acc;
}
