//! OpenAI Responses: the request as sent, what it becomes, and the response object,
//! its output items and its stream events. Messages, tools, the tool choice and the
//! answer format are read as chat's (`api::openai`).

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::common::{Common, Route};
use super::content::{self, Content, USER_PARTS};
use super::field::{objects, Field, FromJson, OBJECT};
use super::openai::{
    answer_format, parallel_off, push_role_text, role_text, template_tool, tool_choice, Format,
    Tool, ToolChoice,
};
use super::Timings;
use crate::error::ApiError;
use crate::params::GenParams;
use crate::prompt::{function_tool, Builder, Conversation};
use crate::settings::RequestDefaults;
use crate::structured::{self, Spec};

// ---------------------------------------------------------------- requests

/// `POST /v1/responses`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ResponsesRequest {
    pub instructions: Field<String>,
    pub input: Field<Input>,
    /// Echoed on the response as sent; functions, custom (freeform) tools and a
    /// namespace's tools are offered to the model; hosted tools (web search, file
    /// search, ...), which run on OpenAI's side, are not.
    pub tools: Field<Value>,
    /// Echoed as sent; `none` drops the tools, a forced choice is enforced.
    pub tool_choice: Field<Value>,
    pub parallel_tool_calls: Field<bool>,
    /// Echoed as sent; its `format` is enforced while decoding.
    pub text: Field<Value>,
    /// Nothing is stored: `true` is refused.
    pub store: Field<bool>,
    /// Echoed (at most 16 string values).
    pub metadata: Field<Map<String, Value>>,
    /// Refused: responses are not stored.
    pub previous_response_id: Field<Value>,
    /// Refused when true.
    pub background: Field<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// `input`: a string (one user message) or a list of items.
#[derive(Debug)]
pub enum Input {
    Text(String),
    Items(Vec<Field<Item>>),
}

impl FromJson for Input {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(Input::Text(s)),
            Value::Array(a) => Ok(Input::Items(a.into_iter().map(Field::from_value).collect())),
            other => Err(other),
        }
    }
}

/// An input item: a `message` (the default type), a `function_call` or
/// `custom_tool_call` and its `_output`, or a `reasoning` item (dropped).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Item {
    #[serde(rename = "type")]
    pub kind: Field<String>,
    pub role: Field<String>,
    pub content: Field<Content>,
    pub name: Field<String>,
    /// Passed to the template as sent.
    pub call_id: Field<Value>,
    pub arguments: Field<Value>,
    pub output: Field<Value>,
    /// A custom tool call's free-form input.
    pub input: Field<Value>,
}

objects!(ResponsesRequest, Item);

/// A typed view of a field kept as sent.
fn view<T: FromJson>(f: &Field<Value>) -> Field<T> {
    Field::of(f.sent().as_ref())
}

// ---------------------------------------------------------------- what requests become

impl ResponsesRequest {
    /// `store` and `metadata`: nothing is stored, so `store: true` is refused rather
    /// than answered with `store: false`; `metadata` (at most 16 string values, keys up
    /// to 64 characters, values up to 512, as OpenAI checks it) is echoed.
    pub fn metadata(&self) -> Result<Value, ApiError> {
        if self.store.flag("store")? == Some(true) {
            return Err(ApiError::field(
                "store",
                "store: responses are not stored on this server; send store: false (or omit it) and send the conversation in input each turn",
            ));
        }
        let Some(m) = self.metadata.checked("metadata", OBJECT)? else {
            return Ok(json!({}));
        };
        if m.len() > 16 {
            return Err(ApiError::field(
                "metadata",
                format!("metadata: at most 16 keys, got {}", m.len()),
            ));
        }
        for (k, v) in m {
            let field = format!("metadata.{k}");
            if k.chars().count() > 64 {
                return Err(ApiError::field(
                    &field,
                    format!("{field}: keys are at most 64 characters"),
                ));
            }
            match v.as_str() {
                Some(s) if s.chars().count() <= 512 => {}
                Some(_) => {
                    return Err(ApiError::field(
                        &field,
                        format!("{field}: values are at most 512 characters"),
                    ))
                }
                None => {
                    return Err(ApiError::field(
                        &field,
                        format!("{field} must be a string, got {v}"),
                    ))
                }
            }
        }
        Ok(Value::Object(m.clone()))
    }

    /// The fields that ask for what this server does not keep.
    pub fn refuse_stored(&self) -> Result<(), ApiError> {
        if self.previous_response_id.is_set() {
            return Err(ApiError::field(
                "previous_response_id",
                "previous_response_id: responses are not stored; send the conversation in input",
            ));
        }
        if self.background.is_true() {
            return Err(ApiError::field(
                "background",
                "background: background responses are not supported",
            ));
        }
        Ok(())
    }

    /// `instructions`, `input` and `tools`, as the template reads them.
    pub fn conversation(&self) -> Result<Conversation, ApiError> {
        let mut b = Builder::default();
        if let Some(s) = self.instructions.text("instructions")? {
            b.system(s.to_string());
        }
        match &self.input {
            Field::Ok(Input::Text(s)) => b.user(s.clone()),
            Field::Ok(Input::Items(items)) => {
                let empty = Item::default();
                for (i, item) in items.iter().enumerate() {
                    item_turn(&mut b, item.ok().unwrap_or(&empty), &format!("input[{i}]"))?;
                }
            }
            Field::Absent | Field::Null => {
                return Err(ApiError::field("input", "input is required"))
            }
            Field::Wrong(v) => {
                return Err(ApiError::field(
                    "input",
                    format!("input must be a string or a list of items, got {v}"),
                ))
            }
        }
        // Tools: functions and custom tools, a namespace's nested ones too.
        let mut tools = Vec::new();
        if let Field::Ok(list) = view::<Vec<Field<Tool>>>(&self.tools) {
            for (i, t) in list.iter().enumerate() {
                if let Field::Ok(t) = t {
                    offered(t, &format!("tools[{i}]"), &mut tools, &mut Vec::new())?;
                }
            }
        }
        let choice_none = self.tool_choice.ok().and_then(Value::as_str) == Some("none");
        // Forced choices are read and enforced by structured output.
        let images = b.take_images();
        Ok(Conversation {
            images,
            messages: b.finish(),
            tools: if tools.is_empty() || choice_none {
                None
            } else {
                Some(Value::Array(tools))
            },
            continue_final: false,
        })
    }

    /// The generation parameters: the thinking controls, the shared fields, and
    /// structured output (`text.format`, `tool_choice`, `parallel_tool_calls`).
    pub fn params(
        &self,
        defaults: &RequestDefaults,
        n_vocab: usize,
        conv: &Conversation,
    ) -> Result<GenParams, ApiError> {
        let thinking = self.common.thinking(defaults)?;
        let mut p = self
            .common
            .params(&Route::RESPONSES, defaults, n_vocab, thinking)?;
        p.constraint = self.structured(conv.tools.as_ref())?;
        Ok(p)
    }

    /// Structured output: `text.format`, `tool_choice` and `parallel_tool_calls` over
    /// the conversation's tools.
    pub fn structured(&self, conv_tools: Option<&Value>) -> Result<Option<Spec>, ApiError> {
        let format: Field<Format> = Field::of(self.text.ok().and_then(|t| t.get("format")));
        let json = answer_format(&format, "text.format", false)?;
        let tools = structured::tools_of(conv_tools);
        let (force, tools) = match self.tool_choice.ok() {
            // `{"type": "custom", "name"}`: that custom tool, as a named function is.
            Some(v) if v.get("type").and_then(Value::as_str) == Some("custom") => {
                let Some(name) = v.get("name").and_then(Value::as_str) else {
                    return Err(ApiError::field(
                        "tool_choice.name",
                        "tool_choice: a custom choice needs name, the custom tool's name",
                    ));
                };
                if !self.custom_tools()?.iter().any(|n| n == name) {
                    return Err(ApiError::field(
                        "tool_choice.name",
                        format!("tool_choice: no custom tool named \"{name}\" is in tools"),
                    ));
                }
                (true, structured::only_named(tools, name, "tool_choice")?)
            }
            _ => {
                let choice: Field<ToolChoice> = view(&self.tool_choice);
                tool_choice(&choice, tools)?
            }
        };
        Ok(structured::finish(
            json,
            tools,
            force,
            parallel_off(&self.parallel_tool_calls),
        ))
    }

    /// The names of the custom (freeform) tools offered: their calls are answered as
    /// `custom_tool_call` items with the raw input.
    pub fn custom_tools(&self) -> Result<Vec<String>, ApiError> {
        let mut names = Vec::new();
        if let Field::Ok(list) = view::<Vec<Field<Tool>>>(&self.tools) {
            for (i, t) in list.iter().enumerate() {
                if let Field::Ok(t) = t {
                    offered(t, &format!("tools[{i}]"), &mut Vec::new(), &mut names)?;
                }
            }
        }
        Ok(names)
    }

    /// `reasoning.summary`: a summary is asked for (the think block is given as one).
    pub fn summary(&self) -> Option<String> {
        self.common
            .reasoning
            .ok()
            .and_then(|r| r.summary.str())
            .map(str::to_string)
    }

    /// The response's echo of the request's `text`: as sent when it has a format,
    /// else plain text.
    pub fn text_echo(&self) -> Value {
        match self.text.ok() {
            Some(t) if t.get("format").is_some_and(|f| !f.is_null()) => t.clone(),
            _ => json!({"format": {"type": "text"}}),
        }
    }
}

/// One input item's turn.
fn item_turn(b: &mut Builder, item: &Item, field: &str) -> Result<(), ApiError> {
    match item.kind.str().unwrap_or("message") {
        "message" => {
            let role = item.role.str().unwrap_or("");
            if role == "user" {
                let cf = format!("{field}.content");
                let items = content::items(&item.content, &cf, USER_PARTS, true)?;
                let c = b.content(items);
                b.user(c);
                return Ok(());
            }
            let Some(text) = role_text(role, &item.content, field)? else {
                return Err(ApiError::field(
                    &format!("{field}.role"),
                    format!(
                        "{field}.role \"{role}\" is not one of system, developer, user, assistant"
                    ),
                ));
            };
            if let Some(turn) = push_role_text(b, role, text) {
                b.push(turn);
            }
        }
        "function_call" => {
            let name = content::tool_name(&item.name, &format!("{field}.name"))?;
            let arguments = content::arguments(&item.arguments, &format!("{field}.arguments"))?;
            b.assistant_tool_call(json!({
                "id": item.call_id.or_null(),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }));
        }
        "function_call_output" => {
            let out = match item.output.sent() {
                Some(Value::String(s)) => Value::String(s),
                Some(v @ Value::Array(_)) => {
                    let items = content::items(
                        &Field::from_value(v),
                        &format!("{field}.output"),
                        &["input_text", "output_text", "text"],
                        true,
                    )?;
                    b.content(items)
                }
                Some(v) => Value::String(v.to_string()),
                None => Value::String(String::new()),
            };
            b.tool_result(item.call_id.or_null(), out);
        }
        // A freeform (custom) tool call: its text input becomes {"input": ...}.
        "custom_tool_call" => {
            let name = content::tool_name(&item.name, &format!("{field}.name"))?;
            let input = item.input.sent().unwrap_or(json!(""));
            b.assistant_tool_call(json!({
                "id": item.call_id.or_null(),
                "type": "function",
                "function": {"name": name, "arguments": {"input": input}},
            }));
        }
        "custom_tool_call_output" => {
            let out = match item.output.sent() {
                Some(Value::String(s)) => s,
                Some(v) => v.to_string(),
                None => String::new(),
            };
            b.tool_result(item.call_id.or_null(), out);
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
    Ok(())
}

/// The tools a Responses tool offers the template (`out`): itself, or a namespace's
/// tools; the names of custom tools go to `custom` too. Hosted tools (web search,
/// file search, ...) run on OpenAI's side and are not offered.
fn offered(
    t: &Tool,
    field: &str,
    out: &mut Vec<Value>,
    custom: &mut Vec<String>,
) -> Result<(), ApiError> {
    match t.kind.str() {
        Some("function") => out.push(template_tool(t.function_spec(), &format!("{field}.name"))?),
        Some("custom") => {
            let (name, tool) = custom_tool(t, field)?;
            custom.push(name);
            out.push(tool);
        }
        Some("namespace") => {
            if let Some(inner) = t.tools.ok() {
                for (j, it) in inner.iter().enumerate() {
                    if let Field::Ok(it) = it {
                        offered(it, &format!("{field}.tools[{j}]"), out, custom)?;
                    }
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// The parameter a custom tool's raw input travels in through the template (and
/// back in a call's arguments): `{"input": "..."}`.
pub const CUSTOM_INPUT: &str = "input";

/// A custom (freeform) tool as the template takes it: a function with one string
/// parameter, `input`, whose description says it is raw text; a grammar format is
/// shown to the model in the description. Returns its name too.
fn custom_tool(t: &Tool, field: &str) -> Result<(String, Value), ApiError> {
    let name = content::tool_name(&t.flat.name, &format!("{field}.name"))?;
    let mut description = t
        .flat
        .description
        .ok()
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let format_field = format!("{field}.format");
    let note = match t.format.ok() {
        None => String::new(),
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => String::new(),
            Some("grammar") => {
                let syntax = f.get("syntax").and_then(Value::as_str).unwrap_or("lark");
                let Some(definition) = f.get("definition").and_then(Value::as_str) else {
                    return Err(ApiError::field(
                        &format!("{format_field}.definition"),
                        format!("{format_field}.definition must be the grammar's text"),
                    ));
                };
                format!("The input must follow this {syntax} grammar:\n{definition}")
            }
            _ => {
                return Err(ApiError::field(
                    &format!("{format_field}.type"),
                    format!(
                        "{format_field}.type must be \"text\" or \"grammar\", got {}",
                        f.get("type").unwrap_or(&Value::Null)
                    ),
                ))
            }
        },
    };
    if !note.is_empty() {
        if !description.is_empty() {
            description.push_str("\n\n");
        }
        description.push_str(&note);
    }
    let parameters = json!({
        "type": "object",
        "properties": {CUSTOM_INPUT: {
            "type": "string",
            "description": "The tool's whole input as raw text (not JSON).",
        }},
        "required": [CUSTOM_INPUT],
    });
    let tool = function_tool(&name, Some(&Value::String(description)), Some(&parameters));
    Ok((name, tool))
}

/// A custom tool call's raw input, from its arguments (`{"input": "..."}`); a call
/// the budget cut off gives what it has.
pub fn custom_input(arguments: &str) -> String {
    let parsed = serde_json::from_str::<Value>(arguments)
        .or_else(|_| serde_json::from_str::<Value>(&format!("{}}}", arguments.trim_end())));
    match parsed.ok().as_ref().and_then(|v| v.get(CUSTOM_INPUT)) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    }
}

// ---------------------------------------------------------------- responses

/// A response object.
#[derive(Debug, Serialize)]
pub struct ResponseOut<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created_at: u64,
    pub status: &'static str,
    pub error: Option<ErrorOut>,
    pub incomplete_details: Option<Incomplete>,
    pub instructions: &'a Value,
    pub max_output_tokens: usize,
    pub model: &'a str,
    pub output: Vec<ItemOut>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub reasoning: ReasoningOut<'a>,
    pub store: bool,
    pub temperature: f64,
    pub text: &'a Value,
    pub tool_choice: &'a Value,
    pub tools: &'a Value,
    pub top_p: f64,
    pub truncation: &'static str,
    pub metadata: &'a Value,
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

#[derive(Debug, Serialize)]
pub struct ErrorOut {
    pub code: &'static str,
    pub message: String,
}

#[derive(Debug, Serialize)]
pub struct Incomplete {
    pub reason: &'static str,
}

#[derive(Debug, Serialize)]
pub struct ReasoningOut<'a> {
    pub effort: Option<&'a str>,
    pub summary: Option<&'a str>,
}

/// A response's `usage`.
#[derive(Debug, Serialize)]
pub struct Usage {
    pub input_tokens: usize,
    pub input_tokens_details: super::openai::CachedTokens,
    pub output_tokens: usize,
    pub output_tokens_details: super::openai::ReasoningTokens,
    pub total_tokens: usize,
}

/// An output item.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ItemOut {
    Reasoning {
        id: String,
        summary: Vec<PartOut>,
        content: Vec<PartOut>,
    },
    Message {
        id: String,
        status: &'static str,
        role: &'static str,
        content: Vec<PartOut>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        status: &'static str,
    },
    /// A call of a custom (freeform) tool, with its raw input.
    CustomToolCall {
        id: String,
        call_id: String,
        name: String,
        input: String,
    },
}

/// A content part of an item.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PartOut {
    SummaryText {
        text: String,
    },
    ReasoningText {
        text: String,
    },
    OutputText {
        text: String,
        annotations: Vec<Value>,
        logprobs: Vec<Value>,
    },
}

impl PartOut {
    pub fn output_text(text: &str) -> PartOut {
        PartOut::OutputText {
            text: text.to_string(),
            annotations: Vec::new(),
            logprobs: Vec::new(),
        }
    }
}

impl ItemOut {
    /// A reasoning item: the think block, and again as its summary when one is asked.
    pub fn reasoning(id: &str, text: &str, with_summary: bool) -> ItemOut {
        let summary = if with_summary {
            vec![PartOut::SummaryText {
                text: text.to_string(),
            }]
        } else {
            Vec::new()
        };
        ItemOut::Reasoning {
            id: id.to_string(),
            summary,
            content: vec![PartOut::ReasoningText {
                text: text.to_string(),
            }],
        }
    }

    pub fn message(id: &str, text: &str, status: &'static str) -> ItemOut {
        ItemOut::Message {
            id: id.to_string(),
            status,
            role: "assistant",
            content: vec![PartOut::output_text(text)],
        }
    }

    pub fn call(id: &str, call_id: &str, name: &str, args: &str, status: &'static str) -> ItemOut {
        ItemOut::FunctionCall {
            id: id.to_string(),
            call_id: call_id.to_string(),
            name: name.to_string(),
            arguments: args.to_string(),
            status,
        }
    }

    pub fn custom_call(id: &str, call_id: &str, name: &str, input: &str) -> ItemOut {
        ItemOut::CustomToolCall {
            id: id.to_string(),
            call_id: call_id.to_string(),
            name: name.to_string(),
            input: input.to_string(),
        }
    }

    pub fn is_reasoning(&self) -> bool {
        matches!(self, ItemOut::Reasoning { .. })
    }
}

/// One stream event: its payload, then its `type` and `sequence_number`.
#[derive(Debug, Serialize)]
pub struct Event<'a> {
    #[serde(flatten)]
    pub payload: Payload<'a>,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub sequence_number: u64,
}

/// What an event carries.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Payload<'a> {
    /// `response.created`, `.in_progress`, `.completed`, `.incomplete`, `.failed`.
    Response { response: Box<ResponseOut<'a>> },
    /// `response.output_item.added` / `.done`.
    Item { output_index: usize, item: ItemOut },
    /// `response.content_part.added` / `.done`.
    ContentPart {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: PartOut,
    },
    /// `response.reasoning_summary_part.added` / `.done`.
    SummaryPart {
        item_id: String,
        output_index: usize,
        summary_index: usize,
        part: PartOut,
    },
    /// `response.reasoning_text.delta`.
    ContentDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
    },
    /// `response.output_text.delta`.
    TextDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        logprobs: Vec<Value>,
    },
    /// `response.reasoning_summary_text.delta`.
    SummaryDelta {
        item_id: String,
        output_index: usize,
        summary_index: usize,
        delta: String,
    },
    /// `response.function_call_arguments.delta`.
    ArgumentsDelta {
        item_id: String,
        output_index: usize,
        delta: String,
    },
    /// `response.reasoning_text.done`.
    ContentDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
    },
    /// `response.output_text.done`.
    TextDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
        logprobs: Vec<Value>,
    },
    /// `response.reasoning_summary_text.done`.
    SummaryDone {
        item_id: String,
        output_index: usize,
        summary_index: usize,
        text: String,
    },
    /// `response.custom_tool_call_input.done`.
    InputDone {
        item_id: String,
        output_index: usize,
        input: String,
    },
    /// `response.function_call_arguments.done`.
    ArgumentsDone {
        item_id: String,
        output_index: usize,
        name: String,
        arguments: String,
    },
}
