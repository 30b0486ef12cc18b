//! The vision encoder's hyperparameters, from an mmproj GGUF's `clip.*` keys.
//!
//! Keys are the ones llama.cpp's converter writes for a Qwen3.5/3.6 checkpoint with
//! `--mmproj` (`general.architecture = clip`, `clip.projector_type = qwen3vl_merger`).
//! A missing key is an error that names it. Qwen3-VL's deep-stack mergers (the same
//! projector type, with `clip.vision.is_deepstack_layers` set) are refused.

use crate::ModelError;
use gguf::{GgufFile, Value};

/// The projector type of the Qwen3.5/3.6 encoder (llama.cpp's name for it).
pub const PROJECTOR_TYPE: &str = "qwen3vl_merger";

/// What the encoder and the preprocessing need to know (see `from_gguf`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Width of the ViT (`clip.vision.embedding_length`).
    pub hidden: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// The ViT MLP's inner width.
    pub ffn: usize,
    /// Patch side in pixels.
    pub patch_size: usize,
    /// Frames per patch (2: an image is its own two frames).
    pub temporal_patch: usize,
    /// The merger joins `merge × merge` patches into one text-model row.
    pub merge: usize,
    /// Side of the learned position-embedding grid (`image_size / patch_size`).
    pub pos_side: usize,
    /// The text model's hidden size (`clip.vision.projection_dim`).
    pub out_hidden: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Rotary base of the 2-D positions.
    pub rope_theta: f32,
}

/// Input channels of a patch (RGB).
pub const IN_CHANNELS: usize = 3;

fn meta_err(key: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Metadata {
        key: key.to_string(),
        msg: msg.into(),
    }
}

fn req<'a>(f: &'a GgufFile, key: &str) -> Result<&'a Value, ModelError> {
    f.get(key).ok_or_else(|| {
        meta_err(
            key,
            "missing; this is not a Qwen3.5/3.6 mmproj as llama.cpp's converter writes it (convert the checkpoint with --mmproj)",
        )
    })
}

/// A positive dimension, bounded so that products of dimensions cannot overflow.
fn dim(f: &GgufFile, key: &str) -> Result<usize, ModelError> {
    let v = req(f, key)?;
    match v.as_u64() {
        Some(0) => Err(meta_err(key, "is 0; expected a positive integer")),
        Some(n) if n > (1 << 20) => Err(meta_err(key, format!("value {n} is implausibly large"))),
        Some(n) => Ok(n as usize),
        None => Err(meta_err(
            key,
            format!("expected a positive integer, found {v:?}"),
        )),
    }
}

fn float(f: &GgufFile, key: &str) -> Result<f32, ModelError> {
    let v = req(f, key)?;
    v.as_f64()
        .map(|x| x as f32)
        .filter(|x| x.is_finite())
        .ok_or_else(|| meta_err(key, format!("expected a finite number, found {v:?}")))
}

fn triple(f: &GgufFile, key: &str) -> Result<[f32; 3], ModelError> {
    let v = req(f, key)?;
    let bad = || meta_err(key, format!("expected an array of 3 numbers, found {v:?}"));
    let a = v.as_array().ok_or_else(bad)?;
    if a.len() != 3 {
        return Err(bad());
    }
    let mut out = [0.0f32; 3];
    for (o, x) in out.iter_mut().zip(a) {
        *o = x.as_f64().ok_or_else(bad)? as f32;
    }
    Ok(out)
}

impl VisionConfig {
    /// Reads and checks the `clip.*` keys of an mmproj file.
    pub fn from_gguf(f: &GgufFile) -> Result<VisionConfig, ModelError> {
        let key = "general.architecture";
        let arch = req(f, key)?
            .as_str()
            .ok_or_else(|| meta_err(key, "expected a string"))?;
        if arch != "clip" {
            return Err(meta_err(
                key,
                format!(
                    "is `{arch}`, expected `clip`: this is not a vision encoder (mmproj) file; pass the mmproj GGUF converted with --mmproj, not the text model"
                ),
            ));
        }
        let key = "clip.projector_type";
        let projector = req(f, key)?
            .as_str()
            .ok_or_else(|| meta_err(key, "expected a string"))?;
        if projector != PROJECTOR_TYPE {
            return Err(meta_err(
                key,
                format!(
                    "projector type `{projector}` is not supported; scoria runs the Qwen3.5/3.6 vision encoder (`{PROJECTOR_TYPE}`): use the mmproj file of a Qwen3.5 or Qwen3.6 model"
                ),
            ));
        }
        let n_layer = dim(f, "clip.vision.block_count")?;
        let key = "clip.vision.is_deepstack_layers";
        if let Some(v) = f.get(key) {
            let flags = v.as_array().ok_or_else(|| {
                meta_err(key, format!("expected an array of booleans, found {v:?}"))
            })?;
            let mut deep = Vec::new();
            for (i, x) in flags.iter().enumerate() {
                match x.as_bool() {
                    Some(true) => deep.push(i.to_string()),
                    Some(false) => {}
                    None => {
                        return Err(meta_err(
                            key,
                            format!("element {i} is {x:?}, expected a boolean"),
                        ))
                    }
                }
            }
            if !deep.is_empty() {
                return Err(meta_err(
                    key,
                    format!(
                        "layer(s) {} feed deep-stack mergers, which Qwen3-VL encoders have and scoria does not support; use a Qwen3.5/3.6 mmproj (no deep-stack layers)",
                        deep.join(", ")
                    ),
                ));
            }
        }

        let hidden = dim(f, "clip.vision.embedding_length")?;
        let n_head = dim(f, "clip.vision.attention.head_count")?;
        if hidden % n_head != 0 || (hidden / n_head) % 4 != 0 {
            return Err(meta_err(
                "clip.vision.attention.head_count",
                format!(
                    "{n_head} heads do not split embedding_length {hidden} into heads of a multiple of 4 values (the 2-D rotary needs that)"
                ),
            ));
        }
        let patch_size = dim(f, "clip.vision.patch_size")?;
        let image_size = dim(f, "clip.vision.image_size")?;
        if image_size % patch_size != 0 {
            return Err(meta_err(
                "clip.vision.image_size",
                format!("{image_size} is not a multiple of patch_size {patch_size}"),
            ));
        }
        let eps = float(f, "clip.vision.attention.layer_norm_epsilon")?;
        if eps <= 0.0 {
            return Err(meta_err(
                "clip.vision.attention.layer_norm_epsilon",
                format!("{eps} is not positive"),
            ));
        }
        let image_std = triple(f, "clip.vision.image_std")?;
        if image_std.iter().any(|&s| s == 0.0 || !s.is_finite()) {
            return Err(meta_err(
                "clip.vision.image_std",
                format!("{image_std:?} has a zero or non-finite value"),
            ));
        }
        Ok(VisionConfig {
            hidden,
            n_layer,
            n_head,
            ffn: dim(f, "clip.vision.feed_forward_length")?,
            patch_size,
            // The converter splits the Conv3d into exactly two frames.
            temporal_patch: 2,
            merge: dim(f, "clip.vision.spatial_merge_size")?,
            pos_side: image_size / patch_size,
            out_hidden: dim(f, "clip.vision.projection_dim")?,
            eps,
            image_mean: triple(f, "clip.vision.image_mean")?,
            image_std,
            rope_theta: 10000.0,
        })
    }

    /// Values per attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.n_head
    }

    /// Values in one patch row of a [`super::PreparedImage`]: channel, frame, y, x.
    pub fn patch_values(&self) -> usize {
        IN_CHANNELS * self.temporal_patch * self.patch_size * self.patch_size
    }
}
