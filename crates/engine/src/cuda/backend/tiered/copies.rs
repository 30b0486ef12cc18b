//! Moving experts' bytes into VRAM: a step's misses into their slots (from the
//! pinned RAM copy in one copy each, or read from the file into pinned staging by the
//! [`ExpertReader`] and copied from there), a layer's likely experts into the prompt
//! pool while its mixer runs, and a decode token's guessed experts into the next
//! layer's slots ahead of its step. Copies on the copier are ordered by events.

use super::{matrices, pinned, Tiered, STAGING_EXPERTS};
use crate::cuda::weights::{cuda_err, DevWeight, MoeDev};
use crate::experts::{ExpertReader, Fetch, Filled, Home, ReadCounters, ReadError, Staging};
use cuda::{Event, Gpu, Lane, PinnedBuf};
use model::{ExecError, ExecErrorKind};
use std::cell::RefMut;
use std::time::Instant;

/// Pinned memory is staging for expert reads: the reader's thread owns a buffer
/// while its reads are in flight (a `PinnedBuf` is plain host memory, `Send`; it
/// keeps its context alive, so a buffer a stalled read still holds when the
/// executor is dropped is freed when that read ends).
impl Staging for PinnedBuf {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// Reads of experts held only in the file.
pub(super) struct FileReads {
    /// Reads whole experts into pinned staging on a thread of its own, with the
    /// deadline, the retry and a verdict per expert (`experts::reader`). A read past
    /// its deadline keeps its buffer until the kernel is done with it, so a late
    /// read never lands in staging a copy reads; reads fail at once meanwhile.
    pub reader: ExpertReader<PinnedBuf>,
    /// The last read, while copies from its staging to VRAM may still run on the
    /// lane named: its buffer goes back to the reader only once that lane has
    /// drained them (before the next read, as the one staging buffer was reused).
    pub copying: Option<(Filled<PinnedBuf>, Lane)>,
    /// Bytes of the staging allocated at load.
    pub staging_bytes: u64,
}

impl FileReads {
    /// Hands the last read's staging back to the reader once the copies reading it
    /// are done (waiting for the lane they went on).
    fn reuse_staging(&mut self, gpu: &Gpu) -> Result<(), ExecError> {
        if let Some((f, lane)) = self.copying.take() {
            let drained = match lane {
                Lane::Copier => gpu.sync_copier(),
                Lane::Stream => gpu.sync(),
            };
            if let Err(e) = drained {
                // Copies may still read it: keep it out of the reader's hands.
                self.copying = Some((f, lane));
                return Err(cuda_err("wait for staging")(e));
            }
            self.reader.recycle(f.into_buf());
        }
        Ok(())
    }
}

impl Tiered {
    /// What the reads of experts from the file have done so far.
    pub fn read_counters(&self) -> ReadCounters {
        self.reads.borrow().reader.counters()
    }

    /// What keeps experts held only in the file from being read now, if anything
    /// (the file changed, a read is out past its deadline).
    pub fn standing_fault(&self) -> Option<String> {
        self.reads
            .borrow_mut()
            .reader
            .standing_fault()
            .map(|e| e.to_string())
    }

    /// The error of expert `expert` of layer `layer` that could not be read
    /// (`ExecErrorKind::ExpertRead`: its entry fails alone).
    fn read_error(&self, layer: usize, expert: u32, err: &ReadError) -> ExecError {
        // Noted once; the mapped file shows the changed bytes, the pinned copy the
        // loaded ones.
        let changed = matches!(err, ReadError::Changed { .. });
        if changed && !self.file_changed.replace(true) && self.cpu_from_map {
            tracing::warn!(
                "the CPU computes its share of the experts from the pinned copy from now \
                 on, not from the changed file"
            );
        }
        ExecError::of_kind(
            ExecErrorKind::ExpertRead,
            "read expert",
            format!("layer {layer} expert {expert}: {err}"),
        )
    }

    /// Copies the experts of `fetch` into their slots of layer `layer` (whose slot
    /// matrices are `mats`: the layer's, or the pool's), on `lane`: on the stream,
    /// ordered before anything issued after; on the copier, ordered by the caller
    /// (the copier made to wait before, the stream made to wait before the batch
    /// computes). Experts held only in the file are read first, in rounds of
    /// `STAGING_EXPERTS`; an expert that cannot be read (after the reader's retry,
    /// past its deadline, from a changed file) fails the call with its error, and
    /// the error's kind is `ExecErrorKind::ExpertRead`. On any failure the caller makes the store
    /// forget the step's fetches (`ExpertStore::forget`), so that no later step
    /// computes with bytes that did not arrive.
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
        let mut reads = self.reads.borrow_mut();
        let done = (|| {
            for round in from_file.chunks(STAGING_EXPERTS) {
                reads.reuse_staging(gpu)?;
                let experts: Vec<u32> = round.iter().map(|f| f.expert).collect();
                let got = reads
                    .reader
                    .read(layer, &experts)
                    .map_err(|e| self.read_error(layer, experts[0], &e))?;
                if let Some((i, err)) =
                    (0..round.len()).find_map(|i| got.ranges(i).err().map(|e| (i, e.clone())))
                {
                    // None of its bytes were copied: the staging is free again.
                    reads.reader.recycle(got.into_buf());
                    return Err(self.read_error(layer, experts[i], &err));
                }
                // Held until the copies reading it are done (`reuse_staging`).
                let (got, _) = reads.copying.insert((got, lane));
                for (i, f) in round.iter().enumerate() {
                    let r = got
                        .ranges(i)
                        .map_err(|e| self.read_error(layer, f.expert, e))?;
                    for (j, w) in mats.iter().enumerate() {
                        gpu.copy_pinned_to_device(
                            lane,
                            got.buf(),
                            r[j].start,
                            w.matrix_bytes as usize,
                            w.ptr + f.slot as u64 * w.stride,
                        )
                        .map_err(cuda_err("copy expert from staging"))?;
                    }
                }
            }
            Ok(())
        })();
        drop(reads);
        let ns = t0.elapsed().as_nanos() as u64;
        self.store.borrow_mut().add_disk_time(ns);
        done
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
