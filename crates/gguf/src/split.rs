//! Split models: `NAME-0000k-of-0000N.gguf` shards as llama.cpp's gguf-split writes them.
//!
//! Each shard is a complete GGUF file (header, metadata, tensor infos, data). The model's
//! metadata lives in shard 1; every shard carries `split.no` (u16, 0-based), `split.count`
//! (u16) and `split.tensors.count` (i32, the tensor count of the whole model). The reader
//! finds the other shards by file name, as llama.cpp does, and then checks those keys so
//! that a mixed-up or incomplete set of shards is refused instead of silently loading a
//! subset of the tensors.

use std::path::{Path, PathBuf};

/// 0-based index of this shard (u16).
pub const KEY_SPLIT_NO: &str = "split.no";
/// Number of shards (u16).
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// Number of tensors in the whole model, all shards together (i32).
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// The parts of a shard file name `{stem}-{index:05}-of-{count:05}.gguf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardName {
    pub stem: String,
    /// 1-based, as in the file name.
    pub index: u32,
    pub count: u32,
}

/// `{stem}-{index:05}-of-{count:05}.gguf`; `index` is 1-based.
pub fn shard_file_name(stem: &str, index: u32, count: u32) -> String {
    format!("{stem}-{index:05}-of-{count:05}.gguf")
}

/// Splits a file name of the form `{stem}-NNNNN-of-MMMMM.gguf` (exactly five digits per
/// field, non-empty stem). Returns None for any other name; the numbers are not
/// range-checked here.
pub fn parse_shard_file_name(file_name: &str) -> Option<ShardName> {
    let base = file_name.strip_suffix(".gguf")?;
    const TAIL: usize = "-00001-of-00003".len();
    let bytes = base.as_bytes();
    if bytes.len() <= TAIL {
        return None;
    }
    let tail = &bytes[bytes.len() - TAIL..];
    let digits = |b: &[u8]| b.iter().all(u8::is_ascii_digit);
    if tail[0] != b'-' || !digits(&tail[1..6]) || &tail[6..10] != b"-of-" || !digits(&tail[10..]) {
        return None;
    }
    // The tail is ASCII, so the stem ends on a char boundary.
    let stem = base.get(..base.len() - TAIL)?;
    let index = std::str::from_utf8(&tail[1..6]).ok()?.parse().ok()?;
    let count = std::str::from_utf8(&tail[10..]).ok()?.parse().ok()?;
    Some(ShardName {
        stem: stem.to_string(),
        index,
        count,
    })
}

/// The paths of all shards of the model `path` belongs to, or None when its name is
/// not a shard name. Errors on impossible numbering (`-00004-of-00003`).
pub(crate) fn shard_paths(path: &Path) -> Result<Option<Vec<PathBuf>>, crate::Error> {
    let Some(name) = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_shard_file_name)
    else {
        return Ok(None);
    };
    if name.count == 0 || name.index == 0 || name.index > name.count {
        return Err(crate::Error::Invalid {
            path: path.to_path_buf(),
            msg: format!(
                "shard file name says shard {} of {}, which is impossible",
                name.index, name.count
            ),
        });
    }
    let dir = path.parent().unwrap_or_else(|| Path::new(""));
    Ok(Some(
        (1..=name.count)
            .map(|k| dir.join(shard_file_name(&name.stem, k, name.count)))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let n = shard_file_name("Qwen3-30B-A3B-Q4_K_M", 2, 3);
        assert_eq!(n, "Qwen3-30B-A3B-Q4_K_M-00002-of-00003.gguf");
        assert_eq!(
            parse_shard_file_name(&n),
            Some(ShardName {
                stem: "Qwen3-30B-A3B-Q4_K_M".into(),
                index: 2,
                count: 3
            })
        );
    }

    #[test]
    fn other_names_are_not_shards() {
        for n in [
            "model.gguf",
            "-00001-of-00002.gguf",
            "m-0001-of-00002.gguf",
            "m-00001-of-0002.gguf",
            "m-00001-of-00002.bin",
            "m-0000a-of-00002.gguf",
            "m_00001-of-00002.gguf",
            "ü-00001-of-00002.gguf.x",
        ] {
            assert_eq!(parse_shard_file_name(n), None, "{n}");
        }
        assert!(parse_shard_file_name("ü-00001-of-00002.gguf").is_some());
    }

    #[test]
    fn impossible_numbering_is_an_error() {
        assert!(shard_paths(Path::new("/x/m-00004-of-00003.gguf")).is_err());
        assert!(shard_paths(Path::new("/x/m-00000-of-00003.gguf")).is_err());
        let paths = shard_paths(Path::new("/x/m-00002-of-00003.gguf"))
            .ok()
            .flatten()
            .unwrap_or_default();
        assert_eq!(paths.len(), 3);
        assert_eq!(paths[0], Path::new("/x/m-00001-of-00003.gguf"));
    }
}
