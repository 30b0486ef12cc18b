//! `scoria`: run mixture-of-experts models larger than the GPU, and serve them.

mod bench;
mod inspect;
mod perplexity;
mod profile;
mod quantize;
mod run;
mod serve;
mod synth;

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "scoria",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("SCORIA_BUILD_COMMIT"), ")"),
    about = "Mixture-of-experts inference engine and server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the OpenAI and Anthropic APIs (the demo model, models/demo.gguf, when no
    /// --model is given).
    // Boxed: its many flags make it far larger than the other variants.
    Serve(Box<serve::ServeArgs>),
    /// Generate from a prompt on the terminal.
    Run(run::RunArgs),
    /// Write a synthetic GGUF (random weights) of a named geometry.
    Synth(synth::SynthArgs),
    /// Measure prompt and generation speed (llama-bench's tests, labels and table).
    Bench(bench::BenchArgs),
    /// Describe a GGUF file: arch, geometry, tensor types, where every byte goes.
    Inspect(inspect::InspectArgs),
    /// Record how often each expert of each layer is routed to (for the expert slot plan).
    Profile(profile::ProfileArgs),
    /// Perplexity over a text (as llama-perplexity counts it), and the KL divergence from
    /// a base model's logits (--kld-base; --kld-max makes it a quality gate).
    Perplexity(perplexity::PerplexityArgs),
    /// Write a GGUF file's tensors at another type (f32, f16, bf16, q8_0, q4_k_m).
    Quantize(quantize::QuantizeArgs),
}

/// The model a command runs: the file given, else the trained demo model
/// (`models/demo.gguf` of the checkout; an error naming where it was looked for and the
/// remedies when it is not there).
pub(crate) fn model_or_demo(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    match given {
        Some(p) => Ok(p.to_path_buf()),
        None => Ok(model::synth::demo_model_path()?),
    }
}

/// Keeps freed buffers of up to 32 MiB in the allocator for the next use instead of
/// giving them back to the kernel at once. A CPU prompt pass allocates and frees
/// activations of 8–16 MB a layer; with glibc's defaults every free of one unmapped
/// or `madvise`d its pages (a TLB flush across every core the process runs on) and
/// the next allocation faulted them in again, on the pass's own thread while the
/// others waited: most of what remained of a prompt pass outside its parallel loops
/// (perf, two threads: 1.4–2.1% of the pass, 0.6% with these settings). The memory
/// kept is bounded by the largest pass's working set. `GLIBC_TUNABLES`, when set,
/// is left to decide.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("GLIBC_TUNABLES").is_none() {
        // SAFETY: mallopt only sets the allocator's parameters; called first thing in
        // main, before any other thread exists.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

fn main() {
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SCORIA_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(a) => serve::run(*a),
        Command::Run(a) => run::run(a),
        Command::Synth(a) => synth::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Profile(a) => profile::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Quantize(a) => quantize::run(a),
    };
    if let Err(e) = result {
        eprintln!("scoria: error: {e:#}");
        std::process::exit(1);
    }
}
