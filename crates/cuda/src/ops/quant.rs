//! Activation quantization, the canonical matvec family and embedding rows: every
//! output bit-identical to `quant::quantize_act`, `quant::matvec` and
//! `quant::dequantize_row`.

use super::{act_q8_args, addr, blocks, int, opt_addr, MAX_GRID_YZ};
use crate::error::CudaError;
use crate::gpu::{Arg, Gpu};
use crate::kernels::K;
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use gguf::GgmlType;

/// Tokens a matvec tile multiplies with one weight load.
pub const TILE_TOKENS: usize = 8;

/// Quantized activations on the device: `quant::ActQ8` (what `quant::quantize_act`
/// makes of each row) as the addresses of its three arrays, `qs` i8 [rows × cols],
/// `d` f32 [rows × cols/32], `sums` i32 [rows × cols/32]. `qs` must be 16-byte
/// aligned, `d` and `sums` 4-byte aligned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActQ8 {
    pub qs: u64,
    pub d: u64,
    pub sums: u64,
}

impl ActQ8 {
    /// No quantized activations (float weights read `x`).
    pub const NONE: ActQ8 = ActQ8 {
        qs: 0,
        d: 0,
        sums: 0,
    };
    /// Bytes of (qs, d, sums) for `rows` × `cols` values.
    pub fn sizes(rows: usize, cols: usize) -> (u64, u64, u64) {
        let n = (rows * cols) as u64;
        (n, n / 32 * 4, n / 32 * 4)
    }
}

/// A tile of up to [`TILE_TOKENS`] tokens meeting one expert's weight matrix in
/// [`Gpu::matvec_tiles`]: token j < n reads input row `in_row[j]` and writes output row
/// `out_row[j]`. A tile with n <= 0 is skipped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tile {
    pub expert: i32,
    pub n: i32,
    pub in_row: [i32; 8],
    pub out_row: [i32; 8],
}

// SAFETY: plain old data of i32s with the layout of the CUDA struct (kernels/quant.cu).
unsafe impl DeviceRepr for Tile {}
// SAFETY: all-zero bytes are a valid Tile (n = 0: skipped).
unsafe impl ValidAsZeroBits for Tile {}

/// What the kernels know of a weight type: its kernel, the type code of
/// kernels/sc_formats.cuh, values per block and the alignment its loads need.
pub(crate) struct TypeInfo {
    k: K,
    /// The same kernel for one token per tile (decode).
    k1: K,
    /// The kernel for 2 to 4 tokens of a plain matrix (batched decode): one row a
    /// warp for float types, two for quantized ones.
    k4: K,
    /// `matvec_multi_rows` for matrices of this type.
    mr: K,
    /// The kernel for many tokens, same bits: the int8 tensor-core GEMM
    /// (kernels/mmq.cu) for quantized types, the shared-memory float matmul (`mm_*` in
    /// kernels/quant.cu, plain matrices only) for float types.
    mm: K,
    pub(crate) code: i32,
    block: usize,
    pub(crate) align: u64,
    pub(crate) float: bool,
    /// One of the low-bit types (crates/quant/src/lowbit.rs): the kernels that take
    /// any type at run time (`matvec_multi`, the fused MoE, `embed`) have a twin for
    /// them (suffix `_lb`), so that their own code stays as it was for the others.
    pub(crate) lowbit: bool,
}

/// The first low-bit type code of kernels/sc_formats.cuh (`SC_T_LOWBIT_FIRST`).
const LOWBIT_FIRST_CODE: i32 = 9;

fn type_info(ty: GgmlType) -> Option<TypeInfo> {
    use GgmlType as T;
    let ((k, k1, k4, mm, mr), code, block, align, float) = match ty {
        T::F32 => (
            (
                K::MatvecF32,
                K::MatvecF32T1,
                K::MatvecF32T4,
                K::MmF32,
                K::MatvecMultiRowsF32,
            ),
            0,
            1,
            4,
            true,
        ),
        T::F16 => (
            (
                K::MatvecF16,
                K::MatvecF16T1,
                K::MatvecF16T4,
                K::MmF16,
                K::MatvecMultiRowsF16,
            ),
            1,
            1,
            2,
            true,
        ),
        T::BF16 => (
            (
                K::MatvecBf16,
                K::MatvecBf16T1,
                K::MatvecBf16T4,
                K::MmBf16,
                K::MatvecMultiRowsBf16,
            ),
            2,
            1,
            2,
            true,
        ),
        T::Q8_0 => (
            (
                K::MatvecQ8_0,
                K::MatvecQ8_0T1,
                K::MatvecQ8_0T4,
                K::MmqQ8_0,
                K::MatvecMultiRowsQ8_0,
            ),
            3,
            32,
            2,
            false,
        ),
        T::Q4_0 => (
            (
                K::MatvecQ4_0,
                K::MatvecQ4_0T1,
                K::MatvecQ4_0T4,
                K::MmqQ4_0,
                K::MatvecMultiRowsQ4_0,
            ),
            4,
            32,
            2,
            false,
        ),
        T::Q4_K => (
            (
                K::MatvecQ4K,
                K::MatvecQ4KT1,
                K::MatvecQ4KT4,
                K::MmqQ4K,
                K::MatvecMultiRowsQ4K,
            ),
            5,
            256,
            16,
            false,
        ),
        T::Q5_K => (
            (
                K::MatvecQ5K,
                K::MatvecQ5KT1,
                K::MatvecQ5KT4,
                K::MmqQ5K,
                K::MatvecMultiRowsQ5K,
            ),
            6,
            256,
            16,
            false,
        ),
        T::Q6_K => (
            (
                K::MatvecQ6K,
                K::MatvecQ6KT1,
                K::MatvecQ6KT4,
                K::MmqQ6K,
                K::MatvecMultiRowsQ6K,
            ),
            7,
            256,
            2,
            false,
        ),
        T::IQ4_XS => (
            (
                K::MatvecIq4Xs,
                K::MatvecIq4XsT1,
                K::MatvecIq4XsT4,
                K::MmqIq4Xs,
                K::MatvecMultiRowsIq4Xs,
            ),
            8,
            256,
            8,
            false,
        ),
        T::Q2_K => (
            (
                K::MatvecQ2K,
                K::MatvecQ2KT1,
                K::MatvecQ2KT4,
                K::MmqQ2K,
                K::MatvecMultiRowsQ2K,
            ),
            9,
            256,
            4,
            false,
        ),
        T::Q3_K => (
            (
                K::MatvecQ3K,
                K::MatvecQ3KT1,
                K::MatvecQ3KT4,
                K::MmqQ3K,
                K::MatvecMultiRowsQ3K,
            ),
            10,
            256,
            2,
            false,
        ),
        T::Q4_1 => (
            (
                K::MatvecQ4_1,
                K::MatvecQ4_1T1,
                K::MatvecQ4_1T4,
                K::MmqQ4_1,
                K::MatvecMultiRowsQ4_1,
            ),
            11,
            32,
            4,
            false,
        ),
        T::Q5_0 => (
            (
                K::MatvecQ5_0,
                K::MatvecQ5_0T1,
                K::MatvecQ5_0T4,
                K::MmqQ5_0,
                K::MatvecMultiRowsQ5_0,
            ),
            12,
            32,
            2,
            false,
        ),
        T::Q5_1 => (
            (
                K::MatvecQ5_1,
                K::MatvecQ5_1T1,
                K::MatvecQ5_1T4,
                K::MmqQ5_1,
                K::MatvecMultiRowsQ5_1,
            ),
            13,
            32,
            4,
            false,
        ),
        T::IQ4_NL => (
            (
                K::MatvecIq4Nl,
                K::MatvecIq4NlT1,
                K::MatvecIq4NlT4,
                K::MmqIq4Nl,
                K::MatvecMultiRowsIq4Nl,
            ),
            14,
            32,
            2,
            false,
        ),
        T::MXFP4 => (
            (
                K::MatvecMxfp4,
                K::MatvecMxfp4T1,
                K::MatvecMxfp4T4,
                K::MmqMxfp4,
                K::MatvecMultiRowsMxfp4,
            ),
            15,
            32,
            1,
            false,
        ),
        T::TQ1_0 => (
            (
                K::MatvecTq1_0,
                K::MatvecTq1_0T1,
                K::MatvecTq1_0T4,
                K::MmqTq1_0,
                K::MatvecMultiRowsTq1_0,
            ),
            16,
            256,
            2,
            false,
        ),
        T::TQ2_0 => (
            (
                K::MatvecTq2_0,
                K::MatvecTq2_0T1,
                K::MatvecTq2_0T4,
                K::MmqTq2_0,
                K::MatvecMultiRowsTq2_0,
            ),
            17,
            256,
            2,
            false,
        ),
        T::IQ2_XXS => (
            (
                K::MatvecIq2Xxs,
                K::MatvecIq2XxsT1,
                K::MatvecIq2XxsT4,
                K::MmqIq2Xxs,
                K::MatvecMultiRowsIq2Xxs,
            ),
            18,
            256,
            2,
            false,
        ),
        T::IQ2_XS => (
            (
                K::MatvecIq2Xs,
                K::MatvecIq2XsT1,
                K::MatvecIq2XsT4,
                K::MmqIq2Xs,
                K::MatvecMultiRowsIq2Xs,
            ),
            19,
            256,
            2,
            false,
        ),
        T::IQ2_S => (
            (
                K::MatvecIq2S,
                K::MatvecIq2ST1,
                K::MatvecIq2ST4,
                K::MmqIq2S,
                K::MatvecMultiRowsIq2S,
            ),
            20,
            256,
            2,
            false,
        ),
        T::IQ3_XXS => (
            (
                K::MatvecIq3Xxs,
                K::MatvecIq3XxsT1,
                K::MatvecIq3XxsT4,
                K::MmqIq3Xxs,
                K::MatvecMultiRowsIq3Xxs,
            ),
            21,
            256,
            2,
            false,
        ),
        T::IQ3_S => (
            (
                K::MatvecIq3S,
                K::MatvecIq3ST1,
                K::MatvecIq3ST4,
                K::MmqIq3S,
                K::MatvecMultiRowsIq3S,
            ),
            22,
            256,
            2,
            false,
        ),
        T::IQ1_S => (
            (
                K::MatvecIq1S,
                K::MatvecIq1ST1,
                K::MatvecIq1ST4,
                K::MmqIq1S,
                K::MatvecMultiRowsIq1S,
            ),
            23,
            256,
            2,
            false,
        ),
        T::IQ1_M => (
            (
                K::MatvecIq1M,
                K::MatvecIq1MT1,
                K::MatvecIq1MT4,
                K::MmqIq1M,
                K::MatvecMultiRowsIq1M,
            ),
            24,
            256,
            4,
            false,
        ),
        T::NVFP4 => (
            (
                K::MatvecNvfp4,
                K::MatvecNvfp4T1,
                K::MatvecNvfp4T4,
                K::MmqNvfp4,
                K::MatvecMultiRowsNvfp4,
            ),
            25,
            64,
            4,
            false,
        ),
        _ => return None,
    };
    Some(TypeInfo {
        k,
        k1,
        k4,
        mm,
        mr,
        code,
        block,
        align,
        float,
        lowbit: code >= LOWBIT_FIRST_CODE,
    })
}

/// Whether the CUDA kernels take tensors of type `ty` (every product, the fused MoE
/// and embedding rows): the float types and every quantized type of the quant crate.
pub fn supports_type(ty: GgmlType) -> bool {
    type_info(ty).is_some()
}

/// Checks a weight matrix's shape: a supported type, whole blocks and 32-value
/// sub-blocks per row, and `row_bytes` matching the type.
pub(crate) fn check_weights(
    kernel: &'static str,
    ty: GgmlType,
    row_bytes: u64,
    n_cols: usize,
) -> Result<TypeInfo, CudaError> {
    let ti = type_info(ty)
        .ok_or_else(|| CudaError::bad(kernel, format!("tensor type {ty} has no CUDA kernel")))?;
    if n_cols == 0 || !n_cols.is_multiple_of(32) || !n_cols.is_multiple_of(ti.block) {
        return Err(CudaError::bad(
            kernel,
            format!("{ty}: a row of {n_cols} columns is not a whole number of blocks and 32-value sub-blocks"),
        ));
    }
    let want = ty.row_bytes(n_cols).unwrap_or(0) as u64;
    if row_bytes != want {
        return Err(CudaError::bad(
            kernel,
            format!("{ty}: row_bytes is {row_bytes}, a row of {n_cols} columns has {want}"),
        ));
    }
    Ok(ti)
}

/// Activation arguments: `x` for float weights, the ActQ8 for quantized ones (the
/// other may be 0).
fn act_args(kernel: &'static str, float: bool, x: u64, xq: ActQ8) -> Result<[Arg; 4], CudaError> {
    if float {
        Ok([
            Arg::P(addr(kernel, "x", x, 4)?),
            Arg::P(0),
            Arg::P(0),
            Arg::P(0),
        ])
    } else {
        let [qs, d, sums] = act_q8_args(kernel, xq, true)?;
        Ok([Arg::P(0), qs, d, sums])
    }
}

/// A weight matrix on the device for the one-token kernels that take several
/// (`matvec_multi`, the fused MoE): `n_rows` rows of `n_cols` values of type `ty` at
/// `ptr`, `row_bytes` apart; for a stack of experts, expert e's matrix starts
/// `expert_bytes · e` after `ptr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mat {
    pub ty: GgmlType,
    pub ptr: u64,
    pub expert_bytes: u64,
    pub row_bytes: u64,
    pub n_rows: usize,
    pub n_cols: usize,
}

/// Checks one [`Mat`]: its shape and type (as the matvec kernels do) and the
/// alignment its rows' loads need.
pub(crate) fn check_mat(kn: &'static str, what: &str, m: &Mat) -> Result<TypeInfo, CudaError> {
    let ti = check_weights(kn, m.ty, m.row_bytes, m.n_cols)?;
    addr(kn, what, m.ptr, ti.align)?;
    if !m.expert_bytes.is_multiple_of(ti.align) {
        return Err(CudaError::bad(
            kn,
            format!(
                "{what}: expert_bytes {} is not a multiple of {}",
                m.expert_bytes, ti.align
            ),
        ));
    }
    Ok(ti)
}

/// What the caller knows of a tile array ([`Gpu::matvec_tiles_as`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileShape {
    /// Any tiles.
    Any,
    /// Every tile holds one token.
    Single,
    /// Tiles `TILE_GROUP·u .. TILE_GROUP·(u+1)` share one expert (empty tiles of that
    /// expert pad a group).
    Grouped,
}

/// `matvec_multi`'s 1 to 4 matrices, an output each.
fn check_multi_counts(mats: &[&Mat], outs: &[u64]) -> Result<(), CudaError> {
    if mats.is_empty() || mats.len() > 4 || outs.len() != mats.len() {
        return Err(CudaError::bad(
            "matvec_multi",
            format!(
                "{} matrices and {} outputs (1 to 4 of each)",
                mats.len(),
                outs.len()
            ),
        ));
    }
    Ok(())
}

/// Warps (rows) per matvec block.
const MV_ROWS_PER_BLOCK: usize = 4;

/// The tensor-core GEMM's block: weight rows × tokens (kernels/mmq.cu), and the most
/// 32-value sub-blocks a row may have there.
const MMQ_ROWS: usize = 64;
const MMQ_TOKENS: usize = 32;
const MMQ_MAX_SUB: usize = 512;
/// The GEMM's dynamic shared memory: 3 stack levels (2-4) × 16 outputs × 128 threads of f32.
pub(crate) const MMQ_DYN_SMEM: u32 = 3 * 16 * 128 * 4;

/// The float matmul's block (kernels/quant.cu `mm_*`): weight rows × tokens, and the
/// columns a stage takes (a row's length must be a multiple of it).
const MMF_ROWS: usize = 16;
const MMF_TOKENS: usize = 32;
const MMF_K: usize = 128;

/// Tiles the GEMM reads as one unit: [`TileShape::Grouped`] tiles share an expert in
/// groups of this many.
pub const TILE_GROUP: usize = MMQ_TOKENS / TILE_TOKENS;

/// Where `matvec_multi_launch` finds the DeltaNet conv's history: one token's state,
/// or a device table of each token's state address.
#[derive(Clone, Copy)]
enum ConvAt {
    State(u64),
    Table(u64),
}

impl Gpu {
    /// `q` = quantize_act of each of `rows` rows of `cols` values at `x` (f32).
    pub fn quantize_act(
        &self,
        x: u64,
        rows: usize,
        cols: usize,
        q: ActQ8,
    ) -> Result<(), CudaError> {
        const KN: &str = "quantize_act";
        if !cols.is_multiple_of(32) {
            return Err(CudaError::bad(
                KN,
                format!("{cols} columns is not a multiple of 32"),
            ));
        }
        let n_blocks = rows * cols / 32;
        if n_blocks == 0 {
            return Ok(());
        }
        let args = [
            Arg::P(addr(KN, "x", x, 4)?),
            Arg::I64(n_blocks as i64),
            Arg::P(addr(KN, "q.qs", q.qs, 16)?),
            Arg::P(addr(KN, "q.d", q.d, 4)?),
            Arg::P(addr(KN, "q.sums", q.sums, 4)?),
        ];
        // 8 warps per block, one 32-value block each.
        self.launch(K::QuantizeAct, [blocks(n_blocks, 8)?, 1, 1], 256, 0, &args)
    }

    /// `out[t·n_rows + r]` = row r of `w` · token t, for t < n_tok: the canonical dot,
    /// bit-identical to `quant::matvec` per token. Float weights (F32, F16, BF16) read
    /// `x` (f32 [n_tok × n_cols]); quantized ones read `xq` (quantize_act of x).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        ty: GgmlType,
        w: u64,
        row_bytes: u64,
        n_rows: usize,
        n_cols: usize,
        x: u64,
        xq: ActQ8,
        n_tok: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        self.matvec_launch(
            "matvec",
            ty,
            w,
            0,
            row_bytes,
            n_rows,
            n_cols,
            x,
            xq,
            n_tok,
            0,
            0,
            TileShape::Any,
            out,
        )
    }

    /// The same kernels over a device array of `n_tiles` [`Tile`]s: tile i multiplies
    /// the weight matrix of expert `tile.expert` (at `w_base + expert·expert_bytes`)
    /// with its tokens' input rows and writes `out[out_row[j]·n_rows + r]`. The grid
    /// depends only on `n_tiles`, so the tiles may be written on the device (the
    /// router) inside a captured graph. [`Gpu::matvec_tiles_as`] says more of the tiles
    /// when the caller knows it.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_tiles(
        &self,
        ty: GgmlType,
        w_base: u64,
        expert_bytes: u64,
        row_bytes: u64,
        n_rows: usize,
        n_cols: usize,
        x: u64,
        xq: ActQ8,
        tiles: u64,
        n_tiles: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        self.matvec_tiles_as(
            TileShape::Any,
            ty,
            w_base,
            expert_bytes,
            row_bytes,
            n_rows,
            n_cols,
            x,
            xq,
            tiles,
            n_tiles,
            out,
        )
    }

    /// [`Gpu::matvec_tiles`] for tiles of a known `shape`, which picks the fastest
    /// kernel: one token per tile (a decode step's routed experts) the one-accumulator
    /// kernels; tiles grouped by [`TILE_GROUP`] (a prompt's) the tensor-core GEMM for
    /// quantized types. Every kernel gives the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_tiles_as(
        &self,
        shape: TileShape,
        ty: GgmlType,
        w_base: u64,
        expert_bytes: u64,
        row_bytes: u64,
        n_rows: usize,
        n_cols: usize,
        x: u64,
        xq: ActQ8,
        tiles: u64,
        n_tiles: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "matvec_tiles";
        addr(KN, "tiles", tiles, 4)?;
        self.matvec_launch(
            KN,
            ty,
            w_base,
            expert_bytes,
            row_bytes,
            n_rows,
            n_cols,
            x,
            xq,
            0,
            tiles,
            n_tiles,
            shape,
            out,
        )
    }

    /// The rows the `n_tiles` tiles at `tiles` name (`out_row`, `cols` f32 each, at
    /// stride `cols` from `out`), each times its matrix's second-level scale, one
    /// multiplication a value: row r's is `per_route[r]` when `per_route` is not 0,
    /// else `per_expert[tile.expert]` (f32 device arrays).
    pub fn scale_tile_rows(
        &self,
        out: u64,
        cols: usize,
        tiles: u64,
        n_tiles: usize,
        per_expert: u64,
        per_route: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "scale_tile_rows";
        if n_tiles == 0 {
            return Ok(());
        }
        if per_expert == 0 && per_route == 0 {
            return Err(CudaError::bad(
                KN,
                "neither per_expert nor per_route scales given",
            ));
        }
        let args = [
            Arg::P(addr(KN, "out", out, 4)?),
            Arg::I32(int(KN, "cols", cols)?),
            Arg::P(addr(KN, "tiles", tiles, 4)?),
            Arg::P(opt_addr(KN, "per_expert", per_expert, 4)?),
            Arg::P(opt_addr(KN, "per_route", per_route, 4)?),
        ];
        self.launch(K::ScaleTileRows, [blocks(n_tiles, 1)?, 1, 1], 256, 0, &args)
    }

    #[allow(clippy::too_many_arguments)]
    fn matvec_launch(
        &self,
        kn: &'static str,
        ty: GgmlType,
        w: u64,
        expert_bytes: u64,
        row_bytes: u64,
        n_rows: usize,
        n_cols: usize,
        x: u64,
        xq: ActQ8,
        n_tok: usize,
        tiles: u64,
        n_tiles: usize,
        shape: TileShape,
        out: u64,
    ) -> Result<(), CudaError> {
        let ti = check_weights(kn, ty, row_bytes, n_cols)?;
        addr(kn, "w", w, ti.align)?;
        if !expert_bytes.is_multiple_of(ti.align) {
            return Err(CudaError::bad(
                kn,
                format!(
                    "expert_bytes {expert_bytes} is not a multiple of {}",
                    ti.align
                ),
            ));
        }
        let units = if tiles != 0 {
            n_tiles
        } else {
            n_tok.div_ceil(TILE_TOKENS)
        };
        if n_rows == 0 || units == 0 {
            return Ok(());
        }
        let [ax, aq, ad, asum] = act_args(kn, ti.float, x, xq)?;
        // Many tokens of a plain float matrix (a prompt's router): the shared-memory
        // matmul (same bits per (row, token)).
        let float_units = n_tok.div_ceil(MMF_TOKENS);
        if ti.float
            && tiles == 0
            && n_tok > TILE_TOKENS
            && float_units <= MAX_GRID_YZ
            && n_cols.is_multiple_of(MMF_K)
        {
            let args = [
                Arg::P(w),
                Arg::U64(row_bytes),
                Arg::I32(int(kn, "n_rows", n_rows)?),
                Arg::I32(int(kn, "n_cols", n_cols)?),
                ax,
                Arg::I32(int(kn, "n_tok", n_tok)?),
                Arg::P(addr(kn, "out", out, 4)?),
            ];
            let grid = [blocks(n_rows, MMF_ROWS)?, float_units as u32, 1];
            return self.launch(ti.mm, grid, 256, 0, &args);
        }
        // Many tokens of a dense product, or grouped tiles: the tensor-core GEMM when
        // the type and the device have one (same bits per (row, token)).
        let gemm = (!ti.float).then_some(ti.mm).filter(|_| {
            self.compute_capability().0 >= 8
                && n_cols / 32 <= MMQ_MAX_SUB
                && if tiles == 0 {
                    n_tok > TILE_TOKENS
                } else {
                    shape == TileShape::Grouped
                }
        });
        if let Some(k) = gemm {
            let units = if tiles == 0 {
                n_tok.div_ceil(MMQ_TOKENS)
            } else {
                n_tiles.div_ceil(TILE_GROUP)
            };
            let args = [
                Arg::P(w),
                Arg::U64(expert_bytes),
                Arg::U64(row_bytes),
                Arg::I32(int(kn, "n_rows", n_rows)?),
                Arg::I32(int(kn, "n_cols", n_cols)?),
                aq,
                ad,
                asum,
                Arg::I32(int(kn, "n_tok", n_tok)?),
                Arg::P(tiles),
                Arg::I32(int(kn, "n_tiles", n_tiles)?),
                Arg::P(addr(kn, "out", out, 4)?),
            ];
            let grid = [blocks(n_rows, MMQ_ROWS)?, units.min(MAX_GRID_YZ) as u32, 1];
            return self.launch(k, grid, 128, MMQ_DYN_SMEM, &args);
        }
        let args = [
            Arg::P(w),
            Arg::U64(expert_bytes),
            Arg::U64(row_bytes),
            Arg::I32(int(kn, "n_rows", n_rows)?),
            Arg::I32(int(kn, "n_cols", n_cols)?),
            ax,
            aq,
            ad,
            asum,
            Arg::I32(int(kn, "n_tok", n_tok)?),
            Arg::P(tiles),
            Arg::I32(int(kn, "n_tiles", n_tiles)?),
            Arg::P(addr(kn, "out", out, 4)?),
        ];
        // One token per tile (decode): the kernel that keeps one accumulator per
        // lane runs more warps at once; same bits per (row, token).
        let one = (tiles == 0 && n_tok == 1) || (tiles != 0 && shape == TileShape::Single);
        let four = !one && tiles == 0 && n_tok <= 4;
        let k = if one {
            ti.k1
        } else if four {
            ti.k4
        } else {
            ti.k
        };
        // The quantized _t4 kernels take two rows a warp.
        let rows_per_warp = if four && !ti.float { 2 } else { 1 };
        let grid = [
            blocks(n_rows, MV_ROWS_PER_BLOCK * rows_per_warp)?,
            units.min(MAX_GRID_YZ) as u32,
            1,
        ];
        self.launch(k, grid, (32 * MV_ROWS_PER_BLOCK) as u32, 0, &args)
    }

    /// One token against up to four matrices that read it, in one launch:
    /// `outs[p][r] = x · mats[p][r]` with the bits of [`Gpu::matvec`] for one token.
    /// The matrices read `x` (f32) or its quantized copy `xq` (needed when a type is
    /// quantized) and have as many columns. With `conv` = (state, taps, d_conv),
    /// matrix 0's rows are channels of the DeltaNet conv: `outs[0]` receives
    /// silu(conv) as [`Gpu::dn_conv`] computes it for one token, and `state` (f32
    /// [rows][d_conv − 1]) advances.
    pub fn matvec_multi(
        &self,
        mats: &[&Mat],
        outs: &[u64],
        x: u64,
        xq: ActQ8,
        conv: Option<(u64, u64, usize)>,
    ) -> Result<(), CudaError> {
        let conv = conv.map(|(state, taps, d)| (ConvAt::State(state), taps, d));
        self.matvec_multi_launch(mats, outs, x, xq, conv, 1)
    }

    /// [`Gpu::matvec_multi`] for each of `n_tok` tokens (rows of `x` and `xq`):
    /// `outs[p]` gets a row of matrix p's `n_rows` values per token, each with the
    /// one-token bits (a batched decode step of several sequences). With `conv` =
    /// (state table, taps, d_conv), token t's conv state is at the table's entry t
    /// (device u64 [n_tok]): each sequence's conv advances on its own state.
    pub fn matvec_multi_rows(
        &self,
        mats: &[&Mat],
        outs: &[u64],
        x: u64,
        xq: ActQ8,
        n_tok: usize,
        conv: Option<(u64, u64, usize)>,
    ) -> Result<(), CudaError> {
        let conv = conv.map(|(table, taps, d)| (ConvAt::Table(table), taps, d));
        check_multi_counts(mats, outs)?;
        // One launch per weight type, in the order of each type's first matrix: a
        // kernel of one type keeps that type's registers (the conv goes with matrix 0,
        // always first in its group).
        let mut done = [false; 4];
        for i in 0..mats.len() {
            if done[i] {
                continue;
            }
            let group: Vec<usize> = (i..mats.len())
                .filter(|&j| !done[j] && mats[j].ty == mats[i].ty)
                .collect();
            group.iter().for_each(|&j| done[j] = true);
            let sub: Vec<&Mat> = group.iter().map(|&j| mats[j]).collect();
            let so: Vec<u64> = group.iter().map(|&j| outs[j]).collect();
            let c = if i == 0 { conv } else { None };
            self.matvec_multi_launch(&sub, &so, x, xq, c, n_tok)?;
        }
        Ok(())
    }

    /// `matvec_multi` (one token, `conv` at a [`ConvAt::State`]) or
    /// `matvec_multi_rows` (`n_tok` tokens, `conv` at a [`ConvAt::Table`]).
    fn matvec_multi_launch(
        &self,
        mats: &[&Mat],
        outs: &[u64],
        x: u64,
        xq: ActQ8,
        conv: Option<(ConvAt, u64, usize)>,
        n_tok: usize,
    ) -> Result<(), CudaError> {
        const KN: &str = "matvec_multi";
        // The rows kernel for several tokens, or for the states of a table.
        let rows = n_tok > 1 || matches!(conv, Some((ConvAt::Table(_), ..)));
        check_multi_counts(mats, outs)?;
        let n_cols = mats[0].n_cols;
        let (mut w, mut rb, mut ends, mut o) = ([0u64; 4], [0u64; 4], [0i32; 4], [0u64; 4]);
        let (mut tys, mut need_q, mut lowbit, mut end) = (0i32, false, false, 0usize);
        for (p, m) in mats.iter().enumerate() {
            let ti = check_mat(KN, "matrix", m)?;
            if m.n_cols != n_cols {
                return Err(CudaError::bad(
                    KN,
                    format!("matrix {p} has {} columns, matrix 0 {n_cols}", m.n_cols),
                ));
            }
            need_q |= !ti.float;
            lowbit |= ti.lowbit;
            tys |= ti.code << (8 * p);
            (w[p], rb[p], o[p]) = (m.ptr, m.row_bytes, addr(KN, "out", outs[p], 4)?);
            end += m.n_rows;
            ends[p] = int(KN, "rows", end)?;
        }
        for p in mats.len()..4 {
            ends[p] = ends[p - 1];
        }
        // One token: the conv state itself (absent when d_conv is 1: no history);
        // rows: a table of their states.
        let (cs, ctab, ct, dc) = match conv {
            Some((at, t, d)) => {
                if d == 0 || d > super::MAX_D_CONV {
                    return Err(CudaError::bad(
                        KN,
                        format!("d_conv {d} (1..={} supported)", super::MAX_D_CONV),
                    ));
                }
                let (cs, ctab) = match at {
                    ConvAt::Table(tab) => (0, addr(KN, "conv state table", tab, 8)?),
                    ConvAt::State(st) if d > 1 => (addr(KN, "conv state", st, 4)?, 0),
                    ConvAt::State(st) => (st, 0),
                };
                (cs, ctab, addr(KN, "conv taps", t, 4)?, d)
            }
            None => (0, 0, 0, 0),
        };
        let [q0, q1, q2] = act_q8_args(KN, xq, need_q)?;
        let mut args = vec![
            Arg::P(w[0]),
            Arg::P(w[1]),
            Arg::P(w[2]),
            Arg::P(w[3]),
            Arg::I32(tys),
        ];
        args.extend(rb.map(Arg::U64));
        args.extend(ends.map(Arg::I32));
        args.extend(o.map(Arg::P));
        args.extend([
            Arg::I32(int(KN, "n_cols", n_cols)?),
            Arg::P(addr(KN, "x", x, 4)?),
            q0,
            q1,
            q2,
            Arg::P(cs),
            Arg::P(ct),
            Arg::I32(dc as i32),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::P(ctab),
        ]);
        if end == 0 || n_tok == 0 {
            return Ok(());
        }
        // The rows kernels are one type's (the caller groups the matrices), two rows a
        // warp.
        let (kernel, rows_per_warp) = if rows {
            if mats.iter().any(|m| m.ty != mats[0].ty) {
                return Err(CudaError::bad(
                    KN,
                    "the rows launch takes matrices of one type".to_string(),
                ));
            }
            (check_mat(KN, "matrix", mats[0])?.mr, 2)
        } else if lowbit {
            (K::MatvecMultiLb, 1)
        } else {
            (K::MatvecMulti, 1)
        };
        self.launch(
            kernel,
            [blocks(end, MV_ROWS_PER_BLOCK * rows_per_warp)?, 1, 1],
            (32 * MV_ROWS_PER_BLOCK) as u32,
            0,
            &args,
        )
    }

    /// `out[t]` = row `ids[t]` of `table` dequantized (`quant::dequantize_row`), for
    /// t < n_tok; `ids` is i32 on the device. Ids are not range-checked on the device:
    /// the caller validates them against the vocabulary.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        ty: GgmlType,
        table: u64,
        row_bytes: u64,
        cols: usize,
        ids: u64,
        n_tok: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        const KN: &str = "embed";
        let ti = check_weights(KN, ty, row_bytes, cols)?;
        if n_tok == 0 {
            return Ok(());
        }
        let args = [
            Arg::I32(ti.code),
            Arg::P(addr(KN, "table", table, ti.align.min(4))?),
            Arg::U64(row_bytes),
            Arg::I32(int(KN, "cols", cols)?),
            Arg::P(addr(KN, "ids", ids, 4)?),
            Arg::I32(int(KN, "n_tok", n_tok)?),
            Arg::P(addr(KN, "out", out, 4)?),
        ];
        let grid = [blocks(cols, 256)?, n_tok.min(MAX_GRID_YZ) as u32, 1];
        let k = if ti.lowbit { K::EmbedLb } else { K::Embed };
        self.launch(k, grid, 256, 0, &args)
    }
}
