//! From each API's conversation shape to the one message list the chat template reads.
//!
//! The template sees OpenAI chat messages: `{"role", "content": string}`, assistant
//! turns with `reasoning_content` and `tool_calls` (arguments as objects, which the
//! Qwen3.5 XML template iterates), and `{"role": "tool", "tool_call_id", "content"}`.
//! System text before the first turn (system and developer messages, Responses
//! `instructions`, Anthropic `system`) becomes one leading system message. A system or
//! developer message later in the conversation (Claude Code sends one as `messages[1]`)
//! stays where it is, as a system turn; a template that accepts a system message only
//! first (Qwen3.5 raises) gets it folded into the leading one instead
//! ([`Conversation::folded`], chosen in `gen::render_chat`).

use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// Renders a conversation to prompt text. The GGUF's chat template in the server.
pub trait PromptRender: Send + Sync {
    /// `messages` and `tools` in the normalized shape above.
    fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        enable_thinking: bool,
        extra: &Map<String, Value>,
    ) -> Result<String, String>;

    /// The conversation with its last turn left as the template renders it but no
    /// generation prompt after it (`add_generation_prompt: false`), for continuing a
    /// final assistant message ([`continue_final`] cuts the turn's closing off).
    fn render_without_generation_prompt(
        &self,
        _messages: &[Value],
        _tools: Option<&Value>,
        _enable_thinking: bool,
        _extra: &Map<String, Value>,
    ) -> Result<String, String> {
        Err("this prompt renderer cannot continue a final assistant message".into())
    }
}

/// The prompt that continues the final assistant message `last` (as it appears in the
/// rendered text) instead of closing it: `rendered` cut after the last occurrence of
/// the message's text, trimmed as templates trim it (what HF transformers'
/// `continue_final_message` does). None when the text is not in the rendering.
pub fn continue_final(rendered: &str, last: &str) -> Option<String> {
    let needle = last.trim();
    if needle.is_empty() {
        return None;
    }
    let at = rendered.rfind(needle)?;
    Some(rendered[..at + needle.len()].to_string())
}

/// The model's own chat template (from the GGUF).
pub struct TemplateRenderer(pub std::sync::Arc<model::chat::ChatTemplate>);

impl TemplateRenderer {
    fn render_with(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        enable_thinking: bool,
        extra: &Map<String, Value>,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let inputs = model::chat::ChatInputs {
            messages: Value::Array(messages.to_vec()),
            tools: tools.cloned(),
            add_generation_prompt,
            enable_thinking: Some(enable_thinking),
            extra: extra.clone(),
        };
        self.0.render(&inputs).map_err(|e| e.to_string())
    }
}

impl PromptRender for TemplateRenderer {
    fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        enable_thinking: bool,
        extra: &Map<String, Value>,
    ) -> Result<String, String> {
        self.render_with(messages, tools, enable_thinking, extra, true)
    }

    fn render_without_generation_prompt(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        enable_thinking: bool,
        extra: &Map<String, Value>,
    ) -> Result<String, String> {
        self.render_with(messages, tools, enable_thinking, extra, false)
    }
}

/// A normalized conversation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Conversation {
    pub messages: Vec<Value>,
    /// OpenAI chat-shape tools, None when there are none (or tool_choice is "none").
    pub tools: Option<Value>,
    /// The last message is an assistant message to continue (a prefill), not a turn
    /// to close: Anthropic always, OpenAI chat with `continue_final_message: true`.
    pub continue_final: bool,
}

impl Conversation {
    /// Whether a system turn comes after the first message.
    pub fn has_later_system(&self) -> bool {
        self.messages.iter().skip(1).any(|m| m["role"] == "system")
    }

    /// The messages with every system turn merged, in order, into one leading system
    /// message: for templates that accept a system message only first.
    pub fn folded(&self) -> Vec<Value> {
        let mut system: Vec<&str> = Vec::new();
        let mut rest = Vec::with_capacity(self.messages.len());
        for m in &self.messages {
            if m["role"] == "system" {
                system.push(m["content"].as_str().unwrap_or(""));
            } else {
                rest.push(m.clone());
            }
        }
        let mut out = Vec::with_capacity(rest.len() + 1);
        if !system.is_empty() {
            out.push(json!({"role": "system", "content": system.join("\n\n")}));
        }
        out.extend(rest);
        out
    }
}

/// Collects system text and turns, then produces the final list.
#[derive(Default)]
struct Builder {
    system: Vec<String>,
    turns: Vec<Value>,
}

impl Builder {
    /// System text: part of the leading system message until the first turn, a
    /// system turn in place after it.
    fn system(&mut self, text: String) {
        if text.is_empty() {
        } else if self.turns.is_empty() {
            self.system.push(text);
        } else {
            self.turns.push(json!({"role": "system", "content": text}));
        }
    }

    /// Adds a tool call to the last assistant turn if it is one, else a new turn.
    fn assistant_tool_call(&mut self, call: Value) {
        if let Some(last) = self.turns.last_mut() {
            if last["role"] == "assistant" {
                match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(list) => list.push(call),
                    None => last["tool_calls"] = json!([call]),
                }
                return;
            }
        }
        self.turns
            .push(json!({"role": "assistant", "content": "", "tool_calls": [call]}));
    }

    fn finish(self) -> Vec<Value> {
        let mut out = Vec::with_capacity(self.turns.len() + 1);
        if !self.system.is_empty() {
            out.push(json!({"role": "system", "content": self.system.join("\n\n")}));
        }
        out.extend(self.turns);
        out
    }
}

/// Text of a content value: a string, or a list of text parts. `allowed` are the
/// part types read as text; an image part is refused by name.
fn content_text(v: &Value, field: &str, allowed: &[&str]) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out: Vec<String> = Vec::new();
            for (j, p) in parts.iter().enumerate() {
                let f = format!("{field}[{j}]");
                if let Value::String(s) = p {
                    out.push(s.clone());
                    continue;
                }
                let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
                if allowed.contains(&ty) {
                    // A refusal part carries its text under `refusal`.
                    let key = if ty == "refusal" { "refusal" } else { "text" };
                    let t = p.get(key).and_then(Value::as_str).ok_or_else(|| {
                        ApiError::field(&f, format!("{f}.{key} must be a string"))
                    })?;
                    out.push(t.to_string());
                } else if ty.contains("image")
                    || ty.contains("audio")
                    || ty.contains("file")
                    || ty == "document"
                {
                    return Err(ApiError::field(
                        &f,
                        format!("{f}: content of type \"{ty}\" is not supported (text only)"),
                    ));
                } else {
                    return Err(ApiError::field(
                        &f,
                        format!("{f}: unknown content part type \"{ty}\""),
                    ));
                }
            }
            Ok(out.join("\n"))
        }
        other => Err(ApiError::field(
            field,
            format!("{field} must be a string or a list of content parts, got {other}"),
        )),
    }
}

/// Tool-call arguments as the templates want them: an object. Arguments that are not a
/// JSON object are refused naming `field` (a template would fail on them with an error
/// about its own source, which tells the client nothing).
fn arguments_value(v: Option<&Value>, field: &str) -> Result<Value, ApiError> {
    let not_object = |what: String| {
        ApiError::field(
            field,
            format!("{field} must be a JSON object of the function's arguments, {what}"),
        )
    };
    match v {
        None | Some(Value::Null) => Ok(json!({})),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(json!({})),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(obj @ Value::Object(_)) => Ok(obj),
            Ok(other) => Err(not_object(format!("got {other}"))),
            Err(e) => Err(not_object(format!(
                "but it does not parse as JSON ({e}): {}",
                excerpt(s)
            ))),
        },
        Some(obj @ Value::Object(_)) => Ok(obj.clone()),
        Some(other) => Err(not_object(format!("got {}", excerpt(&other.to_string())))),
    }
}

/// The start of a value for an error message.
fn excerpt(s: &str) -> String {
    const MAX: usize = 80;
    match s.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

fn check_tool_name(name: Option<&str>, field: &str) -> Result<String, ApiError> {
    match name {
        Some(n) if !n.is_empty() => Ok(n.to_string()),
        _ => Err(ApiError::field(
            field,
            format!("{field} must be a non-empty string"),
        )),
    }
}

/// OpenAI chat `tools` → the template's list; `tool_choice` "none" drops them (the
/// other choices are read and enforced by `structured`).
pub fn openai_tools(body: &Map<String, Value>) -> Result<Option<Value>, ApiError> {
    if body.get("tool_choice").and_then(Value::as_str) == Some("none") {
        return Ok(None);
    }
    let list = match body.get("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::field(
                "tools",
                format!("tools must be a list, got {v}"),
            ))
        }
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let field = format!("tools[{i}]");
        let ty = t.get("type").and_then(Value::as_str).unwrap_or("function");
        if ty != "function" {
            return Err(ApiError::field(
                &field,
                format!("{field}: tool type \"{ty}\" is not supported (only \"function\")"),
            ));
        }
        // Chat shape {"type","function":{...}}, or the flat Responses shape.
        let f = t.get("function").unwrap_or(t);
        let name = check_tool_name(
            f.get("name").and_then(Value::as_str),
            &format!("{field}.function.name"),
        )?;
        out.push(function_tool(
            &name,
            f.get("description"),
            f.get("parameters"),
        ));
    }
    Ok(if out.is_empty() {
        None
    } else {
        Some(Value::Array(out))
    })
}

fn function_tool(name: &str, description: Option<&Value>, parameters: Option<&Value>) -> Value {
    let mut f = Map::new();
    f.insert("name".into(), json!(name));
    if let Some(d) = description.filter(|d| !d.is_null()) {
        f.insert("description".into(), d.clone());
    }
    f.insert(
        "parameters".into(),
        parameters
            .filter(|p| !p.is_null())
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
    );
    json!({"type": "function", "function": f})
}

/// The request's `messages`: a non-empty list (both chat APIs).
fn messages_list(body: &Map<String, Value>) -> Result<&Vec<Value>, ApiError> {
    match body.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => Ok(a),
        Some(Value::Array(_)) => Err(ApiError::field("messages", "messages must not be empty")),
        None | Some(Value::Null) => Err(ApiError::field("messages", "messages is required")),
        Some(v) => Err(ApiError::field(
            "messages",
            format!("messages must be a list, got {v}"),
        )),
    }
}

/// OpenAI chat `messages`.
pub fn openai_chat(body: &Map<String, Value>) -> Result<Conversation, ApiError> {
    let msgs = messages_list(body)?;
    let mut b = Builder::default();
    for (i, m) in msgs.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::field(
                &format!("{field}.role"),
                format!("{field}.role is required"),
            )
        })?;
        let content_field = format!("{field}.content");
        let content = m.get("content").unwrap_or(&Value::Null);
        match role {
            "system" | "developer" => b.system(content_text(content, &content_field, &["text", "input_text"])?),
            "user" => {
                let text = content_text(content, &content_field, &["text", "input_text"])?;
                b.turns.push(json!({"role": "user", "content": text}));
            }
            "assistant" => {
                let text = content_text(content, &content_field, &["text", "output_text", "refusal"])?;
                let mut turn = json!({"role": "assistant", "content": text});
                for key in ["reasoning_content", "reasoning", "thinking"] {
                    if let Some(r) = m.get(key).and_then(Value::as_str).filter(|r| !r.is_empty()) {
                        turn["reasoning_content"] = json!(r);
                        break;
                    }
                }
                if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
                    let Value::Array(calls) = calls else {
                        return Err(ApiError::field(&format!("{field}.tool_calls"), format!("{field}.tool_calls must be a list")));
                    };
                    let mut out = Vec::new();
                    for (j, c) in calls.iter().enumerate() {
                        let cf = format!("{field}.tool_calls[{j}]");
                        let f = c.get("function").ok_or_else(|| {
                            ApiError::field(&format!("{cf}.function"), format!("{cf}.function is required"))
                        })?;
                        let name = check_tool_name(f.get("name").and_then(Value::as_str), &format!("{cf}.function.name"))?;
                        out.push(json!({
                            "id": c.get("id").cloned().unwrap_or(Value::Null),
                            "type": "function",
                            "function": {"name": name, "arguments": arguments_value(f.get("arguments"), &format!("{cf}.function.arguments"))?},
                        }));
                    }
                    turn["tool_calls"] = Value::Array(out);
                }
                b.turns.push(turn);
            }
            "tool" | "function" => {
                let text = content_text(content, &content_field, &["text"])?;
                let mut turn = json!({"role": "tool", "content": text});
                if let Some(id) = m.get("tool_call_id") {
                    turn["tool_call_id"] = id.clone();
                }
                if let Some(n) = m.get("name") {
                    turn["name"] = n.clone();
                }
                b.turns.push(turn);
            }
            other => {
                return Err(ApiError::field(
                    &format!("{field}.role"),
                    format!("{field}.role \"{other}\" is not one of system, developer, user, assistant, tool"),
                ))
            }
        }
    }
    let messages = b.finish();
    // vLLM's and HF's `continue_final_message`: continue the last assistant message.
    let continue_final = match body.get("continue_final_message") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => {
            if messages.last().is_some_and(|m| m["role"] == "assistant") {
                true
            } else {
                return Err(ApiError::field(
                    "continue_final_message",
                    "continue_final_message: the last message must be an assistant message to continue",
                ));
            }
        }
        Some(v) => {
            return Err(ApiError::field(
                "continue_final_message",
                format!("continue_final_message must be true or false, got {v}"),
            ))
        }
    };
    Ok(Conversation {
        messages,
        tools: openai_tools(body)?,
        continue_final,
    })
}

/// Anthropic `system` + `messages` + `tools`.
pub fn anthropic(body: &Map<String, Value>) -> Result<Conversation, ApiError> {
    let mut b = Builder::default();
    if let Some(s) = body.get("system").filter(|v| !v.is_null()) {
        b.system(content_text(s, "system", &["text"])?);
    }
    let msgs = messages_list(body)?;
    for (i, m) in msgs.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        // Claude Code's mid-conversation system message (a beta it turns on for model
        // names it does not know): text only, kept in place.
        if role == "system" {
            let cf = format!("{field}.content");
            b.system(content_text(
                m.get("content").unwrap_or(&Value::Null),
                &cf,
                &["text"],
            )?);
            continue;
        }
        if role != "user" && role != "assistant" {
            return Err(ApiError::field(
                &format!("{field}.role"),
                format!(
                    "{field}.role must be \"user\", \"assistant\" or \"system\", got {}",
                    m.get("role")
                        .map(Value::to_string)
                        .unwrap_or_else(|| "nothing".into())
                ),
            ));
        }
        let blocks: Vec<Value> = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(a)) => a.clone(),
            other => {
                return Err(ApiError::field(
                    &format!("{field}.content"),
                    format!(
                        "{field}.content must be a string or a list of blocks, got {}",
                        other
                            .map(Value::to_string)
                            .unwrap_or_else(|| "nothing".into())
                    ),
                ))
            }
        };
        let mut text: Vec<String> = Vec::new();
        let mut thinking: Vec<String> = Vec::new();
        let mut calls: Vec<Value> = Vec::new();
        for (j, blk) in blocks.iter().enumerate() {
            let bf = format!("{field}.content[{j}]");
            let ty = blk.get("type").and_then(Value::as_str).unwrap_or("");
            match (role, ty) {
                (_, "text") => text.push(
                    blk.get("text")
                        .and_then(Value::as_str)
                        .ok_or_else(|| {
                            ApiError::field(
                                &format!("{bf}.text"),
                                format!("{bf}.text must be a string"),
                            )
                        })?
                        .to_string(),
                ),
                ("assistant", "thinking") => {
                    if let Some(t) = blk.get("thinking").and_then(Value::as_str) {
                        thinking.push(t.to_string());
                    }
                }
                ("assistant", "redacted_thinking") => {}
                ("assistant", "tool_use") => {
                    let name = check_tool_name(
                        blk.get("name").and_then(Value::as_str),
                        &format!("{bf}.name"),
                    )?;
                    calls.push(json!({
                        "id": blk.get("id").cloned().unwrap_or(Value::Null),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments_value(blk.get("input"), &format!("{bf}.input"))?},
                    }));
                }
                ("user", "tool_result") => {
                    // Results go out as tool turns, before the user's own text.
                    let mut out = content_text(
                        blk.get("content").unwrap_or(&Value::Null),
                        &format!("{bf}.content"),
                        &["text"],
                    )?;
                    if blk.get("is_error").and_then(Value::as_bool) == Some(true)
                        && !out.starts_with("Error")
                    {
                        out = format!("Error: {out}");
                    }
                    b.turns.push(json!({
                        "role": "tool",
                        "tool_call_id": blk.get("tool_use_id").cloned().unwrap_or(Value::Null),
                        "content": out,
                    }));
                }
                (_, t) if t.contains("image") || t == "document" => {
                    return Err(ApiError::field(
                        &bf,
                        format!("{bf}: content of type \"{t}\" is not supported (text only)"),
                    ))
                }
                (r, t) => {
                    return Err(ApiError::field(
                        &bf,
                        format!("{bf}: block type \"{t}\" is not accepted in a {r} message"),
                    ))
                }
            }
        }
        if role == "user" {
            if !text.is_empty() || blocks.is_empty() {
                b.turns
                    .push(json!({"role": "user", "content": text.join("\n")}));
            }
        } else {
            let mut turn = json!({"role": "assistant", "content": text.join("\n")});
            if !thinking.is_empty() {
                turn["reasoning_content"] = json!(thinking.join("\n"));
            }
            if !calls.is_empty() {
                turn["tool_calls"] = Value::Array(calls);
            }
            b.turns.push(turn);
        }
    }
    // Tools: {"name", "description", "input_schema"}; server tools (typed) are skipped.
    let mut tools = Vec::new();
    let choice = body
        .get("tool_choice")
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str);
    // `any` and `tool` are read and enforced by `structured`.
    if let Some(list) = body.get("tools").filter(|v| !v.is_null()) {
        let Value::Array(list) = list else {
            return Err(ApiError::field("tools", "tools must be a list"));
        };
        for (i, t) in list.iter().enumerate() {
            let ty = t.get("type").and_then(Value::as_str).unwrap_or("custom");
            if ty != "custom" {
                continue;
            }
            let name = check_tool_name(
                t.get("name").and_then(Value::as_str),
                &format!("tools[{i}].name"),
            )?;
            tools.push(function_tool(
                &name,
                t.get("description"),
                t.get("input_schema"),
            ));
        }
    }
    let tools = if tools.is_empty() || choice == Some("none") {
        None
    } else {
        Some(Value::Array(tools))
    };
    let messages = b.finish();
    // A final assistant message is a prefill: the answer continues it.
    let continue_final = messages
        .last()
        .is_some_and(|m| m["role"] == "assistant" && m.get("tool_calls").is_none());
    Ok(Conversation {
        messages,
        tools,
        continue_final,
    })
}

/// Responses `instructions` + `input` + `tools`.
pub fn responses(body: &Map<String, Value>) -> Result<Conversation, ApiError> {
    let mut b = Builder::default();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => b.system(s.clone()),
        Some(v) => {
            return Err(ApiError::field(
                "instructions",
                format!("instructions must be a string, got {v}"),
            ))
        }
    }
    match body.get("input") {
        Some(Value::String(s)) => b.turns.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let field = format!("input[{i}]");
                let ty = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                match ty {
                    "message" => {
                        let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                        let cf = format!("{field}.content");
                        let content = item.get("content").unwrap_or(&Value::Null);
                        match role {
                            "system" | "developer" => b.system(content_text(content, &cf, &["input_text", "text"])?),
                            "user" => {
                                let t = content_text(content, &cf, &["input_text", "text"])?;
                                b.turns.push(json!({"role": "user", "content": t}));
                            }
                            "assistant" => {
                                let t = content_text(content, &cf, &["output_text", "text", "refusal"])?;
                                b.turns.push(json!({"role": "assistant", "content": t}));
                            }
                            other => {
                                return Err(ApiError::field(
                                    &format!("{field}.role"),
                                    format!("{field}.role \"{other}\" is not one of system, developer, user, assistant"),
                                ))
                            }
                        }
                    }
                    "function_call" => {
                        let name = check_tool_name(
                            item.get("name").and_then(Value::as_str),
                            &format!("{field}.name"),
                        )?;
                        b.assistant_tool_call(json!({
                            "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                            "type": "function",
                            "function": {"name": name, "arguments": arguments_value(item.get("arguments"), &format!("{field}.arguments"))?},
                        }));
                    }
                    "function_call_output" => {
                        let out = match item.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v @ Value::Array(_)) => content_text(
                                v,
                                &format!("{field}.output"),
                                &["input_text", "output_text", "text"],
                            )?,
                            Some(v) => v.to_string(),
                            None => String::new(),
                        };
                        b.turns.push(json!({
                            "role": "tool",
                            "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                            "content": out,
                        }));
                    }
                    // A freeform (custom) tool call: its text input becomes {"input": ...}.
                    "custom_tool_call" => {
                        let name = check_tool_name(
                            item.get("name").and_then(Value::as_str),
                            &format!("{field}.name"),
                        )?;
                        let input = item.get("input").cloned().unwrap_or(json!(""));
                        b.assistant_tool_call(json!({
                            "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                            "type": "function",
                            "function": {"name": name, "arguments": {"input": input}},
                        }));
                    }
                    "custom_tool_call_output" => {
                        let out = match item.get("output") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v) => v.to_string(),
                            None => String::new(),
                        };
                        b.turns.push(json!({
                            "role": "tool",
                            "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                            "content": out,
                        }));
                    }
                    // Reasoning echoed back from an earlier turn carries nothing we can use.
                    "reasoning" => {}
                    other => {
                        return Err(ApiError::field(
                            &format!("{field}.type"),
                            format!("{field}.type \"{other}\" is not supported"),
                        ))
                    }
                }
            }
        }
        None | Some(Value::Null) => return Err(ApiError::field("input", "input is required")),
        Some(v) => {
            return Err(ApiError::field(
                "input",
                format!("input must be a string or a list of items, got {v}"),
            ))
        }
    }
    // Tools: functions are used, a namespace's nested functions too; others ignored.
    let mut tools = Vec::new();
    if let Some(Value::Array(list)) = body.get("tools") {
        for (i, t) in list.iter().enumerate() {
            collect_response_tools(t, &format!("tools[{i}]"), &mut tools)?;
        }
    }
    let choice_none = body.get("tool_choice").and_then(Value::as_str) == Some("none");
    // Forced choices are read and enforced by `structured`.
    Ok(Conversation {
        messages: b.finish(),
        tools: if tools.is_empty() || choice_none {
            None
        } else {
            Some(Value::Array(tools))
        },
        continue_final: false,
    })
}

fn collect_response_tools(t: &Value, field: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    match t.get("type").and_then(Value::as_str) {
        Some("function") => {
            let f = t.get("function").unwrap_or(t);
            let name = check_tool_name(
                f.get("name").and_then(Value::as_str),
                &format!("{field}.name"),
            )?;
            out.push(function_tool(
                &name,
                f.get("description"),
                f.get("parameters"),
            ));
        }
        Some("namespace") => {
            if let Some(Value::Array(inner)) = t.get("tools") {
                for (j, it) in inner.iter().enumerate() {
                    collect_response_tools(it, &format!("{field}.tools[{j}]"), out)?;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Whether rendered prompt text leaves the model inside an open think block.
pub fn ends_in_open_think(prompt: &str) -> bool {
    let open = prompt.rfind("<think>");
    let close = prompt.rfind("</think>");
    match (open, close) {
        (Some(o), Some(c)) => o > c && prompt[o..].trim() == "<think>",
        (Some(o), None) => prompt[o..].trim() == "<think>",
        _ => false,
    }
}

/// A ChatML renderer in the Qwen layout, used when the model file has no template.
pub struct ChatMl;

impl PromptRender for ChatMl {
    fn render(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        enable_thinking: bool,
        _extra: &Map<String, Value>,
    ) -> Result<String, String> {
        let mut out = String::new();
        let mut rest = messages;
        let mut system = String::new();
        if let Some(first) = messages.first() {
            if first["role"] == "system" {
                system = first["content"].as_str().unwrap_or("").to_string();
                rest = &messages[1..];
            }
        }
        if let Some(Value::Array(ts)) = tools {
            if !system.is_empty() {
                system.push_str("\n\n");
            }
            system.push_str("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>");
            for t in ts {
                system.push('\n');
                system.push_str(&t.to_string());
            }
            system.push_str("\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
        }
        if !system.is_empty() {
            out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
        }
        for m in rest {
            let role = m["role"].as_str().unwrap_or("user");
            let content = m["content"].as_str().unwrap_or("");
            match role {
                "tool" => out.push_str(&format!(
                    "<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n"
                )),
                "assistant" => {
                    out.push_str("<|im_start|>assistant\n");
                    out.push_str(content);
                    if let Some(Value::Array(calls)) = m.get("tool_calls") {
                        for c in calls {
                            let call = json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]});
                            out.push_str(&format!("\n<tool_call>\n{call}\n</tool_call>"));
                        }
                    }
                    out.push_str("<|im_end|>\n");
                }
                r => out.push_str(&format!("<|im_start|>{r}\n{content}<|im_end|>\n")),
            }
        }
        out.push_str("<|im_start|>assistant\n");
        if enable_thinking {
            out.push_str("<think>\n");
        } else {
            out.push_str("<think>\n\n</think>\n\n");
        }
        Ok(out)
    }

    fn render_without_generation_prompt(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        enable_thinking: bool,
        extra: &Map<String, Value>,
    ) -> Result<String, String> {
        let out = self.render(messages, tools, enable_thinking, extra)?;
        let prompt = "<|im_start|>assistant\n";
        Ok(out
            .strip_suffix(if enable_thinking {
                "<think>\n"
            } else {
                "<think>\n\n</think>\n\n"
            })
            .and_then(|o| o.strip_suffix(prompt))
            .unwrap_or(&out)
            .to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn leading_system_text_joins_later_system_turns_stay_in_place() {
        let c = openai_chat(&obj(json!({"messages": [
            {"role": "system", "content": "S"},
            {"role": "developer", "content": "D0"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "developer", "content": "D"},
        ]})))
        .unwrap();
        assert_eq!(
            c.messages,
            vec![
                json!({"role": "system", "content": "S\n\nD0"}),
                json!({"role": "user", "content": "hi"}),
                json!({"role": "system", "content": "D"}),
            ]
        );
        assert!(c.has_later_system());
        // Folded, for templates that take a system message only first.
        assert_eq!(
            c.folded(),
            vec![
                json!({"role": "system", "content": "S\n\nD0\n\nD"}),
                json!({"role": "user", "content": "hi"}),
            ]
        );
    }

    #[test]
    fn anthropic_accepts_a_system_message_inside_messages() {
        // Claude Code's mid-conversation system message, as messages[1].
        let c = anthropic(&obj(json!({
            "system": "Base.",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": [{"type": "text", "text": "Agents: a, b"}]},
                {"role": "user", "content": "go"},
            ],
        })))
        .unwrap();
        assert_eq!(
            c.messages[2],
            json!({"role": "system", "content": "Agents: a, b"})
        );
        assert_eq!(
            c.folded()[0],
            json!({"role": "system", "content": "Base.\n\nAgents: a, b"})
        );
        // Before any turn it simply joins the system prompt.
        let c = anthropic(&obj(json!({"messages": [
            {"role": "system", "content": "First."},
            {"role": "user", "content": "hi"}]})))
        .unwrap();
        assert_eq!(
            c.messages[0],
            json!({"role": "system", "content": "First."})
        );
        assert!(!c.has_later_system());
    }

    #[test]
    fn assistant_tool_call_arguments_become_objects() {
        let c = openai_chat(&obj(json!({"messages": [
            {"role": "user", "content": "w?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})))
        .unwrap();
        assert_eq!(
            c.messages[1]["tool_calls"][0]["function"]["arguments"]["x"],
            1
        );
        assert_eq!(c.messages[2]["role"], "tool");
        assert!(c.tools.is_some());
    }

    #[test]
    fn bad_messages_name_the_field() {
        let e = openai_chat(&obj(
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
        ))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = openai_chat(&obj(json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:"}}]}]})))
        .unwrap_err();
        assert!(e.message.contains("messages[0].content[0]"));
        assert!(openai_chat(&obj(json!({})))
            .unwrap_err()
            .message
            .contains("messages"));
    }

    #[test]
    fn anthropic_blocks() {
        let c = anthropic(&obj(json!({
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "cold"}]},
                    {"type": "text", "text": "thanks"}]},
            ],
            "tools": [{"name": "get", "input_schema": {"type": "object"}},
                      {"type": "web_search_20250305", "name": "web_search"}],
        })))
        .unwrap();
        assert_eq!(c.messages[0]["content"], "Be brief.");
        assert_eq!(c.messages[2]["reasoning_content"], "hmm");
        assert_eq!(
            c.messages[2]["tool_calls"][0]["function"]["arguments"]["city"],
            "Oslo"
        );
        assert_eq!(
            c.messages[3],
            json!({"role": "tool", "tool_call_id": "t1", "content": "cold"})
        );
        assert_eq!(c.messages[4]["content"], "thanks");
        assert_eq!(c.tools.as_ref().unwrap().as_array().unwrap().len(), 1);
    }

    #[test]
    fn responses_items_round_trip() {
        let c = responses(&obj(json!({
            "instructions": "I",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "go"}]},
                {"type": "reasoning", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{\"cmd\":\"ls\"}"},
                {"type": "function_call", "call_id": "c2", "name": "sh", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            ],
            "tools": [{"type": "function", "name": "sh", "parameters": {"type": "object"}},
                      {"type": "web_search"},
                      {"type": "namespace", "tools": [{"type": "function", "name": "inner"}]}],
        })))
        .unwrap();
        assert_eq!(c.messages[0]["content"], "I\n\nD");
        assert_eq!(c.messages[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(
            c.messages[2]["tool_calls"][0]["function"]["arguments"]["cmd"],
            "ls"
        );
        assert_eq!(c.messages[3]["role"], "tool");
        assert_eq!(c.tools.as_ref().unwrap().as_array().unwrap().len(), 2);
    }

    #[test]
    fn open_think_detection() {
        assert!(ends_in_open_think("<|im_start|>assistant\n<think>\n"));
        assert!(!ends_in_open_think(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!ends_in_open_think("<|im_start|>assistant\n"));
    }
}
