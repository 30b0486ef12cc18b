//! A tiered layer's step of the backend: the host reads the step's routing, the
//! expert store assigns slots (fetching misses) and, in a decode step, leaves some
//! misses held in RAM to the CPU; the resident executor's expert kernels run over
//! the slots, batch by batch or, for a decode step whose experts fit one batch,
//! fused. A decode step's graph segment ends here and the next begins once the
//! host's part is issued (`segments.rs`).

use super::{matrices, RowsTo, Tiered};
use crate::cuda::backend::moe::{fused_moe, FusedAct, Routed};
use crate::cuda::backend::{is_float, CudaBackend, DBuf};
use crate::cuda::trace::{DevPoint, HostPoint};
use crate::cuda::weights::{cuda_err, MoeDev};
use crate::experts::Batch;
use cuda::{ActQ8, Lane, MoeRoute, Tile, TILE_GROUP, TILE_TOKENS};
use model::ExecError;
use std::time::{Duration, Instant};

impl CudaBackend {
    /// The routed experts of a tiered layer: the host reads the step's routing, the
    /// expert store assigns slots (fetching misses) and, in a decode step, leaves some
    /// misses held in RAM to the CPU (the cost model's split); the same kernels run
    /// over slots instead of experts, one batch of slots at a time, while the CPU's
    /// team computes its experts with the same bits (beside this thread issuing the
    /// device's work) and their rows are queued for upload from pinned memory.
    /// Returns the down projections and the shared expert, or, for a decode step
    /// that the fused kernels take ([`Self::tiered_fused`]), the block's output.
    /// Adds the host's times to the store's statistics.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::cuda::backend) fn routed_tiered(
        &self,
        t: &Tiered,
        layer: usize,
        m: &MoeDev,
        x: &DBuf,
        xq: ActQ8,
        logits: &DBuf,
        wts: &DBuf,
        ids: u64,
        guess: bool,
    ) -> Result<Routed, ExecError> {
        let cfg = &self.cfg;
        let (t_n, k) = (x.rows, cfg.n_expert_used);
        let rows = t_n * k;
        // With a guess, `logits` holds a second row: the next layer's (see `moe`).
        let route_rows = t_n + usize::from(guess);
        self.gpu
            .route_topk(logits.ptr, route_rows, cfg.n_expert, k, wts.ptr, ids, 0, 0)
            .map_err(cuda_err("route_topk"))?;
        let n_guess = if guess { k } else { 0 };
        // A decode step may leave experts to the CPU: its input comes with the routes,
        // written to the host by a kernel at the segment's end. The host sees them
        // as they land, sooner than a download's synchronisation would tell it.
        let publish = t_n == 1;
        if publish {
            t.publish_routes(&self.gpu, ids, rows + n_guess, x.ptr, x.cols)?;
        }
        self.seg_break()?;
        t.trace_dev(&self.gpu, layer, DevPoint::SegEnd)?;
        let t0 = Instant::now();
        let got = if publish {
            t.read_published(&self.gpu, layer, rows, n_guess, x.cols)?
        } else {
            t.read_routes(&self.gpu, layer, ids, rows, n_guess)?
        };
        t.trace_host(layer, HostPoint::Read);
        let (routes, x_host) = (got.routes, got.x);
        let wait = t0.elapsed();
        t.wait_ahead(&self.gpu, layer)?;
        let mut store = t.store.borrow_mut();
        let bytes = store.plan().layers[layer].expert_bytes;
        let batches = store
            .step(layer, &routes, &|misses| {
                if t_n == 1 {
                    t.to_cpu(misses, bytes)
                } else {
                    0
                }
            })
            .map_err(|e| ExecError::new("expert store", e))?;
        drop(store);
        let fused = t_n == 1
            && self.fused
            && batches.len() == 1
            && !batches[0].pool
            && fused_moe(m, cfg.n_expert, k);
        let routed = if fused {
            self.tiered_fused(t, layer, m, x, xq, &batches[0], &routes, &x_host, wts.ptr)
                .map(Routed::Combined)
        } else {
            self.tiered_batches(t, layer, m, x, xq, &batches, &routes, &x_host)
        };
        if routed.is_err() {
            // The store took every batch's fetches as done: a failed one's, and those
            // after it, which never ran. No later step may take their slots for hits.
            let mut store = t.store.borrow_mut();
            for b in &batches {
                store.forget(layer, &b.fetch);
            }
        }
        let routed = routed?;
        let next = layer + 1;
        // A decode token: the next layer's guessed experts start on their way to its
        // slots now, beside this layer's last products and the next layer's mixer.
        if !got.guesses.is_empty() {
            let n = t.guesses.min(got.guesses.len());
            t.copy_ahead(&self.gpu, next, &self.w.layers[next].moe, &got.guesses[..n])?;
        }
        // A long prompt chunk: the next layer's experts start on their way to the
        // pool now, beside this layer's last products and the next layer's mixer.
        if t_n > 1 && next < t.store.borrow().n_layer() {
            t.prefetch(&self.gpu, next, &self.w.layers[next].moe, t_n)?;
        }
        let ns = |d: Duration| d.as_nanos() as u64;
        t.store
            .borrow_mut()
            .add_step_time(ns(t0.elapsed()), ns(wait));
        self.seg_resume()?;
        Ok(routed)
    }

    /// A tiered decode step's routed experts through the fused kernels, when one
    /// batch holds them all: the misses copied into their slots, the given slots'
    /// gate/up (the CPU's ranks skipped) in one launch, and once the CPU's rows are
    /// queued, the down products combined with them in one more. The CPU's team
    /// computes its experts beside this thread's issuing.
    #[allow(clippy::too_many_arguments)]
    fn tiered_fused(
        &self,
        t: &Tiered,
        layer: usize,
        m: &MoeDev,
        x: &DBuf,
        xq: ActQ8,
        b: &Batch,
        routes: &[u32],
        x_host: &[f32],
        wts: u64,
    ) -> Result<DBuf, ExecError> {
        // Each rank's slot, or -1 where the CPU computes it.
        let slots = b.slots_of(routes);
        if let Some(r) =
            (0..routes.len()).find(|&r| slots[r] < 0 && !b.cpu.iter().any(|&(e, _)| e == routes[r]))
        {
            return Err(ExecError::new(
                "expert store",
                format!("layer {layer}: rank {r}'s expert has neither a slot nor the CPU"),
            ));
        }
        let dev_slots = self.arena.alloc_bytes(4 * slots.len(), "route")?;
        let given = self
            .arena
            .alloc(routes.len(), self.cfg.n_embd, "expert products")?;
        let issue = || -> Result<FusedAct, ExecError> {
            t.fetch(&self.gpu, layer, matrices(m), &b.fetch, Lane::Stream)?;
            t.upload_slots(&self.gpu, &slots, dev_slots)?;
            let a = self.fused_gate_up(m, x, xq, MoeRoute::Given { ids: dev_slots })?;
            t.trace_dev(&self.gpu, layer, DevPoint::Products)?;
            Ok(a)
        };
        let a = if b.cpu.is_empty() {
            issue()?
        } else {
            // `given` holds only the CPU's rows: they may go in one copy, on the
            // copier beside the slots' products (7–9% faster decode than after them
            // on the stream; bench/RESULTS.md, 2026-12-04).
            let to = RowsTo::Given {
                dst: given.ptr,
                cols: given.cols,
            };
            let (a, ()) = t.cpu_beside(&self.gpu, layer, b, x_host, routes, to, issue, || ())?;
            a?
        };
        let out = self.fused_down(m, &a, dev_slots, wts, given.ptr)?;
        t.trace_dev(&self.gpu, layer, DevPoint::Down)?;
        Ok(out)
    }

    /// The batches of a tiered step through the tile kernels (prompts, and decode
    /// steps the fused kernels do not take): each batch's misses copied in, its
    /// slots' products (or the prompt pool's), the CPU's experts beside; then the
    /// shared expert.
    #[allow(clippy::too_many_arguments)]
    fn tiered_batches(
        &self,
        t: &Tiered,
        layer: usize,
        m: &MoeDev,
        x: &DBuf,
        xq: ActQ8,
        batches: &[Batch],
        routes: &[u32],
        x_host: &[f32],
    ) -> Result<Routed, ExecError> {
        let cfg = &self.cfg;
        let (k, rows) = (cfg.n_expert_used, routes.len());
        let g = self
            .arena
            .alloc(rows, m.gate_exps.n_rows, "expert products")?;
        let u = self
            .arena
            .alloc(rows, m.up_exps.n_rows, "expert products")?;
        let act = self.arena.alloc(rows, m.gate_exps.n_rows, "swiglu")?;
        let down = self
            .arena
            .alloc(rows, m.down_exps.n_rows, "expert products")?;
        let aq = if is_float(m.down_exps.ty) {
            ActQ8::default()
        } else {
            self.arena.alloc_act_q8(rows, act.cols)?
        };
        let tile_bytes = std::mem::size_of::<Tile>();
        // prompt_tiles makes at most ⌈n/8⌉ tiles of an expert with n routes, or in
        // groups, TILE_GROUP·⌈n/32⌉ ≤ TILE_GROUP·(⌈n/8⌉) (n ≥ 1).
        let max_tiles = TILE_GROUP * (rows.div_ceil(TILE_TOKENS) + cfg.n_expert);
        let ta = self.arena.alloc_bytes(max_tiles * tile_bytes, "route")?;
        let tb = self.arena.alloc_bytes(max_tiles * tile_bytes, "route")?;
        let slots = matrices(m);
        let per_route = self.route_scales(m, routes)?;
        let pool = batches
            .iter()
            .any(|b| b.pool)
            .then(|| t.pool_mats(m))
            .flatten();
        let mut shared = None;
        // Several batches overlap copies with products: a batch's copies run on the
        // copier as soon as the batch they overwrite (`Batch::after`) has computed,
        // and the batch computes once its copies have landed (per-batch events). The
        // store never puts consecutive slot batches in the same slots, so batch i+1's
        // copies run while batch i computes; the pool's batch, filled during the
        // mixer, computes while the first slot copies run. The shared expert runs
        // beside the copies that wait for nothing.
        let double = batches.len() > 1;
        let gpu = &self.gpu;
        let events = if double {
            Some(t.batch_events(gpu, batches.len())?)
        } else {
            None
        };
        let ord = cuda_err("order expert copies");
        // Issues batch j's copies on the copier (after whatever the copier was made
        // to wait for) and records where they end.
        let copy = |j: usize| -> Result<(), ExecError> {
            if let Some(events) = &events {
                t.fetch(gpu, layer, slots, &batches[j].fetch, Lane::Copier)?;
                gpu.record(Lane::Copier, &events[j][1]).map_err(&ord)?;
            }
            Ok(())
        };
        if double {
            // After the slots' readers in earlier steps.
            gpu.copier_waits().map_err(&ord)?;
            for (j, b) in batches.iter().enumerate() {
                if b.after.is_none() && !b.fetch.is_empty() {
                    copy(j)?;
                }
            }
            shared = Some(self.shared_expert(m, x, xq)?);
        }
        for (i, b) in batches.iter().enumerate() {
            // The device's part of the batch: its copies (or a wait for them), its
            // experts' products, and the copies that waited for them.
            let issue = || -> Result<(), ExecError> {
                let mats = if b.pool {
                    t.wait_pool(gpu)?;
                    let p = pool.as_ref().ok_or_else(|| {
                        ExecError::new("expert store", "a pool batch without a pool")
                    })?;
                    [&p[0], &p[1], &p[2]]
                } else if let Some(events) = events.as_ref().filter(|_| !b.fetch.is_empty()) {
                    gpu.wait_event(Lane::Stream, &events[i][1]).map_err(&ord)?;
                    slots
                } else {
                    t.fetch(gpu, layer, slots, &b.fetch, Lane::Stream)?;
                    slots
                };
                // Routes of this batch's experts, named by slot; the others are skipped.
                let (gu, dn, grouped) = self.prompt_tiles(&b.slots_of(routes), k);
                if !gu.is_empty() {
                    self.put_tiles(&gu, ta)?;
                    self.put_tiles(&dn, tb)?;
                    self.mm_tiles_into(mats[0], x, xq, ta, gu.len(), grouped, &g, per_route[0])?;
                    self.mm_tiles_into(mats[1], x, xq, ta, gu.len(), grouped, &u, per_route[1])?;
                    // Rows of other batches are recomputed alike (element- and row-wise ops).
                    self.swiglu_into(&g, &u, &act)?;
                    if !is_float(m.down_exps.ty) {
                        self.gpu
                            .quantize_act(act.ptr, act.rows, act.cols, aq)
                            .map_err(cuda_err("quantize_act"))?;
                    }
                    self.mm_tiles_into(
                        mats[2],
                        &act,
                        aq,
                        tb,
                        dn.len(),
                        grouped,
                        &down,
                        per_route[2],
                    )?;
                }
                if b.pool {
                    t.pool_read(gpu)?;
                }
                if let Some(events) = &events {
                    let later: Vec<usize> = (i + 1..batches.len())
                        .filter(|&j| batches[j].after == Some(i) && !batches[j].fetch.is_empty())
                        .collect();
                    if !later.is_empty() {
                        gpu.record(Lane::Stream, &events[i][0]).map_err(&ord)?;
                        gpu.wait_event(Lane::Copier, &events[i][0]).map_err(&ord)?;
                        for j in later {
                            copy(j)?;
                        }
                    }
                }
                Ok(())
            };
            // The shared expert, issued once (beside the CPU's down products).
            let first = shared.is_none();
            let shared_issue = || first.then(|| self.shared_expert(m, x, xq)).transpose();
            let s = if b.cpu.is_empty() {
                issue()?;
                shared_issue()?
            } else {
                // The CPU computes its experts on its team while this thread issues
                // the device's work: gate/up beside the copies and the slots'
                // products, down beside the shared expert.
                // The GPU's products fill the other rows of `down`: a copy a row.
                let to = RowsTo::Down {
                    dst: down.ptr,
                    cols: down.cols,
                };
                let (issued, s) =
                    t.cpu_beside(&self.gpu, layer, b, x_host, routes, to, issue, shared_issue)?;
                issued?;
                s?
            };
            shared = shared.or(s);
        }
        let shared = match shared {
            Some(s) => s,
            None => self.shared_expert(m, x, xq)?,
        };
        Ok(Routed::Parts(down, shared))
    }

    /// The second-level scale of each route's expert for the gate, up and down
    /// matrices of `m` (those with scales), on the device in one upload: the tiles of a
    /// tiered layer name slots, not experts. 0 for a matrix without scales.
    fn route_scales(&self, m: &MoeDev, routes: &[u32]) -> Result<[u64; 3], ExecError> {
        let mats = [&m.gate_exps, &m.up_exps, &m.down_exps];
        let n_scaled = mats.iter().filter(|w| w.scale.is_some()).count();
        let mut out = [0u64; 3];
        if n_scaled == 0 {
            return Ok(out);
        }
        let dev = self.arena.alloc(n_scaled, routes.len(), "route scales")?;
        let mut host = Vec::with_capacity(n_scaled * routes.len());
        for (o, w) in out.iter_mut().zip(mats) {
            let Some(s) = &w.scale else { continue };
            *o = dev.ptr + (host.len() * 4) as u64;
            host.extend(routes.iter().map(|&e| s.host[e as usize]));
        }
        self.gpu
            .copy_to_device(&host, dev.ptr)
            .map_err(cuda_err("upload route scales"))?;
        Ok(out)
    }
}
