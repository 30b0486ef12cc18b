//! The scheduler on tiny synthetic models of every arch: requests decoded side by
//! side (mixed prompt lengths, a prompt read in pieces, greedy and seeded sampling,
//! late arrivals, a cancellation, more requests than slots) get exactly the tokens
//! and logits they get alone; a chat turn that diverges from the previous one at a
//! message start reuses the state up to there, from its slot or from the prompt
//! cache (in memory and on disk), with the bits of a cold run. They run on the
//! executor of the test device (`SCORIA_TEST_DEVICE`: the CPU, or the GPU in
//! `scripts/gpu-tests.sh`, where the slots' state comes back through the CUDA
//! executor's snapshots).

mod common;

use common::bits;
use engine::{
    Completion, Engine, EngineConfig, EngineError, Flow, GenerateRequest, RequestCallbacks,
    SamplingParams, TokenEvent,
};
use model::geometry::ARCHS;
use model::synth::Preset;
use model::Arch;
use std::path::Path;
use std::sync::{Arc, Mutex};

fn engine(path: &Path, parallel: usize, cache: Option<u64>, dir: Option<&Path>) -> Engine {
    engine_ctx(path, 1024, parallel, cache, dir)
}

fn engine_ctx(
    path: &Path,
    n_ctx: usize,
    parallel: usize,
    cache: Option<u64>,
    dir: Option<&Path>,
) -> Engine {
    Engine::load(
        path,
        &EngineConfig {
            max_context: Some(n_ctx),
            parallel: Some(parallel),
            device: Some(common::test_device()),
            prompt_cache: cache,
            prompt_cache_dir: dir.map(Path::to_path_buf),
            ..Default::default()
        },
    )
    .expect("load")
}

fn tokens(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % 5000) as u32 + 100)
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling,
        stop_at_eog: false,
        constraint: None,
        logprobs: None,
        speculative: Default::default(),
        images: Vec::new(),
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// What a request produced: its tokens and the logits each was chosen from.
#[derive(Default, Debug)]
struct Seen {
    tokens: Vec<u32>,
    logits: Vec<Vec<u32>>,
    done: Option<Result<Completion, String>>,
}

/// Collects into a shared `Seen`; cancels itself after `cancel_after` tokens.
struct Collect {
    seen: Arc<Mutex<Seen>>,
    cancel_after: Option<usize>,
}

impl RequestCallbacks for Collect {
    fn token(&mut self, ev: &TokenEvent) -> Flow {
        self.seen.lock().unwrap().tokens.push(ev.token);
        Flow::Continue
    }
    fn wants_logits(&self) -> bool {
        true
    }
    fn logits(&mut self, l: &[f32]) {
        self.seen.lock().unwrap().logits.push(bits(l));
    }
    fn cancelled(&self) -> bool {
        self.cancel_after
            .is_some_and(|n| self.seen.lock().unwrap().tokens.len() >= n)
    }
    fn done(&mut self, r: Result<Completion, EngineError>) {
        self.seen.lock().unwrap().done = Some(r.map_err(|e| e.to_string()));
    }
}

/// Runs `req` alone on `eng`: its tokens and logits bits.
fn solo(eng: &mut Engine, req: &GenerateRequest) -> (Completion, Vec<Vec<u32>>) {
    let mut logits = Vec::new();
    let c = eng
        .generate_with_logits(req, &mut |_| Flow::Continue, &mut |l| logits.push(bits(l)))
        .expect("generate");
    (c, logits)
}

/// Each of `reqs` run alone from a cold engine.
fn solos(eng: &mut Engine, reqs: &[GenerateRequest]) -> Vec<(Completion, Vec<Vec<u32>>)> {
    reqs.iter()
        .map(|r| {
            eng.reset().expect("reset");
            solo(eng, r)
        })
        .collect()
}

#[test]
fn requests_decoded_side_by_side_get_the_bits_they_get_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 5);
        let reqs = [
            request(tokens(40, 1), 12, SamplingParams::default()),
            // More than one prompt piece (the CPU reads 512 tokens per step).
            request(tokens(600, 2), 6, seeded(3)),
            request(tokens(20, 3), 15, seeded(5)),
            // These two arrive after a few steps; the last is cancelled.
            request(tokens(30, 4), 10, SamplingParams::default()),
            request(tokens(25, 5), 14, seeded(9)),
        ];
        let cancel_after = [None, None, None, None, Some(4)];
        let want = solos(&mut engine(&path, 1, Some(0), None), &reqs);

        // Three slots for five requests: two wait for a slot.
        let mut eng = engine(&path, 3, Some(0), None);
        let seen: Vec<Arc<Mutex<Seen>>> = (0..reqs.len()).map(|_| Default::default()).collect();
        let submit = |eng: &mut Engine, i: usize| {
            eng.submit(
                reqs[i].clone(),
                Box::new(Collect {
                    seen: seen[i].clone(),
                    cancel_after: cancel_after[i],
                }),
            )
        };
        for i in 0..3 {
            submit(&mut eng, i);
        }
        for _ in 0..3 {
            assert!(eng.step());
        }
        submit(&mut eng, 3);
        submit(&mut eng, 4);
        let mut steps = 0;
        while eng.step() {
            steps += 1;
            assert!(steps < 10_000, "{arch:?}: the scheduler does not finish");
        }
        for (i, s) in seen.iter().enumerate() {
            let s = s.lock().unwrap();
            let done = s
                .done
                .as_ref()
                .expect("done called")
                .as_ref()
                .expect("no error");
            let (c, logits) = &want[i];
            if cancel_after[i].is_some() {
                assert_eq!(done.finish, engine::FinishReason::Stopped);
                assert_eq!(
                    s.tokens[..],
                    c.tokens[..s.tokens.len()],
                    "{arch:?} request {i}"
                );
                continue;
            }
            assert_eq!(done.finish, c.finish, "{arch:?} request {i}");
            assert_eq!(s.tokens, c.tokens, "{arch:?} request {i}: tokens");
            assert_eq!(done.tokens, c.tokens, "{arch:?} request {i}: completion");
            assert_eq!(s.logits.len(), logits.len(), "{arch:?} request {i}");
            for (k, (a, b)) in s.logits.iter().zip(logits).enumerate() {
                assert!(a == b, "{arch:?} request {i}: logits of token {k} differ");
            }
        }
        assert!(!eng.busy());
        assert!(eng.slots().iter().all(|s| !s.busy));
    }
}

/// The marker of a chat message start in these prompts.
fn im_start(eng: &Engine) -> u32 {
    eng.tokenizer()
        .token_id("<|im_start|>")
        .expect("<|im_start|>")
}

/// Turn 1 of a chat, and turn 2, which keeps turn 1 up to its last message start
/// and then differs (as when a template re-renders the previous answer); and how
/// much of turn 1 the cache can give turn 2: up to the message start where the
/// model has recurrent state (a mark), one token more (the common prefix) where it
/// has only attention.
fn turns(eng: &Engine, salt: usize) -> (Vec<u32>, Vec<u32>, usize) {
    let s = im_start(eng);
    let mut t1 = vec![s];
    t1.extend(tokens(40, salt));
    let boundary = t1.len();
    t1.push(s);
    t1.extend(tokens(10, salt + 1));
    let mut t2 = t1[..boundary].to_vec();
    t2.push(s);
    t2.extend(tokens(15, salt + 2));
    t2.push(s);
    t2.extend(tokens(5, salt + 3));
    let reused = if eng.info().arch == "qwen3moe" {
        boundary + 1
    } else {
        boundary
    };
    (t1, t2, reused)
}

#[test]
fn a_chat_turn_reuses_the_state_up_to_where_it_diverges_with_the_bits_of_a_cold_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 5);
        let mut cold = engine(&path, 1, Some(0), None);
        let (t1, t2, boundary) = turns(&cold, 7);
        let r1 = request(t1, 8, SamplingParams::default());
        let r2 = request(t2, 8, seeded(4));
        let (want, want_logits) = solo(&mut cold, &r2);
        assert_eq!(want.timings.cache_n, 0);

        // Its slot goes back to the message start.
        let mut eng = engine(&path, 2, Some(0), None);
        solo(&mut eng, &r1);
        let (got, logits) = solo(&mut eng, &r2);
        assert_eq!(
            got.timings.cache_n, boundary,
            "{arch:?}: reused from the slot"
        );
        assert_eq!(got.tokens, want.tokens, "{arch:?}");
        assert!(logits == want_logits, "{arch:?}: logits differ");
    }
}

#[test]
fn a_new_conversation_reuses_the_system_message_of_one_that_went_on_for_turns() {
    // A client's conversations share their system message. One conversation goes on
    // for three turns in the slot, each re-rendering the turn before after its user
    // message (as agents' templates do), so the slot takes more marks than it keeps
    // and, with the prompt cache on, comes back from it; a new conversation with the
    // same system message still starts from its end, with the bits of a cold run.
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 5);
        let mut cold = engine(&path, 1, Some(0), None);
        let s = im_start(&cold);
        let mut system = vec![s];
        system.extend(tokens(40, 11));
        let mut user = system.clone();
        user.push(s);
        user.extend(tokens(10, 12));
        // The generation prompt: the assistant's role and an empty think block, which
        // the next turn renders differently (its answer without the think block).
        let answer = |p: &mut Vec<u32>| {
            p.push(s);
            p.extend(tokens(2, 7));
        };
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|t| {
                let mut p = user.clone();
                answer(&mut p);
                if t > 0 {
                    p.extend(tokens(8, 20 + t));
                    for m in 0..t {
                        p.push(s);
                        p.extend(tokens(8, 30 + 3 * t + m));
                    }
                    answer(&mut p);
                }
                p.extend(tokens(3, 8));
                p
            })
            .collect();
        let mut other = system.clone();
        other.push(s);
        other.extend(tokens(12, 99));
        let fresh = request(other, 8, seeded(3));
        let (want, want_logits) = solo(&mut cold, &fresh);
        let reused = if arch == Arch::Qwen3Moe {
            system.len() + 1
        } else {
            system.len()
        };
        for cache in [Some(0), None] {
            let mut eng = engine(&path, 1, cache, None);
            for p in &prompts {
                solo(&mut eng, &request(p.clone(), 4, SamplingParams::default()));
            }
            let (got, logits) = solo(&mut eng, &fresh);
            assert_eq!(
                got.timings.cache_n, reused,
                "{arch:?}, prompt cache {cache:?}: reused from the slot"
            );
            assert_eq!(got.tokens, want.tokens, "{arch:?}");
            assert!(logits == want_logits, "{arch:?}: logits differ");
        }
    }
}

#[test]
fn a_conversation_a_slot_lost_comes_back_from_the_prompt_cache_and_its_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    for arch in ARCHS {
        let path = common::synth_tiny(dir.path(), arch, Preset::Q8_0, 5);
        let cache_dir = dir.path().join(format!("cache-{arch:?}"));
        let mut cold = engine(&path, 1, Some(0), None);
        let (a1, a2, boundary) = turns(&cold, 11);
        let (b1, _, _) = turns(&cold, 23);
        let r2 = request(a2.clone(), 8, SamplingParams::default());
        let (want, want_logits) = solo(&mut cold, &r2);

        // One slot: conversation B takes it from A, which goes to the cache.
        let mut eng = engine(&path, 1, Some(64 << 20), Some(&cache_dir));
        solo(&mut eng, &request(a1, 6, SamplingParams::default()));
        solo(&mut eng, &request(b1, 6, SamplingParams::default()));
        let (got, logits) = solo(&mut eng, &r2);
        assert_eq!(got.timings.cache_n, boundary, "{arch:?}: from the cache");
        assert_eq!(got.tokens, want.tokens, "{arch:?}");
        assert!(logits == want_logits, "{arch:?}: logits differ");
        let report = eng.cache_report();
        assert_eq!(report.counters.store_hits, 1, "{arch:?}: {report:?}");
        eng.flush_prompt_cache();
        let files = std::fs::read_dir(&cache_dir).expect("cache dir").count();
        assert!(
            files >= 1,
            "{arch:?}: nothing written to {}",
            cache_dir.display()
        );

        // A restarted engine finds it on disk.
        let mut again = engine(&path, 1, Some(64 << 20), Some(&cache_dir));
        let (got, logits) = solo(&mut again, &r2);
        assert_eq!(got.timings.cache_n, boundary, "{arch:?}: from the files");
        assert_eq!(got.tokens, want.tokens, "{arch:?}");
        assert!(
            logits == want_logits,
            "{arch:?}: logits differ after a restart"
        );
    }
}

#[test]
fn slots_share_one_context_pool_and_the_newest_request_yields_when_it_is_full() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), Arch::Qwen35Moe, Preset::Q8_0, 5);
    let reqs = [
        request(tokens(100, 31), 120, SamplingParams::default()),
        request(tokens(100, 32), 120, seeded(2)),
    ];
    let want = solos(&mut engine_ctx(&path, 256, 1, Some(0), None), &reqs);
    assert!(want.iter().all(|(c, _)| c.tokens.len() == 120));

    // 256 positions for two requests that need 220 each: the second (newer)
    // ends when neither can go on; the first then finishes with its solo bits.
    let mut eng = engine_ctx(&path, 256, 2, Some(0), None);
    let seen: Vec<Arc<Mutex<Seen>>> = (0..2).map(|_| Default::default()).collect();
    for (r, s) in reqs.iter().zip(&seen) {
        eng.submit(
            r.clone(),
            Box::new(Collect {
                seen: s.clone(),
                cancel_after: None,
            }),
        );
    }
    while eng.step() {}
    let first = seen[0].lock().unwrap();
    let c = first.done.as_ref().unwrap().as_ref().unwrap();
    assert_eq!(c.finish, engine::FinishReason::Length);
    assert_eq!(first.tokens, want[0].0.tokens);
    assert!(first.logits == want[0].1);
    let second = seen[1].lock().unwrap();
    let c = second.done.as_ref().unwrap().as_ref().unwrap();
    assert_eq!(c.finish, engine::FinishReason::ContextFull);
    assert!(second.tokens.len() < 120);
    assert_eq!(second.tokens[..], want[1].0.tokens[..second.tokens.len()]);
    let held: usize = eng.slots().iter().map(|s| s.cached_tokens).sum();
    assert!(held <= 256, "the slots hold {held} positions");
}

/// Each token event's token and log-probabilities.
type Events = Vec<(u32, Option<engine::TokenLogprobs>)>;

/// Records each token event's log-probabilities.
struct Logprobs(Arc<Mutex<Events>>);

impl RequestCallbacks for Logprobs {
    fn token(&mut self, ev: &TokenEvent) -> Flow {
        self.0.lock().unwrap().push((ev.token, ev.logprobs));
        Flow::Continue
    }
    fn done(&mut self, _: Result<Completion, EngineError>) {}
}

#[test]
fn log_probabilities_are_the_models_and_do_not_change_what_is_decoded_alone_or_beside_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), Arch::Qwen35Moe, Preset::Q8_0, 5);
    let plain = [
        request(tokens(30, 1), 10, SamplingParams::default()),
        request(tokens(18, 2), 10, seeded(7)),
    ];
    // Alone, without log-probabilities: the tokens and the logits they came from.
    let want = solos(&mut engine(&path, 1, Some(0), None), &plain);
    let with: Vec<GenerateRequest> = plain
        .iter()
        .zip([3usize, 0])
        .map(|(r, n)| GenerateRequest {
            logprobs: Some(n),
            speculative: Default::default(),
            images: Vec::new(),
            ..r.clone()
        })
        .collect();
    // Alone and side by side, with them.
    let run = |parallel: usize| {
        let mut eng = engine(&path, parallel, Some(0), None);
        let seen: Vec<_> = with
            .iter()
            .map(|_| Arc::new(Mutex::new(Vec::new())))
            .collect();
        for (r, s) in with.iter().zip(&seen) {
            eng.submit(r.clone(), Box::new(Logprobs(s.clone())));
            if parallel == 1 {
                while eng.step() {}
            }
        }
        while eng.step() {}
        seen.iter()
            .map(|s| s.lock().unwrap().clone())
            .collect::<Vec<_>>()
    };
    let alone = run(1);
    let beside = run(2);
    for (i, ((c, logits), got)) in want.iter().zip(&alone).enumerate() {
        let toks: Vec<u32> = got.iter().map(|e| e.0).collect();
        assert_eq!(toks, c.tokens, "request {i}: the tokens do not change");
        for (k, &(tok, lp)) in got.iter().enumerate() {
            let lp = lp.expect("every token has its log-probabilities");
            let l: Vec<f32> = logits[k].iter().map(|&b| f32::from_bits(b)).collect();
            // The reference: log-softmax in f64.
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max + l.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            let reference = l[tok as usize] as f64 - lse;
            assert!(
                (lp.logprob as f64 - reference).abs() < 1e-4,
                "request {i} token {k}: {} vs {reference}",
                lp.logprob
            );
            assert_eq!(lp.top().len(), with[i].logprobs.unwrap());
            let mut order: Vec<(u32, f32)> = l
                .iter()
                .copied()
                .enumerate()
                .map(|(j, v)| (j as u32, v))
                .collect();
            order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            for (j, &(id, v)) in lp.top().iter().enumerate() {
                assert_eq!(id, order[j].0, "request {i} token {k}: rank {j}");
                assert!((v as f64 - (order[j].1 as f64 - lse)).abs() < 1e-4);
            }
            if i == 0 {
                // Greedy: the token chosen is the most likely one.
                assert_eq!(lp.top()[0], (tok, lp.logprob));
            }
        }
    }
    for (i, (a, b)) in alone.iter().zip(&beside).enumerate() {
        let bits = |v: &Events| {
            v.iter()
                .map(|(t, lp)| {
                    let lp = lp.expect("log-probabilities");
                    let top: Vec<(u32, u32)> =
                        lp.top().iter().map(|&(id, v)| (id, v.to_bits())).collect();
                    (*t, lp.logprob.to_bits(), top)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(a), bits(b), "request {i}: side by side, the same bits");
    }
}
