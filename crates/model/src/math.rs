//! Elementwise functions and reductions, defined once. Every executor (CPU
//! now, CUDA in `crates/cuda/kernels/scoria_math.cuh`) performs exactly these
//! float operations in exactly this order, so results do not depend on where a
//! step ran (docs/design.md invariant 1).
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
//! Measured accuracy against f64, exhaustively over every f32 in the range
//! (numbers kept in the tests `exp_ulp_error`, `ln_1p_ulp_error`,
//! `softplus_sigmoid_silu_ulp_error`, which re-check them on strided sweeps):
//! `exp` 0.94 ulp over [-87, 88.7] and 0.85 ulp over [-103.9, -87]
//! (subnormal results are computed with one rounding, not flushed; below
//! about -103.97 the result is +0, above 88.7228 it is +inf); `ln_1p`
//! 0.84 ulp over (-1, 1e30]; `softplus` 1.69 ulp over [-87, 20] (it is
//! exactly `x` above 20); `sigmoid` 2.48 ulp and `silu` 2.39 ulp over
//! [-87, 87] (the roundings of the prescribed formulas themselves).
//!
//! Builds: `rms_norm`, `l2_norm` and `silu_mul` (and the DeltaNet loops and routing) are compiled
//! once per CPU vector level and chosen at run time (`crate::simd`). Hardware FMA and
//! SSE4.1 nearest-even rounding give the bits of libm's `fmaf`/`rintf`, which the
//! baseline build calls, so every level computes the same bits; the other functions
//! here are `#[inline(always)]` so that callers built for a level get them inline too.
//!
//! NaN inputs give NaN outputs, but the NaN's bits are not specified: x86
//! propagates an input payload, NVIDIA GPUs produce the canonical 0x7fffffff.
//!
//! # The canonical 32-lane reduction order
//! A sum over i in 0..n (of x_i, x_i², or a_i·b_i) is computed as:
//! 1. 32 accumulators, all starting at 0.0; accumulator l (0..32) adds the terms
//!    of elements l, l+32, l+64, ... in increasing order: `acc[l] = acc[l] + t`
//!    (written `acc[l] += t`: one rounded addition, never fused).
//!    A product term `a*b` is rounded before the add (not fused).
//! 2. the accumulators combine by the fixed tree `acc[l] = acc[l] + acc[l+w]`
//!    for w = 16, 8, 4, 2, 1 (l < w); the result is acc[0].
//!
//! A CUDA warp maps lane l to accumulator l and does step 2 with xor shuffles
//! (`sc_warp_sum`); float addition is commutative, so lane l computing
//! acc[l] + acc[l^w] gets the same bits as the tree. An n below 32 simply
//! leaves some accumulators at 0.0. `sum`, `sum_sq` and `dot` implement this
//! order; `rms_norm`, `l2_norm` and `softmax` use them.

use crate::simd::multiversion;
// Step 2 is defined once, beside the quantized kernels' canonical order.
use quant::combine_lanes;
/// Number of accumulators (lanes) of the canonical reduction order.
pub use quant::LANES;

/// Σ x_i in the canonical 32-lane order.
#[inline]
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    // Whole groups of 32 first, then the partial last group: accumulator l still
    // takes elements l, l+32, ... in increasing order, and the compiler can keep the
    // 32 accumulators in vector registers.
    let mut groups = x.chunks_exact(LANES);
    for g in &mut groups {
        for l in 0..LANES {
            acc[l] += g[l];
        }
    }
    for (a, &v) in acc.iter_mut().zip(groups.remainder()) {
        *a += v;
    }
    combine_lanes(acc)
}

/// Σ x_i² in the canonical 32-lane order (each square rounded, then added).
#[inline]
pub fn sum_sq(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut groups = x.chunks_exact(LANES);
    for g in &mut groups {
        for l in 0..LANES {
            acc[l] += g[l] * g[l];
        }
    }
    for (a, &v) in acc.iter_mut().zip(groups.remainder()) {
        *a += v * v;
    }
    combine_lanes(acc)
}

/// Σ a_i·b_i in the canonical 32-lane order (each product rounded, then
/// added). The slices must have the same length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len(), "dot of slices of different lengths");
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let (mut ga, mut gb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut ga).zip(&mut gb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for ((a, &x), &y) in acc.iter_mut().zip(ga.remainder()).zip(gb.remainder()) {
        *a += x * y;
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

/// e^x in f32, ≤ 1 ulp from the true value over [-103.9, 88.7] (see the
/// module doc). Overflow gives +inf, NaN gives NaN, -inf and x < -104 give +0.
/// Subnormal results are computed, not flushed: the scaling by 2^n is two
/// exact-or-once-rounded multiplications, so a subnormal result is rounded
/// once, as the true value would be.
///
/// Operation sequence (mirrored by `sc_exp`):
/// `t = x*LOG2_E; kf = rint(t); r = fma(-kf, HI, x); r = fma(-kf, LO, r);`
/// `p = C7; p = fma(p,r,C6) … fma(p,r,C2); p = fma(p,r,1); p = fma(p,r,1);`
/// `n = (int)kf; n1 = n >> 1; n2 = n - n1; result = (p * 2^n1) * 2^n2`.
#[inline(always)]
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
    exp_in_range(x)
}

/// [`exp`] for x in [`EXP_UNDERFLOW`, `EXP_OVERFLOW`] (callers guarantee it): its
/// operations without the range checks (the same bits there), so a loop over it
/// vectorises.
#[inline(always)]
fn exp_in_range(x: f32) -> f32 {
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
    // SAFETY: kf is integral and, x being in range, within -150..=128: an i32. (A
    // saturating `as` would keep loops over it from vectorising.)
    let n: i32 = unsafe { kf.to_int_unchecked() };
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

/// ln(1 + x) in f32, ≤ 1 ulp over (-1, 1e30] (see the module doc).
/// ln_1p(±0) = ±0, ln_1p(-1) = -inf, x < -1 gives NaN, +inf gives +inf,
/// NaN gives NaN.
///
/// Operation sequence (mirrored by `sc_log1p`):
/// `u = 1 + x; c = u < 2^24 ? (x - (u - 1)) / u : 0;` (the rounding error of
/// 1 + x, relative); split u's bits into k and m ∈ [√½, √2); `f = m - 1;
/// hfsq = (0.5*f)*f; s = f/(2+f); z = s*s; R = fma(…fma(C5,z,C4)…,z,C1)*z;`
/// `result = fma(k, HI, -(hfsq - fma(s, hfsq + R, fma(k, LO, c)) - f))`.
#[inline(always)]
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
    if x == 0.0 {
        // Keeps the sign of -0 (the arithmetic below would give +0).
        return x;
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
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// SiLU, x · sigmoid(x), computed as x / (1 + e^-x) with our `exp`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// softplus(x) = ln(1 + e^x), and x itself above 20 (where the two agree in f32),
/// as torch and ggml define it; with our `exp` and `ln_1p`. ≤ 2 ulp (module doc).
#[inline(always)]
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

multiversion! {
    /// Root-mean-square normalisation of `x` in place: x · 1/sqrt(mean(x²) + eps) · w.
    /// The sum of squares runs in the canonical 32-lane order.
    pub fn rms_norm / rms_norm_at(x: &mut [f32], w: &[f32], eps: f32) {
        let scale = rms_scale(sum_sq(x), x.len(), eps);
        for (v, w) in x.iter_mut().zip(w) {
            *v = (*v * scale) * w;
        }
    }
}

multiversion! {
    /// L2 normalisation as the reference gated-delta rule does it: x · 1/sqrt(Σx² + eps),
    /// Σx² in the canonical 32-lane order.
    pub fn l2_norm / l2_norm_at(x: &mut [f32], eps: f32) {
        let scale = l2_scale(sum_sq(x), eps);
        for v in x.iter_mut() {
            *v *= scale;
        }
    }
}

multiversion! {
    /// SwiGLU in place: `g_i = silu(g_i) · u_i` (the slices have the same length).
    pub fn silu_mul / silu_mul_at(g: &mut [f32], u: &[f32]) {
        debug_assert_eq!(g.len(), u.len(), "silu_mul of slices of different lengths");
        for (a, &b) in g.iter_mut().zip(u) {
            *a = silu(*a) * b;
        }
    }
}

/// Sampling weights (the engine's sampler, `engine::sampler` module docs): a finite
/// logit `e` at `d = (e − m) / t` weighs `⌊exp(d) · 2³¹⌋`, 0 below `d < −22` and when
/// `e` is not finite. `sc_weight` in the CUDA sampler computes the same bits.
#[inline(always)]
pub fn sample_weight(e: f32, m: f32, t: f32) -> u32 {
    let d = (e - m) / t;
    let ok = e.is_finite() && d >= SAMPLE_WEIGHT_CUT;
    // d ≤ 0 for e ≤ m: exp(d) ≤ 1, at most 2^31; the cast truncates. Without branches
    // (a loop over it vectorises): d is in exp's range once clamped above, and a d
    // past EXP_OVERFLOW gives +inf either way, which the cast saturates.
    let x = if ok { d.min(EXP_OVERFLOW) } else { 0.0 };
    let f = exp_in_range(x) * SAMPLE_WEIGHT_ONE as f32;
    // `f as u32` without the saturating cast's branches: f is not NaN and ≥ 0, and
    // 2^32 or more saturates to u32::MAX as the cast does.
    // SAFETY: the clamped value is in [0, 2^32).
    let w: u32 = unsafe { f.min(4_294_967_040.0).to_int_unchecked() };
    match (ok, f >= 4_294_967_296.0) {
        (false, _) => 0,
        (true, true) => u32::MAX,
        (true, false) => w,
    }
}

/// The weight of the largest logit.
pub const SAMPLE_WEIGHT_ONE: u32 = 1 << 31;
/// `(e − m) / t` below this weighs 0 (e^-22 · 2^31 < 1: its floor is 0 anyway).
pub const SAMPLE_WEIGHT_CUT: f32 = -22.0;

multiversion! {
    /// `out[i] = sample_weight(l[i], m, t)` for every logit (the slices have the same
    /// length): a sampling step's weights over the whole vocabulary, vectorised.
    pub fn sample_weights / sample_weights_at(l: &[f32], m: f32, t: f32, out: &mut [u32]) {
        for (o, &e) in out.iter_mut().zip(l) {
            *o = sample_weight(e, m, t);
        }
    }
}

multiversion! {
    /// ln Σ e^x_i: the maximum (exact in any order), e^(x_i - max) with our `exp`
    /// summed in the canonical 32-lane order, then max + ln_1p(sum - 1) (the sum is
    /// at least 1: the maximum's own term). -inf when every value is -inf (or `x`
    /// is empty), NaN when one is NaN, +inf when one is.
    pub fn log_sum_exp / log_sum_exp_at(x: &[f32]) -> f32 {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if x.iter().any(|v| v.is_nan()) {
            return f32::NAN;
        }
        if !max.is_finite() {
            return max;
        }
        let mut acc = [0.0f32; LANES];
        let mut groups = x.chunks_exact(LANES);
        for g in &mut groups {
            for l in 0..LANES {
                acc[l] += exp(g[l] - max);
            }
        }
        for (a, &v) in acc.iter_mut().zip(groups.remainder()) {
            *a += exp(v - max);
        }
        max + ln_1p(combine_lanes(acc) - 1.0)
    }
}

/// Softmax in place: max (exact in any order), e^(v - max) with our `exp`,
/// their sum in the canonical 32-lane order, then each times 1/sum.
// Always inlined: attention's vector builds (`engine::cpu::attention`) then run it,
// and `exp`'s fused multiply-adds, as instructions instead of calls (same bits).
#[inline(always)]
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
    rope_neox_with(head, &rope_table(pos, n_rot, theta));
}

/// [`rope_cos_sin`] of every pair at `pos`: one table serves every head of a token.
pub fn rope_table(pos: usize, n_rot: usize, theta: f32) -> Vec<(f32, f32)> {
    (0..n_rot / 2)
        .map(|i| rope_cos_sin(pos, i, n_rot, theta))
        .collect()
}

/// The rotary table of a token at multimodal position (t, h, w) with interleaved
/// sections (Qwen3.5's M-RoPE, transformers' `recomposition_frequencies`): pair `i`
/// takes the h position when `i % 3 == 1` and `i < 3 * sections[1]`, the w position when
/// `i % 3 == 2` and `i < 3 * sections[2]`, else t. With t = h = w it is
/// [`rope_table`] of that position, bit for bit.
pub fn mrope_table(
    pos: [u32; 3],
    n_rot: usize,
    theta: f32,
    sections: [usize; 4],
) -> Vec<(f32, f32)> {
    (0..n_rot / 2)
        .map(|i| {
            let axis = if i % 3 == 1 && i < 3 * sections[1] {
                1
            } else if i % 3 == 2 && i < 3 * sections[2] {
                2
            } else {
                0
            };
            rope_cos_sin(pos[axis] as usize, i, n_rot, theta)
        })
        .collect()
}

/// [`rope_neox`] with the position's [`rope_table`] (its length is n_rot / 2).
pub fn rope_neox_with(head: &mut [f32], table: &[(f32, f32)]) {
    let half = table.len();
    for (i, &(cos, sin)) in table.iter().enumerate() {
        let x0 = head[i];
        let x1 = head[i + half];
        head[i] = x0 * cos - x1 * sin;
        head[i + half] = x0 * sin + x1 * cos;
    }
}

/// One pinned input and the exact output bits of each activation, for
/// [`PINNED`].
#[derive(Debug, Clone, Copy)]
pub struct Pinned {
    /// Input bits (`f32::to_bits`).
    pub x: u32,
    /// `exp(x)` bits.
    pub exp: u32,
    /// `sigmoid(x)` bits.
    pub sigmoid: u32,
    /// `silu(x)` bits.
    pub silu: u32,
    /// `softplus(x)` bits.
    pub softplus: u32,
}

/// Pinned bit patterns of `exp`, `sigmoid`, `silu` and `softplus`: the
/// outputs these formulas give today, covering ordinary values, the worst
/// measured ulp errors, overflow, subnormal results, underflow to zero, and
/// ±0 and +inf (no NaN outputs: their bits are not specified). The unit tests
/// check the CPU functions against it and the CUDA test suite checks
/// `sc_exp`, `sc_sigmoid`, `sc_silu`, `sc_softplus` against the same table, so
/// a change of formula on either side fails loudly. Regenerate it
/// (`cargo run -p scoria-model --example pinned_tables`, which recomputes the
/// outputs of the inputs listed here) only together with a deliberate formula
/// change made on both sides.
pub const PINNED: &[Pinned] = &[
    Pinned {
        x: 0x00000000,
        exp: 0x3f800000,
        sigmoid: 0x3f000000,
        silu: 0x00000000,
        softplus: 0x3f317218,
    }, // 0e0
    Pinned {
        x: 0x80000000,
        exp: 0x3f800000,
        sigmoid: 0x3f000000,
        silu: 0x80000000,
        softplus: 0x3f317218,
    }, // -0e0
    Pinned {
        x: 0x3f800000,
        exp: 0x402df854,
        sigmoid: 0x3f3b26a8,
        silu: 0x3f3b26a8,
        softplus: 0x3fa818f5,
    }, // 1e0
    Pinned {
        x: 0xbf800000,
        exp: 0x3ebc5ab2,
        sigmoid: 0x3e89b2b1,
        silu: 0xbe89b2b1,
        softplus: 0x3ea063d6,
    }, // -1e0
    Pinned {
        x: 0x3f000000,
        exp: 0x3fd3094c,
        sigmoid: 0x3f1f597f,
        silu: 0x3e9f597f,
        softplus: 0x3f795d1c,
    }, // 5e-1
    Pinned {
        x: 0xbf000000,
        exp: 0x3f1b4598,
        sigmoid: 0x3ec14d03,
        silu: 0xbe414d03,
        softplus: 0x3ef2ba38,
    }, // -5e-1
    Pinned {
        x: 0x40490fdb,
        exp: 0x41b92024,
        sigmoid: 0x3f75653f,
        silu: 0x4040bbb1,
        softplus: 0x404bc500,
    }, // 3.1415927e0
    Pinned {
        x: 0xc0700000,
        exp: 0x3cc0a84a,
        sigmoid: 0x3cbc3b0a,
        silu: 0xbdb07759,
        softplus: 0x3cbe6d46,
    }, // -3.75e0
    Pinned {
        x: 0x33d6bf95,
        exp: 0x3f800001,
        sigmoid: 0x3f000001,
        silu: 0x3356bf96,
        softplus: 0x3f317219,
    }, // 1e-7
    Pinned {
        x: 0x8da24260,
        exp: 0x3f800000,
        sigmoid: 0x3f000000,
        silu: 0x8d224260,
        softplus: 0x3f317218,
    }, // -1e-30
    Pinned {
        x: 0x41200000,
        exp: 0x46ac14ef,
        sigmoid: 0x3f7ffd06,
        silu: 0x411ffe24,
        softplus: 0x41200030,
    }, // 1e1
    Pinned {
        x: 0xc1200000,
        exp: 0x383e6bce,
        sigmoid: 0x383e6997,
        silu: 0xb9ee03fc,
        softplus: 0x383e6ab3,
    }, // -1e1
    Pinned {
        x: 0x41a00000,
        exp: 0x4de75844,
        sigmoid: 0x3f800000,
        silu: 0x41a00000,
        softplus: 0x41a00000,
    }, // 2e1
    Pinned {
        x: 0x41a00001,
        exp: 0x4de75861,
        sigmoid: 0x3f800000,
        silu: 0x41a00001,
        softplus: 0x41a00001,
    }, // 2.0000002e1
    Pinned {
        x: 0x41f00000,
        exp: 0x551b8238,
        sigmoid: 0x3f800000,
        silu: 0x41f00000,
        softplus: 0x41f00000,
    }, // 3e1
    Pinned {
        x: 0xc1f00000,
        exp: 0x29d2b706,
        sigmoid: 0x29d2b707,
        silu: 0xac458b96,
        softplus: 0x29d2b706,
    }, // -3e1
    Pinned {
        x: 0x41d582e9,
        exp: 0x52b584c5,
        sigmoid: 0x3f800000,
        silu: 0x41d582e9,
        softplus: 0x41d582e9,
    }, // 2.6688921e1
    Pinned {
        x: 0xbfa18cdf,
        exp: 0x3e90ecad,
        sigmoid: 0x3e61e7c1,
        silu: 0xbe8e8f10,
        softplus: 0x3e7f39f2,
    }, // -1.2621115e0
    Pinned {
        x: 0xc18515ec,
        exp: 0x337ff4bf,
        sigmoid: 0x337ff4bc,
        silu: 0xb5851011,
        softplus: 0x337ff4bf,
    }, // -1.6635704e1
    Pinned {
        x: 0xc1857a71,
        exp: 0x3373b253,
        sigmoid: 0x3373b254,
        silu: 0xb57e2069,
        softplus: 0x3373b253,
    }, // -1.6684786e1
    Pinned {
        x: 0x42b16666,
        exp: 0x7f7a37fc,
        sigmoid: 0x3f800000,
        silu: 0x42b16666,
        softplus: 0x42b16666,
    }, // 8.87e1
    Pinned {
        x: 0x42b17217,
        exp: 0x7f7fff84,
        sigmoid: 0x3f800000,
        silu: 0x42b17217,
        softplus: 0x42b17217,
    }, // 8.872283e1
    Pinned {
        x: 0x42b17218,
        exp: 0x7f800000,
        sigmoid: 0x3f800000,
        silu: 0x42b17218,
        softplus: 0x42b17218,
    }, // 8.872284e1
    Pinned {
        x: 0xc2af0000,
        exp: 0x006cb2bc,
        sigmoid: 0x006cb2bc,
        silu: 0x83949c5d,
        softplus: 0x006cb2bc,
    }, // -8.75e1
    Pinned {
        x: 0xc2c80000,
        exp: 0x0000001b,
        sigmoid: 0x00000000,
        silu: 0x80000000,
        softplus: 0x0000001b,
    }, // -1e2
    Pinned {
        x: 0xc2cf0000,
        exp: 0x00000001,
        sigmoid: 0x00000000,
        silu: 0x80000000,
        softplus: 0x00000001,
    }, // -1.035e2
    Pinned {
        x: 0xc2d10000,
        exp: 0x00000000,
        sigmoid: 0x00000000,
        silu: 0x80000000,
        softplus: 0x00000000,
    }, // -1.045e2
    Pinned {
        x: 0x7f800000,
        exp: 0x7f800000,
        sigmoid: 0x3f800000,
        silu: 0x7f800000,
        softplus: 0x7f800000,
    }, // inf
];

/// Pinned bit patterns of `ln_1p` (`sc_log1p`): (input bits, output bits),
/// like [`PINNED`].
pub const PINNED_LN_1P: &[(u32, u32)] = &[
    (0x00000000, 0x00000000), // 0e0
    (0x80000000, 0x80000000), // -0e0
    (0x2edbe6ff, 0x2edbe6ff), // 1e-10
    (0xaedbe6ff, 0xaedbe6ff), // -1e-10
    (0x3a83126f, 0x3a8301ab), // 1e-3
    (0x3ecf9864, 0x3eae443c), // 4.0545952e-1
    (0xbe800000, 0xbe934b10), // -2.5e-1
    (0xbf000000, 0xbf317218), // -5e-1
    (0xbf7fffff, 0xc1851592), // -9.9999994e-1
    (0x3f800000, 0x3f317218), // 1e0
    (0x402df854, 0x3fa818f5), // 2.7182817e0
    (0x447a0000, 0x40dd1485), // 1e3
    (0x4b800000, 0x41851592), // 1.6777216e7
    (0x50df8476, 0x41c0fee7), // 3e10
    (0x7f7fffff, 0x42b17218), // 3.4028235e38
    (0xbf800000, 0xff800000), // -1e0
    (0x7f800000, 0x7f800000), // inf
];

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
    fn mrope_of_equal_positions_is_rope() {
        for p in [0u32, 7, 4095] {
            assert_eq!(
                mrope_table([p; 3], 64, 1e7, [11, 11, 10, 0]),
                rope_table(p as usize, 64, 1e7)
            );
        }
        // Pairs 1, 4, .. take h and 2, 5, .. take w within their sections; the rest t.
        let t = mrope_table([1, 2, 3], 16, 1e4, [3, 3, 2, 0]);
        let axis = [1, 2, 3, 1, 2, 3, 1, 2];
        for (i, &(c, s)) in t.iter().enumerate() {
            assert_eq!((c, s), rope_cos_sin(axis[i], i, 16, 1e4), "pair {i}");
        }
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
        let e = if y == 0.0 {
            -126
        } else {
            (y.abs().log2().floor() as i32).max(-126)
        };
        2f64.powi(e - 23)
    }

    /// Largest |got - want| / ulp(want) over `xs`, with the x where it occurs.
    fn max_ulp(
        xs: impl Iterator<Item = f32>,
        f: impl Fn(f32) -> f32,
        g: impl Fn(f64) -> f64,
    ) -> (f64, f32) {
        let mut worst = (0.0f64, 0.0f32);
        for x in xs {
            let want = g(x as f64);
            let got = f(x) as f64;
            let err = (got - want).abs() / ulp_at(want);
            if err > worst.0 || err.is_nan() {
                worst = (err, x);
            }
        }
        worst
    }

    /// The f32 values from lo to hi (inclusive), every `stride`-th bit
    /// pattern (1 = every float; the exhaustive sweeps gave the same maxima
    /// as the strided ones below, see the module doc).
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

    // Exhaustive sweeps (every f32; release build, ~8 min) measured:
    //   exp      0.939 ulp on [-87, 88.7] (at 26.688921),
    //            0.849 ulp on [-103.9, -87] (subnormal results),
    //   ln_1p    0.835 ulp on (-1, 1e30] (at 0.40545952),
    //   softplus 1.694 ulp on [-87, 20] (at -1.2621115),
    //   sigmoid  2.481 ulp, silu 2.394 ulp on [-87, 87] (the formulas' own
    //            roundings of 1 + e^-x and the division, not exp's error).
    // The tests sweep with strides (a few million points each) and hold the
    // functions to these bounds.

    #[test]
    fn exp_ulp_error() {
        let (e, at) = max_ulp(sweep(-87.0, 88.7, 997), exp, f64::exp);
        assert!(e <= 1.0, "exp: {e} ulp at {at}");
        let (e, at) = max_ulp(sweep(-103.9, -87.0, 101), exp, f64::exp);
        assert!(e <= 1.0, "exp, subnormal results: {e} ulp at {at}");
        assert!(max_ulp([26.688921f32].into_iter(), exp, f64::exp).0 > 0.9);
    }

    #[test]
    fn ln_1p_ulp_error() {
        let (e, at) = max_ulp(sweep(-0.99999994, 1.0e30, 997), ln_1p, f64::ln_1p);
        assert!(e <= 1.0, "ln_1p: {e} ulp at {at}");
        let (e, at) = max_ulp(sweep(-1.0e-3, 1.0e-3, 499), ln_1p, f64::ln_1p);
        assert!(e <= 1.0, "ln_1p near 0: {e} ulp at {at}");
    }

    #[test]
    fn softplus_sigmoid_silu_ulp_error() {
        let softplus64 = |x: f64| x.exp().ln_1p();
        let (e, at) = max_ulp(sweep(-87.0, 20.0, 997), softplus, softplus64);
        assert!(e <= 2.0, "softplus: {e} ulp at {at}");
        let (e, at) = max_ulp(sweep(20.0, 1.0e6, 997), softplus, |x| {
            x + (-x).exp().ln_1p()
        });
        assert!(e <= 1.0, "softplus above 20: {e} ulp at {at}");
        let (e, at) = max_ulp(sweep(-87.0, 87.0, 997), sigmoid, |x| {
            1.0 / (1.0 + (-x).exp())
        });
        assert!(e <= 2.5, "sigmoid: {e} ulp at {at}");
        let (e, at) = max_ulp(sweep(-87.0, 87.0, 997), silu, |x| x / (1.0 + (-x).exp()));
        assert!(e <= 2.5, "silu: {e} ulp at {at}");
    }

    #[test]
    fn exp_special_values() {
        assert_eq!(exp(0.0).to_bits(), 1.0f32.to_bits());
        assert_eq!(exp(-0.0).to_bits(), 1.0f32.to_bits());
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY).to_bits(), 0);
        assert!(exp(f32::NAN).is_nan());
        // Overflow boundary: e^88.72283 < f32::MAX < e^88.72284 (rounded).
        assert!(exp(88.72283).is_finite());
        assert_eq!(exp(88.72284), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(1.0e30), f32::INFINITY);
        // Smallest normal 2^-126 = e^-87.33655: results below are subnormal,
        // computed (not flushed) and correctly rounded here.
        for x in [-87.4f32, -90.0, -95.0, -100.0, -103.0] {
            let want = (x as f64).exp() as f32;
            assert!(want.is_subnormal());
            assert_eq!(exp(x).to_bits(), want.to_bits(), "exp({x})");
        }
        // e^-103.27893 = 2^-149 (the smallest subnormal); below about
        // -103.97 the result rounds to zero.
        assert_eq!(exp(-103.27893).to_bits(), 1);
        assert_eq!(exp(-103.9).to_bits(), 1);
        assert_eq!(exp(-104.0).to_bits(), 0);
        assert_eq!(exp(-1.0e30).to_bits(), 0);
        // Exact powers of two come out exact where the reduction is exact.
        assert_eq!(exp(std::f32::consts::LN_2), 2.0);
    }

    #[test]
    fn ln_1p_special_values() {
        assert_eq!(ln_1p(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(ln_1p(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(ln_1p(-1.0), f32::NEG_INFINITY);
        assert!(ln_1p(-1.5).is_nan());
        assert!(ln_1p(f32::NEG_INFINITY).is_nan());
        assert!(ln_1p(f32::NAN).is_nan());
        assert_eq!(ln_1p(f32::INFINITY), f32::INFINITY);
        assert!(ln_1p(f32::MAX).is_finite());
        // Tiny and subnormal x: ln(1 + x) = x.
        for x in [1.0e-30f32, -1.0e-30, 1.0e-40, f32::from_bits(1)] {
            assert_eq!(ln_1p(x).to_bits(), x.to_bits(), "ln_1p({x:e})");
        }
    }

    #[test]
    fn activations_special_values() {
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert_eq!(sigmoid(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(sigmoid(-100.0).to_bits(), 0);
        assert_eq!(silu(0.0).to_bits(), 0);
        assert_eq!(silu(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(silu(-100.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(silu(f32::INFINITY), f32::INFINITY);
        assert_eq!(silu(100.0), 100.0);
        let above = 20.0f32.next_up();
        assert_eq!(softplus(above), above);
        assert_eq!(softplus(f32::INFINITY), f32::INFINITY);
        assert_eq!(softplus(f32::NEG_INFINITY).to_bits(), 0);
        // e^-100 is subnormal and ln(1 + y) = y there.
        assert_eq!(softplus(-100.0).to_bits(), exp(-100.0).to_bits());
        for f in [exp, ln_1p, sigmoid, silu, softplus] {
            assert!(f(f32::NAN).is_nan());
        }
    }

    #[test]
    fn pinned_bits() {
        for p in PINNED {
            let x = f32::from_bits(p.x);
            let got = [exp(x), sigmoid(x), silu(x), softplus(x)].map(f32::to_bits);
            assert_eq!(
                got,
                [p.exp, p.sigmoid, p.silu, p.softplus],
                "pinned outputs of {x:e}"
            );
        }
        for &(xb, yb) in PINNED_LN_1P {
            let x = f32::from_bits(xb);
            assert_eq!(ln_1p(x).to_bits(), yb, "pinned ln_1p({x:e})");
        }
    }

    /// A small deterministic generator (xorshift) of floats of mixed sign
    /// and magnitude, so sums see cancellation and rounding.
    fn test_values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                u * [1.0f32, 1.0e-3, 1.0e3, 7.0][(s & 3) as usize]
            })
            .collect()
    }

    /// The canonical order spelled out with 32 explicit accumulators.
    fn reference_sum(terms: &[f32]) -> f32 {
        let mut acc = [0.0f32; 32];
        for (l, a) in acc.iter_mut().enumerate() {
            for t in terms.iter().skip(l).step_by(32) {
                *a += t;
            }
        }
        for w in [16, 8, 4, 2, 1] {
            for l in 0..w {
                acc[l] += acc[l + w];
            }
        }
        acc[0]
    }

    #[test]
    fn canonical_order_matches_explicit_accumulators() {
        let mut differs_from_serial = false;
        for n in [0, 1, 5, 31, 32, 33, 64, 100, 1000, 2048, 4099] {
            let a = test_values(n, 7 + n as u64);
            let b = test_values(n, 1000 + n as u64);
            let sq: Vec<f32> = a.iter().map(|v| v * v).collect();
            let prod: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x * y).collect();
            assert_eq!(
                sum(&a).to_bits(),
                reference_sum(&a).to_bits(),
                "sum, n = {n}"
            );
            assert_eq!(
                sum_sq(&a).to_bits(),
                reference_sum(&sq).to_bits(),
                "sum_sq, n = {n}"
            );
            assert_eq!(
                dot(&a, &b).to_bits(),
                reference_sum(&prod).to_bits(),
                "dot, n = {n}"
            );
            let serial = prod.iter().fold(0.0f32, |s, v| s + v);
            differs_from_serial |= serial.to_bits() != dot(&a, &b).to_bits();
        }
        // The test would be vacuous if the order made no difference.
        assert!(
            differs_from_serial,
            "no case distinguishes the canonical order from a serial sum"
        );
    }

    #[test]
    fn norms_and_softmax_use_the_canonical_order() {
        let x = test_values(1000, 3);
        let w = test_values(1000, 4);
        let mut y = x.clone();
        rms_norm(&mut y, &w, 1e-6);
        let scale = 1.0
            / (reference_sum(&x.iter().map(|v| v * v).collect::<Vec<_>>()) / 1000.0 + 1e-6).sqrt();
        for i in 0..1000 {
            assert_eq!(y[i].to_bits(), ((x[i] * scale) * w[i]).to_bits());
        }
        let mut z = x.clone();
        softmax(&mut z);
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = x.iter().map(|&v| exp(v - max)).collect();
        let inv = 1.0 / reference_sum(&e);
        for i in 0..1000 {
            assert_eq!(z[i].to_bits(), (e[i] * inv).to_bits());
        }
    }
}
