//! OpenAI Responses API: `POST /v1/responses`.
//!
//! Output items in order: a `reasoning` item (the think block as a `reasoning_text`
//! content part, and again as `summary_text` when the request asks for a summary —
//! there is no separate summarizer), a `message` item with the answer, and one
//! `function_call` item per tool call. There is no response store: a
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
use crate::error::{ApiError, Flavor, RouteError};
use crate::gen::{
    collect, core, event_frame, json_body, now_unix, render_chat, sse_response, start,
    timings_json, unique_suffix, OutputMode, Sink, Step,
};
use crate::output::Piece;
use crate::params::{self, GenParams};
use crate::prompt;
use crate::worker::Finished;
use crate::AppState;

fn oa(e: ApiError) -> RouteError {
    RouteError(e, Flavor::OpenAi)
}

fn usage(f: &Finished) -> Value {
    json!({
        "input_tokens": f.prompt_tokens,
        "input_tokens_details": {"cached_tokens": f.timings.cache_n},
        "output_tokens": f.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": f.reasoning_tokens},
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

/// The fixed part of a response object (everything but output/usage/status).
struct Envelope {
    id: String,
    created_at: u64,
    model: String,
    instructions: Value,
    max_output_tokens: Value,
    temperature: f32,
    top_p: f32,
    effort: Option<String>,
    summary: Option<String>,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    /// The request's `text` (its `format` is enforced while decoding), echoed.
    text: Value,
    /// The request's `metadata`, echoed.
    metadata: Value,
}

impl Envelope {
    fn response(&self, status: &str, output: Vec<Value>, f: Option<&Finished>) -> Value {
        let incomplete = f.and_then(|f| match f.finish {
            FinishReason::Length | FinishReason::ContextFull => {
                Some(json!({"reason": "max_output_tokens"}))
            }
            _ => None,
        });
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": null,
            "reasoning": {"effort": self.effort, "summary": self.summary},
            "store": false,
            "temperature": self.temperature,
            "text": self.text,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "metadata": self.metadata,
            "usage": null,
        });
        if let Some(f) = f {
            r["usage"] = usage(f);
            r["timings"] = timings_json(&f.timings);
        }
        r
    }
}

fn status_of(f: &Finished) -> &'static str {
    match f.finish {
        FinishReason::Length | FinishReason::ContextFull => "incomplete",
        _ => "completed",
    }
}

/// `store` and `metadata`: nothing is stored, so `store: true` is refused rather than
/// answered with `store: false`; `metadata` (at most 16 string values, keys up to 64
/// characters, values up to 512, as OpenAI checks it) is echoed on the response.
fn store_and_metadata(body: &Map<String, Value>) -> Result<Value, ApiError> {
    if params::opt_bool(body, "store")? == Some(true) {
        return Err(ApiError::field(
            "store",
            "store: responses are not stored on this server; send store: false (or omit it) and send the conversation in input each turn",
        ));
    }
    let Some(m) = params::opt_obj(body, "metadata")? else {
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

fn reasoning_item(id: &str, text: &str, with_summary: bool) -> Value {
    let summary = if with_summary {
        json!([{"type": "summary_text", "text": text}])
    } else {
        json!([])
    };
    json!({"type": "reasoning", "id": id, "summary": summary,
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(id: &str, call_id: &str, name: &str, args: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
           "arguments": args, "status": status})
}

fn parse(
    state: &AppState,
    body: &Map<String, Value>,
) -> Result<(prompt::Conversation, GenParams, Option<String>), ApiError> {
    let core = core(state)?;
    if body
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(ApiError::field(
            "previous_response_id",
            "previous_response_id: responses are not stored; send the conversation in input",
        ));
    }
    if body.get("background").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::field(
            "background",
            "background: background responses are not supported",
        ));
    }
    let conv = prompt::responses(body)?;
    let thinking = params::parse_thinking(body, &core.defaults)?;
    let summary = body
        .get("reasoning")
        .and_then(|r| r.get("summary"))
        .and_then(Value::as_str)
        .map(str::to_string);
    params::refuse_unsupported(body)?;
    params::parse_logprobs(body, params::LogprobsForm::Refused)?;
    let sampling = params::parse_sampling(body, &core.defaults, state.engine_info.n_vocab, 2.0)?;
    let max_tokens = params::parse_max_tokens(
        body,
        &["max_output_tokens", "max_tokens", "max_completion_tokens"],
        core.defaults.max_tokens,
    )?;
    let stop = params::parse_stop(body, "stop")?;
    let stream = params::opt_bool(body, "stream")?.unwrap_or(false);
    let constraint = crate::structured::responses(body, conv.tools.as_ref())?;
    Ok((
        conv,
        GenParams {
            sampling,
            max_tokens,
            stop,
            thinking,
            stream,
            include_usage: false,
            constraint,
            logprobs: None,
        },
        summary,
    ))
}

pub async fn responses(
    State(state): State<Arc<AppState>>,
    log: RequestLog,
    body: Bytes,
) -> Response {
    match inner(state, log, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, RouteError> {
    let body = json_body(body).map_err(oa)?;
    let metadata = store_and_metadata(&body).map_err(oa)?;
    let (conv, p, summary) = parse(&state, &body).map_err(oa)?;
    let (tokens, open) = render_chat(&state, &conv, &p.thinking, &Map::new(), "input")
        .await
        .map_err(oa)?;
    let gen = start(
        &state,
        "/v1/responses",
        &log,
        tokens,
        &p,
        OutputMode {
            structured: true,
            think_open: open,
            tools: conv.tools.as_ref(),
        },
        "input",
    )
    .map_err(oa)?;
    let suffix = unique_suffix(gen.id);
    let env = Envelope {
        id: format!("resp_{suffix}"),
        created_at: now_unix(),
        model: state.model_id.clone(),
        instructions: body.get("instructions").cloned().unwrap_or(Value::Null),
        max_output_tokens: json!(p.max_tokens),
        temperature: p.sampling.temperature,
        top_p: p.sampling.top_p,
        effort: p.thinking.effort.clone(),
        summary: summary.clone(),
        tools: body.get("tools").cloned().unwrap_or(json!([])),
        tool_choice: body.get("tool_choice").cloned().unwrap_or(json!("auto")),
        parallel_tool_calls: body
            .get("parallel_tool_calls")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        text: body
            .get("text")
            .filter(|t| t.get("format").is_some_and(|f| !f.is_null()))
            .cloned()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
        metadata,
    };
    let with_summary = summary.is_some_and(|s| s != "none");
    if !p.stream {
        let c = collect(gen).await.map_err(oa)?;
        let f = c
            .finished
            .ok_or_else(|| oa(ApiError::internal("generation ended without a result")))?;
        let status = status_of(&f);
        let mut output = Vec::new();
        if !c.reasoning.is_empty() {
            output.push(reasoning_item(
                &format!("rs_{suffix}"),
                &c.reasoning,
                with_summary,
            ));
        }
        if !c.content.is_empty() || c.calls.is_empty() {
            output.push(message_item(&format!("msg_{suffix}"), &c.content, status));
        }
        for (i, (name, args)) in c.calls.iter().enumerate() {
            output.push(call_item(
                &format!("fc_{suffix}{i}"),
                &format!("call_{suffix}{i}"),
                name,
                args,
                "completed",
            ));
        }
        return Ok(Json(env.response(status, output, Some(&f))).into_response());
    }
    Ok(sse_response(move |sink| async move {
        let mut s = Streamer {
            sink,
            seq: 0,
            env,
            suffix,
            with_summary,
            output: Vec::new(),
            open: None,
            text: String::new(),
            item_status: "completed",
        };
        let _ = s.run(gen).await;
    }))
}

/// The item being streamed.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    Reasoning,
    Message,
    Call,
}

struct Streamer {
    sink: Sink,
    seq: u64,
    env: Envelope,
    suffix: String,
    with_summary: bool,
    /// Finished items, in order.
    output: Vec<Value>,
    open: Option<(Open, usize, String, String, String)>, // kind, output_index, item id, name, call_id
    /// Text of the open item.
    text: String,
    /// The status a message or call item closes with: `incomplete` when the response
    /// ends incomplete (the budget ran out inside it).
    item_status: &'static str,
}

impl Streamer {
    async fn emit(&mut self, kind: &str, mut v: Value) -> Result<(), ()> {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        self.sink.send(event_frame(kind, &v)).await
    }

    async fn open_item(&mut self, kind: Open, name: &str) -> Result<(), ()> {
        self.close_item().await?;
        let idx = self.output.len();
        let s = &self.suffix;
        let (id, call_id) = match kind {
            Open::Reasoning => (format!("rs_{s}{idx}"), String::new()),
            Open::Message => (format!("msg_{s}{idx}"), String::new()),
            Open::Call => (format!("fc_{s}{idx}"), format!("call_{s}{idx}")),
        };
        let item = match kind {
            Open::Reasoning => json!({"type": "reasoning", "id": id, "summary": [], "content": []}),
            Open::Message => json!({"type": "message", "id": id, "status": "in_progress",
                                    "role": "assistant", "content": []}),
            Open::Call => call_item(&id, &call_id, name, "", "in_progress"),
        };
        self.emit(
            "response.output_item.added",
            json!({"output_index": idx, "item": item}),
        )
        .await?;
        match kind {
            Open::Reasoning => {
                self.emit(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": idx,
                    "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
                )
                .await?;
                if self.with_summary {
                    self.emit(
                        "response.reasoning_summary_part.added",
                        json!({"item_id": id,
                        "output_index": idx, "summary_index": 0,
                        "part": {"type": "summary_text", "text": ""}}),
                    )
                    .await?;
                }
            }
            Open::Message => {
                self.emit("response.content_part.added", json!({"item_id": id, "output_index": idx,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
                    .await?;
            }
            Open::Call => {}
        }
        self.open = Some((kind, idx, id, name.to_string(), call_id));
        self.text.clear();
        Ok(())
    }

    async fn delta(&mut self, t: &str) -> Result<(), ()> {
        let Some((kind, idx, id, _, _)) = self.open.clone() else {
            return Ok(());
        };
        self.text.push_str(t);
        match kind {
            Open::Reasoning => {
                self.emit(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": idx,
                    "content_index": 0, "delta": t}),
                )
                .await?;
                if self.with_summary {
                    self.emit(
                        "response.reasoning_summary_text.delta",
                        json!({"item_id": id,
                        "output_index": idx, "summary_index": 0, "delta": t}),
                    )
                    .await?;
                }
            }
            Open::Message => {
                self.emit(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": idx,
                    "content_index": 0, "delta": t, "logprobs": []}),
                )
                .await?;
            }
            Open::Call => {
                self.emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id,
                    "output_index": idx, "delta": t}),
                )
                .await?;
            }
        }
        Ok(())
    }

    async fn close_item(&mut self) -> Result<(), ()> {
        let Some((kind, idx, id, name, call_id)) = self.open.take() else {
            return Ok(());
        };
        let text = std::mem::take(&mut self.text);
        let item = match kind {
            Open::Reasoning => {
                self.emit(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": idx,
                    "content_index": 0, "text": text}),
                )
                .await?;
                self.emit(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": idx,
                    "content_index": 0, "part": {"type": "reasoning_text", "text": text}}),
                )
                .await?;
                if self.with_summary {
                    self.emit(
                        "response.reasoning_summary_text.done",
                        json!({"item_id": id,
                        "output_index": idx, "summary_index": 0, "text": text}),
                    )
                    .await?;
                    self.emit(
                        "response.reasoning_summary_part.done",
                        json!({"item_id": id,
                        "output_index": idx, "summary_index": 0,
                        "part": {"type": "summary_text", "text": text}}),
                    )
                    .await?;
                }
                reasoning_item(&id, &text, self.with_summary)
            }
            Open::Message => {
                self.emit(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": idx,
                    "content_index": 0, "text": text, "logprobs": []}),
                )
                .await?;
                self.emit("response.content_part.done", json!({"item_id": id, "output_index": idx,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}))
                    .await?;
                message_item(&id, &text, self.item_status)
            }
            Open::Call => {
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": id,
                    "output_index": idx, "name": name, "arguments": text}),
                )
                .await?;
                call_item(&id, &call_id, &name, &text, self.item_status)
            }
        };
        self.emit(
            "response.output_item.done",
            json!({"output_index": idx, "item": item}),
        )
        .await?;
        self.output.push(item);
        Ok(())
    }

    fn is_open(&self, kind: Open) -> bool {
        matches!(&self.open, Some((k, ..)) if *k == kind)
    }

    async fn run(&mut self, mut gen: crate::gen::Generation) -> Result<(), ()> {
        let r = self.env.response("in_progress", vec![], None);
        self.emit("response.created", json!({"response": r}))
            .await?;
        let r = self.env.response("in_progress", vec![], None);
        self.emit("response.in_progress", json!({"response": r}))
            .await?;
        while let Some(step) = gen.next().await {
            match step {
                Step::Piece(Piece::Reasoning(t)) => {
                    if !self.is_open(Open::Reasoning) {
                        self.open_item(Open::Reasoning, "").await?;
                    }
                    self.delta(&t).await?;
                }
                Step::Piece(Piece::Content(t)) => {
                    if !self.is_open(Open::Message) {
                        self.open_item(Open::Message, "").await?;
                    }
                    self.delta(&t).await?;
                }
                Step::Piece(Piece::ToolStart { name, .. }) => {
                    self.open_item(Open::Call, &name).await?;
                }
                Step::Piece(Piece::ToolArgs { delta, .. }) => self.delta(&delta).await?,
                Step::Piece(Piece::ToolEnd { .. }) => self.close_item().await?,
                Step::Done(f) => {
                    // A response always has a message or a call.
                    let has_answer = self.output.iter().any(|i| i["type"] != "reasoning")
                        || self.open.as_ref().is_some_and(|o| o.0 != Open::Reasoning);
                    let status = status_of(&f);
                    if !has_answer {
                        self.open_item(Open::Message, "").await?;
                    }
                    if status == "incomplete" {
                        self.item_status = "incomplete";
                    }
                    self.close_item().await?;
                    let r = self.env.response(status, self.output.clone(), Some(&f));
                    let kind = if status == "completed" {
                        "response.completed"
                    } else {
                        "response.incomplete"
                    };
                    self.emit(kind, json!({"response": r})).await?;
                }
                // Keep-alive: Codex's idle timeout (300 s) counts events, not bytes, and
                // its SSE parser drops comments; `response.in_progress` again is a no-op.
                Step::Idle => {
                    let r = self.env.response("in_progress", self.output.clone(), None);
                    self.emit("response.in_progress", json!({"response": r}))
                        .await?;
                }
                Step::Failed(e) => {
                    let mut r = self.env.response("failed", self.output.clone(), None);
                    r["error"] = json!({"code": "server_error", "message": format!("generation failed: {e}")});
                    self.emit("response.failed", json!({"response": r})).await?;
                }
            }
        }
        Ok(())
    }
}
