//! The chat template as the operations endpoints see it: its source, whether
//! it thinks, its tool-call wire format, and `/apply-template`.

use serde_json::{json, Map, Value};

use model::chat::{ChatInputs, ChatTemplate};

use super::{bad_request, BadRequest};

/// The wire format a template asks the model to write tool calls in.
fn tool_call_format(source: &str) -> Option<&'static str> {
    if source.contains("<function=") {
        // Qwen3.5 / Qwen3-Coder: <tool_call><function=NAME><parameter=P>V</parameter>...
        Some("qwen3-xml")
    } else if source.contains("<tool_call>") {
        // Qwen3 / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
        Some("hermes-json")
    } else {
        None
    }
}

/// `{source, thinks, tool_call_format}` for `/props` and `/health`.
pub fn describe(t: Option<&ChatTemplate>) -> Value {
    let Some(t) = t else {
        return json!({"source": null, "thinks": false, "tool_call_format": null});
    };
    let src = t.source();
    json!({
        "source": src,
        "thinks": t.supports_thinking() && src.contains("<think>"),
        "tool_call_format": if t.supports_tools() { tool_call_format(src) } else { None },
    })
}

/// Anthropic-style tools (`{name, description, input_schema}`) in the OpenAI
/// form the template expects; OpenAI-style ones pass through.
fn openai_tools(tools: &[Value]) -> Result<Value, BadRequest> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let Some(obj) = t.as_object() else {
            return Err(bad_request(
                format!("`tools[{i}]` must be an object"),
                Some("tools"),
            ));
        };
        if obj.contains_key("function") {
            out.push(t.clone());
        } else if let Some(name) = obj.get("name").and_then(Value::as_str) {
            let mut f = Map::new();
            f.insert("name".into(), Value::from(name));
            if let Some(d) = obj.get("description") {
                f.insert("description".into(), d.clone());
            }
            let params = obj
                .get("input_schema")
                .or_else(|| obj.get("parameters"))
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            f.insert("parameters".into(), params);
            out.push(json!({"type": "function", "function": f}));
        } else {
            return Err(bad_request(
                format!("`tools[{i}]` has neither `function` nor `name`"),
                Some("tools"),
            ));
        }
    }
    Ok(Value::Array(out))
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Renders `body.messages` (with `tools`, `add_generation_prompt`,
/// `chat_template_kwargs`, `enable_thinking`, `reasoning_effort`) through the
/// template.
pub fn render(t: &ChatTemplate, body: &Map<String, Value>) -> Result<String, BadRequest> {
    let messages = match body.get("messages") {
        Some(Value::Array(m)) => m,
        Some(_) => return Err(bad_request("`messages` must be an array", Some("messages"))),
        None => return Err(bad_request("`messages` is required", Some("messages"))),
    };
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        match role {
            Some(r) if ROLES.contains(&r) => {}
            Some(r) => {
                return Err(bad_request(
                    format!(
                        "`messages[{i}].role` is `{r}`; expected one of {}",
                        ROLES.join(", ")
                    ),
                    Some(&format!("messages[{i}].role")),
                ))
            }
            None => {
                return Err(bad_request(
                    format!("`messages[{i}].role` is required"),
                    Some(&format!("messages[{i}].role")),
                ))
            }
        }
    }
    let tools = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(Value::Array(a)) => Some(openai_tools(a)?),
        Some(_) => return Err(bad_request("`tools` must be an array", Some("tools"))),
    };
    let add_generation_prompt = match body.get("add_generation_prompt") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad_request(
                "`add_generation_prompt` must be a boolean",
                Some("add_generation_prompt"),
            ))
        }
    };
    let extra = match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(bad_request(
                "`chat_template_kwargs` must be an object",
                Some("chat_template_kwargs"),
            ))
        }
    };
    let mut enable_thinking = extra.get("enable_thinking").and_then(Value::as_bool);
    match body.get("enable_thinking") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => enable_thinking = Some(*b),
        Some(_) => {
            return Err(bad_request(
                "`enable_thinking` must be a boolean",
                Some("enable_thinking"),
            ))
        }
    }
    if body.get("reasoning_effort").and_then(Value::as_str) == Some("none") {
        enable_thinking = Some(false);
    }
    let inputs = ChatInputs {
        messages: Value::Array(messages.clone()),
        tools,
        add_generation_prompt,
        enable_thinking,
        extra,
    };
    t.render(&inputs)
        .map_err(|e| bad_request(e.to_string(), Some("messages")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen35() -> ChatTemplate {
        ChatTemplate::new(model::chat::QWEN35_TEMPLATE).expect("template")
    }

    #[test]
    fn describes_qwen_templates() {
        let d = describe(Some(&qwen35()));
        assert_eq!(d["thinks"], true);
        assert_eq!(d["tool_call_format"], "qwen3-xml");
        let q3 = ChatTemplate::new(model::chat::QWEN3_TEMPLATE).expect("template");
        assert_eq!(describe(Some(&q3))["tool_call_format"], "hermes-json");
        assert_eq!(describe(None)["thinks"], false);
    }

    #[test]
    fn renders_messages_tools_and_thinking_switch() {
        let t = qwen35();
        let body = json!({
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
            ],
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema":
                {"type": "object", "properties": {"city": {"type": "string"}}}}]
        });
        let Value::Object(m) = body else {
            unreachable!()
        };
        let p = render(&t, &m).unwrap_or_else(|_| panic!("render"));
        assert!(p.contains("Be brief."));
        assert!(p.contains("get_weather"));
        assert!(p.contains("sunny"));
        assert!(p.ends_with("<think>\n"), "{p:?}");

        let body =
            json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"});
        let Value::Object(m) = body else {
            unreachable!()
        };
        let p = render(&t, &m).unwrap_or_else(|_| panic!("render"));
        assert!(p.contains("</think>"), "{p:?}");
    }

    #[test]
    fn bad_role_is_refused() {
        let body = json!({"messages": [{"role": "wizard", "content": "hi"}]});
        let Value::Object(m) = body else {
            unreachable!()
        };
        assert!(render(&qwen35(), &m).is_err());
    }
}
