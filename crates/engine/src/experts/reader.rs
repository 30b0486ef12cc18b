//! [`ExpertReader`]: whole experts read from the model file(s) on a thread of their
//! own, with a deadline, one retry, and a verdict per expert.
//!
//! A disk fails in three ways that matter to a server: a read fails (`EIO`: a bad
//! sector, a dying drive, a network filesystem that gave up), a read returns short
//! (continued by [`DirectReader`]), or a read stalls (a drive resetting, a hung
//! mount). The first two end with an error the kernel gives; the third may not end
//! for minutes, and a step waiting for it would hold up every request. So:
//!
//! - reads run on the reader's thread into a buffer the reader owns while they are
//!   in flight (a *staging* buffer, from the caller's allocator: plain aligned memory
//!   on the CPU, pinned memory for a GPU's copies); the caller waits at most
//!   [`ReadPolicy::deadline`]. Past it the caller gets [`ReadError::Stalled`] and goes
//!   on; the buffer stays with the thread until the kernel is done with it, so a late
//!   read never writes into memory someone else uses. While that read is out, every
//!   new read fails at once with [`ReadError::Stuck`] (requests that need the disk
//!   fail fast; those served from RAM or VRAM go on); when it comes back, reads
//!   resume by themselves.
//! - a read that fails is retried once, expert by expert, so one bad range costs only
//!   the experts in it: the others of the batch are served, and the failed ones are
//!   reported each with its file, offset and cause ([`Filled::expert`]).
//! - a file that changed since it was loaded ([`ReadError::Changed`]) fails every read
//!   from then on (a restart loads it as it is now).
//!
//! Every shard is opened when the reader is built, against the [`FileId`] the
//! [`ExpertIndex`] recorded when the model was loaded, so a file replaced in between
//! is refused, and one replaced later is still read as it was loaded (the open
//! descriptor keeps it).

use std::ops::Range;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::index::{ExpertIndex, MatrixLoc};
use super::io::{covering_span, AlignedBuf, DirectReader, ReadError, ReadRequest, ReaderOptions};

/// How long a step waits for an expert read when nothing else is said: far above
/// what a healthy NVMe drive or network filesystem takes for a few experts
/// (milliseconds), well below what a client waits for a token.
pub const DEFAULT_READ_DEADLINE: Duration = Duration::from_secs(10);

/// Memory expert reads land in: the reader's thread owns it while reads are in
/// flight, so it must be `Send`; it starts [`ALIGN`](super::io::ALIGN)-aligned.
pub trait Staging: Send + 'static {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl Staging for AlignedBuf {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
}

/// How an [`ExpertReader`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadPolicy {
    pub reader: ReaderOptions,
    /// How long a caller waits for one read of experts before it fails with
    /// [`ReadError::Stalled`].
    pub deadline: Duration,
}

impl Default for ReadPolicy {
    fn default() -> Self {
        ReadPolicy {
            reader: ReaderOptions::default(),
            deadline: DEFAULT_READ_DEADLINE,
        }
    }
}

/// What the reader has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReadCounters {
    /// Experts read (each once, however many tries it took), and their bytes.
    pub experts: u64,
    pub bytes: u64,
    /// Reads that failed and were tried again, expert by expert.
    pub retries: u64,
    /// Experts that could not be read (after the retry, or for a stall or a
    /// changed file).
    pub failed: u64,
    /// Reads that missed the deadline.
    pub stalls: u64,
}

/// Experts read into a staging buffer: each requested expert's gate, up and down
/// bytes, or why it could not be read.
pub struct Filled<S> {
    buf: S,
    experts: Vec<u32>,
    results: Vec<Result<[Range<usize>; 3], ReadError>>,
}

impl<S: Staging> Filled<S> {
    /// The experts asked for, in order.
    pub fn experts(&self) -> &[u32] {
        &self.experts
    }

    /// The `i`-th expert's gate, up and down bytes.
    pub fn expert(&self, i: usize) -> Result<[&[u8]; 3], &ReadError> {
        let r = self.ranges(i)?;
        let b = self.buf.bytes();
        Ok([&b[r[0].clone()], &b[r[1].clone()], &b[r[2].clone()]])
    }

    /// Where the `i`-th expert's gate, up and down bytes lie in the buffer (for
    /// copies that take the buffer and an offset).
    pub fn ranges(&self, i: usize) -> Result<&[Range<usize>; 3], &ReadError> {
        self.results[i].as_ref()
    }

    pub fn buf(&self) -> &S {
        &self.buf
    }

    /// The buffer, to hand back with [`ExpertReader::recycle`].
    pub fn into_buf(self) -> S {
        self.buf
    }
}

/// One read for the thread.
struct Job<S> {
    buf: S,
    /// Per expert: its matrices.
    locs: Vec<[MatrixLoc; 3]>,
}

/// What the thread did with a job.
struct Done<S> {
    buf: S,
    results: Vec<Result<[Range<usize>; 3], ReadError>>,
    retries: u64,
}

/// The read past its deadline: what it was, and when it was sent.
struct Outstanding {
    path: PathBuf,
    offset: u64,
    len: u64,
    since: Instant,
}

/// Reads whole experts on a thread of its own (see the module docs).
pub struct ExpertReader<S: Staging> {
    index: ExpertIndex,
    deadline: Duration,
    jobs: Option<mpsc::Sender<Job<S>>>,
    done: mpsc::Receiver<Done<S>>,
    thread: Option<std::thread::JoinHandle<()>>,
    alloc: Box<dyn FnMut(usize) -> Result<S, String> + Send>,
    spare: Vec<S>,
    outstanding: Option<Outstanding>,
    /// Set once a file is found changed: every later read fails with it.
    changed: Option<ReadError>,
    counters: ReadCounters,
}

/// Spare staging buffers kept for reuse.
const SPARE: usize = 2;

impl<S: Staging> ExpertReader<S> {
    /// Opens every shard of `index` (refusing one that is not the file the index
    /// was built from) and starts the reading thread. `alloc(n)` gives a staging
    /// buffer of at least `n` bytes.
    pub fn open(
        index: &ExpertIndex,
        policy: ReadPolicy,
        alloc: impl FnMut(usize) -> Result<S, String> + Send + 'static,
    ) -> Result<ExpertReader<S>, ReadError> {
        let mut readers = Vec::with_capacity(index.shard_paths().len());
        for (shard, path) in index.shard_paths().iter().enumerate() {
            readers.push(match index.shard_id(shard) {
                Some(id) => DirectReader::open_expecting(path, policy.reader, &id)?,
                None => DirectReader::with_options(path, policy.reader)?,
            });
        }
        let (jobs, rx) = mpsc::channel::<Job<S>>();
        let (tx, done) = mpsc::channel::<Done<S>>();
        let thread = std::thread::Builder::new()
            .name("expert-reader".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let d = run_job(&mut readers, job);
                    if tx.send(d).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| ReadError::Open {
                path: index.shard_paths().first().cloned().unwrap_or_default(),
                msg: format!("cannot start the reading thread: {e}"),
            })?;
        Ok(ExpertReader {
            index: index.clone(),
            deadline: policy.deadline,
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            alloc: Box::new(alloc),
            spare: Vec::new(),
            outstanding: None,
            changed: None,
            counters: ReadCounters::default(),
        })
    }

    pub fn index(&self) -> &ExpertIndex {
        &self.index
    }

    pub fn counters(&self) -> ReadCounters {
        self.counters
    }

    /// A fault that fails every read now: the file changed, or a read is still
    /// out past its deadline. `None` while reads work.
    pub fn standing_fault(&mut self) -> Option<ReadError> {
        self.collect_late();
        if let Some(e) = &self.changed {
            return Some(e.clone());
        }
        self.outstanding.as_ref().map(|o| self.stuck(o))
    }

    fn stuck(&self, o: &Outstanding) -> ReadError {
        ReadError::Stuck {
            path: o.path.clone(),
            offset: o.offset,
            len: o.len,
            waited_ms: o.since.elapsed().as_millis() as u64,
        }
    }

    /// Takes back the buffer of a read that missed its deadline, if it has come
    /// back since.
    fn collect_late(&mut self) {
        let Some(o) = &self.outstanding else { return };
        match self.done.try_recv() {
            Ok(d) => {
                tracing::warn!(
                    "{}: the expert read at offset {} that missed its deadline came back after {:.1} s; reads resume",
                    o.path.display(),
                    o.offset,
                    o.since.elapsed().as_secs_f64()
                );
                self.outstanding = None;
                self.note_changed(&d.results);
                self.recycle(d.buf);
            }
            Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => {}
        }
    }

    fn note_changed(&mut self, results: &[Result<[Range<usize>; 3], ReadError>]) {
        if self.changed.is_none() {
            if let Some(Err(e @ ReadError::Changed { .. })) = results
                .iter()
                .find(|r| matches!(r, Err(ReadError::Changed { .. })))
            {
                tracing::error!("{e}");
                self.changed = Some(e.clone());
            }
        }
    }

    /// Hands a buffer back for later reads.
    pub fn recycle(&mut self, buf: S) {
        if self.spare.len() < SPARE {
            self.spare.push(buf);
        }
    }

    /// Reads experts `experts` of block `layer` into one staging buffer. `Err`: no
    /// expert was read (a stall past the deadline, a read still out, a changed
    /// file, no buffer); `Ok`: each expert read or failed on its own (see
    /// [`Filled::expert`]).
    pub fn read(&mut self, layer: usize, experts: &[u32]) -> Result<Filled<S>, ReadError> {
        self.collect_late();
        if let Some(e) = &self.changed {
            return Err(e.clone());
        }
        if let Some(o) = &self.outstanding {
            return Err(self.stuck(o));
        }
        let first_path = || {
            self.index
                .shard_paths()
                .first()
                .cloned()
                .unwrap_or_default()
        };
        let mut locs = Vec::with_capacity(experts.len());
        for &e in experts {
            locs.push(
                self.index
                    .expert(layer, e as usize)
                    .ok_or_else(|| ReadError::Open {
                        path: first_path(),
                        msg: format!("block {layer} has no expert {e}"),
                    })?,
            );
        }
        let need: usize = locs
            .iter()
            .flatten()
            .map(|l| covering_span(l.offset, l.len as usize).len)
            .sum();
        let buf = match self.spare.iter().position(|b| b.bytes().len() >= need) {
            Some(i) => self.spare.swap_remove(i),
            None => (self.alloc)(need).map_err(|msg| ReadError::Open {
                path: first_path(),
                msg: format!("no staging buffer of {need} bytes: {msg}"),
            })?,
        };
        let head = locs.first().map(|l| l[0]);
        let t0 = Instant::now();
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|j| j.send(Job { buf, locs }).is_ok());
        let gone = || ReadError::Open {
            path: first_path(),
            msg: "the expert reading thread has ended".into(),
        };
        if !sent {
            return Err(gone());
        }
        match self.done.recv_timeout(self.deadline) {
            Ok(d) => {
                self.note_changed(&d.results);
                self.counters.retries += d.retries;
                for (r, &e) in d.results.iter().zip(experts) {
                    match r {
                        Ok(m) => {
                            self.counters.experts += 1;
                            self.counters.bytes += m.iter().map(|r| r.len() as u64).sum::<u64>();
                        }
                        Err(err) => {
                            self.counters.failed += 1;
                            tracing::error!("expert {e} of layer {layer}: {err}");
                        }
                    }
                }
                Ok(Filled {
                    buf: d.buf,
                    experts: experts.to_vec(),
                    results: d.results,
                })
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let (path, offset, len) = match head {
                    Some(l) => (
                        self.index
                            .shard_path(l.shard)
                            .map(|p| p.to_path_buf())
                            .unwrap_or_default(),
                        l.offset,
                        l.len,
                    ),
                    None => (first_path(), 0, 0),
                };
                self.counters.stalls += 1;
                self.counters.failed += experts.len() as u64;
                let err = ReadError::Stalled {
                    path: path.clone(),
                    offset,
                    len,
                    deadline_ms: self.deadline.as_millis() as u64,
                };
                tracing::error!("{err}");
                self.outstanding = Some(Outstanding {
                    path,
                    offset,
                    len,
                    since: t0,
                });
                Err(err)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(gone()),
        }
    }
}

impl<S: Staging> Drop for ExpertReader<S> {
    fn drop(&mut self) {
        self.jobs = None;
        // A thread waiting for a stalled read is left to finish on its own (it owns
        // everything it touches); an idle one ends at once.
        if self.outstanding.is_none() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// Reads one job on the reading thread: the matrices in shard order, each shard's
/// in one batch; a batch that fails is read again expert by expert, once.
fn run_job<S: Staging>(readers: &mut [DirectReader], job: Job<S>) -> Done<S> {
    let Job { mut buf, locs } = job;
    // (expert, matrix) in shard order, then expert order.
    let mut order: Vec<(usize, usize)> = (0..locs.len())
        .flat_map(|e| (0..3).map(move |m| (e, m)))
        .collect();
    order.sort_by_key(|&(e, m)| (locs[e][m].shard, e));
    let ranges: Vec<(u64, usize)> = order
        .iter()
        .map(|&(e, m)| (locs[e][m].offset, locs[e][m].len as usize))
        .collect();
    let mut results: Vec<Result<[Range<usize>; 3], ReadError>> =
        vec![Ok([0..0, 0..0, 0..0]); locs.len()];
    let mut retries = 0;
    let base = buf.bytes().as_ptr() as usize;
    let Some(mut reqs) = ReadRequest::carve(buf.bytes_mut(), &ranges) else {
        let err = ReadError::Open {
            path: PathBuf::new(),
            msg: "the staging buffer is too small or unaligned".into(),
        };
        results.iter_mut().for_each(|r| *r = Err(err.clone()));
        return Done {
            buf,
            results,
            retries,
        };
    };
    // Runs of one shard.
    let mut start = 0;
    while start < order.len() {
        let shard = locs[order[start].0][order[start].1].shard;
        let end = start
            + order[start..]
                .iter()
                .take_while(|&&(e, m)| locs[e][m].shard == shard)
                .count();
        let Some(reader) = readers.get_mut(shard) else {
            let err = ReadError::Open {
                path: PathBuf::new(),
                msg: format!("the model has no shard {shard}"),
            };
            for &(e, _) in &order[start..end] {
                results[e] = Err(err.clone());
            }
            start = end;
            continue;
        };
        if let Err(err) = reader.read_batch(&mut reqs[start..end]) {
            if !err.is_transient() {
                for &(e, _) in &order[start..end] {
                    results[e] = Err(err.clone());
                }
            } else {
                // Once more, expert by expert: only the experts whose bytes cannot be
                // read fail.
                tracing::warn!("{err}; reading its experts again, one by one");
                retries += 1;
                let mut i = start;
                while i < end {
                    let e = order[i].0;
                    let j = i + order[i..end].iter().take_while(|o| o.0 == e).count();
                    match reader.read_batch(&mut reqs[i..j]) {
                        Ok(()) => {}
                        Err(again) => {
                            results[e] = Err(match again {
                                ReadError::Read {
                                    path,
                                    offset,
                                    len,
                                    msg,
                                } => ReadError::Read {
                                    path,
                                    offset,
                                    len,
                                    msg: format!("{msg} (and again when retried)"),
                                },
                                other => other,
                            });
                        }
                    }
                    i = j;
                }
            }
        }
        start = end;
    }
    for (i, &(e, m)) in order.iter().enumerate() {
        if let Ok(r) = &mut results[e] {
            let d = reqs[i].data();
            let at = d.as_ptr() as usize - base;
            r[m] = at..at + d.len();
        }
    }
    drop(reqs);
    Done {
        buf,
        results,
        retries,
    }
}
