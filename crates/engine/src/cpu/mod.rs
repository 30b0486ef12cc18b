//! The CPU executor: implements `model::Backend` with the quant crate's
//! canonical-order kernels; parallel loops on rayon for prompts and on the spinning
//! team (`team::shared`) for decode passes.
//!
//! Prompts and decode steps run the same kernels: a matmul over T tokens gives,
//! for every (row, token), the bits a matvec of that token would, so a prompt's
//! state equals the state of feeding its tokens one by one.

mod attention;
mod deltanet;
mod moe;
mod mtp;
pub mod op_times;
mod snapshot;
pub(crate) mod team;
mod tier;

pub use tier::CpuTier;

#[cfg(feature = "cuda")]
pub(crate) use moe::{ExpertMat, TokenExperts};

use model::weights::{Mixer, Weight};
use model::{Backend, ExecError, LayerKind, ModelConfig, ModelWeights, Norm, SegmentRows};
use rayon::prelude::*;

use crate::api::{Device, DeviceReport, Precision};
use crate::exec::{EntryResult, Executor, SeqSnapshot, SeqStep, StepOut, TrailSpan, Want};

/// Activations: `rows` tokens × `cols` features, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Act {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// Token-wise loops over at least this many rows run rows in parallel (below it, the
/// fork-join costs more than the work).
pub(crate) const PARALLEL_ROWS: usize = 16;

/// `f(r, row)` for every `cols`-wide row of `data`: rows in parallel when there are
/// at least [`PARALLEL_ROWS`] of them. Each row's operations are the same either way.
pub(crate) fn each_row(data: &mut [f32], cols: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if data.len() < PARALLEL_ROWS * cols {
        data.chunks_mut(cols)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
    } else {
        data.par_chunks_mut(cols)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
    }
}

/// `n` zeros. A prompt's activations are megabytes a layer, whose zeroing (and the
/// first touch of their pages) on the pass's own thread had been most of what a
/// prompt pass did outside its parallel loops; a buffer of 512 KiB or more (a prompt's
/// activations, a decode step's logits) is zeroed in pieces by the parallel loop's
/// threads instead.
fn zeroed(n: usize) -> Vec<f32> {
    /// Values per piece (128 KiB).
    const PIECE: usize = 32 * 1024;
    if n < 4 * PIECE {
        return vec![0.0; n];
    }
    let mut v: Vec<f32> = Vec::with_capacity(n);
    let mut pieces: Vec<&mut [std::mem::MaybeUninit<f32>]> =
        v.spare_capacity_mut()[..n].chunks_mut(PIECE).collect();
    quant::par::for_each_mut(&mut pieces, |_, p| p.fill(std::mem::MaybeUninit::new(0.0)));
    // SAFETY: the pieces cover the first n values, and every one was written.
    unsafe { v.set_len(n) };
    v
}

impl Act {
    pub fn zeros(rows: usize, cols: usize) -> Act {
        Act {
            rows,
            cols,
            data: zeroed(rows * cols),
        }
    }
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// K/V of one attention layer, f32, for the positions allocated so far (`capacity`):
/// K dim-major, [kv head][head_dim][capacity] (so the scores of many positions run
/// side by side, see `attention.rs`); V [position][kv head][head_dim].
///
/// The cache starts empty and grows as positions are written (see [`KvCache::reserve`]),
/// so a sequence holds memory for the positions it used, not for the whole context.
pub struct KvCache {
    k: Vec<f32>,
    v: Vec<f32>,
    /// Floats per position (n_head_kv · head_dim).
    kvw: usize,
    /// Positions allocated: K's row stride.
    cap: usize,
    /// One past the highest position written since the last clear.
    len: usize,
}

/// Growth step of a K/V cache, in positions: capacities are multiples of this (or
/// the context length).
pub const KV_PAGE: usize = 256;

impl KvCache {
    /// An empty cache of `kvw` floats (n_head_kv · head_dim) per position.
    pub fn new(kvw: usize) -> KvCache {
        KvCache {
            k: Vec::new(),
            v: Vec::new(),
            kvw,
            cap: 0,
            len: 0,
        }
    }

    /// Positions allocated.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// One past the highest position written since the last clear.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Floats per position.
    pub fn width(&self) -> usize {
        self.kvw
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        (self.k.capacity() + self.v.capacity()) * 4
    }

    /// K, dim-major: dim `i` (of all kv heads, `h·head_dim + i`) of position `p` at
    /// `i · capacity + p`.
    pub fn k(&self) -> &[f32] {
        &self.k
    }

    /// V, position-major: position `p` at `p · width`.
    pub fn v(&self) -> &[f32] {
        &self.v
    }

    /// Makes room for positions `0..end` (`end ≤ n_ctx`). Growth goes in steps of a
    /// quarter of what is held (at least [`KV_PAGE`] positions, rounded up to a
    /// page, at most `n_ctx`): the copies of a sequence that grows to `n` positions
    /// total about 5n positions, and at most a quarter (or one page) stays unused.
    /// K is re-laid out for its new stride; the values, and so every later result,
    /// do not change.
    pub fn reserve(&mut self, end: usize, n_ctx: usize) {
        if end <= self.cap {
            return;
        }
        let step = (self.cap / 4).max(KV_PAGE);
        let want = end.max(self.cap + step).div_ceil(KV_PAGE) * KV_PAGE;
        let new_cap = want.min(n_ctx).max(end);
        self.grow_to(new_cap);
    }

    /// Sets the capacity to exactly `new_cap ≥ capacity` positions.
    fn grow_to(&mut self, new_cap: usize) {
        let (kvw, cap) = (self.kvw, self.cap);
        let mut k = Vec::new();
        k.reserve_exact(kvw * new_cap);
        k.resize(kvw * new_cap, 0.0);
        if cap > 0 {
            for (dst, src) in k.chunks_exact_mut(new_cap).zip(self.k.chunks_exact(cap)) {
                dst[..cap].copy_from_slice(src);
            }
        }
        self.k = k;
        // `reserve_exact` first: `resize` alone may double the allocation.
        self.v.reserve_exact(kvw * new_cap - self.v.len());
        self.v.resize(kvw * new_cap, 0.0);
        self.cap = new_cap;
    }

    /// Records that positions `0..end` hold written values.
    pub(crate) fn wrote(&mut self, end: usize) {
        self.len = self.len.max(end);
    }

    /// Mutable K and V (for writing positions below `capacity`).
    pub(crate) fn k_v_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (&mut self.k, &mut self.v)
    }

    /// Forgets the positions from `pos` on (a verify step's rejected drafts): their
    /// values stay until a later step overwrites them, but no snapshot reads them.
    pub(crate) fn truncate(&mut self, pos: usize) {
        self.len = self.len.min(pos);
    }

    /// Gives the memory back: the cache is empty again.
    pub fn free(&mut self) {
        self.k = Vec::new();
        self.v = Vec::new();
        self.cap = 0;
        self.len = 0;
    }
}

/// Conv history and recurrent state of one DeltaNet layer.
pub struct DeltaNetState {
    /// conv_dim × (d_conv − 1), channel-major, oldest first.
    pub conv: Vec<f32>,
    /// Hv × dk × dv.
    pub ssm: Vec<f32>,
    /// During a verify step (`Executor::keep_trail`): the state after each of its
    /// tokens, so `Executor::rollback` can go back to any of them.
    pub trail: Option<Trail>,
}

/// A DeltaNet layer's conv and recurrent state after each token of one step,
/// token-major (token t's conv at `t · conv.len`, its recurrent state at `t · ssm.len`
/// of the layer's state).
#[derive(Default)]
pub struct Trail {
    pub conv: Vec<f32>,
    pub ssm: Vec<f32>,
}

/// One sequence's state.
pub struct CpuState {
    pub n_ctx: usize,
    pub kv: Vec<KvCache>,
    pub dn: Vec<DeltaNetState>,
    /// The next step keeps the DeltaNet trail (`Executor::keep_trail`).
    pub keep_trail: bool,
    /// The positions of the last step's trail (None: it kept none).
    pub trail: Option<TrailSpan>,
    /// The MTP block's cache and the trunk's last hidden rows (drafts).
    pub mtp: mtp::MtpState,
}

impl CpuState {
    /// Forgets everything (a new sequence): the K/V memory is given back (it grows
    /// again as positions are written) and the recurrent state, which has no
    /// positions and keeps its fixed size, is zeroed.
    pub fn clear(&mut self) {
        for c in &mut self.kv {
            c.free();
        }
        for d in &mut self.dn {
            d.conv.iter_mut().for_each(|x| *x = 0.0);
            d.ssm.iter_mut().for_each(|x| *x = 0.0);
            d.trail = None;
        }
        self.keep_trail = false;
        self.trail = None;
        self.mtp.clear();
    }

    /// Brings the sequence back to position `pos` (tokens `0..pos` fed) after a
    /// step that kept its trail over positions `span.pos0..span.pos0 + span.n`,
    /// `span.pos0 < pos ≤ span.pos0 + span.n`: each DeltaNet layer takes the state it
    /// had after token `pos − 1`, and K/V from `pos` on are forgotten. The trail is
    /// used up either way.
    pub fn rollback(&mut self, pos: usize) -> Result<(), ExecError> {
        let (t, span) = TrailSpan::entry(self.trail.take(), pos)?;
        for d in &mut self.dn {
            let tr = d.trail.take().ok_or_else(|| {
                ExecError::new(
                    "rollback",
                    "a DeltaNet layer kept no trail in the last step",
                )
            })?;
            if t + 1 < span.n {
                let (c, s) = (d.conv.len(), d.ssm.len());
                d.conv.copy_from_slice(&tr.conv[t * c..(t + 1) * c]);
                d.ssm.copy_from_slice(&tr.ssm[t * s..(t + 1) * s]);
            }
            // The buffers serve the next verify step.
            d.trail = Some(tr);
        }
        for c in &mut self.kv {
            c.truncate(pos);
        }
        self.mtp.truncate(pos);
        Ok(())
    }

    /// Makes room for positions `0..end` in every attention layer now (a caller that
    /// knows a request's length can allocate once instead of growing).
    pub fn reserve(&mut self, end: usize) -> Result<(), ExecError> {
        if end > self.n_ctx {
            return Err(ExecError::new(
                "reserve",
                format!("{end} positions exceed the context of {}", self.n_ctx),
            ));
        }
        for c in &mut self.kv {
            c.reserve(end, self.n_ctx);
        }
        Ok(())
    }

    /// Positions allocated (the same in every attention layer).
    pub fn capacity(&self) -> usize {
        self.kv.first().map_or(0, KvCache::capacity)
    }

    /// Bytes held: the K/V allocated so far plus the fixed recurrent state.
    pub fn bytes(&self) -> usize {
        let kv: usize = self.kv.iter().map(KvCache::bytes).sum();
        let dn: usize = self
            .dn
            .iter()
            .map(|d| (d.conv.capacity() + d.ssm.capacity()) * 4)
            .sum();
        kv + dn + self.mtp.bytes()
    }
}

/// The CPU executor's backend: the memory-mapped weights and the kernels that
/// read them.
pub struct CpuBackend {
    pub cfg: ModelConfig,
    pub weights: ModelWeights,
    pub precision: Precision,
    /// When set, the MoE counts every (token, chosen expert) per layer here (routing
    /// profiles for the expert store's slot plan); `None` costs one branch per layer.
    pub routing: Option<std::sync::Arc<crate::experts::RoutingCounts>>,
    /// Tiered experts (`tier.rs`): a RAM copy of some, the others read from the file
    /// when routed to. `None`: every expert is read from the mapped file.
    pub tier: Option<CpuTier>,
    /// The last pass's post-norm hidden rows, kept when MTP drafts need them.
    pub hidden: HiddenRows,
}

/// The post-norm hidden rows (what the LM head reads) of the last pass, kept while
/// on (`Executor::enable_mtp`).
#[derive(Default)]
pub struct HiddenRows {
    on: std::sync::atomic::AtomicBool,
    rows: std::sync::Mutex<Option<Act>>,
}

impl HiddenRows {
    pub fn on(&self) -> bool {
        self.on.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn set_on(&self, on: bool) {
        self.on.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn take(&self) -> Option<Act> {
        self.rows.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

pub(crate) fn is_float(ty: quant::GgmlType) -> bool {
    matches!(
        ty,
        quant::GgmlType::F32 | quant::GgmlType::F16 | quant::GgmlType::BF16
    )
}

impl CpuBackend {
    /// Each row of `x` RMS-normed with the weight `w`.
    pub(crate) fn norm_rows(&self, x: &Act, w: &[f32]) -> Act {
        let eps = self.cfg.eps;
        let mut out = Act::zeros(x.rows, x.cols);
        each_row(&mut out.data, x.cols, |t, o| {
            o.copy_from_slice(x.row(t));
            model::math::rms_norm(o, w, eps);
        });
        out
    }

    /// Quantizes each row of `x` when any weight of the given types that will
    /// read it is quantized. Activation quantization does not depend on the
    /// weight type, so one copy serves every weight that reads `x`.
    pub(crate) fn prepare(&self, types: &[quant::GgmlType], x: &Act) -> Vec<quant::ActQ8> {
        if !self.quantizes(types) {
            Vec::new()
        } else {
            let mut out = vec![quant::ActQ8::default(); x.rows];
            quant::par::for_each_mut(&mut out, |r, q| *q = quant::quantize_act(x.row(r)));
            out
        }
    }

    /// Whether weights of these types read a quantized copy of their input.
    fn quantizes(&self, types: &[quant::GgmlType]) -> bool {
        self.precision != Precision::ReferenceF32 && types.iter().any(|&t| !is_float(t))
    }

    /// One row's [`CpuBackend::prepare`]: its quantized copy, or an empty one when
    /// no weight of `types` reads it.
    pub(crate) fn quantized(&self, types: &[quant::GgmlType], x: &[f32]) -> quant::ActQ8 {
        if self.quantizes(types) {
            quant::quantize_act(x)
        } else {
            quant::ActQ8::default()
        }
    }

    /// Single-token products, each into its own output, in one parallel region
    /// (`quant::matvec_many`); at [`Precision::ReferenceF32`], one by one with the
    /// quantized weights dequantized, as [`CpuBackend::mm`].
    pub(crate) fn matvecs(&self, jobs: &mut [quant::MatvecJob]) {
        if self.precision != Precision::ReferenceF32 {
            return quant::matvec_many(jobs);
        }
        for j in jobs.iter_mut() {
            if is_float(j.ty) {
                quant::matvec(j.ty, j.w, j.n_cols, j.x, j.xq, j.out);
            } else {
                let x = Act {
                    rows: 1,
                    cols: j.n_cols,
                    data: j.x.to_vec(),
                };
                let mut out = Act::zeros(1, j.out.len());
                reference_mm(j.ty, j.w, j.out.len(), &x, &mut out);
                j.out.copy_from_slice(&out.data);
            }
        }
    }

    /// out (tokens × n_rows) = x (tokens × cols) · Wᵀ for a weight given as raw bytes;
    /// `xq` comes from `prepare`.
    pub(crate) fn mm(
        &self,
        ty: quant::GgmlType,
        w: &[u8],
        n_rows: usize,
        x: &Act,
        xq: &[quant::ActQ8],
    ) -> Act {
        let mut out = Act::zeros(x.rows, n_rows);
        if self.precision == Precision::ReferenceF32 && !is_float(ty) {
            reference_mm(ty, w, n_rows, x, &mut out);
        } else if x.rows == 1 {
            let empty = quant::ActQ8::default();
            let q = xq.first().unwrap_or(&empty);
            quant::matvec(ty, w, x.cols, &x.data, q, &mut out.data);
        } else {
            quant::matmul(ty, w, x.cols, &x.data, xq, &mut out.data);
        }
        out
    }

    /// out = x · Wᵀ, times the matrix's second-level scale when it has one.
    pub(crate) fn mm_weight(&self, w: &Weight, x: &Act) -> Act {
        let xq = self.prepare(&[w.ty], x);
        self.mm_scaled(w, x, &xq)
    }

    /// `mm` of `w`'s bytes (x quantized as `xq`), times `w`'s second-level scale.
    fn mm_scaled(&self, w: &Weight, x: &Act, xq: &[quant::ActQ8]) -> Act {
        let mut out = self.mm(w.ty, w.bytes(), w.n_rows(), x, xq);
        apply_scale(&mut out.data, w.scale(0));
        out
    }

    /// Several weights applied to one input (a layer's projections of the same
    /// rows): for a single row, one parallel region for all of them (bit-identical
    /// to calling `mm` for each, without a fork-join per small matrix); one quantized
    /// copy of the input serves every weight. Each output is scaled as by `mm_weight`.
    pub(crate) fn mm_many(&self, x: &Act, weights: &[&Weight]) -> Vec<Act> {
        let types: Vec<quant::GgmlType> = weights.iter().map(|m| m.ty).collect();
        let xq = self.prepare(&types, x);
        if x.rows != 1 {
            return weights.iter().map(|m| self.mm_scaled(m, x, &xq)).collect();
        }
        let empty = quant::ActQ8::default();
        let mut outs: Vec<Act> = weights.iter().map(|m| Act::zeros(1, m.n_rows())).collect();
        let mut jobs: Vec<quant::MatvecJob> = weights
            .iter()
            .zip(outs.iter_mut())
            .map(|(m, o)| quant::MatvecJob {
                ty: m.ty,
                w: m.bytes(),
                n_cols: x.cols,
                x: &x.data,
                xq: xq.first().unwrap_or(&empty),
                out: &mut o.data,
            })
            .collect();
        self.matvecs(&mut jobs);
        for (o, m) in outs.iter_mut().zip(weights) {
            apply_scale(&mut o.data, m.scale(0));
        }
        outs
    }
}

/// A product's values times its matrix's second-level scale (`model::Weight::scale`),
/// one f32 multiplication each, when the matrix has one (the GPU's `scale` kernels
/// make the same multiplication).
pub(crate) fn apply_scale(out: &mut [f32], scale: Option<f32>) {
    if let Some(s) = scale {
        for v in out {
            *v *= s;
        }
    }
}

/// Dequantize-then-f32 product (Precision::ReferenceF32).
fn reference_mm(ty: quant::GgmlType, w: &[u8], n_rows: usize, x: &Act, out: &mut Act) {
    let rb = w.len() / n_rows;
    let cols = x.cols;
    let per_row: Vec<Vec<f32>> = (0..n_rows)
        .into_par_iter()
        .map(|r| {
            let mut row = vec![0.0f32; cols];
            quant::dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut row);
            (0..x.rows)
                .map(|t| row.iter().zip(x.row(t)).map(|(a, b)| a * b).sum())
                .collect()
        })
        .collect();
    for (r, vals) in per_row.iter().enumerate() {
        for (t, v) in vals.iter().enumerate() {
            out.data[t * n_rows + r] = *v;
        }
    }
}

impl Backend for CpuBackend {
    type Buf = Act;
    type State = CpuState;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn new_state(&self, n_ctx: usize) -> Result<CpuState, ExecError> {
        let cfg = &self.cfg;
        // K/V start empty and grow with the positions written (KvCache::reserve).
        let kv = (0..cfg.n_attention_layers())
            .map(|_| KvCache::new(cfg.n_head_kv * cfg.head_dim))
            .collect();
        let dn = match &cfg.ssm {
            Some(s) => cfg
                .layer_kinds
                .iter()
                .filter(|k| **k == LayerKind::DeltaNet)
                .map(|_| DeltaNetState {
                    conv: vec![0.0; s.conv_dim() * (s.d_conv - 1)],
                    ssm: vec![0.0; s.n_v_heads * s.d_state * s.d_state],
                    trail: None,
                })
                .collect(),
            None => Vec::new(),
        };
        Ok(CpuState {
            n_ctx,
            kv,
            dn,
            keep_trail: false,
            trail: None,
            mtp: mtp::MtpState::new(cfg.n_head_kv * cfg.head_dim),
        })
    }

    fn embed(&self, tokens: &[u32]) -> Result<Act, ExecError> {
        let table = &self.weights.token_embd;
        let cols = table.row_len();
        let rb = table.row_bytes();
        let bytes = table.bytes();
        let mut out = Act::zeros(tokens.len(), cols);
        each_row(&mut out.data, cols, |r, row| {
            let t = tokens[r] as usize;
            quant::dequantize_row(table.ty, &bytes[t * rb..(t + 1) * rb], row);
        });
        Ok(out)
    }

    fn rms_norm(&self, x: &Act, which: Norm) -> Result<Act, ExecError> {
        let w = match which {
            Norm::Attn(i) => &self.weights.layers[i].attn_norm,
            Norm::Ffn(i) => &self.weights.layers[i].ffn_norm,
            Norm::Output => &self.weights.output_norm,
        };
        Ok(self.norm_rows(x, w))
    }

    fn add_assign(&self, x: &mut Act, y: &Act) -> Result<(), ExecError> {
        let cols = x.cols;
        each_row(&mut x.data, cols, |t, row| {
            for (a, b) in row.iter_mut().zip(y.row(t)) {
                *a += b;
            }
        });
        Ok(())
    }

    fn last_row(&self, x: Act) -> Result<Act, ExecError> {
        let r = x.rows - 1;
        Ok(Act {
            rows: 1,
            cols: x.cols,
            data: x.row(r).to_vec(),
        })
    }

    fn rows(&self, x: &Act, start: usize, n: usize) -> Result<Act, ExecError> {
        let end = start
            .checked_add(n)
            .filter(|&end| end <= x.rows)
            .ok_or_else(|| {
                ExecError::new(
                    "rows",
                    format!("rows {start}..{start}+{n} of a {}-row buffer", x.rows),
                )
            })?;
        Ok(Act {
            rows: n,
            cols: x.cols,
            data: x.data[start * x.cols..end * x.cols].to_vec(),
        })
    }

    fn wants_hidden(&self) -> bool {
        self.hidden.on()
    }

    fn keep_hidden(&self, h: &Act) -> Result<(), ExecError> {
        *self.hidden.rows.lock().unwrap_or_else(|e| e.into_inner()) = Some(Act {
            rows: h.rows,
            cols: h.cols,
            data: h.data.clone(),
        });
        Ok(())
    }

    fn set_row(&self, x: &mut Act, row: usize, data: &[f32]) -> Result<(), ExecError> {
        model::check_set_row(x.rows, x.cols, row, data.len())?;
        x.data[row * x.cols..(row + 1) * x.cols].copy_from_slice(data);
        Ok(())
    }

    fn concat_rows(&self, parts: &[Act]) -> Result<Act, ExecError> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if let Some(p) = parts.iter().find(|p| p.cols != cols) {
            return Err(ExecError::new(
                "concat_rows",
                format!("a part has {} columns, the first {cols}", p.cols),
            ));
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut data = Vec::with_capacity(rows * cols);
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        Ok(Act { rows, cols, data })
    }

    /// One sequence's rows: [`Backend::mix_segments`] with that one part.
    fn attention(
        &self,
        layer: usize,
        slot: usize,
        x: &Act,
        pos0: usize,
        state: &mut CpuState,
    ) -> Result<Act, ExecError> {
        let part = SegmentRows {
            rows: x.rows,
            pos0,
            state,
            rope: None,
        };
        self.mix_segments(layer, LayerKind::Attention, slot, x, &mut [part])
    }

    /// One sequence's rows: [`Backend::mix_segments`] with that one part.
    fn delta_net(
        &self,
        layer: usize,
        slot: usize,
        x: &Act,
        state: &mut CpuState,
    ) -> Result<Act, ExecError> {
        let part = SegmentRows {
            rows: x.rows,
            pos0: 0,
            state,
            rope: None,
        };
        self.mix_segments(layer, LayerKind::DeltaNet, slot, x, &mut [part])
    }

    /// The projections in and out run once over every segment's rows (each weight
    /// read once per pass; a row's products are its bits alone, as in a prompt),
    /// the conv/recurrence or the attention over the cache per segment.
    fn mix_segments(
        &self,
        layer: usize,
        kind: LayerKind,
        slot: usize,
        h: &Act,
        parts: &mut [SegmentRows<'_, CpuState>],
    ) -> Result<Act, ExecError> {
        op_times::timed(op_times::Part::Mixers, || {
            self.mix_parts(layer, kind, slot, h, parts)
        })
    }

    fn moe(&self, layer: usize, x: &Act) -> Result<Act, ExecError> {
        let m = &self.weights.layers[layer].moe;
        Ok(op_times::timed(op_times::Part::Moe, || {
            moe::run(self, layer, m, x)
        }))
    }

    fn lm_head(&self, x: &Act) -> Result<Act, ExecError> {
        Ok(op_times::timed(op_times::Part::LmHead, || {
            self.mm_weight(&self.weights.output, x)
        }))
    }
}

impl CpuBackend {
    /// [`Backend::mix_segments`]'s work.
    fn mix_parts(
        &self,
        layer: usize,
        kind: LayerKind,
        slot: usize,
        h: &Act,
        parts: &mut [SegmentRows<'_, CpuState>],
    ) -> Result<Act, ExecError> {
        let total: usize = parts.iter().map(|p| p.rows).sum();
        if total != h.rows {
            return Err(ExecError::new(
                "mix_segments",
                format!("the segments have {total} rows, the batch {}", h.rows),
            ));
        }
        let mut cores = Vec::with_capacity(parts.len());
        // The cores' rows as one buffer (a lone sequence's as they are).
        let joined = |mut cores: Vec<Act>| {
            if cores.len() == 1 {
                Ok(cores.remove(0))
            } else {
                self.concat_rows(&cores)
            }
        };
        // Each part's first row in h: the rows of the parts before it.
        let mut r0 = 0;
        match (&self.weights.layers[layer].mixer, kind) {
            (Mixer::Attention(w), LayerKind::Attention) => {
                let proj = attention::project(self, w, h);
                for p in parts.iter_mut() {
                    let n_ctx = p.state.n_ctx;
                    let cache = &mut p.state.kv[slot];
                    let at = attention::At {
                        pos0: p.pos0,
                        rope: p.rope,
                    };
                    cores.push(attention::core(
                        self, w, &proj, r0, p.rows, at, cache, n_ctx,
                    ));
                    r0 += p.rows;
                }
                Ok(self.mm_weight(&w.o, &joined(cores)?))
            }
            (Mixer::DeltaNet(w), LayerKind::DeltaNet) => {
                let proj = deltanet::project(self, w, h);
                for p in parts.iter_mut() {
                    let keep = p.state.keep_trail;
                    let st = &mut p.state.dn[slot];
                    cores.push(deltanet::core(self, w, &proj, r0, p.rows, st, keep));
                    r0 += p.rows;
                }
                Ok(self.mm_weight(&w.out, &joined(cores)?))
            }
            _ => Err(ExecError::new(
                "mix_segments",
                format!("layer {layer} has no {kind:?} weights"),
            )),
        }
    }
}

/// The CPU executor: the backend and the state of each sequence.
pub struct CpuExecutor {
    backend: CpuBackend,
    states: Vec<CpuState>,
    /// Steps run so far, and the one `SCORIA_TEST_DEVICE_FAULT` makes fail as a lost
    /// device would (tests only).
    steps: u64,
    device_fault_at: Option<u64>,
}

impl CpuExecutor {
    pub fn new(backend: CpuBackend, n_ctx: usize, n_seq: usize) -> Result<CpuExecutor, ExecError> {
        let states = (0..n_seq)
            .map(|_| backend.new_state(n_ctx))
            .collect::<Result<_, _>>()?;
        let device_fault_at = std::env::var(crate::switches::TEST_DEVICE_FAULT)
            .ok()
            .and_then(|v| v.parse().ok());
        Ok(CpuExecutor {
            backend,
            states,
            steps: 0,
            device_fault_at,
        })
    }

    /// Sequence `seq`'s state, or an error naming `op`.
    fn state_mut(&mut self, op: &str, seq: usize) -> Result<&mut CpuState, ExecError> {
        let n = self.states.len();
        self.states
            .get_mut(seq)
            .ok_or_else(|| ExecError::new(op, format!("no sequence {seq} (there are {n})")))
    }

    /// Allocates K/V for positions `0..end` of sequence `seq` now instead of as the
    /// steps reach them.
    pub fn reserve(&mut self, seq: usize, end: usize) -> Result<(), ExecError> {
        self.state_mut("reserve", seq)?.reserve(end)
    }

    /// Positions of K/V allocated for sequence `seq`.
    pub fn capacity(&self, seq: usize) -> Option<usize> {
        self.states.get(seq).map(CpuState::capacity)
    }

    /// Bytes sequence `seq`'s state holds now.
    pub fn seq_bytes(&self, seq: usize) -> Option<usize> {
        self.states.get(seq).map(CpuState::bytes)
    }
}

impl Executor for CpuExecutor {
    fn sequences(&self) -> usize {
        self.states.len()
    }

    fn report(&self) -> DeviceReport {
        DeviceReport {
            device: Device::Cpu,
            name: format!("cpu ({})", quant::kernel_isa()),
            vram_used: None,
            vram_total: None,
        }
    }

    fn clear(&mut self, seq: usize) -> Result<(), ExecError> {
        self.state_mut("clear", seq)?.clear();
        Ok(())
    }

    fn snapshots(&self) -> bool {
        true
    }

    fn rollbacks(&self) -> bool {
        true
    }

    fn keep_trail(&mut self, seq: usize) -> Result<(), ExecError> {
        self.state_mut("keep_trail", seq)?.keep_trail = true;
        Ok(())
    }

    fn rollback(&mut self, seq: usize, pos: usize) -> Result<(), ExecError> {
        self.state_mut("rollback", seq)?.rollback(pos)
    }

    fn snapshot(&mut self, seq: usize, pos: usize) -> Result<SeqSnapshot, ExecError> {
        snapshot::take(self.state_mut("snapshot", seq)?, pos, true, None)
    }

    fn snapshot_from_mark(
        &mut self,
        seq: usize,
        mark: &SeqSnapshot,
    ) -> Result<SeqSnapshot, ExecError> {
        let st = self.state_mut("snapshot_from_mark", seq)?;
        snapshot::take(st, mark.pos, true, Some(mark))
    }

    fn snapshot_recurrent(&mut self, seq: usize, pos: usize) -> Result<SeqSnapshot, ExecError> {
        snapshot::take(self.state_mut("snapshot_recurrent", seq)?, pos, false, None)
    }

    fn restore(&mut self, seq: usize, snap: &SeqSnapshot, upto: usize) -> Result<(), ExecError> {
        let st = self.state_mut("restore", seq)?;
        st.mtp.lose();
        snapshot::restore(st, snap, upto)
    }

    fn restore_recurrent(&mut self, seq: usize, snap: &SeqSnapshot) -> Result<(), ExecError> {
        let st = self.state_mut("restore_recurrent", seq)?;
        st.mtp.lose();
        snapshot::restore_recurrent(st, snap)
    }

    fn mtp_draft(&mut self, seq: usize, token: u32, k: usize) -> Result<Vec<u32>, ExecError> {
        let Some(w) = self
            .backend
            .weights
            .mtp
            .as_ref()
            .filter(|_| self.backend.hidden.on())
        else {
            return Ok(Vec::new());
        };
        let n = self.states.len();
        let st = self.states.get_mut(seq).ok_or_else(|| {
            ExecError::new(
                "mtp_draft",
                format!("no sequence {seq} (this executor holds {n})"),
            )
        })?;
        let n_ctx = st.n_ctx;
        Ok(mtp::draft(&self.backend, w, &mut st.mtp, token, k, n_ctx))
    }

    fn enable_mtp(&mut self) -> bool {
        let ok = self.backend.weights.mtp.is_some();
        self.backend.hidden.set_on(ok);
        ok
    }

    fn state_bytes_held(&self) -> Option<usize> {
        Some(self.states.iter().map(CpuState::bytes).sum())
    }

    fn expert_stats(&self) -> Option<crate::experts::TierStats> {
        self.backend.tier.as_ref().map(CpuTier::stats)
    }

    fn expert_reads(&self) -> Option<crate::experts::ReadCounters> {
        self.backend.tier.as_ref().map(CpuTier::counters)
    }

    fn standing_fault(&self) -> Option<String> {
        self.backend.tier.as_ref().and_then(CpuTier::standing_fault)
    }

    /// All or nothing: the first entry that failed fails the step.
    fn step(&mut self, batch: &[SeqStep]) -> Result<Vec<StepOut>, ExecError> {
        self.step_each(batch)?.into_iter().collect()
    }

    /// The whole batch is one `model::forward_batch`: each weight is read once per
    /// step for all its rows, and each entry gets the bits it would get alone. With
    /// tiered experts, an entry whose rows could not get their experts fails alone.
    fn step_each(&mut self, batch: &[SeqStep]) -> Result<Vec<EntryResult>, ExecError> {
        self.steps += 1;
        if self.device_fault_at == Some(self.steps) {
            return Err(ExecError::fatal(
                "step",
                format!(
                    "the device stopped answering (injected at step {} by {})",
                    self.steps,
                    crate::switches::TEST_DEVICE_FAULT
                ),
            ));
        }
        // A mutable borrow of each named state; a sequence named twice is refused
        // (its two entries would race for one state).
        let mut slots: Vec<Option<&mut CpuState>> = self.states.iter_mut().map(Some).collect();
        let n_seq = slots.len();
        let mut segs = Vec::with_capacity(batch.len());
        for s in batch {
            let state = slots
                .get_mut(s.seq)
                .ok_or_else(|| {
                    ExecError::new(
                        "step",
                        format!("no sequence {} (this executor holds {n_seq})", s.seq),
                    )
                })?
                .take()
                .ok_or_else(|| {
                    ExecError::new(
                        "step",
                        format!(
                            "sequence {} appears twice in one batch; each entry must name a distinct sequence",
                            s.seq
                        ),
                    )
                })?;
            if s.tokens.is_empty() {
                return Err(ExecError::new(
                    "step",
                    format!("the entry for sequence {} has no tokens", s.seq),
                ));
            }
            // A verify step keeps its DeltaNet trail (and says where it lies); any
            // other step leaves nothing to roll back to.
            state.trail = state.keep_trail.then_some(TrailSpan {
                pos0: s.pos0,
                n: s.tokens.len(),
            });
            segs.push(model::Segment {
                tokens: s.tokens,
                pos0: s.pos0,
                state,
                logits: s.want.logits(),
                media: s.media,
            });
        }
        // A pass of a few rows (decode steps) is hundreds of short loops: they run on
        // the spinning team, from this thread. A longer pass runs on a thread of
        // rayon's pool, so its loops fork from a worker (which takes a share of each
        // and wakes idle workers as it goes) instead of each loop handing work over
        // from this thread and sleeping until the pool is done.
        let backend = &self.backend;
        let rows: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if let Some(t) = &backend.tier {
            t.begin_pass();
        }
        let logits = op_times::timed(op_times::Part::Pass, || {
            if rows < PARALLEL_ROWS {
                quant::par::with_pool(team::shared(), || model::forward_batch(backend, &mut segs))
            } else {
                rayon::scope(|_| model::forward_batch(backend, &mut segs))
            }
        });
        for seg in &mut segs {
            seg.state.keep_trail = false;
        }
        let logits = logits?;
        // MTP: the positions this step made computable, from its hidden rows.
        if let (Some(w), Some(h)) = (backend.weights.mtp.as_ref(), backend.hidden.take()) {
            let mut row0 = 0;
            for seg in &mut segs {
                let n = seg.tokens.len();
                if seg.media.rope.is_some() || !seg.media.embeds.is_empty() {
                    // Images: the MTP block was trained on text.
                    seg.state.mtp.lose();
                } else {
                    let rows = Act {
                        rows: n,
                        cols: h.cols,
                        data: h.data[row0 * h.cols..(row0 + n) * h.cols].to_vec(),
                    };
                    let n_ctx = seg.state.n_ctx;
                    mtp::fill(
                        backend,
                        w,
                        &mut seg.state.mtp,
                        seg.tokens,
                        seg.pos0,
                        rows,
                        n_ctx,
                    );
                }
                row0 += n;
            }
        }
        // Rows that could not get their experts: the entries they belong to fail.
        let failed = backend
            .tier
            .as_ref()
            .map(CpuTier::failed_rows)
            .unwrap_or_default();
        let mut row0 = 0;
        Ok(batch
            .iter()
            .zip(logits)
            .map(|(s, l)| {
                let rows = row0..row0 + s.tokens.len();
                row0 = rows.end;
                if let Some((_, e)) = failed.iter().find(|(r, _)| rows.contains(r)) {
                    return Err(e.clone());
                }
                Ok(match s.want {
                    Want::Logits(_) => StepOut::Logits(l.data),
                    Want::Greedy => StepOut::Token(crate::sampler::argmax(&l.data)),
                    Want::Sample => StepOut::Token(crate::sampler::sample_with(
                        &s.sample_draws(0, 1)?[0],
                        &l.data,
                    )),
                    Want::SampleRows => {
                        let n = s.tokens.len();
                        StepOut::Tokens(
                            l.data
                                .chunks_exact(l.data.len() / n)
                                .zip(s.sample_draws(0, n)?)
                                .map(|(row, d)| crate::sampler::sample_with(d, row))
                                .collect(),
                        )
                    }
                    Want::GreedyRows => StepOut::Tokens(
                        l.data
                            .chunks_exact(l.data.len() / s.tokens.len())
                            .map(crate::sampler::argmax)
                            .collect(),
                    ),
                })
            })
            .collect())
    }
}
