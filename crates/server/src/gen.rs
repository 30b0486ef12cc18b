//! What every generation route shares: rendering the prompt, submitting the job, and
//! reading its output back as structured pieces (streamed through `sse`, or
//! gathered).
//!
//! Keep-alives: a generation that has produced nothing for [`Core::keepalive`] yields
//! [`Step::Idle`] — while the request waits in the queue or its prompt is read, which
//! takes minutes for an agent's prompt on a CPU — and each streaming route answers
//! with something its clients' idle watchdogs count (see the routes: a `ping` event or
//! an SSE comment is dropped below those watchdogs). A client that left makes the
//! write fail, hyper drops the body, the task is dropped with it, and the worker stops
//! the request at its next prompt piece or token.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use crate::access::RequestLog;
use crate::error::ApiError;
use crate::output::{OutputParser, Piece};
use crate::params::{GenParams, Thinking};
use crate::prompt::{continue_final, ends_in_open_think, Conversation, PromptRender};
use crate::protect::Protector;
use crate::settings::RequestDefaults;
use crate::worker::{thinking_limit, Event, Finished, Job, ThinkPlan, Worker};
use crate::AppState;

/// The generation side of the server: present once a model is loaded.
pub struct Core {
    pub worker: Worker,
    pub defaults: RequestDefaults,
    pub renderer: Arc<dyn PromptRender>,
    pub think_open_id: Option<u32>,
    pub think_close_id: Option<u32>,
    /// The budget sentence + `</think>` + blank line, tokenized.
    pub close_tokens: Vec<u32>,
    /// Just `</think>` and a blank line: for budgets too small for the sentence.
    pub close_short: Vec<u32>,
    /// A stream that has sent nothing for this long gets a keep-alive.
    pub keepalive: Duration,
    /// Bytes of a request's output that may wait unread before the request is
    /// stopped (a client that does not read its stream; `backlog`).
    pub backlog: usize,
    /// The engine's vision encoder (`Engine::vision`): None, and a request with an
    /// image is refused.
    pub vision: Option<model::vision::VisionConfig>,
    /// What an image may be (`--image-max-pixels`, `--image-min-pixels`).
    pub image_limits: crate::images::ImageLimits,
}

/// A rendered, tokenized prompt.
#[derive(Debug, Default)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// The images whose rows replace placeholder tokens, in order.
    pub images: Vec<engine::PromptImage>,
}

impl From<Vec<u32>> for Prompt {
    fn from(tokens: Vec<u32>) -> Prompt {
        Prompt {
            tokens,
            images: Vec::new(),
        }
    }
}

/// What [`render_chat`] gives.
#[derive(Debug)]
pub struct Rendered {
    pub prompt: Prompt,
    /// The prompt leaves the model inside an open think block.
    pub think_open: bool,
}

/// [`Core::backlog`] in the server: tens of thousands of tokens, far more than a
/// client that reads at all ever leaves waiting.
pub const BACKLOG: usize = 4 << 20;

/// How long a stream may stay silent before a keep-alive: well inside the idle
/// watchdogs of agent clients (Claude Code's and Codex's are 300 s), and short enough
/// that a client that left is noticed within seconds (the write fails).
pub const KEEPALIVE: Duration = Duration::from_secs(5);

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A short unique suffix for response / item / call ids.
pub fn unique_suffix(id: u64) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{:08x}{:06x}", nanos, id & 0xff_ffff)
}

pub fn core(state: &AppState) -> Result<&Core, ApiError> {
    state
        .core
        .as_ref()
        .ok_or_else(|| ApiError::unavailable("no model is loaded"))
}

/// Renders a conversation with the model's template and tokenizes it. Returns the
/// prompt (each image's placeholder expanded to its rows) and whether it leaves the
/// model inside an open think block. Images are decoded and resized here too.
///
/// The work runs on the blocking pool, not on the async runtime's threads: a large
/// conversation takes seconds to render and tokenize, and `/health` and every other
/// request must keep answering meanwhile.
pub async fn render_chat(
    state: &Arc<AppState>,
    conv: &Conversation,
    thinking: &Thinking,
    extra: &Map<String, Value>,
    field: &str,
) -> Result<Rendered, ApiError> {
    let (state, conv, thinking, extra, field) = (
        state.clone(),
        conv.clone(),
        thinking.clone(),
        extra.clone(),
        field.to_string(),
    );
    tokio::task::spawn_blocking(move || render_chat_now(&state, conv, &thinking, &extra, &field))
        .await
        .map_err(|e| ApiError::internal(format!("rendering the prompt failed: {e}")))?
}

/// [`render_chat`] on the calling thread.
fn render_chat_now(
    state: &AppState,
    mut conv: Conversation,
    thinking: &Thinking,
    extra: &Map<String, Value>,
    field: &str,
) -> Result<Rendered, ApiError> {
    let core = core(state)?;
    // Images first: a request the encoder cannot take is refused before any rendering.
    let images = prepare_images(state, core, &conv)?;
    // Per-session noise (Claude Code's billing header) would keep every new session
    // from reusing the cached system prompt; the model does not need it.
    if core.defaults.strip_session_noise {
        conv.strip_session_noise();
    }
    let mut extra = extra.clone();
    if let Some(e) = &thinking.effort {
        extra.entry("reasoning_effort").or_insert_with(|| json!(e));
    }
    // Control-token text in the messages stays text (see `protect`), unless the server
    // is told to keep the old behaviour.
    let controls = state.tokenizer.control_texts();
    let protector = Protector::new(&controls);
    let protected = !core.defaults.content_special_tokens && {
        let m = conv
            .messages
            .iter_mut()
            .fold(false, |acc, m| protector.protect(m) | acc);
        let t = conv.tools.as_mut().is_some_and(|t| protector.protect(t));
        m | t
    };
    // A final assistant message to continue: its text, as it stands in the rendering.
    let last_text = conv
        .continue_final
        .then(|| conv.messages.last())
        .flatten()
        .and_then(|m| m["content"].as_str())
        .map(str::to_string)
        .filter(|t| !t.trim().is_empty());
    let render = |messages: &[Value]| match &last_text {
        Some(_) => core.renderer.render_without_generation_prompt(
            messages,
            conv.tools.as_ref(),
            thinking.enabled,
            &extra,
        ),
        None => core
            .renderer
            .render(messages, conv.tools.as_ref(), thinking.enabled, &extra),
    };
    // A system turn after the first message stays in place where the template renders
    // it (Qwen3, ChatML); a template that refuses it (Qwen3.5 accepts a system message
    // only first) gets it folded into the leading system message.
    let mut text = match render(&conv.messages) {
        Ok(t) => Ok(t),
        Err(_) if conv.has_later_system() => render(&conv.folded()),
        Err(e) => Err(e),
    }
    .map_err(|e| ApiError::field(field, format!("{field}: the chat template failed: {e}")))?;
    if let Some(last) = &last_text {
        text = continue_final(&text, last).ok_or_else(|| {
            ApiError::field(
                field,
                format!("{field}: the final assistant message cannot be continued: the chat template does not render its text"),
            )
        })?;
    }
    // What the template did decides, not what was asked: a template that ignores
    // `enable_thinking` still leaves the model inside its think block.
    let open = ends_in_open_think(&text);
    let (text, literal) = if protected {
        protector.restore(&text)
    } else {
        (text, Vec::new())
    };
    // A prompt that cannot fit is refused before it is tokenized: tokenizing tens of
    // megabytes takes a minute and gigabytes of memory.
    let n_ctx = state.engine_info.n_ctx;
    let at_least = state.tokenizer.min_tokens(text.len());
    if at_least >= n_ctx {
        return Err(too_long(field, &format!("at least {at_least}"), n_ctx));
    }
    let tokens = state
        .tokenizer
        .encode_prompt_marked(&text, &literal)
        .map_err(|e| ApiError::field(field, format!("{field}: cannot tokenize the prompt: {e}")))?;
    let prompt = match images {
        None => Prompt::from(tokens),
        Some((pad, merge, images)) => {
            let (tokens, images) = crate::images::expand(&tokens, pad, images, merge)
                .map_err(|e| ApiError::internal(format!("placing the images failed: {e}")))?;
            Prompt { tokens, images }
        }
    };
    Ok(Rendered {
        prompt,
        think_open: open,
    })
}

/// The conversation's images ready for the encoder, in the order the messages place
/// them, with the placeholder token and the merge size (None: no image).
#[allow(clippy::type_complexity)]
fn prepare_images(
    state: &AppState,
    core: &Core,
    conv: &Conversation,
) -> Result<Option<(u32, usize, Vec<Arc<model::vision::PreparedImage>>)>, ApiError> {
    let Some(first) = conv.images.first() else {
        return Ok(None);
    };
    let Some(vision) = &core.vision else {
        return Err(crate::images::no_encoder(&first.field));
    };
    let pad = state
        .tokenizer
        .token_id(crate::images::IMAGE_PAD)
        .ok_or_else(|| {
            ApiError::field(
                &first.field,
                format!(
                    "{}: this model's vocabulary has no {} token, so it cannot take images",
                    first.field,
                    crate::images::IMAGE_PAD
                ),
            )
        })?;
    // The order the template renders them: messages in order, items in order.
    let mut order = Vec::with_capacity(conv.images.len());
    for m in &conv.messages {
        if let Value::Array(items) = &m["content"] {
            for i in items {
                if i["type"] == "image" {
                    if let Some(k) = i["image"].as_u64() {
                        order.push(k as usize);
                    }
                }
            }
        }
    }
    let mut prepared = Vec::with_capacity(order.len());
    for k in order {
        let img = conv.images.get(k).ok_or_else(|| {
            ApiError::internal(format!("image {k} of the conversation is missing"))
        })?;
        let p = crate::images::prepare_input(img, vision, &core.image_limits)?;
        prepared.push(Arc::new(p));
    }
    Ok(Some((pad, vision.merge, prepared)))
}

/// The 400 for a prompt of `n` tokens that does not fit a context of `n_ctx`.
fn too_long(field: &str, n: &str, n_ctx: usize) -> ApiError {
    ApiError::field(
        field,
        format!(
            "{field}: the prompt is {n} tokens, which does not fit the context of {n_ctx} tokens (shorten it, or start the server with a larger --max-context)"
        ),
    )
}

/// A running generation, read as structured pieces.
pub struct Generation {
    pub id: u64,
    rx: crate::backlog::EventRx,
    parser: Option<OutputParser>,
    pending: std::collections::VecDeque<Step>,
    done: bool,
    /// The request's log record: told of the first output, the end, a failure.
    log: RequestLog,
    output_started: bool,
    keepalive: Duration,
    /// Each generated token's log-probabilities so far (requests that asked).
    logprobs: Vec<(u32, engine::TokenLogprobs)>,
}

/// What a route gets from [`Generation::next`].
#[derive(Debug)]
pub enum Step {
    Piece(Piece),
    Done(Finished),
    Failed(String),
    /// Nothing for [`Core::keepalive`]: a streaming route sends a keep-alive.
    Idle,
}

impl Generation {
    /// The output continues the final assistant message of the prompt (a prefill):
    /// its leading whitespace is kept.
    pub fn continue_message(&mut self) {
        if let Some(p) = &mut self.parser {
            p.continue_message();
        }
    }

    /// Prompt tokens the engine reused from cached state, once it took the request
    /// (0 before).
    pub fn cached(&self) -> usize {
        self.log.cached()
    }

    /// The log-probabilities of the tokens that arrived since the last call (the
    /// tokens of the text [`Generation::next`] has given out, and perhaps of text a
    /// stop sequence still holds back).
    pub fn take_logprobs(&mut self) -> Vec<(u32, engine::TokenLogprobs)> {
        std::mem::take(&mut self.logprobs)
    }

    pub async fn next(&mut self) -> Option<Step> {
        loop {
            if let Some(s) = self.pending.pop_front() {
                return Some(s);
            }
            if self.done {
                return None;
            }
            let Ok(event) = tokio::time::timeout(self.keepalive, self.rx.recv()).await else {
                return Some(Step::Idle);
            };
            match event {
                Some(Event::Text(t)) => {
                    if !self.output_started {
                        self.output_started = true;
                        self.log.output_started();
                    }
                    match &mut self.parser {
                        Some(p) => self.pending.extend(p.push(&t).into_iter().map(Step::Piece)),
                        None => self.pending.push_back(Step::Piece(Piece::Content(t))),
                    }
                }
                Some(Event::Logprobs(t, lp)) => self.logprobs.push((t, lp)),
                Some(Event::Done(f)) => {
                    if let Some(p) = &mut self.parser {
                        let cut = matches!(
                            f.finish,
                            engine::FinishReason::Length | engine::FinishReason::ContextFull
                        );
                        let rest = if cut { p.finish_cut() } else { p.finish() };
                        self.pending.extend(rest.into_iter().map(Step::Piece));
                    }
                    self.log.finished(&f);
                    self.pending.push_back(Step::Done(f));
                    self.done = true;
                }
                Some(Event::Failed(e)) => {
                    self.log.failed(&e);
                    self.pending.push_back(Step::Failed(e));
                    self.done = true;
                }
                None => {
                    let e = "the engine worker stopped";
                    self.log.failed(e);
                    self.pending.push_back(Step::Failed(e.into()));
                    self.done = true;
                }
            }
        }
    }
}

/// How a request's output is read.
pub struct OutputMode<'a> {
    /// Split reasoning and tool calls (chat routes); false: raw text (completions).
    pub structured: bool,
    /// The prompt leaves the model inside an open think block.
    pub think_open: bool,
    pub tools: Option<&'a Value>,
}

impl<'a> OutputMode<'a> {
    /// Raw text (completions).
    pub const RAW: OutputMode<'static> = OutputMode {
        structured: false,
        think_open: false,
        tools: None,
    };

    /// A chat answer: reasoning (`think_open`: the prompt leaves the model inside its
    /// think block), text and calls of `tools`.
    pub fn chat(think_open: bool, tools: Option<&'a Value>) -> OutputMode<'a> {
        OutputMode {
            structured: true,
            think_open,
            tools,
        }
    }
}

/// Checks the prompt fits, queues the job, and returns its output stream.
pub fn start(
    state: &AppState,
    route: &str,
    log: &RequestLog,
    prompt: impl Into<Prompt>,
    params: &GenParams,
    mode: OutputMode<'_>,
    prompt_field: &str,
) -> Result<Generation, ApiError> {
    let core = core(state)?;
    let n_ctx = state.engine_info.n_ctx;
    let Prompt {
        tokens: prompt,
        images,
    } = prompt.into();
    if prompt.is_empty() {
        return Err(ApiError::field(
            prompt_field,
            format!("{prompt_field}: the prompt is empty"),
        ));
    }
    if prompt.len() >= n_ctx {
        return Err(too_long(prompt_field, &prompt.len().to_string(), n_ctx));
    }
    // The tokens this request may generate: what it asked for, but never more than the
    // context has room for. The thinking budget and the answer room are taken from this,
    // so a default request on a small context still leaves room to answer.
    let budget = params.max_tokens.min(n_ctx - prompt.len());
    let think = if mode.structured && (params.thinking.enabled || mode.think_open) {
        // The budget sentence costs ~25 tokens: a small request closes with `</think>` alone.
        let close = if budget >= 8 * core.close_tokens.len() {
            &core.close_tokens
        } else {
            &core.close_short
        };
        ThinkPlan {
            open_at_start: mode.think_open,
            limit: thinking_limit(
                budget,
                params.thinking.budget,
                core.defaults.thinking_answer_room,
                close.len(),
            ),
            close_tokens: close.clone(),
            open_id: core.think_open_id,
            close_id: core.think_close_id,
        }
    } else {
        ThinkPlan::default()
    };
    let constraint = match &params.constraint {
        Some(spec) => Some(crate::structured::constraint(state, spec, &think)?),
        None => None,
    };
    let id = state.next_request_id();
    log.queued(prompt.len());
    let (tx, rx) = crate::backlog::channel(core.backlog);
    let job = Job {
        id,
        req: engine::GenerateRequest {
            images,
            ..params.request(prompt, budget, constraint)
        },
        think,
        stops: params.stop.clone(),
        detok: Box::new(state.tokenizer.stream_decoder(true)),
        tx,
        log: log.clone(),
    };
    state.stats.request_queued(id, route);
    core.worker.submit(job).map_err(|e| {
        state.stats.request_failed(id, &e);
        ApiError::internal(e)
    })?;
    let parser = mode
        .structured
        .then(|| OutputParser::new(mode.think_open, mode.tools));
    Ok(Generation {
        id,
        rx,
        parser,
        pending: Default::default(),
        done: false,
        log: log.clone(),
        output_started: false,
        keepalive: core.keepalive,
        logprobs: Vec::new(),
    })
}

/// A finished generation, gathered (non-streaming responses).
#[derive(Debug, Default)]
pub struct Collected {
    pub reasoning: String,
    pub content: String,
    /// (name, arguments JSON text)
    pub calls: Vec<(String, String)>,
    /// The last call was cut off by the token budget: its arguments are what was
    /// generated, not a complete object.
    pub cut: bool,
    pub finished: Option<Finished>,
    /// Each generated token's log-probabilities, when the request asked.
    pub logprobs: Vec<(u32, engine::TokenLogprobs)>,
}

impl Collected {
    /// How the generation ended.
    pub fn finished(&self) -> Result<&Finished, ApiError> {
        self.finished
            .as_ref()
            .ok_or_else(|| ApiError::internal("generation ended without a result"))
    }
}

pub async fn collect(mut g: Generation) -> Result<Collected, ApiError> {
    let mut c = Collected::default();
    while let Some(step) = g.next().await {
        match step {
            Step::Piece(Piece::Reasoning(t)) => c.reasoning.push_str(&t),
            Step::Piece(Piece::Content(t)) => c.content.push_str(&t),
            Step::Piece(Piece::ToolStart { name, .. }) => c.calls.push((name, String::new())),
            Step::Piece(Piece::ToolArgs { delta, .. }) => {
                if let Some(last) = c.calls.last_mut() {
                    last.1.push_str(&delta);
                }
            }
            Step::Piece(Piece::ToolEnd { .. }) => {}
            Step::Piece(Piece::ToolCut { .. }) => c.cut = true,
            Step::Done(f) => c.finished = Some(f),
            Step::Failed(e) => return Err(ApiError::internal(format!("generation failed: {e}"))),
            Step::Idle => {}
        }
    }
    c.logprobs = g.take_logprobs();
    Ok(c)
}
