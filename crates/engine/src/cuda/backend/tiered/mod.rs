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
//! that is only in the file is read with `O_DIRECT` (io_uring) into pinned staging, then
//! copied; the staging is reused only after the stream has drained the copies reading
//! it. A failed read ends the step with an error naming the file and offset: no slot is
//! ever computed with bytes that did not arrive.

use super::trace::{DecodeTrace, DevPoint, HostPoint};
use super::weights::{cuda_err, DevWeight, MoeDev};
use crate::cpu::team::Team;
use crate::cpu::TokenExperts;
use crate::experts::io::{DirectReader, ReadRequest, ALIGN};
use crate::experts::{fit_cpu, Batch, CostModel, ExpertStore, Fetch, Home, TierStats};
use cuda::{DevBuf, Gpu, Lane, Mark, PinnedBuf};
use model::weights::Weight;
use model::{ExecError, ModelWeights};
use std::cell::{Cell, RefCell, RefMut};
use std::sync::Arc;
use std::time::Instant;

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
    /// Per shard, opened at the first read from it.
    readers: RefCell<Vec<Option<DirectReader>>>,
    staging: RefCell<PinnedBuf>,
    /// A prompt step's routing on its way to the host (pinned).
    inbox: RefCell<Option<PinnedBuf>>,
    /// Where a decode step's kernel writes its routing and expert input for the
    /// host (mapped pinned memory: word 0 the flag, the words from 4 on); allocated
    /// before any capture, since the kernel that writes it is captured in the
    /// step's graph segment.
    mailbox: RefCell<PinnedBuf>,
    /// The CPU's rows copied on the copier ([`RowsTo::lane`]), for the stream to wait on.
    rows_done: Mark,
    /// A routing was published and not read (a step failed between): the kernel
    /// may still set the flag, so the next token waits for the device first.
    unread: Cell<bool>,
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
    pool_free: Mark,
    pool_filled: Mark,
    /// Per batch of a step: its products done (stream) and its copies landed
    /// (copier); grown to the most batches a step has had.
    marks: RefCell<Vec<[Mark; 2]>>,
    /// How many of the next layer's likeliest experts a decode step guesses and
    /// copies ahead (`SCORIA_GUESS_EXPERTS`; 0: none).
    pub guesses: usize,
    /// Recorded on the copier after the guessed experts' copies, and the layer they
    /// are for (its step makes the stream wait for the mark).
    ahead_done: Mark,
    ahead_for: Cell<Option<usize>>,
    /// `SCORIA_TRACE_DECODE=1`: the per-layer time line of decode tokens.
    trace: Option<RefCell<DecodeTrace>>,
}

/// Where a decode step's CPU rows go: row r (for route r) of the device matrix at
/// `dst`, `cols` floats a row. With `spare`, the matrix's other rows are unused
/// scratch, so one copy may cover all the CPU's rows and the rows between. The
/// copies go on `lane`: on the copier they run beside the device's own products
/// queued before them (the stream waits for them where it reads the rows).
#[derive(Clone, Copy)]
pub(crate) struct RowsTo {
    pub dst: u64,
    pub cols: usize,
    pub spare: bool,
    pub lane: Lane,
}

/// Words of the mailbox before the published ones (word 0 is the flag).
const MAILBOX_HEAD: usize = 4;

/// A decode step's routing as read back: its routes, the next layer's guessed
/// experts, and the experts' input.
pub(crate) struct StepRoutes {
    pub routes: Vec<u32>,
    pub guesses: Vec<u32>,
    pub x: Vec<f32>,
}

/// The guesses a decode step copies ahead unless `SCORIA_GUESS_EXPERTS` says. On N80
/// at a 16 GiB budget under random routing, 3 guesses decoded 6.8% faster than none
/// and 2 guesses 5.3% (bench/RESULTS.md, 2026-12-04, session 32), once the copies
/// ahead waited for the step's own work (see [`Tiered::copy_ahead`]); before that
/// they slowed the CPU's rows on the copy engine and decode ran 2–10% slower.
pub const DEFAULT_GUESSES: usize = 3;

/// A step's routing from its words: `n_routes` ids, `n_guess` ids, then the input.
fn parse_routes(words: &[u8], n_routes: usize, n_guess: usize) -> StepRoutes {
    let word = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let ids = |b: &[u8]| -> Vec<u32> {
        b.chunks_exact(4)
            .map(|c| i32::from_ne_bytes(word(c)) as u32)
            .collect()
    };
    let (r, rest) = words.split_at(4 * n_routes);
    let (g, xb) = rest.split_at(4 * n_guess);
    StepRoutes {
        routes: ids(r),
        guesses: ids(g),
        x: xb
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(word(c)))
            .collect(),
    }
}

/// The pinned buffer held in `held`, replaced by a new one of `bytes` bytes when it
/// is smaller (or absent): transfers grow it once, then reuse it.
pub(super) fn pinned_at_least<'a>(
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
pub(super) fn matrices(m: &MoeDev) -> [&DevWeight; 3] {
    [&m.gate_exps, &m.up_exps, &m.down_exps]
}

impl Tiered {
    /// Allocates and fills the pinned RAM copy the store's plan asks for (from the
    /// memory-mapped file), and the staging for file reads; `pool` is the prompt
    /// pool's VRAM (the store's `with_pool` bytes).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        store: ExpertStore,
        pool: Option<DevBuf<u8>>,
        weights: &ModelWeights,
        cpu_share: Option<f64>,
        probe: (u64, usize),
        map_ok: bool,
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
        let n_shards = store.index().shard_paths().len();
        // The most words a step publishes: two rows of routes (its own and the guess)
        // of at most 32 ranks, and the expert input.
        let n_embd = (0..store.n_layer())
            .filter_map(|l| store.index().expert(l, 0).map(|m| m[0].cols))
            .max()
            .unwrap_or(0);
        let mailbox = gpu
            .alloc_pinned(4 * (MAILBOX_HEAD + 2 * 32 + n_embd))
            .map_err(cuda_err("pinned mailbox for the routing"))?;
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
            readers: RefCell::new((0..n_shards).map(|_| None).collect()),
            staging: RefCell::new(staging),
            outs: RefCell::new(None),
            inbox: RefCell::new(None),
            mailbox: RefCell::new(mailbox),
            rows_done: gpu.new_mark().map_err(cuda_err("CPU expert rows"))?,
            unread: Cell::new(false),
            slot_ids: RefCell::new(None),
            pool: pool.map(Arc::new),
            pool_free: gpu.new_mark().map_err(cuda_err("prompt pool"))?,
            pool_filled: gpu.new_mark().map_err(cuda_err("prompt pool"))?,
            marks: RefCell::new(Vec::new()),
            guesses: std::env::var("SCORIA_GUESS_EXPERTS")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(DEFAULT_GUESSES),
            ahead_done: gpu.new_mark().map_err(cuda_err("guessed experts"))?,
            ahead_for: Cell::new(None),
            trace: if std::env::var("SCORIA_TRACE_DECODE").is_ok_and(|v| v == "1") {
                Some(RefCell::new(DecodeTrace::new(gpu, weights.layers.len())?))
            } else {
                None
            },
            team: Team::new(rayon::current_num_threads().saturating_sub(1)),
        };
        t.measure(gpu, probe, map_ok)?;
        Ok(t)
    }

    /// Measures the cost model on this machine: a pinned copy of experts into
    /// `probe` (device address and bytes: empty slots, so no VRAM beyond the
    /// budget), and the CPU computing 1, 2, 4 and 8 experts of one layer, from the pinned
    /// copy and, when `map_ok` (the page cache can keep the file's experts beside
    /// the pinned copy), from the mapped file.
    ///
    /// The layer measured is the first of the largest copies (the last one written
    /// may still sit in the CPU's cache), and every timed call reads experts no
    /// earlier call read, so the CPU's rate is one of RAM, not of its cache.
    fn measure(&mut self, gpu: &Gpu, probe: (u64, usize), map_ok: bool) -> Result<(), ExecError> {
        let Some(l) = (0..self.ram.len()).rev().max_by_key(|&l| self.ram[l].len()) else {
            return Ok(());
        };
        let src = &self.ram[l];
        let n = src.len().min(probe.1).min(256 << 20);
        if n == 0 {
            return Ok(());
        }
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            gpu.copy_pinned_to_device(Lane::Stream, src, 0, n, probe.0)
                .map_err(cuda_err("measure PCIe"))?;
            gpu.sync().map_err(cuda_err("measure PCIe"))?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        self.cost.pcie_bps = n as f64 / best.max(1e-9);
        let store = self.store.borrow();
        // Experts for the timed calls, taken in turn (from the far end of the layer,
        // away from the bytes the copies above read), each call on new ones while
        // the layer has them.
        let resident: Vec<(u32, usize)> = store.ram_layout(l).collect();
        let bytes = store.plan().layers[l].expert_bytes;
        drop(store);
        let k = resident.len().min(8);
        if k < 2 {
            return Ok(());
        }
        let x: Vec<f32> = (0..self.n_embd(l))
            .map(|i| ((i % 7) as f32 - 3.0) * 0.01)
            .collect();
        let next = std::cell::Cell::new(0usize);
        let take = |c: usize| -> Vec<(u32, usize)> {
            (0..c)
                .map(|_| {
                    let i = next.get();
                    next.set(i + 1);
                    resident[resident.len() - 1 - i % resident.len()]
                })
                .collect()
        };
        // (seconds per call, seconds per byte) of the CPU reading one source: two
        // calls to wake the team and touch its buffers, then calls of 1, 2, 4 and k
        // experts in turn, five rounds, and the line through the fastest of each
        // size. A cold start or one slow call cannot set the fit alone.
        let mut sizes: Vec<usize> = [1, 2, 4, k].into_iter().filter(|&c| c <= k).collect();
        sizes.dedup();
        let fit = |t: &Tiered| {
            for _ in 0..2 {
                std::hint::black_box(t.cpu_experts(l, &take(k), &x));
            }
            let mut best = vec![f64::MAX; sizes.len()];
            for _ in 0..5 {
                for (b, &c) in best.iter_mut().zip(&sizes) {
                    let set = take(c);
                    let t0 = Instant::now();
                    std::hint::black_box(t.cpu_experts(l, &set, &x));
                    *b = b.min(t0.elapsed().as_secs_f64());
                }
            }
            let points: Vec<(usize, f64)> = sizes.iter().copied().zip(best).collect();
            tracing::debug!(
                "CPU expert calls (experts, fastest µs): {:?}",
                points
                    .iter()
                    .map(|&(c, t)| (c, (t * 1e6).round()))
                    .collect::<Vec<_>>()
            );
            fit_cpu(&points, bytes)
        };
        let pinned = fit(self);
        let mut chosen = pinned;
        if map_ok {
            self.cpu_from_map = true;
            let mapped = fit(self);
            self.cpu_from_map = mapped.1 < pinned.1;
            if self.cpu_from_map {
                chosen = mapped;
            }
            tracing::info!(
                "CPU expert reads: {:.1} GB/s from the pinned copy, {:.1} GB/s from the mapped file; using the {}",
                1e-9 / pinned.1,
                1e-9 / mapped.1,
                if self.cpu_from_map { "mapped file" } else { "pinned copy" }
            );
        }
        (self.cost.cpu_fixed_s, self.cost.cpu_s_per_byte) = chosen;
        tracing::info!(
            "expert miss costs (measured): PCIe {:.1} GB/s from pinned RAM; CPU {:.1} GB/s + {:.0} µs per call{}",
            self.cost.pcie_bps / 1e9,
            1e-9 / self.cost.cpu_s_per_byte,
            self.cost.cpu_fixed_s * 1e6,
            if map_ok {
                ""
            } else {
                " (from the pinned copy: the page cache has no room for the file's experts beside it)"
            }
        );
        Ok(())
    }

    /// Layer `l`'s shapes: (n_embd, n_ff) and each matrix's type and bytes, from the
    /// index (the file's layout of one expert).
    fn shapes(&self, l: usize) -> [(quant::GgmlType, usize); 3] {
        let store = self.store.borrow();
        let locs = store.index().expert(l, 0);
        std::array::from_fn(|j| {
            locs.map_or((quant::GgmlType::F32, 0), |m| (m[j].ty, m[j].len as usize))
        })
    }

    fn n_embd(&self, l: usize) -> usize {
        self.store
            .borrow()
            .index()
            .expert(l, 0)
            .map_or(0, |m| m[0].cols)
    }

    /// How many of a decode step's `misses` (held in RAM, `bytes` each) the CPU
    /// computes.
    pub fn to_cpu(&self, misses: usize, bytes: u64) -> usize {
        if let Some(f) = self.cpu_share {
            return ((misses as f64 * f).round() as usize).min(misses);
        }
        self.cost.split(misses, bytes)
    }

    /// The gate, up and down matrices (type, bytes) of the experts `cpu` ((expert,
    /// RAM offset)) of layer `layer` as the CPU reads them (the pinned copy or the
    /// mapped file, whichever measured faster), and the layer's n_ff.
    #[allow(clippy::type_complexity)]
    fn cpu_mats(
        &self,
        layer: usize,
        cpu: &[(u32, usize)],
    ) -> (Vec<[(quant::GgmlType, &[u8]); 3]>, usize) {
        let shapes = self.shapes(layer);
        let ram = self.ram[layer].as_slice();
        let mapped = &self.mapped[layer];
        let mats = cpu
            .iter()
            .map(|&(e, off)| {
                let mut at = off;
                std::array::from_fn(|j| {
                    let (ty, len) = shapes[j];
                    let bytes = if self.cpu_from_map {
                        mapped[j].matrix_bytes(e as usize)
                    } else {
                        &ram[at..at + len]
                    };
                    at += len;
                    (ty, bytes)
                })
            })
            .collect();
        let n_ff = {
            let store = self.store.borrow();
            store.index().expert(layer, 0).map_or(0, |m| m[0].rows)
        };
        (mats, n_ff)
    }

    /// The experts of batch `b` that the CPU computes (layer `layer`, one token
    /// `x`), on the team while this thread runs `first` (beside the gate/up
    /// products) and then `second` (beside the down products); their output rows
    /// are then queued to the device as `to` says (row r for route r of `routes`).
    /// Returns what `first` and `second` returned; the time from the first
    /// products' start to the last's end goes to the statistics.
    #[allow(clippy::too_many_arguments)]
    pub fn cpu_beside<A, B>(
        &self,
        gpu: &Gpu,
        layer: usize,
        b: &Batch,
        x: &[f32],
        routes: &[u32],
        to: RowsTo,
        first: impl FnOnce() -> A,
        second: impl FnOnce() -> B,
    ) -> Result<(A, B), ExecError> {
        let t0 = Instant::now();
        self.trace_host(layer, HostPoint::CpuStart);
        let (mats, n_ff) = self.cpu_mats(layer, &b.cpu);
        let mut te = TokenExperts::new(x, &mats, n_ff);
        let a = te.gate_up(&self.team, first);
        let (outs, r) = te.down(&self.team, second);
        let ns = t0.elapsed().as_nanos() as u64;
        self.trace_host(layer, HostPoint::CpuEnd);
        self.store.borrow_mut().add_cpu_time(ns);
        self.upload_outputs(gpu, &b.cpu, &outs, routes, to)?;
        self.trace_dev(gpu, layer, DevPoint::Handed)?;
        Ok((a, r))
    }

    /// The outputs of the experts `cpu` ((expert, RAM offset)) of layer `layer` for
    /// one token `x`, computed by the CPU kernels on the team.
    pub fn cpu_experts(&self, layer: usize, cpu: &[(u32, usize)], x: &[f32]) -> Vec<Vec<f32>> {
        let (mats, n_ff) = self.cpu_mats(layer, cpu);
        let mut te = TokenExperts::new(x, &mats, n_ff);
        te.gate_up(&self.team, || ());
        te.down(&self.team, || ()).0
    }

    /// Queues `slots` (a step's slot per rank) to the device at `dst`, from pinned
    /// memory (rewritten only after the next step's routing download has waited for
    /// the stream).
    pub fn upload_slots(&self, gpu: &Gpu, slots: &[i32], dst: u64) -> Result<(), ExecError> {
        let bytes = 4 * slots.len();
        let mut buf = pinned(gpu, &self.slot_ids, bytes, "pinned buffer for the slots")?;
        for (d, s) in buf.as_mut_slice().chunks_exact_mut(4).zip(slots) {
            d.copy_from_slice(&s.to_ne_bytes());
        }
        gpu.copy_pinned_to_device(Lane::Stream, &buf, 0, bytes, dst)
            .map_err(cuda_err("upload the step's slots"))
    }

    /// Queues the kernel that writes a decode step's routing (`n_ids` ids at `ids`:
    /// the step's routes, then the guess) and its expert input (`n_x` floats at `x`)
    /// to the mailbox, for [`Self::read_published`]. Part of the step's graph segment.
    pub fn publish_routes(
        &self,
        gpu: &Gpu,
        ids: u64,
        n_ids: usize,
        x: u64,
        n_x: usize,
    ) -> Result<(), ExecError> {
        let mailbox = self.mailbox.borrow();
        if 4 * (MAILBOX_HEAD + n_ids + n_x) > mailbox.len() {
            return Err(ExecError::new(
                "publish routes",
                format!(
                    "{n_ids} ids and {n_x} values do not fit the {}-byte mailbox",
                    mailbox.len()
                ),
            ));
        }
        self.unread.set(true);
        gpu.publish_words(ids, n_ids, x, n_x, mailbox.dev_ptr())
            .map_err(cuda_err("publish_words"))
    }

    /// Waits for the routing a step's kernel published ([`Self::publish_routes`]):
    /// `n_routes` routes, `n_guess` guessed ids and `n_x` input values. The device
    /// has then run everything before that kernel, as after a download's
    /// synchronisation.
    pub fn read_published(
        &self,
        gpu: &Gpu,
        layer: usize,
        n_routes: usize,
        n_guess: usize,
        n_x: usize,
    ) -> Result<StepRoutes, ExecError> {
        let mut mailbox = self.mailbox.borrow_mut();
        gpu.wait_word(&mailbox, 0, "publishing the routing")
            .map_err(cuda_err("read routes"))?;
        if let Some(t) = &self.trace {
            // The routing is on the host as the step's segment ends.
            t.borrow_mut().dev(gpu, layer, DevPoint::Routed)?;
        }
        let words =
            &mailbox.as_slice()[4 * MAILBOX_HEAD..4 * (MAILBOX_HEAD + n_routes + n_guess + n_x)];
        let routes = parse_routes(words, n_routes, n_guess);
        mailbox.store_word(0, 0);
        self.unread.set(false);
        Ok(routes)
    }

    /// Waits for the device's routing of a prompt's step: the `n_routes` expert ids
    /// at `ids` and the `n_guess` ids of the next layer's guess after them (a
    /// download; decode steps publish theirs, [`Self::publish_routes`]).
    pub fn read_routes(
        &self,
        gpu: &Gpu,
        layer: usize,
        ids: u64,
        n_routes: usize,
        n_guess: usize,
    ) -> Result<StepRoutes, ExecError> {
        let bytes = 4 * (n_routes + n_guess);
        let mut buf = pinned(gpu, &self.inbox, bytes, "pinned buffer for the routing")?;
        let srcs = [(ids, bytes)];
        let mut trace = self.trace.as_ref().map(RefCell::borrow_mut);
        let stamp = trace
            .as_mut()
            .and_then(|t| t.stamp(layer, DevPoint::Routed));
        gpu.download_pinned(&srcs, &mut buf, stamp)
            .map_err(cuda_err("download routes"))?;
        drop(trace);
        Ok(parse_routes(&buf.as_slice()[..bytes], n_routes, n_guess))
    }

    /// Copies layer `layer`'s guessed experts (`guesses`, likeliest first; see
    /// `ExpertStore::ahead`) into its slots on the copier. Issued once the step of
    /// the layer before has issued all its work (its CPU share is done), and started
    /// only after that work has run on the device: started beside it, they held up
    /// the CPU's rows (a small copy on the step's path) on the copy engine, 62.8 µs
    /// from the CPU's end to its rows on the device against 31.9 µs when they wait
    /// (`SCORIA_TRACE_DECODE`). So they run beside this layer's mixer, when the copy
    /// engine and the RAM would otherwise wait for the routing. This layer's step
    /// makes the stream wait for them ([`Self::wait_ahead`]).
    pub fn copy_ahead(
        &self,
        gpu: &Gpu,
        layer: usize,
        m: &MoeDev,
        guesses: &[u32],
    ) -> Result<(), ExecError> {
        let fetch = self.store.borrow_mut().ahead(layer, guesses);
        if fetch.is_empty() {
            return Ok(());
        }
        // After everything the step issued (see above).
        let copied = gpu
            .copier_waits()
            .map_err(cuda_err("order expert copies"))
            .and_then(|()| self.fetch(gpu, layer, matrices(m), &fetch, Lane::Copier))
            .and_then(|()| {
                gpu.mark(Lane::Copier, &self.ahead_done)
                    .map_err(cuda_err("order expert copies"))
            });
        match copied {
            Ok(()) => self.ahead_for.set(Some(layer)),
            Err(_) => self.store.borrow_mut().drop_ahead(layer, &fetch),
        }
        copied
    }

    /// Makes the stream wait for the copies [`Self::copy_ahead`] issued for layer
    /// `layer`, if any (before the step's products read its slots).
    pub fn wait_ahead(&self, gpu: &Gpu, layer: usize) -> Result<(), ExecError> {
        if self.ahead_for.get() != Some(layer) {
            return Ok(());
        }
        self.ahead_for.set(None);
        gpu.wait_mark(Lane::Stream, &self.ahead_done)
            .map_err(cuda_err("order expert copies"))
    }

    /// Queues the CPU's expert outputs `outs` (one per expert of `cpu`) as rows of
    /// the device matrix `to` names: each goes to every row `r` whose route
    /// `routes[r]` is its expert, in one copy from the first such row to the last
    /// where `to.spare` allows, else one copy a row. The copies read pinned memory,
    /// so the host does not wait for the stream to reach them.
    fn upload_outputs(
        &self,
        gpu: &Gpu,
        cpu: &[(u32, usize)],
        outs: &[Vec<f32>],
        routes: &[u32],
        to: RowsTo,
    ) -> Result<(), ExecError> {
        let row_bytes = to.cols * 4;
        let mut buf = pinned(
            gpu,
            &self.outs,
            routes.len() * row_bytes,
            "pinned buffer for CPU expert outputs",
        )?;
        // Row spans to copy: one from the first CPU row to the last when the rows
        // between are spare, else one a row.
        let mut spans: Vec<(usize, usize)> = Vec::new();
        for (&(e, _), out) in cpu.iter().zip(outs) {
            for (r, _) in routes.iter().enumerate().filter(|(_, &re)| re == e) {
                let at = r * row_bytes;
                for (d, v) in buf.as_mut_slice()[at..at + row_bytes]
                    .chunks_exact_mut(4)
                    .zip(out)
                {
                    d.copy_from_slice(&v.to_ne_bytes());
                }
                match spans.first_mut() {
                    Some((lo, hi)) if to.spare => (*lo, *hi) = ((*lo).min(r), (*hi).max(r + 1)),
                    _ => spans.push((r, r + 1)),
                }
            }
        }
        for (lo, hi) in spans {
            let at = lo * row_bytes;
            gpu.copy_pinned_to_device(to.lane, &buf, at, (hi - lo) * row_bytes, to.dst + at as u64)
                .map_err(cuda_err("upload CPU expert output"))?;
        }
        if to.lane == Lane::Copier {
            gpu.mark(Lane::Copier, &self.rows_done)
                .and_then(|()| gpu.wait_mark(Lane::Stream, &self.rows_done))
                .map_err(cuda_err("order CPU expert rows"))?;
        }
        Ok(())
    }

    /// A decode token begins; a traced one puts the device's and the host's clocks
    /// on one line.
    pub fn begin_token(&self, gpu: &Gpu, traced: bool) -> Result<(), ExecError> {
        if self.unread.get() {
            // A failed step's routing: let its kernel finish, then clear its flag.
            gpu.sync().map_err(cuda_err("decode"))?;
            self.mailbox.borrow_mut().store_word(0, 0);
            self.unread.set(false);
        }
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
        self.staging.borrow().len() as u64
    }

    pub fn stats(&self) -> TierStats {
        self.store.borrow().stats()
    }

    pub fn pool_bytes(&self) -> u64 {
        self.pool.as_ref().map_or(0, |p| p.len() as u64)
    }

    /// Layer `m`'s slot matrices over the prompt pool (entry i where slot i is).
    pub fn pool_mats(&self, m: &MoeDev) -> Option<[DevWeight; 3]> {
        let pool = self.pool.as_ref()?;
        let mats = matrices(m);
        let base = mats[0].ptr;
        Some(mats.map(|w| w.moved(pool, pool.ptr() + (w.ptr - base))))
    }

    /// At least `n` pairs of per-batch marks (see `marks`).
    pub fn marks(&self, gpu: &Gpu, n: usize) -> Result<RefMut<'_, Vec<[Mark; 2]>>, ExecError> {
        let mut marks = self.marks.borrow_mut();
        while marks.len() < n {
            let mark = || gpu.new_mark().map_err(cuda_err("order expert copies"));
            marks.push([mark()?, mark()?]);
        }
        Ok(marks)
    }

    /// Copies layer `layer`'s prefetched experts into the prompt pool on the copier
    /// (when the store prefetches for a chunk of `n_tokens`; see
    /// `ExpertStore::prefetch`), after the pool's last batch has computed. Issued
    /// before the layer's mixer, so the copies run beside it.
    pub fn prefetch(
        &self,
        gpu: &Gpu,
        layer: usize,
        m: &MoeDev,
        n_tokens: usize,
    ) -> Result<(), ExecError> {
        let Some(mats) = self.pool_mats(m) else {
            return Ok(());
        };
        let fetch = self.store.borrow_mut().prefetch(layer, n_tokens);
        if fetch.is_empty() {
            return Ok(());
        }
        let cap = self.pool_bytes() / mats[0].stride;
        let filled = (|| {
            if fetch.iter().any(|f| u64::from(f.slot) >= cap) {
                return Err(ExecError::new(
                    "prompt pool",
                    format!("layer {layer}: more experts than the pool's {cap}"),
                ));
            }
            gpu.wait_mark(Lane::Copier, &self.pool_free)
                .map_err(cuda_err("order expert copies"))?;
            self.fetch(
                gpu,
                layer,
                [&mats[0], &mats[1], &mats[2]],
                &fetch,
                Lane::Copier,
            )?;
            gpu.mark(Lane::Copier, &self.pool_filled)
                .map_err(cuda_err("order expert copies"))
        })();
        if filled.is_err() {
            self.store.borrow_mut().drop_pool();
        }
        filled
    }

    /// Makes the stream wait for the pool's fill (before its batch computes).
    pub fn wait_pool(&self, gpu: &Gpu) -> Result<(), ExecError> {
        gpu.wait_mark(Lane::Stream, &self.pool_filled)
            .map_err(cuda_err("order expert copies"))
    }

    /// Marks the stream after the pool's batch (the next fill waits for it).
    pub fn pool_read(&self, gpu: &Gpu) -> Result<(), ExecError> {
        gpu.mark(Lane::Stream, &self.pool_free)
            .map_err(cuda_err("order expert copies"))
    }

    /// Copies the experts of `fetch` into their slots of layer `layer` (whose slot
    /// matrices are `mats`: the layer's, or the pool's), on `lane`: on the stream,
    /// ordered before anything issued after; on the copier, ordered by the caller
    /// (the copier made to wait before, the stream made to wait before the batch
    /// computes). On a failure the caller makes
    /// the store forget the step's fetches (`ExpertStore::forget`), so that no later
    /// step computes with bytes that did not arrive.
    pub fn fetch(
        &self,
        gpu: &Gpu,
        layer: usize,
        mats: [&DevWeight; 3],
        fetch: &[Fetch],
        lane: Lane,
    ) -> Result<(), ExecError> {
        let mut from_file = Vec::new();
        for f in fetch {
            match f.from {
                // The RAM copy holds an expert's gate, up and down one after another,
                // as a slot does: one copy.
                Home::Ram(off) => {
                    let len = mats.iter().map(|w| w.matrix_bytes as usize).sum();
                    gpu.copy_pinned_to_device(
                        lane,
                        &self.ram[layer],
                        off,
                        len,
                        mats[0].ptr + f.slot as u64 * mats[0].stride,
                    )
                    .map_err(cuda_err("copy expert from RAM"))?;
                }
                _ => from_file.push(*f),
            }
        }
        if from_file.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        let store = self.store.borrow();
        let index = store.index();
        let mut staging = self.staging.borrow_mut();
        let mut readers = self.readers.borrow_mut();
        for round in from_file.chunks(STAGING_EXPERTS) {
            // The staging may still be read by the previous round's copies.
            match lane {
                Lane::Copier => gpu.sync_copier(),
                Lane::Stream => gpu.sync(),
            }
            .map_err(cuda_err("wait for staging"))?;
            let mut ranges = Vec::new();
            let mut shard = None;
            for f in round {
                let locs = index.expert(layer, f.expert as usize).ok_or_else(|| {
                    ExecError::new(
                        "read expert",
                        format!("layer {layer} expert {} is not in the index", f.expert),
                    )
                })?;
                for loc in locs {
                    if *shard.get_or_insert(loc.shard) != loc.shard {
                        return Err(ExecError::new(
                            "read expert",
                            format!("layer {layer}: expert tensors span several shards"),
                        ));
                    }
                    ranges.push((loc.offset, loc.len as usize));
                }
            }
            let shard = shard.unwrap_or(0);
            let reader = match &mut readers[shard] {
                Some(r) => r,
                slot => {
                    let path = index.shard_path(shard).ok_or_else(|| {
                        ExecError::new("read expert", format!("no shard {shard}"))
                    })?;
                    slot.insert(
                        DirectReader::open(path).map_err(|e| ExecError::new("read expert", e))?,
                    )
                }
            };
            let base = staging.as_slice().as_ptr() as usize;
            let mut reqs =
                ReadRequest::carve(staging.as_mut_slice(), &ranges).ok_or_else(|| {
                    ExecError::new(
                        "read expert",
                        "the staging buffer is too small or unaligned",
                    )
                })?;
            reader
                .read_batch(&mut reqs)
                .map_err(|e| ExecError::new("read expert", e))?;
            // Where each matrix's bytes sit in the staging.
            let offs: Vec<usize> = reqs
                .iter()
                .map(|r| r.data().as_ptr() as usize - base)
                .collect();
            drop(reqs);
            for (i, f) in round.iter().enumerate() {
                for (j, w) in mats.iter().enumerate() {
                    gpu.copy_pinned_to_device(
                        lane,
                        &staging,
                        offs[3 * i + j],
                        w.matrix_bytes as usize,
                        w.ptr + f.slot as u64 * w.stride,
                    )
                    .map_err(cuda_err("copy expert from staging"))?;
                }
            }
        }
        drop(store);
        let ns = t0.elapsed().as_nanos() as u64;
        self.store.borrow_mut().add_disk_time(ns);
        Ok(())
    }
}
