//! The ViT: patch embedding, interpolated learned positions, 2-D rotary attention blocks
//! and the merger, on the CPU.
