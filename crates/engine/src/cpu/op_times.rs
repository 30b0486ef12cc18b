//! Where CPU passes spend their time, by part of the model: the mixers (attention and
//! DeltaNet with their projections), the MoE blocks (router, routed and shared
//! experts, combine), the LM head, and the whole pass (the rest of it is the
//! embedding, norms and residual adds); and, across the parts, the parallel loops a
//! decode pass runs on the CPU team (the rest of its time is work on one thread).
//! Every CPU pass in the process adds to one set of counters (a clock read before
//! and after each part and loop: a few hundred a token); `scoria bench` reports the
//! difference over a test's timed runs.

use std::cell::Cell;
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
/// Time in the team's loops, by the innermost part they ran in.
static LOOP_NANOS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
static LOOPS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The innermost part this thread is timing.
    static CURRENT: Cell<Part> = const { Cell::new(Part::Pass) };
}

/// Runs `f`, adding its wall time to `part`.
pub(crate) fn timed<T>(part: Part, f: impl FnOnce() -> T) -> T {
    /// Gives the thread its outer part back however `f` ends (a panic that a
    /// caller catches must not leave later loops counted in this part).
    struct Restore(Part);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(part)));
    let t0 = Instant::now();
    let out = f();
    NANOS[part as usize].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}

/// Runs the parallel loop `f`, adding its wall time to the loops of the part this
/// thread is in.
pub(crate) fn timed_loop<T>(f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let out = f();
    let part = CURRENT.with(Cell::get);
    LOOP_NANOS[part as usize].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    LOOPS.fetch_add(1, Ordering::Relaxed);
    out
}

/// One part's time, and how much of it went to the team's parallel loops (the
/// rest ran on one thread).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PartTime {
    pub total: Duration,
    pub in_loops: Duration,
}

impl PartTime {
    fn at(p: Part) -> PartTime {
        let get = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        PartTime {
            total: get(&NANOS[p as usize]),
            in_loops: get(&LOOP_NANOS[p as usize]),
        }
    }

    fn since(&self, before: &PartTime) -> PartTime {
        PartTime {
            total: self.total.saturating_sub(before.total),
            in_loops: self.in_loops.saturating_sub(before.in_loops),
        }
    }
}

/// Time spent in each part since the process started (or between two snapshots,
/// with [`OpTimes::since`]). `passes.in_loops` counts only the loops outside the
/// other parts (the embedding, norms and adds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTimes {
    pub mixers: PartTime,
    pub moe: PartTime,
    pub lm_head: PartTime,
    pub passes: PartTime,
    /// Parallel loops run on the team.
    pub loop_count: u64,
}

impl OpTimes {
    /// The counters now.
    pub fn now() -> OpTimes {
        OpTimes {
            mixers: PartTime::at(Part::Mixers),
            moe: PartTime::at(Part::Moe),
            lm_head: PartTime::at(Part::LmHead),
            passes: PartTime::at(Part::Pass),
            loop_count: LOOPS.load(Ordering::Relaxed),
        }
    }

    /// The time spent between `before` and this snapshot.
    pub fn since(&self, before: &OpTimes) -> OpTimes {
        OpTimes {
            mixers: self.mixers.since(&before.mixers),
            moe: self.moe.since(&before.moe),
            lm_head: self.lm_head.since(&before.lm_head),
            passes: self.passes.since(&before.passes),
            loop_count: self.loop_count.saturating_sub(before.loop_count),
        }
    }

    /// A pass's time on one thread: everything outside the team's loops.
    pub fn one_thread(&self) -> Duration {
        let loops = [self.mixers, self.moe, self.lm_head, self.passes]
            .iter()
            .map(|p| p.in_loops)
            .sum();
        self.passes.total.saturating_sub(loops)
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
        assert!(d.lm_head.total >= Duration::from_millis(5), "{d:?}");
    }

    #[test]
    fn a_panicking_part_gives_the_thread_its_outer_part_back() {
        timed(Part::Moe, || {
            let caught = std::panic::catch_unwind(|| timed(Part::LmHead, || panic!("inside")));
            assert!(caught.is_err());
            assert!(matches!(CURRENT.with(Cell::get), Part::Moe));
        });
        assert!(matches!(CURRENT.with(Cell::get), Part::Pass));
    }
}
