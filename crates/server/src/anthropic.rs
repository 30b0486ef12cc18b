//! Anthropic routes: `/v1/messages` and `/v1/messages/count_tokens`.
//!
//! The stream is the Messages API's event sequence: `message_start`, then for each
//! content block `content_block_start`, its deltas (`thinking_delta`, `text_delta`,
//! `input_json_delta`) and `content_block_stop`, then `message_delta` (stop reason,
//! usage, `timings`) and `message_stop`. Usage is Anthropic's: `input_tokens`
//! excludes the prompt tokens reused from cached state, which are
//! `cache_read_input_tokens` (see `api::anthropic::Usage`); `message_start` is sent
//! with the first step, once the engine has said what it reuses.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::FinishReason;
use serde_json::{json, Map, Value};

use crate::access::RequestLog;
use crate::api::anthropic::{
    BlockOut, DeltaOut, Event, MessageOut, MessagesRequest, StopDelta, Usage,
};
use crate::api::field;
use crate::api::Timings;
use crate::error::{ApiError, Flavor, RouteError};
use crate::gen::{
    collect, core, render_chat, start, unique_suffix, Collected, Generation, OutputMode, Step,
};
use crate::output::Piece;
use crate::sse::{self, Encoder};
use crate::worker::Finished;
use crate::AppState;

fn an(e: ApiError) -> RouteError {
    RouteError(e, Flavor::Anthropic)
}

pub async fn messages(
    State(state): State<Arc<AppState>>,
    log: RequestLog,
    body: Bytes,
) -> Response {
    message(state, log, &body)
        .await
        .unwrap_or_else(|e| an(e).into_response())
}

async fn message(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let req: MessagesRequest = field::body(body)?;
    let core = core(&state)?;
    let conv = req.conversation()?;
    let p = req.params(&core.defaults, state.engine_info.n_vocab, &conv)?;
    let r = render_chat(&state, &conv, &p.thinking, &Map::new(), "messages").await?;
    let (tokens, think_open) = (r.prompt, r.think_open);
    let prompt_tokens = tokens.tokens.len();
    let mode = OutputMode::chat(think_open, conv.tools.as_ref());
    let mut gen = start(&state, "/v1/messages", &log, tokens, &p, mode, "messages")?;
    if conv.continue_final {
        gen.continue_message();
    }
    let id = format!("msg_{}", unique_suffix(gen.id));
    let model = state.model_id.clone();
    if p.stream {
        let start = message_out(id, model, Vec::new(), None);
        return Ok(sse::stream(
            gen,
            MessageStream::new(start, prompt_tokens, think_open),
        ));
    }
    let gen_id = gen.id;
    let c = collect(gen).await?;
    let f = c.finished()?;
    let content = content_blocks(&c, gen_id);
    let message = message_out(id, model, content, Some((f, !c.calls.is_empty())));
    Ok(Json(message).into_response())
}

/// A whole answer's blocks: thinking, text, tool calls (an empty text block when
/// there is nothing).
fn content_blocks(c: &Collected, gen_id: u64) -> Vec<BlockOut> {
    let mut content = Vec::new();
    if !c.reasoning.is_empty() {
        content.push(BlockOut::Thinking {
            thinking: c.reasoning.clone(),
            signature: String::new(),
        });
    }
    if !c.content.is_empty() {
        content.push(BlockOut::Text {
            text: c.content.clone(),
        });
    }
    for (i, (name, args)) in c.calls.iter().enumerate() {
        content.push(BlockOut::ToolUse {
            id: tool_id(gen_id, i),
            name: name.clone(),
            input: input_object(args),
        });
    }
    if content.is_empty() {
        content.push(BlockOut::Text {
            text: String::new(),
        });
    }
    content
}

pub async fn count_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let r = async {
        let req: MessagesRequest = field::body(&body)?;
        let core = core(&state)?;
        let conv = req.conversation()?;
        let thinking = req.common.thinking(&core.defaults)?;
        let r = render_chat(&state, &conv, &thinking, &Map::new(), "messages").await?;
        Ok::<Value, ApiError>(json!({"input_tokens": r.prompt.tokens.len()}))
    }
    .await;
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response_as(Flavor::Anthropic),
    }
}

/// A message: streaming's start (no `finished`), or the whole answer.
fn message_out(
    id: String,
    model: String,
    content: Vec<BlockOut>,
    finished: Option<(&Finished, bool)>,
) -> MessageOut {
    let (stop_reason, stop_sequence, usage, timings) = match finished {
        Some((f, had_calls)) => (
            Some(stop_reason(f, had_calls)),
            f.stop_hit.clone(),
            usage_of(f),
            Some(Timings::of(&f.timings)),
        ),
        None => (None, None, Usage::of(0, 0, 0), None),
    };
    MessageOut {
        id,
        kind: "message",
        role: "assistant",
        model,
        content,
        stop_reason,
        stop_sequence,
        usage,
        timings,
    }
}

/// A finished request's usage.
fn usage_of(f: &Finished) -> Usage {
    Usage::of(f.prompt_tokens, f.timings.cache_n, f.completion_tokens)
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

fn tool_id(gen_id: u64, index: usize) -> String {
    format!("toolu_{}{}", unique_suffix(gen_id), index)
}

/// Tool input as an object (what a tool_use block carries). A call the token budget
/// cut off (the message's `stop_reason` is `max_tokens`) has the parameters that were
/// complete when it stopped.
fn input_object(args: &str) -> Value {
    match serde_json::from_str::<Value>(args) {
        Ok(v @ Value::Object(_)) => v,
        _ => match serde_json::from_str::<Value>(&format!("{}}}", args.trim_end())) {
            Ok(v @ Value::Object(_)) => v,
            _ => json!({}),
        },
    }
}

/// The kind of an open content block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Thinking,
    Text,
    ToolUse,
}

/// The message stream.
struct MessageStream {
    /// `message_start`'s message (taken when sent: with the first step, when the
    /// engine has said how much of the prompt it reuses, unless the request is
    /// still queued then).
    start: Option<MessageOut>,
    prompt_tokens: usize,
    /// The prompt leaves the model thinking (a keep-alive before any block opens one).
    think_open: bool,
    /// The open block: its index and kind.
    open: Option<(usize, Kind)>,
    next_index: usize,
    had_calls: bool,
}

impl MessageStream {
    fn new(start: MessageOut, prompt_tokens: usize, think_open: bool) -> MessageStream {
        MessageStream {
            start: Some(start),
            prompt_tokens,
            think_open,
            open: None,
            next_index: 0,
            had_calls: false,
        }
    }
}

fn push(out: &mut Vec<Bytes>, e: &Event) {
    out.push(sse::event(e.name(), e));
}

impl MessageStream {
    /// `message_start` (with the prompt's usage so far) and a `ping`, once.
    fn send_start(&mut self, gen: &Generation, out: &mut Vec<Bytes>) {
        if let Some(mut message) = self.start.take() {
            message.usage = Usage::of(self.prompt_tokens, gen.cached(), 0);
            push(out, &Event::MessageStart { message });
            push(out, &Event::Ping);
        }
    }

    fn close(&mut self, out: &mut Vec<Bytes>) {
        if let Some((index, _)) = self.open.take() {
            push(out, &Event::ContentBlockStop { index });
        }
    }

    /// The open block when it is of `kind` (a tool call always opens its own), else
    /// a new one starting as `block`.
    fn ensure(&mut self, kind: Kind, block: BlockOut, out: &mut Vec<Bytes>) -> usize {
        if let Some((i, k)) = self.open {
            if k == kind && kind != Kind::ToolUse {
                return i;
            }
        }
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        push(
            out,
            &Event::ContentBlockStart {
                index,
                content_block: block,
            },
        );
        self.open = Some((index, kind));
        index
    }

    fn delta(&self, index: usize, delta: DeltaOut, out: &mut Vec<Bytes>) {
        push(out, &Event::ContentBlockDelta { index, delta });
    }
}

fn empty_block(kind: Kind) -> BlockOut {
    match kind {
        Kind::Thinking => BlockOut::Thinking {
            thinking: String::new(),
            signature: String::new(),
        },
        _ => BlockOut::Text {
            text: String::new(),
        },
    }
}

impl Encoder for MessageStream {
    fn step(&mut self, step: Step, gen: &mut Generation, out: &mut Vec<Bytes>) {
        self.send_start(gen, out);
        match step {
            Step::Piece(Piece::Reasoning(t)) => {
                let i = self.ensure(Kind::Thinking, empty_block(Kind::Thinking), out);
                self.delta(i, DeltaOut::ThinkingDelta { thinking: t }, out);
            }
            Step::Piece(Piece::Content(t)) => {
                let i = self.ensure(Kind::Text, empty_block(Kind::Text), out);
                self.delta(i, DeltaOut::TextDelta { text: t }, out);
            }
            Step::Piece(Piece::ToolStart { index, name }) => {
                self.had_calls = true;
                let block = BlockOut::ToolUse {
                    id: tool_id(gen.id, index),
                    name,
                    input: json!({}),
                };
                self.ensure(Kind::ToolUse, block, out);
            }
            Step::Piece(Piece::ToolArgs { delta, .. }) => {
                if let Some((i, Kind::ToolUse)) = self.open {
                    self.delta(
                        i,
                        DeltaOut::InputJsonDelta {
                            partial_json: delta,
                        },
                        out,
                    );
                }
            }
            Step::Piece(Piece::ToolEnd { .. } | Piece::ToolCut { .. }) => self.close(out),
            // Keep-alive. Claude Code's idle watchdog (300 s, then it retries without
            // streaming while the first request runs on) counts the events its SDK
            // yields, and the SDK drops `ping`; a `message_delta` would be counted
            // again in its usage totals. An empty delta in the block the answer
            // starts with (thinking when the prompt left the model thinking) is what
            // it counts and changes nothing.
            Step::Idle => {
                let (i, kind) = match self.open {
                    Some(open) => open,
                    None => {
                        let kind = if self.think_open {
                            Kind::Thinking
                        } else {
                            Kind::Text
                        };
                        (self.ensure(kind, empty_block(kind), out), kind)
                    }
                };
                let delta = match kind {
                    Kind::Thinking => DeltaOut::ThinkingDelta {
                        thinking: String::new(),
                    },
                    Kind::ToolUse => DeltaOut::InputJsonDelta {
                        partial_json: String::new(),
                    },
                    Kind::Text => DeltaOut::TextDelta {
                        text: String::new(),
                    },
                };
                self.delta(i, delta, out);
            }
            Step::Done(f) => {
                self.close(out);
                push(
                    out,
                    &Event::MessageDelta {
                        delta: StopDelta {
                            stop_reason: stop_reason(&f, self.had_calls),
                            stop_sequence: f.stop_hit.clone(),
                        },
                        usage: usage_of(&f),
                        timings: Timings::of(&f.timings),
                    },
                );
                push(out, &Event::MessageStop);
            }
            Step::Failed(e) => {
                let err = ApiError::internal(format!("generation failed: {e}"));
                out.push(Bytes::from(err.sse_frame(Flavor::Anthropic)));
            }
        }
    }
}
