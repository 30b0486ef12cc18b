//! AVX2 (+FMA, F16C) kernels: the canonical order with 32 accumulators held as
//! four 8-lane vectors (vector k holds accumulators 8k..8k+7).
//!
//! Integer dots use `maddubs` (unsigned × signed bytes → i16 pairs) and `madd`
//! (→ i32); no i16 sum can saturate: the unsigned operand is at most 63 (or 128
//! for the sign trick on int8 weights) and the activations at most 127 in size.
//! Each sub-block's eight i32 partial sums are reduced to one lane with `hsum8x8`,
//! so that the float sequence runs with one sub-block per lane, exactly as in
//! `scalar.rs`.
//!
//! The quantized kernels take a tile of N tokens (`matmul`; N = 1 is the single-row
//! dot). With `T` (many tokens) they read `transpose_act` activations and transpose
//! each unpacked weight block (8×8 dwords) the same way, so that lane i of every
//! vector is sub-block i: vertical sums replace `hsum8x8`.

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::{kernel, multi};

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn multi(_ty: crate::GgmlType, _proof: crate::isa::Avx2Proof) -> Option<crate::Multi> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn kernel(ty: crate::GgmlType, _proof: crate::isa::Avx2Proof) -> crate::Kernel {
    crate::scalar_kernel(ty)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod imp {
    use std::arch::x86_64::*;

    use crate::formats::*;
    use crate::isa::Avx2Proof;
    use crate::scalar;
    use crate::{ActQ8, GgmlType, Kernel, Multi};

    pub(crate) fn kernel(ty: GgmlType, _proof: Avx2Proof) -> Kernel {
        use GgmlType as T;
        // SAFETY (every wrapper below): the wrappers are only handed out here, and
        // `Avx2Proof` exists only once avx2, fma and f16c were detected on this CPU.
        macro_rules! q {
            ($f:ident) => {{
                fn w(row: &[u8], xq: &ActQ8) -> f32 {
                    unsafe { $f::<1, false>(row, [xq], [&[]])[0] }
                }
                Kernel::Q(w)
            }};
        }
        macro_rules! f {
            ($f:ident) => {{
                fn w(row: &[u8], x: &[f32]) -> f32 {
                    unsafe { $f(row, x) }
                }
                Kernel::F(w)
            }};
        }
        match ty {
            T::F32 => f!(dot_f32),
            T::F16 => f!(dot_f16),
            T::BF16 => f!(dot_bf16),
            T::Q8_0 => q!(dot_q8_0),
            T::Q4_0 => q!(dot_q4_0),
            T::Q4_K => q!(dot_q4_k),
            T::Q5_K => q!(dot_q5_k),
            T::Q6_K => q!(dot_q6_k),
            T::IQ4_XS => q!(dot_iq4_xs),
            other => crate::scalar_kernel(other),
        }
    }

    /// The many-token kernel of `ty` (tiles of up to 4 tokens), if it has one.
    pub(crate) fn multi(ty: GgmlType, _proof: Avx2Proof) -> Option<Multi> {
        use GgmlType as T;
        // SAFETY (every wrapper below): as in `kernel`.
        Some(match ty {
            T::Q8_0 => multi_wrap!(dot_q8_0, transpose_act, 4, 2, 1),
            T::Q4_0 => multi_wrap!(dot_q4_0, transpose_act, 4, 2, 1),
            T::Q4_K => multi_wrap!(dot_q4_k, transpose_act, 4, 2, 1),
            T::Q5_K => multi_wrap!(dot_q5_k, transpose_act, 4, 2, 1),
            T::Q6_K => multi_wrap!(dot_q6_k, transpose_act, 4, 2, 1),
            T::IQ4_XS => multi_wrap!(dot_iq4_xs, transpose_act, 4, 2, 1),
            _ => return None,
        })
    }

    /// Lane j of the result = the sum of the eight i32 lanes of v[j] (exact).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn hsum8x8(v: &[__m256i; 8]) -> __m256i {
        let a01 = _mm256_hadd_epi32(v[0], v[1]);
        let a23 = _mm256_hadd_epi32(v[2], v[3]);
        let a45 = _mm256_hadd_epi32(v[4], v[5]);
        let a67 = _mm256_hadd_epi32(v[6], v[7]);
        let b0 = _mm256_hadd_epi32(a01, a23);
        let b1 = _mm256_hadd_epi32(a45, a67);
        let lo = _mm256_permute2x128_si256(b0, b1, 0x20);
        let hi = _mm256_permute2x128_si256(b0, b1, 0x31);
        _mm256_add_epi32(lo, hi)
    }

    /// The fixed combine tree over accumulators acc[k] = lanes 8k..8k+7.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn tree(acc: &[__m256; 4]) -> f32 {
        // w = 16: lanes 0..15 += lanes 16..31.
        let a0 = _mm256_add_ps(acc[0], acc[2]);
        let a1 = _mm256_add_ps(acc[1], acc[3]);
        // w = 8.
        let v = _mm256_add_ps(a0, a1);
        // w = 4.
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        // w = 2.
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        // w = 1.
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn ld(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn lda(p: *const i8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// d (f16 at p) and the following f16 (dmin) as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1)))
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn f16_one(p: *const u8) -> f32 {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32));
        _mm_cvtss_f32(v)
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

    /// The 6-bit scales and mins of a Q4_K/Q5_K block as two 8-byte words
    /// (byte j = sub-block j), from the 12 packed bytes at p.
    #[inline(always)]
    pub(crate) unsafe fn k_scales(p: *const u8) -> (u64, u64) {
        let w0 = (p as *const u32).read_unaligned();
        let w1 = (p.add(4) as *const u32).read_unaligned();
        let w2 = (p.add(8) as *const u32).read_unaligned();
        let sc_lo = w0 & 0x3f3f_3f3f;
        let m_lo = w1 & 0x3f3f_3f3f;
        let sc_hi = (w2 & 0x0f0f_0f0f) | (((w0 >> 6) & 0x0303_0303) << 4);
        let m_hi = ((w2 >> 4) & 0x0f0f_0f0f) | (((w1 >> 6) & 0x0303_0303) << 4);
        (
            sc_lo as u64 | (sc_hi as u64) << 32,
            m_lo as u64 | (m_hi as u64) << 32,
        )
    }

    /// The float part shared by every 8-sub-block group: `c = (d * da) * isum`,
    /// lanes = sub-blocks.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_c(d: __m256, da: __m256, isum: __m256i) -> __m256 {
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
    #[target_feature(enable = "avx2,fma,f16c")]
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

    /// Q4_K / Q5_K float part: `c = (d*da)*is; c = fma(-(dmin*da), im, c)`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
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

    /// Sub-block j's dot in lane j: unsigned weights `w[j]` against the 32 activations
    /// at `qa + 32j` (exact).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots8<const T: bool>(w: &[__m256i; 8], qa: *const i8, sum16: usize) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        if T {
            // Lane i is sub-block i in every vector: vertical sums, `sum16` i16
            // partials at a time (the caller's bound keeps them below 2^15).
            let mut acc = _mm256_setzero_si256();
            for j0 in (0..8).step_by(sum16) {
                let mut p = _mm256_maddubs_epi16(w[j0], lda(qa.add(SUB * j0)));
                for j in j0 + 1..j0 + sum16 {
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[j], lda(qa.add(SUB * j))));
                }
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
            }
            return acc;
        }
        let mut v = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], lda(qa.add(SUB * j))), ones);
        }
        hsum8x8(&v)
    }

    /// [`dots8`] (untransposed) of the activation vectors `a[j]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dots8_v(w: &[__m256i; 8], a: &[__m256i; 8]) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let mut v = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], a[j]), ones);
        }
        hsum8x8(&v)
    }

    /// [`dots8_signed`] (untransposed) of the activation vectors `a[j]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dots8_signed_v(w: &[__m256i; 8], aw: &[__m256i; 8], a: &[__m256i; 8]) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let mut v = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            v[j] = _mm256_madd_epi16(
                _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(a[j], w[j])),
                ones,
            );
        }
        hsum8x8(&v)
    }

    /// Signed weights `w[j]` (and `|w[j]|` in `aw[j]`) against the activations at
    /// `qa + 32j`: `|w|` as unsigned (|-128| = 128 fits), the sign moved onto a (exact).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots8_signed<const T: bool>(
        w: &[__m256i; 8],
        aw: &[__m256i; 8],
        qa: *const i8,
    ) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let mut v = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            let a = lda(qa.add(SUB * j));
            v[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(a, w[j])), ones);
        }
        if T {
            // Lane i is sub-block i in every vector.
            let s01 = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
            let s23 = _mm256_add_epi32(_mm256_add_epi32(v[4], v[5]), _mm256_add_epi32(v[6], v[7]));
            return _mm256_add_epi32(s01, s23);
        }
        hsum8x8(&v)
    }

    /// The 8×8 dword transpose: result k, lane i = dword k of `n[i]` (the layout of
    /// [`transpose_act`] when `n[i]` holds sub-block i).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn transpose8(n: [__m256i; 8]) -> [__m256i; 8] {
        let t0 = _mm256_unpacklo_epi32(n[0], n[1]);
        let t1 = _mm256_unpackhi_epi32(n[0], n[1]);
        let t2 = _mm256_unpacklo_epi32(n[2], n[3]);
        let t3 = _mm256_unpackhi_epi32(n[2], n[3]);
        let t4 = _mm256_unpacklo_epi32(n[4], n[5]);
        let t5 = _mm256_unpackhi_epi32(n[4], n[5]);
        let t6 = _mm256_unpacklo_epi32(n[6], n[7]);
        let t7 = _mm256_unpackhi_epi32(n[6], n[7]);
        let u0 = _mm256_unpacklo_epi64(t0, t2);
        let u1 = _mm256_unpackhi_epi64(t0, t2);
        let u2 = _mm256_unpacklo_epi64(t1, t3);
        let u3 = _mm256_unpackhi_epi64(t1, t3);
        let u4 = _mm256_unpacklo_epi64(t4, t6);
        let u5 = _mm256_unpackhi_epi64(t4, t6);
        let u6 = _mm256_unpacklo_epi64(t5, t7);
        let u7 = _mm256_unpackhi_epi64(t5, t7);
        [
            _mm256_permute2x128_si256(u0, u4, 0x20),
            _mm256_permute2x128_si256(u1, u5, 0x20),
            _mm256_permute2x128_si256(u2, u6, 0x20),
            _mm256_permute2x128_si256(u3, u7, 0x20),
            _mm256_permute2x128_si256(u0, u4, 0x31),
            _mm256_permute2x128_si256(u1, u5, 0x31),
            _mm256_permute2x128_si256(u2, u6, 0x31),
            _mm256_permute2x128_si256(u3, u7, 0x31),
        ]
    }

    /// Activations in the layout of the AVX2 many-token kernels: within each whole
    /// 256-value group, 32-byte vector k, dword lane i holds values 4k..4k+4 of
    /// sub-block i ([`transpose8`] of the group as loaded). A trailing partial group
    /// keeps its order. Reached only through [`multi`], i.e. once the features were
    /// detected.
    fn transpose_act(qs: &[i8]) -> Vec<i8> {
        let mut out = qs.to_vec();
        // SAFETY: see above; every access is within a whole 256-byte group.
        unsafe { transpose_groups(qs, &mut out) };
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn transpose_groups(qs: &[i8], out: &mut [i8]) {
        assert_eq!(qs.len(), out.len());
        for g in 0..qs.len() / 256 {
            let src = qs.as_ptr().add(256 * g);
            let dst = out.as_mut_ptr().add(256 * g);
            let mut n = [_mm256_setzero_si256(); 8];
            for (j, v) in n.iter_mut().enumerate() {
                *v = lda(src.add(32 * j));
            }
            for (k, v) in transpose8(n).into_iter().enumerate() {
                _mm256_storeu_si256(dst.add(32 * k) as *mut __m256i, v);
            }
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
    #[target_feature(enable = "avx2,fma,f16c")]
    fn trees<const N: usize>(acc: &[[__m256; 4]; N]) -> [f32; N] {
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = tree(&acc[t]);
        }
        out
    }

    // Every quantized kernel below computes N tokens against one row: each block's
    // weights are unpacked once, then every token runs the canonical sequence into
    // its own 32 accumulators (N = 1 is the single-row dot).

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_q4_k<const N: usize, const T: bool>(
        row: &[u8],
        xq: [&ActQ8; N],
        ta: [&[i8]; N],
    ) -> [f32; N] {
        let nb = check_all(row, &xq, Q4_K_BYTES, QK_K);
        check_t::<N, T>(&ta, nb * QK_K);
        // i16 partials of q ≤ 15: eight add up below 2^15.
        const SUM16: usize = 8;
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        for b in 0..nb {
            let blk = row.as_ptr().add(Q4_K_BYTES * b);
            let mut w = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let q = ld(blk.add(16 + 32 * c));
                w[2 * c] = _mm256_and_si256(q, m4);
                w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            }
            if T {
                w = transpose8(w);
            }
            let kb = k_block(blk);
            for t in 0..N {
                let dots = dots8::<T>(&w, act::<N, T>(&xq, &ta, t).add(QK_K * b), SUM16);
                let c = k_c(kb, b, xq[t], dots);
                acc[t][b & 3] = _mm256_add_ps(acc[t][b & 3], c);
            }
        }
        trees(&acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_q5_k<const N: usize, const T: bool>(
        row: &[u8],
        xq: [&ActQ8; N],
        ta: [&[i8]; N],
    ) -> [f32; N] {
        let nb = check_all(row, &xq, Q5_K_BYTES, QK_K);
        check_t::<N, T>(&ta, nb * QK_K);
        // i16 partials of q ≤ 31: four add up below 2^15.
        const SUM16: usize = 4;
        let m4 = _mm256_set1_epi8(0x0F);
        let b4 = _mm256_set1_epi8(0x10);
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        for b in 0..nb {
            let blk = row.as_ptr().add(Q5_K_BYTES * b);
            let mut qh = ld(blk.add(16));
            let mut w = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let q = ld(blk.add(48 + 32 * c));
                // Bits 2c and 2c+1 of qh sit in bits 0 and 1 of each byte here.
                w[2 * c] = _mm256_or_si256(
                    _mm256_and_si256(q, m4),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), b4),
                );
                w[2 * c + 1] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 3), b4),
                );
                qh = _mm256_srli_epi16(qh, 2);
            }
            if T {
                w = transpose8(w);
            }
            let kb = k_block(blk);
            for t in 0..N {
                let dots = dots8::<T>(&w, act::<N, T>(&xq, &ta, t).add(QK_K * b), SUM16);
                let c = k_c(kb, b, xq[t], dots);
                acc[t][b & 3] = _mm256_add_ps(acc[t][b & 3], c);
            }
        }
        trees(&acc)
    }

    /// The four 32-value sub-blocks of one Q6_K half as unsigned 0..63 bytes
    /// (q + 32), from ql (64 bytes) and qh (32 bytes).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn q6_half(ql: *const u8, qh: *const u8) -> [__m256i; 4] {
        let m4 = _mm256_set1_epi8(0x0F);
        let ql0 = ld(ql);
        let ql1 = ld(ql.add(32));
        let h = ld(qh);
        let h0 = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x03)), 4);
        let h1 = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x0C)), 2);
        let h2 = _mm256_and_si256(h, _mm256_set1_epi8(0x30));
        let h3 = _mm256_srli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0xC0u8 as i8)), 2);
        [
            _mm256_or_si256(_mm256_and_si256(ql0, m4), h0),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), h1),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), h2),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), h3),
        ]
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_q6_k<const N: usize, const T: bool>(
        row: &[u8],
        xq: [&ActQ8; N],
        ta: [&[i8]; N],
    ) -> [f32; N] {
        let nb = check_all(row, &xq, Q6_K_BYTES, QK_K);
        check_t::<N, T>(&ta, nb * QK_K);
        let m32 = _mm256_set1_epi8(32);
        // Within each 128-bit half of a (scale_lo, scale_hi) i16 pair broadcast:
        // low half takes bytes 0,1 (scale_lo), high half bytes 2,3 (scale_hi).
        let pick = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
            3, 2, 3,
        );
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        for b in 0..nb {
            let blk = row.as_ptr().add(Q6_K_BYTES * b);
            // 16 int8 scales → 16 i16; i32 lane j holds the pair (sc[2j], sc[2j+1]).
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
            let mut w = [_mm256_setzero_si256(); 8];
            let mut scv = [_mm256_setzero_si256(); 8];
            for h in 0..2 {
                let q = q6_half(blk.add(64 * h), blk.add(128 + 32 * h));
                for k in 0..4 {
                    let j = 4 * h + k;
                    w[j] = q[k];
                    let pair = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(j as i32));
                    scv[j] = _mm256_shuffle_epi8(pair, pick);
                }
            }
            let d = _mm256_set1_ps(f16_one(blk.add(208)));
            // Transposed: vectors 0..3 hold values 0..15 of every sub-block (lane i =
            // sub-block i), vectors 4..7 values 16..31; i32 lane i of `slo` / `shi`
            // is sub-block i's first / second group scale as an i16 pair.
            let slo = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(sc16, 0xA0), 0xA0);
            let shi = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(sc16, 0xF5), 0xF5);
            if T {
                w = transpose8(w);
            }
            for t in 0..N {
                let qa = act::<N, T>(&xq, &ta, t).add(QK_K * b);
                if T {
                    let mut ps = [_mm256_setzero_si256(); 2];
                    for j in 0..8 {
                        let a = lda(qa.add(SUB * j));
                        // Σ (q - 32)·a over byte pairs (|·| ≤ 8128): four add up
                        // below 2^15.
                        let p = _mm256_sub_epi16(
                            _mm256_maddubs_epi16(w[j], a),
                            _mm256_maddubs_epi16(m32, a),
                        );
                        ps[j / 4] = _mm256_add_epi16(ps[j / 4], p);
                    }
                    let isum = _mm256_add_epi32(
                        _mm256_madd_epi16(ps[0], slo),
                        _mm256_madd_epi16(ps[1], shi),
                    );
                    let da = _mm256_loadu_ps(xq[t].d.as_ptr().add(8 * b));
                    acc[t][b & 3] = _mm256_add_ps(acc[t][b & 3], scale_c(d, da, isum));
                    continue;
                }
                let mut v = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    let a = lda(qa.add(SUB * j));
                    // Σ (q - 32)·a over byte pairs, exact in i16.
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(w[j], a),
                        _mm256_maddubs_epi16(m32, a),
                    );
                    v[j] = _mm256_madd_epi16(p, scv[j]);
                }
                let isum = hsum8x8(&v);
                let da = _mm256_loadu_ps(xq[t].d.as_ptr().add(8 * b));
                acc[t][b & 3] = _mm256_add_ps(acc[t][b & 3], scale_c(d, da, isum));
            }
        }
        trees(&acc)
    }

    /// The eight `ls - 32` scales of an IQ4_XS block as i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn iq4_xs_scales(blk: *const u8) -> __m256i {
        let b = std::slice::from_raw_parts(blk, 8);
        let mut s = [0i32; 8];
        for (ib, v) in s.iter_mut().enumerate() {
            *v = iq4_xs_scale(b, ib);
        }
        _mm256_loadu_si256(s.as_ptr() as *const __m256i)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_iq4_xs<const N: usize, const T: bool>(
        row: &[u8],
        xq: [&ActQ8; N],
        ta: [&[i8]; N],
    ) -> [f32; N] {
        let nb = check_all(row, &xq, IQ4_XS_BYTES, QK_K);
        check_t::<N, T>(&ta, nb * QK_K);
        let m4 = _mm256_set1_epi8(0x0F);
        let table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i));
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        for b in 0..nb {
            let blk = row.as_ptr().add(IQ4_XS_BYTES * b);
            let mut w = [_mm256_setzero_si256(); 8];
            let mut aw = [_mm256_setzero_si256(); 8];
            for p in 0..4 {
                // Sub-blocks 2p and 2p+1: 16 bytes each.
                let q = ld(blk.add(8 + 32 * p));
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                w[2 * p] = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20));
                w[2 * p + 1] = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31));
            }
            if T {
                w = transpose8(w);
            }
            for j in 0..8 {
                aw[j] = _mm256_sign_epi8(w[j], w[j]);
            }
            let scales = iq4_xs_scales(blk);
            let d = _mm256_set1_ps(f16_one(blk));
            for t in 0..N {
                let raw = dots8_signed::<T>(&w, &aw, act::<N, T>(&xq, &ta, t).add(QK_K * b));
                let isum = _mm256_mullo_epi32(raw, scales);
                let da = _mm256_loadu_ps(xq[t].d.as_ptr().add(8 * b));
                acc[t][b & 3] = _mm256_add_ps(acc[t][b & 3], scale_c(d, da, isum));
            }
        }
        trees(&acc)
    }

    /// Eight f16 block scales at stride `stride` bytes, as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16x8(p: *const u8, stride: usize) -> __m256 {
        let mut h = [0u16; 8];
        for (k, v) in h.iter_mut().enumerate() {
            *v = (p.add(stride * k) as *const u16).read_unaligned();
        }
        _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i))
    }

    // The last partial group of a Q8_0 / Q4_0 row (r = nb % 8 blocks, 1..=7) runs as
    // one more group of 8 whose blocks r..8 are padding: weights and activations 0 (so
    // the integer dot is 0), activation scale and sum 0, and weight scale -0.0. A padded
    // lane's contribution is then `(-0.0 * +0.0) * 0.0 = -0.0`, and `acc + -0.0 == acc`
    // for every acc (`+ +0.0` would turn a -0.0 accumulator into +0.0; accumulators
    // that start at +0.0 never become -0.0 when rounding to nearest, but the identity
    // need not rely on that). The real blocks go through the float sequence of
    // `scalar.rs` (`acc[s % 32] += (d * da) * isum`; group g goes into vector g & 3,
    // and sub-block 8g + k is accumulator 8(g & 3) + k = (8g + k) % 32). Nothing past
    // the row or the activations is read. The partial group keeps its order in the
    // transposed activations too (`transpose_act`), so every token's tail reads `qs`.

    /// Lanes k < r: -1 (r ≤ 8).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn tail_mask(r: usize) -> __m256i {
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(r as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    }

    /// [`f16x8`] of the first r (< 8) blocks at p; lanes r..8 are -0.0 (see above).
    /// Built in a register: eight 2-byte stores read back as one 16-byte load would
    /// stall the store forwarding.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn f16x8_tail(p: *const u8, stride: usize, r: usize) -> __m256 {
        let mut h = _mm_set1_epi16(0x8000u16 as i16);
        macro_rules! lane {
            ($($k:literal),+) => {$(
                if $k < r {
                    let v = (p.add(stride * $k) as *const u16).read_unaligned();
                    h = _mm_insert_epi16::<$k>(h, v as i32);
                }
            )+};
        }
        lane!(0, 1, 2, 3, 4, 5, 6);
        _mm256_cvtph_ps(h)
    }

    /// The 32 activations of each of the first r (< 8) sub-blocks at qa, zeros after.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn act_tail(qa: *const i8, r: usize) -> [__m256i; 8] {
        let mut a = [_mm256_setzero_si256(); 8];
        for (k, v) in a.iter_mut().enumerate() {
            if k < r {
                *v = lda(qa.add(SUB * k));
            }
        }
        a
    }

    /// Adds `c = (d * da) * isum` of a partial group (`mask` = [`tail_mask`]; the
    /// activation scales past it read as +0.0) at sub-block 8g to `acc[g & 3]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn add_tail(
        acc: &mut [__m256; 4],
        g: usize,
        d: __m256,
        xq: &ActQ8,
        mask: __m256i,
        isum: __m256i,
    ) {
        let da = _mm256_maskload_ps(xq.d.as_ptr().add(8 * g), mask);
        let c = scale_c(d, da, isum);
        // Constant indices: `acc` may then stay in registers.
        match g & 3 {
            0 => acc[0] = _mm256_add_ps(acc[0], c),
            1 => acc[1] = _mm256_add_ps(acc[1], c),
            2 => acc[2] = _mm256_add_ps(acc[2], c),
            _ => acc[3] = _mm256_add_ps(acc[3], c),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_q8_0<const N: usize, const T: bool>(
        row: &[u8],
        xq: [&ActQ8; N],
        ta: [&[i8]; N],
    ) -> [f32; N] {
        let nb = check_all(row, &xq, Q8_0_BYTES, SUB);
        check_t::<N, T>(&ta, nb * SUB);
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        let groups = nb / 8;
        for g in 0..groups {
            let base = row.as_ptr().add(Q8_0_BYTES * 8 * g);
            let mut w = [_mm256_setzero_si256(); 8];
            let mut aw = [_mm256_setzero_si256(); 8];
            for k in 0..8 {
                w[k] = ld(base.add(Q8_0_BYTES * k + 2));
            }
            if T {
                w = transpose8(w);
            }
            for k in 0..8 {
                aw[k] = _mm256_sign_epi8(w[k], w[k]);
            }
            let d = f16x8(base, Q8_0_BYTES);
            for t in 0..N {
                let isum = dots8_signed::<T>(&w, &aw, act::<N, T>(&xq, &ta, t).add(SUB * 8 * g));
                let da = _mm256_loadu_ps(xq[t].d.as_ptr().add(8 * g));
                acc[t][g & 3] = _mm256_add_ps(acc[t][g & 3], scale_c(d, da, isum));
            }
        }
        let r = nb - 8 * groups;
        if r > 0 {
            // The partial group (see `tail_mask`).
            let g = groups;
            let base = row.as_ptr().add(Q8_0_BYTES * 8 * g);
            let mut w = [_mm256_setzero_si256(); 8];
            for (k, wk) in w.iter_mut().enumerate() {
                if k < r {
                    *wk = ld(base.add(Q8_0_BYTES * k + 2));
                }
            }
            let mut aw = [_mm256_setzero_si256(); 8];
            for k in 0..8 {
                aw[k] = _mm256_sign_epi8(w[k], w[k]);
            }
            let d = f16x8_tail(base, Q8_0_BYTES, r);
            let mask = tail_mask(r);
            for t in 0..N {
                let a = act_tail(xq[t].qs.as_ptr().add(SUB * 8 * g), r);
                let isum = dots8_signed_v(&w, &aw, &a);
                add_tail(&mut acc[t], g, d, xq[t], mask, isum);
            }
        }
        trees(&acc)
    }

    /// The 32 values (0..15) of the Q4_0 block whose 16 quant bytes are at p.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_0_unpack(p: *const u8, m4: __m256i) -> __m256i {
        let q = _mm_loadu_si128(p as *const __m128i);
        // Low nibbles are values 0..15, high nibbles values 16..31.
        let qq = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
        _mm256_and_si256(qq, m4)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_q4_0<const N: usize, const T: bool>(
        row: &[u8],
        xq: [&ActQ8; N],
        ta: [&[i8]; N],
    ) -> [f32; N] {
        let nb = check_all(row, &xq, Q4_0_BYTES, SUB);
        check_t::<N, T>(&ta, nb * SUB);
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        let groups = nb / 8;
        for g in 0..groups {
            let base = row.as_ptr().add(Q4_0_BYTES * 8 * g);
            let mut w = [_mm256_setzero_si256(); 8];
            for (k, wk) in w.iter_mut().enumerate() {
                *wk = q4_0_unpack(base.add(Q4_0_BYTES * k + 2), m4);
            }
            if T {
                w = transpose8(w);
            }
            let d = f16x8(base, Q4_0_BYTES);
            for t in 0..N {
                // i16 partials of q ≤ 15: eight add up below 2^15.
                let dots = dots8::<T>(&w, act::<N, T>(&xq, &ta, t).add(SUB * 8 * g), 8);
                // Σ (q - 8)·a = Σ q·a - 8·asum.
                let sums = _mm256_loadu_si256(xq[t].sums.as_ptr().add(8 * g) as *const __m256i);
                let isum = _mm256_sub_epi32(dots, _mm256_slli_epi32(sums, 3));
                let da = _mm256_loadu_ps(xq[t].d.as_ptr().add(8 * g));
                acc[t][g & 3] = _mm256_add_ps(acc[t][g & 3], scale_c(d, da, isum));
            }
        }
        let r = nb - 8 * groups;
        if r > 0 {
            // The partial group (see `tail_mask`).
            let g = groups;
            let base = row.as_ptr().add(Q4_0_BYTES * 8 * g);
            let mut w = [_mm256_setzero_si256(); 8];
            for (k, wk) in w.iter_mut().enumerate() {
                if k < r {
                    *wk = q4_0_unpack(base.add(Q4_0_BYTES * k + 2), m4);
                }
            }
            let d = f16x8_tail(base, Q4_0_BYTES, r);
            let mask = tail_mask(r);
            for t in 0..N {
                let a = act_tail(xq[t].qs.as_ptr().add(SUB * 8 * g), r);
                let dots = dots8_v(&w, &a);
                let sums = _mm256_maskload_epi32(xq[t].sums.as_ptr().add(8 * g), mask);
                let isum = _mm256_sub_epi32(dots, _mm256_slli_epi32(sums, 3));
                add_tail(&mut acc[t], g, d, xq[t], mask, isum);
            }
        }
        trees(&acc)
    }

    /// Float rows: element i → accumulator i % 32 by fma; `load(i)` gives the
    /// weights i..i+8 as f32 (called for whole 32-value groups only). A row whose
    /// length is not a multiple of 32 finishes its last elements through
    /// `scalar::float_tail` (`weight(i)`: weight i as f32), the same fmas into the
    /// same accumulators.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_float(
        n: usize,
        x: &[f32],
        load: impl Fn(usize) -> __m256,
        weight: impl Fn(usize) -> f32,
    ) -> f32 {
        assert!(x.len() >= n);
        let xp = x.as_ptr();
        let whole = n - n % 32;
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..whole).step_by(32) {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(load(i + 8 * k), _mm256_loadu_ps(xp.add(i + 8 * k)), *a);
            }
        }
        if whole == n {
            return tree(&acc);
        }
        let mut a = [0f32; 32];
        for k in 0..4 {
            _mm256_storeu_ps(a.as_mut_ptr().add(8 * k), acc[k]);
        }
        scalar::float_tail(&mut a, whole..n, x, weight);
        crate::combine_lanes(a)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
        let n = row.len() / 4;
        let p = row.as_ptr() as *const f32;
        dot_float(
            n,
            x,
            |i| _mm256_loadu_ps(p.add(i)),
            |i| scalar::f32_at(row, i),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
        let n = row.len() / 2;
        let p = row.as_ptr();
        dot_float(
            n,
            x,
            |i| _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i) as *const __m128i)),
            |i| scalar::f16_elem(row, i),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
        let n = row.len() / 2;
        let p = row.as_ptr();
        dot_float(
            n,
            x,
            |i| {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * i) as *const __m128i));
                _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
            },
            |i| scalar::bf16_elem(row, i),
        )
    }
}
