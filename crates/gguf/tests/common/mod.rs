//! Shared test helpers: scratch paths and a small model with every kind of metadata.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use gguf::{GgmlType, Value, ValueType};

/// A fresh, empty directory under cargo's per-target scratch dir.
pub fn scratch_dir(test: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "gguf-{test}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// One value of every type, nested arrays included.
pub fn every_value() -> Vec<(String, Value)> {
    let strings = |xs: &[&str]| {
        Value::Array(
            ValueType::String,
            xs.iter().map(|s| Value::String(s.to_string())).collect(),
        )
    };
    vec![
        (
            "general.architecture".into(),
            Value::String("qwen3moe".into()),
        ),
        ("t.u8".into(), Value::U8(250)),
        ("t.i8".into(), Value::I8(-120)),
        ("t.u16".into(), Value::U16(65000)),
        ("t.i16".into(), Value::I16(-32000)),
        ("t.u32".into(), Value::U32(4_000_000_000)),
        ("t.i32".into(), Value::I32(-2_000_000_000)),
        ("t.f32".into(), Value::F32(-1.5e-6)),
        ("t.bool_t".into(), Value::Bool(true)),
        ("t.bool_f".into(), Value::Bool(false)),
        ("t.string".into(), Value::String("héllo \u{1F600}".into())),
        ("t.empty_string".into(), Value::String(String::new())),
        ("t.u64".into(), Value::U64(u64::MAX)),
        ("t.i64".into(), Value::I64(i64::MIN)),
        ("t.f64".into(), Value::F64(std::f64::consts::PI)),
        ("t.f32_inf".into(), Value::F32(f32::INFINITY)),
        (
            "t.arr_i32".into(),
            Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)]),
        ),
        ("t.arr_empty".into(), Value::Array(ValueType::F64, vec![])),
        (
            "t.arr_str".into(),
            strings(&["a", "", "Ġthe", "<|im_end|>"]),
        ),
        (
            "t.arr_bool".into(),
            Value::Array(ValueType::Bool, vec![Value::Bool(true), Value::Bool(false)]),
        ),
        (
            "t.arr_nested".into(),
            Value::Array(
                ValueType::Array,
                vec![
                    strings(&["x", "y"]),
                    Value::Array(
                        ValueType::U8,
                        vec![Value::U8(1), Value::U8(2), Value::U8(3)],
                    ),
                    Value::Array(ValueType::Array, vec![]),
                    Value::Array(
                        ValueType::Array,
                        vec![Value::Array(ValueType::U64, vec![Value::U64(7)])],
                    ),
                ],
            ),
        ),
        (
            "t.arr_every_scalar".into(),
            Value::Array(
                ValueType::Array,
                vec![
                    Value::Array(ValueType::U8, vec![Value::U8(0)]),
                    Value::Array(ValueType::I8, vec![Value::I8(-1)]),
                    Value::Array(ValueType::U16, vec![Value::U16(2)]),
                    Value::Array(ValueType::I16, vec![Value::I16(-3)]),
                    Value::Array(ValueType::U32, vec![Value::U32(4)]),
                    Value::Array(ValueType::F32, vec![Value::F32(0.25)]),
                    Value::Array(ValueType::I64, vec![Value::I64(-6)]),
                    Value::Array(ValueType::F64, vec![Value::F64(-0.125)]),
                ],
            ),
        ),
    ]
}

/// Deterministic bytes for tensor data.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// (name, dims, type) of a handful of tensors of different types.
pub fn some_tensors() -> Vec<(String, Vec<u64>, GgmlType)> {
    vec![
        ("token_embd.weight".into(), vec![8, 3], GgmlType::F32),
        ("blk.0.attn_q.weight".into(), vec![64, 2], GgmlType::Q8_0),
        (
            "blk.0.ffn_down_exps.weight".into(),
            vec![256, 2, 3],
            GgmlType::Q4_K,
        ),
        ("blk.0.attn_norm.weight".into(), vec![5], GgmlType::F16),
        (
            "blk.0.ffn_gate_exps.weight".into(),
            vec![256, 1, 2, 2],
            GgmlType::Q6_K,
        ),
        ("blk.0.x.weight".into(), vec![32, 3], GgmlType::IQ4_NL),
        ("output.weight".into(), vec![3, 3], GgmlType::BF16),
        ("blk.0.ids".into(), vec![7], GgmlType::I32),
        ("blk.0.mx".into(), vec![32], GgmlType::MXFP4),
    ]
}
