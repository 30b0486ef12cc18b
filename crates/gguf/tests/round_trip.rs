//! Files written by `GgufWriter` read back identically: metadata, layout and bytes.

mod common;

use common::{every_value, pattern, scratch_dir, some_tensors};
use gguf::{write_file, Error, GgmlType, GgufFile, GgufWriter, InMemoryTensor, Value, ValueType};

fn round_trip(alignment: Option<u64>) {
    let dir = scratch_dir("round-trip");
    let path = dir.join("model.gguf");
    let mut w = GgufWriter::new();
    if let Some(a) = alignment {
        w.set_alignment(a).expect("alignment");
    }
    for (k, v) in every_value() {
        w.add_kv(k, v).expect("kv");
    }
    let decls = some_tensors();
    for (name, dims, ty) in &decls {
        w.add_tensor(name.clone(), dims, *ty).expect("tensor");
    }
    let layout = w.layout().expect("layout");
    let data: Vec<Vec<u8>> = layout
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| pattern(t.size as usize, i as u8))
        .collect();
    let slices: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let written = w.write_to_path(&path, &slices).expect("write");

    let a = alignment.unwrap_or(32);
    assert_eq!(layout.alignment, a);
    assert_eq!(written, layout.file_size);
    assert_eq!(
        std::fs::metadata(&path).expect("stat").len(),
        layout.file_size
    );
    assert_eq!(layout.data_start % a, 0);

    let f = GgufFile::open(&path).expect("open");
    // Metadata: same pairs in the same order (plus general.alignment when set).
    let mut expected = Vec::new();
    if let Some(a) = alignment {
        expected.push(("general.alignment".to_string(), Value::U32(a as u32)));
    }
    expected.extend(every_value());
    assert_eq!(f.metadata(), expected.as_slice());
    assert_eq!(f.alignment(), a);
    assert_eq!(f.architecture(), Some("qwen3moe"));
    assert_eq!(f.paths(), std::slice::from_ref(&path));
    assert_eq!(f.file_size(), layout.file_size);
    assert_eq!(f.shards()[0].data_start, layout.data_start);
    assert_eq!(f.shards()[0].version, 3);
    assert_eq!(f.data_bytes(), vec![layout.file_size - layout.data_start]);

    assert_eq!(f.tensors().len(), decls.len());
    for (i, ((name, dims, ty), t)) in decls.iter().zip(f.tensors()).enumerate() {
        assert_eq!(&t.name, name);
        assert_eq!(&t.dims, dims);
        assert_eq!(t.ty, *ty);
        assert_eq!(t.shard, 0);
        assert_eq!(t.offset, layout.data_start + layout.tensors[i].offset);
        assert_eq!(t.offset % a, 0);
        assert_eq!(t.size, layout.tensors[i].size);
        let expect_size = t.n_elements() / ty.block_size() as u64 * ty.type_size() as u64;
        assert_eq!(t.size, expect_size);
        assert_eq!(f.tensor_data(t), data[i].as_slice());
        assert_eq!(f.tensor(name).map(|x| x.offset), Some(t.offset));
        assert_eq!(f.tensor_bytes(name), Some(data[i].as_slice()));
    }
    assert!(f.tensor("nope").is_none());
    // Mapping the pages ahead of use, in pieces that do not start on a page,
    // leaves every byte as it was.
    let len = f.shard_bytes(0).expect("shard 0").len();
    for at in (0..len).step_by(5000) {
        f.populate(0, at, 5000.min(len - at)).expect("populate");
    }
    for (i, t) in f.tensors().iter().enumerate() {
        assert_eq!(f.tensor_data(t), data[i].as_slice());
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn round_trip_alignment_default_32() {
    round_trip(None);
}

#[test]
fn round_trip_alignment_64() {
    round_trip(Some(64));
}

#[test]
fn round_trip_alignment_32_explicit_and_odd_multiple_of_8() {
    round_trip(Some(32));
    round_trip(Some(24));
}

#[test]
fn chunked_writes_produce_the_same_file() {
    let mut whole = GgufWriter::new();
    let mut chunked = GgufWriter::new();
    for w in [&mut whole, &mut chunked] {
        w.add_kv("general.architecture", Value::String("x".into()))
            .expect("kv");
        w.add_tensor("a", &[256, 3], GgmlType::Q4_K).expect("a");
        w.add_tensor("b", &[3], GgmlType::F32).expect("b");
    }
    let layout = whole.layout().expect("layout");
    let data: Vec<Vec<u8>> = layout
        .tensors
        .iter()
        .map(|t| pattern(t.size as usize, 9))
        .collect();

    let mut out1 = Vec::new();
    whole.write_header(&mut out1).expect("header");
    for d in &data {
        whole.write_tensor(&mut out1, d).expect("tensor");
    }
    let n1 = whole.finish(&mut out1).expect("finish");

    let mut out2 = Vec::new();
    let l2 = chunked.write_header(&mut out2).expect("header");
    assert_eq!(l2, layout);
    assert_eq!(out2.len() as u64, layout.data_start);
    for d in &data {
        for c in d.chunks(7) {
            chunked.write_tensor_chunk(&mut out2, c).expect("chunk");
        }
    }
    assert_eq!(chunked.next_tensor(), None);
    let n2 = chunked.finish(&mut out2).expect("finish");
    assert_eq!(n1, n2);
    assert_eq!(out1, out2);
    assert_eq!(out1.len() as u64, layout.file_size);
}

#[test]
fn zero_tensor_files_open() {
    let dir = scratch_dir("zero-tensors");
    // Metadata only.
    let p1 = dir.join("meta.gguf");
    write_file(
        &p1,
        &[("general.architecture", Value::String("qwen3next".into()))],
        &[],
    )
    .expect("write");
    let f = GgufFile::open(&p1).expect("open");
    assert!(f.tensors().is_empty());
    assert_eq!(f.architecture(), Some("qwen3next"));
    assert_eq!(f.shards()[0].n_tensors, 0);

    // Nothing at all: a 24-byte header padded to 32.
    let p2 = dir.join("empty.gguf");
    let size = write_file(&p2, &[], &[]).expect("write");
    assert_eq!(size, 32);
    let f = GgufFile::open(&p2).expect("open");
    assert!(f.metadata().is_empty() && f.tensors().is_empty());
    assert_eq!(f.architecture(), None);

    // Also without the trailing padding (some writers omit it when there is no data).
    let bytes = std::fs::read(&p2).expect("read");
    let p3 = dir.join("unpadded.gguf");
    std::fs::write(&p3, &bytes[..24]).expect("write");
    assert!(GgufFile::open(&p3).is_ok());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn typed_getters_name_the_key_and_what_was_found() {
    let dir = scratch_dir("getters");
    let path = dir.join("m.gguf");
    write_file(
        &path,
        &[
            ("general.architecture", Value::String("qwen3moe".into())),
            ("qwen3moe.block_count", Value::U32(48)),
            ("qwen3moe.rope.freq_base", Value::F32(1e6)),
            ("qwen3moe.neg", Value::I32(-1)),
            (
                "tokenizer.ggml.tokens",
                Value::Array(ValueType::String, vec![Value::String("a".into())]),
            ),
            ("flag", Value::Bool(true)),
        ],
        &[InMemoryTensor {
            name: "w",
            dims: &[2],
            ty: GgmlType::F32,
            data: &[0; 8],
        }],
    )
    .expect("write");
    let f = GgufFile::open(&path).expect("open");
    let key = f.arch_key("block_count").expect("arch key");
    assert_eq!(key, "qwen3moe.block_count");
    assert_eq!(f.get_u64(&key).expect("u64"), 48);
    assert_eq!(f.get_i64(&key).expect("i64"), 48);
    assert_eq!(f.get_f64(&key).expect("f64"), 48.0);
    assert_eq!(f.get_f64("qwen3moe.rope.freq_base").expect("f64"), 1e6);
    assert_eq!(f.get_str("general.architecture").expect("str"), "qwen3moe");
    assert_eq!(f.get_array("tokenizer.ggml.tokens").expect("arr").len(), 1);
    assert!(f.get_bool("flag").expect("bool"));
    assert_eq!(f.get_i64("qwen3moe.neg").expect("i64"), -1);

    let msg = |e: Error| e.to_string();
    let e = msg(f.get_u64("qwen3moe.expert_count").expect_err("missing"));
    assert!(
        e.contains("qwen3moe.expert_count") && e.contains("missing"),
        "{e}"
    );
    let e = msg(f.get_u64("qwen3moe.neg").expect_err("negative"));
    assert!(
        e.contains("qwen3moe.neg") && e.contains("i32") && e.contains("-1"),
        "{e}"
    );
    let e = msg(f.get_str("qwen3moe.block_count").expect_err("not a string"));
    assert!(
        e.contains("u32 48") && e.contains("expected a string"),
        "{e}"
    );
    let e = msg(f.get_u64("tokenizer.ggml.tokens").expect_err("array"));
    assert!(e.contains("array[string; 1]"), "{e}");
    let e = msg(f.get_array("flag").expect_err("bool"));
    assert!(e.contains("bool true"), "{e}");
    assert!(e.contains("m.gguf"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn writer_refuses_what_it_cannot_write() {
    let mut w = GgufWriter::new();
    assert!(w.set_alignment(0).is_err());
    assert!(w.set_alignment(12).is_err());
    assert!(w.add_kv("general.alignment", Value::U64(64)).is_err());
    w.add_kv("k", Value::U8(1)).expect("kv");
    assert!(w.add_kv("k", Value::U8(2)).is_err(), "duplicate key");
    let mixed = Value::Array(ValueType::U8, vec![Value::U8(1), Value::I8(1)]);
    assert!(w.add_kv("mixed", mixed).is_err());
    let nested_mixed = Value::Array(
        ValueType::Array,
        vec![Value::Array(ValueType::U8, vec![Value::U16(1)])],
    );
    assert!(w.add_kv("nested_mixed", nested_mixed).is_err());
    assert!(
        w.add_tensor("q", &[33], GgmlType::Q8_0).is_err(),
        "partial block"
    );
    assert!(w.add_tensor("q", &[], GgmlType::F32).is_err(), "no dims");
    assert!(w.add_tensor("q", &[1, 1, 1, 1, 1], GgmlType::F32).is_err());
    assert!(w.add_tensor("q", &[u64::MAX, 2], GgmlType::F32).is_err());
    assert!(w.add_tensor("n".repeat(64), &[1], GgmlType::F32).is_err());
    w.add_tensor("a", &[4], GgmlType::F32).expect("a");
    assert!(w.add_tensor("a", &[4], GgmlType::F32).is_err(), "duplicate");
    w.add_tensor("b", &[2], GgmlType::F16).expect("b");

    let mut out = Vec::new();
    assert!(w.write_tensor(&mut out, &[0; 16]).is_err(), "before header");
    assert!(w.finish(&mut out).is_err(), "before header");
    w.write_header(&mut out).expect("header");
    assert!(w.add_kv("late", Value::U8(0)).is_err());
    assert!(w.add_tensor("late", &[1], GgmlType::F32).is_err());
    assert_eq!(w.next_tensor(), Some("a"));
    assert!(w.write_tensor(&mut out, &[0; 15]).is_err(), "short");
    assert!(
        w.write_tensor_chunk(&mut out, &[0; 17]).is_err(),
        "long chunk"
    );
    w.write_tensor_chunk(&mut out, &[0; 8]).expect("chunk");
    assert!(
        w.write_tensor(&mut out, &[0; 8]).is_err(),
        "whole after partial"
    );
    let e = w.finish(&mut out).expect_err("unfinished").to_string();
    assert!(e.contains("`a`") && e.contains("8 of 16"), "{e}");
    w.write_tensor_chunk(&mut out, &[0; 8]).expect("chunk");
    w.write_tensor(&mut out, &[0; 4]).expect("b");
    assert!(w.write_tensor(&mut out, &[]).is_err(), "no tensors left");
    let n = w.finish(&mut out).expect("finish");
    assert_eq!(n, out.len() as u64);
    assert!(w.finish(&mut out).is_err(), "twice");
}

#[test]
fn version_2_files_are_read() {
    let dir = scratch_dir("v2");
    let path = dir.join("v2.gguf");
    write_file(
        &path,
        &[("general.architecture", Value::String("qwen3moe".into()))],
        &[InMemoryTensor {
            name: "w",
            dims: &[4],
            ty: GgmlType::F32,
            data: &[1; 16],
        }],
    )
    .expect("write");
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let f = GgufFile::open(&path).expect("open v2");
    assert_eq!(f.shards()[0].version, 2);
    assert_eq!(f.tensor_bytes("w"), Some(&[1u8; 16][..]));
    let _ = std::fs::remove_dir_all(dir);
}
