// Row reductions and elementwise steps: rms_norm, dot_rows, add, scale, swiglu, argmax.
// rms_norm, dot_rows, add, scale and swiglu are bit-identical to the CPU (model::math); every
// reduction uses the canonical 32-lane order (lane l sums elements l, l+32, ... in
// increasing order, then the fixed tree sc_warp_sum).

#include "sc_common.cuh"
#include "scoria_math.cuh"
#include "sc_argmax.cuh"


// Row reductions run one block per row: the block stages the row's terms (squares or
// products) in shared memory in one coalesced pass, then warp 0 runs the canonical
// 32-lane sum out of shared memory (lane l: elements l, l+32, ... in increasing order,
// then the tree sc_warp_sum). The sums are the CPU's bit for bit; the staging only
// keeps the loads in flight together instead of one memory round trip per element.
#define SC_ROW_THREADS 1024
#define SC_ROW_CHUNK 4096  // a multiple of SC_ROW_THREADS (so of 32)
#define SC_ROW_PER (SC_ROW_CHUNK / SC_ROW_THREADS)

// Canonical sum of the SC_ROW_CHUNK-sized chunk of terms in `st` (n of them) into
// warp 0's lane accumulator.
__device__ __forceinline__ void sc_row_accumulate(const float* st, int n, float& acc) {
  if (threadIdx.x < 32) {
#pragma unroll 8
    for (int i = threadIdx.x; i < n; i += 32) acc = sc_add(acc, st[i]);
  }
}

// out[r] = rms_norm(x[r]) · w (model::math::rms_norm): ss = Σ x_i² (canonical order,
// squares rounded then added), scale = 1/sqrt(ss/n + eps), out_i = (x_i · scale) · w_i.
// With ADD, x += y first (the residual step fused with the next norm: the same
// operations as `add` followed by `rms_norm`). `out` may be `x`. Each thread loads
// all its values of a chunk before it computes or stores any, and keeps them for the
// last pass when the row is one chunk: a few memory round trips a row, not one per
// element.
// With non-null `qs`, the output rows are also quantized into the canonical int8
// blocks (qs, qd, qsum as quantize_act writes them; cols a multiple of 32): each warp
// holds a whole 32-value block of every pass, since SC_ROW_THREADS is a multiple of 32.
template <bool ADD>
__device__ __forceinline__ void sc_row_norm(float* x, const float* y, int rows, int cols,
                                            const float* __restrict__ w, float eps, float* out,
                                            int8_t* qs, float* qd, int* qsum) {
  __shared__ float st[SC_ROW_CHUNK];
  __shared__ float s_scale;
  const int r = blockIdx.x;
  if (r >= rows) return;
  float* xr = x + (size_t)r * cols;
  float acc = 0.0f;
  float keep[SC_ROW_PER];
  for (int c0 = 0; c0 < cols; c0 += SC_ROW_CHUNK) {
    const int n = min(SC_ROW_CHUNK, cols - c0);
    float v[SC_ROW_PER], u[SC_ROW_PER];
#pragma unroll
    for (int k = 0; k < SC_ROW_PER; k++) {
      const int i = threadIdx.x + k * SC_ROW_THREADS;
      v[k] = i < n ? xr[c0 + i] : 0.0f;
      u[k] = ADD && i < n ? y[(size_t)r * cols + c0 + i] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < SC_ROW_PER; k++) {
      const int i = threadIdx.x + k * SC_ROW_THREADS;
      if (i < n) {
        if (ADD) {
          v[k] = sc_add(v[k], u[k]);
          xr[c0 + i] = v[k];
        }
        st[i] = sc_mul(v[k], v[k]);
      }
      keep[k] = v[k];
    }
    __syncthreads();
    sc_row_accumulate(st, n, acc);
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    const float ss = sc_warp_sum(acc);
    if (threadIdx.x == 0) s_scale = sc_rms_scale(ss, (float)cols, eps);
  }
  __syncthreads();
  const float scale = s_scale;
  float* orow = out + (size_t)r * cols;
  auto emit = [&](int i, float v) {
    orow[i] = v;
    if (qs) {
      const size_t blk = ((size_t)r * cols + i) >> 5;
      sc_quant_block(v, threadIdx.x & 31, qs + blk * 32, qd + blk, qsum + blk);
    }
  };
  if (cols <= SC_ROW_CHUNK) {
    float wv[SC_ROW_PER];
#pragma unroll
    for (int k = 0; k < SC_ROW_PER; k++) {
      const int i = threadIdx.x + k * SC_ROW_THREADS;
      wv[k] = i < cols ? __ldg(w + i) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < SC_ROW_PER; k++) {
      const int i = threadIdx.x + k * SC_ROW_THREADS;
      if (i < cols) emit(i, sc_mul(sc_mul(keep[k], scale), wv[k]));
    }
  } else {
    for (int i = threadIdx.x; i < cols; i += SC_ROW_THREADS) emit(i, sc_mul(sc_mul(xr[i], scale), __ldg(w + i)));
  }
}

extern "C" __global__ void __launch_bounds__(SC_ROW_THREADS)
    rms_norm(const float* x, int rows, int cols, const float* __restrict__ w, float eps, float* out,
             int8_t* qs, float* qd, int* qsum) {
  sc_pdl_enter();
  // x is only read on this path (ADD = false).
  sc_row_norm<false>(const_cast<float*>(x), nullptr, rows, cols, w, eps, out, qs, qd, qsum);
}

extern "C" __global__ void __launch_bounds__(SC_ROW_THREADS)
    add_rms_norm(float* x, const float* y, int rows, int cols, const float* __restrict__ w, float eps,
                 float* out, int8_t* qs, float* qd, int* qsum) {
  sc_pdl_enter();
  sc_row_norm<true>(x, y, rows, cols, w, eps, out, qs, qd, qsum);
}

// out[r] = Σ_i x[r][i] · v[i] in the canonical order (model::math::dot: each product
// rounded, then added).
extern "C" __global__ void __launch_bounds__(SC_ROW_THREADS)
    dot_rows(const float* __restrict__ x, const float* __restrict__ v, int rows, int n_cols,
             float* __restrict__ out) { sc_pdl_enter();
  __shared__ float st[SC_ROW_CHUNK];
  const int r = blockIdx.x;
  if (r >= rows) return;
  const float* xr = x + (size_t)r * n_cols;
  float acc = 0.0f;
  for (int c0 = 0; c0 < n_cols; c0 += SC_ROW_CHUNK) {
    const int n = min(SC_ROW_CHUNK, n_cols - c0);
    for (int i = threadIdx.x; i < n; i += SC_ROW_THREADS) st[i] = sc_mul(xr[c0 + i], __ldg(v + c0 + i));
    __syncthreads();
    sc_row_accumulate(st, n, acc);
    __syncthreads();
  }
  if (threadIdx.x < 32) {
    const float s = sc_warp_sum(acc);
    if (threadIdx.x == 0) out[r] = s;
  }
}

// x += y.
extern "C" __global__ void __launch_bounds__(256) add(float* x, const float* y, long long n) { sc_pdl_enter();
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    x[i] = sc_add(x[i], y[i]);
  }
}

// x *= s: a product's values times its matrix's second-level scale, one
// multiplication each (the CPU's engine::cpu::apply_scale).
extern "C" __global__ void __launch_bounds__(256) scale(float* x, long long n, float s) { sc_pdl_enter();
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    x[i] = sc_mul(x[i], s);
  }
}

// out = silu(g) · u (the CPU's swiglu). `out` may be `g` or `u`.
extern "C" __global__ void __launch_bounds__(256) swiglu(const float* g, const float* u, long long n,
                                                         float* out) { sc_pdl_enter();
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    out[i] = sc_mul(sc_silu(g[i]), u[i]);
  }
}

// The greedy choice of each row (sc_argmax.cuh), each row spread over the GPU: grid
// (blocks of SC_ARGMAX_CHUNK ids, rows), row y (n values) writes out_idx[y].
// `scratch`: per row 2 + 2·gridDim.x words (ops/norm.rs: argmax_scratch_words): the
// arrival counter (zero before the first use; the last block leaves it so), a word of
// padding, then each block's (value, index).
#define SC_ARGMAX_THREADS 256
#define SC_ARGMAX_CHUNK 2048
extern "C" __global__ void __launch_bounds__(SC_ARGMAX_THREADS)
    argmax(const float* __restrict__ x, int n, int* __restrict__ out_idx, unsigned* __restrict__ scratch) {
  sc_pdl_enter();
  const int nb = gridDim.x;
  const float* row = x + (size_t)blockIdx.y * n;
  unsigned* st = scratch + (size_t)blockIdx.y * (2 + 2 * nb);
  const int lo = blockIdx.x * SC_ARGMAX_CHUNK;
  float bv;
  int bi;
  sc_range_best(row, lo, min(n, lo + SC_ARGMAX_CHUNK), bv, bi);
  if (threadIdx.x == 0) {
    st[2 + 2 * blockIdx.x] = __float_as_uint(bv);
    st[3 + 2 * blockIdx.x] = (unsigned)bi;
  }
  if (!sc_last_block(&st[0], nb)) return;
  bv = -INFINITY;
  bi = SC_NO_INDEX;
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    sc_better(bv, bi, __uint_as_float(__ldcg(&st[2 + 2 * b])), (int)__ldcg(&st[3 + 2 * b]));
  }
  sc_block_best(bv, bi);
  if (threadIdx.x == 0) out_idx[blockIdx.y] = bi == SC_NO_INDEX ? 0 : bi;
}
