//! Helpers shared by the engine's integration tests.
// Each test target uses a different subset.
#![allow(dead_code)]

use engine::{Engine, Flow, GenerateRequest};
use model::geometry::Geometry;
use model::synth::{synthesize, Preset, SynthOptions};
use std::path::{Path, PathBuf};

/// Writes `geometry` at `preset` with seeded random weights into `dir`.
pub fn synth(dir: &Path, geometry: &str, preset: Preset, seed: u64) -> PathBuf {
    let g = Geometry::all()
        .into_iter()
        .find(|g| g.name == geometry)
        .unwrap_or_else(|| panic!("no geometry {geometry}"));
    synth_geometry(dir, &g, preset, seed)
}

/// Writes `arch`'s tiny geometry at `preset` with seeded random weights into `dir`.
pub fn synth_tiny(dir: &Path, arch: model::Arch, preset: Preset, seed: u64) -> PathBuf {
    let g = Geometry::by_name(Some(arch), "tiny").expect("tiny geometry");
    synth_geometry(dir, &g, preset, seed)
}

/// Writes the geometry `g` (a named one or one a test made up) at `preset` with
/// seeded random weights into `dir`.
pub fn synth_geometry(dir: &Path, g: &Geometry, preset: Preset, seed: u64) -> PathBuf {
    let path = dir.join(format!("{}-{preset}.gguf", g.name));
    synthesize(
        &path,
        g,
        &SynthOptions {
            preset,
            seed,
            sync: false,
        },
        &|_, _| {},
    )
    .expect("synthesize");
    path
}

/// Rewrites `src` into `dst`, letting `edit` change each tensor (name, type, bytes)
/// or drop it (None), and adding `extra` after them.
pub fn rewrite(
    src: &Path,
    dst: &Path,
    edit: impl Fn(&str, gguf::GgmlType, &[u8]) -> Option<(gguf::GgmlType, Vec<u8>)>,
    extra: &[gguf::InMemoryTensor],
) {
    let f = gguf::GgufFile::open(src).expect("open");
    let kvs: Vec<(&str, gguf::Value)> = f
        .metadata()
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let edited: Vec<(String, Vec<u64>, gguf::GgmlType, Vec<u8>)> = f
        .tensors()
        .iter()
        .filter_map(|t| {
            edit(&t.name, t.ty, f.tensor_data(t))
                .map(|(ty, data)| (t.name.clone(), t.dims.clone(), ty, data))
        })
        .collect();
    let tensors: Vec<gguf::InMemoryTensor> = edited
        .iter()
        .map(|(name, dims, ty, data)| gguf::InMemoryTensor {
            name,
            dims,
            ty: *ty,
            data,
        })
        .chain(extra.iter().map(|t| gguf::InMemoryTensor { ..*t }))
        .collect();
    gguf::write_file(dst, &kvs, &tensors).expect("write");
}

/// The device these tests run on: `SCORIA_TEST_DEVICE` (`cpu`, `cuda`, `cuda:N`),
/// the CPU by default. The GPU test script runs the same targets with `cuda`.
pub fn test_device() -> engine::Device {
    match std::env::var("SCORIA_TEST_DEVICE") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|e| panic!("SCORIA_TEST_DEVICE: {e}")),
        Err(_) => engine::Device::Cpu,
    }
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Greedy-generates `n` tokens, returning them and the logits the decode path
/// produced for each generated position (from single-token steps).
pub fn decode(eng: &mut Engine, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let req = GenerateRequest::greedy(prompt.to_vec(), n);
    let mut logits = Vec::new();
    let c = eng
        .generate_with_logits(&req, &mut |_| Flow::Continue, &mut |l| {
            logits.push(l.to_vec())
        })
        .expect("generate");
    (c.tokens, logits)
}

/// What a request produced: its tokens, the logits bits each came from, its end.
#[derive(Default, Debug)]
pub struct Seen {
    pub tokens: Vec<u32>,
    pub logits: Vec<Vec<u32>>,
    pub done: Option<Result<engine::Completion, String>>,
}

/// Callbacks that record a request into a [`Seen`].
pub struct Collect(pub std::sync::Arc<std::sync::Mutex<Seen>>);

impl engine::RequestCallbacks for Collect {
    fn token(&mut self, ev: &engine::TokenEvent) -> Flow {
        self.0.lock().unwrap().tokens.push(ev.token);
        Flow::Continue
    }
    fn wants_logits(&self) -> bool {
        true
    }
    fn logits(&mut self, l: &[f32]) {
        self.0.lock().unwrap().logits.push(bits(l));
    }
    fn done(&mut self, r: Result<engine::Completion, engine::EngineError>) {
        self.0.lock().unwrap().done = Some(r.map_err(|e| e.to_string()));
    }
}

/// Submits every request at once and steps the engine until they end (side by side
/// in its slots).
pub fn together(eng: &mut Engine, reqs: &[GenerateRequest]) -> Vec<Seen> {
    let seen: Vec<std::sync::Arc<std::sync::Mutex<Seen>>> =
        reqs.iter().map(|_| Default::default()).collect();
    for (r, s) in reqs.iter().zip(&seen) {
        eng.submit(r.clone(), Box::new(Collect(s.clone())));
    }
    while eng.step() {}
    seen.into_iter()
        .map(|s| std::mem::take(&mut *s.lock().unwrap()))
        .collect()
}

/// `tests/fixtures/<name>` of this checkout; `SCORIA_REPO_ROOT` moves it (test
/// executables copied to the GPU machine run from another directory).
pub fn fixtures(name: &str) -> std::path::PathBuf {
    let root = match std::env::var_os("SCORIA_REPO_ROOT") {
        Some(r) => std::path::PathBuf::from(r),
        None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."),
    };
    root.join("tests/fixtures").join(name)
}

/// The bytes of the routed experts of every layer of the file at `path`, the bytes
/// of one expert of its largest layer, and its config.
pub fn trunk_experts_and_largest(path: &Path) -> (u64, u64, model::ModelConfig) {
    let file = gguf::GgufFile::open(path).expect("open");
    let cfg = model::ModelConfig::from_gguf(&file).expect("config");
    let index = engine::experts::ExpertIndex::build(&file, &cfg).expect("index");
    let sizes = index.trunk_expert_bytes();
    let bytes = sizes.iter().sum::<u64>() * cfg.n_expert as u64;
    (bytes, sizes.into_iter().max().unwrap_or(0), cfg)
}

/// Budgets (VRAM, RAM) that tier the routed experts of the file at `path` on the
/// test device, which reported `vram_used` with every expert resident: on the GPU,
/// VRAM for half the experts and none in RAM, so misses come from the file; on the
/// CPU (no VRAM), a RAM budget of one byte, so every routed expert is read from it.
pub fn tiering_budgets(path: &Path, vram_used: Option<u64>) -> (Option<u64>, Option<u64>) {
    match vram_used {
        Some(used) => {
            let (experts, _, _) = trunk_experts_and_largest(path);
            (Some(used - experts / 2 + context_vram()), Some(0))
        }
        None => (None, Some(1)),
    }
}

/// VRAM the GPU executor keeps beside its weights and slots.
fn context_vram() -> u64 {
    #[cfg(feature = "cuda")]
    return engine::cuda::CONTEXT_VRAM;
    #[cfg(not(feature = "cuda"))]
    0
}

/// GPU 0, or None (and why) when this machine has none; `SCORIA_REQUIRE_GPU=1` makes a
/// missing GPU a failure.
#[cfg(feature = "cuda")]
pub fn gpu() -> Option<cuda::Gpu> {
    match cuda::Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            if std::env::var("SCORIA_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("SCORIA_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("skipped: no GPU ({e})");
            None
        }
    }
}

/// What a lost device leaves, checked on `eng` after two one-slot requests (`seen`,
/// the second queued behind the first) met it: the first emitted tokens, then ended
/// with the executor's error (`cause`); the queued one was refused with the remedy;
/// `Engine::fatal` names `cause`; every later request, queued or alone, is refused
/// at once with the remedy.
pub fn assert_device_lost(eng: &mut Engine, seen: &[Seen], cause: &str, prompt: &[u32]) {
    let err = |s: &Seen| match &s.done {
        Some(Err(e)) => e.clone(),
        other => panic!("an error expected, got {other:?}"),
    };
    let first = err(&seen[0]);
    assert!(first.contains(cause), "{first}");
    assert!(
        !seen[0].tokens.is_empty(),
        "the steps before the fault emitted tokens"
    );
    let second = err(&seen[1]);
    assert!(
        second.contains("can run nothing more") && second.contains("restart"),
        "{second}"
    );
    let fatal = eng
        .fatal()
        .expect("the engine reports the failure")
        .to_string();
    assert!(fatal.contains(cause), "{fatal}");
    let later = together(eng, &[GenerateRequest::greedy(prompt.to_vec(), 4)]);
    assert!(err(&later[0]).contains("restart the server"));
    let e = eng
        .generate(&GenerateRequest::greedy(prompt.to_vec(), 4), &mut |_| {
            Flow::Continue
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("restart the server"), "{e}");
}

/// A request's tokens and the bits of the logits each was chosen from.
pub type Bits = (Vec<u32>, Vec<Vec<u32>>);

/// A request alone: its [`Bits`].
pub fn solo(eng: &mut Engine, req: &GenerateRequest) -> Bits {
    let mut logits = Vec::new();
    let c = eng
        .generate_with_logits(req, &mut |_| Flow::Continue, &mut |l| logits.push(bits(l)))
        .unwrap_or_else(|e| panic!("generate: {e}"));
    (c.tokens, logits)
}

/// The disk-fault tests' requests: A (longer) and B (short, so that some experts
/// are left that it never uses).
pub fn fault_requests() -> [GenerateRequest; 2] {
    let toks = |n: usize, salt: usize| -> Vec<u32> {
        (0..n)
            .map(|i| ((i * 7919 + salt * 104_729 + 13) % 5000) as u32 + 100)
            .collect()
    };
    [
        GenerateRequest::greedy(toks(24, 1), 8),
        GenerateRequest::greedy(toks(3, 2), 2),
    ]
}

/// What a faulted run of A and B side by side must show: A ended with an error
/// containing each of `parts`, B has its solo bytes (`refs[1]`).
pub fn only_a_failed(seen: &[Seen], refs: &[Bits], parts: &[&str]) {
    let msg = match &seen[0].done {
        Some(Err(m)) => m.clone(),
        other => panic!(
            "A should have failed: {:?}",
            other.as_ref().map(|r| r.as_ref().map(|c| c.tokens.clone()))
        ),
    };
    for p in parts {
        assert!(msg.contains(p), "{p:?} not in {msg:?}");
    }
    assert!(
        matches!(seen[1].done, Some(Ok(_))),
        "B: {:?}",
        seen[1].done.as_ref().map(|r| r.as_ref().err())
    );
    assert_eq!(seen[1].tokens, refs[1].0, "B's tokens");
    assert_eq!(seen[1].logits, refs[1].1, "B's logits");
}

/// The file offset the read of expert `e`'s gate matrix of layer `l` starts at (the
/// 4096-byte block the matrix starts in), as a range for a fault rule.
pub fn gate_reads(
    index: &engine::experts::ExpertIndex,
    l: usize,
    e: usize,
) -> std::ops::Range<u64> {
    let m = index
        .matrix(l, e, model::tensors::ExpertMatrix::Gate)
        .expect("matrix");
    let start = m.offset / 4096 * 4096;
    start..start + 1
}
