//! Live serving statistics: one `Stats` per server, fed by the request path
//! (queued → started → prompt progress → tokens → finished/failed, for any
//! number of requests at once, interleaved) and by the engine loop (one
//! `engine_step` per decode call, `set_slots` with the slot pool), and read by
//! `/metrics` (Prometheus text), `/slots`, `/stats.json` and the stats page.
//!
//! Every update takes one short mutex section with no allocation on the token
//! path, so the decode loop never waits on a reader for long. Readers copy what
//! they need out under the lock and format outside it.

use std::collections::{BTreeMap, VecDeque};
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

/// One engine slot as the statistics see it; the worker converts the engine's
/// slot list to these after each step (or whenever the pool changes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotView {
    /// The slot's index in the pool (0-based).
    pub id: usize,
    /// Whether a request is decoding in it.
    pub busy: bool,
    /// Positions the slot holds: the state kept for reuse when idle, the
    /// reused prefix or the current fill when busy (the larger of this and the
    /// live request's own count is shown).
    pub cached_tokens: usize,
    /// The live request in this slot (its id from `request_queued`).
    pub request: Option<u64>,
}

/// The slot pool's shape: context per slot, number of slots, and the
/// positions they share (the KV usage ratio's denominator).
#[derive(Clone, Copy)]
struct Pool {
    n_ctx_per_slot: usize,
    total_slots: usize,
    positions: usize,
}

#[derive(Default)]
struct Inner {
    /// Requests waiting for the engine, in arrival order.
    queue: VecDeque<Queued>,
    /// The requests being decoded, in arrival order (oldest first).
    live: Vec<Live>,
    /// The engine's slot list, once the worker reports it (`None`: one slot,
    /// or `pool.total_slots` slots filled in arrival order).
    slots: Option<Vec<SlotView>>,
    pool: Option<Pool>,
    /// Whether the worker reports decode calls itself (`engine_step`). Until it
    /// does, each prompt chunk and each token counts as one decode call with
    /// one busy slot, which is what a one-request-at-a-time worker does.
    stepped: bool,
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
    /// How prompts were served from cached state (the engine's report).
    cache: Option<engine::CacheReport>,
    /// Where the engine runs and the device memory it holds (re-read after each request).
    device: Option<engine::DeviceReport>,
    /// What the reads of experts from the model file have done, when it is read.
    expert_reads: Option<engine::experts::ReadCounters>,
    /// The engine's standing fault (`Engine::standing_fault`), in words.
    fault: Option<String>,
    /// The engine's standing warning (`Engine::standing_warning`), in words.
    warning: Option<String>,
    /// The executor's failure for good (`Engine::fatal`): the process must restart.
    fatal: Option<String>,
}

struct Queued {
    id: u64,
    route: String,
    at: Instant,
    at_unix_ms: u64,
}

struct Live {
    id: u64,
    route: String,
    /// When it arrived (queued), for arrival order.
    arrived: Instant,
    /// The slot the engine gave it (`request_slot`).
    slot: Option<usize>,
    queued_at_unix_ms: u64,
    queue_ms: f64,
    started: Instant,
    prompt_tokens: usize,
    /// Of the prompt, tokens reused from cached state (`request_cached`).
    cached: usize,
    prompt_done: usize,
    prompt_finished: Option<Instant>,
    tokens: usize,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

impl Live {
    /// Context positions the request occupies so far.
    fn ctx_used(&self) -> usize {
        self.prompt_done + self.tokens
    }

    /// Prompt speed so far (or over the whole prompt once it is read).
    fn prompt_tps(&self, now: Instant) -> f64 {
        let end = self.prompt_finished.unwrap_or(now);
        per_second(self.prompt_done as u64, ms_between(self.started, end))
    }

    /// Decode speed since the first token. The first token comes out of the
    /// prompt pass; speed counts the rest.
    fn decode_tps(&self, now: Instant) -> f64 {
        match self.first_token {
            Some(a) => per_second(self.tokens.saturating_sub(1) as u64, ms_between(a, now)),
            None => 0.0,
        }
    }

    fn state(&self) -> &'static str {
        if self.prompt_finished.is_some() {
            "decoding"
        } else {
            "prompt"
        }
    }

    fn to_json(&self, now: Instant, slot: Option<usize>) -> Value {
        let prompt_end = self.prompt_finished.unwrap_or(now);
        let decode_ms = match self.first_token {
            Some(a) => ms_between(a, now),
            None => 0.0,
        };
        json!({
            "id": self.id,
            "route": self.route,
            "slot": slot,
            "state": self.state(),
            "queued_at_ms": self.queued_at_unix_ms,
            "queue_ms": round2(self.queue_ms),
            "elapsed_ms": round2(ms_between(self.started, now)),
            "prompt_tokens": self.prompt_tokens,
            "prompt_done": self.prompt_done,
            "prompt_ms": round2(ms_between(self.started, prompt_end)),
            "prompt_per_second": round2(self.prompt_tps(now)),
            "predicted_n": self.tokens,
            "predicted_ms": round2(decode_ms),
            "predicted_per_second": round2(self.decode_tps(now)),
            "n_ctx_used": self.ctx_used(),
        })
    }
}

/// One slot as the readers show it (computed under the lock, no formatting).
struct SlotRow {
    id: usize,
    busy: bool,
    cached_tokens: usize,
    /// Index into `Inner::live`.
    live: Option<usize>,
    /// The live request's id when the engine names one not (or no longer) live.
    task: Option<u64>,
    n_ctx_used: usize,
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
    /// Decode calls (engine steps), and the busy slots summed over them.
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

    /// The engine took request `id` (into a slot); its prompt has
    /// `prompt_tokens` tokens. Any number of requests may be live at once.
    pub fn request_started(&self, id: u64, prompt_tokens: usize) {
        let now = Instant::now();
        let mut g = self.lock();
        let queued = g
            .queue
            .iter()
            .position(|q| q.id == id)
            .and_then(|i| g.queue.remove(i));
        let (route, arrived, queued_at_unix_ms, queue_ms) = match queued {
            Some(q) => (q.route, q.at, q.at_unix_ms, ms_between(q.at, now)),
            None => (String::from("?"), now, unix_ms(), 0.0),
        };
        // Started twice: the second start wins (one entry per id).
        g.live.retain(|c| c.id != id);
        let at = g.live.partition_point(|c| c.arrived <= arrived);
        g.live.insert(
            at,
            Live {
                id,
                route,
                arrived,
                slot: None,
                queued_at_unix_ms,
                queue_ms,
                started: now,
                prompt_tokens,
                cached: 0,
                prompt_done: 0,
                prompt_finished: None,
                tokens: 0,
                first_token: None,
                last_token: None,
            },
        );
    }

    /// Request `id` took slot `slot` (the engine's `RequestCallbacks::admitted`). A busy
    /// slot in `set_slots` without a request id is linked to the live request
    /// that took it; without a slot list, requests show in their own slots.
    pub fn request_slot(&self, id: u64, slot: usize) {
        if let Some(c) = self.lock().live_mut(id) {
            c.slot = Some(slot);
        }
    }

    /// Request `id` reuses `cached` of its prompt tokens from cached state (the
    /// engine's `RequestCallbacks::admitted`): counted in
    /// `prompt_tokens_cached_total` however the request ends.
    pub fn request_cached(&self, id: u64, cached: usize) {
        if let Some(c) = self.lock().live_mut(id) {
            c.cached = cached;
        }
    }

    /// `done` prompt tokens of request `id` have been evaluated so far.
    pub fn prompt_progress(&self, id: u64, done: usize) {
        let now = Instant::now();
        let mut g = self.lock();
        let mut decoded = false;
        if let Some(c) = g.live_mut(id) {
            if done > c.prompt_done {
                c.prompt_done = done;
                decoded = true;
            }
            if c.prompt_done >= c.prompt_tokens && c.prompt_finished.is_none() {
                c.prompt_finished = Some(now);
            }
        }
        if decoded && !g.stepped {
            g.totals.n_decode += 1;
            g.totals.n_busy_slots += 1;
        }
    }

    /// Request `id` produced one more token.
    pub fn token_generated(&self, id: u64) {
        let now = Instant::now();
        let mut g = self.lock();
        let mut counted = false;
        if let Some(c) = g.live_mut(id) {
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
        if counted && !g.stepped {
            g.totals.n_decode += 1;
            g.totals.n_busy_slots += 1;
        }
    }

    /// The engine made one decode call (one step) with `busy_slots` slots in
    /// it: `n_decode` grows by 1 and `n_busy_slots` by `busy_slots`, as
    /// llama-server counts them. Once called, prompt chunks and tokens no
    /// longer count as decode calls of their own.
    pub fn engine_step(&self, busy_slots: usize) {
        let mut g = self.lock();
        g.stepped = true;
        g.totals.n_decode += 1;
        g.totals.n_busy_slots += busy_slots as u64;
    }

    /// The engine's slots, in pool order (after each step, or when they
    /// change). Before the first call the readers show one slot (or
    /// `set_pool`'s count, filled by the live requests in arrival order).
    pub fn set_slots(&self, slots: Vec<SlotView>) {
        self.lock().slots = Some(slots);
    }

    /// The pool's shape (at load): `total_slots` slots, each up to
    /// `n_ctx_per_slot` positions, sharing `positions` positions in all (the
    /// engine's context pool; `total_slots × n_ctx_per_slot` where each slot
    /// has its own). `/props` `total_slots`, the KV usage ratio and the stats
    /// page's context total follow it.
    pub fn set_pool(&self, n_ctx_per_slot: usize, total_slots: usize, positions: usize) {
        self.lock().pool = Some(Pool {
            n_ctx_per_slot,
            total_slots: total_slots.max(1),
            positions,
        });
    }

    /// Positions all slots can hold together: `set_pool`'s, else slots × `n_ctx`.
    pub fn ctx_total(&self, n_ctx: usize) -> usize {
        let g = self.lock();
        g.pool.map_or(g.n_slots() * n_ctx, |p| p.positions)
    }

    /// Slots in the pool: `set_pool`'s count, else the length of the last
    /// slot list, else 1.
    pub fn total_slots(&self) -> usize {
        self.lock().n_slots()
    }

    /// Context positions per slot: `set_pool`'s, else `n_ctx` (the model's).
    pub fn ctx_per_slot(&self, n_ctx: usize) -> usize {
        self.lock().pool.map_or(n_ctx, |p| p.n_ctx_per_slot)
    }

    /// Requests being decoded now.
    pub fn live_count(&self) -> usize {
        self.lock().live.len()
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
        t.draft_proposed += timings.draft_n as u64;
        t.draft_accepted += timings.draft_n_accepted.min(timings.draft_n) as u64;
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
    /// cancellation, not an error. Either way the prompt tokens it had evaluated,
    /// those it reused from cached state and the tokens it had generated count in
    /// the totals: the work was done.
    pub fn request_failed(&self, id: u64, err: &str) {
        let now = Instant::now();
        let mut g = self.lock();
        let live = g.live.iter().find(|c| c.id == id).map(|c| {
            let prompt_end = c.prompt_finished.unwrap_or(now);
            (
                c.prompt_done.saturating_sub(c.cached),
                c.cached,
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
        let (prompt_n, cache_n, predicted_n, prompt_ms, predicted_ms) =
            live.unwrap_or((0, 0, 0, 0.0, 0.0));
        let t = &mut g.totals;
        t.prompt_tokens += prompt_n as u64;
        t.cache_tokens += cache_n as u64;
        t.prompt_seconds += prompt_ms / 1000.0;
        t.tokens_predicted += predicted_n as u64;
        t.tokens_predicted_seconds += predicted_ms / 1000.0;
        g.bucket.prompt_tokens += prompt_n as u64;
        g.bucket.prompt_ms += prompt_ms;
        g.bucket.tokens_predicted += predicted_n as u64;
        g.bucket.predicted_ms += predicted_ms;
        if live.is_some() {
            g.last_ctx_used = prompt_n + cache_n + predicted_n;
        }
        g.push_log(LogEntry {
            id,
            route,
            finish: finish.to_string(),
            error: Some(err.to_string()),
            queued_at_unix_ms,
            queue_ms,
            prompt_n,
            cache_n,
            predicted_n,
            prompt_ms,
            predicted_ms,
            n_ctx_used: prompt_n + cache_n + predicted_n,
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
    /// The engine's prompt-cache report (slot reuse, the conversation store).
    pub fn set_cache_report(&self, report: engine::CacheReport) {
        self.lock().cache = Some(report);
    }

    pub fn set_expert_tiers(&self, tiers: Value) {
        self.lock().expert_tiers = Some(tiers);
    }

    /// The tiered expert store's counters (at load, then after every request), in
    /// the shape of [`expert_tiers`].
    pub fn set_expert_stats(&self, t: &engine::experts::TierStats) {
        self.set_expert_tiers(expert_tiers(t));
    }

    /// The engine's device report (at load, then after every request).
    pub fn set_device(&self, report: engine::DeviceReport) {
        self.lock().device = Some(report);
    }

    /// The engine's counters of expert reads from the model file.
    pub fn set_expert_reads(&self, c: engine::experts::ReadCounters) {
        self.lock().expert_reads = Some(c);
    }

    /// The engine's standing fault now (None: healthy); logged when it appears
    /// and when it clears.
    pub fn set_fault(&self, fault: Option<String>) {
        let mut g = self.lock();
        match (&g.fault, &fault) {
            (None, Some(f)) => tracing::error!("health: degraded: {f}"),
            (Some(_), None) => tracing::info!("health: the fault has cleared; ok again"),
            _ => {}
        }
        g.fault = fault;
    }

    /// The engine's standing fault, if one was reported.
    pub fn fault(&self) -> Option<String> {
        self.lock().fault.clone()
    }

    /// The engine's standing warning now (None: none): the server serves, but
    /// slower or with some requests failing (the GPU short of memory); logged when
    /// it appears and when it clears.
    pub fn set_warning(&self, warning: Option<String>) {
        let mut g = self.lock();
        match (&g.warning, &warning) {
            (None, Some(w)) => tracing::warn!("health: warning: {w}"),
            (Some(_), None) => tracing::info!("health: the warning has cleared"),
            _ => {}
        }
        g.warning = warning;
    }

    /// The engine's standing warning, if one was reported.
    pub fn warning(&self) -> Option<String> {
        self.lock().warning.clone()
    }

    /// The executor failed for good (`Engine::fatal`); logged once. It never clears.
    pub fn set_fatal(&self, fatal: String) {
        let mut g = self.lock();
        if g.fatal.is_none() {
            tracing::error!("health: unhealthy: {fatal}");
            g.fatal = Some(fatal);
        }
    }

    /// The executor's failure for good, once one happened.
    pub fn fatal(&self) -> Option<String> {
        self.lock().fatal.clone()
    }

    /// The latest device report, if the engine gave one.
    pub fn device(&self) -> Option<engine::DeviceReport> {
        self.lock().device.clone()
    }

    /// Requests waiting for the engine (not counting those decoding).
    pub fn queue_depth(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether any request is being decoded now.
    pub fn busy(&self) -> bool {
        !self.lock().live.is_empty()
    }

    /// The slots in llama-server's `/slots` shape (`id`, `n_ctx`,
    /// `is_processing`, `id_task`, `state`, `n_prompt_tokens`,
    /// `n_prompt_tokens_processed`, `n_decoded`, `n_ctx_used`) with scoria's
    /// `cached_tokens`, `route` and `elapsed_ms` beside them. `n_ctx`: the
    /// model's context, used per slot until `set_pool` says otherwise.
    pub fn slots_json(&self, n_ctx: usize) -> Vec<Value> {
        let now = Instant::now();
        let g = self.lock();
        g.slots_json(now, g.pool.map_or(n_ctx, |p| p.n_ctx_per_slot))
    }

    /// The live picture as JSON (what `/stats.json` serves; `ops` adds the
    /// model's context size and the GPU panel). `current` is the oldest live
    /// request, `live` every live request (with its `slot`), `slots` the pool.
    pub fn snapshot(&self) -> Value {
        let now = Instant::now();
        let g = self.lock();
        let rows = g.slot_rows();
        let slot_of = |i: usize| {
            rows.iter()
                .find(|r| r.live == Some(i))
                .map(|r| r.id)
                .or(g.live[i].slot)
        };
        let live: Vec<Value> = g
            .live
            .iter()
            .enumerate()
            .map(|(i, c)| c.to_json(now, slot_of(i)))
            .collect();
        let current = live.first().cloned();
        // Aggregate speeds over the live requests: decode is the sum of their
        // rates (they decode side by side); prompt is the sum over those still
        // reading their prompt, else the newest one's finished prompt pass.
        let (prompt_tps, decode_tps) = if g.live.is_empty() {
            (g.last_prompt_tps, g.last_decode_tps)
        } else {
            let reading: Vec<&Live> = g
                .live
                .iter()
                .filter(|c| c.prompt_finished.is_none())
                .collect();
            let prompt = if reading.is_empty() {
                g.live
                    .iter()
                    .max_by_key(|c| c.started)
                    .map_or(0.0, |c| c.prompt_tps(now))
            } else {
                reading.iter().map(|c| c.prompt_tps(now)).sum::<f64>()
            };
            (
                prompt,
                g.live.iter().map(|c| c.decode_tps(now)).sum::<f64>(),
            )
        };
        let live_tokens: usize = g.live.iter().map(|c| c.tokens).sum();
        let live_prompt: usize = g.live.iter().map(|c| c.prompt_done).sum();
        let ctx_used: usize = rows.iter().map(|r| r.n_ctx_used).sum();
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
        let n_ctx_per_slot = g.pool.map(|p| p.n_ctx_per_slot);
        json!({
            "now_ms": unix_ms(),
            "uptime_s": round2(self.started_at.elapsed().as_secs_f64()),
            "state": match &current {
                Some(c) => c["state"].clone(),
                None => Value::from("idle"),
            },
            "current": current,
            "live": live,
            "slots": g.slots_json(now, n_ctx_per_slot),
            "speed": {
                "live": !g.live.is_empty(),
                "prompt_per_second": round2(prompt_tps),
                "predicted_per_second": round2(decode_tps),
            },
            // `ops` adds `total` (slots × context per slot) and fills each slot's
            // `n_ctx` when the pool's shape was never set.
            "context": {
                "used": ctx_used,
                "slots": rows.len(),
                "busy_slots": rows.iter().filter(|r| r.busy).count(),
                "per_slot": n_ctx_per_slot,
                "total": g.pool.map(|p| p.positions),
            },
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
                "prompt_tokens": t.prompt_tokens + live_prompt as u64,
                "prompt_seconds": round2(t.prompt_seconds),
                "cache_tokens": t.cache_tokens,
                "tokens_predicted": t.tokens_predicted + live_tokens as u64,
                "tokens_predicted_seconds": round2(t.tokens_predicted_seconds),
                "n_decode": t.n_decode,
                "n_busy_slots": t.n_busy_slots,
                "busy_slots_per_decode": round2(if t.n_decode > 0 {
                    t.n_busy_slots as f64 / t.n_decode as f64
                } else {
                    0.0
                }),
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
            "prompt_cache": g.cache.as_ref().map(|c| json!(c)),
            "device": g.device.as_ref().map(crate::device::to_json),
        })
    }
}

impl Inner {
    /// Removes request `id` from the live requests or the queue; returns its
    /// route, arrival time and queue wait.
    fn take_request(&mut self, id: u64) -> (String, u64, f64) {
        let now = Instant::now();
        if let Some(i) = self.live.iter().position(|c| c.id == id) {
            let c = self.live.remove(i);
            return (c.route, c.queued_at_unix_ms, c.queue_ms);
        }
        if let Some(i) = self.queue.iter().position(|q| q.id == id) {
            if let Some(q) = self.queue.remove(i) {
                return (q.route, q.at_unix_ms, ms_between(q.at, now));
            }
        }
        (String::from("?"), unix_ms(), 0.0)
    }

    fn live_mut(&mut self, id: u64) -> Option<&mut Live> {
        self.live.iter_mut().find(|c| c.id == id)
    }

    fn n_slots(&self) -> usize {
        match (&self.pool, &self.slots) {
            (Some(p), _) => p.total_slots,
            (None, Some(s)) => s.len().max(1),
            (None, None) => 1,
        }
    }

    /// The slots as the readers show them. With the engine's list: its slots,
    /// each linked to its live request (by the id in the list, else by the
    /// slot the request took). Without: one slot per `set_pool` slot (or
    /// one), each live request in the slot it took (or, when none said, in
    /// arrival order); a lone idle slot keeps the last request's context
    /// (the state kept for reuse), as the one-request server reported it.
    fn slot_rows(&self) -> Vec<SlotRow> {
        if let Some(slots) = &self.slots {
            // The list is as of the engine's last step: a request admitted
            // since then is live but the list may still show its slot idle.
            // It shows in the slot it took, or (before it said which) in the
            // first slot with no request; a live request is never hidden.
            let mut rows: Vec<SlotRow> = slots
                .iter()
                .map(|s| {
                    let live = s
                        .request
                        .and_then(|r| self.live.iter().position(|c| c.id == r))
                        .or_else(|| self.live.iter().position(|c| c.slot == Some(s.id)));
                    SlotRow {
                        id: s.id,
                        busy: s.busy,
                        cached_tokens: s.cached_tokens,
                        live,
                        task: s.request.filter(|_| s.busy),
                        n_ctx_used: s.cached_tokens,
                    }
                })
                .collect();
            for i in 0..self.live.len() {
                if rows.iter().any(|r| r.live == Some(i)) {
                    continue;
                }
                if let Some(r) = rows.iter_mut().find(|r| r.live.is_none() && !r.busy) {
                    r.live = Some(i);
                }
            }
            for r in &mut rows {
                if let Some(i) = r.live {
                    r.busy = true;
                    r.n_ctx_used = r.n_ctx_used.max(self.live[i].ctx_used());
                }
            }
            return rows;
        }
        let n = self.n_slots();
        // Requests that said which slot they took sit there; else (a worker
        // that never says) they fill the slots in arrival order.
        let by_slot = self.live.iter().any(|c| c.slot.is_some());
        (0..n)
            .map(|i| {
                let live = if by_slot {
                    self.live.iter().position(|c| c.slot == Some(i))
                } else {
                    (i < self.live.len()).then_some(i)
                };
                let n_ctx_used = match live {
                    Some(i) => self.live[i].ctx_used(),
                    None if n == 1 => self.last_ctx_used,
                    None => 0,
                };
                SlotRow {
                    id: i,
                    busy: live.is_some(),
                    cached_tokens: if live.is_none() { n_ctx_used } else { 0 },
                    live,
                    task: None,
                    n_ctx_used,
                }
            })
            .collect()
    }

    /// `/slots` objects (see [`Stats::slots_json`]); `n_ctx` null when unknown
    /// here (`ops` fills it from the model).
    fn slots_json(&self, now: Instant, n_ctx: impl Into<Value> + Copy) -> Vec<Value> {
        self.slot_rows()
            .iter()
            .map(|r| {
                let c = r.live.map(|i| &self.live[i]);
                let id_task = match (c, r.task) {
                    (Some(c), _) => Value::from(c.id),
                    (None, Some(t)) => Value::from(t),
                    (None, None) => Value::from(-1),
                };
                json!({
                    "id": r.id,
                    "n_ctx": n_ctx.into(),
                    "is_processing": r.busy,
                    "id_task": id_task,
                    "state": match c {
                        Some(c) => c.state(),
                        None if r.busy => "processing",
                        None => "idle",
                    },
                    "route": c.map(|c| c.route.as_str()),
                    "n_prompt_tokens": c.map_or(0, |c| c.prompt_tokens),
                    "n_prompt_tokens_processed": c.map_or(0, |c| c.prompt_done),
                    "n_decoded": c.map_or(0, |c| c.tokens),
                    "n_ctx_used": r.n_ctx_used,
                    "cached_tokens": r.cached_tokens,
                    "elapsed_ms": c.map(|c| round2(ms_between(c.started, now))),
                })
            })
            .collect()
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

mod prometheus;

#[cfg(test)]
mod tests;

/// Tiered experts' counts as JSON, per tier: each tier's share of expert uses
/// (`hit_rate`, what the stats page shows), its `uses` and, for misses, the `bytes`
/// moved. `vram`: slot hits; `ram`: misses copied from the pinned copy, with how
/// many experts were copied ahead of their step, into the prompt pool or on a guess
/// of a decode token's routing (`prefetched`), and how many of those no route used
/// (`prefetch_unused`); `cpu`: misses the CPU computed from RAM (`compute_ms`: from
/// the start of its products to their end, summed over steps); `disk`: misses read
/// from the file (`read_ms`). The stats page and a request's `timings.experts`
/// have this shape.
pub fn expert_tiers(t: &engine::experts::TierStats) -> Value {
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
    let mut cpu = tier(t.cpu_misses, Some(t.cpu_bytes));
    cpu["compute_ms"] = json!(t.cpu_ns as f64 / 1e6);
    let mut ram = tier(t.ram_misses, Some(t.ram_bytes));
    ram["prefetched"] = json!(t.prefetched);
    ram["prefetch_unused"] = json!(t.prefetch_unused);
    json!({
        "vram": tier(t.hits, None),
        "ram": ram,
        "cpu": cpu,
        "disk": disk,
    })
}
