//! Stream capture and replay: a captured decode-like sequence replayed with new device
//! inputs gives the CPU's bits; device-written routing tiles drive matvec_tiles inside
//! a graph; a moving position read from the device; calls that cannot be captured are
//! refused by name.

use crate::quant_kernels::weights;
use crate::{assert_bits, down, filled, gpu, poisoned, up, Rng};
use cuda::{ActQ8, GgmlType, Tile};

#[test]
fn captured_graph_replays_with_new_inputs() {
    let Some(g) = gpu("graph replay") else { return };
    let mut rng = Rng::new(40);
    let (n_rows, n_cols, ty) = (300, 2048, GgmlType::Q4_K);
    let w = weights(ty, n_rows, n_cols, false, &mut rng);
    let rb = (w.len() / n_rows) as u64;
    let nw = rng.vec(n_rows, 1.5);
    let (dw, dnw) = (up(&g, &w), up(&g, &nw));
    let x = poisoned(&g, n_cols);
    let qs = filled::<i8>(&g, n_cols, 0);
    let (qd, qsum) = (poisoned(&g, n_cols / 32), filled::<i32>(&g, n_cols / 32, 0));
    let q = ActQ8 {
        qs: qs.ptr(),
        d: qd.ptr(),
        sums: qsum.ptr(),
    };
    let y = poisoned(&g, n_rows);
    let best = filled::<i32>(&g, 1, 0xff);
    let scratch = filled::<u32>(&g, cuda::argmax_scratch_words(n_rows, 1), 0);

    g.begin_capture().unwrap();
    g.quantize_act(x.ptr(), 1, n_cols, q).unwrap();
    g.matvec(ty, dw.ptr(), rb, n_rows, n_cols, x.ptr(), q, 1, y.ptr())
        .unwrap();
    g.rms_norm(y.ptr(), 1, n_rows, dnw.ptr(), 1e-6, y.ptr(), ActQ8::NONE)
        .unwrap();
    g.argmax(y.ptr(), n_rows, best.ptr(), scratch.ptr())
        .unwrap();
    let graph = g.end_capture().unwrap();

    for round in 0..3 {
        let xv = rng.vec(n_cols, 1.0 + round as f32);
        g.copy_to_device(&xv, x.ptr()).unwrap();
        graph.launch(&g).unwrap();
        let xq = quant::quantize_act(&xv);
        let mut want = vec![0f32; n_rows];
        quant::matvec(ty, &w, n_cols, &xv, &xq, &mut want);
        model::math::rms_norm(&mut want, &nw, 1e-6);
        assert_bits(&down(&g, &y), &want, &format!("replay {round}"));
        let mut bi = 0;
        for (i, &v) in want.iter().enumerate() {
            if v > want[bi] {
                bi = i;
            }
        }
        assert_eq!(down(&g, &best)[0], bi as i32, "argmax, replay {round}");
    }
}

#[test]
fn routing_tiles_written_on_the_device_drive_the_experts() {
    let Some(g) = gpu("graph routing") else {
        return;
    };
    let mut rng = Rng::new(41);
    let (n_exp, k, ff, e, ty) = (64, 8, 256, 512, GgmlType::Q4_K);
    let gate_w = weights(ty, n_exp * ff, e, false, &mut rng);
    let rb = (gate_w.len() / (n_exp * ff)) as u64;
    let router = weights(GgmlType::F32, n_exp, e, false, &mut rng);
    let (dg, dr) = (up(&g, &gate_w), up(&g, &router));
    let x = poisoned(&g, e);
    let qs = filled::<i8>(&g, e, 0);
    let (qd, qsum) = (poisoned(&g, e / 32), filled::<i32>(&g, e / 32, 0));
    let q = ActQ8 {
        qs: qs.ptr(),
        d: qd.ptr(),
        sums: qsum.ptr(),
    };
    let logits = poisoned(&g, n_exp);
    let (wts, ids) = (poisoned(&g, k), filled::<i32>(&g, k, 0xff));
    let (tgu, tdown) = (filled::<Tile>(&g, k, 0), filled::<Tile>(&g, k, 0));
    let gate_out = poisoned(&g, k * ff);

    g.begin_capture().unwrap();
    g.matvec(
        GgmlType::F32,
        dr.ptr(),
        (e * 4) as u64,
        n_exp,
        e,
        x.ptr(),
        ActQ8::NONE,
        1,
        logits.ptr(),
    )
    .unwrap();
    g.route_topk(
        logits.ptr(),
        1,
        n_exp,
        k,
        wts.ptr(),
        ids.ptr(),
        tgu.ptr(),
        tdown.ptr(),
    )
    .unwrap();
    g.quantize_act(x.ptr(), 1, e, q).unwrap();
    g.matvec_tiles(
        ty,
        dg.ptr(),
        ff as u64 * rb,
        rb,
        ff,
        e,
        x.ptr(),
        q,
        tgu.ptr(),
        k,
        gate_out.ptr(),
    )
    .unwrap();
    let graph = g.end_capture().unwrap();

    for round in 0..2 {
        let xv = rng.vec(e, 2.0);
        g.copy_to_device(&xv, x.ptr()).unwrap();
        graph.launch(&g).unwrap();
        let mut lg = vec![0f32; n_exp];
        quant::matvec(
            GgmlType::F32,
            &router,
            e,
            &xv,
            &quant::ActQ8::default(),
            &mut lg,
        );
        let routes = model::moe::route(&lg, k);
        let xq = quant::quantize_act(&xv);
        let mut want = vec![0f32; k * ff];
        for (r, &(ex, _)) in routes.iter().enumerate() {
            let m = &gate_w[ex * ff * rb as usize..(ex + 1) * ff * rb as usize];
            quant::matvec(ty, m, e, &xv, &xq, &mut want[r * ff..(r + 1) * ff]);
        }
        let want_ids: Vec<i32> = routes.iter().map(|r| r.0 as i32).collect();
        assert_eq!(down(&g, &ids), want_ids, "routing, replay {round}");
        assert_bits(
            &down(&g, &gate_out),
            &want,
            &format!("expert gates, replay {round}"),
        );
    }
}

#[test]
fn attention_graph_follows_the_position_on_the_device() {
    let Some(g) = gpu("graph attention") else {
        return;
    };
    let mut rng = Rng::new(42);
    let (nh, nkv, hd, n_rot, n_ctx) = (8, 2, 128, 64, 512);
    let rope = crate::attention::rope_table(n_ctx, n_rot, 1e6);
    let (qn, kn) = (rng.vec(hd, 1.5), rng.vec(hd, 1.5));
    let (drope, dqn, dkn) = (up(&g, &rope), up(&g, &qn), up(&g, &kn));
    let q_stride = 2 * hd;
    let (q_raw, k_raw, v_raw) = (
        poisoned(&g, nh * q_stride),
        poisoned(&g, nkv * hd),
        poisoned(&g, nkv * hd),
    );
    let pos = filled::<i32>(&g, 1, 0);
    let sb = g.attn_scratch_bytes(1, nh, nkv, hd, n_ctx);
    let scratch = poisoned(&g, (sb as usize / 4).max(1));
    let sp = if sb > 0 { scratch.ptr() } else { 0 };
    // Graph and direct calls each on their own caches, from the same history.
    let history = rng.vec(n_ctx * nkv * hd, 1.0);
    let (kc_g, vc_g) = (up(&g, &history), up(&g, &history));
    let (kc_d, vc_d) = (up(&g, &history), up(&g, &history));
    let (q_g, out_g) = (poisoned(&g, nh * hd), poisoned(&g, nh * hd));
    let (q_d, out_d) = (poisoned(&g, nh * hd), poisoned(&g, nh * hd));
    let step = |kc: u64, vc: u64, qo: u64, out: u64| {
        g.attn_prep(
            q_raw.ptr(),
            k_raw.ptr(),
            v_raw.ptr(),
            1,
            pos.ptr(),
            nh,
            nkv,
            hd,
            q_stride,
            dqn.ptr(),
            dkn.ptr(),
            1e-6,
            &cuda::Rotary::plain(drope.ptr(), n_rot),
            kc,
            vc,
            qo,
            0,
        )
        .unwrap();
        g.attn_core(
            qo,
            1,
            pos.ptr(),
            nh,
            nkv,
            hd,
            kc,
            vc,
            n_ctx,
            q_raw.ptr(),
            q_stride,
            out,
            sp,
            ActQ8::NONE,
            0,
        )
        .unwrap();
    };
    g.begin_capture().unwrap();
    step(kc_g.ptr(), vc_g.ptr(), q_g.ptr(), out_g.ptr());
    let graph = g.end_capture().unwrap();
    for p in [3i32, 4, 300] {
        g.copy_to_device(&[p], pos.ptr()).unwrap();
        g.copy_to_device(&rng.vec(nh * q_stride, 2.0), q_raw.ptr())
            .unwrap();
        g.copy_to_device(&rng.vec(nkv * hd, 2.0), k_raw.ptr())
            .unwrap();
        g.copy_to_device(&rng.vec(nkv * hd, 2.0), v_raw.ptr())
            .unwrap();
        graph.launch(&g).unwrap();
        step(kc_d.ptr(), vc_d.ptr(), q_d.ptr(), out_d.ptr());
        assert_bits(
            &down(&g, &out_g),
            &down(&g, &out_d),
            &format!("attention at {p}: graph vs direct"),
        );
        assert_bits(
            &down(&g, &kc_g),
            &down(&g, &kc_d),
            &format!("k cache at {p}"),
        );
        let kc = down(&g, &kc_g);
        let row = &kc[p as usize * nkv * hd..(p as usize + 1) * nkv * hd];
        let old = &history[p as usize * nkv * hd..(p as usize + 1) * nkv * hd];
        assert!(
            row.iter().zip(old).any(|(a, b)| a.to_bits() != b.to_bits()),
            "position {p} written"
        );
    }
}

#[test]
fn calls_that_cannot_be_captured_are_refused() {
    let Some(g) = gpu("capture refusals") else {
        return;
    };
    let b = g.alloc::<f32>(16, "buffer").unwrap();
    g.begin_capture().unwrap();
    let e = g.alloc::<f32>(16, "scratch").unwrap_err().to_string();
    assert!(
        e.contains("allocating scratch") && e.contains("captured"),
        "{e}"
    );
    let e = g
        .copy_to_device(&[1f32; 16], b.ptr())
        .unwrap_err()
        .to_string();
    assert!(e.contains("copy_to_device"), "{e}");
    let e = g.download::<f32>(b.ptr(), 16).unwrap_err().to_string();
    assert!(e.contains("download"), "{e}");
    g.memset(b.ptr(), 0, b.bytes()).unwrap();
    let graph = g.end_capture().unwrap();
    g.copy_to_device(&[2f32; 16], b.ptr()).unwrap();
    graph.launch(&g).unwrap();
    assert_eq!(down(&g, &b), vec![0f32; 16]);
    assert!(g.end_capture().is_err());
}

#[test]
fn out_of_memory_names_the_allocation() {
    let Some(g) = gpu("out of memory") else {
        return;
    };
    let (_, total) = g.mem_info().unwrap();
    let e = g
        .alloc::<u8>(2 * total as usize, "an impossible cache")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("out of device memory allocating") && e.contains("an impossible cache"),
        "{e}"
    );
    assert!(!g.name().is_empty());
}

#[test]
fn published_words_reach_the_host_from_a_replayed_graph() {
    let Some(g) = gpu("publish words") else {
        return;
    };
    let mut rng = Rng::new(41);
    let (n_a, n_b) = (20, 2048);
    let a = filled::<i32>(&g, n_a, 0);
    let b = poisoned(&g, n_b);
    // The words land after the head the launcher names (the kernel writes there).
    let head = cuda::PUBLISH_HEAD_WORDS;
    let mut mailbox = g.alloc_pinned(4 * (head + n_a + n_b)).unwrap();
    g.begin_capture().unwrap();
    g.publish_words(a.ptr(), n_a, b.ptr(), n_b, mailbox.dev_ptr())
        .unwrap();
    let graph = g.end_capture().unwrap();
    // New words each round, read as soon as the flag is up (no synchronisation):
    // every word is this round's, never the last round's.
    for round in 0..4 {
        let av: Vec<i32> = (0..n_a).map(|_| rng.below(512) as i32).collect();
        let bv = rng.vec(n_b, 1.0 + round as f32);
        g.copy_to_device(&av, a.ptr()).unwrap();
        g.copy_to_device(&bv, b.ptr()).unwrap();
        graph.launch(&g).unwrap();
        assert_eq!(g.wait_word(&mailbox, 0, "the words").unwrap(), 1);
        let words: Vec<u32> = mailbox.as_slice()[4 * head..4 * (head + n_a + n_b)]
            .chunks_exact(4)
            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let want: Vec<u32> = av
            .iter()
            .map(|&v| v as u32)
            .chain(bv.iter().map(|v| v.to_bits()))
            .collect();
        assert_eq!(words, want, "round {round}");
        mailbox.store_word(0, 0);
    }
    // A stream that ends without setting the word is an error, not a hang.
    g.sync().unwrap();
    let err = g.wait_word(&mailbox, 0, "the words").unwrap_err();
    assert!(err.to_string().contains("without the words"), "{err}");
}
