//! The weights the forward pass reads, looked up through the arch's tensor table
//! ([`crate::tensors`]: names and shapes), each shape checked against the config
//! before anything runs.

use crate::config::{LayerKind, ModelConfig};
use crate::tensors::{self, ArchTable, BlockKind, TensorDef, TensorId};
use crate::ModelError;
use gguf::{GgmlType, GgufFile};
use std::cell::RefCell;
use std::collections::BTreeSet;
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
    /// The matrix's second-level scale (`<matrix>.scale`, as NVFP4 files converted from
    /// NVIDIA's FP4 checkpoints carry): a factor on every product with it, one value
    /// for a matrix or for every expert of a stack, or one per expert. `None`: 1.
    scale: Option<Arc<[f32]>>,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ty, self.dims)
    }
}

impl Weight {
    /// The factor on each product with matrix `e` (expert e of a stack, 0 for a
    /// matrix) when the file gives one: the product's values are multiplied by it,
    /// one f32 multiplication each, before anything else reads them.
    pub fn scale(&self, e: usize) -> Option<f32> {
        self.scale
            .as_ref()
            .map(|s| if s.len() == 1 { s[0] } else { s[e] })
    }
    /// The file the tensor lives in (offsets and shard paths for direct reads).
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }
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
    /// Names of the tensors handed out (what the tests check against the file).
    read: RefCell<BTreeSet<String>>,
    /// The `.scale` tensors attached to the matrices handed out.
    scales: RefCell<BTreeSet<String>>,
}

impl<'a> Loader<'a> {
    pub fn new(file: &'a Arc<GgufFile>) -> Self {
        Loader {
            file,
            read: RefCell::new(BTreeSet::new()),
            scales: RefCell::new(BTreeSet::new()),
        }
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
            .tensor_position(name)
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
        self.read.borrow_mut().insert(name.to_string());
        Ok(Weight {
            file: self.file.clone(),
            index,
            name: name.to_string(),
            ty: t.ty,
            dims: found,
            scale: None,
        })
    }

    pub fn opt(&self, name: &str, dims: &[usize]) -> Result<Option<Weight>, ModelError> {
        if self.has(name) {
            self.get(name, dims).map(Some)
        } else {
            Ok(None)
        }
    }

    /// `w` with its second-level scale attached when the file has one: `<stem>.scale`
    /// beside `<stem>.weight` (llama.cpp's converter), or `<name>.scale`. One value, or
    /// for a stack of experts one per expert; finite.
    fn scaled(&self, mut w: Weight) -> Result<Weight, ModelError> {
        let Some(name) = scale_names(&w.name).into_iter().find(|n| self.has(n)) else {
            return Ok(w);
        };
        let n_mat = w.dims.get(2).copied().unwrap_or(1);
        let t = self.file.tensor(&name).expect("found above");
        let found: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        let n: usize = found.iter().product();
        let float = matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if !float || (n != 1 && n != n_mat) {
            let per = if n_mat > 1 {
                format!(" or {n_mat} (one per expert)")
            } else {
                String::new()
            };
            return Err(ModelError::Unsupported(format!(
                "tensor `{name}`: the second-level scale of `{}` should be 1{per} F32 \
                 values, the file has {} {found:?}: the file is damaged or from a \
                 converter scoria does not know; convert it again",
                w.name, t.ty
            )));
        }
        let s = self.get(&name, &[n])?.to_f32();
        if let Some(i) = s.iter().position(|v| !v.is_finite()) {
            return Err(ModelError::Unsupported(format!(
                "tensor `{name}`: value {i} is {}, not a scale: the file is damaged; convert it again",
                s[i]
            )));
        }
        self.scales.borrow_mut().insert(name);
        w.scale = Some(s.into());
        Ok(w)
    }
}

/// Refuses a second-level scale the loader read the tensor of but did not attach (a
/// scale on an embedding, a norm or another vector), or of a tensor the file does not
/// have: no product applies it, so the file would compute wrong outputs. Scales of
/// tensors not read (an MTP block past the first) are not looked at.
fn unapplied_scales(l: &Loader) -> Result<(), ModelError> {
    let read = l.read.borrow();
    let scales = l.scales.borrow();
    for t in l.file().tensors() {
        let Some(bases) = scaled_matrix_names(&t.name) else {
            continue;
        };
        // A scale of no tensor at all (`output.scale` in a file whose head is the
        // embedding) would be as silently lost.
        if !bases.iter().any(|n| l.has(n)) {
            return Err(ModelError::Unsupported(format!(
                "tensor `{}`: a second-level scale of `{}`, which the file does not have, \
                 so it would not be applied; this file is not one scoria can run correctly",
                t.name, bases[0]
            )));
        }
        let of = bases.into_iter().find(|n| read.contains(n));
        if let (Some(of), false) = (of, scales.contains(&t.name)) {
            return Err(ModelError::Unsupported(format!(
                "tensor `{}`: a second-level scale on `{of}`, which scoria reads without \
                 a matrix product (an embedding or a vector), so it would not be applied; \
                 this file is not one scoria can run correctly",
                t.name
            )));
        }
    }
    Ok(())
}

/// Where a matrix's second-level scale may be stored: `<stem>.scale` for
/// `<stem>.weight` (llama.cpp's converter; first), and `<name>.scale`.
pub fn scale_names(name: &str) -> Vec<String> {
    let mut names = Vec::with_capacity(2);
    if let Some(stem) = name.strip_suffix(".weight") {
        names.push(format!("{stem}.scale"));
    }
    names.push(format!("{name}.scale"));
    names
}

/// The matrices a tensor named `scale` may be the second-level scale of
/// (`<base>.weight`, then `<base>` for `<base>.scale`: [`scale_names`] the other way
/// round); None for a name that is no scale's.
pub fn scaled_matrix_names(scale: &str) -> Option<[String; 2]> {
    let base = scale.strip_suffix(".scale")?;
    Some([format!("{base}.weight"), base.to_string()])
}

/// The tensors of the trunk or of one block, named and shaped by the arch's table.
struct Tensors<'a> {
    l: &'a Loader<'a>,
    table: &'static ArchTable,
    cfg: &'a ModelConfig,
    block: Option<usize>,
}

impl Tensors<'_> {
    fn def(&self, id: TensorId) -> Result<&'static TensorDef, ModelError> {
        self.table.def(id).ok_or_else(|| {
            ModelError::Unsupported(format!(
                "internal: the {} tensor table has no {id:?}",
                self.table.arch
            ))
        })
    }

    /// Whether this block carries `id` (the arch has it and the block is of a kind that does).
    fn carries(&self, id: TensorId) -> bool {
        let kind = BlockKind::of(self.cfg, self.block.unwrap_or(0));
        self.table
            .def(id)
            .is_some_and(|d| self.block.is_none() || d.when.applies(kind, self.cfg))
    }

    /// A matrix the kernels multiply by: its rows must be ones the CPU dot kernels run;
    /// its second-level scale attached when the file has one.
    fn get(&self, id: TensorId) -> Result<Weight, ModelError> {
        self.l.scaled(kernel_rows(self.lookup(id)?)?)
    }

    fn lookup(&self, id: TensorId) -> Result<Weight, ModelError> {
        let d = self.def(id)?;
        self.l.get(&d.name_in(self.block), &d.dims(self.cfg))
    }

    /// A matrix the table marks optional: `None` when the file leaves it out.
    fn opt(&self, id: TensorId) -> Result<Option<Weight>, ModelError> {
        let d = self.def(id)?;
        if d.optional {
            self.l
                .opt(&d.name_in(self.block), &d.dims(self.cfg))?
                .map(|w| self.l.scaled(kernel_rows(w)?))
                .transpose()
        } else {
            self.get(id).map(Some)
        }
    }

    /// A vector (norm, gate, per-head parameter) as f32: only converted, so any length.
    fn vector(&self, id: TensorId) -> Result<Vec<f32>, ModelError> {
        Ok(self.lookup(id)?.to_f32())
    }
}

/// `w` if the dot kernels can run its rows (`quant::row_bytes`: float rows of any
/// length, quantized rows of whole 32-value sub-blocks), else the refusal by name, so
/// that nothing a kernel cannot run reaches the first forward pass.
fn kernel_rows(w: Weight) -> Result<Weight, ModelError> {
    check_kernel_rows(&w.name, w.ty, w.row_len())?;
    Ok(w)
}

/// The check of [`kernel_rows`]. A GGUF already holds whole blocks, and for every
/// supported type whole blocks are whole sub-blocks, so today this refuses nothing a
/// valid file holds; it keeps the kernels' rule in front of them for new types.
fn check_kernel_rows(name: &str, ty: GgmlType, row_len: usize) -> Result<(), ModelError> {
    quant::row_bytes(ty, row_len).map(|_| ()).map_err(|e| {
        ModelError::Unsupported(format!(
            "tensor `{name}` has rows the matrix kernels cannot run: {e}"
        ))
    })
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
    /// qwen3next: `ssm_ba` {n_embd, 2·Hv}. Value head h's β is element `beta_rows[h]`
    /// of the projection's output row, its α element `alpha_rows[h]` (the layout is
    /// described in `arch/qwen3next.rs`, which builds these indices).
    Fused {
        w: Weight,
        beta_rows: Vec<u32>,
        alpha_rows: Vec<u32>,
    },
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
    /// The first MTP (NextN) block, when the file has one: what speculative decoding
    /// drafts with.
    pub mtp: Option<MtpWeights>,
}

/// An MTP block: the next token's embedding and the trunk's post-norm hidden state,
/// each RMS-normed (`enorm`, `hnorm`), joined [embedding | hidden] and projected
/// (`eh_proj`), one full-attention layer with its MoE block, then `head_norm` before
/// the shared LM head.
#[derive(Debug, Clone)]
pub struct MtpWeights {
    pub eh_proj: Weight,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub head_norm: Vec<f32>,
    pub layer: LayerWeights,
}

impl ModelWeights {
    /// Looks up and checks every trunk tensor the arch's table lists. Unsupported tensor
    /// types anywhere in the file are refused first, by name, before any memory is
    /// allocated.
    pub fn load(file: &Arc<GgufFile>, cfg: &ModelConfig) -> Result<ModelWeights, ModelError> {
        Self::load_with(&Loader::new(file), cfg)
    }

    fn load_with(l: &Loader, cfg: &ModelConfig) -> Result<ModelWeights, ModelError> {
        for t in l.file().tensors() {
            if !quant::is_supported(t.ty) {
                return Err(ModelError::UnsupportedType {
                    name: t.name.clone(),
                    ty: t.ty,
                });
            }
        }
        let table = tensors::table(cfg.arch);
        let trunk = Tensors {
            l,
            table,
            cfg,
            block: None,
        };
        // Embedding rows are read, not multiplied by: no scale (a file that gives
        // `token_embd` one is refused below, as llama.cpp would ignore it).
        let token_embd = kernel_rows(trunk.lookup(TensorId::TokenEmbd)?)?;
        let output = match trunk.opt(TensorId::Output)? {
            Some(w) => w,
            None => token_embd.clone(),
        };
        let output_norm = trunk.vector(TensorId::OutputNorm)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let b = Tensors {
                block: Some(i),
                ..trunk
            };
            layers.push(load_layer(&b, i, cfg.layer_kinds[i])?);
        }
        let mtp = if cfg.n_nextn > 0 {
            let i = cfg.n_layer;
            let b = Tensors {
                block: Some(i),
                ..trunk
            };
            let mtp = (|| {
                Ok::<_, ModelError>(MtpWeights {
                    eh_proj: b.get(TensorId::NextnEhProj)?,
                    enorm: b.vector(TensorId::NextnEnorm)?,
                    hnorm: b.vector(TensorId::NextnHnorm)?,
                    head_norm: b.vector(TensorId::NextnSharedHeadNorm)?,
                    layer: load_layer(&b, i, LayerKind::Attention)?,
                })
            })();
            // The trunk runs without it: a file whose MTP block cannot be read only
            // loses MTP drafts.
            match mtp {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!("the MTP block is unusable (no MTP drafts): {e}");
                    None
                }
            }
        } else {
            None
        };
        unapplied_scales(l)?;
        Ok(ModelWeights {
            token_embd,
            output_norm,
            output,
            layers,
            mtp,
        })
    }
}

/// Block `i` (a trunk layer, or an MTP block's layer): its mixer of `kind`, then the
/// MoE block.
fn load_layer(b: &Tensors, i: usize, kind: LayerKind) -> Result<LayerWeights, ModelError> {
    let cfg = b.cfg;
    for r in b.table.refused {
        let name = format!("blk.{i}.{}", r.name);
        if b.l.has(&name) {
            return Err(ModelError::Unsupported(format!("{name}: {}", r.why)));
        }
    }
    use TensorId as T;
    let mixer = match kind {
        LayerKind::Attention => Mixer::Attention(AttentionWeights {
            q: b.get(T::AttnQ)?,
            k: b.get(T::AttnK)?,
            v: b.get(T::AttnV)?,
            o: b.get(T::AttnOutput)?,
            q_norm: b.vector(T::AttnQNorm)?,
            k_norm: b.vector(T::AttnKNorm)?,
        }),
        LayerKind::DeltaNet => {
            let ssm = cfg.ssm.as_ref().ok_or_else(|| {
                ModelError::Unsupported("DeltaNet layer without ssm config".into())
            })?;
            let beta_alpha = if b.carries(T::SsmBa) {
                // The fused layout is HF's `in_proj_ba`, whichever arch stores it.
                let (beta_rows, alpha_rows) =
                    crate::arch::qwen3next::ba_rows(ssm.n_k_heads, ssm.n_v_heads);
                BetaAlpha::Fused {
                    w: b.get(T::SsmBa)?,
                    beta_rows,
                    alpha_rows,
                }
            } else {
                BetaAlpha::Separate {
                    beta: b.get(T::SsmBeta)?,
                    alpha: b.get(T::SsmAlpha)?,
                }
            };
            Mixer::DeltaNet(DeltaNetWeights {
                qkv: b.get(T::AttnQkv)?,
                gate: b.get(T::AttnGate)?,
                beta_alpha,
                a: b.vector(T::SsmA)?,
                dt_bias: b.vector(T::SsmDtBias)?,
                conv: b.vector(T::SsmConv1d)?,
                norm: b.vector(T::SsmNorm)?,
                out: b.get(T::SsmOut)?,
            })
        }
    };
    let shared = if b.carries(T::FfnGateInpShexp) {
        Some(SharedExpert {
            gate_inp: b.vector(T::FfnGateInpShexp)?,
            gate: b.get(T::FfnGateShexp)?,
            up: b.get(T::FfnUpShexp)?,
            down: b.get(T::FfnDownShexp)?,
        })
    } else {
        None
    };
    Ok(LayerWeights {
        attn_norm: b.vector(T::AttnNorm)?,
        mixer,
        ffn_norm: b.vector(T::FfnNorm)?,
        moe: MoeWeights {
            router: b.get(T::FfnGateInp)?,
            gate_exps: b.get(T::FfnGateExps)?,
            up_exps: b.get(T::FfnUpExps)?,
            down_exps: b.get(T::FfnDownExps)?,
            shared,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arch;
    use crate::geometry::{Geometry, ARCHS};
    use crate::synth::{self, Preset, SynthOptions};
    use std::path::{Path, PathBuf};

    /// Loads `path` and checks that the loader read every tensor of the file's trunk and
    /// of its first MTP block, and that everything else is an MTP block tensor the
    /// table lists: nothing in the file is unaccounted for.
    fn load_and_account(path: &Path) -> (ModelConfig, ModelWeights) {
        let file = Arc::new(GgufFile::open(path).unwrap());
        let cfg = ModelConfig::from_gguf(&file).unwrap();
        let l = Loader::new(&file);
        let w = ModelWeights::load_with(&l, &cfg).unwrap();
        let read = l.read.borrow();
        let table = tensors::table(cfg.arch);
        for t in file.tensors() {
            // A second-level scale is read with its matrix (the test below).
            if t.name.ends_with(".scale") {
                continue;
            }
            let (block, _) = table
                .find(&t.name)
                .unwrap_or_else(|| panic!("{}: {} is not in the table", path.display(), t.name));
            // The trunk, and the first MTP block when the loader kept it.
            let in_trunk = block.is_none_or(|b| b < cfg.n_layer);
            let mtp = block == Some(cfg.n_layer) && w.mtp.is_some();
            assert_eq!(
                read.contains(&t.name),
                in_trunk || mtp,
                "{}: {} read by the loader: {}",
                path.display(),
                t.name,
                read.contains(&t.name)
            );
        }
        assert!(read.iter().all(|n| file.tensor(n).is_some()));
        (cfg, w)
    }

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("scoria-weights-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn tiny_models_of_every_arch_load_every_trunk_tensor() {
        for arch in ARCHS {
            let g = Geometry::by_name(Some(arch), "tiny").unwrap();
            let path = scratch(&format!("{}.gguf", g.name));
            let opts = SynthOptions {
                preset: Preset::Q8_0,
                seed: 5,
                sync: false,
            };
            synth::synthesize(&path, &g, &opts, &|_, _| {}).unwrap();
            let (cfg, w) = load_and_account(&path);
            // The loader and synth derive the config the same way.
            assert_eq!(cfg, g.config().unwrap(), "{}", g.name);
            assert_eq!(w.layers.len(), cfg.n_layer);
            assert_eq!(w.output.name, "output.weight");
            for (i, layer) in w.layers.iter().enumerate() {
                match (&layer.mixer, cfg.layer_kinds[i]) {
                    (Mixer::Attention(a), LayerKind::Attention) => {
                        assert_eq!(
                            a.q.n_rows(),
                            cfg.n_head * cfg.head_dim * if arch.is_hybrid() { 2 } else { 1 }
                        );
                    }
                    (Mixer::DeltaNet(d), LayerKind::DeltaNet) => {
                        let ssm = cfg.ssm.as_ref().unwrap();
                        match (&d.beta_alpha, arch) {
                            (
                                BetaAlpha::Fused {
                                    w,
                                    beta_rows,
                                    alpha_rows,
                                },
                                Arch::Qwen3Next,
                            ) => {
                                assert_eq!(w.n_rows(), 2 * ssm.n_v_heads);
                                // Hk = 2, Hv = 4: [b0 b1 a0 a1 | b2 b3 a2 a3].
                                assert_eq!(beta_rows, &[0, 1, 4, 5]);
                                assert_eq!(alpha_rows, &[2, 3, 6, 7]);
                            }
                            (BetaAlpha::Separate { beta, alpha }, Arch::Qwen35Moe) => {
                                assert_eq!(beta.name, format!("blk.{i}.ssm_beta.weight"));
                                assert_eq!(alpha.name, format!("blk.{i}.ssm_alpha.weight"));
                            }
                            (ba, _) => panic!("{arch}: layer {i} has {ba:?}"),
                        }
                        assert_eq!(d.conv.len(), ssm.d_conv * ssm.conv_dim());
                    }
                    (m, k) => panic!("{arch}: layer {i} is {k:?} but loaded {m:?}"),
                }
                assert_eq!(layer.moe.shared.is_some(), arch.is_hybrid());
            }
            std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
        }
    }

    /// The converted-checkpoint NVFP4 mix: every NVFP4 matrix of the trunk and the MTP
    /// block gets its `.scale` (one per expert for a stack), and nothing else has one.
    #[test]
    fn second_level_scales_are_attached_to_their_matrices() {
        for arch in ARCHS {
            let g = Geometry::by_name(Some(arch), "tiny").unwrap();
            let path = scratch(&format!("{}-scaled.gguf", g.name));
            let opts = SynthOptions {
                preset: Preset::Mix(synth::Mix::Nvfp4Scaled),
                seed: 5,
                sync: false,
            };
            synth::synthesize(&path, &g, &opts, &|_, _| {}).unwrap();
            let file = Arc::new(GgufFile::open(&path).unwrap());
            let cfg = ModelConfig::from_gguf(&file).unwrap();
            let l = Loader::new(&file);
            let w = ModelWeights::load_with(&l, &cfg).unwrap();
            let mut mats: Vec<&Weight> = vec![&w.output, &w.token_embd];
            let layers = w.layers.iter().chain(w.mtp.as_ref().map(|m| &m.layer));
            for layer in layers {
                match &layer.mixer {
                    Mixer::Attention(a) => mats.extend([&a.q, &a.k, &a.v, &a.o]),
                    Mixer::DeltaNet(d) => {
                        mats.extend([&d.qkv, &d.gate, &d.out]);
                        match &d.beta_alpha {
                            BetaAlpha::Separate { beta, alpha } => mats.extend([beta, alpha]),
                            BetaAlpha::Fused { w, .. } => mats.push(w),
                        }
                    }
                }
                let m = &layer.moe;
                mats.extend([&m.router, &m.gate_exps, &m.up_exps, &m.down_exps]);
                if let Some(sh) = &m.shared {
                    mats.extend([&sh.gate, &sh.up, &sh.down]);
                }
            }
            mats.extend(w.mtp.as_ref().map(|m| &m.eh_proj));
            let mut scaled = 0;
            for m in mats {
                let n_mat = m.dims.get(2).copied().unwrap_or(1);
                let want = m.ty == GgmlType::NVFP4;
                assert_eq!(m.scale(0).is_some(), want, "{}", m.name);
                if want {
                    scaled += 1;
                    let s = m.scale.as_ref().unwrap();
                    assert_eq!(s.len(), n_mat, "{}", m.name);
                    assert!(s.iter().all(|&v| v > 0.0 && v.is_finite()), "{}", m.name);
                }
            }
            let in_file = file.tensors().iter().filter(|t| t.name.ends_with(".scale"));
            let in_file: BTreeSet<String> = in_file.map(|t| t.name.clone()).collect();
            assert_eq!(in_file.len(), scaled, "{}", g.name);
            assert_eq!(*l.scales.borrow(), in_file, "{}", g.name);
            drop(w);
            drop(l);
            drop(file);
            std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
        }
    }

    #[test]
    fn converter_fixtures_load_every_tensor() {
        // Tiny checkpoints converted by llama.cpp's own converter (tools/reference).
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        for arch in ARCHS {
            for file in ["model-f32.gguf", "model-q8_0.gguf"] {
                let (cfg, _) = load_and_account(&root.join(arch.name()).join(file));
                assert_eq!(cfg.arch, arch);
            }
        }
    }

    #[test]
    fn kernel_rows_accept_float_rows_of_any_length_and_refuse_partial_sub_blocks() {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            check_kernel_rows("blk.0.attn_output.weight", ty, 240).unwrap();
        }
        check_kernel_rows("x", GgmlType::Q4_K, 512).unwrap();
        let e = check_kernel_rows("blk.3.attn_output.weight", GgmlType::Q8_0, 48)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blk.3.attn_output.weight"), "{e}");
        let e = check_kernel_rows("x", GgmlType::Q8_1, 256)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no CPU kernel"), "{e}");
    }

    #[test]
    fn a_wrong_shape_is_refused_by_name() {
        let g = Geometry::by_name(Some(Arch::Qwen3Moe), "tiny").unwrap();
        let mut cfg = g.config().unwrap();
        let path = scratch("shape.gguf");
        let opts = SynthOptions {
            preset: Preset::Q8_0,
            seed: 5,
            sync: false,
        };
        synth::synthesize(&path, &g, &opts, &|_, _| {}).unwrap();
        let file = Arc::new(GgufFile::open(&path).unwrap());
        cfg.n_ff_exp *= 2;
        let e = ModelWeights::load(&file, &cfg).unwrap_err().to_string();
        assert!(e.contains("blk.0.ffn_gate_exps.weight"), "{e}");
        drop(file);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
