//! Gated DeltaNet, bit-identical to the CPU (`engine/src/cpu/deltanet.rs` over
//! `model::deltanet`): conv, q/k L2 norm, the recurrence and the gated norm.

use super::{addr, blocks, int, opt_addr};
use crate::error::CudaError;
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;
use crate::ops::quant::ActQ8;

pub use crate::shapes::MAX_D_CONV;
/// Tokens per run of dn_conv (runs go in parallel).
const DN_CONV_RUN: usize = 32;

/// One DeltaNet layer's weights and shape for [`Gpu::dn_step`] (device addresses).
#[derive(Clone, Copy, Debug)]
pub struct DnStep {
    /// β of value head h is `beta_src[beta_idx[h]]` (i32 [Hv]); α likewise.
    pub beta_src: u64,
    pub beta_idx: u64,
    pub alpha_src: u64,
    pub alpha_idx: u64,
    /// f32 [Hv] each.
    pub a: u64,
    pub dt_bias: u64,
    /// i32 [Hv]: the key head of each value head.
    pub k_head_of: u64,
    /// The gated norm's gate z (f32 [Hv·d_state]) and weight (f32 [d_state]).
    pub z: u64,
    pub norm_w: u64,
    pub eps: f32,
    /// The q scale (1/sqrt(d_state)).
    pub scale: f32,
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub d_state: usize,
}

/// Several sequences' one-token rows in one launch of [`Gpu::dn_step_rows`] (a
/// batched decode step): row y's state is at `state_tab[y]` (device u64 [n]), its
/// conv output row `conv_stride` values after row y − 1's, its β/α source rows
/// `beta_stride` / `alpha_stride` apart; z, the output and its copy are rows of
/// Hv·d_state.
#[derive(Clone, Copy, Debug)]
pub struct DnRows {
    pub n: usize,
    pub state_tab: u64,
    pub conv_stride: usize,
    pub beta_stride: usize,
    pub alpha_stride: usize,
}

impl Gpu {
    /// The causal depthwise conv of `n_tok` tokens, per channel in token order, as
    /// `model::deltanet::conv_step`: qkv f32 [n_tok][conv_dim] in, silu(conv) to `out`
    /// (may be `qkv`), `state` f32 [conv_dim][d_conv-1] (oldest first) advanced in
    /// place, `taps` f32 [conv_dim][d_conv]. `trail` (0: none): f32
    /// [n_tok − 1][conv_dim][d_conv-1], the state after each token but the last (what a
    /// sequence fed up to that token holds: a verify step's, for a rollback).
    #[allow(clippy::too_many_arguments)]
    pub fn dn_conv(
        &self,
        qkv: u64,
        state: u64,
        taps: u64,
        n_tok: usize,
        conv_dim: usize,
        d_conv: usize,
        out: u64,
        trail: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "dn_conv";
        if d_conv == 0 || d_conv > MAX_D_CONV {
            return Err(CudaError::bad(
                KN,
                format!("d_conv {d_conv} (1..={MAX_D_CONV} supported)"),
            ));
        }
        if n_tok == 0 || conv_dim == 0 {
            return Ok(());
        }
        // Runs of tokens in parallel, each starting from its predecessors' inputs;
        // in place, one run (a run would read inputs another has overwritten). A run
        // is at least d_conv - 1 tokens (the kernel's new-state rule), and the runs
        // fit the grid.
        let tpb = if out == qkv {
            n_tok
        } else {
            DN_CONV_RUN
                .max(d_conv)
                .max(n_tok.div_ceil(super::MAX_GRID_YZ))
        };
        let args = [
            Arg::P(addr(KN, "qkv", qkv, 4)?),
            Arg::P(if d_conv > 1 {
                addr(KN, "state", state, 4)?
            } else {
                state
            }),
            Arg::P(addr(KN, "taps", taps, 4)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::I32(int(KN, "conv_dim", conv_dim)?),
            Arg::I32(int(KN, "d_conv", d_conv)?),
            Arg::I32(int(KN, "tokens per run", tpb)?),
            Arg::P(addr(KN, "out", out, 4)?),
            Arg::P(opt_addr(KN, "trail", trail, 4)?),
        ];
        let runs = n_tok.div_ceil(tpb);
        self.launch(
            K::DnConv,
            [blocks(conv_dim, 128)?, runs as u32, 1],
            128,
            0,
            &args,
        )
    }

    /// In place on the conv output [n_tok][conv_dim] (rows [q | k | v], n_k_heads
    /// heads of d_state each for q and k): each q and k head L2-normalised with eps
    /// 1e-6 (`model::math::l2_norm`), then the q heads multiplied by `scale`.
    pub fn dn_qk_norm(
        &self,
        conv_out: u64,
        n_tok: usize,
        conv_dim: usize,
        n_k_heads: usize,
        d_state: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        const KN: &str = "dn_qk_norm";
        if 2 * n_k_heads * d_state > conv_dim {
            return Err(CudaError::bad(
                KN,
                format!("2·{n_k_heads} heads of {d_state} exceed conv_dim {conv_dim}"),
            ));
        }
        let items = n_tok * 2 * n_k_heads;
        if items == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "conv_out", conv_out, 4)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::I32(int(KN, "conv_dim", conv_dim)?),
            Arg::I32(int(KN, "n_k_heads", n_k_heads)?),
            Arg::I32(int(KN, "d_state", d_state)?),
            Arg::F32(scale),
        ];
        self.launch(K::DnQkNorm, [blocks(items, 4)?, 1, 1], 128, 0, &args)
    }

    /// Each value head h's recurrence over the tokens in order, then the gated norm,
    /// bit-identical to the CPU: g = a[h]·softplus(alpha + dt_bias[h]),
    /// β = sigmoid(beta), `model::deltanet::step` on `state` [Hv][dk][dv] (dk = dv =
    /// d_state) with q/k of key head `k_head_of[h]` from `conv_out` (normed by
    /// `dn_qk_norm`) and v of head h, then `gated_norm` with z [n_tok][Hv·dv] and
    /// `norm_w` [dv]; out [n_tok][Hv·dv]. β of (t, h) is
    /// `beta_src[t·beta_stride + beta_idx[h]]`, α likewise (index arrays i32 [Hv]),
    /// which serves fused and separate β/α projections alike. d_state must be 32, 64
    /// or 128. `trail` (0: none): f32 [n_tok − 1][Hv][dk][dv], the state after each
    /// token but the last (a verify step's, for a rollback; `dn_conv`'s likewise).
    #[allow(clippy::too_many_arguments)]
    pub fn dn_recurrence(
        &self,
        conv_out: u64,
        n_tok: usize,
        conv_dim: usize,
        beta_src: u64,
        beta_stride: usize,
        beta_idx: u64,
        alpha_src: u64,
        alpha_stride: usize,
        alpha_idx: u64,
        a: u64,
        dt_bias: u64,
        k_head_of: u64,
        z: u64,
        norm_w: u64,
        eps: f32,
        state: u64,
        n_k_heads: usize,
        n_v_heads: usize,
        d_state: usize,
        out: u64,
        trail: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "dn_recurrence";
        let k = match d_state {
            32 => K::DnRecurrenceDk32,
            64 => K::DnRecurrenceDk64,
            128 => K::DnRecurrenceDk128,
            _ => {
                return Err(CudaError::bad(
                    KN,
                    format!("d_state {d_state} (32, 64 or 128 supported)"),
                ))
            }
        };
        let want = (2 * n_k_heads + n_v_heads) * d_state;
        if conv_dim != want {
            return Err(CudaError::bad(
                KN,
                format!("conv_dim {conv_dim} is not [q|k|v] = (2·{n_k_heads} + {n_v_heads})·{d_state} = {want}"),
            ));
        }
        if n_tok == 0 || n_v_heads == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "conv_out", conv_out, 4)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::I32(int(KN, "conv_dim", conv_dim)?),
            Arg::P(addr(KN, "beta_src", beta_src, 4)?),
            Arg::I32(int(KN, "beta_stride", beta_stride)?),
            Arg::P(addr(KN, "beta_idx", beta_idx, 4)?),
            Arg::P(addr(KN, "alpha_src", alpha_src, 4)?),
            Arg::I32(int(KN, "alpha_stride", alpha_stride)?),
            Arg::P(addr(KN, "alpha_idx", alpha_idx, 4)?),
            Arg::P(addr(KN, "a", a, 4)?),
            Arg::P(addr(KN, "dt_bias", dt_bias, 4)?),
            Arg::P(addr(KN, "k_head_of", k_head_of, 4)?),
            Arg::P(addr(KN, "state", state, 4)?),
            Arg::I32(int(KN, "n_k_heads", n_k_heads)?),
            Arg::I32(int(KN, "n_v_heads", n_v_heads)?),
            Arg::P(addr(KN, "out", out, 4)?),
            Arg::P(opt_addr(KN, "trail", trail, 4)?),
        ];
        let grid = [
            int(KN, "n_v_heads", n_v_heads)? as u32,
            (d_state / 32) as u32,
            1,
        ];
        self.launch(k, grid, 32, 0, &args)?;
        let args = [
            Arg::P(out),
            Arg::P(addr(KN, "z", z, 4)?),
            Arg::P(addr(KN, "norm_w", norm_w, 4)?),
            Arg::F32(eps),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::I32(int(KN, "n_v_heads", n_v_heads)?),
            Arg::I32(int(KN, "d_state", d_state)?),
        ];
        self.launch(
            K::DnGatedNorm,
            [blocks(n_tok * n_v_heads, 4)?, 1, 1],
            128,
            0,
            &args,
        )
    }

    /// One token of every value head in one launch: the q/k L2 norm
    /// ([`Gpu::dn_qk_norm`]'s bits) read from `conv_out` (the conv output [q | k | v],
    /// left as it is), the recurrence on `state` and the gated norm
    /// ([`Gpu::dn_recurrence`]'s bits) into `out` (f32 [Hv·d_state]), and unless `q`
    /// is [`ActQ8::NONE`] its quantized copy ([`Gpu::quantize_act`]'s bits).
    pub fn dn_step(
        &self,
        conv_out: u64,
        d: &DnStep,
        state: u64,
        out: u64,
        q: ActQ8,
    ) -> Result<(), CudaError> {
        self.dn_step_launch(conv_out, d, state, None, out, q)
    }

    /// [`Gpu::dn_step`] for one token of each of `rows.n` sequences in one launch
    /// (see [`DnRows`]): every row gets its one-token bits.
    pub fn dn_step_rows(
        &self,
        conv_out: u64,
        d: &DnStep,
        rows: &DnRows,
        out: u64,
        q: ActQ8,
    ) -> Result<(), CudaError> {
        self.dn_step_launch(conv_out, d, 0, Some(rows), out, q)
    }

    fn dn_step_launch(
        &self,
        conv_out: u64,
        d: &DnStep,
        state: u64,
        rows: Option<&DnRows>,
        out: u64,
        q: ActQ8,
    ) -> Result<(), CudaError> {
        const KN: &str = "dn_step";
        let k = match (d.d_state, rows.is_some()) {
            (32, false) => K::DnStepDk32,
            (64, false) => K::DnStepDk64,
            (128, false) => K::DnStepDk128,
            (32, true) => K::DnStepRowsDk32,
            (64, true) => K::DnStepRowsDk64,
            (128, true) => K::DnStepRowsDk128,
            (s, _) => {
                return Err(CudaError::bad(
                    KN,
                    format!("d_state {s} (32, 64 or 128 supported)"),
                ))
            }
        };
        if d.n_v_heads == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "conv_out", conv_out, 4)?),
            Arg::P(addr(KN, "beta_src", d.beta_src, 4)?),
            Arg::P(addr(KN, "beta_idx", d.beta_idx, 4)?),
            Arg::P(addr(KN, "alpha_src", d.alpha_src, 4)?),
            Arg::P(addr(KN, "alpha_idx", d.alpha_idx, 4)?),
            Arg::P(addr(KN, "a", d.a, 4)?),
            Arg::P(addr(KN, "dt_bias", d.dt_bias, 4)?),
            Arg::P(addr(KN, "k_head_of", d.k_head_of, 4)?),
            Arg::P(match rows {
                Some(_) => 0,
                None => addr(KN, "state", state, 4)?,
            }),
            Arg::I32(int(KN, "n_k_heads", d.n_k_heads)?),
            Arg::F32(d.scale),
            Arg::P(addr(KN, "z", d.z, 4)?),
            Arg::P(addr(KN, "norm_w", d.norm_w, 4)?),
            Arg::F32(d.eps),
            Arg::P(addr(KN, "out", out, 4)?),
            Arg::P(opt_addr(KN, "qs", q.qs, 16)?),
            Arg::P(opt_addr(KN, "d", q.d, 4)?),
            Arg::P(opt_addr(KN, "sums", q.sums, 4)?),
            Arg::P(match rows {
                Some(r) => addr(KN, "state_tab", r.state_tab, 8)?,
                None => 0,
            }),
            Arg::I32(int(KN, "conv_stride", rows.map_or(0, |r| r.conv_stride))?),
            Arg::I32(int(KN, "beta_stride", rows.map_or(0, |r| r.beta_stride))?),
            Arg::I32(int(KN, "alpha_stride", rows.map_or(0, |r| r.alpha_stride))?),
        ];
        let n = rows.map_or(1, |r| r.n);
        if n == 0 {
            return Ok(());
        }
        if n > super::MAX_GRID_YZ {
            return Err(CudaError::bad(KN, format!("{n} rows in one launch")));
        }
        let grid = [int(KN, "n_v_heads", d.n_v_heads)? as u32, n as u32, 1];
        self.launch(k, grid, d.d_state as u32, 0, &args)
    }
}
