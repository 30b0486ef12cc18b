//! The HTTP layer every route shares, over HTTP with a scripted generator
//! (`test_server`): errors in the route family's own JSON shape (401, 404, 405, 413,
//! 400, and 503 while the model loads), CORS for browser clients, `/health` keeping
//! the settings and the file's path behind the key, and `GET /v1/models/{id}`.

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::json;

use crate::api_tests::post;
use crate::test_http::request;
use crate::test_server::{serve_state, user, Setup};

// /health says what the server does, and keeps the settings and the file's path
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
    for choice in h["capabilities"]["tools"]["tool_choice"]
        .as_array()
        .unwrap()
    {
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
    let p = request(
        addr,
        "GET",
        "/props",
        "Authorization: Bearer sekret\r\n",
        None,
    )
    .await
    .json();
    assert_eq!(p["model"]["path"], "/tmp/tiny.gguf");
    assert_eq!(p["capabilities"]["default_temperature"], 0.6);
    assert!(p["settings"]["server"]["model"].is_object());
}

// `GET /v1/models/{id}` (the SDKs' `models.retrieve`).
#[tokio::test]
async fn models_retrieve_answers_the_model_or_404() {
    let addr = Setup::new("ok").serve().await;
    let r = request(addr, "GET", "/v1/models/test-model", "", None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["id"], "test-model");
    assert_eq!(v["object"], "model");
    assert!(v["created"].is_u64() && v["owned_by"].is_string(), "{v}");
    let r = request(addr, "GET", "/v1/models/gpt-9", "", None).await;
    assert_eq!(r.status, 404);
    let v = r.json();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("gpt-9"),
        "{v}"
    );
    // An id with a slash (Hugging Face style aliases).
    let r = request(addr, "GET", "/v1/models/Qwen/Qwen3", "", None).await;
    assert_eq!(r.status, 404);
}

// Every error is JSON in the route's own shape.
#[tokio::test]
async fn every_error_is_json_in_the_routes_shape() {
    let mut setup = Setup::new("ok");
    setup.api_key = Some("sekret".into());
    let addr = setup.serve().await;
    let key = "Authorization: Bearer sekret\r\n";
    let anthropic = |r: &crate::test_http::Reply, ty: &str| {
        let v = r.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], ty, "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    };
    // 401 on /v1/messages in Anthropic's shape, on OpenAI routes in OpenAI's.
    let r = post(addr, "/v1/messages", &json!({"messages": user("q")}), "").await;
    assert_eq!(r.status, 401);
    anthropic(&r, "authentication_error");
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user("q")}),
        "",
    )
    .await;
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    // 405: a wrong method.
    let r = request(addr, "GET", "/v1/chat/completions", key, None).await;
    assert_eq!(r.status, 405);
    let v = r.json();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("POST"),
        "{v} {}",
        r.headers
    );
    assert_eq!(v["error"]["code"], "method_not_allowed");
    let r = request(addr, "GET", "/v1/messages", "x-api-key: sekret\r\n", None).await;
    assert_eq!(r.status, 405);
    anthropic(&r, "invalid_request_error");
    // 404 in the route family's shape.
    let r = request(
        addr,
        "GET",
        "/v1/messages/nope",
        "x-api-key: sekret\r\n",
        None,
    )
    .await;
    assert_eq!(r.status, 404);
    anthropic(&r, "not_found_error");
    // 413: announced larger than the limit (the server need not read it).
    let r = request_with_length(
        addr,
        "/v1/messages",
        "x-api-key: sekret\r\n",
        crate::BODY_LIMIT + 1,
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.body);
    anthropic(&r, "request_too_large");
    let r = request_with_length(addr, "/v1/chat/completions", key, crate::BODY_LIMIT + 1).await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    // No Rust debug text: a bad content value is shown as JSON.
    let r = post(
        addr,
        "/v1/messages",
        &json!({"max_tokens": 5, "messages": [{"role": "user", "content": 3}]}),
        "x-api-key: sekret\r\n",
    )
    .await;
    assert_eq!(r.status, 400);
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(!m.contains("Some(") && !m.contains("Number("), "{m}");
    let r = post(
        addr,
        "/v1/messages",
        &json!({"max_tokens": 5, "messages": user("q"), "thinking": {"type": "sometimes"}}),
        "x-api-key: sekret\r\n",
    )
    .await;
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(!m.contains("Some("), "{m}");
    // An unparsable tool-call argument in history names the field.
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"city\": Par"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"}]}),
        key,
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    assert_eq!(
        v["error"]["param"],
        "messages[1].tool_calls[0].function.arguments"
    );
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("messages[1].tool_calls[0].function.arguments"),
        "{m}"
    );
    assert!(!m.contains("template"), "{m}");
}

/// A POST whose Content-Length announces `len` bytes; sends only a few of them.
async fn request_with_length(
    addr: SocketAddr,
    path: &str,
    headers: &str,
    len: usize,
) -> crate::test_http::Reply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{headers}Content-Length: {len}\r\n\r\n{{\"messages\": ["
    );
    s.write_all(head.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut raw)).await;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a reply");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    crate::test_http::Reply {
        status,
        headers: head.to_ascii_lowercase(),
        body: body.to_string(),
    }
}

// CORS for browser clients: off unless configured, preflight answered before auth.
#[tokio::test]
async fn cors_is_off_by_default_and_preflight_precedes_auth() {
    let preflight = "Origin: https://app.example.com\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n";
    // Not configured: no CORS headers at all.
    let mut setup = Setup::new("ok");
    setup.api_key = Some("sekret".into());
    let addr = setup.serve().await;
    let r = request(addr, "OPTIONS", "/v1/chat/completions", preflight, None).await;
    assert!(
        !r.headers.contains("access-control-allow-origin"),
        "{}",
        r.headers
    );
    // Configured: the preflight is answered without the key, for that origin only.
    let mut setup = Setup::new("ok");
    setup.api_key = Some("sekret".into());
    let state = setup
        .state()
        .with_cors(vec!["https://app.example.com".into()]);
    let addr = serve_state(state).await;
    let r = request(addr, "OPTIONS", "/v1/chat/completions", preflight, None).await;
    assert!(r.status < 300, "{} {}", r.status, r.body);
    assert!(
        r.headers
            .contains("access-control-allow-origin: https://app.example.com"),
        "{}",
        r.headers
    );
    assert!(
        r.headers.contains("access-control-allow-headers"),
        "{}",
        r.headers
    );
    // The real request carries the header too, and so does a refusal (so the page can
    // read why).
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user("q")}),
        "Origin: https://app.example.com\r\nAuthorization: Bearer sekret\r\n",
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r
        .headers
        .contains("access-control-allow-origin: https://app.example.com"));
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user("q")}),
        "Origin: https://app.example.com\r\n",
    )
    .await;
    assert_eq!(r.status, 401);
    assert!(r
        .headers
        .contains("access-control-allow-origin: https://app.example.com"));
    // Another origin gets no grant.
    let r = request(
        addr,
        "OPTIONS",
        "/v1/chat/completions",
        &preflight.replace("app.example.com", "evil.example"),
        None,
    )
    .await;
    assert!(
        !r.headers.contains("access-control-allow-origin"),
        "{}",
        r.headers
    );
}

// While the model loads, refusals are in the route family's shape too.
#[tokio::test]
async fn loading_refusals_are_in_the_routes_shape() {
    let ready = Arc::new(std::sync::OnceLock::new());
    let gate = crate::startup::loading_gate(ready, std::time::Instant::now());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, gate).await;
    });
    let h = request(addr, "GET", "/health", "", None).await;
    assert_eq!(h.status, 503);
    assert_eq!(h.json()["status"], "loading");
    let r = post(addr, "/v1/messages", &json!({"messages": user("q")}), "").await;
    assert_eq!(r.status, 503);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "overloaded_error", "{v}");
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": user("q")}),
        "",
    )
    .await;
    assert_eq!(r.status, 503);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("loading"));
}
