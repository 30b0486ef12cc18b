//! rms_norm, dot_rows, add, scale, scale_tile_rows, swiglu, argmax, route_topk and
//! moe_combine against the CPU (model::math, model::moe, the engine's MoE combination
//! and second-level scales), bit for bit.

use crate::{assert_bits, down, filled, gpu, poisoned, up, QOut, Rng};
use cuda::{ActQ8, Tile};

#[test]
fn rms_norm_matches_model_math() {
    let Some(g) = gpu("rms_norm") else { return };
    let mut rng = Rng::new(10);
    for (rows, cols) in [(1, 2048), (5, 4096), (3, 100), (70, 128)] {
        let x = rng.vec(rows * cols, 3.0);
        let w = rng.vec(cols, 2.0);
        let mut want = x.clone();
        for r in want.chunks_exact_mut(cols) {
            model::math::rms_norm(r, &w, 1e-6);
        }
        let (dx, dw) = (up(&g, &x), up(&g, &w));
        let out = poisoned(&g, rows * cols);
        g.rms_norm(dx.ptr(), rows, cols, dw.ptr(), 1e-6, out.ptr(), ActQ8::NONE)
            .unwrap();
        assert_bits(&down(&g, &out), &want, &format!("rms_norm {rows}×{cols}"));
        // In place.
        g.rms_norm(dx.ptr(), rows, cols, dw.ptr(), 1e-6, dx.ptr(), ActQ8::NONE)
            .unwrap();
        assert_bits(
            &down(&g, &dx),
            &want,
            &format!("rms_norm in place {rows}×{cols}"),
        );
    }
}

#[test]
fn add_rms_norm_equals_add_then_rms_norm() {
    let Some(g) = gpu("add_rms_norm") else { return };
    let mut rng = Rng::new(16);
    for (rows, cols) in [(1, 2048), (7, 4096), (2, 96)] {
        let (x, y) = (rng.vec(rows * cols, 3.0), rng.vec(rows * cols, 3.0));
        let w = rng.vec(cols, 2.0);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        let mut want = sum.clone();
        for r in want.chunks_exact_mut(cols) {
            model::math::rms_norm(r, &w, 1e-6);
        }
        let (dx, dy, dw) = (up(&g, &x), up(&g, &y), up(&g, &w));
        let out = poisoned(&g, rows * cols);
        g.add_rms_norm(
            dx.ptr(),
            dy.ptr(),
            rows,
            cols,
            dw.ptr(),
            1e-6,
            out.ptr(),
            ActQ8::NONE,
        )
        .unwrap();
        assert_bits(
            &down(&g, &dx),
            &sum,
            &format!("add_rms_norm sum {rows}×{cols}"),
        );
        assert_bits(
            &down(&g, &out),
            &want,
            &format!("add_rms_norm {rows}×{cols}"),
        );
    }
}

/// A norm that also writes its output's quantized copy gives quantize_act's blocks
/// of the CPU's norm output, and the same output as without it.
#[test]
fn norms_quantize_their_output_like_quantize_act() {
    let Some(g) = gpu("rms_norm with quantized copy") else {
        return;
    };
    let mut rng = Rng::new(17);
    for (rows, cols, add) in [
        (1, 2048, false),
        (1, 2048, true),
        (5, 4096 + 32, true),
        (3, 96, false),
    ] {
        let (x, y) = (rng.vec(rows * cols, 3.0), rng.vec(rows * cols, 3.0));
        let w = rng.vec(cols, 2.0);
        let mut want = if add {
            x.iter().zip(&y).map(|(a, b)| a + b).collect()
        } else {
            x.clone()
        };
        for r in want.chunks_exact_mut(cols) {
            model::math::rms_norm(r, &w, 1e-6);
        }
        let (dx, dy, dw) = (up(&g, &x), up(&g, &y), up(&g, &w));
        let out = poisoned(&g, rows * cols);
        let qo = QOut::new(&g, rows * cols);
        let q = qo.q();
        if add {
            g.add_rms_norm(dx.ptr(), dy.ptr(), rows, cols, dw.ptr(), 1e-6, out.ptr(), q)
                .unwrap();
        } else {
            g.rms_norm(dx.ptr(), rows, cols, dw.ptr(), 1e-6, out.ptr(), q)
                .unwrap();
        }
        let what = format!("norm add={add} {rows}×{cols}");
        assert_bits(&down(&g, &out), &want, &what);
        qo.assert_quantizes(&g, &want, cols, &what);
    }
    // A row that is not whole blocks cannot be quantized: refused by name.
    let b = poisoned(&g, 100);
    let e = g
        .rms_norm(
            b.ptr(),
            1,
            100,
            b.ptr(),
            1e-6,
            b.ptr(),
            ActQ8 {
                qs: b.ptr(),
                d: b.ptr(),
                sums: b.ptr(),
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("rms_norm"), "{e}");
}

#[test]
fn dot_rows_matches_model_math_dot() {
    let Some(g) = gpu("dot_rows") else { return };
    let mut rng = Rng::new(11);
    for (rows, n) in [(1, 2048), (9, 4096), (4, 77)] {
        let x = rng.vec(rows * n, 2.0);
        let v = rng.vec(n, 1.0);
        let want: Vec<f32> = x.chunks_exact(n).map(|r| model::math::dot(r, &v)).collect();
        let (dx, dv) = (up(&g, &x), up(&g, &v));
        let out = poisoned(&g, rows);
        g.dot_rows(dx.ptr(), dv.ptr(), rows, n, out.ptr()).unwrap();
        assert_bits(&down(&g, &out), &want, &format!("dot_rows {rows}×{n}"));
    }
}

#[test]
fn add_and_swiglu_match_the_cpu() {
    let Some(g) = gpu("add, swiglu") else { return };
    let mut rng = Rng::new(12);
    for n in [1, 1000, 2048 * 9 + 5] {
        let (a, b) = (rng.vec(n, 30.0), rng.vec(n, 30.0));
        let (da, db) = (up(&g, &a), up(&g, &b));
        g.add(da.ptr(), db.ptr(), n).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_bits(&down(&g, &da), &want, &format!("add {n}"));

        // SiLU over its whole range, including where e^-x overflows.
        let mut gate = rng.vec(n, 30.0);
        if n > 4 {
            gate[0] = -100.0;
            gate[1] = 100.0;
            gate[2] = 0.0;
            gate[3] = -0.0;
        }
        let (dg, db) = (up(&g, &gate), up(&g, &b));
        let out = poisoned(&g, n);
        g.swiglu(dg.ptr(), db.ptr(), n, out.ptr()).unwrap();
        let want: Vec<f32> = gate
            .iter()
            .zip(&b)
            .map(|(&x, &u)| model::math::silu(x) * u)
            .collect();
        assert_bits(&down(&g, &out), &want, &format!("swiglu {n}"));
    }
}

/// Second-level scales: `scale` over a whole product, `scale_tile_rows` over the
/// rows tiles wrote (by the tile's expert, or by route), the rows no tile names left
/// as they were; one f32 multiplication a value, as the CPU's `apply_scale`.
#[test]
fn scales_match_the_cpus_multiplication() {
    let Some(g) = gpu("scale, scale_tile_rows") else {
        return;
    };
    let mut rng = Rng::new(13);
    for n in [1, 1000, 2048 * 9 + 5] {
        let x = rng.vec(n, 30.0);
        let s = rng.f() * 3.0;
        let dx = up(&g, &x);
        g.scale(dx.ptr(), n, s).unwrap();
        let want: Vec<f32> = x.iter().map(|v| v * s).collect();
        assert_bits(&down(&g, &dx), &want, &format!("scale {n}"));
    }
    let (rows, cols, n_expert) = (37, 96, 5);
    let x = rng.vec(rows * cols, 30.0);
    let per_expert = rng.vec(n_expert, 2.0);
    let per_route = rng.vec(rows, 2.0);
    // Tiles of up to 8 rows, some empty, row 36 in none.
    let mut tiles = Vec::new();
    let mut r = 0;
    while r < rows - 1 {
        let n = (1 + rng.below(8)).min(rows - 1 - r);
        let mut t = Tile {
            expert: rng.below(n_expert) as i32,
            n: n as i32,
            in_row: [-1; 8],
            out_row: [-1; 8],
        };
        for j in 0..n {
            t.out_row[j] = (r + j) as i32;
        }
        tiles.push(t);
        tiles.push(Tile::default());
        r += n;
    }
    let (de, dr, dt) = (up(&g, &per_expert), up(&g, &per_route), up(&g, &tiles));
    for by_route in [false, true] {
        let dx = up(&g, &x);
        let route = if by_route { dr.ptr() } else { 0 };
        g.scale_tile_rows(dx.ptr(), cols, dt.ptr(), tiles.len(), de.ptr(), route)
            .unwrap();
        let mut want = x.clone();
        for t in &tiles {
            for &row in &t.out_row[..t.n as usize] {
                let row = row as usize;
                let s = if by_route {
                    per_route[row]
                } else {
                    per_expert[t.expert as usize]
                };
                for v in &mut want[row * cols..(row + 1) * cols] {
                    *v *= s;
                }
            }
        }
        assert_bits(
            &down(&g, &dx),
            &want,
            &format!("scale_tile_rows by route {by_route}"),
        );
    }
}

/// engine::sampler::argmax (the engine is not a dependency of this crate).
fn cpu_argmax(l: &[f32]) -> i32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in l.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as i32
}

#[test]
fn argmax_is_the_greedy_choice() {
    let Some(g) = gpu("argmax") else { return };
    let mut rng = Rng::new(13);
    let n = 248_320;
    let mut cases: Vec<Vec<f32>> = Vec::new();
    let x = rng.vec(n, 20.0);
    cases.push(x.clone());
    // Ties at the maximum: the lowest index wins.
    let mut t = x.clone();
    t[200_000] = 50.0;
    t[123_457] = 50.0;
    t[240_000] = 50.0;
    cases.push(t);
    // NaN never wins, even first.
    let mut t = x.clone();
    t[0] = f32::NAN;
    t[99] = f32::NAN;
    t[5] = 60.0;
    cases.push(t);
    // Everything -inf or NaN: 0.
    let mut t = vec![f32::NEG_INFINITY; 1000];
    t[3] = f32::NAN;
    cases.push(t);
    // +inf wins.
    let mut t = x.clone();
    t[777] = f32::INFINITY;
    cases.push(t);
    cases.push(vec![-3.0]);
    for (i, c) in cases.iter().enumerate() {
        let dx = up(&g, c);
        let out = filled::<i32>(&g, 1, 0xff);
        let scratch = filled::<u32>(&g, cuda::argmax_scratch_words(c.len(), 1), 0);
        g.argmax(dx.ptr(), c.len(), out.ptr(), scratch.ptr())
            .unwrap();
        assert_eq!(down(&g, &out)[0], cpu_argmax(c), "argmax case {i}");
    }
    // The full-size cases as rows of one launch, twice over one scratch.
    let rows: Vec<&Vec<f32>> = cases.iter().filter(|c| c.len() == n).collect();
    let flat: Vec<f32> = rows.iter().flat_map(|c| c.iter().copied()).collect();
    let dx = up(&g, &flat);
    let scratch = filled::<u32>(&g, cuda::argmax_scratch_words(n, rows.len()), 0);
    for call in 0..2 {
        let out = filled::<i32>(&g, rows.len(), 0xff);
        g.argmax_rows(dx.ptr(), n, rows.len(), out.ptr(), scratch.ptr())
            .unwrap();
        let want: Vec<i32> = rows.iter().map(|c| cpu_argmax(c)).collect();
        assert_eq!(down(&g, &out), want, "argmax_rows, call {call}");
    }
}

#[test]
fn route_topk_matches_model_moe_route() {
    let Some(g) = gpu("route_topk") else { return };
    let mut rng = Rng::new(14);
    for (n_expert, k, n_tok) in [
        (8, 2, 3),
        (128, 8, 5),
        (512, 10, 1),
        (512, 10, 7),
        (256, 8, 1),
        (64, 32, 2),
    ] {
        let mut logits = rng.vec(n_tok * n_expert, 4.0);
        // Exact ties between experts, and a token whose logits are all equal.
        logits[1] = logits[n_expert - 1];
        logits[2] = logits[n_expert - 1];
        if n_tok > 1 {
            logits[n_expert..2 * n_expert].fill(0.25);
        }
        let dl = up(&g, &logits);
        let w = poisoned(&g, n_tok * k);
        let ids = filled::<i32>(&g, n_tok * k, 0xff);
        let tiles =
            (n_tok == 1).then(|| (filled::<Tile>(&g, k, 0xff), filled::<Tile>(&g, k, 0xff)));
        let (tg, td) = tiles.as_ref().map_or((0, 0), |(a, b)| (a.ptr(), b.ptr()));
        g.route_topk(dl.ptr(), n_tok, n_expert, k, w.ptr(), ids.ptr(), tg, td)
            .unwrap();
        let (gw, gi) = (down(&g, &w), down(&g, &ids));
        for t in 0..n_tok {
            let r = model::moe::route(&logits[t * n_expert..(t + 1) * n_expert], k);
            let want_ids: Vec<i32> = r.iter().map(|x| x.0 as i32).collect();
            let want_w: Vec<f32> = r.iter().map(|x| x.1).collect();
            assert_eq!(
                &gi[t * k..(t + 1) * k],
                &want_ids[..],
                "ids, {n_expert} experts top-{k} token {t}"
            );
            assert_bits(
                &gw[t * k..(t + 1) * k],
                &want_w,
                &format!("weights, {n_expert} experts top-{k} token {t}"),
            );
        }
        if let Some((a, b)) = &tiles {
            let (ta, tb) = (down(&g, a), down(&g, b));
            for r in 0..k {
                let mut want = Tile {
                    expert: gi[r],
                    n: 1,
                    ..Default::default()
                };
                want.out_row[0] = r as i32;
                assert_eq!(ta[r], want, "gate/up tile {r}");
                want.in_row[0] = r as i32;
                assert_eq!(tb[r], want, "down tile {r}");
            }
        }
    }
}

#[test]
fn moe_combine_sums_in_rank_order() {
    let Some(g) = gpu("moe_combine") else { return };
    let mut rng = Rng::new(15);
    for (n_tok, k, e, shared, logit) in [
        (1, 8, 2048, true, true),
        (6, 10, 512, false, false),
        (3, 4, 100, true, false),
    ] {
        let down_v = rng.vec(n_tok * k * e, 5.0);
        let wts: Vec<f32> = (0..n_tok * k).map(|_| 0.5 * (rng.f() + 1.0)).collect();
        let sh = rng.vec(n_tok * e, 5.0);
        let lg = rng.vec(n_tok, 6.0);
        // The CPU's combination (engine/src/cpu/moe.rs): o += w·d from 0.0 in rank
        // order, then o += sigmoid(logit)·shared.
        let mut want = vec![0f32; n_tok * e];
        for t in 0..n_tok {
            let o = &mut want[t * e..(t + 1) * e];
            for r in 0..k {
                let wt = wts[t * k + r];
                for (c, a) in o.iter_mut().enumerate() {
                    *a += wt * down_v[(t * k + r) * e + c];
                }
            }
            if shared {
                let gate = if logit {
                    model::math::sigmoid(lg[t])
                } else {
                    1.0
                };
                for (c, a) in o.iter_mut().enumerate() {
                    *a = if logit {
                        *a + gate * sh[t * e + c]
                    } else {
                        *a + sh[t * e + c]
                    };
                }
            }
        }
        let (dd, dw, ds, dlg) = (up(&g, &down_v), up(&g, &wts), up(&g, &sh), up(&g, &lg));
        let out = poisoned(&g, n_tok * e);
        g.moe_combine(
            dd.ptr(),
            dw.ptr(),
            n_tok,
            k,
            e,
            if shared { ds.ptr() } else { 0 },
            if logit { dlg.ptr() } else { 0 },
            out.ptr(),
        )
        .unwrap();
        assert_bits(
            &down(&g, &out),
            &want,
            &format!("moe_combine {n_tok}×{k}×{e} shared={shared} logit={logit}"),
        );
    }
}

#[test]
fn shared_math_matches_model_math_and_the_pinned_tables() {
    let Some(g) = gpu("scoria_math.cuh") else {
        return;
    };
    // The pinned tables of model::math.
    let xs: Vec<f32> = model::math::PINNED
        .iter()
        .map(|p| f32::from_bits(p.x))
        .collect();
    let out = poisoned(&g, 5 * xs.len());
    let dx = up(&g, &xs);
    g.math_probe(dx.ptr(), xs.len(), out.ptr()).unwrap();
    let got = down(&g, &out);
    let n = xs.len();
    for (i, p) in model::math::PINNED.iter().enumerate() {
        let x = xs[i];
        assert_eq!(got[i].to_bits(), p.exp, "sc_exp({x:e})");
        assert_eq!(got[n + i].to_bits(), p.sigmoid, "sc_sigmoid({x:e})");
        assert_eq!(got[2 * n + i].to_bits(), p.silu, "sc_silu({x:e})");
        assert_eq!(got[3 * n + i].to_bits(), p.softplus, "sc_softplus({x:e})");
    }
    let xs: Vec<f32> = model::math::PINNED_LN_1P
        .iter()
        .map(|p| f32::from_bits(p.0))
        .collect();
    let out = poisoned(&g, 5 * xs.len());
    let dx = up(&g, &xs);
    g.math_probe(dx.ptr(), xs.len(), out.ptr()).unwrap();
    let got = down(&g, &out);
    for (i, p) in model::math::PINNED_LN_1P.iter().enumerate() {
        assert_eq!(
            got[4 * xs.len() + i].to_bits(),
            p.1,
            "sc_log1p({:e})",
            xs[i]
        );
    }
    // A sweep: every 9973rd f32 of [-110, 110] and of (-1, 4] (denser near 0, as f32
    // are), and uniform values, against model::math.
    let mut xs = Vec::new();
    for (lo, hi) in [(-110.0f32, 110.0f32), (-0.999_999_9, 4.0)] {
        // Bit patterns from -0 down to lo, and from +0 up to hi.
        for (start, end) in [(0x8000_0000u32, lo.to_bits()), (0, hi.to_bits())] {
            let mut b = start;
            while b <= end {
                xs.push(f32::from_bits(b));
                b += 9973;
            }
        }
    }
    let mut rng = Rng::new(17);
    xs.extend((0..100_000).map(|_| rng.f() * 30.0));
    let out = poisoned(&g, 5 * xs.len());
    let dx = up(&g, &xs);
    g.math_probe(dx.ptr(), xs.len(), out.ptr()).unwrap();
    let got = down(&g, &out);
    let n = xs.len();
    type Unary = fn(f32) -> f32;
    let f: [(&str, Unary); 5] = [
        ("exp", model::math::exp),
        ("sigmoid", model::math::sigmoid),
        ("silu", model::math::silu),
        ("softplus", model::math::softplus),
        ("ln_1p", model::math::ln_1p),
    ];
    for (k, (name, func)) in f.iter().enumerate() {
        let want: Vec<f32> = xs.iter().map(|&x| func(x)).collect();
        // ln_1p below -1 is NaN, whose bits are not specified.
        let keep: Vec<usize> = (0..n).filter(|&i| !want[i].is_nan()).collect();
        let g1: Vec<f32> = keep.iter().map(|&i| got[k * n + i]).collect();
        let w1: Vec<f32> = keep.iter().map(|&i| want[i]).collect();
        assert_bits(&g1, &w1, &format!("sc_{name} vs model::math::{name}"));
    }
}
