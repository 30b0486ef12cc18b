//! Kernel launches: one method on [`Gpu`](crate::Gpu) per kernel, taking raw device
//! addresses (`u64`) so that the executor can point into one scratch arena. Each
//! checks the host-side contract (sizes, alignment) and the launch; none allocates,
//! synchronises or reads device data on the host, so all are capture-safe. None uses
//! atomics on floats: every reduction has a fixed tree, and results are the same run
//! to run.

mod attention;
mod deltanet;
mod moe;
mod norm;
mod quant;
mod sample;
mod vision;

pub use attention::Rotary;
pub use deltanet::{DnRows, DnStep, MAX_D_CONV};
pub use moe::{
    MoeRoute, RouterRoute, FUSED_MAX_EXPERTS, MAX_EXPERTS, MAX_TOP_K, PUBLISH_HEAD_WORDS,
    ROUTER_MAX_TOKENS, ROUTE_IN_ROUTER_MAX_EXPERT,
};
pub use norm::argmax_scratch_words;
pub use quant::{supports_type, ActQ8, Mat, Tile, TileShape, TILE_GROUP, TILE_TOKENS};
pub use sample::{sample_scratch_words, sample_words, SampleRow};
pub use vision::{vis_attention_supports, VisEpilogue, VisWeight};

use crate::kernels::K;

/// Kernels launched with more than the default dynamic shared memory, and how much
/// they need at most.
pub(crate) fn dynamic_smem_needs() -> Vec<(K, u32)> {
    vec![
        (K::AttnCoreHd32, attention::core_smem(32, false)),
        (K::AttnCoreHd64, attention::core_smem(64, false)),
        (K::AttnCoreHd128, attention::core_smem(128, false)),
        (K::AttnCoreHd256, attention::core_smem(256, false)),
        (K::AttnCoreWideHd32, attention::core_smem(32, true)),
        (K::AttnCoreWideHd64, attention::core_smem(64, true)),
        (K::AttnCoreWideHd128, attention::core_smem(128, true)),
        (K::AttnCoreWideHd256, attention::core_smem(256, true)),
        (K::AttnCoreRowsHd32, attention::core_smem(32, false)),
        (K::AttnCoreRowsHd64, attention::core_smem(64, false)),
        (K::AttnCoreRowsHd128, attention::core_smem(128, false)),
        (K::AttnCoreRowsHd256, attention::core_smem(256, false)),
        (K::MmqQ8_0, quant::MMQ_DYN_SMEM),
        (K::MmqQ4_0, quant::MMQ_DYN_SMEM),
        (K::MmqQ4K, quant::MMQ_DYN_SMEM),
        (K::MmqQ5K, quant::MMQ_DYN_SMEM),
        (K::MmqQ6K, quant::MMQ_DYN_SMEM),
        (K::MmqIq4Xs, quant::MMQ_DYN_SMEM),
        (K::MmqQ2K, quant::MMQ_DYN_SMEM),
        (K::MmqQ3K, quant::MMQ_DYN_SMEM),
        (K::MmqQ4_1, quant::MMQ_DYN_SMEM),
        (K::MmqQ5_0, quant::MMQ_DYN_SMEM),
        (K::MmqQ5_1, quant::MMQ_DYN_SMEM),
        (K::MmqIq4Nl, quant::MMQ_DYN_SMEM),
        (K::MmqMxfp4, quant::MMQ_DYN_SMEM),
        (K::MmqTq1_0, quant::MMQ_DYN_SMEM),
        (K::MmqTq2_0, quant::MMQ_DYN_SMEM),
        (K::MmqIq2Xxs, quant::MMQ_DYN_SMEM),
        (K::MmqIq2Xs, quant::MMQ_DYN_SMEM),
        (K::MmqIq2S, quant::MMQ_DYN_SMEM),
        (K::MmqIq3Xxs, quant::MMQ_DYN_SMEM),
        (K::MmqIq3S, quant::MMQ_DYN_SMEM),
        (K::MmqIq1S, quant::MMQ_DYN_SMEM),
        (K::MmqIq1M, quant::MMQ_DYN_SMEM),
        (K::MmqNvfp4, quant::MMQ_DYN_SMEM),
    ]
}

use crate::error::CudaError;

/// `v` as an i32 kernel parameter.
pub(crate) fn int(kernel: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::bad(kernel, format!("{what} = {v} exceeds i32")))
}

/// A device address that must be non-null and aligned to `align` bytes.
pub(crate) fn addr(kernel: &'static str, what: &str, p: u64, align: u64) -> Result<u64, CudaError> {
    if p == 0 {
        return Err(CudaError::bad(
            kernel,
            format!("{what} is a null device pointer"),
        ));
    }
    if !p.is_multiple_of(align) {
        return Err(CudaError::bad(
            kernel,
            format!("{what} ({p:#x}) is not {align}-byte aligned"),
        ));
    }
    Ok(p)
}

/// An optional device address (0 = none), aligned when present.
pub(crate) fn opt_addr(
    kernel: &'static str,
    what: &str,
    p: u64,
    align: u64,
) -> Result<u64, CudaError> {
    if p == 0 {
        Ok(0)
    } else {
        addr(kernel, what, p, align)
    }
}

/// A quantized copy's three kernel parameters (qs, d, sums). `required`: the kernel
/// reads it, so every address must be there and aligned. Otherwise `ActQ8::NONE` gives
/// three nulls (the kernel skips it), and a copy with only some addresses is refused.
pub(crate) fn act_q8_args(
    kernel: &'static str,
    q: ActQ8,
    required: bool,
) -> Result<[crate::gpu::Arg; 3], CudaError> {
    use crate::gpu::Arg;
    if q == ActQ8::NONE && !required {
        return Ok([Arg::P(0), Arg::P(0), Arg::P(0)]);
    }
    if q.qs == 0 || q.d == 0 || q.sums == 0 {
        return Err(CudaError::bad(
            kernel,
            if required {
                "needs quantized activations (qs, d and sums)"
            } else {
                "give all of qs, d and sums, or none"
            },
        ));
    }
    Ok([
        Arg::P(addr(kernel, "qs", q.qs, 16)?),
        Arg::P(addr(kernel, "d", q.d, 4)?),
        Arg::P(addr(kernel, "sums", q.sums, 4)?),
    ])
}

/// Blocks of `per` items covering `n` (at least one when n > 0).
pub(crate) fn blocks(n: usize, per: usize) -> Result<u32, CudaError> {
    u32::try_from(n.div_ceil(per))
        .map_err(|_| CudaError::bad("launch", format!("{n} items need too many blocks")))
}

/// The most blocks a grid's y or z dimension may have.
pub(crate) const MAX_GRID_YZ: usize = 65535;
