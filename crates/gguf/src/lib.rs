//! GGUF v3: a reader over memory-mapped files (including `-0000k-of-0000N` split
//! shards) and a streaming writer for `scoria synth` and tests.
//!
//! Every failure on a malformed file is an [`Error`] naming the file and byte offset;
//! the reader never panics on file contents.
//!
//! Map of the crate:
//! - `file.rs`: [`GgufFile`], the opened model (all shards), metadata and tensor lookup,
//!   typed getters (`get_u64`, `arch_key`, ...) that turn a missing or mistyped key into
//!   an error naming it;
//! - `reader.rs`: parsing and validation of one file held in memory;
//! - `split.rs`: shard file names and the `split.*` keys;
//! - `writer.rs`: [`GgufWriter`], declare-then-stream writing, and shard splitting;
//! - `value.rs`: [`Value`] and its short display; `types.rs`: the ggml type table.
//!
//! The reader validates the whole index at open, so a [`TensorInfo`] it hands out always
//! describes bytes that are inside the mapped file.

mod file;
mod reader;
mod split;
mod types;
mod value;
mod writer;

pub use file::{GgufFile, ShardInfo};
pub use split::{
    parse_shard_file_name, shard_file_name, ShardName, KEY_SPLIT_COUNT, KEY_SPLIT_NO,
    KEY_SPLIT_TENSORS_COUNT,
};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::{write_file, GgufWriter, InMemoryTensor, Layout, TensorLayout, WriteError};

use std::path::PathBuf;

/// The first four bytes of every GGUF file.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// The version the writer produces (the reader also accepts 2, which has the same layout).
pub const GGUF_VERSION: u32 = 3;
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// At most this many dimensions per tensor (ggml's limit).
pub const MAX_DIMS: usize = 4;
/// Nested arrays deeper than this (an array of arrays is depth 2) are refused by the
/// reader and the writer: no real file nests more than twice, and unbounded recursion on
/// a forged file would overflow the stack.
pub const MAX_ARRAY_DEPTH: u32 = 16;
pub const KEY_ALIGNMENT: &str = "general.alignment";
pub const KEY_ARCHITECTURE: &str = "general.architecture";

/// `offset` rounded up to a multiple of `alignment` (non-zero), or None on overflow.
pub fn align_up(offset: u64, alignment: u64) -> Option<u64> {
    let rem = offset.checked_rem(alignment)?;
    if rem == 0 {
        Some(offset)
    } else {
        offset.checked_add(alignment - rem)
    }
}

/// Bytes of a tensor of `dims` (ggml order) and type `ty`. The contiguous dimension
/// must be a whole number of blocks: ggml's quantized rows never straddle a block.
pub(crate) fn tensor_size(dims: &[u64], ty: GgmlType) -> Result<u64, String> {
    let Some(&ne0) = dims.first() else {
        return Err("a tensor needs at least one dimension".into());
    };
    // ggml stores dims as i64.
    if let Some(d) = dims.iter().find(|&&d| d > i64::MAX as u64) {
        return Err(format!("dimension {d} does not fit an i64"));
    }
    let block = ty.block_size() as u64;
    if ne0 % block != 0 {
        return Err(format!(
            "row of {ne0} elements is not a whole number of {block}-element blocks"
        ));
    }
    let too_big = || "size overflows 64 bits".to_string();
    let n = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(too_big)?;
    (n / block)
        .checked_mul(ty.type_size() as u64)
        .ok_or_else(too_big)
}

/// One tensor as the file describes it.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous dimension (ne0).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Index of the shard file holding the data.
    pub shard: usize,
    /// Absolute byte offset of the data within its shard file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// Reader errors. Every variant names the file, and where it applies the byte offset.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The cause is part of the message (not a `source()`), so a report that
    /// prints the chain does not print it twice.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}: at byte offset {offset}: {msg}")]
    Malformed {
        path: PathBuf,
        offset: u64,
        msg: String,
    },
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
}
