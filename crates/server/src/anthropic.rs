//! Anthropic routes: `/v1/messages` and `/v1/messages/count_tokens`.
//!
//! The stream is the Messages API's event sequence: `message_start`, then for each
//! content block `content_block_start`, its deltas (`thinking_delta`, `text_delta`,
//! `input_json_delta`) and `content_block_stop`, then `message_delta` (stop reason,
//! output tokens, `timings`) and `message_stop`.

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
    collect, core, event_frame, json_body, render_chat, sse_response, start, timings_json,
    unique_suffix, OutputMode, Step,
};
use crate::output::Piece;
use crate::params::{self, GenParams};
use crate::prompt;
use crate::worker::Finished;
use crate::AppState;

fn an(e: ApiError) -> RouteError {
    RouteError(e, Flavor::Anthropic)
}

/// Anthropic `stop_reason`.
pub fn stop_reason(f: &Finished, had_calls: bool) -> &'static str {
    match f.finish {
        FinishReason::Length | FinishReason::ContextFull => "max_tokens",
        _ if f.stop_hit.is_some() => "stop_sequence",
        _ if had_calls => "tool_use",
        _ => "end_turn",
    }
}

fn usage(f: &Finished) -> Value {
    json!({
        "input_tokens": f.prompt_tokens,
        "output_tokens": f.completion_tokens,
        "cache_read_input_tokens": f.timings.cache_n,
        "cache_creation_input_tokens": 0,
    })
}

fn tool_id(gen_id: u64, index: usize) -> String {
    format!("toolu_{}{}", unique_suffix(gen_id), index)
}

/// Tool input as an object (what a tool_use block carries).
fn input_object(args: &str) -> Value {
    match serde_json::from_str::<Value>(args) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

fn parse(
    state: &AppState,
    body: &Map<String, Value>,
) -> Result<(prompt::Conversation, GenParams), ApiError> {
    let core = core(state)?;
    let conv = prompt::anthropic(body)?;
    let thinking = params::parse_thinking(body, &core.defaults)?;
    params::refuse_unsupported(body)?;
    params::parse_logprobs(body, params::LogprobsForm::Refused)?;
    let sampling = params::parse_sampling(body, &core.defaults, state.engine_info.n_vocab, 1.0)?;
    let max_tokens = params::parse_max_tokens(body, &["max_tokens"], core.defaults.max_tokens)?;
    let stop = params::parse_stop(body, "stop_sequences")?;
    let stream = params::opt_bool(body, "stream")?.unwrap_or(false);
    let constraint = crate::structured::anthropic(body, conv.tools.as_ref())?;
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
    ))
}

pub async fn messages(
    State(state): State<Arc<AppState>>,
    log: RequestLog,
    body: Bytes,
) -> Response {
    match messages_inner(state, log, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn messages_inner(
    state: Arc<AppState>,
    log: RequestLog,
    body: &[u8],
) -> Result<Response, RouteError> {
    let body = json_body(body).map_err(an)?;
    let (conv, p) = parse(&state, &body).map_err(an)?;
    let (tokens, think_open) = render_chat(&state, &conv, &p.thinking, &Map::new(), "messages")
        .await
        .map_err(an)?;
    let prompt_tokens = tokens.len();
    let gen = start(
        &state,
        "/v1/messages",
        &log,
        tokens,
        &p,
        OutputMode {
            structured: true,
            think_open,
            tools: conv.tools.as_ref(),
        },
        "messages",
    )
    .map_err(an)?;
    let mut gen = gen;
    if conv.continue_final {
        gen.continue_message();
    }
    let id = format!("msg_{}", unique_suffix(gen.id));
    let model = state.model_id.clone();
    if !p.stream {
        let gen_id = gen.id;
        let c = collect(gen).await.map_err(an)?;
        let f = c
            .finished
            .ok_or_else(|| an(ApiError::internal("generation ended without a result")))?;
        let mut content = Vec::new();
        if !c.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": c.reasoning, "signature": ""}));
        }
        if !c.content.is_empty() {
            content.push(json!({"type": "text", "text": c.content}));
        }
        for (i, (name, args)) in c.calls.iter().enumerate() {
            content.push(
                json!({"type": "tool_use", "id": tool_id(gen_id, i), "name": name,
                                "input": input_object(args)}),
            );
        }
        if content.is_empty() {
            content.push(json!({"type": "text", "text": ""}));
        }
        return Ok(Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason(&f, !c.calls.is_empty()),
            "stop_sequence": f.stop_hit,
            "usage": usage(&f),
            "timings": timings_json(&f.timings),
        }))
        .into_response());
    }
    Ok(sse_response(move |sink| async move {
        let mut gen = gen;
        let start_msg = json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }});
        if sink
            .send(event_frame("message_start", &start_msg))
            .await
            .is_err()
        {
            return;
        }
        if sink
            .send(event_frame("ping", &json!({"type": "ping"})))
            .await
            .is_err()
        {
            return;
        }
        // The open block: its index and kind ("thinking", "text", "tool_use").
        let mut open: Option<(usize, &'static str)> = None;
        let mut next_index = 0usize;
        let mut had_calls = false;
        let mut frames: Vec<(String, Value)> = Vec::new();
        let close = |open: &mut Option<(usize, &'static str)>,
                     frames: &mut Vec<(String, Value)>| {
            if let Some((i, _)) = open.take() {
                frames.push((
                    "content_block_stop".into(),
                    json!({"type": "content_block_stop", "index": i}),
                ));
            }
        };
        while let Some(step) = gen.next().await {
            frames.clear();
            let mut ensure = |kind: &'static str,
                              block: Value,
                              open: &mut Option<(usize, &'static str)>,
                              frames: &mut Vec<(String, Value)>|
             -> usize {
                if let Some((i, k)) = open {
                    if *k == kind && kind != "tool_use" {
                        return *i;
                    }
                }
                close(open, frames);
                let i = next_index;
                next_index += 1;
                frames.push((
                    "content_block_start".into(),
                    json!({"type": "content_block_start", "index": i, "content_block": block}),
                ));
                *open = Some((i, kind));
                i
            };
            match step {
                Step::Piece(Piece::Reasoning(t)) => {
                    let i = ensure(
                        "thinking",
                        json!({"type": "thinking", "thinking": "", "signature": ""}),
                        &mut open,
                        &mut frames,
                    );
                    frames.push((
                        "content_block_delta".into(),
                        json!({"type": "content_block_delta", "index": i,
                        "delta": {"type": "thinking_delta", "thinking": t}}),
                    ));
                }
                Step::Piece(Piece::Content(t)) => {
                    let i = ensure(
                        "text",
                        json!({"type": "text", "text": ""}),
                        &mut open,
                        &mut frames,
                    );
                    frames.push((
                        "content_block_delta".into(),
                        json!({"type": "content_block_delta", "index": i,
                        "delta": {"type": "text_delta", "text": t}}),
                    ));
                }
                Step::Piece(Piece::ToolStart { index, name }) => {
                    had_calls = true;
                    ensure(
                        "tool_use",
                        json!({"type": "tool_use", "id": tool_id(gen.id, index), "name": name, "input": {}}),
                        &mut open,
                        &mut frames,
                    );
                }
                Step::Piece(Piece::ToolArgs { delta, .. }) => {
                    if let Some((i, "tool_use")) = open {
                        frames.push((
                            "content_block_delta".into(),
                            json!({"type": "content_block_delta", "index": i,
                            "delta": {"type": "input_json_delta", "partial_json": delta}}),
                        ));
                    }
                }
                Step::Piece(Piece::ToolEnd { .. }) => close(&mut open, &mut frames),
                // Keep-alive. Claude Code's idle watchdog (300 s, then it retries without
                // streaming while the first request runs on) counts the events its SDK
                // yields, and the SDK drops `ping`; a `message_delta` would be counted
                // again in its usage totals. An empty delta in the block the answer
                // starts with (thinking when the prompt left the model thinking) is what
                // it counts and changes nothing.
                Step::Idle => {
                    let kind = match open {
                        Some((_, k)) => k,
                        None if think_open => "thinking",
                        None => "text",
                    };
                    let (block, delta) = match kind {
                        "thinking" => (
                            json!({"type": "thinking", "thinking": "", "signature": ""}),
                            json!({"type": "thinking_delta", "thinking": ""}),
                        ),
                        "tool_use" => (
                            Value::Null,
                            json!({"type": "input_json_delta", "partial_json": ""}),
                        ),
                        _ => (
                            json!({"type": "text", "text": ""}),
                            json!({"type": "text_delta", "text": ""}),
                        ),
                    };
                    let i = match open {
                        Some((i, _)) => i,
                        None => ensure(kind, block, &mut open, &mut frames),
                    };
                    frames.push((
                        "content_block_delta".into(),
                        json!({"type": "content_block_delta", "index": i, "delta": delta}),
                    ));
                }
                Step::Done(f) => {
                    close(&mut open, &mut frames);
                    frames.push(("message_delta".into(), json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason(&f, had_calls), "stop_sequence": f.stop_hit},
                        "usage": {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens},
                        "timings": timings_json(&f.timings),
                    })));
                    frames.push(("message_stop".into(), json!({"type": "message_stop"})));
                }
                Step::Failed(e) => {
                    let err = ApiError::internal(format!("generation failed: {e}"));
                    let _ = sink
                        .send(Bytes::from(err.sse_frame(Flavor::Anthropic)))
                        .await;
                    return;
                }
            }
            for (name, v) in &frames {
                if sink.send(event_frame(name, v)).await.is_err() {
                    return;
                }
            }
        }
    }))
}

pub async fn count_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let r = async {
        let body = json_body(&body)?;
        let core = core(&state)?;
        let conv = prompt::anthropic(&body)?;
        let thinking = params::parse_thinking(&body, &core.defaults)?;
        let (tokens, _) = render_chat(&state, &conv, &thinking, &Map::new(), "messages").await?;
        Ok::<Value, ApiError>(json!({"input_tokens": tokens.len()}))
    }
    .await;
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response_as(Flavor::Anthropic),
    }
}
