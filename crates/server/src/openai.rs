//! OpenAI routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.
//!
//! Streams are framed as the official SDKs parse them: `data: {chunk}\n\n` frames, a
//! first delta carrying the role, reasoning in `reasoning_content` deltas, tool calls
//! as `tool_calls` deltas (id, type and name first, then argument pieces), a last
//! chunk with `finish_reason` (and `timings`), a usage chunk with empty `choices` when
//! `stream_options.include_usage` is set, and `data: [DONE]`.

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
    collect, core, data_frame, json_body, now_unix, openai_usage, render_chat, sse_response, start,
    timings_json, unique_suffix, Generation, OutputMode, Step, SSE_COMMENT,
};
use crate::output::Piece;
use crate::params::{self, GenParams, LogprobsForm, Thinking};
use crate::prompt;
use crate::worker::Finished;
use crate::AppState;

type Result<T> = std::result::Result<T, RouteError>;

fn oa(e: ApiError) -> RouteError {
    RouteError(e, Flavor::OpenAi)
}

/// OpenAI `finish_reason`.
pub fn finish_reason(f: &Finished, had_calls: bool) -> &'static str {
    if had_calls && f.finish != FinishReason::Length && f.finish != FinishReason::ContextFull {
        return "tool_calls";
    }
    match f.finish {
        FinishReason::Length | FinishReason::ContextFull => "length",
        _ => "stop",
    }
}

/// The sampling / budget / stop fields every OpenAI generation route reads.
fn gen_params(
    state: &AppState,
    body: &Map<String, Value>,
    budget_names: &[&str],
    thinking: Thinking,
    logprobs: LogprobsForm,
) -> std::result::Result<GenParams, ApiError> {
    let core = core(state)?;
    params::refuse_unsupported(body)?;
    let logprobs = params::parse_logprobs(body, logprobs)?;
    let sampling = params::parse_sampling(body, &core.defaults, state.engine_info.n_vocab, 2.0)?;
    let max_tokens = params::parse_max_tokens(body, budget_names, core.defaults.max_tokens)?;
    let stop = params::parse_stop(body, "stop")?;
    let (stream, include_usage) = params::parse_stream(body)?;
    Ok(GenParams {
        sampling,
        max_tokens,
        stop,
        thinking,
        stream,
        include_usage,
        constraint: None,
        logprobs,
    })
}

/// A token's text and bytes, as the logprobs objects give them (a token that
/// ends inside a UTF-8 character shows U+FFFD in `token`; `bytes` are exact).
fn token_text(state: &AppState, id: u32) -> (String, Vec<u8>) {
    let bytes = state.tokenizer.token_to_piece(id);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal":
/// null}`, one entry per generated token (the thinking block's and tool calls'
/// included, the end-of-generation token not).
fn chat_logprobs(state: &AppState, lps: &[(u32, engine::TokenLogprobs)]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_text(state, id);
        json!({"token": token, "logprob": logprob, "bytes": bytes})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|&(id, lp)| {
            let mut e = entry(id, lp.logprob);
            e["top_logprobs"] = lp.top().iter().map(|&(t, l)| entry(t, l)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' `logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (a
/// token → log-probability map per token; null when no alternatives were asked)
/// and `text_offset` (each token's character offset in the generated text, the
/// tokens before these counting `offset` characters; advanced past these).
fn completion_logprobs(
    state: &AppState,
    lps: &[(u32, engine::TokenLogprobs)],
    n: usize,
    offset: &mut usize,
) -> Value {
    let (mut tokens, mut logprobs, mut tops, mut offsets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for &(id, lp) in lps {
        let (token, _) = token_text(state, id);
        offsets.push(*offset);
        *offset += token.chars().count();
        tokens.push(token);
        logprobs.push(lp.logprob);
        let top: Map<String, Value> = lp
            .top()
            .iter()
            .map(|&(t, l)| (token_text(state, t).0, json!(l)))
            .collect();
        tops.push(Value::Object(top));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": if n > 0 { Value::Array(tops) } else { Value::Null },
        "text_offset": offsets,
    })
}

fn call_id(gen_id: u64, index: usize) -> String {
    format!("call_{}{}", unique_suffix(gen_id), index)
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    log: RequestLog,
    body: Bytes,
) -> Response {
    match chat_inner(state, log, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response> {
    let body = json_body(body).map_err(oa)?;
    let core = core(&state).map_err(oa)?;
    let conv = prompt::openai_chat(&body).map_err(oa)?;
    let thinking = params::parse_thinking(&body, &core.defaults).map_err(oa)?;
    let mut p = gen_params(
        &state,
        &body,
        &["max_tokens", "max_completion_tokens", "max_output_tokens"],
        thinking,
        LogprobsForm::Chat,
    )
    .map_err(oa)?;
    p.constraint = crate::structured::openai_chat(&body, conv.tools.as_ref()).map_err(oa)?;
    let extra = match body.get("chat_template_kwargs") {
        Some(Value::Object(m)) => m.clone(),
        _ => Map::new(),
    };
    let (tokens, open) = render_chat(&state, &conv, &p.thinking, &extra, "messages")
        .await
        .map_err(oa)?;
    let gen = start(
        &state,
        "/v1/chat/completions",
        &log,
        tokens,
        &p,
        OutputMode {
            structured: true,
            think_open: open,
            tools: conv.tools.as_ref(),
        },
        "messages",
    )
    .map_err(oa)?;
    let mut gen = gen;
    if conv.continue_final {
        gen.continue_message();
    }
    let id = format!("chatcmpl-{}", unique_suffix(gen.id));
    let created = now_unix();
    let model = state.model_id.clone();
    if !p.stream {
        let gen_id = gen.id;
        let c = collect(gen).await.map_err(oa)?;
        let f = c
            .finished
            .ok_or_else(|| oa(ApiError::internal("generation ended without a result")))?;
        let mut message = json!({"role": "assistant", "content": c.content});
        if !c.reasoning.is_empty() {
            message["reasoning_content"] = json!(c.reasoning);
        }
        if !c.calls.is_empty() {
            let calls: Vec<Value> = c
                .calls
                .iter()
                .enumerate()
                .map(|(i, (name, args))| {
                    json!({"id": call_id(gen_id, i), "type": "function",
                           "function": {"name": name, "arguments": args}})
                })
                .collect();
            message["tool_calls"] = Value::Array(calls);
            if c.content.is_empty() {
                message["content"] = Value::Null;
            }
        }
        let body = json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": "scoria",
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": p.logprobs.map(|_| chat_logprobs(&state, &c.logprobs)),
                "finish_reason": finish_reason(&f, !c.calls.is_empty()),
            }],
            "usage": openai_usage(&f),
            "timings": timings_json(&f.timings),
        });
        return Ok(Json(body).into_response());
    }
    let include_usage = p.include_usage;
    Ok(sse_response(move |sink| async move {
        let chunk = |delta: Value, finish: Value| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created,
                "model": model, "system_fingerprint": "scoria",
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        };
        // A chunk carries the log-probabilities of the tokens that arrived since
        // the last one (text a stop sequence may still claim comes later); there
        // are some only when the request asked.
        let with_logprobs = |mut frame: Value, gen: &mut Generation| {
            let lps = gen.take_logprobs();
            if !lps.is_empty() {
                frame["choices"][0]["logprobs"] = chat_logprobs(&state, &lps);
            }
            frame
        };
        let mut gen = gen;
        if sink
            .send(data_frame(&chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
            )))
            .await
            .is_err()
        {
            return;
        }
        let mut had_calls = false;
        while let Some(step) = gen.next().await {
            let frame = match step {
                Step::Piece(Piece::Reasoning(t)) => {
                    chunk(json!({"reasoning_content": t}), Value::Null)
                }
                Step::Piece(Piece::Content(t)) => chunk(json!({"content": t}), Value::Null),
                Step::Piece(Piece::ToolStart { index, name }) => {
                    had_calls = true;
                    chunk(
                        json!({"tool_calls": [{"index": index, "id": call_id(gen.id, index), "type": "function",
                                               "function": {"name": name, "arguments": ""}}]}),
                        Value::Null,
                    )
                }
                Step::Piece(Piece::ToolArgs { index, delta }) => chunk(
                    json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}),
                    Value::Null,
                ),
                Step::Piece(Piece::ToolEnd { .. }) => continue,
                Step::Idle => {
                    if sink.send(Bytes::from_static(SSE_COMMENT)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Step::Done(f) => {
                    let last = chunk(json!({}), json!(finish_reason(&f, had_calls)));
                    let mut last = with_logprobs(last, &mut gen);
                    last["timings"] = timings_json(&f.timings);
                    if sink.send(data_frame(&last)).await.is_err() {
                        return;
                    }
                    if include_usage
                        && sink
                            .send(data_frame(&usage_chunk(chunk(json!({}), Value::Null), &f)))
                            .await
                            .is_err()
                    {
                        return;
                    }
                    break;
                }
                Step::Failed(e) => {
                    let _ = sink.send(failure_frame(&e)).await;
                    break;
                }
            };
            let frame = with_logprobs(frame, &mut gen);
            if sink.send(data_frame(&frame)).await.is_err() {
                return;
            }
        }
        let _ = sink.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    }))
}

/// `/v1/completions` prompt: a string, a one-element list of strings, token ids, or a
/// one-element list of token-id lists. Several prompts are refused (that is n > 1).
fn completion_prompt(
    state: &AppState,
    body: &Map<String, Value>,
) -> std::result::Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::field(
            "prompt",
            "prompt must be a string, a list of token ids, or a one-element list of either",
        )
    };
    let ids = |a: &[Value]| -> std::result::Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|&n| (n as usize) < state.engine_info.n_vocab)
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
        state
            .tokenizer
            .encode_prompt(s)
            .map_err(|e| ApiError::field("prompt", format!("prompt: cannot tokenize: {e}")))
    };
    match body.get("prompt") {
        None | Some(Value::Null) => Err(ApiError::field("prompt", "prompt is required")),
        Some(Value::String(s)) => encode(s),
        Some(Value::Array(a)) if a.is_empty() => Err(bad()),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => ids(a),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => encode(s),
            Value::Array(inner) => ids(inner),
            _ => Err(bad()),
        },
        Some(Value::Array(_)) => Err(ApiError::field(
            "prompt",
            "prompt: several prompts in one request are not supported; send one",
        )),
        Some(_) => Err(bad()),
    }
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    log: RequestLog,
    body: Bytes,
) -> Response {
    match completions_inner(state, log, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response> {
    let body = json_body(body).map_err(oa)?;
    let no_thinking = Thinking {
        enabled: false,
        budget: None,
        effort: None,
    };
    let mut p = gen_params(
        &state,
        &body,
        &["max_tokens", "max_completion_tokens", "max_output_tokens"],
        no_thinking,
        LogprobsForm::Completions,
    )
    .map_err(oa)?;
    p.constraint = crate::structured::openai_completion(&body).map_err(oa)?;
    let tokens = completion_prompt(&state, &body).map_err(oa)?;
    let gen = start(
        &state,
        "/v1/completions",
        &log,
        tokens,
        &p,
        OutputMode {
            structured: false,
            think_open: false,
            tools: None,
        },
        "prompt",
    )
    .map_err(oa)?;
    let id = format!("cmpl-{}", unique_suffix(gen.id));
    let created = now_unix();
    let model = state.model_id.clone();
    if !p.stream {
        let c = collect(gen).await.map_err(oa)?;
        let f = c
            .finished
            .ok_or_else(|| oa(ApiError::internal("generation ended without a result")))?;
        return Ok(Json(json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": "scoria",
            "choices": [{"text": c.content, "index": 0,
                         "logprobs": p.logprobs.map(|n| completion_logprobs(&state, &c.logprobs, n, &mut 0)),
                         "finish_reason": finish_reason(&f, false)}],
            "usage": openai_usage(&f),
            "timings": timings_json(&f.timings),
        }))
        .into_response());
    }
    let include_usage = p.include_usage;
    let logprobs = p.logprobs;
    Ok(sse_response(move |sink| async move {
        let chunk = |text: &str, finish: Value| {
            json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": "scoria",
                "choices": [{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}],
            })
        };
        // As on chat: each chunk has the tokens that arrived since the last;
        // `text_offset` counts from the start of the whole text.
        let mut offset = 0usize;
        let mut with_logprobs = |mut frame: Value, gen: &mut Generation| {
            let lps = gen.take_logprobs();
            if let (Some(n), false) = (logprobs, lps.is_empty()) {
                frame["choices"][0]["logprobs"] = completion_logprobs(&state, &lps, n, &mut offset);
            }
            frame
        };
        let mut gen = gen;
        while let Some(step) = gen.next().await {
            let frame = match step {
                Step::Piece(Piece::Content(t)) => chunk(&t, Value::Null),
                Step::Piece(_) => continue,
                Step::Idle => {
                    if sink.send(Bytes::from_static(SSE_COMMENT)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Step::Done(f) => {
                    let last = chunk("", json!(finish_reason(&f, false)));
                    let mut last = with_logprobs(last, &mut gen);
                    last["timings"] = timings_json(&f.timings);
                    if sink.send(data_frame(&last)).await.is_err() {
                        return;
                    }
                    if include_usage
                        && sink
                            .send(data_frame(&usage_chunk(chunk("", Value::Null), &f)))
                            .await
                            .is_err()
                    {
                        return;
                    }
                    break;
                }
                Step::Failed(e) => {
                    let _ = sink.send(failure_frame(&e)).await;
                    break;
                }
            };
            let frame = with_logprobs(frame, &mut gen);
            if sink.send(data_frame(&frame)).await.is_err() {
                return;
            }
        }
        let _ = sink.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    }))
}

/// The model entry /v1/models lists.
pub fn model_entry(state: &AppState) -> Value {
    let info = &state.engine_info;
    let mut entry = json!({
        "id": state.model_id,
        "object": "model",
        "created": now_unix(),
        "owned_by": "scoria",
        "meta": {
            "arch": info.arch,
            "name": info.name,
            "n_ctx": info.n_ctx,
            "n_ctx_train": info.n_ctx_train,
            "n_vocab": info.n_vocab,
            "n_expert": info.n_expert,
            "size": info.file_bytes,
            "synthetic": info.synthetic,
        },
    });
    if info.synthetic {
        entry["description"] = json!(if info.name.contains("tiny-qwen35moe") {
            "embedded demo model: synthesized, random weights (its output is noise)"
        } else {
            "synthetic model (scoria synth): random weights (its output is noise)"
        });
    }
    entry
}

pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [model_entry(&state)]})).into_response()
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`): the model, or a 404 naming it.
pub async fn model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id == state.model_id {
        return Json(model_entry(&state)).into_response();
    }
    let mut e = ApiError::with_status(
        axum::http::StatusCode::NOT_FOUND,
        format!(
            "the model \"{id}\" does not exist; this server serves \"{}\" (GET /v1/models lists it)",
            state.model_id
        ),
    );
    e.param = Some("model".into());
    oa(e).into_response()
}

/// The `stream_options.include_usage` frame: the route's empty chunk with no
/// choices, the usage and the timings.
fn usage_chunk(mut empty: Value, f: &Finished) -> Value {
    empty["choices"] = json!([]);
    empty["usage"] = openai_usage(f);
    empty["timings"] = timings_json(&f.timings);
    empty
}

/// The error frame a stream ends with when generation fails mid-way.
fn failure_frame(e: &impl std::fmt::Display) -> Bytes {
    let err = ApiError::internal(format!("generation failed: {e}"));
    Bytes::from(err.sse_frame(Flavor::OpenAi))
}
