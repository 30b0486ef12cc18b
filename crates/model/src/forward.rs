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
}

impl ExecError {
    pub fn new(op: impl Into<String>, msg: impl std::fmt::Display) -> ExecError {
        ExecError {
            op: op.into(),
            msg: msg.to_string(),
        }
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
    /// Routed experts (+ shared expert) of layer `layer`.
    fn moe(&self, layer: usize, x: &Self::Buf) -> Result<Self::Buf, ExecError>;
    /// The LM head: logits (n_vocab per row).
    fn lm_head(&self, x: &Self::Buf) -> Result<Self::Buf, ExecError>;
}

/// Runs `tokens` at positions pos0.. through the model, advancing `state`, and
/// returns the logits buffer (n_vocab per returned position) on the backend.
pub fn forward<B: Backend>(
    b: &B,
    tokens: &[u32],
    pos0: usize,
    state: &mut B::State,
    which: Logits,
) -> Result<B::Buf, ExecError> {
    let cfg = b.config();
    let mut x = b.embed(tokens)?;
    let (mut attn_slot, mut dn_slot) = (0, 0);
    let n_layer = cfg.layer_kinds.len();
    let mut h = b.rms_norm(&x, Norm::Attn(0))?;
    for (i, kind) in cfg.layer_kinds.iter().enumerate() {
        let m = match kind {
            LayerKind::Attention => {
                attn_slot += 1;
                b.attention(i, attn_slot - 1, &h, pos0, state)?
            }
            LayerKind::DeltaNet => {
                dn_slot += 1;
                b.delta_net(i, dn_slot - 1, &h, state)?
            }
        };
        let hf = b.add_rms_norm(&mut x, &m, Norm::Ffn(i))?;
        let f = b.moe(i, &hf)?;
        if i + 1 < n_layer {
            h = b.add_rms_norm(&mut x, &f, Norm::Attn(i + 1))?;
        } else {
            b.add_assign(&mut x, &f)?;
        }
    }
    if which == Logits::Last {
        x = b.last_row(x)?;
    }
    let x = b.rms_norm(&x, Norm::Output)?;
    b.lm_head(&x)
}
