//! Starting the server: the settings' engine loaded behind a port that is bound
//! first (`/health` answers `loading` until the model is in), the generation side
//! wired to the routes, the startup lines, and a graceful stop at Ctrl-C or SIGTERM:
//! no new connections, `--shutdown-grace` seconds for the requests still running,
//! then a final error event for each one left, the prompt cache's writes finished,
//! and exit status 0.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Router;

use crate::{app, device, error, gen, metrics, prompt, settings, worker, AppState};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Settings(#[from] settings::SettingsError),
    #[error("cannot use the demo model: {0}")]
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
    /// The executor failed for good while serving (a lost device): the server stopped.
    #[error("the executor failed and can run nothing more: {0}; restart the server")]
    Fatal(String),
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
    if let Some(c) = engine.expert_reads() {
        stats.set_expert_reads(c);
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
    let vision = engine.vision().cloned();
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
            backlog: gen::BACKLOG,
            vision,
            image_limits: Default::default(),
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
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&(
        settings.server.host.as_str(),
        settings.server.port,
    ))
    .ok()
    .and_then(|mut a| a.next())
    .ok_or_else(|| ServeError::Host(settings.server.host.clone()))?;
    let ip = addr.ip();
    eprintln!("scoria serve: {}", settings.summary());
    let cfg = settings.engine_config();
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
        let head_limit = Duration::from_secs(settings.server.read_timeout as u64);
        let ready: Arc<std::sync::OnceLock<Router>> = Arc::new(std::sync::OnceLock::new());
        let started = std::time::Instant::now();
        let gate = loading_gate(ready.clone(), started);
        // Stopping: set once a signal came; the listener closes, open connections
        // finish the response they are sending and close.
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let mut server = tokio::spawn(async move {
            crate::timeouts::serve(listener, gate, head_limit, async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            })
            .await
        });
        eprintln!("scoria serve: listening on http://{bound} (loading the model; /health reports progress)");

        let model_setting = settings.server.model.clone();
        let engine_settings = settings.engine.clone();
        let (engine, demo) = tokio::task::spawn_blocking(move || {
            let mut cfg = cfg;
            // Without --model, the trained demo model of the checkout (its hash checked).
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
                if demo { " (the demo model)" } else { "" }
            );
            if let Some(note) = engine_settings.choose_mmproj(&path, &mut cfg) {
                eprintln!("scoria serve: {note}");
            }
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
            mut core,
            info,
            tokenizer,
            template,
        } = core_for(engine, settings.defaults.clone(), stats.clone())?;
        core.image_limits = settings.engine.image_limits();
        if core.vision.is_some() {
            eprintln!("scoria serve: images: on (the vision encoder is loaded)");
        }
        let model_id = match (&settings.server.alias, demo) {
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
            .with_cors(settings.server.cors_origin.clone())
            .with_read_timeout(Duration::from_secs(settings.server.read_timeout as u64))
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
        let _ = ready.set(app(state.clone()));
        eprintln!(
            "scoria serve: ready on http://{bound} (OpenAI: /v1/chat/completions /v1/completions /v1/responses /v1/models; Anthropic: /v1/messages; /health /metrics /){}",
            if settings.api_key.is_some() { "; API key required" } else { "" }
        );
        let fatal = {
            let stats = state.stats.clone();
            async move {
                loop {
                    if let Some(f) = stats.fatal() {
                        return f;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        tokio::select! {
            r = &mut server => {
                r.map_err(|e| std::io::Error::other(e.to_string()))??;
                return Ok(());
            }
            _ = shutdown_signal() => {}
            f = fatal => {
                // The engine refuses every request now: stop at once (the requests'
                // final events go out) and exit non-zero for the supervisor.
                eprintln!("scoria serve: the executor failed and can run nothing more: {f}; stopping");
                stop(state, stop_tx, server, Duration::ZERO).await;
                return Err(ServeError::Fatal(f));
            }
        }
        let grace = Duration::from_secs(settings.server.shutdown_grace as u64);
        stop(state, stop_tx, server, grace).await;
        Ok::<(), ServeError>(())
    });
    rt.shutdown_timeout(std::time::Duration::from_millis(200));
    result
}

/// How long clients get to take the final events of requests ended at the grace
/// period's end, before their connections are dropped.
const FINAL_EVENTS: Duration = Duration::from_secs(5);

/// How long the engine gets to finish the prompt cache's writes.
const CACHE_WRITES: Duration = Duration::from_secs(30);

/// The graceful stop: refuse new connections, give the requests still running
/// `grace` to finish, end the ones left (each stream gets a final error event), wait
/// for the engine to finish the prompt cache's writes, and return.
async fn stop(
    state: Arc<AppState>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    mut server: tokio::task::JoinHandle<std::io::Result<()>>,
    grace: Duration,
) {
    let running = state.stats.live_count() + state.stats.queue_depth();
    eprintln!(
        "scoria serve: stopping: new connections are refused; {running} request(s) still running get {} s to finish (--shutdown-grace)",
        grace.as_secs()
    );
    let _ = stop_tx.send(true);
    if tokio::time::timeout(grace, &mut server).await.is_err() {
        let left = state.stats.live_count() + state.stats.queue_depth();
        eprintln!("scoria serve: stopping: the grace period is over; ending the {left} request(s) still running");
        if let Some(core) = &state.core {
            core.worker.end_requests();
        }
        if tokio::time::timeout(FINAL_EVENTS, &mut server)
            .await
            .is_err()
        {
            eprintln!(
                "scoria serve: stopping: closing the connections of clients that did not read their final events within {} s",
                FINAL_EVENTS.as_secs()
            );
            server.abort();
        }
    }
    let flushed = tokio::task::spawn_blocking(move || {
        state
            .core
            .as_ref()
            .is_none_or(|c| c.worker.stop(CACHE_WRITES))
    })
    .await
    .unwrap_or(false);
    if flushed {
        eprintln!("scoria serve: stopped");
    } else {
        eprintln!(
            "scoria serve: stopped; the prompt cache's writes did not finish within {} s and were abandoned (an entry is written whole or not at all)",
            CACHE_WRITES.as_secs()
        );
    }
}

/// The router served while the model loads: `/health` says "loading" (503) and
/// every other route answers 503; once `ready` holds the full app, every request
/// goes to it unchanged.
pub(crate) fn loading_gate(
    ready: Arc<std::sync::OnceLock<Router>>,
    started: std::time::Instant,
) -> Router {
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
