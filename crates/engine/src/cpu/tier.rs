//! Tiered experts on the CPU (`--device cpu` with `--ram-budget`): the routed experts
//! a RAM budget holds are copied into memory at load (the RAM copy, chosen by the
//! expert plan's RAM rule: a routing profile's most used first, else round-robin
//! over layers); every other expert is read from the model file with `O_DIRECT`
//! ([`ExpertReader`]) each time a step routes to it, so the experts beyond the budget
//! never enter the page cache. Experts compute with the same kernels from either
//! copy: the bits do not depend on where an expert came from (invariant 1).
//!
//! A read that fails, or stalls past its deadline, fails only the rows routed to the
//! experts it could not bring: the MoE computes the other rows, the failed rows are
//! recorded here for the pass, and the executor ends only the sequences they belong
//! to (`Executor::step_each`), each with the error naming the file, offset and cause.
//! A row that failed takes no expert in the later layers of its pass.

use std::ops::Range;
use std::sync::Mutex;
use std::time::Instant;

use gguf::GgufFile;
use model::{ExecError, ModelConfig};

use crate::error::EngineError;
use crate::experts::{
    ram_copy, AlignedBuf, ExpertIndex, ExpertReader, Filled, PlanError, ReadCounters, ReadPolicy,
    RoutingProfile, TierStats,
};

/// Experts read at once while the RAM copy is filled at load.
const FILL_EXPERTS: usize = 32;

/// The tiered experts of a CPU executor (see the module docs).
pub struct CpuTier {
    /// Per trunk layer: its resident experts' gate, up and down, expert after expert.
    ram: Vec<AlignedBuf>,
    /// Per trunk layer: expert → where its gate, up and down lie in `ram`.
    ram_at: Vec<Vec<Option<[Range<usize>; 3]>>>,
    ram_bytes: u64,
    reader: Mutex<ExpertReader<AlignedBuf>>,
    stats: Mutex<TierStats>,
    /// Rows of the current pass that could not get their experts, with why.
    failed: Mutex<Vec<(usize, ExecError)>>,
}

/// Where one expert of a layer step is.
enum At {
    /// Not routed to in this step.
    Unused,
    Ram,
    /// The `i`-th expert of the step's read.
    Read(usize),
    Failed(ExecError),
}

/// One layer step's routed experts: where each one's bytes are, or why it has none.
pub(crate) struct LayerExperts<'a> {
    tier: &'a CpuTier,
    layer: usize,
    read: Option<Filled<AlignedBuf>>,
    at: Vec<At>,
}

impl LayerExperts<'_> {
    /// Why expert `ex` has no bytes in this step (`None`: it has them).
    pub fn failure(&self, ex: usize) -> Option<&ExecError> {
        match self.at.get(ex) {
            Some(At::Failed(e)) => Some(e),
            _ => None,
        }
    }

    /// Expert `ex`'s gate, up and down bytes, `None` when the step has none for it.
    pub fn mats(&self, ex: usize) -> Option<[&[u8]; 3]> {
        match self.at.get(ex)? {
            At::Ram => {
                let r = self.tier.ram_at[self.layer][ex].as_ref()?;
                let b = &self.tier.ram[self.layer];
                Some([&b[r[0].clone()], &b[r[1].clone()], &b[r[2].clone()]])
            }
            At::Read(i) => self.read.as_ref()?.expert(*i).ok(),
            At::Unused | At::Failed(_) => None,
        }
    }
}

impl CpuTier {
    /// Indexes the routed experts of `file`, opens the file for direct reads and
    /// fills the RAM copy with the experts `budget` bytes hold.
    pub fn open(
        file: &GgufFile,
        cfg: &ModelConfig,
        budget: u64,
        profile: Option<&RoutingProfile>,
        policy: ReadPolicy,
    ) -> Result<CpuTier, EngineError> {
        if let Some(available) = crate::memory::mem_available() {
            if budget > available {
                return Err(EngineError::Memory(
                    PlanError::RamTooLarge { budget, available }.to_string(),
                ));
            }
        }
        let index =
            ExpertIndex::build(file, cfg).map_err(|e| EngineError::Device(e.to_string()))?;
        let read_err = |e: crate::experts::ReadError| {
            EngineError::Exec(ExecError::new("read experts into RAM", e))
        };
        let mut reader =
            ExpertReader::open(&index, policy, |n| Ok(AlignedBuf::zeroed(n))).map_err(read_err)?;
        let bytes = index.trunk_expert_bytes();
        let (resident, _, ram_bytes) = ram_copy(&bytes, cfg.n_expert, budget, profile);
        let mut ram = Vec::with_capacity(bytes.len());
        let mut ram_at = Vec::with_capacity(bytes.len());
        for (l, res) in resident.iter().enumerate() {
            let experts: Vec<u32> = (0..cfg.n_expert as u32)
                .filter(|&e| res[e as usize])
                .collect();
            let mut buf = AlignedBuf::zeroed((experts.len() as u64 * bytes[l]) as usize);
            let mut at = vec![None; cfg.n_expert];
            let mut off = 0;
            for chunk in experts.chunks(FILL_EXPERTS) {
                let got = reader.read(l, chunk).map_err(read_err)?;
                for (i, &e) in chunk.iter().enumerate() {
                    let mats = got.expert(i).map_err(|e| read_err(e.clone()))?;
                    let mut r: [Range<usize>; 3] = [0..0, 0..0, 0..0];
                    for (m, src) in mats.iter().enumerate() {
                        buf[off..off + src.len()].copy_from_slice(src);
                        r[m] = off..off + src.len();
                        off += src.len();
                    }
                    at[e as usize] = Some(r);
                }
                reader.recycle(got.into_buf());
            }
            ram.push(buf);
            ram_at.push(at);
        }
        tracing::info!(
            "experts on the CPU: {:.2} GiB of {:.2} GiB in RAM, the rest read from the file when routed to",
            ram_bytes as f64 / crate::memory::GIB,
            bytes.iter().sum::<u64>() as f64 * cfg.n_expert as f64 / crate::memory::GIB
        );
        Ok(CpuTier {
            ram,
            ram_at,
            ram_bytes,
            reader: Mutex::new(reader),
            stats: Mutex::new(TierStats::default()),
            failed: Mutex::new(Vec::new()),
        })
    }

    /// Bytes of the RAM copy.
    pub fn ram_bytes(&self) -> u64 {
        self.ram_bytes
    }

    pub fn stats(&self) -> TierStats {
        *lock(&self.stats)
    }

    pub fn counters(&self) -> ReadCounters {
        lock(&self.reader).counters()
    }

    /// What keeps experts that are only in the file from being read now, if
    /// anything (a changed file, a read out past its deadline).
    pub fn standing_fault(&self) -> Option<String> {
        lock(&self.reader).standing_fault().map(|e| e.to_string())
    }

    /// The experts of layer `layer` that `uses` routes to (`uses[e]`: routes to
    /// expert `e` in this step): the RAM copy's at hand, the others read.
    pub(crate) fn fetch(&self, layer: usize, uses: &[u32]) -> LayerExperts<'_> {
        let mut at: Vec<At> = uses.iter().map(|_| At::Unused).collect();
        let mut to_read = Vec::new();
        let mut st = TierStats::default();
        let ebytes = |e: usize| {
            self.ram_at[layer][e]
                .as_ref()
                .map_or(0, |r| r.iter().map(|r| r.len() as u64).sum())
        };
        // Counted as the GPU's tiers count what the CPU computes: every use from the
        // RAM copy is a CPU "miss" (there are no VRAM slots to hit), every use of an
        // expert read from the file a disk miss; bytes once per expert and step.
        for (e, &n) in uses.iter().enumerate() {
            if n == 0 {
                continue;
            }
            if self.ram_at[layer][e].is_some() {
                at[e] = At::Ram;
                st.cpu_misses += n as u64;
                st.cpu_bytes += ebytes(e);
            } else {
                to_read.push(e as u32);
            }
        }
        let mut read = None;
        if !to_read.is_empty() {
            let t0 = Instant::now();
            let got = lock(&self.reader).read(layer, &to_read);
            st.disk_ns += t0.elapsed().as_nanos() as u64;
            match got {
                Ok(f) => {
                    for (i, &e) in to_read.iter().enumerate() {
                        at[e as usize] = match f.expert(i) {
                            Ok(m) => {
                                st.disk_misses += uses[e as usize] as u64;
                                st.disk_bytes += m.iter().map(|b| b.len() as u64).sum::<u64>();
                                At::Read(i)
                            }
                            Err(err) => At::Failed(expert_err(layer, e, err)),
                        };
                    }
                    read = Some(f);
                }
                Err(err) => {
                    for &e in &to_read {
                        at[e as usize] = At::Failed(expert_err(layer, e, &err));
                    }
                }
            }
        }
        add(&mut lock(&self.stats), &st);
        LayerExperts {
            tier: self,
            layer,
            read,
            at,
        }
    }

    /// Hands a layer step's read buffer back for the next.
    pub(crate) fn done(&self, le: LayerExperts<'_>) {
        if let Some(f) = le.read {
            lock(&self.reader).recycle(f.into_buf());
        }
    }

    /// Starts a pass: no row has failed yet.
    pub(crate) fn begin_pass(&self) {
        lock(&self.failed).clear();
    }

    /// Rows of this pass that failed so far (each once, with its first error).
    pub(crate) fn failed_rows(&self) -> Vec<(usize, ExecError)> {
        lock(&self.failed).clone()
    }

    /// Records rows that could not get their experts in this pass.
    pub(crate) fn fail_rows(&self, rows: impl IntoIterator<Item = (usize, ExecError)>) {
        let mut f = lock(&self.failed);
        for (r, e) in rows {
            if !f.iter().any(|(x, _)| *x == r) {
                f.push((r, e));
            }
        }
    }
}

fn expert_err(layer: usize, expert: u32, err: &crate::experts::ReadError) -> ExecError {
    ExecError::of_kind(
        model::ExecErrorKind::ExpertRead,
        "read expert",
        format!("layer {layer} expert {expert}: {err}"),
    )
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn add(a: &mut TierStats, b: &TierStats) {
    a.cpu_misses += b.cpu_misses;
    a.cpu_bytes += b.cpu_bytes;
    a.disk_misses += b.disk_misses;
    a.disk_bytes += b.disk_bytes;
    a.disk_ns += b.disk_ns;
}
