//! The engine's public surface: what the server and the CLI call.
//!
//! One `Engine` owns one loaded model and its slots: `submit` queues requests and
//! `step` decodes them side by side (`sched`); `generate` runs one request to its end.
//! Every token is reported through a request's callbacks (`RequestCallbacks`), which
//! can stop the request or force tokens into it (the server uses that to close a
//! thinking block when a budget runs out).

use std::time::Duration;

use crate::constraint::Constraint;
use crate::experts::TierStats;
pub use crate::sampler::SamplingParams;

/// Settings chosen at load time.
#[derive(Debug, Clone, Default)]
pub struct EngineConfig {
    /// CPU threads for the kernels (None: all cores).
    pub threads: Option<usize>,
    /// Context length to allocate: a pool the slots share on the CPU, each slot's on a
    /// GPU (None: the model's trained length when memory allows, else the longest
    /// power of two that fits; see `ContextAsk::Auto`).
    pub max_context: Option<usize>,
    /// Slots: requests decoded at once, each in its own sequence (None:
    /// `DEFAULT_PARALLEL_CPU`; on a GPU, whose executor keeps a whole context per
    /// slot, one instead when that many would push routed experts out of VRAM).
    pub parallel: Option<usize>,
    /// Bytes of RAM for conversations no slot holds any more (None: the smaller of
    /// 8 GiB and a quarter of the available memory; 0: off).
    pub prompt_cache: Option<u64>,
    /// Where the prompt cache persists, so a restart resumes warm (None: memory only).
    pub prompt_cache_dir: Option<std::path::PathBuf>,
    /// How the CPU kernels treat activations (tests use `ReferenceF32`).
    pub precision: Precision,
    /// Where model steps run (None: the GPU when the build has CUDA and one is
    /// present, else the CPU).
    pub device: Option<Device>,
    /// The vision encoder (an mmproj GGUF): requests may then carry images.
    pub mmproj: Option<std::path::PathBuf>,
    /// The largest image, in patches, the vision encoder takes on the GPU (its scratch
    /// is allocated for it at load; larger images are encoded on the CPU; 0 keeps every
    /// image on the CPU). None: what a 32nd of the GPU's memory holds, 8,192 to 65,536.
    pub vision_gpu_patches: Option<usize>,
    /// Count every routing decision (`scoria profile`; read with
    /// `Engine::routing_counts`). The CPU executor records them, so this runs on the
    /// CPU; asking for it with `--device cuda` is refused.
    pub record_routing: bool,
    /// GPU: VRAM the executor may use (None: the free VRAM minus a reserve). A
    /// model that does not fit keeps its routed experts in VRAM slots, a pinned RAM
    /// copy and the file (the tiered expert store).
    pub vram_budget: Option<u64>,
    /// GPU, tiered: pinned RAM for the experts' copy (None: what MemAvailable
    /// allows minus 8 GiB, at most every expert). CPU: when set, the routed experts
    /// this many bytes hold are copied into RAM at load and every other one is read
    /// from the file (`O_DIRECT`) each time a step routes to it (None: every expert
    /// is read through the mapped file).
    pub ram_budget: Option<u64>,
    /// Tiered experts: how long a step waits for experts read from the file before
    /// the requests that needed them fail (None:
    /// [`experts::DEFAULT_READ_DEADLINE`](crate::experts::DEFAULT_READ_DEADLINE)).
    pub expert_read_deadline: Option<std::time::Duration>,
    /// GPU, tiered: a routing profile (`scoria profile`) that divides the slots
    /// by measured demand and fills them before the first step.
    pub expert_profile: Option<std::path::PathBuf>,
    /// GPU, tiered: the share (0–1) of a decode step's misses held in RAM that the
    /// CPU computes instead of copying them to VRAM slots (None: a cost model from
    /// bandwidths measured at load decides each step). For tests and experiments;
    /// the output is the same either way.
    pub cpu_expert_share: Option<f64>,
    /// GPU, tiered: experts in the prompt pool, VRAM beside the slots that the next
    /// layer's experts are copied into while a prompt's mixer runs (None: five eighths
    /// of a layer's experts within a sixteenth of the expert budget, or none when prompt
    /// chunks are too short to use it; 0: off).
    pub prompt_pool: Option<usize>,
    /// GPU, tiered: how many of the next layer's likeliest experts a decode step
    /// guesses and copies ahead (None: [`DEFAULT_GUESS_EXPERTS`]; 0: none). A guess
    /// only moves bytes: every layer computes with its own routing.
    pub guess_experts: Option<usize>,
    /// Speculative decoding: the draft source and the drafts' length
    /// (`--spec`, `--draft-max`, `--draft-min`; off by default).
    pub spec: crate::spec::SpecConfig,
}

/// The guesses a tiered decode step copies ahead unless `guess_experts` says. On N80
/// at a 16 GiB budget under random routing, 3 guesses decoded 6.8% faster than none
/// and 2 guesses 5.3% (bench/RESULTS.md, 2026-12-04, session 32), once the copies
/// ahead waited for the step's own work; before that they slowed the CPU's rows on the
/// copy engine and decode ran 2–10% slower.
pub const DEFAULT_GUESS_EXPERTS: usize = 3;

/// How matrix products treat activations (on the CPU executor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// The canonical kernels: activations quantized to 32-value int8 blocks for
    /// quantized weights (docs/design.md's reduction order). What serving uses.
    #[default]
    Canonical,
    /// Weights dequantized and multiplied with f32 activations. Slow; for checking
    /// a quantized file's weights against a float reference.
    ReferenceF32,
}

/// The executor a loaded engine runs on, for startup lines, `/props` and the
/// stats page.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceReport {
    pub device: Device,
    /// `cpu (avx512)`, or the GPU's name.
    pub name: String,
    /// Device memory this engine holds (weights, state, scratch), GPU only.
    pub vram_used: Option<u64>,
    /// The GPU's total memory, GPU only.
    pub vram_total: Option<u64>,
}

/// Where model steps run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Device {
    Cpu,
    /// CUDA device ordinal.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => Err(format!(
                    "unknown device `{s}` (expected cpu, cuda or cuda:N)"
                )),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What the loaded model is.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelInfo {
    /// GGUF `general.architecture` (qwen3moe, qwen3next, qwen35moe).
    pub arch: String,
    /// GGUF `general.name`, or the file stem.
    pub name: String,
    /// Path of the model file (first shard).
    pub path: String,
    /// Bytes of all shards.
    pub file_bytes: u64,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
    /// Context length this engine allocated.
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// True for models written by `scoria synth` (random weights).
    pub synthetic: bool,
}

/// One request to decode.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (forced tokens count too).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop when the model emits an end-of-generation token (the token is reported,
    /// then generation ends). False only for tests and benchmarks.
    pub stop_at_eog: bool,
    /// Structured output: only tokens this grammar allows are sampled (None: free).
    /// The engine decodes with a copy; the request keeps the initial state.
    pub constraint: Option<Constraint>,
    /// Report each generated token's log-probability and this many of the most
    /// likely tokens at its position (at most [`MAX_TOP_LOGPROBS`]); None: none.
    pub logprobs: Option<usize>,
    /// This request's draft limits (llama-server's `speculative.n_max`/`n_min`);
    /// the engine's where `None`. Speculation never changes the tokens.
    pub speculative: crate::spec::DraftLimits,
    /// The images of the prompt, in order: each one's rows replace the prompt's
    /// tokens `at..at + rows` (the placeholders), which must not overlap. An engine
    /// without a vision encoder (`EngineConfig::mmproj`) refuses a request with any.
    pub images: Vec<PromptImage>,
}

/// One image of a prompt: its rows take the prompt's positions `at..at +
/// image.rows(merge)`.
#[derive(Debug, Clone)]
pub struct PromptImage {
    pub at: usize,
    pub image: std::sync::Arc<model::vision::PreparedImage>,
}

impl GenerateRequest {
    /// `max_tokens` greedy tokens after `prompt`, every one of them (no stop at an
    /// end-of-generation token), free of any grammar, without log-probabilities:
    /// what tests, benchmarks and routing records decode.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_at_eog: false,
            constraint: None,
            logprobs: None,
            speculative: Default::default(),
            images: Vec::new(),
        }
    }
}

/// The most alternatives a token's [`TokenLogprobs`] list.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability under the model: the log-softmax of the
/// logits at its position, before the sampling settings, biases, penalties and
/// grammar masks; and the most likely tokens there with theirs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    top: [(u32, f32); MAX_TOP_LOGPROBS],
    n_top: usize,
}

impl TokenLogprobs {
    /// `token`'s log-probability in `logits`, and the `n_top` (at most
    /// [`MAX_TOP_LOGPROBS`]) most likely tokens, most likely first (ties: the
    /// lower id first). The sum runs in one fixed order, so the same logits give
    /// the same bits.
    pub fn of(logits: &[f32], token: u32, n_top: usize) -> TokenLogprobs {
        let lse = model::math::log_sum_exp(logits);
        let mut top = [(0u32, 0f32); MAX_TOP_LOGPROBS];
        let best = crate::sampler::top_logits(logits, n_top.min(MAX_TOP_LOGPROBS));
        for (slot, &(id, l)) in top.iter_mut().zip(&best) {
            *slot = (id, l - lse);
        }
        TokenLogprobs {
            logprob: logits.get(token as usize).map_or(f32::NAN, |&l| l - lse),
            top,
            n_top: best.len(),
        }
    }

    /// The most likely tokens and their log-probabilities, most likely first.
    pub fn top(&self) -> &[(u32, f32)] {
        &self.top[..self.n_top]
    }
}

/// A token as it is produced.
#[derive(Debug, Clone, Copy)]
pub struct TokenEvent {
    pub token: u32,
    /// 0-based index among the generated tokens.
    pub index: usize,
    /// The token was forced by the callback, not sampled.
    pub forced: bool,
    /// The token is an end-of-generation token.
    pub eog: bool,
    /// Its log-probabilities, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// How far the prompt of a request has been read (`Engine::generate_with_progress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptProgress {
    /// Prompt tokens whose effect is in the state: the cached ones and those evaluated.
    pub done: usize,
    /// Tokens in the prompt.
    pub total: usize,
    /// Of `done`, those reused from the previous request's state.
    pub cached: usize,
}

/// What the callback wants after a token.
#[derive(Debug, Clone, PartialEq)]
pub enum Flow {
    Continue,
    /// End the request now (finish reason `Stopped`).
    Stop,
    /// Feed these tokens next, as if generated (each is reported with `forced: true`).
    Force(Vec<u32>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model emitted an end-of-generation token.
    Eog,
    /// `max_tokens` reached.
    Length,
    /// The callback returned `Flow::Stop` (a stop sequence, a disconnect).
    Stopped,
    /// The context is full.
    ContextFull,
}

/// Per-request numbers, in llama-server's `timings` vocabulary.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Timings {
    /// Prompt tokens evaluated (excluding cached ones).
    pub prompt_n: usize,
    pub prompt_ms: f64,
    /// Generated tokens.
    pub predicted_n: usize,
    pub predicted_ms: f64,
    /// Prompt tokens reused from the previous request's state.
    pub cache_n: usize,
    /// Tiered experts: where the routed experts came from in the engine's steps
    /// between this request's admission and its end — for its prompt and tokens,
    /// and for those of requests decoding beside it in the same steps (an expert
    /// fetched once serves every sequence of a step). `None` when every expert is
    /// resident.
    pub experts: Option<TierStats>,
    /// Speculative decoding: draft tokens verified for this request (llama-server's
    /// `draft_n`) and those accepted (`draft_n_accepted`); 0 without speculation.
    pub draft_n: usize,
    pub draft_n_accepted: usize,
}

impl Timings {
    pub fn prompt_per_second(&self) -> f64 {
        per_second(self.prompt_n, self.prompt_ms)
    }
    pub fn predicted_per_second(&self) -> f64 {
        per_second(self.predicted_n, self.predicted_ms)
    }
    /// The share of drafted tokens that were accepted (0 when none were drafted).
    pub fn draft_acceptance(&self) -> f64 {
        if self.draft_n > 0 {
            self.draft_n_accepted as f64 / self.draft_n as f64
        } else {
            0.0
        }
    }
}

fn per_second(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

/// The result of one request.
#[derive(Debug, Clone)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub timings: Timings,
    /// The seed the sampler used.
    pub seed: u64,
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Parses a memory size: bytes (`1073741824`), or a number with a unit, decimal
/// fractions allowed: `K`/`KB`/`KiB`, `M`…, `G`…, `T`… (all powers of 1024, as
/// memory is sold), case-insensitive: `16G`, `12.5GiB`, `512m`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        u => {
            return Err(format!(
                "{s:?}: unknown unit {u:?} (use bytes or K, M, G, T, e.g. 16G or 12.5GiB)"
            ))
        }
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 16G, 12.5GiB, 512M)"))?;
    let bytes = v * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{s:?} is too large"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod size_tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert_eq!(parse_size("12.5GiB"), Ok(25 << 29));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size(" 2 TB "), Ok(2 << 40));
        assert!(parse_size("16X").unwrap_err().contains("unknown unit"));
        assert!(parse_size("G").unwrap_err().contains("not a size"));
        assert!(parse_size("1e30T").is_err());
    }
}
