//! The embedded Qwen vocabularies tokenize exactly like tiktoken (the reference they were
//! published with). Expected ids: tests/fixtures/tokenizer_expected.json, written by
//! tests/fixtures/gen_tokenizer_fixture.py.

use std::collections::HashMap;

use gguf::{Value, ValueType};
use model::tokenizer::{PreTokenizer, Tokenizer};
use model::vocab::{self, token_type, QwenVocab, VocabParts};

fn fixture() -> serde_json::Value {
    let text = include_str!("fixtures/tokenizer_expected.json");
    serde_json::from_str(text).expect("fixture JSON")
}

fn nfc(s: &str) -> String {
    let mut n = tokenizers::NormalizedString::from(s);
    n.nfc();
    n.get().to_string()
}

fn check_vocab(v: QwenVocab, key: &str) {
    let t0 = std::time::Instant::now();
    let parts = vocab::load(v).expect("load vocab");
    eprintln!("{key}: vocab loaded in {:?}", t0.elapsed());
    let fx = &fixture()[key];
    assert_eq!(parts.tokens.len(), v.padded_size());
    assert_eq!(parts.vocab_size, v.padded_size());
    assert_eq!(parts.token_types.len(), parts.tokens.len());
    assert_eq!(fx["n_ranks"].as_u64(), Some(v.n_ranks() as u64));
    assert_eq!(
        parts.merges.len() as u64,
        fx["n_merges"].as_u64().expect("n_merges")
    );
    for m in fx["merges_sample"].as_array().expect("sample") {
        let i = m[0].as_u64().expect("index") as usize;
        assert_eq!(parts.merges[i], m[1].as_str().expect("merge"), "merge {i}");
    }
    let n = v.n_ranks();
    assert_eq!(parts.tokens[n], "<|endoftext|>");
    assert_eq!(parts.tokens[n + 2], "<|im_end|>");
    assert_eq!(parts.eos_id, Some(n as u32 + 2));
    assert_eq!(parts.bos_id, Some(n as u32));
    assert_eq!(parts.pad_id, Some(n as u32));
    assert_eq!(parts.pre, v.pre());
    let think = parts
        .tokens
        .iter()
        .position(|t| t == "<think>")
        .expect("<think>");
    assert_eq!(think, n + 24);
    assert_eq!(parts.token_types[think], token_type::USER_DEFINED);
    assert_eq!(parts.token_types[n + 16], token_type::CONTROL); // <|fim_prefix|>
    assert_eq!(parts.token_types[n - 1], token_type::NORMAL);
    let last = parts.tokens.len() - 1;
    assert_eq!(parts.tokens[last], format!("[PAD{last}]"));
    assert_eq!(parts.token_types[last], token_type::UNUSED);

    let t0 = std::time::Instant::now();
    let tk = Tokenizer::from_parts(parts).expect("tokenizer");
    eprintln!("{key}: tokenizer built in {:?}", t0.elapsed());
    check_cases(&tk, fx);
    assert_eq!(tk.eog_ids(), &[n as u32 + 2, n as u32]);
}

fn check_cases(tk: &Tokenizer, fx: &serde_json::Value) {
    let mut failures = 0;
    for case in fx["cases"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        let want: Vec<u32> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        let got = tk.encode(text, true).expect("encode");
        if got != want {
            failures += 1;
            eprintln!("MISMATCH {text:?}\n  got  {got:?}\n  want {want:?}");
        }
        assert_eq!(tk.decode(&got, false), nfc(text), "round trip of {text:?}");
    }
    assert_eq!(failures, 0);
}

#[test]
fn qwen2_matches_tiktoken() {
    check_vocab(QwenVocab::Qwen2, "qwen2");
}

#[test]
fn qwen35_matches_tiktoken() {
    check_vocab(QwenVocab::Qwen35, "qwen35");
}

fn str_array(v: &[String]) -> Value {
    Value::Array(
        ValueType::String,
        v.iter().map(|s| Value::String(s.clone())).collect(),
    )
}

/// The keys llama.cpp's converter writes, as `scoria synth` will.
fn gguf_metadata(p: &VocabParts) -> HashMap<String, Value> {
    let mut m = HashMap::new();
    m.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
    m.insert("tokenizer.ggml.pre".into(), Value::String(p.pre.into()));
    m.insert("tokenizer.ggml.tokens".into(), str_array(&p.tokens));
    m.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(
            ValueType::I32,
            p.token_types.iter().map(|&t| Value::I32(t)).collect(),
        ),
    );
    m.insert("tokenizer.ggml.merges".into(), str_array(&p.merges));
    for (k, v) in [
        ("tokenizer.ggml.eos_token_id", p.eos_id),
        ("tokenizer.ggml.bos_token_id", p.bos_id),
        ("tokenizer.ggml.padding_token_id", p.pad_id),
    ] {
        if let Some(v) = v {
            m.insert(k.into(), Value::U32(v));
        }
    }
    m.insert(
        "tokenizer.ggml.add_bos_token".into(),
        Value::Bool(p.add_bos),
    );
    m
}

#[test]
fn qwen35_from_gguf_metadata() {
    let parts = vocab::load(QwenVocab::Qwen35).expect("load");
    let meta = gguf_metadata(parts);
    let tk = Tokenizer::from_metadata(|k| meta.get(k)).expect("tokenizer");
    assert_eq!(tk.pre_tokenizer(), PreTokenizer::Qwen35);
    assert_eq!(tk.vocab_size(), 248_320);
    check_cases(&tk, &fixture()["qwen35"]);
    assert_eq!(tk.token_id("<|im_start|>"), Some(248_045));
    assert_eq!(tk.token_id("</think>"), Some(248_069));
    assert_eq!(
        tk.token_id("Ġthe"),
        tk.encode(" the", false).expect("enc").first().copied()
    );

    let mut bad = meta.clone();
    bad.insert(
        "tokenizer.ggml.pre".into(),
        Value::String("llama-bpe".into()),
    );
    let err = Tokenizer::from_metadata(|k| bad.get(k)).expect_err("unknown pre");
    assert!(err.to_string().contains("llama-bpe"), "{err}");
    bad.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
    let err = Tokenizer::from_metadata(|k| bad.get(k)).expect_err("spm");
    assert!(err.to_string().contains("\"llama\""), "{err}");
}

#[test]
fn stream_decoder_matches_decode() {
    let tk = Tokenizer::qwen(QwenVocab::Qwen2).expect("tk");
    assert!(std::sync::Arc::ptr_eq(
        &tk,
        &Tokenizer::qwen(QwenVocab::Qwen2).expect("tk")
    ));
    let text = "Emoji 🦙🚀😶\u{200d}🌫️, 中文，日本語 <think>x</think> — done<|im_end|>";
    let ids = tk.encode(text, true).expect("encode");
    for skip in [false, true] {
        let mut sd = tk.stream_decoder(skip);
        let mut s = String::new();
        for &id in &ids {
            let piece = sd.push(id);
            assert!(!piece.contains('\u{fffd}'));
            s.push_str(&piece);
        }
        s.push_str(&sd.finish());
        assert_eq!(s, tk.decode(&ids, skip));
    }
    assert!(tk.decode(&ids, true).ends_with("done"));
}
