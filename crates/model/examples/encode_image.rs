//! Times the vision encoder on one image: decoding and preprocessing, then the encoder.
//!
//! `cargo run --release -p scoria-model --example encode_image -- MMPROJ IMAGE [RUNS]`
//! prints the image's grid, the merged rows, and each step's milliseconds (the
//! encoder's best of RUNS, default 1).

use std::time::Instant;

use model::vision::preprocess::{prepare, ImageLimits};
use model::vision::VisionModel;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: encode_image MMPROJ IMAGE [RUNS]");
        std::process::exit(2);
    }
    let runs: usize = args.get(3).and_then(|r| r.parse().ok()).unwrap_or(1);
    let t = Instant::now();
    let enc = VisionModel::open(args[1].as_ref()).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    let bytes = std::fs::read(&args[2]).expect("read the image");
    let t = Instant::now();
    let img = prepare(&bytes, enc.config(), &ImageLimits::default()).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    let prep_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut best = f64::MAX;
    let mut rows = 0;
    for _ in 0..runs {
        let t = Instant::now();
        let e = enc.encode(&img).expect("encode");
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
        rows = e.rows;
    }
    println!(
        "image {}x{} -> grid {:?}, {} rows of {}; load {load_ms:.0} ms, preprocess {prep_ms:.1} ms, encode {best:.0} ms (best of {runs}), {} threads",
        img.resized.0,
        img.resized.1,
        img.grid,
        rows,
        enc.config().out_hidden,
        rayon::current_num_threads()
    );
}
