//! Gated DeltaNet on the CPU: projections for all tokens at once, the conv over the
//! tokens (blocks of channels in parallel), then each value head's
//! recurrence over the tokens (heads in parallel), gated norm, output projection.
//! Every channel and head performs the same float operations in the same order
//! whether it sees one token or a prompt.

use super::{each_row, Act, CpuBackend, DeltaNetState, Job};
use model::deltanet::{conv_step, gated_norm, step};
use model::math::{l2_norm, sigmoid, softplus};
use model::weights::{BetaAlpha, DeltaNetWeights, Weight};

/// The reference L2-normalises q and k with eps 1e-6 (HF `l2norm`).
const L2_EPS: f32 = 1e-6;

/// Channels per parallel conv task (not a divisor of the test models' 1024
/// channels, so their prompts run a partial last block too).
const CONV_BLOCK: usize = 160;

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
    let jobs = Job::on_one_input(&weights);
    let mut outs = b.mm_many(&[x], &jobs).into_iter();
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
pub(super) fn core(
    b: &CpuBackend,
    w: &DeltaNetWeights,
    p: &Projections,
    r0: usize,
    t_n: usize,
    st: &mut DeltaNetState,
) -> Act {
    let cfg = &b.cfg;
    let ssm = cfg
        .ssm
        .as_ref()
        .expect("DeltaNet layers exist only in hybrid configs");
    let (hk, d) = (ssm.n_k_heads, ssm.d_state);
    let (kd, vd) = (ssm.key_dim(), ssm.value_dim());

    // The conv: sequential in time, independent per channel, so blocks of channels
    // run in parallel, each over every token (a channel's float operations are
    // those of a one-token call). Then each token's q/k normalisation.
    let cd = ssm.conv_dim();
    let scale = 1.0 / (d as f32).sqrt();
    let mut conv = Act::zeros(t_n, cd);
    let norm_qk = |row: &mut [f32]| {
        let (q_all, rest) = row.split_at_mut(kd);
        let k_all = &mut rest[..kd];
        for h in 0..hk {
            l2_norm(&mut q_all[h * d..(h + 1) * d], L2_EPS);
            l2_norm(&mut k_all[h * d..(h + 1) * d], L2_EPS);
        }
        for qv in q_all.iter_mut() {
            *qv *= scale;
        }
    };
    if ssm.d_conv < 2 {
        // No history: the conv is a per-channel scale.
        for t in 0..t_n {
            let dst = conv.row_mut(t);
            conv_step(&mut st.conv, &w.conv, p.qkv.row(r0 + t), ssm.d_conv, dst);
            norm_qk(dst);
        }
    } else {
        let hist = ssm.d_conv - 1;
        // (state, taps) per block; each block writes its channels' run of every row.
        let mut blocks: Vec<(&mut [f32], &[f32])> = st
            .conv
            .chunks_mut(CONV_BLOCK * hist)
            .zip(w.conv.chunks(CONV_BLOCK * ssm.d_conv))
            .collect();
        {
            let out = quant::par::ColumnRuns::new(&mut conv.data, cd);
            quant::par::for_each_mut(&mut blocks, |i, (state, taps)| {
                let (c0, n) = (i * CONV_BLOCK, taps.len() / ssm.d_conv);
                for t in 0..t_n {
                    let src = &p.qkv.row(r0 + t)[c0..c0 + n];
                    // SAFETY: channels c0..c0 + n belong to this block alone.
                    let o = unsafe { out.run(t, c0, n) };
                    conv_step(state, taps, src, ssm.d_conv, o);
                }
            });
        }
        each_row(&mut conv.data, cd, |_, row| norm_qk(row));
    }

    // Then each value head runs its recurrence over all tokens; heads are
    // independent, so they run in parallel (one parallel loop per call), each writing
    // its columns of every output row.
    let mut y = Act::zeros(t_n, vd);
    let mut states: Vec<&mut [f32]> = st.ssm.chunks_mut(d * d).collect();
    {
        let out = quant::par::ColumnRuns::new(&mut y.data, vd);
        quant::par::for_each_mut(&mut states, |h, s| {
            let kh = ssm.k_head_of(h);
            for t in 0..t_n {
                let row = conv.row(t);
                let q = &row[kh * d..(kh + 1) * d];
                let k = &row[kd + kh * d..kd + (kh + 1) * d];
                let v = &row[2 * kd + h * d..2 * kd + (h + 1) * d];
                let g = w.a[h] * softplus(p.alpha.row(r0 + t)[h] + w.dt_bias[h]);
                let beta = sigmoid(p.beta.row(r0 + t)[h]);
                // SAFETY: columns h·d.. of each row belong to head h alone.
                let o = unsafe { out.run(t, h * d, d) };
                step(s, q, k, v, g, beta, o);
                gated_norm(o, &p.z.row(r0 + t)[h * d..(h + 1) * d], &w.norm, cfg.eps);
            }
        });
    }
    y
}
