//! The one message list the chat template reads, built from each API's conversation
//! (`api::*::conversation`), and the renderers that turn it into prompt text.
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
    /// The images the messages carry: a content item `{"type": "image", "image": K}`
    /// stands for `images[K]` (see `images`).
    pub images: Vec<crate::images::ImageInput>,
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

/// Lines of a system prompt that change from session to session and tell a model
/// nothing: Claude Code starts its system prompt with
/// `x-anthropic-billing-header: cc_version=2.1.197.f2f; cc_entrypoint=sdk-cli;`, whose
/// suffix after the version changes with each session's first prompt, so two sessions
/// would share no cached prefix at all. Matched at the start of a line, any case.
pub const SESSION_NOISE_PREFIXES: &[&str] = &["x-anthropic-billing-header:"];

/// `text` without its session-noise lines (and the blank lines they leave at its
/// start); None when there were none.
pub fn strip_noise_lines(text: &str) -> Option<String> {
    let noisy = |line: &str| {
        let l = line.trim_start();
        SESSION_NOISE_PREFIXES.iter().any(|p| {
            l.get(..p.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(p))
        })
    };
    if !text.lines().any(noisy) {
        return None;
    }
    let kept: Vec<&str> = text.split('\n').filter(|l| !noisy(l)).collect();
    Some(kept.join("\n").trim_start_matches(['\n', '\r']).to_string())
}

impl Conversation {
    /// Removes session noise ([`SESSION_NOISE_PREFIXES`]) from every system message;
    /// a system message left empty is dropped. True when anything was removed.
    pub fn strip_session_noise(&mut self) -> bool {
        let mut changed = false;
        self.messages.retain_mut(|m| {
            if m["role"] != "system" {
                return true;
            }
            let Some(clean) = m["content"].as_str().and_then(strip_noise_lines) else {
                return true;
            };
            changed = true;
            if clean.trim().is_empty() {
                return false;
            }
            m["content"] = Value::String(clean);
            true
        });
        changed
    }
}

/// Collects system text and turns, then produces the final list.
#[derive(Default)]
pub struct Builder {
    system: Vec<String>,
    turns: Vec<Value>,
    images: Vec<crate::images::ImageInput>,
}

impl Builder {
    /// System text: part of the leading system message until the first turn, a
    /// system turn in place after it.
    pub fn system(&mut self, text: String) {
        if text.is_empty() {
        } else if self.turns.is_empty() {
            self.system.push(text);
        } else {
            self.turns.push(json!({"role": "system", "content": text}));
        }
    }

    /// A user turn (text, or what [`Builder::content`] made).
    pub fn user(&mut self, content: impl Into<Value>) {
        self.turns
            .push(json!({"role": "user", "content": content.into()}));
    }

    /// A message's content from its text and images: the text parts joined by
    /// newlines when there is no image (as before images); else a list of text and
    /// `{"type": "image", "image": K}` items in order (adjacent text joined by
    /// newlines), the images kept for rendering.
    pub fn content(&mut self, items: Vec<crate::api::content::Item>) -> Value {
        use crate::api::content::Item;
        if !items.iter().any(|i| matches!(i, Item::Image(_))) {
            let texts: Vec<String> = items
                .into_iter()
                .filter_map(|i| match i {
                    Item::Text(t) => Some(t),
                    Item::Image(_) => None,
                })
                .collect();
            return Value::String(texts.join("\n"));
        }
        let mut out: Vec<Value> = Vec::new();
        let mut text: Option<String> = None;
        for i in items {
            match i {
                Item::Text(t) => match &mut text {
                    Some(s) => {
                        s.push('\n');
                        s.push_str(&t);
                    }
                    None => text = Some(t),
                },
                Item::Image(img) => {
                    if let Some(t) = text.take() {
                        out.push(json!({"type": "text", "text": t}));
                    }
                    out.push(json!({"type": "image", "image": self.images.len()}));
                    self.images.push(img);
                }
            }
        }
        if let Some(t) = text {
            out.push(json!({"type": "text", "text": t}));
        }
        Value::Array(out)
    }

    /// A turn as it stands.
    pub fn push(&mut self, turn: Value) {
        self.turns.push(turn);
    }

    /// A tool's result (text, or what [`Builder::content`] made).
    pub fn tool_result(&mut self, call_id: Value, content: impl Into<Value>) {
        self.turns.push(json!({
            "role": "tool",
            "tool_call_id": call_id,
            "content": content.into(),
        }));
    }

    /// Adds a tool call to the last assistant turn if it is one, else a new turn.
    pub fn assistant_tool_call(&mut self, call: Value) {
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

    /// The images [`Builder::content`] kept, in the order their items number them.
    pub fn take_images(&mut self) -> Vec<crate::images::ImageInput> {
        std::mem::take(&mut self.images)
    }

    pub fn finish(self) -> Vec<Value> {
        let mut out = Vec::with_capacity(self.turns.len() + 1);
        if !self.system.is_empty() {
            out.push(json!({"role": "system", "content": self.system.join("\n\n")}));
        }
        out.extend(self.turns);
        out
    }
}

/// A function tool in the shape the templates take
/// (`{"type": "function", "function": {"name", "description", "parameters"}}`).
pub fn function_tool(name: &str, description: Option<&Value>, parameters: Option<&Value>) -> Value {
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

/// A message's content as ChatML text: a string as it is; a list's text items, and
/// each image item as the Qwen vision placeholder.
fn chatml_content(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(items) => items
            .iter()
            .map(|i| match i["type"].as_str() {
                Some("image") => "<|vision_start|><|image_pad|><|vision_end|>",
                _ => i["text"].as_str().unwrap_or(""),
            })
            .collect(),
        _ => String::new(),
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
            let content = &chatml_content(&m["content"]);
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

    #[test]
    fn session_noise_lines_are_dropped_from_system_messages_only() {
        let header = "x-anthropic-billing-header: cc_version=2.1.197.f2f; cc_entrypoint=sdk-cli;";
        let mut c = Conversation {
            messages: vec![
                json!({"role": "system", "content": format!("{header}\nYou are Claude Code.")}),
                json!({"role": "user", "content": header}),
                json!({"role": "system", "content": "X-Anthropic-Billing-Header: cc_version=1"}),
            ],
            ..Default::default()
        };
        assert!(c.strip_session_noise());
        assert_eq!(
            c.messages,
            vec![
                json!({"role": "system", "content": "You are Claude Code."}),
                json!({"role": "user", "content": header}),
            ]
        );
        assert!(!c.strip_session_noise());
        assert_eq!(strip_noise_lines("a\nb"), None);
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
