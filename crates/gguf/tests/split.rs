//! Split models: written by `into_shards`, opened through any shard's name.

mod common;

use std::path::{Path, PathBuf};

use common::{pattern, scratch_dir, some_tensors};
use gguf::{shard_file_name, GgufFile, GgufWriter, Value};

/// Writes `some_tensors()` as shards of `sizes` tensors each; returns paths and data.
fn write_split(dir: &Path, sizes: &[usize], alignment: u64) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    let mut w = GgufWriter::new();
    w.set_alignment(alignment).expect("alignment");
    w.add_kv("general.architecture", Value::String("qwen3moe".into()))
        .expect("kv");
    w.add_kv("qwen3moe.block_count", Value::U32(1)).expect("kv");
    for (name, dims, ty) in some_tensors() {
        w.add_tensor(name, &dims, ty).expect("tensor");
    }
    let layout = w.layout().expect("layout");
    let data: Vec<Vec<u8>> = layout
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| pattern(t.size as usize, 100 + i as u8))
        .collect();
    let shards = w.into_shards(sizes).expect("shards");
    assert_eq!(shards.len(), sizes.len());
    let n = shards.len() as u32;
    let mut paths = Vec::new();
    let mut next = 0;
    for (k, mut shard) in shards.into_iter().enumerate() {
        let path = dir.join(shard_file_name("model", k as u32 + 1, n));
        let count = shard.tensor_count();
        let slices: Vec<&[u8]> = data[next..next + count].iter().map(Vec::as_slice).collect();
        next += count;
        shard.write_to_path(&path, &slices).expect("write shard");
        paths.push(path);
    }
    (paths, data)
}

fn check_model(f: &GgufFile, paths: &[PathBuf], data: &[Vec<u8>], sizes: &[usize], a: u64) {
    assert_eq!(f.paths(), paths);
    assert_eq!(f.architecture(), Some("qwen3moe"));
    assert_eq!(f.get_u64("split.count").expect("count"), sizes.len() as u64);
    assert_eq!(f.get_u64("split.no").expect("no"), 0);
    let total = some_tensors().len() as u64;
    assert_eq!(f.get_u64("split.tensors.count").expect("tensors"), total);
    assert!(matches!(f.get("split.no"), Some(Value::U16(0))));
    assert!(matches!(f.get("split.tensors.count"), Some(Value::I32(_))));
    assert_eq!(f.tensors().len() as u64, total);
    let mut shard_of = Vec::new();
    for (k, &m) in sizes.iter().enumerate() {
        shard_of.extend(std::iter::repeat_n(k, m));
    }
    for (i, ((name, dims, _), t)) in some_tensors().iter().zip(f.tensors()).enumerate() {
        assert_eq!(&t.name, name);
        assert_eq!(&t.dims, dims);
        assert_eq!(t.shard, shard_of[i], "{name}");
        assert_eq!(t.offset % a, 0);
        assert!(t.offset >= f.shards()[t.shard].data_start);
        assert_eq!(f.tensor_data(t), data[i].as_slice(), "{name}");
    }
    let file_total: u64 = paths
        .iter()
        .map(|p| std::fs::metadata(p).expect("stat").len())
        .sum();
    assert_eq!(f.file_size(), file_total);
    assert_eq!(f.data_bytes().len(), sizes.len());
    for (s, &m) in f.shards().iter().zip(sizes) {
        assert_eq!(s.n_tensors, m);
        assert_eq!(s.alignment, a);
    }
}

#[test]
fn three_shards_open_from_shard_1_2_and_3() {
    for a in [32, 64] {
        let dir = scratch_dir("split3");
        let sizes = [4, 2, 3];
        let (paths, data) = write_split(&dir, &sizes, a);
        for p in &paths {
            let f = GgufFile::open(p).expect("open");
            check_model(&f, &paths, &data, &sizes, a);
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn shard_1_may_hold_only_metadata() {
    let dir = scratch_dir("split-meta-only");
    let sizes = [0, 5, 4];
    let (paths, data) = write_split(&dir, &sizes, 32);
    let f = GgufFile::open(&paths[1]).expect("open");
    check_model(&f, &paths, &data, &sizes, 32);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn split_by_size_keeps_shards_under_the_limit() {
    let mut w = GgufWriter::new();
    for (name, dims, ty) in some_tensors() {
        w.add_tensor(name, &dims, ty).expect("tensor");
    }
    let shards = w.into_shards_by_size(400).expect("split");
    assert!(shards.len() > 1);
    let mut total = 0;
    for s in &shards {
        let l = s.layout().expect("layout");
        let bytes: u64 = l.tensors.iter().map(|t| t.size).sum();
        assert!(bytes <= 400 || l.tensors.len() == 1);
        total += l.tensors.len();
    }
    assert_eq!(total, some_tensors().len());
}

#[test]
fn a_missing_shard_is_named() {
    let dir = scratch_dir("split-missing");
    let (paths, _) = write_split(&dir, &[3, 3, 3], 32);
    std::fs::remove_file(&paths[2]).expect("rm");
    for p in &paths[..2] {
        let e = GgufFile::open(p).expect_err("missing shard").to_string();
        assert!(e.contains("model-00003-of-00003.gguf"), "{e}");
        assert!(e.contains("missing"), "{e}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn inconsistent_split_keys_are_refused() {
    let dir = scratch_dir("split-bad");
    let (paths, _) = write_split(&dir, &[3, 3, 3], 32);

    // Shards renamed as if there were only two: split.count disagrees with the name.
    let two: Vec<PathBuf> = (1..=2)
        .map(|k| dir.join(shard_file_name("two", k, 2)))
        .collect();
    std::fs::copy(&paths[0], &two[0]).expect("cp");
    std::fs::copy(&paths[1], &two[1]).expect("cp");
    let e = GgufFile::open(&two[0]).expect_err("count").to_string();
    assert!(
        e.contains("split.count is 3") && e.contains("byte offset"),
        "{e}"
    );

    // Shards swapped: split.no disagrees with the position.
    let swapped: Vec<PathBuf> = (1..=3)
        .map(|k| dir.join(shard_file_name("swapped", k, 3)))
        .collect();
    std::fs::copy(&paths[0], &swapped[0]).expect("cp");
    std::fs::copy(&paths[2], &swapped[1]).expect("cp");
    std::fs::copy(&paths[1], &swapped[2]).expect("cp");
    let e = GgufFile::open(&swapped[0]).expect_err("no").to_string();
    assert!(e.contains("split.no is 2"), "{e}");

    // A shard under a plain name: the other shards cannot be found.
    let plain = dir.join("renamed.gguf");
    std::fs::copy(&paths[0], &plain).expect("cp");
    let e = GgufFile::open(&plain).expect_err("plain").to_string();
    assert!(e.contains("3-shard split model"), "{e}");

    // split.tensors.count that does not match what the shards hold.
    let forged = dir.join(shard_file_name("forged", 1, 1));
    let mut w = GgufWriter::new();
    w.add_kv("split.no", Value::U16(0)).expect("kv");
    w.add_kv("split.count", Value::U16(1)).expect("kv");
    w.add_kv("split.tensors.count", Value::I32(5)).expect("kv");
    w.add_tensor("t", &[1], gguf::GgmlType::F32).expect("t");
    w.write_to_path(&forged, &[&[0; 4]]).expect("write");
    let e = GgufFile::open(&forged).expect_err("tensors").to_string();
    assert!(
        e.contains("split.tensors.count is 5") && e.contains("hold 1"),
        "{e}"
    );

    // Impossible numbering in the name.
    let e = GgufFile::open(&dir.join("m-00004-of-00003.gguf"))
        .expect_err("numbering")
        .to_string();
    assert!(e.contains("shard 4 of 3"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn duplicate_tensor_across_shards_is_refused() {
    let dir = scratch_dir("split-dup");
    let n = 2;
    for k in 0..n {
        let mut w = GgufWriter::new();
        w.add_kv("split.no", Value::U16(k as u16)).expect("kv");
        w.add_kv("split.count", Value::U16(n as u16)).expect("kv");
        w.add_tensor("same", &[1], gguf::GgmlType::F32).expect("t");
        let p = dir.join(shard_file_name("dup", k + 1, n));
        w.write_to_path(&p, &[&[0; 4]]).expect("write");
    }
    let e = GgufFile::open(&dir.join(shard_file_name("dup", 1, n)))
        .expect_err("dup")
        .to_string();
    assert!(e.contains("`same` also appears in shard 1"), "{e}");
    assert!(e.contains("dup-00002-of-00002.gguf"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn into_shards_checks_its_arguments() {
    let mk = || {
        let mut w = GgufWriter::new();
        w.add_tensor("a", &[1], gguf::GgmlType::F32).expect("a");
        w.add_tensor("b", &[1], gguf::GgmlType::F32).expect("b");
        w
    };
    assert!(mk().into_shards(&[1]).is_err());
    assert!(mk().into_shards(&[]).is_err());
    assert!(mk().into_shards(&[1, 2]).is_err());
    assert_eq!(mk().into_shards(&[2]).expect("one").len(), 1);
    let mut w = mk();
    w.add_kv("split.count", Value::U16(2)).expect("kv");
    assert!(
        w.into_shards(&[1, 1]).is_err(),
        "split keys are the writer's"
    );
}
