//! Tests for the defects issue 9 lists (a client run and a newcomer's first hour), over
//! HTTP with the real Qwen3.5 tokenizer and a scripted backend (see `api_tests.rs`).

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::api_tests::{greedy, info, post, tokenizer};
use crate::gen::Core;
use crate::metrics::Stats;
use crate::prompt::{ChatMl, PromptRender};
use crate::settings::RequestDefaults;
use crate::test_http::request;
use crate::worker::testing::Scripted;
use crate::worker::{Worker, BUDGET_CLOSE_TEXT};
use crate::AppState;

/// How a test server is built.
struct Setup {
    script: String,
    defaults: RequestDefaults,
    renderer: Arc<dyn PromptRender>,
    api_key: Option<String>,
    n_ctx: usize,
    settings: Value,
}

impl Setup {
    fn new(script: &str) -> Setup {
        Setup {
            script: script.to_string(),
            defaults: greedy(),
            renderer: Arc::new(ChatMl),
            api_key: None,
            n_ctx: info().n_ctx,
            settings: json!({}),
        }
    }

    fn state(self) -> AppState {
        let tok = tokenizer();
        let eog = tok.token_id("<|im_end|>").expect("im_end");
        let mut ids = tok.encode(&self.script, true).expect("encode");
        ids.push(eog);
        let stats = Arc::new(Stats::new());
        let worker =
            Worker::spawn(Box::new(Scripted { script: ids, eog }), stats.clone()).expect("worker");
        let core = Core {
            worker,
            defaults: self.defaults,
            renderer: self.renderer,
            think_open_id: tok.token_id("<think>"),
            think_close_id: tok.token_id("</think>"),
            close_tokens: tok.encode(BUDGET_CLOSE_TEXT, true).expect("encode"),
            close_short: tok.encode("\n</think>\n\n", true).expect("encode"),
            keepalive: crate::gen::KEEPALIVE,
        };
        let mut info = info();
        info.n_ctx = self.n_ctx;
        AppState::new(
            stats,
            info,
            tok,
            None,
            self.settings,
            self.api_key,
            "test-model".into(),
        )
        .with_core(core)
    }

    async fn serve(self) -> SocketAddr {
        serve_state(self.state()).await
    }
}

async fn serve_state(state: AppState) -> SocketAddr {
    let state = Arc::new(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, crate::app(state)).await;
    });
    addr
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

// 1. The budget is min(max_tokens, context - prompt): a default request on a small
// context must not think until the context is full and answer nothing.
#[tokio::test]
async fn default_request_leaves_room_to_answer_in_a_small_context() {
    // The script thinks far longer than the context, then answers.
    let script = format!("{}\n</think>\n\nThe answer.", "thinking ".repeat(3000));
    let mut setup = Setup::new(&script);
    setup.n_ctx = 1024;
    let addr = setup.serve().await;
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user("Hi")}),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let usage = &v["usage"];
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let completion = usage["completion_tokens"].as_u64().unwrap();
    // Never past the context.
    assert!(prompt + completion <= 1024, "{usage}");
    // The think block was closed in time and an answer followed.
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.is_empty(), "{v}");
    let reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
        .as_u64()
        .unwrap();
    assert!(reasoning < completion, "{usage}");
}

// 5. /health says what the server does, and keeps the settings and the file's path
// behind the key.
#[tokio::test]
async fn health_tells_the_truth_and_keeps_settings_behind_the_key() {
    let mut setup = Setup::new("ok");
    setup.api_key = Some("sekret".into());
    setup.settings = json!({"engine": {"temp": {"value": 0.6, "source": "default"}},
                            "server": {"model": {"value": "/secret/dir/m.gguf", "source": "command line"}}});
    let addr = setup.serve().await;
    let h = request(addr, "GET", "/health", "", None).await;
    assert_eq!(h.status, 200);
    assert!(!h.body.contains("/tmp/tiny.gguf"), "{}", h.body);
    assert!(!h.body.contains("/secret/dir"), "{}", h.body);
    let h = h.json();
    assert!(h.get("settings").is_none(), "{h}");
    let greedy = h["capabilities"]["greedy"].as_str().unwrap();
    assert!(!greedy.contains("absent"), "{greedy}");
    // Every tool_choice /health lists is accepted.
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]);
    for choice in h["capabilities"]["tools"]["tool_choice"].as_array().unwrap() {
        let choice = match choice.as_str().unwrap() {
            "named" => json!({"type": "function", "function": {"name": "f"}}),
            c => json!(c),
        };
        let r = post(
            addr,
            "/v1/chat/completions",
            &json!({"messages": user("q"), "tools": tools, "tool_choice": choice}),
            "Authorization: Bearer sekret\r\n",
        )
        .await;
        assert_eq!(r.status, 200, "tool_choice {choice}: {}", r.body);
    }
    // Behind the key: the settings, the path and the defaults.
    assert_eq!(request(addr, "GET", "/props", "", None).await.status, 401);
    let p = request(addr, "GET", "/props", "Authorization: Bearer sekret\r\n", None)
        .await
        .json();
    assert_eq!(p["model"]["path"], "/tmp/tiny.gguf");
    assert_eq!(p["capabilities"]["default_temperature"], 0.6);
    assert!(p["settings"]["server"]["model"].is_object());
}
