//! The tensor inventory of every arch, described once.
//!
//! Each arch file (`arch/*.rs`) holds an [`ArchTable`]: the tensors outside the blocks
//! (`token_embd.weight`, ...) and the tensors of a block (`blk.{i}.attn_q.weight`, ...),
//! each with its GGUF name, its shape as a function of the [`ModelConfig`] (ggml order,
//! `dims[0]` the row length), its [`Role`], the blocks that carry it ([`When`]), whether a
//! file may leave it out, and the rule `llama-quantize` applies to it ([`QuantRule`]).
//!
//! Every reader of the inventory goes through this table: the loader
//! ([`ModelWeights::load`](crate::weights::ModelWeights::load)), the synthetic-model
//! writer ([`synth`](crate::synth)), the byte accounting `scoria inspect` prints, and the
//! expert store (routed experts by [`Role::RoutedExpert`]). The same tensor has the same
//! name, shape and role in every arch that has it; the arch tables differ in which tensors
//! they list (unit-tested below).

use crate::config::{Arch, LayerKind, ModelConfig};

/// What a tensor is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// `token_embd`.
    Embedding,
    /// The LM head (`output`).
    Output,
    /// The final norm before the head.
    OutputNorm,
    /// A norm weight inside a block (pre-mixer, pre-FFN, q/k, the DeltaNet gated norm).
    Norm,
    /// Full (softmax) attention projections.
    Attention,
    /// Gated DeltaNet projections and parameters.
    LinearAttention,
    /// The MoE router (`ffn_gate_inp`).
    Router,
    /// The shared expert's FFN matrices.
    SharedExpert,
    /// The shared expert's scalar sigmoid gate (`ffn_gate_inp_shexp`).
    SharedExpertGate,
    /// One matrix of every routed expert of a block ({.., .., n_expert}): the bytes an
    /// expert store tiers.
    RoutedExpert(ExpertMatrix),
    /// The MTP (NextN) block's own tensors (`nextn.*`); the rest of an MTP block has the
    /// roles of an ordinary block.
    Mtp,
}

/// Which matrix of a routed expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertMatrix {
    /// {n_embd, n_ff_exp, n_expert}.
    Gate,
    /// {n_embd, n_ff_exp, n_expert}.
    Up,
    /// {n_ff_exp, n_embd, n_expert}.
    Down,
}

impl Role {
    /// The role of a tensor named `name` in a file of any supported arch (`blk.{i}.` is
    /// stripped); `None` for a name no arch table lists. The same name has the same role
    /// in every arch that has it.
    pub fn of(name: &str) -> Option<Role> {
        ALL_TABLES
            .iter()
            .find_map(|t| t.find(name))
            .map(|(_, d)| d.role)
    }

    /// Routed-expert data (what an expert store tiers), MTP blocks' experts included.
    pub fn is_routed_expert(self) -> bool {
        matches!(self, Role::RoutedExpert(_))
    }
}

/// Whether the tensor named `name` holds routed experts (see [`Role::of`]).
pub fn is_routed_expert(name: &str) -> bool {
    Role::of(name).is_some_and(Role::is_routed_expert)
}

/// One dimension of a tensor, in terms of the model's hyperparameters. Linear-attention
/// dimensions are 0 in a config without `ssm` (no block of such a model carries them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// n_embd.
    Embd,
    /// 2·n_embd (the MTP block's `eh_proj` input: [embedding | hidden]).
    TwoEmbd,
    /// Rows of `token_embd` / `output`.
    Vocab,
    /// Attention head dim.
    HeadDim,
    /// n_head·head_dim, doubled when the attention output is gated (per head [q | gate]).
    QOut,
    /// n_head·head_dim: the input of `attn_output`.
    AttnOut,
    /// n_head_kv·head_dim.
    KvOut,
    /// n_expert.
    Experts,
    /// Routed expert FFN width.
    ExpertFf,
    /// Shared expert FFN width.
    SharedFf,
    /// Causal conv taps (`ssm.conv_kernel`).
    ConvKernel,
    /// Channels through the conv: [q | k | v] = 2·Hk·d + Hv·d.
    ConvDim,
    /// Hv·d: the value block, z, and `ssm_out`'s input.
    ValueDim,
    /// Hv, value heads.
    VHeads,
    /// 2·Hv (qwen3next's fused β/α projection).
    TwoVHeads,
    /// d, the DeltaNet head dim (`ssm.state_size`).
    StateSize,
}

impl Dim {
    pub fn size(self, c: &ModelConfig) -> usize {
        let ssm = |f: fn(&crate::config::SsmConfig) -> usize| c.ssm.as_ref().map_or(0, f);
        match self {
            Dim::Embd => c.n_embd,
            Dim::TwoEmbd => 2 * c.n_embd,
            Dim::Vocab => c.n_vocab,
            Dim::HeadDim => c.head_dim,
            Dim::QOut => c.n_head * c.head_dim * if c.attn_output_gate { 2 } else { 1 },
            Dim::AttnOut => c.n_head * c.head_dim,
            Dim::KvOut => c.n_head_kv * c.head_dim,
            Dim::Experts => c.n_expert,
            Dim::ExpertFf => c.n_ff_exp,
            Dim::SharedFf => c.n_ff_shexp,
            Dim::ConvKernel => ssm(|s| s.d_conv),
            Dim::ConvDim => ssm(|s| s.conv_dim()),
            Dim::ValueDim => ssm(|s| s.value_dim()),
            Dim::VHeads => ssm(|s| s.n_v_heads),
            Dim::TwoVHeads => ssm(|s| 2 * s.n_v_heads),
            Dim::StateSize => ssm(|s| s.d_state),
        }
    }
}

/// Which blocks carry a block tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Every block.
    Always,
    /// Full-attention layers and MTP blocks (which are full attention).
    Attention,
    /// Gated DeltaNet layers.
    DeltaNet,
    /// MTP (NextN) blocks only.
    Nextn,
    /// Every block, when the model has a shared expert (`n_ff_shexp > 0`).
    SharedExpert,
}

/// What a block is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// A trunk layer.
    Layer(LayerKind),
    /// An MTP (NextN) block stored after the trunk: full attention, MoE, and `nextn.*`.
    Nextn,
}

impl BlockKind {
    /// Block `i` of `cfg` (trunk layers first, then `n_nextn` MTP blocks).
    pub fn of(cfg: &ModelConfig, i: usize) -> BlockKind {
        match cfg.layer_kinds.get(i) {
            Some(&k) => BlockKind::Layer(k),
            None => BlockKind::Nextn,
        }
    }
}

impl When {
    pub fn applies(self, kind: BlockKind, cfg: &ModelConfig) -> bool {
        match self {
            When::Always => true,
            When::Attention => matches!(
                kind,
                BlockKind::Layer(LayerKind::Attention) | BlockKind::Nextn
            ),
            When::DeltaNet => kind == BlockKind::Layer(LayerKind::DeltaNet),
            When::Nextn => kind == BlockKind::Nextn,
            When::SharedExpert => cfg.n_ff_shexp > 0,
        }
    }
}

/// The type llama.cpp's converter and `llama-quantize` give a tensor, by class (the
/// presets in `synth` turn a class into a type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantRule {
    /// The converter writes it F32 whatever the outtype (1-D tensors, norms, routers,
    /// `ssm_conv1d`) and `llama-quantize` leaves it alone.
    KeepF32,
    /// A matrix at the file type's base type (Q4_K in Q4_K_M).
    Weight,
    /// The LM head (Q6_K in Q4_K_M).
    Output,
    /// `attn_v` and `attn_qkv`: Q6_K in Q4_K_M where `use_more_bits` holds, counting
    /// these tensors in file order.
    AttnV,
    /// `ffn_down*`: Q6_K in Q4_K_M on the blocks where `use_more_bits` holds.
    FfnDown,
}

/// Which tensor, as the forward pass knows it. The GGUF name may differ by arch (the
/// pre-FFN norm is `ffn_norm` in qwen3moe, `post_attention_norm` in the hybrids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorId {
    TokenEmbd,
    OutputNorm,
    Output,
    AttnNorm,
    /// The norm before the MoE block.
    FfnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    AttnQNorm,
    AttnKNorm,
    /// DeltaNet [q | k | v] projection.
    AttnQkv,
    /// DeltaNet output gate z.
    AttnGate,
    /// Fused β/α (qwen3next).
    SsmBa,
    SsmBeta,
    SsmAlpha,
    SsmConv1d,
    SsmA,
    SsmDtBias,
    SsmNorm,
    SsmOut,
    FfnGateInp,
    FfnGateExps,
    FfnUpExps,
    FfnDownExps,
    FfnGateInpShexp,
    FfnGateShexp,
    FfnUpShexp,
    FfnDownShexp,
    NextnEhProj,
    NextnEnorm,
    NextnHnorm,
    NextnSharedHeadNorm,
}

/// One tensor of an arch's inventory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TensorDef {
    pub id: TensorId,
    /// GGUF name; block tensors are stored as `blk.{i}.{name}`.
    pub name: &'static str,
    /// ggml order (`shape[0]` is the row length).
    pub shape: &'static [Dim],
    pub role: Role,
    /// Which blocks carry it (ignored for trunk tensors).
    pub when: When,
    /// A file may leave it out (`output.weight`: the head is then `token_embd`).
    pub optional: bool,
    pub quant: QuantRule,
}

impl TensorDef {
    pub const fn new(
        id: TensorId,
        name: &'static str,
        shape: &'static [Dim],
        role: Role,
        when: When,
        quant: QuantRule,
    ) -> TensorDef {
        TensorDef {
            id,
            name,
            shape,
            role,
            when,
            optional: false,
            quant,
        }
    }

    pub const fn optional(self) -> TensorDef {
        TensorDef {
            optional: true,
            ..self
        }
    }

    /// The shape in `cfg` (ggml order).
    pub fn dims(&self, cfg: &ModelConfig) -> Vec<usize> {
        self.shape.iter().map(|d| d.size(cfg)).collect()
    }

    /// The GGUF name in block `block` (`None`: a trunk tensor).
    pub fn name_in(&self, block: Option<usize>) -> String {
        match block {
            Some(i) => format!("blk.{i}.{}", self.name),
            None => self.name.to_string(),
        }
    }
}

/// A block tensor name this engine refuses, with the remedy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub name: &'static str,
    pub why: &'static str,
}

/// One arch's inventory and the facts about it the config needs.
#[derive(Debug)]
pub struct ArchTable {
    pub arch: Arch,
    /// Tensors outside the blocks.
    pub trunk: &'static [TensorDef],
    /// Tensors of a block, in groups (shared groups from this module and the arch's own).
    pub block: &'static [&'static [TensorDef]],
    /// Block tensors that make a file unusable here (checked in every trunk layer).
    pub refused: &'static [Refused],
    /// The attention output is gated by sigmoid(gate), so `attn_q` is twice as wide.
    pub gated_attention: bool,
    /// Value heads are stored tiled (v head h reads k head h % Hk) rather than grouped.
    pub tiled_v_heads: bool,
}

/// One tensor of a concrete model: name, shape and its entry in the table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInstance {
    pub name: String,
    /// ggml order.
    pub dims: Vec<usize>,
    /// `Some(i)` for `blk.{i}.*`.
    pub block: Option<usize>,
    pub def: &'static TensorDef,
}

impl ArchTable {
    /// Every block tensor of the arch.
    pub fn block_defs(&self) -> impl Iterator<Item = &'static TensorDef> + '_ {
        self.block.iter().flat_map(|g| g.iter())
    }

    /// The entry for `id`, if this arch has that tensor.
    pub fn def(&self, id: TensorId) -> Option<&'static TensorDef> {
        self.trunk
            .iter()
            .chain(self.block_defs())
            .find(|d| d.id == id)
    }

    /// The entry a GGUF name refers to, with its block index.
    pub fn find(&self, name: &str) -> Option<(Option<usize>, &'static TensorDef)> {
        match block_of(name) {
            Some(b) => {
                let leaf = name.strip_prefix(&format!("blk.{b}."))?;
                let d = self.block_defs().find(|d| d.name == leaf)?;
                Some((Some(b as usize), d))
            }
            None => self
                .trunk
                .iter()
                .find(|d| d.name == name)
                .map(|d| (None, d)),
        }
    }

    /// Every tensor a file of `cfg` holds (optional ones included): the trunk, then each
    /// block (`n_layer` trunk layers, then `n_nextn` MTP blocks) in table order.
    pub fn instances(&self, cfg: &ModelConfig) -> Vec<TensorInstance> {
        let mut out: Vec<TensorInstance> = self
            .trunk
            .iter()
            .map(|d| TensorInstance {
                name: d.name.to_string(),
                dims: d.dims(cfg),
                block: None,
                def: d,
            })
            .collect();
        for i in 0..cfg.n_layer + cfg.n_nextn {
            let kind = BlockKind::of(cfg, i);
            for d in self.block_defs().filter(|d| d.when.applies(kind, cfg)) {
                out.push(TensorInstance {
                    name: d.name_in(Some(i)),
                    dims: d.dims(cfg),
                    block: Some(i),
                    def: d,
                });
            }
        }
        out
    }
}

/// The table of `arch`.
pub fn table(arch: Arch) -> &'static ArchTable {
    match arch {
        Arch::Qwen3Moe => &crate::arch::qwen3moe::TABLE,
        Arch::Qwen3Next => &crate::arch::qwen3next::TABLE,
        Arch::Qwen35Moe => &crate::arch::qwen35moe::TABLE,
    }
}

const ALL_TABLES: [&ArchTable; 3] = [
    &crate::arch::qwen3next::TABLE,
    &crate::arch::qwen35moe::TABLE,
    &crate::arch::qwen3moe::TABLE,
];

/// Block index of a tensor name (`blk.N.`), as llama.cpp parses it.
pub fn block_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("blk.")?;
    let end = rest.find('.')?;
    rest[..end].parse().ok()
}

// The groups of tensors the arch tables share. Names and shapes follow what llama.cpp's
// converter writes for each arch (checked against its output by the parity fixtures).

use Dim as D;
use QuantRule as Q;
use Role as R;
use TensorId as T;

/// `token_embd`, `output_norm`, `output` (every arch).
pub const TRUNK: &[TensorDef] = &[
    TensorDef::new(
        T::TokenEmbd,
        "token_embd.weight",
        &[D::Embd, D::Vocab],
        R::Embedding,
        When::Always,
        Q::Weight,
    ),
    TensorDef::new(
        T::OutputNorm,
        "output_norm.weight",
        &[D::Embd],
        R::OutputNorm,
        When::Always,
        Q::KeepF32,
    ),
    TensorDef::new(
        T::Output,
        "output.weight",
        &[D::Embd, D::Vocab],
        R::Output,
        When::Always,
        Q::Output,
    )
    .optional(),
];

/// The pre-mixer norm.
pub const ATTN_NORM: TensorDef = TensorDef::new(
    T::AttnNorm,
    "attn_norm.weight",
    &[D::Embd],
    R::Norm,
    When::Always,
    Q::KeepF32,
);

/// The hybrids' pre-FFN norm (HF `post_attention_layernorm`).
pub const POST_ATTENTION_NORM: TensorDef = TensorDef::new(
    T::FfnNorm,
    "post_attention_norm.weight",
    &[D::Embd],
    R::Norm,
    When::Always,
    Q::KeepF32,
);

/// GQA attention with per-head q/k RMSNorm (gated in the hybrids: see [`Dim::QOut`]).
pub const ATTENTION: &[TensorDef] = &[
    TensorDef::new(
        T::AttnQ,
        "attn_q.weight",
        &[D::Embd, D::QOut],
        R::Attention,
        When::Attention,
        Q::Weight,
    ),
    TensorDef::new(
        T::AttnK,
        "attn_k.weight",
        &[D::Embd, D::KvOut],
        R::Attention,
        When::Attention,
        Q::Weight,
    ),
    TensorDef::new(
        T::AttnV,
        "attn_v.weight",
        &[D::Embd, D::KvOut],
        R::Attention,
        When::Attention,
        Q::AttnV,
    ),
    TensorDef::new(
        T::AttnOutput,
        "attn_output.weight",
        &[D::AttnOut, D::Embd],
        R::Attention,
        When::Attention,
        Q::Weight,
    ),
    TensorDef::new(
        T::AttnQNorm,
        "attn_q_norm.weight",
        &[D::HeadDim],
        R::Norm,
        When::Attention,
        Q::KeepF32,
    ),
    TensorDef::new(
        T::AttnKNorm,
        "attn_k_norm.weight",
        &[D::HeadDim],
        R::Norm,
        When::Attention,
        Q::KeepF32,
    ),
];

/// Gated DeltaNet, without β/α (each hybrid stores those its own way).
pub const DELTANET: &[TensorDef] = &[
    TensorDef::new(
        T::AttnQkv,
        "attn_qkv.weight",
        &[D::Embd, D::ConvDim],
        R::LinearAttention,
        When::DeltaNet,
        Q::AttnV,
    ),
    TensorDef::new(
        T::AttnGate,
        "attn_gate.weight",
        &[D::Embd, D::ValueDim],
        R::LinearAttention,
        When::DeltaNet,
        Q::Weight,
    ),
    TensorDef::new(
        T::SsmConv1d,
        "ssm_conv1d.weight",
        &[D::ConvKernel, D::ConvDim],
        R::LinearAttention,
        When::DeltaNet,
        Q::KeepF32,
    ),
    // −exp(A_log), per value head.
    TensorDef::new(
        T::SsmA,
        "ssm_a",
        &[D::VHeads],
        R::LinearAttention,
        When::DeltaNet,
        Q::KeepF32,
    ),
    TensorDef::new(
        T::SsmDtBias,
        "ssm_dt.bias",
        &[D::VHeads],
        R::LinearAttention,
        When::DeltaNet,
        Q::KeepF32,
    ),
    // The gated RMSNorm over one head (not +1-shifted).
    TensorDef::new(
        T::SsmNorm,
        "ssm_norm.weight",
        &[D::StateSize],
        R::Norm,
        When::DeltaNet,
        Q::KeepF32,
    ),
    TensorDef::new(
        T::SsmOut,
        "ssm_out.weight",
        &[D::ValueDim, D::Embd],
        R::LinearAttention,
        When::DeltaNet,
        Q::Weight,
    ),
];

/// Router and routed experts (every arch).
pub const MOE: &[TensorDef] = &[
    TensorDef::new(
        T::FfnGateInp,
        "ffn_gate_inp.weight",
        &[D::Embd, D::Experts],
        R::Router,
        When::Always,
        Q::KeepF32,
    ),
    TensorDef::new(
        T::FfnGateExps,
        "ffn_gate_exps.weight",
        &[D::Embd, D::ExpertFf, D::Experts],
        R::RoutedExpert(ExpertMatrix::Gate),
        When::Always,
        Q::Weight,
    ),
    TensorDef::new(
        T::FfnUpExps,
        "ffn_up_exps.weight",
        &[D::Embd, D::ExpertFf, D::Experts],
        R::RoutedExpert(ExpertMatrix::Up),
        When::Always,
        Q::Weight,
    ),
    TensorDef::new(
        T::FfnDownExps,
        "ffn_down_exps.weight",
        &[D::ExpertFf, D::Embd, D::Experts],
        R::RoutedExpert(ExpertMatrix::Down),
        When::Always,
        Q::FfnDown,
    ),
];

/// The sigmoid-gated shared expert (the hybrids).
pub const SHARED_EXPERT: &[TensorDef] = &[
    // Stored {n_embd} or {n_embd, 1}; the loader accepts both.
    TensorDef::new(
        T::FfnGateInpShexp,
        "ffn_gate_inp_shexp.weight",
        &[D::Embd],
        R::SharedExpertGate,
        When::SharedExpert,
        Q::KeepF32,
    ),
    TensorDef::new(
        T::FfnGateShexp,
        "ffn_gate_shexp.weight",
        &[D::Embd, D::SharedFf],
        R::SharedExpert,
        When::SharedExpert,
        Q::Weight,
    ),
    TensorDef::new(
        T::FfnUpShexp,
        "ffn_up_shexp.weight",
        &[D::Embd, D::SharedFf],
        R::SharedExpert,
        When::SharedExpert,
        Q::Weight,
    ),
    TensorDef::new(
        T::FfnDownShexp,
        "ffn_down_shexp.weight",
        &[D::SharedFf, D::Embd],
        R::SharedExpert,
        When::SharedExpert,
        Q::FfnDown,
    ),
];

/// An MTP block's own tensors (HF `mtp.fc`, `pre_fc_norm_embedding`,
/// `pre_fc_norm_hidden`, `mtp.norm`); the rest of the block is an ordinary attention
/// block.
pub const NEXTN: &[TensorDef] = &[
    TensorDef::new(
        T::NextnEhProj,
        "nextn.eh_proj.weight",
        &[D::TwoEmbd, D::Embd],
        R::Mtp,
        When::Nextn,
        Q::Weight,
    ),
    TensorDef::new(
        T::NextnEnorm,
        "nextn.enorm.weight",
        &[D::Embd],
        R::Mtp,
        When::Nextn,
        Q::KeepF32,
    ),
    TensorDef::new(
        T::NextnHnorm,
        "nextn.hnorm.weight",
        &[D::Embd],
        R::Mtp,
        When::Nextn,
        Q::KeepF32,
    ),
    TensorDef::new(
        T::NextnSharedHeadNorm,
        "nextn.shared_head_norm.weight",
        &[D::Embd],
        R::Mtp,
        When::Nextn,
        Q::KeepF32,
    ),
];

/// Fused gate/up expert tensors (the converter's `fuse_gate_up_exps` option).
pub const FUSED_GATE_UP: Refused = Refused {
    name: "ffn_gate_up_exps.weight",
    why: "fused gate/up expert tensors are not supported yet; convert without fusing",
};

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn a_name_means_the_same_tensor_in_every_arch() {
        let mut seen: HashMap<&str, &TensorDef> = HashMap::new();
        for t in ALL_TABLES {
            for d in t.trunk.iter().chain(t.block_defs()) {
                if let Some(prev) = seen.insert(d.name, d) {
                    assert_eq!(prev, d, "{} differs between arch tables", d.name);
                }
            }
        }
    }

    #[test]
    fn each_table_names_each_tensor_once() {
        for t in ALL_TABLES {
            let mut names: Vec<&str> = t
                .trunk
                .iter()
                .chain(t.block_defs())
                .map(|d| d.name)
                .collect();
            let mut ids: Vec<String> = t
                .trunk
                .iter()
                .chain(t.block_defs())
                .map(|d| format!("{:?}", d.id))
                .collect();
            let n = names.len();
            names.sort_unstable();
            names.dedup();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(names.len(), n, "{}: a name twice", t.arch);
            assert_eq!(ids.len(), n, "{}: an id twice", t.arch);
            assert_eq!(table(t.arch).arch, t.arch);
        }
    }

    #[test]
    fn roles_by_name() {
        assert_eq!(Role::of("token_embd.weight"), Some(Role::Embedding));
        assert_eq!(Role::of("output.weight"), Some(Role::Output));
        assert_eq!(Role::of("blk.7.ssm_ba.weight"), Some(Role::LinearAttention));
        assert_eq!(
            Role::of("blk.40.ffn_down_exps.weight"),
            Some(Role::RoutedExpert(ExpertMatrix::Down))
        );
        assert_eq!(
            Role::of("blk.0.ffn_gate_inp_shexp.weight"),
            Some(Role::SharedExpertGate)
        );
        assert_eq!(Role::of("blk.x.attn_q.weight"), None);
        assert_eq!(Role::of("rope_freqs.weight"), None);
        assert!(is_routed_expert("blk.3.ffn_up_exps.weight"));
        assert!(!is_routed_expert("blk.3.ffn_up_shexp.weight"));
        assert_eq!(block_of("blk.12.attn_q.weight"), Some(12));
        assert_eq!(block_of("output.weight"), None);
    }
}
