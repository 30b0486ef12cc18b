//! `scoria bench`: prompt and generation speed, labelled and reported as llama-bench
//! does, so the two can be compared test by test (`bench/compare.py`).
//!
//! # What is timed
//!
//! Every test and repetition starts from an empty state (`Engine::reset`) and feeds
//! random token ids (uniform in `1..n_vocab`, seeded by `--seed`, the test and the
//! repetition, so no two repetitions see the same input and none is all zeros).
//!
//! * `ppN @ dD`: the engine first evaluates D random ids (not timed), then is asked
//!   for a prompt of those D ids followed by N new ones with `max_tokens = 0`. It keeps
//!   the D-token state and evaluates only the N new tokens; the time is the engine's
//!   `Timings::prompt_ms`: from the start of that evaluation until the logits of the
//!   last prompt position are on the host. t/s = N / that time.
//! * `tgN @ dD`: one request whose prompt is max(D, 1) random ids (evaluated, not
//!   timed), decoded greedily (or as `--temp`, `--top-k`, `--top-p`, `--min-p` say,
//!   each token drawn where the logits are, as a chat request's) with
//!   `stop_at_eog = false` (end-of-generation tokens are ignored, as
//!   `scoria run --ignore-eos` does) and `max_tokens = N + 1`. The engine's
//!   `Timings::predicted_ms` covers everything after the prompt step: N one-token
//!   forward steps, at positions max(D, 1) .. max(D, 1) + N - 1, and the greedy pick of
//!   N + 1 tokens (the last one is picked but never fed). Plain greedy sampling lets
//!   the executor return the argmax id from each step instead of the logits, so the
//!   picks are part of the steps (the prompt step's pick is made before the timer
//!   starts). t/s = N / that time. Against llama-bench, which times N one-token steps
//!   at positions D .. D + N - 1 on random ids and picks nothing: the same positions
//!   for D > 0, one position later for D = 0, plus the argmax inside each step.
//!
//! Before each test's repetitions, one warm-up run of that same test (own inputs) is
//! made and not reported. Each test reports every sample, mean ± sample standard
//! deviation (llama-bench's `t/s` column) and the median (what `docs/benchmarks.md` compares).

mod report;
mod traffic;
mod verify;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use engine::{Engine, EngineConfig, FinishReason, Flow, GenerateRequest, SamplingParams};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::{Rng, SeedableRng};

use report::{ModelDesc, Report, TestResult};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Tests are labelled as llama-bench labels them: pp512, tg128, \
pp512 @ d4096, tg128 @ d4096. A 0 in -p or -n skips that kind of test.",
    mut_arg("max_context", |a| a.help(
        "Context length to allocate [default: just enough for the largest depth + test]"
    ))
)]
pub struct BenchArgs {
    /// Model file (GGUF; the first shard of a split model) [default: the demo model,
    /// models/demo.gguf].
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Prompt sizes, comma-separated (one `ppN` test each).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generation sizes, comma-separated (one `tgN` test each).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Depths, comma-separated: tokens already in the KV cache / recurrent state
    /// before the timed part (every test runs at every depth).
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub n_depth: Vec<usize>,
    /// Timed repetitions of each test (after one warm-up run).
    #[arg(short = 'r', long = "repetitions", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub repetitions: u32,
    /// Output format.
    #[arg(short = 'o', long = "output-format", value_enum, default_value_t = Format::Md)]
    pub format: Format,
    /// Write the output to this file instead of stdout.
    #[arg(long = "output")]
    pub output: Option<PathBuf>,
    /// Generation tests decode this many streams at once (each its own random
    /// prompt, in its own slot, one batched step for all), reported as `tgN xS`:
    /// t/s counts every stream's tokens. The warm-up run checks that each stream's
    /// tokens are those it gets alone.
    #[arg(long, default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=engine::MAX_PARALLEL as i64))]
    pub parallel: u32,
    /// Instead of the -p/-n tests: time speculative verify steps of these many tokens
    /// (the pending token and its drafts, every row's greedy token, rolled back after)
    /// against a one-token decode step, at each -d depth, with the speedup that implies
    /// at acceptance 0.6, 0.75 and 0.9. Needs --spec with --draft-max of at least the
    /// largest size − 1.
    #[arg(long = "verify", value_delimiter = ',', value_name = "TOKENS")]
    pub verify: Vec<usize>,
    /// Seed of the random token ids.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Generation tests decode under this JSON schema (a file), as a request with
    /// structured output does: each token is chosen from what the schema allows, the
    /// mask computed beside each step. Compare with a run without it to see the cost;
    /// use a schema the output cannot finish within the test (an unbounded array).
    #[arg(long = "json-schema", value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    /// How generation tests choose tokens (greedy unless --temp is above 0; each token
    /// drawn where the logits are, as a chat request's); the report records it.
    #[command(flatten)]
    pub sampling: crate::run::Sampling,
    /// Where and how the engine runs (the settings `serve` has too).
    #[command(flatten)]
    pub engine: server::settings::EngineArgs,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// llama-bench's markdown table, plus a median column.
    Md,
    /// One JSON object: run, model, device, and every test with its samples.
    Json,
    /// One JSON object per test and line, each self-contained.
    Jsonl,
}

/// One test: `n_prompt` > 0 is a prompt test, `n_gen` > 0 a generation test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestSpec {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
    /// Generation tests: streams decoded at once, each in its own slot (1: alone).
    pub n_streams: usize,
}

impl TestSpec {
    /// llama-bench's label: `pp512`, `tg128`, then ` @ d4096` when there is a depth.
    pub fn label(&self) -> String {
        let mut s = match (self.n_prompt, self.n_gen) {
            (p, 0) => format!("pp{p}"),
            (0, n) => format!("tg{n}"),
            (p, n) => format!("pp{p}+tg{n}"),
        };
        if self.n_depth > 0 {
            s.push_str(&format!(" @ d{}", self.n_depth));
        }
        if self.n_streams > 1 {
            s.push_str(&format!(" x{}", self.n_streams));
        }
        s
    }

    /// Tokens the rate is computed over (every stream's).
    pub fn timed_tokens(&self) -> usize {
        (self.n_prompt + self.n_gen) * self.n_streams
    }

    /// A generation test of one stream: what a decode token's RAM traffic describes.
    fn single_decode(&self) -> bool {
        self.n_gen > 0 && self.n_prompt == 0 && self.n_streams == 1
    }

    /// Tokens in the state before the timed part begins.
    fn prefix_len(&self) -> usize {
        if self.n_gen > 0 {
            self.n_depth.max(1)
        } else {
            self.n_depth
        }
    }

    /// The smallest context the engine accepts this test in: a prompt must be
    /// shorter than the context, and every decode step needs a free position.
    pub fn n_ctx_needed(&self) -> usize {
        if self.n_gen > 0 {
            self.prefix_len() + self.n_gen + 1
        } else {
            self.n_depth + self.n_prompt + 1
        }
    }
}

/// The tests in llama-bench's order: for each depth, the prompt sizes, then the
/// generation sizes; zeros are skipped.
pub fn plan(
    n_prompt: &[usize],
    n_gen: &[usize],
    n_depth: &[usize],
    streams: usize,
) -> Vec<TestSpec> {
    let mut out = Vec::new();
    for &d in n_depth {
        for &p in n_prompt.iter().filter(|&&p| p > 0) {
            out.push(TestSpec {
                n_prompt: p,
                n_gen: 0,
                n_depth: d,
                n_streams: 1,
            });
        }
        for &n in n_gen.iter().filter(|&&n| n > 0) {
            out.push(TestSpec {
                n_prompt: 0,
                n_gen: n,
                n_depth: d,
                n_streams: streams,
            });
        }
    }
    out
}

/// `n` token ids uniform in `1..n_vocab` (never 0), from a generator seeded by the
/// run's seed, the test's index and the run (0 is the warm-up, 1.. the repetitions),
/// so every run sees different input and a run can be reproduced.
pub fn random_ids(seed: u64, test: usize, run: u64, n: usize, n_vocab: usize) -> Vec<u32> {
    let mix = splitmix(splitmix(splitmix(seed) ^ test as u64) ^ run);
    let mut rng = rand::rngs::StdRng::seed_from_u64(mix);
    let hi = n_vocab.max(2) as u32;
    (0..n).map(|_| rng.random_range(1..hi)).collect()
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One timed run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub ns: u64,
    pub tps: f64,
}

impl Sample {
    fn from_ms(tokens: usize, ms: f64) -> Result<Sample> {
        if ms <= 0.0 || !ms.is_finite() {
            bail!("the engine reported {ms} ms for {tokens} tokens; cannot compute a rate");
        }
        Ok(Sample {
            ns: (ms * 1e6).round() as u64,
            tps: tokens as f64 * 1000.0 / ms,
        })
    }
}

/// A request of the run: `sampling` (greedy unless the sampling flags say otherwise,
/// no penalties) with `seed`.
fn request(
    prompt: Vec<u32>,
    max_tokens: usize,
    seed: u64,
    sampling: &SamplingParams,
) -> GenerateRequest {
    GenerateRequest {
        prompt,
        max_tokens,
        sampling: SamplingParams {
            seed: Some(seed),
            ..sampling.clone()
        },
        stop_at_eog: false,
        constraint: None,
        logprobs: None,
        speculative: Default::default(),
        images: Vec::new(),
    }
}

/// Runs `t` once on `ids` (its prefix and its new tokens); see the module docs for
/// what is timed.
fn run_once(
    eng: &mut Engine,
    t: &TestSpec,
    ids: &[u32],
    seed: u64,
    sampling: &SamplingParams,
    constraint: Option<&engine::constraint::Constraint>,
) -> Result<Sample> {
    eng.reset()?;
    let mut keep_going = |_: &engine::TokenEvent| Flow::Continue;
    if t.n_gen == 0 {
        let d = t.n_depth;
        if d > 0 {
            eng.generate(
                &request(ids[..d].to_vec(), 0, seed, sampling),
                &mut keep_going,
            )?;
        }
        let c = eng.generate(&request(ids.to_vec(), 0, seed, sampling), &mut keep_going)?;
        let tm = &c.timings;
        if tm.prompt_n != t.n_prompt || tm.cache_n != d {
            bail!(
                "{}: the engine evaluated {} prompt tokens after {} kept ones; expected {} after {d}",
                t.label(),
                tm.prompt_n,
                tm.cache_n,
                t.n_prompt
            );
        }
        Sample::from_ms(t.n_prompt, tm.prompt_ms)
    } else {
        let mut req = request(ids.to_vec(), t.n_gen + 1, seed, sampling);
        req.constraint = constraint.cloned();
        let c = eng.generate(&req, &mut keep_going)?;
        if c.timings.predicted_n != t.n_gen + 1 || c.finish != FinishReason::Length {
            bail!(
                "{}: the engine generated {} tokens (finish {:?}); expected {} ending at the length limit",
                t.label(),
                c.timings.predicted_n,
                c.finish,
                t.n_gen + 1
            );
        }
        Sample::from_ms(t.n_gen, c.timings.predicted_ms)
    }
}

/// What one stream of `run_streams` produced.
#[derive(Default)]
struct StreamOut {
    tokens: Vec<u32>,
    done: Option<std::result::Result<engine::Completion, String>>,
}

/// Collects a stream's tokens for `run_streams`.
struct Collect(std::sync::Arc<std::sync::Mutex<StreamOut>>);

impl engine::RequestCallbacks for Collect {
    fn token(&mut self, ev: &engine::TokenEvent) -> Flow {
        if let Ok(mut o) = self.0.lock() {
            o.tokens.push(ev.token);
        }
        Flow::Continue
    }
    fn done(&mut self, r: std::result::Result<engine::Completion, engine::EngineError>) {
        if let Ok(mut o) = self.0.lock() {
            o.done = Some(r.map_err(|e| e.to_string()));
        }
    }
}

/// Runs generation test `t` as `streams.len()` streams at once: each stream's
/// prompt (all but its last token) is evaluated alone first, untimed, into its own
/// slot; then every stream is submitted and the engine stepped until all end. The
/// time is the wall clock of that part (each stream's last prompt token, read as a
/// one-token piece, and its `n_gen + 1` picks); t/s counts every stream's `n_gen`.
/// With `check`, each stream is then run alone and its tokens compared.
fn run_streams(
    eng: &mut Engine,
    t: &TestSpec,
    streams: &[Vec<u32>],
    seed: u64,
    sampling: &SamplingParams,
    check: bool,
) -> Result<Sample> {
    eng.reset()?;
    let mut keep_going = |_: &engine::TokenEvent| Flow::Continue;
    for ids in streams {
        if ids.len() > 1 {
            eng.generate(
                &request(ids[..ids.len() - 1].to_vec(), 0, seed, sampling),
                &mut keep_going,
            )?;
        }
    }
    let outs: Vec<_> = streams
        .iter()
        .map(|_| std::sync::Arc::new(std::sync::Mutex::new(StreamOut::default())))
        .collect();
    let t0 = std::time::Instant::now();
    for (ids, out) in streams.iter().zip(&outs) {
        eng.submit(
            request(ids.clone(), t.n_gen + 1, seed, sampling),
            Box::new(Collect(out.clone())),
        );
    }
    while eng.step() {}
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    let mut got = Vec::with_capacity(streams.len());
    for (k, out) in outs.iter().enumerate() {
        let mut o = out
            .lock()
            .map_err(|_| anyhow::anyhow!("stream {k}: its collector failed"))?;
        match o.done.take() {
            Some(Ok(c)) if c.finish == FinishReason::Length && c.tokens.len() == t.n_gen + 1 => {}
            Some(Ok(c)) => bail!(
                "stream {k}: {} tokens, finish {:?}; expected {} ending at the length limit",
                c.tokens.len(),
                c.finish,
                t.n_gen + 1
            ),
            Some(Err(e)) => bail!("stream {k}: {e}"),
            None => bail!("stream {k} did not end"),
        }
        got.push(std::mem::take(&mut o.tokens));
    }
    if check {
        for (k, ids) in streams.iter().enumerate() {
            eng.reset()?;
            let alone = eng.generate(
                &request(ids.clone(), t.n_gen + 1, seed, sampling),
                &mut keep_going,
            )?;
            if alone.tokens != got[k] {
                let at = alone
                    .tokens
                    .iter()
                    .zip(&got[k])
                    .take_while(|(a, b)| a == b)
                    .count();
                bail!(
                    "stream {k} decoded beside {} others differs from its run alone at token {at}: batching changed the output",
                    streams.len() - 1
                );
            }
        }
        eprintln!(
            "scoria bench: {}: each of the {} streams gave the tokens it gives alone",
            t.label(),
            streams.len()
        );
    }
    Sample::from_ms(t.n_gen * streams.len(), ms)
}

/// Where the output goes; opened before the run so a bad path fails at once.
enum Sink {
    Stdout,
    File(PathBuf, std::fs::File),
}

impl Sink {
    fn write(self, text: &str) -> Result<()> {
        match self {
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            Sink::File(path, mut f) => {
                f.write_all(text.as_bytes())
                    .and_then(|_| f.flush())
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!("scoria bench: wrote {}", path.display());
            }
        }
        Ok(())
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    a.sampling.check()?;
    if let Some(n) = a.engine.threads {
        engine::check_threads(n)?;
    }
    let verify_sizes = (!a.verify.is_empty())
        .then(|| verify::sizes(&a.verify))
        .transpose()?;
    let tests = match verify_sizes {
        Some(_) => Vec::new(),
        None => plan(&a.n_prompt, &a.n_gen, &a.n_depth, a.parallel as usize),
    };
    if tests.is_empty() && verify_sizes.is_none() {
        bail!("nothing to run: every -p and -n size is 0");
    }
    let reps = a.repetitions as usize;
    if let Some(m) = a.model.as_ref().filter(|m| !m.is_file()) {
        bail!(
            "model file {} not found (give a GGUF file with -m)",
            m.display()
        );
    }
    let model_path = crate::model_or_demo(a.model.as_deref())?;
    let needed = match &verify_sizes {
        Some(sizes) => a
            .n_depth
            .iter()
            .map(|&d| verify::n_ctx_needed(d, sizes, reps))
            .max()
            .unwrap_or(16),
        None => tests.iter().map(TestSpec::n_ctx_needed).max().unwrap_or(16),
    };
    if let Some(c) = a.engine.max_context {
        if let Some(t) = tests.iter().find(|t| t.n_ctx_needed() > c) {
            bail!(
                "test {} needs a context of {} tokens but --max-context is {c}; raise --max-context or lower -d/-p/-n",
                t.label(),
                t.n_ctx_needed()
            );
        }
    }
    let sink = match &a.output {
        Some(p) => Sink::File(
            p.clone(),
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        ),
        None => Sink::Stdout,
    };
    let t0 = std::time::Instant::now();
    let mut eng = Engine::load(&model_path, &{
        let engine = a.engine.values();
        let mut c = EngineConfig {
            parallel: Some(a.parallel as usize),
            precision: Default::default(),
            ..Default::default()
        };
        engine.apply(&mut c);
        c.max_context = Some(
            engine
                .max_context
                .unwrap_or(needed.max(16) * a.parallel as usize),
        );
        c
    })
    .with_context(|| format!("loading {}", model_path.display()))?;
    // The file's header once, for the model column and (CPU decode) the traffic line.
    let file = gguf::GgufFile::open(&model_path)
        .with_context(|| format!("reading {}", model_path.display()))?;
    let model = ModelDesc::read(
        &model_path,
        &file,
        eng.info().clone(),
        eng.memory().weights_mapped,
    );
    let constraint = match &a.json_schema {
        None => None,
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let schema: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not JSON", p.display()))?;
            let compiler = engine::constraint::GrammarCompiler::new(eng.tokenizer())?;
            let g = compiler
                .compile(&engine::constraint::Grammar::JsonSchema(schema))
                .with_context(|| format!("--json-schema {}", p.display()))?;
            eprintln!(
                "scoria bench: generation tests decode under the schema in {}",
                p.display()
            );
            Some(engine::constraint::Constraint::new(g))
        }
    };
    let sampling = a.sampling.params();
    if sampling.temperature > 0.0 {
        eprintln!(
            "scoria bench: generation tests sample: temperature {}, top-k {}, top-p {}, min-p {}",
            sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
        );
    }
    let device = eng.device_report();
    let threads = rayon::current_num_threads();
    eprintln!(
        "scoria bench: {} ({:.2} GiB, {} params), context {}, {threads} threads, loaded in {:.1}s",
        model.type_name(),
        model.size as f64 / (1u64 << 30) as f64,
        report::fmt_params(model.n_params),
        model.info.n_ctx,
        t0.elapsed().as_secs_f64()
    );
    eprintln!("scoria bench: {}", server::device::line(&device));
    if let Some(want) = a.engine.device.filter(|&d| d != device.device) {
        // The table's backend column follows the report, so the numbers stay honest;
        // say loudly that they are not what was asked for.
        eprintln!(
            "scoria bench: warning: --device {want} was asked for, but the engine reports it runs on {}",
            device.device
        );
    }
    if model.info.synthetic {
        eprintln!("scoria bench: {}", report::SYNTHETIC_NOTE);
    }
    if let Some(sizes) = &verify_sizes {
        let text = verify::run(
            &mut eng,
            sizes,
            &a.n_depth,
            reps,
            a.seed,
            a.format,
            (&model.type_name(), report::backend(device.device)),
        )?;
        return sink.write(&text);
    }
    // CPU decode: the bytes a token reads, and the RAM bandwidth they are bound by.
    let cpu_decode =
        device.device == engine::Device::Cpu && tests.iter().any(TestSpec::single_decode);
    let traffic = cpu_decode
        .then(|| traffic::DecodeTraffic::read(&model_path, &file, &model.info, eng.memory()))
        .transpose()?;
    let ram_read_bps = cpu_decode.then(|| {
        let bps = traffic::measure_ram_read();
        eprintln!(
            "scoria bench: RAM reads {:.1} GB/s ({threads} threads over 1 GiB, best of 3)",
            bps / 1e9
        );
        bps
    });

    let bar = progress_bar((tests.len() * (reps + 1)) as u64);
    let n_vocab = model.info.n_vocab;
    let mut results = Vec::with_capacity(tests.len());
    for (i, t) in tests.iter().enumerate() {
        let label = t.label();
        let len = t.prefix_len() + t.n_prompt;
        let mut samples = Vec::with_capacity(reps);
        let mut stats_before = None;
        let mut times_before = None;
        for run in 0..=reps as u64 {
            if run == 1 {
                stats_before = eng.expert_stats();
                times_before = Some(engine::cpu::op_times::OpTimes::now());
            }
            bar.set_message(if run == 0 {
                format!("{label} warm-up")
            } else {
                format!("{label} run {run}/{reps}")
            });
            let s = if t.n_streams > 1 {
                let streams: Vec<Vec<u32>> = (0..t.n_streams)
                    .map(|k| random_ids(a.seed ^ ((k as u64) << 32), i, run, len, n_vocab))
                    .collect();
                run_streams(&mut eng, t, &streams, a.seed ^ run, &sampling, run == 0)
            } else {
                let ids = random_ids(a.seed, i, run, len, n_vocab);
                run_once(
                    &mut eng,
                    t,
                    &ids,
                    a.seed ^ run,
                    &sampling,
                    constraint.as_ref(),
                )
            }
            .with_context(|| format!("test {label}, run {run}"))?;
            if run > 0 {
                samples.push(s);
            }
            bar.inc(1);
        }
        let r = TestResult {
            spec: *t,
            samples,
            device: eng.device_report(),
            finished_at: report::utc_now(),
            experts: eng
                .expert_stats()
                .zip(stats_before)
                .map(|(after, before)| after.minus(&before)),
            ram_bytes_per_token: traffic
                .filter(|_| t.single_decode())
                .map(|tr| tr.per_token(t)),
        };
        let s = r.summary();
        bar.suspend(|| {
            eprintln!(
                "scoria bench: {label}: {:.2} t/s median, {:.2} ± {:.2} mean over {reps} runs",
                s.median, s.mean, s.stddev
            );
            if let Some(line) = r.experts_line() {
                eprintln!("scoria bench: {label}: {line}");
            }
            if let (Some(tr), Some(_)) = (traffic, r.ram_bytes_per_token) {
                eprintln!(
                    "scoria bench: {label}: {}",
                    tr.line(t, s.median, ram_read_bps)
                );
            }
            // Where a CPU decode pass's time went (each run's passes: its 1-token
            // prompt and n_gen - 1 decode steps).
            if let (true, Some(before)) = (
                cpu_decode && t.single_decode() && t.n_depth == 0,
                times_before,
            ) {
                let d = engine::cpu::op_times::OpTimes::now().since(&before);
                eprintln!(
                    "scoria bench: {label}: {}",
                    op_times_line(&d, reps * t.n_gen)
                );
            }
        });
        results.push(r);
    }
    bar.finish_and_clear();

    let rep = Report {
        model,
        device,
        threads,
        seed: a.seed,
        repetitions: reps,
        date: report::utc_now(),
        command: command_line(),
        // $SCORIA_COMMIT overrides the commit the binary was built from.
        build_commit: std::env::var("SCORIA_COMMIT")
            .unwrap_or_else(|_| env!("SCORIA_BUILD_COMMIT").into()),
        ram_read_bps,
        sampling,
        tests: results,
    };
    let text = match a.format {
        Format::Md => rep.markdown(),
        Format::Json => format!("{:#}\n", rep.to_json()),
        Format::Jsonl => rep.to_jsonl(),
    };
    sink.write(&text)
}

/// A CPU decode token's time by part of the model: each part's time over `tokens`
/// passes (and the share of it outside the team's parallel loops, on one thread),
/// and the rest of the passes (embedding, norms, residual adds).
fn op_times_line(d: &engine::cpu::op_times::OpTimes, tokens: usize) -> String {
    let ms = |x: std::time::Duration| x.as_secs_f64() * 1e3 / tokens.max(1) as f64;
    let pass = ms(d.passes.total);
    let pct = |v: f64| 100.0 * v / pass.max(f64::MIN_POSITIVE);
    let part = |name: &str, p: &engine::cpu::op_times::PartTime| {
        let (t, one) = (ms(p.total), ms(p.total.saturating_sub(p.in_loops)));
        format!("{name} {t:.2} ms ({:.0}%; {one:.2} on one thread)", pct(t))
    };
    let parts = ms(d.mixers.total + d.moe.total + d.lm_head.total);
    let rest = (pass - parts).max(0.0);
    let one = ms(d.one_thread());
    format!(
        "a pass {pass:.2} ms: {}, {}, {}, the rest (embedding, norms, adds) {rest:.2} ms ({:.0}%); {:.0} parallel loops, {one:.2} ms ({:.0}%) of the pass on one thread",
        part("mixers", &d.mixers),
        part("MoE", &d.moe),
        part("LM head", &d.lm_head),
        pct(rest),
        d.loop_count as f64 / tokens.max(1) as f64,
        pct(one),
    )
}

/// A progress bar on stderr (drawn only when stderr is a terminal).
fn progress_bar(len: u64) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len), target);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// The command as typed (arguments with spaces or quotes single-quoted), for the
/// record every number carries.
fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:,=@+".contains(c))
            {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests;
