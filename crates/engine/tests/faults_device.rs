//! A lost device (a GPU's sticky context error, injected on the CPU executor with
//! `SCORIA_TEST_DEVICE_FAULT`): the step's requests end with the executor's message,
//! the requests still waiting are refused, the engine reports the failure
//! (`Engine::fatal`) and refuses every later request, naming the remedy. One test in
//! its own binary: the variable is read when the executor is made.

mod common;

use common::together;
use engine::{Engine, EngineConfig, GenerateRequest};
use model::synth::Preset;

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
    common::assert_device_lost(&mut eng, &seen, "the device stopped answering", &p);
}
