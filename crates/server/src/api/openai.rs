//! OpenAI chat completions and completions: the requests as sent, what they become
//! (a conversation, the generation parameters, the structured-output spec), and the
//! objects and chunks the routes answer with. The message, tool, tool-choice and
//! format types are the Responses API's too.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::common::{Common, Route};
use super::content::{self, Content, ASSISTANT_PARTS, TEXT_PARTS, USER_PARTS};
use super::field::{objects, Field, FromJson};
use super::Timings;
use crate::error::ApiError;
use crate::params::{GenParams, Thinking};
use crate::prompt::{function_tool, Builder, Conversation};
use crate::settings::RequestDefaults;
use crate::structured::{self, JsonAnswer, Spec, Tool as SpecTool};
use crate::worker::Finished;

// ---------------------------------------------------------------- requests

/// `POST /v1/chat/completions`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ChatRequest {
    pub messages: Field<Vec<Field<Message>>>,
    /// vLLM's and HF's `continue_final_message`: continue the last assistant message.
    pub continue_final_message: Field<bool>,
    pub tools: Field<Vec<Field<Tool>>>,
    pub tool_choice: Field<ToolChoice>,
    pub parallel_tool_calls: Field<bool>,
    pub response_format: Field<Format>,
    #[serde(flatten)]
    pub common: Common,
}

/// `POST /v1/completions`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    pub prompt: Field<Prompt>,
    pub response_format: Field<Format>,
    #[serde(flatten)]
    pub common: Common,
}

/// A chat message (and, for its role and content, a Responses message item).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Message {
    pub role: Field<String>,
    pub content: Field<Content>,
    /// An assistant turn's reasoning, under the names clients use.
    pub reasoning_content: Field<String>,
    pub reasoning: Field<String>,
    pub thinking: Field<String>,
    pub tool_calls: Field<Vec<Field<ToolCall>>>,
    /// A tool result's call id and function name, passed to the template as sent.
    pub tool_call_id: Field<Value>,
    pub name: Field<Value>,
}

/// A tool call in an assistant message.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ToolCall {
    /// Passed to the template as sent.
    pub id: Field<Value>,
    pub function: Field<FunctionCall>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct FunctionCall {
    pub name: Field<String>,
    /// A JSON object's text (or the object).
    pub arguments: Field<Value>,
}

/// A tool: `{"type": "function", "function": {...}}` (chat), the same function
/// flat (Responses), or a Responses namespace of tools.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: Field<String>,
    pub function: Field<Function>,
    #[serde(flatten)]
    pub flat: Function,
    /// A namespace's tools.
    pub tools: Field<Vec<Field<Tool>>>,
    /// A Responses custom (freeform) tool's input format: `{"type": "text"}` or
    /// `{"type": "grammar", "syntax", "definition"}`.
    pub format: Field<Value>,
}

/// A function's name, description and parameter schema (the schema passes through).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Function {
    pub name: Field<String>,
    pub description: Field<Value>,
    pub parameters: Field<Value>,
}

/// `tool_choice`: `"auto"`, `"none"`, `"required"`, or a named function (chat:
/// `{"type": "function", "function": {"name"}}`; Responses: `{"type": "function",
/// "name"}`).
#[derive(Debug)]
pub enum ToolChoice {
    Mode(String),
    /// An object: as sent (for the error message) and as read.
    Object(Value, Box<Named>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Named {
    #[serde(rename = "type")]
    pub kind: Field<String>,
    pub function: Field<NamedFunction>,
    pub name: Field<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct NamedFunction {
    pub name: Field<Value>,
}

impl FromJson for ToolChoice {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(ToolChoice::Mode(s)),
            v @ Value::Object(_) => {
                let named = Named::from_json(v.clone())?;
                Ok(ToolChoice::Object(v, Box::new(named)))
            }
            other => Err(other),
        }
    }
}

/// An answer format: `response_format` (chat, completions: the schema under
/// `json_schema`) or Responses' `text.format` (the schema beside `type`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Format {
    #[serde(rename = "type")]
    pub kind: Field<String>,
    pub json_schema: Field<SchemaHolder>,
    pub schema: Field<Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SchemaHolder {
    pub schema: Field<Value>,
}

/// A completions prompt: a string, token ids, or a one-element list of either.
#[derive(Debug)]
pub enum Prompt {
    Text(String),
    List(Vec<Value>),
}

impl FromJson for Prompt {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(Prompt::Text(s)),
            Value::Array(a) => Ok(Prompt::List(a)),
            other => Err(other),
        }
    }
}

objects!(
    ChatRequest,
    CompletionRequest,
    Message,
    ToolCall,
    FunctionCall,
    Tool,
    Function,
    Named,
    NamedFunction,
    Format,
    SchemaHolder
);

// ---------------------------------------------------------------- what requests become

/// The text a system, developer, user or assistant message says, as both OpenAI APIs
/// write it; None for another role (each API handles or refuses it itself).
pub(crate) fn role_text(
    role: &str,
    content: &Field<Content>,
    field: &str,
) -> Result<Option<String>, ApiError> {
    let parts = match role {
        "system" | "developer" | "user" => USER_PARTS,
        "assistant" => ASSISTANT_PARTS,
        _ => return Ok(None),
    };
    content::text(content, &format!("{field}.content"), parts).map(Some)
}

/// Adds a message's text to the conversation by role (system text joins the system
/// prompt; an assistant turn is returned for the caller to complete).
pub(crate) fn push_role_text(b: &mut Builder, role: &str, text: String) -> Option<Value> {
    match role {
        "system" | "developer" => {
            b.system(text);
            None
        }
        "user" => {
            b.user(text);
            None
        }
        _ => Some(json!({"role": "assistant", "content": text})),
    }
}

/// A function tool as the template takes it; its name is checked as `name_field`.
pub(crate) fn template_tool(f: &Function, name_field: &str) -> Result<Value, ApiError> {
    let name = content::tool_name(&f.name, name_field)?;
    let base = name_field.strip_suffix(".name").unwrap_or(name_field);
    let parameters = content::tool_schema(&f.parameters, &format!("{base}.parameters"))?;
    Ok(function_tool(&name, f.description.ok(), parameters))
}

impl ChatRequest {
    /// `messages`, `continue_final_message` and `tools`, as the template reads them.
    pub fn conversation(&self) -> Result<Conversation, ApiError> {
        let msgs = content::messages(&self.messages)?;
        let mut b = Builder::default();
        let empty = Message::default();
        for (i, m) in msgs.iter().enumerate() {
            let field = format!("messages[{i}]");
            let m = m.ok().unwrap_or(&empty);
            let role = m.role.str().ok_or_else(|| {
                ApiError::field(
                    &format!("{field}.role"),
                    format!("{field}.role is required"),
                )
            })?;
            if role == "user" {
                let cf = format!("{field}.content");
                let items = content::items(&m.content, &cf, USER_PARTS, true)?;
                let c = b.content(items);
                b.user(c);
                continue;
            }
            if let Some(text) = role_text(role, &m.content, &field)? {
                if let Some(mut turn) = push_role_text(&mut b, role, text) {
                    assistant_extras(&mut turn, m, &field)?;
                    b.push(turn);
                }
                continue;
            }
            match role {
                "tool" | "function" => {
                    let cf = format!("{field}.content");
                    let items = content::items(&m.content, &cf, TEXT_PARTS, true)?;
                    let mut turn = json!({"role": "tool", "content": b.content(items)});
                    if let Some(id) = m.tool_call_id.sent() {
                        turn["tool_call_id"] = id;
                    }
                    if let Some(n) = m.name.sent() {
                        turn["name"] = n;
                    }
                    b.push(turn);
                }
                other => {
                    return Err(ApiError::field(
                        &format!("{field}.role"),
                        format!("{field}.role \"{other}\" is not one of system, developer, user, assistant, tool"),
                    ))
                }
            }
        }
        let images = b.take_images();
        let messages = b.finish();
        let continue_final = match self.continue_final_message.flag("continue_final_message")? {
            None | Some(false) => false,
            Some(true) if messages.last().is_some_and(|m| m["role"] == "assistant") => true,
            Some(true) => return Err(ApiError::field(
                "continue_final_message",
                "continue_final_message: the last message must be an assistant message to continue",
            )),
        };
        Ok(Conversation {
            messages,
            tools: self.template_tools()?,
            continue_final,
            images,
        })
    }

    /// `tools` as the template takes them; `tool_choice: "none"` drops them (the other
    /// choices are enforced by structured output).
    fn template_tools(&self) -> Result<Option<Value>, ApiError> {
        if matches!(&self.tool_choice, Field::Ok(ToolChoice::Mode(m)) if m == "none") {
            return Ok(None);
        }
        let list = match &self.tools {
            Field::Absent | Field::Null => return Ok(None),
            Field::Ok(a) => a,
            Field::Wrong(v) => {
                return Err(ApiError::field(
                    "tools",
                    format!("tools must be a list, got {v}"),
                ))
            }
        };
        let empty = Tool::default();
        let mut out = Vec::new();
        for (i, t) in list.iter().enumerate() {
            let field = format!("tools[{i}]");
            let t = t.ok().unwrap_or(&empty);
            let ty = t.kind.str().unwrap_or("function");
            if ty != "function" {
                return Err(ApiError::field(
                    &field,
                    format!("{field}: tool type \"{ty}\" is not supported (only \"function\")"),
                ));
            }
            // Chat shape {"type","function":{...}}, or the flat Responses shape.
            out.push(template_tool(
                t.function_spec(),
                &format!("{field}.function.name"),
            )?);
        }
        Ok(if out.is_empty() {
            None
        } else {
            Some(Value::Array(out))
        })
    }

    /// The generation parameters: the thinking controls, the shared fields, and
    /// structured output (`response_format`, `tool_choice`, `parallel_tool_calls`).
    pub fn params(
        &self,
        defaults: &RequestDefaults,
        n_vocab: usize,
        conv: &Conversation,
    ) -> Result<GenParams, ApiError> {
        let thinking = self.common.thinking(defaults)?;
        let mut p = self
            .common
            .params(&Route::CHAT, defaults, n_vocab, thinking)?;
        p.constraint = self.structured(conv.tools.as_ref())?;
        Ok(p)
    }

    /// Structured output: `response_format`, `tool_choice` and `parallel_tool_calls`
    /// over the conversation's tools.
    pub fn structured(&self, conv_tools: Option<&Value>) -> Result<Option<Spec>, ApiError> {
        let json = answer_format(&self.response_format, "response_format", true)?;
        let (force, tools) = tool_choice(&self.tool_choice, structured::tools_of(conv_tools))?;
        Ok(structured::finish(
            json,
            tools,
            force,
            parallel_off(&self.parallel_tool_calls),
        ))
    }
}

/// An assistant message's reasoning and tool calls.
fn assistant_extras(turn: &mut Value, m: &Message, field: &str) -> Result<(), ApiError> {
    for r in [&m.reasoning_content, &m.reasoning, &m.thinking] {
        if let Some(r) = r.str().filter(|r| !r.is_empty()) {
            turn["reasoning_content"] = json!(r);
            break;
        }
    }
    let calls = match &m.tool_calls {
        Field::Absent | Field::Null => return Ok(()),
        Field::Ok(calls) => calls,
        Field::Wrong(_) => {
            return Err(ApiError::field(
                &format!("{field}.tool_calls"),
                format!("{field}.tool_calls must be a list"),
            ))
        }
    };
    let empty = ToolCall::default();
    let mut out = Vec::new();
    for (j, c) in calls.iter().enumerate() {
        let cf = format!("{field}.tool_calls[{j}]");
        let c = c.ok().unwrap_or(&empty);
        let no_function = FunctionCall::default();
        let f = match &c.function {
            Field::Absent => {
                return Err(ApiError::field(
                    &format!("{cf}.function"),
                    format!("{cf}.function is required"),
                ))
            }
            Field::Ok(f) => f,
            Field::Null | Field::Wrong(_) => &no_function,
        };
        let name = content::tool_name(&f.name, &format!("{cf}.function.name"))?;
        let arguments = content::arguments(&f.arguments, &format!("{cf}.function.arguments"))?;
        out.push(json!({
            "id": c.id.or_null(),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }));
    }
    turn["tool_calls"] = Value::Array(out);
    Ok(())
}

impl Tool {
    /// The function: under `function` when the key is there, else the tool itself.
    pub(crate) fn function_spec(&self) -> &Function {
        static NONE: Function = Function {
            name: Field::Absent,
            description: Field::Absent,
            parameters: Field::Absent,
        };
        match &self.function {
            Field::Absent => &self.flat,
            Field::Ok(f) => f,
            Field::Null | Field::Wrong(_) => &NONE,
        }
    }
}

impl CompletionRequest {
    /// The generation parameters (no thinking: the prompt is raw text) and
    /// `response_format`.
    pub fn params(
        &self,
        defaults: &RequestDefaults,
        n_vocab: usize,
    ) -> Result<GenParams, ApiError> {
        let mut p = self
            .common
            .params(&Route::COMPLETIONS, defaults, n_vocab, Thinking::OFF)?;
        p.constraint = self.structured()?;
        Ok(p)
    }

    /// Structured output: `response_format`.
    pub fn structured(&self) -> Result<Option<Spec>, ApiError> {
        let json = answer_format(&self.response_format, "response_format", true)?;
        Ok(structured::finish(json, Vec::new(), false, false))
    }

    /// The prompt's tokens: text is tokenized, token ids are checked against the
    /// vocabulary. Several prompts are refused (that is n > 1).
    pub fn prompt(
        &self,
        tokenizer: &model::tokenizer::Tokenizer,
        n_vocab: usize,
    ) -> Result<Vec<u32>, ApiError> {
        let bad = || {
            ApiError::field(
                "prompt",
                "prompt must be a string, a list of token ids, or a one-element list of either",
            )
        };
        let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
            a.iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .filter(|&n| (n as usize) < n_vocab)
                        .ok_or_else(|| {
                            ApiError::field(
                                "prompt",
                                format!("prompt: {v} is not a token id of this model"),
                            )
                        })
                })
                .collect()
        };
        let encode = |s: &str| {
            tokenizer
                .encode_prompt(s)
                .map_err(|e| ApiError::field("prompt", format!("prompt: cannot tokenize: {e}")))
        };
        match &self.prompt {
            Field::Absent | Field::Null => Err(ApiError::field("prompt", "prompt is required")),
            Field::Ok(Prompt::Text(s)) => encode(s),
            Field::Ok(Prompt::List(a)) if a.is_empty() => Err(bad()),
            Field::Ok(Prompt::List(a)) if a.iter().all(Value::is_number) => ids(a),
            Field::Ok(Prompt::List(a)) if a.len() == 1 => match &a[0] {
                Value::String(s) => encode(s),
                Value::Array(inner) => ids(inner),
                _ => Err(bad()),
            },
            Field::Ok(Prompt::List(_)) => Err(ApiError::field(
                "prompt",
                "prompt: several prompts in one request are not supported; send one",
            )),
            Field::Wrong(_) => Err(bad()),
        }
    }
}

/// An answer format (or text: None). `nested`: the schema is under `json_schema`
/// (chat, completions), else beside `type` (Responses' `text.format`).
pub(crate) fn answer_format(
    fmt: &Field<Format>,
    field: &str,
    nested: bool,
) -> Result<Option<JsonAnswer>, ApiError> {
    let f = match fmt {
        Field::Absent | Field::Null => return Ok(None),
        Field::Ok(f) => Some(f),
        // Not an object: a bare `"json"` or `"json_object"` is a common slip.
        Field::Wrong(v) => {
            return Err(ApiError::field(
                field,
                format!(
                    "{field} must be an object such as {{\"type\": \"json_object\"}} or {{\"type\": \"json_schema\", ...}}, got {v}"
                ),
            ))
        }
    };
    match (f, f.and_then(|f| f.kind.str())) {
        (_, Some("text")) => Ok(None),
        (_, Some("json_object")) => Ok(Some(JsonAnswer {
            schema: json!({"type": "object"}),
            field: field.to_string(),
        })),
        (Some(f), Some("json_schema")) => {
            let (schema, holder_field) = if nested {
                let holder_field = format!("{field}.json_schema");
                match &f.json_schema {
                    Field::Ok(h) => (&h.schema, holder_field),
                    _ => {
                        return Err(ApiError::field(
                            &holder_field,
                            format!("{holder_field} must be an object with a `schema`"),
                        ))
                    }
                }
            } else {
                (&f.schema, field.to_string())
            };
            let schema_field = format!("{holder_field}.schema");
            let schema = match schema.ok() {
                // OpenAI accepts a format without a schema: any JSON value.
                None => json!({}),
                Some(s @ Value::Object(_)) | Some(s @ Value::Bool(_)) => s.clone(),
                Some(other) => {
                    return Err(ApiError::field(
                        &schema_field,
                        format!("{schema_field} must be a JSON schema object, got {other}"),
                    ))
                }
            };
            Ok(Some(JsonAnswer {
                schema,
                field: schema_field,
            }))
        }
        _ => {
            let ty = match f.map(|f| &f.kind) {
                Some(Field::Ok(s)) => Value::String(s.clone()),
                Some(Field::Wrong(v)) => v.clone(),
                _ => Value::Null,
            };
            Err(ApiError::field(
                &format!("{field}.type"),
                format!(
                    "{field}.type must be \"text\", \"json_object\" or \"json_schema\", got {ty}"
                ),
            ))
        }
    }
}

/// `tool_choice`: whether calls are forced, and the tools allowed.
pub(crate) fn tool_choice(
    choice: &Field<ToolChoice>,
    tools: Vec<SpecTool>,
) -> Result<(bool, Vec<SpecTool>), ApiError> {
    let other = |v: &Value| {
        ApiError::field(
            "tool_choice",
            format!(
                "tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", ...}}, got {v}"
            ),
        )
    };
    match choice {
        Field::Absent | Field::Null => Ok((false, tools)),
        Field::Ok(ToolChoice::Mode(s)) if s == "auto" || s == "none" => Ok((false, tools)),
        Field::Ok(ToolChoice::Mode(s)) if s == "required" => {
            if tools.is_empty() {
                return Err(ApiError::field(
                    "tool_choice",
                    "tool_choice: \"required\" needs at least one function in tools",
                ));
            }
            Ok((true, tools))
        }
        Field::Ok(ToolChoice::Object(_, o)) if o.kind.str() == Some("function") => {
            // `function.name` when the function names one (null included), else `name`.
            let name = match &o.function {
                Field::Ok(f) if f.name.is_present() => &f.name,
                _ => &o.name,
            };
            let Some(Value::String(name)) = name.ok() else {
                return Err(ApiError::field(
                    "tool_choice",
                    "tool_choice: a named choice needs function.name",
                ));
            };
            Ok((true, structured::only_named(tools, name, "tool_choice")?))
        }
        Field::Ok(ToolChoice::Mode(s)) => Err(other(&Value::String(s.clone()))),
        Field::Ok(ToolChoice::Object(v, _)) | Field::Wrong(v) => Err(other(v)),
    }
}

/// `parallel_tool_calls: false`: at most one call.
pub(crate) fn parallel_off(f: &Field<bool>) -> bool {
    f.ok() == Some(&false)
}

// ---------------------------------------------------------------- responses

/// What every object and chunk of one response repeats.
#[derive(Debug, Clone, Serialize)]
pub struct Head {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
}

/// Chat and completions `usage`.
#[derive(Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: CachedTokens,
    pub completion_tokens_details: ReasoningTokens,
}

#[derive(Debug, Serialize)]
pub struct CachedTokens {
    pub cached_tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct ReasoningTokens {
    pub reasoning_tokens: usize,
}

impl Usage {
    pub fn of(f: &Finished) -> Usage {
        Usage {
            prompt_tokens: f.prompt_tokens,
            completion_tokens: f.completion_tokens,
            total_tokens: f.prompt_tokens + f.completion_tokens,
            prompt_tokens_details: CachedTokens {
                cached_tokens: f.timings.cache_n,
            },
            completion_tokens_details: ReasoningTokens {
                reasoning_tokens: f.reasoning_tokens,
            },
        }
    }
}

/// A chat completion (`object: "chat.completion"`).
#[derive(Debug, Serialize)]
pub struct ChatCompletion<'a> {
    #[serde(flatten)]
    pub head: &'a Head,
    pub choices: [ChatChoice; 1],
    pub usage: Usage,
    pub timings: Timings,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// Null when the answer is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<CallOut>>,
}

/// A tool call the model made.
#[derive(Debug, Serialize)]
pub struct CallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionOut,
}

#[derive(Debug, Serialize)]
pub struct FunctionOut {
    pub name: String,
    pub arguments: String,
}

/// Chat `logprobs`: one entry per generated token.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<LogprobEntry>,
    pub refusal: Option<String>,
}

/// A token with its log-probability and bytes (`top_logprobs`: its alternatives).
#[derive(Debug, Serialize)]
pub struct LogprobEntry {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<LogprobEntry>>,
}

/// A chat stream chunk (`object: "chat.completion.chunk"`).
#[derive(Debug, Serialize)]
pub struct ChatChunk<'a> {
    #[serde(flatten)]
    pub head: &'a Head,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// What a chunk adds to the message.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<[DeltaCall; 1]>,
}

/// A tool call's start (id, type, name) or a piece of its arguments.
#[derive(Debug, Serialize)]
pub struct DeltaCall {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: DeltaFunction,
}

#[derive(Debug, Serialize)]
pub struct DeltaFunction {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// A completion (`object: "text_completion"`), and each chunk of its stream.
#[derive(Debug, Serialize)]
pub struct Completion<'a> {
    #[serde(flatten)]
    pub head: &'a Head,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub text: String,
    pub index: u32,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// Completions' `logprobs`: per token its text, log-probability, alternatives
/// (text → log-probability; null when none were asked) and character offset.
#[derive(Debug, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f64>,
    pub top_logprobs: Option<Vec<Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

/// `/v1/models` entries.
#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<Model>,
}

#[derive(Debug, Serialize)]
pub struct Model {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub meta: ModelMeta,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<&'static str>,
    /// What the model takes: `completion`, and `multimodal` and `vision` when it
    /// takes images.
    pub capabilities: Vec<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct ModelMeta {
    pub arch: String,
    pub name: String,
    pub n_ctx: usize,
    pub n_ctx_train: usize,
    pub n_vocab: usize,
    pub n_expert: usize,
    pub size: u64,
    pub synthetic: bool,
}
