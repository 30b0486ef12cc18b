//! Qwen3.5 / Qwen3.6 MoE (`qwen35moe`): the same hybrid as Qwen3-Next, with
//! these differences in its GGUF files:
//! - β and α are separate projections `ssm_beta` and `ssm_alpha` {n_embd, Hv}.
//! - The converter permutes every value-head-indexed tensor into *tiled* order,
//!   so value head h reads key head h % Hk (`SsmConfig::tiled_v_heads`).
//! - RoPE is IMROPE with sections [11,11,10,0]; for text all four position
//!   components are equal, which reduces it exactly to NeoX rope over n_rot dims.
//! - One MTP (NextN) block may follow the trunk (`nextn_predict_layers`); it is
//!   not run by the trunk forward and is kept for speculative decoding.

use crate::config::{LayerKind, ModelConfig};
use crate::weights::{
    load_attention, load_common, load_deltanet, BetaAlpha, LayerWeights, Loader, Mixer,
};
use crate::ModelError;

pub(crate) fn load_layer(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
) -> Result<LayerWeights, ModelError> {
    let mixer = match cfg.layer_kinds[i] {
        LayerKind::Attention => Mixer::Attention(load_attention(l, cfg, i)?),
        LayerKind::DeltaNet => {
            let hv = cfg.ssm.as_ref().map(|s| s.n_v_heads).unwrap_or(0);
            let beta = l.get(&format!("blk.{i}.ssm_beta.weight"), &[cfg.n_embd, hv])?;
            let alpha = l.get(&format!("blk.{i}.ssm_alpha.weight"), &[cfg.n_embd, hv])?;
            Mixer::DeltaNet(load_deltanet(
                l,
                cfg,
                i,
                BetaAlpha::Separate { beta, alpha },
            )?)
        }
    };
    load_common(l, cfg, i, mixer, "post_attention_norm")
}
