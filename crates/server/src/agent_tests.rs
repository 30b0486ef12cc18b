//! What real coding agents need from the server (Claude Code, Codex), over HTTP with
//! the real Qwen3.5 tokenizer and a scripted generator: a system message inside the
//! conversation, keep-alives and cancellation while a long prompt is read, the
//! reasoning efforts they send, `HEAD /`, and one log line per request with every
//! error counted. (The real clients themselves run in `scripts/agent-clients.sh`.)

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::api_tests::{greedy, info, post, qwen3, qwen35, tokenizer};
use crate::gen::Core;
use crate::metrics::Stats;
use crate::prompt::{ChatMl, PromptRender};
use crate::test_http::request;
use crate::worker::testing::{Scripted, SlowPrompt};
use crate::worker::{Generator, Worker, BUDGET_CLOSE_TEXT};
use crate::AppState;

/// Remembers every prompt text it renders (the last one is the request's).
struct Recording(Arc<dyn PromptRender>, Arc<Mutex<Vec<String>>>);

impl PromptRender for Recording {
    fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        enable_thinking: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String, String> {
        let r = self.0.render(messages, tools, enable_thinking, extra);
        if let Ok(t) = &r {
            self.1.lock().unwrap().push(t.clone());
        }
        r
    }
}

/// A running test server and what it exposes to the test.
struct Running {
    addr: SocketAddr,
    stats: Arc<Stats>,
    lines: Arc<Mutex<Vec<String>>>,
    prompts: Arc<Mutex<Vec<String>>>,
}

impl Running {
    fn last_prompt(&self) -> String {
        self.prompts
            .lock()
            .unwrap()
            .last()
            .cloned()
            .unwrap_or_default()
    }

    /// Waits (up to 5 s) for a log line containing every one of `parts`.
    async fn line_with(&self, parts: &[&str]) -> String {
        let t0 = Instant::now();
        loop {
            if let Some(l) = self
                .lines
                .lock()
                .unwrap()
                .iter()
                .find(|l| parts.iter().all(|p| l.contains(p)))
            {
                return l.clone();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "no log line with {parts:?}; lines: {:#?}",
                self.lines.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The tokens of `script` followed by end-of-turn.
fn scripted(script: &str) -> Scripted {
    let tok = tokenizer();
    let eog = tok.token_id("<|im_end|>").expect("im_end");
    let mut ids = tok.encode(script, true).expect("encode");
    ids.push(eog);
    Scripted { script: ids, eog }
}

async fn start_server(
    generator: Box<dyn Generator>,
    renderer: Arc<dyn PromptRender>,
    api_key: Option<&str>,
    keepalive: Duration,
) -> Running {
    let tok = tokenizer();
    let stats = Arc::new(Stats::new());
    let worker = Worker::spawn(generator, stats.clone()).expect("worker");
    let prompts = Arc::new(Mutex::new(Vec::new()));
    let core = Core {
        worker,
        defaults: greedy(),
        renderer: Arc::new(Recording(renderer, prompts.clone())),
        think_open_id: tok.token_id("<think>"),
        think_close_id: tok.token_id("</think>"),
        close_tokens: tok.encode(BUDGET_CLOSE_TEXT, true).expect("encode"),
        close_short: tok.encode("\n</think>\n\n", true).expect("encode"),
        keepalive,
        backlog: crate::gen::BACKLOG,
        vision: None,
        image_limits: Default::default(),
    };
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink_lines = lines.clone();
    let state = Arc::new(
        AppState::new(
            stats.clone(),
            info(),
            tok,
            None,
            json!({}),
            api_key.map(str::to_string),
            "test-model".into(),
        )
        .with_core(core)
        .with_access_log(Arc::new(move |l: &str, poll: bool| {
            let tag = if poll { "[poll] " } else { "" };
            sink_lines.lock().unwrap().push(format!("{tag}{l}"))
        })),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, crate::app(state)).await;
    });
    Running {
        addr,
        stats,
        lines,
        prompts,
    }
}

async fn simple(script: &str, renderer: Arc<dyn PromptRender>) -> Running {
    start_server(
        Box::new(scripted(script)),
        renderer,
        None,
        crate::gen::KEEPALIVE,
    )
    .await
}

/// Claude Code's request shape: a system message as `messages[1]`.
fn claude_code_body(stream: bool) -> Value {
    json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "stream": stream,
    "system": [{"type": "text", "text": "You are Claude Code."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "list the files"}]},
        {"role": "system", "content": "Available agent types for the Agent tool: general"},
        {"role": "user", "content": "go on"},
    ]})
}

// ---- 1. A system message inside the conversation -------------------------------

#[tokio::test]
async fn a_system_message_inside_messages_is_accepted_on_every_route() {
    // Qwen3.5's template refuses a system message after the first: it is folded into
    // the leading system message.
    let s = simple("ok", qwen35()).await;
    for stream in [false, true] {
        let r = post(s.addr, "/v1/messages", &claude_code_body(stream), "").await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let p = s.last_prompt();
    let first_user = p.find("<|im_start|>user").expect("a user turn");
    let agents = p.find("Available agent types").expect("the system text");
    assert!(agents < first_user, "folded into the system prompt: {p}");
    assert!(p.starts_with("<|im_start|>system\nYou are Claude Code.\n\nAvailable agent types"));
    let r = post(
        s.addr,
        "/v1/messages/count_tokens",
        &claude_code_body(false),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The OpenAI routes: a system / developer turn after a user turn.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "Mid-conversation note"},
            {"role": "user", "content": "again"}]}),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(s
        .last_prompt()
        .starts_with("<|im_start|>system\nMid-conversation note"));
    let r = post(
        s.addr,
        "/v1/responses",
        &json!({"instructions": "I", "input": [
            {"role": "user", "content": "hi"},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Dev note"}]},
            {"role": "user", "content": "again"}]}),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(s
        .last_prompt()
        .starts_with("<|im_start|>system\nI\n\nDev note"));

    // Qwen3's template renders a later system turn where it is: kept in place.
    let s = simple("ok", qwen3()).await;
    let r = post(s.addr, "/v1/messages", &claude_code_body(false), "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let p = s.last_prompt();
    assert!(
        p.contains("<|im_start|>user\nlist the files<|im_end|>\n<|im_start|>system\nAvailable agent types for the Agent tool: general<|im_end|>\n<|im_start|>user\ngo on"),
        "{p}"
    );
    // The built-in ChatML renderer too.
    let s = simple("ok", Arc::new(ChatMl)).await;
    let r = post(s.addr, "/v1/messages", &claude_code_body(true), "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(s
        .last_prompt()
        .contains("<|im_end|>\n<|im_start|>system\nAvailable agent types"));
}

#[tokio::test]
async fn a_system_message_must_still_be_text() {
    let s = simple("ok", qwen35()).await;
    let r = post(
        s.addr,
        "/v1/messages",
        &json!({"max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "image", "source": {}}]}]}),
        "",
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("messages[1].content[0]"), "{}", r.body);
    let r = post(
        s.addr,
        "/v1/messages",
        &json!({"max_tokens": 5, "messages": [{"role": "wizard", "content": "hi"}]}),
        "",
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("messages[0].role"), "{}", r.body);
}

// ---- 2. Keep-alives, progress and cancellation while the prompt is read ----------

/// A generator that takes `pieces` × `delay` to read any prompt, then answers "ok".
fn slow(pieces: usize, delay: Duration) -> (Box<dyn Generator>, Arc<AtomicUsize>) {
    let read = Arc::new(AtomicUsize::new(0));
    let b = SlowPrompt {
        inner: scripted("ok"),
        pieces,
        delay,
        pieces_read: read.clone(),
    };
    (Box::new(b), read)
}

/// (event, data) of every frame of an Anthropic stream.
fn anthropic_events(body: &str) -> Vec<(String, Value)> {
    crate::test_http::Reply {
        status: 200,
        headers: String::new(),
        body: body.to_string(),
    }
    .frames()
    .into_iter()
    .map(|(e, d)| (e.unwrap_or_default(), serde_json::from_str(&d).unwrap()))
    .collect()
}

#[tokio::test]
async fn streams_send_keepalives_their_clients_count_while_the_prompt_is_read() {
    let (b, _) = slow(10, Duration::from_millis(60));
    let s = start_server(b, qwen35(), None, Duration::from_millis(100)).await;
    // Anthropic, thinking on: empty thinking deltas in the block the reasoning then
    // continues (Claude Code's watchdog ignores `ping`, which its SDK drops).
    let r = post(s.addr, "/v1/messages", &claude_code_body(true), "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let ev = anthropic_events(&r.body);
    let starts: Vec<&Value> = ev
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, d)| d)
        .collect();
    assert_eq!(starts.len(), 1, "one block: {ev:?}");
    assert_eq!(starts[0]["content_block"]["type"], "thinking");
    let deltas: Vec<&str> = ev
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["thinking"].as_str().unwrap())
        .collect();
    let empty = deltas.iter().take_while(|t| t.is_empty()).count();
    assert!(empty >= 3, "keep-alives before the reasoning: {deltas:?}");
    assert_eq!(deltas[empty..].concat(), "ok");
    // No extra message_delta: Claude Code adds each one's usage to its totals.
    assert_eq!(ev.iter().filter(|(n, _)| n == "message_delta").count(), 1);
    assert_eq!(ev.last().unwrap().0, "message_stop");
    // Thinking off: the keep-alives open the text block the answer continues.
    let mut body = claude_code_body(true);
    body["thinking"] = json!({"type": "disabled"});
    let r = post(s.addr, "/v1/messages", &body, "").await;
    let ev = anthropic_events(&r.body);
    let kinds: Vec<&Value> = ev
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, d)| &d["content_block"]["type"])
        .collect();
    assert_eq!(kinds, vec!["text"], "{ev:?}");
    let text: Vec<&str> = ev
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert!(
        text.iter().take_while(|t| t.is_empty()).count() >= 3,
        "{text:?}"
    );
    assert_eq!(text.concat(), "ok");

    // Responses: `response.in_progress` again (Codex's parser drops SSE comments).
    let r = post(
        s.addr,
        "/v1/responses",
        &json!({"input": "hi", "stream": true}),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let names: Vec<String> = r
        .frames()
        .into_iter()
        .map(|f| f.0.unwrap_or_default())
        .collect();
    let first_item = names
        .iter()
        .position(|n| n == "response.output_item.added")
        .expect("an item");
    let progress = names[..first_item]
        .iter()
        .filter(|n| *n == "response.in_progress")
        .count();
    assert!(progress >= 4, "{names:?}");
    assert_eq!(names.last().map(String::as_str), Some("response.completed"));
    // Chat completions: SSE comments before the answer.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true});
    let r = post(s.addr, "/v1/chat/completions", &chat, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let first_answer = r.body.find("\"ok\"").expect("the answer");
    let comments = r.body[..first_answer].matches(": keep-alive\n\n").count();
    assert!(comments >= 3, "{}", r.body);
}

/// Sends `body` to `path` on a raw connection, reads until `until` is seen, waits
/// 300 ms more (the prompt is being read by then), and closes the connection.
async fn leave_early(addr: SocketAddr, path: &str, body: &Value, until: &str) {
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !until.is_empty() && !String::from_utf8_lossy(&seen).contains(until) {
        let n = tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf))
            .await
            .expect("reply in time")
            .expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(sock);
}

/// Waits until the stats log has a cancelled request (up to 5 s); returns its error.
async fn cancelled(stats: &Stats) -> String {
    let t0 = Instant::now();
    loop {
        let snap = stats.snapshot();
        if let Some(r) = snap["requests"]
            .as_array()
            .and_then(|l| l.iter().find(|r| r["finish"] == "cancelled"))
        {
            return r["error"].as_str().unwrap_or("").to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "not cancelled: {snap}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_client_that_leaves_during_the_prompt_stops_its_work() {
    // 100 pieces × 40 ms = 4 s of prompt; the client leaves after its first ping.
    let (b, read) = slow(100, Duration::from_millis(40));
    let s = start_server(b, qwen35(), None, Duration::from_millis(100)).await;
    leave_early(
        s.addr,
        "/v1/messages",
        &claude_code_body(true),
        "event: ping",
    )
    .await;
    let why = cancelled(&s.stats).await;
    assert!(why.contains("while the prompt was read"), "{why}");
    let n = read.load(Ordering::SeqCst);
    assert!(
        n < 30,
        "{n} of 100 prompt pieces were read after the client left"
    );
    s.line_with(&[
        "POST /v1/messages 200",
        "client disconnected before the first token",
    ])
    .await;
}

#[tokio::test]
async fn a_non_streaming_client_that_leaves_during_the_prompt_stops_its_work() {
    let (b, read) = slow(100, Duration::from_millis(40));
    let s = start_server(b, qwen35(), None, Duration::from_millis(100)).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    leave_early(s.addr, "/v1/chat/completions", &body, "").await;
    let why = cancelled(&s.stats).await;
    assert!(why.contains("while the prompt was read"), "{why}");
    let n = read.load(Ordering::SeqCst);
    assert!(
        n < 30,
        "{n} of 100 prompt pieces were read after the client left"
    );
    s.line_with(&[
        "POST /v1/chat/completions -",
        "client disconnected before the response",
    ])
    .await;
}

#[tokio::test]
async fn prompt_progress_shows_in_slots_and_stats() {
    let (b, _) = slow(20, Duration::from_millis(50));
    let s = start_server(b, qwen35(), None, Duration::from_millis(100)).await;
    let addr = s.addr;
    let req =
        tokio::spawn(async move { post(addr, "/v1/messages", &claude_code_body(false), "").await });
    let t0 = Instant::now();
    let (slot, current) = loop {
        let slots = request(addr, "GET", "/slots", "", None).await.json();
        let stats = request(addr, "GET", "/stats.json", "", None).await.json();
        let slot = slots[0].clone();
        let done = slot["n_prompt_tokens_processed"].as_u64().unwrap_or(0);
        let total = slot["n_prompt_tokens"].as_u64().unwrap_or(0);
        if done > 0 && done < total {
            break (slot, stats["current"].clone());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "no progress: {slots}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(slot["state"], "prompt", "{slot}");
    assert_eq!(current["state"], "prompt", "{current}");
    let done = current["prompt_done"].as_u64().unwrap();
    assert!(done > 0 && done < current["prompt_tokens"].as_u64().unwrap());
    assert_eq!(req.await.unwrap().status, 200);
}

// ---- 3. Reasoning efforts -----------------------------------------------------------

#[tokio::test]
async fn every_effort_clients_send_is_accepted_on_every_route() {
    let s = simple("ok", qwen35()).await;
    let msgs = json!([{"role": "user", "content": "q"}]);
    for effort in ["minimal", "xhigh", "max", "ultra"] {
        for (path, body) in [
            (
                "/v1/chat/completions",
                json!({"messages": msgs, "reasoning_effort": effort}),
            ),
            (
                "/v1/chat/completions",
                json!({"messages": msgs, "output_config": {"effort": effort}}),
            ),
            (
                "/v1/responses",
                json!({"input": "q", "reasoning": {"effort": effort}}),
            ),
            (
                "/v1/messages",
                json!({"max_tokens": 20, "messages": msgs, "output_config": {"effort": effort}}),
            ),
            (
                "/v1/messages",
                json!({"max_tokens": 20, "messages": msgs, "reasoning_effort": effort}),
            ),
        ] {
            let r = post(s.addr, path, &body, "").await;
            assert_eq!(r.status, 200, "{path} {body}: {}", r.body);
            if path == "/v1/responses" {
                assert_eq!(r.json()["reasoning"]["effort"], effort);
            }
        }
    }
    let r = post(
        s.addr,
        "/v1/responses",
        &json!({"input": "q", "reasoning": {"effort": "colossal"}}),
        "",
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(
        r.body.contains("ultra"),
        "the message lists the values: {}",
        r.body
    );
}

// ---- 4. HEAD / -----------------------------------------------------------------------

#[tokio::test]
async fn head_root_is_answered_as_get_without_the_key() {
    let s = start_server(
        Box::new(scripted("ok")),
        qwen35(),
        Some("sekret"),
        crate::gen::KEEPALIVE,
    )
    .await;
    let get = request(s.addr, "GET", "/", "", None).await;
    assert_eq!(get.status, 200);
    let head = request(s.addr, "HEAD", "/", "", None).await;
    assert_eq!(head.status, 200, "{}", head.headers);
    assert!(head.body.is_empty());
    assert!(
        head.headers.contains("content-type: text/html"),
        "{}",
        head.headers
    );
    // Everything else still needs the key.
    assert_eq!(
        request(s.addr, "HEAD", "/v1/models", "", None).await.status,
        401
    );
    assert_eq!(request(s.addr, "GET", "/slots", "", None).await.status, 401);
}

// ---- 5. One log line per request; errors counted ------------------------------------

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l[name.len()..].trim().parse().ok())
}

#[tokio::test]
async fn every_request_is_logged_once_and_errors_are_counted() {
    let s = start_server(
        Box::new(scripted("ok")),
        qwen35(),
        Some("k"),
        crate::gen::KEEPALIVE,
    )
    .await;
    let key = "x-api-key: k\r\n";
    // A 400: logged with its message, counted.
    let r = post(
        s.addr,
        "/v1/messages",
        &json!({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "q"}]}),
        key,
    )
    .await;
    assert_eq!(r.status, 400);
    let l = s.line_with(&["POST /v1/messages 400"]).await;
    assert!(l.contains("temperature"), "{l}");
    // A 401 and a 404.
    assert_eq!(
        post(s.addr, "/v1/messages", &json!({}), "").await.status,
        401
    );
    s.line_with(&["POST /v1/messages 401", "API key"]).await;
    assert_eq!(
        request(s.addr, "GET", "/nowhere", key, None).await.status,
        404
    );
    s.line_with(&["GET /nowhere 404"]).await;
    // A generation: its tokens.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "q"}]}),
        key,
    )
    .await;
    assert_eq!(r.status, 200);
    let l = s.line_with(&["POST /v1/chat/completions 200"]).await;
    let usage = &r.json()["usage"];
    assert!(
        l.contains(&format!(
            "prompt={} cached=0 generated={} finish=end_of_turn",
            usage["prompt_tokens"], usage["completion_tokens"]
        )),
        "{l}"
    );
    // A stream, to its end.
    let r = post(
        s.addr,
        "/v1/messages",
        &json!({"max_tokens": 5, "stream": true, "messages": [{"role": "user", "content": "q"}]}),
        key,
    )
    .await;
    assert_eq!(r.status, 200);
    let l = s.line_with(&["POST /v1/messages 200"]).await;
    assert!(!l.contains("disconnected"), "{l}");
    assert!(l.contains("finish="), "{l}");

    let text = request(s.addr, "GET", "/metrics", key, None).await.body;
    assert_eq!(metric(&text, "scoria:errors_total"), Some(3.0), "{text}");
    assert_eq!(
        metric(
            &text,
            "scoria:http_errors_total{route=\"/v1/messages\",status=\"400\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "scoria:http_errors_total{route=\"/v1/messages\",status=\"401\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "scoria:http_errors_total{route=\"unmatched\",status=\"404\"}"
        ),
        Some(1.0),
        "{text}"
    );
    // One line per request: the five above, and the /metrics call, marked as a poll.
    let l = s.line_with(&["GET /metrics 200"]).await;
    assert!(l.starts_with("[poll] "), "{l}");
    let lines = s.lines.lock().unwrap().clone();
    let api: Vec<&String> = lines.iter().filter(|l| !l.contains("/metrics")).collect();
    assert_eq!(api.len(), 5, "{lines:#?}");
    assert!(api.iter().all(|l| !l.starts_with("[poll]")), "{api:#?}");
}
