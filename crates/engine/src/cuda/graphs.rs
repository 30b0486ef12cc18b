//! Decode steps as CUDA graphs: a sequence's step (or a batched pass over several
//! sequences, or a tiered step's segments) is captured the first time and replayed
//! after. When the GPU runs out of memory while serving (another process took VRAM
//! since startup), a step whose graph cannot be captured, instantiated or launched
//! runs the same kernels one by one — the same bits, slower — and no new graph is
//! captured for [`PRESSURE_RETRY`] ([`Pressure`]).

use super::backend::SegRun;
use super::weights::{self, cuda_err, is_out_of_vram};
use super::{gib, CudaExecutor};
use crate::exec::{SeqStep, Want};
use cuda::Graph;
use model::ExecError;
use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Graphs kept at once in each keyed cache (batched decode passes by their list of
/// sequences, MTP passes, verify steps).
const MAX_KEYED_GRAPHS: usize = 64;

/// A captured decode step of one sequence: replaying it runs one token.
pub(super) struct DecodeGraph {
    pub(super) graph: Graph,
    /// Logits (n_vocab) or the greedy token id (one i32), on the device.
    pub(super) out: u64,
}

/// A tiered decode step of one sequence captured as segments (see `SegRun`).
pub(super) struct DecodeSegments {
    graphs: Vec<Graph>,
    out: u64,
}

/// How long after running out of device memory the executor captures no new CUDA
/// graph (and `/health` warns).
pub const PRESSURE_RETRY: Duration = Duration::from_secs(30);

/// The GPU ran out of memory while serving: another process took VRAM since
/// startup (the executor's own buffers were all allocated then). A decode step
/// whose graph is not captured yet runs the same kernels one by one (the same bits,
/// slower) until `retry_at`; graphs captured before go on being replayed. It ends
/// at the first step that completes without running out after `retry_at`.
pub(super) struct Pressure {
    /// What failed, with the free VRAM then.
    pub(super) what: String,
    pub(super) at: Instant,
    pub(super) retry_at: Instant,
}

impl CudaExecutor {
    /// Captures the kernels `launch` issues as a graph, with the address of its
    /// output. Nothing runs on the device meanwhile, so when the capture itself
    /// fails (the inner error: e.g. out of VRAM to instantiate the graph) the caller
    /// may launch the same kernels without a graph; the outer error is `launch`'s.
    pub(super) fn capture(
        &mut self,
        launch: impl FnOnce(&mut Self) -> Result<u64, ExecError>,
    ) -> Result<Result<DecodeGraph, cuda::CudaError>, ExecError> {
        if let Err(e) = self.be.gpu.begin_capture() {
            return Ok(Err(e));
        }
        let out = launch(self);
        // End the capture whatever happened, so the stream is usable again.
        let graph = self
            .be
            .gpu
            .end_capture()
            .and_then(|g| injected_graph_oom().map(|()| g));
        let out = out?;
        Ok(graph.map(|graph| DecodeGraph { graph, out }))
    }

    /// A graph could not be captured or launched (`e`, in `op`): out of VRAM, the
    /// step goes on without it (Ok, after the warning); any other error fails the
    /// step (a sticky one fatally).
    pub(super) fn graph_failed(&mut self, op: &str, e: cuda::CudaError) -> Result<(), ExecError> {
        if !e.is_out_of_memory() {
            return Err(cuda_err(op)(e));
        }
        self.out_of_vram(&format!("{op}: {e}"));
        Ok(())
    }

    /// Notes that the GPU ran out of memory doing `what` (see [`Pressure`]): a
    /// warning in the log when it starts, then a quiet renewal each time.
    pub(super) fn out_of_vram(&mut self, what: &str) {
        let ordinal = self.ordinal;
        let free = match self.be.gpu.mem_info() {
            Ok((free, total)) => format!("{:.2} GiB free of {:.2} GiB", gib(free), gib(total)),
            Err(_) => "free VRAM unknown".to_string(),
        };
        // The remedy is said once, after.
        let what = what.replace(&format!(": {}", weights::OUT_OF_VRAM), "");
        let what = format!("cuda:{ordinal}: {what} ({free} then)");
        let now = Instant::now();
        if self.pressure.is_none() {
            tracing::warn!(
                "{what}: another process took VRAM since scoria started. Decode steps \
                 whose CUDA graphs are not captured yet run their kernels one by one (the \
                 same output, slower), and capturing is tried again in {} s; a request \
                 whose step cannot run fails with this error and the next ones go on. \
                 Free the GPU, or run scoria with a lower --vram-budget or --parallel",
                PRESSURE_RETRY.as_secs()
            );
        } else {
            tracing::debug!("{what}: still short of VRAM");
        }
        self.pressure = Some(Pressure {
            what,
            at: now,
            retry_at: now + PRESSURE_RETRY,
        });
    }

    /// A step completed: the shortage of VRAM is over once it is `PRESSURE_RETRY`
    /// old (graphs are captured again from this step on).
    pub(super) fn end_pressure(&mut self) {
        if self
            .pressure
            .as_ref()
            .is_some_and(|p| Instant::now() >= p.retry_at)
        {
            self.pressure = None;
            tracing::info!(
                "cuda:{}: no shortage of VRAM for {} s: decode steps are captured as CUDA \
                 graphs again",
                self.ordinal,
                PRESSURE_RETRY.as_secs()
            );
        }
    }

    /// True while no new graph should be captured (out of VRAM lately).
    pub(super) fn capture_paused(&self) -> bool {
        self.pressure
            .as_ref()
            .is_some_and(|p| Instant::now() < p.retry_at)
    }

    /// One decode token of sequence `s.seq` without a graph: the kernels the
    /// captured step holds, launched one by one (what `SCORIA_NO_GRAPH` runs).
    pub(super) fn decode_eager(&mut self, s: &SeqStep) -> Result<u64, ExecError> {
        if let Some(t) = &self.be.tiered {
            // Clears what a failed step left in the routing mailbox.
            t.begin_token(&self.be.gpu, false)?;
        }
        let out = self.launch_step(s.seq, s.tokens, s.pos0, s.want, Default::default())?;
        if let Some(t) = &self.be.tiered {
            t.end_token(&self.be.gpu)?;
        }
        Ok(out)
    }

    /// One decode token of sequence `seq` through its captured graph
    /// (capturing it the first time).
    /// Without VRAM for the graph (see [`Pressure`]), the same kernels one by one.
    pub(super) fn decode_graph(&mut self, s: &SeqStep) -> Result<u64, ExecError> {
        let slot = usize::from(s.want == Want::Greedy);
        if self.graphs[s.seq][slot].is_none() {
            if self.capture_paused() {
                return self.decode_eager(s);
            }
            match self
                .capture(|ex| ex.launch_step(s.seq, s.tokens, s.pos0, s.want, Default::default()))?
            {
                Ok(g) => self.graphs[s.seq][slot] = Some(g),
                Err(e) => {
                    self.graph_failed("capture a decode step", e)?;
                    return self.decode_eager(s);
                }
            }
        }
        let g = self.graphs[s.seq][slot]
            .as_ref()
            .ok_or_else(|| ExecError::new("decode", "graph missing"))?;
        match g.graph.launch(&self.be.gpu) {
            Ok(()) => Ok(g.out),
            Err(e) => {
                // Nothing of it ran: the same kernels without the graph.
                self.graphs[s.seq][slot] = None;
                self.graph_failed("launch a decode step's graph", e)?;
                self.decode_eager(s)
            }
        }
    }

    /// One tiered decode token of sequence `seq`: its device work between the MoE
    /// layers' host parts replayed from graph segments (captured the first time).
    /// Out of VRAM for a segment's graph (see [`Pressure`]): when no segment of
    /// the step has run yet, the step runs its kernels one by one instead; past the
    /// first segment the step fails (its state is part-way; the scheduler starts
    /// the slot over).
    pub(super) fn decode_segments(&mut self, s: &SeqStep) -> Result<u64, ExecError> {
        let slot = usize::from(s.want == Want::Greedy);
        if self.segments[s.seq][slot].is_none() && self.capture_paused() {
            return self.decode_eager(s);
        }
        let cached = self.segments[s.seq][slot].take();
        let record = cached.is_none();
        let (graphs, recorded_out) = cached.map_or((Vec::new(), None), |c| (c.graphs, Some(c.out)));
        *self.be.seg.borrow_mut() = Some(SegRun {
            record,
            graphs,
            next: 0,
        });
        let gpu = &self.be.gpu;
        if let Some(t) = &self.be.tiered {
            t.begin_token(gpu, !record)?;
        }
        let begin = if record {
            gpu.begin_capture()
                .map_err(cuda_err("capture a step segment"))
        } else {
            gpu.set_skip(true);
            Ok(())
        };
        let out = begin
            .and_then(|()| self.launch_step(s.seq, s.tokens, s.pos0, s.want, Default::default()))
            .and_then(|out| self.be.seg_break().map(|()| out));
        let run = self.be.seg.borrow_mut().take();
        let gpu = &self.be.gpu;
        gpu.set_skip(false);
        if gpu.is_capturing() {
            // A failure mid-capture: close it so the stream is usable again.
            let _ = gpu.end_capture();
        }
        let out = match out {
            Err(e) if is_out_of_vram(&e) => {
                self.out_of_vram(&e.to_string());
                if run.as_ref().is_some_and(|r| r.graphs.is_empty()) {
                    // No segment ran: the same kernels without graphs.
                    return self.decode_eager(s);
                }
                return Err(e);
            }
            out => out?,
        };
        let run = run.ok_or_else(|| ExecError::new("decode", "segment state missing"))?;
        if recorded_out.is_some_and(|o| o != out) {
            return Err(ExecError::new(
                "decode",
                "the replayed step's output is not where the captured one wrote it",
            ));
        }
        if !record && run.next != run.graphs.len() {
            return Err(ExecError::new(
                "decode",
                format!(
                    "the step ran {} of its {} captured segments",
                    run.next,
                    run.graphs.len()
                ),
            ));
        }
        self.segments[s.seq][slot] = Some(DecodeSegments {
            graphs: run.graphs,
            out,
        });
        if let Some(t) = &self.be.tiered {
            t.end_token(&self.be.gpu)?;
        }
        Ok(out)
    }

    /// One token of each of `entries`' sequences in one batched pass (`launch_rows`),
    /// replayed from the graph captured for this list of sequences (see
    /// [`Self::replay`]). Returns where the logits rows are.
    pub(super) fn decode_rows(&mut self, entries: &[&SeqStep]) -> Result<u64, ExecError> {
        let key: Vec<usize> = entries.iter().map(|e| e.seq).collect();
        self.replay(
            |ex| &mut ex.row_graphs,
            key,
            "a batched decode step",
            |ex| ex.launch_rows(entries),
        )
    }

    /// The kernels `launch` issues, replayed from the graph kept under `key` in the
    /// cache `cache` names (captured the first time; a full cache is emptied first).
    /// Without graphs, while capturing is paused, or without VRAM for the graph (see
    /// [`Pressure`]), the same kernels one by one. `what` names the pass in errors.
    /// Returns `launch`'s output address.
    pub(super) fn replay<K: Hash + Eq + Clone>(
        &mut self,
        cache: fn(&mut Self) -> &mut HashMap<K, DecodeGraph>,
        key: K,
        what: &str,
        launch: impl Fn(&mut Self) -> Result<u64, ExecError>,
    ) -> Result<u64, ExecError> {
        if !self.use_graphs {
            return launch(self);
        }
        if !cache(self).contains_key(&key) && !self.capture_paused() {
            if cache(self).len() >= MAX_KEYED_GRAPHS {
                cache(self).clear();
            }
            match self.capture(&launch)? {
                Ok(g) => {
                    cache(self).insert(key.clone(), g);
                }
                Err(e) => self.graph_failed(&format!("capture {what}"), e)?,
            }
        }
        let Some(g) = cache(self).remove(&key) else {
            return launch(self);
        };
        match g.graph.launch(&self.be.gpu) {
            Ok(()) => {
                let out = g.out;
                cache(self).insert(key, g);
                Ok(out)
            }
            Err(e) => {
                // Nothing of it ran: the same kernels without the graph.
                self.graph_failed(&format!("launch {what}'s graph"), e)?;
                launch(self)
            }
        }
    }
}

/// The fault-injection hook of a graph's instantiation (`fault::Site::GpuGraph`):
/// an injected fault fails it as the driver does when VRAM is short. Nothing
/// without the `fault-injection` feature.
pub(crate) fn injected_graph_oom() -> Result<(), cuda::CudaError> {
    match crate::fault::hit(
        crate::fault::Site::GpuGraph,
        std::path::Path::new("cuda graph"),
        0,
    ) {
        Some(_) => Err(cuda::CudaError::Driver {
            call: "cuGraphInstantiate".into(),
            code: "CUDA_ERROR_OUT_OF_MEMORY (out of memory; injected by a test)".into(),
        }),
        None => Ok(()),
    }
}
