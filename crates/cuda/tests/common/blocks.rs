//! Random blocks of every quantized type whose scales stay finite, shared by the host
//! test of the kernels' block decoding and the GPU kernel tests.

use quant::GgmlType;

/// Offsets of a block's f16 scales and its size (random bytes must keep these finite).
fn scale_fields(ty: GgmlType) -> (&'static [usize], usize) {
    use GgmlType as T;
    match ty {
        T::Q8_0 => (&[0], 34),
        T::Q4_0 => (&[0], 18),
        T::Q4_K => (&[0, 2], 144),
        T::Q5_K => (&[0, 2], 176),
        T::Q6_K => (&[208], 210),
        T::IQ4_XS => (&[0], 136),
        T::Q2_K => (&[80, 82], 84),
        T::Q3_K => (&[108], 110),
        T::Q4_1 => (&[0, 2], 20),
        T::Q5_0 => (&[0], 22),
        T::Q5_1 => (&[0, 2], 24),
        T::IQ4_NL => (&[0], 18),
        // MXFP4's scale is a byte (e8m0), IQ1_M's f16 is spread over four words:
        // `finite_scales` sets them.
        T::MXFP4 => (&[], 17),
        T::IQ1_M => (&[], 56),
        T::TQ1_0 => (&[52], 54),
        T::TQ2_0 => (&[64], 66),
        T::IQ2_XXS => (&[0], 66),
        T::IQ2_XS => (&[0], 74),
        T::IQ2_S => (&[0], 82),
        T::IQ3_XXS => (&[0], 98),
        T::IQ3_S => (&[0], 110),
        T::IQ1_S => (&[0], 50),
        // NVFP4's four e4m3 scale bytes: every byte is a finite scale.
        T::NVFP4 => (&[], 36),
        _ => (&[], 0),
    }
}

/// A random f16 of magnitude from subnormal to ~1 (exponent field 0..15), any sign.
fn small_f16(next: &mut dyn FnMut() -> u64) -> u16 {
    ((next() as u16) & 0x83ff) | (((next() % 16) as u16) << 10)
}

/// The scales of a random block that are not a plain f16 field: MXFP4's e8m0 exponent
/// (within 2^±20, so that products stay finite) and IQ1_M's f16, whose four nibbles
/// are the top nibbles of its four scale words.
fn finite_scales(ty: GgmlType, blk: &mut [u8], next: &mut dyn FnMut() -> u64) {
    match ty {
        GgmlType::MXFP4 => blk[0] = 108 + (next() % 40) as u8,
        GgmlType::IQ1_M => {
            let d = small_f16(next);
            for u in 0..4 {
                let at = 48 + 2 * u;
                let w = u16::from_le_bytes([blk[at], blk[at + 1]]) & 0x0fff;
                let w = w | (((d >> (4 * u)) & 0xf) << 12);
                blk[at..at + 2].copy_from_slice(&w.to_le_bytes());
            }
        }
        _ => {}
    }
}

/// Whether [`random_blocks`] can fill `ty` (a block type whose scales it knows).
pub fn has_raw_form(ty: GgmlType) -> bool {
    scale_fields(ty).1 > 0
}

/// Fills `w` (whole blocks of `ty`) with random bytes, then gives every scale a finite
/// random value: every bit pattern of the quant fields, no NaN or infinity.
pub fn random_blocks(ty: GgmlType, w: &mut [u8], next: &mut dyn FnMut() -> u64) {
    let (fields, bsize) = scale_fields(ty);
    for b in w.iter_mut() {
        *b = next() as u8;
    }
    for blk in w.chunks_exact_mut(bsize) {
        for &off in fields {
            let bits = small_f16(next);
            blk[off..off + 2].copy_from_slice(&bits.to_le_bytes());
        }
        finite_scales(ty, blk, next);
    }
}
