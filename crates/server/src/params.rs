//! What decoding needs from a request besides the prompt ([`GenParams`]), and the
//! one conversion of it into the engine's [`GenerateRequest`]. The request fields it
//! comes from are read in `api::common`.

use engine::{GenerateRequest, SamplingParams};

/// Thinking budget (tokens) that each reasoning effort maps to. The Qwen templates
/// know only "thinking on/off", so effort is expressed as a budget on the think block:
/// `minimal` 256, `low` 1024, `medium` 4096; `high`, `xhigh`, `max` and `ultra` are
/// unbounded (the request's token budget and the answer room still apply). `none`
/// turns thinking off (`api::common::Common::thinking`).
pub fn effort_budget(effort: &str) -> Option<usize> {
    match effort {
        "minimal" => Some(256),
        "low" => Some(1024),
        "medium" => Some(4096),
        _ => None,
    }
}

/// The thinking controls of one request, resolved against the server defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Thinking {
    /// Passed to the template as `enable_thinking`.
    pub enabled: bool,
    /// Close the think block after this many generated tokens.
    pub budget: Option<usize>,
    /// The effective effort (for the response's `reasoning.effort`).
    pub effort: Option<String>,
}

impl Thinking {
    /// No thinking (raw completions).
    pub const OFF: Thinking = Thinking {
        enabled: false,
        budget: None,
        effort: None,
    };
}

/// Everything decoding needs from a request besides the prompt.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub thinking: Thinking,
    pub stream: bool,
    pub include_usage: bool,
    /// Structured output (a schema, forced tool calls), enforced while decoding.
    pub constraint: Option<crate::structured::Spec>,
    /// Each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Speculative decoding's draft limits (`speculative.n_max`/`n_min`).
    pub speculative: engine::DraftLimits,
    /// Go on past end-of-generation tokens (`ignore_eos`).
    pub ignore_eos: bool,
}

impl GenParams {
    /// The engine's request: `prompt`, at most `max_tokens` tokens (the request's
    /// budget, cut to what the context leaves), stopping at end-of-generation, under
    /// `constraint` (the compiled form of [`GenParams::constraint`]).
    pub fn request(
        &self,
        prompt: Vec<u32>,
        max_tokens: usize,
        constraint: Option<engine::constraint::Constraint>,
    ) -> GenerateRequest {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: self.sampling.clone(),
            stop_at_eog: !self.ignore_eos,
            constraint,
            logprobs: self.logprobs,
            speculative: self.speculative,
            images: Vec::new(),
        }
    }
}
