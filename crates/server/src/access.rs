//! What operators see of each request: one log line when its response ends, and
//! every 4xx/5xx counted in `/metrics`.
//!
//! The middleware [`log_requests`] runs outside every other layer (the API key check
//! included). It gives the request a [`RequestLog`] (routes take it as an extractor
//! and fill in tokens and failures as they learn them), and a [`Line`] that is written
//! once, when it is dropped: after the last byte of the body went out, or when the
//! client left first — before the response (hyper drops the handler), or in the middle
//! of a stream (hyper drops the body).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{FromRequestParts, MatchedPath, Request, State};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::metrics::Stats;
use crate::worker::Finished;
use crate::AppState;

/// Where finished log lines go: `tracing` (target `scoria::access`) in the server,
/// a collector in tests. The flag marks a routine poll (see [`is_poll`]).
pub type LogSink = Arc<dyn Fn(&str, bool) + Send + Sync>;

/// The default sink: an `info` event on target `scoria::access` (stderr in `scoria
/// serve`); routine polls at `debug`, so a stats page or a health probe polling every
/// second does not bury the requests (`SCORIA_LOG=scoria::access=debug` shows them).
pub fn tracing_sink() -> LogSink {
    Arc::new(|line: &str, poll: bool| {
        if poll {
            tracing::debug!(target: "scoria::access", "{line}");
        } else {
            tracing::info!(target: "scoria::access", "{line}");
        }
    })
}

/// A successful read of an operations endpoint that monitors poll.
fn is_poll(method: &Method, path: &str, status: Option<StatusCode>) -> bool {
    (method == Method::GET || method == Method::HEAD)
        && status.is_some_and(|s| s.is_success())
        && matches!(
            path,
            "/" | "/health" | "/metrics" | "/stats.json" | "/slots" | "/props"
        )
}

/// What a route learned about its request; shared with the request's [`Line`].
#[derive(Clone, Default)]
pub struct RequestLog(Arc<Mutex<Record>>);

#[derive(Default)]
struct Record {
    /// Prompt tokens, once the request was queued for the engine.
    prompt: Option<usize>,
    /// The engine's account: what it reused at admission and the tokens generated
    /// so far; its final numbers once it finished.
    cached: usize,
    generated: usize,
    /// Tiered experts: where the experts of the steps it ran in came from.
    experts: Option<engine::experts::TierStats>,
    /// Speculative decoding: draft tokens checked and accepted.
    drafts: (usize, usize),
    finish: Option<String>,
    /// Output reached the route (the first piece of the answer).
    output_started: bool,
    /// The generation failed (the worker counted it in `errors_total` already).
    failure: Option<String>,
}

impl RequestLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The request was queued with a prompt of `tokens` tokens.
    pub fn queued(&self, tokens: usize) {
        self.lock().prompt = Some(tokens);
    }

    /// The engine took the request, reusing `cached` prompt tokens.
    pub fn admitted(&self, cached: usize) {
        self.lock().cached = cached;
    }

    /// The engine generated one more token (counted as they come, so a request whose
    /// client left is logged with the tokens made before it went).
    pub fn token_generated(&self) {
        self.lock().generated += 1;
    }

    /// Prompt tokens reused from cached state (0 until the engine took the request).
    pub fn cached(&self) -> usize {
        self.lock().cached
    }

    /// The first piece of the answer reached the route.
    pub fn output_started(&self) {
        self.lock().output_started = true;
    }

    /// The engine finished the request.
    pub fn finished(&self, f: &Finished) {
        let mut r = self.lock();
        r.cached = f.timings.cache_n;
        r.generated = f.completion_tokens;
        r.experts = f.timings.experts;
        r.drafts = (f.timings.draft_n, f.timings.draft_n_accepted);
        r.finish = Some(match (f.finish, &f.stop_hit) {
            (_, Some(_)) => "stop_sequence".into(),
            (engine::FinishReason::Eog, _) => "end_of_turn".into(),
            (engine::FinishReason::Length, _) => "max_tokens".into(),
            (engine::FinishReason::ContextFull, _) => "context_full".into(),
            (engine::FinishReason::Stopped, _) => "stopped".into(),
        });
    }

    /// The generation failed with `err`.
    pub fn failed(&self, err: &str) {
        self.lock().failure = Some(err.to_string());
    }
}

impl<S: Send + Sync> FromRequestParts<S> for RequestLog {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        // Outside the middleware (a route mounted on its own) the record goes nowhere.
        Ok(parts
            .extensions
            .get::<RequestLog>()
            .cloned()
            .unwrap_or_default())
    }
}

/// One request's log line, written when dropped.
pub struct Line {
    sink: LogSink,
    method: Method,
    path: String,
    started: Instant,
    log: RequestLog,
    status: Option<StatusCode>,
    /// The error message of a 4xx/5xx answer.
    error: Option<String>,
    /// The whole response went out.
    complete: bool,
}

impl Line {
    /// The text of the line (without the timestamp the sink adds).
    fn text(&self) -> String {
        use std::fmt::Write as _;
        let r = self.log.lock();
        let status = self
            .status
            .map(|s| s.as_u16().to_string())
            .unwrap_or_else(|| "-".into());
        let mut out = format!(
            "{} {} {status} {:.2}s",
            self.method,
            self.path,
            self.started.elapsed().as_secs_f64()
        );
        if let Some(p) = r.prompt {
            let _ = write!(out, " prompt={p} cached={}", r.cached);
            let _ = write!(out, " generated={}", r.generated);
        }
        if let Some(e) = &r.experts {
            let mb = |b: u64| b as f64 / 1e6;
            let _ = write!(
                out,
                " experts_vram={:.1}% ram_mb={:.1} cpu_mb={:.1} disk_mb={:.1}",
                100.0 * e.hit_rate(),
                mb(e.ram_bytes),
                mb(e.cpu_bytes),
                mb(e.disk_bytes)
            );
        }
        if r.drafts.0 > 0 {
            let (n, a) = r.drafts;
            let _ = write!(
                out,
                " drafted={n} accepted={a} ({:.1}%)",
                100.0 * a as f64 / n as f64
            );
        }
        if let Some(f) = &r.finish {
            let _ = write!(out, " finish={f}");
        }
        if let Some(e) = r.failure.as_ref().or(self.error.as_ref()) {
            let _ = write!(out, " error={}", quoted(e));
        }
        if !self.complete {
            out.push_str(match (self.status, r.prompt, r.output_started) {
                (None, _, _) => " client disconnected before the response",
                (Some(_), Some(_), false) => {
                    " client disconnected before the first token (queued or reading the prompt)"
                }
                (Some(_), _, _) => " client disconnected mid-response",
            });
        }
        out
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        let line = self.text();
        (self.sink)(&line, is_poll(&self.method, &self.path, self.status));
    }
}

/// A message on one line, quoted, at most 300 characters.
fn quoted(s: &str) -> String {
    let one: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(300)
        .collect();
    format!("{one:?}")
}

/// The route label errors are counted under: the matched route, or `unmatched`
/// (unknown paths would make the label set unbounded).
fn route_label(req: &Request) -> String {
    req.extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into())
}

/// The middleware: gives the request its [`RequestLog`], counts a 4xx/5xx answer, and
/// writes one line when the response ends.
pub async fn log_requests(
    State(state): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    let log = RequestLog::default();
    req.extensions_mut().insert(log.clone());
    let route = route_label(&req);
    let mut line = Line {
        sink: state.access_log.clone(),
        method: req.method().clone(),
        path: req.uri().path().to_string(),
        started: Instant::now(),
        log,
        status: None,
        error: None,
        complete: false,
    };
    // Dropped here (the client left before the answer): `line` says so.
    let res = next.run(req).await;
    let status = res.status();
    line.status = Some(status);
    let res = if status.is_client_error() || status.is_server_error() {
        let (parts, body) = res.into_parts();
        // Error bodies are small JSON objects; their message goes into the line.
        let bytes = axum::body::to_bytes(body, 1 << 20)
            .await
            .unwrap_or_default();
        line.error = Some(error_message(&bytes));
        count_error(&state.stats, &route, status, &line.log);
        Response::from_parts(parts, Body::from(bytes))
    } else {
        res
    };
    let (parts, body) = res.into_parts();
    // A HEAD answer's body is never polled; an empty body has nothing to send.
    line.complete = line.method == Method::HEAD || body.is_end_stream();
    Response::from_parts(parts, Body::new(Logged { inner: body, line })).into_response()
}

/// Counts a 4xx/5xx answer. A generation failure the worker already counted in
/// `errors_total` is counted by status only.
fn count_error(stats: &Stats, route: &str, status: StatusCode, log: &RequestLog) {
    let counted = log.lock().failure.is_some();
    stats.http_error(route, status.as_u16(), !counted);
}

/// The `error.message` of an OpenAI- or Anthropic-shaped error body, else its text.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

/// A response body that carries the request's [`Line`]: complete once its last frame
/// went out, written when hyper drops it.
struct Logged {
    inner: Body,
    line: Line,
}

impl HttpBody for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(None) => this.line.complete = true,
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.line.complete = true,
            _ => {}
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::experts::TierStats;

    fn line_after(experts: Option<TierStats>) -> String {
        let log = RequestLog::default();
        log.queued(8);
        log.finished(&Finished {
            finish: engine::FinishReason::Eog,
            stop_hit: None,
            prompt_tokens: 8,
            completion_tokens: 3,
            reasoning_tokens: 0,
            timings: engine::Timings {
                cache_n: 2,
                experts,
                ..Default::default()
            },
            seed: 1,
        });
        let line = Line {
            sink: Arc::new(|_, _| {}),
            method: Method::POST,
            path: "/v1/chat/completions".into(),
            started: Instant::now(),
            log,
            status: Some(StatusCode::OK),
            error: None,
            complete: true,
        };
        line.text()
    }

    #[test]
    fn a_generation_line_says_where_its_experts_came_from_when_they_are_tiered() {
        let l = line_after(None);
        assert!(
            l.ends_with("prompt=8 cached=2 generated=3 finish=end_of_turn"),
            "{l}"
        );
        let e = TierStats {
            hits: 30,
            ram_misses: 6,
            ram_bytes: 12_000_000,
            cpu_misses: 4,
            cpu_bytes: 8_000_000,
            ..Default::default()
        };
        let l = line_after(Some(e));
        assert!(
            l.ends_with(
                "generated=3 experts_vram=75.0% ram_mb=12.0 cpu_mb=8.0 disk_mb=0.0 finish=end_of_turn"
            ),
            "{l}"
        );
    }
}
