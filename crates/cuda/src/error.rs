//! Errors of the CUDA layer: each names the driver call or kernel that failed and,
//! where there is one, the remedy.

use cudarc::driver::{result::DriverError, sys::CUresult};

/// Why a CUDA operation failed.
#[derive(thiserror::Error, Debug)]
pub enum CudaError {
    #[error("no NVIDIA driver (libcuda.so) found: install the driver or use --device cpu")]
    NoDriver,
    #[error(
        "the NVIDIA driver supports CUDA {major}.{minor}, but scoria's kernels need CUDA 13.0 \
         (driver 580 or newer): update the driver or use --device cpu"
    )]
    DriverTooOld { major: i32, minor: i32 },
    #[error(
        "{device} has compute capability {cc_major}.{cc_minor}; scoria's kernels need 8.0 \
         (Ampere) or newer: use --device cpu"
    )]
    DeviceTooOld {
        device: String,
        cc_major: i32,
        cc_minor: i32,
    },
    #[error("CUDA device {ordinal} does not exist ({count} found)")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error(
        "out of device memory allocating {} for {what} ({} free of {})",
        gib(*bytes),
        gib(*free),
        gib(*total)
    )]
    OutOfMemory {
        bytes: u64,
        what: String,
        free: u64,
        total: u64,
    },
    /// A driver call failed; `call` names it (and the kernel, for launches), e.g.
    /// `cuLaunchKernel(matvec_q4_k)`.
    #[error("{call}: {code}")]
    Driver { call: String, code: String },
    #[error(
        "loading the kernels ({module}) on {device} (compute capability {cc_major}.{cc_minor}) \
         failed: {code}; they were built for sm_{archs} (+ PTX of the highest): rebuild with \
         SCORIA_CUDA_ARCHS including this GPU"
    )]
    ModuleLoad {
        module: String,
        device: String,
        cc_major: i32,
        cc_minor: i32,
        archs: String,
        code: String,
    },
    /// A launch was refused before reaching the driver: its arguments break the
    /// kernel's contract (named in the message).
    #[error("{kernel}: {msg}")]
    BadArgs { kernel: &'static str, msg: String },
    #[error("{0}")]
    Capture(String),
}

impl CudaError {
    pub(crate) fn driver(call: impl Into<String>, e: DriverError) -> CudaError {
        CudaError::Driver {
            call: call.into(),
            code: describe(e.0),
        }
    }

    /// The device had no memory for what was asked (a plain allocation, a graph's
    /// instantiation or upload, a launch's local memory): not sticky, the context
    /// goes on; once another process frees VRAM the same call may succeed.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            CudaError::OutOfMemory { .. } => true,
            CudaError::Driver { code, .. } => code.starts_with("CUDA_ERROR_OUT_OF_MEMORY"),
            _ => false,
        }
    }

    pub(crate) fn bad(kernel: &'static str, msg: impl Into<String>) -> CudaError {
        CudaError::BadArgs {
            kernel,
            msg: msg.into(),
        }
    }
}

/// `CUDA_ERROR_NAME (description)` for a driver result code.
pub(crate) fn describe(code: CUresult) -> String {
    let e = DriverError(code);
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{code:?}"));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

/// Bytes as GiB (or MiB below one GiB) for messages.
pub(crate) fn gib(bytes: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes as f64 >= GIB {
        format!("{:.1} GiB", bytes as f64 / GIB)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_well() {
        assert_eq!(super::gib(1288490189), "1.2 GiB");
        assert_eq!(super::gib(3 << 20), "3.0 MiB");
    }

    #[test]
    fn out_of_memory_is_told_from_sticky_errors() {
        use super::CudaError;
        let driver = |code: &str| CudaError::Driver {
            call: "cuGraphInstantiate".into(),
            code: code.into(),
        };
        assert!(driver("CUDA_ERROR_OUT_OF_MEMORY (out of memory)").is_out_of_memory());
        assert!(CudaError::OutOfMemory {
            bytes: 1,
            what: "x".into(),
            free: 0,
            total: 1
        }
        .is_out_of_memory());
        for sticky in [
            "CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)",
            "CUDA_ERROR_LAUNCH_FAILED (unspecified launch failure)",
        ] {
            assert!(!driver(sticky).is_out_of_memory(), "{sticky}");
        }
    }
}
