//! AVX-512 kernels, in two instantiations of one body: with VNNI
//! (F, BW, VL, VNNI) and without (F, BW, VL).
//!
//! Integer dots run 64 bytes at a time: `vpdpbusd` (unsigned × signed bytes, four
//! products summed into each i32 lane) with VNNI, `vpmaddubsw` + `vpmaddwd` (the
//! same four-product groups) without. Signed weights (Q8_0, IQ4_XS) are made
//! unsigned with an exact offset under VNNI (`Σ (w + 128)·a - 128·asum`) and with
//! the sign trick without it (where the offset would saturate the i16 pairs). Each
//! sub-block's partial sums are reduced to one lane, and the float sequence then
//! runs on 8-lane vectors, one sub-block per lane, exactly as in `scalar.rs` (the
//! same helpers as the AVX2 kernels). Float rows keep the 32 accumulators in two
//! 16-lane vectors.
//!
//! The quantized kernels take a tile of N tokens (`matmul`; N = 1 is the single-row
//! dot). With `T` (many tokens) they read `transpose_act` activations and permute
//! each unpacked weight block the same way, so the four partial-dot vectors of a
//! block just add up (sub-block s in lanes s and s + 8); token pairs share one
//! 16-lane float sequence.
//!
//! The Q8_0/Q4_0 kernels, their padded partial groups and row loops are in
//! `avx512/q8_0_q4_0.rs` (a macro expanded inside this one's modules).

#[cfg(target_arch = "x86_64")]
pub(crate) use bw::{kernel as bw_kernel, multi as bw_multi};
#[cfg(target_arch = "x86_64")]
pub(crate) use vnni::{kernel as vnni_kernel, multi as vnni_multi};

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn vnni_kernel(ty: crate::GgmlType, _proof: crate::isa::Avx512Proof) -> crate::Kernel {
    crate::scalar_kernel(ty)
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn bw_kernel(ty: crate::GgmlType, _proof: crate::isa::Avx512BwProof) -> crate::Kernel {
    crate::scalar_kernel(ty)
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn vnni_multi(
    _ty: crate::GgmlType,
    _proof: crate::isa::Avx512Proof,
) -> Option<crate::Multi> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn bw_multi(
    _ty: crate::GgmlType,
    _proof: crate::isa::Avx512BwProof,
) -> Option<crate::Multi> {
    None
}

/// A safe `Kernel` around an unsafe target-feature kernel (see the SAFETY note at its use).
#[cfg(target_arch = "x86_64")]
macro_rules! wrap_q {
    ($f:ident) => {{
        fn w(row: &[u8], xq: &ActQ8) -> f32 {
            unsafe { $f::<1, false>(row, [xq], [&[]])[0] }
        }
        Kernel::Q(w)
    }};
}

/// [`wrap_q!`] with the loop over rows too (`Kernel::QRows`), `$rows` being the
/// kernel's row loop. The single-row dot is the loop over one row, so that the
/// loop is the kernel's only caller (and gets it inlined).
#[cfg(target_arch = "x86_64")]
macro_rules! wrap_rows {
    ($rows:ident) => {{
        fn w(row: &[u8], xq: &ActQ8) -> f32 {
            let mut out = 0.0;
            unsafe { $rows(row.len(), row, xq, std::slice::from_mut(&mut out)) };
            out
        }
        fn rows(rb: usize, w: &[u8], xq: &ActQ8, out: &mut [f32]) {
            unsafe { $rows(rb, w, xq, out) }
        }
        Kernel::QRows(w, rows)
    }};
}

#[cfg(target_arch = "x86_64")]
macro_rules! wrap_f {
    ($f:ident) => {{
        fn w(row: &[u8], x: &[f32]) -> f32 {
            unsafe { $f(row, x) }
        }
        Kernel::F(w)
    }};
}

#[cfg(target_arch = "x86_64")]
#[macro_use]
mod q8_0_q4_0;

#[cfg(target_arch = "x86_64")]
macro_rules! avx512_kernels {
    ($name:ident, $feat:literal, $proof:ty, vnni: $vnni:literal) => {
        mod $name {
            /// Whether `dp` is `vpdpbusd` (and signed weights use the +128 offset).
            const VNNI: bool = $vnni;
            const OFFSET: bool = $vnni;

            use std::arch::x86_64::*;

            use crate::avx2::imp::{
                add_tail, f16x8_tail, iq4_xs_scales, k_scales, tail_mask, tree,
            };
            use crate::formats::*;
            use crate::scalar;
            use crate::{ActQ8, GgmlType, Kernel, Multi};

            pub(crate) fn kernel(ty: GgmlType, _proof: $proof) -> Kernel {
                use GgmlType as T;
                // SAFETY (every wrapper below): the wrappers are only handed out here, and
                // the proof exists only once this module's target features were detected
                // on this CPU.
                match ty {
                    T::F32 => wrap_f!(dot_f32),
                    T::F16 => wrap_f!(dot_f16),
                    T::BF16 => wrap_f!(dot_bf16),
                    T::Q8_0 => wrap_rows!(rows_q8_0),
                    T::Q4_0 => wrap_rows!(rows_q4_0),
                    T::Q4_K => wrap_q!(dot_q4_k),
                    T::Q5_K => wrap_q!(dot_q5_k),
                    T::Q6_K => wrap_q!(dot_q6_k),
                    T::IQ4_XS => wrap_q!(dot_iq4_xs),
                    other => crate::scalar_kernel(other),
                }
            }

            /// The many-token kernel of `ty` (tiles of up to 8 tokens), if it has one.
            pub(crate) fn multi(ty: GgmlType, _proof: $proof) -> Option<Multi> {
                use GgmlType as T;
                // SAFETY (every wrapper below): as in `kernel`.
                Some(match ty {
                    T::Q8_0 => multi_wrap!(dot_q8_0, transpose_act, 8, 4, 2, 1),
                    T::Q4_0 => multi_wrap!(dot_q4_0, transpose_act, 8, 4, 2, 1),
                    T::Q4_K => multi_wrap!(dot_q4_k, transpose_act, 8, 4, 2, 1),
                    T::Q5_K => multi_wrap!(dot_q5_k, transpose_act, 8, 4, 2, 1),
                    T::Q6_K => multi_wrap!(dot_q6_k, transpose_act, 8, 4, 2, 1),
                    T::IQ4_XS => {
                        multi_wrap!(dot_iq4_xs, transpose_act, 8, 4, 2, 1)
                    }
                    _ => return None,
                })
            }

            fn check(row: &[u8], xq: &ActQ8, block_bytes: usize, block_vals: usize) -> usize {
                let nb = row.len() / block_bytes;
                assert!(
                    row.len() == nb * block_bytes
                        && xq.qs.len() >= nb * block_vals
                        && xq.d.len() >= nb * block_vals / SUB
                        && xq.sums.len() >= nb * block_vals / SUB
                );
                nb
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn ld256(p: *const u8) -> __m256i {
                _mm256_loadu_si256(p as *const __m256i)
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn ld512(p: *const u8) -> __m512i {
                _mm512_loadu_si512(p as *const __m512i)
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn lda512(p: *const i8) -> __m512i {
                _mm512_loadu_si512(p as *const __m512i)
            }

            /// Unsigned × signed byte dot: each i32 lane sums four products.
            #[inline]
            #[target_feature(enable = $feat)]
            #[allow(unused_unsafe)]
            fn dp(u: __m512i, s: __m512i) -> __m512i {
                if VNNI {
                    // SAFETY: only reached in the VNNI instantiation, whose features include avx512vnni.
                    unsafe { _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s) }
                } else {
                    // u ≤ 128 and |s| ≤ 127 at every call: no i16 pair sum saturates.
                    _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1))
                }
            }

            /// Signed int8 weights prepared for [`dps`] (once per block, shared by tokens):
            /// with VNNI `w + 128` (as unsigned bytes); without, `|w|` and the sign mask.
            #[derive(Clone, Copy)]
            struct SignedW {
                u: __m512i,
                neg: __mmask64,
            }

            #[inline]
            #[target_feature(enable = $feat)]
            fn signed_w(w: __m512i) -> SignedW {
                if OFFSET {
                    SignedW {
                        u: _mm512_xor_si512(w, _mm512_set1_epi8(0x80u8 as i8)),
                        neg: 0,
                    }
                } else {
                    SignedW {
                        u: _mm512_abs_epi8(w),
                        neg: _mm512_movepi8_mask(w),
                    }
                }
            }

            /// Signed × signed byte dot (|s| ≤ 127), each i32 lane summing four products.
            /// With VNNI: `Σ (w + 128)·s` — the caller subtracts `128·Σ s` (`OFFSET`);
            /// without: `Σ |w|·(s·sign w)`, exact as it stands.
            #[inline]
            #[target_feature(enable = $feat)]
            fn dps(w: SignedW, s: __m512i) -> __m512i {
                if OFFSET {
                    dp(w.u, s)
                } else {
                    dp(
                        w.u,
                        _mm512_mask_sub_epi8(s, w.neg, _mm512_setzero_si512(), s),
                    )
                }
            }

            /// Removes the `OFFSET` bias from eight sub-block dots: `raw - 128·asum`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn unbias(raw: __m256i, sums: *const i32) -> __m256i {
                if OFFSET {
                    _mm256_sub_epi32(
                        raw,
                        _mm256_slli_epi32(_mm256_loadu_si256(sums as *const __m256i), 7),
                    )
                } else {
                    raw
                }
            }

            /// Reduces four 16-lane partial sums, each holding two sub-blocks (lanes 0..7
            /// and 8..15), to one vector with lane j = sub-block j's dot (exact).
            #[inline]
            #[target_feature(enable = $feat)]
            fn reduce4(p: &[__m512i; 4]) -> __m256i {
                // Per 128-bit chunk k: [p0 lanes 0+2, p1 0+2, p0 1+3, p1 1+3] (and p2, p3).
                let t01 = _mm512_add_epi32(
                    _mm512_unpacklo_epi32(p[0], p[1]),
                    _mm512_unpackhi_epi32(p[0], p[1]),
                );
                let t23 = _mm512_add_epi32(
                    _mm512_unpacklo_epi32(p[2], p[3]),
                    _mm512_unpackhi_epi32(p[2], p[3]),
                );
                // Chunk k: [Σ chunk k of p0, of p1, of p2, of p3].
                let u = _mm512_add_epi32(
                    _mm512_unpacklo_epi64(t01, t23),
                    _mm512_unpackhi_epi64(t01, t23),
                );
                // Chunk 0: chunks 0+1 (sub-blocks 0, 2, 4, 6); chunk 2: chunks 2+3 (1, 3, 5, 7).
                let v = _mm512_add_epi32(u, _mm512_shuffle_i64x2(u, u, 0xB1));
                let order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
                _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, v))
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
                let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
                (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1)))
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn f16_one(p: *const u8) -> f32 {
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                    (p as *const u16).read_unaligned() as i32,
                )))
            }

            /// `c = (d * da) * isum`, lanes = sub-blocks.
            #[inline]
            #[target_feature(enable = $feat)]
            fn scale_c(d: __m256, da: __m256, isum: __m256i) -> __m256 {
                _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum))
            }

            /// The per-block float constants of a Q4_K/Q5_K block, shared by every token.
            #[derive(Clone, Copy)]
            struct KBlock {
                d: __m256,
                dmin: __m256,
                sc32: __m256i,
                m32: __m256i,
            }

            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn k_block(blk: *const u8) -> KBlock {
                let (d, dmin) = f16_pair(blk);
                let (sc, m) = k_scales(blk.add(4));
                KBlock {
                    d: _mm256_set1_ps(d),
                    dmin: _mm256_set1_ps(dmin),
                    sc32: _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64)),
                    m32: _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(m as i64)),
                }
            }

            /// Q4_K / Q5_K: `c = (d*da)*is; c = fma(-(dmin*da), im, c)`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn k_c(k: KBlock, b: usize, xq: &ActQ8, dots: __m256i) -> __m256 {
                let sums = _mm256_loadu_si256(xq.sums.as_ptr().add(8 * b) as *const __m256i);
                let da = _mm256_loadu_ps(xq.d.as_ptr().add(8 * b));
                let is = _mm256_mullo_epi32(dots, k.sc32);
                let im = _mm256_mullo_epi32(sums, k.m32);
                let dd = _mm256_mul_ps(k.d, da);
                let dm = _mm256_mul_ps(k.dmin, da);
                let c = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(is));
                _mm256_fnmadd_ps(dm, _mm256_cvtepi32_ps(im), c)
            }

            /// Pairs the nibble planes of two consecutive 32-byte chunks: from
            /// lo = [lo_c, lo_c+1] and hi = [hi_c, hi_c+1] (256 bits each half) returns
            /// [lo_c, hi_c] and [lo_c+1, hi_c+1], i.e. the values of 64 consecutive elements each.
            #[inline]
            #[target_feature(enable = $feat)]
            fn pair_planes(lo: __m512i, hi: __m512i) -> (__m512i, __m512i) {
                (
                    _mm512_shuffle_i64x2(lo, hi, 0x44),
                    _mm512_shuffle_i64x2(lo, hi, 0xEE),
                )
            }

            /// The four 64-value dots of one 256-value block: `z[k]` (unsigned weights of
            /// values 64k..64k+63) against the token's activations at `qa`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn dots4<const T: bool>(z: &[__m512i; 4], qa: *const i8) -> __m256i {
                if T {
                    return fold(sum4(z, qa));
                }
                let p = [
                    dp(z[0], lda512(qa)),
                    dp(z[1], lda512(qa.add(64))),
                    dp(z[2], lda512(qa.add(128))),
                    dp(z[3], lda512(qa.add(192))),
                ];
                reduce::<T>(&p)
            }

            /// The layout of transposed activations ([`transpose_act`]) for the
            /// weights of one 256-value group: `n[k]` holds sub-blocks 2k (dword lanes 0..7)
            /// and 2k+1 (lanes 8..15), four values per lane; result k, lane i holds
            /// dword 2k + i/8 of sub-block i % 8. A sum over k then leaves sub-block s in
            /// lanes s and s + 8.
            #[inline]
            #[target_feature(enable = $feat)]
            fn transpose4(n: [__m512i; 4]) -> [__m512i; 4] {
                // Stage 1: sub-blocks 0..3 (from n0, n1), dwords 4m..4m+4, at lane 4s + d.
                let ix0 =
                    _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
                let ix1 = _mm512_add_epi32(ix0, _mm512_set1_epi32(4));
                // Stage 2: lane i takes sub-block i % 8 from x (< 4) or y (≥ 4).
                let io0 =
                    _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
                let io1 = _mm512_add_epi32(io0, _mm512_set1_epi32(2));
                let x0 = _mm512_permutex2var_epi32(n[0], ix0, n[1]);
                let x1 = _mm512_permutex2var_epi32(n[0], ix1, n[1]);
                let y0 = _mm512_permutex2var_epi32(n[2], ix0, n[3]);
                let y1 = _mm512_permutex2var_epi32(n[2], ix1, n[3]);
                [
                    _mm512_permutex2var_epi32(x0, io0, y0),
                    _mm512_permutex2var_epi32(x0, io1, y0),
                    _mm512_permutex2var_epi32(x1, io0, y1),
                    _mm512_permutex2var_epi32(x1, io1, y1),
                ]
            }

            /// Activations in the layout of the many-token kernels: within each whole
            /// 256-value group (8 sub-blocks of 32), 64-byte vector k, dword lane i
            /// (i < 16) holds values 4·(2k + i/8) .. +4 of sub-block i % 8 ([`transpose4`]
            /// of the group as loaded), so that one vertical sum of the four vectors'
            /// partial dots leaves each sub-block in two lanes. A trailing partial group
            /// keeps its order. (Any layout is exact: the weights get the same one.)
            /// Reached only through [`multi`], i.e. once the features were detected.
            fn transpose_act(qs: &[i8]) -> Vec<i8> {
                let mut out = qs.to_vec();
                // SAFETY: see above; every access is within a whole 256-byte group.
                unsafe { transpose_groups(qs, &mut out) };
                out
            }

            #[target_feature(enable = $feat)]
            unsafe fn transpose_groups(qs: &[i8], out: &mut [i8]) {
                assert_eq!(qs.len(), out.len());
                for g in 0..qs.len() / 256 {
                    let src = qs.as_ptr().add(256 * g);
                    let dst = out.as_mut_ptr().add(256 * g);
                    let n = [
                        lda512(src),
                        lda512(src.add(64)),
                        lda512(src.add(128)),
                        lda512(src.add(192)),
                    ];
                    for (k, v) in transpose4(n).into_iter().enumerate() {
                        _mm512_storeu_si512(dst.add(64 * k) as *mut __m512i, v);
                    }
                }
            }

            /// Sub-block j's dot in lane j from four partial-sum vectors: in the
            /// transposed layout (`T`) a sum and one fold, else [`reduce4`].
            #[inline]
            #[target_feature(enable = $feat)]
            fn reduce<const T: bool>(p: &[__m512i; 4]) -> __m256i {
                if T {
                    let v = _mm512_add_epi32(
                        _mm512_add_epi32(p[0], p[1]),
                        _mm512_add_epi32(p[2], p[3]),
                    );
                    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
                } else {
                    reduce4(p)
                }
            }

            /// `acc + dp(u, s)` (with VNNI one `vpdpbusd` into acc).
            #[inline]
            #[target_feature(enable = $feat)]
            #[allow(unused_unsafe)]
            fn dp_acc(acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
                if VNNI {
                    // SAFETY: only reached in the VNNI instantiation, whose features include avx512vnni.
                    unsafe { _mm512_dpbusd_epi32(acc, u, s) }
                } else {
                    _mm512_add_epi32(acc, dp(u, s))
                }
            }

            /// Transposed layout: the sum of the four vectors' partial dots of unsigned
            /// weights z (sub-block s in lanes s and s + 8).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn sum4(z: &[__m512i; 4], qa: *const i8) -> __m512i {
                let mut v = dp(z[0], lda512(qa));
                for k in 1..4 {
                    v = dp_acc(v, z[k], lda512(qa.add(64 * k)));
                }
                v
            }

            /// [`sum4`] for signed weights (`OFFSET` bias included, as in [`dps`]).
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn sum4s(w: &[SignedW; 4], qa: *const i8) -> __m512i {
                let mut v = dps(w[0], lda512(qa));
                for k in 1..4 {
                    let s = lda512(qa.add(64 * k));
                    v = if OFFSET {
                        dp_acc(v, w[k].u, s)
                    } else {
                        _mm512_add_epi32(v, dps(w[k], s))
                    };
                }
                v
            }

            /// Lane j (< 8) = lanes j + j + 8 of v: sub-block j's dot.
            #[inline]
            #[target_feature(enable = $feat)]
            fn fold(v: __m512i) -> __m256i {
                _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
            }

            /// [`fold`] of two tokens into one pair vector (lanes 0..7 a, 8..15 b).
            #[inline]
            #[target_feature(enable = $feat)]
            fn fold2(a: __m512i, b: __m512i) -> __m512i {
                _mm512_add_epi32(
                    _mm512_shuffle_i64x2(a, b, 0x44),
                    _mm512_shuffle_i64x2(a, b, 0xEE),
                )
            }

            /// The eight sub-block dots of signed weights (bias included) at `qa`.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn dots4s<const T: bool>(w: &[SignedW; 4], qa: *const i8) -> __m256i {
                if T {
                    fold(sum4s(w, qa))
                } else {
                    let mut p = [_mm512_setzero_si512(); 4];
                    for k in 0..4 {
                        p[k] = dps(w[k], lda512(qa.add(64 * k)));
                    }
                    reduce4(&p)
                }
            }

            /// Token t's activations: transposed (`T`) or as quantized.
            #[inline]
            fn act<const N: usize, const T: bool>(
                xq: &[&ActQ8; N],
                ta: &[&[i8]; N],
                t: usize,
            ) -> *const i8 {
                if T {
                    ta[t].as_ptr()
                } else {
                    xq[t].qs.as_ptr()
                }
            }

            fn check_t<const N: usize, const T: bool>(ta: &[&[i8]; N], n: usize) {
                if T {
                    for a in ta {
                        assert!(a.len() >= n);
                    }
                }
            }

            /// The nb shared by every token's check.
            fn check_all<const N: usize>(
                row: &[u8],
                xq: &[&ActQ8; N],
                block_bytes: usize,
                block_vals: usize,
            ) -> usize {
                let nb = row.len() / block_bytes;
                for x in xq {
                    check(row, x, block_bytes, block_vals);
                }
                nb
            }

            /// The combine tree of every token.
            #[inline]
            #[target_feature(enable = $feat)]
            fn trees<const N: usize>(acc: &[[__m256; 4]; N]) -> [f32; N] {
                let mut out = [0f32; N];
                for t in 0..N {
                    out[t] = tree(&acc[t]);
                }
                out
            }

            // Pairs of tokens: the float sequence is elementwise, so two tokens' 8-lane
            // vectors run side by side in one 16-lane vector (lanes 0..7 token 2i, 8..15
            // token 2i+1) with the same operations, halving the float work.

            #[inline]
            #[target_feature(enable = $feat)]
            fn join_i(a: __m256i, b: __m256i) -> __m512i {
                _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)
            }

            #[inline]
            #[target_feature(enable = $feat)]
            fn join_f(a: __m256, b: __m256) -> __m512 {
                _mm512_castpd_ps(_mm512_insertf64x4(
                    _mm512_castpd256_pd512(_mm256_castps_pd(a)),
                    _mm256_castps_pd(b),
                    1,
                ))
            }

            /// Both halves = v.
            #[inline]
            #[target_feature(enable = $feat)]
            fn dup_f(v: __m256) -> __m512 {
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)))
            }

            /// The activation scales of sub-blocks 8b..8b+8 of two tokens.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn da2(a: &ActQ8, c: &ActQ8, b: usize) -> __m512 {
                join_f(
                    _mm256_loadu_ps(a.d.as_ptr().add(8 * b)),
                    _mm256_loadu_ps(c.d.as_ptr().add(8 * b)),
                )
            }

            /// The activation sums of sub-blocks 8b..8b+8 of two tokens.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn sums2(a: &ActQ8, c: &ActQ8, b: usize) -> __m512i {
                join_i(
                    _mm256_loadu_si256(a.sums.as_ptr().add(8 * b) as *const __m256i),
                    _mm256_loadu_si256(c.sums.as_ptr().add(8 * b) as *const __m256i),
                )
            }

            /// [`scale_c`] for a pair: `c = (d * da) * isum`.
            #[inline]
            #[target_feature(enable = $feat)]
            fn scale_c2(d: __m512, da: __m512, isum: __m512i) -> __m512 {
                _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum))
            }

            /// [`k_c`] for a pair of tokens.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn k_c2(k: KBlock, b: usize, a: &ActQ8, c: &ActQ8, dots: __m512i) -> __m512 {
                let sums = sums2(a, c, b);
                let da = da2(a, c, b);
                let is = _mm512_mullo_epi32(dots, _mm512_broadcast_i64x4(k.sc32));
                let im = _mm512_mullo_epi32(sums, _mm512_broadcast_i64x4(k.m32));
                let dd = _mm512_mul_ps(dup_f(k.d), da);
                let dm = _mm512_mul_ps(dup_f(k.dmin), da);
                let c = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(is));
                _mm512_fnmadd_ps(dm, _mm512_cvtepi32_ps(im), c)
            }

            /// Adds `c = (d * da) * is[t]` (sub-blocks 8b..8b+8) to every token's
            /// accumulators, two tokens per 16-lane vector.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn add_scaled<const N: usize>(
                acc: &mut [[__m256; 4]; N],
                acc2: &mut [[__m512; 4]; N],
                xq: &[&ActQ8; N],
                b: usize,
                d: __m256,
                is: &[__m256i; N],
            ) {
                let d2 = dup_f(d);
                for p in 0..N / 2 {
                    let da = da2(xq[2 * p], xq[2 * p + 1], b);
                    let c = scale_c2(d2, da, join_i(is[2 * p], is[2 * p + 1]));
                    acc2[p][b & 3] = _mm512_add_ps(acc2[p][b & 3], c);
                }
                if N % 2 == 1 {
                    let t = N - 1;
                    let da = _mm256_loadu_ps(xq[t].d.as_ptr().add(8 * b));
                    acc[t][b & 3] = _mm256_add_ps(acc[t][b & 3], scale_c(d, da, is[t]));
                }
            }

            /// Splits the pair accumulators into the per-token ones (every token but an
            /// odd last one).
            #[inline]
            #[target_feature(enable = $feat)]
            fn unpair<const N: usize>(acc2: &[[__m512; 4]; N], acc: &mut [[__m256; 4]; N]) {
                for p in 0..N / 2 {
                    for k in 0..4 {
                        acc[2 * p][k] = _mm512_castps512_ps256(acc2[p][k]);
                        acc[2 * p + 1][k] = _mm256_castpd_ps(_mm512_extractf64x4_pd(
                            _mm512_castps_pd(acc2[p][k]),
                            1,
                        ));
                    }
                }
            }

            // Every quantized kernel below computes N tokens against one row: each
            // block's weights are unpacked once, then every token runs the canonical
            // sequence into its own 32 accumulators (N = 1 is the single-row dot).

            #[target_feature(enable = $feat)]
            unsafe fn dot_q4_k<const N: usize, const T: bool>(
                row: &[u8],
                xq: [&ActQ8; N],
                ta: [&[i8]; N],
            ) -> [f32; N] {
                let nb = check_all(row, &xq, Q4_K_BYTES, QK_K);
                check_t::<N, T>(&ta, nb * QK_K);
                let m4 = _mm512_set1_epi8(0x0F);
                let mut acc = [[_mm256_setzero_ps(); 4]; N];
                let mut acc2 = [[_mm512_setzero_ps(); 4]; N];
                for b in 0..nb {
                    let blk = row.as_ptr().add(Q4_K_BYTES * b);
                    let mut z = [_mm512_setzero_si512(); 4];
                    for h in 0..2 {
                        let q = ld512(blk.add(16 + 64 * h));
                        let lo = _mm512_and_si512(q, m4);
                        let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                        (z[2 * h], z[2 * h + 1]) = pair_planes(lo, hi);
                    }
                    if T {
                        z = transpose4(z);
                    }
                    let kb = k_block(blk);
                    for p in 0..N / 2 {
                        let (xa, xb) = (xq[2 * p], xq[2 * p + 1]);
                        let (pa, pb) = (
                            act::<N, T>(&xq, &ta, 2 * p).add(QK_K * b),
                            act::<N, T>(&xq, &ta, 2 * p + 1).add(QK_K * b),
                        );
                        let dots = if T {
                            fold2(sum4(&z, pa), sum4(&z, pb))
                        } else {
                            join_i(dots4::<T>(&z, pa), dots4::<T>(&z, pb))
                        };
                        let c = k_c2(kb, b, xa, xb, dots);
                        acc2[p][b & 3] = _mm512_add_ps(acc2[p][b & 3], c);
                    }
                    if N % 2 == 1 {
                        let t = N - 1;
                        let dots = dots4::<T>(&z, act::<N, T>(&xq, &ta, t).add(QK_K * b));
                        let c = k_c(kb, b, xq[t], dots);
                        acc[t][b & 3] = _mm256_add_ps(acc[t][b & 3], c);
                    }
                }
                unpair(&acc2, &mut acc);
                trees(&acc)
            }

            #[target_feature(enable = $feat)]
            unsafe fn dot_q5_k<const N: usize, const T: bool>(
                row: &[u8],
                xq: [&ActQ8; N],
                ta: [&[i8]; N],
            ) -> [f32; N] {
                let nb = check_all(row, &xq, Q5_K_BYTES, QK_K);
                check_t::<N, T>(&ta, nb * QK_K);
                let m4 = _mm512_set1_epi8(0x0F);
                let b4 = _mm512_set1_epi8(0x10);
                let mut acc = [[_mm256_setzero_ps(); 4]; N];
                let mut acc2 = [[_mm512_setzero_ps(); 4]; N];
                for b in 0..nb {
                    let blk = row.as_ptr().add(Q5_K_BYTES * b);
                    let qh = ld256(blk.add(16));
                    // First half serves chunk 2h (bits 4h, 4h+1), second half chunk 2h+1
                    // (bits 4h+2, 4h+3): bit pairs move to bits 0, 1 of each byte.
                    let mut hz =
                        _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                    let mut z = [_mm512_setzero_si512(); 4];
                    for h in 0..2 {
                        let q = ld512(blk.add(48 + 64 * h));
                        let lo = _mm512_or_si512(
                            _mm512_and_si512(q, m4),
                            _mm512_and_si512(_mm512_slli_epi16(hz, 4), b4),
                        );
                        let hi = _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                            _mm512_and_si512(_mm512_slli_epi16(hz, 3), b4),
                        );
                        hz = _mm512_srli_epi16(hz, 4);
                        (z[2 * h], z[2 * h + 1]) = pair_planes(lo, hi);
                    }
                    if T {
                        z = transpose4(z);
                    }
                    let kb = k_block(blk);
                    for p in 0..N / 2 {
                        let (xa, xb) = (xq[2 * p], xq[2 * p + 1]);
                        let (pa, pb) = (
                            act::<N, T>(&xq, &ta, 2 * p).add(QK_K * b),
                            act::<N, T>(&xq, &ta, 2 * p + 1).add(QK_K * b),
                        );
                        let dots = if T {
                            fold2(sum4(&z, pa), sum4(&z, pb))
                        } else {
                            join_i(dots4::<T>(&z, pa), dots4::<T>(&z, pb))
                        };
                        let c = k_c2(kb, b, xa, xb, dots);
                        acc2[p][b & 3] = _mm512_add_ps(acc2[p][b & 3], c);
                    }
                    if N % 2 == 1 {
                        let t = N - 1;
                        let dots = dots4::<T>(&z, act::<N, T>(&xq, &ta, t).add(QK_K * b));
                        let c = k_c(kb, b, xq[t], dots);
                        acc[t][b & 3] = _mm256_add_ps(acc[t][b & 3], c);
                    }
                }
                unpair(&acc2, &mut acc);
                trees(&acc)
            }

            #[target_feature(enable = $feat)]
            unsafe fn dot_q6_k<const N: usize, const T: bool>(
                row: &[u8],
                xq: [&ActQ8; N],
                ta: [&[i8]; N],
            ) -> [f32; N] {
                let nb = check_all(row, &xq, Q6_K_BYTES, QK_K);
                check_t::<N, T>(&ta, nb * QK_K);
                let m4 = _mm512_set1_epi8(0x0F);
                let m32 = _mm512_set1_epi8(32);
                // Per 256-bit half: the qh bit pair of sub-block k (of 4) and its shift to bits 4, 5.
                let mask01 = _mm512_inserti64x4(_mm512_set1_epi8(0x03), _mm256_set1_epi8(0x0C), 1);
                let shl01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
                let mask23 =
                    _mm512_inserti64x4(_mm512_set1_epi8(0x30), _mm256_set1_epi8(0xC0u8 as i8), 1);
                let shr23 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
                // Lane i of pair P (sub-blocks 2P, 2P+1) uses 16-value group 4P + i/4.
                let group = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
                let mut acc = [[_mm256_setzero_ps(); 4]; N];
                let mut acc2 = [[_mm512_setzero_ps(); 4]; N];
                for b in 0..nb {
                    let blk = row.as_ptr().add(Q6_K_BYTES * b);
                    let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(192) as *const __m128i));
                    // z[pp]: values 64pp..64pp+63 as unsigned q + 32 (0..63); scv[pp]: their scales.
                    let mut z = [_mm512_setzero_si512(); 4];
                    let mut scv = [_mm512_setzero_si512(); 4];
                    for h in 0..2 {
                        let ql = ld512(blk.add(64 * h));
                        let qh = _mm512_broadcast_i64x4(ld256(blk.add(128 + 32 * h)));
                        let h01 = _mm512_sllv_epi16(_mm512_and_si512(qh, mask01), shl01);
                        let h23 = _mm512_srlv_epi16(_mm512_and_si512(qh, mask23), shr23);
                        z[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), h01);
                        z[2 * h + 1] =
                            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), h23);
                    }
                    for pp in 0..4 {
                        scv[pp] = _mm512_permutexvar_epi32(
                            _mm512_add_epi32(group, _mm512_set1_epi32(4 * pp as i32)),
                            sc,
                        );
                    }
                    if T {
                        z = transpose4(z);
                        scv = transpose4(scv);
                    }
                    let d = _mm256_set1_ps(f16_one(blk.add(208)));
                    let mut is = [_mm256_setzero_si256(); N];
                    for t in 0..N {
                        let qa = act::<N, T>(&xq, &ta, t).add(QK_K * b);
                        let mut p = [_mm512_setzero_si512(); 4];
                        if T {
                            // Vectors 0, 1 hold the first 16-value group of every
                            // sub-block and 2, 3 the second: one scale each per pair.
                            let mut h = [_mm512_setzero_si512(); 2];
                            for (g, hg) in h.iter_mut().enumerate() {
                                let a0 = lda512(qa.add(128 * g));
                                let a1 = lda512(qa.add(128 * g + 64));
                                let q = dp_acc(dp(z[2 * g], a0), z[2 * g + 1], a1);
                                let m = dp_acc(dp(m32, a0), m32, a1);
                                // Σ (q - 32)·a per group of eight, exact.
                                *hg = _mm512_mullo_epi32(_mm512_sub_epi32(q, m), scv[2 * g]);
                            }
                            is[t] = fold(_mm512_add_epi32(h[0], h[1]));
                        } else {
                            for pp in 0..4 {
                                let a = lda512(qa.add(64 * pp));
                                // Σ (q - 32)·a per group of four, exact.
                                let s = _mm512_sub_epi32(dp(z[pp], a), dp(m32, a));
                                p[pp] = _mm512_mullo_epi32(s, scv[pp]);
                            }
                            is[t] = reduce4(&p);
                        }
                    }
                    add_scaled(&mut acc, &mut acc2, &xq, b, d, &is);
                }
                unpair(&acc2, &mut acc);
                trees(&acc)
            }

            #[target_feature(enable = $feat)]
            unsafe fn dot_iq4_xs<const N: usize, const T: bool>(
                row: &[u8],
                xq: [&ActQ8; N],
                ta: [&[i8]; N],
            ) -> [f32; N] {
                let nb = check_all(row, &xq, IQ4_XS_BYTES, QK_K);
                check_t::<N, T>(&ta, nb * QK_K);
                let m4 = _mm512_set1_epi8(0x0F);
                // The signed levels K, in every 128-bit lane.
                let table = _mm512_broadcast_i32x4(_mm_loadu_si128(
                    KVALUES_IQ4NL.as_ptr() as *const __m128i
                ));
                let idx0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
                let idx1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
                let mut acc = [[_mm256_setzero_ps(); 4]; N];
                let mut acc2 = [[_mm512_setzero_ps(); 4]; N];
                for b in 0..nb {
                    let blk = row.as_ptr().add(IQ4_XS_BYTES * b);
                    let mut w = [_mm512_setzero_si512(); 4];
                    for h in 0..2 {
                        // Sub-blocks 4h..4h+4, 16 bytes each: low nibbles are values 0..15,
                        // high nibbles values 16..31 of each sub-block.
                        let q = ld512(blk.add(8 + 64 * h));
                        let lo = _mm512_and_si512(q, m4);
                        let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                        w[2 * h] =
                            _mm512_shuffle_epi8(table, _mm512_permutex2var_epi64(lo, idx0, hi));
                        w[2 * h + 1] =
                            _mm512_shuffle_epi8(table, _mm512_permutex2var_epi64(lo, idx1, hi));
                    }
                    if T {
                        w = transpose4(w);
                    }
                    let mut sw = [signed_w(w[0]); 4];
                    for k in 1..4 {
                        sw[k] = signed_w(w[k]);
                    }
                    let scales = iq4_xs_scales(blk);
                    let d = _mm256_set1_ps(f16_one(blk));
                    let mut is = [_mm256_setzero_si256(); N];
                    for t in 0..N {
                        let qa = act::<N, T>(&xq, &ta, t).add(QK_K * b);
                        let raw = unbias(dots4s::<T>(&sw, qa), xq[t].sums.as_ptr().add(8 * b));
                        is[t] = _mm256_mullo_epi32(raw, scales);
                    }
                    add_scaled(&mut acc, &mut acc2, &xq, b, d, &is);
                }
                unpair(&acc2, &mut acc);
                trees(&acc)
            }

            avx512_q8_0_q4_0!($feat);

            /// The combine tree for float rows: acc0 = accumulators 0..15, acc1 = 16..31.
            #[inline]
            #[target_feature(enable = $feat)]
            fn tree16(acc0: __m512, acc1: __m512) -> f32 {
                // w = 16.
                let v = _mm512_add_ps(acc0, acc1);
                // w = 8.
                let lo = _mm512_castps512_ps256(v);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
                let v8 = _mm256_add_ps(lo, hi);
                // w = 4, 2, 1.
                let s4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
                let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
                _mm_cvtss_f32(s1)
            }

            /// Finishes a float row: the accumulators of its whole 32-value groups
            /// (`acc0` = 0..15, `acc1` = 16..31), then elements `whole..n` through
            /// `scalar::float_tail` (the same fmas into the same accumulators).
            #[inline]
            #[target_feature(enable = $feat)]
            fn float_finish(
                acc0: __m512,
                acc1: __m512,
                whole: usize,
                n: usize,
                x: &[f32],
                weight: impl Fn(usize) -> f32,
            ) -> f32 {
                if whole == n {
                    return tree16(acc0, acc1);
                }
                let mut a = [0f32; 32];
                // SAFETY: a[0..16] and a[16..32] are in bounds.
                unsafe {
                    _mm512_storeu_ps(a.as_mut_ptr(), acc0);
                    _mm512_storeu_ps(a.as_mut_ptr().add(16), acc1);
                }
                scalar::float_tail(&mut a, whole..n, x, weight);
                crate::combine_lanes(a)
            }

            #[target_feature(enable = $feat)]
            unsafe fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
                let n = row.len() / 4;
                assert!(x.len() >= n);
                let (w, xp) = (row.as_ptr() as *const f32, x.as_ptr());
                let whole = n - n % 32;
                let mut a0 = _mm512_setzero_ps();
                let mut a1 = _mm512_setzero_ps();
                for i in (0..whole).step_by(32) {
                    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w.add(i)), _mm512_loadu_ps(xp.add(i)), a0);
                    a1 = _mm512_fmadd_ps(
                        _mm512_loadu_ps(w.add(i + 16)),
                        _mm512_loadu_ps(xp.add(i + 16)),
                        a1,
                    );
                }
                float_finish(a0, a1, whole, n, x, |i| scalar::f32_at(row, i))
            }

            #[target_feature(enable = $feat)]
            unsafe fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
                let n = row.len() / 2;
                assert!(x.len() >= n);
                let (w, xp) = (row.as_ptr(), x.as_ptr());
                let whole = n - n % 32;
                let mut a0 = _mm512_setzero_ps();
                let mut a1 = _mm512_setzero_ps();
                for i in (0..whole).step_by(32) {
                    let w0 = _mm512_cvtph_ps(ld256(w.add(2 * i)));
                    let w1 = _mm512_cvtph_ps(ld256(w.add(2 * i + 32)));
                    a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp.add(i)), a0);
                    a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp.add(i + 16)), a1);
                }
                float_finish(a0, a1, whole, n, x, |i| scalar::f16_elem(row, i))
            }

            #[target_feature(enable = $feat)]
            unsafe fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
                let n = row.len() / 2;
                assert!(x.len() >= n);
                let (w, xp) = (row.as_ptr(), x.as_ptr());
                let widen = |p: *const u8| {
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ld256(p)), 16))
                };
                let whole = n - n % 32;
                let mut a0 = _mm512_setzero_ps();
                let mut a1 = _mm512_setzero_ps();
                for i in (0..whole).step_by(32) {
                    a0 = _mm512_fmadd_ps(widen(w.add(2 * i)), _mm512_loadu_ps(xp.add(i)), a0);
                    a1 = _mm512_fmadd_ps(
                        widen(w.add(2 * i + 32)),
                        _mm512_loadu_ps(xp.add(i + 16)),
                        a1,
                    );
                }
                float_finish(a0, a1, whole, n, x, |i| scalar::bf16_elem(row, i))
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
avx512_kernels!(vnni, "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c", crate::isa::Avx512Proof, vnni: true);
#[cfg(target_arch = "x86_64")]
avx512_kernels!(bw, "avx512f,avx512bw,avx512vl,avx2,fma,f16c", crate::isa::Avx512BwProof, vnni: false);
