//! Qwen3.5 / Qwen3.6 MoE (`qwen35moe`): the same hybrid as Qwen3-Next, with
//! these differences in its GGUF files:
//! - β and α are separate projections `ssm_beta` and `ssm_alpha` {n_embd, Hv}.
//! - The converter permutes every value-head-indexed tensor into *tiled* order,
//!   so value head h reads key head h % Hk (`SsmConfig::tiled_v_heads`).
//! - RoPE is IMROPE with sections [11,11,10,0]; for text all four position
//!   components are equal, which reduces it exactly to NeoX rope over n_rot dims.
//! - One MTP (NextN) block may follow the trunk (`nextn_predict_layers`); it is
//!   not run by the trunk forward and is kept for speculative decoding.

use crate::config::Arch;
use crate::tensors::{
    ArchTable, Dim, QuantRule, Role, TensorDef, TensorId, When, ATTENTION, ATTN_NORM, DELTANET,
    FUSED_GATE_UP, MOE, NEXTN, POST_ATTENTION_NORM, SHARED_EXPERT, TRUNK,
};

/// β and α logits, one per value head each.
const BETA_ALPHA: &[TensorDef] = &[
    TensorDef::new(
        TensorId::SsmBeta,
        "ssm_beta.weight",
        &[Dim::Embd, Dim::VHeads],
        Role::LinearAttention,
        When::DeltaNet,
        QuantRule::Weight,
    ),
    TensorDef::new(
        TensorId::SsmAlpha,
        "ssm_alpha.weight",
        &[Dim::Embd, Dim::VHeads],
        Role::LinearAttention,
        When::DeltaNet,
        QuantRule::Weight,
    ),
];

pub(crate) static TABLE: ArchTable = ArchTable {
    arch: Arch::Qwen35Moe,
    trunk: TRUNK,
    block: &[
        &[ATTN_NORM, POST_ATTENTION_NORM],
        ATTENTION,
        DELTANET,
        BETA_ALPHA,
        MOE,
        SHARED_EXPERT,
        NEXTN,
    ],
    refused: &[FUSED_GATE_UP],
    gated_attention: true,
    tiled_v_heads: true,
};
