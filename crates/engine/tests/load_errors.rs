//! A model file the engine cannot use is refused with a message naming what is
//! wrong — an unsupported tensor type by tensor name (before anything is
//! allocated), a missing tensor, a truncated file by byte offset — never a panic.

mod common;

use common::rewrite;
use engine::{Engine, EngineConfig};
use gguf::{GgmlType, GgufFile, InMemoryTensor};
use model::geometry::Geometry;
use model::synth::{synthesize, Preset, SynthOptions};
use std::path::{Path, PathBuf};

fn tiny(dir: &Path) -> PathBuf {
    let g = Geometry::all()
        .into_iter()
        .find(|g| g.name == "tiny-qwen3moe")
        .expect("tiny-qwen3moe");
    let path = dir.join("tiny.gguf");
    synthesize(
        &path,
        &g,
        &SynthOptions {
            preset: Preset::Q8_0,
            seed: 3,
            sync: false,
        },
        &|_, _| {},
    )
    .expect("synthesize");
    path
}

fn load_err(path: &Path) -> String {
    match Engine::load(path, &EngineConfig::default()) {
        Ok(_) => panic!("{} loaded but should have been refused", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_type_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = tiny(dir.path());
    // Q8_K has no kernel here (llama.cpp's activation type; no model stores weights in it).
    let bad = GgmlType::Q8_K;
    let dst = dir.path().join(format!("{bad}.gguf"));
    rewrite(
        &src,
        &dst,
        |name, ty, data| {
            if name == "blk.1.ffn_up_exps.weight" {
                // Same element count, stored as `bad`.
                let n = data.len() / ty.type_size() * ty.block_size();
                Some((bad, vec![0u8; n / bad.block_size() * bad.type_size()]))
            } else {
                Some((ty, data.to_vec()))
            }
        },
        &[],
    );
    let e = load_err(&dst);
    assert!(
        e.contains("blk.1.ffn_up_exps.weight") && e.contains(bad.name()),
        "{e}"
    );
}

/// `tiny` with `extra` tensors added.
fn with_extra(dir: &Path, name: &str, extra: &[InMemoryTensor]) -> PathBuf {
    let src = tiny(dir);
    let dst = dir.join(name);
    rewrite(&src, &dst, |_, ty, data| Some((ty, data.to_vec())), extra);
    dst
}

/// An NVFP4 file converted from an FP4 checkpoint carries each matrix's second-level
/// scale (`<matrix>.scale`), applied to the matrix's products (tests/nvfp4_scales.rs).
/// One the engine could not apply, or of the wrong size or value, is refused by name.
#[test]
fn second_level_scales_it_cannot_apply_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let n_expert = GgufFile::open(&tiny(dir.path()))
        .expect("open")
        .tensor("blk.1.ffn_up_exps.weight")
        .expect("experts")
        .dims[2] as usize;
    let one = 0.5f32.to_le_bytes();
    let two: Vec<u8> = [0.5f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let nan = f32::NAN.to_le_bytes();
    let cases: [(&str, &[u64], &[u8], &str); 5] = [
        // A norm is read as a vector: no product to apply it to.
        (
            "blk.0.attn_norm.scale",
            &[1],
            &one,
            "without a matrix product",
        ),
        ("token_embd.scale", &[1], &one, "without a matrix product"),
        // A scale of no tensor (as `output.scale` where the head is the embedding).
        ("blk.0.attn_missing.scale", &[1], &one, "does not have"),
        // Neither one value nor one per expert.
        ("blk.1.ffn_up_exps.scale", &[2], &two, "one per expert"),
        ("blk.1.attn_q.scale", &[1], &nan, "NaN"),
    ];
    assert_ne!(n_expert, 2);
    for (name, dims, data, says) in cases {
        let path = with_extra(
            dir.path(),
            "scaled.gguf",
            &[InMemoryTensor {
                name,
                dims,
                ty: GgmlType::F32,
                data,
            }],
        );
        let e = load_err(&path);
        assert!(e.contains(name) && e.contains(says), "{name}: {e}");
    }
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = tiny(dir.path());
    let dst = dir.path().join("missing.gguf");
    rewrite(
        &src,
        &dst,
        |name, ty, data| (name != "blk.2.attn_k_norm.weight").then(|| (ty, data.to_vec())),
        &[],
    );
    let e = load_err(&dst);
    assert!(e.contains("blk.2.attn_k_norm.weight"), "{e}");
}

#[test]
fn truncated_file_names_an_offset() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = tiny(dir.path());
    let bytes = std::fs::read(&src).expect("read");
    for cut in [10usize, 1000, bytes.len() / 2, bytes.len() - 7] {
        let dst = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&dst, &bytes[..cut]).expect("write");
        let e = load_err(&dst);
        assert!(e.contains("offset"), "cut at {cut}: {e}");
    }
}

#[test]
fn mtp_block_loads_with_the_trunk() {
    // tiny-qwen35moe carries one NextN/MTP block after its trunk, as real
    // Qwen3.6 files do; it loads and is kept out of the trunk's layer count.
    let g = Geometry::all()
        .into_iter()
        .find(|g| g.name == "tiny-qwen35moe")
        .expect("tiny-qwen35moe");
    assert!(g.n_nextn > 0);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t35.gguf");
    synthesize(
        &path,
        &g,
        &SynthOptions {
            preset: Preset::Q8_0,
            seed: 1,
            sync: false,
        },
        &|_, _| {},
    )
    .expect("synthesize");
    let eng = Engine::load(&path, &EngineConfig::default()).expect("load");
    assert_eq!(eng.config().n_nextn, g.n_nextn as usize);
    assert_eq!(eng.config().n_layer, g.n_layer as usize);
}

/// A `--max-context` no machine can hold (18446744073709551615 wrapped the state-size
/// arithmetic, passed the memory check and panicked with `capacity overflow`) and
/// thread counts of 0 or thousands are refused with the flag named.
#[test]
fn absurd_context_and_thread_counts_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = tiny(dir.path());
    let load = |cfg: EngineConfig| match Engine::load(&path, &cfg) {
        Ok(_) => panic!("{cfg:?} loaded but should have been refused"),
        Err(e) => e.to_string(),
    };
    for n_ctx in [usize::MAX, 1 << 60, 1 << 40] {
        let e = load(EngineConfig {
            max_context: Some(n_ctx),
            ..Default::default()
        });
        assert!(
            e.contains(&format!("--max-context {n_ctx}")) && e.contains("lower --max-context"),
            "{e}"
        );
    }
    for threads in [0, 100_000] {
        let e = load(EngineConfig {
            threads: Some(threads),
            ..Default::default()
        });
        assert!(e.contains(&format!("-t/--threads {threads}")), "{e}");
    }
}
