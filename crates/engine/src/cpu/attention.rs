//! Attention on the CPU: q/k per-head RMSNorm, partial NeoX RoPE, causal GQA
//! softmax attention over the cache, optional sigmoid output gate, output proj.
//!
//! Each score is one sequential sum over the head's dims, `s = 0; s += q_i·k_i`
//! (products and sums rounded apart), then `s · scale`. A prompt of T tokens computes
//! T²/2 of them per head, so their speed decides how prompt speed falls with length:
//! one sum is a chain of dependent adds, but the scores of different positions are
//! independent. The cache therefore keeps keys dim-major (positions contiguous) and
//! [`scores`] runs `LANES` positions side by side, each lane its own unchanged chain,
//! so the bits are those of the one-score-at-a-time loop.

use super::{Act, CpuBackend, Job, KvCache};
use model::math::{rms_norm, rope_neox, sigmoid};
use model::weights::AttentionWeights;
use rayon::prelude::*;

/// Positions whose scores run side by side (8 AVX2 / 4 AVX-512 registers of sums:
/// enough independent chains to hide the add latency).
const LANES: usize = 64;

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
        // Keys (dim-major: key dim i of kv head h at position p is
        // k[(h·hd + i)·n_ctx + p]) and values (position-major) into the cache.
        let kvw = nkv * hd;
        let p = pos0 + t;
        let mut key = vec![0.0f32; hd];
        for h in 0..nkv {
            key.copy_from_slice(&kf.row(t)[h * hd..(h + 1) * hd]);
            rms_norm(&mut key, &w.k_norm, cfg.eps);
            rope_neox(&mut key, p, cfg.n_rot, cfg.rope_theta);
            for (i, &kv) in key.iter().enumerate() {
                cache.k[(h * hd + i) * n_ctx + p] = kv;
            }
        }
        cache.v[p * kvw..(p + 1) * kvw].copy_from_slice(vf.row(t));
    }

    let scale = 1.0 / (hd as f32).sqrt();
    let group = nh / nkv;
    let kvw = nkv * hd;
    let mut out = Act::zeros(t_n, nh * hd);
    let (k_cache, v_cache) = (&cache.k, &cache.v);
    let wide = wide_kernels();
    out.data.par_chunks_mut(hd).enumerate().for_each(|(th, o)| {
        let (t, h) = (th / nh, th % nh);
        let kvh = h / group;
        let qh = &q[th * hd..(th + 1) * hd];
        let n_pos = pos0 + t + 1;
        let mut scores = vec![0.0f32; n_pos];
        let kt = &k_cache[kvh * hd * n_ctx..(kvh + 1) * hd * n_ctx];
        scores_at(wide, qh, kt, n_ctx, scale, &mut scores);
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

/// Which build of [`scores`] runs: the widest vector level the quant kernels use
/// (so `SCORIA_ISA` lowers it too). Every build performs the same float operations.
#[derive(Clone, Copy)]
enum Wide {
    Plain,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn wide_kernels() -> Wide {
    #[cfg(target_arch = "x86_64")]
    {
        match quant::kernel_isa() {
            "avx512" | "avx512bw" if std::arch::is_x86_feature_detected!("avx512f") => {
                return Wide::Avx512
            }
            "avx512" | "avx512bw" | "avx2" if std::arch::is_x86_feature_detected!("avx2") => {
                return Wide::Avx2
            }
            _ => {}
        }
    }
    Wide::Plain
}

fn scores_at(wide: Wide, q: &[f32], kt: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    match wide {
        Wide::Plain => scores(q, kt, stride, scale, out),
        // SAFETY: `wide_kernels` chose these only where the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        Wide::Avx2 => unsafe { scores_avx2(q, kt, stride, scale, out) },
        #[cfg(target_arch = "x86_64")]
        Wide::Avx512 => unsafe { scores_avx512(q, kt, stride, scale, out) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn scores_avx2(q: &[f32], kt: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    scores(q, kt, stride, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn scores_avx512(q: &[f32], kt: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    scores(q, kt, stride, scale, out)
}

/// `out[p] = (Σ_i q_i·k_i(p)) · scale` for the positions p < out.len(), where `kt` is
/// one kv head's keys dim-major (`k_i(p) = kt[i·stride + p]`). Each sum starts at +0.0
/// and adds the rounded products in increasing i, exactly the one-position loop; the
/// `LANES` positions of a block only share the loop (Rust never fuses `a * b + c`).
#[inline(always)]
fn scores(q: &[f32], kt: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    let n_pos = out.len();
    let mut p0 = 0;
    while p0 < n_pos {
        let width = (n_pos - p0).min(LANES);
        let mut acc = [0.0f32; LANES];
        if width == LANES {
            for (i, &qi) in q.iter().enumerate() {
                let k: &[f32; LANES] = kt[i * stride + p0..i * stride + p0 + LANES]
                    .try_into()
                    .expect("a whole block");
                for j in 0..LANES {
                    acc[j] += qi * k[j];
                }
            }
        } else {
            for (i, &qi) in q.iter().enumerate() {
                let k = &kt[i * stride + p0..i * stride + p0 + width];
                for (a, &kv) in acc.iter_mut().zip(k) {
                    *a += qi * kv;
                }
            }
        }
        for (o, &a) in out[p0..p0 + width].iter_mut().zip(&acc) {
            *o = a * scale;
        }
        p0 += width;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The blocked scores equal the one-position-at-a-time loop bit for bit, at every
    /// build, for block-sized and ragged position counts.
    #[test]
    fn scores_equal_the_sequential_dot_bitwise() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (hd, n_pos) in [
            (40usize, 1usize),
            (128, 63),
            (256, 64),
            (72, 200),
            (256, 1000),
        ] {
            let stride = n_pos + 5;
            let q: Vec<f32> = (0..hd).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            let kt: Vec<f32> = (0..hd * stride)
                .map(|_| rng.random_range(-3.0f32..3.0))
                .collect();
            let scale = 1.0 / (hd as f32).sqrt();
            let want: Vec<u32> = (0..n_pos)
                .map(|p| {
                    let mut s = 0.0f32;
                    for i in 0..hd {
                        s += q[i] * kt[i * stride + p];
                    }
                    (s * scale).to_bits()
                })
                .collect();
            let mut builds = vec![Wide::Plain];
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx2") {
                    builds.push(Wide::Avx2);
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    builds.push(Wide::Avx512);
                }
            }
            for wide in builds {
                let mut out = vec![f32::NAN; n_pos];
                scores_at(wide, &q, &kt, stride, scale, &mut out);
                let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "hd {hd}, {n_pos} positions");
            }
        }
    }
}
