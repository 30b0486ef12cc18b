//! Qwen3-MoE (`qwen3moe`): every layer is GQA attention with per-head q/k RMSNorm
//! and full-width NeoX RoPE, followed by routed experts (no shared expert).
//! Norms are plain RMSNorm (the HF checkpoint is not zero-centred, so the
//! converter shifts nothing). The pre-FFN norm is `ffn_norm`.

use crate::config::ModelConfig;
use crate::weights::{load_attention, load_common, LayerWeights, Loader, Mixer};
use crate::ModelError;

pub(crate) fn load_layer(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
) -> Result<LayerWeights, ModelError> {
    let attn = load_attention(l, cfg, i)?;
    load_common(l, cfg, i, Mixer::Attention(attn), "ffn_norm")
}
