//! OpenAI routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.
//!
//! Streams are framed as the official SDKs parse them: `data: {chunk}\n\n` frames, a
//! first delta carrying the role, reasoning in `reasoning_content` deltas, tool calls
//! as `tool_calls` deltas (id, type and name first, then argument pieces), a last
//! chunk with `finish_reason` (and `timings`), a usage chunk with empty `choices` when
//! `stream_options.include_usage` is set, and `data: [DONE]`. Keep-alives are SSE
//! comments.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::FinishReason;
use serde_json::{Map, Value};

use crate::access::RequestLog;
use crate::api::field;
use crate::api::openai::{
    AssistantMessage, CallOut, ChatChoice, ChatChunk, ChatCompletion, ChatLogprobs, ChatRequest,
    ChunkChoice, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Delta,
    DeltaCall, DeltaFunction, FunctionOut, Head, LogprobEntry, Model, ModelList, ModelMeta, Usage,
};
use crate::api::Timings;
use crate::error::{ApiError, Flavor, RouteError};
use crate::gen::{
    collect, core, now_unix, render_chat, start, unique_suffix, Collected, Generation, OutputMode,
    Step,
};
use crate::output::Piece;
use crate::sse::{self, Encoder};
use crate::worker::Finished;
use crate::AppState;

fn oa(e: ApiError) -> RouteError {
    RouteError(e, Flavor::OpenAi)
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    log: RequestLog,
    body: Bytes,
) -> Response {
    chat(state, log, &body)
        .await
        .unwrap_or_else(|e| oa(e).into_response())
}

async fn chat(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatRequest = field::body(body)?;
    let core = core(&state)?;
    let conv = req.conversation()?;
    let p = req.params(&core.defaults, state.engine_info.n_vocab, &conv)?;
    let extra = req.common.template_kwargs();
    let r = render_chat(&state, &conv, &p.thinking, &extra, "messages").await?;
    let (tokens, open) = (r.prompt, r.think_open);
    let mode = OutputMode::chat(open, conv.tools.as_ref());
    let mut gen = start(
        &state,
        "/v1/chat/completions",
        &log,
        tokens,
        &p,
        mode,
        "messages",
    )?;
    if conv.continue_final {
        gen.continue_message();
    }
    let head = head(&state, &gen, "chatcmpl-", "chat.completion");
    if p.stream {
        let head = Head {
            object: "chat.completion.chunk",
            ..head
        };
        let stream = ChatStream::new(state, head, p.include_usage);
        return Ok(sse::stream(gen, stream));
    }
    let gen_id = gen.id;
    let c = collect(gen).await?;
    let completion = chat_completion(&state, &head, &c, gen_id, p.logprobs)?;
    Ok(Json(completion).into_response())
}

/// A whole chat answer: reasoning, text and tool calls as one message.
fn chat_completion<'a>(
    state: &AppState,
    head: &'a Head,
    c: &Collected,
    gen_id: u64,
    logprobs: Option<usize>,
) -> Result<ChatCompletion<'a>, ApiError> {
    let f = c.finished()?;
    let calls: Vec<CallOut> = c
        .calls
        .iter()
        .enumerate()
        .map(|(i, (name, args))| CallOut {
            id: call_id(gen_id, i),
            kind: "function",
            function: FunctionOut {
                name: name.clone(),
                arguments: args.clone(),
            },
        })
        .collect();
    let message = AssistantMessage {
        role: "assistant",
        content: (calls.is_empty() || !c.content.is_empty()).then(|| c.content.clone()),
        reasoning_content: (!c.reasoning.is_empty()).then(|| c.reasoning.clone()),
        tool_calls: (!calls.is_empty()).then_some(calls),
    };
    Ok(ChatCompletion {
        head,
        choices: [ChatChoice {
            index: 0,
            message,
            logprobs: logprobs.map(|_| chat_logprobs(state, &c.logprobs)),
            finish_reason: finish_reason(f, !c.calls.is_empty()),
        }],
        usage: Usage::of(f),
        timings: Timings::of(&f.timings),
    })
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    log: RequestLog,
    body: Bytes,
) -> Response {
    completion(state, log, &body)
        .await
        .unwrap_or_else(|e| oa(e).into_response())
}

async fn completion(
    state: Arc<AppState>,
    log: RequestLog,
    body: &[u8],
) -> Result<Response, ApiError> {
    let req: CompletionRequest = field::body(body)?;
    let core = core(&state)?;
    let n_vocab = state.engine_info.n_vocab;
    let p = req.params(&core.defaults, n_vocab)?;
    let tokens = req.prompt(&state.tokenizer, n_vocab)?;
    let gen = start(
        &state,
        "/v1/completions",
        &log,
        tokens,
        &p,
        OutputMode::RAW,
        "prompt",
    )?;
    let head = head(&state, &gen, "cmpl-", "text_completion");
    if p.stream {
        return Ok(sse::stream(
            gen,
            CompletionStream {
                state,
                head,
                include_usage: p.include_usage,
                logprobs: p.logprobs,
                offset: 0,
            },
        ));
    }
    let c = collect(gen).await?;
    let f = c.finished()?;
    Ok(Json(Completion {
        head: &head,
        choices: vec![CompletionChoice {
            text: c.content.clone(),
            index: 0,
            logprobs: p
                .logprobs
                .map(|n| completion_logprobs(&state, &c.logprobs, n, &mut 0)),
            finish_reason: Some(finish_reason(f, false)),
        }],
        usage: Some(Usage::of(f)),
        timings: Some(Timings::of(&f.timings)),
    })
    .into_response())
}

/// What every object and chunk of this response repeats.
fn head(state: &AppState, gen: &Generation, prefix: &str, object: &'static str) -> Head {
    Head {
        id: format!("{prefix}{}", unique_suffix(gen.id)),
        object,
        created: now_unix(),
        model: state.model_id.clone(),
        system_fingerprint: "scoria",
    }
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

fn call_id(gen_id: u64, index: usize) -> String {
    format!("call_{}{}", unique_suffix(gen_id), index)
}

/// A token's text and bytes, as the logprobs objects give them (a token that
/// ends inside a UTF-8 character shows U+FFFD in `token`; `bytes` are exact).
fn token_text(state: &AppState, id: u32) -> (String, Vec<u8>) {
    let bytes = state.tokenizer.token_to_piece(id);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat's `logprobs`: one entry per generated token (the thinking block's and tool
/// calls' included, the end-of-generation token not).
fn chat_logprobs(state: &AppState, lps: &[(u32, engine::TokenLogprobs)]) -> ChatLogprobs {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_text(state, id);
        LogprobEntry {
            token,
            logprob: logprob as f64,
            bytes,
            top_logprobs: None,
        }
    };
    let content = lps
        .iter()
        .map(|&(id, lp)| LogprobEntry {
            top_logprobs: Some(lp.top().iter().map(|&(t, l)| entry(t, l)).collect()),
            ..entry(id, lp.logprob)
        })
        .collect();
    ChatLogprobs {
        content,
        refusal: None,
    }
}

/// Completions' `logprobs`; `offset` counts the characters of the text before these
/// tokens (and is advanced past them).
fn completion_logprobs(
    state: &AppState,
    lps: &[(u32, engine::TokenLogprobs)],
    n: usize,
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs {
        tokens: Vec::new(),
        token_logprobs: Vec::new(),
        top_logprobs: (n > 0).then(Vec::new),
        text_offset: Vec::new(),
    };
    for &(id, lp) in lps {
        let (token, _) = token_text(state, id);
        out.text_offset.push(*offset);
        *offset += token.chars().count();
        out.tokens.push(token);
        out.token_logprobs.push(lp.logprob as f64);
        if let Some(tops) = &mut out.top_logprobs {
            let top: Map<String, Value> = lp
                .top()
                .iter()
                .map(|&(t, l)| (token_text(state, t).0, Value::from(l as f64)))
                .collect();
            tops.push(top);
        }
    }
    out
}

/// The chat stream.
struct ChatStream {
    state: Arc<AppState>,
    head: Head,
    include_usage: bool,
    had_calls: bool,
}

impl ChatStream {
    fn new(state: Arc<AppState>, head: Head, include_usage: bool) -> ChatStream {
        ChatStream {
            state,
            head,
            include_usage,
            had_calls: false,
        }
    }

    /// A chunk of one choice, with the log-probabilities of the tokens that arrived
    /// since the last chunk (text a stop sequence may still claim comes later).
    fn chunk(&self, delta: Delta, finish: Option<&'static str>, gen: &mut Generation) -> Bytes {
        let lps = gen.take_logprobs();
        let logprobs = (!lps.is_empty()).then(|| chat_logprobs(&self.state, &lps));
        self.frame(delta, finish, logprobs, None)
    }

    fn frame(
        &self,
        delta: Delta,
        finish: Option<&'static str>,
        logprobs: Option<ChatLogprobs>,
        timings: Option<Timings>,
    ) -> Bytes {
        sse::data(&ChatChunk {
            head: &self.head,
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
            timings,
        })
    }
}

impl Encoder for ChatStream {
    fn open(&mut self, out: &mut Vec<Bytes>) {
        let role = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
            ..Default::default()
        };
        out.push(self.frame(role, None, None, None));
    }

    fn step(&mut self, step: Step, gen: &mut Generation, out: &mut Vec<Bytes>) {
        let delta = match step {
            Step::Piece(Piece::Reasoning(t)) => Delta {
                reasoning_content: Some(t),
                ..Default::default()
            },
            Step::Piece(Piece::Content(t)) => Delta {
                content: Some(t),
                ..Default::default()
            },
            Step::Piece(Piece::ToolStart { index, name }) => {
                self.had_calls = true;
                Delta {
                    tool_calls: Some([DeltaCall {
                        index,
                        id: Some(call_id(gen.id, index)),
                        kind: Some("function"),
                        function: DeltaFunction {
                            name: Some(name),
                            arguments: String::new(),
                        },
                    }]),
                    ..Default::default()
                }
            }
            Step::Piece(Piece::ToolArgs { index, delta }) => Delta {
                tool_calls: Some([DeltaCall {
                    index,
                    id: None,
                    kind: None,
                    function: DeltaFunction {
                        name: None,
                        arguments: delta,
                    },
                }]),
                ..Default::default()
            },
            Step::Piece(Piece::ToolEnd { .. } | Piece::ToolCut { .. }) => return,
            Step::Idle => return out.push(sse::comment()),
            Step::Done(f) => {
                let lps = gen.take_logprobs();
                let logprobs = (!lps.is_empty()).then(|| chat_logprobs(&self.state, &lps));
                let finish = Some(finish_reason(&f, self.had_calls));
                out.push(self.frame(
                    Delta::default(),
                    finish,
                    logprobs,
                    Some(Timings::of(&f.timings)),
                ));
                if self.include_usage {
                    out.push(sse::data(&ChatChunk {
                        head: &self.head,
                        choices: Vec::new(),
                        usage: Some(Usage::of(&f)),
                        timings: Some(Timings::of(&f.timings)),
                    }));
                }
                return;
            }
            Step::Failed(e) => return out.push(failure_frame(&e)),
        };
        out.push(self.chunk(delta, None, gen));
    }

    fn close(&mut self, out: &mut Vec<Bytes>) {
        out.push(sse::done());
    }
}

/// The completions stream: content only; `text_offset` counts from the start of the
/// whole text.
struct CompletionStream {
    state: Arc<AppState>,
    head: Head,
    include_usage: bool,
    logprobs: Option<usize>,
    offset: usize,
}

impl CompletionStream {
    fn frame(
        &mut self,
        text: String,
        finish: Option<&'static str>,
        gen: &mut Generation,
        timings: Option<Timings>,
    ) -> Bytes {
        let lps = gen.take_logprobs();
        let logprobs = match (self.logprobs, lps.is_empty()) {
            (Some(n), false) => Some(completion_logprobs(&self.state, &lps, n, &mut self.offset)),
            _ => None,
        };
        sse::data(&Completion {
            head: &self.head,
            choices: vec![CompletionChoice {
                text,
                index: 0,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
            timings,
        })
    }
}

impl Encoder for CompletionStream {
    fn step(&mut self, step: Step, gen: &mut Generation, out: &mut Vec<Bytes>) {
        match step {
            Step::Piece(Piece::Content(t)) => out.push(self.frame(t, None, gen, None)),
            Step::Piece(_) => {}
            Step::Idle => out.push(sse::comment()),
            Step::Done(f) => {
                let finish = Some(finish_reason(&f, false));
                let timings = Some(Timings::of(&f.timings));
                out.push(self.frame(String::new(), finish, gen, timings));
                if self.include_usage {
                    out.push(sse::data(&Completion {
                        head: &self.head,
                        choices: Vec::new(),
                        usage: Some(Usage::of(&f)),
                        timings: Some(Timings::of(&f.timings)),
                    }));
                }
            }
            Step::Failed(e) => out.push(failure_frame(&e)),
        }
    }

    fn close(&mut self, out: &mut Vec<Bytes>) {
        out.push(sse::done());
    }
}

/// The error frame a stream ends with when generation fails mid-way.
fn failure_frame(e: &impl std::fmt::Display) -> Bytes {
    let err = ApiError::internal(format!("generation failed: {e}"));
    Bytes::from(err.sse_frame(Flavor::OpenAi))
}

/// The model entry /v1/models lists.
pub fn model_entry(state: &AppState) -> Model {
    let info = &state.engine_info;
    Model {
        id: state.model_id.clone(),
        object: "model",
        created: now_unix(),
        owned_by: "scoria",
        meta: ModelMeta {
            arch: info.arch.clone(),
            name: info.name.clone(),
            n_ctx: info.n_ctx,
            n_ctx_train: info.n_ctx_train,
            n_vocab: info.n_vocab,
            n_expert: info.n_expert,
            size: info.file_bytes,
            synthetic: info.synthetic,
        },
        description: info.synthetic.then(|| {
            if info.name.contains("tiny-qwen35moe") {
                "embedded demo model: synthesized, random weights (its output is noise)"
            } else {
                "synthetic model (scoria synth): random weights (its output is noise)"
            }
        }),
        capabilities: if state.takes_images() {
            vec!["completion", "multimodal", "vision"]
        } else {
            vec!["completion"]
        },
    }
}

pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    Json(ModelList {
        object: "list",
        data: vec![model_entry(&state)],
    })
    .into_response()
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
