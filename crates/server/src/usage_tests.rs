//! Issue 45, over HTTP: usage as each API defines it (streamed and not), what a
//! cancelled request did in its log line and the metrics, Responses custom (freeform)
//! tools end to end, and the conformance refusals. The engine is a scripted generator
//! that reports a fixed number of reused prompt tokens at admission; the prompt
//! cache across two Claude Code sessions runs on the real engine (the demo model).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{Completion, Flow, GenerateRequest, PromptProgress, TokenEvent};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::api_tests::{greedy, info, post, tokenizer};
use crate::gen::Core;
use crate::metrics::Stats;
use crate::prompt::{ChatMl, PromptRender};
use crate::settings::RequestDefaults;
use crate::test_http::{request, Reply};
use crate::worker::testing::Scripted;
use crate::worker::{Generator, JobSink, Worker, BUDGET_CLOSE_TEXT};
use crate::AppState;

/// Reports `cached` reused prompt tokens at admission (at most all but one), then
/// generates `inner`'s script, `delay` per token.
struct Cached {
    inner: Scripted,
    cached: usize,
    delay: Duration,
}

impl Generator for Cached {
    fn generate(
        &mut self,
        req: &GenerateRequest,
        on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
        on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
    ) -> Result<Completion, String> {
        let delay = self.delay;
        let mut c = self.inner.generate(req, on_prompt, &mut |t| {
            std::thread::sleep(delay);
            on_token(t)
        })?;
        let cached = self.cached.min(req.prompt.len() - 1);
        c.timings.cache_n = cached;
        c.timings.prompt_n = req.prompt.len() - cached;
        Ok(c)
    }

    fn submit(&mut self, req: GenerateRequest, mut sink: Box<JobSink>) {
        let cached = self.cached.min(req.prompt.len() - 1);
        engine::RequestCallbacks::admitted(sink.as_mut(), 0, cached);
        let cell = std::cell::RefCell::new(sink.as_mut());
        let r = self.generate(
            &req,
            &mut |p| engine::RequestCallbacks::prompt(&mut **cell.borrow_mut(), p),
            &mut |t| engine::RequestCallbacks::token(&mut **cell.borrow_mut(), t),
        );
        sink.finish(r);
    }
}

/// Remembers the last prompt text it renders.
struct Recording(Arc<Mutex<String>>);

impl PromptRender for Recording {
    fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        enable_thinking: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String, String> {
        let t = ChatMl.render(messages, tools, enable_thinking, extra)?;
        *self.0.lock().unwrap() = t.clone();
        Ok(t)
    }
}

struct Running {
    addr: SocketAddr,
    lines: Arc<Mutex<Vec<String>>>,
    prompt: Arc<Mutex<String>>,
}

impl Running {
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

const CACHED: usize = 7;

/// A server whose "model" writes `script` (then end-of-turn), `delay` per token,
/// reusing [`CACHED`] prompt tokens.
async fn serve(script: &str, delay: Duration) -> Running {
    let defaults = RequestDefaults {
        enable_thinking: false,
        ..greedy()
    };
    serve_with(script, delay, defaults).await
}

async fn serve_with(script: &str, delay: Duration, defaults: RequestDefaults) -> Running {
    let tok = tokenizer();
    let eog = tok.token_id("<|im_end|>").expect("im_end");
    let mut ids = tok.encode(script, true).expect("encode");
    ids.push(eog);
    let stats = Arc::new(Stats::new());
    let gen = Cached {
        inner: Scripted { script: ids, eog },
        cached: CACHED,
        delay,
    };
    let worker = Worker::spawn(Box::new(gen), stats.clone()).expect("worker");
    let prompt = Arc::new(Mutex::new(String::new()));
    let core = Core {
        worker,
        defaults,
        renderer: Arc::new(Recording(prompt.clone())),
        think_open_id: tok.token_id("<think>"),
        think_close_id: tok.token_id("</think>"),
        close_tokens: tok.encode(BUDGET_CLOSE_TEXT, true).expect("encode"),
        close_short: tok.encode("\n</think>\n\n", true).expect("encode"),
        keepalive: crate::gen::KEEPALIVE,
        backlog: crate::gen::BACKLOG,
        vision: None,
        image_limits: Default::default(),
    };
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    let state = AppState::new(
        stats,
        info(),
        tok,
        None,
        json!({}),
        None,
        "test-model".into(),
    )
    .with_core(core)
    .with_access_log(Arc::new(move |l: &str, _| {
        sink.lock().unwrap().push(l.to_string())
    }));
    let addr = crate::test_server::serve_state(state).await;
    Running {
        addr,
        lines,
        prompt,
    }
}

/// SSE frames as (event name, data as JSON).
fn events(r: &Reply) -> Vec<(String, Value)> {
    r.frames()
        .into_iter()
        .filter(|(_, d)| d.starts_with('{'))
        .map(|(e, d)| {
            (
                e.unwrap_or_default(),
                serde_json::from_str(&d).expect("json"),
            )
        })
        .collect()
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

// ---- 2. usage as each API defines it --------------------------------------------

#[tokio::test]
async fn anthropic_usage_excludes_cached_tokens_from_input_streamed_and_not() {
    let s = serve("Hello there.", Duration::ZERO).await;
    let body = json!({"model": "m", "max_tokens": 50, "messages": user("say hello to me")});
    let r = post(s.addr, "/v1/messages", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let u = &r.json()["usage"];
    let prompt = u["input_tokens"].as_u64().unwrap() + CACHED as u64;
    assert_eq!(u["cache_read_input_tokens"], CACHED, "{u}");
    assert_eq!(u["cache_creation_input_tokens"], 0, "{u}");
    assert!(u["output_tokens"].as_u64().unwrap() > 0, "{u}");

    let mut body = body;
    body["stream"] = json!(true);
    let r = post(s.addr, "/v1/messages", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let ev = events(&r);
    let start = &ev
        .iter()
        .find(|(e, _)| e == "message_start")
        .expect("start")
        .1;
    let su = &start["message"]["usage"];
    assert_eq!(su["cache_read_input_tokens"], CACHED, "{su}");
    assert_eq!(su["cache_creation_input_tokens"], 0, "{su}");
    assert_eq!(
        su["input_tokens"].as_u64().unwrap() + CACHED as u64,
        prompt,
        "{su}"
    );
    let delta = &ev
        .iter()
        .find(|(e, _)| e == "message_delta")
        .expect("delta")
        .1;
    let du = &delta["usage"];
    assert_eq!(du["cache_read_input_tokens"], CACHED, "{du}");
    assert_eq!(du["cache_creation_input_tokens"], 0, "{du}");
    assert_eq!(du["input_tokens"], su["input_tokens"], "{du}");
    assert_eq!(du["output_tokens"], u["output_tokens"], "{du}");
    // message_start comes first, then ping.
    assert_eq!(ev[0].0, "message_start");
}

#[tokio::test]
async fn openai_usage_counts_cached_tokens_inside_the_prompt() {
    let s = serve("Hello there.", Duration::ZERO).await;
    let body = json!({"model": "m", "messages": user("say hello to me")});
    let r = post(s.addr, "/v1/chat/completions", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let u = &r.json()["usage"];
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], CACHED, "{u}");
    let prompt = u["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > CACHED as u64, "{u}");
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        prompt + u["completion_tokens"].as_u64().unwrap()
    );

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let r = post(s.addr, "/v1/chat/completions", &sbody, "").await;
    let last = events(&r).pop().expect("usage chunk").1;
    assert_eq!(last["usage"]["prompt_tokens"], prompt, "{last}");
    assert_eq!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"],
        CACHED
    );

    let rbody = json!({"model": "m", "input": "say hello to me", "max_output_tokens": 20});
    let r = post(s.addr, "/v1/responses", &rbody, "").await;
    let u = &r.json()["usage"];
    assert_eq!(u["input_tokens_details"]["cached_tokens"], CACHED, "{u}");
    assert!(u["input_tokens"].as_u64().unwrap() > CACHED as u64, "{u}");
}

// ---- 3. a cancelled request is logged and counted with what it did -------------

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l[name.len()..].trim().parse().ok())
}

#[tokio::test]
async fn a_request_cancelled_mid_stream_is_logged_and_counted_with_what_it_did() {
    // 200 tokens, 20 ms each: the client leaves after some of them.
    let script = "word ".repeat(200);
    let s = serve(&script, Duration::from_millis(20)).await;
    let body = json!({"model": "m", "max_tokens": 500, "stream": true,
        "messages": user("write a lot")})
    .to_string();
    let mut sock = tokio::net::TcpStream::connect(s.addr)
        .await
        .expect("connect");
    let req = format!(
        "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.expect("write");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("text_delta").count() < 5 {
        let n = tokio::time::timeout(Duration::from_secs(10), sock.read(&mut buf))
            .await
            .expect("in time")
            .expect("read");
        assert!(n > 0, "closed: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    drop(sock);
    let line = s
        .line_with(&["POST /v1/messages 200", "client disconnected mid-response"])
        .await;
    assert!(line.contains(&format!("cached={CACHED} ")), "{line}");
    let generated: usize = line
        .split(" generated=")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!((5..200).contains(&generated), "{line}");
    // The metrics count the reused prompt and the tokens made before it stopped.
    let t0 = Instant::now();
    loop {
        let m = request(s.addr, "GET", "/metrics", "", None).await.body;
        if m.contains("finish=\"cancelled\"") {
            assert_eq!(
                metric(&m, "scoria:prompt_tokens_cached_total"),
                Some(CACHED as f64),
                "{m}"
            );
            let predicted = metric(&m, "llamacpp:tokens_predicted_total").expect("predicted");
            assert!(predicted >= 5.0, "{m}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---- 4. Responses custom (freeform) tools ---------------------------------------

const PATCH: &str = "*** Begin Patch\n*** Add File: hello.txt\n+hi \"there\"\n*** End Patch";

fn patch_call() -> String {
    format!("<tool_call>\n<function=apply_patch>\n<parameter=input>\n{PATCH}\n</parameter>\n</function>\n</tool_call>")
}

fn custom_tools() -> Value {
    json!([
        {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"*** Begin Patch\" /(.|\\n)*/"}},
        {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
    ])
}

#[tokio::test]
async fn a_custom_tool_is_offered_and_its_call_comes_back_with_the_raw_input() {
    let s = serve(&patch_call(), Duration::ZERO).await;
    let body = json!({"model": "m", "input": "add hello.txt", "tools": custom_tools()});
    let r = post(s.addr, "/v1/responses", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    // The template saw it, with its grammar.
    let prompt = s.prompt.lock().unwrap().clone();
    assert!(prompt.contains("\"apply_patch\""), "{prompt}");
    assert!(prompt.contains("lark grammar"), "{prompt}");
    let v = r.json();
    let call = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "custom_tool_call")
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(call["name"], "apply_patch");
    assert_eq!(call["input"], PATCH);
    assert!(call["call_id"].as_str().is_some_and(|c| !c.is_empty()));
    assert_eq!(v["tools"], custom_tools(), "tools echoed as sent");

    // Streamed: the input's delta and done events, and the item.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = post(s.addr, "/v1/responses", &sbody, "").await;
    let ev = events(&r);
    let kinds: Vec<&str> = ev.iter().map(|(e, _)| e.as_str()).collect();
    assert!(
        !kinds.contains(&"response.function_call_arguments.delta"),
        "{kinds:?}"
    );
    let delta: String = ev
        .iter()
        .filter(|(e, _)| e == "response.custom_tool_call_input.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(delta, PATCH);
    let done = &ev
        .iter()
        .find(|(e, _)| e == "response.custom_tool_call_input.done")
        .expect("input done")
        .1;
    assert_eq!(done["input"], PATCH);
    let item = &ev
        .iter()
        .find(|(e, d)| e == "response.output_item.done" && d["item"]["type"] == "custom_tool_call")
        .expect("item done")
        .1["item"];
    assert_eq!(item["input"], PATCH);
    let completed = &ev.last().unwrap().1["response"]["output"];
    assert!(
        completed
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["type"] == "custom_tool_call" && i["input"] == PATCH),
        "{completed}"
    );

    // The call and its output go back to the template in the next turn.
    let next = json!({"model": "m", "tools": custom_tools(), "input": [
        {"role": "user", "content": "add hello.txt"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"}
    ]});
    let r = post(s.addr, "/v1/responses", &next, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = s.prompt.lock().unwrap().clone();
    assert!(
        prompt.contains("Done!") && prompt.contains("Begin Patch"),
        "{prompt}"
    );
}

#[tokio::test]
async fn tool_choice_custom_forces_that_custom_tool() {
    let s = serve(&patch_call(), Duration::ZERO).await;
    let body = json!({"model": "m", "input": "add hello.txt", "tools": custom_tools(),
        "tool_choice": {"type": "custom", "name": "apply_patch"}});
    let r = post(s.addr, "/v1/responses", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(
        v["tool_choice"],
        json!({"type": "custom", "name": "apply_patch"})
    );
    assert!(
        v["output"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["type"] == "custom_tool_call"),
        "{v}"
    );
    // A name that is no custom tool, and a custom tool without a usable format.
    let mut bad = body.clone();
    bad["tool_choice"] = json!({"type": "custom", "name": "shell"});
    let r = post(s.addr, "/v1/responses", &bad, "").await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("no custom tool named"), "{}", r.body);
    let bad = json!({"model": "m", "input": "x",
        "tools": [{"type": "custom", "name": "t", "format": {"type": "regex"}}]});
    let r = post(s.addr, "/v1/responses", &bad, "").await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("tools[0].format.type"), "{}", r.body);
}

// ---- 5. conformance -------------------------------------------------------------

async fn refused(addr: SocketAddr, path: &str, body: &str, needle: &str) {
    let r = request(addr, "POST", path, "", Some(body)).await;
    assert_eq!(r.status, 400, "{path} {body}: {}", r.body);
    let msg = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(msg.contains(needle), "{path} {body}: {msg}");
}

#[tokio::test]
async fn conformance_refusals_name_the_field_and_the_remedy() {
    let s = serve("ok", Duration::ZERO).await;
    let a = s.addr;
    let msgs = user("hi").to_string();
    // stream_options without stream.
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = if path == "/v1/completions" {
            r#"{"prompt": "hi", "stream_options": {"include_usage": true}}"#.to_string()
        } else {
            format!(r#"{{"messages": {msgs}, "stream_options": {{"include_usage": true}}}}"#)
        };
        refused(
            a,
            path,
            &body,
            "stream_options is only allowed with stream: true",
        )
        .await;
    }
    // ... while with stream it is fine, and null is no option.
    let body = json!({"messages": user("hi"), "stream_options": null});
    assert_eq!(post(a, "/v1/chat/completions", &body, "").await.status, 200);
    // A parameter schema that is not an object.
    let body = format!(
        r#"{{"messages": {msgs}, "tools": [{{"type": "function", "function": {{"name": "f", "parameters": "{{}}"}}}}]}}"#
    );
    refused(
        a,
        "/v1/chat/completions",
        &body,
        "tools[0].function.parameters must be a JSON Schema object",
    )
    .await;
    let body =
        r#"{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": [1]}]}"#;
    refused(
        a,
        "/v1/responses",
        body,
        "tools[0].parameters must be a JSON Schema object",
    )
    .await;
    let body = format!(
        r#"{{"max_tokens": 5, "messages": {msgs}, "tools": [{{"name": "f", "input_schema": 3}}]}}"#
    );
    refused(
        a,
        "/v1/messages",
        &body,
        "tools[0].input_schema must be a JSON Schema object",
    )
    .await;
    // response_format as a bare string.
    let body = format!(r#"{{"messages": {msgs}, "response_format": "json"}}"#);
    refused(
        a,
        "/v1/chat/completions",
        &body,
        "response_format must be an object such as {\"type\": \"json_object\"}",
    )
    .await;
    // Anthropic requires max_tokens.
    let body = format!(r#"{{"messages": {msgs}}}"#);
    refused(a, "/v1/messages", &body, "max_tokens is required").await;
    let body = format!(r#"{{"max_tokens": null, "messages": {msgs}}}"#);
    refused(a, "/v1/messages", &body, "max_tokens is required").await;
    // A lone surrogate.
    let body = r#"{"messages": [{"role": "user", "content": "cut \ud800 here"}]}"#;
    refused(a, "/v1/chat/completions", body, "lone UTF-16 surrogate").await;
    let body = r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "\udc00"}]}"#;
    refused(a, "/v1/messages", body, "line 1 column").await;
}

#[tokio::test]
async fn responses_echo_sampling_values_as_sent() {
    let s = serve("ok", Duration::ZERO).await;
    let body = json!({"model": "m", "input": "hi", "temperature": 0.6, "top_p": 0.9});
    let r = post(s.addr, "/v1/responses", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("\"temperature\":0.6,"), "{}", r.body);
    assert!(r.body.contains("\"top_p\":0.9,"), "{}", r.body);
    assert_eq!(crate::responses::decimal(0.95), 0.95);
    assert_eq!(crate::responses::decimal(1e-5), 1e-5);
}

/// A forced call the budget cuts off: reported as truncated on every route, never
/// as a complete call with `{}` nor as markup in the answer text.
#[tokio::test]
async fn a_forced_tool_call_cut_by_max_tokens_is_reported_as_truncated() {
    let script = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>";
    let s = serve(script, Duration::ZERO).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]);
    let tok = tokenizer();
    let n = |t: &str| tok.encode(t, true).unwrap().len();
    // Cut inside the second parameter, inside the first, and inside the markup.
    let cuts = [
        n("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncel"),
        n("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"),
        n("<tool_call>\n<func"),
    ];
    for (k, &max) in cuts.iter().enumerate() {
        let body = json!({"model": "m", "messages": user("weather?"), "tools": tools,
            "tool_choice": "required", "max_tokens": max});
        let r = post(s.addr, "/v1/chat/completions", &body, "").await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "length", "{v}");
        let content = choice["message"]["content"].as_str().unwrap_or("");
        assert!(!content.contains('<'), "markup leaked: {v}");
        let calls = choice["message"]["tool_calls"].as_array();
        match k {
            0 => {
                let args = calls.expect("a call")[0]["function"]["arguments"]
                    .as_str()
                    .unwrap()
                    .to_string();
                assert_eq!(args, r#"{"city": "Paris""#, "{v}");
            }
            1 => {
                let args = &calls.expect("a call")[0]["function"]["arguments"];
                assert_ne!(args, "{}", "{v}");
            }
            _ => assert!(calls.is_none_or(|c| c.is_empty()), "{v}"),
        }
        // Anthropic: max_tokens, the parameters that were complete.
        let body = json!({"model": "m", "max_tokens": max, "messages": user("weather?"),
            "tools": [{"name": "get_weather", "input_schema": tools[0]["function"]["parameters"]}],
            "tool_choice": {"type": "any"}});
        let r = post(s.addr, "/v1/messages", &body, "").await;
        let v = r.json();
        assert_eq!(v["stop_reason"], "max_tokens", "{v}");
        for b in v["content"].as_array().unwrap() {
            assert!(!b["text"].as_str().unwrap_or("").contains('<'), "{v}");
        }
        if k == 0 {
            let tu = v["content"]
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["type"] == "tool_use");
            assert_eq!(
                tu.expect("tool_use")["input"],
                json!({"city": "Paris"}),
                "{v}"
            );
        }
        // Responses: incomplete, and so is the call.
        let body = json!({"model": "m", "input": "weather?", "max_output_tokens": max,
            "tools": [{"type": "function", "name": "get_weather", "parameters": tools[0]["function"]["parameters"]}],
            "tool_choice": "required"});
        for stream in [false, true] {
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let r = post(s.addr, "/v1/responses", &body, "").await;
            let v = if stream {
                events(&r).pop().unwrap().1["response"].clone()
            } else {
                r.json()
            };
            assert_eq!(v["status"], "incomplete", "{v}");
            for item in v["output"].as_array().unwrap() {
                if item["type"] == "function_call" {
                    assert_eq!(item["status"], "incomplete", "{v}");
                }
                if item["type"] == "message" {
                    let t = item["content"][0]["text"].as_str().unwrap_or("");
                    assert!(!t.contains('<'), "{v}");
                }
            }
        }
    }
}

// ---- 1. two Claude Code sessions share the cached prefix (real engine) ----------

/// A server over the demo engine with the Qwen3.5 template.
async fn demo_server(strip: bool) -> SocketAddr {
    let path = model::synth::synthetic_demo_path().expect("demo model");
    let engine = engine::Engine::load(
        &path,
        &engine::EngineConfig {
            max_context: Some(2048),
            device: Some(engine::Device::Cpu),
            ..Default::default()
        },
    )
    .expect("load the demo model");
    let stats = Arc::new(Stats::new());
    let defaults = RequestDefaults {
        strip_session_noise: strip,
        ..greedy()
    };
    let loaded = crate::core_for(engine, defaults, stats.clone()).expect("core");
    let state = AppState::new(
        stats,
        loaded.info,
        loaded.tokenizer,
        loaded.template,
        json!({}),
        None,
        "demo".into(),
    )
    .with_core(loaded.core);
    crate::test_server::serve_state(state).await
}

/// A Claude Code session's first request: the billing header (its suffix differs
/// per session) as the first system block, then the system prompt.
fn first_request(suffix: &str) -> Value {
    first_request_with(suffix, "Read hello.txt and tell me what it says.")
}

fn first_request_with(suffix: &str, prompt: &str) -> Value {
    let system = "You are Claude Code, a coding agent. ".repeat(12);
    json!({"model": "claude-sonnet-4-5", "max_tokens": 1, "temperature": 0,
        "system": [
            {"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;")},
            {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}
        ],
        "tools": [{"name": "Read", "description": "Reads a file.", "input_schema":
            {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}]})
}

async fn usage_of(addr: SocketAddr, body: &Value) -> Value {
    let r = post(addr, "/v1/messages", body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["usage"].clone()
}

#[tokio::test]
async fn a_second_claude_code_session_reuses_the_first_sessions_cached_prefix() {
    let addr = demo_server(true).await;
    let first = usage_of(addr, &first_request("f2f")).await;
    assert_eq!(first["cache_read_input_tokens"], 0, "{first}");
    let prompt = first["input_tokens"].as_u64().unwrap();
    let second = usage_of(addr, &first_request("58e")).await;
    let cached = second["cache_read_input_tokens"].as_u64().unwrap();
    // The prompts are the same once the header is gone: all of it but the last
    // position or so is reused.
    assert_eq!(
        second["input_tokens"].as_u64().unwrap() + cached,
        prompt,
        "{second}"
    );
    assert!(
        cached > 0 && cached + 8 >= prompt,
        "{cached} of {prompt}: {second}"
    );
    // A third session with its own first prompt (as real sessions have) reuses the
    // system prompt and tools: everything before its user turn.
    let third = first_request_with("0c4", "Summarize hello.txt in five words.");
    let u = usage_of(addr, &third).await;
    let (cached, fresh) = (
        u["cache_read_input_tokens"].as_u64().unwrap(),
        u["input_tokens"].as_u64().unwrap(),
    );
    assert!(cached > 0 && fresh < 40 && fresh < cached / 4, "{u}");

    // With the setting off the header's suffix splits the prompts near the start.
    let addr = demo_server(false).await;
    let first = usage_of(addr, &first_request("f2f")).await;
    let prompt = first["input_tokens"].as_u64().unwrap();
    let second = usage_of(addr, &first_request("58e")).await;
    let cached = second["cache_read_input_tokens"].as_u64().unwrap();
    assert!(cached < prompt / 4, "{cached} of {prompt}: {second}");
}
