//! The gated DeltaNet recurrence, per value head, defined once on plain slices.
//!
//! State S is dk × dv, row-major by key index (S[i][j] at i·dv + j), f32.
//! Per token, with log-decay g ≤ 0 and β ∈ (0, 1):
//!   S ← e^g · S
//!   kv_j = Σ_i S[i][j] · k_i
//!   δ_j = β · (v_j − kv_j)
//!   S[i][j] ← S[i][j] + k_i · δ_j
//!   o_j = Σ_i S[i][j] · q_i        (q already L2-normalised and scaled by 1/√dk)
//! This is the recurrent form of the reference (HF `torch_recurrent_gated_delta_rule`,
//! ggml `gated_delta_net`). Prompts run the same recurrence token by token, so a
//! prompt and a decode produce the same state bit for bit.

/// One token of one value head; writes the output into `o` (length dv).
pub fn step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, o: &mut [f32]) {
    let dv = v.len();
    let decay = g.exp();
    for x in s.iter_mut() {
        *x *= decay;
    }
    let mut kv = vec![0.0f32; dv];
    for (i, &ki) in k.iter().enumerate() {
        let row = &s[i * dv..(i + 1) * dv];
        for (acc, &sij) in kv.iter_mut().zip(row) {
            *acc += sij * ki;
        }
    }
    let delta: Vec<f32> = v.iter().zip(&kv).map(|(&vj, &kvj)| beta * (vj - kvj)).collect();
    for (i, &ki) in k.iter().enumerate() {
        let row = &mut s[i * dv..(i + 1) * dv];
        for (sij, &dj) in row.iter_mut().zip(&delta) {
            *sij += ki * dj;
        }
    }
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, &qi) in q.iter().enumerate() {
        let row = &s[i * dv..(i + 1) * dv];
        for (acc, &sij) in o.iter_mut().zip(row) {
            *acc += sij * qi;
        }
    }
}

/// Causal depthwise conv of one token over `channels`: `state` holds the previous
/// d_conv−1 inputs per channel (oldest first, channel-major), `w` holds d_conv taps
/// per channel (tap d_conv−1 multiplies the current input). Writes silu(conv) to
/// `out` and shifts the new input into the state.
pub fn conv_step(state: &mut [f32], w: &[f32], x: &[f32], d_conv: usize, out: &mut [f32]) {
    let hist = d_conv - 1;
    for c in 0..x.len() {
        let taps = &w[c * d_conv..(c + 1) * d_conv];
        let st = &mut state[c * hist..(c + 1) * hist];
        let mut acc = 0.0f32;
        for j in 0..hist {
            acc += st[j] * taps[j];
        }
        acc += x[c] * taps[hist];
        out[c] = crate::math::silu(acc);
        if hist > 0 {
            st.copy_within(1.., 0);
            st[hist - 1] = x[c];
        }
    }
}

/// Gated RMSNorm of one head's output: rmsnorm(o)·w ⊙ silu(z).
pub fn gated_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    crate::math::rms_norm(o, w, eps);
    for (x, &zz) in o.iter_mut().zip(z) {
        *x *= crate::math::silu(zz);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_matches_closed_form_for_one_token_from_zero_state() {
        // From S = 0: S = β k vᵀ, o = S^T q = β (k·q) v.
        let (dk, dv) = (3, 2);
        let mut s = vec![0.0; dk * dv];
        let q = [0.5, -1.0, 2.0];
        let k = [1.0, 0.0, 0.5];
        let v = [2.0, -3.0];
        let mut o = [0.0; 2];
        step(&mut s, &q, &k, &v, -0.3, 0.25, &mut o);
        let kq: f32 = q.iter().zip(&k).map(|(a, b)| a * b).sum();
        assert!((o[0] - 0.25 * kq * 2.0).abs() < 1e-6);
        assert!((o[1] - 0.25 * kq * -3.0).abs() < 1e-6);
    }

    #[test]
    fn conv_shifts_history() {
        let d_conv = 3;
        let w = [1.0, 10.0, 100.0]; // one channel
        let mut st = vec![0.0; 2];
        let mut out = [0.0];
        conv_step(&mut st, &w, &[1.0], d_conv, &mut out);
        assert_eq!(st, vec![0.0, 1.0]);
        conv_step(&mut st, &w, &[2.0], d_conv, &mut out);
        assert_eq!(st, vec![1.0, 2.0]);
        // 1·0 + 10·1 + 100·2 = 210, silu(210) = 210
        assert!((out[0] - 210.0).abs() < 1e-3);
    }
}
