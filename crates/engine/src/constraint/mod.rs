//! Token constraints: structured output enforced while decoding.
//!
//! A [`TokenConstraint`] says which tokens may come next and is told each token that
//! came. The engine applies its mask to the logits before the sampler (disallowed
//! tokens get −∞), so greedy and sampled decoding alike only ever pick an allowed
//! token, and a grammar that is complete leaves only end-of-generation. The mask for
//! the next position is computed on a helper thread while the executor runs the step
//! that produces its logits, so it costs no decoding time unless it is slower than
//! the step.
//!
//! A [`Constraint`] is what a [`crate::GenerateRequest`] carries: a grammar in its
//! initial state plus where it starts. With a think block the reasoning stays free:
//! the grammar starts at the first sampled token after the block closes (tokens the
//! caller forces between the close and that token, such as the blank line after a
//! budget-forced `</think>`, are not part of the grammar's text). The engine decodes
//! with a copy, so a request can be run again.
//!
//! [`grammar`] builds constraints from JSON schemas and Lark grammars with llguidance.

pub mod grammar;

pub use grammar::{Grammar, GrammarCompiler, GrammarError};

/// Which tokens may come next: bit `i % 32` of word `i / 32` allows token `i`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenMask {
    pub words: Vec<u32>,
}

impl TokenMask {
    /// A mask that allows nothing, for `n` tokens.
    pub fn none(n: usize) -> TokenMask {
        TokenMask {
            words: vec![0; n.div_ceil(32)],
        }
    }
    pub fn allows(&self, token: u32) -> bool {
        let i = token as usize;
        self.words
            .get(i / 32)
            .is_some_and(|w| w & (1 << (i % 32)) != 0)
    }
    pub fn allow(&mut self, token: u32) {
        let i = token as usize;
        if let Some(w) = self.words.get_mut(i / 32) {
            *w |= 1 << (i % 32);
        }
    }
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }
}

/// What a grammar allows at one position.
#[derive(Debug, Clone)]
pub struct Allowed {
    /// Tokens that continue the text.
    pub tokens: TokenMask,
    /// The text so far is complete: generation may end here.
    pub may_end: bool,
}

/// A constraint refused a token or failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("structured output: {0}")]
pub struct ConstraintError(pub String);

/// A grammar over tokens, advanced one token at a time.
pub trait TokenConstraint: Send {
    /// A copy in the same state.
    fn box_clone(&self) -> Box<dyn TokenConstraint>;
    /// What may come next.
    fn allowed(&mut self) -> Result<Allowed, ConstraintError>;
    /// Advances past `token` (not an end-of-generation token); an error when the
    /// grammar does not allow it.
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;
}

impl Clone for Box<dyn TokenConstraint> {
    fn clone(&self) -> Self {
        self.box_clone()
    }
}

/// The think block before the constrained text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkGate {
    /// `<think>`: when the prompt does not open the block, the first token may open it.
    pub open: Option<u32>,
    /// `</think>`: the grammar starts after it.
    pub close: u32,
    /// The prompt leaves the model inside the block.
    pub inside: bool,
}

/// A grammar and where it starts: what a request carries.
#[derive(Clone)]
pub struct Constraint {
    grammar: Box<dyn TokenConstraint>,
    think: Option<ThinkGate>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("think", &self.think)
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// `grammar` binds the whole output.
    pub fn new(grammar: Box<dyn TokenConstraint>) -> Constraint {
        Constraint {
            grammar,
            think: None,
        }
    }

    /// The output may start with a free think block; the grammar binds what follows it.
    pub fn after_think(mut self, gate: ThinkGate) -> Constraint {
        self.think = Some(gate);
        self
    }

    /// A fresh run of this constraint for one generation.
    pub(crate) fn start(&self, eog: &[u32]) -> ConstraintRun {
        let phase = match self.think {
            None => Phase::Armed,
            Some(g) if g.inside => Phase::Thinking,
            Some(g) if g.open.is_some() => Phase::MayThink,
            Some(_) => Phase::Armed,
        };
        ConstraintRun {
            grammar: self.grammar.clone(),
            think: self.think,
            phase,
            eog: eog.to_vec(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing generated yet: the grammar or the think block may start.
    MayThink,
    /// Inside the think block: anything but the end of generation.
    Thinking,
    /// The grammar starts at the next sampled token (forced tokens pass).
    Armed,
    /// The grammar has started: every token is its.
    Running,
}

/// What the engine applies to the logits before sampling one position.
#[derive(Debug, Clone)]
pub(crate) enum LogitMask {
    /// Only these tokens (and the end-of-generation ids when `may_end`).
    Allow(Allowed),
    /// Everything but the end of generation.
    NoEnd,
}

/// One generation's constraint state (engine side).
pub(crate) struct ConstraintRun {
    grammar: Box<dyn TokenConstraint>,
    think: Option<ThinkGate>,
    phase: Phase,
    eog: Vec<u32>,
}

impl ConstraintRun {
    /// The mask for the next sampled position.
    pub(crate) fn next_mask(&mut self) -> Result<LogitMask, ConstraintError> {
        match self.phase {
            Phase::Thinking => Ok(LogitMask::NoEnd),
            Phase::Armed | Phase::Running => self.grammar.allowed().map(LogitMask::Allow),
            Phase::MayThink => {
                let mut a = self.grammar.allowed()?;
                if let Some(open) = self.think.and_then(|g| g.open) {
                    a.tokens.allow(open);
                }
                Ok(LogitMask::Allow(a))
            }
        }
    }

    /// Records a token that was emitted (`forced`: by the caller, not sampled).
    pub(crate) fn on_token(&mut self, token: u32, forced: bool) -> Result<(), ConstraintError> {
        let gate = self.think;
        match self.phase {
            Phase::Thinking => {
                if gate.is_some_and(|g| g.close == token) {
                    self.phase = Phase::Armed;
                }
            }
            Phase::MayThink if gate.and_then(|g| g.open) == Some(token) => {
                self.phase = Phase::Thinking;
            }
            Phase::MayThink | Phase::Armed if forced => {}
            Phase::MayThink | Phase::Armed | Phase::Running => {
                if !self.eog.contains(&token) {
                    self.grammar.commit(token)?;
                    self.phase = Phase::Running;
                }
            }
        }
        Ok(())
    }

    /// Sets every logit the mask does not allow to −∞.
    pub(crate) fn apply(&self, mask: &LogitMask, logits: &mut [f32]) {
        match mask {
            LogitMask::NoEnd => {
                for &e in &self.eog {
                    if let Some(l) = logits.get_mut(e as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            LogitMask::Allow(a) => {
                // The end-of-generation ids keep the model's own logits when the
                // text may end here, whatever the grammar's mask says of them.
                let keep: Vec<(usize, f32)> = if a.may_end {
                    self.eog
                        .iter()
                        .filter_map(|&e| logits.get(e as usize).map(|&l| (e as usize, l)))
                        .collect()
                } else {
                    Vec::new()
                };
                for (w, chunk) in logits.chunks_mut(32).enumerate() {
                    let bits = a.tokens.words.get(w).copied().unwrap_or(0);
                    if bits == u32::MAX {
                        continue;
                    }
                    for (b, l) in chunk.iter_mut().enumerate() {
                        if bits & (1 << b) == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
                for (i, l) in keep {
                    logits[i] = l;
                }
                if !a.may_end {
                    for &e in &self.eog {
                        if let Some(l) = logits.get_mut(e as usize) {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows only token 7, then records what it was given.
    #[derive(Clone, Default)]
    struct Seven(Vec<u32>);

    impl TokenConstraint for Seven {
        fn box_clone(&self) -> Box<dyn TokenConstraint> {
            Box::new(self.clone())
        }
        fn allowed(&mut self) -> Result<Allowed, ConstraintError> {
            let mut tokens = TokenMask::none(40);
            tokens.allow(7);
            Ok(Allowed {
                tokens,
                may_end: !self.0.is_empty(),
            })
        }
        fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
            if token != 7 {
                return Err(ConstraintError(format!("{token} is not 7")));
            }
            self.0.push(token);
            Ok(())
        }
    }

    const EOG: u32 = 39;
    const OPEN: u32 = 30;
    const CLOSE: u32 = 31;

    fn masked(run: &mut ConstraintRun) -> Vec<usize> {
        let m = run.next_mask().unwrap();
        let mut l = vec![0.5f32; 40];
        run.apply(&m, &mut l);
        (0..40).filter(|&i| l[i].is_finite()).collect()
    }

    #[test]
    fn mask_words() {
        let mut m = TokenMask::none(70);
        assert_eq!(m.words.len(), 3);
        m.allow(0);
        m.allow(33);
        m.allow(69);
        m.allow(500);
        assert!(m.allows(33) && m.allows(69) && !m.allows(34) && !m.allows(500));
        assert_eq!(m.count(), 3);
    }

    #[test]
    fn the_grammar_binds_from_the_start_without_a_think_block() {
        let c = Constraint::new(Box::new(Seven::default()));
        let mut run = c.start(&[EOG]);
        assert_eq!(masked(&mut run), vec![7], "nothing else, not even the end");
        run.on_token(7, false).unwrap();
        assert_eq!(
            masked(&mut run),
            vec![7, EOG as usize],
            "complete: the end is allowed"
        );
        assert!(run.on_token(8, false).is_err());
        // The request keeps its initial state: a second run starts afresh.
        let mut again = c.start(&[EOG]);
        assert_eq!(masked(&mut again), vec![7]);
    }

    #[test]
    fn the_think_block_is_free_and_forced_tokens_after_it_are_not_grammar() {
        let gate = ThinkGate {
            open: Some(OPEN),
            close: CLOSE,
            inside: true,
        };
        let mut run = Constraint::new(Box::new(Seven::default()))
            .after_think(gate)
            .start(&[EOG]);
        let free = masked(&mut run);
        assert_eq!(free.len(), 39, "all but the end: {free:?}");
        run.on_token(3, false).unwrap();
        run.on_token(CLOSE, true).unwrap();
        // A forced blank line after the close is passed over.
        run.on_token(12, true).unwrap();
        assert_eq!(masked(&mut run), vec![7]);
        run.on_token(7, false).unwrap();
        // Now forced tokens are the grammar's too.
        assert!(run.on_token(12, true).is_err());
    }

    #[test]
    fn the_first_token_may_open_the_think_block() {
        let gate = ThinkGate {
            open: Some(OPEN),
            close: CLOSE,
            inside: false,
        };
        let c = Constraint::new(Box::new(Seven::default())).after_think(gate);
        let mut run = c.start(&[EOG]);
        assert_eq!(masked(&mut run), vec![7, OPEN as usize]);
        run.on_token(OPEN, false).unwrap();
        assert_eq!(masked(&mut run).len(), 39);
        run.on_token(CLOSE, false).unwrap();
        assert_eq!(masked(&mut run), vec![7]);
        // Or the grammar starts at once.
        let mut run = c.start(&[EOG]);
        run.on_token(7, false).unwrap();
        assert_eq!(masked(&mut run), vec![7, EOG as usize]);
    }
}
