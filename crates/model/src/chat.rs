//! Chat templates: the Jinja template a model ships (`tokenizer.chat_template` in GGUF)
//! rendered with minijinja the way HF transformers' `apply_chat_template` renders it.
//!
//! What HF sets up and this module reproduces (transformers `chat_template_utils`):
//! `trim_blocks` and `lstrip_blocks` on, the trailing newline of the template dropped,
//! loop controls, `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` filter that
//! is Python's `json.dumps(x, ensure_ascii=False)` (", " / ": " separators, no HTML
//! escaping; `indent`, `separators`, `sort_keys`, `ensure_ascii` keyword arguments).
//! Python string methods (`startswith`, `split`, `rstrip`, ...) come from
//! `minijinja_contrib::pycompat`. Values print as Python prints them (`True`, `None`,
//! `1e-05`), in `{{ }}` and through the `string` filter.
//!
//! Message preparation (as HF's `apply_chat_template` and OpenAI-compatible servers do):
//! keys whose value is null are dropped, except `content`, which becomes `""` when null or
//! absent (templates concatenate it); `reasoning_content` is filled from `reasoning` or
//! `thinking` when absent; tool-call `arguments` given as a JSON string (the OpenAI wire
//! form) are parsed into an object, which is what Qwen templates iterate over; and for
//! templates that only handle string content, a list of `{type: text, text}` parts is
//! joined with "\n".

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map as JsonMap, Value as Json};

/// Qwen3 hybrid-thinking template (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): JSON tool calls,
/// `enable_thinking=false` appends an empty think block to the generation prompt.
pub const QWEN3_TEMPLATE: &str = include_str!("../assets/templates/qwen3.jinja");
/// Qwen3.5 / Qwen3.6 template: XML `<function=...><parameter=...>` tool calls, and the
/// generation prompt opens `<think>` unless `enable_thinking=false`.
pub const QWEN35_TEMPLATE: &str = include_str!("../assets/templates/qwen35.jinja");

const TEMPLATE_NAME: &str = "chat";
const RAISED: &str = "raise_exception: ";

/// Errors compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template itself refused the conversation (`raise_exception`), e.g. "No user
    /// query found in messages." Bad input: report it to the client.
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
    #[error("invalid chat input: {0}")]
    Input(String),
    #[error("tokenizer.chat_template: {0}")]
    Metadata(String),
}

/// What a chat template is rendered with.
#[derive(Debug, Clone, Default)]
pub struct ChatInputs {
    /// Array of OpenAI-style messages: `role`, `content` (string, null, or a list of
    /// `{type: "text", text}` parts), `reasoning_content`, `tool_calls`
    /// (`[{id, type: "function", function: {name, arguments}}]`, arguments an object or a
    /// JSON string), `tool_call_id`, `name`.
    pub messages: Json,
    /// OpenAI tools array (`[{type: "function", function: {name, description, parameters}}]`).
    pub tools: Option<Json>,
    pub add_generation_prompt: bool,
    /// `enable_thinking`; `None` leaves it undefined (the template's default: on for Qwen).
    pub enable_thinking: Option<bool>,
    /// Extra top-level template variables (`chat_template_kwargs`). The fields above win
    /// over same-named entries here.
    pub extra: JsonMap<String, Json>,
}

/// A compiled chat template. `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    /// The template handles list content itself (Qwen3.5 does, Qwen3 does not).
    content_parts: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("len", &self.source.len())
            .field("content_parts", &self.content_parts)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(py_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson_filter);
        env.add_filter("string", string_filter);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatError::Syntax(describe(&e)))?;
        let content_parts = [
            "content is string",
            "content is iterable",
            "content is sequence",
        ]
        .iter()
        .any(|p| source.contains(p));
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            content_parts,
            bos_token: None,
            eos_token: None,
        })
    }

    /// The template stored in a GGUF file (`tokenizer.chat_template`), if any, with
    /// `bos_token` / `eos_token` set from the file's vocabulary.
    pub fn from_gguf(file: &gguf::GgufFile) -> Result<Option<ChatTemplate>, ChatError> {
        let Some(v) = file.get("tokenizer.chat_template") else {
            return Ok(None);
        };
        let src = v
            .as_str()
            .ok_or_else(|| ChatError::Metadata("not a string".into()))?;
        let mut t = ChatTemplate::new(src)?;
        let token = |key: &str| -> Option<String> {
            let id = usize::try_from(file.get(key)?.as_u64()?).ok()?;
            let tokens = file.get("tokenizer.ggml.tokens")?.as_array()?;
            Some(tokens.get(id)?.as_str()?.to_string())
        };
        t.bos_token = token("tokenizer.ggml.bos_token_id");
        t.eos_token = token("tokenizer.ggml.eos_token_id");
        Ok(Some(t))
    }

    /// Sets the `bos_token` / `eos_token` template variables (HF passes them; Qwen's
    /// templates do not use them).
    pub fn with_special_tokens(mut self, bos: Option<String>, eos: Option<String>) -> Self {
        self.bos_token = bos;
        self.eos_token = eos;
        self
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template reads `enable_thinking`.
    pub fn supports_thinking(&self) -> bool {
        self.source.contains("enable_thinking")
    }

    /// Whether the template renders a `tools` list.
    pub fn supports_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Renders the conversation to the prompt text (tokenize it with `parse_special`).
    pub fn render(&self, inputs: &ChatInputs) -> Result<String, ChatError> {
        let messages = self.prepare_messages(&inputs.messages)?;
        let mut ctx = inputs.extra.clone();
        for (k, v) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(v) = v {
                if !ctx.contains_key(k) {
                    ctx.insert(k.into(), Json::String(v.clone()));
                }
            }
        }
        ctx.insert("messages".into(), messages);
        match &inputs.tools {
            Some(Json::Null) | None => {
                ctx.remove("tools");
            }
            Some(t) => {
                if !t.is_array() {
                    return Err(ChatError::Input("tools must be an array".into()));
                }
                ctx.insert("tools".into(), t.clone());
            }
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(inputs.add_generation_prompt),
        );
        if let Some(b) = inputs.enable_thinking {
            ctx.insert("enable_thinking".into(), Json::Bool(b));
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Render(describe(&e)))?;
        tmpl.render(Value::from_serialize(&ctx)).map_err(|e| {
            let raised = e
                .detail()
                .filter(|_| e.kind() == ErrorKind::InvalidOperation)
                .and_then(|d| d.strip_prefix(RAISED));
            match raised {
                Some(msg) => ChatError::Raised(msg.to_string()),
                None => ChatError::Render(describe(&e)),
            }
        })
    }

    fn prepare_messages(&self, messages: &Json) -> Result<Json, ChatError> {
        let list = messages
            .as_array()
            .ok_or_else(|| ChatError::Input("messages must be an array".into()))?;
        let mut out = Vec::with_capacity(list.len());
        for (i, m) in list.iter().enumerate() {
            let obj = m
                .as_object()
                .ok_or_else(|| ChatError::Input(format!("messages[{i}] is not an object")))?;
            let mut msg: JsonMap<String, Json> = obj
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if !msg.get("role").is_some_and(Json::is_string) {
                return Err(ChatError::Input(format!(
                    "messages[{i}].role must be a string"
                )));
            }
            let content = msg.remove("content").unwrap_or(Json::String(String::new()));
            let content = match content {
                Json::Array(parts) if !self.content_parts => {
                    Json::String(join_text_parts(&parts, i)?)
                }
                Json::String(_) | Json::Array(_) => content,
                other => {
                    return Err(ChatError::Input(format!(
                        "messages[{i}].content must be a string or a list of parts, not {other}"
                    )))
                }
            };
            msg.insert("content".into(), content);
            if !msg.contains_key("reasoning_content") {
                let alias = ["reasoning", "thinking"]
                    .iter()
                    .find_map(|k| msg.get(*k).cloned());
                if let Some(r) = alias {
                    msg.insert("reasoning_content".into(), r);
                }
            }
            if let Some(Json::Array(calls)) = msg.get_mut("tool_calls") {
                for call in calls.iter_mut() {
                    let target = match call.get_mut("function") {
                        Some(f @ Json::Object(_)) => f,
                        _ => call,
                    };
                    if let Some(args) = target.get_mut("arguments") {
                        if let Json::String(s) = args {
                            if let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(s) {
                                *args = parsed;
                            }
                        }
                    }
                }
            }
            out.push(Json::Object(msg));
        }
        Ok(Json::Array(out))
    }
}

fn join_text_parts(parts: &[Json], i: usize) -> Result<String, ChatError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let text = match p {
            Json::String(s) => s.as_str(),
            Json::Object(o) => match o.get("text").and_then(Json::as_str) {
                Some(t) => t,
                None => {
                    let ty = o.get("type").and_then(Json::as_str).unwrap_or("?");
                    return Err(ChatError::Input(format!(
                        "messages[{i}].content[{j}]: part of type {ty:?} is not supported by this \
                         model's chat template (text only)"
                    )));
                }
            },
            _ => {
                return Err(ChatError::Input(format!(
                    "messages[{i}].content[{j}] is not a content part"
                )))
            }
        };
        texts.push(text);
    }
    Ok(texts.join("\n"))
}

fn describe(e: &Error) -> String {
    match e.line() {
        Some(line) => format!("{e} (template line {line})"),
        None => e.to_string(),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{msg}"),
    ))
}

// --------------------------------------------------------------------------- Python output

/// Prints values as Python's `str()` would where minijinja differs (bools, None, floats,
/// lists and dicts).
fn py_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &Value,
) -> Result<(), Error> {
    match py_str(value) {
        Some(s) => {
            out.write_str(&s)?;
            Ok(())
        }
        None => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `str()` of `value` where it differs from minijinja's; None where they agree
/// (strings, integers, undefined) or the value is not plain data.
fn py_str(value: &Value) -> Option<String> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => {
            let json = serde_json::to_value(value).ok()?;
            let mut out = String::new();
            py_repr(&json, &mut out);
            Some(out)
        }
        _ => py_str_scalar(value),
    }
}

/// Python's `repr()` of plain data (what `str()` of a list or dict prints).
fn py_repr(v: &Json, out: &mut String) {
    match v {
        Json::Null => out.push_str("None"),
        Json::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Json::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) if f.is_nan() => out.push_str("nan"),
            Some(f) if f.is_infinite() => out.push_str(if f > 0.0 { "inf" } else { "-inf" }),
            Some(f) => out.push_str(&py_float_repr(f)),
            None => {
                let _ = write!(out, "{n}");
            }
        },
        Json::String(s) => {
            let q = if s.contains('\'') && !s.contains('"') {
                '"'
            } else {
                '\''
            };
            out.push(q);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == q => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                        let _ = write!(out, "\\x{:02x}", c as u32);
                    }
                    c => out.push(c),
                }
            }
            out.push(q);
        }
        Json::Array(items) => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(x, out);
            }
            out.push(']');
        }
        Json::Object(map) => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&Json::String(k.clone()), out);
                out.push_str(": ");
                py_repr(x, out);
            }
            out.push('}');
        }
    }
}

/// Python `str()` of a bool, None or float; None for other kinds.
fn py_str_scalar(value: &Value) -> Option<String> {
    match value.kind() {
        ValueKind::Bool => Some(if value.is_true() { "True" } else { "False" }.into()),
        ValueKind::None => Some("None".into()),
        ValueKind::Number if !value.is_integer() => {
            let f = f64::try_from(value.clone()).ok()?;
            Some(if f.is_nan() {
                "nan".into()
            } else if f.is_infinite() {
                if f > 0.0 { "inf" } else { "-inf" }.into()
            } else {
                py_float_repr(f)
            })
        }
        _ => None,
    }
}

/// `string` filter with Python's spelling of scalars, lists and dicts.
fn string_filter(value: Value) -> Value {
    if value.is_undefined() {
        return Value::from("");
    }
    if value.kind() == ValueKind::String {
        return value;
    }
    match py_str(&value) {
        Some(s) => Value::from(s),
        None => Value::from(value.to_string()),
    }
}

/// Python's `repr(float)` for a finite value: shortest round-trip digits, scientific
/// notation below 1e-4 and from 1e16, exponent with sign and at least two digits.
pub fn py_float_repr(f: f64) -> String {
    let s = format!("{f:e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((s.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

/// Options of Python's `json.dumps`.
struct DumpOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// `tojson` as HF defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`.
fn tojson_filter(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer",
                    )
                })?;
                Some(" ".repeat(n.clamp(0, 64) as usize))
            }
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be strings",
                    )
                })?;
            match <[String; 2]>::try_from(parts) {
                Ok([a, b]) => (a, b),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let opts = DumpOpts {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let json = serde_json::to_value(&value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: value is not JSON: {e}"),
        )
    })?;
    let mut out = String::new();
    dump_json(&json, &opts, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps(value)` with the given options.
pub fn py_json_dumps(value: &Json) -> String {
    let opts = DumpOpts {
        indent: None,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
        ensure_ascii: false,
        sort_keys: false,
    };
    let mut out = String::new();
    dump_json(value, &opts, 0, &mut out);
    out
}

fn dump_json(v: &Json, o: &DumpOpts, level: usize, out: &mut String) {
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => {
            if n.is_f64() {
                let f = n.as_f64().unwrap_or(0.0);
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    out.push_str(&py_float_repr(f));
                }
            } else {
                let _ = write!(out, "{n}");
            }
        }
        Json::String(s) => dump_str(s, o.ensure_ascii, out),
        Json::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                dump_json(item, o, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Json::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                dump_str(k, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                dump_json(val, o, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
    }
}

fn dump_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// --------------------------------------------------------------------------- strftime_now

/// `strftime_now(format)`: the current UTC time. Supports %Y %m %d %e %H %I %M %S %p %y
/// %b %B %a %A %j %%; other directives are copied through.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

fn strftime(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => {
                let _ = write!(out, "{:02}", y.rem_euclid(100));
            }
            Some('m') => {
                let _ = write!(out, "{m:02}");
            }
            Some('d') => {
                let _ = write!(out, "{d:02}");
            }
            Some('e') => {
                let _ = write!(out, "{d:2}");
            }
            Some('H') => {
                let _ = write!(out, "{h:02}");
            }
            Some('I') => {
                let _ = write!(out, "{:02}", if h % 12 == 0 { 12 } else { h % 12 });
            }
            Some('M') => {
                let _ = write!(out, "{mi:02}");
            }
            Some('S') => {
                let _ = write!(out, "{s:02}");
            }
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&DAYS[wday][..3]),
            Some('A') => out.push_str(DAYS[wday]),
            Some('j') => {
                let _ = write!(out, "{yday:03}");
            }
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (1.5e300, "1.5e+300"),
            (0.1 + 0.2, "0.30000000000000004"),
            (-2.5e-10, "-2.5e-10"),
        ] {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn json_dumps_matches_python() {
        let v = json!({"a": [1, 2.0, true, null], "é": "x<y>&\"\n\u{1}", "e": {}, "l": []});
        assert_eq!(
            py_json_dumps(&v),
            r#"{"a": [1, 2.0, true, null], "é": "x<y>&\"\n\u0001", "e": {}, "l": []}"#
        );
    }

    #[test]
    fn tojson_kwargs() {
        let t = ChatTemplate::new(
            "{{ x|tojson }}|{{ x|tojson(indent=2) }}|{{ x|tojson(ensure_ascii=true, sort_keys=true) }}\
             |{{ x|tojson(separators=(',', ':')) }}",
        )
        .expect("compile");
        let mut extra = JsonMap::new();
        extra.insert("x".into(), json!({"b": "ü", "a": [1]}));
        let inputs = ChatInputs {
            messages: json!([]),
            extra,
            ..Default::default()
        };
        assert_eq!(
            t.render(&inputs).expect("render"),
            "{\"b\": \"ü\", \"a\": [1]}|{\n  \"b\": \"ü\",\n  \"a\": [\n    1\n  ]\n}|\
             {\"a\": [1], \"b\": \"\\u00fc\"}|{\"b\":\"ü\",\"a\":[1]}"
        );
    }

    #[test]
    fn python_scalars_and_raise() {
        let t = ChatTemplate::new(
            "{{ true }} {{ none }} {{ 0.00001 }} {{ false|string }} {{ 3|string }}\n\
             {%- if messages|length == 0 %}{{ raise_exception('empty!') }}{% endif %}",
        )
        .expect("compile");
        let mut inputs = ChatInputs {
            messages: json!([{"role": "user", "content": "x"}]),
            ..Default::default()
        };
        assert_eq!(
            t.render(&inputs).expect("render"),
            "True None 1e-05 False 3"
        );
        inputs.messages = json!([]);
        match t.render(&inputs) {
            Err(ChatError::Raised(m)) => assert_eq!(m, "empty!"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %j", 0),
            "1970-01-01 00:00:00 Thu 001"
        );
        // 2024-02-29 13:05:09 UTC
        assert_eq!(
            strftime("%d %b %Y %I%p %A %B %e %j %%", 1_709_211_909),
            "29 Feb 2024 01PM Thursday February 29 060 %"
        );
    }

    #[test]
    fn bad_input_is_an_error() {
        let t = ChatTemplate::new(QWEN3_TEMPLATE).expect("compile");
        let bad = [
            json!({"role": "user"}),
            json!([1]),
            json!([{"content": "x"}]),
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        ];
        for m in bad {
            let inputs = ChatInputs {
                messages: m.clone(),
                ..Default::default()
            };
            assert!(matches!(t.render(&inputs), Err(ChatError::Input(_))), "{m}");
        }
        assert!(matches!(
            ChatTemplate::new("{% if %}"),
            Err(ChatError::Syntax(_))
        ));
    }
}
