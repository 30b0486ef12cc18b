//! [`Team`]: a few threads that stay awake between short parallel loops.
//!
//! The tiered GPU executor hands the CPU a few experts of one token per MoE layer,
//! about every 200–400 µs, and each hand-off is worth only 50–100 µs of work. A
//! general pool (rayon) puts its threads to sleep between such calls and wakes them
//! one by one, which cost 100 µs or more a call when measured there. A team's threads
//! spin while work keeps coming (and sleep after [`Team::IDLE_SPIN`] without any),
//! so a loop starts on every thread within a microsecond or two.
//!
//! A loop is `n` numbered tasks; threads claim them one at a time until none is
//! left. The caller first does something else while the team works
//! ([`Team::run_beside`], e.g. issue GPU work), then joins in.
//!
//! The CPU executor's decode passes run their loops on one process-wide team
//! ([`shared`], a [`quant::par::Pool`]): a decode token is a few hundred loops of
//! tens of microseconds each, the same pattern at the scale of a whole pass.
//!
//! Every wait spins for a while and then yields its core, so a team on a machine
//! with more runnable threads than cores (a test run, a busy server) hands the
//! cores to whoever has work instead of burning a time slice waiting for a
//! descheduled thread.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The task function of the current loop, lifetime erased (see [`Team::start`]).
type TaskFn<'f> = dyn Fn(usize) + Sync + 'f;

struct Shared {
    /// Generation (high 32 bits) and next unclaimed task (low 32 bits). A thread
    /// claims a task with a compare-exchange that also checks the generation, so a
    /// thread still holding an older loop can never claim a task of a newer one.
    claim: AtomicU64,
    /// The current loop: its generation, task count and function, written before
    /// `claim` moves to that generation. A thread takes tasks only of the
    /// generation it finds here, so it never pairs one loop's count with another's
    /// claims. (Read by every thread at the start of every loop, hence a read lock.)
    task: RwLock<Option<(u64, usize, &'static TaskFn<'static>)>>,
    /// Tasks of the current loop finished.
    done: AtomicUsize,
    /// Whether a task panicked in the current loop.
    panicked: AtomicBool,
    /// Threads asleep wait here for a new generation or the end.
    sleep: Mutex<u64>,
    /// Threads asleep or about to be (counted under `sleep`): a loop wakes them only
    /// when there are some.
    sleepers: AtomicUsize,
    wake: Condvar,
    stop: AtomicBool,
}

/// A team of threads for short parallel loops.
pub struct Team {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    /// Held for the whole of a loop: loops from several threads take turns (a second
    /// loop must not reset the counts a first one still waits on).
    one_loop: Mutex<()>,
}

/// A loop started by [`Team::start`]: it borrows the task function until
/// [`Pending::wait`] returns, or until it is dropped (unwinding included). Private,
/// so that no caller can forget one while its threads still call the function.
struct Pending<'t, 'f> {
    team: &'t Team,
    _turn: std::sync::MutexGuard<'t, ()>,
    gen: u64,
    n: usize,
    waited: bool,
    _f: std::marker::PhantomData<&'f TaskFn<'f>>,
}

impl Team {
    /// How long a thread spins without work before it sleeps.
    pub const IDLE_SPIN: Duration = Duration::from_millis(5);

    /// A team of `workers` threads (0: the caller's thread does every loop alone).
    pub fn new(workers: usize) -> Team {
        let shared = Arc::new(Shared {
            claim: AtomicU64::new(0),
            task: RwLock::new(None),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleep: Mutex::new(0),
            sleepers: AtomicUsize::new(0),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let threads = (0..workers)
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("scoria-team-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawn a team thread")
            })
            .collect();
        Team {
            shared,
            threads,
            one_loop: Mutex::new(()),
        }
    }

    /// Starts `f(0) .. f(n - 1)` on the team's threads and returns at once; the
    /// caller's thread takes no task until [`Pending::wait`] (which works on what is
    /// left, then waits for the rest). With no workers, `wait` does all.
    fn start<'t, 'f>(&'t self, n: usize, f: &'f TaskFn<'f>) -> Pending<'t, 'f> {
        let turn = self.one_loop.lock().unwrap_or_else(|e| e.into_inner());
        let s = &self.shared;
        // SAFETY: the reference is used only for tasks of this generation, all of
        // which finish before `Pending::wait` returns; `Pending` cannot outlive 'f,
        // waits on drop, and never leaves this module (so it is never forgotten):
        // no thread calls `f` after 'f ends.
        let f: &'static TaskFn<'static> =
            unsafe { std::mem::transmute::<&'f TaskFn<'f>, &'static TaskFn<'static>>(f) };
        let gen = (s.claim.load(Ordering::Relaxed) >> 32) + 1;
        s.done.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        *s.task.write().unwrap_or_else(|e| e.into_inner()) = Some((gen, n, f));
        s.claim.store(gen << 32, Ordering::Release);
        // Sleepers wake for the new generation; spinners see it themselves. (A
        // thread counts itself a sleeper and checks the generation under `sleep`,
        // so it either sees this one or is counted here.)
        let mut g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
        *g = gen;
        if s.sleepers.load(Ordering::Relaxed) > 0 {
            s.wake.notify_all();
        }
        drop(g);
        Pending {
            team: self,
            _turn: turn,
            gen,
            n,
            waited: false,
            _f: std::marker::PhantomData,
        }
    }

    /// Starts `f(0) .. f(n - 1)` on the team, runs `beside` on the caller's thread
    /// meanwhile, then joins the loop; returns `beside`'s value when all tasks are
    /// done. Panics if a task panicked (after every task has finished, also when
    /// `beside` panics).
    pub fn run_beside<R>(&self, n: usize, f: &TaskFn<'_>, beside: impl FnOnce() -> R) -> R {
        let pending = self.start(n, f);
        let r = beside();
        pending.wait();
        r
    }
}

/// The process's team for the CPU executor's decode passes: one thread fewer than
/// rayon's pool (the caller's thread is the last), built at first use.
pub(crate) fn shared() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| Team::new(rayon::current_num_threads().saturating_sub(1)))
}

// SAFETY: `run_beside` runs every task of the loop once (claims are unique per
// generation) and returns only after all have finished (`Pending::wait`).
unsafe impl quant::par::Pool for Team {
    fn threads(&self) -> usize {
        self.threads.len() + 1
    }

    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        super::op_times::timed_loop(|| self.run_beside(n, f, || ()));
    }
}

impl Pending<'_, '_> {
    /// Takes the tasks no thread has claimed yet, then waits for the others'.
    /// Panics if a task panicked.
    pub fn wait(mut self) {
        self.finish();
        if self.team.shared.panicked.load(Ordering::Acquire) {
            panic!("a task of a CPU team loop panicked");
        }
    }

    fn finish(&mut self) {
        if self.waited {
            return;
        }
        self.waited = true;
        let s = &self.team.shared;
        work(s, self.gen);
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < self.n {
            pause(&mut spins);
        }
    }
}

impl Drop for Pending<'_, '_> {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &self.shared;
        s.stop.store(true, Ordering::Release);
        let g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
        s.wake.notify_all();
        drop(g);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Claims and runs tasks of generation `gen` until none is left.
fn work(s: &Shared, gen: u64) {
    let (n, f) = match *s.task.read().unwrap_or_else(|e| e.into_inner()) {
        Some((g, n, f)) if g == gen => (n as u64, f),
        _ => return,
    };
    let mut cur = s.claim.load(Ordering::Acquire);
    loop {
        if cur >> 32 != gen || cur & 0xffff_ffff >= n {
            return;
        }
        match s
            .claim
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                let i = (cur & 0xffff_ffff) as usize;
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).is_err() {
                    s.panicked.store(true, Ordering::Release);
                }
                s.done.fetch_add(1, Ordering::AcqRel);
                cur = s.claim.load(Ordering::Acquire);
            }
            Err(now) => cur = now,
        }
    }
}

/// One round of a wait: a spin-loop hint for the first [`SPINS`] rounds, then the
/// core handed to any other runnable thread (a system call, ~1 µs when none is).
fn pause(spins: &mut u32) {
    if *spins < SPINS {
        *spins += 1;
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// Rounds a wait spins before it starts yielding: a few to tens of microseconds,
/// as a spin-loop hint costs from a few to ~140 cycles depending on the core.
const SPINS: u32 = 500;

fn worker(s: &Shared) {
    let mut seen = 0u64;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        let gen = s.claim.load(Ordering::Acquire) >> 32;
        if gen != seen {
            seen = gen;
            work(s, gen);
            idle_since = Instant::now();
            spins = 0;
            continue;
        }
        if idle_since.elapsed() < Team::IDLE_SPIN {
            pause(&mut spins);
            continue;
        }
        // Asleep until a newer generation is published (or the team ends).
        let mut g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
        s.sleepers.fetch_add(1, Ordering::Relaxed);
        while *g == seen && !s.stop.load(Ordering::Acquire) {
            g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        s.sleepers.fetch_sub(1, Ordering::Relaxed);
        drop(g);
        idle_since = Instant::now();
        spins = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::Team;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_task_runs_once_per_loop() {
        for workers in [0, 1, 3, 7] {
            let team = Team::new(workers);
            for round in 0..300 {
                let n = round % 37;
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                let r = team.run_beside(
                    n,
                    &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    },
                    // Half the loops with the caller busy a while first.
                    || {
                        if round % 2 == 1 {
                            std::thread::sleep(std::time::Duration::from_micros(50));
                        }
                        round
                    },
                );
                assert_eq!(r, round);
                for (i, h) in hits.iter().enumerate() {
                    assert_eq!(
                        h.load(Ordering::Relaxed),
                        1,
                        "{workers} workers, round {round}, task {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn loops_from_several_threads_take_turns() {
        let team = Team::new(3);
        std::thread::scope(|sc| {
            for t in 0..4 {
                let team = &team;
                sc.spawn(move || {
                    for round in 0..2000 {
                        let n = 1 + (round + t) % 23;
                        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                        team.run_beside(
                            n,
                            &|i| {
                                hits[i].fetch_add(1, Ordering::Relaxed);
                                std::hint::black_box((0..i * 50).sum::<usize>());
                            },
                            || (),
                        );
                        assert!(
                            hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                            "thread {t}, round {round}"
                        );
                    }
                });
            }
        });
    }

    #[test]
    fn sleeping_threads_wake_for_the_next_loop() {
        let team = Team::new(2);
        team.run_beside(4, &|_| {}, || ());
        std::thread::sleep(Team::IDLE_SPIN * 3);
        let sum = AtomicUsize::new(0);
        team.run_beside(
            100,
            &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            },
            || (),
        );
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_team_goes_on() {
        let team = Team::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            team.run_beside(8, &|i| assert_ne!(i, 5, "task five fails"), || ());
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        team.run_beside(
            8,
            &|_| {
                n.fetch_add(1, Ordering::Relaxed);
            },
            || (),
        );
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }
}
