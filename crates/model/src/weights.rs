//! The tensor inventory: every weight the forward pass reads, looked up by its
//! GGUF name, with its shape checked against the config before anything runs.

use crate::config::{LayerKind, ModelConfig};
use crate::ModelError;
use gguf::{GgmlType, GgufFile};
use std::sync::Arc;

/// One tensor of the model file, borrowed from the memory map.
#[derive(Clone)]
pub struct Weight {
    file: Arc<GgufFile>,
    index: usize,
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: dims[0] is the row length.
    pub dims: Vec<usize>,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ty, self.dims)
    }
}

impl Weight {
    /// The tensor's bytes (all experts for a 3-D expert tensor).
    pub fn bytes(&self) -> &[u8] {
        self.file.tensor_data(&self.file.tensors()[self.index])
    }
    /// Elements per row (ne0).
    pub fn row_len(&self) -> usize {
        self.dims[0]
    }
    /// Rows of one matrix (ne1; 1 for vectors).
    pub fn n_rows(&self) -> usize {
        self.dims.get(1).copied().unwrap_or(1)
    }
    pub fn row_bytes(&self) -> usize {
        // Checked at load: the row is a whole number of blocks.
        self.ty.row_bytes(self.row_len()).unwrap_or(0)
    }
    /// Bytes of matrix `e` of a 3-D tensor {ne0, ne1, n}: rows e·ne1 .. (e+1)·ne1.
    pub fn matrix_bytes(&self, e: usize) -> &[u8] {
        let per = self.n_rows() * self.row_bytes();
        &self.bytes()[e * per..(e + 1) * per]
    }
    /// All elements as f32 (used for vectors: norms, biases, gates).
    pub fn to_f32(&self) -> Vec<f32> {
        let n: usize = self.dims.iter().product();
        let mut out = vec![0.0f32; n];
        let rb = self.row_bytes();
        let rl = self.row_len();
        for (r, chunk) in out.chunks_mut(rl).enumerate() {
            quant::dequantize_row(self.ty, &self.bytes()[r * rb..(r + 1) * rb], chunk);
        }
        out
    }
}

/// Looks tensors up by name and checks their shapes.
pub struct Loader<'a> {
    file: &'a Arc<GgufFile>,
}

impl<'a> Loader<'a> {
    pub fn new(file: &'a Arc<GgufFile>) -> Self {
        Loader { file }
    }

    pub fn file(&self) -> &GgufFile {
        self.file
    }

    pub fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    /// The tensor `name`, which must have exactly `dims` (ggml order; a trailing
    /// 1 in the file is accepted for vectors stored as {n, 1}).
    pub fn get(&self, name: &str, dims: &[usize]) -> Result<Weight, ModelError> {
        let index = self
            .file
            .tensors()
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let t = &self.file.tensors()[index];
        let mut found: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        while found.len() > dims.len() && found.last() == Some(&1) {
            found.pop();
        }
        if found != dims {
            return Err(ModelError::Shape {
                name: name.to_string(),
                expected: dims.to_vec(),
                found: t.dims.iter().map(|&d| d as usize).collect(),
            });
        }
        Ok(Weight {
            file: self.file.clone(),
            index,
            name: name.to_string(),
            ty: t.ty,
            dims: found,
        })
    }

    pub fn opt(&self, name: &str, dims: &[usize]) -> Result<Option<Weight>, ModelError> {
        if self.has(name) {
            self.get(name, dims).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Attention (plain GQA for qwen3moe; gated for the hybrids).
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    /// {n_embd, n_head·head_dim} (×2 when gated: per head [q | gate]).
    pub q: Weight,
    pub k: Weight,
    pub v: Weight,
    pub o: Weight,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

/// How a DeltaNet layer stores its β and α projections.
#[derive(Debug, Clone)]
pub enum BetaAlpha {
    /// qwen35moe: `ssm_beta` and `ssm_alpha`, {n_embd, Hv} each.
    Separate { beta: Weight, alpha: Weight },
    /// qwen3next: `ssm_ba` {n_embd, 2·Hv}, per key head [β ×r, α ×r].
    Fused(Weight),
}

/// Gated DeltaNet (linear attention).
#[derive(Debug, Clone)]
pub struct DeltaNetWeights {
    /// {n_embd, conv_dim}: [q | k | v].
    pub qkv: Weight,
    /// {n_embd, Hv·dv}: the output gate z.
    pub gate: Weight,
    pub beta_alpha: BetaAlpha,
    /// −exp(A_log), per value head.
    pub a: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// conv_dim rows of d_conv taps, taps contiguous.
    pub conv: Vec<f32>,
    /// Gated RMSNorm weight over dv (not +1-shifted).
    pub norm: Vec<f32>,
    pub out: Weight,
}

#[derive(Debug, Clone)]
pub enum Mixer {
    Attention(AttentionWeights),
    DeltaNet(DeltaNetWeights),
}

#[derive(Debug, Clone)]
pub struct SharedExpert {
    /// The scalar gate: sigmoid(gate_inp · x).
    pub gate_inp: Vec<f32>,
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Router {n_embd, n_expert}.
    pub router: Weight,
    /// {n_embd, n_ff_exp, n_expert}.
    pub gate_exps: Weight,
    pub up_exps: Weight,
    /// {n_ff_exp, n_embd, n_expert}.
    pub down_exps: Weight,
    pub shared: Option<SharedExpert>,
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub mixer: Mixer,
    /// Pre-FFN norm (`post_attention_norm` in the hybrids, `ffn_norm` in qwen3moe).
    pub ffn_norm: Vec<f32>,
    pub moe: MoeWeights,
}

#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub token_embd: Weight,
    pub output_norm: Vec<f32>,
    /// The LM head (`output`, or `token_embd` when the file ties them).
    pub output: Weight,
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    /// Looks up and checks every trunk tensor. Unsupported tensor types anywhere
    /// in the file are refused first, by name, before any memory is allocated.
    pub fn load(file: &Arc<GgufFile>, cfg: &ModelConfig) -> Result<ModelWeights, ModelError> {
        for t in file.tensors() {
            if !quant::is_supported(t.ty) {
                return Err(ModelError::UnsupportedType {
                    name: t.name.clone(),
                    ty: t.ty,
                });
            }
        }
        let l = Loader::new(file);
        let e = cfg.n_embd;
        let token_embd = l.get("token_embd.weight", &[e, cfg.n_vocab])?;
        let output = match l.opt("output.weight", &[e, cfg.n_vocab])? {
            Some(w) => w,
            None => token_embd.clone(),
        };
        let output_norm = l.get("output_norm.weight", &[e])?.to_f32();
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            layers.push(crate::arch::load_layer(&l, cfg, i)?);
        }
        Ok(ModelWeights {
            token_embd,
            output_norm,
            output,
            layers,
        })
    }
}

/// Tensors shared by every arch's layer: the MoE block.
pub(crate) fn load_moe(l: &Loader, cfg: &ModelConfig, i: usize) -> Result<MoeWeights, ModelError> {
    let (e, f, n) = (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert);
    let p = |s: &str| format!("blk.{i}.{s}");
    if l.has(&p("ffn_gate_up_exps.weight")) {
        return Err(ModelError::Unsupported(format!(
            "{}: fused gate/up expert tensors are not supported yet; convert without fusing",
            p("ffn_gate_up_exps.weight")
        )));
    }
    let shared = if cfg.n_ff_shexp > 0 {
        let s = cfg.n_ff_shexp;
        Some(SharedExpert {
            gate_inp: l.get(&p("ffn_gate_inp_shexp.weight"), &[e])?.to_f32(),
            gate: l.get(&p("ffn_gate_shexp.weight"), &[e, s])?,
            up: l.get(&p("ffn_up_shexp.weight"), &[e, s])?,
            down: l.get(&p("ffn_down_shexp.weight"), &[s, e])?,
        })
    } else {
        None
    };
    Ok(MoeWeights {
        router: l.get(&p("ffn_gate_inp.weight"), &[e, n])?,
        gate_exps: l.get(&p("ffn_gate_exps.weight"), &[e, f, n])?,
        up_exps: l.get(&p("ffn_up_exps.weight"), &[e, f, n])?,
        down_exps: l.get(&p("ffn_down_exps.weight"), &[f, e, n])?,
        shared,
    })
}

/// Attention tensors; `q_width` is n_head·head_dim, doubled when the output is gated.
pub(crate) fn load_attention(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
) -> Result<AttentionWeights, ModelError> {
    let e = cfg.n_embd;
    let hd = cfg.head_dim;
    let p = |s: &str| format!("blk.{i}.{s}");
    let q_width = cfg.n_head * hd * if cfg.attn_output_gate { 2 } else { 1 };
    Ok(AttentionWeights {
        q: l.get(&p("attn_q.weight"), &[e, q_width])?,
        k: l.get(&p("attn_k.weight"), &[e, cfg.n_head_kv * hd])?,
        v: l.get(&p("attn_v.weight"), &[e, cfg.n_head_kv * hd])?,
        o: l.get(&p("attn_output.weight"), &[cfg.n_head * hd, e])?,
        q_norm: l.get(&p("attn_q_norm.weight"), &[hd])?.to_f32(),
        k_norm: l.get(&p("attn_k_norm.weight"), &[hd])?.to_f32(),
    })
}

/// DeltaNet tensors common to both hybrids; `beta_alpha` is arch-specific.
pub(crate) fn load_deltanet(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
    beta_alpha: BetaAlpha,
) -> Result<DeltaNetWeights, ModelError> {
    let ssm = cfg
        .ssm
        .as_ref()
        .ok_or_else(|| ModelError::Unsupported("DeltaNet layer without ssm config".into()))?;
    let e = cfg.n_embd;
    let p = |s: &str| format!("blk.{i}.{s}");
    let hv = ssm.n_v_heads;
    Ok(DeltaNetWeights {
        qkv: l.get(&p("attn_qkv.weight"), &[e, ssm.conv_dim()])?,
        gate: l.get(&p("attn_gate.weight"), &[e, ssm.value_dim()])?,
        beta_alpha,
        a: l.get(&p("ssm_a"), &[hv])?.to_f32(),
        dt_bias: l.get(&p("ssm_dt.bias"), &[hv])?.to_f32(),
        conv: l
            .get(&p("ssm_conv1d.weight"), &[ssm.d_conv, ssm.conv_dim()])?
            .to_f32(),
        norm: l.get(&p("ssm_norm.weight"), &[ssm.d_state])?.to_f32(),
        out: l.get(&p("ssm_out.weight"), &[ssm.value_dim(), e])?,
    })
}

pub(crate) fn load_common(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
    mixer: Mixer,
    ffn_norm_name: &str,
) -> Result<LayerWeights, ModelError> {
    let e = cfg.n_embd;
    debug_assert!(matches!(
        (&mixer, cfg.layer_kinds[i]),
        (Mixer::Attention(_), LayerKind::Attention) | (Mixer::DeltaNet(_), LayerKind::DeltaNet)
    ));
    Ok(LayerWeights {
        attn_norm: l.get(&format!("blk.{i}.attn_norm.weight"), &[e])?.to_f32(),
        mixer,
        ffn_norm: l
            .get(&format!("blk.{i}.{ffn_norm_name}.weight"), &[e])?
            .to_f32(),
        moe: load_moe(l, cfg, i)?,
    })
}

/// A hybrid arch's layer: DeltaNet or gated attention by the layer's kind, then
/// the MoE block. `beta_alpha` loads the arch's own β/α projections.
pub(crate) fn load_hybrid_layer(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
    beta_alpha: impl FnOnce(usize) -> Result<BetaAlpha, ModelError>,
) -> Result<LayerWeights, ModelError> {
    let mixer = match cfg.layer_kinds[i] {
        LayerKind::Attention => Mixer::Attention(load_attention(l, cfg, i)?),
        LayerKind::DeltaNet => {
            let hv = cfg.ssm.as_ref().map(|s| s.n_v_heads).unwrap_or(0);
            Mixer::DeltaNet(load_deltanet(l, cfg, i, beta_alpha(hv)?)?)
        }
    };
    load_common(l, cfg, i, mixer, "post_attention_norm")
}
