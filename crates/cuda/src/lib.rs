//! CUDA for scoria: the device context, its one stream, device and pinned buffers,
//! graphs, and the kernels (`kernels/*.cu`, compiled by build.rs with nvcc).
//!
//! Everything but [`compiled`] and [`shapes`] exists only with the `cuda` feature; without it the
//! crate builds with no CUDA at all. See README.md for the kernel list and which
//! kernels are bit-identical to the CPU.

#[cfg(feature = "cuda")]
mod error;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod ops;
pub mod shapes;

#[cfg(feature = "cuda")]
pub use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
#[cfg(feature = "cuda")]
pub use error::CudaError;
#[cfg(feature = "cuda")]
pub use gguf::GgmlType;
#[cfg(feature = "cuda")]
pub use gpu::{DevBuf, Event, Gpu, Graph, Lane, PinnedAlloc, PinnedBuf};
#[cfg(feature = "cuda")]
pub use ops::{
    argmax_scratch_words, sample_scratch_words, sample_words, supports_type,
    vis_attention_supports, ActQ8, DnRows, DnStep, Mat, MoeRoute, Rotary, RouterRoute, SampleRow,
    Tile, TileShape, VisEpilogue, VisWeight, FUSED_MAX_EXPERTS, MAX_D_CONV, MAX_EXPERTS, MAX_TOP_K,
    PUBLISH_HEAD_WORDS, ROUTER_MAX_TOKENS, ROUTE_IN_ROUTER_MAX_EXPERT, TILE_GROUP, TILE_TOKENS,
};

/// True when this build has the CUDA executor (feature `cuda`).
pub fn compiled() -> bool {
    cfg!(feature = "cuda")
}
