//! What the CLI's server tests share.

use std::path::{Path, PathBuf};

/// A tiny qwen3moe with random weights in `dir` (its answers run to `max_tokens`).
pub fn tiny_model(dir: &Path) -> PathBuf {
    let path = dir.join("tiny-qwen3moe.gguf");
    let g = model::geometry::Geometry::by_name(Some(model::Arch::Qwen3Moe), "tiny").expect("tiny");
    model::synth::synthesize(
        &path,
        &g,
        &model::synth::SynthOptions {
            preset: model::synth::Preset::Q8_0,
            seed: 3,
            sync: false,
        },
        &|_, _| {},
    )
    .expect("synthesize");
    path
}
