//! What a matmul's last partial group of tokens costs at the AMX level: one thread,
//! a lone padded group of 16 (`amx16`), a padded group after a whole one
//! (`amx32 - amx16`), and 1..15 tokens on the AVX-512 kernels, for one expert-sized
//! matrix of each common type. The thresholds `AMX_MIN_TOKENS` and `AMX_MIN_TAIL` in
//! `src/lib.rs` come from it. Then one expert layer of a 512-token prompt on all
//! threads (256 Q4_K experts of 512 × 2048, each token routed to 8, as random routing
//! spreads them): the library's policy against tails below 12 tokens on the AVX-512
//! kernels (the policy before the thresholds above), alternated.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p scoria-quant --example tail_bench`

use quant::{GgmlType as T, Isa};
use rayon::prelude::*;
use std::time::{Duration, Instant};
fn lcg(s: &mut u64) -> u64 {
    *s = s
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *s >> 33
}
fn time_it(mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    let st = Instant::now();
    let mut n = 0;
    while n < 5 || st.elapsed() < Duration::from_millis(150) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        n += 1;
    }
    best
}
fn main() {
    for (ty, rows, cols) in [
        (T::Q4_K, 512usize, 2048usize),
        (T::Q6_K, 2048, 512),
        (T::Q8_0, 512, 2048),
    ] {
        let rb = quant::row_bytes(ty, cols).unwrap();
        let mut s = 5u64;
        let mut w = vec![0u8; rows * rb];
        let mut x = vec![0f32; cols];
        for r in 0..rows {
            for v in x.iter_mut() {
                *v = (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0;
            }
            quant::quantize_row(ty, &x, &mut w[r * rb..(r + 1) * rb]);
        }
        let xs: Vec<f32> = (0..cols * 32)
            .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let xqs: Vec<quant::ActQ8> = xs.chunks_exact(cols).map(quant::quantize_act).collect();
        let mut out = vec![0f32; rows * 32];
        let t = |isa: Isa, n: usize, out: &mut Vec<f32>| {
            time_it(|| {
                quant::matmul_with(
                    isa,
                    ty,
                    &w,
                    cols,
                    &xs[..n * cols],
                    &xqs[..n],
                    &mut out[..rows * n],
                )
            }) * 1e6
        };
        let a16 = t(Isa::Amx, 16, &mut out);
        let a32 = t(Isa::Amx, 32, &mut out);
        println!("{} {rows}x{cols}: amx16 {a16:.1} us, amx32 {a32:.1} us (a padded group after a full one: {:.1} us)", ty.name(), a32 - a16);
        for r in 1..16 {
            let v = t(Isa::Avx512, r, &mut out);
            println!(
                "   r={r:2}: avx512 {v:.1} us  {}",
                if v > a32 - a16 {
                    "AMX tail cheaper"
                } else {
                    ""
                }
            );
        }
    }
    expert_layer();
}

fn expert_layer() {
    let (ty, rows, cols, n_exp) = (T::Q4_K, 512usize, 2048usize, 256usize);
    let rb = quant::row_bytes(ty, cols).unwrap();
    let mut s = 5u64;
    let mut base = vec![0u8; 64 * rb];
    let mut x = vec![0f32; cols];
    for r in 0..64 {
        for v in x.iter_mut() {
            *v = (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0;
        }
        quant::quantize_row(ty, &x, &mut base[r * rb..(r + 1) * rb]);
    }
    // Each expert its own copy, so the layer reads 151 MB as a prompt does.
    let ws: Vec<Vec<u8>> = (0..n_exp)
        .map(|_| {
            (0..rows)
                .flat_map(|r| base[(r % 64) * rb..(r % 64 + 1) * rb].to_vec())
                .collect()
        })
        .collect();
    let mut counts = vec![0usize; n_exp];
    for _ in 0..512 {
        let mut chosen: Vec<usize> = Vec::new();
        while chosen.len() < 8 {
            let e = (lcg(&mut s) % n_exp as u64) as usize;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for e in chosen {
            counts[e] += 1;
        }
    }
    let most = counts.iter().copied().max().unwrap_or(0);
    let xs: Vec<f32> = (0..cols * most)
        .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let xqs: Vec<quant::ActQ8> = xs.chunks_exact(cols).map(quant::quantize_act).collect();
    let layer = |library: bool| {
        let t = Instant::now();
        (0..n_exp).into_par_iter().for_each(|e| {
            let n = counts[e];
            if n == 0 {
                return;
            }
            let mut out = vec![0f32; rows * n];
            let (xs, xqs) = (&xs[..n * cols], &xqs[..n]);
            if library {
                quant::matmul_with(Isa::Amx, ty, &ws[e], cols, xs, xqs, &mut out);
                return;
            }
            let rest = n % 16;
            let n_amx = if rest >= 12 { n } else { n - rest };
            let (head, tail) = out.split_at_mut(rows * n_amx);
            if n_amx > 0 {
                let (x, q) = (&xs[..n_amx * cols], &xqs[..n_amx]);
                quant::matmul_with(Isa::Amx, ty, &ws[e], cols, x, q, head);
            }
            if n_amx < n {
                let (x, q) = (&xs[n_amx * cols..], &xqs[n_amx..]);
                quant::matmul_with(Isa::Avx512, ty, &ws[e], cols, x, q, tail);
            }
        });
        t.elapsed().as_secs_f64() * 1e3
    };
    println!("expert layer, {} threads:", rayon::current_num_threads());
    for round in 0..6 {
        let old = layer(false);
        let new = layer(true);
        println!(
            "   round {round}: AVX-512 tails below 12 tokens {old:.1} ms, library {new:.1} ms"
        );
    }
}
