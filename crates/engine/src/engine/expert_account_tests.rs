//! A request's `timings.experts`: the tiered experts' traffic of exactly the steps
//! it ran in, alone and beside another request. The CPU executor keeps no such
//! counts, so a wrapper around it counts every step as a tiered executor would.

use super::Engine;
use crate::api::{
    Completion, Device, DeviceReport, EngineConfig, Flow, GenerateRequest, TokenEvent,
};
use crate::error::EngineError;
use crate::exec::{Executor, SeqStep, StepOut};
use crate::experts::TierStats;
use crate::sched::RequestCallbacks;
use model::geometry::Geometry;
use model::synth::{synthesize, Preset, SynthOptions};
use model::ExecError;
use std::sync::{Arc, Mutex};

/// The CPU executor, with counts a step adds to: a use (a hit) per token fed and a
/// miss per step.
struct Counting {
    inner: Box<dyn Executor>,
    stats: Arc<Mutex<TierStats>>,
}

impl Executor for Counting {
    fn report(&self) -> DeviceReport {
        self.inner.report()
    }
    fn sequences(&self) -> usize {
        self.inner.sequences()
    }
    fn clear(&mut self, seq: usize) -> Result<(), ExecError> {
        self.inner.clear(seq)
    }
    fn step(&mut self, batch: &[SeqStep]) -> Result<Vec<StepOut>, ExecError> {
        let out = self.inner.step(batch);
        let mut s = self.stats.lock().unwrap();
        s.hits += batch.iter().map(|b| b.tokens.len() as u64).sum::<u64>();
        s.ram_misses += 1;
        out
    }
    fn expert_stats(&self) -> Option<TierStats> {
        Some(*self.stats.lock().unwrap())
    }
    fn prompt_chunk(&self) -> usize {
        self.inner.prompt_chunk()
    }
}

/// Stands in while the executor is moved into its wrapper.
struct Moved;

impl Executor for Moved {
    fn report(&self) -> DeviceReport {
        unreachable!()
    }
    fn sequences(&self) -> usize {
        unreachable!()
    }
    fn clear(&mut self, _: usize) -> Result<(), ExecError> {
        unreachable!()
    }
    fn step(&mut self, _: &[SeqStep]) -> Result<Vec<StepOut>, ExecError> {
        unreachable!()
    }
}

/// The counts when the request was admitted and when it ended, and its result.
#[derive(Default)]
struct Seen {
    admitted: Option<TierStats>,
    ended: Option<TierStats>,
    done: Option<Completion>,
}

struct Watch {
    stats: Arc<Mutex<TierStats>>,
    seen: Arc<Mutex<Seen>>,
}

impl RequestCallbacks for Watch {
    fn admitted(&mut self, _: usize, _: usize) {
        self.seen.lock().unwrap().admitted = Some(*self.stats.lock().unwrap());
    }
    fn token(&mut self, _: &TokenEvent) -> Flow {
        Flow::Continue
    }
    fn done(&mut self, r: Result<Completion, EngineError>) {
        let mut seen = self.seen.lock().unwrap();
        seen.ended = Some(*self.stats.lock().unwrap());
        seen.done = Some(r.expect("generation"));
    }
}

fn request(prompt_len: usize, max_tokens: usize, salt: u32) -> GenerateRequest {
    let prompt = (0..prompt_len as u32).map(|i| 100 + i * 7 + salt).collect();
    GenerateRequest::greedy(prompt, max_tokens)
}

#[test]
fn a_request_s_expert_traffic_is_that_of_the_steps_it_ran_in() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    let g = Geometry::by_name(Some(model::Arch::Qwen35Moe), "tiny").expect("geometry");
    let opts = SynthOptions {
        preset: Preset::Q4KM,
        seed: 3,
        sync: false,
    };
    synthesize(&path, &g, &opts, &|_, _| {}).expect("synthesize");
    let cfg = EngineConfig {
        max_context: Some(256),
        parallel: Some(2),
        device: Some(Device::Cpu),
        prompt_cache: Some(0),
        ..Default::default()
    };
    let mut eng = Engine::load(&path, &cfg).expect("load");
    // Not tiered: no account.
    let c = eng
        .generate(&request(5, 3, 0), &mut |_| Flow::Continue)
        .expect("generate");
    assert_eq!(c.timings.experts, None);

    let stats = Arc::new(Mutex::new(TierStats::default()));
    let inner = std::mem::replace(&mut eng.exec, Box::new(Moved));
    eng.exec = Box::new(Counting {
        inner,
        stats: stats.clone(),
    });
    eng.reset().expect("reset");
    // Alone: every token it fed (the prompt, each generated token but the last).
    let before = *stats.lock().unwrap();
    let c = eng
        .generate(&request(6, 4, 1), &mut |_| Flow::Continue)
        .expect("generate");
    let e = c.timings.experts.expect("an account");
    assert_eq!(e, stats.lock().unwrap().minus(&before));
    assert_eq!(c.tokens.len(), 4);
    assert_eq!(e.hits, 6 + 4 - 1);
    // Beside another: each gets the steps from its admission to its end, the other's
    // tokens in them included.
    let (short, long) = (
        Arc::new(Mutex::new(Seen::default())),
        Arc::new(Mutex::new(Seen::default())),
    );
    for (req, seen) in [(request(5, 3, 2), &short), (request(9, 12, 3), &long)] {
        let sink = Watch {
            stats: stats.clone(),
            seen: seen.clone(),
        };
        eng.submit(req, Box::new(sink));
    }
    while eng.step() {}
    for seen in [&short, &long] {
        let s = seen.lock().unwrap();
        let (a, z) = (s.admitted.expect("admitted"), s.ended.expect("ended"));
        let c = s.done.as_ref().expect("done");
        assert_eq!(c.timings.experts, Some(z.minus(&a)));
    }
    let s = short.lock().unwrap().done.clone().unwrap();
    let l = long.lock().unwrap().done.clone().unwrap();
    let (se, le) = (s.timings.experts.unwrap(), l.timings.experts.unwrap());
    assert!(
        se.hits > 5 + 3 - 1,
        "the short one's steps carried the long one's tokens too"
    );
    assert_eq!(le.hits, (5 + 3 - 1) + (9 + 12 - 1), "the long one saw both");
}
