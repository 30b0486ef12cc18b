//! Every CUDA kernel against its CPU reference (the quant and model crates), on random
//! data (seeded, fresh per case, never all zeros). Where docs/design.md demands identity the
//! comparison is of bits (`to_bits`); attention is compared within a tolerance.
//! Outputs are poisoned (NaN / impossible values) before each launch, so an element
//! that a kernel fails to write shows up as a mismatch.
//!
//! Needs an NVIDIA GPU and driver. Without one each test prints a SKIP line and
//! passes, unless SCORIA_REQUIRE_GPU=1, which makes them fail (the GPU machine sets it).
#![cfg(feature = "cuda")]

#[path = "gpu_kernels/attention.rs"]
mod attention;
#[path = "common/blocks.rs"]
mod blocks;
#[path = "gpu_kernels/deltanet.rs"]
mod deltanet;
#[path = "gpu_kernels/graph.rs"]
mod graph;
#[path = "gpu_kernels/moe.rs"]
mod moe_kernels;
#[path = "gpu_kernels/quant.rs"]
mod quant_kernels;
#[path = "gpu_kernels/rows.rs"]
mod rows;
#[path = "gpu_kernels/vision.rs"]
mod vision;

use cuda::{ActQ8, DevBuf, DeviceRepr, Gpu, ValidAsZeroBits};

/// A GPU for one test (each test has its own stream), or None (with a SKIP line)
/// when the machine has none and SCORIA_REQUIRE_GPU is not 1.
pub fn gpu(test: &str) -> Option<Gpu> {
    let required = std::env::var("SCORIA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match Gpu::device_count() {
        Ok(n) if n > 0 => {
            Some(Gpu::open(0).unwrap_or_else(|e| panic!("{test}: opening GPU 0: {e}")))
        }
        Ok(_) if required => {
            panic!("{test}: SCORIA_REQUIRE_GPU=1 but the driver sees no CUDA device")
        }
        Err(e) if required => panic!("{test}: SCORIA_REQUIRE_GPU=1 but: {e}"),
        Ok(_) => {
            eprintln!("SKIP {test}: no CUDA device");
            None
        }
        Err(e) => {
            eprintln!("SKIP {test}: {e}");
            None
        }
    }
}

/// xorshift64: seeded, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Uniform in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// n values in [-scale, scale), none of them all zero.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

pub fn up<T: DeviceRepr>(g: &Gpu, v: &[T]) -> DevBuf<T> {
    g.upload(v, "test input").expect("upload")
}

/// `n` f32 of device memory filled with NaN (0xffffffff).
pub fn poisoned(g: &Gpu, n: usize) -> DevBuf<f32> {
    let b = g.alloc::<f32>(n, "test output").expect("alloc");
    g.memset(b.ptr(), 0xff, b.bytes()).expect("poison");
    b
}

/// `n` elements of device memory with every byte `byte`.
pub fn filled<T: DeviceRepr + ValidAsZeroBits>(g: &Gpu, n: usize, byte: u8) -> DevBuf<T> {
    let b = g.alloc::<T>(n, "test output").expect("alloc");
    g.memset(b.ptr(), byte, b.bytes()).expect("fill");
    b
}

pub fn down<T: DeviceRepr + Default + Clone>(g: &Gpu, b: &DevBuf<T>) -> Vec<T> {
    g.download(b.ptr(), b.len()).expect("download")
}

/// Softmax in f64 of q against each of `keys` (scores q·k·`scale`): the weights,
/// summing to 1 (the attention references' common step).
pub fn softmax_f64<'a>(q: &[f32], keys: impl Iterator<Item = &'a [f32]>, scale: f64) -> Vec<f64> {
    let s: Vec<f64> = keys
        .map(|k| {
            q.iter()
                .zip(k)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|v| v / z).collect()
}

/// Bit-for-bit equality, reporting the first differences and how many there are.
pub fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    if !bad.is_empty() {
        let show: Vec<String> = bad
            .iter()
            .take(5)
            .map(|&i| {
                let unwritten = if got[i].to_bits() == u32::MAX {
                    " (never written)"
                } else {
                    ""
                };
                format!(
                    "[{i}] gpu {:e} ({:#010x}){unwritten} vs cpu {:e} ({:#010x})",
                    got[i],
                    got[i].to_bits(),
                    want[i],
                    want[i].to_bits()
                )
            })
            .collect();
        panic!(
            "{what}: {} of {} values differ: {}",
            bad.len(),
            got.len(),
            show.join("; ")
        );
    }
}

/// Room on the device for a kernel to write the quantized copy of `n` values, poisoned
/// (-128 is not a quantized value, NaN not a scale, 0x80808080 not a sum).
pub struct QOut {
    pub qs: DevBuf<i8>,
    pub d: DevBuf<f32>,
    pub sums: DevBuf<i32>,
}

impl QOut {
    pub fn new(g: &Gpu, n: usize) -> QOut {
        QOut {
            qs: filled(g, n, 0x80),
            d: poisoned(g, n / 32),
            sums: filled(g, n / 32, 0x80),
        }
    }
    pub fn q(&self) -> ActQ8 {
        ActQ8 {
            qs: self.qs.ptr(),
            d: self.d.ptr(),
            sums: self.sums.ptr(),
        }
    }
    /// Holds `quant::quantize_act` of each `cols`-value row of `want`, bit for bit.
    pub fn assert_quantizes(&self, g: &Gpu, want: &[f32], cols: usize, what: &str) {
        let (qs, d, sums) = (down(g, &self.qs), down(g, &self.d), down(g, &self.sums));
        let nb = cols / 32;
        for (r, row) in want.chunks_exact(cols).enumerate() {
            let w = quant::quantize_act(row);
            assert_eq!(
                &qs[r * cols..(r + 1) * cols],
                &w.qs[..],
                "qs of row {r}: {what}"
            );
            assert_bits(
                &d[r * nb..(r + 1) * nb],
                &w.d,
                &format!("d of row {r}: {what}"),
            );
            assert_eq!(
                &sums[r * nb..(r + 1) * nb],
                &w.sums[..],
                "sums of row {r}: {what}"
            );
        }
    }
}

/// Activations quantized on the CPU, uploaded in the device layout (rows concatenated).
pub struct DevActQ8 {
    pub qs: DevBuf<i8>,
    pub d: DevBuf<f32>,
    pub sums: DevBuf<i32>,
}

impl DevActQ8 {
    pub fn upload(g: &Gpu, rows: &[quant::ActQ8]) -> DevActQ8 {
        let qs: Vec<i8> = rows.iter().flat_map(|r| r.qs.iter().copied()).collect();
        let d: Vec<f32> = rows.iter().flat_map(|r| r.d.iter().copied()).collect();
        let sums: Vec<i32> = rows.iter().flat_map(|r| r.sums.iter().copied()).collect();
        DevActQ8 {
            qs: up(g, &qs),
            d: up(g, &d),
            sums: up(g, &sums),
        }
    }
    pub fn q(&self) -> ActQ8 {
        ActQ8 {
            qs: self.qs.ptr(),
            d: self.d.ptr(),
            sums: self.sums.ptr(),
        }
    }
}

#[test]
fn without_a_driver_the_error_says_what_to_do() {
    // Runs everywhere: on a machine without the driver this checks the message; on
    // the GPU machine it checks that the device is found.
    match Gpu::device_count() {
        Err(cuda::CudaError::NoDriver) => {
            let msg = cuda::CudaError::NoDriver.to_string();
            assert!(
                msg.contains("libcuda.so") && msg.contains("--device cpu"),
                "{msg}"
            );
            assert!(
                std::env::var("SCORIA_REQUIRE_GPU").map_or(true, |v| v != "1"),
                "SCORIA_REQUIRE_GPU=1: {msg}"
            );
        }
        Err(e) => {
            assert!(
                std::env::var("SCORIA_REQUIRE_GPU").map_or(true, |v| v != "1"),
                "SCORIA_REQUIRE_GPU=1: {e}"
            );
            eprintln!("SKIP: {e}");
        }
        Ok(n) => {
            if n == 0 {
                assert!(
                    std::env::var("SCORIA_REQUIRE_GPU").map_or(true, |v| v != "1"),
                    "no CUDA device"
                );
                return;
            }
            let err = Gpu::open(n + 2).expect_err("a device past the count");
            assert_eq!(
                err.to_string(),
                format!("CUDA device {} does not exist ({n} found)", n + 2)
            );
        }
    }
    assert!(cuda::compiled());
}
