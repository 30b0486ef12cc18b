// Sampling on the device: engine::sampler::sample_with, bit for bit. The definition
// (edits, integer weights, rank, top-k, min-p, top-p, the draw in id order) is in that
// module's docs; the CPU code and these kernels are two computations of it. Every sum
// is of integers, so no order has to agree; the only floats are the edits, (e − m) / T
// and sc_exp, written out as the CPU writes them; after them a row is integers only.
//
// A row is spread over the whole GPU: each kernel's grid is (blocks of the row's ids,
// rows), SC_SAMPLE_CHUNK ids a block, and the last block of a row to finish (an
// arrival counter in the row's scratch) does what needs the whole row. Four kernels,
// launched in this order on one stream:
//   sample_max     the edits; each block's argmax; the last block: greedy's answer and
//                  the largest value m (the token is written here for greedy and for
//                  rows without a finite candidate).
//   sample_weigh   the weights, in place of the logits, each block's sum and, when top-k
//                  or top-p cut, counts and masses per log-scale bucket (the CPU's
//                  weight_bucket); the last block finds the bucket where the cut falls.
//   sample_gather  the weights of that range of buckets into a candidate list; the last
//                  block ranks the list (radix select by weight, then by id among equal
//                  weights) to the member where top-k's count and top-p's mass are
//                  reached: the nucleus as (floor, last id, sum), like the CPU's Nucleus.
//                  A range with more than SC_SAMPLE_CAND weights (near-constant logits)
//                  is ranked from the weights in place, slower, the same answer.
//   sample_draw    each block's sum of the nucleus's weights; the last block finds the
//                  block where the draw falls and walks it in id order.

#include "sc_common.cuh"
#include "scoria_math.cuh"
#include "sc_argmax.cuh"

#define SC_SAMPLE_THREADS 512
// Ids per block (SC_SAMPLE_THREADS · 8: sample_draw's walk gives each thread 8).
#define SC_SAMPLE_CHUNK 4096
// Words of a row's parameters and of one edit (Gpu::sample_rows documents them).
#define SC_SAMPLE_PARAM_WORDS 10
#define SC_SAMPLE_EDIT_WORDS 4
// engine::sampler::rank's NUCLEUS_BUCKETS.
#define SC_BUCKETS 240
// Candidates a row's list holds.
#define SC_SAMPLE_CAND 32768
// A row's scratch (u32 words; ops/sample.rs has the same numbers): ScRow, the buckets'
// counts (u32) and masses (u64), then per block an ScPart, then the candidates.
#define SC_ROW_STATE_WORDS 64
#define SC_HC_OFF SC_ROW_STATE_WORDS
#define SC_HM_OFF (SC_HC_OFF + SC_BUCKETS)
#define SC_PART_OFF (SC_HM_OFF + 2 * SC_BUCKETS)

typedef unsigned long long sc_u64;

// What the kernels of one row tell each other.
struct ScRow {
  unsigned arrived[4];  // each kernel's arrival counter (back to 0 by its last block)
  unsigned done;        // sample_max wrote the token
  int best;
  float m;
  unsigned gather;      // sample_weigh: 1 when sample_gather ranks [lo, hi)
  unsigned topk;        // 1: the ranking takes top-k's member first
  unsigned n_cand;      // weights in [lo, hi)
  sc_u64 lo, hi;
  sc_u64 total;         // every weight's sum
  sc_u64 above;         // top-p alone: the mass of the buckets above lo
  sc_u64 need;          // top-p alone: ⌈top_p · total⌉
  unsigned floor, last_id;  // the nucleus (Nucleus in sampler/rank.rs)
  sc_u64 sum;
};
static_assert(sizeof(ScRow) <= SC_ROW_STATE_WORDS * 4, "ScRow outgrew its words");

struct ScPart {
  float v;  // sample_max: the block's largest value and its id
  int i;
  sc_u64 sum;  // sample_weigh, then sample_draw: the block's sum
};

// One row as a kernel sees it.
struct ScCtx {
  const unsigned* pr;  // its parameter words
  float* x;            // its logits, then its weights
  ScRow* st;
  unsigned* hc;
  sc_u64* hm;
  ScPart* part;
  uint2* cand;
  int nb;      // blocks of the row
  int lo, hi;  // this block's ids
};

__device__ __forceinline__ ScCtx sc_ctx(float* logits, int n, const unsigned* params, unsigned* scratch,
                                        int row_words) {
  ScCtx c;
  c.pr = params + (size_t)blockIdx.y * SC_SAMPLE_PARAM_WORDS;
  c.x = logits + (size_t)c.pr[0] * n;
  unsigned* base = scratch + (size_t)blockIdx.y * row_words;
  c.st = reinterpret_cast<ScRow*>(base);
  c.hc = base + SC_HC_OFF;
  c.hm = reinterpret_cast<sc_u64*>(base + SC_HM_OFF);
  c.part = reinterpret_cast<ScPart*>(base + SC_PART_OFF);
  c.nb = gridDim.x;
  c.cand = reinterpret_cast<uint2*>(base + SC_PART_OFF + 4 * c.nb);
  c.lo = blockIdx.x * SC_SAMPLE_CHUNK;
  c.hi = min(n, c.lo + SC_SAMPLE_CHUNK);
  return c;
}

// engine::sampler's weight of e (model::math::sample_weight), 0 below min_w.
__device__ __forceinline__ unsigned sc_weight(float e, float m, float t, unsigned min_w) {
  if (!isfinite(e)) return 0u;
  const float d = __fdiv_rn(__fsub_rn(e, m), t);
  if (!(d >= -22.0f)) return 0u;
  const unsigned w = __float2uint_rz(__fmul_rn(sc_exp(d), 2147483648.0f));
  return w < min_w ? 0u : w;
}

// engine::sampler's weight_bucket and bucket_floor.
__device__ __forceinline__ int sc_bucket(unsigned x) {
  if (x < 16u) return (int)x;
  const int shift = 28 - __clz(x);
  return 16 + (shift - 1) * 8 + (int)((x >> shift) & 7u);
}
__device__ __forceinline__ sc_u64 sc_bucket_floor(int b) {
  if (b < 16) return (sc_u64)b;
  return (sc_u64)((b - 16) % 8 + 8) << ((b - 16) / 8 + 1);
}

// sampler::top_p_need: ⌈top_p · total⌉ in f64, within 1..=total.
__device__ __forceinline__ sc_u64 sc_top_p_need(float top_p, sc_u64 total) {
  const double cf = ceil(__dmul_rn((double)top_p, (double)total));
  const sc_u64 cap = total > 0 ? total : 1ull;
  return cf <= 1.0 ? 1ull : (cf >= (double)cap ? cap : (sc_u64)cf);
}

// Block-wide sum (u64); every thread gets it. `red`: 32 shared words.
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
// the sum. `tot`: 33 shared words.
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

// Warp-aggregated additions to a shared histogram: lanes that hit one bin (b < nbins)
// add together; b = nbins: no bin. Called by whole warps. Weights are below 2^32: two
// 16-bit halves keep each warp sum in 32 bits.
__device__ __forceinline__ void sc_hist_add(unsigned b, unsigned nbins, unsigned x, unsigned* hc, sc_u64* hm) {
  const unsigned peers = __match_any_sync(SC_FULL, b);
  const bool leader = (threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1);
  if (b == nbins) return;
  // Every lane of the group takes part in its reductions.
  unsigned lo16 = 0, hi16 = 0;
  if (hm) {
    lo16 = __reduce_add_sync(peers, x & 0xffffu);
    hi16 = __reduce_add_sync(peers, x >> 16);
  }
  if (!leader) return;
  atomicAdd(&hc[b], (unsigned)__popc(peers));
  if (hm) atomicAdd(&hm[b], ((sc_u64)hi16 << 16) + lo16);
}

// ---------------------------------------------------------------- ranking one list

// Where a candidate list's members come from: the gathered list (`cand`, `n` of
// them, written by other blocks of this kernel: read through L2), or, when it
// overflowed, the row's weights in place with those outside [lo, hi) left out.
struct ScSrc {
  const uint2* cand;
  const unsigned* w;
  int n;
  sc_u64 lo, hi;
  __device__ __forceinline__ uint2 at(int i) const {
    if (cand) return __ldcg(cand + i);
    const unsigned x = w[i];
    return make_uint2(((sc_u64)x >= lo && (sc_u64)x < hi) ? x : 0u, (unsigned)i);
  }
};

// The member of the rank order (weight descending, then id ascending) at which a
// running quantity, from `above`, first reaches `target`: the count (mass false) or the
// weights' sum. Both running sums there come back, inclusive.
struct ScPick {
  unsigned w, id;
  sc_u64 cum_c, cum_m;
};

struct ScRank {
  unsigned hc[256];
  sc_u64 hm[256];
  sc_u64 red[33];
  unsigned mn[32], mx[32];
  unsigned dig;
  sc_u64 add_c, add_m;
};

// The block's least `lo` and largest `hi`; every thread gets them.
__device__ __forceinline__ void sc_block_min_max(unsigned& lo, unsigned& hi, ScRank& s) {
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(SC_FULL, lo, o));
    hi = max(hi, __shfl_xor_sync(SC_FULL, hi, o));
  }
  if ((threadIdx.x & 31) == 0) {
    s.mn[threadIdx.x >> 5] = lo;
    s.mx[threadIdx.x >> 5] = hi;
  }
  __syncthreads();
  for (int k = 0; k < (int)(blockDim.x >> 5); ++k) {
    lo = min(lo, s.mn[k]);
    hi = max(hi, s.mx[k]);
  }
  __syncthreads();
}

// One radix digit: with the histogram of this pass in s.hc/s.hm, the digit (descending
// when `desc`, else ascending) at which `acc` plus the quantity's bins reaches target;
// s.add_c/s.add_m get the bins before it. Warp 0: each lane sums 8 bins in order,
// lanes in order, and the lane where the target is reached walks its 8.
__device__ __forceinline__ void sc_pick_digit(bool desc, bool mass, sc_u64 acc, sc_u64 target, ScRank& s) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  auto bin = [&](int j) { return desc ? 255 - j : j; };  // the j-th bin in order
  sc_u64 qc = 0, qm = 0;
  for (int j = 8 * lane; j < 8 * lane + 8; ++j) {
    qc += s.hc[bin(j)];
    qm += s.hm[bin(j)];
  }
  sc_u64 pc = qc, pm = qm;  // inclusive prefix over lanes
  for (int o = 1; o < 32; o <<= 1) {
    const sc_u64 yc = __shfl_up_sync(SC_FULL, pc, o), ym = __shfl_up_sync(SC_FULL, pm, o);
    if (lane >= o) {
      pc += yc;
      pm += ym;
    }
  }
  const bool reached = acc + (mass ? pm : pc) >= target;
  const unsigned ballot = __ballot_sync(SC_FULL, reached);
  // Unreachable unless the caller's target exceeds the list: the last bin is taken
  // then, so that the ranking still ends (with a wrong member).
  const int at = ballot ? __ffs(ballot) - 1 : 31;
  if (lane == at) {
    sc_u64 c = pc - qc, m = pm - qm;
    int d = bin(8 * lane + 7);
    for (int j = 8 * lane; j < 8 * lane + 8; ++j) {
      const int b = bin(j);
      if (acc + (mass ? m + s.hm[b] : c + s.hc[b]) >= target) {
        d = b;
        break;
      }
      c += s.hc[b];
      m += s.hm[b];
    }
    s.dig = (unsigned)d;
    s.add_c = c;
    s.add_m = m;
  }
}


// Radix select over the members whose key `key(member, k)` defines (returns true),
// most significant digit first from the highest bit in which their keys differ, 8 bits
// a pass: returns the key at which the quantity (the count, or the weights' sum when
// `by_mass`), from above_c/above_m, reaches target, the keys ranked descending
// (`desc`) or ascending; above_c/above_m grow by the members ranked strictly before
// that key (above_m only when `keep_mass`), and `eq` gets how many members have it.
template <class Key>
__device__ unsigned sc_radix(const ScSrc& src, bool desc, bool by_mass, bool keep_mass, sc_u64 target,
                             sc_u64& above_c, sc_u64& above_m, sc_u64& eq, Key key, ScRank& s) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const int n_up = (src.n + 31) & ~31;
  unsigned lo = 0xffffffffu, hi = 0u;
  sc_u64 count = 0;
  for (int i = tid; i < src.n; i += nt) {
    unsigned k;
    if (key(src.at(i), k)) {
      lo = min(lo, k);
      hi = max(hi, k);
      ++count;
    }
  }
  sc_block_min_max(lo, hi, s);
  const unsigned diff = lo ^ hi;
  if (!diff) {
    // One key: every member has it.
    eq = sc_block_sum(count, s.red);
    return hi;
  }
  int bit = 31 - __clz(diff);  // the highest bit not yet fixed
  unsigned mask = bit >= 31 ? 0u : (0xffffffffu << (bit + 1));
  unsigned prefix = hi & mask;
  eq = 0;
  while (bit >= 0) {
    const int width = min(8, bit + 1), shift = bit + 1 - width;
    const unsigned dmask = (1u << width) - 1u;
    for (int d = tid; d < 256; d += nt) {
      s.hc[d] = 0;
      s.hm[d] = 0;
    }
    __syncthreads();
    for (int i = tid; i < n_up; i += nt) {
      const uint2 e = i < src.n ? src.at(i) : make_uint2(0u, 0u);
      unsigned k = 0;
      const bool in = i < src.n && key(e, k) && (k & mask) == prefix;
      sc_hist_add(in ? (k >> shift) & dmask : 256u, 256u, e.x, s.hc, keep_mass ? s.hm : nullptr);
    }
    __syncthreads();
    sc_pick_digit(desc, by_mass, by_mass ? above_m : above_c, target, s);
    __syncthreads();
    const unsigned d = s.dig;
    above_c += s.add_c;
    above_m += s.add_m;
    eq = s.hc[d];
    __syncthreads();
    prefix |= d << shift;
    mask |= dmask << shift;
    bit -= width;
  }
  return prefix;
}

// The rank's member at which the quantity reaches target (ScPick): first the weight
// kappa it has (radix select by weight, descending), then, of the members weighing
// kappa, how many the target takes (j) and the j-th lowest id among them.
__device__ ScPick sc_pick(const ScSrc& src, bool by_mass, sc_u64 target, sc_u64 above_c, sc_u64 above_m,
                          ScRank& s) {
  const int tid = threadIdx.x, nt = blockDim.x;
  sc_u64 eq;
  const unsigned kappa = sc_radix(
      src, true, by_mass, true, target, above_c, above_m, eq,
      [](uint2 e, unsigned& k) {
        k = e.x;
        return e.x != 0u;
      },
      s);
  // Members weighing kappa that reach the target: at least 1, at most eq (the
  // target lies in kappa's bin).
  sc_u64 j = by_mass ? (target - above_m + kappa - 1) / kappa : target - above_c;
  j = max(1ull, min(j, max(eq, 1ull)));
  const auto of_kappa = [kappa](uint2 e, unsigned& k) {
    k = e.y;
    return e.x == kappa;
  };
  unsigned id;
  if (j == 1) {
    // The lowest id weighing kappa.
    unsigned lo = 0xffffffffu, hi = 0u;
    for (int i = tid; i < src.n; i += nt) {
      unsigned k;
      if (of_kappa(src.at(i), k)) lo = min(lo, k);
    }
    sc_block_min_max(lo, hi, s);
    id = lo;
  } else {
    sc_u64 c = 0, m = 0, e2;
    id = sc_radix(src, false, false, false, j, c, m, e2, of_kappa, s);
  }
  return ScPick{kappa, id, above_c + j, above_m + j * kappa};
}

// ---------------------------------------------------------------- the kernels
// Each takes: logits (f32 rows of n), params (row b of the launch: words
// params[b·10 ..]: logits row, temperature (f32 bits), top_k (0 = off), top_p (f32
// bits; ≥ 1 = off), min_w, the draw's 64 random bits (low, high), the row's first
// edit, its edit count, and o: out_idx[o] gets the token), edits (e·4 ..: id, add,
// repeat, sub (f32 bits), at most one per id), out_idx, and the rows' scratch
// (`row_words` words a row of the launch, zero when first used; the kernels leave
// the counters at zero). A row's logits are overwritten with its weights (u32).
#define SC_SAMPLE_ARGS                                                                                  \
  float *__restrict__ logits, int n, const unsigned *__restrict__ params, const unsigned *__restrict__ edits, \
      int *__restrict__ out_idx, unsigned *__restrict__ scratch, int row_words

extern "C" __global__ void __launch_bounds__(SC_SAMPLE_THREADS) sample_max(SC_SAMPLE_ARGS) {
  sc_pdl_enter();
  const ScCtx c = sc_ctx(logits, n, params, scratch, row_words);
  const int tid = threadIdx.x, nt = blockDim.x;
  // 1. This block's edits: distinct ids, so no two threads touch one value.
  const unsigned e0 = c.pr[7], ne = c.pr[8];
  for (unsigned j = tid; j < ne; j += nt) {
    const unsigned* e = edits + (size_t)(e0 + j) * SC_SAMPLE_EDIT_WORDS;
    const unsigned id = e[0];
    if (id >= (unsigned)c.lo && id < (unsigned)c.hi) {
      const float rep = __uint_as_float(e[2]);
      float v = __fadd_rn(c.x[id], __uint_as_float(e[1]));
      if (rep != 1.0f) v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
      c.x[id] = __fsub_rn(v, __uint_as_float(e[3]));
    }
  }
  __syncthreads();
  // 2. The block's argmax.
  float bv;
  int bi;
  sc_range_best(c.x, c.lo, c.hi, bv, bi);
  if (tid == 0) {
    c.part[blockIdx.x].v = bv;
    c.part[blockIdx.x].i = bi;
  }
  if (!sc_last_block(&c.st->arrived[0], c.nb)) return;
  // 3. The row's argmax (0 when no value qualifies) and its value m: finite unless
  // there is no candidate or one is +inf, both the argmax's answer, as greedy's is.
  bv = -INFINITY;
  bi = SC_NO_INDEX;
  for (int b = tid; b < c.nb; b += nt) sc_better(bv, bi, __ldcg(&c.part[b].v), __ldcg(&c.part[b].i));
  sc_block_best(bv, bi);
  const int best = bi == SC_NO_INDEX ? 0 : bi;
  const bool done = __uint_as_float(c.pr[1]) <= 0.0f || !isfinite(bv);
  if (tid == 0) {
    c.st->done = done ? 1u : 0u;
    c.st->best = best;
    c.st->m = bv;
    c.st->gather = 0;
    c.st->n_cand = 0;
    if (done) out_idx[c.pr[9]] = best;
  }
  for (int b = tid; b < SC_BUCKETS; b += nt) {
    c.hc[b] = 0;
    c.hm[b] = 0;
  }
}

extern "C" __global__ void __launch_bounds__(SC_SAMPLE_THREADS) sample_weigh(SC_SAMPLE_ARGS) {
  sc_pdl_enter();
  const ScCtx c = sc_ctx(logits, n, params, scratch, row_words);
  if (__ldcg(&c.st->done)) return;
  const int tid = threadIdx.x, nt = blockDim.x;
  const float m = __ldcg(&c.st->m), t = __uint_as_float(c.pr[1]), top_p = __uint_as_float(c.pr[3]);
  const unsigned top_k = c.pr[2], min_w = c.pr[4];
  const bool hist = top_k > 0 || top_p < 1.0f;
  __shared__ unsigned s_hc[SC_BUCKETS];
  __shared__ sc_u64 s_hm[SC_BUCKETS];
  __shared__ sc_u64 red[33];
  for (int b = tid; b < SC_BUCKETS; b += nt) {
    s_hc[b] = 0;
    s_hm[b] = 0;
  }
  __syncthreads();
  // 1. The weights (min-p applied) in place of the logits, their sum and buckets.
  // Whole warps take each round (sc_hist_add).
  unsigned* w = reinterpret_cast<unsigned*>(c.x);
  const int span = c.hi - c.lo, span_up = (span + 31) & ~31;
  sc_u64 sum = 0;
  for (int j = tid; j < span_up; j += nt) {
    unsigned v = 0;
    if (j < span) {
      v = sc_weight(c.x[c.lo + j], m, t, min_w);
      w[c.lo + j] = v;
      sum += v;
    }
    if (hist) sc_hist_add(v ? (unsigned)sc_bucket(v) : SC_BUCKETS, SC_BUCKETS, v, s_hc, s_hm);
  }
  const sc_u64 block_sum = sc_block_sum(sum, red);
  if (tid == 0) c.part[blockIdx.x].sum = block_sum;
  if (hist) {
    for (int b = tid; b < SC_BUCKETS; b += nt) {
      if (s_hc[b]) {
        atomicAdd(&c.hc[b], s_hc[b]);
        atomicAdd(&c.hm[b], s_hm[b]);
      }
    }
  }
  if (!sc_last_block(&c.st->arrived[1], c.nb)) return;
  // 2. The row's sum; the bucket where the cut falls.
  sum = 0;
  for (int b = tid; b < c.nb; b += nt) sum += __ldcg(&c.part[b].sum);
  const sc_u64 total = sc_block_sum(sum, red);
  for (int b = tid; b < SC_BUCKETS; b += nt) {
    s_hc[b] = hist ? __ldcg(&c.hc[b]) : 0u;
    s_hm[b] = hist ? __ldcg(&c.hm[b]) : 0ull;
  }
  __syncthreads();
  if (tid != 0) return;
  ScRow* st = c.st;
  st->total = total;
  sc_u64 n_pos = 0;
  for (int b = 0; b < SC_BUCKETS; ++b) n_pos += s_hc[b];
  // Bucket 0 holds the zero weights, never counted; the walk stops at bucket 1 at the
  // latest, whose floor is 1 (sampler::nucleus's walk).
  if (top_k > 0 && top_k < n_pos) {
    // top-k's member is in the bucket where the count from the top reaches k: every
    // member weighs at least its floor, and fewer than k weights are heavier.
    sc_u64 acc = 0;
    int b = SC_BUCKETS - 1;
    for (; b > 1; --b) {
      if (acc + s_hc[b] >= top_k) break;
      acc += s_hc[b];
    }
    st->topk = 1;
    st->lo = sc_bucket_floor(b);
    st->hi = 1ull << 32;
    st->above = 0;
    st->gather = 1;
  } else if (top_p < 1.0f) {
    // top-p alone: the bucket where the mass from the top reaches need.
    const sc_u64 need = sc_top_p_need(top_p, total);
    sc_u64 acc = 0;
    int b = SC_BUCKETS - 1;
    for (; b > 1; --b) {
      if (acc + s_hm[b] >= need) break;
      acc += s_hm[b];
    }
    st->topk = 0;
    st->lo = sc_bucket_floor(b);
    st->hi = sc_bucket_floor(b + 1);
    st->above = acc;
    st->need = need;
    st->gather = 1;
  } else {
    // Every weight (top-k at or past the non-zero count keeps them all).
    st->floor = 0;
    st->last_id = 0xffffffffu;
    st->sum = total;
  }
}

extern "C" __global__ void __launch_bounds__(SC_SAMPLE_THREADS) sample_gather(SC_SAMPLE_ARGS) {
  sc_pdl_enter();
  const ScCtx c = sc_ctx(logits, n, params, scratch, row_words);
  if (__ldcg(&c.st->done) || !__ldcg(&c.st->gather)) return;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31;
  const sc_u64 lo = __ldcg(&c.st->lo), hi = __ldcg(&c.st->hi);
  const unsigned* w = reinterpret_cast<const unsigned*>(c.x);
  // 1. This block's weights in [lo, hi) appended to the list, a warp's at once.
  const int span = c.hi - c.lo, span_up = (span + 31) & ~31;
  for (int j = tid; j < span_up; j += nt) {
    const unsigned v = j < span ? w[c.lo + j] : 0u;
    const bool in = j < span && (sc_u64)v >= lo && (sc_u64)v < hi;
    const unsigned ballot = __ballot_sync(SC_FULL, in);
    if (!ballot) continue;
    const int leader = __ffs(ballot) - 1;
    unsigned base = 0;
    if (lane == leader) base = atomicAdd(&c.st->n_cand, (unsigned)__popc(ballot));
    base = __shfl_sync(SC_FULL, base, leader);
    const unsigned slot = base + __popc(ballot & ((1u << lane) - 1u));
    if (in && slot < SC_SAMPLE_CAND) c.cand[slot] = make_uint2(v, (unsigned)(c.lo + j));
  }
  if (!sc_last_block(&c.st->arrived[2], c.nb)) return;
  // 2. The nucleus from the list (or from the weights in place when it overflowed).
  __shared__ ScRank rank;
  const unsigned n_cand = __ldcg(&c.st->n_cand);
  ScSrc src;
  src.lo = lo;
  src.hi = hi;
  if (n_cand <= SC_SAMPLE_CAND) {
    src.cand = c.cand;
    src.w = nullptr;
    src.n = (int)n_cand;
  } else {
    src.cand = nullptr;
    src.w = w;
    src.n = n;
  }
  const float top_p = __uint_as_float(c.pr[3]);
  ScPick p;
  if (__ldcg(&c.st->topk)) {
    // top-k's member (the list holds every weight ranked at or above it), then
    // top-p's among the k: need is of their sum, so its member ranks at or above.
    p = sc_pick(src, false, c.pr[2], 0, 0, rank);
    if (top_p < 1.0f) p = sc_pick(src, true, sc_top_p_need(top_p, p.cum_m), 0, 0, rank);
  } else {
    p = sc_pick(src, true, __ldcg(&c.st->need), 0, __ldcg(&c.st->above), rank);
  }
  if (tid == 0) {
    c.st->floor = p.w;
    c.st->last_id = p.id;
    c.st->sum = p.cum_m;
  }
}

static_assert(SC_SAMPLE_CHUNK == SC_SAMPLE_THREADS * 8, "sample_draw's walk takes 8 ids a thread");

extern "C" __global__ void __launch_bounds__(SC_SAMPLE_THREADS) sample_draw(SC_SAMPLE_ARGS) {
  sc_pdl_enter();
  const ScCtx c = sc_ctx(logits, n, params, scratch, row_words);
  if (__ldcg(&c.st->done)) return;
  const int tid = threadIdx.x, nt = blockDim.x;
  __shared__ sc_u64 red[33];
  __shared__ int s_blk;
  __shared__ sc_u64 s_r;
  const unsigned fl = __ldcg(&c.st->floor), last = __ldcg(&c.st->last_id);
  const sc_u64 s_n = __ldcg(&c.st->sum);
  const unsigned* w = reinterpret_cast<const unsigned*>(c.x);
  // The nucleus (sampler/rank.rs's Nucleus::weight): every weight above the floor, and of
  // those equal to it the ids up to last.
  const auto kept = [fl, last](int i, unsigned x) -> sc_u64 {
    return (x > fl || (x == fl && (unsigned)i <= last)) ? x : 0u;
  };
  // 1. This block's sum of the nucleus.
  sc_u64 sum = 0;
  for (int i = c.lo + tid; i < c.hi; i += nt) sum += kept(i, w[i]);
  const sc_u64 block_sum = sc_block_sum(sum, red);
  if (tid == 0) c.part[blockIdx.x].sum = block_sum;
  if (!sc_last_block(&c.st->arrived[3], c.nb)) return;
  // 2. The draw r = ⌊bits · s_n / 2^64⌋; the block whose sums hold it, in id order.
  int* const out = out_idx + c.pr[9];
  const int best = __ldcg(&c.st->best);
  if (s_n == 0) {
    if (tid == 0) *out = best;
    return;
  }
  const sc_u64 bits = (sc_u64)c.pr[5] | ((sc_u64)c.pr[6] << 32);
  const sc_u64 r = __umul64hi(bits, s_n);
  if (tid == 0) s_blk = -1;
  sc_u64 before = 0;
  for (int b0 = 0; b0 < c.nb; b0 += nt) {
    const int b = b0 + tid;
    const sc_u64 v = b < c.nb ? __ldcg(&c.part[b].sum) : 0ull;
    sc_u64 round;
    const sc_u64 ex = before + sc_block_scan(v, red, round);
    if (b < c.nb && ex <= r && r < ex + v) {
      s_blk = b;
      s_r = r - ex;
    }
    before += round;
  }
  __syncthreads();
  const int blk = s_blk;
  if (blk < 0) {
    // Unreachable: the blocks' sums add up to s_n.
    if (tid == 0) *out = best;
    return;
  }
  // 3. The walk inside that block: 8 ids a thread, threads in id order.
  const int lo = blk * SC_SAMPLE_CHUNK + tid * 8, hi = min(n, lo + 8);
  sc_u64 mine = 0;
  for (int i = lo; i < hi; ++i) mine += kept(i, w[i]);
  sc_u64 all;
  const sc_u64 base = sc_block_scan(mine, red, all);
  const sc_u64 rr = s_r;
  if (base <= rr && rr < base + mine) {
    sc_u64 acc = base;
    for (int i = lo; i < hi; ++i) {
      acc += kept(i, w[i]);
      if (rr < acc) {
        *out = i;
        break;
      }
    }
  }
}
