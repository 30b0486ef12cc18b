//! Rolling a sequence back after a speculative verify step: the step's DeltaNet
//! layers write the state after each of its tokens but the last into the sequence's
//! trail (`dn_conv` and `dn_recurrence` with a trail), and a rollback copies the entry
//! of the last accepted token back into the state, on the device. K/V past the
//! accepted position need nothing: a later step writes a position before any
//! attention reads it.

use super::weights::cuda_err;
use super::CudaExecutor;
use crate::exec::{SeqStep, TrailSpan};
use model::ExecError;

impl CudaExecutor {
    /// Before a step: the entries whose trail is armed must fit it (one pass of at
    /// most the trail's tokens). On a refusal every trail is disarmed.
    pub(super) fn check_trails(&mut self, batch: &[SeqStep]) -> Result<(), ExecError> {
        let bad = batch.iter().find(|s| {
            let t = &self.states[s.seq].trail;
            t.armed && s.tokens.len() > t.tokens
        });
        if let Some(s) = bad {
            let most = self.states[s.seq].trail.tokens;
            let n = s.tokens.len();
            self.end_trails(batch, false);
            return Err(ExecError::new(
                "step",
                format!(
                    "a verify step of {n} tokens for sequence {} is longer than the {most} \
                     its trail holds (the scheduler drafts at most Executor::verify_tokens − 1)",
                    s.seq
                ),
            ));
        }
        Ok(())
    }

    /// After a step (`ok`: it completed): each armed entry's trail now spans its
    /// tokens; every other entry's sequence has nothing to roll back to.
    pub(super) fn end_trails(&mut self, batch: &[SeqStep], ok: bool) {
        for s in batch {
            let t = &mut self.states[s.seq].trail;
            t.span = (ok && t.armed).then_some(TrailSpan {
                pos0: s.pos0,
                n: s.tokens.len(),
            });
            t.armed = false;
        }
    }

    /// `Executor::rollback` on the device.
    pub(super) fn roll_back(&mut self, seq: usize, pos: usize) -> Result<(), ExecError> {
        let st = self.state("rollback", seq)?;
        let (t, span) = TrailSpan::entry(st.trail.span, pos)?;
        let gpu = &self.be.gpu;
        if t + 1 < span.n {
            let parts = st
                .conv
                .iter()
                .zip(&st.trail.conv)
                .chain(st.ssm.iter().zip(&st.trail.ssm));
            for (state, trail) in parts {
                let bytes = state.bytes();
                gpu.copy_device(trail.ptr() + t as u64 * bytes, state.ptr(), bytes)
                    .map_err(cuda_err("roll back the recurrent state"))?;
            }
        }
        self.states[seq].trail.span = None;
        if let Some(m) = self.states[seq].mtp.as_mut() {
            m.span.truncate(pos);
        }
        self.fed[seq] = pos;
        Ok(())
    }
}
