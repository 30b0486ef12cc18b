//! `model::Backend` on one GPU: every op is a kernel launch on the GPU's one
//! stream, reading weights from `WeightsDev` and writing into a scratch arena.
//!
//! **Scratch.** Activations live in one preallocated arena with a bump
//! allocator, so a step allocates nothing and the same sequence of ops gets the
//! same addresses every time (what makes a captured decode graph replayable).
//! The arena has a persistent part (the residual stream `x` and the fixed output
//! of the mixer and output norms, from `embed`) and a per-layer part that is
//! released when the next layer starts (the norm `Norm::Attn`) or at the output
//! norm: `model::forward` holds nothing else across those points. A step's token ids and first position are written to
//! device buffers by the executor before the step, and kernels read them there.
//!
//! **Decode without the host.** With one token, routing, the expert tiles and
//! every product stay on the device: nothing in a step waits for the host, so a
//! step can be captured as a CUDA graph. A prompt (several tokens) downloads its
//! routing once per layer to group tokens by expert.

use super::tiered::{matrices, RowsTo, Tiered};
use super::trace::{DevPoint, HostPoint};
use super::weights::{cuda_err, AttnDev, DevWeight, DnDev, MixerDev, MoeDev, WeightsDev};
use crate::experts::Batch;
use cuda::{DevBuf, Gpu, Graph, Lane, MoeRoute, QAct, Tile, TileShape, TILE_GROUP, TILE_TOKENS};
use model::{Backend, ExecError, LayerKind, ModelConfig, Norm, SegmentRows};
use quant::GgmlType;
use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

/// Activations on the device: `rows` tokens × `cols` f32, row-major.
#[derive(Debug, Clone, Copy)]
pub struct DBuf {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
}

/// One sequence's state in VRAM.
pub struct CudaState {
    pub n_ctx: usize,
    /// Per attention layer: K and V, f32 [n_ctx][n_head_kv][head_dim].
    pub kv: Vec<(DevBuf<f32>, DevBuf<f32>)>,
    /// Per DeltaNet layer: conv history [conv_dim][d_conv − 1] and the
    /// recurrent state [Hv][dk][dv].
    pub conv: Vec<DevBuf<f32>>,
    pub ssm: Vec<DevBuf<f32>>,
}

const ALIGN: usize = 256;

/// The most sequences one batched decode pass takes (rows mode: one token each, their
/// states named by device tables; see [`CudaBackend::load_rows`]).
pub(crate) const MAX_ROWS: usize = 16;

/// What names a sequence's state in the device tables: its first buffer's address.
fn state_id(st: &CudaState) -> u64 {
    st.kv
        .first()
        .map(|(k, _)| k.ptr())
        .or_else(|| st.conv.first().map(DevBuf::ptr))
        .unwrap_or(0)
}

/// DeltaNet layers of the model.
fn n_delta_net(cfg: &ModelConfig) -> usize {
    cfg.layer_kinds
        .iter()
        .filter(|k| **k == LayerKind::DeltaNet)
        .count()
}

fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

pub struct CudaBackend {
    pub(crate) gpu: Gpu,
    pub(crate) cfg: ModelConfig,
    pub(crate) w: WeightsDev,
    arena: DevBuf<u8>,
    /// The input of each mixer and of the LM head (the norms `Norm::Attn` and
    /// `Norm::Output` write here): in the persistent part, after `x`.
    h_fixed: Cell<u64>,
    persist: Cell<usize>,
    top: Cell<usize>,
    /// (cos, sin) per position and rotary pair, computed on the host with
    /// `model::math::rope_cos_sin` (the CPU's values).
    rope: DevBuf<f32>,
    /// The step's token ids (up to `max_tokens`) and each row's position (a
    /// sequence's rows are consecutive positions, so a segment reads its first).
    tok: DevBuf<i32>,
    pos: DevBuf<i32>,
    /// The positions written to `pos` (checked by the mixers).
    pos_host: RefCell<Vec<usize>>,
    /// The first row of the segment whose mixer runs (its position is `pos[seg_row]`).
    seg_row: Cell<usize>,
    /// Rows mode: per attention layer the (K, V) caches of each row, per DeltaNet
    /// layer the conv states then the recurrent states, [`MAX_ROWS`] entries a table
    /// (written by [`Self::load_rows`]), and which state each row's entries are.
    state_tab: DevBuf<u64>,
    tab_ids: RefCell<Vec<u64>>,
    pub(crate) max_tokens: usize,
    /// The expert store when the routed experts do not all live in VRAM
    /// (`MoeDev`'s expert tensors are then slot buffers).
    pub(crate) tiered: Option<Tiered>,
    /// A tiered decode step being recorded or replayed as segments.
    pub(crate) seg: RefCell<Option<SegRun>>,
    /// The last norm's output (address, rows) and the quantized copy the norm
    /// kernel wrote beside it, which `prepare` hands out instead of quantizing again.
    normed_q: Cell<Option<(u64, usize, QAct)>>,
    /// The quantized copy of `h_fixed`, in the persistent part (a norm into
    /// `h_fixed` still reads the released per-layer part, so its copy cannot go there).
    h_fixed_q: Cell<QAct>,
    /// Finished-block counts of the fused gate/up kernel's planes (zero between
    /// launches; see `Gpu::moe_gate_up`).
    plane_done: DevBuf<i32>,
    /// The router's finished blocks per row (zero between launches), for the rows it
    /// routes (`Gpu::router_routed`).
    route_done: DevBuf<i32>,
    /// One token takes the fused kernels (`moe_fused`, `delta_net_step`, the
    /// attention's joint projections); `SCORIA_NO_FUSED_DECODE=1` sends it through the
    /// prompt path's kernels instead, which give the same bits (a test compares them).
    fused: bool,
}

/// A tiered decode step cut into graph segments where the host takes part (each
/// MoE layer reads its routing and moves experts): the device work between two such
/// points is captured once per sequence and replayed after, while the host work in
/// between runs every step. Launches inside a replayed segment are skipped
/// (`Gpu::set_skip`): the arena hands out the same addresses in the same order, so
/// the graphs read and write where this step's eager work expects.
pub(crate) struct SegRun {
    pub record: bool,
    pub graphs: Vec<Graph>,
    pub next: usize,
}

/// The activations of a fused MoE block's gate/up launch, their quantized copy, and
/// where the shared gate's logit went (0 without a shared expert).
struct FusedAct {
    act: DBuf,
    aq: QAct,
    logit: u64,
}

/// A tiered layer's routed experts: their down products and the shared expert's
/// output and gate logit, for `moe_combine`; or, from the fused kernels, the block's
/// output itself.
enum Routed {
    Parts(DBuf, (u64, u64)),
    Combined(DBuf),
}

/// Scratch bytes a step of up to `t` tokens needs (a generous bound: the largest
/// layer's temporaries plus the persistent residual stream and the logits);
/// `attn_split` is the most `Gpu::attn_scratch_bytes` asks for at any such step.
pub(crate) fn scratch_bytes(
    cfg: &ModelConfig,
    t: usize,
    logit_rows: usize,
    attn_split: usize,
) -> usize {
    let f = 4usize;
    let q = |rows: usize, cols: usize| rows * cols + 2 * rows * cols.div_ceil(32) * 4 + 3 * ALIGN;
    let e = cfg.n_embd;
    let hd = cfg.head_dim;
    let q_width = cfg.n_head * hd * if cfg.attn_output_gate { 2 } else { 1 };
    let kvw = cfg.n_head_kv * hd;
    let attn = q(t, e)
        + t * (q_width + 2 * kvw + 2 * cfg.n_head * hd + e) * f
        + q(t, cfg.n_head * hd)
        + attn_split
        + ALIGN;
    let dn = match &cfg.ssm {
        Some(s) => {
            q(t, e)
                + t * (2 * s.conv_dim() + 3 * s.value_dim() + 4 * s.n_v_heads + e) * f
                + q(t, s.value_dim())
        }
        None => 0,
    };
    let k = cfg.n_expert_used;
    let fe = cfg.n_ff_exp;
    let sh = cfg.n_ff_shexp;
    let tiles = (t * k + 2 * cfg.n_expert) * std::mem::size_of::<Tile>();
    let moe = q(t, e)
        + t * (cfg.n_expert + 2 * k) * f
        + 2 * tiles
        + 3 * t * k * fe * f
        + q(t * k, fe)
        + t * k * e * f
        + 3 * t * sh * f
        + q(t, sh.max(32))
        + 3 * t * e * f
        // A tiered decode token's guess of the next layer's routing.
        + (cfg.n_expert + 2 * k) * f
        + 3 * ALIGN;
    let norm = t * e * f;
    let layer = norm + attn.max(dn) + norm + moe;
    // x, the fixed norm output and its quantized copy, the logits.
    let persist = 2 * t * e * f + q(t, e) + logit_rows * cfg.n_vocab * f;
    // Alignment slack: about 60 allocations per layer.
    layer + persist + 64 * ALIGN * 2
}

impl CudaBackend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        gpu: Gpu,
        cfg: ModelConfig,
        w: WeightsDev,
        arena_bytes: usize,
        n_ctx: usize,
        max_tokens: usize,
        tiered: Option<Tiered>,
    ) -> Result<CudaBackend, ExecError> {
        let arena = gpu
            .alloc::<u8>(arena_bytes, "scratch arena")
            .map_err(cuda_err("allocate scratch"))?;
        let half = cfg.n_rot / 2;
        let mut table = Vec::with_capacity(n_ctx * half * 2);
        for p in 0..n_ctx {
            for i in 0..half {
                let (c, s) = model::math::rope_cos_sin(p, i, cfg.n_rot, cfg.rope_theta);
                table.push(c);
                table.push(s);
            }
        }
        if table.is_empty() {
            table.push(0.0);
        }
        let rope = gpu
            .upload(&table, "rope table")
            .map_err(cuda_err("upload rope table"))?;
        let tok = gpu
            .alloc::<i32>(max_tokens, "token ids")
            .map_err(cuda_err("allocate step inputs"))?;
        let pos = gpu
            .alloc::<i32>(max_tokens.max(MAX_ROWS), "positions")
            .map_err(cuda_err("allocate step inputs"))?;
        let plane_done = gpu
            .alloc::<i32>(MAX_ROWS * (cuda::MAX_TOP_K + 1), "expert plane counts")
            .map_err(cuda_err("allocate step inputs"))?;
        let route_done = gpu
            .alloc::<i32>(cuda::ROUTER_MAX_TOKENS, "router counts")
            .map_err(cuda_err("allocate step inputs"))?;
        let tables = 2 * (cfg.n_attention_layers() + n_delta_net(&cfg));
        let state_tab = gpu
            .alloc::<u64>(tables.max(1) * MAX_ROWS, "state tables")
            .map_err(cuda_err("allocate step inputs"))?;
        Ok(CudaBackend {
            gpu,
            cfg,
            w,
            arena,
            h_fixed: Cell::new(0),
            persist: Cell::new(0),
            top: Cell::new(0),
            rope,
            tok,
            pos,
            pos_host: RefCell::new(vec![0]),
            seg_row: Cell::new(0),
            state_tab,
            tab_ids: RefCell::new(Vec::new()),
            max_tokens,
            tiered,
            seg: RefCell::new(None),
            normed_q: Cell::new(None),
            h_fixed_q: Cell::new(QAct::NONE),
            plane_done,
            route_done,
            fused: !std::env::var("SCORIA_NO_FUSED_DECODE").is_ok_and(|v| v == "1"),
        })
    }

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

    fn upload_ids(&self, tokens: &[u32]) -> Result<(), ExecError> {
        if tokens.len() > self.max_tokens {
            return Err(ExecError::new(
                "step",
                format!(
                    "{} tokens in one step (at most {})",
                    tokens.len(),
                    self.max_tokens
                ),
            ));
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        self.gpu
            .copy_to_device(&ids, self.tok.ptr())
            .map_err(cuda_err("upload tokens"))
    }

    /// Writes one sequence's step inputs where the kernels read them: its token ids
    /// and first position.
    pub(crate) fn load_inputs(&self, tokens: &[u32], pos0: usize) -> Result<(), ExecError> {
        self.upload_ids(tokens)?;
        self.gpu
            .copy_to_device(&[pos0 as i32], self.pos.ptr())
            .map_err(cuda_err("upload position"))?;
        *self.pos_host.borrow_mut() = vec![pos0];
        self.tab_ids.borrow_mut().clear();
        Ok(())
    }

    /// Writes a batched decode step's inputs: row r is one token (`tokens[r]`) of the
    /// sequence whose state is `states[r]`, at `positions[r]`; the state tables name
    /// each row's caches and recurrent state, so the mixers run every row in one
    /// launch (rows mode) and a captured pass replays for whatever sequences the
    /// tables name.
    pub(crate) fn load_rows(
        &self,
        tokens: &[u32],
        positions: &[usize],
        states: &[&CudaState],
    ) -> Result<(), ExecError> {
        let n = tokens.len();
        if n > MAX_ROWS || positions.len() != n || states.len() != n {
            return Err(ExecError::new(
                "step",
                format!(
                    "a batched pass of {n} rows ({} positions, {} states; at most {MAX_ROWS})",
                    positions.len(),
                    states.len()
                ),
            ));
        }
        self.upload_ids(tokens)?;
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        self.gpu
            .copy_to_device(&pos, self.pos.ptr())
            .map_err(cuda_err("upload positions"))?;
        let mut tab = vec![0u64; self.state_tab.len()];
        for (r, st) in states.iter().enumerate() {
            for (a, (k, v)) in st.kv.iter().enumerate() {
                tab[a * 2 * MAX_ROWS + 2 * r] = k.ptr();
                tab[a * 2 * MAX_ROWS + 2 * r + 1] = v.ptr();
            }
            let base = 2 * self.cfg.n_attention_layers() * MAX_ROWS;
            for (d, (c, h)) in st.conv.iter().zip(&st.ssm).enumerate() {
                tab[base + 2 * d * MAX_ROWS + r] = c.ptr();
                tab[base + (2 * d + 1) * MAX_ROWS + r] = h.ptr();
            }
        }
        self.gpu
            .copy_to_device(&tab, self.state_tab.ptr())
            .map_err(cuda_err("upload state tables"))?;
        *self.pos_host.borrow_mut() = positions.to_vec();
        *self.tab_ids.borrow_mut() = states.iter().map(|s| state_id(s)).collect();
        Ok(())
    }

    /// The table of attention layer `slot`'s (K, V) per row.
    fn kv_tab(&self, slot: usize) -> u64 {
        self.state_tab.ptr() + (8 * slot * 2 * MAX_ROWS) as u64
    }

    /// The tables of DeltaNet layer `slot`'s conv and recurrent states per row.
    fn dn_tabs(&self, slot: usize) -> (u64, u64) {
        let at = |i: usize| self.state_tab.ptr() + (8 * i * MAX_ROWS) as u64;
        let base = 2 * self.cfg.n_attention_layers();
        (at(base + 2 * slot), at(base + 2 * slot + 1))
    }

    /// Whether the executor runs one token of several sequences as one pass: the
    /// fused kernels route and compute every row's experts on the device (tiered
    /// experts read the routing on the host, one sequence at a time).
    pub(crate) fn batches_rows(&self) -> bool {
        self.fused && self.tiered.is_none()
    }

    /// Whether `parts` are the rows [`Self::load_rows`] wrote, in order: one token
    /// each, their states named by the tables, at the positions written.
    fn rows_mode(&self, parts: &[SegmentRows<'_, CudaState>]) -> bool {
        let ids = self.tab_ids.borrow();
        let pos = self.pos_host.borrow();
        self.fused
            && parts.len() > 1
            && ids.len() == parts.len()
            && pos.len() == parts.len()
            && parts
                .iter()
                .zip(ids.iter().zip(pos.iter()))
                .all(|(p, (&id, &at))| p.rows == 1 && state_id(p.state) == id && p.pos0 == at)
    }

    pub(crate) fn arena_bytes(&self) -> u64 {
        self.arena.bytes()
    }

    pub(crate) fn rope_bytes(&self) -> u64 {
        self.rope.bytes()
    }

    pub(crate) fn new_state_for(&self, n_ctx: usize) -> Result<CudaState, ExecError> {
        let cfg = &self.cfg;
        let g = &self.gpu;
        let kv_len = n_ctx * cfg.n_head_kv * cfg.head_dim;
        let mut kv = Vec::new();
        for _ in 0..cfg.n_attention_layers() {
            kv.push((
                g.alloc::<f32>(kv_len, "K cache")
                    .map_err(cuda_err("allocate state"))?,
                g.alloc::<f32>(kv_len, "V cache")
                    .map_err(cuda_err("allocate state"))?,
            ));
        }
        let (mut conv, mut ssm) = (Vec::new(), Vec::new());
        if let Some(s) = &cfg.ssm {
            for _ in 0..n_delta_net(cfg) {
                conv.push(
                    g.alloc::<f32>(s.conv_dim() * (s.d_conv - 1), "conv state")
                        .map_err(cuda_err("allocate state"))?,
                );
                ssm.push(
                    g.alloc::<f32>(s.n_v_heads * s.d_state * s.d_state, "DeltaNet state")
                        .map_err(cuda_err("allocate state"))?,
                );
            }
        }
        Ok(CudaState {
            n_ctx,
            kv,
            conv,
            ssm,
        })
    }

    /// Zeroes a sequence's recurrent state (K/V past the position are never read).
    pub(crate) fn clear_state(&self, st: &CudaState) -> Result<(), ExecError> {
        for b in st.conv.iter().chain(&st.ssm) {
            self.gpu
                .memset(b.ptr(), 0, b.bytes())
                .map_err(cuda_err("clear state"))?;
        }
        Ok(())
    }

    fn alloc_bytes(&self, bytes: usize, what: &str) -> Result<u64, ExecError> {
        let start = self.top.get().next_multiple_of(ALIGN);
        let end = start + bytes;
        if end as u64 > self.arena.bytes() {
            return Err(ExecError::new(
                what,
                format!(
                    "the scratch arena ({} bytes) is too small for this step (needs more than {end}); this is a sizing bug, please report it",
                    self.arena.bytes()
                ),
            ));
        }
        self.top.set(end);
        Ok(self.arena.ptr() + start as u64)
    }

    fn alloc(&self, rows: usize, cols: usize, what: &str) -> Result<DBuf, ExecError> {
        Ok(DBuf {
            ptr: self.alloc_bytes(rows * cols * 4, what)?,
            rows,
            cols,
        })
    }

    /// Room for the quantized copy of `rows` × `cols` activations.
    fn alloc_qact(&self, rows: usize, cols: usize) -> Result<QAct, ExecError> {
        let n = rows * cols;
        let nb = n / 32;
        Ok(QAct {
            qs: self.alloc_bytes(n, "quantize")?,
            d: self.alloc_bytes(nb * 4, "quantize")?,
            sums: self.alloc_bytes(nb * 4, "quantize")?,
        })
    }

    /// Quantizes the rows of `x` into the canonical int8 blocks.
    fn quantize(&self, x: &DBuf) -> Result<QAct, ExecError> {
        let q = self.alloc_qact(x.rows, x.cols)?;
        self.gpu
            .quantize_act(x.ptr, x.rows, x.cols, q)
            .map_err(cuda_err("quantize_act"))?;
        Ok(q)
    }

    /// The quantized copy of `x` when any of `ws` needs one: the one its norm wrote,
    /// or a new one.
    fn prepare(&self, ws: &[&DevWeight], x: &DBuf) -> Result<QAct, ExecError> {
        if ws.iter().all(|w| is_float(w.ty)) {
            return Ok(QAct::default());
        }
        match self.normed_q.get() {
            Some((ptr, rows, q)) if ptr == x.ptr && rows == x.rows => Ok(q),
            _ => self.quantize(x),
        }
    }

    /// out (tokens × n_rows) = x · Wᵀ, with `xq` from `prepare`.
    fn mm_q(&self, w: &DevWeight, x: &DBuf, xq: QAct) -> Result<DBuf, ExecError> {
        let out = self.alloc(x.rows, w.n_rows, "matvec")?;
        self.mm_q_into(w, x, xq, &out)?;
        Ok(out)
    }

    /// [`Self::mm_q`] into `out` (x.rows × w.n_rows).
    fn mm_q_into(&self, w: &DevWeight, x: &DBuf, xq: QAct, out: &DBuf) -> Result<(), ExecError> {
        if x.cols != w.n_cols {
            return Err(ExecError::new(
                "matvec",
                format!("input has {} columns, weight rows {}", x.cols, w.n_cols),
            ));
        }
        self.gpu
            .matvec(
                w.ty,
                w.ptr,
                w.row_bytes,
                w.n_rows,
                w.n_cols,
                x.ptr,
                xq,
                x.rows,
                out.ptr,
            )
            .map_err(cuda_err("matvec"))
    }

    fn mm(&self, w: &DevWeight, x: &DBuf) -> Result<DBuf, ExecError> {
        let xq = self.prepare(&[w], x)?;
        self.mm_q(w, x, xq)
    }

    /// Routed expert products over `tiles` (device array of `n_tiles`; `grouped`:
    /// built by [`Self::prompt_tiles`] in groups of [`TILE_GROUP`] of one expert).
    #[allow(clippy::too_many_arguments)]
    fn mm_tiles(
        &self,
        w: &DevWeight,
        x: &DBuf,
        xq: QAct,
        tiles: u64,
        n_tiles: usize,
        grouped: bool,
        out_rows: usize,
    ) -> Result<DBuf, ExecError> {
        let out = self.alloc(out_rows, w.n_rows, "expert products")?;
        self.mm_tiles_into(w, x, xq, tiles, n_tiles, grouped, &out)?;
        Ok(out)
    }

    /// [`Self::mm_tiles`] into `out` (rows: every route; the tiles write theirs).
    #[allow(clippy::too_many_arguments)]
    fn mm_tiles_into(
        &self,
        w: &DevWeight,
        x: &DBuf,
        xq: QAct,
        tiles: u64,
        n_tiles: usize,
        grouped: bool,
        out: &DBuf,
    ) -> Result<(), ExecError> {
        // The tiles partition the routes: as many tiles as routes means one token
        // each (always so in a decode step, whose tiles route_topk writes). Every
        // kernel gives the same bits; only the speed differs.
        let shape = if grouped {
            TileShape::Grouped
        } else if n_tiles == out.rows {
            TileShape::Single
        } else {
            TileShape::Any
        };
        self.gpu
            .matvec_tiles_as(
                shape,
                w.ty,
                w.ptr,
                w.stride,
                w.row_bytes,
                w.n_rows,
                w.n_cols,
                x.ptr,
                xq,
                tiles,
                n_tiles,
                out.ptr,
            )
            .map_err(cuda_err("matvec_tiles"))
    }

    fn swiglu(&self, g: &DBuf, u: &DBuf) -> Result<DBuf, ExecError> {
        let out = self.alloc(g.rows, g.cols, "swiglu")?;
        self.swiglu_into(g, u, &out)?;
        Ok(out)
    }

    fn swiglu_into(&self, g: &DBuf, u: &DBuf, out: &DBuf) -> Result<(), ExecError> {
        self.gpu
            .swiglu(g.ptr, u.ptr, g.rows * g.cols, out.ptr)
            .map_err(cuda_err("swiglu"))
    }

    /// Uploads tiles to device address `dst` (stream-ordered: earlier launches
    /// reading `dst` have finished before the copy lands).
    fn put_tiles(&self, tiles: &[Tile], dst: u64) -> Result<(), ExecError> {
        self.gpu
            .copy_to_device(tiles, dst)
            .map_err(cuda_err("upload tiles"))
    }

    /// The shared expert's output and gate logit (device addresses; 0, 0 without one).
    fn shared_expert(&self, m: &MoeDev, x: &DBuf, xq: QAct) -> Result<(u64, u64), ExecError> {
        let Some(s) = &m.shared else {
            return Ok((0, 0));
        };
        let sg = self.mm_q(&s.gate, x, xq)?;
        let su = self.mm_q(&s.up, x, xq)?;
        let sa = self.swiglu(&sg, &su)?;
        let sd = self.mm(&s.down, &sa)?;
        let logit = self.alloc(x.rows, 1, "shared gate")?;
        self.gpu
            .dot_rows(x.ptr, s.gate_inp.ptr(), x.rows, x.cols, logit.ptr)
            .map_err(cuda_err("dot_rows"))?;
        Ok((sd.ptr, logit.ptr))
    }

    /// The routed experts of every resident layer: all its experts are in VRAM.
    /// Returns the down projections, one row per route (token-major, rank order).
    fn routed_resident(
        &self,
        m: &MoeDev,
        x: &DBuf,
        xq: QAct,
        logits: &DBuf,
        wts: &DBuf,
        ids: u64,
    ) -> Result<DBuf, ExecError> {
        let cfg = &self.cfg;
        let (t_n, k) = (x.rows, cfg.n_expert_used);
        let tile_bytes = std::mem::size_of::<Tile>();
        // One token: route_topk writes the expert tiles on the device.
        let device_tiles = if t_n == 1 {
            Some((
                self.alloc_bytes(k * tile_bytes, "route")?,
                self.alloc_bytes(k * tile_bytes, "route")?,
            ))
        } else {
            None
        };
        let (a, b) = device_tiles.unwrap_or((0, 0));
        self.gpu
            .route_topk(logits.ptr, t_n, cfg.n_expert, k, wts.ptr, ids, a, b)
            .map_err(cuda_err("route_topk"))?;
        let (tiles_gu, tiles_down, n_tiles, grouped) = match device_tiles {
            Some((a, b)) => (a, b, k, false),
            None => {
                // A prompt: group its routes by expert on the host.
                let host: Vec<i32> = self
                    .gpu
                    .download(ids, t_n * k)
                    .map_err(cuda_err("download routes"))?;
                let (gu, down, grouped) = self.prompt_tiles(&host, k);
                let a = self.alloc_bytes(gu.len() * tile_bytes, "route")?;
                let b = self.alloc_bytes(down.len() * tile_bytes, "route")?;
                self.put_tiles(&gu, a)?;
                self.put_tiles(&down, b)?;
                (a, b, gu.len(), grouped)
            }
        };
        let rows = t_n * k;
        let g = self.mm_tiles(&m.gate_exps, x, xq, tiles_gu, n_tiles, grouped, rows)?;
        let u = self.mm_tiles(&m.up_exps, x, xq, tiles_gu, n_tiles, grouped, rows)?;
        let act = self.swiglu(&g, &u)?;
        let aq = self.prepare(&[&m.down_exps], &act)?;
        self.mm_tiles(&m.down_exps, &act, aq, tiles_down, n_tiles, grouped, rows)
    }

    /// The MoE block of a token (or of each of up to [`MAX_ROWS`] rows on its own)
    /// when every expert is in VRAM, in three launches: the router; the routing with
    /// every expert's gate/up/SwiGLU (the shared one and its gate logit included) and
    /// their quantized copy; the down products combined. Several rows are routed
    /// once, by the router's last block of each row (or by `route_topk` for more
    /// experts than it routes), rather than in every block of the gate/up launch,
    /// whose blocks multiply with the rows (4 rows decoded 15% slower that way on
    /// Q35, measured 2026-12-02; 8% after the routing's warp reductions, 2026-12-03).
    /// A float router takes `Gpu::router`. The bits of the
    /// unfused path ([`Self::routed_resident`], `shared_expert`, `moe_combine`),
    /// which longer prompts take.
    fn moe_fused(
        &self,
        m: &MoeDev,
        x: &DBuf,
        xq: QAct,
        wts: &DBuf,
        ids: u64,
    ) -> Result<DBuf, ExecError> {
        let (n, k) = (x.rows, self.cfg.n_expert_used);
        let logits = self.alloc(n, m.router.n_rows, "matvec")?;
        // A float router of up to ROUTER_MAX_TOKENS rows: the router kernel, which also
        // routes several rows when the expert count allows (no route_topk launch).
        let float_router = is_float(m.router.ty) && n <= cuda::ROUTER_MAX_TOKENS;
        let routed = float_router && n > 1 && self.cfg.n_expert <= cuda::ROUTE_IN_ROUTER_MAX_EXPERT;
        if float_router {
            let route = routed.then_some(cuda::RouterRoute {
                k,
                weights_out: wts.ptr,
                ids_out: ids,
                counter: self.route_done.ptr(),
            });
            self.gpu
                .router_routed(&m.router.mat(), x.ptr, n, logits.ptr, route)
                .map_err(cuda_err("router"))?;
        } else {
            self.mm_q_into(&m.router, x, xq, &logits)?;
        }
        let route = if n == 1 {
            MoeRoute::Logits {
                logits: logits.ptr,
                n_expert: self.cfg.n_expert,
                wts_out: wts.ptr,
                ids_out: ids,
            }
        } else {
            if !routed {
                self.gpu
                    .route_topk(logits.ptr, n, self.cfg.n_expert, k, wts.ptr, ids, 0, 0)
                    .map_err(cuda_err("route_topk"))?;
            }
            MoeRoute::Given { ids }
        };
        let a = self.fused_gate_up(m, x, xq, route)?;
        self.fused_down(m, &a, ids, wts.ptr, 0)
    }

    /// The first launch of a fused MoE block after the router: the routing (or the
    /// given one), every expert's gate/up/SwiGLU and the shared gate's logit, for each
    /// row of `x` on its own.
    fn fused_gate_up(
        &self,
        m: &MoeDev,
        x: &DBuf,
        xq: QAct,
        route: MoeRoute,
    ) -> Result<FusedAct, ExecError> {
        let k = self.cfg.n_expert_used;
        let (fe, sh) = (
            m.gate_exps.n_rows,
            m.shared.as_ref().map_or(0, |s| s.gate.n_rows),
        );
        let n = x.rows;
        let act = self.alloc(n, k * fe + sh, "expert products")?;
        // The down products' quantized input, written by the gate/up kernel.
        let quantized =
            !is_float(m.down_exps.ty) || m.shared.as_ref().is_some_and(|s| !is_float(s.down.ty));
        let aq = if quantized {
            self.alloc_qact(n, act.cols)?
        } else {
            QAct::NONE
        };
        // Where the shared expert's gate logit goes.
        let logit = match &m.shared {
            Some(_) => self.alloc(n, 1, "shared gate")?.ptr,
            None => 0,
        };
        let shared = m.shared.as_ref().map(|s| (s.gate.mat(), s.up.mat()));
        self.gpu
            .moe_gate_up(
                &m.gate_exps.mat(),
                &m.up_exps.mat(),
                shared.as_ref().map(|(g, u)| (g, u)),
                m.shared.as_ref().map_or(0, |s| s.gate_inp.ptr()),
                route,
                k,
                n,
                x.ptr,
                xq,
                logit,
                act.ptr,
                aq,
                self.plane_done.ptr(),
            )
            .map_err(cuda_err("moe_gate_up"))?;
        Ok(FusedAct { act, aq, logit })
    }

    /// The second launch of a fused MoE block: the down products of the ranks' experts
    /// (`ids`, slots when tiered; a negative one's products are row r of `given`) and
    /// the shared expert, combined with the routing weights `wts`.
    fn fused_down(
        &self,
        m: &MoeDev,
        a: &FusedAct,
        ids: u64,
        wts: u64,
        given: u64,
    ) -> Result<DBuf, ExecError> {
        let out = self.alloc(a.act.rows, self.cfg.n_embd, "moe")?;
        let sdown = m.shared.as_ref().map(|s| s.down.mat());
        self.gpu
            .moe_down_combine(
                &m.down_exps.mat(),
                sdown.as_ref(),
                ids,
                wts,
                self.cfg.n_expert_used,
                a.act.rows,
                a.act.ptr,
                a.aq,
                a.logit,
                out.ptr,
                given,
            )
            .map_err(cuda_err("moe_down_combine"))?;
        Ok(out)
    }

    /// A tiered decode step's routed experts through the fused kernels, when one
    /// batch holds them all: the misses copied into their slots, the given slots'
    /// gate/up (the CPU's ranks skipped) in one launch, and once the CPU's rows are
    /// queued, the down products combined with them in one more. The CPU's team
    /// computes its experts beside this thread's issuing.
    #[allow(clippy::too_many_arguments)]
    fn tiered_fused(
        &self,
        t: &Tiered,
        layer: usize,
        m: &MoeDev,
        x: &DBuf,
        xq: QAct,
        b: &Batch,
        routes: &[u32],
        x_host: &[f32],
        wts: u64,
    ) -> Result<DBuf, ExecError> {
        // Each rank's slot, or -1 where the CPU computes it.
        let slots = b.slots_of(routes);
        if let Some(r) =
            (0..routes.len()).find(|&r| slots[r] < 0 && !b.cpu.iter().any(|&(e, _)| e == routes[r]))
        {
            return Err(ExecError::new(
                "expert store",
                format!("layer {layer}: rank {r}'s expert has neither a slot nor the CPU"),
            ));
        }
        let dev_slots = self.alloc_bytes(4 * slots.len(), "route")?;
        let given = self.alloc(routes.len(), self.cfg.n_embd, "expert products")?;
        let issue = || -> Result<FusedAct, ExecError> {
            t.fetch(&self.gpu, layer, matrices(m), &b.fetch, Lane::Stream)?;
            t.upload_slots(&self.gpu, &slots, dev_slots)?;
            let a = self.fused_gate_up(m, x, xq, MoeRoute::Given { ids: dev_slots })?;
            t.trace_dev(&self.gpu, layer, DevPoint::Products)?;
            Ok(a)
        };
        let a = if b.cpu.is_empty() {
            issue()?
        } else {
            // `given` holds only the CPU's rows: they may go in one copy.
            let to = RowsTo {
                dst: given.ptr,
                cols: given.cols,
                spare: true,
                // Beside the slots' products: 7–9% faster decode than after them
                // on the stream (bench/RESULTS.md, 2026-12-04).
                lane: Lane::Copier,
            };
            let (a, ()) = t.cpu_beside(&self.gpu, layer, b, x_host, routes, to, issue, || ())?;
            a?
        };
        let out = self.fused_down(m, &a, dev_slots, wts, given.ptr)?;
        t.trace_dev(&self.gpu, layer, DevPoint::Down)?;
        Ok(out)
    }

    /// The routed experts of a tiered layer: the host reads the step's routing, the
    /// expert store assigns slots (fetching misses) and, in a decode step, leaves some
    /// misses held in RAM to the CPU (the cost model's split); the same kernels run
    /// over slots instead of experts, one batch of slots at a time, while the CPU's
    /// team computes its experts with the same bits (beside this thread issuing the
    /// device's work) and their rows are queued for upload from pinned memory.
    /// Returns the down projections and the shared expert, or, for a decode step
    /// that the fused kernels take ([`Self::tiered_fused`]), the block's output.
    /// Adds the host's times to the store's statistics.
    #[allow(clippy::too_many_arguments)]
    fn routed_tiered(
        &self,
        t: &Tiered,
        layer: usize,
        m: &MoeDev,
        x: &DBuf,
        xq: QAct,
        logits: &DBuf,
        wts: &DBuf,
        ids: u64,
        guess: bool,
    ) -> Result<Routed, ExecError> {
        let cfg = &self.cfg;
        let (t_n, k) = (x.rows, cfg.n_expert_used);
        let rows = t_n * k;
        // With a guess, `logits` holds a second row: the next layer's (see `moe`).
        let route_rows = t_n + usize::from(guess);
        self.gpu
            .route_topk(logits.ptr, route_rows, cfg.n_expert, k, wts.ptr, ids, 0, 0)
            .map_err(cuda_err("route_topk"))?;
        let n_guess = if guess { k } else { 0 };
        // A decode step may leave experts to the CPU: its input comes with the routes,
        // written to the host by a kernel at the segment's end. The host sees them
        // as they land, sooner than a download's synchronisation would tell it.
        let publish = t_n == 1;
        if publish {
            t.publish_routes(&self.gpu, ids, rows + n_guess, x.ptr, x.cols)?;
        }
        self.seg_break()?;
        t.trace_dev(&self.gpu, layer, DevPoint::SegEnd)?;
        let t0 = Instant::now();
        let got = if publish {
            t.read_published(&self.gpu, layer, rows, n_guess, x.cols)?
        } else {
            t.read_routes(&self.gpu, layer, ids, rows, n_guess)?
        };
        t.trace_host(layer, HostPoint::Read);
        let (routes, x_host) = (got.routes, got.x);
        let wait = t0.elapsed();
        t.wait_ahead(&self.gpu, layer)?;
        let mut store = t.store.borrow_mut();
        let bytes = store.plan().layers[layer].expert_bytes;
        let batches = store
            .step(layer, &routes, &|misses| {
                if t_n == 1 {
                    t.to_cpu(misses, bytes)
                } else {
                    0
                }
            })
            .map_err(|e| ExecError::new("expert store", e))?;
        drop(store);
        let fused = t_n == 1
            && self.fused
            && batches.len() == 1
            && !batches[0].pool
            && fused_moe(m, cfg.n_expert, k);
        let routed = if fused {
            self.tiered_fused(t, layer, m, x, xq, &batches[0], &routes, &x_host, wts.ptr)
                .map(Routed::Combined)
        } else {
            self.tiered_batches(t, layer, m, x, xq, &batches, &routes, &x_host)
        };
        if routed.is_err() {
            // The store took every batch's fetches as done: a failed one's, and those
            // after it, which never ran. No later step may take their slots for hits.
            let mut store = t.store.borrow_mut();
            for b in &batches {
                store.forget(layer, &b.fetch);
            }
        }
        let routed = routed?;
        let next = layer + 1;
        // A decode token: the next layer's guessed experts start on their way to its
        // slots now, beside this layer's last products and the next layer's mixer.
        if !got.guesses.is_empty() {
            let n = t.guesses.min(got.guesses.len());
            t.copy_ahead(&self.gpu, next, &self.w.layers[next].moe, &got.guesses[..n])?;
        }
        // A long prompt chunk: the next layer's experts start on their way to the
        // pool now, beside this layer's last products and the next layer's mixer.
        if t_n > 1 && next < t.store.borrow().n_layer() {
            t.prefetch(&self.gpu, next, &self.w.layers[next].moe, t_n)?;
        }
        let ns = |d: Duration| d.as_nanos() as u64;
        t.store
            .borrow_mut()
            .add_step_time(ns(t0.elapsed()), ns(wait));
        self.seg_resume()?;
        Ok(routed)
    }

    /// The batches of a tiered step through the tile kernels (prompts, and decode
    /// steps the fused kernels do not take): each batch's misses copied in, its
    /// slots' products (or the prompt pool's), the CPU's experts beside; then the
    /// shared expert.
    #[allow(clippy::too_many_arguments)]
    fn tiered_batches(
        &self,
        t: &Tiered,
        layer: usize,
        m: &MoeDev,
        x: &DBuf,
        xq: QAct,
        batches: &[Batch],
        routes: &[u32],
        x_host: &[f32],
    ) -> Result<Routed, ExecError> {
        let cfg = &self.cfg;
        let (k, rows) = (cfg.n_expert_used, routes.len());
        let g = self.alloc(rows, m.gate_exps.n_rows, "expert products")?;
        let u = self.alloc(rows, m.up_exps.n_rows, "expert products")?;
        let act = self.alloc(rows, m.gate_exps.n_rows, "swiglu")?;
        let down = self.alloc(rows, m.down_exps.n_rows, "expert products")?;
        let aq = if is_float(m.down_exps.ty) {
            QAct::default()
        } else {
            self.alloc_qact(rows, act.cols)?
        };
        let tile_bytes = std::mem::size_of::<Tile>();
        // prompt_tiles makes at most ⌈n/8⌉ tiles of an expert with n routes, or in
        // groups, TILE_GROUP·⌈n/32⌉ ≤ TILE_GROUP·(⌈n/8⌉) (n ≥ 1).
        let max_tiles = TILE_GROUP * (rows.div_ceil(TILE_TOKENS) + cfg.n_expert);
        let ta = self.alloc_bytes(max_tiles * tile_bytes, "route")?;
        let tb = self.alloc_bytes(max_tiles * tile_bytes, "route")?;
        let slots = matrices(m);
        let pool = batches
            .iter()
            .any(|b| b.pool)
            .then(|| t.pool_mats(m))
            .flatten();
        let mut shared = None;
        // Several batches overlap copies with products: a batch's copies run on the
        // copier as soon as the batch they overwrite (`Batch::after`) has computed,
        // and the batch computes once its copies have landed (per-batch marks). The
        // store never puts consecutive slot batches in the same slots, so batch i+1's
        // copies run while batch i computes; the pool's batch, filled during the
        // mixer, computes while the first slot copies run. The shared expert runs
        // beside the copies that wait for nothing.
        let double = batches.len() > 1;
        let gpu = &self.gpu;
        let marks = if double {
            Some(t.marks(gpu, batches.len())?)
        } else {
            None
        };
        let ord = cuda_err("order expert copies");
        // Issues batch j's copies on the copier (after whatever the copier was made
        // to wait for) and marks where they end.
        let copy = |j: usize| -> Result<(), ExecError> {
            if let Some(marks) = &marks {
                t.fetch(gpu, layer, slots, &batches[j].fetch, Lane::Copier)?;
                gpu.mark(Lane::Copier, &marks[j][1]).map_err(&ord)?;
            }
            Ok(())
        };
        if double {
            // After the slots' readers in earlier steps.
            gpu.copier_waits().map_err(&ord)?;
            for (j, b) in batches.iter().enumerate() {
                if b.after.is_none() && !b.fetch.is_empty() {
                    copy(j)?;
                }
            }
            shared = Some(self.shared_expert(m, x, xq)?);
        }
        for (i, b) in batches.iter().enumerate() {
            // The device's part of the batch: its copies (or a wait for them), its
            // experts' products, and the copies that waited for them.
            let issue = || -> Result<(), ExecError> {
                let mats = if b.pool {
                    t.wait_pool(gpu)?;
                    let p = pool.as_ref().ok_or_else(|| {
                        ExecError::new("expert store", "a pool batch without a pool")
                    })?;
                    [&p[0], &p[1], &p[2]]
                } else if let Some(marks) = marks.as_ref().filter(|_| !b.fetch.is_empty()) {
                    gpu.wait_mark(Lane::Stream, &marks[i][1]).map_err(&ord)?;
                    slots
                } else {
                    t.fetch(gpu, layer, slots, &b.fetch, Lane::Stream)?;
                    slots
                };
                // Routes of this batch's experts, named by slot; the others are skipped.
                let (gu, dn, grouped) = self.prompt_tiles(&b.slots_of(routes), k);
                if !gu.is_empty() {
                    self.put_tiles(&gu, ta)?;
                    self.put_tiles(&dn, tb)?;
                    self.mm_tiles_into(mats[0], x, xq, ta, gu.len(), grouped, &g)?;
                    self.mm_tiles_into(mats[1], x, xq, ta, gu.len(), grouped, &u)?;
                    // Rows of other batches are recomputed alike (element- and row-wise ops).
                    self.swiglu_into(&g, &u, &act)?;
                    if !is_float(m.down_exps.ty) {
                        self.gpu
                            .quantize_act(act.ptr, act.rows, act.cols, aq)
                            .map_err(cuda_err("quantize_act"))?;
                    }
                    self.mm_tiles_into(mats[2], &act, aq, tb, dn.len(), grouped, &down)?;
                }
                if b.pool {
                    t.pool_read(gpu)?;
                }
                if let Some(marks) = &marks {
                    let later: Vec<usize> = (i + 1..batches.len())
                        .filter(|&j| batches[j].after == Some(i) && !batches[j].fetch.is_empty())
                        .collect();
                    if !later.is_empty() {
                        gpu.mark(Lane::Stream, &marks[i][0]).map_err(&ord)?;
                        gpu.wait_mark(Lane::Copier, &marks[i][0]).map_err(&ord)?;
                        for j in later {
                            copy(j)?;
                        }
                    }
                }
                Ok(())
            };
            // The shared expert, issued once (beside the CPU's down products).
            let first = shared.is_none();
            let shared_issue = || first.then(|| self.shared_expert(m, x, xq)).transpose();
            let s = if b.cpu.is_empty() {
                issue()?;
                shared_issue()?
            } else {
                // The CPU computes its experts on its team while this thread issues
                // the device's work: gate/up beside the copies and the slots'
                // products, down beside the shared expert.
                // The GPU's products fill the other rows of `down`: a copy a row.
                let to = RowsTo {
                    dst: down.ptr,
                    cols: down.cols,
                    spare: false,
                    lane: Lane::Stream,
                };
                let (issued, s) =
                    t.cpu_beside(&self.gpu, layer, b, x_host, routes, to, issue, shared_issue)?;
                issued?;
                s?
            };
            shared = shared.or(s);
        }
        let shared = match shared {
            Some(s) => s,
            None => self.shared_expert(m, x, xq)?,
        };
        Ok(Routed::Parts(down, shared))
    }

    /// The weight of norm `which`, where its output goes and where its quantized copy
    /// goes (remembered for `prepare`; none when rows are not whole 32-value blocks).
    /// A mixer's input and the LM head's go to the fixed buffer and its fixed
    /// quantized copy, and the previous layer's scratch is released (the kernel
    /// reading it is ordered before any later reuse on the stream); the MoE block's
    /// input is an ordinary allocation.
    fn norm_target(&self, x: &DBuf, which: Norm) -> Result<(u64, DBuf, QAct), ExecError> {
        let fixed = DBuf {
            ptr: self.h_fixed.get(),
            rows: x.rows,
            cols: x.cols,
        };
        let (w, out, q) = match which {
            Norm::Attn(i) => {
                self.top.set(self.persist.get());
                (
                    self.w.layers[i].attn_norm.ptr(),
                    fixed,
                    self.h_fixed_q.get(),
                )
            }
            Norm::Output => {
                self.top.set(self.persist.get());
                (self.w.output_norm.ptr(), fixed, self.h_fixed_q.get())
            }
            Norm::Ffn(i) => {
                let out = self.alloc(x.rows, x.cols, "rms_norm")?;
                let q = if x.cols.is_multiple_of(32) {
                    self.alloc_qact(x.rows, x.cols)?
                } else {
                    QAct::NONE
                };
                (self.w.layers[i].ffn_norm.ptr(), out, q)
            }
        };
        self.normed_q
            .set((q != QAct::NONE).then_some((out.ptr, out.rows, q)));
        Ok((w, out, q))
    }

    /// Checks that the current segment's first position is `pos0` on the device too,
    /// and returns where it is.
    fn check_pos(&self, pos0: usize, op: &str) -> Result<u64, ExecError> {
        let row = self.seg_row.get();
        let have = self.pos_host.borrow().get(row).copied();
        if have != Some(pos0) {
            return Err(ExecError::new(
                op,
                format!("position {pos0} was not written to the device (have {have:?})"),
            ));
        }
        Ok(self.pos.ptr() + 4 * row as u64)
    }

    /// Groups a prompt's (token, rank) routes by expert into tiles of up to 8
    /// tokens: (gate/up tiles reading token rows, down tiles reading route rows,
    /// grouped). When the experts average at least a tile of tokens, each expert's
    /// tiles are padded with empty ones to whole groups of [`TILE_GROUP`], which the
    /// tensor-core GEMM reads as one unit (`grouped`); sparser prompts (and tiered
    /// decode steps) keep one tile per 8 routes for the matvec kernels.
    fn prompt_tiles(&self, ids: &[i32], k: usize) -> (Vec<Tile>, Vec<Tile>, bool) {
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); self.cfg.n_expert];
        for (r, &e) in ids.iter().enumerate() {
            if let Some(v) = by_expert.get_mut(e as usize) {
                v.push(r);
            }
        }
        let active = by_expert.iter().filter(|v| !v.is_empty()).count();
        let routed: usize = by_expert.iter().map(Vec::len).sum();
        let grouped = active > 0 && routed >= TILE_TOKENS * active;
        let (mut gu, mut down) = (Vec::new(), Vec::new());
        for (e, routes) in by_expert.iter().enumerate() {
            let n_tiles = routes.len().div_ceil(TILE_TOKENS);
            let padded = if grouped {
                n_tiles.next_multiple_of(TILE_GROUP)
            } else {
                n_tiles
            };
            for i in 0..padded {
                // Past the expert's routes: an empty tile padding its group.
                let lo = (i * TILE_TOKENS).min(routes.len());
                let chunk = &routes[lo..(lo + TILE_TOKENS).min(routes.len())];
                let mut a = Tile {
                    expert: e as i32,
                    n: chunk.len() as i32,
                    in_row: [-1; 8],
                    out_row: [-1; 8],
                };
                let mut b = a;
                for (j, &r) in chunk.iter().enumerate() {
                    a.in_row[j] = (r / k) as i32;
                    a.out_row[j] = r as i32;
                    b.in_row[j] = r as i32;
                    b.out_row[j] = r as i32;
                }
                gu.push(a);
                down.push(b);
            }
        }
        (gu, down, grouped)
    }

    /// One token of a DeltaNet layer in three launches: the input projections with
    /// the conv of qkv (`matvec_multi`), the q/k norm, recurrence and gated norm with
    /// the output's quantized copy (`dn_step`), and the output projection. The bits
    /// of the prompt path's separate kernels.
    fn delta_net_step(
        &self,
        d: &DnDev,
        ssm: &model::SsmConfig,
        x: &DBuf,
        xq: QAct,
        state: &mut CudaState,
        slot: usize,
    ) -> Result<DBuf, ExecError> {
        let conv = self.alloc(1, ssm.conv_dim(), "delta_net")?;
        let z = self.alloc(1, d.gate.n_rows, "delta_net")?;
        let proj: Vec<DBuf> = d
            .proj
            .iter()
            .map(|w| self.alloc(1, w.n_rows, "delta_net"))
            .collect::<Result<_, _>>()?;
        let mut mats = vec![d.qkv.mat(), d.gate.mat()];
        mats.extend(d.proj.iter().map(DevWeight::mat));
        let mut outs = vec![conv.ptr, z.ptr];
        outs.extend(proj.iter().map(|p| p.ptr));
        self.gpu
            .matvec_multi(
                &mats.iter().collect::<Vec<_>>(),
                &outs,
                x.ptr,
                xq,
                Some((state.conv[slot].ptr(), d.conv.ptr(), ssm.d_conv)),
            )
            .map_err(cuda_err("matvec_multi"))?;
        let (y, yq, step) = self.dn_step_args(d, ssm, &proj, &z, 1)?;
        self.gpu
            .dn_step(conv.ptr, &step, state.ssm[slot].ptr(), y.ptr, yq)
            .map_err(cuda_err("dn_step"))?;
        self.mm_q(&d.out, &y, yq)
    }
}

impl CudaBackend {
    /// The output rows of a DeltaNet step (and their quantized copy when the output
    /// projection needs one) and the `dn_step` arguments over the layer's β/α sources
    /// `proj` and gate `z`.
    fn dn_step_args(
        &self,
        d: &DnDev,
        ssm: &model::SsmConfig,
        proj: &[DBuf],
        z: &DBuf,
        rows: usize,
    ) -> Result<(DBuf, QAct, cuda::DnStep), ExecError> {
        let y = self.alloc(rows, ssm.value_dim(), "delta_net")?;
        let yq = if is_float(d.out.ty) {
            QAct::NONE
        } else {
            self.alloc_qact(rows, y.cols)?
        };
        let step = cuda::DnStep {
            beta_src: proj[d.beta.proj].ptr,
            beta_idx: d.beta.idx.ptr(),
            alpha_src: proj[d.alpha.proj].ptr,
            alpha_idx: d.alpha.idx.ptr(),
            a: d.a.ptr(),
            dt_bias: d.dt_bias.ptr(),
            k_head_of: d.k_head_of.ptr(),
            z: z.ptr,
            norm_w: d.norm.ptr(),
            eps: self.cfg.eps,
            scale: 1.0 / (ssm.d_state as f32).sqrt(),
            n_k_heads: ssm.n_k_heads,
            n_v_heads: ssm.n_v_heads,
            d_state: ssm.d_state,
        };
        Ok((y, yq, step))
    }

    /// An attention layer after its projections: the q/k norms, rotary and cache
    /// write (`attn_prep`), the attention over the cache (`attn_core`) and the output
    /// projection, for the rows of `q_raw`. `caches` are one sequence's (K, V), whose
    /// first position is at `pos_dev`; or, with `kv_tab`, ignored: each row is one
    /// token of its own sequence, its caches in the table and its position at
    /// `pos_dev` + 4·row (rows mode).
    #[allow(clippy::too_many_arguments)]
    fn attention_core(
        &self,
        a: &AttnDev,
        (q_raw, k_raw, v_raw): (&DBuf, &DBuf, &DBuf),
        pos_dev: u64,
        caches: (u64, u64),
        kv_tab: u64,
        n_ctx: usize,
    ) -> Result<DBuf, ExecError> {
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let n = q_raw.rows;
        let q_stride = if cfg.attn_output_gate { 2 * hd } else { hd };
        let q = self.alloc(n, nh * hd, "attention")?;
        self.gpu
            .attn_prep(
                q_raw.ptr,
                k_raw.ptr,
                v_raw.ptr,
                n,
                pos_dev,
                nh,
                nkv,
                hd,
                q_stride,
                a.q_norm.ptr(),
                a.k_norm.ptr(),
                cfg.eps,
                self.rope.ptr(),
                cfg.n_rot,
                caches.0,
                caches.1,
                q.ptr,
                kv_tab,
            )
            .map_err(cuda_err("attn_prep"))?;
        let out = self.alloc(n, nh * hd, "attention")?;
        // The output projection's quantized input, written by the attention kernels.
        let oq = if is_float(a.o.ty) {
            QAct::NONE
        } else {
            self.alloc_qact(n, nh * hd)?
        };
        let split = if kv_tab == 0 {
            self.gpu.attn_scratch_bytes(n, nh, nkv, hd, n_ctx)
        } else {
            self.gpu.attn_rows_scratch_bytes(n, nh, nkv, hd, n_ctx)
        };
        let scratch = if split > 0 {
            self.alloc_bytes(split as usize, "attention")?
        } else {
            0
        };
        // The kernel finds head h's gate at h·q_stride + head_dim of the raw q row.
        let gate = if cfg.attn_output_gate { q_raw.ptr } else { 0 };
        let quantized = self
            .gpu
            .attn_core(
                q.ptr, n, pos_dev, nh, nkv, hd, caches.0, caches.1, n_ctx, gate, q_stride, out.ptr,
                scratch, oq, kv_tab,
            )
            .map_err(cuda_err("attn_core"))?;
        if oq != QAct::NONE && !quantized {
            self.gpu
                .quantize_act(out.ptr, out.rows, out.cols, oq)
                .map_err(cuda_err("quantize_act"))?;
        }
        self.mm_q(&a.o, &out, oq)
    }

    /// The input projections of a mixer in rows mode: every row of `x` against each
    /// of `ws` (at most four) in one launch, into `outs`; with `conv` (state table,
    /// taps, d_conv) matrix 0's rows go through each row's DeltaNet conv.
    fn multi_rows(
        &self,
        ws: &[&DevWeight],
        x: &DBuf,
        xq: QAct,
        conv: Option<(u64, u64, usize)>,
    ) -> Result<Vec<DBuf>, ExecError> {
        let outs: Vec<DBuf> = ws
            .iter()
            .map(|w| self.alloc(x.rows, w.n_rows, "matvec_multi_rows"))
            .collect::<Result<_, _>>()?;
        let mats: Vec<cuda::Mat> = ws.iter().map(|w| w.mat()).collect();
        let ptrs: Vec<u64> = outs.iter().map(|o| o.ptr).collect();
        self.gpu
            .matvec_multi_rows(
                &mats.iter().collect::<Vec<_>>(),
                &ptrs,
                x.ptr,
                xq,
                x.rows,
                conv,
            )
            .map_err(cuda_err("matvec_multi_rows"))?;
        Ok(outs)
    }

    /// Rows mode of a DeltaNet layer: the input projections once over every row with
    /// each row's conv on its own state, then each row's recurrence and gated norm on
    /// its own state in one launch (the one-token kernels' bits), and the output
    /// projection over every row.
    /// None when the layer's shape has no one-token kernel.
    fn delta_net_rows(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
    ) -> Result<Option<DBuf>, ExecError> {
        let (MixerDev::DeltaNet(d), Some(ssm)) = (&self.w.layers[layer].mixer, &self.cfg.ssm)
        else {
            return Ok(None);
        };
        let mut ws: Vec<&DevWeight> = vec![&d.qkv, &d.gate];
        ws.extend(d.proj.iter());
        if !dn_step_shape(&ws, ssm) {
            return Ok(None);
        }
        let n = x.rows;
        let xq = self.prepare(&ws, x)?;
        let (conv_tab, ssm_tab) = self.dn_tabs(slot);
        let outs = self.multi_rows(&ws, x, xq, Some((conv_tab, d.conv.ptr(), ssm.d_conv)))?;
        let (conv, z, proj) = (&outs[0], &outs[1], &outs[2..]);
        let conv_dim = ssm.conv_dim();
        let (y, yq, step) = self.dn_step_args(d, ssm, proj, z, n)?;
        let rows = cuda::DnRows {
            n,
            state_tab: ssm_tab,
            conv_stride: conv_dim,
            beta_stride: d.beta.stride,
            alpha_stride: d.alpha.stride,
        };
        self.gpu
            .dn_step_rows(conv.ptr, &step, &rows, y.ptr, yq)
            .map_err(cuda_err("dn_step_rows"))?;
        Ok(Some(self.mm_q(&d.out, &y, yq)?))
    }

    /// Rows mode of an attention layer: the projections once over every row, then
    /// each row's q/k norm, rotary and cache write, and its attention over its own
    /// cache, in one launch each (the one-token launches' bits), and the output
    /// projection over every row. None when the shape has no rows mode.
    fn attention_rows(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
        parts: &[SegmentRows<'_, CudaState>],
    ) -> Result<Option<DBuf>, ExecError> {
        let MixerDev::Attention(a) = &self.w.layers[layer].mixer else {
            return Ok(None);
        };
        let (nh, nkv) = (self.cfg.n_head, self.cfg.n_head_kv);
        let n_ctx = parts[0].state.n_ctx;
        if nkv == 0 || nh / nkv > 16 || parts.iter().any(|p| p.state.n_ctx != n_ctx) {
            return Ok(None);
        }
        if let Some(p) = parts.iter().find(|p| p.pos0 + 1 > n_ctx) {
            return Err(ExecError::new(
                "attention",
                format!("position {} exceeds the context of {n_ctx}", p.pos0),
            ));
        }
        let ws = [&a.q, &a.k, &a.v];
        let xq = self.prepare(&ws, x)?;
        let outs = self.multi_rows(&ws, x, xq, None)?;
        let raw = (&outs[0], &outs[1], &outs[2]);
        let tab = self.kv_tab(slot);
        self.attention_core(a, raw, self.pos.ptr(), (0, 0), tab, n_ctx)
            .map(Some)
    }
}

/// Whether a DeltaNet layer with input projections `ws` has the one-token kernels
/// (`matvec_multi` takes at most four matrices, `dn_step` three state widths).
fn dn_step_shape(ws: &[&DevWeight], ssm: &model::SsmConfig) -> bool {
    ws.len() <= 4 && matches!(ssm.d_state, 32 | 64 | 128)
}

/// Whether one token's MoE block of `m` can take the fused kernels: gate and up of
/// one type and shape (routed and shared alike), the shared expert reading and
/// writing the routed width, widths of whole 32-value blocks (the activations'
/// quantized copy), a warp per rank in one block, and few enough experts for the
/// fused routing.
fn fused_moe(m: &MoeDev, n_expert: usize, k: usize) -> bool {
    let pair = |g: &DevWeight, u: &DevWeight| {
        (g.ty, g.row_bytes, g.stride, g.n_rows, g.n_cols)
            == (u.ty, u.row_bytes, u.stride, u.n_rows, u.n_cols)
    };
    let shared_ok = m.shared.as_ref().is_none_or(|s| {
        pair(&s.gate, &s.up)
            && s.gate.n_cols == m.gate_exps.n_cols
            && s.down.n_rows == m.down_exps.n_rows
    });
    let widths_ok = m.gate_exps.n_rows.is_multiple_of(32)
        && m.shared
            .as_ref()
            .is_none_or(|s| s.gate.n_rows.is_multiple_of(32));
    pair(&m.gate_exps, &m.up_exps)
        && shared_ok
        && widths_ok
        && k + usize::from(m.shared.is_some()) <= 32
        && k <= cuda::MAX_TOP_K
        && n_expert <= cuda::FUSED_MAX_EXPERTS
}

impl Backend for CudaBackend {
    type Buf = DBuf;
    type State = CudaState;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn new_state(&self, n_ctx: usize) -> Result<CudaState, ExecError> {
        self.new_state_for(n_ctx)
    }

    /// Reads the token ids the executor wrote to `tok`.
    fn embed(&self, tokens: &[u32]) -> Result<DBuf, ExecError> {
        if tokens.len() > self.max_tokens {
            return Err(ExecError::new(
                "embed",
                format!(
                    "{} tokens in one step (at most {})",
                    tokens.len(),
                    self.max_tokens
                ),
            ));
        }
        self.top.set(0);
        self.persist.set(0);
        self.normed_q.set(None);
        // A long prompt chunk: the first layer's experts start on their way to the
        // prompt pool (later layers' from the layer before; see `routed_tiered`).
        if let Some(t) = &self.tiered {
            if tokens.len() > 1 && !self.gpu.is_capturing() {
                t.prefetch(&self.gpu, 0, &self.w.layers[0].moe, tokens.len())?;
            } else {
                // Left by a step that failed part way: not for this one.
                t.store.borrow_mut().drop_pool();
            }
        }
        let t = &self.w.token_embd;
        let x = self.alloc(tokens.len(), t.n_cols, "embed")?;
        let h = self.alloc(tokens.len(), t.n_cols, "embed")?;
        self.h_fixed.set(h.ptr);
        self.h_fixed_q.set(if t.n_cols.is_multiple_of(32) {
            self.alloc_qact(tokens.len(), t.n_cols)?
        } else {
            QAct::NONE
        });
        self.gpu
            .embed(
                t.ty,
                t.ptr,
                t.row_bytes,
                t.n_cols,
                self.tok.ptr(),
                tokens.len(),
                x.ptr,
            )
            .map_err(cuda_err("embed"))?;
        self.persist.set(self.top.get());
        Ok(x)
    }

    fn rms_norm(&self, x: &DBuf, which: Norm) -> Result<DBuf, ExecError> {
        let (w, out, q) = self.norm_target(x, which)?;
        self.gpu
            .rms_norm(x.ptr, x.rows, x.cols, w, self.cfg.eps, out.ptr, q)
            .map_err(cuda_err("rms_norm"))?;
        Ok(out)
    }

    fn add_assign(&self, x: &mut DBuf, y: &DBuf) -> Result<(), ExecError> {
        self.gpu
            .add(x.ptr, y.ptr, x.rows * x.cols)
            .map_err(cuda_err("add"))
    }

    fn add_rms_norm(&self, x: &mut DBuf, y: &DBuf, which: Norm) -> Result<DBuf, ExecError> {
        let (w, out, q) = self.norm_target(x, which)?;
        self.gpu
            .add_rms_norm(x.ptr, y.ptr, x.rows, x.cols, w, self.cfg.eps, out.ptr, q)
            .map_err(cuda_err("add_rms_norm"))?;
        Ok(out)
    }

    fn last_row(&self, x: DBuf) -> Result<DBuf, ExecError> {
        // A view of the last row: it stays in the persistent part with `x`.
        Ok(DBuf {
            ptr: x.ptr + ((x.rows - 1) * x.cols * 4) as u64,
            rows: 1,
            cols: x.cols,
        })
    }

    /// A view of the rows (they stay where they are).
    fn rows(&self, x: &DBuf, start: usize, n: usize) -> Result<DBuf, ExecError> {
        if start + n > x.rows {
            return Err(ExecError::new(
                "rows",
                format!("rows {start}..{} of {}", start + n, x.rows),
            ));
        }
        Ok(DBuf {
            ptr: x.ptr + (start * x.cols * 4) as u64,
            rows: n,
            cols: x.cols,
        })
    }

    /// Parts that lie one after another are one view; others are copied together.
    fn concat_rows(&self, parts: &[DBuf]) -> Result<DBuf, ExecError> {
        let Some(first) = parts.first() else {
            return Err(ExecError::new("concat_rows", "no parts"));
        };
        let cols = first.cols;
        if let Some(p) = parts.iter().find(|p| p.cols != cols) {
            return Err(ExecError::new(
                "concat_rows",
                format!("parts of {cols} and {} columns", p.cols),
            ));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let adjacent = parts
            .windows(2)
            .all(|w| w[1].ptr == w[0].ptr + (w[0].rows * cols * 4) as u64);
        if adjacent {
            return Ok(DBuf {
                ptr: first.ptr,
                rows,
                cols,
            });
        }
        let out = self.alloc(rows, cols, "concat_rows")?;
        let mut at = out.ptr;
        for p in parts {
            let bytes = (p.rows * cols * 4) as u64;
            self.gpu
                .copy_device(p.ptr, at, bytes)
                .map_err(cuda_err("concat_rows"))?;
            at += bytes;
        }
        Ok(out)
    }

    /// One sequence: its mixer over all of `h`. The rows [`CudaBackend::load_rows`]
    /// wrote (a batched decode step): rows mode, each kernel once for every row.
    /// Otherwise each segment on its own rows, reading its positions from its first row.
    fn mix_segments(
        &self,
        layer: usize,
        kind: LayerKind,
        slot: usize,
        h: &DBuf,
        parts: &mut [SegmentRows<'_, CudaState>],
    ) -> Result<DBuf, ExecError> {
        let mix = |hs: &DBuf, p: &mut SegmentRows<'_, CudaState>| match kind {
            LayerKind::Attention => self.attention(layer, slot, hs, p.pos0, p.state),
            LayerKind::DeltaNet => self.delta_net(layer, slot, hs, p.state),
        };
        if let [p] = parts {
            return mix(h, p);
        }
        if self.rows_mode(parts) {
            let out = match kind {
                LayerKind::Attention => self.attention_rows(layer, slot, h, parts)?,
                LayerKind::DeltaNet => self.delta_net_rows(layer, slot, h)?,
            };
            if let Some(out) = out {
                return Ok(out);
            }
        }
        let mut outs = Vec::with_capacity(parts.len());
        let mut start = 0;
        for p in parts.iter_mut() {
            let hs = self.rows(h, start, p.rows)?;
            self.seg_row.set(start);
            let out = mix(&hs, p);
            self.seg_row.set(0);
            outs.push(out?);
            start += p.rows;
        }
        self.concat_rows(&outs)
    }

    fn attention(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
        pos0: usize,
        state: &mut CudaState,
    ) -> Result<DBuf, ExecError> {
        let pos_dev = self.check_pos(pos0, "attention")?;
        let MixerDev::Attention(a) = &self.w.layers[layer].mixer else {
            return Err(ExecError::new(
                "attention",
                format!("layer {layer} has no attention weights"),
            ));
        };
        let t_n = x.rows;
        if pos0 + t_n > state.n_ctx {
            return Err(ExecError::new(
                "attention",
                format!(
                    "positions {pos0}..{} exceed the context of {}",
                    pos0 + t_n,
                    state.n_ctx
                ),
            ));
        }
        let xq = self.prepare(&[&a.q, &a.k, &a.v], x)?;
        let (q_raw, k_raw, v_raw) = if t_n == 1 && self.fused {
            // One token: the three projections in one launch.
            let q_raw = self.alloc(1, a.q.n_rows, "attention")?;
            let k_raw = self.alloc(1, a.k.n_rows, "attention")?;
            let v_raw = self.alloc(1, a.v.n_rows, "attention")?;
            self.gpu
                .matvec_multi(
                    &[&a.q.mat(), &a.k.mat(), &a.v.mat()],
                    &[q_raw.ptr, k_raw.ptr, v_raw.ptr],
                    x.ptr,
                    xq,
                    None,
                )
                .map_err(cuda_err("matvec_multi"))?;
            (q_raw, k_raw, v_raw)
        } else {
            (
                self.mm_q(&a.q, x, xq)?,
                self.mm_q(&a.k, x, xq)?,
                self.mm_q(&a.v, x, xq)?,
            )
        };
        let (kc, vc) = &state.kv[slot];
        let raw = (&q_raw, &k_raw, &v_raw);
        self.attention_core(a, raw, pos_dev, (kc.ptr(), vc.ptr()), 0, state.n_ctx)
    }

    fn delta_net(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
        state: &mut CudaState,
    ) -> Result<DBuf, ExecError> {
        let MixerDev::DeltaNet(d) = &self.w.layers[layer].mixer else {
            return Err(ExecError::new(
                "delta_net",
                format!("layer {layer} has no DeltaNet weights"),
            ));
        };
        let ssm =
            self.cfg.ssm.as_ref().ok_or_else(|| {
                ExecError::new("delta_net", "DeltaNet layer in a config without ssm")
            })?;
        let t_n = x.rows;
        let mut ws: Vec<&DevWeight> = vec![&d.qkv, &d.gate];
        ws.extend(d.proj.iter());
        let xq = self.prepare(&ws, x)?;
        if t_n == 1 && self.fused && dn_step_shape(&ws, ssm) {
            return self.delta_net_step(d, ssm, x, xq, state, slot);
        }
        let qkv = self.mm_q(&d.qkv, x, xq)?;
        let z = self.mm_q(&d.gate, x, xq)?;
        let proj: Vec<DBuf> = d
            .proj
            .iter()
            .map(|w| self.mm_q(w, x, xq))
            .collect::<Result<_, _>>()?;
        let conv_dim = ssm.conv_dim();
        let conv = self.alloc(t_n, conv_dim, "delta_net")?;
        self.gpu
            .dn_conv(
                qkv.ptr,
                state.conv[slot].ptr(),
                d.conv.ptr(),
                t_n,
                conv_dim,
                ssm.d_conv,
                conv.ptr,
            )
            .map_err(cuda_err("dn_conv"))?;
        let scale = 1.0 / (ssm.d_state as f32).sqrt();
        self.gpu
            .dn_qk_norm(conv.ptr, t_n, conv_dim, ssm.n_k_heads, ssm.d_state, scale)
            .map_err(cuda_err("dn_qk_norm"))?;
        let y = self.alloc(t_n, ssm.value_dim(), "delta_net")?;
        self.gpu
            .dn_recurrence(
                conv.ptr,
                t_n,
                conv_dim,
                proj[d.beta.proj].ptr,
                d.beta.stride,
                d.beta.idx.ptr(),
                proj[d.alpha.proj].ptr,
                d.alpha.stride,
                d.alpha.idx.ptr(),
                d.a.ptr(),
                d.dt_bias.ptr(),
                d.k_head_of.ptr(),
                z.ptr,
                d.norm.ptr(),
                self.cfg.eps,
                state.ssm[slot].ptr(),
                ssm.n_k_heads,
                ssm.n_v_heads,
                ssm.d_state,
                y.ptr,
            )
            .map_err(cuda_err("dn_recurrence"))?;
        self.mm(&d.out, &y)
    }

    fn moe(&self, layer: usize, x: &DBuf) -> Result<DBuf, ExecError> {
        let m = &self.w.layers[layer].moe;
        let cfg = &self.cfg;
        let (t_n, e, k) = (x.rows, cfg.n_embd, cfg.n_expert_used);
        // One quantized copy of x for the router and every expert that reads it.
        let mut ws: Vec<&DevWeight> = vec![&m.router, &m.gate_exps, &m.up_exps];
        if let Some(s) = &m.shared {
            ws.extend([&s.gate, &s.up]);
        }
        let xq = self.prepare(&ws, x)?;
        // A tiered decode token guesses the next layer's routing: the next router
        // applied to this layer's expert input, in the same launches as this layer's
        // routing (a second row of logits, weights and ids). The guess only decides
        // which experts are copied ahead (`Tiered::copy_ahead`).
        let guess = match &self.tiered {
            Some(t) if t_n == 1 && t.guesses > 0 => self
                .w
                .layers
                .get(layer + 1)
                .and_then(|next| m.router.joined(&next.moe.router)),
            _ => None,
        };
        let route_rows = t_n + usize::from(guess.is_some());
        let wts = self.alloc(route_rows, k, "route")?;
        let ids = self.alloc_bytes(route_rows * k * 4, "route")?;
        // A token or a batched decode step's rows: routed and computed on the device.
        if t_n <= MAX_ROWS && self.fused && self.tiered.is_none() && fused_moe(m, cfg.n_expert, k) {
            return self.moe_fused(m, x, xq, &wts, ids);
        }
        let logits = self.mm_q(guess.as_ref().unwrap_or(&m.router), x, xq)?;
        let guessed = guess.is_some();
        let (down, (shared, logit)) = match &self.tiered {
            Some(t) => match self.routed_tiered(t, layer, m, x, xq, &logits, &wts, ids, guessed)? {
                Routed::Combined(out) => return Ok(out),
                Routed::Parts(down, shared) => (down, shared),
            },
            None => {
                let down = self.routed_resident(m, x, xq, &logits, &wts, ids)?;
                (down, self.shared_expert(m, x, xq)?)
            }
        };
        let out = self.alloc(t_n, e, "moe")?;
        self.gpu
            .moe_combine(down.ptr, wts.ptr, t_n, k, e, shared, logit, out.ptr)
            .map_err(cuda_err("moe_combine"))?;
        Ok(out)
    }

    fn lm_head(&self, x: &DBuf) -> Result<DBuf, ExecError> {
        self.mm(self.w.lm_head(), x)
    }
}
