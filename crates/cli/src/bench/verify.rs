//! `scoria bench --verify 1,2,4,8`: what a speculative verify step of N tokens costs
//! (the pending token and N − 1 drafts, every row's greedy token, the trail kept for
//! a rollback), against a decode step of one token, and the speedup that implies.
//!
//! At each depth D the engine evaluates D random ids (not timed), then runs the steps
//! one after another, each rolled back to its first token afterwards (every draft
//! rejected), so each starts one position after the one before: a warm-up round of
//! every size (graphs are captured there), then `-r` timed rounds. A step's time is its
//! wall time until its tokens are on the host (`Engine::time_verify`).
//!
//! The implied speedup of drafting k = N − 1 tokens, each accepted with probability a
//! independently: a step emits 1 + a + … + a^k tokens on average, in the time t(N),
//! where plain decoding emits one in t(1): (1 − a^N) / (1 − a) · t(1) / t(N). The
//! drafts' own cost is left out (prompt lookup's is negligible; an MTP draft's is one
//! pass of its block and the LM head per token).

use anyhow::{bail, Context, Result};
use engine::Engine;

use super::report::summarize;
use super::{random_ids, Format};

/// The acceptance rates the implied speedups are given for.
const ACCEPTANCE: [f64; 3] = [0.6, 0.75, 0.9];

/// One size at one depth: its samples (ms).
struct Row {
    depth: usize,
    tokens: usize,
    ms: Vec<f64>,
}

/// The positions the verify runs need at depth `depth`: the prefix, one position
/// per step, and the longest step's tokens.
pub fn n_ctx_needed(depth: usize, sizes: &[usize], reps: usize) -> usize {
    depth + (reps + 1) * sizes.len() + sizes.iter().max().copied().unwrap_or(1)
}

/// The sizes to time: those asked for, sorted, with 1 (the decode step every speedup
/// is relative to).
pub fn sizes(asked: &[usize]) -> Result<Vec<usize>> {
    if asked.contains(&0) {
        bail!("--verify: a verify step feeds at least one token (the pending one)");
    }
    let mut s = asked.to_vec();
    s.push(1);
    s.sort_unstable();
    s.dedup();
    Ok(s)
}

/// Times every size at every depth and returns the report in `format`, its rows
/// labelled with the model's and the backend's names.
pub fn run(
    eng: &mut Engine,
    sizes: &[usize],
    depths: &[usize],
    reps: usize,
    seed: u64,
    format: Format,
    (model, backend): (&str, &str),
) -> Result<String> {
    let n_vocab = eng.info().n_vocab;
    let mut rows = Vec::new();
    for (i, &depth) in depths.iter().enumerate() {
        let prefix = random_ids(seed, i, 0, depth, n_vocab);
        // Round `run` (0: the warm-up) runs every size once, in order.
        let steps: Vec<Vec<u32>> = (0..=reps)
            .flat_map(|_| sizes.iter().copied())
            .enumerate()
            .map(|(k, n)| random_ids(seed ^ 0x5eed, i, (k + 1) as u64, n, n_vocab))
            .collect();
        let ms = eng
            .time_verify(&prefix, &steps)
            .with_context(|| format!("verify steps at depth {depth}"))?;
        for (j, &n) in sizes.iter().enumerate() {
            // Round 0 is the warm-up.
            let samples = (1..=reps).map(|run| ms[run * sizes.len() + j]).collect();
            rows.push(Row {
                depth,
                tokens: n,
                ms: samples,
            });
        }
        eprintln!("scoria bench: verify steps at depth {depth} done");
    }
    Ok(match format {
        Format::Md => markdown(&rows, model, backend),
        Format::Jsonl => objects(&rows, model, backend)
            .map(|v| format!("{v}\n"))
            .collect(),
        Format::Json => format!(
            "{:#}\n",
            serde_json::json!({
                "tool": "scoria bench --verify",
                "rows": objects(&rows, model, backend).collect::<Vec<_>>(),
            })
        ),
    })
}

/// The median ms of a decode step at `depth` (the `tokens` 1 row).
fn one_token(rows: &[Row], depth: usize) -> f64 {
    rows.iter()
        .find(|r| r.depth == depth && r.tokens == 1)
        .map_or(f64::NAN, |r| summarize(&r.ms).median)
}

/// (1 − a^n) / (1 − a) · t1 / tn.
pub fn implied(a: f64, n: usize, t1: f64, tn: f64) -> f64 {
    (1.0 - a.powi(n as i32)) / (1.0 - a) * t1 / tn
}

fn markdown(rows: &[Row], model: &str, backend: &str) -> String {
    let mut out = String::from(
        "| model | backend | depth | tokens | ms (median) | ms (runs) | × one token | implied at 0.6 | at 0.75 | at 0.9 |\n\
         | ----- | ------- | ----: | -----: | ----------: | --------- | ----------: | -------------: | ------: | -----: |\n",
    );
    for r in rows {
        let t1 = one_token(rows, r.depth);
        let m = summarize(&r.ms).median;
        let runs: Vec<String> = r.ms.iter().map(|x| format!("{x:.3}")).collect();
        let sp: Vec<String> = ACCEPTANCE
            .iter()
            .map(|&a| format!("{:.2}×", implied(a, r.tokens, t1, m)))
            .collect();
        out.push_str(&format!(
            "| {model} | {backend} | {} | {} | {m:.3} | {} | {:.2} | {} |\n",
            r.depth,
            r.tokens,
            runs.join(", "),
            m / t1,
            sp.join(" | ")
        ));
    }
    out.push_str(
        "\nimplied: (1 − a^N) / (1 − a) · t(1) / t(N), drafts accepted independently with \
         probability a, the drafts' own cost left out\n",
    );
    out
}

/// One JSON object per row.
fn objects<'a>(
    rows: &'a [Row],
    model: &'a str,
    backend: &'a str,
) -> impl Iterator<Item = serde_json::Value> + 'a {
    rows.iter().map(move |r| {
        let t1 = one_token(rows, r.depth);
        let m = summarize(&r.ms).median;
        let implied: serde_json::Map<String, serde_json::Value> = ACCEPTANCE
            .iter()
            .map(|&a| (format!("{a}"), implied(a, r.tokens, t1, m).into()))
            .collect();
        serde_json::json!({
            "test": "verify",
            "model": model,
            "backend": backend,
            "n_depth": r.depth,
            "tokens": r.tokens,
            "ms": r.ms,
            "ms_median": m,
            "relative_to_one_token": m / t1,
            "implied_speedup": implied,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn implied_speedup_counts_the_expected_tokens_per_step() {
        // One token: no drafts, the same speed.
        assert!((implied(0.75, 1, 2.0, 2.0) - 1.0).abs() < 1e-12);
        // 4 tokens at a = 0.5: 1 + 0.5 + 0.25 + 0.125 = 1.875 tokens per step; a step
        // costing 1.5 decode steps gives 1.25×.
        assert!((implied(0.5, 4, 1.0, 1.5) - 1.25).abs() < 1e-12);
    }

    #[test]
    fn sizes_always_include_one_token() {
        assert_eq!(sizes(&[8, 2, 4, 2]).unwrap(), vec![1, 2, 4, 8]);
        assert!(sizes(&[0, 2]).is_err());
    }
}
