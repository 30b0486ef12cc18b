//! The image encoder's kernels (vision.cu) against f64 references on random data:
//! within a tolerance for the products and norms, bit for bit for the rotary step and
//! the learned positions (the CPU encoder's operations in its order).

use crate::{assert_bits, down, gpu, poisoned, softmax_f64, up, Rng};
use cuda::{DevBuf, Gpu, VisEpilogue, VisWeight};
use half::f16;

/// Weights on the device as vis_linear takes them, and the values they stand for.
struct W {
    hi: DevBuf<u16>,
    lo: Option<DevBuf<u16>>,
    bias: DevBuf<f32>,
    n_in: usize,
    n_out: usize,
    /// The weights as the product should see them.
    w: Vec<f32>,
    b: Vec<f32>,
}

impl W {
    /// Random `[n_out][n_in]` weights: f16 values when `f16_only`, else f32 values
    /// split into hi and lo.
    fn new(g: &Gpu, rng: &mut Rng, n_in: usize, n_out: usize, f16_only: bool) -> W {
        let mut w = rng.vec(n_in * n_out, 0.5);
        if f16_only {
            for v in &mut w {
                *v = f16::from_f32(*v).to_f32();
            }
        }
        let hi: Vec<u16> = w.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        let lo: Vec<u16> = w
            .iter()
            .zip(&hi)
            .map(|(&v, &h)| f16::from_f32(v - f16::from_bits(h).to_f32()).to_bits())
            .collect();
        let b = rng.vec(n_out, 1.0);
        W {
            hi: up(g, &hi),
            lo: (!f16_only).then(|| up(g, &lo)),
            bias: up(g, &b),
            n_in,
            n_out,
            w,
            b,
        }
    }

    fn dev(&self) -> VisWeight {
        VisWeight {
            hi: self.hi.ptr(),
            lo: self.lo.as_ref().map_or(0, |l| l.ptr()),
            bias: self.bias.ptr(),
            n_in: self.n_in,
            n_out: self.n_out,
        }
    }
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// erf to ~1e-7 (Abramowitz–Stegun 7.1.26 is too coarse; a series is enough here).
fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 4.0 {
        let (mut term, mut sum) = (a, a);
        for k in 1..200 {
            term *= -a * a / k as f64;
            sum += term / (2 * k + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        1.0
    };
    r.copysign(x)
}

#[test]
fn vis_linear_matches_f64_products() {
    let Some(g) = gpu("vis_linear") else { return };
    let mut rng = Rng::new(71);
    let cases = [
        (1, 64, 8, true, VisEpilogue::Store),
        (130, 1152, 200, true, VisEpilogue::Store),
        (129, 4304, 136, true, VisEpilogue::Add),
        (37, 24, 300, false, VisEpilogue::Store),
        (200, 256, 129, false, VisEpilogue::GeluTanh),
        (64, 512, 64, true, VisEpilogue::GeluErf),
    ];
    for (n_tok, n_in, n_out, f16_only, epi) in cases {
        let w = W::new(&g, &mut rng, n_in, n_out, f16_only);
        let x = rng.vec(n_tok * n_in, 3.0);
        let y0 = rng.vec(n_tok * n_out, 2.0);
        let dx = up(&g, &x);
        let y = if epi == VisEpilogue::Add {
            up(&g, &y0)
        } else {
            poisoned(&g, n_tok * n_out)
        };
        g.vis_linear(dx.ptr(), n_tok, &w.dev(), y.ptr(), epi)
            .unwrap();
        let got = down(&g, &y);
        let what = format!("vis_linear {n_tok}×{n_in}→{n_out} f16 {f16_only} {epi:?}");
        let mut worst = 0.0f64;
        for t in 0..n_tok {
            for o in 0..n_out {
                let (mut s, mut mag) = (w.b[o] as f64, w.b[o].abs() as f64);
                for k in 0..n_in {
                    let p = w.w[o * n_in + k] as f64 * x[t * n_in + k] as f64;
                    s += p;
                    mag += p.abs();
                }
                let want = match epi {
                    VisEpilogue::Store => s,
                    VisEpilogue::GeluTanh => gelu_tanh(s),
                    VisEpilogue::GeluErf => 0.5 * s * (1.0 + erf(s / std::f64::consts::SQRT_2)),
                    VisEpilogue::Add => y0[t * n_out + o] as f64 + s,
                };
                let err = (got[t * n_out + o] as f64 - want).abs() / (mag + 1e-30);
                assert!(
                    err < 2e-5,
                    "{what}: ({t}, {o}) got {} want {want} (error {err:e} of Σ|w·x| {mag})",
                    got[t * n_out + o]
                );
                worst = worst.max(err);
            }
        }
        eprintln!("{what}: worst error {worst:e} of Σ|w·x|");
    }
}

#[test]
fn vis_attention_matches_f64_softmax() {
    let Some(g) = gpu("vis_attention") else {
        return;
    };
    let mut rng = Rng::new(72);
    for (n, hd, heads) in [
        (1, 16, 2),
        (33, 16, 4),
        (200, 72, 3),
        (70, 80, 2),
        (129, 64, 1),
    ] {
        let h = hd * heads;
        let qkv = rng.vec(n * 3 * h, 1.5);
        let d = up(&g, &qkv);
        let out = poisoned(&g, n * h);
        g.vis_attention(d.ptr(), n, 0, n, h, hd, out.ptr()).unwrap();
        let got = down(&g, &out);
        // The queries in ranges of 37 give the same bits, and write only their own rows
        // (the row past a range stays poisoned).
        for q0 in (0..n).step_by(37) {
            let nq = 37.min(n - q0);
            let part = poisoned(&g, (nq + 1) * h);
            g.vis_attention(d.ptr(), n, q0, nq, h, hd, part.ptr())
                .unwrap();
            let p = down(&g, &part);
            assert!(
                p[..nq * h]
                    .iter()
                    .zip(&got[q0 * h..(q0 + nq) * h])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "vis_attention n {n} hd {hd}: queries {q0}..+{nq} differ from the whole run"
            );
            let pad = &p[nq * h..];
            assert!(
                pad.iter().all(|v| v.is_nan()),
                "vis_attention n {n} hd {hd}: queries {q0}..+{nq} wrote past their rows"
            );
        }
        assert!(g.vis_attention(d.ptr(), n, n, 1, h, hd, out.ptr()).is_err());
        let scale = 1.0 / (hd as f64).sqrt();
        for i in 0..n {
            for hh in 0..heads {
                let q = &qkv[i * 3 * h + hh * hd..][..hd];
                let keys = (0..n).map(|j| &qkv[j * 3 * h + h + hh * hd..][..hd]);
                let w = softmax_f64(q, keys, scale);
                for dd in 0..hd {
                    let want: f64 = (0..n)
                        .map(|j| w[j] * qkv[j * 3 * h + 2 * h + hh * hd + dd] as f64)
                        .sum::<f64>();
                    let gv = got[i * h + hh * hd + dd] as f64;
                    assert!(
                        (gv - want).abs() < 2e-5,
                        "vis_attention n {n} hd {hd}: row {i} head {hh} dim {dd}: {gv} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn vis_layernorm_matches_f64() {
    let Some(g) = gpu("vis_layernorm") else {
        return;
    };
    let mut rng = Rng::new(73);
    for (rows, d) in [(1, 64), (17, 1152), (5, 4608), (3, 100)] {
        let x: Vec<f32> = rng.vec(rows * d, 4.0).iter().map(|v| v + 3.0).collect();
        let (w, b) = (rng.vec(d, 2.0), rng.vec(d, 1.0));
        let (dx, dw, db) = (up(&g, &x), up(&g, &w), up(&g, &b));
        let y = poisoned(&g, rows * d);
        g.vis_layernorm(dx.ptr(), rows, d, dw.ptr(), db.ptr(), 1e-6, y.ptr())
            .unwrap();
        let got = down(&g, &y);
        for r in 0..rows {
            let xr = &x[r * d..][..d];
            let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
            let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (var + 1e-6).sqrt();
            for i in 0..d {
                let want = (xr[i] as f64 - mean) * inv * w[i] as f64 + b[i] as f64;
                let gv = got[r * d + i] as f64;
                assert!(
                    (gv - want).abs() < 1e-5 * (1.0 + want.abs()),
                    "vis_layernorm {rows}×{d}: ({r}, {i}) {gv} vs {want}"
                );
            }
        }
    }
}

#[test]
fn vis_rope_and_positions_are_the_cpu_steps_bit_for_bit() {
    let Some(g) = gpu("vis_rope") else { return };
    let mut rng = Rng::new(74);
    let (n, hd, heads) = (37, 72, 3);
    let h = hd * heads;
    let half = hd / 2;
    let qkv = rng.vec(n * 3 * h, 2.0);
    let (cos, sin) = (rng.vec(n * half, 1.0), rng.vec(n * half, 1.0));
    let mut want = qkv.clone();
    for i in 0..n {
        for head in want[i * 3 * h..][..2 * h].chunks_exact_mut(hd) {
            let (a, b) = head.split_at_mut(half);
            for j in 0..half {
                let (x, y, c, s) = (a[j], b[j], cos[i * half + j], sin[i * half + j]);
                a[j] = x * c - y * s;
                b[j] = y * c + x * s;
            }
        }
    }
    let (d, dc, ds) = (up(&g, &qkv), up(&g, &cos), up(&g, &sin));
    g.vis_rope(d.ptr(), n, h, hd, dc.ptr(), ds.ptr()).unwrap();
    assert_bits(&down(&g, &d), &want, "vis_rope");

    let side = 6;
    let pos = rng.vec(side * side * h, 1.0);
    let x = rng.vec(n * h, 1.0);
    let idx: Vec<i32> = (0..4 * n).map(|_| rng.below(side * side) as i32).collect();
    let wt = rng.vec(4 * n, 1.0);
    let mut want = x.clone();
    for i in 0..n {
        for t in 0..4 {
            let row = &pos[idx[4 * i + t] as usize * h..][..h];
            for (v, &e) in want[i * h..][..h].iter_mut().zip(row) {
                *v += wt[4 * i + t] * e;
            }
        }
    }
    let (dx, dp, di, dw) = (up(&g, &x), up(&g, &pos), up(&g, &idx), up(&g, &wt));
    g.vis_pos_add(dx.ptr(), n, h, dp.ptr(), di.ptr(), dw.ptr())
        .unwrap();
    assert_bits(&down(&g, &dx), &want, "vis_pos_add");
}
