//! What a network is: hyperparameters from GGUF metadata, the tensor inventory
//! and per-layer op sequence of each architecture, the tokenizer and chat template.

pub mod arch;
pub mod chat;
pub mod config;
pub mod deltanet;
pub mod forward;
pub mod geometry;
pub mod math;
pub mod moe;
pub mod requant;
pub mod simd;
pub mod synth;
pub mod tensors;
pub mod tokenizer;
pub mod vision;
pub mod vocab;
pub mod weights;

pub use config::{Arch, LayerKind, ModelConfig, SsmConfig};
pub use forward::{
    check_set_row, forward, forward_batch, Backend, ExecError, ExecErrorKind, Logits, Media, Norm,
    Segment, SegmentRows,
};
pub use weights::ModelWeights;

/// The weight types the kernels read, for messages ("F32, F16, ...").
fn supported_types() -> String {
    quant::SUPPORTED.map(|t| t.to_string()).join(", ")
}

/// Why a model file cannot be used; each names the key or tensor and the remedy.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("metadata key `{key}`: {msg}")]
    Metadata { key: String, msg: String },
    #[error("architecture `{0}` is not supported (supported: qwen3moe, qwen3next, qwen35moe)")]
    UnsupportedArch(String),
    #[error("tensor `{0}` is missing from the file")]
    MissingTensor(String),
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?} (ggml order) for this model's metadata")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` has type {ty}, which this engine has no kernel for (supported: {}); use a file quantized to a supported type", supported_types())]
    UnsupportedType { name: String, ty: gguf::GgmlType },
    #[error("{0}")]
    Unsupported(String),
}
