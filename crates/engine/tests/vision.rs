//! Images through the engine, against transformers: the vision fixture
//! (`tests/fixtures/qwen35moe-vision/`, `tools/reference/make_vision_fixture.py`) is a
//! tiny random Qwen3.5-MoE vision-language model converted by llama.cpp's converter
//! (text model + mmproj). The processor's pixels of `image.png` go in as the prompt's
//! image; the greedy tokens must be the reference's and every decode position's logits
//! within the text tolerance. Then the invariants: an image request beside text
//! requests gets its solo bits, and the prompt cache tells images apart by their bytes.
//! On the device `SCORIA_TEST_DEVICE` names (the GPU suite runs them on the GPU, with
//! the encoder on the GPU too); on the GPU the encoder's embedding is also checked
//! against transformers' and the CPU encoder's directly.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{bits, test_device, together};
use engine::{Engine, EngineConfig, GenerateRequest, Precision, PromptImage};
use model::vision::PreparedImage;

fn fixtures() -> PathBuf {
    common::fixtures("qwen35moe-vision")
}

struct Reference {
    prompt: Vec<u32>,
    generated: Vec<u32>,
    image_at: usize,
    grid: [usize; 3],
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).expect("reference.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("reference.json parses");
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap_or_else(|| panic!("no `{k}`"))
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let g = ids("image_grid_thw");
    Reference {
        prompt: ids("prompt"),
        generated: ids("generated"),
        image_at: v["image_at"].as_u64().unwrap() as usize,
        grid: [g[0] as usize, g[1] as usize, g[2] as usize],
    }
}

/// The processor's output for `image.png` (its preprocessing is tested in the model
/// crate), named by the file's bytes.
fn image(salt: u8) -> Arc<PreparedImage> {
    let (_, pixels) = engine::npy::read_f32(&fixtures().join("pixel_values_image.npy")).unwrap();
    let r = reference();
    let mut sha256 = [0u8; 32];
    sha256[0] = salt;
    let pixels = if salt == 0 {
        pixels
    } else {
        // Another image of the same size: the same pixels mirrored.
        pixels.iter().rev().copied().collect()
    };
    Arc::new(PreparedImage {
        pixels,
        grid: r.grid,
        resized: (r.grid[2] * 16, r.grid[1] * 16),
        sha256,
    })
}

/// Float-reference activations on the CPU; the GPU's F32 matrices take f32
/// activations anyway.
fn precision() -> Precision {
    if test_device() == engine::Device::Cpu {
        Precision::ReferenceF32
    } else {
        Precision::Canonical
    }
}

fn load(mmproj: &str, prompt_cache: Option<u64>) -> Engine {
    Engine::load(
        &fixtures().join("model-f32.gguf"),
        &EngineConfig {
            max_context: Some(256),
            precision: precision(),
            device: Some(test_device()),
            mmproj: Some(fixtures().join(mmproj)),
            prompt_cache,
            parallel: Some(3),
            ..Default::default()
        },
    )
    .expect("load the vision fixture")
}

fn request(r: &Reference, img: Arc<PreparedImage>, n: usize) -> GenerateRequest {
    let mut req = GenerateRequest::greedy(r.prompt.clone(), n);
    req.images = vec![PromptImage {
        at: r.image_at,
        image: img,
    }];
    req
}

/// Row `i` of an `[n, v]` array.
fn row(a: &[f32], v: usize, i: usize) -> &[f32] {
    &a[i * v..(i + 1) * v]
}

#[test]
fn image_prompt_matches_transformers() {
    let r = reference();
    let (v, full) = engine::npy::read_f32(&fixtures().join("full_logits.npy"))
        .map(|(s, d)| (s[1], d))
        .unwrap();
    for (mmproj, tol) in [("mmproj-f32.gguf", 1e-4f32), ("mmproj-f16.gguf", 2e-2)] {
        let mut eng = load(mmproj, None);
        assert!(eng.vision().is_some());
        let mut logits = Vec::new();
        let c = eng
            .generate_with_logits(
                &request(&r, image(0), r.generated.len()),
                &mut |_| engine::Flow::Continue,
                &mut |l| logits.push(l.to_vec()),
            )
            .expect("generate");
        assert_eq!(c.tokens, r.generated, "{mmproj}: greedy tokens");
        let mut worst = 0f32;
        for (j, got) in logits.iter().enumerate() {
            let want = row(&full, v, r.prompt.len() - 1 + j);
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let diff = got
                .iter()
                .zip(want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= tol * scale,
                "{mmproj}: position {j}: max |diff| {diff} > {tol} × {scale}"
            );
            worst = worst.max(diff / scale);
        }
        eprintln!("{mmproj}: decode logits within {worst:.2e} of the row's largest |logit|");
    }
}

#[test]
fn text_only_prompts_keep_their_bits_with_an_encoder_loaded() {
    let r = reference();
    let text: Vec<u32> = r.prompt.iter().map(|&t| t % 256).collect();
    let mut with = load("mmproj-f32.gguf", None);
    let mut without = Engine::load(
        &fixtures().join("model-f32.gguf"),
        &EngineConfig {
            max_context: Some(256),
            precision: precision(),
            device: Some(test_device()),
            ..Default::default()
        },
    )
    .unwrap();
    let a = common::decode(&mut with, &text, 6);
    let b = common::decode(&mut without, &text, 6);
    assert_eq!(a.0, b.0);
    for (x, y) in a.1.iter().zip(&b.1) {
        assert_eq!(bits(x), bits(y));
    }
}

#[test]
fn an_image_request_beside_text_requests_gets_its_solo_bits() {
    let r = reference();
    let mut eng = load("mmproj-f32.gguf", Some(0));
    let img = request(&r, image(0), 8);
    let solo = together(&mut eng, std::slice::from_ref(&img)).remove(0);
    let text = GenerateRequest::greedy(r.prompt.iter().map(|&t| (t * 7) % 256).collect(), 8);
    let other = request(&r, image(1), 8);
    let mixed = together(&mut eng, &[text, img.clone(), other]);
    assert!(solo.done.as_ref().unwrap().is_ok());
    assert_eq!(mixed[1].tokens, solo.tokens);
    assert_eq!(mixed[1].logits, solo.logits);
    // The mirrored image is another image: other tokens.
    assert_ne!(mixed[2].logits, solo.logits);
}

#[test]
fn tiered_experts_give_an_image_request_the_resident_bits() {
    let r = reference();
    let model = fixtures().join("model-f32.gguf");
    let run = |budgets: (Option<u64>, Option<u64>)| {
        let mut eng = Engine::load(
            &model,
            &EngineConfig {
                max_context: Some(256),
                precision: precision(),
                device: Some(test_device()),
                mmproj: Some(fixtures().join("mmproj-f32.gguf")),
                parallel: Some(1),
                vram_budget: budgets.0,
                ram_budget: budgets.1,
                ..Default::default()
            },
        )
        .unwrap();
        let seen = together(&mut eng, &[request(&r, image(0), 8)]).remove(0);
        let used = eng.device_report().vram_used;
        (seen, eng.expert_stats(), used)
    };
    let (resident, _, used) = run((None, None));
    let (tiered, stats, _) = run(common::tiering_budgets(&model, used));
    let stats = stats.expect("tiered");
    assert!(stats.disk_misses > 0, "{stats:?}");
    assert!(tiered.done.as_ref().unwrap().is_ok(), "{:?}", tiered.done);
    assert_eq!(tiered.tokens, resident.tokens);
    assert_eq!(tiered.logits, resident.logits);
}

#[test]
fn cached_state_is_shared_only_by_the_same_image() {
    let r = reference();
    // One slot, so each request meets the history the one before it left.
    let open = || {
        Engine::load(
            &fixtures().join("model-f32.gguf"),
            &EngineConfig {
                max_context: Some(256),
                precision: precision(),
                device: Some(test_device()),
                mmproj: Some(fixtures().join("mmproj-f32.gguf")),
                parallel: Some(1),
                ..Default::default()
            },
        )
        .unwrap()
    };
    let mut eng = open();
    let first = together(&mut eng, &[request(&r, image(0), 6)]).remove(0);
    // The next turn: the conversation so far and a few more tokens.
    let mut next = r.prompt.clone();
    next.extend(&first.tokens);
    next.extend([5, 6, 7]);
    let turn = |img| {
        let mut q = request(&r, img, 6);
        q.prompt = next.clone();
        q
    };
    // With another image in its place, only the text before the image is kept.
    let other = together(&mut eng, &[turn(image(1))]).remove(0);
    let kept = other.done.unwrap().unwrap().timings.cache_n;
    assert!(
        kept <= r.image_at,
        "kept {kept} positions across a different image"
    );
    // With the same image, the whole first turn is kept, and the bits are a cold run's.
    let _ = together(&mut eng, &[request(&r, image(0), 6)]);
    let warm = together(&mut eng, &[turn(image(0))]).remove(0);
    let kept = warm
        .done
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap()
        .timings
        .cache_n;
    assert!(
        kept >= r.prompt.len(),
        "kept only {kept} positions of the same image"
    );
    let cold = together(&mut open(), &[turn(image(0))]).remove(0);
    assert_eq!(cold.done.unwrap().unwrap().timings.cache_n, 0);
    assert_eq!(warm.tokens, cold.tokens);
    assert_eq!(warm.logits, cold.logits);
}

#[test]
fn misplaced_images_and_engines_without_an_encoder_are_refused() {
    let r = reference();
    let mut eng = load("mmproj-f32.gguf", None);
    let mut past_end = request(&r, image(0), 2);
    past_end.images[0].at = r.prompt.len() - 3;
    let e = eng
        .generate(&past_end, &mut |_| engine::Flow::Continue)
        .unwrap_err();
    assert!(
        e.to_string().contains("image 0 takes prompt positions"),
        "{e}"
    );
    let mut text_only = Engine::load(
        &fixtures().join("model-f32.gguf"),
        &EngineConfig {
            max_context: Some(256),
            device: Some(test_device()),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(text_only.vision().is_none());
    let e = text_only
        .generate(&request(&r, image(0), 2), &mut |_| engine::Flow::Continue)
        .unwrap_err();
    assert!(e.to_string().contains("--mmproj"), "{e}");
}

#[test]
fn an_encoder_for_another_model_is_refused_at_load() {
    // The demo model's encoder projects to 128 values; this model's hidden size is 64.
    let e = Engine::load(
        &fixtures().join("model-f32.gguf"),
        &EngineConfig {
            max_context: Some(64),
            device: Some(test_device()),
            mmproj: Some(fixtures().join("mmproj-demo-f16.gguf")),
            ..Default::default()
        },
    )
    .err()
    .expect("refused");
    let msg = e.to_string();
    assert!(
        msg.contains("128") && msg.contains("64") && msg.contains("another model"),
        "{msg}"
    );
}

/// The GPU encoder's embedding of the fixture image against transformers' (as the CPU
/// encoder's is checked in the model crate) and the CPU encoder's, the same bits on a
/// second run, and an image over its scratch refused by name.
#[cfg(feature = "cuda")]
#[test]
fn gpu_encoder_embeds_as_transformers() {
    if test_device() == engine::Device::Cpu {
        eprintln!("SKIP gpu_encoder_embeds_as_transformers: SCORIA_TEST_DEVICE is the CPU");
        return;
    }
    let (shape, want) = engine::npy::read_f32(&fixtures().join("image_embeds.npy")).unwrap();
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff =
        |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    for (mmproj, tol) in [("mmproj-f32.gguf", 1e-5f32), ("mmproj-f16.gguf", 2e-3)] {
        let m = model::vision::VisionModel::open(&fixtures().join(mmproj)).unwrap();
        let g = engine::cuda::vision::GpuEncoder::open(0, &m, None).expect("open on the GPU");
        let img = image(0);
        let got = g.encode(&m, &img).expect("encode on the GPU");
        assert_eq!([got.rows, got.width], [shape[0], shape[1]], "{mmproj}");
        let d = max_diff(&got.data, &want);
        assert!(
            d <= tol * scale,
            "{mmproj}: max |GPU - transformers| {d} > {tol} × {scale}"
        );
        let cpu = m.encode(&img).unwrap();
        let dc = max_diff(&got.data, &cpu.data);
        assert!(
            dc <= tol * scale,
            "{mmproj}: max |GPU - CPU| {dc} > {tol} × {scale}"
        );
        let again = g.encode(&m, &img).unwrap();
        assert_eq!(bits(&again.data), bits(&got.data), "{mmproj}: a second run");
        eprintln!(
            "{mmproj}: GPU embedding within {:.2e} of transformers', {:.2e} of the CPU's (of the largest value {scale})",
            d / scale,
            dc / scale
        );
    }
    // Chunks of 8 patches (the fixture's image has 48) give the same bits as one
    // chunk: every step computes a row from that row alone.
    use engine::cuda::vision::GpuEncoder;
    let m = model::vision::VisionModel::open(&fixtures().join("mmproj-f16.gguf")).unwrap();
    let img = image(0);
    let n = img.grid.iter().product::<usize>();
    let whole = GpuEncoder::open(0, &m, Some(n)).unwrap();
    let small = GpuEncoder::open_chunked(0, &m, Some(n), 8).unwrap();
    let a = whole.encode(&m, &img).unwrap();
    let b = small.encode(&m, &img).unwrap();
    assert!(n > 8 && n.is_multiple_of(8), "{n} patches");
    assert_eq!(
        bits(&a.data),
        bits(&b.data),
        "chunks of 8 against one chunk"
    );
    assert!(small.scratch_bytes() < whole.scratch_bytes());
    // The size the default is chosen by is the size allocated.
    let size = engine::cuda::vision::ScratchSize::of(&m, engine::cuda::vision::CHUNK_ROWS);
    assert_eq!(size.bytes(n), whole.scratch_bytes());
    let on_24g = engine::cuda::vision::default_max_patches(size, 24 << 30);
    assert!(
        (8192..=65_536).contains(&on_24g) && on_24g.is_multiple_of(1024),
        "{on_24g}"
    );
    // An image over the scratch is refused by name.
    let tight = GpuEncoder::open(0, &m, Some(n - 4)).unwrap();
    let Err(e) = tight.encode(&m, &img) else {
        panic!("an image of {n} patches is over a scratch of {}", n - 4)
    };
    assert!(e.to_string().contains("patches"), "{e}");
}
