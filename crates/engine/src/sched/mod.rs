//! The scheduler: slots, each an executor sequence that decodes one request at a
//! time; a step decodes one token for every decoding slot and reads one piece of
//! one waiting prompt, all in one executor call; admission in arrival order.
//!
//! Batching is invisible (docs/design.md, invariant 3): a request gets the bits it
//! gets alone. The executor's batched step is exact per sequence, sampling state is
//! per request, and a prompt is read in the pieces a solo run cuts (from its first
//! uncached token, `Executor::prompt_chunk` at a time), so neither the company a
//! request keeps nor when it arrived changes its tokens.
//!
//! A slot keeps its sequence's tokens after a request ends (the prompt cache): the
//! next request goes to the free slot whose state it can reuse the most of.
//!
//! [`Scheduler`] (here) owns the slots, the queue, the running requests, the shared
//! context pool, the prompt cache and the counters; each of its methods that runs
//! the model takes the executor (`&mut dyn Executor`), which the engine owns.
//! `admit.rs`: which slot a request gets and what of its state it keeps (the slot's
//! own, a mark, the prompt cache), and a conversation a slot loses stashed into the
//! prompt cache; `step.rs`: one step over the running requests, and each one's
//! decoding state (`Active`); `seq_cache.rs`: what a slot holds and how much of a
//! prompt it can serve; `callbacks.rs`: how a request reports back.

mod admit;
mod callbacks;
pub(crate) mod media;
mod seq_cache;
mod step;

pub use callbacks::RequestCallbacks;
pub use seq_cache::MessageStart;

use std::collections::VecDeque;

use model::{ExecError, Logits};

use crate::api::{
    Completion, FinishReason, Flow, GenerateRequest, PromptProgress, Timings, TokenEvent,
};
use crate::error::EngineError;
use crate::exec::{self, Executor, SeqStep, StepOut, Want};
use crate::prompt_cache::{self, PromptCache};
use crate::spec::{Drafter, SpecConfig, StepCosts};
use callbacks::{Closures, LogitsFn};
use seq_cache::SeqCache;
use step::Active;

/// The facts about the model a step needs.
pub(crate) struct Limits {
    pub n_ctx: usize,
    pub n_vocab: usize,
    /// End-of-generation tokens.
    pub eog: Vec<u32>,
}

impl Limits {
    pub fn check(&self, tokens: &[u32]) -> Result<(), EngineError> {
        self.check_ids(tokens, false)
    }

    /// [`Limits::check`], letting image rows' ids through when `images` (a prompt
    /// whose images `media::mark_images` placed).
    fn check_ids(&self, tokens: &[u32], images: bool) -> Result<(), EngineError> {
        let image = |id: u32| images && id >= media::IMAGE_ID_BASE;
        match tokens
            .iter()
            .find(|&&id| id as usize >= self.n_vocab && !image(id))
        {
            Some(&id) => Err(EngineError::BadToken {
                id,
                n_vocab: self.n_vocab,
            }),
            None => Ok(()),
        }
    }

    /// Refuses a request that cannot run (before it takes a slot).
    pub fn validate(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.check_ids(&req.prompt, !req.images.is_empty())?;
        if req.prompt.len() >= self.n_ctx {
            return Err(EngineError::PromptTooLong {
                prompt: req.prompt.len(),
                n_ctx: self.n_ctx,
            });
        }
        for &(id, _) in &req.sampling.logit_bias {
            self.check(&[id])?;
        }
        Ok(())
    }
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
    /// How saving it to `--prompt-cache-dir` fares (None: memory only).
    pub disk: Option<prompt_cache::WriterStatus>,
}

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

/// A request waiting for a slot.
type Queued = (GenerateRequest, Box<dyn RequestCallbacks + Send>);

/// The slots of one loaded model and the requests they serve: `submit` queues a
/// request, `step` admits what fits and decodes one token of every running request.
pub(crate) struct Scheduler {
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
    store: Option<PromptCache>,
    /// Mirrors the prompt cache into `--prompt-cache-dir` on its own thread (None:
    /// memory only).
    store_writer: Option<prompt_cache::Writer>,
    /// The token that starts a chat message (`<|im_start|>`), where a later prompt
    /// may diverge from this one.
    boundary: Option<MessageStart>,
    /// The model has recurrent state (DeltaNet), which cannot be rewound: a slot
    /// goes back to a mark or keeps its whole history.
    recurrent: bool,
    counters: CacheCounters,
    /// The limits every request is checked against (context — the positions of the
    /// pool the slots share —, vocabulary, end-of-generation tokens).
    limits: Limits,
    /// Sequences the last `step` ran (0: it ran none).
    last_ran: usize,
    /// Speculative decoding's settings, and the draft source (None: off).
    spec: SpecConfig,
    drafter: Option<Drafter>,
    /// What steps of one sequence cost by the tokens they feed (draft lengths follow).
    costs: StepCosts,
    /// The vision encoder requests' images go through (None: text only).
    vision: Option<std::sync::Arc<media::Vision>>,
    /// The executor failed for good (a lost device): every request is refused.
    fatal: Option<String>,
}

impl Scheduler {
    /// `slots` empty slots sharing a context pool of `limits.n_ctx` positions, with
    /// the prompt cache `store` (mirrored by `store_writer`).
    pub fn new(
        slots: usize,
        limits: Limits,
        recurrent: bool,
        boundary: Option<MessageStart>,
        store: Option<PromptCache>,
        store_writer: Option<prompt_cache::Writer>,
    ) -> Scheduler {
        Scheduler {
            seqs: (0..slots).map(|_| SeqCache::default()).collect(),
            queue: VecDeque::new(),
            running: Vec::new(),
            tick: 0,
            store,
            store_writer,
            boundary,
            recurrent,
            counters: CacheCounters::default(),
            limits,
            last_ran: 0,
            spec: SpecConfig::default(),
            drafter: None,
            costs: StepCosts::default(),
            vision: None,
            fatal: None,
        }
    }

    /// Requests may carry images, which `vision` encodes.
    pub fn set_vision(&mut self, vision: media::Vision) {
        self.vision = Some(std::sync::Arc::new(vision));
    }

    /// Speculates with `drafter` (None: off) under `spec`'s limits from the next
    /// admission on.
    pub fn set_spec(&mut self, spec: SpecConfig, drafter: Option<Drafter>) {
        self.spec = spec;
        self.drafter = drafter;
    }

    /// The draft source requests get (None: speculation is off).
    pub fn drafter(&self) -> Option<Drafter> {
        self.drafter
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

    /// Waits until the prompt cache's files mirror what it holds now.
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
            disk: self.store_writer.as_ref().map(|w| w.status()),
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
    pub fn submit(&mut self, mut req: GenerateRequest, mut sink: Box<dyn RequestCallbacks + Send>) {
        if let Some(e) = self.fatal_error() {
            sink.done(Err(e));
            return;
        }
        match self.mark_images(&mut req) {
            Ok(()) => self.queue.push_back((req, sink)),
            Err(e) => sink.done(Err(e)),
        }
    }

    /// What the executor's failure that ends this engine's work said (None: none).
    pub fn fatal(&self) -> Option<&str> {
        self.fatal.as_deref()
    }

    /// The error every request gets once the executor failed for good.
    fn fatal_error(&self) -> Option<EngineError> {
        self.fatal.as_ref().map(|f| {
            EngineError::Device(format!(
                "the executor failed and can run nothing more ({f}); restart the server"
            ))
        })
    }

    /// Writes the ids of `req`'s images over their placeholders (after checking the
    /// prompt's own tokens), so that slots and the prompt cache tell images apart.
    fn mark_images(&self, req: &mut GenerateRequest) -> Result<(), EngineError> {
        if req.images.is_empty() {
            return Ok(());
        }
        self.limits.check(&req.prompt)?;
        media::mark_images(req, self.vision.as_deref())
    }

    /// Admits what fits, then decodes one token of every running request (and one
    /// piece of the first waiting prompt) in one executor step. True while work
    /// remains.
    pub fn step(&mut self, exec: &mut dyn Executor) -> bool {
        if let Some(e) = self.fatal_error() {
            // Nothing runs any more: what waits is refused.
            for (_, mut sink) in self.queue.drain(..) {
                sink.done(Err(EngineError::Device(e.to_string())));
            }
            for (_, mut sink) in self.running.drain(..) {
                sink.done(Err(EngineError::Device(e.to_string())));
            }
            return false;
        }
        if self.running.is_empty() {
            // A slot still marked busy lost its request to a panic mid-step: its
            // state may hold part of that step, so it starts over.
            for seq in 0..self.seqs.len() {
                if self.seqs[seq].busy {
                    self.seqs[seq].busy = false;
                    if let Err(e) = self.clear_seq(exec, seq) {
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
            match self.admit(exec, seq, req, logits, sink.as_mut()) {
                Ok(Some(act)) => self.running.push((act, sink)),
                Ok(None) => {}
                Err(e) => sink.done(Err(e)),
            }
        }
        self.last_ran = 0;
        if self.running.is_empty() {
            return !self.queue.is_empty();
        }
        self.make_room(exec);
        let mut running = std::mem::take(&mut self.running);
        let mut items: Vec<(&mut Active, &mut dyn RequestCallbacks)> = running
            .iter_mut()
            .map(|(a, s)| (a, s.as_mut() as &mut dyn RequestCallbacks))
            .collect();
        let room = self
            .limits
            .n_ctx
            .saturating_sub(self.seqs.iter().map(|c| c.history.len()).sum());
        let mut done = step::run(
            exec,
            &mut self.seqs,
            &self.limits,
            &mut items,
            room,
            &mut self.costs,
        );
        if let Some(f) = done.fatal.take() {
            tracing::error!(
                "the executor failed for good: {f}; every request is refused from now on"
            );
            self.fatal = Some(f);
        }
        if done.ran == 0 && done.starved {
            // Every running request waits for room that only they hold: the newest
            // ends (finish `ContextFull`) so the others can go on.
            if let Some(i) = (0..items.len()).rev().find(|&i| !done.ended[i]) {
                let (act, sink) = &mut items[i];
                tracing::warn!(
                    "the context pool of {} positions is full: request in slot {} ends (raise --max-context or lower --parallel)",
                    self.limits.n_ctx,
                    act.seq
                );
                step::end(
                    act,
                    &mut **sink,
                    FinishReason::ContextFull,
                    exec.expert_stats(),
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
    fn make_room(&mut self, exec: &mut dyn Executor) {
        let want = self.running.len() + exec.prompt_chunk();
        loop {
            let used: usize = self.seqs.iter().map(|c| c.history.len()).sum();
            if used + want <= self.limits.n_ctx {
                return;
            }
            let idle = (0..self.seqs.len())
                .filter(|&i| !self.seqs[i].busy && !self.seqs[i].history.is_empty())
                .min_by_key(|&i| self.seqs[i].last_used);
            let Some(seq) = idle else {
                return;
            };
            self.stash_seq(exec, seq);
            if let Err(e) = self.clear_seq(exec, seq) {
                tracing::warn!("slot {seq}: freeing its positions: {e}");
                return;
            }
        }
    }

    /// Forgets every slot's cached sequence (no request may be running).
    pub fn reset(&mut self, exec: &mut dyn Executor) -> Result<(), EngineError> {
        self.check_idle()?;
        for seq in 0..self.seqs.len() {
            self.clear_seq(exec, seq)?;
        }
        Ok(())
    }

    fn clear_seq(&mut self, exec: &mut dyn Executor, seq: usize) -> Result<(), EngineError> {
        let c = &mut self.seqs[seq];
        c.history.clear();
        c.last_logits = None;
        c.marks.clear();
        exec.clear(seq)?;
        Ok(())
    }

    fn check_idle(&self) -> Result<(), EngineError> {
        if self.busy() {
            Err(EngineError::Settings(
                "the engine is decoding submitted requests: step it until they end first".into(),
            ))
        } else {
            Ok(())
        }
    }

    /// Runs `req` to its end on this thread, through the scheduler's step (a batch
    /// of one), reporting to the closures; nothing else may be queued or running.
    pub fn run_alone<'a>(
        &mut self,
        exec: &mut dyn Executor,
        req: &GenerateRequest,
        on_prompt: &'a mut dyn FnMut(&PromptProgress) -> Flow,
        on_token: &'a mut dyn FnMut(&TokenEvent) -> Flow,
        on_logits: Option<LogitsFn<'a>>,
    ) -> Result<Completion, EngineError> {
        self.check_idle()?;
        if let Some(e) = self.fatal_error() {
            return Err(e);
        }
        let mut sink = Closures {
            on_prompt,
            on_token,
            on_logits,
            result: None,
        };
        let mut req = req.clone();
        self.mark_images(&mut req)?;
        let seq = self.pick_seq(&req.prompt).unwrap_or(0);
        let logits = sink.wants_logits();
        if let Some(mut act) = self.admit(exec, seq, req, logits, &mut sink)? {
            loop {
                let mut items: [(&mut Active, &mut dyn RequestCallbacks); 1] =
                    [(&mut act, &mut sink)];
                // Alone: the whole context is this request's.
                let room = self
                    .limits
                    .n_ctx
                    .saturating_sub(self.seqs[seq].history.len());
                let done = step::run(
                    exec,
                    &mut self.seqs,
                    &self.limits,
                    &mut items,
                    room,
                    &mut self.costs,
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

    /// Evaluates `tokens` from an empty state in slot 0 and returns the logits of
    /// every position (n_vocab each).
    pub fn logits_all(
        &mut self,
        exec: &mut dyn Executor,
        tokens: &[u32],
    ) -> Result<Vec<f32>, EngineError> {
        self.check_idle()?;
        self.limits.check(tokens)?;
        if tokens.len() > self.limits.n_ctx {
            return Err(EngineError::PromptTooLong {
                prompt: tokens.len(),
                n_ctx: self.limits.n_ctx,
            });
        }
        self.clear_seq(exec, 0)?;
        let StepOut::Logits(all) = self.feed(exec, tokens, Want::Logits(Logits::All))? else {
            return Err(ExecError::new("logits_all", "the executor returned a token").into());
        };
        let n_vocab = self.limits.n_vocab;
        self.seqs[0].last_logits = Some(all[all.len() - n_vocab..].to_vec());
        Ok(all)
    }

    /// The time of verify steps (`scoria bench --verify`): feeds `prefix` to slot 0
    /// from an empty state, then runs each of `steps` after it as a speculative verify
    /// step would (every row's greedy token; the trail kept where the executor keeps
    /// one and the step has drafts), each rolled back to its first token after (all
    /// drafts rejected), so the next one starts one position later. Returns each
    /// step's wall time in ms (the step returns after its tokens are downloaded).
    pub fn time_verify(
        &mut self,
        exec: &mut dyn Executor,
        prefix: &[u32],
        steps: &[Vec<u32>],
    ) -> Result<Vec<f64>, EngineError> {
        self.check_idle()?;
        let most = steps.iter().map(Vec::len).max().unwrap_or(0);
        if most > 1 && most > exec.verify_tokens() {
            return Err(EngineError::Settings(format!(
                "a verify step of {most} tokens, but this engine verifies at most {} \
                 (speculation off, or --draft-max below {}): run with --spec and \
                 --draft-max {}",
                exec.verify_tokens(),
                most - 1,
                most - 1
            )));
        }
        let need = prefix.len() + steps.len() + most;
        if need > self.limits.n_ctx {
            return Err(EngineError::PromptTooLong {
                prompt: need,
                n_ctx: self.limits.n_ctx,
            });
        }
        self.clear_seq(exec, 0)?;
        if !prefix.is_empty() {
            self.feed(exec, prefix, Want::Greedy)?;
        }
        let mut pos0 = prefix.len();
        let mut ms = Vec::with_capacity(steps.len());
        let result = steps.iter().try_for_each(|tokens| {
            let n = tokens.len();
            let verify = n > 1;
            if verify {
                exec.keep_trail(0)?;
            }
            let t = std::time::Instant::now();
            exec.step(&[SeqStep {
                seq: 0,
                tokens,
                pos0,
                want: if verify {
                    Want::GreedyRows
                } else {
                    Want::Greedy
                },
                media: Default::default(),
                draws: &[],
            }])?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            if verify {
                exec.rollback(0, pos0 + 1)?;
            }
            pos0 += 1;
            Ok::<(), ExecError>(())
        });
        // The slot's history is not what the steps left: start over next time.
        let cleared = self.clear_seq(exec, 0);
        result?;
        cleared?;
        Ok(ms)
    }

    /// Feeds `tokens` after slot 0's history, in prompt chunks; returns the
    /// logits of the last position (or of all positions with `Logits::All`), or
    /// the greedy token.
    fn feed(
        &mut self,
        exec: &mut dyn Executor,
        tokens: &[u32],
        want: Want,
    ) -> Result<StepOut, EngineError> {
        let c = &mut self.seqs[0];
        c.last_logits = None;
        let pos0 = c.history.len();
        let chunk = exec.prompt_chunk();
        let out = exec::in_pieces(tokens, pos0, want, chunk, |chunk, pos0, want| {
            exec.step(&[SeqStep {
                seq: 0,
                tokens: chunk,
                pos0,
                want,
                media: Default::default(),
                draws: &[],
            }])?
            .pop()
            .ok_or_else(|| ExecError::new("step", "the executor returned no output"))
        });
        match out {
            Ok(o) => {
                self.seqs[0].history.extend_from_slice(tokens);
                Ok(o)
            }
            Err(e) => {
                // The state may hold part of this feed: start over next time.
                let _ = self.clear_seq(exec, 0);
                Err(e.into())
            }
        }
    }
}
