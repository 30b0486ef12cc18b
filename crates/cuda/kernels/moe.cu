// Routing and the combination of expert outputs, bit-identical to the CPU
// (model::moe::route, engine/src/cpu/moe.rs).

#include "sc_route.cuh"

#define SC_ROUTE_WARPS 4

struct Tile {
  int expert;
  int n;
  int in_row[8];
  int out_row[8];
};

// One warp per token (sc_route_warp). With tiles_gu (n_tok == 1), tile r of
// tiles_gu = {id_r, 1, in 0, out r} and of tiles_down = {id_r, 1, in r, out r}.
extern "C" __global__ void __launch_bounds__(32 * SC_ROUTE_WARPS)
    route_topk(const float* __restrict__ logits, int n_tok, int n_expert, int k,
               float* __restrict__ weights_out, int* __restrict__ ids_out, Tile* __restrict__ tiles_gu,
               Tile* __restrict__ tiles_down) {
  sc_pdl_enter();
  __shared__ float sp[SC_ROUTE_WARPS][SC_MAX_EXPERT];
  __shared__ int sid[SC_ROUTE_WARPS][SC_MAX_K];
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
  const int t = blockIdx.x * SC_ROUTE_WARPS + wi;
  if (t >= n_tok) return;
  float wt = 0.0f;
  int id = 0;
  // As few experts per lane as the count needs (the same routing; the k argmax
  // rounds scan PER registers each).
  const float* l = logits + (size_t)t * n_expert;
  if (n_expert <= 256) {
    sc_route_warp<8>(l, n_expert, k, sp[wi], sid[wi], wt, id);
  } else if (n_expert <= 512) {
    sc_route_warp<16>(l, n_expert, k, sp[wi], sid[wi], wt, id);
  } else {
    sc_route_warp<SC_MAX_EXPERT / 32>(l, n_expert, k, sp[wi], sid[wi], wt, id);
  }
  if (lane < k) {
    weights_out[(size_t)t * k + lane] = wt;
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

// The words of a (n_a) and then b (n_b) copied to mapped host memory at host[4..],
// then host[0] set to 1 once they are visible there: one block. The host polls
// host[0] (Gpu::wait_word), reads the words, and clears it before the next launch.
// A tiered decode step hands its routing and expert input to the host this way,
// without a copy on the copy engine or an event.
extern "C" __global__ void __launch_bounds__(256)
    publish_words(const uint32_t* __restrict__ a, int n_a, const uint32_t* __restrict__ b, int n_b,
                  volatile uint32_t* host) {
  sc_pdl_enter();
  for (int i = threadIdx.x; i < n_a + n_b; i += blockDim.x) host[4 + i] = i < n_a ? a[i] : b[i - n_a];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) host[0] = 1u;
}
