//! From image file bytes to a [`super::PreparedImage`], as the reference processor
//! (transformers' `Qwen2VLImageProcessorPil`, fed by its `load_image`) does it:
//!
//! 1. sniff the format from the bytes (PNG, JPEG, WebP, GIF) and decode under limits (the
//!    byte count, each side, the decoder's allocation), applying the EXIF orientation;
//!    GIF gives its first frame;
//! 2. convert to 8-bit RGB as PIL's `convert("RGB")` does (alpha dropped, not blended;
//!    gray replicated);
//! 3. [`smart_resize`] to a multiple of `patch_size * merge` within the pixel budget and
//!    resample with PIL's bicubic filter ([`resize_bicubic`]);
//! 4. rescale by 1/255 and normalise per channel, in the reference's precision;
//! 5. cut into patches in the encoder's order ([`patchify`]).

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, RgbImage};
use sha2::{Digest, Sha256};

use super::{PreparedImage, VisionConfig};

/// Bounds on what an image may be and become.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// The fewest pixels the resized image may have (the processor's `size.shortest_edge`).
    pub min_pixels: usize,
    /// The most pixels the resized image may have (the processor's `size.longest_edge`).
    pub max_pixels: usize,
    /// The most bytes an encoded image may have.
    pub max_bytes: usize,
    /// The longest side, in pixels, a source image may have. The decoder may also use at
    /// most `4 * max_side²` bytes (an 8-bit RGBA image of that side), see [`decode_budget`].
    pub max_side: u32,
}

impl Default for ImageLimits {
    /// Qwen3.5's processor bounds (65,536 to 16,777,216 pixels), 32 MiB of encoded bytes
    /// and sides up to 16,384 pixels.
    fn default() -> Self {
        ImageLimits {
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            max_bytes: 32 << 20,
            max_side: 16_384,
        }
    }
}

/// The most bytes the decoder may allocate for an image under `limits`: what an 8-bit
/// RGBA image with both sides at `max_side` takes.
pub fn decode_budget(limits: &ImageLimits) -> u64 {
    4 * u64::from(limits.max_side) * u64::from(limits.max_side)
}

/// The formats [`prepare`] decodes, as a user reads them.
pub const ACCEPTED_FORMATS: &str = "PNG, JPEG, WebP or GIF";

/// Why an image could not be prepared. Each message is one sentence a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("the image is {len} bytes, over the limit of {max} bytes; send a smaller file")]
    TooManyBytes { len: usize, max: usize },
    #[error("the image is empty (0 bytes); send a {ACCEPTED_FORMATS} file")]
    NoBytes,
    #[error("the image's format ({found}) is not accepted; send a {ACCEPTED_FORMATS} file")]
    UnsupportedFormat { found: String },
    #[error("the image's bytes are not a recognised image format; send a {ACCEPTED_FORMATS} file")]
    UnknownFormat,
    #[error("the {format} image could not be decoded ({reason}); check that the file is complete and not corrupt")]
    Decode {
        format: &'static str,
        reason: String,
    },
    #[error("the image is {width}x{height} pixels, over the limit of {max_side} pixels a side; scale it down first")]
    TooLarge {
        width: u32,
        height: u32,
        max_side: u32,
    },
    #[error("the image has no pixels ({width}x{height}); send an image with at least one pixel")]
    ZeroSize { width: u32, height: u32 },
    #[error("decoding the {width}x{height} image would take {needed} bytes, over the limit of {max} bytes; send an 8-bit image or a smaller one")]
    TooMuchMemory {
        width: u32,
        height: u32,
        needed: u64,
        max: u64,
    },
    #[error("the image is {width}x{height} pixels, an aspect ratio over 200:1; crop or pad it to at most 200:1")]
    AspectRatio { width: usize, height: usize },
    #[error("the vision config's {field} is 0; the mmproj file is damaged or not a Qwen3.5 vision encoder")]
    BadConfig { field: &'static str },
}

fn format_name(f: ImageFormat) -> &'static str {
    match f {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        ImageFormat::WebP => "WebP",
        ImageFormat::Gif => "GIF",
        _ => "other",
    }
}

/// Decodes PNG, JPEG, WebP or GIF (first frame) `bytes` into 8-bit RGB as PIL's
/// `ImageOps.exif_transpose` then `convert("RGB")` gives it: the EXIF orientation
/// applied, alpha dropped (no blending), gray replicated. Bounded by `limits`.
pub fn decode_rgb(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, ImageError> {
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes {
            len: bytes.len(),
            max: limits.max_bytes,
        });
    }
    if bytes.is_empty() {
        return Err(ImageError::NoBytes);
    }
    let format = image::guess_format(bytes).map_err(|_| ImageError::UnknownFormat)?;
    if !matches!(
        format,
        ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif
    ) {
        let found = format
            .extensions_str()
            .first()
            .map_or("unknown".to_string(), |e| e.to_uppercase());
        return Err(ImageError::UnsupportedFormat { found });
    }
    let name = format_name(format);
    let decode_err = |e: image::ImageError| ImageError::Decode {
        format: name,
        reason: e.to_string(),
    };
    let budget = decode_budget(limits);
    // Open the decoder (it reads the header only) with the allocation limit but no side
    // limit, so a too-large side is reported with its size before any pixel is read.
    let mut header_limits = image::Limits::default();
    header_limits.max_alloc = Some(budget);
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    reader.limits(header_limits);
    let mut decoder = reader.into_decoder().map_err(decode_err)?;
    let (width, height) = decoder.dimensions();
    if width == 0 || height == 0 {
        return Err(ImageError::ZeroSize { width, height });
    }
    if width > limits.max_side || height > limits.max_side {
        return Err(ImageError::TooLarge {
            width,
            height,
            max_side: limits.max_side,
        });
    }
    let needed = decoder.total_bytes();
    if needed > budget {
        return Err(ImageError::TooMuchMemory {
            width,
            height,
            needed,
            max: budget,
        });
    }
    let mut full = image::Limits::default();
    full.max_image_width = Some(limits.max_side);
    full.max_image_height = Some(limits.max_side);
    full.max_alloc = Some(budget);
    decoder.set_limits(full).map_err(decode_err)?;
    // An unreadable orientation is no orientation, as PIL ignores broken EXIF.
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(decode_err)?;
    img.apply_orientation(orientation);
    Ok(match img {
        DynamicImage::ImageRgb8(rgb) => rgb,
        other => other.to_rgb8(),
    })
}

/// The reference's `smart_resize`: the (height, width) an `h × w` image is resized to,
/// both multiples of `factor`, the pixel count within `limits`' min and max where the
/// aspect ratio allows, the aspect ratio kept as near as can be. Python's arithmetic:
/// f64, `round` half to even. Refuses aspect ratios over 200.
pub fn target_size(
    h: usize,
    w: usize,
    factor: usize,
    limits: &ImageLimits,
) -> Result<(usize, usize), ImageError> {
    if factor == 0 {
        return Err(ImageError::BadConfig {
            field: "patch_size * merge",
        });
    }
    if h == 0 || w == 0 {
        return Err(ImageError::ZeroSize {
            width: w as u32,
            height: h as u32,
        });
    }
    let (hf, wf, ff) = (h as f64, w as f64, factor as f64);
    if h.max(w) as f64 / h.min(w) as f64 > 200.0 {
        return Err(ImageError::AspectRatio {
            width: w,
            height: h,
        });
    }
    let mut h_bar = (hf / ff).round_ties_even() as usize * factor;
    let mut w_bar = (wf / ff).round_ties_even() as usize * factor;
    if h_bar * w_bar > limits.max_pixels {
        let beta = ((h * w) as f64 / limits.max_pixels as f64).sqrt();
        h_bar = factor.max((hf / beta / ff).floor() as usize * factor);
        w_bar = factor.max((wf / beta / ff).floor() as usize * factor);
    } else if h_bar * w_bar < limits.min_pixels {
        let beta = (limits.min_pixels as f64 / (h * w) as f64).sqrt();
        h_bar = (hf * beta / ff).ceil() as usize * factor;
        w_bar = (wf * beta / ff).ceil() as usize * factor;
    }
    Ok((h_bar, w_bar))
}

/// Fixed-point precision of the resampling coefficients (PIL's 8-bit path).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// PIL's bicubic kernel (a = -0.5), support 2.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One output sample's taps: the first input index and the fixed-point weights.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// The taps of a resampling from `in_size` to `out_size` samples: each output centre
/// mapped back into the input, the kernel widened by the scale when shrinking (so it
/// averages), the weights normalised to sum 1 and rounded to `PRECISION_BITS`.
fn taps(in_size: usize, out_size: usize) -> Vec<Taps> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    (0..out_size)
        .map(|i| {
            let center = (i as f64 + 0.5) * scale;
            // C's (int) cast truncates; the lower end is clamped at 0 anyway.
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let raw: Vec<f64> = (lo..hi)
                .map(|x| bicubic((x as f64 - center + 0.5) / filterscale))
                .collect();
            let sum: f64 = raw.iter().sum();
            let one = f64::from(1u32 << PRECISION_BITS);
            let weights = raw
                .iter()
                .map(|&w| {
                    let w = if sum != 0.0 { w / sum } else { w };
                    if w < 0.0 {
                        (-0.5 + w * one) as i32
                    } else {
                        (0.5 + w * one) as i32
                    }
                })
                .collect();
            Taps { first: lo, weights }
        })
        .collect()
}

/// A weighted sum in fixed point, rounded and clipped to a byte.
#[inline]
fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// One horizontal resampling pass over `rows` rows of `w` RGB pixels.
fn pass_horizontal(src: &[u8], w: usize, rows: usize, out_w: usize) -> Vec<u8> {
    let half: i64 = 1 << (PRECISION_BITS - 1);
    let tx = taps(w, out_w);
    let mut out = vec![0u8; out_w * rows * 3];
    for y in 0..rows {
        let row = &src[y * w * 3..(y + 1) * w * 3];
        let orow = &mut out[y * out_w * 3..(y + 1) * out_w * 3];
        for (x, t) in tx.iter().enumerate() {
            for c in 0..3 {
                let mut acc = half;
                for (k, &wt) in t.weights.iter().enumerate() {
                    acc += i64::from(row[(t.first + k) * 3 + c]) * i64::from(wt);
                }
                orow[x * 3 + c] = clip8(acc);
            }
        }
    }
    out
}

/// One vertical resampling pass over `h` rows of `w` RGB pixels.
fn pass_vertical(src: &[u8], w: usize, h: usize, out_h: usize) -> Vec<u8> {
    let half: i64 = 1 << (PRECISION_BITS - 1);
    let ty = taps(h, out_h);
    let stride = w * 3;
    let mut out = vec![0u8; out_h * stride];
    for (y, t) in ty.iter().enumerate() {
        let orow = &mut out[y * stride..(y + 1) * stride];
        for (i, o) in orow.iter_mut().enumerate() {
            let mut acc = half;
            for (k, &wt) in t.weights.iter().enumerate() {
                acc += i64::from(src[(t.first + k) * stride + i]) * i64::from(wt);
            }
            *o = clip8(acc);
        }
    }
    out
}

/// Resizes an RGB image to `width × height` as PIL's `Image.resize(..., BICUBIC)` does:
/// two separable passes (each only where that side changes), both in fixed point with
/// the intermediate rounded to bytes. The same size returns a copy.
///
/// Pass order: the reference's Pillow (13.0) runs the vertical pass first when the
/// width grows and the height shrinks (the cheaper order there), and the horizontal one
/// first otherwise — measured against it, not documented. Where both sides shrink it
/// sometimes goes vertical first too, by a rule not pinned down; there the result may
/// differ from it by a few levels at sharp edges.
pub fn resize_bicubic(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (sw, sh) = src.dimensions();
    if (sw, sh) == (width, height) {
        return src.clone();
    }
    let (sw, sh, ow, oh) = (sw as usize, sh as usize, width as usize, height as usize);
    let raw = src.as_raw();
    let out = if ow == sw {
        pass_vertical(raw, sw, sh, oh)
    } else if oh == sh {
        pass_horizontal(raw, sw, sh, ow)
    } else if ow > sw && oh < sh {
        pass_horizontal(&pass_vertical(raw, sw, sh, oh), sw, oh, ow)
    } else {
        pass_vertical(&pass_horizontal(raw, sw, sh, ow), ow, sh, oh)
    };
    RgbImage::from_raw(width, height, out)
        .expect("the resized buffer holds width x height RGB pixels")
}

/// The normalised value of byte `x` in channel `c`: the reference rescales in f64 and
/// stores f32 (`(x as f64 * (1/255)) as f32`), then subtracts the mean and divides by
/// the std in f32.
#[inline]
fn normalise(x: u8, mean: f32, std: f32) -> f32 {
    let scaled = (f64::from(x) * (1.0 / 255.0)) as f32;
    (scaled - mean) / std
}

/// Cuts a resized RGB image into the encoder's patches (see [`PreparedImage::pixels`]):
/// patches ordered by `merge × merge` blocks (block row, block column, row in block,
/// column in block), each patch's values (channel, frame, y, x), the image standing
/// for each of its `temporal_patch` frames. Returns the values and the (h, w) grid.
pub fn patchify(img: &RgbImage, cfg: &VisionConfig) -> (Vec<f32>, usize, usize) {
    let (ps, m, tp) = (cfg.patch_size, cfg.merge, cfg.temporal_patch);
    let (w, h) = (img.width() as usize, img.height() as usize);
    let (gh, gw) = (h / ps, w / ps);
    let raw = img.as_raw();
    // Normalise each channel's 256 byte values once.
    let lut: Vec<[f32; 256]> = (0..3)
        .map(|c| std::array::from_fn(|x| normalise(x as u8, cfg.image_mean[c], cfg.image_std[c])))
        .collect();
    let mut out = Vec::with_capacity(gh * gw * 3 * tp * ps * ps);
    for br in 0..gh / m {
        for bc in 0..gw / m {
            for ir in 0..m {
                for ic in 0..m {
                    let (py, px) = ((br * m + ir) * ps, (bc * m + ic) * ps);
                    for (c, lut) in lut.iter().enumerate() {
                        for _ in 0..tp {
                            for y in py..py + ps {
                                let row = &raw[(y * w + px) * 3..(y * w + px + ps) * 3];
                                out.extend(row.chunks_exact(3).map(|p| lut[p[c] as usize]));
                            }
                        }
                    }
                }
            }
        }
    }
    (out, gh, gw)
}

/// Image file bytes to the encoder's input: decoded ([`decode_rgb`]), resized to
/// [`target_size`] with factor `patch_size * merge`, normalised and cut into patches.
pub fn prepare(
    bytes: &[u8],
    cfg: &VisionConfig,
    limits: &ImageLimits,
) -> Result<PreparedImage, ImageError> {
    for (field, v) in [
        ("patch_size", cfg.patch_size),
        ("merge", cfg.merge),
        ("temporal_patch", cfg.temporal_patch),
    ] {
        if v == 0 {
            return Err(ImageError::BadConfig { field });
        }
    }
    let rgb = decode_rgb(bytes, limits)?;
    let (h_bar, w_bar) = target_size(
        rgb.height() as usize,
        rgb.width() as usize,
        cfg.patch_size * cfg.merge,
        limits,
    )?;
    let resized = resize_bicubic(&rgb, w_bar as u32, h_bar as u32);
    drop(rgb);
    let (pixels, gh, gw) = patchify(&resized, cfg);
    Ok(PreparedImage {
        pixels,
        grid: [1, gh, gw],
        resized: (w_bar, h_bar),
        sha256: Sha256::digest(bytes).into(),
    })
}
