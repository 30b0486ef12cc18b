//! Recording a routing profile: run the CPU executor over some tokens with a
//! [`RoutingCounts`] recorder in its MoE, and return what it counted.
//!
//! The executor is built here rather than through [`Engine`](crate::Engine), whose
//! executor is chosen at load time and has no recorder: a profile is a CPU run of the
//! model's own routing (DESIGN.md invariant 4: the same `model::moe::route` every
//! executor uses), so it is the same whichever device will serve.

use super::profile::{RoutingCounts, RoutingProfile};
use crate::cpu::{CpuBackend, CpuExecutor, Precision};
use crate::exec::{Executor, SeqStep, StepOut, Want};
use crate::{EngineError, GIB, PROMPT_CHUNK};
use model::{ExecError, ModelConfig, ModelWeights};
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::Arc;

/// The tokens a profile is recorded over.
#[derive(Debug, Clone, PartialEq)]
pub enum ProfileInput {
    /// Text, tokenized with the model's tokenizer (special tokens parsed).
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// `tokens` ids drawn uniformly from the vocabulary with a seeded generator (for
    /// synthetic models, whose routing does not depend on meaning).
    Random { tokens: usize, seed: u64 },
}

/// A recorded profile and how it was made.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub profile: RoutingProfile,
    /// Prompt tokens evaluated in one pass per chunk (the prefill path).
    pub prompt_tokens: usize,
    /// The tokens fed by single-token decode steps after the prompt, in order: each the
    /// greedy choice after the one before (the first after the prompt).
    pub generated: Vec<u32>,
    pub seconds: f64,
}

/// Loads the model at `path`, evaluates `input` as a prompt and then `n_decode` greedy
/// decode steps on the CPU, counting every routing decision of every trunk layer.
pub fn record_profile(
    path: &Path,
    input: &ProfileInput,
    n_decode: usize,
) -> Result<Recorded, EngineError> {
    let t0 = std::time::Instant::now();
    let file = Arc::new(gguf::GgufFile::open(path)?);
    let cfg = ModelConfig::from_gguf(&file)?;
    let weights = ModelWeights::load(&file, &cfg)?;
    let prompt: Vec<u32> = match input {
        ProfileInput::Ids(ids) => ids.clone(),
        ProfileInput::Text(text) => model::tokenizer::Tokenizer::from_gguf(&file)
            .and_then(|t| t.encode(text, true))
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?,
        ProfileInput::Random { tokens, seed } => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(*seed);
            (0..*tokens)
                .map(|_| rng.random_range(0..cfg.n_vocab as u32))
                .collect()
        }
    };
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= cfg.n_vocab) {
        return Err(EngineError::BadToken {
            id,
            n_vocab: cfg.n_vocab,
        });
    }
    let n_ctx = prompt.len() + n_decode;
    let state = crate::cpu::state_bytes(&cfg, n_ctx) as u64;
    if let Some(avail) = crate::mem_available() {
        if state > avail {
            return Err(EngineError::Memory(format!(
                "the KV cache and recurrent state for {n_ctx} tokens need {:.2} GiB, but only {:.2} GiB of RAM is available; profile fewer tokens",
                state as f64 / GIB,
                avail as f64 / GIB
            )));
        }
    }
    let counts = Arc::new(RoutingCounts::for_model(&cfg));
    let backend = CpuBackend {
        cfg: cfg.clone(),
        weights,
        precision: Precision::Canonical,
        routing: Some(counts.clone()),
    };
    let mut exec = CpuExecutor::new(backend, n_ctx, 1)?;
    let mut step = |tokens: &[u32], pos0: usize| -> Result<u32, EngineError> {
        let out = exec.step(&[SeqStep {
            seq: 0,
            tokens,
            pos0,
            want: Want::Greedy,
        }])?;
        match out.first() {
            Some(StepOut::Token(t)) => Ok(*t),
            _ => Err(ExecError::new("profile", "the executor returned no token").into()),
        }
    };
    let mut pos = 0;
    let mut next = 0;
    for chunk in prompt.chunks(PROMPT_CHUNK) {
        next = step(chunk, pos)?;
        pos += chunk.len();
    }
    let mut generated = Vec::with_capacity(n_decode);
    for _ in 0..n_decode {
        generated.push(next);
        next = step(&[next], pos)?;
        pos += 1;
    }
    let name = file
        .get("general.name")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
    let profile = RoutingProfile::from_counts(&name, &cfg, &counts)
        .map_err(|e| EngineError::Exec(ExecError::new("routing profile", e)))?;
    Ok(Recorded {
        profile,
        prompt_tokens: prompt.len(),
        generated,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
