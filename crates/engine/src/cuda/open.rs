//! Opening the CUDA executor: what it may take (`Budgets`), the VRAM check with
//! the numbers and the remedy before anything is allocated, the context, prompt
//! chunk and prompt pool chosen from what is left, the weights uploaded (all of
//! them, or the dense part and the tiered expert store), the MTP block where asked
//! for, and the startup account (`VramAccount`).

use super::backend::tiered::{self, Tiered};
use super::backend::{self, CudaBackend, MAX_ROWS};
use super::{gib, weights, CudaExecutor, CONTEXT_VRAM, MAX_LOGIT_ROWS};
use crate::experts::{plan, ExpertIndex, ExpertStore, PlanRequest, ReadPolicy, RoutingProfile};
use crate::memory::ContextAsk;
use crate::EngineError;
use cuda::{Gpu, Lane};
use model::{ModelConfig, ModelWeights};
use std::collections::HashMap;
use weights::cuda_err;
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
    /// Keep the model's MTP block in VRAM to draft with, its routed experts whole
    /// also when the trunk's are tiered (when the file has one; `cuda/mtp.rs`).
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
    /// The MTP block to upload beside the weights (`mtp_bytes`, with its buffers),
    /// and one sequence's MTP state (both counted in what `open_at` is given).
    mtp: Option<&'a model::weights::MtpWeights>,
    mtp_bytes: u64,
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
        let mtp_bytes = mtp.map_or(0, |m| {
            weights::mtp_bytes(m) + mtp_buf_bytes(cfg, PROMPT_CHUNKS[0])
        });
        let w_bytes = w_bytes + mtp_bytes;
        let mtp_state = |c: usize| mtp.map_or(0, |_| mtp_state_bytes(cfg, c, verify));
        let state_of =
            |c: usize| (cfg.seq_state_bytes(c) + trail_bytes(cfg, verify)) as u64 + mtp_state(c);
        let (n_ctx, chosen) = match ask {
            ContextAsk::Fixed(n) => (n, None),
            ContextAsk::Auto => {
                let dense = weights::upload_bytes(weights) - weights::routed_expert_bytes(weights)
                    + mtp_bytes;
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
            mtp_bytes,
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
            return Self::open_tiered(o, state);
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
        put_mtp(&mut be, mtp, mtp_state);
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
            mtp,
            mtp_bytes,
            mtp_state,
            ..
        } = o;
        let ordinal = gpu.ordinal();
        let name = gpu.name();
        // The MTP block's routed experts stay whole beside the tiered ones.
        let dense =
            weights::upload_bytes(weights) - weights::routed_expert_bytes(weights) + mtp_bytes;
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
        let mut be = CudaBackend::new(gpu, cfg.clone(), w, arena, n_ctx, chunk, Some(t))?;
        put_mtp(&mut be, mtp, mtp_state);
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
            verify_graphs: HashMap::new(),
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
}

/// Uploads the MTP block `mtp` (counted in the weights' VRAM already) into `be`; a
/// block the kernels cannot run is left out with a warning, not fatal (drafts then
/// come from prompt lookup).
fn put_mtp(be: &mut CudaBackend, mtp: Option<&model::weights::MtpWeights>, state: u64) {
    let Some(m) = mtp else { return };
    let ordinal = be.gpu.ordinal();
    match weights::upload_mtp(&be.gpu, &be.cfg, m).and_then(|w| be.set_mtp(w)) {
        Ok(bufs) => tracing::info!(
            "cuda:{ordinal}: MTP block in VRAM for drafts (its routed experts whole): \
             {:.2} GiB of weights and buffers, {:.2} GiB of K/V per slot",
            gib(weights::mtp_bytes(m) + bufs),
            gib(state)
        ),
        Err(e) => tracing::warn!("cuda:{ordinal}: no MTP drafts on the GPU: {e}"),
    }
}
