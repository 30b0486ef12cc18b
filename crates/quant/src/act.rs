//! Activation quantization (the one routine; see the crate docs).

use crate::isa::Isa;
use crate::scalar::quantize_act_block;
use crate::ActQ8;

pub(crate) fn quantize(isa: Isa, x: &[f32]) -> ActQ8 {
    let nb = x.len() / 32;
    let mut out = ActQ8 {
        qs: vec![0; x.len()],
        d: vec![0.0; nb],
        sums: vec![0; nb],
    };
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: the AVX2 level (avx2, fma, f16c) was detected on this CPU
        // (`Isa::is_available` is checked by every caller of `quantize`).
        unsafe { quantize_avx2(x, &mut out) };
        return out;
    }
    let _ = isa;
    for (b, (xs, qs)) in x
        .chunks_exact(32)
        .zip(out.qs.chunks_exact_mut(32))
        .enumerate()
    {
        let (d, s) = quantize_act_block(xs, qs);
        out.d[b] = d;
        out.sums[b] = s;
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_avx2(x: &[f32], out: &mut ActQ8) {
    use std::arch::x86_64::*;
    let nb = x.len() / 32;
    assert!(out.qs.len() == 32 * nb && out.d.len() == nb && out.sums.len() == nb);
    let sign = _mm256_set1_ps(-0.0);
    let lo = _mm256_set1_ps(-127.0);
    let hi = _mm256_set1_ps(127.0);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nb {
        // SAFETY: block b covers x[32b..32b+32] and qs[32b..32b+32], in bounds (asserted).
        let (v0, v1, v2, v3) = unsafe {
            let p = x.as_ptr().add(32 * b);
            (
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            )
        };
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
            _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)),
        );
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1));
        let amax = _mm_cvtss_f32(m1);
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let idv = _mm256_set1_ps(id);
        let q = |v: __m256| {
            let r = _mm256_round_ps(
                _mm256_mul_ps(v, idv),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            );
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        };
        let (i0, i1, i2, i3) = (q(v0), q(v1), q(v2), q(v3));
        let s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
        let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b10_11_00_01));
        let packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        let bytes = _mm256_permutevar8x32_epi32(packed, order);
        // SAFETY: qs[32b..32b+32] is in bounds (asserted above).
        unsafe { _mm256_storeu_si256(out.qs.as_mut_ptr().add(32 * b) as *mut __m256i, bytes) };
        out.d[b] = d;
        out.sums[b] = _mm_cvtsi128_si32(s1);
    }
}
