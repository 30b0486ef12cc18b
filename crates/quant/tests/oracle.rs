//! Dequantization against an implementation we did not write: the `gguf` Python
//! package's numpy dequantizers (`oracle.py`), bit for bit, on random blocks (every byte
//! random but the scales), on blocks of one repeated byte, on our quantizers' blocks,
//! and on blocks the package's own quantizers wrote. The package cannot quantize NVFP4,
//! so NVFP4 blocks llama.cpp's `llama-quantize` wrote are kept in `tests/data`
//! (`tests/data/README.md`) with the values they came from: they join the check, and
//! they must dequantize near those values without Python.
//!
//! Needs `python3` with the `gguf` and `numpy` packages (scripts/install-test-deps.sh
//! installs the pinned versions). Without them the test fails and says so;
//! `SCORIA_SKIP_GGUF_ORACLE=1` skips it on a machine that cannot have them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{quant_types, rand_floats, random_row, set_scales};
use quant::GgmlType as T;
use rand::rngs::StdRng;
use rand::SeedableRng;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle.py")
}

fn python_ready() -> bool {
    if std::env::var_os("SCORIA_SKIP_GGUF_ORACLE").is_some_and(|v| v == "1") {
        eprintln!("note: SCORIA_SKIP_GGUF_ORACLE=1: the gguf dequantization oracle is skipped");
        return false;
    }
    let ok = Command::new("python3")
        .args(["-c", "import gguf, numpy"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "the dequantization oracle needs python3 with the gguf and numpy packages: run \
         scripts/install-test-deps.sh (or set SCORIA_SKIP_GGUF_ORACLE=1 to skip it)"
    );
    true
}

fn work_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("scoria-oracle-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn run(args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(script())
        .args(args)
        .output()
        .expect("python3 runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "oracle.py {args:?} failed:\n{text}");
    text
}

/// NVFP4 blocks `llama-quantize` wrote (tests/data/README.md) and the values it read.
const LLAMA_QUANTIZE_NVFP4: &[u8] = include_bytes!("data/nvfp4-llama-quantize.blocks");
const LLAMA_QUANTIZE_NVFP4_SRC: &[u8] = include_bytes!("data/nvfp4-llama-quantize.src.f32");

/// A quantizer we did not write, read back: each 16-value group within a fifth of its
/// largest magnitude (half the widest gap between levels, 4 of 12, plus the e4m3
/// scale's rounding) and 11% in RMS over all. A misread layout is far outside: the
/// nibbles swapped give 140% RMS, the halves' scales swapped 83% of a group's largest.
#[test]
fn nvfp4_blocks_llama_quantize_wrote_dequantize_near_their_source() {
    let src: Vec<f32> = LLAMA_QUANTIZE_NVFP4_SRC
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut y = vec![0f32; src.len()];
    quant::dequantize_row(T::NVFP4, LLAMA_QUANTIZE_NVFP4, &mut y);
    let (mut se, mut ss) = (0f64, 0f64);
    for (g, (ys, xs)) in y.chunks(16).zip(src.chunks(16)).enumerate() {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let worst = ys
            .iter()
            .zip(xs)
            .fold(0f32, |a, (p, q)| a.max((p - q).abs()));
        assert!(
            worst <= 0.2 * amax,
            "group {g}: error {worst} of its largest {amax}"
        );
        se += ys
            .iter()
            .zip(xs)
            .map(|(p, q)| ((p - q) as f64).powi(2))
            .sum::<f64>();
        ss += xs.iter().map(|q| (*q as f64).powi(2)).sum::<f64>();
    }
    let rms = (se / ss).sqrt();
    assert!(rms < 0.11, "RMS error {rms:.4} of the values'");
}

#[test]
fn dequantization_equals_the_gguf_package_bitwise() {
    if !python_ready() {
        return;
    }
    let dir = work_dir("check");
    let mut rng = StdRng::seed_from_u64(30);
    let types = quant_types();
    for &ty in &types {
        let n = 64 * 256;
        // Random blocks: every code of every field, sane scales.
        let mut blocks = random_row(&mut rng, ty, n);
        // Blocks of one repeated byte (each field at its extremes and in between).
        for fill in [0x00u8, 0xFF, 0x55, 0xAA, 0x80, 0x7F] {
            let mut b = vec![fill; quant::row_bytes(ty, 256).unwrap()];
            for blk in b.chunks_exact_mut(ty.type_size()) {
                set_scales(ty, blk, &mut rng);
            }
            blocks.extend(b);
        }
        if ty == T::NVFP4 {
            blocks.extend_from_slice(LLAMA_QUANTIZE_NVFP4);
        }
        // Our quantizer's blocks.
        let x = rand_floats(&mut rng, 8 * 256);
        let mut q = vec![0u8; quant::row_bytes(ty, x.len()).unwrap()];
        quant::quantize_row(ty, &x, &mut q);
        blocks.extend(q);
        let n_vals = blocks.len() / ty.type_size() * ty.block_size();
        let mut y = vec![0f32; n_vals];
        quant::dequantize_row(ty, &blocks, &mut y);
        std::fs::write(dir.join(format!("{ty}.blocks")), &blocks).unwrap();
        std::fs::write(dir.join(format!("{ty}.f32")), f32_bytes(&y)).unwrap();
    }
    let text = run(&["check", dir.to_str().unwrap()]);
    eprint!("{text}");
    assert!(text.contains(&format!(
        "{} types checked, 0 with differences",
        types.len()
    )));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn blocks_the_gguf_package_quantized_dequantize_to_its_values() {
    if !python_ready() {
        return;
    }
    let dir = work_dir("make");
    let names: Vec<String> = quant_types().iter().map(|t| t.to_string()).collect();
    let mut args = vec!["make", dir.to_str().unwrap()];
    args.extend(names.iter().map(|s| s.as_str()));
    let text = run(&args);
    eprint!("{text}");
    let mut seen = Vec::new();
    for ty in quant_types() {
        let Ok(blocks) = std::fs::read(dir.join(format!("{ty}.ref-blocks"))) else {
            continue;
        };
        let want: Vec<u32> = std::fs::read(dir.join(format!("{ty}.ref-f32")))
            .unwrap()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut y = vec![0f32; want.len()];
        quant::dequantize_row(ty, &blocks, &mut y);
        for (i, (a, &b)) in y.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                b,
                "{ty} value {i}: {a} vs gguf {}",
                f32::from_bits(b)
            );
        }
        seen.push(ty);
    }
    // The package quantizes these (ggml's reference quantizers, reproduced in numpy).
    for ty in [
        T::Q8_0,
        T::Q4_0,
        T::Q4_1,
        T::Q5_0,
        T::Q5_1,
        T::TQ1_0,
        T::TQ2_0,
        T::MXFP4,
    ] {
        assert!(
            seen.contains(&ty),
            "the gguf package quantized no {ty} blocks"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
