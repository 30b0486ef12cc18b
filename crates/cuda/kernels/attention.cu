// Attention: per-head q/k RMSNorm + NeoX rotary + the K/V cache write (attn_prep,
// bit-identical to the CPU's norm and rope), and causal softmax attention over the
// cache (attn_core: flash-style, online softmax over key tiles in shared memory; not
// bit-identical to the CPU, whose softmax sees all scores at once, but deterministic).
// Positions come from the device (pos0_dev), so a captured graph replays at a moving
// position.

#include "sc_common.cuh"
#include "scoria_math.cuh"

// Maximum over a full warp (exact in any order); every lane gets it.
__device__ __forceinline__ float sc_warp_max(float v) {
#pragma unroll
  for (int w = 16; w >= 1; w >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, w));
  return v;
}

#define SC_FULL 0xffffffffu
#define SC_MAX_HD 256

// ---------------------------------------------------------------------- attn_prep
// One warp per (token, head slot): slots 0..n_head are query heads (normed with
// q_norm, rotated, written to q_out[t][h]); slots n_head.. are K/V heads (k normed
// with k_norm and rotated into k_cache[pos][h], v copied to v_cache[pos][h]), with
// pos = *pos0_dev + t. rope is f32 [n_ctx][n_rot/2][2] = (cos, sin). A null q_norm /
// k_norm skips that norm. With `kv_tab` each token t is one of its own sequence (a
// batched decode step): its position is pos0_dev[t] and its caches are at kv_tab[2t]
// (K) and kv_tab[2t + 1] (V). With `mpos` (i32 [n_tok][3], multimodal (t, h, w)
// positions) the rotation of pair p takes the h position when p % 3 == 1 and
// p < 3·sec_h, the w position when p % 3 == 2 and p < 3·sec_w, else t; the cache row is
// still pos.
#define SC_PREP_WARPS 4
template <bool ROWS>
__device__ __forceinline__ void attn_prep_body(const float* __restrict__ q_raw, const float* __restrict__ k_raw, const float* __restrict__ v_raw,
              int n_tok, const int* __restrict__ pos0_dev, int n_head, int n_head_kv, int hd, int q_stride,
              const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
              const float* __restrict__ rope, int n_rot, float* __restrict__ k_cache,
              float* __restrict__ v_cache, float* __restrict__ q_out,
              const unsigned long long* __restrict__ kv_tab, const int* __restrict__ mpos,
              int sec_h, int sec_w) { 
  __shared__ float sbuf[SC_PREP_WARPS][SC_MAX_HD];
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
  const long long item = (long long)blockIdx.x * SC_PREP_WARPS + wi;
  const int slots = n_head + n_head_kv;
  if (item >= (long long)n_tok * slots) return;
  const int t = (int)(item / slots), slot = (int)(item % slots);
  const bool is_q = slot < n_head;
  const int h = is_q ? slot : slot - n_head;
  int pos = pos0_dev[0] + t;
  if (ROWS) {
    pos = pos0_dev[t];
    k_cache = (float*)kv_tab[2 * t];
    v_cache = (float*)kv_tab[2 * t + 1];
  }
  const float* src = is_q ? q_raw + (size_t)t * n_head * q_stride + (size_t)h * q_stride
                          : k_raw + ((size_t)t * n_head_kv + h) * hd;
  float* dst = is_q ? q_out + ((size_t)t * n_head + h) * hd : k_cache + ((size_t)pos * n_head_kv + h) * hd;
  const float* nw = is_q ? q_norm : k_norm;
  float* buf = sbuf[wi];
  if (nw) {
    float acc = 0.0f;
    for (int i = lane; i < hd; i += 32) {
      const float v = src[i];
      acc = sc_add(acc, sc_mul(v, v));
    }
    const float ss = __shfl_sync(SC_FULL, sc_warp_sum(acc), 0);
    const float scale = sc_rms_scale(ss, (float)hd, eps);
    for (int i = lane; i < hd; i += 32) buf[i] = sc_mul(sc_mul(src[i], scale), nw[i]);
  } else {
    for (int i = lane; i < hd; i += 32) buf[i] = src[i];
  }
  __syncwarp();
  const int half = n_rot / 2;
  for (int i = lane; i < hd; i += 32) {
    float y;
    if (i < n_rot) {
      // Rotary pair p = (p, p + half), at the token's position, or with `mpos` at the
      // (t, h, w) position its section takes (model::math::mrope_table).
      const int p = i < half ? i : i - half;
      int at = pos;
      if (mpos) {
        const int axis = (p % 3 == 1 && p < 3 * sec_h) ? 1 : (p % 3 == 2 && p < 3 * sec_w) ? 2 : 0;
        at = mpos[3 * t + axis];
      }
      const float c = rope[((size_t)at * half + p) * 2], s = rope[((size_t)at * half + p) * 2 + 1];
      const float x0 = buf[p], x1 = buf[p + half];
      y = i < half ? sc_sub(sc_mul(x0, c), sc_mul(x1, s)) : sc_add(sc_mul(x0, s), sc_mul(x1, c));
    } else {
      y = buf[i];
    }
    dst[i] = y;
  }
  if (!is_q) {
    const float* vs = v_raw + ((size_t)t * n_head_kv + h) * hd;
    float* vd = v_cache + ((size_t)pos * n_head_kv + h) * hd;
    for (int i = lane; i < hd; i += 32) vd[i] = vs[i];
  }
}
// The one-token launch, and the rows launch (see above).
extern "C" __global__ void __launch_bounds__(32 * SC_PREP_WARPS) attn_prep(const float* __restrict__ q_raw, const float* __restrict__ k_raw, const float* __restrict__ v_raw,
              int n_tok, const int* __restrict__ pos0_dev, int n_head, int n_head_kv, int hd, int q_stride,
              const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
              const float* __restrict__ rope, int n_rot, float* __restrict__ k_cache,
              float* __restrict__ v_cache, float* __restrict__ q_out,
              const unsigned long long* __restrict__ kv_tab, const int* __restrict__ mpos,
              int sec_h, int sec_w) {
  sc_pdl_enter();
  attn_prep_body<false>(q_raw, k_raw, v_raw, n_tok, pos0_dev, n_head, n_head_kv, hd, q_stride, q_norm, k_norm, eps, rope, n_rot, k_cache, v_cache, q_out, kv_tab, mpos, sec_h, sec_w);
}
extern "C" __global__ void __launch_bounds__(32 * SC_PREP_WARPS) attn_prep_rows(const float* __restrict__ q_raw, const float* __restrict__ k_raw, const float* __restrict__ v_raw,
              int n_tok, const int* __restrict__ pos0_dev, int n_head, int n_head_kv, int hd, int q_stride,
              const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
              const float* __restrict__ rope, int n_rot, float* __restrict__ k_cache,
              float* __restrict__ v_cache, float* __restrict__ q_out,
              const unsigned long long* __restrict__ kv_tab, const int* __restrict__ mpos,
              int sec_h, int sec_w) {
  sc_pdl_enter();
  attn_prep_body<true>(q_raw, k_raw, v_raw, n_tok, pos0_dev, n_head, n_head_kv, hd, q_stride, q_norm, k_norm, eps, rope, n_rot, k_cache, v_cache, q_out, kv_tab, mpos, sec_h, sec_w);
}

// ---------------------------------------------------------------------- attn_core
// A block takes one KV head and 16 query rows of its group (row r = t·group + g is
// query head kvh·group + g of token t), 4 per warp, and walks key tiles of 32 keys:
// K and V tiles in shared memory shared by the 16 rows, lane = key for the scores,
// lane = head dims (lane + 32j) for the outputs. Online softmax per row: m (running
// max), l (running sum), o (running Σ p·v).
//
// The canonical order, whatever the launch: a row's keys 0..=pos go in chunks of
// SC_ACHUNK keys at absolute positions (chunk c = keys c·SC_ACHUNK ..), each chunk's
// (m, l, o) by the online softmax over its tiles of 32 from a fresh start, and the
// chunks folded in order by sc_attn_fold (a chunk the row sees nothing of is skipped).
// So a row's bits depend only on its position and the cache, never on how many rows
// or splits ran with it (prefill ≡ decode ≡ verify ≡ a prompt continued after decode).
//
// Split mode (n_split > 1, for few query rows): blockIdx.z is the chunk, whose
// (m, l, o) the block writes to `scratch` (m = -inf for a row that sees none of it;
// nothing at all for a chunk past every row's last key: the grid spans the cache's
// capacity, the rows' positions are on the device); attn_combine folds each row's
// chunks up to its last key. Otherwise (one launch over every key) the block folds its
// chunks itself as it walks them and writes the output.
//
// Rows mode (kv_tab given: a batched decode step): each of the n_tok tokens is one
// token of a sequence of its own, blockIdx.y = token b, with position pos0_dev[b] and
// caches kv_tab[2b] (K), kv_tab[2b + 1] (V); its block does what the one-token launch
// does (n_head / n_head_kv <= SC_AQ), writing token b's rows of out and scratch.
// attn_combine over n_tok tokens then merges every token's splits alike.
// A block has NW warps of 4 query rows each: SC_AWARPS (16 rows) in general; the
// wide launches (attn_core_wide_*, SC_AWARPS_WIDE: 64 rows) serve prompts that take
// one key range, where four times the rows share each K/V tile's load and more warps
// hide its latency. Each row's operations (its keys in tiles of 32 from 0) are the same in
// both, so are its bits.
#define SC_AQ 16      // query rows per block
#define SC_AK 32      // keys per tile
#define SC_AWARPS 4   // 4 rows per warp
#define SC_AWARPS_WIDE 16
#define SC_ACHUNK 128  // keys per canonical chunk (a multiple of SC_AK; Gpu's KEY_CHUNK)

// Folds a chunk's (m, l, o) into a row's running (M, L, O): the canonical merge of the
// chunks, in chunk order, shared by the one-launch kernels and attn_combine. A chunk
// with nothing visible (m = -inf) is skipped; the first visible one is copied.
template <int N>
__device__ __forceinline__ void sc_attn_fold(float& M, float& L, float (&O)[N], float m, float l,
                                             const float (&o)[N]) {
  if (m == -INFINITY) return;
  if (M == -INFINITY) {
    M = m;
    L = l;
#pragma unroll
    for (int j = 0; j < N; j++) O[j] = o[j];
    return;
  }
  const float mn = fmaxf(M, m);
  const float a = sc_exp(__fsub_rn(M, mn)), b = sc_exp(__fsub_rn(m, mn));
  L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(l, b));
#pragma unroll
  for (int j = 0; j < N; j++) O[j] = __fadd_rn(__fmul_rn(O[j], a), __fmul_rn(o[j], b));
  M = mn;
}

// The gated output of one row: o / l, times sigmoid(gate) when gated.
__device__ __forceinline__ float sc_attn_out(float o, float l, const float* gate, size_t gi) {
  float y = sc_div(o, l);
  if (gate) y = sc_mul(y, sc_sigmoid(gate[gi]));
  return y;
}

template <int HD, bool ROWS, int NW>
__device__ __forceinline__ void attn_core_body(const float* __restrict__ q, int n_tok,
                                               const int* __restrict__ pos0_dev, int n_head, int n_head_kv,
                                               const float* __restrict__ k_cache,
                                               const float* __restrict__ v_cache, float scale,
                                               const float* __restrict__ gate, int q_stride,
                                               float* __restrict__ out, float* __restrict__ scratch,
                                               int n_split, const unsigned long long* __restrict__ kv_tab) {
  constexpr int ND = HD / 32;  // output dims per lane
  constexpr int AQ = 4 * NW;   // query rows per block
  // float4s of K (and of V) each thread loads per tile, and how many at once.
  constexpr int TILE_PER = (SC_AK * (HD / 4) + 32 * NW - 1) / (32 * NW);
  constexpr int TILE_BATCH = TILE_PER < 32 / NW ? TILE_PER : 32 / NW;
  extern __shared__ float4 smem4[];
  float* smem = (float*)smem4;
  float* sQ = smem;                        // [AQ][HD]
  float* sK = sQ + AQ * HD;             // [SC_AK][HD + 1]
  float* sV = sK + SC_AK * (HD + 1);       // [SC_AK][HD]  (16-byte aligned: HD % 4 == 0)
  const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
  const int kvh = blockIdx.x;
  const int group = n_head / n_head_kv;
  // Rows mode: token b alone (t0 = b is where its rows go); otherwise tokens from 0.
  const int t0 = ROWS ? blockIdx.y : 0;
  const int n_loc = ROWS ? 1 : n_tok;
  const int n_rows = n_loc * group;
  const int row0 = ROWS ? 0 : blockIdx.y * AQ;
  const int pos0 = pos0_dev[t0];
  if (ROWS) {
    k_cache = (const float*)kv_tab[2 * t0];
    v_cache = (const float*)kv_tab[2 * t0 + 1];
  }
  const int split = blockIdx.z;

  // This warp's 4 rows: their last visible key (-1 for rows past the end).
  int limit[4];
  int last_row = min(row0 + AQ, n_rows) - 1;
#pragma unroll
  for (int qi = 0; qi < 4; qi++) {
    const int r = row0 + wi * 4 + qi;
    limit[qi] = r < n_rows ? pos0 + r / group : -1;
  }
  const int block_limit = pos0 + last_row / group;  // the block's last visible key
  // The chunks this block takes: its split's, or every one it sees.
  const int c_first = n_split > 1 ? split : 0;
  const int c_last = n_split > 1 ? split : block_limit / SC_ACHUNK;
  // A chunk past every row's last key: nothing to write (attn_combine stops at each
  // row's last chunk), so a cache's capacity costs a decode step almost nothing.
  if (c_first * SC_ACHUNK > block_limit) return;

  // Query tile (zeros for rows past the end).
  for (int idx = threadIdx.x; idx < AQ * (HD / 4); idx += blockDim.x) {
    const int rl = idx / (HD / 4), c = idx % (HD / 4);
    const int r = row0 + rl;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < n_rows) {
      const int t = t0 + r / group, h = kvh * group + r % group;
      v = *(const float4*)(q + ((size_t)t * n_head + h) * HD + 4 * c);
    }
    *(float4*)(sQ + rl * HD + 4 * c) = v;
  }


  // The fold of the chunks so far (one-launch mode) and the current chunk's state.
  float M[4], L[4], O[4][ND];
  float m[4], l[4], o[4][ND];
#pragma unroll
  for (int qi = 0; qi < 4; qi++) {
    M[qi] = -INFINITY;
    L[qi] = 0.0f;
#pragma unroll
    for (int j = 0; j < ND; j++) O[qi][j] = 0.0f;
  }

  for (int c = c_first; c <= c_last; c++) {
    const int k_begin = c * SC_ACHUNK;
    const int k_end = min(k_begin + SC_ACHUNK, block_limit + 1);
#pragma unroll
    for (int qi = 0; qi < 4; qi++) {
      m[qi] = -INFINITY;
      l[qi] = 0.0f;
#pragma unroll
      for (int j = 0; j < ND; j++) o[qi][j] = 0.0f;
    }

    for (int kb = k_begin; kb < k_end; kb += SC_AK) {
      __syncthreads();  // the previous tile is consumed (and, first time, sQ is written)
      // The tile's float4s in batches whose loads are all issued before the first
      // store, so a thread waits for memory once a batch, not once a float4.
#pragma unroll
      for (int b0 = 0; b0 < TILE_PER; b0 += TILE_BATCH) {
        float4 kv[TILE_BATCH], vv[TILE_BATCH];
#pragma unroll
        for (int u = 0; u < TILE_BATCH; u++) {
          const int idx = threadIdx.x + (b0 + u) * 32 * NW;
          const int key = kb + idx / (HD / 4);
          kv[u] = make_float4(0.f, 0.f, 0.f, 0.f);
          vv[u] = kv[u];
          if (idx < SC_AK * (HD / 4) && key < k_end) {
            const size_t off = ((size_t)key * n_head_kv + kvh) * HD + 4 * (idx % (HD / 4));
            kv[u] = *(const float4*)(k_cache + off);
            vv[u] = *(const float4*)(v_cache + off);
          }
        }
#pragma unroll
        for (int u = 0; u < TILE_BATCH; u++) {
          const int idx = threadIdx.x + (b0 + u) * 32 * NW;
          if (idx < SC_AK * (HD / 4)) {
            const int j = idx / (HD / 4), c = idx % (HD / 4);
            float* kd = sK + j * (HD + 1) + 4 * c;
            kd[0] = kv[u].x;
            kd[1] = kv[u].y;
            kd[2] = kv[u].z;
            kd[3] = kv[u].w;
            *(float4*)(sV + j * HD + 4 * c) = vv[u];
          }
        }
      }
      __syncthreads();

      // Scores: lane = key.
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      const float* kr = sK + lane * (HD + 1);
      const float* qw = sQ + (wi * 4) * HD;
#pragma unroll 4
      for (int d = 0; d < HD; d += 4) {
        const float k0 = kr[d], k1 = kr[d + 1], k2 = kr[d + 2], k3 = kr[d + 3];
#pragma unroll
        for (int qi = 0; qi < 4; qi++) {
          const float4 qv = *(const float4*)(qw + qi * HD + d);
          s[qi] = fmaf(qv.x, k0, s[qi]);
          s[qi] = fmaf(qv.y, k1, s[qi]);
          s[qi] = fmaf(qv.z, k2, s[qi]);
          s[qi] = fmaf(qv.w, k3, s[qi]);
        }
      }
      const int key = kb + lane;
      float p[4];
#pragma unroll
      for (int qi = 0; qi < 4; qi++) {
        const float sc = (key <= limit[qi] && key < k_end) ? s[qi] * scale : -INFINITY;
        const float m_new = fmaxf(m[qi], sc_warp_max(sc));
        if (m_new == -INFINITY) {  // nothing visible to this row yet
          p[qi] = 0.0f;
          continue;
        }
        const float alpha = sc_exp(m[qi] - m_new);
        p[qi] = sc_exp(sc - m_new);
        l[qi] = l[qi] * alpha + sc_warp_sum(p[qi]);  // every lane holds the same value
        l[qi] = __shfl_sync(SC_FULL, l[qi], 0);
        m[qi] = m_new;
#pragma unroll
        for (int j = 0; j < ND; j++) o[qi][j] *= alpha;
      }
      // o += Σ_key p · v: lane = output dims.
#pragma unroll 4
      for (int j = 0; j < SC_AK; j++) {
        const float* vr = sV + j * HD + lane;
        float pj[4];
#pragma unroll
        for (int qi = 0; qi < 4; qi++) pj[qi] = __shfl_sync(SC_FULL, p[qi], j);
#pragma unroll
        for (int jd = 0; jd < ND; jd++) {
          const float v = vr[32 * jd];
#pragma unroll
          for (int qi = 0; qi < 4; qi++) o[qi][jd] = fmaf(pj[qi], v, o[qi][jd]);
        }
      }
    }
    if (n_split == 1) {
#pragma unroll
      for (int qi = 0; qi < 4; qi++) sc_attn_fold(M[qi], L[qi], O[qi], m[qi], l[qi], o[qi]);
    }
  }

  // Results of this warp's rows.
#pragma unroll
  for (int qi = 0; qi < 4; qi++) {
    const int r = row0 + wi * 4 + qi;
    if (r >= n_rows) continue;
    const int t = t0 + r / group, h = kvh * group + r % group;
    const size_t th = (size_t)t * n_head + h;
    if (n_split > 1) {
      const size_t rows_total = (size_t)n_tok * n_head;
      float* pm = scratch;                                   // [n_split][rows]
      float* pl = scratch + (size_t)n_split * rows_total;    // [n_split][rows]
      float* po = scratch + 2 * (size_t)n_split * rows_total;  // [n_split][rows][HD]
      const size_t si = (size_t)split * rows_total + th;
      if (lane == 0) {
        pm[si] = m[qi];
        pl[si] = l[qi];
      }
#pragma unroll
      for (int jd = 0; jd < ND; jd++) po[si * HD + lane + 32 * jd] = o[qi][jd];
    } else {
#pragma unroll
      for (int jd = 0; jd < ND; jd++) {
        const int d = lane + 32 * jd;
        out[th * HD + d] = sc_attn_out(O[qi][jd], L[qi], gate, (size_t)t * n_head * q_stride + (size_t)h * q_stride + HD + d);
      }
    }
  }
}

#define SC_ATTN_CORE(HD, NAME, ROWS, NW)                                                           \
  extern "C" __global__ void __launch_bounds__(32 * NW) NAME(                                      \
      const float* __restrict__ q, int n_tok, const int* __restrict__ pos0_dev, int n_head,        \
      int n_head_kv, const float* __restrict__ k_cache, const float* __restrict__ v_cache,         \
      float scale, const float* __restrict__ gate, int q_stride, float* __restrict__ out,          \
      float* __restrict__ scratch, int n_split, const unsigned long long* __restrict__ kv_tab) {     \
    sc_pdl_enter();                                                                                \
    attn_core_body<HD, ROWS, NW>(q, n_tok, pos0_dev, n_head, n_head_kv, k_cache, v_cache, scale,    \
                                 gate, q_stride, out, scratch, n_split, kv_tab);                   \
  }

SC_ATTN_CORE(32, attn_core_hd32, false, SC_AWARPS)
SC_ATTN_CORE(64, attn_core_hd64, false, SC_AWARPS)
SC_ATTN_CORE(128, attn_core_hd128, false, SC_AWARPS)
SC_ATTN_CORE(256, attn_core_hd256, false, SC_AWARPS)
SC_ATTN_CORE(32, attn_core_wide_hd32, false, SC_AWARPS_WIDE)
SC_ATTN_CORE(64, attn_core_wide_hd64, false, SC_AWARPS_WIDE)
SC_ATTN_CORE(128, attn_core_wide_hd128, false, SC_AWARPS_WIDE)
SC_ATTN_CORE(256, attn_core_wide_hd256, false, SC_AWARPS_WIDE)
SC_ATTN_CORE(32, attn_core_rows_hd32, true, SC_AWARPS)
SC_ATTN_CORE(64, attn_core_rows_hd64, true, SC_AWARPS)
SC_ATTN_CORE(128, attn_core_rows_hd128, true, SC_AWARPS)
SC_ATTN_CORE(256, attn_core_rows_hd256, true, SC_AWARPS)

// Folds the chunk results of every (token, head) in chunk order (sc_attn_fold, as
// the one-launch kernels fold them), up to the chunk of the token's last key (its
// position: pos0_dev[0] + t, or pos0_dev[t] in rows mode; attn_core writes nothing
// for a chunk past every row of its block). One warp per (token, head) and 32 head
// dims (blockIdx.y), one lane per dim: the fold is a chain of dependent steps, so
// many short chains on many SMs. The partial results are loaded SC_COMBINE_AHEAD
// chunks at a time, all issued before the first fold.
#define SC_COMBINE_AHEAD 32
extern "C" __global__ void __launch_bounds__(32)
    attn_combine(const float* __restrict__ scratch, int n_split, int n_tok, int n_head, int hd,
                 const float* __restrict__ gate, int q_stride, float* __restrict__ out, int8_t* __restrict__ qs,
                 float* __restrict__ qd, int* __restrict__ qsum, const int* __restrict__ pos0_dev,
                 int rows_mode) {
  sc_pdl_enter();
  const size_t th = blockIdx.x;
  const int d = blockIdx.y * 32 + threadIdx.x;
  const size_t rows_total = (size_t)n_tok * n_head;
  const float* pm = scratch;
  const float* pl = scratch + (size_t)n_split * rows_total;
  const float* po = scratch + 2 * (size_t)n_split * rows_total;
  const int tok = (int)(th / n_head);
  const int pos = rows_mode ? pos0_dev[tok] : pos0_dev[0] + tok;
  const int n_used = min(n_split, pos / SC_ACHUNK + 1);
  float mx = -INFINITY, lsum = 0.0f, osum[1] = {0.0f};
  for (int s0 = 0; s0 < n_used; s0 += SC_COMBINE_AHEAD) {
    float cm[SC_COMBINE_AHEAD], cl[SC_COMBINE_AHEAD], co[SC_COMBINE_AHEAD];
#pragma unroll
    for (int u = 0; u < SC_COMBINE_AHEAD; u++) {
      // Past the last chunk: a chunk that is there (the last), read and skipped.
      const size_t si = (size_t)min(s0 + u, n_used - 1) * rows_total + th;
      cm[u] = pm[si];
      cl[u] = pl[si];
      co[u] = po[si * hd + d];
    }
#pragma unroll
    for (int u = 0; u < SC_COMBINE_AHEAD; u++) {
      const float os[1] = {co[u]};
      sc_attn_fold(mx, lsum, osum, s0 + u < n_used ? cm[u] : -INFINITY, cl[u], os);
    }
  }
  const size_t t = th / n_head, h = th % n_head;
  const float y = sc_attn_out(osum[0], lsum, gate, t * n_head * q_stride + h * q_stride + hd + d);
  out[th * hd + d] = y;
  // The warp holds 32 consecutive dims of the row (hd is a multiple of 32).
  if (qs) {
    const size_t at = th * hd + (d & ~31);
    sc_quant_block(y, d & 31, qs + at, qd + at / 32, qsum + at / 32);
  }
}
