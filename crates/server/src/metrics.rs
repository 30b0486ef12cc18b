//! Live serving statistics: one `Stats` per server, fed by the request path
//! (queued → started → prompt progress → tokens → finished/failed) and read by
//! `/metrics` (Prometheus text), `/stats.json` and the stats page.
//!
//! Every update takes one short mutex section with no allocation on the token
//! path, so the decode loop never waits on a reader for long. Readers copy what
//! they need out under the lock and format outside it.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// How many finished requests the log keeps.
const LOG_LEN: usize = 100;

/// Shared serving statistics (interior mutability; share it behind an `Arc`).
pub struct Stats {
    started_at: Instant,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Requests waiting for the engine, in arrival order.
    queue: VecDeque<Queued>,
    /// The request being decoded, if any.
    current: Option<Current>,
    totals: Totals,
    /// Since the last Prometheus scrape (llama-server resets its throughput
    /// gauges on each scrape: the gauges are averages over that window).
    bucket: Bucket,
    /// Finished and failed requests, newest last.
    log: VecDeque<LogEntry>,
    /// Context used by the last finished request (the state kept for reuse).
    last_ctx_used: usize,
    last_prompt_tps: f64,
    last_decode_tps: f64,
    /// Latest expert-tier numbers (`{tier: {hit_rate, ...}}`), when the engine reports them.
    expert_tiers: Option<Value>,
    /// Where the engine runs and the device memory it holds (re-read after each request).
    device: Option<engine::DeviceReport>,
}

struct Queued {
    id: u64,
    route: String,
    at: Instant,
    at_unix_ms: u64,
}

struct Current {
    id: u64,
    route: String,
    queued_at_unix_ms: u64,
    queue_ms: f64,
    started: Instant,
    prompt_tokens: usize,
    prompt_done: usize,
    prompt_finished: Option<Instant>,
    tokens: usize,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

#[derive(Default, Clone)]
struct Totals {
    requests_by: BTreeMap<(String, String), u64>,
    /// Requests that ended in an error: a generation failure, or a 4xx/5xx answer.
    errors: u64,
    /// 4xx/5xx answers by (route, status).
    http_errors: BTreeMap<(String, u16), u64>,
    prompt_tokens: u64,
    prompt_seconds: f64,
    cache_tokens: u64,
    tokens_predicted: u64,
    tokens_predicted_seconds: f64,
    n_decode: u64,
    n_busy_slots: u64,
    n_tokens_max: u64,
    queue_max: usize,
    draft_proposed: u64,
    draft_accepted: u64,
}

#[derive(Default, Clone, Copy)]
struct Bucket {
    prompt_tokens: u64,
    prompt_ms: f64,
    tokens_predicted: u64,
    predicted_ms: f64,
}

#[derive(Clone)]
struct LogEntry {
    id: u64,
    route: String,
    finish: String,
    error: Option<String>,
    queued_at_unix_ms: u64,
    queue_ms: f64,
    prompt_n: usize,
    cache_n: usize,
    predicted_n: usize,
    prompt_ms: f64,
    predicted_ms: f64,
    n_ctx_used: usize,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn per_second(n: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

fn ms_between(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64() * 1000.0
}

impl Default for Stats {
    fn default() -> Self {
        Stats::new()
    }
}

impl Stats {
    pub fn new() -> Stats {
        Stats {
            started_at: Instant::now(),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain counters behind: still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request arrived and waits for the engine.
    pub fn request_queued(&self, id: u64, route: &str) {
        let mut g = self.lock();
        g.queue.push_back(Queued {
            id,
            route: route.to_string(),
            at: Instant::now(),
            at_unix_ms: unix_ms(),
        });
        let depth = g.queue.len();
        if depth > g.totals.queue_max {
            g.totals.queue_max = depth;
        }
    }

    /// The engine took request `id`; its prompt has `prompt_tokens` tokens.
    pub fn request_started(&self, id: u64, prompt_tokens: usize) {
        let now = Instant::now();
        let mut g = self.lock();
        let queued = g
            .queue
            .iter()
            .position(|q| q.id == id)
            .and_then(|i| g.queue.remove(i));
        let (route, queued_at_unix_ms, queue_ms) = match queued {
            Some(q) => (q.route, q.at_unix_ms, ms_between(q.at, now)),
            None => (String::from("?"), unix_ms(), 0.0),
        };
        g.current = Some(Current {
            id,
            route,
            queued_at_unix_ms,
            queue_ms,
            started: now,
            prompt_tokens,
            prompt_done: 0,
            prompt_finished: None,
            tokens: 0,
            first_token: None,
            last_token: None,
        });
    }

    /// `done` prompt tokens of request `id` have been evaluated so far.
    pub fn prompt_progress(&self, id: u64, done: usize) {
        let now = Instant::now();
        let mut g = self.lock();
        let mut decoded = false;
        if let Some(c) = g.current.as_mut().filter(|c| c.id == id) {
            if done > c.prompt_done {
                c.prompt_done = done;
                decoded = true;
            }
            if c.prompt_done >= c.prompt_tokens && c.prompt_finished.is_none() {
                c.prompt_finished = Some(now);
            }
        }
        if decoded {
            g.totals.n_decode += 1;
            g.totals.n_busy_slots += 1;
        }
    }

    /// Request `id` produced one more token.
    pub fn token_generated(&self, id: u64) {
        let now = Instant::now();
        let mut g = self.lock();
        let mut counted = false;
        if let Some(c) = g.current.as_mut().filter(|c| c.id == id) {
            if c.prompt_finished.is_none() {
                c.prompt_done = c.prompt_tokens;
                c.prompt_finished = Some(now);
            }
            c.tokens += 1;
            if c.first_token.is_none() {
                c.first_token = Some(now);
            }
            c.last_token = Some(now);
            counted = true;
        }
        if counted {
            g.totals.n_decode += 1;
            g.totals.n_busy_slots += 1;
        }
    }

    /// Request `id` ended (normally, by a stop, by length, or cancelled:
    /// `finish` says which). `n_ctx_used` is the context it occupied.
    pub fn request_finished(
        &self,
        id: u64,
        timings: &engine::Timings,
        finish: &str,
        n_ctx_used: usize,
    ) {
        let mut g = self.lock();
        let (route, queued_at_unix_ms, queue_ms) = g.take_request(id);
        let t = &mut g.totals;
        *t.requests_by
            .entry((route.clone(), finish.to_string()))
            .or_insert(0) += 1;
        t.prompt_tokens += timings.prompt_n as u64;
        t.prompt_seconds += timings.prompt_ms / 1000.0;
        t.cache_tokens += timings.cache_n as u64;
        t.tokens_predicted += timings.predicted_n as u64;
        t.tokens_predicted_seconds += timings.predicted_ms / 1000.0;
        let n_tokens = (timings.prompt_n + timings.predicted_n) as u64;
        if n_tokens > t.n_tokens_max {
            t.n_tokens_max = n_tokens;
        }
        g.bucket.prompt_tokens += timings.prompt_n as u64;
        g.bucket.prompt_ms += timings.prompt_ms;
        g.bucket.tokens_predicted += timings.predicted_n as u64;
        g.bucket.predicted_ms += timings.predicted_ms;
        g.last_ctx_used = n_ctx_used;
        if timings.prompt_n > 0 {
            g.last_prompt_tps = timings.prompt_per_second();
        }
        if timings.predicted_n > 0 {
            g.last_decode_tps = timings.predicted_per_second();
        }
        g.push_log(LogEntry {
            id,
            route,
            finish: finish.to_string(),
            error: None,
            queued_at_unix_ms,
            queue_ms,
            prompt_n: timings.prompt_n,
            cache_n: timings.cache_n,
            predicted_n: timings.predicted_n,
            prompt_ms: timings.prompt_ms,
            predicted_ms: timings.predicted_ms,
            n_ctx_used,
        });
    }

    /// Request `id` failed (while queued or while decoding). An `err` that
    /// starts with `cancelled` (the client went away) is recorded as a
    /// cancellation, not an error. Either way the prompt and tokens it had
    /// already decoded count in the totals: the work was done.
    pub fn request_failed(&self, id: u64, err: &str) {
        let now = Instant::now();
        let mut g = self.lock();
        let live = g.current.as_ref().filter(|c| c.id == id).map(|c| {
            let prompt_end = c.prompt_finished.unwrap_or(now);
            (
                c.prompt_done,
                c.tokens,
                ms_between(c.started, prompt_end),
                match c.last_token {
                    Some(last) => ms_between(prompt_end, last),
                    None => 0.0,
                },
            )
        });
        let (route, queued_at_unix_ms, queue_ms) = g.take_request(id);
        let cancelled = err.trim_start().to_ascii_lowercase().starts_with("cancel");
        let finish = if cancelled { "cancelled" } else { "error" };
        if !cancelled {
            g.totals.errors += 1;
        }
        *g.totals
            .requests_by
            .entry((route.clone(), finish.to_string()))
            .or_insert(0) += 1;
        let (prompt_n, predicted_n, prompt_ms, predicted_ms) = live.unwrap_or((0, 0, 0.0, 0.0));
        let t = &mut g.totals;
        t.prompt_tokens += prompt_n as u64;
        t.prompt_seconds += prompt_ms / 1000.0;
        t.tokens_predicted += predicted_n as u64;
        t.tokens_predicted_seconds += predicted_ms / 1000.0;
        g.bucket.prompt_tokens += prompt_n as u64;
        g.bucket.prompt_ms += prompt_ms;
        g.bucket.tokens_predicted += predicted_n as u64;
        g.bucket.predicted_ms += predicted_ms;
        if live.is_some() {
            g.last_ctx_used = prompt_n + predicted_n;
        }
        g.push_log(LogEntry {
            id,
            route,
            finish: finish.to_string(),
            error: Some(err.to_string()),
            queued_at_unix_ms,
            queue_ms,
            prompt_n,
            cache_n: 0,
            predicted_n,
            prompt_ms,
            predicted_ms,
            n_ctx_used: prompt_n + predicted_n,
        });
    }

    /// A request on `route` was answered with error `status` (4xx/5xx). `new_error`:
    /// count it in `errors_total` too (false when the worker already did, for a
    /// generation that failed).
    pub fn http_error(&self, route: &str, status: u16, new_error: bool) {
        let mut g = self.lock();
        *g.totals
            .http_errors
            .entry((route.to_string(), status))
            .or_insert(0) += 1;
        if new_error {
            g.totals.errors += 1;
        }
    }

    /// Speculative decoding: `proposed` draft tokens were checked, `accepted` kept.
    pub fn draft_checked(&self, _id: u64, proposed: usize, accepted: usize) {
        let mut g = self.lock();
        g.totals.draft_proposed += proposed as u64;
        g.totals.draft_accepted += accepted.min(proposed) as u64;
    }

    /// The expert store's per-tier numbers as the engine reports them, e.g.
    /// `{"vram": {"hit_rate": 0.91}, "ram": {"hit_rate": 0.08}}`.
    pub fn set_expert_tiers(&self, tiers: Value) {
        self.lock().expert_tiers = Some(tiers);
    }

    /// The tiered expert store's counters (at load, then after every request): each
    /// tier's share of expert uses (`hit_rate`, what the stats page shows), uses and
    /// bytes moved. `vram`: slot hits; `ram`: misses copied from the pinned copy;
    /// `cpu`: misses the CPU computed from RAM; `disk`: misses read from the file.
    pub fn set_expert_stats(&self, t: &engine::experts::TierStats) {
        let uses = t.uses().max(1) as f64;
        let tier = |n: u64, bytes: Option<u64>| {
            let mut v = json!({"hit_rate": n as f64 / uses, "uses": n});
            if let Some(b) = bytes {
                v["bytes"] = json!(b);
            }
            v
        };
        let mut disk = tier(t.disk_misses, Some(t.disk_bytes));
        disk["read_ms"] = json!(t.disk_ns as f64 / 1e6);
        self.set_expert_tiers(json!({
            "vram": tier(t.hits, None),
            "ram": tier(t.ram_misses, Some(t.ram_bytes)),
            "cpu": tier(t.cpu_misses, Some(t.cpu_bytes)),
            "disk": disk,
        }));
    }

    /// The engine's device report (at load, then after every request).
    pub fn set_device(&self, report: engine::DeviceReport) {
        self.lock().device = Some(report);
    }

    /// The latest device report, if the engine gave one.
    pub fn device(&self) -> Option<engine::DeviceReport> {
        self.lock().device.clone()
    }

    /// Requests waiting for the engine (not counting the one decoding).
    pub fn queue_depth(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether a request is being decoded now.
    pub fn busy(&self) -> bool {
        self.lock().current.is_some()
    }

    /// The live picture as JSON (what `/stats.json` serves; `ops` adds the
    /// model's context size and the GPU panel).
    pub fn snapshot(&self) -> Value {
        let now = Instant::now();
        let g = self.lock();
        let current = g.current.as_ref().map(|c| {
            let prompt_end = c.prompt_finished.unwrap_or(now);
            let prompt_ms = ms_between(c.started, prompt_end);
            let decode_ms = match c.first_token {
                Some(a) => ms_between(a, now),
                None => 0.0,
            };
            // The first token comes out of the prompt pass; speed counts the rest.
            let decode_tps = per_second(c.tokens.saturating_sub(1) as u64, decode_ms);
            json!({
                "id": c.id,
                "route": c.route,
                "state": if c.prompt_finished.is_some() { "decoding" } else { "prompt" },
                "queued_at_ms": c.queued_at_unix_ms,
                "queue_ms": round2(c.queue_ms),
                "elapsed_ms": round2(ms_between(c.started, now)),
                "prompt_tokens": c.prompt_tokens,
                "prompt_done": c.prompt_done,
                "prompt_ms": round2(prompt_ms),
                "prompt_per_second": round2(per_second(c.prompt_done as u64, prompt_ms)),
                "predicted_n": c.tokens,
                "predicted_ms": round2(decode_ms),
                "predicted_per_second": round2(decode_tps),
                "n_ctx_used": c.prompt_done + c.tokens,
            })
        });
        let (prompt_tps, decode_tps, ctx_used, live_tokens, live_prompt) = match &current {
            Some(c) => (
                c["prompt_per_second"].as_f64().unwrap_or(0.0),
                c["predicted_per_second"].as_f64().unwrap_or(0.0),
                c["n_ctx_used"].as_u64().unwrap_or(0),
                c["predicted_n"].as_u64().unwrap_or(0),
                c["prompt_done"].as_u64().unwrap_or(0),
            ),
            None => (
                g.last_prompt_tps,
                g.last_decode_tps,
                g.last_ctx_used as u64,
                0,
                0,
            ),
        };
        let t = &g.totals;
        let requests_total: u64 = t.requests_by.values().sum();
        let by_finish =
            t.requests_by
                .iter()
                .fold(BTreeMap::<&str, u64>::new(), |mut m, ((_, f), n)| {
                    *m.entry(f.as_str()).or_insert(0) += n;
                    m
                });
        let log: Vec<Value> = g.log.iter().rev().map(LogEntry::to_json).collect();
        json!({
            "now_ms": unix_ms(),
            "uptime_s": round2(self.started_at.elapsed().as_secs_f64()),
            "state": match &current {
                Some(c) => c["state"].clone(),
                None => Value::from("idle"),
            },
            "current": current,
            "speed": {
                "live": g.current.is_some(),
                "prompt_per_second": round2(prompt_tps),
                "predicted_per_second": round2(decode_tps),
            },
            "context": { "used": ctx_used },
            "queue": {
                "depth": g.queue.len(),
                "max": t.queue_max,
                "waiting": g.queue.iter().map(|q| json!({
                    "id": q.id,
                    "route": q.route,
                    "wait_ms": round2(ms_between(q.at, now)),
                })).collect::<Vec<_>>(),
            },
            "totals": {
                "requests": requests_total,
                "by_finish": by_finish,
                "errors": t.errors,
                "prompt_tokens": t.prompt_tokens + live_prompt,
                "prompt_seconds": round2(t.prompt_seconds),
                "cache_tokens": t.cache_tokens,
                "tokens_predicted": t.tokens_predicted + live_tokens,
                "tokens_predicted_seconds": round2(t.tokens_predicted_seconds),
                "n_decode": t.n_decode,
            },
            "requests": log,
            "draft": if t.draft_proposed > 0 {
                json!({
                    "proposed": t.draft_proposed,
                    "accepted": t.draft_accepted,
                    "accept_rate": t.draft_accepted as f64 / t.draft_proposed as f64,
                })
            } else {
                Value::Null
            },
            "experts": match &g.expert_tiers {
                Some(tiers) => json!({ "tiers": tiers }),
                None => Value::Null,
            },
            "device": g.device.as_ref().map(crate::device::to_json),
        })
    }

    /// Prometheus text exposition: llama-server's `llamacpp:*` metrics with
    /// their names, HELP and TYPE lines, then scoria's own `scoria:*`.
    /// `n_ctx` is the allocated context. Resets the throughput window, as
    /// llama-server does on each scrape.
    pub fn render_prometheus(&self, n_ctx: usize) -> String {
        let (t, bucket, busy, depth, ctx_used, live_tokens, device, tiers) = {
            let mut g = self.lock();
            let bucket = std::mem::take(&mut g.bucket);
            let ctx_used = match &g.current {
                Some(c) => c.prompt_done + c.tokens,
                None => g.last_ctx_used,
            };
            let live = g.current.as_ref().map(|c| c.tokens).unwrap_or(0);
            (
                g.totals.clone(),
                bucket,
                g.current.is_some(),
                g.queue.len(),
                ctx_used,
                live,
                g.device.clone(),
                g.expert_tiers.clone(),
            )
        };
        let mut out = String::with_capacity(4096);
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {}", fmt_value(value));
        };
        metric(
            "llamacpp:prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed.",
            t.prompt_tokens as f64,
        );
        metric(
            "llamacpp:prompt_seconds_total",
            "counter",
            "Prompt process time",
            t.prompt_seconds,
        );
        metric(
            "llamacpp:tokens_predicted_total",
            "counter",
            "Number of generation tokens processed.",
            t.tokens_predicted as f64,
        );
        metric(
            "llamacpp:tokens_predicted_seconds_total",
            "counter",
            "Predict process time",
            t.tokens_predicted_seconds,
        );
        metric(
            "llamacpp:n_decode_total",
            "counter",
            "Total number of llama_decode() calls",
            t.n_decode as f64,
        );
        metric(
            "llamacpp:n_tokens_max",
            "counter",
            "Largest observed n_tokens.",
            t.n_tokens_max as f64,
        );
        metric(
            "llamacpp:n_busy_slots_per_decode",
            "counter",
            "Average number of busy slots per llama_decode() call",
            if t.n_decode > 0 {
                t.n_busy_slots as f64 / t.n_decode as f64
            } else {
                0.0
            },
        );
        metric(
            "llamacpp:prompt_tokens_seconds",
            "gauge",
            "Average prompt throughput in tokens/s.",
            per_second(bucket.prompt_tokens, bucket.prompt_ms),
        );
        metric(
            "llamacpp:predicted_tokens_seconds",
            "gauge",
            "Average generation throughput in tokens/s.",
            per_second(bucket.tokens_predicted, bucket.predicted_ms),
        );
        metric(
            "llamacpp:kv_cache_usage_ratio",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            if n_ctx > 0 {
                ctx_used as f64 / n_ctx as f64
            } else {
                0.0
            },
        );
        metric(
            "llamacpp:kv_cache_tokens",
            "gauge",
            "KV-cache tokens.",
            ctx_used as f64,
        );
        metric(
            "llamacpp:requests_processing",
            "gauge",
            "Number of requests processing.",
            if busy { 1.0 } else { 0.0 },
        );
        metric(
            "llamacpp:requests_deferred",
            "gauge",
            "Number of requests deferred.",
            depth as f64,
        );

        // scoria's own.
        let _ = writeln!(
            out,
            "# HELP scoria:requests_total Requests ended, by route and finish reason."
        );
        let _ = writeln!(out, "# TYPE scoria:requests_total counter");
        for ((route, finish), n) in &t.requests_by {
            let _ = writeln!(
                out,
                "scoria:requests_total{{route=\"{}\",finish=\"{}\"}} {n}",
                escape_label(route),
                escape_label(finish)
            );
        }
        let _ = writeln!(
            out,
            "# HELP scoria:http_errors_total Requests answered with a 4xx/5xx status, by route and status."
        );
        let _ = writeln!(out, "# TYPE scoria:http_errors_total counter");
        for ((route, status), n) in &t.http_errors {
            let _ = writeln!(
                out,
                "scoria:http_errors_total{{route=\"{}\",status=\"{status}\"}} {n}",
                escape_label(route)
            );
        }
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {}", fmt_value(value));
        };
        metric(
            "scoria:errors_total",
            "counter",
            "Requests that ended in an error: answered with a 4xx/5xx status, or failed while streaming.",
            t.errors as f64,
        );
        metric(
            "scoria:queue_depth",
            "gauge",
            "Requests waiting for the engine.",
            depth as f64,
        );
        metric(
            "scoria:queue_depth_max",
            "gauge",
            "Largest queue depth seen since start.",
            t.queue_max as f64,
        );
        metric(
            "scoria:prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from the kept state instead of evaluated.",
            t.cache_tokens as f64,
        );
        metric(
            "scoria:draft_tokens_total",
            "counter",
            "Draft tokens proposed to speculative verification.",
            t.draft_proposed as f64,
        );
        metric(
            "scoria:draft_tokens_accepted_total",
            "counter",
            "Draft tokens accepted by verification.",
            t.draft_accepted as f64,
        );
        metric(
            "scoria:tokens_generating",
            "gauge",
            "Tokens generated so far by the request being decoded.",
            live_tokens as f64,
        );
        metric(
            "scoria:context_size",
            "gauge",
            "Context length allocated per sequence, in tokens.",
            n_ctx as f64,
        );
        metric(
            "scoria:uptime_seconds",
            "gauge",
            "Seconds since the server started.",
            self.started_at.elapsed().as_secs_f64(),
        );
        if let Some(d) = &device {
            // The engine's own account (what it allocated), beside nvidia-smi's
            // whole-device numbers on the stats page.
            if let Some(used) = d.vram_used {
                metric(
                    "scoria:device_memory_used_bytes",
                    "gauge",
                    "Device memory the engine holds (weights, state, scratch), as it reports it.",
                    used as f64,
                );
            }
            if let Some(total) = d.vram_total {
                metric(
                    "scoria:device_memory_total_bytes",
                    "gauge",
                    "Total memory of the device the engine runs on.",
                    total as f64,
                );
            }
            let _ = writeln!(
                out,
                "# HELP scoria:device_info Where model steps run (value 1; the labels say which device)."
            );
            let _ = writeln!(out, "# TYPE scoria:device_info gauge");
            let _ = writeln!(
                out,
                "scoria:device_info{{device=\"{}\",name=\"{}\"}} 1",
                escape_label(&d.device.to_string()),
                escape_label(&d.name)
            );
        }
        if let Some(tiers) = tiers.as_ref().and_then(Value::as_object) {
            for (name, help, field) in [
                (
                    "scoria:expert_uses_total",
                    "Routed expert uses by where the expert came from (vram: a slot hit; ram: copied from the pinned RAM copy; cpu: computed by the CPU from RAM; disk: read from the model file).",
                    "uses",
                ),
                (
                    "scoria:expert_miss_bytes_total",
                    "Bytes of expert weights moved for misses, by tier.",
                    "bytes",
                ),
            ] {
                let rows: Vec<(&String, f64)> = tiers
                    .iter()
                    .filter_map(|(tier, v)| Some((tier, v.get(field)?.as_f64()?)))
                    .collect();
                if rows.is_empty() {
                    continue;
                }
                let _ = writeln!(out, "# HELP {name} {help}");
                let _ = writeln!(out, "# TYPE {name} counter");
                for (tier, v) in rows {
                    let _ = writeln!(
                        out,
                        "{name}{{tier=\"{}\"}} {}",
                        escape_label(tier),
                        fmt_value(v)
                    );
                }
            }
        }
        out
    }
}

impl Inner {
    /// Removes request `id` from the queue or the current slot; returns its
    /// route, arrival time and queue wait.
    fn take_request(&mut self, id: u64) -> (String, u64, f64) {
        let now = Instant::now();
        if self.current.as_ref().is_some_and(|c| c.id == id) {
            if let Some(c) = self.current.take() {
                return (c.route, c.queued_at_unix_ms, c.queue_ms);
            }
        }
        if let Some(i) = self.queue.iter().position(|q| q.id == id) {
            if let Some(q) = self.queue.remove(i) {
                return (q.route, q.at_unix_ms, ms_between(q.at, now));
            }
        }
        (String::from("?"), unix_ms(), 0.0)
    }

    fn push_log(&mut self, e: LogEntry) {
        if self.log.len() >= LOG_LEN {
            self.log.pop_front();
        }
        self.log.push_back(e);
    }
}

impl LogEntry {
    fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "route": self.route,
            "finish": self.finish,
            "error": self.error,
            "queued_at_ms": self.queued_at_unix_ms,
            "queue_ms": round2(self.queue_ms),
            "timings": {
                "cache_n": self.cache_n,
                "prompt_n": self.prompt_n,
                "prompt_ms": round2(self.prompt_ms),
                "prompt_per_second": round2(per_second(self.prompt_n as u64, self.prompt_ms)),
                "predicted_n": self.predicted_n,
                "predicted_ms": round2(self.predicted_ms),
                "predicted_per_second":
                    round2(per_second(self.predicted_n as u64, self.predicted_ms)),
            },
            "n_ctx_used": self.n_ctx_used,
        })
    }
}

fn round2(x: f64) -> f64 {
    if x.is_finite() {
        (x * 100.0).round() / 100.0
    } else {
        0.0
    }
}

/// Prometheus sample value: integers without a fraction, others as Rust prints them.
fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        return "0".to_string();
    }
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timings(prompt_n: usize, predicted_n: usize) -> engine::Timings {
        engine::Timings {
            prompt_n,
            prompt_ms: 100.0,
            predicted_n,
            predicted_ms: 200.0,
            cache_n: 3,
        }
    }

    #[test]
    fn lifecycle_updates_queue_current_and_totals() {
        let s = Stats::new();
        s.request_queued(1, "chat");
        s.request_queued(2, "messages");
        assert_eq!(s.queue_depth(), 2);
        s.request_started(1, 10);
        assert_eq!(s.queue_depth(), 1);
        s.prompt_progress(1, 10);
        s.token_generated(1);
        s.token_generated(1);
        let snap = s.snapshot();
        assert_eq!(snap["state"], "decoding");
        assert_eq!(snap["current"]["predicted_n"], 2);
        assert_eq!(snap["current"]["n_ctx_used"], 12);
        assert_eq!(snap["totals"]["tokens_predicted"], 2);
        assert_eq!(snap["queue"]["depth"], 1);
        s.request_finished(1, &timings(10, 2), "stop", 12);
        s.request_failed(2, "boom");
        let snap = s.snapshot();
        assert_eq!(snap["state"], "idle");
        assert_eq!(snap["queue"]["depth"], 0);
        assert_eq!(snap["totals"]["requests"], 2);
        assert_eq!(snap["totals"]["errors"], 1);
        assert_eq!(snap["totals"]["tokens_predicted"], 2);
        assert_eq!(snap["requests"][0]["id"], 2);
        assert_eq!(snap["requests"][0]["error"], "boom");
        assert_eq!(snap["requests"][1]["route"], "chat");
        assert_eq!(snap["requests"][1]["timings"]["predicted_per_second"], 10.0);
    }

    #[test]
    fn prometheus_text_has_help_type_and_values() {
        let s = Stats::new();
        s.request_queued(7, "chat");
        s.request_started(7, 4);
        s.token_generated(7);
        s.request_finished(7, &timings(4, 1), "length", 5);
        let text = s.render_prometheus(100);
        assert!(text.contains("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 4\n"));
        assert!(text.contains("llamacpp:kv_cache_usage_ratio 0.05\n"));
        assert!(text.contains("scoria:requests_total{route=\"chat\",finish=\"length\"} 1\n"));
        assert!(text.contains("scoria:prompt_tokens_cached_total 3\n"));
        assert!(text.contains("llamacpp:prompt_tokens_seconds 40\n"));
        // The throughput window resets on each scrape.
        let again = s.render_prometheus(100);
        assert!(again.contains("llamacpp:prompt_tokens_seconds 0\n"));
        // Every sample line belongs to a declared metric.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            assert!(text.contains(&format!("# TYPE {name} ")), "{line}");
        }
    }

    #[test]
    fn draft_and_expert_numbers_appear_when_reported() {
        let s = Stats::new();
        assert!(s.snapshot()["draft"].is_null());
        s.draft_checked(1, 10, 7);
        s.set_expert_tiers(json!({"vram": {"hit_rate": 0.5}}));
        let snap = s.snapshot();
        assert_eq!(snap["draft"]["accept_rate"], 0.7);
        assert_eq!(snap["experts"]["tiers"]["vram"]["hit_rate"], 0.5);
        assert!(s
            .render_prometheus(10)
            .contains("scoria:draft_tokens_accepted_total 7\n"));
    }

    #[test]
    fn cancelled_requests_keep_their_work_and_are_not_errors() {
        let s = Stats::new();
        s.request_queued(3, "chat");
        s.request_started(3, 5);
        s.prompt_progress(3, 5);
        s.token_generated(3);
        s.token_generated(3);
        s.request_failed(3, "cancelled: the client disconnected");
        let snap = s.snapshot();
        assert_eq!(snap["totals"]["errors"], 0);
        assert_eq!(snap["totals"]["tokens_predicted"], 2);
        assert_eq!(snap["totals"]["prompt_tokens"], 5);
        assert_eq!(snap["requests"][0]["finish"], "cancelled");
        assert_eq!(snap["requests"][0]["n_ctx_used"], 7);
        s.request_queued(4, "chat");
        s.request_failed(4, "prompt too long");
        assert_eq!(s.snapshot()["totals"]["errors"], 1);
        let text = s.render_prometheus(10);
        assert!(text.contains("finish=\"cancelled\"} 1"));
        assert!(text.contains("finish=\"error\"} 1"));
    }

    #[test]
    fn tiered_expert_counters_reach_metrics_and_the_snapshot() {
        let s = Stats::new();
        assert!(!s.render_prometheus(10).contains("scoria:expert"));
        s.set_expert_stats(&engine::experts::TierStats {
            hits: 60,
            ram_misses: 20,
            ram_bytes: 2000,
            disk_misses: 5,
            disk_bytes: 500,
            cpu_misses: 15,
            cpu_bytes: 1500,
            disk_ns: 3_000_000,
        });
        let text = s.render_prometheus(10);
        assert!(
            text.contains("# TYPE scoria:expert_uses_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("scoria:expert_uses_total{tier=\"vram\"} 60\n"),
            "{text}"
        );
        assert!(
            text.contains("scoria:expert_uses_total{tier=\"cpu\"} 15\n"),
            "{text}"
        );
        assert!(
            text.contains("scoria:expert_miss_bytes_total{tier=\"disk\"} 500\n"),
            "{text}"
        );
        assert!(
            !text.contains("expert_miss_bytes_total{tier=\"vram\"}"),
            "{text}"
        );
        let snap = s.snapshot();
        assert_eq!(snap["experts"]["tiers"]["vram"]["hit_rate"], 0.6);
        assert_eq!(snap["experts"]["tiers"]["disk"]["read_ms"], 3.0);
    }

    #[test]
    fn device_memory_is_exported_when_known() {
        let s = Stats::new();
        assert!(s.snapshot()["device"].is_null());
        assert!(!s.render_prometheus(10).contains("scoria:device"));
        s.set_device(engine::DeviceReport {
            device: engine::Device::Cpu,
            name: "cpu (avx2)".into(),
            vram_used: None,
            vram_total: None,
        });
        let text = s.render_prometheus(10);
        assert!(!text.contains("scoria:device_memory"), "{text}");
        assert!(text.contains("scoria:device_info{device=\"cpu\",name=\"cpu (avx2)\"} 1\n"));
        s.set_device(engine::DeviceReport {
            device: engine::Device::Cuda(0),
            name: "NVIDIA \"H200\"".into(),
            vram_used: Some(21_000_000_000),
            vram_total: Some(150_000_000_000),
        });
        let text = s.render_prometheus(10);
        assert!(text.contains("# TYPE scoria:device_memory_used_bytes gauge\nscoria:device_memory_used_bytes 21000000000\n"), "{text}");
        assert!(text.contains("scoria:device_memory_total_bytes 150000000000\n"));
        assert!(text.contains("name=\"NVIDIA \\\"H200\\\"\"} 1"), "{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or("");
            assert!(text.contains(&format!("# TYPE {name} ")), "{line}");
        }
        let snap = s.snapshot();
        assert_eq!(snap["device"]["device"], "cuda:0");
        assert_eq!(snap["device"]["vram_used_bytes"], 21_000_000_000u64);
        assert_eq!(s.device().map(|d| d.device), Some(engine::Device::Cuda(0)));
    }

    #[test]
    fn unknown_ids_are_harmless() {
        let s = Stats::new();
        s.prompt_progress(9, 3);
        s.token_generated(9);
        s.request_finished(9, &timings(1, 1), "stop", 2);
        assert_eq!(s.snapshot()["totals"]["requests"], 1);
    }
}
