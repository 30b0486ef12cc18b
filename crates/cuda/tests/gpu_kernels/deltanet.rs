//! The gated DeltaNet kernels against the CPU executor's sequence
//! (engine/src/cpu/deltanet.rs over model::deltanet), bit for bit: conv outputs and
//! state, normed q/k, recurrent state and the gated outputs.

use crate::{assert_bits, down, gpu, poisoned, up, QOut, Rng};
use cuda::DnStep;
use model::deltanet::{conv_step, gated_norm, step};
use model::math::{l2_norm, sigmoid, softplus};

struct Case {
    n_k_heads: usize,
    n_v_heads: usize,
    d: usize,
    n_tok: usize,
    /// Value head h reads key head h % Hk (else h / (Hv/Hk)).
    tiled: bool,
    /// β and α in one [b | a] projection per key-head group (qwen3next), else two.
    fused: bool,
}

#[test]
fn deltanet_matches_the_cpu_bit_for_bit() {
    let Some(g) = gpu("deltanet") else { return };
    let mut rng = Rng::new(30);
    let cases = [
        Case {
            n_k_heads: 2,
            n_v_heads: 4,
            d: 128,
            n_tok: 1,
            tiled: false,
            fused: true,
        },
        Case {
            n_k_heads: 2,
            n_v_heads: 4,
            d: 128,
            n_tok: 9,
            tiled: false,
            fused: false,
        },
        Case {
            n_k_heads: 4,
            n_v_heads: 8,
            d: 64,
            n_tok: 5,
            tiled: true,
            fused: false,
        },
        Case {
            n_k_heads: 1,
            n_v_heads: 2,
            d: 32,
            n_tok: 3,
            tiled: false,
            fused: true,
        },
        Case {
            n_k_heads: 2,
            n_v_heads: 2,
            d: 128,
            n_tok: 40,
            tiled: true,
            fused: true,
        },
        Case {
            n_k_heads: 4,
            n_v_heads: 8,
            d: 64,
            n_tok: 1,
            tiled: true,
            fused: false,
        },
        Case {
            n_k_heads: 2,
            n_v_heads: 2,
            d: 32,
            n_tok: 1,
            tiled: false,
            fused: false,
        },
        // The recurrence stages runs of 16 tokens: two whole runs, the last token
        // closing the second.
        Case {
            n_k_heads: 2,
            n_v_heads: 4,
            d: 64,
            n_tok: 32,
            tiled: false,
            fused: false,
        },
        // dn_conv in several parallel runs of tokens, the last one partial.
        Case {
            n_k_heads: 1,
            n_v_heads: 2,
            d: 32,
            n_tok: 97,
            tiled: false,
            fused: false,
        },
    ];
    let (d_conv, eps) = (4usize, 1e-6f32);
    for c in cases {
        let (hk, hv, d, t_n) = (c.n_k_heads, c.n_v_heads, c.d, c.n_tok);
        let (kd, vd) = (hk * d, hv * d);
        let conv_dim = 2 * kd + vd;
        let hist = d_conv - 1;
        let qkv = rng.vec(t_n * conv_dim, 2.0);
        let conv_state0 = rng.vec(conv_dim * hist, 2.0);
        let taps = rng.vec(conv_dim * d_conv, 0.7);
        let ssm0 = rng.vec(hv * d * d, 0.2);
        let z = rng.vec(t_n * vd, 3.0);
        let norm_w = rng.vec(d, 1.5);
        let a: Vec<f32> = (0..hv).map(|_| -(1.0 + rng.f())).collect();
        let dt_bias = rng.vec(hv, 1.0);
        let r = hv / hk;
        let k_head_of: Vec<i32> = (0..hv)
            .map(|h| if c.tiled { h % hk } else { h / r } as i32)
            .collect();
        // β/α sources and the index arrays that gather them.
        let (
            beta_src,
            beta_stride,
            beta_idx,
            alpha_src,
            alpha_stride,
            alpha_idx,
            beta_rows,
            alpha_rows,
        ) = if c.fused {
            let ba = rng.vec(t_n * 2 * hv, 3.0);
            let bi: Vec<i32> = (0..hv).map(|h| ((h / r) * 2 * r + h % r) as i32).collect();
            let ai: Vec<i32> = (0..hv)
                .map(|h| ((h / r) * 2 * r + r + h % r) as i32)
                .collect();
            let mut br = Vec::new();
            let mut ar = Vec::new();
            let (brows, arows) = model::arch::qwen3next::ba_rows(hk, hv);
            for t in 0..t_n {
                let row = &ba[t * 2 * hv..(t + 1) * 2 * hv];
                br.extend(brows.iter().map(|&i| row[i as usize]));
                ar.extend(arows.iter().map(|&i| row[i as usize]));
            }
            (ba.clone(), 2 * hv, bi, ba, 2 * hv, ai, br, ar)
        } else {
            let b = rng.vec(t_n * hv, 3.0);
            let al = rng.vec(t_n * hv, 3.0);
            let idx: Vec<i32> = (0..hv as i32).collect();
            (b.clone(), hv, idx.clone(), al.clone(), hv, idx, b, al)
        };

        // The CPU executor's sequence.
        let scale = 1.0 / (d as f32).sqrt();
        let mut cst = conv_state0.clone();
        let mut conv = vec![0f32; t_n * conv_dim];
        let mut conv_raw = vec![0f32; t_n * conv_dim];
        for t in 0..t_n {
            let dst = &mut conv[t * conv_dim..(t + 1) * conv_dim];
            conv_step(
                &mut cst,
                &taps,
                &qkv[t * conv_dim..(t + 1) * conv_dim],
                d_conv,
                dst,
            );
            conv_raw[t * conv_dim..(t + 1) * conv_dim].copy_from_slice(dst);
            let (q_all, rest) = dst.split_at_mut(kd);
            for h in 0..hk {
                l2_norm(&mut q_all[h * d..(h + 1) * d], 1e-6);
                l2_norm(&mut rest[h * d..(h + 1) * d], 1e-6);
            }
            for qv in q_all.iter_mut() {
                *qv *= scale;
            }
        }
        let mut ssm = ssm0.clone();
        let mut y = vec![0f32; t_n * vd];
        for h in 0..hv {
            let kh = k_head_of[h] as usize;
            let s = &mut ssm[h * d * d..(h + 1) * d * d];
            for t in 0..t_n {
                let row = &conv[t * conv_dim..(t + 1) * conv_dim];
                let (q, k) = (
                    &row[kh * d..(kh + 1) * d],
                    &row[kd + kh * d..kd + (kh + 1) * d],
                );
                let v = &row[2 * kd + h * d..2 * kd + (h + 1) * d];
                let gg = a[h] * softplus(alpha_rows[t * hv + h] + dt_bias[h]);
                let beta = sigmoid(beta_rows[t * hv + h]);
                let o = &mut y[t * vd + h * d..t * vd + (h + 1) * d];
                step(s, q, k, v, gg, beta, o);
                gated_norm(o, &z[t * vd + h * d..t * vd + (h + 1) * d], &norm_w, eps);
            }
        }

        // The GPU: conv, q/k norm, recurrence (+ gated norm).
        let dqkv = up(&g, &qkv);
        let dcst = up(&g, &conv_state0);
        let dtaps = up(&g, &taps);
        let dconv = poisoned(&g, t_n * conv_dim);
        g.dn_conv(
            dqkv.ptr(),
            dcst.ptr(),
            dtaps.ptr(),
            t_n,
            conv_dim,
            d_conv,
            dconv.ptr(),
            0,
        )
        .unwrap();
        let what = format!(
            "Hk {hk} Hv {hv} d {d} T {t_n} tiled {} fused {}",
            c.tiled, c.fused
        );
        assert_bits(&down(&g, &dconv), &conv_raw, &format!("conv out, {what}"));
        assert_bits(&down(&g, &dcst), &cst, &format!("conv state, {what}"));
        g.dn_qk_norm(dconv.ptr(), t_n, conv_dim, hk, d, scale)
            .unwrap();
        assert_bits(&down(&g, &dconv), &conv, &format!("normed q/k, {what}"));
        let (dbs, dbi, das, dai) = (
            up(&g, &beta_src),
            up(&g, &beta_idx),
            up(&g, &alpha_src),
            up(&g, &alpha_idx),
        );
        let (da, ddt, dkh, dz, dnw) = (
            up(&g, &a),
            up(&g, &dt_bias),
            up(&g, &k_head_of),
            up(&g, &z),
            up(&g, &norm_w),
        );
        let dssm = up(&g, &ssm0);
        let out = poisoned(&g, t_n * vd);
        g.dn_recurrence(
            dconv.ptr(),
            t_n,
            conv_dim,
            dbs.ptr(),
            beta_stride,
            dbi.ptr(),
            das.ptr(),
            alpha_stride,
            dai.ptr(),
            da.ptr(),
            ddt.ptr(),
            dkh.ptr(),
            dz.ptr(),
            dnw.ptr(),
            eps,
            dssm.ptr(),
            hk,
            hv,
            d,
            out.ptr(),
            0,
        )
        .unwrap();
        assert_bits(&down(&g, &dssm), &ssm, &format!("recurrent state, {what}"));
        assert_bits(&down(&g, &out), &y, &format!("output, {what}"));

        // One token in one launch (dn_step) from the conv output before the q/k norm,
        // with the output's quantized copy.
        if t_n == 1 {
            let dconv_raw = up(&g, &conv_raw);
            let dssm1 = up(&g, &ssm0);
            let out1 = poisoned(&g, vd);
            let qo = QOut::new(&g, vd);
            let step_args = DnStep {
                beta_src: dbs.ptr(),
                beta_idx: dbi.ptr(),
                alpha_src: das.ptr(),
                alpha_idx: dai.ptr(),
                a: da.ptr(),
                dt_bias: ddt.ptr(),
                k_head_of: dkh.ptr(),
                z: dz.ptr(),
                norm_w: dnw.ptr(),
                eps,
                scale,
                n_k_heads: hk,
                n_v_heads: hv,
                d_state: d,
            };
            g.dn_step(dconv_raw.ptr(), &step_args, dssm1.ptr(), out1.ptr(), qo.q())
                .unwrap();
            assert_bits(&down(&g, &dssm1), &ssm, &format!("dn_step state, {what}"));
            assert_bits(&down(&g, &out1), &y, &format!("dn_step output, {what}"));
            assert_bits(
                &down(&g, &dconv_raw),
                &conv_raw,
                &format!("dn_step leaves the conv output, {what}"),
            );
            qo.assert_quantizes(&g, &y, vd, &format!("dn_step, {what}"));
        }
    }
}

#[test]
fn deltanet_prompt_equals_token_by_token() {
    // The invariant the executor relies on: feeding T tokens at once leaves the same
    // state and outputs as T single-token calls; and the trail a verify step keeps
    // holds, for each token but the last, the state T single-token calls leave there
    // (what a rollback restores). T crosses the recurrence's 16-token runs.
    let Some(g) = gpu("deltanet prompt vs decode") else {
        return;
    };
    let mut rng = Rng::new(31);
    let (hk, hv, d, t_n, d_conv) = (2usize, 4usize, 128usize, 18usize, 4usize);
    let (kd, vd) = (hk * d, hv * d);
    let conv_dim = 2 * kd + vd;
    let (conv_len, ssm_len) = (conv_dim * (d_conv - 1), hv * d * d);
    let qkv = rng.vec(t_n * conv_dim, 2.0);
    let taps = rng.vec(conv_dim * d_conv, 0.7);
    let cst0 = rng.vec(conv_len, 1.0);
    let ssm0 = rng.vec(ssm_len, 0.2);
    let ba = rng.vec(t_n * hv, 2.0);
    let z = rng.vec(t_n * vd, 2.0);
    let nw = rng.vec(d, 1.0);
    let a: Vec<f32> = (0..hv).map(|_| -(1.0 + rng.f())).collect();
    let dtb = rng.vec(hv, 1.0);
    let idx: Vec<i32> = (0..hv as i32).collect();
    let kho: Vec<i32> = (0..hv).map(|h| (h / 2) as i32).collect();
    let (dtaps, dba, didx, da, ddtb, dkho, dz, dnw) = (
        up(&g, &taps),
        up(&g, &ba),
        up(&g, &idx),
        up(&g, &a),
        up(&g, &dtb),
        up(&g, &kho),
        up(&g, &z),
        up(&g, &nw),
    );
    let scale = 1.0 / (d as f32).sqrt();
    // Outputs, final conv and recurrent state, the states after each call, and the
    // trails of the calls (when `trail`).
    type Run = (
        Vec<f32>,
        Vec<f32>,
        Vec<f32>,
        Vec<(Vec<f32>, Vec<f32>)>,
        Vec<f32>,
        Vec<f32>,
    );
    let run = |tokens: &[(usize, usize)], trail: bool| -> Run {
        let (cst, ssm) = (up(&g, &cst0), up(&g, &ssm0));
        let (mut outs, mut after, mut ctrail, mut strail) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &(t0, n) in tokens {
            let x = up(&g, &qkv[t0 * conv_dim..(t0 + n) * conv_dim]);
            let conv = poisoned(&g, n * conv_dim);
            let entries = if trail { n - 1 } else { 0 };
            let (ct, st) = (
                poisoned(&g, (entries * conv_len).max(1)),
                poisoned(&g, (entries * ssm_len).max(1)),
            );
            let ptr = |b: &cuda::DevBuf<f32>| if trail { b.ptr() } else { 0 };
            g.dn_conv(
                x.ptr(),
                cst.ptr(),
                dtaps.ptr(),
                n,
                conv_dim,
                d_conv,
                conv.ptr(),
                ptr(&ct),
            )
            .unwrap();
            g.dn_qk_norm(conv.ptr(), n, conv_dim, hk, d, scale).unwrap();
            let out = poisoned(&g, n * vd);
            g.dn_recurrence(
                conv.ptr(),
                n,
                conv_dim,
                dba.ptr() + (t0 * hv * 4) as u64,
                hv,
                didx.ptr(),
                dba.ptr() + (t0 * hv * 4) as u64,
                hv,
                didx.ptr(),
                da.ptr(),
                ddtb.ptr(),
                dkho.ptr(),
                dz.ptr() + (t0 * vd * 4) as u64,
                dnw.ptr(),
                1e-6,
                ssm.ptr(),
                hk,
                hv,
                d,
                out.ptr(),
                ptr(&st),
            )
            .unwrap();
            outs.extend(down(&g, &out));
            after.push((down(&g, &cst), down(&g, &ssm)));
            if trail {
                ctrail.extend(&down(&g, &ct)[..entries * conv_len]);
                strail.extend(&down(&g, &st)[..entries * ssm_len]);
            }
        }
        (outs, down(&g, &cst), down(&g, &ssm), after, ctrail, strail)
    };
    let whole = run(&[(0, t_n)], false);
    let single: Vec<(usize, usize)> = (0..t_n).map(|t| (t, 1)).collect();
    let steps = run(&single, false);
    assert_bits(&steps.0, &whole.0, "outputs");
    assert_bits(&steps.1, &whole.1, "conv state");
    assert_bits(&steps.2, &whole.2, "recurrent state");
    // With the trail: the same outputs and state, and each entry the state after
    // its token.
    let kept = run(&[(0, t_n)], true);
    assert_bits(&kept.0, &whole.0, "outputs with the trail");
    assert_bits(&kept.1, &whole.1, "conv state with the trail");
    assert_bits(&kept.2, &whole.2, "recurrent state with the trail");
    for (t, (c, s)) in steps.3[..t_n - 1].iter().enumerate() {
        assert_bits(
            &kept.4[t * conv_len..(t + 1) * conv_len],
            c,
            &format!("conv trail after token {t}"),
        );
        assert_bits(
            &kept.5[t * ssm_len..(t + 1) * ssm_len],
            s,
            &format!("recurrent trail after token {t}"),
        );
    }
}
