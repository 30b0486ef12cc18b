//! `Engine`: one loaded model — its configuration, tokenizer and chat template, the
//! executor its steps run on (chosen and opened here), and the scheduler of its slots,
//! to which `submit` and `step` delegate.

use std::path::Path;
use std::sync::Arc;

use model::chat::ChatTemplate;
use model::tokenizer::Tokenizer;
use model::{ModelConfig, ModelWeights};

use crate::api::{
    Completion, Device, DeviceReport, EngineConfig, Flow, GenerateRequest, ModelInfo,
    PromptProgress, TokenEvent,
};
use crate::cpu::{CpuBackend, CpuExecutor, CpuTier};
use crate::error::EngineError;
use crate::exec::Executor;
use crate::experts;
use crate::memory::{self, ContextAsk, MemoryAccount, GIB};
use crate::prompt_cache::{self, PromptCache};
use crate::sched::{CacheReport, Limits, RequestCallbacks, Scheduler, SlotInfo};
use crate::spec::{Drafter, SpecConfig, SpecMode};

#[cfg(feature = "cuda")]
use crate::cuda;

#[cfg(test)]
mod expert_account_tests;
#[cfg(test)]
mod spec_tests;

/// One loaded model and its slots: `submit` queues requests, `step` decodes one
/// token for each running request (the scheduler, `sched`); `generate*` runs one
/// request to its end when nothing else is queued.
pub struct Engine {
    info: ModelInfo,
    cfg: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    template: Option<Arc<ChatTemplate>>,
    /// Runs the model steps (CPU or CUDA); holds the weights and the state of
    /// every slot's sequence.
    exec: Box<dyn Executor>,
    /// The routing recorder, with `EngineConfig::record_routing`.
    routing: Option<Arc<experts::RoutingCounts>>,
    /// The slots, the queue, the running requests and the prompt cache.
    sched: Scheduler,
    memory: MemoryAccount,
    /// The vision encoder's configuration (`EngineConfig::mmproj`; None: text only).
    vision: Option<model::vision::VisionConfig>,
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

        let ask = match cfg.max_context {
            Some(n) if n < 16 => {
                return Err(EngineError::Memory(format!(
                    "--max-context {n} is too small (at least 16)"
                )))
            }
            Some(n) => ContextAsk::Fixed(n),
            None => ContextAsk::Auto,
        };
        // The slots when none are asked for (the memory check below counts them; a
        // GPU executor takes one instead when that many would push experts out of VRAM).
        let parallel = cfg.parallel.unwrap_or(DEFAULT_PARALLEL_CPU);
        if parallel == 0 || parallel > MAX_PARALLEL {
            return Err(EngineError::Settings(format!(
                "--parallel {parallel}: the number of slots must be 1 to {MAX_PARALLEL}"
            )));
        }
        let available = memory::mem_available();
        let routing = cfg
            .record_routing
            .then(|| Arc::new(experts::RoutingCounts::for_model(&mcfg)));
        // The image encoder first: on a GPU its weights and scratch are allocated before
        // the executor measures what VRAM it has.
        let vision = cfg
            .mmproj
            .as_deref()
            .map(|p| open_vision(p, &mcfg, cfg))
            .transpose()?;
        let (mut exec, n_ctx) =
            open_executor(cfg, &file, &mcfg, weights, ask, available, routing.clone())?;
        // The executor's slots (a tiered GPU takes one unless asked for more): the account
        // counts those (no more than the memory check counted).
        let parallel = exec.sequences();
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
        // Snapshots restore only where the same kernels computed them: the CPU's
        // bits do not depend on its ISA (invariant 1), a GPU's may differ from the
        // CPU's and from another GPU model's.
        let report = exec.report();
        // Tiered experts on the CPU stay out of the page cache (they are read with
        // O_DIRECT): only a CPU reading every expert from the map pre-reads it.
        if report.device == Device::Cpu && exec.expert_stats().is_none() {
            memory::populate_weights(&file, available);
        }
        let numerics = match report.device {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(_) => format!("cuda {}", report.name),
        };
        let model_id = format!(
            "{}:{}:{}:{}:{}:{numerics}",
            info.arch,
            info.name,
            info.file_bytes,
            info.n_vocab,
            fingerprint(&file)
        );
        let boundary = tokenizer
            .token_id("<|im_start|>")
            .map(|token| crate::sched::MessageStart {
                token,
                system: match tokenizer.encode("system", false).as_deref() {
                    Ok([t]) => Some(*t),
                    _ => None,
                },
            });
        let limits = Limits {
            n_ctx,
            n_vocab: mcfg.n_vocab,
            eog: tokenizer.eog_ids().to_vec(),
        };
        let store = open_prompt_cache(cfg, exec.as_ref(), &model_id, available)?;
        let prompt_cache = store.as_ref().map_or(0, |s| s.budget() as u64);
        let store_writer = match (&store, &cfg.prompt_cache_dir) {
            (Some(_), Some(dir)) => Some(prompt_cache::Writer::new(dir.clone(), model_id.clone())),
            _ => None,
        };
        let mut memory = MemoryAccount::new(&file, &mcfg, n_ctx, parallel, prompt_cache, available);
        let drafter = choose_drafter(&cfg.spec, &mcfg, exec.as_mut())?;
        let mut sched = Scheduler::new(
            parallel,
            limits,
            mcfg.ssm.is_some(),
            boundary,
            store,
            store_writer,
        );
        sched.set_spec(cfg.spec, drafter);
        let vision_cfg = vision.map(|v| {
            memory.vision_bytes = v.model.bytes();
            #[cfg(feature = "cuda")]
            if let Some(g) = &v.gpu {
                memory.vision_vram = g.weight_bytes() + g.scratch_bytes();
            }
            let c = v.model.config().clone();
            sched.set_vision(v);
            c
        });
        Ok(Engine {
            info,
            cfg: mcfg,
            tokenizer: Arc::new(tokenizer),
            template,
            exec,
            routing,
            sched,
            memory,
            vision: vision_cfg,
        })
    }

    /// The vision encoder's configuration, when the engine has one (`EngineConfig::mmproj`):
    /// what image preprocessing needs, and how many rows an image takes.
    pub fn vision(&self) -> Option<&model::vision::VisionConfig> {
        self.vision.as_ref()
    }

    /// The draft source speculative decoding uses (None: off).
    pub fn drafter(&self) -> Option<Drafter> {
        self.sched.drafter()
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

    /// What the reads of tiered experts from the model file have done so far
    /// (reads, retries, failures, stalls); `None` when no expert is read from it.
    pub fn expert_reads(&self) -> Option<experts::ReadCounters> {
        self.exec.expert_reads()
    }

    /// The executor's failure after which it runs nothing more (a GPU's sticky context
    /// error, a lost device), once one happened: every request is refused from then on
    /// and the process must be restarted (the server reports it unhealthy and exits).
    pub fn fatal(&self) -> Option<&str> {
        self.sched.fatal()
    }

    /// A fault that keeps some requests from being served until it clears or the
    /// process restarts — the model file changed under the running server, an
    /// expert read is out past its deadline — in words; `None` while healthy (for
    /// `/health`).
    pub fn standing_fault(&self) -> Option<String> {
        self.exec.standing_fault()
    }

    /// A condition the server goes on serving with but that makes requests slower
    /// or some of them fail — the GPU short of memory because another process took
    /// VRAM — in words; `None` while there is none (for `/health`'s `warning`).
    pub fn standing_warning(&self) -> Option<String> {
        self.exec.standing_warning()
    }

    /// The ISA the CPU kernels use.
    pub fn kernel_isa(&self) -> &'static str {
        quant::kernel_isa()
    }

    /// Forgets every slot's cached sequence (no request may be running).
    pub fn reset(&mut self) -> Result<(), EngineError> {
        self.sched.reset(self.exec.as_mut())
    }

    /// The slots: how many there are.
    pub fn parallel(&self) -> usize {
        self.sched.parallel()
    }

    /// What each slot holds now.
    pub fn slots(&self) -> Vec<SlotInfo> {
        self.sched.slots()
    }

    /// Waits until the prompt cache's files mirror what it holds now (its writes
    /// run on a thread of their own; dropping the engine also waits for them).
    pub fn flush_prompt_cache(&self) {
        self.sched.flush_prompt_cache()
    }

    /// How prompts were served from cached state so far.
    pub fn cache_report(&self) -> CacheReport {
        self.sched.cache_report()
    }

    /// Sequences the last `step` ran in its executor call (0: none).
    pub fn last_step_size(&self) -> usize {
        self.sched.last_step_size()
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.sched.queued()
    }

    /// True while requests are queued or running.
    pub fn busy(&self) -> bool {
        self.sched.busy()
    }

    /// Queues `req`; `step` admits it to a slot in arrival order and reports to
    /// `sink` until it ends (`RequestCallbacks::done`, exactly once).
    pub fn submit(&mut self, req: GenerateRequest, sink: Box<dyn RequestCallbacks + Send>) {
        self.sched.submit(req, sink)
    }

    /// Admits what fits, then decodes one token of every running request (and one
    /// piece of the first waiting prompt) in one executor step. True while work
    /// remains.
    pub fn step(&mut self) -> bool {
        self.sched.step(self.exec.as_mut())
    }

    /// Evaluates `tokens` from an empty state and returns the logits of every
    /// position (n_vocab each), for parity tests and `--dump-logits`.
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.sched.logits_all(self.exec.as_mut(), tokens)
    }

    /// Times verify steps of the given tokens after `prefix` (see
    /// `Scheduler::time_verify`): each step's wall time in ms.
    pub fn time_verify(
        &mut self,
        prefix: &[u32],
        steps: &[Vec<u32>],
    ) -> Result<Vec<f64>, EngineError> {
        self.sched.time_verify(self.exec.as_mut(), prefix, steps)
    }

    /// Decodes `req`, calling `on_token` after every token.
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
    ) -> Result<Completion, EngineError> {
        self.generate_with_progress(req, &mut |_| Flow::Continue, on_token)
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
        self.sched
            .run_alone(self.exec.as_mut(), req, on_prompt, on_token, None)
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
        self.sched.run_alone(
            self.exec.as_mut(),
            req,
            &mut |_| Flow::Continue,
            on_token,
            Some(on_logits),
        )
    }
}

/// A fingerprint of a model's weights for the prompt cache's model id: its tensors'
/// names, types and shapes and the first 4 KiB of each one's bytes (SHA-256, 16 hex
/// digits). Two files of one name, size and vocabulary with other weights (a
/// fine-tune, another seed) differ here, so neither loads the other's entries; it
/// reads a page or two per tensor.
fn fingerprint(file: &gguf::GgufFile) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for t in file.tensors() {
        h.update((t.name.len() as u64).to_le_bytes());
        h.update(t.name.as_bytes());
        h.update(format!("{:?}{:?}", t.ty, t.dims).as_bytes());
        if let Ok(d) = file.try_tensor_data(t) {
            h.update(&d[..d.len().min(4096)]);
        }
    }
    h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Prompt-cache budget when none is set: at most this, and at most a quarter of
/// the memory available at load.
pub const DEFAULT_PROMPT_CACHE: u64 = 8 << 30;

/// The prompt cache `cfg` asks for, loaded from its directory when it has one.
fn open_prompt_cache(
    cfg: &EngineConfig,
    exec: &dyn Executor,
    model_id: &str,
    available: Option<u64>,
) -> Result<Option<PromptCache>, EngineError> {
    let budget = cfg.prompt_cache.unwrap_or_else(|| {
        DEFAULT_PROMPT_CACHE.min(available.map_or(DEFAULT_PROMPT_CACHE, |a| a / 4))
    });
    if budget == 0 {
        return Ok(None);
    }
    if !exec.snapshots() {
        tracing::info!(
            "prompt cache: off on this executor (it cannot snapshot sequences); each slot still reuses its own last conversation"
        );
        return Ok(None);
    }
    if let Some(avail) = available {
        if budget > avail {
            return Err(EngineError::Memory(format!(
                "--prompt-cache {:.2} GiB is more than the {:.2} GiB of RAM available; lower it (0 turns it off)",
                budget as f64 / GIB,
                avail as f64 / GIB
            )));
        }
    }
    let mut store = PromptCache::new(usize::try_from(budget).unwrap_or(usize::MAX));
    if let Some(dir) = &cfg.prompt_cache_dir {
        // The directory only makes a restart warm: a problem with it is logged and
        // the server starts with what it could read.
        match store.load_dir(dir, model_id) {
            Ok(r) => tracing::info!(
                "prompt cache: {} conversation(s) loaded from {} ({} file(s) skipped)",
                r.loaded,
                dir.display(),
                r.skipped
            ),
            Err(e) => tracing::warn!(
                "prompt cache: --prompt-cache-dir {}: {e}; starting with an empty cache",
                dir.display()
            ),
        }
    }
    Ok(Some(store))
}

/// Slots on the CPU when `EngineConfig::parallel` is None.
pub const DEFAULT_PARALLEL_CPU: usize = 4;

/// The most slots `--parallel` may ask for.
pub const MAX_PARALLEL: usize = 64;

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

/// The vision encoder of `path` for a model of `mcfg`, refused (with the numbers) when
/// it belongs to another model. Its rows go into the text model's steps as they are.
/// It runs on the GPU the executor would take (`--device cuda:N`, or GPU 0 when no
/// device is named), with a copy on the CPU for images over the GPU's scratch; on
/// the CPU alone with `--device cpu`, without a GPU, or when the GPU cannot take it
/// (said in the log).
fn open_vision(
    path: &Path,
    mcfg: &ModelConfig,
    cfg: &EngineConfig,
) -> Result<crate::sched::media::Vision, EngineError> {
    let model = model::vision::encoder::VisionModel::open(path)?;
    let out = model.config().out_hidden;
    if out != mcfg.n_embd {
        return Err(EngineError::Settings(format!(
            "--mmproj {}: the encoder gives rows of {out} values but this model's hidden size is {}; the mmproj file belongs to another model (use the one published with it)",
            path.display(),
            mcfg.n_embd
        )));
    }
    if mcfg.rope_sections.is_none() {
        return Err(EngineError::Settings(format!(
            "--mmproj {}: this model ({}) has no multimodal rotary positions (rope.dimension_sections); images need a Qwen3.5/3.6 model",
            path.display(),
            mcfg.arch.name()
        )));
    }
    let c = model.config();
    let shape = format!(
        "{} blocks of width {}, patch {}, merge {}",
        c.n_layer, c.hidden, c.patch_size, c.merge
    );
    #[allow(unused_mut)]
    let mut vision = crate::sched::media::Vision::new(model);
    #[cfg(feature = "cuda")]
    {
        let ordinal = match cfg.device {
            Some(Device::Cuda(n)) => Some(n),
            Some(Device::Cpu) => None,
            None => (cfg.precision == crate::api::Precision::Canonical
                && ::cuda::Gpu::device_count().is_ok_and(|n| n > 0))
            .then_some(0),
        };
        if cfg.vision_gpu_patches == Some(0) {
            tracing::info!(
                "vision encoder {}: {shape} (on the CPU: --vision-gpu-patches 0)",
                path.display()
            );
            return Ok(vision);
        }
        if let Some(n) = ordinal {
            match cuda::vision::GpuEncoder::open(n, &vision.model, cfg.vision_gpu_patches) {
                Ok(g) => {
                    tracing::info!(
                        "vision encoder {}: {shape}, on cuda:{n} ({:.2} GiB of weights, {:.2} GiB of scratch for images of up to {} patches; larger ones on the CPU, --vision-gpu-patches sets it)",
                        path.display(),
                        g.weight_bytes() as f64 / GIB,
                        g.scratch_bytes() as f64 / GIB,
                        g.max_patches()
                    );
                    vision.gpu = Some(g);
                    return Ok(vision);
                }
                Err(e) => tracing::warn!(
                    "vision encoder {}: not on cuda:{n} ({e}); images are encoded on the CPU",
                    path.display()
                ),
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = cfg;
    tracing::info!("vision encoder {}: {shape} (on the CPU)", path.display());
    Ok(vision)
}

/// The routing profile `cfg.expert_profile` names, checked against the model.
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
        prompt_pool: cfg.prompt_pool,
        guess_experts: cfg.guess_experts.unwrap_or(crate::DEFAULT_GUESS_EXPERTS),
        slots_flexible: cfg.parallel.is_none(),
        verify_tokens: match cfg.spec.mode {
            SpecMode::Off => 0,
            _ => cfg.spec.draft_max + 1,
        },
        mtp: matches!(cfg.spec.mode, SpecMode::Auto | SpecMode::Mtp),
        reads: read_policy(cfg),
    }
}

/// How tiered experts held only in the file are read (both executors).
fn read_policy(cfg: &EngineConfig) -> experts::ReadPolicy {
    experts::ReadPolicy {
        deadline: cfg
            .expert_read_deadline
            .unwrap_or(experts::DEFAULT_READ_DEADLINE),
        ..Default::default()
    }
}

/// Opens the executor `cfg.device` names, or the best one present: the GPU when
/// the build has CUDA and one answers, else the CPU.
///
/// Returns it with its context: `ask`'s, or the one chosen for `ContextAsk::Auto`
/// (logged with why). On the CPU the K/V and state of the pool are checked against
/// the `available` RAM before anything is allocated; a GPU checks its VRAM.
fn open_executor(
    cfg: &EngineConfig,
    file: &gguf::GgufFile,
    mcfg: &ModelConfig,
    weights: ModelWeights,
    ask: ContextAsk,
    available: Option<u64>,
    routing: Option<Arc<experts::RoutingCounts>>,
) -> Result<(Box<dyn Executor>, usize), EngineError> {
    let cpu_seqs = cfg.parallel.unwrap_or(DEFAULT_PARALLEL_CPU);
    #[cfg(feature = "cuda")]
    let gpu_seqs = cfg.parallel.unwrap_or(DEFAULT_PARALLEL_CPU);
    let recording = routing.is_some();
    // A context no address space holds is refused on any device (the VRAM check
    // would only say it does not fit).
    if let ContextAsk::Fixed(n) = ask {
        memory::check_state(mcfg, n, cpu_seqs, None)?;
    }
    #[cfg(feature = "cuda")]
    let gpu = |e: cuda::CudaExecutor| {
        let n_ctx = e.context();
        (Box::new(e) as Box<dyn Executor>, n_ctx)
    };
    let cpu = |weights| -> Result<(Box<dyn Executor>, usize), EngineError> {
        let (n_ctx, chosen) = match ask {
            ContextAsk::Fixed(n) => (n, None),
            ContextAsk::Auto => {
                let (n, why) =
                    memory::auto_context_cpu(mcfg, cpu_seqs, available, file.file_size());
                (n, Some(why))
            }
        };
        memory::check_state(mcfg, n_ctx, cpu_seqs, available)?;
        memory::log_context(n_ctx, mcfg.n_ctx_train, chosen.as_deref(), false);
        // A RAM budget on the CPU tiers the experts (cpu/tier.rs).
        let tier = match cfg.ram_budget {
            Some(budget) => {
                let profile = load_profile(cfg, mcfg)?;
                let policy = read_policy(cfg);
                Some(CpuTier::open(file, mcfg, budget, profile.as_ref(), policy)?)
            }
            None => None,
        };
        let backend = CpuBackend {
            cfg: mcfg.clone(),
            weights,
            precision: cfg.precision,
            routing,
            tier,
            hidden: Default::default(),
        };
        Ok((Box::new(CpuExecutor::new(backend, n_ctx, cpu_seqs)?), n_ctx))
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
            Ok(gpu(cuda::CudaExecutor::open_with(
                n, mcfg, &weights, ask, gpu_seqs, budgets,
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
            if cfg.precision == crate::api::Precision::Canonical && !recording {
                let profile = load_profile(cfg, mcfg)?;
                let budgets = cuda_budgets(cfg, profile.as_ref());
                match cuda::CudaExecutor::open_with(0, mcfg, &weights, ask, gpu_seqs, budgets) {
                    Ok(e) => return Ok(gpu(e)),
                    Err(e @ EngineError::Device(_)) => {
                        tracing::info!("no usable GPU, running on the CPU: {e}")
                    }
                    // A GPU that answers but cannot take this model (its shapes, its
                    // types, its size): say so louder than a machine without one.
                    Err(e) => {
                        tracing::warn!("the GPU cannot run this model, running on the CPU: {e}")
                    }
                }
            }
            cpu(weights)
        }
    }
}

/// The draft source for `spec` on this model and executor: `auto` takes what both
/// support (prompt lookup where the executor can roll a sequence back, else none);
/// an explicit mode they cannot serve is refused with the reason and the remedy.
fn choose_drafter(
    spec: &SpecConfig,
    cfg: &ModelConfig,
    exec: &mut dyn Executor,
) -> Result<Option<Drafter>, EngineError> {
    spec.check().map_err(EngineError::Settings)?;
    let device = exec.report().device;
    let refuse = |why: String| {
        Err(EngineError::Settings(format!(
            "--spec {}: {why}; use --spec auto (which picks what this model and device \
             support) or --spec off",
            spec.mode
        )))
    };
    match spec.mode {
        SpecMode::Off => Ok(None),
        _ if !exec.rollbacks() && spec.mode == SpecMode::Auto => Ok(None),
        _ if !exec.rollbacks() => refuse(format!(
            "the {device} executor cannot roll a sequence back after a verify step"
        )),
        // The model's own MTP block where it has one and the executor runs it (with
        // prompt lookup where the text repeats a long stretch), else prompt lookup.
        SpecMode::Auto => Ok(Some(if exec.enable_mtp() {
            Drafter::MtpAndNgram
        } else {
            Drafter::Ngram
        })),
        SpecMode::Ngram => Ok(Some(Drafter::Ngram)),
        SpecMode::Mtp if cfg.n_nextn == 0 => {
            refuse("this model file has no MTP (nextn) layer".to_string())
        }
        SpecMode::Mtp if !exec.enable_mtp() => refuse(format!(
            "the {device} executor does not run this model's MTP block (the log says why; \
             prompt lookup drafts without it: --spec ngram)"
        )),
        SpecMode::Mtp => Ok(Some(Drafter::Mtp)),
    }
}
