//! Parity with HuggingFace transformers on tiny random checkpoints of the three
//! HF model classes, converted to GGUF by llama.cpp's own converter (the files a
//! user has). Fixtures: tests/fixtures/<arch>/, made by tools/reference/.
//!
//! - F32 files: every position's logits within 1e-4 of the reference (relative to
//!   the row's largest |logit|), prompt in one pass and token by token, and the
//!   32 greedy tokens exactly.
//! - Q8_0 files with f32 activations (`Precision::ReferenceF32`): within 1e-3
//!   against transformers run on the Q8_0-rounded weights (1e-3: see below),
//!   which proves the Q8_0 blocks are read exactly.
//! - Q8_0 files on the serving kernels (int8 activations): close, not equal —
//!   activation quantization moves logits by ~1% and these random models amplify
//!   that through flipped expert choices, so only agreement statistics are checked.

mod common;

use common::test_device;
use engine::Precision;
use engine::{Engine, EngineConfig, Flow, GenerateRequest};
use std::path::{Path, PathBuf};

/// `tests/fixtures/<arch>` of this checkout; `SCORIA_REPO_ROOT` moves it (test
/// executables copied to the GPU machine run from another directory).
fn fixtures(arch: &str) -> PathBuf {
    let root = match std::env::var_os("SCORIA_REPO_ROOT") {
        Some(r) => PathBuf::from(r),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."),
    };
    root.join("tests/fixtures").join(arch)
}

struct Reference {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    sequence: Vec<u32>,
}

fn ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("reference.json: no array `{key}`"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn reference(arch: &str) -> Reference {
    let text =
        std::fs::read_to_string(fixtures(arch).join("reference.json")).expect("reference.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference.json parses");
    Reference {
        prompt: ids(&v, "prompt_ids"),
        greedy: ids(&v, "greedy_ids"),
        sequence: ids(&v, "sequence_ids"),
    }
}

fn npy(arch: &str, name: &str) -> (usize, Vec<f32>) {
    let (shape, data) = engine::npy::read_f32(&fixtures(arch).join(name)).expect("npy");
    assert_eq!(shape.len(), 2);
    (shape[1], data)
}

fn load(arch: &str, file: &str, precision: Precision) -> Engine {
    Engine::load(
        &fixtures(arch).join(file),
        &EngineConfig {
            threads: None,
            max_context: Some(256),
            precision,
            // Float-reference precision is a CPU mode.
            device: Some(if precision == Precision::ReferenceF32 {
                engine::Device::Cpu
            } else {
                test_device()
            }),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{arch}/{file}: {e}"))
}

/// Largest per-row error relative to the row's largest |reference logit|.
fn worst_relative(ours: &[f32], reference: &[f32], n_vocab: usize) -> (f32, usize) {
    assert_eq!(ours.len(), reference.len());
    let mut worst = (0.0f32, 0);
    for (r, (a, b)) in ours
        .chunks(n_vocab)
        .zip(reference.chunks(n_vocab))
        .enumerate()
    {
        let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
        let err = a
            .iter()
            .zip(b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
            / scale;
        assert!(err.is_finite(), "row {r}: non-finite logits");
        if err > worst.0 {
            worst = (err, r);
        }
    }
    worst
}

fn check_f32(arch: &str) {
    let r = reference(arch);
    let mut eng = load(arch, "model-f32.gguf", Precision::Canonical);
    let (n_vocab, full) = npy(arch, "full_logits.npy");
    assert_eq!(eng.info().n_vocab, n_vocab);

    // Prompt and generated tokens in one pass (teacher forcing).
    let ours = eng.logits_all(&r.sequence).expect("logits");
    let (err, row) = worst_relative(&ours, &full[..r.sequence.len() * n_vocab], n_vocab);
    assert!(
        err <= 1e-4,
        "{arch} F32: one-pass logits off by {err:.3e} (relative) at position {row}"
    );

    // Greedy generation through the decode path.
    let (_, stepped) = npy(arch, "logits.npy");
    let req = GenerateRequest::greedy(r.prompt.clone(), r.greedy.len());
    let mut rows: Vec<f32> = Vec::new();
    let c = eng
        .generate_with_logits(&req, &mut |_| Flow::Continue, &mut |l| {
            rows.extend_from_slice(l)
        })
        .expect("generate");
    assert_eq!(
        c.tokens, r.greedy,
        "{arch} F32: greedy tokens differ from transformers"
    );
    let first = r.prompt.len() - 1;
    let (err, row) = worst_relative(
        &rows,
        &stepped[first * n_vocab..(first + rows.len() / n_vocab) * n_vocab],
        n_vocab,
    );
    assert!(
        err <= 1e-4,
        "{arch} F32: decode logits off by {err:.3e} (relative) at generated step {row}"
    );
}

fn check_q8_0(arch: &str) {
    let r = reference(arch);
    let (n_vocab, q8_ref) = npy(arch, "q8_0_full_logits.npy");
    let q8_ref = &q8_ref[..r.sequence.len() * n_vocab];

    let mut exact = load(arch, "model-q8_0.gguf", Precision::ReferenceF32);
    let ours = exact.logits_all(&r.sequence).expect("logits");
    let (err, row) = worst_relative(&ours, q8_ref, n_vocab);
    // 1e-3 rather than 1e-4: the reference for this file is transformers' chunked
    // DeltaNet prefill over 112 tokens, which itself differs from its token-by-token
    // recurrence by up to ~1.5e-4 on these models (tools/reference/README.md).
    assert!(
        err <= 1e-3,
        "{arch} Q8_0 (f32 activations): off by {err:.3e} at position {row}"
    );

    let mut serving = load(arch, "model-q8_0.gguf", Precision::Canonical);
    let ours = serving.logits_all(&r.sequence).expect("logits");
    let mut agree = 0;
    let mut rels = Vec::new();
    for (a, b) in ours.chunks(n_vocab).zip(q8_ref.chunks(n_vocab)) {
        let am = engine::sampler::argmax(a);
        let bm = engine::sampler::argmax(b);
        agree += (am == bm) as usize;
        let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        rels.push(
            a.iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
                / scale,
        );
    }
    rels.sort_by(|a, b| a.total_cmp(b));
    let median = rels[rels.len() / 2];
    let n = r.sequence.len();
    assert!(
        agree * 4 >= n * 3,
        "{arch} Q8_0: argmax agrees on only {agree}/{n} positions"
    );
    assert!(
        median < 0.15,
        "{arch} Q8_0: median relative error {median:.3}"
    );
}

#[test]
fn qwen3moe_f32_matches_transformers() {
    check_f32("qwen3moe");
}
#[test]
fn qwen3next_f32_matches_transformers() {
    check_f32("qwen3next");
}
#[test]
fn qwen35moe_f32_matches_transformers() {
    check_f32("qwen35moe");
}
#[test]
fn qwen3moe_q8_0_matches_transformers() {
    check_q8_0("qwen3moe");
}
#[test]
fn qwen3next_q8_0_matches_transformers() {
    check_q8_0("qwen3next");
}
#[test]
fn qwen35moe_q8_0_matches_transformers() {
    check_q8_0("qwen35moe");
}
