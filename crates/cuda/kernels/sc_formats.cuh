// The block formats on the GPU: one 32-value sub-block of a weight row decoded into
// 32 signed bytes (as 8 little-endian words, dp4a-ready) plus its scales, and the
// sub-block's float contribution against one activation block, exactly as
// crates/quant/src/lib.rs defines it (the canonical order, invariant 1). Also the
// per-element dequantization of crates/quant/src/formats.rs (embeddings).
//
// Layouts are ggml's (crates/quant/src/formats.rs). Integer parts are exact, so how
// they are computed is free (dp4a, byte tricks); the float sequence per sub-block is
// fixed and spelled out with sc_mul / sc_add / sc_fma.
//
// Alignment each load needs (the host checks the row base): Q4_K, Q5_K: 16 bytes;
// IQ4_XS: 8; Q8_0, Q4_0, Q6_K, F16, BF16: 2; F32: 4. Activation blocks (ActQ8.qs): 16.
// The low-bit types: Q2_K, Q4_1, Q5_1, IQ1_M, NVFP4: 4; MXFP4: 1 (17-byte blocks);
// the others 2.
#pragma once

#include "sc_common.cuh"

// Type codes shared with the host (crates/cuda/src/kernels.rs, `type_code`).
#define SC_T_F32 0
#define SC_T_F16 1
#define SC_T_BF16 2
#define SC_T_Q8_0 3
#define SC_T_Q4_0 4
#define SC_T_Q4_K 5
#define SC_T_Q5_K 6
#define SC_T_Q6_K 7
#define SC_T_IQ4_XS 8
// The low-bit types (crates/quant/src/lowbit.rs), in the order of quant::SUPPORTED.
#define SC_T_Q2_K 9
#define SC_T_Q3_K 10
#define SC_T_Q4_1 11
#define SC_T_Q5_0 12
#define SC_T_Q5_1 13
#define SC_T_IQ4_NL 14
#define SC_T_MXFP4 15
#define SC_T_TQ1_0 16
#define SC_T_TQ2_0 17
#define SC_T_IQ2_XXS 18
#define SC_T_IQ2_XS 19
#define SC_T_IQ2_S 20
#define SC_T_IQ3_XXS 21
#define SC_T_IQ3_S 22
#define SC_T_IQ1_S 23
#define SC_T_IQ1_M 24
#define SC_T_NVFP4 25
// The first and last low-bit code: their kernels are their own (see the low-bit
// section below).
#define SC_T_LOWBIT_FIRST SC_T_Q2_K
#define SC_T_LOWBIT_LAST SC_T_NVFP4

SC_HD uint8_t sc_ld8(const uint8_t* p) {
#ifdef SC_DEVICE_CODE
  return __ldg(p);
#else
  return *p;
#endif
}

// 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block whose 12 scale
// bytes are the words s0 (bytes 0..3), s1 (4..7), s2 (8..11). Same as
// quant::formats::k_scale_min.
SC_HD void sc_k_scale_min(uint32_t s0, uint32_t s1, uint32_t s2, int j, int& sc, int& m) {
  const uint64_t lo = (uint64_t)s0 | ((uint64_t)s1 << 32);  // bytes 0..7
  if (j < 4) {
    sc = (int)((lo >> (8 * j)) & 63);
    m = (int)((lo >> (8 * (j + 4))) & 63);
  } else {
    const uint32_t hi = (s2 >> (8 * (j - 4))) & 0xff;       // byte j + 4
    const uint32_t below = (uint32_t)(lo >> (8 * (j - 4))) & 0xff;  // byte j - 4
    const uint32_t at = (uint32_t)(lo >> (8 * j)) & 0xff;           // byte j
    sc = (int)((hi & 0xf) | ((below >> 6) << 4));
    m = (int)((hi >> 4) | ((at >> 6) << 4));
  }
}

// ------------------------------------------------------- the float sequences
// A sub-block's contribution from its exact integer parts: the float operations of
// the canonical order, written once here and used by the matvec (dp4a) and the
// prompt GEMM (tensor cores) alike.
//
// Q8_0, Q4_0, Q6_K, IQ4_XS: c = (d * da) * isum
SC_HD float sc_finish_d(float d, float da, int isum) { return sc_mul(sc_mul(d, da), sc_i2f(isum)); }
// int -> f32 for |v| <= 2^22, exactly, with two full-rate operations instead of the
// quarter-rate conversion: SC_I2F_MAGIC (the bits of 1.5·2^23) plus v are the bits of
// the float 1.5·2^23 + v (its ulp is 1 and the mantissa stays in range), and
// subtracting 1.5·2^23 is exact (sc_from_magic). The prompt GEMM starts its integer
// accumulators from SC_I2F_MAGIC to the same end.
#define SC_I2F_MAGIC 0x4B400000
#if defined(__CUDACC__)
__device__ __forceinline__ float sc_from_magic(int bits) { return __fsub_rn(__int_as_float(bits), 12582912.0f); }
#endif
SC_HD float sc_i2f_small(int v) {
#ifdef SC_DEVICE_CODE
  return sc_from_magic(SC_I2F_MAGIC + v);
#else
  return (float)v;
#endif
}
// Q4_K, Q5_K: is = sc·dot, im = m·asum; c = (d * da) * is; c = fma(-(dmin * da), im, c)
// `four_bit` (Q4_K: |is| <= 63·32·15·127 < 2^22, |im| <= 63·32·127) converts with
// sc_i2f_small; Q5_K's is may reach 63·32·31·127 and takes sc_i2f. Both are exact.
SC_HD float sc_finish_k(float d, float dmin, int sc, int m, float da, int asum, int dot, bool four_bit) {
  const int is = sc * dot;
  const int im = m * asum;
  const float c = sc_mul(sc_mul(d, da), four_bit ? sc_i2f_small(is) : sc_i2f(is));
  return sc_fma(-sc_mul(dmin, da), sc_i2f_small(im), c);
}

// ------------------------------------------------------------------------ Q8_0
// Block of 34 bytes: d (f16), 32 int8. One block is one sub-block.
struct WQ8_0 {
  float d;
  uint32_t q[8];
};
SC_HD void sc_load_q8_0(const uint8_t* row, int s, WQ8_0& w) {
  const uint8_t* blk = row + 34 * (size_t)s;
  w.d = sc_f16_to_f32(sc_ld16(blk));
  sc_ld_words<8>(blk + 2, w.q);
}
// c = (d * da) * isum
SC_HD float sc_contrib_q8_0(const WQ8_0& w, const uint32_t* a, float da, int asum) {
  (void)asum;
  int isum = 0;
#pragma unroll
  for (int i = 0; i < 8; i++) isum = sc_dp4a(w.q[i], a[i], isum);
  return sc_finish_d(w.d, da, isum);
}

// ------------------------------------------------------------------------ Q4_0
// Block of 18 bytes: d (f16), 16 bytes; byte j holds element j (low nibble) and
// element j + 16 (high nibble); value = nibble - 8.
struct WQ4_0 {
  float d;
  uint32_t q[4];  // the raw 16 bytes
};
SC_HD void sc_load_q4_0(const uint8_t* row, int s, WQ4_0& w) {
  const uint8_t* blk = row + 18 * (size_t)s;
  w.d = sc_f16_to_f32(sc_ld16(blk));
  sc_ld_words<4>(blk + 2, w.q);
}
// isum = Σ (q - 8)·a = Σ q·a - 8·asum (exact); c = (d * da) * isum
SC_HD float sc_contrib_q4_0(const WQ4_0& w, const uint32_t* a, float da, int asum) {
  int raw = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    raw = sc_dp4a(w.q[i] & 0x0f0f0f0fu, a[i], raw);
    raw = sc_dp4a((w.q[i] >> 4) & 0x0f0f0f0fu, a[4 + i], raw);
  }
  return sc_finish_d(w.d, da, raw - 8 * asum);
}

// ------------------------------------------------------------------ Q4_K, Q5_K
// Q4_K block of 144 bytes: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes
// of nibbles: 32-byte chunk c holds sub-block 2c (low nibbles) and 2c+1 (high).
// Q5_K block of 176 bytes: the same header, qh (32 bytes: bit j of byte l is the
// fifth bit of element l of sub-block j) at 16, the nibbles at 48.
struct WK {
  float d, dmin;
  int sc, m;
  uint32_t q[8];  // values 0..15 / 0..31
  bool four_bit;  // Q4_K (a constant once inlined)
};
SC_HD void sc_load_q4_k(const uint8_t* row, int s, WK& w) {
  w.four_bit = true;
  const int j = s & 7;
  const uint8_t* blk = row + 144 * (size_t)(s >> 3);
  uint32_t h[4];
  sc_ld128(blk, h);
  w.d = sc_f16_to_f32((uint16_t)(h[0] & 0xffff));
  w.dmin = sc_f16_to_f32((uint16_t)(h[0] >> 16));
  sc_k_scale_min(h[1], h[2], h[3], j, w.sc, w.m);
  uint32_t raw[8];
  const uint8_t* qs = blk + 16 + 32 * (j >> 1);
  sc_ld128(qs, raw);
  sc_ld128(qs + 16, raw + 4);
  const int sh = 4 * (j & 1);
#pragma unroll
  for (int i = 0; i < 8; i++) w.q[i] = (raw[i] >> sh) & 0x0f0f0f0fu;
}
SC_HD void sc_load_q5_k(const uint8_t* row, int s, WK& w) {
  w.four_bit = false;
  const int j = s & 7;
  const uint8_t* blk = row + 176 * (size_t)(s >> 3);
  uint32_t h[4];
  sc_ld128(blk, h);
  w.d = sc_f16_to_f32((uint16_t)(h[0] & 0xffff));
  w.dmin = sc_f16_to_f32((uint16_t)(h[0] >> 16));
  sc_k_scale_min(h[1], h[2], h[3], j, w.sc, w.m);
  uint32_t qh[8], raw[8];
  sc_ld128(blk + 16, qh);
  sc_ld128(blk + 32, qh + 4);
  const uint8_t* qs = blk + 48 + 32 * (j >> 1);
  sc_ld128(qs, raw);
  sc_ld128(qs + 16, raw + 4);
  const int sh = 4 * (j & 1);
#pragma unroll
  for (int i = 0; i < 8; i++) {
    w.q[i] = ((raw[i] >> sh) & 0x0f0f0f0fu) | (((qh[i] >> j) & 0x01010101u) << 4);
  }
}
// is = sc·Σ q·a, im = m·asum; c = (d * da) * is; c = fma(-(dmin * da), im, c)
SC_HD float sc_contrib_k(const WK& w, const uint32_t* a, float da, int asum) {
  int isum = 0;
#pragma unroll
  for (int i = 0; i < 8; i++) isum = sc_dp4a(w.q[i], a[i], isum);
  return sc_finish_k(w.d, w.dmin, w.sc, w.m, da, asum, isum, w.four_bit);
}

// ------------------------------------------------------------------------ Q6_K
// Block of 210 bytes (2-byte aligned only): ql[128], qh[64], 16 int8 scales (one per
// 16 values), d (f16) at 208. Element 32·jj + l (jj = 0..3, l = 0..31) of half h:
// ql[64h + l + 32(jj&1)] nibble (jj>>1), qh[32h + l] bits 2jj..2jj+1; value - 32.
struct WQ6_K {
  float d;
  int sc_lo, sc_hi;
  uint32_t q[8];  // values -32..31 as signed bytes
};
SC_HD void sc_load_q6_k(const uint8_t* row, int s, WQ6_K& w) {
  const int j = s & 7;
  const int h = j >> 2, jj = j & 3;
  const uint8_t* blk = row + 210 * (size_t)(s >> 3);
  uint32_t ql[8], qh[8];
  sc_ld_words<8>(blk + 64 * h + 32 * (jj & 1), ql);
  sc_ld_words<8>(blk + 128 + 32 * h, qh);
  const uint16_t scw = sc_ld16(blk + 192 + 2 * j);
  w.sc_lo = (int)(int8_t)(uint8_t)(scw & 0xff);
  w.sc_hi = (int)(int8_t)(uint8_t)(scw >> 8);
  w.d = sc_f16_to_f32(sc_ld16(blk + 208));
  const int nsh = 4 * (jj >> 1), hsh = 2 * jj;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const uint32_t u = ((ql[i] >> nsh) & 0x0f0f0f0fu) | (((qh[i] >> hsh) & 0x03030303u) << 4);
    w.q[i] = sc_vsub4(u, 0x20202020u);
  }
}
// The two 16-value halves' dots of a sub-block: lo = Σ_{i<16} q·a, hi = Σ_{i≥16} q·a
// (q, a: 8 words of signed bytes, words 0..3 the first half).
SC_HD void sc_dot_halves(const uint32_t* q, const uint32_t* a, int& lo, int& hi) {
  lo = 0;
  hi = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    lo = sc_dp4a(q[i], a[i], lo);
    hi = sc_dp4a(q[4 + i], a[4 + i], hi);
  }
}
// isum = sc_lo·Σ_{i<16} q·a + sc_hi·Σ_{i≥16} q·a; c = (d * da) * isum
SC_HD float sc_contrib_q6_k(const WQ6_K& w, const uint32_t* a, float da, int asum) {
  (void)asum;
  int lo, hi;
  sc_dot_halves(w.q, a, lo, hi);
  return sc_finish_d(w.d, da, w.sc_lo * lo + w.sc_hi * hi);
}

// ---------------------------------------------------------------------- IQ4_XS
// Block of 136 bytes: d (f16), scales_h (u16), scales_l[4], qs[128]: sub-block j's
// 16 bytes at 8 + 16j, low nibble = element l, high = element l + 16, each an index
// into the 16 non-uniform levels.
// The levels of KVALUES_IQ4NL as int8 bytes, four to a word (little-endian).
#define SC_IQ4_T0 0xBFAD9881u /* -127, -104, -83, -65 */
#define SC_IQ4_T1 0xF6EADDCFu /*  -49,  -35, -22, -10 */
#define SC_IQ4_T2 0x26190D01u /*    1,   13,  25,  38 */
#define SC_IQ4_T3 0x71594535u /*   53,   69,  89, 113 */

// Four nibble indices (one per byte, 0..15) -> their four levels (signed bytes).
SC_HD uint32_t sc_iq4_lut(uint32_t n) {
  const uint32_t sel = (n & 0x7u) | ((n >> 4) & 0x70u) | ((n >> 8) & 0x700u) | ((n >> 12) & 0x7000u);
  const uint32_t lo = sc_byte_perm(SC_IQ4_T0, SC_IQ4_T1, sel);
  const uint32_t hi = sc_byte_perm(SC_IQ4_T2, SC_IQ4_T3, sel);
  const uint32_t m = ((n >> 3) & 0x01010101u) * 0xffu;  // 0xff in bytes whose index >= 8
  return (hi & m) | (lo & ~m);
}

struct WIQ4 {
  float d;
  int scale;      // ls - 32
  uint32_t q[8];  // levels; words 0..3 elements 0..15, words 4..7 elements 16..31
};
SC_HD void sc_load_iq4_xs(const uint8_t* row, int s, WIQ4& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 136 * (size_t)(s >> 3);
  uint32_t h0, h1;
  sc_ld64(blk, h0, h1);
  w.d = sc_f16_to_f32((uint16_t)(h0 & 0xffff));
  const uint32_t scales_h = h0 >> 16;
  const int ls = (int)(((h1 >> (4 * j)) & 0xf) | (((scales_h >> (2 * j)) & 3) << 4));
  w.scale = ls - 32;
  uint32_t raw[4];
  sc_ld64(blk + 8 + 16 * j, raw[0], raw[1]);
  sc_ld64(blk + 16 + 16 * j, raw[2], raw[3]);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    w.q[i] = sc_iq4_lut(raw[i] & 0x0f0f0f0fu);
    w.q[4 + i] = sc_iq4_lut((raw[i] >> 4) & 0x0f0f0f0fu);
  }
}
// isum = (ls - 32)·Σ K[q]·a; c = (d * da) * isum
SC_HD float sc_contrib_iq4_xs(const WIQ4& w, const uint32_t* a, float da, int asum) {
  (void)asum;
  int raw = 0;
#pragma unroll
  for (int i = 0; i < 8; i++) raw = sc_dp4a(w.q[i], a[i], raw);
  return sc_finish_d(w.d, da, w.scale * raw);
}

// ================================================================= the low-bit types
// Q2_K, Q3_K, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, TQ1_0, TQ2_0, IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, NVFP4 (layouts: crates/quant/src/lowbit.rs). Each sub-block
// decodes into the canonical integer form of crates/quant/src/lib.rs: a signed byte
// weight w per value, an integer multiplier per 16-value half (mul_0, mul_1), the float
// scale D and, with a minimum, E (and for Q2_K the halves' integer mins). Against an
// activation block (a, da, asum):
//   is = mul_0·Σ_{i<16} w·a + mul_1·Σ_{i≥16} w·a            (exact; |is| < 2^23)
//   c  = (D * da) * is
//   Q4_1, Q5_1: c = fma(E * da, asum, c)
//   Q2_K:       c = fma(E * da, emul_0·Σ_{i<16} a + emul_1·Σ_{i≥16} a, c)
//   NVFP4 (mul = 1, 0; E the second half's own scale): c = fma(E * da, Σ_{i≥16} w·a, c)

// The codebooks (generated from the quant crate's: build.rs), read through the
// read-only cache on the GPU: the lanes of a warp look up different rows, which
// constant memory would serve one address at a time.
#if defined(__CUDACC__)
#define SC_TABLE __device__ const
#else
#define SC_TABLE static const
#endif
#include "sc_grids.cuh"

struct WLB {
  float d;        // D
  float e;        // E (Q2_K: -dmin; Q4_1, Q5_1: m; NVFP4: the second half's scale)
  int m0, m1;     // the halves' multipliers
  int e0, e1;     // Q2_K: the halves' mins
  uint32_t q[8];  // w as signed bytes; words 0..3 values 0..15, words 4..7 values 16..31
};

// N little-endian words at a 4-byte aligned p.
template <int N>
SC_HD void sc_ld_w32(const uint8_t* p, uint32_t* w) {
#pragma unroll
  for (int i = 0; i < N; i++) w[i] = sc_ld32(p + 4 * i);
}

SC_HD int sc_popc(uint32_t v) {
#ifdef SC_DEVICE_CODE
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

SC_HD float sc_bits_f32(uint32_t b) {
#ifdef SC_DEVICE_CODE
  return __uint_as_float(b);
#else
  float f;
  memcpy(&f, &b, 4);
  return f;
#endif
}

// Bits 0..3 of x as the bytes 0/1 of a word (bit i -> byte i).
SC_HD uint32_t sc_bits_to_bytes(uint32_t x) { return ((x & 0xfu) * 0x00204081u) & 0x01010101u; }
// Four codebook bytes (each 1..127) negated where bits 0..3 of s are set (bit i: byte i).
SC_HD uint32_t sc_signed4(uint32_t v, uint32_t s) {
  const uint32_t m = sc_bits_to_bytes(s) * 0xffu;
  return sc_vsub4(v ^ m, m);  // (v ^ 0xff) - 0xff = -v in a byte; v where m is 0
}
// The eight sign bits of a 7-bit index of IQ2_XXS / IQ3_XXS: the eighth makes the
// count of set bits even (quant's ksigns).
SC_HD uint32_t sc_ksigns(uint32_t i) {
  i &= 0x7fu;
  return i | ((uint32_t)(sc_popc(i) & 1) << 7);
}
// An 8-value codebook row (two words).
SC_HD void sc_grid8(const uint32_t (*tab)[2], int idx, uint32_t& lo, uint32_t& hi) {
#ifdef SC_DEVICE_CODE
  const uint2 v = __ldg((const uint2*)tab[idx]);
  lo = v.x;
  hi = v.y;
#else
  lo = tab[idx][0];
  hi = tab[idx][1];
#endif
}
SC_HD uint32_t sc_grid4(const uint32_t* tab, int idx) {
#ifdef SC_DEVICE_CODE
  return __ldg(tab + idx);
#else
  return tab[idx];
#endif
}
// Four IQ1 codebook bytes (-1, 0, +1) as 8·grid + δ, δ = -1 when `neg`, else +1.
SC_HD uint32_t sc_iq1_word(uint32_t v, bool neg) {
  const uint32_t g8 = (v << 3) & 0xf8f8f8f8u;  // 8·grid per byte (0xf8 = -8)
  return neg ? sc_vsub4(g8, 0x01010101u) : g8 + 0x01010101u;  // no byte carries
}
// Byte k of w.
SC_HD uint32_t sc_byte(uint32_t w, int k) { return (w >> (8 * k)) & 0xffu; }

// Four nibble indices (one per byte, 0..15) -> bytes of the 16-entry table T0..T3
// (four bytes a word), as sc_iq4_lut does it for IQ4_XS's table.
SC_HD uint32_t sc_lut16(uint32_t n, uint32_t t0, uint32_t t1, uint32_t t2, uint32_t t3) {
  const uint32_t sel = (n & 0x7u) | ((n >> 4) & 0x70u) | ((n >> 8) & 0x700u) | ((n >> 12) & 0x7000u);
  const uint32_t lo = sc_byte_perm(t0, t1, sel);
  const uint32_t hi = sc_byte_perm(t2, t3, sel);
  const uint32_t m = ((n >> 3) & 0x01010101u) * 0xffu;
  return (hi & m) | (lo & ~m);
}
// The MXFP4 (e2m1) levels doubled (quant's KVALUES_MXFP4): 0 1 2 3 4 6 8 12, negated.
#define SC_MXFP4_T0 0x03020100u /*   0,  1,  2,   3 */
#define SC_MXFP4_T1 0x0C080604u /*   4,  6,  8,  12 */
#define SC_MXFP4_T2 0xFDFEFF00u /*   0, -1, -2,  -3 */
#define SC_MXFP4_T3 0xF4F8FAFCu /*  -4, -6, -8, -12 */

// An MXFP4 block's e8m0 scale with the halving the doubled levels need: 2^(e − 128),
// exact (subnormal for e < 2): quant's e8m0_half.
SC_HD float sc_e8m0_half(uint32_t e) {
  return sc_bits_f32(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// Q2_K (84 bytes / 256): scales[16] @0 (low nibble the 16-value group's scale, high
// its min), qs[64] @16, d @80, dmin @82. Value 128c + 32k + l: (qs[32c + l] >> 2k) & 3.
// w = q, mul = sc, D = d, E = -dmin, emul = m.
SC_HD void sc_load_q2_k(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7, c = j >> 2, k = j & 3;
  const uint8_t* blk = row + 84 * (size_t)(s >> 3);
  const uint32_t dd = sc_ld32(blk + 80);
  w.d = sc_f16_to_f32((uint16_t)(dd & 0xffff));
  w.e = -sc_f16_to_f32((uint16_t)(dd >> 16));
  const uint32_t sc = sc_ld16(blk + 2 * j);
  w.m0 = (int)(sc & 0xf);
  w.e0 = (int)((sc >> 4) & 0xf);
  w.m1 = (int)((sc >> 8) & 0xf);
  w.e1 = (int)((sc >> 12) & 0xf);
  uint32_t raw[8];
  sc_ld_w32<8>(blk + 16 + 32 * c, raw);
#pragma unroll
  for (int i = 0; i < 8; i++) w.q[i] = (raw[i] >> (2 * k)) & 0x03030303u;
}

// Q3_K (110 bytes / 256): hmask[32] @0, qs[64] @32, scales[12] @96, d @108. Value
// v = 128c + 32k + l: ((qs[32c + l] >> 2k) & 3) − (bit v/32 of hmask[l] ? 0 : 4); the
// 16-value group i's scale: low four bits nibble i / 8 of byte i % 8, high two bits
// 2·(i / 4) of byte 8 + i % 4, minus 32. w = q, mul = the scale, D = d.
SC_HD int sc_q3_k_scale(const uint8_t* sc, int i) {
  const int lo = (sc_ld8(sc + (i & 7)) >> (4 * (i >> 3))) & 0xf;
  const int hi = (sc_ld8(sc + 8 + (i & 3)) >> (2 * (i >> 2))) & 3;
  return (lo | (hi << 4)) - 32;
}
SC_HD void sc_load_q3_k(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7, c = j >> 2, k = j & 3;
  const uint8_t* blk = row + 110 * (size_t)(s >> 3);
  uint32_t hm[8], qs[8];
  sc_ld_words<8>(blk, hm);
  sc_ld_words<8>(blk + 32 + 32 * c, qs);
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const uint32_t lo = (qs[i] >> (2 * k)) & 0x03030303u;
    const uint32_t hb = (hm[i] >> j) & 0x01010101u;
    w.q[i] = sc_vsub4(lo | (hb << 2), 0x04040404u);
  }
  w.m0 = sc_q3_k_scale(blk + 96, 2 * j);
  w.m1 = sc_q3_k_scale(blk + 96, 2 * j + 1);
  w.d = sc_f16_to_f32(sc_ld16(blk + 108));
  w.e = 0.0f;
  w.e0 = w.e1 = 0;
}

// The 32 nibbles of 16 bytes (4 words): low nibbles are values 0..15, high 16..31.
SC_HD void sc_nibbles(const uint32_t* raw, uint32_t* q) {
#pragma unroll
  for (int i = 0; i < 4; i++) {
    q[i] = raw[i] & 0x0f0f0f0fu;
    q[4 + i] = (raw[i] >> 4) & 0x0f0f0f0fu;
  }
}
// The fifth bits of a Q5_0 / Q5_1 block (qh: bit i is value i's) into q's bytes.
SC_HD void sc_q5_high(uint32_t qh, uint32_t* q) {
#pragma unroll
  for (int i = 0; i < 8; i++) q[i] |= sc_bits_to_bytes(qh >> (4 * i)) << 4;
}

// Q4_1 (20 bytes / 32): d @0, m @2, qs[16] @4. w = q (0..15), mul = 1, D = d, E = m.
SC_HD void sc_load_q4_1(const uint8_t* row, int s, WLB& w) {
  const uint8_t* blk = row + 20 * (size_t)s;
  const uint32_t dm = sc_ld32(blk);
  w.d = sc_f16_to_f32((uint16_t)(dm & 0xffff));
  w.e = sc_f16_to_f32((uint16_t)(dm >> 16));
  uint32_t raw[4];
  sc_ld_w32<4>(blk + 4, raw);
  sc_nibbles(raw, w.q);
  w.m0 = w.m1 = 1;
  w.e0 = w.e1 = 0;
}

// Q5_0 (22 bytes / 32): d @0, qh (u32) @2, qs[16] @6. w = q − 16, mul = 1, D = d.
SC_HD void sc_load_q5_0(const uint8_t* row, int s, WLB& w) {
  const uint8_t* blk = row + 22 * (size_t)s;
  w.d = sc_f16_to_f32(sc_ld16(blk));
  uint32_t qh, raw[4];
  sc_ld_words<1>(blk + 2, &qh);
  sc_ld_words<4>(blk + 6, raw);
  sc_nibbles(raw, w.q);
  sc_q5_high(qh, w.q);
#pragma unroll
  for (int i = 0; i < 8; i++) w.q[i] = sc_vsub4(w.q[i], 0x10101010u);
  w.e = 0.0f;
  w.m0 = w.m1 = 1;
  w.e0 = w.e1 = 0;
}

// Q5_1 (24 bytes / 32): d @0, m @2, qh @4, qs[16] @8. w = q (0..31), mul = 1, D = d,
// E = m.
SC_HD void sc_load_q5_1(const uint8_t* row, int s, WLB& w) {
  const uint8_t* blk = row + 24 * (size_t)s;
  const uint32_t dm = sc_ld32(blk);
  w.d = sc_f16_to_f32((uint16_t)(dm & 0xffff));
  w.e = sc_f16_to_f32((uint16_t)(dm >> 16));
  uint32_t raw[4];
  sc_ld_w32<4>(blk + 8, raw);
  sc_nibbles(raw, w.q);
  sc_q5_high(sc_ld32(blk + 4), w.q);
  w.m0 = w.m1 = 1;
  w.e0 = w.e1 = 0;
}

// IQ4_NL (18 bytes / 32): d @0, qs[16] @2. w = K[q] (IQ4_XS's levels), mul = 1, D = d.
SC_HD void sc_load_iq4_nl(const uint8_t* row, int s, WLB& w) {
  const uint8_t* blk = row + 18 * (size_t)s;
  w.d = sc_f16_to_f32(sc_ld16(blk));
  uint32_t raw[4];
  sc_ld_words<4>(blk + 2, raw);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    w.q[i] = sc_iq4_lut(raw[i] & 0x0f0f0f0fu);
    w.q[4 + i] = sc_iq4_lut((raw[i] >> 4) & 0x0f0f0f0fu);
  }
  w.e = 0.0f;
  w.m0 = w.m1 = 1;
  w.e0 = w.e1 = 0;
}

// MXFP4 (17 bytes / 32, any alignment): e (e8m0) @0, qs[16] @1. w = K2[q] (the doubled
// e2m1 levels), mul = 1, D = 2^(e − 128).
SC_HD void sc_load_mxfp4(const uint8_t* row, int s, WLB& w) {
  const uint8_t* blk = row + 17 * (size_t)s;
  w.d = sc_e8m0_half(sc_ld8(blk));
  uint32_t raw[4];
  sc_ld_words<4>(blk + 1, raw);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    w.q[i] = sc_lut16(raw[i] & 0x0f0f0f0fu, SC_MXFP4_T0, SC_MXFP4_T1, SC_MXFP4_T2, SC_MXFP4_T3);
    w.q[4 + i] = sc_lut16((raw[i] >> 4) & 0x0f0f0f0fu, SC_MXFP4_T0, SC_MXFP4_T1, SC_MXFP4_T2, SC_MXFP4_T3);
  }
  w.e = 0.0f;
  w.m0 = w.m1 = 1;
  w.e0 = w.e1 = 0;
}

// An NVFP4 scale byte (unsigned e4m3, bias 7; bit 7 unused) with the halving the
// doubled levels need, exactly: 0 for 0x00 and 0x7F, m · 2^-10 for exponent 0, else
// (8 + m) · 2^(e − 11): quant's ue4m3_half.
SC_HD float sc_ue4m3_half(uint32_t b) {
  b &= 0xffu;
  if (b == 0u || b == 0x7fu) return 0.0f;
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  return e == 0u ? sc_mul(sc_i2f((int)m), 0.0009765625f) : sc_bits_f32(((e + 119u) << 23) | (m << 20));
}

// NVFP4 (36 bytes / 64, 4-byte aligned): d[4] (unsigned e4m3, one a 16-value group) @0,
// qs[32] @4; group k's values 0..7 are the low nibbles of qs[8k..8k + 8], 8..15 their
// high nibbles. Sub-block s is groups 2(s & 1), 2(s & 1) + 1 of block s >> 1.
// w = K2[q], mul = 1, 0, D = the first group's scale, E = the second's.
SC_HD void sc_load_nvfp4(const uint8_t* row, int s, WLB& w) {
  const uint8_t* blk = row + 36 * (size_t)(s >> 1);
  const int h = s & 1;
  const uint32_t d = sc_ld32(blk);
  w.d = sc_ue4m3_half(d >> (16 * h));
  w.e = sc_ue4m3_half(d >> (16 * h + 8));
  uint32_t raw[4];
  sc_ld_w32<4>(blk + 4 + 16 * h, raw);
  // Words 0, 1: the first group's 8 bytes (values 0..7 low, 8..15 high nibbles).
#pragma unroll
  for (int g = 0; g < 2; g++) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const uint32_t v = raw[2 * g + i];
      w.q[4 * g + i] = sc_lut16(v & 0x0f0f0f0fu, SC_MXFP4_T0, SC_MXFP4_T1, SC_MXFP4_T2, SC_MXFP4_T3);
      w.q[4 * g + 2 + i] = sc_lut16((v >> 4) & 0x0f0f0f0fu, SC_MXFP4_T0, SC_MXFP4_T1, SC_MXFP4_T2, SC_MXFP4_T3);
    }
  }
  w.m0 = 1;
  w.m1 = 0;
  w.e0 = w.e1 = 0;
}

// Base-3 digit n (0..4) of each byte of v, minus 1, as signed bytes: TQ1_0's
// ((byte · 3^n mod 256) · 3) >> 8.
SC_HD uint32_t sc_trits4(uint32_t v, int n) {
  const uint32_t p3 = n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u;
  uint32_t r = 0;
#pragma unroll
  for (int b = 0; b < 4; b++) {
    const uint32_t q = (sc_byte(v, b) * p3) & 0xffu;
    r |= ((q * 3u) >> 8) << (8 * b);
  }
  return sc_vsub4(r, 0x01010101u);
}

// TQ1_0 (54 bytes / 256): qs[48] @0, qh[4] @48, d @52. Values 0..160: digit n of qs[l]
// is value 32n + l (l < 32); 160..240: digit n of qs[32 + l] is value 160 + 16n + l
// (l < 16); 240..256: digit n (< 4) of qh[l] is value 240 + 4n + l (l < 4).
// w = digit − 1, mul = 1, D = d.
SC_HD void sc_load_tq1_0(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 54 * (size_t)(s >> 3);
  if (j < 5) {
    uint32_t raw[8];
    sc_ld_words<8>(blk, raw);
#pragma unroll
    for (int i = 0; i < 8; i++) w.q[i] = sc_trits4(raw[i], j);
  } else {
    uint32_t raw[4];
    sc_ld_words<4>(blk + 32, raw);
    // Sub-block 5: digits 0, 1 of qs[32..48]; 6: digits 2, 3; 7: digit 4, then qh.
    const int n = 2 * (j - 5);
#pragma unroll
    for (int i = 0; i < 4; i++) w.q[i] = sc_trits4(raw[i], n);
    if (j < 7) {
#pragma unroll
      for (int i = 0; i < 4; i++) w.q[4 + i] = sc_trits4(raw[i], n + 1);
    } else {
      uint32_t qh;
      sc_ld_words<1>(blk + 48, &qh);
#pragma unroll
      for (int i = 0; i < 4; i++) w.q[4 + i] = sc_trits4(qh, i);
    }
  }
  w.d = sc_f16_to_f32(sc_ld16(blk + 52));
  w.e = 0.0f;
  w.m0 = w.m1 = 1;
  w.e0 = w.e1 = 0;
}

// TQ2_0 (66 bytes / 256): qs[64] @0, d @64; value 128c + 32k + l is
// ((qs[32c + l] >> 2k) & 3) − 1. w = q, mul = 1, D = d.
SC_HD void sc_load_tq2_0(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7, c = j >> 2, k = j & 3;
  const uint8_t* blk = row + 66 * (size_t)(s >> 3);
  uint32_t raw[8];
  sc_ld_words<8>(blk + 32 * c, raw);
#pragma unroll
  for (int i = 0; i < 8; i++) w.q[i] = sc_vsub4((raw[i] >> (2 * k)) & 0x03030303u, 0x01010101u);
  w.d = sc_f16_to_f32(sc_ld16(blk + 64));
  w.e = 0.0f;
  w.m0 = w.m1 = 1;
  w.e0 = w.e1 = 0;
}

// IQ2_XXS (66 bytes / 256): d @0, then per sub-block j two u32 at 2 + 8j: four codebook
// rows (a byte each, 8 values a row) and four 7-bit sign indices (bits 7k) with ls in
// bits 28..31. w = grid · sign, mul = 2·ls + 1, D = d / 8.
SC_HD void sc_load_iq2_xxs(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 66 * (size_t)(s >> 3);
  uint32_t a[2];
  sc_ld_words<2>(blk + 2 + 8 * j, a);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    uint32_t lo, hi;
    sc_grid8(sc_grid_iq2xxs, (int)sc_byte(a[0], k), lo, hi);
    const uint32_t sg = sc_ksigns(a[1] >> (7 * k));
    w.q[2 * k] = sc_signed4(lo, sg);
    w.q[2 * k + 1] = sc_signed4(hi, sg >> 4);
  }
  w.m0 = w.m1 = 2 * (int)(a[1] >> 28) + 1;
  w.d = sc_mul(sc_f16_to_f32(sc_ld16(blk)), 0.125f);
  w.e = 0.0f;
  w.e0 = w.e1 = 0;
}

// IQ2_XS (74 bytes / 256): d @0, qs (u16)[32] @2 — row r: codebook row q & 511, sign
// index q >> 9 (values 8r..8r+8) —, scales[8] @66 (sub-block j: low nibble the first
// 16 values, high the second). w = grid · sign, mul = 2·ls + 1 a half, D = d / 8.
SC_HD void sc_load_iq2_xs(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 74 * (size_t)(s >> 3);
  uint32_t qw[2];
  sc_ld_words<2>(blk + 2 + 8 * j, qw);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const uint32_t q = (qw[k >> 1] >> (16 * (k & 1))) & 0xffffu;
    uint32_t lo, hi;
    sc_grid8(sc_grid_iq2xs, (int)(q & 511), lo, hi);
    const uint32_t sg = sc_ksigns(q >> 9);
    w.q[2 * k] = sc_signed4(lo, sg);
    w.q[2 * k + 1] = sc_signed4(hi, sg >> 4);
  }
  const uint32_t sc = sc_ld8(blk + 66 + j);
  w.m0 = 2 * (int)(sc & 0xf) + 1;
  w.m1 = 2 * (int)(sc >> 4) + 1;
  w.d = sc_mul(sc_f16_to_f32(sc_ld16(blk)), 0.125f);
  w.e = 0.0f;
  w.e0 = w.e1 = 0;
}

// IQ2_S (82 bytes / 256): d @0, qs[32] @2 (low 8 bits of row r's index), signs[32] @34
// (row r's 8 sign bits), qh[8] @66 (bits 2·(r % 4) of byte r / 4: the index's bits 8,
// 9), scales[8] @74 (as IQ2_XS). Canonical form as IQ2_XS.
SC_HD void sc_load_iq2_s(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 82 * (size_t)(s >> 3);
  uint32_t qs, sg;
  sc_ld_words<1>(blk + 2 + 4 * j, &qs);
  sc_ld_words<1>(blk + 34 + 4 * j, &sg);
  const uint32_t qh = sc_ld8(blk + 66 + j);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int idx = (int)(sc_byte(qs, k) | (((qh >> (2 * k)) & 3u) << 8));
    uint32_t lo, hi;
    sc_grid8(sc_grid_iq2s, idx, lo, hi);
    const uint32_t sk = sc_byte(sg, k);
    w.q[2 * k] = sc_signed4(lo, sk);
    w.q[2 * k + 1] = sc_signed4(hi, sk >> 4);
  }
  const uint32_t sc = sc_ld8(blk + 74 + j);
  w.m0 = 2 * (int)(sc & 0xf) + 1;
  w.m1 = 2 * (int)(sc >> 4) + 1;
  w.d = sc_mul(sc_f16_to_f32(sc_ld16(blk)), 0.125f);
  w.e = 0.0f;
  w.e0 = w.e1 = 0;
}

// IQ3_XXS (98 bytes / 256): d @0, qs[64] @2 (a codebook row of 4 values a byte;
// sub-block j: bytes 8j..8j+8), then per sub-block j a u32 @66 + 4j: four 7-bit sign
// indices (bits 7k, each for 8 values) and ls (bits 28..31).
// w = grid · sign, mul = 2·ls + 1, D = d / 4.
SC_HD void sc_load_iq3_xxs(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 98 * (size_t)(s >> 3);
  uint32_t qs[2], aux;
  sc_ld_words<2>(blk + 2 + 8 * j, qs);
  sc_ld_words<1>(blk + 66 + 4 * j, &aux);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const uint32_t sg = sc_ksigns(aux >> (7 * k));
    const uint32_t r0 = sc_grid4(sc_grid_iq3xxs, (int)sc_byte(qs[k >> 1], 2 * (k & 1)));
    const uint32_t r1 = sc_grid4(sc_grid_iq3xxs, (int)sc_byte(qs[k >> 1], 2 * (k & 1) + 1));
    w.q[2 * k] = sc_signed4(r0, sg);
    w.q[2 * k + 1] = sc_signed4(r1, sg >> 4);
  }
  w.m0 = w.m1 = 2 * (int)(aux >> 28) + 1;
  w.d = sc_mul(sc_f16_to_f32(sc_ld16(blk)), 0.25f);
  w.e = 0.0f;
  w.e0 = w.e1 = 0;
}

// IQ3_S (110 bytes / 256): d @0, qs[64] @2 (low 8 bits of row r's index, 4 values a
// row), qh[8] @66 (bit r % 8 of byte r / 8: the index's bit 8), signs[32] @74 (byte t:
// values 8t..8t+8), scales[4] @106 (sub-block j: nibble j % 2 of byte j / 2).
// w = grid · sign, mul = 1 + 2·sc, D = d.
SC_HD void sc_load_iq3_s(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 110 * (size_t)(s >> 3);
  uint32_t qs[2], sg;
  sc_ld_words<2>(blk + 2 + 8 * j, qs);
  sc_ld_words<1>(blk + 74 + 4 * j, &sg);  // row 8j + k's signs: nibble k
  const uint32_t qh = sc_ld8(blk + 66 + j);
#pragma unroll
  for (int k = 0; k < 8; k++) {
    const int idx = (int)(sc_byte(qs[k >> 2], k & 3) | (((qh >> k) & 1u) << 8));
    w.q[k] = sc_signed4(sc_grid4(sc_grid_iq3s, idx), sg >> (4 * k));
  }
  const int sc = (sc_ld8(blk + 106 + (j >> 1)) >> (4 * (j & 1))) & 0xf;
  w.m0 = w.m1 = 1 + 2 * sc;
  w.d = sc_f16_to_f32(sc_ld16(blk));
  w.e = 0.0f;
  w.e0 = w.e1 = 0;
}

// IQ1_S (50 bytes / 256): d @0, qs[32] @2 (low 8 bits of row r's index, 8 values of
// −1, 0, +1 a row), qh (u16)[8] @34 — sub-block j: bits 3k..3k+3 the index's bits 8..10
// of row 4j + k, bits 12..14 s, bit 15 the sign of δ. w = 8·grid ± 1, mul = 2s + 1,
// D = d / 8.
SC_HD void sc_load_iq1_s(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 50 * (size_t)(s >> 3);
  uint32_t qs;
  sc_ld_words<1>(blk + 2 + 4 * j, &qs);
  const uint32_t qh = sc_ld16(blk + 34 + 2 * j);
  const bool neg = (qh & 0x8000u) != 0;
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int idx = (int)(sc_byte(qs, k) | (((qh >> (3 * k)) & 7u) << 8));
    uint32_t lo, hi;
    sc_grid8(sc_grid_iq1s, idx, lo, hi);
    w.q[2 * k] = sc_iq1_word(lo, neg);
    w.q[2 * k + 1] = sc_iq1_word(hi, neg);
  }
  w.m0 = w.m1 = 2 * (int)((qh >> 12) & 7) + 1;
  w.d = sc_mul(sc_f16_to_f32(sc_ld16(blk)), 0.125f);
  w.e = 0.0f;
  w.e0 = w.e1 = 0;
}

// IQ1_M (56 bytes / 256): qs[32] @0 (low 8 bits of row r's index), qh[16] @32 (nibble
// r % 2 of byte r / 2: bits 0..2 the index's bits 8..10, bit 3 the sign of row r's δ),
// scales (four u16) @48: 3-bit scale i (16-value group i) at bits 3·(i % 4) of word
// i / 4, the f16 d in the words' top nibbles (word u's in bits 4u..4u+4).
// w = 8·grid ± 1, mul = 2s + 1 a half, D = d / 8.
SC_HD void sc_load_iq1_m(const uint8_t* row, int s, WLB& w) {
  const int j = s & 7;
  const uint8_t* blk = row + 56 * (size_t)(s >> 3);
  const uint32_t qs = sc_ld32(blk + 4 * j);
  const uint32_t qh = sc_ld16(blk + 32 + 2 * j);  // row 4j + k: nibble k
  const uint32_t sc0 = sc_ld32(blk + 48), sc1 = sc_ld32(blk + 52);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const uint32_t nib = (qh >> (4 * k)) & 0xfu;
    const int idx = (int)(sc_byte(qs, k) | ((nib & 7u) << 8));
    uint32_t lo, hi;
    sc_grid8(sc_grid_iq1s, idx, lo, hi);
    w.q[2 * k] = sc_iq1_word(lo, (nib & 8u) != 0);
    w.q[2 * k + 1] = sc_iq1_word(hi, (nib & 8u) != 0);
  }
  const uint32_t dbits = ((sc0 >> 12) & 0xfu) | ((sc0 >> 24) & 0xf0u) | ((sc1 >> 4) & 0xf00u) | ((sc1 >> 16) & 0xf000u);
  // Group i = 2j + h: word i / 4 = j / 2, bits 3·(i % 4).
  const uint32_t sw = (j >> 2) ? sc1 : sc0;
  const uint32_t wd = (sw >> (16 * ((j >> 1) & 1))) & 0xffffu;
  const int i0 = (2 * j) & 3;
  w.m0 = 2 * (int)((wd >> (3 * i0)) & 7) + 1;
  w.m1 = 2 * (int)((wd >> (3 * (i0 + 1))) & 7) + 1;
  w.d = sc_mul(sc_f16_to_f32((uint16_t)dbits), 0.125f);
  w.e = 0.0f;
  w.e0 = w.e1 = 0;
}

// The float sequences. One multiplier a sub-block (mul_0 = mul_1):
// is = mul·Σ w·a; c = (D * da) * is. |is| < 2^23: sc_i2f converts it exactly.
SC_HD float sc_contrib_lb(const WLB& w, const uint32_t* a, float da, int asum) {
  (void)asum;
  int dot = 0;
#pragma unroll
  for (int i = 0; i < 8; i++) dot = sc_dp4a(w.q[i], a[i], dot);
  return sc_mul(sc_mul(w.d, da), sc_i2f(w.m0 * dot));
}
// A multiplier a half: is = mul_0·Σ_{i<16} w·a + mul_1·Σ_{i≥16} w·a; c = (D * da) * is.
SC_HD float sc_contrib_lb_halves(const WLB& w, const uint32_t* a, float da, int asum) {
  (void)asum;
  int lo, hi;
  sc_dot_halves(w.q, a, lo, hi);
  return sc_mul(sc_mul(w.d, da), sc_i2f(w.m0 * lo + w.m1 * hi));
}
// Q4_1, Q5_1 (mul = 1): c = (D * da) * is; c = fma(E * da, asum, c).
SC_HD float sc_contrib_lb_asum(const WLB& w, const uint32_t* a, float da, int asum) {
  int dot = 0;
#pragma unroll
  for (int i = 0; i < 8; i++) dot = sc_dp4a(w.q[i], a[i], dot);
  const float c = sc_mul(sc_mul(w.d, da), sc_i2f(dot));
  return sc_fma(sc_mul(w.e, da), sc_i2f(asum), c);
}
// Q2_K: is as for the halves; ie = emul_0·Σ_{i<16} a + emul_1·Σ_{i≥16} a;
// c = (D * da) * is; c = fma(E * da, ie, c).
SC_HD float sc_contrib_q2_k(const WLB& w, const uint32_t* a, float da, int asum) {
  int lo = 0, hi = 0, alo = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    lo = sc_dp4a(w.q[i], a[i], lo);
    hi = sc_dp4a(w.q[4 + i], a[4 + i], hi);
    alo = sc_dp4a(0x01010101u, a[i], alo);
  }
  const float c = sc_mul(sc_mul(w.d, da), sc_i2f(w.m0 * lo + w.m1 * hi));
  return sc_fma(sc_mul(w.e, da), sc_i2f(w.e0 * alo + w.e1 * (asum - alo)), c);
}

// NVFP4: is = Σ_{i<16} w·a (mul = 1, 0); c = (D * da) * is; c = fma(E * da, Σ_{i≥16} w·a, c).
SC_HD float sc_contrib_nvfp4(const WLB& w, const uint32_t* a, float da, int asum) {
  (void)asum;
  int lo, hi;
  sc_dot_halves(w.q, a, lo, hi);
  const float c = sc_mul(sc_mul(w.d, da), sc_i2f(lo));
  return sc_fma(sc_mul(w.e, da), sc_i2f(hi), c);
}

// Every low-bit type: X(code, name, loader, contribution). The kernels (matvecs, the
// fused MoE, the GEMM) and the host test (tests/host_formats.cpp) all take each type's
// pair from this list.
#define SC_LOWBIT_TYPES(X)                                          \
  X(SC_T_Q2_K, q2_k, sc_load_q2_k, sc_contrib_q2_k)                 \
  X(SC_T_Q3_K, q3_k, sc_load_q3_k, sc_contrib_lb_halves)            \
  X(SC_T_Q4_1, q4_1, sc_load_q4_1, sc_contrib_lb_asum)              \
  X(SC_T_Q5_0, q5_0, sc_load_q5_0, sc_contrib_lb)                   \
  X(SC_T_Q5_1, q5_1, sc_load_q5_1, sc_contrib_lb_asum)              \
  X(SC_T_IQ4_NL, iq4_nl, sc_load_iq4_nl, sc_contrib_lb)             \
  X(SC_T_MXFP4, mxfp4, sc_load_mxfp4, sc_contrib_lb)                \
  X(SC_T_TQ1_0, tq1_0, sc_load_tq1_0, sc_contrib_lb)                \
  X(SC_T_TQ2_0, tq2_0, sc_load_tq2_0, sc_contrib_lb)                \
  X(SC_T_IQ2_XXS, iq2_xxs, sc_load_iq2_xxs, sc_contrib_lb)          \
  X(SC_T_IQ2_XS, iq2_xs, sc_load_iq2_xs, sc_contrib_lb_halves)      \
  X(SC_T_IQ2_S, iq2_s, sc_load_iq2_s, sc_contrib_lb_halves)         \
  X(SC_T_IQ3_XXS, iq3_xxs, sc_load_iq3_xxs, sc_contrib_lb)          \
  X(SC_T_IQ3_S, iq3_s, sc_load_iq3_s, sc_contrib_lb)                \
  X(SC_T_IQ1_S, iq1_s, sc_load_iq1_s, sc_contrib_lb)                \
  X(SC_T_IQ1_M, iq1_m, sc_load_iq1_m, sc_contrib_lb_halves)       \
  X(SC_T_NVFP4, nvfp4, sc_load_nvfp4, sc_contrib_nvfp4)

// The types whose two halves have their own multipliers (is needs both half dots; the
// prompt GEMM runs two K = 16 products for them, as for Q6_K), and NVFP4, whose halves
// have their own float scales.
#define SC_LB_HALVES(TY)                                                                              \
  ((TY) == SC_T_Q2_K || (TY) == SC_T_Q3_K || (TY) == SC_T_IQ2_XS || (TY) == SC_T_IQ2_S || (TY) == SC_T_IQ1_M || \
   (TY) == SC_T_NVFP4)

// Sub-block s of a low-bit row of type `ty` (the dequantization's dispatch).
SC_HD void sc_load_lb(int ty, const uint8_t* row, int s, WLB& w) {
  switch (ty) {
#define SC_LB_LOAD_CASE(CODE, NAME, LOAD, CONTRIB) \
  case CODE: LOAD(row, s, w); break;
    SC_LOWBIT_TYPES(SC_LB_LOAD_CASE)
#undef SC_LB_LOAD_CASE
    default: break;
  }
}

// Element i of a low-bit row: its sub-block decoded, then the float operations of
// quant's lowbit::dequantize (products rounded one by one, in its order).
SC_HD float sc_dequant_lb(int ty, const uint8_t* row, int i) {
  WLB w;
  sc_load_lb(ty, row, i >> 5, w);
  const int l = i & 31, h = l >> 4;
  const int q = (int)(int8_t)(uint8_t)sc_byte(w.q[l >> 2], l & 3);
  const float qf = sc_i2f(q);
  const int mi = h ? w.m1 : w.m0;
  const float m = sc_i2f(mi);
  const float qa = sc_i2f(q < 0 ? -q : q), sg = q < 0 ? -1.0f : 1.0f;  // |w|, its sign
  switch (ty) {
    case SC_T_Q2_K:  // (d * sc) * q - (dmin * m)
      return sc_sub(sc_mul(sc_mul(w.d, m), qf), sc_mul(-w.e, sc_i2f(h ? w.e1 : w.e0)));
    case SC_T_Q3_K:
      return sc_mul(sc_mul(w.d, m), qf);
    case SC_T_Q4_1:
    case SC_T_Q5_1:
      return sc_add(sc_mul(w.d, qf), w.e);
    case SC_T_IQ2_XXS:
    case SC_T_IQ2_XS:
    case SC_T_IQ2_S: {
      // ((d * (0.5 + ls)) * 0.25) * |grid|, then the sign; d = 8·D, ls = (mul − 1) / 2.
      const float db = sc_mul(sc_mul(sc_mul(w.d, 8.0f), sc_add(0.5f, sc_i2f((mi - 1) / 2))), 0.25f);
      return sc_mul(sc_mul(db, qa), sg);
    }
    case SC_T_IQ3_XXS: {  // ((d * (0.5 + ls)) * 0.5) * |grid|, then the sign; d = 4·D
      const float db = sc_mul(sc_mul(sc_mul(w.d, 4.0f), sc_add(0.5f, sc_i2f((mi - 1) / 2))), 0.5f);
      return sc_mul(sc_mul(db, qa), sg);
    }
    case SC_T_IQ3_S:  // ((d * (1 + 2·sc)) * |grid|) * sign
      return sc_mul(sc_mul(sc_mul(w.d, m), qa), sg);
    case SC_T_IQ1_S:
    case SC_T_IQ1_M:  // (d * (2s + 1)) * (grid + δ): d = 8·D, grid + δ = w / 8 (exact)
      return sc_mul(sc_mul(sc_mul(w.d, 8.0f), m), sc_mul(qf, 0.125f));
    case SC_T_NVFP4:  // the group's own scale * w
      return sc_mul(h ? w.e : w.d, qf);
    default:  // Q5_0, IQ4_NL, MXFP4, TQ1_0, TQ2_0: D * w
      return sc_mul(w.d, qf);
  }
}

// ------------------------------------------------------------------ float rows
SC_HD float sc_get_f32(const uint8_t* row, int i) {
#ifdef SC_DEVICE_CODE
  return __ldg((const float*)row + i);
#else
  float v;
  memcpy(&v, row + 4 * (size_t)i, 4);
  return v;
#endif
}
SC_HD float sc_get_f16(const uint8_t* row, int i) { return sc_f16_to_f32(sc_ld16(row + 2 * (size_t)i)); }
SC_HD float sc_get_bf16(const uint8_t* row, int i) { return sc_bf16_to_f32(sc_ld16(row + 2 * (size_t)i)); }

// ------------------------------------------------------------- dequantization
// Element i of a row, the float sequence of quant::formats::dequantize:
// Q8_0: d * q;  Q4_0: d * (q - 8);  Q4_K / Q5_K: (d * sc) * q - dmin * m (product
// rounded, then subtract);  Q6_K: (d * sc) * q;  IQ4_XS: (d * (ls - 32)) * K[q].
SC_HD float sc_dequant(int ty, const uint8_t* row, int i) {
  switch (ty) {
    case SC_T_F32:
      return sc_get_f32(row, i);
    case SC_T_F16:
      return sc_get_f16(row, i);
    case SC_T_BF16:
      return sc_get_bf16(row, i);
    case SC_T_Q8_0: {
      const uint8_t* blk = row + 34 * (size_t)(i >> 5);
      const float d = sc_f16_to_f32(sc_ld16(blk));
      return sc_mul(d, sc_i2f((int)(int8_t)sc_ld8(blk + 2 + (i & 31))));
    }
    case SC_T_Q4_0: {
      const uint8_t* blk = row + 18 * (size_t)(i >> 5);
      const float d = sc_f16_to_f32(sc_ld16(blk));
      const int l = i & 31;
      const uint8_t q = sc_ld8(blk + 2 + (l & 15));
      const int n = l < 16 ? (q & 0xf) : (q >> 4);
      return sc_mul(d, sc_i2f(n - 8));
    }
    case SC_T_Q4_K:
    case SC_T_Q5_K: {
      const bool five = ty == SC_T_Q5_K;
      const uint8_t* blk = row + (five ? 176 : 144) * (size_t)(i >> 8);
      const int e = i & 255, j = e >> 5, l = e & 31;
      const float d = sc_f16_to_f32(sc_ld16(blk));
      const float dmin = sc_f16_to_f32(sc_ld16(blk + 2));
      int sc, m;
      sc_k_scale_min(sc_ld32(blk + 4), sc_ld32(blk + 8), sc_ld32(blk + 12), j, sc, m);
      const uint8_t qb = sc_ld8(blk + (five ? 48 : 16) + 32 * (j >> 1) + l);
      int q = (j & 1) ? (qb >> 4) : (qb & 0xf);
      if (five && ((sc_ld8(blk + 16 + l) >> j) & 1)) q += 16;
      const float d1 = sc_mul(d, sc_i2f(sc));
      const float m1 = sc_mul(dmin, sc_i2f(m));
      return sc_sub(sc_mul(d1, sc_i2f(q)), m1);
    }
    case SC_T_Q6_K: {
      const uint8_t* blk = row + 210 * (size_t)(i >> 8);
      const int e = i & 255, h = e >> 7, r = e & 127, jj = r >> 5, l = r & 31;
      const uint8_t qlb = sc_ld8(blk + 64 * h + l + 32 * (jj & 1));
      const int nib = (jj >> 1) ? (qlb >> 4) : (qlb & 0xf);
      const int hb = (sc_ld8(blk + 128 + 32 * h + l) >> (2 * jj)) & 3;
      const int q = (nib | (hb << 4)) - 32;
      const float d = sc_f16_to_f32(sc_ld16(blk + 208));
      const float ds = sc_mul(d, sc_i2f((int)(int8_t)sc_ld8(blk + 192 + (e >> 4))));
      return sc_mul(ds, sc_i2f(q));
    }
    case SC_T_IQ4_XS: {
      const uint8_t* blk = row + 136 * (size_t)(i >> 8);
      const int e = i & 255, j = e >> 5, l = e & 31;
      const float d = sc_f16_to_f32(sc_ld16(blk));
      const uint32_t scales_h = sc_ld16(blk + 2);
      const int lo = (sc_ld8(blk + 4 + (j >> 1)) >> (4 * (j & 1))) & 0xf;
      const int hi = (int)((scales_h >> (2 * j)) & 3);
      const float dl = sc_mul(d, sc_i2f((lo | (hi << 4)) - 32));
      const uint8_t qb = sc_ld8(blk + 8 + 16 * j + (l & 15));
      const uint32_t n = l < 16 ? (qb & 0xfu) : (uint32_t)(qb >> 4);
      const int k = (int)(int8_t)(uint8_t)(sc_iq4_lut(n) & 0xff);
      return sc_mul(dl, sc_i2f(k));
    }
    default:
      return 0.0f;
  }
}
