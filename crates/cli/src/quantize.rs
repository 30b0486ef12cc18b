//! `scoria quantize`: a GGUF file's tensors written again at another type (`model::requant`).

use std::path::PathBuf;

use anyhow::bail;
use model::synth::Preset;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Types are chosen per tensor as llama-quantize chooses them for the preset; the \
quantizers round to nearest (no scale search, no importance matrix), so the files are for \
measuring what a type costs (`scoria perplexity --kld-base`), not for publishing. f32 is the \
exact float form of any quantized file."
)]
pub struct QuantizeArgs {
    /// The GGUF file to read (a single file).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// The preset: f32, f16, bf16, q8_0 or q4_k_m.
    #[arg(short = 'q', long = "quant")]
    pub quant: String,
    /// Output file.
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// Replace the output file if it exists.
    #[arg(long)]
    pub force: bool,
}

pub fn run(a: QuantizeArgs) -> anyhow::Result<()> {
    let preset: Preset = a.quant.parse().map_err(anyhow::Error::msg)?;
    if a.output.is_dir() {
        bail!(
            "-o {} is a directory; give the file to write",
            a.output.display()
        );
    }
    if a.output.exists() && !a.force {
        bail!("{} exists; pass --force to replace it", a.output.display());
    }
    let t = std::time::Instant::now();
    let r = model::requant::requantize(&a.model, &a.output, preset, &|_, _| {})?;
    let types: Vec<String> = r
        .by_type
        .iter()
        .map(|(ty, n, bytes)| format!("{ty} {n} ({:.2} MB)", *bytes as f64 / 1e6))
        .collect();
    println!("tensor types: {}", types.join(", "));
    println!(
        "wrote {}: {:.2} MB, {} tensors ({} converted, {} copied) in {:.1} s",
        r.path.display(),
        r.file_size as f64 / 1e6,
        r.n_tensors,
        r.converted,
        r.copied,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
