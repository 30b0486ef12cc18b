//! Parallel loops with a pool the caller chooses.
//!
//! The kernels' loops ([`for_each`], [`for_each_mut`]) run on rayon unless the
//! calling thread has installed another [`Pool`] with [`with_pool`]. The engine
//! installs a team of spinning threads for decode passes: a decode token runs a few
//! hundred loops of tens of microseconds each, and rayon puts its threads to sleep
//! between them and wakes them one by one, which costs as much as the loops' work
//! on a many-core machine. Prompt passes keep rayon.
//!
//! A loop's tasks never start loops of their own on the installed pool: inside a
//! task, loops run on the task's thread (so a pool never waits on itself).
//! Which thread runs a task never changes a value, only the time.

use std::cell::Cell;

use rayon::prelude::*;

/// Threads that run numbered tasks.
///
/// # Safety
/// `run` must call `f(i)` exactly once for every `i < n` and return only after all
/// have returned: [`for_each_mut`] hands out `&mut` items by index on that promise.
pub unsafe trait Pool: Sync {
    /// Threads that take tasks, the caller's included.
    fn threads(&self) -> usize;
    /// `f(0) .. f(n - 1)`, each once, in any order and on any of the pool's threads.
    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync));
}

#[derive(Clone, Copy)]
enum Mode {
    Rayon,
    Pool(*const (dyn Pool + 'static)),
    /// Inside a task of an installed pool: loops run on this thread.
    Serial,
}

thread_local! {
    static MODE: Cell<Mode> = const { Cell::new(Mode::Rayon) };
}

/// Puts the thread's previous mode back when a scope ends (unwinding included).
struct Restore(Mode);

impl Drop for Restore {
    fn drop(&mut self) {
        MODE.with(|m| m.set(self.0));
    }
}

fn enter(mode: Mode) -> Restore {
    Restore(MODE.with(|m| m.replace(mode)))
}

/// Runs `f` with the loops this thread starts (and only those) on `pool`.
pub fn with_pool<R>(pool: &dyn Pool, f: impl FnOnce() -> R) -> R {
    // SAFETY: the pointer is used only by this thread's loops until `_restore` puts
    // the previous mode back, which happens before `with_pool` returns (or unwinds),
    // so never after `pool`'s lifetime.
    let p: *const (dyn Pool + 'static) =
        unsafe { std::mem::transmute::<*const dyn Pool, *const (dyn Pool + 'static)>(pool) };
    let _restore = enter(Mode::Pool(p));
    f()
}

/// Threads a loop started here would use.
pub fn threads() -> usize {
    match MODE.with(Cell::get) {
        Mode::Rayon => rayon::current_num_threads().max(1),
        // SAFETY: installed by `with_pool`, whose borrow is still live (see there).
        Mode::Pool(p) => unsafe { &*p }.threads().max(1),
        Mode::Serial => 1,
    }
}

/// `f(0) .. f(n - 1)` in parallel on this thread's pool (rayon unless
/// [`with_pool`] installed another), returning when all have run.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    match MODE.with(Cell::get) {
        // Inside a pool's task, or nothing to share out: on this thread.
        Mode::Serial => (0..n).for_each(f),
        _ if n <= 1 => (0..n).for_each(f),
        Mode::Rayon => (0..n).into_par_iter().for_each(&f),
        Mode::Pool(p) => {
            // SAFETY: as in `threads`.
            let pool = unsafe { &*p };
            pool.run(n, &|i| {
                let _restore = enter(Mode::Serial);
                f(i)
            });
        }
    }
}

/// `f(i, &mut items[i])` for every item, in parallel as [`for_each`].
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(usize, &mut T) + Sync) {
    struct Items<T>(*mut T, usize);
    // SAFETY: each index is handed to exactly one task (the `Pool` contract, and
    // rayon's and a plain loop's), so no item is ever reached from two threads.
    unsafe impl<T: Send> Sync for Items<T> {}
    let items = Items(items.as_mut_ptr(), items.len());
    let items = &items;
    for_each(items.1, |i| {
        assert!(i < items.1);
        // SAFETY: `i` is in bounds and handed out once (see `Items`); the slice
        // outlives the loop.
        f(i, unsafe { &mut *items.0.add(i) })
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A pool that runs tasks in reverse order on the caller's thread and counts loops.
    struct Backwards(AtomicUsize);

    unsafe impl Pool for Backwards {
        fn threads(&self) -> usize {
            3
        }
        fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
            self.0.fetch_add(1, Ordering::Relaxed);
            (0..n).rev().for_each(f);
        }
    }

    #[test]
    fn loops_run_on_the_installed_pool_and_nested_loops_inline() {
        let pool = Backwards(AtomicUsize::new(0));
        let mut items = vec![0usize; 10];
        with_pool(&pool, || {
            assert_eq!(threads(), 3);
            for_each_mut(&mut items, |i, v| {
                // Inside a task: one thread, and no loop reaches the pool.
                assert_eq!(threads(), 1);
                let inner = AtomicUsize::new(0);
                for_each(4, |_| {
                    inner.fetch_add(1, Ordering::Relaxed);
                });
                *v = i * 10 + inner.load(Ordering::Relaxed);
            });
        });
        assert_eq!(pool.0.load(Ordering::Relaxed), 1);
        assert_eq!(items, (0..10).map(|i| i * 10 + 4).collect::<Vec<_>>());
        // Outside `with_pool`: rayon again.
        assert_eq!(threads(), rayon::current_num_threads());
        for_each_mut(&mut items, |i, v| *v = i);
        assert_eq!(pool.0.load(Ordering::Relaxed), 1);
        assert_eq!(items, (0..10).collect::<Vec<_>>());
    }
}
