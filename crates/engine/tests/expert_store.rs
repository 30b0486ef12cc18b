//! The expert store's slot policy (`engine::experts::ExpertStore`), on the index of a
//! synthetic model: what a step hits, fetches and evicts, how a prompt that needs more
//! experts than a layer has slots is split into batches, where each expert's bytes come
//! from, and the counters. The GPU test `tiered_experts_give_the_resident_bits` checks
//! that the executor carrying these answers out gives the resident executor's bits.

use engine::experts::{plan, Batch, ExpertIndex, ExpertStore, Home, PlanRequest};
use gguf::GgufFile;
use model::geometry::Geometry;
use model::synth::{synthesize, Preset, SynthOptions};
use model::{Arch, ModelConfig};
use std::collections::HashSet;

/// A store for tiny-qwen35moe with `extra` slots per layer above top-k and the even
/// experts of every layer in RAM.
fn store(extra: u64) -> (ExpertStore, usize, usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let g = Geometry::by_name(Some(Arch::Qwen35Moe), "tiny").expect("geometry");
    let path = dir.path().join("m.gguf");
    synthesize(
        &path,
        &g,
        &SynthOptions {
            preset: Preset::Q4KM,
            seed: 5,
            sync: false,
        },
        &|_, _| {},
    )
    .expect("synthesize");
    let file = GgufFile::open(&path).expect("open");
    let cfg = ModelConfig::from_gguf(&file).expect("config");
    let index = ExpertIndex::build(&file, &cfg).expect("index");
    let k = cfg.n_expert_used;
    let bytes = index.trunk_expert_bytes();
    let vram: u64 = bytes.iter().map(|b| b * (k as u64 + extra)).sum();
    let req = PlanRequest {
        expert_bytes: bytes.clone(),
        n_expert: cfg.n_expert,
        top_k: k,
        vram_budget: vram,
        ram_budget: bytes.iter().sum::<u64>() * cfg.n_expert as u64 / 2,
        mem_available: None,
    };
    let mut p = plan(&req, None).expect("plan");
    // RAM: the even experts of every layer, whatever the planner's order.
    for l in &mut p.layers {
        for (e, r) in l.resident.iter_mut().enumerate() {
            *r = e % 2 == 0;
        }
    }
    (ExpertStore::new(index, p), k, cfg.n_expert)
}

/// Every expert of the batch is where the batch says, and the store agrees.
fn check_batch(s: &ExpertStore, layer: usize, b: &Batch) {
    let slots: HashSet<u32> = b.slot_of.iter().map(|&(_, s)| s).collect();
    assert_eq!(slots.len(), b.slot_of.len(), "two experts share a slot");
    for &(e, slot) in &b.slot_of {
        assert_eq!(s.home(layer, e), Home::Slot(slot));
        assert_eq!(s.slot_expert(layer, slot), Some(e));
    }
    for f in &b.fetch {
        assert_eq!(b.slot(f.expert), Some(f.slot));
        let want = if f.expert % 2 == 0 {
            matches!(f.from, Home::Ram(_))
        } else {
            f.from == Home::File
        };
        assert!(want, "expert {} fetched from {:?}", f.expert, f.from);
    }
}

#[test]
fn a_step_hits_what_is_cached_and_evicts_only_outside_its_batch() {
    let (mut s, k, n) = store(2);
    assert_eq!(s.n_slots(0), k + 2);
    let first: Vec<u32> = (0..k as u32).collect();
    let b = s.step(0, &first, &|_| 0).expect("step");
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].fetch.len(), k, "a cold step fetches every expert");
    check_batch(&s, 0, &b[0]);
    assert_eq!(s.stats().hits, 0);
    let again = s.step(0, &first, &|_| 0).expect("step");
    assert!(again[0].fetch.is_empty(), "the same routing hits");
    assert_eq!(s.stats().hits, k as u64);
    // Half new experts: the kept half hits, the new half misses and may not evict it.
    let mixed: Vec<u32> = (k as u32 / 2..k as u32 / 2 + k as u32)
        .map(|e| e % n as u32)
        .collect();
    let b = s.step(0, &mixed, &|_| 0).expect("step");
    check_batch(&s, 0, &b[0]);
    let fetched: HashSet<u32> = b[0].fetch.iter().map(|f| f.expert).collect();
    for e in &mixed {
        assert_eq!(fetched.contains(e), !first.contains(e), "expert {e}");
    }
    // Other layers are untouched.
    assert_eq!(s.home(1, 0), Home::Ram(0));
    assert_eq!(s.home(1, 1), Home::File);
}

#[test]
fn the_least_recently_used_expert_is_evicted_first() {
    let (mut s, k, _) = store(1);
    // k + 1 slots: fill them with experts 0..=k (the step of 0..k, then k).
    s.step(0, &(0..k as u32).collect::<Vec<_>>(), &|_| 0)
        .expect("step");
    s.step(0, &(1..=k as u32).collect::<Vec<_>>(), &|_| 0)
        .expect("step");
    // 0 was used once, long ago; 1..=k just now: a new expert takes 0's slot.
    let slot0 = match s.home(0, 0) {
        Home::Slot(x) => x,
        h => panic!("expert 0 not cached: {h:?}"),
    };
    let b = s.step(0, &[k as u32 + 1], &|_| 0).expect("step");
    assert_eq!(b[0].fetch.len(), 1);
    assert_eq!(b[0].fetch[0].slot, slot0);
    assert!(!matches!(s.home(0, 0), Home::Slot(_)));
}

#[test]
fn a_prompt_needing_more_experts_than_slots_runs_in_batches() {
    let (mut s, k, n) = store(0);
    s.step(0, &[3], &|_| 0).expect("step");
    // Every expert, several times over (a prompt of n tokens with k routes each).
    let routes: Vec<u32> = (0..n * k).map(|i| ((i * 7) % n) as u32).collect();
    let before = s.stats();
    let batches = s.step(0, &routes, &|_| 0).expect("step");
    // Double-buffered: batches of half the k slots, consecutive ones in disjoint
    // slots (a batch's copies run while the previous batch computes).
    assert!(k >= 2);
    assert_eq!(batches.len(), n.div_ceil(k / 2));
    // The cached expert comes first, so it is used before anything evicts it.
    assert!(batches[0].slot(3).is_some() && batches[0].fetch.iter().all(|f| f.expert != 3));
    let mut seen = HashSet::new();
    for (i, b) in batches.iter().enumerate() {
        assert!(b.slot_of.len() <= k / 2);
        for &(e, slot) in &b.slot_of {
            assert!(seen.insert(e), "expert {e} in two batches");
            if i > 0 {
                assert!(
                    batches[i - 1].slot_of.iter().all(|&(_, s)| s != slot),
                    "batch {i} reuses slot {slot} of the batch before it"
                );
            }
        }
    }
    assert_eq!(seen.len(), n);
    let d = s.stats().minus(&before);
    assert_eq!(d.uses(), routes.len() as u64, "every route is counted once");
    assert_eq!(d.ram_misses + d.disk_misses, n as u64 - 1);
    // Expert 3 (odd: a file expert) hit; the n/2 even ones came from RAM.
    assert_eq!(d.ram_misses, n as u64 / 2);
    assert_eq!(d.disk_misses, n as u64 / 2 - 1);
    let eb = s.plan().layers[0].expert_bytes;
    assert_eq!(d.ram_bytes, d.ram_misses * eb);
    assert_eq!(d.disk_bytes, d.disk_misses * eb);
}

#[test]
fn a_routed_expert_out_of_range_is_an_error() {
    let (mut s, _, n) = store(0);
    let e = s.step(2, &[0, n as u32], &|_| 0).unwrap_err();
    assert!(
        e.contains(&format!("expert {n}")) && e.contains("layer 2"),
        "{e}"
    );
}

#[test]
fn warming_fills_free_slots_only() {
    let (mut s, k, n) = store(1);
    let order: Vec<(u32, u32)> = (0..n as u32).map(|e| (0, e)).collect();
    let f = s.warm(&order);
    assert_eq!(f.len(), k + 1, "layer 0 has k + 1 slots");
    assert!(f.iter().all(|(l, _)| *l == 0));
    for (e, (_, fe)) in f.iter().enumerate() {
        assert_eq!(fe.expert, e as u32);
        assert_eq!(s.home(0, e as u32), Home::Slot(fe.slot));
    }
    assert_eq!(s.stats().uses(), 0, "warming is neither a hit nor a miss");
    let b = s.step(0, &[0], &|_| 0).expect("step");
    assert!(b[0].fetch.is_empty());
}

#[test]
fn the_cpu_takes_ram_misses_seen_least_recently_and_no_slot() {
    let (mut s, k, _) = store(0);
    // Expert 2 was routed to before (and evicted since); 4 and 6 never were.
    s.step(0, &[2], &|_| 0).expect("step");
    let others: Vec<u32> = (10..10 + k as u32).collect();
    s.step(0, &others, &|_| 0).expect("step");
    assert!(!matches!(s.home(0, 2), Home::Slot(_)));
    let before = s.stats();
    // 2, 4, 6 are in RAM (even), 7 only in the file; the CPU may take two.
    let b = s.step(0, &[2, 4, 6, 7], &|m| {
        assert_eq!(m, 3, "three misses are in RAM");
        2
    });
    let b = b.expect("step");
    assert_eq!(b.len(), 1);
    let cpu: Vec<u32> = b[0].cpu.iter().map(|&(e, _)| e).collect();
    assert_eq!(cpu, vec![4, 6], "the never-seen experts go to the CPU");
    for &(e, off) in &b[0].cpu {
        assert_eq!(s.home(0, e), Home::Ram(off), "a CPU expert takes no slot");
    }
    let fetched: Vec<u32> = b[0].fetch.iter().map(|f| f.expert).collect();
    assert_eq!(fetched, vec![2, 7]);
    check_batch(&s, 0, &b[0]);
    let d = s.stats().minus(&before);
    assert_eq!((d.cpu_misses, d.ram_misses, d.disk_misses), (2, 1, 1));
    assert_eq!(d.cpu_bytes, 2 * s.plan().layers[0].expert_bytes);
    // Seen now: on its next miss 4 goes to a slot before a never-seen expert.
    s.step(0, &others, &|_| 0).expect("step");
    let b = s.step(0, &[4, 8], &|_| 1).expect("step");
    assert_eq!(
        b[0].cpu.iter().map(|&(e, _)| e).collect::<Vec<_>>(),
        vec![8]
    );
}

#[test]
fn a_failed_fetch_leaves_no_slot_behind() {
    let (mut s, k, _) = store(0);
    let b = s
        .step(0, &(0..k as u32).collect::<Vec<_>>(), &|_| 0)
        .expect("step");
    // The copies of the first two failed: those experts must miss again.
    s.forget(0, &b[0].fetch[..2]);
    for f in &b[0].fetch[..2] {
        assert!(!matches!(s.home(0, f.expert), Home::Slot(_)));
        assert_eq!(s.slot_expert(0, f.slot), None);
    }
    let again = s
        .step(0, &(0..k as u32).collect::<Vec<_>>(), &|_| 0)
        .expect("step");
    let refetched: Vec<u32> = again[0].fetch.iter().map(|f| f.expert).collect();
    assert_eq!(refetched, vec![b[0].fetch[0].expert, b[0].fetch[1].expert]);
}

/// Every batch's copies wait for the last earlier batch that computes with a slot
/// they overwrite (`Batch::after`), and pool batches name no slot.
fn check_after(batches: &[Batch]) {
    for (j, b) in batches.iter().enumerate() {
        let users: Vec<usize> = (0..j)
            .filter(|&i| {
                !batches[i].pool
                    && b.fetch
                        .iter()
                        .any(|f| batches[i].slot_of.iter().any(|&(_, s)| s == f.slot))
            })
            .collect();
        if b.pool {
            assert!(b.fetch.is_empty() && b.after.is_none(), "batch {j}");
        } else {
            assert_eq!(b.after, users.last().copied(), "batch {j}");
        }
    }
}

/// A store with a prompt pool of `entries` experts of the largest layer.
fn pooled(extra: u64, entries: u64) -> (ExpertStore, usize, usize) {
    let (s, k, n) = store(extra);
    let largest = s.plan().layers.iter().map(|l| l.expert_bytes).max();
    (s.with_pool(entries * largest.unwrap_or(0)), k, n)
}

#[test]
fn a_long_chunk_prefetches_into_the_pool_and_its_step_computes_them_apart() {
    let (mut s, k, n) = pooled(0, 3);
    assert!(s.pool_entries(0) >= 3);
    // Expert 2 (even: in RAM) is in a slot: never prefetched.
    s.step(0, &[2], &|_| 0).expect("step");
    // A chunk too short to use most experts prefetches nothing.
    let short = (engine::experts::PREFETCH_ROUTES_PER_EXPERT * n).div_ceil(k) - 1;
    assert!(s.prefetch(0, short).is_empty());
    let before = s.stats();
    let f = s.prefetch(0, short + 1);
    assert_eq!(f.len(), s.pool_entries(0).min(n / 2 - 1));
    for (i, f) in f.iter().enumerate() {
        assert_eq!(f.slot, i as u32, "pool entries in order");
        assert!(f.expert % 2 == 0 && f.expert != 2, "expert {}", f.expert);
        assert!(matches!(f.from, Home::Ram(_)));
        // The pool is not a slot.
        assert!(!matches!(s.home(0, f.expert), Home::Slot(_)));
    }
    // Every expert but the last prefetched one, several times over.
    let skip = f.last().expect("prefetched").expert;
    let routes: Vec<u32> = (0..n * k)
        .map(|i| ((i * 7) % n) as u32)
        .filter(|&e| e != skip)
        .collect();
    let batches = s.step(0, &routes, &|_| 0).expect("step");
    let pools: Vec<&Batch> = batches.iter().filter(|b| b.pool).collect();
    assert_eq!(pools.len(), 1, "one pool batch");
    let at = batches.iter().position(|b| b.pool).expect("pool batch");
    assert!(at <= 1, "the pool batch computes first or second");
    let want: Vec<(u32, u32)> = f[..f.len() - 1]
        .iter()
        .map(|f| (f.expert, f.slot))
        .collect();
    assert_eq!(pools[0].slot_of, want, "the routed prefetched experts");
    check_after(&batches);
    let mut seen = HashSet::new();
    for b in &batches {
        for &(e, _) in &b.slot_of {
            assert!(seen.insert(e), "expert {e} in two batches");
        }
    }
    assert_eq!(seen.len(), n - 1, "every routed expert once");
    let d = s.stats().minus(&before);
    assert_eq!(d.uses(), routes.len() as u64, "every route is counted once");
    assert_eq!((d.prefetched, d.prefetch_unused), (f.len() as u64, 1));
    let eb = s.plan().layers[0].expert_bytes;
    assert_eq!(d.ram_bytes, (d.ram_misses + d.prefetch_unused) * eb);
    // The pool is used once: the next step of the layer has no pool batch.
    let again = s.step(0, &routes, &|_| 0).expect("step");
    assert!(again.iter().all(|b| !b.pool));
    check_after(&again);
}

#[test]
fn a_pool_filled_for_one_layer_is_not_used_by_another() {
    let (mut s, k, n) = pooled(1, 2);
    assert!(!s.prefetch(0, n * k).is_empty());
    let routes: Vec<u32> = (0..n as u32).collect();
    let b = s.step(1, &routes, &|_| 0).expect("step");
    assert!(b.iter().all(|b| !b.pool), "layer 1 took layer 0's pool");
    let b = s.step(0, &routes, &|_| 0).expect("step");
    assert!(b.iter().all(|b| !b.pool), "the pool outlived another step");
    // A store without a pool never prefetches.
    let (mut s, k, n) = store(1);
    assert!(s.prefetch(0, n * k).is_empty());
}

#[test]
fn batch_copies_wait_for_the_last_batch_using_their_slots() {
    for extra in [0, 1, 3, 6] {
        let (mut s, k, n) = store(extra);
        s.step(0, &[3, 5], &|_| 0).expect("step");
        let routes: Vec<u32> = (0..n * k).map(|i| ((i * 5) % n) as u32).collect();
        let batches = s.step(0, &routes, &|_| 0).expect("step");
        check_after(&batches);
    }
}

#[test]
fn each_route_gets_its_batch_slot_or_none() {
    let b = Batch {
        slot_of: vec![(7, 0), (2, 3), (11, 1)],
        ..Batch::default()
    };
    let routes = [2, 5, 11, 7, 7, 0, 12, 2, 40];
    assert_eq!(b.slots_of(&routes), vec![3, -1, 1, 0, 0, -1, -1, 3, -1]);
    assert!(Batch::default().slots_of(&routes).iter().all(|&s| s == -1));
}

/// Guessed experts held in RAM and in no slot take slots before the step (those in a
/// slot already, or only in the file, are skipped); at the step each one routed to
/// is a RAM miss whose other uses hit, each other one is counted unused, and the
/// guess is used once.
#[test]
fn guessed_experts_take_slots_before_the_step_and_are_counted_once() {
    let (mut s, k, n) = store(2);
    assert!(n >= 8 && k >= 2, "{n} experts, top-{k}");
    // Expert 2 (even: in RAM) is in a slot already.
    s.step(0, &[2], &|_| 0).expect("step");
    let before = s.stats();
    // 1 and 3 are odd (only in the file): never copied ahead.
    let f = s.ahead(0, &[2, 4, 1, 6, 3]);
    let got: Vec<u32> = f.iter().map(|f| f.expert).collect();
    assert_eq!(got, [4, 6], "the guesses in RAM and in no slot, in order");
    for f in &f {
        assert!(matches!(f.from, Home::Ram(_)));
        assert_eq!(s.home(0, f.expert), Home::Slot(f.slot));
    }
    assert_ne!(f[0].slot, f[1].slot);
    let eb = s.plan().layers[0].expert_bytes;
    // A step routed twice to 4, once to 2, not to 6: 4 is a RAM miss and a hit,
    // 2 a hit, 6 unused.
    let batches = s.step(0, &[4, 2, 4], &|_| 0).expect("step");
    assert_eq!(batches.len(), 1);
    assert!(batches[0].fetch.is_empty(), "nothing left to copy");
    check_batch(&s, 0, &batches[0]);
    let d = s.stats().minus(&before);
    assert_eq!(d.uses(), 3, "every route is counted once");
    assert_eq!((d.hits, d.ram_misses), (2, 1));
    assert_eq!((d.prefetched, d.prefetch_unused), (2, 1));
    assert_eq!(d.ram_bytes, 2 * eb, "both copies ahead moved their bytes");
    // The guess is used once: the next step counts 4 and 6 as plain hits.
    let before = s.stats();
    s.step(0, &[4, 6], &|_| 0).expect("step");
    let d = s.stats().minus(&before);
    assert_eq!((d.hits, d.ram_misses, d.prefetch_unused), (2, 0, 0));
    // A guess for another layer is not counted at this one's step.
    let g = s.ahead(1, &[8]);
    assert_eq!(g.len(), 1);
    let before = s.stats();
    s.step(0, &[8], &|_| 0).expect("step");
    let d = s.stats().minus(&before);
    assert_eq!((d.prefetch_unused, d.hits), (0, 0));
}

/// How long the host takes to plan one decode step of a Qwen3-Next-80B-shaped layer
/// (512 experts, top-10, 195 slots: N80 at a 16 GiB budget) under random routing,
/// half of each step's misses left to the CPU. A measurement, not a check: it runs
/// only when asked (`cargo test --release -p scoria-engine --test expert_store --
/// --ignored --nocapture planning_a_decode_step`) and writes a 1.2 GB file.
#[test]
#[ignore]
fn planning_a_decode_step() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut g = Geometry::by_name(Some(Arch::Qwen3Next), "qwen3-next-80b-a3b").expect("geometry");
    g.n_layer = 1;
    let path = dir.path().join("m.gguf");
    let opts = SynthOptions {
        preset: Preset::Q4KM,
        seed: 1,
        sync: false,
    };
    synthesize(&path, &g, &opts, &|_, _| {}).expect("synthesize");
    let file = GgufFile::open(&path).expect("open");
    let cfg = ModelConfig::from_gguf(&file).expect("config");
    let index = ExpertIndex::build(&file, &cfg).expect("index");
    let (k, n) = (cfg.n_expert_used, cfg.n_expert);
    let bytes = index.trunk_expert_bytes();
    let req = PlanRequest {
        expert_bytes: bytes.clone(),
        n_expert: n,
        top_k: k,
        vram_budget: bytes.iter().map(|b| b * 195).sum(),
        ram_budget: bytes.iter().sum::<u64>() * n as u64,
        mem_available: None,
    };
    let mut s = ExpertStore::new(index, plan(&req, None).expect("plan"));
    let mut x = 12345u64;
    let steps: Vec<Vec<u32>> = (0..20_000)
        .map(|_| {
            let mut r = Vec::with_capacity(k);
            while r.len() < k {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let e = (x % n as u64) as u32;
                if !r.contains(&e) {
                    r.push(e);
                }
            }
            r
        })
        .collect();
    let t0 = std::time::Instant::now();
    for r in &steps {
        s.step(0, r, &|m| m / 2).expect("step");
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / steps.len() as f64;
    let st = s.stats();
    eprintln!(
        "planning a decode step: {us:.2} µs ({:.1}% slot hits)",
        100.0 * st.hits as f64 / (steps.len() * k) as f64
    );
}
