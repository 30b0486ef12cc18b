//! `scoria profile`: record how often each (layer, expert) is routed to, for the expert
//! store's slot plan. Runs the model on the CPU over a prompt (text, ids, or seeded
//! random ids) and some greedy decode steps, and writes the counts as JSON.

use anyhow::{bail, Context, Result};
use engine::{record_profile, ProfileInput};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// Model file (GGUF; the first shard of a split model).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// A file whose text is the prompt (tokenized with the model's tokenizer).
    #[arg(long = "prompt-file", conflicts_with_all = ["prompt_ids", "tokens"])]
    pub prompt_file: Option<PathBuf>,
    /// Token ids of the prompt, comma-separated (e.g. 1,2,3).
    #[arg(long = "prompt-ids", value_delimiter = ',', conflicts_with = "tokens")]
    pub prompt_ids: Option<Vec<u32>>,
    /// A prompt of N token ids drawn uniformly from the vocabulary (with --seed).
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Seed of the random prompt ids.
    #[arg(long, default_value_t = 1, requires = "tokens")]
    pub seed: u64,
    /// Greedy decode steps after the prompt (one token per step: the decode path).
    #[arg(short = 'n', long = "n-predict", default_value_t = 0)]
    pub n_predict: usize,
    /// Where to write the profile (JSON).
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

pub fn run(a: ProfileArgs) -> Result<()> {
    if let Some(n) = a.threads {
        engine::check_threads(n)?;
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("setting the thread count")?;
    }
    let input = match (&a.prompt_file, &a.prompt_ids, a.tokens) {
        (Some(f), _, _) => ProfileInput::Text(
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
        ),
        (None, Some(ids), _) => ProfileInput::Ids(ids.clone()),
        (None, None, Some(n)) => ProfileInput::Random {
            tokens: n,
            seed: a.seed,
        },
        (None, None, None) => {
            bail!("give a prompt: --prompt-file FILE, --prompt-ids 1,2,3, or --tokens N [--seed S] for random ids")
        }
    };
    let rec = record_profile(&a.model, &input, a.n_predict)
        .with_context(|| format!("profiling {}", a.model.display()))?;
    let p = &rec.profile;
    rec.profile
        .save(&a.output)
        .with_context(|| format!("writing {}", a.output.display()))?;
    eprintln!(
        "scoria profile: {} ({}, {} layers, {} experts, top-{}): {} prompt tokens + {} decode steps in {:.1}s",
        p.model,
        p.arch,
        p.n_layer,
        p.n_expert,
        p.top_k,
        rec.prompt_tokens,
        rec.generated.len(),
        rec.seconds
    );
    eprintln!("layer  effective experts  unused  top-{} share", p.top_k);
    for l in 0..p.n_layer {
        let unused = p.counts[l].iter().filter(|&&c| c == 0).count();
        eprintln!(
            "{l:>5}  {:>17.1}  {unused:>6}  {:>10.1}%",
            p.effective_experts(l),
            100.0 * p.coverage(l, p.top_k)
        );
    }
    eprintln!("wrote {}", a.output.display());
    Ok(())
}
