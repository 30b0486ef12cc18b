//! `/metrics`: the statistics as Prometheus text.

use std::fmt::Write as _;

use super::*;

impl Stats {
    /// Prometheus text exposition: llama-server's `llamacpp:*` metrics with
    /// their names, HELP and TYPE lines, then scoria's own `scoria:*`.
    /// `n_ctx` is the context per slot (unless `set_pool` gave one). Resets
    /// the throughput window, as llama-server does on each scrape.
    pub fn render_prometheus(&self, n_ctx: usize) -> String {
        let mut g = self.lock();
        let bucket = std::mem::take(&mut g.bucket);
        let rows = g.slot_rows();
        let t = g.totals.clone();
        let (device, tiers) = (g.device.clone(), g.expert_tiers.clone());
        let cache = g.cache.clone();
        let (reads, fault) = (g.expert_reads, g.fault.is_some());
        let warning = g.warning.is_some();
        let processing = g.live.len();
        let depth = g.queue.len();
        let live_tokens: usize = g.live.iter().map(|c| c.tokens).sum();
        let n_slots = g.n_slots();
        let (n_ctx, ctx_total) = match g.pool {
            Some(p) => (p.n_ctx_per_slot, p.positions),
            None => (n_ctx, n_slots * n_ctx),
        };
        drop(g);
        let ctx_used: usize = rows.iter().map(|r| r.n_ctx_used).sum();
        let busy_slots = rows.iter().filter(|r| r.busy).count();
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
            if ctx_total > 0 {
                ctx_used as f64 / ctx_total as f64
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
            processing as f64,
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
        if let Some(c) = &cache {
            let k = &c.counters;
            metric(
                "scoria:prompt_cache_slot_hits_total",
                "counter",
                "Requests that reused part of their slot's state (the conversation it held).",
                k.slot_hits as f64,
            );
            metric(
                "scoria:prompt_cache_store_hits_total",
                "counter",
                "Requests that restored a conversation from the prompt cache.",
                k.store_hits as f64,
            );
            metric(
                "scoria:prompt_cache_misses_total",
                "counter",
                "Requests that started from an empty state.",
                k.misses as f64,
            );
            let hit_rate = match k.slot_hits + k.store_hits + k.misses {
                0 => 0.0,
                n => (k.slot_hits + k.store_hits) as f64 / n as f64,
            };
            metric(
                "scoria:prompt_cache_hit_ratio",
                "gauge",
                "Share of requests that reused cached state, since start.",
                hit_rate,
            );
            if let Some(s) = &c.store {
                metric(
                    "scoria:prompt_cache_entries",
                    "gauge",
                    "Conversations in the prompt cache.",
                    s.entries as f64,
                );
                metric(
                    "scoria:prompt_cache_bytes",
                    "gauge",
                    "Bytes the prompt cache holds.",
                    s.bytes as f64,
                );
                metric(
                    "scoria:prompt_cache_budget_bytes",
                    "gauge",
                    "Bytes the prompt cache may hold (--prompt-cache).",
                    s.budget as f64,
                );
                metric(
                    "scoria:prompt_cache_evictions_total",
                    "counter",
                    "Conversations dropped from the prompt cache to stay within its budget.",
                    s.evictions as f64,
                );
            }
        }
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
            "Tokens generated so far by the requests being decoded.",
            live_tokens as f64,
        );
        metric(
            "scoria:context_size",
            "gauge",
            "Context length allocated per sequence (per slot), in tokens.",
            n_ctx as f64,
        );
        metric(
            "scoria:slots_total",
            "gauge",
            "Slots in the pool: requests that can decode at once.",
            n_slots as f64,
        );
        metric(
            "scoria:slots_busy",
            "gauge",
            "Slots decoding a request now.",
            busy_slots as f64,
        );
        metric(
            "scoria:uptime_seconds",
            "gauge",
            "Seconds since the server started.",
            self.started_at.elapsed().as_secs_f64(),
        );
        metric(
            "scoria:fault",
            "gauge",
            "1 while a fault keeps some requests from being served (the model file changed, an expert read is stuck): /health says degraded and why.",
            if fault { 1.0 } else { 0.0 },
        );
        metric(
            "scoria:warning",
            "gauge",
            "1 while the server serves under a standing warning (the GPU short of memory since another process took VRAM: slower, some requests may fail): /health's warning says what.",
            if warning { 1.0 } else { 0.0 },
        );
        if let Some(r) = &reads {
            for (name, help, v) in [
                (
                    "scoria:expert_reads_total",
                    "Experts read from the model file (each once, however many tries it took).",
                    r.experts,
                ),
                (
                    "scoria:expert_read_bytes_total",
                    "Bytes of experts read from the model file.",
                    r.bytes,
                ),
                (
                    "scoria:expert_read_retries_total",
                    "Expert reads from the model file that failed and were tried again.",
                    r.retries,
                ),
                (
                    "scoria:expert_read_failures_total",
                    "Experts that could not be read from the model file (after the retry, past the deadline, or from a changed file); their requests failed.",
                    r.failed,
                ),
                (
                    "scoria:expert_read_stalls_total",
                    "Expert reads from the model file that missed their deadline.",
                    r.stalls,
                ),
            ] {
                metric(name, "counter", help, v as f64);
            }
        }
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
                (
                    "scoria:expert_prefetched_total",
                    "Experts copied from RAM into the prompt pool ahead of their layer's routing (long prompts).",
                    "prefetched",
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
