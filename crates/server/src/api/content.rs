//! What every API's messages are made of: content (a string or a list of parts),
//! tool-call arguments and tool names, read into the text and objects the chat
//! template takes.

use serde::Deserialize;
use serde_json::{json, Value};

use super::field::{objects, Field, FromJson};
use crate::error::ApiError;

/// A message's content: a string, or a list of parts.
#[derive(Debug)]
pub enum Content {
    Text(String),
    Parts(Vec<Field<Part>>),
}

impl FromJson for Content {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(Content::Text(s)),
            Value::Array(a) => Ok(Content::Parts(
                a.into_iter().map(Field::from_value).collect(),
            )),
            other => Err(other),
        }
    }
}

/// One part of a content list: a plain string, or a typed part.
#[derive(Debug)]
pub enum Part {
    Text(String),
    Typed(TypedPart),
}

impl FromJson for Part {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(Part::Text(s)),
            v @ Value::Object(_) => TypedPart::from_json(v).map(Part::Typed),
            other => Err(other),
        }
    }
}

/// `{"type": "text" | "input_text" | "output_text" | "refusal" | ..., "text", "refusal"}`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct TypedPart {
    #[serde(rename = "type")]
    pub kind: Field<String>,
    pub text: Field<String>,
    /// A refusal part carries its text here.
    pub refusal: Field<String>,
}

objects!(TypedPart);

/// The part types a system, developer or user message is read from.
pub const USER_PARTS: &[&str] = &["text", "input_text"];
/// The part types an assistant message is read from.
pub const ASSISTANT_PARTS: &[&str] = &["text", "output_text", "refusal"];
/// Only text parts (tool results, Anthropic's text).
pub const TEXT_PARTS: &[&str] = &["text"];

/// The text of a content value (parts joined by newlines; absent or null is empty).
/// `allowed` are the part types read as text; an image part is refused by name.
pub fn text(content: &Field<Content>, field: &str, allowed: &[&str]) -> Result<String, ApiError> {
    match content {
        Field::Absent | Field::Null => Ok(String::new()),
        Field::Ok(Content::Text(s)) => Ok(s.clone()),
        Field::Ok(Content::Parts(parts)) => {
            let mut out: Vec<String> = Vec::new();
            for (j, p) in parts.iter().enumerate() {
                let f = format!("{field}[{j}]");
                let typed = match p {
                    Field::Ok(Part::Text(s)) => {
                        out.push(s.clone());
                        continue;
                    }
                    Field::Ok(Part::Typed(t)) => Some(t),
                    _ => None,
                };
                let ty = typed.and_then(|t| t.kind.str()).unwrap_or("");
                if allowed.contains(&ty) {
                    let (key, value) = match typed {
                        Some(t) if ty == "refusal" => ("refusal", t.refusal.str()),
                        Some(t) => ("text", t.text.str()),
                        None => ("text", None),
                    };
                    let t = value.ok_or_else(|| {
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
        Field::Wrong(other) => Err(ApiError::field(
            field,
            format!("{field} must be a string or a list of content parts, got {other}"),
        )),
    }
}

/// Tool-call arguments as the templates want them: an object. Arguments that are not
/// a JSON object are refused naming `field` (a template would fail on them with an
/// error about its own source, which tells the client nothing).
pub fn arguments(v: &Field<Value>, field: &str) -> Result<Value, ApiError> {
    let not_object = |what: String| {
        ApiError::field(
            field,
            format!("{field} must be a JSON object of the function's arguments, {what}"),
        )
    };
    match v.ok() {
        None => Ok(json!({})),
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

/// A tool's (or a tool call's) name: a non-empty string.
pub fn tool_name(name: &Field<String>, field: &str) -> Result<String, ApiError> {
    match name.str() {
        Some(n) if !n.is_empty() => Ok(n.to_string()),
        _ => Err(ApiError::field(
            field,
            format!("{field} must be a non-empty string"),
        )),
    }
}

/// A tool's parameter schema (`parameters`, `input_schema`): a JSON Schema object,
/// or nothing (absent or null: no parameters).
pub fn tool_schema<'a>(
    schema: &'a Field<Value>,
    field: &str,
) -> Result<Option<&'a Value>, ApiError> {
    match schema {
        Field::Ok(v @ Value::Object(_)) => Ok(Some(v)),
        Field::Absent | Field::Null => Ok(None),
        Field::Ok(v) | Field::Wrong(v) => {
            let mut got = v.to_string();
            if got.len() > 80 {
                got = format!("{}...", got.chars().take(77).collect::<String>());
            }
            Err(ApiError::field(
                field,
                format!("{field} must be a JSON Schema object (e.g. {{\"type\": \"object\", \"properties\": {{...}}}}), got {got}"),
            ))
        }
    }
}

/// The request's `messages`: a non-empty list (both chat APIs).
pub fn messages<T>(f: &Field<Vec<Field<T>>>) -> Result<&[Field<T>], ApiError> {
    match f {
        Field::Ok(a) if !a.is_empty() => Ok(a),
        Field::Ok(_) => Err(ApiError::field("messages", "messages must not be empty")),
        Field::Absent | Field::Null => Err(ApiError::field("messages", "messages is required")),
        Field::Wrong(v) => Err(ApiError::field(
            "messages",
            format!("messages must be a list, got {v}"),
        )),
    }
}
