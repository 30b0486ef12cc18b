//! What a supervisor sees of the engine's faults: `/health` turns `degraded` (503)
//! with the fault in words while an expert read is stuck past its deadline, and `ok`
//! (200) again once it comes back; `/metrics` counts the expert reads, their retries,
//! failures and stalls. The faults are injected through `engine::fault` into real
//! reads of a real model file, under the real server.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use engine::fault::{inject, Fault, Rule, Site};

mod common;
use common::{http, serve};
use serde_json::{json, Value};

const DEADLINE: Duration = Duration::from_millis(500);

/// A tiny qwen3moe with random weights whose experts are all read from the file.
fn engine(path: &Path) -> engine::Engine {
    common::tiny_model(path, model::Arch::Qwen3Moe, 5);
    engine::Engine::load(
        path,
        &engine::EngineConfig {
            max_context: Some(256),
            parallel: Some(2),
            device: Some(engine::Device::Cpu),
            prompt_cache: Some(0),
            ram_budget: Some(0),
            expert_read_deadline: Some(DEADLINE),
            ..Default::default()
        },
    )
    .expect("load")
}

async fn health(addr: SocketAddr) -> (u16, Value) {
    let (status, body) = http(addr, "GET", "/health", "").await;
    (status, serde_json::from_str(&body).expect("health json"))
}

/// The value of the unlabelled sample `name` in `/metrics`.
async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (status, body) = http(addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{body}"))
}

/// Polls `name` until `ok` holds for it (the worker reports after its step, which
/// may be after the answer reached the client); returns it.
async fn metric_becomes(addr: SocketAddr, name: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let t0 = Instant::now();
    loop {
        let v = metric(addr, name).await;
        if ok(v) {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{name} stayed {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn complete(addr: SocketAddr) -> (u16, String) {
    let body = json!({"prompt": "the fault test", "max_tokens": 4, "temperature": 0});
    http(addr, "POST", "/v1/completions", &body.to_string()).await
}

/// A completion's text.
fn text(body: &str) -> String {
    let v: Value = serde_json::from_str(body).expect("json");
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

/// Polls `/health` until its status is `want` (the worker reports after its step).
async fn health_becomes(addr: SocketAddr, want: u16, within: Duration) -> Value {
    let t0 = Instant::now();
    loop {
        let (status, body) = health(addr).await;
        if status == want {
            return body;
        }
        assert!(
            t0.elapsed() < within,
            "/health stayed {status} (wanted {want}): {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_report_expert_read_faults() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("faulty-qwen3moe.gguf");
    let addr = serve(engine(&path)).await;
    let file = path.to_string_lossy().to_string();

    // Healthy: ok, no fault, the counters there and zero.
    let (status, h) = health(addr).await;
    assert_eq!((status, h["status"].as_str()), (200, Some("ok")), "{h}");
    assert!(h["fault"].is_null(), "{h}");
    assert!(h["warning"].is_null(), "{h}");
    assert_eq!(metric(addr, "scoria:fault").await, 0.0);
    assert_eq!(metric(addr, "scoria:warning").await, 0.0);
    assert_eq!(metric(addr, "scoria:expert_read_failures_total").await, 0.0);
    let (status, clean) = complete(addr).await;
    assert_eq!(status, 200, "{clean}");
    // Experts are read from the file.
    metric_becomes(addr, "scoria:expert_reads_total", |v| v > 0.0).await;
    assert!(metric(addr, "scoria:expert_read_bytes_total").await > 0.0);

    // One failed read: retried, served, counted; health stays ok.
    {
        let eio = inject(Rule::new(Site::ExpertRead, &file, Fault::Errno(5)).times(1));
        let (status, body) = complete(addr).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(text(&body), text(&clean));
        assert_eq!(eio.fired(), 1);
    }
    metric_becomes(addr, "scoria:expert_read_retries_total", |v| v == 1.0).await;
    assert_eq!(metric(addr, "scoria:expert_read_failures_total").await, 0.0);
    assert_eq!(health(addr).await.0, 200);

    // A read that stalls past the deadline: the request fails, /health is degraded
    // with the fault in words until the read comes back, then ok again.
    let stall = inject(
        Rule::new(
            Site::ExpertRead,
            &file,
            Fault::Stall(Duration::from_secs(3)),
        )
        .times(1),
    );
    let (status, body) = complete(addr).await;
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("deadline"), "{body}");
    assert_eq!(stall.fired(), 1);
    let h = health_becomes(addr, 503, Duration::from_secs(2)).await;
    assert_eq!(h["status"], "degraded", "{h}");
    let fault = h["fault"].as_str().expect("fault text");
    assert!(
        fault.contains(&file) && fault.contains("has not come back"),
        "{fault}"
    );
    assert_eq!(metric(addr, "scoria:fault").await, 1.0);
    assert_eq!(metric(addr, "scoria:expert_read_stalls_total").await, 1.0);
    assert!(metric(addr, "scoria:expert_read_failures_total").await >= 1.0);
    // No request comes in: the idle worker still sees the read come back.
    let h = health_becomes(addr, 200, Duration::from_secs(10)).await;
    assert_eq!(h["status"], "ok", "{h}");
    assert!(h["fault"].is_null(), "{h}");
    assert_eq!(metric(addr, "scoria:fault").await, 0.0);
    // And the next request gets the bytes it got before the faults.
    drop(stall);
    let (status, after) = complete(addr).await;
    assert_eq!(status, 200, "{after}");
    assert_eq!(text(&after), text(&clean));
}
