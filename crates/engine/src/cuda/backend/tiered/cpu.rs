//! The CPU's side of tiered experts: a decode step may leave some misses held in
//! RAM to the CPU kernels (the cost model's split), which compute them on a team of
//! threads that stay awake while a decode runs, beside this thread issuing the
//! device's work; their output rows are queued to the device from pinned memory.
//! The cost model's numbers are measured at load.

use super::{pinned, Tiered};
use crate::cpu::{ExpertMat, TokenExperts};
use crate::cuda::trace::{DevPoint, HostPoint};
use crate::cuda::weights::cuda_err;
use crate::experts::{fit_cpu, Batch};
use cuda::{Gpu, Lane};
use model::ExecError;
use std::time::Instant;

/// Where a decode step's CPU rows go: row r (for route r) of a device matrix at
/// `dst`, `cols` floats a row.
#[derive(Clone, Copy)]
pub(crate) enum RowsTo {
    /// The fused down kernel's `given` rows, of which the CPU's are the only ones
    /// read (the others are unused scratch): one copy covers all the CPU's rows and
    /// the rows between, on the copier, where it runs beside the device's own
    /// products queued before it (the stream waits for it before it reads the rows).
    Given { dst: u64, cols: usize },
    /// The tile kernels' down products, whose other rows are the device's own: one
    /// copy a row, on the stream.
    Down { dst: u64, cols: usize },
}

impl Tiered {
    /// Measures the cost model on this machine: a pinned copy of experts into
    /// `probe` (device address and bytes: empty slots, so no VRAM beyond the
    /// budget), and the CPU computing 1, 2, 4 and 8 experts of one layer, from the pinned
    /// copy and, when `map_ok` (the page cache can keep the file's experts beside
    /// the pinned copy), from the mapped file.
    ///
    /// The layer measured is the first of the largest copies (the last one written
    /// may still sit in the CPU's cache), and every timed call reads experts no
    /// earlier call read, so the CPU's rate is one of RAM, not of its cache.
    pub(super) fn measure(
        &mut self,
        gpu: &Gpu,
        probe: (u64, usize),
        map_ok: bool,
    ) -> Result<(), ExecError> {
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
        let x: Vec<f32> = (0..self.n_embd)
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

    /// The gate, up and down matrices (type, bytes, second-level scale) of the
    /// experts `cpu` ((expert, RAM offset)) of layer `layer` as the CPU reads them
    /// (the pinned copy or the mapped file, whichever measured faster, the pinned copy
    /// once the file was found changed), and the layer's n_ff.
    fn cpu_mats(&self, layer: usize, cpu: &[(u32, usize)]) -> (Vec<[ExpertMat<'_>; 3]>, usize) {
        let shapes = self.shapes(layer);
        let ram = self.ram[layer].as_slice();
        let mapped = &self.mapped[layer];
        let from_map = self.cpu_from_map && !self.file_changed.get();
        let mats = cpu
            .iter()
            .map(|&(e, off)| {
                let mut at = off;
                std::array::from_fn(|j| {
                    let (ty, len) = shapes[j];
                    let bytes = if from_map {
                        mapped[j].matrix_bytes(e as usize)
                    } else {
                        &ram[at..at + len]
                    };
                    at += len;
                    (ty, bytes, mapped[j].scale(e as usize))
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

    /// Queues the CPU's expert outputs `outs` (one per expert of `cpu`) as rows of
    /// the device matrix `to` names: each goes to every row `r` whose route
    /// `routes[r]` is its expert, in one copy from the first such row to the last
    /// where the rows between are spare ([`RowsTo::Given`]), else one copy a row. The
    /// copies read pinned memory, so the host does not wait for the stream to reach
    /// them.
    fn upload_outputs(
        &self,
        gpu: &Gpu,
        cpu: &[(u32, usize)],
        outs: &[Vec<f32>],
        routes: &[u32],
        to: RowsTo,
    ) -> Result<(), ExecError> {
        let (dst, cols, spare) = match to {
            RowsTo::Given { dst, cols } => (dst, cols, true),
            RowsTo::Down { dst, cols } => (dst, cols, false),
        };
        let lane = if spare { Lane::Copier } else { Lane::Stream };
        let row_bytes = cols * 4;
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
                    Some((lo, hi)) if spare => (*lo, *hi) = ((*lo).min(r), (*hi).max(r + 1)),
                    _ => spans.push((r, r + 1)),
                }
            }
        }
        for (lo, hi) in spans {
            let at = lo * row_bytes;
            gpu.copy_pinned_to_device(lane, &buf, at, (hi - lo) * row_bytes, dst + at as u64)
                .map_err(cuda_err("upload CPU expert output"))?;
        }
        if lane == Lane::Copier {
            // The stream reads the rows after the copier's copies.
            gpu.stream_waits()
                .map_err(cuda_err("order CPU expert rows"))?;
        }
        Ok(())
    }
}
