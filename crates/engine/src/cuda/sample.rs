//! `Want::Sample` on the GPU: the sampler's draw runs where the logits are
//! (`Gpu::sample_rows`, the same definition as `sampler::sample_with`, bit for bit),
//! and only the token comes back.

use super::CudaExecutor;
use crate::sampler::Draw;
use model::ExecError;

use super::weights::cuda_err;

/// Words the parameter buffer starts with (grown when a step needs more: many
/// penalised ids).
const MIN_WORDS: usize = 16 << 10;

impl CudaExecutor {
    /// Samples rows of the logits at `logits` (f32 [.. × n_vocab]): each `(row, out,
    /// draw)` writes its token to `argmax_out[out]`, after anything already queued
    /// there (so a row's greedy id may be overwritten by its sampled one).
    pub(super) fn sample_rows(
        &mut self,
        logits: u64,
        rows: &[(usize, usize, &Draw)],
    ) -> Result<(), ExecError> {
        if rows.is_empty() {
            return Ok(());
        }
        let edits: Vec<Vec<(u32, f32, f32, f32)>> = rows
            .iter()
            .map(|(_, _, d)| {
                d.edits
                    .iter()
                    .map(|e| (e.id, e.add, e.repeat, e.sub))
                    .collect()
            })
            .collect();
        let specs: Vec<cuda::SampleRow> = rows
            .iter()
            .zip(&edits)
            .map(|(&(row, out, d), edits)| cuda::SampleRow {
                row,
                out,
                temperature: d.temperature,
                top_k: d.top_k,
                top_p: d.top_p,
                min_w: d.min_w,
                bits: d.bits,
                edits,
            })
            .collect();
        let words = cuda::sample_words(&specs).map_err(cuda_err("sample"))?;
        let gpu = &self.be.gpu;
        if self
            .sample_params
            .as_ref()
            .is_none_or(|b| b.len() < words.len())
        {
            self.sample_params = None;
            let n = words.len().max(MIN_WORDS).next_power_of_two();
            self.sample_params = Some(
                gpu.alloc::<u32>(n, "sampling parameters")
                    .map_err(cuda_err("allocate"))?,
            );
        }
        let params = self
            .sample_params
            .as_ref()
            .map(|b| b.ptr())
            .ok_or_else(|| ExecError::new("sample", "no parameter buffer"))?;
        gpu.copy_to_device(&words, params)
            .map_err(cuda_err("upload sampling parameters"))?;
        let n_vocab = self.be.cfg.n_vocab;
        let need = cuda::sample_scratch_words(n_vocab, rows.len());
        if self.sample_scratch.as_ref().is_none_or(|b| b.len() < need) {
            // Rows of a step at a time: grown to the most a step has sampled (zeroed,
            // as the kernels need it the first time).
            self.sample_scratch = None;
            self.sample_scratch = Some(
                gpu.alloc::<u32>(need, "sampling scratch")
                    .map_err(cuda_err("allocate"))?,
            );
        }
        let scratch = self
            .sample_scratch
            .as_ref()
            .ok_or_else(|| ExecError::new("sample", "no scratch buffer"))?;
        gpu.sample_rows(
            logits,
            n_vocab,
            rows.len(),
            params,
            self.argmax_out.ptr(),
            scratch.ptr(),
            scratch.len(),
        )
        .map_err(cuda_err("sample"))
    }
}
