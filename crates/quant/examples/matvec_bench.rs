//! Weight-read throughput of the matvec kernels, per type and kernel level.
//!
//! `cargo run --release -p scoria-quant --example matvec_bench [-- --quick]`
//!
//! For each case it prints GB/s of weight bytes read: one thread (rows in a loop)
//! and all rayon threads (`matvec`). The 512x2048 shape is one expert projection
//! (cache-resident when repeated); the larger shapes exceed the caches.
//! The matmul cases (prompt processing: one expert's tokens, a dense projection)
//! report (row, token) dots per second and the effective GFLOP/s (2·rows·cols·tokens).
//! `--matmul` runs only those; `--tail` the cost of a matmul's last partial group of
//! tokens at the AMX level (see `tail_bench`); `--lowbit` one thread's speed on every
//! quantized type; `--short` one thread's nanoseconds per dot on rows of a few 32-value
//! blocks (a partial group of 8, like the demo model's 128-wide LM head).

use std::time::{Duration, Instant};

use rayon::prelude::*;

use quant::{GgmlType as T, Isa};

fn lcg(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *state >> 33
}

fn random_matrix(ty: T, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut s = seed;
    // Quantize random values so that scales are sane (random bytes would also do).
    let mut w = vec![0u8; rows * quant::row_bytes(ty, cols).expect("shape")];
    let rb = w.len() / rows;
    let mut x = vec![0f32; cols];
    for r in 0..rows.min(64) {
        for v in x.iter_mut() {
            *v = (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0;
        }
        quant::quantize_row(ty, &x, &mut w[r * rb..(r + 1) * rb]);
    }
    // Replicate the first rows (quantizing every row is slow for IQ4_XS).
    for r in 64..rows {
        let src = (r % 64) * rb;
        w.copy_within(src..src + rb, r * rb);
    }
    w
}

fn time_it(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    let start = Instant::now();
    let mut n = 0;
    while n < 3 || start.elapsed() < budget {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
        n += 1;
    }
    best
}

/// One thread's matvec speed on a 1024 x 4096 matrix of every quantized type (Q4_K
/// first, for reference), in weight GB/s and in weights per nanosecond, at the AVX2
/// and AVX-512 levels.
fn lowbit_bench(budget: Duration) {
    let (rows, cols) = (1024usize, 4096usize);
    let mut s = 7u64;
    let x: Vec<f32> = (0..cols)
        .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let xq = quant::quantize_act(&x);
    println!(
        "{:<8} {:<9} {:>9} {:>12}",
        "type", "isa", "GB/s", "weights/ns"
    );
    for ty in quant::SUPPORTED {
        if matches!(ty, T::F32 | T::F16 | T::BF16) {
            continue;
        }
        let w = random_matrix(ty, rows, cols, 42);
        let rb = w.len() / rows;
        for isa in [Isa::Avx2, Isa::Avx512] {
            if !isa.is_available() {
                continue;
            }
            let mut out = vec![0f32; rows];
            let t = time_it(budget, || {
                for (o, row) in out.iter_mut().zip(w.chunks_exact(rb)) {
                    *o = quant::dot_with(isa, ty, row, &x, &xq);
                }
            });
            println!(
                "{:<8} {:<9} {:>9.2} {:>12.2}",
                ty.name(),
                isa.name(),
                w.len() as f64 / 1e9 / t,
                (rows * cols) as f64 / 1e9 / t
            );
        }
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let budget = Duration::from_millis(if quick { 100 } else { 400 });
    if std::env::args().any(|a| a == "--matmul") {
        matmul_bench(budget);
        return;
    }
    if std::env::args().any(|a| a == "--tail") {
        tail_bench(budget);
        return;
    }
    if std::env::args().any(|a| a == "--lowbit") {
        lowbit_bench(budget);
        return;
    }
    if std::env::args().any(|a| a == "--short") {
        short_bench(budget);
        return;
    }
    println!(
        "kernel level in use: {} (threads: {})",
        quant::kernel_isa(),
        rayon::current_num_threads()
    );
    let cases: &[(T, usize, usize)] = &[
        (T::Q4_K, 512, 2048),
        (T::Q6_K, 2048, 8192),
        (T::Q4_K, 8192, 8192),
        (T::Q5_K, 8192, 8192),
        (T::Q6_K, 8192, 8192),
        (T::IQ4_XS, 8192, 8192),
        (T::Q8_0, 8192, 8192),
        (T::Q4_0, 8192, 8192),
        (T::F16, 4096, 8192),
        (T::BF16, 4096, 8192),
        (T::F32, 2048, 8192),
        // Larger than any cache: RAM bandwidth.
        (T::Q4_K, 131072, 4096),
    ];
    println!(
        "{:<8} {:>12} {:<7} {:>12} {:>12}",
        "type", "rows x cols", "isa", "1 thread", "all threads"
    );
    for &(ty, rows, cols) in cases {
        let w = random_matrix(ty, rows, cols, 42);
        let mut s = 7u64;
        let x: Vec<f32> = (0..cols)
            .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let xq = quant::quantize_act(&x);
        let rb = w.len() / rows;
        let gb = w.len() as f64 / 1e9;
        for isa in Isa::ALL {
            if !isa.is_available() {
                println!(
                    "{:<8} {:>12} {:<7} (not available on this CPU)",
                    ty.name(),
                    format!("{rows}x{cols}"),
                    isa.name()
                );
                continue;
            }
            if isa == Isa::Scalar && quick {
                continue;
            }
            let mut out = vec![0f32; rows];
            let one = time_it(budget, || {
                for (o, row) in out.iter_mut().zip(w.chunks_exact(rb)) {
                    *o = quant::dot_with(isa, ty, row, &x, &xq);
                }
            });
            let all = time_it(budget, || {
                quant::matvec_with(isa, ty, &w, cols, &x, &xq, &mut out)
            });
            println!(
                "{:<8} {:>12} {:<7} {:>8.1} GB/s {:>8.1} GB/s",
                ty.name(),
                format!("{rows}x{cols}"),
                isa.name(),
                gb / one,
                gb / all
            );
        }
    }
    moe_bench(budget);
    matmul_bench(budget);
    let x: Vec<f32> = (0..2048).map(|i| (i as f32 * 0.37).sin()).collect();
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        let t = time_it(budget, || {
            std::hint::black_box(quant::quantize_act_with(isa, std::hint::black_box(&x)));
        });
        println!(
            "quantize_act 2048 values, {:<7}: {:.2} us",
            isa.name(),
            t * 1e6
        );
    }
}

/// The decode pattern of one MoE layer: 8 routed experts out of 128, each with a
/// gate and an up projection of 512x2048 Q4_K, computed as 16 separate matvecs
/// or as one `matvec_many` batch. Expert choice rotates so that weights come from RAM.
fn moe_bench(budget: Duration) {
    let (rows, cols, n_experts) = (512, 2048, 128);
    let ty = T::Q4_K;
    let rb = quant::row_bytes(ty, cols).expect("shape");
    let pool = random_matrix(ty, rows * 2 * n_experts, cols, 9);
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.1).cos()).collect();
    let xq = quant::quantize_act(&x);
    let mut outs = vec![vec![0f32; rows]; 16];
    let mut step = 0usize;
    let expert = |step: usize, k: usize, m: usize| {
        let e = (step * 37 + k * 13) % n_experts;
        let start = (2 * e + m) * rows * rb;
        start..start + rows * rb
    };
    let bytes = (16 * rows * rb) as f64 / 1e9;
    let separate = time_it(budget, || {
        step += 1;
        for (i, o) in outs.iter_mut().enumerate() {
            quant::matvec(ty, &pool[expert(step, i / 2, i % 2)], cols, &x, &xq, o);
        }
    });
    let batched = time_it(budget, || {
        step += 1;
        let mut jobs: Vec<quant::MatvecJob> = outs
            .iter_mut()
            .enumerate()
            .map(|(i, o)| quant::MatvecJob {
                ty,
                w: &pool[expert(step, i / 2, i % 2)],
                n_cols: cols,
                x: &x,
                xq: &xq,
                out: o,
            })
            .collect();
        quant::matvec_many(&mut jobs);
    });
    println!(
        "MoE layer step (8 experts x gate+up 512x2048 Q4_K of 128): 16 matvec calls {:.1} us ({:.1} GB/s), one matvec_many {:.1} us ({:.1} GB/s)",
        separate * 1e6,
        bytes / separate,
        batched * 1e6,
        bytes / batched
    );
}

/// `--short`: nanoseconds per (row, token) dot of Q4_0 and Q8_0 rows of 4, 7, 12 and
/// 16 blocks (128, 224, 384, 512 values: all, all, half and none of them a partial group
/// of 8 blocks), one token (`matvec`) and 16 tokens (`matmul`), per kernel level, on
/// one thread: run it with `RAYON_NUM_THREADS=1`.
fn short_bench(budget: Duration) {
    let rows = 8192usize;
    println!(
        "{:<6} {:>5} {:<9} {:>12} {:>12}",
        "type", "cols", "isa", "matvec ns", "matmul16 ns"
    );
    for ty in [T::Q4_0, T::Q8_0] {
        for cols in [128usize, 224, 384, 512] {
            let w = random_matrix(ty, rows, cols, 3);
            let mut s = 9u64;
            let xs: Vec<f32> = (0..cols * 16)
                .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let xqs: Vec<quant::ActQ8> = xs.chunks_exact(cols).map(quant::quantize_act).collect();
            let mut out = vec![0f32; rows * 16];
            for isa in Isa::ALL {
                if !isa.is_available() || isa == Isa::Amx {
                    continue;
                }
                let mv = time_it(budget, || {
                    quant::matvec_with(isa, ty, &w, cols, &xs[..cols], &xqs[0], &mut out[..rows])
                });
                let mm = time_it(budget, || {
                    quant::matmul_with(isa, ty, &w, cols, &xs, &xqs, &mut out)
                });
                println!(
                    "{:<6} {:>5} {:<9} {:>12.2} {:>12.2}",
                    ty.name(),
                    cols,
                    isa.name(),
                    mv / rows as f64 * 1e9,
                    mm / (rows * 16) as f64 * 1e9
                );
            }
        }
    }
}

/// Prompt processing: `matmul` of n tokens against one matrix, per type and kernel level.
fn matmul_bench(budget: Duration) {
    // `--isa NAME` runs only that kernel level.
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--isa")
        .and_then(|i| args.get(i + 1))
        .map(|n| Isa::from_name(n).unwrap_or_else(|| panic!("--isa {n}: no such kernel level")));
    // `--case TYPExROWSxCOLSxN` (e.g. q4_Kx512x2048x16) runs only that case.
    let case = args
        .iter()
        .position(|a| a == "--case")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let cases: &[(T, usize, usize, usize)] = &[
        (T::Q4_K, 512, 2048, 8),
        (T::Q4_K, 512, 2048, 16),
        (T::Q4_K, 8192, 2048, 64),
        (T::Q4_K, 2048, 2048, 512),
        (T::Q6_K, 512, 2048, 16),
        (T::Q6_K, 2048, 2048, 64),
        (T::Q8_0, 512, 2048, 8),
        (T::Q8_0, 512, 2048, 16),
        (T::Q8_0, 2048, 2048, 64),
        (T::Q8_0, 2048, 2048, 512),
        (T::Q5_K, 2048, 2048, 64),
        (T::IQ4_XS, 2048, 2048, 64),
        (T::Q4_0, 2048, 2048, 64),
    ];
    println!(
        "{:<8} {:>16} {:<8} {:>14} {:>10}",
        "type", "rows x cols x n", "isa", "Mdot/s", "GFLOP/s"
    );
    for &(ty, rows, cols, n_tok) in cases {
        let name = format!("{}x{rows}x{cols}x{n_tok}", ty.name());
        if case
            .as_ref()
            .is_some_and(|c| !c.eq_ignore_ascii_case(&name))
        {
            continue;
        }
        let w = random_matrix(ty, rows, cols, 5);
        let mut s = 11u64;
        let xs: Vec<f32> = (0..cols * n_tok)
            .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let xqs: Vec<quant::ActQ8> = xs.chunks_exact(cols).map(quant::quantize_act).collect();
        let mut out = vec![0f32; rows * n_tok];
        for isa in Isa::ALL {
            if !isa.is_available() || isa == Isa::Scalar || only.is_some_and(|o| o != isa) {
                continue;
            }
            let t = time_it(budget, || {
                quant::matmul_with(isa, ty, &w, cols, &xs, &xqs, &mut out)
            });
            let dots = (rows * n_tok) as f64;
            println!(
                "{:<8} {:>16} {:<8} {:>14.2} {:>10.1}",
                ty.name(),
                format!("{rows}x{cols}x{n_tok}"),
                isa.name(),
                dots / t / 1e6,
                2.0 * dots * cols as f64 / t / 1e9
            );
        }
    }
}

/// `--tail`: what a matmul's last partial group of tokens costs at the AMX level (run it
/// with `RAYON_NUM_THREADS=1`): a lone padded group of 16 (`amx16`), a padded group after
/// a whole one (`amx32 - amx16`), and 1..15 tokens on the AVX-512 kernels, for one
/// expert-sized matrix of each common type (`AMX_MIN_TOKENS` and `AMX_MIN_TAIL` in
/// `src/lib.rs` come from it); then one expert layer of a 512-token prompt on all threads
/// (256 Q4_K experts of 512 × 2048, each token routed to 8, as random routing spreads
/// them), the library's policy against tails below 12 tokens on the AVX-512 kernels (the
/// policy before those thresholds), alternated.
fn tail_bench(budget: Duration) {
    for (ty, rows, cols) in [
        (T::Q4_K, 512usize, 2048usize),
        (T::Q6_K, 2048, 512),
        (T::Q8_0, 512, 2048),
    ] {
        let w = random_matrix(ty, rows, cols, 5);
        let mut s = 7u64;
        let xs: Vec<f32> = (0..cols * 32)
            .map(|_| (lcg(&mut s) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let xqs: Vec<quant::ActQ8> = xs.chunks_exact(cols).map(quant::quantize_act).collect();
        let mut out = vec![0f32; rows * 32];
        let t = |isa: Isa, n: usize, out: &mut Vec<f32>| {
            time_it(budget, || {
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
    // Each expert its own copy, so the layer reads 151 MB as a prompt does.
    let base = random_matrix(ty, rows, cols, 5);
    let ws: Vec<Vec<u8>> = (0..n_exp).map(|_| base.clone()).collect();
    let mut s = 7u64;
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
