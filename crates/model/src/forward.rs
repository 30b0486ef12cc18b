//! The forward pass of every supported arch, written once over a [`Backend`].
//!
//! A layer is: x += mixer(rmsnorm(x)); x += moe(rmsnorm(x)). The mixer is gated
//! attention or gated DeltaNet (hybrids) or plain GQA attention (qwen3moe); which
//! one a layer has is `ModelConfig::layer_kinds`, and the arch-specific details
//! live in the weights (see `arch/`).
//!
//! A backend is a device seam: it owns its copy of the weights (the CPU one reads
//! the memory-mapped file, the CUDA one an upload in VRAM) and its activation
//! buffers, and names weights by layer and role rather than by host pointers.
//! Every operation returns a `Result`, so a device or copy failure reaches the
//! caller as an [`ExecError`] naming what failed.

use crate::config::{LayerKind, ModelConfig};

/// Which positions' logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (decoding).
    Last,
    /// Every position (parity tests, `--dump-logits`).
    All,
}

/// An executor operation that failed: which one, and why (e.g. a CUDA error).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{op}: {msg}")]
pub struct ExecError {
    pub op: String,
    pub msg: String,
    pub kind: ExecErrorKind,
}

/// What an [`ExecError`] means for the caller: most fail the step; some are survived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExecErrorKind {
    #[default]
    Other,
    /// The device can run nothing more (a GPU's sticky context error, a lost device):
    /// the process must be restarted.
    Fatal,
    /// The GPU is out of memory (another process took VRAM since startup): the
    /// executor gives back what it can and goes on.
    OutOfVram,
    /// Experts could not be read from the model file: only the request whose pass
    /// needed them fails.
    ExpertRead,
}

impl ExecError {
    pub fn new(op: impl Into<String>, msg: impl std::fmt::Display) -> ExecError {
        ExecError::of_kind(ExecErrorKind::Other, op, msg)
    }

    /// An error after which the device runs nothing more.
    pub fn fatal(op: impl Into<String>, msg: impl std::fmt::Display) -> ExecError {
        ExecError::of_kind(ExecErrorKind::Fatal, op, msg)
    }

    pub fn of_kind(
        kind: ExecErrorKind,
        op: impl Into<String>,
        msg: impl std::fmt::Display,
    ) -> ExecError {
        ExecError {
            op: op.into(),
            msg: msg.to_string(),
            kind,
        }
    }

    pub fn is_fatal(&self) -> bool {
        self.kind == ExecErrorKind::Fatal
    }
}

/// The RMS norms of a model, by position in the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// Before layer i's mixer.
    Attn(usize),
    /// Before layer i's MoE block.
    Ffn(usize),
    /// Before the LM head.
    Output,
}

/// The operations a model step needs from an executor. Activations are
/// `tokens × width` matrices held by the backend.
pub trait Backend {
    /// Activations of some tokens, row-major by token.
    type Buf;
    /// One sequence's state: a KV cache per attention layer, conv and recurrent
    /// state per DeltaNet layer.
    type State;

    fn config(&self) -> &ModelConfig;
    fn new_state(&self, n_ctx: usize) -> Result<Self::State, ExecError>;
    fn embed(&self, tokens: &[u32]) -> Result<Self::Buf, ExecError>;
    /// Whether [`forward_batch`] should hand every row's post-norm hidden state (what
    /// the LM head reads) to [`Backend::keep_hidden`] (MTP drafts start from it).
    fn wants_hidden(&self) -> bool {
        false
    }
    /// The post-norm hidden rows of the pass, all rows in segment order.
    fn keep_hidden(&self, h: &Self::Buf) -> Result<(), ExecError> {
        let _ = h;
        Ok(())
    }
    /// Overwrites row `row` of `x` with `data` (an image's embedding row, n_embd
    /// values). A backend that takes no images may leave the default, which refuses.
    fn set_row(&self, x: &mut Self::Buf, row: usize, data: &[f32]) -> Result<(), ExecError> {
        let _ = (x, row, data);
        Err(ExecError::new(
            "set_row",
            "this executor takes no image rows (images run on the CPU executor)",
        ))
    }
    fn rms_norm(&self, x: &Self::Buf, which: Norm) -> Result<Self::Buf, ExecError>;
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<(), ExecError>;
    /// x += y, then the norm `which` of the new x: the residual step and the next
    /// norm, which a device may run as one kernel (same bits as the two apart).
    fn add_rms_norm(
        &self,
        x: &mut Self::Buf,
        y: &Self::Buf,
        which: Norm,
    ) -> Result<Self::Buf, ExecError> {
        self.add_assign(x, y)?;
        self.rms_norm(x, which)
    }
    /// Keeps only the last row.
    fn last_row(&self, x: Self::Buf) -> Result<Self::Buf, ExecError>;
    /// Rows `start..start + n` of `x` as a buffer of their own (a copy or a view):
    /// [`forward_batch`] hands each sequence's rows to its mixer, and picks the
    /// rows whose logits were asked for. Only passes over several sequences use
    /// it; a backend that runs one sequence per pass may leave the default, which
    /// refuses.
    fn rows(&self, x: &Self::Buf, start: usize, n: usize) -> Result<Self::Buf, ExecError> {
        let _ = (x, start, n);
        Err(ExecError::new(
            "rows",
            "this backend runs one sequence per forward pass (no row split); step the sequences one by one",
        ))
    }
    /// The rows of `parts`, in order, as one buffer (the inverse of [`Backend::rows`]).
    /// Same default as `rows`.
    fn concat_rows(&self, parts: &[Self::Buf]) -> Result<Self::Buf, ExecError> {
        let _ = parts;
        Err(ExecError::new(
            "concat_rows",
            "this backend runs one sequence per forward pass (no row concatenation); step the sequences one by one",
        ))
    }
    /// Attention of layer `layer` for tokens at positions pos0.. (writes their
    /// K/V into the state's cache for attention layer number `slot`).
    fn attention(
        &self,
        layer: usize,
        slot: usize,
        x: &Self::Buf,
        pos0: usize,
        state: &mut Self::State,
    ) -> Result<Self::Buf, ExecError>;
    /// Gated DeltaNet of layer `layer` over the tokens, advancing DeltaNet layer
    /// number `slot`'s state.
    fn delta_net(
        &self,
        layer: usize,
        slot: usize,
        x: &Self::Buf,
        state: &mut Self::State,
    ) -> Result<Self::Buf, ExecError>;
    /// The mixer of layer `layer` (of `kind`, its `slot`-th of that kind) for several
    /// sequences at once: the rows of `h` are the segments' in the order of `parts`,
    /// each part giving its row count, first position and state; the result has the
    /// rows of `h`, each mixed with its own segment's state. [`forward_batch`] calls it
    /// for one sequence too. The default gives a lone sequence all of `h` and runs
    /// several segments' rows through [`Backend::attention`] / [`Backend::delta_net`]
    /// on their own, then concatenates them; a backend may instead run the token-wise
    /// projections once over every row (reading each weight once per pass), as long
    /// as every row gets the bits it gets alone.
    fn mix_segments(
        &self,
        layer: usize,
        kind: LayerKind,
        slot: usize,
        h: &Self::Buf,
        parts: &mut [SegmentRows<'_, Self::State>],
    ) -> Result<Self::Buf, ExecError> {
        if parts.iter().any(|p| p.rope.is_some()) {
            return Err(ExecError::new(
                "mix_segments",
                "this executor has no multimodal rotary positions (images run on the CPU executor)",
            ));
        }
        let mix = |hs: &Self::Buf, p: &mut SegmentRows<'_, Self::State>| match kind {
            LayerKind::Attention => self.attention(layer, slot, hs, p.pos0, p.state),
            LayerKind::DeltaNet => self.delta_net(layer, slot, hs, p.state),
        };
        // One sequence: its rows are all of `h` (no split, which not every backend has).
        if let [p] = parts {
            return mix(h, p);
        }
        let mut outs = Vec::with_capacity(parts.len());
        let mut start = 0;
        for p in parts.iter_mut() {
            let hs = self.rows(h, start, p.rows)?;
            start += p.rows;
            outs.push(mix(&hs, p)?);
        }
        self.concat_rows(&outs)
    }
    /// Routed experts (+ shared expert) of layer `layer`.
    fn moe(&self, layer: usize, x: &Self::Buf) -> Result<Self::Buf, ExecError>;
    /// The LM head: logits (n_vocab per row).
    fn lm_head(&self, x: &Self::Buf) -> Result<Self::Buf, ExecError>;
}

/// The check of every [`Backend::set_row`]: `len` values into row `row` of a buffer of
/// `rows` rows of `cols`.
pub fn check_set_row(rows: usize, cols: usize, row: usize, len: usize) -> Result<(), ExecError> {
    if row >= rows || len != cols {
        return Err(ExecError::new(
            "set_row",
            format!("row {row} of {len} values into {rows} rows of {cols}"),
        ));
    }
    Ok(())
}

/// One segment's part of a batch's activations, for [`Backend::mix_segments`]: its
/// `rows` (after the rows of the parts before it), at positions `pos0..`, advancing
/// `state`.
pub struct SegmentRows<'a, S> {
    pub rows: usize,
    pub pos0: usize,
    pub state: &'a mut S,
    /// Each row's multimodal rotary position ([`Media::rope`]; None: pos0 + row).
    pub rope: Option<&'a [[u32; 3]]>,
}

/// What a segment feeds besides token ids, when its prompt holds images: rows whose
/// embedding is given instead of looked up, and every row's (t, h, w) rotary position
/// (`ModelConfig::rope_sections`). The default is a text segment: each row embeds its
/// token and sits at pos0 + row in every section, the text path's bits exactly.
#[derive(Debug, Clone, Copy, Default)]
pub struct Media<'a> {
    /// (row of the segment, its embedding: n_embd values).
    pub embeds: &'a [(usize, &'a [f32])],
    /// Every row's rotary position (None: pos0 + row in every section).
    pub rope: Option<&'a [[u32; 3]]>,
}

/// One sequence's part of a [`forward_batch`]: `tokens` at positions `pos0..`,
/// advancing `state`, returning the logits `logits` names.
pub struct Segment<'a, S> {
    pub tokens: &'a [u32],
    pub pos0: usize,
    pub state: &'a mut S,
    pub logits: Logits,
    pub media: Media<'a>,
}

/// Runs `tokens` at positions pos0.. through the model, advancing `state`, and
/// returns the logits buffer (n_vocab per returned position) on the backend.
/// The same operations as [`forward_batch`] of this one segment.
pub fn forward<B: Backend>(
    b: &B,
    tokens: &[u32],
    pos0: usize,
    state: &mut B::State,
    which: Logits,
) -> Result<B::Buf, ExecError> {
    let seg = Segment {
        tokens,
        pos0,
        state,
        logits: which,
        media: Media::default(),
    };
    let mut out = forward_batch(b, &mut [seg])?;
    out.pop()
        .ok_or_else(|| ExecError::new("forward", "the pass returned no logits"))
}

/// Runs several sequences' segments through the model in one pass and returns each
/// segment's logits (n_vocab per returned position), in segment order.
///
/// The segments' tokens form one activation matrix, so every token-wise operation
/// (norms, residual adds, router, experts, shared expert, LM head) runs once over
/// all rows and reads each weight once per pass; the mixers, which read and
/// advance a sequence's state, get every segment's rows and state at once
/// ([`Backend::mix_segments`]: per segment by default, or with their projections
/// shared by all rows and only the state's part per segment). Every
/// token-wise operation computes each row from that row alone (the kernels give a
/// row the same bits whatever the other rows, and routing is per token), so each
/// segment gets the bits and the state it would get alone (invariant 3 of docs/design.md,
/// "batching is invisible"). One segment runs no row split or concatenation: its
/// operations are exactly those of a single-sequence pass.
///
/// The segments must advance distinct states (the borrow checker sees to that)
/// and each must have at least one token.
pub fn forward_batch<B: Backend>(
    b: &B,
    segs: &mut [Segment<'_, B::State>],
) -> Result<Vec<B::Buf>, ExecError> {
    if segs.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(i) = segs.iter().position(|s| s.tokens.is_empty()) {
        return Err(ExecError::new(
            "forward",
            format!("segment {i} has no tokens (every segment needs at least one)"),
        ));
    }
    let cfg = b.config();
    let single = segs.len() == 1;
    // Row offset of each segment in the batch's activation matrix.
    let mut starts = Vec::with_capacity(segs.len());
    let mut n_rows = 0;
    for s in segs.iter() {
        starts.push(n_rows);
        n_rows += s.tokens.len();
    }
    let images = segs.iter().any(|s| !s.media.embeds.is_empty());
    let mut x = if single && !images {
        b.embed(segs[0].tokens)?
    } else {
        let mut all: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        // Image rows' ids name the image, not a vocabulary entry: they embed token 0,
        // and their rows are overwritten below.
        for (s, &start) in segs.iter().zip(&starts) {
            for &(r, _) in s.media.embeds {
                if let Some(t) = all.get_mut(start + r) {
                    *t = 0;
                }
            }
        }
        b.embed(&all)?
    };
    for (s, &start) in segs.iter().zip(&starts) {
        if let Some(&(r, _)) = s.media.embeds.iter().find(|(r, _)| *r >= s.tokens.len()) {
            return Err(ExecError::new(
                "forward",
                format!(
                    "an image row at {r} lies past the segment's {} tokens",
                    s.tokens.len()
                ),
            ));
        }
        if s.media.rope.is_some_and(|r| r.len() != s.tokens.len()) {
            return Err(ExecError::new(
                "forward",
                "a segment's rotary positions do not cover its tokens",
            ));
        }
        for &(r, data) in s.media.embeds {
            b.set_row(&mut x, start + r, data)?;
        }
    }
    let (mut attn_slot, mut dn_slot) = (0, 0);
    let n_layer = cfg.layer_kinds.len();
    let mut h = b.rms_norm(&x, Norm::Attn(0))?;
    for (i, kind) in cfg.layer_kinds.iter().enumerate() {
        let slot = match kind {
            LayerKind::Attention => &mut attn_slot,
            LayerKind::DeltaNet => &mut dn_slot,
        };
        *slot += 1;
        let slot = *slot - 1;
        let mut parts: Vec<SegmentRows<'_, B::State>> = segs
            .iter_mut()
            .map(|s| SegmentRows {
                rows: s.tokens.len(),
                pos0: s.pos0,
                state: &mut *s.state,
                rope: s.media.rope,
            })
            .collect();
        let m = b.mix_segments(i, *kind, slot, &h, &mut parts)?;
        let hf = b.add_rms_norm(&mut x, &m, Norm::Ffn(i))?;
        let f = b.moe(i, &hf)?;
        if i + 1 < n_layer {
            h = b.add_rms_norm(&mut x, &f, Norm::Attn(i + 1))?;
        } else {
            b.add_assign(&mut x, &f)?;
        }
    }
    if b.wants_hidden() {
        b.keep_hidden(&b.rms_norm(&x, Norm::Output)?)?;
    }
    if single {
        if segs[0].logits == Logits::Last {
            x = b.last_row(x)?;
        }
        let x = b.rms_norm(&x, Norm::Output)?;
        return Ok(vec![b.lm_head(&x)?]);
    }
    // Only the rows whose logits were asked for go through the output norm and
    // the LM head; `picked[k]` is (first row, rows) of segment k among them.
    let mut picked = Vec::with_capacity(segs.len());
    let mut n_picked = 0;
    for (s, &start) in segs.iter().zip(&starts) {
        let (from, n) = match s.logits {
            Logits::Last => (start + s.tokens.len() - 1, 1),
            Logits::All => (start, s.tokens.len()),
        };
        picked.push((from, n_picked, n));
        n_picked += n;
    }
    if n_picked < n_rows {
        let parts = picked
            .iter()
            .map(|&(from, _, n)| b.rows(&x, from, n))
            .collect::<Result<Vec<_>, _>>()?;
        x = b.concat_rows(&parts)?;
    }
    let x = b.rms_norm(&x, Norm::Output)?;
    let logits = b.lm_head(&x)?;
    picked
        .iter()
        .map(|&(_, at, n)| b.rows(&logits, at, n))
        .collect()
}
