//! Attention: `attn_prep` (per-head q/k RMSNorm, NeoX rotary, K/V cache write;
//! bit-identical to the CPU's norm and rope) and `attn_core` (causal softmax attention
//! over the cache, flash-style; deterministic, within float tolerance of the CPU).

use super::{act_q8_args, addr, blocks, int, opt_addr, MAX_GRID_YZ};
use crate::error::{gib, CudaError};
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;
use crate::ops::quant::ActQ8;

/// Query rows and keys per attn_core tile (kernels/attention.cu SC_AQ, SC_AK), the
/// query rows of the wide launches that prompts of one key range take (16 warps),
/// and the query rows each warp of either takes.
const AQ: usize = 16;
const AQ_WIDE: usize = 64;
const AK: usize = 32;
const ROWS_PER_WARP: usize = 4;
/// The largest head dimension attn_prep takes (SC_MAX_HD).
const MAX_HD: usize = 256;
/// Keys per canonical chunk (kernels/attention.cu SC_ACHUNK): a row's keys go in
/// chunks of this many at absolute positions, folded in order, whatever the launch.
const KEY_CHUNK: usize = 128;
/// The most scratch a split launch's partial results take; past it the launch walks
/// every key in each block instead (the same bits, fewer blocks).
const SPLIT_SCRATCH_MAX: usize = 256 << 20;

/// Scratch of `n_split` chunks' (m, l, o) for `n_tok` tokens (0 when not split).
fn split_bytes(n_split: usize, n_tok: usize, n_head: usize, head_dim: usize) -> u64 {
    if n_split <= 1 {
        0
    } else {
        (n_split * n_tok * n_head * (head_dim + 2) * 4) as u64
    }
}

/// Dynamic shared memory of attn_core for a head dimension (`wide`: the 64-row
/// launches): the Q tile, the K tile (rows padded by one float) and the V tile.
pub(crate) fn core_smem(hd: usize, wide: bool) -> u32 {
    let aq = if wide { AQ_WIDE } else { AQ };
    ((aq * hd + AK * (hd + 1) + AK * hd) * 4) as u32
}

/// The launch for a head dimension: rows mode, wide (a prompt of one key range) or
/// the general one.
fn core_kernel(hd: usize, rows: bool, wide: bool) -> Option<K> {
    Some(match (hd, rows, wide) {
        (32, true, _) => K::AttnCoreRowsHd32,
        (64, true, _) => K::AttnCoreRowsHd64,
        (128, true, _) => K::AttnCoreRowsHd128,
        (256, true, _) => K::AttnCoreRowsHd256,
        (32, false, true) => K::AttnCoreWideHd32,
        (64, false, true) => K::AttnCoreWideHd64,
        (128, false, true) => K::AttnCoreWideHd128,
        (256, false, true) => K::AttnCoreWideHd256,
        (32, false, false) => K::AttnCoreHd32,
        (64, false, false) => K::AttnCoreHd64,
        (128, false, false) => K::AttnCoreHd128,
        (256, false, false) => K::AttnCoreHd256,
        _ => return None,
    })
}

/// The rotary table of [`Gpu::attn_prep`] and where each token finds its row.
#[derive(Debug, Clone, Copy)]
pub struct Rotary {
    /// The host's table f32 [n_ctx][n_rot/2][2] of (cos, sin) (`model::math`).
    pub table: u64,
    /// Rotated dims of each head (even, at most head_dim).
    pub n_rot: usize,
    /// 0: token t rotates at its cache position. Otherwise device i32 [n_tok][3], each
    /// token's multimodal (t, h, w) position (Qwen3.5's M-RoPE): pair p rotates at the
    /// h position when p % 3 == 1 and p < 3·sections[0], at w when p % 3 == 2 and
    /// p < 3·sections[1], else at t (`model::math::mrope_table`). Every position must
    /// be a row of the table (not checked on the device).
    pub mpos: u64,
    /// The h and w sections of the model's `rope.dimension_sections`.
    pub sections: [usize; 2],
}

impl Rotary {
    /// Every token at its cache position.
    pub fn plain(table: u64, n_rot: usize) -> Rotary {
        Rotary {
            table,
            n_rot,
            mpos: 0,
            sections: [0, 0],
        }
    }
}

impl Gpu {
    /// For each token t (position `*pos0_dev + t`): every query head of `q_raw`
    /// (f32 [n_tok][n_head·q_stride], head h at h·q_stride) RMS-normed with `q_norm`,
    /// NeoX-rotated on its first `n_rot` dims and written to `q_out`
    /// [n_tok][n_head][head_dim]; every key head of `k_raw` ([n_tok][n_head_kv·head_dim])
    /// normed with `k_norm`, rotated and written to `k_cache` [n_ctx][n_head_kv][head_dim]
    /// at the token's position; `v_raw` copied to `v_cache` likewise, rotated as `rope`
    /// says ([`Rotary`]). A zero
    /// `q_norm` / `k_norm` skips that norm. The position is read on the device, so a
    /// captured graph replays at whatever position is stored there; the caller keeps
    /// `pos0 + n_tok <= n_ctx` (it is not checked on the device). With a non-zero
    /// `kv_tab` (device u64 [2·n_tok]) every token is one token of a sequence of its
    /// own (a batched decode step): token t is at position `pos0_dev[t]` and its caches
    /// are at `kv_tab[2t]` (K) and `kv_tab[2t + 1]` (V); `k_cache`/`v_cache` are unused.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_prep(
        &self,
        q_raw: u64,
        k_raw: u64,
        v_raw: u64,
        n_tok: usize,
        pos0_dev: u64,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        q_stride: usize,
        q_norm: u64,
        k_norm: u64,
        eps: f32,
        rope: &Rotary,
        k_cache: u64,
        v_cache: u64,
        q_out: u64,
        kv_tab: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "attn_prep";
        let n_rot = rope.n_rot;
        if head_dim == 0 || head_dim > MAX_HD {
            return Err(CudaError::bad(
                KN,
                format!("head_dim {head_dim} (1..={MAX_HD} supported)"),
            ));
        }
        if !n_rot.is_multiple_of(2) || n_rot > head_dim {
            return Err(CudaError::bad(
                KN,
                format!("n_rot {n_rot} must be even and at most head_dim {head_dim}"),
            ));
        }
        if q_stride < head_dim {
            return Err(CudaError::bad(
                KN,
                format!("q_stride {q_stride} < head_dim {head_dim}"),
            ));
        }
        let items = n_tok * (n_head + n_head_kv);
        if items == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "q_raw", q_raw, 4)?),
            Arg::P(addr(KN, "k_raw", k_raw, 4)?),
            Arg::P(addr(KN, "v_raw", v_raw, 4)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::P(addr(KN, "pos0_dev", pos0_dev, 4)?),
            Arg::I32(int(KN, "n_head", n_head)?),
            Arg::I32(int(KN, "n_head_kv", n_head_kv)?),
            Arg::I32(int(KN, "head_dim", head_dim)?),
            Arg::I32(int(KN, "q_stride", q_stride)?),
            Arg::P(opt_addr(KN, "q_norm", q_norm, 4)?),
            Arg::P(opt_addr(KN, "k_norm", k_norm, 4)?),
            Arg::F32(eps),
            Arg::P(addr(KN, "rope", rope.table, 4)?),
            Arg::I32(int(KN, "n_rot", n_rot)?),
            Arg::P(if kv_tab == 0 {
                addr(KN, "k_cache", k_cache, 4)?
            } else {
                0
            }),
            Arg::P(if kv_tab == 0 {
                addr(KN, "v_cache", v_cache, 4)?
            } else {
                0
            }),
            Arg::P(addr(KN, "q_out", q_out, 4)?),
            Arg::P(opt_addr(KN, "kv_tab", kv_tab, 8)?),
            Arg::P(opt_addr(KN, "mpos", rope.mpos, 4)?),
            Arg::I32(int(KN, "sections[0]", rope.sections[0])?),
            Arg::I32(int(KN, "sections[1]", rope.sections[1])?),
        ];
        let kernel = if kv_tab == 0 {
            K::AttnPrep
        } else {
            K::AttnPrepRows
        };
        self.launch(kernel, [blocks(items, 4)?, 1, 1], 128, 0, &args)
    }

    /// How many blocks along the keys `attn_core` launches for `n_tok` tokens (of one
    /// sequence, or in rows mode of one sequence each): 1 when the query rows alone
    /// fill the GPU (prompts: each block walks every key) or when the chunks' partial
    /// results would need more than [`SPLIT_SCRATCH_MAX`], else one per [`KEY_CHUNK`]
    /// keys of the capacity (decode, verify steps; the blocks past the rows' last key
    /// return at once, and the fold stops there). Either gives the same bits.
    /// Depends only on host values, so a captured graph keeps it.
    fn attn_splits(&self, n_tok: usize, rows_mode: bool, shape: [usize; 4]) -> usize {
        let [n_head, n_head_kv, head_dim, n_ctx] = shape;
        let group = n_head / n_head_kv.max(1);
        let per_seq = if rows_mode { 1 } else { n_tok };
        let base = n_head_kv * (per_seq * group).div_ceil(AQ);
        let sms = self.sm_count as usize;
        let chunks = n_ctx.div_ceil(KEY_CHUNK);
        if base == 0 || base >= sms || chunks <= 1 {
            return 1;
        }
        if chunks * n_tok * n_head * (head_dim + 2) * 4 > SPLIT_SCRATCH_MAX {
            return 1;
        }
        chunks
    }

    /// Bytes of scratch `attn_core` needs for this shape (0: none). Allocate it once
    /// for the largest shape used, outside capture.
    pub fn attn_scratch_bytes(
        &self,
        n_tok: usize,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        n_ctx: usize,
    ) -> u64 {
        let shape = [n_head, n_head_kv, head_dim, n_ctx];
        split_bytes(
            self.attn_splits(n_tok, false, shape),
            n_tok,
            n_head,
            head_dim,
        )
    }

    /// [`Gpu::attn_scratch_bytes`] of `attn_core` in rows mode (`n_rows` sequences of
    /// one token each).
    pub fn attn_rows_scratch_bytes(
        &self,
        n_rows: usize,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        n_ctx: usize,
    ) -> u64 {
        let shape = [n_head, n_head_kv, head_dim, n_ctx];
        split_bytes(
            self.attn_splits(n_rows, true, shape),
            n_rows,
            n_head,
            head_dim,
        )
    }

    /// Causal softmax attention of `q` (f32 [n_tok][n_head][head_dim], from
    /// `attn_prep`) over the caches: token t (position `*pos0_dev + t`) sees positions
    /// 0..=pos0+t of its KV head (head h reads KV head h / (n_head / n_head_kv)), scores
    /// scaled by 1/sqrt(head_dim); out [n_tok][n_head·head_dim]. With a non-zero
    /// `gate` (the raw q projection, head h's gate at h·q_stride + head_dim) the output
    /// is multiplied by sigmoid(gate). The length is read on the device (graph replay
    /// at a moving position); `n_ctx` (the cache's capacity) only sizes the key split.
    /// `scratch` must hold [`Gpu::attn_scratch_bytes`] bytes (it may be 0 when that is
    /// 0). head_dim must be 32, 64, 128 or 256; q, k_cache, v_cache 16-byte aligned.
    /// Deterministic, not bit-identical to the CPU (online softmax); a row's bits
    /// depend only on its position and the cache (keys in chunks of [`KEY_CHUNK`] at
    /// absolute positions, folded in order), never on the rows or splits launched
    /// with it. When the keys are split (a block per chunk, folded by a second kernel), that kernel also
    /// writes `out`'s quantized copy to `oq` ([`Gpu::quantize_act`]'s bits) unless
    /// `oq` is [`ActQ8::NONE`]; returns whether it did (the caller quantizes otherwise).
    ///
    /// With a non-zero `kv_tab` (rows mode, as in [`Gpu::attn_prep`]) each of the
    /// `n_tok` tokens is one token of its own sequence, at position `pos0_dev[t]` over
    /// the caches `kv_tab[2t]`, `kv_tab[2t + 1]`, and gets the bits of its one-token
    /// call (the same key split); `scratch` then holds
    /// [`Gpu::attn_rows_scratch_bytes`]. Needs n_head / n_head_kv ≤ 16.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_core(
        &self,
        q: u64,
        n_tok: usize,
        pos0_dev: u64,
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        k_cache: u64,
        v_cache: u64,
        n_ctx: usize,
        gate: u64,
        q_stride: usize,
        out: u64,
        scratch: u64,
        oq: ActQ8,
        kv_tab: u64,
    ) -> Result<bool, CudaError> {
        const KN: &str = "attn_core";
        let unsupported = || {
            CudaError::bad(
                KN,
                format!("head_dim {head_dim} (32, 64, 128 or 256 supported)"),
            )
        };
        core_kernel(head_dim, false, false).ok_or_else(unsupported)?;
        if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(CudaError::bad(
                KN,
                format!("{n_head} query heads over {n_head_kv} KV heads"),
            ));
        }
        if gate != 0 && q_stride < 2 * head_dim {
            return Err(CudaError::bad(
                KN,
                format!("gated attention needs q_stride ≥ 2·head_dim, got {q_stride}"),
            ));
        }
        if n_tok == 0 || n_head == 0 {
            return Ok(false);
        }
        let group = n_head / n_head_kv;
        let rows_mode = kv_tab != 0;
        if rows_mode && group > AQ {
            return Err(CudaError::bad(
                KN,
                format!("rows mode takes at most {AQ} query heads per KV head, not {group}"),
            ));
        }
        // Rows mode: each token is a sequence of its own, split as one token.
        let n_split = self.attn_splits(n_tok, rows_mode, [n_head, n_head_kv, head_dim, n_ctx]);
        if n_split > 1 {
            addr(KN, "scratch", scratch, 4)?;
        }
        if n_split > MAX_GRID_YZ {
            return Err(CudaError::bad(
                KN,
                format!("a context of {n_ctx} keys is too long for one launch (split it)"),
            ));
        }
        // A prompt of one key range and more rows than one block: the wide launch
        // (the same bits per row), when this GPU gives it the shared memory.
        let wide = !rows_mode
            && n_split == 1
            && n_tok * group > AQ
            && core_smem(head_dim, true) <= self.funcs.smem_optin.max(48 * 1024);
        let aq = if wide { AQ_WIDE } else { AQ };
        // Rows mode: one block row per token.
        let row_tiles = if rows_mode {
            n_tok
        } else {
            (n_tok * group).div_ceil(aq)
        };
        if row_tiles > MAX_GRID_YZ {
            return Err(CudaError::bad(
                KN,
                format!("{n_tok} tokens in one call is too many (split the prompt)"),
            ));
        }
        let k = core_kernel(head_dim, rows_mode, wide).ok_or_else(unsupported)?;
        let smem = core_smem(head_dim, wide);
        if smem > 48 * 1024 && smem > self.funcs.smem_optin {
            return Err(CudaError::bad(
                KN,
                format!(
                    "head_dim {head_dim} needs {} of shared memory per block; this GPU allows {}",
                    gib(smem as u64),
                    gib(self.funcs.smem_optin as u64)
                ),
            ));
        }
        let threads = (32 * aq / ROWS_PER_WARP) as u32;
        let scale = 1.0f32 / (head_dim as f32).sqrt();
        let args = [
            Arg::P(addr(KN, "q", q, 16)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::P(addr(KN, "pos0_dev", pos0_dev, 4)?),
            Arg::I32(int(KN, "n_head", n_head)?),
            Arg::I32(int(KN, "n_head_kv", n_head_kv)?),
            Arg::P(if rows_mode {
                0
            } else {
                addr(KN, "k_cache", k_cache, 16)?
            }),
            Arg::P(if rows_mode {
                0
            } else {
                addr(KN, "v_cache", v_cache, 16)?
            }),
            Arg::F32(scale),
            Arg::P(opt_addr(KN, "gate", gate, 4)?),
            Arg::I32(int(KN, "q_stride", q_stride)?),
            Arg::P(addr(KN, "out", out, 4)?),
            Arg::P(if n_split > 1 { scratch } else { 0 }),
            Arg::I32(n_split as i32),
            Arg::P(opt_addr(KN, "kv_tab", kv_tab, 8)?),
        ];
        let q_out = act_q8_args(KN, oq, false)?;
        let grid = [n_head_kv as u32, row_tiles as u32, n_split as u32];
        self.launch(k, grid, threads, smem, &args)?;
        if n_split > 1 {
            let args = [
                Arg::P(scratch),
                Arg::I32(n_split as i32),
                Arg::I32(int(KN, "n_tok", n_tok)?),
                Arg::I32(int(KN, "n_head", n_head)?),
                Arg::I32(int(KN, "head_dim", head_dim)?),
                Arg::P(gate),
                Arg::I32(int(KN, "q_stride", q_stride)?),
                Arg::P(out),
                q_out[0],
                q_out[1],
                q_out[2],
                Arg::P(pos0_dev),
                Arg::I32(i32::from(rows_mode)),
            ];
            let rows = u32::try_from(n_tok * n_head)
                .map_err(|_| CudaError::bad(KN, "too many (token, head) rows"))?;
            let dims = (head_dim / 32) as u32;
            self.launch(K::AttnCombine, [rows, dims, 1], 32, 0, &args)?;
        }
        Ok(n_split > 1 && oq != ActQ8::NONE)
    }
}
