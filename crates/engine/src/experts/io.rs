//! Direct reads of expert bytes from the model file: `O_DIRECT` through io_uring.
//!
//! A miss that is not in RAM is read from the model file straight into a 4 KiB-aligned
//! host buffer (later: pinned CUDA memory), bypassing the page cache so that streaming
//! a model larger than RAM does not evict the pinned tier or the rest of the system.
//!
//! `O_DIRECT` needs the file offset, the length and the buffer address aligned to the
//! device's logical block size; [`ALIGN`] (4096) covers 512-byte and 4 KiB devices. An
//! expert matrix in a GGUF file starts at any multiple of the file's alignment (32 by
//! default), so each request reads its *covering span*: from `offset` rounded down to
//! 4096 to `offset + len` rounded up. That costs at most 4095 extra bytes before and
//! 4095 after each range (under 0.3% of a 3 MiB expert matrix); the caller's buffer must
//! hold the whole span ([`covering_span`]) and the requested bytes are the sub-slice
//! [`ReadRequest::data`].
//!
//! Fallbacks, each announced once per process with `tracing::warn!`:
//! - a filesystem that refuses `O_DIRECT` (tmpfs refuses it at open; some refuse the
//!   first read with `EINVAL`): buffered reads of the same spans;
//! - no io_uring (old kernel, seccomp, `kernel.io_uring_disabled`, no `IORING_OP_READ`):
//!   `pread`, one range after another.
//!
//! Whatever the path, a read either fills every requested byte or fails with one
//! [`ReadError`] naming the file, offset and length: short reads are continued,
//! `EINTR`/`EAGAIN` retried (a bounded number of times), and nothing partial or zeroed
//! is ever returned as success.
//!
//! A file that changes under a running server is not served as garbage: the reader
//! keeps the [`FileId`] (device, inode, size, modification time) of the file it
//! opened, and before and after every batch compares it with what the open file says
//! now; a file written in place or truncated fails every read with
//! [`ReadError::Changed`] (restart to load it). A file deleted or replaced by a new
//! one at its path (a rename over it) is no danger: the open descriptor still reads
//! the file that was loaded, and a warning says so once.
//!
//! Reads here wait as long as the kernel takes; the deadline for a stalled disk is
//! [`ExpertReader`](super::ExpertReader)'s, which runs these reads on a thread of its
//! own. With the `fault-injection` feature, every completed read passes through
//! [`crate::fault`] (site `ExpertRead`), which may turn it into an error, a short read,
//! the end of the file or a stall.

use std::alloc::Layout;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Alignment of file offsets, lengths and buffers for direct reads.
pub const ALIGN: usize = 4096;
/// Reads in flight at once through io_uring, unless configured otherwise.
pub const DEFAULT_QUEUE_DEPTH: u32 = 32;
/// The deepest queue accepted (io_uring itself takes up to 32768 entries; deeper than
/// this only costs memory for reads of megabytes each).
pub const MAX_QUEUE_DEPTH: u32 = 4096;
/// Largest single read submitted (a multiple of [`ALIGN`] that fits the u32 length of an
/// io_uring read and stays below Linux's 2 GiB per-call cap).
const MAX_PIECE: u64 = 1 << 30;
/// Consecutive `EINTR`/`EAGAIN` results one piece tolerates.
const MAX_RETRIES: u32 = 64;

/// A direct-read failure. Every message names the file and, for reads, the offset and
/// length of the range the caller asked for.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    #[error("{}: cannot open for expert reads: {msg}", path.display())]
    Open { path: PathBuf, msg: String },
    #[error("{}: reading {len} bytes at offset {offset}: {msg}", path.display())]
    Read {
        path: PathBuf,
        offset: u64,
        len: u64,
        msg: String,
    },
    /// The file is not the one loaded any more (written in place, truncated, or
    /// another file at its path): its bytes cannot be trusted.
    #[error(
        "{}: the model file changed while scoria was serving it ({what}); experts are not \
         read from it any more: restart scoria to load the file as it is now",
        path.display()
    )]
    Changed { path: PathBuf, what: String },
    /// A read did not come back within the deadline.
    #[error(
        "{}: reading {len} bytes at offset {offset}: no answer within the {:.1} s deadline \
         (the disk is stalled or failing: see the kernel log, `dmesg`)",
        path.display(), *deadline_ms as f64 / 1000.0
    )]
    Stalled {
        path: PathBuf,
        offset: u64,
        len: u64,
        deadline_ms: u64,
    },
    /// An earlier read is still outstanding past its deadline: no new read is
    /// started until it comes back.
    #[error(
        "{}: the read of {len} bytes at offset {offset} has not come back for {:.1} s; \
         experts that are only in the file cannot be read until it does (see the kernel \
         log, `dmesg`)",
        path.display(), *waited_ms as f64 / 1000.0
    )]
    Stuck {
        path: PathBuf,
        offset: u64,
        len: u64,
        waited_ms: u64,
    },
}

impl ReadError {
    /// Whether reading the same range again may succeed (a failed read, as opposed
    /// to a file that changed, a stall or a refusal before anything was read).
    pub fn is_transient(&self) -> bool {
        matches!(self, ReadError::Read { .. })
    }
}

/// Which file a path named when it was opened: enough to tell it was written to,
/// truncated or replaced since (the modification time changes with every write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    /// Modification time, in nanoseconds since the epoch.
    pub mtime_ns: i128,
}

impl FileId {
    pub fn of(m: &std::fs::Metadata) -> FileId {
        FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
        }
    }

    /// The identity of the file at `path` now.
    pub fn at(path: &Path) -> std::io::Result<FileId> {
        std::fs::metadata(path).map(|m| FileId::of(&m))
    }

    /// What differs from `was` (the same file, read from its open descriptor), in
    /// words; `None` when nothing that matters does.
    fn changed_since(&self, was: &FileId) -> Option<String> {
        if self.size != was.size {
            Some(format!(
                "its size went from {} to {} bytes",
                was.size, self.size
            ))
        } else if self.mtime_ns != was.mtime_ns {
            Some("it was written to after it was loaded".into())
        } else {
            None
        }
    }
}

/// The aligned part of the file a request reads: `len` bytes from `start`, the
/// requested bytes beginning `skip` bytes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub len: usize,
    pub skip: usize,
}

/// The 4 KiB-aligned span covering `len` bytes at `offset` (an empty span for `len` 0).
pub fn covering_span(offset: u64, len: usize) -> Span {
    if len == 0 {
        return Span {
            start: offset,
            len: 0,
            skip: 0,
        };
    }
    let a = ALIGN as u64;
    let start = offset / a * a;
    let end = (offset + len as u64).div_ceil(a) * a;
    Span {
        start,
        len: (end - start) as usize,
        skip: (offset - start) as usize,
    }
}

/// A zero-initialised heap buffer whose start is [`ALIGN`]-aligned and whose length is
/// a multiple of it: a destination for direct reads on the CPU and in tests (the expert
/// store passes pinned CUDA memory instead).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// At least `len` bytes (rounded up to a multiple of [`ALIGN`], at least one block).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let len = len.max(1).div_ceil(ALIGN) * ALIGN;
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        match std::ptr::NonNull::new(raw) {
            Some(ptr) => AlignedBuf { ptr, len },
            None => std::alloc::handle_alloc_error(layout),
        }
    }

    fn layout(len: usize) -> Layout {
        match Layout::from_size_align(len, ALIGN) {
            Ok(l) => l,
            Err(_) => panic!("AlignedBuf of {len} bytes exceeds the address space"),
        }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// One range to read: `len` bytes at file offset `offset`, into `dst`, which must start
/// [`ALIGN`]-aligned and hold at least `covering_span(offset, len).len` bytes.
pub struct ReadRequest<'a> {
    pub offset: u64,
    pub len: usize,
    dst: &'a mut [u8],
}

impl<'a> ReadRequest<'a> {
    pub fn new(offset: u64, len: usize, dst: &'a mut [u8]) -> ReadRequest<'a> {
        ReadRequest { offset, len, dst }
    }

    /// The requested bytes (after a successful [`DirectReader::read_batch`]).
    pub fn data(&self) -> &[u8] {
        let s = covering_span(self.offset, self.len);
        &self.dst[s.skip..s.skip + self.len]
    }

    /// The whole destination, span padding included.
    pub fn dst(&self) -> &[u8] {
        self.dst
    }

    /// Cuts `buf` (aligned) into one destination per `(offset, len)` range, each the
    /// size of its covering span; `None` when `buf` is unaligned or shorter than
    /// [`batch_bytes`]`(ranges)`.
    pub fn carve(buf: &'a mut [u8], ranges: &[(u64, usize)]) -> Option<Vec<ReadRequest<'a>>> {
        if !(buf.as_ptr() as usize).is_multiple_of(ALIGN) || buf.len() < batch_bytes(ranges) {
            return None;
        }
        let mut rest = buf;
        let mut out = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            let (dst, tail) =
                std::mem::take(&mut rest).split_at_mut(covering_span(offset, len).len);
            rest = tail;
            out.push(ReadRequest { offset, len, dst });
        }
        Some(out)
    }
}

/// Bytes of aligned buffer a batch of `(offset, len)` ranges needs (sum of the spans).
pub fn batch_bytes(ranges: &[(u64, usize)]) -> usize {
    ranges.iter().map(|&(o, l)| covering_span(o, l).len).sum()
}

/// How a [`DirectReader`] should read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaderOptions {
    /// Reads in flight at once through io_uring (1 to [`MAX_QUEUE_DEPTH`]).
    pub queue_depth: u32,
    /// Try io_uring (false: `pread`).
    pub io_uring: bool,
    /// Try `O_DIRECT` (false: buffered reads through the page cache).
    pub direct: bool,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            queue_depth: DEFAULT_QUEUE_DEPTH,
            io_uring: true,
            direct: true,
        }
    }
}

static WARNED_DIRECT: AtomicBool = AtomicBool::new(false);
static WARNED_URING: AtomicBool = AtomicBool::new(false);
/// The model file's path was deleted or now names another file (once per process).
static WARNED_MOVED: AtomicBool = AtomicBool::new(false);

fn warn_once(flag: &AtomicBool, msg: impl FnOnce() -> String) {
    if !flag.swap(true, Ordering::Relaxed) {
        tracing::warn!("{}", msg());
    }
}

/// One piece of one request in progress: file bytes `pos..end` go to
/// `dst[pos - span_start ..]`; the piece is complete once `pos >= need` (bytes past the
/// request's end are span padding, which may lie past the end of the file).
#[derive(Debug, Clone, Copy)]
struct Op {
    req: usize,
    span_start: u64,
    pos: u64,
    end: u64,
    need: u64,
    retries: u32,
}

/// Why a batch stopped.
enum RunError {
    Failed(ReadError),
    /// A direct read was refused with `EINVAL`: the filesystem does not do `O_DIRECT`.
    DirectRefused,
}

/// What one completed read means for its piece.
enum Outcome {
    Done,
    Again,
    Failed(String),
    /// `EINVAL` from a direct read: the filesystem refuses `O_DIRECT` for this file.
    DirectRefused,
}

/// Reads ranges of one file with `O_DIRECT` through io_uring (see the module docs).
pub struct DirectReader {
    path: PathBuf,
    file: File,
    size: u64,
    /// The open file's identity when it was opened (compared before and after each
    /// batch).
    id: FileId,
    direct: bool,
    depth: u32,
    #[cfg(target_os = "linux")]
    ring: Option<io_uring::IoUring>,
}

impl std::fmt::Debug for DirectReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectReader")
            .field("path", &self.path)
            .field("size", &self.size)
            .field("direct", &self.direct)
            .field("io_uring", &self.uses_io_uring())
            .field("queue_depth", &self.depth)
            .finish()
    }
}

fn open_file(path: &Path, direct: bool) -> std::io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

#[cfg(target_os = "linux")]
fn new_ring(depth: u32) -> std::io::Result<io_uring::IoUring> {
    let ring = io_uring::IoUring::new(depth)?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    if !probe.is_supported(io_uring::opcode::Read::CODE) {
        return Err(std::io::Error::other(
            "this kernel's io_uring has no IORING_OP_READ (Linux 5.6 or later has it)",
        ));
    }
    Ok(ring)
}

impl DirectReader {
    /// Opens `path` for reading with [`ReaderOptions::default`].
    pub fn open(path: &Path) -> Result<DirectReader, ReadError> {
        Self::with_options(path, ReaderOptions::default())
    }

    pub fn with_options(path: &Path, opts: ReaderOptions) -> Result<DirectReader, ReadError> {
        let open_err = |msg: String| ReadError::Open {
            path: path.to_path_buf(),
            msg,
        };
        if !(1..=MAX_QUEUE_DEPTH).contains(&opts.queue_depth) {
            return Err(open_err(format!(
                "the queue depth is {}, it must be 1 to {MAX_QUEUE_DEPTH}",
                opts.queue_depth
            )));
        }
        let (file, direct) = if opts.direct {
            match open_file(path, true) {
                Ok(f) => (f, true),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    warn_once(&WARNED_DIRECT, || {
                        format!(
                            "{}: the filesystem refuses O_DIRECT ({e}); expert reads go through the page cache",
                            path.display()
                        )
                    });
                    (
                        open_file(path, false).map_err(|e| open_err(e.to_string()))?,
                        false,
                    )
                }
                Err(e) => return Err(open_err(e.to_string())),
            }
        } else {
            (
                open_file(path, false).map_err(|e| open_err(e.to_string()))?,
                false,
            )
        };
        let id = FileId::of(
            &file
                .metadata()
                .map_err(|e| open_err(format!("cannot read its length: {e}")))?,
        );
        let size = id.size;
        #[cfg(target_os = "linux")]
        let ring = if opts.io_uring {
            match new_ring(opts.queue_depth) {
                Ok(r) => Some(r),
                Err(e) => {
                    warn_once(&WARNED_URING, || {
                        format!(
                            "io_uring is unavailable ({e}); expert reads use pread, one at a time"
                        )
                    });
                    None
                }
            }
        } else {
            None
        };
        Ok(DirectReader {
            path: path.to_path_buf(),
            file,
            size,
            id,
            direct,
            depth: opts.queue_depth,
            #[cfg(target_os = "linux")]
            ring,
        })
    }

    /// Opens `path` as [`DirectReader::with_options`] does, refusing a file that is
    /// not `expected` (the file as it was when the model was loaded: another file at
    /// the path, or the same file written since).
    pub fn open_expecting(
        path: &Path,
        opts: ReaderOptions,
        expected: &FileId,
    ) -> Result<DirectReader, ReadError> {
        let r = Self::with_options(path, opts)?;
        let changed = |what: String| ReadError::Changed {
            path: path.to_path_buf(),
            what,
        };
        if (r.id.dev, r.id.ino) != (expected.dev, expected.ino) {
            return Err(changed(
                "the path names another file than the one loaded (it was replaced)".into(),
            ));
        }
        if let Some(what) = r.id.changed_since(expected) {
            return Err(changed(what));
        }
        Ok(r)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The identity of the file this reader has open, as it was opened.
    pub fn file_id(&self) -> FileId {
        self.id
    }

    /// Refuses to read when the open file has changed since it was opened (see the
    /// module docs); warns once when its path was deleted or names another file,
    /// which the open descriptor does not notice.
    pub fn check_unchanged(&self) -> Result<(), ReadError> {
        let now = self.file.metadata().map_err(|e| ReadError::Changed {
            path: self.path.clone(),
            what: format!("its state cannot be read: {e}"),
        })?;
        if let Some(what) = FileId::of(&now).changed_since(&self.id) {
            return Err(ReadError::Changed {
                path: self.path.clone(),
                what,
            });
        }
        let at_path = FileId::at(&self.path);
        let moved = match &at_path {
            Ok(p) => (p.dev, p.ino) != (self.id.dev, self.id.ino),
            Err(_) => true,
        };
        if moved {
            warn_once(&WARNED_MOVED, || {
                format!(
                    "{}: the model file was deleted or replaced on disk; scoria keeps reading \
                     the file it loaded (still open, its space is freed when scoria exits); \
                     restart scoria to load the new one",
                    self.path.display()
                )
            });
        }
        Ok(())
    }

    /// Length of the file when it was opened.
    pub fn file_size(&self) -> u64 {
        self.size
    }

    /// Whether reads bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Whether reads go through io_uring (else `pread`).
    pub fn uses_io_uring(&self) -> bool {
        #[cfg(target_os = "linux")]
        {
            self.ring.is_some()
        }
        #[cfg(not(target_os = "linux"))]
        {
            false
        }
    }

    pub fn queue_depth(&self) -> u32 {
        self.depth
    }

    fn read_err(&self, r: &ReadRequest, msg: impl Into<String>) -> ReadError {
        ReadError::Read {
            path: self.path.clone(),
            offset: r.offset,
            len: r.len as u64,
            msg: msg.into(),
        }
    }

    /// Reads every request of `reqs`; on success each [`ReadRequest::data`] holds the
    /// file's bytes. On error nothing may be used (some destinations may be partly
    /// written), and the error names the first range that failed.
    pub fn read_batch(&mut self, reqs: &mut [ReadRequest]) -> Result<(), ReadError> {
        if reqs.is_empty() {
            return Ok(());
        }
        self.check_unchanged()?;
        self.read_unchecked(reqs)?;
        // A write during the reads may have torn them.
        self.check_unchanged()
    }

    fn read_unchecked(&mut self, reqs: &mut [ReadRequest]) -> Result<(), ReadError> {
        let mut ops = Vec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            let end = r.offset.checked_add(r.len as u64);
            if end.is_none_or(|e| e > self.size) {
                return Err(self.read_err(
                    r,
                    format!(
                        "the range ends past the end of the file ({} bytes)",
                        self.size
                    ),
                ));
            }
            let span = covering_span(r.offset, r.len);
            if !(r.dst.as_ptr() as usize).is_multiple_of(ALIGN) {
                return Err(self.read_err(
                    r,
                    format!("the destination buffer is not {ALIGN}-byte aligned"),
                ));
            }
            if r.dst.len() < span.len {
                return Err(self.read_err(
                    r,
                    format!(
                        "the destination holds {} bytes, the covering aligned span needs {}",
                        r.dst.len(),
                        span.len
                    ),
                ));
            }
            let need = r.offset + r.len as u64;
            let span_end = span.start + span.len as u64;
            let mut p = span.start;
            while p < need {
                let end = (p + MAX_PIECE).min(span_end);
                ops.push(Op {
                    req: i,
                    span_start: span.start,
                    pos: p,
                    end,
                    need: need.min(end),
                    retries: 0,
                });
                p = end;
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        match self.run(reqs, ops.clone()) {
            Ok(()) => Ok(()),
            Err(RunError::Failed(e)) => Err(e),
            Err(RunError::DirectRefused) => {
                // The filesystem accepted O_DIRECT at open but refuses the reads: read
                // the whole batch again through the page cache.
                warn_once(&WARNED_DIRECT, || {
                    format!(
                        "{}: the filesystem refuses O_DIRECT reads (EINVAL); expert reads go through the page cache",
                        self.path.display()
                    )
                });
                self.file = open_file(&self.path, false).map_err(|e| ReadError::Open {
                    path: self.path.clone(),
                    msg: e.to_string(),
                })?;
                self.direct = false;
                match self.run(reqs, ops) {
                    Ok(()) => Ok(()),
                    Err(RunError::Failed(e)) => Err(e),
                    // Not produced by a buffered reader (`settle` fails EINVAL then).
                    Err(RunError::DirectRefused) => {
                        Err(self.read_err(&reqs[0], "the filesystem refused the reads (EINVAL)"))
                    }
                }
            }
        }
    }

    /// Runs the pieces; `Err(None)` means a direct read was refused with `EINVAL`.
    fn run(&mut self, reqs: &mut [ReadRequest], ops: Vec<Op>) -> Result<(), RunError> {
        #[cfg(target_os = "linux")]
        if self.ring.is_some() {
            return self.run_uring(reqs, ops);
        }
        self.run_pread(reqs, ops)
    }

    fn run_pread(&mut self, reqs: &mut [ReadRequest], ops: Vec<Op>) -> Result<(), RunError> {
        for mut op in ops {
            loop {
                let r = &mut reqs[op.req];
                let from = (op.pos - op.span_start) as usize;
                let to = (op.end - op.span_start) as usize;
                let res = self
                    .file
                    .read_at(&mut r.dst[from..to], op.pos)
                    .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO));
                let res = injected(&self.path, self.direct, op.pos, res);
                match settle(self.direct, self.size, &mut op, res) {
                    Outcome::Done => break,
                    Outcome::Again => {}
                    Outcome::Failed(msg) => {
                        return Err(RunError::Failed(self.read_err(&reqs[op.req], msg)))
                    }
                    Outcome::DirectRefused => return Err(RunError::DirectRefused),
                }
            }
        }
        Ok(())
    }

    #[cfg(target_os = "linux")]
    fn run_uring(&mut self, reqs: &mut [ReadRequest], mut ops: Vec<Op>) -> Result<(), RunError> {
        use io_uring::{opcode, types};
        use std::os::fd::AsRawFd;

        let fd = types::Fd(self.file.as_raw_fd());
        let depth = self.depth as usize;
        // Destination base pointers, taken once: the kernel writes through them while
        // `reqs` stays mutably borrowed by this call, and this function does not return
        // before every submitted read has completed (see the drain below).
        let bases: Vec<*mut u8> = reqs.iter_mut().map(|r| r.dst.as_mut_ptr()).collect();
        let mut pending: std::collections::VecDeque<usize> = (0..ops.len()).collect();
        let mut in_flight = 0usize;
        let mut failure: Option<RunError> = None;
        let Some(ring) = self.ring.as_mut() else {
            return Err(RunError::Failed(
                self.read_err(&reqs[0], "internal: no io_uring"),
            ));
        };
        loop {
            while in_flight < depth && failure.is_none() {
                let Some(i) = pending.pop_front() else { break };
                let op = &ops[i];
                let from = (op.pos - op.span_start) as usize;
                let len = (op.end - op.pos) as u32;
                // SAFETY: from..from+len lies inside the request's destination (checked
                // against the span length in read_batch), which outlives the read.
                let buf = unsafe { bases[op.req].add(from) };
                let sqe = opcode::Read::new(fd, buf, len)
                    .offset(op.pos)
                    .build()
                    .user_data(i as u64);
                // SAFETY: the buffer stays valid until the completion is reaped below.
                // The queue holds `depth` entries and at most `depth` are in flight.
                if unsafe { ring.submission().push(&sqe) }.is_err() {
                    pending.push_front(i);
                    break;
                }
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                    ) => {}
                Err(e) => {
                    // Reads may be in flight into the caller's buffers and there is no way
                    // left to wait for them: returning (or unwinding) would let the kernel
                    // write into freed memory.
                    eprintln!(
                        "scoria: fatal: io_uring_enter failed with reads in flight on {}: {e}",
                        self.path.display()
                    );
                    std::process::abort();
                }
            }
            let done: Vec<(u64, i32)> = ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (id, res) in done {
                in_flight -= 1;
                let i = id as usize;
                let res = if res < 0 { Err(-res) } else { Ok(res as usize) };
                let mut op = ops[i];
                let res = injected(&self.path, self.direct, op.pos, res);
                let outcome = settle(self.direct, self.size, &mut op, res);
                ops[i] = op;
                match outcome {
                    Outcome::Done => {}
                    Outcome::Again => pending.push_front(i),
                    Outcome::Failed(msg) => {
                        if failure.is_none() {
                            failure = Some(RunError::Failed(ReadError::Read {
                                path: self.path.clone(),
                                offset: reqs[op.req].offset,
                                len: reqs[op.req].len as u64,
                                msg,
                            }));
                        }
                    }
                    Outcome::DirectRefused => {
                        if failure.is_none() {
                            failure = Some(RunError::DirectRefused);
                        }
                    }
                }
            }
        }
        match failure {
            Some(f) => Err(f),
            None => Ok(()),
        }
    }
}

/// A completed read's result as the fault-injection hook leaves it (unchanged
/// without the `fault-injection` feature): `pos` is the file offset it read at.
#[inline(always)]
fn injected(path: &Path, direct: bool, pos: u64, res: Result<usize, i32>) -> Result<usize, i32> {
    use crate::fault::{hit, Fault, Site};
    match hit(Site::ExpertRead, path, pos) {
        None => res,
        Some(Fault::Errno(e)) => Err(e),
        Some(Fault::Eof) => Ok(0),
        Some(Fault::Stall(d)) => {
            std::thread::sleep(d);
            res
        }
        Some(Fault::Short(n)) => res.map(|got| {
            // The bytes past `n` were read but are not reported: the reader must
            // ask for them again. A direct read stops at a block boundary.
            let n = if direct {
                (n / ALIGN * ALIGN).max(ALIGN)
            } else {
                n.max(1)
            };
            got.min(n)
        }),
    }
}

/// What a read result (`Ok(bytes)` or `Err(errno)`) means for `op`, advancing it;
/// `direct`: the file is open with `O_DIRECT`; `size`: its length at open.
fn settle(direct: bool, size: u64, op: &mut Op, res: Result<usize, i32>) -> Outcome {
    match res {
        Err(e) if e == libc::EINTR || e == libc::EAGAIN => {
            op.retries += 1;
            if op.retries > MAX_RETRIES {
                Outcome::Failed(format!(
                    "gave up after {MAX_RETRIES} retries: {}",
                    std::io::Error::from_raw_os_error(e)
                ))
            } else {
                Outcome::Again
            }
        }
        Err(e) if e == libc::EINVAL && direct => Outcome::DirectRefused,
        Err(e) => Outcome::Failed(format!(
            "at file offset {}: {}",
            op.pos,
            std::io::Error::from_raw_os_error(e)
        )),
        Ok(0) => Outcome::Failed(format!(
            "the file ends at byte {} (it was {size} bytes when opened: truncated while in use?)",
            op.pos
        )),
        Ok(n) => {
            let reached = op.pos + n as u64;
            if reached >= op.need {
                return Outcome::Done;
            }
            if direct && !reached.is_multiple_of(ALIGN as u64) {
                // A direct read ends unaligned only at the end of the file.
                return Outcome::Failed(format!(
                    "the file ends at byte {reached} (it was {size} bytes when opened: truncated while in use?)"
                ));
            }
            // A short read: continue where it stopped (aligned, for a direct read).
            op.pos = reached;
            op.retries = 0;
            Outcome::Again
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covering_spans() {
        assert_eq!(
            covering_span(4095, 2),
            Span {
                start: 0,
                len: 8192,
                skip: 4095
            }
        );
        assert_eq!(
            covering_span(8192, 4096),
            Span {
                start: 8192,
                len: 4096,
                skip: 0
            }
        );
        assert_eq!(covering_span(100, 0).len, 0);
        assert_eq!(batch_bytes(&[(1, 1), (4096, 4097)]), 4096 + 8192);
        let mut b = AlignedBuf::zeroed(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_ptr() as usize % ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
        let reqs = ReadRequest::carve(&mut b, &[(10, 100), (5000, 10)]).unwrap();
        assert_eq!(reqs.len(), 2);
        assert_eq!(reqs[1].dst().as_ptr() as usize % ALIGN, 0);
        assert!(ReadRequest::carve(&mut b, &[(10, 10_000)]).is_none());
        assert!(ReadRequest::carve(&mut b[1..], &[(0, 1)]).is_none());
    }

    fn op(pos: u64, need: u64) -> Op {
        Op {
            req: 0,
            span_start: 0,
            pos,
            end: need.div_ceil(4096) * 4096,
            need,
            retries: 0,
        }
    }

    fn failed(o: Outcome) -> String {
        match o {
            Outcome::Failed(m) => m,
            _ => panic!("expected a failure"),
        }
    }

    #[test]
    fn interrupted_reads_are_retried_a_bounded_number_of_times() {
        let mut o = op(0, 10_000);
        for _ in 0..MAX_RETRIES {
            assert!(matches!(
                settle(true, 1 << 20, &mut o, Err(libc::EINTR)),
                Outcome::Again
            ));
        }
        let m = failed(settle(true, 1 << 20, &mut o, Err(libc::EAGAIN)));
        assert!(m.contains("gave up after"), "{m}");
    }

    #[test]
    fn short_reads_continue_from_an_aligned_position() {
        // Direct: 8192 of 12000 bytes read → continue at 8192, then finish.
        let mut o = op(0, 12_000);
        assert!(matches!(
            settle(true, 1 << 20, &mut o, Ok(8192)),
            Outcome::Again
        ));
        assert_eq!(o.pos, 8192);
        assert!(matches!(
            settle(true, 1 << 20, &mut o, Ok(4096)),
            Outcome::Done
        ));
        // Buffered: continue exactly where the read stopped.
        let mut o = op(0, 12_000);
        assert!(matches!(
            settle(false, 1 << 20, &mut o, Ok(5000)),
            Outcome::Again
        ));
        assert_eq!(o.pos, 5000);
        // A direct read that ends unaligned before the data does: the file ended.
        let mut o = op(0, 12_000);
        let m = failed(settle(true, 1 << 20, &mut o, Ok(5000)));
        assert!(m.contains("the file ends at byte 5000"), "{m}");
        // End of file (0 bytes) before the data ends.
        let mut o = op(4096, 12_000);
        let m = failed(settle(false, 1 << 20, &mut o, Ok(0)));
        assert!(m.contains("the file ends at byte 4096"), "{m}");
        // A direct read past the data's end but short of the span's (the end of the
        // file lies inside the last block) is complete.
        let mut o = op(0, 12_000);
        assert!(matches!(
            settle(true, 12_000, &mut o, Ok(12_000)),
            Outcome::Done
        ));
    }

    #[test]
    fn errors_name_the_offset_and_einval_means_no_o_direct() {
        let mut o = op(8192, 10_000);
        let m = failed(settle(true, 1 << 20, &mut o, Err(libc::EIO)));
        assert!(m.contains("at file offset 8192"), "{m}");
        assert!(matches!(
            settle(true, 1 << 20, &mut o, Err(libc::EINVAL)),
            Outcome::DirectRefused
        ));
        assert!(matches!(
            settle(false, 1 << 20, &mut o, Err(libc::EINVAL)),
            Outcome::Failed(_)
        ));
    }
}
