//! `scoria bench` results: statistics, and the markdown / JSON / JSONL forms.
//!
//! The markdown table has llama-bench's columns and widths (`model`, `size`,
//! `params`, `backend`, `threads`, `test`, `t/s` = mean ± sample standard deviation)
//! and one more, `median t/s`. The JSON keeps llama-bench's per-test names
//! (`n_prompt`, `n_gen`, `n_depth`, `samples_ns`, `samples_ts`, `avg_ts`, `stddev_ts`)
//! so one reader handles both tools' output.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::{Sample, TestSpec};

/// Said next to every number measured on a `scoria synth` model.
pub const SYNTHETIC_NOTE: &str = "synthetic model (random weights): routers route nearly \
uniformly, the worst case for an expert cache";

/// Mean, sample standard deviation (n - 1; 0 for one sample) and median.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub mean: f64,
    pub stddev: f64,
    pub median: f64,
}

pub fn summarize(xs: &[f64]) -> Summary {
    let n = xs.len();
    if n == 0 {
        return Summary {
            mean: 0.0,
            stddev: 0.0,
            median: 0.0,
        };
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    let stddev = if n > 1 {
        (xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    let mut sorted = xs.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    Summary {
        mean,
        stddev,
        median,
    }
}

/// The model as the report names it.
#[derive(Debug, Clone)]
pub struct ModelDesc {
    pub filename: String,
    pub info: engine::ModelInfo,
    /// Bytes of tensor data (llama-bench's `model_size`).
    pub size: u64,
    /// Elements of all tensors (llama-bench's `model_n_params`).
    pub n_params: u64,
    /// GGUF `general.file_type` (llama_ftype), when the file says.
    pub file_type: Option<u64>,
}

impl ModelDesc {
    /// Reads the parameter count and file type from the GGUF's header.
    pub fn read(path: &Path, f: &gguf::GgufFile, info: engine::ModelInfo, size: u64) -> ModelDesc {
        ModelDesc {
            filename: path.display().to_string(),
            info,
            size,
            n_params: f.tensors().iter().map(|t| t.n_elements()).sum(),
            file_type: f.get("general.file_type").and_then(|v| v.as_u64()),
        }
    }

    /// The `model` column: arch and name (`qwen35moe Qwen3.6-35B-A3B`).
    pub fn type_name(&self) -> String {
        format!("{} {}", self.info.arch, self.info.name)
    }
}

/// One test's samples and the engine's device report after them.
#[derive(Debug, Clone)]
pub struct TestResult {
    pub spec: TestSpec,
    pub samples: Vec<Sample>,
    pub device: engine::DeviceReport,
    pub finished_at: String,
    /// Tiered experts: where the routed experts of the timed runs (their depth
    /// prefixes included) came from.
    pub experts: Option<engine::experts::TierStats>,
    /// CPU generation tests: the RAM bytes one generated token reads (estimated from
    /// the model's tensors, `traffic::DecodeTraffic`).
    pub ram_bytes_per_token: Option<u64>,
}

impl TestResult {
    /// One line on the tiered experts of the timed runs, per timed token.
    pub fn experts_line(&self) -> Option<String> {
        let e = self.experts?;
        let tokens = (self.samples.len() * self.spec.timed_tokens()).max(1) as f64;
        let mb = |b: u64| b as f64 / 1e6;
        let ms = |ns: u64| ns as f64 / 1e6;
        Some(format!(
            "experts: {:.1}% VRAM slot hits; misses per timed token {:.1} computed by the CPU ({:.1} MB), {:.1} copied from RAM ({:.1} MB; {:.1} copied ahead (into the prompt pool, or on a guess of the routing), {:.2} of those unused), {:.1} from disk ({:.1} MB, {:.1} ms reading); host per timed token {:.2} ms in expert steps, {:.2} ms of it waiting for the routing, {:.2} ms while the CPU computed (issuing the GPU's part beside it)",
            100.0 * e.hit_rate(),
            e.cpu_misses as f64 / tokens,
            mb(e.cpu_bytes) / tokens,
            e.ram_misses as f64 / tokens,
            mb(e.ram_bytes) / tokens,
            e.prefetched as f64 / tokens,
            e.prefetch_unused as f64 / tokens,
            e.disk_misses as f64 / tokens,
            mb(e.disk_bytes) / tokens,
            e.disk_ns as f64 / 1e6 / tokens,
            ms(e.step_ns) / tokens,
            ms(e.wait_ns) / tokens,
            ms(e.cpu_ns) / tokens,
        ))
    }

    /// Statistics of the samples' tokens per second.
    pub fn summary(&self) -> Summary {
        summarize(&self.samples.iter().map(|s| s.tps).collect::<Vec<_>>())
    }

    fn to_json(&self) -> Value {
        let ts: Vec<f64> = self.samples.iter().map(|s| s.tps).collect();
        let ns: Vec<f64> = self.samples.iter().map(|s| s.ns as f64).collect();
        let s = summarize(&ts);
        let n = summarize(&ns);
        json!({
            "test": self.spec.label(),
            "n_prompt": self.spec.n_prompt,
            "n_gen": self.spec.n_gen,
            "n_depth": self.spec.n_depth,
            "n_streams": self.spec.n_streams,
            "timed_tokens": self.spec.timed_tokens(),
            "samples_ns": self.samples.iter().map(|s| s.ns).collect::<Vec<_>>(),
            "samples_ts": ts,
            "avg_ns": n.mean.round() as u64,
            "stddev_ns": n.stddev.round() as u64,
            "avg_ts": s.mean,
            "stddev_ts": s.stddev,
            "median_ts": s.median,
            "vram_used_bytes": self.device.vram_used,
            "experts": self.experts,
            "ram_bytes_per_token": self.ram_bytes_per_token,
            "test_time": self.finished_at,
        })
    }
}

/// A whole run.
#[derive(Debug, Clone)]
pub struct Report {
    pub model: ModelDesc,
    /// The engine's device report right after loading.
    pub device: engine::DeviceReport,
    pub threads: usize,
    pub seed: u64,
    pub repetitions: usize,
    pub date: String,
    pub command: String,
    pub build_commit: String,
    /// RAM read bandwidth measured before CPU generation tests (bytes per second).
    pub ram_read_bps: Option<f64>,
    /// How generation tests chose tokens (greedy: temperature 0).
    pub sampling: engine::SamplingParams,
    pub tests: Vec<TestResult>,
}

/// llama-bench's `backend` column: `CPU` or `CUDA`.
pub fn backend(d: engine::Device) -> &'static str {
    match d {
        engine::Device::Cpu => "CPU",
        engine::Device::Cuda(_) => "CUDA",
    }
}

/// `17.28 GiB` or `512.00 MiB`, as llama-bench prints sizes.
pub fn fmt_size(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes < 1 << 30 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    }
}

/// `30.53 B` or `85.20 M`, as llama-bench prints parameter counts.
pub fn fmt_params(n: u64) -> String {
    if n < 1_000_000_000 {
        format!("{:.2} M", n as f64 / 1e6)
    } else {
        format!("{:.2} B", n as f64 / 1e9)
    }
}

/// Column name and width: negative = left-aligned (llama-bench's convention).
const COLUMNS: &[(&str, i32)] = &[
    ("model", -30),
    ("size", 10),
    ("params", 10),
    ("backend", -10),
    ("threads", 7),
    ("test", 15),
    ("t/s", 20),
    ("median t/s", 12),
];

fn cell(text: &str, width: i32) -> String {
    let w = width.unsigned_abs() as usize;
    if width < 0 {
        format!(" {text:<w$} |")
    } else {
        format!(" {text:>w$} |")
    }
}

impl Report {
    fn model_json(&self) -> Value {
        let m = &self.model;
        let i = &m.info;
        json!({
            "filename": m.filename,
            "type": m.type_name(),
            "size": m.size,
            "n_params": m.n_params,
            "file_type": m.file_type,
            "file_bytes": i.file_bytes,
            "arch": i.arch,
            "name": i.name,
            "n_ctx_train": i.n_ctx_train,
            "n_vocab": i.n_vocab,
            "n_layer": i.n_layer,
            "n_embd": i.n_embd,
            "n_expert": i.n_expert,
            "n_expert_used": i.n_expert_used,
            "synthetic": i.synthetic,
        })
    }

    /// Fields every test shares (the JSON's top level; repeated on each JSONL line).
    fn run_fields(&self) -> Map<String, Value> {
        let v = json!({
            "tool": "scoria bench",
            "version": env!("CARGO_PKG_VERSION"),
            "build_commit": self.build_commit,
            "date": self.date,
            "command": self.command,
            "backends": backend(self.device.device),
            "device": server::device::to_json(&self.device),
            "n_threads": self.threads,
            "n_ctx": self.model.info.n_ctx,
            "seed": self.seed,
            "repetitions": self.repetitions,
            "warmup_runs": 1,
            "ram_read_bps": self.ram_read_bps,
            "sampling": {
                "temperature": self.sampling.temperature,
                "top_k": self.sampling.top_k,
                "top_p": self.sampling.top_p,
                "min_p": self.sampling.min_p,
            },
        });
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    /// `{run fields, "model": {...}, "tests": [{...}, ...]}`.
    pub fn to_json(&self) -> Value {
        let mut m = self.run_fields();
        m.insert("model".into(), self.model_json());
        m.insert(
            "tests".into(),
            Value::Array(self.tests.iter().map(TestResult::to_json).collect()),
        );
        Value::Object(m)
    }

    /// One line per test: the run fields, the model under `model`, the test's fields.
    pub fn to_jsonl(&self) -> String {
        let mut out = String::new();
        for t in &self.tests {
            let mut m = self.run_fields();
            m.insert("model".into(), self.model_json());
            if let Value::Object(tm) = t.to_json() {
                m.extend(tm);
            }
            out.push_str(&Value::Object(m).to_string());
            out.push('\n');
        }
        out
    }

    /// llama-bench's table (plus `median t/s`), then the build, device and notes.
    pub fn markdown(&self) -> String {
        let mut out = String::from("|");
        for (name, w) in COLUMNS {
            out.push_str(&cell(name, *w));
        }
        out.push_str("\n|");
        for (_, w) in COLUMNS {
            let n = w.unsigned_abs() as usize - 1;
            out.push_str(&format!(
                " {}{} |",
                "-".repeat(n),
                if *w > 0 { ":" } else { "-" }
            ));
        }
        out.push('\n');
        let model = self.model.type_name();
        let size = fmt_size(self.model.size);
        let params = fmt_params(self.model.n_params);
        let threads = self.threads.to_string();
        for t in &self.tests {
            let s = t.summary();
            let values = [
                model.clone(),
                size.clone(),
                params.clone(),
                backend(self.device.device).to_string(),
                threads.clone(),
                t.spec.label(),
                format!("{:.2} ± {:.2}", s.mean, s.stddev),
                format!("{:.2}", s.median),
            ];
            out.push('|');
            for (v, (_, w)) in values.iter().zip(COLUMNS) {
                out.push_str(&cell(v, *w));
            }
            out.push('\n');
        }
        out.push_str(&format!(
            "\nbuild: {} (scoria {})\n{}\n",
            self.build_commit,
            env!("CARGO_PKG_VERSION"),
            server::device::line(&self.device)
        ));
        if self.model.info.synthetic {
            out.push_str(&format!("note: {SYNTHETIC_NOTE}\n"));
        }
        out
    }
}

/// The current time as RFC 3339 UTC (`2026-11-30T12:34:56Z`), as llama-bench's
/// `test_time`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339(secs)
}

/// Seconds since the Unix epoch as RFC 3339 UTC.
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from a day count (proleptic Gregorian; eras of 400 years).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
