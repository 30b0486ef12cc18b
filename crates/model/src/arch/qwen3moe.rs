//! Qwen3-MoE (`qwen3moe`): every layer is GQA attention with per-head q/k RMSNorm
//! and full-width NeoX RoPE, followed by routed experts (no shared expert).
//! Norms are plain RMSNorm (the HF checkpoint is not zero-centred, so the
//! converter shifts nothing). The pre-FFN norm is `ffn_norm`.

use crate::config::Arch;
use crate::tensors::{
    ArchTable, Dim, QuantRule, Role, TensorDef, TensorId, When, ATTENTION, ATTN_NORM,
    FUSED_GATE_UP, MOE, TRUNK,
};

/// The pre-FFN norm, under its qwen3moe name.
const FFN_NORM: TensorDef = TensorDef::new(
    TensorId::FfnNorm,
    "ffn_norm.weight",
    &[Dim::Embd],
    Role::Norm,
    When::Always,
    QuantRule::KeepF32,
);

pub(crate) static TABLE: ArchTable = ArchTable {
    arch: Arch::Qwen3Moe,
    trunk: TRUNK,
    block: &[&[ATTN_NORM, FFN_NORM], ATTENTION, MOE],
    refused: &[FUSED_GATE_UP],
    gated_attention: false,
    tiled_v_heads: false,
};
