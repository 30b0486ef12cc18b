//! Sampling on the device (`kernels/sample.cu`): `engine::sampler::sample_with` for
//! several rows of logits at once, with only the tokens coming back.

use super::{addr, int};
use crate::error::CudaError;
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;

/// Words of one row's parameters in [`sample_words`]' layout (SC_SAMPLE_PARAM_WORDS).
const PARAM_WORDS: usize = 10;
/// Words of one edit (SC_SAMPLE_EDIT_WORDS).
const EDIT_WORDS: usize = 4;

/// One row to sample: `engine::sampler::Draw`'s fields (this crate does not depend
/// on the engine), and which row of the logits it reads.
#[derive(Debug, Clone, Copy)]
pub struct SampleRow<'a> {
    /// Row of the logits buffer.
    pub row: usize,
    /// Where the token goes: `out_idx[out]`.
    pub out: usize,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_w: u32,
    pub bits: u64,
    /// (id, add, repeat, sub): at most one per id.
    pub edits: &'a [(u32, f32, f32, f32)],
}

/// The parameter words of `rows` followed by their edits' words: what
/// [`Gpu::sample_rows`] reads at `params` (the edits start at `rows.len() · 10`).
pub fn sample_words(rows: &[SampleRow]) -> Result<Vec<u32>, CudaError> {
    const KN: &str = "sample_rows";
    let n_edits: usize = rows.iter().map(|r| r.edits.len()).sum();
    let mut w = Vec::with_capacity(rows.len() * PARAM_WORDS + n_edits * EDIT_WORDS);
    let mut first = 0usize;
    for r in rows {
        let row = u32::try_from(r.row).map_err(|_| CudaError::bad(KN, "row past u32"))?;
        let out = u32::try_from(r.out).map_err(|_| CudaError::bad(KN, "out past u32"))?;
        let at = u32::try_from(first).map_err(|_| CudaError::bad(KN, "too many edits"))?;
        let count =
            u32::try_from(r.edits.len()).map_err(|_| CudaError::bad(KN, "too many edits"))?;
        w.extend([
            row,
            r.temperature.to_bits(),
            r.top_k,
            r.top_p.to_bits(),
            r.min_w,
            r.bits as u32,
            (r.bits >> 32) as u32,
            at,
            count,
            out,
        ]);
        first += r.edits.len();
    }
    for r in rows {
        for &(id, add, repeat, sub) in r.edits {
            w.extend([id, add.to_bits(), repeat.to_bits(), sub.to_bits()]);
        }
    }
    Ok(w)
}

impl Gpu {
    /// Samples `rows` rows of logits (`logits`: f32 [.. × n]; each row's index is in
    /// its parameters) as `engine::sampler::sample_with` does, bit for bit: each
    /// row's token (i32) goes to `out_idx[out]`, `params` being the device copy of
    /// [`sample_words`]. The rows' logits are edited in place (scratch afterwards).
    pub fn sample_rows(
        &self,
        logits: u64,
        n: usize,
        rows: usize,
        params: u64,
        out_idx: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "sample_rows";
        if n == 0 {
            return Err(CudaError::bad(KN, "sampling from no logits"));
        }
        if rows == 0 {
            return Ok(());
        }
        let edits = params + (rows * PARAM_WORDS * 4) as u64;
        let args = [
            Arg::P(addr(KN, "logits", logits, 4)?),
            Arg::I32(int(KN, "n", n)?),
            Arg::P(addr(KN, "params", params, 4)?),
            Arg::P(addr(KN, "edits", edits, 4)?),
            Arg::P(addr(KN, "out_idx", out_idx, 4)?),
        ];
        let rows = u32::try_from(rows).map_err(|_| CudaError::bad(KN, "too many rows"))?;
        self.launch(K::SampleRows, [rows, 1, 1], 1024, 0, &args)
    }
}
