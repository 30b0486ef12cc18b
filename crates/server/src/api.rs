//! The wire types of each API, one module per API: the requests as sent (serde
//! structs whose fields are [`field::Field`]s, so a field of the wrong type is refused
//! with a message naming it rather than with serde's), what a request becomes (its
//! conversation, its [`crate::params::GenParams`], its structured-output spec), and
//! the objects, chunks and events the routes answer with.
//!
//! * [`openai`] — chat completions and completions (and the message, tool, tool
//!   choice and format types Responses shares);
//! * [`responses`] — the Responses API;
//! * [`anthropic`] — Messages;
//! * [`common`] — the fields every generation route reads (sampling, budget, stop,
//!   log-probabilities, thinking, refused fields);
//! * [`content`] — content parts, tool-call arguments and tool names;
//! * [`field`] — a field as sent, and the checks that name it.

pub mod anthropic;
pub mod common;
pub mod content;
pub mod field;
pub mod openai;
pub mod responses;

use serde::Serialize;

/// llama-server's `timings` object, with `experts` (where the routed experts of the
/// steps the request ran in came from, [`crate::metrics::expert_tiers`]) when they
/// are tiered.
#[derive(Debug, Clone, Serialize)]
pub struct Timings {
    pub cache_n: usize,
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub prompt_per_token_ms: f64,
    pub prompt_per_second: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    pub predicted_per_token_ms: f64,
    pub predicted_per_second: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<serde_json::Value>,
    /// Speculative decoding (llama-server's names): draft tokens checked and kept;
    /// absent when the request drafted nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_n: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_n_accepted: Option<usize>,
}

impl Timings {
    pub fn of(t: &engine::Timings) -> Timings {
        let per_token = |n: usize, ms: f64| if n > 0 { ms / n as f64 } else { 0.0 };
        Timings {
            cache_n: t.cache_n,
            prompt_n: t.prompt_n,
            prompt_ms: t.prompt_ms,
            prompt_per_token_ms: per_token(t.prompt_n, t.prompt_ms),
            prompt_per_second: t.prompt_per_second(),
            predicted_n: t.predicted_n,
            predicted_ms: t.predicted_ms,
            predicted_per_token_ms: per_token(t.predicted_n, t.predicted_ms),
            predicted_per_second: t.predicted_per_second(),
            experts: t.experts.as_ref().map(crate::metrics::expert_tiers),
            draft_n: (t.draft_n > 0).then_some(t.draft_n),
            draft_n_accepted: (t.draft_n > 0).then_some(t.draft_n_accepted),
        }
    }
}

#[cfg(test)]
mod tests;
