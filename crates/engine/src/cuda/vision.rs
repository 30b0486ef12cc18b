//! The image encoder on the GPU: `model::vision::encoder`'s steps on cuda's `vis_*`
//! kernels (the linear layers on the tensor cores), with its own stream, so an image
//! encodes while the text model steps. Its weights and a scratch sized for images of
//! up to [`GPU_MAX_PATCHES`] patches are allocated when it opens (before the executor,
//! which then budgets what is left); a larger image is encoded on the CPU.
//!
//! The embedding is the GPU's own (a dense computation, like the text model's norms:
//! not the CPU's bits), the same on every run, and within the vision fixture's
//! tolerance of transformers (tests/vision.rs).

use crate::EngineError;
use cuda::{DevBuf, Gpu, VisEpilogue, VisWeight};
use half::f16;
use model::vision::encoder::{
    interp_taps, patch_cells, rope_cos_sin, LayerNorm, Linear, VisionModel,
};
use model::vision::{ImageEmbeds, PreparedImage};
use rayon::prelude::*;
use std::sync::Mutex;

/// The most patches an image may have to be encoded on the GPU: 8,192 (about two
/// megapixels at patch 16, e.g. a 1920×1080 screenshot). The scratch is sized for it.
pub const GPU_MAX_PATCHES: usize = 8192;

/// Patches the MLP takes at a time (its inner rows are the largest scratch).
const MLP_CHUNK: usize = 2048;

fn dev(e: cuda::CudaError) -> EngineError {
    EngineError::Device(format!("vision encoder: {e}"))
}

struct DevLinear {
    hi: DevBuf<u16>,
    lo: Option<DevBuf<u16>>,
    bias: DevBuf<f32>,
    n_in: usize,
    n_out: usize,
}

impl DevLinear {
    /// The weights as f16 rows, plus the f16 rounding of what they leave when the
    /// file's weights are not f16 values.
    fn upload(gpu: &Gpu, l: &Linear, what: &str) -> Result<DevLinear, EngineError> {
        let w = l.rows_f32();
        let (hi, lo): (Vec<u16>, Vec<u16>) = w
            .par_iter()
            .map(|&v| {
                let h = f16::from_f32(v);
                (h.to_bits(), f16::from_f32(v - h.to_f32()).to_bits())
            })
            .unzip();
        // ±0 remainders: the f16 rows hold the weights exactly.
        let exact = lo.par_iter().all(|&b| b & 0x7fff == 0);
        Ok(DevLinear {
            hi: gpu.upload(&hi, what).map_err(dev)?,
            lo: if exact {
                None
            } else {
                Some(gpu.upload(&lo, what).map_err(dev)?)
            },
            bias: gpu.upload(l.bias(), what).map_err(dev)?,
            n_in: l.n_in(),
            n_out: l.n_out(),
        })
    }

    fn w(&self) -> VisWeight {
        VisWeight {
            hi: self.hi.ptr(),
            lo: self.lo.as_ref().map_or(0, |b| b.ptr()),
            bias: self.bias.ptr(),
            n_in: self.n_in,
            n_out: self.n_out,
        }
    }

    fn bytes(&self) -> u64 {
        self.hi.bytes() + self.lo.as_ref().map_or(0, |b| b.bytes()) + self.bias.bytes()
    }
}

struct DevNorm {
    w: DevBuf<f32>,
    b: DevBuf<f32>,
}

impl DevNorm {
    fn upload(gpu: &Gpu, n: &LayerNorm, what: &str) -> Result<DevNorm, EngineError> {
        Ok(DevNorm {
            w: gpu.upload(&n.w, what).map_err(dev)?,
            b: gpu.upload(&n.b, what).map_err(dev)?,
        })
    }

    fn bytes(&self) -> u64 {
        self.w.bytes() + self.b.bytes()
    }
}

struct DevBlock {
    ln1: DevNorm,
    qkv: DevLinear,
    out: DevLinear,
    ln2: DevNorm,
    up: DevLinear,
    down: DevLinear,
}

/// Device buffers for one image of up to `max` patches.
struct Scratch {
    /// The residual stream, `[n][hidden]`.
    x: DevBuf<f32>,
    /// Normed rows, then the attention's output, `[n][hidden]`.
    xn: DevBuf<f32>,
    qkv: DevBuf<f32>,
    /// The MLP's inner rows of a chunk, then the merger's.
    u: DevBuf<f32>,
    out: DevBuf<f32>,
    pixels: DevBuf<f32>,
    cos: DevBuf<f32>,
    sin: DevBuf<f32>,
    tap_idx: DevBuf<i32>,
    tap_w: DevBuf<f32>,
}

struct Inner {
    gpu: Gpu,
    patch: DevLinear,
    pos: DevBuf<f32>,
    blocks: Vec<DevBlock>,
    post_ln: DevNorm,
    mm0: DevLinear,
    mm2: DevLinear,
    s: Scratch,
}

/// The encoder's weights and scratch on one GPU.
pub struct GpuEncoder {
    inner: Mutex<Inner>,
    weights: u64,
    scratch: u64,
    max_patches: usize,
}

impl GpuEncoder {
    /// Uploads `model`'s weights to GPU `ordinal` and allocates the scratch. Refuses an
    /// encoder whose heads the attention kernel does not take.
    pub fn open(ordinal: usize, model: &VisionModel) -> Result<GpuEncoder, EngineError> {
        let c = model.config();
        let (h, hd) = (c.hidden, c.head_dim());
        if !cuda::vis_attention_supports(hd) {
            return Err(EngineError::Settings(format!(
                "the vision encoder's heads of {hd} values are not supported on the GPU (16, 32, 64, 72 or 80)"
            )));
        }
        let w = model.weights();
        for l in [w.patch, w.mm0, w.mm2].into_iter().chain(
            w.blocks
                .iter()
                .flat_map(|b| [&b.qkv, &b.out, &b.up, &b.down]),
        ) {
            if !l.n_in().is_multiple_of(8) {
                return Err(EngineError::Settings(format!(
                    "a vision encoder layer takes rows of {} values; the GPU needs a multiple of 8",
                    l.n_in()
                )));
            }
        }
        let mut gpu = Gpu::open(ordinal).map_err(dev)?;
        gpu.set_diagnostics(
            crate::switches::on(crate::switches::CUDA_SYNC),
            crate::switches::on(crate::switches::NO_PDL),
        );
        let blocks = w
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let what = format!("vision block {i}");
                Ok(DevBlock {
                    ln1: DevNorm::upload(&gpu, &b.ln1, &what)?,
                    qkv: DevLinear::upload(&gpu, &b.qkv, &what)?,
                    out: DevLinear::upload(&gpu, &b.out, &what)?,
                    ln2: DevNorm::upload(&gpu, &b.ln2, &what)?,
                    up: DevLinear::upload(&gpu, &b.up, &what)?,
                    down: DevLinear::upload(&gpu, &b.down, &what)?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let patch = DevLinear::upload(&gpu, w.patch, "vision patch embedding")?;
        let pos = gpu.upload(w.pos, "vision positions").map_err(dev)?;
        let post_ln = DevNorm::upload(&gpu, w.post_ln, "vision post norm")?;
        let mm0 = DevLinear::upload(&gpu, w.mm0, "vision merger")?;
        let mm2 = DevLinear::upload(&gpu, w.mm2, "vision merger")?;
        let weights = blocks
            .iter()
            .map(|b| {
                b.ln1.bytes()
                    + b.qkv.bytes()
                    + b.out.bytes()
                    + b.ln2.bytes()
                    + b.up.bytes()
                    + b.down.bytes()
            })
            .sum::<u64>()
            + patch.bytes()
            + pos.bytes()
            + post_ln.bytes()
            + mm0.bytes()
            + mm2.bytes();

        let n = GPU_MAX_PATCHES;
        let a = |len: usize| gpu.alloc::<f32>(len, "vision encoder scratch").map_err(dev);
        let s = Scratch {
            x: a(n * h)?,
            xn: a(n * h)?,
            qkv: a(n * 3 * h)?,
            u: a((MLP_CHUNK.min(n) * c.ffn).max(n * h))?,
            out: a(n / (c.merge * c.merge) * c.out_hidden)?,
            pixels: a(n * c.patch_values())?,
            cos: a(n * hd / 2)?,
            sin: a(n * hd / 2)?,
            tap_idx: gpu
                .alloc::<i32>(4 * n, "vision encoder scratch")
                .map_err(dev)?,
            tap_w: a(4 * n)?,
        };
        let scratch = [
            &s.x, &s.xn, &s.qkv, &s.u, &s.out, &s.pixels, &s.cos, &s.sin, &s.tap_w,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum::<u64>()
            + s.tap_idx.bytes();
        Ok(GpuEncoder {
            inner: Mutex::new(Inner {
                gpu,
                patch,
                pos,
                blocks,
                post_ln,
                mm0,
                mm2,
                s,
            }),
            weights,
            scratch,
            max_patches: n,
        })
    }

    /// VRAM its weights take.
    pub fn weight_bytes(&self) -> u64 {
        self.weights
    }

    /// VRAM its scratch takes.
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch
    }

    /// The most patches an image it encodes may have.
    pub fn max_patches(&self) -> usize {
        self.max_patches
    }

    /// The merged embedding of `img` (`model` is the encoder these weights came from),
    /// as `VisionModel::encode` computes it, on the GPU. One image at a time.
    pub fn encode(
        &self,
        model: &VisionModel,
        img: &PreparedImage,
    ) -> Result<ImageEmbeds, EngineError> {
        let n = model
            .check(img)
            .map_err(|e| EngineError::Image(e.to_string()))?;
        if n > self.max_patches {
            return Err(EngineError::Image(format!(
                "an image of {n} patches is over the {} the GPU encoder holds",
                self.max_patches
            )));
        }
        let c = model.config();
        let (h, hd) = (c.hidden, c.head_dim());
        let [_, gh, gw] = img.grid;
        let cells = patch_cells(gh, gw, c.merge);
        let mut idx = Vec::with_capacity(4 * n);
        let mut wt = Vec::with_capacity(4 * n);
        for &(r, col) in &cells {
            for (i, w) in interp_taps(r, col, gh, gw, c.pos_side) {
                idx.push(i as i32);
                wt.push(w);
            }
        }
        let (cos, sin) = rope_cos_sin(&cells, hd, c.rope_theta);

        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (g, s) = (&inner.gpu, &inner.s);
        g.copy_to_device(&img.pixels, s.pixels.ptr()).map_err(dev)?;
        g.copy_to_device(&idx, s.tap_idx.ptr()).map_err(dev)?;
        g.copy_to_device(&wt, s.tap_w.ptr()).map_err(dev)?;
        g.copy_to_device(&cos, s.cos.ptr()).map_err(dev)?;
        g.copy_to_device(&sin, s.sin.ptr()).map_err(dev)?;
        let run = || -> Result<Vec<f32>, cuda::CudaError> {
            let (x, xn, qkv, u) = (s.x.ptr(), s.xn.ptr(), s.qkv.ptr(), s.u.ptr());
            g.vis_linear(s.pixels.ptr(), n, &inner.patch.w(), x, VisEpilogue::Store)?;
            g.vis_pos_add(x, n, h, inner.pos.ptr(), s.tap_idx.ptr(), s.tap_w.ptr())?;
            for b in &inner.blocks {
                g.vis_layernorm(x, n, h, b.ln1.w.ptr(), b.ln1.b.ptr(), c.eps, xn)?;
                g.vis_linear(xn, n, &b.qkv.w(), qkv, VisEpilogue::Store)?;
                g.vis_rope(qkv, n, h, hd, s.cos.ptr(), s.sin.ptr())?;
                g.vis_attention(qkv, n, h, hd, xn)?;
                g.vis_linear(xn, n, &b.out.w(), x, VisEpilogue::Add)?;
                g.vis_layernorm(x, n, h, b.ln2.w.ptr(), b.ln2.b.ptr(), c.eps, xn)?;
                for c0 in (0..n).step_by(MLP_CHUNK) {
                    let rows = MLP_CHUNK.min(n - c0);
                    let off = (c0 * h * 4) as u64;
                    g.vis_linear(xn + off, rows, &b.up.w(), u, VisEpilogue::GeluTanh)?;
                    g.vis_linear(u, rows, &b.down.w(), x + off, VisEpilogue::Add)?;
                }
            }
            let p = &inner.post_ln;
            g.vis_layernorm(x, n, h, p.w.ptr(), p.b.ptr(), c.eps, xn)?;
            // Consecutive groups of merge² patches are one merged row.
            let rows = n / (c.merge * c.merge);
            g.vis_linear(xn, rows, &inner.mm0.w(), u, VisEpilogue::GeluErf)?;
            g.vis_linear(u, rows, &inner.mm2.w(), s.out.ptr(), VisEpilogue::Store)?;
            g.download::<f32>(s.out.ptr(), rows * c.out_hidden)
        };
        let data = run().map_err(dev)?;
        Ok(ImageEmbeds {
            rows: n / (c.merge * c.merge),
            width: c.out_hidden,
            data,
        })
    }
}
