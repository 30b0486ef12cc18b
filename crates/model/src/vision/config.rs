//! The vision encoder's hyperparameters, from an mmproj GGUF's `clip.*` keys.

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
