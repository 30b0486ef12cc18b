//! One file per architecture: its tensor inventory and its special cases.

pub mod qwen35moe;
pub mod qwen3moe;
pub mod qwen3next;

use crate::config::{Arch, ModelConfig};
use crate::weights::{LayerWeights, Loader};
use crate::ModelError;

pub(crate) fn load_layer(
    l: &Loader,
    cfg: &ModelConfig,
    i: usize,
) -> Result<LayerWeights, ModelError> {
    match cfg.arch {
        Arch::Qwen3Moe => qwen3moe::load_layer(l, cfg, i),
        Arch::Qwen3Next => qwen3next::load_layer(l, cfg, i),
        Arch::Qwen35Moe => qwen35moe::load_layer(l, cfg, i),
    }
}
