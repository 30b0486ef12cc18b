//! Admission: which free slot a request gets (the one that keeps the most of its
//! prompt, else the least recently used), what of that slot's state it keeps — the
//! slot's own history, a mark, or a conversation from the prompt cache —, and the
//! conversation a slot loses, stashed into the prompt cache first.

use super::seq_cache::{mark_positions, reusable, spaced_marks};
use super::step::{self, Active};
use super::{media, RequestCallbacks, Scheduler};
use crate::api::GenerateRequest;
use crate::error::EngineError;
use crate::exec::Executor;
use crate::spec::RequestSpec;

impl Scheduler {
    /// A free slot, when there is one and a request waits.
    pub(super) fn free_seq(&self) -> Option<usize> {
        let (req, _) = self.queue.front()?;
        self.pick_seq(&req.prompt)
    }

    /// The free slot that keeps the most of `prompt`; else the least recently used.
    pub(super) fn pick_seq(&self, prompt: &[u32]) -> Option<usize> {
        self.seqs
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.busy)
            .max_by_key(|(_, c)| {
                (
                    reusable(c, prompt, self.recurrent).keep,
                    std::cmp::Reverse(c.last_used),
                )
            })
            .map(|(i, _)| i)
    }

    /// Checks `req`, prepares slot `seq` for it (keeping what its cache or the
    /// prompt cache can give), and starts it; `None` when it ended at once (the
    /// sink was told).
    pub(super) fn admit(
        &mut self,
        exec: &mut dyn Executor,
        seq: usize,
        req: GenerateRequest,
        logits: bool,
        sink: &mut dyn RequestCallbacks,
    ) -> Result<Option<Active>, EngineError> {
        self.limits.validate(&req)?;
        let keep = self.prepare_seq(exec, seq, &req.prompt)?;
        self.tick += 1;
        self.seqs[seq].last_used = self.tick;
        sink.admitted(seq, keep);
        let marks = if self.recurrent && exec.snapshots() {
            let at = mark_positions(&req.prompt, self.boundary);
            spaced_marks(at, keep, exec.min_mark_gap())
        } else {
            Vec::new()
        };
        let experts = exec.expert_stats();
        let mut act = Active::new(seq, req, keep, &self.limits, logits, marks, experts);
        act.media = media::RequestMedia::new(&act.req, self.vision.as_ref(), keep);
        act.spec = RequestSpec::new(
            self.drafter,
            &self.spec,
            act.req.speculative,
            &act.req.prompt,
        );
        let c = &mut self.seqs[seq];
        if step::start_cached(&mut act, c, &self.limits, sink) {
            return Ok(None);
        }
        c.busy = true;
        Ok(Some(act))
    }

    /// Makes slot `seq`'s state a prefix of `prompt`, as long as its own cache or
    /// the prompt cache allows; returns how many prompt tokens it holds. A
    /// conversation the slot held and now loses goes to the prompt cache.
    fn prepare_seq(
        &mut self,
        exec: &mut dyn Executor,
        seq: usize,
        prompt: &[u32],
    ) -> Result<usize, EngineError> {
        let own = reusable(&self.seqs[seq], prompt, self.recurrent);
        let stored = match self.store.as_mut() {
            Some(st) => st.peek(prompt),
            None => 0,
        };
        if stored > own.keep {
            self.stash_seq(exec, seq);
            let hit = self.store.as_mut().and_then(|st| st.lookup(prompt));
            if let Some(hit) = hit {
                let c = &mut self.seqs[seq];
                // A mark is the state after its tokens: those up to where the slot's
                // old history and the prompt part stay true of the restored one.
                let same = c
                    .history
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(hit.matched);
                c.history.clear();
                c.last_logits = None;
                c.marks.retain(|m| m.pos <= same);
                match exec.restore(seq, &hit.snapshot, hit.matched) {
                    Ok(()) => {
                        self.seqs[seq].history = prompt[..hit.matched].to_vec();
                        self.counters.store_hits += 1;
                        self.counters.tokens_reused += hit.matched as u64;
                        return Ok(hit.matched);
                    }
                    Err(e) => {
                        tracing::warn!(
                            "prompt cache: restoring {} tokens failed: {e}",
                            hit.matched
                        );
                        self.clear_seq(exec, seq)?;
                        self.counters.misses += 1;
                        return Ok(0);
                    }
                }
            }
        }
        if own.keep < self.seqs[seq].history.len() {
            self.stash_seq(exec, seq);
        }
        if own.keep == 0 {
            self.clear_seq(exec, seq)?;
            self.counters.misses += 1;
            return Ok(0);
        }
        if let Some(i) = own.mark {
            let snap = self.seqs[seq].marks[i].snap.clone();
            if let Err(e) = exec.restore_recurrent(seq, &snap) {
                tracing::warn!("slot {seq}: going back to position {}: {e}", own.keep);
                self.clear_seq(exec, seq)?;
                self.counters.misses += 1;
                return Ok(0);
            }
        }
        let c = &mut self.seqs[seq];
        if own.keep < c.history.len() {
            c.history.truncate(own.keep);
            c.last_logits = None;
        }
        c.marks.retain(|m| m.pos <= own.keep);
        self.counters.slot_hits += 1;
        self.counters.tokens_reused += own.keep as u64;
        Ok(own.keep)
    }

    /// Puts the conversation slot `seq` holds into the prompt cache before the
    /// slot is given to another: its state at the last message start it marked
    /// (or its whole history, for attention-only models).
    pub(super) fn stash_seq(&mut self, exec: &mut dyn Executor, seq: usize) {
        let Some(store) = self.store.as_mut() else {
            return;
        };
        let c = &self.seqs[seq];
        let (pos, recurrent) = if self.recurrent {
            let best = c
                .marks
                .iter()
                .filter(|m| m.boundary && m.pos <= c.history.len())
                .max_by_key(|m| m.pos)
                .or_else(|| {
                    c.marks
                        .iter()
                        .filter(|m| m.pos <= c.history.len())
                        .max_by_key(|m| m.pos)
                });
            match best {
                Some(m) => (m.pos, Some(m.snap.clone())),
                None => return,
            }
        } else {
            (c.history.len(), None)
        };
        if pos == 0 {
            return;
        }
        let snap = match &recurrent {
            Some(mark) => exec.snapshot_from_mark(seq, mark),
            None => exec.snapshot(seq, pos),
        };
        let snap = match snap {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("prompt cache: no snapshot of slot {seq}: {e}");
                return;
            }
        };
        let tokens = c.history[..pos].to_vec();
        match store.insert(tokens, snap) {
            Ok(_) => {
                if let Some(w) = &self.store_writer {
                    w.save(store.contents());
                }
            }
            Err(e) => tracing::warn!("prompt cache: {e}"),
        }
    }
}
