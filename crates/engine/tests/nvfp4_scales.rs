//! NVFP4 files converted from NVIDIA's FP4 checkpoints carry each matrix's
//! second-level scale beside it (`<stem>.scale`: one value a matrix, one per expert
//! for a stack), a factor on every product with the matrix. Both executors apply it
//! after the product, one f32 multiplication per value, on every path.
//!
//! The check compares bytes. A file whose scale bytes are multiplied by a power of
//! two 2^k, exactly (every e4m3 scale byte of the synthetic weights has one that is
//! 2^k times it), computes products exactly 2^k times the original's (every float
//! operation of the canonical dot is a product or sum of the block scales' multiples),
//! so it must give the same bits as the original blocks with a scale of 2^k, if the
//! scale is applied to the right product of the right expert and nowhere else. The
//! powers differ between matrices and between the experts of a stack, so a scale
//! taken from the wrong expert, applied twice or left out shows.

mod common;

use common::{bits, decode, rewrite, synth_tiny};
use engine::{Device, Engine, EngineConfig};
use gguf::{GgmlType, GgufFile, InMemoryTensor};
use model::synth::Preset;
use std::collections::HashMap;
use std::path::Path;

/// An NVFP4 block: 4 scale bytes (unsigned e4m3, one a 16-value group), 32 bytes of
/// nibbles.
const BLOCK: usize = 36;

/// What an NVFP4 scale byte multiplies (up to the format's constant halving): 0 for
/// 0x00 and 0x7F, `m · 2^-10` for exponent 0, else `(8 + m) · 2^(e − 11)`.
fn ue4m3(b: u8) -> f64 {
    let (e, m) = ((b >> 3) & 0xF, f64::from(b & 7));
    match b {
        0 | 0x7F => 0.0,
        _ if e == 0 => m * 2f64.powi(-10),
        _ => (8.0 + m) * 2f64.powi(i32::from(e) - 11),
    }
}

/// The scale byte worth 2^k times `b`, when e4m3 has one (zero stays zero).
fn times_pow2(b: u8, k: i32) -> Option<u8> {
    let want = ue4m3(b) * 2f64.powi(k);
    if want == 0.0 {
        return Some(b);
    }
    (1..0x7Fu8).find(|&c| ue4m3(c) == want)
}

/// The power of two each matrix gets: 1 to 3 by tensor and expert, lowered until every
/// scale byte of the matrix has its multiple.
fn power_for(data: &[u8], seed: usize) -> i32 {
    let mut k = 1 + (seed % 3) as i32;
    while k > 0
        && !data
            .chunks_exact(BLOCK)
            .all(|blk| blk[..4].iter().all(|&b| times_pow2(b, k).is_some()))
    {
        k -= 1;
    }
    k
}

/// From an NVFP4 file `src`: `scaled`, its blocks with every matrix's scale 2^k as a
/// `.scale` tensor, and `folded`, the blocks with their scale bytes multiplied by 2^k
/// and no scales. The LM head's scale is stored as `output.weight.scale` (the other
/// naming converters use), the rest as `<stem>.scale`. Returns how many matrices got a
/// factor other than 1.
fn scaled_and_folded(src: &Path, scaled: &Path, folded: &Path) -> usize {
    // Each NVFP4 tensor's power of two per matrix. Embedding rows are looked up, not
    // multiplied by: converters give them no scale (the loader refuses one).
    let f = GgufFile::open(src).expect("open");
    let powers: HashMap<String, Vec<i32>> = f
        .tensors()
        .iter()
        .enumerate()
        .filter(|(_, t)| t.ty == GgmlType::NVFP4 && t.name != "token_embd.weight")
        .map(|(ti, t)| {
            let n_mat = t.dims.get(2).copied().unwrap_or(1) as usize;
            let data = f.tensor_data(t);
            let per = data.len() / n_mat;
            let ks = data
                .chunks(per)
                .enumerate()
                .map(|(m, chunk)| power_for(chunk, 7 * ti + m))
                .collect();
            (t.name.clone(), ks)
        })
        .collect();
    let scales: Vec<(String, Vec<u64>, Vec<u8>)> = powers
        .iter()
        .map(|(name, ks)| {
            let scale = match name.strip_suffix(".weight") {
                Some(stem) if name != "output.weight" => format!("{stem}.scale"),
                _ => format!("{name}.scale"),
            };
            let values = ks
                .iter()
                .flat_map(|&k| 2f32.powi(k).to_le_bytes())
                .collect();
            (scale, vec![ks.len() as u64], values)
        })
        .collect();
    let extra: Vec<InMemoryTensor> = scales
        .iter()
        .map(|(name, dims, data)| InMemoryTensor {
            name,
            dims,
            ty: GgmlType::F32,
            data,
        })
        .collect();
    rewrite(src, scaled, |_, ty, data| Some((ty, data.to_vec())), &extra);
    rewrite(
        src,
        folded,
        |name, ty, data| {
            let mut out = data.to_vec();
            if let Some(ks) = powers.get(name) {
                let per = out.len() / ks.len();
                for (chunk, &k) in out.chunks_mut(per).zip(ks) {
                    for blk in chunk.chunks_exact_mut(BLOCK) {
                        for b in &mut blk[..4] {
                            *b = times_pow2(*b, k).expect("checked by power_for");
                        }
                    }
                }
            }
            Some((ty, out))
        },
        &[],
    );
    powers.values().flatten().filter(|&&k| k != 0).count()
}

/// An engine on `device` with the given budgets and CPU share of a tiered GPU's
/// misses.
fn on(
    device: Device,
    vram_budget: Option<u64>,
    ram_budget: Option<u64>,
    cpu_expert_share: Option<f64>,
) -> EngineConfig {
    EngineConfig {
        device: Some(device),
        vram_budget,
        ram_budget,
        cpu_expert_share,
        max_context: Some(512),
        parallel: Some(1),
        ..EngineConfig::default()
    }
}

/// A prompt's logits at every position (the prompt path, experts grouped by token
/// once there are enough rows) and a greedy continuation's (single-token steps);
/// `check` looks at the engine afterwards.
fn run(
    path: &Path,
    cfg: &EngineConfig,
    check: impl FnOnce(&Engine),
) -> (Vec<u32>, Vec<Vec<u32>>, Vec<u32>) {
    let mut eng = Engine::load(path, cfg).expect("load");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 500).collect();
    let all = eng.logits_all(&prompt).expect("logits_all");
    let (tokens, logits) = decode(&mut eng, &prompt[..9], 12);
    check(&eng);
    (bits(&all), logits.iter().map(|l| bits(l)).collect(), tokens)
}

/// On the test device (the GPU suite runs this with `cuda`): the scaled file gives
/// the folded file's bits, resident and with every routed expert tiered (the CPU's
/// RAM tier reading them from the file; the GPU's slots filled from the file, and
/// from RAM with half the misses computed by the CPU's threads beside the GPU).
#[test]
fn scales_apply_to_every_product() {
    let dev = common::test_device();
    for arch in model::geometry::ARCHS {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = synth_tiny(dir.path(), arch, Preset::Uniform(GgmlType::NVFP4), 5);
        let (scaled, folded) = (
            dir.path().join("scaled.gguf"),
            dir.path().join("folded.gguf"),
        );
        let changed = scaled_and_folded(&src, &scaled, &folded);
        assert!(changed > 10, "{arch:?}: only {changed} matrices scaled");
        let resident = on(dev, None, None, None);
        let want = run(&folded, &resident, |_| ());
        let got = run(&scaled, &resident, |_| ());
        assert!(want.0 == got.0, "{arch:?}: prompt logits differ");
        assert!(want.1 == got.1, "{arch:?}: decode logits differ");
        assert_eq!(want.2, got.2, "{arch:?}: tokens");
        let used = Engine::load(&scaled, &resident)
            .expect("load")
            .device_report()
            .vram_used;
        let (vram, ram) = common::tiering_budgets(&scaled, used);
        let tiered = run(&scaled, &on(dev, vram, ram, None), |e| {
            assert!(e.expert_stats().is_some(), "{arch:?}: not tiered");
        });
        assert!(want == tiered, "{arch:?}: tiered differs from resident");
        if used.is_some() {
            let (experts, _, _) = common::trunk_experts_and_largest(&scaled);
            let beside = run(&scaled, &on(dev, vram, Some(experts), Some(0.5)), |e| {
                let cpu = e.expert_stats().map_or(0, |s| s.cpu_misses);
                assert!(cpu > 0, "{arch:?}: the CPU computed no expert");
            });
            assert!(want == beside, "{arch:?}: the CPU's share differs");
        }
    }
}
