//! Parsing and validation of one GGUF file (one shard) held in memory.
//!
//! The parser works on a byte slice (the memory map) so that every check is a bounds
//! check on that slice: a count or length read from the file is compared with the bytes
//! that remain before anything is allocated from it, and every failure carries the byte
//! offset where the bad field starts.

use std::collections::HashMap;
use std::path::Path;

use crate::{
    align_up, tensor_size, Error, GgmlType, TensorInfo, Value, ValueType, DEFAULT_ALIGNMENT,
    GGUF_MAGIC, KEY_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS,
};

/// Bytes of the fixed header: magic, version, tensor count, kv count.
pub(crate) const HEADER_BYTES: u64 = 24;
/// Smallest possible kv pair: empty key (u64 length), type id, a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest possible tensor info: empty name, n_dims, one dim, type id, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

/// One shard as parsed: everything the file says, validated against its own length.
pub(crate) struct ParsedShard {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, Value)>,
    /// Byte offset of each metadata value, parallel to `metadata`, for later errors.
    pub value_offsets: Vec<u64>,
    /// Tensors with `shard` = 0 and `offset` absolute within this file.
    pub tensors: Vec<TensorInfo>,
    /// Byte offset of each tensor info, parallel to `tensors`, for later errors.
    pub info_offsets: Vec<u64>,
    pub data_start: u64,
}

impl ParsedShard {
    pub fn get(&self, key: &str) -> Option<(&Value, u64)> {
        self.metadata
            .iter()
            .zip(&self.value_offsets)
            .find(|((k, _), _)| k == key)
            .map(|((_, v), off)| (v, *off))
    }
}

/// A position in the file with bounds-checked reads.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn malformed(&self, offset: u64, msg: impl Into<String>) -> Error {
        Error::Malformed {
            path: self.path.to_path_buf(),
            offset,
            msg: msg.into(),
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], Error> {
        if n > self.remaining() {
            return Err(self.malformed(
                self.offset(),
                format!(
                    "unexpected end of file reading {what}: need {n} bytes, {} remain (file is {} bytes)",
                    self.remaining(),
                    self.buf.len()
                ),
            ));
        }
        // n <= remaining, which is a usize
        let n = n as usize;
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], Error> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, Error> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, Error> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String, Error> {
        let start = self.offset();
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(self.malformed(
                start,
                format!(
                    "{what} has length {len}, but only {} bytes remain in the file",
                    self.remaining()
                ),
            ));
        }
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.malformed(
                start + 8 + e.valid_up_to() as u64,
                format!("{what} is not valid UTF-8"),
            )),
        }
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType, Error> {
        let at = self.offset();
        let id = self.u32(what)?;
        ValueType::from_id(id)
            .ok_or_else(|| self.malformed(at, format!("{what}: unknown value type id {id}")))
    }

    fn value(&mut self, ty: ValueType, what: &str, depth: u32) -> Result<Value, Error> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            // Any non-zero byte is true, as ggml reads it.
            ValueType::Bool => Value::Bool(self.array::<1>(what)?[0] != 0),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                let start = self.offset();
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.malformed(
                        start,
                        format!("{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep"),
                    ));
                }
                let elem = self.value_type(what)?;
                let count_at = self.offset();
                let count = self.u64(what)?;
                let min = elem.min_encoded_size();
                if count > self.remaining() / min {
                    return Err(self.malformed(
                        count_at,
                        format!(
                            "{what}: array of {count} {elem} elements needs at least {} bytes, only {} remain",
                            count.saturating_mul(min),
                            self.remaining()
                        ),
                    ));
                }
                // count * min <= remaining <= usize::MAX, so this is a real bound.
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, what, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

/// Parses and validates one GGUF file. `buf` is the whole file.
pub(crate) fn parse(buf: &[u8], path: &Path) -> Result<ParsedShard, Error> {
    let mut c = Cursor { buf, pos: 0, path };
    if (buf.len() as u64) < HEADER_BYTES {
        return Err(c.malformed(
            0,
            format!(
                "file is {} bytes, shorter than the {HEADER_BYTES}-byte GGUF header",
                buf.len()
            ),
        ));
    }
    let magic: [u8; 4] = c.array("magic")?;
    if &magic != GGUF_MAGIC {
        return Err(c.malformed(
            0,
            format!("not a GGUF file: magic is {magic:02x?}, expected \"GGUF\""),
        ));
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(c.malformed(
                4,
                "GGUF version 1 (32-bit counts) is not supported; re-convert the model",
            ))
        }
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err(c.malformed(4, "big-endian GGUF files are not supported"))
        }
        v => return Err(c.malformed(4, format!("unsupported GGUF version {v} (supported: 2, 3)"))),
    }
    let tensor_count = c.u64("tensor count")?;
    let kv_count = c.u64("metadata kv count")?;
    let body = c.remaining();
    if kv_count > body / MIN_KV_BYTES {
        return Err(c.malformed(
            16,
            format!(
                "metadata kv count {kv_count} needs at least {} bytes, the file has {body} after the header",
                kv_count.saturating_mul(MIN_KV_BYTES)
            ),
        ));
    }
    let needed = kv_count * MIN_KV_BYTES; // cannot overflow: <= body
    if tensor_count > (body - needed) / MIN_TENSOR_INFO_BYTES {
        return Err(c.malformed(
            8,
            format!(
                "tensor count {tensor_count} needs at least {} bytes of tensor infos, the file has {body} after the header",
                tensor_count.saturating_mul(MIN_TENSOR_INFO_BYTES)
            ),
        ));
    }

    // Both counts are now bounded by the file length, so these reservations are too.
    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(kv_count as usize);
    let mut value_offsets = Vec::with_capacity(kv_count as usize);
    let mut seen_keys: HashMap<String, u64> = HashMap::with_capacity(kv_count as usize);
    for i in 0..kv_count {
        let key_at = c.offset();
        let key = c.string(&format!("metadata key #{i}"))?;
        if let Some(first) = seen_keys.get(&key) {
            return Err(c.malformed(
                key_at,
                format!("duplicate metadata key `{key}` (first at byte offset {first})"),
            ));
        }
        let what = format!("metadata `{key}`");
        let ty = c.value_type(&what)?;
        let value_at = c.offset();
        let value = c.value(ty, &what, 0)?;
        seen_keys.insert(key.clone(), key_at);
        metadata.push((key, value));
        value_offsets.push(value_at);
    }

    let alignment = match metadata.iter().position(|(k, _)| k == KEY_ALIGNMENT) {
        None => DEFAULT_ALIGNMENT,
        Some(idx) => {
            let at = value_offsets[idx];
            match &metadata[idx].1 {
                Value::U32(a) if *a != 0 && a % 8 == 0 => u64::from(*a),
                Value::U32(a) => {
                    return Err(c.malformed(
                        at,
                        format!("{KEY_ALIGNMENT} is {a}; it must be a non-zero multiple of 8"),
                    ))
                }
                v => {
                    return Err(c.malformed(
                        at,
                        format!("{KEY_ALIGNMENT} must be a u32, found {}", v.describe_type()),
                    ))
                }
            }
        }
    };

    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(tensor_count as usize);
    let mut info_offsets = Vec::with_capacity(tensor_count as usize);
    let mut seen_names: HashMap<String, u64> = HashMap::with_capacity(tensor_count as usize);
    for i in 0..tensor_count {
        let info_at = c.offset();
        let name = c.string(&format!("tensor name #{i}"))?;
        if let Some(first) = seen_names.get(&name) {
            return Err(c.malformed(
                info_at,
                format!("duplicate tensor name `{name}` (first at byte offset {first})"),
            ));
        }
        let what = format!("tensor `{name}`");
        let n_dims_at = c.offset();
        let n_dims = c.u32(&what)?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(c.malformed(
                n_dims_at,
                format!("{what}: n_dims is {n_dims}, must be 1..={MAX_DIMS}"),
            ));
        }
        let dims_at = c.offset();
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let type_at = c.offset();
        let type_id = c.u32(&what)?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| {
            c.malformed(type_at, format!("{what}: unknown ggml type id {type_id}"))
        })?;
        let size = tensor_size(&dims, ty)
            .map_err(|msg| c.malformed(dims_at, format!("{what} {dims:?} {ty}: {msg}")))?;
        let offset_at = c.offset();
        let rel_offset = c.u64(&what)?;
        if rel_offset % alignment != 0 {
            return Err(c.malformed(
                offset_at,
                format!(
                    "{what}: data offset {rel_offset} is not a multiple of the alignment {alignment}"
                ),
            ));
        }
        seen_names.insert(name.clone(), info_at);
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            shard: 0,
            offset: rel_offset,
            size,
        });
        info_offsets.push(offset_at);
    }

    let infos_end = c.offset();
    let file_len = buf.len() as u64;
    let data_start = align_up(infos_end, alignment)
        .ok_or_else(|| c.malformed(infos_end, "data section start overflows a 64-bit offset"))?;

    // Make offsets absolute and check that each tensor's bytes are in the file.
    for (t, &at) in tensors.iter_mut().zip(&info_offsets) {
        let abs = data_start.checked_add(t.offset);
        let end = abs.and_then(|a| a.checked_add(t.size));
        match (abs, end) {
            (Some(abs), Some(end)) if end <= file_len => t.offset = abs,
            (Some(abs), _) => {
                return Err(c.malformed(
                    abs,
                    format!(
                        "tensor `{}` data ({} bytes at byte offset {abs}) extends past the end of the file ({file_len} bytes); is the file truncated?",
                        t.name, t.size
                    ),
                ))
            }
            (None, _) => {
                return Err(c.malformed(
                    at,
                    format!(
                        "tensor `{}` data offset {} overflows a 64-bit offset",
                        t.name, t.offset
                    ),
                ))
            }
        }
    }

    // Two tensors sharing bytes means a corrupt index; ggml itself lays them out
    // back to back, so any overlap is an error rather than aliasing.
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().filter(|t| t.size > 0).collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.offset + a.size > b.offset {
            return Err(c.malformed(
                b.offset,
                format!(
                    "tensor `{}` data overlaps tensor `{}` (at byte offset {}, {} bytes)",
                    b.name, a.name, a.offset, a.size
                ),
            ));
        }
    }

    Ok(ParsedShard {
        version,
        alignment,
        metadata,
        value_offsets,
        tensors,
        info_offsets,
        data_start,
    })
}
