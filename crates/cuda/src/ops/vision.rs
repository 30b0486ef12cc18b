//! The image encoder's steps (kernels/vision.cu): linear layers on the tensor cores,
//! LayerNorm, the learned positions, the 2-D rotary step and bidirectional attention.
//! Deterministic, not bit-identical to the CPU encoder (see vision.cu).

use super::{addr, blocks, int, opt_addr};
use crate::error::CudaError;
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;

/// What `vis_linear` does with `x·wᵀ + b` before it is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VisEpilogue {
    /// `y = v`.
    Store = 0,
    /// `y = gelu_tanh(v)` (the ViT MLP's).
    GeluTanh = 1,
    /// `y = v·Φ(v)`, the exact GELU (the merger's).
    GeluErf = 2,
    /// `y += v` (a residual step).
    Add = 3,
}

/// A linear layer's weights on the device: `[n_out][n_in]` f16 rows `hi` and, for
/// weights f16 does not hold, `lo` (0: none), the rounding of what `hi` leaves, and the
/// f32 bias.
#[derive(Clone, Copy, Debug)]
pub struct VisWeight {
    pub hi: u64,
    pub lo: u64,
    pub bias: u64,
    pub n_in: usize,
    pub n_out: usize,
}

/// Whether `vis_attention` takes heads of `hd` values.
pub fn vis_attention_supports(hd: usize) -> bool {
    attn_kernel(hd).is_some()
}

fn attn_kernel(hd: usize) -> Option<K> {
    Some(match hd {
        16 => K::VisAttnHd16,
        32 => K::VisAttnHd32,
        64 => K::VisAttnHd64,
        72 => K::VisAttnHd72,
        80 => K::VisAttnHd80,
        _ => return None,
    })
}

/// Rows of a vis_linear tile (VL_BM = VL_BN in vision.cu).
const VL_TILE: usize = 128;

impl Gpu {
    /// `y[t] = epi(w·x[t] + b)` for `n_tok` rows of `w.n_in` f32 in `x`, into rows of
    /// `w.n_out` in `y` (which must not overlap `x`).
    pub fn vis_linear(
        &self,
        x: u64,
        n_tok: usize,
        w: &VisWeight,
        y: u64,
        epi: VisEpilogue,
    ) -> Result<(), CudaError> {
        const KN: &str = "vis_linear";
        if n_tok == 0 || w.n_out == 0 {
            return Ok(());
        }
        if w.n_in == 0 || !w.n_in.is_multiple_of(8) {
            return Err(CudaError::bad(
                KN,
                format!("rows of {} values: a multiple of 8 is needed", w.n_in),
            ));
        }
        let args = [
            Arg::P(addr(KN, "x", x, 16)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::I32(int(KN, "n_in", w.n_in)?),
            Arg::P(addr(KN, "w.hi", w.hi, 16)?),
            Arg::P(opt_addr(KN, "w.lo", w.lo, 16)?),
            Arg::P(addr(KN, "w.bias", w.bias, 4)?),
            Arg::I32(int(KN, "n_out", w.n_out)?),
            Arg::P(addr(KN, "y", y, 4)?),
            Arg::I32(epi as i32),
        ];
        let by = blocks(n_tok, VL_TILE)?;
        if by as usize > super::MAX_GRID_YZ {
            return Err(CudaError::bad(KN, format!("{n_tok} rows are too many")));
        }
        let k = if w.lo == 0 {
            K::VisLinear
        } else {
            K::VisLinearLo
        };
        self.launch(k, [blocks(w.n_out, VL_TILE)?, by, 1], 256, 0, &args)
    }

    /// `y[r] = LayerNorm(x[r])·w + b` for `rows` rows of `d` f32. `y` may be `x`.
    #[allow(clippy::too_many_arguments)]
    pub fn vis_layernorm(
        &self,
        x: u64,
        rows: usize,
        d: usize,
        w: u64,
        b: u64,
        eps: f32,
        y: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "vis_layernorm";
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::I32(int(KN, "d", d)?),
            Arg::P(addr(KN, "w", w, 4)?),
            Arg::P(addr(KN, "b", b, 4)?),
            Arg::F32(eps),
            Arg::P(addr(KN, "y", y, 4)?),
        ];
        self.launch(K::VisLayernorm, [blocks(rows, 1)?, 1, 1], 256, 0, &args)
    }

    /// `x[i] += Σ_t wt[i][t]·pos[idx[i][t]]` for `n` rows of `h` f32: the learned
    /// positions resampled through four taps a patch (`idx` i32, `wt` f32, `[n][4]`).
    pub fn vis_pos_add(
        &self,
        x: u64,
        n: usize,
        h: usize,
        pos: u64,
        idx: u64,
        wt: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "vis_pos_add";
        if n == 0 || h == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::I32(int(KN, "n", n)?),
            Arg::I32(int(KN, "h", h)?),
            Arg::P(addr(KN, "pos", pos, 4)?),
            Arg::P(addr(KN, "idx", idx, 4)?),
            Arg::P(addr(KN, "wt", wt, 4)?),
        ];
        self.launch(
            K::VisPosAdd,
            [self.stride_blocks(n * h), 1, 1],
            256,
            0,
            &args,
        )
    }

    /// The 2-D rotary step on the q and k parts of `qkv` (`[n][3·h]`, heads of `hd`):
    /// pairs (j, j + hd/2) rotated by `cos`/`sin` (`[n][hd/2]`).
    pub fn vis_rope(
        &self,
        qkv: u64,
        n: usize,
        h: usize,
        hd: usize,
        cos: u64,
        sin: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "vis_rope";
        if n == 0 {
            return Ok(());
        }
        if hd == 0 || !hd.is_multiple_of(2) || !h.is_multiple_of(hd) {
            return Err(CudaError::bad(
                KN,
                format!("heads of {hd} values in rows of {h}"),
            ));
        }
        let args = [
            Arg::P(addr(KN, "qkv", qkv, 4)?),
            Arg::I32(int(KN, "n", n)?),
            Arg::I32(int(KN, "h", h)?),
            Arg::I32(int(KN, "hd", hd)?),
            Arg::P(addr(KN, "cos", cos, 4)?),
            Arg::P(addr(KN, "sin", sin, 4)?),
        ];
        self.launch(K::VisRope, [self.stride_blocks(n * h), 1, 1], 256, 0, &args)
    }

    /// `out[i - q0][head] = softmax_j(q_i·k_j / sqrt(hd))·v_j` over all `n` patches for
    /// every head and the queries `i` in `q0..q0 + nq`, q, k and v in `qkv` (`[n][3·h]`);
    /// `out` is `[nq][h]`. A query's result does not depend on the range it is in.
    #[allow(clippy::too_many_arguments)]
    pub fn vis_attention(
        &self,
        qkv: u64,
        n: usize,
        q0: usize,
        nq: usize,
        h: usize,
        hd: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "vis_attention";
        if nq == 0 {
            return Ok(());
        }
        let k = attn_kernel(hd).ok_or_else(|| {
            CudaError::bad(
                KN,
                format!("heads of {hd} values (16, 32, 64, 72 or 80 supported)"),
            )
        })?;
        if !h.is_multiple_of(hd) || h / hd > super::MAX_GRID_YZ {
            return Err(CudaError::bad(KN, format!("rows of {h} for heads of {hd}")));
        }
        if q0.checked_add(nq).is_none_or(|end| end > n) {
            return Err(CudaError::bad(
                KN,
                format!("queries {q0}..{q0}+{nq} of {n} patches"),
            ));
        }
        let scale = (hd as f32).powf(-0.5);
        let args = [
            Arg::P(addr(KN, "qkv", qkv, 16)?),
            Arg::I32(int(KN, "n", n)?),
            Arg::I32(int(KN, "q0", q0)?),
            Arg::I32(int(KN, "nq", nq)?),
            Arg::I32(int(KN, "h", h)?),
            Arg::F32(scale),
            Arg::P(addr(KN, "out", out, 4)?),
        ];
        // 64 queries a block (VA_Q in vision.cu), 4 warps.
        self.launch(k, [blocks(nq, 64)?, (h / hd) as u32, 1], 128, 0, &args)
    }
}
