// Activation quantization, the canonical matvec over token tiles, and embedding rows.
// Every output is bit-identical to the CPU (crates/quant): quant::quantize_act,
// quant::matvec / quant::dot, quant::dequantize_row.

#include "sc_formats.cuh"
#include "scoria_math.cuh"

#define SC_FULL 0xffffffffu

// ------------------------------------------------------------------ quantize_act
// One warp per 32-value block, lane i = value i (quant::quantize_act_block):
// amax = max |x_i|; d = amax / 127; id = d == 0 ? 0 : 1 / d;
// q_i = clamp(round_half_even(x_i * id), -127, 127); sum = Σ q_i.
extern "C" __global__ void __launch_bounds__(256) quantize_act(const float* __restrict__ x, long long n_blocks,
                                                               int8_t* __restrict__ qs, float* __restrict__ d_out,
                                                               int* __restrict__ sums) {
  const long long blk = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (blk >= n_blocks) return;  // whole warps only: blockDim is a multiple of 32
  const float v = x[blk * 32 + lane];
  // The CPU keeps amax from 0 and takes |x| only when greater: NaN never wins.
  float a = fmaxf(0.0f, fabsf(v));
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) a = fmaxf(a, __shfl_xor_sync(SC_FULL, a, w));
  const float d = sc_div(a, 127.0f);
  const float id = d == 0.0f ? 0.0f : sc_div(1.0f, d);
  const float r = rintf(sc_mul(v, id));
  // Rust's `NaN.clamp(..) as i8` is 0.
  const int q = r != r ? 0 : (int)fminf(fmaxf(r, -127.0f), 127.0f);
  int sum = q;
#pragma unroll
  for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(SC_FULL, sum, w);
  qs[blk * 32 + lane] = (int8_t)q;
  if (lane == 0) {
    d_out[blk] = d;
    sums[blk] = sum;
  }
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

// Activation block `ab` (32 int8 values) as 8 words.
__device__ __forceinline__ void sc_load_act(const int8_t* __restrict__ xq, size_t ab, uint32_t* a) {
  const uint8_t* p = (const uint8_t*)(xq + ab * 32);
  sc_ld128(p, a);
  sc_ld128(p + 16, a + 4);
}

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
// acc = fma(w_i, x_i, acc), in increasing order. The loads of 16 elements are issued
// together before their FMAs (one memory round trip per 16 instead of per element).
#define SC_FDOT(GET)                                                                      \
  for (int i0 = lane; i0 < n_cols; i0 += 32 * 16) {                                       \
    float wv[16];                                                                         \
    _Pragma("unroll") for (int q = 0; q < 16; q++) {                                      \
      const int i = i0 + 32 * q;                                                          \
      wv[q] = i < n_cols ? GET(row, i) : 0.0f;                                            \
    }                                                                                     \
    _Pragma("unroll") for (int j = 0; j < TL; j++) {                                      \
      if (j < nt) {                                                                       \
        const float* xr = x + (size_t)in_r[j] * n_cols;                                   \
        float xv[16];                                                                     \
        _Pragma("unroll") for (int q = 0; q < 16; q++) {                                  \
          const int i = i0 + 32 * q;                                                      \
          xv[q] = i < n_cols ? __ldg(xr + i) : 0.0f;                                      \
        }                                                                                 \
        _Pragma("unroll") for (int q = 0; q < 16; q++) {                                  \
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
// so more warps in flight. Both perform the same operations per (row, token).
#define SC_MATVEC_KERNEL_T(NAME, TLV, BODY)                                               \
  extern "C" __global__ void __launch_bounds__(128)                                      \
      NAME(const uint8_t* __restrict__ w, unsigned long long expert_bytes,               \
           unsigned long long row_bytes, int n_rows, int n_cols, const float* __restrict__ x, \
           const int8_t* __restrict__ xq, const float* __restrict__ xd,                  \
           const int* __restrict__ xs, int n_tok, const Tile* __restrict__ tiles,        \
           int n_tiles, float* __restrict__ out) {                                       \
    constexpr int TL = TLV;                                                              \
    const int lane = threadIdx.x & 31;                                                   \
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);                   \
    if (r >= n_rows) return;                                                             \
    const int n_sub = n_cols >> 5;                                                       \
    (void)n_sub;                                                                         \
    (void)x;                                                                             \
    (void)xq;                                                                            \
    (void)xd;                                                                            \
    (void)xs;                                                                            \
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
#define SC_MATVEC_KERNEL(NAME, BODY)                                                      \
  SC_MATVEC_KERNEL_T(NAME, 8, BODY)                                                      \
  SC_MATVEC_KERNEL_T(NAME##_t1, 1, BODY)

SC_MATVEC_KERNEL(matvec_f32, SC_FDOT(sc_get_f32))
SC_MATVEC_KERNEL(matvec_f16, SC_FDOT(sc_get_f16))
SC_MATVEC_KERNEL(matvec_bf16, SC_FDOT(sc_get_bf16))
SC_MATVEC_KERNEL(matvec_q8_0, SC_QDOT(WQ8_0, sc_load_q8_0, sc_contrib_q8_0))
SC_MATVEC_KERNEL(matvec_q4_0, SC_QDOT(WQ4_0, sc_load_q4_0, sc_contrib_q4_0))
SC_MATVEC_KERNEL(matvec_q4_k, SC_QDOT(WK, sc_load_q4_k, sc_contrib_k))
SC_MATVEC_KERNEL(matvec_q5_k, SC_QDOT(WK, sc_load_q5_k, sc_contrib_k))
SC_MATVEC_KERNEL(matvec_q6_k, SC_QDOT(WQ6_K, sc_load_q6_k, sc_contrib_q6_k))
SC_MATVEC_KERNEL(matvec_iq4_xs, SC_QDOT(WIQ4, sc_load_iq4_xs, sc_contrib_iq4_xs))

// ------------------------------------------------------------------------- embed
// out[t][i] = element i of table row ids[t] (quant::dequantize_row).
extern "C" __global__ void __launch_bounds__(256) embed(int ty, const uint8_t* __restrict__ table,
                                                        unsigned long long row_bytes, int cols,
                                                        const int* __restrict__ ids, int n_tok,
                                                        float* __restrict__ out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= cols) return;
  for (int t = blockIdx.y; t < n_tok; t += gridDim.y) {
    const uint8_t* row = table + (unsigned long long)ids[t] * row_bytes;
    out[(size_t)t * cols + i] = sc_dequant(ty, row, i);
  }
}
