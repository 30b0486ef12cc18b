//! Damaged files are refused with an error that names a byte offset, and never panic.

mod common;

use std::path::{Path, PathBuf};

use common::{pattern, scratch_dir};
use gguf::{Error, GgmlType, GgufFile, GgufWriter, Value, ValueType};

/// A small valid file. The last tensor's size is a multiple of the alignment, so the
/// file has no trailing padding and cutting off any byte removes tensor data.
fn base_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    let kvs = [
        ("general.alignment", Value::U32(32)),
        ("general.architecture", Value::String("qwen3moe".into())),
        ("t.x1", Value::U32(7)),
        ("t.x2", Value::U32(8)),
        (
            "tokenizer.ggml.tokens",
            Value::Array(
                ValueType::String,
                vec![
                    Value::String("a".into()),
                    Value::String("bc".into()),
                    Value::String("def".into()),
                ],
            ),
        ),
        (
            "t.nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(
                    ValueType::U8,
                    vec![Value::U8(1), Value::U8(2)],
                )],
            ),
        ),
        (
            "t.marker",
            Value::Array(ValueType::I16, vec![Value::I16(5)]),
        ),
    ];
    for (k, v) in kvs {
        w.add_kv(k, v).expect("kv");
    }
    w.add_tensor("a.weight", &[8], GgmlType::F32).expect("a");
    w.add_tensor("b.weight", &[32, 2], GgmlType::Q8_0)
        .expect("b");
    w.add_tensor("c.weight", &[16], GgmlType::F32).expect("c");
    let layout = w.layout().expect("layout");
    let mut out = Vec::new();
    w.write_header(&mut out).expect("header");
    for (i, t) in layout.tensors.iter().enumerate() {
        w.write_tensor(&mut out, &pattern(t.size as usize, i as u8))
            .expect("data");
    }
    w.finish(&mut out).expect("finish");
    assert_eq!(layout.tensors[2].size % 32, 0);
    out
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{:?} not in file", String::from_utf8_lossy(needle)))
}

/// Offset of the value of metadata key `key` (after its type id).
fn value_at(b: &[u8], key: &str) -> usize {
    find(b, key.as_bytes()) + key.len() + 4
}

/// Offset of the type id field that precedes a key's value.
fn type_at(b: &[u8], key: &str) -> usize {
    find(b, key.as_bytes()) + key.len()
}

/// Offset of a tensor info's n_dims field.
fn n_dims_at(b: &[u8], name: &str) -> usize {
    find(b, name.as_bytes()) + name.len()
}

fn dims_at(b: &[u8], name: &str) -> usize {
    n_dims_at(b, name) + 4
}

fn n_dims(b: &[u8], name: &str) -> usize {
    let at = n_dims_at(b, name);
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes")) as usize
}

fn ggml_type_at(b: &[u8], name: &str) -> usize {
    dims_at(b, name) + 8 * n_dims(b, name)
}

fn offset_at(b: &[u8], name: &str) -> usize {
    ggml_type_at(b, name) + 4
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn open_bytes(path: &Path, bytes: &[u8]) -> Result<GgufFile, Error> {
    std::fs::write(path, bytes).expect("write");
    GgufFile::open(path)
}

/// The error for a damaged file: must be `Malformed` and say which byte.
fn expect_malformed(path: &Path, bytes: &[u8], what: &str) -> String {
    match open_bytes(path, bytes) {
        Ok(_) => panic!("{what}: damaged file opened"),
        Err(e @ Error::Malformed { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("at byte offset"), "{what}: {msg}");
            assert!(msg.contains(&path.display().to_string()), "{what}: {msg}");
            msg
        }
        Err(e) => panic!("{what}: expected a Malformed error, got {e}"),
    }
}

type Patch = Box<dyn Fn(&mut Vec<u8>)>;

#[test]
fn the_base_file_is_valid() {
    let dir = scratch_dir("base");
    let f = open_bytes(&dir.join("base.gguf"), &base_file()).expect("open");
    assert_eq!(f.tensors().len(), 3);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn every_truncation_is_refused_with_an_offset() {
    let dir = scratch_dir("truncate");
    let path = dir.join("t.gguf");
    let full = base_file();
    for len in 0..full.len() {
        expect_malformed(&path, &full[..len], &format!("truncated to {len}"));
    }
    assert!(open_bytes(&path, &full).is_ok());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn damaged_fields_are_refused_with_an_offset() {
    let dir = scratch_dir("fields");
    let path = dir.join("f.gguf");
    let base = base_file();
    let b = &base;
    // (what, patch, text the message must contain)
    let cases: Vec<(&str, Patch, &str)> = vec![
        (
            "bad magic",
            Box::new(|b| b[..4].copy_from_slice(b"GGML")),
            "not a GGUF file",
        ),
        ("version 1", Box::new(|b| put_u32(b, 4, 1)), "version 1"),
        ("version 99", Box::new(|b| put_u32(b, 4, 99)), "version 99"),
        (
            "big-endian",
            Box::new(|b| put_u32(b, 4, 3u32.swap_bytes())),
            "big-endian",
        ),
        (
            "huge tensor count",
            Box::new(|b| put_u64(b, 8, u64::MAX)),
            "tensor count",
        ),
        (
            "large tensor count",
            Box::new(|b| put_u64(b, 8, 1 << 40)),
            "tensor count",
        ),
        (
            "tensor count + 1",
            Box::new(|b| put_u64(b, 8, 4)),
            "byte offset",
        ),
        (
            "huge kv count",
            Box::new(|b| put_u64(b, 16, u64::MAX)),
            "kv count",
        ),
        (
            "kv count - 1",
            Box::new(|b| put_u64(b, 16, 6)),
            "byte offset",
        ),
        (
            "kv count + 1",
            Box::new(|b| put_u64(b, 16, 8)),
            "byte offset",
        ),
        (
            "huge key length",
            Box::new(|b| put_u64(b, 24, u64::MAX / 2)),
            "length",
        ),
        (
            "key not UTF-8",
            Box::new(|b| {
                let at = find(b, b"architecture");
                b[at] = 0xff;
            }),
            "not valid UTF-8",
        ),
        (
            "unknown value type",
            Box::new(|b| {
                let at = type_at(b, "t.x1");
                put_u32(b, at, 13)
            }),
            "unknown value type id 13",
        ),
        (
            "huge string length",
            Box::new(|b| {
                let at = value_at(b, "general.architecture");
                put_u64(b, at, 1 << 50)
            }),
            "length",
        ),
        (
            "huge array count",
            Box::new(|b| {
                let at = value_at(b, "tokenizer.ggml.tokens") + 4;
                put_u64(b, at, 1 << 60)
            }),
            "array of 1152921504606846976 string",
        ),
        (
            "array count + 1",
            Box::new(|b| {
                let at = value_at(b, "t.marker") + 4;
                put_u64(b, at, 1 << 20)
            }),
            "array of",
        ),
        (
            "unknown array element type",
            Box::new(|b| {
                let at = value_at(b, "tokenizer.ggml.tokens");
                put_u32(b, at, 99)
            }),
            "unknown value type id 99",
        ),
        (
            "alignment not a multiple of 8",
            Box::new(|b| {
                let at = value_at(b, "general.alignment");
                put_u32(b, at, 12)
            }),
            "general.alignment is 12",
        ),
        (
            "alignment zero",
            Box::new(|b| {
                let at = value_at(b, "general.alignment");
                put_u32(b, at, 0)
            }),
            "general.alignment is 0",
        ),
        (
            "alignment not a u32",
            Box::new(|b| {
                let at = type_at(b, "general.alignment");
                put_u32(b, at, ValueType::I32 as u32)
            }),
            "must be a u32, found i32",
        ),
        (
            "duplicate key",
            Box::new(|b| {
                let at = find(b, b"t.x2");
                b[at + 3] = b'1';
            }),
            "duplicate metadata key `t.x1`",
        ),
        (
            "n_dims 5",
            Box::new(|b| {
                let at = n_dims_at(b, "a.weight");
                put_u32(b, at, 5)
            }),
            "n_dims is 5",
        ),
        (
            "n_dims 0",
            Box::new(|b| {
                let at = n_dims_at(b, "a.weight");
                put_u32(b, at, 0)
            }),
            "n_dims is 0",
        ),
        (
            "unknown ggml type",
            Box::new(|b| {
                let at = ggml_type_at(b, "a.weight");
                put_u32(b, at, 99)
            }),
            "tensor `a.weight`: unknown ggml type id 99",
        ),
        (
            "removed ggml type 4",
            Box::new(|b| {
                let at = ggml_type_at(b, "b.weight");
                put_u32(b, at, 4)
            }),
            "tensor `b.weight`: unknown ggml type id 4",
        ),
        (
            "row not whole blocks",
            Box::new(|b| {
                let at = dims_at(b, "b.weight");
                put_u64(b, at, 33)
            }),
            "not a whole number of 32-element blocks",
        ),
        (
            "dimension beyond i64",
            Box::new(|b| {
                let at = dims_at(b, "a.weight");
                put_u64(b, at, u64::MAX)
            }),
            "does not fit an i64",
        ),
        (
            "element count overflows",
            Box::new(|b| {
                let at = dims_at(b, "b.weight");
                put_u64(b, at, 1 << 40);
                put_u64(b, at + 8, 1 << 40);
            }),
            "overflows",
        ),
        (
            "misaligned offset",
            Box::new(|b| {
                let at = offset_at(b, "b.weight");
                let v = get_u64(b, at);
                put_u64(b, at, v + 1)
            }),
            "not a multiple of the alignment 32",
        ),
        (
            "tensor past end of file",
            Box::new(|b| {
                let at = offset_at(b, "c.weight");
                put_u64(b, at, 1 << 20)
            }),
            "tensor `c.weight` data (64 bytes at byte offset",
        ),
        (
            "tensor offset overflows",
            Box::new(|b| {
                let at = offset_at(b, "c.weight");
                put_u64(b, at, u64::MAX - 31)
            }),
            "overflows",
        ),
        (
            "tensor bigger than the file",
            Box::new(|b| {
                let at = dims_at(b, "c.weight");
                put_u64(b, at, 1 << 30)
            }),
            "extends past the end of the file",
        ),
        (
            "duplicate tensor name",
            Box::new(|b| {
                let at = find(b, b"b.weight");
                b[at] = b'a';
            }),
            "duplicate tensor name `a.weight`",
        ),
        (
            "overlapping tensors",
            Box::new(|b| {
                let at = offset_at(b, "b.weight");
                put_u64(b, at, 0)
            }),
            "overlaps",
        ),
        (
            "empty file",
            Box::new(|b| b.clear()),
            "shorter than the 24-byte GGUF header",
        ),
    ];
    for (what, patch, expected) in &cases {
        let mut bytes = b.clone();
        patch(&mut bytes);
        assert_ne!(&bytes, b, "{what}: patch changed nothing");
        let msg = expect_malformed(&path, &bytes, what);
        assert!(msg.contains(expected), "{what}: {msg}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn errors_point_at_the_damaged_field() {
    let dir = scratch_dir("offsets");
    let path = dir.join("o.gguf");
    let base = base_file();
    let offset_of = |bytes: &[u8]| match open_bytes(&path, bytes) {
        Err(Error::Malformed { offset, .. }) => offset,
        Err(e) => panic!("unexpected {e}"),
        Ok(_) => panic!("opened"),
    };
    let mut b = base.clone();
    let at = ggml_type_at(&b, "a.weight");
    put_u32(&mut b, at, 99);
    assert_eq!(offset_of(&b), at as u64);

    let mut b = base.clone();
    let at = value_at(&b, "general.alignment");
    put_u32(&mut b, at, 12);
    assert_eq!(offset_of(&b), at as u64);

    let mut b = base.clone();
    put_u64(&mut b, 8, u64::MAX);
    assert_eq!(offset_of(&b), 8);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn deeply_nested_arrays_are_refused() {
    let dir = scratch_dir("nested");
    let path = dir.join("n.gguf");
    let depth = 100_000u64;
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.push(b'k');
    b.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..depth {
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
    }
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    let msg = expect_malformed(&path, &b, "nested");
    assert!(msg.contains("nested more than 16 deep"), "{msg}");

    // The writer refuses what the reader would refuse.
    let mut v = Value::Array(ValueType::U8, vec![]);
    for _ in 0..16 {
        v = Value::Array(ValueType::Array, vec![v]);
    }
    assert!(GgufWriter::new().add_kv("k", v).is_err());
    let _ = std::fs::remove_dir_all(dir);
}

/// Flipping bits anywhere in the index gives a clean result (open or a clean error).
#[test]
fn bit_flips_in_the_index_never_panic() {
    let dir = scratch_dir("flips");
    let path: PathBuf = dir.join("x.gguf");
    let base = base_file();
    let data_start = GgufFile::open({
        std::fs::write(&path, &base).expect("write");
        &path
    })
    .expect("open")
    .shards()[0]
        .data_start as usize;
    for at in 0..data_start {
        for mask in [0x01u8, 0x80] {
            let mut b = base.clone();
            b[at] ^= mask;
            if let Err(e) = open_bytes(&path, &b) {
                let msg = e.to_string();
                assert!(msg.contains("byte offset"), "flip {mask:#x} at {at}: {msg}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}
