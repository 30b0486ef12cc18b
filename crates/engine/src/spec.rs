//! Speculative decoding: where drafts come from and how long they may be.
//!
//! A decoding request whose slot speculates feeds, in one step, its last emitted
//! token and up to `n_max` drafted tokens after it (a *verify* step: every position's
//! logits, through the same multi-token path as a prompt, whose rows have the bits of
//! decoding each token alone — invariant 1). The scheduler then emits tokens from
//! those rows exactly as plain decoding would, one row at a time (the grammar's mask,
//! the sampler and its randomness, penalties, log-probabilities, stops), and keeps a
//! draft only while it equals the token just emitted; the sequence is rolled back to
//! the last accepted token (`Executor::rollback`). So the emitted tokens are plain
//! decoding's, byte for byte, whatever the drafts were (invariant 2).
//!
//! Drafts come from prompt lookup here ([`ngram_draft`]): the longest earlier
//! occurrence of the sequence's last tokens in its prompt and output, and the tokens
//! that followed it.

use std::fmt;
use std::str::FromStr;

/// Where drafts come from (`--spec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMode {
    /// No speculation: one token per step.
    #[default]
    Off,
    /// What the model file and the executor support: the MTP block where the model
    /// has one and the executor runs it, else prompt lookup; nothing where the
    /// executor cannot roll back.
    Auto,
    /// Prompt lookup: n-grams of the prompt and the generated text.
    Ngram,
    /// The model's own next-next-token (MTP, GGUF `nextn`) layer.
    Mtp,
}

impl FromStr for SpecMode {
    type Err = String;
    fn from_str(s: &str) -> Result<SpecMode, String> {
        match s {
            "off" | "none" => Ok(SpecMode::Off),
            "auto" => Ok(SpecMode::Auto),
            "ngram" | "lookup" => Ok(SpecMode::Ngram),
            "mtp" => Ok(SpecMode::Mtp),
            _ => Err(format!(
                "unknown speculation mode `{s}` (expected auto, mtp, ngram or off)"
            )),
        }
    }
}

impl fmt::Display for SpecMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SpecMode::Off => "off",
            SpecMode::Auto => "auto",
            SpecMode::Ngram => "ngram",
            SpecMode::Mtp => "mtp",
        })
    }
}

/// The most drafts a verify step carries unless `--draft-max` says (llama-server's
/// `speculative.n_max` default).
pub const DEFAULT_DRAFT_MAX: usize = 16;

/// The longest draft any setting may ask for: a verify step of this many tokens
/// plus one still runs on the decode team's short loops' side of the CPU's cut.
pub const MAX_DRAFT: usize = 64;

/// Speculation settings at load time (`EngineConfig::spec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    pub mode: SpecMode,
    /// Drafts per verify step at most.
    pub draft_max: usize,
    /// Fewer drafts than this are not verified: the step decodes one token.
    pub draft_min: usize,
    /// Draft as long as the acceptance allows whatever a verify step costs (`false`:
    /// the length is chosen from the measured cost of verify steps, see
    /// [`StepCosts`], and speculation pauses where it does not pay).
    pub fixed: bool,
}

impl Default for SpecConfig {
    fn default() -> SpecConfig {
        SpecConfig {
            mode: SpecMode::Off,
            draft_max: DEFAULT_DRAFT_MAX,
            draft_min: 0,
            fixed: false,
        }
    }
}

impl SpecConfig {
    /// Refuses settings that cannot work, naming the option.
    pub fn check(&self) -> Result<(), String> {
        if self.draft_max > MAX_DRAFT {
            return Err(format!(
                "--draft-max {}: at most {MAX_DRAFT} drafts per step",
                self.draft_max
            ));
        }
        if self.draft_min > self.draft_max {
            return Err(format!(
                "--draft-min {} is above --draft-max {}: lower --draft-min",
                self.draft_min, self.draft_max
            ));
        }
        Ok(())
    }
}

/// A request's own draft limits (llama-server's `speculative.n_max` / `n_min`);
/// `None` takes the engine's. `n_max` 0 turns speculation off for the request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftLimits {
    pub n_max: Option<usize>,
    pub n_min: Option<usize>,
}

/// The draft source the engine settled on at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Drafter {
    /// Prompt lookup.
    Ngram,
    /// The model's MTP block (`Executor::mtp_draft`).
    Mtp,
    /// `auto` where the model has an MTP block the executor runs: prompt lookup where
    /// the text repeats a long stretch (a match of at least [`LOOKUP_OVER_MTP`]
    /// tokens: an agent re-emitting a file), the MTP block otherwise — as llama.cpp
    /// tries its n-gram drafters before its draft model.
    MtpAndNgram,
}

impl fmt::Display for Drafter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Drafter::Ngram => "ngram",
            Drafter::Mtp => "mtp",
            Drafter::MtpAndNgram => "mtp+ngram",
        })
    }
}

/// The shortest match (tokens at the end of the sequence seen earlier) that yields
/// a draft: a single token repeats too often to predict what follows.
pub const MIN_MATCH: usize = 2;

/// Matches are not measured past this many tokens (a longer one drafts as long).
const MAX_MATCH: usize = 64;

/// With an MTP block beside it, a lookup drafts only from a match this long (the
/// length of llama.cpp's `ngram-simple` key, which it tries before its draft model):
/// shorter repeats are left to the MTP block, which sees the whole context.
pub const LOOKUP_OVER_MTP: usize = 12;

/// A prompt-lookup draft for `seq` (the prompt and the tokens emitted so far, the
/// last of which is about to be fed): the tokens that followed the earlier
/// occurrence of `seq`'s longest suffix (at least [`MIN_MATCH`] tokens; the latest
/// occurrence among equally long ones), at most `n_max` of them and at most twice
/// the match's length — a long match drafts long, a short one briefly. Where the
/// tokens that followed run into the suffix itself (a loop), the draft goes on
/// around the loop.
pub fn ngram_draft(seq: &[u32], n_max: usize) -> Vec<u32> {
    ngram_match(seq, n_max).1
}

/// [`ngram_draft`] with the length of the match it continues (0: none).
pub fn ngram_match(seq: &[u32], n_max: usize) -> (usize, Vec<u32>) {
    let n = seq.len();
    if n_max == 0 || n < MIN_MATCH + 1 {
        return (0, Vec::new());
    }
    let last = seq[n - 1];
    // (match length, end of the earlier occurrence)
    let mut best: Option<(usize, usize)> = None;
    for j in (0..n - 1).rev() {
        if seq[j] != last {
            continue;
        }
        let most = (j + 1).min(MAX_MATCH);
        let mut m = 1;
        while m < most && seq[j - m] == seq[n - 1 - m] {
            m += 1;
        }
        if m >= MIN_MATCH && best.is_none_or(|(bm, _)| m > bm) {
            best = Some((m, j));
            if m == MAX_MATCH {
                break;
            }
        }
    }
    let Some((m, j)) = best else {
        return (0, Vec::new());
    };
    // The continuation runs on into the draft itself where it reaches the end of
    // `seq` (a loop of period n − 1 − j drafts its next turns, not only one).
    let len = n_max.min(2 * m);
    let mut draft = Vec::with_capacity(len);
    for i in 0..len {
        let at = j + 1 + i;
        draft.push(if at < n { seq[at] } else { draft[at - n] });
    }
    (m, draft)
}

/// A request's speculation: its limits and what it drafted and kept.
#[derive(Debug, Clone)]
pub(crate) struct RequestSpec {
    pub drafter: Drafter,
    pub n_max: usize,
    pub n_min: usize,
    /// The prompt and the emitted tokens so far (the lookup's text).
    text: Vec<u32>,
    prompt_len: usize,
    /// The longest draft the running acceptance allows now (see [`RequestSpec::verified`]).
    run_cap: usize,
    /// Drafts kept and draft positions tried, decayed at each verify step: the chance
    /// that a draft token is kept (see [`RequestSpec::keep_rate`]).
    kept: f64,
    tried: f64,
    /// Take the longest draft allowed, whatever it costs (`SpecConfig::fixed`).
    fixed: bool,
    /// Steps decoded without drafts because none paid, and after how many such steps
    /// a draft is tried anyway (the acceptance and the costs change as the text does).
    paused: usize,
    probe_every: usize,
}

impl RequestSpec {
    /// The request's speculation under the engine's `drafter` and `cfg`, with its own
    /// `limits`; None when it does not speculate.
    pub fn new(
        drafter: Option<Drafter>,
        cfg: &SpecConfig,
        limits: DraftLimits,
        prompt: &[u32],
    ) -> Option<RequestSpec> {
        let drafter = drafter?;
        let n_max = limits.n_max.unwrap_or(cfg.draft_max).min(MAX_DRAFT);
        let n_min = limits.n_min.unwrap_or(cfg.draft_min).min(n_max);
        (n_max > 0).then(|| RequestSpec {
            drafter,
            n_max,
            n_min,
            text: prompt.to_vec(),
            prompt_len: prompt.len(),
            run_cap: n_max,
            kept: PRIOR_KEPT,
            tried: PRIOR_TRIED,
            fixed: cfg.fixed,
            paused: 0,
            probe_every: FIRST_PROBE,
        })
    }

    /// Drafts after `emitted` (the request's output so far; its last token is the
    /// one the step feeds), at most `cap` ([`Self::len`] long): prompt lookup's, or
    /// the executor's MTP block's (`mtp(token, n)`: `n` drafts after `pending`, the
    /// token the step feeds; none without one), where [`Drafter::MtpAndNgram`] takes
    /// a lookup first when the text repeats at least [`LOOKUP_OVER_MTP`] tokens.
    /// Empty when fewer than `n_min` (at least one) come; an error is `mtp`'s.
    pub fn draft<E>(
        &mut self,
        emitted: &[u32],
        pending: Option<u32>,
        cap: usize,
        costs: &StepCosts,
        mtp: impl FnOnce(u32, usize) -> Result<Vec<u32>, E>,
    ) -> Result<Vec<u32>, E> {
        self.sync(emitted);
        let d = match (self.drafter, pending) {
            (Drafter::Ngram, _) => {
                let n = self.len(cap, costs);
                ngram_draft(&self.text, n)
            }
            (_, None) => Vec::new(),
            (drafter, Some(t)) => match self.len(cap, costs) {
                0 => Vec::new(),
                n => match (drafter == Drafter::MtpAndNgram).then(|| self.lookup(n)) {
                    Some(Some(d)) => d,
                    _ => mtp(t, n)?,
                },
            },
        };
        Ok(self.enough(d))
    }

    /// A lookup draft of up to `n` tokens where the text repeats at least
    /// [`LOOKUP_OVER_MTP`] tokens, else None (the MTP block drafts).
    fn lookup(&self, n: usize) -> Option<Vec<u32>> {
        let (m, d) = ngram_match(&self.text, n);
        (m >= LOOKUP_OVER_MTP && !d.is_empty()).then_some(d)
    }

    /// `text` is the prompt and a prefix of the output: brings it to `emitted`'s end.
    fn sync(&mut self, emitted: &[u32]) {
        let synced = self.text.len() - self.prompt_len;
        self.text
            .extend_from_slice(&emitted[synced.min(emitted.len())..]);
    }

    /// How long the next draft may be, at most `cap`: the longest the running
    /// acceptance allows, or (unless `fixed`) the length among those that brings the
    /// most tokens per second by `costs` — 0 where no draft pays, except every
    /// `probe_every`-th such step, which drafts anyway to measure again (as long as
    /// would pay were [`PROBE_KEEP`] of the drafts kept, at least one: where every
    /// verify row is dear, a probe costs one row), and 0 until a decode step's cost
    /// is known (a drafter that always has a draft, MTP, would otherwise never
    /// measure the step it is compared with).
    pub fn len(&mut self, cap: usize, costs: &StepCosts) -> usize {
        let most = self.n_max.min(self.run_cap).min(cap);
        if self.fixed || most == 0 {
            return most;
        }
        if costs.relative(1).is_none() {
            return 0;
        }
        let Some(best) = best_len(self.keep_rate(), self.n_min.max(1), most, costs) else {
            return most;
        };
        if best > 0 {
            self.paused = 0;
            self.probe_every = FIRST_PROBE;
            return best;
        }
        self.paused += 1;
        if self.paused < self.probe_every {
            return 0;
        }
        // A probe; the next one waits twice as long while none pays.
        self.paused = 0;
        self.probe_every = (self.probe_every * 2).min(LAST_PROBE);
        let floor = self.n_min.max(1);
        best_len(PROBE_KEEP, floor, most, costs).map_or(most, |n| n.clamp(floor.min(most), most))
    }

    /// The chance that a draft token is kept, from the verify steps so far (decayed,
    /// starting from a prior of [`PRIOR_KEPT`] / [`PRIOR_TRIED`]).
    pub fn keep_rate(&self) -> f64 {
        self.kept / self.tried
    }

    /// `d`, or nothing when it is shorter than `n_min` (at least one).
    pub fn enough(&self, d: Vec<u32>) -> Vec<u32> {
        if d.len() < self.n_min.max(1) {
            Vec::new()
        } else {
            d
        }
    }

    /// A verify step kept `accepted` of its `drafted` tokens: the next draft may be
    /// twice as long after a step that kept them all, and at most one longer than
    /// what was kept after one that did not (a verify row past the first rejection is
    /// wasted work: every row costs the LM head), never below `n_min` nor 1.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        // Draft positions tried: up to and including the first rejected one.
        let tried = if accepted < drafted {
            accepted + 1
        } else {
            drafted
        };
        self.kept = KEEP_DECAY * self.kept + accepted as f64;
        self.tried = KEEP_DECAY * self.tried + tried as f64;
        let floor = self.n_min.max(1);
        self.run_cap = if accepted >= drafted {
            (self.run_cap.max(1) * 2).min(self.n_max)
        } else {
            (accepted + 1).max(floor).min(self.n_max)
        };
    }
}

/// The prior of a request's keep rate: as if 3 of 4 draft tokens had been kept
/// (what the peers report for MTP and lookup drafts on chat and code).
const PRIOR_KEPT: f64 = 3.0;
const PRIOR_TRIED: f64 = 4.0;
/// Weight of the keep counts before each verify step (0.8: the last ~5 steps count most).
const KEEP_DECAY: f64 = 0.8;
/// Steps without drafts (none paid) before the first probe, and the longest wait.
const FIRST_PROBE: usize = 16;
const LAST_PROBE: usize = 256;
/// The keep rate a probe's length assumes (an optimistic one: what a repeated stretch
/// or a confident MTP head gives).
const PROBE_KEEP: f64 = 0.9;

/// What a step of one sequence costs by the tokens it feeds (1: a decode step; k+1: a
/// verify step of k drafts), measured by the scheduler around the executor's call:
/// seconds, a moving average per token count. The first step of each count is not
/// counted (it may capture a CUDA graph or fault pages in).
#[derive(Debug, Clone, Default)]
pub struct StepCosts {
    /// Index tokens − 1: (steps seen, average seconds).
    seen: Vec<(u32, f64)>,
}

/// Weight of a new measurement in [`StepCosts`]' averages.
const COST_WEIGHT: f64 = 0.2;

impl StepCosts {
    /// A step of one sequence feeding `tokens` tokens took `secs`.
    pub fn observe(&mut self, tokens: usize, secs: f64) {
        if tokens == 0 || tokens > MAX_DRAFT + 1 || !secs.is_finite() {
            return;
        }
        if self.seen.len() < tokens {
            self.seen.resize(tokens, (0, 0.0));
        }
        let (n, avg) = &mut self.seen[tokens - 1];
        *avg = match *n {
            0 => 0.0,
            1 => secs,
            _ => *avg + COST_WEIGHT * (secs - *avg),
        };
        *n = n.saturating_add(1);
    }

    /// Seconds of a step feeding `tokens`, where measured.
    fn secs(&self, tokens: usize) -> Option<f64> {
        self.seen
            .get(tokens.checked_sub(1)?)
            .filter(|&&(n, _)| n >= 2)
            .map(|&(_, s)| s)
    }

    /// A step feeding `tokens` over a decode step: measured, or the nearest measured
    /// count below it (a count never tried looks as cheap as the last tried, so it
    /// gets tried); None until a decode step has been measured.
    pub fn relative(&self, tokens: usize) -> Option<f64> {
        let one = self.secs(1).filter(|&s| s > 0.0)?;
        let at = (1..=tokens).rev().find_map(|t| self.secs(t))?;
        Some(at / one)
    }
}

/// The draft length in {0} ∪ [min_len, most] with the most expected tokens per unit
/// of step cost: a verify step of k drafts emits 1 + p + … + p^k tokens on average (p:
/// the chance each draft is kept, given the ones before it were) and costs
/// `costs.relative(k + 1)` decode steps. None while the costs are unknown.
pub fn best_len(p: f64, min_len: usize, most: usize, costs: &StepCosts) -> Option<usize> {
    costs.relative(1)?;
    let p = p.clamp(0.0, 1.0);
    let (mut best, mut best_rate) = (0, 1.0);
    let (mut expect, mut pk) = (1.0, 1.0);
    for k in 1..=most {
        pk *= p;
        expect += pk;
        if k < min_len {
            continue;
        }
        let cost = costs.relative(k + 1)?.max(f64::MIN_POSITIVE);
        // Ties go to the shorter draft (less work for the same tokens).
        if expect / cost > best_rate * (1.0 + 1e-9) {
            best = k;
            best_rate = expect / cost;
        }
    }
    Some(best)
}

/// Where a sequence's MTP state stands, the bookkeeping both executors share (the
/// MTP cache and the kept hidden rows themselves are theirs): MTP position p pairs
/// token x_p with the trunk's post-norm hidden row at p − 1 and predicts x_{p+1};
/// positions `base..end` are in the sequence's MTP cache (position p at index
/// p − base; `base` 0: lost, after a restore), and the trunk's hidden rows of
/// positions `pos0..pos0 + rows` are kept (the last step's, for the next fill and
/// for drafts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MtpSpan {
    pub base: usize,
    pub end: usize,
    pub pos0: usize,
    pub rows: usize,
}

/// The fill after a step (see [`MtpSpan::fill`]): MTP positions `first..` (`rows` of
/// them), the first one's hidden row from the step before when `prev`, the others
/// from the step's own rows (h_{p−1} is the step's row p − 1 − pos0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MtpFill {
    pub first: usize,
    pub rows: usize,
    pub prev: bool,
}

impl MtpSpan {
    /// A cleared sequence: nothing cached, position 1 next (position 0 has no h_{−1}).
    pub const EMPTY: MtpSpan = MtpSpan {
        base: 1,
        end: 1,
        pos0: 0,
        rows: 0,
    };
    /// A sequence whose state came from elsewhere (a snapshot): the cache starts
    /// again after the next step, and nothing is drafted until then.
    pub const LOST: MtpSpan = MtpSpan {
        base: 0,
        end: 0,
        pos0: 0,
        rows: 0,
    };

    /// The cache's rows in use (positions `base..end`).
    pub fn cached(&self) -> usize {
        self.end - self.base
    }

    /// The sequence was rolled back to `pos` positions.
    pub fn truncate(&mut self, pos: usize) {
        self.end = self.end.min(pos).max(self.base);
        self.rows = pos.saturating_sub(self.pos0).min(self.rows);
    }

    /// Before filling after a step that fed `n` tokens at `pos0`: which MTP positions
    /// the step made computable (each p with x_p fed and h_{p−1} known). The span
    /// moves for them: cleared at position 0; truncated to `pos0` when the cache and
    /// the kept rows reach it (a rolled-back step's rows included); else started
    /// again after `pos0` (nothing before this step: a slot that kept only part of
    /// its history, or a lost state).
    pub fn fill(&mut self, pos0: usize, n: usize) -> MtpFill {
        let prev = pos0 > 0 && self.pos0 < pos0 && pos0 <= self.pos0 + self.rows;
        let first = if pos0 == 0 {
            *self = Self::EMPTY;
            1
        } else if prev && self.base > 0 && self.base <= pos0 && pos0 <= self.end {
            self.truncate(pos0);
            pos0
        } else {
            self.base = pos0 + 1;
            self.end = pos0 + 1;
            pos0 + 1
        };
        MtpFill {
            first,
            rows: (pos0 + n).saturating_sub(first),
            prev: first == pos0,
        }
    }

    /// After the fill: the cache reaches `pos0 + n`, and the step's last `kept` hidden
    /// rows are kept.
    pub fn filled(&mut self, pos0: usize, n: usize, kept: usize) {
        self.end = pos0 + n;
        self.pos0 = pos0 + n - kept;
        self.rows = kept;
    }

    /// The position a draft starts at (the next token's: the cache and the kept rows
    /// reach the sequence's end), or None.
    pub fn draft_at(&self) -> Option<usize> {
        let t = self.pos0 + self.rows;
        (self.rows > 0 && self.end == t && self.base > 0).then_some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_follow_the_longest_match() {
        // "1 2 3 4 5 9 9 1 2 3" → 4 5 9 9 1 2 (match 3 → up to 6 tokens).
        let seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3];
        assert_eq!(ngram_draft(&seq, 16), vec![4, 5, 9, 9, 1, 2]);
        assert_eq!(ngram_draft(&seq, 2), vec![4, 5]);
        // A loop drafts its next turns: "7 8 9 7 8 9 7" → 8 9 7 8 9 7 ...
        let seq = [7, 8, 9, 7, 8, 9, 7];
        assert_eq!(ngram_draft(&seq, 7), vec![8, 9, 7, 8, 9, 7, 8]);
        // The longer match wins over a later shorter one.
        let seq = [7, 1, 2, 3, 4, 8, 2, 3, 5, 1, 2, 3];
        assert_eq!(ngram_draft(&seq, 3), vec![4, 8, 2]);
        // A match of one token drafts nothing.
        assert!(ngram_draft(&[5, 6, 7, 6], 8).is_empty());
        // Twice the match at most.
        let seq = [1, 2, 10, 11, 12, 13, 14, 15, 1, 2];
        assert_eq!(ngram_draft(&seq, 16), vec![10, 11, 12, 13]);
    }

    #[test]
    fn the_draft_cap_follows_the_acceptance() {
        let cfg = SpecConfig {
            mode: SpecMode::Ngram,
            draft_max: 8,
            draft_min: 0,
            fixed: false,
        };
        let loop_text: Vec<u32> = [7, 8, 9].repeat(10);
        let mut s = RequestSpec::new(
            Some(Drafter::Ngram),
            &cfg,
            DraftLimits::default(),
            &loop_text,
        )
        .expect("speculates");
        // Until a decode step has been timed there is nothing to compare with: none.
        assert_eq!(lookup_len(&mut s, &StepCosts::default()), 0);
        // Verify steps as cheap as a decode step: the cap is all that limits a draft.
        let flat = measured(1, |_| 1.0);
        assert_eq!(lookup_len(&mut s, &flat), 8);
        s.verified(8, 1);
        assert_eq!(lookup_len(&mut s, &flat), 2);
        s.verified(2, 0);
        assert_eq!(lookup_len(&mut s, &flat), 1);
        s.verified(1, 1);
        s.verified(2, 2);
        assert_eq!(lookup_len(&mut s, &flat), 4);
        s.verified(4, 4);
        s.verified(8, 8);
        assert_eq!(lookup_len(&mut s, &flat), 8);
        // n_max 0: no speculation at all.
        let none = DraftLimits {
            n_max: Some(0),
            n_min: None,
        };
        assert!(RequestSpec::new(Some(Drafter::Ngram), &cfg, none, &loop_text).is_none());
    }

    /// The length of a lookup request's draft (`RequestSpec::draft`, no MTP block).
    fn lookup_len(s: &mut RequestSpec, costs: &StepCosts) -> usize {
        let no_mtp = |_, _| -> Result<Vec<u32>, ()> { unreachable!("a lookup drafter") };
        s.draft(&[], None, 64, costs, no_mtp).expect("lookup").len()
    }

    /// Costs measured three times at each token count up to `upto`.
    fn measured(upto: usize, secs: impl Fn(usize) -> f64) -> StepCosts {
        let mut c = StepCosts::default();
        for t in 1..=upto {
            for _ in 0..3 {
                c.observe(t, secs(t));
            }
        }
        c
    }

    #[test]
    fn step_costs_skip_the_first_step_and_fill_gaps_from_below() {
        let mut c = StepCosts::default();
        c.observe(1, 9.0); // a graph's capture: not counted
        assert_eq!(c.relative(1), None);
        c.observe(1, 0.002);
        assert_eq!(c.relative(1), Some(1.0));
        // 5 tokens never measured: as cheap as the nearest count measured below.
        assert_eq!(c.relative(5), Some(1.0));
        c.observe(3, 1.0);
        c.observe(3, 0.004);
        assert_eq!(c.relative(3), Some(2.0));
        assert_eq!(c.relative(5), Some(2.0));
        // A moving average: one slow step moves it a fifth of the way.
        c.observe(3, 0.014);
        assert!((c.relative(3).unwrap() - 3.0).abs() < 1e-9);
        // Nonsense is ignored.
        c.observe(0, 1.0);
        c.observe(MAX_DRAFT + 2, 1.0);
        c.observe(2, f64::NAN);
        assert_eq!(c.relative(2), Some(1.0));
    }

    #[test]
    fn the_draft_length_follows_the_step_costs() {
        assert_eq!(best_len(0.9, 1, 8, &StepCosts::default()), None);
        // Every row costs a decode step (a small model's LM head on the CPU): no
        // draft pays, however likely it is kept.
        let linear = measured(9, |t| 0.002 * t as f64);
        assert_eq!(best_len(0.95, 1, 8, &linear), Some(0));
        // Rows nearly free: the longest draft, unless nothing is kept.
        let flat = measured(9, |t| 0.003 * (1.0 + 0.01 * t as f64));
        assert_eq!(best_len(0.9, 1, 8, &flat), Some(8));
        assert_eq!(best_len(0.0, 1, 8, &flat), Some(0));
        // A GPU's verify steps (5 tokens cost 2 decode steps) at 3 of 4 kept: rates
        // 1.40, 1.54, 1.56, 1.52 for 1..4 drafts.
        let gpu = measured(9, |t| 0.003 * (1.0 + 0.25 * (t - 1) as f64));
        assert_eq!(best_len(0.75, 1, 8, &gpu), Some(3));
        assert_eq!(best_len(0.75, 1, 2, &gpu), Some(2));
        // Below the least draft verified, nothing is a choice.
        assert_eq!(best_len(0.75, 5, 8, &gpu), Some(5));
        assert_eq!(best_len(0.3, 5, 8, &gpu), Some(0));
    }

    #[test]
    fn speculation_pauses_where_it_does_not_pay_and_probes() {
        let cfg = SpecConfig {
            mode: SpecMode::Ngram,
            draft_max: 8,
            ..SpecConfig::default()
        };
        let loop_text: Vec<u32> = [7, 8, 9].repeat(10);
        let spec = |cfg: &SpecConfig| {
            RequestSpec::new(
                Some(Drafter::Ngram),
                cfg,
                DraftLimits::default(),
                &loop_text,
            )
            .expect("speculates")
        };
        let linear = measured(9, |t| 0.002 * t as f64);
        let mut s = spec(&cfg);
        let lens: Vec<usize> = (0..48).map(|_| lookup_len(&mut s, &linear)).collect();
        // 15 steps without drafts, a probe, 31 without, a probe; each of one token:
        // every row costs a decode step, so no length pays even at 9 in 10 kept.
        let probes: Vec<usize> = (0..48).filter(|&i| lens[i] > 0).collect();
        assert_eq!(probes, [15, 47]);
        assert_eq!(lens[15], 1);
        // Rows that cost little but drafts that are rarely kept: the probe is as long
        // as pays at 9 in 10 kept.
        let gpu = measured(9, |t| 0.003 * (1.0 + 0.25 * (t - 1) as f64));
        let mut p = spec(&cfg);
        (p.kept, p.tried) = (0.1, 1.0);
        let lens: Vec<usize> = (0..16).map(|_| lookup_len(&mut p, &gpu)).collect();
        assert_eq!(lens[..15], [0; 15]);
        assert_eq!(best_len(PROBE_KEEP, 1, 8, &gpu), Some(6));
        assert_eq!(lens[15], 6);
        // Fixed: the longest, whatever the costs.
        let mut f = spec(&SpecConfig { fixed: true, ..cfg });
        assert_eq!(lookup_len(&mut f, &linear), 8);
        // Where drafts pay, the length follows the keep rate: all kept → long.
        let gpu = measured(17, |t| 0.003 * (1.0 + 0.25 * (t - 1) as f64));
        let mut g = spec(&cfg);
        assert_eq!(lookup_len(&mut g, &gpu), 3);
        for _ in 0..10 {
            g.verified(8, 8);
        }
        assert!(g.keep_rate() > 0.95, "{}", g.keep_rate());
        assert_eq!(lookup_len(&mut g, &gpu), 8);
        // ... none kept → none drafted (until a probe).
        for _ in 0..30 {
            g.verified(1, 0);
        }
        assert!(g.keep_rate() < 0.1, "{}", g.keep_rate());
        assert_eq!(lookup_len(&mut g, &gpu), 0);
    }

    #[test]
    fn modes_parse_and_print() {
        for m in [
            SpecMode::Off,
            SpecMode::Auto,
            SpecMode::Ngram,
            SpecMode::Mtp,
        ] {
            assert_eq!(m.to_string().parse::<SpecMode>(), Ok(m));
        }
        assert!("fast"
            .parse::<SpecMode>()
            .unwrap_err()
            .contains("auto, mtp"));
    }

    #[test]
    fn beside_mtp_a_lookup_drafts_only_from_a_long_match() {
        let cfg = SpecConfig {
            mode: SpecMode::Auto,
            draft_max: 4,
            draft_min: 0,
            fixed: true,
        };
        let limits = DraftLimits::default();
        // 20 tokens, then their first 11 again: the repeat is 11 long, under the bar.
        let first: Vec<u32> = (100..120).collect();
        let mut text = first.clone();
        text.extend_from_slice(&first[..11]);
        let mut spec =
            RequestSpec::new(Some(Drafter::MtpAndNgram), &cfg, limits, &text).expect("spec");
        assert_eq!(ngram_match(&text, 4).0, 11);
        let costs = StepCosts::default();
        let mtp = |_: u32, n: usize| Ok::<_, ()>(vec![7; n]);
        assert_eq!(spec.draft(&[], Some(1), 64, &costs, mtp), Ok(vec![7; 4]));
        // No pending token: the MTP block has nothing to draft after.
        assert_eq!(spec.draft(&[], None, 64, &costs, mtp), Ok(vec![]));
        // One more token of the repeat (emitted): 12 long, the lookup drafts.
        let d = spec.draft(&[first[11]], Some(1), 64, &costs, mtp);
        assert_eq!(d, Ok(first[12..16].to_vec()));
    }

    #[test]
    fn mtp_span_follows_steps_rollbacks_and_restores() {
        let mut s = MtpSpan::EMPTY;
        // A prompt of 5 at 0: positions 1..5 (position 0 has no h_{−1}); its 5 rows kept.
        let f = s.fill(0, 5);
        assert_eq!((f.first, f.rows, f.prev), (1, 4, false));
        s.filled(0, 5, 5);
        assert_eq!(s.draft_at(), Some(5));
        // A verify step of 3 at 5: position 5 from the kept row h_4, then 6 and 7.
        let f = s.fill(5, 3);
        assert_eq!((f.first, f.rows, f.prev), (5, 3, true));
        s.filled(5, 3, 3);
        assert_eq!((s.base, s.end, s.pos0, s.rows), (1, 8, 5, 3));
        // One draft kept: rolled back to 7; the next step (at 7) starts from h_6.
        s.truncate(7);
        assert_eq!((s.end, s.rows), (7, 2));
        assert_eq!(s.draft_at(), Some(7));
        let f = s.fill(7, 1);
        assert_eq!((f.first, f.rows, f.prev), (7, 1, true));
        s.filled(7, 1, 1);
        assert_eq!(s.cached(), 7);
        // A restored sequence drafts nothing, and its next step starts over after it.
        s = MtpSpan::LOST;
        assert_eq!(s.draft_at(), None);
        let f = s.fill(40, 2);
        assert_eq!((f.first, f.rows, f.prev), (41, 1, false));
        s.filled(40, 2, 2);
        assert_eq!((s.base, s.end, s.draft_at()), (41, 42, Some(42)));
        // A step that skips ahead (a slot reused for a longer prefix) starts over too.
        let f = s.fill(50, 1);
        assert_eq!((f.first, f.rows, f.prev), (51, 0, false));
        s.filled(50, 1, 1);
        assert_eq!((s.cached(), s.draft_at()), (0, Some(51)));
        // Back to position 0: cleared.
        assert_eq!(s.fill(0, 1).rows, 0);
        assert_eq!((s.base, s.end), (1, 1));
    }
}
