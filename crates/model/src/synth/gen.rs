//! Seeded random tensor data, generated directly in the file's block format.
//!
//! Quantized tensors are not made by quantizing floats: each block gets random quants and
//! format-correct f16 scales chosen so that the dequantized values have the target
//! standard deviation and mean ~0. That is ~10x faster than a float round trip and
//! lets `scoria synth` write a 46 GB model at disk speed.
//!
//! Determinism: a tensor is cut into chunks of a fixed number of blocks (a function of
//! its type only), and chunk `c` of the tensor named `n` draws from its own generator
//! seeded by (seed, hash(n), c). The bytes therefore never depend on the thread count.

use gguf::GgmlType;
use half::{bf16, f16};

/// Target output bytes per chunk (the unit of parallel work and of determinism).
const CHUNK_BYTES: usize = 4 << 20;

/// How a tensor's values are distributed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Uniform on [center − half_width, center + half_width].
    Uniform { center: f32, half_width: f32 },
    /// −exp(u), u uniform on [ln_lo, ln_hi]: `ssm_a` (= −exp(A_log)).
    NegExp { ln_lo: f32, ln_hi: f32 },
}

impl Init {
    /// Zero-mean values with standard deviation `std`.
    pub fn with_std(std: f32) -> Init {
        Init::Uniform {
            center: 0.0,
            half_width: std * 3f32.sqrt(),
        }
    }

    /// The standard deviation of a zero-centred uniform init (what quantized blocks target).
    pub(crate) fn zero_mean_std(&self) -> Option<f32> {
        match *self {
            Init::Uniform {
                center: 0.0,
                half_width,
            } => Some(half_width / 3f32.sqrt()),
            _ => None,
        }
    }
}

/// xoshiro256++ seeded through splitmix64.
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a tensor name: the stream id of its generator.
pub fn name_hash(name: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

impl Rng {
    /// The generator of chunk `chunk` of stream `stream` under `seed`.
    pub fn new(seed: u64, stream: u64, chunk: u64) -> Rng {
        let mut x = seed;
        let mut y = splitmix64(&mut x) ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut z = splitmix64(&mut y) ^ chunk.wrapping_mul(0x8CB9_2BA7_2F3D_8DD7);
        let s = [
            splitmix64(&mut z),
            splitmix64(&mut z),
            splitmix64(&mut z),
            splitmix64(&mut z),
        ];
        Rng { s }
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform on [0, 1).
    #[inline]
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let v = self.next_u64().to_le_bytes();
            let n = rest.len();
            rest.copy_from_slice(&v[..n]);
        }
    }

    /// Two values of `init` per u64 draw where possible.
    #[inline]
    fn sample(&mut self, init: &Init) -> f32 {
        match *init {
            Init::Uniform { center, half_width } => center + (2.0 * self.unit() - 1.0) * half_width,
            Init::NegExp { ln_lo, ln_hi } => -(ln_lo + self.unit() * (ln_hi - ln_lo)).exp(),
        }
    }
}

/// Types the generator can produce: every type with kernels.
pub fn supports(ty: GgmlType) -> bool {
    quant::is_supported(ty)
}

/// Blocks per chunk for a type: fixed, so chunking never depends on the machine.
pub fn blocks_per_chunk(ty: GgmlType) -> u64 {
    (CHUNK_BYTES / ty.type_size()).max(1) as u64
}

/// Why a tensor cannot be generated.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GenError {
    #[error("type {0} has no synthetic generator")]
    Type(GgmlType),
    #[error("type {0} needs zero-mean weights; this tensor's init is {1:?}")]
    Init(GgmlType, Init),
}

/// Checks that `ty` with `init` can be generated (before any byte is written).
pub fn check(ty: GgmlType, init: &Init) -> Result<(), GenError> {
    if !supports(ty) {
        return Err(GenError::Type(ty));
    }
    let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    if !float && init.zero_mean_std().is_none() {
        return Err(GenError::Init(ty, *init));
    }
    Ok(())
}

/// Appends `n_blocks` blocks of type `ty` drawn from `rng` to `out`.
/// [`check`] must have accepted (`ty`, `init`); otherwise nothing is written.
pub fn generate(ty: GgmlType, init: &Init, n_blocks: usize, rng: &mut Rng, out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + n_blocks * ty.type_size(), 0);
    let buf = &mut out[start..];
    let std = init.zero_mean_std().unwrap_or(0.0);
    match ty {
        GgmlType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.sample(init).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(rng.sample(init)).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&bf16::from_f32(rng.sample(init)).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => q8_0(buf, std, rng),
        GgmlType::Q4_K => q4_k(buf, std, rng),
        GgmlType::Q5_K => q5_k(buf, std, rng),
        GgmlType::Q6_K => q6_k(buf, std, rng),
        t if quant::is_supported(t) => scaled_random(t, buf, std, rng),
        _ => out.truncate(start),
    }
}

/// Per-block scale jitter in [0.85, 1.15): real files' block scales vary too.
#[inline]
fn jitter(rng: &mut Rng) -> f32 {
    0.85 + 0.3 * rng.unit()
}

fn put_f16(dst: &mut [u8], v: f32) {
    dst.copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Q8_0: d (f16) + 32 int8 in [−127, 127]; uniform quants have std 73.6·d.
fn q8_0(buf: &mut [u8], std: f32, rng: &mut Rng) {
    const Q_STD: f32 = 73.61; // sqrt((255² − 1) / 12)
    for b in buf.chunks_exact_mut(34) {
        put_f16(&mut b[..2], std / Q_STD * jitter(rng));
        rng.fill_bytes(&mut b[2..]);
        for q in &mut b[2..] {
            if *q == 0x80 {
                *q = 0x81; // −128 is never produced by ggml's quantizer
            }
        }
    }
}

/// Encodes 8 six-bit scales and mins into Q4_K / Q5_K's 12 bytes.
fn pack_k4_scales(sc: &[u8; 8], m: &[u8; 8], out: &mut [u8]) {
    for j in 0..4 {
        out[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        out[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        out[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
}

/// Scales and mins for a K block whose quants are uniform on 0..=qmax: 6-bit sub-block
/// scales in 40..=63 around `d`, and mins that cancel the quants' mean (qmax/2).
/// Writes d, dmin and the 12 scale bytes into `head` (16 bytes).
fn k_block_head(head: &mut [u8], std: f32, qmax: f32, rng: &mut Rng) {
    const MEAN_SC: f32 = 51.5;
    let q_std = ((qmax + 1.0) * (qmax + 1.0) - 1.0).sqrt() / 12f32.sqrt();
    let d = f16::from_f32(std / (MEAN_SC * q_std) * jitter(rng));
    // dmin·m ≈ d·sc·qmax/2 with m ≤ 63 for sc ≤ 63.
    let dmin = f16::from_f32(d.to_f32() * (qmax / 2.0) * 64.0 / 63.0);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        let s = 40 + (rng.next_u64() % 24) as u8;
        sc[j] = s;
        let want = if dminf > 0.0 {
            f32::from(s) * df * (qmax / 2.0) / dminf
        } else {
            0.0
        };
        m[j] = want.round().clamp(0.0, 63.0) as u8;
    }
    head[..2].copy_from_slice(&d.to_le_bytes());
    head[2..4].copy_from_slice(&dmin.to_le_bytes());
    pack_k4_scales(&sc, &m, &mut head[4..16]);
}

/// Q4_K (144 B): d, dmin, scales[12], qs[128] of 4-bit quants.
fn q4_k(buf: &mut [u8], std: f32, rng: &mut Rng) {
    for b in buf.chunks_exact_mut(144) {
        k_block_head(&mut b[..16], std, 15.0, rng);
        rng.fill_bytes(&mut b[16..]);
    }
}

/// Q5_K (176 B): d, dmin, scales[12], qh[32], qs[128] of 5-bit quants.
fn q5_k(buf: &mut [u8], std: f32, rng: &mut Rng) {
    for b in buf.chunks_exact_mut(176) {
        k_block_head(&mut b[..16], std, 31.0, rng);
        rng.fill_bytes(&mut b[16..]);
    }
}

/// Q6_K (210 B): ql[128], qh[64], int8 scales[16], d (last). Quants q − 32 with q uniform
/// on 0..=63 (std 18.47); scales of random sign cancel the −0.5 mean.
fn q6_k(buf: &mut [u8], std: f32, rng: &mut Rng) {
    const Q_STD: f32 = 18.47;
    const MEAN_SC: f32 = 95.5;
    for b in buf.chunks_exact_mut(210) {
        rng.fill_bytes(&mut b[..192]);
        for s in &mut b[192..208] {
            let r = rng.next_u64();
            let mag = 64 + (r % 64) as i8;
            let v = if r & (1 << 40) != 0 { -mag } else { mag };
            *s = v as u8;
        }
        put_f16(&mut b[208..210], std / (MEAN_SC * Q_STD) * jitter(rng));
    }
}

/// The other quantized types: random codes (every field), a block scale of 1 (and the
/// minimum that centres the values where the type has one), then every scale field
/// multiplied by the factor that gives the block's dequantized values the target
/// RMS, with the per-block jitter. Zero mean comes from the codes' symmetry (random
/// signs, signed scales, a scale of random sign) or the minimum.
fn scaled_random(ty: GgmlType, buf: &mut [u8], std: f32, rng: &mut Rng) {
    let mut y = vec![0f32; ty.block_size()];
    for b in buf.chunks_exact_mut(ty.type_size()) {
        rng.fill_bytes(b);
        let fields = unit_scales(ty, b, rng);
        quant::dequantize_row(ty, b, &mut y);
        let ms = y.iter().map(|v| v * v).sum::<f32>() / y.len() as f32;
        let f = if ms > 0.0 {
            std * jitter(rng) / ms.sqrt()
        } else {
            0.0
        };
        match ty {
            // e = 128 is a scale of 1: powers of two only.
            GgmlType::MXFP4 => b[0] = (128.0 + f.log2().round()).clamp(1.0, 254.0) as u8,
            // Each 16 values' e4m3 scale (1 at unit scale) becomes the nearest to f.
            GgmlType::NVFP4 => b[..4].fill(quant::nvfp4_scale_byte(f)),
            GgmlType::IQ1_M => set_iq1_m_d(b, f),
            _ => {
                // Without a minimum, a scale of random sign cancels the codes' own mean
                // (Q4_0's q − 8 averages −0.5).
                let has_min = matches!(ty, GgmlType::Q2_K | GgmlType::Q4_1 | GgmlType::Q5_1);
                let sign = if has_min || rng.next_u64() & 1 == 0 {
                    1.0
                } else {
                    -1.0
                };
                for &(off, unit) in fields {
                    put_f16(&mut b[off..off + 2], sign * unit * f);
                }
            }
        }
    }
}

/// Writes a block's unit scales and code constraints; returns its f16 fields as
/// (offset, value at scale 1).
fn unit_scales(ty: GgmlType, b: &mut [u8], rng: &mut Rng) -> &'static [(usize, f32)] {
    use GgmlType as T;
    let fields: &'static [(usize, f32)] = match ty {
        // y = (d·sc)·q − (dmin·m), q uniform on 0..=3 (mean 1.5): sc in 8..=15 and
        // dmin·m ≈ d·sc·1.5 with m ≤ 15.
        T::Q2_K => {
            const DMIN: f32 = 1.5 * 16.0 / 15.0;
            for s in &mut b[..16] {
                let sc = 8 + (rng.next_u64() % 8) as u8;
                let m = (f32::from(sc) * 1.5 / DMIN).round().min(15.0) as u8;
                *s = sc | (m << 4);
            }
            &[(80, 1.0), (82, DMIN)]
        }
        T::Q3_K => &[(108, 1.0)],
        // y = d·q + m with q uniform on 0..=15 / 0..=31.
        T::Q4_1 => &[(0, 1.0), (2, -7.5)],
        T::Q5_1 => &[(0, 1.0), (2, -15.5)],
        // Codes 0..=2 (−1, 0, +1): TQ2_0's code 3 is not a ternary value.
        T::TQ2_0 => {
            for q in &mut b[..64] {
                let mut v = 0u8;
                for k in 0..4 {
                    v |= ((rng.next_u64() % 3) as u8) << (2 * k);
                }
                *q = v;
            }
            &[(64, 1.0)]
        }
        T::TQ1_0 => &[(52, 1.0)],
        T::MXFP4 => {
            b[0] = 128;
            &[]
        }
        T::NVFP4 => {
            b[..4].fill(0x40); // (8 + 0) · 2^(8 − 11) = 1
            &[]
        }
        T::IQ1_M => {
            set_iq1_m_d(b, 1.0);
            &[]
        }
        _ => &[(0, 1.0)],
    };
    for &(off, unit) in fields {
        put_f16(&mut b[off..off + 2], unit);
    }
    fields
}

/// IQ1_M keeps its f16 scale in the top nibbles of its four scale words.
fn set_iq1_m_d(b: &mut [u8], d: f32) {
    let bits = f16::from_f32(d).to_bits();
    for u in 0..4 {
        let at = 48 + 2 * u;
        let w = u16::from_le_bytes([b[at], b[at + 1]]) & 0x0FFF;
        let w = w | (((bits >> (4 * u)) & 0xF) << 12);
        b[at..at + 2].copy_from_slice(&w.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_streams_differ_and_repeat() {
        let a: Vec<u64> = (0..4).map(|_| Rng::new(1, 2, 3).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(Rng::new(1, 2, 3).next_u64(), Rng::new(1, 2, 4).next_u64());
        assert_ne!(Rng::new(1, 2, 3).next_u64(), Rng::new(2, 2, 3).next_u64());
    }

    #[test]
    fn every_quantized_type_is_generated_at_the_target_statistics() {
        for &ty in &quant::SUPPORTED {
            if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                continue;
            }
            let std = 0.03f32;
            let n_blocks = 4096 / ty.block_size().min(256) * 4;
            let mut out = Vec::new();
            let mut rng = Rng::new(5, name_hash(ty.name()), 0);
            generate(ty, &Init::with_std(std), n_blocks, &mut rng, &mut out);
            assert_eq!(out.len(), n_blocks * ty.type_size(), "{ty}");
            let mut y = vec![0f32; n_blocks * ty.block_size()];
            quant::dequantize_row(ty, &out, &mut y);
            let n = y.len() as f64;
            let mean = y.iter().map(|&v| v as f64).sum::<f64>() / n;
            let sd = (y.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            // MXFP4's scale is a power of two: within a factor √2 of the target (NVFP4's
            // small scales are e4m3 subnormals, a few steps apart).
            let (lo, hi) = if matches!(ty, GgmlType::MXFP4 | GgmlType::NVFP4) {
                (0.65, 1.5)
            } else {
                (0.85, 1.15)
            };
            assert!(
                (lo * std as f64..hi * std as f64).contains(&sd),
                "{ty}: std {sd} (target {std})"
            );
            assert!(mean.abs() < 0.1 * std as f64, "{ty}: mean {mean}");
        }
    }

    #[test]
    fn k4_scale_packing_matches_the_decoder() {
        let sc = [1, 17, 33, 63, 40, 50, 60, 5];
        let m = [2, 20, 48, 62, 41, 51, 61, 7];
        let mut s = [0u8; 12];
        pack_k4_scales(&sc, &m, &mut s);
        for j in 0..8 {
            let (d, mm) = if j < 4 {
                (s[j] & 63, s[j + 4] & 63)
            } else {
                (
                    (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
                    (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                )
            };
            assert_eq!((d, mm), (sc[j], m[j]), "sub-block {j}");
        }
    }
}
