//! The simple quantizers of the low-bit types ([`crate::lowbit`]): searches for tests and
//! synthetic models. Not llama.cpp's (no importance weights, no scale search); every
//! output is a valid block, and together they reach every code (levels, scales, codebook
//! rows, signs).

use gguf::GgmlType;
use half::f16;

use crate::formats::{KVALUES_IQ4NL, QK_K};
use crate::grids::*;
use crate::lowbit::{e8m0_half, u32_at, ue4m3_half, Spec, KVALUES_MXFP4};

fn put_f16(dst: &mut [u8], off: usize, v: f32) -> f32 {
    let h = f16::from_f32(v);
    dst[off..off + 2].copy_from_slice(&h.to_bits().to_le_bytes());
    h.to_f32()
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The value of largest magnitude, with its sign.
fn signed_max(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

fn inv(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Quantizes whole blocks of `sp`'s type.
pub(crate) fn quantize(sp: &Spec, src: &[f32], dst: &mut [u8]) {
    for (blk, x) in dst
        .chunks_exact_mut(sp.block_bytes)
        .zip(src.chunks_exact(sp.block_vals))
    {
        blk.fill(0);
        match sp.ty {
            GgmlType::Q2_K => quantize_q2_k(x, blk),
            GgmlType::Q3_K => quantize_q3_k(x, blk),
            GgmlType::Q4_1 => quantize_affine32(x, blk, false),
            GgmlType::Q5_1 => quantize_affine32(x, blk, true),
            GgmlType::Q5_0 => quantize_q5_0(x, blk),
            GgmlType::IQ4_NL => quantize_iq4_nl(x, blk),
            GgmlType::MXFP4 => quantize_mxfp4(x, blk),
            GgmlType::TQ1_0 => quantize_tq1_0(x, blk),
            GgmlType::TQ2_0 => quantize_tq2_0(x, blk),
            GgmlType::IQ2_XXS => quantize_iq2(x, blk, Iq2::Xxs),
            GgmlType::IQ2_XS => quantize_iq2(x, blk, Iq2::Xs),
            GgmlType::IQ2_S => quantize_iq2(x, blk, Iq2::S),
            GgmlType::IQ3_XXS => quantize_iq3_xxs(x, blk),
            GgmlType::IQ3_S => quantize_iq3_s(x, blk),
            GgmlType::IQ1_S => quantize_iq1(x, blk, false),
            GgmlType::IQ1_M => quantize_iq1(x, blk, true),
            GgmlType::NVFP4 => quantize_nvfp4(x, blk),
            other => unreachable!("{other} is not a low-bit type"),
        }
    }
}

/// Q2_K: per 16-value group an affine range [−min, −min + 3·scale] covering 0.
fn quantize_q2_k(x: &[f32], b: &mut [u8]) {
    let mut scale = [0f32; 16];
    let mut minv = [0f32; 16];
    for gi in 0..16 {
        let xs = &x[16 * gi..16 * gi + 16];
        let lo = xs.iter().fold(0.0f32, |m, &v| m.min(v));
        let hi = xs.iter().fold(0.0f32, |m, &v| m.max(v));
        scale[gi] = (hi - lo) / 3.0;
        minv[gi] = -lo;
    }
    let d = put_f16(b, 80, scale.iter().fold(0.0f32, |m, &v| m.max(v)) / 15.0);
    let dmin = put_f16(b, 82, minv.iter().fold(0.0f32, |m, &v| m.max(v)) / 15.0);
    for gi in 0..16 {
        let sc = (scale[gi] * inv(d)).round().clamp(0.0, 15.0) as u8;
        let m = (minv[gi] * inv(dmin)).round().clamp(0.0, 15.0) as u8;
        b[gi] = sc | (m << 4);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        for l in 0..16 {
            let v = 16 * gi + l;
            let q = ((x[v] + ml) * inv(dl)).round().clamp(0.0, 3.0) as u8;
            let (c, k, l32) = (v / 128, (v / 32) % 4, v % 32);
            b[16 + 32 * c + l32] |= q << (2 * k);
        }
    }
}

/// Q3_K: per 16-value group a signed scale taking the group's extreme to −4.
fn quantize_q3_k(x: &[f32], b: &mut [u8]) {
    let mut gs = [0f32; 16];
    for (gi, s) in gs.iter_mut().enumerate() {
        *s = signed_max(&x[16 * gi..16 * gi + 16]) / -4.0;
    }
    let d = put_f16(b, 108, amax(&gs) / 32.0);
    for gi in 0..16 {
        let sc = (gs[gi] * inv(d)).round().clamp(-32.0, 31.0) as i32;
        let u = (sc + 32) as u8;
        b[96 + gi % 8] |= (u & 0xF) << (4 * (gi / 8));
        b[96 + 8 + gi % 4] |= (u >> 4) << (2 * (gi / 4));
        let ds = d * sc as f32;
        for l in 0..16 {
            let v = 16 * gi + l;
            let q = (x[v] * inv(ds)).round().clamp(-4.0, 3.0) as i32;
            let (c, k, l32, j) = (v / 128, (v / 32) % 4, v % 32, v / 32);
            let (lo, h) = if q >= 0 { (q, 1) } else { (q + 4, 0) };
            b[32 + 32 * c + l32] |= (lo as u8) << (2 * k);
            b[l32] |= h << j;
        }
    }
}

/// Q4_1 / Q5_1: d = (max − min) / levels, m = min.
fn quantize_affine32(x: &[f32], b: &mut [u8], five: bool) {
    let lo = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let nmax = if five { 31.0 } else { 15.0 };
    let d = put_f16(b, 0, (hi - lo) / nmax);
    let m = put_f16(b, 2, lo);
    let (qh, qs) = if five { (4, 8) } else { (0, 4) };
    let mut bits = 0u32;
    for (i, &v) in x.iter().enumerate() {
        let q = ((v - m) * inv(d)).round().clamp(0.0, nmax) as u8;
        b[qs + i % 16] |= (q & 0xF) << (4 * (i / 16));
        bits |= ((q >> 4) as u32 & 1) << i;
    }
    if five {
        b[qh..qh + 4].copy_from_slice(&bits.to_le_bytes());
    }
}

/// Q5_0: the block's extreme to −16.
fn quantize_q5_0(x: &[f32], b: &mut [u8]) {
    let d = put_f16(b, 0, signed_max(x) / -16.0);
    let id = inv(d);
    let mut bits = 0u32;
    for (i, &v) in x.iter().enumerate() {
        let q = (v * id + 16.5).floor().clamp(0.0, 31.0) as u8;
        b[6 + i % 16] |= (q & 0xF) << (4 * (i / 16));
        bits |= ((q >> 4) as u32) << i;
    }
    b[2..6].copy_from_slice(&bits.to_le_bytes());
}

/// The index of the level nearest `v` (first of equals).
fn nearest(levels: impl Iterator<Item = f32>, v: f32) -> usize {
    let mut best = 0;
    let mut err = f32::INFINITY;
    for (k, l) in levels.enumerate() {
        let e = (v - l).abs();
        if e < err {
            err = e;
            best = k;
        }
    }
    best
}

/// IQ4_NL: the block's extreme to K[0] = −127.
fn quantize_iq4_nl(x: &[f32], b: &mut [u8]) {
    let d = put_f16(b, 0, signed_max(x) / -127.0);
    for (i, &v) in x.iter().enumerate() {
        let q = nearest(KVALUES_IQ4NL.iter().map(|&k| d * k as f32), v) as u8;
        b[2 + i % 16] |= q << (4 * (i / 16));
    }
}

/// MXFP4: the power of two that puts the block's largest magnitude in [8, 16) doubled
/// levels (as llama.cpp's quantizer picks it), then the nearest level.
fn quantize_mxfp4(x: &[f32], b: &mut [u8]) {
    let m = amax(x);
    let e = if m > 0.0 {
        (m.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
    } else {
        0
    };
    b[0] = e;
    let d = e8m0_half(e);
    for (i, &v) in x.iter().enumerate() {
        let q = nearest(KVALUES_MXFP4.iter().map(|&k| d * k as f32), v) as u8;
        b[1 + i % 16] |= q << (4 * (i / 16));
    }
}

/// NVFP4: per 16 values the e4m3 scale nearest to the one that puts their largest
/// magnitude on the top level (12 doubled), then the nearest level.
fn quantize_nvfp4(x: &[f32], b: &mut [u8]) {
    for (k, g) in x.chunks_exact(16).enumerate() {
        let sb = nvfp4_scale_byte(amax(g) / 12.0);
        b[k] = sb;
        let d = ue4m3_half(sb);
        for (i, &v) in g.iter().enumerate() {
            let q = nearest(KVALUES_MXFP4.iter().map(|&l| d * l as f32), v) as u8;
            b[4 + 8 * k + i % 8] |= q << (4 * (i / 8));
        }
    }
}

/// The NVFP4 scale byte (unsigned e4m3, as the block stores it) whose value — the
/// factor of the doubled e2m1 levels — is nearest to `v` (0 for `v` ≤ 0).
pub fn nvfp4_scale_byte(v: f32) -> u8 {
    // The values rise with the byte over 0..=0x7E (0x7F is e4m3's NaN, read as 0), so
    // the nearest is the first byte at or above `v` or the one below it; a tie goes to
    // the lower byte.
    let (mut lo, mut hi) = (0u8, 0x7Fu8);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if ue4m3_half(mid) < v {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    match lo {
        0 => 0,
        0x7F => 0x7E,
        b if v - ue4m3_half(b - 1) <= ue4m3_half(b) - v => b - 1,
        b => b,
    }
}

/// Ternary values (0, 1, 2 for −1, 0, +1) of a block scaled by its largest magnitude.
fn ternary(x: &[f32]) -> (f32, [u8; QK_K]) {
    let d = amax(x);
    let id = inv(d);
    let mut t = [0u8; QK_K];
    for (o, &v) in t.iter_mut().zip(x) {
        *o = ((v * id).round().clamp(-1.0, 1.0) as i32 + 1) as u8;
    }
    (d, t)
}

/// Packs up to five base-3 digits (digit n most significant first) into a TQ1_0 byte.
fn pack_trits(t: &[u8]) -> u8 {
    let mut v = 0u16;
    for n in 0..5 {
        v = 3 * v + t.get(n).copied().unwrap_or(0) as u16;
    }
    (v * 256).div_ceil(243) as u8
}

fn quantize_tq1_0(x: &[f32], b: &mut [u8]) {
    let (d, t) = ternary(x);
    for l in 0..32 {
        let digits: Vec<u8> = (0..5).map(|n| t[32 * n + l]).collect();
        b[l] = pack_trits(&digits);
    }
    for l in 0..16 {
        let digits: Vec<u8> = (0..5).map(|n| t[160 + 16 * n + l]).collect();
        b[32 + l] = pack_trits(&digits);
    }
    for l in 0..4 {
        let digits: Vec<u8> = (0..4).map(|n| t[240 + 4 * n + l]).collect();
        b[48 + l] = pack_trits(&digits);
    }
    put_f16(b, 52, d);
}

fn quantize_tq2_0(x: &[f32], b: &mut [u8]) {
    let (d, t) = ternary(x);
    for (v, &q) in t.iter().enumerate() {
        let (c, k, l) = (v / 128, (v / 32) % 4, v % 32);
        b[32 * c + l] |= q << (2 * k);
    }
    put_f16(b, 64, d);
}

/// The codebook row nearest (least squares) to `t` among `rows` (values as bytes).
fn nearest_row<const K: usize>(rows: impl Iterator<Item = [i8; K]>, t: &[f32]) -> usize {
    let mut best = 0;
    let mut err = f32::INFINITY;
    for (r, row) in rows.enumerate() {
        let mut e = 0.0f32;
        for i in 0..K {
            let dv = t[i] - row[i] as f32;
            e += dv * dv;
        }
        if e < err {
            err = e;
            best = r;
        }
    }
    best
}

fn row8(v: u64) -> [i8; 8] {
    v.to_le_bytes().map(|b| b as i8)
}

fn row4(v: u32) -> [i8; 4] {
    v.to_le_bytes().map(|b| b as i8)
}

/// Sign bits of `x` (bit i: x[i] < 0). With `even`, the count of set bits is made even by
/// flipping the bit of the value of least magnitude (IQ2_XXS, IQ2_XS, IQ3_XXS store 7 bits
/// and derive the eighth from the parity).
fn sign_bits(x: &[f32], even: bool) -> u8 {
    let mut s = 0u8;
    for (i, &v) in x.iter().enumerate() {
        if v < 0.0 {
            s |= 1 << i;
        }
    }
    if even && s.count_ones() % 2 == 1 {
        let i = (0..x.len())
            .min_by(|&a, &b| x[a].abs().total_cmp(&x[b].abs()))
            .unwrap_or(0);
        s ^= 1 << i;
    }
    s
}

/// Per-scale integer codes `k` (0..=kmax) and the block's f16 scale for a scale of the
/// form `d · (2k + 1) · unit`, given each scale's ideal value `want`.
fn odd_scales(want: &[f32], kmax: f32, unit: f32) -> (f32, Vec<u8>) {
    let top = want.iter().fold(0.0f32, |m, &v| m.max(v));
    let d = f16::from_f32(top / ((2.0 * kmax + 1.0) * unit)).to_f32();
    let ks = want
        .iter()
        .map(|&w| ((w * inv(d * unit) - 1.0) / 2.0).round().clamp(0.0, kmax) as u8)
        .collect();
    (d, ks)
}

#[derive(Clone, Copy, PartialEq)]
enum Iq2 {
    Xxs,
    Xs,
    S,
}

/// IQ2_XXS / IQ2_XS / IQ2_S: scales put each scale group's extreme on the top level
/// (43), then every 8 values take their signs and the nearest codebook row.
fn quantize_iq2(x: &[f32], b: &mut [u8], kind: Iq2) {
    let per = if kind == Iq2::Xxs { 32 } else { 16 };
    let want: Vec<f32> = x.chunks(per).map(|c| amax(c) / 43.0).collect();
    let (d, ks) = odd_scales(&want, 15.0, 0.125);
    put_f16(b, 0, d);
    let grid: &[u64] = match kind {
        Iq2::Xxs => &IQ2XXS_GRID,
        Iq2::Xs => &IQ2XS_GRID,
        Iq2::S => &IQ2S_GRID,
    };
    for r in 0..32 {
        let xs = &x[8 * r..8 * r + 8];
        let k = ks[8 * r / per] as f32;
        let id = inv(d * (2.0 * k + 1.0) * 0.125);
        let t: Vec<f32> = xs.iter().map(|v| v.abs() * id).collect();
        let idx = nearest_row(grid.iter().map(|&v| row8(v)), &t);
        let s = sign_bits(xs, kind != Iq2::S);
        let (j, k4) = (r / 4, r % 4);
        match kind {
            Iq2::Xxs => {
                b[2 + 8 * j + k4] = idx as u8;
                let a1 = u32_at(b, 6 + 8 * j) | (((s & 0x7F) as u32) << (7 * k4));
                b[6 + 8 * j..10 + 8 * j].copy_from_slice(&a1.to_le_bytes());
            }
            Iq2::Xs => {
                let q = idx as u16 | (((s & 0x7F) as u16) << 9);
                b[2 + 2 * r..4 + 2 * r].copy_from_slice(&q.to_le_bytes());
            }
            Iq2::S => {
                b[2 + r] = idx as u8;
                b[66 + j] |= ((idx >> 8) as u8 & 3) << (2 * k4);
                b[34 + r] = s;
            }
        }
    }
    for j in 0..8 {
        match kind {
            Iq2::Xxs => {
                let a1 = u32_at(b, 6 + 8 * j) | ((ks[j] as u32) << 28);
                b[6 + 8 * j..10 + 8 * j].copy_from_slice(&a1.to_le_bytes());
            }
            Iq2::Xs => b[66 + j] = ks[2 * j] | (ks[2 * j + 1] << 4),
            Iq2::S => b[74 + j] = ks[2 * j] | (ks[2 * j + 1] << 4),
        }
    }
}

fn quantize_iq3_xxs(x: &[f32], b: &mut [u8]) {
    let want: Vec<f32> = x.chunks(32).map(|c| amax(c) / 62.0).collect();
    let (d, ks) = odd_scales(&want, 15.0, 0.25);
    put_f16(b, 0, d);
    for j in 0..8 {
        let id = inv(d * (2.0 * ks[j] as f32 + 1.0) * 0.25);
        let mut aux = (ks[j] as u32) << 28;
        for k in 0..4 {
            let xs = &x[32 * j + 8 * k..32 * j + 8 * k + 8];
            for h in 0..2 {
                let t: Vec<f32> = xs[4 * h..4 * h + 4].iter().map(|v| v.abs() * id).collect();
                b[2 + 8 * j + 2 * k + h] =
                    nearest_row(IQ3XXS_GRID.iter().map(|&v| row4(v)), &t) as u8;
            }
            aux |= ((sign_bits(xs, true) & 0x7F) as u32) << (7 * k);
        }
        b[66 + 4 * j..70 + 4 * j].copy_from_slice(&aux.to_le_bytes());
    }
}

fn quantize_iq3_s(x: &[f32], b: &mut [u8]) {
    let want: Vec<f32> = x.chunks(32).map(|c| amax(c) / 15.0).collect();
    // d · (1 + 2·sc) = d · (2·sc + 1).
    let (d, ks) = odd_scales(&want, 15.0, 1.0);
    put_f16(b, 0, d);
    for j in 0..8 {
        b[106 + j / 2] |= ks[j] << (4 * (j % 2));
        let id = inv(d * (2.0 * ks[j] as f32 + 1.0));
        for k in 0..8 {
            let r = 8 * j + k;
            let xs = &x[4 * r..4 * r + 4];
            let t: Vec<f32> = xs.iter().map(|v| v.abs() * id).collect();
            let idx = nearest_row(IQ3S_GRID.iter().map(|&v| row4(v)), &t);
            b[2 + r] = idx as u8;
            b[66 + j] |= ((idx >> 8) as u8 & 1) << k;
            b[74 + r / 2] |= sign_bits(xs, false) << (4 * (r % 2));
        }
    }
}

/// IQ1_S / IQ1_M: scales put each scale group's extreme at 1.125; every 8 values take
/// the nearest row of grid + δ (δ's sign: the sub-block's mean for IQ1_S, the better
/// of both per row for IQ1_M).
fn quantize_iq1(x: &[f32], b: &mut [u8], m: bool) {
    let per = if m { 16 } else { 32 };
    let want: Vec<f32> = x.chunks(per).map(|c| amax(c) / 1.125).collect();
    let (d, ks) = odd_scales(&want, 7.0, 1.0);
    let rows = || IQ1S_GRID.iter().map(|&v| row8(v));
    let fit = |xs: &[f32], dl: f32, delta: f32| -> (usize, f32) {
        let t: Vec<f32> = xs.iter().map(|v| v * inv(dl) - delta).collect();
        let idx = nearest_row(rows(), &t);
        let row = row8(IQ1S_GRID[idx]);
        let err = (0..8).map(|i| (t[i] - row[i] as f32).powi(2)).sum();
        (idx, err)
    };
    if m {
        let dh = f16::from_f32(d).to_bits();
        for u in 0..4 {
            let mut w = ((dh >> (4 * u)) & 0xF) << 12;
            for t in 0..4 {
                w |= (ks[4 * u + t] as u16) << (3 * t);
            }
            b[48 + 2 * u..50 + 2 * u].copy_from_slice(&w.to_le_bytes());
        }
        for r in 0..32 {
            let xs = &x[8 * r..8 * r + 8];
            let dl = d * (2.0 * ks[r / 2] as f32 + 1.0);
            let (ip, ep) = fit(xs, dl, 0.125);
            let (in_, en) = fit(xs, dl, -0.125);
            let (idx, neg) = if en < ep { (in_, 8u8) } else { (ip, 0) };
            b[r] = idx as u8;
            b[32 + r / 2] |= (((idx >> 8) as u8 & 7) | neg) << (4 * (r % 2));
        }
    } else {
        put_f16(b, 0, d);
        for j in 0..8 {
            let xs = &x[32 * j..32 * j + 32];
            let neg = xs.iter().sum::<f32>() < 0.0;
            let delta = if neg { -0.125 } else { 0.125 };
            let dl = d * (2.0 * ks[j] as f32 + 1.0);
            let mut qh = ((ks[j] as u16) << 12) | if neg { 0x8000 } else { 0 };
            for k in 0..4 {
                let (idx, _) = fit(&xs[8 * k..8 * k + 8], dl, delta);
                b[2 + 4 * j + k] = idx as u8;
                qh |= ((idx >> 8) as u16 & 7) << (3 * k);
            }
            b[34 + 2 * j..36 + 2 * j].copy_from_slice(&qh.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The binary search picks what a scan of every byte picks: each value, the points
    /// halfway between neighbours (ties), one step either side of both, and the ends —
    /// except past the largest scale, where the scan's differences all round to the same
    /// float and it fell back to byte 0; the search gives the largest scale.
    #[test]
    fn nvfp4_scale_byte_is_the_nearest_of_every_byte() {
        let scan = |v: f32| nearest((0..0x7Fu8).map(ue4m3_half), v) as u8;
        for v in [f32::MAX, f32::INFINITY] {
            assert_eq!(nvfp4_scale_byte(v), 0x7E);
        }
        let mut vs = vec![0.0, -1.0, f32::MIN_POSITIVE, 1e6, f32::NAN];
        for b in 0..0x7Fu8 {
            let l = ue4m3_half(b);
            let h = ue4m3_half(b.saturating_add(1).min(0x7E));
            let m = (l + h) / 2.0;
            for x in [l, m, h] {
                // The floats one step below and above x (x ≥ 0).
                let below = f32::from_bits(x.to_bits().saturating_sub(1));
                vs.extend([x, below, f32::from_bits(x.to_bits() + 1)]);
            }
            vs.push(l * 1.3);
        }
        for v in vs {
            assert_eq!(nvfp4_scale_byte(v), scan(v), "v = {v:e}");
        }
    }
}
