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
// isum = sc_lo·Σ_{i<16} q·a + sc_hi·Σ_{i≥16} q·a; c = (d * da) * isum
SC_HD float sc_contrib_q6_k(const WQ6_K& w, const uint32_t* a, float da, int asum) {
  (void)asum;
  int lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    lo = sc_dp4a(w.q[i], a[i], lo);
    hi = sc_dp4a(w.q[4 + i], a[4 + i], hi);
  }
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
