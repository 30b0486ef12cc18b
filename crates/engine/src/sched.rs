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

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use model::{ExecError, Logits};

use crate::constraint::{ConstraintRun, LogitMask};
use crate::exec::{SeqSnapshot, SeqStep, StepOut, Want};
use crate::experts::TierStats;
use crate::sampler::Sampler;
use crate::{
    ms, Completion, EngineError, FinishReason, Flow, GenerateRequest, PromptProgress, Timings,
    TokenEvent, TokenLogprobs,
};

/// A request's callbacks: where its progress goes, and whether it still wants to go
/// on. The engine calls them from the thread that steps the engine.
pub trait RequestCallbacks {
    /// The request took slot `slot`; `cached` of its prompt's tokens are reused
    /// from the slot's state.
    fn admitted(&mut self, _slot: usize, _cached: usize) {}
    /// After each piece of the prompt is read. `Flow::Stop` ends the request
    /// before its first token (finish `Stopped`, no tokens); the pieces read stay
    /// in the slot's cache. `Flow::Force` is read as `Continue`.
    fn prompt(&mut self, _progress: &PromptProgress) -> Flow {
        Flow::Continue
    }
    /// After each token: continue, stop, or force tokens in next.
    fn token(&mut self, ev: &TokenEvent) -> Flow;
    /// True when `logits` should get every set of logits a token was chosen from
    /// (the prompt's last position, then each generated token's but the last).
    fn wants_logits(&self) -> bool {
        false
    }
    fn logits(&mut self, _logits: &[f32]) {}
    /// The request is no longer wanted (its client left): checked while it waits
    /// and before each step; it then ends with finish `Stopped`.
    fn cancelled(&self) -> bool {
        false
    }
    /// The request ended: its completion, or why it failed. Called exactly once.
    fn done(&mut self, result: Result<Completion, EngineError>);
}

/// What one slot's sequence holds.
#[derive(Debug, Default)]
pub(crate) struct SeqCache {
    /// Tokens whose effect is in the sequence's state, in order.
    pub history: Vec<u32>,
    /// The logits at the end of `history`, when known, so a prompt equal to the
    /// history needs no evaluation.
    pub last_logits: Option<Vec<f32>>,
    /// When a request last used this slot (scheduler ticks): the least recently
    /// used free slot is the one given to a request that can reuse none.
    pub last_used: u64,
    /// A request is decoding here.
    pub busy: bool,
    /// Snapshots of the recurrent state at positions of `history` where a later
    /// prompt may diverge (message starts, prompt ends), oldest first: the slot
    /// can go back to any of them, its own K/V below being still in place.
    pub marks: Vec<Mark>,
}

/// The recurrent state after `pos` tokens of a slot's history.
#[derive(Debug, Clone)]
pub(crate) struct Mark {
    pub pos: usize,
    pub snap: Arc<SeqSnapshot>,
    /// At a message start (not a prompt end).
    pub boundary: bool,
}

/// Marks a slot keeps (each holds one copy of the recurrent state).
pub(crate) const MAX_MARKS: usize = 4;

/// How a slot serves a prompt: keep `keep` tokens of its history, going back to
/// mark `mark` first when one is named.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Reuse {
    pub keep: usize,
    pub mark: Option<usize>,
}

/// How much of `prompt` the slot `c` can serve from its state. `recurrent`: the
/// model has state that cannot be rewound (DeltaNet), so the slot keeps its whole
/// history or goes back to one of its marks.
pub(crate) fn reusable(c: &SeqCache, prompt: &[u32], recurrent: bool) -> Reuse {
    let h = &c.history;
    if h.is_empty() {
        return Reuse::default();
    }
    if prompt.starts_with(h) && (h.len() < prompt.len() || c.last_logits.is_some()) {
        return Reuse {
            keep: h.len(),
            mark: None,
        };
    }
    // At least one prompt token is evaluated, to get logits.
    let common = h
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count()
        .min(prompt.len() - 1);
    if !recurrent {
        // Attention only: K/V past a position are never read.
        return Reuse {
            keep: common,
            mark: None,
        };
    }
    c.marks
        .iter()
        .enumerate()
        .filter(|(_, m)| m.pos <= common && m.pos > 0)
        .max_by_key(|(_, m)| m.pos)
        .map(|(i, m)| Reuse {
            keep: m.pos,
            mark: Some(i),
        })
        .unwrap_or_default()
}

/// Where a request's prompt should leave marks: before each of the last two
/// message starts (`boundary`, e.g. `<|im_start|>`) and at its end. Only models
/// with recurrent state need them.
pub(crate) fn mark_positions(prompt: &[u32], boundary: Option<u32>) -> Vec<(usize, bool)> {
    let mut at: Vec<(usize, bool)> = match boundary {
        Some(b) => prompt
            .iter()
            .enumerate()
            .filter(|&(i, &t)| t == b && i > 0)
            .map(|(i, _)| (i, true))
            .collect(),
        None => Vec::new(),
    };
    let n = at.len();
    at.drain(..n.saturating_sub(2));
    at.push((prompt.len(), false));
    at
}

/// The marks of `at` (from [`mark_positions`]) worth taking after `cached` prompt
/// tokens: each at least `gap` positions past the one before it (or past
/// `cached`), earlier ones first. A mark closer than that would save re-reading
/// fewer tokens than its snapshot costs on the executor.
pub(crate) fn spaced_marks(
    at: Vec<(usize, bool)>,
    cached: usize,
    gap: usize,
) -> Vec<(usize, bool)> {
    let mut last = cached;
    at.into_iter()
        .filter(|&(p, _)| {
            let keep = p >= last + gap.max(1);
            if keep {
                last = p;
            }
            keep
        })
        .collect()
}

/// One request being decoded in a slot.
pub(crate) struct Active {
    pub seq: usize,
    pub req: GenerateRequest,
    sampler: Sampler,
    seed: u64,
    constraint: Option<ConstraintRun>,
    /// What the executor returns for this request's steps.
    want: Want,
    timings: Timings,
    /// The executor's tiered-expert counts at admission (None: not tiered).
    experts_at_start: Option<TierStats>,
    t0: Instant,
    t1: Instant,
    /// Prompt tokens in the state (cached and evaluated).
    fed: usize,
    decoding: bool,
    out: Vec<u32>,
    forced: VecDeque<u32>,
    /// The constraint's mask for the logits the next step returns.
    mask: Option<LogitMask>,
    /// The mask must be computed while the next step runs.
    need_mask: bool,
    /// The token the next step feeds.
    pending: Option<u32>,
    /// Prompt positions still to mark (ascending, past `fed`), and whether each is
    /// a message start.
    marks: Vec<(usize, bool)>,
}

/// What a step gave one request.
enum Outcome {
    Running,
    Done(Result<Completion, EngineError>),
}

/// The facts about the model a step needs.
pub(crate) struct Limits {
    pub n_ctx: usize,
    pub n_vocab: usize,
    /// End-of-generation tokens.
    pub eog: Vec<u32>,
}

impl Limits {
    pub fn check(&self, tokens: &[u32]) -> Result<(), EngineError> {
        match tokens.iter().find(|&&id| id as usize >= self.n_vocab) {
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
        self.check(&req.prompt)?;
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

impl Active {
    /// Starts `req` in slot `seq`, whose state holds `cached` tokens of its prompt;
    /// `experts` is the executor's tiered-expert count now.
    pub fn new(
        seq: usize,
        req: GenerateRequest,
        cached: usize,
        lim: &Limits,
        logits: bool,
        marks: Vec<(usize, bool)>,
        experts: Option<TierStats>,
    ) -> Active {
        let seed = req.sampling.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let sampler = Sampler::new(&req.sampling, seed, &req.prompt);
        let constraint = req.constraint.as_ref().map(|c| c.start(&lim.eog));
        // With plain greedy sampling and nobody asking for logits, the device
        // picks the token and only its id comes back.
        let want = if !logits
            && req.logprobs.is_none()
            && sampler.is_plain_greedy()
            && constraint.is_none()
        {
            Want::Greedy
        } else {
            Want::Logits(Logits::Last)
        };
        let now = Instant::now();
        Active {
            seq,
            timings: Timings {
                cache_n: cached,
                prompt_n: req.prompt.len() - cached,
                ..Timings::default()
            },
            experts_at_start: experts,
            req,
            sampler,
            seed,
            constraint,
            want,
            t0: now,
            t1: now,
            fed: cached,
            decoding: false,
            out: Vec::new(),
            forced: VecDeque::new(),
            mask: None,
            need_mask: false,
            pending: None,
            marks: marks.into_iter().filter(|&(p, _)| p > cached).collect(),
        }
    }

    fn completion(&mut self, finish: FinishReason) -> Completion {
        if self.decoding {
            self.timings.predicted_n = self.out.len();
            self.timings.predicted_ms = ms(self.t1.elapsed());
        }
        Completion {
            tokens: std::mem::take(&mut self.out),
            finish,
            timings: self.timings.clone(),
            seed: self.seed,
        }
    }

    /// Puts the tiered experts' traffic since admission into a finished request's
    /// timings: `now` is the executor's count after the request's last step.
    fn account_experts(&self, r: &mut Result<Completion, EngineError>, now: Option<TierStats>) {
        if let (Ok(c), Some(start), Some(now)) = (r, self.experts_at_start, now) {
            c.timings.experts = Some(now.minus(&start));
        }
    }

    /// The prompt is in the state and `next` holds its last position's output:
    /// generation starts.
    fn start_decoding(
        &mut self,
        cache: &mut SeqCache,
        next: StepOut,
        lim: &Limits,
        sink: &mut dyn RequestCallbacks,
    ) -> Outcome {
        self.timings.prompt_ms = ms(self.t0.elapsed());
        self.t1 = Instant::now();
        self.decoding = true;
        if let StepOut::Logits(l) = &next {
            if sink.wants_logits() {
                sink.logits(l);
            }
        }
        match self.constraint.as_mut().map(|c| c.next_mask()).transpose() {
            Ok(m) => self.mask = m,
            Err(e) => return Outcome::Done(Err(e.into())),
        }
        self.advance(cache, next, lim, sink)
    }

    /// Chooses the next token from `next` (the output for the end of the
    /// history), reports it, and either ends the request or sets the token the
    /// next step feeds.
    fn advance(
        &mut self,
        cache: &mut SeqCache,
        mut next: StepOut,
        lim: &Limits,
        sink: &mut dyn RequestCallbacks,
    ) -> Outcome {
        let mut masked = false;
        // Log-probabilities are the model's: kept from before a grammar mask.
        let unmasked = match (&next, self.req.logprobs, &self.constraint) {
            (StepOut::Logits(l), Some(_), Some(_)) => Some(l.clone()),
            _ => None,
        };
        let finish = 'f: {
            if self.out.len() >= self.req.max_tokens {
                break 'f FinishReason::Length;
            }
            if cache.history.len() >= lim.n_ctx {
                break 'f FinishReason::ContextFull;
            }
            let (token, was_forced) = match self.forced.pop_front() {
                Some(t) => (t, true),
                None => match &mut next {
                    StepOut::Logits(l) => {
                        if let (Some(c), Some(m)) = (self.constraint.as_ref(), self.mask.as_ref()) {
                            c.apply(m, l);
                            masked = true;
                        }
                        (self.sampler.sample(l), false)
                    }
                    StepOut::Token(t) => (*t, false),
                },
            };
            if let Some(c) = self.constraint.as_mut() {
                if let Err(e) = c.on_token(token, was_forced) {
                    return Outcome::Done(Err(e.into()));
                }
            }
            self.sampler.accept(token);
            self.out.push(token);
            let eog = lim.eog.contains(&token);
            let logprobs = match (&unmasked, &next, self.req.logprobs) {
                (Some(l), _, Some(n)) | (None, StepOut::Logits(l), Some(n)) => {
                    Some(TokenLogprobs::of(l, token, n))
                }
                _ => None,
            };
            let ev = TokenEvent {
                token,
                index: self.out.len() - 1,
                forced: was_forced,
                eog,
                logprobs,
            };
            match sink.token(&ev) {
                Flow::Continue => {}
                Flow::Stop => break 'f FinishReason::Stopped,
                Flow::Force(ts) => {
                    if let Err(e) = lim.check(&ts) {
                        return Outcome::Done(Err(e));
                    }
                    self.forced.extend(ts);
                }
            }
            if eog && self.req.stop_at_eog && self.forced.is_empty() {
                break 'f FinishReason::Eog;
            }
            if self.out.len() >= self.req.max_tokens {
                break 'f FinishReason::Length;
            }
            self.pending = Some(token);
            // The next position's mask is computed while the step that produces
            // its logits runs (not needed when the next token is forced).
            self.need_mask = self.constraint.is_some() && self.forced.is_empty();
            if !self.need_mask {
                self.mask = None;
            }
            return Outcome::Running;
        };
        // `next` belongs to the end of the history (the last token emitted was
        // not fed), so a request repeating this history can start from it.
        cache.last_logits = match next {
            StepOut::Logits(l) if !masked => Some(l),
            _ => None,
        };
        Outcome::Done(Ok(self.completion(finish)))
    }
}

/// One entry of a step: which request, and the tokens it feeds.
struct Entry {
    item: usize,
    tokens: Vec<u32>,
    want: Want,
    prompt: bool,
}

/// What one step did.
pub(crate) struct Stepped {
    /// For each item: it ended (its sink has been told).
    pub ended: Vec<bool>,
    /// Entries the executor ran.
    pub ran: usize,
    /// Some entry waited for room in the context pool.
    pub starved: bool,
}

/// One scheduler step over `items` (requests in admission order): every decoding
/// request feeds its pending token, and the first request still reading its prompt
/// feeds its next piece, in one executor call, as far as `room` (free positions
/// of the shared context pool) allows; the others wait.
pub(crate) fn step(
    exec: &mut dyn crate::exec::Executor,
    seqs: &mut [SeqCache],
    lim: &Limits,
    items: &mut [(&mut Active, &mut dyn RequestCallbacks)],
    mut room: usize,
) -> Stepped {
    let mut ended = vec![false; items.len()];
    let mut starved = false;
    let chunk = exec.prompt_chunk().max(1);
    let mut entries = Vec::new();
    let mut prompt_taken = false;
    for (i, (act, sink)) in items.iter_mut().enumerate() {
        if sink.cancelled() {
            let c = act.completion(FinishReason::Stopped);
            sink.done(Ok(c));
            ended[i] = true;
            continue;
        }
        if act.decoding {
            if let Some(t) = act.pending {
                if room == 0 {
                    starved = true;
                    continue;
                }
                room -= 1;
                entries.push(Entry {
                    item: i,
                    tokens: vec![t],
                    want: act.want,
                    prompt: false,
                });
            }
        } else if !prompt_taken {
            prompt_taken = true;
            let p = &act.req.prompt;
            // Pieces end at marks, so the state there can be kept.
            let mark = act.marks.first().map_or(p.len(), |m| m.0);
            let end = (act.fed + chunk).min(p.len()).min(mark);
            if end - act.fed > room {
                starved = true;
                continue;
            }
            room -= end - act.fed;
            entries.push(Entry {
                item: i,
                tokens: p[act.fed..end].to_vec(),
                // The earlier pieces only advance the state (their greedy token,
                // the cheapest output, is dropped).
                want: if end == p.len() {
                    act.want
                } else {
                    Want::Greedy
                },
                prompt: true,
            });
        }
    }
    let ran = entries.len();
    if entries.is_empty() {
        return Stepped {
            ended,
            ran,
            starved,
        };
    }
    let batch: Vec<SeqStep> = entries
        .iter()
        .map(|e| {
            let seq = items[e.item].0.seq;
            SeqStep {
                seq,
                tokens: &e.tokens,
                pos0: seqs[seq].history.len(),
                want: e.want,
            }
        })
        .collect();
    // The constraints' masks for the logits this step returns are computed while
    // it runs.
    let mut masking: Vec<(usize, &mut ConstraintRun)> = Vec::new();
    for (i, (act, _)) in items.iter_mut().enumerate() {
        if act.decoding && act.pending.is_some() && act.need_mask && !ended[i] {
            if let Some(c) = act.constraint.as_mut() {
                masking.push((i, c));
            }
        }
    }
    let (result, masks) = std::thread::scope(|s| {
        let helpers: Vec<_> = masking
            .into_iter()
            .map(|(i, c)| (i, s.spawn(move || c.next_mask())))
            .collect();
        let result = exec.step(&batch);
        let masks: Vec<_> = helpers.into_iter().map(|(i, h)| (i, h.join())).collect();
        (result, masks)
    });
    drop(batch);
    for (i, m) in masks {
        let (act, sink) = &mut items[i];
        match m {
            Ok(Ok(m)) => act.mask = Some(m),
            Ok(Err(e)) => {
                sink.done(Err(e.into()));
                ended[i] = true;
            }
            Err(_) => {
                sink.done(Err(crate::constraint::ConstraintError(
                    "the grammar failed (panic)".into(),
                )
                .into()));
                ended[i] = true;
            }
        }
    }
    let outs = match result {
        Ok(o) if o.len() == entries.len() => o,
        r => {
            let err = match r {
                Err(e) => e,
                Ok(_) => {
                    ExecError::new("step", "the executor returned the wrong number of outputs")
                }
            };
            // The states may hold part of this step: those slots start over.
            for e in &entries {
                let seq = items[e.item].0.seq;
                let c = &mut seqs[seq];
                c.history.clear();
                c.last_logits = None;
                let _ = exec.clear(seq);
                if !ended[e.item] {
                    items[e.item].1.done(Err(err.clone().into()));
                    ended[e.item] = true;
                }
            }
            return Stepped {
                ended,
                ran,
                starved,
            };
        }
    };
    for (e, out) in entries.into_iter().zip(outs) {
        let (act, sink) = &mut items[e.item];
        let cache = &mut seqs[act.seq];
        cache.history.extend_from_slice(&e.tokens);
        cache.last_logits = None;
        if ended[e.item] {
            continue;
        }
        let outcome = if e.prompt {
            act.fed += e.tokens.len();
            if let Some(&(pos, boundary)) = act.marks.first().filter(|m| m.0 == act.fed) {
                act.marks.remove(0);
                keep_mark(exec, act.seq, cache, pos, boundary);
            }
            let progress = PromptProgress {
                done: act.fed,
                total: act.req.prompt.len(),
                cached: act.timings.cache_n,
            };
            let last = act.fed == act.req.prompt.len();
            if sink.prompt(&progress) == Flow::Stop {
                act.timings.prompt_n = act.fed - act.timings.cache_n;
                act.timings.prompt_ms = ms(act.t0.elapsed());
                if let (true, StepOut::Logits(l)) = (last, out) {
                    cache.last_logits = Some(l);
                }
                Outcome::Done(Ok(act.completion(FinishReason::Stopped)))
            } else if last {
                act.start_decoding(cache, out, lim, &mut **sink)
            } else {
                Outcome::Running
            }
        } else {
            act.pending = None;
            if let StepOut::Logits(l) = &out {
                if sink.wants_logits() {
                    sink.logits(l);
                }
            }
            act.advance(cache, out, lim, &mut **sink)
        };
        if let Outcome::Done(mut r) = outcome {
            act.account_experts(&mut r, exec.expert_stats());
            sink.done(r);
            ended[e.item] = true;
        }
    }
    Stepped {
        ended,
        ran,
        starved,
    }
}

/// Ends `act` now with `finish` (the context pool cannot give it room); `experts`
/// is the executor's tiered-expert count now.
pub(crate) fn end(
    act: &mut Active,
    sink: &mut dyn RequestCallbacks,
    finish: FinishReason,
    experts: Option<TierStats>,
) {
    let mut r = Ok(act.completion(finish));
    act.account_experts(&mut r, experts);
    sink.done(r);
}

/// Keeps a snapshot of slot `seq`'s recurrent state at `pos` (its history's
/// length) as a mark; the oldest marks go beyond `MAX_MARKS`.
fn keep_mark(
    exec: &mut dyn crate::exec::Executor,
    seq: usize,
    cache: &mut SeqCache,
    pos: usize,
    boundary: bool,
) {
    if !exec.snapshots() {
        return;
    }
    match exec.snapshot_recurrent(seq, pos) {
        Ok(snap) => {
            cache.marks.retain(|m| m.pos != pos);
            cache.marks.push(Mark {
                pos,
                snap: Arc::new(snap),
                boundary,
            });
            cache.marks.sort_by_key(|m| m.pos);
            let n = cache.marks.len();
            cache.marks.drain(..n.saturating_sub(MAX_MARKS));
        }
        Err(e) => tracing::warn!("slot {seq}: no snapshot at position {pos}: {e}"),
    }
}

/// Starts `act` at once when its prompt is entirely cached and the logits at its
/// end are known (nothing to evaluate). True when the request already ended
/// (its callbacks were told).
pub(crate) fn start_cached(
    act: &mut Active,
    cache: &mut SeqCache,
    lim: &Limits,
    sink: &mut dyn RequestCallbacks,
) -> bool {
    if act.fed < act.req.prompt.len() {
        return false;
    }
    let Some(l) = cache.last_logits.take() else {
        return false;
    };
    match act.start_decoding(cache, StepOut::Logits(l), lim, sink) {
        Outcome::Running => false,
        Outcome::Done(mut r) => {
            // No step ran for it.
            act.account_experts(&mut r, act.experts_at_start);
            sink.done(r);
            true
        }
    }
}

/// Where `Engine::generate_with_logits` hands each set of logits.
pub(crate) type LogitsFn<'a> = &'a mut dyn FnMut(&[f32]);

/// [`RequestCallbacks`] over the borrowed closures of `Engine::generate*`; keeps
/// the result.
pub(crate) struct Closures<'a> {
    pub on_prompt: &'a mut dyn FnMut(&PromptProgress) -> Flow,
    pub on_token: &'a mut dyn FnMut(&TokenEvent) -> Flow,
    pub on_logits: Option<LogitsFn<'a>>,
    pub result: Option<Result<Completion, EngineError>>,
}

impl RequestCallbacks for Closures<'_> {
    fn prompt(&mut self, p: &PromptProgress) -> Flow {
        (self.on_prompt)(p)
    }
    fn token(&mut self, ev: &TokenEvent) -> Flow {
        (self.on_token)(ev)
    }
    fn wants_logits(&self) -> bool {
        self.on_logits.is_some()
    }
    fn logits(&mut self, l: &[f32]) {
        if let Some(f) = self.on_logits.as_mut() {
            f(l);
        }
    }
    fn done(&mut self, r: Result<Completion, EngineError>) {
        self.result = Some(r);
    }
}

#[cfg(test)]
mod tests {
    use super::spaced_marks;

    #[test]
    fn marks_closer_than_the_gap_are_not_taken() {
        let at = vec![(31, true), (40, true), (42, false)];
        assert_eq!(spaced_marks(at.clone(), 0, 1), at);
        assert_eq!(spaced_marks(at.clone(), 0, 16), vec![(31, true)]);
        assert_eq!(
            spaced_marks(at.clone(), 0, 10),
            vec![(31, true), (42, false)]
        );
        // Counted from what the slot already holds.
        assert_eq!(spaced_marks(at.clone(), 20, 16), vec![(40, true)]);
        assert_eq!(spaced_marks(vec![(1, false)], 0, 32), vec![]);
    }
}
