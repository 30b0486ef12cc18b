// Gated DeltaNet, bit-identical to the CPU (engine/src/cpu/deltanet.rs over
// model::deltanet::{conv_step, step, gated_norm}): the causal depthwise conv with SiLU,
// the L2 norm of q and k, the per-head recurrence token by token, and the gated
// RMSNorm. Prompts and decode steps run the same operations in the same order, so
// their states agree bit for bit.

#include "sc_common.cuh"
#include "scoria_math.cuh"

#define SC_FULL 0xffffffffu
#define SC_MAX_DCONV 8

// ------------------------------------------------------------------------ dn_conv
// One thread per channel c and run of `tpb` tokens (blockIdx.y), in token order
// (model::deltanet::conv_step): acc = Σ_j hist[j]·taps[j] (in j order, products
// rounded then added), then acc += x·taps[d_conv-1]; out = silu(acc); the history
// shifts left and takes x. The history of a run is the previous tokens' inputs, or the
// state for the first run: so every token gets the sequential loop's bits.
// state is [conv_dim][d_conv-1] (oldest first), taps [conv_dim][d_conv]. The first
// run also writes the new state (the last d_conv-1 inputs), after reading the old one.
// `out` may be `qkv` only with one run (gridDim.y == 1): runs read their
// predecessors' inputs. (A batched decode step's rows take the conv inside
// matvec_multi_rows, each on its own state.) `trail` (may be null): the history after
// each token but the last, entry t at t·conv_dim·(d_conv-1) in the state's layout (a
// verify step's, for a rollback to any of its tokens).
extern "C" __global__ void __launch_bounds__(128) dn_conv(const float* qkv, float* __restrict__ state,
                                                          const float* __restrict__ taps, int n_tok,
                                                          int conv_dim, int d_conv, int tpb, float* out,
                                                          float* __restrict__ trail) {
  sc_pdl_enter();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= conv_dim) return;
  const int run = blockIdx.y, runs = gridDim.y;
  const int hist = d_conv - 1;
  const int t0 = run * tpb, t1 = min(n_tok, t0 + tpb);
  float st[SC_MAX_DCONV], w[SC_MAX_DCONV];
#pragma unroll
  for (int j = 0; j < SC_MAX_DCONV; j++) {
    // Entry j of the history before token t0 is input t0 - hist + j.
    const int src = t0 - hist + j;
    st[j] = j >= hist ? 0.0f : src >= 0 ? qkv[(size_t)src * conv_dim + c] : state[(size_t)c * hist + j];
    w[j] = j < d_conv ? taps[(size_t)c * d_conv + j] : 0.0f;
  }
  float tail[SC_MAX_DCONV];  // the first run: the new state when n_tok >= hist
  if (run == 0) {
#pragma unroll
    for (int j = 0; j < SC_MAX_DCONV; j++) {
      const int src = n_tok - hist + j;
      tail[j] = j < hist && src >= 0 ? qkv[(size_t)src * conv_dim + c] : 0.0f;
    }
  }
  for (int t = t0; t < t1; t++) {
    const float x = qkv[(size_t)t * conv_dim + c];
    float acc = 0.0f;
    float wl = 0.0f;
#pragma unroll
    for (int j = 0; j < SC_MAX_DCONV; j++) {
      if (j < hist) acc = sc_add(acc, sc_mul(st[j], w[j]));
      if (j == hist) wl = w[j];
    }
    acc = sc_add(acc, sc_mul(x, wl));
    out[(size_t)t * conv_dim + c] = sc_silu(acc);
#pragma unroll
    for (int j = 0; j + 1 < SC_MAX_DCONV; j++)
      if (j + 1 < hist) st[j] = st[j + 1];
#pragma unroll
    for (int j = 0; j < SC_MAX_DCONV; j++)
      if (j == hist - 1) st[j] = x;
    if (trail != nullptr && t + 1 < n_tok) {
      float* tr = trail + (size_t)t * conv_dim * hist + (size_t)c * hist;
#pragma unroll
      for (int j = 0; j < SC_MAX_DCONV; j++)
        if (j < hist) tr[j] = st[j];
    }
  }
  if (run == 0) {
    // With one run `st` is the new state; with several, n_tok >= tpb >= hist and
    // `tail` is.
#pragma unroll
    for (int j = 0; j < SC_MAX_DCONV; j++)
      if (j < hist) state[(size_t)c * hist + j] = runs == 1 ? st[j] : tail[j];
  }
}

// --------------------------------------------------------------------- dn_qk_norm
// One warp per (token, head) of the 2·n_k_heads q and k heads at the front of each
// conv row ([q | k | v]): x · 1/sqrt(Σx² + 1e-6) (model::math::l2_norm, canonical
// order), then q heads · scale (a second rounding, as the CPU does).
extern "C" __global__ void __launch_bounds__(128) dn_qk_norm(float* conv_out, int n_tok, int conv_dim,
                                                             int n_k_heads, int d_state, float scale) { sc_pdl_enter();
  const int lane = threadIdx.x & 31;
  const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (item >= (long long)n_tok * 2 * n_k_heads) return;
  const int t = (int)(item / (2 * n_k_heads)), hh = (int)(item % (2 * n_k_heads));
  float* x = conv_out + (size_t)t * conv_dim + (size_t)hh * d_state;
  float acc = 0.0f;
  for (int i = lane; i < d_state; i += 32) acc = sc_add(acc, sc_mul(x[i], x[i]));
  const float ss = __shfl_sync(SC_FULL, sc_warp_sum(acc), 0);
  const float s = sc_l2_scale(ss, 1e-6f);
  const bool is_q = hh < n_k_heads;
  for (int i = lane; i < d_state; i += 32) {
    float v = sc_mul(x[i], s);
    if (is_q) v = sc_mul(v, scale);
    x[i] = v;
  }
}

// ------------------------------------------------------------------ dn_recurrence
// One warp per (value head h, 32 state columns); lane = column j, which keeps
// S[:, j] (DK values) in registers across the tokens (model::deltanet::step):
//   g = a[h]·softplus(alpha + dt_bias[h]); β = sigmoid(beta); S ← e^g·S;
//   kv_j = Σ_i S[i][j]·k_i; δ_j = β·(v_j − kv_j); S[i][j] += k_i·δ_j; o_j = Σ_i S[i][j]·q_i
// (sums in i order from 0.0, products rounded, then added). Writes o (before the
// gated norm) to out[t][h·DK + j]. β/α of head h are beta_src[t·beta_stride +
// beta_idx[h]] and alpha_src[t·alpha_stride + alpha_idx[h]]; its q/k are key head
// k_head_of[h].
// One token of the recurrence for state column j (dn_step; S = S[:, j] in registers; q and k
// of the key head in shared memory, k declared volatile-readable), model::deltanet::step:
// S ← e^g·S; kv = Σ_i S[i]·k_i; δ = β·(v − kv); S[i] += k_i·δ; o = Σ_i S[i]·q_i, sums in
// i order from 0.0, products rounded, then added. Returns o. The CPU's loops (decay
// all; kv over i; update all; o over i) are fused pairwise: every element sees the same
// operations and both sums keep their i order.
template <int DK>
__device__ __forceinline__ float sc_dn_update(float* S, const float* sq, float* sk, float v, float decay,
                                              float beta) {
  float kv = 0.0f;
#pragma unroll
  for (int i = 0; i < DK; i++) {
    S[i] = sc_mul(S[i], decay);
    kv = sc_add(kv, sc_mul(S[i], sk[i]));
  }
  const float delta = sc_mul(beta, sc_sub(v, kv));
  float o = 0.0f;
  // Re-read k from shared memory (volatile) rather than keep DK values of it live
  // across both loops: with S in registers that would exceed the register file.
  const volatile float* skv = sk;
#pragma unroll
  for (int i = 0; i < DK; i++) {
    S[i] = sc_add(S[i], sc_mul(skv[i], delta));
    o = sc_add(o, sc_mul(S[i], sq[i]));
  }
  return o;
}

// Asynchronous 4-byte copy global → shared (cp.async), so that the loads of the
// next run of tokens are in flight while the warp computes this one.
__device__ __forceinline__ void sc_cp_async4(float* dst, const float* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void sc_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void sc_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Tokens a prompt recurrence stages in shared memory at a time (two buffers: the
// next run's q, k, v, α and β load while the warp computes this run's).
#define SC_DN_RUN 16

// A prompt's recurrence for one warp's 32 state columns of value head h. Each token
// is model::deltanet::step (as sc_dn_update), but the work is laid out for latency:
//  - a run of SC_DN_RUN tokens' inputs is copied into shared memory (cp.async) while
//    the run before computes, and lane u computes the run's token u decay e^g and β;
//  - token t's update and output sum are fused with token t+1's decay and kv sum,
//    S[i] += k_i·δ; o += S[i]·q_i; S[i] *= e^g'; kv' += S[i]·k'_i, so two independent
//    sums advance together. Every S[i] sees update(t) then decay(t+1), and both sums
//    keep their i order: the bits of the loops one after another (and of dn_step).
// With a `trail` (non-null), the state after each token but the last also goes there
// (entry t at t·n_v_heads·DK·DK, in the state's layout): S after token t's update,
// before token t+1's decay — the state a sequence fed up to token t holds.
template <int DK>
__device__ __forceinline__ void dn_recurrence_body(
    const float* __restrict__ conv_out, int n_tok, int conv_dim, const float* __restrict__ beta_src,
    int beta_stride, const int* __restrict__ beta_idx, const float* __restrict__ alpha_src, int alpha_stride,
    const int* __restrict__ alpha_idx, const float* __restrict__ a, const float* __restrict__ dt_bias,
    const int* __restrict__ k_head_of, float* __restrict__ state, int n_k_heads, int n_v_heads,
    float* __restrict__ out, float* __restrict__ trail) {
  constexpr int R = SC_DN_RUN;
  __shared__ __align__(16) float sq[2][R][DK];
  __shared__ __align__(16) float sk[2][R][DK];
  __shared__ float sv[2][R][32];
  __shared__ float sab[2][2][R];  // raw α, β of the run
  __shared__ float sgb[2][2][R];  // e^g, β of the run
  const int lane = threadIdx.x;
  const int h = blockIdx.x;
  const int j = blockIdx.y * 32 + lane;
  const int kd = n_k_heads * DK;
  const int kh = k_head_of[h];
  const int bi = beta_idx[h], ai = alpha_idx[h];
  const float ah = a[h], dtb = dt_bias[h];
  float* sh = state + (size_t)h * DK * DK;
  float S[DK];
#pragma unroll
  for (int i = 0; i < DK; i++) S[i] = sh[(size_t)i * DK + j];
  if (n_tok <= 0) return;
  const int n_runs = (n_tok + R - 1) / R;
  // Issues the copies of run `r` into buffer r & 1.
  auto stage = [&](int r) {
    const int b = r & 1, t0 = r * R, n = min(R, n_tok - t0);
    for (int u = 0; u < n; u++) {
      const float* row = conv_out + (size_t)(t0 + u) * conv_dim;
#pragma unroll
      for (int m = 0; m < DK / 32; m++) {
        sc_cp_async4(&sq[b][u][lane + 32 * m], row + kh * DK + lane + 32 * m);
        sc_cp_async4(&sk[b][u][lane + 32 * m], row + kd + kh * DK + lane + 32 * m);
      }
      sc_cp_async4(&sv[b][u][lane], row + 2 * kd + h * DK + j);
    }
    if (lane < n) {
      sc_cp_async4(&sab[b][0][lane], alpha_src + (size_t)(t0 + lane) * alpha_stride + ai);
      sc_cp_async4(&sab[b][1][lane], beta_src + (size_t)(t0 + lane) * beta_stride + bi);
    }
    sc_cp_async_commit();
  };
  // Waits for the run staged last and computes its decays and βs.
  auto arrive = [&](int r) {
    const int b = r & 1;
    sc_cp_async_wait_all();
    __syncwarp();
    if (lane < min(R, n_tok - r * R)) {
      const float g = sc_mul(ah, sc_softplus(sc_add(sab[b][0][lane], dtb)));
      sgb[b][0][lane] = sc_exp(g);
      sgb[b][1][lane] = sc_sigmoid(sab[b][1][lane]);
    }
    __syncwarp();
  };
  stage(0);
  arrive(0);
  if (n_runs > 1) stage(1);
  // Token 0's decay and kv.
  float kv = 0.0f;
  {
    const float d0 = sgb[0][0][0];
#pragma unroll
    for (int i = 0; i < DK; i++) {
      S[i] = sc_mul(S[i], d0);
      kv = sc_add(kv, sc_mul(S[i], sk[0][0][i]));
    }
  }
  for (int t = 0; t < n_tok; t++) {
    const int r = t / R, u = t - r * R, b = r & 1;
    const bool last = t + 1 == n_tok;
    if (!last && u == R - 1) arrive(r + 1);  // token t+1 opens the next run
    const float delta = sc_mul(sgb[b][1][u], sc_sub(sv[b][u][lane], kv));
    const float* qt = sq[b][u];
    const float* kt = sk[b][u];
    float o = 0.0f;
    if (last) {
#pragma unroll
      for (int i = 0; i < DK; i += 4) {
        const float4 k4 = *(const float4*)(kt + i), q4 = *(const float4*)(qt + i);
        const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int c = 0; c < 4; c++) {
          S[i + c] = sc_add(S[i + c], sc_mul(kk[c], delta));
          o = sc_add(o, sc_mul(S[i + c], qq[c]));
        }
      }
    } else {
      const int t1 = t + 1, r1 = t1 / R, u1 = t1 - r1 * R, b1 = r1 & 1;
      const float* kn = sk[b1][u1];
      const float d1 = sgb[b1][0][u1];
      float* tr = trail != nullptr ? trail + (size_t)t * n_v_heads * DK * DK + (size_t)h * DK * DK + j : nullptr;
      float kv1 = 0.0f;
#pragma unroll
      for (int i = 0; i < DK; i += 4) {
        const float4 k4 = *(const float4*)(kt + i), q4 = *(const float4*)(qt + i);
        const float4 n4 = *(const float4*)(kn + i);
        const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w};
        const float nn[4] = {n4.x, n4.y, n4.z, n4.w};
#pragma unroll
        for (int c = 0; c < 4; c++) {
          S[i + c] = sc_add(S[i + c], sc_mul(kk[c], delta));
          if (tr != nullptr) tr[(size_t)(i + c) * DK] = S[i + c];
          o = sc_add(o, sc_mul(S[i + c], qq[c]));
          S[i + c] = sc_mul(S[i + c], d1);
          kv1 = sc_add(kv1, sc_mul(S[i + c], nn[c]));
        }
      }
      kv = kv1;
    }
    out[(size_t)t * n_v_heads * DK + (size_t)h * DK + j] = o;
    // This run's buffer is free once its last token is done: stage the run after next.
    if (u == R - 1 && r + 2 < n_runs) {
      __syncwarp();
      stage(r + 2);
    }
  }
#pragma unroll
  for (int i = 0; i < DK; i++) sh[(size_t)i * DK + j] = S[i];
}

#define SC_DN_REC(DK)                                                                             \
  extern "C" __global__ void __launch_bounds__(32) dn_recurrence_dk##DK(                          \
      const float* __restrict__ conv_out, int n_tok, int conv_dim, const float* __restrict__ beta_src, \
      int beta_stride, const int* __restrict__ beta_idx, const float* __restrict__ alpha_src,     \
      int alpha_stride, const int* __restrict__ alpha_idx, const float* __restrict__ a,           \
      const float* __restrict__ dt_bias, const int* __restrict__ k_head_of,                       \
      float* __restrict__ state, int n_k_heads, int n_v_heads, float* __restrict__ out,           \
      float* __restrict__ trail) { sc_pdl_enter();                                                  \
    dn_recurrence_body<DK>(conv_out, n_tok, conv_dim, beta_src, beta_stride, beta_idx, alpha_src, \
                           alpha_stride, alpha_idx, a, dt_bias, k_head_of, state, n_k_heads,      \
                           n_v_heads, out, trail);                                                \
  }

SC_DN_REC(32)
SC_DN_REC(64)
SC_DN_REC(128)

// ------------------------------------------------------------------ dn_gated_norm
// In place on o [n_tok][n_v_heads·d_state], one warp per (token, head)
// (model::deltanet::gated_norm): rms_norm(o)·w (canonical order), then · silu(z).
extern "C" __global__ void __launch_bounds__(128) dn_gated_norm(float* o, const float* __restrict__ z,
                                                                const float* __restrict__ norm_w, float eps,
                                                                int n_tok, int n_v_heads, int d_state) { sc_pdl_enter();
  const int lane = threadIdx.x & 31;
  const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (item >= (long long)n_tok * n_v_heads) return;
  float* x = o + (size_t)item * d_state;
  const float* zr = z + (size_t)item * d_state;
  float acc = 0.0f;
  for (int i = lane; i < d_state; i += 32) acc = sc_add(acc, sc_mul(x[i], x[i]));
  const float ss = __shfl_sync(SC_FULL, sc_warp_sum(acc), 0);
  const float scale = sc_rms_scale(ss, (float)d_state, eps);
  for (int i = lane; i < d_state; i += 32) {
    x[i] = sc_mul(sc_mul(sc_mul(x[i], scale), norm_w[i]), sc_silu(zr[i]));
  }
}

// ------------------------------------------------------------------------ dn_step
// One token of value head h (= blockIdx.x) in one launch, DK threads (thread j =
// state column j): the L2 norm of q and k of its key head (dn_qk_norm's order and
// scale), the recurrence (dn_recurrence_body's operations for t = 0), the gated norm
// (dn_gated_norm's) and, with `qs`, the quantized copy of the output (each warp
// holds one 32-value block of it; sc_quant_block). conv_out is the conv output
// [q | k | v] before the q/k norm, which this kernel only reads (a key head shared by
// several value heads is normalised by each of their blocks, with the same bits).
// Several rows (blockIdx.y = row y: one token of a sequence of its own, a batched
// decode step) read row y of conv_out (conv_stride apart), of the β/α sources
// (beta_stride, alpha_stride) and of z, write row y of out and its copy (Hv·DK
// apart), and advance the state at state_tab[y]; row 0 without a table is the
// one-token launch.
template <int DK>
__device__ __forceinline__ void dn_step_body(const float* __restrict__ row, const float* __restrict__ beta_src,
                                             const int* __restrict__ beta_idx, const float* __restrict__ alpha_src,
                                             const int* __restrict__ alpha_idx, const float* __restrict__ a,
                                             const float* __restrict__ dt_bias, const int* __restrict__ k_head_of,
                                             float* __restrict__ state, int n_k_heads, float scale,
                                             const float* __restrict__ z, const float* __restrict__ norm_w, float eps,
                                             float* __restrict__ out, int8_t* __restrict__ qs,
                                             float* __restrict__ qd, int* __restrict__ qsum) {
  __shared__ float sq[DK], sk[DK], so[DK];
  __shared__ float s_q, s_k, s_o;
  const int j = threadIdx.x, lane = j & 31, w = j >> 5;
  const int h = blockIdx.x;
  const int kd = n_k_heads * DK;
  const int kh = k_head_of[h];
  sq[j] = row[kh * DK + j];
  sk[j] = row[kd + kh * DK + j];
  __syncthreads();
  if (w == 0) {
    float aq = 0.0f, ak = 0.0f;
    for (int i = lane; i < DK; i += 32) {
      aq = sc_add(aq, sc_mul(sq[i], sq[i]));
      ak = sc_add(ak, sc_mul(sk[i], sk[i]));
    }
    aq = sc_warp_sum(aq);
    ak = sc_warp_sum(ak);
    if (lane == 0) {
      s_q = sc_l2_scale(aq, 1e-6f);
      s_k = sc_l2_scale(ak, 1e-6f);
    }
  }
  __syncthreads();
  const float qn = sc_mul(sc_mul(sq[j], s_q), scale);
  const float kn = sc_mul(sk[j], s_k);
  __syncthreads();
  sq[j] = qn;
  sk[j] = kn;
  __syncthreads();
  float* sh = state + (size_t)h * DK * DK;
  float S[DK];
#pragma unroll
  for (int i = 0; i < DK; i++) S[i] = sh[(size_t)i * DK + j];
  const float v = row[2 * kd + h * DK + j];
  const float g = sc_mul(a[h], sc_softplus(sc_add(alpha_src[alpha_idx[h]], dt_bias[h])));
  const float beta = sc_sigmoid(beta_src[beta_idx[h]]);
  const float o = sc_dn_update<DK>(S, sq, sk, v, sc_exp(g), beta);
#pragma unroll
  for (int i = 0; i < DK; i++) sh[(size_t)i * DK + j] = S[i];
  so[j] = o;
  __syncthreads();
  if (w == 0) {
    float acc = 0.0f;
    for (int i = lane; i < DK; i += 32) acc = sc_add(acc, sc_mul(so[i], so[i]));
    acc = sc_warp_sum(acc);
    if (lane == 0) s_o = sc_rms_scale(acc, (float)DK, eps);
  }
  __syncthreads();
  const size_t at = (size_t)h * DK + j;
  const float y = sc_mul(sc_mul(sc_mul(o, s_o), norm_w[j]), sc_silu(z[at]));
  out[at] = y;
  if (qs) sc_quant_block(y, lane, qs + (size_t)h * DK + 32 * w, qd + at / 32, qsum + at / 32);
}

#define SC_DN_STEP(DK, NAME, ROWS)                                                                   \
  extern "C" __global__ void __launch_bounds__(DK) NAME(                                             \
      const float* __restrict__ conv_out, const float* __restrict__ beta_src,                       \
      const int* __restrict__ beta_idx, const float* __restrict__ alpha_src,                        \
      const int* __restrict__ alpha_idx, const float* __restrict__ a, const float* __restrict__ dt_bias, \
      const int* __restrict__ k_head_of, float* __restrict__ state, int n_k_heads, float scale,     \
      const float* __restrict__ z, const float* __restrict__ norm_w, float eps, float* __restrict__ out, \
      int8_t* __restrict__ qs, float* __restrict__ qd, int* __restrict__ qsum,                      \
      const unsigned long long* __restrict__ state_tab, int conv_stride, int beta_stride,           \
      int alpha_stride) {                                                                            \
    sc_pdl_enter();                                                                                  \
    if (ROWS) {                                                                                      \
      const size_t y = blockIdx.y, vw = (size_t)gridDim.x * DK;                                      \
      state = (float*)state_tab[y];                                                                  \
      conv_out += y * conv_stride;                                                                   \
      beta_src += y * beta_stride;                                                                   \
      alpha_src += y * alpha_stride;                                                                 \
      z += y * vw;                                                                                   \
      out += y * vw;                                                                                 \
      if (qs) {                                                                                      \
        qs += y * vw;                                                                                \
        qd += y * vw / 32;                                                                           \
        qsum += y * vw / 32;                                                                         \
      }                                                                                              \
    }                                                                                                \
    dn_step_body<DK>(conv_out, beta_src, beta_idx, alpha_src, alpha_idx, a, dt_bias, k_head_of, state, \
                     n_k_heads, scale, z, norm_w, eps, out, qs, qd, qsum);                           \
  }

SC_DN_STEP(32, dn_step_dk32, false)
SC_DN_STEP(64, dn_step_dk64, false)
SC_DN_STEP(128, dn_step_dk128, false)
SC_DN_STEP(32, dn_step_rows_dk32, true)
SC_DN_STEP(64, dn_step_rows_dk64, true)
SC_DN_STEP(128, dn_step_rows_dk128, true)
