//! Every multiversioned loop (`model::simd`) gives the same bits at every level this
//! CPU has as the plain build (libm `fmaf`/`rintf`), on random data that includes
//! subnormals, huge and tiny magnitudes, signed zeros, values around the exp
//! overflow/underflow thresholds and inputs whose exp argument reduction hits a
//! rounding tie (x·log2(e) exactly half an integer).

use model::deltanet::{conv_step_at, gated_norm_at, step_at};
use model::math::{
    exp, l2_norm_at, log_sum_exp_at, rms_norm_at, sample_weight, sample_weights_at, silu_mul_at,
    SAMPLE_WEIGHT_CUT, SAMPLE_WEIGHT_ONE,
};
use model::simd::Level;

/// xorshift64*, deterministic.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Floats x (both signs) with x · log2(e) == k + 0.5 exactly in f32: the argument
/// reduction's round-half-even meets a tie.
fn exp_ties() -> Vec<f32> {
    let log2e = f32::from_bits(0x3fb8_aa3b);
    let mut out = Vec::new();
    for k in -150i32..=128 {
        let want = k as f32 + 0.5;
        let mut x = want / log2e;
        for _ in 0..8 {
            x = x.next_down();
        }
        for _ in 0..16 {
            if x * log2e == want {
                out.push(x);
            }
            x = x.next_up();
        }
    }
    out
}

/// A mix of ordinary values, the ranges where exp is special, subnormals, huge and
/// tiny magnitudes, signed zeros and exp ties.
fn nasty(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    let ties = exp_ties();
    assert!(ties.len() > 20, "too few exp ties found: {}", ties.len());
    (0..n)
        .map(|_| match r.next() % 10 {
            0 => f32::from_bits((r.next() as u32) & 0x007f_ffff) * r.unit().signum(), // subnormal
            1 => r.unit() * 1.0e30,
            2 => r.unit() * 1.0e-30,
            3 => {
                [0.0, -0.0, 89.0, -104.0, 88.72283, -87.33655, 20.0, -20.0][(r.next() % 8) as usize]
            }
            4 => ties[(r.next() % ties.len() as u64) as usize],
            5 => -ties[(r.next() % ties.len() as u64) as usize],
            6 => r.unit() * 110.0,
            _ => r.unit() * 8.0,
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The levels above Plain this CPU has (empty on CPUs without AVX2/FMA).
fn fast_levels() -> Vec<Level> {
    Level::available()
        .into_iter()
        .filter(|&l| l != Level::Plain)
        .collect()
}

#[test]
fn elementwise_and_norms_match_plain() {
    for n in [1usize, 7, 31, 32, 33, 128, 1000, 4099] {
        for seed in 0..4u64 {
            let x = nasty(n, 11 + seed * 101 + n as u64);
            let w = nasty(n, 12 + seed * 101 + n as u64);
            let ones = vec![1.0f32; n];
            // Norm inputs must not overflow Σx² to inf everywhere: use bounded data too.
            let mut r = Rng(99 + seed + n as u64);
            let small: Vec<f32> = (0..n).map(|_| r.unit() * 3.0).collect();
            for level in fast_levels() {
                for input in [&x, &small] {
                    let (mut a, mut b) = (input.clone(), input.clone());
                    silu_mul_at(Level::Plain, &mut a, &w);
                    silu_mul_at(level, &mut b, &w);
                    assert_eq!(bits(&a), bits(&b), "silu_mul {level:?} n={n}");
                    let (mut a, mut b) = (input.clone(), input.clone());
                    silu_mul_at(Level::Plain, &mut a, &ones);
                    silu_mul_at(level, &mut b, &ones);
                    assert_eq!(bits(&a), bits(&b), "silu {level:?} n={n}");
                    let (mut a, mut b) = (input.clone(), input.clone());
                    rms_norm_at(Level::Plain, &mut a, &w, 1e-6);
                    rms_norm_at(level, &mut b, &w, 1e-6);
                    assert_eq!(bits(&a), bits(&b), "rms_norm {level:?} n={n}");
                    let (mut a, mut b) = (input.clone(), input.clone());
                    l2_norm_at(Level::Plain, &mut a, 1e-6);
                    l2_norm_at(level, &mut b, 1e-6);
                    assert_eq!(bits(&a), bits(&b), "l2_norm {level:?} n={n}");
                    let (mut a, mut b) = (input.clone(), input.clone());
                    gated_norm_at(Level::Plain, &mut a, &x, &small, 1e-6);
                    gated_norm_at(level, &mut b, &x, &small, 1e-6);
                    assert_eq!(bits(&a), bits(&b), "gated_norm {level:?} n={n}");
                }
            }
        }
    }
}

/// The sampler's weights over a vocabulary, at every level, are the scalar function's.
#[test]
fn sample_weights_match_plain() {
    let mut r = Rng(93);
    for n in [1usize, 7, 33, 1000, 248_320] {
        let logits: Vec<f32> = (0..n).map(|_| r.unit() * 30.0).collect();
        for x in [logits, nasty(n, 7 + n as u64)] {
            let m = x
                .iter()
                .copied()
                .filter(|v| v.is_finite())
                .fold(f32::MIN, f32::max);
            for t in [0.05f32, 0.7, 1.0, 3.0] {
                let want: Vec<u32> = x.iter().map(|&e| sample_weight(e, m, t)).collect();
                for level in Level::available() {
                    let mut got = vec![7u32; n];
                    sample_weights_at(level, &x, m, t, &mut got);
                    assert_eq!(got, want, "{level:?} n={n} t={t}");
                }
                // The branch-free weight is the definition with the checked exp, also
                // where m is not the maximum (d > 0, past exp's overflow).
                for mm in [m, 0.0, -5.0, -1e30, f32::MIN] {
                    for &e in &x {
                        let d = (e - mm) / t;
                        let def = if e.is_finite() && d >= SAMPLE_WEIGHT_CUT {
                            (exp(d) * SAMPLE_WEIGHT_ONE as f32) as u32
                        } else {
                            0
                        };
                        assert_eq!(sample_weight(e, mm, t), def, "e={e} m={mm} t={t}");
                    }
                }
            }
        }
    }
}

#[test]
fn log_sum_exp_matches_plain() {
    let mut r = Rng(91);
    for n in [0usize, 1, 31, 32, 33, 1000, 248_320] {
        // Logit-like values, then the nasty mix (extremes, subnormals, exp ties).
        let logits: Vec<f32> = (0..n).map(|_| r.unit() * 30.0).collect();
        for x in [logits, nasty(n, 5 + n as u64)] {
            let want = log_sum_exp_at(Level::Plain, &x);
            for level in fast_levels() {
                assert_eq!(
                    log_sum_exp_at(level, &x).to_bits(),
                    want.to_bits(),
                    "{level:?} n={n}"
                );
            }
        }
    }
}

#[test]
fn conv_step_matches_plain() {
    let (channels, d_conv) = (300, 4);
    let w = nasty(channels * d_conv, 5);
    for level in fast_levels() {
        let mut st_a = nasty(channels * (d_conv - 1), 6);
        let mut st_b = st_a.clone();
        for t in 0..20u64 {
            let x = nasty(channels, 100 + t);
            let (mut oa, mut ob) = (vec![0.0f32; channels], vec![0.0f32; channels]);
            conv_step_at(Level::Plain, &mut st_a, &w, &x, d_conv, &mut oa);
            conv_step_at(level, &mut st_b, &w, &x, d_conv, &mut ob);
            assert_eq!(bits(&oa), bits(&ob), "conv_step output {level:?} t={t}");
            assert_eq!(bits(&st_a), bits(&st_b), "conv_step state {level:?} t={t}");
        }
    }
}

/// The conv's rule written out for any kernel size (the state shifts by one each
/// token): the unrolled kernel-of-4 path must give its bits.
#[test]
fn conv_step_of_four_taps_follows_the_rule() {
    let (channels, d_conv) = (77, 4);
    let hist = d_conv - 1;
    let w = nasty(channels * d_conv, 7);
    let mut st_want = nasty(channels * hist, 8);
    let mut st_got = st_want.clone();
    for level in std::iter::once(Level::Plain).chain(fast_levels()) {
        for t in 0..10u64 {
            let x = nasty(channels, 200 + t);
            let mut want = vec![0.0f32; channels];
            for c in 0..channels {
                let (taps, st) = (&w[c * d_conv..], &mut st_want[c * hist..(c + 1) * hist]);
                let mut acc = 0.0f32;
                for j in 0..hist {
                    acc += st[j] * taps[j];
                }
                acc += x[c] * taps[hist];
                want[c] = model::math::silu(acc);
                st.rotate_left(1);
                st[hist - 1] = x[c];
            }
            let mut got = vec![0.0f32; channels];
            conv_step_at(level, &mut st_got, &w, &x, d_conv, &mut got);
            assert_eq!(bits(&got), bits(&want), "conv output {level:?} t={t}");
            assert_eq!(bits(&st_got), bits(&st_want), "conv state {level:?} t={t}");
        }
    }
}

/// The recurrence in its four-pass form (decay all of S, kv, δ, update, output), as
/// `step` was first written: the fused two-pass `step` must give the same bits.
#[allow(clippy::too_many_arguments)]
fn four_pass(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, o: &mut [f32]) {
    let dv = v.len();
    let decay = model::math::exp(g);
    for x in s.iter_mut() {
        *x *= decay;
    }
    let mut kv = vec![0.0f32; dv];
    for (i, &ki) in k.iter().enumerate() {
        for (acc, &sij) in kv.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
            *acc += sij * ki;
        }
    }
    let delta: Vec<f32> = v
        .iter()
        .zip(&kv)
        .map(|(&vj, &kvj)| beta * (vj - kvj))
        .collect();
    for (i, &ki) in k.iter().enumerate() {
        for (sij, &dj) in s[i * dv..(i + 1) * dv].iter_mut().zip(&delta) {
            *sij += ki * dj;
        }
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, &qi) in q.iter().enumerate() {
        for (acc, &sij) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
            *acc += sij * qi;
        }
    }
}

#[test]
fn deltanet_step_matches_plain() {
    for (dk, dv) in [(128usize, 128usize), (16, 40), (3, 5)] {
        let mut r = Rng(77 + dk as u64);
        let s0: Vec<f32> = (0..dk * dv).map(|_| r.unit() * 0.5).collect();
        for level in Level::available() {
            let (mut sa, mut sb) = (s0.clone(), s0.clone());
            for t in 0..40u64 {
                // Mostly model-like values, with every fourth token taken from the
                // nasty mix (subnormals, extremes) to exercise the special cases.
                let pick = |n: usize, seed: u64, r: &mut Rng| -> Vec<f32> {
                    if t % 4 == 3 {
                        nasty(n, seed)
                    } else {
                        (0..n).map(|_| r.unit()).collect()
                    }
                };
                let q = pick(dk, 1000 + t, &mut r);
                let k = pick(dk, 2000 + t, &mut r);
                let v = pick(dv, 3000 + t, &mut r);
                // g spans ordinary decays, exp ties, subnormal and underflowing decays.
                let g = match t % 5 {
                    0 => -r.unit().abs() * 4.0,
                    1 => -exp_ties()[(t as usize * 7) % 50].abs(),
                    2 => -100.0,
                    3 => -200.0,
                    _ => -0.0,
                };
                let beta = 0.5 * (r.unit() + 1.0);
                let (mut oa, mut ob) = (vec![0.0f32; dv], vec![0.0f32; dv]);
                // Plain is checked against the four-pass form, the others against Plain.
                if level == Level::Plain {
                    four_pass(&mut sa, &q, &k, &v, g, beta, &mut oa);
                } else {
                    step_at(Level::Plain, &mut sa, &q, &k, &v, g, beta, &mut oa);
                }
                step_at(level, &mut sb, &q, &k, &v, g, beta, &mut ob);
                assert_eq!(
                    bits(&oa),
                    bits(&ob),
                    "step output {level:?} {dk}x{dv} t={t}"
                );
                assert_eq!(bits(&sa), bits(&sb), "step state {level:?} {dk}x{dv} t={t}");
            }
        }
    }
}

/// The plain build is the reference: the fast builds must really be different code
/// paths on this CPU for the tests above to mean anything (reported, not failed, on
/// CPUs without AVX2/FMA, where only the plain build runs).
#[test]
fn fast_levels_exist_on_x86_with_fma() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        assert!(fast_levels().contains(&Level::Avx2));
    }
}

#[test]
fn routing_matches_plain() {
    use model::moe::route_at;
    for (n, k) in [(256usize, 8usize), (512, 10), (16, 4), (5, 5)] {
        for seed in 0..8u64 {
            let mut r = Rng(500 + seed * 31 + n as u64);
            let logits: Vec<f32> = if seed % 2 == 0 {
                (0..n).map(|_| r.unit() * 6.0).collect()
            } else {
                nasty(n, 600 + seed)
            };
            let want: Vec<(usize, u32)> = route_at(Level::Plain, &logits, k)
                .into_iter()
                .map(|(i, w)| (i, w.to_bits()))
                .collect();
            for level in fast_levels() {
                let got: Vec<(usize, u32)> = route_at(level, &logits, k)
                    .into_iter()
                    .map(|(i, w)| (i, w.to_bits()))
                    .collect();
                assert_eq!(got, want, "route {level:?} n={n} seed={seed}");
            }
        }
    }
}
