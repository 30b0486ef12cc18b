//! Named model geometries: every hyperparameter a GGUF of that shape carries.
//!
//! `scoria synth` writes a GGUF from a [`Geometry`]; tests and benchmarks name them
//! (`tiny-qwen35moe`, `qwen3.6-35b-a3b`, ...). The real geometries' numbers come from
//! the released configs (`config.json` of each checkpoint) as llama.cpp's converter
//! writes them to GGUF metadata.
//!
//! The tiny geometries keep every feature of their arch at a few MB of non-vocabulary
//! weights: hybrids have 8 layers (two of them full attention), twice as many value heads
//! as key heads in the linear attention, a head_dim that is not hidden/heads, partial
//! rotary and a shared expert; every row length is a multiple of 256 so K-quants apply.
//! They have 16 experts, not 8: llama-quantize special-cases 8-expert models (attn_v and
//! attn_k to Q8_0, attn_output to Q5_K), which no real checkpoint here is.

use gguf::{Value, ValueType};

pub use crate::config::Arch;
use crate::config::ModelConfig;
use crate::ModelError;

/// Every arch, in `--list` order.
pub const ARCHS: [Arch; 3] = [Arch::Qwen3Next, Arch::Qwen35Moe, Arch::Qwen3Moe];

/// Gated DeltaNet dimensions (hybrid archs only).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearAttention {
    /// Key (and query) heads, Hk (`ssm.group_count`).
    pub n_k_heads: u32,
    /// Value heads, Hv (`ssm.time_step_rank`); a multiple of `n_k_heads`.
    pub n_v_heads: u32,
    /// Head dim of keys and values alike (`ssm.state_size`; the GGUF has no separate
    /// value head dim, and `ssm.inner_size` = Hv · this).
    pub head_dim: u32,
    /// Causal depthwise conv kernel (`ssm.conv_kernel`).
    pub conv_kernel: u32,
}

/// Every hyperparameter of one model shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Geometry {
    /// The name `--geometry` takes (lower case).
    pub name: &'static str,
    pub arch: Arch,
    /// Trunk layers (llama.cpp's `n_layer()`), without MTP blocks.
    pub n_layer: u32,
    /// MTP (NextN) blocks stored after the trunk as `blk.{n_layer + i}`.
    pub n_nextn: u32,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    /// Attention head dim (`attention.key_length` = `value_length`); never inferred.
    pub head_dim: u32,
    /// Rotated dims per head (`rope.dimension_count`).
    pub n_rot: u32,
    pub rope_theta: f32,
    /// `rope.dimension_sections` (qwen35moe's interleaved M-RoPE).
    pub rope_sections: Option<[i32; 4]>,
    pub rms_eps: f32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    /// Routed expert FFN width (`expert_feed_forward_length`).
    pub expert_ff: u32,
    /// Shared expert FFN width (`expert_shared_feed_forward_length`); 0 = no shared expert.
    pub shared_ff: u32,
    /// `feed_forward_length`, written only when the HF config has `intermediate_size`
    /// (unused by these all-MoE models).
    pub dense_ff: Option<u32>,
    /// Every `full_attention_interval`-th layer is full attention (hybrids); 0 otherwise.
    pub full_attention_interval: u32,
    pub linear: Option<LinearAttention>,
    /// Rows of `token_embd` / `output` (the padded vocabulary).
    pub n_vocab: u32,
    pub context_length: u32,
}

impl Geometry {
    /// `{arch}.block_count`: trunk plus MTP blocks.
    pub fn block_count(&self) -> u32 {
        self.n_layer + self.n_nextn
    }

    /// The `{arch}.*` hyperparameter keys a GGUF of this geometry carries, in the order
    /// the converter writes them.
    pub fn hparams(&self) -> Vec<(String, Value)> {
        let a = self.arch.name();
        let k = |suffix: &str| format!("{a}.{suffix}");
        let mut kv: Vec<(String, Value)> = Vec::new();
        let mut put = |k: String, v: Value| kv.push((k, v));
        put(k("block_count"), Value::U32(self.block_count()));
        put(k("context_length"), Value::U32(self.context_length));
        put(k("embedding_length"), Value::U32(self.n_embd));
        if let Some(ff) = self.dense_ff {
            put(k("feed_forward_length"), Value::U32(ff));
        }
        put(k("attention.head_count"), Value::U32(self.n_head));
        put(k("attention.head_count_kv"), Value::U32(self.n_head_kv));
        put(k("rope.freq_base"), Value::F32(self.rope_theta));
        put(
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(self.rms_eps),
        );
        put(k("expert_used_count"), Value::U32(self.n_expert_used));
        put(k("attention.key_length"), Value::U32(self.head_dim));
        put(k("attention.value_length"), Value::U32(self.head_dim));
        put(k("expert_count"), Value::U32(self.n_expert));
        put(k("expert_feed_forward_length"), Value::U32(self.expert_ff));
        if self.shared_ff > 0 {
            put(
                k("expert_shared_feed_forward_length"),
                Value::U32(self.shared_ff),
            );
        }
        if self.arch.is_hybrid() {
            put(k("rope.dimension_count"), Value::U32(self.n_rot));
        }
        if let Some(sections) = self.rope_sections {
            put(
                k("rope.dimension_sections"),
                Value::Array(
                    ValueType::I32,
                    sections.iter().map(|&x| Value::I32(x)).collect(),
                ),
            );
        }
        if let Some(l) = &self.linear {
            put(k("ssm.conv_kernel"), Value::U32(l.conv_kernel));
            put(k("ssm.state_size"), Value::U32(l.head_dim));
            put(k("ssm.group_count"), Value::U32(l.n_k_heads));
            put(k("ssm.time_step_rank"), Value::U32(l.n_v_heads));
            put(k("ssm.inner_size"), Value::U32(l.n_v_heads * l.head_dim));
            put(
                k("full_attention_interval"),
                Value::U32(self.full_attention_interval),
            );
        }
        if self.n_nextn > 0 {
            put(k("nextn_predict_layers"), Value::U32(self.n_nextn));
        }
        kv
    }

    /// The config a file of this geometry gives: [`Geometry::hparams`] read by
    /// [`ModelConfig::from_metadata`], the same derivation the loader uses. (The
    /// vocabulary size comes from the tokenizer arrays in a file; here from `n_vocab`.)
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        let arch = Value::String(self.arch.name().to_string());
        let kv = self.hparams();
        let mut cfg = ModelConfig::from_metadata(|key: &str| match key {
            "general.architecture" => Some(&arch),
            _ => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
        })?;
        cfg.n_vocab = self.n_vocab as usize;
        Ok(cfg)
    }

    /// The vocabulary a synthetic model of this arch carries.
    pub fn vocab(&self) -> crate::vocab::QwenVocab {
        match self.arch {
            Arch::Qwen35Moe => crate::vocab::QwenVocab::Qwen35,
            Arch::Qwen3Next | Arch::Qwen3Moe => crate::vocab::QwenVocab::Qwen2,
        }
    }

    /// All named geometries, tiny ones first.
    pub fn all() -> Vec<Geometry> {
        vec![
            tiny_qwen3next(),
            tiny_qwen35moe(),
            tiny_qwen3moe(),
            qwen3_next_80b_a3b(),
            qwen36_35b_a3b(),
            qwen35_122b_a10b(),
            qwen35_397b_a17b(),
            qwen3_30b_a3b(),
        ]
    }

    /// Looks a geometry up by name (case-insensitive; aliases accepted). `tiny` needs the
    /// arch to pick one of the three tiny geometries; with an arch, a geometry of another
    /// arch is not returned.
    pub fn by_name(arch: Option<Arch>, name: &str) -> Option<Geometry> {
        let lower = name.to_ascii_lowercase();
        let lower = match lower.as_str() {
            "qwen3.5-35b-a3b" => "qwen3.6-35b-a3b".to_string(),
            _ => lower,
        };
        if lower == "tiny" {
            return match arch? {
                Arch::Qwen3Next => Some(tiny_qwen3next()),
                Arch::Qwen35Moe => Some(tiny_qwen35moe()),
                Arch::Qwen3Moe => Some(tiny_qwen3moe()),
            };
        }
        let g = Geometry::all().into_iter().find(|g| g.name == lower)?;
        match arch {
            Some(a) if a != g.arch => None,
            _ => Some(g),
        }
    }

    /// Names and aliases, with their arch, for `--help` and `--list`.
    pub fn names() -> Vec<(&'static str, Arch, &'static str)> {
        let mut v: Vec<(&'static str, Arch, &'static str)> = Geometry::all()
            .into_iter()
            .map(|g| (g.name, g.arch, g.description()))
            .collect();
        v.push((
            "qwen3.5-35b-a3b",
            Arch::Qwen35Moe,
            "alias of qwen3.6-35b-a3b (same geometry)",
        ));
        v.push((
            "tiny",
            Arch::Qwen35Moe,
            "with --arch: that arch's tiny geometry",
        ));
        v
    }

    fn description(&self) -> &'static str {
        match self.name {
            "tiny-qwen3next" => "8 layers, hidden 256, 16 experts top-4 + shared",
            "tiny-qwen35moe" => "8 layers + MTP, hidden 256, 16 experts top-4 + shared",
            "tiny-qwen3moe" => "4 layers, hidden 256, 16 experts top-4",
            "qwen3-next-80b-a3b" => "Qwen3-Next-80B-A3B: 48 layers, 512 experts top-10",
            "qwen3.6-35b-a3b" => "Qwen3.5/3.6-35B-A3B: 40 layers + MTP, 256 experts top-8",
            "qwen3.5-122b-a10b" => "Qwen3.5-122B-A10B: 48 layers + MTP, 256 experts top-8",
            "qwen3.5-397b-a17b" => "Qwen3.5-397B-A17B: 60 layers + MTP, 512 experts top-10",
            "qwen3-30b-a3b" => "Qwen3-30B-A3B: 48 layers, 128 experts top-8",
            _ => "",
        }
    }

    /// Parameters (elements) of the non-vocabulary part and of the whole model, counted
    /// over the arch's tensor table. `None` if the geometry is not a valid config.
    pub fn n_params(&self) -> Option<(u64, u64)> {
        let cfg = self.config().ok()?;
        let (mut vocab, mut rest) = (0u64, 0u64);
        for t in crate::tensors::table(self.arch).instances(&cfg) {
            let n: u64 = t.dims.iter().map(|&d| d as u64).product();
            match t.def.role {
                crate::tensors::Role::Embedding | crate::tensors::Role::Output => vocab += n,
                _ => rest += n,
            }
        }
        Some((rest, rest + vocab))
    }
}

const QWEN35_ROPE_SECTIONS: [i32; 4] = [11, 11, 10, 0];

fn tiny_qwen35moe() -> Geometry {
    Geometry {
        name: "tiny-qwen35moe",
        arch: Arch::Qwen35Moe,
        n_layer: 8,
        n_nextn: 1,
        n_embd: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 256,
        n_rot: 64,
        rope_theta: 1.0e7,
        rope_sections: Some(QWEN35_ROPE_SECTIONS),
        rms_eps: 1e-6,
        n_expert: 16,
        n_expert_used: 4,
        expert_ff: 256,
        shared_ff: 256,
        dense_ff: None,
        full_attention_interval: 4,
        linear: Some(LinearAttention {
            n_k_heads: 2,
            n_v_heads: 4,
            head_dim: 128,
            conv_kernel: 4,
        }),
        n_vocab: 248_320,
        context_length: 262_144,
    }
}

fn tiny_qwen3next() -> Geometry {
    Geometry {
        name: "tiny-qwen3next",
        arch: Arch::Qwen3Next,
        n_nextn: 0,
        rope_sections: None,
        dense_ff: Some(512),
        n_vocab: 151_936,
        ..tiny_qwen35moe()
    }
}

fn tiny_qwen3moe() -> Geometry {
    Geometry {
        name: "tiny-qwen3moe",
        arch: Arch::Qwen3Moe,
        n_layer: 4,
        n_nextn: 0,
        n_embd: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 128,
        n_rot: 128,
        rope_theta: 1.0e6,
        rope_sections: None,
        rms_eps: 1e-6,
        n_expert: 16,
        n_expert_used: 4,
        expert_ff: 256,
        shared_ff: 0,
        dense_ff: Some(768),
        full_attention_interval: 0,
        linear: None,
        n_vocab: 151_936,
        context_length: 40_960,
    }
}

fn qwen3_next_80b_a3b() -> Geometry {
    Geometry {
        name: "qwen3-next-80b-a3b",
        arch: Arch::Qwen3Next,
        n_layer: 48,
        // Most Qwen3-Next GGUFs carry no MTP block (the converter dropped `mtp.*`).
        n_nextn: 0,
        n_embd: 2048,
        n_head: 16,
        n_head_kv: 2,
        head_dim: 256,
        n_rot: 64,
        rope_theta: 1.0e7,
        rope_sections: None,
        rms_eps: 1e-6,
        n_expert: 512,
        n_expert_used: 10,
        expert_ff: 512,
        shared_ff: 512,
        dense_ff: Some(5120),
        full_attention_interval: 4,
        linear: Some(LinearAttention {
            n_k_heads: 16,
            n_v_heads: 32,
            head_dim: 128,
            conv_kernel: 4,
        }),
        n_vocab: 151_936,
        context_length: 262_144,
    }
}

fn qwen36_35b_a3b() -> Geometry {
    Geometry {
        name: "qwen3.6-35b-a3b",
        arch: Arch::Qwen35Moe,
        n_layer: 40,
        n_nextn: 1,
        n_embd: 2048,
        n_head: 16,
        n_head_kv: 2,
        head_dim: 256,
        n_rot: 64,
        rope_theta: 1.0e7,
        rope_sections: Some(QWEN35_ROPE_SECTIONS),
        rms_eps: 1e-6,
        n_expert: 256,
        n_expert_used: 8,
        expert_ff: 512,
        shared_ff: 512,
        dense_ff: None,
        full_attention_interval: 4,
        linear: Some(LinearAttention {
            n_k_heads: 16,
            n_v_heads: 32,
            head_dim: 128,
            conv_kernel: 4,
        }),
        n_vocab: 248_320,
        context_length: 262_144,
    }
}

fn qwen35_122b_a10b() -> Geometry {
    Geometry {
        name: "qwen3.5-122b-a10b",
        n_layer: 48,
        n_embd: 3072,
        n_head: 32,
        n_head_kv: 2,
        expert_ff: 1024,
        shared_ff: 1024,
        linear: Some(LinearAttention {
            n_k_heads: 16,
            n_v_heads: 64,
            head_dim: 128,
            conv_kernel: 4,
        }),
        ..qwen36_35b_a3b()
    }
}

/// Qwen3.5-397B-A17B (the released config: hidden 4096, 60 layers with every fourth
/// full attention, 32 query / 2 KV heads of 256, 512 experts of 1024 with top-10 and a
/// shared expert of 1024, linear attention 16 key / 64 value heads of 128, one MTP
/// layer, the Qwen3.5 vocabulary).
fn qwen35_397b_a17b() -> Geometry {
    Geometry {
        name: "qwen3.5-397b-a17b",
        n_layer: 60,
        n_embd: 4096,
        n_head: 32,
        n_head_kv: 2,
        n_expert: 512,
        n_expert_used: 10,
        expert_ff: 1024,
        shared_ff: 1024,
        linear: Some(LinearAttention {
            n_k_heads: 16,
            n_v_heads: 64,
            head_dim: 128,
            conv_kernel: 4,
        }),
        ..qwen36_35b_a3b()
    }
}

fn qwen3_30b_a3b() -> Geometry {
    Geometry {
        name: "qwen3-30b-a3b",
        arch: Arch::Qwen3Moe,
        n_layer: 48,
        n_nextn: 0,
        n_embd: 2048,
        n_head: 32,
        n_head_kv: 4,
        head_dim: 128,
        n_rot: 128,
        rope_theta: 1.0e6,
        rope_sections: None,
        rms_eps: 1e-6,
        n_expert: 128,
        n_expert_used: 8,
        expert_ff: 768,
        shared_ff: 0,
        dense_ff: Some(6144),
        full_attention_interval: 0,
        linear: None,
        n_vocab: 151_936,
        context_length: 40_960,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_and_aliases() {
        let g = Geometry::by_name(None, "Qwen3.5-35B-A3B").unwrap();
        assert_eq!(g.name, "qwen3.6-35b-a3b");
        assert_eq!(g.block_count(), 41);
        assert!(Geometry::by_name(Some(Arch::Qwen3Moe), "qwen3.6-35b-a3b").is_none());
        assert!(Geometry::by_name(None, "tiny").is_none());
        assert_eq!(
            Geometry::by_name(Some(Arch::Qwen3Next), "tiny")
                .unwrap()
                .arch,
            Arch::Qwen3Next
        );
    }

    #[test]
    fn tiny_geometries_have_every_feature() {
        for arch in ARCHS {
            let g = Geometry::by_name(Some(arch), "tiny").unwrap();
            let c = g.config().unwrap();
            assert_ne!(c.head_dim, c.n_embd / c.n_head);
            assert_eq!(c.n_embd % 256, 0);
            assert_eq!(c.n_ff_exp % 256, 0);
            if arch.is_hybrid() {
                let s = c.ssm.as_ref().unwrap();
                assert_eq!(s.n_v_heads, 2 * s.n_k_heads);
                assert!(c.n_layer >= 8);
                assert_eq!(c.n_attention_layers(), 2);
                assert!(c.n_rot < c.head_dim);
                assert!(c.n_ff_shexp > 0);
            }
            assert!(g.n_params().unwrap().0 < 40_000_000);
        }
    }

    #[test]
    fn real_layer_patterns() {
        use crate::config::LayerKind;
        let c = Geometry::by_name(None, "qwen3-next-80b-a3b")
            .unwrap()
            .config()
            .unwrap();
        assert_eq!(c.n_attention_layers(), 12);
        assert_eq!(c.layer_kinds[3], LayerKind::Attention);
        assert_eq!(c.layer_kinds[0], LayerKind::DeltaNet);
        let q = Geometry::by_name(None, "qwen3.6-35b-a3b")
            .unwrap()
            .config()
            .unwrap();
        assert_eq!(q.ssm.as_ref().unwrap().conv_dim(), 8192);
        assert_eq!((q.n_layer, q.n_nextn), (40, 1));
    }

    #[test]
    fn the_big_qwen35_geometries_have_their_released_sizes() {
        // Parameter counts of the released checkpoints' text towers with MTP: about
        // 122B and 397B (the names round them; 10B and 17B are active).
        for (name, total_b, n_attn, kv) in [
            ("qwen3.5-122b-a10b", 122.0, 12, 2),
            ("qwen3.5-397b-a17b", 397.0, 15, 2),
        ] {
            let g = Geometry::by_name(None, name).unwrap();
            let (_, total) = g.n_params().unwrap();
            let b = total as f64 / 1e9;
            assert!((b - total_b).abs() / total_b < 0.03, "{name}: {b:.1}B");
            let c = g.config().unwrap();
            assert_eq!(c.n_attention_layers(), n_attn, "{name}");
            assert_eq!(c.n_head_kv, kv, "{name}");
            assert_eq!(c.n_embd % 256, 0);
            assert_eq!(c.n_ff_exp % 256, 0);
        }
    }

    #[test]
    fn every_geometry_is_a_valid_config() {
        for g in Geometry::all() {
            let c = g.config().unwrap_or_else(|e| panic!("{}: {e}", g.name));
            assert_eq!(c.arch, g.arch);
            assert_eq!(c.n_layer + c.n_nextn, g.block_count() as usize);
            assert_eq!(c.n_vocab, g.n_vocab as usize);
        }
    }
}
