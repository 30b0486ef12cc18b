//! Hyperparameters read from GGUF metadata, for every supported architecture.
//!
//! Keys are the ones llama.cpp's converter writes (`{arch}.block_count`, ...).
//! A missing required key is an error that names it; nothing is guessed except
//! where the converter itself leaves a key out and llama.cpp applies a default
//! (noted at each such place).

use crate::ModelError;
use gguf::{GgufFile, Value};

/// The architectures this engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B, Coder): GQA attention, routed experts only.
    Qwen3Moe,
    /// Qwen3-Next-80B-A3B: gated DeltaNet ×3 + gated attention ×1, shared expert.
    Qwen3Next,
    /// Qwen3.5 / 3.6 MoE: as Qwen3-Next, with V heads stored in tiled order.
    Qwen35Moe,
}

impl Arch {
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "qwen3moe" => Some(Arch::Qwen3Moe),
            "qwen3next" => Some(Arch::Qwen3Next),
            "qwen35moe" => Some(Arch::Qwen35Moe),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen3Next => "qwen3next",
            Arch::Qwen35Moe => "qwen35moe",
        }
    }
    /// The hybrid archs alternate gated DeltaNet and gated attention layers.
    pub fn is_hybrid(self) -> bool {
        !matches!(self, Arch::Qwen3Moe)
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which mixer a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Attention,
    DeltaNet,
}

/// The linear-attention (gated DeltaNet) geometry of the hybrid archs.
#[derive(Debug, Clone, PartialEq)]
pub struct SsmConfig {
    /// Causal conv kernel width (4).
    pub d_conv: usize,
    /// Key head dim = value head dim (`ssm.state_size`).
    pub d_state: usize,
    /// Key heads (`ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads (`ssm.time_step_rank`).
    pub n_v_heads: usize,
    /// Value heads are stored tiled (v head h uses k head h % Hk, qwen35 GGUFs)
    /// rather than grouped (h uses h / (Hv/Hk), HF and qwen3next GGUFs).
    pub tiled_v_heads: bool,
}

impl SsmConfig {
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.d_state
    }
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.d_state
    }
    /// Channels through the conv: [q | k | v].
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// The key head that value head `h` reads.
    pub fn k_head_of(&self, h: usize) -> usize {
        if self.tiled_v_heads {
            h % self.n_k_heads
        } else {
            h / (self.n_v_heads / self.n_k_heads)
        }
    }
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    /// Trunk layers (without MTP/NextN layers).
    pub n_layer: usize,
    /// MTP/NextN layers stored after the trunk (kept for speculative decoding).
    pub n_nextn: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Attention head dim (`attention.key_length`); never hidden / heads.
    pub head_dim: usize,
    /// Rotated dims per head (NeoX pairing).
    pub n_rot: usize,
    pub rope_theta: f32,
    /// `rope.dimension_sections` (qwen35moe): how many rotary pairs take the (t, h, w)
    /// positions of multimodal rotary embeddings, interleaved. Text gives every section
    /// the same position, where this is plain rotary.
    pub rope_sections: Option<[usize; 4]>,
    pub eps: f32,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    /// Shared expert width (0: none).
    pub n_ff_shexp: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    /// Attention output is gated by sigmoid(gate) (hybrids).
    pub attn_output_gate: bool,
    pub ssm: Option<SsmConfig>,
    pub layer_kinds: Vec<LayerKind>,
}

/// Metadata lookup: a file's, or the list a geometry writes.
type Meta<'m, 'a> = &'m dyn Fn(&str) -> Option<&'a Value>;

fn req(f: Meta, key: &str) -> Result<u64, ModelError> {
    f(key)
        .and_then(|v| v.as_u64())
        .ok_or_else(|| ModelError::Metadata {
            key: key.to_string(),
            msg: match f(key) {
                None => "missing".to_string(),
                Some(v) => format!("expected a non-negative integer, found {v:?}"),
            },
        })
}

fn req_usize(f: Meta, key: &str) -> Result<usize, ModelError> {
    let v = req(f, key)?;
    // Generous sanity bound: no real dimension comes near it, and it keeps
    // products of dimensions far from overflowing.
    if v > (1 << 31) {
        return Err(ModelError::Metadata {
            key: key.to_string(),
            msg: format!("value {v} is implausibly large"),
        });
    }
    Ok(v as usize)
}

fn opt_f32(f: Meta, key: &str) -> Option<f32> {
    f(key).and_then(|v| v.as_f64()).map(|v| v as f32)
}

impl ModelConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig, ModelError> {
        Self::from_metadata(|k: &str| f.get(k))
    }

    /// The config described by GGUF metadata `get` (a file's, or the keys a
    /// [`Geometry`](crate::geometry::Geometry) writes): the one place hyperparameters
    /// are derived.
    pub fn from_metadata<'a>(
        get: impl Fn(&str) -> Option<&'a Value>,
    ) -> Result<ModelConfig, ModelError> {
        Self::parse(&get)
    }

    fn parse(f: Meta) -> Result<ModelConfig, ModelError> {
        let arch_name = f("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| ModelError::Metadata {
                key: "general.architecture".into(),
                msg: "missing".into(),
            })?
            .to_string();
        let arch = Arch::from_name(&arch_name)
            .ok_or_else(|| ModelError::UnsupportedArch(arch_name.clone()))?;
        let facts = crate::tensors::table(arch);
        let k = |s: &str| format!("{arch_name}.{s}");

        let block_count = req_usize(f, &k("block_count"))?;
        let n_nextn = f(&k("nextn_predict_layers"))
            .and_then(|v| v.as_u64())
            .unwrap_or(0) as usize;
        if n_nextn >= block_count {
            return Err(ModelError::Metadata {
                key: k("nextn_predict_layers"),
                msg: format!("{n_nextn} is not smaller than block_count {block_count}"),
            });
        }
        let n_layer = block_count - n_nextn;
        let n_embd = req_usize(f, &k("embedding_length"))?;
        let n_head = req_usize(f, &k("attention.head_count"))?;
        let n_head_kv = req_usize(f, &k("attention.head_count_kv"))?;
        // llama.cpp defaults key_length to n_embd / n_head when absent.
        let head_dim = match f(&k("attention.key_length")) {
            Some(_) => req_usize(f, &k("attention.key_length"))?,
            None => n_embd / n_head.max(1),
        };
        let n_rot = match f(&k("rope.dimension_count")) {
            Some(_) => req_usize(f, &k("rope.dimension_count"))?,
            None => head_dim,
        };
        let rope_theta = opt_f32(f, &k("rope.freq_base")).unwrap_or(10000.0);
        let rope_sections = match f(&k("rope.dimension_sections")) {
            None => None,
            Some(v) => {
                let bad = || ModelError::Metadata {
                    key: k("rope.dimension_sections"),
                    msg: format!("expected an array of 4 non-negative integers, found {v:?}"),
                };
                let a = v.as_array().ok_or_else(bad)?;
                let mut out = [0usize; 4];
                if a.len() != 4 {
                    return Err(bad());
                }
                for (o, x) in out.iter_mut().zip(a) {
                    *o = x.as_u64().ok_or_else(bad)? as usize;
                }
                Some(out)
            }
        };
        let eps = opt_f32(f, &k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6);
        let n_expert = req_usize(f, &k("expert_count"))?;
        let n_expert_used = req_usize(f, &k("expert_used_count"))?;
        let n_ff_exp = req_usize(f, &k("expert_feed_forward_length"))?;
        let n_ff_shexp = f(&k("expert_shared_feed_forward_length"))
            .and_then(|v| v.as_u64())
            .unwrap_or(0) as usize;
        let n_ctx_train = f(&k("context_length"))
            .and_then(|v| v.as_u64())
            .unwrap_or(4096) as usize;
        let n_vocab = f("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map(|a| a.len())
            .or_else(|| {
                f(&k("vocab_size"))
                    .and_then(|v| v.as_u64())
                    .map(|v| v as usize)
            })
            .unwrap_or(0);

        let bad = |key: String, msg: String| ModelError::Metadata { key, msg };
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(bad(
                k("attention.head_count_kv"),
                format!("{n_head_kv} must divide head_count {n_head}"),
            ));
        }
        if n_rot > head_dim || !n_rot.is_multiple_of(2) {
            return Err(bad(
                k("rope.dimension_count"),
                format!("{n_rot} must be even and at most key_length {head_dim}"),
            ));
        }
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(bad(
                k("expert_used_count"),
                format!("{n_expert_used} must be in 1..={n_expert}"),
            ));
        }

        let (ssm, layer_kinds) = if arch.is_hybrid() {
            let ssm = SsmConfig {
                d_conv: req_usize(f, &k("ssm.conv_kernel"))?,
                d_state: req_usize(f, &k("ssm.state_size"))?,
                n_k_heads: req_usize(f, &k("ssm.group_count"))?,
                n_v_heads: req_usize(f, &k("ssm.time_step_rank"))?,
                tiled_v_heads: facts.tiled_v_heads,
            };
            if ssm.n_k_heads == 0 || !ssm.n_v_heads.is_multiple_of(ssm.n_k_heads) {
                return Err(bad(
                    k("ssm.time_step_rank"),
                    format!(
                        "{} value heads must be a multiple of {} key heads",
                        ssm.n_v_heads, ssm.n_k_heads
                    ),
                ));
            }
            if ssm.d_conv < 1 {
                return Err(bad(k("ssm.conv_kernel"), "must be at least 1".into()));
            }
            if let Some(inner) = f(&k("ssm.inner_size")).and_then(|v| v.as_u64()) {
                if inner as usize != ssm.value_dim() {
                    return Err(bad(
                        k("ssm.inner_size"),
                        format!(
                            "{inner} != time_step_rank × state_size = {}",
                            ssm.value_dim()
                        ),
                    ));
                }
            }
            // The converter never writes `attention.recurrent_layers`; llama.cpp then
            // derives the pattern from full_attention_interval (default 4).
            let interval = f(&k("full_attention_interval"))
                .and_then(|v| v.as_u64())
                .unwrap_or(4)
                .max(1) as usize;
            let kinds = (0..n_layer)
                .map(|i| {
                    if (i + 1) % interval == 0 {
                        LayerKind::Attention
                    } else {
                        LayerKind::DeltaNet
                    }
                })
                .collect();
            (Some(ssm), kinds)
        } else {
            (None, vec![LayerKind::Attention; n_layer])
        };

        Ok(ModelConfig {
            arch,
            n_layer,
            n_nextn,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_theta,
            rope_sections,
            eps,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
            n_vocab,
            n_ctx_train,
            attn_output_gate: facts.gated_attention,
            ssm,
            layer_kinds,
        })
    }

    pub fn n_attention_layers(&self) -> usize {
        self.layer_kinds
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count()
    }

    // A sequence's state as every executor keeps it, in f32: the memory accounts at
    // startup count with these. Each saturates at `usize::MAX` instead of wrapping: a
    // context too large to count is too large to allocate, and the memory checks then
    // refuse it (a wrapped product used to pass them and fail in the allocator).

    /// Bytes one position of one sequence takes: K and V (f32) of every attention
    /// layer. A sequence's K/V memory is this times its allocated positions.
    pub fn kv_bytes_per_position(&self) -> usize {
        product(&[
            self.n_attention_layers(),
            2,
            self.n_head_kv,
            self.head_dim,
            4,
        ])
    }

    /// Bytes of one sequence's fixed recurrent state (f32 conv history and DeltaNet
    /// state of every DeltaNet layer), held whatever its length; 0 for archs without
    /// DeltaNet layers.
    pub fn recurrent_state_bytes(&self) -> usize {
        match &self.ssm {
            Some(s) => {
                let n = self
                    .layer_kinds
                    .iter()
                    .filter(|k| **k == LayerKind::DeltaNet)
                    .count();
                let per_layer = product(&[s.conv_dim(), s.d_conv.saturating_sub(1)])
                    .saturating_add(product(&[s.n_v_heads, s.d_state, s.d_state]));
                product(&[n, per_layer, 4])
            }
            None => 0,
        }
    }

    /// Bytes a sequence of `n_ctx` positions needs at most: every position allocated
    /// plus the recurrent state.
    pub fn seq_state_bytes(&self, n_ctx: usize) -> usize {
        self.kv_bytes_per_position()
            .saturating_mul(n_ctx)
            .saturating_add(self.recurrent_state_bytes())
    }
}

/// The product of `xs`, saturating.
fn product(xs: &[usize]) -> usize {
    xs.iter().fold(1usize, |acc, &x| acc.saturating_mul(x))
}
