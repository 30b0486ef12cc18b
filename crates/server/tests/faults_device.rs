//! A lost device under the real server (injected on the CPU executor with
//! `SCORIA_TEST_DEVICE_FAULT`): the request whose step failed gets an error naming
//! it, later requests are refused with the remedy, and `/health` turns `unhealthy`
//! (503) with the failure in words — it never clears. (`scoria serve` then stops with
//! a non-zero exit status: crates/cli/tests/device_fault.rs.) One test in its own
//! binary: the variable is read when the executor is made.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn http(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    (status, rest.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_device_turns_health_unhealthy_and_requests_fail_with_the_remedy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    let g = model::geometry::Geometry::by_name(Some(model::Arch::Qwen3Moe), "tiny").expect("tiny");
    model::synth::synthesize(
        &path,
        &g,
        &model::synth::SynthOptions {
            preset: model::synth::Preset::Q8_0,
            seed: 5,
            sync: false,
        },
        &|_, _| {},
    )
    .expect("synthesize");
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
    let stats = Arc::new(server::metrics::Stats::new());
    let loaded = server::core_for(eng, Default::default(), stats.clone()).expect("core");
    let state = server::AppState::new(
        stats,
        loaded.info,
        loaded.tokenizer,
        loaded.template,
        json!({}),
        None,
        "lost".into(),
    )
    .with_core(loaded.core);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, server::app(Arc::new(state))).await });

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
