//! What every API's messages are made of: content (a string or a list of parts),
//! tool-call arguments and tool names, read into the text and objects the chat
//! template takes.

use serde::Deserialize;
use serde_json::{json, Value};

use super::field::{objects, Field, FromJson};
use crate::error::ApiError;
use crate::images::{self, ImageInput};

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
    Typed(Box<TypedPart>),
}

impl FromJson for Part {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(Part::Text(s)),
            v @ Value::Object(_) => TypedPart::from_json(v).map(|t| Part::Typed(Box::new(t))),
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
    /// `image_url` (chat: `{"url"}` or a string) and `input_image` (Responses: a string).
    pub image_url: Field<Value>,
    /// Responses `input_image` by file id (refused: nothing is stored).
    pub file_id: Field<Value>,
    /// Anthropic `image`: `{"type": "base64", "media_type", "data"}`.
    pub source: Field<Value>,
}

objects!(TypedPart);

/// The part types a system, developer or user message is read from.
pub const USER_PARTS: &[&str] = &["text", "input_text"];
/// The part types an assistant message is read from.
pub const ASSISTANT_PARTS: &[&str] = &["text", "output_text", "refusal"];
/// Only text parts (tool results, Anthropic's text).
pub const TEXT_PARTS: &[&str] = &["text"];

/// What a content value is made of: text, and images where the message may carry them.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Text(String),
    Image(ImageInput),
}

/// The text of a content value (parts joined by newlines; absent or null is empty).
/// `allowed` are the part types read as text; an image part is refused by name.
pub fn text(content: &Field<Content>, field: &str, allowed: &[&str]) -> Result<String, ApiError> {
    let items = items(content, field, allowed, false)?;
    Ok(items
        .into_iter()
        .filter_map(|i| match i {
            Item::Text(t) => Some(t),
            Item::Image(_) => None,
        })
        .collect::<Vec<_>>()
        .join("\n"))
}

/// The image a typed part carries (`image_url`, `input_image` or `image`), read from
/// `f` (the part's field name).
pub fn image(t: &TypedPart, ty: &str, f: &str) -> Result<ImageInput, ApiError> {
    if ty == "image" {
        return images::from_anthropic_source(t.source.ok(), &format!("{f}.source"));
    }
    if ty == "input_image" && t.image_url.ok().is_none() && t.file_id.ok().is_some() {
        return Err(ApiError::field(
            &format!("{f}.file_id"),
            format!("{f}.file_id: this server stores no files; send the image in image_url as a base64 data: URL (data:image/png;base64,...)"),
        ));
    }
    match t.image_url.ok() {
        Some(Value::String(url)) => images::from_url(url, &format!("{f}.image_url")),
        Some(Value::Object(o)) => match o.get("url") {
            Some(Value::String(url)) => images::from_url(url, &format!("{f}.image_url.url")),
            _ => Err(ApiError::field(
                &format!("{f}.image_url.url"),
                format!("{f}.image_url.url must be a base64 data: URL of the image (data:image/png;base64,...)"),
            )),
        },
        _ => Err(ApiError::field(
            &format!("{f}.image_url"),
            format!("{f}.image_url must be a base64 data: URL of the image (data:image/png;base64,...)"),
        )),
    }
}

/// The part types that carry an image.
pub const IMAGE_PARTS: &[&str] = &["image_url", "input_image", "image"];

/// A content value's text parts and (`with_images`: user messages and tool results)
/// image parts, in order. `allowed` are the part types read as text.
pub fn items(
    content: &Field<Content>,
    field: &str,
    allowed: &[&str],
    with_images: bool,
) -> Result<Vec<Item>, ApiError> {
    match content {
        Field::Absent | Field::Null => Ok(Vec::new()),
        Field::Ok(Content::Text(s)) => Ok(vec![Item::Text(s.clone())]),
        Field::Ok(Content::Parts(parts)) => {
            let mut out = Vec::new();
            for (j, p) in parts.iter().enumerate() {
                let f = format!("{field}[{j}]");
                let typed = match p {
                    Field::Ok(Part::Text(s)) => {
                        out.push(Item::Text(s.clone()));
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
                    out.push(Item::Text(t.to_string()));
                } else if let (true, true, Some(t)) =
                    (with_images, IMAGE_PARTS.contains(&ty), typed)
                {
                    out.push(Item::Image(image(t, ty, &f)?));
                } else if ty.contains("image")
                    || ty.contains("audio")
                    || ty.contains("file")
                    || ty == "document"
                {
                    let only = if with_images {
                        "images and text only"
                    } else {
                        "text only; images go in user messages and tool results"
                    };
                    return Err(ApiError::field(
                        &f,
                        format!("{f}: content of type \"{ty}\" is not supported here ({only})"),
                    ));
                } else {
                    return Err(ApiError::field(
                        &f,
                        format!("{f}: unknown content part type \"{ty}\""),
                    ));
                }
            }
            Ok(out)
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
