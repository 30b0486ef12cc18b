//! Foundations of the tiered expert store (docs/design.md, "The expert store"), the parts
//! that need no GPU:
//! - [`ExpertIndex`] (`index.rs`): where every routed expert matrix lives in the model
//!   file(s): shard, absolute offset, length, type, shape;
//! - [`io`]: [`DirectReader`], batches of ranges read with `O_DIRECT` through io_uring
//!   into 4 KiB-aligned buffers (pinned memory later), with the fallbacks, refusing a
//!   file that changed since it was opened;
//! - [`ExpertReader`] (`reader.rs`): whole experts read on a thread of their own, with
//!   a deadline for a stalled disk, one retry, and a verdict per expert;
//! - [`RoutingCounts`] / [`RoutingProfile`] (`profile.rs`): routing counts per (layer,
//!   expert), recorded by the CPU executor's MoE, saved and validated against a model
//!   (`crate::record` runs an engine on the CPU to record one);
//! - [`plan()`] (`plan.rs`): VRAM slots per layer by measured demand, the pinned RAM
//!   copy most used first, and the account of where every GiB goes; budgets are
//!   granted or refused, never trimmed;
//! - [`ExpertStore`] (`store.rs`): where each expert lives now (VRAM slot, pinned RAM,
//!   file), and each step's slot assignments and fetches, for the executor to carry out.

mod cost;
mod index;
pub mod io;
mod plan;
mod profile;
mod reader;
mod store;

pub use cost::{cpu_may_read_map, fit_cpu, CostModel};
pub use index::{ExpertIndex, IndexError, MatrixLoc, MATRICES};
pub use io::{AlignedBuf, DirectReader, FileId, ReadError, ReadRequest, ReaderOptions};
pub use plan::{plan, ram_copy, LayerPlan, Plan, PlanError, PlanRequest, SlotRule};
pub use profile::{ProfileError, RoutingCounts, RoutingProfile};
pub use reader::{ExpertReader, Filled, ReadCounters, ReadPolicy, Staging, DEFAULT_READ_DEADLINE};
pub use store::{
    Batch, ExpertStore, Fetch, Home, TierStats, FREQ_WEIGHT, HALF_LIFE, PREFETCH_ROUTES_PER_EXPERT,
};
