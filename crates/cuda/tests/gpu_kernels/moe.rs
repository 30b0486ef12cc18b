//! The MoE and router kernels (the fused decode MoE, `matvec_multi`, the decode router)
//! against the quant crate and the CPU's routing, bit for bit.

use crate::quant_kernels::{activations, cpu_matmul, weights, TYPES};
use crate::{assert_bits, down, filled, gpu, poisoned, up, DevActQ8, QOut, Rng};
use cuda::{GgmlType, MoeRoute};

/// `rows` × `cols` of `ty` at `b` (a stack of such matrices for experts).
fn mat(ty: GgmlType, b: &cuda::DevBuf<u8>, rows: usize, cols: usize) -> cuda::Mat {
    let rb = quant::row_bytes(ty, cols).expect("supported shape") as u64;
    cuda::Mat {
        ty,
        ptr: b.ptr(),
        expert_bytes: rb * rows as u64,
        row_bytes: rb,
        n_rows: rows,
        n_cols: cols,
    }
}

/// One token's MoE block through the fused decode kernels (moe_gate_up, then
/// quantize_act over the activations, then moe_down_combine) against the CPU:
/// each expert's matvecs, SwiGLU, the shared gate's dot and the rank-order
/// combination, bit for bit, for every weight type as gate/up and as down of the
/// routed and of the shared expert.
#[test]
fn fused_decode_moe_matches_the_cpu() {
    let Some(g) = gpu("moe_gate_up, moe_down_combine") else {
        return;
    };
    let mut rng = Rng::new(31);
    let n = TYPES.len();
    // (routed gate/up, routed down, shared gate/up, shared down, shared, logit,
    //  n_embd, n_ff, n_sff, experts, k)
    let mut cases = vec![
        (
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            true,
            true,
            2048,
            512,
            512,
            16,
            8,
        ),
        (
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            false,
            false,
            1024,
            256,
            0,
            12,
            10,
        ),
    ];
    for i in 0..n {
        let shared = i % 3 != 2;
        cases.push((
            TYPES[i],
            TYPES[(i + 3) % n],
            TYPES[(i + 5) % n],
            TYPES[(i + 7) % n],
            shared,
            shared && i % 3 == 0,
            512,
            256,
            if shared { 512 } else { 0 },
            6,
            3,
        ));
    }
    for (tgu, td, stgu, std_, shared, logit, e, fe, sh, n_exp, k) in cases {
        let what = format!(
            "gate/up {tgu}, down {td}, shared {}, {e}×{fe}, top-{k} of {n_exp}",
            if shared {
                format!("{stgu}/{std_} ({sh}) logit={logit}")
            } else {
                "none".into()
            }
        );
        let gate = weights(tgu, n_exp * fe, e, false, &mut rng);
        let upw = weights(tgu, n_exp * fe, e, false, &mut rng);
        let dn = weights(td, n_exp * e, fe, false, &mut rng);
        let (sg, su, sd) = if shared {
            (
                weights(stgu, sh, e, false, &mut rng),
                weights(stgu, sh, e, false, &mut rng),
                weights(std_, e, sh, false, &mut rng),
            )
        } else {
            (Vec::new(), Vec::new(), Vec::new())
        };
        let gate_inp = rng.vec(e, 0.2);
        let (gu_rb, d_rb) = (gate.len() / (n_exp * fe), dn.len() / (n_exp * e));
        // The CPU's MoE block of a token (x) routed by the router's logits: its
        // routing (ids, weights), activations, shared gate logit and output.
        let cpu = |x: &[f32], logits: &[f32]| {
            let routes = model::moe::route(logits, k);
            let ids: Vec<i32> = routes.iter().map(|&(e, _)| e as i32).collect();
            let wts: Vec<f32> = routes.iter().map(|&(_, w)| w).collect();
            let mut act = Vec::new();
            for &id in &ids {
                let ex = id as usize * fe * gu_rb..(id as usize + 1) * fe * gu_rb;
                let gv = cpu_matmul(tgu, &gate[ex.clone()], fe, e, x, 1);
                let uv = cpu_matmul(tgu, &upw[ex], fe, e, x, 1);
                act.extend(gv.iter().zip(&uv).map(|(&a, &b)| model::math::silu(a) * b));
            }
            if shared {
                let gv = cpu_matmul(stgu, &sg, sh, e, x, 1);
                let uv = cpu_matmul(stgu, &su, sh, e, x, 1);
                act.extend(gv.iter().zip(&uv).map(|(&a, &b)| model::math::silu(a) * b));
            }
            let lg = model::math::dot(x, &gate_inp);
            let mut want = vec![0f32; e];
            for (r, &id) in ids.iter().enumerate() {
                let ex = id as usize * e * d_rb..(id as usize + 1) * e * d_rb;
                let d = cpu_matmul(td, &dn[ex], e, fe, &act[r * fe..(r + 1) * fe], 1);
                for (o, v) in want.iter_mut().zip(&d) {
                    *o += wts[r] * v;
                }
            }
            if shared {
                let d = cpu_matmul(std_, &sd, e, sh, &act[k * fe..], 1);
                let gt = model::math::sigmoid(lg);
                for (o, v) in want.iter_mut().zip(&d) {
                    *o = if logit { *o + gt * v } else { *o + v };
                }
            }
            (ids, wts, act, lg, want)
        };
        let x = activations(1, e, &mut rng);
        let logits = rng.vec(n_exp, 4.0);
        let (ids, wts, act, lg, want) = cpu(&x, &logits);

        // The GPU.
        let (dgate, dup, ddn) = (up(&g, &gate), up(&g, &upw), up(&g, &dn));
        let (dsg, dsu, dsd) = (up(&g, &sg), up(&g, &su), up(&g, &sd));
        let (dx, dgi, dlogits) = (up(&g, &x), up(&g, &gate_inp), up(&g, &logits));
        let (dwts_out, dids_out) = (poisoned(&g, k), filled::<i32>(&g, k, 0xff));
        let dq = DevActQ8::upload(&g, &[quant::quantize_act(&x)]);
        let n_act = k * fe + sh;
        let dact = poisoned(&g, n_act);
        let dlg = poisoned(&g, 1);
        let (mg, mu, md) = (
            mat(tgu, &dgate, fe, e),
            mat(tgu, &dup, fe, e),
            mat(td, &ddn, e, fe),
        );
        let (msg, msu, msd) = (
            mat(stgu, &dsg, sh, e),
            mat(stgu, &dsu, sh, e),
            mat(std_, &dsd, e, sh),
        );
        // The activations' quantized copy, written by the last block of each plane; the
        // plane counters must be zero again afterwards, so a second launch gives the same.
        let aqo = QOut::new(&g, n_act);
        let aq = aqo.q();
        let done = filled::<i32>(&g, k + 1, 0);
        // The two launches with this case's weights: gate/up for `n` tokens (x, its
        // copy, the shared logit's address, act, act's copy, the plane counts) and
        // down + combine (ids, weights, act and its copy, shared logit, out, given).
        let gate_up = |route, n, x, xq, lg: u64, act, aq, done| {
            g.moe_gate_up(
                &mg,
                &mu,
                shared.then_some((&msg, &msu)),
                if logit { dgi.ptr() } else { 0 },
                route,
                k,
                n,
                x,
                xq,
                if logit { lg } else { 0 },
                act,
                aq,
                done,
            )
            .unwrap()
        };
        let down_combine = |ids, wts, n, act, aq, lg: u64, out, given| {
            g.moe_down_combine(
                &md,
                shared.then_some(&msd),
                ids,
                wts,
                k,
                n,
                act,
                aq,
                if logit { lg } else { 0 },
                out,
                given,
            )
            .unwrap()
        };
        for launch in 0..2 {
            let route = MoeRoute::Logits {
                logits: dlogits.ptr(),
                n_expert: n_exp,
                wts_out: dwts_out.ptr(),
                ids_out: dids_out.ptr(),
            };
            gate_up(
                route,
                1,
                dx.ptr(),
                dq.q(),
                dlg.ptr(),
                dact.ptr(),
                aq,
                done.ptr(),
            );
            let what = format!("{what}, launch {launch}");
            assert_bits(&down(&g, &dact), &act, &format!("activations: {what}"));
            if logit {
                assert_bits(
                    &down(&g, &dlg),
                    &[lg],
                    &format!("shared gate logit: {what}"),
                );
            }
            aqo.assert_quantizes(&g, &act, n_act, &format!("activations: {what}"));
            assert!(
                down(&g, &done).iter().all(|&c| c == 0),
                "plane counts not reset: {what}"
            );
        }
        let out = poisoned(&g, e);
        assert_bits(
            &down(&g, &dwts_out),
            &wts,
            &format!("routing weights: {what}"),
        );
        assert_eq!(down(&g, &dids_out), ids, "routing experts: {what}");
        down_combine(
            dids_out.ptr(),
            dwts_out.ptr(),
            1,
            dact.ptr(),
            aq,
            dlg.ptr(),
            out.ptr(),
            0,
        );
        assert_bits(&down(&g, &out), &want, &format!("output: {what}"));

        // The routing given instead, every other rank computed elsewhere (negative
        // id, its down products given as rows): the same activations for the ranks
        // computed here, the others untouched, and the same output.
        let given_ids: Vec<i32> = ids
            .iter()
            .enumerate()
            .map(|(r, &id)| if r % 2 == 1 { -1 } else { id })
            .collect();
        let dgiven_ids = up(&g, &given_ids);
        let mut given = vec![f32::NAN; k * e];
        for (r, &id) in ids.iter().enumerate().filter(|(r, _)| r % 2 == 1) {
            let ex = id as usize * e * d_rb..(id as usize + 1) * e * d_rb;
            let d = cpu_matmul(td, &dn[ex], e, fe, &act[r * fe..(r + 1) * fe], 1);
            given[r * e..(r + 1) * e].copy_from_slice(&d);
        }
        let dgiven = up(&g, &given);
        let dact2 = poisoned(&g, n_act);
        let aqo2 = QOut::new(&g, n_act);
        let route = MoeRoute::Given {
            ids: dgiven_ids.ptr(),
        };
        gate_up(
            route,
            1,
            dx.ptr(),
            dq.q(),
            dlg.ptr(),
            dact2.ptr(),
            aqo2.q(),
            done.ptr(),
        );
        let got = down(&g, &dact2);
        for r in 0..k + usize::from(shared) {
            let (a, b) = (r * fe, if r < k { (r + 1) * fe } else { n_act });
            if r < k && r % 2 == 1 {
                assert!(
                    got[a..b].iter().all(|v| v.is_nan()),
                    "rank {r} computed elsewhere was written: {what}"
                );
            } else {
                assert_bits(
                    &got[a..b],
                    &act[a..b],
                    &format!("given routing, plane {r}: {what}"),
                );
            }
        }
        assert!(
            down(&g, &done).iter().all(|&c| c == 0),
            "plane counts not reset (given routing): {what}"
        );
        let out2 = poisoned(&g, e);
        down_combine(
            dgiven_ids.ptr(),
            dwts_out.ptr(),
            1,
            dact2.ptr(),
            aqo2.q(),
            dlg.ptr(),
            out2.ptr(),
            dgiven.ptr(),
        );
        assert_bits(
            &down(&g, &out2),
            &want,
            &format!("output, given routing: {what}"),
        );

        // Three tokens at once (the rows launches), the second the token above: each
        // token's routing, activations, shared logit and output are its own bits.
        let toks = [
            activations(1, e, &mut rng),
            x.clone(),
            activations(1, e, &mut rng),
        ];
        let lgts = [rng.vec(n_exp, 4.0), logits.clone(), rng.vec(n_exp, 4.0)];
        let wants: Vec<_> = toks.iter().zip(&lgts).map(|(x, l)| cpu(x, l)).collect();
        let nt = toks.len();
        let dx3 = up(&g, &toks.concat());
        let dl3 = up(&g, &lgts.concat());
        let dq3 = DevActQ8::upload(
            &g,
            &toks
                .iter()
                .map(|x| quant::quantize_act(x))
                .collect::<Vec<_>>(),
        );
        let (dw3, di3) = (poisoned(&g, nt * k), filled::<i32>(&g, nt * k, 0xff));
        let (dact3, dlg3, aqo3) = (
            poisoned(&g, nt * n_act),
            poisoned(&g, nt),
            QOut::new(&g, nt * n_act),
        );
        let done3 = filled::<i32>(&g, nt * (k + 1), 0);
        let route = MoeRoute::Logits {
            logits: dl3.ptr(),
            n_expert: n_exp,
            wts_out: dw3.ptr(),
            ids_out: di3.ptr(),
        };
        gate_up(
            route,
            nt,
            dx3.ptr(),
            dq3.q(),
            dlg3.ptr(),
            dact3.ptr(),
            aqo3.q(),
            done3.ptr(),
        );
        let out3 = poisoned(&g, nt * e);
        down_combine(
            di3.ptr(),
            dw3.ptr(),
            nt,
            dact3.ptr(),
            aqo3.q(),
            dlg3.ptr(),
            out3.ptr(),
            0,
        );
        let (gw3, gi3, ga3, gl3, go3) = (
            down(&g, &dw3),
            down(&g, &di3),
            down(&g, &dact3),
            down(&g, &dlg3),
            down(&g, &out3),
        );
        for (t, (ids, wts, act, lg, want)) in wants.iter().enumerate() {
            let what = format!("{what}, token {t} of {nt}");
            assert_eq!(
                &gi3[t * k..(t + 1) * k],
                &ids[..],
                "routing experts: {what}"
            );
            assert_bits(
                &gw3[t * k..(t + 1) * k],
                wts,
                &format!("routing weights: {what}"),
            );
            assert_bits(
                &ga3[t * n_act..(t + 1) * n_act],
                act,
                &format!("activations: {what}"),
            );
            if logit {
                assert_bits(
                    &gl3[t..t + 1],
                    &[*lg],
                    &format!("shared gate logit: {what}"),
                );
            }
            assert_bits(&go3[t * e..(t + 1) * e], want, &format!("output: {what}"));
        }
        aqo3.assert_quantizes(
            &g,
            &wants.iter().flat_map(|w| w.2.clone()).collect::<Vec<_>>(),
            n_act,
            &format!("activations' copy: {what}, {nt} tokens"),
        );
        assert!(
            down(&g, &done3).iter().all(|&c| c == 0),
            "plane counts not reset ({nt} tokens): {what}"
        );
    }
}

/// Up to four matrices against one token in one launch (matvec_multi) give each
/// matrix's matvec, bit for bit, for every type; the conv epilogue of matrix 0 gives
/// model::deltanet::conv_step's output and state.
#[test]
fn matvec_multi_matches_the_cpu() {
    let Some(g) = gpu("matvec_multi") else { return };
    let mut rng = Rng::new(33);
    let n = TYPES.len();
    for i in 0..n {
        let n_cols = 512;
        let count = 1 + i % 4;
        let shapes: Vec<(GgmlType, usize)> = (0..count)
            .map(|p| (TYPES[(i + 2 * p) % n], [96, 63, 8, 41][p]))
            .collect();
        let ws: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(ty, rows)| weights(ty, rows, n_cols, false, &mut rng))
            .collect();
        let x = activations(1, n_cols, &mut rng);
        let conv = i % 2 == 0;
        let d_conv = 4;
        let rows0 = shapes[0].1;
        let state0 = rng.vec(rows0 * (d_conv - 1), 2.0);
        let taps = rng.vec(rows0 * d_conv, 0.7);
        // The CPU.
        let mut want: Vec<Vec<f32>> = shapes
            .iter()
            .zip(&ws)
            .map(|(&(ty, rows), w)| cpu_matmul(ty, w, rows, n_cols, &x, 1))
            .collect();
        let mut state = state0.clone();
        if conv {
            let mut o = vec![0f32; rows0];
            model::deltanet::conv_step(&mut state, &taps, &want[0], d_conv, &mut o);
            want[0] = o;
        }
        // The GPU.
        let dws: Vec<_> = ws.iter().map(|w| up(&g, w)).collect();
        let mats: Vec<cuda::Mat> = shapes
            .iter()
            .zip(&dws)
            .map(|(&(ty, rows), b)| mat(ty, b, rows, n_cols))
            .collect();
        let outs: Vec<_> = shapes.iter().map(|&(_, rows)| poisoned(&g, rows)).collect();
        let (dx, dst, dtaps) = (up(&g, &x), up(&g, &state0), up(&g, &taps));
        let dq = DevActQ8::upload(&g, &[quant::quantize_act(&x)]);
        g.matvec_multi(
            &mats.iter().collect::<Vec<_>>(),
            &outs.iter().map(|o| o.ptr()).collect::<Vec<_>>(),
            dx.ptr(),
            dq.q(),
            conv.then_some((dst.ptr(), dtaps.ptr(), d_conv)),
        )
        .unwrap();
        for (p, o) in outs.iter().enumerate() {
            assert_bits(
                &down(&g, o),
                &want[p],
                &format!("matvec_multi matrix {p} of {shapes:?}, conv {conv}"),
            );
        }
        if conv {
            assert_bits(
                &down(&g, &dst),
                &state,
                &format!("conv state of {shapes:?}"),
            );
        }
        // Several tokens in one launch (matvec_multi_rows; 3, or 6 to take a second
        // group of four): each token's matvec, and with the conv, each token's conv
        // step on a state of its own (a table).
        let nt = if i % 2 == 0 { 3 } else { 6 };
        let x3 = activations(nt, n_cols, &mut rng);
        let dx3 = up(&g, &x3);
        let q3: Vec<_> = x3.chunks(n_cols).map(quant::quantize_act).collect();
        let dq3 = DevActQ8::upload(&g, &q3);
        let outs3: Vec<_> = shapes
            .iter()
            .map(|&(_, rows)| poisoned(&g, nt * rows))
            .collect();
        let states3: Vec<Vec<f32>> = (0..nt)
            .map(|_| rng.vec(rows0 * (d_conv - 1), 2.0))
            .collect();
        let dstates3: Vec<_> = states3.iter().map(|st| up(&g, st)).collect();
        let tab = up(&g, &dstates3.iter().map(|b| b.ptr()).collect::<Vec<u64>>());
        g.matvec_multi_rows(
            &mats.iter().collect::<Vec<_>>(),
            &outs3.iter().map(|o| o.ptr()).collect::<Vec<_>>(),
            dx3.ptr(),
            dq3.q(),
            nt,
            conv.then_some((tab.ptr(), dtaps.ptr(), d_conv)),
        )
        .unwrap();
        for (p, (o, (&(ty, rows), w))) in outs3.iter().zip(shapes.iter().zip(&ws)).enumerate() {
            let mut want = cpu_matmul(ty, w, rows, n_cols, &x3, nt);
            if p == 0 && conv {
                for (t, st) in states3.iter().enumerate() {
                    let mut st = st.clone();
                    let mut o = vec![0f32; rows];
                    let row = &want[t * rows..(t + 1) * rows];
                    model::deltanet::conv_step(&mut st, &taps, row, d_conv, &mut o);
                    want[t * rows..(t + 1) * rows].copy_from_slice(&o);
                    assert_bits(
                        &down(&g, &dstates3[t]),
                        &st,
                        &format!("matvec_multi_rows conv state of token {t}, {shapes:?}"),
                    );
                }
            }
            assert_bits(
                &down(&g, o),
                &want,
                &format!("matvec_multi_rows matrix {p} of {shapes:?}, conv {conv}"),
            );
        }
    }
}

/// The router kernel against the CPU's matvec, bit for bit: float routers of each
/// type, widths wider than one register load of a row (2,048 values), token counts
/// up to the most it takes (a row of blocks each), and refusals by name.
#[test]
fn router_matches_the_cpu_matvec() {
    let Some(g) = gpu("router") else { return };
    let mut rng = Rng::new(31);
    for (ty, n_expert, n_cols, n_tok) in [
        (GgmlType::F32, 256, 2048, 1),
        (GgmlType::F32, 256, 2048, 4),
        (GgmlType::F32, 512, 2048, 16),
        (GgmlType::F32, 60, 160, 3),
        (GgmlType::F32, 130, 4128, 5),
        (GgmlType::F32, 1024, 256, 2),
        (GgmlType::F16, 128, 2048, 7),
        (GgmlType::BF16, 64, 96, 9),
    ] {
        let w = weights(ty, n_expert, n_cols, false, &mut rng);
        let x = activations(n_tok, n_cols, &mut rng);
        let want = cpu_matmul(ty, &w, n_expert, n_cols, &x, n_tok);
        let (dw, dx) = (up(&g, &w), up(&g, &x));
        let logits = poisoned(&g, n_tok * n_expert);
        g.router(
            &mat(ty, &dw, n_expert, n_cols),
            dx.ptr(),
            n_tok,
            logits.ptr(),
        )
        .unwrap();
        assert_bits(
            &down(&g, &logits),
            &want,
            &format!("{ty} {n_expert}×{n_cols}, {n_tok} tokens"),
        );
        // The routed launch (at most 256 experts): the same logits, and each token's
        // model::moe::route from its last block, twice (the counts return to zero).
        if n_expert > cuda::ROUTE_IN_ROUTER_MAX_EXPERT {
            continue;
        }
        let k = n_expert.min(8);
        let counter = filled::<i32>(&g, n_tok, 0);
        for round in 0..2 {
            let logits = poisoned(&g, n_tok * n_expert);
            let (dw, di) = (poisoned(&g, n_tok * k), filled::<i32>(&g, n_tok * k, 0xff));
            let route = cuda::RouterRoute {
                k,
                weights_out: dw.ptr(),
                ids_out: di.ptr(),
                counter: counter.ptr(),
            };
            g.router_routed(
                &mat(ty, &up(&g, &w), n_expert, n_cols),
                dx.ptr(),
                n_tok,
                logits.ptr(),
                Some(route),
            )
            .unwrap();
            let what = format!("routed {ty} {n_expert}×{n_cols}, {n_tok} tokens, round {round}");
            assert_bits(&down(&g, &logits), &want, &what);
            let (gw, gi) = (down(&g, &dw), down(&g, &di));
            for t in 0..n_tok {
                let r = model::moe::route(&want[t * n_expert..(t + 1) * n_expert], k);
                let ids: Vec<i32> = r.iter().map(|x| x.0 as i32).collect();
                let wts: Vec<f32> = r.iter().map(|x| x.1).collect();
                assert_eq!(&gi[t * k..(t + 1) * k], &ids[..], "ids, {what}, token {t}");
                assert_bits(
                    &gw[t * k..(t + 1) * k],
                    &wts,
                    &format!("weights, {what}, token {t}"),
                );
            }
            assert_eq!(down(&g, &counter), vec![0; n_tok], "counts, {what}");
        }
    }
    let w = weights(GgmlType::Q8_0, 8, 64, false, &mut rng);
    let dw = up(&g, &w);
    let x = up(&g, &vec![0f32; 17 * 64]);
    let out = poisoned(&g, 17 * 8);
    let e = g
        .router(&mat(GgmlType::Q8_0, &dw, 8, 64), x.ptr(), 1, out.ptr())
        .unwrap_err();
    assert!(e.to_string().contains("F32, F16 or BF16"), "{e}");
    let wf = up(&g, &vec![0f32; 8 * 64]);
    let wf = cuda::Mat {
        ty: GgmlType::F32,
        ptr: wf.ptr(),
        expert_bytes: 8 * 256,
        row_bytes: 256,
        n_rows: 8,
        n_cols: 64,
    };
    let e = g.router(&wf, x.ptr(), 17, out.ptr()).unwrap_err();
    assert!(e.to_string().contains("17 tokens"), "{e}");
    let wb = up(&g, &vec![0f32; 512 * 64]);
    let big = cuda::Mat {
        ptr: wb.ptr(),
        expert_bytes: 512 * 256,
        n_rows: 512,
        ..wf
    };
    let route = cuda::RouterRoute {
        k: 8,
        weights_out: out.ptr(),
        ids_out: out.ptr(),
        counter: out.ptr(),
    };
    let e = g
        .router_routed(&big, x.ptr(), 2, out.ptr(), Some(route))
        .unwrap_err();
    assert!(e.to_string().contains("of 512 experts"), "{e}");
}
