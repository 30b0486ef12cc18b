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
//! - The trained demo model (`models/demo.gguf`, Q4_0 and Q8_0 matrices), against
//!   transformers holding the file's dequantized tensors (tests/fixtures/demo): its
//!   fixture keeps ~1000 of the 248,320 columns and each row's log-sum-exp over all of
//!   them, so log-softmax values are compared at those columns. With f32 activations
//!   within 1e-3 nats, in one pass and token by token, and the 32 greedy tokens exactly;
//!   on the serving kernels (the CPU's or the GPU's) the greedy tokens exactly and the
//!   log-probabilities within what 8-bit activations move them.

mod common;

use common::{fixtures, test_device};
use engine::Precision;
use engine::{Engine, EngineConfig, Flow, GenerateRequest};

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

/// How far the serving kernels' log-probabilities may be from the demo's reference, at
/// the columns the reference gives at least 5% (ln 0.05 ≈ −3). Measured on the CPU
/// (2026-12-04): 0.116 nats in one pass, 0.067 token by token (0.019 at the columns over
/// 37%; 0.56 over every kept column, where the unlikely tokens' log-probabilities move
/// most). With f32 activations the same comparison is within 1.2e-5 nats.
const DEMO_SERVING_TOL: f32 = 0.15;
const DEMO_SERVING_MIN_LP: f32 = -3.0;

/// The demo model's fixture: the reference ids, the kept columns and each row's
/// log-sum-exp over the whole vocabulary.
struct Demo {
    r: Reference,
    columns: Vec<usize>,
    lse: Vec<f32>,
}

fn demo_fixture() -> Demo {
    let text = std::fs::read_to_string(fixtures("demo").join("reference.json"))
        .expect("tests/fixtures/demo/reference.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference.json parses");
    let floats = |key: &str| -> Vec<f64> {
        v[key]
            .as_array()
            .unwrap_or_else(|| panic!("reference.json: no array `{key}`"))
            .iter()
            .map(|x| x.as_f64().expect("number"))
            .collect()
    };
    assert_eq!(
        v["model_sha256"].as_str(),
        Some(model::synth::DEMO_MODEL_SHA256),
        "the fixture was made from another demo model"
    );
    Demo {
        r: reference("demo"),
        columns: floats("logit_columns")
            .iter()
            .map(|&c| c as usize)
            .collect(),
        lse: floats("logsumexp").iter().map(|&x| x as f32).collect(),
    }
}

fn demo_engine(precision: Precision) -> Engine {
    let path = model::synth::demo_model_path().expect("the demo model");
    Engine::load(
        &path,
        &EngineConfig {
            max_context: Some(256),
            precision,
            device: Some(if precision == Precision::ReferenceF32 {
                engine::Device::Cpu
            } else {
                test_device()
            }),
            ..Default::default()
        },
    )
    .expect("load the demo model")
}

/// The largest |difference| of log-softmax values at the fixture's columns between our
/// rows (every vocabulary entry) and the reference's rows `first..` (the kept columns,
/// normalized by each row's log-sum-exp), and where it is; only columns whose reference
/// log-probability is at least `min_lp`.
fn demo_worst(
    d: &Demo,
    ours: &[f32],
    n_vocab: usize,
    reference: &[f32],
    first: usize,
    min_lp: f32,
) -> (f32, usize) {
    let n_cols = d.columns.len();
    let mut worst = (0.0f32, 0);
    for (i, row) in ours.chunks(n_vocab).enumerate() {
        let r = first + i;
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let lse = m + row
            .iter()
            .map(|&x| f64::from((x - m).exp()))
            .sum::<f64>()
            .ln() as f32;
        let want = &reference[r * n_cols..(r + 1) * n_cols];
        for (&c, &w) in d.columns.iter().zip(want) {
            if w - d.lse[r] < min_lp {
                continue;
            }
            let err = ((row[c] - lse) - (w - d.lse[r])).abs();
            assert!(err.is_finite(), "row {r}: non-finite log-probability");
            if err > worst.0 {
                worst = (err, r);
            }
        }
    }
    worst
}

/// Runs the demo at `precision`: the one-pass log-softmax error, the decode one (over the
/// columns whose reference log-probability is at least `min_lp`), and the greedy tokens.
fn demo_run(precision: Precision, min_lp: f32) -> (f32, f32, Vec<u32>) {
    let d = demo_fixture();
    let mut eng = demo_engine(precision);
    let n_vocab = eng.info().n_vocab;
    let (_, full) = npy("demo", "full_logits.npy");
    let ours = eng.logits_all(&d.r.sequence).expect("logits");
    let (one_pass, row) = demo_worst(&d, &ours, n_vocab, &full, 0, min_lp);
    eprintln!("demo {precision:?}: one pass within {one_pass:.3e} nats (row {row})");
    let (_, stepped) = npy("demo", "logits.npy");
    let req = GenerateRequest::greedy(d.r.prompt.clone(), d.r.greedy.len());
    let mut rows: Vec<f32> = Vec::new();
    let c = eng
        .generate_with_logits(&req, &mut |_| Flow::Continue, &mut |l| {
            rows.extend_from_slice(l)
        })
        .expect("generate");
    let (decode, row) = demo_worst(&d, &rows, n_vocab, &stepped, d.r.prompt.len() - 1, min_lp);
    eprintln!("demo {precision:?}: decode within {decode:.3e} nats (row {row})");
    (one_pass, decode, c.tokens)
}

#[test]
fn demo_model_matches_transformers_with_f32_activations() {
    let (one_pass, decode, tokens) = demo_run(Precision::ReferenceF32, f32::NEG_INFINITY);
    let d = demo_fixture();
    assert_eq!(
        tokens, d.r.greedy,
        "demo: greedy tokens differ from transformers"
    );
    assert!(
        one_pass <= 1e-3,
        "demo: one-pass log-probabilities off by {one_pass:.3e}"
    );
    assert!(
        decode <= 1e-3,
        "demo: decode log-probabilities off by {decode:.3e}"
    );
}

#[test]
fn demo_model_on_the_serving_kernels_keeps_transformers_greedy_tokens() {
    let (one_pass, decode, tokens) = demo_run(Precision::Canonical, DEMO_SERVING_MIN_LP);
    let d = demo_fixture();
    assert_eq!(
        tokens, d.r.greedy,
        "demo: greedy tokens differ from transformers"
    );
    // 8-bit activations move the likely tokens' log-probabilities by about a tenth of a nat.
    assert!(
        one_pass <= DEMO_SERVING_TOL,
        "demo: one pass off by {one_pass:.3e}"
    );
    assert!(
        decode <= DEMO_SERVING_TOL,
        "demo: decode off by {decode:.3e}"
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
