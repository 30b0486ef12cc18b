//! The scalar canonical kernels: the reference definition of every dot product.
//!
//! Each function here performs exactly the operations listed in the crate docs;
//! the SIMD kernels must reproduce their results bit for bit.

use crate::formats::*;
use crate::{combine_lanes, ActQ8};

#[inline]
fn idot_i8(w: &[i8], a: &[i8]) -> i32 {
    w.iter().zip(a).map(|(&x, &y)| x as i32 * y as i32).sum()
}

#[inline]
fn idot_u8(w: &[u8], a: &[i8]) -> i32 {
    w.iter().zip(a).map(|(&x, &y)| x as i32 * y as i32).sum()
}

/// Contribution of Q8_0 block `s`: `c = (d * da) * isum`.
#[inline]
pub(crate) fn q8_0_contrib(blk: &[u8], s: usize, xq: &ActQ8) -> f32 {
    let d = f16_at(blk, 0);
    let a = &xq.qs[SUB * s..SUB * s + SUB];
    let mut isum = 0i32;
    for i in 0..SUB {
        isum += (blk[2 + i] as i8) as i32 * a[i] as i32;
    }
    (d * xq.d[s]) * isum as f32
}

/// Contribution of Q4_0 block `s`: `isum = Σ (q - 8)·a`, `c = (d * da) * isum`.
#[inline]
pub(crate) fn q4_0_contrib(blk: &[u8], s: usize, xq: &ActQ8) -> f32 {
    let d = f16_at(blk, 0);
    let a = &xq.qs[SUB * s..SUB * s + SUB];
    let mut isum = 0i32;
    for j in 0..16 {
        let q = blk[2 + j];
        isum += ((q & 0xF) as i32 - 8) * a[j] as i32;
        isum += ((q >> 4) as i32 - 8) * a[j + 16] as i32;
    }
    (d * xq.d[s]) * isum as f32
}

pub(crate) fn dot_q8_0(row: &[u8], xq: &ActQ8) -> f32 {
    let mut acc = [0f32; 32];
    for (s, blk) in row.chunks_exact(Q8_0_BYTES).enumerate() {
        acc[s % 32] += q8_0_contrib(blk, s, xq);
    }
    combine_lanes(acc)
}

pub(crate) fn dot_q4_0(row: &[u8], xq: &ActQ8) -> f32 {
    let mut acc = [0f32; 32];
    for (s, blk) in row.chunks_exact(Q4_0_BYTES).enumerate() {
        acc[s % 32] += q4_0_contrib(blk, s, xq);
    }
    combine_lanes(acc)
}

/// Q4_K and Q5_K: per sub-block j of a block (sub-block s of the row)
/// `c = (d * da) * (sc·isum)`, `c = fma(-(dmin * da), m·asum, c)`.
fn dot_k(five_bits: bool, row: &[u8], xq: &ActQ8) -> f32 {
    let bytes = if five_bits { Q5_K_BYTES } else { Q4_K_BYTES };
    let mut acc = [0f32; 32];
    let mut q = [0u8; QK_K];
    for (b, blk) in row.chunks_exact(bytes).enumerate() {
        if five_bits {
            q5_k_values(blk, &mut q);
        } else {
            q4_k_values(blk, &mut q);
        }
        let d = f16_at(blk, 0);
        let dmin = f16_at(blk, 2);
        for j in 0..8 {
            let s = 8 * b + j;
            let (sc, m) = k_scale_min(&blk[4..16], j);
            let isum = idot_u8(&q[SUB * j..SUB * j + SUB], &xq.qs[SUB * s..SUB * s + SUB]);
            let is = sc as i32 * isum;
            let im = m as i32 * xq.sums[s];
            let da = xq.d[s];
            let mut c = (d * da) * is as f32;
            c = (-(dmin * da)).mul_add(im as f32, c);
            acc[s % 32] += c;
        }
    }
    combine_lanes(acc)
}

pub(crate) fn dot_q4_k(row: &[u8], xq: &ActQ8) -> f32 {
    dot_k(false, row, xq)
}

pub(crate) fn dot_q5_k(row: &[u8], xq: &ActQ8) -> f32 {
    dot_k(true, row, xq)
}

/// Q6_K: `isum = sc[2j]·Σ_{i<16} q·a + sc[2j+1]·Σ_{i≥16} q·a` (exact), `c = (d * da) * isum`.
pub(crate) fn dot_q6_k(row: &[u8], xq: &ActQ8) -> f32 {
    let mut acc = [0f32; 32];
    let mut q = [0i8; QK_K];
    for (b, blk) in row.chunks_exact(Q6_K_BYTES).enumerate() {
        q6_k_values(blk, &mut q);
        let d = f16_at(blk, 208);
        for j in 0..8 {
            let s = 8 * b + j;
            let a = &xq.qs[SUB * s..SUB * s + SUB];
            let lo = idot_i8(&q[SUB * j..SUB * j + 16], &a[..16]);
            let hi = idot_i8(&q[SUB * j + 16..SUB * j + 32], &a[16..]);
            let isum = (blk[192 + 2 * j] as i8) as i32 * lo + (blk[193 + 2 * j] as i8) as i32 * hi;
            acc[s % 32] += (d * xq.d[s]) * isum as f32;
        }
    }
    combine_lanes(acc)
}

/// IQ4_XS: `isum = (ls - 32)·Σ K[q]·a` (exact), `c = (d * da) * isum`.
pub(crate) fn dot_iq4_xs(row: &[u8], xq: &ActQ8) -> f32 {
    let mut acc = [0f32; 32];
    for (b, blk) in row.chunks_exact(IQ4_XS_BYTES).enumerate() {
        let d = f16_at(blk, 0);
        for j in 0..8 {
            let s = 8 * b + j;
            let a = &xq.qs[SUB * s..SUB * s + SUB];
            let qs = &blk[8 + 16 * j..8 + 16 * j + 16];
            let mut raw = 0i32;
            for l in 0..16 {
                raw += KVALUES_IQ4NL[(qs[l] & 0xF) as usize] as i32 * a[l] as i32;
                raw += KVALUES_IQ4NL[(qs[l] >> 4) as usize] as i32 * a[l + 16] as i32;
            }
            let isum = iq4_xs_scale(blk, j) * raw;
            acc[s % 32] += (d * xq.d[s]) * isum as f32;
        }
    }
    combine_lanes(acc)
}

/// Element `i` of an F32 row.
#[inline]
pub(crate) fn f32_at(row: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]])
}

/// Element `i` of an F16 row, widened (exactly).
#[inline]
pub(crate) fn f16_elem(row: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32()
}

/// Element `i` of a BF16 row, widened (exactly).
#[inline]
pub(crate) fn bf16_elem(row: &[u8], i: usize) -> f32 {
    bf16_bits_to_f32(u16::from_le_bytes([row[2 * i], row[2 * i + 1]]))
}

/// Elements `range` of a float row into their accumulators, `acc[i % 32] =
/// fma(w_i, x_i, acc[i % 32])` in increasing i. The whole scalar dot is this over
/// every element; the SIMD kernels use it for the elements after the last whole
/// 32-value group, so a row of any length keeps the canonical order.
#[inline]
pub(crate) fn float_tail(
    acc: &mut [f32; 32],
    range: std::ops::Range<usize>,
    x: &[f32],
    weight: impl Fn(usize) -> f32,
) {
    for i in range {
        acc[i % 32] = weight(i).mul_add(x[i], acc[i % 32]);
    }
}

/// Float rows (any length): element i goes to accumulator i % 32 as `acc = fma(w, x, acc)`.
fn dot_float(n: usize, x: &[f32], weight: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; 32];
    float_tail(&mut acc, 0..n, x, weight);
    combine_lanes(acc)
}

pub(crate) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    dot_float(row.len() / 4, x, |i| f32_at(row, i))
}

pub(crate) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_float(row.len() / 2, x, |i| f16_elem(row, i))
}

pub(crate) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    dot_float(row.len() / 2, x, |i| bf16_elem(row, i))
}

/// Activation quantization of one 32-value block (the one definition).
#[inline]
pub(crate) fn quantize_act_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let mut amax = 0.0f32;
    for &v in x {
        let a = v.abs();
        // `a > amax` (not f32::max) so that the SIMD max instruction's rule is the same.
        if a > amax {
            amax = a;
        }
    }
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    let mut sum = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        *o = r;
        sum += r as i32;
    }
    (d, sum)
}
