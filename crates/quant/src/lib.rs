//! Quantized block formats: layouts, dequantization and CPU dot kernels.
//!
//! # The canonical reduction order (invariant 1)
//!
//! This is the one place where the arithmetic of every decode-path dot product is
//! defined. The scalar kernels (`scalar.rs`) are its literal transcription; the AVX2
//! and AVX-512 kernels, and the GPU kernels, must perform exactly these float
//! operations in this order, so that results are bit-identical wherever a row is
//! computed. Integer parts are exact, so *how* an integer is computed is free; every
//! float operation below is fixed. "fma" means one fused multiply-add with a single
//! rounding (`f32::mul_add`, `_mm256_fmadd_ps`, `__fmaf_rn`); a product written `a * b`
//! is rounded on its own and never fused.
//!
//! **Activation quantization** ([`quantize_act`]), per 32-value block of x:
//! `amax = max |x_i|` (exact); `d = amax / 127` (f32 division);
//! `id = if d == 0 { 0 } else { 1 / d }`;
//! `q_i = clamp(round_half_even(x_i * id), -127, 127)` as i8; `sum = Σ q_i` (i32).
//! The block stores `d` (f32) and `sum`.
//!
//! **Sub-blocks.** A weight row of `n_cols` values is cut into sub-blocks of 32 values,
//! s = 0..n_cols/32 (a 32-value block — Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 — is
//! one sub-block; NVFP4's 64-value block is 2; a 256-value block — the K-quants, the IQ
//! types, TQ1_0, TQ2_0 — is 8). Sub-block s meets activation block s: `a` = its int8 values,
//! `da` = its scale, `asum` = its integer sum. Each sub-block yields one f32
//! contribution `c` (d, dmin and the f16 block scales are converted to f32 exactly):
//!
//! | type | exact integer part | float sequence |
//! |---|---|---|
//! | Q8_0 | `isum = Σ q·a` (q int8) | `c = (d * da) * isum` |
//! | Q4_0 | `isum = Σ (q - 8)·a` | `c = (d * da) * isum` |
//! | Q4_K, Q5_K | `is = sc · Σ q·a`, `im = m · asum` (sc, m: the sub-block's 6-bit scale and min; q: 0..15 / 0..31) | `c = (d * da) * is`; `c = fma(-(dmin * da), im, c)` |
//! | Q6_K | `isum = sc_lo · Σ_{i<16} q·a + sc_hi · Σ_{i≥16} q·a` (q: -32..31; sc_lo, sc_hi: the two int8 scales of the sub-block's 16-value groups) | `c = (d * da) * isum` |
//! | IQ4_XS | `isum = (ls - 32) · Σ K[q]·a` | `c = (d * da) * isum` |
//!
//! **The low-bit types** (`lowbit.rs`) are written in one form. Each value has an
//! integer weight w, each 16-value half h of the sub-block an integer multiplier
//! `mul_h`, and the sub-block a float scale D (with a minimum: E); then
//! `is = mul_0 · Σ_{i<16} w·a + mul_1 · Σ_{i≥16} w·a` and
//!
//! | type | w | mul_0, mul_1 | D | float sequence |
//! |---|---|---|---|---|
//! | Q2_K | q (0..3) | the halves' 4-bit scales sc | d | `c = (D * da) * is`; `c = fma(E * da, ie, c)` with E = −dmin, `ie = m_0 · Σ_{i<16} a + m_1 · Σ_{i≥16} a` (m: the halves' 4-bit mins) |
//! | Q3_K | q (−4..3) | the halves' scales s − 32 | d | `c = (D * da) * is` |
//! | Q4_1, Q5_1 | q (0..15 / 0..31) | 1 | d | `c = (D * da) * is`; `c = fma(E * da, asum, c)` with E = m |
//! | Q5_0 | q − 16 | 1 | d | `c = (D * da) * is` |
//! | IQ4_NL | `K[q]` | 1 | d | same |
//! | MXFP4 | `K2[q]` (doubled e2m1 levels: 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12) | 1 | 2^(e − 128) | same |
//! | TQ1_0, TQ2_0 | q (−1..1 / −1..2) | 1 | d | same |
//! | IQ2_XXS | grid · sign | 2·ls + 1 (one per sub-block) | d / 8 | same |
//! | IQ2_XS, IQ2_S | grid · sign | the halves' 2·ls + 1 | d / 8 | same |
//! | IQ3_XXS | grid · sign | 2·ls + 1 | d / 4 | same |
//! | IQ3_S | grid · sign | 1 + 2·sc | d | same |
//! | IQ1_S | 8·grid ± 1 (the sign of δ) | 2·s + 1 | d / 8 | same |
//! | IQ1_M | 8·grid ± 1 (each row's δ) | the halves' 2·s + 1 | d / 8 | same |
//! | NVFP4 | `K2[q]` | 1, 0 | the first 16 values' scale | `c = (D * da) * is`; `c = fma(E * da, ie, c)` with E the second 16 values' scale, `ie = Σ_{i≥16} w·a` |
//!
//! D is exact: an f16 (or e8m0) scale converted to f32 times a power of two (NVFP4's
//! scales are unsigned e4m3 bytes, halved: `(8 + m) · 2^(e − 11)`, or `m · 2^-10` for
//! e = 0). The types whose scales are per 16 values (Q2_K, Q3_K, IQ2_XS, IQ2_S, IQ1_M)
//! keep both halves in the *integer* part, so every type has one float sequence per
//! 32-value sub-block. NVFP4 alone has *float* scales per 16 values (two e4m3 scales
//! can be 2^15 apart, beyond any integer multiplier): its second half is the float
//! step E. The integer weights and multipliers are each layout's dequantization
//! formula with the common float factor taken out (`y = D · mul · w` for the
//! multiplier of the value's half, plus the minimum: IQ2's `d · (0.5 + ls) / 4 ·
//! grid · sign` is `d/8 · (2·ls + 1) · (grid · sign)`, IQ1's `d · (2s + 1) · (grid ±
//! 1/8)` is `d/8 · (2s + 1) · (8·grid ± 1)`). Bounds: |w| ≤ 127, |mul| ≤ 32, |is| <
//! 2^23 (IQ3_XXS: 31 · 62 · 127 · 32), |ie| < 2^16.
//!
//! Every integer above is below 2^24 in magnitude, so its conversion to f32 is exact.
//!
//! **Accumulation.** 32 accumulators start at +0.0; accumulator l takes sub-blocks
//! l, l+32, l+64, ... in increasing order: `acc[s % 32] = acc[s % 32] + c` (one f32 add).
//!
//! **Float weights** (F32, F16, BF16; x is used unquantized; F16/BF16 widen exactly):
//! accumulator l takes *elements* l, l+32, l+64, ... in increasing order as
//! `acc[l] = fma(w_i, x_i, acc[l])`.
//!
//! **Combine.** For w = 16, 8, 4, 2, 1: `acc[l] = acc[l] + acc[l + w]` for l < w;
//! the result is `acc[0]`.
//!
//! For quantized types `n_cols` must be a multiple of 32 (256 for the 256-value block
//! types): a whole number of blocks and of 32-value sub-blocks. Float rows may have
//! any length (checkpoints have e.g. 6 heads of 40 = 240 values): the rule above puts
//! every element in its accumulator whether or not the last group of 32 is full, and
//! the SIMD kernels finish a partial last group with the scalar fmas.
//!
//! **For other implementations (CUDA).** Compile without contraction or spell every
//! operation out (`__fmul_rn`, `__fadd_rn`, `__fmaf_rn`, `__fdiv_rn`, `__frcp_rn` or
//! `1.0f / d` with IEEE division; nvcc contracts `a * b + c` into an FMA by default);
//! no flush-to-zero (subnormals occur: `d * da` of small scales); `__float2int_rn`
//! or `rintf` for round-half-to-even. A warp maps lane l to accumulator l and combines
//! with `acc += __shfl_xor_sync(.., acc, w)` for w = 16, 8, 4, 2, 1 (addition is
//! commutative, so lane l computing `acc[l^w] + acc[l]` gives the same bits).
//! Bit-identity is guaranteed for finite activations; NaN/inf inputs give
//! unspecified (but memory-safe) results.
//!
//! # Kernels
//!
//! One scalar reference, AVX2 (+FMA, F16C), AVX-512 without VNNI (F, BW, VL) and
//! AVX-512 with VNNI kernels, chosen once at run time ([`kernel_isa`]), and above
//! them AMX-INT8 for prompt matmuls (`amx.rs`: the tile unit computes the exact
//! integer dots of 16 rows × 16 tokens, AVX-512 the float sequence);
//! `SCORIA_ISA=scalar|avx2|avx512bw|avx512|amx` forces a lower level. Tests check every
//! level the CPU has against the scalar kernels bit for bit. The low-bit types have one
//! kernel body per level over their canonical integer form (`lowbit_simd.rs`); they
//! have no AMX kernel, and their prompt matmuls at the AMX level run on the AVX-512
//! kernels.
//!
//! **Many tokens** ([`matmul`], prompt processing). The quantized AVX2 and AVX-512
//! kernels are generic over a tile of N tokens (N = 1 is the single-row dot): each
//! weight block is unpacked once and every token of the tile then runs the sequence
//! above into its own 32 accumulators. Only the loop order differs, so every
//! (row, token) is bit-identical to [`matvec`]. Two exact re-arrangements make the
//! per-token work small: the activations are re-laid out once per call (and each
//! weight block once per tile, the same way) so that a sub-block's integer dot is a
//! vertical sum instead of a horizontal reduction (integers: any order is exact);
//! and AVX-512 runs the elementwise float sequence of two tokens in one 16-lane
//! vector (lanes 0..7 token a, 8..15 token b: the same operations per lane).

// Kernels index several arrays by the same lane/sub-block number; index loops say that best.
#![allow(clippy::needless_range_loop)]

/// A many-token kernel: `out[t]` = the row · token t (`xqs[t]`), bit-identical to the
/// single-row dot of that token; `xqs.len() == out.len()`. `ta[t]` is token t's
/// activations in the kernel's layout ([`Multi::layout`] of `xqs[t].qs`).
pub(crate) type MultiFn = fn(&[u8], &[ActQ8], &[Vec<i8>], &mut [f32]);

/// Builds the activation layout a many-token kernel reads from one token's `qs`.
pub(crate) type LayoutFn = fn(&[i8]) -> Vec<i8>;

/// A many-token kernel and the activation layout it reads.
#[derive(Clone, Copy)]
pub(crate) struct Multi {
    pub f: MultiFn,
    /// Built once per token and call, shared by every row.
    pub layout: LayoutFn,
}

/// A safe [`Multi`] around an unsafe target-feature kernel
/// `$f::<N, true>(row, [&ActQ8; N], [&[i8]; N]) -> [f32; N]` that reads `$layout`
/// activations, run on tiles of the listed sizes (descending, ending with 1). The
/// caller's SAFETY note covers the unsafe call.
#[cfg(target_arch = "x86_64")]
macro_rules! multi_wrap {
    ($f:ident, $layout:path, $($n:literal),+) => {{
        fn w(row: &[u8], xqs: &[ActQ8], ta: &[Vec<i8>], out: &mut [f32]) {
            assert!(xqs.len() == out.len() && ta.len() == out.len());
            let mut t = 0;
            $(
                while xqs.len() - t >= $n {
                    let tile: [&ActQ8; $n] = std::array::from_fn(|i| &xqs[t + i]);
                    let tt: [&[i8]; $n] = std::array::from_fn(|i| ta[t + i].as_slice());
                    let r = unsafe { $f::<$n, true>(row, tile, tt) };
                    out[t..t + $n].copy_from_slice(&r);
                    t += $n;
                }
            )+
        }
        Multi { f: w, layout: $layout }
    }};
}

mod act;
#[cfg(target_arch = "x86_64")]
mod amx;
mod avx2;
mod avx512;
mod formats;
mod grids;
mod isa;
mod lowbit;
mod lowbit_quantize;
mod lowbit_simd;
pub mod par;
mod scalar;

pub use gguf::GgmlType;
pub use isa::{kernel_isa, Isa};
pub use lowbit_quantize::nvfp4_scale_byte;

/// The accumulators of the canonical order.
pub const LANES: usize = 32;

/// The canonical order's **Combine** (the crate docs): `acc[l] = acc[l] + acc[l + w]`
/// for w = 16, 8, 4, 2, 1 and l < w; the result is `acc[0]`. Every scalar kernel here
/// and every canonical sum of `model::math` ends with it.
#[inline]
pub fn combine_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Activations quantized once per step into 32-value blocks (see the crate docs):
/// `qs` holds one int8 per value, `d` and `sums` one entry per 32-value block.
#[derive(Debug, Clone, Default)]
pub struct ActQ8 {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub sums: Vec<i32>,
}

/// Why a quant operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("tensor type {0} has no CPU kernel")]
    Unsupported(GgmlType),
    #[error(
        "{ty}: a row of {n_cols} columns is not a whole number of blocks (and 32-value sub-blocks)"
    )]
    BadColumns { ty: GgmlType, n_cols: usize },
    #[error("{what}: expected {expected} elements/bytes, got {got}")]
    BadLength {
        what: &'static str,
        expected: usize,
        got: usize,
    },
}

/// True exactly for the types that have dequantization and dot kernels.
pub fn is_supported(ty: GgmlType) -> bool {
    use GgmlType as T;
    matches!(
        ty,
        T::F32 | T::F16 | T::BF16 | T::Q8_0 | T::Q4_0 | T::Q4_K | T::Q5_K | T::Q6_K | T::IQ4_XS
    ) || lowbit::spec(ty).is_some()
}

/// Every type with kernels: the float types, then the quantized types in the order of
/// the canonical-order table.
pub const SUPPORTED: [GgmlType; 26] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::NVFP4,
];

fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Bytes of one row of `n_cols` values of `ty`, checking that the type has kernels
/// and that the dot kernels can run such a row: any length for F32/F16/BF16, a whole
/// number of blocks and of 32-value sub-blocks for quantized types.
pub fn row_bytes(ty: GgmlType, n_cols: usize) -> Result<usize, QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    match ty.row_bytes(n_cols) {
        Some(b) if is_float(ty) || n_cols.is_multiple_of(32) => Ok(b),
        _ => Err(QuantError::BadColumns { ty, n_cols }),
    }
}

/// Bytes of `n` stored values: a whole number of blocks. Dequantization and
/// quantization need only this; the dot kernels also need 32-value sub-blocks
/// (`row_bytes`), so vectors of any length (conv taps, norms) still convert.
fn storage_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    ty.row_bytes(n)
        .ok_or(QuantError::BadColumns { ty, n_cols: n })
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), QuantError> {
    if expected == got {
        Ok(())
    } else {
        Err(QuantError::BadLength {
            what,
            expected,
            got,
        })
    }
}

fn check_act(ty: GgmlType, n_cols: usize, x: &[f32], xq: &ActQ8) -> Result<(), QuantError> {
    if is_float(ty) {
        check_len("x", n_cols, x.len())
    } else {
        check_len("xq.qs", n_cols, xq.qs.len())?;
        check_len("xq.d", n_cols / 32, xq.d.len())?;
        check_len("xq.sums", n_cols / 32, xq.sums.len())
    }
}

/// Quantizes `x` (length a multiple of 32) as the crate docs define.
///
/// Panics when `x.len()` is not a multiple of 32.
pub fn quantize_act(x: &[f32]) -> ActQ8 {
    assert!(
        x.len().is_multiple_of(32),
        "quantize_act: {} values is not a multiple of 32",
        x.len()
    );
    act::quantize(isa::active(), x)
}

/// [`quantize_act`] with an explicit kernel level (for tests and benchmarks).
///
/// Panics when `x.len()` is not a multiple of 32 or `isa` is not available on this CPU.
pub fn quantize_act_with(isa: Isa, x: &[f32]) -> ActQ8 {
    assert!(
        x.len().is_multiple_of(32),
        "quantize_act: {} values is not a multiple of 32",
        x.len()
    );
    assert!(
        isa.is_available(),
        "kernel level {isa} is not available on this CPU"
    );
    act::quantize(isa, x)
}

/// A selected dot kernel: quantized rows read `ActQ8`, float rows read x.
#[derive(Clone, Copy)]
pub(crate) enum Kernel {
    Q(fn(&[u8], &ActQ8) -> f32),
    F(fn(&[u8], &[f32]) -> f32),
    /// A quantized kernel with a loop over rows: the single-row dot, and
    /// `rows(rb, w, xq, out)`, which is [`dot_rows`] of it (the same bits) in one
    /// call, so that short rows pay the call once per chunk of rows, not per row.
    QRows(fn(&[u8], &ActQ8) -> f32, RowsFn),
}

/// `out[i]` = row i of `w` (rows of `rb` bytes, `out.len()` of them) · xq, with the
/// prefetches of [`RowPrefetch`].
pub(crate) type RowsFn = fn(usize, &[u8], &ActQ8, &mut [f32]);

impl Kernel {
    #[inline]
    fn dot(self, row: &[u8], x: &[f32], xq: &ActQ8) -> f32 {
        match self {
            Kernel::Q(f) | Kernel::QRows(f, _) => f(row, xq),
            Kernel::F(f) => f(row, x),
        }
    }
}

fn kernel(isa: Isa, ty: GgmlType) -> Kernel {
    if lowbit::spec(ty).is_some() {
        let k = match isa {
            Isa::Avx512 | Isa::Amx => lowbit_simd::avx512_kernel(ty, isa::avx512_proof()),
            Isa::Avx512Bw => lowbit_simd::avx512bw_kernel(ty, isa::avx512bw_proof()),
            Isa::Avx2 => lowbit_simd::avx2_kernel(ty, isa::avx2_proof()),
            Isa::Scalar => None,
        };
        return k.unwrap_or_else(|| scalar_kernel(ty));
    }
    match isa {
        // AMX differs from AVX-512 only in prompt matmuls (`try_matmul_with`).
        Isa::Avx512 | Isa::Amx => avx512::vnni_kernel(ty, isa::avx512_proof()),
        Isa::Avx512Bw => avx512::bw_kernel(ty, isa::avx512bw_proof()),
        Isa::Avx2 => avx2::kernel(ty, isa::avx2_proof()),
        Isa::Scalar => scalar_kernel(ty),
    }
}

/// The many-token kernel of `ty` at `isa`, where one exists (else `matmul` runs the
/// single-row kernel per token).
fn multi_kernel(isa: Isa, ty: GgmlType) -> Option<Multi> {
    if lowbit::spec(ty).is_some() {
        // The low-bit types have no AMX kernel: their prompts run on AVX-512.
        return match isa {
            Isa::Avx512 | Isa::Amx => lowbit_simd::avx512_multi(ty, isa::avx512_proof()),
            Isa::Avx512Bw => lowbit_simd::avx512bw_multi(ty, isa::avx512bw_proof()),
            Isa::Avx2 => lowbit_simd::avx2_multi(ty, isa::avx2_proof()),
            Isa::Scalar => None,
        };
    }
    match isa {
        Isa::Avx512 | Isa::Amx => avx512::vnni_multi(ty, isa::avx512_proof()),
        Isa::Avx512Bw => avx512::bw_multi(ty, isa::avx512bw_proof()),
        Isa::Avx2 => avx2::multi(ty, isa::avx2_proof()),
        Isa::Scalar => None,
    }
}

fn scalar_kernel(ty: GgmlType) -> Kernel {
    use GgmlType as T;
    match ty {
        T::F32 => Kernel::F(scalar::dot_f32),
        T::F16 => Kernel::F(scalar::dot_f16),
        T::BF16 => Kernel::F(scalar::dot_bf16),
        T::Q8_0 => Kernel::Q(scalar::dot_q8_0),
        T::Q4_0 => Kernel::Q(scalar::dot_q4_0),
        T::Q4_K => Kernel::Q(scalar::dot_q4_k),
        T::Q5_K => Kernel::Q(scalar::dot_q5_k),
        T::Q6_K => Kernel::Q(scalar::dot_q6_k),
        T::IQ4_XS => Kernel::Q(scalar::dot_iq4_xs),
        other => match lowbit::scalar_kernel(other) {
            Some(f) => Kernel::Q(f),
            None => unreachable!("no kernel for {other}: callers check is_supported"),
        },
    }
}

/// Dot product of one row (`row.len()` bytes of `ty`) with x, using the active kernel level.
/// `xq` must be `quantize_act(x)` for quantized types; x is used only for float types.
pub fn try_dot_with(
    isa: Isa,
    ty: GgmlType,
    row: &[u8],
    x: &[f32],
    xq: &ActQ8,
) -> Result<f32, QuantError> {
    assert!(
        isa.is_available(),
        "kernel level {isa} is not available on this CPU"
    );
    let n_cols = if is_float(ty) { x.len() } else { xq.qs.len() };
    check_len("row", row_bytes(ty, n_cols)?, row.len())?;
    check_act(ty, n_cols, x, xq)?;
    Ok(kernel(isa, ty).dot(row, x, xq))
}

/// [`try_dot_with`] with an explicit kernel level, panicking on a shape error.
pub fn dot_with(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32], xq: &ActQ8) -> f32 {
    try_dot_with(isa, ty, row, x, xq).unwrap_or_else(|e| panic!("quant::dot: {e}"))
}

/// Dot product of a single row with x (canonical order, active kernel level).
/// Panics on a shape error (the loader validates shapes before calling).
pub fn dot(ty: GgmlType, row: &[u8], x: &[f32], xq: &ActQ8) -> f32 {
    dot_with(isa::active(), ty, row, x, xq)
}

/// How far ahead of the row being read a row loop asks for its weights (bytes).
/// Decode is a stream of weights through short loops, and the hardware prefetchers
/// alone left each core's stream short of the RAM bandwidth: on the GPU machine's
/// 16-core Xeon, Q35 CPU decode went from 27.5 to 30–34 t/s with 512–8192 bytes
/// ahead (4096 the steadiest), and the development machine's EPYC gained about 12%
/// (bench/RESULTS.md, 2026-12-02 session 24). `scoria bench`'s RAM measurement reads
/// this far ahead too.
pub const PREFETCH_AHEAD: usize = 4096;

/// Asks the CPU to bring every 64-byte line of `data` into its caches: a hint (no
/// value changes, nothing is read that the program sees); nothing on other than x86-64.
#[inline]
pub fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let (start, len) = (data.as_ptr().cast::<u8>(), std::mem::size_of_val(data));
        for at in (0..len).step_by(64) {
            // SAFETY: the address is inside `data`, and a prefetch reads nothing.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(start.add(at).cast());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// `out[i]` = row i of `w` (rows of `rb` bytes) · x, with the bytes
/// [`PREFETCH_AHEAD`] past each row's start (one row's worth, within `w`) requested
/// before its dot: a hint, so the values are those of the plain loop.
#[inline]
fn dot_rows(k: Kernel, rb: usize, w: &[u8], x: &[f32], xq: &ActQ8, out: &mut [f32]) {
    if let Kernel::QRows(_, rows) = k {
        return rows(rb, w, xq, out);
    }
    for (i, (o, row)) in out.iter_mut().zip(w.chunks_exact(rb)).enumerate() {
        prefetch_row(w, i, rb);
        *o = k.dot(row, x, xq);
    }
}

/// The prefetch of [`dot_rows`] before row i (of `rb` bytes) of `w`.
#[inline]
fn prefetch_row(w: &[u8], i: usize, rb: usize) {
    let ahead = (i * rb + PREFETCH_AHEAD).min(w.len());
    prefetch(&w[ahead..(ahead + rb).min(w.len())]);
}

/// [`dot_rows`]'s prefetches for a loop over rows in order, each 64-byte line asked
/// for once: before row i, the lines up to [`PREFETCH_AHEAD`] past its end that
/// were not asked for yet (the same bytes as `dot_rows`, without its per-row
/// bounds arithmetic and the repeats of lines two rows share). A hint only.
pub(crate) struct RowPrefetch<'a> {
    w: &'a [u8],
    next: usize,
}

impl<'a> RowPrefetch<'a> {
    #[inline]
    pub(crate) fn new(w: &'a [u8]) -> Self {
        RowPrefetch {
            w,
            next: PREFETCH_AHEAD.min(w.len()),
        }
    }

    /// Before the row that ends at byte `end` of `w`.
    #[inline]
    pub(crate) fn before_row_ending(&mut self, end: usize) {
        let to = (end + PREFETCH_AHEAD).min(self.w.len());
        if self.next < to {
            prefetch(&self.w[self.next..to]);
            self.next = (to + 63) & !63;
        }
    }
}

/// Rows handed to one task: enough work to amortise the task, few enough to balance.
fn rows_per_task(n_rows: usize, row_bytes: usize) -> usize {
    let threads = par::threads();
    let by_balance = n_rows.div_ceil(threads * 4);
    let by_size = (16 * 1024usize).div_ceil(row_bytes.max(1));
    by_balance.max(by_size).max(1)
}

/// `out[r] = row r of w · x` for `out.len()` rows of `n_cols` values of `ty`, with an
/// explicit kernel level.
pub fn try_matvec_with(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    x: &[f32],
    xq: &ActQ8,
    out: &mut [f32],
) -> Result<(), QuantError> {
    matvec_rows(isa, ty, w, n_cols, x, xq, out, true)
}

/// [`try_matvec`] on the calling thread alone (for callers that spread rows over
/// their own threads): the same bits, row by row.
pub fn try_matvec_serial(
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    x: &[f32],
    xq: &ActQ8,
    out: &mut [f32],
) -> Result<(), QuantError> {
    matvec_rows(isa::active(), ty, w, n_cols, x, xq, out, false)
}

/// The rows of [`try_matvec_with`]: in parallel ([`par`]) when `parallel` and the
/// matrix is larger than 64 KiB, else on the calling thread.
#[allow(clippy::too_many_arguments)]
fn matvec_rows(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    x: &[f32],
    xq: &ActQ8,
    out: &mut [f32],
    parallel: bool,
) -> Result<(), QuantError> {
    assert!(
        isa.is_available(),
        "kernel level {isa} is not available on this CPU"
    );
    let rb = row_bytes(ty, n_cols)?;
    check_len("w", out.len() * rb, w.len())?;
    check_act(ty, n_cols, x, xq)?;
    let k = kernel(isa, ty);
    if !parallel || out.len() * rb <= 64 * 1024 {
        dot_rows(k, rb, w, x, xq, out);
        return Ok(());
    }
    let per = rows_per_task(out.len(), rb);
    let mut tasks: Vec<(&mut [f32], &[u8])> = out.chunks_mut(per).zip(w.chunks(per * rb)).collect();
    par::for_each_mut(&mut tasks, |_, (o, wc)| dot_rows(k, rb, wc, x, xq, o));
    Ok(())
}

/// [`try_matvec_with`] at the active kernel level.
pub fn try_matvec(
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    x: &[f32],
    xq: &ActQ8,
    out: &mut [f32],
) -> Result<(), QuantError> {
    try_matvec_with(isa::active(), ty, w, n_cols, x, xq, out)
}

/// `out[r]` = row r of `w` (n_cols columns, `out.len()` rows, type `ty`) · x.
/// `xq` must be `quantize_act(x)` when `ty` is a quantized type; it is ignored for F32/F16/BF16.
/// Rayon-parallel over rows. Panics on a shape error (the loader validates shapes first).
pub fn matvec(ty: GgmlType, w: &[u8], n_cols: usize, x: &[f32], xq: &ActQ8, out: &mut [f32]) {
    try_matvec(ty, w, n_cols, x, xq, out).unwrap_or_else(|e| panic!("quant::matvec: {e}"))
}

/// [`matvec`] with an explicit kernel level, panicking on a shape error.
pub fn matvec_with(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    x: &[f32],
    xq: &ActQ8,
    out: &mut [f32],
) {
    try_matvec_with(isa, ty, w, n_cols, x, xq, out).unwrap_or_else(|e| panic!("quant::matvec: {e}"))
}

/// One matrix-vector product of a [`matvec_many`] batch.
pub struct MatvecJob<'a> {
    pub ty: GgmlType,
    /// `out.len()` rows of `n_cols` values.
    pub w: &'a [u8],
    pub n_cols: usize,
    /// Read for float types (may be empty otherwise).
    pub x: &'a [f32],
    /// `quantize_act(x)` for quantized types (ignored for float types).
    pub xq: &'a ActQ8,
    pub out: &'a mut [f32],
}

/// Several independent matvecs (e.g. the gate and up projections of every routed
/// expert of a token) in one parallel region, so that small matrices do not each
/// pay for a fork-join. Each job's result is bit-identical to [`matvec`] on it.
/// Nothing is computed unless every job's shapes are valid.
pub fn try_matvec_many_with(isa: Isa, jobs: &mut [MatvecJob<'_>]) -> Result<(), QuantError> {
    assert!(
        isa.is_available(),
        "kernel level {isa} is not available on this CPU"
    );
    for j in jobs.iter() {
        let rb = row_bytes(j.ty, j.n_cols)?;
        check_len("w", j.out.len() * rb, j.w.len())?;
        check_act(j.ty, j.n_cols, j.x, j.xq)?;
    }
    let threads = par::threads();
    let total: usize = jobs.iter().map(|j| j.w.len()).sum();
    // Tasks of about total / (4 · threads) bytes, at least 16 KiB.
    let task_bytes = (total / (threads * 4)).max(16 * 1024);
    let mut tasks = Vec::new();
    for j in jobs.iter_mut() {
        let rb = row_bytes(j.ty, j.n_cols)?;
        let per = (task_bytes / rb).max(1);
        let k = kernel(isa, j.ty);
        for (o, wc) in j.out.chunks_mut(per).zip(j.w.chunks(per * rb)) {
            tasks.push((k, rb, wc, j.x, j.xq, o));
        }
    }
    let run = |(k, rb, wc, x, xq, o): &mut (Kernel, usize, &[u8], &[f32], &ActQ8, &mut [f32])| {
        dot_rows(*k, *rb, wc, x, xq, o)
    };
    if tasks.len() <= 1 || total <= 64 * 1024 {
        tasks.iter_mut().for_each(run);
    } else {
        par::for_each_mut(&mut tasks, |_, t| run(t));
    }
    Ok(())
}

/// [`try_matvec_many_with`] at the active kernel level, panicking on a shape error.
pub fn matvec_many(jobs: &mut [MatvecJob<'_>]) {
    try_matvec_many_with(isa::active(), jobs).unwrap_or_else(|e| panic!("quant::matvec_many: {e}"))
}

/// Tokens processed together against one chunk of rows (their activations stay in cache).
const TOKEN_TILE: usize = 8;

/// The fewest tokens for which a matmul of fewer than 16 tokens at the AMX level runs
/// them as one padded group of 16 on the tile unit. A group costs the same however few
/// of its 16 tokens are real, and each 16-row stripe of weights is unpacked once per
/// call; measured on the dev box, a full group is ~1.2× the AVX-512 kernels' speed and
/// a lone group of 10–11 tokens about even with them (`matvec_bench --tail`), so fewer
/// tokens go to the AVX-512 kernels.
#[cfg(target_arch = "x86_64")]
const AMX_MIN_TOKENS: usize = 12;

/// The fewest tokens of a last partial group that run padded on the tile unit after
/// whole groups: the stripes are already unpacked, so the group costs only its tile
/// products. One thread on the dev box (`matvec_bench --tail`, two runs): such a group
/// took 130–135 µs (Q4_K 512 × 2048), 94–99 µs (Q8_0 512 × 2048) and 231–358 µs
/// (Q6_K 2048 × 512) against 166–173, 141–197 and 269–294 µs for 8 tokens on the
/// AVX-512 kernels; below 8 the Q6_K case went either way between runs.
#[cfg(target_arch = "x86_64")]
const AMX_MIN_TAIL: usize = 8;

/// Many tokens against one matrix: `xs` is n_tok × n_cols (row-major), `xqs` one
/// `ActQ8` per token (may be empty for float types), `out` n_tok × n_rows (row-major).
/// Every (row, token) value is bit-identical to [`matvec`] of that token.
pub fn try_matmul_with(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    xs: &[f32],
    xqs: &[ActQ8],
    out: &mut [f32],
) -> Result<(), QuantError> {
    assert!(
        isa.is_available(),
        "kernel level {isa} is not available on this CPU"
    );
    let rb = row_bytes(ty, n_cols)?;
    let float = is_float(ty);
    let n_tok = if float {
        if n_cols == 0 {
            return Err(QuantError::BadColumns { ty, n_cols });
        }
        if !xs.len().is_multiple_of(n_cols) {
            return Err(QuantError::BadLength {
                what: "xs (n_tok × n_cols)",
                expected: xs.len().div_ceil(n_cols) * n_cols,
                got: xs.len(),
            });
        }
        xs.len() / n_cols
    } else {
        xqs.len()
    };
    if n_tok == 0 {
        return check_len("out", 0, out.len());
    }
    if !out.len().is_multiple_of(n_tok) {
        return Err(QuantError::BadLength {
            what: "out (n_tok × n_rows)",
            expected: out.len().div_ceil(n_tok) * n_tok,
            got: out.len(),
        });
    }
    let n_rows = out.len() / n_tok;
    check_len("w", n_rows * rb, w.len())?;
    if float {
        if !xqs.is_empty() {
            check_len("xqs (one per token, or none)", n_tok, xqs.len())?;
        }
    } else {
        if !xs.is_empty() {
            check_len("xs", n_tok * n_cols, xs.len())?;
        }
        for xq in xqs {
            check_act(ty, n_cols, &[], xq)?;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx && !float && amx::supports(ty) {
        // Whole groups of 16 tokens, and a last partial group unless it is small.
        let rest = n_tok % 16;
        let min = if n_tok > 16 {
            AMX_MIN_TAIL
        } else {
            AMX_MIN_TOKENS
        };
        let n_amx = if rest >= min { n_tok } else { n_tok - rest };
        if n_amx > 0 {
            let (head, tail) = out.split_at_mut(n_amx * n_rows);
            amx::matmul(ty, w, rb, &xqs[..n_amx], head, isa::amx_proof());
            if n_amx < n_tok {
                let xs_tail = if xs.is_empty() {
                    xs
                } else {
                    &xs[n_amx * n_cols..]
                };
                return try_matmul_with(Isa::Avx512, ty, w, n_cols, xs_tail, &xqs[n_amx..], tail);
            }
            return Ok(());
        }
    }
    // Tasks own disjoint weight rows. A task computes a tile of tokens for its rows
    // (row-major, so a kernel writes each row's tokens together) and copies the tile
    // into its rows' runs of `out` (tokens × rows) itself: no transpose of the whole
    // product on one thread afterwards (that had been a sixth of a prompt's time on
    // two threads without AMX, and more the more threads there are).
    let k = kernel(isa, ty);
    let empty = ActQ8::default();
    let x_of = |t: usize| -> &[f32] {
        if float {
            &xs[t * n_cols..(t + 1) * n_cols]
        } else {
            &[]
        }
    };
    let xq_of = |t: usize| -> &ActQ8 {
        if float {
            &empty
        } else {
            &xqs[t]
        }
    };
    let per = rows_per_task(n_rows, rb * n_tok.min(TOKEN_TILE));
    let multi = if float { None } else { multi_kernel(isa, ty) };
    // The layout some many-token kernels read, built once per token for every row.
    let mut ta: Vec<Vec<i8>> = Vec::new();
    if let Some(m) = multi {
        ta.resize(n_tok, Vec::new());
        par::for_each_mut(&mut ta, |t, l| *l = (m.layout)(&xqs[t].qs));
    }
    let out = par::ColumnRuns::new(out, n_rows);
    par::for_each(n_rows.div_ceil(per), |i| {
        let (r0, r1) = (i * per, ((i + 1) * per).min(n_rows));
        let wc = &w[r0 * rb..r1 * rb];
        let rows = r1 - r0;
        let mut tile = vec![0f32; rows * TOKEN_TILE];
        for t0 in (0..n_tok).step_by(TOKEN_TILE) {
            let t1 = (t0 + TOKEN_TILE).min(n_tok);
            let nt = t1 - t0;
            for r in 0..rows {
                let row = &wc[r * rb..(r + 1) * rb];
                let o = &mut tile[r * nt..(r + 1) * nt];
                match multi {
                    // Each block of the row is unpacked once for the whole tile.
                    Some(m) => (m.f)(row, &xqs[t0..t1], &ta[t0..t1], o),
                    None => {
                        for (ov, t) in o.iter_mut().zip(t0..t1) {
                            *ov = k.dot(row, x_of(t), xq_of(t));
                        }
                    }
                }
            }
            for (j, t) in (t0..t1).enumerate() {
                // SAFETY: rows r0..r1 belong to this task alone.
                let dst = unsafe { out.run(t, r0, rows) };
                for (r, d) in dst.iter_mut().enumerate() {
                    *d = tile[r * nt + j];
                }
            }
        }
    });
    Ok(())
}

/// [`try_matmul_with`] at the active kernel level.
pub fn try_matmul(
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    xs: &[f32],
    xqs: &[ActQ8],
    out: &mut [f32],
) -> Result<(), QuantError> {
    try_matmul_with(isa::active(), ty, w, n_cols, xs, xqs, out)
}

/// Prompt-time matrix product (see [`try_matmul_with`]); panics on a shape error.
pub fn matmul(ty: GgmlType, w: &[u8], n_cols: usize, xs: &[f32], xqs: &[ActQ8], out: &mut [f32]) {
    try_matmul(ty, w, n_cols, xs, xqs, out).unwrap_or_else(|e| panic!("quant::matmul: {e}"))
}

/// [`matmul`] with an explicit kernel level, panicking on a shape error.
pub fn matmul_with(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    xs: &[f32],
    xqs: &[ActQ8],
    out: &mut [f32],
) {
    try_matmul_with(isa, ty, w, n_cols, xs, xqs, out)
        .unwrap_or_else(|e| panic!("quant::matmul: {e}"))
}

/// Dequantizes one row (`dst.len()` values) from `src` (exactly that row's bytes).
pub fn try_dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_len("src", storage_bytes(ty, dst.len())?, src.len())?;
    formats::dequantize(ty, src, dst);
    Ok(())
}

/// Dequantizes one row; panics on a shape error.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    try_dequantize_row(ty, src, dst).unwrap_or_else(|e| panic!("quant::dequantize_row: {e}"))
}

/// Quantizes one row (`src.len()` values) into `dst` (exactly that row's bytes) with a
/// simple round-to-nearest quantizer (for tests and synthetic models).
pub fn try_quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_len("dst", storage_bytes(ty, src.len())?, dst.len())?;
    formats::quantize(ty, src, dst);
    Ok(())
}

/// Quantizes one row; panics on a shape error.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    try_quantize_row(ty, src, dst).unwrap_or_else(|e| panic!("quant::quantize_row: {e}"))
}
