//! Gated DeltaNet on the CPU: projections for all tokens at once, then the conv
//! and the recurrence token by token (the recurrence is cheap next to the
//! projections), gated norm, output projection.

use super::{Act, CpuBackend, DeltaNetState, Job};
use model::deltanet::{conv_step, gated_norm, step};
use model::math::{l2_norm, sigmoid, softplus};
use model::weights::{BetaAlpha, DeltaNetWeights, Weight};
use model::ModelConfig;
use rayon::prelude::*;

/// The reference L2-normalises q and k with eps 1e-6 (HF `l2norm`).
const L2_EPS: f32 = 1e-6;

pub(super) fn run(
    b: &CpuBackend,
    cfg: &ModelConfig,
    w: &DeltaNetWeights,
    x: &Act,
    st: &mut DeltaNetState,
) -> Act {
    let ssm = cfg
        .ssm
        .as_ref()
        .expect("DeltaNet layers exist only in hybrid configs");
    let (hk, hv, d) = (ssm.n_k_heads, ssm.n_v_heads, ssm.d_state);
    let (kd, vd) = (ssm.key_dim(), ssm.value_dim());
    let t_n = x.rows;

    // Every projection reads the same input: one batch (one parallel region when decoding).
    let mut weights: Vec<&Weight> = vec![&w.qkv, &w.gate];
    match &w.beta_alpha {
        BetaAlpha::Separate { beta, alpha } => weights.extend([beta, alpha]),
        BetaAlpha::Fused(ba) => weights.push(ba),
    }
    let jobs = Job::on_one_input(&weights);
    let mut outs = b.mm_many(&[x], &jobs).into_iter();
    let (qkv, z) = (outs.next().expect("qkv"), outs.next().expect("gate"));
    let (beta_raw, alpha_raw) = match &w.beta_alpha {
        BetaAlpha::Separate { .. } => (outs.next().expect("beta"), outs.next().expect("alpha")),
        BetaAlpha::Fused(_) => {
            let out = outs.next().expect("ba");
            let mut b = Act::zeros(t_n, hv);
            let mut a = Act::zeros(t_n, hv);
            for t in 0..t_n {
                let (bb, aa) = model::arch::qwen3next::split_ba(out.row(t), hk, hv);
                b.row_mut(t).copy_from_slice(&bb);
                a.row_mut(t).copy_from_slice(&aa);
            }
            (b, a)
        }
    };

    let scale = 1.0 / (d as f32).sqrt();
    let mut y = Act::zeros(t_n, vd);
    let mut conv_out = vec![0.0f32; ssm.conv_dim()];
    for t in 0..t_n {
        conv_step(&mut st.conv, &w.conv, qkv.row(t), ssm.d_conv, &mut conv_out);
        let (q_all, rest) = conv_out.split_at_mut(kd);
        let (k_all, v_all) = rest.split_at_mut(kd);
        for h in 0..hk {
            l2_norm(&mut q_all[h * d..(h + 1) * d], L2_EPS);
            l2_norm(&mut k_all[h * d..(h + 1) * d], L2_EPS);
        }
        for qv in q_all.iter_mut() {
            *qv *= scale;
        }
        let (q_all, k_all, v_all) = (&*q_all, &*k_all, &*v_all);
        let br = beta_raw.row(t);
        let ar = alpha_raw.row(t);
        let zr = z.row(t);
        y.row_mut(t)
            .par_chunks_mut(d)
            .zip(st.ssm.par_chunks_mut(d * d))
            .enumerate()
            .for_each(|(h, (o, s))| {
                let kh = ssm.k_head_of(h);
                let g = w.a[h] * softplus(ar[h] + w.dt_bias[h]);
                let beta = sigmoid(br[h]);
                step(
                    s,
                    &q_all[kh * d..(kh + 1) * d],
                    &k_all[kh * d..(kh + 1) * d],
                    &v_all[h * d..(h + 1) * d],
                    g,
                    beta,
                    o,
                );
                gated_norm(o, &zr[h * d..(h + 1) * d], &w.norm, cfg.eps);
            });
    }
    b.mm_weight(&w.out, &y)
}
