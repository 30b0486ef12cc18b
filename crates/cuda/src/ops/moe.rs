//! The MoE block's launches (kernels/moe.cu), bit-identical to the CPU
//! (`model::moe::route`, `engine/src/cpu/moe.rs`): routing, the combination of
//! expert outputs, the fused one-token (or per-row) expert kernels and the decode
//! router, and the hand-off of a tiered step's routing to the host.

use super::quant::{check_mat, ActQ8, Mat, TypeInfo};
use super::{act_q8_args, addr, blocks, int, opt_addr, MAX_GRID_YZ};
use crate::error::CudaError;
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;
use gguf::GgmlType;

pub use crate::shapes::MAX_EXPERTS;
pub use crate::shapes::MAX_TOP_K;
/// The most experts [`Gpu::moe_gate_up`] routes (kernels/moe.cu SC_FUSED_MAX_EXPERT).
pub const FUSED_MAX_EXPERTS: usize = 512;
/// The most tokens [`Gpu::router`] takes (a block row each; a longer prompt's router
/// is a plain matrix product).
pub const ROUTER_MAX_TOKENS: usize = 16;
/// The most experts [`Gpu::router_routed`] routes (kernels/moe.cu router_route_tail).
pub const ROUTE_IN_ROUTER_MAX_EXPERT: usize = 256;
/// Words of a [`Gpu::publish_words`] buffer before the published ones: word 0 is the
/// flag the kernel sets last (kernels/moe.cu `publish_words` writes `host[4 + i]`).
pub const PUBLISH_HEAD_WORDS: usize = 4;

/// Where [`Gpu::router_routed`] writes each token's routing: `weights_out` (f32 [n_tok
/// × k]) and `ids_out` (i32 [n_tok × k]) in rank order, as [`Gpu::route_topk`] does;
/// `counter` (i32 [n_tok]) counts each row's finished blocks and must be zero before
/// the launch (it is zero again after it).
#[derive(Clone, Copy, Debug)]
pub struct RouterRoute {
    pub k: usize,
    pub weights_out: u64,
    pub ids_out: u64,
    pub counter: u64,
}

/// Gate and up of one expert set: the same type, row size and shape.
fn check_pair(kn: &'static str, gate: &Mat, up: &Mat) -> Result<TypeInfo, CudaError> {
    if (
        gate.ty,
        gate.row_bytes,
        gate.expert_bytes,
        gate.n_rows,
        gate.n_cols,
    ) != (up.ty, up.row_bytes, up.expert_bytes, up.n_rows, up.n_cols)
    {
        return Err(CudaError::bad(
            kn,
            format!(
                "gate ({}, {}×{}) and up ({}, {}×{}) differ in type or shape",
                gate.ty, gate.n_rows, gate.n_cols, up.ty, up.n_rows, up.n_cols
            ),
        ));
    }
    check_mat(kn, "up", up)?;
    check_mat(kn, "gate", gate)
}

/// Where [`Gpu::moe_gate_up`] finds a token's routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeRoute {
    /// The kernel routes the token (as [`Gpu::route_topk`]) from the router's
    /// `logits` (f32 [n_expert]), writing the ranks' weights to `wts_out` (f32 [k])
    /// and experts to `ids_out` (i32 [k]).
    Logits {
        logits: u64,
        n_expert: usize,
        wts_out: u64,
        ids_out: u64,
    },
    /// The ranks' experts (or slots) are given at `ids` (i32 [k]); a negative one is
    /// computed elsewhere, and its activations are left alone.
    Given { ids: u64 },
}

impl Gpu {
    /// One token's routing and its experts' SwiGLU, in one launch: the routing
    /// ([`MoeRoute`]), then
    /// `act[r·n_ff + i] = silu(x·gate_{id_r}[i]) · (x·up_{id_r}[i])` for the k ranks
    /// and, with `shared` = (gate, up), `act[k·n_ff + i]` alike for the shared expert;
    /// with `gate_inp` (f32, x's width) also `*shared_logit = x·gate_inp`. The bits of
    /// [`Gpu::matvec`] (one token), [`Gpu::swiglu`] and [`Gpu::dot_rows`]. `x` is the
    /// token's f32 row, `xq` its quantized copy (needed when a type is quantized).
    /// Unless `act_q` is [`ActQ8::NONE`], `act`'s quantized copy is written there too
    /// ([`Gpu::quantize_act`] of the whole row; every expert width a multiple of 32),
    /// and `done` (i32 [k + 1], zero) counts each plane's finished blocks, zero again
    /// when the kernel ends.
    ///
    /// With `n_tok` > 1 each of the tokens (rows of `x`, its copy and the router
    /// `logits`) is routed and computed as if alone: its rows of `wts_out` / `ids_out`
    /// (k each; of `ids` for [`MoeRoute::Given`]), `act` and `act_q` (k·n_ff + n_sff
    /// each), `shared_logit` (one each), with `done` holding `n_tok`·(k + 1) counts.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up(
        &self,
        gate: &Mat,
        up: &Mat,
        shared: Option<(&Mat, &Mat)>,
        gate_inp: u64,
        route: MoeRoute,
        k: usize,
        n_tok: usize,
        x: u64,
        xq: ActQ8,
        shared_logit: u64,
        act: u64,
        act_q: ActQ8,
        done: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "moe_gate_up";
        let ti = check_pair(KN, gate, up)?;
        let mut need_q = !ti.float;
        let mut lowbit = ti.lowbit;
        let (sg, su, s_code, s_rows) = match shared {
            Some((sg, su)) => {
                let si = check_pair(KN, sg, su)?;
                need_q |= !si.float;
                lowbit |= si.lowbit;
                if sg.n_cols != gate.n_cols {
                    return Err(CudaError::bad(
                        KN,
                        format!(
                            "the shared expert reads {} values, the routed {}",
                            sg.n_cols, gate.n_cols
                        ),
                    ));
                }
                (sg.ptr, su.ptr, si.code, sg.n_rows)
            }
            None => (0, 0, 0, 0),
        };
        let (logits, n_expert, wts_out, ids_out, ids_in) = match route {
            MoeRoute::Logits {
                logits,
                n_expert,
                wts_out,
                ids_out,
            } => (
                addr(KN, "logits", logits, 4)?,
                n_expert,
                addr(KN, "wts_out", wts_out, 4)?,
                addr(KN, "ids_out", ids_out, 4)?,
                0,
            ),
            MoeRoute::Given { ids } => (0, k, 0, 0, addr(KN, "ids", ids, 4)?),
        };
        if n_expert == 0 || n_expert > FUSED_MAX_EXPERTS || k == 0 || k > n_expert || k > MAX_TOP_K
        {
            return Err(CudaError::bad(
                KN,
                format!(
                    "top-{k} of {n_expert} experts (at most {MAX_TOP_K} of {FUSED_MAX_EXPERTS})"
                ),
            ));
        }
        if (gate_inp != 0) != (shared_logit != 0) || (gate_inp != 0 && shared.is_none()) {
            return Err(CudaError::bad(
                KN,
                "gate_inp and shared_logit come together, with a shared expert",
            ));
        }
        let [q0, q1, q2] = act_q8_args(KN, xq, need_q)?;
        let quantize = act_q != ActQ8::NONE;
        if quantize && (!gate.n_rows.is_multiple_of(32) || !s_rows.is_multiple_of(32)) {
            return Err(CudaError::bad(
                KN,
                format!(
                    "expert widths {} and {s_rows} are not whole 32-value blocks to quantize",
                    gate.n_rows
                ),
            ));
        }
        let [aq0, aq1, aq2] = act_q8_args(KN, act_q, false)?;
        let args = [
            Arg::P(gate.ptr),
            Arg::P(up.ptr),
            Arg::I32(ti.code),
            Arg::U64(gate.expert_bytes),
            Arg::U64(gate.row_bytes),
            Arg::I32(int(KN, "n_ff", gate.n_rows)?),
            Arg::P(sg),
            Arg::P(su),
            Arg::I32(s_code),
            Arg::U64(shared.map_or(0, |s| s.0.row_bytes)),
            Arg::I32(int(KN, "n_sff", s_rows)?),
            Arg::P(logits),
            Arg::I32(n_expert as i32),
            Arg::I32(k as i32),
            Arg::P(wts_out),
            Arg::P(ids_out),
            Arg::I32(int(KN, "n_cols", gate.n_cols)?),
            Arg::P(addr(KN, "x", x, 4)?),
            q0,
            q1,
            q2,
            Arg::P(opt_addr(KN, "gate_inp", gate_inp, 4)?),
            Arg::P(opt_addr(KN, "shared_logit", shared_logit, 4)?),
            Arg::P(addr(KN, "act", act, 4)?),
            aq0,
            aq1,
            aq2,
            Arg::P(if quantize {
                addr(KN, "done", done, 4)?
            } else {
                0
            }),
            Arg::P(ids_in),
        ];
        // Four rows a block; the shared plane has one more warp for the gate logit.
        let rows = gate.n_rows.max(s_rows + usize::from(gate_inp != 0));
        let planes = k + usize::from(shared.is_some());
        if n_tok == 0 || n_tok > MAX_GRID_YZ {
            return Err(CudaError::bad(
                KN,
                format!("{n_tok} tokens (1..={MAX_GRID_YZ})"),
            ));
        }
        // The low-bit types have the kernels' twins (kernels/moe.cu).
        let kernel = match (n_tok > 1, lowbit) {
            (true, false) => K::MoeGateUpRows,
            (false, false) => K::MoeGateUp,
            (true, true) => K::MoeGateUpRowsLb,
            (false, true) => K::MoeGateUpLb,
        };
        self.launch(
            kernel,
            [blocks(rows, 4)?, planes as u32, n_tok as u32],
            128,
            0,
            &args,
        )
    }

    /// The down products of [`Gpu::moe_gate_up`]'s `act` and their combination, for
    /// one token, in one launch: `out[c] = Σ_r wts[r]·(act_r·down_{ids[r]}[c])` in rank
    /// order, then `+ sigmoid(*shared_logit)·(act_k·sdown[c])` with a shared expert
    /// (`+ act_k·sdown[c]` when `shared_logit` is 0). The bits of [`Gpu::matvec_tiles`]
    /// and [`Gpu::moe_combine`]. `aq` is act's quantized copy (rows concatenated, as
    /// [`Gpu::quantize_act`] writes one row of k·n_ff + n_sff values), needed when a
    /// type is quantized. A rank with a negative id in `ids` takes its products from
    /// row r of `given` (f32 [k × n_out]: experts computed elsewhere, e.g. by the CPU)
    /// instead; `given` may be 0 when no id is negative. `n_tok` tokens laid out as
    /// [`Gpu::moe_gate_up`] writes them each get their one-token bits (`out` and
    /// `given` rows of n_out values).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_combine(
        &self,
        down: &Mat,
        sdown: Option<&Mat>,
        ids: u64,
        wts: u64,
        k: usize,
        n_tok: usize,
        act: u64,
        aq: ActQ8,
        shared_logit: u64,
        out: u64,
        given: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "moe_down_combine";
        let ti = check_mat(KN, "down", down)?;
        let mut need_q = !ti.float;
        // Half a warp per row when every row is quantized and at most 16 sub-blocks.
        let mut pair = !ti.float && down.n_cols <= 16 * 32;
        let mut lowbit = ti.lowbit;
        let (sp, s_code, s_bytes, s_cols) = match sdown {
            Some(s) => {
                let si = check_mat(KN, "shared down", s)?;
                need_q |= !si.float;
                lowbit |= si.lowbit;
                pair &= !si.float && s.n_cols <= 16 * 32;
                if s.n_rows != down.n_rows {
                    return Err(CudaError::bad(
                        KN,
                        format!(
                            "the shared expert writes {} values, the routed {}",
                            s.n_rows, down.n_rows
                        ),
                    ));
                }
                (s.ptr, si.code, s.row_bytes, s.n_cols)
            }
            None => (0, 0, 0, 0),
        };
        let warps = k + usize::from(sdown.is_some());
        if k == 0 || warps > 32 {
            return Err(CudaError::bad(
                KN,
                format!("top-{k} (at most 31 with a shared expert, 32 without)"),
            ));
        }
        if shared_logit != 0 && sdown.is_none() {
            return Err(CudaError::bad(KN, "shared_logit without a shared expert"));
        }
        let [q0, q1, q2] = act_q8_args(KN, aq, need_q)?;
        let args = [
            Arg::P(down.ptr),
            Arg::I32(ti.code),
            Arg::U64(down.expert_bytes),
            Arg::U64(down.row_bytes),
            Arg::I32(int(KN, "n_ff", down.n_cols)?),
            Arg::P(sp),
            Arg::I32(s_code),
            Arg::U64(s_bytes),
            Arg::I32(int(KN, "n_sff", s_cols)?),
            Arg::P(addr(KN, "ids", ids, 4)?),
            Arg::P(addr(KN, "wts", wts, 4)?),
            Arg::I32(k as i32),
            Arg::P(addr(KN, "act", act, 4)?),
            q0,
            q1,
            q2,
            Arg::P(opt_addr(KN, "shared_logit", shared_logit, 4)?),
            Arg::P(addr(KN, "out", out, 4)?),
            Arg::I32(int(KN, "n_out", down.n_rows)?),
            Arg::I32(i32::from(pair)),
            Arg::P(opt_addr(KN, "given", given, 4)?),
        ];
        if n_tok == 0 || n_tok > MAX_GRID_YZ {
            return Err(CudaError::bad(
                KN,
                format!("{n_tok} tokens (1..={MAX_GRID_YZ})"),
            ));
        }
        let grid = [
            blocks(down.n_rows, if pair { 4 } else { 1 })?,
            n_tok as u32,
            1,
        ];
        let kernel = match (n_tok > 1, lowbit) {
            (true, false) => K::MoeDownCombineRows,
            (false, false) => K::MoeDownCombine,
            (true, true) => K::MoeDownCombineRowsLb,
            (false, true) => K::MoeDownCombineLb,
        };
        self.launch(kernel, grid, 32 * warps as u32, 0, &args)
    }

    /// The router of up to [`ROUTER_MAX_TOKENS`] tokens: `logits` (f32 [n_tok ×
    /// n_expert]) = x (f32 [n_tok × n_cols], 16-byte aligned) · routerᵀ for a float
    /// router (F32, F16 or BF16, one row per expert), the bits of [`Gpu::matvec`]. Each
    /// warp reads its expert row before waiting for the kernel before (programmatic
    /// dependent launch), so the router's weights stream in while that kernel runs;
    /// each token is a row of blocks, which read its values once into shared memory.
    pub fn router(&self, router: &Mat, x: u64, n_tok: usize, logits: u64) -> Result<(), CudaError> {
        self.router_routed(router, x, n_tok, logits, None)
    }

    /// [`Gpu::router`], and with `route`, each token routed too (`model::moe::route`,
    /// [`Gpu::route_topk`]'s bits) by the last block of its row to finish: a decode
    /// step of several rows without `route_topk`'s launch. At most
    /// [`ROUTE_IN_ROUTER_MAX_EXPERT`] experts.
    pub fn router_routed(
        &self,
        router: &Mat,
        x: u64,
        n_tok: usize,
        logits: u64,
        route: Option<RouterRoute>,
    ) -> Result<(), CudaError> {
        const KN: &str = "router";
        let kernel = match (router.ty, route.is_some()) {
            (GgmlType::F32, false) => K::RouterF32,
            (GgmlType::F16, false) => K::RouterF16,
            (GgmlType::BF16, false) => K::RouterBf16,
            (GgmlType::F32, true) => K::RouterF32R,
            (GgmlType::F16, true) => K::RouterF16R,
            (GgmlType::BF16, true) => K::RouterBf16R,
            (other, _) => {
                return Err(CudaError::bad(
                    KN,
                    format!("a {other} router (F32, F16 or BF16 only)"),
                ))
            }
        };
        check_mat(KN, "router", router)?;
        if n_tok > ROUTER_MAX_TOKENS {
            return Err(CudaError::bad(
                KN,
                format!("{n_tok} tokens (at most {ROUTER_MAX_TOKENS})"),
            ));
        }
        if let Some(r) = route {
            let n_expert = router.n_rows;
            if n_expert > ROUTE_IN_ROUTER_MAX_EXPERT
                || r.k == 0
                || r.k > n_expert
                || r.k > MAX_TOP_K
            {
                return Err(CudaError::bad(
                    KN,
                    format!(
                        "routing top-{} of {n_expert} experts (at most {MAX_TOP_K} of {ROUTE_IN_ROUTER_MAX_EXPERT}; \
                         route_topk takes more)",
                        r.k
                    ),
                ));
            }
            addr(KN, "weights_out", r.weights_out, 4)?;
            addr(KN, "ids_out", r.ids_out, 4)?;
            addr(KN, "counter", r.counter, 4)?;
        }
        if n_tok == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(router.ptr),
            Arg::U64(router.row_bytes),
            Arg::I32(int(KN, "n_expert", router.n_rows)?),
            Arg::I32(int(KN, "n_cols", router.n_cols)?),
            Arg::P(addr(KN, "x", x, 16)?),
            Arg::P(addr(KN, "logits", logits, 4)?),
            Arg::I32(route.map_or(0, |r| r.k as i32)),
            Arg::P(route.map_or(0, |r| r.weights_out)),
            Arg::P(route.map_or(0, |r| r.ids_out)),
            Arg::P(route.map_or(0, |r| r.counter)),
        ];
        let grid = [blocks(router.n_rows, 4)?, n_tok as u32, 1];
        self.launch(kernel, grid, 128, 0, &args)
    }

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

    /// Copies `n_a` words at `a`, then `n_b` at `b`, to the mapped pinned buffer
    /// `host` (a `PinnedBuf::dev_ptr`) from word [`PUBLISH_HEAD_WORDS`] on, then sets its word 0 to 1 once
    /// they are visible to the host (`Gpu::wait_word`; the host clears word 0 before
    /// the next launch). Ordered after the stream's work before it.
    pub fn publish_words(
        &self,
        a: u64,
        n_a: usize,
        b: u64,
        n_b: usize,
        host: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "publish_words";
        let args = [
            Arg::P(addr(KN, "a", a, 4)?),
            Arg::I32(int(KN, "n_a", n_a)?),
            Arg::P(opt_addr(KN, "b", b, 4)?),
            Arg::I32(int(KN, "n_b", n_b)?),
            Arg::P(addr(KN, "host", host, 16)?),
        ];
        self.launch(K::PublishWords, [1, 1, 1], 256, 0, &args)
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
