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
}

impl Default for SpecConfig {
    fn default() -> SpecConfig {
        SpecConfig {
            mode: SpecMode::Off,
            draft_max: DEFAULT_DRAFT_MAX,
            draft_min: 0,
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
}

impl fmt::Display for Drafter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Drafter::Ngram => "ngram",
            Drafter::Mtp => "mtp",
        })
    }
}

/// The shortest match (tokens at the end of the sequence seen earlier) that yields
/// a draft: a single token repeats too often to predict what follows.
pub const MIN_MATCH: usize = 2;

/// Matches are not measured past this many tokens (a longer one drafts as long).
const MAX_MATCH: usize = 64;

/// A prompt-lookup draft for `seq` (the prompt and the tokens emitted so far, the
/// last of which is about to be fed): the tokens that followed the earlier
/// occurrence of `seq`'s longest suffix (at least [`MIN_MATCH`] tokens; the latest
/// occurrence among equally long ones), at most `n_max` of them and at most twice
/// the match's length — a long match drafts long, a short one briefly. Where the
/// tokens that followed run into the suffix itself (a loop), the draft goes on
/// around the loop.
pub fn ngram_draft(seq: &[u32], n_max: usize) -> Vec<u32> {
    let n = seq.len();
    if n_max == 0 || n < MIN_MATCH + 1 {
        return Vec::new();
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
        return Vec::new();
    };
    // The continuation runs on into the draft itself where it reaches the end of
    // `seq` (a loop of period n − 1 − j drafts its next turns, not only one).
    let len = n_max.min(2 * m);
    let mut draft = Vec::with_capacity(len);
    for i in 0..len {
        let at = j + 1 + i;
        draft.push(if at < n { seq[at] } else { draft[at - n] });
    }
    draft
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
        })
    }

    /// Drafts after `emitted` (the request's output so far; its last token is the
    /// one the step feeds), at most `cap`; empty when fewer than `n_min` (at least
    /// one) come.
    pub fn draft(&mut self, emitted: &[u32], cap: usize) -> Vec<u32> {
        // `text` is the prompt and a prefix of the output: bring it to the output's end.
        let synced = self.text.len() - self.prompt_len;
        self.text
            .extend_from_slice(&emitted[synced.min(emitted.len())..]);
        let d = match self.drafter {
            Drafter::Ngram => ngram_draft(&self.text, self.len(cap)),
            // The executor drafts (`RequestSpec::len` long).
            Drafter::Mtp => Vec::new(),
        };
        self.enough(d)
    }

    /// How long the next draft may be, at most `cap`.
    pub fn len(&self, cap: usize) -> usize {
        self.n_max.min(self.run_cap).min(cap)
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
        let floor = self.n_min.max(1);
        self.run_cap = if accepted >= drafted {
            (self.run_cap.max(1) * 2).min(self.n_max)
        } else {
            (accepted + 1).max(floor).min(self.n_max)
        };
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
        };
        let loop_text: Vec<u32> = [7, 8, 9].repeat(10);
        let mut s = RequestSpec::new(
            Some(Drafter::Ngram),
            &cfg,
            DraftLimits::default(),
            &loop_text,
        )
        .expect("speculates");
        assert_eq!(s.draft(&[], 64).len(), 8);
        s.verified(8, 1);
        assert_eq!(s.draft(&[], 64).len(), 2);
        s.verified(2, 0);
        assert_eq!(s.draft(&[], 64).len(), 1);
        s.verified(1, 1);
        s.verified(2, 2);
        assert_eq!(s.draft(&[], 64).len(), 4);
        s.verified(4, 4);
        s.verified(8, 8);
        assert_eq!(s.draft(&[], 64).len(), 8);
        // n_max 0: no speculation at all.
        let none = DraftLimits {
            n_max: Some(0),
            n_min: None,
        };
        assert!(RequestSpec::new(Some(Drafter::Ngram), &cfg, none, &loop_text).is_none());
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
}
