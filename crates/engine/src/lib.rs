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
pub mod sched;

pub use api::*;

use cpu::{CpuBackend, CpuExecutor};
use exec::{Executor, SeqStep, StepOut, Want};
use model::chat::ChatTemplate;
use model::tokenizer::Tokenizer;
use model::{ExecError, Logits, ModelConfig, ModelWeights};
pub use sched::RequestCallbacks;
use sched::{Active, Closures, Limits, LogitsFn, SeqCache};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;

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
    /// KV cache and recurrent state at most: the context pool's positions (shared
    /// by the slots) and every slot's recurrent state.
    pub state_bytes: u64,
    /// Slots, and the positions of the context pool they share.
    pub parallel: usize,
    pub pool_positions: usize,
    /// K/V bytes of one position, and recurrent-state bytes of one slot.
    pub bytes_per_position: u64,
    pub recurrent_bytes: u64,
    /// RAM the prompt cache may hold (0: off).
    pub prompt_cache: u64,
    /// MemAvailable when loading, if known.
    pub available: Option<u64>,
}

impl MemoryAccount {
    /// One line for the startup log: where the memory goes.
    pub fn describe(&self) -> String {
        let gib = |b: u64| b as f64 / GIB;
        format!(
            "weights {:.2} GiB memory-mapped ({:.2} GiB routed experts, {:.2} GiB dense); \
             KV + recurrent state up to {:.3} GiB ({} positions shared by {} slot(s) × {:.1} KiB, \
             + {:.1} MiB recurrent per slot); prompt cache up to {:.2} GiB{}",
            gib(self.weights_mapped),
            gib(self.expert_bytes),
            gib(self.weights_mapped.saturating_sub(self.expert_bytes)),
            gib(self.state_bytes),
            self.pool_positions,
            self.parallel,
            self.bytes_per_position as f64 / 1024.0,
            self.recurrent_bytes as f64 / (1u64 << 20) as f64,
            gib(self.prompt_cache),
            self.available
                .map(|a| format!("; {:.2} GiB RAM available", gib(a)))
                .unwrap_or_default()
        )
    }
}

/// A request waiting for a slot.
type Queued = (GenerateRequest, Box<dyn RequestCallbacks + Send>);

/// One loaded model and its slots: `submit` queues requests, `step` decodes one
/// token for each running request (`sched`); `generate*` runs one request to its
/// end when nothing else is queued.
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
    /// What each slot's sequence holds (its prompt cache).
    seqs: Vec<SeqCache>,
    /// Requests waiting for a slot, in arrival order.
    queue: VecDeque<Queued>,
    /// Requests decoding, in admission order.
    running: Vec<(Active, Box<dyn RequestCallbacks + Send>)>,
    /// Admissions so far (orders the slots' last use).
    tick: u64,
    /// Conversations no slot holds any more (None: off, or the executor cannot
    /// snapshot its sequences).
    store: Option<prompt_cache::PromptCache>,
    /// Mirrors the prompt cache into `--prompt-cache-dir` on its own thread (None:
    /// memory only).
    store_writer: Option<prompt_cache::Writer>,
    /// The token that starts a chat message (`<|im_start|>`), where a later prompt
    /// may diverge from this one.
    boundary: Option<u32>,
    counters: CacheCounters,
    /// The limits every request is checked against (context, vocabulary,
    /// end-of-generation tokens).
    limits: Limits,
    /// Sequences the last `step` ran (0: it ran none).
    last_ran: usize,
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
        // The slots when none are asked for (the memory check below counts them; a
        // GPU executor takes one instead when that many would push experts out of VRAM).
        let parallel = cfg.parallel.unwrap_or(DEFAULT_PARALLEL_CPU);
        if parallel == 0 || parallel > MAX_PARALLEL {
            return Err(EngineError::Settings(format!(
                "--parallel {parallel}: the number of slots must be 1 to {MAX_PARALLEL}"
            )));
        }
        // Positions are one pool the slots share (the CPU's K/V grow with use);
        // recurrent state is per slot.
        let per_position = mcfg.kv_bytes_per_position();
        let recurrent = mcfg.recurrent_state_bytes();
        let state_bytes = mcfg
            .seq_state_bytes(n_ctx)
            .saturating_add(recurrent.saturating_mul(parallel - 1));
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
                    "the KV cache and recurrent state of a context of --max-context {n_ctx} positions shared by {parallel} slot(s) need {:.2} GiB, but only {:.2} GiB of RAM is available; lower --max-context or --parallel",
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
        // The executor's slots (a tiered GPU takes one unless asked for more): the account
        // counts those (no more than the check above did).
        let parallel = exec.sequences();
        let state_bytes = (mcfg.seq_state_bytes(n_ctx) + recurrent * (parallel - 1)) as u64;
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
        if report.device == Device::Cpu {
            populate_weights(&file, available);
        }
        let numerics = match report.device {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(_) => format!("cuda {}", report.name),
        };
        let model_id = format!(
            "{}:{}:{}:{}:{numerics}",
            info.arch, info.name, info.file_bytes, info.n_vocab
        );
        let boundary = tokenizer.token_id("<|im_start|>");
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
        Ok(Engine {
            info,
            cfg: mcfg,
            tokenizer: Arc::new(tokenizer),
            template,
            exec,
            routing,
            seqs: (0..parallel).map(|_| SeqCache::default()).collect(),
            queue: VecDeque::new(),
            running: Vec::new(),
            tick: 0,
            store,
            store_writer,
            boundary,
            counters: CacheCounters::default(),
            limits,
            last_ran: 0,
            memory: MemoryAccount {
                weights_mapped: tensor_bytes,
                expert_bytes,
                state_bytes,
                parallel,
                pool_positions: n_ctx,
                bytes_per_position: per_position as u64,
                recurrent_bytes: recurrent as u64,
                prompt_cache,
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

    /// Forgets every slot's cached sequence (no request may be running).
    pub fn reset(&mut self) -> Result<(), EngineError> {
        self.check_idle()?;
        for seq in 0..self.seqs.len() {
            self.clear_seq(seq)?;
        }
        Ok(())
    }

    fn clear_seq(&mut self, seq: usize) -> Result<(), EngineError> {
        let c = &mut self.seqs[seq];
        c.history.clear();
        c.last_logits = None;
        c.marks.clear();
        self.exec.clear(seq)?;
        Ok(())
    }

    fn check_idle(&self) -> Result<(), EngineError> {
        if self.running.is_empty() && self.queue.is_empty() {
            Ok(())
        } else {
            Err(EngineError::Settings(
                "the engine is decoding submitted requests: step it until they end first".into(),
            ))
        }
    }

    /// The slots: how many there are.
    pub fn parallel(&self) -> usize {
        self.seqs.len()
    }

    /// What each slot holds now.
    pub fn slots(&self) -> Vec<SlotInfo> {
        self.seqs
            .iter()
            .enumerate()
            .map(|(id, c)| {
                let act = self.running.iter().find(|(a, _)| a.seq == id);
                SlotInfo {
                    id,
                    busy: c.busy,
                    cached_tokens: c.history.len(),
                    prompt_tokens: act.map(|(a, _)| a.req.prompt.len()),
                }
            })
            .collect()
    }

    /// Waits until the prompt cache's files mirror what it holds now (its writes
    /// run on a thread of their own; dropping the engine also waits for them).
    pub fn flush_prompt_cache(&self) {
        if let Some(w) = &self.store_writer {
            w.flush();
        }
    }

    /// How prompts were served from cached state so far.
    pub fn cache_report(&self) -> CacheReport {
        CacheReport {
            counters: self.counters,
            store: self.store.as_ref().map(|s| s.stats()),
        }
    }

    /// Sequences the last `step` ran in its executor call (0: none).
    pub fn last_step_size(&self) -> usize {
        self.last_ran
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// True while requests are queued or running.
    pub fn busy(&self) -> bool {
        !self.running.is_empty() || !self.queue.is_empty()
    }

    /// Queues `req`; `step` admits it to a slot in arrival order and reports to
    /// `sink` until it ends (`RequestCallbacks::done`, exactly once).
    pub fn submit(&mut self, req: GenerateRequest, sink: Box<dyn RequestCallbacks + Send>) {
        self.queue.push_back((req, sink));
    }

    /// Admits what fits, then decodes one token of every running request (and one
    /// piece of the first waiting prompt) in one executor step. True while work
    /// remains.
    pub fn step(&mut self) -> bool {
        if self.running.is_empty() {
            // A slot still marked busy lost its request to a panic mid-step: its
            // state may hold part of that step, so it starts over.
            for seq in 0..self.seqs.len() {
                if self.seqs[seq].busy {
                    self.seqs[seq].busy = false;
                    if let Err(e) = self.clear_seq(seq) {
                        tracing::warn!("slot {seq}: clearing after a failed step: {e}");
                    }
                }
            }
        }
        while let Some(seq) = self.free_seq() {
            let Some((req, mut sink)) = self.queue.pop_front() else {
                break;
            };
            if sink.cancelled() {
                sink.done(Ok(Completion {
                    tokens: Vec::new(),
                    finish: FinishReason::Stopped,
                    timings: Timings::default(),
                    seed: req.sampling.seed.unwrap_or(0),
                }));
                continue;
            }
            let logits = sink.wants_logits();
            match self.admit(seq, req, logits, sink.as_mut()) {
                Ok(Some(act)) => self.running.push((act, sink)),
                Ok(None) => {}
                Err(e) => sink.done(Err(e)),
            }
        }
        self.last_ran = 0;
        if self.running.is_empty() {
            return !self.queue.is_empty();
        }
        self.make_room();
        let mut running = std::mem::take(&mut self.running);
        let mut items: Vec<(&mut Active, &mut dyn RequestCallbacks)> = running
            .iter_mut()
            .map(|(a, s)| (a, s.as_mut() as &mut dyn RequestCallbacks))
            .collect();
        let room = self
            .info
            .n_ctx
            .saturating_sub(self.seqs.iter().map(|c| c.history.len()).sum());
        let mut done = sched::step(
            self.exec.as_mut(),
            &mut self.seqs,
            &self.limits,
            &mut items,
            room,
        );
        if done.ran == 0 && done.starved {
            // Every running request waits for room that only they hold: the newest
            // ends (finish `ContextFull`) so the others can go on.
            if let Some(i) = (0..items.len()).rev().find(|&i| !done.ended[i]) {
                let (act, sink) = &mut items[i];
                tracing::warn!(
                    "the context pool of {} positions is full: request in slot {} ends (raise --max-context or lower --parallel)",
                    self.info.n_ctx,
                    act.seq
                );
                sched::end(
                    act,
                    &mut **sink,
                    FinishReason::ContextFull,
                    self.exec.expert_stats(),
                );
                done.ended[i] = true;
            }
        }
        self.last_ran = done.ran;
        let ended = done.ended;
        drop(items);
        let mut i = 0;
        running.retain(|(a, _)| {
            let keep = !ended[i];
            i += 1;
            if !keep {
                self.seqs[a.seq].busy = false;
            }
            keep
        });
        self.running = running;
        self.busy()
    }

    /// Frees the positions idle slots hold (least recently used first; their
    /// conversations go to the prompt cache) until the pool has room for the next
    /// step: a token per running request and a prompt piece.
    fn make_room(&mut self) {
        let want = self.running.len() + self.exec.prompt_chunk();
        loop {
            let used: usize = self.seqs.iter().map(|c| c.history.len()).sum();
            if used + want <= self.info.n_ctx {
                return;
            }
            let idle = (0..self.seqs.len())
                .filter(|&i| !self.seqs[i].busy && !self.seqs[i].history.is_empty())
                .min_by_key(|&i| self.seqs[i].last_used);
            let Some(seq) = idle else {
                return;
            };
            self.stash_seq(seq);
            if let Err(e) = self.clear_seq(seq) {
                tracing::warn!("slot {seq}: freeing its positions: {e}");
                return;
            }
        }
    }

    /// A free slot, when there is one and a request waits.
    fn free_seq(&self) -> Option<usize> {
        let (req, _) = self.queue.front()?;
        self.pick_seq(&req.prompt)
    }

    /// The free slot that keeps the most of `prompt`; else the least recently used.
    fn pick_seq(&self, prompt: &[u32]) -> Option<usize> {
        let recurrent = self.cfg.ssm.is_some();
        self.seqs
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.busy)
            .max_by_key(|(_, c)| {
                (
                    sched::reusable(c, prompt, recurrent).keep,
                    std::cmp::Reverse(c.last_used),
                )
            })
            .map(|(i, _)| i)
    }

    /// Checks `req`, prepares slot `seq` for it (keeping what its cache or the
    /// prompt cache can give), and starts it; `None` when it ended at once (the
    /// sink was told).
    fn admit(
        &mut self,
        seq: usize,
        req: GenerateRequest,
        logits: bool,
        sink: &mut dyn RequestCallbacks,
    ) -> Result<Option<Active>, EngineError> {
        self.limits.validate(&req)?;
        let keep = self.prepare_seq(seq, &req.prompt)?;
        self.tick += 1;
        self.seqs[seq].last_used = self.tick;
        sink.admitted(seq, keep);
        let marks = if self.cfg.ssm.is_some() && self.exec.snapshots() {
            let at = sched::mark_positions(&req.prompt, self.boundary);
            sched::spaced_marks(at, keep, self.exec.min_mark_gap())
        } else {
            Vec::new()
        };
        let experts = self.exec.expert_stats();
        let mut act = Active::new(seq, req, keep, &self.limits, logits, marks, experts);
        let c = &mut self.seqs[seq];
        if sched::start_cached(&mut act, c, &self.limits, sink) {
            return Ok(None);
        }
        c.busy = true;
        Ok(Some(act))
    }

    /// Makes slot `seq`'s state a prefix of `prompt`, as long as its own cache or
    /// the prompt cache allows; returns how many prompt tokens it holds. A
    /// conversation the slot held and now loses goes to the prompt cache.
    fn prepare_seq(&mut self, seq: usize, prompt: &[u32]) -> Result<usize, EngineError> {
        let recurrent = self.cfg.ssm.is_some();
        let own = sched::reusable(&self.seqs[seq], prompt, recurrent);
        let stored = match self.store.as_mut() {
            Some(st) => st.peek(prompt),
            None => 0,
        };
        if stored > own.keep {
            self.stash_seq(seq);
            let hit = self.store.as_mut().and_then(|st| st.lookup(prompt));
            if let Some(hit) = hit {
                let c = &mut self.seqs[seq];
                c.history.clear();
                c.last_logits = None;
                c.marks.clear();
                match self.exec.restore(seq, &hit.snapshot, hit.matched) {
                    Ok(()) => {
                        self.seqs[seq].history = prompt[..hit.matched].to_vec();
                        self.counters.store_hits += 1;
                        self.counters.tokens_reused += hit.matched as u64;
                        return Ok(hit.matched);
                    }
                    Err(e) => {
                        tracing::warn!(
                            "prompt cache: restoring {} tokens failed: {e}",
                            hit.matched
                        );
                        self.clear_seq(seq)?;
                        self.counters.misses += 1;
                        return Ok(0);
                    }
                }
            }
        }
        if own.keep < self.seqs[seq].history.len() {
            self.stash_seq(seq);
        }
        if own.keep == 0 {
            self.clear_seq(seq)?;
            self.counters.misses += 1;
            return Ok(0);
        }
        if let Some(i) = own.mark {
            let snap = self.seqs[seq].marks[i].snap.clone();
            if let Err(e) = self.exec.restore_recurrent(seq, &snap) {
                tracing::warn!("slot {seq}: going back to position {}: {e}", own.keep);
                self.clear_seq(seq)?;
                self.counters.misses += 1;
                return Ok(0);
            }
        }
        let c = &mut self.seqs[seq];
        if own.keep < c.history.len() {
            c.history.truncate(own.keep);
            c.last_logits = None;
        }
        c.marks.retain(|m| m.pos <= own.keep);
        self.counters.slot_hits += 1;
        self.counters.tokens_reused += own.keep as u64;
        Ok(own.keep)
    }

    /// Puts the conversation slot `seq` holds into the prompt cache before the
    /// slot is given to another: its state at the last message start it marked
    /// (or its whole history, for attention-only models).
    fn stash_seq(&mut self, seq: usize) {
        let Some(store) = self.store.as_mut() else {
            return;
        };
        let c = &self.seqs[seq];
        let (pos, recurrent) = if self.cfg.ssm.is_some() {
            let best = c
                .marks
                .iter()
                .filter(|m| m.boundary && m.pos <= c.history.len())
                .max_by_key(|m| m.pos)
                .or_else(|| {
                    c.marks
                        .iter()
                        .filter(|m| m.pos <= c.history.len())
                        .max_by_key(|m| m.pos)
                });
            match best {
                Some(m) => (m.pos, Some(m.snap.clone())),
                None => return,
            }
        } else {
            (c.history.len(), None)
        };
        if pos == 0 {
            return;
        }
        let snap = match &recurrent {
            Some(mark) => self.exec.snapshot_from_mark(seq, mark),
            None => self.exec.snapshot(seq, pos),
        };
        let snap = match snap {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("prompt cache: no snapshot of slot {seq}: {e}");
                return;
            }
        };
        let tokens = c.history[..pos].to_vec();
        match store.insert(tokens, snap) {
            Ok(_) => {
                if let Some(w) = &self.store_writer {
                    w.save(store.contents());
                }
            }
            Err(e) => tracing::warn!("prompt cache: {e}"),
        }
    }

    /// Feeds `tokens` after slot 0's history, in prompt chunks; returns the
    /// logits of the last position (or of all positions with `Logits::All`), or
    /// the greedy token.
    fn feed(&mut self, tokens: &[u32], want: Want) -> Result<StepOut, EngineError> {
        let c = &mut self.seqs[0];
        c.last_logits = None;
        let pos0 = c.history.len();
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
                self.seqs[0].history.extend_from_slice(tokens);
                Ok(o)
            }
            Err(e) => {
                // The state may hold part of this feed: start over next time.
                let _ = self.clear_seq(0);
                Err(e.into())
            }
        }
    }

    /// Evaluates `tokens` from an empty state and returns the logits of every
    /// position (n_vocab each), for parity tests and `--dump-logits`.
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.check_idle()?;
        self.limits.check(tokens)?;
        if tokens.len() > self.info.n_ctx {
            return Err(EngineError::PromptTooLong {
                prompt: tokens.len(),
                n_ctx: self.info.n_ctx,
            });
        }
        self.clear_seq(0)?;
        let StepOut::Logits(all) = self.feed(tokens, Want::Logits(Logits::All))? else {
            return Err(ExecError::new("logits_all", "the executor returned a token").into());
        };
        let n_vocab = self.cfg.n_vocab;
        self.seqs[0].last_logits = Some(all[all.len() - n_vocab..].to_vec());
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

    /// Runs one request to its end on this thread, through the scheduler's step
    /// (a batch of one); nothing else may be queued or running.
    fn generate_inner<'a>(
        &mut self,
        req: &GenerateRequest,
        on_prompt: &'a mut dyn FnMut(&PromptProgress) -> Flow,
        on_token: &'a mut dyn FnMut(&TokenEvent) -> Flow,
        on_logits: Option<LogitsFn<'a>>,
    ) -> Result<Completion, EngineError> {
        self.check_idle()?;
        let mut sink = Closures {
            on_prompt,
            on_token,
            on_logits,
            result: None,
        };
        let seq = self.pick_seq(&req.prompt).unwrap_or(0);
        let logits = sink.wants_logits();
        if let Some(mut act) = self.admit(seq, req.clone(), logits, &mut sink)? {
            loop {
                let mut items: [(&mut Active, &mut dyn RequestCallbacks); 1] =
                    [(&mut act, &mut sink)];
                // Alone: the whole context is this request's.
                let room = self.info.n_ctx.saturating_sub(self.seqs[seq].history.len());
                let done = sched::step(
                    self.exec.as_mut(),
                    &mut self.seqs,
                    &self.limits,
                    &mut items,
                    room,
                );
                if done.ended[0] {
                    break;
                }
            }
            self.seqs[seq].busy = false;
        }
        sink.result
            .take()
            .unwrap_or_else(|| Err(ExecError::new("generate", "the request did not end").into()))
    }
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
) -> Result<Option<prompt_cache::PromptCache>, EngineError> {
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
    let mut store = prompt_cache::PromptCache::new(usize::try_from(budget).unwrap_or(usize::MAX));
    if let Some(dir) = &cfg.prompt_cache_dir {
        match store.load_dir(dir, model_id) {
            Ok(r) => tracing::info!(
                "prompt cache: {} conversation(s) loaded from {} ({} file(s) skipped)",
                r.loaded,
                dir.display(),
                r.skipped
            ),
            Err(e) => {
                return Err(EngineError::Settings(format!(
                    "--prompt-cache-dir {}: {e}",
                    dir.display()
                )))
            }
        }
    }
    Ok(Some(store))
}

/// How requests' prompts were served from cached state.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct CacheCounters {
    /// Requests that kept part of their slot's state.
    pub slot_hits: u64,
    /// Requests that restored a conversation from the prompt cache.
    pub store_hits: u64,
    /// Requests that started from an empty state.
    pub misses: u64,
    /// Prompt tokens not evaluated thanks to either.
    pub tokens_reused: u64,
}

/// The prompt cache's state, for `/metrics` and the stats page.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CacheReport {
    pub counters: CacheCounters,
    /// Conversations stored, their bytes, the budget, and evictions so far
    /// (None: the prompt cache is off).
    pub store: Option<prompt_cache::CacheStats>,
}

/// Slots on the CPU when `EngineConfig::parallel` is None.
pub const DEFAULT_PARALLEL_CPU: usize = 4;

/// The most slots `--parallel` may ask for.
pub const MAX_PARALLEL: usize = 64;

/// One slot, for `/slots` and the stats page.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlotInfo {
    pub id: usize,
    /// A request is decoding here.
    pub busy: bool,
    /// Tokens in the slot's state (the cached conversation, or the request's
    /// prompt and output so far).
    pub cached_tokens: usize,
    /// The running request's prompt length.
    pub prompt_tokens: Option<usize>,
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
        slots_flexible: cfg.parallel.is_none(),
    }
}

/// The CPU executor reads every weight from the file's mapping: when the file fits
/// in the available memory, its pages are mapped now (pieces of 64 MiB on every
/// core, with a progress bar) rather than by page faults inside the first tokens'
/// parallel loops (a fault per few pages of every expert a token reaches for the
/// first time). A file larger than memory is left to be paged in as it is read.
fn populate_weights(file: &gguf::GgufFile, available: Option<u64>) {
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    const PIECE: usize = 64 << 20;
    let size = file.file_size();
    if available.is_none_or(|a| size > a) {
        return;
    }
    let pieces: Vec<(usize, usize, usize)> = (0..file.shards().len())
        .flat_map(|k| {
            let len = file.shard_bytes(k).map_or(0, <[u8]>::len);
            (0..len)
                .step_by(PIECE)
                .map(move |at| (k, at, PIECE.min(len - at)))
        })
        .collect();
    let bar = indicatif::ProgressBar::new(size);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "mapping weights into memory {bar:30} {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let t0 = std::time::Instant::now();
    let done = AtomicU64::new(0);
    let outcome: std::io::Result<Vec<bool>> = pieces
        .par_iter()
        .map(|&(k, at, len)| {
            let ok = file.populate(k, at, len)?;
            bar.set_position(done.fetch_add(len as u64, Ordering::Relaxed) + len as u64);
            Ok(ok)
        })
        .collect();
    bar.finish_and_clear();
    match outcome {
        Ok(oks) if oks.iter().all(|&ok| ok) => tracing::info!(
            "mapped {:.2} GiB of weights in {:.1} s",
            size as f64 / GIB,
            t0.elapsed().as_secs_f64()
        ),
        // A system that cannot: the pages come in as they are read.
        Ok(_) => {}
        Err(e) => tracing::warn!("could not map the weights ahead of use: {e}"),
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
    let cpu_seqs = cfg.parallel.unwrap_or(DEFAULT_PARALLEL_CPU);
    #[cfg(feature = "cuda")]
    let gpu_seqs = cfg.parallel.unwrap_or(DEFAULT_PARALLEL_CPU);
    let recording = routing.is_some();
    let cpu = |weights| -> Result<Box<dyn Executor>, EngineError> {
        let backend = CpuBackend {
            cfg: mcfg.clone(),
            weights,
            precision: cfg.precision,
            routing,
        };
        Ok(Box::new(CpuExecutor::new(backend, n_ctx, cpu_seqs)?))
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
                n, mcfg, &weights, n_ctx, gpu_seqs, budgets,
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
                match cuda::CudaExecutor::open(0, mcfg, &weights, n_ctx, gpu_seqs, budgets) {
                    Ok(e) => return Ok(Box::new(e)),
                    Err(e) => tracing::info!("no usable GPU, running on the CPU: {e}"),
                }
            }
            cpu(weights)
        }
    }
}

#[cfg(test)]
mod expert_account_tests;

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
