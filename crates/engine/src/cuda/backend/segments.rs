//! A tiered decode step cut into graph segments where the host takes part (each
//! MoE layer reads its routing and moves experts): the device work between two such
//! points is captured once per sequence and replayed after, while the host work in
//! between runs every step. Launches inside a replayed segment are skipped
//! (`Gpu::set_skip`): the arena hands out the same addresses in the same order, so
//! the graphs read and write where this step's eager work expects.

use super::CudaBackend;
use crate::cuda::weights::cuda_err;
use cuda::Graph;
use model::ExecError;

/// The segments mode's state: a step being recorded (`record`: each segment is
/// captured as it ends) or replayed (`graphs[next]` is the segment to launch next).
pub(crate) struct SegRun {
    pub record: bool,
    pub graphs: Vec<Graph>,
    pub next: usize,
}

impl CudaBackend {
    /// Ends the current segment of a segmented step: launches it (just captured, or
    /// captured by an earlier step) so the host can read what it computed.
    pub(crate) fn seg_break(&self) -> Result<(), ExecError> {
        let mut seg = self.seg.borrow_mut();
        let Some(r) = seg.as_mut() else {
            return Ok(());
        };
        if r.record {
            let g = self
                .gpu
                .end_capture()
                .and_then(|g| crate::cuda::injected_graph_oom().map(|()| g))
                .map_err(cuda_err("capture a step segment"))?;
            g.launch(&self.gpu)
                .map_err(cuda_err("launch a step segment"))?;
            r.graphs.push(g);
        } else {
            self.gpu.set_skip(false);
            let g = r.graphs.get(r.next).ok_or_else(|| {
                ExecError::new("decode", "the step has more segments than were captured")
            })?;
            g.launch(&self.gpu)
                .map_err(cuda_err("launch a step segment"))?;
            r.next += 1;
        }
        Ok(())
    }

    /// Starts the next segment after the host's part (see [`SegRun`]).
    pub(crate) fn seg_resume(&self) -> Result<(), ExecError> {
        match self.seg.borrow().as_ref() {
            Some(r) if r.record => self
                .gpu
                .begin_capture()
                .map_err(cuda_err("capture a step segment")),
            Some(_) => {
                self.gpu.set_skip(true);
                Ok(())
            }
            None => Ok(()),
        }
    }
}
