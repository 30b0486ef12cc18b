//! The ViT: patch embedding, interpolated learned positions, 2-D rotary attention blocks
//! and the merger, on the CPU.
//!
//! Weights are dequantized to f32 when the file is opened; every step computes in f32
//! (LayerNorm statistics and the exact GELU in f64); the matrix products (every linear
//! layer, and each head's q·kᵀ and softmax·v) on quant's F32 matrix kernels, the rest
//! parallel over patches with rayon.
//! Patches stay in the reference's merge-block order throughout, so the merger's groups
//! of `merge × merge` patches are consecutive rows.

use super::config::{VisionConfig, IN_CHANNELS};
use super::{ImageEmbeds, PreparedImage};
use crate::ModelError;
use gguf::GgufFile;
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// `y = W·x + b` for each patch row `x`; `w` is `[n_out][n_in]` row-major, as the
/// file's float rows (F16, BF16, F32: kept as they are, half the memory of f32 for the
/// usual F16 file) or, for a quantized file, dequantized to F32 rows.
pub struct Linear {
    ty: quant::GgmlType,
    w: Vec<u8>,
    b: Vec<f32>,
    n_in: usize,
    n_out: usize,
}

impl Linear {
    /// A linear layer of f32 weights.
    fn of_f32(w: &[f32], b: Vec<f32>, n_in: usize, n_out: usize) -> Linear {
        Linear {
            ty: quant::GgmlType::F32,
            w: f32_bytes(w).to_vec(),
            b,
            n_in,
            n_out,
        }
    }

    fn apply(&self, x: &[f32], n: usize) -> Vec<f32> {
        let (n_in, n_out) = (self.n_in, self.n_out);
        debug_assert_eq!(x.len(), n * n_in);
        let mut y = vec![0.0f32; n * n_out];
        quant::matmul(self.ty, &self.w, n_in, x, &[], &mut y);
        y.par_chunks_mut(n_out).for_each(|row| {
            for (v, b) in row.iter_mut().zip(&self.b) {
                *v += *b;
            }
        });
        y
    }

    fn bytes(&self) -> usize {
        self.w.len() + 4 * self.b.len()
    }

    pub fn n_in(&self) -> usize {
        self.n_in
    }

    pub fn n_out(&self) -> usize {
        self.n_out
    }

    pub fn bias(&self) -> &[f32] {
        &self.b
    }

    /// The weights' type as kept (F16, BF16 or F32).
    pub fn ty(&self) -> quant::GgmlType {
        self.ty
    }

    /// The weights as f32 rows `[n_out][n_in]` (exact: every kept type is a float).
    pub fn rows_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.n_in * self.n_out];
        let row_bytes = self.w.len() / self.n_out;
        out.par_chunks_mut(self.n_in)
            .zip(self.w.par_chunks(row_bytes))
            .for_each(|(dst, src)| {
                quant::try_dequantize_row(self.ty, src, dst).expect("a float type, checked at load")
            });
        out
    }
}

/// LayerNorm with weight and bias.
pub struct LayerNorm {
    pub w: Vec<f32>,
    pub b: Vec<f32>,
}

impl LayerNorm {
    fn apply(&self, x: &[f32], eps: f32) -> Vec<f32> {
        let d = self.w.len();
        let mut y = vec![0.0f32; x.len()];
        y.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .for_each(|(yr, xr)| {
                let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
                let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
                let inv = 1.0 / (var + eps as f64).sqrt();
                for (((o, &v), &w), &b) in yr.iter_mut().zip(xr).zip(&self.w).zip(&self.b) {
                    *o = ((v as f64 - mean) * inv) as f32 * w + b;
                }
            });
        y
    }

    fn bytes(&self) -> usize {
        4 * (self.w.len() + self.b.len())
    }
}

/// One ViT block: `x += out(attention(ln1(x)))`, `x += down(gelu_tanh(up(ln2(x))))`.
pub struct Block {
    pub ln1: LayerNorm,
    pub qkv: Linear,
    pub out: Linear,
    pub ln2: LayerNorm,
    pub up: Linear,
    pub down: Linear,
}

/// The encoder's weights, for a device that runs it (`VisionModel::weights`).
pub struct VisionWeights<'a> {
    /// The patch embedding as a matrix over a patch row's values.
    pub patch: &'a Linear,
    /// The learned positions, `[pos_side²][hidden]`.
    pub pos: &'a [f32],
    pub blocks: &'a [Block],
    pub post_ln: &'a LayerNorm,
    /// The merger: `mm2(gelu_erf(mm0(rows of merge² patches)))`.
    pub mm0: &'a Linear,
    pub mm2: &'a Linear,
}

/// The Qwen3.5/3.6 vision encoder with its weights in memory as f32.
pub struct VisionModel {
    config: VisionConfig,
    path: PathBuf,
    /// The Conv3d as a matrix over a patch row's (channel, frame, y, x) values.
    patch: Linear,
    /// `[pos_side²][hidden]`.
    pos: Vec<f32>,
    blocks: Vec<Block>,
    post_ln: LayerNorm,
    mm0: Linear,
    mm2: Linear,
    identity: [u8; 32],
}

impl std::fmt::Debug for VisionModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VisionModel")
            .field("path", &self.path)
            .field("config", &self.config)
            .finish()
    }
}

/// An error while opening `path`, with the file named.
fn in_file(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Unsupported(format!("vision encoder {}: {e}", path.display()))
}

/// Reads tensors of one opened mmproj file as f32, checking their shapes.
struct Loader<'a> {
    file: &'a GgufFile,
    path: &'a Path,
}

impl Loader<'_> {
    /// The tensor `name`, which must have exactly `dims` (ggml order; trailing 1s in
    /// the file are accepted), dequantized row by row.
    fn get(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>, ModelError> {
        let remedy = "use the mmproj GGUF converted (llama.cpp's converter, --mmproj) from the same Qwen3.5/3.6 checkpoint";
        let t = self.file.tensor(name).ok_or_else(|| {
            in_file(
                self.path,
                format!("tensor `{name}` is missing from the file; {remedy}"),
            )
        })?;
        let mut found: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        while found.len() > dims.len() && found.last() == Some(&1) {
            found.pop();
        }
        if found != dims {
            return Err(in_file(
                self.path,
                format!(
                    "tensor `{name}` has shape {:?}, expected {dims:?} (ggml order) for the file's clip.vision.* metadata; {remedy}",
                    t.dims
                ),
            ));
        }
        let ne0 = dims[0];
        let n: usize = dims.iter().product();
        let bytes = self
            .file
            .try_tensor_data(t)
            .map_err(|e| in_file(self.path, e))?;
        let row_bytes =
            t.ty.row_bytes(ne0)
                .filter(|&b| b * (n / ne0) == bytes.len());
        let Some(row_bytes) = row_bytes else {
            return Err(in_file(
                self.path,
                format!(
                    "tensor `{name}` ({}) has rows of {ne0} values, which are not whole blocks of its type; re-convert the mmproj as F16, BF16 or F32",
                    t.ty
                ),
            ));
        };
        let mut out = vec![0.0f32; n];
        out.par_chunks_mut(ne0)
            .zip(bytes.par_chunks(row_bytes))
            .try_for_each(|(dst, src)| quant::try_dequantize_row(t.ty, src, dst))
            .map_err(|e| {
                in_file(
                    self.path,
                    format!(
                        "tensor `{name}` has type {}, which cannot be dequantized ({e}); use an F16, BF16, Q8_0 or F32 mmproj",
                        t.ty
                    ),
                )
            })?;
        Ok(out)
    }

    fn linear(&self, name: &str, n_in: usize, n_out: usize) -> Result<Linear, ModelError> {
        let wname = format!("{name}.weight");
        let w = self.get(&wname, &[n_in, n_out])?;
        let b = self.get(&format!("{name}.bias"), &[n_out])?;
        let t = self.file.tensor(&wname).expect("checked by get");
        if !matches!(
            t.ty,
            quant::GgmlType::F16 | quant::GgmlType::BF16 | quant::GgmlType::F32
        ) {
            return Ok(Linear::of_f32(&w, b, n_in, n_out));
        }
        // The float rows as the file has them (`get` checked shape and type).
        let bytes = self
            .file
            .try_tensor_data(t)
            .map_err(|e| in_file(self.path, e))?;
        Ok(Linear {
            ty: t.ty,
            w: bytes.to_vec(),
            b,
            n_in,
            n_out,
        })
    }

    fn norm(&self, name: &str, d: usize) -> Result<LayerNorm, ModelError> {
        Ok(LayerNorm {
            w: self.get(&format!("{name}.weight"), &[d])?,
            b: self.get(&format!("{name}.bias"), &[d])?,
        })
    }
}

/// sha256 over every byte of the file (metadata and tensors), hashed in parallel
/// chunks whose digests are then hashed in order.
fn file_identity(file: &GgufFile) -> [u8; 32] {
    const CHUNK: usize = 16 << 20;
    let mut outer = Sha256::new();
    outer.update(b"scoria vision encoder v1\0");
    for shard in 0..file.paths().len() {
        let bytes = file.shard_bytes(shard).unwrap_or(&[]);
        let digests: Vec<[u8; 32]> = bytes
            .par_chunks(CHUNK)
            .map(|c| Sha256::digest(c).into())
            .collect();
        outer.update((bytes.len() as u64).to_le_bytes());
        for d in digests {
            outer.update(d);
        }
    }
    outer.finalize().into()
}

impl VisionModel {
    /// Opens an mmproj GGUF, checks every tensor against its metadata and loads the
    /// weights as f32.
    pub fn open(path: &Path) -> Result<VisionModel, ModelError> {
        let file = GgufFile::open(path).map_err(|e| ModelError::Unsupported(e.to_string()))?;
        let config = VisionConfig::from_gguf(&file).map_err(|e| in_file(path, e))?;
        let c = &config;
        let l = Loader { file: &file, path };
        let (h, p) = (c.hidden, c.patch_size);

        // The Conv3d, one tensor per frame, each [hidden][channel][y][x]; joined into
        // one matrix whose columns follow a patch row's (channel, frame, y, x) order.
        let pv = c.patch_values();
        let mut patch_w = vec![0.0f32; h * pv];
        for f in 0..c.temporal_patch {
            let name = match f {
                0 => "v.patch_embd.weight".to_string(),
                _ => format!("v.patch_embd.weight.{f}"),
            };
            let wf = l.get(&name, &[p, p, IN_CHANNELS, h])?;
            for (o, dst) in patch_w.chunks_exact_mut(pv).enumerate() {
                for ch in 0..IN_CHANNELS {
                    let src = &wf[(o * IN_CHANNELS + ch) * p * p..][..p * p];
                    dst[(ch * c.temporal_patch + f) * p * p..][..p * p].copy_from_slice(src);
                }
            }
        }
        let patch = Linear::of_f32(&patch_w, l.get("v.patch_embd.bias", &[h])?, pv, h);
        let pos = l.get("v.position_embd.weight", &[h, c.pos_side * c.pos_side])?;
        let blocks = (0..c.n_layer)
            .map(|i| {
                let b = |s: &str| format!("v.blk.{i}.{s}");
                Ok(Block {
                    ln1: l.norm(&b("ln1"), h)?,
                    qkv: l.linear(&b("attn_qkv"), h, 3 * h)?,
                    out: l.linear(&b("attn_out"), h, h)?,
                    ln2: l.norm(&b("ln2"), h)?,
                    up: l.linear(&b("ffn_up"), h, c.ffn)?,
                    down: l.linear(&b("ffn_down"), c.ffn, h)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let mh = h * c.merge * c.merge;
        let post_ln = l.norm("v.post_ln", h)?;
        let mm0 = l.linear("mm.0", mh, mh)?;
        let mm2 = l.linear("mm.2", mh, c.out_hidden)?;
        let identity = file_identity(&file);
        Ok(VisionModel {
            config,
            path: path.to_path_buf(),
            patch,
            pos,
            blocks,
            post_ln,
            mm0,
            mm2,
            identity,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// The file it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of memory the weights take.
    pub fn bytes(&self) -> u64 {
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| {
                b.ln1.bytes()
                    + b.qkv.bytes()
                    + b.out.bytes()
                    + b.ln2.bytes()
                    + b.up.bytes()
                    + b.down.bytes()
            })
            .sum();
        (self.patch.bytes()
            + 4 * self.pos.len()
            + blocks
            + self.post_ln.bytes()
            + self.mm0.bytes()
            + self.mm2.bytes()) as u64
    }

    /// sha256 of the file's bytes (metadata and tensors): two encoders with the same
    /// identity embed every image identically.
    pub fn identity(&self) -> [u8; 32] {
        self.identity
    }

    /// The weights, for a device that runs the encoder.
    pub fn weights(&self) -> VisionWeights<'_> {
        VisionWeights {
            patch: &self.patch,
            pos: &self.pos,
            blocks: &self.blocks,
            post_ln: &self.post_ln,
            mm0: &self.mm0,
            mm2: &self.mm2,
        }
    }

    /// Checks that `img` is one image this encoder takes; returns its patch count.
    pub fn check(&self, img: &PreparedImage) -> Result<usize, ModelError> {
        let c = &self.config;
        let [t, gh, gw] = img.grid;
        if t != 1 {
            return Err(ModelError::Unsupported(format!(
                "image grid {:?}: t = {t}, but the vision encoder takes one image (t = 1) at a time; videos are not supported",
                img.grid
            )));
        }
        if gh == 0 || gw == 0 || gh % c.merge != 0 || gw % c.merge != 0 {
            return Err(ModelError::Unsupported(format!(
                "image grid {:?}: h and w must be positive multiples of the merge size {} (resize the image to multiples of {} pixels)",
                img.grid,
                c.merge,
                c.merge * c.patch_size
            )));
        }
        let n = gh * gw;
        let pv = c.patch_values();
        if img.pixels.len() != n * pv {
            return Err(ModelError::Unsupported(format!(
                "image grid {:?} needs {n} patches of {pv} values = {} pixel values, found {}",
                img.grid,
                n * pv,
                img.pixels.len()
            )));
        }
        Ok(n)
    }

    /// The merged embedding of one image: `img.rows(merge)` rows of `out_hidden`.
    pub fn encode(&self, img: &PreparedImage) -> Result<ImageEmbeds, ModelError> {
        let c = &self.config;
        let n = self.check(img)?;
        let [_, gh, gw] = img.grid;
        let h = c.hidden;
        let cells = patch_cells(gh, gw, c.merge);

        let mut x = self.patch.apply(&img.pixels, n);
        x.par_chunks_mut(h).zip(&cells).for_each(|(xr, &(r, col))| {
            for (idx, wt) in interp_taps(r, col, gh, gw, c.pos_side) {
                for (v, &e) in xr.iter_mut().zip(&self.pos[idx * h..(idx + 1) * h]) {
                    *v += wt * e;
                }
            }
        });
        let rope = rope_tables(&cells, c.head_dim(), c.rope_theta);
        for b in &self.blocks {
            let a = self.attention(b, &b.ln1.apply(&x, c.eps), n, &rope);
            add(&mut x, &b.out.apply(&a, n));
            let mut u = b.up.apply(&b.ln2.apply(&x, c.eps), n);
            u.par_iter_mut().for_each(|v| *v = gelu_tanh(*v));
            add(&mut x, &b.down.apply(&u, n));
        }
        let y = self.post_ln.apply(&x, c.eps);
        // Consecutive groups of merge² patches are one merged row of merge²·hidden.
        let rows = n / (c.merge * c.merge);
        let mut m = self.mm0.apply(&y, rows);
        m.par_iter_mut().for_each(|v| *v = gelu_erf(*v));
        let data = self.mm2.apply(&m, rows);
        Ok(ImageEmbeds {
            rows,
            width: c.out_hidden,
            data,
        })
    }

    /// Full bidirectional attention over the `n` patches of `xn` (normed input),
    /// 2-D rotary on q and k. Returns the heads' outputs, `[n][hidden]`.
    fn attention(&self, b: &Block, xn: &[f32], n: usize, rope: &Rope) -> Vec<f32> {
        let c = &self.config;
        let (h, hd, nh) = (c.hidden, c.head_dim(), c.n_head);
        let mut qkv = b.qkv.apply(xn, n);
        qkv.par_chunks_mut(3 * h).enumerate().for_each(|(i, row)| {
            for head in row[..2 * h].chunks_exact_mut(hd) {
                rope.apply(i, head);
            }
        });
        // Keys and values head-major, so one head's rows are contiguous.
        let split = |off: usize| {
            let mut out = vec![0.0f32; n * h];
            out.par_chunks_mut(n * hd)
                .enumerate()
                .for_each(|(hh, dst)| {
                    for (j, d) in dst.chunks_exact_mut(hd).enumerate() {
                        d.copy_from_slice(&qkv[j * 3 * h + off + hh * hd..][..hd]);
                    }
                });
            out
        };
        let (k, v) = (split(h), split(2 * h));
        let scale = (hd as f32).powf(-0.5);
        let mut out = vec![0.0f32; n * h];
        // One head at a time: scores = q·kᵀ and out = softmax(scores)·v as two matrix
        // products on quant's kernels (keys and the transposed values as the "weights").
        let mut qh = vec![0.0f32; n * hd];
        let mut vt = vec![0.0f32; hd * n];
        let mut scores = vec![0.0f32; n * n];
        let mut oh = vec![0.0f32; n * hd];
        for hh in 0..nh {
            qh.par_chunks_mut(hd).enumerate().for_each(|(i, d)| {
                d.copy_from_slice(&qkv[i * 3 * h + hh * hd..][..hd]);
            });
            let kh = &k[hh * n * hd..][..n * hd];
            let vh = &v[hh * n * hd..][..n * hd];
            vt.par_chunks_mut(n).enumerate().for_each(|(d, row)| {
                for (j, x) in row.iter_mut().enumerate() {
                    *x = vh[j * hd + d];
                }
            });
            quant::matmul(
                quant::GgmlType::F32,
                f32_bytes(kh),
                hd,
                &qh,
                &[],
                &mut scores,
            );
            scores.par_chunks_mut(n).for_each(|row| {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
                let mut sum = 0.0f32;
                for s in row.iter_mut() {
                    *s = (*s * scale - max).exp();
                    sum += *s;
                }
                let inv = 1.0 / sum;
                for s in row.iter_mut() {
                    *s *= inv;
                }
            });
            quant::matmul(
                quant::GgmlType::F32,
                f32_bytes(&vt),
                n,
                &scores,
                &[],
                &mut oh,
            );
            out.par_chunks_mut(h)
                .zip(oh.par_chunks(hd))
                .for_each(|(orow, o)| {
                    orow[hh * hd..(hh + 1) * hd].copy_from_slice(o);
                });
        }
        out
    }
}

/// A [f32] as the little-endian F32 rows quant's matrix kernels read (the GGUF layout).
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: a [f32] viewed as its bytes: f32 has no padding and u8 no alignment.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn add(x: &mut [f32], y: &[f32]) {
    x.par_iter_mut().zip(y).for_each(|(a, &b)| *a += b);
}

/// GELU with the tanh approximation (the ViT MLP's `gelu_pytorch_tanh`).
fn gelu_tanh(x: f32) -> f32 {
    let x = x as f64;
    let k = (2.0 / std::f64::consts::PI).sqrt();
    (0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())) as f32
}

/// Exact GELU, `x·Φ(x)` (the merger's).
fn gelu_erf(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))) as f32
}

/// The error function to about 1e-14: its Maclaurin series below |x| = 3, the
/// continued fraction of erfc above.
fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 3.0 {
        // erf(x) = 2/√π Σ (-1)^k x^(2k+1) / (k! (2k+1))
        let (mut term, mut sum, x2) = (a, a, a * a);
        for k in 1..100 {
            term *= -x2 / k as f64;
            let t = term / (2 * k + 1) as f64;
            sum += t;
            if t.abs() < 1e-17 * sum.abs() {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else if a < 10.0 {
        // erfc(a) = e^(-a²)/√π · 1/(a + (1/2)/(a + 1/(a + (3/2)/(a + ...))))
        let mut k = a;
        for i in (1..=80).rev() {
            k = a + (i as f64 / 2.0) / k;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * k)
    } else {
        1.0
    };
    r.copysign(x)
}

/// The (row, col) in the image's patch grid of each patch, in the reference's
/// merge-block order: `merge × merge` blocks row-major, patches row-major within each.
pub fn patch_cells(h: usize, w: usize, merge: usize) -> Vec<(usize, usize)> {
    let bw = w / merge;
    (0..h * w)
        .map(|k| {
            let (in_col, in_row) = (k % merge, (k / merge) % merge);
            let block = k / (merge * merge);
            let (block_row, block_col) = (block / bw, block % bw);
            (block_row * merge + in_row, block_col * merge + in_col)
        })
        .collect()
}

/// The four (table index, weight) taps of the learned `side × side` position table
/// resampled bilinearly (align_corners) to an `h × w` grid, at cell (row, col): the
/// (floor, floor), (floor, ceil), (ceil, floor), (ceil, ceil) corners, the reference's
/// order of summation.
pub fn interp_taps(row: usize, col: usize, h: usize, w: usize, side: usize) -> [(usize, f32); 4] {
    // torch.linspace(0, side - 1, n)[i] in f32: from the start in the first half,
    // from the end in the second.
    let lin = |i: usize, n: usize| -> f32 {
        if n == 1 {
            return 0.0;
        }
        let end = (side - 1) as f32;
        let step = end / (n - 1) as f32;
        if i < n / 2 {
            i as f32 * step
        } else {
            end - (n - 1 - i) as f32 * step
        }
    };
    let (sr, sc) = (lin(row, h), lin(col, w));
    let (fr, fc) = (sr as usize, sc as usize);
    let (cr, cc) = ((fr + 1).min(side - 1), (fc + 1).min(side - 1));
    let (dr, dc) = (sr - fr as f32, sc - fc as f32);
    [
        (fr * side + fc, (1.0 - dr) * (1.0 - dc)),
        (fr * side + cc, (1.0 - dr) * dc),
        (cr * side + fc, dr * (1.0 - dc)),
        (cr * side + cc, dr * dc),
    ]
}

/// cos and sin of the 2-D rotary angles of each patch: `hd / 2` per patch, the row's
/// `hd / 4` frequencies then the column's.
struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

/// cos and sin of the 2-D rotary angles of each patch at `cells`, `[n][hd/2]` each: the
/// tables the encoder rotates q and k by (NeoX pairing, `j` with `j + hd/2`).
pub fn rope_cos_sin(cells: &[(usize, usize)], hd: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let r = rope_tables(cells, hd, theta);
    (r.cos, r.sin)
}

fn rope_tables(cells: &[(usize, usize)], hd: usize, theta: f32) -> Rope {
    let half = hd / 2;
    let inv: Vec<f32> = (0..hd / 4)
        .map(|j| 1.0 / theta.powf((2 * j) as f32 / half as f32))
        .collect();
    let mut cos = Vec::with_capacity(cells.len() * half);
    let mut sin = Vec::with_capacity(cells.len() * half);
    for &(r, c) in cells {
        for a in inv
            .iter()
            .map(|&f| r as f32 * f)
            .chain(inv.iter().map(|&f| c as f32 * f))
        {
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Rope { cos, sin, half }
}

impl Rope {
    /// Rotates one head of patch `i`, NeoX pairing (`i` with `i + hd/2`).
    fn apply(&self, i: usize, head: &mut [f32]) {
        let half = self.half;
        let (cos, sin) = (&self.cos[i * half..][..half], &self.sin[i * half..][..half]);
        let (a, b) = head.split_at_mut(half);
        for j in 0..half {
            let (x, y) = (a[j], b[j]);
            a[j] = x * cos[j] - y * sin[j];
            b[j] = y * cos[j] + x * sin[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bilinear_taps_by_hand() {
        // A 4×4 table resampled to 3 rows × 5 columns: rows sit at 0, 1.5, 3 and
        // columns at 0, 0.75, 1.5, 2.25, 3 of the table.
        let t = interp_taps(1, 3, 3, 5, 4);
        // row 1.5: floor 1, ceil 2, d 0.5; col 2.25: floor 2, ceil 3, d 0.25.
        let want = [
            (4 + 2, 0.5 * 0.75),
            (4 + 3, 0.5 * 0.25),
            (8 + 2, 0.5 * 0.75),
            (8 + 3, 0.5 * 0.25),
        ];
        for (g, w) in t.iter().zip(want) {
            assert_eq!(g.0, w.0);
            assert!((g.1 - w.1).abs() < 1e-6, "{t:?}");
        }
        // The last row and column clamp the ceil tap to the table's edge, weight 0.
        let t = interp_taps(2, 4, 3, 5, 4);
        assert_eq!(t[0], (15, 1.0));
        assert_eq!(t.iter().map(|x| x.1).sum::<f32>(), 1.0);
        // A one-row grid reads the table's first row.
        assert_eq!(interp_taps(0, 0, 1, 1, 4)[0], (0, 1.0));
        // Resampling a table that is linear in (row, col) gives the line exactly.
        let table: Vec<f32> = (0..16)
            .map(|k| (k / 4) as f32 * 10.0 + (k % 4) as f32)
            .collect();
        let v: f32 = interp_taps(1, 3, 3, 5, 4)
            .iter()
            .map(|&(i, w)| w * table[i])
            .sum();
        assert!((v - (15.0 + 2.25)).abs() < 1e-5, "{v}");
    }

    #[test]
    fn cells_follow_merge_blocks() {
        // 4×4 grid, merge 2: block (0,0) holds (0,0) (0,1) (1,0) (1,1), then block (0,1).
        let c = patch_cells(4, 4, 2);
        assert_eq!(&c[..6], &[(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]);
        assert_eq!(c[8], (2, 0));
        assert_eq!(c[15], (3, 3));
    }

    #[test]
    fn erf_matches_known_values() {
        // erf(0.5), erf(1), erf(2), erf(3.5) to 15 digits.
        for (x, want) in [
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.5, 0.999_999_256_901_627_7),
        ] {
            assert!((erf(x) - want).abs() < 1e-13, "erf({x}) = {}", erf(x));
            assert!((erf(-x) + want).abs() < 1e-13);
        }
        assert_eq!(erf(0.0), 0.0);
    }
}
