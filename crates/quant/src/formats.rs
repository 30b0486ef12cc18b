//! Block layouts of the first supported types (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K,
//! Q6_K, IQ4_XS): byte offsets, scale unpacking, dequantization and the simple
//! round-to-nearest quantizers. The low-bit types added after them (Q2_K, Q3_K, Q4_1,
//! Q5_0, Q5_1, IQ4_NL, MXFP4, TQ1_0, TQ2_0 and the IQ1/IQ2/IQ3 types) are in `lowbit.rs`,
//! which `dequantize` and `quantize` hand them to.
//!
//! Layouts follow the ggml block structs exactly (see section C.2 of the format
//! notes); all multi-byte fields are little-endian.

use half::{bf16, f16};

/// Values per sub-block: the unit of the canonical reduction order.
pub const SUB: usize = 32;

pub const Q8_0_BYTES: usize = 34;
pub const Q4_0_BYTES: usize = 18;
pub const QK_K: usize = 256;
pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;
pub const IQ4_XS_BYTES: usize = 136;

/// The 16 non-uniform levels of IQ4_NL / IQ4_XS.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[inline]
pub fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// 6-bit scales and mins of a Q4_K / Q5_K block (`scales[12]`), sub-block j = 0..8.
#[inline]
pub fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Quant values (0..15) of a Q4_K block in element order.
#[inline]
pub fn q4_k_values(blk: &[u8], out: &mut [u8; QK_K]) {
    let qs = &blk[16..144];
    for c in 0..4 {
        for l in 0..32 {
            let q = qs[32 * c + l];
            out[64 * c + l] = q & 0xF;
            out[64 * c + 32 + l] = q >> 4;
        }
    }
}

/// Quant values (0..31) of a Q5_K block in element order.
#[inline]
pub fn q5_k_values(blk: &[u8], out: &mut [u8; QK_K]) {
    let qh = &blk[16..48];
    let ql = &blk[48..176];
    for c in 0..4 {
        let u1 = 1u8 << (2 * c);
        let u2 = 2u8 << (2 * c);
        for l in 0..32 {
            let q = ql[32 * c + l];
            out[64 * c + l] = (q & 0xF) + if qh[l] & u1 != 0 { 16 } else { 0 };
            out[64 * c + 32 + l] = (q >> 4) + if qh[l] & u2 != 0 { 16 } else { 0 };
        }
    }
}

/// Quant values (-32..31) of a Q6_K block in element order.
#[inline]
pub fn q6_k_values(blk: &[u8], out: &mut [i8; QK_K]) {
    for h in 0..2 {
        let ql = &blk[64 * h..64 * h + 64];
        let qh = &blk[128 + 32 * h..128 + 32 * h + 32];
        let y = &mut out[128 * h..128 * h + 128];
        for l in 0..32 {
            let hb = qh[l];
            y[l] = ((ql[l] & 0xF) | ((hb & 3) << 4)) as i8 - 32;
            y[l + 32] = ((ql[l + 32] & 0xF) | (((hb >> 2) & 3) << 4)) as i8 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((hb >> 4) & 3) << 4)) as i8 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((hb >> 6) & 3) << 4)) as i8 - 32;
        }
    }
}

/// Signed 6-bit sub-block scale `ls - 32` of an IQ4_XS block, ib = 0..8.
#[inline]
pub fn iq4_xs_scale(blk: &[u8], ib: usize) -> i32 {
    let scales_h = u16::from_le_bytes([blk[2], blk[3]]) as i32;
    let lo = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) as i32;
    let hi = (scales_h >> (2 * ib)) & 3;
    (lo | (hi << 4)) - 32
}

/// Dequantizes `dst.len()` values; `src` must hold exactly that many (checked by the caller).
///
/// Float sequences (all f32, no fused operations):
/// - Q8_0: `d * q`;  Q4_0: `d * (q - 8)` (the integer is converted exactly);
/// - Q4_K / Q5_K: `d1 = d * sc`, `m1 = dmin * m`, `y = d1 * q - m1` (product rounded, then subtract);
/// - Q6_K: `y = (d * sc) * q`;  IQ4_XS: `dl = d * (ls - 32)`, `y = dl * K[q]`.
pub(crate) fn dequantize(ty: gguf::GgmlType, src: &[u8], dst: &mut [f32]) {
    use gguf::GgmlType as T;
    match ty {
        T::F32 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        T::F16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        T::BF16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        T::Q8_0 => {
            for (y, blk) in dst.chunks_exact_mut(32).zip(src.chunks_exact(Q8_0_BYTES)) {
                let d = f16_at(blk, 0);
                for (v, &q) in y.iter_mut().zip(&blk[2..34]) {
                    *v = d * (q as i8) as f32;
                }
            }
        }
        T::Q4_0 => {
            for (y, blk) in dst.chunks_exact_mut(32).zip(src.chunks_exact(Q4_0_BYTES)) {
                let d = f16_at(blk, 0);
                for j in 0..16 {
                    let q = blk[2 + j];
                    y[j] = d * ((q & 0xF) as i32 - 8) as f32;
                    y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        T::Q4_K | T::Q5_K => {
            let bytes = if ty == T::Q4_K {
                Q4_K_BYTES
            } else {
                Q5_K_BYTES
            };
            let mut q = [0u8; QK_K];
            for (y, blk) in dst.chunks_exact_mut(QK_K).zip(src.chunks_exact(bytes)) {
                let d = f16_at(blk, 0);
                let dmin = f16_at(blk, 2);
                if ty == T::Q4_K {
                    q4_k_values(blk, &mut q);
                } else {
                    q5_k_values(blk, &mut q);
                }
                for j in 0..8 {
                    let (sc, m) = k_scale_min(&blk[4..16], j);
                    let d1 = d * sc as f32;
                    let m1 = dmin * m as f32;
                    for l in 0..SUB {
                        y[SUB * j + l] = d1 * q[SUB * j + l] as f32 - m1;
                    }
                }
            }
        }
        T::Q6_K => {
            let mut q = [0i8; QK_K];
            for (y, blk) in dst.chunks_exact_mut(QK_K).zip(src.chunks_exact(Q6_K_BYTES)) {
                let d = f16_at(blk, 208);
                q6_k_values(blk, &mut q);
                for (g, (yg, qg)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
                    let ds = d * (blk[192 + g] as i8) as f32;
                    for (v, &qv) in yg.iter_mut().zip(qg) {
                        *v = ds * qv as f32;
                    }
                }
            }
        }
        T::IQ4_XS => {
            for (y, blk) in dst
                .chunks_exact_mut(QK_K)
                .zip(src.chunks_exact(IQ4_XS_BYTES))
            {
                let d = f16_at(blk, 0);
                for ib in 0..8 {
                    let dl = d * iq4_xs_scale(blk, ib) as f32;
                    let qs = &blk[8 + 16 * ib..8 + 16 * ib + 16];
                    let ys = &mut y[SUB * ib..SUB * ib + SUB];
                    for j in 0..16 {
                        ys[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
                        ys[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
                    }
                }
            }
        }
        other => match crate::lowbit::spec(other) {
            Some(sp) => crate::lowbit::dequantize(&sp, src, dst),
            None => unreachable!("dequantize called for unsupported type {other}"),
        },
    }
}

fn put_f16(dst: &mut [u8], off: usize, v: f32) -> f32 {
    let h = f16::from_f32(v);
    dst[off..off + 2].copy_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Value of largest magnitude, with its sign.
fn signed_max(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// Simple round-to-nearest quantizers for tests and synthetic models. They are
/// not llama.cpp's quantizers (those search for better scales); any output is
/// a valid block of the format.
pub(crate) fn quantize(ty: gguf::GgmlType, src: &[f32], dst: &mut [u8]) {
    use gguf::GgmlType as T;
    match ty {
        T::F32 => {
            for (b, v) in dst.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        T::F16 => {
            for (b, v) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        T::BF16 => {
            for (b, v) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        T::Q8_0 => {
            for (blk, x) in dst.chunks_exact_mut(Q8_0_BYTES).zip(src.chunks_exact(32)) {
                let d = put_f16(blk, 0, amax(x) / 127.0);
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                for (b, v) in blk[2..].iter_mut().zip(x) {
                    *b = (v * id).round().clamp(-127.0, 127.0) as i8 as u8;
                }
            }
        }
        T::Q4_0 => {
            for (blk, x) in dst.chunks_exact_mut(Q4_0_BYTES).zip(src.chunks_exact(32)) {
                let d = put_f16(blk, 0, signed_max(x) / -8.0);
                let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                let q = |v: f32| (v * id + 8.5).floor().clamp(0.0, 15.0) as u8;
                for j in 0..16 {
                    blk[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
                }
            }
        }
        T::Q4_K | T::Q5_K => quantize_k(ty == T::Q5_K, src, dst),
        T::Q6_K => quantize_q6_k(src, dst),
        T::IQ4_XS => quantize_iq4_xs(src, dst),
        other => match crate::lowbit::spec(other) {
            Some(sp) => crate::lowbit_quantize::quantize(&sp, src, dst),
            None => unreachable!("quantize called for unsupported type {other}"),
        },
    }
}

fn quantize_k(five_bits: bool, src: &[f32], dst: &mut [u8]) {
    let bytes = if five_bits { Q5_K_BYTES } else { Q4_K_BYTES };
    let nmax = if five_bits { 31.0f32 } else { 15.0 };
    for (blk, x) in dst.chunks_exact_mut(bytes).zip(src.chunks_exact(QK_K)) {
        blk.fill(0);
        // Per sub-block affine range [-min, -min + scale * nmax] covering 0.
        let mut scale = [0f32; 8];
        let mut minv = [0f32; 8];
        for j in 0..8 {
            let xs = &x[SUB * j..SUB * j + SUB];
            let lo = xs.iter().fold(0.0f32, |m, &v| m.min(v));
            let hi = xs.iter().fold(0.0f32, |m, &v| m.max(v));
            scale[j] = (hi - lo) / nmax;
            minv[j] = -lo;
        }
        let d = put_f16(blk, 0, scale.iter().fold(0.0f32, |m, &v| m.max(v)) / 63.0);
        let dmin = put_f16(blk, 2, minv.iter().fold(0.0f32, |m, &v| m.max(v)) / 63.0);
        let mut sc = [0u8; 8];
        let mut mm = [0u8; 8];
        for j in 0..8 {
            sc[j] = if d == 0.0 {
                0
            } else {
                (scale[j] / d).round().clamp(0.0, 63.0) as u8
            };
            mm[j] = if dmin == 0.0 {
                0
            } else {
                (minv[j] / dmin).round().clamp(0.0, 63.0) as u8
            };
        }
        {
            let s = &mut blk[4..16];
            for j in 0..8 {
                if j < 4 {
                    s[j] = sc[j];
                    s[j + 4] = mm[j];
                } else {
                    s[j + 4] = (sc[j] & 0xF) | ((mm[j] & 0xF) << 4);
                    s[j - 4] |= (sc[j] >> 4) << 6;
                    s[j] |= (mm[j] >> 4) << 6;
                }
            }
        }
        let mut q = [0u8; QK_K];
        for j in 0..8 {
            let d1 = d * sc[j] as f32;
            let m1 = dmin * mm[j] as f32;
            let id = if d1 == 0.0 { 0.0 } else { 1.0 / d1 };
            for l in 0..SUB {
                q[SUB * j + l] = ((x[SUB * j + l] + m1) * id).round().clamp(0.0, nmax) as u8;
            }
        }
        if five_bits {
            for c in 0..4 {
                for l in 0..32 {
                    let a = q[64 * c + l];
                    let b = q[64 * c + 32 + l];
                    blk[48 + 32 * c + l] = (a & 0xF) | ((b & 0xF) << 4);
                    blk[16 + l] |= ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1));
                }
            }
        } else {
            for c in 0..4 {
                for l in 0..32 {
                    blk[16 + 32 * c + l] = q[64 * c + l] | (q[64 * c + 32 + l] << 4);
                }
            }
        }
    }
}

fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    for (blk, x) in dst.chunks_exact_mut(Q6_K_BYTES).zip(src.chunks_exact(QK_K)) {
        blk.fill(0);
        let mut gs = [0f32; 16];
        for (g, s) in gs.iter_mut().enumerate() {
            *s = signed_max(&x[16 * g..16 * g + 16]) / -32.0;
        }
        let maxs = gs.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
        let d = put_f16(blk, 208, maxs / 127.0);
        let mut q = [0u8; QK_K];
        for g in 0..16 {
            let sc = if d == 0.0 {
                0
            } else {
                (gs[g] / d).round().clamp(-128.0, 127.0) as i8
            };
            blk[192 + g] = sc as u8;
            let ds = d * sc as f32;
            let id = if ds == 0.0 { 0.0 } else { 1.0 / ds };
            for l in 0..16 {
                let v = (x[16 * g + l] * id).round().clamp(-32.0, 31.0) as i32 + 32;
                q[16 * g + l] = v as u8;
            }
        }
        for h in 0..2 {
            let y = &q[128 * h..128 * h + 128];
            for l in 0..32 {
                blk[64 * h + l] = (y[l] & 0xF) | ((y[l + 64] & 0xF) << 4);
                blk[64 * h + l + 32] = (y[l + 32] & 0xF) | ((y[l + 96] & 0xF) << 4);
                blk[128 + 32 * h + l] = (y[l] >> 4)
                    | ((y[l + 32] >> 4) << 2)
                    | ((y[l + 64] >> 4) << 4)
                    | ((y[l + 96] >> 4) << 6);
            }
        }
    }
}

fn quantize_iq4_xs(src: &[f32], dst: &mut [u8]) {
    for (blk, x) in dst
        .chunks_exact_mut(IQ4_XS_BYTES)
        .zip(src.chunks_exact(QK_K))
    {
        blk.fill(0);
        let mut dls = [0f32; 8];
        for (j, dl) in dls.iter_mut().enumerate() {
            *dl = signed_max(&x[SUB * j..SUB * j + SUB]) / -127.0;
        }
        let maxd = dls.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
        let d = put_f16(blk, 0, maxd / 31.0);
        let mut scales_h = 0u16;
        for j in 0..8 {
            let ls = if d == 0.0 {
                0
            } else {
                (dls[j] / d).round().clamp(-32.0, 31.0) as i32
            } + 32;
            blk[4 + j / 2] |= ((ls & 0xF) as u8) << (4 * (j % 2));
            scales_h |= ((ls >> 4) as u16 & 3) << (2 * j);
            let dl = d * (ls - 32) as f32;
            let nearest = |v: f32| -> u8 {
                let mut best = 0usize;
                let mut err = f32::INFINITY;
                for (k, &kv) in KVALUES_IQ4NL.iter().enumerate() {
                    let e = (v - dl * kv as f32).abs();
                    if e < err {
                        err = e;
                        best = k;
                    }
                }
                best as u8
            };
            for l in 0..16 {
                blk[8 + 16 * j + l] = nearest(x[SUB * j + l]) | (nearest(x[SUB * j + l + 16]) << 4);
            }
        }
        blk[2..4].copy_from_slice(&scales_h.to_le_bytes());
    }
}
