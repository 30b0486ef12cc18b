//! Qwen3-Next (`qwen3next`): gated DeltaNet ×3 + gated attention ×1, routed
//! experts plus a sigmoid-gated shared expert.
//!
//! Special cases of this arch's GGUF files:
//! - β and α come from one fused projection `ssm_ba` {n_embd, 2·Hv}, laid out per
//!   key head g as [β_{g·r} .. β_{g·r+r-1}, α_{g·r} .. α_{g·r+r-1}] (r = Hv/Hk),
//!   as HF's `in_proj_ba` is; the converter keeps it as is.
//! - Value heads are in HF's grouped order: value head h reads key head h / r.
//!   (qwen35moe files differ: see qwen35moe.rs.)

use crate::config::ModelConfig;
use crate::weights::{load_hybrid_layer, BetaAlpha, LayerWeights, Loader};
use crate::ModelError;

pub(crate) fn load_layer(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
) -> Result<LayerWeights, ModelError> {
    if l.has(&format!("blk.{i}.ssm_in.weight")) {
        return Err(ModelError::Unsupported(format!(
            "blk.{i}.ssm_in.weight: this file uses the legacy fused qkvz projection; \
             re-convert it with a current llama.cpp converter (attn_qkv + attn_gate)"
        )));
    }
    load_hybrid_layer(l, cfg, i, |hv| {
        Ok(BetaAlpha::Fused(l.get(
            &format!("blk.{i}.ssm_ba.weight"),
            &[cfg.n_embd, 2 * hv],
        )?))
    })
}

/// Splits the fused `ssm_ba` output of one token into (β logits, α logits), each
/// in value-head order.
pub fn split_ba(ba: &[f32], n_k_heads: usize, n_v_heads: usize) -> (Vec<f32>, Vec<f32>) {
    let r = n_v_heads / n_k_heads;
    let mut b = vec![0.0f32; n_v_heads];
    let mut a = vec![0.0f32; n_v_heads];
    for g in 0..n_k_heads {
        for j in 0..r {
            b[g * r + j] = ba[g * 2 * r + j];
            a[g * r + j] = ba[g * 2 * r + r + j];
        }
    }
    (b, a)
}

#[cfg(test)]
mod tests {
    #[test]
    fn split_ba_groups() {
        // Hk = 2, Hv = 4: [b0 b1 a0 a1 | b2 b3 a2 a3]
        let ba = [0.0, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0];
        let (b, a) = super::split_ba(&ba, 2, 4);
        assert_eq!(b, vec![0.0, 1.0, 2.0, 3.0]);
        assert_eq!(a, vec![10.0, 11.0, 12.0, 13.0]);
    }
}
