// The greedy choice, as engine::sampler::argmax: the lowest index of the largest value
// among those greater than -inf; NaN never wins; 0 when no value qualifies (all NaN or
// -inf). A row is spread over blocks (norm.cu's argmax, sample.cu's sample_max): each
// block's choice among its ids (sc_range_best), then the last block of the row to
// arrive (sc_last_block) combines the blocks' with sc_better. Block functions are
// called by every thread of a block of up to 1024 threads (a multiple of 32).
#pragma once

#ifndef SC_FULL
#define SC_FULL 0xffffffffu
#endif

// No index yet: loses every comparison with a real one.
#define SC_NO_INDEX 0x7fffffff

__device__ __forceinline__ void sc_better(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

// Block-wide sc_better; every thread gets the answer.
__device__ __forceinline__ void sc_block_best(float& bv, int& bi) {
  __shared__ float sv[32];
  __shared__ int si[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(SC_FULL, bv, o);
    const int oi = __shfl_xor_sync(SC_FULL, bi, o);
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
  bi = lane < nw ? si[lane] : SC_NO_INDEX;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(SC_FULL, bv, o);
    const int oi = __shfl_xor_sync(SC_FULL, bi, o);
    sc_better(bv, bi, ov, oi);
  }
  __syncthreads();  // sv/si may be reused by the caller's next call
}

// The block's choice among x[lo..hi): -inf and SC_NO_INDEX when no value qualifies.
// Ids increase within a thread, so strict > keeps the lowest of equal values; -inf
// and NaN never win.
__device__ __forceinline__ void sc_range_best(const float* __restrict__ x, int lo, int hi, float& bv, int& bi) {
  bv = -INFINITY;
  bi = SC_NO_INDEX;
  for (int i = lo + (int)threadIdx.x; i < hi; i += blockDim.x) {
    const float v = x[i];
    if (v > bv) {
      bv = v;
      bi = i;
    }
  }
  sc_block_best(bv, bi);
}

// Whether this block is the last of the `nb` blocks sharing the counter `arrived` to
// get here: every thread's writes are made visible first, so the last block sees the
// others' (read them with __ldcg). The last block sets the counter back to 0.
__device__ __forceinline__ bool sc_last_block(unsigned* arrived, int nb) {
  __shared__ unsigned s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(arrived, 1u) == (unsigned)nb - 1u ? 1u : 0u;
    if (s_last) atomicExch(arrived, 0u);
  }
  __syncthreads();
  if (s_last) __threadfence();
  return s_last != 0;
}
