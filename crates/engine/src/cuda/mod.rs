//! The CUDA executor: the whole model in one GPU's memory, our own kernels
//! (`crates/cuda`), and each batch-1 decode step replayed as a CUDA graph.
//!
//! Loading (`open.rs`) checks the VRAM the weights, the sequences' state and the
//! scratch arena need against the free memory before allocating anything, and
//! refuses with the numbers and the remedy (docs/design.md invariant 5). This file
//! holds the executor and its steps: batched decode rows, one sequence's decode
//! step or prompt pieces, and the `Executor` entry points.

mod backend;
mod graphs;
mod mtp;
mod open;
mod rollback;
mod sample;
mod snapshot;
mod trace;
pub mod vision;
mod weights;

use backend::tiered::Tiered;
use backend::MAX_ROWS;
pub use backend::{CudaBackend, CudaState, DBuf};
pub(crate) use graphs::injected_graph_oom;
pub use graphs::PRESSURE_RETRY;
use graphs::{DecodeGraph, DecodeSegments, Pressure};
pub use open::{Budgets, VramAccount};
use snapshot::{recurrent_uploads, upload_f32s};

use crate::exec::{EntryResult, Executor, SeqSnapshot, SeqStep, StepOut, Want};
use crate::experts::{ReadCounters, TierStats};
use crate::{Device, DeviceReport};
use model::{ExecError, Logits, Segment};
use std::collections::HashMap;
use std::time::Instant;
use weights::{cuda_err, is_out_of_vram};

/// VRAM the CUDA context, the loaded kernels and allocation rounding take beyond
/// what scoria allocates (measured with nvidia-smi on an H200: about 0.9 GiB with
/// the executor's own 16 GiB). An explicit --vram-budget covers it.
pub const CONTEXT_VRAM: u64 = (1 << 30) + (64 << 20);
/// Positions whose logits one step may return at once (Logits::All is split
/// into pieces of this many tokens).
const MAX_LOGIT_ROWS: usize = 64;
/// The fewest prompt tokens between marks on the GPU (see `min_mark_gap`).
const MIN_MARK_GAP: usize = 32;

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
    /// Verify steps (a few tokens of one sequence with every row's output) by
    /// (sequence, tokens, greedy rows, trail armed): see [`CudaExecutor::verify_key`].
    verify_graphs: HashMap<(usize, usize, bool, bool), DecodeGraph>,
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

impl CudaExecutor {
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
            m.span = crate::spec::MtpSpan::EMPTY;
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
            m.span = crate::spec::MtpSpan::LOST;
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
            m.span = crate::spec::MtpSpan::LOST;
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
        if let Some(key) = self.verify_key(s) {
            // A verify step: replayed from a graph like a decode token.
            self.be.load_inputs(s.tokens, s.pos0, None)?;
            let out = self.replay(
                |ex| &mut ex.verify_graphs,
                key,
                "a verify step",
                |ex| ex.launch_step(s.seq, s.tokens, s.pos0, s.want, Default::default()),
            )?;
            let r = self.read_out(out, s.want, (0, s.tokens.len()), s)?;
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
                m.span = crate::spec::MtpSpan::LOST;
            }
            Ok(r)
        })
    }
}

impl CudaExecutor {
    /// The graph key of entry `s` when it is a step a graph can replay like a decode
    /// token: a few tokens (a speculative verify step, at most [`MAX_ROWS`]) of text
    /// with every row's output, whose pass needs nothing from the host
    /// (`CudaBackend::pass_on_device`) and fits the context (checked here: a replay
    /// runs no host check). The key holds what changes the captured kernels: the
    /// sequence (its state's buffers), the tokens, whether the rows' argmax is taken
    /// (greedy rows; sampled rows and logits are drawn or read from the logits), and
    /// whether the DeltaNet layers write the trail.
    fn verify_key(&self, s: &SeqStep) -> Option<(usize, usize, bool, bool)> {
        let n = s.tokens.len();
        let st = &self.states[s.seq];
        let fits = n > 1
            && n <= MAX_ROWS
            && s.want.logits() == Logits::All
            && !has_media(s)
            && s.pos0 + n <= st.n_ctx
            && self.be.pass_on_device(n);
        fits.then_some((s.seq, n, s.want == Want::GreedyRows, st.trail.armed))
    }
}

/// Whether a step entry feeds image rows or multimodal rotary positions.
fn has_media(s: &SeqStep) -> bool {
    !s.media.embeds.is_empty() || s.media.rope.is_some()
}
