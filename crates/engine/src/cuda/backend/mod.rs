//! `model::Backend` on one GPU: every op is a kernel launch on the GPU's one
//! stream, reading weights from `WeightsDev` and writing into a scratch arena.
//!
//! **Scratch.** Activations live in one preallocated arena with a bump
//! allocator ([`Arena`]), so a step allocates nothing and the same sequence of ops
//! gets the same addresses every time (what makes a captured decode graph
//! replayable). The arena has a persistent part (the residual stream `x` and the
//! fixed output of the mixer and output norms, from `embed`) and a per-layer part
//! that is released when the next layer starts (the norm `Norm::Attn`) or at the
//! output norm: `model::forward` holds nothing else across those points. A step's
//! token ids and first position are written to device buffers by the executor
//! before the step, and kernels read them there.
//!
//! **Decode without the host.** With one token, routing, the expert tiles and
//! every product stay on the device: nothing in a step waits for the host, so a
//! step can be captured as a CUDA graph. A prompt (several tokens) downloads its
//! routing once per layer to group tokens by expert.
//!
//! **Modes**, each in its own file with its own state: one sequence's mixers
//! (`mixers.rs`); rows mode, one token of each of several sequences in one pass
//! over device tables of their states (`rows.rs`, [`RowTables`]); the MoE block with
//! every expert resident, fused or by tiles (`moe.rs`, [`MoeCounts`]); tiered
//! experts, whose layer step reads the routing on the host and moves experts
//! (`tiered/`, [`Tiered`]); and a tiered decode step cut into graph segments at
//! those host parts (`segments.rs`, [`SegRun`]). This file holds the backend, its
//! arena, the launches every mode shares and the `model::Backend` entry points.
//!
//! **Why `&self` and cells.** `model::Backend` takes `&self`, and the ops read the
//! weights the backend owns while they allocate scratch; the tiered layer step also
//! runs two closures that issue device work (one allocating) while the CPU's team
//! computes beside them (`Tiered::cpu_beside`). So what changes during a pass
//! (the arena's bump pointer, the norm outputs handed to the next op, the segment
//! being recorded) is in cells; what the executor writes between passes (the step
//! inputs, the rows' tables) is written through `&mut self`.

mod mixers;
mod moe;
mod mtp;
mod rows;
mod segments;
pub(crate) mod tiered;

pub(crate) use moe::MoeCounts;
pub(crate) use mtp::MtpBufs;
pub(crate) use rows::{RowTables, MAX_ROWS};
pub(crate) use segments::SegRun;
use tiered::Tiered;

use super::weights::{cuda_err, DevWeight, WeightsDev};
use cuda::{ActQ8, DevBuf, Gpu, Tile};
use model::{Backend, ExecError, LayerKind, ModelConfig, Norm, SegmentRows};
use quant::GgmlType;
use std::cell::{Cell, RefCell};

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
    /// What a verify step keeps to roll back to any of its tokens.
    pub trail: CudaTrail,
    /// The MTP block's cache and the trunk's last hidden rows (drafts), when the
    /// executor runs the MTP block.
    pub mtp: Option<MtpSeq>,
}

/// A sequence's MTP state on the device (`cpu/mtp.rs`'s `MtpState`): the MTP block's
/// K/V (position p at row p − `span.base`) and the last step's last `span.rows`
/// post-norm hidden rows (room for a verify step's rows, to roll back into), where
/// `span` (`MtpSpan`, both executors' bookkeeping) says.
pub struct MtpSeq {
    pub k: DevBuf<f32>,
    pub v: DevBuf<f32>,
    pub hid: DevBuf<f32>,
    pub(crate) span: crate::spec::MtpSpan,
}

impl MtpSeq {
    /// Rows of hidden state the sequence keeps.
    pub fn keeps(&self, n_embd: usize) -> usize {
        self.hid.len() / n_embd
    }
}

/// A verify step's DeltaNet states after each of its tokens but the last
/// (`Executor::keep_trail`): per DeltaNet layer, entry t of `conv` and `ssm` at t
/// times the layer's state length (what `dn_conv` and `dn_recurrence` write).
#[derive(Default)]
pub struct CudaTrail {
    pub conv: Vec<DevBuf<f32>>,
    pub ssm: Vec<DevBuf<f32>>,
    /// The most tokens a verify step may feed (the entries plus one); 0: the
    /// executor was opened without speculation and keeps no trail.
    pub tokens: usize,
    /// The next step writes the trail.
    pub armed: bool,
    /// Where the last step that wrote it began and how many tokens it fed.
    pub span: Option<crate::exec::TrailSpan>,
}

const ALIGN: usize = 256;

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

/// The scratch arena: one device allocation handed out by a bump pointer (see the
/// module's doc), its persistent part first.
struct Arena {
    buf: DevBuf<u8>,
    /// The first free byte.
    top: Cell<usize>,
    /// The end of the persistent part: releasing the per-layer part goes back here.
    persist: Cell<usize>,
}

impl Arena {
    /// A step begins: the whole arena is free.
    fn reset(&self) {
        self.top.set(0);
        self.persist.set(0);
    }

    /// Everything allocated so far stays for the rest of the step.
    fn keep(&self) {
        self.persist.set(self.top.get());
    }

    /// Releases the per-layer part.
    fn release(&self) {
        self.top.set(self.persist.get());
    }

    fn alloc_bytes(&self, bytes: usize, what: &str) -> Result<u64, ExecError> {
        let start = self.top.get().next_multiple_of(ALIGN);
        let end = start + bytes;
        if end as u64 > self.buf.bytes() {
            return Err(ExecError::new(
                what,
                format!(
                    "the scratch arena ({} bytes) is too small for this step (needs more than {end}); this is a sizing bug, please report it",
                    self.buf.bytes()
                ),
            ));
        }
        self.top.set(end);
        Ok(self.buf.ptr() + start as u64)
    }

    fn alloc(&self, rows: usize, cols: usize, what: &str) -> Result<DBuf, ExecError> {
        Ok(DBuf {
            ptr: self.alloc_bytes(rows * cols * 4, what)?,
            rows,
            cols,
        })
    }

    /// Room for the quantized copy of `rows` × `cols` activations.
    fn alloc_act_q8(&self, rows: usize, cols: usize) -> Result<ActQ8, ExecError> {
        let n = rows * cols;
        let nb = n / 32;
        Ok(ActQ8 {
            qs: self.alloc_bytes(n, "quantize")?,
            d: self.alloc_bytes(nb * 4, "quantize")?,
            sums: self.alloc_bytes(nb * 4, "quantize")?,
        })
    }
}

pub struct CudaBackend {
    pub(crate) gpu: Gpu,
    pub(crate) cfg: ModelConfig,
    pub(crate) w: WeightsDev,
    arena: Arena,
    /// The input of each mixer and of the LM head (the norms `Norm::Attn` and
    /// `Norm::Output` write here) and its quantized copy, both in the persistent
    /// part, after `x` (a norm into it still reads the released per-layer part, so
    /// its copy cannot go there).
    fixed: Cell<(u64, ActQ8)>,
    /// The last norm's output (address, rows) and the quantized copy the norm
    /// kernel wrote beside it, which `prepare` hands out instead of quantizing again.
    normed_q: Cell<Option<(u64, usize, ActQ8)>>,
    /// (cos, sin) per position and rotary pair, computed on the host with
    /// `model::math::rope_cos_sin` (the CPU's values).
    rope: DevBuf<f32>,
    /// The step's token ids (up to `chunk_tokens`) and each row's position (a
    /// sequence's rows are consecutive positions, so a segment reads its first).
    tok: DevBuf<i32>,
    pos: DevBuf<i32>,
    /// A prompt piece's multimodal rotary positions, i32 [chunk_tokens][3] (models
    /// with `rope_sections`; one element otherwise), written by `load_inputs`.
    mpos: DevBuf<i32>,
    /// The positions written to `pos` and to `mpos` (checked by the mixers).
    pos_host: Vec<usize>,
    mpos_host: Vec<[u32; 3]>,
    /// The first row of the segment whose mixer runs (its position is `pos[seg_row]`).
    seg_row: Cell<usize>,
    /// Rows mode's device tables of each row's state.
    rows: RowTables,
    /// The fused MoE kernels' counters.
    counts: MoeCounts,
    /// The most tokens one step takes (a prompt is fed in chunks of this many): the
    /// token ids' buffer and the scratch arena are sized for it.
    pub(crate) chunk_tokens: usize,
    /// The expert store when the routed experts do not all live in VRAM
    /// (`MoeDev`'s expert tensors are then slot buffers).
    pub(crate) tiered: Option<Tiered>,
    /// A tiered decode step being recorded or replayed as segments.
    pub(crate) seg: RefCell<Option<SegRun>>,
    /// One token takes the fused kernels (`moe_fused`, `delta_net_step`, the
    /// attention's joint projections); `SCORIA_NO_FUSED_DECODE=1` sends it through the
    /// prompt path's kernels instead, which give the same bits (a test compares them).
    /// A model with second-level scales always takes the prompt path's kernels: each
    /// product is scaled after it (`mm_q_into`, `mm_tiles_into`), which the fused
    /// kernels, reading their products within (SwiGLU, the conv, the combine), do not.
    fused: bool,
    /// The MTP block and its buffers, when the executor drafts with it.
    pub(crate) mtp: Option<MtpBufs>,
    /// Passes keep their post-norm hidden rows in `mtp.hid` (`Backend::keep_hidden`).
    keep_hidden: Cell<bool>,
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
        // A tiered layer's second-level scales by route (gate, up, down).
        + 3 * t * k * f
        + ALIGN
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
        chunk_tokens: usize,
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
            .alloc::<i32>(chunk_tokens, "token ids")
            .map_err(cuda_err("allocate step inputs"))?;
        let pos = gpu
            .alloc::<i32>(chunk_tokens.max(MAX_ROWS), "positions")
            .map_err(cuda_err("allocate step inputs"))?;
        let mpos = gpu
            .alloc::<i32>(
                if cfg.rope_sections.is_some() {
                    3 * chunk_tokens
                } else {
                    1
                },
                "multimodal positions",
            )
            .map_err(cuda_err("allocate step inputs"))?;
        let counts = MoeCounts::new(&gpu)?;
        let rows = RowTables::new(&gpu, &cfg)?;
        let scaled = w.scaled;
        if scaled {
            tracing::info!(
                "second-level scales: one token takes the prompt path's kernels, each \
                 product scaled after it (the fused decode kernels do not apply scales)"
            );
        }
        Ok(CudaBackend {
            gpu,
            cfg,
            w,
            arena: Arena {
                buf: arena,
                top: Cell::new(0),
                persist: Cell::new(0),
            },
            fixed: Cell::new((0, ActQ8::NONE)),
            normed_q: Cell::new(None),
            rope,
            tok,
            pos,
            mpos,
            pos_host: vec![0],
            mpos_host: Vec::new(),
            seg_row: Cell::new(0),
            rows,
            counts,
            chunk_tokens,
            tiered,
            seg: RefCell::new(None),
            fused: !crate::switches::on(crate::switches::NO_FUSED_DECODE) && !scaled,
            mtp: None,
            keep_hidden: Cell::new(false),
        })
    }

    fn upload_ids(&self, tokens: &[u32]) -> Result<(), ExecError> {
        if tokens.len() > self.chunk_tokens {
            return Err(ExecError::new(
                "step",
                format!(
                    "{} tokens in one step (at most {})",
                    tokens.len(),
                    self.chunk_tokens
                ),
            ));
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        self.gpu
            .copy_to_device(&ids, self.tok.ptr())
            .map_err(cuda_err("upload tokens"))
    }

    /// Writes one sequence's step inputs where the kernels read them: its token ids,
    /// first position and, for a request with images, each row's multimodal rotary
    /// position (not capturable: such steps run without graphs).
    pub(crate) fn load_inputs(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        rope: Option<&[[u32; 3]]>,
    ) -> Result<(), ExecError> {
        self.upload_ids(tokens)?;
        self.gpu
            .copy_to_device(&[pos0 as i32], self.pos.ptr())
            .map_err(cuda_err("upload position"))?;
        self.pos_host = vec![pos0];
        self.rows.ids.clear();
        self.mpos_host.clear();
        if let Some(rope) = rope {
            self.load_mpos(rope)?;
        }
        Ok(())
    }

    /// The device buffer of the step's token ids (a draft's argmax writes the next
    /// draft's token there).
    pub(crate) fn token_ids(&self) -> u64 {
        self.tok.ptr()
    }

    /// Whether passes keep their hidden rows for the MTP block (its drafts).
    pub(crate) fn set_keep_hidden(&self, on: bool) {
        self.keep_hidden.set(on && self.mtp.is_some());
    }

    pub(crate) fn arena_bytes(&self) -> u64 {
        self.arena.buf.bytes()
    }

    pub(crate) fn rope_bytes(&self) -> u64 {
        self.rope.bytes() + self.mpos.bytes()
    }

    /// Writes one segment's multimodal rotary positions to `mpos`.
    fn load_mpos(&mut self, rope: &[[u32; 3]]) -> Result<(), ExecError> {
        let rows = self.rope.len() / self.cfg.n_rot.max(2);
        if self.cfg.rope_sections.is_none() || 3 * rope.len() > self.mpos.len() {
            return Err(ExecError::new(
                "attention",
                format!(
                    "{} rows of multimodal positions (this model takes {})",
                    rope.len(),
                    self.mpos.len() / 3
                ),
            ));
        }
        if let Some(p) = rope.iter().flatten().find(|&&p| p as usize >= rows) {
            return Err(ExecError::new(
                "attention",
                format!("multimodal position {p} is past the rotary table's {rows} positions"),
            ));
        }
        let flat: Vec<i32> = rope.iter().flatten().map(|&p| p as i32).collect();
        self.gpu
            .copy_to_device(&flat, self.mpos.ptr())
            .map_err(cuda_err("upload multimodal positions"))?;
        self.mpos_host = rope.to_vec();
        Ok(())
    }

    /// A sequence of `n_ctx` positions whose verify steps feed up to `trail_tokens`
    /// tokens (0: no speculation, no trail).
    pub(crate) fn new_state_for(
        &self,
        n_ctx: usize,
        trail_tokens: usize,
    ) -> Result<CudaState, ExecError> {
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
        let mut trail = CudaTrail {
            tokens: trail_tokens,
            ..Default::default()
        };
        let entries = trail_tokens.saturating_sub(1);
        if let Some(s) = &cfg.ssm {
            let (conv_len, ssm_len) = (
                s.conv_dim() * (s.d_conv - 1),
                s.n_v_heads * s.d_state * s.d_state,
            );
            let alloc =
                |n: usize, what: &str| g.alloc::<f32>(n, what).map_err(cuda_err("allocate state"));
            for _ in 0..n_delta_net(cfg) {
                conv.push(alloc(conv_len, "conv state")?);
                ssm.push(alloc(ssm_len, "DeltaNet state")?);
                if entries > 0 {
                    trail.conv.push(alloc(entries * conv_len, "conv trail")?);
                    trail.ssm.push(alloc(entries * ssm_len, "DeltaNet trail")?);
                }
            }
        }
        let mtp = match &self.mtp {
            Some(_) => Some(MtpSeq {
                k: g.alloc::<f32>(kv_len, "MTP K cache")
                    .map_err(cuda_err("allocate state"))?,
                v: g.alloc::<f32>(kv_len, "MTP V cache")
                    .map_err(cuda_err("allocate state"))?,
                hid: g
                    .alloc::<f32>(trail_tokens.max(1) * cfg.n_embd, "MTP hidden rows")
                    .map_err(cuda_err("allocate state"))?,
                span: crate::spec::MtpSpan::EMPTY,
            }),
            None => None,
        };
        Ok(CudaState {
            n_ctx,
            kv,
            conv,
            ssm,
            trail,
            mtp,
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

    /// Quantizes the rows of `x` into the canonical int8 blocks.
    fn quantize(&self, x: &DBuf) -> Result<ActQ8, ExecError> {
        let q = self.arena.alloc_act_q8(x.rows, x.cols)?;
        self.gpu
            .quantize_act(x.ptr, x.rows, x.cols, q)
            .map_err(cuda_err("quantize_act"))?;
        Ok(q)
    }

    /// The quantized copy of `x` when any of `ws` needs one: the one its norm wrote,
    /// or a new one.
    fn prepare(&self, ws: &[&DevWeight], x: &DBuf) -> Result<ActQ8, ExecError> {
        if ws.iter().all(|w| is_float(w.ty)) {
            return Ok(ActQ8::default());
        }
        match self.normed_q.get() {
            Some((ptr, rows, q)) if ptr == x.ptr && rows == x.rows => Ok(q),
            _ => self.quantize(x),
        }
    }

    /// out (tokens × n_rows) = x · Wᵀ, with `xq` from `prepare`.
    fn mm_q(&self, w: &DevWeight, x: &DBuf, xq: ActQ8) -> Result<DBuf, ExecError> {
        let out = self.arena.alloc(x.rows, w.n_rows, "matvec")?;
        self.mm_q_into(w, x, xq, &out)?;
        Ok(out)
    }

    /// [`Self::mm_q`] into `out` (x.rows × w.n_rows).
    fn mm_q_into(&self, w: &DevWeight, x: &DBuf, xq: ActQ8, out: &DBuf) -> Result<(), ExecError> {
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
            .map_err(cuda_err("matvec"))?;
        match &w.scale {
            Some(s) => self
                .gpu
                .scale(out.ptr, x.rows * w.n_rows, s.host[0])
                .map_err(cuda_err("scale")),
            None => Ok(()),
        }
    }

    fn mm(&self, w: &DevWeight, x: &DBuf) -> Result<DBuf, ExecError> {
        let xq = self.prepare(&[w], x)?;
        self.mm_q(w, x, xq)
    }

    fn swiglu(&self, g: &DBuf, u: &DBuf) -> Result<DBuf, ExecError> {
        let out = self.arena.alloc(g.rows, g.cols, "swiglu")?;
        self.swiglu_into(g, u, &out)?;
        Ok(out)
    }

    fn swiglu_into(&self, g: &DBuf, u: &DBuf, out: &DBuf) -> Result<(), ExecError> {
        self.gpu
            .swiglu(g.ptr, u.ptr, g.rows * g.cols, out.ptr)
            .map_err(cuda_err("swiglu"))
    }

    /// The weight of norm `which`, where its output goes and where its quantized copy
    /// goes (remembered for `prepare`; none when rows are not whole 32-value blocks).
    /// A mixer's input and the LM head's go to the fixed buffer and its fixed
    /// quantized copy, and the previous layer's scratch is released (the kernel
    /// reading it is ordered before any later reuse on the stream); the MoE block's
    /// input is an ordinary allocation.
    fn norm_target(&self, x: &DBuf, which: Norm) -> Result<(u64, DBuf, ActQ8), ExecError> {
        let (h, h_q) = self.fixed.get();
        let fixed = DBuf {
            ptr: h,
            rows: x.rows,
            cols: x.cols,
        };
        let (w, out, q) = match which {
            Norm::Attn(i) => {
                self.arena.release();
                (self.w.layers[i].attn_norm.ptr(), fixed, h_q)
            }
            Norm::Output => {
                self.arena.release();
                (self.w.output_norm.ptr(), fixed, h_q)
            }
            Norm::Ffn(i) => {
                let out = self.arena.alloc(x.rows, x.cols, "rms_norm")?;
                let q = if x.cols.is_multiple_of(32) {
                    self.arena.alloc_act_q8(x.rows, x.cols)?
                } else {
                    ActQ8::NONE
                };
                (self.w.layers[i].ffn_norm.ptr(), out, q)
            }
        };
        self.normed_q
            .set((q != ActQ8::NONE).then_some((out.ptr, out.rows, q)));
        Ok((w, out, q))
    }

    /// Checks that the current segment's first position is `pos0` on the device too,
    /// and returns where it is.
    fn check_pos(&self, pos0: usize, op: &str) -> Result<u64, ExecError> {
        let row = self.seg_row.get();
        let have = self.pos_host.get(row).copied();
        if have != Some(pos0) {
            return Err(ExecError::new(
                op,
                format!("position {pos0} was not written to the device (have {have:?})"),
            ));
        }
        Ok(self.pos.ptr() + 4 * row as u64)
    }
}

impl Backend for CudaBackend {
    type Buf = DBuf;
    type State = CudaState;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn new_state(&self, n_ctx: usize) -> Result<CudaState, ExecError> {
        self.new_state_for(n_ctx, 0)
    }

    /// Reads the token ids the executor wrote to `tok`.
    fn embed(&self, tokens: &[u32]) -> Result<DBuf, ExecError> {
        if tokens.len() > self.chunk_tokens {
            return Err(ExecError::new(
                "embed",
                format!(
                    "{} tokens in one step (at most {})",
                    tokens.len(),
                    self.chunk_tokens
                ),
            ));
        }
        self.arena.reset();
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
        let x = self.arena.alloc(tokens.len(), t.n_cols, "embed")?;
        let h = self.arena.alloc(tokens.len(), t.n_cols, "embed")?;
        let h_q = if t.n_cols.is_multiple_of(32) {
            self.arena.alloc_act_q8(tokens.len(), t.n_cols)?
        } else {
            ActQ8::NONE
        };
        self.fixed.set((h.ptr, h_q));
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
        self.arena.keep();
        Ok(x)
    }

    /// An image row over the embedded token (not during capture).
    fn set_row(&self, x: &mut DBuf, row: usize, data: &[f32]) -> Result<(), ExecError> {
        model::check_set_row(x.rows, x.cols, row, data.len())?;
        self.gpu
            .copy_to_device(data, x.ptr + (row * x.cols * 4) as u64)
            .map_err(cuda_err("set_row"))
    }

    fn wants_hidden(&self) -> bool {
        self.keep_hidden.get()
    }

    /// Into `mtp.hid` (a copy on the stream: capturable), for the MTP passes after
    /// the step.
    fn keep_hidden(&self, h: &DBuf) -> Result<(), ExecError> {
        let Some(m) = &self.mtp else {
            return Err(ExecError::new("keep_hidden", "no MTP block in VRAM"));
        };
        let bytes = (h.rows * h.cols * 4) as u64;
        if bytes > m.hid.bytes() {
            return Err(ExecError::new(
                "keep_hidden",
                format!("{} hidden rows (room for {})", h.rows, m.rows()),
            ));
        }
        self.gpu
            .copy_device(h.ptr, m.hid.ptr(), bytes)
            .map_err(cuda_err("keep_hidden"))
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
        let out = self.arena.alloc(rows, cols, "concat_rows")?;
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
            // A prompt with images (the executor runs it on its own, without graphs).
            if let (Some(rope), LayerKind::Attention) = (p.rope, kind) {
                if self.mpos_host != rope {
                    return Err(ExecError::new(
                        "attention",
                        "the multimodal positions were not written to the device",
                    ));
                }
                return self.attention_seq(layer, slot, h, p.pos0, p.state, self.mpos.ptr());
            }
            return mix(h, p);
        }
        if parts.iter().any(|p| p.rope.is_some()) {
            return Err(ExecError::new(
                "mix_segments",
                "a sequence with multimodal positions runs in a pass of its own on the CUDA executor",
            ));
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
        self.attention_seq(layer, slot, x, pos0, state, 0)
    }

    fn delta_net(
        &self,
        layer: usize,
        slot: usize,
        x: &DBuf,
        state: &mut CudaState,
    ) -> Result<DBuf, ExecError> {
        self.delta_net_seq(layer, slot, x, state)
    }

    fn moe(&self, layer: usize, x: &DBuf) -> Result<DBuf, ExecError> {
        self.moe_block(layer, x)
    }

    fn lm_head(&self, x: &DBuf) -> Result<DBuf, ExecError> {
        self.mm(self.w.lm_head(), x)
    }
}
