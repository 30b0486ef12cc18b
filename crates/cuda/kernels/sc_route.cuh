// The routing of one token (model::moe::route) by one warp, shared by route_topk,
// the fused decode MoE and the router (moe.cu).
#pragma once

#include "sc_common.cuh"
#include "scoria_math.cuh"

#define SC_MAX_EXPERT 1024
#define SC_MAX_K 32

// The warp's largest (MAX) or smallest of one u32 a lane (every lane gets it): one
// reduction instruction from sm_80, a butterfly of shuffles before.
template <bool MAX>
__device__ __forceinline__ uint32_t sc_warp_ext_u32(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return MAX ? __reduce_max_sync(0xffffffffu, v) : __reduce_min_sync(0xffffffffu, v);
#else
  for (int w = 16; w > 0; w >>= 1) {
    const uint32_t o = __shfl_xor_sync(0xffffffffu, v, w);
    v = MAX ? max(v, o) : min(v, o);
  }
  return v;
#endif
}

// One full warp routes one token's n_expert logits `l` (model::moe::route): softmax
// over all experts (max, e^(v - max) with sc_exp, their sum in the canonical 32-lane
// order, times 1/sum); the k most probable, ties to the lower index; renormalised by
// 1/max(Σ of the k in rank order, 6.103515625e-5). `p` (n_expert floats) and `sid`
// (SC_MAX_K ints) are the warp's shared scratch. Lane r < k returns rank r's weight
// and expert in w_out / id_out. PER: experts a lane keeps (n_expert <= 32·PER; fewer
// registers for kernels that route small expert counts).
template <int PER>
__device__ __forceinline__ void sc_route_warp(const float* __restrict__ l, int n_expert, int k, float* p,
                                              int* sid, float& w_out, int& id_out) {
  const int lane = threadIdx.x & 31;
  // Each lane keeps its experts (lane, lane + 32, ...) in registers: one memory round
  // trip, and the k argmax rounds below run without shared-memory scans.
  float pv[PER];
  uint32_t taken = 0;  // bit q: expert lane + 32·q is chosen or absent
  float mx = -INFINITY;
#pragma unroll
  for (int q = 0; q < PER; q++) {
    const int e = lane + 32 * q;
    pv[q] = e < n_expert ? l[e] : -INFINITY;
    if (e >= n_expert) taken |= 1u << q;
    if (e < n_expert) mx = fmaxf(mx, pv[q]);
  }
  for (int w = 16; w > 0; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
  float acc = 0.0f;
#pragma unroll
  for (int q = 0; q < PER; q++) {
    if (lane + 32 * q < n_expert) {
      pv[q] = sc_exp(sc_sub(pv[q], mx));
      acc = sc_add(acc, pv[q]);
    }
  }
  const float sum = __shfl_sync(0xffffffffu, sc_warp_sum(acc), 0);
  const float inv = sc_div(1.0f, sum);
#pragma unroll
  for (int q = 0; q < PER; q++) {
    const int e = lane + 32 * q;
    if (e < n_expert) {
      pv[q] = sc_mul(pv[q], inv);
      p[e] = pv[q];
    }
  }
  __syncwarp();

  // k rounds of a warp argmax over the experts not yet chosen. A probability is
  // e^(..)·(1/sum) >= +0, so its bits order as it does: key = bits + 1 for a
  // candidate (0: none; NaN never wins), each lane's best key held with its lowest
  // expert (q ascending, strict >), then the warp's largest key and the lowest expert
  // holding it: larger probability first, the lower expert on ties.
  for (int r = 0; r < k; r++) {
    uint32_t lk = 0;
    int li = 0x7fffffff;
#pragma unroll
    for (int q = 0; q < PER; q++) {
      const float v = pv[q];
      const uint32_t key = __float_as_uint(v) + 1u;
      if (!(taken & (1u << q)) && v == v && key > lk) {
        lk = key;
        li = lane + 32 * q;
      }
    }
    const uint32_t mk = sc_warp_ext_u32<true>(lk);
    int bi = (int)sc_warp_ext_u32<false>(lk == mk && mk != 0 ? (uint32_t)li : 0xffffffffu);
    // Only if every remaining probability is NaN does no expert win; take the
    // lowest untaken index then (memory safety; NaN routing is unspecified).
    if (mk == 0) {
      bi = 0;
      for (bool again = true; again;) {
        again = false;
        for (int q = 0; q < r; q++)
          if (sid[q] == bi) {
            bi++;
            again = true;
          }
      }
    }
#pragma unroll
    for (int q = 0; q < PER; q++) {
      if (lane + 32 * q == bi) taken |= 1u << q;
    }
    if (lane == 0) sid[r] = bi;
    __syncwarp();
  }
  float s = 0.0f;
  for (int r = 0; r < k; r++) s = sc_add(s, p[sid[r]]);
  const float rinv = sc_div(1.0f, fmaxf(s, 6.103515625e-5f));
  if (lane < k) {
    id_out = sid[lane];
    w_out = sc_mul(p[id_out], rinv);
  }
}
