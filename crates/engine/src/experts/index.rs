//! [`ExpertIndex`]: where every routed expert matrix of a model lives in its file(s).
//!
//! A block's routed experts are three 3-D tensors (`ffn_{gate,up,down}_exps`, ggml shape
//! {cols, rows, n_expert}); expert `e`'s matrix is the `e`-th contiguous run of
//! `rows · row_bytes` bytes of its tensor. The index turns (block, expert, matrix) into
//! (shard, absolute byte offset, length, type, rows, cols), which is what the expert
//! store hands to [`DirectReader`](super::io::DirectReader) and to the DMA engine.
//!
//! The tensors are found through the arch's tensor table (`model::tensors`, every
//! [`Role::RoutedExpert`] entry), so trunk layers and MTP (NextN) blocks are both
//! covered: blocks `0..n_layer` are the trunk, `n_layer..n_blocks()` the MTP blocks.

use gguf::{GgmlType, GgufFile};
use model::tensors::{self, ExpertMatrix, Role};
use model::ModelConfig;
use std::path::{Path, PathBuf};

use super::io::FileId;

/// The three matrices of an expert, in the order [`ExpertIndex::expert`] returns them.
pub const MATRICES: [ExpertMatrix; 3] = [ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down];

fn matrix_slot(m: ExpertMatrix) -> usize {
    match m {
        ExpertMatrix::Gate => 0,
        ExpertMatrix::Up => 1,
        ExpertMatrix::Down => 2,
    }
}

/// Where one expert matrix lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixLoc {
    /// Index into [`ExpertIndex::shard_paths`].
    pub shard: usize,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    /// Bytes (`rows · row_bytes(cols)`).
    pub len: u64,
    pub ty: GgmlType,
    /// Output rows (ne1).
    pub rows: usize,
    /// Elements per row (ne0).
    pub cols: usize,
}

/// One routed-expert tensor of a block: expert `e`'s matrix is at `offset + e · len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TensorLoc {
    shard: usize,
    offset: u64,
    len: u64,
    ty: GgmlType,
    rows: usize,
    cols: usize,
}

/// Why an index cannot be built; each names the tensor.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("routed expert tensor `{0}` is missing from the file")]
    Missing(String),
    #[error("routed expert tensor `{name}` has shape {found:?}, expected {expected:?} (ggml order) for this model's metadata")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<u64>,
    },
    #[error("routed expert tensor `{name}`: {msg}")]
    Layout { name: String, msg: String },
    #[error("the {arch} tensor table lists no routed expert tensors for block {block}")]
    NoExperts { arch: &'static str, block: usize },
}

/// Where every routed expert matrix of a loaded model lives (see the module docs).
#[derive(Debug, Clone)]
pub struct ExpertIndex {
    shards: Vec<PathBuf>,
    /// Each shard's identity when the index was built (with the model's load):
    /// readers opened later refuse a file that is not this one.
    ids: Vec<Option<FileId>>,
    n_layer: usize,
    n_expert: usize,
    /// Per block: gate, up, down.
    blocks: Vec<[TensorLoc; 3]>,
}

impl ExpertIndex {
    /// Indexes the routed experts of every block of `file` (trunk and MTP blocks).
    pub fn build(file: &GgufFile, cfg: &ModelConfig) -> Result<ExpertIndex, IndexError> {
        let n_blocks = cfg.n_layer + cfg.n_nextn;
        let mut found: Vec<[Option<TensorLoc>; 3]> = vec![[None; 3]; n_blocks];
        for inst in tensors::table(cfg.arch).instances(cfg) {
            let (Role::RoutedExpert(m), Some(block)) = (inst.def.role, inst.block) else {
                continue;
            };
            let t = file
                .tensor(&inst.name)
                .ok_or_else(|| IndexError::Missing(inst.name.clone()))?;
            let dims_ok =
                t.dims.len() == 3 && t.dims.iter().zip(&inst.dims).all(|(&a, &b)| a == b as u64);
            if !dims_ok {
                return Err(IndexError::Shape {
                    name: inst.name.clone(),
                    expected: inst.dims.clone(),
                    found: t.dims.clone(),
                });
            }
            let layout = |msg: String| IndexError::Layout {
                name: inst.name.clone(),
                msg,
            };
            let (cols, rows, n) = (inst.dims[0], inst.dims[1], inst.dims[2]);
            let row_bytes = t.ty.row_bytes(cols).ok_or_else(|| {
                layout(format!(
                    "a row of {cols} elements is not a whole number of {} blocks",
                    t.ty
                ))
            })?;
            let len = (rows as u64) * row_bytes as u64;
            if len.checked_mul(n as u64) != Some(t.size) {
                return Err(layout(format!(
                    "{} bytes in the file, but {n} experts of {rows} rows × {row_bytes} bytes are {}",
                    t.size,
                    len as u128 * n as u128
                )));
            }
            found[block][matrix_slot(m)] = Some(TensorLoc {
                shard: t.shard,
                offset: t.offset,
                len,
                ty: t.ty,
                rows,
                cols,
            });
        }
        let blocks = found
            .into_iter()
            .enumerate()
            .map(|(b, locs)| match locs {
                [Some(g), Some(u), Some(d)] => Ok([g, u, d]),
                _ => Err(IndexError::NoExperts {
                    arch: cfg.arch.name(),
                    block: b,
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ExpertIndex {
            shards: file.paths().to_vec(),
            ids: file.paths().iter().map(|p| FileId::at(p).ok()).collect(),
            n_layer: cfg.n_layer,
            n_expert: cfg.n_expert,
            blocks,
        })
    }

    /// Trunk layers (the blocks routing profiles and slot plans cover).
    pub fn n_layer(&self) -> usize {
        self.n_layer
    }

    /// Trunk layers and MTP blocks.
    pub fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn n_expert(&self) -> usize {
        self.n_expert
    }

    /// The shard files, in shard order ([`MatrixLoc::shard`] indexes this).
    pub fn shard_paths(&self) -> &[PathBuf] {
        &self.shards
    }

    pub fn shard_path(&self, shard: usize) -> Option<&Path> {
        self.shards.get(shard).map(PathBuf::as_path)
    }

    /// Shard `shard`'s identity when the index was built (`None`: it could not be
    /// read then).
    pub fn shard_id(&self, shard: usize) -> Option<FileId> {
        self.ids.get(shard).copied().flatten()
    }

    /// Matrix `m` of expert `expert` of block `block`; `None` out of range.
    pub fn matrix(&self, block: usize, expert: usize, m: ExpertMatrix) -> Option<MatrixLoc> {
        if expert >= self.n_expert {
            return None;
        }
        let t = self.blocks.get(block)?[matrix_slot(m)];
        Some(MatrixLoc {
            shard: t.shard,
            offset: t.offset + expert as u64 * t.len,
            len: t.len,
            ty: t.ty,
            rows: t.rows,
            cols: t.cols,
        })
    }

    /// Gate, up and down of one expert ([`MATRICES`] order); `None` out of range.
    pub fn expert(&self, block: usize, expert: usize) -> Option<[MatrixLoc; 3]> {
        Some([
            self.matrix(block, expert, ExpertMatrix::Gate)?,
            self.matrix(block, expert, ExpertMatrix::Up)?,
            self.matrix(block, expert, ExpertMatrix::Down)?,
        ])
    }

    /// Bytes of one expert of `block` (its three matrices); every expert of a block has
    /// the same size, blocks may differ (Q4_K_M stores some `ffn_down` as Q6_K).
    pub fn expert_bytes(&self, block: usize) -> Option<u64> {
        self.blocks
            .get(block)
            .map(|ts| ts.iter().map(|t| t.len).sum())
    }

    /// Bytes of all experts of `block`.
    pub fn block_bytes(&self, block: usize) -> Option<u64> {
        self.expert_bytes(block).map(|b| b * self.n_expert as u64)
    }

    /// One expert's bytes for each trunk layer (the input of [`super::plan`]).
    pub fn trunk_expert_bytes(&self) -> Vec<u64> {
        (0..self.n_layer)
            .filter_map(|l| self.expert_bytes(l))
            .collect()
    }

    /// Bytes of every routed expert of every block (trunk and MTP).
    pub fn total_bytes(&self) -> u64 {
        (0..self.n_blocks())
            .filter_map(|b| self.block_bytes(b))
            .sum()
    }
}
