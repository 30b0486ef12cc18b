//! A lost device (a GPU's sticky context error, injected on the CPU executor with
//! `SCORIA_TEST_DEVICE_FAULT`): the step's requests end with the executor's message,
//! the requests still waiting are refused, the engine reports the failure
//! (`Engine::fatal`) and refuses every later request, naming the remedy. One test in
//! its own binary: the variable is read when the executor is made.

mod common;

use common::{together, Seen};
use engine::{Engine, EngineConfig, GenerateRequest};
use model::synth::Preset;

fn err(s: &Seen) -> String {
    match &s.done {
        Some(Err(e)) => e.clone(),
        other => panic!("an error expected, got {other:?}"),
    }
}

#[test]
fn a_lost_device_ends_the_requests_and_the_engine_refuses_more() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::synth_tiny(dir.path(), model::Arch::Qwen35Moe, Preset::Q8_0, 5);
    // The fourth step fails: three steps of the first request's prompt and decoding go
    // well first.
    std::env::set_var(engine::switches::TEST_DEVICE_FAULT, "4");
    let mut eng = Engine::load(
        &path,
        &EngineConfig {
            max_context: Some(256),
            parallel: Some(1),
            device: Some(engine::Device::Cpu),
            ..Default::default()
        },
    )
    .expect("load");
    std::env::remove_var(engine::switches::TEST_DEVICE_FAULT);
    assert!(eng.fatal().is_none());
    let p: Vec<u32> = (0..20).map(|i| 100 + i * 7).collect();
    // One slot: the second request waits in the queue while the first one runs.
    let seen = together(
        &mut eng,
        &[
            GenerateRequest::greedy(p.clone(), 8),
            GenerateRequest::greedy(p.clone(), 8),
        ],
    );
    let first = err(&seen[0]);
    assert!(first.contains("the device stopped answering"), "{first}");
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
    assert!(fatal.contains("the device stopped answering"), "{fatal}");
    // Later requests, queued or alone, are refused at once with the remedy.
    let later = together(&mut eng, &[GenerateRequest::greedy(p.clone(), 4)]);
    assert!(err(&later[0]).contains("restart the server"));
    let e = eng
        .generate(&GenerateRequest::greedy(p, 4), &mut |_| {
            engine::Flow::Continue
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("restart the server"), "{e}");
}
