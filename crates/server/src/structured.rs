//! Structured output: what a request asks its output to be, turned into a grammar the
//! engine enforces while decoding (`engine::constraint`).
//!
//! * `response_format` (chat, completions) and `text.format` (Responses):
//!   `{"type": "json_schema", ...}` binds the answer to the schema, `{"type":
//!   "json_object"}` to any JSON object.
//! * A forced tool call — OpenAI `tool_choice` `"required"` or a named function,
//!   Anthropic `{"type": "any"}` or `{"type": "tool", "name"}` — binds the answer to
//!   tool calls in the Qwen form the model's template uses, each call's arguments to
//!   its tool's parameter schema; `parallel_tool_calls: false` /
//!   `disable_parallel_tool_use: true` to exactly one call.
//! * With tools offered and the choice left to the model (`auto`), a schema binds only
//!   a text answer: a tool call in the template's form stays possible.
//!
//! The think block stays free: the grammar starts after `</think>`. JSON is compact
//! (no optional whitespace). A schema llguidance cannot enforce is a 400 naming the
//! keyword (its compile error) at the schema's field.

use engine::constraint::{grammar::compact, Constraint, Grammar, GrammarCompiler, ThinkGate};
use serde_json::Value;

use crate::error::ApiError;
use crate::worker::ThinkPlan;
use crate::AppState;

/// What a request's output must be.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    /// The answer as JSON (None: free text, or only tool calls when `force_tools`).
    pub json: Option<JsonAnswer>,
    /// Tools whose calls are allowed, in the template's shape
    /// (`{"type": "function", "function": {"name", "parameters"}}`).
    pub tools: Vec<Tool>,
    /// The answer must be tool calls (`required`, a named tool, `any`).
    pub force_tools: bool,
    /// At most one call.
    pub single_call: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct JsonAnswer {
    pub schema: Value,
    /// The request field the schema came from (for errors).
    pub field: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub parameters: Value,
}

/// The Qwen tool-call form a template writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallForm {
    /// `<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>` (Qwen3, Qwen3-Next).
    Json,
    /// `<tool_call>\n<function=f>\n<parameter=p>\nv\n</parameter>\n</function>\n</tool_call>`
    /// (Qwen3.5 / Qwen3.6, Qwen3-Coder).
    Xml,
}

impl CallForm {
    /// The form the chat template renders tool calls in.
    pub fn of_template(source: Option<&str>) -> CallForm {
        match source {
            Some(s) if s.contains("<function=") => CallForm::Xml,
            _ => CallForm::Json,
        }
    }
}

/// The template-shaped tools of a conversation.
pub fn tools_of(conv_tools: Option<&Value>) -> Vec<Tool> {
    conv_tools
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|t| {
                    let f = t.get("function")?;
                    Some(Tool {
                        name: f.get("name")?.as_str()?.to_string(),
                        parameters: f
                            .get("parameters")
                            .cloned()
                            .unwrap_or_else(|| serde_json::json!({"type": "object"})),
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Keeps only the tool named `name` (a forced named tool); a name not offered is a 400.
pub fn only_named(tools: Vec<Tool>, name: &str, field: &str) -> Result<Vec<Tool>, ApiError> {
    let kept: Vec<Tool> = tools.into_iter().filter(|t| t.name == name).collect();
    if kept.is_empty() {
        return Err(ApiError::field(
            field,
            format!("{field}: no tool named \"{name}\" is in tools"),
        ));
    }
    Ok(kept)
}

/// The spec of an answer format and the tools a choice allows (None: the output is
/// free).
pub fn finish(
    json: Option<JsonAnswer>,
    tools: Vec<Tool>,
    force: bool,
    single: bool,
) -> Option<Spec> {
    if json.is_none() && !force {
        return None;
    }
    Some(Spec {
        json,
        tools,
        force_tools: force,
        single_call: single,
    })
}

/// A JSON string literal for the Lark grammar (its escapes are JSON's).
fn lit(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

/// `schema` embedded in a Lark grammar: compact, with the root's `$defs` carried
/// along when it is a part of a larger schema (so `#/$defs/...` still resolves).
fn embed(schema: &Value, root_defs: Option<&Value>) -> String {
    let mut s = compact(schema);
    if let (Some(defs), Some(o)) = (root_defs, s.as_object_mut()) {
        o.entry("$defs").or_insert_with(|| defs.clone());
    }
    s.to_string()
}

/// The Lark rules of one tool call (rule `name`), in the template's form.
fn call_rules(tool: &Tool, name: &str, form: CallForm, rules: &mut Vec<String>) {
    match form {
        CallForm::Json => {
            let head = format!(
                "<tool_call>\n{{\"name\": {}, \"arguments\": ",
                lit(&tool.name)
            );
            rules.push(format!(
                "{name}: {} %json {} {}",
                lit(&head),
                embed(&tool.parameters, None),
                lit("}\n</tool_call>")
            ));
        }
        CallForm::Xml => {
            let props = tool
                .parameters
                .get("properties")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            let required: Vec<&str> = tool
                .parameters
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let defs = tool.parameters.get("$defs");
            let mut parts = Vec::new();
            for (j, (pname, pschema)) in props.iter().enumerate() {
                let rule = format!("{name}_p{j}");
                let open = lit(&format!("<parameter={pname}>\n"));
                let close = "\n</parameter>\n";
                let is_text = pschema.get("type").and_then(Value::as_str) == Some("string")
                    && pschema.get("enum").is_none()
                    && pschema.get("const").is_none();
                // Strings are written raw in this form, so an enum of strings (or a
                // string const) is its words, unquoted.
                let words: Option<Vec<&str>> = match (pschema.get("enum"), pschema.get("const")) {
                    (Some(Value::Array(e)), _) => e.iter().map(Value::as_str).collect(),
                    (None, Some(Value::String(c))) => Some(vec![c.as_str()]),
                    _ => None,
                };
                if let Some(words) = words.filter(|w| !w.is_empty()) {
                    let alts: Vec<String> = words.iter().map(|w| lit(w)).collect();
                    rules.push(format!(
                        "{rule}: {open} ({}) {}",
                        alts.join(" | "),
                        lit(close)
                    ));
                } else if is_text {
                    // Raw text up to the closing tag (the parser reads a string
                    // parameter's value as it stands), within maxLength.
                    let body = match pschema.get("maxLength").and_then(Value::as_u64) {
                        Some(n) => format!("/(?s:.{{0,{n}}})/"),
                        None => "/(?s:.*)/".to_string(),
                    };
                    rules.push(format!("{rule}_v[suffix={}]: {body}", lit(close)));
                    rules.push(format!("{rule}: {open} {rule}_v"));
                } else {
                    rules.push(format!(
                        "{rule}: {open} %json {} {}",
                        embed(pschema, defs),
                        lit(close)
                    ));
                }
                parts.push(if required.contains(&pname.as_str()) {
                    rule
                } else {
                    format!("{rule}?")
                });
            }
            rules.push(format!(
                "{name}: {} {} {}",
                lit(&format!("<tool_call>\n<function={}>\n", tool.name)),
                parts.join(" "),
                lit("</function>\n</tool_call>")
            ));
        }
    }
}

/// The grammar of `spec`'s answer.
pub fn grammar(spec: &Spec, form: CallForm) -> Grammar {
    if let (Some(j), true) = (&spec.json, spec.tools.is_empty()) {
        return Grammar::JsonSchema(j.schema.clone());
    }
    let mut rules = Vec::new();
    let names: Vec<String> = (0..spec.tools.len()).map(|i| format!("call{i}")).collect();
    for (tool, name) in spec.tools.iter().zip(&names) {
        call_rules(tool, name, form, &mut rules);
    }
    rules.push(format!("call: {}", names.join(" | ")));
    let calls = if spec.single_call {
        "call"
    } else {
        "call (\"\\n\" call)*"
    };
    let start = match (&spec.json, spec.force_tools) {
        (_, true) => format!("start: {calls}"),
        (Some(j), false) => format!("start: %json {} | {calls}", embed(&j.schema, None)),
        // Not reached: a spec without a schema forces tools.
        (None, false) => format!("start: {calls}"),
    };
    rules.insert(0, start);
    Grammar::Lark(rules.join("\n"))
}

/// The compiler for this server's tokenizer, built on first use.
fn compiler(state: &AppState) -> Result<&GrammarCompiler, ApiError> {
    state
        .grammar_compiler()
        .map_err(|e| ApiError::internal(format!("structured output is unavailable: {e}")))
}

/// The constraint the engine enforces for `spec`, starting after the think block that
/// `think` describes (`thinking`: the request lets the model think).
pub fn constraint(
    state: &AppState,
    spec: &Spec,
    think: &ThinkPlan,
) -> Result<Constraint, ApiError> {
    let form = CallForm::of_template(state.template.as_deref().map(|t| t.source()));
    let g = grammar(spec, form);
    let compiled = compiler(state)?.compile(&g).map_err(|e| {
        let field = match &spec.json {
            Some(j) if !spec.force_tools => j.field.clone(),
            _ => "tools".to_string(),
        };
        ApiError::field(
            &field,
            format!("{field}: this schema cannot be enforced: {e}"),
        )
    })?;
    let c = Constraint::new(compiled);
    Ok(match think.close_id {
        Some(close) if think.open_at_start || think.open_id.is_some() => c.after_think(ThinkGate {
            open: think.open_id,
            close,
            inside: think.open_at_start,
        }),
        _ => c,
    })
}
