//! GGUF v3: a reader over memory-mapped files (including `-0000k-of-0000N` split
//! shards) and a streaming writer for `scoria synth` and tests.
//!
//! Every failure on a malformed file is an [`Error`] naming the file and byte offset;
//! the reader never panics on file contents.

mod types;
pub use types::GgmlType;

use std::path::{Path, PathBuf};

/// A metadata value. Arrays keep their element type so a writer can round-trip them.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type id (0..=12) and the elements.
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// GGUF metadata value type ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl Value {
    /// Any integer value that is >= 0 (bools are not integers).
    pub fn as_u64(&self) -> Option<u64> {
        todo!("gguf helper")
    }
    pub fn as_i64(&self) -> Option<i64> {
        todo!("gguf helper")
    }
    /// Any numeric value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        todo!("gguf helper")
    }
    pub fn as_str(&self) -> Option<&str> {
        todo!("gguf helper")
    }
    pub fn as_bool(&self) -> Option<bool> {
        todo!("gguf helper")
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        todo!("gguf helper")
    }
}

/// One tensor as the file describes it.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: dims[0] is the contiguous dimension (ne0).
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
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
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

/// An opened GGUF model: one file or all shards of a split model, memory-mapped.
pub struct GgufFile {
    _todo: (),
}

impl GgufFile {
    /// Opens `path`; when its name is `NAME-0000k-of-0000N.gguf`, all N shards are opened.
    pub fn open(_path: &Path) -> Result<GgufFile, Error> {
        todo!("gguf helper")
    }
    /// Metadata in file order (of the first shard; `split.*` keys included).
    pub fn metadata(&self) -> &[(String, Value)] {
        todo!("gguf helper")
    }
    pub fn get(&self, _key: &str) -> Option<&Value> {
        todo!("gguf helper")
    }
    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        todo!("gguf helper")
    }
    /// All tensors of all shards, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        todo!("gguf helper")
    }
    pub fn tensor(&self, _name: &str) -> Option<&TensorInfo> {
        todo!("gguf helper")
    }
    /// The tensor's bytes, borrowed from the mapping.
    pub fn tensor_data(&self, _t: &TensorInfo) -> &[u8] {
        todo!("gguf helper")
    }
    pub fn paths(&self) -> &[PathBuf] {
        todo!("gguf helper")
    }
}
