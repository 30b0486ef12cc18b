//! The block types added for the files people download at 1.5–5 bits: Q2_K, Q3_K, Q4_1,
//! Q5_0, Q5_1, IQ4_NL, MXFP4, TQ1_0, TQ2_0, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
//! IQ1_M and NVFP4: their layouts, the decoding of a block into the *canonical integer form*
//! every dot kernel reads, the scalar reference dot and dequantization (the simple
//! quantizers are in `lowbit_quantize.rs`, the SIMD dots in `lowbit_simd.rs`).
//!
//! # The canonical integer form
//!
//! Whatever the layout, a run of 8 sub-blocks of 32 values (one 256-value block, 4
//! consecutive 64-value blocks or 8 consecutive 32-value blocks) decodes into a [`Group`]:
//! - `w[i]`: one signed integer weight per value (|w| ≤ 127);
//! - `mul[2j]`, `mul[2j + 1]`: the integer multipliers of the two 16-value halves of
//!   sub-block j (equal for types with one scale per 32 values);
//! - `d[j]`: the sub-block's float scale D (an f16 or e8m0 scale converted to f32, times
//!   a power of two, all exact);
//! - for types with a minimum: `e[j]` (its float scale E) and, for Q2_K, `emul[2j]`,
//!   `emul[2j + 1]` (the halves' integer mins);
//! - for NVFP4, whose halves have float scales of their own: `d[j]` the first half's,
//!   `e[j]` the second's, `mul` = (1, 0) and `emul` = (0, 1).
//!
//! Against activation sub-block s (`a`, `da`, `asum`; see the crate docs) sub-block j
//! contributes
//! ```text
//! is = mul[2j]·Σ_{i<16} w·a + mul[2j+1]·Σ_{i≥16} w·a          (exact integer)
//! c  = (d[j] * da) * is
//! Min::Asum   (Q4_1, Q5_1): c = fma(e[j] * da, asum, c)
//! Min::Halves (Q2_K):       c = fma(e[j] * da, emul[2j]·Σ_{i<16} a + emul[2j+1]·Σ_{i≥16} a, c)
//! Min::Split  (NVFP4):      c = fma(e[j] * da, emul[2j]·Σ_{i<16} w·a + emul[2j+1]·Σ_{i≥16} w·a, c)
//! ```
//! and the row's contributions are accumulated and combined as for every other type.
//! The crate docs' table gives each type's w, mul, d and e.

use gguf::GgmlType;

use crate::formats::{KVALUES_IQ4NL, QK_K, SUB};
use crate::grids::*;
use crate::ActQ8;

/// How a type's minimum enters the float sequence.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Min {
    /// No minimum.
    None,
    /// `c = fma(e * da, asum, c)`: a minimum per 32 values (Q4_1, Q5_1).
    Asum,
    /// `c = fma(e * da, ie, c)`, `ie` from the halves' integer mins (Q2_K).
    Halves,
    /// `c = fma(e * da, ie, c)`, `ie` = `emul`-weighted halves' dots Σ w·a: a second
    /// float scale for the second 16 values (NVFP4).
    Split,
}

/// Eight sub-blocks in the canonical integer form (see the module docs).
#[derive(Clone)]
pub(crate) struct Group {
    pub w: [i8; QK_K],
    pub mul: [i16; 16],
    pub d: [f32; 8],
    pub e: [f32; 8],
    pub emul: [i16; 16],
}

impl Default for Group {
    fn default() -> Self {
        Group {
            w: [0; QK_K],
            mul: [0; 16],
            d: [0.0; 8],
            e: [0.0; 8],
            emul: [0; 16],
        }
    }
}

/// One type: its block geometry, minimum kind and decoder.
#[derive(Clone, Copy)]
pub(crate) struct Spec {
    pub ty: GgmlType,
    pub block_bytes: usize,
    /// 32 or 256.
    pub block_vals: usize,
    pub min: Min,
    /// Decodes one block into the group: a 256-value block fills sub-blocks 0..8 (`j`
    /// is 0); a 64-value block sub-blocks `j`, `j + 1`; a 32-value block sub-block `j`.
    pub decode: DecodeFn,
    /// For blocks whose weights are a 16-entry table of their nibbles (IQ4_NL, MXFP4,
    /// NVFP4): the SIMD kernels look the weights up with a byte shuffle.
    pub lut: Option<Lut>,
}

/// How a table type's nibbles sit in a block (see [`Spec::lut`]).
#[derive(Clone, Copy)]
pub(crate) struct Lut {
    pub table: &'static [i8; 16],
    /// Offset of the block's nibble bytes: 16 a sub-block.
    pub qs: usize,
    /// The 16 bytes of a sub-block hold two runs of 8 (NVFP4's 16-value groups): values
    /// 0..8 and 16..24 are the low nibbles, 8..16 and 24..32 the high ones. Otherwise
    /// values 0..16 are the low nibbles and 16..32 the high ones.
    pub runs_of_8: bool,
    /// Decodes the block's scales alone.
    pub scales: DecodeFn,
}

/// A block decoder (see [`Spec::decode`]).
pub(crate) type DecodeFn = fn(&[u8], usize, &mut Group);

impl Spec {
    /// Blocks per group of 8 sub-blocks.
    #[inline]
    pub fn blocks_per_group(&self) -> usize {
        QK_K / self.block_vals
    }

    /// Bytes of a whole group.
    #[inline]
    pub fn group_bytes(&self) -> usize {
        self.blocks_per_group() * self.block_bytes
    }

    /// Decodes the first `n_sub` sub-blocks of the group whose bytes start `src`
    /// (`n_sub` < 8 only for a row's last group of 32- or 64-value blocks; a whole
    /// number of blocks).
    #[inline(always)]
    pub fn decode_group(&self, src: &[u8], n_sub: usize, g: &mut Group) {
        let per_block = self.block_vals / SUB;
        for b in 0..n_sub.div_ceil(per_block) {
            let blk = &src[b * self.block_bytes..(b + 1) * self.block_bytes];
            (self.decode)(blk, b * per_block, g);
        }
    }
}

const fn mk(
    ty: GgmlType,
    block_bytes: usize,
    block_vals: usize,
    min: Min,
    decode: fn(&[u8], usize, &mut Group),
) -> Spec {
    Spec {
        ty,
        block_bytes,
        block_vals,
        min,
        decode,
        lut: None,
    }
}

const fn with_lut(s: Spec, lut: Lut) -> Spec {
    Spec {
        lut: Some(lut),
        ..s
    }
}

/// The spec of `ty`, if it is one of this module's types.
pub(crate) const fn spec(ty: GgmlType) -> Option<Spec> {
    use GgmlType as T;
    Some(match ty {
        T::Q2_K => mk(ty, 84, QK_K, Min::Halves, decode_q2_k),
        T::Q3_K => mk(ty, 110, QK_K, Min::None, decode_q3_k),
        T::Q4_1 => mk(ty, 20, SUB, Min::Asum, decode_q4_1),
        T::Q5_0 => mk(ty, 22, SUB, Min::None, decode_q5_0),
        T::Q5_1 => mk(ty, 24, SUB, Min::Asum, decode_q5_1),
        T::IQ4_NL => with_lut(
            mk(ty, 18, SUB, Min::None, decode_iq4_nl),
            Lut {
                table: &KVALUES_IQ4NL,
                qs: 2,
                runs_of_8: false,
                scales: scales_iq4_nl,
            },
        ),
        T::MXFP4 => with_lut(
            mk(ty, 17, SUB, Min::None, decode_mxfp4),
            Lut {
                table: &KVALUES_MXFP4,
                qs: 1,
                runs_of_8: false,
                scales: scales_mxfp4,
            },
        ),
        T::TQ1_0 => mk(ty, 54, QK_K, Min::None, decode_tq1_0),
        T::TQ2_0 => mk(ty, 66, QK_K, Min::None, decode_tq2_0),
        T::IQ2_XXS => mk(ty, 66, QK_K, Min::None, decode_iq2_xxs),
        T::IQ2_XS => mk(ty, 74, QK_K, Min::None, decode_iq2_xs),
        T::IQ2_S => mk(ty, 82, QK_K, Min::None, decode_iq2_s),
        T::IQ3_XXS => mk(ty, 98, QK_K, Min::None, decode_iq3_xxs),
        T::IQ3_S => mk(ty, 110, QK_K, Min::None, decode_iq3_s),
        T::IQ1_S => mk(ty, 50, QK_K, Min::None, decode_iq1_s),
        T::IQ1_M => mk(ty, 56, QK_K, Min::None, decode_iq1_m),
        T::NVFP4 => with_lut(
            mk(ty, 36, 2 * SUB, Min::Split, decode_nvfp4),
            Lut {
                table: &KVALUES_MXFP4,
                qs: 4,
                runs_of_8: true,
                scales: scales_nvfp4,
            },
        ),
        _ => return None,
    })
}

/// [`spec`] of a type known to be one of this module's (for constants).
pub(crate) const fn spec_of(ty: GgmlType) -> Spec {
    match spec(ty) {
        Some(s) => s,
        None => panic!("not a low-bit type"),
    }
}

/// An f16 to f32, exactly, in plain integer and float operations (the decoders run
/// outside any target-feature function, where a library conversion may not use the
/// CPU's conversion instruction).
#[inline]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1F) as u32;
    let man = (h & 0x3FF) as u32;
    let mag = if exp == 0 {
        // Zero and subnormals: man · 2^-24, exact.
        (man as f32 * (1.0 / 16_777_216.0)).to_bits()
    } else if exp == 31 {
        0x7F80_0000 | (man << 13)
    } else {
        ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(sign | mag)
}

#[inline]
fn f16_at(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16_at(b, off))
}

#[inline]
fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

#[inline]
pub(crate) fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// The value of an MXFP4 block's e8m0 scale with the halving the doubled levels need:
/// 2^(e − 128), exact for every e (subnormal for e < 2).
#[inline]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// The MXFP4 (e2m1) levels, doubled so that they are integers.
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Byte masks of the 256 sign patterns: byte i is 0xFF where bit i is set.
static SIGN_MASKS: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut s = 0;
    while s < 256 {
        let mut i = 0;
        while i < 8 {
            if (s >> i) & 1 != 0 {
                t[s] |= 0xFF << (8 * i);
            }
            i += 1;
        }
        s += 1;
    }
    t
};

const LOW_BITS: u64 = 0x0101_0101_0101_0101;

/// Codebook bytes (each 1..=127) negated where `m` has 0xFF: `x ^ 0xFF` is −x − 1 and
/// adding 1 cannot carry out of a byte whose value was at least 1.
#[inline(always)]
fn negate_bytes(row: u64, m: u64) -> u64 {
    (row ^ m).wrapping_add(m & LOW_BITS)
}

/// Writes eight bytes (value i in byte i) as weights.
#[inline(always)]
fn put8(w: &mut [i8], v: u64) {
    for (o, b) in w[..8].iter_mut().zip(v.to_le_bytes()) {
        *o = b as i8;
    }
}

/// Eight codebook bytes with sign bits `s` (bit i set: value i negative) into `w`.
#[inline(always)]
fn signed8(row: u64, s: u8, w: &mut [i8]) {
    put8(w, negate_bytes(row, SIGN_MASKS[s as usize]));
}

/// Four codebook bytes with the sign bits `s` (bit i: value i) into `w`.
#[inline(always)]
fn signed4(row: u32, s: u8, w: &mut [i8]) {
    let v = negate_bytes(row as u64, SIGN_MASKS[(s & 0xF) as usize]) as u32;
    for (o, b) in w[..4].iter_mut().zip(v.to_le_bytes()) {
        *o = b as i8;
    }
}

/// Bytewise `a + b` (mod 256 in every byte, no carry between bytes).
#[inline(always)]
fn add_bytes(a: u64, b: u64) -> u64 {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    ((a & !HIGH).wrapping_add(b & !HIGH)) ^ ((a ^ b) & HIGH)
}

/// An IQ1 codebook row (bytes −1, 0, +1) as the weights 8·grid + δ (δ = ±1): the
/// shift's spill into the next byte lands in the bits the mask clears.
#[inline(always)]
fn iq1_row(row: u64, delta_neg: bool) -> u64 {
    let g8 = (row << 3) & 0xF8F8_F8F8_F8F8_F8F8;
    add_bytes(g8, if delta_neg { u64::MAX } else { LOW_BITS })
}

// ---------------------------------------------------------------------------------------
// Layouts and decoders. Offsets are bytes from the block's start; every field is
// little-endian; "value v" is the v-th value of the block in row order.
// ---------------------------------------------------------------------------------------

/// Q2_K (84 B / 256): `scales[16]` @0 (low nibble: the 16-value group's scale, high: its
/// min), `qs[64]` @16, `d` @80, `dmin` @82 (f16). Value 128c + 32k + l (c < 2, k < 4,
/// l < 32) is `q = (qs[32c + l] >> 2k) & 3`; group g = value / 16;
/// `y = (d * sc_g) * q − (dmin * m_g)`.
/// Canonical: w = q, mul = sc, d = d, e = −dmin, emul = m.
#[inline(always)]
fn decode_q2_k(b: &[u8], _: usize, g: &mut Group) {
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for j in 0..8 {
        let (c, k) = (j / 4, j % 4);
        for l in 0..32 {
            g.w[32 * j + l] = ((b[16 + 32 * c + l] >> (2 * k)) & 3) as i8;
        }
        for h in 0..2 {
            let s = b[2 * j + h];
            g.mul[2 * j + h] = (s & 0xF) as i16;
            g.emul[2 * j + h] = (s >> 4) as i16;
        }
        g.d[j] = d;
        g.e[j] = -dmin;
    }
}

/// The 16 signed 6-bit scales (−32..31) of a Q3_K block (`scales[12]` at s): group i's
/// low four bits are nibble i / 8 of byte i % 8, its high two bits are bits
/// 2·(i / 4) of byte 8 + i % 4.
#[inline]
pub(crate) fn q3_k_scale(s: &[u8], i: usize) -> i32 {
    let lo = (s[i % 8] >> (4 * (i / 8))) & 0xF;
    let hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    (lo | (hi << 4)) as i32 - 32
}

/// Q3_K (110 B / 256): `hmask[32]` @0, `qs[64]` @32, `scales[12]` @96, `d` @108. Value
/// v = 128c + 32k + l: `q = ((qs[32c + l] >> 2k) & 3) − (bit v/32 of hmask[l] ? 0 : 4)`
/// (−4..3); `y = (d * s_g) * q` with g = v / 16.
/// Canonical: w = q, mul = s, d = d.
#[inline(always)]
fn decode_q3_k(b: &[u8], _: usize, g: &mut Group) {
    let d = f16_at(b, 108);
    let sc = &b[96..108];
    for j in 0..8 {
        let (c, k) = (j / 4, j % 4);
        for l in 0..32 {
            let lo = ((b[32 + 32 * c + l] >> (2 * k)) & 3) as i8;
            let hbit = (b[l] >> j) & 1;
            g.w[32 * j + l] = lo - if hbit != 0 { 0 } else { 4 };
        }
        g.mul[2 * j] = q3_k_scale(sc, 2 * j) as i16;
        g.mul[2 * j + 1] = q3_k_scale(sc, 2 * j + 1) as i16;
        g.d[j] = d;
    }
}

/// The 4-bit quants of a 32-value block whose 16 nibble bytes start at `qs`: low
/// nibbles are values 0..15, high nibbles 16..31. (Fixed-size, branch-free loops: the
/// decoders are the SIMD kernels' front end.)
#[inline]
fn nibbles(b: &[u8], qs: usize) -> [u8; 32] {
    let q: &[u8; 16] = b[qs..qs + 16].try_into().unwrap();
    let mut out = [0u8; 32];
    for i in 0..16 {
        out[i] = q[i] & 0xF;
        out[i + 16] = q[i] >> 4;
    }
    out
}

/// Sub-block j's 32 weights.
#[inline]
fn sub_w(g: &mut Group, j: usize) -> &mut [i8; 32] {
    (&mut g.w[32 * j..32 * j + 32]).try_into().unwrap()
}

/// Q4_1 (20 B / 32): `d` @0, `m` @2, `qs[16]` @4; `y = (d * q) + m`.
/// Canonical: w = q (0..15), mul = 1, d = d, e = m (Min::Asum).
#[inline(always)]
fn decode_q4_1(b: &[u8], j: usize, g: &mut Group) {
    let q = nibbles(b, 4);
    let w = sub_w(g, j);
    for i in 0..32 {
        w[i] = q[i] as i8;
    }
    g.mul[2 * j] = 1;
    g.mul[2 * j + 1] = 1;
    g.d[j] = f16_at(b, 0);
    g.e[j] = f16_at(b, 2);
}

/// The 5-bit quants of a Q5_0/Q5_1 block (`qh` u32 at `qh`: bit i is value i's bit 4).
#[inline]
fn q5(b: &[u8], qh: usize, qs: usize) -> [u8; 32] {
    let mut q = nibbles(b, qs);
    let h = u32_at(b, qh);
    for (i, v) in q.iter_mut().enumerate() {
        *v |= (((h >> i) & 1) as u8) << 4;
    }
    q
}

/// Q5_0 (22 B / 32): `d` @0, `qh` (u32) @2, `qs[16]` @6; q = nibble | bit i of qh << 4;
/// `y = d * (q − 16)`. Canonical: w = q − 16, mul = 1, d = d.
#[inline(always)]
fn decode_q5_0(b: &[u8], j: usize, g: &mut Group) {
    let q = q5(b, 2, 6);
    let w = sub_w(g, j);
    for i in 0..32 {
        w[i] = q[i] as i8 - 16;
    }
    g.mul[2 * j] = 1;
    g.mul[2 * j + 1] = 1;
    g.d[j] = f16_at(b, 0);
}

/// Q5_1 (24 B / 32): `d` @0, `m` @2, `qh` @4, `qs[16]` @8; `y = (d * q) + m`.
/// Canonical: w = q (0..31), mul = 1, d = d, e = m (Min::Asum).
#[inline(always)]
fn decode_q5_1(b: &[u8], j: usize, g: &mut Group) {
    let q = q5(b, 4, 8);
    let w = sub_w(g, j);
    for i in 0..32 {
        w[i] = q[i] as i8;
    }
    g.mul[2 * j] = 1;
    g.mul[2 * j + 1] = 1;
    g.d[j] = f16_at(b, 0);
    g.e[j] = f16_at(b, 2);
}

/// IQ4_NL (18 B / 32): `d` @0, `qs[16]` @2; `y = d * K[q]` (the IQ4_XS levels).
/// Canonical: w = K[q], mul = 1, d = d.
#[inline(always)]
fn decode_iq4_nl(b: &[u8], j: usize, g: &mut Group) {
    let q = nibbles(b, 2);
    let w = sub_w(g, j);
    for i in 0..32 {
        w[i] = KVALUES_IQ4NL[(q[i] & 0xF) as usize];
    }
    scales_iq4_nl(b, j, g);
}

#[inline(always)]
fn scales_iq4_nl(b: &[u8], j: usize, g: &mut Group) {
    g.mul[2 * j] = 1;
    g.mul[2 * j + 1] = 1;
    g.d[j] = f16_at(b, 0);
}

/// MXFP4 (17 B / 32): `e` (e8m0) @0, `qs[16]` @1; `y = 2^(e−128) * K2[q]` with K2 the
/// doubled e2m1 levels. Canonical: w = K2[q], mul = 1, d = 2^(e−128).
#[inline(always)]
fn decode_mxfp4(b: &[u8], j: usize, g: &mut Group) {
    let q = nibbles(b, 1);
    let w = sub_w(g, j);
    for i in 0..32 {
        w[i] = KVALUES_MXFP4[(q[i] & 0xF) as usize];
    }
    scales_mxfp4(b, j, g);
}

#[inline(always)]
fn scales_mxfp4(b: &[u8], j: usize, g: &mut Group) {
    g.mul[2 * j] = 1;
    g.mul[2 * j + 1] = 1;
    g.d[j] = e8m0_half(b[0]);
}

/// NVFP4 (36 B / 64): `d[4]` (unsigned e4m3, one a 16-value group) @0, `qs[32]` @4; group
/// k's values 0..8 are the low nibbles of `qs[8k..8k + 8]`, 8..16 their high nibbles;
/// `y = ue4m3_half(d[k]) * K2[q]`. A block is sub-blocks j (groups 0, 1) and j + 1
/// (groups 2, 3). Canonical: w = K2[q], mul = (1, 0), emul = (0, 1), d = the first
/// group's scale, e = the second's (Min::Split).
#[inline(always)]
fn decode_nvfp4(b: &[u8], j: usize, g: &mut Group) {
    for k in 0..4 {
        let w = &mut g.w[32 * j + 16 * k..32 * j + 16 * k + 16];
        for i in 0..8 {
            let q = b[4 + 8 * k + i];
            w[i] = KVALUES_MXFP4[(q & 0xF) as usize];
            w[i + 8] = KVALUES_MXFP4[(q >> 4) as usize];
        }
    }
    scales_nvfp4(b, j, g);
}

#[inline(always)]
fn scales_nvfp4(b: &[u8], j: usize, g: &mut Group) {
    for h in 0..2 {
        let s = j + h;
        g.mul[2 * s] = 1;
        g.mul[2 * s + 1] = 0;
        g.emul[2 * s] = 0;
        g.emul[2 * s + 1] = 1;
        g.d[s] = ue4m3_half(b[2 * h]);
        g.e[s] = ue4m3_half(b[2 * h + 1]);
    }
}

/// An NVFP4 scale byte (unsigned e4m3: 4 exponent bits, bias 7, 3 mantissa bits; bit
/// 7 unused) with the halving the doubled levels need, exactly: 0 for 0x00 and 0x7F,
/// `m · 2^-10` for exponent 0, else `(8 + m) · 2^(e − 11)`.
#[inline]
pub(crate) fn ue4m3_half(b: u8) -> f32 {
    if b == 0 || b == 0x7F {
        return 0.0;
    }
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as u32);
    if e == 0 {
        // m · 2^-10: m's bits as an f32 mantissa under exponent 2^-10.
        m as f32 * (1.0 / 1024.0)
    } else {
        f32::from_bits((((e - 11 + 127 + 3) as u32) << 23) | (m << 20))
    }
}

const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// Trit n (0..=4) of a TQ1_0 byte, as −1, 0 or +1.
#[inline]
fn trit(byte: u8, n: usize) -> i8 {
    let q = byte.wrapping_mul(POW3[n]);
    ((q as u16 * 3) >> 8) as i8 - 1
}

/// The 256 ternary values of a TQ1_0 block in row order.
fn tq1_0_values(b: &[u8], w: &mut [i8]) {
    // Values 0..160: trit n of qs[l] is value 32n + l (l < 32).
    for n in 0..5 {
        for l in 0..32 {
            w[32 * n + l] = trit(b[l], n);
        }
    }
    // Values 160..240: trit n of qs[32 + l] is value 160 + 16n + l (l < 16).
    for n in 0..5 {
        for l in 0..16 {
            w[160 + 16 * n + l] = trit(b[32 + l], n);
        }
    }
    // Values 240..256: trit n (< 4) of qh[l] is value 240 + 4n + l (l < 4).
    for n in 0..4 {
        for l in 0..4 {
            w[240 + 4 * n + l] = trit(b[48 + l], n);
        }
    }
}

/// TQ1_0 (54 B / 256): `qs[48]` @0 (five base-3 digits per byte, read as
/// `((byte · 3^n mod 256) · 3) >> 8`), `qh[4]` @48 (four digits each), `d` @52;
/// `y = d * (digit − 1)`. Canonical: w = digit − 1, mul = 1, d = d.
#[inline(always)]
fn decode_tq1_0(b: &[u8], _: usize, g: &mut Group) {
    tq1_0_values(b, &mut g.w);
    g.mul = [1; 16];
    g.d = [f16_at(b, 52); 8];
}

/// TQ2_0 (66 B / 256): `qs[64]` @0, `d` @64; value 128c + 32k + l is
/// `((qs[32c + l] >> 2k) & 3) − 1`; `y = d * q`. Canonical: w = q, mul = 1, d = d.
#[inline(always)]
fn decode_tq2_0(b: &[u8], _: usize, g: &mut Group) {
    for j in 0..8 {
        let (c, k) = (j / 4, j % 4);
        for l in 0..32 {
            g.w[32 * j + l] = ((b[32 * c + l] >> (2 * k)) & 3) as i8 - 1;
        }
    }
    g.mul = [1; 16];
    g.d = [f16_at(b, 64); 8];
}

/// IQ2_XXS (66 B / 256): `d` @0, then per sub-block j two u32 at 2 + 8j: `a0` (four
/// codebook rows, one byte each, 8 values per row) and `a1` (four 7-bit sign indices at
/// bits 7k, `ls` in bits 28..32). `y = ((d * (0.5 + ls)) * 0.25) * grid * sign`.
/// Canonical: w = grid·sign, mul = 2·ls + 1, d = d / 8.
#[inline(always)]
fn decode_iq2_xxs(b: &[u8], _: usize, g: &mut Group) {
    let d = f16_at(b, 0);
    for j in 0..8 {
        let a0 = u32_at(b, 2 + 8 * j);
        let a1 = u32_at(b, 6 + 8 * j);
        for k in 0..4 {
            let row = IQ2XXS_GRID[((a0 >> (8 * k)) & 0xFF) as usize];
            let s = ksigns(a1 >> (7 * k));
            signed8(row, s, &mut g.w[32 * j + 8 * k..]);
        }
        let m = (2 * (a1 >> 28) + 1) as i16;
        g.mul[2 * j] = m;
        g.mul[2 * j + 1] = m;
        g.d[j] = d * 0.125;
    }
}

/// IQ2_XS (74 B / 256): `d` @0, `qs[32]` (u16) @2 — row r of the block: codebook row
/// `q & 511`, sign index `q >> 9` (values 8r..8r+8) —, `scales[8]` @66 (sub-block j:
/// low nibble the first 16 values, high the second). `y = ((d * (0.5 + ls)) * 0.25) *
/// grid * sign`. Canonical: w = grid·sign, mul = 2·ls + 1 per half, d = d / 8.
#[inline(always)]
fn decode_iq2_xs(b: &[u8], _: usize, g: &mut Group) {
    let d = f16_at(b, 0);
    for j in 0..8 {
        for k in 0..4 {
            let q = u16_at(b, 2 + 2 * (4 * j + k));
            let row = IQ2XS_GRID[(q & 511) as usize];
            signed8(row, ksigns((q >> 9) as u32), &mut g.w[32 * j + 8 * k..]);
        }
        let s = b[66 + j];
        g.mul[2 * j] = 2 * (s & 0xF) as i16 + 1;
        g.mul[2 * j + 1] = 2 * (s >> 4) as i16 + 1;
        g.d[j] = d * 0.125;
    }
}

/// IQ2_S (82 B / 256): `d` @0, `qs[32]` @2 (low 8 bits of row r's codebook index),
/// `signs[32]` @34 (row r's 8 sign bits), `qh[8]` @66 (bits 2·(r % 4) of byte r / 4:
/// the index's bits 8, 9), `scales[8]` @74 (as IQ2_XS). Canonical as IQ2_XS.
#[inline(always)]
fn decode_iq2_s(b: &[u8], _: usize, g: &mut Group) {
    let d = f16_at(b, 0);
    for j in 0..8 {
        for k in 0..4 {
            let r = 4 * j + k;
            let idx = b[2 + r] as usize | ((((b[66 + j] >> (2 * k)) & 3) as usize) << 8);
            signed8(IQ2S_GRID[idx], b[34 + r], &mut g.w[32 * j + 8 * k..]);
        }
        let s = b[74 + j];
        g.mul[2 * j] = 2 * (s & 0xF) as i16 + 1;
        g.mul[2 * j + 1] = 2 * (s >> 4) as i16 + 1;
        g.d[j] = d * 0.125;
    }
}

/// IQ3_XXS (98 B / 256): `d` @0, `qs[64]` @2 (one codebook row of 4 values per byte;
/// sub-block j: bytes 8j..8j+8), then per sub-block j a u32 @66 + 4j: four 7-bit sign
/// indices (bits 7k, each for 8 values) and `ls` (bits 28..32).
/// `y = ((d * (0.5 + ls)) * 0.5) * grid * sign`.
/// Canonical: w = grid·sign, mul = 2·ls + 1, d = d / 4.
#[inline(always)]
fn decode_iq3_xxs(b: &[u8], _: usize, g: &mut Group) {
    let d = f16_at(b, 0);
    for j in 0..8 {
        let aux = u32_at(b, 66 + 4 * j);
        for k in 0..4 {
            let s = ksigns(aux >> (7 * k));
            let r0 = IQ3XXS_GRID[b[2 + 8 * j + 2 * k] as usize];
            let r1 = IQ3XXS_GRID[b[2 + 8 * j + 2 * k + 1] as usize];
            signed4(r0, s, &mut g.w[32 * j + 8 * k..]);
            signed4(r1, s >> 4, &mut g.w[32 * j + 8 * k + 4..]);
        }
        let m = (2 * (aux >> 28) + 1) as i16;
        g.mul[2 * j] = m;
        g.mul[2 * j + 1] = m;
        g.d[j] = d * 0.25;
    }
}

/// IQ3_S (110 B / 256): `d` @0, `qs[64]` @2 (low 8 bits of row r's index, 4 values per
/// row), `qh[8]` @66 (bit r % 8 of byte r / 8: the index's bit 8), `signs[32]` @74
/// (byte t: values 8t..8t+8), `scales[4]` @106 (sub-block j: nibble j % 2 of byte j / 2).
/// `y = ((d * (1 + 2·sc)) * grid) * sign`. Canonical: w = grid·sign, mul = 1 + 2·sc, d = d.
#[inline(always)]
fn decode_iq3_s(b: &[u8], _: usize, g: &mut Group) {
    let d = f16_at(b, 0);
    for j in 0..8 {
        for k in 0..8 {
            let r = 8 * j + k;
            let idx = b[2 + r] as usize | ((((b[66 + j] >> k) & 1) as usize) << 8);
            let s = b[74 + r / 2] >> (4 * (r % 2));
            signed4(IQ3S_GRID[idx], s, &mut g.w[4 * r..]);
        }
        let sc = (b[106 + j / 2] >> (4 * (j % 2))) & 0xF;
        let m = 1 + 2 * sc as i16;
        g.mul[2 * j] = m;
        g.mul[2 * j + 1] = m;
        g.d[j] = d;
    }
}

/// IQ1_S (50 B / 256): `d` @0, `qs[32]` @2 (low 8 bits of row r's index, 8 values of
/// −1, 0, +1 per row), `qh[8]` (u16) @34 — sub-block j: bits 3k..3k+3 the index's bits
/// 8..10 of row 4j + k, bits 12..14 `s`, bit 15 the sign of δ —;
/// `y = (d * (2s + 1)) * (grid + δ)` with δ = ±0.125.
/// Canonical: w = 8·grid ± 1 (the sign of δ), mul = 2s + 1, d = d / 8.
#[inline(always)]
fn decode_iq1_s(b: &[u8], _: usize, g: &mut Group) {
    let d = f16_at(b, 0);
    for j in 0..8 {
        let qh = u16_at(b, 34 + 2 * j);
        let delta: i8 = if qh & 0x8000 != 0 { -1 } else { 1 };
        for k in 0..4 {
            let idx = b[2 + 4 * j + k] as usize | ((((qh >> (3 * k)) & 7) as usize) << 8);
            put8(
                &mut g.w[32 * j + 8 * k..],
                iq1_row(IQ1S_GRID[idx], delta < 0),
            );
        }
        let m = 2 * ((qh >> 12) & 7) as i16 + 1;
        g.mul[2 * j] = m;
        g.mul[2 * j + 1] = m;
        g.d[j] = d * 0.125;
    }
}

/// The f16 scale of an IQ1_M block: the top nibbles of its four u16 scale words.
#[inline]
pub(crate) fn iq1_m_d(b: &[u8]) -> f32 {
    let mut bits = 0u16;
    for u in 0..4 {
        bits |= (u16_at(b, 48 + 2 * u) & 0xF000) >> (12 - 4 * u);
    }
    f16_to_f32(bits)
}

/// IQ1_M (56 B / 256): `qs[32]` @0 (low 8 bits of row r's index), `qh[16]` @32 (nibble
/// r % 2 of byte r / 2: bits 0..2 the index's bits 8..10, bit 3 the sign of row r's δ),
/// `scales` (four u16) @48: 3-bit scale i (16-value group i) at bits 3·(i % 4) of word
/// i / 4, the f16 `d` in the words' top nibbles (word u's in bits 4u..4u+4).
/// `y = (d * (2s + 1)) * (grid + δ)`. Canonical: w = 8·grid ± 1, mul = 2s + 1 per half,
/// d = d / 8.
#[inline(always)]
fn decode_iq1_m(b: &[u8], _: usize, g: &mut Group) {
    let d = iq1_m_d(b);
    for j in 0..8 {
        for k in 0..4 {
            let r = 4 * j + k;
            let nib = (b[32 + r / 2] >> (4 * (r % 2))) & 0xF;
            let idx = b[r] as usize | (((nib & 7) as usize) << 8);
            let delta: i8 = if nib & 8 != 0 { -1 } else { 1 };
            put8(&mut g.w[8 * r..], iq1_row(IQ1S_GRID[idx], delta < 0));
        }
        for h in 0..2 {
            let i = 2 * j + h;
            let s = (u16_at(b, 48 + 2 * (i / 4)) >> (3 * (i % 4))) & 7;
            g.mul[i] = 2 * s as i16 + 1;
        }
        g.d[j] = d * 0.125;
    }
}

/// A low-bit type as a compile-time constant: the SIMD kernels are built per type, so
/// its decoder is inlined into them (and compiled for their vector level).
pub(crate) trait Kind {
    const SPEC: Spec;
}

/// The [`Kind`] of each type, named as the type.
#[allow(non_camel_case_types)]
pub(crate) mod kinds {
    use super::{spec_of, Kind, Spec};
    use gguf::GgmlType;

    macro_rules! kinds {
        ($($t:ident),+) => {
            $(
                pub(crate) struct $t;
                impl Kind for $t {
                    const SPEC: Spec = spec_of(GgmlType::$t);
                }
            )+
        };
    }

    kinds!(
        Q2_K, Q3_K, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, TQ1_0, TQ2_0, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
        IQ3_S, IQ1_S, IQ1_M, NVFP4
    );
}

// ---------------------------------------------------------------------------------------
// The scalar reference dot.
// ---------------------------------------------------------------------------------------

/// The contribution of decoded sub-block j against activation sub-block s (the
/// sequence of the module docs).
#[inline]
pub(crate) fn contrib(min: Min, g: &Group, j: usize, xq: &ActQ8, s: usize) -> f32 {
    let a = &xq.qs[SUB * s..SUB * s + SUB];
    let w = &g.w[SUB * j..SUB * j + SUB];
    let mut lo = 0i32;
    let mut hi = 0i32;
    for i in 0..16 {
        lo += w[i] as i32 * a[i] as i32;
        hi += w[i + 16] as i32 * a[i + 16] as i32;
    }
    let is = g.mul[2 * j] as i32 * lo + g.mul[2 * j + 1] as i32 * hi;
    let da = xq.d[s];
    let mut c = (g.d[j] * da) * is as f32;
    match min {
        Min::None => {}
        Min::Asum => c = (g.e[j] * da).mul_add(xq.sums[s] as f32, c),
        Min::Halves => {
            let alo: i32 = a[..16].iter().map(|&v| v as i32).sum();
            let ahi: i32 = a[16..].iter().map(|&v| v as i32).sum();
            let ie = g.emul[2 * j] as i32 * alo + g.emul[2 * j + 1] as i32 * ahi;
            c = (g.e[j] * da).mul_add(ie as f32, c);
        }
        Min::Split => {
            let ie = g.emul[2 * j] as i32 * lo + g.emul[2 * j + 1] as i32 * hi;
            c = (g.e[j] * da).mul_add(ie as f32, c);
        }
    }
    c
}

/// Adds the contributions of sub-blocks `s0..s0 + n_sub` of a row (decoded in `g`) to
/// their accumulators.
#[inline]
pub(crate) fn add_group(
    min: Min,
    g: &Group,
    n_sub: usize,
    xq: &ActQ8,
    s0: usize,
    acc: &mut [f32; 32],
) {
    for j in 0..n_sub {
        let s = s0 + j;
        acc[s % 32] += contrib(min, g, j, xq, s);
    }
}

/// The scalar dot of one row of `sp`'s type (the reference every level reproduces).
pub(crate) fn dot(sp: &Spec, row: &[u8], xq: &ActQ8) -> f32 {
    let n_sub = row.len() / sp.block_bytes * sp.block_vals / SUB;
    let gb = sp.group_bytes();
    let mut acc = [0f32; 32];
    let mut g = Group::default();
    let mut s0 = 0;
    while s0 < n_sub {
        let n = (n_sub - s0).min(8);
        let off = s0 / 8 * gb;
        sp.decode_group(&row[off..], n, &mut g);
        add_group(sp.min, &g, n, xq, s0, &mut acc);
        s0 += n;
    }
    crate::combine_lanes(acc)
}

/// Generates the `fn(&[u8], &ActQ8) -> f32` scalar kernel of each type.
macro_rules! scalar_fns {
    ($($name:ident => $ty:ident),+ $(,)?) => {
        $(
            pub(crate) fn $name(row: &[u8], xq: &ActQ8) -> f32 {
                const SP: Spec = spec_of(GgmlType::$ty);
                dot(&SP, row, xq)
            }
        )+
        /// The scalar kernel of a type of this module.
        pub(crate) fn scalar_kernel(ty: GgmlType) -> Option<fn(&[u8], &ActQ8) -> f32> {
            Some(match ty {
                $(GgmlType::$ty => $name,)+
                _ => return None,
            })
        }
    };
}

scalar_fns!(
    dot_q2_k => Q2_K,
    dot_q3_k => Q3_K,
    dot_q4_1 => Q4_1,
    dot_q5_0 => Q5_0,
    dot_q5_1 => Q5_1,
    dot_iq4_nl => IQ4_NL,
    dot_mxfp4 => MXFP4,
    dot_tq1_0 => TQ1_0,
    dot_tq2_0 => TQ2_0,
    dot_iq2_xxs => IQ2_XXS,
    dot_iq2_xs => IQ2_XS,
    dot_iq2_s => IQ2_S,
    dot_iq3_xxs => IQ3_XXS,
    dot_iq3_s => IQ3_S,
    dot_iq1_s => IQ1_S,
    dot_iq1_m => IQ1_M,
    dot_nvfp4 => NVFP4,
);

// ---------------------------------------------------------------------------------------
// Dequantization: per value, the float operations of each layout's formula in the
// order written there (products rounded one by one, never fused).
// ---------------------------------------------------------------------------------------

/// Dequantizes whole blocks of `sp`'s type: `dst.len()` values from `src`.
pub(crate) fn dequantize(sp: &Spec, src: &[u8], dst: &mut [f32]) {
    use GgmlType as T;
    let mut g = Group::default();
    for (b, blk) in src.chunks_exact(sp.block_bytes).enumerate() {
        let y = &mut dst[b * sp.block_vals..(b + 1) * sp.block_vals];
        // A 32- or 64-value block decodes into the group's first sub-blocks.
        (sp.decode)(blk, 0, &mut g);
        let n_sub = sp.block_vals / SUB;
        for j in 0..n_sub {
            let w = &g.w[SUB * j..SUB * j + SUB];
            let ys = &mut y[SUB * j..SUB * j + SUB];
            for (i, (o, &q)) in ys.iter_mut().zip(w).enumerate() {
                let h = 2 * j + i / 16;
                let (m, q) = (g.mul[h] as f32, q as f32);
                *o = match sp.ty {
                    // (d * sc) * q - (dmin * m); e = -dmin.
                    T::Q2_K => (g.d[j] * m) * q - (-g.e[j] * g.emul[h] as f32),
                    T::Q3_K => (g.d[j] * m) * q,
                    T::Q4_1 | T::Q5_1 => (g.d[j] * q) + g.e[j],
                    T::Q5_0 | T::IQ4_NL | T::MXFP4 | T::TQ1_0 | T::TQ2_0 => g.d[j] * q,
                    // The group's own scale: d for the first 16 values, e for the second.
                    T::NVFP4 => [g.d[j], g.e[j]][i / 16] * q,
                    T::IQ2_XXS | T::IQ2_XS | T::IQ2_S => {
                        // d = 8·D; ls = (mul − 1) / 2.
                        let ls = ((g.mul[h] - 1) / 2) as f32;
                        let db = ((g.d[j] * 8.0) * (0.5 + ls)) * 0.25;
                        (db * q.abs()) * q.signum()
                    }
                    T::IQ3_XXS => {
                        let ls = ((g.mul[h] - 1) / 2) as f32;
                        let db = ((g.d[j] * 4.0) * (0.5 + ls)) * 0.5;
                        (db * q.abs()) * q.signum()
                    }
                    T::IQ3_S => ((g.d[j] * m) * q.abs()) * q.signum(),
                    // (d * (2s + 1)) * (grid + δ), grid + δ = w / 8 (exact).
                    T::IQ1_S | T::IQ1_M => ((g.d[j] * 8.0) * m) * (q * 0.125),
                    other => unreachable!("{other} is not a low-bit type"),
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = super::f16_to_f32(h);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}: {got} vs {want}"
            );
        }
    }
}
