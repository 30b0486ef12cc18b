//! A streaming GGUF v3 writer.
//!
//! `scoria synth` writes files of tens of gigabytes, so tensor data never has to be in
//! memory at once: the caller declares every kv and tensor (name, dims, type) first, which
//! fixes the layout, writes the header, then streams each tensor's bytes in order (whole
//! or in chunks). The writer checks each tensor's byte count and inserts the alignment
//! padding, so the result always matches the layout it reported.
//!
//! Files are laid out as llama.cpp lays them out: tensors back to back in declaration
//! order, each padded to the alignment (the last one too).

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::split::{KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT};
use crate::{
    align_up, tensor_size, Error, GgmlType, Value, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION,
    KEY_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS,
};

/// ggml keeps tensor names in a 64-byte buffer with a NUL terminator; llama.cpp refuses
/// longer names, so the writer does too.
const MAX_TENSOR_NAME_BYTES: usize = 63;

/// Writer errors: a declaration the format cannot represent, misuse of the streaming
/// protocol, or an I/O failure of the sink.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Invalid(String),
}

impl WriteError {
    /// The same error as a reader-style [`Error`] naming the file being written.
    pub fn with_path(self, path: &Path) -> Error {
        match self {
            WriteError::Io(cause) => Error::Io {
                path: path.to_path_buf(),
                cause,
            },
            WriteError::Invalid(msg) => Error::Invalid {
                path: path.to_path_buf(),
                msg,
            },
        }
    }
}

fn invalid<T>(msg: impl Into<String>) -> Result<T, WriteError> {
    Err(WriteError::Invalid(msg.into()))
}

/// Where each declared tensor lands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Byte offset relative to the data section start (what the tensor info stores).
    pub offset: u64,
    /// Bytes of data, without padding.
    pub size: u64,
}

/// The byte layout of the file a [`GgufWriter`] will produce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub alignment: u64,
    /// Bytes of header, metadata and tensor infos, before padding.
    pub header_bytes: u64,
    /// Absolute offset of the data section (`header_bytes` aligned up).
    pub data_start: u64,
    pub tensors: Vec<TensorLayout>,
    /// Total length of the finished file.
    pub file_size: u64,
}

impl Layout {
    /// Absolute file offset of tensor `i`.
    pub fn absolute_offset(&self, i: usize) -> Option<u64> {
        self.tensors.get(i).map(|t| self.data_start + t.offset)
    }
}

#[derive(Debug, Clone)]
struct TensorDecl {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Accepting kvs and tensors.
    Declaring,
    /// Header written; `next` is the tensor being written, `done` its bytes so far.
    Data {
        next: usize,
        done: u64,
    },
    Finished,
}

/// Builds one GGUF file: declare, inspect the [`Layout`], then stream.
///
/// ```no_run
/// # use gguf::{GgufWriter, GgmlType, Value};
/// # fn main() -> Result<(), gguf::WriteError> {
/// let mut w = GgufWriter::new();
/// w.add_kv("general.architecture", Value::String("qwen3moe".into()))?;
/// w.add_tensor("token_embd.weight", &[64, 10], GgmlType::F32)?;
/// let mut out = std::fs::File::create("m.gguf")?;
/// w.write_header(&mut out)?;
/// w.write_tensor(&mut out, &[0u8; 64 * 10 * 4])?;
/// w.finish(&mut out)?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct GgufWriter {
    alignment: u64,
    kvs: Vec<(String, Value)>,
    tensors: Vec<TensorDecl>,
    names: HashSet<String>,
    state: State,
    /// Bytes written to the sink so far.
    written: u64,
    /// Absolute data offsets of the tensors; fixed once the header is written.
    layout: Option<Layout>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

/// Checks that `v` can be written and read back: array elements must all have the
/// declared type, and arrays may not nest deeper than the reader accepts.
fn check_value(v: &Value, what: &str, depth: u32) -> Result<(), WriteError> {
    if let Value::Array(ty, items) = v {
        if depth >= MAX_ARRAY_DEPTH {
            return invalid(format!(
                "{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep"
            ));
        }
        for (i, item) in items.iter().enumerate() {
            if item.value_type() != *ty {
                return invalid(format!(
                    "{what}: element {i} of an array of {ty} is a {}",
                    item.type_name()
                ));
            }
            check_value(item, what, depth + 1)?;
        }
    }
    Ok(())
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The value's payload, without its type id.
fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(b) => out.push(u8::from(*b)),
        Value::String(s) => put_string(out, s),
        Value::Array(ty, items) => {
            out.extend_from_slice(&ty.id().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

fn check_alignment(a: u64) -> Result<(), WriteError> {
    if a == 0 || a % 8 != 0 || a > u64::from(u32::MAX) {
        return invalid(format!(
            "alignment {a} must be a non-zero multiple of 8 that fits a u32"
        ));
    }
    Ok(())
}

impl GgufWriter {
    /// An empty file with the default alignment (32).
    pub fn new() -> GgufWriter {
        GgufWriter {
            alignment: DEFAULT_ALIGNMENT,
            kvs: Vec::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            state: State::Declaring,
            written: 0,
            layout: None,
        }
    }

    fn declaring(&self) -> Result<(), WriteError> {
        if self.state != State::Declaring {
            return invalid("the header has already been written; declarations are closed");
        }
        Ok(())
    }

    /// Sets the data alignment and records it as `general.alignment` (u32).
    pub fn set_alignment(&mut self, alignment: u64) -> Result<(), WriteError> {
        self.declaring()?;
        check_alignment(alignment)?;
        // check_alignment bounds it to u32
        let value = Value::U32(alignment as u32);
        self.alignment = alignment;
        match self.kvs.iter_mut().find(|(k, _)| k == KEY_ALIGNMENT) {
            Some((_, v)) => *v = value,
            None => self.kvs.push((KEY_ALIGNMENT.to_string(), value)),
        }
        Ok(())
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Adds a metadata pair, in the order given. `general.alignment` (u32) also sets the
    /// alignment; a duplicate key is an error.
    pub fn add_kv(&mut self, key: impl Into<String>, value: Value) -> Result<(), WriteError> {
        self.declaring()?;
        let key = key.into();
        if self.kvs.iter().any(|(k, _)| *k == key) {
            return invalid(format!("duplicate metadata key `{key}`"));
        }
        check_value(&value, &format!("metadata `{key}`"), 0)?;
        if key == KEY_ALIGNMENT {
            match value {
                Value::U32(a) => return self.set_alignment(u64::from(a)),
                other => {
                    return invalid(format!(
                        "{KEY_ALIGNMENT} must be a u32, got {}",
                        other.describe_type()
                    ))
                }
            }
        }
        self.kvs.push((key, value));
        Ok(())
    }

    /// The metadata declared so far, in order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.kvs
    }

    /// Declares the next tensor; `dims` in ggml order (contiguous dimension first).
    /// Returns its index, the order in which its data must be written.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<usize, WriteError> {
        self.declaring()?;
        let name = name.into();
        if name.len() > MAX_TENSOR_NAME_BYTES {
            return invalid(format!(
                "tensor name `{name}` is {} bytes; llama.cpp allows at most {MAX_TENSOR_NAME_BYTES}",
                name.len()
            ));
        }
        if self.names.contains(&name) {
            return invalid(format!("duplicate tensor name `{name}`"));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return invalid(format!(
                "tensor `{name}` has {} dimensions, must be 1..={MAX_DIMS}",
                dims.len()
            ));
        }
        let size = tensor_size(dims, ty)
            .or_else(|msg| invalid(format!("tensor `{name}` {dims:?} {ty}: {msg}")))?;
        self.names.insert(name.clone());
        self.tensors.push(TensorDecl {
            name,
            dims: dims.to_vec(),
            ty,
            size,
        });
        Ok(self.tensors.len() - 1)
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Header, metadata and tensor infos as they will be written (unpadded).
    fn encode_header(&self, offsets: &[u64]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(GGUF_MAGIC);
        out.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (key, value) in &self.kvs {
            put_string(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut out, value);
        }
        for (t, off) in self.tensors.iter().zip(offsets) {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
        }
        out
    }

    /// Relative offsets of the tensors and the padded data section length.
    fn data_offsets(&self) -> Result<(Vec<u64>, u64), WriteError> {
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut pos = 0u64;
        for t in &self.tensors {
            offsets.push(pos);
            pos = pos
                .checked_add(t.size)
                .and_then(|end| align_up(end, self.alignment))
                .map_or_else(|| invalid("the data section overflows 64 bits"), Ok)?;
        }
        Ok((offsets, pos))
    }

    /// The layout of the file as currently declared.
    pub fn layout(&self) -> Result<Layout, WriteError> {
        if let Some(layout) = &self.layout {
            return Ok(layout.clone());
        }
        let (offsets, data_len) = self.data_offsets()?;
        let header_bytes = self.encode_header(&offsets).len() as u64;
        self.make_layout(header_bytes, &offsets, data_len)
    }

    fn make_layout(
        &self,
        header_bytes: u64,
        offsets: &[u64],
        data_len: u64,
    ) -> Result<Layout, WriteError> {
        let too_big = || WriteError::Invalid("the file size overflows 64 bits".into());
        let data_start = align_up(header_bytes, self.alignment).ok_or_else(too_big)?;
        Ok(Layout {
            alignment: self.alignment,
            header_bytes,
            data_start,
            tensors: self
                .tensors
                .iter()
                .zip(offsets)
                .map(|(t, &offset)| TensorLayout {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    ty: t.ty,
                    offset,
                    size: t.size,
                })
                .collect(),
            file_size: data_start.checked_add(data_len).ok_or_else(too_big)?,
        })
    }

    fn write_padding(&mut self, w: &mut impl Write) -> Result<(), WriteError> {
        const ZEROS: [u8; 256] = [0; 256];
        let target = align_up(self.written, self.alignment)
            .map_or_else(|| invalid("file offset overflows 64 bits"), Ok)?;
        let mut pad = target - self.written;
        while pad > 0 {
            let n = pad.min(ZEROS.len() as u64) as usize;
            w.write_all(&ZEROS[..n])?;
            pad -= n as u64;
        }
        self.written = target;
        Ok(())
    }

    /// Writes magic, version, counts, metadata and tensor infos, then pads to the data
    /// section. Declarations are closed afterwards. Returns the layout written.
    pub fn write_header(&mut self, w: &mut impl Write) -> Result<Layout, WriteError> {
        self.declaring()?;
        let (offsets, data_len) = self.data_offsets()?;
        let header = self.encode_header(&offsets);
        let layout = self.make_layout(header.len() as u64, &offsets, data_len)?;
        w.write_all(&header)?;
        self.written = header.len() as u64;
        self.write_padding(w)?;
        self.state = State::Data { next: 0, done: 0 };
        self.layout = Some(layout.clone());
        Ok(layout)
    }

    /// Name of the tensor whose bytes are expected next, if any.
    pub fn next_tensor(&self) -> Option<&str> {
        match self.state {
            State::Data { next, .. } => self.tensors.get(next).map(|t| t.name.as_str()),
            _ => None,
        }
    }

    /// Writes the whole data of the next tensor; `bytes` must be exactly its size.
    pub fn write_tensor(&mut self, w: &mut impl Write, bytes: &[u8]) -> Result<(), WriteError> {
        match self.state {
            State::Data { next, done: 0 } => {
                if let Some(t) = self.tensors.get(next) {
                    if bytes.len() as u64 != t.size {
                        return invalid(format!(
                            "tensor `{}` needs {} bytes, got {}",
                            t.name,
                            t.size,
                            bytes.len()
                        ));
                    }
                }
            }
            State::Data { next, done } => {
                let name = self.tensors.get(next).map_or("", |t| t.name.as_str());
                return invalid(format!(
                    "tensor `{name}` is partly written ({done} bytes); continue it with write_tensor_chunk"
                ));
            }
            _ => {}
        }
        self.write_tensor_chunk(w, bytes)
    }

    /// Appends `chunk` to the data of the current tensor. When the tensor's last byte
    /// is written, the padding follows and the next tensor becomes current. A chunk may
    /// not run past the end of the current tensor.
    pub fn write_tensor_chunk(
        &mut self,
        w: &mut impl Write,
        chunk: &[u8],
    ) -> Result<(), WriteError> {
        let (next, done) = match self.state {
            State::Declaring => return invalid("write_header must come before tensor data"),
            State::Finished => return invalid("the file is already finished"),
            State::Data { next, done } => (next, done),
        };
        let Some(t) = self.tensors.get(next) else {
            return invalid(format!(
                "all {} declared tensors are already written",
                self.tensors.len()
            ));
        };
        let (size, name) = (t.size, t.name.clone());
        let len = chunk.len() as u64;
        if len > size - done {
            return invalid(format!(
                "tensor `{name}` has {} bytes left to write, got a chunk of {len}",
                size - done
            ));
        }
        w.write_all(chunk)?;
        self.written += len;
        let done = done + len;
        if done == size {
            self.write_padding(w)?;
            self.state = State::Data {
                next: next + 1,
                done: 0,
            };
        } else {
            self.state = State::Data { next, done };
        }
        Ok(())
    }

    /// Checks that every tensor was written and flushes `w`. Returns the file size.
    pub fn finish(&mut self, w: &mut impl Write) -> Result<u64, WriteError> {
        match self.state {
            State::Declaring => return invalid("write_header was never called"),
            State::Finished => return invalid("the file is already finished"),
            State::Data { next, done } => {
                if let Some(t) = self.tensors.get(next) {
                    return invalid(format!(
                        "tensor `{}` ({} of {} declared) has {done} of {} bytes written",
                        t.name,
                        next + 1,
                        self.tensors.len(),
                        t.size
                    ));
                }
            }
        }
        w.flush()?;
        self.state = State::Finished;
        // Defensive: the padding rules above make these equal by construction.
        if let Some(layout) = &self.layout {
            if layout.file_size != self.written {
                return invalid(format!(
                    "wrote {} bytes but the layout says {}",
                    self.written, layout.file_size
                ));
            }
        }
        Ok(self.written)
    }

    /// Writes the whole file to `path` with in-memory tensor data, one slice per declared
    /// tensor in order. Returns the file size.
    pub fn write_to_path(&mut self, path: &Path, data: &[&[u8]]) -> Result<u64, Error> {
        let invalid = |e: WriteError| e.with_path(path);
        if data.len() != self.tensors.len() {
            return Err(invalid(WriteError::Invalid(format!(
                "{} tensors declared, data given for {}",
                self.tensors.len(),
                data.len()
            ))));
        }
        let file = File::create(path).map_err(|e| invalid(e.into()))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        self.write_header(&mut out).map_err(invalid)?;
        for bytes in data {
            self.write_tensor(&mut out, bytes).map_err(invalid)?;
        }
        self.finish(&mut out).map_err(invalid)
    }

    /// Splits the declared model into shard writers holding `tensors_per_shard[k]`
    /// consecutive tensors each, as gguf-split does: shard 1 keeps all metadata, every
    /// shard gets `split.no` (u16, 0-based), `split.count` (u16) and
    /// `split.tensors.count` (i32, all shards together), and the alignment. Write shard
    /// `k` (0-based) to [`crate::shard_file_name`]`(stem, k + 1, n)`.
    pub fn into_shards(self, tensors_per_shard: &[usize]) -> Result<Vec<GgufWriter>, WriteError> {
        self.declaring()?;
        let n = tensors_per_shard.len();
        let Ok(count) = u16::try_from(n) else {
            return invalid(format!("{n} shards; split.count is a u16"));
        };
        if n == 0 {
            return invalid("a split model needs at least one shard");
        }
        let total: usize = tensors_per_shard.iter().sum();
        if total != self.tensors.len() {
            return invalid(format!(
                "shard sizes add up to {total} tensors, {} are declared",
                self.tensors.len()
            ));
        }
        let Ok(total_i32) = i32::try_from(total) else {
            return invalid(format!("{total} tensors; split.tensors.count is an i32"));
        };
        if let Some((k, _)) = self.kvs.iter().find(|(k, _)| k.starts_with("split.")) {
            return invalid(format!(
                "metadata key `{k}` is set by the split writer; do not declare it"
            ));
        }
        let mut tensors = self.tensors.into_iter();
        let mut shards = Vec::with_capacity(n);
        for (k, &m) in tensors_per_shard.iter().enumerate() {
            let mut shard = GgufWriter::new();
            if k == 0 {
                for (key, value) in &self.kvs {
                    shard.add_kv(key.clone(), value.clone())?;
                }
            } else if self.alignment != DEFAULT_ALIGNMENT {
                shard.set_alignment(self.alignment)?;
            }
            // k < n <= u16::MAX
            shard.add_kv(KEY_SPLIT_NO, Value::U16(k as u16))?;
            shard.add_kv(KEY_SPLIT_COUNT, Value::U16(count))?;
            shard.add_kv(KEY_SPLIT_TENSORS_COUNT, Value::I32(total_i32))?;
            for t in tensors.by_ref().take(m) {
                shard.add_tensor(t.name, &t.dims, t.ty)?;
            }
            shards.push(shard);
        }
        Ok(shards)
    }

    /// Splits greedily so that no shard holds more than `max_shard_bytes` of tensor data
    /// (a tensor larger than that gets a shard of its own). See [`GgufWriter::into_shards`].
    pub fn into_shards_by_size(self, max_shard_bytes: u64) -> Result<Vec<GgufWriter>, WriteError> {
        let mut counts = Vec::new();
        let (mut in_shard, mut bytes) = (0usize, 0u64);
        for t in &self.tensors {
            if in_shard > 0 && bytes.saturating_add(t.size) > max_shard_bytes {
                counts.push(in_shard);
                (in_shard, bytes) = (0, 0);
            }
            in_shard += 1;
            bytes = bytes.saturating_add(t.size);
        }
        if in_shard > 0 || counts.is_empty() {
            counts.push(in_shard);
        }
        self.into_shards(&counts)
    }
}

/// One tensor with its data in memory, for [`write_file`].
#[derive(Debug, Clone, Copy)]
pub struct InMemoryTensor<'a> {
    pub name: &'a str,
    /// ggml order: contiguous dimension first.
    pub dims: &'a [u64],
    pub ty: GgmlType,
    pub data: &'a [u8],
}

/// Writes a complete file from in-memory metadata and tensors (tests, small fixtures).
/// Set the alignment with a `general.alignment` u32 kv. Returns the file size.
pub fn write_file(
    path: &Path,
    kvs: &[(&str, Value)],
    tensors: &[InMemoryTensor<'_>],
) -> Result<u64, Error> {
    let as_error = |e: WriteError| e.with_path(path);
    let mut w = GgufWriter::new();
    for (key, value) in kvs {
        w.add_kv(*key, value.clone()).map_err(as_error)?;
    }
    for t in tensors {
        w.add_tensor(t.name, t.dims, t.ty).map_err(as_error)?;
    }
    let data: Vec<&[u8]> = tensors.iter().map(|t| t.data).collect();
    w.write_to_path(path, &data)
}
