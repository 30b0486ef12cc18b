//! Request fields shared by every generation route: sampling, token budgets, stop
//! sequences and the thinking controls, validated and merged with the server defaults.
//!
//! The rules: a value outside its defined range is a 400 naming the field, never
//! clamped; a field we cannot honour and that would change the result (n > 1,
//! logprobs, a response format, ...) is a 400; a field the request sends always wins,
//! a server default fills only a field the request omits, and a request that sends
//! `temperature: 0` decodes greedy and takes none of the sampling defaults.

use engine::SamplingParams;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::settings::{RequestDefaults, EFFORTS};

pub type Obj = Map<String, Value>;

/// Thinking budget (tokens) that each reasoning effort maps to. The Qwen templates
/// know only "thinking on/off", so effort is expressed as a budget on the think block:
/// `minimal` 256, `low` 1024, `medium` 4096; `high`, `xhigh`, `max` and `ultra` are
/// unbounded (the request's token budget and the answer room still apply). `none`
/// turns thinking off (handled by `parse_thinking`).
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
}

/// A number field within `[lo, hi]`; absent or null is None.
pub fn opt_f64(o: &Obj, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x >= lo && x <= hi => Ok(Some(x)),
            Some(x) => Err(ApiError::field(
                name,
                format!("{name} must be between {lo} and {hi}, got {x}"),
            )),
            None => Err(ApiError::field(
                name,
                format!("{name} must be a number, got {v}"),
            )),
        },
    }
}

/// A whole-number field `>= min`; absent or null is None.
pub fn opt_uint(o: &Obj, name: &str, min: u64) -> Result<Option<u64>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= min => Ok(Some(n)),
            _ => Err(ApiError::field(
                name,
                format!("{name} must be a whole number >= {min}, got {v}"),
            )),
        },
    }
}

pub fn opt_bool(o: &Obj, name: &str) -> Result<Option<bool>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::field(
            name,
            format!("{name} must be true or false, got {v}"),
        )),
    }
}

pub fn opt_str<'a>(o: &'a Obj, name: &str) -> Result<Option<&'a str>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(ApiError::field(
            name,
            format!("{name} must be a string, got {v}"),
        )),
    }
}

pub fn opt_obj<'a>(o: &'a Obj, name: &str) -> Result<Option<&'a Obj>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(v) => Err(ApiError::field(
            name,
            format!("{name} must be an object, got {v}"),
        )),
    }
}

/// The first of `names` present; two present with different values is a 400.
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

/// The log-probabilities a request asks for: None, or the number of alternatives
/// listed beside each generated token.
pub fn parse_logprobs(o: &Obj, form: LogprobsForm) -> Result<Option<usize>, ApiError> {
    let max = engine::MAX_TOP_LOGPROBS as u64;
    let logprobs = o.get("logprobs").filter(|v| !v.is_null());
    let top = o.get("top_logprobs").filter(|v| !v.is_null());
    let (name, n) = match form {
        LogprobsForm::Refused => {
            // Only the neutral values (false, 0).
            let neutral = |v: Option<&Value>| {
                v.is_none_or(|v| *v == Value::Bool(false) || v.as_u64() == Some(0))
            };
            if neutral(logprobs) && neutral(top) {
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
            let n = opt_uint(o, "top_logprobs", 0)?;
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

/// Fields we do not implement whose presence (with a non-neutral value) changes the
/// result; refused rather than ignored.
pub fn refuse_unsupported(o: &Obj) -> Result<(), ApiError> {
    let refuse = |name: &str, why: &str| Err(ApiError::field(name, format!("{name}: {why}")));
    if let Some(n) = o.get("n").filter(|v| !v.is_null()) {
        if n.as_u64() != Some(1) {
            return refuse("n", &format!("only n = 1 is supported, got {n}"));
        }
    }
    if let Some(n) = o.get("best_of").filter(|v| !v.is_null()) {
        if n.as_u64() != Some(1) {
            return refuse(
                "best_of",
                &format!("only best_of = 1 is supported, got {n}"),
            );
        }
    }
    if o.get("echo").and_then(Value::as_bool) == Some(true) {
        return refuse("echo", "echo is not supported");
    }
    if o.get("suffix")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty())
    {
        return refuse("suffix", "suffix (fill-in-the-middle) is not supported");
    }
    // `response_format` is read by `structured` (json_schema, json_object are enforced).
    if o.get("functions").is_some_and(|v| !v.is_null()) {
        return refuse(
            "functions",
            "the deprecated functions / function_call form is not supported; send tools",
        );
    }
    if o.get("modalities")
        .and_then(Value::as_array)
        .is_some_and(|m| m.iter().any(|x| x != "text"))
    {
        return refuse("modalities", "only text output is supported");
    }
    for name in ["grammar", "json_schema"] {
        if o.get(name).is_some_and(|v| !v.is_null()) {
            return refuse(name, "constrained decoding is not supported");
        }
    }
    let neutral = [
        ("mirostat", 0.0),
        ("typical_p", 1.0),
        ("tfs_z", 1.0),
        ("dry_multiplier", 0.0),
        ("xtc_probability", 0.0),
        ("n_probs", 0.0),
        ("dynatemp_range", 0.0),
    ];
    for (name, ok) in neutral {
        if let Some(v) = o.get(name).filter(|v| !v.is_null()) {
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

/// `stop` / `stop_sequences`: a string or a list of non-empty strings.
pub fn parse_stop(o: &Obj, name: &str) -> Result<Vec<String>, ApiError> {
    let list = match o.get(name) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut out = Vec::new();
            for v in a {
                match v.as_str() {
                    Some(s) => out.push(s.to_string()),
                    None => {
                        return Err(ApiError::field(
                            name,
                            format!("{name} must be a string or a list of strings, got {v}"),
                        ))
                    }
                }
            }
            out
        }
        Some(v) => {
            return Err(ApiError::field(
                name,
                format!("{name} must be a string or a list of strings, got {v}"),
            ))
        }
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

/// `logit_bias`: `{"token id": bias}` (OpenAI) or `[[id, bias], ...]` (llama-server),
/// bias in [-100, 100]; -100 bans the token.
pub fn parse_logit_bias(o: &Obj, n_vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    const NAME: &str = "logit_bias";
    let mut pairs: Vec<(Value, Value)> = Vec::new();
    match o.get(NAME) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => {
            for (k, v) in m {
                pairs.push((Value::String(k.clone()), v.clone()));
            }
        }
        Some(Value::Array(a)) => {
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
        Some(v) => {
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

/// The token budget from whichever of `names` the request sends (they must agree),
/// else the server default.
pub fn parse_max_tokens(o: &Obj, names: &[&str], default: usize) -> Result<usize, ApiError> {
    let mut found = Vec::new();
    for name in names {
        if let Some(n) = opt_uint(o, name, 1)? {
            found.push((name.to_string(), n));
        }
    }
    Ok(agreeing(found)?.map(|n| n as usize).unwrap_or(default))
}

/// Sampling: request fields over server defaults (OpenAI ranges; `temp_max` is 2 for
/// OpenAI routes and 1 for Anthropic).
pub fn parse_sampling(
    o: &Obj,
    d: &RequestDefaults,
    n_vocab: usize,
    temp_max: f64,
) -> Result<SamplingParams, ApiError> {
    let temperature = opt_f64(o, "temperature", 0.0, temp_max)?;
    let top_p = opt_f64(o, "top_p", 0.0, 1.0)?;
    if top_p == Some(0.0) {
        return Err(ApiError::field(
            "top_p",
            "top_p must be greater than 0 and at most 1, got 0",
        ));
    }
    let top_k = opt_uint(o, "top_k", 0)?;
    let min_p = opt_f64(o, "min_p", 0.0, 1.0)?;
    let presence = opt_f64(o, "presence_penalty", -2.0, 2.0)?;
    let frequency = opt_f64(o, "frequency_penalty", -2.0, 2.0)?;
    let repeat = opt_f64(o, "repeat_penalty", 0.0, 10.0)?;
    if repeat == Some(0.0) {
        return Err(ApiError::field(
            "repeat_penalty",
            "repeat_penalty must be greater than 0",
        ));
    }
    let repeat_last_n = opt_uint(o, "repeat_last_n", 0)?;
    let seed = match o.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(s), _) => Some(s),
            // llama.cpp clients send -1 for "random".
            (None, Some(-1)) => None,
            _ => {
                return Err(ApiError::field(
                    "seed",
                    format!("seed must be a whole number >= 0, got {v}"),
                ))
            }
        },
    };
    let logit_bias = parse_logit_bias(o, n_vocab)?;
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
        temperature: pick(temperature, d.temperature, 0.0),
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

/// The thinking controls every route understands, under all the names clients use:
/// `reasoning_effort`, `enable_thinking`, `chat_template_kwargs.{enable_thinking,
/// reasoning_effort}`, `max_thinking_tokens` and its aliases, the `reasoning` object
/// (`{"effort", "enabled", "max_tokens"}`), the Anthropic `thinking` object
/// (`{"type": "enabled"|"disabled"|"adaptive", "budget_tokens"}`) and Anthropic's
/// `output_config.effort`. Names that disagree are a 400.
pub fn parse_thinking(o: &Obj, d: &RequestDefaults) -> Result<Thinking, ApiError> {
    let mut enabled: Vec<(String, bool)> = Vec::new();
    let mut efforts: Vec<(String, String)> = Vec::new();
    let mut budgets: Vec<(String, u64)> = Vec::new();

    if let Some(e) = opt_str(o, "reasoning_effort")? {
        efforts.push((
            "reasoning_effort".into(),
            effort_value("reasoning_effort", e)?,
        ));
    }
    if let Some(b) = opt_bool(o, "enable_thinking")? {
        enabled.push(("enable_thinking".into(), b));
    }
    if let Some(k) = opt_obj(o, "chat_template_kwargs")? {
        if let Some(b) = opt_bool(k, "enable_thinking")
            .map_err(|e| ApiError::field("chat_template_kwargs.enable_thinking", e.message))?
        {
            enabled.push(("chat_template_kwargs.enable_thinking".into(), b));
        }
        if let Some(e) = k.get("reasoning_effort").and_then(Value::as_str) {
            let name = "chat_template_kwargs.reasoning_effort";
            efforts.push((name.into(), effort_value(name, e)?));
        }
    }
    for name in [
        "max_thinking_tokens",
        "thinking_budget_tokens",
        "thinking_budget",
        "thinking_token_budget",
    ] {
        if let Some(n) = opt_uint(o, name, 1)? {
            budgets.push((name.into(), n));
        }
    }
    if let Some(r) = opt_obj(o, "reasoning")? {
        if let Some(e) = r.get("effort").filter(|v| !v.is_null()) {
            let e = e.as_str().ok_or_else(|| {
                ApiError::field(
                    "reasoning.effort",
                    format!("reasoning.effort must be a string, got {e}"),
                )
            })?;
            efforts.push((
                "reasoning.effort".into(),
                effort_value("reasoning.effort", e)?,
            ));
        }
        if let Some(b) = r.get("enabled").and_then(Value::as_bool) {
            enabled.push(("reasoning.enabled".into(), b));
        }
        if let Some(n) = r.get("max_tokens").filter(|v| !v.is_null()) {
            match n.as_u64() {
                Some(n) if n >= 1 => budgets.push(("reasoning.max_tokens".into(), n)),
                _ => {
                    return Err(ApiError::field(
                        "reasoning.max_tokens",
                        format!("reasoning.max_tokens must be a whole number >= 1, got {n}"),
                    ))
                }
            }
        }
    }
    // Anthropic's effort control (Claude Code sends it); read on every route.
    if let Some(oc) = opt_obj(o, "output_config")? {
        if let Some(e) = oc.get("effort").filter(|v| !v.is_null()) {
            let name = "output_config.effort";
            let e = e.as_str().ok_or_else(|| {
                ApiError::field(name, format!("{name} must be a string, got {e}"))
            })?;
            efforts.push((name.into(), effort_value(name, e)?));
        }
    }
    if let Some(t) = opt_obj(o, "thinking")? {
        match t.get("type").and_then(Value::as_str) {
            Some("enabled") | Some("adaptive") => {
                enabled.push(("thinking.type".into(), true));
                if let Some(n) = t.get("budget_tokens").filter(|v| !v.is_null()) {
                    match n.as_u64() {
                        Some(n) if n >= 1 => budgets.push(("thinking.budget_tokens".into(), n)),
                        _ => {
                            return Err(ApiError::field(
                                "thinking.budget_tokens",
                                format!(
                                    "thinking.budget_tokens must be a whole number >= 1, got {n}"
                                ),
                            ))
                        }
                    }
                }
            }
            Some("disabled") => enabled.push(("thinking.type".into(), false)),
            _ => {
                return Err(ApiError::field(
                    "thinking.type",
                    format!(
                        "thinking.type must be \"enabled\", \"adaptive\" or \"disabled\", got {}",
                        t.get("type")
                            .map(Value::to_string)
                            .unwrap_or_else(|| "nothing".into())
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

/// `stream` and `stream_options.include_usage`.
pub fn parse_stream(o: &Obj) -> Result<(bool, bool), ApiError> {
    let stream = opt_bool(o, "stream")?.unwrap_or(false);
    let include_usage = match opt_obj(o, "stream_options")? {
        Some(so) => opt_bool(so, "include_usage")
            .map_err(|e| ApiError::field("stream_options.include_usage", e.message))?
            .unwrap_or(false),
        None => false,
    };
    Ok((stream, include_usage))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Obj {
        v.as_object().cloned().unwrap()
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
            let e = parse_sampling(&obj(json!({ field: v })), &d, 100, 2.0).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
            assert!(e.message.contains(field), "{}", e.message);
        }
    }

    #[test]
    fn defaults_fill_omitted_and_temp0_takes_none() {
        let d = RequestDefaults::default();
        let s = parse_sampling(&obj(json!({"top_k": 5})), &d, 100, 2.0).unwrap();
        assert_eq!(s.temperature, d.temperature);
        assert_eq!(s.top_k, 5);
        assert_eq!(s.top_p, d.top_p);
        let g = parse_sampling(&obj(json!({"temperature": 0})), &d, 100, 2.0).unwrap();
        assert_eq!(g.temperature, 0.0);
        assert_eq!(g.top_k, 0);
        assert_eq!(g.top_p, 1.0);
    }

    #[test]
    fn logit_bias_forms() {
        let b = parse_logit_bias(&obj(json!({"logit_bias": {"5": 10, "7": -100}})), 100).unwrap();
        assert_eq!(b[0], (5, 10.0));
        assert_eq!(b[1].1, f32::NEG_INFINITY);
        let b = parse_logit_bias(&obj(json!({"logit_bias": [[3, 1.5]]})), 100).unwrap();
        assert_eq!(b, vec![(3, 1.5)]);
        assert!(parse_logit_bias(&obj(json!({"logit_bias": {"500": 1}})), 100).is_err());
        assert!(parse_logit_bias(&obj(json!({"logit_bias": {"5": 101}})), 100).is_err());
    }

    #[test]
    fn budgets_must_agree() {
        let names = ["max_tokens", "max_completion_tokens"];
        assert_eq!(parse_max_tokens(&obj(json!({})), &names, 77).unwrap(), 77);
        assert_eq!(
            parse_max_tokens(
                &obj(json!({"max_tokens": 5, "max_completion_tokens": 5})),
                &names,
                7
            )
            .unwrap(),
            5
        );
        let e = parse_max_tokens(
            &obj(json!({"max_tokens": 5, "max_completion_tokens": 6})),
            &names,
            7,
        )
        .unwrap_err();
        assert!(e.message.contains("max_completion_tokens"));
        assert!(parse_max_tokens(&obj(json!({"max_tokens": 0})), &names, 7).is_err());
    }

    #[test]
    fn unsupported_refused() {
        for body in [
            json!({"n": 2}),
            json!({"best_of": 3}),
            json!({"echo": true}),
        ] {
            assert!(refuse_unsupported(&obj(body.clone())).is_err(), "{body}");
        }
        refuse_unsupported(&obj(
            json!({"n": 1, "logprobs": false, "response_format": {"type": "text"}}),
        ))
        .unwrap();
    }

    #[test]
    fn logprobs_forms() {
        use LogprobsForm::*;
        let p = |body: Value, form| parse_logprobs(&obj(body), form);
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
            parse_stop(&obj(json!({"stop": "x"})), "stop").unwrap(),
            vec!["x"]
        );
        assert_eq!(
            parse_stop(&obj(json!({"stop": ["a", "b"]})), "stop")
                .unwrap()
                .len(),
            2
        );
        assert!(parse_stop(&obj(json!({"stop": [""]})), "stop").is_err());
        assert!(parse_stop(&obj(json!({"stop": 3})), "stop").is_err());
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
                let t = parse_thinking(&obj(body.clone()), &d)
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
        let e = parse_thinking(
            &obj(json!({"output_config": {"effort": "low"}, "reasoning_effort": "max"})),
            &d,
        )
        .unwrap_err();
        assert!(e.message.contains("output_config.effort"), "{e}");
        let e = parse_thinking(&obj(json!({"output_config": {"effort": "huge"}})), &d).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("output_config.effort"));
    }

    #[test]
    fn thinking_controls() {
        let d = RequestDefaults::default();
        let t = parse_thinking(&obj(json!({})), &d).unwrap();
        assert!(t.enabled && t.budget.is_none());
        let t = parse_thinking(&obj(json!({"reasoning_effort": "none"})), &d).unwrap();
        assert!(!t.enabled);
        let t = parse_thinking(&obj(json!({"reasoning_effort": "low"})), &d).unwrap();
        assert_eq!(t.budget, Some(1024));
        let t = parse_thinking(
            &obj(json!({"chat_template_kwargs": {"enable_thinking": false}})),
            &d,
        )
        .unwrap();
        assert!(!t.enabled);
        let t = parse_thinking(
            &obj(json!({"thinking": {"type": "enabled", "budget_tokens": 9}})),
            &d,
        )
        .unwrap();
        assert_eq!(t.budget, Some(9));
        let t = parse_thinking(
            &obj(json!({"reasoning": {"effort": "medium"}, "max_thinking_tokens": 10})),
            &d,
        )
        .unwrap();
        assert_eq!(t.budget, Some(10));
        assert!(parse_thinking(&obj(json!({"reasoning_effort": "maximal"})), &d).is_err());
        assert!(parse_thinking(
            &obj(
                json!({"enable_thinking": true, "chat_template_kwargs": {"enable_thinking": false}})
            ),
            &d
        )
        .is_err());
        assert!(parse_thinking(
            &obj(json!({"max_thinking_tokens": 5, "thinking_budget": 6})),
            &d
        )
        .is_err());
        assert!(parse_thinking(
            &obj(json!({"reasoning_effort": "none", "enable_thinking": true})),
            &d
        )
        .is_err());
    }
}
