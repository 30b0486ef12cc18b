//! Sampling on the device (`kernels/sample.cu`): `engine::sampler::sample_with` for
//! several rows of logits at once, with only the tokens coming back. Each row is
//! spread over the whole GPU (blocks of [`CHUNK`] ids) by four kernels; the rows keep
//! what the kernels tell each other in a scratch buffer of
//! [`sample_scratch_words`] words.

use super::{addr, int};
use crate::error::CudaError;
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;

/// Words of one row's parameters in [`sample_words`]' layout (SC_SAMPLE_PARAM_WORDS).
const PARAM_WORDS: usize = 10;
/// Words of one edit (SC_SAMPLE_EDIT_WORDS).
const EDIT_WORDS: usize = 4;
/// Ids per block (SC_SAMPLE_CHUNK) and threads per block (SC_SAMPLE_THREADS).
const CHUNK: usize = 4096;
const THREADS: u32 = 512;
/// A row's scratch before its blocks' words (SC_PART_OFF: the row's state, the
/// buckets' counts and masses), words per block (an ScPart), and the candidate list's
/// length (SC_SAMPLE_CAND; two words each).
const ROW_HEAD_WORDS: usize = 64 + 3 * 240;
const PART_WORDS: usize = 4;
const CANDIDATES: usize = 32768;

/// Words of scratch a row takes for `n` logits (even, so that every row's u64 words
/// stay aligned).
fn row_words(n: usize) -> usize {
    ROW_HEAD_WORDS + PART_WORDS * n.div_ceil(CHUNK) + 2 * CANDIDATES
}

/// Words of scratch [`Gpu::sample_rows`] needs for `rows` rows of `n` logits.
pub fn sample_scratch_words(n: usize, rows: usize) -> usize {
    row_words(n) * rows
}

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
    /// `scratch` holds `scratch_words` u32 words, at least [`sample_scratch_words`],
    /// zeroed before its first use for this `n`: the kernels leave it ready for the
    /// next call with the same `n` (any number of rows).
    #[allow(clippy::too_many_arguments)]
    pub fn sample_rows(
        &self,
        logits: u64,
        n: usize,
        rows: usize,
        params: u64,
        out_idx: u64,
        scratch: u64,
        scratch_words: usize,
    ) -> Result<(), CudaError> {
        const KN: &str = "sample_rows";
        if n == 0 {
            return Err(CudaError::bad(KN, "sampling from no logits"));
        }
        if rows == 0 {
            return Ok(());
        }
        if scratch_words < sample_scratch_words(n, rows) {
            return Err(CudaError::bad(
                KN,
                format!(
                    "scratch of {scratch_words} words for {rows} rows of {n} logits (needs {})",
                    sample_scratch_words(n, rows)
                ),
            ));
        }
        let edits = params + (rows * PARAM_WORDS * 4) as u64;
        let args = [
            Arg::P(addr(KN, "logits", logits, 4)?),
            Arg::I32(int(KN, "n", n)?),
            Arg::P(addr(KN, "params", params, 4)?),
            Arg::P(addr(KN, "edits", edits, 4)?),
            Arg::P(addr(KN, "out_idx", out_idx, 4)?),
            Arg::P(addr(KN, "scratch", scratch, 8)?),
            Arg::I32(int(KN, "row_words", row_words(n))?),
        ];
        let rows = u32::try_from(rows).map_err(|_| CudaError::bad(KN, "too many rows"))?;
        let blocks = u32::try_from(n.div_ceil(CHUNK)).map_err(|_| CudaError::bad(KN, "n"))?;
        for k in [K::SampleMax, K::SampleWeigh, K::SampleGather, K::SampleDraw] {
            self.launch(k, [blocks, rows, 1], THREADS, 0, &args)?;
        }
        Ok(())
    }
}
