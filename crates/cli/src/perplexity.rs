//! `scoria perplexity`: perplexity over a text, counted as llama.cpp's `llama-perplexity`
//! counts it, and the KL divergence of a model's next-token distributions from a base's
//! (the quality gate: `--kld-max`).
//!
//! Counting: the text is tokenized whole (a BOS first only when the vocabulary asks for
//! one; Qwen's do not) and cut into consecutive windows of `--ctx` tokens, the tail that
//! fills no window dropped; each window is evaluated from an empty state (with the BOS, when
//! there is one, in place of its first token), and only its second half is scored: the
//! logits at positions ctx/2 … ctx−2 against the tokens that follow them, ctx − 1 − ctx/2
//! predictions per window, so every scored token has at least ctx/2 tokens of context.
//! The perplexity is exp of the mean negative log-likelihood over all scored tokens.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use engine::{Engine, EngineConfig};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Counted as llama-perplexity counts: the text is tokenized whole (a \
BOS only when the vocabulary asks for one; Qwen's do not) and cut into windows of --ctx tokens \
(the tail that fills no window is dropped); each window is evaluated from an empty state and \
only its second half is scored (positions ctx/2 to ctx-2 predicting the next token: ctx-1-ctx/2 \
tokens per window). The text must hold at least two windows.

KL divergence (--kld-base): for every scored position, KL(base || this model) over the \
next-token distributions, then its mean, percentiles and the share of positions where both \
models' most likely token is the same. A base GGUF is run in this process (exact, over the \
whole vocabulary); a base .npy is what --save-logits wrote on an earlier run with the same \
text, --ctx and --chunks. Saved with --save-top-k K, it holds each position's K most likely \
tokens: the KL divergence is then that of the two distributions with every other token \
merged into one outcome, a lower bound of the full one (--save-top-k 0 keeps every token: \
4 bytes per vocabulary entry and position)."
)]
pub struct PerplexityArgs {
    /// Model file (GGUF; the first shard of a split model) [default: the demo model,
    /// models/demo.gguf].
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The text to score (UTF-8; an incomplete character at its very end is dropped).
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Tokens per window (at least 16).
    #[arg(short = 'c', long = "ctx", default_value_t = 512)]
    pub ctx: usize,
    /// Score only the first N windows [default: every whole window of the text].
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Write this model's log-probabilities at the scored positions as float32 .npy, a
    /// base for a later --kld-base.
    #[arg(long = "save-logits", value_name = "FILE.npy")]
    pub save_logits: Option<PathBuf>,
    /// With --save-logits: keep each position's K most likely tokens (0: every token).
    #[arg(long = "save-top-k", default_value_t = 256, requires = "save_logits")]
    pub save_top_k: usize,
    /// The base to compare with: a .npy from --save-logits, or a GGUF model run here.
    #[arg(long = "kld-base", value_name = "BASE.npy|BASE.gguf")]
    pub kld_base: Option<PathBuf>,
    /// Fail (exit status 1) when the mean KL divergence from the base is above X.
    #[arg(long = "kld-max", value_name = "X", requires = "kld_base")]
    pub kld_max: Option<f64>,
    /// Where model steps run: cpu, cuda (device 0) or cuda:N (default: the engine
    /// chooses: the GPU when the build has CUDA and one is present, else the CPU).
    #[arg(long)]
    pub device: Option<engine::Device>,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
}

/// The positions of a window of `ctx` tokens whose logits are scored (each against the
/// token after it): llama-perplexity's second half.
pub fn scored_rows(ctx: usize) -> std::ops::Range<usize> {
    ctx / 2..ctx - 1
}

/// One row of logits, summarized: its largest logit, where it is, and ln Σ exp(l − max)
/// (the sum in f64, each term in f32 as llama-perplexity computes it).
#[derive(Debug, Clone, Copy)]
struct Row {
    max: f32,
    argmax: usize,
    ln_sum: f64,
}

impl Row {
    fn of(logits: &[f32]) -> Row {
        let (mut max, mut argmax) = (f32::NEG_INFINITY, 0);
        for (i, &l) in logits.iter().enumerate() {
            if l > max {
                (max, argmax) = (l, i);
            }
        }
        let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        Row {
            max,
            argmax,
            ln_sum: sum.ln(),
        }
    }
    /// ln p(i).
    fn log_prob(&self, logits: &[f32], i: usize) -> f64 {
        f64::from(logits[i] - self.max) - self.ln_sum
    }
}

/// KL(P ‖ Q) with P given by its log-probabilities `base` (every token) and Q by `logits`.
pub fn kld_full(base: &[f32], logits: &[f32]) -> f64 {
    let q = Row::of(logits);
    base.iter()
        .enumerate()
        .map(|(i, &lp)| {
            let lp = f64::from(lp);
            lp.exp() * (lp - q.log_prob(logits, i))
        })
        .sum::<f64>()
        .max(0.0)
}

/// KL(P ‖ Q) for P given by base logits (both over the whole vocabulary).
pub fn kld_logits(base: &[f32], logits: &[f32]) -> f64 {
    let p = Row::of(base);
    let q = Row::of(logits);
    base.iter()
        .enumerate()
        .map(|(i, _)| {
            let lp = p.log_prob(base, i);
            lp.exp() * (lp - q.log_prob(logits, i))
        })
        .sum::<f64>()
        .max(0.0)
}

/// KL divergence between P and Q coarsened to P's top-K tokens `ids` (their log-probs
/// `base`) and one outcome for every other token. By the log-sum inequality it is at most
/// the full KL(P ‖ Q), and equal to it when `ids` is the whole vocabulary.
pub fn kld_top_k(ids: &[u32], base: &[f32], logits: &[f32]) -> f64 {
    let q = Row::of(logits);
    let mut in_top = vec![false; logits.len()];
    let mut kl = 0.0;
    let mut p_top = 0.0;
    for (&i, &lp) in ids.iter().zip(base) {
        let (i, lp) = (i as usize, f64::from(lp));
        in_top[i] = true;
        p_top += lp.exp();
        kl += lp.exp() * (lp - q.log_prob(logits, i));
    }
    // The rest's mass under Q, summed directly (1 − Σ q over the top loses it to rounding).
    let q_rest: f64 = (0..logits.len())
        .filter(|&i| !in_top[i])
        .map(|i| q.log_prob(logits, i).exp())
        .sum();
    // With every token in the top there is no rest: 1 − Σ p is then the f32 log-probs'
    // rounding, which must not meet Q's empty rest.
    let p_rest = (1.0 - p_top).max(0.0);
    if p_rest > 0.0 && ids.len() < logits.len() {
        kl += p_rest * (p_rest.ln() - q_rest.max(f64::MIN_POSITIVE).ln());
    }
    kl.max(0.0)
}

/// llama-perplexity's percentile: linear interpolation between the sorted values.
pub fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    if fraction <= 0.0 {
        return sorted[0];
    }
    if fraction >= 1.0 {
        return sorted[sorted.len() - 1];
    }
    let p = fraction * (sorted.len() - 1) as f64;
    let i = p as usize;
    let f = p - i as f64;
    (1.0 - f) * sorted[i] + f * sorted[(i + 1).min(sorted.len() - 1)]
}

/// Mean and its standard error (llama-perplexity's `mean_and_uncertainty`).
pub fn mean_and_uncertainty(values: &[f64]) -> (f64, f64) {
    let n = values.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let var = values.iter().map(|v| v * v).sum::<f64>() / n as f64 - mean * mean;
    let err = if var > 0.0 && n > 1 {
        (var / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    (mean, err)
}

/// The quality gate: an error naming both numbers when the mean KL divergence is above
/// the allowed one.
pub fn gate(mean_kld: f64, kld_max: Option<f64>) -> Result<()> {
    match kld_max {
        Some(max) if mean_kld.is_nan() || mean_kld > max => bail!(
            "KLD gate failed: the mean KL divergence from the base is {mean_kld:.6}, above --kld-max {max}"
        ),
        _ => Ok(()),
    }
}

/// A saved base row: the scored token and its log-prob, then the kept tokens (every
/// token in id order, or the top K by probability) and their log-probs.
///
/// File layout, float32 .npy (ids are exact in f32 below 2^24):
/// - every token: `[rows, 1 + n_vocab]`: the scored token's id, then ln p of every token;
/// - top K: `[rows, 2 + 2K]`: the scored token's id and ln p, the K ids (most likely
///   first), their ln p. K < (n_vocab − 1) / 2, so the two shapes never coincide.
#[derive(Debug, Clone, PartialEq)]
pub enum SavedRow {
    Full {
        token: u32,
        log_probs: Vec<f32>,
    },
    TopK {
        token: u32,
        token_lp: f32,
        ids: Vec<u32>,
        log_probs: Vec<f32>,
    },
}

impl SavedRow {
    fn token(&self) -> u32 {
        match self {
            SavedRow::Full { token, .. } | SavedRow::TopK { token, .. } => *token,
        }
    }

    /// This row of `logits` (scored against `token`) as saved with `top_k` (0: every token).
    pub fn make(logits: &[f32], token: u32, top_k: usize) -> SavedRow {
        let r = Row::of(logits);
        if top_k == 0 {
            return SavedRow::Full {
                token,
                log_probs: (0..logits.len())
                    .map(|i| r.log_prob(logits, i) as f32)
                    .collect(),
            };
        }
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let by = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if top_k < idx.len() {
            idx.select_nth_unstable_by(top_k, by);
            idx.truncate(top_k);
        }
        idx.sort_by(by);
        SavedRow::TopK {
            token,
            token_lp: r.log_prob(logits, token as usize) as f32,
            log_probs: idx
                .iter()
                .map(|&i| r.log_prob(logits, i as usize) as f32)
                .collect(),
            ids: idx,
        }
    }

    fn to_f32(&self) -> Vec<f32> {
        match self {
            SavedRow::Full { token, log_probs } => {
                let mut v = vec![*token as f32];
                v.extend_from_slice(log_probs);
                v
            }
            SavedRow::TopK {
                token,
                token_lp,
                ids,
                log_probs,
            } => {
                let mut v = vec![*token as f32, *token_lp];
                v.extend(ids.iter().map(|&i| i as f32));
                v.extend_from_slice(log_probs);
                v
            }
        }
    }

    fn from_f32(row: &[f32], n_vocab: usize) -> SavedRow {
        let token = row[0] as u32;
        if row.len() == 1 + n_vocab {
            return SavedRow::Full {
                token,
                log_probs: row[1..].to_vec(),
            };
        }
        let k = (row.len() - 2) / 2;
        SavedRow::TopK {
            token,
            token_lp: row[1],
            ids: row[2..2 + k].iter().map(|&i| i as u32).collect(),
            log_probs: row[2 + k..].to_vec(),
        }
    }

    /// −ln p_base(token).
    fn nll(&self) -> f64 {
        match self {
            SavedRow::Full { token, log_probs } => -f64::from(log_probs[*token as usize]),
            SavedRow::TopK { token_lp, .. } => -f64::from(*token_lp),
        }
    }

    /// The base's most likely token.
    fn argmax(&self) -> usize {
        match self {
            SavedRow::Full { log_probs, .. } => {
                let mut best = 0;
                for (i, &lp) in log_probs.iter().enumerate() {
                    if lp > log_probs[best] {
                        best = i;
                    }
                }
                best
            }
            SavedRow::TopK { ids, .. } => ids.first().map_or(0, |&i| i as usize),
        }
    }

    fn kld(&self, logits: &[f32]) -> f64 {
        match self {
            SavedRow::Full { log_probs, .. } => kld_full(log_probs, logits),
            SavedRow::TopK { ids, log_probs, .. } => kld_top_k(ids, log_probs, logits),
        }
    }

    /// Columns of a row saved with `top_k` for a vocabulary of `n_vocab`.
    pub fn columns(top_k: usize, n_vocab: usize) -> usize {
        if top_k == 0 {
            1 + n_vocab
        } else {
            2 + 2 * top_k
        }
    }
}

/// What the model is compared with.
enum Base {
    Gguf(PathBuf, Box<Engine>),
    Saved {
        path: PathBuf,
        cols: usize,
        data: Vec<f32>,
        top_k: Option<usize>,
    },
}

/// One scored position's numbers.
#[derive(Debug, Clone, Copy, Default)]
struct Scored {
    nll: f64,
    base_nll: f64,
    kld: f64,
    same_top: bool,
}

/// The text of `path`; an incomplete UTF-8 character at its very end (a file cut at a
/// byte count) is dropped.
fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("-f: reading {}", path.display()))?;
    match String::from_utf8(bytes) {
        Ok(s) => Ok(s),
        Err(e) => {
            let err = e.utf8_error();
            if err.error_len().is_some() {
                bail!(
                    "-f {}: not UTF-8 text (invalid byte at offset {})",
                    path.display(),
                    err.valid_up_to()
                );
            }
            let mut b = e.into_bytes();
            b.truncate(err.valid_up_to());
            Ok(String::from_utf8(b).unwrap_or_default())
        }
    }
}

fn load(path: &Path, a: &PerplexityArgs) -> Result<Engine> {
    Engine::load(
        path,
        &EngineConfig {
            threads: a.threads,
            max_context: Some(a.ctx),
            parallel: Some(1),
            // Every window starts from an empty state: nothing to cache.
            prompt_cache: Some(0),
            device: a.device,
            ..Default::default()
        },
    )
    .map_err(|e| anyhow::anyhow!(server::load_message(&path.display().to_string(), &e)))
}

fn is_npy(p: &Path) -> bool {
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("npy"))
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    if a.ctx < 16 {
        bail!("--ctx {}: a window needs at least 16 tokens", a.ctx);
    }
    if a.chunks == Some(0) {
        bail!("--chunks 0: give at least 1 window (or leave it out for all)");
    }
    if let Some(n) = a.threads {
        engine::check_threads(n)?;
    }
    if let Some(x) = a.kld_max.filter(|x| x.is_nan() || *x < 0.0) {
        bail!("--kld-max {x}: give a KL divergence of 0 or more");
    }
    let text = read_text(&a.file)?;
    let model = crate::model_or_demo(a.model.as_deref())?;
    let save = match &a.save_logits {
        Some(p) => Some((
            p.clone(),
            std::fs::File::create(p)
                .with_context(|| format!("--save-logits: cannot create {}", p.display()))?,
        )),
        None => None,
    };
    let result = score(&a, &model, &text, save.as_ref().map(|(_, f)| f));
    if let (Err(_), Some((p, _))) = (&result, &save) {
        // Leave no partial base behind.
        let _ = std::fs::remove_file(p);
    }
    result
}

fn score(a: &PerplexityArgs, model: &Path, text: &str, save: Option<&std::fs::File>) -> Result<()> {
    let t0 = std::time::Instant::now();
    let mut eng = load(model, a)?;
    let info = eng.info().clone();
    let n_vocab = info.n_vocab;
    let tok = eng.tokenizer_arc();
    let mut tokens = tok.encode(text, false)?;
    let bos = tok.bos_id().filter(|_| tok.add_bos());
    if let Some(b) = bos {
        tokens.insert(0, b);
    }
    let ctx = a.ctx;
    if tokens.len() < 2 * ctx {
        bail!(
            "-f {}: {} tokens; perplexity at --ctx {ctx} needs at least {} (two windows): give a longer text or a smaller --ctx",
            a.file.display(),
            tokens.len(),
            2 * ctx
        );
    }
    let n_chunk = (tokens.len() / ctx).min(a.chunks.unwrap_or(usize::MAX));
    let rows = scored_rows(ctx);
    let per_chunk = rows.len();
    let n_rows = n_chunk * per_chunk;
    eprintln!(
        "scoria perplexity: {} ({}, {} layers), {}, loaded in {:.2}s",
        info.name,
        info.arch,
        info.n_layer,
        server::device::line(&eng.device_report()),
        t0.elapsed().as_secs_f64()
    );
    eprintln!(
        "scoria perplexity: {}: {} tokens{}; {n_chunk} windows of {ctx}, the last {per_chunk} predictions of each scored ({n_rows} tokens)",
        a.file.display(),
        tokens.len(),
        if bos.is_some() { " (with BOS)" } else { "" },
    );

    let mut base = match &a.kld_base {
        None => None,
        Some(p) if is_npy(p) => Some(read_base(p, n_vocab, n_rows)?),
        Some(p) => {
            let b = load(p, a)?;
            if b.info().n_vocab != n_vocab
                || b.tokenizer().encode(text, false)? != tokens[usize::from(bos.is_some())..]
            {
                bail!(
                    "--kld-base {}: its vocabulary is not {}'s (the text tokenizes differently); compare models of one vocabulary",
                    p.display(),
                    model.display()
                );
            }
            Some(Base::Gguf(p.clone(), Box::new(b)))
        }
    };

    let mut writer = match save {
        Some(f) => {
            if a.save_top_k != 0 && 2 * a.save_top_k + 1 >= n_vocab {
                bail!(
                    "--save-top-k {}: keep fewer than half of the {n_vocab} tokens, or 0 for every token",
                    a.save_top_k
                );
            }
            if n_vocab >= 1 << 24 {
                bail!(
                    "--save-logits: a vocabulary of {n_vocab} tokens has ids a float32 cannot hold"
                );
            }
            let mut w = BufWriter::with_capacity(8 << 20, f);
            engine::npy::write_header(&mut w, n_rows, SavedRow::columns(a.save_top_k, n_vocab))?;
            Some(w)
        }
        None => None,
    };

    let bar = ProgressBar::new(n_chunk as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{wide_bar}] {pos}/{len} windows, eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let keep_rows = writer.is_some();
    let mut scored: Vec<Scored> = Vec::with_capacity(n_rows);
    for c in 0..n_chunk {
        let start = c * ctx;
        let mut window = tokens[start..start + ctx].to_vec();
        if let Some(b) = bos {
            window[0] = b;
        }
        let logits = eng.logits_all(&window)?;
        let base_logits = match &mut base {
            Some(Base::Gguf(_, b)) => Some(b.logits_all(&window)?),
            _ => None,
        };
        let saved_rows: Vec<SavedRow> = match &base {
            Some(Base::Saved { cols, data, .. }) => (0..per_chunk)
                .map(|j| {
                    let r = c * per_chunk + j;
                    SavedRow::from_f32(&data[r * cols..(r + 1) * cols], n_vocab)
                })
                .collect(),
            _ => Vec::new(),
        };
        if let Some(Base::Saved { path, .. }) = &base {
            for (j, s) in saved_rows.iter().enumerate() {
                let want = tokens[start + rows.start + j + 1];
                if s.token() != want {
                    bail!(
                        "--kld-base {}: position {} scores token {} there and {want} here: it was saved from another text, --ctx or tokenizer",
                        path.display(),
                        c * per_chunk + j,
                        s.token()
                    );
                }
            }
        }
        let out: Vec<(Scored, Option<SavedRow>)> = rows
            .clone()
            .into_par_iter()
            .map(|j| {
                let l = &logits[j * n_vocab..(j + 1) * n_vocab];
                let next = tokens[start + j + 1];
                let r = Row::of(l);
                let mut s = Scored {
                    nll: -r.log_prob(l, next as usize),
                    ..Scored::default()
                };
                if let Some(bl) = &base_logits {
                    let b = &bl[j * n_vocab..(j + 1) * n_vocab];
                    let br = Row::of(b);
                    s.base_nll = -br.log_prob(b, next as usize);
                    s.kld = kld_logits(b, l);
                    s.same_top = br.argmax == r.argmax;
                } else if let Some(saved) = saved_rows.get(j - rows.start) {
                    s.base_nll = saved.nll();
                    s.kld = saved.kld(l);
                    s.same_top = saved.argmax() == r.argmax;
                }
                let keep = keep_rows.then(|| SavedRow::make(l, next, a.save_top_k));
                (s, keep)
            })
            .collect();
        for (s, keep) in out {
            scored.push(s);
            if let (Some(w), Some(row)) = (writer.as_mut(), keep) {
                for v in row.to_f32() {
                    w.write_all(&v.to_le_bytes())?;
                }
            }
        }
        let (m, _) = mean_and_uncertainty(&scored.iter().map(|s| s.nll).collect::<Vec<_>>());
        bar.set_message(format!("ppl {:.4}", m.exp()));
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(mut w) = writer {
        w.flush()?;
        if let Some(p) = &a.save_logits {
            eprintln!(
                "scoria perplexity: wrote {} scored positions ({}) to {}",
                n_rows,
                if a.save_top_k == 0 {
                    "every token".to_string()
                } else {
                    format!("top {}", a.save_top_k)
                },
                p.display()
            );
        }
    }

    let nlls: Vec<f64> = scored.iter().map(|s| s.nll).collect();
    let (m, err) = mean_and_uncertainty(&nlls);
    let ppl = m.exp();
    println!(
        "Final estimate: PPL = {ppl:.4} +/- {:.5} ({n_rows} tokens, {n_chunk} windows of {ctx}, in {:.1}s)",
        err * ppl,
        t0.elapsed().as_secs_f64()
    );
    let mut gate_result = Ok(());
    if let Some(b) = &base {
        let (name, top_k) = match b {
            Base::Gguf(p, _) => (p.display().to_string(), None),
            Base::Saved { path, top_k, .. } => (path.display().to_string(), *top_k),
        };
        let base_nlls: Vec<f64> = scored.iter().map(|s| s.base_nll).collect();
        let (bm, berr) = mean_and_uncertainty(&base_nlls);
        let ratio: Vec<f64> = scored.iter().map(|s| s.nll - s.base_nll).collect();
        let (rm, rerr) = mean_and_uncertainty(&ratio);
        let mut klds: Vec<f64> = scored.iter().map(|s| s.kld).collect();
        let (km, kerr) = mean_and_uncertainty(&klds);
        klds.sort_by(f64::total_cmp);
        let same = scored.iter().filter(|s| s.same_top).count() as f64 / n_rows as f64;
        let same_err = if n_rows > 1 {
            (same * (1.0 - same) / (n_rows - 1) as f64).sqrt()
        } else {
            0.0
        };
        println!(
            "====== KL divergence from {name}{} ======",
            match top_k {
                Some(k) => format!(" (its top {k} tokens and the rest: a lower bound)"),
                None => String::new(),
            }
        );
        println!("Mean PPL(Q)                : {ppl:10.4} ± {:.4}", err * ppl);
        println!(
            "Mean PPL(base)             : {:10.4} ± {:.4}",
            bm.exp(),
            berr * bm.exp()
        );
        println!("Mean ln(PPL(Q)/PPL(base))  : {rm:10.6} ± {rerr:.6}");
        println!("Mean    KLD                : {km:10.6} ± {kerr:.6}");
        println!(
            "Maximum KLD                : {:10.6}",
            klds.last().copied().unwrap_or(0.0)
        );
        println!(
            "99.9%   KLD                : {:10.6}",
            percentile(&klds, 0.999)
        );
        println!(
            "99.0%   KLD                : {:10.6}",
            percentile(&klds, 0.99)
        );
        println!(
            "Median  KLD                : {:10.6}",
            percentile(&klds, 0.5)
        );
        println!(
            "Same top-1                 : {:8.3} ± {:.3} %",
            100.0 * same,
            100.0 * same_err
        );
        gate_result = gate(km, a.kld_max);
        if gate_result.is_ok() {
            if let Some(x) = a.kld_max {
                eprintln!("scoria perplexity: KLD gate passed: mean KL divergence {km:.6} ≤ --kld-max {x}");
            }
        }
    }
    println!("perplexity: {ppl:.4}");
    gate_result
}

fn read_base(path: &Path, n_vocab: usize, n_rows: usize) -> Result<Base> {
    let (shape, data) =
        engine::npy::read_f32(path).with_context(|| format!("--kld-base {}", path.display()))?;
    let cols = match shape[..] {
        [_, c] => c,
        _ => bail!(
            "--kld-base {}: shape {shape:?}; a base from --save-logits is 2-D",
            path.display()
        ),
    };
    let top_k = if cols == 1 + n_vocab {
        None
    } else if cols >= 4 && cols % 2 == 0 && 2 * ((cols - 2) / 2) + 1 < n_vocab {
        Some((cols - 2) / 2)
    } else {
        bail!(
            "--kld-base {}: rows of {cols} values are neither every token of this model's vocabulary ({} values) nor a top-K row (2 + 2K): it was saved from another model",
            path.display(),
            1 + n_vocab
        )
    };
    if shape[0] < n_rows {
        bail!(
            "--kld-base {}: {} scored positions saved, this run scores {n_rows}: save the base with the same -f, --ctx and --chunks",
            path.display(),
            shape[0]
        );
    }
    if let Some(k) = top_k {
        // Ids must be tokens of this vocabulary.
        if let Some(r) = (0..n_rows).find(|&r| {
            data[r * cols + 2..r * cols + 2 + k]
                .iter()
                .any(|&i| i < 0.0 || i as usize >= n_vocab)
        }) {
            bail!(
                "--kld-base {}: position {r} holds a token id outside this model's vocabulary of {n_vocab}",
                path.display()
            );
        }
    }
    Ok(Base::Saved {
        path: path.to_path_buf(),
        cols,
        data,
        top_k,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// −ln p(token) under `logits`.
    fn nll(logits: &[f32], token: usize) -> f64 {
        -Row::of(logits).log_prob(logits, token)
    }

    fn softmax(l: &[f32]) -> Vec<f64> {
        let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    #[test]
    fn the_second_half_of_each_window_is_scored_as_llama_perplexity_scores_it() {
        // ctx 512: positions 256..=510, 255 predictions (n_ctx - 1 - n_ctx/2).
        assert_eq!(scored_rows(512), 256..511);
        assert_eq!(scored_rows(512).len(), 512 - 1 - 256);
        assert_eq!(scored_rows(17), 8..16);
    }

    #[test]
    fn nll_is_minus_the_log_softmax() {
        let l = [1.0f32, 2.0, 0.5, -3.0];
        let p = softmax(&l);
        for (t, pt) in p.iter().enumerate() {
            assert!((nll(&l, t) + pt.ln()).abs() < 1e-6);
        }
    }

    #[test]
    fn kld_is_zero_for_equal_rows_and_matches_the_definition() {
        let p = [0.3f32, -1.0, 2.0, 0.0, 1.5];
        let q = [0.1f32, -0.5, 1.7, 0.4, 1.5];
        assert!(kld_logits(&p, &p).abs() < 1e-12);
        let (pp, qq) = (softmax(&p), softmax(&q));
        let want: f64 = pp.iter().zip(&qq).map(|(a, b)| a * (a / b).ln()).sum();
        assert!((kld_logits(&p, &q) - want).abs() < 1e-7);
        let lp: Vec<f32> = pp.iter().map(|x| x.ln() as f32).collect();
        assert!((kld_full(&lp, &q) - want).abs() < 1e-6);
    }

    #[test]
    fn top_k_kld_is_exact_with_every_token_and_a_lower_bound_with_fewer() {
        let p: Vec<f32> = (0..50)
            .map(|i| ((i * 37) % 11) as f32 * 0.4 - 1.0)
            .collect();
        let q: Vec<f32> = (0..50)
            .map(|i| ((i * 29) % 13) as f32 * 0.3 - 1.2)
            .collect();
        let full = kld_logits(&p, &q);
        let row = |k| match SavedRow::make(&p, 3, k) {
            SavedRow::TopK { ids, log_probs, .. } => kld_top_k(&ids, &log_probs, &q),
            SavedRow::Full { .. } => unreachable!(),
        };
        assert!((row(50) - full).abs() < 1e-6, "{} vs {full}", row(50));
        for k in [1, 5, 20, 49] {
            assert!(row(k) <= full + 1e-9, "k {k}: {} > {full}", row(k));
        }
        assert!(row(20) > 0.5 * full);
    }

    #[test]
    fn saved_rows_read_back_as_written() {
        let l: Vec<f32> = (0..40).map(|i| (i as f32 * 0.77).sin() * 3.0).collect();
        for k in [0, 4] {
            let r = SavedRow::make(&l, 7, k);
            let v = r.to_f32();
            assert_eq!(v.len(), SavedRow::columns(k, 40));
            let back = SavedRow::from_f32(&v, 40);
            assert_eq!(back, r);
            assert!((back.nll() - nll(&l, 7)).abs() < 1e-5);
            assert_eq!(back.argmax(), Row::of(&l).argmax);
        }
        // The top K, most likely first.
        if let SavedRow::TopK { ids, log_probs, .. } = SavedRow::make(&l, 7, 4) {
            assert_eq!(ids[0] as usize, Row::of(&l).argmax);
            assert!(log_probs.windows(2).all(|w| w[0] >= w[1]));
        }
    }

    #[test]
    fn percentiles_interpolate_as_llama_perplexity_does() {
        let v = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.0);
        assert!((percentile(&v, 0.99) - 3.96).abs() < 1e-12);
        assert_eq!(percentile(&v, 1.0), 4.0);
        let (m, e) = mean_and_uncertainty(&v);
        assert_eq!(m, 2.0);
        assert!((e - (2.0f64 / 4.0).sqrt()).abs() < 1e-12);
    }

    #[test]
    fn the_gate_fails_above_its_threshold_and_only_then() {
        assert!(gate(0.02, None).is_ok());
        assert!(gate(0.01, Some(0.01)).is_ok());
        assert!(gate(0.0099, Some(0.01)).is_ok());
        let e = gate(0.0101, Some(0.01)).unwrap_err().to_string();
        assert!(
            e.contains("0.010100") && e.contains("--kld-max 0.01"),
            "{e}"
        );
        assert!(!e.contains('\n'), "one line: {e}");
        // A NaN divergence is never a pass.
        assert!(gate(f64::NAN, Some(1.0)).is_err());
    }
}
