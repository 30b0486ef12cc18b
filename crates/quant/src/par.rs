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

/// A row-major matrix of f32 (rows of `width` values) that the tasks of one loop
/// write at once, each owning a range of columns: a task takes its columns' run of
/// any row. (A product's output whose tasks own weight rows, a layer's output whose
/// tasks own heads or channels.)
pub struct ColumnRuns<'a> {
    ptr: *mut f32,
    len: usize,
    width: usize,
    _data: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: `run`'s contract keeps the tasks' runs disjoint, and the `&mut` borrow of the
// whole matrix lasts as long as this value.
unsafe impl Sync for ColumnRuns<'_> {}

impl<'a> ColumnRuns<'a> {
    pub fn new(data: &'a mut [f32], width: usize) -> ColumnRuns<'a> {
        ColumnRuns {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            width,
            _data: std::marker::PhantomData,
        }
    }

    /// Columns `c0..c0 + n` of row `row`.
    ///
    /// # Safety
    /// No other live slice from this value may overlap this one: tasks that own
    /// disjoint columns, or disjoint rows, are safe.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn run(&self, row: usize, c0: usize, n: usize) -> &mut [f32] {
        let at = row * self.width + c0;
        assert!(c0 + n <= self.width && at + n <= self.len);
        // SAFETY: in bounds by the assert; exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), n) }
    }
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
