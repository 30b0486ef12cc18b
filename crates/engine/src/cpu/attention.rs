//! Attention on the CPU: q/k per-head RMSNorm, partial NeoX RoPE, causal GQA
//! softmax attention over the cache, optional sigmoid output gate, output proj.

use super::{Act, CpuBackend, Job, KvCache};
use model::math::{rms_norm, rope_neox, sigmoid};
use model::weights::AttentionWeights;
use rayon::prelude::*;

pub(super) fn run(
    b: &CpuBackend,
    w: &AttentionWeights,
    x: &Act,
    pos0: usize,
    cache: &mut KvCache,
    n_ctx: usize,
) -> Act {
    let cfg = &b.cfg;
    let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
    let t_n = x.rows;
    assert!(
        pos0 + t_n <= n_ctx,
        "context overflow is checked by the engine"
    );
    let jobs = Job::on_one_input(&[&w.q, &w.k, &w.v]);
    let mut outs = b.mm_many(&[x], &jobs).into_iter();
    let (qf, kf, vf) = (
        outs.next().expect("q"),
        outs.next().expect("k"),
        outs.next().expect("v"),
    );
    let q_stride = if cfg.attn_output_gate { 2 * hd } else { hd };

    // Queries (normed, rotated) and gates, per token and head.
    let mut q = vec![0.0f32; t_n * nh * hd];
    let mut gate = vec![
        0.0f32;
        if cfg.attn_output_gate {
            t_n * nh * hd
        } else {
            0
        }
    ];
    for t in 0..t_n {
        let row = qf.row(t);
        for h in 0..nh {
            let dst = &mut q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            dst.copy_from_slice(&row[h * q_stride..h * q_stride + hd]);
            rms_norm(dst, &w.q_norm, cfg.eps);
            rope_neox(dst, pos0 + t, cfg.n_rot, cfg.rope_theta);
            if cfg.attn_output_gate {
                gate[(t * nh + h) * hd..(t * nh + h + 1) * hd]
                    .copy_from_slice(&row[h * q_stride + hd..h * q_stride + 2 * hd]);
            }
        }
        // Keys and values into the cache.
        let kvw = nkv * hd;
        let p = pos0 + t;
        for h in 0..nkv {
            let dst = &mut cache.k[p * kvw + h * hd..p * kvw + (h + 1) * hd];
            dst.copy_from_slice(&kf.row(t)[h * hd..(h + 1) * hd]);
            rms_norm(dst, &w.k_norm, cfg.eps);
            rope_neox(dst, p, cfg.n_rot, cfg.rope_theta);
        }
        cache.v[p * kvw..(p + 1) * kvw].copy_from_slice(vf.row(t));
    }

    let scale = 1.0 / (hd as f32).sqrt();
    let group = nh / nkv;
    let kvw = nkv * hd;
    let mut out = Act::zeros(t_n, nh * hd);
    let (k_cache, v_cache) = (&cache.k, &cache.v);
    out.data.par_chunks_mut(hd).enumerate().for_each(|(th, o)| {
        let (t, h) = (th / nh, th % nh);
        let kvh = h / group;
        let qh = &q[th * hd..(th + 1) * hd];
        let n_pos = pos0 + t + 1;
        let mut scores = Vec::with_capacity(n_pos);
        for p in 0..n_pos {
            let k = &k_cache[p * kvw + kvh * hd..p * kvw + (kvh + 1) * hd];
            let mut s = 0.0f32;
            for (a, b) in qh.iter().zip(k) {
                s += a * b;
            }
            scores.push(s * scale);
        }
        model::math::softmax(&mut scores);
        for (p, &pr) in scores.iter().enumerate() {
            let v = &v_cache[p * kvw + kvh * hd..p * kvw + (kvh + 1) * hd];
            for (acc, &vv) in o.iter_mut().zip(v) {
                *acc += pr * vv;
            }
        }
        if !gate.is_empty() {
            let g = &gate[th * hd..(th + 1) * hd];
            for (acc, &gg) in o.iter_mut().zip(g) {
                *acc *= sigmoid(gg);
            }
        }
    });
    b.mm_weight(&w.o, &out)
}
