//! The executor seam: what the engine asks of a device. An executor owns its
//! weights (uploaded from the model file into its own storage), the state of
//! every sequence it holds, and its scratch memory; the engine hands it a batch
//! of sequence steps and gets back each one's logits or chosen token.
//!
//! The step is batch-shaped from the start: each entry names its own sequence,
//! positions and output, so batched decode, speculative verification and a
//! scheduler with several slots use the same call (the scheduler sends a step's
//! entries together).

use crate::api::DeviceReport;
use model::{ExecError, Logits};

/// What one sequence's step should return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Logits of the last position or of every position.
    Logits(Logits),
    /// Only the greedy token of the last position (argmax, lowest id on ties),
    /// chosen on the device so only the id comes back.
    Greedy,
    /// The greedy token of every position ([`StepOut::Tokens`]): a verify step of a
    /// plain greedy request, whose rows need only their argmax.
    GreedyRows,
    /// The token [`SeqStep::draws`]`[0]` picks from the last position's logits
    /// (`sampler::sample_with`), chosen where the logits are, so only the id comes back
    /// ([`StepOut::Token`]).
    Sample,
    /// Each position's token as its draw in [`SeqStep::draws`] picks it
    /// ([`StepOut::Tokens`]): a verify step of a sampled request.
    SampleRows,
}

impl Want {
    /// The positions whose logits the forward pass must produce.
    pub fn logits(self) -> Logits {
        match self {
            Want::Logits(w) => w,
            Want::Greedy | Want::Sample => Logits::Last,
            Want::GreedyRows | Want::SampleRows => Logits::All,
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
    /// Image rows and multimodal rotary positions (a prompt with images; the
    /// default: text).
    pub media: model::Media<'a>,
    /// What [`Want::Sample`] (one draw) and [`Want::SampleRows`] (one a position)
    /// sample with; empty for every other want.
    pub draws: &'a [crate::sampler::Draw],
}

impl SeqStep<'_> {
    /// The draws of the `n` positions from `first` of a sampled entry.
    pub fn sample_draws(
        &self,
        first: usize,
        n: usize,
    ) -> Result<&[crate::sampler::Draw], ExecError> {
        self.draws.get(first..first + n).ok_or_else(|| {
            ExecError::new(
                "step",
                format!(
                    "a sampled entry came with {} draws for positions {first}..{}",
                    self.draws.len(),
                    first + n
                ),
            )
        })
    }
}

/// One entry's outcome in [`Executor::step_each`].
pub type EntryResult = Result<StepOut, ExecError>;

/// What a step returned for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOut {
    /// n_vocab per returned position.
    Logits(Vec<f32>),
    Token(u32),
    /// One greedy token per position ([`Want::GreedyRows`]).
    Tokens(Vec<u32>),
}

/// A host copy of one sequence's state at position `pos` (tokens `0..pos` fed):
/// what a prompt cache keeps, and what [`Executor::restore`] loads into any
/// sequence of an executor of the same model.
///
/// K and V are both position-major here, whatever a device keeps, so a prefix of
/// positions is a prefix of each array and the format does not depend on the device.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqSnapshot {
    /// The position the snapshot was taken at: tokens `0..pos` went in.
    pub pos: usize,
    /// Positions of K/V held: `pos` for a full snapshot, 0 for one of only the
    /// recurrent state ([`Executor::snapshot_recurrent`]).
    pub kv_pos: usize,
    /// Per attention layer, in layer order: K and V of positions `0..kv_pos`.
    pub kv: Vec<LayerKv>,
    /// Per DeltaNet layer, in layer order: the state after token `pos − 1`; empty
    /// for archs without DeltaNet layers.
    pub recurrent: Vec<RecurrentState>,
}

/// K and V of one attention layer: `[position][kv head][head_dim]` each, f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// One DeltaNet layer's state: conv history (conv_dim × (d_conv − 1), channel-major,
/// oldest first) and recurrent state (Hv × dk × dv).
#[derive(Debug, Clone, PartialEq)]
pub struct RecurrentState {
    pub conv: Vec<f32>,
    pub ssm: Vec<f32>,
}

impl SeqSnapshot {
    /// A snapshot taken at `pos`: with K/V of `0..pos` (`with_kv`) or none.
    pub(crate) fn taken(
        pos: usize,
        with_kv: bool,
        kv: Vec<LayerKv>,
        recurrent: Vec<RecurrentState>,
    ) -> SeqSnapshot {
        SeqSnapshot {
            pos,
            kv_pos: if with_kv { pos } else { 0 },
            kv,
            recurrent,
        }
    }

    /// Bytes of its arrays.
    pub fn bytes(&self) -> usize {
        let kv: usize = self.kv.iter().map(|l| l.k.len() + l.v.len()).sum();
        let rec: usize = self
            .recurrent
            .iter()
            .map(|r| r.conv.len() + r.ssm.len())
            .sum();
        (kv + rec) * 4
    }

    /// Whether any prefix of its positions can be restored: true when it holds no
    /// recurrent state (attention-only archs), whose state at an earlier position
    /// cannot be recovered from a later one.
    pub fn rewindable(&self) -> bool {
        self.recurrent.is_empty()
    }
}

/// What a snapshot is checked against before it is taken or loaded: the shape of a
/// sequence's state on its executor. Every executor checks through this, so a
/// snapshot is refused for the same reasons, with the same words, on every device.
pub(crate) struct StateShape {
    pub n_ctx: usize,
    /// Per attention layer: K (and V) floats a position.
    pub kv_width: Vec<usize>,
    /// Per DeltaNet layer: (conv, recurrent) floats.
    pub recurrent: Vec<(usize, usize)>,
    /// Positions the sequence has been fed since it was cleared (K/V of `0..fed`
    /// are in place).
    pub fed: usize,
}

impl StateShape {
    /// Refuses a snapshot at `pos` of a sequence that has not been fed that far.
    pub fn check_take(&self, op: &str, pos: usize) -> Result<(), ExecError> {
        if pos > self.n_ctx {
            return Err(ExecError::new(
                op,
                format!("position {pos} is beyond the context of {}", self.n_ctx),
            ));
        }
        if !self.kv_width.is_empty() && self.fed < pos {
            return Err(ExecError::new(
                op,
                format!(
                    "the sequence has been fed {} positions since it was cleared, not {pos}",
                    self.fed
                ),
            ));
        }
        Ok(())
    }

    /// Checks that `snap`'s recurrent state fits this model.
    pub fn check_recurrent(&self, op: &str, snap: &SeqSnapshot) -> Result<(), ExecError> {
        if snap.recurrent.len() != self.recurrent.len() {
            return Err(ExecError::new(
                op,
                format!(
                    "the snapshot holds {} DeltaNet layer states, this model has {} \
                     (a snapshot of another model?)",
                    snap.recurrent.len(),
                    self.recurrent.len()
                ),
            ));
        }
        for (i, (r, &(conv, ssm))) in snap.recurrent.iter().zip(&self.recurrent).enumerate() {
            if r.conv.len() != conv || r.ssm.len() != ssm {
                return Err(ExecError::new(
                    op,
                    format!(
                        "DeltaNet layer state {i} of the snapshot has another shape than this model's"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Checks a `restore` of positions `0..upto` of `snap`.
    pub fn check_restore(&self, snap: &SeqSnapshot, upto: usize) -> Result<(), ExecError> {
        let op = "restore";
        if snap.kv.len() != self.kv_width.len() {
            return Err(ExecError::new(
                op,
                format!(
                    "the snapshot holds {} attention layers, this model has {} \
                     (a snapshot of another model?)",
                    snap.kv.len(),
                    self.kv_width.len()
                ),
            ));
        }
        if upto > snap.kv_pos {
            return Err(ExecError::new(
                op,
                format!(
                    "cannot restore {upto} positions from a snapshot holding K/V of {}",
                    snap.kv_pos
                ),
            ));
        }
        if !self.recurrent.is_empty() && upto != snap.pos {
            return Err(ExecError::new(
                op,
                format!(
                    "this model's DeltaNet state cannot be rewound: restore exactly the \
                     snapshot's {} positions, not {upto}",
                    snap.pos
                ),
            ));
        }
        if upto > self.n_ctx {
            return Err(ExecError::new(
                op,
                format!("{upto} positions exceed the context of {}", self.n_ctx),
            ));
        }
        for (i, (l, &w)) in snap.kv.iter().zip(&self.kv_width).enumerate() {
            let want = snap.kv_pos * w;
            if l.k.len() != want || l.v.len() != want {
                return Err(ExecError::new(
                    op,
                    format!(
                        "attention layer {i} of the snapshot has another shape than this model's"
                    ),
                ));
            }
        }
        self.check_recurrent(op, snap)
    }

    /// Checks a `restore_recurrent` of `snap`: the sequence's own K/V must reach
    /// its position.
    pub fn check_restore_recurrent(&self, snap: &SeqSnapshot) -> Result<(), ExecError> {
        let op = "restore_recurrent";
        if !self.kv_width.is_empty() && self.fed < snap.pos {
            return Err(ExecError::new(
                op,
                format!(
                    "the sequence holds K/V of {} positions, short of the snapshot's {}: \
                     restore the full snapshot instead",
                    self.fed, snap.pos
                ),
            ));
        }
        self.check_recurrent(op, snap)
    }
}

/// The error of an executor without snapshots.
fn no_snapshots(op: &str) -> ExecError {
    ExecError::new(
        op,
        "sequence snapshots are not built for this executor (the CPU executor has them)",
    )
}

/// Where the last step of a sequence that kept its trail (a verify step) began and
/// how many tokens it fed.
#[derive(Debug, Clone, Copy)]
pub struct TrailSpan {
    pub pos0: usize,
    pub n: usize,
}

impl TrailSpan {
    /// For `Executor::rollback` to `pos` after the step `span` kept (None: the last
    /// step kept no trail): the index of the token whose state the sequence takes
    /// (`pos − 1 − pos0`), with the span; an error naming the cause otherwise.
    pub fn entry(span: Option<TrailSpan>, pos: usize) -> Result<(usize, TrailSpan), ExecError> {
        let span = span.ok_or_else(|| {
            ExecError::new(
                "rollback",
                "the sequence's last step kept no trail (call keep_trail before the verify step)",
            )
        })?;
        if pos <= span.pos0 || pos > span.pos0 + span.n {
            return Err(ExecError::new(
                "rollback",
                format!(
                    "position {pos} is outside the last verify step's positions {}..={}",
                    span.pos0 + 1,
                    span.pos0 + span.n
                ),
            ));
        }
        Ok((pos - span.pos0 - 1, span))
    }
}

/// The error of an executor without rollback.
fn no_rollback(op: &str) -> ExecError {
    ExecError::new(
        op,
        "rolling a sequence back after a verify step is not built for this executor \
         (the CPU and CUDA executors have it): speculative decoding is off here",
    )
}

/// A device that runs model steps.
pub trait Executor: Send {
    /// Where steps run and what device memory they hold.
    fn report(&self) -> DeviceReport;
    /// The sequences it holds (the engine's slots).
    fn sequences(&self) -> usize;
    /// Forgets sequence `seq` (a new conversation starts there).
    fn clear(&mut self, seq: usize) -> Result<(), ExecError>;
    /// Runs every entry of `batch` (each against its own sequence) and returns
    /// their outputs in order. All or nothing: on an error, every entry's sequence
    /// may hold part of the step.
    fn step(&mut self, batch: &[SeqStep]) -> Result<Vec<StepOut>, ExecError>;
    /// As `step`, but an entry may fail on its own (an expert its rows needed could
    /// not be read): `Ok` holds one result per entry, and only the sequences of the
    /// failed entries hold part of the step (the caller clears them); the others
    /// are complete, with the bits they get alone. `Err`: the whole step failed, as
    /// with `step`. By default, `step`'s all or nothing.
    fn step_each(&mut self, batch: &[SeqStep]) -> Result<Vec<EntryResult>, ExecError> {
        Ok(self.step(batch)?.into_iter().map(Ok).collect())
    }
    /// Where the routed experts computed so far came from (VRAM slot hits, misses
    /// from RAM and from the file); `None` when every expert is always resident.
    fn expert_stats(&self) -> Option<crate::experts::TierStats> {
        None
    }
    /// What the reads of experts from the file have done so far (reads, retries,
    /// failures, stalls); `None` when no expert is read from the file.
    fn expert_reads(&self) -> Option<crate::experts::ReadCounters> {
        None
    }
    /// A fault that keeps some requests from being served until it clears or the
    /// process restarts (the model file changed under it, an expert read is out
    /// past its deadline), in words; `None` while healthy.
    fn standing_fault(&self) -> Option<String> {
        None
    }
    /// A condition that does not keep requests from being served but makes them
    /// slower or some of them fail (a GPU short of memory because another process
    /// took VRAM), in words; `None` while there is none.
    fn standing_warning(&self) -> Option<String> {
        None
    }
    /// The most prompt tokens one step should carry (the engine feeds prompts in
    /// pieces of this many; the pieces do not change the results).
    fn prompt_chunk(&self) -> usize {
        512
    }
    /// Whether `snapshot`, `snapshot_recurrent`, `restore` and `restore_recurrent`
    /// are built (else they return an error).
    fn snapshots(&self) -> bool {
        false
    }
    /// The fewest prompt positions past the previous one a mark (a recurrent-state
    /// snapshot the scheduler keeps so a later turn can go back there) must be to be
    /// taken: re-reading fewer tokens costs less than the snapshot's copy here.
    fn min_mark_gap(&self) -> usize {
        1
    }
    /// A host copy of sequence `seq`'s state, which has been fed tokens `0..pos`:
    /// K/V of positions `0..pos` and the recurrent state.
    fn snapshot(&mut self, seq: usize, pos: usize) -> Result<SeqSnapshot, ExecError> {
        let _ = (seq, pos);
        Err(no_snapshots("snapshot"))
    }
    /// Like `snapshot` but without K/V (`kv_pos` 0): enough to bring `seq` itself
    /// back to `pos` with [`Executor::restore_recurrent`] while its K/V of `0..pos`
    /// are still in place (a step never writes positions below its `pos0`).
    fn snapshot_recurrent(&mut self, seq: usize, pos: usize) -> Result<SeqSnapshot, ExecError> {
        let _ = (seq, pos);
        Err(no_snapshots("snapshot_recurrent"))
    }
    /// A full snapshot of sequence `seq` at `mark.pos`: its K/V of `0..mark.pos`
    /// (still in place: a step never writes below its `pos0`) with the recurrent
    /// state of `mark`, a [`Executor::snapshot_recurrent`] taken there earlier. What
    /// the prompt cache keeps of a slot that has moved past its last mark; executors
    /// override it to copy only the K/V.
    fn snapshot_from_mark(
        &mut self,
        seq: usize,
        mark: &SeqSnapshot,
    ) -> Result<SeqSnapshot, ExecError> {
        let mut snap = self.snapshot(seq, mark.pos)?;
        snap.recurrent = mark.recurrent.clone();
        Ok(snap)
    }
    /// Loads positions `0..upto` of `snap` into sequence `seq` (its previous state is
    /// dropped); the next step continues at `pos0 = upto`. With DeltaNet layers
    /// `upto` must be `snap.pos` (their state cannot be rewound); attention-only
    /// archs may restore any prefix `upto ≤ snap.kv_pos`.
    fn restore(&mut self, seq: usize, snap: &SeqSnapshot, upto: usize) -> Result<(), ExecError> {
        let _ = (seq, snap, upto);
        Err(no_snapshots("restore"))
    }
    /// Loads only `snap`'s recurrent state into `seq`, keeping its K/V: brings `seq`
    /// back to `snap.pos` when its K/V of `0..snap.pos` are the snapshot's sequence's
    /// (the caller's promise; a sequence that never reached `snap.pos` is refused).
    fn restore_recurrent(&mut self, seq: usize, snap: &SeqSnapshot) -> Result<(), ExecError> {
        let _ = (seq, snap);
        Err(no_snapshots("restore_recurrent"))
    }
    /// Whether `keep_trail` and `rollback` are built (speculative decoding's verify
    /// steps need them; else they return an error).
    fn rollbacks(&self) -> bool {
        false
    }
    /// The most tokens a verify step may feed here (the pending token and its
    /// drafts): the scheduler drafts at most one fewer.
    fn verify_tokens(&self) -> usize {
        usize::MAX
    }
    /// The next step of sequence `seq` is a verify step (the last accepted token and
    /// drafts after it): it keeps the recurrent state after each of its tokens, so
    /// that `rollback` can bring the sequence back to any of them.
    fn keep_trail(&mut self, seq: usize) -> Result<(), ExecError> {
        let _ = seq;
        Err(no_rollback("keep_trail"))
    }
    /// Brings sequence `seq` back to position `pos` (tokens `0..pos` fed) after a
    /// step that kept its trail over positions `pos0..pos0 + n`, with
    /// `pos0 < pos ≤ pos0 + n`: the recurrent state is the one after token `pos − 1`
    /// and K/V from `pos` on are discarded; the next step continues at `pos`. The
    /// bits are those of a sequence that was never fed the tokens past `pos`.
    fn rollback(&mut self, seq: usize, pos: usize) -> Result<(), ExecError> {
        let _ = (seq, pos);
        Err(no_rollback("rollback"))
    }

    /// Keeps what MTP drafts need from now on (the trunk's hidden rows, the MTP
    /// block's cache per sequence); false where the executor or the model has no MTP.
    fn enable_mtp(&mut self) -> bool {
        false
    }

    /// Up to `k` tokens the model's MTP block drafts after `token`, which the next
    /// step feeds at sequence `seq`'s end; none where it cannot (no MTP, or a
    /// sequence restored from a snapshot, until it is cleared).
    fn mtp_draft(&mut self, seq: usize, token: u32, k: usize) -> Result<Vec<u32>, ExecError> {
        let _ = (seq, token, k);
        Ok(Vec::new())
    }
    /// Bytes the sequences' state holds now (K/V allocated so far and recurrent
    /// state), where the executor counts it.
    fn state_bytes_held(&self) -> Option<usize> {
        None
    }
}

/// Runs a sequence's tokens in pieces of at most `piece` tokens through `run(tokens,
/// pos0, want)`: the earlier pieces only advance the state (their greedy token, the
/// cheapest output, is dropped); every position's output is collected when `want`
/// asks for every position (`Logits::All`, `GreedyRows`), else the last piece's
/// output is returned.
pub(crate) fn in_pieces<E>(
    tokens: &[u32],
    pos0: usize,
    want: Want,
    piece: usize,
    mut run: impl FnMut(&[u32], usize, Want) -> Result<StepOut, E>,
) -> Result<StepOut, E> {
    let all = want.logits() == Logits::All;
    let n = tokens.len().div_ceil(piece);
    let (mut logits, mut ids) = (Vec::new(), Vec::new());
    let mut last = StepOut::Logits(Vec::new());
    for (i, chunk) in tokens.chunks(piece).enumerate() {
        let w = if all || i + 1 == n {
            want
        } else {
            Want::Greedy
        };
        last = run(chunk, pos0 + i * piece, w)?;
        match (all, &last) {
            (true, StepOut::Logits(l)) => logits.extend_from_slice(l),
            (true, StepOut::Tokens(t)) => ids.extend_from_slice(t),
            _ => {}
        }
    }
    Ok(match want {
        Want::Logits(Logits::All) => StepOut::Logits(logits),
        Want::GreedyRows | Want::SampleRows => StepOut::Tokens(ids),
        _ => last,
    })
}
