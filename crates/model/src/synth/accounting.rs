//! Where every byte of a GGUF model goes: the accounting `scoria inspect` prints.
//!
//! Per shard, the fixed header, metadata, tensor infos, padding before the data section,
//! tensor data, padding after tensors and unreferenced bytes sum to the file size
//! exactly (each term is measured, the last one is what no tensor claims). Tensors are
//! also grouped by role (embedding, attention, linear attention, router, shared expert,
//! routed experts, norms, MTP, ...) so the dense/expert split of a model is visible.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use gguf::{GgmlType, GgufFile, TensorInfo};

use super::plan::block_of;

/// The role of a tensor, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    Embedding,
    Output,
    Attention,
    LinearAttention,
    Router,
    SharedExpert,
    RoutedExperts,
    Norms,
    Mtp,
    Other,
}

impl Group {
    pub const ALL: [Group; 10] = [
        Group::Embedding,
        Group::Output,
        Group::Attention,
        Group::LinearAttention,
        Group::Router,
        Group::SharedExpert,
        Group::RoutedExperts,
        Group::Norms,
        Group::Mtp,
        Group::Other,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Group::Embedding => "embedding",
            Group::Output => "output head",
            Group::Attention => "attention",
            Group::LinearAttention => "linear attention (ssm)",
            Group::Router => "router",
            Group::SharedExpert => "shared expert",
            Group::RoutedExperts => "routed experts",
            Group::Norms => "norms",
            Group::Mtp => "MTP block",
            Group::Other => "other",
        }
    }
}

/// Facts about the model needed to classify names.
#[derive(Debug, Clone, Default)]
pub struct Classifier {
    /// First MTP block index (`block_count − nextn_predict_layers`), if the file has MTP.
    pub nextn_start: Option<u32>,
    /// Blocks that hold linear-attention (`ssm_*`) tensors.
    pub recurrent: HashSet<u32>,
}

impl Classifier {
    pub fn for_file(f: &GgufFile) -> Classifier {
        let arch = f.architecture().unwrap_or("");
        let get = |k: &str| f.get(&format!("{arch}.{k}")).and_then(|v| v.as_u64());
        let nextn_start = match (get("block_count"), get("nextn_predict_layers")) {
            (Some(b), Some(n)) if n > 0 && n <= b => u32::try_from(b - n).ok(),
            _ => None,
        };
        let recurrent = f
            .tensors()
            .iter()
            .filter(|t| t.name.contains(".ssm_"))
            .filter_map(|t| block_of(&t.name))
            .collect();
        Classifier {
            nextn_start,
            recurrent,
        }
    }

    pub fn classify(&self, name: &str) -> Group {
        let block = block_of(name);
        if let (Some(b), Some(start)) = (block, self.nextn_start) {
            if b >= start {
                return Group::Mtp;
            }
        }
        let leaf = match block {
            Some(b) => name
                .strip_prefix(&format!("blk.{b}."))
                .unwrap_or(name)
                .to_string(),
            None => name.to_string(),
        };
        if leaf.contains(".nextn.") || leaf.starts_with("nextn.") {
            return Group::Mtp;
        }
        if leaf.starts_with("token_embd") {
            return Group::Embedding;
        }
        if leaf == "output.weight" || leaf.starts_with("output.") {
            return Group::Output;
        }
        if leaf.contains("norm") {
            return Group::Norms;
        }
        if leaf.contains("_exps") {
            return Group::RoutedExperts;
        }
        if leaf.contains("_shexp") {
            return Group::SharedExpert;
        }
        if leaf.starts_with("ffn_gate_inp") {
            return Group::Router;
        }
        if leaf.starts_with("ssm_") {
            return Group::LinearAttention;
        }
        if leaf.starts_with("attn_") {
            let linear = block.is_some_and(|b| self.recurrent.contains(&b));
            return if linear {
                Group::LinearAttention
            } else {
                Group::Attention
            };
        }
        Group::Other
    }
}

/// Whether a tensor is routed-expert data (the part an expert store tiers), MTP included.
pub fn is_routed_expert(name: &str) -> bool {
    name.contains("_exps")
}

/// One shard's bytes, term by term; [`ShardAccounting::total`] equals `file_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardAccounting {
    pub path: PathBuf,
    pub file_size: u64,
    /// Magic, version, tensor count, kv count: 24 bytes.
    pub fixed_header: u64,
    pub metadata: u64,
    pub tensor_infos: u64,
    /// Zeros between the tensor infos and the aligned data section.
    pub header_padding: u64,
    pub tensor_data: u64,
    /// Gaps after tensors shorter than the alignment (the writer's padding).
    pub tensor_padding: u64,
    /// Bytes of the data section no tensor claims beyond alignment padding (0 in a file
    /// written by llama.cpp or scoria).
    pub unreferenced: u64,
    pub n_tensors: usize,
    pub alignment: u64,
}

impl ShardAccounting {
    pub fn total(&self) -> u64 {
        self.fixed_header
            + self.metadata
            + self.tensor_infos
            + self.header_padding
            + self.tensor_data
            + self.tensor_padding
            + self.unreferenced
    }
}

/// Bytes and tensor count of a group or type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub tensors: usize,
    pub bytes: u64,
}

/// The whole model's accounting.
#[derive(Debug, Clone)]
pub struct Accounting {
    pub shards: Vec<ShardAccounting>,
    pub groups: BTreeMap<Group, Tally>,
    pub by_type: BTreeMap<GgmlType, Tally>,
    pub routed_expert: Tally,
    pub dense: Tally,
    /// Sum of the shards' file sizes.
    pub file_size: u64,
}

impl Accounting {
    /// Sum of every term of every shard; equals `file_size`.
    pub fn total(&self) -> u64 {
        self.shards.iter().map(ShardAccounting::total).sum()
    }
    pub fn tensor_data(&self) -> u64 {
        self.shards.iter().map(|s| s.tensor_data).sum()
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum AccountingError {
    #[error("{path}: at byte offset {offset}: {msg}")]
    Header {
        path: PathBuf,
        offset: u64,
        msg: String,
    },
    #[error("{path}: tensors overlap at byte offset {offset}")]
    Overlap { path: PathBuf, offset: u64 },
}

/// Measures the header region of one shard: (metadata bytes, tensor info bytes).
struct HeaderWalk<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> HeaderWalk<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], String> {
        let n = usize::try_from(n).map_err(|_| format!("length {n} does not fit memory"))?;
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| format!("{n} bytes run past the end of the file"))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, String> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self) -> Result<(), String> {
        let n = self.u64()?;
        self.take(n).map(|_| ())
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<(), String> {
        let fixed = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => return self.string(),
            9 => {
                if depth > 8 {
                    return Err("arrays nested too deep".into());
                }
                let elem = self.u32()?;
                let count = self.u64()?;
                return match elem {
                    0 | 1 | 7 => self.take(count).map(|_| ()),
                    2 | 3 => self.take(count.saturating_mul(2)).map(|_| ()),
                    4..=6 => self.take(count.saturating_mul(4)).map(|_| ()),
                    10..=12 => self.take(count.saturating_mul(8)).map(|_| ()),
                    _ => {
                        for _ in 0..count {
                            self.value(elem, depth + 1)?;
                        }
                        Ok(())
                    }
                };
            }
            other => return Err(format!("unknown metadata value type {other}")),
        };
        self.take(fixed).map(|_| ())
    }
}

fn walk_header(b: &[u8]) -> Result<(u64, u64, u64), (u64, String)> {
    let mut w = HeaderWalk { b, pos: 0 };
    let at = |w: &HeaderWalk, m: String| (w.pos as u64, m);
    let magic = w.take(4).map_err(|m| (0, m))?;
    if magic != gguf::GGUF_MAGIC {
        return Err((0, "not a GGUF file (bad magic)".into()));
    }
    w.u32().map_err(|m| at(&w, m))?;
    let n_tensors = w.u64().map_err(|m| at(&w, m))?;
    let n_kv = w.u64().map_err(|m| at(&w, m))?;
    let fixed = w.pos as u64;
    for _ in 0..n_kv {
        w.string().map_err(|m| at(&w, m))?;
        let ty = w.u32().map_err(|m| at(&w, m))?;
        w.value(ty, 0).map_err(|m| at(&w, m))?;
    }
    let kv_end = w.pos as u64;
    for _ in 0..n_tensors {
        w.string().map_err(|m| at(&w, m))?;
        let nd = w.u32().map_err(|m| at(&w, m))?;
        if nd as usize > gguf::MAX_DIMS {
            return Err(at(&w, format!("{nd} dimensions")));
        }
        w.take(8 * u64::from(nd) + 4 + 8).map_err(|m| at(&w, m))?;
    }
    Ok((fixed, kv_end - fixed, w.pos as u64 - kv_end))
}

/// The accounting of an opened model (all shards).
pub fn account(f: &GgufFile) -> Result<Accounting, AccountingError> {
    let classifier = Classifier::for_file(f);
    let mut shards = Vec::new();
    for (i, info) in f.shards().iter().enumerate() {
        let bytes = f.shard_bytes(i).unwrap_or(&[]);
        let (fixed, metadata, tensor_infos) =
            walk_header(bytes).map_err(|(offset, msg)| AccountingError::Header {
                path: info.path.clone(),
                offset,
                msg,
            })?;
        let header_end = fixed + metadata + tensor_infos;
        let mut ts: Vec<&TensorInfo> = f.tensors().iter().filter(|t| t.shard == i).collect();
        ts.sort_by_key(|t| t.offset);
        let mut pos = info.data_start.max(header_end);
        let mut tensor_data = 0u64;
        let mut tensor_padding = 0u64;
        let mut unreferenced = 0u64;
        // A gap shorter than the alignment is the writer's padding; anything longer is
        // bytes no tensor claims.
        let split = |g: u64| if g < info.alignment { (g, 0) } else { (0, g) };
        for t in &ts {
            if t.offset < pos {
                return Err(AccountingError::Overlap {
                    path: info.path.clone(),
                    offset: t.offset,
                });
            }
            let g = t.offset - pos;
            if tensor_data == 0 && pos == info.data_start.max(header_end) {
                // Before the first tensor: the data section should start at it.
                unreferenced += g;
            } else {
                let (p, u) = split(g);
                tensor_padding += p;
                unreferenced += u;
            }
            tensor_data += t.size;
            pos = t.offset + t.size;
        }
        let (p, u) = split(info.file_size.saturating_sub(pos));
        tensor_padding += p;
        unreferenced += u;
        shards.push(ShardAccounting {
            path: info.path.clone(),
            file_size: info.file_size,
            fixed_header: fixed,
            metadata,
            tensor_infos,
            header_padding: info.data_start.saturating_sub(header_end),
            tensor_data,
            tensor_padding,
            unreferenced,
            n_tensors: ts.len(),
            alignment: info.alignment,
        });
    }
    let mut groups: BTreeMap<Group, Tally> = BTreeMap::new();
    let mut by_type: BTreeMap<GgmlType, Tally> = BTreeMap::new();
    let (mut routed, mut dense) = (Tally::default(), Tally::default());
    for t in f.tensors() {
        for tally in [
            groups.entry(classifier.classify(&t.name)).or_default(),
            by_type.entry(t.ty).or_default(),
            if is_routed_expert(&t.name) {
                &mut routed
            } else {
                &mut dense
            },
        ] {
            tally.tensors += 1;
            tally.bytes += t.size;
        }
    }
    Ok(Accounting {
        shards,
        groups,
        by_type,
        routed_expert: routed,
        dense,
        file_size: f.file_size(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        let mut c = Classifier {
            nextn_start: Some(40),
            recurrent: HashSet::new(),
        };
        c.recurrent.insert(0);
        assert_eq!(c.classify("token_embd.weight"), Group::Embedding);
        assert_eq!(c.classify("output.weight"), Group::Output);
        assert_eq!(c.classify("output_norm.weight"), Group::Norms);
        assert_eq!(c.classify("blk.0.attn_qkv.weight"), Group::LinearAttention);
        assert_eq!(c.classify("blk.3.attn_q.weight"), Group::Attention);
        assert_eq!(c.classify("blk.0.ssm_a"), Group::LinearAttention);
        assert_eq!(c.classify("blk.0.ssm_norm.weight"), Group::Norms);
        assert_eq!(c.classify("blk.0.ffn_gate_inp.weight"), Group::Router);
        assert_eq!(
            c.classify("blk.0.ffn_gate_inp_shexp.weight"),
            Group::SharedExpert
        );
        assert_eq!(
            c.classify("blk.0.ffn_down_exps.weight"),
            Group::RoutedExperts
        );
        assert_eq!(c.classify("blk.40.ffn_down_exps.weight"), Group::Mtp);
        assert_eq!(c.classify("blk.40.nextn.eh_proj.weight"), Group::Mtp);
    }
}
