// Sampling on the device: engine::sampler::sample_with, bit for bit. The definition
// (edits, integer weights, rank, top-k, min-p, top-p, the draw in id order) is in that
// module's docs; the CPU code and this kernel are two computations of it. Every sum is
// of integers, so no order has to agree; the only floats are the edits, (e − m) / T and
// sc_exp, written out as the CPU writes them.
//
// One block of SC_SAMPLE_THREADS threads per sampled row. The row's logits are edited
// in place (they are the step's scratch), and the values ranked below the top-k are
// overwritten with -inf once top-k has been applied.

#include "sc_common.cuh"
#include "scoria_math.cuh"
#include "sc_argmax.cuh"

#define SC_SAMPLE_THREADS 1024
// Words of a row's parameters and of one edit (Gpu::sample_rows documents them).
#define SC_SAMPLE_PARAM_WORDS 10
#define SC_SAMPLE_EDIT_WORDS 4

typedef unsigned long long sc_u64;

// Order-preserving key of a finite value: a larger value has a larger key; -0 and +0
// share one (the CPU's rank treats them as equal, ties by id).
__device__ __forceinline__ unsigned sc_rank_key(float v) {
  const unsigned b = __float_as_uint(__fadd_rn(v, 0.0f));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// engine::sampler::weight of (e − m) / t, 0 below min_w; 0 for a value that is not finite.
__device__ __forceinline__ unsigned sc_weight(float e, float m, float t, unsigned min_w) {
  if (!isfinite(e)) return 0u;
  const float d = __fdiv_rn(__fsub_rn(e, m), t);
  if (!(d >= -22.0f)) return 0u;
  const unsigned w = __float2uint_rz(__fmul_rn(sc_exp(d), 2147483648.0f));
  return w < min_w ? 0u : w;
}

// Exclusive prefix sum of v over the block's threads in thread order; `total` gets
// the sum. `tot`: 33 shared words. Integer sums: any tree gives the same result.
__device__ __forceinline__ sc_u64 sc_block_scan(sc_u64 v, sc_u64* tot, sc_u64& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  sc_u64 inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const sc_u64 y = __shfl_up_sync(SC_FULL, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) tot[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const sc_u64 t = lane < nw ? tot[lane] : 0ull;
    sc_u64 ti = t;
    for (int o = 1; o < 32; o <<= 1) {
      const sc_u64 y = __shfl_up_sync(SC_FULL, ti, o);
      if (lane >= o) ti += y;
    }
    tot[lane] = ti - t;
    if (lane == 31) tot[32] = ti;
  }
  __syncthreads();
  const sc_u64 ex = tot[warp] + inc - v;
  total = tot[32];
  __syncthreads();
  return ex;
}

// The contiguous id range [lo, hi) of this thread: passes whose outcome depends on id
// order (ties at a cut, the draw) walk ids in order within a thread, threads in order.
__device__ __forceinline__ void sc_my_range(int n, int& lo, int& hi) {
  const int per = (n + blockDim.x - 1) / blockDim.x;
  lo = min(n, (int)threadIdx.x * per);
  hi = min(n, lo + per);
}

// One pass of a radix select: for every value of the row whose key matches `prefix`
// under `mask` (finite values; with WEIGHTED, those of non-zero weight), its weight
// (WEIGHTED) or 1 is added to hist[digit] and 1 to cnt[digit] (WEIGHTED), digit = the
// key's 8 bits at `shift`. Most values share their top digits, so the lanes of a warp
// that hit one bin add together first (one shared atomic per bin and warp, not one per
// value); integer sums, so the grouping does not change them.
template <bool WEIGHTED>
__device__ __forceinline__ void sc_radix_pass(const float* __restrict__ x, int n, float m,
                                              float t, unsigned min_w, unsigned prefix,
                                              unsigned mask, int shift, sc_u64* hist,
                                              unsigned* cnt) {
  const int lane = threadIdx.x & 31;
  // Whole warps take each round (n rounded up to 32), so every lane of a warp reaches
  // the warp-wide intrinsics below together.
  const int n_up = (n + 31) & ~31;
  for (int i = threadIdx.x; i < n_up; i += blockDim.x) {
    unsigned b = 256u, w = 0u;
    if (i < n) {
      const float v = x[i];
      w = WEIGHTED ? sc_weight(v, m, t, min_w) : (isfinite(v) ? 1u : 0u);
      if (w) {
        const unsigned k = sc_rank_key(v);
        if ((k & mask) == prefix) b = (k >> shift) & 255u;
      }
    }
    const unsigned peers = __match_any_sync(SC_FULL, b);
    if (b != 256u) {
      const bool leader = lane == __ffs(peers) - 1;
      if (WEIGHTED) {
        // Weights are below 2^32: two 16-bit halves keep each warp sum in 32 bits.
        const unsigned lo = __reduce_add_sync(peers, w & 0xffffu);
        const unsigned hi = __reduce_add_sync(peers, w >> 16);
        if (leader) {
          atomicAdd(&hist[b], ((sc_u64)hi << 16) + lo);
          atomicAdd(&cnt[b], (unsigned)__popc(peers));
        }
      } else if (leader) {
        atomicAdd(&hist[b], (sc_u64)__popc(peers));
      }
    }
  }
}

// Block b: params[b·10 ..]: logits row, temperature (f32 bits), top_k (0 = off), top_p
// (f32 bits; ≥ 1 = off), min_w, the draw's 64 random bits (low, high), the row's first
// edit, its edit count, and o: out_idx[o] gets the token. edits[e·4 ..]: id, add,
// repeat, sub (f32 bits), at most one per id.
extern "C" __global__ void __launch_bounds__(SC_SAMPLE_THREADS)
    sample_rows(float* __restrict__ logits, int n, const unsigned* __restrict__ params,
                const unsigned* __restrict__ edits, int* __restrict__ out_idx) {
  sc_pdl_enter();
  __shared__ sc_u64 hist[256];
  __shared__ unsigned cnt[256];
  __shared__ sc_u64 tot[33];
  __shared__ float red_m[32];
  __shared__ unsigned red_n[32];
  __shared__ sc_u64 bc[4];
  const unsigned* pr = params + (size_t)blockIdx.x * SC_SAMPLE_PARAM_WORDS;
  float* x = logits + (size_t)pr[0] * n;
  const float t = __uint_as_float(pr[1]);
  const unsigned top_k = pr[2];
  const float top_p = __uint_as_float(pr[3]);
  const unsigned min_w = pr[4];
  const sc_u64 bits = (sc_u64)pr[5] | ((sc_u64)pr[6] << 32);
  const unsigned e0 = pr[7], ne = pr[8];
  int* const out = out_idx + pr[9];
  const int tid = threadIdx.x, nt = blockDim.x;
  const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;

  // 1. Edits: distinct ids, so no two threads touch one value.
  for (unsigned j = tid; j < ne; j += nt) {
    const unsigned* e = edits + (size_t)(e0 + j) * SC_SAMPLE_EDIT_WORDS;
    if (e[0] < (unsigned)n) {
      const float rep = __uint_as_float(e[2]);
      float v = __fadd_rn(x[e[0]], __uint_as_float(e[1]));
      if (rep != 1.0f) v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
      x[e[0]] = __fsub_rn(v, __uint_as_float(e[3]));
    }
  }
  __syncthreads();
  if (t <= 0.0f) {
    const int b = sc_row_argmax(x, n);
    if (tid == 0) *out = b;
    return;
  }

  // 2. The largest finite value, the count of finite values, any +inf.
  float m = -INFINITY;
  unsigned nf = 0, pinf = 0;
  for (int i = tid; i < n; i += nt) {
    const float v = x[i];
    if (isfinite(v)) {
      ++nf;
      m = v > m ? v : m;
    } else if (v == INFINITY) {
      pinf = 1;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(SC_FULL, m, o);
    m = om > m ? om : m;
    nf += __shfl_xor_sync(SC_FULL, nf, o);
    pinf |= __shfl_xor_sync(SC_FULL, pinf, o);
  }
  if (lane == 0) {
    red_m[warp] = m;
    red_n[warp] = nf | (pinf << 31);
  }
  __syncthreads();
  m = -INFINITY;
  nf = 0;
  pinf = 0;
  for (int w = 0; w < nw; ++w) {
    m = red_m[w] > m ? red_m[w] : m;
    nf += red_n[w] & 0x7fffffffu;
    pinf |= red_n[w] >> 31;
  }
  __syncthreads();
  if (nf == 0 || pinf) {
    const int b = sc_row_argmax(x, n);
    if (tid == 0) *out = b;
    return;
  }

  int lo, hi;
  sc_my_range(n, lo, hi);
  sc_u64 total;

  // 3. top-k: the k-th key by a radix select (8 bits a pass, from the top); what ranks
  // below it becomes -inf (equal keys: the lower ids stay).
  if (top_k > 0 && top_k < nf) {
    unsigned prefix = 0, mask = 0;
    sc_u64 want = top_k, eq = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int d = tid; d < 256; d += nt) hist[d] = 0;
      __syncthreads();
      sc_radix_pass<false>(x, n, m, t, min_w, prefix, mask, shift, hist, cnt);
      __syncthreads();
      if (tid == 0) {
        sc_u64 acc = 0;
        int d = 255;
        for (; d > 0; --d) {
          if (acc + hist[d] >= want) break;
          acc += hist[d];
        }
        bc[0] = d;
        bc[1] = want - acc;
        bc[2] = hist[d];
      }
      __syncthreads();
      prefix |= (unsigned)bc[0] << shift;
      mask |= 0xffu << shift;
      want = bc[1];
      eq = bc[2];
      __syncthreads();
    }
    if (eq > want) {
      sc_u64 c = 0;
      for (int i = lo; i < hi; ++i) {
        const float v = x[i];
        c += (isfinite(v) && sc_rank_key(v) == prefix) ? 1ull : 0ull;
      }
      sc_u64 before = sc_block_scan(c, tot, total);
      for (int i = lo; i < hi; ++i) {
        const float v = x[i];
        if (isfinite(v) && sc_rank_key(v) == prefix) {
          if (before >= want) x[i] = -INFINITY;
          ++before;
        }
      }
      __syncthreads();
    }
    for (int i = tid; i < n; i += nt) {
      const float v = x[i];
      if (isfinite(v) && sc_rank_key(v) < prefix) x[i] = -INFINITY;
    }
    __syncthreads();
  }

  // 4. top-p: the key kp at which the rank's weights reach need; `above` is the weight
  // ranked above kp, `eqn` how many weighted values have key kp.
  const bool cut = top_p < 1.0f;
  unsigned kp = 0;
  sc_u64 need = 0, above = 0, eqn = 0;
  if (cut) {
    sc_u64 s = 0;
    for (int i = tid; i < n; i += nt) s += sc_weight(x[i], m, t, min_w);
    sc_block_scan(s, tot, total);
    const double c = ceil(__dmul_rn((double)top_p, (double)total));
    const sc_u64 cap = total > 0 ? total : 1ull;
    need = c <= 1.0 ? 1ull : (c >= (double)cap ? cap : (sc_u64)c);
    unsigned mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int d = tid; d < 256; d += nt) {
        hist[d] = 0;
        cnt[d] = 0;
      }
      __syncthreads();
      sc_radix_pass<true>(x, n, m, t, min_w, kp, mask, shift, hist, cnt);
      __syncthreads();
      if (tid == 0) {
        sc_u64 acc = above;
        int d = 255;
        for (; d > 0; --d) {
          if (acc + hist[d] >= need) break;
          acc += hist[d];
        }
        bc[0] = d;
        bc[1] = acc;
        bc[2] = cnt[d];
      }
      __syncthreads();
      kp |= (unsigned)bc[0] << shift;
      mask |= 0xffu << shift;
      above = bc[1];
      eqn = bc[2];
      __syncthreads();
    }
  }

  // 5. The draw: the nucleus's weights in id order. A value at kp is in while the
  // weight ranked before it (above, then the equal ones of lower id) is under need.
  sc_u64 eq_before = 0;
  if (cut && eqn > 1) {
    sc_u64 c = 0;
    for (int i = lo; i < hi; ++i) {
      const float v = x[i];
      const unsigned w = sc_weight(v, m, t, min_w);
      if (w && sc_rank_key(v) == kp) c += w;
    }
    eq_before = sc_block_scan(c, tot, total);
  }
  sc_u64 mine = 0;
  {
    sc_u64 eb = eq_before;
    for (int i = lo; i < hi; ++i) {
      const float v = x[i];
      const unsigned w = sc_weight(v, m, t, min_w);
      if (!w) continue;
      bool in = true;
      if (cut) {
        const unsigned k = sc_rank_key(v);
        if (k < kp) {
          in = false;
        } else if (k == kp) {
          in = above + eb < need;
          eb += w;
        }
      }
      if (in) mine += w;
    }
  }
  sc_u64 s_n;
  const sc_u64 base = sc_block_scan(mine, tot, s_n);
  if (s_n == 0) {
    const int b = sc_row_argmax(x, n);
    if (tid == 0) *out = b;
    return;
  }
  const sc_u64 r = __umul64hi(bits, s_n);
  if (base <= r && r < base + mine) {
    sc_u64 acc = base, eb = eq_before;
    for (int i = lo; i < hi; ++i) {
      const float v = x[i];
      const unsigned w = sc_weight(v, m, t, min_w);
      if (!w) continue;
      bool in = true;
      if (cut) {
        const unsigned k = sc_rank_key(v);
        if (k < kp) {
          in = false;
        } else if (k == kp) {
          in = above + eb < need;
          eb += w;
        }
      }
      if (in) {
        acc += w;
        if (r < acc) {
          *out = i;
          break;
        }
      }
    }
  }
}
