//! `scoria serve`: the HTTP server (OpenAI and Anthropic APIs).
//!
//! Every flag is optional: a value given here wins over the config file (`--config`),
//! which wins over the built-in default. The settings logic lives in
//! `server::settings`; this file only maps flags to setting names.

use std::path::PathBuf;

use anyhow::Context;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// GGUF model file (first shard of a split model). Without it, the demo model
    /// (models/demo.gguf: a tiny qwen35moe trained for a few minutes) is served.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1, loopback only].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on [default: 8080].
    #[arg(long)]
    pub port: Option<u16>,
    /// Model id reported by /v1/models and in responses [default: the model's name].
    #[arg(long)]
    pub alias: Option<String>,
    /// Require this key (Authorization: Bearer KEY, or x-api-key) on every route but
    /// /health. Command line only: a config file may not set it.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Let browser pages from this origin call the API (CORS), e.g.
    /// https://app.example.com; repeat the flag or separate with commas; `*` allows any
    /// origin. Preflight requests are answered before the API key is checked
    /// [default: none, CORS off].
    #[arg(long, value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// Let control-token text inside messages (`<|im_end|>` typed by a user or
    /// returned by a tool) act as the control token, as before; unsafe: such text can
    /// forge turns [default: false, message text is text].
    #[arg(long, value_name = "BOOL")]
    pub content_special_tokens: Option<bool>,
    /// JSON config file with "server" and "engine" sections (names = these flags
    /// without dashes). The command line wins over it.
    #[arg(long)]
    pub config: Option<PathBuf>,

    /// Where model steps run: cpu, cuda (device 0) or cuda:N [default: the engine
    /// chooses: the GPU when the build has CUDA and one is present, else the CPU].
    #[arg(long)]
    pub device: Option<String>,
    /// GPU: VRAM to use in all, e.g. 16G [default: the free VRAM minus 512 MiB]. A
    /// model that does not fit keeps its routed experts in VRAM slots, pinned RAM and
    /// the file (same output).
    #[arg(long)]
    pub vram_budget: Option<String>,
    /// GPU, tiered experts: pinned RAM for the experts' copy, e.g. 40G [default: what
    /// is available minus 8 GiB].
    #[arg(long)]
    pub ram_budget: Option<String>,
    /// GPU, tiered experts: a routing profile from `scoria profile` [default: none].
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// CPU threads for the kernels [default: all cores].
    #[arg(long)]
    pub threads: Option<u64>,
    /// Context length to allocate [default: the engine's, min(trained, 4096)].
    #[arg(long)]
    pub max_context: Option<u64>,
    /// RAM for the prompt cache: conversations no slot holds any more, reused when
    /// they come back, e.g. 4G; 0 turns it off [default: the smaller of 8 GiB and a
    /// quarter of the available RAM].
    #[arg(long)]
    pub prompt_cache: Option<String>,
    /// Directory where the prompt cache persists, so a restart resumes warm
    /// [default: memory only].
    #[arg(long)]
    pub prompt_cache_dir: Option<PathBuf>,
    /// Requests decoded at once, each in its own slot; more wait in arrival order
    /// [default: 4 on the CPU, 1 on a GPU (its executor does not batch yet)].
    #[arg(long)]
    pub parallel: Option<u64>,
    /// Default temperature for requests that send none (0 = greedy) [default: 0.6].
    #[arg(long)]
    pub temp: Option<f64>,
    /// Default top-k (0 = off) [default: 20].
    #[arg(long)]
    pub top_k: Option<u64>,
    /// Default top-p (1 = off) [default: 0.95].
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Default min-p (0 = off) [default: 0].
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Default presence penalty [default: 0].
    #[arg(long, allow_hyphen_values = true)]
    pub presence_penalty: Option<f64>,
    /// Default frequency penalty [default: 0].
    #[arg(long, allow_hyphen_values = true)]
    pub frequency_penalty: Option<f64>,
    /// Default repetition penalty over the last 64 tokens (1 = off) [default: 1].
    #[arg(long)]
    pub repeat_penalty: Option<f64>,
    /// Default seed [default: random per request].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Token budget for requests that send none [default: 8192].
    #[arg(long)]
    pub max_tokens_default: Option<u64>,
    /// Reasoning effort for requests that name none: none, minimal (256-token thinking
    /// budget), low (1024), medium (4096), high, xhigh (no budget) [default: unset].
    #[arg(long)]
    pub reasoning_effort: Option<String>,
    /// Thinking on or off for requests that do not say [default: true].
    #[arg(long)]
    pub enable_thinking: Option<bool>,
    /// Thinking budget for requests that send none [default: none].
    #[arg(long)]
    pub max_thinking_tokens: Option<u64>,
    /// Tokens of the budget kept for the answer: the think block is closed when
    /// max(this, 15% of max_tokens) remain (0 = off) [default: 1024].
    #[arg(long)]
    pub thinking_answer_room: Option<u64>,
}

impl ServeArgs {
    fn overrides(&self) -> server::settings::Overrides {
        let mut o = server::settings::Overrides {
            config: self.config.clone(),
            api_key: self.api_key.clone(),
            values: Vec::new(),
        };
        o.set(
            "model",
            self.model.as_ref().map(|p| p.display().to_string()),
        );
        o.set("host", self.host.clone());
        o.set("port", self.port);
        o.set("alias", self.alias.clone());
        o.set("content-special-tokens", self.content_special_tokens);
        o.set(
            "cors-origin",
            (!self.cors_origin.is_empty()).then(|| self.cors_origin.join(",")),
        );
        o.set("device", self.device.clone());
        o.set("vram-budget", self.vram_budget.clone());
        o.set("ram-budget", self.ram_budget.clone());
        o.set(
            "profile",
            self.profile.as_ref().map(|p| p.display().to_string()),
        );
        o.set("threads", self.threads);
        o.set("max-context", self.max_context);
        o.set("parallel", self.parallel);
        o.set("prompt-cache", self.prompt_cache.clone());
        o.set(
            "prompt-cache-dir",
            self.prompt_cache_dir
                .as_ref()
                .map(|p| p.display().to_string()),
        );
        o.set("temp", self.temp);
        o.set("top-k", self.top_k);
        o.set("top-p", self.top_p);
        o.set("min-p", self.min_p);
        o.set("presence-penalty", self.presence_penalty);
        o.set("frequency-penalty", self.frequency_penalty);
        o.set("repeat-penalty", self.repeat_penalty);
        o.set("seed", self.seed);
        o.set("max-tokens-default", self.max_tokens_default);
        o.set("reasoning-effort", self.reasoning_effort.clone());
        o.set("enable-thinking", self.enable_thinking);
        o.set("max-thinking-tokens", self.max_thinking_tokens);
        o.set("thinking-answer-room", self.thinking_answer_room);
        o
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let settings =
        server::settings::Settings::resolve(&args.overrides()).context("invalid settings")?;
    server::run(settings)?;
    Ok(())
}
