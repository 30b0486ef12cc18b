//! Where CPU passes spend their time, by part of the model: the mixers (attention and
//! DeltaNet with their projections), the MoE blocks (router, routed and shared
//! experts, combine), the LM head, and the whole pass (the rest of it is the
//! embedding, norms and residual adds). Every CPU pass in the process adds to one set
//! of counters (a clock read before and after each part: a few hundred a token);
//! `scoria bench` reports the difference over a test's timed runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A part of a pass.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Part {
    Mixers = 0,
    Moe = 1,
    LmHead = 2,
    /// A whole `forward_batch`.
    Pass = 3,
}

static NANOS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Runs `f`, adding its wall time to `part`.
pub(crate) fn timed<T>(part: Part, f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let out = f();
    NANOS[part as usize].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}

/// Time spent in each part since the process started (or between two snapshots,
/// with [`OpTimes::since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTimes {
    pub mixers: Duration,
    pub moe: Duration,
    pub lm_head: Duration,
    pub passes: Duration,
}

impl OpTimes {
    /// The counters now.
    pub fn now() -> OpTimes {
        let at = |p: Part| Duration::from_nanos(NANOS[p as usize].load(Ordering::Relaxed));
        OpTimes {
            mixers: at(Part::Mixers),
            moe: at(Part::Moe),
            lm_head: at(Part::LmHead),
            passes: at(Part::Pass),
        }
    }

    /// The time spent between `before` and this snapshot.
    pub fn since(&self, before: &OpTimes) -> OpTimes {
        OpTimes {
            mixers: self.mixers.saturating_sub(before.mixers),
            moe: self.moe.saturating_sub(before.moe),
            lm_head: self.lm_head.saturating_sub(before.lm_head),
            passes: self.passes.saturating_sub(before.passes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_part_adds_its_time_to_that_part_only() {
        let before = OpTimes::now();
        timed(Part::LmHead, || {
            std::thread::sleep(Duration::from_millis(5))
        });
        let d = OpTimes::now().since(&before);
        // (Other tests' passes may add to any part meanwhile.)
        assert!(d.lm_head >= Duration::from_millis(5), "{d:?}");
    }
}
