// The MoE block on the GPU, bit-identical to the CPU (model::moe::route,
// engine/src/cpu/moe.rs): the routing, the combination of expert outputs, the fused
// one-token (or per-row) expert kernels, the decode router, and the kernel that
// hands a tiered step's routing to the host.

#include "sc_dot.cuh"
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

// ------------------------------------------------------------- fused decode MoE
// One token's routed and shared experts in two launches instead of a dozen: the same
// per-row dot products as the _t1 matvec kernels (quant.cu; lane l is accumulator l and
// takes sub-blocks / elements l, l + 32, ... in increasing order, then sc_warp_sum),
// the same SwiGLU, the same rank-order combination as moe_combine: the same bits.

// The contributions of sub-block s of two quantized rows (each only where its flag is
// set) against one token's quantized activations, the loads issued together: one step
// of sc_qdot_rows for each row.
template <class F>
__device__ __forceinline__ void sc_qsub2(const uint8_t* r0, const uint8_t* r1, bool v0, bool v1, int s,
                                         const int8_t* xq, const float* xd, const int* xs, float& c0,
                                         float& c1) {
  typename F::W w0, w1;
  if (v0) F::load(r0, s, w0);
  if (v1) F::load(r1, s, w1);
  uint32_t a[8];
  sc_load_act(xq, s, a);
  const float d = __ldg(xd + s);
  const int sum = __ldg(xs + s);
  if (v0) c0 = F::contrib(w0, a, d, sum);
  if (v1) c1 = F::contrib(w1, a, d, sum);
}

__device__ __forceinline__ void sc_qsub2_any(int ty, const uint8_t* r0, const uint8_t* r1, bool v0, bool v1,
                                             int s, const int8_t* xq, const float* xd, const int* xs,
                                             float& c0, float& c1) {
  switch (ty) {
    case SC_T_Q8_0: sc_qsub2<FmtQ8_0>(r0, r1, v0, v1, s, xq, xd, xs, c0, c1); break;
    case SC_T_Q4_0: sc_qsub2<FmtQ4_0>(r0, r1, v0, v1, s, xq, xd, xs, c0, c1); break;
    case SC_T_Q4_K: sc_qsub2<FmtQ4K>(r0, r1, v0, v1, s, xq, xd, xs, c0, c1); break;
    case SC_T_Q5_K: sc_qsub2<FmtQ5K>(r0, r1, v0, v1, s, xq, xd, xs, c0, c1); break;
    case SC_T_Q6_K: sc_qsub2<FmtQ6K>(r0, r1, v0, v1, s, xq, xd, xs, c0, c1); break;
    case SC_T_IQ4_XS: sc_qsub2<FmtIq4Xs>(r0, r1, v0, v1, s, xq, xd, xs, c0, c1); break;
    default: break;
  }
}
// sc_qsub2_any for every quantized type, the low-bit ones included (the _lb kernels).
__device__ __forceinline__ void sc_qsub2_lb(int ty, const uint8_t* r0, const uint8_t* r1, bool v0, bool v1,
                                            int s, const int8_t* xq, const float* xd, const int* xs,
                                            float& c0, float& c1) {
  if (ty < SC_T_LOWBIT_FIRST) {
    sc_qsub2_any(ty, r0, r1, v0, v1, s, xq, xd, xs, c0, c1);
    return;
  }
  switch (ty) {
#define SC_LB_QSUB2_CASE(CODE, NAME, LOAD, CONTRIB) \
  case CODE: sc_qsub2<FmtLb_##NAME>(r0, r1, v0, v1, s, xq, xd, xs, c0, c1); break;
    SC_LOWBIT_TYPES(SC_LB_QSUB2_CASE)
#undef SC_LB_QSUB2_CASE
    default: break;
  }
}

// The routing of one token and its experts' SwiGLU in one launch. Each block of a
// routed plane first routes the token itself from the router's `logits`
// (sc_route_warp, by its warp 0: every block gets the same bits) and block (0, 0)
// writes the ranks' weights and experts to wts_out / ids_out for moe_down_combine.
// Then act = silu(x·gateᵀ) · (x·upᵀ) for the k routed experts and, as plane k when
// `sgate` is given, the shared expert: one warp per (row, plane), four rows a block,
// blockIdx.y the plane. Routed plane r writes act[r·n_ff ..], the shared plane
// act[k·n_ff ..] (n_sff values). With `gate_inp`, one more warp of the shared plane
// writes the shared gate's logit x·gate_inp (dot_rows: products rounded, then added)
// to *shared_logit. Gate and up share a type (`ty`, `sty`) and a row size. At most
// SC_FUSED_MAX_EXPERT experts. With `aq`, the last block of each plane to finish also
// writes the plane's quantized copy (aq/ad/as at the plane's offset, as quantize_act
// of the whole act row; n_ff and n_sff multiples of 32), counting finished blocks in
// plane_done[plane] (zero before the launch, zero again after it). With `ids_in`
// (k ints), the routing is given instead (`logits`, wts_out and ids_out unused):
// rank r reads expert (or slot) ids_in[r], and a rank with a negative id is left
// alone (its act rows unwritten, its plane not counted or quantized).
// Several tokens (blockIdx.z = token t, each its own routing: a batched decode step of
// several sequences) read row t of logits, x and its quantized copy, and write row t of
// wts_out / ids_out (k each), act and aq (k·n_ff + n_sff each), shared_logit[t], with
// plane_done[t·(k + 1) + plane]; ids_in likewise row t. One token is blockIdx.z = 0, so
// every token gets the bits it gets alone. LB: the types may be low-bit ones too (the
// _lb kernels, which the host picks when the routed or the shared expert's type is
// one; the others never meet such a type).
#define SC_FUSED_MAX_EXPERT 512
template <bool ROWS, bool LB>
__device__ __forceinline__ void moe_gate_up_body(const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up, int ty,
                unsigned long long expert_bytes, unsigned long long row_bytes, int n_ff,
                const uint8_t* __restrict__ sgate, const uint8_t* __restrict__ sup, int sty,
                unsigned long long srow_bytes, int n_sff, const float* __restrict__ logits, int n_expert,
                int k, float* __restrict__ wts_out, int* __restrict__ ids_out, int n_cols,
                const float* __restrict__ x, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                const int* __restrict__ xs, const float* __restrict__ gate_inp,
                float* __restrict__ shared_logit, float* act, int8_t* __restrict__ aq,
                float* __restrict__ ad, int* __restrict__ as, int* __restrict__ plane_done,
                const int* __restrict__ ids_in) {
  
  // Token tk's rows (0 alone): offsets taken where each pointer is used, so that
  // the rows launch keeps the one-token launch's registers.
  const size_t tk = ROWS ? blockIdx.z : 0;
  const size_t aw = (size_t)k * n_ff + (sgate ? n_sff : 0);
  __shared__ float sp[SC_FUSED_MAX_EXPERT];
  __shared__ bool s_last;
  __shared__ int sid[SC_MAX_K];
  __shared__ int s_ids[SC_MAX_K];
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int plane = blockIdx.y;
  const bool shared = plane == k;
  if (!shared) {
    if (ids_in) {
      if ((int)threadIdx.x < k) s_ids[threadIdx.x] = ids_in[tk * k + threadIdx.x];
    } else if (threadIdx.x < 32) {
      float wt = 0.0f;
      int id = 0;
      sc_route_warp<SC_FUSED_MAX_EXPERT / 32>(logits + tk * n_expert, n_expert, k, sp, sid, wt, id);
      if (lane < k) {
        s_ids[lane] = id;
        if (blockIdx.x == 0 && plane == 0) {
          wts_out[tk * k + lane] = wt;
          ids_out[tk * k + lane] = id;
        }
      }
    }
    __syncthreads();
    // A rank computed elsewhere (given a negative id): its whole plane stops here,
    // before counting, so its plane_done entry stays zero.
    if (s_ids[plane] < 0) return;
  }
  const int n_rows = shared ? n_sff : n_ff;
  if (shared && gate_inp && r == n_rows) {
    float acc = 0.0f;
    const float* xt = x + tk * n_cols;
    for (int i = lane; i < n_cols; i += 32) acc = sc_add(acc, sc_mul(xt[i], __ldg(gate_inp + i)));
    acc = sc_warp_sum(acc);
    if (lane == 0) shared_logit[tk] = acc;
  } else if (r < n_rows) {
    const uint8_t* rows[2];
    int t;
    if (shared) {
      rows[0] = sgate + (unsigned long long)r * srow_bytes;
      rows[1] = sup + (unsigned long long)r * srow_bytes;
      t = sty;
    } else {
      const unsigned long long off =
          (unsigned long long)s_ids[plane] * expert_bytes + (unsigned long long)r * row_bytes;
      rows[0] = gate + off;
      rows[1] = up + off;
      t = ty;
    }
    float acc[2] = {0.0f, 0.0f};
    const size_t xo = tk * n_cols;
    if constexpr (LB) {
      sc_dot_rows_lb<2>(t, rows, n_cols, x + xo, xq ? xq + xo : nullptr, xd ? xd + xo / 32 : nullptr,
                        xs ? xs + xo / 32 : nullptr, lane, acc);
    } else {
      sc_dot_rows<2>(t, rows, n_cols, x + xo, xq ? xq + xo : nullptr, xd ? xd + xo / 32 : nullptr,
                     xs ? xs + xo / 32 : nullptr, lane, acc);
    }
    // Gate's sum in lanes 0..15, up's in 16..31 (sc_warp_sum's bits each).
    const float gu = sc_warp_sum_split<2>(acc);
    const float u = __shfl_sync(0xffffffffu, gu, 16);
    if (lane == 0) act[tk * aw + (size_t)plane * n_ff + r] = sc_mul(sc_silu(gu), u);
  }
  if (!aq) return;
  // The last block of a plane to finish quantizes the plane's activations (the
  // threadfence-reduction pattern: every block's writes are visible before its count,
  // and the last one resets the count for the next launch).
  __threadfence();
  __syncthreads();
  plane_done += tk * (k + 1);
  if (threadIdx.x == 0) s_last = atomicAdd(plane_done + plane, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  const size_t base = tk * aw + (size_t)plane * n_ff;
  for (int b = threadIdx.x >> 5; b < (n_rows >> 5); b += blockDim.x >> 5) {
    const size_t at = base + (size_t)b * 32;
    sc_quant_block(__ldcg(act + at + (threadIdx.x & 31)), threadIdx.x & 31, aq + at, ad + at / 32, as + at / 32);
  }
  if (threadIdx.x == 0) plane_done[plane] = 0;
}
// The one-token launch, and the rows launch (see above).
extern "C" __global__ void __launch_bounds__(128) moe_gate_up(const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up, int ty,
                unsigned long long expert_bytes, unsigned long long row_bytes, int n_ff,
                const uint8_t* __restrict__ sgate, const uint8_t* __restrict__ sup, int sty,
                unsigned long long srow_bytes, int n_sff, const float* __restrict__ logits, int n_expert,
                int k, float* __restrict__ wts_out, int* __restrict__ ids_out, int n_cols,
                const float* __restrict__ x, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                const int* __restrict__ xs, const float* __restrict__ gate_inp,
                float* __restrict__ shared_logit, float* act, int8_t* __restrict__ aq,
                float* __restrict__ ad, int* __restrict__ as, int* __restrict__ plane_done,
                const int* __restrict__ ids_in) {
  sc_pdl_enter();
  moe_gate_up_body<false, false>(gate, up, ty, expert_bytes, row_bytes, n_ff, sgate, sup, sty, srow_bytes, n_sff, logits, n_expert, k, wts_out, ids_out, n_cols, x, xq, xd, xs, gate_inp, shared_logit, act, aq, ad, as, plane_done, ids_in);
}
extern "C" __global__ void __launch_bounds__(128) moe_gate_up_rows(const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up, int ty,
                unsigned long long expert_bytes, unsigned long long row_bytes, int n_ff,
                const uint8_t* __restrict__ sgate, const uint8_t* __restrict__ sup, int sty,
                unsigned long long srow_bytes, int n_sff, const float* __restrict__ logits, int n_expert,
                int k, float* __restrict__ wts_out, int* __restrict__ ids_out, int n_cols,
                const float* __restrict__ x, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                const int* __restrict__ xs, const float* __restrict__ gate_inp,
                float* __restrict__ shared_logit, float* act, int8_t* __restrict__ aq,
                float* __restrict__ ad, int* __restrict__ as, int* __restrict__ plane_done,
                const int* __restrict__ ids_in) {
  sc_pdl_enter();
  moe_gate_up_body<true, false>(gate, up, ty, expert_bytes, row_bytes, n_ff, sgate, sup, sty, srow_bytes, n_sff, logits, n_expert, k, wts_out, ids_out, n_cols, x, xq, xd, xs, gate_inp, shared_logit, act, aq, ad, as, plane_done, ids_in);
}
// The two launches for the low-bit types.
extern "C" __global__ void __launch_bounds__(128) moe_gate_up_lb(const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up, int ty,
                unsigned long long expert_bytes, unsigned long long row_bytes, int n_ff,
                const uint8_t* __restrict__ sgate, const uint8_t* __restrict__ sup, int sty,
                unsigned long long srow_bytes, int n_sff, const float* __restrict__ logits, int n_expert,
                int k, float* __restrict__ wts_out, int* __restrict__ ids_out, int n_cols,
                const float* __restrict__ x, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                const int* __restrict__ xs, const float* __restrict__ gate_inp,
                float* __restrict__ shared_logit, float* act, int8_t* __restrict__ aq,
                float* __restrict__ ad, int* __restrict__ as, int* __restrict__ plane_done,
                const int* __restrict__ ids_in) {
  sc_pdl_enter();
  moe_gate_up_body<false, true>(gate, up, ty, expert_bytes, row_bytes, n_ff, sgate, sup, sty, srow_bytes, n_sff, logits, n_expert, k, wts_out, ids_out, n_cols, x, xq, xd, xs, gate_inp, shared_logit, act, aq, ad, as, plane_done, ids_in);
}
extern "C" __global__ void __launch_bounds__(128) moe_gate_up_rows_lb(const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up, int ty,
                unsigned long long expert_bytes, unsigned long long row_bytes, int n_ff,
                const uint8_t* __restrict__ sgate, const uint8_t* __restrict__ sup, int sty,
                unsigned long long srow_bytes, int n_sff, const float* __restrict__ logits, int n_expert,
                int k, float* __restrict__ wts_out, int* __restrict__ ids_out, int n_cols,
                const float* __restrict__ x, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                const int* __restrict__ xs, const float* __restrict__ gate_inp,
                float* __restrict__ shared_logit, float* act, int8_t* __restrict__ aq,
                float* __restrict__ ad, int* __restrict__ as, int* __restrict__ plane_done,
                const int* __restrict__ ids_in) {
  sc_pdl_enter();
  moe_gate_up_body<true, true>(gate, up, ty, expert_bytes, row_bytes, n_ff, sgate, sup, sty, srow_bytes, n_sff, logits, n_expert, k, wts_out, ids_out, n_cols, x, xq, xd, xs, gate_inp, shared_logit, act, aq, ad, as, plane_done, ids_in);
}

// out[c] = Σ_r wts[r] · (act_r · down_{ids[r]}[c]) in rank order from 0.0, then
// + sigmoid(*shared_logit) · (act_k · sdown[c]) (+ the product alone without a logit)
// when `sdown` is given: moe_combine over the down products. One warp per routed rank
// (and one for the shared expert); the first threads add them up. act (and its
// quantized copy aq/ad/as, for quantized types) holds the routed rows at stride n_ff,
// then the shared row (n_sff values). Without `pair`, a block computes output row c =
// blockIdx.x with whole warps. With `pair` (quantized types, rows of at most 16
// sub-blocks), it computes rows 4·blockIdx.x .. + 3, each half-warp two of them (its
// loads together): the canonical sum of such a row has zeros in lanes 16..31, so its
// first tree step is acc + 0 and the rest stays within 16 lanes (the same bits).
// A rank with a negative id takes its products from row r of `given` (k rows of
// n_out values) instead: experts computed elsewhere (tiered decode: by the CPU).
// Several tokens (blockIdx.y = token t): row t of ids, wts (k each), act and its copy
// (k·n_ff + n_sff each), shared_logit, out (n_out) and given (k·n_out), as
// moe_gate_up lays them out; token 0 is the one-token launch. LB: as for moe_gate_up.
template <bool ROWS, bool LB>
__device__ __forceinline__ void moe_down_combine_body(const uint8_t* __restrict__ down, int ty, unsigned long long expert_bytes,
                     unsigned long long row_bytes, int n_ff, const uint8_t* __restrict__ sdown, int sty,
                     unsigned long long srow_bytes, int n_sff, const int* __restrict__ ids,
                     const float* __restrict__ wts, int k, const float* __restrict__ act,
                     const int8_t* __restrict__ aq, const float* __restrict__ ad, const int* __restrict__ as,
                     const float* __restrict__ shared_logit, float* __restrict__ out, int n_out, int pair,
                     const float* __restrict__ given) {
  
  if (ROWS && blockIdx.y) {
    const size_t tk = blockIdx.y;
    const size_t aw = (size_t)k * n_ff + (sdown ? n_sff : 0);
    ids += tk * k;
    wts += tk * k;
    act += tk * aw;
    if (aq) {
      aq += tk * aw;
      ad += tk * aw / 32;
      as += tk * aw / 32;
    }
    if (shared_logit) shared_logit += tk;
    out += tk * n_out;
    if (given) given += tk * k * n_out;
  }
  __shared__ float part[4][32];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const bool shared = w == k;
  const int t = shared ? sty : ty;
  const int n = shared ? n_sff : n_ff;
  const size_t a0 = (size_t)w * n_ff;  // the shared row starts at k·n_ff too
  const int id = shared ? 0 : ids[w];
  const uint8_t* base = shared ? sdown : down + (unsigned long long)max(id, 0) * expert_bytes;
  const unsigned long long rb = shared ? srow_bytes : row_bytes;
  const int rows = pair ? 4 : 1;
  const int c0 = blockIdx.x * rows;
  // part[j][w] is rank w's product for row c0 + j (both modes below).
  if (id < 0) {
    // A rank computed elsewhere: its products are row w of `given`.
    if (lane < rows) part[lane][w] = c0 + lane < n_out ? given[(size_t)w * n_out + c0 + lane] : 0.0f;
  } else if (pair) {
    // Half h of the warp takes rows c0 + h and c0 + 2 + h.
    const int half = lane >> 4, hl = lane & 15;
    const int ca = c0 + half, cb = c0 + 2 + half;
    const bool in = hl < (n >> 5);
    const bool va = in && ca < n_out, vb = in && cb < n_out;
    float pa = 0.0f, pb = 0.0f;
    if constexpr (LB) {
      sc_qsub2_lb(t, base + (unsigned long long)ca * rb, base + (unsigned long long)cb * rb, va, vb, hl, aq + a0,
                  ad + a0 / 32, as + a0 / 32, pa, pb);
    } else {
      sc_qsub2_any(t, base + (unsigned long long)ca * rb, base + (unsigned long long)cb * rb, va, vb, hl, aq + a0,
                   ad + a0 / 32, as + a0 / 32, pa, pb);
    }
    float v[2] = {va ? sc_add(0.0f, pa) : 0.0f, vb ? sc_add(0.0f, pb) : 0.0f};
#pragma unroll
    for (int j = 0; j < 2; j++) {
      v[j] = sc_add(v[j], 0.0f);
#pragma unroll
      for (int o = 8; o >= 1; o >>= 1) v[j] = sc_add(v[j], __shfl_xor_sync(0xffffffffu, v[j], o));
    }
    if (hl == 0) {
      part[half][w] = v[0];
      part[2 + half][w] = v[1];
    }
  } else {
    const uint8_t* rows_p[1] = {base + (unsigned long long)c0 * rb};
    float acc[1] = {0.0f};
    if constexpr (LB) {
      sc_dot_rows_lb<1>(t, rows_p, n, act + a0, aq ? aq + a0 : nullptr, ad ? ad + a0 / 32 : nullptr,
                        as ? as + a0 / 32 : nullptr, lane, acc);
    } else {
      sc_dot_rows<1>(t, rows_p, n, act + a0, aq ? aq + a0 : nullptr, ad ? ad + a0 / 32 : nullptr,
                     as ? as + a0 / 32 : nullptr, lane, acc);
    }
    const float v = sc_warp_sum(acc[0]);
    if (lane == 0) part[0][w] = v;
  }
  __syncthreads();
  if ((int)threadIdx.x < rows && c0 + (int)threadIdx.x < n_out) {
    const float* pt = part[threadIdx.x];
    float o = 0.0f;
    for (int i = 0; i < k; i++) o = sc_add(o, sc_mul(wts[i], pt[i]));
    if (sdown) {
      o = shared_logit ? sc_add(o, sc_mul(sc_sigmoid(*shared_logit), pt[k])) : sc_add(o, pt[k]);
    }
    out[c0 + threadIdx.x] = o;
  }
}
// The one-token launch, and the rows launch (see above).
extern "C" __global__ void __launch_bounds__(1024) moe_down_combine(const uint8_t* __restrict__ down, int ty, unsigned long long expert_bytes,
                     unsigned long long row_bytes, int n_ff, const uint8_t* __restrict__ sdown, int sty,
                     unsigned long long srow_bytes, int n_sff, const int* __restrict__ ids,
                     const float* __restrict__ wts, int k, const float* __restrict__ act,
                     const int8_t* __restrict__ aq, const float* __restrict__ ad, const int* __restrict__ as,
                     const float* __restrict__ shared_logit, float* __restrict__ out, int n_out, int pair,
                     const float* __restrict__ given) {
  sc_pdl_enter();
  moe_down_combine_body<false, false>(down, ty, expert_bytes, row_bytes, n_ff, sdown, sty, srow_bytes, n_sff, ids, wts, k, act, aq, ad, as, shared_logit, out, n_out, pair, given);
}
// The rows launch at 56 registers, so that more of its blocks fit an SM (Q35: four
// blocks of nine warps, not three; the one-token launch fits one wave either way).
extern "C" __global__ void __maxnreg__(56) moe_down_combine_rows(const uint8_t* __restrict__ down, int ty, unsigned long long expert_bytes,
                     unsigned long long row_bytes, int n_ff, const uint8_t* __restrict__ sdown, int sty,
                     unsigned long long srow_bytes, int n_sff, const int* __restrict__ ids,
                     const float* __restrict__ wts, int k, const float* __restrict__ act,
                     const int8_t* __restrict__ aq, const float* __restrict__ ad, const int* __restrict__ as,
                     const float* __restrict__ shared_logit, float* __restrict__ out, int n_out, int pair,
                     const float* __restrict__ given) {
  sc_pdl_enter();
  moe_down_combine_body<true, false>(down, ty, expert_bytes, row_bytes, n_ff, sdown, sty, srow_bytes, n_sff, ids, wts, k, act, aq, ad, as, shared_logit, out, n_out, pair, given);
}
// The two launches for the low-bit types.
extern "C" __global__ void __launch_bounds__(1024) moe_down_combine_lb(const uint8_t* __restrict__ down, int ty, unsigned long long expert_bytes,
                     unsigned long long row_bytes, int n_ff, const uint8_t* __restrict__ sdown, int sty,
                     unsigned long long srow_bytes, int n_sff, const int* __restrict__ ids,
                     const float* __restrict__ wts, int k, const float* __restrict__ act,
                     const int8_t* __restrict__ aq, const float* __restrict__ ad, const int* __restrict__ as,
                     const float* __restrict__ shared_logit, float* __restrict__ out, int n_out, int pair,
                     const float* __restrict__ given) {
  sc_pdl_enter();
  moe_down_combine_body<false, true>(down, ty, expert_bytes, row_bytes, n_ff, sdown, sty, srow_bytes, n_sff, ids, wts, k, act, aq, ad, as, shared_logit, out, n_out, pair, given);
}
extern "C" __global__ void __maxnreg__(56) moe_down_combine_rows_lb(const uint8_t* __restrict__ down, int ty, unsigned long long expert_bytes,
                     unsigned long long row_bytes, int n_ff, const uint8_t* __restrict__ sdown, int sty,
                     unsigned long long srow_bytes, int n_sff, const int* __restrict__ ids,
                     const float* __restrict__ wts, int k, const float* __restrict__ act,
                     const int8_t* __restrict__ aq, const float* __restrict__ ad, const int* __restrict__ as,
                     const float* __restrict__ shared_logit, float* __restrict__ out, int n_out, int pair,
                     const float* __restrict__ given) {
  sc_pdl_enter();
  moe_down_combine_body<true, true>(down, ty, expert_bytes, row_bytes, n_ff, sdown, sty, srow_bytes, n_sff, ids, wts, k, act, aq, ad, as, shared_logit, out, n_out, pair, given);
}

// ------------------------------------------------------------------------ router
// The router of a decode step (a float matrix, one row per expert), a block row per
// token (blockIdx.y = token t: row t of x and of logits). One warp per expert row:
// each lane's share of the row's first 32·SC_RT_PER values is loaded into registers
// before sc_pdl_enter (router_row_load: weights, memory no kernel writes), so the
// row's read overlaps the kernel before; the token's values are staged in shared
// memory (one round trip for the block) rather than loaded by every warp. The logit
// takes the operations of SC_FDOT (accumulator `lane` takes elements lane, lane + 32,
// ... as fma(w, x, acc) in increasing order, then sc_warp_sum): the matvec bits.
// Several tokens run as several block rows rather than one block staging them all
// (Q35, 2026-12-03, bench/RESULTS.md: four streams 802 -> 846 t/s, one 360 -> 371).
#define SC_RT_WARPS 4
#define SC_RT_PER 64
// This lane's share of the 32·SC_RT_PER columns from c0 of this warp's router row
// (zeros past the row's end, and for a warp past the last row): weights only, so a
// kernel may load them before sc_pdl_enter.
struct RouterRow {
  float v[SC_RT_PER];
};
template <class F>
__device__ __forceinline__ void router_row_load(RouterRow& wv, const uint8_t* __restrict__ w,
                                                unsigned long long row_bytes, int n_rows, int n_cols, int c0) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * SC_RT_WARPS + (threadIdx.x >> 5);
  const uint8_t* row = w + (unsigned long long)(r < n_rows ? r : 0) * row_bytes;
#pragma unroll
  for (int q = 0; q < SC_RT_PER; q++) {
    const int c = c0 + lane + 32 * q;
    wv.v[q] = r < n_rows && c < n_cols ? F::get(row, c) : 0.0f;
  }
}
// The rest of the router, after sc_pdl_enter, with the first columns in `wv`; `x`
// and `logits` are the block's token's rows.
template <class F>
__device__ __forceinline__ void router_body(RouterRow& wv, const uint8_t* __restrict__ w,
                                            unsigned long long row_bytes, int n_rows, int n_cols,
                                            const float* __restrict__ x, float* __restrict__ logits) {
  __shared__ __align__(16) float sx[32 * SC_RT_PER];
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * SC_RT_WARPS + (threadIdx.x >> 5);
  float acc = 0.0f;
  // Every thread takes every step (the block synchronises inside).
  for (int c0 = 0; c0 < n_cols; c0 += 32 * SC_RT_PER) {
    const int nc = min(32 * SC_RT_PER, n_cols - c0);  // a multiple of 32 (the host checks)
    if (c0 > 0) {
      router_row_load<F>(wv, w, row_bytes, n_rows, n_cols, c0);
      __syncthreads();  // the columns before are read
    }
    const float4* src = (const float4*)(x + c0);
#pragma unroll 4
    for (int i = threadIdx.x; i < nc / 4; i += blockDim.x) ((float4*)sx)[i] = __ldg(src + i);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < SC_RT_PER; q++) {
      const int c = lane + 32 * q;
      if (c < nc) acc = sc_fma(wv.v[q], sx[c], acc);
    }
  }
  const float v = sc_warp_sum(acc);
  if (r < n_rows && lane == 0) logits[r] = v;
}
// The router_*_r kernels route each token too, in the last block of its row to finish
// (counted in counter[t], zero before the launch and zero again after it: the
// threadfence-reduction pattern), by sc_route_warp as route_topk does it, into
// wts_out / ids_out (k each); n_expert <= 256 (the host checks). Several tokens of a
// decode step save route_topk's launch (Q35, four streams, 2026-12-03: +2.3%).
__device__ __forceinline__ void router_route_tail(const float* __restrict__ logits, int n_expert, int k,
                                                  float* __restrict__ wts_out, int* __restrict__ ids_out,
                                                  int* __restrict__ counter) {
  __shared__ bool s_last;
  __shared__ float sp[256];
  __shared__ int sid[SC_MAX_K];
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(counter + blockIdx.y, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (!s_last || threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  float wt = 0.0f;
  int id = 0;
  sc_route_warp<8>(logits, n_expert, k, sp, sid, wt, id);  // n_expert <= 256 (the host checks)
  if (lane < k) {
    wts_out[(size_t)blockIdx.y * k + lane] = wt;
    ids_out[(size_t)blockIdx.y * k + lane] = id;
  }
  if (lane == 0) counter[blockIdx.y] = 0;
}
#define SC_ROUTER(NAME, FMT, ROUTE)                                                                        \
  extern "C" __global__ void __launch_bounds__(32 * SC_RT_WARPS)                                     \
      NAME(const uint8_t* __restrict__ w, unsigned long long row_bytes, int n_rows, int n_cols,      \
           const float* __restrict__ x, float* __restrict__ logits, int k, float* __restrict__ wts_out, \
           int* __restrict__ ids_out, int* __restrict__ counter) {                                   \
    RouterRow wv;                                                                                    \
    router_row_load<FMT>(wv, w, row_bytes, n_rows, n_cols, 0);                                       \
    sc_pdl_enter();                                                                                  \
    router_body<FMT>(wv, w, row_bytes, n_rows, n_cols, x + (size_t)blockIdx.y * n_cols,             \
                     logits + (size_t)blockIdx.y * n_rows);                                          \
    if (ROUTE) router_route_tail(logits + (size_t)blockIdx.y * n_rows, n_rows, k, wts_out, ids_out, counter); \
  }
SC_ROUTER(router_f32, FmtF32, false)
SC_ROUTER(router_f16, FmtF16, false)
SC_ROUTER(router_bf16, FmtBf16, false)
SC_ROUTER(router_f32_r, FmtF32, true)
SC_ROUTER(router_f16_r, FmtF16, true)
SC_ROUTER(router_bf16_r, FmtBf16, true)
