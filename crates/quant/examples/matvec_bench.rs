//! Weight-read throughput of the matvec kernels, per type and kernel level.
//!
//! `cargo run --release -p scoria-quant --example matvec_bench [-- --quick]`
//!
//! For each case it prints GB/s of weight bytes read: one thread (rows in a loop)
//! and all rayon threads (`matvec`). The 512x2048 shape is one expert projection
//! (cache-resident when repeated); the larger shapes exceed the caches.

use std::time::{Duration, Instant};

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

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let budget = Duration::from_millis(if quick { 100 } else { 400 });
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
