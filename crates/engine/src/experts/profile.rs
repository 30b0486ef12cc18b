//! Routing profiles: how often each (layer, expert) is chosen.
//!
//! [`RoutingCounts`] is the recorder the CPU executor's MoE bumps for every
//! (token, chosen expert) when [`CpuBackend::routing`](crate::cpu::CpuBackend) holds one;
//! [`RoutingProfile`] is its saved form (`scoria profile -o routing.json`), read back and
//! checked against the model with [`RoutingProfile::load`]. The slot planner
//! ([`super::plan`]) divides VRAM slots between layers by the demand a profile measures.
//!
//! A profile file is JSON:
//! `{ "model", "arch", "n_layer", "n_expert", "top_k", "tokens", "counts" }`, `counts`
//! holding `n_layer` rows of `n_expert` counts. Routing picks `top_k` distinct experts
//! for every token in every layer, so each row sums to `tokens × top_k`; `load` checks it.

use model::ModelConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Routing counts per (layer, expert), shared between the executor and a reader.
///
/// Relaxed atomics: each bump is independent, and a snapshot taken while a step runs
/// may see part of it (take snapshots between steps for exact totals).
#[derive(Debug)]
pub struct RoutingCounts {
    n_layer: usize,
    n_expert: usize,
    /// `counts[layer · n_expert + expert]`.
    counts: Vec<AtomicU64>,
    /// Tokens routed per layer.
    tokens: Vec<AtomicU64>,
    /// While set, every recorded token's experts are also appended to `trace`.
    tracing: AtomicBool,
    /// Per layer: the experts of each routed token, in the order recorded (top-k per
    /// token, in rank order).
    trace: Mutex<Vec<Vec<u32>>>,
}

impl RoutingCounts {
    pub fn new(n_layer: usize, n_expert: usize) -> RoutingCounts {
        RoutingCounts {
            n_layer,
            n_expert,
            counts: (0..n_layer * n_expert).map(|_| AtomicU64::new(0)).collect(),
            tokens: (0..n_layer).map(|_| AtomicU64::new(0)).collect(),
            tracing: AtomicBool::new(false),
            trace: Mutex::new(Vec::new()),
        }
    }

    /// A recorder shaped for `cfg`'s trunk layers.
    pub fn for_model(cfg: &ModelConfig) -> RoutingCounts {
        Self::new(cfg.n_layer, cfg.n_expert)
    }

    pub fn n_layer(&self) -> usize {
        self.n_layer
    }

    pub fn n_expert(&self) -> usize {
        self.n_expert
    }

    /// Records one token's routing in `layer`: each chosen expert once. Indices outside
    /// the recorder's shape are a programming error (the recorder is shaped from the
    /// same config the executor runs): they are skipped, and debug builds assert.
    #[inline]
    pub fn record_token(&self, layer: usize, experts: impl IntoIterator<Item = usize>) {
        debug_assert!(layer < self.n_layer, "layer {layer} of {}", self.n_layer);
        let Some(tokens) = self.tokens.get(layer) else {
            return;
        };
        tokens.fetch_add(1, Ordering::Relaxed);
        let row = layer * self.n_expert;
        let mut trace = if self.tracing.load(Ordering::Relaxed) {
            Some(self.trace.lock().unwrap_or_else(|e| e.into_inner()))
        } else {
            None
        };
        for e in experts {
            debug_assert!(e < self.n_expert, "expert {e} of {}", self.n_expert);
            if e < self.n_expert {
                self.counts[row + e].fetch_add(1, Ordering::Relaxed);
                if let Some(t) = trace.as_mut() {
                    t[layer].push(e as u32);
                }
            }
        }
    }

    /// Starts keeping, besides the counts, every token's experts in the order they are
    /// recorded ([`RoutingCounts::take_trace`]): the routing of one sequence, token by
    /// token, to replay through the expert store. Record one sequence at a time (the
    /// trace of several decoded together interleaves them).
    pub fn start_trace(&self) {
        let mut t = self.trace.lock().unwrap_or_else(|e| e.into_inner());
        *t = vec![Vec::new(); self.n_layer];
        self.tracing.store(true, Ordering::Relaxed);
    }

    /// The trace since [`RoutingCounts::start_trace`], per layer: `top_k` experts per
    /// token in rank order, tokens in order; tracing stops.
    pub fn take_trace(&self) -> Vec<Vec<u32>> {
        self.tracing.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.trace.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Counts per layer, per expert.
    pub fn snapshot(&self) -> Vec<Vec<u64>> {
        self.counts
            .chunks(self.n_expert.max(1))
            .take(self.n_layer)
            .map(|row| row.iter().map(|c| c.load(Ordering::Relaxed)).collect())
            .collect()
    }

    /// Tokens routed through `layer` so far.
    pub fn tokens(&self, layer: usize) -> u64 {
        self.tokens
            .get(layer)
            .map_or(0, |t| t.load(Ordering::Relaxed))
    }

    pub fn reset(&self) {
        for c in self.counts.iter().chain(&self.tokens) {
            c.store(0, Ordering::Relaxed);
        }
    }
}

/// Why a profile cannot be read or does not fit the model; names the field.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("{}: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{}: not a routing profile: {cause}", path.display())]
    Parse {
        path: PathBuf,
        cause: serde_json::Error,
    },
    #[error("routing profile{}: `{field}`: {msg}", at(.path))]
    Invalid {
        path: Option<PathBuf>,
        field: String,
        msg: String,
    },
}

fn at(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map(|p| format!(" {}", p.display()))
        .unwrap_or_default()
}

/// A saved routing profile (see the module docs for the file format).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutingProfile {
    /// The model's `general.name` (or file stem): for people; not checked.
    pub model: String,
    pub arch: String,
    pub n_layer: usize,
    pub n_expert: usize,
    /// Experts chosen per token (`n_expert_used`).
    pub top_k: usize,
    /// Tokens routed (prompt and decode), the same in every layer.
    pub tokens: u64,
    /// `counts[layer][expert]`.
    pub counts: Vec<Vec<u64>>,
}

impl RoutingProfile {
    /// The profile of what `counts` recorded for a model of `cfg` called `model`.
    pub fn from_counts(
        model: &str,
        cfg: &ModelConfig,
        counts: &RoutingCounts,
    ) -> Result<RoutingProfile, ProfileError> {
        let p = RoutingProfile {
            model: model.to_string(),
            arch: cfg.arch.name().to_string(),
            n_layer: counts.n_layer(),
            n_expert: counts.n_expert(),
            top_k: cfg.n_expert_used,
            tokens: counts.tokens(0),
            counts: counts.snapshot(),
        };
        for l in 1..p.n_layer {
            if counts.tokens(l) != p.tokens {
                return Err(p.invalid(
                    "tokens",
                    format!(
                        "layer 0 routed {} tokens but layer {l} routed {} (snapshot taken during a step?)",
                        p.tokens,
                        counts.tokens(l)
                    ),
                ));
            }
        }
        p.validate(cfg)?;
        Ok(p)
    }

    fn invalid(&self, field: &str, msg: String) -> ProfileError {
        ProfileError::Invalid {
            path: None,
            field: field.to_string(),
            msg,
        }
    }

    /// Reads `path` and checks it against `cfg` ([`RoutingProfile::validate`]).
    pub fn load(path: &Path, cfg: &ModelConfig) -> Result<RoutingProfile, ProfileError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ProfileError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        let p: RoutingProfile =
            serde_json::from_str(&text).map_err(|cause| ProfileError::Parse {
                path: path.to_path_buf(),
                cause,
            })?;
        p.validate(cfg).map_err(|e| match e {
            ProfileError::Invalid { field, msg, .. } => ProfileError::Invalid {
                path: Some(path.to_path_buf()),
                field,
                msg,
            },
            e => e,
        })?;
        Ok(p)
    }

    /// Writes the profile as JSON (one line per layer).
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        let io = |cause| ProfileError::Io {
            path: path.to_path_buf(),
            cause,
        };
        let head = serde_json::json!({
            "model": self.model,
            "arch": self.arch,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "top_k": self.top_k,
            "tokens": self.tokens,
        });
        // Hand-assembled so each layer's counts stay on one line: a person can read the
        // file, and it is still plain JSON.
        let mut s = head.to_string();
        s.pop(); // the closing brace
        s.push_str(",\"counts\":[\n");
        for (l, row) in self.counts.iter().enumerate() {
            let row = serde_json::to_string(row).map_err(|e| io(std::io::Error::other(e)))?;
            s.push_str("  ");
            s.push_str(&row);
            s.push_str(if l + 1 < self.counts.len() {
                ",\n"
            } else {
                "\n"
            });
        }
        s.push_str("]}\n");
        std::fs::write(path, s).map_err(io)
    }

    /// Checks that the profile belongs to a model of `cfg` and is self-consistent: arch,
    /// layer and expert counts, top-k, the shape of `counts`, and that every layer's
    /// counts sum to `tokens × top_k`.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<(), ProfileError> {
        let check = |field: &str, found: String, expected: String| {
            if found == expected {
                Ok(())
            } else {
                Err(self.invalid(
                    field,
                    format!("the profile says {found}, the model has {expected}: record a profile of this model with `scoria profile`"),
                ))
            }
        };
        check("arch", self.arch.clone(), cfg.arch.name().to_string())?;
        check("n_layer", self.n_layer.to_string(), cfg.n_layer.to_string())?;
        check(
            "n_expert",
            self.n_expert.to_string(),
            cfg.n_expert.to_string(),
        )?;
        check(
            "top_k",
            self.top_k.to_string(),
            cfg.n_expert_used.to_string(),
        )?;
        if self.tokens == 0 {
            return Err(self.invalid("tokens", "is 0: the profile measured nothing".into()));
        }
        if self.counts.len() != self.n_layer {
            return Err(self.invalid(
                "counts",
                format!(
                    "has {} rows, expected one per layer ({})",
                    self.counts.len(),
                    self.n_layer
                ),
            ));
        }
        let per_layer = self.tokens.checked_mul(self.top_k as u64);
        for (l, row) in self.counts.iter().enumerate() {
            if row.len() != self.n_expert {
                return Err(self.invalid(
                    &format!("counts[{l}]"),
                    format!(
                        "has {} entries, expected one per expert ({})",
                        row.len(),
                        self.n_expert
                    ),
                ));
            }
            let sum = row.iter().try_fold(0u64, |a, &c| a.checked_add(c));
            if sum.is_none() || sum != per_layer {
                return Err(self.invalid(
                    &format!("counts[{l}]"),
                    format!(
                        "sums to {}, but {} tokens × top-{} routes make {}",
                        sum.map_or("more than 2^64".to_string(), |s| s.to_string()),
                        self.tokens,
                        self.top_k,
                        per_layer.map_or("more than 2^64".to_string(), |s| s.to_string()),
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Layer `layer`'s routing distribution: each expert's share of its routes.
    pub fn shares(&self, layer: usize) -> Vec<f64> {
        let row = &self.counts[layer];
        let total: u64 = row.iter().sum();
        row.iter()
            .map(|&c| {
                if total == 0 {
                    0.0
                } else {
                    c as f64 / total as f64
                }
            })
            .collect()
    }

    /// The number of experts layer `layer` effectively uses: exp of the entropy of its
    /// routing distribution (its perplexity). Between `top_k` (the same k experts for
    /// every token: a share is at most 1/k) and `n_expert` (uniform routing).
    pub fn effective_experts(&self, layer: usize) -> f64 {
        let h: f64 = self
            .shares(layer)
            .iter()
            .filter(|&&p| p > 0.0)
            .map(|&p| -p * p.ln())
            .sum();
        h.exp()
    }

    /// Share of layer `layer`'s routes that its `n` most used experts take (what `n`
    /// slots holding the most used experts would hit on this profile).
    pub fn coverage(&self, layer: usize, n: usize) -> f64 {
        let mut s = self.shares(layer);
        s.sort_by(|a, b| b.total_cmp(a));
        s.iter().take(n).sum::<f64>().min(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::geometry::Geometry;
    use model::Arch;

    fn cfg() -> ModelConfig {
        // tiny-qwen3moe: 4 layers, 16 experts, top-4.
        Geometry::by_name(Some(Arch::Qwen3Moe), "tiny")
            .unwrap()
            .config()
            .unwrap()
    }

    fn recorded(cfg: &ModelConfig) -> RoutingProfile {
        let rc = RoutingCounts::for_model(cfg);
        for t in 0..10usize {
            for l in 0..cfg.n_layer {
                rc.record_token(l, (0..4).map(|i| (t + i * (l + 1)) % cfg.n_expert));
            }
        }
        RoutingProfile::from_counts("tiny", cfg, &rc).unwrap()
    }

    fn invalid_field(e: ProfileError) -> String {
        match e {
            ProfileError::Invalid { field, .. } => field,
            e => panic!("expected a field error, got {e}"),
        }
    }

    #[test]
    fn counts_record_every_route() {
        let cfg = cfg();
        let rc = RoutingCounts::for_model(&cfg);
        rc.record_token(1, [3, 5, 0, 15]);
        rc.record_token(1, [3, 4, 1, 2]);
        let s = rc.snapshot();
        assert_eq!(s.len(), 4);
        assert_eq!(s[1][3], 2);
        assert_eq!(s[1][15], 1);
        assert_eq!(s[0].iter().sum::<u64>(), 0);
        assert_eq!(rc.tokens(1), 2);
        rc.reset();
        assert_eq!(rc.snapshot()[1][3], 0);
        assert_eq!(rc.tokens(1), 0);
    }

    #[test]
    fn a_trace_keeps_each_tokens_experts_in_order_while_it_runs() {
        let cfg = cfg();
        let rc = RoutingCounts::for_model(&cfg);
        rc.record_token(0, [9, 9, 9, 9]);
        rc.start_trace();
        rc.record_token(1, [3, 5, 0, 15]);
        rc.record_token(0, [1, 2, 3, 4]);
        rc.record_token(1, [7, 6, 5, 4]);
        let t = rc.take_trace();
        assert_eq!(t.len(), 4);
        assert_eq!(t[0], vec![1, 2, 3, 4]);
        assert_eq!(t[1], vec![3, 5, 0, 15, 7, 6, 5, 4]);
        assert!(t[2].is_empty());
        // Stopped: later tokens are counted, not traced.
        rc.record_token(1, [1, 1, 1, 1]);
        assert_eq!(rc.take_trace(), Vec::<Vec<u32>>::new());
        assert_eq!(rc.tokens(1), 3);
    }

    #[test]
    fn a_profile_round_trips_through_its_file() {
        let cfg = cfg();
        let p = recorded(&cfg);
        assert_eq!(p.tokens, 10);
        assert_eq!(p.counts.iter().flatten().sum::<u64>(), 10 * 4 * 4);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routing.json");
        p.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        // Plain JSON with the documented fields.
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        for f in [
            "model", "arch", "n_layer", "n_expert", "top_k", "tokens", "counts",
        ] {
            assert!(v.get(f).is_some(), "{f} missing from {text}");
        }
        assert_eq!(RoutingProfile::load(&path, &cfg).unwrap(), p);
    }

    #[test]
    fn a_profile_of_another_model_is_refused_naming_the_field() {
        let cfg = cfg();
        let p = recorded(&cfg);
        let mut other = cfg.clone();
        other.n_layer = 5;
        assert_eq!(invalid_field(p.validate(&other).unwrap_err()), "n_layer");
        let mut other = cfg.clone();
        other.n_expert = 32;
        assert_eq!(invalid_field(p.validate(&other).unwrap_err()), "n_expert");
        let mut other = cfg.clone();
        other.n_expert_used = 8;
        assert_eq!(invalid_field(p.validate(&other).unwrap_err()), "top_k");
        let mut other = cfg.clone();
        other.arch = Arch::Qwen3Next;
        let e = p.validate(&other).unwrap_err();
        assert!(e.to_string().contains("qwen3next"), "{e}");
        assert_eq!(invalid_field(e), "arch");

        let mut bad = p.clone();
        bad.counts[2][7] += 1;
        let e = bad.validate(&cfg).unwrap_err();
        assert!(e.to_string().contains("sums to 41"), "{e}");
        assert_eq!(invalid_field(e), "counts[2]");
        let mut bad = p.clone();
        bad.counts[1].pop();
        assert_eq!(invalid_field(bad.validate(&cfg).unwrap_err()), "counts[1]");
        let mut bad = p.clone();
        bad.counts.pop();
        bad.n_layer = 3;
        assert_eq!(invalid_field(bad.validate(&cfg).unwrap_err()), "n_layer");
        let mut bad = p.clone();
        bad.counts.pop();
        assert_eq!(invalid_field(bad.validate(&cfg).unwrap_err()), "counts");
        let mut bad = p;
        bad.tokens = 0;
        assert_eq!(invalid_field(bad.validate(&cfg).unwrap_err()), "tokens");
    }

    #[test]
    fn load_names_the_file() {
        let cfg = cfg();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.json");
        std::fs::write(&path, "{\"model\": 1}").unwrap();
        let e = RoutingProfile::load(&path, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("bad.json") && e.contains("not a routing profile"),
            "{e}"
        );
        let mut p = recorded(&cfg);
        p.n_expert = 8;
        p.save(&path).unwrap();
        let e = RoutingProfile::load(&path, &cfg).unwrap_err().to_string();
        assert!(e.contains("bad.json") && e.contains("`n_expert`"), "{e}");
        let e = RoutingProfile::load(&dir.path().join("none.json"), &cfg).unwrap_err();
        assert!(matches!(e, ProfileError::Io { .. }), "{e}");
    }

    #[test]
    fn effective_experts_and_coverage() {
        let p = RoutingProfile {
            model: String::new(),
            arch: "qwen3moe".into(),
            n_layer: 2,
            n_expert: 4,
            top_k: 1,
            tokens: 8,
            counts: vec![vec![2, 2, 2, 2], vec![8, 0, 0, 0]],
        };
        assert!((p.effective_experts(0) - 4.0).abs() < 1e-12);
        assert!((p.effective_experts(1) - 1.0).abs() < 1e-12);
        assert_eq!(p.coverage(0, 2), 0.5);
        assert_eq!(p.coverage(1, 1), 1.0);
        assert_eq!(p.coverage(0, 9), 1.0);
    }
}
