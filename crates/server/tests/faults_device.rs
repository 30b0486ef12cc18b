//! A lost device under the real server (injected on the CPU executor with
//! `SCORIA_TEST_DEVICE_FAULT`): the request whose step failed gets an error naming
//! it, later requests are refused with the remedy, and `/health` turns `unhealthy`
//! (503) with the failure in words — it never clears. (`scoria serve` then stops with
//! a non-zero exit status: crates/cli/tests/device_fault.rs.) One test in its own
//! binary: the variable is read when the executor is made.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::{http, serve};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_device_turns_health_unhealthy_and_requests_fail_with_the_remedy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    common::tiny_model(&path, model::Arch::Qwen3Moe, 5);
    // The second step fails: the first request's prompt runs, its first decode step
    // does not.
    std::env::set_var(engine::switches::TEST_DEVICE_FAULT, "2");
    let eng = engine::Engine::load(
        &path,
        &engine::EngineConfig {
            max_context: Some(256),
            parallel: Some(1),
            device: Some(engine::Device::Cpu),
            prompt_cache: Some(0),
            ..Default::default()
        },
    )
    .expect("load");
    std::env::remove_var(engine::switches::TEST_DEVICE_FAULT);
    let addr = serve(eng).await;

    let body = json!({"prompt": "the device test", "max_tokens": 8, "temperature": 0}).to_string();
    let (status, text) = http(addr, "POST", "/v1/completions", &body).await;
    assert!(status >= 500, "{status}: {text}");
    assert!(text.contains("the device stopped answering"), "{text}");
    // The worker reports after its step: /health turns unhealthy and stays so.
    let t0 = Instant::now();
    let health = loop {
        let (status, body) = http(addr, "GET", "/health", "").await;
        if status == 503 {
            break serde_json::from_str::<Value>(&body).expect("json");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "/health stayed {status}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(health["status"], "unhealthy", "{health}");
    assert!(
        health["fault"]
            .as_str()
            .unwrap_or("")
            .contains("the device stopped answering"),
        "{health}"
    );
    let (status, text) = http(addr, "POST", "/v1/completions", &body).await;
    assert!(
        status >= 500 && text.contains("restart the server"),
        "{status}: {text}"
    );
    let (status, _) = http(addr, "GET", "/health", "").await;
    assert_eq!(status, 503);
}
