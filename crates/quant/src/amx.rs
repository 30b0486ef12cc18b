//! AMX-INT8 prompt matmuls: the exact integer part of every sub-block on the tile unit,
//! the canonical float sequence on AVX-512.
//!
//! The crate's reduction order fixes only the float operations; each sub-block's
//! integer dot is exact however it is computed. Here one `tdpbusd` (unsigned weights:
//! Q4_K, Q5_K) or `tdpbssd` (signed: Q8_0, Q4_0, Q6_K, IQ4_XS) computes that dot for
//! 16 weight rows × 16 tokens at once, with K = 32 bytes (one sub-block; Q6_K runs its
//! two 16-value halves as two K = 16 products, because each half has its own scale).
//! The 16 × 16 int32 results go through memory into AVX-512 registers, one row at a
//! time with the 16 tokens in the lanes, and each lane then runs exactly the scalar
//! sequence of `scalar.rs` for its (row, token): the same products, the same fma, the
//! same accumulator `s % 32` in increasing s, the same combine tree. So every value is
//! bit-identical to `matvec` of that token.
//!
//! Scale products that the scalar code forms as one integer (`sc · isum`, `m · asum`,
//! `(ls - 32) · raw`, `sc_lo · lo + sc_hi · hi`) are formed here in f32 from exact
//! conversions; every such integer is below 2^24 (crate docs), so the float product
//! (and the Q6_K fma) is exact and equals the integer's conversion.
//!
//! Weights are unpacked per call, 16 rows at a time (a stripe: one byte per value plus
//! four f32 parameters per sub-block and row, 48 KiB for 2,048 columns), and reused
//! by every token group; nothing is repacked at load, so weights cost no extra memory.
//! Activations are laid out once per call in the tile unit's B layout (16 tokens ×
//! 4 consecutive bytes per 64-byte row). Missing rows and tokens of the last stripe
//! and group are zero and their results are dropped.

use std::arch::asm;
use std::arch::x86_64::*;

use rayon::prelude::*;

use crate::formats::*;
use crate::isa::AmxProof;
use crate::{ActQ8, GgmlType};

/// Weight rows per tile (the tile unit's 16 rows).
const ROWS: usize = 16;
/// Tokens per tile (16 int32 columns of a 64-byte tile row).
const TOKS: usize = 16;
/// Bytes of one sub-block's A tile (16 rows × 32 bytes) or B tile (8 rows × 64 bytes).
const TILE: usize = 512;

/// Whether `ty` has an AMX matmul.
pub(crate) fn supports(ty: GgmlType) -> bool {
    use GgmlType as T;
    matches!(
        ty,
        T::Q8_0 | T::Q4_0 | T::Q4_K | T::Q5_K | T::Q6_K | T::IQ4_XS
    )
}

/// One block format: how its sub-blocks unpack and how their contribution is formed.
trait Format {
    const BLOCK_BYTES: usize;
    /// 32-value sub-blocks per block.
    const SUBS: usize;
    /// Weights are int8 (`tdpbssd`) rather than uint8 (`tdpbusd`).
    const SIGNED: bool;
    /// Two K = 16 products per sub-block (Q6_K's two scales).
    const HALVES: bool;
    /// Writes sub-block j's 32 values to `q[j·512..j·512 + 32]` (its row of the
    /// sub-block's A tile in the stripe) and its parameters to `p[j]`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C must be available.
    unsafe fn unpack(blk: &[u8], q: &mut [u8], p: &mut [[f32; 4]; 8]);
    /// The contribution `c` of one (row, sub-block) to 16 tokens: `lo` the int32
    /// dots (`hi` the second half's, for `HALVES`), `da` and `asum` the tokens'
    /// activation scale and integer sum (as f32).
    ///
    /// # Safety
    /// AVX-512 F must be available.
    unsafe fn contrib(lo: __m512i, hi: __m512i, p: &[f32; 4], da: __m512, asum: __m512) -> __m512;
}

/// `(d * da) * isum`, the sequence of Q8_0, Q4_0, Q6_K and IQ4_XS.
#[target_feature(enable = "avx512f")]
#[inline]
fn scaled(d: f32, da: __m512, isum: __m512) -> __m512 {
    _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d), da), isum)
}

struct Q8_0;
impl Format for Q8_0 {
    const BLOCK_BYTES: usize = Q8_0_BYTES;
    const SUBS: usize = 1;
    const SIGNED: bool = true;
    const HALVES: bool = false;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn unpack(blk: &[u8], q: &mut [u8], p: &mut [[f32; 4]; 8]) {
        q[..32].copy_from_slice(&blk[2..34]);
        p[0] = [f16_at(blk, 0), 0.0, 0.0, 0.0];
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn contrib(lo: __m512i, _: __m512i, p: &[f32; 4], da: __m512, _: __m512) -> __m512 {
        scaled(p[0], da, _mm512_cvtepi32_ps(lo))
    }
}

struct Q4_0;
impl Format for Q4_0 {
    const BLOCK_BYTES: usize = Q4_0_BYTES;
    const SUBS: usize = 1;
    const SIGNED: bool = true;
    const HALVES: bool = false;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn unpack(blk: &[u8], q: &mut [u8], p: &mut [[f32; 4]; 8]) {
        for j in 0..16 {
            let v = blk[2 + j];
            q[j] = ((v & 0xF) as i8 - 8) as u8;
            q[j + 16] = ((v >> 4) as i8 - 8) as u8;
        }
        p[0] = [f16_at(blk, 0), 0.0, 0.0, 0.0];
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn contrib(lo: __m512i, _: __m512i, p: &[f32; 4], da: __m512, _: __m512) -> __m512 {
        scaled(p[0], da, _mm512_cvtepi32_ps(lo))
    }
}

/// Q4_K and Q5_K parameters of sub-block j: d, dmin, sc, m. The 6-bit scales and
/// mins of `k_scale_min`, four sub-blocks per 32-bit word: bytes 0..4 of the scales
/// hold sc (low 6 bits) of sub-blocks 0..4 and, in their top 2 bits, bits 4..6 of sc
/// of sub-blocks 4..8; bytes 4..8 likewise for m; bytes 8..12 the low 4 bits of sc
/// (low nibble) and m (high nibble) of sub-blocks 4..8.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn k_params(blk: &[u8], p: &mut [[f32; 4]; 8]) {
    let head = &blk[..16];
    // [d, dmin, 0, 0]: F16C converts exactly, as `f16_at` does.
    let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
        head[0], head[1], head[2], head[3],
    ])));
    let word = |o: usize| u32::from_le_bytes([head[4 + o], head[5 + o], head[6 + o], head[7 + o]]);
    let (a, b, c) = (word(0), word(4), word(8));
    let sc =
        (a & 0x3F3F_3F3F) as u64 | (((c & 0x0F0F_0F0F) | ((a >> 2) & 0x3030_3030)) as u64) << 32;
    let m = (b & 0x3F3F_3F3F) as u64
        | ((((c >> 4) & 0x0F0F_0F0F) | ((b >> 2) & 0x3030_3030)) as u64) << 32;
    let scv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64)));
    let mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m as i64)));
    // (sc_j, m_j) pairs: lo = j 0, 1 | 4, 5; hi = j 2, 3 | 6, 7.
    let lo = _mm256_unpacklo_ps(scv, mv);
    let hi = _mm256_unpackhi_ps(scv, mv);
    let pairs = [
        _mm256_castps256_ps128(lo),
        _mm256_castps256_ps128(hi),
        _mm256_extractf128_ps::<1>(lo),
        _mm256_extractf128_ps::<1>(hi),
    ];
    for (k, &pr) in pairs.iter().enumerate() {
        // [d, dmin, sc, m] of sub-blocks 2k and 2k + 1.
        let even = _mm_shuffle_ps::<0b01_00_01_00>(dd, pr);
        let odd = _mm_shuffle_ps::<0b11_10_01_00>(dd, pr);
        // SAFETY: each destination is a [f32; 4], 16 writable bytes.
        unsafe {
            _mm_storeu_ps(p[2 * k].as_mut_ptr(), even);
            _mm_storeu_ps(p[2 * k + 1].as_mut_ptr(), odd);
        }
    }
}

/// `c = (d * da) * (sc·isum)`, `c = fma(-(dmin * da), m·asum, c)`.
#[target_feature(enable = "avx512f")]
#[inline]
fn k_contrib(lo: __m512i, p: &[f32; 4], da: __m512, asum: __m512) -> __m512 {
    let is = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(p[2]));
    let c = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(p[0]), da), is);
    let im = _mm512_mul_ps(_mm512_set1_ps(p[3]), asum);
    // fnmadd(a, b, c) = -(a·b) + c in one rounding = fma(-a, b, c).
    _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_set1_ps(p[1]), da), im, c)
}

struct Q4K;
impl Format for Q4K {
    const BLOCK_BYTES: usize = Q4_K_BYTES;
    const SUBS: usize = 8;
    const SIGNED: bool = false;
    const HALVES: bool = false;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn unpack(blk: &[u8], q: &mut [u8], p: &mut [[f32; 4]; 8]) {
        let qs = &blk[16..144];
        for c in 0..4 {
            let (lo, hi) = q[2 * c * TILE..(2 * c + 1) * TILE + 32].split_at_mut(TILE);
            for l in 0..32 {
                let v = qs[32 * c + l];
                lo[l] = v & 0xF;
                hi[l] = v >> 4;
            }
        }
        k_params(blk, p);
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn contrib(lo: __m512i, _: __m512i, p: &[f32; 4], da: __m512, asum: __m512) -> __m512 {
        k_contrib(lo, p, da, asum)
    }
}

struct Q5K;
impl Format for Q5K {
    const BLOCK_BYTES: usize = Q5_K_BYTES;
    const SUBS: usize = 8;
    const SIGNED: bool = false;
    const HALVES: bool = false;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn unpack(blk: &[u8], q: &mut [u8], p: &mut [[f32; 4]; 8]) {
        let mut v = [0u8; QK_K];
        q5_k_values(blk, &mut v);
        for j in 0..8 {
            q[j * TILE..j * TILE + 32].copy_from_slice(&v[SUB * j..SUB * j + SUB]);
        }
        k_params(blk, p);
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn contrib(lo: __m512i, _: __m512i, p: &[f32; 4], da: __m512, asum: __m512) -> __m512 {
        k_contrib(lo, p, da, asum)
    }
}

struct Q6K;
impl Format for Q6K {
    const BLOCK_BYTES: usize = Q6_K_BYTES;
    const SUBS: usize = 8;
    const SIGNED: bool = true;
    const HALVES: bool = true;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn unpack(blk: &[u8], q: &mut [u8], p: &mut [[f32; 4]; 8]) {
        let mut v = [0i8; QK_K];
        q6_k_values(blk, &mut v);
        let d = f16_at(blk, 208);
        for j in 0..8 {
            for (o, &x) in q[j * TILE..j * TILE + 32]
                .iter_mut()
                .zip(&v[SUB * j..SUB * j + SUB])
            {
                *o = x as u8;
            }
            let (lo, hi) = (blk[192 + 2 * j] as i8, blk[193 + 2 * j] as i8);
            p[j] = [d, lo as f32, hi as f32, 0.0];
        }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn contrib(lo: __m512i, hi: __m512i, p: &[f32; 4], da: __m512, _: __m512) -> __m512 {
        // sc_lo·lo + sc_hi·hi: both products and their sum are integers below 2^24,
        // so the product and the fma are exact.
        let l = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(p[1]));
        let isum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(p[2]), l);
        scaled(p[0], da, isum)
    }
}

struct Iq4Xs;
impl Format for Iq4Xs {
    const BLOCK_BYTES: usize = IQ4_XS_BYTES;
    const SUBS: usize = 8;
    const SIGNED: bool = true;
    const HALVES: bool = false;
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn unpack(blk: &[u8], q: &mut [u8], p: &mut [[f32; 4]; 8]) {
        let d = f16_at(blk, 0);
        for j in 0..8 {
            let qs = &blk[8 + 16 * j..8 + 16 * j + 16];
            for l in 0..16 {
                q[j * TILE + l] = KVALUES_IQ4NL[(qs[l] & 0xF) as usize] as u8;
                q[j * TILE + l + 16] = KVALUES_IQ4NL[(qs[l] >> 4) as usize] as u8;
            }
            p[j] = [d, iq4_xs_scale(blk, j) as f32, 0.0, 0.0];
        }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn contrib(lo: __m512i, _: __m512i, p: &[f32; 4], da: __m512, _: __m512) -> __m512 {
        scaled(
            p[0],
            da,
            _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(p[1])),
        )
    }
}

/// The activations of one call in the tile layout, in groups of 16 tokens.
struct Acts {
    nsub: usize,
    /// `[group][sub-block][k/4][token][k%4]`: sub-block s of group g is the B tile at
    /// `(g·nsub + s)·512` (8 rows of 64 bytes; rows 0..4 and 4..8 are the halves).
    q: Vec<i8>,
    /// `[group][sub-block][token]`: the activation scale.
    da: Vec<f32>,
    /// `[group][sub-block][token]`: the activation block's integer sum, as f32 (exact).
    asum: Vec<f32>,
}

fn layout_acts(xqs: &[ActQ8], nsub: usize) -> Acts {
    let groups = xqs.len().div_ceil(TOKS);
    let mut q = vec![0i8; groups * nsub * TILE];
    let mut da = vec![0f32; groups * nsub * TOKS];
    let mut asum = vec![0f32; groups * nsub * TOKS];
    // One group of TOKS tokens (its tiles, scales and sums) per task.
    q.par_chunks_mut(nsub * TILE)
        .zip(da.par_chunks_mut(nsub * TOKS))
        .zip(asum.par_chunks_mut(nsub * TOKS))
        .enumerate()
        .for_each(|(g, ((q, da), asum))| {
            for (n, xq) in xqs[g * TOKS..].iter().take(TOKS).enumerate() {
                for s in 0..nsub {
                    let tile = &mut q[s * TILE..(s + 1) * TILE];
                    for k4 in 0..8 {
                        let src = &xq.qs[SUB * s + 4 * k4..SUB * s + 4 * k4 + 4];
                        tile[64 * k4 + 4 * n..64 * k4 + 4 * n + 4].copy_from_slice(src);
                    }
                    da[s * TOKS + n] = xq.d[s];
                    asum[s * TOKS + n] = xq.sums[s] as f32;
                }
            }
        });
    Acts { nsub, q, da, asum }
}

/// 16 weight rows unpacked: `q[s]` is sub-block s's A tile (`[row][32]`), `p[s·16 + m]`
/// row m's parameters for sub-block s.
struct Stripe {
    q: Vec<u8>,
    p: Vec<[f32; 4]>,
}

impl Stripe {
    fn new(nsub: usize) -> Stripe {
        Stripe {
            q: vec![0; nsub * TILE],
            p: vec![[0.0; 4]; nsub * ROWS],
        }
    }

    /// Unpacks `rows` (whole rows of `rb` bytes, at most 16); the missing rows are zero.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL must be available (the unpacking loops are compiled for it).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn fill<F: Format>(&mut self, rows: &[u8], rb: usize) {
        let n_rows = rows.len() / rb;
        if n_rows < ROWS {
            // Only the last stripe of a matrix is short; its missing rows compute zeros.
            self.q.fill(0);
            self.p.fill([0.0; 4]);
        }
        let mut p = [[0f32; 4]; 8];
        for (m, row) in rows.chunks_exact(rb).enumerate() {
            for (b, blk) in row.chunks_exact(F::BLOCK_BYTES).enumerate() {
                let s0 = F::SUBS * b;
                // Sub-block s0 + j of row m starts at (s0 + j)·512 + 32·m.
                // SAFETY: this function's target features are the ones `unpack` needs.
                F::unpack(blk, &mut self.q[s0 * TILE + 32 * m..], &mut p);
                for j in 0..F::SUBS {
                    self.p[(s0 + j) * ROWS + m] = p[j];
                }
            }
        }
    }
}

/// The palette-1 tile configuration: tmm0..tmm3 int32 results (16 × 16 each); tmm4,
/// tmm5 weights and tmm6, tmm7 activations, of a whole sub-block (16 rows × 32 bytes;
/// 8 rows × 64 bytes) or, for `HALVES`, of a 16-value half (16 × 16; 4 × 64).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new(halves: bool) -> TileConfig {
        let (a_cols, b_rows) = if halves { (16, 4) } else { (32, 8) };
        let mut c = [0u8; 64];
        c[0] = 1;
        for (t, rows, colsb) in [
            (0, 16, 64u16),
            (1, 16, 64),
            (2, 16, 64),
            (3, 16, 64),
            (4, 16, a_cols),
            (5, 16, a_cols),
            (6, b_rows, 64),
            (7, b_rows, 64),
        ] {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t] = rows;
        }
        TileConfig(c)
    }
}

/// Int32 results of one 16 × 16 tile, one 64-byte row per weight row.
const DOT_VECS: usize = ROWS;

/// Integer dots of `k` consecutive sub-blocks (k = 1..=4; weights at `a`, 512 bytes
/// apart, rows 32 bytes apart; activations at `b`, 512 bytes apart) into `out`, one
/// tile (`HALVES`: two) of 1 KiB per sub-block. Four sub-blocks use four result tiles
/// and alternate the operand tiles, so that the tile unit overlaps them (tiles are not
/// renamed: one register reused back to back serialises).
///
/// # Safety
/// The configuration `TileConfig::new(F::HALVES)` must be loaded on this thread; `a`
/// and `b` must point at k·512 readable bytes, `out` at k KiB (`HALVES`: 2k KiB)
/// writable ones.
#[inline(always)]
unsafe fn tile_dots<F: Format>(k: usize, a: *const u8, b: *const i8, out: *mut __m512i) {
    macro_rules! four {
        ($op:literal) => {
            asm!(
                "tilezero tmm0",
                "tileloadd tmm4, [{a} + {sa}]",
                "tileloadd tmm6, [{b} + {sb}]",
                concat!($op, " tmm0, tmm4, tmm6"),
                "tilezero tmm1",
                "tileloadd tmm5, [{a} + {sa} + 512]",
                "tileloadd tmm7, [{b} + {sb} + 512]",
                concat!($op, " tmm1, tmm5, tmm7"),
                "tilezero tmm2",
                "tileloadd tmm4, [{a} + {sa} + 1024]",
                "tileloadd tmm6, [{b} + {sb} + 1024]",
                concat!($op, " tmm2, tmm4, tmm6"),
                "tilezero tmm3",
                "tileloadd tmm5, [{a} + {sa} + 1536]",
                "tileloadd tmm7, [{b} + {sb} + 1536]",
                concat!($op, " tmm3, tmm5, tmm7"),
                "tilestored [{c} + {sb}], tmm0",
                "tilestored [{c} + {sb} + 1024], tmm1",
                "tilestored [{c} + {sb} + 2048], tmm2",
                "tilestored [{c} + {sb} + 3072], tmm3",
                a = in(reg) a,
                b = in(reg) b,
                c = in(reg) out,
                sa = in(reg) 32usize,
                sb = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    macro_rules! one {
        ($op:literal, $a:expr, $b:expr, $c:expr) => {
            asm!(
                "tilezero tmm0",
                "tileloadd tmm4, [{a} + {sa}]",
                "tileloadd tmm6, [{b} + {sb}]",
                concat!($op, " tmm0, tmm4, tmm6"),
                "tilestored [{c} + {sb}], tmm0",
                a = in(reg) $a,
                b = in(reg) $b,
                c = in(reg) $c,
                sa = in(reg) 32usize,
                sb = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    // One sub-block in halves: rows 0..16 and 16..32 of the weights (16 bytes each,
    // rows still 32 apart) against activation rows 0..4 and 4..8.
    macro_rules! halves {
        ($a:expr, $b:expr, $c:expr) => {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm4, [{a} + {sa}]",
                "tileloadd tmm6, [{b} + {sb}]",
                "tdpbssd tmm0, tmm4, tmm6",
                "tileloadd tmm5, [{a} + {sa} + 16]",
                "tileloadd tmm7, [{b} + {sb} + 256]",
                "tdpbssd tmm1, tmm5, tmm7",
                "tilestored [{c} + {sb}], tmm0",
                "tilestored [{c} + {sb} + 1024], tmm1",
                a = in(reg) $a,
                b = in(reg) $b,
                c = in(reg) $c,
                sa = in(reg) 32usize,
                sb = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    if F::HALVES {
        // Two sub-blocks per block of four result tiles.
        let mut i = 0;
        while i + 2 <= k {
            let (a, b, c) = (a.add(i * TILE), b.add(i * TILE), out.add(2 * i * DOT_VECS));
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tileloadd tmm4, [{a} + {sa}]",
                "tileloadd tmm6, [{b} + {sb}]",
                "tdpbssd tmm0, tmm4, tmm6",
                "tileloadd tmm5, [{a} + {sa} + 16]",
                "tileloadd tmm7, [{b} + {sb} + 256]",
                "tdpbssd tmm1, tmm5, tmm7",
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm4, [{a} + {sa} + 512]",
                "tileloadd tmm6, [{b} + {sb} + 512]",
                "tdpbssd tmm2, tmm4, tmm6",
                "tileloadd tmm5, [{a} + {sa} + 528]",
                "tileloadd tmm7, [{b} + {sb} + 768]",
                "tdpbssd tmm3, tmm5, tmm7",
                "tilestored [{c} + {sb}], tmm0",
                "tilestored [{c} + {sb} + 1024], tmm1",
                "tilestored [{c} + {sb} + 2048], tmm2",
                "tilestored [{c} + {sb} + 3072], tmm3",
                a = in(reg) a,
                b = in(reg) b,
                c = in(reg) c,
                sa = in(reg) 32usize,
                sb = in(reg) 64usize,
                options(nostack),
            );
            i += 2;
        }
        if i < k {
            halves!(a.add(i * TILE), b.add(i * TILE), out.add(2 * i * DOT_VECS));
        }
    } else if k == 4 {
        if F::SIGNED {
            four!("tdpbssd");
        } else {
            four!("tdpbusd");
        }
    } else {
        for i in 0..k {
            let (a, b, c) = (a.add(i * TILE), b.add(i * TILE), out.add(i * DOT_VECS));
            if F::SIGNED {
                one!("tdpbssd", a, b, c);
            } else {
                one!("tdpbusd", a, b, c);
            }
        }
    }
}

/// Accumulators whose sub-blocks' dots are computed together before their float
/// sequences run (so the tile unit works on several independent tiles).
const CHUNK_L: usize = 4;

/// Per-task buffers of [`stripe_group`], allocated once.
struct Scratch {
    /// The dots of one chunk of accumulators: `[round][l - l0]`, one tile (two for
    /// `HALVES`) each, where sub-block `s = l + 32·round`.
    dots: Vec<__m512i>,
    /// Accumulator l of row m at `[l·16 + m]` (16 tokens).
    acc: Vec<__m512>,
}

impl Scratch {
    fn new(nsub: usize) -> Scratch {
        Scratch {
            dots: vec![unsafe { std::mem::zeroed() }; nsub.div_ceil(32) * CHUNK_L * 2 * DOT_VECS],
            acc: vec![unsafe { std::mem::zeroed() }; 32 * ROWS],
        }
    }
}

/// The 16 × 16 results of a stripe against token group `g`: `out[m][n]` = row m ·
/// token n, by the canonical sequence.
///
/// # Safety
/// AVX-512 F and the AMX level must be available and `TileConfig::new(F::HALVES)`
/// loaded on this thread.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn stripe_group<F: Format>(
    st: &Stripe,
    acts: &Acts,
    g: usize,
    sc: &mut Scratch,
    out: &mut [[f32; TOKS]; ROWS],
) {
    let nsub = acts.nsub;
    let tiles = if F::HALVES { 2 } else { 1 };
    let rounds = nsub.div_ceil(32);
    assert!(st.q.len() == nsub * TILE && st.p.len() == nsub * ROWS);
    assert!(acts.q.len() >= (g + 1) * nsub * TILE && acts.da.len() >= (g + 1) * nsub * TOKS);
    assert!(sc.dots.len() >= rounds * CHUNK_L * tiles * DOT_VECS && sc.acc.len() == 32 * ROWS);
    let nl = nsub.min(32);
    // Accumulators that no sub-block reaches stay +0.0, as in the scalar code.
    for v in &mut sc.acc[nl * ROWS..] {
        *v = _mm512_setzero_ps();
    }
    let dots = sc.dots.as_mut_ptr();
    for l0 in (0..nl).step_by(CHUNK_L) {
        let l1 = (l0 + CHUNK_L).min(nl);
        // Every sub-block of accumulators l0..l1: round r holds s = l0 + 32r.. (at
        // most l1 - l0 of them, consecutive, fewer in the last round).
        for r in 0..rounds {
            let s0 = l0 + 32 * r;
            let k = (l1 + 32 * r).min(nsub).saturating_sub(s0);
            if k > 0 {
                tile_dots::<F>(
                    k,
                    st.q.as_ptr().add(s0 * TILE),
                    acts.q.as_ptr().add((g * nsub + s0) * TILE),
                    dots.add(r * CHUNK_L * tiles * DOT_VECS),
                );
            }
        }
        for l in l0..l1 {
            // Accumulator l of rows m..m + 4, 16 tokens each: sub-blocks l, l + 32, ...
            // in increasing order (four rows at once share the activation loads).
            for m in (0..ROWS).step_by(4) {
                let mut a = [_mm512_setzero_ps(); 4];
                for (r, s) in (l..nsub).step_by(32).enumerate() {
                    let d = dots.add((r * CHUNK_L + l - l0) * tiles * DOT_VECS + m);
                    let da = _mm512_loadu_ps(acts.da.as_ptr().add((g * nsub + s) * TOKS));
                    let asum = _mm512_loadu_ps(acts.asum.as_ptr().add((g * nsub + s) * TOKS));
                    let p = &st.p[s * ROWS + m..s * ROWS + m + 4];
                    for i in 0..4 {
                        let lo = *d.add(i);
                        let hi = if F::HALVES { *d.add(DOT_VECS + i) } else { lo };
                        a[i] = _mm512_add_ps(a[i], F::contrib(lo, hi, &p[i], da, asum));
                    }
                }
                sc.acc[l * ROWS + m..l * ROWS + m + 4].copy_from_slice(&a);
            }
        }
    }
    // The combine tree: acc[l] += acc[l + w] for w = 16, 8, 4, 2, 1.
    let acc = &mut sc.acc;
    let mut w = 16;
    while w > 0 {
        for l in 0..w {
            for m in 0..ROWS {
                acc[l * ROWS + m] = _mm512_add_ps(acc[l * ROWS + m], acc[(l + w) * ROWS + m]);
            }
        }
        w /= 2;
    }
    for m in 0..ROWS {
        _mm512_storeu_ps(out[m].as_mut_ptr(), acc[m]);
    }
}

/// The output matrix (tokens × rows), written by several tasks at once, each to the
/// columns of its own rows.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    n_rows: usize,
    n_tok: usize,
}

// SAFETY: tasks write disjoint elements (their own rows) and `run` holds the `&mut`
// borrow of the whole matrix until every task has finished.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// Rows `r0..r0 + w.len() / rb` of `w` against every token, into `out`.
///
/// # Safety
/// The AMX level must be available (tile permission granted to this process); `out`
/// must be valid for n_tok × n_rows values, rows `r0..` of which no one else touches.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn run_rows<F: Format>(w: &[u8], rb: usize, r0: usize, acts: &Acts, out: Out) {
    let cfg = TileConfig::new(F::HALVES);
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    // This thread's buffers from an earlier call of the same width, else new ones.
    let (mut st, mut sc) = BUFS
        .with(|b| b.take())
        .filter(|(st, _)| st.p.len() == acts.nsub * ROWS)
        .unwrap_or_else(|| (Stripe::new(acts.nsub), Scratch::new(acts.nsub)));
    let mut res = [[0f32; TOKS]; ROWS];
    for (i, rows) in w.chunks(ROWS * rb).enumerate() {
        st.fill::<F>(rows, rb);
        let n_rows = rows.len() / rb;
        let rs = r0 + i * ROWS;
        assert!(rs + n_rows <= out.n_rows);
        for g in 0..out.n_tok.div_ceil(TOKS) {
            stripe_group::<F>(&st, acts, g, &mut sc, &mut res);
            let t0 = g * TOKS;
            for n in 0..(out.n_tok - t0).min(TOKS) {
                // Token t0 + n's values of rows rs..rs + n_rows: in bounds by the assert
                // (t0 + n < n_tok) and owned by this task.
                let dst = out.ptr.add((t0 + n) * out.n_rows + rs);
                for m in 0..n_rows {
                    *dst.add(m) = res[m][n];
                }
            }
        }
    }
    asm!("tilerelease", options(nostack, nomem));
    BUFS.with(|b| b.set(Some((st, sc))));
}

thread_local! {
    /// The stripe and scratch buffers of this thread's last task (~96 KiB for 2,048
    /// columns), kept so that a matmul of many small tasks does not allocate and zero
    /// them per task. A width change replaces them.
    static BUFS: std::cell::Cell<Option<(Stripe, Scratch)>> = const { std::cell::Cell::new(None) };
}

fn run<F: Format>(w: &[u8], rb: usize, xqs: &[ActQ8], out: &mut [f32], _proof: AmxProof) {
    let n_tok = xqs.len();
    let nsub = rb / F::BLOCK_BYTES * F::SUBS;
    let n_rows = w.len() / rb;
    assert!(rb.is_multiple_of(F::BLOCK_BYTES) && w.len() == n_rows * rb);
    assert!(out.len() == n_rows * n_tok);
    assert!(xqs
        .iter()
        .all(|x| x.qs.len() == nsub * SUB && x.d.len() == nsub && x.sums.len() == nsub));
    let acts = layout_acts(xqs, nsub);
    let o = Out {
        ptr: out.as_mut_ptr(),
        n_rows,
        n_tok,
    };
    let stripes = n_rows.div_ceil(ROWS);
    let threads = rayon::current_num_threads().max(1);
    let per = stripes.div_ceil(threads * 4).max(1) * ROWS;
    // SAFETY (both calls): the proof exists only once the AMX level (AVX-512 and the
    // tile permission of this process) was detected; `out` is borrowed mutably for
    // the whole call and each task writes only its own rows (`per` apart).
    if stripes <= 1 {
        unsafe { run_rows::<F>(w, rb, 0, &acts, o) };
        return;
    }
    w.par_chunks(per * rb)
        .enumerate()
        .for_each(|(i, wc)| unsafe { run_rows::<F>(wc, rb, i * per, &acts, o) });
}

/// `out[t·n_rows + r]` = row r of `w` (rows of `rb` bytes of `ty`) · token t, for
/// `ty` with [`supports`]; bit-identical to the single-row dot. Shapes are checked by
/// the caller (`try_matmul_with`).
pub(crate) fn matmul(
    ty: GgmlType,
    w: &[u8],
    rb: usize,
    xqs: &[ActQ8],
    out: &mut [f32],
    proof: AmxProof,
) {
    use GgmlType as T;
    match ty {
        T::Q8_0 => run::<Q8_0>(w, rb, xqs, out, proof),
        T::Q4_0 => run::<Q4_0>(w, rb, xqs, out, proof),
        T::Q4_K => run::<Q4K>(w, rb, xqs, out, proof),
        T::Q5_K => run::<Q5K>(w, rb, xqs, out, proof),
        T::Q6_K => run::<Q6K>(w, rb, xqs, out, proof),
        T::IQ4_XS => run::<Iq4Xs>(w, rb, xqs, out, proof),
        other => unreachable!("no AMX kernel for {other}: callers check supports"),
    }
}
