//! OpenAI Responses API: `POST /v1/responses`.
//!
//! Output items in order: a `reasoning` item (the think block as a `reasoning_text`
//! content part, and again as `summary_text` when the request asks for a summary —
//! there is no separate summarizer), a `message` item with the answer, and one
//! `function_call` item per tool call — a `custom_tool_call` item, with the raw
//! input, for a call of a custom (freeform) tool, which the template sees as a
//! function with one string parameter. There is no response store: a
//! `previous_response_id` and `store: true` are refused; clients send the history each
//! turn, and a reasoning item they echo back is dropped. `metadata` is echoed.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::FinishReason;
use serde_json::{json, Map, Value};

use crate::access::RequestLog;
use crate::api::field;
use crate::api::openai::{CachedTokens, ReasoningTokens};
use crate::api::responses::{
    custom_input, ErrorOut, Event, Incomplete, ItemOut, PartOut, Payload, ReasoningOut,
    ResponseOut, ResponsesRequest, Usage,
};
use crate::api::Timings;
use crate::error::{ApiError, Flavor, RouteError};
use crate::gen::{
    collect, core, now_unix, render_chat, start, unique_suffix, Collected, Generation, OutputMode,
    Step,
};
use crate::output::Piece;
use crate::params::GenParams;
use crate::sse::{self, Encoder};
use crate::worker::Finished;
use crate::AppState;

pub async fn responses(
    State(state): State<Arc<AppState>>,
    log: RequestLog,
    body: Bytes,
) -> Response {
    response(state, log, &body)
        .await
        .unwrap_or_else(|e| RouteError(e, Flavor::OpenAi).into_response())
}

async fn response(
    state: Arc<AppState>,
    log: RequestLog,
    body: &[u8],
) -> Result<Response, ApiError> {
    let req: ResponsesRequest = field::body(body)?;
    let metadata = req.metadata()?;
    let core = core(&state)?;
    req.refuse_stored()?;
    let conv = req.conversation()?;
    let p = req.params(&core.defaults, state.engine_info.n_vocab, &conv)?;
    let r = render_chat(&state, &conv, &p.thinking, &Map::new(), "input").await?;
    let (tokens, open) = (r.prompt, r.think_open);
    let mode = OutputMode::chat(open, conv.tools.as_ref());
    let gen = start(&state, "/v1/responses", &log, tokens, &p, mode, "input")?;
    let suffix = unique_suffix(gen.id);
    let mut env = Envelope::new(&state, &req, &p, &suffix, metadata);
    env.custom = req.custom_tools()?;
    if p.stream {
        return Ok(sse::stream(gen, ResponseStream::new(env, suffix)));
    }
    let c = collect(gen).await?;
    let f = c.finished()?;
    let status = status_of(f);
    let output = output_items(&c, &suffix, &env, status);
    Ok(Json(env.response(status, output, Some(f))).into_response())
}

/// A whole answer's items: the reasoning, the message (always, unless the answer is
/// only tool calls), the calls.
fn output_items(c: &Collected, suffix: &str, env: &Envelope, status: &'static str) -> Vec<ItemOut> {
    let mut output = Vec::new();
    if !c.reasoning.is_empty() {
        output.push(ItemOut::reasoning(
            &format!("rs_{suffix}"),
            &c.reasoning,
            env.with_summary,
        ));
    }
    if !c.content.is_empty() || c.calls.is_empty() {
        output.push(ItemOut::message(
            &format!("msg_{suffix}"),
            &c.content,
            status,
        ));
    }
    let n = c.calls.len();
    for (i, (name, args)) in c.calls.iter().enumerate() {
        let cut = c.cut && i + 1 == n;
        let (id, call_id) = (format!("fc_{suffix}{i}"), format!("call_{suffix}{i}"));
        output.push(if env.is_custom(name) {
            ItemOut::custom_call(&id, &call_id, name, &custom_input(args))
        } else {
            let status = if cut { "incomplete" } else { "completed" };
            ItemOut::call(&id, &call_id, name, args, status)
        });
    }
    output
}

/// The fixed part of a response object (everything but output, usage and status).
struct Envelope {
    id: String,
    created_at: u64,
    model: String,
    instructions: Value,
    max_output_tokens: usize,
    temperature: f64,
    top_p: f64,
    effort: Option<String>,
    summary: Option<String>,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    /// The request's `text` (its `format` is enforced while decoding), echoed.
    text: Value,
    /// The request's `metadata`, echoed.
    metadata: Value,
    /// A summary of the reasoning is asked for (the think block is given as one).
    with_summary: bool,
    /// The custom (freeform) tools' names: their calls are `custom_tool_call` items.
    custom: Vec<String>,
}

impl Envelope {
    fn new(
        state: &AppState,
        req: &ResponsesRequest,
        p: &GenParams,
        suffix: &str,
        metadata: Value,
    ) -> Envelope {
        let summary = req.summary();
        Envelope {
            id: format!("resp_{suffix}"),
            created_at: now_unix(),
            model: state.model_id.clone(),
            instructions: req.instructions.str().map_or(Value::Null, Value::from),
            max_output_tokens: p.max_tokens,
            temperature: decimal(p.sampling.temperature),
            top_p: decimal(p.sampling.top_p),
            effort: p.thinking.effort.clone(),
            with_summary: summary.as_deref().is_some_and(|s| s != "none"),
            summary,
            tools: req.tools.sent().unwrap_or_else(|| json!([])),
            tool_choice: req.tool_choice.sent().unwrap_or_else(|| json!("auto")),
            parallel_tool_calls: req.parallel_tool_calls.ok().copied().unwrap_or(true),
            text: req.text_echo(),
            metadata,
            custom: Vec::new(),
        }
    }

    fn is_custom(&self, name: &str) -> bool {
        self.custom.iter().any(|c| c == name)
    }

    fn response(
        &self,
        status: &'static str,
        output: Vec<ItemOut>,
        f: Option<&Finished>,
    ) -> ResponseOut<'_> {
        let incomplete = f.and_then(|f| match f.finish {
            FinishReason::Length | FinishReason::ContextFull => Some(Incomplete {
                reason: "max_output_tokens",
            }),
            _ => None,
        });
        ResponseOut {
            id: &self.id,
            object: "response",
            created_at: self.created_at,
            status,
            error: None,
            incomplete_details: incomplete,
            instructions: &self.instructions,
            max_output_tokens: self.max_output_tokens,
            model: &self.model,
            output,
            parallel_tool_calls: self.parallel_tool_calls,
            previous_response_id: None,
            reasoning: ReasoningOut {
                effort: self.effort.as_deref(),
                summary: self.summary.as_deref(),
            },
            store: false,
            temperature: self.temperature,
            text: &self.text,
            tool_choice: &self.tool_choice,
            tools: &self.tools,
            top_p: self.top_p,
            truncation: "disabled",
            metadata: &self.metadata,
            usage: f.map(|f| Usage {
                input_tokens: f.prompt_tokens,
                input_tokens_details: CachedTokens {
                    cached_tokens: f.timings.cache_n,
                },
                output_tokens: f.completion_tokens,
                output_tokens_details: ReasoningTokens {
                    reasoning_tokens: f.reasoning_tokens,
                },
                total_tokens: f.prompt_tokens + f.completion_tokens,
            }),
            timings: f.map(|f| Timings::of(&f.timings)),
        }
    }
}

/// A sampling value kept as `f32`, echoed as the decimal it was sent as: `0.6`, not
/// the `0.6000000238418579` a plain widening to `f64` would print.
pub fn decimal(x: f32) -> f64 {
    // The shortest decimal that reads back as `x`, read as an f64.
    x.to_string().parse().unwrap_or(x as f64)
}

fn status_of(f: &Finished) -> &'static str {
    match f.finish {
        FinishReason::Length | FinishReason::ContextFull => "incomplete",
        _ => "completed",
    }
}

/// The kind of the item being streamed.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    Reasoning,
    Message,
    Call,
    /// A custom tool's call: its input is given whole when the call ends.
    Custom,
}

/// The item being streamed: its kind, output index, id, and a call's name and id.
struct OpenItem {
    kind: Open,
    index: usize,
    id: String,
    name: String,
    call_id: String,
}

/// The response stream: `response.created`, `response.in_progress`, each item's
/// events, then `response.completed` (or `.incomplete`, `.failed`).
struct ResponseStream {
    seq: u64,
    env: Envelope,
    suffix: String,
    /// Finished items, in order.
    output: Vec<ItemOut>,
    open: Option<OpenItem>,
    /// Text of the open item.
    text: String,
    /// The status a message or call item closes with: `incomplete` when the response
    /// ends incomplete (the budget ran out inside it).
    item_status: &'static str,
}

/// An event's payload, built from the item it is about.
fn part(item: &OpenItem, content_index: usize, part: PartOut) -> Payload<'static> {
    Payload::ContentPart {
        item_id: item.id.clone(),
        output_index: item.index,
        content_index,
        part,
    }
}

fn summary_part(item: &OpenItem, part: PartOut) -> Payload<'static> {
    Payload::SummaryPart {
        item_id: item.id.clone(),
        output_index: item.index,
        summary_index: 0,
        part,
    }
}

impl ResponseStream {
    fn new(env: Envelope, suffix: String) -> ResponseStream {
        ResponseStream {
            seq: 0,
            env,
            suffix,
            output: Vec::new(),
            open: None,
            text: String::new(),
            item_status: "completed",
        }
    }

    fn emit(&mut self, kind: &str, payload: Payload<'_>, out: &mut Vec<Bytes>) {
        let e = Event {
            payload,
            kind,
            sequence_number: self.seq,
        };
        self.seq += 1;
        out.push(sse::event(kind, &e));
    }

    /// The response object in `status`, with the items finished so far.
    fn whole(
        &mut self,
        kind: &str,
        status: &'static str,
        f: Option<&Finished>,
        failure: Option<String>,
        out: &mut Vec<Bytes>,
    ) {
        let mut response = self.env.response(status, self.output.clone(), f);
        response.error = failure.map(|message| ErrorOut {
            code: "server_error",
            message,
        });
        let e = Event {
            payload: Payload::Response {
                response: Box::new(response),
            },
            kind,
            sequence_number: self.seq,
        };
        out.push(sse::event(kind, &e));
        self.seq += 1;
    }

    fn is_open(&self, kind: Open) -> bool {
        self.open.as_ref().is_some_and(|o| o.kind == kind)
    }

    fn open_item(&mut self, kind: Open, name: &str, out: &mut Vec<Bytes>) {
        self.close_item(out);
        let index = self.output.len();
        let s = &self.suffix;
        let (id, call_id) = match kind {
            Open::Reasoning => (format!("rs_{s}{index}"), String::new()),
            Open::Message => (format!("msg_{s}{index}"), String::new()),
            Open::Call | Open::Custom => (format!("fc_{s}{index}"), format!("call_{s}{index}")),
        };
        let item = match kind {
            Open::Reasoning => ItemOut::Reasoning {
                id: id.clone(),
                summary: Vec::new(),
                content: Vec::new(),
            },
            Open::Message => ItemOut::Message {
                id: id.clone(),
                status: "in_progress",
                role: "assistant",
                content: Vec::new(),
            },
            Open::Call => ItemOut::call(&id, &call_id, name, "", "in_progress"),
            Open::Custom => ItemOut::custom_call(&id, &call_id, name, ""),
        };
        self.emit(
            "response.output_item.added",
            Payload::Item {
                output_index: index,
                item,
            },
            out,
        );
        let open = OpenItem {
            kind,
            index,
            id,
            name: name.to_string(),
            call_id,
        };
        match kind {
            Open::Reasoning => {
                let text = PartOut::ReasoningText {
                    text: String::new(),
                };
                self.emit("response.content_part.added", part(&open, 0, text), out);
                if self.env.with_summary {
                    let text = PartOut::SummaryText {
                        text: String::new(),
                    };
                    self.emit(
                        "response.reasoning_summary_part.added",
                        summary_part(&open, text),
                        out,
                    );
                }
            }
            Open::Message => {
                self.emit(
                    "response.content_part.added",
                    part(&open, 0, PartOut::output_text("")),
                    out,
                );
            }
            Open::Call | Open::Custom => {}
        }
        self.open = Some(open);
        self.text.clear();
    }

    fn delta(&mut self, t: &str, out: &mut Vec<Bytes>) {
        let Some(o) = &self.open else {
            return;
        };
        let (item_id, output_index, kind) = (o.id.clone(), o.index, o.kind);
        self.text.push_str(t);
        let delta = t.to_string();
        match kind {
            Open::Reasoning => {
                self.emit(
                    "response.reasoning_text.delta",
                    Payload::ContentDelta {
                        item_id: item_id.clone(),
                        output_index,
                        content_index: 0,
                        delta: delta.clone(),
                    },
                    out,
                );
                if self.env.with_summary {
                    self.emit(
                        "response.reasoning_summary_text.delta",
                        Payload::SummaryDelta {
                            item_id,
                            output_index,
                            summary_index: 0,
                            delta,
                        },
                        out,
                    );
                }
            }
            Open::Message => self.emit(
                "response.output_text.delta",
                Payload::TextDelta {
                    item_id,
                    output_index,
                    content_index: 0,
                    delta,
                    logprobs: Vec::new(),
                },
                out,
            ),
            // Held: the input is the `input` string inside the arguments.
            Open::Custom => {}
            Open::Call => self.emit(
                "response.function_call_arguments.delta",
                Payload::ArgumentsDelta {
                    item_id,
                    output_index,
                    delta,
                },
                out,
            ),
        }
    }

    fn close_item(&mut self, out: &mut Vec<Bytes>) {
        let Some(o) = self.open.take() else {
            return;
        };
        let text = std::mem::take(&mut self.text);
        let (item_id, output_index) = (o.id.clone(), o.index);
        let item = match o.kind {
            Open::Reasoning => {
                self.emit(
                    "response.reasoning_text.done",
                    Payload::ContentDone {
                        item_id: item_id.clone(),
                        output_index,
                        content_index: 0,
                        text: text.clone(),
                    },
                    out,
                );
                let done = PartOut::ReasoningText { text: text.clone() };
                self.emit("response.content_part.done", part(&o, 0, done), out);
                if self.env.with_summary {
                    self.emit(
                        "response.reasoning_summary_text.done",
                        Payload::SummaryDone {
                            item_id,
                            output_index,
                            summary_index: 0,
                            text: text.clone(),
                        },
                        out,
                    );
                    let done = PartOut::SummaryText { text: text.clone() };
                    self.emit(
                        "response.reasoning_summary_part.done",
                        summary_part(&o, done),
                        out,
                    );
                }
                ItemOut::reasoning(&o.id, &text, self.env.with_summary)
            }
            Open::Message => {
                self.emit(
                    "response.output_text.done",
                    Payload::TextDone {
                        item_id,
                        output_index,
                        content_index: 0,
                        text: text.clone(),
                        logprobs: Vec::new(),
                    },
                    out,
                );
                self.emit(
                    "response.content_part.done",
                    part(&o, 0, PartOut::output_text(&text)),
                    out,
                );
                ItemOut::message(&o.id, &text, self.item_status)
            }
            Open::Call => {
                self.emit(
                    "response.function_call_arguments.done",
                    Payload::ArgumentsDone {
                        item_id,
                        output_index,
                        name: o.name.clone(),
                        arguments: text.clone(),
                    },
                    out,
                );
                ItemOut::call(&o.id, &o.call_id, &o.name, &text, self.item_status)
            }
            Open::Custom => {
                let input = custom_input(&text);
                if !input.is_empty() {
                    self.emit(
                        "response.custom_tool_call_input.delta",
                        Payload::ArgumentsDelta {
                            item_id: item_id.clone(),
                            output_index,
                            delta: input.clone(),
                        },
                        out,
                    );
                }
                self.emit(
                    "response.custom_tool_call_input.done",
                    Payload::InputDone {
                        item_id,
                        output_index,
                        input: input.clone(),
                    },
                    out,
                );
                ItemOut::custom_call(&o.id, &o.call_id, &o.name, &input)
            }
        };
        self.emit(
            "response.output_item.done",
            Payload::Item {
                output_index,
                item: item.clone(),
            },
            out,
        );
        self.output.push(item);
    }
}

impl Encoder for ResponseStream {
    fn open(&mut self, out: &mut Vec<Bytes>) {
        self.whole("response.created", "in_progress", None, None, out);
        self.whole("response.in_progress", "in_progress", None, None, out);
    }

    fn step(&mut self, step: Step, _gen: &mut Generation, out: &mut Vec<Bytes>) {
        match step {
            Step::Piece(Piece::Reasoning(t)) => {
                if !self.is_open(Open::Reasoning) {
                    self.open_item(Open::Reasoning, "", out);
                }
                self.delta(&t, out);
            }
            Step::Piece(Piece::Content(t)) => {
                if !self.is_open(Open::Message) {
                    self.open_item(Open::Message, "", out);
                }
                self.delta(&t, out);
            }
            Step::Piece(Piece::ToolStart { name, .. }) => {
                let kind = if self.env.is_custom(&name) {
                    Open::Custom
                } else {
                    Open::Call
                };
                self.open_item(kind, &name, out)
            }
            Step::Piece(Piece::ToolArgs { delta, .. }) => self.delta(&delta, out),
            Step::Piece(Piece::ToolEnd { .. }) => self.close_item(out),
            // The budget ran out inside the call: the response ends incomplete.
            Step::Piece(Piece::ToolCut { .. }) => {
                self.item_status = "incomplete";
                self.close_item(out);
            }
            Step::Done(f) => {
                // A response always has a message or a call.
                let has_answer = self.output.iter().any(|i| !i.is_reasoning())
                    || self
                        .open
                        .as_ref()
                        .is_some_and(|o| o.kind != Open::Reasoning);
                let status = status_of(&f);
                if !has_answer {
                    self.open_item(Open::Message, "", out);
                }
                if status == "incomplete" {
                    self.item_status = "incomplete";
                }
                self.close_item(out);
                let kind = if status == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                self.whole(kind, status, Some(&f), None, out);
            }
            // Keep-alive: Codex's idle timeout (300 s) counts events, not bytes, and
            // its SSE parser drops comments; `response.in_progress` again is a no-op.
            Step::Idle => self.whole("response.in_progress", "in_progress", None, None, out),
            Step::Failed(e) => {
                let message = format!("generation failed: {e}");
                self.whole("response.failed", "failed", None, Some(message), out);
            }
        }
    }
}
