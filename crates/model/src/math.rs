//! Elementwise functions, defined once. Every executor (CPU now, CUDA later)
//! must use exactly these formulas so that results do not depend on where a
//! step ran (DESIGN.md invariant 1).

/// Logistic sigmoid, 1 / (1 + e^-x).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU, x · sigmoid(x), computed as x / (1 + e^-x).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// softplus(x) = ln(1 + e^x), and x itself above 20 (where the two agree in f32),
/// as torch and ggml define it.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Root-mean-square normalisation of `x` in place: x · 1/sqrt(mean(x²) + eps) · w.
/// The sum of squares runs in index order in f32, as the reference does.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let mut ss = 0.0f32;
    for v in x.iter() {
        ss += v * v;
    }
    let scale = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for (v, w) in x.iter_mut().zip(w) {
        *v = (*v * scale) * w;
    }
}

/// L2 normalisation as the reference gated-delta rule does it: x · 1/sqrt(Σx² + eps).
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let mut ss = 0.0f32;
    for v in x.iter() {
        ss += v * v;
    }
    let scale = 1.0 / (ss + eps).sqrt();
    for v in x.iter_mut() {
        *v *= scale;
    }
}

/// Softmax in place (max-subtracted, f32).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// NeoX rotary embedding of the first `n_rot` dims of one head at `pos`:
/// dims i and i + n_rot/2 form a pair; dims >= n_rot pass through.
/// The frequencies follow the reference's f32 arithmetic:
/// inv_freq_i = 1 / theta^(2i / n_rot), angle = pos · inv_freq_i.
pub fn rope_neox(head: &mut [f32], pos: usize, n_rot: usize, theta: f32) {
    let half = n_rot / 2;
    for i in 0..half {
        let inv_freq = 1.0 / theta.powf((2 * i) as f32 / n_rot as f32);
        let angle = pos as f32 * inv_freq;
        let (sin, cos) = angle.sin_cos();
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
}
