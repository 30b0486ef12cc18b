//! The HTTP server: OpenAI (chat completions, completions, responses, models),
//! Anthropic (messages, count_tokens), and the operations endpoints.
//!
//! # One request
//!
//! The route (`openai`, `responses`, `anthropic`) reads its body into the API's
//! request type (`api`), which turns itself into a conversation (`prompt`), the
//! generation parameters (`params`) and a structured-output spec (`structured`);
//! `gen` renders and tokenizes the prompt off the async runtime and queues the job
//! for the engine thread (`worker`); the answer comes back as pieces (`output`) that
//! the route gathers into the API's response object or streams through `sse`.
//! `startup` loads the model behind the bound port; `settings` defines every setting
//! once.
//!
//! # The state every route shares
//!
//! * `lib.rs` defines [`AppState`], shared as `Arc<AppState>` by every
//!   route. Its fields are public and stable:
//!   - `stats: Arc<metrics::Stats>` — the request ledger. `metrics.rs` (operations)
//!     defines `Stats` with `Stats::new()`, `request_queued(&self, id: u64, route: &str)`,
//!     `request_started(&self, id: u64, prompt_tokens: usize)`,
//!     `prompt_progress(&self, id: u64, done: usize)`, `token_generated(&self, id: u64)`,
//!     `request_finished(...)`,
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
//!   routes and applies the API-key middleware to every route except `/health` and
//!   `GET`/`HEAD /` (the stats page's static shell; its data comes from `/stats.json`).

pub mod metrics;
pub mod ops;

pub mod access;
pub mod anthropic;
pub mod api;
pub mod backlog;
pub mod device;
pub mod error;
pub mod gen;
pub mod images;
pub mod openai;
pub mod output;
pub mod params;
pub mod prompt;
pub mod protect;
pub mod responses;
pub mod settings;
pub mod sse;
pub mod startup;
pub mod structured;
pub mod timeouts;
pub mod worker;

#[cfg(test)]
mod agent_tests;
#[cfg(test)]
mod api_tests;
#[cfg(test)]
mod client_fault_tests;
#[cfg(test)]
mod http_tests;
#[cfg(test)]
mod image_tests;
#[cfg(test)]
mod prompt_tests;
#[cfg(test)]
mod structured_tests;
#[cfg(test)]
mod test_http;
#[cfg(test)]
mod test_server;
#[cfg(test)]
mod usage_tests;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

pub use startup::{core_for, load_message, run, Loaded, ServeError};

/// Everything a route needs; shared as `Arc<AppState>`.
pub struct AppState {
    pub stats: Arc<metrics::Stats>,
    pub engine_info: engine::ModelInfo,
    pub tokenizer: Arc<model::tokenizer::Tokenizer>,
    pub template: Option<Arc<model::chat::ChatTemplate>>,
    pub settings: serde_json::Value,
    pub api_key: Option<String>,
    pub model_id: String,
    /// The generation side (engine worker, defaults, renderer); None in tests of the
    /// operations routes, where generation routes answer 503.
    pub core: Option<gen::Core>,
    /// Where the one line per request goes (`access::tracing_sink` by default).
    pub access_log: access::LogSink,
    /// Origins browser pages may call from (`--cors-origin`); empty: no CORS headers.
    pub cors_origins: Vec<String>,
    /// How long a client may take to send a request's body (`--read-timeout`).
    pub read_timeout: std::time::Duration,
    next_id: AtomicU64,
    /// Structured output's grammar compiler for `tokenizer`, built on first use.
    grammars: std::sync::OnceLock<Result<engine::constraint::GrammarCompiler, String>>,
}

impl AppState {
    /// Whether requests may carry images: the engine has a vision encoder.
    pub fn takes_images(&self) -> bool {
        self.core.as_ref().is_some_and(|c| c.vision.is_some())
    }

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
            core: None,
            access_log: access::tracing_sink(),
            cors_origins: Vec::new(),
            read_timeout: timeouts::READ_TIMEOUT,
            next_id: AtomicU64::new(1),
            grammars: std::sync::OnceLock::new(),
        }
    }

    /// The grammar compiler for this tokenizer (built on first use: it walks the
    /// vocabulary once).
    pub fn grammar_compiler(&self) -> Result<&engine::constraint::GrammarCompiler, String> {
        self.grammars
            .get_or_init(|| {
                engine::constraint::GrammarCompiler::new(&self.tokenizer).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Sends the request log lines to `sink` instead.
    pub fn with_access_log(mut self, sink: access::LogSink) -> AppState {
        self.access_log = sink;
        self
    }

    /// Answers browsers from `origins` (`*`: any) with CORS headers.
    pub fn with_cors(mut self, origins: Vec<String>) -> AppState {
        self.cors_origins = origins;
        self
    }

    /// Gives clients `limit` to send a request's body.
    pub fn with_read_timeout(mut self, limit: std::time::Duration) -> AppState {
        self.read_timeout = limit;
        self
    }

    /// Attaches the generation side.
    pub fn with_core(mut self, core: gen::Core) -> AppState {
        self.core = Some(core);
        self
    }

    /// A fresh request id (1, 2, 3, ...), unique for the life of the server.
    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// The whole application: API routes + operations routes, behind the API key.
pub fn app(state: Arc<AppState>) -> Router {
    let router = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/completions", post(openai::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/responses", post(responses::responses))
        .route("/v1/models", get(openai::models))
        .route("/models", get(openai::models))
        .route("/v1/models/{*id}", get(openai::model))
        .route("/models/{*id}", get(openai::model))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .merge(ops::router())
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            timeouts::read_body,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    // Outside the key check: a browser's preflight carries no key.
    let router = match cors_layer(&state.cors_origins) {
        Some(cors) => router.layer(cors),
        None => router,
    };
    let routes = router
        // Refused requests (401, 404) are logged and counted too.
        .layer(middleware::from_fn_with_state(
            state.clone(),
            access::log_requests,
        ))
        .with_state(state);
    // Around the whole router: a route's 405 gets its `Allow` header inside it.
    Router::new()
        .fallback_service(routes)
        .layer(middleware::from_fn(json_errors))
}

/// CORS for browser clients, when origins are configured: preflights are answered
/// here (before the API key is asked for), and every answer, errors included, carries
/// the headers a browser needs to read it.
fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{HeaderValue, Method};
    use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer, ExposeHeaders};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o).ok())
                .collect::<Vec<_>>(),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::HEAD, Method::OPTIONS])
            // The SDKs send their own headers (x-stainless-*, anthropic-version, ...).
            .allow_headers(AllowHeaders::mirror_request())
            .expose_headers(ExposeHeaders::any())
            .max_age(std::time::Duration::from_secs(600)),
    )
}

/// Compares a presented key with the configured one in time independent of where
/// they first differ (the length is not secret).
fn same_secret(given: &str, key: &str) -> bool {
    given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Unknown paths answer 404 with a JSON body in the shape of the API the path belongs to.
async fn not_found(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error::ApiError::with_status(
        StatusCode::NOT_FOUND,
        format!("no route for {method} {}", uri.path()),
    )
    .into_response_as(error::Flavor::of_path(uri.path()))
}

/// The request body limit (agent conversations are large; the default 2 MB would cut
/// them off).
pub const BODY_LIMIT: usize = 256 << 20;

/// Every error is JSON in the route's own shape: a refusal made below the handlers
/// (axum's 405 for a wrong method, the body limit's 413, an extractor's rejection)
/// comes as plain text or an empty body; this rewrites it, keeping the status and the
/// headers (`Allow` on a 405).
async fn json_errors(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    // A body announced larger than the limit is refused before a byte of it is read.
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let res = match announced {
        Some(n) if n > BODY_LIMIT as u64 => StatusCode::PAYLOAD_TOO_LARGE.into_response(),
        _ => next.run(req).await,
    };
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let message = match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = parts
                .headers
                .get(header::ALLOW)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .map(|v| format!(" (use {v})"))
                .unwrap_or_default();
            format!("{method} is not allowed on {path}{allowed}")
        }
        StatusCode::PAYLOAD_TOO_LARGE => format!(
            "the request body is larger than this server accepts ({} MiB)",
            BODY_LIMIT >> 20
        ),
        _ => {
            // An extractor's own text says what was wrong; keep it when it is short.
            let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
            let text = String::from_utf8_lossy(&text).trim().to_string();
            if text.is_empty() {
                format!(
                    "{method} {path}: {}",
                    status.canonical_reason().unwrap_or("error")
                )
            } else {
                text
            }
        }
    };
    let fresh = error::ApiError::with_status(status, message)
        .into_response_as(error::Flavor::of_path(&path));
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let (_, body) = fresh.into_parts();
    Response::from_parts(parts, body)
}

/// Refuses every route but `/health` and the stats page shell without the configured key
/// (`Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`).
async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = state.api_key.as_deref() else {
        return next.run(req).await;
    };
    // /health is for probes; `GET /` is the stats page's static shell, which holds no
    // data (its script asks for the key and sends it with every /stats.json call).
    // `HEAD /` is answered as GET is (Claude Code checks connectivity with it).
    let path = req.uri().path();
    let method = req.method();
    if path == "/health"
        || (path == "/"
            && (method == axum::http::Method::GET || method == axum::http::Method::HEAD))
    {
        return next.run(req).await;
    }
    let headers = req.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        });
    let x_api_key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    let ok = |given: Option<&str>| given.is_some_and(|g| same_secret(g, key));
    if ok(bearer) || ok(x_api_key) {
        return next.run(req).await;
    }
    error::ApiError::with_status(
        StatusCode::UNAUTHORIZED,
        "invalid or missing API key (send Authorization: Bearer KEY or x-api-key: KEY)",
    )
    .into_response_as(error::Flavor::of_path(path))
}

/// Serves `state` on `addr` until the process is stopped.
pub async fn serve(state: Arc<AppState>, addr: SocketAddr) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    axum::serve(listener, app(state)).await
}
