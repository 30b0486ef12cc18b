//! The runtime: loads a model, keeps per-sequence state (KV cache, recurrent
//! state), samples, and runs model steps on an executor (the CPU, or CUDA).
//!
//! Modules depend downwards only: each uses only modules after it in this list —
//! `record`, `engine`, `sched`, `cuda`, `cpu`, `prompt_cache`, `exec`, `api`, `sampler`,
//! `experts`, `memory`, `error`, `constraint`, `fault` (`npy` and `switches` use none). This file only
//! declares them and re-exports the public surface.

mod api;
pub mod constraint;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod engine;
mod error;
pub mod exec;
pub mod experts;
pub mod fault;
mod memory;
pub mod npy;
pub mod prompt_cache;
mod record;
pub mod sampler;
pub mod sched;
pub mod spec;
pub mod switches;

pub use api::*;
pub use engine::{
    check_threads, Engine, DEFAULT_PARALLEL_CPU, DEFAULT_PROMPT_CACHE, MAX_PARALLEL,
    MAX_THREADS_PER_CPU,
};
pub use error::EngineError;
pub use memory::{ContextAsk, MemoryAccount};
pub use record::{record_profile, ProfileInput, Recorded};
pub use sched::{CacheCounters, CacheReport, RequestCallbacks, SlotInfo};
pub use spec::{DraftLimits, SpecConfig, SpecMode};
