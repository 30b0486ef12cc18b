//! Qwen3-Next (`qwen3next`): gated DeltaNet ×3 + gated attention ×1, routed
//! experts plus a sigmoid-gated shared expert.
//!
//! Special cases of this arch's GGUF files:
//! - β and α come from one fused projection `ssm_ba` {n_embd, 2·Hv}, laid out per
//!   key head g as [β_{g·r} .. β_{g·r+r-1}, α_{g·r} .. α_{g·r+r-1}] (r = Hv/Hk),
//!   as HF's `in_proj_ba` is; the converter keeps it as is. [`ba_rows`] turns that
//!   layout into gather indices, so executors never need this file.
//! - Value heads are in HF's grouped order: value head h reads key head h / r.
//!   (qwen35moe files differ: see qwen35moe.rs.)
//! - Legacy files hold the fused, per-key-head interleaved `ssm_in` (qkvz) instead of
//!   `attn_qkv` + `attn_gate`; they are refused with the remedy.
//! - Most files carry no MTP block; a converter with MTP support names it as qwen35moe's.

use crate::config::Arch;
use crate::tensors::{
    ArchTable, Dim, QuantRule, Refused, Role, TensorDef, TensorId, When, ATTENTION, ATTN_NORM,
    DELTANET, FUSED_GATE_UP, MOE, NEXTN, POST_ATTENTION_NORM, SHARED_EXPERT, TRUNK,
};

/// β and α, fused: see [`ba_rows`] for the row order.
const SSM_BA: TensorDef = TensorDef::new(
    TensorId::SsmBa,
    "ssm_ba.weight",
    &[Dim::Embd, Dim::TwoVHeads],
    Role::LinearAttention,
    When::DeltaNet,
    QuantRule::Weight,
);

const LEGACY_SSM_IN: Refused = Refused {
    name: "ssm_in.weight",
    why: "this file uses the legacy fused qkvz projection; \
          re-convert it with a current llama.cpp converter (attn_qkv + attn_gate)",
};

pub(crate) static TABLE: ArchTable = ArchTable {
    arch: Arch::Qwen3Next,
    trunk: TRUNK,
    block: &[
        &[ATTN_NORM, POST_ATTENTION_NORM],
        ATTENTION,
        DELTANET,
        &[SSM_BA],
        MOE,
        SHARED_EXPERT,
        NEXTN,
    ],
    refused: &[LEGACY_SSM_IN, FUSED_GATE_UP],
    gated_attention: true,
    tiled_v_heads: false,
};

/// Where each value head's β and α sit in one token's `ssm_ba` output: β of value head
/// h is element `beta[h]`, α is `alpha[h]`. Per key head g the output holds
/// [β_{g·r} .. β_{g·r+r−1}, α_{g·r} .. α_{g·r+r−1}] with r = Hv / Hk.
pub fn ba_rows(n_k_heads: usize, n_v_heads: usize) -> (Vec<u32>, Vec<u32>) {
    let r = n_v_heads / n_k_heads.max(1);
    let mut beta = Vec::with_capacity(n_v_heads);
    let mut alpha = Vec::with_capacity(n_v_heads);
    for g in 0..n_k_heads {
        for j in 0..r {
            beta.push((g * 2 * r + j) as u32);
            alpha.push((g * 2 * r + r + j) as u32);
        }
    }
    (beta, alpha)
}

#[cfg(test)]
mod tests {
    #[test]
    fn ba_rows_gather_the_grouped_layout() {
        // Hk = 2, Hv = 4: [b0 b1 a0 a1 | b2 b3 a2 a3]
        let ba = [0.0f32, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0];
        let (b, a) = super::ba_rows(2, 4);
        let gather = |rows: &[u32]| rows.iter().map(|&r| ba[r as usize]).collect::<Vec<f32>>();
        assert_eq!(gather(&b), vec![0.0, 1.0, 2.0, 3.0]);
        assert_eq!(gather(&a), vec![10.0, 11.0, 12.0, 13.0]);
        // Every output element is read exactly once.
        let mut all: Vec<u32> = b.iter().chain(&a).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<u32>>());
    }
}
