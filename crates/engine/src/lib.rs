//! The runtime: loads a model, keeps per-sequence state (KV cache, recurrent
//! state), samples, and runs model steps on an executor (CPU now; CUDA later).

mod api;
pub mod constraint;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod exec;
pub mod experts;
pub mod npy;
pub mod prompt_cache;
pub mod sampler;

pub use api::*;

use cpu::{CpuBackend, CpuExecutor};
use exec::{Executor, SeqStep, StepOut, Want};
use model::chat::ChatTemplate;
use model::tokenizer::Tokenizer;
use model::{ExecError, Logits, ModelConfig, ModelWeights};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Errors a caller can act on; each names what is wrong and the remedy.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] gguf::Error),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("prompt of {prompt} tokens does not fit the context of {n_ctx} tokens (shorten the prompt or raise --max-context)")]
    PromptTooLong { prompt: usize, n_ctx: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary of {n_vocab} tokens")]
    BadToken { id: u32, n_vocab: usize },
    #[error("memory: {0}")]
    Memory(String),
    #[error("device: {0}")]
    Device(String),
    /// A setting that cannot be used (names the flag and the remedy).
    #[error("{0}")]
    Settings(String),
    #[error("executor: {0}")]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Constraint(#[from] constraint::ConstraintError),
}

/// Where the memory of a loaded model goes (printed at startup).
#[derive(Debug, Clone, serde::Serialize)]
pub struct MemoryAccount {
    /// Model file, memory-mapped (pages in on use; counted once).
    pub weights_mapped: u64,
    /// Of which routed experts.
    pub expert_bytes: u64,
    /// KV cache and recurrent state of one sequence at n_ctx.
    pub state_bytes: u64,
    /// MemAvailable when loading, if known.
    pub available: Option<u64>,
}

/// One loaded model, decoding one request at a time.
pub struct Engine {
    info: ModelInfo,
    cfg: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    template: Option<Arc<ChatTemplate>>,
    /// Runs the model steps (CPU or CUDA); holds the weights and the state of
    /// sequence 0, the one this engine decodes.
    exec: Box<dyn Executor>,
    /// The routing recorder, with `EngineConfig::record_routing`.
    routing: Option<Arc<experts::RoutingCounts>>,
    /// Tokens whose effect is in `state`, in order (the prompt cache).
    history: Vec<u32>,
    /// The logits at the end of `history`, when known (after a request or
    /// `logits_all`), so a prompt equal to the history needs no evaluation.
    last_logits: Option<Vec<f32>>,
    memory: MemoryAccount,
}

/// Memory this process may still take: MemAvailable, or less inside a cgroup whose
/// memory limit leaves less room (`None` where neither can be read).
fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok();
    let avail = s.and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    });
    let cg = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_headroom(&c, std::path::Path::new("/sys/fs/cgroup")));
    match (avail, cg) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// The least room (limit − usage) of the memory limits on this process's cgroup and
/// its ancestors, from `/proc/self/cgroup`'s text and the cgroup mount `root` (v2:
/// `memory.max`/`memory.current`; v1: the memory controller's `limit_in_bytes` and
/// `usage_in_bytes`); `None` when no limit is set.
fn cgroup_headroom(self_cgroup: &str, root: &Path) -> Option<u64> {
    let read = |p: &Path| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    let mut best: Option<u64> = None;
    for line in self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrl, path) = (parts.next(), parts.next()?, parts.next()?);
        let (base, max, cur) = match ctrl {
            "" => (root.to_path_buf(), "memory.max", "memory.current"),
            c if c.split(',').any(|x| x == "memory") => (
                root.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            ),
            _ => continue,
        };
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            if let (Some(m), Some(c)) = (read(&dir.join(max)), read(&dir.join(cur))) {
                // v1 reports "no limit" as a huge number; v2 as "max" (unparsed: None).
                if m < (1u64 << 60) {
                    let room = m.saturating_sub(c);
                    best = Some(best.map_or(room, |b| b.min(room)));
                }
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    best
}

impl Engine {
    /// Loads a GGUF model (first shard of a split model, or the single file).
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Engine, EngineError> {
        if let Some(n) = cfg.threads {
            check_threads(n)?;
            // Fails only if the pool already exists (a second engine in one process).
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build_global();
        }
        let file = Arc::new(gguf::GgufFile::open(path)?);
        let mcfg = ModelConfig::from_gguf(&file)?;
        let weights = ModelWeights::load(&file, &mcfg)?;
        let tokenizer =
            Tokenizer::from_gguf(&file).map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let template = ChatTemplate::from_gguf(&file)
            .map_err(|e| EngineError::Template(e.to_string()))?
            .map(Arc::new);

        let n_ctx = match cfg.max_context {
            Some(n) => {
                if n < 16 {
                    return Err(EngineError::Memory(format!(
                        "--max-context {n} is too small (at least 16)"
                    )));
                }
                n
            }
            None => mcfg.n_ctx_train.min(4096),
        };
        let state_bytes = cpu::state_bytes(&mcfg, n_ctx);
        if state_bytes > isize::MAX as usize {
            // No allocation can be this large (the count saturated or nearly so).
            return Err(EngineError::Memory(format!(
                "--max-context {n_ctx} is far too large: its KV cache and recurrent state would \
                 need more memory than a 64-bit address space holds; lower --max-context \
                 (this model was trained for {} tokens)",
                mcfg.n_ctx_train
            )));
        }
        let state_bytes = state_bytes as u64;
        let available = mem_available();
        if let Some(avail) = available {
            if state_bytes > avail {
                return Err(EngineError::Memory(format!(
                    "the KV cache and recurrent state for --max-context {n_ctx} need {:.2} GiB, but only {:.2} GiB of RAM is available; lower --max-context",
                    state_bytes as f64 / GIB,
                    avail as f64 / GIB
                )));
            }
        }
        let expert_bytes: u64 = file
            .tensors()
            .iter()
            .filter(|t| model::tensors::is_routed_expert(&t.name))
            .map(|t| t.size)
            .sum();
        let tensor_bytes: u64 = file.tensors().iter().map(|t| t.size).sum::<u64>();
        let routing = cfg
            .record_routing
            .then(|| Arc::new(experts::RoutingCounts::for_model(&mcfg)));
        let exec = open_executor(cfg, &mcfg, weights, n_ctx, routing.clone())?;
        let name = file
            .get("general.name")
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| {
                path.file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            });
        let synthetic = file
            .get("scoria.synthetic")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let info = ModelInfo {
            arch: mcfg.arch.name().to_string(),
            name,
            path: path.display().to_string(),
            file_bytes: file.file_size(),
            n_ctx_train: mcfg.n_ctx_train,
            n_ctx,
            n_vocab: mcfg.n_vocab,
            n_layer: mcfg.n_layer,
            n_embd: mcfg.n_embd,
            n_expert: mcfg.n_expert,
            n_expert_used: mcfg.n_expert_used,
            synthetic,
        };
        Ok(Engine {
            info,
            cfg: mcfg,
            tokenizer: Arc::new(tokenizer),
            template,
            exec,
            routing,
            history: Vec::new(),
            last_logits: None,
            memory: MemoryAccount {
                weights_mapped: tensor_bytes,
                expert_bytes,
                state_bytes,
                available,
            },
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn memory(&self) -> &MemoryAccount {
        &self.memory
    }
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
    /// A shared handle to the tokenizer (for threads that tokenize while the engine decodes).
    pub fn tokenizer_arc(&self) -> Arc<Tokenizer> {
        self.tokenizer.clone()
    }
    /// The chat template embedded in the file, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_deref()
    }
    pub fn chat_template_arc(&self) -> Option<Arc<ChatTemplate>> {
        self.template.clone()
    }
    /// Every routing decision counted since load, with `EngineConfig::record_routing`.
    pub fn routing_counts(&self) -> Option<&experts::RoutingCounts> {
        self.routing.as_deref()
    }

    /// The most prompt tokens the executor reads in one step (a longer prompt is
    /// read in pieces of this many).
    pub fn prompt_chunk(&self) -> usize {
        self.exec.prompt_chunk()
    }

    /// Where steps run and what device memory they hold.
    pub fn device_report(&self) -> DeviceReport {
        self.exec.report()
    }

    /// Where the routed experts computed so far came from, when they are tiered
    /// (VRAM slots in front of pinned RAM and the file); `None` otherwise.
    pub fn expert_stats(&self) -> Option<experts::TierStats> {
        self.exec.expert_stats()
    }

    /// The ISA the CPU kernels use.
    pub fn kernel_isa(&self) -> &'static str {
        quant::kernel_isa()
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), EngineError> {
        for &id in tokens {
            if id as usize >= self.cfg.n_vocab {
                return Err(EngineError::BadToken {
                    id,
                    n_vocab: self.cfg.n_vocab,
                });
            }
        }
        Ok(())
    }

    /// Forgets the cached sequence.
    pub fn reset(&mut self) -> Result<(), EngineError> {
        self.history.clear();
        self.last_logits = None;
        self.exec.clear(0)?;
        Ok(())
    }

    /// Feeds `tokens` after the current history, in prompt chunks; returns the
    /// logits of the last position (or of all positions with `Logits::All`), or
    /// the greedy token.
    fn feed(&mut self, tokens: &[u32], want: Want) -> Result<StepOut, EngineError> {
        self.last_logits = None;
        let pos0 = self.history.len();
        let exec = &mut self.exec;
        let out = exec::in_pieces(
            tokens,
            pos0,
            want,
            exec.prompt_chunk(),
            |chunk, pos0, want| {
                exec.step(&[SeqStep {
                    seq: 0,
                    tokens: chunk,
                    pos0,
                    want,
                }])?
                .pop()
                .ok_or_else(|| ExecError::new("step", "the executor returned no output"))
            },
        );
        match out {
            Ok(o) => {
                self.history.extend_from_slice(tokens);
                Ok(o)
            }
            Err(e) => {
                // The state may hold part of this feed: start over next time.
                let _ = self.reset();
                Err(e.into())
            }
        }
    }

    /// Evaluates `tokens` from an empty state and returns the logits of every
    /// position (n_vocab each), for parity tests and `--dump-logits`.
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.check_tokens(tokens)?;
        if tokens.len() > self.info.n_ctx {
            return Err(EngineError::PromptTooLong {
                prompt: tokens.len(),
                n_ctx: self.info.n_ctx,
            });
        }
        self.reset()?;
        let StepOut::Logits(all) = self.feed(tokens, Want::Logits(Logits::All))? else {
            return Err(ExecError::new("logits_all", "the executor returned a token").into());
        };
        let n_vocab = self.cfg.n_vocab;
        self.last_logits = Some(all[all.len() - n_vocab..].to_vec());
        Ok(all)
    }

    /// Decodes `req`, calling `on_token` after every token.
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
    ) -> Result<Completion, EngineError> {
        self.generate_inner(req, &mut |_| Flow::Continue, on_token, None)
    }

    /// As `generate`, also calling `on_prompt` after each piece of the prompt is
    /// evaluated (a long prompt takes minutes on a CPU). `Flow::Stop` there ends the
    /// request before its first token (finish `Stopped`, no tokens); the pieces already
    /// evaluated stay in the prompt cache. `Flow::Force` is read as `Continue`.
    pub fn generate_with_progress(
        &mut self,
        req: &GenerateRequest,
        on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
        on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
    ) -> Result<Completion, EngineError> {
        self.generate_inner(req, on_prompt, on_token, None)
    }

    /// As `generate`, also handing to `on_logits` every set of logits a token was
    /// chosen from: the prompt's last position, then the position of each
    /// generated token but the last (use `logits_all` for every prompt position).
    pub fn generate_with_logits(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
        on_logits: &mut dyn FnMut(&[f32]),
    ) -> Result<Completion, EngineError> {
        self.generate_inner(req, &mut |_| Flow::Continue, on_token, Some(on_logits))
    }

    fn generate_inner(
        &mut self,
        req: &GenerateRequest,
        on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
        on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
        mut on_logits: Option<LogitsSink>,
    ) -> Result<Completion, EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_tokens(&req.prompt)?;
        let n_ctx = self.info.n_ctx;
        if req.prompt.len() >= n_ctx {
            return Err(EngineError::PromptTooLong {
                prompt: req.prompt.len(),
                n_ctx,
            });
        }
        for &(id, _) in &req.sampling.logit_bias {
            self.check_tokens(&[id])?;
        }
        let seed = req.sampling.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let mut sampler = sampler::Sampler::new(&req.sampling, seed, &req.prompt);
        let mut timings = Timings::default();

        // Prompt cache: keep the state when it holds a prefix of this prompt (the
        // whole prompt too, when the logits at its end are known). Recurrent state
        // cannot be rewound, so anything else starts over.
        let reuse = !self.history.is_empty()
            && req.prompt.starts_with(&self.history)
            && (self.history.len() < req.prompt.len() || self.last_logits.is_some());
        if !reuse {
            self.reset()?;
        }
        // With plain greedy sampling and nobody asking for logits, the device
        // picks the token and only its id comes back.
        let mut constraint = req
            .constraint
            .as_ref()
            .map(|c| c.start(self.tokenizer.eog_ids()));
        let want = if on_logits.is_none() && sampler.is_plain_greedy() && constraint.is_none() {
            Want::Greedy
        } else {
            Want::Logits(Logits::Last)
        };
        timings.cache_n = self.history.len();
        let t0 = Instant::now();
        let new = req.prompt[self.history.len()..].to_vec();
        timings.prompt_n = new.len();
        let mut next = match self.last_logits.take() {
            Some(l) if new.is_empty() => StepOut::Logits(l),
            // Piece by piece (the pieces `feed` would cut, so the bits are the same),
            // reporting after each one.
            _ => {
                let chunk = self.exec.prompt_chunk();
                let n = new.len().div_ceil(chunk);
                let mut out = StepOut::Logits(Vec::new());
                for (i, piece) in new.chunks(chunk).enumerate() {
                    let last = i + 1 == n;
                    out = self.feed(piece, if last { want } else { Want::Greedy })?;
                    let progress = PromptProgress {
                        done: self.history.len(),
                        total: req.prompt.len(),
                        cached: timings.cache_n,
                    };
                    if on_prompt(&progress) == Flow::Stop {
                        timings.prompt_n = self.history.len() - timings.cache_n;
                        timings.prompt_ms = ms(t0.elapsed());
                        if let (true, StepOut::Logits(l)) = (last, out) {
                            self.last_logits = Some(l);
                        }
                        return Ok(Completion {
                            tokens: Vec::new(),
                            finish: FinishReason::Stopped,
                            timings,
                            seed,
                        });
                    }
                }
                out
            }
        };
        timings.prompt_ms = ms(t0.elapsed());
        if let (Some(f), StepOut::Logits(l)) = (on_logits.as_mut(), &next) {
            f(l);
        }

        let t1 = Instant::now();
        let mut out = Vec::new();
        let mut forced: std::collections::VecDeque<u32> = Default::default();
        // The constraint's mask for the position whose logits are in `next`.
        let mut mask = constraint.as_mut().map(|c| c.next_mask()).transpose()?;
        // `next` was edited by a mask (so it is not kept for the prompt cache).
        let mut masked = false;
        let finish = loop {
            if out.len() >= req.max_tokens {
                break FinishReason::Length;
            }
            if self.history.len() >= n_ctx {
                break FinishReason::ContextFull;
            }
            let (token, was_forced) = match forced.pop_front() {
                Some(t) => (t, true),
                None => match &mut next {
                    StepOut::Logits(l) => {
                        if let (Some(c), Some(m)) = (constraint.as_ref(), mask.as_ref()) {
                            c.apply(m, l);
                            masked = true;
                        }
                        (sampler.sample(l), false)
                    }
                    StepOut::Token(t) => (*t, false),
                },
            };
            if let Some(c) = constraint.as_mut() {
                c.on_token(token, was_forced)?;
            }
            sampler.accept(token);
            out.push(token);
            let eog = self.tokenizer.eog_ids().contains(&token);
            let ev = TokenEvent {
                token,
                index: out.len() - 1,
                forced: was_forced,
                eog,
            };
            match on_token(&ev) {
                Flow::Continue => {}
                Flow::Stop => break FinishReason::Stopped,
                Flow::Force(ts) => {
                    self.check_tokens(&ts)?;
                    forced.extend(ts);
                }
            }
            if eog && req.stop_at_eog && forced.is_empty() {
                break FinishReason::Eog;
            }
            if out.len() >= req.max_tokens {
                break FinishReason::Length;
            }
            // The next position's mask is computed while the step that produces its
            // logits runs (not needed when the next token is forced).
            match constraint.as_mut().filter(|_| forced.is_empty()) {
                None => {
                    next = self.feed(&[token], want)?;
                    mask = None;
                }
                Some(c) => {
                    let (stepped, m) = std::thread::scope(|s| {
                        let helper = s.spawn(|| c.next_mask());
                        let stepped = self.feed(&[token], want);
                        (stepped, helper.join())
                    });
                    next = stepped?;
                    mask = Some(m.map_err(|_| {
                        constraint::ConstraintError("the grammar failed (panic)".into())
                    })??);
                }
            }
            masked = false;
            if let (Some(f), StepOut::Logits(l)) = (on_logits.as_mut(), &next) {
                f(l);
            }
        };
        // `next` belongs to the end of the history (the last token emitted was
        // not fed), so a request repeating this history can start from its logits.
        self.last_logits = match next {
            StepOut::Logits(l) if !masked => Some(l),
            _ => None,
        };
        timings.predicted_n = out.len();
        timings.predicted_ms = ms(t1.elapsed());
        Ok(Completion {
            tokens: out,
            finish,
            timings,
            seed,
        })
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// More kernel threads than this many per CPU thread of the machine are refused: they
/// only take turns on the cores (and thousands of them take seconds just to start).
pub const MAX_THREADS_PER_CPU: usize = 4;

/// Checks a thread count the user asked for (`-t` / `--threads`, the config file's
/// `threads`): at least 1 and at most [`MAX_THREADS_PER_CPU`] × the CPU threads this
/// machine has.
pub fn check_threads(n: usize) -> Result<(), EngineError> {
    // Where the machine's count is unknown, allow what a large server has.
    let cpus = std::thread::available_parallelism().map_or(256, |c| c.get());
    let max = cpus.saturating_mul(MAX_THREADS_PER_CPU);
    if n == 0 {
        return Err(EngineError::Settings(format!(
            "-t/--threads 0: at least 1 thread is needed (leave it out to use all {cpus} CPU threads)"
        )));
    }
    if n > max {
        return Err(EngineError::Settings(format!(
            "-t/--threads {n} is more than {MAX_THREADS_PER_CPU}× the {cpus} CPU threads of this machine \
             (at most {max}); leave it out to use all {cpus}"
        )));
    }
    Ok(())
}

/// Where `generate_with_logits` hands each set of logits.
type LogitsSink<'a> = &'a mut dyn FnMut(&[f32]);

/// The routing profile `cfg.expert_profile` names, checked against the model.
#[cfg(feature = "cuda")]
fn load_profile(
    cfg: &EngineConfig,
    mcfg: &ModelConfig,
) -> Result<Option<experts::RoutingProfile>, EngineError> {
    cfg.expert_profile
        .as_deref()
        .map(|p| {
            experts::RoutingProfile::load(p, mcfg)
                .map_err(|e| EngineError::Settings(format!("--profile {}: {e}", p.display())))
        })
        .transpose()
}

#[cfg(feature = "cuda")]
fn cuda_budgets<'a>(
    cfg: &EngineConfig,
    profile: Option<&'a experts::RoutingProfile>,
) -> cuda::Budgets<'a> {
    cuda::Budgets {
        vram: cfg.vram_budget,
        ram: cfg.ram_budget,
        profile,
        cpu_share: cfg.cpu_expert_share,
    }
}

/// Opens the executor `cfg.device` names, or the best one present: the GPU when
/// the build has CUDA and one answers, else the CPU.
fn open_executor(
    cfg: &EngineConfig,
    mcfg: &ModelConfig,
    weights: ModelWeights,
    n_ctx: usize,
    routing: Option<Arc<experts::RoutingCounts>>,
) -> Result<Box<dyn Executor>, EngineError> {
    let recording = routing.is_some();
    let cpu = |weights| -> Result<Box<dyn Executor>, EngineError> {
        let backend = CpuBackend {
            cfg: mcfg.clone(),
            weights,
            precision: cfg.precision,
            routing,
        };
        Ok(Box::new(CpuExecutor::new(backend, n_ctx, 1)?))
    };
    match cfg.device {
        Some(Device::Cpu) => cpu(weights),
        Some(Device::Cuda(_)) if recording => Err(EngineError::Device(
            "routing is recorded by the CPU executor: use --device cpu".into(),
        )),
        #[cfg(feature = "cuda")]
        Some(Device::Cuda(n)) => {
            let profile = load_profile(cfg, mcfg)?;
            let budgets = cuda_budgets(cfg, profile.as_ref());
            Ok(Box::new(cuda::CudaExecutor::open(
                n, mcfg, &weights, n_ctx, 1, budgets,
            )?))
        }
        #[cfg(not(feature = "cuda"))]
        Some(Device::Cuda(_)) => Err(EngineError::Device(
            "this build of scoria has no CUDA support: rebuild with `--features cuda` \
             (see the README) or use --device cpu"
                .into(),
        )),
        None => {
            #[cfg(feature = "cuda")]
            if cfg.precision == cpu::Precision::Canonical && !recording {
                let profile = load_profile(cfg, mcfg)?;
                let budgets = cuda_budgets(cfg, profile.as_ref());
                match cuda::CudaExecutor::open(0, mcfg, &weights, n_ctx, 1, budgets) {
                    Ok(e) => return Ok(Box::new(e)),
                    Err(e) => tracing::info!("no usable GPU, running on the CPU: {e}"),
                }
            }
            cpu(weights)
        }
    }
}

#[cfg(test)]
mod cgroup_tests {
    use super::cgroup_headroom;

    #[test]
    fn the_tightest_limit_of_the_cgroup_and_its_ancestors_counts() {
        let d = tempfile::tempdir().expect("tempdir");
        let leaf = d.path().join("a/b");
        std::fs::create_dir_all(&leaf).expect("mkdir");
        let w = |p: &std::path::Path, name: &str, v: &str| {
            std::fs::write(p.join(name), v).expect("write")
        };
        w(&leaf, "memory.max", "max");
        w(&leaf, "memory.current", "100");
        assert_eq!(cgroup_headroom("0::/a/b\n", d.path()), None, "no limit set");
        w(&d.path().join("a"), "memory.max", "17179869184");
        w(&d.path().join("a"), "memory.current", "1073741824");
        assert_eq!(cgroup_headroom("0::/a/b\n", d.path()), Some(15 << 30));
        w(&leaf, "memory.max", "4096");
        assert_eq!(cgroup_headroom("0::/a/b\n", d.path()), Some(3996));
        // cgroup v1: the memory controller's own hierarchy.
        let v1 = d.path().join("memory/job");
        std::fs::create_dir_all(&v1).expect("mkdir");
        w(&v1, "memory.limit_in_bytes", "2000");
        w(&v1, "memory.usage_in_bytes", "500");
        assert_eq!(cgroup_headroom("4:memory:/job\n", d.path()), Some(1500));
        w(&v1, "memory.limit_in_bytes", "9223372036854771712");
        assert_eq!(
            cgroup_headroom("4:memory:/job\n", d.path()),
            None,
            "v1's 'unlimited'"
        );
    }
}
