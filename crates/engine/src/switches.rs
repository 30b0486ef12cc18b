//! Every environment variable scoria's programs read, in one place.
//!
//! Settings that change what a run does (budgets, the prompt pool, guesses, sampling)
//! are settings (`--flag` and the config file), never environment variables. What is
//! left here is diagnosis, logging and where things live. A switch is on when its
//! variable is set to anything but the empty string or `0` ([`on`]), and is read once,
//! when the executor opens.
//!
//! | variable | read by | what it is for |
//! |---|---|---|
//! | `SCORIA_NO_GRAPH` | the CUDA executor | launch every kernel eagerly instead of replaying each decode step's CUDA graph |
//! | `SCORIA_NO_FUSED_DECODE` | the CUDA executor | send a one-token step through the prompt path's separate kernels instead of the fused ones (same bits) |
//! | `SCORIA_NO_PDL` | the CUDA executor | launch without programmatic dependent launch |
//! | `SCORIA_CUDA_SYNC` | the CUDA executor | synchronise after every launch outside capture, so an asynchronous fault names its kernel |
//! | `SCORIA_TRACE_DECODE` | the CUDA executor, tiered | print every 128 decode tokens where a layer step's time went |
//! | `SCORIA_ISA` | `quant` (a value: `scalar`, `avx2`, `avx512bw`, `avx512`, `amx`) | run the CPU kernels at a lower instruction-set level than the CPU has |
//! | `SCORIA_LOG` | the `scoria` binary (a `tracing` filter, e.g. `debug`) | log detail |
//! | `SCORIA_CACHE_DIR` | `model::synth` | where the synthetic models tests make are kept (else `$XDG_CACHE_HOME/scoria`, `~/.cache/scoria`) |
//! | `SCORIA_COMMIT` | `scoria bench` | the commit its results name, for a binary built outside a checkout |
//!
//! Build time (`crates/cuda/build.rs`, `crates/cli/build.rs`): `SCORIA_CUDA_ARCHS` (the
//! GPU architectures to compile kernels for, e.g. `89` or `80,90`), `SCORIA_NVCC_FLAGS`
//! (extra nvcc flags), `SCORIA_CUDA_PREFIX` (where nvcc's toolkit lives when `NVCC`
//! does not say), and `SCORIA_BUILD_COMMIT` (set by the build for `--version`).
//!
//! Tests: `SCORIA_TEST_DEVICE` (`cuda` runs the engine's parity, invariant, batch and
//! scheduler tests on the GPU), `SCORIA_REQUIRE_GPU=1` (a missing GPU fails instead of
//! skipping), `SCORIA_REQUIRE_CXX=1` (likewise for the host C++ compiler of
//! `crates/cuda/tests/host_formats.rs`), `SCORIA_SKIP_GGUF_ORACLE=1` (skips the `gguf`
//! package's dequantization oracle on a machine that cannot install it),
//! `SCORIA_REPO_ROOT` (where the GPU machine's copy of the repository is),
//! `SCORIA_TEST_KILLED_WRITER` (`tests/faults_prompt_cache.rs` runs itself as a child that
//! writes the prompt cache there until it is killed), `SCORIA_TEST_DEVICE_FAULT`
//! ([`TEST_DEVICE_FAULT`]), `SCORIA_TEST_CUDA_FAULT` ([`TEST_CUDA_FAULT`]),
//! `SCORIA_TEST_FAULTS_GPU_CHILD` (`tests/faults_gpu.rs` runs itself as a child that
//! holds the GPU's free memory until it is killed, or that meets a sticky error). The test
//! scripts' own variables (`SCORIA_BIN`, `SCORIA_URL`, `SCORIA_API_KEY`, the
//! `*_TIMEOUT`s) are documented at the top of each script.

/// The CUDA executor launches every kernel eagerly.
pub const NO_GRAPH: &str = "SCORIA_NO_GRAPH";
/// The CUDA executor keeps room for speculative verify steps (`--spec` on the GPU).
/// One-token steps take the prompt path's separate kernels.
pub const NO_FUSED_DECODE: &str = "SCORIA_NO_FUSED_DECODE";
/// No programmatic dependent launch.
pub const NO_PDL: &str = "SCORIA_NO_PDL";
/// Synchronise after every launch.
pub const CUDA_SYNC: &str = "SCORIA_CUDA_SYNC";
/// The tiered decode step's time line.
pub const TRACE_DECODE: &str = "SCORIA_TRACE_DECODE";
/// Tests only: the CPU executor's step number N (counted from 1) fails as a lost
/// device would (a fatal executor error), so the path a GPU's sticky error takes —
/// the requests ended, the engine refusing more, `/health` unhealthy, a non-zero
/// exit — runs on any machine.
pub const TEST_DEVICE_FAULT: &str = "SCORIA_TEST_DEVICE_FAULT";
/// Tests only: the CUDA executor's step number N (counted from 1) launches a kernel
/// that writes to an illegal address, so the context gets a real sticky error
/// (`CUDA_ERROR_ILLEGAL_ADDRESS`) and the step fails with it, fatally.
pub const TEST_CUDA_FAULT: &str = "SCORIA_TEST_CUDA_FAULT";

/// True when the variable `name` is set to anything but "" or "0".
pub fn on(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty() && v != "0")
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_switch_is_on_unless_unset_empty_or_zero() {
        // A name no other test reads, so setting it cannot race with them.
        let name = "SCORIA_SWITCH_TEST_ONLY";
        std::env::remove_var(name);
        assert!(!super::on(name));
        for (v, want) in [("", false), ("0", false), ("1", true), ("yes", true)] {
            std::env::set_var(name, v);
            assert_eq!(super::on(name), want, "{name}={v:?}");
        }
        std::env::remove_var(name);
    }
}
