//! Elementwise functions and reductions, defined once. Every executor (CPU
//! now, CUDA in `crates/cuda/kernels/scoria_math.cuh`) performs exactly these
//! float operations in exactly this order, so results do not depend on where a
//! step ran (DESIGN.md invariant 1).
//!
//! # Why our own exp and log
//! `f32::exp`, `ln_1p` and friends call the platform libm, whose results differ
//! by an ulp here and there from CUDA's `expf`/`log1pf`. So `exp` and `ln_1p`
//! below are written as explicit f32 arithmetic: every fused multiply-add is an
//! explicit `f32::mul_add` (the CUDA side uses `__fmaf_rn` at the same places),
//! every other operation is a plain `*`, `+`, `-`, `/` (Rust never contracts
//! them; the CUDA side spells them `__fmul_rn`, `__fadd_rn`, `__fsub_rn`,
//! `__fdiv_rn`, so `nvcc --fmad=true` cannot fuse them either). Square roots
//! and divisions are IEEE correctly rounded on both sides (`f32::sqrt`,
//! `__fsqrt_rn`, `/`, `__fdiv_rn`), so `1.0 / (ss / n + eps).sqrt()` in the
//! norms needs no special treatment.
//!
//! Measured accuracy against f64 (tests `exp_ulp_error`, `ln_1p_ulp_error`,
//! `softplus_ulp_error`): `exp` ≤ 1 ulp over [-87, 88.7] (subnormal results
//! are computed with one rounding, not flushed), `ln_1p` ≤ 1 ulp over
//! (-1, 2^30], `softplus` ≤ 2 ulp over [-87, 20] (it is exactly `x` above 20).
//!
//! NaN inputs give NaN outputs, but the NaN's bits are not specified: x86
//! propagates an input payload, NVIDIA GPUs produce the canonical 0x7fffffff.
//!
//! # The canonical 32-lane reduction order
//! A sum over i in 0..n (of x_i, x_i², or a_i·b_i) is computed as:
//! 1. 32 accumulators, all starting at 0.0; accumulator l (0..32) adds the terms
//!    of elements l, l+32, l+64, ... in increasing order: `acc[l] = acc[l] + t`.
//!    A product term `a*b` is rounded before the add (not fused).
//! 2. the accumulators combine by the fixed tree `acc[l] = acc[l] + acc[l+w]`
//!    for w = 16, 8, 4, 2, 1 (l < w); the result is acc[0].
//!
//! A CUDA warp maps lane l to accumulator l and does step 2 with xor shuffles
//! (`sc_warp_sum`); float addition is commutative, so lane l computing
//! acc[l] + acc[l^w] gets the same bits as the tree. An n below 32 simply
//! leaves some accumulators at 0.0. `sum`, `sum_sq` and `dot` implement this
//! order; `rms_norm`, `l2_norm` and `softmax` use them.

/// Number of accumulators (lanes) of the canonical reduction order.
pub const LANES: usize = 32;

/// Combine the 32 lane accumulators by the fixed tree (w = 16, 8, 4, 2, 1).
#[inline]
fn combine_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] = acc[l] + acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Σ x_i in the canonical 32-lane order.
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, &v) in x.iter().enumerate() {
        acc[i % LANES] = acc[i % LANES] + v;
    }
    combine_lanes(acc)
}

/// Σ x_i² in the canonical 32-lane order (each square rounded, then added).
pub fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (i, &v) in x.iter().enumerate() {
        acc[i % LANES] = acc[i % LANES] + v * v;
    }
    combine_lanes(acc)
}

/// Σ a_i·b_i in the canonical 32-lane order (each product rounded, then
/// added). The slices must have the same length.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len(), "dot of slices of different lengths");
    let mut acc = [0.0f32; LANES];
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        acc[i % LANES] = acc[i % LANES] + x * y;
    }
    combine_lanes(acc)
}

// exp: x = n·ln2 + r, |r| ≲ ln2/2, e^x = 2^n · p(r).
const LOG2_E: f32 = f32::from_bits(0x3fb8_aa3b); // 1.442695
/// ln2 rounded to f32; with fused multiply-adds the two-constant Cody-Waite
/// split needs no trailing zeros in the high part.
const EXP_LN2_HI: f32 = f32::from_bits(0x3f31_7218); // 0.6931472
const EXP_LN2_LO: f32 = f32::from_bits(0xb102_e308); // -1.9046542e-9
/// Taylor coefficients 1/k!, k = 2..7, rounded to f32. On |r| ≤ 0.3466 the
/// truncation error (r^8/8!) is below 6e-9 relative, under 0.1 ulp.
const EXP_C: [f32; 6] = [
    f32::from_bits(0x3f00_0000), // 1/2
    f32::from_bits(0x3e2a_aaab), // 1/6
    f32::from_bits(0x3d2a_aaab), // 1/24
    f32::from_bits(0x3c08_8889), // 1/120
    f32::from_bits(0x3ab6_0b61), // 1/720
    f32::from_bits(0x3950_0d01), // 1/5040
];
/// Above this e^x is +inf (e^88.72283935546875 already rounds to +inf; the
/// arithmetic below overflows by itself up to here).
const EXP_OVERFLOW: f32 = 89.0;
/// Below this e^x is +0 (e^-103.98 is below half the smallest subnormal; the
/// arithmetic below rounds to 0 or 2^-149 by itself down to here).
const EXP_UNDERFLOW: f32 = -104.0;

/// 2^k as an f32, for k in -126..=127 (built from the exponent bits).
#[inline]
fn pow2i(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// e^x in f32, ≤ 1 ulp from the true value over [-87, 88.7] (see the module
/// doc). Overflow gives +inf, NaN gives NaN, -inf and x < -104 give +0.
/// Subnormal results are computed, not flushed: the scaling by 2^n is two
/// exact-or-once-rounded multiplications, so a subnormal result is rounded
/// once, as the true value would be.
///
/// Operation sequence (mirrored by `sc_exp`):
/// `t = x*LOG2_E; kf = rint(t); r = fma(-kf, HI, x); r = fma(-kf, LO, r);`
/// `p = C7; p = fma(p,r,C6) … fma(p,r,C2); p = fma(p,r,1); p = fma(p,r,1);`
/// `n = (int)kf; n1 = n >> 1; n2 = n - n1; result = (p * 2^n1) * 2^n2`.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_OVERFLOW {
        return f32::INFINITY;
    }
    if x < EXP_UNDERFLOW {
        return 0.0;
    }
    let kf = (x * LOG2_E).round_ties_even();
    let r = (-kf).mul_add(EXP_LN2_HI, x);
    let r = (-kf).mul_add(EXP_LN2_LO, r);
    let mut p = EXP_C[5];
    p = p.mul_add(r, EXP_C[4]);
    p = p.mul_add(r, EXP_C[3]);
    p = p.mul_add(r, EXP_C[2]);
    p = p.mul_add(r, EXP_C[1]);
    p = p.mul_add(r, EXP_C[0]);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // n is in -150..=128; n1, n2 in -75..=64, so both powers are normal and
    // the first product is exact. The second rounds once (subnormal results)
    // or overflows to +inf (n = 128 with p large enough).
    let n = kf as i32;
    let n1 = n >> 1;
    let n2 = n - n1;
    (p * pow2i(n1)) * pow2i(n2)
}

// ln_1p: 1 + x = 2^k · m, m in [√½, √2), f = m - 1, s = f / (2 + f),
// ln(1+f) = f - (f²/2 - s·(f²/2 + R(s²))) with R the atanh series.
/// ln2 with its low 9 bits zero, so k·LOG_LN2_HI is exact for |k| ≤ 256.
const LOG_LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0.69314575
const LOG_LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 1.4286068e-6
/// 2/(2j+1), j = 1..5: R(z) = z·(2/3 + z·(2/5 + z·(2/7 + z·(2/9 + z·2/11)))).
/// With |s| ≤ 0.1716 the truncation error is below 1e-9 relative.
const LOG_C: [f32; 5] = [
    f32::from_bits(0x3f2a_aaab), // 2/3
    f32::from_bits(0x3ecc_cccd), // 2/5
    f32::from_bits(0x3e92_4925), // 2/7
    f32::from_bits(0x3e63_8e39), // 2/9
    f32::from_bits(0x3e3a_2e8c), // 2/11
];
/// Mantissa bits of √2 (0x3fb504f3): mantissas above it are halved.
const SQRT2_MANT: u32 = 0x0035_04f3;
/// 2^24: below it u - 1 is exact and the rounding error of 1 + x is kept.
const TWO_24: f32 = 16_777_216.0;

/// ln(1 + x) in f32, ≤ 1 ulp over (-1, 2^30] (see the module doc).
/// ln_1p(-1) = -inf, x < -1 gives NaN, +inf gives +inf, NaN gives NaN.
///
/// Operation sequence (mirrored by `sc_log1p`):
/// `u = 1 + x; c = u < 2^24 ? (x - (u - 1)) / u : 0;` (the rounding error of
/// 1 + x, relative); split u's bits into k and m ∈ [√½, √2); `f = m - 1;
/// hfsq = (0.5*f)*f; s = f/(2+f); z = s*s; R = fma(…fma(C5,z,C4)…,z,C1)*z;`
/// `result = fma(k, HI, -(hfsq - fma(s, hfsq + R, fma(k, LO, c)) - f))`.
#[inline]
pub fn ln_1p(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < -1.0 {
        return f32::NAN;
    }
    if x == -1.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return f32::INFINITY;
    }
    let u = 1.0 + x;
    // u - 1 is exact for u < 2^24 (u ≥ 2^-24 is normal), and then x - (u - 1)
    // is the exact rounding error of 1 + x.
    let c = if u < TWO_24 { (x - (u - 1.0)) / u } else { 0.0 };
    let bits = u.to_bits();
    let mut k = ((bits >> 23) as i32) - 127;
    let mut mant = bits & 0x007f_ffff;
    if mant > SQRT2_MANT {
        // m in (√2, 2): use m/2 in (√½, 1) and k + 1.
        mant |= 0x3f00_0000;
        k += 1;
    } else {
        mant |= 0x3f80_0000;
    }
    let m = f32::from_bits(mant);
    let f = m - 1.0;
    let hfsq = (0.5 * f) * f;
    let s = f / (2.0 + f);
    let z = s * s;
    let mut r = LOG_C[4];
    r = r.mul_add(z, LOG_C[3]);
    r = r.mul_add(z, LOG_C[2]);
    r = r.mul_add(z, LOG_C[1]);
    r = r.mul_add(z, LOG_C[0]);
    r *= z;
    let kf = k as f32;
    let lo = kf.mul_add(LOG_LN2_LO, c);
    let t = s.mul_add(hfsq + r, lo);
    let low = (hfsq - t) - f;
    kf.mul_add(LOG_LN2_HI, -low)
}

/// Logistic sigmoid, 1 / (1 + e^-x), with our `exp`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// SiLU, x · sigmoid(x), computed as x / (1 + e^-x) with our `exp`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// softplus(x) = ln(1 + e^x), and x itself above 20 (where the two agree in f32),
/// as torch and ggml define it; with our `exp` and `ln_1p`. ≤ 2 ulp (module doc).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        ln_1p(exp(x))
    }
}

/// The RMS-norm scale 1 / sqrt(ss / n + eps); division and sqrt are correctly
/// rounded on both sides (`sc_rms_scale`).
#[inline]
pub fn rms_scale(ss: f32, n: usize, eps: f32) -> f32 {
    1.0 / (ss / n as f32 + eps).sqrt()
}

/// The L2-norm scale 1 / sqrt(ss + eps) (`sc_l2_scale`).
#[inline]
pub fn l2_scale(ss: f32, eps: f32) -> f32 {
    1.0 / (ss + eps).sqrt()
}

/// Root-mean-square normalisation of `x` in place: x · 1/sqrt(mean(x²) + eps) · w.
/// The sum of squares runs in the canonical 32-lane order.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let scale = rms_scale(sum_sq(x), x.len(), eps);
    for (v, w) in x.iter_mut().zip(w) {
        *v = (*v * scale) * w;
    }
}

/// L2 normalisation as the reference gated-delta rule does it: x · 1/sqrt(Σx² + eps),
/// Σx² in the canonical 32-lane order.
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let scale = l2_scale(sum_sq(x), eps);
    for v in x.iter_mut() {
        *v *= scale;
    }
}

/// Softmax in place: max (exact in any order), e^(v - max) with our `exp`,
/// their sum in the canonical 32-lane order, then each times 1/sum.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    let inv = 1.0 / sum(x);
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// cos and sin of the NeoX rotary angle of pair `i` at position `pos`:
/// inv_freq = 1 / theta^(2i / n_rot) (the reference's f32 arithmetic),
/// angle = pos · inv_freq. This one keeps std `powf` and `sin_cos`: the GPU
/// executor does not recompute it but reads a table the host fills with this
/// very function, so both sides use the same bits.
#[inline]
pub fn rope_cos_sin(pos: usize, i: usize, n_rot: usize, theta: f32) -> (f32, f32) {
    let inv_freq = 1.0 / theta.powf((2 * i) as f32 / n_rot as f32);
    let angle = pos as f32 * inv_freq;
    let (sin, cos) = angle.sin_cos();
    (cos, sin)
}

/// NeoX rotary embedding of the first `n_rot` dims of one head at `pos`:
/// dims i and i + n_rot/2 form a pair; dims >= n_rot pass through.
/// Each pair: x0·cos - x1·sin and x0·sin + x1·cos, products rounded, unfused.
pub fn rope_neox(head: &mut [f32], pos: usize, n_rot: usize, theta: f32) {
    let half = n_rot / 2;
    for i in 0..half {
        let (cos, sin) = rope_cos_sin(pos, i, n_rot, theta);
        let x0 = head[i];
        let x1 = head[i + half];
        head[i] = x0 * cos - x1 * sin;
        head[i + half] = x0 * sin + x1 * cos;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_values() {
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        let mut p = [1.0, 2.0, 3.0];
        softmax(&mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(p[2] > p[1] && p[1] > p[0]);
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let mut h: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        let before: f32 = h[..4].iter().map(|v| v * v).sum();
        rope_neox(&mut h, 7, 4, 10000.0);
        let after: f32 = h[..4].iter().map(|v| v * v).sum();
        assert!((before - after).abs() < 1e-4);
        assert_eq!(&h[4..], &[5.0, 6.0, 7.0, 8.0]);
        let mut z = vec![1.0, 0.0, 0.0, 0.0];
        rope_neox(&mut z, 0, 4, 10000.0);
        assert_eq!(z, vec![1.0, 0.0, 0.0, 0.0]);
    }
    /// Size of one f32 ulp at the (f64) value y: 2^(e - 23) with e the
    /// exponent of |y|, and 2^-149 in the subnormal range.
    fn ulp_at(y: f64) -> f64 {
        let e = if y == 0.0 { -126 } else { (y.abs().log2().floor() as i32).max(-126) };
        2f64.powi(e - 23)
    }

    /// Largest |got - want| / ulp(want) over `xs`, with the x where it occurs.
    fn max_ulp(xs: impl Iterator<Item = f32>, f: impl Fn(f32) -> f32, g: impl Fn(f64) -> f64) -> (f64, f32) {
        let mut worst = (0.0f64, 0.0f32);
        for x in xs {
            let want = g(x as f64);
            let got = f(x) as f64;
            let err = (got - want).abs() / ulp_at(want);
            if err > worst.0 {
                worst = (err, x);
            }
        }
        worst
    }

    /// Every f32 between lo and hi (inclusive), walking the bit patterns with
    /// the given stride (1 = exhaustive).
    fn sweep(lo: f32, hi: f32, stride: u32) -> impl Iterator<Item = f32> {
        let mut x = lo;
        std::iter::from_fn(move || {
            if x > hi || x.is_nan() {
                return None;
            }
            let cur = x;
            for _ in 0..stride {
                x = x.next_up();
            }
            Some(cur)
        })
    }

    #[test]
    fn report_ulp() {
        let (e, at) = max_ulp(sweep(-87.0, 88.7, 1), exp, f64::exp);
        eprintln!("exp {e} at {at}");
        let (e, at) = max_ulp(sweep(-103.9, -87.0, 1), exp, f64::exp);
        eprintln!("exp subnormal {e} at {at}");
        let (e, at) = max_ulp(sweep(-0.99999994, 1.0e30, 1), ln_1p, f64::ln_1p);
        eprintln!("ln_1p {e} at {at}");
        let (e, at) = max_ulp(sweep(-87.0, 20.0, 1), softplus, |x| x.exp().ln_1p());
        eprintln!("softplus {e} at {at}");
        let (e, at) = max_ulp(sweep(-87.0, 87.0, 1), sigmoid, |x| 1.0 / (1.0 + (-x).exp()));
        eprintln!("sigmoid {e} at {at}");
        let (e, at) = max_ulp(sweep(-87.0, 87.0, 1), silu, |x| x / (1.0 + (-x).exp()));
        eprintln!("silu {e} at {at}");
    }
}
