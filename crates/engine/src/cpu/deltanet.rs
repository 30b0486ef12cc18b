//! Gated DeltaNet on the CPU: projections for all tokens at once, then per key head
//! in parallel the conv over the tokens, the q/k normalisation and its value heads'
//! recurrences and gated norms, then the output projection.
//! Every channel and head performs the same float operations in the same order
//! whether it sees one token or a prompt.

use super::{Act, CpuBackend, DeltaNetState, Trail};
use model::deltanet::{conv_step, gated_norm, step};
use model::math::{l2_norm, sigmoid, softplus};
use model::weights::{BetaAlpha, DeltaNetWeights, Weight};

/// The reference L2-normalises q and k with eps 1e-6 (HF `l2norm`).
const L2_EPS: f32 = 1e-6;

/// The token-wise input projections of every row: qkv (the conv's input), the
/// output gate z, and each value head's β and α.
pub(super) struct Projections {
    qkv: Act,
    z: Act,
    beta: Act,
    alpha: Act,
}

pub(super) fn project(b: &CpuBackend, w: &DeltaNetWeights, x: &Act) -> Projections {
    let hv = b
        .cfg
        .ssm
        .as_ref()
        .expect("DeltaNet layers exist only in hybrid configs")
        .n_v_heads;
    let t_n = x.rows;
    // Every projection reads the same input: one batch (one parallel region when decoding).
    let mut weights: Vec<&Weight> = vec![&w.qkv, &w.gate];
    match &w.beta_alpha {
        BetaAlpha::Separate { beta, alpha } => weights.extend([beta, alpha]),
        BetaAlpha::Fused { w, .. } => weights.push(w),
    }
    let mut outs = b.mm_many(x, &weights).into_iter();
    let (qkv, z) = (outs.next().expect("qkv"), outs.next().expect("gate"));
    let (beta, alpha) = match &w.beta_alpha {
        BetaAlpha::Separate { .. } => (outs.next().expect("beta"), outs.next().expect("alpha")),
        BetaAlpha::Fused {
            beta_rows,
            alpha_rows,
            ..
        } => {
            // Gather each value head's β and α from the fused row (the arch's
            // layout, given as data by the loader).
            let out = outs.next().expect("ba");
            let mut b = Act::zeros(t_n, hv);
            let mut a = Act::zeros(t_n, hv);
            for t in 0..t_n {
                let row = out.row(t);
                for (dst, &r) in b.row_mut(t).iter_mut().zip(beta_rows) {
                    *dst = row[r as usize];
                }
                for (dst, &r) in a.row_mut(t).iter_mut().zip(alpha_rows) {
                    *dst = row[r as usize];
                }
            }
            (b, a)
        }
    };
    Projections {
        qkv,
        z,
        beta,
        alpha,
    }
}

/// The conv, the recurrence and the gated norm of the `t_n` rows from `r0` of
/// `p`, advancing `st`: the rows before the output projection.
///
/// One parallel loop, a task per key head: it runs the conv over every token for
/// that head's q and k channels and the v channels of the value heads that read it,
/// normalises the head's q and k, then runs those value heads' recurrences and gated
/// norms. Each channel and head performs the float operations of a one-token call, in
/// the same order, so the bits do not depend on how many tokens or tasks there are.
///
/// With `keep_trail` (a verify step) the state after each token is also copied into
/// `st.trail`, each task its own channels and heads, so the sequence can be brought
/// back to any of those tokens: a copy of the state per token, which costs less than
/// the recurrence that wrote it.
pub(super) fn core(
    b: &CpuBackend,
    w: &DeltaNetWeights,
    p: &Projections,
    r0: usize,
    t_n: usize,
    st: &mut DeltaNetState,
    keep_trail: bool,
) -> Act {
    let cfg = &b.cfg;
    let ssm = cfg
        .ssm
        .as_ref()
        .expect("DeltaNet layers exist only in hybrid configs");
    let (hk, hv, d, dc) = (ssm.n_k_heads, ssm.n_v_heads, ssm.d_state, ssm.d_conv);
    let (kd, vd, cd) = (ssm.key_dim(), ssm.value_dim(), ssm.conv_dim());
    let hist = dc - 1;
    let scale = 1.0 / (d as f32).sqrt();
    let mut conv = Act::zeros(t_n, cd);
    let mut y = Act::zeros(t_n, vd);
    let DeltaNetState {
        conv: st_conv,
        ssm: st_ssm,
        trail,
    } = st;
    let trail = if keep_trail {
        let tr = trail.get_or_insert_with(Trail::default);
        tr.conv.resize(t_n * cd * hist, 0.0);
        tr.ssm.resize(t_n * hv * d * d, 0.0);
        Some(tr)
    } else {
        None
    };
    {
        let conv_out = quant::par::ColumnRuns::new(&mut conv.data, cd);
        let y_out = quant::par::ColumnRuns::new(&mut y.data, vd);
        // Both states as one row each: a task takes its channels' and heads' runs.
        let conv_state = quant::par::ColumnRuns::new(st_conv, cd * hist);
        let ssm_state = quant::par::ColumnRuns::new(st_ssm, hv * d * d);
        // The trail: a row per token.
        let trail = trail.map(|tr| {
            (
                quant::par::ColumnRuns::new(&mut tr.conv, cd * hist),
                quant::par::ColumnRuns::new(&mut tr.ssm, hv * d * d),
            )
        });
        quant::par::for_each(hk, |kh| {
            let heads = (0..hv).filter(|&h| ssm.k_head_of(h) == kh);
            // This key head's q and k channels, then its value heads' v channels.
            let chans = [kh * d, kd + kh * d]
                .into_iter()
                .chain(heads.clone().map(|h| 2 * kd + h * d));
            for c0 in chans {
                // SAFETY (all four runs): key head kh's channels and value heads
                // belong to this task alone.
                let state = unsafe { conv_state.run(0, c0 * hist, d * hist) };
                let taps = &w.conv[c0 * dc..(c0 + d) * dc];
                for t in 0..t_n {
                    let src = &p.qkv.row(r0 + t)[c0..c0 + d];
                    conv_step(state, taps, src, dc, unsafe { conv_out.run(t, c0, d) });
                    if let Some((tc, _)) = &trail {
                        unsafe { tc.run(t, c0 * hist, d * hist) }.copy_from_slice(state);
                    }
                }
            }
            for t in 0..t_n {
                let q = unsafe { conv_out.run(t, kh * d, d) };
                l2_norm(q, L2_EPS);
                for qv in q.iter_mut() {
                    *qv *= scale;
                }
                l2_norm(unsafe { conv_out.run(t, kd + kh * d, d) }, L2_EPS);
            }
            for h in heads {
                let s = unsafe { ssm_state.run(0, h * d * d, d * d) };
                for t in 0..t_n {
                    let q = unsafe { conv_out.run(t, kh * d, d) };
                    let k = unsafe { conv_out.run(t, kd + kh * d, d) };
                    let v = unsafe { conv_out.run(t, 2 * kd + h * d, d) };
                    let g = w.a[h] * softplus(p.alpha.row(r0 + t)[h] + w.dt_bias[h]);
                    let beta = sigmoid(p.beta.row(r0 + t)[h]);
                    let o = unsafe { y_out.run(t, h * d, d) };
                    step(s, q, k, v, g, beta, o);
                    if let Some((_, ts)) = &trail {
                        unsafe { ts.run(t, h * d * d, d * d) }.copy_from_slice(s);
                    }
                    gated_norm(o, &p.z.row(r0 + t)[h * d..(h + 1) * d], &w.norm, cfg.eps);
                }
            }
        });
    }
    y
}
