//! The prompt cache: snapshots of sequence state keyed by the tokens that made
//! them, so a conversation resent with a new turn appended resumes from the longest
//! prefix some earlier request already computed instead of from position 0.
//!
//! A hit restores a snapshot (`Executor::restore`) and runs only the rest of the
//! prompt; since a snapshot holds copied, not recomputed, values, the result is the
//! cold run's bits. What prefix of an entry is usable depends on the model:
//! - attention-only models (snapshots without recurrent state) can restore any prefix
//!   of an entry's positions, so the usable length is the common prefix of the entry's
//!   tokens and the prompt;
//! - models with DeltaNet layers can only resume exactly at the entry's position
//!   (their recurrent state cannot be rewound), so an entry is usable only when all of
//!   its tokens are a prefix of the prompt.
//!
//! At least one prompt token is always left to run: its step yields the logits the
//! next token is sampled from.
//!
//! Entries are few (each holds the K/V of a whole conversation, megabytes to
//! gigabytes) so lookups scan them all. The store keeps within a byte budget by
//! dropping the least recently used entries, and can be saved to and loaded from a
//! directory (one file per entry) so a restarted server resumes warm.
//!
//! The directory is a convenience, never a condition of serving:
//! - an entry is written to a temporary name, fsynced, renamed into place and the
//!   directory fsynced, so a crash or `SIGKILL` at any point leaves either the whole
//!   entry or none; a restart removes the temporaries a dead writer left;
//! - a file that cannot be used — corrupt or truncated (its SHA-256 does not match),
//!   another model's, another format version's, or written by another scoria
//!   version (whose kernels may give other bits) — is skipped with a warning naming
//!   it and why, and never loaded;
//! - a full disk, a read-only directory or any other write failure is logged once
//!   (with the remedy) and again only when writes work again; the conversations
//!   stay cached in memory ([`Writer::status`] says how the directory fares).

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::exec::{LayerKv, RecurrentState, SeqSnapshot};

/// What went wrong storing or saving an entry.
#[derive(Debug, thiserror::Error)]
pub enum PromptCacheError {
    #[error(
        "a prompt-cache entry's snapshot must hold K/V of all its {tokens} tokens \
         (it was taken at position {pos} with K/V of {kv_pos}): take it with \
         Executor::snapshot after feeding exactly those tokens"
    )]
    Mismatch {
        tokens: usize,
        pos: usize,
        kv_pos: usize,
    },
    #[error("prompt cache directory {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// One stored snapshot.
struct Entry {
    id: u64,
    tokens: Arc<[u32]>,
    snap: Arc<SeqSnapshot>,
    /// Snapshot arrays plus tokens.
    bytes: usize,
    /// Value of the store's clock when last inserted or hit.
    used: u64,
}

/// A lookup's answer: restore `snapshot` up to `matched` positions (the prompt's
/// first `matched` tokens), then run the rest of the prompt from there.
#[derive(Debug, Clone)]
pub struct Hit {
    /// The entry (for [`PromptCache::remove`]); ids are never reused.
    pub id: u64,
    pub matched: usize,
    pub snapshot: Arc<SeqSnapshot>,
}

/// Counters for /metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// Lookups that found a usable prefix.
    pub hits: u64,
    /// Lookups that found none.
    pub misses: u64,
    /// Sum of the matched lengths of hits: prompt tokens not recomputed.
    pub tokens_reused: u64,
    /// Entries dropped to stay within the budget (not counting replaced or removed ones).
    pub evictions: u64,
    /// Entries stored now.
    pub entries: usize,
    /// Bytes they hold.
    pub bytes: usize,
    /// The byte budget.
    pub budget: usize,
}

/// What `load_dir` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Files read into the store (some may have been evicted again by the budget).
    pub loaded: usize,
    /// Files skipped (another model's, another format or scoria version, corrupt,
    /// unreadable); each is named in a warning.
    pub skipped: usize,
    /// The skipped files and why each was skipped.
    pub skipped_files: Vec<(PathBuf, String)>,
    /// Temporary files of interrupted writes removed.
    pub temporaries_removed: usize,
}

/// The store; see the module doc.
pub struct PromptCache {
    budget: usize,
    entries: Vec<Entry>,
    next_id: u64,
    clock: u64,
    stats: CacheStats,
}

/// The longest common prefix of two token lists.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PromptCache {
    /// An empty store that holds at most `budget` bytes of entries.
    pub fn new(budget: usize) -> PromptCache {
        PromptCache {
            budget,
            entries: Vec::new(),
            next_id: 0,
            clock: 0,
            stats: CacheStats {
                budget,
                ..Default::default()
            },
        }
    }

    /// The counters, with the current entries and bytes.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            entries: self.entries.len(),
            bytes: self.bytes(),
            ..self.stats
        }
    }

    /// Bytes the entries hold.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// How many of `prompt`'s tokens entry `e` can stand in for (0: none).
    fn usable(e: &Entry, prompt: &[u32]) -> usize {
        // One token is always left to run (module doc).
        let limit = prompt.len().saturating_sub(1);
        if e.snap.rewindable() {
            common_prefix(&e.tokens, prompt).min(limit)
        } else if e.tokens.len() <= limit && prompt.starts_with(&e.tokens) {
            e.tokens.len()
        } else {
            0
        }
    }

    /// How many tokens of `prompt` the best entry covers (0: none), without
    /// counting a use.
    pub fn peek(&self, prompt: &[u32]) -> usize {
        self.entries
            .iter()
            .map(|e| Self::usable(e, prompt))
            .max()
            .unwrap_or(0)
    }

    /// The entry covering the longest usable prefix of `prompt` (the most recently
    /// used of equals), marked as just used; `None` when no entry covers a token.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Hit> {
        let best = self
            .entries
            .iter_mut()
            .map(|e| (Self::usable(e, prompt), e))
            .filter(|(n, _)| *n > 0)
            .max_by_key(|(n, e)| (*n, e.used));
        match best {
            Some((matched, e)) => {
                self.clock += 1;
                e.used = self.clock;
                self.stats.hits += 1;
                self.stats.tokens_reused += matched as u64;
                Some(Hit {
                    id: e.id,
                    matched,
                    snapshot: e.snap.clone(),
                })
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// The snapshot of entry `id`, if still stored (does not count as a use).
    pub fn get(&self, id: u64) -> Option<Arc<SeqSnapshot>> {
        self.entries
            .iter()
            .find(|e| e.id == id)
            .map(|e| e.snap.clone())
    }

    /// Drops entry `id`; whether it was stored.
    pub fn remove(&mut self, id: u64) -> bool {
        let n = self.entries.len();
        self.entries.retain(|e| e.id != id);
        self.entries.len() != n
    }

    /// Stores `snap`, the state after feeding `tokens` (taken with
    /// `Executor::snapshot` at position `tokens.len()`), as the most recently used
    /// entry, replacing an entry of the same tokens and evicting the least recently
    /// used ones until the store fits its budget. Returns the new entry's id, or
    /// `None` when the entry alone is larger than the budget (it is not kept).
    pub fn insert(
        &mut self,
        tokens: Vec<u32>,
        snap: impl Into<Arc<SeqSnapshot>>,
    ) -> Result<Option<u64>, PromptCacheError> {
        let snap = snap.into();
        if snap.pos != tokens.len() || snap.kv_pos != snap.pos {
            return Err(PromptCacheError::Mismatch {
                tokens: tokens.len(),
                pos: snap.pos,
                kv_pos: snap.kv_pos,
            });
        }
        self.entries.retain(|e| *e.tokens != *tokens);
        let bytes = snap.bytes() + tokens.len() * 4;
        if bytes > self.budget {
            return Ok(None);
        }
        let mut total = self.bytes();
        while total + bytes > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            total -= self.entries.swap_remove(oldest).bytes;
            self.stats.evictions += 1;
        }
        self.clock += 1;
        let id = self.next_id;
        self.next_id += 1;
        self.entries.push(Entry {
            id,
            tokens: tokens.into(),
            snap,
            bytes,
            used: self.clock,
        });
        Ok(Some(id))
    }

    /// Writes every entry to `dir` (created if missing) as one file each, named by a
    /// hash of `model` and its tokens, and deletes the files of `model` whose entries
    /// are gone, so the directory mirrors the store. Files already there are not
    /// rewritten (same name: same model and tokens, so the same state). Each file is
    /// written to a temporary name and renamed, so a crash leaves no partial entry.
    /// Returns the number of files written.
    pub fn save_dir(&self, dir: &Path, model: &str) -> Result<usize, PromptCacheError> {
        save_entries(dir, model, &self.contents())
    }

    /// The entries' tokens and snapshots (shared, not copied): what [`save_dir`]
    /// writes, for a [`Writer`] to write away from the caller's thread.
    ///
    /// [`save_dir`]: PromptCache::save_dir
    pub fn contents(&self) -> Vec<(Arc<[u32]>, Arc<SeqSnapshot>)> {
        self.entries
            .iter()
            .map(|e| (e.tokens.clone(), e.snap.clone()))
            .collect()
    }

    /// Reads the entry files of `model` in `dir` into the store, oldest file first
    /// (so the newest end up most recently used), within the budget. A file of another
    /// model or format version, or a corrupt or unreadable one, is skipped with a
    /// warning naming it and why. A missing directory holds nothing.
    pub fn load_dir(&mut self, dir: &Path, model: &str) -> Result<LoadReport, PromptCacheError> {
        let mut report = LoadReport {
            temporaries_removed: remove_stale_temporaries(dir),
            ..LoadReport::default()
        };
        let listing = match fs::read_dir(dir) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(report),
            Err(source) => {
                return Err(PromptCacheError::Io {
                    path: dir.to_path_buf(),
                    source,
                })
            }
        };
        let mut files: Vec<(std::time::SystemTime, PathBuf)> = listing
            .filter_map(|f| f.ok())
            .map(|f| f.path())
            .filter(|p| p.extension().is_some_and(|x| x == &EXT[1..]))
            .map(|p| {
                let t = fs::metadata(&p)
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                (t, p)
            })
            .collect();
        files.sort();
        for (_, path) in files {
            let read = crate::fault::io_error(crate::fault::Site::CacheRead, &path)
                .and_then(|()| fs::read(&path))
                .map_err(|e| format!("cannot read it: {e}"))
                .and_then(|bytes| parse_file(&bytes, model));
            let stored = read
                .and_then(|(tokens, snap)| self.insert(tokens, snap).map_err(|e| e.to_string()));
            match stored {
                Ok(_) => report.loaded += 1,
                Err(why) => {
                    tracing::warn!(
                        "prompt cache: skipping {}: {why} (it is not loaded; a save removes \
                         it when it is this model's)",
                        path.display()
                    );
                    report.skipped += 1;
                    report.skipped_files.push((path, why));
                }
            }
        }
        Ok(report)
    }
}

/// [`PromptCache::save_dir`] over a store's [`PromptCache::contents`]: first the
/// files of entries that are gone are removed (which frees room on a full disk),
/// then the new entries are written, each to a temporary name, fsynced and renamed
/// into place, the directory fsynced after. Stops at the first failure.
fn save_entries(
    dir: &Path,
    model: &str,
    entries: &[(Arc<[u32]>, Arc<SeqSnapshot>)],
) -> Result<usize, PromptCacheError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PromptCacheError::Io { path, source }
    };
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let prefix = model_prefix(model);
    let keep: std::collections::HashSet<String> = entries
        .iter()
        .map(|(tokens, _)| file_name(model, tokens))
        .collect();
    for f in fs::read_dir(dir).map_err(io_err(dir))? {
        let f = f.map_err(io_err(dir))?;
        let name = f.file_name().to_string_lossy().into_owned();
        if name.starts_with(&prefix) && name.ends_with(EXT) && !keep.contains(&name) {
            fs::remove_file(f.path()).map_err(io_err(&f.path()))?;
        }
    }
    let mut written = 0;
    for (tokens, snap) in entries {
        let name = file_name(model, tokens);
        let path = dir.join(&name);
        if path.exists() {
            continue;
        }
        let tmp = dir.join(format!(".{name}{TMP}{}", std::process::id()));
        let res = write_file(&tmp, model, tokens, snap).and_then(|()| fs::rename(&tmp, &path));
        if let Err(err) = res {
            // Best effort: the temporary file is garbage either way (and a restart
            // removes it if this fails too).
            let _ = fs::remove_file(&tmp);
            return Err(io_err(&path)(err));
        }
        written += 1;
    }
    if written > 0 {
        // The renames are durable once the directory is. Best effort: some
        // filesystems refuse to fsync a directory, and the entries are whole either
        // way (a crash before this loses a rename, never half a file).
        if let Err(e) = fs::File::open(dir).and_then(|d| d.sync_all()) {
            tracing::debug!("prompt cache: fsync of {}: {e}", dir.display());
        }
    }
    Ok(written)
}

/// What follows an entry file's name in its temporary name, before the writer's
/// process id.
const TMP: &str = ".tmp-";

/// Removes the temporary files in `dir` that no live writer is writing: those of
/// a process that is gone, and this process's own (none is written before the
/// cache is loaded; a restarted container may reuse the crashed one's id). Returns
/// how many it removed.
fn remove_stale_temporaries(dir: &Path) -> usize {
    let Ok(listing) = fs::read_dir(dir) else {
        return 0;
    };
    let me = std::process::id();
    let mut removed = 0;
    for f in listing.filter_map(Result::ok) {
        let name = f.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix('.')
            .and_then(|n| n.rsplit_once(TMP))
            .filter(|(entry, _)| entry.ends_with(EXT))
            .and_then(|(_, pid)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != me && process_alive(pid) {
            continue;
        }
        match fs::remove_file(f.path()) {
            Ok(()) => {
                tracing::info!(
                    "prompt cache: removed {}, left by an interrupted write",
                    f.path().display()
                );
                removed += 1;
            }
            Err(e) => tracing::warn!(
                "prompt cache: cannot remove {} (left by an interrupted write): {e}",
                f.path().display()
            ),
        }
    }
    removed
}

/// Whether process `pid` exists (signal 0 checks without sending anything).
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// How a [`Writer`]'s directory fares.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct WriterStatus {
    /// Saves that wrote or removed what they had to.
    pub saves: u64,
    /// Entry files written.
    pub files_written: u64,
    /// Saves that failed.
    pub failures: u64,
    /// Why the last save failed, while the directory is failing (`None` once a
    /// save works again).
    pub failing: Option<String>,
}

enum WriterJob {
    Save(Vec<(Arc<[u32]>, Arc<SeqSnapshot>)>),
    Flush(std::sync::mpsc::Sender<()>),
}

/// Mirrors a store into its directory on a thread of its own, so a conversation
/// put into the cache (up to gigabytes of K/V) does not hold up the slots that
/// are decoding. Only the newest contents matter: a save still queued when a newer
/// one arrives is skipped. Dropping the writer finishes the queued save.
pub struct Writer {
    tx: Option<std::sync::mpsc::Sender<WriterJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
    status: Arc<std::sync::Mutex<WriterStatus>>,
}

impl Writer {
    /// Starts the thread that writes `model`'s entries into `dir`.
    pub fn new(dir: PathBuf, model: String) -> Writer {
        let (tx, rx) = std::sync::mpsc::channel::<WriterJob>();
        let status = Arc::new(std::sync::Mutex::new(WriterStatus::default()));
        let shared = status.clone();
        let thread = std::thread::Builder::new()
            .name("prompt-cache-writer".into())
            .spawn(move || {
                while let Ok(mut job) = rx.recv() {
                    // Skip to the newest save (acknowledging flushes on the way
                    // only after it is written).
                    let mut flushes = Vec::new();
                    while let Ok(next) = rx.try_recv() {
                        match next {
                            WriterJob::Flush(ack) => flushes.push(ack),
                            save => job = save,
                        }
                    }
                    match job {
                        WriterJob::Save(entries) => {
                            let t0 = std::time::Instant::now();
                            let r = save_entries(&dir, &model, &entries);
                            let mut st = shared.lock().unwrap_or_else(|e| e.into_inner());
                            match r {
                                Ok(n) => {
                                    if n > 0 {
                                        tracing::debug!(
                                            "prompt cache: wrote {n} file(s) to {} in {:.2} s",
                                            dir.display(),
                                            t0.elapsed().as_secs_f64()
                                        );
                                    }
                                    if st.failing.take().is_some() {
                                        tracing::info!(
                                            "prompt cache: writing to {} works again",
                                            dir.display()
                                        );
                                    }
                                    st.saves += 1;
                                    st.files_written += n as u64;
                                }
                                Err(e) => {
                                    // Once per failing spell: a save follows every
                                    // request that leaves a conversation behind.
                                    let msg = e.to_string();
                                    if st.failing.is_none() {
                                        tracing::warn!(
                                            "prompt cache: {msg}; conversations stay cached in memory \
                                             but are not saved to {} until writing works again \
                                             (free space there, or make it writable)",
                                            dir.display()
                                        );
                                    } else {
                                        tracing::debug!("prompt cache: {msg}");
                                    }
                                    st.failures += 1;
                                    st.failing = Some(msg);
                                }
                            }
                        }
                        WriterJob::Flush(ack) => flushes.push(ack),
                    }
                    for ack in flushes {
                        let _ = ack.send(());
                    }
                }
            })
            .ok();
        if thread.is_none() {
            tracing::warn!("prompt cache: no writer thread; the cache stays in memory");
        }
        Writer {
            tx: thread.as_ref().map(|_| tx),
            thread,
            status,
        }
    }

    /// How the directory fares: saves, files written, failures, and why the last
    /// save failed while writes fail.
    pub fn status(&self) -> WriterStatus {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Queues writing `entries` (a store's [`PromptCache::contents`]).
    pub fn save(&self, entries: Vec<(Arc<[u32]>, Arc<SeqSnapshot>)>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(WriterJob::Save(entries));
        }
    }

    /// Waits until every save queued so far is on disk.
    pub fn flush(&self) {
        if let Some(tx) = &self.tx {
            let (ack, done) = std::sync::mpsc::channel();
            if tx.send(WriterJob::Flush(ack)).is_ok() {
                let _ = done.recv();
            }
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Entry file extension.
const EXT: &str = ".pcache";
/// First bytes of an entry file.
const MAGIC: &[u8; 8] = b"SCORIAPC";
/// Entry file format version; files of another version are skipped.
const VERSION: u32 = 2;
/// The scoria that writes and reads entries here; files another one wrote are
/// skipped (another build's kernels may give other bits, and a hit must give the
/// cold run's).
const WRITER: &str = concat!("scoria ", env!("CARGO_PKG_VERSION"));

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// File names of `model`'s entries start with this.
fn model_prefix(model: &str) -> String {
    format!("{}-", hex(&Sha256::digest(model.as_bytes())[..6]))
}

/// The entry file of `model` and `tokens`.
fn file_name(model: &str, tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    h.update((model.len() as u64).to_le_bytes());
    h.update(model.as_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    format!("{}{}{EXT}", model_prefix(model), hex(&h.finalize()[..12]))
}

/// A writer that hashes what it writes (to the file at `path`).
struct Hashed<'a, W: Write> {
    w: W,
    h: Sha256,
    path: &'a Path,
}

impl<W: Write> Hashed<'_, W> {
    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        crate::fault::io_error(crate::fault::Site::CacheWrite, self.path)?;
        self.h.update(b);
        self.w.write_all(b)
    }
    fn u32(&mut self, x: u32) -> io::Result<()> {
        self.put(&x.to_le_bytes())
    }
    fn u64(&mut self, x: usize) -> io::Result<()> {
        self.put(&(x as u64).to_le_bytes())
    }
    fn f32s(&mut self, xs: &[f32]) -> io::Result<()> {
        self.u64(xs.len())?;
        let mut buf = Vec::with_capacity(4096 * 4);
        for c in xs.chunks(4096) {
            buf.clear();
            for x in c {
                buf.extend_from_slice(&x.to_le_bytes());
            }
            self.put(&buf)?;
        }
        Ok(())
    }
}

/// Entry file layout (little-endian): magic, version u32, the writing scoria (u32
/// length, UTF-8), model id (u32 length, UTF-8), tokens (u64 count, u32 each), pos
/// u64, kv_pos u64, attention layers (u32 count; K then V, each a u64 count and
/// f32s), DeltaNet layers (u32 count; conv then ssm likewise), then the SHA-256 of
/// everything before it. Written to `path` (a temporary name) and fsynced.
fn write_file(path: &Path, model: &str, tokens: &[u32], snap: &SeqSnapshot) -> io::Result<()> {
    crate::fault::io_error(crate::fault::Site::CacheCreate, path)?;
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    let mut w = Hashed {
        w: io::BufWriter::new(file),
        h: Sha256::new(),
        path,
    };
    w.put(MAGIC)?;
    w.u32(VERSION)?;
    w.u32(WRITER.len() as u32)?;
    w.put(WRITER.as_bytes())?;
    w.u32(model.len() as u32)?;
    w.put(model.as_bytes())?;
    w.u64(tokens.len())?;
    for &t in tokens {
        w.u32(t)?;
    }
    w.u64(snap.pos)?;
    w.u64(snap.kv_pos)?;
    w.u32(snap.kv.len() as u32)?;
    for l in &snap.kv {
        w.f32s(&l.k)?;
        w.f32s(&l.v)?;
    }
    w.u32(snap.recurrent.len() as u32)?;
    for r in &snap.recurrent {
        w.f32s(&r.conv)?;
        w.f32s(&r.ssm)?;
    }
    let Hashed { w: mut out, h, .. } = w;
    out.write_all(&h.finalize())?;
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()
}

/// A bounds-checked reader over a file's bytes.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.b.len() {
            return Err("it is truncated".into());
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<usize, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        usize::try_from(u64::from_le_bytes(a)).map_err(|_| "a length is out of range".to_string())
    }
    /// A count of `size`-byte items, checked against the bytes left before anything
    /// is allocated for them.
    fn count(&mut self, size: usize) -> Result<usize, String> {
        let n = self.u64()?;
        if n.checked_mul(size).is_none_or(|b| b > self.b.len()) {
            return Err("a length runs past the end of the file".into());
        }
        Ok(n)
    }
    fn f32s(&mut self) -> Result<Vec<f32>, String> {
        let n = self.count(4)?;
        Ok(self
            .take(n * 4)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Reads an entry file of `model`; the error says why it is unusable.
fn parse_file(bytes: &[u8], model: &str) -> Result<(Vec<u32>, SeqSnapshot), String> {
    let mut r = Reader { b: bytes };
    if r.take(MAGIC.len()).ok() != Some(&MAGIC[..]) {
        return Err("it is not a prompt-cache entry".into());
    }
    let version = r.u32()?;
    if version != VERSION {
        return Err(format!(
            "it has format version {version}, this build reads {VERSION}"
        ));
    }
    let n = r.u32()? as usize;
    let writer = r.take(n)?;
    let n = r.u32()? as usize;
    let id = r.take(n)?;
    // The checksum first: a corrupt header is a corrupt file, not another model's.
    if bytes.len() < 32 + MAGIC.len() {
        return Err("it is truncated".into());
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    if Sha256::digest(body)[..] != sum[..] {
        return Err("its checksum does not match (corrupt or truncated)".into());
    }
    if writer != WRITER.as_bytes() {
        return Err(format!(
            "it was written by {:?}, this is {WRITER:?} (another build's kernels may give other bits)",
            String::from_utf8_lossy(writer)
        ));
    }
    if id != model.as_bytes() {
        return Err(format!(
            "it was written for model {:?}, not {model:?}",
            String::from_utf8_lossy(id)
        ));
    }
    // The checksum is the last 32 bytes.
    if r.b.len() < 32 {
        return Err("it is truncated".into());
    }
    r.b = &r.b[..r.b.len() - 32];
    let n_tok = r.count(4)?;
    let tokens = r
        .take(n_tok * 4)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let pos = r.u64()?;
    let kv_pos = r.u64()?;
    let n_kv = r.u32()?;
    let mut kv = Vec::new();
    for _ in 0..n_kv {
        let k = r.f32s()?;
        let v = r.f32s()?;
        kv.push(LayerKv { k, v });
    }
    let n_rec = r.u32()?;
    let mut recurrent = Vec::new();
    for _ in 0..n_rec {
        let conv = r.f32s()?;
        let ssm = r.f32s()?;
        recurrent.push(RecurrentState { conv, ssm });
    }
    if !r.b.is_empty() {
        return Err("it has bytes after its last array".into());
    }
    Ok((
        tokens,
        SeqSnapshot {
            pos,
            kv_pos,
            kv,
            recurrent,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot of `n` positions, `w` floats per position, one attention layer,
    /// with DeltaNet state when `recurrent`; values from `seed`.
    fn snap(n: usize, w: usize, recurrent: bool, seed: f32) -> SeqSnapshot {
        let vals = |len: usize, off: f32| (0..len).map(|i| seed + off + i as f32).collect();
        SeqSnapshot {
            pos: n,
            kv_pos: n,
            kv: vec![LayerKv {
                k: vals(n * w, 0.5),
                v: vals(n * w, 0.25),
            }],
            recurrent: if recurrent {
                vec![RecurrentState {
                    conv: vals(6, 0.125),
                    ssm: vals(8, 0.0625),
                }]
            } else {
                Vec::new()
            },
        }
    }

    fn entry_bytes(n: usize, w: usize, recurrent: bool) -> usize {
        snap(n, w, recurrent, 0.0).bytes() + n * 4
    }

    #[test]
    fn longest_prefix_attention_only() {
        let mut c = PromptCache::new(1 << 20);
        let a = c
            .insert(vec![1, 2, 3, 4], snap(4, 2, false, 0.0))
            .unwrap()
            .unwrap();
        let b = c
            .insert(vec![1, 2, 9, 9, 9], snap(5, 2, false, 1.0))
            .unwrap()
            .unwrap();
        // Common prefix with a: 3; with b: 2.
        let h = c.lookup(&[1, 2, 3, 7, 7]).unwrap();
        assert_eq!((h.id, h.matched), (a, 3));
        // b is longer here.
        let h = c.lookup(&[1, 2, 9, 9, 8, 8]).unwrap();
        assert_eq!((h.id, h.matched), (b, 4));
        // One token is always left to run.
        let h = c.lookup(&[1, 2, 3, 4]).unwrap();
        assert_eq!((h.id, h.matched), (a, 3));
        assert!(c.lookup(&[5, 1, 2]).is_none());
        assert!(c.lookup(&[1]).is_none());
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.tokens_reused), (3, 2, 10));
        assert_eq!(s.entries, 2);
        assert_eq!(s.bytes, entry_bytes(4, 2, false) + entry_bytes(5, 2, false));
    }

    #[test]
    fn recurrent_entries_match_only_whole() {
        let mut c = PromptCache::new(1 << 20);
        let short = c
            .insert(vec![1, 2], snap(2, 2, true, 0.0))
            .unwrap()
            .unwrap();
        let long = c
            .insert(vec![1, 2, 3, 4], snap(4, 2, true, 1.0))
            .unwrap()
            .unwrap();
        // `long` shares 3 tokens but cannot be rewound to 3: `short` it is.
        let h = c.lookup(&[1, 2, 3, 5, 6]).unwrap();
        assert_eq!((h.id, h.matched), (short, 2));
        let h = c.lookup(&[1, 2, 3, 4, 5]).unwrap();
        assert_eq!((h.id, h.matched), (long, 4));
        // The whole prompt cached leaves nothing to run: the shorter entry serves.
        let h = c.lookup(&[1, 2, 3, 4]).unwrap();
        assert_eq!((h.id, h.matched), (short, 2));
        assert!(c.lookup(&[1, 3]).is_none());
    }

    #[test]
    fn lru_and_budget() {
        let one = entry_bytes(4, 2, false);
        let mut c = PromptCache::new(3 * one);
        let a = c
            .insert(vec![1, 0, 0, 0], snap(4, 2, false, 0.0))
            .unwrap()
            .unwrap();
        let b = c
            .insert(vec![2, 0, 0, 0], snap(4, 2, false, 0.0))
            .unwrap()
            .unwrap();
        let d = c
            .insert(vec![3, 0, 0, 0], snap(4, 2, false, 0.0))
            .unwrap()
            .unwrap();
        assert_eq!(c.len(), 3);
        // Touch a: b is now the least recently used.
        assert_eq!(c.lookup(&[1, 0, 5]).unwrap().id, a);
        let e = c
            .insert(vec![4, 0, 0, 0], snap(4, 2, false, 0.0))
            .unwrap()
            .unwrap();
        assert!(c.get(b).is_none(), "b was least recently used");
        for id in [a, d, e] {
            assert!(c.get(id).is_some());
        }
        assert_eq!(c.stats().evictions, 1);
        assert!(c.bytes() <= c.budget());
        // Same tokens again: replaced, not duplicated.
        let e2 = c
            .insert(vec![4, 0, 0, 0], snap(4, 2, false, 9.0))
            .unwrap()
            .unwrap();
        assert_eq!(c.len(), 3);
        assert!(c.get(e).is_none() && c.get(e2).is_some());
        // Larger than the whole budget: not kept, nothing evicted for it.
        assert_eq!(
            c.insert(vec![7; 20], snap(20, 2, false, 0.0)).unwrap(),
            None
        );
        assert_eq!(c.len(), 3);
        // A snapshot that is not of its tokens is refused.
        assert!(c.insert(vec![1, 2], snap(3, 2, false, 0.0)).is_err());
        assert!(c.remove(a) && !c.remove(a));
    }

    #[test]
    fn the_writer_mirrors_the_newest_contents_off_the_callers_thread() {
        let dir = tempfile::tempdir().unwrap();
        let files = || -> Vec<String> {
            let mut v: Vec<_> = fs::read_dir(dir.path())
                .unwrap()
                .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        let mut c = PromptCache::new(1 << 20);
        let w = Writer::new(dir.path().to_path_buf(), "model-a".into());
        c.insert(vec![1, 2, 3], snap(3, 4, true, 0.0)).unwrap();
        w.save(c.contents());
        c.insert(vec![4, 5], snap(2, 4, true, 1.0)).unwrap();
        w.save(c.contents());
        w.flush();
        let two = files();
        assert_eq!(two.len(), 2, "{two:?}");
        assert!(
            two.iter().all(|f| f.ends_with(EXT)),
            "no temporary left: {two:?}"
        );

        // The directory holds what save_dir writes for the same store.
        let same = tempfile::tempdir().unwrap();
        c.save_dir(same.path(), "model-a").unwrap();
        let mut want: Vec<_> = fs::read_dir(same.path())
            .unwrap()
            .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        want.sort();
        assert_eq!(two, want);

        // A removed entry's file goes; dropping the writer finishes its queue.
        let mut smaller = PromptCache::new(1 << 20);
        smaller.insert(vec![4, 5], snap(2, 4, true, 1.0)).unwrap();
        w.save(smaller.contents());
        drop(w);
        let one = files();
        assert_eq!(one.len(), 1, "{one:?}");
        let mut back = PromptCache::new(1 << 20);
        back.load_dir(dir.path(), "model-a").unwrap();
        assert_eq!(back.lookup(&[4, 5, 6]).unwrap().matched, 2);
    }

    #[test]
    fn disk_round_trip_and_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = PromptCache::new(1 << 20);
        let s1 = snap(3, 4, true, 0.0);
        let s2 = snap(5, 4, true, 2.0);
        c.insert(vec![1, 2, 3], s1.clone()).unwrap();
        c.insert(vec![1, 2, 3, 4, 5], s2.clone()).unwrap();
        assert_eq!(c.save_dir(dir.path(), "model-a").unwrap(), 2);
        // Unchanged entries are not rewritten.
        assert_eq!(c.save_dir(dir.path(), "model-a").unwrap(), 0);

        let mut back = PromptCache::new(1 << 20);
        let r = back.load_dir(dir.path(), "model-a").unwrap();
        assert_eq!((r.loaded, r.skipped), (2, 0), "{r:?}");
        let h = back.lookup(&[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(h.matched, 5);
        assert_eq!(*h.snapshot, s2);
        let h = back.lookup(&[1, 2, 3, 9]).unwrap();
        assert_eq!(*h.snapshot, s1);

        // Another model's view of the directory: both files are foreign.
        let mut other = PromptCache::new(1 << 20);
        let r = other.load_dir(dir.path(), "model-b").unwrap();
        assert_eq!((r.loaded, r.skipped), (0, 2), "{r:?}");
        for (_, why) in &r.skipped_files {
            assert!(
                why.contains("written for model \"model-a\", not \"model-b\""),
                "{why}"
            );
        }

        // Corrupt one file (one flipped bit in an array), truncate the other, add junk.
        let mut files: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|f| f.unwrap().path())
            .collect();
        files.sort();
        let mut bytes = fs::read(&files[0]).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        fs::write(&files[0], bytes).unwrap();
        let bytes = fs::read(&files[1]).unwrap();
        fs::write(&files[1], &bytes[..bytes.len() - 7]).unwrap();
        fs::write(dir.path().join("junk.pcache"), b"not an entry").unwrap();
        let mut hurt = PromptCache::new(1 << 20);
        let r = hurt.load_dir(dir.path(), "model-a").unwrap();
        assert_eq!((r.loaded, r.skipped), (0, 3), "{r:?}");
        let why = |name: &Path| {
            r.skipped_files
                .iter()
                .find(|(p, _)| p == name)
                .map(|(_, w)| w.clone())
                .unwrap_or_default()
        };
        assert!(why(&files[0]).contains("checksum does not match"), "{r:?}");
        assert!(why(&files[1]).contains("checksum does not match"), "{r:?}");
        assert!(
            why(&dir.path().join("junk.pcache")).contains("not a prompt-cache entry"),
            "{r:?}"
        );
        assert!(hurt.is_empty());

        // The directory mirrors the store: a dropped entry's file goes.
        let d2 = tempfile::tempdir().unwrap();
        let mut c = PromptCache::new(1 << 20);
        let a = c.insert(vec![1, 2, 3], s1).unwrap().unwrap();
        c.insert(vec![1, 2, 3, 4, 5], s2).unwrap();
        c.save_dir(d2.path(), "m").unwrap();
        c.remove(a);
        c.save_dir(d2.path(), "m").unwrap();
        assert_eq!(fs::read_dir(d2.path()).unwrap().count(), 1);
        // A missing directory holds nothing.
        let r = PromptCache::new(1)
            .load_dir(&d2.path().join("absent"), "m")
            .unwrap();
        assert_eq!(r, LoadReport::default());
    }
}
