//! The CUDA executor: the whole model in one GPU's memory, our own kernels
//! (`crates/cuda`), and each batch-1 decode step replayed as a CUDA graph.
//!
//! Loading checks the VRAM the weights, the sequences' state and the scratch
//! arena need against the free memory before allocating anything, and refuses
//! with the numbers and the remedy (docs/design.md invariant 5).

mod backend;
mod graphs;
mod mtp;
mod rollback;
mod sample;
mod snapshot;
mod trace;
pub mod vision;
mod weights;

use backend::tiered::{self, Tiered};
use backend::MAX_ROWS;
pub use backend::{CudaBackend, CudaState, DBuf};
pub(crate) use graphs::injected_graph_oom;
pub use graphs::PRESSURE_RETRY;
use graphs::{DecodeGraph, DecodeSegments, Pressure};
use snapshot::{recurrent_uploads, upload_f32s};

use crate::exec::{EntryResult, Executor, SeqSnapshot, SeqStep, StepOut, Want};
use crate::experts::{
    plan, ExpertIndex, ExpertStore, PlanRequest, ReadCounters, ReadPolicy, RoutingProfile,
    TierStats,
};
use crate::memory::ContextAsk;
use crate::{Device, DeviceReport, EngineError};
use cuda::{Gpu, Lane};
use model::{ExecError, Logits, ModelConfig, ModelWeights, Segment};
use std::collections::HashMap;
use std::time::Instant;
use weights::{cuda_err, is_out_of_vram};

/// Tokens per step the scratch arena is sized for with every expert resident (a
/// prompt is fed in chunks of at most this many).
const MAX_STEP_TOKENS: usize = 512;
/// Longer prompt chunks give each expert more tokens per weight read (the prompt
/// GEMM's units are 32 tokens of one expert) and, with tiered experts, stream every
/// expert a chunk routes to through the slots once: the executor takes the longest
/// of these whose scratch takes at most a quarter of what the budget leaves after
/// the weights (dense weights when tiered) and the state.
const PROMPT_CHUNKS: [usize; 4] = [4096, 2048, 1024, MAX_STEP_TOKENS];

/// The longest of [`PROMPT_CHUNKS`] that is no longer than the context and whose
/// scratch is at most `left / 4`, with its (arena, scratch) sizes; the shortest when
/// none is.
fn prompt_chunk_for(
    gpu: &Gpu,
    cfg: &ModelConfig,
    n_ctx: usize,
    left: u64,
) -> (usize, (usize, u64)) {
    PROMPT_CHUNKS
        .iter()
        .filter(|&&c| c <= n_ctx.max(MAX_STEP_TOKENS))
        .map(|&c| (c, scratch_for(gpu, cfg, n_ctx, c)))
        .find(|&(c, (_, s))| c == MAX_STEP_TOKENS || s <= left / 4)
        .unwrap_or((
            MAX_STEP_TOKENS,
            scratch_for(gpu, cfg, n_ctx, MAX_STEP_TOKENS),
        ))
}
/// The prompt pool (see `ExpertStore::prefetch`) holds at most this share of a
/// layer's experts (eighths). Measured on N80 W16 pp4096 (bench/RESULTS.md,
/// 2026-12-03, sessions 27 and 28): five eighths (320 experts) 4,039–4,069 t/s, a half
/// 3,835–3,837, three quarters 3,351 (not profiled: fewer slots, more copies), a
/// quarter 3,207 and none 2,907–2,921 on an earlier build.
const POOL_EXPERT_EIGHTHS: usize = 5;
/// ... and at most this share of the VRAM left for experts.
const POOL_VRAM_SHARE: u64 = 16;

/// The tiered store's prompt pool: how many experts it holds (each as large as the
/// largest layer's) and their bytes. `POOL_EXPERT_EIGHTHS` of a layer's experts,
/// within `POOL_VRAM_SHARE` of `left` (the VRAM left for experts). (0, 0), no
/// pool, when prompt chunks of `chunk` tokens are too short to prefetch, when every
/// expert fits in `left` anyway, or when the pool would hold fewer than top-k
/// experts. `set` (the `--prompt-pool` setting: a number of experts; 0 turns the
/// pool off) overrides the rule.
fn prompt_pool(
    index: &ExpertIndex,
    cfg: &ModelConfig,
    chunk: usize,
    left: u64,
    set: Option<usize>,
) -> (u64, u64) {
    let sizes = index.trunk_expert_bytes();
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let all: u64 = sizes.iter().map(|b| b * cfg.n_expert as u64).sum();
    let experts = match set {
        Some(n) => n as u64,
        None if chunk * cfg.n_expert_used
            < crate::experts::PREFETCH_ROUTES_PER_EXPERT * cfg.n_expert
            || all <= left =>
        {
            0
        }
        None => {
            let n = ((cfg.n_expert * POOL_EXPERT_EIGHTHS / 8) as u64)
                .min((left / POOL_VRAM_SHARE).checked_div(largest).unwrap_or(0));
            if n < cfg.n_expert_used as u64 {
                0
            } else {
                n
            }
        }
    };
    (experts, experts * largest)
}

/// VRAM the CUDA context, the loaded kernels and allocation rounding take beyond
/// what scoria allocates (measured with nvidia-smi on an H200: about 0.9 GiB with
/// the executor's own 16 GiB). An explicit --vram-budget covers it.
pub const CONTEXT_VRAM: u64 = (1 << 30) + (64 << 20);
/// Positions whose logits one step may return at once (Logits::All is split
/// into pieces of this many tokens).
const MAX_LOGIT_ROWS: usize = 64;
/// The fewest prompt tokens between marks on the GPU (see `min_mark_gap`).
const MIN_MARK_GAP: usize = 32;
/// VRAM left free for the driver and the CUDA context's own needs.
const RESERVE: u64 = 512 << 20;

/// RAM left to the system when the pinned expert copy's size is chosen for the user.
const RAM_HEADROOM: u64 = 8 << 30;

/// Where the executor's VRAM went, for the startup account.
#[derive(Debug, Clone, Copy)]
pub struct VramAccount {
    /// Everything uploaded from the file (with tiered experts: the dense part).
    pub weights: u64,
    /// VRAM slots of the tiered expert store (0 when every expert is resident).
    pub expert_slots: u64,
    /// The tiered store's prompt pool (0 when there is none).
    pub prompt_pool: u64,
    pub state: u64,
    pub scratch: u64,
    pub total: u64,
}

/// What the executor may take (the tiered expert store's VRAM and RAM) and what it
/// keeps room for (verify steps).
#[derive(Debug, Clone, Copy, Default)]
pub struct Budgets<'a> {
    /// VRAM this executor may use in all (None: the free VRAM minus a reserve).
    /// When the whole model fits, every expert is resident; otherwise the dense
    /// weights, state and scratch come first and the rest becomes expert slots.
    pub vram: Option<u64>,
    /// Pinned RAM for the copy of the experts (None: what fits in MemAvailable
    /// minus 8 GiB, at most all of them).
    pub ram: Option<u64>,
    /// Seeds the slot division and the first slot contents.
    pub profile: Option<&'a RoutingProfile>,
    /// A fixed share of each decode step's RAM misses for the CPU (None: the
    /// measured cost model splits them).
    pub cpu_share: Option<f64>,
    /// Experts in the prompt pool (None: the rule of [`prompt_pool`]; 0: no pool).
    pub prompt_pool: Option<usize>,
    /// The next layer's likeliest experts a decode step copies ahead (0: none).
    pub guess_experts: usize,
    /// The slot count is a default rather than the user's: when that many
    /// sequences' state would push routed experts out of VRAM, open one sequence
    /// instead (a tiered executor decodes one sequence at a time, and every expert
    /// kept in VRAM speeds it up).
    pub slots_flexible: bool,
    /// The most tokens a speculative verify step feeds (the pending token and its
    /// drafts; 0: no speculation): each sequence keeps room for the DeltaNet state
    /// after each of them but the last, to roll back to (at most
    /// [`MAX_LOGIT_ROWS`]: a verify step is one pass).
    pub verify_tokens: usize,
    /// Keep the model's MTP block in VRAM to draft with (when the file has one and
    /// every expert is resident; `cuda/mtp.rs`).
    pub mtp: bool,
    /// How experts held only in the file are read (their deadline).
    pub reads: ReadPolicy,
}

/// The most tokens a verify step may feed on this executor for `budgets`.
fn verify_tokens(budgets: &Budgets) -> usize {
    budgets.verify_tokens.min(MAX_LOGIT_ROWS)
}

/// VRAM a sequence keeps for its verify steps of up to `verify_tokens` tokens: the
/// DeltaNet state after each token but the last.
fn trail_bytes(cfg: &ModelConfig, verify_tokens: usize) -> usize {
    cfg.recurrent_state_bytes() * verify_tokens.saturating_sub(1)
}

/// VRAM a sequence's MTP state takes at `n_ctx` positions (`backend::MtpSeq`): the
/// block's K/V and the hidden rows of a verify step.
fn mtp_state_bytes(cfg: &ModelConfig, n_ctx: usize, verify_tokens: usize) -> u64 {
    (2 * n_ctx * cfg.n_head_kv * cfg.head_dim + verify_tokens.max(1) * cfg.n_embd) as u64 * 4
}

/// The MTP block's buffers for steps of up to `chunk` rows (`backend::MtpBufs`).
fn mtp_buf_bytes(cfg: &ModelConfig, chunk: usize) -> u64 {
    let rows = chunk.max(MAX_ROWS);
    ((2 * rows + 1) * cfg.n_embd * 4 + 4 * rows * 4) as u64
}

pub struct CudaExecutor {
    be: CudaBackend,
    states: Vec<CudaState>,
    /// Per sequence: positions fed since it was cleared (its K/V of `0..fed` are in
    /// place), for the snapshot checks.
    fed: Vec<usize>,
    /// Pinned memory snapshots pass through (allocated at the first one): a
    /// sequence's state moves in a few large copies with one wait each, instead of
    /// one staged copy and wait per buffer.
    snap_buf: Option<cuda::PinnedBuf>,
    /// Per sequence: the captured step returning logits [0] or a token [1].
    graphs: Vec<[Option<DecodeGraph>; 2]>,
    /// The same for tiered steps, as segments.
    segments: Vec<[Option<DecodeSegments>; 2]>,
    /// Batched decode passes (one token of each of several sequences), by the list of
    /// sequences: the logits rows, with every row's greedy token in `argmax_out`.
    row_graphs: HashMap<Vec<usize>, DecodeGraph>,
    /// MTP passes by (sequence, rows, chained drafts; 0: a fill without logits).
    mtp_graphs: HashMap<(usize, usize, usize), DecodeGraph>,
    argmax_out: cuda::DevBuf<i32>,
    /// The argmax kernel's per-row blocks (`cuda::argmax_scratch_words`).
    argmax_scratch: cuda::DevBuf<u32>,
    /// `Want::Sample`'s parameters (`sample.rs`; allocated at the first sampled step).
    sample_params: Option<cuda::DevBuf<u32>>,
    /// What the sampling kernels of a row tell each other (`cuda::sample_scratch_words`).
    sample_scratch: Option<cuda::DevBuf<u32>>,
    use_graphs: bool,
    /// Set while the GPU is short of memory (see [`Pressure`]).
    pressure: Option<Pressure>,
    /// Steps run so far, and the one `SCORIA_TEST_CUDA_FAULT` makes fault (tests).
    steps: u64,
    cuda_fault_at: Option<u64>,
    ordinal: usize,
    name: String,
    vram: VramAccount,
}

// SAFETY: the executor is used by one thread at a time (the engine owns it and
// `Executor` methods take `&mut self`); the `Cell`s in the backend are never
// shared between threads, and the CUDA context is made current by each call.
unsafe impl Send for CudaExecutor {}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The scratch arena for steps of up to `max_step` tokens, and with the RoPE table
/// the scratch VRAM in all.
fn scratch_for(gpu: &Gpu, cfg: &ModelConfig, n_ctx: usize, max_step: usize) -> (usize, u64) {
    // attn_core's key-split partials: the split count depends on the step's token
    // count, so take the largest any step may ask for (a batched decode pass: each
    // row's own).
    let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
    let attn_split = (1..=max_step)
        .map(|t| gpu.attn_scratch_bytes(t, nh, nkv, hd, n_ctx))
        .chain([gpu.attn_rows_scratch_bytes(MAX_ROWS, nh, nkv, hd, n_ctx)])
        .max()
        .unwrap_or(0) as usize;
    let arena = backend::scratch_bytes(cfg, max_step, MAX_LOGIT_ROWS, attn_split);
    (arena, arena as u64 + (n_ctx * cfg.n_rot * 4) as u64)
}

fn upload_bar(bytes: u64, ordinal: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(bytes);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "loading weights for {msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(format!("cuda:{ordinal}"));
    bar
}

/// What opening an executor has settled once the context is chosen: the GPU, the
/// model, the context and sequences, the budgets, the VRAM `budget` for weights, state
/// and scratch (the CUDA context apart), and the GPU's free and total memory.
struct Opening<'a> {
    gpu: Gpu,
    cfg: &'a ModelConfig,
    weights: &'a ModelWeights,
    n_ctx: usize,
    n_seq: usize,
    budgets: Budgets<'a>,
    budget: u64,
    free: u64,
    total: u64,
    /// The MTP block to upload beside the weights, and one sequence's MTP state
    /// (both counted in what `open_at` is given; a tiered executor leaves them out).
    mtp: Option<&'a model::weights::MtpWeights>,
    mtp_state: u64,
}

impl CudaExecutor {
    /// Opens GPU `ordinal`, checks the VRAM the model needs, uploads the weights
    /// and allocates `n_seq` sequences of `n_ctx` positions.
    pub fn open(
        ordinal: usize,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        n_ctx: usize,
        n_seq: usize,
        budgets: Budgets,
    ) -> Result<CudaExecutor, EngineError> {
        Self::open_with(
            ordinal,
            cfg,
            weights,
            ContextAsk::Fixed(n_ctx),
            n_seq,
            budgets,
        )
    }

    /// The positions each sequence holds.
    pub fn context(&self) -> usize {
        self.states.first().map_or(0, |st| st.n_ctx)
    }

    /// As [`open`](Self::open), with the context asked for, or (`ContextAsk::Auto`)
    /// chosen by `memory::auto_context_gpu` from this GPU's budget and this model's
    /// state and scratch sizes. Logged with why.
    pub fn open_with(
        ordinal: usize,
        cfg: &ModelConfig,
        weights: &ModelWeights,
        ask: ContextAsk,
        n_seq: usize,
        budgets: Budgets,
    ) -> Result<CudaExecutor, EngineError> {
        let dev = |e: cuda::CudaError| EngineError::Device(e.to_string());
        // Whether there is a GPU first (no GPU is not this model's fault), then
        // whether its kernels take this model, before anything is allocated.
        let mut gpu = Gpu::open(ordinal).map_err(dev)?;
        weights::check_shape(cfg)?;
        weights::check_tensors(weights)?;
        gpu.set_diagnostics(
            crate::switches::on(crate::switches::CUDA_SYNC),
            crate::switches::on(crate::switches::NO_PDL),
        );
        let name = gpu.name();
        let (free, total) = gpu.mem_info().map_err(dev)?;
        let w_bytes = weights::upload_bytes(weights);
        let budget = match budgets.vram {
            Some(b) if b <= CONTEXT_VRAM => {
                return Err(EngineError::Memory(format!(
                    "--vram-budget {:.2} GiB is too small: the CUDA context and kernels alone take about {:.2} GiB of it",
                    gib(b),
                    gib(CONTEXT_VRAM)
                )))
            }
            Some(b) if b.saturating_add(RESERVE) > free => {
                return Err(EngineError::Memory(format!(
                    "--vram-budget {:.2} GiB is more than cuda:{ordinal} ({name}) has free ({:.2} GiB of {:.2} GiB, {:.2} GiB kept in reserve): lower --vram-budget",
                    gib(b),
                    gib(free),
                    gib(total),
                    gib(RESERVE)
                )))
            }
            Some(b) => b - CONTEXT_VRAM,
            None => free.saturating_sub(RESERVE),
        };
        let verify = verify_tokens(&budgets);
        let mtp = weights.mtp.as_ref().filter(|_| budgets.mtp);
        let w_bytes = w_bytes
            + mtp.map_or(0, |m| {
                weights::mtp_bytes(m) + mtp_buf_bytes(cfg, PROMPT_CHUNKS[0])
            });
        let mtp_state = |c: usize| mtp.map_or(0, |_| mtp_state_bytes(cfg, c, verify));
        let state_of =
            |c: usize| (cfg.seq_state_bytes(c) + trail_bytes(cfg, verify)) as u64 + mtp_state(c);
        let (n_ctx, chosen) = match ask {
            ContextAsk::Fixed(n) => (n, None),
            ContextAsk::Auto => {
                // A tiered executor leaves the MTP block out.
                let dense = weights::upload_bytes(weights) - weights::routed_expert_bytes(weights);
                let fit = crate::memory::GpuFit {
                    budget,
                    seqs: n_seq,
                    slots_flexible: budgets.slots_flexible,
                    weights: w_bytes,
                    dense,
                    chunk: PROMPT_CHUNKS[0],
                    state: &state_of,
                    scratch: &|c, fast| {
                        let step = if fast {
                            PROMPT_CHUNKS[0]
                        } else {
                            MAX_STEP_TOKENS
                        };
                        scratch_for(&gpu, cfg, c, step).1
                    },
                };
                let (c, why) = crate::memory::auto_context_gpu(cfg.n_ctx_train, &fit);
                (c, Some(why))
            }
        };
        let state_one = state_of(n_ctx);
        let o = Opening {
            gpu,
            cfg,
            weights,
            n_ctx,
            n_seq,
            budgets,
            budget,
            free,
            total,
            mtp,
            mtp_state: mtp_state(n_ctx),
        };
        let e = Self::open_at(o, w_bytes, state_one)?;
        crate::memory::log_context(n_ctx, cfg.n_ctx_train, chosen.as_deref(), true);
        Ok(e)
    }

    /// `open_with` once the context is known (`w_bytes`: the weights' upload size;
    /// `state_one`: one sequence's K/V, state and verify trail at the context).
    fn open_at(mut o: Opening, w_bytes: u64, state_one: u64) -> Result<CudaExecutor, EngineError> {
        let Opening {
            cfg,
            weights,
            n_ctx,
            n_seq,
            budget,
            free,
            total,
            mtp,
            mtp_state,
            ..
        } = o;
        let ordinal = o.gpu.ordinal();
        let name = o.gpu.name();
        let state = state_one * n_seq as u64;
        let (_, scratch) = scratch_for(&o.gpu, cfg, n_ctx, MAX_STEP_TOKENS);
        let (n_seq, state) = if o.budgets.slots_flexible
            && n_seq > 1
            && w_bytes + state + scratch > budget
        {
            tracing::info!(
                "cuda:{ordinal}: one slot instead of {n_seq}: the state of {n_seq} would leave routed experts outside VRAM (--parallel sets the slots)"
            );
            (1, state_one)
        } else {
            (n_seq, state)
        };
        if w_bytes + state + scratch > budget {
            o.n_seq = n_seq;
            if mtp.is_some() {
                tracing::info!(
                    "cuda:{ordinal}: the experts are tiered, so the MTP block stays on the \
                     file (MTP drafts need every expert in VRAM; prompt lookup drafts instead)"
                );
            }
            return Self::open_tiered(o, state - mtp_state * n_seq as u64);
        }
        let (chunk, (arena, scratch)) =
            prompt_chunk_for(&o.gpu, cfg, n_ctx, budget - (w_bytes + state));
        let need = w_bytes + state + scratch + RESERVE;
        if need > free {
            return Err(EngineError::Memory(format!(
                "cuda:{ordinal} ({name}) has {:.2} GiB free of {:.2} GiB, but this model needs {:.2} GiB: \
                 weights {:.2} GiB + KV/state {:.2} GiB for --max-context {n_ctx} + scratch {:.2} GiB + reserve {:.2} GiB. \
                 Lower --max-context, use a smaller quantization, or run on the CPU (--device cpu)",
                gib(free),
                gib(total),
                gib(need),
                gib(w_bytes),
                gib(state),
                gib(scratch),
                gib(RESERVE),
            )));
        }
        let bar = upload_bar(w_bytes, ordinal);
        let w = weights::upload(&o.gpu, cfg, weights, None, &|done| bar.set_position(done))?;
        bar.finish_and_clear();
        let mut be = CudaBackend::new(o.gpu, cfg.clone(), w, arena, n_ctx, chunk, None)?;
        if let Some(m) = mtp {
            // Counted above; a block the kernels cannot run is left out, not fatal.
            match weights::upload_mtp(&be.gpu, cfg, m).and_then(|w| be.set_mtp(w)) {
                Ok(bufs) => tracing::info!(
                    "cuda:{ordinal}: MTP block in VRAM for drafts: {:.2} GiB of weights and \
                     buffers, {:.2} GiB of K/V per slot",
                    gib(weights::mtp_bytes(m) + bufs),
                    gib(mtp_state)
                ),
                Err(e) => tracing::warn!("cuda:{ordinal}: no MTP drafts on the GPU: {e}"),
            }
        }
        let vram = VramAccount {
            weights: w_bytes,
            expert_slots: 0,
            prompt_pool: 0,
            state,
            scratch: be.arena_bytes() + be.rope_bytes(),
            total,
        };
        Self::finish(
            be,
            n_ctx,
            n_seq,
            verify_tokens(&o.budgets),
            ordinal,
            name,
            vram,
        )
    }

    /// The dense weights, state (`state`, all sequences) and scratch in VRAM, the
    /// routed experts in slots (the rest of the budget), a pinned RAM copy and the file.
    fn open_tiered(o: Opening, state: u64) -> Result<CudaExecutor, EngineError> {
        let Opening {
            gpu,
            cfg,
            weights,
            n_ctx,
            n_seq,
            budgets,
            budget,
            total,
            ..
        } = o;
        let ordinal = gpu.ordinal();
        let name = gpu.name();
        let dense = weights::upload_bytes(weights) - weights::routed_expert_bytes(weights);
        let left = budget.saturating_sub(dense + state);
        let (chunk, (arena, scratch)) = prompt_chunk_for(&gpu, cfg, n_ctx, left);
        let fixed = dense + state + scratch;
        let mem = |m: String| EngineError::Memory(m);
        if fixed >= budget {
            return Err(mem(format!(
                "the VRAM budget is {:.2} GiB, but the dense weights ({:.2} GiB), KV/state for --max-context {n_ctx} ({:.2} GiB) and scratch ({:.2} GiB) alone need {:.2} GiB, with nothing left for expert slots: \
                 raise --vram-budget, lower --max-context, or run on the CPU (--device cpu)",
                gib(budget),
                gib(dense),
                gib(state),
                gib(scratch),
                gib(fixed)
            )));
        }
        let file = weights.token_embd.file();
        let index = ExpertIndex::build(file, cfg).map_err(|e| mem(e.to_string()))?;
        let routed: u64 = (0..index.n_layer())
            .filter_map(|l| index.block_bytes(l))
            .sum();
        let avail = crate::memory::mem_available();
        let ram = budgets.ram.unwrap_or_else(|| match avail {
            Some(a) => routed.min(a.saturating_sub(RAM_HEADROOM)),
            None => 0,
        });
        let map_ok = crate::experts::cpu_may_read_map(avail, ram, RAM_HEADROOM);
        let (pool_experts, pool) =
            prompt_pool(&index, cfg, chunk, budget - fixed, budgets.prompt_pool);
        if fixed + pool >= budget {
            return Err(mem(format!(
                "the VRAM budget is {:.2} GiB, but the dense weights, KV/state and scratch ({:.2} GiB) and the prompt pool ({:.2} GiB) leave nothing for expert slots: raise --vram-budget or lower --prompt-pool",
                gib(budget),
                gib(fixed),
                gib(pool)
            )));
        }
        let req = PlanRequest::for_index(&index, cfg.n_expert_used, budget - fixed - pool, ram);
        let plan = plan(&req, budgets.profile).map_err(|e| mem(e.to_string()))?;
        let context = budgets.vram.map_or(0, |_| CONTEXT_VRAM);
        tracing::info!(
            "cuda:{ordinal} {name}: VRAM budget {:.2} GiB: CUDA context {:.2} GiB, dense weights {:.2} GiB, KV/state {:.2} GiB, scratch {:.2} GiB for prompt chunks of {chunk} tokens, prompt pool {:.2} GiB ({pool_experts} experts of the largest layer, filled while a layer's mixer runs), expert slots {:.2} GiB\n{plan}",
            gib(budget + context),
            gib(context),
            gib(dense),
            gib(state),
            gib(scratch),
            gib(pool),
            gib(plan.vram_used)
        );
        let slots: Vec<usize> = plan.layers.iter().map(|l| l.slots).collect();
        let bar = upload_bar(dense + plan.ram_used, ordinal);
        let w = weights::upload(&gpu, cfg, weights, Some(&slots), &|done| {
            bar.set_position(done)
        })?;
        let warm = budgets.profile.map(|_| plan.resident_order.clone());
        let store = ExpertStore::new(index, plan).with_pool(pool);
        let pool_mem = (pool > 0)
            .then(|| gpu.alloc::<u8>(pool as usize, "prompt pool"))
            .transpose()
            .map_err(cuda_err("allocate the prompt pool"))?;
        // The largest slot block, still empty, for measuring copies into VRAM.
        let probe = w
            .layers
            .iter()
            .map(|l| (l.moe.gate_exps.mem.ptr(), l.moe.gate_exps.mem.len()))
            .max_by_key(|p| p.1)
            .unwrap_or((0, 0));
        let t = Tiered::new(
            &gpu,
            store,
            pool_mem,
            weights,
            cfg.n_embd,
            budgets.cpu_share,
            budgets.guess_experts,
            probe,
            map_ok,
            budgets.reads,
            &|done| bar.set_position(dense + done),
        )?;
        bar.finish_and_clear();
        // With a routing profile, the slots start with the most used experts.
        if let Some(order) = warm {
            let fetches = t.store.borrow_mut().warm(&order);
            for (l, f) in fetches {
                t.fetch(
                    &gpu,
                    l,
                    tiered::matrices(&w.layers[l].moe),
                    &[f],
                    Lane::Stream,
                )?;
            }
        }
        tracing::info!(
            "pinned RAM: {:.2} GiB expert copy + {:.3} GiB staging for file reads",
            gib(t.ram_bytes()),
            gib(t.staging_bytes())
        );
        let slot_bytes = t.store.borrow().plan().vram_used;
        let be = CudaBackend::new(gpu, cfg.clone(), w, arena, n_ctx, chunk, Some(t))?;
        let vram = VramAccount {
            weights: dense,
            expert_slots: slot_bytes,
            prompt_pool: pool,
            state,
            scratch: be.arena_bytes() + be.rope_bytes(),
            total,
        };
        Self::finish(
            be,
            n_ctx,
            n_seq,
            verify_tokens(&budgets),
            ordinal,
            name,
            vram,
        )
    }

    fn finish(
        be: CudaBackend,
        n_ctx: usize,
        n_seq: usize,
        verify_tokens: usize,
        ordinal: usize,
        name: String,
        vram: VramAccount,
    ) -> Result<CudaExecutor, EngineError> {
        let states = (0..n_seq)
            .map(|_| be.new_state_for(n_ctx, verify_tokens))
            .collect::<Result<Vec<_>, _>>()?;
        let argmax_out = be
            .gpu
            .alloc::<i32>(MAX_ROWS.max(MAX_LOGIT_ROWS), "argmax")
            .map_err(cuda_err("allocate"))?;
        let argmax_scratch = be
            .gpu
            .alloc::<u32>(
                cuda::argmax_scratch_words(be.cfg.n_vocab, MAX_ROWS.max(MAX_LOGIT_ROWS)),
                "argmax scratch",
            )
            .map_err(cuda_err("allocate"))?;
        // A tiered step waits for the host at every MoE layer: graph segments.
        let use_graphs = !crate::switches::on(crate::switches::NO_GRAPH);
        let trail = trail_bytes(&be.cfg, verify_tokens) * n_seq;
        tracing::info!(
            "cuda:{ordinal} {name}: weights {:.2} GiB, expert slots {:.2} GiB, KV/state {:.2} GiB{}, scratch {:.2} GiB (prompt chunks of {} tokens), of {:.2} GiB",
            gib(vram.weights),
            gib(vram.expert_slots),
            gib(vram.state),
            if verify_tokens > 0 {
                format!(
                    " (of which {:.2} GiB the DeltaNet states of verify steps of up to {verify_tokens} tokens)",
                    gib(trail as u64)
                )
            } else {
                String::new()
            },
            gib(vram.scratch),
            be.chunk_tokens,
            gib(vram.total)
        );
        Ok(CudaExecutor {
            be,
            graphs: (0..n_seq).map(|_| [None, None]).collect(),
            segments: (0..n_seq).map(|_| [None, None]).collect(),
            row_graphs: HashMap::new(),
            mtp_graphs: HashMap::new(),
            fed: vec![0; states.len()],
            snap_buf: None,
            states,
            argmax_out,
            argmax_scratch,
            sample_params: None,
            sample_scratch: None,
            use_graphs,
            pressure: None,
            steps: 0,
            cuda_fault_at: std::env::var(crate::switches::TEST_CUDA_FAULT)
                .ok()
                .and_then(|v| v.parse().ok()),
            ordinal,
            name,
            vram,
        })
    }

    pub fn vram(&self) -> VramAccount {
        self.vram
    }

    /// One pass over one token of each entry's sequence (kernels only; capturable):
    /// the logits rows in entry order, and each row's greedy token in `argmax_out`.
    /// The inputs were written by `CudaBackend::load_rows`.
    fn launch_rows(&mut self, entries: &[&SeqStep]) -> Result<u64, ExecError> {
        let mut free: Vec<Option<&mut CudaState>> = self.states.iter_mut().map(Some).collect();
        let mut segs = Vec::with_capacity(entries.len());
        for e in entries {
            let state = free.get_mut(e.seq).and_then(Option::take).ok_or_else(|| {
                ExecError::new("step", format!("sequence {} appears twice", e.seq))
            })?;
            segs.push(Segment {
                tokens: e.tokens,
                pos0: e.pos0,
                state,
                logits: Logits::Last,
                media: e.media,
            });
        }
        let outs = model::forward_batch(&self.be, &mut segs)?;
        let vocab = self.be.cfg.n_vocab;
        let base = outs.first().map_or(0, |o| o.ptr);
        if outs
            .iter()
            .enumerate()
            .any(|(i, o)| o.ptr != base + (i * vocab * 4) as u64)
        {
            return Err(ExecError::new(
                "step",
                "the logits rows are not consecutive",
            ));
        }
        self.be
            .gpu
            .argmax_rows(
                base,
                vocab,
                outs.len(),
                self.argmax_out.ptr(),
                self.argmax_scratch.ptr(),
            )
            .map_err(cuda_err("argmax"))?;
        Ok(base)
    }

    /// `SCORIA_TEST_CUDA_FAULT`'s step: a kernel writes to an illegal address, and
    /// the error the synchronisation after it reports (sticky: fatal).
    fn injected_sticky_error(&self) -> ExecError {
        tracing::warn!(
            "cuda:{}: step {} writes to an illegal address ({})",
            self.ordinal,
            self.steps,
            crate::switches::TEST_CUDA_FAULT
        );
        let gpu = &self.be.gpu;
        match gpu.provoke_illegal_address().and_then(|()| gpu.sync()) {
            Err(e) => cuda_err("step")(e),
            Ok(()) => ExecError::new(
                "step",
                format!(
                    "{}: the kernel writing to an illegal address ran without a fault",
                    crate::switches::TEST_CUDA_FAULT
                ),
            ),
        }
    }

    /// One token of each of several sequences in one pass (batched decode): every
    /// mixer runs its rows in one launch each, over the states the backend's tables
    /// name, and each row gets the bits of its sequence's own step. Replayed from a
    /// graph captured for this list of sequences.
    fn step_rows(&mut self, entries: &[&SeqStep]) -> Result<Vec<StepOut>, ExecError> {
        let tokens: Vec<u32> = entries.iter().map(|e| e.tokens[0]).collect();
        let positions: Vec<usize> = entries.iter().map(|e| e.pos0).collect();
        let states: Vec<&CudaState> = entries.iter().map(|e| &self.states[e.seq]).collect();
        self.be.load_rows(&tokens, &positions, &states)?;
        let logits = self.decode_rows(entries)?;
        let sampled: Vec<(usize, usize, &crate::sampler::Draw)> = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| matches!(e.want, Want::Sample | Want::SampleRows))
            .map(|(i, e)| Ok((i, i, &e.sample_draws(0, 1)?[0])))
            .collect::<Result<_, ExecError>>()?;
        self.sample_rows(logits, &sampled)?;
        let gpu = &self.be.gpu;
        let vocab = self.be.cfg.n_vocab;
        let ids: Vec<i32> = if entries.iter().any(|e| !matches!(e.want, Want::Logits(_))) {
            gpu.download(self.argmax_out.ptr(), entries.len())
                .map_err(cuda_err("download tokens"))?
        } else {
            Vec::new()
        };
        let outs = entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                Ok(match e.want {
                    Want::Greedy | Want::Sample => StepOut::Token(ids[i] as u32),
                    Want::GreedyRows | Want::SampleRows => StepOut::Tokens(vec![ids[i] as u32]),
                    Want::Logits(_) => StepOut::Logits(
                        gpu.download(logits + (i * vocab * 4) as u64, vocab)
                            .map_err(cuda_err("download logits"))?,
                    ),
                })
            })
            .collect::<Result<Vec<_>, ExecError>>()?;
        // After the outputs are read: the MTP passes reuse the scratch arena.
        for (i, e) in entries.iter().enumerate() {
            self.mtp_fill(e.seq, e.tokens, e.pos0, i)?;
        }
        Ok(outs)
    }

    /// Runs the forward pass (kernels only; capturable for one token) and, for
    /// `Greedy` and `GreedyRows`, the argmax of the last row or of every row; returns
    /// the device address of the output. `media`: the
    /// rows' images and rotary positions (`Media::default()` for text).
    fn launch_step(
        &mut self,
        seq: usize,
        tokens: &[u32],
        pos0: usize,
        want: Want,
        media: model::Media<'_>,
    ) -> Result<u64, ExecError> {
        let mut seg = [Segment {
            tokens,
            pos0,
            state: &mut self.states[seq],
            logits: want.logits(),
            media,
        }];
        let logits = model::forward_batch(&self.be, &mut seg)?
            .pop()
            .ok_or_else(|| ExecError::new("step", "the pass returned no logits"))?;
        let rows = match want {
            Want::Greedy => 1,
            Want::GreedyRows => tokens.len(),
            Want::Logits(_) | Want::Sample | Want::SampleRows => return Ok(logits.ptr),
        };
        self.be
            .gpu
            .argmax_rows(
                logits.ptr,
                self.be.cfg.n_vocab,
                rows,
                self.argmax_out.ptr(),
                self.argmax_scratch.ptr(),
            )
            .map_err(cuda_err("argmax"))?;
        Ok(self.argmax_out.ptr())
    }

    /// Entry `s`'s output for `want` (`rows` rows, from its position `first`) from
    /// `out`, what `launch_step` returned; a sampled entry's tokens are drawn here.
    fn read_out(
        &mut self,
        out: u64,
        want: Want,
        (first, rows): (usize, usize),
        s: &SeqStep,
    ) -> Result<StepOut, ExecError> {
        // Where the tokens are: greedy's argmax wrote them at `out`; a sampled entry's
        // are drawn now into `argmax_out`.
        let tokens_at = match want {
            Want::Sample | Want::SampleRows => {
                let each: Vec<(usize, usize, &crate::sampler::Draw)> = s
                    .sample_draws(first, rows)?
                    .iter()
                    .enumerate()
                    .map(|(i, d)| (i, i, d))
                    .collect();
                self.sample_rows(out, &each)?;
                self.argmax_out.ptr()
            }
            _ => out,
        };
        Ok(match want {
            Want::Greedy | Want::GreedyRows | Want::Sample | Want::SampleRows => {
                let t: Vec<i32> = self
                    .be
                    .gpu
                    .download(tokens_at, rows)
                    .map_err(cuda_err("download tokens"))?;
                let t: Vec<u32> = t.into_iter().map(|t| t as u32).collect();
                if matches!(want, Want::Greedy | Want::Sample) {
                    StepOut::Token(t[0])
                } else {
                    StepOut::Tokens(t)
                }
            }
            Want::Logits(_) => StepOut::Logits(
                self.be
                    .gpu
                    .download(out, rows * self.be.cfg.n_vocab)
                    .map_err(cuda_err("download logits"))?,
            ),
        })
    }
}

impl Executor for CudaExecutor {
    fn sequences(&self) -> usize {
        self.states.len()
    }

    fn report(&self) -> DeviceReport {
        DeviceReport {
            device: Device::Cuda(self.ordinal),
            name: self.name.clone(),
            vram_used: Some(
                self.vram.weights
                    + self.vram.expert_slots
                    + self.vram.prompt_pool
                    + self.vram.state
                    + self.vram.scratch,
            ),
            vram_total: Some(self.vram.total),
        }
    }

    fn prompt_chunk(&self) -> usize {
        self.be.chunk_tokens
    }

    fn expert_stats(&self) -> Option<TierStats> {
        self.be.tiered.as_ref().map(Tiered::stats)
    }

    fn clear(&mut self, seq: usize) -> Result<(), ExecError> {
        let st = self.state("clear", seq)?;
        self.be.clear_state(st)?;
        self.fed[seq] = 0;
        self.states[seq].trail.armed = false;
        self.states[seq].trail.span = None;
        if let Some(m) = self.states[seq].mtp.as_mut() {
            m.clear();
        }
        Ok(())
    }

    fn enable_mtp(&mut self) -> bool {
        self.start_mtp()
    }

    fn mtp_draft(&mut self, seq: usize, token: u32, k: usize) -> Result<Vec<u32>, ExecError> {
        self.mtp_drafts(seq, token, k)
    }

    fn rollbacks(&self) -> bool {
        self.states.first().is_some_and(|s| s.trail.tokens > 1)
    }

    fn verify_tokens(&self) -> usize {
        self.states.first().map_or(0, |s| s.trail.tokens)
    }

    fn keep_trail(&mut self, seq: usize) -> Result<(), ExecError> {
        if !self.rollbacks() {
            return Err(ExecError::new(
                "keep_trail",
                "this GPU executor was opened without speculative decoding (no room for \
                 verify steps' states)",
            ));
        }
        self.state("keep_trail", seq)?;
        self.states[seq].trail.armed = true;
        Ok(())
    }

    fn rollback(&mut self, seq: usize, pos: usize) -> Result<(), ExecError> {
        self.roll_back(seq, pos)
    }

    fn snapshots(&self) -> bool {
        true
    }

    /// A snapshot leaves VRAM over PCIe (a Qwen3.5-35B mark: 63 MiB in about 4 ms on
    /// an H200 host), about what a prompt piece of a few dozen tokens takes.
    fn min_mark_gap(&self) -> usize {
        MIN_MARK_GAP
    }

    fn snapshot(&mut self, seq: usize, pos: usize) -> Result<SeqSnapshot, ExecError> {
        self.take_snapshot("snapshot", seq, pos, true, None)
    }

    fn snapshot_recurrent(&mut self, seq: usize, pos: usize) -> Result<SeqSnapshot, ExecError> {
        self.take_snapshot("snapshot_recurrent", seq, pos, false, None)
    }

    fn snapshot_from_mark(
        &mut self,
        seq: usize,
        mark: &SeqSnapshot,
    ) -> Result<SeqSnapshot, ExecError> {
        self.take_snapshot("snapshot_from_mark", seq, mark.pos, true, Some(mark))
    }

    fn restore(&mut self, seq: usize, snap: &SeqSnapshot, upto: usize) -> Result<(), ExecError> {
        self.shape("restore", seq)?.check_restore(snap, upto)?;
        // Marked unfed first: a failed upload leaves no claim on the state.
        self.fed[seq] = 0;
        self.states[seq].trail.span = None;
        if let Some(m) = self.states[seq].mtp.as_mut() {
            m.lose();
        }
        let n = upto * self.kv_width();
        let st = &self.states[seq];
        let mut parts: Vec<(&[f32], u64)> = Vec::new();
        for (l, (k, v)) in snap.kv.iter().zip(&st.kv) {
            parts.extend([(&l.k[..n], k.ptr()), (&l.v[..n], v.ptr())]);
        }
        parts.extend(recurrent_uploads(snap, st));
        upload_f32s(&self.be.gpu, &mut self.snap_buf, &parts)?;
        self.fed[seq] = upto;
        Ok(())
    }

    fn restore_recurrent(&mut self, seq: usize, snap: &SeqSnapshot) -> Result<(), ExecError> {
        self.shape("restore_recurrent", seq)?
            .check_restore_recurrent(snap)?;
        self.states[seq].trail.span = None;
        if let Some(m) = self.states[seq].mtp.as_mut() {
            m.lose();
        }
        let parts: Vec<_> = recurrent_uploads(snap, &self.states[seq]).collect();
        upload_f32s(&self.be.gpu, &mut self.snap_buf, &parts)?;
        self.fed[seq] = snap.pos;
        Ok(())
    }

    /// All or nothing: an entry that failed fails the step.
    fn step(&mut self, batch: &[SeqStep]) -> Result<Vec<StepOut>, ExecError> {
        self.step_each(batch)?.into_iter().collect()
    }

    /// With tiered experts each entry runs in a pass of its own, and an entry whose
    /// pass could not read an expert from the file fails alone (its sequence holds
    /// part of the step); the other entries' passes give the bits they give alone.
    /// Any other error fails the step.
    fn step_each(&mut self, batch: &[SeqStep]) -> Result<Vec<EntryResult>, ExecError> {
        let mut seen = vec![false; self.states.len()];
        for s in batch {
            if s.seq >= self.states.len() {
                return Err(ExecError::new("step", format!("no sequence {}", s.seq)));
            }
            if s.tokens.is_empty() {
                return Err(ExecError::new("step", "no tokens"));
            }
            if std::mem::replace(&mut seen[s.seq], true) {
                return Err(ExecError::new(
                    "step",
                    format!("sequence {} appears twice", s.seq),
                ));
            }
        }
        self.check_trails(batch)?;
        self.steps += 1;
        if self.cuda_fault_at == Some(self.steps) {
            return Err(self.injected_sticky_error());
        }
        // Until the step is done its sequences' state is in between.
        for s in batch {
            self.fed[s.seq] = 0;
        }
        let outs = self.run_step(batch);
        match &outs {
            Ok(outs) => {
                for (s, out) in batch.iter().zip(outs) {
                    self.end_trails(std::slice::from_ref(s), out.is_ok());
                }
            }
            Err(_) => self.end_trails(batch, false),
        }
        match &outs {
            Err(e) if is_out_of_vram(e) => self.out_of_vram(&e.to_string()),
            Ok(_) => self.end_pressure(),
            Err(_) => {}
        }
        let outs = outs?;
        for (s, out) in batch.iter().zip(&outs) {
            if out.is_ok() {
                self.fed[s.seq] = s.pos0 + s.tokens.len();
            }
        }
        Ok(outs)
    }

    fn expert_reads(&self) -> Option<ReadCounters> {
        self.be.tiered.as_ref().map(Tiered::read_counters)
    }

    fn standing_fault(&self) -> Option<String> {
        self.be.tiered.as_ref().and_then(Tiered::standing_fault)
    }

    /// While the GPU ran out of memory less than `PRESSURE_RETRY` ago.
    fn standing_warning(&self) -> Option<String> {
        let p = self.pressure.as_ref()?;
        (Instant::now() < p.retry_at).then(|| {
            format!(
                "VRAM pressure: {} {} s ago; decode steps without a captured CUDA graph \
                 run kernel by kernel (same output, slower), and a request whose step \
                 cannot run fails. Another process took VRAM since scoria started: free \
                 the GPU, or run scoria with a lower --vram-budget or --parallel",
                p.what,
                p.at.elapsed().as_secs(),
            )
        })
    }
}

impl CudaExecutor {
    /// The entries of a checked step: batched passes where they can go together,
    /// the rest one by one (each entry of a tiered executor on its own; its outcome
    /// may be an expert that could not be read, see [`Self::step_entry`]).
    fn run_step(&mut self, batch: &[SeqStep]) -> Result<Vec<EntryResult>, ExecError> {
        let mut outs: Vec<Option<EntryResult>> = batch.iter().map(|_| None).collect();
        // One token of several sequences: batched passes of up to MAX_ROWS rows.
        if self.be.batches_rows() {
            let rows: Vec<usize> = (0..batch.len())
                .filter(|&i| batch[i].tokens.len() == 1 && !has_media(&batch[i]))
                .collect();
            for chunk in rows.chunks(MAX_ROWS).filter(|c| c.len() > 1) {
                let entries: Vec<&SeqStep> = chunk.iter().map(|&i| &batch[i]).collect();
                for (&i, out) in chunk.iter().zip(self.step_rows(&entries)?) {
                    outs[i] = Some(Ok(out));
                }
            }
        }
        for (s, out) in batch.iter().zip(outs.iter_mut()) {
            if out.is_none() {
                *out = Some(self.step_entry(s)?);
            }
        }
        Ok(outs.into_iter().flatten().collect())
    }

    /// One entry on its own ([`Self::step_one`]). With tiered experts, a pass that
    /// failed because an expert could not be read from the file fails this entry
    /// alone (`Ok(Err)`): the device first finishes what the pass had issued (copies
    /// into slots the store has forgotten included), so the next pass starts from a
    /// quiet device; every other error fails the step.
    fn step_entry(&mut self, s: &SeqStep) -> Result<EntryResult, ExecError> {
        if self.be.tiered.is_none() {
            return self.step_one(s).map(Ok);
        }
        match self.step_one(s) {
            Ok(out) => Ok(Ok(out)),
            Err(e) if e.kind == model::ExecErrorKind::ExpertRead => {
                self.be
                    .gpu
                    .sync()
                    .map_err(cuda_err("finish a step whose expert read failed"))?;
                Ok(Err(e))
            }
            Err(e) => Err(e),
        }
    }
}

impl CudaExecutor {
    fn state(&self, op: &str, seq: usize) -> Result<&CudaState, ExecError> {
        let n = self.states.len();
        self.states
            .get(seq)
            .ok_or_else(|| ExecError::new(op, format!("no sequence {seq} (there are {n})")))
    }
}

impl CudaExecutor {
    /// One entry on its own: a decode token through its sequence's graph, or a
    /// prompt in the pieces the arena holds.
    fn step_one(&mut self, s: &SeqStep) -> Result<StepOut, ExecError> {
        let every_row = s.want.logits() == Logits::All;
        if s.tokens.len() == 1 && !every_row && !has_media(s) {
            self.be.load_inputs(s.tokens, s.pos0, None)?;
            let out = if self.use_graphs && self.be.tiered.is_some() {
                self.decode_segments(s)?
            } else if self.use_graphs {
                self.decode_graph(s)?
            } else {
                self.decode_eager(s)?
            };
            let r = self.read_out(out, s.want, (0, 1), s)?;
            // After the output is read: the MTP pass reuses the scratch arena.
            self.mtp_fill(s.seq, s.tokens, s.pos0, 0)?;
            return Ok(r);
        }
        // Several tokens: pieces the arena holds (every position's logits
        // need more room, so those pieces are shorter).
        let piece = if every_row {
            MAX_LOGIT_ROWS
        } else {
            self.be.chunk_tokens
        };
        // An entry with images (a prompt holding them, or a later token of such a
        // request) comes this way too, without graphs: its rows and rotary positions
        // are host copies made at each step. Image rows' ids name images, not
        // vocabulary entries: they embed token 0 and are overwritten.
        crate::exec::in_pieces(s.tokens, s.pos0, s.want, piece, |chunk, pos0, want| {
            let (off, n) = (pos0 - s.pos0, chunk.len());
            let embeds: Vec<(usize, &[f32])> = s
                .media
                .embeds
                .iter()
                .filter(|(r, _)| (off..off + n).contains(r))
                .map(|&(r, e)| (r - off, e))
                .collect();
            let rope = s.media.rope.map(|r| &r[off..off + n]);
            if embeds.is_empty() {
                self.be.load_inputs(chunk, pos0, rope)?;
            } else {
                let mut ids = chunk.to_vec();
                for &(r, _) in &embeds {
                    ids[r] = 0;
                }
                self.be.load_inputs(&ids, pos0, rope)?;
            }
            let media = model::Media {
                embeds: &embeds,
                rope,
            };
            let out = self.launch_step(s.seq, chunk, pos0, want, media)?;
            let rows = if want.logits() == Logits::All {
                chunk.len()
            } else {
                1
            };
            let r = self.read_out(out, want, (off, rows), s)?;
            if media.embeds.is_empty() && media.rope.is_none() {
                self.mtp_fill(s.seq, chunk, pos0, 0)?;
            } else if let Some(m) = self.states[s.seq].mtp.as_mut() {
                // Images: the MTP block was trained on text.
                m.lose();
            }
            Ok(r)
        })
    }
}

/// Whether a step entry feeds image rows or multimodal rotary positions.
fn has_media(s: &SeqStep) -> bool {
    !s.media.embeds.is_empty() || s.media.rope.is_some()
}
