//! Fault injection: the seam tests use to make the engine's file I/O fail the way
//! disks and filesystems fail (an error, a short read, a read that stalls), so that
//! each failure's message and recovery can be asserted.
//!
//! The hooks are compiled only with the cargo feature `fault-injection`, which the
//! engine's own tests turn on (a dev-dependency of the crate on itself) and nothing
//! else does: in every other build [`hit`] is an inlined `None` and the hooks cost
//! nothing. A hook names its [`Site`] and the file it works on; a test registers
//! [`Rule`]s with [`inject`], each matching a site and a piece of the file's path
//! (tests in one process use files of their own, so their rules never meet), and
//! removes them by dropping the returned guard.
//!
//! Sites (more come with the GPU and server faults):
//! - [`Site::ExpertRead`]: one completed read of expert bytes from the model file
//!   (`experts::io`), given the file offset it read at; the fault replaces or delays
//!   its result;
//! - [`Site::CacheCreate`], [`Site::CacheWrite`], [`Site::CacheRead`]: the prompt
//!   cache creating an entry's temporary file, writing its bytes, and reading an
//!   entry at load (`prompt_cache`);
//! - [`Site::GpuGraph`]: the CUDA executor instantiating a captured graph (a decode
//!   step's, a batched decode step's, or a segment of a tiered one), on the path
//!   `cuda graph`; any fault makes it fail as the driver does when another process
//!   took the VRAM it needs (`CUDA_ERROR_OUT_OF_MEMORY`).

use std::time::Duration;

/// Where a fault can be injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Site {
    /// A read of expert bytes from the model file completed (at a file offset).
    ExpertRead,
    /// The prompt cache creates an entry's temporary file.
    CacheCreate,
    /// The prompt cache writes an entry's bytes (before its fsync and rename).
    CacheWrite,
    /// The prompt cache reads an entry file at load.
    CacheRead,
    /// The CUDA executor instantiates a captured graph (any fault: out of VRAM).
    GpuGraph,
}

/// What happens at a matching hook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The operation fails with this `errno` (`libc::EIO`, `libc::ENOSPC`, ...).
    Errno(i32),
    /// A read returns at most this many bytes (rounded down to the alignment of a
    /// direct read, at least one block); the reader must continue it.
    Short(usize),
    /// A read returns 0 bytes: the end of the file.
    Eof,
    /// The operation takes this long before it completes (normally).
    Stall(Duration),
}

/// One injected fault: at hooks of `site` whose path contains `path`, and (for
/// reads) whose file offset lies in `offsets`, skip the first `skip` matches,
/// then apply `fault` to the next `times` (None: every one). Where several rules
/// match, the one injected last applies (and the others do not count the hit).
#[derive(Debug, Clone)]
pub struct Rule {
    pub site: Site,
    pub path: String,
    pub offsets: std::ops::Range<u64>,
    pub skip: u32,
    pub times: Option<u32>,
    pub fault: Fault,
}

impl Rule {
    /// `fault` at every hook of `site` on a path containing `path`.
    pub fn new(site: Site, path: impl Into<String>, fault: Fault) -> Rule {
        Rule {
            site,
            path: path.into(),
            offsets: 0..u64::MAX,
            skip: 0,
            times: None,
            fault,
        }
    }

    /// Only reads starting inside `offsets` of the file.
    pub fn at(mut self, offsets: std::ops::Range<u64>) -> Rule {
        self.offsets = offsets;
        self
    }

    /// Only the first `n` matches (after the skipped ones).
    pub fn times(mut self, n: u32) -> Rule {
        self.times = Some(n);
        self
    }

    /// Lets the first `n` matches through untouched.
    pub fn skip(mut self, n: u32) -> Rule {
        self.skip = n;
        self
    }
}

#[cfg(feature = "fault-injection")]
mod registry {
    use super::{Fault, Rule, Site};
    use std::sync::Mutex;

    pub(super) struct Live {
        pub id: u64,
        pub rule: Rule,
        /// Matches so far (skipped ones included).
        pub seen: u32,
        /// Faults applied so far.
        pub fired: u32,
    }

    pub(super) static RULES: Mutex<Vec<Live>> = Mutex::new(Vec::new());
    pub(super) static NEXT: Mutex<u64> = Mutex::new(0);

    pub(super) fn hit(site: Site, path: &std::path::Path, offset: u64) -> Option<Fault> {
        let path = path.to_string_lossy();
        let mut rules = RULES.lock().unwrap_or_else(|e| e.into_inner());
        // The newest rule first: a narrow rule added over a broad one takes its hits.
        for l in rules.iter_mut().rev() {
            let r = &l.rule;
            if r.site != site || !path.contains(r.path.as_str()) || !r.offsets.contains(&offset) {
                continue;
            }
            l.seen += 1;
            if l.seen <= r.skip || r.times.is_some_and(|n| l.fired >= n) {
                continue;
            }
            l.fired += 1;
            return Some(r.fault);
        }
        None
    }
}

/// Removes its rule when dropped; counts how often it fired.
#[cfg(feature = "fault-injection")]
#[must_use = "the rule is removed when the guard is dropped"]
pub struct Injected {
    id: u64,
}

#[cfg(feature = "fault-injection")]
impl Injected {
    /// How many times the fault was applied so far.
    pub fn fired(&self) -> u32 {
        let rules = registry::RULES.lock().unwrap_or_else(|e| e.into_inner());
        rules
            .iter()
            .find(|l| l.id == self.id)
            .map_or(0, |l| l.fired)
    }
}

#[cfg(feature = "fault-injection")]
impl Drop for Injected {
    fn drop(&mut self) {
        let mut rules = registry::RULES.lock().unwrap_or_else(|e| e.into_inner());
        rules.retain(|l| l.id != self.id);
    }
}

/// Registers `rule` until the guard is dropped.
#[cfg(feature = "fault-injection")]
pub fn inject(rule: Rule) -> Injected {
    let id = {
        let mut n = registry::NEXT.lock().unwrap_or_else(|e| e.into_inner());
        *n += 1;
        *n
    };
    let mut rules = registry::RULES.lock().unwrap_or_else(|e| e.into_inner());
    rules.push(registry::Live {
        id,
        rule,
        seen: 0,
        fired: 0,
    });
    Injected { id }
}

/// The fault to apply at a hook of `site` on `path` (at file offset `offset`; 0
/// where there is none), if a rule says so.
#[cfg(feature = "fault-injection")]
pub(crate) fn hit(site: Site, path: &std::path::Path, offset: u64) -> Option<Fault> {
    registry::hit(site, path, offset)
}

/// Without the `fault-injection` feature no fault is ever injected.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn hit(_site: Site, _path: &std::path::Path, _offset: u64) -> Option<Fault> {
    None
}

/// A hook of an operation that either fails or goes on: the injected error (an
/// `errno` fault; a stall sleeps, then lets it go on).
#[inline(always)]
pub(crate) fn io_error(site: Site, path: &std::path::Path) -> std::io::Result<()> {
    match hit(site, path, 0) {
        Some(Fault::Errno(e)) => Err(std::io::Error::from_raw_os_error(e)),
        Some(Fault::Stall(d)) => {
            std::thread::sleep(d);
            Ok(())
        }
        _ => Ok(()),
    }
}
