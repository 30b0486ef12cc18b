//! Qwen3.5 / Qwen3.6 MoE (`qwen35moe`): the same hybrid as Qwen3-Next, with
//! these differences in its GGUF files:
//! - β and α are separate projections `ssm_beta` and `ssm_alpha` {n_embd, Hv}.
//! - The converter permutes every value-head-indexed tensor into *tiled* order,
//!   so value head h reads key head h % Hk (`SsmConfig::tiled_v_heads`).
//! - RoPE is IMROPE with sections [11,11,10,0]; for text all four position
//!   components are equal, which reduces it exactly to NeoX rope over n_rot dims.
//! - One MTP (NextN) block may follow the trunk (`nextn_predict_layers`); it is
//!   not run by the trunk forward and is kept for speculative decoding.

use crate::config::ModelConfig;
use crate::weights::{load_hybrid_layer, BetaAlpha, LayerWeights, Loader};
use crate::ModelError;

pub(crate) fn load_layer(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
) -> Result<LayerWeights, ModelError> {
    load_hybrid_layer(l, cfg, i, |hv| {
        Ok(BetaAlpha::Separate {
            beta: l.get(&format!("blk.{i}.ssm_beta.weight"), &[cfg.n_embd, hv])?,
            alpha: l.get(&format!("blk.{i}.ssm_alpha.weight"), &[cfg.n_embd, hv])?,
        })
    })
}
