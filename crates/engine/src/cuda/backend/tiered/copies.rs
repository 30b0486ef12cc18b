//! Moving experts' bytes into VRAM: a step's misses into their slots (from the
//! pinned RAM copy in one copy each, or read from the file with `O_DIRECT` into
//! pinned staging and copied from there), a layer's likely experts into the prompt
//! pool while its mixer runs, and a decode token's guessed experts into the next
//! layer's slots ahead of its step. Copies on the copier are ordered by events.

use super::{matrices, pinned, Tiered, STAGING_EXPERTS};
use crate::cuda::weights::{cuda_err, DevWeight, MoeDev};
use crate::experts::io::{DirectReader, ReadRequest};
use crate::experts::{Fetch, Home};
use cuda::{Event, Gpu, Lane, PinnedBuf};
use model::ExecError;
use std::cell::RefMut;
use std::time::Instant;

/// Reads of experts held only in the file.
pub(super) struct FileReads {
    /// Per shard, opened at the first read from it.
    pub readers: Vec<Option<DirectReader>>,
    /// Pinned staging the reads land in (room for `STAGING_EXPERTS` experts).
    pub staging: PinnedBuf,
}

impl Tiered {
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
        let mut reads = self.reads.borrow_mut();
        let FileReads { readers, staging } = &mut *reads;
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
                        staging,
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
            gpu.wait_event(Lane::Copier, &self.pool_free)
                .map_err(cuda_err("order expert copies"))?;
            self.fetch(
                gpu,
                layer,
                [&mats[0], &mats[1], &mats[2]],
                &fetch,
                Lane::Copier,
            )?;
            gpu.record(Lane::Copier, &self.pool_filled)
                .map_err(cuda_err("order expert copies"))
        })();
        if filled.is_err() {
            self.store.borrow_mut().drop_pool();
        }
        filled
    }

    /// Layer `m`'s slot matrices over the prompt pool (entry i where slot i is).
    pub fn pool_mats(&self, m: &MoeDev) -> Option<[DevWeight; 3]> {
        let pool = self.pool.as_ref()?;
        let mats = matrices(m);
        let base = mats[0].ptr;
        Some(mats.map(|w| w.moved(pool, pool.ptr() + (w.ptr - base))))
    }

    /// Makes the stream wait for the pool's fill (before its batch computes).
    pub fn wait_pool(&self, gpu: &Gpu) -> Result<(), ExecError> {
        gpu.wait_event(Lane::Stream, &self.pool_filled)
            .map_err(cuda_err("order expert copies"))
    }

    /// Records on the stream the end of the pool's batch (the next fill waits for it).
    pub fn pool_read(&self, gpu: &Gpu) -> Result<(), ExecError> {
        gpu.record(Lane::Stream, &self.pool_free)
            .map_err(cuda_err("order expert copies"))
    }

    /// At least `n` pairs of per-batch events (see `batch_events`).
    pub fn batch_events(
        &self,
        gpu: &Gpu,
        n: usize,
    ) -> Result<RefMut<'_, Vec<[Event; 2]>>, ExecError> {
        let mut events = self.batch_events.borrow_mut();
        while events.len() < n {
            let event = || gpu.new_event().map_err(cuda_err("order expert copies"));
            events.push([event()?, event()?]);
        }
        Ok(events)
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
                gpu.record(Lane::Copier, &self.ahead_done)
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
        gpu.wait_event(Lane::Stream, &self.ahead_done)
            .map_err(cuda_err("order expert copies"))
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
}
