//! One step of the scheduler over the running requests: a token for every decoding
//! request and one piece of the first waiting prompt, in one executor call; and each
//! running request's own state (`Active`: its sampler, constraint, timings, forced
//! tokens) and what each output of the executor does to it.
//!
//! A prompt is cut where a solo run cuts it (`Executor::prompt_chunk` pieces from its
//! first uncached token, and at its marks), so a request's tokens do not depend on the
//! company it keeps (invariant 3); the constraints' masks for the logits a step
//! returns are computed beside it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use model::{ExecError, Logits};

use super::media::{EntryMedia, RequestMedia, IMAGE_ID_BASE};
use super::seq_cache::{Mark, SeqCache, MAX_MARKS};
use super::{Limits, RequestCallbacks};
use crate::api::{
    ms, Completion, FinishReason, Flow, GenerateRequest, PromptProgress, Timings, TokenEvent,
    TokenLogprobs,
};
use crate::constraint::{ConstraintError, ConstraintRun, LogitMask};
use crate::error::EngineError;
use crate::exec::{Executor, SeqStep, StepOut, Want};
use crate::experts::TierStats;
use crate::sampler::{Draw, Sampler};
use crate::spec::{RequestSpec, StepCosts};

/// One request being decoded in a slot.
pub(super) struct Active {
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
    /// Speculative decoding's drafts for this request (None: one token a step).
    pub spec: Option<RequestSpec>,
    /// The request's images and rotary positions (None: text).
    pub media: Option<RequestMedia>,
}

/// What a step gave one request (a value returned once per token, never stored:
/// its size does not matter).
#[allow(clippy::large_enum_variant)]
enum Outcome {
    Running,
    Done(Result<Completion, EngineError>),
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
        // With nobody asking for logits and no grammar mask, the executor picks the
        // token where the logits are and only its id comes back.
        let want = if logits || req.logprobs.is_some() || constraint.is_some() {
            Want::Logits(Logits::Last)
        } else if sampler.is_plain_greedy() {
            Want::Greedy
        } else {
            Want::Sample
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
            spec: None,
            media: None,
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
                    StepOut::Tokens(_) => {
                        let e = ExecError::new("step", "several tokens came back for one position");
                        return Outcome::Done(Err(e.into()));
                    }
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

impl Active {
    /// The drafts a verify step feeds after the pending token, at most `cap` (the
    /// positions free for them): none unless the request speculates and its next
    /// token is not forced, and none that could only be emitted past `max_tokens`.
    /// The executor is told to keep the trail the verify step needs to roll back.
    fn drafts(&mut self, exec: &mut dyn Executor, cap: usize, costs: &StepCosts) -> Vec<u32> {
        let Some(spec) = self.spec.as_mut() else {
            return Vec::new();
        };
        if !self.forced.is_empty() {
            return Vec::new();
        }
        // A verify step emits at most one token past its drafts.
        let left = self.req.max_tokens.saturating_sub(self.out.len() + 1);
        let (seq, pending) = (self.seq, self.pending);
        let mtp = |t, n| exec.mtp_draft(seq, t, n);
        let mut drafts = match spec.draft(&self.out, pending, cap.min(left), costs, mtp) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("slot {seq}: no MTP draft: {e}");
                Vec::new()
            }
        };
        // A lookup continued into an image would draft its rows' ids: stop before them.
        if let Some(i) = drafts.iter().position(|&t| t >= IMAGE_ID_BASE) {
            drafts.truncate(i);
        }
        if drafts.is_empty() {
            return drafts;
        }
        match exec.keep_trail(self.seq) {
            Ok(()) => drafts,
            Err(e) => {
                tracing::warn!("slot {}: no verify step: {e}", self.seq);
                Vec::new()
            }
        }
    }

    /// A verify step fed `tokens` (the pending token, then drafts) and returned `out`,
    /// every position's logits (or, for a request that needs no logits, every
    /// position's token: `Want::GreedyRows`, `Want::SampleRows`): emits tokens from the rows one by one exactly as
    /// plain decoding would from those logits (the mask after the tokens before it,
    /// the sampler, the callbacks), going on to the next row only while the token
    /// emitted equals the draft fed there; then rolls the sequence back to the last
    /// token accepted. `cache.history` grows by the tokens kept.
    fn verified(
        &mut self,
        exec: &mut dyn Executor,
        cache: &mut SeqCache,
        tokens: &[u32],
        out: StepOut,
        lim: &Limits,
        sink: &mut dyn RequestCallbacks,
    ) -> Result<Outcome, ExecError> {
        let nv = lim.n_vocab;
        let whole = match &out {
            StepOut::Logits(l) => l.len() == tokens.len() * nv,
            StepOut::Tokens(t) => t.len() == tokens.len(),
            StepOut::Token(_) => false,
        };
        if !whole {
            return Err(ExecError::new(
                "verify",
                format!(
                    "the executor did not return the output of the step's {} positions",
                    tokens.len()
                ),
            ));
        }
        // Row i's output, as a decode step of that position would return it.
        let row = |i: usize| match &out {
            StepOut::Logits(l) => StepOut::Logits(l[i * nv..(i + 1) * nv].to_vec()),
            StepOut::Tokens(t) => StepOut::Token(t[i]),
            StepOut::Token(t) => StepOut::Token(*t),
        };
        let pos0 = cache.history.len();
        self.pending = None;
        self.timings.draft_n += tokens.len() - 1;
        let mut fed = 0;
        let mut outcome = Outcome::Running;
        for (i, &token) in tokens.iter().enumerate() {
            let row = row(i);
            cache.history.push(token);
            fed = i + 1;
            if i > 0 && self.need_mask {
                // This row's mask, after the token just accepted (plain decoding
                // computes it beside the step that returns these logits).
                match self.constraint.as_mut().map(|c| c.next_mask()).transpose() {
                    Ok(m) => self.mask = m,
                    Err(e) => {
                        outcome = Outcome::Done(Err(e.into()));
                        break;
                    }
                }
            }
            if let (true, StepOut::Logits(l)) = (sink.wants_logits(), &row) {
                sink.logits(l);
            }
            outcome = self.advance(cache, row, lim, sink);
            let accepted = matches!(outcome, Outcome::Running)
                && self.forced.is_empty()
                && tokens.get(i + 1).is_some_and(|&d| self.pending == Some(d));
            if !accepted {
                break;
            }
            // The draft was fed at the next position: nothing is pending.
            self.pending = None;
            self.timings.draft_n_accepted += 1;
        }
        if let Some(spec) = self.spec.as_mut() {
            spec.verified(tokens.len() - 1, fed - 1);
        }
        if fed < tokens.len() {
            exec.rollback(self.seq, pos0 + fed)?;
        }
        Ok(outcome)
    }
}

/// One entry of a step: which request, and the tokens it feeds.
struct Entry {
    item: usize,
    tokens: Vec<u32>,
    want: Want,
    /// What a `Want::Sample` or `Want::SampleRows` entry samples with.
    draws: Vec<Draw>,
    prompt: bool,
    /// A verify step: `tokens[1..]` are drafts, and the executor keeps the trail to
    /// roll the sequence back to the last one accepted.
    verify: bool,
    /// Image rows and rotary positions (a request with images).
    media: Option<EntryMedia>,
    /// Seconds its drafts took to make (an MTP draft runs on the executor): part of
    /// what the step costs.
    draft_secs: f64,
}

/// What one step did.
pub(super) struct Stepped {
    /// For each item: it ended (its sink has been told).
    pub ended: Vec<bool>,
    /// Entries the executor ran.
    pub ran: usize,
    /// Some entry waited for room in the context pool.
    pub starved: bool,
    /// The executor failed in a way it cannot recover from (`ExecError::fatal`).
    pub fatal: Option<String>,
}

/// One scheduler step over `items` (requests in admission order): every decoding
/// request feeds its pending token, and the first request still reading its prompt
/// feeds its next piece, in one executor call, as far as `room` (free positions
/// of the shared context pool) allows; the others wait.
pub(super) fn run(
    exec: &mut dyn Executor,
    seqs: &mut [SeqCache],
    lim: &Limits,
    items: &mut [(&mut Active, &mut dyn RequestCallbacks)],
    mut room: usize,
    costs: &mut StepCosts,
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
                let pos0 = seqs[act.seq].history.len();
                let cap = room
                    .min(lim.n_ctx.saturating_sub(pos0 + 1))
                    .min(exec.verify_tokens().saturating_sub(1));
                let t0 = Instant::now();
                let drafts = act.drafts(exec, cap, costs);
                let draft_secs = t0.elapsed().as_secs_f64();
                room -= drafts.len();
                let verify = !drafts.is_empty();
                let mut tokens = vec![t];
                tokens.extend(drafts);
                let want = match (verify, act.want) {
                    (false, w) => w,
                    // Plain greedy: each row's argmax is all the rows give; sampled:
                    // each row's token, drawn as if the drafts before it were kept.
                    (true, Want::Greedy) => Want::GreedyRows,
                    (true, Want::Sample) => Want::SampleRows,
                    (true, _) => Want::Logits(Logits::All),
                };
                let draws = match want {
                    Want::Sample => vec![act.sampler.draw()],
                    Want::SampleRows => act.sampler.draws_ahead(&tokens[1..]),
                    _ => Vec::new(),
                };
                entries.push(Entry {
                    item: i,
                    tokens,
                    want,
                    draws,
                    prompt: false,
                    verify,
                    media: None,
                    draft_secs,
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
                draws: if end == p.len() && act.want == Want::Sample {
                    vec![act.sampler.draw()]
                } else {
                    Vec::new()
                },
                prompt: true,
                verify: false,
                media: None,
                draft_secs: 0.0,
            });
        }
    }
    // A prompt piece whose images are still being encoded waits while other entries
    // run (alone, the step waits for the encoder).
    if entries.len() > 1 {
        entries.retain(|e| {
            let act = &items[e.item].0;
            !e.prompt
                || act
                    .media
                    .as_ref()
                    .is_none_or(|m| m.ready(seqs[act.seq].history.len(), e.tokens.len()))
        });
    }
    // Requests with images: each entry's image rows and rotary positions.
    for e in &mut entries {
        let (act, sink) = &mut items[e.item];
        let Some(m) = act.media.as_mut() else {
            continue;
        };
        match m.entry(seqs[act.seq].history.len(), e.tokens.len()) {
            Ok(em) => e.media = Some(em),
            Err(err) => {
                sink.done(Err(err));
                ended[e.item] = true;
            }
        }
    }
    entries.retain(|e| !ended[e.item]);
    let rows: Vec<Vec<(usize, &[f32])>> = entries
        .iter()
        .map(|e| {
            e.media.as_ref().map_or_else(Vec::new, |m| {
                m.embeds
                    .iter()
                    .map(|(r, im, k)| (*r, &im.data[k * im.width..(k + 1) * im.width]))
                    .collect()
            })
        })
        .collect();
    let ran = entries.len();
    if entries.is_empty() {
        return Stepped {
            ended,
            ran,
            starved,
            fatal: None,
        };
    }
    let batch: Vec<SeqStep> = entries
        .iter()
        .zip(&rows)
        .map(|(e, rows)| {
            let seq = items[e.item].0.seq;
            SeqStep {
                seq,
                tokens: &e.tokens,
                pos0: seqs[seq].history.len(),
                want: e.want,
                media: model::Media {
                    embeds: rows,
                    rope: e.media.as_ref().map(|m| &m.rope[..]),
                },
                draws: &e.draws,
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
        let t0 = Instant::now();
        let result = exec.step_each(&batch);
        let took = t0.elapsed().as_secs_f64();
        // What a step of one sequence costs by the tokens it feeds: the draft
        // lengths are chosen by it.
        if let ([e], Ok(_)) = (&entries[..], &result) {
            if !e.prompt && e.media.is_none() {
                costs.observe(e.tokens.len(), took + e.draft_secs);
            }
        }
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
                sink.done(Err(
                    ConstraintError("the grammar failed (panic)".into()).into()
                ));
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
                fail_entry(exec, seqs, seq, &err);
                if !ended[e.item] {
                    items[e.item].1.done(Err(err.clone().into()));
                    ended[e.item] = true;
                }
            }
            return Stepped {
                ended,
                ran,
                starved,
                fatal: err.is_fatal().then(|| err.to_string()),
            };
        }
    };
    for (e, out) in entries.into_iter().zip(outs) {
        let (act, sink) = &mut items[e.item];
        // An entry that failed alone: its request ends with the error, its slot
        // starts over; the others' steps are complete.
        let out = match out {
            Ok(o) => o,
            Err(err) => {
                fail_entry(exec, seqs, act.seq, &err);
                if !ended[e.item] {
                    sink.done(Err(err.into()));
                    ended[e.item] = true;
                }
                continue;
            }
        };
        let cache = &mut seqs[act.seq];
        cache.last_logits = None;
        if ended[e.item] {
            cache.history.extend_from_slice(&e.tokens);
            continue;
        }
        if e.verify {
            let outcome = match act.verified(exec, cache, &e.tokens, out, lim, &mut **sink) {
                Ok(o) => o,
                Err(err) => {
                    fail_entry(exec, seqs, act.seq, &err);
                    sink.done(Err(err.into()));
                    ended[e.item] = true;
                    continue;
                }
            };
            if let Outcome::Done(mut r) = outcome {
                act.account_experts(&mut r, exec.expert_stats());
                sink.done(r);
                ended[e.item] = true;
            }
            continue;
        }
        cache.history.extend_from_slice(&e.tokens);
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
        fatal: None,
    }
}

/// Sequence `seq`'s part of a step failed with `err`: its state may hold part of
/// the step, so the slot starts over (its request is told by the caller).
fn fail_entry(exec: &mut dyn Executor, seqs: &mut [SeqCache], seq: usize, err: &ExecError) {
    tracing::error!("slot {seq}: the step failed, its request ends: {err}");
    let c = &mut seqs[seq];
    c.history.clear();
    c.last_logits = None;
    c.marks.clear();
    if let Err(e) = exec.clear(seq) {
        tracing::warn!("slot {seq}: clearing after a failed step: {e}");
    }
}

/// Ends `act` now with `finish` (the context pool cannot give it room); `experts`
/// is the executor's tiered-expert count now.
pub(super) fn end(
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
/// length) as a mark; beyond `MAX_MARKS` the oldest go, but for the earliest.
fn keep_mark(
    exec: &mut dyn Executor,
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
            // The oldest go first, but for the earliest: where conversations that
            // share a system message part, which a new one comes back to.
            let n = cache.marks.len();
            if n > MAX_MARKS {
                cache.marks.drain(1..1 + n - MAX_MARKS);
            }
        }
        Err(e) => tracing::warn!("slot {seq}: no snapshot at position {pos}: {e}"),
    }
}

/// Starts `act` at once when its prompt is entirely cached and the logits at its
/// end are known (nothing to evaluate). True when the request already ended
/// (its callbacks were told).
pub(super) fn start_cached(
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
