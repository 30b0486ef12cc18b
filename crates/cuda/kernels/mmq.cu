// The prompt GEMM: quantized weights × quantized activations on the int8 tensor cores,
// with every (row, token) bit-identical to the matvec kernels (quant.cu) and so to the
// CPU's quant::matvec: the canonical order (crates/quant/src/lib.rs) holds here too.
//
// How the canonical order survives a tiled GEMM:
// - Each sub-block's integer dot is one mma with K = 32 (two with K = 16 for Q6_K,
//   whose two 16-value halves have their own scales) started from a constant: exact
//   int32, however the tensor core sums it.
// - Its float contribution is the canonical sequence (sc_formats.cuh's sc_finish_*),
//   with each exact integer formed as an exact float instead (mq_finish).
// - Accumulator l (l = 0..31) takes sub-blocks l, l+32, ... in increasing order, and
//   the 32 accumulators are combined by the fixed tree (w = 16, 8, 4, 2, 1). Walking
//   the accumulators in bit-reversed order (0, 16, 8, 24, 4, ...) visits the tree's
//   leaves left to right, so each can be finished in turn and folded into a stack of
//   partial sums like a binary counter: leaf n merges with the stack as many times as
//   n has trailing one bits. Each addition is one of the tree's (addition is
//   commutative, so the operand order does not matter), and a thread keeps 6 floats
//   per output instead of 32. Empty leaves (l >= the row's sub-block count) are +0.0,
//   exactly as in the canonical sequence.
// - An even leaf and the odd leaf after it sum into two register banks, so the even
//   one is already in place when the odd one ends; the pair's sum then merges with
//   stack level 1 (registers) and levels 2-4 (shared memory), the depth a
//   compile-time case, so the fold is straight-line code.
//
// A block computes 64 weight rows × 32 tokens (4 warps of 16 rows, each 4 mma tiles of
// 8 tokens); K advances 4 sub-blocks per stage, in the leaf order above, through
// shared memory: each (row, sub-block) is decoded once per block into 32 signed bytes
// and its scales, each (token, sub-block) copied with its scale and sum.
//
// Tokens come from `Tile`s (quant.cu's struct): with `tiles`, unit u is tiles 4u..4u+3,
// which the host groups so that the four share one expert; without, unit u is tokens
// 32u..32u+31 of a dense product.

#include "sc_formats.cuh"
#include "scoria_math.cuh"

struct Tile {
  int expert;
  int n;
  int in_row[8];
  int out_row[8];
};

#define MQ_BM 64         // weight rows per block
#define MQ_BN 32         // tokens per block
#define MQ_KS 4          // sub-blocks per stage
#define MQ_MAX_SUB 512   // sub-blocks per row (16,384 columns); the host checks

// A row of 32 bytes in shared memory holds its two 16-byte halves swapped when bit 2
// of the row is set, so that the fragment reads of 8 rows × 4 words hit 32 banks.
__device__ __forceinline__ int mq_word(int row, int w) { return w ^ (((row >> 2) & 1) << 2); }

// A sub-block's scales: d, dmin, and two integer scales as floats (exact; Q4_K/Q5_K:
// sc, m; Q6_K: the two half scales; IQ4_XS: ls - 32).
struct MqScale {
  float d, dmin, a, b;
};
// The low-bit types' (sc_formats.cuh): D, E, the halves' multipliers as floats
// (exact), and Q2_K's halves' mins as four equal bytes each (the A operand of the mma
// that gives its min's integer ie = Σ emul·a).
struct MqScaleLb {
  float d, e, m0, m1;
  uint32_t e0, e1;
};
template <bool LB>
struct MqScaleSel {
  typedef MqScale T;
};
template <>
struct MqScaleSel<true> {
  typedef MqScaleLb T;
};
template <int TY>
using MqScaleOf = typename MqScaleSel<(TY >= SC_T_LOWBIT_FIRST)>::T;

// A low-bit sub-block: the weights of sc_formats.cuh's decoder, its scales as above.
template <int TY>
__device__ __forceinline__ void mq_decode_lb(const uint8_t* row, int s, uint32_t* q, MqScaleLb& p) {
  WLB w;
  sc_load_lb(TY, row, s, w);
  p.d = w.d;
  p.e = w.e;
  p.m0 = (float)w.m0;
  p.m1 = (float)w.m1;
  p.e0 = (uint32_t)w.e0 * 0x01010101u;
  p.e1 = (uint32_t)w.e1 * 0x01010101u;
#pragma unroll
  for (int i = 0; i < 8; i++) q[i] = w.q[i];
}

template <int TY>
__device__ __forceinline__ void mq_decode(const uint8_t* row, int s, uint32_t* q, MqScaleOf<TY>& p) {
  if constexpr (TY >= SC_T_LOWBIT_FIRST) {
    mq_decode_lb<TY>(row, s, q, p);
  } else {
  p.dmin = 0.0f;
  p.a = 0.0f;
  p.b = 0.0f;
  if constexpr (TY == SC_T_Q8_0) {
    WQ8_0 w;
    sc_load_q8_0(row, s, w);
    p.d = w.d;
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = w.q[i];
  } else if constexpr (TY == SC_T_Q4_0) {
    // (q - 8) as signed bytes: Σ (q - 8)·a is the same integer as sc_contrib_q4_0's.
    WQ4_0 w;
    sc_load_q4_0(row, s, w);
    p.d = w.d;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      q[i] = sc_vsub4(w.q[i] & 0x0f0f0f0fu, 0x08080808u);
      q[4 + i] = sc_vsub4((w.q[i] >> 4) & 0x0f0f0f0fu, 0x08080808u);
    }
  } else if constexpr (TY == SC_T_Q4_K || TY == SC_T_Q5_K) {
    WK w;
    if constexpr (TY == SC_T_Q4_K) {
      sc_load_q4_k(row, s, w);
    } else {
      sc_load_q5_k(row, s, w);
    }
    p.d = w.d;
    p.dmin = w.dmin;
    p.a = (float)w.sc;
    p.b = (float)w.m;
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = w.q[i];
  } else if constexpr (TY == SC_T_Q6_K) {
    WQ6_K w;
    sc_load_q6_k(row, s, w);
    p.d = w.d;
    p.a = (float)w.sc_lo;
    p.b = (float)w.sc_hi;
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = w.q[i];
  } else {
    WIQ4 w;
    sc_load_iq4_xs(row, s, w);
    p.d = w.d;
    p.a = (float)w.scale;
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = w.q[i];
  }
  }
}

// The mma accumulators start from SC_I2F_MAGIC (sc_formats.cuh), so a finished
// accumulator holds the bits of the float 1.5·2^23 + dot (exact: every sub-block dot
// here is below 2^22 in magnitude — Q8_0 and IQ4_XS 32·127·127, the others less), and
// sc_from_magic's one subtraction gives float(dot) exactly, with no conversion
// instruction.
// The contribution of one (row, token, sub-block) from its accumulator(s) (`hi`: Q6_K's
// second half). `asum` is the activation sum as a float (exact: |asum| <= 32·127).
// Each integer of the canonical sequence (crates/quant/src/lib.rs) is below 2^24, so
// a product or sum of exact floats that equals it is exact too: float(sc)·float(dot)
// is float(sc·dot), and so on. Only a zero's sign can differ from the integer route
// (0·-3 is -0.0), and it never shows: an accumulator starts at +0.0 and x + ±0 = x
// for every x but -0.0, which a sum that starts at +0.0 never reaches.
template <int TY>
__device__ __forceinline__ float mq_finish(const MqScale& p, int acc, int hi, float da, float asum) {
  const float dot = sc_from_magic(acc);
  if constexpr (TY == SC_T_Q4_K || TY == SC_T_Q5_K) {
    // c = (d * da) * is; c = fma(-(dmin * da), im, c)
    const float c = sc_mul(sc_mul(p.d, da), sc_mul(p.a, dot));
    return sc_fma(-sc_mul(p.dmin, da), sc_mul(p.b, asum), c);
  } else if constexpr (TY == SC_T_Q6_K) {
    // isum = sc_lo·dot_lo + sc_hi·dot_hi, one rounding of an exact value
    return sc_mul(sc_mul(p.d, da), sc_fma(p.a, dot, sc_mul(p.b, sc_from_magic(hi))));
  } else if constexpr (TY == SC_T_IQ4_XS) {
    return sc_mul(sc_mul(p.d, da), sc_mul(p.a, dot));
  } else {
    return sc_mul(sc_mul(p.d, da), dot);
  }
}

// The low-bit types' contribution (sc_formats.cuh's sequences) from the accumulators:
// `acc` the whole sub-block's dot or, for the types with a multiplier a half
// (SC_LB_HALVES, NVFP4 with them), the first half's, `hi` the second's; `mn` Q2_K's
// Σ emul·a. Each
// integer of the canonical sequence is below 2^24, so float products and sums of the
// exact floats here are that integer, exactly (is = fma(m0, lo, m1·hi): m1·hi is
// exact, and the fma rounds the exact is once, to itself); only a zero's sign can
// differ from the integer route, which never shows (see mq_finish).
template <int TY>
__device__ __forceinline__ float mq_finish_lb(const MqScaleLb& p, int acc, int hi, int mn, float da, float asum) {
  const float lo = sc_from_magic(acc);
  if constexpr (TY == SC_T_NVFP4) {
    // c = (D * da) * lo; c = fma(E * da, hi, c): the halves' own scales.
    return sc_fma(sc_mul(p.e, da), sc_from_magic(hi), sc_mul(sc_mul(p.d, da), lo));
  }
  float is;
  if constexpr (SC_LB_HALVES(TY)) {
    is = sc_fma(p.m0, lo, sc_mul(p.m1, sc_from_magic(hi)));
  } else {
    is = sc_mul(p.m0, lo);
  }
  // c = (D * da) * is
  const float c = sc_mul(sc_mul(p.d, da), is);
  if constexpr (TY == SC_T_Q4_1 || TY == SC_T_Q5_1) {
    return sc_fma(sc_mul(p.e, da), asum, c);  // c = fma(E * da, asum, c)
  } else if constexpr (TY == SC_T_Q2_K) {
    return sc_fma(sc_mul(p.e, da), sc_from_magic(mn), c);  // c = fma(E * da, ie, c)
  } else {
    return c;
  }
}

__device__ __forceinline__ void mq_mma_k32(int* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(SC_I2F_MAGIC));
#else
  __trap();
#endif
}

__device__ __forceinline__ void mq_mma_k16(int* c, uint32_t a0, uint32_t a1, uint32_t b0) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%7, %7, %7, %7};"
      : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
      : "r"(a0), "r"(a1), "r"(b0), "r"(SC_I2F_MAGIC));
#else
  __trap();
#endif
}

// Each thread's 16 outputs (4 token tiles × 4 values of the mma fragment).
typedef float MqOut[4][4];

// Stack levels 2-4 in shared memory, [level - 2][output][thread]: each is touched at
// most 8 times per output, and registers are better spent on more blocks per SM.
#define MQ_STACK_STRIDE (16 * 128)

// The end of odd leaf n, whose n >> 1 has T trailing one bits: the pair (even leaf in
// `ev`, odd in `od`) merges with levels 1..T and is stored at level T + 1; after leaf
// 31 (T = 4) `ev` holds each output's whole tree. Both banks restart from +0.0.
template <int T>
__device__ __forceinline__ void mq_fold(MqOut& ev, MqOut& od, MqOut& l1, float* st) {
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++) {
      float* so = st + (i * 4 + j) * 128;
      float v = sc_add(ev[i][j], od[i][j]);
      if constexpr (T == 0) {
        l1[i][j] = v;
      } else {
        v = sc_add(l1[i][j], v);
#pragma unroll
        for (int lvl = 2; lvl <= T; lvl++) v = sc_add(so[(lvl - 2) * MQ_STACK_STRIDE], v);
        if constexpr (T < 4) so[(T - 1) * MQ_STACK_STRIDE] = v;
      }
      ev[i][j] = T == 4 ? v : 0.0f;
      od[i][j] = 0.0f;
    }
}

template <int TY>
__device__ __forceinline__ void mq_body(const uint8_t* __restrict__ w, unsigned long long expert_bytes,
                                        unsigned long long row_bytes, int n_rows, int n_cols,
                                        const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                        const int* __restrict__ xs, int n_tok, const Tile* __restrict__ tiles,
                                        int n_tiles, float* __restrict__ out) {
  __shared__ __align__(16) uint32_t sw[MQ_KS][MQ_BM][8];
  __shared__ __align__(16) uint32_t sa[MQ_KS][MQ_BN][8];
  __shared__ MqScaleOf<TY> sp[MQ_KS][MQ_BM];
  __shared__ float sda[MQ_KS][MQ_BN];
  __shared__ float sas[MQ_KS][MQ_BN];  // activation sums as floats (exact)
  __shared__ short order[MQ_MAX_SUB];            // sub-block of each step, leaf by leaf
  __shared__ unsigned char pushes[MQ_MAX_SUB];   // leaves that end after this step
  __shared__ int in_row[MQ_BN], out_row[MQ_BN];
  __shared__ int s_expert;
  // The outputs' stack levels 2-4: [level - 2][output q of the thread][thread]
  // (dynamic, 24 KiB).
  extern __shared__ float mq_stack[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int n_sub = n_cols >> 5;
  const int r0 = blockIdx.x * MQ_BM;

  // The step order: leaf li (thread li) is accumulator l = bitrev5(li), whose
  // sub-blocks l, l+32, ... follow the leaves before it.
  if (tid < 32) {
    auto cnt = [&](int li) {
      const int l = (int)(__brev((unsigned)li) >> 27);
      return l < n_sub ? (n_sub - 1 - l) / 32 + 1 : 0;
    };
    int start = 0;
    for (int j = 0; j < tid; j++) start += cnt(j);
    const int c = cnt(tid);
    const int l = (int)(__brev((unsigned)tid) >> 27);
    for (int j = 0; j < c; j++) {
      order[start + j] = (short)(l + 32 * j);
      pushes[start + j] = 0;
    }
    if (c > 0) {
      // This leaf, then the empty ones right after it (leaf 0 is never empty).
      int np = 1;
      while (tid + np < 32 && cnt(tid + np) == 0) np++;
      pushes[start + c - 1] = (unsigned char)np;
    }
  }

  const int n_units = tiles ? (n_tiles + 3) / 4 : (n_tok + MQ_BN - 1) / MQ_BN;
  for (int u = blockIdx.y; u < n_units; u += gridDim.y) {
    __syncthreads();  // the order is written; the previous unit's rows are no longer read
    if (tid < MQ_BN) {
      int ir = -1, orow = -1;
      if (tiles) {
        const int ti = 4 * u + (tid >> 3), e = tid & 7;
        if (ti < n_tiles) {
          const Tile* tl = tiles + ti;
          if (e < tl->n) {
            ir = tl->in_row[e];
            orow = tl->out_row[e];
          }
        }
        if (tid == 0) s_expert = tiles[4 * u].expert;
      } else {
        const int tk = MQ_BN * u + tid;
        if (tk < n_tok) ir = orow = tk;
        if (tid == 0) s_expert = 0;
      }
      in_row[tid] = ir;
      out_row[tid] = orow;
    }
    __syncthreads();
    const uint8_t* wexp = w + (unsigned long long)s_expert * expert_bytes;

    // Even and odd leaves' sums, and stack level 1.
    MqOut ev, od, l1;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++) {
        ev[i][j] = 0.0f;
        od[i][j] = 0.0f;
      }
    int leaf = 0;  // the leaf the next step belongs to
    float* const st = mq_stack + tid;

    for (int k0 = 0; k0 < n_sub; k0 += MQ_KS) {
      __syncthreads();  // the previous stage is consumed
      // Weights: 4 sub-blocks × 64 rows, two (row, sub-block) per thread (unrolled,
      // so both reads are in flight at once).
#pragma unroll
      for (int it = 0; it < MQ_KS * MQ_BM / 128; it++) {
        const int item = tid + 128 * it;
        const int e = item / MQ_BM, r = item % MQ_BM;
        uint32_t q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        MqScaleOf<TY> p = {};
        if (k0 + e < n_sub && r0 + r < n_rows) {
          mq_decode<TY>(wexp + (unsigned long long)(r0 + r) * row_bytes, order[k0 + e], q, p);
        }
        uint4* dst = (uint4*)&sw[e][r][0];
        const int sw4 = mq_word(r, 0) >> 2;  // 1: halves swapped
        dst[sw4] = make_uint4(q[0], q[1], q[2], q[3]);
        dst[sw4 ^ 1] = make_uint4(q[4], q[5], q[6], q[7]);
        sp[e][r] = p;
      }
      // Activations: 4 sub-blocks × 32 tokens, one per thread.
      {
        const int item = tid;
        const int e = item / MQ_BN, j = item % MQ_BN;
        uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
        float da = 0.0f;
        int as = 0;
        if (k0 + e < n_sub && in_row[j] >= 0) {
          const size_t ab = (size_t)in_row[j] * n_sub + order[k0 + e];
          const uint4* src = (const uint4*)(xq + ab * 32);
          v0 = __ldg(src);
          v1 = __ldg(src + 1);
          da = __ldg(xd + ab);
          as = __ldg(xs + ab);
        }
        uint4* dst = (uint4*)&sa[e][j][0];
        const int sw4 = mq_word(j, 0) >> 2;
        dst[sw4] = v0;
        dst[sw4 ^ 1] = v1;
        sda[e][j] = da;
        sas[e][j] = (float)as;
      }
      __syncthreads();

      // One step: sub-block e's products, summed into the bank of the step's leaf.
      auto step = [&](int e, MqOut& acc) {
        const int wr = warp * 16 + g;
        // Rows wr and wr + 8 share bit 2, so one swizzle serves both.
        const int w0 = mq_word(wr, t4), w1 = mq_word(wr, 4 + t4);
        const uint32_t a0 = sw[e][wr][w0];
        const uint32_t a1 = sw[e][wr + 8][w0];
        const uint32_t a2 = sw[e][wr][w1];
        const uint32_t a3 = sw[e][wr + 8][w1];
        const MqScaleOf<TY> p0 = sp[e][wr], p1 = sp[e][wr + 8];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
          const int tr = nt * 8 + g;
          const uint32_t b0 = sa[e][tr][mq_word(tr, t4)];
          const uint32_t b1 = sa[e][tr][mq_word(tr, 4 + t4)];
          if constexpr (TY >= SC_T_LOWBIT_FIRST) {
            // Two K = 16 products for the types with a multiplier a half (as Q6_K);
            // Q2_K's min from one more, of its halves' mins.
            int c[4], h[4] = {SC_I2F_MAGIC, SC_I2F_MAGIC, SC_I2F_MAGIC, SC_I2F_MAGIC};
            int mn[4] = {SC_I2F_MAGIC, SC_I2F_MAGIC, SC_I2F_MAGIC, SC_I2F_MAGIC};
            if constexpr (SC_LB_HALVES(TY)) {
              mq_mma_k16(c, a0, a1, b0);
              mq_mma_k16(h, a2, a3, b1);
            } else {
              mq_mma_k32(c, a0, a1, a2, a3, b0, b1);
            }
            if constexpr (TY == SC_T_Q2_K) mq_mma_k32(mn, p0.e0, p1.e0, p0.e1, p1.e1, b0, b1);
            const int j0 = nt * 8 + 2 * t4;
            const float da0 = sda[e][j0], da1 = sda[e][j0 + 1];
            const float as0 = sas[e][j0], as1 = sas[e][j0 + 1];
            acc[nt][0] = sc_add(acc[nt][0], mq_finish_lb<TY>(p0, c[0], h[0], mn[0], da0, as0));
            acc[nt][1] = sc_add(acc[nt][1], mq_finish_lb<TY>(p0, c[1], h[1], mn[1], da1, as1));
            acc[nt][2] = sc_add(acc[nt][2], mq_finish_lb<TY>(p1, c[2], h[2], mn[2], da0, as0));
            acc[nt][3] = sc_add(acc[nt][3], mq_finish_lb<TY>(p1, c[3], h[3], mn[3], da1, as1));
          } else {
          int c[4], h[4] = {SC_I2F_MAGIC, SC_I2F_MAGIC, SC_I2F_MAGIC, SC_I2F_MAGIC};
          if constexpr (TY == SC_T_Q6_K) {
            mq_mma_k16(c, a0, a1, b0);
            mq_mma_k16(h, a2, a3, b1);
          } else {
            mq_mma_k32(c, a0, a1, a2, a3, b0, b1);
          }
          const int j0 = nt * 8 + 2 * t4;
          const float da0 = sda[e][j0], da1 = sda[e][j0 + 1];
          const float as0 = sas[e][j0], as1 = sas[e][j0 + 1];
          acc[nt][0] = sc_add(acc[nt][0], mq_finish<TY>(p0, c[0], h[0], da0, as0));
          acc[nt][1] = sc_add(acc[nt][1], mq_finish<TY>(p0, c[1], h[1], da1, as1));
          acc[nt][2] = sc_add(acc[nt][2], mq_finish<TY>(p1, c[2], h[2], da0, as0));
          acc[nt][3] = sc_add(acc[nt][3], mq_finish<TY>(p1, c[3], h[3], da1, as1));
          }
        }
      };
#pragma unroll 1
      for (int e = 0; e < MQ_KS && k0 + e < n_sub; e++) {
        if (leaf & 1) {
          step(e, od);
        } else {
          step(e, ev);
        }
        // Leaves that end here (this one, then the empty ones after it, whose sums
        // are the banks' +0.0): an even one stays in `ev`; an odd one folds the pair.
        const int np = pushes[k0 + e];
        for (int k = 0; k < np; k++, leaf++) {
          if (!(leaf & 1)) continue;
          switch (__ffs(~(leaf >> 1)) - 1) {
            case 0: mq_fold<0>(ev, od, l1, st); break;
            case 1: mq_fold<1>(ev, od, l1, st); break;
            case 2: mq_fold<2>(ev, od, l1, st); break;
            case 3: mq_fold<3>(ev, od, l1, st); break;
            default: mq_fold<4>(ev, od, l1, st); break;
          }
        }
      }
    }

    // `ev` holds each output's tree value.
    const int wr = r0 + warp * 16 + g;
#pragma unroll
    for (int nt = 0; nt < 4; nt++) {
      const int j0 = nt * 8 + 2 * t4;
#pragma unroll
      for (int q = 0; q < 4; q++) {
        const int r = wr + (q >> 1) * 8;
        const int o = out_row[j0 + (q & 1)];
        if (r < n_rows && o >= 0) out[(size_t)o * n_rows + r] = ev[nt][q];
      }
    }
  }
}

// 128 threads (the loads above assume it), 4 blocks per SM.
#define MQ_KERNEL(NAME, TY)                                                                            \
  extern "C" __global__ void __launch_bounds__(128, 4)                                               \
      NAME(const uint8_t* __restrict__ w, unsigned long long expert_bytes, unsigned long long row_bytes, \
           int n_rows, int n_cols, const int8_t* __restrict__ xq, const float* __restrict__ xd,      \
           const int* __restrict__ xs, int n_tok, const Tile* __restrict__ tiles, int n_tiles,       \
           float* __restrict__ out) { sc_pdl_enter();                                                                \
    mq_body<TY>(w, expert_bytes, row_bytes, n_rows, n_cols, xq, xd, xs, n_tok, tiles, n_tiles, out); \
  }

MQ_KERNEL(mmq_q8_0, SC_T_Q8_0)
MQ_KERNEL(mmq_q4_0, SC_T_Q4_0)
MQ_KERNEL(mmq_q4_k, SC_T_Q4_K)
MQ_KERNEL(mmq_q5_k, SC_T_Q5_K)
MQ_KERNEL(mmq_q6_k, SC_T_Q6_K)
MQ_KERNEL(mmq_iq4_xs, SC_T_IQ4_XS)
// The low-bit types: mmq_q2_k, ...
#define MQ_LB_KERNEL(CODE, NAME, LOAD, CONTRIB) MQ_KERNEL(mmq_##NAME, CODE)
SC_LOWBIT_TYPES(MQ_LB_KERNEL)
#undef MQ_LB_KERNEL
