//! The CUDA executor's copy of the weights: every tensor the forward pass reads,
//! uploaded from the memory-mapped file as its GGUF bytes (no requantization),
//! plus the small per-layer vectors (norms, gates, DeltaNet constants) as f32.
//! Arch facts the kernels need (which key head a value head reads, where β and α
//! sit in a fused projection) arrive here as index arrays, not as code.

use cuda::{CudaError, DevBuf, Gpu};
use model::weights::{BetaAlpha, LayerWeights, Mixer, ModelWeights, MtpWeights, Weight};
use model::{ExecError, ExecErrorKind, ModelConfig};
use quant::GgmlType;
use std::sync::Arc;

/// One weight tensor in VRAM: a matrix, or a stack of expert matrices.
pub(crate) struct DevWeight {
    /// The memory holding it (shared by a tiered layer's three slot matrices).
    pub mem: Arc<DevBuf<u8>>,
    /// The device address of its first matrix.
    pub ptr: u64,
    pub ty: GgmlType,
    pub row_bytes: u64,
    /// Rows of one matrix.
    pub n_rows: usize,
    /// Values per row.
    pub n_cols: usize,
    /// Bytes of one matrix (one expert of a 3-D tensor).
    pub matrix_bytes: u64,
    /// Bytes from one expert's matrix to the next's: `matrix_bytes` for a tensor
    /// as the file holds it; a whole slot (gate, up and down) for slot matrices.
    pub stride: u64,
    /// The second-level scale of each of its matrices when the file gives them
    /// (`model::Weight::scale`): applied after every product with it.
    pub scale: Option<DevScale>,
}

/// A matrix's second-level scales, expert e's at index e (one value for a matrix):
/// on the host for products of one matrix (a launch argument) and for the routes of
/// tiered layers, whose tiles name slots; on the device for resident expert tiles,
/// indexed by the tile's expert.
#[derive(Clone)]
pub(crate) struct DevScale {
    pub host: Arc<[f32]>,
    pub dev: Arc<DevBuf<f32>>,
}

impl DevWeight {
    /// `w`'s shape and type over `buf` (its bytes).
    fn new(w: &Weight, buf: DevBuf<u8>) -> DevWeight {
        let ptr = buf.ptr();
        DevWeight::within(w, Arc::new(buf), ptr, (w.n_rows() * w.row_bytes()) as u64)
    }

    /// `w`'s shape and type at `ptr` inside `mem`, its experts `stride` bytes apart.
    fn within(w: &Weight, mem: Arc<DevBuf<u8>>, ptr: u64, stride: u64) -> DevWeight {
        let (n_rows, row_bytes) = (w.n_rows(), w.row_bytes());
        DevWeight {
            mem,
            ptr,
            ty: w.ty,
            row_bytes: row_bytes as u64,
            n_rows,
            n_cols: w.row_len(),
            matrix_bytes: (n_rows * row_bytes) as u64,
            stride,
            scale: None,
        }
    }

    /// The same matrices at `ptr` inside `mem`: another block laid out as this
    /// one (the prompt pool, holding slots of a layer's layout).
    pub fn moved(&self, mem: &Arc<DevBuf<u8>>, ptr: u64) -> DevWeight {
        DevWeight {
            mem: Arc::clone(mem),
            ptr,
            scale: self.scale.clone(),
            ..*self
        }
    }

    /// This matrix and `next` as one matrix of both's rows, when `next` follows it
    /// in VRAM with rows of the same type and width (the upload puts the layers'
    /// routers back to back): one launch computes both products, each row with the
    /// bits it has alone. Not for matrices with second-level scales (the joined
    /// product's rows would need two).
    pub fn joined(&self, next: &DevWeight) -> Option<DevWeight> {
        let follows = next.ptr == self.ptr + self.matrix_bytes
            && self.scale.is_none()
            && next.scale.is_none()
            && Arc::ptr_eq(&self.mem, &next.mem)
            && next.ty == self.ty
            && next.row_bytes == self.row_bytes
            && next.n_cols == self.n_cols;
        follows.then(|| DevWeight {
            mem: Arc::clone(&self.mem),
            scale: None,
            n_rows: self.n_rows + next.n_rows,
            matrix_bytes: self.matrix_bytes + next.matrix_bytes,
            stride: self.matrix_bytes + next.matrix_bytes,
            ..*self
        })
    }

    /// The matrix as the fused kernels take it.
    pub fn mat(&self) -> cuda::Mat {
        cuda::Mat {
            ty: self.ty,
            ptr: self.ptr,
            expert_bytes: self.stride,
            row_bytes: self.row_bytes,
            n_rows: self.n_rows,
            n_cols: self.n_cols,
        }
    }
}

pub(crate) struct AttnDev {
    pub q: DevWeight,
    pub k: DevWeight,
    pub v: DevWeight,
    pub o: DevWeight,
    pub q_norm: DevBuf<f32>,
    pub k_norm: DevBuf<f32>,
}

/// Where β or α of each value head is found in a projection's output row.
pub(crate) struct Gather {
    /// Index into the projection list of the layer (see `DnDev::proj`).
    pub proj: usize,
    pub stride: usize,
    pub idx: DevBuf<i32>,
}

pub(crate) struct DnDev {
    pub qkv: DevWeight,
    pub gate: DevWeight,
    /// The β/α projections: [beta, alpha] (qwen35moe) or [ba] (qwen3next).
    pub proj: Vec<DevWeight>,
    pub beta: Gather,
    pub alpha: Gather,
    pub a: DevBuf<f32>,
    pub dt_bias: DevBuf<f32>,
    pub conv: DevBuf<f32>,
    pub norm: DevBuf<f32>,
    pub k_head_of: DevBuf<i32>,
    pub out: DevWeight,
}

pub(crate) enum MixerDev {
    Attention(AttnDev),
    DeltaNet(DnDev),
}

pub(crate) struct SharedDev {
    pub gate_inp: DevBuf<f32>,
    pub gate: DevWeight,
    pub up: DevWeight,
    pub down: DevWeight,
}

pub(crate) struct MoeDev {
    pub router: DevWeight,
    pub gate_exps: DevWeight,
    pub up_exps: DevWeight,
    pub down_exps: DevWeight,
    pub shared: Option<SharedDev>,
}

pub(crate) struct LayerDev {
    pub attn_norm: DevBuf<f32>,
    pub ffn_norm: DevBuf<f32>,
    pub mixer: MixerDev,
    pub moe: MoeDev,
}

pub(crate) struct WeightsDev {
    pub token_embd: DevWeight,
    pub output_norm: DevBuf<f32>,
    /// The LM head; None when the file ties it to the embedding.
    pub output: Option<DevWeight>,
    pub layers: Vec<LayerDev>,
    /// Some matrix has second-level scales (`DevWeight::scale`).
    pub scaled: bool,
}

/// The model's MTP (next-next-token) block in VRAM: the projection of the embedded
/// token and the trunk's hidden row side by side, one attention + MoE layer (every
/// expert resident), and the norm before the shared LM head.
pub(crate) struct MtpDev {
    pub eh_proj: DevWeight,
    pub enorm: DevBuf<f32>,
    pub hnorm: DevBuf<f32>,
    pub head_norm: DevBuf<f32>,
    pub layer: LayerDev,
}

impl WeightsDev {
    pub fn lm_head(&self) -> &DevWeight {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}

fn tied(w: &ModelWeights) -> bool {
    w.output.name == w.token_embd.name
}

/// A CUDA error as the executor reports it: a sticky one is fatal (nothing more
/// runs in the context); running out of device memory is not (the context goes on,
/// and the same call may succeed once VRAM is freed), and its message says so and
/// what to do ([`OUT_OF_VRAM`]); the others name their call.
pub(crate) fn cuda_err(op: &str) -> impl Fn(CudaError) -> ExecError + '_ {
    move |e| {
        let text = e.to_string();
        if STICKY.iter().any(|s| text.contains(s)) {
            ExecError::fatal(
                op,
                format!("{text} (the CUDA context cannot run anything more: restart the process)"),
            )
        } else if e.is_out_of_memory() && text.starts_with("cuMemHostAlloc") {
            ExecError::new(
                op,
                format!(
                    "{text}: host memory could not be pinned (the host is short of RAM, or \
                     the GPU of memory to map it: other programs took it): free RAM or \
                     VRAM, or run scoria with a lower --ram-budget"
                ),
            )
        } else if e.is_out_of_memory() {
            ExecError::of_kind(
                ExecErrorKind::OutOfVram,
                op,
                format!("{text}: {OUT_OF_VRAM}"),
            )
        } else {
            ExecError::new(op, text)
        }
    }
}

/// What an out-of-memory error of the GPU adds to its message: scoria checked the
/// free VRAM at startup and allocated its buffers then, so another process took
/// what is missing since.
pub(crate) const OUT_OF_VRAM: &str = "the GPU is out of memory: another process took VRAM \
     since scoria started (nvidia-smi lists them); free the GPU, or run scoria with a lower \
     --vram-budget or --parallel";

/// Whether `e` is a GPU's out-of-memory error (see [`cuda_err`]), which the
/// executor survives.
pub(crate) fn is_out_of_vram(e: &ExecError) -> bool {
    e.kind == ExecErrorKind::OutOfVram
}

/// The CUDA driver's errors that leave the context unusable (every later call fails
/// with them): a kernel that faulted, or the device lost.
const STICKY: &[&str] = &[
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_DEVICE_UNAVAILABLE",
    "CUDA_ERROR_DEVICE_NOT_LICENSED",
];

/// Bytes the upload will take in VRAM (for the startup check).
pub(crate) fn upload_bytes(w: &ModelWeights) -> u64 {
    let mut n = w.token_embd.bytes().len() as u64 + w.output_norm.len() as u64 * 4;
    if !tied(w) {
        n += w.output.bytes().len() as u64;
    }
    n + w.layers.iter().map(layer_bytes).sum::<u64>()
}

/// Bytes a layer's upload takes (its routed experts included).
fn layer_bytes(l: &LayerWeights) -> u64 {
    let mut n = (l.attn_norm.len() + l.ffn_norm.len()) as u64 * 4;
    match &l.mixer {
        Mixer::Attention(a) => {
            for m in [&a.q, &a.k, &a.v, &a.o] {
                n += m.bytes().len() as u64;
            }
            n += (a.q_norm.len() + a.k_norm.len()) as u64 * 4;
        }
        Mixer::DeltaNet(d) => {
            for m in [&d.qkv, &d.gate, &d.out] {
                n += m.bytes().len() as u64;
            }
            match &d.beta_alpha {
                BetaAlpha::Separate { beta, alpha } => {
                    n += (beta.bytes().len() + alpha.bytes().len()) as u64
                }
                BetaAlpha::Fused { w, .. } => n += w.bytes().len() as u64,
            }
            n += (d.a.len() + d.dt_bias.len() + d.conv.len() + d.norm.len()) as u64 * 4;
        }
    }
    let m = &l.moe;
    for t in [&m.router, &m.gate_exps, &m.up_exps, &m.down_exps] {
        n += t.bytes().len() as u64;
    }
    if let Some(s) = &m.shared {
        n += (s.gate.bytes().len() + s.up.bytes().len() + s.down.bytes().len()) as u64;
        n += s.gate_inp.len() as u64 * 4;
    }
    n
}

/// Bytes the MTP block's upload takes ([`upload_mtp`]).
pub(crate) fn mtp_bytes(m: &MtpWeights) -> u64 {
    let norms = (m.enorm.len() + m.hnorm.len() + m.head_norm.len()) as u64 * 4;
    m.eh_proj.bytes().len() as u64 + norms + layer_bytes(&m.layer)
}

/// Bytes of the routed experts' tensors (what tiers instead of uploading).
pub(crate) fn routed_expert_bytes(w: &ModelWeights) -> u64 {
    w.layers
        .iter()
        .map(|l| {
            let m = &l.moe;
            (m.gate_exps.bytes().len() + m.up_exps.bytes().len() + m.down_exps.bytes().len()) as u64
        })
        .sum()
}

/// Every matrix the upload reads or tiers (the routed experts included).
fn matrices(w: &ModelWeights) -> Vec<&Weight> {
    let mut v = vec![&w.token_embd];
    if !tied(w) {
        v.push(&w.output);
    }
    for l in &w.layers {
        match &l.mixer {
            Mixer::Attention(a) => v.extend([&a.q, &a.k, &a.v, &a.o]),
            Mixer::DeltaNet(d) => {
                v.extend([&d.qkv, &d.gate, &d.out]);
                match &d.beta_alpha {
                    BetaAlpha::Separate { beta, alpha } => v.extend([beta, alpha]),
                    BetaAlpha::Fused { w, .. } => v.push(w),
                }
            }
        }
        let m = &l.moe;
        v.extend([&m.router, &m.gate_exps, &m.up_exps, &m.down_exps]);
        if let Some(s) = &m.shared {
            v.extend([&s.gate, &s.up, &s.down]);
        }
    }
    v
}

/// Refuses a model whose shape the GPU kernels are not built for (`cuda::shapes`:
/// head and state widths, conv width, expert counts), naming the GGUF keys, before
/// anything is allocated.
pub(crate) fn check_shape(cfg: &ModelConfig) -> Result<(), ExecError> {
    let shape = cuda::shapes::ModelShape {
        head_dim: cfg.head_dim,
        n_expert: cfg.n_expert,
        top_k: cfg.n_expert_used,
        deltanet: cfg.ssm.as_ref().map(|s| (s.d_state, s.d_conv)),
    };
    cuda::shapes::check(cfg.arch.name(), &shape).map_err(|e| ExecError::new("load", e))
}

/// Refuses a model the GPU kernels cannot run, by tensor name, before anything is
/// allocated: a tensor type without CUDA kernels, or rows that are not whole 32-value
/// groups ([`check_width`]).
pub(crate) fn check_tensors(w: &ModelWeights) -> Result<(), ExecError> {
    matrices(w).into_iter().try_for_each(check_width)
}

/// Whether any matrix of `w` has a second-level scale.
fn has_scales(w: &ModelWeights) -> bool {
    matrices(w).iter().any(|m| m.scale(0).is_some())
}

/// The GPU kernels read rows in 32-value groups (the activation's quantization
/// blocks): a row of another width is refused at load by tensor name, before anything
/// runs (the CPU executor runs it); so is a type the kernels do not read.
fn check_width(w: &Weight) -> Result<(), ExecError> {
    if !cuda::supports_type(w.ty) {
        return Err(ExecError::new(
            "upload weights",
            format!(
                "{}: tensor type {} has no CUDA kernel; run this model on the CPU (--device cpu)",
                w.name, w.ty
            ),
        ));
    }
    let n = w.row_len();
    if n == 0 || !n.is_multiple_of(32) {
        return Err(ExecError::new(
            "upload weights",
            format!(
                "{}: rows of {n} values are not a multiple of 32, which the CUDA kernels need; run this model on the CPU (--device cpu)",
                w.name
            ),
        ));
    }
    Ok(())
}

struct Uploader<'a> {
    gpu: &'a Gpu,
    done: u64,
    progress: &'a dyn Fn(u64),
}

impl Uploader<'_> {
    fn weight(&mut self, w: &Weight) -> Result<DevWeight, ExecError> {
        check_width(w)?;
        let bytes = w.bytes();
        let buf = self
            .gpu
            .upload(bytes, &w.name)
            .map_err(cuda_err("upload weights"))?;
        self.done += bytes.len() as u64;
        (self.progress)(self.done);
        Ok(DevWeight {
            scale: self.scale(w)?,
            ..DevWeight::new(w, buf)
        })
    }

    /// `w`'s second-level scales on the device and the host, one per matrix, when it
    /// has them.
    fn scale(&mut self, w: &Weight) -> Result<Option<DevScale>, ExecError> {
        if w.scale(0).is_none() {
            return Ok(None);
        }
        let n = w.dims.get(2).copied().unwrap_or(1).max(1);
        let host: Arc<[f32]> = (0..n).map(|e| w.scale(e).unwrap_or(1.0)).collect();
        let dev = self.f32s(&host, &format!("{} second-level scales", w.name))?;
        Ok(Some(DevScale {
            host,
            dev: Arc::new(dev),
        }))
    }

    /// The layers' routers (`ws`, in layer order) in one block, back to back, so that
    /// a layer's router and the next one's are one matrix ([`DevWeight::joined`]);
    /// each in its own block when their types or shapes differ.
    fn routers(&mut self, ws: &[&Weight]) -> Result<Vec<DevWeight>, ExecError> {
        let len = |w: &Weight| w.n_rows() * w.row_bytes();
        let alike = ws.windows(2).all(|p| {
            p[0].ty == p[1].ty && p[0].row_bytes() == p[1].row_bytes() && len(p[0]) == len(p[1])
        }) && ws.iter().all(|w| w.bytes().len() == len(w));
        let Some(first) = ws.first().filter(|_| alike) else {
            return ws.iter().map(|w| self.weight(w)).collect();
        };
        let each = len(first);
        let mem = Arc::new(
            self.gpu
                .alloc::<u8>(each * ws.len(), &first.name)
                .map_err(cuda_err("upload weights"))?,
        );
        let mut out = Vec::with_capacity(ws.len());
        for (i, w) in ws.iter().enumerate() {
            check_width(w)?;
            let ptr = mem.ptr() + (i * each) as u64;
            self.gpu
                .copy_to_device(w.bytes(), ptr)
                .map_err(cuda_err("upload weights"))?;
            self.done += each as u64;
            (self.progress)(self.done);
            out.push(DevWeight {
                scale: self.scale(w)?,
                ..DevWeight::within(w, Arc::clone(&mem), ptr, each as u64)
            });
        }
        Ok(out)
    }

    /// Room for `n` experts of a layer's gate, up and down tensors (VRAM slots), not
    /// filled: one block of `n` slots, each holding an expert's three matrices one
    /// after another as the pinned RAM copy does, so one copy fills a slot.
    fn slots(&mut self, ws: [&Weight; 3], n: usize) -> Result<[DevWeight; 3], ExecError> {
        let mut at = [0u64; 3];
        let mut slot = 0u64;
        for (j, w) in ws.iter().enumerate() {
            check_width(w)?;
            at[j] = slot;
            slot += (w.n_rows() * w.row_bytes()) as u64;
        }
        let mem = Arc::new(
            self.gpu
                .alloc::<u8>(n * slot as usize, &ws[0].name)
                .map_err(cuda_err("allocate expert slots"))?,
        );
        let base = mem.ptr();
        let scales = [self.scale(ws[0])?, self.scale(ws[1])?, self.scale(ws[2])?];
        Ok(std::array::from_fn(|j| DevWeight {
            scale: scales[j].clone(),
            ..DevWeight::within(ws[j], Arc::clone(&mem), base + at[j], slot)
        }))
    }

    /// Layer `i` of the model (`router`: its router, uploaded with the others; `slots`:
    /// the expert slots of a tiered layer, whose expert tensors are then slot buffers).
    fn layer(
        &mut self,
        cfg: &ModelConfig,
        i: usize,
        l: &LayerWeights,
        router: DevWeight,
        slots: Option<usize>,
    ) -> Result<LayerDev, ExecError> {
        let up = self;
        let mixer = match &l.mixer {
            Mixer::Attention(a) => MixerDev::Attention(AttnDev {
                q: up.weight(&a.q)?,
                k: up.weight(&a.k)?,
                v: up.weight(&a.v)?,
                o: up.weight(&a.o)?,
                q_norm: up.f32s(&a.q_norm, "attn_q_norm")?,
                k_norm: up.f32s(&a.k_norm, "attn_k_norm")?,
            }),
            Mixer::DeltaNet(d) => {
                let ssm = cfg.ssm.as_ref().ok_or_else(|| {
                    ExecError::new(
                        "upload weights",
                        format!("layer {i}: DeltaNet without ssm config"),
                    )
                })?;
                let hv = ssm.n_v_heads;
                let identity: Vec<i32> = (0..hv as i32).collect();
                let (proj, beta, alpha) = match &d.beta_alpha {
                    BetaAlpha::Separate { beta, alpha } => (
                        vec![up.weight(beta)?, up.weight(alpha)?],
                        Gather {
                            proj: 0,
                            stride: hv,
                            idx: up.i32s(&identity, "beta index")?,
                        },
                        Gather {
                            proj: 1,
                            stride: hv,
                            idx: up.i32s(&identity, "alpha index")?,
                        },
                    ),
                    BetaAlpha::Fused {
                        w,
                        beta_rows,
                        alpha_rows,
                    } => {
                        let b: Vec<i32> = beta_rows.iter().map(|&r| r as i32).collect();
                        let a: Vec<i32> = alpha_rows.iter().map(|&r| r as i32).collect();
                        (
                            vec![up.weight(w)?],
                            Gather {
                                proj: 0,
                                stride: 2 * hv,
                                idx: up.i32s(&b, "beta index")?,
                            },
                            Gather {
                                proj: 0,
                                stride: 2 * hv,
                                idx: up.i32s(&a, "alpha index")?,
                            },
                        )
                    }
                };
                let k_head_of: Vec<i32> = (0..hv).map(|h| ssm.k_head_of(h) as i32).collect();
                MixerDev::DeltaNet(DnDev {
                    qkv: up.weight(&d.qkv)?,
                    gate: up.weight(&d.gate)?,
                    proj,
                    beta,
                    alpha,
                    a: up.f32s(&d.a, "ssm_a")?,
                    dt_bias: up.f32s(&d.dt_bias, "ssm_dt.bias")?,
                    conv: up.f32s(&d.conv, "ssm_conv1d")?,
                    norm: up.f32s(&d.norm, "ssm_norm")?,
                    k_head_of: up.i32s(&k_head_of, "k head map")?,
                    out: up.weight(&d.out)?,
                })
            }
        };
        let m = &l.moe;
        let shared = match &m.shared {
            Some(s) => Some(SharedDev {
                gate_inp: up.f32s(&s.gate_inp, "ffn_gate_inp_shexp")?,
                gate: up.weight(&s.gate)?,
                up: up.weight(&s.up)?,
                down: up.weight(&s.down)?,
            }),
            None => None,
        };
        Ok(LayerDev {
            attn_norm: up.f32s(&l.attn_norm, "attn_norm")?,
            ffn_norm: up.f32s(&l.ffn_norm, "ffn_norm")?,
            mixer,
            moe: match slots {
                Some(n) => {
                    let [gate_exps, up_exps, down_exps] =
                        up.slots([&m.gate_exps, &m.up_exps, &m.down_exps], n)?;
                    MoeDev {
                        router,
                        gate_exps,
                        up_exps,
                        down_exps,
                        shared,
                    }
                }
                None => MoeDev {
                    router,
                    gate_exps: up.weight(&m.gate_exps)?,
                    up_exps: up.weight(&m.up_exps)?,
                    down_exps: up.weight(&m.down_exps)?,
                    shared,
                },
            },
        })
    }

    fn f32s(&mut self, v: &[f32], what: &str) -> Result<DevBuf<f32>, ExecError> {
        self.done += v.len() as u64 * 4;
        self.gpu.upload(v, what).map_err(cuda_err("upload weights"))
    }

    fn i32s(&mut self, v: &[i32], what: &str) -> Result<DevBuf<i32>, ExecError> {
        self.gpu.upload(v, what).map_err(cuda_err("upload weights"))
    }
}

/// Uploads every tensor of `w`; `progress` is called with the bytes done so far.
/// With `slots`, layer `l`'s routed expert tensors are not uploaded: room for
/// `slots[l]` experts is allocated in their place (the tiered store fills it).
pub(crate) fn upload(
    gpu: &Gpu,
    cfg: &ModelConfig,
    w: &ModelWeights,
    slots: Option<&[usize]>,
    progress: &dyn Fn(u64),
) -> Result<WeightsDev, ExecError> {
    let mut up = Uploader {
        gpu,
        done: 0,
        progress,
    };
    let token_embd = up.weight(&w.token_embd)?;
    let output = if tied(w) {
        None
    } else {
        Some(up.weight(&w.output)?)
    };
    let output_norm = up.f32s(&w.output_norm, "output_norm")?;
    let routers: Vec<&Weight> = w.layers.iter().map(|l| &l.moe.router).collect();
    let mut routers = up.routers(&routers)?.into_iter();
    let mut layers = Vec::with_capacity(w.layers.len());
    for (i, l) in w.layers.iter().enumerate() {
        let router = routers
            .next()
            .ok_or_else(|| ExecError::new("upload weights", format!("layer {i}: no router")))?;
        let slots = slots.and_then(|s| s.get(i)).copied();
        layers.push(up.layer(cfg, i, l, router, slots)?);
    }
    Ok(WeightsDev {
        token_embd,
        output_norm,
        output,
        layers,
        scaled: has_scales(w),
    })
}

/// Uploads the MTP block `m` (block `cfg.n_layer` of the file), [`mtp_bytes`] of it.
pub(crate) fn upload_mtp(
    gpu: &Gpu,
    cfg: &ModelConfig,
    m: &MtpWeights,
) -> Result<MtpDev, ExecError> {
    if !matches!(m.layer.mixer, Mixer::Attention(_)) {
        return Err(ExecError::new(
            "upload MTP block",
            "its mixer is not attention",
        ));
    }
    let mut up = Uploader {
        gpu,
        done: 0,
        progress: &|_| {},
    };
    let router = up.weight(&m.layer.moe.router)?;
    Ok(MtpDev {
        eh_proj: up.weight(&m.eh_proj)?,
        enorm: up.f32s(&m.enorm, "nextn.enorm")?,
        hnorm: up.f32s(&m.hnorm, "nextn.hnorm")?,
        head_norm: up.f32s(&m.head_norm, "nextn.shared_head_norm")?,
        layer: up.layer(cfg, cfg.n_layer, &m.layer, router, None)?,
    })
}
