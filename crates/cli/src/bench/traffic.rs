//! What one decode token reads from RAM on the CPU, and the RAM's measured read
//! bandwidth: `scoria bench` reports a CPU generation test's achieved GB/s against
//! that bound (docs/benchmarks.md, "the bound").
//!
//! A decode token reads every dense matrix whole (the attention and DeltaNet
//! projections, routers, shared experts, norms and the LM head — the embedding when
//! the head is tied to it, else one row of it), `top-k` of each layer's routed
//! experts (distinct under random routing; fewer bytes when tokens of a real model
//! share experts), the recurrent state once read and once written, and the K/V of
//! the positions it attends to. The MTP block is not run.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use model::synth::accounting::{self, Accounting, Group};
use rayon::prelude::*;

use super::TestSpec;

/// The parts of a decode token's RAM reads (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeTraffic {
    /// Dense weights read whole each token.
    pub dense: u64,
    /// `top-k / n_expert` of the routed experts.
    pub experts: u64,
    /// The recurrent state, read and written.
    pub state: u64,
    /// K/V bytes of one attended position.
    pub kv_per_position: u64,
}

impl DecodeTraffic {
    /// From the model file's tensor accounting and the engine's state sizes.
    pub fn read(
        path: &Path,
        f: &gguf::GgufFile,
        info: &engine::ModelInfo,
        mem: &engine::MemoryAccount,
    ) -> Result<DecodeTraffic> {
        let acc = accounting::account(f).with_context(|| format!("{}", path.display()))?;
        Ok(DecodeTraffic::new(
            &acc,
            (info.n_expert_used, info.n_expert),
            mem.recurrent_bytes,
            mem.bytes_per_position,
        ))
    }

    /// From a file's accounting, its routing (top-k, experts per layer), the
    /// recurrent-state bytes of one sequence and the K/V bytes of one position.
    pub fn new(
        acc: &Accounting,
        (k, n): (usize, usize),
        recurrent: u64,
        kv_per_position: u64,
    ) -> DecodeTraffic {
        let group = |g: Group| acc.groups.get(&g).map_or(0, |t| t.bytes);
        let head_tied = group(Group::Output) == 0;
        let dense = Group::ALL
            .into_iter()
            .filter(|&g| match g {
                Group::RoutedExperts | Group::Mtp => false,
                Group::Embedding => head_tied,
                _ => true,
            })
            .map(group)
            .sum();
        DecodeTraffic {
            dense,
            experts: experts_read(group(Group::RoutedExperts), k, n),
            state: 2 * recurrent,
            kv_per_position,
        }
    }

    /// Bytes one generated token of test `t` reads, at the test's mean depth.
    pub fn per_token(&self, t: &TestSpec) -> u64 {
        let positions = (t.prefix_len() + t.n_gen / 2) as u64;
        self.dense + self.experts + self.state + self.kv_per_position * positions
    }

    /// `reads ~X GB a token (…): Y GB/s, Z% of the RAM bound (B t/s)`.
    pub fn line(&self, t: &TestSpec, tps: f64, ram_bps: Option<f64>) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let per = self.per_token(t);
        let achieved = per as f64 * tps;
        let mut s = format!(
            "RAM traffic: ~{:.3} GB a token (dense weights {:.3}, routed experts {:.3}, recurrent state {:.3}, K/V {:.3}): {:.1} GB/s at the median",
            gb(per),
            gb(self.dense),
            gb(self.experts),
            gb(self.state),
            gb(per - self.dense - self.experts - self.state),
            achieved / 1e9
        );
        if let Some(bw) = ram_bps.filter(|&b| b > 0.0 && per > 0) {
            s.push_str(&format!(
                ", {:.0}% of the RAM bound ({:.1} GB/s measured: {:.1} t/s)",
                100.0 * achieved / bw,
                bw / 1e9,
                bw / per as f64
            ));
        }
        s
    }
}

/// Routed expert bytes a token reads: `k` of every layer's `n` experts.
fn experts_read(routed: u64, k: usize, n: usize) -> u64 {
    if n == 0 {
        return 0;
    }
    (routed as u128 * k as u128 / n as u128) as u64
}

/// RAM read bandwidth with the engine's threads: the best of three parallel passes
/// over 1 GiB (several times the largest last-level caches), in bytes per second.
/// Each pass asks for its data [`quant::PREFETCH_AHEAD`] bytes ahead, as the engine's
/// row loops do (without it, the passes measured 90.6 GB/s on the GPU machine's host,
/// where a decode step's LM head read at 110: a bound the engine beat).
pub fn measure_ram_read() -> f64 {
    const WORDS: usize = (1 << 30) / 8;
    /// Words per 64-byte line, and words ahead.
    const LINE: usize = 8;
    const AHEAD: usize = quant::PREFETCH_AHEAD / 8;
    let buf: Vec<u64> = (0..WORDS as u64).into_par_iter().collect();
    let chunk = (WORDS / (4 * rayon::current_num_threads().max(1))).max(1 << 12);
    let sum_chunk = |c: &[u64]| {
        let mut acc = 0u64;
        for (i, line) in c.chunks(LINE).enumerate() {
            let ahead = (i * LINE + AHEAD).min(c.len());
            quant::prefetch(&c[ahead..(ahead + LINE).min(c.len())]);
            acc = line.iter().fold(acc, |a, &x| a.wrapping_add(x));
        }
        acc
    };
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        let sum: u64 = buf
            .par_chunks(chunk)
            .map(sum_chunk)
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    (WORDS * 8) as f64 / best.max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n_gen: usize, n_depth: usize) -> TestSpec {
        TestSpec {
            n_prompt: 0,
            n_gen,
            n_depth,
            n_streams: 1,
        }
    }

    #[test]
    fn a_token_reads_the_dense_part_k_experts_the_state_twice_and_its_positions() {
        assert_eq!(experts_read(512 * 100, 10, 512), 1000);
        assert_eq!(experts_read(7, 1, 0), 0);
        let t = DecodeTraffic {
            dense: 1_000,
            experts: 200,
            state: 30,
            kv_per_position: 4,
        };
        // tg128 at depth 0: the prefix is one token, the mean position 1 + 64.
        assert_eq!(t.per_token(&spec(128, 0)), 1_000 + 200 + 30 + 4 * 65);
        assert_eq!(
            t.per_token(&spec(128, 4096)),
            1_000 + 200 + 30 + 4 * (4096 + 64)
        );
        let line = t.line(&spec(128, 0), 1e6, Some(2.98e9));
        assert!(line.contains("1.5 GB/s at the median"), "{line}");
        assert!(line.contains("50% of the RAM bound"), "{line}");
        assert!(!t.line(&spec(128, 0), 1e6, None).contains("bound"));
    }

    #[test]
    fn the_demo_model_is_accounted_whole() {
        // Every tensor byte of the embedded demo model is read whole each token, or is
        // a routed expert (k of n read), or the embedding (rows) beside an untied
        // head, or the MTP block (not run).
        let path = model::synth::demo_model_path().expect("demo model");
        let f = gguf::GgufFile::open(&path).expect("open");
        let cfg = model::ModelConfig::from_gguf(&f).expect("config");
        let acc = accounting::account(&f).expect("account");
        let (k, n) = (cfg.n_expert_used, cfg.n_expert);
        let t = DecodeTraffic::new(&acc, (k, n), 5, 3);
        let g = |x: Group| acc.groups.get(&x).map_or(0, |t| t.bytes);
        let routed = g(Group::RoutedExperts);
        assert!(routed > 0 && t.dense > 0);
        let rows_only = if g(Group::Output) == 0 {
            0
        } else {
            g(Group::Embedding)
        };
        assert_eq!(
            t.dense + routed + rows_only + g(Group::Mtp),
            acc.tensor_data()
        );
        assert_eq!(t.experts, routed * k as u64 / n as u64);
        assert_eq!((t.state, t.kv_per_position), (10, 3));
    }
}
