//! `scoria synth`: write a synthetic GGUF (seeded random weights) of a named geometry.

use std::path::PathBuf;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use model::geometry::{Arch, Geometry, ARCHS};
use model::synth::{self, Preset, SynthOptions};

#[derive(clap::Args, Debug)]
#[command(after_help = "Geometries: run `scoria synth --list`.")]
pub struct SynthArgs {
    /// Architecture: qwen3next, qwen35moe or qwen3moe (inferred from the geometry when
    /// omitted; needed with `--geometry tiny`).
    #[arg(long)]
    pub arch: Option<String>,
    /// Geometry name, e.g. qwen3.6-35b-a3b, qwen3-next-80b-a3b, qwen3-30b-a3b, tiny.
    #[arg(long, short = 'g')]
    pub geometry: Option<String>,
    /// Quantization preset: q4_k_m, q8_0, f32, f16, bf16, a mix (ud_q2_k_xl, ud_q3_k_xl,
    /// ud_iq2_xxs, mxfp4_moe, nvfp4_scaled) or one quantized type for every matrix (q2_k, iq2_xxs, ...;
    /// `scoria synth --list` lists them).
    #[arg(long, short = 'q', default_value = "q4_k_m")]
    pub quant: String,
    /// Seed of the random weights (same seed, same bytes).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output file.
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Replace the output file if it exists.
    #[arg(long)]
    pub force: bool,
    /// Do not fsync the file before renaming it into place.
    #[arg(long)]
    pub no_sync: bool,
    /// List the geometries and exit.
    #[arg(long)]
    pub list: bool,
    /// Keep only the first N trunk layers: the geometry's shapes in a file small enough
    /// for a small machine's RAM (benchmarks of per-layer speed; not a real model's depth).
    #[arg(long)]
    pub layers: Option<u32>,
}

fn parse_arch(s: &str) -> anyhow::Result<Arch> {
    Arch::from_name(&s.to_ascii_lowercase()).with_context(|| {
        let names: Vec<&str> = ARCHS.iter().map(|a| a.name()).collect();
        format!("unknown arch `{s}` (one of {})", names.join(", "))
    })
}

fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

fn list() {
    println!(
        "{:<20} {:<10} {:>10} {:>10}  description",
        "geometry", "arch", "params", "non-vocab"
    );
    for (name, arch, desc) in Geometry::names() {
        if name == "tiny" {
            println!("{name:<20} {:<10} {:>10} {:>10}  {desc}", "any", "", "");
            continue;
        }
        let params = Geometry::by_name(Some(arch), name).and_then(|g| g.n_params());
        let (p, nv) = match params {
            Some((rest, total)) => (
                format!("{:.2}B", total as f64 / 1e9),
                format!("{:.2}B", rest as f64 / 1e9),
            ),
            None => (String::new(), String::new()),
        };
        println!("{name:<20} {:<10} {p:>10} {nv:>10}  {desc}", arch.name());
    }
    println!();
    let presets: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
    println!("presets: {} (default q4_k_m)", presets.join(", "));
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    if args.list {
        list();
        return Ok(());
    }
    let arch = args.arch.as_deref().map(parse_arch).transpose()?;
    let Some(name) = args.geometry.as_deref() else {
        bail!("--geometry is required (see `scoria synth --list`)");
    };
    let Some(mut geometry) = Geometry::by_name(arch, name) else {
        let known: Vec<&str> = Geometry::names().iter().map(|n| n.0).collect();
        match (arch, name.eq_ignore_ascii_case("tiny")) {
            (None, true) => {
                bail!("`--geometry tiny` needs --arch (qwen3next, qwen35moe or qwen3moe)")
            }
            (Some(a), false) if Geometry::by_name(None, name).is_some() => {
                bail!("geometry `{name}` is not a {a} geometry")
            }
            _ => bail!("unknown geometry `{name}` (one of {})", known.join(", ")),
        }
    };
    if let Some(n) = args.layers {
        if n == 0 || n > geometry.n_layer {
            bail!(
                "--layers {n}: {} has {} trunk layers; pass 1 to {}",
                geometry.name,
                geometry.n_layer,
                geometry.n_layer
            );
        }
        geometry.n_layer = n;
    }
    let preset: Preset = args.quant.parse().map_err(anyhow::Error::msg)?;
    let Some(output) = args.output else {
        bail!("-o/--output FILE is required");
    };
    // A directory is never replaced, --force or not: say what to give instead.
    if output.is_dir() {
        bail!(
            "-o {} is a directory; give the file to write, e.g. -o {}",
            output.display(),
            output.join(format!("{}.gguf", geometry.name)).display()
        );
    }
    if output.exists() && !args.force {
        bail!("{} exists; pass --force to replace it", output.display());
    }
    let opts = SynthOptions {
        preset,
        seed: args.seed,
        sync: !args.no_sync,
    };
    eprintln!(
        "synthesizing {} ({}, {} trunk layers) {} seed {} -> {}",
        geometry.name,
        geometry.arch.name(),
        geometry.n_layer,
        preset,
        opts.seed,
        output.display()
    );
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let progress = |done: u64, total: u64| {
        if bar.length() != Some(total) {
            bar.set_length(total);
        }
        bar.set_position(done);
    };
    let report = synth::synthesize(&output, &geometry, &opts, &progress)?;
    bar.finish_and_clear();
    let mut types: Vec<String> = Vec::new();
    for (ty, n, bytes) in &report.by_type {
        types.push(format!("{ty} {n} ({})", gb(*bytes)));
    }
    println!("tensor types: {}", types.join(", "));
    println!(
        "wrote {}: {} ({:.2} GiB), {} tensors, in {:.1} s ({:.2} GB/s)",
        report.path.display(),
        gb(report.file_size),
        report.file_size as f64 / (1u64 << 30) as f64,
        report.n_tensors,
        report.seconds,
        report.bytes_per_second() / 1e9
    );
    Ok(())
}
