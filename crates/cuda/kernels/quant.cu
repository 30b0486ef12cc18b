// Activation quantization, the canonical matvec over token tiles, embedding rows and
// the mixers' joint input projections. Every output is bit-identical to the CPU
// (crates/quant): quant::quantize_act, quant::matvec / quant::dot,
// quant::dequantize_row.

#include "sc_dot.cuh"
#include "scoria_math.cuh"


// ------------------------------------------------------------------ quantize_act
// One warp per 32-value block, lane i = value i (sc_quant_block).
extern "C" __global__ void __launch_bounds__(256) quantize_act(const float* __restrict__ x, long long n_blocks,
                                                               int8_t* __restrict__ qs, float* __restrict__ d_out,
                                                               int* __restrict__ sums) {
  sc_pdl_enter();
  const long long blk = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (blk >= n_blocks) return;  // whole warps only: blockDim is a multiple of 32
  sc_quant_block(x[blk * 32 + (threadIdx.x & 31)], threadIdx.x & 31, qs + blk * 32, d_out + blk, sums + blk);
}

// ------------------------------------------------------------------------ matvec
// A tile of up to 8 tokens multiplied by the weight matrix of one expert. Mirrors the
// Rust `Tile` (#[repr(C)]).
struct Tile {
  int expert;
  int n;
  int in_row[8];
  int out_row[8];
};

#define SC_TILE 8

// Quantized rows: lane `lane` is accumulator `lane` and takes sub-blocks lane,
// lane + 32, ... in increasing order; each sub-block is decoded once and meets every
// token of the tile.
#define SC_QDOT(W, LOAD, CONTRIB)                                                        \
  _Pragma("unroll 2") for (int s = lane; s < n_sub; s += 32) {                          \
    W w;                                                                                 \
    LOAD(row, s, w);                                                                     \
    _Pragma("unroll") for (int j = 0; j < TL; j++) {                                     \
      if (j < nt) {                                                                      \
        const size_t ab = (size_t)in_r[j] * n_sub + s;                                   \
        uint32_t a[8];                                                                   \
        sc_load_act(xq, ab, a);                                                          \
        acc[j] = sc_add(acc[j], CONTRIB(w, a, __ldg(xd + ab), __ldg(xs + ab)));          \
      }                                                                                  \
    }                                                                                    \
  }

// Float rows: accumulator `lane` takes elements lane, lane + 32, ... as
// acc = fma(w_i, x_i, acc), in increasing order. The loads of SC_FB = 16 elements are
// issued together before their FMAs (one memory round trip per 16 instead of per
// element).
#define SC_FB 16
#define SC_FDOT(GET)                                                                      \
  for (int i0 = lane; i0 < n_cols; i0 += 32 * SC_FB) {                                       \
    float wv[SC_FB];                                                                         \
    _Pragma("unroll") for (int q = 0; q < SC_FB; q++) {                                      \
      const int i = i0 + 32 * q;                                                          \
      wv[q] = i < n_cols ? GET(row, i) : 0.0f;                                            \
    }                                                                                     \
    _Pragma("unroll") for (int j = 0; j < TL; j++) {                                      \
      if (j < nt) {                                                                       \
        const float* xr = x + (size_t)in_r[j] * n_cols;                                   \
        float xv[SC_FB];                                                                     \
        _Pragma("unroll") for (int q = 0; q < SC_FB; q++) {                                  \
          const int i = i0 + 32 * q;                                                      \
          xv[q] = i < n_cols ? __ldg(xr + i) : 0.0f;                                      \
        }                                                                                 \
        _Pragma("unroll") for (int q = 0; q < SC_FB; q++) {                                  \
          if (i0 + 32 * q < n_cols) acc[j] = sc_fma(wv[q], xv[q], acc[j]);                \
        }                                                                                 \
      }                                                                                   \
    }                                                                                     \
  }

// One warp per weight row; blockIdx.y walks the token tiles (implicit tiles of 8
// consecutive tokens when `tiles` is null, else the device array). The grid depends
// only on host values; a tile with n <= 0 is skipped. A tile's tokens meet each
// decoded weight sub-block in groups of TL: the TL = 8 kernels serve prompts, the
// TL = 1 kernels (suffix _t1) single tokens (decode), with fewer live registers and
// so more warps in flight, the TL = 4 ones (_t4) 2 to 4 tokens of a plain float matrix
// (a batched decode step of several sequences; quantized ones take matvec_r2_body).
// All perform the same operations per (row, token).
#define SC_MATVEC_KERNEL_T(NAME, TLV, LB, BODY)                                           \
  extern "C" __global__ void LB                                                          \
      NAME(const uint8_t* __restrict__ w, unsigned long long expert_bytes,               \
           unsigned long long row_bytes, int n_rows, int n_cols, const float* __restrict__ x, \
           const int8_t* __restrict__ xq, const float* __restrict__ xd,                  \
           const int* __restrict__ xs, int n_tok, const Tile* __restrict__ tiles,        \
           int n_tiles, float* __restrict__ out) {                                       \
    const int lane = threadIdx.x & 31;                                                   \
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);                   \
    /* One token of a plain matrix: its row into L2 while the kernel before runs. */     \
    if (TLV <= 4 && tiles == nullptr && r < n_rows) sc_prefetch_l2(w + (unsigned long long)r * row_bytes, row_bytes); \
    sc_pdl_enter();                                                                      \
    constexpr int TL = TLV;                                                              \
    if (r >= n_rows) return;                                                             \
    const int n_sub = n_cols >> 5; /* the quantized bodies' */                           \
    (void)n_sub;                                                                         \
    const int n_units = tiles ? n_tiles : (n_tok + SC_TILE - 1) / SC_TILE;               \
    for (int u = blockIdx.y; u < n_units; u += gridDim.y) {                              \
      int n_in, expert = 0;                                                              \
      const Tile* tl = tiles ? tiles + u : nullptr;                                      \
      const int t0 = u * SC_TILE;                                                        \
      if (tl) {                                                                          \
        expert = tl->expert;                                                             \
        n_in = min(tl->n, SC_TILE);                                                      \
      } else {                                                                           \
        n_in = min(SC_TILE, n_tok - t0);                                                 \
      }                                                                                  \
      const uint8_t* row = w + (unsigned long long)expert * expert_bytes +              \
                           (unsigned long long)r * row_bytes;                            \
      for (int g = 0; g < n_in; g += TL) {                                               \
        const int nt = min(TL, n_in - g);                                                \
        int in_r[TL];                                                                    \
        _Pragma("unroll") for (int j = 0; j < TL; j++) {                                 \
          in_r[j] = tl ? tl->in_row[min(g + j, SC_TILE - 1)] : t0 + g + j;               \
        }                                                                                \
        float acc[TL];                                                                   \
        _Pragma("unroll") for (int j = 0; j < TL; j++) acc[j] = 0.0f;                    \
        BODY                                                                             \
        _Pragma("unroll") for (int j = 0; j < TL; j++) {                                 \
          if (j < nt) {                                                                  \
            const float v = sc_warp_sum(acc[j]);                                         \
            const int orow = tl ? tl->out_row[g + j] : t0 + g + j;                       \
            if (lane == 0) out[(size_t)orow * n_rows + r] = v;                           \
          }                                                                              \
        }                                                                                \
      }                                                                                  \
    }                                                                                    \
  }
// Float types: the three kernels. Quantized types: the TL = 8 and _t1 kernels here;
// their _t4 kernels take two rows a warp (matvec_r2_body, below).
#define SC_MATVEC_KERNEL_F(NAME, BODY)                                                    \
  SC_MATVEC_KERNEL_T(NAME, 8, __launch_bounds__(128), BODY)                              \
  SC_MATVEC_KERNEL_T(NAME##_t4, 4, __launch_bounds__(128), BODY)                         \
  SC_MATVEC_KERNEL_T(NAME##_t1, 1, __launch_bounds__(128), BODY)
#define SC_MATVEC_KERNEL(NAME, BODY)                                                      \
  SC_MATVEC_KERNEL_T(NAME, 8, __launch_bounds__(128), BODY)                              \
  SC_MATVEC_KERNEL_T(NAME##_t1, 1, __launch_bounds__(128), BODY)

SC_MATVEC_KERNEL_F(matvec_f32, SC_FDOT(sc_get_f32))
SC_MATVEC_KERNEL_F(matvec_f16, SC_FDOT(sc_get_f16))
SC_MATVEC_KERNEL_F(matvec_bf16, SC_FDOT(sc_get_bf16))
SC_MATVEC_KERNEL(matvec_q8_0, SC_QDOT(WQ8_0, sc_load_q8_0, sc_contrib_q8_0))
SC_MATVEC_KERNEL(matvec_q4_0, SC_QDOT(WQ4_0, sc_load_q4_0, sc_contrib_q4_0))
SC_MATVEC_KERNEL(matvec_q4_k, SC_QDOT(WK, sc_load_q4_k, sc_contrib_k))
SC_MATVEC_KERNEL(matvec_q5_k, SC_QDOT(WK, sc_load_q5_k, sc_contrib_k))
SC_MATVEC_KERNEL(matvec_q6_k, SC_QDOT(WQ6_K, sc_load_q6_k, sc_contrib_q6_k))
SC_MATVEC_KERNEL(matvec_iq4_xs, SC_QDOT(WIQ4, sc_load_iq4_xs, sc_contrib_iq4_xs))
// The low-bit types (sc_formats.cuh's list): matvec_q2_k, matvec_q2_k_t1, ...
#define SC_LB_MATVEC(CODE, NAME, LOAD, CONTRIB) SC_MATVEC_KERNEL(matvec_##NAME, SC_QDOT(WLB, LOAD, CONTRIB))
SC_LOWBIT_TYPES(SC_LB_MATVEC)
#undef SC_LB_MATVEC

// The rows each tile wrote (`out_row[j]`, `cols` values at stride `cols`) times
// their matrix's second-level scale, one multiplication a value (the CPU's
// engine::cpu::apply_scale): row r's is per_route[r] when given (tiered layers, whose
// tiles name slots), else per_expert[expert]. One block a tile.
extern "C" __global__ void __launch_bounds__(256) scale_tile_rows(float* __restrict__ out, int cols,
                                                                  const Tile* __restrict__ tiles,
                                                                  const float* __restrict__ per_expert,
                                                                  const float* __restrict__ per_route) {
  sc_pdl_enter();
  const Tile* t = tiles + blockIdx.x;
  for (int j = 0; j < t->n; j++) {
    const int r = t->out_row[j];
    const float s = per_route ? per_route[r] : per_expert[t->expert];
    float* row = out + (size_t)r * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) row[c] = sc_mul(row[c], s);
  }
}

// ---------------------------------------------------------------- float matmul
// Float weights × many tokens of a plain matrix (a prompt's router): SC_FDOT's
// operations per (row, token) — lane l is accumulator l and takes elements l, l + 32,
// ... in increasing order as acc = fma(w_i, x_i, acc), then the warp's tree — with a
// block's rows and tokens staged in shared memory, so that each element a lane reads
// serves 8 products instead of one. A block of 8 warps computes 16 rows × 32 tokens:
// warp w takes rows 8·(w & 1) .. + 7 and tokens 8·(w >> 1) .. + 7, so each lane keeps
// 64 accumulators. K advances SC_MF_K columns a stage; the next stage's elements are
// loaded into registers while this one is multiplied. n_cols must be a multiple of
// SC_MF_K (the host checks), so every element a lane takes exists.
#define SC_MF_ROWS 16
#define SC_MF_TOK 32
#define SC_MF_K 128
template <int TY>
__device__ __forceinline__ void sc_mf_body(const uint8_t* __restrict__ w, unsigned long long row_bytes, int n_rows,
                                           int n_cols, const float* __restrict__ x, int n_tok,
                                           float* __restrict__ out) {
  __shared__ float sw[SC_MF_ROWS][SC_MF_K];
  __shared__ float sx[SC_MF_TOK][SC_MF_K];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r0 = blockIdx.x * SC_MF_ROWS, t0 = blockIdx.y * SC_MF_TOK;
  const int wr = 8 * (warp & 1), wt = 8 * (warp >> 1);
  constexpr int PW = SC_MF_ROWS * SC_MF_K / 256, PX = SC_MF_TOK * SC_MF_K / 256;
  // Element tid + 256·q of the stage's tile: consecutive threads, consecutive columns.
  float pw[PW], px[PX];
  auto load = [&](int k0) {
#pragma unroll
    for (int q = 0; q < PW; q++) {
      const int e = tid + 256 * q, r = r0 + e / SC_MF_K;
      const uint8_t* row = w + (unsigned long long)r * row_bytes;
      pw[q] = r < n_rows ? sc_dequant(TY, row, k0 + e % SC_MF_K) : 0.0f;
    }
#pragma unroll
    for (int q = 0; q < PX; q++) {
      const int e = tid + 256 * q, t = t0 + e / SC_MF_K;
      px[q] = t < n_tok ? __ldg(x + (size_t)t * n_cols + k0 + e % SC_MF_K) : 0.0f;
    }
  };
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
  load(0);
  for (int k0 = 0; k0 < n_cols; k0 += SC_MF_K) {
    __syncthreads();  // the previous stage is consumed
#pragma unroll
    for (int q = 0; q < PW; q++) (&sw[0][0])[tid + 256 * q] = pw[q];
#pragma unroll
    for (int q = 0; q < PX; q++) (&sx[0][0])[tid + 256 * q] = px[q];
    __syncthreads();
    if (k0 + SC_MF_K < n_cols) load(k0 + SC_MF_K);
#pragma unroll
    for (int kk = 0; kk < SC_MF_K / 32; kk++) {
      const int c = lane + 32 * kk;
      float a[8], b[8];
#pragma unroll
      for (int i = 0; i < 8; i++) a[i] = sw[wr + i][c];
#pragma unroll
      for (int j = 0; j < 8; j++) b[j] = sx[wt + j][c];
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = sc_fma(a[i], b[j], acc[i][j]);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) {
      const float v = sc_warp_sum(acc[i][j]);
      const int r = r0 + wr + i, t = t0 + wt + j;
      if (lane == 0 && r < n_rows && t < n_tok) out[(size_t)t * n_rows + r] = v;
    }
}

#define SC_MF_KERNEL(NAME, TY)                                                                  \
  extern "C" __global__ void __launch_bounds__(256, 1)                                        \
      NAME(const uint8_t* __restrict__ w, unsigned long long row_bytes, int n_rows, int n_cols, \
           const float* __restrict__ x, int n_tok, float* __restrict__ out) {                   \
    sc_pdl_enter();                                                                             \
    sc_mf_body<TY>(w, row_bytes, n_rows, n_cols, x, n_tok, out);                                \
  }
SC_MF_KERNEL(mm_f32, SC_T_F32)
SC_MF_KERNEL(mm_f16, SC_T_F16)
SC_MF_KERNEL(mm_bf16, SC_T_BF16)

// ------------------------------------------------------------------------- embed
// out[t][i] = element i of table row ids[t] (quant::dequantize_row).
extern "C" __global__ void __launch_bounds__(256) embed(int ty, const uint8_t* __restrict__ table,
                                                        unsigned long long row_bytes, int cols,
                                                        const int* __restrict__ ids, int n_tok,
                                                        float* __restrict__ out) { sc_pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= cols) return;
  for (int t = blockIdx.y; t < n_tok; t += gridDim.y) {
    const uint8_t* row = table + (unsigned long long)ids[t] * row_bytes;
    out[(size_t)t * cols + i] = sc_dequant(ty, row, i);
  }
}
// The same for the low-bit types (sc_dequant_lb): quant::dequantize_row.
extern "C" __global__ void __launch_bounds__(256) embed_lb(int ty, const uint8_t* __restrict__ table,
                                                           unsigned long long row_bytes, int cols,
                                                           const int* __restrict__ ids, int n_tok,
                                                           float* __restrict__ out) {
  sc_pdl_enter();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= cols) return;
  for (int t = blockIdx.y; t < n_tok; t += gridDim.y) {
    const uint8_t* row = table + (unsigned long long)ids[t] * row_bytes;
    out[(size_t)t * cols + i] = sc_dequant_lb(ty, row, i);
  }
}

// Two rows against nt <= 4 tokens at once (a batched decode step's dense rows): acc[t]
// and acc[4 + t] are row r0's and row r1's lane sums for token t, each with the
// operations of sc_qdot_rows for that row and token alone (the one-token bits). Each
// token's activation sub-block is loaded once for both rows. Without r1, one row.
template <class F>
__device__ __forceinline__ void sc_qdot_toks_r2(const uint8_t* r0, const uint8_t* r1, int n_sub,
                                                const int8_t* xq, const float* xd, const int* xs,
                                                int nt, int lane, float (&acc)[8]) {
#pragma unroll 1
  for (int s = lane; s < n_sub; s += 32) {
    typename F::W w0, w1;
    F::load(r0, s, w0);
    if (r1) F::load(r1, s, w1);
#pragma unroll
    for (int t = 0; t < 4; t++) {
      if (t < nt) {
        const size_t b = (size_t)t * n_sub + s;
        uint32_t a[8];
        sc_load_act(xq, b, a);
        const float d = __ldg(xd + b);
        const int sum = __ldg(xs + b);
        acc[t] = sc_add(acc[t], F::contrib(w0, a, d, sum));
        if (r1) acc[4 + t] = sc_add(acc[4 + t], F::contrib(w1, a, d, sum));
      }
    }
  }
}

// The same for float rows (each token's float activations, n_cols apart): SC_FDOT per
// row and token, as sc_fdot_rows computes it for one token.
template <class F>
__device__ __forceinline__ void sc_fdot_toks_r2(const uint8_t* r0, const uint8_t* r1, int n_cols,
                                                const float* x, int nt, int lane, float (&acc)[8]) {
#pragma unroll 1
  for (int t = 0; t < nt; t++) {
    const uint8_t* rows[2] = {r0, r1};
    float a[2] = {0.0f, 0.0f};
    if (r1) {
      sc_fdot_rows<F, 2>(rows, n_cols, x + (size_t)t * n_cols, lane, a);
    } else {
      sc_fdot_rows<F, 1>(rows, n_cols, x + (size_t)t * n_cols, lane, a);
    }
    // acc indexed by constants only, so that it stays in registers.
#pragma unroll
    for (int u = 0; u < 4; u++) {
      if (u == t) {
        acc[u] = a[0];
        acc[4 + u] = a[1];
      }
    }
  }
}

// Several tokens (a batched decode step: rows of xq, n_cols values apart) of a plain
// quantized matrix, two weight rows a warp: token t's value of row r is in lanes
// 4·(4·(r − r0) + t) .. + 3 after sc_warp_sum_split<8>, each (row, token) with the
// one-token bits. Tokens go four at a time.
template <class F>
__device__ __forceinline__ void matvec_r2_body(const uint8_t* __restrict__ w, unsigned long long row_bytes,
                                               int n_rows, int n_cols, const int8_t* __restrict__ xq,
                                               const float* __restrict__ xd, const int* __restrict__ xs,
                                               int n_tok, float* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int r0 = 2 * (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
  if (r0 >= n_rows) return;
  const bool two = r0 + 1 < n_rows;
  const uint8_t* row0 = w + (unsigned long long)r0 * row_bytes;
  const uint8_t* row1 = two ? row0 + row_bytes : nullptr;
  const int n_sub = n_cols >> 5;
  const int i = lane >> 2, rr = i >> 2, t = i & 3;
  for (int t0 = 0; t0 < n_tok; t0 += 4) {
    const int nt = min(4, n_tok - t0);
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const size_t bo = (size_t)t0 * n_sub;
    sc_qdot_toks_r2<F>(row0, row1, n_sub, xq + bo * 32, xd + bo, xs + bo, nt, lane, acc);
    const float v = sc_warp_sum_split<8>(acc);
    if ((lane & 3) == 0 && t < nt && (rr == 0 || two)) out[(size_t)(t0 + t) * n_rows + r0 + rr] = v;
  }
}
// The _t4 kernels' arguments (tiles unused: plain matrices only); the two rows into
// L2 while the kernel before runs. Six blocks an SM (Q4_K: 61 registers, no spills).
#define SC_MATVEC_R2(NAME, FMT)                                                                     \
  extern "C" __global__ void __launch_bounds__(128, 6)                                             \
      NAME(const uint8_t* __restrict__ w, unsigned long long expert_bytes,                         \
           unsigned long long row_bytes, int n_rows, int n_cols, const float* __restrict__ x,      \
           const int8_t* __restrict__ xq, const float* __restrict__ xd,                           \
           const int* __restrict__ xs, int n_tok, const Tile* __restrict__ tiles,                  \
           int n_tiles, float* __restrict__ out) {                                                \
    const int r0 = 2 * (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));                     \
    if (r0 < n_rows) sc_prefetch_l2(w + (unsigned long long)r0 * row_bytes, row_bytes * min(2, n_rows - r0)); \
    sc_pdl_enter();                                                                                \
    matvec_r2_body<FMT>(w, row_bytes, n_rows, n_cols, xq, xd, xs, n_tok, out);                     \
  }
SC_MATVEC_R2(matvec_q8_0_t4, FmtQ8_0)
SC_MATVEC_R2(matvec_q4_0_t4, FmtQ4_0)
SC_MATVEC_R2(matvec_q4_k_t4, FmtQ4K)
SC_MATVEC_R2(matvec_q5_k_t4, FmtQ5K)
SC_MATVEC_R2(matvec_q6_k_t4, FmtQ6K)
SC_MATVEC_R2(matvec_iq4_xs_t4, FmtIq4Xs)
#define SC_LB_MATVEC_R2(CODE, NAME, LOAD, CONTRIB) SC_MATVEC_R2(matvec_##NAME##_t4, FmtLb_##NAME)
SC_LOWBIT_TYPES(SC_LB_MATVEC_R2)
#undef SC_LB_MATVEC_R2

// ------------------------------------------------------------------ matvec_multi
// One token against up to four matrices that read it (a mixer's input projections)
// in one launch: their rows laid end to end (matrix p ends at row end_p of the joint
// row space), one warp per row, four rows a block, each row's value as the _t1
// kernels compute it. `tys` packs the four type codes a byte each (matrix p in bits
// 8p..8p+7). With conv_state, matrix 0's row c passes through the causal conv of
// channel c before it is written (model::deltanet::conv_step, as dn_conv does it
// for one token): acc = Σ_j hist[j]·taps[j] in j order (products rounded, then
// added), acc += x·taps[d_conv-1], out = silu(acc); the history shifts and takes x.
// matvec_multi_rows: n_tok tokens (rows of x and its copy); matrix p's output has a
// row of its n_rows_p values per token, each the one-token bits, and with conv_tab
// (n_tok state addresses) token t's row of matrix 0 passes through the conv with the
// state at conv_tab[t] (each sequence its own).
// This warp's weight row into L2 while the kernel before runs (what matvec_multi
// may do before sc_pdl_enter(): weights are memory no kernel writes).
__device__ __forceinline__ void matvec_multi_prefetch(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2,
                                                      const uint8_t* w3, unsigned long long rb0,
                                                      unsigned long long rb1, unsigned long long rb2,
                                                      unsigned long long rb3, int end0, int end1, int end2,
                                                      int end3) {
  const int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int p = g < end0 ? 0 : g < end1 ? 1 : g < end2 ? 2 : 3;
  const int r = g - (p == 0 ? 0 : p == 1 ? end0 : p == 2 ? end1 : end2);
  const uint8_t* w = p == 0 ? w0 : p == 1 ? w1 : p == 2 ? w2 : w3;
  const unsigned long long rb = p == 0 ? rb0 : p == 1 ? rb1 : p == 2 ? rb2 : rb3;
  if (g < end3) sc_prefetch_l2(w + (unsigned long long)r * rb, rb);
}

// One channel's causal conv step (see above): the history `st` (d_conv − 1 values)
// against `taps` (d_conv), then x; the history shifts and takes x. Returns silu(conv).
__device__ __forceinline__ float sc_conv_channel(float* st, const float* taps, int d_conv, float x) {
  const int hist = d_conv - 1;
  float c = 0.0f;
  for (int j = 0; j < hist; j++) c = sc_add(c, sc_mul(st[j], taps[j]));
  c = sc_add(c, sc_mul(x, taps[hist]));
  for (int j = 0; j + 1 < hist; j++) st[j] = st[j + 1];
  if (hist > 0) st[hist - 1] = x;
  return sc_silu(c);
}

// LB: the matrices may be of the low-bit types too (matvec_multi_lb).
template <bool LB>
__device__ __forceinline__ void matvec_multi_body(
    const uint8_t* __restrict__ w0, const uint8_t* __restrict__ w1, const uint8_t* __restrict__ w2,
    const uint8_t* __restrict__ w3, int tys, unsigned long long rb0, unsigned long long rb1,
    unsigned long long rb2, unsigned long long rb3, int end0, int end1, int end2, int end3,
    float* __restrict__ out0, float* __restrict__ out1, float* __restrict__ out2,
    float* __restrict__ out3, int n_cols, const float* __restrict__ x,
    const int8_t* __restrict__ xq, const float* __restrict__ xd, const int* __restrict__ xs,
    float* __restrict__ conv_state, const float* __restrict__ conv_taps, int d_conv) {
  const int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int p = g < end0 ? 0 : g < end1 ? 1 : g < end2 ? 2 : 3;
  const int r = g - (p == 0 ? 0 : p == 1 ? end0 : p == 2 ? end1 : end2);
  const uint8_t* w = p == 0 ? w0 : p == 1 ? w1 : p == 2 ? w2 : w3;
  const unsigned long long rb = p == 0 ? rb0 : p == 1 ? rb1 : p == 2 ? rb2 : rb3;
  const int lane = threadIdx.x & 31;
  if (g >= end3) return;
  float* out = p == 0 ? out0 : p == 1 ? out1 : p == 2 ? out2 : out3;
  const uint8_t* rows[1] = {w + (unsigned long long)r * rb};
  float acc[1] = {0.0f};
  if constexpr (LB) {
    sc_dot_rows_lb<1>((tys >> (8 * p)) & 0xff, rows, n_cols, x, xq, xd, xs, lane, acc);
  } else {
    sc_dot_rows<1>((tys >> (8 * p)) & 0xff, rows, n_cols, x, xq, xd, xs, lane, acc);
  }
  float v = sc_warp_sum(acc[0]);
  if (lane != 0) return;
  if (p == 0 && conv_state) {
    v = sc_conv_channel(conv_state + (size_t)r * (d_conv - 1), conv_taps + (size_t)r * d_conv, d_conv, v);
  }
  out[r] = v;
}

// The kernels' shared argument list (the rows kernels use n_tok and conv_tab, the
// one-token kernel conv_state).
#define SC_MULTI_ARGS                                                                                \
  const uint8_t *__restrict__ w0, const uint8_t *__restrict__ w1, const uint8_t *__restrict__ w2,   \
      const uint8_t *__restrict__ w3, int tys, unsigned long long rb0, unsigned long long rb1,      \
      unsigned long long rb2, unsigned long long rb3, int end0, int end1, int end2, int end3,       \
      float *__restrict__ out0, float *__restrict__ out1, float *__restrict__ out2,                 \
      float *__restrict__ out3, int n_cols, const float *__restrict__ x,                            \
      const int8_t *__restrict__ xq, const float *__restrict__ xd, const int *__restrict__ xs,      \
      float *__restrict__ conv_state, const float *__restrict__ conv_taps, int d_conv, int n_tok,   \
      const unsigned long long *__restrict__ conv_tab

extern "C" __global__ void __launch_bounds__(128) matvec_multi(SC_MULTI_ARGS) {
  matvec_multi_prefetch(w0, w1, w2, w3, rb0, rb1, rb2, rb3, end0, end1, end2, end3);
  sc_pdl_enter();
  matvec_multi_body<false>(w0, w1, w2, w3, tys, rb0, rb1, rb2, rb3, end0, end1, end2, end3, out0, out1, out2,
                           out3, n_cols, x, xq, xd, xs, conv_state, conv_taps, d_conv);
}
// matvec_multi when a matrix is of a low-bit type.
extern "C" __global__ void __launch_bounds__(128) matvec_multi_lb(SC_MULTI_ARGS) {
  matvec_multi_prefetch(w0, w1, w2, w3, rb0, rb1, rb2, rb3, end0, end1, end2, end3);
  sc_pdl_enter();
  matvec_multi_body<true>(w0, w1, w2, w3, tys, rb0, rb1, rb2, rb3, end0, end1, end2, end3, out0, out1, out2,
                          out3, n_cols, x, xq, xd, xs, conv_state, conv_taps, d_conv);
}

// matvec_multi_rows: two rows of the joint row space a warp (rows 2g and 2g + 1), all of
// one type F (the host launches once per type): two rows of one matrix share each
// token's activation loads (sc_qdot_toks_r2) and one sc_warp_sum_split<8>, and their
// 8 values a group of four tokens are written, conv included, by 8 lanes at once; a
// pair that straddles two matrices takes its rows one at a time. One type a kernel
// keeps the registers of that type's loop (Q35, 2026-12-03: 80 against 128 with
// spills for all types in one kernel, and four streams 895 -> 927 t/s).
// Rows r .. r + n − 1 (n = 1 or 2) of one matrix, all tokens, into `out` (n_rows_p
// values a token), through the conv when `taps`.
template <class F, bool FLOAT>
__device__ __forceinline__ void multi_rows_run(const uint8_t* __restrict__ row0, unsigned long long rb, int n,
                                               int r, float* __restrict__ out, int n_rows_p, int n_cols,
                                               const float* __restrict__ x, const int8_t* __restrict__ xq,
                                               const float* __restrict__ xd, const int* __restrict__ xs,
                                               const float* __restrict__ taps, int d_conv, int n_tok,
                                               const unsigned long long* __restrict__ conv_tab) {
  const int lane = threadIdx.x & 31;
  const int i = lane >> 2, rr = i >> 2, t = i & 3;  // this lane's (row, token) after the split
  const uint8_t* row1 = n == 2 ? row0 + rb : nullptr;
  const int n_sub = n_cols >> 5;
#pragma unroll 1
  for (int t0 = 0; t0 < n_tok; t0 += 4) {
    const int nt = min(4, n_tok - t0);
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if constexpr (FLOAT) {
      sc_fdot_toks_r2<F>(row0, row1, n_cols, x + (size_t)t0 * n_cols, nt, lane, acc);
    } else {
      const size_t bo = (size_t)t0 * n_sub;
      sc_qdot_toks_r2<F>(row0, row1, n_sub, xq + bo * 32, xd + bo, xs + bo, nt, lane, acc);
    }
    float v = sc_warp_sum_split<8>(acc);
    if ((lane & 3) == 0 && t < nt && rr < n) {
      if (taps) {
        float* st = reinterpret_cast<float*>(conv_tab[t0 + t]) + (size_t)(r + rr) * (d_conv - 1);
        v = sc_conv_channel(st, taps + (size_t)(r + rr) * d_conv, d_conv, v);
      }
      out[(t0 + t) * (size_t)n_rows_p + r + rr] = v;
    }
  }
}

template <class F, bool FLOAT>
__device__ __forceinline__ void matvec_multi_rows_body(
    const uint8_t* __restrict__ w0, const uint8_t* __restrict__ w1, const uint8_t* __restrict__ w2,
    const uint8_t* __restrict__ w3, unsigned long long rb0, unsigned long long rb1,
    unsigned long long rb2, unsigned long long rb3, int end0, int end1, int end2, int end3,
    float* __restrict__ out0, float* __restrict__ out1, float* __restrict__ out2,
    float* __restrict__ out3, int n_cols, const float* __restrict__ x,
    const int8_t* __restrict__ xq, const float* __restrict__ xd, const int* __restrict__ xs,
    const float* __restrict__ conv_taps, int d_conv, int n_tok,
    const unsigned long long* __restrict__ conv_tab) {
  const int ga = 2 * (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
  if (ga >= end3) return;
  auto mat_of = [&](int g) { return g < end0 ? 0 : g < end1 ? 1 : g < end2 ? 2 : 3; };
  const bool pair = ga + 1 < end3 && mat_of(ga + 1) == mat_of(ga);
  const int n_calls = pair ? 1 : ga + 1 < end3 ? 2 : 1;
#pragma unroll 1
  for (int c = 0; c < n_calls; c++) {
    const int g = ga + c;
    const int p = mat_of(g);
    const int start = p == 0 ? 0 : p == 1 ? end0 : p == 2 ? end1 : end2;
    const int r = g - start;
    const uint8_t* w = p == 0 ? w0 : p == 1 ? w1 : p == 2 ? w2 : w3;
    const unsigned long long rb = p == 0 ? rb0 : p == 1 ? rb1 : p == 2 ? rb2 : rb3;
    float* out = p == 0 ? out0 : p == 1 ? out1 : p == 2 ? out2 : out3;
    const int n_rows_p = (p == 0 ? end0 : p == 1 ? end1 : p == 2 ? end2 : end3) - start;
    const float* taps = p == 0 && conv_tab ? conv_taps : nullptr;
    multi_rows_run<F, FLOAT>(w + (unsigned long long)r * rb, rb, pair ? 2 : 1, r, out, n_rows_p, n_cols, x, xq,
                             xd, xs, taps, d_conv, n_tok, conv_tab);
  }
}

// Six blocks an SM (at most 80 registers; Q5_K, which would spill there, five).
#define SC_MULTI_ROWS(NAME, F, FLOAT, BLOCKS)                                                         \
  extern "C" __global__ void __launch_bounds__(128, BLOCKS) NAME(SC_MULTI_ARGS) {                   \
    /* Both rows into L2 while the kernel before runs. */                                           \
    const int ga = 2 * (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));                       \
    for (int g = ga; g < ga + 2 && g < end3; g++) {                                                 \
      const int p = g < end0 ? 0 : g < end1 ? 1 : g < end2 ? 2 : 3;                                 \
      const int r = g - (p == 0 ? 0 : p == 1 ? end0 : p == 2 ? end1 : end2);                        \
      const uint8_t* w = p == 0 ? w0 : p == 1 ? w1 : p == 2 ? w2 : w3;                              \
      const unsigned long long rb = p == 0 ? rb0 : p == 1 ? rb1 : p == 2 ? rb2 : rb3;               \
      sc_prefetch_l2(w + (unsigned long long)r * rb, rb);                                           \
    }                                                                                               \
    sc_pdl_enter();                                                                                 \
    (void)tys;                                                                                      \
    (void)conv_state;                                                                               \
    matvec_multi_rows_body<F, FLOAT>(w0, w1, w2, w3, rb0, rb1, rb2, rb3, end0, end1, end2, end3, out0, out1, \
                                     out2, out3, n_cols, x, xq, xd, xs, conv_taps, d_conv, n_tok, conv_tab); \
  }
SC_MULTI_ROWS(matvec_multi_rows_f32, FmtF32, true, 6)
SC_MULTI_ROWS(matvec_multi_rows_f16, FmtF16, true, 6)
SC_MULTI_ROWS(matvec_multi_rows_bf16, FmtBf16, true, 6)
SC_MULTI_ROWS(matvec_multi_rows_q8_0, FmtQ8_0, false, 6)
SC_MULTI_ROWS(matvec_multi_rows_q4_0, FmtQ4_0, false, 6)
SC_MULTI_ROWS(matvec_multi_rows_q4_k, FmtQ4K, false, 6)
SC_MULTI_ROWS(matvec_multi_rows_q5_k, FmtQ5K, false, 5)
SC_MULTI_ROWS(matvec_multi_rows_q6_k, FmtQ6K, false, 6)
SC_MULTI_ROWS(matvec_multi_rows_iq4_xs, FmtIq4Xs, false, 6)
#define SC_LB_MULTI_ROWS(CODE, NAME, LOAD, CONTRIB) SC_MULTI_ROWS(matvec_multi_rows_##NAME, FmtLb_##NAME, false, 6)
SC_LOWBIT_TYPES(SC_LB_MULTI_ROWS)
#undef SC_LB_MULTI_ROWS
