//! AVX2 and AVX-512 kernels of the low-bit types (`lowbit.rs`), one body per level for
//! all of them over the canonical integer form.
//!
//! A group of 8 sub-blocks is decoded once ([`crate::lowbit::Spec::decode_group`]:
//! integer work, exact however it is done) and every token of the tile then runs the
//! canonical sequence on it: the two 16-value halves' integer dots times their
//! multipliers summed into one i32 per sub-block (`maddubs` on |w| and the activations
//! carrying w's sign, then `madd` with the multipliers as i16 pairs; with VNNI,
//! `vpdpbusd` then a 32-bit multiply), the eight sub-blocks' integers reduced to one
//! lane each, and the float sequence on 8-lane vectors, one sub-block per lane, exactly
//! as `lowbit::contrib`. Bounds: |w| ≤ 127 and |a| ≤ 127, so a pair of products is at
//! most 32,258 (no i16 saturation), and multipliers are at most 32 in size.
//!
//! NVFP4's second float scale (`Min::Split`) takes the same products with the second
//! multipliers (`emul`). A row's last partial group (32- and 64-value blocks) runs through the scalar
//! contribution, the same float operations into the same accumulators.

#[cfg(target_arch = "x86_64")]
pub(crate) use imp::*;

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn avx2_kernel(
    _ty: crate::GgmlType,
    _proof: crate::isa::Avx2Proof,
) -> Option<crate::Kernel> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn avx512_kernel(
    _ty: crate::GgmlType,
    _proof: crate::isa::Avx512Proof,
) -> Option<crate::Kernel> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn avx512bw_kernel(
    _ty: crate::GgmlType,
    _proof: crate::isa::Avx512BwProof,
) -> Option<crate::Kernel> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn avx2_multi(
    _ty: crate::GgmlType,
    _proof: crate::isa::Avx2Proof,
) -> Option<crate::Multi> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn avx512_multi(
    _ty: crate::GgmlType,
    _proof: crate::isa::Avx512Proof,
) -> Option<crate::Multi> {
    None
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn avx512bw_multi(
    _ty: crate::GgmlType,
    _proof: crate::isa::Avx512BwProof,
) -> Option<crate::Multi> {
    None
}

/// Calls `$m!(Type)` for every low-bit type, inside a `match $ty { ... }` whose other
/// arm returns None.
#[cfg(target_arch = "x86_64")]
macro_rules! by_type {
    ($ty:expr, $m:ident) => {
        match $ty {
            GgmlType::Q2_K => $m!(Q2_K),
            GgmlType::Q3_K => $m!(Q3_K),
            GgmlType::Q4_1 => $m!(Q4_1),
            GgmlType::Q5_0 => $m!(Q5_0),
            GgmlType::Q5_1 => $m!(Q5_1),
            GgmlType::IQ4_NL => $m!(IQ4_NL),
            GgmlType::MXFP4 => $m!(MXFP4),
            GgmlType::TQ1_0 => $m!(TQ1_0),
            GgmlType::TQ2_0 => $m!(TQ2_0),
            GgmlType::IQ2_XXS => $m!(IQ2_XXS),
            GgmlType::IQ2_XS => $m!(IQ2_XS),
            GgmlType::IQ2_S => $m!(IQ2_S),
            GgmlType::IQ3_XXS => $m!(IQ3_XXS),
            GgmlType::IQ3_S => $m!(IQ3_S),
            GgmlType::IQ1_S => $m!(IQ1_S),
            GgmlType::IQ1_M => $m!(IQ1_M),
            GgmlType::NVFP4 => $m!(NVFP4),
            _ => None,
        }
    };
}

/// The `kernel` and `multi` of one level: safe wrappers around `$dot::<Kind, N>(row,
/// tokens)`. The caller's SAFETY note covers the unsafe calls.
#[cfg(target_arch = "x86_64")]
macro_rules! level_fns {
    ($kernel:ident, $multi:ident, $proof:ty, $dot:ident, $($n:literal),+) => {
        pub(crate) fn $kernel(ty: GgmlType, _proof: $proof) -> Option<Kernel> {
            macro_rules! k {
                ($t:ident) => {{
                    fn w(row: &[u8], xq: &ActQ8) -> f32 {
                        unsafe { $dot::<kinds::$t, 1>(row, [xq])[0] }
                    }
                    Some(Kernel::Q(w))
                }};
            }
            by_type!(ty, k)
        }

        pub(crate) fn $multi(ty: GgmlType, _proof: $proof) -> Option<Multi> {
            macro_rules! m {
                ($t:ident) => {{
                    fn w(row: &[u8], xqs: &[ActQ8], _ta: &[Vec<i8>], out: &mut [f32]) {
                        assert_eq!(xqs.len(), out.len());
                        let mut t = 0;
                        $(
                            while xqs.len() - t >= $n {
                                let tile: [&ActQ8; $n] = std::array::from_fn(|i| &xqs[t + i]);
                                let r = unsafe { $dot::<kinds::$t, $n>(row, tile) };
                                out[t..t + $n].copy_from_slice(&r);
                                t += $n;
                            }
                        )+
                    }
                    Some(Multi { f: w, layout: no_layout })
                }};
            }
            by_type!(ty, m)
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    use crate::avx2::imp::{hsum8x8, tree};
    use crate::formats::SUB;
    use crate::isa::{Avx2Proof, Avx512BwProof, Avx512Proof};
    use crate::lowbit::{add_group, kinds, Group, Kind, Lut, Min, Spec};
    use crate::{ActQ8, GgmlType, Kernel, Multi};

    /// These kernels read the activations as quantized: no extra layout.
    fn no_layout(_qs: &[i8]) -> Vec<i8> {
        Vec::new()
    }

    /// Decodes a whole group: the generic decoder, or for the table types a byte
    /// shuffle of their nibbles through the table (the same integers).
    #[inline(always)]
    unsafe fn decode<K: Kind>(src: &[u8], g: &mut Group) {
        match K::SPEC.lut {
            Some(lut) => decode_lut(src, &K::SPEC, &lut, g),
            None => K::SPEC.decode_group(src, 8, g),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn decode_lut(src: &[u8], sp: &Spec, lut: &Lut, g: &mut Group) {
        let (bb, per_block) = (sp.block_bytes, sp.block_vals / SUB);
        assert!(src.len() >= 8 / per_block * bb && lut.qs + 16 * per_block <= bb);
        // SAFETY: every load reads the 16 bytes of a sub-block inside a block of `src`
        // (asserted); every store writes 16 bytes inside `g.w`.
        unsafe {
            let t = _mm_loadu_si128(lut.table.as_ptr() as *const __m128i);
            let m4 = _mm_set1_epi8(0x0F);
            for j in 0..8 {
                let at = j / per_block * bb + lut.qs + 16 * (j % per_block);
                let q = _mm_loadu_si128(src.as_ptr().add(at) as *const __m128i);
                let lo = _mm_shuffle_epi8(t, _mm_and_si128(q, m4));
                let hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
                let (a, b) = if lut.runs_of_8 {
                    (_mm_unpacklo_epi64(lo, hi), _mm_unpackhi_epi64(lo, hi))
                } else {
                    (lo, hi)
                };
                let w = g.w.as_mut_ptr().add(32 * j);
                _mm_storeu_si128(w as *mut __m128i, a);
                _mm_storeu_si128(w.add(16) as *mut __m128i, b);
            }
        }
        for b in 0..8 / per_block {
            (lut.scales)(&src[b * bb..(b + 1) * bb], b * per_block, g);
        }
    }

    /// Sub-blocks of a row, after checking every token's activations cover them.
    fn check<const N: usize>(sp: &Spec, row: &[u8], xq: &[&ActQ8; N]) -> usize {
        let nb = row.len() / sp.block_bytes;
        assert_eq!(row.len(), nb * sp.block_bytes);
        let n_sub = nb * sp.block_vals / SUB;
        for x in xq {
            assert!(x.qs.len() >= SUB * n_sub && x.d.len() >= n_sub && x.sums.len() >= n_sub);
        }
        n_sub
    }

    /// The float sequence of eight sub-blocks (lanes), `is` and `ie` their integers:
    /// `c = (d * da) * is`, then the minimum's fma.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn float_part(
        min: Min,
        g: &Group,
        xq: &ActQ8,
        gi: usize,
        is: __m256i,
        ie: __m256i,
    ) -> __m256 {
        let d = _mm256_loadu_ps(g.d.as_ptr());
        let da = _mm256_loadu_ps(xq.d.as_ptr().add(8 * gi));
        let c = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(is));
        match min {
            Min::None => c,
            Min::Asum => {
                let e = _mm256_loadu_ps(g.e.as_ptr());
                let sums = _mm256_loadu_si256(xq.sums.as_ptr().add(8 * gi) as *const __m256i);
                _mm256_fmadd_ps(_mm256_mul_ps(e, da), _mm256_cvtepi32_ps(sums), c)
            }
            Min::Halves | Min::Split => {
                let e = _mm256_loadu_ps(g.e.as_ptr());
                _mm256_fmadd_ps(_mm256_mul_ps(e, da), _mm256_cvtepi32_ps(ie), c)
            }
        }
    }

    /// Finishes each token: whole groups are in `acc`; a last partial group (decoded
    /// here) goes through the scalar contribution.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish<const N: usize>(
        sp: &Spec,
        row: &[u8],
        xq: &[&ActQ8; N],
        acc: &[[__m256; 4]; N],
        groups: usize,
        n_sub: usize,
        g: &mut Group,
    ) -> [f32; N] {
        let mut out = [0f32; N];
        let rest = n_sub - 8 * groups;
        if rest > 0 {
            sp.decode_group(&row[groups * sp.group_bytes()..], rest, g);
        }
        for t in 0..N {
            if rest == 0 {
                out[t] = tree(&acc[t]);
                continue;
            }
            let mut a = [0f32; 32];
            for k in 0..4 {
                _mm256_storeu_ps(a.as_mut_ptr().add(8 * k), acc[t][k]);
            }
            add_group(sp.min, g, rest, xq[t], 8 * groups, &mut a);
            out[t] = crate::combine_lanes(a);
        }
        out
    }

    /// The AVX2 kernel of every low-bit type: N tokens against one row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_avx2<K: Kind, const N: usize>(
        row: &[u8],
        xq: [&ActQ8; N],
    ) -> [f32; N] {
        let sp = &K::SPEC;
        let n_sub = check(sp, row, &xq);
        let groups = n_sub / 8;
        let gb = sp.group_bytes();
        let ones = _mm256_set1_epi8(1);
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        let mut g = Group::default();
        for gi in 0..groups {
            decode::<K>(&row[gi * gb..], &mut g);
            let mut w = [_mm256_setzero_si256(); 8];
            let mut aw = [_mm256_setzero_si256(); 8];
            let mut mulv = [_mm256_setzero_si256(); 8];
            let mut emulv = [_mm256_setzero_si256(); 8];
            for j in 0..8 {
                w[j] = _mm256_loadu_si256(g.w.as_ptr().add(SUB * j) as *const __m256i);
                aw[j] = _mm256_sign_epi8(w[j], w[j]);
                // i16 lanes 0..7: values 0..15 (the first half), 8..15: the second.
                mulv[j] = _mm256_set_m128i(
                    _mm_set1_epi16(g.mul[2 * j + 1]),
                    _mm_set1_epi16(g.mul[2 * j]),
                );
                emulv[j] = _mm256_set_m128i(
                    _mm_set1_epi16(g.emul[2 * j + 1]),
                    _mm_set1_epi16(g.emul[2 * j]),
                );
            }
            for t in 0..N {
                let qa = xq[t].qs.as_ptr().add(SUB * 8 * gi);
                let mut v = [_mm256_setzero_si256(); 8];
                let mut ve = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    let a = _mm256_loadu_si256(qa.add(SUB * j) as *const __m256i);
                    let p = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(a, w[j]));
                    v[j] = _mm256_madd_epi16(p, mulv[j]);
                    match sp.min {
                        Min::Halves => {
                            ve[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, a), emulv[j])
                        }
                        Min::Split => ve[j] = _mm256_madd_epi16(p, emulv[j]),
                        Min::None | Min::Asum => {}
                    }
                }
                let is = hsum8x8(&v);
                let ie = if matches!(sp.min, Min::Halves | Min::Split) {
                    hsum8x8(&ve)
                } else {
                    _mm256_setzero_si256()
                };
                let c = float_part(sp.min, &g, xq[t], gi, is, ie);
                acc[t][gi & 3] = _mm256_add_ps(acc[t][gi & 3], c);
            }
        }
        finish(sp, row, &xq, &acc, groups, n_sub, &mut g)
    }

    level_fns!(avx2_kernel, avx2_multi, Avx2Proof, dot_avx2, 4, 2, 1);

    /// The AVX-512 kernels, with VNNI and without: two sub-blocks per 64-byte vector.
    macro_rules! avx512_level {
        ($dot:ident, $kernel:ident, $multi:ident, $feat:literal, $proof:ty, vnni: $vnni:literal) => {
            /// Four 16-lane partial sums (vector k: sub-block 2k in lanes 0..7, 2k + 1 in
            /// 8..15) reduced to lane j = sub-block j (exact).
            #[inline]
            #[target_feature(enable = $feat)]
            fn reduce(p: &[__m512i; 4]) -> __m256i {
                let t01 = _mm512_add_epi32(
                    _mm512_unpacklo_epi32(p[0], p[1]),
                    _mm512_unpackhi_epi32(p[0], p[1]),
                );
                let t23 = _mm512_add_epi32(
                    _mm512_unpacklo_epi32(p[2], p[3]),
                    _mm512_unpackhi_epi32(p[2], p[3]),
                );
                let u = _mm512_add_epi32(
                    _mm512_unpacklo_epi64(t01, t23),
                    _mm512_unpackhi_epi64(t01, t23),
                );
                let v = _mm512_add_epi32(u, _mm512_shuffle_i64x2(u, u, 0xB1));
                let order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
                _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, v))
            }

            /// The products u·s (u unsigned, s signed) summed as far as the lane's
            /// multiplier allows: over each i32 lane's four bytes with VNNI, over each
            /// i16 lane's two bytes without.
            #[inline]
            #[target_feature(enable = $feat)]
            #[allow(unused_unsafe)]
            fn dp(u: __m512i, s: __m512i) -> __m512i {
                if $vnni {
                    // SAFETY: only in the VNNI instantiation, whose features include avx512vnni.
                    unsafe { _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s) }
                } else {
                    _mm512_maddubs_epi16(u, s)
                }
            }

            /// [`dp`]'s sums times the lane's multiplier, as i32 sums over four bytes:
            /// `m16` as i16 pairs, `m32` as i32 (VNNI).
            #[inline]
            #[target_feature(enable = $feat)]
            fn mul(d: __m512i, m16: __m512i, m32: __m512i) -> __m512i {
                if $vnni {
                    _mm512_mullo_epi32(d, m32)
                } else {
                    _mm512_madd_epi16(d, m16)
                }
            }

            /// The AVX-512 kernel of every low-bit type: N tokens against one row.
            #[target_feature(enable = $feat)]
            pub(crate) unsafe fn $dot<K: Kind, const N: usize>(
                row: &[u8],
                xq: [&ActQ8; N],
            ) -> [f32; N] {
                let sp = &K::SPEC;
                let n_sub = check(sp, row, &xq);
                let groups = n_sub / 8;
                let gb = sp.group_bytes();
                let ones = _mm512_set1_epi8(1);
                let zero = _mm512_setzero_si512();
                let mut acc = [[_mm256_setzero_ps(); 4]; N];
                let mut g = Group::default();
                for gi in 0..groups {
                    decode::<K>(&row[gi * gb..], &mut g);
                    let mut aw = [zero; 4];
                    let mut neg = [0u64; 4];
                    let mut m16 = [zero; 4];
                    let mut m32 = [zero; 4];
                    let mut e16 = [zero; 4];
                    let mut e32 = [zero; 4];
                    for k in 0..4 {
                        let w = _mm512_loadu_si512(g.w.as_ptr().add(64 * k) as *const __m512i);
                        aw[k] = _mm512_abs_epi8(w);
                        neg[k] = _mm512_movepi8_mask(w);
                        // i16 lane p covers values 2p, 2p + 1 (half p / 8 of the pair);
                        // i32 lane q values 4q..4q + 4 (half q / 4).
                        let h16: [i16; 32] = std::array::from_fn(|p| g.mul[4 * k + p / 8]);
                        let h32: [i32; 16] = std::array::from_fn(|q| g.mul[4 * k + q / 4] as i32);
                        m16[k] = _mm512_loadu_si512(h16.as_ptr() as *const __m512i);
                        m32[k] = _mm512_loadu_si512(h32.as_ptr() as *const __m512i);
                        if matches!(sp.min, Min::Halves | Min::Split) {
                            let f16: [i16; 32] = std::array::from_fn(|p| g.emul[4 * k + p / 8]);
                            let f32_: [i32; 16] =
                                std::array::from_fn(|q| g.emul[4 * k + q / 4] as i32);
                            e16[k] = _mm512_loadu_si512(f16.as_ptr() as *const __m512i);
                            e32[k] = _mm512_loadu_si512(f32_.as_ptr() as *const __m512i);
                        }
                    }
                    for t in 0..N {
                        let qa = xq[t].qs.as_ptr().add(SUB * 8 * gi);
                        let mut p = [zero; 4];
                        let mut pe = [zero; 4];
                        for k in 0..4 {
                            let a = _mm512_loadu_si512(qa.add(64 * k) as *const __m512i);
                            // a with w's sign: |w|·(a·sign w) = w·a.
                            let sa = _mm512_mask_sub_epi8(a, neg[k], zero, a);
                            let d = dp(aw[k], sa);
                            p[k] = mul(d, m16[k], m32[k]);
                            match sp.min {
                                Min::Halves => pe[k] = mul(dp(ones, a), e16[k], e32[k]),
                                // The same products, the second half's multipliers.
                                Min::Split => pe[k] = mul(d, e16[k], e32[k]),
                                Min::None | Min::Asum => {}
                            }
                        }
                        let is = reduce(&p);
                        let ie = if matches!(sp.min, Min::Halves | Min::Split) {
                            reduce(&pe)
                        } else {
                            _mm256_setzero_si256()
                        };
                        let c = float_part(sp.min, &g, xq[t], gi, is, ie);
                        acc[t][gi & 3] = _mm256_add_ps(acc[t][gi & 3], c);
                    }
                }
                finish(sp, row, &xq, &acc, groups, n_sub, &mut g)
            }

            level_fns!($kernel, $multi, $proof, $dot, 8, 4, 2, 1);
        };
    }

    avx512_level!(
        dot_avx512,
        avx512_kernel,
        avx512_multi,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        Avx512Proof,
        vnni: true
    );

    mod bw {
        use super::*;
        avx512_level!(
            dot_avx512bw,
            avx512bw_kernel,
            avx512bw_multi,
            "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
            Avx512BwProof,
            vnni: false
        );
    }
    pub(crate) use bw::{avx512bw_kernel, avx512bw_multi};
}
