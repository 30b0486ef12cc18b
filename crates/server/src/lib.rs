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
//!   routes and applies the API-key middleware to every route except `/health` and
//!   `GET`/`HEAD /` (the stats page's static shell; its data comes from `/stats.json`).
//! * Files owned by operations: `ops.rs`, `ops/`, `metrics.rs`, `stats_page.rs`,
//!   `assets/`. Everything else in this crate belongs to the API core.

pub mod metrics;
pub mod ops;

pub mod access;
pub mod anthropic;
pub mod device;
pub mod error;
pub mod gen;
pub mod openai;
pub mod output;
pub mod params;
pub mod prompt;
pub mod protect;
pub mod responses;
pub mod settings;
pub mod structured;
pub mod worker;

#[cfg(test)]
mod agent_tests;
#[cfg(test)]
mod api_tests;
#[cfg(test)]
mod defect_tests;
#[cfg(test)]
mod structured_tests;
#[cfg(test)]
mod test_http;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
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
    /// The generation side (engine worker, defaults, renderer); None in tests of the
    /// operations routes, where generation routes answer 503.
    pub core: Option<gen::Core>,
    /// Where the one line per request goes (`access::tracing_sink` by default).
    pub access_log: access::LogSink,
    /// Origins browser pages may call from (`--cors-origin`); empty: no CORS headers.
    pub cors_origins: Vec<String>,
    next_id: AtomicU64,
    /// Structured output's grammar compiler for `tokenizer`, built on first use.
    grammars: std::sync::OnceLock<Result<engine::constraint::GrammarCompiler, String>>,
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
            core: None,
            access_log: access::tracing_sink(),
            cors_origins: Vec::new(),
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

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Settings(#[from] settings::SettingsError),
    #[error("cannot prepare the embedded demo model: {0}")]
    Demo(String),
    #[error("{}", load_message(path, err))]
    Load {
        path: String,
        err: engine::EngineError,
    },
    #[error("{}", bind_message(addr, err))]
    Bind { addr: String, err: std::io::Error },
    #[error("--host {0} is neither an IP address nor a name that resolves (use 127.0.0.1, 0.0.0.0, ::1, localhost, ...)")]
    Host(String),
    #[error("cannot start: {0}")]
    Io(#[from] std::io::Error),
}

/// "cannot load PATH: why", with the path once (errors from the file name it already).
pub fn load_message(path: &str, err: &dyn std::fmt::Display) -> String {
    let why = err.to_string();
    match why.strip_prefix(path) {
        Some(rest) if rest.starts_with(':') => format!("cannot load {path}{rest}"),
        _ => format!("cannot load {path}: {why}"),
    }
}

/// Why the address could not be bound, with the remedy that fits the cause.
fn bind_message(addr: &str, err: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let hint = match err.kind() {
        ErrorKind::AddrInUse => "another program is using the port; choose another with --port",
        ErrorKind::AddrNotAvailable => {
            "the host is not an address of this machine; use 127.0.0.1 (this machine only), 0.0.0.0 (every interface) or one of its own addresses"
        }
        ErrorKind::PermissionDenied => {
            "ports below 1024 need privileges; choose a higher one with --port"
        }
        _ => "check --host and --port",
    };
    format!("cannot listen on {addr}: {err} ({hint})")
}

/// A loaded engine, split into what the routes share.
pub struct Loaded {
    pub core: gen::Core,
    pub info: engine::ModelInfo,
    pub tokenizer: Arc<model::tokenizer::Tokenizer>,
    pub template: Option<Arc<model::chat::ChatTemplate>>,
}

/// The generation side for a loaded engine: worker thread, renderer, think tokens.
pub fn core_for(
    engine: engine::Engine,
    defaults: settings::RequestDefaults,
    stats: Arc<metrics::Stats>,
) -> Result<Loaded, ServeError> {
    let info = engine.info().clone();
    let tokenizer = engine.tokenizer_arc();
    let template = engine.chat_template_arc();
    stats.set_device(engine.device_report());
    // `--parallel` slots, each up to `n_ctx` positions, sharing the engine's
    // context pool: `/props`, `/slots`, the KV usage ratio.
    stats.set_pool(
        info.n_ctx,
        engine.parallel(),
        engine.memory().pool_positions,
    );
    if let Some(t) = engine.expert_stats() {
        stats.set_expert_stats(&t);
    }
    let think_open_id = tokenizer.token_id("<think>");
    let think_close_id = tokenizer.token_id("</think>");
    let (close_tokens, close_short) = match think_close_id {
        Some(_) => (
            tokenizer
                .encode(worker::BUDGET_CLOSE_TEXT, true)
                .unwrap_or_default(),
            tokenizer.encode("\n</think>\n\n", true).unwrap_or_default(),
        ),
        None => (Vec::new(), Vec::new()),
    };
    let renderer: Arc<dyn prompt::PromptRender> = match &template {
        Some(t) => Arc::new(prompt::TemplateRenderer(t.clone())),
        None => Arc::new(prompt::ChatMl),
    };
    let worker = worker::Worker::spawn(Box::new(engine), stats)?;
    Ok(Loaded {
        core: gen::Core {
            worker,
            defaults,
            renderer,
            think_open_id,
            think_close_id,
            close_tokens,
            close_short,
            keepalive: gen::KEEPALIVE,
        },
        info,
        tokenizer,
        template,
    })
}

/// Loads the model named by `settings` (or the demo model), prints the startup
/// lines, and serves until the process is stopped.
pub fn run(settings: settings::Settings) -> Result<(), ServeError> {
    // An IP, or a name such as `localhost` (its first address).
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&(settings.host.as_str(), settings.port))
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| ServeError::Host(settings.host.clone()))?;
    let ip = addr.ip();
    eprintln!("scoria serve: {}", settings.summary());
    let cfg = engine::EngineConfig {
        threads: settings.threads,
        max_context: settings.max_context,
        parallel: settings.parallel,
        prompt_cache: settings.prompt_cache,
        prompt_cache_dir: settings.prompt_cache_dir.clone(),
        device: settings.device,
        vram_budget: settings.vram_budget,
        ram_budget: settings.ram_budget,
        expert_profile: settings.profile.clone(),
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .thread_name("scoria-http")
        .build()?;
    let result = rt.block_on(async move {
        // Listen first: while the model loads, /health answers "loading" (503) and
        // every other route 503, so supervisors and clients can tell loading from down.
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|err| ServeError::Bind {
                addr: addr.to_string(),
                err,
            })?;
        let bound = listener.local_addr().unwrap_or(addr);
        let ready: Arc<std::sync::OnceLock<Router>> = Arc::new(std::sync::OnceLock::new());
        let started = std::time::Instant::now();
        let gate = loading_gate(ready.clone(), started);
        let server = tokio::spawn(async move { axum::serve(listener, gate).await });
        eprintln!("scoria serve: listening on http://{bound} (loading the model; /health reports progress)");

        let model_setting = settings.model.clone();
        let (engine, demo) = tokio::task::spawn_blocking(move || {
            // The demo model is synthesized on first use (seconds), inside the loading phase.
            let (path, demo) = match model_setting {
                Some(p) => (p, false),
                None => (
                    model::synth::demo_model_path().map_err(|e| ServeError::Demo(e.to_string()))?,
                    true,
                ),
            };
            eprintln!(
                "scoria serve: loading {}{}",
                path.display(),
                if demo { " (embedded demo model)" } else { "" }
            );
            engine::Engine::load(&path, &cfg)
                .map(|e| (e, demo))
                .map_err(|err| ServeError::Load {
                    path: path.display().to_string(),
                    err,
                })
        })
        .await
        .map_err(|e| ServeError::Io(std::io::Error::other(e.to_string())))??;
        eprintln!("scoria serve: {}", device::line(&engine.device_report()));
        eprintln!("scoria serve: memory: {}", engine.memory().describe());
        let stats = Arc::new(metrics::Stats::new());
        let Loaded {
            core,
            info,
            tokenizer,
            template,
        } = core_for(engine, settings.defaults.clone(), stats.clone())?;
        let model_id = match (&settings.alias, demo) {
            (Some(a), _) => a.clone(),
            (None, true) => "scoria-demo".to_string(),
            (None, false) => info.name.clone(),
        };
        let label = if demo {
            " — DEMO: a tiny model trained for 7 minutes (models/demo.gguf): plausible text and code, not reliable answers"
        } else if info.synthetic {
            " — synthetic model (scoria synth, random weights); its output is noise"
        } else {
            ""
        };
        let state = Arc::new(
            AppState::new(
                stats,
                info.clone(),
                tokenizer,
                template.clone(),
                settings.to_json(),
                settings.api_key.clone(),
                model_id.clone(),
            )
            .with_cors(settings.cors_origins.clone())
            .with_core(core),
        );
        // The grammar compiler walks the whole vocabulary once: do it now, off the
        // runtime, rather than in the first structured-output request.
        let warm = state.clone();
        std::thread::spawn(move || {
            if let Err(e) = warm.grammar_compiler() {
                tracing::warn!("structured output is unavailable: {e}");
            }
        });
        eprintln!(
            "scoria serve: model \"{model_id}\" ({} {}, context {} of {} trained, template: {}){label}, loaded in {:.1}s",
            info.arch,
            info.name,
            info.n_ctx,
            info.n_ctx_train,
            if template.is_some() { "from the file" } else { "built-in ChatML" },
            started.elapsed().as_secs_f64(),
        );
        if settings.api_key.is_none() && !ip.is_loopback() {
            eprintln!("scoria serve: warning: listening on {ip} with no --api-key; anyone who can reach this port can use the model");
        }
        // The gate forwards everything to the full app from here on.
        let _ = ready.set(app(state));
        eprintln!(
            "scoria serve: ready on http://{bound} (OpenAI: /v1/chat/completions /v1/completions /v1/responses /v1/models; Anthropic: /v1/messages; /health /metrics /){}",
            if settings.api_key.is_some() { "; API key required" } else { "" }
        );
        // Stop at Ctrl-C or SIGTERM without waiting for open streams: a client still
        // reading sees its connection close, and the process exits promptly.
        tokio::select! {
            r = server => r.map_err(|e| std::io::Error::other(e.to_string()))??,
            _ = shutdown_signal() => eprintln!("scoria serve: stopping"),
        }
        Ok::<(), ServeError>(())
    });
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    result
}

/// The router served while the model loads: `/health` says "loading" (503) and
/// every other route answers 503; once `ready` holds the full app, every request
/// goes to it unchanged.
fn loading_gate(ready: Arc<std::sync::OnceLock<Router>>, started: std::time::Instant) -> Router {
    use tower::ServiceExt;
    Router::new().fallback(move |req: axum::extract::Request| {
        let ready = ready.clone();
        async move {
            if let Some(app) = ready.get() {
                return match app.clone().oneshot(req).await {
                    Ok(r) => r.into_response(),
                    Err(never) => match never {},
                };
            }
            let loading_for = started.elapsed().as_secs_f64();
            let path = req.uri().path();
            if path != "/health" {
                // In the shape of the API the path belongs to (Anthropic's on /v1/messages).
                return error::ApiError::unavailable(format!(
                    "the model is still loading ({loading_for:.0} s so far); retry when GET /health answers 200"
                ))
                .into_response_as(error::Flavor::of_path(path));
            }
            let body = serde_json::json!({"status": "loading", "loading_for_s": loading_for});
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
        }
    })
}

/// Resolves at Ctrl-C, or SIGTERM on Unix.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
