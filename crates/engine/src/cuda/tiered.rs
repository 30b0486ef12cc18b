//! Tiered experts on the GPU: each layer's routed experts live in a few VRAM slots
//! (a cache), in a pinned RAM copy, or only in the model file; the
//! [`ExpertStore`](crate::experts::ExpertStore) decides which expert goes to which slot
//! and this module moves the bytes.
//!
//! The slot buffers stand where the whole expert tensors stand in the resident
//! executor (`MoeDev::{gate,up,down}_exps`, one matrix per slot instead of per expert),
//! so the expert kernels are the very same launches with the tile's `expert` field
//! naming a slot: an expert computes the same bits wherever its bytes came from
//! (DESIGN.md invariant 1).
//!
//! A miss in the RAM copy is one asynchronous copy per matrix from pinned memory. A miss
//! that is only in the file is read with `O_DIRECT` (io_uring) into pinned staging, then
//! copied; the staging is reused only after the stream has drained the copies reading
//! it. A failed read ends the step with an error naming the file and offset: no slot is
//! ever computed with bytes that did not arrive.

use super::weights::{cuda_err, DevWeight, MoeDev};
use crate::experts::io::{DirectReader, ReadRequest, ALIGN};
use crate::experts::{ExpertStore, Fetch, Home, TierStats};
use cuda::{Gpu, PinnedBuf};
use model::{ExecError, ModelWeights};
use std::cell::RefCell;
use std::time::Instant;

/// Pinned staging for file reads: room for this many experts at once (more misses
/// from the file in one batch are read in rounds).
const STAGING_EXPERTS: usize = 16;

pub(crate) struct Tiered {
    pub store: RefCell<ExpertStore>,
    /// Per trunk layer: the pinned RAM copy (`ExpertStore::ram_layout`).
    ram: Vec<PinnedBuf>,
    /// Per shard, opened at the first read from it.
    readers: RefCell<Vec<Option<DirectReader>>>,
    staging: RefCell<PinnedBuf>,
}

/// Bytes of one expert's three matrices as the file stores them.
fn matrices(m: &MoeDev) -> [&DevWeight; 3] {
    [&m.gate_exps, &m.up_exps, &m.down_exps]
}

impl Tiered {
    /// Allocates and fills the pinned RAM copy the store's plan asks for (from the
    /// memory-mapped file), and the staging for file reads.
    pub fn new(
        gpu: &Gpu,
        store: ExpertStore,
        weights: &ModelWeights,
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
        Ok(Tiered {
            store: RefCell::new(store),
            ram,
            readers: RefCell::new((0..n_shards).map(|_| None).collect()),
            staging: RefCell::new(staging),
        })
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

    /// Copies the experts of `fetch` into their slots of layer `layer` (whose slot
    /// buffers are `m`), ordered on the stream before anything issued after.
    pub fn fetch(
        &self,
        gpu: &Gpu,
        layer: usize,
        m: &MoeDev,
        fetch: &[Fetch],
    ) -> Result<(), ExecError> {
        let mats = matrices(m);
        let mut from_file = Vec::new();
        for f in fetch {
            match f.from {
                Home::Ram(off) => {
                    let mut at = off;
                    for w in mats {
                        let len = w.matrix_bytes as usize;
                        gpu.copy_pinned_to_device(
                            &self.ram[layer],
                            at,
                            len,
                            w.buf.ptr() + f.slot as u64 * w.matrix_bytes,
                        )
                        .map_err(cuda_err("copy expert from RAM"))?;
                        at += len;
                    }
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
            gpu.sync().map_err(cuda_err("wait for staging"))?;
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
                        &staging,
                        offs[3 * i + j],
                        w.matrix_bytes as usize,
                        w.buf.ptr() + f.slot as u64 * w.matrix_bytes,
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
