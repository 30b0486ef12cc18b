//! Row reductions and elementwise steps: rms_norm, dot_rows, add, swiglu (bit-identical
//! to `model::math`), argmax (the greedy choice of `engine::sampler::argmax`).

use super::{act_q8_args, addr, blocks, int};
use crate::error::CudaError;
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;
use crate::ops::quant::ActQ8;

/// Threads of the one-block-per-row reductions (SC_ROW_THREADS in norm.cu).
const ROW_THREADS: u32 = 1024;

/// The norm kernels' arguments followed by the quantized copy's (null for none).
fn with_q(kn: &'static str, args: &[Arg], cols: usize, q: ActQ8) -> Result<Vec<Arg>, CudaError> {
    if q != ActQ8::NONE && !cols.is_multiple_of(32) {
        return Err(CudaError::bad(
            kn,
            format!("a row of {cols} values is not whole 32-value blocks to quantize"),
        ));
    }
    let mut v = args.to_vec();
    v.extend(act_q8_args(kn, q, false)?);
    Ok(v)
}

impl Gpu {
    /// Blocks for a grid-stride elementwise kernel over n items: enough to fill the
    /// GPU, no more.
    pub(crate) fn stride_blocks(&self, n: usize) -> u32 {
        let cap = self.sm_count as usize * 16;
        n.div_ceil(256).clamp(1, cap) as u32
    }

    /// `out[r] = model::math::rms_norm(x[r], w, eps)` for `rows` rows of `cols` f32,
    /// bit-identical (sum of squares in the canonical 32-lane order, scale =
    /// 1/sqrt(ss/cols + eps), `(v·scale)·w`). `out` may be `x`. Unless `q` is
    /// [`ActQ8::NONE`], the output is also quantized into `q` in the same launch, as
    /// [`Gpu::quantize_act`] would (cols a multiple of 32).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        x: u64,
        rows: usize,
        cols: usize,
        w: u64,
        eps: f32,
        out: u64,
        q: ActQ8,
    ) -> Result<(), CudaError> {
        const KN: &str = "rms_norm";
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::I32(int(KN, "rows", rows)?),
            Arg::I32(int(KN, "cols", cols)?),
            Arg::P(addr(KN, "w", w, 4)?),
            Arg::F32(eps),
            Arg::P(addr(KN, "out", out, 4)?),
        ];
        let args = with_q(KN, &args, cols, q)?;
        let grid = [blocks(rows, 1)?, 1, 1];
        self.launch(K::RmsNorm, grid, ROW_THREADS, 0, &args)
    }

    /// The residual step and the next norm in one launch: `x += y`, then
    /// `out = rms_norm(x)·w` per row, bit-identical to [`Gpu::add`] followed by
    /// [`Gpu::rms_norm`]. `out` must not be `y`; it may be `x` only if the sum is not
    /// needed afterwards. `q` as for [`Gpu::rms_norm`].
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        x: u64,
        y: u64,
        rows: usize,
        cols: usize,
        w: u64,
        eps: f32,
        out: u64,
        q: ActQ8,
    ) -> Result<(), CudaError> {
        const KN: &str = "add_rms_norm";
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        if out == y {
            return Err(CudaError::bad(KN, "out must not be y"));
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::P(addr(KN, "y", y, 4)?),
            Arg::I32(int(KN, "rows", rows)?),
            Arg::I32(int(KN, "cols", cols)?),
            Arg::P(addr(KN, "w", w, 4)?),
            Arg::F32(eps),
            Arg::P(addr(KN, "out", out, 4)?),
        ];
        let args = with_q(KN, &args, cols, q)?;
        let grid = [blocks(rows, 1)?, 1, 1];
        self.launch(K::AddRmsNorm, grid, ROW_THREADS, 0, &args)
    }

    /// `out[t] = model::math::dot(x[t], v)` for `n_tok` rows of `n` f32 (the canonical
    /// order; the shared expert's gate logit), bit-identical.
    pub fn dot_rows(
        &self,
        x: u64,
        v: u64,
        n_tok: usize,
        n: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "dot_rows";
        if n_tok == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::P(addr(KN, "v", v, 4)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::I32(int(KN, "n", n)?),
            Arg::P(addr(KN, "out", out, 4)?),
        ];
        let grid = [blocks(n_tok, 1)?, 1, 1];
        self.launch(K::DotRows, grid, ROW_THREADS, 0, &args)
    }

    /// `x[i] += y[i]` for i < n (f32).
    pub fn add(&self, x: u64, y: u64, n: usize) -> Result<(), CudaError> {
        const KN: &str = "add";
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::P(addr(KN, "y", y, 4)?),
            Arg::I64(n as i64),
        ];
        self.launch(K::Add, [self.stride_blocks(n), 1, 1], 256, 0, &args)
    }

    /// `x[i] *= s` for i < n (f32): a product times its matrix's second-level scale,
    /// one multiplication a value, as the CPU applies it.
    pub fn scale(&self, x: u64, n: usize, s: f32) -> Result<(), CudaError> {
        const KN: &str = "scale";
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::I64(n as i64),
            Arg::F32(s),
        ];
        self.launch(K::Scale, [self.stride_blocks(n), 1, 1], 256, 0, &args)
    }

    /// `out[i] = silu(g[i]) · u[i]` for i < n, with the shared SiLU (bit-identical to
    /// the CPU). `out` may be `g` or `u`.
    pub fn swiglu(&self, g: u64, u: u64, n: usize, out: u64) -> Result<(), CudaError> {
        const KN: &str = "swiglu";
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "g", g, 4)?),
            Arg::P(addr(KN, "u", u, 4)?),
            Arg::I64(n as i64),
            Arg::P(addr(KN, "out", out, 4)?),
        ];
        self.launch(K::Swiglu, [self.stride_blocks(n), 1, 1], 256, 0, &args)
    }

    /// `out_idx[0]` (i32) = the greedy token of the n logits at `x`, exactly as
    /// `engine::sampler::argmax`: the lowest index of the largest value greater than
    /// -inf; NaN never wins; 0 when no value qualifies (all NaN or -inf). `scratch`:
    /// see [`Gpu::argmax_rows`].
    pub fn argmax(&self, x: u64, n: usize, out_idx: u64, scratch: u64) -> Result<(), CudaError> {
        self.argmax_rows(x, n, 1, out_idx, scratch)
    }

    /// [`Gpu::argmax`] of each of `rows` rows of `n` values (`x` f32 [rows × n]) in
    /// one launch, each row spread over the GPU: `out_idx[r]` (i32 [rows]) is row r's.
    /// `scratch` holds [`argmax_scratch_words`]`(n, rows)` u32 words, zeroed before its
    /// first use for this `n` (the kernel leaves it ready for the next call with the
    /// same `n`, any number of rows, captured in a graph or not).
    pub fn argmax_rows(
        &self,
        x: u64,
        n: usize,
        rows: usize,
        out_idx: u64,
        scratch: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "argmax";
        if n == 0 {
            return Err(CudaError::bad(KN, "argmax of no values"));
        }
        if rows == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::I32(int(KN, "n", n)?),
            Arg::P(addr(KN, "out_idx", out_idx, 4)?),
            Arg::P(addr(KN, "scratch", scratch, 4)?),
        ];
        let rows = u32::try_from(rows).map_err(|_| CudaError::bad(KN, "too many rows"))?;
        let blocks = u32::try_from(n.div_ceil(ARGMAX_CHUNK))
            .map_err(|_| CudaError::bad(KN, "too many values"))?;
        self.launch(K::Argmax, [blocks, rows, 1], 256, 0, &args)
    }

    /// For tests of scoria_math.cuh: `out[f·n + i] = f(x[i])` for f = exp, sigmoid,
    /// silu, softplus, log1p (f32 [5 × n]), as the kernels compute them.
    #[doc(hidden)]
    pub fn math_probe(&self, x: u64, n: usize, out: u64) -> Result<(), CudaError> {
        const KN: &str = "math_probe";
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::I32(int(KN, "n", n)?),
            Arg::P(addr(KN, "out", out, 4)?),
        ];
        self.launch(K::MathProbe, [blocks(n, 256)?, 1, 1], 256, 0, &args)
    }

    /// Tests only: queues a kernel that writes to device address 8, which no
    /// allocation holds, so the context gets a real `CUDA_ERROR_ILLEGAL_ADDRESS` — a
    /// sticky error: every later call of this context fails, and the process must
    /// be restarted. Asynchronous, like any launch: the next synchronisation reports
    /// it.
    #[doc(hidden)]
    pub fn provoke_illegal_address(&self) -> Result<(), CudaError> {
        self.launch(K::FaultProbe, [1, 1, 1], 32, 0, &[Arg::U64(8)])
    }
}

/// Values per block of the argmax kernel (SC_ARGMAX_CHUNK in norm.cu).
const ARGMAX_CHUNK: usize = 2048;

/// Words of scratch [`Gpu::argmax_rows`] needs for `rows` rows of `n` values: per row
/// an arrival counter, a word of padding and each block's (value, index).
pub fn argmax_scratch_words(n: usize, rows: usize) -> usize {
    (2 + 2 * n.div_ceil(ARGMAX_CHUNK)) * rows
}
