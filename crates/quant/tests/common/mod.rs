//! Random blocks shared by the kernel and oracle tests.

#![allow(dead_code)]

use quant::GgmlType as T;
use rand::rngs::StdRng;
use rand::{Rng, RngCore};

/// Every quantized type with kernels.
pub fn quant_types() -> Vec<T> {
    quant::SUPPORTED
        .iter()
        .copied()
        .filter(|t| !matches!(t, T::F32 | T::F16 | T::BF16))
        .collect()
}

pub fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// A scale of random sign and size in [0.0005, 0.05).
pub fn rand_scale(rng: &mut StdRng) -> f32 {
    let m: f32 = rng.random_range(0.0005..0.05);
    if rng.random_bool(0.5) {
        m
    } else {
        -m
    }
}

pub fn rand_floats(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

/// Byte offsets of a block's f16 scale fields (every other byte is quants, codebook
/// indices, signs or small integer scales, where any value is valid).
pub fn f16_fields(ty: T) -> &'static [usize] {
    match ty {
        T::Q6_K => &[208],
        T::Q4_K | T::Q5_K | T::Q4_1 | T::Q5_1 => &[0, 2],
        T::Q2_K => &[80, 82],
        T::Q3_K => &[108],
        T::TQ1_0 => &[52],
        T::TQ2_0 => &[64],
        // MXFP4's scale is one e8m0 byte, NVFP4's four e4m3 bytes (every byte is a
        // finite scale: random bytes are sane) and IQ1_M's f16 is spread over four nibbles.
        T::MXFP4 | T::NVFP4 | T::IQ1_M => &[],
        _ => &[0],
    }
}

/// Puts sane random scales into a block whose other bytes are anything.
pub fn set_scales(ty: T, blk: &mut [u8], rng: &mut StdRng) {
    for &o in f16_fields(ty) {
        blk[o..o + 2].copy_from_slice(&f16_bytes(rand_scale(rng)));
    }
    match ty {
        // 2^(e − 128) in [2^-14, 2^-4].
        T::MXFP4 => blk[0] = rng.random_range(114..=124),
        T::IQ1_M => {
            let bits = half::f16::from_f32(rand_scale(rng)).to_bits();
            for u in 0..4 {
                let at = 48 + 2 * u;
                let w = u16::from_le_bytes([blk[at], blk[at + 1]]) & 0x0FFF;
                let w = w | (((bits >> (4 * u)) & 0xF) << 12);
                blk[at..at + 2].copy_from_slice(&w.to_le_bytes());
            }
        }
        _ => {}
    }
}

/// A random row: random bytes with sane scales for quantized types, random values for
/// float types.
pub fn random_row(rng: &mut StdRng, ty: T, n: usize) -> Vec<u8> {
    let rb = quant::row_bytes(ty, n).unwrap();
    let mut w = vec![0u8; rb];
    match ty {
        T::F32 | T::F16 | T::BF16 => quant::quantize_row(ty, &rand_floats(rng, n), &mut w),
        _ => {
            rng.fill_bytes(&mut w);
            for blk in w.chunks_exact_mut(ty.type_size()) {
                set_scales(ty, blk, rng);
            }
        }
    }
    w
}
