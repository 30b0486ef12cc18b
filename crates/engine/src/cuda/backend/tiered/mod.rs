//! Tiered experts on the GPU: each layer's routed experts live in a few VRAM slots
//! (a cache), in a pinned RAM copy, or only in the model file; the
//! [`ExpertStore`](crate::experts::ExpertStore) decides which expert goes to which slot
//! and this module moves the bytes.
//!
//! The slot matrices stand where the whole expert tensors stand in the resident
//! executor (`MoeDev::{gate,up,down}_exps`, one matrix per slot instead of per expert;
//! a slot holds its gate, up and down one after another), so the expert kernels are
//! the very same launches with the tile's `expert` field (or the fused kernels' id)
//! naming a slot: an expert computes the same bits wherever its bytes came from
//! (docs/design.md invariant 1).
//!
//! A miss in the RAM copy is one asynchronous copy from pinned memory. A miss
//! that is only in the file is read by an [`ExpertReader`](crate::experts::ExpertReader)
//! (`O_DIRECT`, io_uring, on a thread of its own, with a deadline and one retry) into
//! pinned staging, then copied; the staging goes back to the reader only after the
//! lane that copies from it has drained those copies. An expert that cannot be read
//! fails the pass it was needed in, with an error naming the file, offset and cause,
//! and the store forgets the step's fetches: no slot is ever computed with bytes that
//! did not arrive. A tiered executor runs each entry of a step in a pass of its own,
//! so the executor fails only that entry (`CudaExecutor::step_each`).
//!
//! The mode's state is [`Tiered`]; its parts are in files of their own: the layer
//! step of the backend (`layer.rs`: the routing read on the host, the slots'
//! products batch by batch or fused, the CPU's experts beside them), moving the
//! bytes (`copies.rs`: misses into slots, the prompt pool, guessed experts copied
//! ahead), the CPU's side (`cpu.rs`: the cost model's measurement, the team
//! computing its experts, their rows queued to the device) and the routing's way to
//! the host (`mailbox.rs`).

mod copies;
mod cpu;
mod layer;
mod mailbox;

use copies::FileReads;
pub(crate) use cpu::RowsTo;
use mailbox::Mailbox;

use crate::cpu::team::Team;
use crate::cuda::trace::{DecodeTrace, DevPoint, HostPoint};
use crate::cuda::weights::{cuda_err, DevWeight, MoeDev};
use crate::experts::io::ALIGN;
use crate::experts::{CostModel, ExpertReader, ExpertStore, ReadPolicy, TierStats};
use cuda::{DevBuf, Event, Gpu, PinnedBuf};
use model::weights::Weight;
use model::{ExecError, ModelWeights};
use std::cell::{Cell, RefCell, RefMut};
use std::sync::Arc;

/// Pinned staging for file reads: room for this many experts at once (more misses
/// from the file in one batch are read in rounds).
const STAGING_EXPERTS: usize = 16;

pub(crate) struct Tiered {
    pub store: RefCell<ExpertStore>,
    pub cost: CostModel,
    /// A fixed share of each decode step's RAM misses for the CPU instead of the
    /// cost model's split (tests and experiments).
    pub cpu_share: Option<f64>,
    /// Per trunk layer: the pinned RAM copy (`ExpertStore::ram_layout`).
    ram: Vec<PinnedBuf>,
    /// Per trunk layer: the expert tensors as the file maps them (gate, up, down).
    mapped: Vec<[Weight; 3]>,
    /// Whether the CPU reads experts from the mapped file rather than the pinned
    /// copy (whichever measured faster; the bytes are the same).
    cpu_from_map: bool,
    /// A read found the model file changed since it was loaded: the CPU reads its
    /// experts from the pinned copy from then on, never from the mapped file (which
    /// shows the file as it is now).
    file_changed: Cell<bool>,
    /// Reads of experts held only in the file: the reader and its pinned staging.
    reads: RefCell<FileReads>,
    /// The routing's way to the host.
    mailbox: RefCell<Mailbox>,
    /// A decode step's slot per rank on its way to the device (pinned, like `outs`).
    slot_ids: RefCell<Option<PinnedBuf>>,
    /// The threads that compute misses on the CPU (awake while a decode runs).
    pub team: Team,
    /// The CPU's expert outputs on their way to the device (a row per route of the
    /// step): pinned, so their copies are queued on the stream without the host
    /// waiting for the kernels before them. The next step's routing download waits
    /// for the stream, so a row is never rewritten before its copy has read it.
    outs: RefCell<Option<PinnedBuf>>,
    /// The prompt pool (see `ExpertStore::prefetch`): VRAM outside the slots that a
    /// layer's experts are copied into while its mixer runs.
    pool: Option<Arc<DevBuf<u8>>>,
    /// Recorded on the stream after the last batch computing in the pool (the
    /// pool's next fill waits for it), and on the copier after the fill (the pool's
    /// batch waits for it).
    pool_free: Event,
    pool_filled: Event,
    /// Per batch of a step: its products done (stream) and its copies landed
    /// (copier); grown to the most batches a step has had.
    batch_events: RefCell<Vec<[Event; 2]>>,
    /// How many of the next layer's likeliest experts a decode step guesses and
    /// copies ahead (the `--guess-experts` setting; 0: none).
    pub guesses: usize,
    /// Recorded on the copier after the guessed experts' copies, and the layer they
    /// are for (its step makes the stream wait for the event).
    ahead_done: Event,
    ahead_for: Cell<Option<usize>>,
    /// `SCORIA_TRACE_DECODE=1`: the per-layer time line of decode tokens.
    trace: Option<RefCell<DecodeTrace>>,
    /// The model's width: an expert's input, which a decode step publishes.
    n_embd: usize,
}

/// The pinned buffer held in `held`, replaced by a new one of `bytes` bytes when it
/// is smaller (or absent): transfers grow it once, then reuse it.
pub(crate) fn pinned_at_least<'a>(
    gpu: &Gpu,
    held: &'a mut Option<PinnedBuf>,
    bytes: usize,
    what: &'static str,
) -> Result<&'a mut PinnedBuf, ExecError> {
    if held.as_ref().is_none_or(|b| b.len() < bytes) {
        *held = Some(gpu.alloc_pinned(bytes).map_err(cuda_err(what))?);
    }
    Ok(held.as_mut().expect("allocated above"))
}

/// [`pinned_at_least`] for a buffer held in `cell`.
fn pinned<'a>(
    gpu: &Gpu,
    cell: &'a RefCell<Option<PinnedBuf>>,
    bytes: usize,
    what: &'static str,
) -> Result<RefMut<'a, PinnedBuf>, ExecError> {
    let mut held = cell.borrow_mut();
    pinned_at_least(gpu, &mut held, bytes, what)?;
    Ok(RefMut::map(held, |b| b.as_mut().expect("allocated above")))
}

/// A layer's three slot matrices (gate, up, down), in the order of an expert's bytes
/// in the RAM copy and in a slot.
pub(crate) fn matrices(m: &MoeDev) -> [&DevWeight; 3] {
    [&m.gate_exps, &m.up_exps, &m.down_exps]
}

impl Tiered {
    /// Allocates and fills the pinned RAM copy the store's plan asks for (from the
    /// memory-mapped file), and the staging for file reads, and opens the model
    /// file for them (`reads`: their deadline; a file that is not the one the store's
    /// index was built from is refused); `pool` is the prompt pool's VRAM (the
    /// store's `with_pool` bytes), `n_embd` the model's width (an expert's input).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        store: ExpertStore,
        pool: Option<DevBuf<u8>>,
        weights: &ModelWeights,
        n_embd: usize,
        cpu_share: Option<f64>,
        guesses: usize,
        probe: (u64, usize),
        map_ok: bool,
        reads: ReadPolicy,
        progress: &dyn Fn(u64),
    ) -> Result<Tiered, ExecError> {
        let mut ram = Vec::with_capacity(store.n_layer());
        let mut done = 0u64;
        for l in 0..store.n_layer() {
            let mut buf = gpu
                .alloc_pinned(store.ram_bytes(l))
                .map_err(cuda_err("pinned RAM copy of the experts"))?;
            let lw = &weights.layers[l].moe;
            let src = [&lw.gate_exps, &lw.up_exps, &lw.down_exps];
            let dst = buf.as_mut_slice();
            for (e, off) in store.ram_layout(l) {
                let mut at = off;
                for w in src {
                    let len = w.n_rows() * w.row_bytes();
                    let from = e as usize * len;
                    let bytes = w.bytes().get(from..from + len).ok_or_else(|| {
                        ExecError::new(
                            "pinned RAM copy of the experts",
                            format!("{}: expert {e} is past the tensor's bytes", w.name),
                        )
                    })?;
                    dst[at..at + len].copy_from_slice(bytes);
                    at += len;
                }
                done += (at - off) as u64;
                progress(done);
            }
            ram.push(buf);
        }
        // The most any expert's three covering spans can take (a span starts at the
        // matrix's offset rounded down and ends rounded up: one extra block at most).
        let span = (0..store.n_layer())
            .filter_map(|l| store.index().expert(l, 0))
            .map(|ms| {
                ms.iter()
                    .map(|m| (m.len as usize).next_multiple_of(ALIGN) + ALIGN)
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0);
        let staging = gpu
            .alloc_pinned(span * STAGING_EXPERTS)
            .map_err(cuda_err("pinned staging for expert reads"))?;
        let staging_bytes = staging.len() as u64;
        // More staging only while the one allocated here is out of reach (it never
        // is in practice: a read past its deadline keeps it, but no read is made
        // until it comes back).
        let alloc = gpu.pinned_alloc();
        let mut reader = ExpertReader::open(store.index(), reads, move |n| {
            alloc.alloc(n).map_err(|e| e.to_string())
        })
        .map_err(|e| ExecError::new("open the model file for expert reads", e))?;
        reader.recycle(staging);
        let mailbox = Mailbox::new(gpu, n_embd)?;
        let mut t = Tiered {
            store: RefCell::new(store),
            cost: CostModel {
                pcie_bps: 25e9,
                cpu_fixed_s: 50e-6,
                cpu_s_per_byte: 1.0 / 30e9,
            },
            cpu_share,
            ram,
            mapped: weights
                .layers
                .iter()
                .map(|l| {
                    let m = &l.moe;
                    [m.gate_exps.clone(), m.up_exps.clone(), m.down_exps.clone()]
                })
                .collect(),
            cpu_from_map: false,
            file_changed: Cell::new(false),
            reads: RefCell::new(FileReads {
                reader,
                copying: None,
                staging_bytes,
            }),
            outs: RefCell::new(None),
            mailbox: RefCell::new(mailbox),
            slot_ids: RefCell::new(None),
            pool: pool.map(Arc::new),
            pool_free: gpu.new_event().map_err(cuda_err("prompt pool"))?,
            pool_filled: gpu.new_event().map_err(cuda_err("prompt pool"))?,
            batch_events: RefCell::new(Vec::new()),
            guesses,
            ahead_done: gpu.new_event().map_err(cuda_err("guessed experts"))?,
            ahead_for: Cell::new(None),
            trace: if crate::switches::on(crate::switches::TRACE_DECODE) {
                Some(RefCell::new(DecodeTrace::new(gpu, weights.layers.len())?))
            } else {
                None
            },
            team: Team::new(rayon::current_num_threads().saturating_sub(1)),
            n_embd,
        };
        t.measure(gpu, probe, map_ok)?;
        Ok(t)
    }

    /// How many of a decode step's `misses` (held in RAM, `bytes` each) the CPU
    /// computes.
    pub fn to_cpu(&self, misses: usize, bytes: u64) -> usize {
        if let Some(f) = self.cpu_share {
            return ((misses as f64 * f).round() as usize).min(misses);
        }
        self.cost.split(misses, bytes)
    }

    /// A decode token begins; a traced one puts the device's and the host's clocks
    /// on one line.
    pub fn begin_token(&self, gpu: &Gpu, traced: bool) -> Result<(), ExecError> {
        let mut mailbox = self.mailbox.borrow_mut();
        if mailbox.unread {
            // A failed step's routing: let its kernel finish, then clear its flag.
            gpu.sync().map_err(cuda_err("decode"))?;
            mailbox.clear();
        }
        drop(mailbox);
        match &self.trace {
            Some(tr) if traced => tr.borrow_mut().begin(gpu),
            _ => Ok(()),
        }
    }

    /// A decode token ended (its output read back).
    pub fn end_token(&self, gpu: &Gpu) -> Result<(), ExecError> {
        match &self.trace {
            Some(tr) => tr.borrow_mut().end(gpu),
            None => Ok(()),
        }
    }

    /// Stamps the stream for the trace (nothing unless a token is traced).
    pub fn trace_dev(&self, gpu: &Gpu, layer: usize, p: DevPoint) -> Result<(), ExecError> {
        match &self.trace {
            Some(tr) => tr.borrow_mut().dev(gpu, layer, p),
            None => Ok(()),
        }
    }

    pub fn trace_host(&self, layer: usize, p: HostPoint) {
        if let Some(tr) = &self.trace {
            tr.borrow_mut().host(layer, p);
        }
    }

    pub fn ram_bytes(&self) -> u64 {
        self.ram.iter().map(|b| b.len() as u64).sum()
    }

    pub fn staging_bytes(&self) -> u64 {
        self.reads.borrow().staging_bytes
    }

    pub fn stats(&self) -> TierStats {
        self.store.borrow().stats()
    }

    pub fn pool_bytes(&self) -> u64 {
        self.pool.as_ref().map_or(0, |p| p.len() as u64)
    }
}
