//! Byte-level invariants of the CPU engine on synthetic models of every arch:
//! a prompt evaluated in one pass gives the same logits, bit for bit, as the same
//! tokens fed one at a time (the decode path); the prompt cache changes nothing;
//! greedy decoding is deterministic.

mod common;

use common::{bits, decode, synth, synth_geometry, test_device};
use engine::{Engine, EngineConfig, Flow, GenerateRequest};
use model::geometry::{Arch, Geometry, LinearAttention};
use model::synth::Preset;

fn load(path: &std::path::Path) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            threads: None,
            max_context: Some(256),
            precision: Default::default(),
            device: Some(test_device()),
            ..Default::default()
        },
    )
    .expect("load")
}

fn check_arch(geometry: &str, preset: Preset) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = synth(dir.path(), geometry, preset, 7);
    check_model(&path, geometry, preset);
}

fn check_model(path: &std::path::Path, geometry: &str, preset: Preset) {
    let path = path.to_path_buf();
    let mut eng = load(&path);
    let n_vocab = eng.info().n_vocab;
    // 20 tokens: enough for the prompt paths that run tokens in parallel.
    let prompt: Vec<u32> = (0..20).map(|i| (i * 7919 + 13) % 5000).collect();
    let (tokens, step_logits) = decode(&mut eng, &prompt, 6);
    assert_eq!(tokens.len(), 6);
    for l in &step_logits {
        assert!(
            l.iter().all(|x| x.is_finite()),
            "{geometry}: non-finite logits"
        );
    }
    // One pass over prompt + generated tokens (all but the last generated one,
    // whose logits were never computed).
    let mut seq = prompt.clone();
    seq.extend_from_slice(&tokens[..tokens.len() - 1]);
    let all = eng.logits_all(&seq).expect("logits_all");
    assert_eq!(all.len(), seq.len() * n_vocab);
    // step_logits[0] is the prompt's last position; step_logits[i] follows generated token i-1.
    for (i, l) in step_logits.iter().enumerate() {
        let row = prompt.len() - 1 + i;
        let batch = &all[row * n_vocab..(row + 1) * n_vocab];
        assert_eq!(
            bits(batch),
            bits(l),
            "{geometry} {preset}: position {row} differs between prefill and decode"
        );
    }
    // Spread: random weights must still give non-degenerate logits.
    let last = step_logits.last().expect("logits");
    let mean = last.iter().sum::<f32>() / n_vocab as f32;
    let var = last.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n_vocab as f32;
    assert!(
        var.sqrt() > 1e-3,
        "{geometry}: degenerate logits (std {})",
        var.sqrt()
    );

    // Greedy decoding is deterministic, and the prompt cache (a request that
    // extends the previous one) gives the same tokens as a cold start.
    let (again, _) = decode(&mut eng, &prompt, 6);
    assert_eq!(again, tokens);
    let mut ext = prompt.clone();
    ext.extend_from_slice(&tokens[..3]);
    let (warm, _) = decode(&mut eng, &prompt, 3);
    assert_eq!(warm, tokens[..3]);
    let (cont_warm, _) = decode(&mut eng, &ext, 3);
    let mut cold = load(&path);
    let (cont_cold, _) = decode(&mut cold, &ext, 3);
    assert_eq!(cont_warm, cont_cold);
    assert_eq!(cont_warm, tokens[3..6]);

    // A prompt equal to the evaluated history starts from the cached logits: no
    // prompt token is evaluated again, and the tokens are the cold-start ones.
    eng.logits_all(&prompt).expect("logits_all");
    let req = GenerateRequest::greedy(prompt.clone(), 6);
    let c = eng
        .generate(&req, &mut |_| Flow::Continue)
        .expect("generate");
    assert_eq!(c.tokens, tokens);
    assert_eq!((c.timings.cache_n, c.timings.prompt_n), (prompt.len(), 0));
}

#[test]
fn qwen35moe_prefill_equals_decode() {
    check_arch("tiny-qwen35moe", Preset::Q4KM);
}

#[test]
fn qwen3next_prefill_equals_decode() {
    check_arch("tiny-qwen3next", Preset::Q4KM);
}

#[test]
fn qwen3moe_prefill_equals_decode() {
    check_arch("tiny-qwen3moe", Preset::Q8_0);
}

#[test]
fn qwen35moe_f32_prefill_equals_decode() {
    check_arch("tiny-qwen35moe", Preset::F32);
}

/// On the CPU, prefill == decode; the GPU's kernels are built for some head widths
/// (`cuda::shapes`) and read rows in 32-value groups, so there the load is refused,
/// naming the GGUF keys (`refused`) and the remedy.
fn check_odd_widths(path: &std::path::Path, name: &str, preset: Preset, refused: &[&str]) {
    if test_device() == engine::Device::Cpu {
        return check_model(path, name, preset);
    }
    let e = Engine::load(
        path,
        &EngineConfig {
            max_context: Some(256),
            device: Some(test_device()),
            ..Default::default()
        },
    )
    .err()
    .expect("the GPU refuses shapes it cannot run")
    .to_string();
    assert!(
        refused.iter().all(|r| e.contains(r)) && e.contains("--device cpu"),
        "{e}"
    );
}

/// Float checkpoints whose rows are not multiples of 32 or 64 (a qwen3moe with 6 heads
/// of 40: attention-output rows of 240 values; hidden 200; experts 72 wide) run, and
/// prefill still equals decode bit for bit. They panicked in the first forward pass.
#[test]
fn qwen3moe_odd_widths_f16_prefill_equals_decode() {
    let g = Geometry {
        name: "odd-qwen3moe",
        n_embd: 200,
        n_head: 6,
        n_head_kv: 2,
        head_dim: 40,
        n_rot: 40,
        expert_ff: 72,
        dense_ff: Some(216),
        ..Geometry::by_name(Some(Arch::Qwen3Moe), "tiny").expect("tiny qwen3moe")
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = synth_geometry(dir.path(), &g, Preset::F16, 7);
    check_odd_widths(
        &path,
        g.name,
        Preset::F16,
        &["qwen3moe.attention.key_length is 40"],
    );
    // Heads the GPU takes, rows it does not (hidden 200): refused by tensor name.
    let g = Geometry {
        name: "odd-rows-qwen3moe",
        head_dim: 64,
        n_rot: 64,
        ..g
    };
    let path = synth_geometry(dir.path(), &g, Preset::F16, 7);
    check_odd_widths(&path, g.name, Preset::F16, &["not a multiple of 32"]);
}

/// The same for the hybrid layers: attention heads of 72, DeltaNet heads of 20
/// (conv rows of 160, value rows of 80), hidden 200, BF16 weights.
#[test]
fn qwen35moe_odd_widths_bf16_prefill_equals_decode() {
    let tiny = Geometry::by_name(Some(Arch::Qwen35Moe), "tiny").expect("tiny qwen35moe");
    let g = Geometry {
        name: "odd-qwen35moe",
        n_embd: 200,
        n_head: 3,
        n_head_kv: 1,
        head_dim: 72,
        expert_ff: 72,
        shared_ff: 88,
        linear: tiny.linear.map(|l| LinearAttention { head_dim: 20, ..l }),
        ..tiny
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = synth_geometry(dir.path(), &g, Preset::Bf16, 7);
    check_odd_widths(
        &path,
        g.name,
        Preset::Bf16,
        &[
            "qwen35moe.attention.key_length is 72",
            "qwen35moe.ssm.state_size is 20",
        ],
    );
}

/// A long prompt (two prompt chunks, many attention tiles per head) gives every
/// position the decode path's logits bit for bit.
#[test]
fn long_prompt_prefill_equals_decode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = synth(dir.path(), "tiny-qwen35moe", Preset::Q8_0, 7);
    let mut eng = Engine::load(
        &path,
        &EngineConfig {
            max_context: Some(1024),
            device: Some(test_device()),
            ..Default::default()
        },
    )
    .expect("load");
    let n_vocab = eng.info().n_vocab;
    let prompt: Vec<u32> = (0..5).map(|i| (i * 7919 + 13) % 5000).collect();
    let (tokens, step_logits) = decode(&mut eng, &prompt, 600);
    let mut seq = prompt.clone();
    seq.extend_from_slice(&tokens[..tokens.len() - 1]);
    let all = eng.logits_all(&seq).expect("logits_all");
    for (i, l) in step_logits.iter().enumerate() {
        let row = prompt.len() - 1 + i;
        assert_eq!(
            bits(&all[row * n_vocab..(row + 1) * n_vocab]),
            bits(l),
            "position {row} differs between prefill and decode"
        );
    }
}

#[test]
fn forced_tokens_and_stop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = synth(dir.path(), "tiny-qwen3moe", Preset::Q8_0, 7);
    let mut eng = load(&path);
    let req = GenerateRequest::greedy(vec![1, 2, 3], 10);
    let mut seen = Vec::new();
    let c = eng
        .generate(&req, &mut |ev| {
            seen.push((ev.token, ev.forced));
            match ev.index {
                0 => Flow::Force(vec![42, 43]),
                2 => Flow::Stop,
                _ => Flow::Continue,
            }
        })
        .expect("generate");
    assert_eq!(c.finish, engine::FinishReason::Stopped);
    assert_eq!(c.tokens.len(), 3);
    assert_eq!(&seen[1..], &[(42, true), (43, true)]);
    // Out-of-vocabulary ids are refused, not indexed.
    let bad = GenerateRequest {
        prompt: vec![u32::MAX],
        ..req
    };
    assert!(eng.generate(&bad, &mut |_| Flow::Continue).is_err());
}

#[test]
fn prompt_progress_is_reported_per_piece_and_a_stop_keeps_the_pieces_read() {
    // 1300 tokens: pieces of 512, 512 and 276.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = synth(dir.path(), "tiny-qwen3moe", Preset::Q8_0, 7);
    let open = || {
        Engine::load(
            &path,
            &EngineConfig {
                max_context: Some(1400),
                device: Some(test_device()),
                ..Default::default()
            },
        )
        .expect("load")
    };
    let prompt: Vec<u32> = (0..1300u32).map(|i| (i * 7919 + 13) % 5000).collect();
    let req = GenerateRequest::greedy(prompt.clone(), 4);
    let mut cold = open();
    let want = cold
        .generate(&req, &mut |_| Flow::Continue)
        .expect("generate");

    // Reported after each piece; reading in reported pieces changes no bit.
    let mut eng = open();
    let mut seen = Vec::new();
    let c = eng
        .generate_with_progress(
            &req,
            &mut |p| {
                seen.push((p.done, p.total, p.cached));
                Flow::Continue
            },
            &mut |_| Flow::Continue,
        )
        .expect("generate");
    // The executor's prompt chunk (512 on the CPU, up to the context on the GPU).
    let chunk = eng.prompt_chunk();
    assert!(chunk < 1300, "the test needs a prompt of several pieces");
    // Where each piece ends, reading from `from`.
    let ends = |from: usize| -> Vec<usize> {
        let (mut v, mut e) = (Vec::new(), from);
        while e < 1300 {
            e = (e + chunk).min(1300);
            v.push(e);
        }
        v
    };
    let want_seen: Vec<_> = ends(0).into_iter().map(|e| (e, 1300, 0)).collect();
    assert_eq!(seen, want_seen);
    assert_eq!(c.tokens, want.tokens);

    // Stopped after the first piece: no token, and the piece stays cached.
    let mut eng = open();
    let c = eng
        .generate_with_progress(&req, &mut |_| Flow::Stop, &mut |_| Flow::Continue)
        .expect("generate");
    assert_eq!(c.finish, engine::FinishReason::Stopped);
    assert!(c.tokens.is_empty());
    assert_eq!(c.timings.prompt_n, chunk);
    let mut pieces = Vec::new();
    let c = eng
        .generate_with_progress(
            &req,
            &mut |p| {
                pieces.push(p.done);
                Flow::Continue
            },
            &mut |_| Flow::Continue,
        )
        .expect("generate");
    assert_eq!(
        (c.timings.cache_n, c.timings.prompt_n),
        (chunk, 1300 - chunk)
    );
    assert_eq!(pieces, ends(chunk));
    assert_eq!(
        c.tokens, want.tokens,
        "a resumed prompt gives the cold tokens"
    );
}

/// One slot over a context of 1024 on the test device.
fn one_slot(path: &std::path::Path) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(1024),
            parallel: Some(1),
            device: Some(test_device()),
            ..Default::default()
        },
    )
    .expect("load")
}

/// A chat turn that continues a slot after a long decode (the slot's K/V and
/// recurrent state written token by token by the decode path, then the new turn's
/// prompt piece on top) gives the bits of a cold prompt over the whole conversation:
/// every decode position equals the cold pass's row, and the new turn's logits and
/// tokens equal a cold start's. Every arch, decode long enough to cross the attention
/// kernels' tiles.
#[test]
fn a_turn_after_a_long_decode_equals_a_cold_prompt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut failures = Vec::new();
    for arch in model::geometry::ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 5);
        let load = || one_slot(&path);
        let mut eng = load();
        let n_vocab = eng.info().n_vocab;
        let prompt: Vec<u32> = (0..84u32).map(|i| (i * 7919 + 13) % 5000 + 100).collect();
        let (tokens, step_logits) = decode(&mut eng, &prompt, 120);
        let mut seq = prompt.clone();
        seq.extend_from_slice(&tokens[..tokens.len() - 1]);
        let all = load().logits_all(&seq).expect("logits_all");
        if let Some(i) = step_logits.iter().enumerate().position(|(i, l)| {
            let row = prompt.len() - 1 + i;
            bits(&all[row * n_vocab..(row + 1) * n_vocab]) != bits(l)
        }) {
            failures.push(format!(
                "{arch}: decode position {} differs from the cold prompt's row",
                prompt.len() - 1 + i
            ));
        }
        for (n, q) in [(120usize, 65usize), (120, 4), (6, 65), (6, 4)] {
            let tokens = &tokens[..n];
            let mut turn = prompt.clone();
            turn.extend_from_slice(tokens);
            turn.extend((0..q as u32).map(|i| (i * 104_729 + 7) % 5000 + 100));
            let (cold_tokens, cold_logits) = decode(&mut load(), &turn, 8);
            // The slot continues: its history is the first turn, fed token by token.
            eng.reset().expect("reset");
            decode(&mut eng, &prompt, n);
            let (warm_tokens, warm_logits) = decode(&mut eng, &turn, 8);
            let first = warm_logits
                .iter()
                .zip(&cold_logits)
                .position(|(a, b)| bits(a) != bits(b));
            if let Some(i) = first {
                failures.push(format!(
                    "{arch}: a turn of {q} new tokens after {n} decoded: its logits {i} differ \
                     from a cold start's (tokens {warm_tokens:?} against {cold_tokens:?})"
                ));
            }
        }
    }
    for f in &failures {
        eprintln!("{f}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A prompt's last row has the same bits whether the prompt runs as one piece or in
/// the 64-row pieces that every position's logits take (`logits_all`): the kernels a
/// long piece takes (larger tiles, grouped experts, split attention) give each row the
/// bits of a short one. Every arch, pieces around the kernels' tile sizes.
#[test]
fn a_prompt_row_has_the_same_bits_in_a_piece_of_any_length() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut failures = Vec::new();
    for arch in model::geometry::ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 5);
        let mut eng = one_slot(&path);
        let n_vocab = eng.info().n_vocab;
        for len in [16usize, 17, 33, 64, 65, 97, 128, 129, 200, 269] {
            let prompt: Vec<u32> = (0..len as u32)
                .map(|i| (i * 7919 + 13) % 5000 + 100)
                .collect();
            eng.reset().expect("reset");
            let all = eng.logits_all(&prompt).expect("logits_all");
            eng.reset().expect("reset");
            let (_, one_piece) = decode(&mut eng, &prompt, 1);
            let last = &all[(len - 1) * n_vocab..];
            if bits(last) != bits(&one_piece[0]) {
                failures.push(format!(
                    "{arch}: a prompt of {len} tokens in one piece gives its last row other bits \
                     than in 64-row pieces"
                ));
            }
        }
    }
    for f in &failures {
        eprintln!("{f}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
