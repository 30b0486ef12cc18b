//! TEMPORARY stand-in for `model::vision::preprocess` (being written beside this
//! branch): the same signature, reading only a PNG's size and giving the grid the
//! reference's resize rule gives, with zero pixels. Deleted once the real module lands
//! in main; nothing here is used outside `images.rs`.

use model::vision::{PreparedImage, VisionConfig};

#[derive(Debug, Clone, PartialEq)]
pub struct ImageLimits {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub max_bytes: usize,
    pub max_side: usize,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits {
            min_pixels: 4096,
            max_pixels: 16 << 20,
            max_bytes: 20 << 20,
            max_side: 16384,
        }
    }
}

#[derive(Debug)]
pub struct ImageError(String);

impl std::fmt::Display for ImageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

pub fn prepare(
    bytes: &[u8],
    cfg: &VisionConfig,
    limits: &ImageLimits,
) -> Result<PreparedImage, ImageError> {
    if bytes.len() > limits.max_bytes {
        return Err(ImageError(format!(
            "the image is {} bytes, more than the {} allowed",
            bytes.len(),
            limits.max_bytes
        )));
    }
    if bytes.len() < 24 || &bytes[..8] != b"\x89PNG\r\n\x1a\n" || &bytes[12..16] != b"IHDR" {
        return Err(ImageError(
            "the image could not be decoded: not a PNG".into(),
        ));
    }
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap()) as f64;
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap()) as f64;
    let f = (cfg.patch_size * cfg.merge) as f64;
    let (mut hb, mut wb) = ((h / f).round() * f, (w / f).round() * f);
    if hb * wb > limits.max_pixels as f64 {
        let beta = (h * w / limits.max_pixels as f64).sqrt();
        hb = f.max((h / beta / f).floor() * f);
        wb = f.max((w / beta / f).floor() * f);
    } else if hb * wb < limits.min_pixels as f64 {
        let beta = (limits.min_pixels as f64 / (h * w)).sqrt();
        hb = (h * beta / f).ceil() * f;
        wb = (w * beta / f).ceil() * f;
    }
    let grid = [
        1,
        hb as usize / cfg.patch_size,
        wb as usize / cfg.patch_size,
    ];
    let per = 3 * cfg.temporal_patch * cfg.patch_size * cfg.patch_size;
    Ok(PreparedImage {
        pixels: vec![0.0; grid.iter().product::<usize>() * per],
        grid,
        resized: (wb as usize, hb as usize),
        sha256: [0; 32],
    })
}
