//! Speculation is free (invariant 2 of docs/design.md): with prompt-lookup drafts
//! verified in one step and the sequence rolled back to the last accepted token,
//! every request emits the bytes plain decoding emits — greedy and seeded sampling,
//! requests decoded side by side, a chat turn continued from the prompt cache, and a
//! structured-output request whose grammar masks the verify rows — on every arch,
//! and every emitted token is chosen from the logits bits plain decoding gave it.
//! The executor's rollback itself is checked against a sequence that was never fed
//! the rejected drafts. They run on the executor of the test device
//! (`SCORIA_TEST_DEVICE`); one that cannot roll back says so and is skipped.
//! Most tests fix the draft length (`SpecConfig::fixed`: they count drafts, and a
//! length chosen from measured step costs depends on the machine's timing);
//! `drafts_chosen_by_step_cost_keep_the_bytes` runs the default choice.

mod common;

use common::{bits, Collect, Seen};
use engine::cpu::{CpuBackend, CpuExecutor};
use engine::exec::{Executor, SeqStep, StepOut, Want};
use engine::sampler::argmax;
use engine::spec::Drafter;
use engine::{Engine, EngineConfig, Flow, GenerateRequest, SamplingParams, SpecConfig, SpecMode};
use gguf::GgufFile;
use model::geometry::ARCHS;
use model::synth::Preset;
use model::{Logits, ModelConfig, ModelWeights};
use std::path::Path;
use std::sync::{Arc, Mutex};

fn executor(file: &Arc<GgufFile>, cfg: &ModelConfig) -> Box<dyn Executor> {
    let weights = ModelWeights::load(file, cfg).expect("weights");
    match common::test_device() {
        engine::Device::Cpu => {
            let backend = CpuBackend {
                cfg: cfg.clone(),
                weights,
                precision: Default::default(),
                routing: None,
                tier: None,
                hidden: Default::default(),
            };
            Box::new(CpuExecutor::new(backend, 128, 1).expect("executor"))
        }
        #[cfg(feature = "cuda")]
        engine::Device::Cuda(n) => Box::new(
            engine::cuda::CudaExecutor::open(
                n,
                cfg,
                &weights,
                128,
                1,
                engine::cuda::Budgets {
                    verify_tokens: 8,
                    ..Default::default()
                },
            )
            .expect("CUDA executor"),
        ),
        #[cfg(not(feature = "cuda"))]
        d => panic!("{d:?}: this build has no CUDA executor"),
    }
}

fn logits(exec: &mut dyn Executor, tokens: &[u32], pos0: usize, want: Want) -> Vec<f32> {
    let out = exec
        .step(&[SeqStep {
            seq: 0,
            tokens,
            pos0,
            want,
            media: Default::default(),
            draws: &[],
        }])
        .expect("step");
    match out.into_iter().next() {
        Some(StepOut::Logits(l)) => l,
        o => panic!("logits expected, got {o:?}"),
    }
}

/// A verify step's rows are the logits of decoding its tokens one by one, and a
/// rollback to any of its positions leaves the state of a sequence that was fed
/// only the tokens up to there (checked through the logits of the tokens after).
#[test]
fn rollback_gives_the_bits_of_never_feeding_the_rejected_drafts() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q4KM, 11);
        let file = Arc::new(GgufFile::open(&path).expect("open"));
        let cfg = ModelConfig::from_gguf(&file).expect("config");
        let nv = cfg.n_vocab;
        let prompt: Vec<u32> = (0..12).map(|i| (i * 7919 + 13) % 4000 + 50).collect();
        let fed: Vec<u32> = vec![901, 77, 3050, 12, 640];
        let after: Vec<u32> = vec![33, 2048, 5];
        let p = prompt.len();

        // The plain sequence: the prompt, then every token alone.
        let mut plain = executor(&file, &cfg);
        if !plain.rollbacks() {
            eprintln!("{arch}: this executor cannot roll back; skipped");
            return;
        }
        logits(plain.as_mut(), &prompt, 0, Want::Logits(Logits::Last));
        let mut one_by_one = Vec::new();
        for (i, &t) in fed.iter().enumerate() {
            one_by_one.push(logits(
                plain.as_mut(),
                &[t],
                p + i,
                Want::Logits(Logits::Last),
            ));
        }

        for keep in 1..=fed.len() {
            let mut spec = executor(&file, &cfg);
            logits(spec.as_mut(), &prompt, 0, Want::Logits(Logits::Last));
            spec.keep_trail(0).expect("keep_trail");
            if keep % 2 == 0 {
                // A plain greedy request's verify step: each row's argmax.
                let step = SeqStep {
                    seq: 0,
                    tokens: &fed,
                    pos0: p,
                    want: Want::GreedyRows,
                    media: Default::default(),
                    draws: &[],
                };
                let out = spec.step(&[step]).expect("step").remove(0);
                let want: Vec<u32> = one_by_one.iter().map(|l| argmax(l)).collect();
                assert_eq!(
                    out,
                    StepOut::Tokens(want),
                    "{arch}: a verify step's greedy rows differ from decoding alone"
                );
            } else {
                let rows = logits(spec.as_mut(), &fed, p, Want::Logits(Logits::All));
                for (i, l) in one_by_one.iter().enumerate() {
                    assert_eq!(
                        bits(&rows[i * nv..(i + 1) * nv]),
                        bits(l),
                        "{arch}: verify row {i} differs from decoding its token alone"
                    );
                }
            }
            spec.rollback(0, p + keep).expect("rollback");
            // The reference: only `keep` tokens were ever fed.
            let mut refx = executor(&file, &cfg);
            logits(refx.as_mut(), &prompt, 0, Want::Logits(Logits::Last));
            for (i, &t) in fed[..keep].iter().enumerate() {
                logits(refx.as_mut(), &[t], p + i, Want::Logits(Logits::Last));
            }
            for (i, &t) in after.iter().enumerate() {
                let pos = p + keep + i;
                let a = logits(spec.as_mut(), &[t], pos, Want::Logits(Logits::Last));
                let b = logits(refx.as_mut(), &[t], pos, Want::Logits(Logits::Last));
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "{arch}: after a rollback to {keep} of {} tokens, token {i} differs",
                    fed.len()
                );
            }
            // The trail is used up: a second rollback is refused.
            assert!(spec.rollback(0, p + keep).is_err());
        }
        // Without a kept trail there is nothing to roll back to.
        let mut spec = executor(&file, &cfg);
        logits(spec.as_mut(), &fed, 0, Want::Logits(Logits::All));
        let err = spec.rollback(0, 2).expect_err("no trail");
        assert!(err.to_string().contains("keep_trail"), "{err}");
    }
}

fn engine(path: &Path, parallel: usize, spec: SpecMode, draft_max: usize) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(2048),
            parallel: Some(parallel),
            device: Some(common::test_device()),
            spec: SpecConfig {
                mode: spec,
                draft_max,
                draft_min: 0,
                fixed: true,
            },
            ..Default::default()
        },
    )
    .expect("load")
}

/// A prompt that repeats itself the way an agent's conversation does: `n` tokens,
/// what the model answers to them (greedy, on `eng`), and the `n` tokens again —
/// so prompt lookup drafts the earlier answer, which the model may or may not give
/// again.
fn echoing(eng: &mut Engine, n: usize, salt: u32) -> Vec<u32> {
    let p: Vec<u32> = (0..n as u32)
        .map(|i| (i * 7919 + salt * 104_729 + 13) % 5000 + 100)
        .collect();
    let c = eng
        .generate(&GenerateRequest::greedy(p.clone(), 24), &mut |_| {
            Flow::Continue
        })
        .expect("generate");
    let mut out = p.clone();
    out.extend_from_slice(&c.tokens);
    out.extend_from_slice(&p);
    out
}

fn request(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        max_tokens,
        sampling,
        ..GenerateRequest::greedy(prompt, max_tokens)
    }
}

/// `r` with a strong bias towards four tokens: random weights rarely repeat themselves
/// (and whether they do within a test's length depends on the device's rounding), but
/// a model choosing among four tokens falls into loops that prompt lookup drafts from,
/// some drafts kept and some not, on every device. The choice among the four is still
/// the model's (and the sampler's).
fn looping(mut r: GenerateRequest) -> GenerateRequest {
    r.sampling.logit_bias = [101, 202, 303, 404].map(|t| (t, 20.0)).to_vec();
    r
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// Each of `reqs` alone, one after the other on `eng`.
fn run_alone(eng: &mut Engine, reqs: &[GenerateRequest]) -> Vec<Seen> {
    reqs.iter()
        .flat_map(|r| common::together(eng, std::slice::from_ref(r)))
        .collect()
}

fn same(label: &str, plain: &[Seen], spec: &[Seen]) {
    for (i, (a, b)) in plain.iter().zip(spec).enumerate() {
        let (ca, cb) = (
            a.done.as_ref().expect("done").as_ref().expect("ok"),
            b.done.as_ref().expect("done").as_ref().expect("ok"),
        );
        assert_eq!(a.tokens, b.tokens, "{label}: request {i}'s tokens differ");
        assert_eq!(
            ca.tokens, cb.tokens,
            "{label}: request {i}'s completion differs"
        );
        assert_eq!(
            ca.finish, cb.finish,
            "{label}: request {i}'s finish differs"
        );
        assert!(
            a.logits == b.logits,
            "{label}: request {i}: a token was chosen from other logits bits"
        );
        assert_eq!(ca.timings.draft_n, 0);
    }
}

/// Drafted and accepted over `seen`.
fn drafts(seen: &[Seen]) -> (usize, usize) {
    seen.iter()
        .filter_map(|s| s.done.as_ref()?.as_ref().ok())
        .fold((0, 0), |(d, a), c| {
            (d + c.timings.draft_n, a + c.timings.draft_n_accepted)
        })
}

#[test]
fn prompt_lookup_emits_the_bytes_of_plain_decoding() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Drafted and accepted over every arch: random weights rarely repeat themselves,
    // but the verify steps must have both kept and rejected drafts.
    let mut total = (0, 0);
    let mut sampled_rows = 0;
    for arch in ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 5);
        let mut plain = engine(&path, 3, SpecMode::Off, 8);
        let mut spec = engine(&path, 3, SpecMode::Ngram, 8);
        if spec.drafter().is_none() {
            eprintln!("{arch}: no speculation on this executor; skipped");
            return;
        }
        let reqs = vec![
            looping(request(
                echoing(&mut plain, 30, 1),
                120,
                SamplingParams::default(),
            )),
            looping(request(echoing(&mut plain, 20, 2), 120, seeded(7))),
            request(echoing(&mut plain, 45, 3), 100, SamplingParams::default()),
            request(echoing(&mut plain, 12, 4), 120, seeded(9)),
        ];
        plain.reset().expect("reset");
        let a = run_alone(&mut plain, &reqs);
        plain.reset().expect("reset");
        // Alone, then side by side in three slots (one request waits for a slot).
        let b = run_alone(&mut spec, &reqs);
        same(&format!("{arch} alone"), &a, &b);
        spec.reset().expect("reset");
        let c = common::together(&mut spec, &reqs);
        same(&format!("{arch} side by side"), &a, &c);
        let (drafted, accepted) = drafts(&b);
        assert!(drafted > 0, "{arch}: nothing was drafted");
        eprintln!("{arch}: {accepted} of {drafted} drafts accepted");
        total = (total.0 + drafted, total.1 + accepted);
        // Nobody asking for logits: decode steps take the executor's token (greedy:
        // `Want::Greedy`; seeded: `Want::Sample`, drawn where the logits are) and
        // verify steps each row's (`GreedyRows`, `SampleRows` with the draw of each
        // row's position); the tokens are those chosen from the logits on the host.
        for (i, r) in reqs.iter().enumerate() {
            spec.reset().expect("reset");
            let c = spec.generate(r, &mut |_| Flow::Continue).expect("spec");
            assert_eq!(c.tokens, a[i].tokens, "{arch}: request {i} without logits");
            sampled_rows += usize::from(r.sampling.temperature > 0.0) * c.timings.draft_n_accepted;
        }

        // A chat turn continuing the first request's conversation: its slot's state
        // (after verify steps and rollbacks) serves the new prompt's start.
        let mut turn = reqs[0].prompt.clone();
        turn.extend_from_slice(&a[0].tokens);
        turn.extend_from_slice(&reqs[1].prompt);
        let next = [request(turn, 30, seeded(4))];
        let fresh = engine(&path, 1, SpecMode::Off, 8);
        let mut fresh = fresh;
        let want = run_alone(&mut fresh, &next);
        // The same turn without speculation: a cached turn has the bits of a cold one.
        plain.reset().expect("reset");
        run_alone(&mut plain, &reqs[..1]);
        let cached = run_alone(&mut plain, &next);
        same(
            &format!("{arch} cached turn, no speculation"),
            &want,
            &cached,
        );
        spec.reset().expect("reset");
        let first = run_alone(&mut spec, &reqs[..1]);
        same(&format!("{arch} first turn"), &a[..1], &first);
        let got = run_alone(&mut spec, &next);
        same(&format!("{arch} cached turn"), &want, &got);
        let c = got[0].done.as_ref().unwrap().as_ref().unwrap();
        assert!(
            c.timings.cache_n > reqs[0].prompt.len(),
            "{arch}: the second turn reused {} tokens",
            c.timings.cache_n
        );
    }
    assert!(
        total.1 > 0 && total.1 < total.0,
        "{} of {} drafts accepted: the test must see drafts kept and rejected",
        total.1,
        total.0
    );
    assert!(
        sampled_rows > 0,
        "no sampled request kept a draft: SampleRows went untested"
    );
}

/// The default draft length, chosen from what this machine's steps cost and the
/// drafts kept (so how much is drafted depends on the timing): the bytes are plain
/// decoding's, alone and side by side.
#[test]
fn drafts_chosen_by_step_cost_keep_the_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), model::Arch::Qwen35Moe, Preset::Q8_0, 5);
    let mut plain = engine(&path, 2, SpecMode::Off, 8);
    let mut spec = Engine::load(
        &path,
        &EngineConfig {
            max_context: Some(2048),
            parallel: Some(2),
            device: Some(common::test_device()),
            spec: SpecConfig {
                mode: SpecMode::Ngram,
                draft_max: 8,
                ..SpecConfig::default()
            },
            ..Default::default()
        },
    )
    .expect("load");
    if spec.drafter().is_none() {
        eprintln!("no speculation on this executor; skipped");
        return;
    }
    let reqs = vec![
        looping(request(
            echoing(&mut plain, 30, 1),
            160,
            SamplingParams::default(),
        )),
        looping(request(echoing(&mut plain, 20, 2), 160, seeded(7))),
        request(echoing(&mut plain, 12, 4), 100, seeded(9)),
    ];
    plain.reset().expect("reset");
    let a = run_alone(&mut plain, &reqs);
    let b = run_alone(&mut spec, &reqs);
    same("alone", &a, &b);
    spec.reset().expect("reset");
    let c = common::together(&mut spec, &reqs);
    same("side by side", &a, &c);
    let (drafted, accepted) = drafts(&b);
    eprintln!("by step cost: {accepted} of {drafted} drafts accepted");
}

/// Per-request limits: `n_max` 0 turns a request's speculation off, a smaller one
/// caps its drafts; the tokens stay plain decoding's.
#[test]
fn per_request_draft_limits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), model::Arch::Qwen35Moe, Preset::Q8_0, 5);
    let mut plain = engine(&path, 1, SpecMode::Off, 8);
    let mut spec = engine(&path, 1, SpecMode::Auto, 8);
    if spec.drafter().is_none() {
        eprintln!("no speculation on this executor; skipped");
        return;
    }
    let natural = request(echoing(&mut plain, 30, 1), 40, SamplingParams::default());
    // Nobody asking for logits and no bias: plain greedy decoding takes the executor's
    // argmax (`Want::Greedy`), the verify rows the sampler's; the tokens agree.
    plain.reset().expect("reset");
    let g_plain = plain
        .generate(&natural, &mut |_| Flow::Continue)
        .expect("plain");
    let g_spec = spec
        .generate(&natural, &mut |_| Flow::Continue)
        .expect("spec");
    assert_eq!(g_plain.tokens, g_spec.tokens);
    eprintln!(
        "greedy without logits: {} drafted, {} accepted",
        g_spec.timings.draft_n, g_spec.timings.draft_n_accepted
    );
    let base = looping(natural);
    plain.reset().expect("reset");
    let a = run_alone(&mut plain, std::slice::from_ref(&base));
    spec.reset().expect("reset");
    let g_spec = spec.generate(&base, &mut |_| Flow::Continue).expect("spec");
    assert_eq!(g_spec.tokens, a[0].tokens);
    assert!(g_spec.timings.draft_n > 0);
    spec.reset().expect("reset");
    let mut off = base.clone();
    off.speculative.n_max = Some(0);
    let b = run_alone(&mut spec, std::slice::from_ref(&off));
    same("n_max 0", &a, &b);
    assert_eq!(drafts(&b), (0, 0));
    let mut two = base.clone();
    two.speculative.n_max = Some(2);
    spec.reset().expect("reset");
    let steps = Arc::new(Mutex::new(Seen::default()));
    spec.submit(two, Box::new(Collect(steps.clone())));
    let mut max_step = 0;
    let mut before = 0;
    while spec.step() {
        let n = steps.lock().unwrap().tokens.len();
        max_step = max_step.max(n - before);
        before = n;
    }
    let seen = std::mem::take(&mut *steps.lock().unwrap());
    same("n_max 2", &a, std::slice::from_ref(&seen));
    assert!(
        max_step <= 3,
        "a step emitted {max_step} tokens with n_max 2"
    );
    assert!(drafts(std::slice::from_ref(&seen)).0 > 0);
}

#[test]
fn explicit_modes_the_engine_cannot_serve_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), model::Arch::Qwen3Moe, Preset::Q8_0, 5);
    let load = |mode, max, min| {
        Engine::load(
            &path,
            &EngineConfig {
                max_context: Some(256),
                device: Some(engine::Device::Cpu),
                spec: SpecConfig {
                    mode,
                    draft_max: max,
                    draft_min: min,
                    fixed: true,
                },
                ..Default::default()
            },
        )
    };
    let e = load(SpecMode::Mtp, 8, 0)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("--spec mtp") && e.contains("no MTP"), "{e}");
    let e = load(SpecMode::Ngram, 4, 5)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("--draft-min 5"), "{e}");
    assert!(load(SpecMode::Auto, 8, 0)
        .expect("auto")
        .drafter()
        .is_some());
    assert!(load(SpecMode::Off, 8, 0).expect("off").drafter().is_none());
}

/// On the trained demo model: a structured-output request (a JSON schema, greedy and
/// sampled) and free chat requests emit plain decoding's bytes with prompt lookup;
/// the grammar masks every verify row as it masks a decode step's.
#[test]
fn demo_model_structured_and_free_requests_keep_their_bytes() {
    use engine::constraint::{Constraint, Grammar, GrammarCompiler};
    let path = model::synth::demo_model_path().expect("demo model");
    let mut plain = engine(&path, 2, SpecMode::Off, 8);
    let mut spec = engine(&path, 2, SpecMode::Ngram, 8);
    if spec.drafter().is_none() {
        eprintln!("no speculation on this executor; skipped");
        return;
    }
    let compiler = GrammarCompiler::new(spec.tokenizer()).expect("compiler");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "items": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 6}
        },
        "required": ["name", "items"],
        "additionalProperties": false
    });
    let grammar = compiler
        .compile(&Grammar::JsonSchema(schema))
        .expect("compile");
    let prompt = |text: &str| {
        spec.tokenizer()
            .encode_prompt(&format!(
                "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
            ))
            .expect("encode")
    };
    let code = "fn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n\nfn sub(a: i32, b: i32) -> i32 {\n    a - b\n}\n";
    let p_json = prompt("List three fruits as JSON with a name field.");
    let p_code = prompt(&format!(
        "Repeat this code exactly, then add a mul function:\n{code}"
    ));
    let mut reqs = vec![
        request(p_json.clone(), 120, SamplingParams::default()),
        request(p_json, 120, seeded(21)),
        request(p_code.clone(), 120, SamplingParams::default()),
        request(p_code, 120, seeded(3)),
    ];
    for r in &mut reqs[..2] {
        r.constraint = Some(Constraint::new(grammar.clone()));
        r.stop_at_eog = true;
    }
    let a = run_alone(&mut plain, &reqs);
    let b = common::together(&mut spec, &reqs);
    same("demo", &a, &b);
    let (drafted, accepted) = drafts(&b);
    eprintln!("demo: {accepted} of {drafted} drafts accepted");
    assert!(drafted > 0 && accepted > 0, "{accepted} of {drafted}");
    // Plain greedy with nobody asking for logits: decode steps take the executor's
    // argmax (`Want::Greedy`) and verify steps each row's (`Want::GreedyRows`).
    let free = &reqs[2];
    let g_plain = plain
        .generate(free, &mut |_| Flow::Continue)
        .expect("plain");
    let g_spec = spec.generate(free, &mut |_| Flow::Continue).expect("spec");
    assert_eq!(g_plain.tokens, g_spec.tokens, "demo: greedy rows");
    assert_eq!(
        g_plain.tokens, b[2].tokens,
        "demo: greedy rows against logits"
    );
    assert!(
        g_spec.timings.draft_n_accepted > 0,
        "demo: greedy rows drafted nothing"
    );
}

/// On the test device, resident: `ngram` drafts by prompt lookup, `mtp` with the
/// model's MTP block and `auto` with both (lookup where the text repeats long), on the
/// CPU and on the GPU (which rolls back and runs the block on the device).
#[test]
fn the_test_device_speculates_with_its_mtp_block() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), model::Arch::Qwen35Moe, Preset::Q8_0, 5);
    for (mode, want) in [
        (SpecMode::Ngram, Drafter::Ngram),
        (SpecMode::Auto, Drafter::MtpAndNgram),
        (SpecMode::Mtp, Drafter::Mtp),
    ] {
        assert_eq!(engine(&path, 1, mode, 8).drafter(), Some(want), "{mode:?}");
    }
}

/// MTP drafts (the model's own next-next-token block) emit plain decoding's bytes:
/// alone, side by side, and on a chat turn continued from the slot's state, on every
/// arch whose synthetic file has an MTP block (random weights: drafts are mostly
/// rejected, which exercises the rollbacks of the MTP cache too).
#[test]
fn mtp_drafts_emit_the_bytes_of_plain_decoding() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut tried = 0;
    for arch in ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 5);
        // Three slots, 4 drafts at every step.
        let load = |mode| {
            Engine::load(
                &path,
                &EngineConfig {
                    max_context: Some(2048),
                    parallel: Some(3),
                    device: Some(common::test_device()),
                    spec: SpecConfig {
                        mode,
                        draft_max: 4,
                        draft_min: 0,
                        fixed: true,
                    },
                    ..Default::default()
                },
            )
        };
        let mut spec = match load(SpecMode::Mtp) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("{arch}: {e}");
                continue;
            }
        };
        tried += 1;
        assert_eq!(spec.drafter(), Some(engine::spec::Drafter::Mtp));
        let mut plain = engine(&path, 3, SpecMode::Off, 8);
        let reqs = vec![
            request(echoing(&mut plain, 30, 1), 60, SamplingParams::default()),
            request(echoing(&mut plain, 20, 2), 60, seeded(7)),
            request(echoing(&mut plain, 12, 4), 60, seeded(9)),
        ];
        plain.reset().expect("reset");
        let a = run_alone(&mut plain, &reqs);
        let b = run_alone(&mut spec, &reqs);
        same(&format!("{arch} mtp alone"), &a, &b);
        spec.reset().expect("reset");
        let c = common::together(&mut spec, &reqs);
        same(&format!("{arch} mtp side by side"), &a, &c);
        let (drafted, accepted) = drafts(&b);
        eprintln!("{arch}: MTP {accepted} of {drafted} drafts accepted");
        assert!(drafted > 0, "{arch}: the MTP block drafted nothing");
        let mut turn = reqs[0].prompt.clone();
        turn.extend_from_slice(&a[0].tokens);
        turn.extend_from_slice(&reqs[1].prompt);
        let next = [request(turn, 30, seeded(4))];
        let want = run_alone(&mut engine(&path, 1, SpecMode::Off, 8), &next);
        spec.reset().expect("reset");
        let _ = run_alone(&mut spec, &reqs[..1]);
        let got = run_alone(&mut spec, &next);
        same(&format!("{arch} mtp cached turn"), &want, &got);
        assert!(drafts(&got).0 > 0, "{arch}: a continued turn drafts too");
        // `auto`: the echoed prompts repeat a stretch longer than LOOKUP_OVER_MTP, so
        // lookup drafts there and the MTP block elsewhere, in one request.
        let mut auto = load(SpecMode::Auto).expect("auto");
        assert_eq!(auto.drafter(), Some(engine::spec::Drafter::MtpAndNgram));
        let d = run_alone(&mut auto, &reqs);
        same(&format!("{arch} auto alone"), &a, &d);
        auto.reset().expect("reset");
        let e = common::together(&mut auto, &reqs);
        same(&format!("{arch} auto side by side"), &a, &e);
        let (drafted, accepted) = drafts(&d);
        eprintln!("{arch}: auto {accepted} of {drafted} drafts accepted");
        assert!(drafted > 0, "{arch}: auto drafted nothing");
    }
    assert!(tried > 0, "no arch has an MTP block");
}

/// The demo model's MTP block against transformers (`tests/fixtures/demo`: the
/// argmax of the MTP head at each position of the reference sequence, f32 on the
/// file's dequantized weights): the executor's one-token draft after each prefix.
/// Then chat requests drafting with it keep plain decoding's bytes and accept drafts.
#[test]
fn demo_mtp_block_matches_transformers_and_its_drafts_are_accepted() {
    let path = model::synth::demo_model_path().expect("demo model");
    let root = common::fixtures("demo");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("reference.json")).unwrap())
            .unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let seq = ids(&r["sequence_ids"]);
    let want = ids(&r["mtp"]["argmax"]);
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let weights = ModelWeights::load(&file, &cfg).unwrap();
    // The CPU in f32 as transformers computes; the GPU in the canonical precision
    // (quantized activations; 62 of 64 on an H100, 2026-12-07).
    let mut exec: Box<dyn Executor> = match common::test_device() {
        engine::Device::Cpu => {
            let backend = CpuBackend {
                cfg: cfg.clone(),
                weights,
                precision: engine::Precision::ReferenceF32,
                routing: None,
                tier: None,
                hidden: Default::default(),
            };
            Box::new(CpuExecutor::new(backend, 512, 1).unwrap())
        }
        #[cfg(feature = "cuda")]
        engine::Device::Cuda(n) => {
            let budgets = engine::cuda::Budgets {
                verify_tokens: 4,
                mtp: true,
                ..Default::default()
            };
            let e = engine::cuda::CudaExecutor::open(n, &cfg, &weights, 512, 1, budgets);
            Box::new(e.expect("CUDA executor"))
        }
        #[cfg(not(feature = "cuda"))]
        d => panic!("{d:?}: this build has no CUDA executor"),
    };
    assert!(exec.enable_mtp());
    // Row p of the reference pairs token seq[p+1] with the trunk's state at p: the
    // draft after feeding seq[..=p] and offering seq[p+1].
    let n = want.len().min(seq.len() - 2).min(64);
    let mut agree = 0;
    for p in 0..n {
        let _ = logits(exec.as_mut(), &seq[p..=p], p, Want::Logits(Logits::Last));
        let d = exec.mtp_draft(0, seq[p + 1], 1).expect("draft");
        assert_eq!(d.len(), 1, "position {p}: no draft");
        agree += (d[0] == want[p]) as usize;
    }
    eprintln!("demo MTP argmax: {agree} of {n} positions as transformers");
    assert!(agree * 100 >= n * 95, "{agree} of {n}");

    let mut plain = engine(&path, 2, SpecMode::Off, 8);
    let mut spec = engine(&path, 2, SpecMode::Mtp, 3);
    let prompt = |text: &str| {
        spec.tokenizer()
            .encode_prompt(&format!(
                "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
            ))
            .expect("encode")
    };
    let reqs = vec![
        request(
            prompt("Write a Rust function that adds two numbers."),
            80,
            SamplingParams::default(),
        ),
        request(prompt("What is a mixture of experts?"), 80, seeded(5)),
    ];
    let a = run_alone(&mut plain, &reqs);
    let b = common::together(&mut spec, &reqs);
    same("demo mtp", &a, &b);
    let (drafted, accepted) = drafts(&b);
    eprintln!("demo: MTP {accepted} of {drafted} drafts accepted");
    assert!(accepted > 0, "{accepted} of {drafted}");
    // One slot, requests one after the other: each starts from what the slot or the
    // prompt cache restores, and its MTP cache starts again after it — every request
    // drafts.
    let mut one = engine(&path, 1, SpecMode::Mtp, 3);
    let three = [reqs[0].clone(), reqs[1].clone(), reqs[0].clone()];
    let c = run_alone(&mut one, &three);
    same("demo mtp one slot", &run_alone(&mut plain, &three), &c);
    for (i, s) in c.iter().enumerate() {
        let t = &s.done.as_ref().unwrap().as_ref().unwrap().timings;
        assert!(
            t.draft_n > 0,
            "request {i} drafted nothing (cached {})",
            t.cache_n
        );
    }
}

/// An engine of `parallel` slots on the test device with `--vram-budget` /
/// `--ram-budget`, drafting up to 8 tokens. A short context: the resident run's
/// prompt scratch (which grows with the context) is then close to what a tiered load
/// plans for, so half the experts' VRAM less does tier them.
fn budgeted(
    path: &Path,
    (mode, parallel): (SpecMode, usize),
    vram_budget: Option<u64>,
    ram_budget: Option<u64>,
) -> Result<Engine, engine::EngineError> {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(256),
            parallel: Some(parallel),
            device: Some(common::test_device()),
            vram_budget,
            ram_budget,
            spec: SpecConfig {
                mode,
                draft_max: 8,
                draft_min: 0,
                fixed: true,
            },
            ..Default::default()
        },
    )
}

/// With the routed experts tiered on the test device (the GPU: VRAM slots for half of
/// them, the rest read from the file; the CPU: every one read from the file), prompt
/// lookup's verify steps and rollbacks keep the bytes of plain decoding with every
/// expert resident, greedy and sampled.
#[test]
fn tiered_prompt_lookup_keeps_the_bytes_of_resident_plain_decoding() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), model::Arch::Qwen35Moe, Preset::Q8_0, 5);
    let load = |mode, vram_budget, ram_budget| budgeted(&path, (mode, 1), vram_budget, ram_budget);
    // What the resident engine uses with speculation's room for verify steps (the
    // GPU keeps a trail of states per slot): half the experts' VRAM less tiers them.
    let used = load(SpecMode::Ngram, None, None)
        .expect("load")
        .device_report()
        .vram_used;
    let (vram_budget, ram_budget) = common::tiering_budgets(&path, used);
    let mut plain = load(SpecMode::Off, None, None).expect("load");
    let mut spec = load(SpecMode::Ngram, vram_budget, ram_budget).expect("tiered load");
    let reqs = vec![
        looping(request(
            echoing(&mut plain, 30, 1),
            60,
            SamplingParams::default(),
        )),
        looping(request(echoing(&mut plain, 20, 2), 60, seeded(7))),
    ];
    plain.reset().expect("reset");
    let a = run_alone(&mut plain, &reqs);
    let b = run_alone(&mut spec, &reqs);
    same("tiered lookup", &a, &b);
    assert!(drafts(&b).0 > 0, "nothing drafted");
    let stats = spec.expert_stats().expect("tiered");
    assert!(stats.disk_misses > 0, "{stats:?}");
}

/// With the routed experts tiered (the GPU: VRAM slots for half of them, the MTP
/// block's whole beside them; the CPU: every one read from the file), MTP drafts
/// keep the bytes of plain decoding with every expert resident, greedy and sampled,
/// two requests side by side; and, drafting a fixed length, they are the drafts of
/// the resident executor (as many kept: placement changes no hidden row).
#[test]
fn tiered_mtp_drafts_keep_the_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), model::Arch::Qwen35Moe, Preset::Q8_0, 5);
    let load = |mode, vram_budget, ram_budget| budgeted(&path, (mode, 2), vram_budget, ram_budget);
    let used = load(SpecMode::Mtp, None, None)
        .expect("resident load")
        .device_report()
        .vram_used;
    let (vram_budget, ram_budget) = common::tiering_budgets(&path, used);
    let mut plain = load(SpecMode::Off, None, None).expect("load");
    let mut resident = load(SpecMode::Mtp, None, None).expect("load");
    let mut spec = load(SpecMode::Mtp, vram_budget, ram_budget).expect("tiered load");
    assert_eq!(spec.drafter(), Some(Drafter::Mtp));
    let reqs = vec![
        request(echoing(&mut plain, 16, 3), 40, SamplingParams::default()),
        request(echoing(&mut plain, 10, 5), 40, seeded(2)),
    ];
    plain.reset().expect("reset");
    let a = run_alone(&mut plain, &reqs);
    let b = common::together(&mut spec, &reqs);
    same("tiered mtp", &a, &b);
    assert!(drafts(&b).0 > 0, "nothing drafted");
    let c = common::together(&mut resident, &reqs);
    assert_eq!(drafts(&b), drafts(&c), "drafted and kept: tiered, resident");
    let stats = spec.expert_stats().expect("tiered");
    assert!(stats.disk_misses > 0, "{stats:?}");
}
