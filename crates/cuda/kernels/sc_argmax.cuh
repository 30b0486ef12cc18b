// The greedy choice of a row, as engine::sampler::argmax: the lowest index of the
// largest value among those greater than -inf; NaN never wins; 0 when no value
// qualifies (all NaN or -inf). Called by every thread of a block of up to 1024 threads
// (a multiple of 32); every thread gets the answer.
#pragma once

#ifndef SC_FULL
#define SC_FULL 0xffffffffu
#endif

__device__ __forceinline__ void sc_better(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

__device__ __forceinline__ int sc_row_argmax(const float* __restrict__ x, int n) {
  __shared__ float sv[32];
  __shared__ int si[32];
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  // Increasing i within a thread: strict > keeps the lowest index of equal values.
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = x[i];
    if (v > bv) {
      bv = v;
      bi = i;
    }
  }
  for (int w = 16; w > 0; w >>= 1) {
    const float ov = __shfl_xor_sync(SC_FULL, bv, w);
    const int oi = __shfl_xor_sync(SC_FULL, bi, w);
    sc_better(bv, bi, ov, oi);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  const int nw = blockDim.x >> 5;
  bv = lane < nw ? sv[lane] : -INFINITY;
  bi = lane < nw ? si[lane] : 0x7fffffff;
  for (int w = 16; w > 0; w >>= 1) {
    const float ov = __shfl_xor_sync(SC_FULL, bv, w);
    const int oi = __shfl_xor_sync(SC_FULL, bi, w);
    sc_better(bv, bi, ov, oi);
  }
  __syncthreads();  // sv/si may be reused by the caller's next call
  return bi == 0x7fffffff ? 0 : bi;
}
