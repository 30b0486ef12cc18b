//! Kernel tests: dequantization against a literal transcription of the block
//! layouts, every kernel level against the scalar canonical kernel bit for bit,
//! and the canonical result against an f64 evaluation of the same formula.

// The spec transcription indexes like the layout notes do.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{quant_types, rand_floats, random_row, set_scales};
use quant::{ActQ8, GgmlType as T, Isa, QuantError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The types `spec_dequant` transcribes; the oracle test (`oracle.rs`) checks every
/// type's dequantization against the `gguf` package.
const SPEC_TYPES: [T; 6] = [T::Q8_0, T::Q4_0, T::Q4_K, T::Q5_K, T::Q6_K, T::IQ4_XS];
const FLOAT: [T; 3] = [T::F32, T::F16, T::BF16];
const LENGTHS: [usize; 4] = [256, 512, 2048, 4096 + 256];
/// Extra lengths for the 32- and 64-value block types (partial groups of 8 sub-blocks),
/// each type taking those that are whole blocks.
const SMALL_LENGTHS: [usize; 8] = [32, 64, 96, 192, 288, 320, 800, 832];

fn all_types() -> Vec<T> {
    quant_types().into_iter().chain(FLOAT).collect()
}

fn lengths(ty: T) -> Vec<usize> {
    let mut v = LENGTHS.to_vec();
    if ty.block_size() < 256 {
        v.extend(
            SMALL_LENGTHS
                .iter()
                .filter(|&&n| n.is_multiple_of(ty.block_size())),
        );
    }
    v
}

/// Kernel levels this CPU runs; prints a note for each skipped one.
fn isas() -> Vec<Isa> {
    let mut v = Vec::new();
    for isa in Isa::ALL {
        if isa.is_available() {
            v.push(isa);
        } else {
            eprintln!("note: skipping kernel level {isa}: not available on this CPU");
        }
    }
    v
}

fn h(b: &[u8], o: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32()
}

/// Dequantization written straight from the layout notes (section C.2).
fn spec_dequant(ty: T, src: &[u8], n: usize) -> Vec<f32> {
    let mut y = Vec::with_capacity(n);
    const K: [i8; 16] = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];
    let scale_min_k4 = |s: &[u8], j: usize| -> (u8, u8) {
        if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            (
                (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
                (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
            )
        }
    };
    match ty {
        T::F32 => {
            for c in src.chunks_exact(4) {
                y.push(f32::from_le_bytes(c.try_into().unwrap()));
            }
        }
        T::F16 => {
            for i in 0..n {
                y.push(h(src, 2 * i));
            }
        }
        T::BF16 => {
            for c in src.chunks_exact(2) {
                y.push(f32::from_bits(
                    (u16::from_le_bytes([c[0], c[1]]) as u32) << 16,
                ));
            }
        }
        T::Q8_0 => {
            for b in src.chunks_exact(34) {
                for j in 0..32 {
                    y.push(h(b, 0) * (b[2 + j] as i8) as f32);
                }
            }
        }
        T::Q4_0 => {
            for b in src.chunks_exact(18) {
                let d = h(b, 0);
                let mut out = [0f32; 32];
                for j in 0..16 {
                    out[j] = d * ((b[2 + j] & 0xF) as i32 - 8) as f32;
                    out[j + 16] = d * ((b[2 + j] >> 4) as i32 - 8) as f32;
                }
                y.extend(out);
            }
        }
        T::Q4_K => {
            for b in src.chunks_exact(144) {
                let (d, dmin, s, qs) = (h(b, 0), h(b, 2), &b[4..16], &b[16..144]);
                for c in 0..4 {
                    let q = &qs[32 * c..32 * c + 32];
                    let (sc, m) = scale_min_k4(s, 2 * c);
                    for l in 0..32 {
                        y.push(d * sc as f32 * (q[l] & 0xF) as f32 - dmin * m as f32);
                    }
                    let (sc, m) = scale_min_k4(s, 2 * c + 1);
                    for l in 0..32 {
                        y.push(d * sc as f32 * (q[l] >> 4) as f32 - dmin * m as f32);
                    }
                }
            }
        }
        T::Q5_K => {
            for b in src.chunks_exact(176) {
                let (d, dmin, s, qh, ql) = (h(b, 0), h(b, 2), &b[4..16], &b[16..48], &b[48..176]);
                for c in 0..4 {
                    let (u1, u2) = (1u8 << (2 * c), 1u8 << (2 * c + 1));
                    let q = &ql[32 * c..32 * c + 32];
                    let (sc, m) = scale_min_k4(s, 2 * c);
                    for l in 0..32 {
                        let v = (q[l] & 0xF) + if qh[l] & u1 != 0 { 16 } else { 0 };
                        y.push(d * sc as f32 * v as f32 - dmin * m as f32);
                    }
                    let (sc, m) = scale_min_k4(s, 2 * c + 1);
                    for l in 0..32 {
                        let v = (q[l] >> 4) + if qh[l] & u2 != 0 { 16 } else { 0 };
                        y.push(d * sc as f32 * v as f32 - dmin * m as f32);
                    }
                }
            }
        }
        T::Q6_K => {
            for b in src.chunks_exact(210) {
                let d = h(b, 208);
                let mut out = [0f32; 256];
                for half in 0..2 {
                    let ql = &b[64 * half..];
                    let qh = &b[128 + 32 * half..];
                    let sc = &b[192 + 8 * half..];
                    let yy = &mut out[128 * half..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        yy[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        yy[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        yy[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        yy[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
                y.extend(out);
            }
        }
        T::IQ4_XS => {
            for b in src.chunks_exact(136) {
                let d = h(b, 0);
                let scales_h = u16::from_le_bytes([b[2], b[3]]) as i32;
                for ib in 0..8 {
                    let ls = ((b[4 + ib / 2] as i32 >> (4 * (ib % 2))) & 0xF)
                        | (((scales_h >> (2 * ib)) & 3) << 4);
                    let dl = d * (ls - 32) as f32;
                    let qs = &b[8 + 16 * ib..];
                    let mut out = [0f32; 32];
                    for j in 0..16 {
                        out[j] = dl * K[(qs[j] & 0xF) as usize] as f32;
                        out[j + 16] = dl * K[(qs[j] >> 4) as usize] as f32;
                    }
                    y.extend(out);
                }
            }
        }
        other => panic!("no spec for {other}"),
    }
    assert_eq!(y.len(), n);
    y
}

/// Dequantization: the spec transcription for the listed types, else the crate's own
/// (checked against the `gguf` package by `oracle.rs`).
fn deq(ty: T, src: &[u8], n: usize) -> Vec<f32> {
    if SPEC_TYPES.contains(&ty) || FLOAT.contains(&ty) {
        spec_dequant(ty, src, n)
    } else {
        let mut y = vec![0f32; n];
        quant::dequantize_row(ty, src, &mut y);
        y
    }
}

#[test]
fn supported_types_are_exactly_the_kernel_types() {
    // The list of types, and the ones before it.
    let want = [
        T::F32,
        T::F16,
        T::BF16,
        T::Q8_0,
        T::Q4_0,
        T::Q4_K,
        T::Q5_K,
        T::Q6_K,
        T::IQ4_XS,
        T::Q2_K,
        T::Q3_K,
        T::Q4_1,
        T::Q5_0,
        T::Q5_1,
        T::IQ1_S,
        T::IQ1_M,
        T::IQ2_XXS,
        T::IQ2_XS,
        T::IQ2_S,
        T::IQ3_XXS,
        T::IQ3_S,
        T::IQ4_NL,
        T::TQ1_0,
        T::TQ2_0,
        T::MXFP4,
        T::NVFP4,
    ];
    for ty in T::ALL {
        let expect = want.contains(&ty);
        assert_eq!(quant::is_supported(ty), expect, "{ty}");
        assert_eq!(quant::SUPPORTED.contains(&ty), expect, "{ty}");
    }
    assert_eq!(quant::SUPPORTED.len(), want.len());
    assert!(Isa::from_name(quant::kernel_isa()).is_some_and(|i| i.is_available()));
}

#[test]
fn dequantize_matches_the_layout_spec_bitwise() {
    let mut rng = StdRng::seed_from_u64(1);
    for ty in SPEC_TYPES.into_iter().chain(FLOAT) {
        for n in lengths(ty) {
            let w = random_row(&mut rng, ty, n);
            let mut got = vec![0f32; n];
            quant::dequantize_row(ty, &w, &mut got);
            let want = spec_dequant(ty, &w, n);
            for i in 0..n {
                assert_eq!(
                    got[i].to_bits(),
                    want[i].to_bits(),
                    "{ty} n={n} i={i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

#[test]
fn quantize_row_round_trips_within_format_precision() {
    let mut rng = StdRng::seed_from_u64(2);
    for ty in all_types() {
        let n = 2048;
        let x = rand_floats(&mut rng, n);
        let mut w = vec![0u8; quant::row_bytes(ty, n).unwrap()];
        quant::quantize_row(ty, &x, &mut w);
        let mut y = vec![0f32; n];
        quant::dequantize_row(ty, &w, &mut y);
        // Worst-case step of each format relative to the value range (2.0 here).
        let tol = match ty {
            T::F32 => 0.0,
            T::F16 => 2e-3,
            T::BF16 => 1e-2,
            T::Q8_0 => 2.0 / 127.0,
            T::Q6_K | T::Q5_K => 4.0 / 31.0,
            T::IQ4_XS => 0.35,
            T::Q4_0 | T::Q4_K => 4.0 / 15.0,
            ty => low_bit_tolerance(ty).0,
        };
        let rms_tol = match ty {
            T::F32 | T::F16 | T::BF16 | T::Q8_0 | T::Q4_0 | T::Q4_K | T::Q5_K | T::Q6_K => {
                tol as f64 / 2.0
            }
            T::IQ4_XS => tol as f64 / 2.0,
            ty => low_bit_tolerance(ty).1 as f64,
        };
        let mut err2 = 0.0f64;
        for i in 0..n {
            let e = (x[i] - y[i]).abs();
            assert!(
                e <= tol,
                "{ty} i={i}: {} -> {} (error {e} > {tol})",
                x[i],
                y[i]
            );
            err2 += (e as f64).powi(2);
        }
        let rms = (err2 / n as f64).sqrt();
        assert!(rms <= rms_tol + 1e-9, "{ty}: rms error {rms} > {rms_tol}");
    }
}

/// The worst and the rms error of the simple quantizers of the low-bit types on values
/// in [-2, 2): the format's step where a block's levels are uniform, else what the
/// codebook allows (measured, with a margin). The codebook types' worst case is a
/// value the nearest codebook row puts on a low level.
fn low_bit_tolerance(ty: T) -> (f32, f32) {
    match ty {
        T::Q2_K => (0.8, 0.4),
        T::Q3_K => (0.7, 0.2),
        T::Q4_1 => (4.0 / 15.0, 0.09),
        T::Q5_0 => (2.0 / 15.0, 0.045),
        T::Q5_1 => (4.0 / 31.0, 0.045),
        T::IQ4_NL => (0.35, 0.1),
        T::MXFP4 => (0.6, 0.21),
        T::NVFP4 => (0.4, 0.15),
        T::TQ1_0 | T::TQ2_0 => (1.0, 0.6),
        T::IQ2_XXS | T::IQ2_XS => (2.2, 0.5),
        T::IQ2_S => (1.3, 0.37),
        T::IQ3_XXS => (2.3, 0.32),
        T::IQ3_S => (0.9, 0.2),
        T::IQ1_S => (2.0, 0.65),
        T::IQ1_M => (1.8, 0.6),
        other => panic!("no tolerance for {other}"),
    }
}

#[test]
fn quantize_act_rounds_half_to_even_and_handles_zero_blocks() {
    // amax = 127 gives d = 1 and id = 1 exactly, so x * id = x and ties are visible.
    let mut x = vec![0f32; 64];
    let ties = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.49, 3.51];
    let want = [0i8, 2, 2, 0, -2, -2, 126, -126, 3, 4];
    x[..ties.len()].copy_from_slice(&ties);
    x[31] = 127.0;
    // Block 1 stays all zeros.
    for isa in isas() {
        let a = quant::quantize_act_with(isa, &x);
        assert_eq!(a.d, vec![1.0, 0.0], "{isa}");
        assert_eq!(&a.qs[..ties.len()], &want, "{isa}");
        assert_eq!(a.qs[31], 127);
        assert!(a.qs[32..].iter().all(|&q| q == 0));
        let s: i32 = a.qs[..32].iter().map(|&q| q as i32).sum();
        assert_eq!(a.sums, vec![s, 0], "{isa}");
    }
    // Negative zero and a block whose extreme is negative.
    let mut y = vec![-0.0f32; 32];
    y[5] = -3.0;
    y[6] = 1.5;
    for isa in isas() {
        let a = quant::quantize_act_with(isa, &y);
        assert_eq!(a.d[0], 3.0 / 127.0);
        assert_eq!(a.qs[5], -127);
        let id = 1.0 / (3.0f32 / 127.0);
        assert_eq!(a.qs[6], (1.5f32 * id).round_ties_even() as i8);
    }
}

#[test]
fn quantize_act_is_identical_on_every_kernel_level() {
    let mut rng = StdRng::seed_from_u64(3);
    for scale in [1e-6f32, 1.0, 1e4] {
        let mut x: Vec<f32> = (0..4096)
            .map(|_| rng.random_range(-1.0f32..1.0) * scale)
            .collect();
        // Values sitting exactly on rounding ties after scaling.
        x[..32]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = i as f32 - 15.5);
        x[32..64].fill(0.0);
        let base = quant::quantize_act_with(Isa::Scalar, &x);
        // The definition, once more, literally.
        for (b, xs) in x.chunks_exact(32).enumerate() {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d == 0.0 { 0.0 } else { 1.0 / d };
            assert_eq!(base.d[b].to_bits(), d.to_bits());
            let mut s = 0;
            for (i, v) in xs.iter().enumerate() {
                let q = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
                assert_eq!(base.qs[32 * b + i], q);
                s += q as i32;
            }
            assert_eq!(base.sums[b], s);
        }
        for isa in isas() {
            let a = quant::quantize_act_with(isa, &x);
            assert_eq!(a.qs, base.qs, "{isa}");
            assert_eq!(a.sums, base.sums, "{isa}");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a.d), bits(&base.d), "{isa}");
        }
    }
}

fn act(rng: &mut StdRng, n: usize) -> (Vec<f32>, ActQ8) {
    let x = rand_floats(rng, n);
    let xq = quant::quantize_act_with(Isa::Scalar, &x);
    (x, xq)
}

#[test]
fn dot_is_bit_identical_on_every_kernel_level() {
    let mut rng = StdRng::seed_from_u64(4);
    let levels = isas();
    for ty in all_types() {
        for n in lengths(ty) {
            for _ in 0..4 {
                let w = random_row(&mut rng, ty, n);
                let (x, xq) = act(&mut rng, n);
                let want = quant::dot_with(Isa::Scalar, ty, &w, &x, &xq);
                assert!(want.is_finite());
                for &isa in &levels {
                    let got = quant::dot_with(isa, ty, &w, &x, &xq);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty} n={n} {isa}: {got} vs scalar {want}"
                    );
                }
            }
        }
    }
}

/// Random rows whose integer parts sit at their extremes (largest quant values,
/// largest scales, activations of ±127), to catch saturation in the SIMD paths.
#[test]
fn dot_survives_extreme_blocks() {
    let mut rng = StdRng::seed_from_u64(5);
    for ty in quant_types() {
        let n = 2048;
        for fill in [0x00u8, 0xFF, 0x80, 0x7F, 0x55, 0xAA] {
            let mut w = random_row(&mut rng, ty, n);
            for blk in w.chunks_exact_mut(ty.type_size()) {
                blk.fill(fill);
                set_scales(ty, blk, &mut rng);
            }
            for sign in [1.0f32, -1.0] {
                let x: Vec<f32> = (0..n)
                    .map(|i| if i % 3 == 0 { -sign } else { sign })
                    .collect();
                let xq = quant::quantize_act_with(Isa::Scalar, &x);
                let want = quant::dot_with(Isa::Scalar, ty, &w, &x, &xq);
                let reference = f64_reference(ty, &w, &x, &xq);
                check_close(ty, n, want, reference);
                for isa in isas() {
                    let got = quant::dot_with(isa, ty, &w, &x, &xq);
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty} fill={fill:#x} {isa}");
                }
            }
        }
    }
}

/// The exact value of the canonical formula, in f64: dequantized weights times the
/// *quantized* activations (or x itself for float weights), plus the size of the
/// terms (for the tolerance).
fn f64_reference(ty: T, w: &[u8], x: &[f32], xq: &ActQ8) -> (f64, f64) {
    let n = x.len();
    let deq = deq(ty, w, n);
    let mut sum = 0.0f64;
    let mut mag = 0.0f64;
    for i in 0..n {
        let a = if FLOAT.contains(&ty) {
            x[i] as f64
        } else {
            xq.d[i / 32] as f64 * xq.qs[i] as f64
        };
        let t = deq[i] as f64 * a;
        sum += t;
        mag += t.abs();
    }
    (sum, mag)
}

fn check_close(ty: T, n: usize, got: f32, (want, mag): (f64, f64)) {
    let err = (got as f64 - want).abs();
    assert!(
        err <= 1e-5 * mag + 1e-30,
        "{ty} n={n}: {got} vs f64 {want} (error {err}, term magnitude {mag})"
    );
}

#[test]
fn dot_matches_an_f64_evaluation_of_the_formula() {
    let mut rng = StdRng::seed_from_u64(6);
    for ty in all_types() {
        for n in lengths(ty) {
            for _ in 0..3 {
                let w = random_row(&mut rng, ty, n);
                let (x, xq) = act(&mut rng, n);
                let got = quant::dot_with(Isa::Scalar, ty, &w, &x, &xq);
                check_close(ty, n, got, f64_reference(ty, &w, &x, &xq));
            }
        }
    }
}

#[test]
fn matvec_and_matmul_equal_the_single_row_dot_bitwise() {
    let mut rng = StdRng::seed_from_u64(7);
    let levels = isas();
    for ty in all_types() {
        // (rows, columns, tokens): token counts around the kernels' tiles of 1, 2, 4
        // and 8 tokens, odd row counts, and both the single-thread and parallel paths.
        let cases = [
            (3usize, 256usize, 11usize),
            (70, 512, 11),
            (512, 2048, 11),
            (5, 256, 1),
            (7, 512, 3),
            (17, 256, 8),
            (33, 768, 13),
            (127, 2048, 64),
            (1, 256, 64),
        ];
        for (n_rows, n_cols, n_tok) in cases {
            // 32-value block types also get a partial group of 8 blocks.
            let n_cols = if n_cols == 768 && ty.block_size() <= 32 {
                800
            } else {
                n_cols
            };
            let rb = quant::row_bytes(ty, n_cols).unwrap();
            let mut w = Vec::with_capacity(n_rows * rb);
            for _ in 0..n_rows {
                w.extend(random_row(&mut rng, ty, n_cols));
            }
            let mut xs = Vec::new();
            let mut xqs = Vec::new();
            for _ in 0..n_tok {
                let (x, xq) = act(&mut rng, n_cols);
                xs.extend(x);
                xqs.push(xq);
            }
            let want: Vec<Vec<f32>> = (0..n_tok)
                .map(|t| {
                    (0..n_rows)
                        .map(|r| {
                            quant::dot_with(
                                Isa::Scalar,
                                ty,
                                &w[r * rb..(r + 1) * rb],
                                &xs[t * n_cols..(t + 1) * n_cols],
                                &xqs[t],
                            )
                        })
                        .collect()
                })
                .collect();
            for &isa in &levels {
                for t in 0..n_tok {
                    let mut out = vec![f32::NAN; n_rows];
                    quant::matvec_with(
                        isa,
                        ty,
                        &w,
                        n_cols,
                        &xs[t * n_cols..(t + 1) * n_cols],
                        &xqs[t],
                        &mut out,
                    );
                    for r in 0..n_rows {
                        assert_eq!(
                            out[r].to_bits(),
                            want[t][r].to_bits(),
                            "matvec {ty} {isa} {n_rows}x{n_cols} t={t} r={r}"
                        );
                    }
                }
                let mut out = vec![f32::NAN; n_rows * n_tok];
                let xqs_arg: &[ActQ8] = if FLOAT.contains(&ty) { &[] } else { &xqs };
                quant::matmul_with(isa, ty, &w, n_cols, &xs, xqs_arg, &mut out);
                for t in 0..n_tok {
                    for r in 0..n_rows {
                        assert_eq!(
                            out[t * n_rows + r].to_bits(),
                            want[t][r].to_bits(),
                            "matmul {ty} {isa} {n_rows}x{n_cols}x{n_tok} t={t} r={r}"
                        );
                    }
                }
            }
        }
    }
}

/// The AMX matmul (16 rows × 16 tokens per tile, one sub-block per tile product) against
/// the scalar dot, bit for bit: row and token counts around and across the tiles of
/// 16 (fewer than 16 tokens run as one padded group from 12 tokens, a last partial
/// group after whole ones from 8, fewer go to the AVX-512 kernels: each occurs here), column counts below, at and above 32 sub-blocks (one
/// and several sub-blocks per accumulator, partial chunks of 4 accumulators), and
/// activations at the int8 extremes (every activation ±127) beside ordinary ones.
#[test]
fn amx_matmul_is_bit_identical_to_the_scalar_dot() {
    if !Isa::Amx.is_available() {
        eprintln!("note: skipping the AMX matmul test: AMX is not available on this CPU");
        return;
    }
    let mut rng = StdRng::seed_from_u64(12);
    for ty in quant_types() {
        let cols: &[usize] = if ty.block_size() == 32 {
            &[32, 160, 800, 1056, 2080]
        } else {
            &[256, 768, 2304, 8448]
        };
        for &n_cols in cols {
            for (n_rows, n_tok) in [
                (1usize, 12usize),
                (15, 16),
                (16, 17),
                (17, 31),
                (33, 40),
                (50, 13),
                (5, 9),
                (20, 36),
                (7, 27),
            ] {
                let rb = quant::row_bytes(ty, n_cols).unwrap();
                let mut w = Vec::with_capacity(n_rows * rb);
                for _ in 0..n_rows {
                    w.extend(random_row(&mut rng, ty, n_cols));
                }
                let mut xs = Vec::new();
                let mut xqs = Vec::new();
                for t in 0..n_tok {
                    let x: Vec<f32> = if t % 3 == 0 {
                        // Every value ±1: each activation block quantizes to ±127.
                        (0..n_cols)
                            .map(|_| if rng.random_bool(0.5) { 1.0 } else { -1.0 })
                            .collect()
                    } else {
                        rand_floats(&mut rng, n_cols)
                    };
                    xqs.push(quant::quantize_act_with(Isa::Scalar, &x));
                    xs.extend(x);
                }
                let mut out = vec![f32::NAN; n_rows * n_tok];
                quant::matmul_with(Isa::Amx, ty, &w, n_cols, &xs, &xqs, &mut out);
                for t in 0..n_tok {
                    for r in 0..n_rows {
                        let want = quant::dot_with(
                            Isa::Scalar,
                            ty,
                            &w[r * rb..(r + 1) * rb],
                            &xs[t * n_cols..(t + 1) * n_cols],
                            &xqs[t],
                        );
                        assert_eq!(
                            out[t * n_rows + r].to_bits(),
                            want.to_bits(),
                            "amx matmul {ty} {n_rows}x{n_cols}x{n_tok} t={t} r={r}: {} vs {want}",
                            out[t * n_rows + r]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn default_entry_points_use_the_active_level() {
    let mut rng = StdRng::seed_from_u64(8);
    let ty = T::Q4_K;
    let w = random_row(&mut rng, ty, 512);
    let (x, _) = act(&mut rng, 512);
    let xq = quant::quantize_act(&x);
    let mut out = [0f32; 1];
    quant::matvec(ty, &w, 512, &x, &xq, &mut out);
    assert_eq!(out[0].to_bits(), quant::dot(ty, &w, &x, &xq).to_bits());
    assert_eq!(
        out[0].to_bits(),
        quant::dot_with(Isa::Scalar, ty, &w, &x, &xq).to_bits()
    );
    let mut out2 = [0f32; 1];
    quant::matmul(ty, &w, 512, &x, std::slice::from_ref(&xq), &mut out2);
    assert_eq!(out2[0].to_bits(), out[0].to_bits());
}

#[test]
fn shapes_are_checked() {
    let mut rng = StdRng::seed_from_u64(9);
    let (x, xq) = act(&mut rng, 256);
    let w = random_row(&mut rng, T::Q4_K, 256);
    let mut out = [0f32; 2];
    assert_eq!(
        quant::try_matvec(T::Q4_K, &w, 256, &x, &xq, &mut out),
        Err(QuantError::BadLength {
            what: "w",
            expected: 288,
            got: 144
        })
    );
    assert_eq!(
        quant::try_matvec(T::Q8_1, &w, 256, &x, &xq, &mut out[..1]),
        Err(QuantError::Unsupported(T::Q8_1))
    );
    assert_eq!(
        quant::try_matvec(T::Q4_K, &w, 128, &x[..128], &xq, &mut out[..1]),
        Err(QuantError::BadColumns {
            ty: T::Q4_K,
            n_cols: 128
        })
    );
    // Float rows may have any length; quantized rows need whole 32-value sub-blocks.
    assert_eq!(quant::row_bytes(T::F32, 48), Ok(192));
    assert_eq!(quant::row_bytes(T::BF16, 241), Ok(482));
    assert_eq!(
        quant::row_bytes(T::Q8_0, 48),
        Err(QuantError::BadColumns {
            ty: T::Q8_0,
            n_cols: 48
        })
    );
    let short = quant::quantize_act(&x[..224]);
    assert!(matches!(
        quant::try_matvec(T::Q4_K, &w, 256, &x, &short, &mut out[..1]),
        Err(QuantError::BadLength { what: "xq.qs", .. })
    ));
    let mut dst = [0f32; 256];
    assert!(quant::try_dequantize_row(T::Q4_K, &w[..100], &mut dst).is_err());
    assert!(quant::try_quantize_row(T::Q6_K, &x, &mut [0u8; 200]).is_err());
    // Conversion needs whole blocks only: a 4-value F32/F16 vector (conv taps) converts,
    // though the dot kernels would refuse it.
    for ty in [T::F32, T::F16, T::BF16] {
        let v = [1.5f32, -2.0, 0.25, 8.0];
        let mut bytes = vec![0u8; ty.type_size() * 4];
        quant::try_quantize_row(ty, &v, &mut bytes).expect("quantize 4 values");
        let mut back = [0f32; 4];
        quant::try_dequantize_row(ty, &bytes, &mut back).expect("dequantize 4 values");
        assert_eq!(back, v, "{ty}");
    }
    assert!(quant::try_dequantize_row(T::Q8_0, &[0u8; 34], &mut [0f32; 4]).is_err());
    let mut out3 = [0f32; 3];
    assert!(matches!(
        quant::try_matmul(
            T::Q4_K,
            &w,
            256,
            &[],
            std::slice::from_ref(&xq),
            &mut out3[..2]
        ),
        Err(QuantError::BadLength { what: "w", .. })
    ));
}

#[test]
fn matvec_many_equals_separate_matvecs_bitwise() {
    let mut rng = StdRng::seed_from_u64(10);
    let shapes = [
        (T::Q4_K, 512usize, 2048usize),
        (T::Q6_K, 40, 512),
        (T::Q8_0, 64, 96),
        (T::BF16, 33, 256),
        (T::IQ4_XS, 1, 256),
    ];
    let mats: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&(ty, rows, cols)| {
            (0..rows)
                .flat_map(|_| random_row(&mut rng, ty, cols))
                .collect()
        })
        .collect();
    let acts: Vec<(Vec<f32>, ActQ8)> = shapes
        .iter()
        .map(|&(_, _, cols)| act(&mut rng, cols))
        .collect();
    for isa in isas() {
        let mut outs: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&(_, rows, _)| vec![f32::NAN; rows])
            .collect();
        {
            let mut jobs: Vec<quant::MatvecJob> = shapes
                .iter()
                .zip(&mats)
                .zip(&acts)
                .zip(outs.iter_mut())
                .map(|(((&(ty, _, cols), w), (x, xq)), out)| quant::MatvecJob {
                    ty,
                    w,
                    n_cols: cols,
                    x,
                    xq,
                    out,
                })
                .collect();
            quant::try_matvec_many_with(isa, &mut jobs).unwrap();
        }
        for (i, &(ty, rows, cols)) in shapes.iter().enumerate() {
            let mut want = vec![0f32; rows];
            quant::matvec_with(
                Isa::Scalar,
                ty,
                &mats[i],
                cols,
                &acts[i].0,
                &acts[i].1,
                &mut want,
            );
            for r in 0..rows {
                assert_eq!(outs[i][r].to_bits(), want[r].to_bits(), "{ty} {isa} r={r}");
            }
        }
    }
    // A bad job refuses the whole batch before anything is written.
    let mut o1 = vec![f32::NAN; 512];
    let mut o2 = vec![f32::NAN; 3];
    let mut jobs = vec![
        quant::MatvecJob {
            ty: T::Q4_K,
            w: &mats[0],
            n_cols: 2048,
            x: &acts[0].0,
            xq: &acts[0].1,
            out: &mut o1,
        },
        quant::MatvecJob {
            ty: T::Q6_K,
            w: &mats[1],
            n_cols: 512,
            x: &acts[1].0,
            xq: &acts[1].1,
            out: &mut o2,
        },
    ];
    assert!(matches!(
        quant::try_matvec_many_with(Isa::Scalar, &mut jobs),
        Err(QuantError::BadLength { what: "w", .. })
    ));
    assert!(o1.iter().all(|v| v.is_nan()));
}

/// Float rows whose length is not a multiple of 32 (a checkpoint with 6 heads of 40 has
/// 240-value attention-output rows): every kernel level gives the scalar bits, matvec
/// (serial and parallel), matmul and matvec_many give the single-row dot's bits, and
/// the dot is the f64 value of the formula.
#[test]
fn float_rows_of_any_length_run_on_every_kernel_level() {
    let mut rng = StdRng::seed_from_u64(10);
    let levels = isas();
    let none = ActQ8::default();
    for ty in FLOAT {
        for n_cols in [1usize, 5, 31, 33, 40, 63, 65, 200, 240, 250, 1000, 4099] {
            // Enough rows to take the parallel matvec path at the larger widths.
            let n_rows = if n_cols >= 1000 { 40 } else { 7 };
            let rb = quant::row_bytes(ty, n_cols).unwrap();
            let mut w = Vec::with_capacity(n_rows * rb);
            for _ in 0..n_rows {
                w.extend(random_row(&mut rng, ty, n_cols));
            }
            let n_tok = 5;
            let xs = rand_floats(&mut rng, n_tok * n_cols);
            let x_of = |t: usize| &xs[t * n_cols..(t + 1) * n_cols];
            let want: Vec<Vec<f32>> = (0..n_tok)
                .map(|t| {
                    (0..n_rows)
                        .map(|r| {
                            let row = &w[r * rb..(r + 1) * rb];
                            let d = quant::dot_with(Isa::Scalar, ty, row, x_of(t), &none);
                            check_close(ty, n_cols, d, f64_reference(ty, row, x_of(t), &none));
                            d
                        })
                        .collect()
                })
                .collect();
            for &isa in &levels {
                for t in 0..n_tok {
                    for r in 0..n_rows {
                        let got =
                            quant::dot_with(isa, ty, &w[r * rb..(r + 1) * rb], x_of(t), &none);
                        assert_eq!(
                            got.to_bits(),
                            want[t][r].to_bits(),
                            "dot {ty} {isa} n={n_cols}"
                        );
                    }
                    let mut out = vec![f32::NAN; n_rows];
                    quant::matvec_with(isa, ty, &w, n_cols, x_of(t), &none, &mut out);
                    assert_eq!(
                        bits(&out),
                        bits(&want[t]),
                        "matvec {ty} {isa} n={n_cols} t={t}"
                    );
                    let mut out2 = vec![f32::NAN; n_rows];
                    quant::try_matvec_many_with(
                        isa,
                        &mut [quant::MatvecJob {
                            ty,
                            w: &w,
                            n_cols,
                            x: x_of(t),
                            xq: &none,
                            out: &mut out2,
                        }],
                    )
                    .unwrap();
                    assert_eq!(
                        bits(&out2),
                        bits(&want[t]),
                        "matvec_many {ty} {isa} n={n_cols}"
                    );
                }
                let mut out = vec![f32::NAN; n_rows * n_tok];
                quant::matmul_with(isa, ty, &w, n_cols, &xs, &[], &mut out);
                for t in 0..n_tok {
                    assert_eq!(
                        bits(&out[t * n_rows..(t + 1) * n_rows]),
                        bits(&want[t]),
                        "matmul {ty} {isa} n={n_cols} t={t}"
                    );
                }
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Q4_0 and Q8_0 rows of 1..=20 blocks: every partial last group of 8 blocks (1..=7,
/// which the SIMD kernels run as one padded group) after 0, 1 and 2 whole groups,
/// against the scalar dot bit for bit through the single-row kernel (`dot_with`,
/// `matvec_with`) and the many-token kernels (`matmul_with` of 15 tokens: tiles of 8,
/// 4, 2 and 1, transposed activations) at every level. Three kinds of row: random;
/// random with blocks whose contribution is exactly -0.0 or +0.0 (a weight scale of
/// ±0.0, quants of value 0 under a negative scale, an all-zero activation block); and
/// every block such a zero, so that the scalar result is exactly +0.0.
#[test]
fn short_q4_0_and_q8_0_rows_are_bit_identical_on_every_kernel_level() {
    let mut rng = StdRng::seed_from_u64(13);
    let levels = isas();
    let (n_rows, n_tok) = (3usize, 15usize);
    for ty in [T::Q4_0, T::Q8_0] {
        let bs = ty.type_size();
        // Quant bytes of value 0: 8 in each Q4_0 nibble, 0 in Q8_0.
        let zero_q = if ty == T::Q4_0 { 0x88u8 } else { 0 };
        for nb in 1..=20usize {
            let n_cols = 32 * nb;
            for kind in 0..3 {
                let zeros = |rng: &mut StdRng| kind == 2 || (kind == 1 && rng.random_bool(0.4));
                let mut w = Vec::with_capacity(n_rows * nb * bs);
                for _ in 0..n_rows {
                    let mut row = random_row(&mut rng, ty, n_cols);
                    for blk in row.chunks_exact_mut(bs) {
                        if !zeros(&mut rng) {
                            continue;
                        }
                        match rng.random_range(0..3) {
                            0 => blk[..2].copy_from_slice(&common::f16_bytes(-0.0)),
                            1 => blk[..2].copy_from_slice(&common::f16_bytes(0.0)),
                            _ => {
                                blk[..2].copy_from_slice(&common::f16_bytes(-0.01));
                                blk[2..].fill(zero_q);
                            }
                        }
                    }
                    w.extend(row);
                }
                let mut xs = Vec::with_capacity(n_tok * n_cols);
                for _ in 0..n_tok {
                    let mut x = rand_floats(&mut rng, n_cols);
                    for b in x.chunks_exact_mut(32) {
                        // Only among random rows' blocks: a zero activation block under
                        // a zero-weight row would leave a contribution of +0.0 too.
                        if kind == 1 && rng.random_bool(0.25) {
                            b.fill(0.0);
                        }
                    }
                    xs.extend(x);
                }
                let xqs: Vec<ActQ8> = xs
                    .chunks_exact(n_cols)
                    .map(|x| quant::quantize_act_with(Isa::Scalar, x))
                    .collect();
                let rb = nb * bs;
                let x_of = |t: usize| &xs[t * n_cols..(t + 1) * n_cols];
                let want: Vec<Vec<f32>> = (0..n_tok)
                    .map(|t| {
                        (0..n_rows)
                            .map(|r| {
                                let row = &w[r * rb..(r + 1) * rb];
                                quant::dot_with(Isa::Scalar, ty, row, x_of(t), &xqs[t])
                            })
                            .collect()
                    })
                    .collect();
                if kind == 2 {
                    assert!(want.iter().flatten().all(|v| v.to_bits() == 0));
                }
                let what = format!("{ty} {nb} blocks, kind {kind}");
                for &isa in &levels {
                    for t in 0..n_tok {
                        for r in 0..n_rows {
                            let row = &w[r * rb..(r + 1) * rb];
                            let got = quant::dot_with(isa, ty, row, x_of(t), &xqs[t]);
                            assert_eq!(
                                got.to_bits(),
                                want[t][r].to_bits(),
                                "dot {what} {isa} t={t} r={r}: {got} vs scalar {}",
                                want[t][r]
                            );
                        }
                        let mut out = vec![f32::NAN; n_rows];
                        quant::matvec_with(isa, ty, &w, n_cols, x_of(t), &xqs[t], &mut out);
                        assert_eq!(bits(&out), bits(&want[t]), "matvec {what} {isa} t={t}");
                    }
                    let mut out = vec![f32::NAN; n_rows * n_tok];
                    quant::matmul_with(isa, ty, &w, n_cols, &xs, &xqs, &mut out);
                    for t in 0..n_tok {
                        assert_eq!(
                            bits(&out[t * n_rows..(t + 1) * n_rows]),
                            bits(&want[t]),
                            "matmul {what} {isa} t={t}"
                        );
                    }
                }
            }
        }
    }
}

/// The loops over rows of the Q4_0/Q8_0 kernels (`matvec`, serial and parallel, and
/// `matvec_many`): every row of a matrix of short rows, for row counts that are not
/// multiples of anything, is the scalar dot bit for bit.
#[test]
fn q4_0_and_q8_0_row_loops_are_bit_identical_for_any_row_count() {
    let mut rng = StdRng::seed_from_u64(17);
    for ty in [T::Q4_0, T::Q8_0] {
        for nb in [1usize, 4, 9] {
            let n_cols = 32 * nb;
            let rb = nb * ty.type_size();
            // 1200 rows of 4+ blocks are over 64 KiB: `matvec` splits them over threads.
            for n_rows in [1usize, 2, 3, 5, 7, 9, 17, 1200] {
                let w: Vec<u8> = (0..n_rows)
                    .flat_map(|_| random_row(&mut rng, ty, n_cols))
                    .collect();
                let x = rand_floats(&mut rng, n_cols);
                let xq = quant::quantize_act_with(Isa::Scalar, &x);
                let want: Vec<f32> = w
                    .chunks_exact(rb)
                    .map(|row| quant::dot_with(Isa::Scalar, ty, row, &x, &xq))
                    .collect();
                let what = format!("{ty} {nb} blocks, {n_rows} rows");
                for isa in isas() {
                    let mut out = vec![f32::NAN; n_rows];
                    quant::matvec_with(isa, ty, &w, n_cols, &x, &xq, &mut out);
                    assert_eq!(bits(&out), bits(&want), "matvec {what} {isa}");
                    let mut jobs = [quant::MatvecJob {
                        ty,
                        w: &w,
                        n_cols,
                        x: &x,
                        xq: &xq,
                        out: &mut out,
                    }];
                    jobs[0].out.fill(f32::NAN);
                    quant::try_matvec_many_with(isa, &mut jobs).expect("shapes");
                    assert_eq!(bits(&out), bits(&want), "matvec_many {what} {isa}");
                }
                let mut out = vec![f32::NAN; n_rows];
                quant::try_matvec_serial(ty, &w, n_cols, &x, &xq, &mut out).expect("shapes");
                assert_eq!(bits(&out), bits(&want), "matvec serial {what}");
            }
        }
    }
}
