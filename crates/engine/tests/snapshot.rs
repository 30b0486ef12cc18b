//! Sequence snapshots and the growing K/V cache of the CPU executor, on tiny
//! synthetic models of every arch: a restored sequence (the same one, another one,
//! a recurrent-only restore, a snapshot that went through the prompt cache's files)
//! continues with the bits of a cold run; a cache that grows across its page
//! boundaries gives the bits of one allocated for the whole context up front (the
//! layout before growth existed); clear gives the memory back.

mod common;

use engine::cpu::{CpuBackend, CpuExecutor, KV_PAGE};
use engine::exec::{Executor, SeqSnapshot, SeqStep, StepOut, Want};
use engine::prompt_cache::PromptCache;
use gguf::GgufFile;
use model::geometry::ARCHS;
use model::synth::Preset;
use model::{Arch, Logits, ModelConfig, ModelWeights};
use std::path::Path;
use std::sync::Arc;

const N_CTX: usize = 1024;

/// A CPU executor of `n_seq` sequences of `N_CTX` positions, and the model's config.
fn executor(path: &Path, n_seq: usize) -> (CpuExecutor, ModelConfig) {
    let file = Arc::new(GgufFile::open(path).expect("open"));
    let cfg = ModelConfig::from_gguf(&file).expect("config");
    let weights = ModelWeights::load(&file, &cfg).expect("weights");
    let backend = CpuBackend {
        cfg: cfg.clone(),
        weights,
        precision: Default::default(),
        routing: None,
        tier: None,
        hidden: Default::default(),
    };
    (
        CpuExecutor::new(backend, N_CTX, n_seq).expect("executor"),
        cfg,
    )
}

fn tokens(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % 5000) as u32)
        .collect()
}

/// Runs `toks` at `pos0` of `seq`; the bits of the logits `want` asks for (empty
/// for Greedy).
fn step(ex: &mut CpuExecutor, seq: usize, toks: &[u32], pos0: usize, want: Want) -> Vec<u32> {
    let out = ex
        .step(&[SeqStep {
            seq,
            tokens: toks,
            pos0,
            want,
            media: Default::default(),
            draws: &[],
        }])
        .expect("step");
    match out.into_iter().next().expect("one output") {
        StepOut::Logits(l) => l.iter().map(|x| x.to_bits()).collect(),
        StepOut::Token(_) | StepOut::Tokens(_) => Vec::new(),
    }
}

const ALL: Want = Want::Logits(Logits::All);

/// Cold: `t[..at]` then `t[at..]` with every position's logits.
fn cold(ex: &mut CpuExecutor, seq: usize, t: &[u32], at: usize) -> Vec<u32> {
    ex.clear(seq).expect("clear");
    step(ex, seq, &t[..at], 0, Want::Greedy);
    step(ex, seq, &t[at..], at, ALL)
}

fn check_restores(arch: Arch) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 11);
    let (mut ex, cfg) = executor(&path, 3);
    let hybrid = cfg.ssm.is_some();
    let t = tokens(30, 0);
    let other = tokens(7, 1);
    let want20 = cold(&mut ex, 2, &t, 20);
    let want12 = cold(&mut ex, 2, &t, 12);

    // Snapshot at 20, wander off (positions 20..27 overwritten, the recurrent state
    // moved on), restore, continue.
    ex.clear(0).unwrap();
    step(&mut ex, 0, &t[..20], 0, Want::Greedy);
    let snap = ex.snapshot(0, 20).expect("snapshot");
    assert_eq!((snap.pos, snap.kv_pos), (20, 20));
    assert_eq!(snap.rewindable(), !hybrid, "{arch:?}");
    assert_eq!(
        snap.bytes(),
        20 * cfg.kv_bytes_per_position() + cfg.recurrent_state_bytes(),
        "{arch:?}: snapshot size"
    );
    step(&mut ex, 0, &other, 20, Want::Greedy);
    ex.restore(0, &snap, 20).expect("restore");
    assert_eq!(
        step(&mut ex, 0, &t[20..], 20, ALL),
        want20,
        "{arch:?}: restore into the same sequence"
    );

    // Into another sequence, which held something else.
    step(&mut ex, 1, &other, 0, Want::Greedy);
    ex.restore(1, &snap, 20).expect("restore elsewhere");
    assert_eq!(
        step(&mut ex, 1, &t[20..], 20, ALL),
        want20,
        "{arch:?}: restore into another sequence"
    );

    // Recurrent state only, over the sequence's own K/V.
    ex.clear(0).unwrap();
    step(&mut ex, 0, &t[..20], 0, Want::Greedy);
    let rec = ex.snapshot_recurrent(0, 20).expect("recurrent snapshot");
    assert_eq!(rec.kv_pos, 0);
    assert_eq!(rec.bytes(), cfg.recurrent_state_bytes());
    step(&mut ex, 0, &other, 20, Want::Greedy);
    ex.restore_recurrent(0, &rec).expect("restore recurrent");
    assert_eq!(
        step(&mut ex, 0, &t[20..], 20, ALL),
        want20,
        "{arch:?}: recurrent-only restore"
    );
    // ...which needs K/V in place: a cleared sequence refuses it.
    ex.clear(0).unwrap();
    assert!(ex.restore_recurrent(0, &rec).is_err());
    // And it holds no K/V to restore from.
    assert!(ex.restore(0, &rec, 20).is_err());

    // A prefix of the snapshot: attention-only models rewind, hybrids refuse.
    let prefix = ex.restore(0, &snap, 12);
    if hybrid {
        let err = prefix.expect_err("hybrid rewind");
        assert!(err.to_string().contains("cannot be rewound"), "{err}");
    } else {
        prefix.expect("prefix restore");
        assert_eq!(
            step(&mut ex, 0, &t[12..], 12, ALL),
            want12,
            "{arch:?}: prefix restore"
        );
    }
    assert!(ex.restore(0, &snap, 21).is_err(), "beyond the snapshot");
    // A sequence cannot be snapshotted beyond what it was fed.
    ex.clear(0).unwrap();
    step(&mut ex, 0, &t[..5], 0, Want::Greedy);
    assert!(ex.snapshot(0, 6).is_err());
    // A snapshot of another shape is refused and leaves the sequence as it was.
    let mut bad: SeqSnapshot = snap.clone();
    bad.kv.pop();
    assert!(ex.restore(0, &bad, 20).is_err());
    assert_eq!(ex.capacity(0), Some(KV_PAGE));

    // Through the prompt cache and its files: a hit restores the cold bits.
    let cache_dir = tempfile::tempdir().expect("tempdir");
    let mut store = PromptCache::new(1 << 30);
    store.insert(t[..20].to_vec(), snap).expect("insert");
    store
        .save_dir(cache_dir.path(), "synth-model")
        .expect("save");
    let mut warm = PromptCache::new(1 << 30);
    let r = warm
        .load_dir(cache_dir.path(), "synth-model")
        .expect("load");
    assert_eq!(r.loaded, 1);
    let hit = warm.lookup(&t).expect("hit");
    assert_eq!(hit.matched, 20);
    ex.restore(0, &hit.snapshot, hit.matched)
        .expect("restore hit");
    assert_eq!(
        step(&mut ex, 0, &t[20..], 20, ALL),
        want20,
        "{arch:?}: prompt-cache hit"
    );
}

#[test]
fn restores_give_cold_bits_qwen3moe() {
    check_restores(Arch::Qwen3Moe);
}

#[test]
fn restores_give_cold_bits_qwen3next() {
    check_restores(Arch::Qwen3Next);
}

#[test]
fn restores_give_cold_bits_qwen35moe() {
    check_restores(Arch::Qwen35Moe);
}

/// A cache growing across its page boundaries (in single-token steps and inside a
/// prompt piece) gives the bits of one allocated for the whole context first; clear
/// frees it.
#[test]
fn growing_cache_matches_preallocated() {
    for arch in ARCHS {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 11);
        let (mut ex, cfg) = executor(&path, 2);
        let (grow, full) = (0, 1);
        ex.reserve(full, N_CTX).expect("reserve");
        assert_eq!(ex.capacity(full), Some(N_CTX));
        assert_eq!(ex.seq_bytes(full), Some(cfg.seq_state_bytes(N_CTX)));
        assert_eq!(ex.capacity(grow), Some(0));
        assert_eq!(ex.seq_bytes(grow), Some(cfg.recurrent_state_bytes()));

        let t = tokens(610, 2);
        let last = Want::Logits(Logits::Last);
        let mut pieces: Vec<(usize, usize, Want)> = vec![(0, 250, Want::Greedy)];
        pieces.extend((250..262).map(|p| (p, p + 1, last)));
        pieces.push((262, 600, last));
        pieces.extend((600..610).map(|p| (p, p + 1, last)));
        for &(a, b, want) in &pieces {
            let g = step(&mut ex, grow, &t[a..b], a, want);
            let f = step(&mut ex, full, &t[a..b], a, want);
            assert_eq!(g, f, "{arch:?}: positions {a}..{b}");
            let cap = ex.capacity(grow).unwrap();
            assert!(
                cap >= b && cap <= N_CTX,
                "{arch:?}: capacity {cap} after {b}"
            );
        }
        // 256 → 512 (at 256) → 768 (at 513, a quarter or a page more).
        assert_eq!(ex.capacity(grow), Some(768), "{arch:?}");
        assert_eq!(
            ex.seq_bytes(grow),
            Some(768 * cfg.kv_bytes_per_position() + cfg.recurrent_state_bytes())
        );
        assert_eq!(
            ex.state_bytes_held(),
            Some(ex.seq_bytes(grow).unwrap() + ex.seq_bytes(full).unwrap())
        );
        // A snapshot of the grown sequence restores into the preallocated one.
        let snap = ex.snapshot(grow, 610).expect("snapshot");
        ex.restore(full, &snap, 610).expect("restore");
        let next = tokens(3, 3);
        let g = step(&mut ex, grow, &next, 610, ALL);
        let f = step(&mut ex, full, &next, 610, ALL);
        assert_eq!(g, f, "{arch:?}: after a restore across layouts");

        for seq in [grow, full] {
            ex.clear(seq).unwrap();
            assert_eq!(ex.capacity(seq), Some(0));
            assert_eq!(ex.seq_bytes(seq), Some(cfg.recurrent_state_bytes()));
        }
    }
}
