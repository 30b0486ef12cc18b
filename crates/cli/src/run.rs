//! `scoria run`: generate from a prompt on the terminal.

use anyhow::{bail, Context, Result};
use engine::{Engine, EngineConfig, Flow, GenerateRequest, SamplingParams};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Model file (GGUF; the first shard of a split model) [default: the demo model,
    /// models/demo.gguf].
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt", conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Token ids to feed instead of text, comma-separated (e.g. 1,2,3).
    #[arg(long = "prompt-ids", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n_predict: usize,
    /// Wrap the prompt as a user turn with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: turn thinking off (Qwen templates' enable_thinking=false).
    #[arg(long, requires = "chat")]
    pub no_think: bool,
    /// An image (PNG, JPEG, ...) to show the model before the prompt; repeat for more.
    /// The images, then the prompt, are one user turn of the chat template (as with
    /// --chat). Needs a vision encoder (--mmproj FILE, or one mmproj*.gguf beside the
    /// model).
    #[arg(long = "image", value_name = "FILE", conflicts_with = "prompt_ids")]
    pub image: Vec<PathBuf>,
    #[command(flatten)]
    pub sampling: Sampling,
    /// Penalize tokens among the last 64: positive logits divided by it, negative ones
    /// multiplied (llama.cpp style; 1 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Sampling seed (default: a random one).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print the generated token ids after the text.
    #[arg(long)]
    pub print_ids: bool,
    /// Write every position's logits (prompt and generated) as float32 .npy [positions, vocab].
    #[arg(long = "dump-logits")]
    pub dump_logits: Option<PathBuf>,
    /// Where and how the engine runs (the settings `serve` has too).
    #[command(flatten)]
    pub engine: server::settings::EngineArgs,
}

/// The token filters `run` and `bench` take (the server's names and ranges).
#[derive(clap::Args, Debug, Clone)]
pub struct Sampling {
    /// Sampling temperature, 0 to 2 as on the server (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample from the k most likely tokens only (0 = off).
    #[arg(long = "top-k", default_value_t = 0)]
    pub top_k: usize,
    /// Sample from the smallest set of tokens whose probabilities sum to p, in (0, 1]
    /// (1 = off).
    #[arg(long = "top-p", default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p times the most likely one, in [0, 1] (0 = off).
    #[arg(long = "min-p", default_value_t = 0.0)]
    pub min_p: f32,
}

impl Sampling {
    /// Refuses a value outside the server's range, naming the flag.
    pub fn check(&self) -> Result<()> {
        check_range("temp", self.temperature, 0.0, 2.0)?;
        check_range("top-p", self.top_p, 0.0, 1.0)?;
        check_range("min-p", self.min_p, 0.0, 1.0)
    }

    /// The engine's settings: these filters, no penalties, no seed.
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            ..Default::default()
        }
    }
}

fn check_range(name: &str, v: f32, lo: f32, hi: f32) -> Result<()> {
    if !(lo..=hi).contains(&v) || v.is_nan() {
        bail!("--{name} {v} is out of range [{lo}, {hi}]");
    }
    Ok(())
}

pub fn run(a: RunArgs) -> Result<()> {
    // The server's range (settings `temp`): one meaning for --temp everywhere.
    a.sampling.check()?;
    check_range("repeat-penalty", a.repeat_penalty, 0.0, 100.0)?;
    if let Some(n) = a.engine.threads {
        engine::check_threads(n)?;
    }
    // The dump's file is created before anything runs: a path that cannot be written
    // is reported now, not after the whole generation.
    let dump = match &a.dump_logits {
        Some(p) => Some(
            std::fs::File::create(p)
                .with_context(|| format!("--dump-logits: cannot create {}", p.display()))?,
        ),
        None => None,
    };
    let result = crate::model_or_demo(a.model.as_deref()).and_then(|m| generate(&a, &m, dump));
    if let (Err(_), Some(p)) = (&result, &a.dump_logits) {
        // Leave no empty or partial dump behind.
        let _ = std::fs::remove_file(p);
    }
    result
}

fn generate(a: &RunArgs, model: &std::path::Path, dump: Option<std::fs::File>) -> Result<()> {
    let t = std::time::Instant::now();
    let settings = a.engine.values();
    let mut eng = Engine::load(model, &{
        let mut c = EngineConfig {
            // One request: one slot.
            parallel: Some(1),
            precision: Default::default(),
            ..Default::default()
        };
        settings.apply(&mut c);
        if let Some(note) = settings.choose_mmproj(model, &mut c) {
            eprintln!("scoria: {note}");
        }
        c
    })
    .map_err(|e| anyhow::anyhow!(server::load_message(&model.display().to_string(), &e)))?;
    let info = eng.info().clone();
    eprintln!(
        "scoria: {} ({}, {} layers, {} experts top-{}), {:.2} GiB file, context {}, kernels {}, loaded in {:.2}s",
        info.name,
        info.arch,
        info.n_layer,
        info.n_expert,
        info.n_expert_used,
        info.file_bytes as f64 / (1u64 << 30) as f64,
        info.n_ctx,
        eng.kernel_isa(),
        t.elapsed().as_secs_f64()
    );
    eprintln!("{}", server::device::line(&eng.device_report()));
    eprintln!("memory: {}", eng.memory().describe());
    let mut images = Vec::new();
    let prompt: Vec<u32> = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if !a.image.is_empty() => {
            let (prompt, placed) = image_prompt(a, &eng, text, &settings.image_limits())?;
            images = placed;
            prompt
        }
        (None, Some(text)) => {
            let text = if a.chat {
                let tpl = eng
                    .chat_template()
                    .context("--chat: the model file has no chat template")?;
                let inputs = model::chat::ChatInputs {
                    messages: serde_json::json!([{"role": "user", "content": text}]),
                    tools: None,
                    add_generation_prompt: true,
                    enable_thinking: if a.no_think { Some(false) } else { None },
                    extra: Default::default(),
                };
                tpl.render(&inputs)?
            } else {
                text.clone()
            };
            eng.tokenizer().encode(&text, true)?
        }
        (None, None) => bail!("give a prompt with -p TEXT or --prompt-ids 1,2,3"),
    };
    let req = GenerateRequest {
        prompt: prompt.clone(),
        max_tokens: a.n_predict,
        sampling: SamplingParams {
            repeat_penalty: a.repeat_penalty,
            seed: a.seed,
            ..a.sampling.params()
        },
        stop_at_eog: !a.ignore_eos,
        constraint: None,
        logprobs: None,
        images,
        speculative: Default::default(),
    };
    let tok = eng.tokenizer_arc();
    let mut dec = tok.stream_decoder(false);
    let mut stdout = std::io::stdout();
    let mut all_logits: Vec<f32> = Vec::new();
    let n_vocab = info.n_vocab;
    let want_logits = dump.is_some();
    // With a dump, the prompt is evaluated by one pass that keeps every position's
    // logits (its time, in ms); generation then continues from that state.
    let mut logits_pass_ms = None;
    if want_logits {
        let t = std::time::Instant::now();
        all_logits = eng.logits_all(&prompt)?;
        logits_pass_ms = Some(t.elapsed().as_secs_f64() * 1000.0);
        all_logits.truncate((prompt.len() - 1) * n_vocab);
    }
    let mut on_token = |ev: &engine::TokenEvent| {
        let piece = dec.push(ev.token);
        let _ = stdout.write_all(piece.as_bytes());
        let _ = stdout.flush();
        Flow::Continue
    };
    // Without a dump nothing asks for the logits: the executor picks each token where
    // they are (on a GPU only the id comes back), as the server does.
    let completion = if want_logits {
        eng.generate_with_logits(&req, &mut on_token, &mut |l| {
            all_logits.extend_from_slice(l)
        })?
    } else {
        eng.generate(&req, &mut on_token)?
    };
    let _ = stdout.write_all(dec.finish().as_bytes());
    println!();
    let mut tm = completion.timings.clone();
    if let Some(ms) = logits_pass_ms {
        // The logits pass evaluated the prompt, so `generate` found all of it in the
        // prompt cache: report the pass as the prompt's evaluation.
        tm.prompt_n += tm.cache_n;
        tm.cache_n = 0;
        tm.prompt_ms += ms;
    }
    eprintln!(
        "prompt: {} tokens in {:.1} ms ({:.2} tok/s){}; generation: {} tokens in {:.1} ms ({:.2} tok/s); finish: {:?}",
        tm.prompt_n,
        tm.prompt_ms,
        tm.prompt_per_second(),
        if tm.cache_n > 0 { format!(", {} cached", tm.cache_n) } else { String::new() },
        tm.predicted_n,
        tm.predicted_ms,
        tm.predicted_per_second(),
        completion.finish
    );
    if let Some(d) = eng.drafter() {
        eprintln!(
            "speculation ({}): {} drafted, {} accepted ({:.1}%)",
            d,
            tm.draft_n,
            tm.draft_n_accepted,
            100.0 * tm.draft_acceptance()
        );
    }
    if let Some(e) = &completion.timings.experts {
        let gb = |b: u64| b as f64 / 1e9;
        eprintln!(
            "experts: {:.1}% of {} uses hit a VRAM slot; {} copied from RAM ({:.2} GB), {} computed by the CPU ({:.2} GB), {} read from disk ({:.2} GB)",
            100.0 * e.hit_rate(),
            e.uses(),
            e.ram_misses,
            gb(e.ram_bytes),
            e.cpu_misses,
            gb(e.cpu_bytes),
            e.disk_misses,
            gb(e.disk_bytes),
        );
    }
    if a.print_ids {
        let ids: Vec<String> = completion.tokens.iter().map(|t| t.to_string()).collect();
        println!("ids: {}", ids.join(","));
    }
    if let (Some(file), Some(path)) = (dump, &a.dump_logits) {
        let rows = all_logits.len() / n_vocab;
        engine::npy::write_f32_to(file, rows, n_vocab, &all_logits)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote logits for {rows} positions to {}", path.display());
    }
    Ok(())
}

/// `--image`: the images, then `text`, as one user turn of the chat template, each
/// image's placeholder expanded to its rows (the server's rendering of an image).
fn image_prompt(
    a: &RunArgs,
    eng: &Engine,
    text: &str,
    limits: &server::images::ImageLimits,
) -> Result<(Vec<u32>, Vec<engine::PromptImage>)> {
    let Some(vision) = eng.vision() else {
        bail!("--image: this model has no vision encoder: give --mmproj FILE (an mmproj GGUF for this model)");
    };
    let mut prepared = Vec::with_capacity(a.image.len());
    let mut content = Vec::with_capacity(a.image.len() + 1);
    for path in &a.image {
        let bytes = std::fs::read(path)
            .with_context(|| format!("--image: cannot read {}", path.display()))?;
        let image = server::images::prepare(&bytes, vision, limits)
            .map_err(|e| anyhow::anyhow!("--image {}: {e}", path.display()))?;
        prepared.push(std::sync::Arc::new(image));
        content.push(serde_json::json!({"type": "image"}));
    }
    content.push(serde_json::json!({"type": "text", "text": text}));
    let tpl = eng
        .chat_template()
        .context("--image: the model file has no chat template")?;
    let inputs = model::chat::ChatInputs {
        messages: serde_json::json!([{"role": "user", "content": content}]),
        tools: None,
        add_generation_prompt: true,
        enable_thinking: if a.no_think { Some(false) } else { None },
        extra: Default::default(),
    };
    let rendered = tpl.render(&inputs)?;
    let tok = eng.tokenizer();
    let pad = tok
        .token_id(server::images::IMAGE_PAD)
        .context("--image: this model's vocabulary has no <|image_pad|> token")?;
    // The prompt text is the user's: control-token text in it stays text.
    let at: Vec<std::ops::Range<usize>> = rendered
        .find(text)
        .filter(|_| !text.is_empty())
        .map(|s| s..s + text.len())
        .into_iter()
        .collect();
    let tokens = tok.encode_prompt_marked(&rendered, &at)?;
    server::images::expand(&tokens, pad, prepared, vision.merge)
        .map_err(|e| anyhow::anyhow!("--image: {e}"))
}
