//! Tokenizer and chat template read back from a real GGUF file written with the keys
//! llama.cpp's converter uses.

use gguf::{GgufFile, GgufWriter, Value, ValueType};
use model::chat::{ChatInputs, ChatTemplate, QWEN3_TEMPLATE};
use model::tokenizer::Tokenizer;
use model::vocab::{self, QwenVocab};

fn strings(v: &[String]) -> Value {
    Value::Array(
        ValueType::String,
        v.iter().map(|s| Value::String(s.clone())).collect(),
    )
}

#[test]
fn qwen2_vocab_and_template_from_gguf_file() {
    let parts = vocab::load(QwenVocab::Qwen2).expect("vocab");
    let mut w = GgufWriter::new();
    let kvs = [
        ("general.architecture", Value::String("qwen3moe".into())),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(parts.pre.into())),
        ("tokenizer.ggml.tokens", strings(&parts.tokens)),
        (
            "tokenizer.ggml.token_type",
            Value::Array(
                ValueType::I32,
                parts.token_types.iter().map(|&t| Value::I32(t)).collect(),
            ),
        ),
        ("tokenizer.ggml.merges", strings(&parts.merges)),
        ("tokenizer.ggml.eos_token_id", Value::U32(151_645)),
        ("tokenizer.ggml.padding_token_id", Value::U32(151_643)),
        ("tokenizer.ggml.bos_token_id", Value::U32(151_643)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        (
            "tokenizer.chat_template",
            Value::String(QWEN3_TEMPLATE.into()),
        ),
    ];
    for (k, v) in kvs {
        w.add_kv(k, v).expect("add_kv");
    }
    let path = std::env::temp_dir().join(format!("scoria-tok-{}.gguf", std::process::id()));
    w.write_to_path(&path, &[]).expect("write");
    let file = GgufFile::open(&path).expect("open");

    let tk = Tokenizer::from_gguf(&file).expect("tokenizer");
    let tmpl = ChatTemplate::from_gguf(&file)
        .expect("template")
        .expect("present");
    let prompt = tmpl
        .render(&ChatInputs {
            messages: serde_json::json!([{"role": "user", "content": "Hello <|im_end|> world"}]),
            add_generation_prompt: true,
            enable_thinking: Some(false),
            ..Default::default()
        })
        .expect("render");
    let ids = tk.encode(&prompt, true).expect("encode");
    // <|im_start|> user \n Hello ... <|im_end|> \n <|im_start|> assistant \n <think> \n\n </think> \n\n
    assert_eq!(ids[0], 151_644);
    assert_eq!(ids.iter().filter(|&&i| i == 151_645).count(), 2);
    assert!(ids.contains(&151_667) && ids.contains(&151_668));
    assert_eq!(tk.decode(&ids, false), prompt);
    assert_eq!(tk.eog_ids(), &[151_645, 151_643]);
    assert_eq!(tk.vocab_size(), 151_936);
    drop(file);
    let _ = std::fs::remove_file(&path);
}
