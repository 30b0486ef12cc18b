//! The HTTP server: OpenAI (chat completions, completions, responses, models),
//! Anthropic (messages, count_tokens), and the operations endpoints.
//!
//! # Contract between the API core and the operations module
//!
//! Two people write this crate at once; this is the interface they agreed on.
//!
//! * `lib.rs` (API core) defines [`AppState`], shared as `Arc<AppState>` by every
//!   route. Its fields are public and stable:
//!   - `stats: Arc<metrics::Stats>` — the request ledger. `metrics.rs` (operations)
//!     defines `Stats` with `Stats::new()`, `request_queued(&self, id: u64, route: &str)`,
//!     `request_started(&self, id: u64, prompt_tokens: usize)`,
//!     `prompt_progress(&self, id: u64, done: usize)`, `token_generated(&self, id: u64)`,
//!     `request_finished(&self, id: u64, timings: &engine::Timings, finish: &str, n_ctx_used: usize)`,
//!     `request_failed(&self, id: u64, err: &str)`, `queue_depth(&self) -> usize`,
//!     `snapshot(&self) -> serde_json::Value`. The API core calls the `request_*`
//!     methods in that order for every generation request (ids from [`AppState::next_request_id`]).
//!   - `engine_info: engine::ModelInfo` — what the loaded model is.
//!   - `tokenizer: Arc<model::tokenizer::Tokenizer>` — usable without waiting for the
//!     engine worker (for /tokenize, /detokenize).
//!   - `template: Option<Arc<model::chat::ChatTemplate>>` — the GGUF's chat template.
//!   - `settings: serde_json::Value` — effective settings, each as
//!     `{"value": ..., "source": "default" | "config" | "command line"}` under
//!     `{"server": {...}, "engine": {...}}` (for /props and /health).
//!   - `api_key: Option<String>`.
//!   - `model_id: String` — the id /v1/models lists (the alias, or the model's name).
//! * `ops.rs` (operations) exposes `pub fn router() -> axum::Router<Arc<AppState>>`
//!   serving `/`, `/health`, `/props`, `/slots`, `/tokenize`, `/detokenize`,
//!   `/apply-template`, `/metrics`, `/stats.json`. [`app`] merges it with the API
//!   routes and applies the API-key middleware to every route except `/health`.
//! * Files owned by operations: `ops.rs`, `ops/`, `metrics.rs`, `stats_page.rs`,
//!   `assets/`. Everything else in this crate belongs to the API core.

pub mod metrics;
pub mod ops;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;

/// Everything a route needs; shared as `Arc<AppState>`.
pub struct AppState {
    pub stats: Arc<metrics::Stats>,
    pub engine_info: engine::ModelInfo,
    pub tokenizer: Arc<model::tokenizer::Tokenizer>,
    pub template: Option<Arc<model::chat::ChatTemplate>>,
    pub settings: serde_json::Value,
    pub api_key: Option<String>,
    pub model_id: String,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        stats: Arc<metrics::Stats>,
        engine_info: engine::ModelInfo,
        tokenizer: Arc<model::tokenizer::Tokenizer>,
        template: Option<Arc<model::chat::ChatTemplate>>,
        settings: serde_json::Value,
        api_key: Option<String>,
        model_id: String,
    ) -> AppState {
        AppState {
            stats,
            engine_info,
            tokenizer,
            template,
            settings,
            api_key,
            model_id,
            next_id: AtomicU64::new(1),
        }
    }

    /// A fresh request id (1, 2, 3, ...), unique for the life of the server.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// The whole application: API routes + operations routes, behind the API key.
pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .merge(ops::router())
        .layer(middleware::from_fn_with_state(state.clone(), require_api_key))
        .with_state(state)
}

/// Refuses every route but `/health` without the configured key
/// (`Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`).
async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = state.api_key.as_deref() else {
        return next.run(req).await;
    };
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let headers = req.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    if bearer == Some(key) || x_api_key == Some(key) {
        return next.run(req).await;
    }
    let body = serde_json::json!({"error": {
        "message": "invalid or missing API key (send Authorization: Bearer KEY or x-api-key: KEY)",
        "type": "authentication_error", "param": null, "code": "invalid_api_key"}});
    (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response()
}

/// Serves `state` on `addr` until the process is stopped.
pub async fn serve(state: Arc<AppState>, addr: SocketAddr) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app(state)).await
}
