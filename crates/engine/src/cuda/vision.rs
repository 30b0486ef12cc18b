//! The image encoder on the GPU: `model::vision::encoder`'s steps on cuda's `vis_*`
//! kernels (the linear layers and the attention on the tensor cores), with its own
//! stream, so an image encodes while the text model steps. Its weights and a scratch
//! for images of up to a number of patches fixed at open ([`default_max_patches`], or
//! `--vision-gpu-patches`) are allocated when it opens (before the executor, which then
//! budgets what is left); a larger image is encoded on the CPU.
//!
//! Only the residual stream and the q, k, v rows are held for the whole image (the
//! attention needs every patch's k and v); every other step runs [`CHUNK_ROWS`] patches
//! at a time through buffers of that size, so the scratch grows by ~19 KB a patch at
//! Qwen3.5's geometry. Every step computes a row from that row alone (the attention a
//! query from every key), so the chunking changes no bits.
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

/// Patches each per-row step takes at a time (rounded down to whole merged rows).
pub const CHUNK_ROWS: usize = 2048;

/// The fewest and the most patches [`default_max_patches`] chooses: 8,192 is about two
/// megapixels at patch 16 (a 1920×1080 screenshot); 65,536 is the most Qwen3.5's
/// preprocessing makes (16,777,216 pixels).
const DEFAULT_PATCHES: (usize, usize) = (8192, 65_536);

/// The scratch's size for images of up to `n` patches: `fixed + per_patch · n` bytes.
#[derive(Debug, Clone, Copy)]
pub struct ScratchSize {
    pub per_patch: u64,
    pub fixed: u64,
}

impl ScratchSize {
    /// For `model` in chunks of `chunk` patches (whole merged rows).
    pub fn of(model: &VisionModel, chunk: usize) -> ScratchSize {
        let c = model.config();
        let w = model.weights();
        let m2 = c.merge * c.merge;
        // Bytes of an f32 or an i32.
        let f = 4u64;
        // x [n][h], qkv [n][3h], cos and sin [n][hd/2], four taps (index, weight) a patch.
        let per_patch = f * (4 * c.hidden + c.head_dim() + 8) as u64;
        let merged = chunk / m2;
        // pixels, xn, u (the MLP's inner rows, then the merger's), out.
        let fixed = f
            * (chunk * c.patch_values()
                + chunk * c.hidden
                + (chunk * c.ffn).max(merged * w.mm0.n_out())
                + merged * c.out_hidden) as u64;
        ScratchSize { per_patch, fixed }
    }

    pub fn bytes(&self, n: usize) -> u64 {
        self.fixed + self.per_patch * n as u64
    }
}

/// How many patches the GPU encoder takes when the user does not say: what a 32nd of
/// the GPU's `total` memory holds beside the chunk buffers, in whole 1,024s, within
/// 8,192 and 65,536 (at Qwen3.5's geometry: ~37,000 on a 24 GB card, a 3840×2160
/// screenshot being 32,640).
pub fn default_max_patches(size: ScratchSize, total: u64) -> usize {
    let room = (total / 32).saturating_sub(size.fixed) / size.per_patch.max(1);
    let n = (room as usize / 1024) * 1024;
    n.clamp(DEFAULT_PATCHES.0, DEFAULT_PATCHES.1)
}

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

impl DevBlock {
    fn bytes(&self) -> u64 {
        [&self.qkv, &self.out, &self.up, &self.down]
            .iter()
            .map(|l| l.bytes())
            .sum::<u64>()
            + self.ln1.bytes()
            + self.ln2.bytes()
    }
}

/// Device buffers for one image of up to `max` patches, in chunks of `chunk`.
struct Scratch {
    /// The residual stream, `[n][hidden]`.
    x: DevBuf<f32>,
    /// q, k and v, `[n][3·hidden]`.
    qkv: DevBuf<f32>,
    cos: DevBuf<f32>,
    sin: DevBuf<f32>,
    tap_idx: DevBuf<i32>,
    tap_w: DevBuf<f32>,
    /// A chunk's pixels.
    pixels: DevBuf<f32>,
    /// A chunk's normed rows, then its attention's output, `[chunk][hidden]`.
    xn: DevBuf<f32>,
    /// A chunk's MLP inner rows, then the merger's.
    u: DevBuf<f32>,
    /// A chunk's merged rows.
    out: DevBuf<f32>,
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
    chunk: usize,
}

impl GpuEncoder {
    /// Uploads `model`'s weights to GPU `ordinal` and allocates the scratch for images
    /// of up to `max_patches` patches (None: [`default_max_patches`] of the GPU's
    /// memory). Refuses an encoder whose heads the attention kernel does not take.
    pub fn open(
        ordinal: usize,
        model: &VisionModel,
        max_patches: Option<usize>,
    ) -> Result<GpuEncoder, EngineError> {
        Self::open_chunked(ordinal, model, max_patches, CHUNK_ROWS)
    }

    /// [`GpuEncoder::open`] with the per-row steps taking `chunk` patches at a time
    /// (rounded down to whole merged rows). The chunk changes no bits; tests use small
    /// ones to prove it.
    pub fn open_chunked(
        ordinal: usize,
        model: &VisionModel,
        max_patches: Option<usize>,
        chunk: usize,
    ) -> Result<GpuEncoder, EngineError> {
        let c = model.config();
        let (h, hd) = (c.hidden, c.head_dim());
        let m2 = c.merge * c.merge;
        let chunk = (chunk / m2).max(1) * m2;
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
        let weights = blocks.iter().map(DevBlock::bytes).sum::<u64>()
            + patch.bytes()
            + pos.bytes()
            + post_ln.bytes()
            + mm0.bytes()
            + mm2.bytes();

        let size = ScratchSize::of(model, chunk);
        let n = match max_patches {
            Some(n) => n,
            None => default_max_patches(size, gpu.mem_info().map_err(dev)?.1),
        };
        let a = |len: usize| gpu.alloc::<f32>(len, "vision encoder scratch").map_err(dev);
        let merged = chunk / m2;
        let s = Scratch {
            x: a(n * h)?,
            qkv: a(n * 3 * h)?,
            cos: a(n * hd / 2)?,
            sin: a(n * hd / 2)?,
            tap_idx: gpu
                .alloc::<i32>(4 * n, "vision encoder scratch")
                .map_err(dev)?,
            tap_w: a(4 * n)?,
            pixels: a(chunk * c.patch_values())?,
            xn: a(chunk * h)?,
            u: a((chunk * c.ffn).max(merged * w.mm0.n_out()))?,
            out: a(merged * c.out_hidden)?,
        };
        let scratch = [
            &s.x, &s.qkv, &s.cos, &s.sin, &s.tap_w, &s.pixels, &s.xn, &s.u, &s.out,
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
            chunk,
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
        g.copy_to_device(&idx, s.tap_idx.ptr()).map_err(dev)?;
        g.copy_to_device(&wt, s.tap_w.ptr()).map_err(dev)?;
        g.copy_to_device(&cos, s.cos.ptr()).map_err(dev)?;
        g.copy_to_device(&sin, s.sin.ptr()).map_err(dev)?;
        let pv = c.patch_values();
        let m2 = c.merge * c.merge;
        let chunks = || {
            (0..n)
                .step_by(self.chunk)
                .map(|c0| (c0, self.chunk.min(n - c0)))
        };
        let run = || -> Result<Vec<f32>, cuda::CudaError> {
            let (x, xn, qkv, u) = (s.x.ptr(), s.xn.ptr(), s.qkv.ptr(), s.u.ptr());
            let at = |base: u64, row: usize, width: usize| base + (row * width * 4) as u64;
            for (c0, rows) in chunks() {
                g.copy_to_device(&img.pixels[c0 * pv..(c0 + rows) * pv], s.pixels.ptr())?;
                let y = at(x, c0, h);
                g.vis_linear(
                    s.pixels.ptr(),
                    rows,
                    &inner.patch.w(),
                    y,
                    VisEpilogue::Store,
                )?;
            }
            g.vis_pos_add(x, n, h, inner.pos.ptr(), s.tap_idx.ptr(), s.tap_w.ptr())?;
            for b in &inner.blocks {
                for (c0, rows) in chunks() {
                    let xc = at(x, c0, h);
                    g.vis_layernorm(xc, rows, h, b.ln1.w.ptr(), b.ln1.b.ptr(), c.eps, xn)?;
                    let qc = at(qkv, c0, 3 * h);
                    g.vis_linear(xn, rows, &b.qkv.w(), qc, VisEpilogue::Store)?;
                }
                g.vis_rope(qkv, n, h, hd, s.cos.ptr(), s.sin.ptr())?;
                // Every chunk's queries see every patch's k and v, all written above.
                for (c0, rows) in chunks() {
                    let xc = at(x, c0, h);
                    g.vis_attention(qkv, n, c0, rows, h, hd, xn)?;
                    g.vis_linear(xn, rows, &b.out.w(), xc, VisEpilogue::Add)?;
                    g.vis_layernorm(xc, rows, h, b.ln2.w.ptr(), b.ln2.b.ptr(), c.eps, xn)?;
                    g.vis_linear(xn, rows, &b.up.w(), u, VisEpilogue::GeluTanh)?;
                    g.vis_linear(u, rows, &b.down.w(), xc, VisEpilogue::Add)?;
                }
            }
            // Consecutive groups of merge² patches are one merged row (a chunk holds
            // whole groups).
            let p = &inner.post_ln;
            let mut data = Vec::with_capacity(n / m2 * c.out_hidden);
            for (c0, rows) in chunks() {
                let xc = at(x, c0, h);
                g.vis_layernorm(xc, rows, h, p.w.ptr(), p.b.ptr(), c.eps, xn)?;
                let merged = rows / m2;
                g.vis_linear(xn, merged, &inner.mm0.w(), u, VisEpilogue::GeluErf)?;
                g.vis_linear(u, merged, &inner.mm2.w(), s.out.ptr(), VisEpilogue::Store)?;
                data.extend(g.download::<f32>(s.out.ptr(), merged * c.out_hidden)?);
            }
            Ok(data)
        };
        let data = run().map_err(dev)?;
        Ok(ImageEmbeds {
            rows: n / (c.merge * c.merge),
            width: c.out_hidden,
            data,
        })
    }
}
