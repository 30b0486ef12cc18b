//! One file per architecture: its tensor table ([`crate::tensors::ArchTable`]) and its
//! special cases, as data. The loader, `synth` and `inspect` read these tables through
//! [`crate::tensors::table`].

pub mod qwen35moe;
pub mod qwen3moe;
pub mod qwen3next;
