//! The API routes end to end over HTTP, with the real Qwen3.5 tokenizer and a scripted
//! generator in place of the engine (the script is the text a model "generates").

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use serde_json::{json, Value};

use crate::gen::Core;
use crate::metrics::Stats;
use crate::prompt::{ChatMl, PromptRender, TemplateRenderer};
use crate::settings::RequestDefaults;
use crate::test_http::{request, Reply};
use crate::test_server::Setup;
use crate::worker::testing::Scripted;
use crate::worker::{Worker, BUDGET_CLOSE_TEXT};
use crate::AppState;

pub(crate) fn tokenizer() -> Arc<model::tokenizer::Tokenizer> {
    static TOK: OnceLock<Arc<model::tokenizer::Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let parts = model::vocab::load(model::vocab::QwenVocab::Qwen35).expect("embedded vocab");
        Arc::new(model::tokenizer::Tokenizer::from_parts(parts).expect("tokenizer"))
    })
    .clone()
}

pub(crate) fn info() -> engine::ModelInfo {
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

/// A server whose "model" generates `script` (then end-of-turn).
async fn server(script: &str, api_key: Option<&str>, defaults: RequestDefaults) -> SocketAddr {
    server_with(script, api_key, defaults, Arc::new(ChatMl)).await
}

async fn server_with(
    script: &str,
    api_key: Option<&str>,
    defaults: RequestDefaults,
    renderer: Arc<dyn PromptRender>,
) -> SocketAddr {
    let tok = tokenizer();
    let eog = tok.token_id("<|im_end|>").expect("im_end");
    let mut ids = tok.encode(script, true).expect("encode");
    ids.push(eog);
    let stats = Arc::new(Stats::new());
    let worker =
        Worker::spawn(Box::new(Scripted { script: ids, eog }), stats.clone()).expect("worker");
    let core = Core {
        worker,
        defaults,
        renderer,
        think_open_id: tok.token_id("<think>"),
        think_close_id: tok.token_id("</think>"),
        close_tokens: tok.encode(BUDGET_CLOSE_TEXT, true).expect("encode"),
        close_short: tok.encode("\n</think>\n\n", true).expect("encode"),
        keepalive: crate::gen::KEEPALIVE,
        backlog: crate::gen::BACKLOG,
        vision: None,
        image_limits: Default::default(),
    };
    let state = Arc::new(
        AppState::new(
            stats,
            info(),
            tok,
            None,
            json!({}),
            api_key.map(str::to_string),
            "test-model".into(),
        )
        .with_core(core),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, crate::app(state)).await;
    });
    addr
}

pub(crate) fn greedy() -> RequestDefaults {
    RequestDefaults {
        temp: 0.0,
        ..RequestDefaults::default()
    }
}

pub(crate) async fn post(addr: SocketAddr, path: &str, body: &Value, headers: &str) -> Reply {
    request(addr, "POST", path, headers, Some(&body.to_string())).await
}

const XML_CALL: &str = "I should check.\n</think>\n\nLet me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>";

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "w",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

#[tokio::test]
async fn chat_splits_reasoning_content_and_tool_calls() {
    let addr = server(XML_CALL, None, greedy()).await;
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": weather_tools()}),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "I should check.");
    assert_eq!(m["content"], "Let me look.");
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(
        m["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(
        v["usage"]["total_tokens"].as_u64().unwrap(),
        v["usage"]["prompt_tokens"].as_u64().unwrap()
            + v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for k in [
        "prompt_n",
        "prompt_ms",
        "prompt_per_token_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_token_ms",
        "predicted_per_second",
        "cache_n",
    ] {
        assert!(v["timings"].get(k).is_some(), "timings.{k}");
    }
}

#[tokio::test]
async fn chat_stream_framing() {
    let addr = server(XML_CALL, None, greedy()).await;
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "w?"}], "tools": weather_tools(),
                "stream": true, "stream_options": {"include_usage": true}}),
        "",
    )
    .await;
    assert_eq!(r.status, 200);
    let frames = r.frames();
    assert_eq!(frames.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str(&f.1).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut args = String::new();
    let mut name = None;
    let mut finish = None;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(ch) = c["choices"].get(0) {
            let d = &ch["delta"];
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(d["content"].as_str().unwrap_or(""));
            if let Some(tc) = d["tool_calls"].get(0) {
                assert_eq!(tc["index"], 0);
                if let Some(n) = tc["function"]["name"].as_str() {
                    assert!(tc["id"].as_str().unwrap().starts_with("call_"));
                    name = Some(n.to_string());
                }
                args.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
            }
            if !ch["finish_reason"].is_null() {
                finish = Some(ch["finish_reason"].clone());
                assert!(c.get("timings").is_some());
            }
        }
    }
    assert_eq!(reasoning, "I should check.");
    assert_eq!(content, "Let me look.");
    assert_eq!(name.as_deref(), Some("get_weather"));
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        json!({"city": "Paris"})
    );
    assert_eq!(finish, Some(json!("tool_calls")));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert!(last["usage"]["total_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn thinking_budget_closes_block_and_answer_follows() {
    // The script never closes its think block; the server must.
    let long = "thinking ".repeat(60);
    let addr = server(&long, None, greedy()).await;
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "q"}], "max_thinking_tokens": 10, "max_tokens": 400}),
        "",
    )
    .await;
    let v = r.json();
    let m = &v["choices"][0]["message"];
    let reasoning = m["reasoning_content"].as_str().unwrap();
    assert!(reasoning.ends_with("directly now."), "{reasoning}");
    assert!(reasoning.starts_with("thinking thinking"));
    // The rest of the script is now the answer.
    assert!(
        m["content"].as_str().unwrap().starts_with("thinking"),
        "{m}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Thinking off: the template closes the block, everything is content.
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "q"}], "reasoning_effort": "none", "max_tokens": 5}),
        "",
    )
    .await;
    let v = r.json();
    assert!(
        v["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn stop_sequences_and_raw_completions() {
    let addr = server("alpha beta gamma delta", None, greedy()).await;
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "stop": [" gam"]}),
        "",
    )
    .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], "alpha beta");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["object"], "text_completion");
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "x", "stream": true, "max_tokens": 2}),
        "",
    )
    .await;
    let frames = r.frames();
    assert_eq!(frames.last().unwrap().1, "[DONE]");
    let text: String = frames[..frames.len() - 1]
        .iter()
        .map(|f| {
            serde_json::from_str::<Value>(&f.1).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(text, "alpha beta");
}

#[tokio::test]
async fn anthropic_stream_events() {
    let addr = server(XML_CALL, None, greedy()).await;
    let r = post(
        addr,
        "/v1/messages",
        &json!({"model": "m", "max_tokens": 200, "stream": true,
                "messages": [{"role": "user", "content": "w?"}],
                "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]}),
        "",
    )
    .await;
    assert_eq!(r.status, 200);
    let frames = r.frames();
    let names: Vec<String> = frames
        .iter()
        .map(|f| f.0.clone().unwrap_or_default())
        .collect();
    assert_eq!(names[0], "message_start");
    assert_eq!(names[names.len() - 2], "message_delta");
    assert_eq!(names[names.len() - 1], "message_stop");
    let data: Vec<Value> = frames
        .iter()
        .map(|f| serde_json::from_str(&f.1).unwrap())
        .collect();
    for (n, d) in names.iter().zip(&data) {
        assert_eq!(&d["type"], n);
    }
    let starts: Vec<&Value> = data
        .iter()
        .filter(|d| d["type"] == "content_block_start")
        .collect();
    let kinds: Vec<&str> = starts
        .iter()
        .map(|d| d["content_block"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, vec!["thinking", "text", "tool_use"]);
    assert_eq!(starts[2]["index"], 2);
    assert_eq!(starts[2]["content_block"]["name"], "get_weather");
    let json_args: String = data
        .iter()
        .filter(|d| d["delta"]["type"] == "input_json_delta")
        .map(|d| d["delta"]["partial_json"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&json_args).unwrap(),
        json!({"city": "Paris"})
    );
    let md = &data[data.len() - 2];
    assert_eq!(md["delta"]["stop_reason"], "tool_use");
    assert!(md["usage"]["output_tokens"].as_u64().unwrap() > 0);
    assert!(md.get("timings").is_some());
    assert!(
        data[0]["message"]["usage"]["input_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[tokio::test]
async fn anthropic_non_stream_and_count_tokens() {
    let addr = server(XML_CALL, None, greedy()).await;
    let body = json!({"model": "m", "max_tokens": 200, "system": "Be brief.",
        "messages": [{"role": "user", "content": "w?"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]});
    let v = post(addr, "/v1/messages", &body, "").await.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["type"], "thinking");
    assert_eq!(
        v["content"][1],
        json!({"type": "text", "text": "Let me look."})
    );
    assert_eq!(v["content"][2]["type"], "tool_use");
    assert_eq!(v["content"][2]["input"], json!({"city": "Paris"}));
    assert_eq!(v["stop_reason"], "tool_use");
    let c = post(addr, "/v1/messages/count_tokens", &body, "")
        .await
        .json();
    assert!(c["input_tokens"].as_u64().unwrap() > 5);
}

#[tokio::test]
async fn responses_items_and_events() {
    let addr = server(XML_CALL, None, greedy()).await;
    let body = json!({"model": "m", "instructions": "be terse", "input": "w?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}, {"type": "web_search"}],
        "reasoning": {"summary": "auto"}});
    let v = post(addr, "/v1/responses", &body, "").await.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    let types: Vec<&str> = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, vec!["reasoning", "message", "function_call"]);
    assert_eq!(v["output"][0]["summary"][0]["text"], "I should check.");
    assert_eq!(v["output"][2]["name"], "get_weather");
    assert!(v["output"][2]["call_id"]
        .as_str()
        .unwrap()
        .starts_with("call_"));
    assert!(
        v["usage"]["output_tokens_details"]["reasoning_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = post(addr, "/v1/responses", &sbody, "").await;
    let data: Vec<Value> = r
        .frames()
        .iter()
        .map(|f| serde_json::from_str(&f.1).unwrap())
        .collect();
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["sequence_number"], i as u64);
    }
    let kinds: Vec<&str> = data.iter().map(|d| d["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[0], "response.created");
    assert_eq!(*kinds.last().unwrap(), "response.completed");
    for k in [
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ] {
        assert!(kinds.contains(&k), "{k} missing from {kinds:?}");
    }
    let done = &data.last().unwrap()["response"];
    assert_eq!(done["output"].as_array().unwrap().len(), 3);
    assert!(done.get("timings").is_some());
}

#[tokio::test]
async fn bad_input_is_400_in_the_routes_shape() {
    let addr = server("x", None, greedy()).await;
    let msgs = json!([{"role": "user", "content": "q"}]);
    for (body, field) in [
        (json!({"messages": msgs, "temperature": 3}), "temperature"),
        (json!({"messages": msgs, "n": 2}), "n"),
        (
            json!({"messages": msgs, "max_tokens": 5, "max_completion_tokens": 6}),
            "max_completion_tokens",
        ),
        (
            json!({"messages": msgs, "logit_bias": {"999999999": 1}}),
            "logit_bias",
        ),
        (json!({"messages": "hi"}), "messages"),
        (
            json!({"messages": msgs, "reasoning_effort": "maximal"}),
            "reasoning_effort",
        ),
    ] {
        let r = post(addr, "/v1/chat/completions", &body, "").await;
        assert_eq!(r.status, 400, "{body}");
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
        assert!(v["error"].get("param").is_some() && v["error"].get("code").is_some());
    }
    let r = post(
        addr,
        "/v1/messages",
        &json!({"messages": msgs, "temperature": 1.5}),
        "",
    )
    .await;
    assert_eq!(r.status, 400);
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("temperature"));
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": "r1"}),
        "",
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("previous_response_id"));
    // Still serving.
    let r = post(addr, "/v1/chat/completions", &json!({"messages": msgs}), "").await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn api_key_guards_all_but_health() {
    let addr = server("x", Some("sekret"), greedy()).await;
    let body = json!({"max_tokens": 8, "messages": [{"role": "user", "content": "q"}]});
    assert_eq!(
        post(addr, "/v1/chat/completions", &body, "").await.status,
        401
    );
    assert_eq!(
        post(
            addr,
            "/v1/chat/completions",
            &body,
            "Authorization: Bearer nope\r\n"
        )
        .await
        .status,
        401
    );
    assert_eq!(
        post(
            addr,
            "/v1/chat/completions",
            &body,
            "Authorization: Bearer sekret\r\n"
        )
        .await
        .status,
        200
    );
    assert_eq!(
        post(addr, "/v1/messages", &body, "x-api-key: sekret\r\n")
            .await
            .status,
        200
    );
    // /health answers without the key.
    assert_eq!(request(addr, "GET", "/health", "", None).await.status, 200);
}

pub(crate) fn qwen35() -> Arc<dyn PromptRender> {
    let t = model::chat::ChatTemplate::new(model::chat::QWEN35_TEMPLATE).expect("template");
    Arc::new(TemplateRenderer(Arc::new(t)))
}

#[tokio::test]
async fn qwen35_template_round_trip() {
    let addr = server_with(XML_CALL, None, greedy(), qwen35()).await;
    // A full tool round trip in the history, a developer turn, tools.
    let body = json!({"messages": [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need a tool",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        {"role": "user", "content": "and Paris?"}],
        "tools": weather_tools()});
    let r = post(addr, "/v1/chat/completions", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(
        v["choices"][0]["message"]["reasoning_content"],
        "I should check."
    );
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    // Anthropic, thinking off: the template closes the block, so nothing is reasoning.
    let r = post(
        addr,
        "/v1/messages",
        &json!({"max_tokens": 50, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "hi"}]}),
        "",
    )
    .await;
    let v = r.json();
    assert_eq!(v["content"][0]["type"], "text", "{v}");
    // Responses with a function_call_output turn.
    let r = post(addr, "/v1/responses", &json!({"instructions": "I", "input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "cold"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}), "").await;
    assert_eq!(r.status, 200, "{}", r.body);
}

pub(crate) fn qwen3() -> Arc<dyn PromptRender> {
    let t = model::chat::ChatTemplate::new(model::chat::QWEN3_TEMPLATE).expect("template");
    Arc::new(TemplateRenderer(Arc::new(t)))
}

#[tokio::test]
async fn qwen3_template_json_calls_and_model_opened_think() {
    // Qwen3 opens its own think block and writes JSON tool calls.
    let script = "<think>\nweather needed\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}\n</tool_call>";
    let addr = server_with(script, None, greedy(), qwen3()).await;
    let body = json!({"messages": [{"role": "user", "content": "w?"}], "tools": weather_tools(), "stream": true});
    let r = post(addr, "/v1/chat/completions", &body, "").await;
    let mut reasoning = String::new();
    let mut args = String::new();
    for (_, d) in r.frames() {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        let delta = &v["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        if let Some(tc) = delta["tool_calls"].get(0) {
            args.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(reasoning, "weather needed");
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        json!({"city": "Lima"})
    );
    // A thinking budget also applies when the model opened the block itself.
    let long = format!("<think>\n{}", "hmm ".repeat(80));
    let addr = server_with(&long, None, greedy(), qwen3()).await;
    let v = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "q"}], "thinking_budget": 8, "max_tokens": 500}),
        "",
    )
    .await
    .json();
    let m = &v["choices"][0]["message"];
    assert!(
        m["reasoning_content"]
            .as_str()
            .unwrap()
            .ends_with("directly now."),
        "{m}"
    );
    assert!(m["content"].as_str().unwrap().starts_with("hmm"), "{m}");
}

// Responses: an incomplete stream marks its message item incomplete; metadata is
// echoed; store: true is refused, not answered with store: false.
#[tokio::test]
async fn responses_incomplete_items_metadata_and_store() {
    let addr = Setup::new("one two three four five six seven eight nine ten")
        .serve()
        .await;
    let body = json!({"input": "q", "stream": true, "max_output_tokens": 3,
                      "reasoning": {"effort": "none"}, "metadata": {"run": "r1"}});
    let r = post(addr, "/v1/responses", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let frames = r.frames();
    let (ev, last) = frames.last().unwrap();
    assert_eq!(ev.as_deref(), Some("response.incomplete"), "{}", r.body);
    let last: Value = serde_json::from_str(last).unwrap();
    let resp = &last["response"];
    assert_eq!(resp["status"], "incomplete");
    assert_eq!(resp["metadata"], json!({"run": "r1"}));
    let msg = resp["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "message")
        .unwrap();
    assert_eq!(msg["status"], "incomplete", "{resp}");
    // The item's own done event says so too.
    let done = frames
        .iter()
        .filter(|(e, _)| e.as_deref() == Some("response.output_item.done"))
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap())
        .find(|d| d["item"]["type"] == "message")
        .unwrap();
    assert_eq!(done["item"]["status"], "incomplete");
    // Not streamed: metadata echoed, the message incomplete.
    let mut body = body;
    body["stream"] = json!(false);
    let v = post(addr, "/v1/responses", &body, "").await.json();
    assert_eq!(v["metadata"], json!({"run": "r1"}));
    assert_eq!(v["status"], "incomplete");
    // store: true cannot be honoured: a 400 naming it.
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "q", "store": true}),
        "",
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "store");
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "q", "store": false}),
        "",
    )
    .await;
    assert_eq!(r.status, 200);
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "q", "metadata": {"n": 1}}),
        "",
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "metadata.n");
}
