//! Operations endpoints: `/health`, `/props`, `/slots`, `/tokenize`,
//! `/detokenize`, `/apply-template`, `/metrics` (Prometheus text), `/stats.json`
//! and the stats page at `/`.
//!
//! Everything here reads [`AppState`]; nothing here decodes. The shapes follow
//! llama-server where it has the endpoint (so tools written for it work), with
//! scoria's own fields added beside them.

mod gpu;
mod template;

// Declared here (not in lib.rs) so the operations files stay one unit.
#[path = "stats_page.rs"]
mod stats_page;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use crate::AppState;

/// The operations routes; `lib.rs` merges them and applies the API key.
pub fn router() -> Router<Arc<AppState>> {
    Router::new()
        .route("/", get(stats_page::index))
        .route("/health", get(health))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .route("/metrics", get(metrics))
        .route("/stats.json", get(stats_json))
}

/// A 400 in the OpenAI error shape, naming the field at fault.
#[derive(Debug)]
pub(crate) struct BadRequest {
    message: String,
    param: Option<String>,
}

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": null,
        }});
        (StatusCode::BAD_REQUEST, Json(body)).into_response()
    }
}

pub(crate) fn bad_request(message: impl Into<String>, param: Option<&str>) -> BadRequest {
    BadRequest {
        message: message.into(),
        param: param.map(str::to_string),
    }
}

/// Parses a request body as a JSON object, or says why not.
fn parse_object(body: &Bytes) -> Result<Map<String, Value>, BadRequest> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(bad_request("the request body must be a JSON object", None)),
        Err(e) => Err(bad_request(
            format!("the request body is not valid JSON: {e}"),
            None,
        )),
    }
}

fn opt_bool(m: &Map<String, Value>, key: &str, default: bool) -> Result<bool, BadRequest> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad_request(format!("`{key}` must be a boolean"), Some(key))),
    }
}

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A setting's effective value from `AppState::settings`
/// (`{"server": {name: {"value": v, "source": s}}, "engine": {...}}`), found
/// in any section, under its hyphenated or underscored name; null values
/// count as unset.
fn setting<'a>(state: &'a AppState, name: &str) -> Option<&'a Value> {
    let alt = name.replace('-', "_");
    let sections = state.settings.as_object()?;
    sections.values().find_map(|sec| {
        let s = sec.get(name).or_else(|| sec.get(&alt))?;
        let v = s.get("value").unwrap_or(s);
        (!v.is_null()).then_some(v)
    })
}

fn setting_or(state: &AppState, name: &str, default: Value) -> Value {
    setting(state, name).cloned().unwrap_or(default)
}

/// The model as `/props` shows it (behind the key): with the file's path.
fn model_json(state: &AppState) -> Value {
    let mut m = public_model_json(state);
    m["path"] = json!(state.engine_info.path);
    m
}

/// The model as the unauthenticated `/health` shows it: what it is, not where it lives.
fn public_model_json(state: &AppState) -> Value {
    let info = &state.engine_info;
    json!({
        "id": state.model_id,
        "name": info.name,
        "arch": info.arch,
        "file_bytes": info.file_bytes,
        "n_ctx": info.n_ctx,
        "n_ctx_train": info.n_ctx_train,
        "n_vocab": info.n_vocab,
        "n_layer": info.n_layer,
        "n_embd": info.n_embd,
        "n_expert": info.n_expert,
        "n_expert_used": info.n_expert_used,
        "synthetic": info.synthetic,
    })
}

/// The `tool_choice` values the chat routes honour (each is tested to be accepted:
/// `http_tests::health_tells_the_truth_and_keeps_settings_behind_the_key`).
pub(crate) const TOOL_CHOICES: &[&str] = &["auto", "none", "required", "named"];

/// What the running build accepts: the sampling fields, the token budget
/// names, the thinking controls, and the tool-call format of the template.
/// `with_settings` adds the server's defaults (for `/props`, behind the key; the
/// unauthenticated `/health` does not show the settings).
fn capabilities(state: &AppState, with_settings: bool) -> Value {
    let tmpl = template::describe(state.template.as_deref());
    let mut caps = json!({
        "routes": [
            "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
            "/v1/messages/count_tokens", "/v1/models",
            "/health", "/props", "/slots", "/tokenize", "/detokenize", "/apply-template",
            "/metrics", "/stats.json", "/",
        ],
        "sampling": [
            "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
            "frequency_penalty", "repeat_penalty", "repeat_last_n", "logit_bias", "stop",
        ],
        "logprobs": "chat completions (logprobs, top_logprobs up to 20) and completions (logprobs up to 20), streamed or not: every generated token's log-probability under the model (before sampling settings, biases and grammar masks), the end-of-generation token excepted",
        "greedy": "temperature 0 decodes greedy (argmax, lowest id wins a tie); a request without temperature samples at the server's default temperature (greedy only when that default is 0)",
        "not_supported": {
            "n": "only n = 1",
            "logprobs": "not on /v1/messages and /v1/responses",
        },
        "token_budget_aliases": ["max_tokens", "max_completion_tokens", "max_output_tokens"],
        "reasoning": {
            "template_thinks": tmpl["thinks"],
            "controls": [
                "reasoning_effort", "enable_thinking", "chat_template_kwargs.enable_thinking",
                "max_thinking_tokens", "thinking_budget_tokens", "thinking_budget",
                "reasoning", "thinking", "output_config.effort",
            ],
            "reasoning_effort": crate::settings::EFFORTS,
            "split": "reasoning_content (chat), reasoning items (responses), thinking blocks (messages)",
        },
        "tools": {
            "accepted": true,
            "tool_call_format": tmpl["tool_call_format"],
            "tool_choice": TOOL_CHOICES,
        },
        "streaming": true,
        "images": state.takes_images(),
        "cancellation": "a client that disconnects is cancelled within one decode step",
        "queue": queue_note(state.stats.total_slots()),
    });
    if with_settings {
        caps["default_temperature"] = setting_or(state, "temp", Value::Null);
        caps["max_tokens_default"] = setting_or(state, "max-tokens-default", Value::Null);
        let r = &mut caps["reasoning"];
        r["default_effort"] = setting_or(state, "reasoning-effort", Value::Null);
        r["default_enable_thinking"] = setting_or(state, "enable-thinking", Value::Null);
        r["max_thinking_tokens_default"] = setting_or(state, "max-thinking-tokens", Value::Null);
        r["thinking_answer_room"] = setting_or(state, "thinking-answer-room", Value::Null);
    }
    caps
}

/// How requests share the engine, for `capabilities.queue`.
fn queue_note(slots: usize) -> String {
    if slots > 1 {
        format!(
            "up to {slots} requests decode at once, one slot each; others wait in arrival order"
        )
    } else {
        "one request decodes at a time; others wait in arrival order".to_string()
    }
}

/// `/health`: 200 `"ok"`; 503 `"degraded"` while the engine reports a standing
/// fault (`fault` says what and the remedy; see docs/server.md, Operations): the
/// process is up, but requests that need what the fault holds back fail, so a load
/// balancer should send them elsewhere until it answers 200 again; 503 `"unhealthy"`
/// once the executor failed for good (a lost device): the process is stopping, with a
/// non-zero exit status, for its supervisor to restart it. `warning` (null when
/// none) names a condition the server goes on serving with, slower or with some
/// requests failing (the GPU short of memory since another process took VRAM),
/// without changing the status.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let snap = state.stats.snapshot();
    let current = &snap["current"];
    let busy = !current.is_null();
    let (fault, status) = match (state.stats.fatal(), state.stats.fault()) {
        (Some(f), _) => (Some(f), "unhealthy"),
        (None, Some(f)) => (Some(f), "degraded"),
        (None, None) => (None, "ok"),
    };
    let code = if fault.is_some() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let body = json!({
        "status": status,
        "fault": fault,
        "warning": state.stats.warning(),
        "loading": false,
        "version": VERSION,
        "model": public_model_json(&state),
        "busy": busy,
        "busy_for_s": if busy {
            Value::from(current["elapsed_ms"].as_f64().unwrap_or(0.0) / 1000.0)
        } else {
            Value::Null
        },
        "in_flight": snap["live"].as_array().map_or(0, Vec::len),
        "queue_depth": snap["queue"]["depth"],
        "uptime_s": snap["uptime_s"],
        "capabilities": capabilities(&state, false),
    });
    (code, Json(body)).into_response()
}

async fn props(State(state): State<Arc<AppState>>) -> Response {
    let info = &state.engine_info;
    let tok = &state.tokenizer;
    let piece = |id: Option<u32>| {
        id.map(|i| String::from_utf8_lossy(&tok.token_to_piece(i)).into_owned())
            .unwrap_or_default()
    };
    let tmpl = template::describe(state.template.as_deref());
    let body = json!({
        "default_generation_settings": {
            "n_ctx": state.stats.ctx_per_slot(info.n_ctx),
            "params": {
                "temperature": setting_or(&state, "temp", Value::from(0.0)),
                "top_k": setting_or(&state, "top-k", Value::from(0)),
                "top_p": setting_or(&state, "top-p", Value::from(1.0)),
                "min_p": setting_or(&state, "min-p", Value::from(0.0)),
                "presence_penalty": setting_or(&state, "presence-penalty", Value::from(0.0)),
                "frequency_penalty": setting_or(&state, "frequency-penalty", Value::from(0.0)),
                "repeat_penalty": setting_or(&state, "repeat-penalty", Value::from(1.0)),
                "seed": setting_or(&state, "seed", Value::from(-1)),
                "n_predict": setting_or(&state, "max-tokens-default", Value::from(-1)),
            },
        },
        "total_slots": state.stats.total_slots(),
        "model_alias": state.model_id,
        "model_path": info.path,
        "modalities": {"vision": state.takes_images(), "audio": false},
        "endpoint_slots": true,
        "endpoint_props": false,
        "endpoint_metrics": true,
        "webui": true,
        "chat_template": tmpl["source"],
        "bos_token": piece(tok.bos_id()),
        "eos_token": piece(tok.eos_id()),
        "build_info": format!("scoria {VERSION}"),
        "model": model_json(&state),
        // Where model steps run and the device memory the engine holds (null until
        // the engine reports; tests of the routes alone have no engine).
        "device": state.stats.device().as_ref().map(crate::device::to_json),
        "chat_template_info": {
            "thinks": tmpl["thinks"],
            "tool_call_format": tmpl["tool_call_format"],
        },
        "capabilities": capabilities(&state, true),
        "settings": state.settings,
    });
    Json(body).into_response()
}

/// One object per slot in llama-server's shape (scoria adds `cached_tokens`,
/// `route`, `elapsed_ms` and the queue depth, the same on every slot).
async fn slots(State(state): State<Arc<AppState>>) -> Response {
    let depth = state.stats.queue_depth();
    let mut slots = state.stats.slots_json(state.engine_info.n_ctx);
    for s in &mut slots {
        s["queue_depth"] = Value::from(depth);
    }
    Json(Value::Array(slots)).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state.stats.render_prometheus(state.engine_info.n_ctx);
    let mut res = text.into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    res
}

async fn stats_json(State(state): State<Arc<AppState>>) -> Response {
    let mut snap = state.stats.snapshot();
    let gpu = gpu::snapshot().await;
    if let Some(obj) = snap.as_object_mut() {
        obj.insert("version".into(), Value::from(VERSION));
        obj.insert("model".into(), model_json(&state));
        // Context per slot and in all: the pool's when set, else the model's.
        let per_slot = state.stats.ctx_per_slot(state.engine_info.n_ctx);
        let total = state.stats.ctx_total(state.engine_info.n_ctx);
        if let Some(ctx) = obj.get_mut("context").and_then(Value::as_object_mut) {
            ctx.insert("per_slot".into(), Value::from(per_slot));
            ctx.insert("total".into(), Value::from(total));
        }
        if let Some(slots) = obj.get_mut("slots").and_then(Value::as_array_mut) {
            for s in slots.iter_mut().filter(|s| s["n_ctx"].is_null()) {
                s["n_ctx"] = Value::from(per_slot);
            }
        }
        obj.insert("gpu".into(), gpu);
    }
    let mut res = Json(snap).into_response();
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

/// `{content, add_special?, parse_special?, with_pieces?}` → `{tokens}`.
/// `add_special` adds BOS when the vocabulary asks for one; `parse_special`
/// (default true) turns control-token text into the control token.
async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Response, BadRequest> {
    let m = parse_object(&body)?;
    let content = match m.get("content") {
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(bad_request("`content` must be a string", Some("content"))),
        None => return Err(bad_request("`content` is required", Some("content"))),
    };
    let add_special = opt_bool(&m, "add_special", false)?;
    let parse_special = opt_bool(&m, "parse_special", true)?;
    let with_pieces = opt_bool(&m, "with_pieces", false)?;
    let tok = &state.tokenizer;
    let mut ids = Vec::new();
    if add_special && tok.add_bos() {
        if let Some(b) = tok.bos_id() {
            ids.push(b);
        }
    }
    let more = tok
        .encode(content, parse_special)
        .map_err(|e| bad_request(format!("cannot tokenize `content`: {e}"), Some("content")))?;
    ids.extend(more);
    let tokens: Vec<Value> = if with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = tok.token_to_piece(id);
                let piece = match String::from_utf8(bytes) {
                    Ok(s) => Value::from(s),
                    Err(e) => Value::from(e.into_bytes()),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| Value::from(id)).collect()
    };
    Ok(Json(json!({"tokens": tokens})).into_response())
}

/// `{tokens}` → `{content}` (control tokens kept, as llama-server does).
async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, BadRequest> {
    let m = parse_object(&body)?;
    let list = match m.get("tokens") {
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(bad_request(
                "`tokens` must be an array of token ids",
                Some("tokens"),
            ))
        }
        None => return Err(bad_request("`tokens` is required", Some("tokens"))),
    };
    let n_vocab = state.tokenizer.vocab_size();
    let mut ids = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        match v.as_u64() {
            Some(id) if (id as usize) < n_vocab => ids.push(id as u32),
            _ => {
                return Err(bad_request(
                    format!("`tokens[{i}]` = {v} is not a token id (0..{n_vocab})"),
                    Some("tokens"),
                ))
            }
        }
    }
    let content = state.tokenizer.decode(&ids, false);
    Ok(Json(json!({"content": content})).into_response())
}

/// `{messages, tools?, add_generation_prompt?, chat_template_kwargs?, ...}` →
/// `{prompt}`: the text the model would be given, without decoding.
async fn apply_template(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, BadRequest> {
    let m = parse_object(&body)?;
    let Some(tmpl) = state.template.as_deref() else {
        return Err(bad_request(
            "the model file has no chat template (tokenizer.chat_template)",
            None,
        ));
    };
    let prompt = template::render(tmpl, &m)?;
    Ok(Json(json!({"prompt": prompt})).into_response())
}

#[cfg(test)]
mod tests;
