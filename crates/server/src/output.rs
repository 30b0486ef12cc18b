//! Turning the model's text into structured output, as it streams.
//!
//! Qwen models write their reasoning between `<think>` and `</think>` and their tool
//! calls between `<tool_call>` and `</tool_call>`, in one of two forms:
//!
//! * JSON (Qwen3, Qwen3-Next): `{"name": "f", "arguments": {...}}`
//! * XML (Qwen3.5 / Qwen3.6, Qwen3-Coder):
//!   `<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>`
//!
//! [`OutputParser`] takes text chunks in generation order and returns [`Piece`]s:
//! reasoning text, answer text, and tool calls (start, argument deltas, end). It holds
//! back only what could still be the start of a tag, so a client sees text as soon as
//! it is unambiguous. The argument deltas of one call concatenate to a JSON object.
//!
//! [`StopMatcher`] finds stop sequences across token boundaries the same way.

use serde_json::{Map, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

/// One unit of structured output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    /// A tool call begins; `index` counts calls from 0 within the response.
    ToolStart {
        index: usize,
        name: String,
    },
    /// More of the call's arguments (a JSON text, in pieces).
    ToolArgs {
        index: usize,
        delta: String,
    },
    ToolEnd {
        index: usize,
    },
    /// The output ended inside the call (the token budget ran out): its arguments
    /// are what was generated, not a complete object. Ends the call in place of
    /// `ToolEnd`.
    ToolCut {
        index: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
    Tool,
}

/// The XML form's position inside a `<tool_call>`.
#[derive(Debug, Clone, PartialEq)]
enum XmlState {
    /// Before `<function=`.
    Start,
    /// Inside a function, between parameters; `params` counts emitted ones.
    InFunction { params: usize },
    /// After `</function>`, waiting for `</tool_call>`.
    Done,
}

/// The streaming splitter. Feed it text with [`OutputParser::push`], then call
/// [`OutputParser::finish`] once.
#[derive(Debug)]
pub struct OutputParser {
    mode: Mode,
    buf: String,
    /// Tool-call parsing is on (the request declared tools).
    tools_enabled: bool,
    /// Parameter types by tool name, from the request's schemas (for the XML form).
    param_types: std::collections::HashMap<String, Map<String, Value>>,
    /// Content emitted so far is empty (for a leading `<think>` and whitespace).
    content_started: bool,
    /// Whitespace at the end of the content, held until something follows it.
    pending_ws: String,
    n_calls: usize,
    /// Inside a tool call: which form, and how far.
    tool_xml: Option<XmlState>,
    /// A JSON-form call being streamed: (byte offset of the arguments object in `buf`,
    /// bytes of it emitted so far).
    json_stream: Option<(usize, usize)>,
    current_name: Option<String>,
    reasoning_len: usize,
    /// [`OutputParser::finish_cut`]: the output was cut off by the token budget.
    cut: bool,
}

impl OutputParser {
    /// `in_reasoning`: the prompt opened a think block the model is now inside
    /// (Qwen3.5's generation prompt does). `tools`: the request's tools in OpenAI
    /// chat shape (`[{"type":"function","function":{"name","parameters"}}]`), or None
    /// to leave `<tool_call>` text as content.
    /// The output continues a message already under way (a prefill): its leading
    /// whitespace is part of the text, not formatting after a turn or a think block.
    pub fn continue_message(&mut self) {
        self.content_started = true;
    }

    pub fn new(in_reasoning: bool, tools: Option<&Value>) -> OutputParser {
        let mut param_types = std::collections::HashMap::new();
        if let Some(Value::Array(list)) = tools {
            for t in list {
                let f = t.get("function").unwrap_or(t);
                if let (Some(name), Some(props)) = (
                    f.get("name").and_then(Value::as_str),
                    f.get("parameters")
                        .and_then(|p| p.get("properties"))
                        .and_then(Value::as_object),
                ) {
                    param_types.insert(name.to_string(), props.clone());
                }
            }
        }
        OutputParser {
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            tools_enabled: tools.is_some(),
            param_types,
            content_started: false,
            pending_ws: String::new(),
            n_calls: 0,
            tool_xml: None,
            json_stream: None,
            current_name: None,
            reasoning_len: 0,
            cut: false,
        }
    }

    /// Whether the model is inside its think block now.
    pub fn in_reasoning(&self) -> bool {
        self.mode == Mode::Reasoning
    }

    /// Number of tool calls started so far.
    pub fn tool_calls(&self) -> usize {
        self.n_calls
    }

    /// Adds generated text; returns what is now certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(&mut out, false);
        out
    }

    /// Ends output that the token budget cut off: as [`OutputParser::finish`], but a
    /// tool call left open ends in [`Piece::ToolCut`] with the arguments generated so
    /// far (no closing brace is made up), and call markup cut before the function's
    /// name is dropped rather than given out as answer text.
    pub fn finish_cut(&mut self) -> Vec<Piece> {
        self.cut = true;
        self.finish()
    }

    /// Ends the output: everything held back is resolved.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.run(&mut out, true);
        match self.mode {
            Mode::Reasoning => {
                let rest = std::mem::take(&mut self.buf);
                self.emit_reasoning(rest, &mut out);
            }
            Mode::Content => {
                let rest = std::mem::take(&mut self.buf);
                self.emit_content(rest, &mut out);
            }
            Mode::Tool => self.finish_tool(&mut out),
        }
        // Trailing whitespace of the answer is dropped.
        self.pending_ws.clear();
        out
    }

    fn run(&mut self, out: &mut Vec<Piece>, at_end: bool) {
        loop {
            let progressed = match self.mode {
                Mode::Reasoning => self.step_reasoning(out, at_end),
                Mode::Content => self.step_content(out, at_end),
                Mode::Tool => self.step_tool(out),
            };
            if !progressed {
                break;
            }
        }
    }

    fn emit_reasoning(&mut self, text: String, out: &mut Vec<Piece>) {
        // The think block's leading newline is template formatting, not reasoning.
        let text = if self.reasoning_len == 0 {
            text.trim_start_matches('\n').to_string()
        } else {
            text
        };
        if text.is_empty() {
            return;
        }
        self.reasoning_len += text.len();
        match out.last_mut() {
            Some(Piece::Reasoning(r)) => r.push_str(&text),
            _ => out.push(Piece::Reasoning(text)),
        }
    }

    fn emit_content(&mut self, text: String, out: &mut Vec<Piece>) {
        let mut text = text.as_str();
        if !self.content_started {
            text = text.trim_start();
        }
        if text.is_empty() {
            return;
        }
        let body = text.trim_end();
        let trailing = &text[body.len()..];
        if body.is_empty() {
            self.pending_ws.push_str(trailing);
            return;
        }
        let mut s = std::mem::take(&mut self.pending_ws);
        s.push_str(body);
        self.pending_ws.push_str(trailing);
        self.content_started = true;
        match out.last_mut() {
            Some(Piece::Content(c)) => c.push_str(&s),
            _ => out.push(Piece::Content(s)),
        }
    }

    /// Returns true when the mode changed (so the loop runs again).
    fn step_reasoning(&mut self, out: &mut Vec<Piece>, at_end: bool) -> bool {
        if let Some(pos) = self.buf.find(THINK_CLOSE) {
            let before = self.buf[..pos].to_string();
            self.buf.drain(..pos + THINK_CLOSE.len());
            // Whitespace before </think> is formatting.
            self.emit_reasoning(before.trim_end().to_string(), out);
            self.mode = Mode::Content;
            return true;
        }
        if !at_end {
            let keep = partial_tag_len(&self.buf, &[THINK_CLOSE]);
            let emit_to = self.buf.len() - keep;
            // Hold trailing whitespace too: it may precede </think>.
            let head = self.buf[..emit_to].trim_end().len();
            if head > 0 {
                let text: String = self.buf.drain(..head).collect();
                self.emit_reasoning(text, out);
            }
        }
        false
    }

    fn step_content(&mut self, out: &mut Vec<Piece>, at_end: bool) -> bool {
        // A think block the model opens itself (Qwen3 without a pre-opened block).
        if !self.content_started && self.reasoning_len == 0 {
            let trimmed = self.buf.trim_start();
            if let Some(rest) = trimmed.strip_prefix(THINK_OPEN) {
                self.buf = rest.to_string();
                self.mode = Mode::Reasoning;
                return true;
            }
            if !at_end && !trimmed.is_empty() && THINK_OPEN.starts_with(trimmed) {
                return false;
            }
        }
        let tags: &[&str] = if self.tools_enabled {
            &[TOOL_OPEN, FUNCTION_OPEN]
        } else {
            &[]
        };
        let found = tags
            .iter()
            .filter_map(|t| self.buf.find(t).map(|p| (p, *t)))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, tag)) = found {
            let before: String = self.buf.drain(..pos).collect();
            self.emit_content(before, out);
            if tag == TOOL_OPEN {
                self.buf.drain(..TOOL_OPEN.len());
            }
            // A bare <function=...> (no wrapper) is parsed the same way.
            self.mode = Mode::Tool;
            self.tool_xml = None;
            self.json_stream = None;
            return true;
        }
        let keep = if at_end {
            0
        } else {
            partial_tag_len(&self.buf, tags)
        };
        let emit_to = self.buf.len() - keep;
        if emit_to > 0 {
            let text: String = self.buf.drain(..emit_to).collect();
            self.emit_content(text, out);
        }
        false
    }

    /// Parses as much of a tool call as is complete. Returns true on leaving Tool mode.
    fn step_tool(&mut self, out: &mut Vec<Piece>) -> bool {
        if self.tool_xml.is_none() {
            let trimmed = self.buf.trim_start();
            if trimmed.is_empty() {
                return false;
            }
            if trimmed.starts_with('<') {
                if trimmed.len() < FUNCTION_OPEN.len() && FUNCTION_OPEN.starts_with(trimmed) {
                    return false;
                }
                if trimmed.starts_with(FUNCTION_OPEN) {
                    self.tool_xml = Some(XmlState::Start);
                }
            }
        }
        match self.tool_xml.clone() {
            None => self.step_tool_json(out),
            Some(state) => self.step_tool_xml(state, out),
        }
    }

    /// The JSON form. Once `"name"` and the start of an `"arguments"` object are seen
    /// (in that order, as Qwen writes them), the call starts and the arguments stream
    /// as they arrive, holding back trailing `}` and whitespace (one of those braces
    /// closes the outer object). Otherwise the call is parsed whole at `</tool_call>`.
    fn step_tool_json(&mut self, out: &mut Vec<Piece>) -> bool {
        let close = self.buf.find(TOOL_CLOSE);
        if self.json_stream.is_none() {
            if close.is_none() {
                if let Some((name, start)) = json_call_head(&self.buf) {
                    let index = self.n_calls;
                    self.n_calls += 1;
                    out.push(Piece::ToolStart { index, name });
                    self.json_stream = Some((start, 0));
                }
            } else if let Some(end) = close {
                let body: String = self.buf[..end].to_string();
                self.buf.drain(..end + TOOL_CLOSE.len());
                self.emit_json_call(&body, out);
                self.mode = Mode::Content;
                return true;
            }
        }
        let Some((start, emitted)) = self.json_stream else {
            return false;
        };
        let index = self.n_calls - 1;
        match close {
            Some(end) => {
                let args = json_args_final(&self.buf[start..end]);
                if args.len() > emitted {
                    out.push(Piece::ToolArgs {
                        index,
                        delta: args[emitted..].to_string(),
                    });
                }
                out.push(Piece::ToolEnd { index });
                self.buf.drain(..end + TOOL_CLOSE.len());
                self.json_stream = None;
                self.mode = Mode::Content;
                true
            }
            None => {
                let avail = &self.buf[start..];
                let keep = partial_tag_len(avail, &[TOOL_CLOSE]);
                let safe = avail[..avail.len() - keep]
                    .trim_end_matches(|c: char| c == '}' || c.is_whitespace())
                    .len();
                if safe > emitted {
                    out.push(Piece::ToolArgs {
                        index,
                        delta: avail[emitted..safe].to_string(),
                    });
                    self.json_stream = Some((start, safe));
                }
                false
            }
        }
    }

    /// Emits a JSON-form call, or the raw text as content when it does not parse.
    fn emit_json_call(&mut self, body: &str, out: &mut Vec<Piece>) {
        match parse_json_call(body) {
            Some((name, args)) => {
                let index = self.n_calls;
                self.n_calls += 1;
                out.push(Piece::ToolStart { index, name });
                out.push(Piece::ToolArgs { index, delta: args });
                out.push(Piece::ToolEnd { index });
            }
            None => {
                let raw = format!("{TOOL_OPEN}{body}{TOOL_CLOSE}");
                self.emit_content(raw, out);
            }
        }
    }

    fn step_tool_xml(&mut self, state: XmlState, out: &mut Vec<Piece>) -> bool {
        match state {
            XmlState::Start => {
                let Some(start) = self.buf.find(FUNCTION_OPEN) else {
                    return false;
                };
                let after = start + FUNCTION_OPEN.len();
                let Some(close) = self.buf[after..].find('>') else {
                    return false;
                };
                let name = self.buf[after..after + close].trim().to_string();
                self.buf.drain(..after + close + 1);
                let index = self.n_calls;
                self.n_calls += 1;
                out.push(Piece::ToolStart {
                    index,
                    name: name.clone(),
                });
                self.current_name = Some(name);
                self.tool_xml = Some(XmlState::InFunction { params: 0 });
                true
            }
            XmlState::InFunction { params } => {
                let index = self.n_calls - 1;
                let p_open = self.buf.find(PARAM_OPEN);
                let f_close = self.buf.find(FUNCTION_CLOSE);
                match (p_open, f_close) {
                    (Some(p), f) if f.is_none_or(|f| p < f) => {
                        let after = p + PARAM_OPEN.len();
                        let Some(gt) = self.buf[after..].find('>') else {
                            return false;
                        };
                        let pname = self.buf[after..after + gt].trim().to_string();
                        let vstart = after + gt + 1;
                        // The value ends at </parameter>, or where the next parameter or
                        // the function's end begins (a model that forgot to close it).
                        let rest = &self.buf[vstart..];
                        let ends = [
                            rest.find(PARAM_CLOSE).map(|e| (e, PARAM_CLOSE.len())),
                            rest.find(PARAM_OPEN).map(|e| (e, 0)),
                            rest.find(FUNCTION_CLOSE).map(|e| (e, 0)),
                        ];
                        let Some((vend, skip)) = ends.into_iter().flatten().min_by_key(|e| e.0)
                        else {
                            return false;
                        };
                        let raw = rest[..vend].to_string();
                        self.buf.drain(..vstart + vend + skip);
                        let value = self.param_value(&pname, &raw);
                        let key = Value::String(pname).to_string();
                        let sep = if params == 0 { "{" } else { ", " };
                        out.push(Piece::ToolArgs {
                            index,
                            delta: format!("{sep}{key}: {value}"),
                        });
                        self.tool_xml = Some(XmlState::InFunction { params: params + 1 });
                        true
                    }
                    (_, Some(f)) => {
                        self.buf.drain(..f + FUNCTION_CLOSE.len());
                        let delta = if params == 0 { "{}" } else { "}" };
                        out.push(Piece::ToolArgs {
                            index,
                            delta: delta.to_string(),
                        });
                        out.push(Piece::ToolEnd { index });
                        self.current_name = None;
                        self.tool_xml = Some(XmlState::Done);
                        true
                    }
                    _ => false,
                }
            }
            XmlState::Done => {
                let trimmed = self.buf.trim_start();
                if let Some(rest) = trimmed.strip_prefix(TOOL_CLOSE) {
                    self.buf = rest.to_string();
                    self.mode = Mode::Content;
                    self.tool_xml = None;
                    return true;
                }
                if trimmed.is_empty() || TOOL_CLOSE.starts_with(trimmed) {
                    return false;
                }
                // No </tool_call> (a bare <function=> call): back to content.
                self.mode = Mode::Content;
                self.tool_xml = None;
                true
            }
        }
    }

    /// A parameter's JSON value: the schema's type decides; without one, JSON
    /// literals (numbers, booleans, objects, arrays, null) keep their type.
    fn param_value(&self, pname: &str, raw: &str) -> Value {
        let text = raw.strip_prefix('\n').unwrap_or(raw);
        let text = text.strip_suffix('\n').unwrap_or(text);
        let ty = self
            .current_name
            .as_ref()
            .and_then(|n| self.param_types.get(n))
            .and_then(|props| props.get(pname))
            .and_then(|p| p.get("type"))
            .and_then(Value::as_str);
        match ty {
            Some("string") => Value::String(text.to_string()),
            _ => match serde_json::from_str::<Value>(text.trim()) {
                Ok(v) if !v.is_string() => v,
                _ => Value::String(text.to_string()),
            },
        }
    }

    fn finish_tool(&mut self, out: &mut Vec<Piece>) {
        if self.cut {
            self.finish_cut_tool(out);
            self.mode = Mode::Content;
            return;
        }
        let rest = std::mem::take(&mut self.buf);
        match self.tool_xml.take() {
            None if self.json_stream.is_some() => {
                let (start, emitted) = self.json_stream.take().unwrap_or((0, 0));
                let index = self.n_calls - 1;
                let args = json_args_final(rest.get(start..).unwrap_or(""));
                if args.len() > emitted {
                    out.push(Piece::ToolArgs {
                        index,
                        delta: args[emitted..].to_string(),
                    });
                }
                out.push(Piece::ToolEnd { index });
            }
            None => {
                // An unterminated JSON call: use it if it parses.
                match parse_json_call(&rest) {
                    Some(_) => self.emit_json_call(&rest, out),
                    None => self.emit_content(format!("{TOOL_OPEN}{rest}"), out),
                }
            }
            Some(XmlState::Start) => self.emit_content(format!("{TOOL_OPEN}{rest}"), out),
            Some(XmlState::InFunction { params }) => {
                let index = self.n_calls - 1;
                let delta = if params == 0 { "{}" } else { "}" };
                out.push(Piece::ToolArgs {
                    index,
                    delta: delta.to_string(),
                });
                out.push(Piece::ToolEnd { index });
            }
            Some(XmlState::Done) => {}
        }
        self.mode = Mode::Content;
    }
}

impl OutputParser {
    /// [`OutputParser::finish_tool`] for output cut off by the budget.
    fn finish_cut_tool(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.buf);
        match self.tool_xml.take() {
            None if self.json_stream.is_some() => {
                let (start, emitted) = self.json_stream.take().unwrap_or((0, 0));
                let index = self.n_calls - 1;
                let avail = rest.get(start..).unwrap_or("");
                let avail = &avail[..avail.len() - partial_tag_len(avail, &[TOOL_CLOSE])];
                if avail.len() > emitted {
                    out.push(Piece::ToolArgs {
                        index,
                        delta: avail[emitted..].to_string(),
                    });
                }
                out.push(Piece::ToolCut { index });
            }
            // A whole call whose closing tag was cut off is a call; less is dropped.
            None if parse_json_call(&rest).is_some() => self.emit_json_call(&rest, out),
            None | Some(XmlState::Start) => {}
            Some(XmlState::InFunction { .. }) => out.push(Piece::ToolCut {
                index: self.n_calls - 1,
            }),
            Some(XmlState::Done) => {}
        }
    }
}

/// The head of a JSON-form call: `{"name": "f", "arguments": {` → ("f", offset of
/// the arguments' `{`). None until all of that has arrived (or when the arguments
/// come first, or are not an object).
fn json_call_head(buf: &str) -> Option<(String, usize)> {
    let t = buf.trim_start();
    if !t.starts_with('{') {
        return None;
    }
    let key = buf.find("\"name\"")?;
    let mut i = key + "\"name\"".len();
    let skip_ws = |i: &mut usize| {
        while buf[*i..].starts_with(|c: char| c.is_ascii_whitespace()) {
            *i += 1;
        }
    };
    skip_ws(&mut i);
    if !buf[i..].starts_with(':') {
        return None;
    }
    i += 1;
    skip_ws(&mut i);
    if !buf[i..].starts_with('"') {
        return None;
    }
    // The string literal ends at the first unescaped quote.
    let lit_start = i;
    let mut j = i + 1;
    let bytes = buf.as_bytes();
    loop {
        match bytes.get(j)? {
            b'\\' => j += 2,
            b'"' => break,
            _ => j += 1,
        }
    }
    let name: String = serde_json::from_str(buf.get(lit_start..=j)?).ok()?;
    let rest = &buf[j + 1..];
    let akey = rest.find("\"arguments\"")?;
    let mut k = j + 1 + akey + "\"arguments\"".len();
    skip_ws(&mut k);
    if !buf[k..].starts_with(':') {
        return None;
    }
    k += 1;
    skip_ws(&mut k);
    if !buf[k..].starts_with('{') {
        return None;
    }
    Some((name, k))
}

/// The arguments object of a finished JSON-form call, from its `{` to the end of the
/// call body: the text minus the outer object's closing brace.
fn json_args_final(from_args: &str) -> String {
    let t = from_args.trim_end();
    // The whole remainder parses: the outer object was never closed.
    if serde_json::from_str::<Value>(t).is_ok() {
        return t.to_string();
    }
    match t.strip_suffix('}') {
        Some(inner) => inner.trim_end().to_string(),
        None => t.to_string(),
    }
}

/// `{"name": ..., "arguments": ...}` → (name, arguments as JSON text).
fn parse_json_call(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(inner) if inner.is_object() => inner.to_string(),
            _ => Value::String(s.clone()).to_string(),
        },
        Some(other) => other.to_string(),
    };
    Some((name, args))
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `tags`
/// (what must be held back because the next chunk may complete the tag).
fn partial_tag_len(text: &str, tags: &[&str]) -> usize {
    let mut best = 0;
    for tag in tags {
        let max = tag.len().saturating_sub(1).min(text.len());
        for n in (1..=max).rev() {
            if n <= best {
                break;
            }
            if text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]) {
                best = n;
                break;
            }
        }
    }
    best
}

/// Stop sequences matched on text across token boundaries.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds text; returns the text that is safe to emit, and the stop sequence that
    /// matched (the text from the match on is dropped; nothing more should be pushed).
    pub fn push(&mut self, text: &str) -> (String, Option<String>) {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.held), None);
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s)))
            .min_by_key(|(p, _)| *p);
        if let Some((pos, stop)) = hit {
            let stop = stop.clone();
            let emit = self.held[..pos].to_string();
            self.held.clear();
            return (emit, Some(stop));
        }
        let refs: Vec<&str> = self.stops.iter().map(String::as_str).collect();
        let keep = partial_tag_len(&self.held, &refs);
        let emit: String = self.held.drain(..self.held.len() - keep).collect();
        (emit, None)
    }

    /// Ends the stream: the held-back text is not a stop after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Feeds `text` in chunks of `n` chars and collects merged pieces.
    fn run(p: &mut OutputParser, text: &str, n: usize) -> Vec<Piece> {
        let chars: Vec<char> = text.chars().collect();
        let mut all = Vec::new();
        for chunk in chars.chunks(n) {
            let s: String = chunk.iter().collect();
            all.extend(p.push(&s));
        }
        all.extend(p.finish());
        merge(all)
    }

    fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        for p in pieces {
            match (out.last_mut(), p) {
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (
                    Some(Piece::ToolArgs { index: i, delta: a }),
                    Piece::ToolArgs { index: j, delta: b },
                ) if *i == j => a.push_str(&b),
                (_, p) => out.push(p),
            }
        }
        out
    }

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])
    }

    #[test]
    fn reasoning_then_content_every_chunking() {
        let text = "\nLet me think.\n</think>\n\nThe answer is 4.";
        for n in 1..8 {
            let mut p = OutputParser::new(true, None);
            assert_eq!(
                run(&mut p, text, n),
                vec![
                    Piece::Reasoning("Let me think.".into()),
                    Piece::Content("The answer is 4.".into())
                ],
                "chunk {n}"
            );
        }
    }

    #[test]
    fn model_opened_think_block() {
        let text = "<think>\nhmm\n</think>\n\nHi";
        for n in 1..6 {
            let mut p = OutputParser::new(false, None);
            assert_eq!(
                run(&mut p, text, n),
                vec![Piece::Reasoning("hmm".into()), Piece::Content("Hi".into())]
            );
        }
    }

    #[test]
    fn unclosed_reasoning_stays_reasoning() {
        let mut p = OutputParser::new(true, None);
        assert_eq!(
            run(&mut p, "thinking </thi", 3),
            vec![Piece::Reasoning("thinking </thi".into())]
        );
    }

    #[test]
    fn plain_content_no_tags() {
        let mut p = OutputParser::new(false, None);
        assert_eq!(
            run(&mut p, "a < b and <tool_call> stays text", 2),
            vec![Piece::Content("a < b and <tool_call> stays text".into())]
        );
    }

    #[test]
    fn json_tool_call() {
        let text = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"o\": {\"a\": [1]}}}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"g\"}\n</tool_call>";
        for n in 1..9 {
            let mut p = OutputParser::new(false, Some(&tools()));
            let got = run(&mut p, text, n);
            assert_eq!(got.len(), 7, "{got:?}");
            assert_eq!(got[0], Piece::Content("Checking.".into()));
            assert_eq!(
                got[1],
                Piece::ToolStart {
                    index: 0,
                    name: "get_weather".into()
                }
            );
            let Piece::ToolArgs { delta, .. } = &got[2] else {
                panic!("{got:?}")
            };
            let v: Value = serde_json::from_str(delta).unwrap();
            assert_eq!(v, json!({"city": "Paris", "o": {"a": [1]}}));
            assert_eq!(got[3], Piece::ToolEnd { index: 0 });
            // Arguments before the name: parsed whole at the end.
            assert_eq!(
                got[4],
                Piece::ToolStart {
                    index: 1,
                    name: "g".into()
                }
            );
            assert_eq!(
                got[5],
                Piece::ToolArgs {
                    index: 1,
                    delta: "{}".into()
                }
            );
        }
    }

    #[test]
    fn json_head_with_unicode_whitespace_does_not_panic() {
        let mut p = OutputParser::new(false, Some(&tools()));
        let mut got =
            p.push("<tool_call>{\"name\"\u{3000}: \"f\", \"arguments\":\u{3000}{\"x\": \"é\"}}");
        got.extend(p.push("</tool_call>"));
        got.extend(p.finish());
        assert!(got
            .iter()
            .any(|g| matches!(g, Piece::ToolEnd { .. }) || matches!(g, Piece::Content(_))));
    }

    #[test]
    fn random_fragments_never_panic() {
        let frags = [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<function=f>",
            "</function>",
            "<parameter=p>",
            "</parameter>",
            "{\"name\": \"f\", \"arguments\": {",
            "}",
            "\"",
            "é",
            "\u{3000}",
            "\n",
            " ",
            "<",
            "x",
            "日本",
            "{",
            ":",
        ];
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |m: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % m as u64) as usize
        };
        for round in 0..400 {
            let text: String = (0..next(30)).map(|_| frags[next(frags.len())]).collect();
            let tools = json!([{"type": "function", "function": {"name": "f"}}]);
            let mut p = OutputParser::new(round % 2 == 0, (round % 3 != 0).then_some(&tools));
            let chars: Vec<char> = text.chars().collect();
            let mut i = 0;
            while i < chars.len() {
                let n = 1 + next(6);
                let chunk: String = chars[i..(i + n).min(chars.len())].iter().collect();
                p.push(&chunk);
                i += n;
            }
            p.finish();
            let mut m = StopMatcher::new(vec!["é!".into(), "日".into()]);
            for c in text.chars() {
                m.push(&c.to_string());
            }
            m.finish();
        }
    }

    #[test]
    fn json_tool_call_streams_arguments() {
        let mut p = OutputParser::new(false, Some(&tools()));
        assert_eq!(p.push("<tool_call>\n{\"name\": \"get_"), vec![]);
        assert_eq!(
            p.push("weather\", \"arguments\": {\"ci"),
            vec![
                Piece::ToolStart {
                    index: 0,
                    name: "get_weather".into()
                },
                Piece::ToolArgs {
                    index: 0,
                    delta: "{\"ci".into()
                },
            ]
        );
        assert_eq!(
            p.push("ty\": \"Oslo\"}}\n</tool"),
            vec![Piece::ToolArgs {
                index: 0,
                delta: "ty\": \"Oslo\"".into()
            }]
        );
        assert_eq!(
            p.push("_call>"),
            vec![
                Piece::ToolArgs {
                    index: 0,
                    delta: "}".into()
                },
                Piece::ToolEnd { index: 0 }
            ]
        );
        // Unterminated at the end of generation: closed with what arrived.
        let mut p = OutputParser::new(false, Some(&tools()));
        let mut got = p.push("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}");
        got.extend(p.finish());
        let args: String = got
            .iter()
            .filter_map(|g| match g {
                Piece::ToolArgs { delta, .. } => Some(delta.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(
            serde_json::from_str::<Value>(&args).unwrap(),
            json!({"x": 1})
        );
    }

    #[test]
    fn xml_tool_calls_typed_by_schema() {
        let text = "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>";
        for n in 1..10 {
            let mut p = OutputParser::new(true, Some(&tools()));
            let got = run(&mut p, text, n);
            assert_eq!(
                got,
                vec![
                    Piece::ToolStart {
                        index: 0,
                        name: "get_weather".into()
                    },
                    Piece::ToolArgs {
                        index: 0,
                        delta: "{\"city\": \"42\", \"days\": 3}".into()
                    },
                    Piece::ToolEnd { index: 0 },
                    Piece::ToolStart {
                        index: 1,
                        name: "get_weather".into()
                    },
                    Piece::ToolArgs {
                        index: 1,
                        delta: "{}".into()
                    },
                    Piece::ToolEnd { index: 1 },
                ],
                "chunk {n}"
            );
            if let Piece::ToolArgs { delta, .. } = &got[1] {
                let v: Value = serde_json::from_str(delta).unwrap();
                assert_eq!(v["days"], 3);
            }
        }
    }

    #[test]
    fn xml_multiline_value_and_untyped_json() {
        let text = "<tool_call>\n<function=run>\n<parameter=code>\nprint(1)\nprint(2)\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n</function>\n</tool_call>";
        let mut p = OutputParser::new(false, Some(&json!([])));
        let got = run(&mut p, text, 4);
        let Piece::ToolArgs { delta, .. } = &got[1] else {
            panic!("{got:?}")
        };
        let v: Value = serde_json::from_str(delta).unwrap();
        assert_eq!(v["code"], "print(1)\nprint(2)");
        assert_eq!(v["opts"]["a"][0], 1);
    }

    #[test]
    fn xml_streams_incrementally() {
        let mut p = OutputParser::new(false, Some(&tools()));
        let a = p.push("<tool_call>\n<function=get_weather>\n");
        assert_eq!(
            a,
            vec![Piece::ToolStart {
                index: 0,
                name: "get_weather".into()
            }]
        );
        let b = p.push("<parameter=city>\nRome\n</parameter>\n");
        assert_eq!(
            b,
            vec![Piece::ToolArgs {
                index: 0,
                delta: "{\"city\": \"Rome\"".into()
            }]
        );
    }

    #[test]
    fn bad_json_call_is_content() {
        let mut p = OutputParser::new(false, Some(&tools()));
        assert_eq!(
            run(&mut p, "<tool_call>{oops</tool_call>", 3),
            vec![Piece::Content("<tool_call>{oops</tool_call>".into())]
        );
    }

    /// Output the budget cut off: a call in progress ends in `ToolCut` with what it
    /// has (no closing brace made up), markup before the name is dropped.
    #[test]
    fn cut_calls_keep_what_they_have_and_leak_no_markup() {
        let cut = |text: &str| {
            let mut p = OutputParser::new(false, Some(&tools()));
            let mut got = p.push(text);
            got.extend(p.finish_cut());
            merge(got)
        };
        let call = |delta: &str, end: Piece| {
            let mut v = vec![Piece::ToolStart {
                index: 0,
                name: "get_weather".into(),
            }];
            if !delta.is_empty() {
                v.push(Piece::ToolArgs {
                    index: 0,
                    delta: delta.into(),
                });
            }
            v.push(end);
            v
        };
        assert_eq!(
            cut("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Os"),
            call("{\"city\": \"Os", Piece::ToolCut { index: 0 })
        );
        assert_eq!(
            cut("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs"),
            call("", Piece::ToolCut { index: 0 })
        );
        assert_eq!(
            cut("Hi.\n<tool_call>\n<func"),
            vec![Piece::Content("Hi.".into())]
        );
        assert_eq!(
            cut("Hi.\n<tool_call>\n{\"na"),
            vec![Piece::Content("Hi.".into())]
        );
        // A whole JSON call whose closing tag was cut off is a call.
        assert_eq!(
            cut("<tool_call>\n{\"arguments\": {\"city\": \"Oslo\"}, \"name\": \"get_weather\"}"),
            call("{\"city\":\"Oslo\"}", Piece::ToolEnd { index: 0 })
        );
    }

    #[test]
    fn truncated_xml_call_is_closed() {
        let mut p = OutputParser::new(false, Some(&tools()));
        let got = run(
            &mut p,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOs",
            5,
        );
        assert_eq!(
            got,
            vec![
                Piece::ToolStart {
                    index: 0,
                    name: "get_weather".into()
                },
                Piece::ToolArgs {
                    index: 0,
                    delta: "{}".into()
                },
                Piece::ToolEnd { index: 0 },
            ]
        );
    }

    #[test]
    fn trailing_whitespace_dropped_inner_kept() {
        let mut p = OutputParser::new(false, None);
        assert_eq!(
            run(&mut p, "a \n b\n\n", 1),
            vec![Piece::Content("a \n b".into())]
        );
    }

    #[test]
    fn stop_across_boundaries() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        let (a, s) = m.push("hello E");
        assert_eq!((a.as_str(), s), ("hello ", None));
        let (b, s) = m.push("N");
        assert_eq!((b.as_str(), s), ("", None));
        let (c, s) = m.push("D tail");
        assert_eq!((c.as_str(), s.as_deref()), ("", Some("END")));
    }

    #[test]
    fn stop_false_alarm_released() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("EN").0, "");
        assert_eq!(m.push("x").0, "ENx");
        assert_eq!(m.push("E").0, "");
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn stop_earliest_wins_and_unicode() {
        let mut m = StopMatcher::new(vec!["é!".into(), "b".into()]);
        let (a, s) = m.push("aéé!b");
        assert_eq!((a.as_str(), s.as_deref()), ("aé", Some("é!")));
    }
}
