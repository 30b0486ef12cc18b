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

use crate::simd::multiversion;

multiversion! {
    /// One token of one value head; writes the output into `o` (length dv). `q` and
    /// `k` have length dk and `s` is dk × dv.
    ///
    /// The four steps above run as two passes over S, row by row: row i is decayed
    /// and then added into kv (kv_j still adds rows in increasing i), and after δ,
    /// row i is updated and then added into o. Every element sees the operations of
    /// the four-pass formulation in the same order, so the bits are the same.
    pub fn step / step_at(
        s: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: f32,
        beta: f32,
        o: &mut [f32],
    ) {
        let dv = v.len();
        assert_eq!(q.len(), k.len(), "deltanet::step: q and k lengths differ");
        assert_eq!(s.len(), k.len() * dv, "deltanet::step: state is not dk × dv");
        assert_eq!(o.len(), dv, "deltanet::step: output is not dv long");
        let decay = crate::math::exp(g);
        // kv, then δ in the same buffer (on the stack for the usual head sizes: a
        // prompt calls this once per token and head).
        let mut stack = [0.0f32; 256];
        let mut heap = Vec::new();
        let kv: &mut [f32] = if dv <= stack.len() {
            &mut stack[..dv]
        } else {
            heap.resize(dv, 0.0f32);
            &mut heap
        };
        for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
            for (acc, sij) in kv.iter_mut().zip(row.iter_mut()) {
                *sij *= decay;
                *acc += *sij * ki;
            }
        }
        for (d, &vj) in kv.iter_mut().zip(v) {
            *d = beta * (vj - *d);
        }
        let delta = &*kv;
        o.iter_mut().for_each(|x| *x = 0.0);
        for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
            for ((sij, &dj), acc) in row.iter_mut().zip(delta).zip(o.iter_mut()) {
                *sij += ki * dj;
                *acc += *sij * qi;
            }
        }
    }
}

multiversion! {
    /// Causal depthwise conv of one token over `channels`: `state` holds the previous
    /// d_conv−1 inputs per channel (oldest first, channel-major), `w` holds d_conv taps
    /// per channel (tap d_conv−1 multiplies the current input). Writes silu(conv) to
    /// `out` and shifts the new input into the state.
    pub fn conv_step / conv_step_at(
        state: &mut [f32],
        w: &[f32],
        x: &[f32],
        d_conv: usize,
        out: &mut [f32],
    ) {
        let hist = d_conv - 1;
        let (w, out) = (&w[..x.len() * d_conv], &mut out[..x.len()]);
        if hist == 3 {
            // The models' kernel of 4, unrolled (the same operations as below).
            let chans = state.chunks_exact_mut(3).zip(w.chunks_exact(4));
            for ((st, taps), (&xc, o)) in chans.zip(x.iter().zip(out.iter_mut())) {
                let mut acc = 0.0f32;
                acc += st[0] * taps[0];
                acc += st[1] * taps[1];
                acc += st[2] * taps[2];
                acc += xc * taps[3];
                *o = acc;
                (st[0], st[1], st[2]) = (st[1], st[2], xc);
            }
        } else {
            for c in 0..x.len() {
                let taps = &w[c * d_conv..(c + 1) * d_conv];
                let st = &mut state[c * hist..(c + 1) * hist];
                let mut acc = 0.0f32;
                for j in 0..hist {
                    acc += st[j] * taps[j];
                }
                acc += x[c] * taps[hist];
                out[c] = acc;
                if hist > 0 {
                    st.copy_within(1.., 0);
                    st[hist - 1] = x[c];
                }
            }
        }
        // SiLU in its own pass over the channels (elementwise, so vectorisable).
        for o in out[..x.len()].iter_mut() {
            *o = crate::math::silu(*o);
        }
    }
}

multiversion! {
    /// Gated RMSNorm of one head's output: rmsnorm(o)·w ⊙ silu(z), i.e.
    /// `o_i = ((o_i · scale) · w_i) · silu(z_i)` with [`crate::math::rms_norm`]'s scale.
    pub fn gated_norm / gated_norm_at(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
        use crate::math::{rms_scale, silu, sum_sq};
        let scale = rms_scale(sum_sq(o), o.len(), eps);
        for ((x, &ww), &zz) in o.iter_mut().zip(w).zip(z) {
            *x = ((*x * scale) * ww) * silu(zz);
        }
    }
}

/// The chunked (parallel) form of the same recurrence over a whole prompt, for
/// one value head: the form tensor-core prefill kernels use. Mathematically equal
/// to calling [`step`] per token; in floating point it differs by rounding only
/// (tested below), so executors that must match the decode path bit for bit
/// (docs/design.md invariant 1) use [`step`] instead.
///
/// Inputs are per token: `q`, `k` (T × dk, q already scaled), `v` (T × dv), `g`,
/// `beta` (T). `s` is the dk × dv state, advanced in place; the output is T × dv.
/// Within a chunk of C tokens with cumulative log-decay Γ:
///   D_ij = e^(Γ_i − Γ_j) (i ≥ j), M_ij = β_i (k_i·k_j) D_ij (i > j),
///   U = (I+M)⁻¹ diag(β) V,  W = (I+M)⁻¹ diag(β e^Γ) K,  U' = U − W S,
///   O = (Q ⊙ e^Γ) S + ((Q Kᵀ) ⊙ D) U',  S ← e^(Γ_last) S + (K ⊙ e^(Γ_last − Γ))ᵀ U'.
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dk: usize,
    dv: usize,
    chunk: usize,
) -> Vec<f32> {
    let t_n = g.len();
    let mut out = vec![0.0f32; t_n * dv];
    let mut start = 0;
    while start < t_n {
        let c = chunk.min(t_n - start);
        let qc = &q[start * dk..(start + c) * dk];
        let kc = &k[start * dk..(start + c) * dk];
        let vc = &v[start * dv..(start + c) * dv];
        let mut gam = vec![0.0f32; c];
        let mut acc = 0.0f32;
        for i in 0..c {
            acc += g[start + i];
            gam[i] = acc;
        }
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        // Forward substitution for (I + M) X = B, row by row.
        let mut u = vec![0.0f32; c * dv];
        let mut w = vec![0.0f32; c * dk];
        for i in 0..c {
            let bi = beta[start + i];
            for jv in 0..dv {
                u[i * dv + jv] = bi * vc[i * dv + jv];
            }
            let e = crate::math::exp(gam[i]);
            for jk in 0..dk {
                w[i * dk + jk] = bi * e * kc[i * dk + jk];
            }
            for j in 0..i {
                let m = bi
                    * dot(&kc[i * dk..(i + 1) * dk], &kc[j * dk..(j + 1) * dk])
                    * crate::math::exp(gam[i] - gam[j]);
                for jv in 0..dv {
                    u[i * dv + jv] -= m * u[j * dv + jv];
                }
                for jk in 0..dk {
                    w[i * dk + jk] -= m * w[j * dk + jk];
                }
            }
        }
        // U' = U − W S
        for i in 0..c {
            for a in 0..dk {
                let wia = w[i * dk + a];
                for jv in 0..dv {
                    u[i * dv + jv] -= wia * s[a * dv + jv];
                }
            }
        }
        // O = (Q ⊙ e^Γ) S + ((Q Kᵀ) ⊙ D) U'
        for i in 0..c {
            let o = &mut out[(start + i) * dv..(start + i + 1) * dv];
            let e = crate::math::exp(gam[i]);
            for a in 0..dk {
                let qa = qc[i * dk + a] * e;
                for jv in 0..dv {
                    o[jv] += qa * s[a * dv + jv];
                }
            }
            for j in 0..=i {
                let a = dot(&qc[i * dk..(i + 1) * dk], &kc[j * dk..(j + 1) * dk])
                    * crate::math::exp(gam[i] - gam[j]);
                for jv in 0..dv {
                    o[jv] += a * u[j * dv + jv];
                }
            }
        }
        // S ← e^(Γ_last) S + (K ⊙ e^(Γ_last − Γ))ᵀ U'
        let last = gam[c - 1];
        let el = crate::math::exp(last);
        s.iter_mut().for_each(|x| *x *= el);
        for j in 0..c {
            let f = crate::math::exp(last - gam[j]);
            for a in 0..dk {
                let ka = kc[j * dk + a] * f;
                for jv in 0..dv {
                    s[a * dv + jv] += ka * u[j * dv + jv];
                }
            }
        }
        start += c;
    }
    out
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

    #[test]
    fn chunked_form_matches_recurrence() {
        // A deterministic pseudo-random sequence spanning several chunks, from a
        // non-zero initial state.
        let (dk, dv, t_n) = (8, 6, 45);
        let mut seed = 12345u64;
        let mut rnd = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let mut q: Vec<f32> = (0..t_n * dk).map(|_| rnd()).collect();
        let mut k: Vec<f32> = (0..t_n * dk).map(|_| rnd()).collect();
        for t in 0..t_n {
            crate::math::l2_norm(&mut q[t * dk..(t + 1) * dk], 1e-6);
            crate::math::l2_norm(&mut k[t * dk..(t + 1) * dk], 1e-6);
        }
        let v: Vec<f32> = (0..t_n * dv).map(|_| rnd()).collect();
        let g: Vec<f32> = (0..t_n).map(|_| -0.5 * (rnd() + 1.0)).collect();
        let beta: Vec<f32> = (0..t_n).map(|_| 0.5 * (rnd() + 1.0)).collect();
        let s0: Vec<f32> = (0..dk * dv).map(|_| 0.3 * rnd()).collect();

        let mut s_rec = s0.clone();
        let mut o_rec = vec![0.0f32; t_n * dv];
        for t in 0..t_n {
            step(
                &mut s_rec,
                &q[t * dk..(t + 1) * dk],
                &k[t * dk..(t + 1) * dk],
                &v[t * dv..(t + 1) * dv],
                g[t],
                beta[t],
                &mut o_rec[t * dv..(t + 1) * dv],
            );
        }
        for chunk in [1, 7, 16, 64] {
            let mut s_ch = s0.clone();
            let o_ch = chunked(&mut s_ch, &q, &k, &v, &g, &beta, dk, dv, chunk);
            for (a, b) in o_ch.iter().zip(&o_rec) {
                assert!((a - b).abs() < 1e-4, "chunk {chunk}: output {a} vs {b}");
            }
            for (a, b) in s_ch.iter().zip(&s_rec) {
                assert!((a - b).abs() < 1e-4, "chunk {chunk}: state {a} vs {b}");
            }
        }
    }
}
