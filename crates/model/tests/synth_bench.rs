//! Writes a full-size synthetic model and reports the time (ignored by default: it
//! writes tens of gigabytes).
//!
//! `SCORIA_SYNTH_BENCH_PATH=/tmp/q35.gguf SCORIA_SYNTH_BENCH_GEOMETRY=qwen3.6-35b-a3b \
//!  cargo test --release -p scoria-model --test synth_bench -- --ignored --nocapture`

use model::geometry::Geometry;
use model::synth::{self, Preset, SynthOptions};

#[test]
#[ignore = "writes a full-size model; set SCORIA_SYNTH_BENCH_PATH"]
fn write_full_size_model() {
    let Some(path) = std::env::var_os("SCORIA_SYNTH_BENCH_PATH") else {
        eprintln!("SCORIA_SYNTH_BENCH_PATH not set; nothing to do");
        return;
    };
    let name = std::env::var("SCORIA_SYNTH_BENCH_GEOMETRY")
        .unwrap_or_else(|_| "qwen3.6-35b-a3b".to_string());
    let preset: Preset = std::env::var("SCORIA_SYNTH_BENCH_QUANT")
        .unwrap_or_else(|_| "q4_k_m".to_string())
        .parse()
        .unwrap();
    let g = Geometry::by_name(None, &name).unwrap();
    let opts = SynthOptions {
        preset,
        seed: 1,
        sync: true,
    };
    let path = std::path::PathBuf::from(path);
    let r = synth::synthesize(&path, &g, &opts, &|_, _| {}).unwrap();
    eprintln!(
        "{} {}: {} bytes, {} tensors, {:.1} s, {:.2} GB/s, {} threads",
        r.geometry,
        r.preset,
        r.file_size,
        r.n_tensors,
        r.seconds,
        r.bytes_per_second() / 1e9,
        rayon::current_num_threads()
    );
    for (ty, n, b) in &r.by_type {
        eprintln!("  {ty}: {n} tensors, {b} bytes");
    }
}
