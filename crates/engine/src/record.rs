//! Recording a routing profile: an [`Engine`] on the CPU with its routing recorder
//! (`EngineConfig::record_routing`) runs some tokens, and the counts become a
//! [`RoutingProfile`]. A profile is a CPU run of the model's own routing (docs/design.md
//! invariant 4: the same `model::moe::route` every executor uses), so it is the same
//! whichever device will serve.

use crate::api::{Device, EngineConfig, Flow, GenerateRequest};
use crate::engine::Engine;
use crate::error::EngineError;
use crate::experts::RoutingProfile;
use model::ExecError;
use rand::{Rng, SeedableRng};
use std::path::Path;

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

/// Loads the model at `path` on the CPU with a routing recorder, evaluates `input`
/// as a prompt and then `n_decode` greedy decode steps, counting every routing
/// decision of every trunk layer.
pub fn record_profile(
    path: &Path,
    input: &ProfileInput,
    n_decode: usize,
) -> Result<Recorded, EngineError> {
    let t0 = std::time::Instant::now();
    // A byte-level BPE token covers at least one byte, so the text's length bounds
    // its token count (the context is sized before the tokenizer is loaded).
    let prompt_bound = match input {
        ProfileInput::Ids(ids) => ids.len(),
        ProfileInput::Text(text) => text.len(),
        ProfileInput::Random { tokens, .. } => *tokens,
    };
    let mut engine = Engine::load(
        path,
        &EngineConfig {
            max_context: Some((prompt_bound + n_decode + 1).max(16)),
            device: Some(Device::Cpu),
            record_routing: true,
            ..Default::default()
        },
    )?;
    let n_vocab = engine.info().n_vocab;
    let prompt: Vec<u32> = match input {
        ProfileInput::Ids(ids) => ids.clone(),
        ProfileInput::Text(text) => engine
            .tokenizer()
            .encode(text, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?,
        ProfileInput::Random { tokens, seed } => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(*seed);
            (0..*tokens)
                .map(|_| rng.random_range(0..n_vocab as u32))
                .collect()
        }
    };
    // The prompt in one pass per chunk, then n_decode single-token steps: the last
    // of the n_decode + 1 greedy tokens is chosen but never fed.
    let req = GenerateRequest::greedy(prompt.clone(), n_decode + 1);
    let done = engine.generate(&req, &mut |_| Flow::Continue)?;
    let mut generated = done.tokens;
    generated.truncate(n_decode);
    let counts = engine
        .routing_counts()
        .ok_or_else(|| EngineError::Exec(ExecError::new("profile", "no routing recorder")))?;
    let profile = RoutingProfile::from_counts(&engine.info().name, engine.config(), counts)
        .map_err(|e| EngineError::Exec(ExecError::new("routing profile", e)))?;
    Ok(Recorded {
        profile,
        prompt_tokens: prompt.len(),
        generated,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
