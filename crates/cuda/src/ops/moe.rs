//! Routing and the combination of expert outputs, bit-identical to the CPU
//! (`model::moe::route`, `engine/src/cpu/moe.rs`).

use super::{addr, blocks, int, opt_addr};
use crate::error::CudaError;
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;

/// The most experts `route_topk` takes (kernels/moe.cu SC_MAX_EXPERT).
pub const MAX_EXPERTS: usize = 1024;
/// The largest k `route_topk` takes (kernels/moe.cu SC_MAX_K).
pub const MAX_TOP_K: usize = 32;

impl Gpu {
    /// `model::moe::route` of each of `n_tok` rows of `n_expert` router logits:
    /// `weights_out` (f32 [n_tok × k]) and `ids_out` (i32 [n_tok × k]) in rank order.
    /// With non-zero `tiles_gu` / `tiles_down` (only for n_tok == 1) it also writes k
    /// [`Tile`](crate::Tile)s each for [`Gpu::matvec_tiles`]: tile r of `tiles_gu` =
    /// {expert id_r, n 1, in_row [0], out_row [r]} (gate/up of the token), of
    /// `tiles_down` = {id_r, 1, [r], [r]} (down of rank r's activation).
    #[allow(clippy::too_many_arguments)]
    pub fn route_topk(
        &self,
        logits: u64,
        n_tok: usize,
        n_expert: usize,
        k: usize,
        weights_out: u64,
        ids_out: u64,
        tiles_gu: u64,
        tiles_down: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "route_topk";
        if n_expert == 0 || n_expert > MAX_EXPERTS {
            return Err(CudaError::bad(
                KN,
                format!("{n_expert} experts (1..={MAX_EXPERTS} supported)"),
            ));
        }
        if k == 0 || k > n_expert || k > MAX_TOP_K {
            return Err(CudaError::bad(
                KN,
                format!("top-{k} of {n_expert} experts (k ≤ {MAX_TOP_K})"),
            ));
        }
        if (tiles_gu == 0) != (tiles_down == 0) {
            return Err(CudaError::bad(KN, "give both tile arrays or neither"));
        }
        if tiles_gu != 0 && n_tok != 1 {
            return Err(CudaError::bad(
                KN,
                format!("device tiles are written for one token, not {n_tok}"),
            ));
        }
        if n_tok == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "logits", logits, 4)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::I32(int(KN, "n_expert", n_expert)?),
            Arg::I32(int(KN, "k", k)?),
            Arg::P(addr(KN, "weights_out", weights_out, 4)?),
            Arg::P(addr(KN, "ids_out", ids_out, 4)?),
            Arg::P(opt_addr(KN, "tiles_gu", tiles_gu, 4)?),
            Arg::P(opt_addr(KN, "tiles_down", tiles_down, 4)?),
        ];
        self.launch(K::RouteTopk, [blocks(n_tok, 4)?, 1, 1], 128, 0, &args)
    }

    /// `out[t] = Σ_r weights[t][r] · down[t·k + r]` in rank order from 0.0 (each
    /// product rounded, then added), then `+ sigmoid(shared_logit[t]) · shared[t]`
    /// when `shared` is non-zero (`+ shared[t]` when `shared_logit` is 0), as the CPU's
    /// MoE does. down: f32 [n_tok·k × e], weights [n_tok × k], shared [n_tok × e],
    /// shared_logit [n_tok], out [n_tok × e].
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        down: u64,
        weights: u64,
        n_tok: usize,
        k: usize,
        e: usize,
        shared: u64,
        shared_logit: u64,
        out: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "moe_combine";
        if n_tok == 0 || e == 0 {
            return Ok(());
        }
        if shared == 0 && shared_logit != 0 {
            return Err(CudaError::bad(KN, "shared_logit without shared"));
        }
        let args = [
            Arg::P(addr(KN, "down", down, 4)?),
            Arg::P(addr(KN, "weights", weights, 4)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::I32(int(KN, "k", k)?),
            Arg::I32(int(KN, "e", e)?),
            Arg::P(opt_addr(KN, "shared", shared, 4)?),
            Arg::P(opt_addr(KN, "shared_logit", shared_logit, 4)?),
            Arg::P(addr(KN, "out", out, 4)?),
        ];
        let n = n_tok * e;
        let grid = [
            n.div_ceil(256).clamp(1, self.sm_count as usize * 16) as u32,
            1,
            1,
        ];
        self.launch(K::MoeCombine, grid, 256, 0, &args)
    }
}
