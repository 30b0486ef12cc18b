//! The operations routes over real HTTP on a loopback port (no extra client
//! crate: a minimal HTTP/1.1 exchange with `Connection: close`).

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::json;

use crate::metrics::Stats;
use crate::test_http::{request, Reply};
use crate::AppState;

fn tokenizer() -> Arc<model::tokenizer::Tokenizer> {
    let parts = model::vocab::load(model::vocab::QwenVocab::Qwen35).expect("embedded vocab");
    Arc::new(model::tokenizer::Tokenizer::from_parts(parts).expect("tokenizer"))
}

fn info() -> engine::ModelInfo {
    engine::ModelInfo {
        arch: "qwen35moe".into(),
        name: "tiny".into(),
        path: "/tmp/tiny.gguf".into(),
        file_bytes: 1 << 20,
        n_ctx_train: 4096,
        n_ctx: 1024,
        n_vocab: 248_320,
        n_layer: 4,
        n_embd: 64,
        n_expert: 8,
        n_expert_used: 2,
        synthetic: true,
    }
}

fn state() -> Arc<AppState> {
    Arc::new(AppState::new(
        Arc::new(Stats::new()),
        info(),
        tokenizer(),
        None,
        json!({"engine": {"max-tokens-default": {"value": 512, "source": "default"}, "temp": {"value": null, "source": "default"}}}),
        None,
        "tiny-test".into(),
    ))
}

async fn serve(state: Arc<AppState>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = super::router().with_state(state);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

async fn call(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Reply {
    request(addr, method, path, "", body).await
}

#[tokio::test]
async fn health_reports_model_and_capabilities() {
    let addr = serve(state()).await;
    let r = call(addr, "GET", "/health", None).await;
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["model"]["id"], "tiny-test");
    assert_eq!(v["model"]["n_ctx"], 1024);
    assert_eq!(v["busy"], false);
    // The settings and the file's path are behind the key, in /props.
    assert!(v.get("settings").is_none(), "{v}");
    assert!(v["model"].get("path").is_none(), "{v}");
    assert!(v["capabilities"].get("max_tokens_default").is_none(), "{v}");
    let p = call(addr, "GET", "/props", None).await.json();
    assert_eq!(p["capabilities"]["max_tokens_default"], 512);
    assert_eq!(p["model"]["path"], "/tmp/tiny.gguf");
    let aliases = v["capabilities"]["token_budget_aliases"].to_string();
    assert!(aliases.contains("max_completion_tokens"));
    assert!(v["version"].is_string());
}

#[tokio::test]
async fn props_and_slots() {
    let st = state();
    let addr = serve(st.clone()).await;
    let p = call(addr, "GET", "/props", None).await.json();
    assert_eq!(p["total_slots"], 1);
    assert_eq!(p["default_generation_settings"]["n_ctx"], 1024);
    assert_eq!(p["model_alias"], "tiny-test");
    assert!(
        p["device"].is_null(),
        "no engine, no report: {}",
        p["device"]
    );
    st.stats.set_device(engine::DeviceReport {
        device: engine::Device::Cuda(0),
        name: "NVIDIA H200".into(),
        vram_used: Some(5 << 30),
        vram_total: Some(141 << 30),
    });
    let p = call(addr, "GET", "/props", None).await.json();
    assert_eq!(p["device"]["device"], "cuda:0");
    assert_eq!(p["device"]["name"], "NVIDIA H200");
    assert_eq!(p["device"]["vram_used_bytes"], 5u64 << 30);
    assert_eq!(p["device"]["vram_total_bytes"], 141u64 << 30);

    let s = call(addr, "GET", "/slots", None).await.json();
    assert_eq!(s[0]["is_processing"], false);
    assert_eq!(s[0]["id_task"], -1);
    st.stats.request_queued(5, "chat");
    st.stats.request_started(5, 10);
    st.stats.token_generated(5);
    let s = call(addr, "GET", "/slots", None).await.json();
    assert_eq!(s[0]["is_processing"], true);
    assert_eq!(s[0]["id_task"], 5);
    assert_eq!(s[0]["n_decoded"], 1);
}

#[tokio::test]
async fn tokenize_round_trip() {
    let addr = serve(state()).await;
    let text = "Hello, world! <|im_start|>user\nnaïve 数字";
    let body = json!({"content": text}).to_string();
    let r = call(addr, "POST", "/tokenize", Some(&body)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let tokens = r.json()["tokens"].clone();
    assert!(tokens.as_array().is_some_and(|a| a.len() > 3));
    let body = json!({"tokens": tokens}).to_string();
    let d = call(addr, "POST", "/detokenize", Some(&body)).await.json();
    assert_eq!(d["content"], text);

    let body = json!({"content": "hi there", "with_pieces": true}).to_string();
    let p = call(addr, "POST", "/tokenize", Some(&body)).await.json();
    let pieces: String = p["tokens"]
        .as_array()
        .expect("array")
        .iter()
        .map(|t| t["piece"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(pieces, "hi there");
    assert!(p["tokens"][0]["id"].is_u64());
}

#[tokio::test]
async fn bad_requests_name_the_field() {
    let addr = serve(state()).await;
    let r = call(addr, "POST", "/tokenize", Some("{not json")).await;
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("JSON")));
    let r = call(addr, "POST", "/tokenize", Some(r#"{"content": 3}"#)).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "content");
    let r = call(addr, "POST", "/detokenize", Some(r#"{"tokens": [1, -2]}"#)).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "tokens");
    let r = call(
        addr,
        "POST",
        "/detokenize",
        Some(r#"{"tokens": [999999999]}"#),
    )
    .await;
    assert_eq!(r.status, 400);
    let r = call(
        addr,
        "POST",
        "/tokenize",
        Some(r#"{"content": "x", "add_special": "yes"}"#),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "add_special");
}

#[tokio::test]
async fn metrics_text_and_counters() {
    let st = state();
    let addr = serve(st.clone()).await;
    let r = call(addr, "GET", "/metrics", None).await;
    assert_eq!(r.status, 200);
    assert!(r
        .headers
        .contains("content-type: text/plain; version=0.0.4"));
    for name in [
        "llamacpp:prompt_tokens_total",
        "llamacpp:prompt_seconds_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:tokens_predicted_seconds_total",
        "llamacpp:n_decode_total",
        "llamacpp:n_busy_slots_per_decode",
        "llamacpp:prompt_tokens_seconds",
        "llamacpp:predicted_tokens_seconds",
        "llamacpp:kv_cache_usage_ratio",
        "llamacpp:kv_cache_tokens",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "scoria:queue_depth",
        "scoria:errors_total",
        "scoria:prompt_tokens_cached_total",
    ] {
        assert!(r.body.contains(&format!("# TYPE {name} ")), "{name}");
    }
    st.stats.request_queued(1, "chat");
    st.stats.request_started(1, 8);
    st.stats.token_generated(1);
    let t = engine::Timings {
        prompt_n: 8,
        prompt_ms: 10.0,
        predicted_n: 1,
        predicted_ms: 5.0,
        cache_n: 0,
        experts: None,
        ..Default::default()
    };
    st.stats.request_finished(1, &t, "stop", 9);
    let r = call(addr, "GET", "/metrics", None).await;
    assert!(r.body.contains("\nllamacpp:tokens_predicted_total 1\n"));
    assert!(r
        .body
        .contains("scoria:requests_total{route=\"chat\",finish=\"stop\"} 1"));
}

#[tokio::test]
async fn stats_json_and_page() {
    let st = state();
    let addr = serve(st.clone()).await;
    st.stats.request_queued(1, "chat");
    st.stats.request_queued(2, "chat");
    st.stats.request_started(1, 4);
    st.stats.token_generated(1);
    st.stats.token_generated(1);
    let v = call(addr, "GET", "/stats.json", None).await.json();
    assert_eq!(v["state"], "decoding");
    assert_eq!(v["context"]["total"], 1024);
    assert_eq!(v["context"]["used"], 6);
    assert_eq!(v["queue"]["depth"], 1);
    assert_eq!(v["totals"]["tokens_predicted"], 2);
    assert!(v["gpu"]["present"].is_boolean());
    assert_eq!(v["model"]["arch"], "qwen35moe");
    assert!(v["device"].is_null());
    st.stats.set_device(engine::DeviceReport {
        device: engine::Device::Cpu,
        name: "cpu (avx512)".into(),
        vram_used: None,
        vram_total: None,
    });
    let v = call(addr, "GET", "/stats.json", None).await.json();
    assert_eq!(v["device"]["name"], "cpu (avx512)");
    assert_eq!(v["device"]["kind"], "cpu");

    let r = call(addr, "GET", "/", None).await;
    assert_eq!(r.status, 200);
    assert!(r.headers.contains("content-type: text/html"));
    assert!(r.body.contains("id=\"decode-tps\""));
}

#[tokio::test]
async fn several_slots_reach_props_slots_health_and_stats_json() {
    use crate::metrics::SlotView;
    let st = state();
    let addr = serve(st.clone()).await;
    st.stats.set_pool(256, 3, 256);
    for id in [1, 2, 3] {
        st.stats.request_queued(id, "chat");
    }
    st.stats.request_started(1, 4);
    st.stats.request_started(2, 8);
    st.stats.token_generated(1);
    st.stats.prompt_progress(2, 3);
    st.stats.set_slots(vec![
        SlotView {
            id: 0,
            busy: true,
            cached_tokens: 0,
            request: Some(2),
        },
        SlotView {
            id: 1,
            busy: true,
            cached_tokens: 0,
            request: Some(1),
        },
        SlotView {
            id: 2,
            busy: false,
            cached_tokens: 40,
            request: None,
        },
    ]);

    let p = call(addr, "GET", "/props", None).await.json();
    assert_eq!(p["total_slots"], 3);
    assert_eq!(p["default_generation_settings"]["n_ctx"], 256);
    assert!(p["capabilities"]["queue"]
        .as_str()
        .is_some_and(|q| q.contains("up to 3")));

    let h = call(addr, "GET", "/health", None).await.json();
    assert_eq!(h["in_flight"], 2);
    assert_eq!(h["queue_depth"], 1);

    let s = call(addr, "GET", "/slots", None).await.json();
    let slots = s.as_array().cloned().unwrap_or_default();
    assert_eq!(slots.len(), 3, "{s}");
    assert_eq!(slots[0]["id_task"], 2);
    assert_eq!(slots[0]["state"], "prompt");
    assert_eq!(slots[0]["n_prompt_tokens_processed"], 3);
    assert_eq!(slots[1]["id_task"], 1);
    assert_eq!(slots[1]["n_decoded"], 1);
    assert_eq!(slots[2]["is_processing"], false);
    assert_eq!(slots[2]["cached_tokens"], 40);
    for slot in &slots {
        assert_eq!(slot["n_ctx"], 256);
        assert_eq!(slot["queue_depth"], 1);
    }

    let v = call(addr, "GET", "/stats.json", None).await.json();
    assert_eq!(v["current"]["id"], 1);
    assert_eq!(v["current"]["slot"], 1);
    assert_eq!(v["live"][1]["id"], 2);
    assert_eq!(v["live"][1]["slot"], 0);
    assert_eq!(v["context"]["total"], 256);
    assert_eq!(v["context"]["used"], 5 + 3 + 40);
    assert_eq!(v["slots"][2]["n_ctx"], 256);

    let m = call(addr, "GET", "/metrics", None).await;
    assert!(
        m.body.contains("\nllamacpp:requests_processing 2\n"),
        "{}",
        m.body
    );
    assert!(m.body.contains("\nllamacpp:requests_deferred 1\n"));
    assert!(m.body.contains("\nllamacpp:kv_cache_tokens 48\n"));
    assert!(m.body.contains("\nllamacpp:kv_cache_usage_ratio 0.1875\n"));
}

#[tokio::test]
async fn apply_template_renders_the_prompt() {
    let tmpl = model::chat::ChatTemplate::new(model::chat::QWEN35_TEMPLATE).expect("template");
    let st = Arc::new(AppState::new(
        Arc::new(Stats::new()),
        info(),
        tokenizer(),
        Some(Arc::new(tmpl)),
        json!({}),
        None,
        "tiny-test".into(),
    ));
    let addr = serve(st).await;
    let body = json!({"messages": [{"role": "user", "content": "hi there"}]}).to_string();
    let r = call(addr, "POST", "/apply-template", Some(&body)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = r.json()["prompt"].as_str().unwrap_or("").to_string();
    assert!(
        prompt.contains("<|im_start|>user\nhi there<|im_end|>"),
        "{prompt:?}"
    );
    assert!(
        prompt.ends_with("<|im_start|>assistant\n<think>\n"),
        "{prompt:?}"
    );
    let body = json!({"messages": [{"role": "wizard", "content": "hi"}]}).to_string();
    let r = call(addr, "POST", "/apply-template", Some(&body)).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "messages[0].role");
    let h = call(addr, "GET", "/health", None).await.json();
    assert_eq!(h["capabilities"]["tools"]["tool_call_format"], "qwen3-xml");
    assert_eq!(h["capabilities"]["reasoning"]["template_thinks"], true);
}

#[tokio::test]
async fn apply_template_without_template_is_400() {
    let addr = serve(state()).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}]}).to_string();
    let r = call(addr, "POST", "/apply-template", Some(&body)).await;
    assert_eq!(r.status, 400);
}
