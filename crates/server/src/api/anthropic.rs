//! Anthropic Messages: the request as sent, what it becomes, and the message and
//! stream events the route answers with.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::common::{Common, Route};
use super::content::{self, Content, Item, Part, TypedPart, TEXT_PARTS};
use super::field::{objects, Field, FromJson};
use super::Timings;
use crate::error::ApiError;
use crate::params::GenParams;
use crate::prompt::{function_tool, Builder, Conversation};
use crate::settings::RequestDefaults;
use crate::structured::{self, Spec};

// ---------------------------------------------------------------- requests

/// `POST /v1/messages` and `/v1/messages/count_tokens`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct MessagesRequest {
    pub system: Field<Content>,
    pub messages: Field<Vec<Field<Message>>>,
    pub tools: Field<Vec<Field<Tool>>>,
    pub tool_choice: Field<ToolChoice>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Message {
    pub role: Field<String>,
    pub content: Field<Blocks>,
}

/// A message's content: a string, or a list of content blocks.
#[derive(Debug)]
pub enum Blocks {
    Text(String),
    List(Vec<Field<Block>>),
}

impl FromJson for Blocks {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(Blocks::Text(s)),
            Value::Array(a) => Ok(Blocks::List(a.into_iter().map(Field::from_value).collect())),
            other => Err(other),
        }
    }
}

/// A content block: `text`, `thinking`, `redacted_thinking`, `tool_use`,
/// `tool_result` (and the image and document blocks we refuse).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Block {
    /// Its `type` and `text`, as a content part's.
    #[serde(flatten)]
    pub part: TypedPart,
    pub thinking: Field<String>,
    /// `tool_use`: passed to the template as sent.
    pub id: Field<Value>,
    pub name: Field<String>,
    pub input: Field<Value>,
    /// `tool_result`: passed to the template as sent.
    pub tool_use_id: Field<Value>,
    pub content: Field<Content>,
    pub is_error: Field<bool>,
}

/// A client tool (`{"name", "description", "input_schema"}`, type `custom` or none);
/// typed server tools (web search, ...) are skipped.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: Field<String>,
    pub name: Field<String>,
    pub description: Field<Value>,
    pub input_schema: Field<Value>,
}

/// `tool_choice`: `{"type": "auto" | "any" | "tool" | "none", "name",
/// "disable_parallel_tool_use"}`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ToolChoice {
    #[serde(rename = "type")]
    pub kind: Field<String>,
    pub name: Field<String>,
    pub disable_parallel_tool_use: Field<bool>,
}

objects!(MessagesRequest, Message, Block, Tool, ToolChoice);

// ---------------------------------------------------------------- what requests become

impl MessagesRequest {
    /// `system`, `messages` and `tools`, as the template reads them. A final assistant
    /// message is a prefill: the answer continues it.
    pub fn conversation(&self) -> Result<Conversation, ApiError> {
        let mut b = Builder::default();
        if self.system.is_set() {
            b.system(content::text(&self.system, "system", TEXT_PARTS)?);
        }
        let msgs = content::messages(&self.messages)?;
        let empty = Message::default();
        for (i, m) in msgs.iter().enumerate() {
            let field = format!("messages[{i}]");
            let m = m.ok().unwrap_or(&empty);
            message(&mut b, m, &field)?;
        }
        let tools = self.template_tools()?;
        let images = b.take_images();
        let messages = b.finish();
        let continue_final = messages
            .last()
            .is_some_and(|m| m["role"] == "assistant" && m.get("tool_calls").is_none());
        Ok(Conversation {
            messages,
            tools,
            continue_final,
            images,
        })
    }

    /// The client tools as the template takes them (none when `tool_choice` is `none`;
    /// `any` and `tool` are enforced by structured output).
    fn template_tools(&self) -> Result<Option<Value>, ApiError> {
        let list = match &self.tools {
            Field::Absent | Field::Null => return Ok(None),
            Field::Ok(list) => list,
            Field::Wrong(_) => return Err(ApiError::field("tools", "tools must be a list")),
        };
        let empty = Tool::default();
        let mut tools = Vec::new();
        for (i, t) in list.iter().enumerate() {
            let t = t.ok().unwrap_or(&empty);
            if t.kind.str().unwrap_or("custom") != "custom" {
                continue;
            }
            let name = content::tool_name(&t.name, &format!("tools[{i}].name"))?;
            let schema =
                content::tool_schema(&t.input_schema, &format!("tools[{i}].input_schema"))?;
            tools.push(function_tool(&name, t.description.ok(), schema));
        }
        let none = self.choice().kind.str() == Some("none");
        Ok(if tools.is_empty() || none {
            None
        } else {
            Some(Value::Array(tools))
        })
    }

    /// `tool_choice`, read leniently (anything but an object is no choice).
    fn choice(&self) -> &ToolChoice {
        static NONE: ToolChoice = ToolChoice {
            kind: Field::Absent,
            name: Field::Absent,
            disable_parallel_tool_use: Field::Absent,
        };
        self.tool_choice.ok().unwrap_or(&NONE)
    }

    /// The generation parameters: the thinking controls, the shared fields (Anthropic's
    /// ranges and names), and `tool_choice` `any` / `tool` with
    /// `disable_parallel_tool_use`.
    pub fn params(
        &self,
        defaults: &RequestDefaults,
        n_vocab: usize,
        conv: &Conversation,
    ) -> Result<GenParams, ApiError> {
        let thinking = self.common.thinking(defaults)?;
        let mut p = self
            .common
            .params(&Route::MESSAGES, defaults, n_vocab, thinking)?;
        p.constraint = self.structured(conv.tools.as_ref())?;
        Ok(p)
    }

    /// Structured output: `tool_choice` `any` / `tool` and `disable_parallel_tool_use`
    /// over the conversation's tools.
    pub fn structured(&self, conv_tools: Option<&Value>) -> Result<Option<Spec>, ApiError> {
        let tools = structured::tools_of(conv_tools);
        let choice = self.choice();
        let single = choice.disable_parallel_tool_use.is_true();
        let (force, tools) = match choice.kind.str() {
            None | Some("auto") | Some("none") => (false, tools),
            Some("any") => {
                if tools.is_empty() {
                    return Err(ApiError::field(
                        "tool_choice",
                        "tool_choice: \"any\" needs at least one tool in tools",
                    ));
                }
                (true, tools)
            }
            Some("tool") => {
                let name = choice.name.str().ok_or_else(|| {
                    ApiError::field(
                        "tool_choice.name",
                        "tool_choice.name: a tool name is required",
                    )
                })?;
                (true, structured::only_named(tools, name, "tool_choice.name")?)
            }
            Some(other) => {
                return Err(ApiError::field(
                    "tool_choice.type",
                    format!(
                        "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\", got \"{other}\""
                    ),
                ))
            }
        };
        Ok(structured::finish(None, tools, force, single))
    }
}

/// One message: a system message's text (Claude Code's mid-conversation system
/// message, kept in place), a user turn (its tool results first, as tool turns), or
/// an assistant turn with its thinking and tool calls.
fn message(b: &mut Builder, m: &Message, field: &str) -> Result<(), ApiError> {
    let role = m.role.str().unwrap_or("");
    if role == "system" {
        let text = match &m.content {
            Field::Ok(Blocks::Text(s)) => s.clone(),
            // As content parts: text only.
            other => content::text(&as_content(other), &format!("{field}.content"), TEXT_PARTS)?,
        };
        b.system(text);
        return Ok(());
    }
    if role != "user" && role != "assistant" {
        return Err(ApiError::field(
            &format!("{field}.role"),
            format!(
                "{field}.role must be \"user\", \"assistant\" or \"system\", got {}",
                m.role.shown()
            ),
        ));
    }
    let blocks: &[Field<Block>] = match &m.content {
        Field::Ok(Blocks::Text(s)) => {
            b.push(turn(role, json!(s), Vec::new(), Vec::new()));
            return Ok(());
        }
        Field::Ok(Blocks::List(list)) => list,
        Field::Absent => return Err(content_error(field, "nothing")),
        Field::Null => return Err(content_error(field, "null")),
        Field::Wrong(v) => return Err(content_error(field, &v.to_string())),
    };
    let mut text: Vec<Item> = Vec::new();
    let mut thinking: Vec<String> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    let empty = Block::default();
    for (j, blk) in blocks.iter().enumerate() {
        let bf = format!("{field}.content[{j}]");
        let blk = blk.ok().unwrap_or(&empty);
        let ty = blk.part.kind.str().unwrap_or("");
        match (role, ty) {
            (_, "text") => text.push(Item::Text(
                blk.part
                    .text
                    .str()
                    .ok_or_else(|| {
                        ApiError::field(
                            &format!("{bf}.text"),
                            format!("{bf}.text must be a string"),
                        )
                    })?
                    .to_string(),
            )),
            ("user", "image") => text.push(Item::Image(content::image(&blk.part, "image", &bf)?)),
            ("assistant", "thinking") => {
                if let Some(t) = blk.thinking.str() {
                    thinking.push(t.to_string());
                }
            }
            ("assistant", "redacted_thinking") => {}
            ("assistant", "tool_use") => {
                let name = content::tool_name(&blk.name, &format!("{bf}.name"))?;
                calls.push(json!({
                    "id": blk.id.or_null(),
                    "type": "function",
                    "function": {"name": name, "arguments": content::arguments(&blk.input, &format!("{bf}.input"))?},
                }));
            }
            ("user", "tool_result") => {
                // Results go out as tool turns, before the user's own text.
                let cf = format!("{bf}.content");
                let mut items = content::items(&blk.content, &cf, TEXT_PARTS, true)?;
                if blk.is_error.is_true() {
                    match items.first_mut() {
                        Some(Item::Text(t)) if t.starts_with("Error") => {}
                        Some(Item::Text(t)) => *t = format!("Error: {t}"),
                        _ => items.insert(0, Item::Text("Error: ".into())),
                    }
                }
                let out = b.content(items);
                b.push(json!({
                    "role": "tool",
                    "tool_call_id": blk.tool_use_id.or_null(),
                    "content": out,
                }));
            }
            (_, t) if t.contains("image") || t == "document" => {
                return Err(ApiError::field(
                    &bf,
                    format!("{bf}: content of type \"{t}\" is not supported here (images go in user messages and tool results)"),
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
    if role == "user" && text.is_empty() && !blocks.is_empty() {
        // Only tool results.
        return Ok(());
    }
    let content = b.content(text);
    b.push(turn(role, content, thinking, calls));
    Ok(())
}

/// A user or assistant turn.
fn turn(role: &str, content: Value, thinking: Vec<String>, calls: Vec<Value>) -> Value {
    let mut turn = json!({"role": role, "content": content});
    if !thinking.is_empty() {
        turn["reasoning_content"] = json!(thinking.join("\n"));
    }
    if !calls.is_empty() {
        turn["tool_calls"] = Value::Array(calls);
    }
    turn
}

fn content_error(field: &str, got: &str) -> ApiError {
    ApiError::field(
        &format!("{field}.content"),
        format!("{field}.content must be a string or a list of blocks, got {got}"),
    )
}

/// A system message's blocks read as content parts.
fn as_content(f: &Field<Blocks>) -> Field<Content> {
    match f {
        Field::Absent => Field::Absent,
        Field::Null => Field::Null,
        Field::Ok(Blocks::Text(s)) => Field::Ok(Content::Text(s.clone())),
        Field::Ok(Blocks::List(list)) => Field::Ok(Content::Parts(
            list.iter()
                .map(|b| match b {
                    Field::Ok(b) => Field::Ok(Part::Typed(Box::new(b.part.clone()))),
                    Field::Null => Field::Null,
                    Field::Absent => Field::Absent,
                    // A string is a text part.
                    Field::Wrong(v) => Field::from_value(v.clone()),
                })
                .collect(),
        )),
        Field::Wrong(v) => Field::Wrong(v.clone()),
    }
}

// ---------------------------------------------------------------- responses

/// `usage` of a message, as Anthropic defines it: `input_tokens` are the prompt
/// tokens read afresh, `cache_read_input_tokens` those reused from cached state, and
/// `cache_creation_input_tokens` those written to a cache on request (none: the
/// server keeps what it reads without being asked); the three add up to the prompt.
/// Sent whole in `message_start`, `message_delta` and the non-streamed message.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Usage {
    pub input_tokens: usize,
    pub cache_creation_input_tokens: usize,
    pub cache_read_input_tokens: usize,
    pub output_tokens: usize,
}

impl Usage {
    /// A prompt of `prompt` tokens, `cached` of them reused, and `output` generated.
    pub fn of(prompt: usize, cached: usize, output: usize) -> Usage {
        let cached = cached.min(prompt);
        Usage {
            input_tokens: prompt - cached,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: cached,
            output_tokens: output,
        }
    }
}

/// A message (the non-streaming answer).
#[derive(Debug, Serialize)]
pub struct MessageOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: String,
    pub content: Vec<BlockOut>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// A content block of the answer.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockOut {
    Thinking {
        thinking: String,
        signature: String,
    },
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

/// A content block's delta.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum DeltaOut {
    ThinkingDelta { thinking: String },
    TextDelta { text: String },
    InputJsonDelta { partial_json: String },
}

/// One event of a message stream (its SSE `event:` name is its `type`).
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    MessageStart {
        message: MessageOut,
    },
    Ping,
    ContentBlockStart {
        index: usize,
        content_block: BlockOut,
    },
    ContentBlockDelta {
        index: usize,
        delta: DeltaOut,
    },
    ContentBlockStop {
        index: usize,
    },
    MessageDelta {
        delta: StopDelta,
        usage: Usage,
        timings: Timings,
    },
    MessageStop,
}

#[derive(Debug, Serialize)]
pub struct StopDelta {
    pub stop_reason: &'static str,
    pub stop_sequence: Option<String>,
}

impl Event {
    /// The SSE event name.
    pub fn name(&self) -> &'static str {
        match self {
            Event::MessageStart { .. } => "message_start",
            Event::Ping => "ping",
            Event::ContentBlockStart { .. } => "content_block_start",
            Event::ContentBlockDelta { .. } => "content_block_delta",
            Event::ContentBlockStop { .. } => "content_block_stop",
            Event::MessageDelta { .. } => "message_delta",
            Event::MessageStop => "message_stop",
        }
    }
}
