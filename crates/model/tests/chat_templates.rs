//! The embedded Qwen chat templates render exactly what HF transformers renders.
//! Expected prompts: tests/fixtures/chat_expected.json, written by
//! tests/fixtures/gen_chat_fixture.py.

use model::chat::{ChatError, ChatInputs, ChatTemplate, QWEN35_TEMPLATE, QWEN3_TEMPLATE};
use serde_json::{json, Value as Json};

fn template(name: &str) -> ChatTemplate {
    let src = match name {
        "qwen3" => QWEN3_TEMPLATE,
        "qwen35" => QWEN35_TEMPLATE,
        other => panic!("unknown template {other}"),
    };
    ChatTemplate::new(src).expect("template compiles")
}

/// An embedded template, or one whose source the fixture carries (Qwen3-Coder, small
/// templates that exercise Python printing and filters).
fn fixture_template(fx: &Json, name: &str) -> ChatTemplate {
    match fx["sources"][name].as_str() {
        Some(src) => ChatTemplate::new(src).expect("template compiles"),
        None => template(name),
    }
}

fn inputs(v: &Json) -> ChatInputs {
    ChatInputs {
        messages: v["messages"].clone(),
        tools: match &v["tools"] {
            Json::Null => None,
            t => Some(t.clone()),
        },
        add_generation_prompt: v["add_generation_prompt"].as_bool().expect("bool"),
        enable_thinking: v["enable_thinking"].as_bool(),
        extra: v["extra"].as_object().cloned().unwrap_or_default(),
    }
}

#[test]
fn renders_like_transformers() {
    let fx: Json =
        serde_json::from_str(include_str!("fixtures/chat_expected.json")).expect("fixture");
    let mut failures = 0;
    for case in fx["cases"].as_array().expect("cases") {
        let name = format!("{}/{}", case["template"], case["name"]);
        let t = fixture_template(&fx, case["template"].as_str().expect("template"));
        let got = t.render(&inputs(&case["inputs"])).expect(&name);
        let want = case["expected"].as_str().expect("expected");
        if got != want {
            failures += 1;
            eprintln!("MISMATCH {name}\n--- got\n{got}\n--- want\n{want}\n---");
        }
    }
    assert_eq!(failures, 0);
}

/// OpenAI clients send arguments as a JSON string and assistant content as null.
#[test]
fn openai_wire_forms_render_like_objects() {
    for name in ["qwen3", "qwen35"] {
        let t = template(name);
        let as_object = json!([
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
            {"role": "tool", "tool_call_id": "c", "content": "-3°C"},
        ]);
        let mut as_string = as_object.clone();
        as_string[1]["content"] = Json::Null;
        as_string[1]["tool_calls"][0]["function"]["arguments"] =
            Json::String("{\"city\":\"Oslo\",\"days\":2}".into());
        as_string[1]["name"] = Json::Null;
        let render = |m: &Json| {
            t.render(&ChatInputs {
                messages: m.clone(),
                add_generation_prompt: true,
                ..Default::default()
            })
            .expect("render")
        };
        assert_eq!(render(&as_object), render(&as_string), "{name}");
    }
}

#[test]
fn qwen3_flattens_text_parts() {
    let t = template("qwen3");
    let parts = json!([{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
    let got = t
        .render(&ChatInputs {
            messages: parts,
            add_generation_prompt: true,
            enable_thinking: Some(false),
            ..Default::default()
        })
        .expect("render");
    assert_eq!(
        got,
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}

#[test]
fn reasoning_aliases_and_template_errors() {
    let t = template("qwen35");
    let with = |field: &str| {
        json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", field: "because"},
        ])
    };
    let render = |m: Json| {
        t.render(&ChatInputs {
            messages: m,
            ..Default::default()
        })
    };
    let want = render(with("reasoning_content")).expect("render");
    assert!(
        want.contains("<think>\nbecause\n</think>\n\na<|im_end|>"),
        "{want}"
    );
    assert_eq!(render(with("reasoning")).expect("render"), want);
    // Qwen3.5 refuses a conversation without a user query, by name.
    match render(json!([{"role": "system", "content": "s"}])) {
        Err(ChatError::Raised(m)) => assert_eq!(m, "No user query found in messages."),
        other => panic!("{other:?}"),
    }
}

#[test]
fn extra_kwargs_reach_the_template() {
    let t = ChatTemplate::new("{{ greeting }} {{ enable_thinking }} {{ messages|length }}")
        .expect("compile");
    let mut extra = serde_json::Map::new();
    extra.insert("greeting".into(), json!("hi"));
    extra.insert("enable_thinking".into(), json!(true));
    let mut i = ChatInputs {
        messages: json!([]),
        extra,
        ..Default::default()
    };
    assert_eq!(t.render(&i).expect("render"), "hi True 0");
    i.enable_thinking = Some(false);
    assert_eq!(t.render(&i).expect("render"), "hi False 0");
}
