//! The Q8_0 and Q4_0 kernels of the AVX-512 levels: whole groups of 8 blocks, the
//! last partial group padded to one (padding adds -0.0, so the real blocks keep the
//! scalar float sequence), and the row loops that run a chunk of rows in one call.
//! Expanded inside `avx512_kernels!`'s module, whose helpers they use, once per level.

macro_rules! avx512_q8_0_q4_0 {
    ($feat:literal) => {
        /// Eight f16 block scales at stride `stride` bytes, as f32 lanes.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn f16x8(p: *const u8, stride: usize) -> __m256 {
            let mut h = [0u16; 8];
            for (k, v) in h.iter_mut().enumerate() {
                *v = (p.add(stride * k) as *const u16).read_unaligned();
            }
            _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i))
        }

        /// [`tail_q8_0`] out of line: inlined into a many-token kernel, it slowed the
        /// loop over whole groups by up to a tenth (and a call costs the single-row
        /// dot of a short row more than that).
        #[inline(never)]
        #[target_feature(enable = $feat)]
        unsafe fn tail_q8_0_outlined<const N: usize>(
            row: &[u8],
            xq: &[&ActQ8; N],
            groups: usize,
            r: usize,
            acc: &mut [[__m256; 4]; N],
        ) {
            tail_q8_0(row, xq, groups, r, acc)
        }

        /// The partial group of a Q8_0 row (r = nb % 8 > 0 blocks after `groups`
        /// whole ones), padded as the AVX2 kernel's (`tail_mask`).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn tail_q8_0<const N: usize>(
            row: &[u8],
            xq: &[&ActQ8; N],
            groups: usize,
            r: usize,
            acc: &mut [[__m256; 4]; N],
        ) {
            let g = groups;
            let base = row.as_ptr().add(Q8_0_BYTES * 8 * g);
            let mut b = [_mm256_setzero_si256(); 8];
            for (k, bk) in b.iter_mut().enumerate() {
                if k < r {
                    *bk = ld256(base.add(Q8_0_BYTES * k + 2));
                }
            }
            let mut sw = [signed_w(_mm512_setzero_si512()); 4];
            for (k, swk) in sw.iter_mut().enumerate() {
                let v = _mm512_inserti64x4(_mm512_castsi256_si512(b[2 * k]), b[2 * k + 1], 1);
                *swk = signed_w(v);
            }
            let d = f16x8_tail(base, Q8_0_BYTES, r);
            let mask = tail_mask(r);
            for t in 0..N {
                let a = act_tail(xq[t].qs.as_ptr().add(SUB * 8 * g), r);
                let mut p = [_mm512_setzero_si512(); 4];
                for k in 0..4 {
                    p[k] = dps(sw[k], a[k]);
                }
                let raw = reduce4(&p);
                let isum = if OFFSET {
                    let sums = _mm256_maskload_epi32(xq[t].sums.as_ptr().add(8 * g), mask);
                    _mm256_sub_epi32(raw, _mm256_slli_epi32(sums, 7))
                } else {
                    raw
                };
                add_tail(&mut acc[t], g, d, xq[t], mask, isum);
            }
        }

        #[target_feature(enable = $feat)]
        unsafe fn dot_q8_0<const N: usize, const T: bool>(
            row: &[u8],
            xq: [&ActQ8; N],
            ta: [&[i8]; N],
        ) -> [f32; N] {
            let nb = check_all(row, &xq, Q8_0_BYTES, SUB);
            check_t::<N, T>(&ta, nb * SUB);
            let mut acc = [[_mm256_setzero_ps(); 4]; N];
            let mut acc2 = [[_mm512_setzero_ps(); 4]; N];
            let groups = nb / 8;
            for g in 0..groups {
                let base = row.as_ptr().add(Q8_0_BYTES * 8 * g);
                let mut w = [_mm512_setzero_si512(); 4];
                for (k, wk) in w.iter_mut().enumerate() {
                    let w0 = ld256(base.add(Q8_0_BYTES * 2 * k + 2));
                    let w1 = ld256(base.add(Q8_0_BYTES * (2 * k + 1) + 2));
                    *wk = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
                }
                if T {
                    w = transpose4(w);
                }
                let mut sw = [signed_w(w[0]); 4];
                for k in 1..4 {
                    sw[k] = signed_w(w[k]);
                }
                let d = f16x8(base, Q8_0_BYTES);
                let mut is = [_mm256_setzero_si256(); N];
                for t in 0..N {
                    let qa = act::<N, T>(&xq, &ta, t).add(SUB * 8 * g);
                    is[t] = unbias(dots4s::<T>(&sw, qa), xq[t].sums.as_ptr().add(8 * g));
                }
                add_scaled(&mut acc, &mut acc2, &xq, g, d, &is);
            }
            unpair(&acc2, &mut acc);
            let r = nb - 8 * groups;
            if r > 0 {
                if N == 1 {
                    tail_q8_0(row, &xq, groups, r, &mut acc);
                } else {
                    tail_q8_0_outlined(row, &xq, groups, r, &mut acc);
                }
            }
            trees(&acc)
        }

        /// `crate::RowsFn` of Q8_0: the single-row dot of each row (its only
        /// caller, so inlined; it checks each row's shape itself).
        #[target_feature(enable = $feat)]
        unsafe fn rows_q8_0(rb: usize, w: &[u8], xq: &ActQ8, out: &mut [f32]) {
            let mut ahead = crate::RowPrefetch::new(w);
            for (i, o) in out.iter_mut().enumerate() {
                ahead.before_row_ending((i + 1) * rb);
                *o = dot_q8_0::<1, false>(&w[i * rb..(i + 1) * rb], [xq], [&[]])[0];
            }
        }

        /// The 64 values (0..15) of two Q4_0 blocks from their quant bytes q0, q1.
        #[inline]
        #[target_feature(enable = $feat)]
        fn q4_0_pair(q0: __m128i, q1: __m128i, m4: __m256i) -> __m512i {
            let y = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
            let lo = _mm256_and_si256(y, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(y, 4), m4);
            // [lo0, lo1, hi0, hi1] → [lo0, hi0, lo1, hi1]: 64 consecutive values.
            let v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            _mm512_shuffle_i64x2(v, v, 0xD8)
        }

        /// The activations of the first r (< 8) sub-blocks at qa as four 64-byte
        /// vectors (sub-blocks 2k, 2k + 1 in vector k), zeros after; nothing past
        /// them is read.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn act_tail(qa: *const i8, r: usize) -> [__m512i; 4] {
            let mut a = [_mm512_setzero_si512(); 4];
            for (k, ak) in a.iter_mut().enumerate() {
                if 2 * k < r {
                    let m: __mmask64 = if 2 * k + 1 < r { !0 } else { 0xFFFF_FFFF };
                    *ak = _mm512_maskz_loadu_epi8(m, qa.add(64 * k));
                }
            }
            a
        }

        /// [`tail_q4_0`] out of line: inlined into a many-token kernel, it slowed the
        /// loop over whole groups by up to a tenth (and a call costs the single-row
        /// dot of a short row more than that).
        #[inline(never)]
        #[target_feature(enable = $feat)]
        unsafe fn tail_q4_0_outlined<const N: usize>(
            row: &[u8],
            xq: &[&ActQ8; N],
            groups: usize,
            r: usize,
            acc: &mut [[__m256; 4]; N],
        ) {
            tail_q4_0(row, xq, groups, r, acc)
        }

        /// The partial group of a Q4_0 row (r = nb % 8 > 0 blocks after `groups`
        /// whole ones), padded as the AVX2 kernel's (`tail_mask`).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn tail_q4_0<const N: usize>(
            row: &[u8],
            xq: &[&ActQ8; N],
            groups: usize,
            r: usize,
            acc: &mut [[__m256; 4]; N],
        ) {
            let g = groups;
            let base = row.as_ptr().add(Q4_0_BYTES * 8 * g);
            let mut b = [_mm_setzero_si128(); 8];
            for (k, bk) in b.iter_mut().enumerate() {
                if k < r {
                    *bk = _mm_loadu_si128(base.add(Q4_0_BYTES * k + 2) as *const __m128i);
                }
            }
            let m4 = _mm256_set1_epi8(0x0F);
            let mut z = [_mm512_setzero_si512(); 4];
            for (k, zk) in z.iter_mut().enumerate() {
                *zk = q4_0_pair(b[2 * k], b[2 * k + 1], m4);
            }
            let d = f16x8_tail(base, Q4_0_BYTES, r);
            let mask = tail_mask(r);
            for t in 0..N {
                let a = act_tail(xq[t].qs.as_ptr().add(SUB * 8 * g), r);
                let mut p = [_mm512_setzero_si512(); 4];
                for k in 0..4 {
                    p[k] = dp(z[k], a[k]);
                }
                let sums = _mm256_maskload_epi32(xq[t].sums.as_ptr().add(8 * g), mask);
                let isum = _mm256_sub_epi32(reduce4(&p), _mm256_slli_epi32(sums, 3));
                add_tail(&mut acc[t], g, d, xq[t], mask, isum);
            }
        }

        #[target_feature(enable = $feat)]
        unsafe fn dot_q4_0<const N: usize, const T: bool>(
            row: &[u8],
            xq: [&ActQ8; N],
            ta: [&[i8]; N],
        ) -> [f32; N] {
            let nb = check_all(row, &xq, Q4_0_BYTES, SUB);
            check_t::<N, T>(&ta, nb * SUB);
            let m4 = _mm256_set1_epi8(0x0F);
            let mut acc = [[_mm256_setzero_ps(); 4]; N];
            let mut acc2 = [[_mm512_setzero_ps(); 4]; N];
            let groups = nb / 8;
            for g in 0..groups {
                let base = row.as_ptr().add(Q4_0_BYTES * 8 * g);
                let mut z = [_mm512_setzero_si512(); 4];
                for (k, zk) in z.iter_mut().enumerate() {
                    let q0 = _mm_loadu_si128(base.add(Q4_0_BYTES * 2 * k + 2) as *const __m128i);
                    let q1 =
                        _mm_loadu_si128(base.add(Q4_0_BYTES * (2 * k + 1) + 2) as *const __m128i);
                    *zk = q4_0_pair(q0, q1, m4);
                }
                if T {
                    z = transpose4(z);
                }
                let d = f16x8(base, Q4_0_BYTES);
                let mut is = [_mm256_setzero_si256(); N];
                for t in 0..N {
                    let qa = act::<N, T>(&xq, &ta, t).add(SUB * 8 * g);
                    let sums = _mm256_loadu_si256(xq[t].sums.as_ptr().add(8 * g) as *const __m256i);
                    is[t] = _mm256_sub_epi32(dots4::<T>(&z, qa), _mm256_slli_epi32(sums, 3));
                }
                add_scaled(&mut acc, &mut acc2, &xq, g, d, &is);
            }
            unpair(&acc2, &mut acc);
            let r = nb - 8 * groups;
            if r > 0 {
                if N == 1 {
                    tail_q4_0(row, &xq, groups, r, &mut acc);
                } else {
                    tail_q4_0_outlined(row, &xq, groups, r, &mut acc);
                }
            }
            trees(&acc)
        }

        /// `crate::RowsFn` of Q4_0: the single-row dot of each row (its only
        /// caller, so inlined; it checks each row's shape itself).
        #[target_feature(enable = $feat)]
        unsafe fn rows_q4_0(rb: usize, w: &[u8], xq: &ActQ8, out: &mut [f32]) {
            let mut ahead = crate::RowPrefetch::new(w);
            for (i, o) in out.iter_mut().enumerate() {
                ahead.before_row_ending((i + 1) * rb);
                *o = dot_q4_0::<1, false>(&w[i * rb..(i + 1) * rb], [xq], [&[]])[0];
            }
        }
    };
}
