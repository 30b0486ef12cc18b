//! Structured output end to end: the routes over the real engine on the demo model
//! (random weights, so its free output is gibberish and a reply that parses and
//! validates shows the grammar at work). Every reply is checked with an independent
//! JSON-schema validator.

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::api_tests::{greedy, post};
use crate::metrics::Stats;
use crate::settings::RequestDefaults;
use crate::AppState;

/// A server over the demo engine. `template`: the model's chat template (the Qwen3.5
/// one, XML tool calls); without it, ChatML and the JSON tool-call form.
async fn server(template: bool) -> SocketAddr {
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
    let mut loaded = crate::core_for(
        engine,
        RequestDefaults {
            max_tokens_default: 300,
            ..greedy()
        },
        stats.clone(),
    )
    .expect("core");
    if !template {
        loaded.template = None;
        loaded.core.renderer = Arc::new(crate::prompt::ChatMl);
    }
    let state = Arc::new(
        AppState::new(
            stats,
            loaded.info,
            loaded.tokenizer,
            loaded.template,
            json!({}),
            None,
            "demo".into(),
        )
        .with_core(loaded.core),
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

/// Nested objects, an array of `$ref`s, enums, anyOf; bounded, so a random model ends.
fn schema() -> Value {
    json!({
        "$defs": {
            "item": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 50},
                    "kind": {"enum": ["tool", "food", "toy"]}
                },
                "required": ["id", "kind"],
                "additionalProperties": false
            }
        },
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 10},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 120}, {"type": "null"}]}},
                "required": ["name", "age"],
                "additionalProperties": false
            },
            "done": {"type": "boolean"}
        },
        "required": ["title", "items", "owner", "done"],
        "additionalProperties": false
    })
}

fn validate(schema: &Value, text: &str) {
    let v: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let validator = jsonschema::validator_for(schema).expect("the schema compiles");
    let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{text} does not validate: {errors:?}");
}

fn no_think() -> Value {
    json!({"enable_thinking": false})
}

fn sampling_runs() -> Vec<Value> {
    let mut runs = vec![json!({"temperature": 0})];
    for seed in [1, 2, 3] {
        runs.push(json!({"temperature": 1.0, "seed": seed}));
    }
    runs.push(json!({"temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 4}));
    runs
}

fn merged(mut a: Value, b: &Value) -> Value {
    if let (Some(a), Some(b)) = (a.as_object_mut(), b.as_object()) {
        for (k, v) in b {
            a.insert(k.clone(), v.clone());
        }
    }
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_bind_every_route_greedy_and_sampled() {
    let addr = server(true).await;
    let s = schema();
    // Free, the demo model's answer is not JSON.
    let r = post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": no_think(), "max_tokens": 40}), "").await;
    let free = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(serde_json::from_str::<Value>(&free).is_err(), "{free}");

    for run in sampling_runs() {
        let chat = merged(
            json!({
                "messages": [{"role": "user", "content": "List some things."}],
                "chat_template_kwargs": no_think(),
                "response_format": {"type": "json_schema", "json_schema": {"name": "things", "schema": s, "strict": true}}
            }),
            &run,
        );
        let r = post(addr, "/v1/chat/completions", &chat, "").await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(
            v["choices"][0]["finish_reason"], "stop",
            "{run}: {}",
            r.body
        );
        validate(
            &s,
            v["choices"][0]["message"]["content"]
                .as_str()
                .expect("content"),
        );

        let resp = merged(
            json!({
                "input": "List some things.",
                "reasoning": {"effort": "none"},
                "text": {"format": {"type": "json_schema", "name": "things", "schema": s, "strict": true}}
            }),
            &run,
        );
        let r = post(addr, "/v1/responses", &resp, "").await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["text"]["format"]["type"], "json_schema", "echoed");
        let text = v["output"]
            .as_array()
            .and_then(|o| o.iter().find(|i| i["type"] == "message"))
            .map(|m| m["content"][0]["text"].as_str().unwrap_or("").to_string())
            .expect("a message item");
        validate(&s, &text);
    }
    // Completions: a raw prompt, the same schema.
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Things:", "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": s}}}),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    validate(&s, r.json()["choices"][0]["text"].as_str().expect("text"));
    // Streaming carries the same constrained text.
    let mut chat = json!({
        "messages": [{"role": "user", "content": "List some things."}],
        "chat_template_kwargs": no_think(), "stream": true, "temperature": 1.0, "seed": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "things", "schema": s}}
    });
    let r = post(addr, "/v1/chat/completions", &chat, "").await;
    let mut text = String::new();
    for (_, data) in r.frames() {
        if let Ok(v) = serde_json::from_str::<Value>(&data) {
            if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(t);
            }
        }
    }
    validate(&s, &text);
    // json_object: an object (its contents unbounded, so only its start is certain
    // on a random model within a budget).
    chat["stream"] = json!(false);
    chat["max_tokens"] = json!(30);
    chat["response_format"] = json!({"type": "json_object"});
    let r = post(addr, "/v1/chat/completions", &chat, "").await;
    let c = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(c.starts_with('{'), "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_think_block_stays_free() {
    let addr = server(true).await;
    let s = schema();
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({
            "messages": [{"role": "user", "content": "List some things."}],
            "chat_template_kwargs": {"enable_thinking": true}, "max_thinking_tokens": 12,
            "temperature": 1.0, "seed": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "things", "schema": s}}
        }),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let m = &r.json()["choices"][0]["message"];
    let reasoning = m["reasoning_content"].as_str().expect("reasoning");
    assert!(!reasoning.is_empty());
    assert!(serde_json::from_str::<Value>(reasoning).is_err());
    validate(&s, m["content"].as_str().expect("content").trim());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unenforceable_keywords_are_a_400_naming_them() {
    let addr = server(true).await;
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}}}}}),
        "",
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["param"], "response_format.json_schema.schema");
    assert!(
        e["message"]
            .as_str()
            .unwrap_or("")
            .contains("dependentSchemas"),
        "{e}"
    );
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
            "schema": {"type": "object", "dependentSchemas": {}}}}}),
        "",
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "text.format.schema");
}

fn tools() -> (Value, Value) {
    let weather = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "note": {"type": "string", "maxLength": 8}
        },
        "required": ["city", "days"],
        "additionalProperties": false
    });
    let time = json!({
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": false
    });
    (weather, time)
}

fn openai_tools() -> Value {
    let (w, t) = tools();
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": w}},
        {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": t}}
    ])
}

fn schema_of(name: &str) -> Value {
    let (w, t) = tools();
    if name == "get_weather" {
        w
    } else {
        t
    }
}

/// The calls of a chat reply: (name, arguments) each validated.
fn check_chat_calls(v: &Value, want: Option<&str>, max: Option<usize>) -> usize {
    let calls = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool calls: {v}"))
        .clone();
    assert!(!calls.is_empty());
    if let Some(m) = max {
        assert!(calls.len() <= m, "{v}");
    }
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    for c in &calls {
        let name = c["function"]["name"].as_str().expect("name");
        if let Some(w) = want {
            assert_eq!(name, w);
        }
        validate(
            &schema_of(name),
            c["function"]["arguments"].as_str().expect("args"),
        );
    }
    calls.len()
}

async fn tool_choice_forms(template: bool) {
    let addr = server(template).await;
    let base = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "chat_template_kwargs": no_think(),
        "tools": openai_tools(),
    });
    for run in sampling_runs() {
        let mut b = merged(base.clone(), &run);
        b["tool_choice"] = json!("required");
        let r = post(addr, "/v1/chat/completions", &b, "").await;
        assert_eq!(r.status, 200, "{}", r.body);
        check_chat_calls(&r.json(), None, None);

        b["tool_choice"] = json!({"type": "function", "function": {"name": "get_time"}});
        b["parallel_tool_calls"] = json!(false);
        let r = post(addr, "/v1/chat/completions", &b, "").await;
        assert_eq!(r.status, 200, "{}", r.body);
        check_chat_calls(&r.json(), Some("get_time"), Some(1));
    }
    // Responses: a named function.
    let r = post(
        addr,
        "/v1/responses",
        &json!({"input": "Weather?", "reasoning": {"effort": "none"}, "temperature": 1.0, "seed": 3,
            "tools": [{"type": "function", "name": "get_weather", "parameters": schema_of("get_weather")}],
            "tool_choice": {"type": "function", "name": "get_weather"}}),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let call = v["output"]
        .as_array()
        .and_then(|o| o.iter().find(|i| i["type"] == "function_call"))
        .unwrap_or_else(|| panic!("no function_call: {v}"));
    assert_eq!(call["name"], "get_weather");
    validate(
        &schema_of("get_weather"),
        call["arguments"].as_str().expect("args"),
    );
    // Anthropic: any, and a named tool with parallel use off.
    let (w, t) = tools();
    let an_tools = json!([
        {"name": "get_weather", "description": "Weather", "input_schema": w},
        {"name": "get_time", "description": "Time", "input_schema": t}
    ]);
    for (choice, want) in [
        (json!({"type": "any"}), None),
        (
            json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}),
            Some("get_weather"),
        ),
    ] {
        for seed in [1, 2] {
            let r = post(
                addr,
                "/v1/messages",
                &json!({"model": "demo", "max_tokens": 300, "messages": [{"role": "user", "content": "Weather?"}],
                    "thinking": {"type": "disabled"}, "temperature": 1.0, "seed": seed,
                    "tools": an_tools, "tool_choice": choice}),
                "",
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.body);
            let v = r.json();
            assert_eq!(v["stop_reason"], "tool_use", "{v}");
            let uses: Vec<&Value> = v["content"]
                .as_array()
                .expect("content")
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .collect();
            assert!(!uses.is_empty(), "{v}");
            if want.is_some() {
                assert_eq!(uses.len(), 1, "{v}");
            }
            for u in uses {
                let name = u["name"].as_str().expect("name");
                if let Some(w) = want {
                    assert_eq!(name, w);
                }
                validate(&schema_of(name), &u["input"].to_string());
            }
        }
    }
    // Tools left to the model (`auto`) with a schema: a valid answer or valid calls.
    for seed in [1, 2, 3, 4] {
        let mut b = base.clone();
        b["temperature"] = json!(1.0);
        b["seed"] = json!(seed);
        b["response_format"] =
            json!({"type": "json_schema", "json_schema": {"name": "t", "schema": schema()}});
        let r = post(addr, "/v1/chat/completions", &b, "").await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        if v["choices"][0]["message"]["tool_calls"].is_array() {
            check_chat_calls(&v, None, None);
        } else {
            validate(
                &schema(),
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .expect("content"),
            );
        }
    }
    // A name that is not offered is a 400.
    let mut b = base.clone();
    b["tool_choice"] = json!({"type": "function", "function": {"name": "nope"}});
    let r = post(addr, "/v1/chat/completions", &b, "").await;
    assert_eq!(r.status, 400, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_is_enforced_in_the_xml_form() {
    tool_choice_forms(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_is_enforced_in_the_json_form() {
    tool_choice_forms(false).await;
}
