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
use serde_json::{Map, Value};

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

/// A JSON-schema answer format: `{"type": "json_schema", ...}` or `{"type":
/// "json_object"}` (or text: None). `fmt` is the format object, `field` its path;
/// `schema_of` finds the schema inside it (chat nests it in `json_schema`).
fn answer_format(
    fmt: Option<&Value>,
    field: &str,
    nested: bool,
) -> Result<Option<JsonAnswer>, ApiError> {
    let Some(fmt) = fmt.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let ty = fmt.get("type").and_then(Value::as_str);
    match ty {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(JsonAnswer {
            schema: serde_json::json!({"type": "object"}),
            field: field.to_string(),
        })),
        Some("json_schema") => {
            let (holder, holder_field) = if nested {
                (fmt.get("json_schema"), format!("{field}.json_schema"))
            } else {
                (Some(fmt), field.to_string())
            };
            let Some(holder) = holder.and_then(Value::as_object) else {
                return Err(ApiError::field(
                    &holder_field,
                    format!("{holder_field} must be an object with a `schema`"),
                ));
            };
            let schema_field = format!("{holder_field}.schema");
            let schema = match holder.get("schema") {
                // OpenAI accepts a format without a schema: any JSON value.
                None | Some(Value::Null) => serde_json::json!({}),
                Some(s @ Value::Object(_)) | Some(s @ Value::Bool(_)) => s.clone(),
                Some(other) => {
                    return Err(ApiError::field(
                        &schema_field,
                        format!("{schema_field} must be a JSON schema object, got {other}"),
                    ))
                }
            };
            Ok(Some(JsonAnswer {
                schema,
                field: schema_field,
            }))
        }
        _ => Err(ApiError::field(
            &format!("{field}.type"),
            format!(
                "{field}.type must be \"text\", \"json_object\" or \"json_schema\", got {}",
                fmt.get("type").unwrap_or(&Value::Null)
            ),
        )),
    }
}

/// The template-shaped tools of a conversation.
fn tools_of(conv_tools: Option<&Value>) -> Vec<Tool> {
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
fn only_named(tools: Vec<Tool>, name: &str, field: &str) -> Result<Vec<Tool>, ApiError> {
    let kept: Vec<Tool> = tools.into_iter().filter(|t| t.name == name).collect();
    if kept.is_empty() {
        return Err(ApiError::field(
            field,
            format!("{field}: no tool named \"{name}\" is in tools"),
        ));
    }
    Ok(kept)
}

fn finish(json: Option<JsonAnswer>, tools: Vec<Tool>, force: bool, single: bool) -> Option<Spec> {
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

/// OpenAI `tool_choice` (chat: `{"type":"function","function":{"name"}}`; Responses:
/// `{"type":"function","name"}`): whether calls are forced, and the tools allowed.
fn openai_choice(
    body: &Map<String, Value>,
    tools: Vec<Tool>,
) -> Result<(bool, Vec<Tool>), ApiError> {
    match body.get("tool_choice") {
        None | Some(Value::Null) => Ok((false, tools)),
        Some(Value::String(s)) if s == "auto" || s == "none" => Ok((false, tools)),
        Some(Value::String(s)) if s == "required" => {
            if tools.is_empty() {
                return Err(ApiError::field(
                    "tool_choice",
                    "tool_choice: \"required\" needs at least one function in tools",
                ));
            }
            Ok((true, tools))
        }
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::field(
                        "tool_choice",
                        "tool_choice: a named choice needs function.name",
                    )
                })?;
            Ok((true, only_named(tools, name, "tool_choice")?))
        }
        Some(other) => Err(ApiError::field(
            "tool_choice",
            format!(
                "tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", ...}}, got {other}"
            ),
        )),
    }
}

fn parallel_off(body: &Map<String, Value>) -> bool {
    body.get("parallel_tool_calls").and_then(Value::as_bool) == Some(false)
}

/// `/v1/chat/completions`: `response_format`, `tool_choice`, `parallel_tool_calls`.
pub fn openai_chat(
    body: &Map<String, Value>,
    conv_tools: Option<&Value>,
) -> Result<Option<Spec>, ApiError> {
    let json = answer_format(body.get("response_format"), "response_format", true)?;
    let (force, tools) = openai_choice(body, tools_of(conv_tools))?;
    Ok(finish(json, tools, force, parallel_off(body)))
}

/// `/v1/completions`: `response_format`.
pub fn openai_completion(body: &Map<String, Value>) -> Result<Option<Spec>, ApiError> {
    let json = answer_format(body.get("response_format"), "response_format", true)?;
    Ok(finish(json, Vec::new(), false, false))
}

/// `/v1/responses`: `text.format`, `tool_choice`, `parallel_tool_calls`.
pub fn responses(
    body: &Map<String, Value>,
    conv_tools: Option<&Value>,
) -> Result<Option<Spec>, ApiError> {
    let fmt = body.get("text").and_then(|t| t.get("format"));
    let json = answer_format(fmt, "text.format", false)?;
    let (force, tools) = openai_choice(body, tools_of(conv_tools))?;
    Ok(finish(json, tools, force, parallel_off(body)))
}

/// `/v1/messages`: `tool_choice` `any` / `tool` and `disable_parallel_tool_use`.
pub fn anthropic(
    body: &Map<String, Value>,
    conv_tools: Option<&Value>,
) -> Result<Option<Spec>, ApiError> {
    let tools = tools_of(conv_tools);
    let choice = body.get("tool_choice").filter(|v| !v.is_null());
    let single = choice
        .and_then(|c| c.get("disable_parallel_tool_use"))
        .and_then(Value::as_bool)
        == Some(true);
    let (force, tools) = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        None | Some("auto") | Some("none") => (false, tools),
        Some("any") => {
            if tools.is_empty() {
                return Err(ApiError::field(
                    "tool_choice",
                    "tool_choice: \"any\" needs at least one tool in tools",
                ));
            }
            (true, tools)
        }
        Some("tool") => {
            let name = choice
                .and_then(|c| c.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::field(
                        "tool_choice.name",
                        "tool_choice.name: a tool name is required",
                    )
                })?;
            (true, only_named(tools, name, "tool_choice.name")?)
        }
        Some(other) => {
            return Err(ApiError::field(
                "tool_choice.type",
                format!(
                "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\", got \"{other}\""
            ),
            ))
        }
    };
    Ok(finish(None, tools, force, single))
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn formats_are_read_where_each_api_puts_them() {
        let chat = obj(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}),
        );
        let s = openai_chat(&chat, None).unwrap().unwrap();
        assert_eq!(s.json.unwrap().field, "response_format.json_schema.schema");
        let r = obj(
            json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "array"}}}}),
        );
        let s = responses(&r, None).unwrap().unwrap();
        assert_eq!(s.json.unwrap().schema, json!({"type": "array"}));
        let o = obj(json!({"response_format": {"type": "json_object"}}));
        assert!(openai_completion(&o).unwrap().is_some());
        assert!(
            openai_completion(&obj(json!({"response_format": {"type": "text"}})))
                .unwrap()
                .is_none()
        );
        let e = openai_chat(&obj(json!({"response_format": {"type": "yaml"}})), None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.type"));
    }

    #[test]
    fn tool_choices() {
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}}
        ]);
        let s = openai_chat(&obj(json!({"tool_choice": "required"})), Some(&tools))
            .unwrap()
            .unwrap();
        assert!(s.force_tools && s.tools.len() == 2 && !s.single_call);
        let s = openai_chat(
            &obj(json!({"tool_choice": {"type": "function", "function": {"name": "b"}}, "parallel_tool_calls": false})),
            Some(&tools),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.tools.len(), s.tools[0].name.as_str(), s.single_call),
            (1, "b", true)
        );
        let e = openai_chat(
            &obj(json!({"tool_choice": {"type": "function", "function": {"name": "zz"}}})),
            Some(&tools),
        )
        .unwrap_err();
        assert!(e.message.contains("zz"));
        assert!(
            openai_chat(&obj(json!({"tool_choice": "auto"})), Some(&tools))
                .unwrap()
                .is_none()
        );
        let s = anthropic(&obj(json!({"tool_choice": {"type": "tool", "name": "a", "disable_parallel_tool_use": true}})), Some(&tools)).unwrap().unwrap();
        assert_eq!((s.tools[0].name.as_str(), s.single_call), ("a", true));
        assert!(
            anthropic(&obj(json!({"tool_choice": {"type": "any"}})), Some(&tools))
                .unwrap()
                .unwrap()
                .force_tools
        );
        let s = responses(
            &obj(json!({"tool_choice": {"type": "function", "name": "a"}})),
            Some(&tools),
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.tools[0].name, "a");
    }
}
