//! Structured output on the synthetic demo model (random weights: its free output is
//! gibberish, so a reply that parses and validates shows the grammar at work).
//! Every reply is checked with an independent JSON-schema validator.

use std::sync::{Arc, OnceLock};

use engine::constraint::{
    Allowed, Constraint, ConstraintError, Grammar, GrammarCompiler, ThinkGate, TokenConstraint,
    TokenMask,
};
use engine::{Engine, EngineConfig, FinishReason, Flow, GenerateRequest, SamplingParams};
use serde_json::{json, Value};

fn engine() -> Engine {
    let path = model::synth::synthetic_demo_path().expect("demo model");
    Engine::load(
        &path,
        &EngineConfig {
            max_context: Some(1024),
            device: Some(engine::Device::Cpu),
            ..Default::default()
        },
    )
    .expect("load the demo model")
}

fn compiler(eng: &Engine) -> Arc<GrammarCompiler> {
    static C: OnceLock<Arc<GrammarCompiler>> = OnceLock::new();
    C.get_or_init(|| Arc::new(GrammarCompiler::new(eng.tokenizer()).expect("compiler")))
        .clone()
}

/// Nested objects, an array of `$ref`s, an enum, an anyOf; every part bounded so a
/// random model's reply ends.
fn schema() -> Value {
    json!({
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer", "minimum": -5, "maximum": 5}
                },
                "required": ["x", "y"],
                "additionalProperties": false
            }
        },
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "color": {"enum": ["red", "green", "blue"]},
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3},
            "meta": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
                "required": ["ok", "tags"],
                "additionalProperties": false
            },
            "tag": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 5}, {"type": "null"}]}
        },
        "required": ["name", "color", "points", "meta", "tag"],
        "additionalProperties": false
    })
}

fn request(
    eng: &Engine,
    constraint: Option<Constraint>,
    sampling: SamplingParams,
) -> GenerateRequest {
    let prompt = eng
        .tokenizer()
        .encode_prompt(
            "<|im_start|>user\nDescribe a shape as JSON.<|im_end|>\n<|im_start|>assistant\n",
        )
        .expect("encode");
    GenerateRequest {
        prompt,
        max_tokens: 400,
        sampling,
        stop_at_eog: true,
        constraint,
        logprobs: None,
        speculative: Default::default(),
        images: Vec::new(),
    }
}

fn reply_text(eng: &Engine, tokens: &[u32]) -> String {
    eng.tokenizer().decode(tokens, true)
}

fn validate(schema: &Value, text: &str) -> Value {
    let v: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let validator = jsonschema::validator_for(schema).expect("the schema compiles");
    let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{text} does not validate: {errors:?}");
    v
}

#[test]
fn schema_replies_validate_greedy_and_sampled() {
    let mut eng = engine();
    let c = compiler(&eng);
    let s = schema();
    let grammar = c.compile(&Grammar::JsonSchema(s.clone())).expect("compile");
    let constraint = Constraint::new(grammar);

    // Unconstrained, the random model's reply is not JSON (the test means something).
    let free = eng
        .generate(&request(&eng, None, SamplingParams::default()), &mut |_| {
            Flow::Continue
        })
        .expect("generate");
    assert!(serde_json::from_str::<Value>(&reply_text(&eng, &free.tokens)).is_err());

    let mut runs = vec![SamplingParams::default()];
    for seed in [1, 2, 3, 4, 5] {
        runs.push(SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        });
    }
    runs.push(SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 40,
        seed: Some(9),
        ..Default::default()
    });
    let mut replies = std::collections::HashSet::new();
    for sampling in runs {
        let req = request(&eng, Some(constraint.clone()), sampling.clone());
        let out = eng
            .generate(&req, &mut |_| Flow::Continue)
            .expect("generate");
        assert_eq!(
            out.finish,
            FinishReason::Eog,
            "{sampling:?}: the grammar ends the reply"
        );
        let text = reply_text(&eng, &out.tokens);
        validate(&s, &text);
        replies.insert(text);
    }
    assert!(
        replies.len() > 2,
        "sampling varies the replies: {replies:?}"
    );
}

#[test]
fn json_object_and_lark_grammars() {
    let mut eng = engine();
    let c = compiler(&eng);
    // json_object with bounded parts: any object.
    let obj = json!({"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": false});
    let g = c
        .compile(&Grammar::JsonSchema(obj.clone()))
        .expect("compile");
    let out = eng
        .generate(
            &request(&eng, Some(Constraint::new(g)), SamplingParams::default()),
            &mut |_| Flow::Continue,
        )
        .expect("generate");
    validate(&obj, &reply_text(&eng, &out.tokens));

    // A Lark grammar with an embedded schema (the shape of a Qwen tool call).
    let args = json!({"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": false});
    let call = json!({"type": "object", "properties": {"name": {"const": "weather"}, "arguments": args}, "required": ["name", "arguments"], "additionalProperties": false});
    // Embedded schemas are made compact as `Grammar::JsonSchema` ones are.
    let embedded = engine::constraint::grammar::compact(&call);
    let lark = format!("start: \"<tool_call>\\n\" %json {embedded} \"\\n</tool_call>\"");
    let g = c.compile(&Grammar::Lark(lark)).expect("compile lark");
    for seed in [1, 2, 3] {
        let sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        };
        let out = eng
            .generate(
                &request(&eng, Some(Constraint::new(g.clone())), sampling),
                &mut |_| Flow::Continue,
            )
            .expect("generate");
        let text = reply_text(&eng, &out.tokens);
        let body = text
            .strip_prefix("<tool_call>\n")
            .and_then(|t| t.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("not a tool call: {text:?}"));
        validate(&call, body);
    }
}

#[test]
fn unsupported_keywords_are_named() {
    let eng = engine();
    let c = compiler(&eng);
    let e = c
        .compile(&Grammar::JsonSchema(json!({"type": "object", "unevaluatedProperties": false, "properties": {"a": {"type": "string", "contentEncoding": "base64"}, "b": {"dependentSchemas": {}}}})))
        .err()
        .expect("refused");
    assert!(
        e.0.contains("dependentSchemas") || e.0.contains("unevaluatedProperties"),
        "{e}"
    );
}

/// Allows every token: the constrained path with nothing to constrain.
#[derive(Clone)]
struct AllowAll(usize);

impl TokenConstraint for AllowAll {
    fn box_clone(&self) -> Box<dyn TokenConstraint> {
        Box::new(self.clone())
    }
    fn allowed(&mut self) -> Result<Allowed, ConstraintError> {
        Ok(Allowed {
            tokens: TokenMask {
                words: vec![u32::MAX; self.0.div_ceil(32)],
            },
            may_end: true,
        })
    }
    fn commit(&mut self, _token: u32) -> Result<(), ConstraintError> {
        Ok(())
    }
}

#[test]
fn an_allow_all_constraint_decodes_the_free_bytes() {
    // The constrained path (logits on the host, the mask beside the step, masking)
    // with nothing to forbid gives the unconstrained tokens, greedy (chosen on the
    // device without a constraint) and sampled.
    let mut eng = engine();
    let n = eng.tokenizer().vocab_size();
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(11),
            ..Default::default()
        },
    ] {
        let mut free = request(&eng, None, sampling.clone());
        free.max_tokens = 40;
        free.stop_at_eog = false;
        let a = eng.generate(&free, &mut |_| Flow::Continue).expect("free");
        eng.reset().expect("reset");
        let mut con = free.clone();
        con.constraint = Some(Constraint::new(Box::new(AllowAll(n))));
        let b = eng
            .generate(&con, &mut |_| Flow::Continue)
            .expect("constrained");
        eng.reset().expect("reset");
        assert_eq!(a.tokens, b.tokens, "{sampling:?}");
        assert_eq!(
            reply_text(&eng, &a.tokens).as_bytes(),
            reply_text(&eng, &b.tokens).as_bytes()
        );
    }
}

#[test]
fn the_think_block_stays_free_and_the_grammar_follows_it() {
    let mut eng = engine();
    let c = compiler(&eng);
    let tok = eng.tokenizer();
    let open = tok.token_id("<think>").expect("<think>");
    let close = tok.token_id("</think>").expect("</think>");
    let blank = tok.encode("\n\n", false).expect("encode");
    let s = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false});
    let g = c.compile(&Grammar::JsonSchema(s.clone())).expect("compile");
    let constraint = Constraint::new(g).after_think(ThinkGate {
        open: Some(open),
        close,
        inside: true,
    });
    let mut req = request(
        &eng,
        Some(constraint),
        SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..Default::default()
        },
    );
    let mut think = eng.tokenizer().encode_prompt("<think>\n").expect("encode");
    req.prompt.append(&mut think);
    // Close the block after 20 free tokens, as the server's thinking budget does:
    // `</think>` and a blank line, forced.
    let mut forced_close = vec![close];
    forced_close.extend(&blank);
    let out = eng
        .generate(&req, &mut |ev| {
            if ev.index == 19 {
                Flow::Force(forced_close.clone())
            } else {
                Flow::Continue
            }
        })
        .expect("generate");
    let at = out.tokens.iter().position(|&t| t == close).expect("closed");
    assert_eq!(at, 20);
    let free = reply_text(&eng, &out.tokens[..at]);
    assert!(
        serde_json::from_str::<Value>(&free).is_err(),
        "the thinking is free text: {free:?}"
    );
    let after = reply_text(&eng, &out.tokens[at + 1 + blank.len()..]);
    validate(&s, &after);
}

/// The mask's own cost per token on the demo model's 248k vocabulary, for
/// bench/RESULTS.md (`cargo test --release -p scoria-engine --test constraint --
/// --ignored --nocapture mask_cost`): the bench schema's masks, replayed over a
/// constrained greedy reply, timed alone.
#[test]
#[ignore]
fn mask_cost() {
    let mut eng = engine();
    let c = compiler(&eng);
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/structured-schema.json"
    ))
    .expect("bench schema");
    let schema: Value = serde_json::from_str(&text).expect("json");
    let g = c.compile(&Grammar::JsonSchema(schema)).expect("compile");
    let mut req = request(
        &eng,
        Some(Constraint::new(g.clone())),
        SamplingParams::default(),
    );
    req.max_tokens = 128;
    req.stop_at_eog = false;
    let out = eng
        .generate(&req, &mut |_| Flow::Continue)
        .expect("generate");
    let mut m = g.clone();
    let mut times = Vec::new();
    let eog = eng.tokenizer().eog_ids().to_vec();
    let text = reply_text(&eng, &out.tokens);
    for &t in &out.tokens {
        if eog.contains(&t) {
            println!("the reply ended the grammar: {text:?}");
            break;
        }
        let t0 = std::time::Instant::now();
        let a = m.allowed().expect("mask");
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        assert!(a.tokens.allows(t));
        m.commit(t).expect("commit");
    }
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "mask over {} tokens: mean {mean:.3} ms, median {:.3} ms, p90 {:.3} ms, max {:.3} ms; decode {:.2} ms/token",
        times.len(),
        times[times.len() / 2],
        times[times.len() * 9 / 10],
        times[times.len() - 1],
        out.timings.predicted_ms / out.tokens.len() as f64
    );
}

/// Where a constrained request's time goes: free greedy decoding, the constrained
/// path with nothing to constrain (logits to the host, the helper thread, masking),
/// and the bench schema; alternated so the machine's load hits all three alike
/// (`cargo test --release -p scoria-engine --test constraint -- --ignored
/// --nocapture overhead`).
#[test]
#[ignore]
fn overhead() {
    let mut eng = engine();
    let c = compiler(&eng);
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/structured-schema.json"
    ))
    .expect("bench schema");
    let schema: Value = serde_json::from_str(&text).expect("json");
    let g = c.compile(&Grammar::JsonSchema(schema)).expect("compile");
    let n = eng.tokenizer().vocab_size();
    let kinds: [(&str, Option<Constraint>); 3] = [
        ("free", None),
        ("allow-all", Some(Constraint::new(Box::new(AllowAll(n))))),
        ("schema", Some(Constraint::new(g))),
    ];
    let mut ms: Vec<Vec<f64>> = vec![Vec::new(); 3];
    for round in 0..6 {
        for (k, (_, con)) in kinds.iter().enumerate() {
            eng.reset().expect("reset");
            let mut req = request(&eng, con.clone(), SamplingParams::default());
            req.max_tokens = 129;
            req.stop_at_eog = false;
            let out = eng
                .generate(&req, &mut |_| Flow::Continue)
                .expect("generate");
            if round > 0 {
                ms[k].push(out.timings.predicted_ms / 128.0);
            }
        }
    }
    for (k, (name, _)) in kinds.iter().enumerate() {
        let mut v = ms[k].clone();
        v.sort_by(f64::total_cmp);
        println!(
            "{name}: ms/token median {:.3}, min {:.3} ({v:.3?})",
            v[v.len() / 2],
            v[0]
        );
    }
}
