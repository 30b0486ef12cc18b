// The dot products of weight rows against one token's activations that the
// quantized products (quant.cu) and the fused MoE and router kernels (moe.cu) share:
// the weight formats as types, and the lane sums of a row in the canonical order
// (lane l is accumulator l and takes sub-blocks / elements l, l + 32, ... in
// increasing order; the caller folds the lanes with sc_warp_sum).
#pragma once

#include "sc_formats.cuh"

// Activation block `ab` (32 int8 values) as 8 words.
__device__ __forceinline__ void sc_load_act(const int8_t* __restrict__ xq, size_t ab, uint32_t* a) {
  const uint8_t* p = (const uint8_t*)(xq + ab * 32);
  sc_ld128(p, a);
  sc_ld128(p + 16, a + 4);
}

// Weight formats as types, for the dot products below.
#define SC_QFMT(NAME, WT, LOAD, CONTRIB)                                                       \
  struct NAME {                                                                                \
    typedef WT W;                                                                              \
    static __device__ __forceinline__ void load(const uint8_t* row, int s, W& w) { LOAD(row, s, w); } \
    static __device__ __forceinline__ float contrib(const W& w, const uint32_t* a, float d, int sum) { \
      return CONTRIB(w, a, d, sum);                                                            \
    }                                                                                          \
  };
SC_QFMT(FmtQ8_0, WQ8_0, sc_load_q8_0, sc_contrib_q8_0)
SC_QFMT(FmtQ4_0, WQ4_0, sc_load_q4_0, sc_contrib_q4_0)
SC_QFMT(FmtQ4K, WK, sc_load_q4_k, sc_contrib_k)
SC_QFMT(FmtQ5K, WK, sc_load_q5_k, sc_contrib_k)
SC_QFMT(FmtQ6K, WQ6_K, sc_load_q6_k, sc_contrib_q6_k)
SC_QFMT(FmtIq4Xs, WIQ4, sc_load_iq4_xs, sc_contrib_iq4_xs)
// The low-bit types: FmtLb_q2_k, FmtLb_q3_k, ... (sc_formats.cuh's list).
#define SC_LB_QFMT(CODE, NAME, LOAD, CONTRIB) SC_QFMT(FmtLb_##NAME, WLB, LOAD, CONTRIB)
SC_LOWBIT_TYPES(SC_LB_QFMT)
#undef SC_LB_QFMT
#define SC_FFMT(NAME, GET)                                                                     \
  struct NAME {                                                                                \
    static __device__ __forceinline__ float get(const uint8_t* row, int i) { return GET(row, i); } \
  };
SC_FFMT(FmtF32, sc_get_f32)
SC_FFMT(FmtF16, sc_get_f16)
SC_FFMT(FmtBf16, sc_get_bf16)

// The lane sums of NR rows (NR = 1 or 2, rows of one type) against one token's
// quantized activations (`xq`, `xd`, `xs` at the token's first block): SC_QDOT with
// one token per row.
template <class F, int NR>
__device__ __forceinline__ void sc_qdot_rows(const uint8_t* const* rows, int n_sub, const int8_t* xq,
                                             const float* xd, const int* xs, int lane, float* acc) {
#pragma unroll 2
  for (int s = lane; s < n_sub; s += 32) {
    typename F::W w[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) F::load(rows[i], s, w[i]);
    uint32_t a[8];
    sc_load_act(xq, s, a);
    const float d = __ldg(xd + s);
    const int sum = __ldg(xs + s);
#pragma unroll
    for (int i = 0; i < NR; i++) acc[i] = sc_add(acc[i], F::contrib(w[i], a, d, sum));
  }
}

// The same for float rows against the token's float activations `x`: SC_FDOT with one
// token per row.
template <class F, int NR>
__device__ __forceinline__ void sc_fdot_rows(const uint8_t* const* rows, int n_cols, const float* x,
                                             int lane, float* acc) {
  for (int i0 = lane; i0 < n_cols; i0 += 32 * 16) {
    float wv[NR][16], xv[16];
#pragma unroll
    for (int i = 0; i < NR; i++) {
#pragma unroll
      for (int q = 0; q < 16; q++) {
        const int c = i0 + 32 * q;
        wv[i][q] = c < n_cols ? F::get(rows[i], c) : 0.0f;
      }
    }
#pragma unroll
    for (int q = 0; q < 16; q++) {
      const int c = i0 + 32 * q;
      xv[q] = c < n_cols ? __ldg(x + c) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < NR; i++) {
#pragma unroll
      for (int q = 0; q < 16; q++) {
        if (i0 + 32 * q < n_cols) acc[i] = sc_fma(wv[i][q], xv[q], acc[i]);
      }
    }
  }
}

// Lane sums of NR rows of type `ty` (a type code of sc_formats.cuh) against one token.
template <int NR>
__device__ __forceinline__ void sc_dot_rows(int ty, const uint8_t* const* rows, int n_cols, const float* x,
                                            const int8_t* xq, const float* xd, const int* xs, int lane,
                                            float* acc) {
  const int n_sub = n_cols >> 5;
  switch (ty) {
    case SC_T_F32: sc_fdot_rows<FmtF32, NR>(rows, n_cols, x, lane, acc); break;
    case SC_T_F16: sc_fdot_rows<FmtF16, NR>(rows, n_cols, x, lane, acc); break;
    case SC_T_BF16: sc_fdot_rows<FmtBf16, NR>(rows, n_cols, x, lane, acc); break;
    case SC_T_Q8_0: sc_qdot_rows<FmtQ8_0, NR>(rows, n_sub, xq, xd, xs, lane, acc); break;
    case SC_T_Q4_0: sc_qdot_rows<FmtQ4_0, NR>(rows, n_sub, xq, xd, xs, lane, acc); break;
    case SC_T_Q4_K: sc_qdot_rows<FmtQ4K, NR>(rows, n_sub, xq, xd, xs, lane, acc); break;
    case SC_T_Q5_K: sc_qdot_rows<FmtQ5K, NR>(rows, n_sub, xq, xd, xs, lane, acc); break;
    case SC_T_Q6_K: sc_qdot_rows<FmtQ6K, NR>(rows, n_sub, xq, xd, xs, lane, acc); break;
    case SC_T_IQ4_XS: sc_qdot_rows<FmtIq4Xs, NR>(rows, n_sub, xq, xd, xs, lane, acc); break;
    default: break;
  }
}

// sc_dot_rows for every type, the low-bit ones included: the kernels that take any
// type at run time have a low-bit twin (suffix _lb) that reads through this, so that
// their own code, which never meets a low-bit type, stays as it was.
template <int NR>
__device__ __forceinline__ void sc_dot_rows_lb(int ty, const uint8_t* const* rows, int n_cols, const float* x,
                                               const int8_t* xq, const float* xd, const int* xs, int lane,
                                               float* acc) {
  if (ty < SC_T_LOWBIT_FIRST) {
    sc_dot_rows<NR>(ty, rows, n_cols, x, xq, xd, xs, lane, acc);
    return;
  }
  const int n_sub = n_cols >> 5;
  switch (ty) {
#define SC_LB_DOT_CASE(CODE, NAME, LOAD, CONTRIB) \
  case CODE: sc_qdot_rows<FmtLb_##NAME, NR>(rows, n_sub, xq, xd, xs, lane, acc); break;
    SC_LOWBIT_TYPES(SC_LB_DOT_CASE)
#undef SC_LB_DOT_CASE
    default: break;
  }
}
