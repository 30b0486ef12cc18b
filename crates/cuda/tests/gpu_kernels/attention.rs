//! attn_prep bit for bit against model::math (rms_norm, rope_neox); attn_core against
//! an f64 softmax attention within 1e-5 of the output's scale.

use crate::{assert_bits, down, gpu, poisoned, softmax_f64, up, QOut, Rng};
use cuda::{ActQ8, Rotary};

/// The host's rope table [n_ctx][n_rot/2][2] = (cos, sin), as model::math computes them.
pub fn rope_table(n_ctx: usize, n_rot: usize, theta: f32) -> Vec<f32> {
    let half = n_rot / 2;
    let mut t = Vec::with_capacity(n_ctx * half * 2);
    for pos in 0..n_ctx {
        for i in 0..half {
            let (c, s) = model::math::rope_cos_sin(pos, i, n_rot, theta);
            t.push(c);
            t.push(s);
        }
    }
    t
}

struct PrepCase {
    n_tok: usize,
    pos0: usize,
    n_head: usize,
    n_head_kv: usize,
    hd: usize,
    n_rot: usize,
    gated: bool,
}

#[test]
fn attn_prep_matches_norm_and_rope() {
    let Some(g) = gpu("attn_prep") else { return };
    let mut rng = Rng::new(20);
    let cases = [
        // qwen3next / qwen35moe: head_dim 256, a quarter rotated, gated queries.
        PrepCase {
            n_tok: 3,
            pos0: 5,
            n_head: 8,
            n_head_kv: 2,
            hd: 256,
            n_rot: 64,
            gated: true,
        },
        // qwen3moe: head_dim 128, fully rotated.
        PrepCase {
            n_tok: 9,
            pos0: 0,
            n_head: 8,
            n_head_kv: 4,
            hd: 128,
            n_rot: 128,
            gated: false,
        },
        PrepCase {
            n_tok: 1,
            pos0: 60,
            n_head: 4,
            n_head_kv: 1,
            hd: 64,
            n_rot: 32,
            gated: false,
        },
    ];
    let (n_ctx, eps, theta) = (64, 1e-6f32, 10_000_000.0f32);
    for c in cases {
        let q_stride = if c.gated { 2 * c.hd } else { c.hd };
        let q_raw = rng.vec(c.n_tok * c.n_head * q_stride, 3.0);
        let k_raw = rng.vec(c.n_tok * c.n_head_kv * c.hd, 3.0);
        let v_raw = rng.vec(c.n_tok * c.n_head_kv * c.hd, 3.0);
        let (qn, kn) = (rng.vec(c.hd, 2.0), rng.vec(c.hd, 2.0));
        let rope = rope_table(n_ctx, c.n_rot, theta);
        let kvw = c.n_head_kv * c.hd;
        // CPU: engine/src/cpu/attention.rs.
        let mut want_q = vec![0f32; c.n_tok * c.n_head * c.hd];
        let mut want_k = vec![f32::from_bits(u32::MAX); n_ctx * kvw];
        let mut want_v = want_k.clone();
        for t in 0..c.n_tok {
            let p = c.pos0 + t;
            for h in 0..c.n_head {
                let dst = &mut want_q[(t * c.n_head + h) * c.hd..(t * c.n_head + h + 1) * c.hd];
                let src = t * c.n_head * q_stride + h * q_stride;
                dst.copy_from_slice(&q_raw[src..src + c.hd]);
                model::math::rms_norm(dst, &qn, eps);
                model::math::rope_neox(dst, p, c.n_rot, theta);
            }
            for h in 0..c.n_head_kv {
                let dst = &mut want_k[p * kvw + h * c.hd..p * kvw + (h + 1) * c.hd];
                dst.copy_from_slice(
                    &k_raw[(t * c.n_head_kv + h) * c.hd..(t * c.n_head_kv + h + 1) * c.hd],
                );
                model::math::rms_norm(dst, &kn, eps);
                model::math::rope_neox(dst, p, c.n_rot, theta);
            }
            want_v[p * kvw..(p + 1) * kvw].copy_from_slice(&v_raw[t * kvw..(t + 1) * kvw]);
        }
        let (dq, dk, dv) = (up(&g, &q_raw), up(&g, &k_raw), up(&g, &v_raw));
        let (dqn, dkn, drope) = (up(&g, &qn), up(&g, &kn), up(&g, &rope));
        let pos = up(&g, &[c.pos0 as i32]);
        let (kc, vc) = (poisoned(&g, n_ctx * kvw), poisoned(&g, n_ctx * kvw));
        let q_out = poisoned(&g, c.n_tok * c.n_head * c.hd);
        g.attn_prep(
            dq.ptr(),
            dk.ptr(),
            dv.ptr(),
            c.n_tok,
            pos.ptr(),
            c.n_head,
            c.n_head_kv,
            c.hd,
            q_stride,
            dqn.ptr(),
            dkn.ptr(),
            eps,
            &Rotary::plain(drope.ptr(), c.n_rot),
            kc.ptr(),
            vc.ptr(),
            q_out.ptr(),
            0,
        )
        .unwrap();
        let what = format!("hd {} rot {} at {}", c.hd, c.n_rot, c.pos0);
        assert_bits(&down(&g, &q_out), &want_q, &format!("q, {what}"));
        assert_bits(&down(&g, &kc), &want_k, &format!("k cache, {what}"));
        assert_bits(&down(&g, &vc), &want_v, &format!("v cache, {what}"));
    }
}

/// Multimodal positions (Qwen3.5's interleaved M-RoPE): each token's pairs rotate at
/// the t, h or w position their section gives, bit for bit as the CPU's
/// `mrope_table`, while its K/V still go to its cache row.
#[test]
fn attn_prep_rotates_at_multimodal_positions() {
    let Some(g) = gpu("attn_prep") else { return };
    let mut rng = Rng::new(21);
    // Qwen3.5's heads: 256 dims, 64 rotated, sections [11, 11, 10, 0].
    let (n_tok, pos0, nh, nkv, hd, n_rot) = (7, 9, 4, 2, 256, 64);
    let sections = [11, 11, 10, 0];
    let (n_ctx, eps, theta) = (64, 1e-6f32, 10_000_000.0f32);
    let q_raw = rng.vec(n_tok * nh * hd, 3.0);
    let k_raw = rng.vec(n_tok * nkv * hd, 3.0);
    let v_raw = rng.vec(n_tok * nkv * hd, 3.0);
    let (qn, kn) = (rng.vec(hd, 2.0), rng.vec(hd, 2.0));
    // Positions anywhere in the table, the three axes apart (an image's rows), and
    // one token with t = h = w (text).
    let mut mpos: Vec<[u32; 3]> = (0..n_tok)
        .map(|_| [0; 3].map(|_| rng.below(n_ctx) as u32))
        .collect();
    mpos[3] = [17; 3];
    let kvw = nkv * hd;
    let mut want_q = vec![0f32; n_tok * nh * hd];
    let mut want_k = vec![f32::from_bits(u32::MAX); n_ctx * kvw];
    for t in 0..n_tok {
        let table = model::math::mrope_table(mpos[t], n_rot, theta, sections);
        for h in 0..nh {
            let dst = &mut want_q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            dst.copy_from_slice(&q_raw[(t * nh + h) * hd..(t * nh + h + 1) * hd]);
            model::math::rms_norm(dst, &qn, eps);
            model::math::rope_neox_with(dst, &table);
        }
        let p = pos0 + t;
        for h in 0..nkv {
            let dst = &mut want_k[p * kvw + h * hd..p * kvw + (h + 1) * hd];
            dst.copy_from_slice(&k_raw[(t * nkv + h) * hd..(t * nkv + h + 1) * hd]);
            model::math::rms_norm(dst, &kn, eps);
            model::math::rope_neox_with(dst, &table);
        }
    }
    let (dq, dk, dv) = (up(&g, &q_raw), up(&g, &k_raw), up(&g, &v_raw));
    let (dqn, dkn) = (up(&g, &qn), up(&g, &kn));
    let drope = up(&g, &rope_table(n_ctx, n_rot, theta));
    let flat: Vec<i32> = mpos.iter().flatten().map(|&p| p as i32).collect();
    let dmpos = up(&g, &flat);
    let pos = up(&g, &[pos0 as i32]);
    let (kc, vc) = (poisoned(&g, n_ctx * kvw), poisoned(&g, n_ctx * kvw));
    let q_out = poisoned(&g, n_tok * nh * hd);
    let rope = Rotary {
        table: drope.ptr(),
        n_rot,
        mpos: dmpos.ptr(),
        sections: [sections[1], sections[2]],
    };
    g.attn_prep(
        dq.ptr(),
        dk.ptr(),
        dv.ptr(),
        n_tok,
        pos.ptr(),
        nh,
        nkv,
        hd,
        hd,
        dqn.ptr(),
        dkn.ptr(),
        eps,
        &rope,
        kc.ptr(),
        vc.ptr(),
        q_out.ptr(),
        0,
    )
    .unwrap();
    assert_bits(&down(&g, &q_out), &want_q, "q at multimodal positions");
    assert_bits(&down(&g, &kc), &want_k, "k cache at multimodal positions");
}

/// Softmax attention in f64 (engine/src/cpu/attention.rs's math), and per output the
/// scale Σ p·|v| (times the gate) that its error is measured against.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    n_tok: usize,
    pos0: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    gate: Option<(&[f32], usize)>,
) -> (Vec<f64>, Vec<f64>) {
    let group = nh / nkv;
    let scale = 1.0 / (hd as f64).sqrt();
    let (mut out, mut mag) = (vec![0f64; n_tok * nh * hd], vec![0f64; n_tok * nh * hd]);
    for t in 0..n_tok {
        for h in 0..nh {
            let kvh = h / group;
            let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            let n_pos = pos0 + t + 1;
            let keys = (0..n_pos).map(|p| &kc[(p * nkv + kvh) * hd..(p * nkv + kvh + 1) * hd]);
            let w = softmax_f64(qh, keys, scale);
            for d in 0..hd {
                let (mut o, mut a) = (0f64, 0f64);
                for (p, &wp) in w.iter().enumerate() {
                    let v = vc[(p * nkv + kvh) * hd + d] as f64;
                    o += wp * v;
                    a += wp * v.abs();
                }
                if let Some((gt, stride)) = gate {
                    let gv = gt[t * nh * stride + h * stride + hd + d] as f64;
                    let sg = 1.0 / (1.0 + (-gv).exp());
                    o *= sg;
                    a *= sg;
                }
                out[(t * nh + h) * hd + d] = o;
                mag[(t * nh + h) * hd + d] = a;
            }
        }
    }
    (out, mag)
}

struct CoreCase {
    n_tok: usize,
    pos0: usize,
    n_ctx: usize,
    n_head: usize,
    n_head_kv: usize,
    hd: usize,
    gated: bool,
}

#[test]
fn attn_core_matches_softmax_attention() {
    let Some(g) = gpu("attn_core") else { return };
    let mut rng = Rng::new(21);
    let cases = [
        CoreCase {
            n_tok: 37,
            pos0: 0,
            n_ctx: 64,
            n_head: 16,
            n_head_kv: 4,
            hd: 128,
            gated: true,
        },
        CoreCase {
            n_tok: 20,
            pos0: 50,
            n_ctx: 80,
            n_head: 8,
            n_head_kv: 2,
            hd: 256,
            gated: true,
        },
        // Decode over a long context: split across blocks, merged by attn_combine.
        CoreCase {
            n_tok: 1,
            pos0: 3000,
            n_ctx: 4096,
            n_head: 32,
            n_head_kv: 4,
            hd: 128,
            gated: false,
        },
        CoreCase {
            n_tok: 1,
            pos0: 700,
            n_ctx: 1024,
            n_head: 16,
            n_head_kv: 2,
            hd: 256,
            gated: true,
        },
        CoreCase {
            n_tok: 2,
            pos0: 0,
            n_ctx: 2,
            n_head: 4,
            n_head_kv: 4,
            hd: 64,
            gated: false,
        },
        CoreCase {
            n_tok: 5,
            pos0: 10,
            n_ctx: 4096,
            n_head: 8,
            n_head_kv: 1,
            hd: 64,
            gated: false,
        },
        // A prompt continuing a long sequence over many key chunks: one launch that
        // walks every chunk, against one-token calls split a block per chunk.
        CoreCase {
            n_tok: 300,
            pos0: 400,
            n_ctx: 1024,
            n_head: 4,
            n_head_kv: 2,
            hd: 128,
            gated: false,
        },
        // A longer prompt: many key tiles per block.
        CoreCase {
            n_tok: 600,
            pos0: 0,
            n_ctx: 600,
            n_head: 4,
            n_head_kv: 1,
            hd: 128,
            gated: true,
        },
    ];
    for c in cases {
        let (nh, nkv, hd) = (c.n_head, c.n_head_kv, c.hd);
        let q_stride = if c.gated { 2 * hd } else { hd };
        let q = rng.vec(c.n_tok * nh * hd, 1.0);
        // Keys scaled so that softmax is neither flat nor one-hot.
        let kc = rng.vec(c.n_ctx * nkv * hd, 0.3);
        let vc = rng.vec(c.n_ctx * nkv * hd, 2.0);
        let gate_raw = rng.vec(c.n_tok * nh * q_stride, 3.0);
        let (dq, dk, dv, dg) = (up(&g, &q), up(&g, &kc), up(&g, &vc), up(&g, &gate_raw));
        let pos = up(&g, &[c.pos0 as i32]);
        let sb = g.attn_scratch_bytes(c.n_tok, nh, nkv, hd, c.n_ctx);
        let scratch = poisoned(&g, (sb as usize / 4).max(1));
        let n_out = c.n_tok * nh * hd;
        let qo = QOut::new(&g, n_out);
        let oq = qo.q();
        let run = || {
            let out = poisoned(&g, n_out);
            let quantized = g
                .attn_core(
                    dq.ptr(),
                    c.n_tok,
                    pos.ptr(),
                    nh,
                    nkv,
                    hd,
                    dk.ptr(),
                    dv.ptr(),
                    c.n_ctx,
                    if c.gated { dg.ptr() } else { 0 },
                    q_stride,
                    out.ptr(),
                    if sb > 0 { scratch.ptr() } else { 0 },
                    oq,
                    0,
                )
                .unwrap();
            assert_eq!(quantized, sb > 0, "the split path (and only it) quantizes");
            down(&g, &out)
        };
        let got = run();
        // The quantized copy the split path writes beside the output is quantize_act's.
        if sb > 0 {
            qo.assert_quantizes(&g, &got, n_out, "attention output");
        }
        let (want, mag) = reference(
            &q,
            &kc,
            &vc,
            c.n_tok,
            c.pos0,
            nh,
            nkv,
            hd,
            c.gated.then_some((&gate_raw[..], q_stride)),
        );
        let what = format!(
            "{} tokens at {} (ctx {}), {nh}/{nkv} heads of {hd}, gated {}, scratch {sb}",
            c.n_tok, c.pos0, c.n_ctx, c.gated
        );
        for i in 0..got.len() {
            let err = (got[i] as f64 - want[i]).abs();
            assert!(
                err <= 1e-5 * mag[i] + 1e-7,
                "{what}: element {i}: gpu {} vs f64 {} (scale {})",
                got[i],
                want[i],
                mag[i]
            );
        }
        assert_bits(&run(), &got, &format!("{what}: run to run"));
        // A prompt (the wide launch once it has more rows than a block; split a block
        // per key chunk or not) gives each token the bits of its one-token call (split
        // or not): the keys' chunks are the same and folded alike.
        if c.n_tok > 1 {
            let sb1 = g.attn_scratch_bytes(1, nh, nkv, hd, c.n_ctx);
            let scratch1 = poisoned(&g, (sb1 as usize / 4).max(1));
            for t in 0..c.n_tok {
                let row = |v: &[f32], w: usize| up(&g, &v[t * w..(t + 1) * w]);
                let (q1, g1) = (row(&q, nh * hd), row(&gate_raw, nh * q_stride));
                let pos1 = up(&g, &[(c.pos0 + t) as i32]);
                let out = poisoned(&g, nh * hd);
                g.attn_core(
                    q1.ptr(),
                    1,
                    pos1.ptr(),
                    nh,
                    nkv,
                    hd,
                    dk.ptr(),
                    dv.ptr(),
                    c.n_ctx,
                    if c.gated { g1.ptr() } else { 0 },
                    q_stride,
                    out.ptr(),
                    if sb1 > 0 { scratch1.ptr() } else { 0 },
                    ActQ8::NONE,
                    0,
                )
                .unwrap();
                assert_bits(
                    &down(&g, &out),
                    &got[t * nh * hd..(t + 1) * nh * hd],
                    &format!("{what}: token {t} alone (scratch {sb1})"),
                );
            }
        }
    }
}
