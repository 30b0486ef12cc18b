// Sampling on the device: engine::sampler::sample_with, bit for bit. The definition
// (edits, integer weights, rank, top-k, min-p, top-p, the draw in id order) is in that
// module's docs; the CPU code and this kernel are two computations of it. Every sum is
// of integers, so no order has to agree; the only floats are the edits, (e − m) / T and
// sc_exp, written out as the CPU writes them; after them the row is integers only.
//
// One block of SC_SAMPLE_THREADS threads per sampled row. The row's logits are edited
// in place (they are the step's scratch), then overwritten with the weights.

#include "sc_common.cuh"
#include "scoria_math.cuh"
#include "sc_argmax.cuh"

#define SC_SAMPLE_THREADS 1024
// Words of a row's parameters and of one edit (Gpu::sample_rows documents them).
#define SC_SAMPLE_PARAM_WORDS 10
#define SC_SAMPLE_EDIT_WORDS 4

typedef unsigned long long sc_u64;

// engine::sampler's weight of e (model::math::sample_weight), 0 below min_w.
__device__ __forceinline__ unsigned sc_weight(float e, float m, float t, unsigned min_w) {
  if (!isfinite(e)) return 0u;
  const float d = __fdiv_rn(__fsub_rn(e, m), t);
  if (!(d >= -22.0f)) return 0u;
  const unsigned w = __float2uint_rz(__fmul_rn(sc_exp(d), 2147483648.0f));
  return w < min_w ? 0u : w;
}

// Block-wide sum (u64) of v; every thread gets it. `red`: 33 shared words.
__device__ __forceinline__ sc_u64 sc_block_sum(sc_u64 v, sc_u64* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SC_FULL, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  sc_u64 s = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += red[w];
  __syncthreads();
  return s;
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

// Shared state of one block's selects.
// top-k of at most this many goes by the gathered candidates (sc_small_top_k).
#define SC_SMALL_K 1024
// ... when at most this many weights reach the threshold the thread maxima give.
#define SC_GATHER 2048

struct ScSelect {
  sc_u64 hist[256];
  sc_u64 red[33];
  sc_u64 bc[4];
  unsigned lo[32], hi[32];
  // sc_small_top_k's candidates (weight, id), the thread maxima, the rank order.
  unsigned cw[SC_GATHER], cid[SC_GATHER];
  unsigned tmax[SC_SAMPLE_THREADS], order[SC_SMALL_K];
  unsigned count;
};

// The weight kappa at which the rank (weight descending) of the non-zero weights
// w[0..n) reaches `want`: counting values (WEIGHTED false) or adding weights, the part
// ranked strictly above kappa (`above`) is below want and with the values equal to
// kappa it reaches want. `eq`: how many values equal kappa. A radix select from the
// highest bit in which the weights differ, 8 bits a pass; every thread gets the
// results. Integer sums: the atomics' order does not matter.
template <bool WEIGHTED>
__device__ unsigned sc_select(const unsigned* __restrict__ w, int n, sc_u64 want, ScSelect& s,
                              sc_u64& above, sc_u64& eq) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
  // The smallest and largest non-zero weight: their common high bits are every
  // candidate's, so the passes start below them.
  unsigned lo = 0xffffffffu, hi = 0u;
  for (int i = tid; i < n; i += nt) {
    const unsigned x = w[i];
    if (x) {
      lo = min(lo, x);
      hi = max(hi, x);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(SC_FULL, lo, o));
    hi = max(hi, __shfl_xor_sync(SC_FULL, hi, o));
  }
  if (lane == 0) {
    s.lo[warp] = lo;
    s.hi[warp] = hi;
  }
  __syncthreads();
  for (int k = 0; k < (nt >> 5); ++k) {
    lo = min(lo, s.lo[k]);
    hi = max(hi, s.hi[k]);
  }
  __syncthreads();
  const unsigned diff = lo ^ hi;
  int bit = diff ? 31 - __clz(diff) : -1;  // highest bit not yet fixed
  unsigned mask = bit >= 31 ? 0u : (0xffffffffu << (bit + 1));
  unsigned prefix = hi & mask;
  above = 0;
  eq = 0;
  if (bit < 0) {
    // Every candidate has the same weight.
    sc_u64 c = 0;
    for (int i = tid; i < n; i += nt) c += w[i] ? 1ull : 0ull;
    eq = sc_block_sum(c, s.red);
    return hi;
  }
  while (bit >= 0) {
    const int width = min(8, bit + 1), shift = bit + 1 - width;
    const unsigned dmask = (1u << width) - 1u;
    for (int d = tid; d < 256; d += nt) s.hist[d] = 0;
    __syncthreads();
    // Whole warps take each round, so all lanes reach the warp-wide intrinsics; lanes
    // that hit one bin add together first (most weights share their top digits).
    const int n_up = (n + 31) & ~31;
    for (int i = tid; i < n_up; i += nt) {
      const unsigned x = i < n ? w[i] : 0u;
      const unsigned b = (x && (x & mask) == prefix) ? (x >> shift) & dmask : 256u;
      const unsigned peers = __match_any_sync(SC_FULL, b);
      if (b != 256u) {
        const bool leader = lane == __ffs(peers) - 1;
        if (WEIGHTED) {
          // Weights are below 2^32: two 16-bit halves keep each warp sum in 32 bits.
          const unsigned lo16 = __reduce_add_sync(peers, x & 0xffffu);
          const unsigned hi16 = __reduce_add_sync(peers, x >> 16);
          if (leader) atomicAdd(&s.hist[b], ((sc_u64)hi16 << 16) + lo16);
        } else if (leader) {
          atomicAdd(&s.hist[b], (sc_u64)__popc(peers));
        }
      }
    }
    __syncthreads();
    if (tid == 0) {
      sc_u64 acc = above;
      int d = (int)dmask;
      for (; d > 0; --d) {
        if (acc + s.hist[d] >= want) break;
        acc += s.hist[d];
      }
      s.bc[0] = (sc_u64)d;
      s.bc[1] = acc;
      s.bc[2] = s.hist[d];
    }
    __syncthreads();
    prefix |= (unsigned)s.bc[0] << shift;
    mask |= dmask << shift;
    above = s.bc[1];
    eq = s.bc[2];
    __syncthreads();
    bit -= width;
  }
  if (WEIGHTED) eq /= prefix;  // the mass of the values equal to kappa, over kappa
  return prefix;
}

// Block-wide maximum of v (u32); every thread gets it.
__device__ __forceinline__ unsigned sc_block_max(unsigned v, ScSelect& s) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(SC_FULL, v, o));
  if ((threadIdx.x & 31) == 0) s.hi[threadIdx.x >> 5] = v;
  __syncthreads();
  unsigned r = 0;
  for (int k = 0; k < (int)(blockDim.x >> 5); ++k) r = max(r, s.hi[k]);
  __syncthreads();
  return r;
}

// top-k for k ≤ SC_SMALL_K (≤ the block's threads), then top-p and the draw, without a
// radix pass: the k-th largest of the threads' maxima is a weight tau that at least k
// weights reach, so every top-k member is among the weights ≥ tau; when those are at
// most SC_GATHER they are gathered (in any order), ranked exactly by counting (weight
// descending, lower id first), and the rest runs on the k members in shared memory.
// Returns false (nothing written) when more than SC_GATHER weights reach tau.
__device__ bool sc_small_top_k(const unsigned* __restrict__ w, int n, unsigned k, bool cut,
                               float top_p, sc_u64 bits, ScSelect& s, int* out) {
  const int tid = threadIdx.x, nt = blockDim.x;
  unsigned mx = 0;
  for (int i = tid; i < n; i += nt) mx = max(mx, w[i]);
  s.tmax[tid] = mx;
  __syncthreads();
  // The k-th largest maximum: the largest one that at least k maxima reach.
  unsigned reach = 0;
  for (int u = 0; u < nt; ++u) reach += s.tmax[u] >= mx ? 1u : 0u;
  const unsigned tau = max(1u, sc_block_max(reach >= k ? mx : 0u, s));
  sc_u64 c = 0;
  for (int i = tid; i < n; i += nt) c += w[i] >= tau ? 1ull : 0ull;
  const sc_u64 nc = sc_block_sum(c, s.red);
  if (nc > SC_GATHER) return false;
  if (tid == 0) s.count = 0;
  __syncthreads();
  for (int i = tid; i < n; i += nt) {
    if (w[i] >= tau) {
      const unsigned slot = atomicAdd(&s.count, 1u);
      s.cw[slot] = w[i];
      s.cid[slot] = i;
    }
  }
  __syncthreads();
  for (int j = tid; j < (int)nc; j += nt) {
    const unsigned wj = s.cw[j], ij = s.cid[j];
    unsigned r = 0;
    for (int u = 0; u < (int)nc; ++u) {
      r += (s.cw[u] > wj || (s.cw[u] == wj && s.cid[u] < ij)) ? 1u : 0u;
    }
    if (r < k) s.order[r] = j;
  }
  __syncthreads();
  // Thread r holds the member of rank r.
  const bool ranked = tid < (int)k;
  const unsigned wr = ranked ? s.cw[s.order[tid]] : 0u;
  const unsigned idr = ranked ? s.cid[s.order[tid]] : 0xffffffffu;
  bool member = ranked;
  sc_u64 total;
  if (cut) {
    const sc_u64 before = sc_block_scan(wr, s.red, total);
    const double cf = ceil(__dmul_rn((double)top_p, (double)total));
    const sc_u64 cap = total > 0 ? total : 1ull;
    const sc_u64 need = cf <= 1.0 ? 1ull : (cf >= (double)cap ? cap : (sc_u64)cf);
    member = ranked && before < need;
  }
  // The nucleus in id order: a member's place is the number of members of lower id.
  __syncthreads();  // s.order's readers are done; tmax becomes the members' ids
  s.tmax[tid] = member ? idr : 0xffffffffu;
  __syncthreads();
  unsigned place = 0;
  if (member) {
    for (int u = 0; u < (int)k; ++u) place += s.tmax[u] < idr ? 1u : 0u;
    s.cw[place] = wr;
    s.cid[place] = idr;
  }
  const sc_u64 n_members = sc_block_sum(member ? 1ull : 0ull, s.red);
  const unsigned v = tid < (int)n_members ? s.cw[tid] : 0u;
  const sc_u64 base = sc_block_scan(v, s.red, total);
  const sc_u64 r = __umul64hi(bits, total);
  if (tid < (int)n_members && base <= r && r < base + v) *out = (int)s.cid[tid];
  return true;
}

// Whether a non-zero weight v (walked in id order) is in the nucleus: always without
// top-p (`cut` false); with it, when above kp, or equal to kp while the weight ranked
// before it (`above`, then `eb`: the equal ones of lower id) is under need. `eb`
// advances past a v equal to kp.
__device__ __forceinline__ bool sc_in_nucleus(unsigned v, bool cut, unsigned kp, sc_u64 above,
                                              sc_u64 need, sc_u64& eb) {
  if (!cut || v > kp) return true;
  if (v < kp) return false;
  const bool in = above + eb < need;
  eb += v;
  return in;
}

// Block b: params[b·10 ..]: logits row, temperature (f32 bits), top_k (0 = off), top_p
// (f32 bits; ≥ 1 = off), min_w, the draw's 64 random bits (low, high), the row's first
// edit, its edit count, and o: out_idx[o] gets the token. edits[e·4 ..]: id, add,
// repeat, sub (f32 bits), at most one per id. The row's logits are overwritten with
// its weights (u32).
extern "C" __global__ void __launch_bounds__(SC_SAMPLE_THREADS)
    sample_rows(float* __restrict__ logits, int n, const unsigned* __restrict__ params,
                const unsigned* __restrict__ edits, int* __restrict__ out_idx) {
  sc_pdl_enter();
  __shared__ ScSelect sel;
  const unsigned* pr = params + (size_t)blockIdx.x * SC_SAMPLE_PARAM_WORDS;
  float* x = logits + (size_t)pr[0] * n;
  unsigned* w = reinterpret_cast<unsigned*>(x);
  const float t = __uint_as_float(pr[1]);
  const unsigned top_k = pr[2];
  const float top_p = __uint_as_float(pr[3]);
  const unsigned min_w = pr[4];
  const sc_u64 bits = (sc_u64)pr[5] | ((sc_u64)pr[6] << 32);
  const unsigned e0 = pr[7], ne = pr[8];
  int* const out = out_idx + pr[9];
  const int tid = threadIdx.x, nt = blockDim.x;

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
  // 2. The argmax: greedy's answer, and the largest value m (finite unless no value
  // is a candidate or one is +inf: the argmax's answer too).
  const int best = sc_row_argmax(x, n);
  const float m = x[best];
  if (t <= 0.0f || !isfinite(m)) {
    if (tid == 0) *out = best;
    return;
  }
  __syncthreads();  // every thread has read m before the weights overwrite it

  // 3. Weights (min-p applied), in place of the logits; how many are non-zero.
  sc_u64 c = 0;
  for (int i = tid; i < n; i += nt) {
    const unsigned v = sc_weight(x[i], m, t, min_w);
    w[i] = v;
    c += v ? 1ull : 0ull;
  }
  __syncthreads();
  const sc_u64 n_pos = sc_block_sum(c, sel.red);

  int lo, hi;
  sc_my_range(n, lo, hi);
  sc_u64 total;

  // 4. top-k: what ranks below the k-th weight becomes 0 (equal weights: the lower
  // ids stay).
  if (top_k > 0 && top_k < n_pos) {
    if (top_k <= SC_SMALL_K && top_k <= (unsigned)nt &&
        sc_small_top_k(w, n, top_k, top_p < 1.0f, top_p, bits, sel, out)) {
      return;
    }
    sc_u64 above, eq;
    const unsigned kappa = sc_select<false>(w, n, top_k, sel, above, eq);
    const sc_u64 take = top_k - above;
    if (eq > take) {
      sc_u64 cnt = 0;
      for (int i = lo; i < hi; ++i) cnt += w[i] == kappa ? 1ull : 0ull;
      sc_u64 before = sc_block_scan(cnt, sel.red, total);
      for (int i = lo; i < hi; ++i) {
        if (w[i] == kappa) {
          if (before >= take) w[i] = 0u;
          ++before;
        }
      }
      __syncthreads();
    }
    for (int i = tid; i < n; i += nt) {
      if (w[i] < kappa) w[i] = 0u;
    }
    __syncthreads();
  }

  // 5. top-p: the weight kp at which the rank's weights reach need; `above` is the
  // weight ranked above kp, `eqn` how many weights equal kp.
  const bool cut = top_p < 1.0f;
  unsigned kp = 0;
  sc_u64 need = 0, above = 0, eqn = 0;
  if (cut) {
    sc_u64 sum = 0;
    for (int i = tid; i < n; i += nt) sum += w[i];
    const sc_u64 s = sc_block_sum(sum, sel.red);
    const double cf = ceil(__dmul_rn((double)top_p, (double)s));
    const sc_u64 cap = s > 0 ? s : 1ull;
    need = cf <= 1.0 ? 1ull : (cf >= (double)cap ? cap : (sc_u64)cf);
    sc_u64 eq_mass;
    kp = sc_select<true>(w, n, need, sel, above, eq_mass);
    eqn = eq_mass;
  }

  // 6. The draw: the nucleus's weights in id order. A weight equal to kp is in while
  // the weight ranked before it (above, then the equal ones of lower id) is under need.
  sc_u64 eq_before = 0;
  if (cut && eqn > 1) {
    sc_u64 e = 0;
    for (int i = lo; i < hi; ++i) e += w[i] == kp ? (sc_u64)kp : 0ull;
    eq_before = sc_block_scan(e, sel.red, total);
  }
  sc_u64 mine = 0;
  {
    sc_u64 eb = eq_before;
    for (int i = lo; i < hi; ++i) {
      const unsigned v = w[i];
      if (v && sc_in_nucleus(v, cut, kp, above, need, eb)) mine += v;
    }
  }
  sc_u64 s_n;
  const sc_u64 base = sc_block_scan(mine, sel.red, s_n);
  if (s_n == 0) {
    if (tid == 0) *out = best;
    return;
  }
  const sc_u64 r = __umul64hi(bits, s_n);
  if (base <= r && r < base + mine) {
    sc_u64 acc = base, eb = eq_before;
    for (int i = lo; i < hi; ++i) {
      const unsigned v = w[i];
      if (v && sc_in_nucleus(v, cut, kp, above, need, eb)) {
        acc += v;
        if (r < acc) {
          *out = i;
          break;
        }
      }
    }
  }
}
