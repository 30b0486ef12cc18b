//! The tensors of a geometry under a quantization preset: names and shapes come from the
//! arch's table ([`crate::tensors`]) over the config the geometry gives; this file adds
//! the type each tensor gets and how its values are drawn.
//!
//! Types follow what llama.cpp's converter and `llama-quantize` produce, by the table's
//! [`QuantRule`]:
//! * `KeepF32` tensors (1-D tensors, norms, routers, `ssm_conv1d`) are F32 whatever the
//!   outtype, and `llama-quantize` leaves them alone;
//! * the rest are written at the outtype and, in a quantized preset, take the type
//!   `llama-quantize` picks from the file type: for Q4_K_M, `output` → Q6_K; `attn_v`
//!   and `attn_qkv` (counted together, in file order) and every `ffn_down*` → Q6_K on the
//!   layers where `use_more_bits` holds, else Q4_K; everything else Q4_K.
//!
//! Order: tensors are written as `llama-quantize` writes them, sorted by block index
//! (non-block tensors first) and then by name.

use gguf::GgmlType;

use super::gen::Init;
use super::{Mix, Preset};
use crate::geometry::Geometry;
use crate::tensors::{self, block_of, QuantRule, Role, TensorId, TensorInstance};

/// One tensor to write.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// ggml order (ne0 first).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub init: Init,
}

fn fan_in(std_for: usize) -> Init {
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

/// How a tensor's values are drawn: matrices at 1/sqrt(fan-in) (`dims[0]` is the input
/// width of every matrix here), norms ~1, the DeltaNet parameters in their working ranges.
fn init(t: &TensorInstance) -> Init {
    match t.def.id {
        // Unit-variance embeddings keep the token's identity visible next to the
        // sublayer outputs (RMS ~0.5 each) added to the residual stream.
        TensorId::TokenEmbd => Init::with_std(1.0),
        TensorId::SsmA => SSM_A,
        TensorId::SsmDtBias => DT_BIAS,
        TensorId::SsmConv1d => CONV,
        TensorId::NextnEnorm | TensorId::NextnHnorm | TensorId::NextnSharedHeadNorm => NORM,
        _ if matches!(t.def.role, Role::Norm | Role::OutputNorm) => NORM,
        _ => fan_in(t.dims[0]),
    }
}

/// llama-quantize's order: by block (non-block tensors first), then by name.
pub fn quantize_order(a: &str, b: &str) -> std::cmp::Ordering {
    let la = block_of(a).map_or(-1, i64::from);
    let lb = block_of(b).map_or(-1, i64::from);
    la.cmp(&lb).then_with(|| a.cmp(b))
}

/// llama-quantize's `use_more_bits`.
pub fn use_more_bits(i_layer: i64, n_layers: i64) -> bool {
    i_layer < n_layers / 8
        || i_layer >= 7 * n_layers / 8
        || (i_layer - n_layers / 8).rem_euclid(3) == 2
}

/// The type of a quantizable tensor of `role` in the mix `m`.
///
/// Where the assignments come from: Unsloth's published description of its Qwen3.5
/// dynamic quants (the "Qwen3.5 GGUF Benchmarks" page of its docs, March 2026: routed
/// `ffn_up_exps`/`ffn_gate_exps` take the low-bit type, `ffn_down_exps` is more
/// sensitive and gets more bits, `ssm_out` and every `attn_*` stay at high precision
/// in hybrid models) and the tensor listings of published Qwen3.5 UD files quoted in
/// public issue threads (huggingface/candle#3821: a Qwen3.5-35B-A3B UD file with its
/// attention, DeltaNet projections, `ssm_out` and shared expert in Q8_0 and its gate/up
/// experts in IQ3_XXS; a dense Qwen3.5 UD-IQ2_XXS file with gate/up in IQ2_XXS and
/// down in IQ3_S). The real files vary a few tensors by layer through their
/// importance-matrix search; these mixes keep one type per role, which is what the
/// kernels and the tiered expert store care about:
///
/// | role | UD-Q2_K_XL | UD-Q3_K_XL | UD-IQ2_XXS | MXFP4_MOE |
/// |---|---|---|---|---|
/// | routed gate, up | Q2_K | Q3_K | IQ2_XXS | MXFP4 |
/// | routed down | Q3_K | Q4_K | IQ3_S | MXFP4 |
/// | shared expert, attention, DeltaNet (incl. `ssm_out`), MTP | Q8_0 | Q8_0 | Q8_0 | Q8_0 |
/// | `token_embd` | Q4_K | Q4_K | Q4_K | Q8_0 |
/// | `output` | Q6_K | Q6_K | Q6_K | Q8_0 |
///
/// (`MXFP4_MOE` is llama-quantize's own rule: MXFP4 experts, Q8_0 elsewhere.
/// `nvfp4_scaled` is not a quantizer's choice but what llama.cpp's converter writes from
/// NVIDIA's FP4 checkpoints: every matrix NVFP4 with its `.scale` ([`second_level`]),
/// the embedding and the LM head BF16, as the checkpoints leave them.)
pub fn mix_type(m: Mix, role: Role) -> GgmlType {
    use crate::tensors::ExpertMatrix as E;
    use GgmlType as T;
    match (m, role) {
        (Mix::Nvfp4Scaled, Role::Embedding | Role::Output) => T::BF16,
        (Mix::Nvfp4Scaled, _) => T::NVFP4,
        (Mix::Mxfp4Moe, Role::RoutedExpert(_)) => T::MXFP4,
        (Mix::Mxfp4Moe, _) => T::Q8_0,
        (_, Role::Embedding) => T::Q4_K,
        (_, Role::Output) => T::Q6_K,
        (Mix::UdQ2KXL, Role::RoutedExpert(E::Gate | E::Up)) => T::Q2_K,
        (Mix::UdQ2KXL, Role::RoutedExpert(E::Down)) => T::Q3_K,
        (Mix::UdQ3KXL, Role::RoutedExpert(E::Gate | E::Up)) => T::Q3_K,
        (Mix::UdQ3KXL, Role::RoutedExpert(E::Down)) => T::Q4_K,
        (Mix::UdIq2Xxs, Role::RoutedExpert(E::Gate | E::Up)) => T::IQ2_XXS,
        (Mix::UdIq2Xxs, Role::RoutedExpert(E::Down)) => T::IQ3_S,
        _ => T::Q8_0,
    }
}

/// Why a plan cannot be made.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PlanError {
    #[error("geometry {geometry}: {msg}")]
    Geometry { geometry: String, msg: String },
    #[error("tensor `{name}`: rows of {ne0} elements are not whole {ty} blocks")]
    Shape {
        name: String,
        ne0: u64,
        ty: GgmlType,
    },
}

/// The type each tensor gets under a preset, chosen as `llama-quantize` chooses it: call
/// [`TypeChooser::next`] for every tensor in llama-quantize's order ([`quantize_order`]),
/// since the `attn_v`/`attn_qkv` rule counts those tensors in that order.
#[derive(Debug, Clone)]
pub struct TypeChooser {
    preset: Preset,
    /// `attn_v` / `attn_qkv` tensors in the file, and how many were chosen so far.
    n_attention_wv: i64,
    i_attention_wv: i64,
    /// Blocks of the file (trunk and MTP).
    n_layer_all: i64,
}

impl TypeChooser {
    pub fn new(preset: Preset, n_attention_wv: usize, n_layer_all: u32) -> TypeChooser {
        TypeChooser {
            preset,
            n_attention_wv: n_attention_wv as i64,
            i_attention_wv: 0,
            n_layer_all: i64::from(n_layer_all),
        }
    }

    /// The type of the next tensor: its rule, its block, and its row length (`ne0`,
    /// which decides between Q8_0 and Q6_K for the head).
    pub fn next(
        &mut self,
        rule: QuantRule,
        role: Role,
        block: Option<usize>,
        ne0: u64,
    ) -> GgmlType {
        let float = match self.preset {
            Preset::F32 => GgmlType::F32,
            Preset::F16 => GgmlType::F16,
            _ => GgmlType::BF16,
        };
        let ty = match (rule, self.preset) {
            (QuantRule::KeepF32, _) => GgmlType::F32,
            (_, Preset::F32 | Preset::F16 | Preset::Bf16) => float,
            (_, Preset::Q8_0) => GgmlType::Q8_0,
            // Q4_K_M, following llama_tensor_get_type_impl for n_expert != 8.
            (QuantRule::Output, Preset::Q4KM) => {
                if !ne0.is_multiple_of(256) {
                    GgmlType::Q8_0
                } else {
                    GgmlType::Q6_K
                }
            }
            (QuantRule::AttnV, Preset::Q4KM) => {
                let more = use_more_bits(self.i_attention_wv, self.n_attention_wv);
                self.i_attention_wv += 1;
                if more {
                    GgmlType::Q6_K
                } else {
                    GgmlType::Q4_K
                }
            }
            (QuantRule::FfnDown, Preset::Q4KM) => {
                let il = block.map_or(0, |b| b as i64);
                if use_more_bits(il, self.n_layer_all) {
                    GgmlType::Q6_K
                } else {
                    GgmlType::Q4_K
                }
            }
            (QuantRule::Weight, Preset::Q4KM) => GgmlType::Q4_K,
            (_, Preset::Uniform(t)) => t,
            (_, Preset::Mix(m)) => mix_type(m, role),
        };
        if ne0.is_multiple_of(ty.block_size() as u64) {
            return ty;
        }
        match self.preset {
            // Rows that are not whole blocks of the chosen type: Q4_K_M takes
            // llama-quantize's fallback; the uniform presets and the mixes take Q8_0
            // (every row here is whole 32-value blocks).
            Preset::Q4KM => fallback(ty, ne0),
            Preset::Uniform(_) | Preset::Mix(_) => GgmlType::Q8_0,
            _ => ty,
        }
    }
}

/// llama-quantize's type for a row of `ne0` values that is not whole blocks of `ty`: a
/// 32-value type of about the same size, or F16 when even that does not fit.
fn fallback(ty: GgmlType, ne0: u64) -> GgmlType {
    use GgmlType as T;
    let to = match ty {
        T::TQ1_0 | T::TQ2_0 => T::Q4_0,
        T::IQ1_S | T::IQ1_M | T::IQ2_XXS | T::IQ2_XS | T::IQ2_S | T::IQ3_XXS | T::IQ3_S => {
            T::IQ4_NL
        }
        T::Q2_K | T::Q3_K | T::IQ4_XS => T::IQ4_NL,
        T::Q4_K => T::Q5_0,
        T::Q5_K => T::Q5_1,
        T::Q6_K => T::Q8_0,
        other => other,
    };
    if ne0.is_multiple_of(to.block_size() as u64) {
        to
    } else {
        T::F16
    }
}

/// The tensors of `g` under `preset`, in file order.
pub fn plan(g: &Geometry, preset: Preset) -> Result<Vec<TensorSpec>, PlanError> {
    let cfg = g.config().map_err(|e| PlanError::Geometry {
        geometry: g.name.to_string(),
        msg: e.to_string(),
    })?;
    let mut decls = tensors::table(g.arch).instances(&cfg);
    decls.sort_by(|a, b| quantize_order(&a.name, &b.name));
    let n_attention_wv = decls
        .iter()
        .filter(|d| d.def.quant == QuantRule::AttnV)
        .count();
    let mut types = TypeChooser::new(preset, n_attention_wv, g.block_count());
    let mut out = Vec::with_capacity(decls.len());
    for d in decls {
        let ty = types.next(d.def.quant, d.def.role, d.block, d.dims[0] as u64);
        let init = init(&d);
        let dims: Vec<u64> = d.dims.iter().map(|&x| x as u64).collect();
        if !dims[0].is_multiple_of(ty.block_size() as u64) {
            return Err(PlanError::Shape {
                name: d.name,
                ne0: dims[0],
                ty,
            });
        }
        let init = if preset == Preset::Mix(Mix::Nvfp4Scaled) && ty == GgmlType::NVFP4 {
            let (init, scale) = second_level(&d.name, &dims, init);
            out.push(scale);
            init
        } else {
            init
        };
        out.push(TensorSpec {
            name: d.name,
            dims,
            ty,
            init,
        });
    }
    out.sort_by(|a, b| quantize_order(&a.name, &b.name));
    Ok(out)
}

/// The standard deviation an NVFP4 matrix of [`Mix::Nvfp4Scaled`] is drawn at, its
/// second-level scale bringing it back to its init's: mid-range e4m3 block scales, as
/// a checkpoint's per-tensor scale puts them.
const SCALED_STD: f32 = 128.0;

/// A matrix's init under [`Mix::Nvfp4Scaled`] and its `.scale` tensor: the values
/// drawn at [`SCALED_STD`], times a scale per matrix (per expert for a stack) of about
/// std / SCALED_STD (±25%, as checkpoints' experts differ).
fn second_level(name: &str, dims: &[u64], init: Init) -> (Init, TensorSpec) {
    let std = init.zero_mean_std().unwrap_or(1.0);
    let s = std / SCALED_STD;
    let scale = TensorSpec {
        name: crate::weights::scale_names(name).swap_remove(0),
        dims: vec![dims.get(2).copied().unwrap_or(1)],
        ty: GgmlType::F32,
        init: Init::Uniform {
            center: s,
            half_width: 0.25 * s,
        },
    };
    (Init::with_std(SCALED_STD), scale)
}

#[cfg(test)]
mod tests {
    #[test]
    fn q4_k_m_rows_that_are_not_whole_k_blocks_take_llama_quantizes_fallback() {
        use gguf::GgmlType as T;
        let mut c = super::TypeChooser::new(super::Preset::Q4KM, 0, 2);
        let w = crate::tensors::QuantRule::Weight;
        let r = crate::tensors::Role::Attention;
        assert_eq!(c.next(w, r, Some(0), 256), T::Q4_K);
        assert_eq!(c.next(w, r, Some(0), 128), T::Q5_0);
        assert_eq!(super::fallback(T::Q5_K, 128), T::Q5_1);
        assert_eq!(super::fallback(T::Q6_K, 128), T::Q8_0);
        assert_eq!(super::fallback(T::IQ2_XXS, 96), T::IQ4_NL);
        assert_eq!(super::fallback(T::Q4_K, 48), T::F16);
    }

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
        let g = Geometry::by_name(Some(crate::geometry::Arch::Qwen35Moe), "tiny").unwrap();
        let p = plan(&g, Preset::Q4KM).unwrap();
        assert_eq!(p[0].name, "output.weight");
        assert_eq!(p[1].name, "output_norm.weight");
        assert_eq!(p[2].name, "token_embd.weight");
        assert_eq!(p[3].name, "blk.0.attn_gate.weight");
        assert!(p.last().unwrap().name.starts_with("blk.8."));
    }
}
