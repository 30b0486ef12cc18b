//! [`GgufFile`]: an opened model, one file or all shards of a split model, memory-mapped.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::reader::{parse, ParsedShard};
use crate::split::{shard_paths, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT};
use crate::{Error, TensorInfo, Value, KEY_ARCHITECTURE};

/// What one shard file holds, for `inspect` and for the expert store's direct reads.
#[derive(Debug, Clone)]
pub struct ShardInfo {
    pub path: PathBuf,
    /// GGUF version of this file (2 or 3).
    pub version: u32,
    /// `general.alignment` of this file (each shard has its own).
    pub alignment: u64,
    /// Absolute byte offset where the data section starts.
    pub data_start: u64,
    /// Length of the file in bytes.
    pub file_size: u64,
    pub n_tensors: usize,
    /// Sum of the sizes of this shard's tensors (without alignment padding).
    pub tensor_bytes: u64,
}

/// An opened GGUF model: one file or all shards of a split model, memory-mapped.
///
/// Opening validates the whole index (header, metadata, tensor infos, that every
/// tensor's bytes lie inside its file), so later accesses cannot fail on file contents.
pub struct GgufFile {
    /// One map per shard; None for a zero-length file, which cannot be mapped (and
    /// never parses, so it never reaches a `GgufFile`).
    maps: Vec<Option<Mmap>>,
    shards: Vec<ShardInfo>,
    paths: Vec<PathBuf>,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    /// Short on purpose: the metadata of a real model holds a 150k-entry vocabulary.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("paths", &self.paths)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("file_size", &self.file_size())
            .finish()
    }
}

// The engine shares one opened model between its threads.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<GgufFile>();
};

fn map_file(path: &Path) -> Result<Option<Mmap>, Error> {
    let io = |cause| Error::Io {
        path: path.to_path_buf(),
        cause,
    };
    let file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    // Mapping a directory fails with "No such device", which tells nobody anything.
    if meta.is_dir() {
        return Err(io(std::io::Error::other(
            "is a directory, not a GGUF file (give the model's .gguf file; for a split model, its first shard)",
        )));
    }
    let len = meta.len();
    if len == 0 {
        return Ok(None);
    }
    // SAFETY: the map is read-only and private to this process. The model file must not
    // be truncated or rewritten while it is open; that is the usual contract of every
    // mmap-based model loader, and the bounds of every tensor were checked against the
    // length at open time.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    Ok(Some(map))
}

fn split_value(p: &ParsedShard, key: &str, path: &Path) -> Result<Option<(u64, u64)>, Error> {
    match p.get(key) {
        None => Ok(None),
        Some((v, at)) => match v.as_u64() {
            Some(n) => Ok(Some((n, at))),
            None => Err(Error::Malformed {
                path: path.to_path_buf(),
                offset: at,
                msg: format!(
                    "{key} must be a non-negative integer, found {} {v}",
                    v.describe_type()
                ),
            }),
        },
    }
}

impl GgufFile {
    /// Opens `path`; when its name is `NAME-0000k-of-0000N.gguf`, all N shards are opened
    /// (whichever k was named). Every shard is parsed and validated before this returns.
    pub fn open(path: &Path) -> Result<GgufFile, Error> {
        let split = shard_paths(path)?;
        let paths = match &split {
            Some(paths) => paths.clone(),
            None => vec![path.to_path_buf()],
        };
        let n = paths.len();
        if split.is_some() {
            // Name every missing shard up front, rather than failing on them one by one.
            let missing: Vec<&PathBuf> = paths.iter().filter(|p| !p.exists()).collect();
            if let Some(first) = missing.first() {
                let list: Vec<String> = missing.iter().map(|p| p.display().to_string()).collect();
                return Err(Error::Invalid {
                    path: (*first).clone(),
                    msg: format!(
                        "split model opened via {} has {n} shards, but {} missing: {}",
                        path.display(),
                        if missing.len() == 1 {
                            "this one is"
                        } else {
                            "these are"
                        },
                        list.join(", ")
                    ),
                });
            }
        }

        let mut maps = Vec::with_capacity(n);
        let mut shards = Vec::with_capacity(n);
        let mut parsed = Vec::with_capacity(n);
        for (k, p) in paths.iter().enumerate() {
            let map = map_file(p)?;
            let bytes = map.as_deref().unwrap_or(&[]);
            let shard = parse(bytes, p)?;
            check_split_keys(&shard, p, k, n, split.is_some())?;
            shards.push(ShardInfo {
                path: p.clone(),
                version: shard.version,
                alignment: shard.alignment,
                data_start: shard.data_start,
                file_size: bytes.len() as u64,
                n_tensors: shard.tensors.len(),
                tensor_bytes: shard.tensors.iter().map(|t| t.size).sum(),
            });
            maps.push(map);
            parsed.push(shard);
        }

        let mut tensors = Vec::with_capacity(parsed.iter().map(|p| p.tensors.len()).sum());
        let mut tensor_index: HashMap<String, usize> = HashMap::with_capacity(tensors.capacity());
        for (k, shard) in parsed.iter_mut().enumerate() {
            let infos = std::mem::take(&mut shard.tensors);
            for (mut t, &at) in infos.into_iter().zip(&shard.info_offsets) {
                if let Some(&prev) = tensor_index.get(&t.name) {
                    let prev_shard = tensors.get(prev).map_or(0, |p: &TensorInfo| p.shard);
                    return Err(Error::Malformed {
                        path: paths[k].clone(),
                        offset: at,
                        msg: format!(
                            "tensor `{}` also appears in shard {}",
                            t.name,
                            prev_shard + 1
                        ),
                    });
                }
                t.shard = k;
                tensor_index.insert(t.name.clone(), tensors.len());
                tensors.push(t);
            }
        }

        let first = parsed.swap_remove(0);
        if let Some((expected, at)) = split_value(&first, KEY_SPLIT_TENSORS_COUNT, &paths[0])? {
            if expected != tensors.len() as u64 {
                return Err(Error::Malformed {
                    path: paths[0].clone(),
                    offset: at,
                    msg: format!(
                        "{KEY_SPLIT_TENSORS_COUNT} is {expected}, but the {n} shard(s) hold {} tensors",
                        tensors.len()
                    ),
                });
            }
        }
        let metadata = first.metadata;
        let meta_index = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        Ok(GgufFile {
            maps,
            shards,
            paths,
            metadata,
            meta_index,
            tensors,
            tensor_index,
        })
    }

    /// Metadata in file order (of the first shard; `split.*` keys included).
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index
            .get(key)
            .and_then(|&i| self.metadata.get(i))
            .map(|(_, v)| v)
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.get(KEY_ARCHITECTURE).and_then(Value::as_str)
    }

    /// All tensors of all shards, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_position(name).map(|i| &self.tensors[i])
    }

    /// Where the tensor `name` is in [`Self::tensors`] (a map lookup).
    pub fn tensor_position(&self, name: &str) -> Option<usize> {
        self.tensor_index.get(name).copied()
    }

    /// The tensor's bytes, borrowed from the mapping.
    ///
    /// # Panics
    /// When `t` does not describe a tensor of this file (a `TensorInfo` from another
    /// `GgufFile` or edited by the caller): that is a programming error, and returning
    /// other bytes would compute with the wrong weights. See [`GgufFile::try_tensor_data`].
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        match self.try_tensor_data(t) {
            Ok(bytes) => bytes,
            Err(e) => panic!("{e}"),
        }
    }

    /// The tensor's bytes, or an error when `t` lies outside this file's shards.
    pub fn try_tensor_data(&self, t: &TensorInfo) -> Result<&[u8], Error> {
        let info = self.shards.get(t.shard).ok_or_else(|| Error::Invalid {
            path: self.paths.first().cloned().unwrap_or_default(),
            msg: format!(
                "tensor `{}` names shard {}, but the model has {} shard(s)",
                t.name,
                t.shard,
                self.shards.len()
            ),
        })?;
        let bytes = self.shard_bytes(t.shard).unwrap_or(&[]);
        usize::try_from(t.offset)
            .ok()
            .zip(usize::try_from(t.size).ok())
            .and_then(|(start, len)| bytes.get(start..start.checked_add(len)?))
            .ok_or_else(|| Error::Malformed {
                path: info.path.clone(),
                offset: t.offset,
                msg: format!(
                    "tensor `{}` ({} bytes) lies outside the file ({} bytes)",
                    t.name,
                    t.size,
                    bytes.len()
                ),
            })
    }

    /// The bytes of the tensor called `name`, if there is one.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).and_then(|t| self.try_tensor_data(t).ok())
    }

    /// The whole mapped file of shard `shard` (0-based).
    pub fn shard_bytes(&self, shard: usize) -> Option<&[u8]> {
        self.maps.get(shard).map(|m| m.as_deref().unwrap_or(&[]))
    }

    /// The shard file paths, in shard order.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Per-shard facts (version, alignment, data start, sizes), in shard order.
    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// Total bytes of all shard files.
    pub fn file_size(&self) -> u64 {
        self.shards.iter().map(|s| s.file_size).sum()
    }

    /// Maps the pages of `len` bytes from `at` of shard `shard` into this process
    /// now (Linux: `MADV_POPULATE_READ`, reading from the disk what the page cache
    /// lacks), so that the first passes over the weights do not take a page fault per
    /// few pages. Returns false, having done nothing, where the system cannot
    /// (other systems, Linux before 5.14). Several threads may populate disjoint
    /// ranges at once.
    pub fn populate(&self, shard: usize, at: usize, len: usize) -> std::io::Result<bool> {
        let Some(Some(map)) = self.maps.get(shard) else {
            return Ok(true);
        };
        #[cfg(target_os = "linux")]
        {
            match map.advise_range(memmap2::Advice::PopulateRead, at, len) {
                Ok(()) => Ok(true),
                // EINVAL: a kernel without MADV_POPULATE_READ.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Ok(false),
                Err(e) => Err(e),
            }
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (map, at, len);
            Ok(false)
        }
    }

    /// For each shard, the bytes from its data section start to the end of the file.
    pub fn data_bytes(&self) -> Vec<u64> {
        self.shards
            .iter()
            .map(|s| s.file_size.saturating_sub(s.data_start))
            .collect()
    }

    /// `general.alignment` of the first shard (32 when absent).
    pub fn alignment(&self) -> u64 {
        self.shards
            .first()
            .map_or(crate::DEFAULT_ALIGNMENT, |s| s.alignment)
    }

    fn invalid(&self, msg: String) -> Error {
        Error::Invalid {
            path: self.paths.first().cloned().unwrap_or_default(),
            msg,
        }
    }

    /// The value for `key`, or an error naming the missing key.
    pub fn require(&self, key: &str) -> Result<&Value, Error> {
        self.get(key)
            .ok_or_else(|| self.invalid(format!("metadata key `{key}` is missing")))
    }

    fn wrong_type(&self, key: &str, v: &Value, expected: &str) -> Error {
        self.invalid(format!(
            "metadata key `{key}` is {} {v}, expected {expected}",
            v.describe_type()
        ))
    }

    /// Any integer value >= 0; missing or another type is an error naming the key.
    pub fn get_u64(&self, key: &str) -> Result<u64, Error> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong_type(key, v, "a non-negative integer"))
    }

    /// Any integer value that fits an i64.
    pub fn get_i64(&self, key: &str) -> Result<i64, Error> {
        let v = self.require(key)?;
        v.as_i64()
            .ok_or_else(|| self.wrong_type(key, v, "an integer"))
    }

    /// Any numeric value (float or integer) as f64.
    pub fn get_f64(&self, key: &str) -> Result<f64, Error> {
        let v = self.require(key)?;
        v.as_f64()
            .ok_or_else(|| self.wrong_type(key, v, "a number"))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, Error> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| self.wrong_type(key, v, "a bool"))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, Error> {
        let v = self.require(key)?;
        v.as_str()
            .ok_or_else(|| self.wrong_type(key, v, "a string"))
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value], Error> {
        let v = self.require(key)?;
        v.as_array()
            .ok_or_else(|| self.wrong_type(key, v, "an array"))
    }

    /// `{general.architecture}.{suffix}`, the form of every per-arch hyperparameter key
    /// (`arch_key("block_count")` is `"qwen3moe.block_count"`).
    pub fn arch_key(&self, suffix: &str) -> Result<String, Error> {
        Ok(format!("{}.{suffix}", self.get_str(KEY_ARCHITECTURE)?))
    }
}

/// Checks a shard's own `split.*` keys against its position among the shards found by
/// file name. `is_split` is false for a file opened by a non-shard name.
fn check_split_keys(
    shard: &ParsedShard,
    path: &Path,
    k: usize,
    n: usize,
    is_split: bool,
) -> Result<(), Error> {
    let malformed = |offset, msg| Error::Malformed {
        path: path.to_path_buf(),
        offset,
        msg,
    };
    if let Some((count, at)) = split_value(shard, KEY_SPLIT_COUNT, path)? {
        if !is_split && count > 1 {
            return Err(malformed(
                at,
                format!(
                    "this file is one shard of a {count}-shard split model, but its name is not \
                     NAME-0000k-of-{count:05}.gguf, so the other shards cannot be found; \
                     give the shards the names gguf-split gave them"
                ),
            ));
        }
        if is_split && count != n as u64 {
            return Err(malformed(
                at,
                format!(
                    "{KEY_SPLIT_COUNT} is {count}, but the file name says the model has {n} shards"
                ),
            ));
        }
    }
    if let Some((no, at)) = split_value(shard, KEY_SPLIT_NO, path)? {
        if no != k as u64 {
            return Err(malformed(
                at,
                format!(
                    "{KEY_SPLIT_NO} is {no} (shard {} by its 1-based number), but the file is shard {} of {n} by its name",
                    no.saturating_add(1),
                    k + 1
                ),
            ));
        }
    }
    Ok(())
}
