//! The executor seam: what the engine asks of a device. An executor owns its
//! weights (uploaded from the model file into its own storage), the state of
//! every sequence it holds, and its scratch memory; the engine hands it a batch
//! of sequence steps and gets back each one's logits or chosen token.
//!
//! The step is batch-shaped from the start: each entry names its own sequence,
//! positions and output, so batched decode, speculative verification and a
//! scheduler with several slots use the same call. Today the engine sends one
//! entry at a time.

use crate::DeviceReport;
use model::{ExecError, Logits};

/// What one sequence's step should return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Logits of the last position or of every position.
    Logits(Logits),
    /// Only the greedy token of the last position (argmax, lowest id on ties),
    /// chosen on the device so only the id comes back.
    Greedy,
}

impl Want {
    /// The positions whose logits the forward pass must produce.
    pub fn logits(self) -> Logits {
        match self {
            Want::Logits(w) => w,
            Want::Greedy => Logits::Last,
        }
    }
}

/// One sequence's part of a step: `tokens` at positions `pos0..` of sequence `seq`.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub seq: usize,
    pub tokens: &'a [u32],
    pub pos0: usize,
    pub want: Want,
}

/// What a step returned for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOut {
    /// n_vocab per returned position.
    Logits(Vec<f32>),
    Token(u32),
}

/// A device that runs model steps.
pub trait Executor: Send {
    /// Where steps run and what device memory they hold.
    fn report(&self) -> DeviceReport;
    /// Forgets sequence `seq` (a new conversation starts there).
    fn clear(&mut self, seq: usize) -> Result<(), ExecError>;
    /// Runs every entry of `batch` (each against its own sequence) and returns
    /// their outputs in order.
    fn step(&mut self, batch: &[SeqStep]) -> Result<Vec<StepOut>, ExecError>;
    /// Where the routed experts computed so far came from (VRAM slot hits, misses
    /// from RAM and from the file); `None` when every expert is always resident.
    fn expert_stats(&self) -> Option<crate::experts::TierStats> {
        None
    }
    /// The most prompt tokens one step should carry (the engine feeds prompts in
    /// pieces of this many; the pieces do not change the results).
    fn prompt_chunk(&self) -> usize {
        512
    }
}

/// Runs a sequence's tokens in pieces of at most `piece` tokens through `run(tokens,
/// pos0, want)`: the earlier pieces only advance the state (their greedy token, the
/// cheapest output, is dropped); every position's logits are collected with
/// `Logits::All`, else the last piece's output is returned.
pub(crate) fn in_pieces<E>(
    tokens: &[u32],
    pos0: usize,
    want: Want,
    piece: usize,
    mut run: impl FnMut(&[u32], usize, Want) -> Result<StepOut, E>,
) -> Result<StepOut, E> {
    let all = want == Want::Logits(Logits::All);
    let n = tokens.len().div_ceil(piece);
    let mut logits = Vec::new();
    let mut last = StepOut::Logits(Vec::new());
    for (i, chunk) in tokens.chunks(piece).enumerate() {
        let w = if all || i + 1 == n {
            want
        } else {
            Want::Greedy
        };
        last = run(chunk, pos0 + i * piece, w)?;
        if let (true, StepOut::Logits(l)) = (all, &last) {
            logits.extend_from_slice(l);
        }
    }
    Ok(if all { StepOut::Logits(logits) } else { last })
}
