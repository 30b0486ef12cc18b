// Routing and the combination of expert outputs, bit-identical to the CPU
// (model::moe::route, engine/src/cpu/moe.rs).

#include "sc_common.cuh"
#include "scoria_math.cuh"

#define SC_FULL 0xffffffffu
#define SC_MAX_EXPERT 1024
#define SC_MAX_K 32
#define SC_ROUTE_WARPS 4
#define SC_ROUTE_PER_LANE (SC_MAX_EXPERT / 32)

struct Tile {
  int expert;
  int n;
  int in_row[8];
  int out_row[8];
};

// Larger probability first, the lower expert on ties (a stable descending sort).
__device__ __forceinline__ void sc_better(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) {
    bv = v;
    bi = i;
  }
}

// One warp per token (model::moe::route): softmax over all experts (max, e^(v - max)
// with sc_exp, their sum in the canonical 32-lane order, times 1/sum); the k most
// probable, ties to the lower index; renormalised by 1/max(Σ of the k in rank order,
// 6.103515625e-5). With tiles_gu (n_tok == 1), tile r of tiles_gu = {id_r, 1, in 0,
// out r} and of tiles_down = {id_r, 1, in r, out r}.
extern "C" __global__ void __launch_bounds__(32 * SC_ROUTE_WARPS)
    route_topk(const float* __restrict__ logits, int n_tok, int n_expert, int k,
               float* __restrict__ weights_out, int* __restrict__ ids_out, Tile* __restrict__ tiles_gu,
               Tile* __restrict__ tiles_down) { sc_pdl_enter();
  __shared__ float sp[SC_ROUTE_WARPS][SC_MAX_EXPERT];
  __shared__ int sid[SC_ROUTE_WARPS][SC_MAX_K];
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
  const int t = blockIdx.x * SC_ROUTE_WARPS + wi;
  if (t >= n_tok) return;
  float* p = sp[wi];
  const float* l = logits + (size_t)t * n_expert;
  // Each lane keeps its experts (lane, lane + 32, ...) in registers: one memory round
  // trip, and the k argmax rounds below run without shared-memory scans.
  float pv[SC_ROUTE_PER_LANE];
  bool taken[SC_ROUTE_PER_LANE];
  float mx = -INFINITY;
#pragma unroll
  for (int q = 0; q < SC_ROUTE_PER_LANE; q++) {
    const int e = lane + 32 * q;
    pv[q] = e < n_expert ? l[e] : -INFINITY;
    taken[q] = e >= n_expert;
    if (e < n_expert) mx = fmaxf(mx, pv[q]);
  }
  for (int w = 16; w > 0; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(SC_FULL, mx, w));
  float acc = 0.0f;
#pragma unroll
  for (int q = 0; q < SC_ROUTE_PER_LANE; q++) {
    if (lane + 32 * q < n_expert) {
      pv[q] = sc_exp(sc_sub(pv[q], mx));
      acc = sc_add(acc, pv[q]);
    }
  }
  const float sum = __shfl_sync(SC_FULL, sc_warp_sum(acc), 0);
  const float inv = sc_div(1.0f, sum);
#pragma unroll
  for (int q = 0; q < SC_ROUTE_PER_LANE; q++) {
    const int e = lane + 32 * q;
    if (e < n_expert) {
      pv[q] = sc_mul(pv[q], inv);
      p[e] = pv[q];
    }
  }
  __syncwarp();

  // k rounds of a warp argmax over the experts not yet chosen.
  for (int r = 0; r < k; r++) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
#pragma unroll
    for (int q = 0; q < SC_ROUTE_PER_LANE; q++) {
      if (!taken[q]) sc_better(bv, bi, pv[q], lane + 32 * q);
    }
    for (int w = 16; w > 0; w >>= 1) {
      const float ov = __shfl_xor_sync(SC_FULL, bv, w);
      const int oi = __shfl_xor_sync(SC_FULL, bi, w);
      sc_better(bv, bi, ov, oi);
    }
    // Only if every remaining probability is NaN does no expert win; take the
    // lowest untaken index then (memory safety; NaN routing is unspecified).
    if (bi == 0x7fffffff) {
      bi = 0;
      for (bool again = true; again;) {
        again = false;
        for (int q = 0; q < r; q++)
          if (sid[wi][q] == bi) {
            bi++;
            again = true;
          }
      }
    }
#pragma unroll
    for (int q = 0; q < SC_ROUTE_PER_LANE; q++) {
      if (lane + 32 * q == bi) taken[q] = true;
    }
    if (lane == 0) sid[wi][r] = bi;
    __syncwarp();
  }
  float s = 0.0f;
  for (int r = 0; r < k; r++) s = sc_add(s, p[sid[wi][r]]);
  const float rinv = sc_div(1.0f, fmaxf(s, 6.103515625e-5f));
  if (lane < k) {
    const int id = sid[wi][lane];
    weights_out[(size_t)t * k + lane] = sc_mul(p[id], rinv);
    ids_out[(size_t)t * k + lane] = id;
    if (tiles_gu) {
      Tile g, d;
      g.expert = d.expert = id;
      g.n = d.n = 1;
#pragma unroll
      for (int j = 0; j < 8; j++) g.in_row[j] = g.out_row[j] = d.in_row[j] = d.out_row[j] = 0;
      g.out_row[0] = lane;
      d.in_row[0] = lane;
      d.out_row[0] = lane;
      tiles_gu[lane] = g;
      tiles_down[lane] = d;
    }
  }
}

// out[t][c] = Σ_r w[t][r] · down[t·k + r][c], in rank order from 0.0 (each product
// rounded, then added); then + sigmoid(shared_logit[t]) · shared[t][c] when a shared
// expert is given (+ shared[t][c] when it has no logit). engine/src/cpu/moe.rs.
extern "C" __global__ void __launch_bounds__(256)
    moe_combine(const float* __restrict__ down, const float* __restrict__ weights, int n_tok, int k,
                int e, const float* __restrict__ shared, const float* __restrict__ shared_logit,
                float* __restrict__ out) { sc_pdl_enter();
  const long long n = (long long)n_tok * e;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / e, c = i - t * e;
    float o = 0.0f;
    for (int r = 0; r < k; r++) {
      o = sc_add(o, sc_mul(weights[t * k + r], down[(t * k + r) * e + c]));
    }
    if (shared) {
      const float g = shared_logit ? sc_sigmoid(shared_logit[t]) : 1.0f;
      o = shared_logit ? sc_add(o, sc_mul(g, shared[i])) : sc_add(o, shared[i]);
    }
    out[i] = o;
  }
}
