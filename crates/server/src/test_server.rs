//! A server for the tests of the HTTP routes: the real Qwen3.5 tokenizer and a
//! scripted generator in place of the engine (the script is the text the "model"
//! generates, then end-of-turn), with the defaults, renderer, key, context and
//! settings a test chooses.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use crate::api_tests::{greedy, info, tokenizer};
use crate::gen::Core;
use crate::metrics::Stats;
use crate::prompt::{ChatMl, PromptRender};
use crate::settings::RequestDefaults;
use crate::worker::testing::Scripted;
use crate::worker::{Generator, Worker, BUDGET_CLOSE_TEXT};
use crate::AppState;

/// How a test server is built.
pub(crate) struct Setup {
    pub(crate) script: String,
    pub(crate) defaults: RequestDefaults,
    pub(crate) renderer: Arc<dyn PromptRender>,
    pub(crate) api_key: Option<String>,
    pub(crate) n_ctx: usize,
    pub(crate) settings: Value,
    /// The fake engine's vision encoder (None: it takes no images).
    pub(crate) vision: Option<model::vision::VisionConfig>,
    /// Where the generator records each request's prompt and images.
    pub(crate) seen: Option<Seen>,
    pub(crate) image_limits: crate::images::ImageLimits,
}

/// Each request's prompt tokens and images, as the generator received them.
pub(crate) type Seen = Arc<Mutex<Vec<(Vec<u32>, Vec<engine::PromptImage>)>>>;

/// The scripted generator, recording what it is asked.
struct Recording {
    inner: Scripted,
    seen: Seen,
}

impl Generator for Recording {
    fn generate(
        &mut self,
        req: &engine::GenerateRequest,
        on_prompt: &mut dyn FnMut(&engine::PromptProgress) -> engine::Flow,
        on_token: &mut dyn FnMut(&engine::TokenEvent) -> engine::Flow,
    ) -> Result<engine::Completion, String> {
        self.seen
            .lock()
            .unwrap()
            .push((req.prompt.clone(), req.images.clone()));
        self.inner.generate(req, on_prompt, on_token)
    }
}

impl Setup {
    pub(crate) fn new(script: &str) -> Setup {
        Setup {
            script: script.to_string(),
            defaults: greedy(),
            renderer: Arc::new(ChatMl),
            api_key: None,
            n_ctx: info().n_ctx,
            settings: json!({}),
            vision: None,
            seen: None,
            image_limits: Default::default(),
        }
    }

    pub(crate) fn state(self) -> AppState {
        let tok = tokenizer();
        let eog = tok.token_id("<|im_end|>").expect("im_end");
        let mut ids = tok.encode(&self.script, true).expect("encode");
        ids.push(eog);
        let stats = Arc::new(Stats::new());
        let scripted = Scripted { script: ids, eog };
        let generator: Box<dyn Generator> = match self.seen {
            Some(seen) => Box::new(Recording {
                inner: scripted,
                seen,
            }),
            None => Box::new(scripted),
        };
        let worker = Worker::spawn(generator, stats.clone()).expect("worker");
        let core = Core {
            worker,
            defaults: self.defaults,
            renderer: self.renderer,
            think_open_id: tok.token_id("<think>"),
            think_close_id: tok.token_id("</think>"),
            close_tokens: tok.encode(BUDGET_CLOSE_TEXT, true).expect("encode"),
            close_short: tok.encode("\n</think>\n\n", true).expect("encode"),
            keepalive: crate::gen::KEEPALIVE,
            backlog: crate::gen::BACKLOG,
            vision: self.vision,
            image_limits: self.image_limits,
        };
        let mut info = info();
        info.n_ctx = self.n_ctx;
        AppState::new(
            stats,
            info,
            tok,
            None,
            self.settings,
            self.api_key,
            "test-model".into(),
        )
        .with_core(core)
    }

    pub(crate) async fn serve(self) -> SocketAddr {
        serve_state(self.state()).await
    }
}

/// Serves `state` on a free loopback port.
pub(crate) async fn serve_state(state: AppState) -> SocketAddr {
    let state = Arc::new(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, crate::app(state)).await;
    });
    addr
}

/// `messages` with one user turn.
pub(crate) fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}
