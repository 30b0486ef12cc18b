//! The forward pass of every supported arch, written once over a [`Backend`].
//!
//! A layer is: x += mixer(rmsnorm(x)); x += moe(rmsnorm(x)). The mixer is gated
//! attention or gated DeltaNet (hybrids) or plain GQA attention (qwen3moe); the
//! arch-specific details live in the weights (see `arch/`) and the config.
//! Executors implement [`Backend`]: the CPU one is in the engine crate; a CUDA
//! one plugs in the same way.

use crate::config::{LayerKind, ModelConfig};
use crate::weights::{AttentionWeights, DeltaNetWeights, Mixer, ModelWeights, MoeWeights, Weight};

/// Which positions' logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (decoding).
    Last,
    /// Every position (parity tests, `--dump-logits`).
    All,
}

/// The operations a model step needs from an executor. Activations are
/// `tokens × width` matrices held by the backend.
pub trait Backend {
    /// Activations of some tokens, row-major by token.
    type Buf;
    /// One sequence's state: a KV cache per attention layer, conv and recurrent
    /// state per DeltaNet layer.
    type State;

    fn new_state(&self, cfg: &ModelConfig, n_ctx: usize) -> Self::State;
    fn embed(&self, table: &Weight, tokens: &[u32]) -> Self::Buf;
    fn rms_norm(&self, x: &Self::Buf, w: &[f32], eps: f32) -> Self::Buf;
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf);
    /// Keeps only the last row.
    fn last_row(&self, x: Self::Buf) -> Self::Buf;
    fn matmul(&self, w: &Weight, x: &Self::Buf) -> Self::Buf;
    fn download(&self, x: &Self::Buf) -> Vec<f32>;
    /// Attention for tokens at positions pos0.. (writes their K/V into the state's
    /// cache for attention layer `slot`).
    fn attention(
        &self,
        cfg: &ModelConfig,
        slot: usize,
        w: &AttentionWeights,
        x: &Self::Buf,
        pos0: usize,
        state: &mut Self::State,
    ) -> Self::Buf;
    /// Gated DeltaNet over the tokens, advancing DeltaNet layer `slot`'s state.
    fn delta_net(
        &self,
        cfg: &ModelConfig,
        slot: usize,
        w: &DeltaNetWeights,
        x: &Self::Buf,
        state: &mut Self::State,
    ) -> Self::Buf;
    /// Routed experts (+ shared expert) of layer `layer`.
    fn moe(&self, cfg: &ModelConfig, layer: usize, w: &MoeWeights, x: &Self::Buf) -> Self::Buf;
}

/// Runs `tokens` at positions pos0.. through the model, advancing `state`, and
/// returns logits (n_vocab per returned position).
pub fn forward<B: Backend>(
    b: &B,
    cfg: &ModelConfig,
    w: &ModelWeights,
    tokens: &[u32],
    pos0: usize,
    state: &mut B::State,
    which: Logits,
) -> Vec<f32> {
    let mut x = b.embed(&w.token_embd, tokens);
    let (mut attn_slot, mut dn_slot) = (0, 0);
    for (i, layer) in w.layers.iter().enumerate() {
        let h = b.rms_norm(&x, &layer.attn_norm, cfg.eps);
        let m = match (&layer.mixer, cfg.layer_kinds[i]) {
            (Mixer::Attention(a), LayerKind::Attention) => {
                let out = b.attention(cfg, attn_slot, a, &h, pos0, state);
                attn_slot += 1;
                out
            }
            (Mixer::DeltaNet(d), LayerKind::DeltaNet) => {
                let out = b.delta_net(cfg, dn_slot, d, &h, state);
                dn_slot += 1;
                out
            }
            // ModelWeights::load builds each layer from its kind.
            _ => unreachable!("layer {i}: weights do not match the layer kind"),
        };
        b.add_assign(&mut x, &m);
        let h = b.rms_norm(&x, &layer.ffn_norm, cfg.eps);
        let f = b.moe(cfg, i, &layer.moe, &h);
        b.add_assign(&mut x, &f);
    }
    if which == Logits::Last {
        x = b.last_row(x);
    }
    let x = b.rms_norm(&x, &w.output_norm, cfg.eps);
    let logits = b.matmul(&w.output, &x);
    b.download(&logits)
}
