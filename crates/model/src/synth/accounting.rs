//! Where every byte of a GGUF model goes: the accounting `scoria inspect` prints.
//!
//! Per shard, the fixed header, metadata, tensor infos, padding before the data section,
//! tensor data, padding after tensors and unreferenced bytes sum to the file size
//! exactly (each term is measured, the last one is what no tensor claims). Tensors are
//! also grouped by their role in the arch's tensor table ([`crate::tensors`]: embedding,
//! attention, linear attention, router, shared expert, routed experts, norms, MTP, ...)
//! so the dense/expert split of a model is visible.

use std::collections::BTreeMap;
use std::path::PathBuf;

use gguf::{GgmlType, GgufFile, TensorInfo};

use crate::config::Arch;
use crate::tensors::{self, block_of, ArchTable, Role};

/// What `inspect` sums a tensor under: its role, coarsened.
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

impl Group {
    /// The group of a tensor of role `role` outside an MTP block.
    pub const fn of(role: Role) -> Group {
        match role {
            Role::Embedding => Group::Embedding,
            Role::Output => Group::Output,
            Role::OutputNorm | Role::Norm => Group::Norms,
            Role::Attention => Group::Attention,
            Role::LinearAttention => Group::LinearAttention,
            Role::Router => Group::Router,
            Role::SharedExpert | Role::SharedExpertGate => Group::SharedExpert,
            Role::RoutedExpert(_) => Group::RoutedExperts,
            Role::Mtp => Group::Mtp,
        }
    }
}

/// Classifies a file's tensor names through its arch's table.
#[derive(Debug, Clone, Default)]
pub struct Classifier {
    /// First MTP block index (`block_count − nextn_predict_layers`), if the file has MTP.
    pub nextn_start: Option<u32>,
    /// The file's arch table; `None` for an arch this engine does not know (names are
    /// then looked up in every table: see [`Role::of`]).
    pub table: Option<&'static ArchTable>,
}

impl Classifier {
    pub fn for_file(f: &GgufFile) -> Classifier {
        let arch = f.architecture().unwrap_or("");
        let get = |k: &str| f.get(&format!("{arch}.{k}")).and_then(|v| v.as_u64());
        let nextn_start = match (get("block_count"), get("nextn_predict_layers")) {
            (Some(b), Some(n)) if n > 0 && n <= b => u32::try_from(b - n).ok(),
            _ => None,
        };
        Classifier {
            nextn_start,
            table: Arch::from_name(arch).map(tensors::table),
        }
    }

    /// The tensor's role in the table, if the table lists it.
    pub fn role(&self, name: &str) -> Option<Role> {
        match self.table {
            Some(t) => t.find(name).map(|(_, d)| d.role),
            None => Role::of(name),
        }
    }

    /// Every tensor of an MTP block is `Mtp`; others go by role, `Other` if unlisted; a
    /// matrix's second-level scale (`<stem>.scale`) by its matrix's.
    pub fn classify(&self, name: &str) -> Group {
        if let (Some(b), Some(start)) = (block_of(name), self.nextn_start) {
            if b >= start {
                return Group::Mtp;
            }
        }
        let role = self.role(name).or_else(|| {
            crate::weights::scaled_matrix_names(name)?
                .iter()
                .find_map(|m| self.role(m))
        });
        role.map_or(Group::Other, Group::of)
    }
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
            if classifier.role(&t.name).is_some_and(Role::is_routed_expert) {
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
        let c = Classifier {
            nextn_start: Some(40),
            table: Some(tensors::table(Arch::Qwen35Moe)),
        };
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
        // Not in qwen35moe's table (qwen3next's fused β/α), nor in any table.
        assert_eq!(c.classify("blk.0.ssm_ba.weight"), Group::Other);
        assert_eq!(c.classify("rope_freqs.weight"), Group::Other);
        // An unknown arch falls back to every table.
        let any = Classifier::default();
        assert_eq!(any.classify("blk.0.ssm_ba.weight"), Group::LinearAttention);
    }
}
