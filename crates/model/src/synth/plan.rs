//! The tensor inventory of a geometry (exact GGUF names and ggml shapes per arch), the
//! type each tensor gets under a quantization preset, and how its values are drawn.
//!
//! Types follow what llama.cpp's converter and `llama-quantize` produce:
//! * the converter writes 1-D tensors, `*_norm.weight`, the routers (`ffn_gate_inp`,
//!   `ffn_gate_inp_shexp`) and `ssm_conv1d` as F32, everything else at its outtype;
//! * `llama-quantize` leaves those alone (and anything not ending in `weight`, such as
//!   `ssm_a` and `ssm_dt.bias`), and picks the type of the rest from the file type: for
//!   Q4_K_M, `output` → Q6_K; `attn_v` and `attn_qkv` (counted together, in file order)
//!   and every `ffn_down*` → Q6_K on the layers where `use_more_bits` holds, else Q4_K;
//!   everything else Q4_K.
//!
//! Order: tensors are written as `llama-quantize` writes them, sorted by block index
//! (non-block tensors first) and then by name.

use gguf::GgmlType;

use super::gen::Init;
use super::Preset;
use crate::geometry::{Arch, Geometry};

/// One tensor to write.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// ggml order (ne0 first).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub init: Init,
}

/// A tensor before its type is chosen.
struct Decl {
    name: String,
    dims: Vec<u64>,
    init: Init,
}

fn fan_in(std_for: u32) -> Init {
    Init::with_std(1.0 / (std_for.max(1) as f32).sqrt())
}

/// Norm weights as the GGUF holds them: ~1 (the converter folds +1 into Qwen3.5/Next's
/// zero-centred norms; `ssm_norm` and Qwen3-MoE's norms are plain weights ~1 anyway).
const NORM: Init = Init::Uniform {
    center: 1.0,
    half_width: 0.1,
};

/// `ssm_a` = −exp(A_log) in [−1, −0.05]: with softplus(alpha + dt_bias) ≈ 0.7 the
/// per-token decay exp(g) stays in (0.5, 0.97), so the state remembers a few dozen tokens.
const SSM_A: Init = Init::NegExp {
    ln_lo: -3.0,
    ln_hi: 0.0,
};
const DT_BIAS: Init = Init::Uniform {
    center: 0.0,
    half_width: 0.5,
};
/// Depthwise conv taps, std ~0.3.
const CONV: Init = Init::Uniform {
    center: 0.0,
    half_width: 0.52,
};

impl Geometry {
    fn decls(&self) -> Vec<Decl> {
        let e = self.n_embd;
        let (e64, v64) = (u64::from(e), u64::from(self.n_vocab));
        let mut out = vec![
            // Unit-variance embeddings keep the token's identity visible next to the
            // sublayer outputs (RMS ~0.5 each) added to the residual stream.
            Decl {
                name: "token_embd.weight".into(),
                dims: vec![e64, v64],
                init: Init::with_std(1.0),
            },
            Decl {
                name: "output_norm.weight".into(),
                dims: vec![e64],
                init: NORM,
            },
            Decl {
                name: "output.weight".into(),
                dims: vec![e64, v64],
                init: fan_in(e),
            },
        ];
        for il in 0..self.block_count() {
            self.block_decls(il, &mut out);
        }
        out
    }

    fn block_decls(&self, il: u32, out: &mut Vec<Decl>) {
        let e = self.n_embd;
        let mut add = |suffix: &str, dims: &[u32], init: Init| {
            out.push(Decl {
                name: format!("blk.{il}.{suffix}"),
                dims: dims.iter().map(|&d| u64::from(d)).collect(),
                init,
            })
        };
        add("attn_norm.weight", &[e], NORM);
        if self.arch == Arch::Qwen3Moe {
            add("ffn_norm.weight", &[e], NORM);
        } else {
            add("post_attention_norm.weight", &[e], NORM);
        }
        match (self.is_recurrent(il), &self.linear) {
            (true, Some(l)) => {
                let (kd, vd, hv) = (l.key_dim(), l.value_dim(), l.n_v_heads);
                add("attn_qkv.weight", &[e, 2 * kd + vd], fan_in(e));
                add("attn_gate.weight", &[e, vd], fan_in(e));
                if self.arch == Arch::Qwen3Next {
                    add("ssm_ba.weight", &[e, 2 * hv], fan_in(e));
                } else {
                    add("ssm_alpha.weight", &[e, hv], fan_in(e));
                    add("ssm_beta.weight", &[e, hv], fan_in(e));
                }
                add("ssm_conv1d.weight", &[l.conv_kernel, l.conv_dim()], CONV);
                add("ssm_a", &[hv], SSM_A);
                add("ssm_dt.bias", &[hv], DT_BIAS);
                add("ssm_norm.weight", &[l.v_head_dim], NORM);
                add("ssm_out.weight", &[vd, e], fan_in(vd));
            }
            _ => {
                let hd = self.head_dim;
                add("attn_q.weight", &[e, self.q_out()], fan_in(e));
                add("attn_k.weight", &[e, self.kv_out()], fan_in(e));
                add("attn_v.weight", &[e, self.kv_out()], fan_in(e));
                let o_in = self.n_head * hd;
                add("attn_output.weight", &[o_in, e], fan_in(o_in));
                add("attn_q_norm.weight", &[hd], NORM);
                add("attn_k_norm.weight", &[hd], NORM);
            }
        }
        let (ne, ff) = (self.n_expert, self.expert_ff);
        add("ffn_gate_inp.weight", &[e, ne], fan_in(e));
        add("ffn_gate_exps.weight", &[e, ff, ne], fan_in(e));
        add("ffn_up_exps.weight", &[e, ff, ne], fan_in(e));
        add("ffn_down_exps.weight", &[ff, e, ne], fan_in(ff));
        if self.shared_ff > 0 {
            let sff = self.shared_ff;
            add("ffn_gate_inp_shexp.weight", &[e], fan_in(e));
            add("ffn_gate_shexp.weight", &[e, sff], fan_in(e));
            add("ffn_up_shexp.weight", &[e, sff], fan_in(e));
            add("ffn_down_shexp.weight", &[sff, e], fan_in(sff));
        }
        if self.is_nextn(il) {
            add("nextn.eh_proj.weight", &[2 * e, e], fan_in(2 * e));
            add("nextn.enorm.weight", &[e], NORM);
            add("nextn.hnorm.weight", &[e], NORM);
            add("nextn.shared_head_norm.weight", &[e], NORM);
        }
    }
}

/// Block index of a tensor name (`blk.N.`), as llama.cpp parses it.
pub fn block_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("blk.")?;
    let end = rest.find('.')?;
    rest[..end].parse().ok()
}

/// llama-quantize's order: by block (non-block tensors first), then by name.
fn quantize_order(a: &str, b: &str) -> std::cmp::Ordering {
    let la = block_of(a).map_or(-1, i64::from);
    let lb = block_of(b).map_or(-1, i64::from);
    la.cmp(&lb).then_with(|| a.cmp(b))
}

/// Whether the converter keeps this tensor F32 whatever the outtype.
fn converter_keeps_f32(name: &str, dims: &[u64]) -> bool {
    dims.len() <= 1
        || name.ends_with("_norm.weight")
        || name.contains("ffn_gate_inp")
        || name.contains("ssm_conv1d")
}

/// llama-quantize's `tensor_allows_quantization` for the names these archs have.
fn quantize_allowed(name: &str, dims: &[u64]) -> bool {
    dims.len() >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && !name.contains("ssm_conv1d")
}

/// llama-quantize's `use_more_bits`.
pub fn use_more_bits(i_layer: i64, n_layers: i64) -> bool {
    i_layer < n_layers / 8
        || i_layer >= 7 * n_layers / 8
        || (i_layer - n_layers / 8).rem_euclid(3) == 2
}

/// Why a plan cannot be made.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PlanError {
    #[error("tensor `{name}`: rows of {ne0} elements are not whole {ty} blocks")]
    Shape {
        name: String,
        ne0: u64,
        ty: GgmlType,
    },
}

/// The tensors of `g` under `preset`, in file order.
pub fn plan(g: &Geometry, preset: Preset) -> Result<Vec<TensorSpec>, PlanError> {
    let mut decls = g.decls();
    decls.sort_by(|a, b| quantize_order(&a.name, &b.name));
    let n_attention_wv = decls
        .iter()
        .filter(|d| d.name.contains("attn_v.weight") || d.name.contains("attn_qkv.weight"))
        .count() as i64;
    let n_layer_all = i64::from(g.block_count());
    let mut i_attention_wv = 0i64;
    let mut out = Vec::with_capacity(decls.len());
    for d in decls {
        let base = match preset {
            Preset::F32 => GgmlType::F32,
            Preset::F16 => GgmlType::F16,
            Preset::Bf16 => GgmlType::BF16,
            Preset::Q8_0 | Preset::Q4KM => GgmlType::BF16,
        };
        let ty = if converter_keeps_f32(&d.name, &d.dims) {
            GgmlType::F32
        } else if !preset.is_quantized() || !quantize_allowed(&d.name, &d.dims) {
            base
        } else if preset == Preset::Q8_0 {
            GgmlType::Q8_0
        } else {
            // Q4_K_M, following llama_tensor_get_type_impl for n_expert != 8.
            let ne0 = d.dims[0];
            if d.name == "output.weight" {
                if ne0 % 256 != 0 {
                    GgmlType::Q8_0
                } else {
                    GgmlType::Q6_K
                }
            } else if d.name.contains("attn_v.weight") || d.name.contains("attn_qkv.weight") {
                let t = if use_more_bits(i_attention_wv, n_attention_wv) {
                    GgmlType::Q6_K
                } else {
                    GgmlType::Q4_K
                };
                i_attention_wv += 1;
                t
            } else if d.name.contains("ffn_down") {
                let il = block_of(&d.name).map_or(0, i64::from);
                if use_more_bits(il, n_layer_all) {
                    GgmlType::Q6_K
                } else {
                    GgmlType::Q4_K
                }
            } else {
                GgmlType::Q4_K
            }
        };
        if d.dims[0] % ty.block_size() as u64 != 0 {
            return Err(PlanError::Shape {
                name: d.name,
                ne0: d.dims[0],
                ty,
            });
        }
        out.push(TensorSpec {
            name: d.name,
            dims: d.dims,
            ty,
            init: d.init,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_matches_llama_quantize_on_41_layers() {
        let q6: Vec<i64> = (0..41).filter(|&i| use_more_bits(i, 41)).collect();
        assert_eq!(
            q6,
            vec![0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39, 40]
        );
    }

    #[test]
    fn tensor_counts_match_real_files() {
        // Qwen3-Coder-Next (no MTP): 3 + 36·18 + 12·16 = 843 tensors.
        let g = Geometry::by_name(None, "qwen3-next-80b-a3b").unwrap();
        assert_eq!(plan(&g, Preset::Q4KM).unwrap().len(), 843);
    }

    #[test]
    fn order_is_llama_quantize_order() {
        let g = Geometry::by_name(Some(Arch::Qwen35Moe), "tiny").unwrap();
        let p = plan(&g, Preset::Q4KM).unwrap();
        assert_eq!(p[0].name, "output.weight");
        assert_eq!(p[1].name, "output_norm.weight");
        assert_eq!(p[2].name, "token_embd.weight");
        assert_eq!(p[3].name, "blk.0.attn_gate.weight");
        assert!(p.last().unwrap().name.starts_with("blk.8."));
    }
}
