//! The fields every generation route reads — sampling, the token budget, stop
//! sequences, log-probabilities, the thinking controls, and the fields we refuse —
//! declared once ([`Common`], flattened into each API's request) and turned into the
//! request's [`GenParams`] in one place.
//!
//! The rules: a value outside its defined range is a 400 naming the field, never
//! clamped; a field we cannot honour and that would change the result (n > 1, a
//! sampler we do not have, ...) is a 400; a field the request sends always wins, a
//! server default fills only a field the request omits, and a request that sends
//! `temperature: 0` decodes greedy and takes none of the sampling defaults.

use engine::SamplingParams;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::field::{objects, Field, FromJson, OBJECT};
use crate::error::ApiError;
use crate::params::{effort_budget, GenParams, Thinking};
use crate::settings::{RequestDefaults, EFFORTS};

/// The fields every generation route shares, as sent.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Common {
    // Sampling.
    pub temperature: Field<f64>,
    pub top_p: Field<f64>,
    pub top_k: Field<u64>,
    pub min_p: Field<f64>,
    pub presence_penalty: Field<f64>,
    pub frequency_penalty: Field<f64>,
    pub repeat_penalty: Field<f64>,
    pub repeat_last_n: Field<u64>,
    /// A whole number; -1 (llama.cpp clients' "random") is no seed.
    pub seed: Field<i128>,
    pub logit_bias: Field<LogitBias>,

    // The token budget, under the names the APIs use (each route reads its own).
    pub max_tokens: Field<u64>,
    pub max_completion_tokens: Field<u64>,
    pub max_output_tokens: Field<u64>,
    /// OpenAI's stop sequences.
    pub stop: Field<Strings>,
    /// Anthropic's.
    pub stop_sequences: Field<Strings>,
    pub stream: Field<bool>,
    pub stream_options: Field<StreamOptions>,

    /// Chat: true/false; completions: the number of alternatives.
    pub logprobs: Field<Value>,
    pub top_logprobs: Field<u64>,

    /// Speculative decoding's draft limits for this request (llama-server's names);
    /// the tokens are the same whatever they are.
    #[serde(rename = "speculative.n_max")]
    pub speculative_n_max: Field<u64>,
    #[serde(rename = "speculative.n_min")]
    pub speculative_n_min: Field<u64>,
    /// llama-server's: generate past end-of-generation tokens (benchmarks ask for
    /// an exact token count).
    pub ignore_eos: Field<bool>,

    // Thinking, under every name clients use.
    pub reasoning_effort: Field<String>,
    pub enable_thinking: Field<bool>,
    /// Passed to the chat template as they are (chat completions); its
    /// `enable_thinking` and `reasoning_effort` are thinking controls too.
    pub chat_template_kwargs: Field<Map<String, Value>>,
    pub max_thinking_tokens: Field<u64>,
    pub thinking_budget_tokens: Field<u64>,
    pub thinking_budget: Field<u64>,
    pub thinking_token_budget: Field<u64>,
    pub reasoning: Field<Reasoning>,
    /// Anthropic's effort control (Claude Code sends it); read on every route.
    pub output_config: Field<OutputConfig>,
    /// Anthropic's thinking object.
    pub thinking: Field<ThinkingConfig>,

    // Fields whose presence (with a non-neutral value) would change the result;
    // refused rather than ignored.
    pub n: Field<Value>,
    pub best_of: Field<Value>,
    pub echo: Field<bool>,
    pub suffix: Field<String>,
    pub functions: Field<Value>,
    pub modalities: Field<Vec<Field<Value>>>,
    pub grammar: Field<Value>,
    pub json_schema: Field<Value>,
    pub mirostat: Field<Value>,
    pub typical_p: Field<Value>,
    pub tfs_z: Field<Value>,
    pub dry_multiplier: Field<Value>,
    pub xtc_probability: Field<Value>,
    pub n_probs: Field<Value>,
    pub dynatemp_range: Field<Value>,
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: Field<bool>,
}

/// The `reasoning` object (OpenAI's Responses, OpenRouter's chat).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Reasoning {
    pub effort: Field<String>,
    pub enabled: Field<bool>,
    pub max_tokens: Field<u64>,
    /// Responses: a summary of the reasoning is asked for (`auto`, `concise`, ...).
    pub summary: Field<String>,
}

/// Anthropic's `output_config`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct OutputConfig {
    pub effort: Field<String>,
}

/// Anthropic's `thinking`: `{"type": "enabled" | "adaptive" | "disabled", "budget_tokens"}`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ThinkingConfig {
    #[serde(rename = "type")]
    pub kind: Field<String>,
    pub budget_tokens: Field<u64>,
}

objects!(StreamOptions, Reasoning, OutputConfig, ThinkingConfig);

/// A string or a list of strings (stop sequences).
#[derive(Debug)]
pub enum Strings {
    One(String),
    Many(Vec<Field<Value>>),
}

impl FromJson for Strings {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(Strings::One(s)),
            Value::Array(a) => Ok(Strings::Many(
                a.into_iter().map(Field::from_value).collect(),
            )),
            other => Err(other),
        }
    }
}

/// `logit_bias`: `{"token id": bias}` (OpenAI) or `[[id, bias], ...]` (llama-server).
#[derive(Debug)]
pub enum LogitBias {
    Map(Map<String, Value>),
    Pairs(Vec<Value>),
}

impl FromJson for LogitBias {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::Object(m) => Ok(LogitBias::Map(m)),
            Value::Array(a) => Ok(LogitBias::Pairs(a)),
            other => Err(other),
        }
    }
}

/// How a route takes log-probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobsForm {
    /// Chat completions: `logprobs` true/false, `top_logprobs` 0..=20 alternatives.
    Chat,
    /// Completions: `logprobs` the number of alternatives, 0..=20 (null: none).
    Completions,
    /// A route without log-probabilities (Anthropic Messages, Responses): a
    /// request for them is refused.
    Refused,
}

/// A name the token budget goes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    MaxTokens,
    MaxCompletionTokens,
    MaxOutputTokens,
}

impl Budget {
    fn name(self) -> &'static str {
        match self {
            Budget::MaxTokens => "max_tokens",
            Budget::MaxCompletionTokens => "max_completion_tokens",
            Budget::MaxOutputTokens => "max_output_tokens",
        }
    }
}

/// How one route reads the shared fields.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    pub logprobs: LogprobsForm,
    /// The highest temperature: 2 on OpenAI routes, 1 on Anthropic's.
    pub temp_max: f64,
    /// The names of the token budget, in the order they are read (they must agree).
    pub budgets: &'static [Budget],
    /// Anthropic's `stop_sequences` rather than `stop`.
    pub stop_sequences: bool,
    /// `stream_options.include_usage` is read.
    pub stream_options: bool,
    /// The request must name its token budget (Anthropic's `max_tokens`).
    pub budget_required: bool,
}

impl Route {
    pub const CHAT: Route = Route {
        logprobs: LogprobsForm::Chat,
        temp_max: 2.0,
        budgets: &[
            Budget::MaxTokens,
            Budget::MaxCompletionTokens,
            Budget::MaxOutputTokens,
        ],
        stop_sequences: false,
        stream_options: true,
        budget_required: false,
    };
    pub const COMPLETIONS: Route = Route {
        logprobs: LogprobsForm::Completions,
        ..Route::CHAT
    };
    pub const RESPONSES: Route = Route {
        logprobs: LogprobsForm::Refused,
        temp_max: 2.0,
        budgets: &[
            Budget::MaxOutputTokens,
            Budget::MaxTokens,
            Budget::MaxCompletionTokens,
        ],
        stop_sequences: false,
        stream_options: false,
        budget_required: false,
    };
    pub const MESSAGES: Route = Route {
        logprobs: LogprobsForm::Refused,
        temp_max: 1.0,
        budgets: &[Budget::MaxTokens],
        stop_sequences: true,
        stream_options: false,
        budget_required: true,
    };
}

/// The first of `found` (name, value); two with different values are a 400.
fn agreeing<T: PartialEq + std::fmt::Debug>(
    found: Vec<(String, T)>,
) -> Result<Option<T>, ApiError> {
    let mut it = found.into_iter();
    let Some((first_name, first)) = it.next() else {
        return Ok(None);
    };
    for (name, v) in it {
        if v != first {
            return Err(ApiError::field(
                &name,
                format!("{first_name} ({first:?}) and {name} ({v:?}) disagree; send one, or the same value in both"),
            ));
        }
    }
    Ok(Some(first))
}

fn effort_value(name: &str, v: &str) -> Result<String, ApiError> {
    if EFFORTS.contains(&v) {
        Ok(v.to_string())
    } else {
        Err(ApiError::field(
            name,
            format!("{name} must be one of {}, got \"{v}\"", EFFORTS.join(", ")),
        ))
    }
}

impl Common {
    /// Everything decoding needs besides the prompt, the thinking controls and the
    /// structured output (which the routes read in their own order): the refused
    /// fields, log-probabilities, sampling, the budget, the stop sequences and `stream`.
    pub fn params(
        &self,
        route: &Route,
        defaults: &RequestDefaults,
        n_vocab: usize,
        thinking: Thinking,
    ) -> Result<GenParams, ApiError> {
        self.refuse_unsupported()?;
        let logprobs = self.logprobs(route.logprobs)?;
        let sampling = self.sampling(defaults, n_vocab, route.temp_max)?;
        if route.budget_required && !self.max_tokens.is_set() {
            return Err(ApiError::field(
                "max_tokens",
                "max_tokens is required: the most tokens the answer may have, e.g. \"max_tokens\": 4096",
            ));
        }
        let max_tokens = self.max_tokens(route.budgets, defaults.max_tokens_default)?;
        let stop = if route.stop_sequences {
            stop_list(&self.stop_sequences, "stop_sequences")?
        } else {
            stop_list(&self.stop, "stop")?
        };
        let stream = self.stream.flag("stream")?.unwrap_or(false);
        let options = match route.stream_options {
            true => self.stream_options.checked("stream_options", OBJECT)?,
            false => None,
        };
        if options.is_some() && !stream {
            return Err(ApiError::field(
                "stream_options",
                "stream_options is only allowed with stream: true (send stream: true, or leave stream_options out)",
            ));
        }
        let include_usage = match options {
            Some(so) => so
                .include_usage
                .flag("include_usage")
                .map_err(|e| ApiError::field("stream_options.include_usage", e.message))?
                .unwrap_or(false),
            None => false,
        };
        let speculative = self.draft_limits()?;
        let ignore_eos = self.ignore_eos.flag("ignore_eos")?.unwrap_or(false);
        Ok(GenParams {
            sampling,
            max_tokens,
            stop,
            thinking,
            stream,
            include_usage,
            constraint: None,
            logprobs,
            speculative,
            ignore_eos,
        })
    }

    /// `speculative.n_max` / `n_min`: this request's draft limits (unset: the server's).
    pub fn draft_limits(&self) -> Result<engine::DraftLimits, ApiError> {
        Ok(engine::DraftLimits {
            n_max: self
                .speculative_n_max
                .at_least("speculative.n_max", 0)?
                .map(|n| n as usize),
            n_min: self
                .speculative_n_min
                .at_least("speculative.n_min", 0)?
                .map(|n| n as usize),
        })
    }

    /// Fields we do not implement whose presence (with a non-neutral value) changes
    /// the result.
    pub fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let refuse = |name: &str, why: &str| Err(ApiError::field(name, format!("{name}: {why}")));
        if let Field::Ok(n) = &self.n {
            if n.as_u64() != Some(1) {
                return refuse("n", &format!("only n = 1 is supported, got {n}"));
            }
        }
        if let Field::Ok(n) = &self.best_of {
            if n.as_u64() != Some(1) {
                return refuse(
                    "best_of",
                    &format!("only best_of = 1 is supported, got {n}"),
                );
            }
        }
        if self.echo.is_true() {
            return refuse("echo", "echo is not supported");
        }
        if self.suffix.str().is_some_and(|s| !s.is_empty()) {
            return refuse("suffix", "suffix (fill-in-the-middle) is not supported");
        }
        // `response_format` is read by `structured` (json_schema, json_object are enforced).
        if self.functions.is_set() {
            return refuse(
                "functions",
                "the deprecated functions / function_call form is not supported; send tools",
            );
        }
        if self
            .modalities
            .ok()
            .is_some_and(|m| m.iter().any(|x| !matches!(x, Field::Ok(v) if v == "text")))
        {
            return refuse("modalities", "only text output is supported");
        }
        for (name, f) in [
            ("grammar", &self.grammar),
            ("json_schema", &self.json_schema),
        ] {
            if f.is_set() {
                return refuse(name, "constrained decoding is not supported");
            }
        }
        let neutral = [
            ("mirostat", &self.mirostat, 0.0),
            ("typical_p", &self.typical_p, 1.0),
            ("tfs_z", &self.tfs_z, 1.0),
            ("dry_multiplier", &self.dry_multiplier, 0.0),
            ("xtc_probability", &self.xtc_probability, 0.0),
            ("n_probs", &self.n_probs, 0.0),
            ("dynatemp_range", &self.dynatemp_range, 0.0),
        ];
        for (name, f, ok) in neutral {
            if let Field::Ok(v) = f {
                if v.as_f64() != Some(ok) {
                    return refuse(
                        name,
                        &format!("this sampler is not supported (only {ok} is accepted)"),
                    );
                }
            }
        }
        Ok(())
    }

    /// The log-probabilities a request asks for: None, or the number of alternatives
    /// listed beside each generated token.
    pub fn logprobs(&self, form: LogprobsForm) -> Result<Option<usize>, ApiError> {
        let max = engine::MAX_TOP_LOGPROBS as u64;
        let logprobs = match &self.logprobs {
            Field::Ok(v) => Some(v),
            _ => None,
        };
        let (name, n) = match form {
            LogprobsForm::Refused => {
                // Only the neutral values (false, 0).
                let neutral = |v: Option<&Value>| {
                    v.is_none_or(|v| *v == Value::Bool(false) || v.as_u64() == Some(0))
                };
                let top = match &self.top_logprobs {
                    Field::Absent | Field::Null => None,
                    Field::Ok(n) => Some(Value::from(*n)),
                    Field::Wrong(v) => Some(v.clone()),
                };
                if neutral(logprobs) && neutral(top.as_ref()) {
                    return Ok(None);
                }
                let name = if neutral(logprobs) {
                    "top_logprobs"
                } else {
                    "logprobs"
                };
                return Err(ApiError::field(
                    name,
                    format!(
                        "{name}: log probabilities are served on /v1/chat/completions and \
                         /v1/completions, not on this route"
                    ),
                ));
            }
            LogprobsForm::Chat => {
                let on = match logprobs {
                    None | Some(Value::Bool(false)) => false,
                    Some(Value::Bool(true)) => true,
                    Some(v) => {
                        return Err(ApiError::field(
                            "logprobs",
                            format!("logprobs must be true or false, got {v}"),
                        ))
                    }
                };
                let n = self.top_logprobs.at_least("top_logprobs", 0)?;
                match (on, n) {
                    (false, None | Some(0)) => return Ok(None),
                    (false, Some(_)) => {
                        return Err(ApiError::field(
                            "top_logprobs",
                            "top_logprobs: set logprobs to true to use top_logprobs".to_string(),
                        ))
                    }
                    (true, n) => ("top_logprobs", n.unwrap_or(0)),
                }
            }
            LogprobsForm::Completions => match logprobs {
                None | Some(Value::Bool(false)) => return Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) => ("logprobs", n),
                    None => {
                        return Err(ApiError::field(
                            "logprobs",
                            format!(
                                "logprobs must be the number of alternatives to list (0 to {max}), got {v}"
                            ),
                        ))
                    }
                },
            },
        };
        if n > max {
            return Err(ApiError::field(
                name,
                format!("{name} must be between 0 and {max}, got {n}"),
            ));
        }
        Ok(Some(n as usize))
    }

    /// Sampling: request fields over server defaults (`temp_max` is 2 for OpenAI
    /// routes and 1 for Anthropic).
    pub fn sampling(
        &self,
        d: &RequestDefaults,
        n_vocab: usize,
        temp_max: f64,
    ) -> Result<SamplingParams, ApiError> {
        let temperature = self.temperature.within("temperature", 0.0, temp_max)?;
        let top_p = self.top_p.within("top_p", 0.0, 1.0)?;
        if top_p == Some(0.0) {
            return Err(ApiError::field(
                "top_p",
                "top_p must be greater than 0 and at most 1, got 0",
            ));
        }
        let top_k = self.top_k.at_least("top_k", 0)?;
        let min_p = self.min_p.within("min_p", 0.0, 1.0)?;
        let presence = self
            .presence_penalty
            .within("presence_penalty", -2.0, 2.0)?;
        let frequency = self
            .frequency_penalty
            .within("frequency_penalty", -2.0, 2.0)?;
        let repeat = self.repeat_penalty.within("repeat_penalty", 0.0, 10.0)?;
        if repeat == Some(0.0) {
            return Err(ApiError::field(
                "repeat_penalty",
                "repeat_penalty must be greater than 0",
            ));
        }
        let repeat_last_n = self.repeat_last_n.at_least("repeat_last_n", 0)?;
        let bad_seed = |v: &dyn std::fmt::Display| {
            ApiError::field("seed", format!("seed must be a whole number >= 0, got {v}"))
        };
        let seed = match &self.seed {
            Field::Absent | Field::Null => None,
            Field::Ok(n) if *n >= 0 => Some(*n as u64),
            // llama.cpp clients send -1 for "random".
            Field::Ok(-1) => None,
            Field::Ok(n) => return Err(bad_seed(n)),
            Field::Wrong(v) => return Err(bad_seed(v)),
        };
        let logit_bias = logit_bias(&self.logit_bias, n_vocab)?;
        // temperature 0 sent explicitly: greedy, and no sampling defaults at all.
        let greedy_request = temperature == Some(0.0);
        let pick = |req: Option<f64>, def: f32, neutral: f32| -> f32 {
            match req {
                Some(v) => v as f32,
                None if greedy_request => neutral,
                None => def,
            }
        };
        Ok(SamplingParams {
            temperature: pick(temperature, d.temp, 0.0),
            top_k: match top_k {
                Some(k) => k as usize,
                None if greedy_request => 0,
                None => d.top_k,
            },
            top_p: pick(top_p, d.top_p, 1.0),
            min_p: pick(min_p, d.min_p, 0.0),
            presence_penalty: pick(presence, d.presence_penalty, 0.0),
            frequency_penalty: pick(frequency, d.frequency_penalty, 0.0),
            repeat_penalty: pick(repeat, d.repeat_penalty, 1.0),
            repeat_last_n: repeat_last_n.map(|n| n as usize).unwrap_or(64),
            logit_bias,
            seed: seed.or(if greedy_request { None } else { d.seed }),
        })
    }

    /// The token budget from whichever of `names` the request sends (they must
    /// agree), else the server default.
    pub fn max_tokens(&self, names: &[Budget], default: usize) -> Result<usize, ApiError> {
        let mut found = Vec::new();
        for &b in names {
            let f = match b {
                Budget::MaxTokens => &self.max_tokens,
                Budget::MaxCompletionTokens => &self.max_completion_tokens,
                Budget::MaxOutputTokens => &self.max_output_tokens,
            };
            if let Some(n) = f.at_least(b.name(), 1)? {
                found.push((b.name().to_string(), n));
            }
        }
        Ok(agreeing(found)?.map(|n| n as usize).unwrap_or(default))
    }

    /// The thinking controls every route understands, under all the names clients
    /// use: `reasoning_effort`, `enable_thinking`,
    /// `chat_template_kwargs.{enable_thinking, reasoning_effort}`,
    /// `max_thinking_tokens` and its aliases, the `reasoning` object (`{"effort",
    /// "enabled", "max_tokens"}`), the Anthropic `thinking` object (`{"type":
    /// "enabled"|"disabled"|"adaptive", "budget_tokens"}`) and Anthropic's
    /// `output_config.effort`. Names that disagree are a 400.
    pub fn thinking(&self, d: &RequestDefaults) -> Result<Thinking, ApiError> {
        let mut enabled: Vec<(String, bool)> = Vec::new();
        let mut efforts: Vec<(String, String)> = Vec::new();
        let mut budgets: Vec<(String, u64)> = Vec::new();

        if let Some(e) = self.reasoning_effort.text("reasoning_effort")? {
            efforts.push((
                "reasoning_effort".into(),
                effort_value("reasoning_effort", e)?,
            ));
        }
        if let Some(b) = self.enable_thinking.flag("enable_thinking")? {
            enabled.push(("enable_thinking".into(), b));
        }
        if let Some(k) = self
            .chat_template_kwargs
            .checked("chat_template_kwargs", OBJECT)?
        {
            if let Some(b) = Field::<bool>::of(k.get("enable_thinking"))
                .flag("enable_thinking")
                .map_err(|e| ApiError::field("chat_template_kwargs.enable_thinking", e.message))?
            {
                enabled.push(("chat_template_kwargs.enable_thinking".into(), b));
            }
            if let Some(e) = k.get("reasoning_effort").and_then(Value::as_str) {
                let name = "chat_template_kwargs.reasoning_effort";
                efforts.push((name.into(), effort_value(name, e)?));
            }
        }
        for (name, f) in [
            ("max_thinking_tokens", &self.max_thinking_tokens),
            ("thinking_budget_tokens", &self.thinking_budget_tokens),
            ("thinking_budget", &self.thinking_budget),
            ("thinking_token_budget", &self.thinking_token_budget),
        ] {
            if let Some(n) = f.at_least(name, 1)? {
                budgets.push((name.into(), n));
            }
        }
        if let Some(r) = self.reasoning.checked("reasoning", OBJECT)? {
            if let Some(e) = r.effort.text("reasoning.effort")? {
                efforts.push((
                    "reasoning.effort".into(),
                    effort_value("reasoning.effort", e)?,
                ));
            }
            if let Some(&b) = r.enabled.ok() {
                enabled.push(("reasoning.enabled".into(), b));
            }
            if let Some(n) = r.max_tokens.at_least("reasoning.max_tokens", 1)? {
                budgets.push(("reasoning.max_tokens".into(), n));
            }
        }
        if let Some(oc) = self.output_config.checked("output_config", OBJECT)? {
            let name = "output_config.effort";
            if let Some(e) = oc.effort.text(name)? {
                efforts.push((name.into(), effort_value(name, e)?));
            }
        }
        if let Some(t) = self.thinking.checked("thinking", OBJECT)? {
            match t.kind.str() {
                Some("enabled") | Some("adaptive") => {
                    enabled.push(("thinking.type".into(), true));
                    if let Some(n) = t.budget_tokens.at_least("thinking.budget_tokens", 1)? {
                        budgets.push(("thinking.budget_tokens".into(), n));
                    }
                }
                Some("disabled") => enabled.push(("thinking.type".into(), false)),
                _ => {
                    return Err(ApiError::field(
                        "thinking.type",
                        format!(
                        "thinking.type must be \"enabled\", \"adaptive\" or \"disabled\", got {}",
                        t.kind.shown()
                    ),
                    ))
                }
            }
        }

        let req_effort = agreeing(efforts)?;
        let req_budget = agreeing(budgets)?.map(|n| n as usize);
        let mut req_enabled = agreeing(enabled.clone())?;
        if req_effort.as_deref() == Some("none") {
            if req_enabled == Some(true) {
                let (name, _) = enabled.iter().find(|e| e.1).cloned().unwrap_or_default();
                return Err(ApiError::field(
                    &name,
                    format!("{name} turns thinking on but the reasoning effort is \"none\""),
                ));
            }
            req_enabled = Some(false);
        }
        let effort = req_effort.or_else(|| d.reasoning_effort.clone());
        let enabled = req_enabled.unwrap_or_else(|| {
            if effort.as_deref() == Some("none") {
                false
            } else {
                d.enable_thinking
            }
        });
        let budget = if !enabled {
            None
        } else if let Some(b) = req_budget {
            Some(b)
        } else {
            let eff_budget = effort.as_deref().and_then(effort_budget);
            match (eff_budget, d.max_thinking_tokens) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        };
        Ok(Thinking {
            enabled,
            budget,
            effort,
        })
    }

    /// What the chat template gets besides the conversation (chat completions).
    pub fn template_kwargs(&self) -> Map<String, Value> {
        self.chat_template_kwargs.ok().cloned().unwrap_or_default()
    }
}

/// `stop` / `stop_sequences`: a string or a list of non-empty strings, at most 16.
fn stop_list(f: &Field<Strings>, name: &str) -> Result<Vec<String>, ApiError> {
    let bad = |v: &Value| {
        ApiError::field(
            name,
            format!("{name} must be a string or a list of strings, got {v}"),
        )
    };
    let list = match f {
        Field::Absent | Field::Null => return Ok(Vec::new()),
        Field::Ok(Strings::One(s)) => vec![s.clone()],
        Field::Ok(Strings::Many(a)) => {
            let mut out = Vec::new();
            for v in a {
                match v {
                    Field::Ok(Value::String(s)) => out.push(s.clone()),
                    Field::Ok(v) | Field::Wrong(v) => return Err(bad(v)),
                    Field::Null | Field::Absent => return Err(bad(&Value::Null)),
                }
            }
            out
        }
        Field::Wrong(v) => return Err(bad(v)),
    };
    if list.len() > 16 {
        return Err(ApiError::field(
            name,
            format!("{name}: at most 16 stop sequences, got {}", list.len()),
        ));
    }
    if list.iter().any(String::is_empty) {
        return Err(ApiError::field(
            name,
            format!("{name}: a stop sequence must not be empty"),
        ));
    }
    Ok(list)
}

/// `logit_bias`: bias in [-100, 100] for token ids of this model; -100 (or `false`)
/// bans the token.
fn logit_bias(f: &Field<LogitBias>, n_vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    const NAME: &str = "logit_bias";
    let mut pairs: Vec<(Value, Value)> = Vec::new();
    match f {
        Field::Absent | Field::Null => return Ok(Vec::new()),
        Field::Ok(LogitBias::Map(m)) => {
            for (k, v) in m {
                pairs.push((Value::String(k.clone()), v.clone()));
            }
        }
        Field::Ok(LogitBias::Pairs(a)) => {
            for item in a {
                match item.as_array().map(Vec::as_slice) {
                    Some([id, bias]) => pairs.push((id.clone(), bias.clone())),
                    _ => {
                        return Err(ApiError::field(
                            NAME,
                            format!("{NAME} entries must be [token_id, bias] pairs, got {item}"),
                        ))
                    }
                }
            }
        }
        Field::Wrong(v) => {
            return Err(ApiError::field(
                NAME,
                format!("{NAME} must be an object, got {v}"),
            ))
        }
    }
    let mut out = Vec::with_capacity(pairs.len());
    for (k, v) in pairs {
        let id = match &k {
            Value::String(s) => s.trim().parse::<u32>().ok(),
            Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
            _ => None,
        };
        let Some(id) = id.filter(|&id| (id as usize) < n_vocab) else {
            return Err(ApiError::field(
                NAME,
                format!("{NAME}: {k} is not a token id of this model (0..{n_vocab})"),
            ));
        };
        let bias = match v {
            Value::Bool(false) => f32::NEG_INFINITY,
            _ => match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => {
                    if b <= -100.0 {
                        f32::NEG_INFINITY
                    } else {
                        b as f32
                    }
                }
                _ => {
                    return Err(ApiError::field(
                        NAME,
                        format!(
                            "{NAME}: the bias for token {id} must be between -100 and 100, got {v}"
                        ),
                    ))
                }
            },
        };
        out.push((id, bias));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::effort_budget;
    use serde_json::json;

    fn obj(v: Value) -> Common {
        Common::deserialize(v).unwrap()
    }

    #[test]
    fn ranges_refused_not_clamped() {
        let d = RequestDefaults::default();
        for (field, v) in [
            ("temperature", json!(2.5)),
            ("top_p", json!(0)),
            ("top_p", json!(1.5)),
            ("min_p", json!(-0.1)),
            ("presence_penalty", json!(3)),
            ("frequency_penalty", json!(-2.1)),
            ("top_k", json!(-1)),
            ("seed", json!("x")),
        ] {
            let e = obj(json!({ field: v })).sampling(&d, 100, 2.0).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
            assert!(e.message.contains(field), "{}", e.message);
        }
    }

    #[test]
    fn defaults_fill_omitted_and_temp0_takes_none() {
        let d = RequestDefaults::default();
        let s = obj(json!({"top_k": 5})).sampling(&d, 100, 2.0).unwrap();
        assert_eq!(s.temperature, d.temp);
        assert_eq!(s.top_k, 5);
        assert_eq!(s.top_p, d.top_p);
        let g = obj(json!({"temperature": 0}))
            .sampling(&d, 100, 2.0)
            .unwrap();
        assert_eq!(g.temperature, 0.0);
        assert_eq!(g.top_k, 0);
        assert_eq!(g.top_p, 1.0);
    }

    #[test]
    fn speculative_limits_are_llama_server_s_dotted_keys() {
        let l = obj(json!({"speculative.n_max": 4, "speculative.n_min": 2}))
            .draft_limits()
            .unwrap();
        assert_eq!((l.n_max, l.n_min), (Some(4), Some(2)));
        assert_eq!(obj(json!({})).draft_limits().unwrap(), Default::default());
        let e = obj(json!({"speculative.n_max": -1}))
            .draft_limits()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("speculative.n_max"));
    }

    #[test]
    fn logit_bias_forms() {
        let b = logit_bias(
            &obj(json!({"logit_bias": {"5": 10, "7": -100}})).logit_bias,
            100,
        )
        .unwrap();
        assert_eq!(b[0], (5, 10.0));
        assert_eq!(b[1].1, f32::NEG_INFINITY);
        let b = logit_bias(&obj(json!({"logit_bias": [[3, 1.5]]})).logit_bias, 100).unwrap();
        assert_eq!(b, vec![(3, 1.5)]);
        assert!(logit_bias(&obj(json!({"logit_bias": {"500": 1}})).logit_bias, 100).is_err());
        assert!(logit_bias(&obj(json!({"logit_bias": {"5": 101}})).logit_bias, 100).is_err());
    }

    #[test]
    fn budgets_must_agree() {
        let names = [Budget::MaxTokens, Budget::MaxCompletionTokens];
        assert_eq!(obj(json!({})).max_tokens(&names, 77).unwrap(), 77);
        assert_eq!(
            obj(json!({"max_tokens": 5, "max_completion_tokens": 5}))
                .max_tokens(&names, 7)
                .unwrap(),
            5
        );
        let e = obj(json!({"max_tokens": 5, "max_completion_tokens": 6}))
            .max_tokens(&names, 7)
            .unwrap_err();
        assert!(e.message.contains("max_completion_tokens"));
        assert!(obj(json!({"max_tokens": 0})).max_tokens(&names, 7).is_err());
    }

    #[test]
    fn unsupported_refused() {
        for body in [
            json!({"n": 2}),
            json!({"best_of": 3}),
            json!({"echo": true}),
        ] {
            assert!(obj(body.clone()).refuse_unsupported().is_err(), "{body}");
        }
        obj(json!({"n": 1, "logprobs": false, "response_format": {"type": "text"}}))
            .refuse_unsupported()
            .unwrap();
    }

    #[test]
    fn logprobs_forms() {
        use LogprobsForm::*;
        let p = |body: Value, form| obj(body).logprobs(form);
        assert_eq!(p(json!({}), Chat).unwrap(), None);
        assert_eq!(
            p(json!({"logprobs": false, "top_logprobs": 0}), Chat).unwrap(),
            None
        );
        assert_eq!(p(json!({"logprobs": true}), Chat).unwrap(), Some(0));
        assert_eq!(
            p(json!({"logprobs": true, "top_logprobs": 20}), Chat).unwrap(),
            Some(20)
        );
        assert_eq!(p(json!({"logprobs": 3}), Completions).unwrap(), Some(3));
        assert_eq!(p(json!({"logprobs": 0}), Completions).unwrap(), Some(0));
        assert_eq!(p(json!({"logprobs": null}), Completions).unwrap(), None);
        assert_eq!(
            p(json!({"logprobs": false, "top_logprobs": 0}), Refused).unwrap(),
            None
        );
        for (body, form, field) in [
            (json!({"top_logprobs": 2}), Chat, "top_logprobs"),
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                Chat,
                "top_logprobs",
            ),
            (json!({"logprobs": 1}), Chat, "logprobs"),
            (json!({"logprobs": 21}), Completions, "logprobs"),
            (json!({"logprobs": -1}), Completions, "logprobs"),
            (json!({"logprobs": true}), Refused, "logprobs"),
            (json!({"top_logprobs": 3}), Refused, "top_logprobs"),
        ] {
            let e = p(body.clone(), form).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
    }

    #[test]
    fn stop_forms() {
        assert_eq!(
            stop_list(&obj(json!({"stop": "x"})).stop, "stop").unwrap(),
            vec!["x"]
        );
        assert_eq!(
            stop_list(&obj(json!({"stop": ["a", "b"]})).stop, "stop")
                .unwrap()
                .len(),
            2
        );
        assert!(stop_list(&obj(json!({"stop": [""]})).stop, "stop").is_err());
        assert!(stop_list(&obj(json!({"stop": 3})).stop, "stop").is_err());
    }

    #[test]
    fn every_effort_current_clients_send_is_accepted_on_every_name() {
        let d = RequestDefaults::default();
        // Codex offers max and ultra; Claude Code sends output_config.effort up to max.
        for e in [
            "none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra",
        ] {
            for body in [
                json!({"reasoning_effort": e}),
                json!({"reasoning": {"effort": e}}),
                json!({"output_config": {"effort": e}}),
                json!({"chat_template_kwargs": {"reasoning_effort": e}}),
            ] {
                let t = obj(body.clone())
                    .thinking(&d)
                    .unwrap_or_else(|err| panic!("{body}: {err}"));
                assert_eq!(t.effort.as_deref(), Some(e), "{body}");
                assert_eq!(t.enabled, e != "none", "{body}");
                assert_eq!(t.budget, effort_budget(e), "{body}");
            }
        }
        // The nearest budgets: the top efforts are unbounded, as high is.
        for e in ["high", "xhigh", "max", "ultra"] {
            assert_eq!(effort_budget(e), None);
        }
        assert_eq!(effort_budget("medium"), Some(4096));
        // output_config.effort must agree with the other names, and be a known value.
        let e = obj(json!({"output_config": {"effort": "low"}, "reasoning_effort": "max"}))
            .thinking(&d)
            .unwrap_err();
        assert!(e.message.contains("output_config.effort"), "{e}");
        let e = obj(json!({"output_config": {"effort": "huge"}}))
            .thinking(&d)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("output_config.effort"));
    }

    #[test]
    fn thinking_controls() {
        let d = RequestDefaults::default();
        let t = obj(json!({})).thinking(&d).unwrap();
        assert!(t.enabled && t.budget.is_none());
        let t = obj(json!({"reasoning_effort": "none"}))
            .thinking(&d)
            .unwrap();
        assert!(!t.enabled);
        let t = obj(json!({"reasoning_effort": "low"}))
            .thinking(&d)
            .unwrap();
        assert_eq!(t.budget, Some(1024));
        let t = obj(json!({"chat_template_kwargs": {"enable_thinking": false}}))
            .thinking(&d)
            .unwrap();
        assert!(!t.enabled);
        let t = obj(json!({"thinking": {"type": "enabled", "budget_tokens": 9}}))
            .thinking(&d)
            .unwrap();
        assert_eq!(t.budget, Some(9));
        let t = obj(json!({"reasoning": {"effort": "medium"}, "max_thinking_tokens": 10}))
            .thinking(&d)
            .unwrap();
        assert_eq!(t.budget, Some(10));
        assert!(obj(json!({"reasoning_effort": "maximal"}))
            .thinking(&d)
            .is_err());
        assert!(obj(
            json!({"enable_thinking": true, "chat_template_kwargs": {"enable_thinking": false}})
        )
        .thinking(&d)
        .is_err());
        assert!(obj(json!({"max_thinking_tokens": 5, "thinking_budget": 6}))
            .thinking(&d)
            .is_err());
        assert!(
            obj(json!({"reasoning_effort": "none", "enable_thinking": true}))
                .thinking(&d)
                .is_err()
        );
    }
}
