//! The GPU kernels' block decoding (kernels/sc_formats.cuh) checked on the CPU: the
//! header compiles for the host too (portable versions of dp4a, byte_perm, funnel
//! shifts), and `host_formats.cpp` runs the matvec warp's exact sequence (lane l =
//! accumulator l, then the fixed tree) and the embedding kernel's dequantization on
//! rows from the quant crate. The results must equal `quant::dot` and
//! `quant::dequantize_row` bit for bit. Needs a C++ compiler (`c++` or `$CXX`); without
//! one the test prints a skip line, unless SCORIA_REQUIRE_CXX=1.
//!
//! This checks the arithmetic and bit manipulation the GPU runs, not the kernels'
//! indexing or tiling (tests/gpu_kernels.rs does that, on a GPU).

#[path = "common/blocks.rs"]
mod blocks;

use quant::GgmlType;
use std::path::{Path, PathBuf};
use std::process::Command;

struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn compiler() -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    Command::new(&cxx)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| cxx)
}

fn build(dir: &Path) -> Option<PathBuf> {
    let Some(cxx) = compiler() else {
        if std::env::var("SCORIA_REQUIRE_CXX").is_ok_and(|v| v == "1") {
            panic!("no C++ compiler (c++ or $CXX) and SCORIA_REQUIRE_CXX=1");
        }
        eprintln!("SKIP host_formats: no C++ compiler (c++ or $CXX)");
        return None;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = dir.join("host_formats");
    let out = Command::new(&cxx)
        .args([
            "-O1",
            "-std=c++17",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-Wall",
            "-Wno-unknown-pragmas",
        ])
        .arg("-I")
        .arg(root.join("kernels"))
        // sc_grids.cuh, the codebooks build.rs generates from the quant crate's.
        .arg("-I")
        .arg(env!("OUT_DIR"))
        .arg(root.join("tests/host_formats.cpp"))
        .arg("-o")
        .arg(&exe)
        .arg("-lm")
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "compiling host_formats.cpp failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

/// Rows of `ty`: quantized from random values, or (for block types, `raw`) random
/// bytes with finite random scales, which reach every bit pattern of the scale and
/// quant fields.
fn weights(ty: GgmlType, n_rows: usize, n_cols: usize, raw: bool, rng: &mut Rng) -> Vec<u8> {
    let rb = quant::row_bytes(ty, n_cols).expect("supported shape");
    let mut w = vec![0u8; n_rows * rb];
    if raw && blocks::has_raw_form(ty) {
        blocks::random_blocks(ty, &mut w, &mut || rng.next_u64());
    } else {
        for r in 0..n_rows {
            let scale = 0.01 + 2.0 * (r as f32 + 1.0) / n_rows as f32;
            let v: Vec<f32> = (0..n_cols).map(|_| rng.f() * scale).collect();
            quant::quantize_row(ty, &v, &mut w[r * rb..(r + 1) * rb]);
        }
    }
    w
}

#[test]
fn kernel_decoding_matches_the_quant_crate_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("scoria-host-formats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let Some(exe) = build(&dir) else { return };
    use GgmlType as T;
    // The type codes of sc_formats.cuh are the positions in quant::SUPPORTED.
    let types = quant::SUPPORTED;
    let mut rng = Rng(0x005c_012a_cafe);
    let mut cases = 0;
    for ty in types {
        let block = ty.block_size().max(32);
        // 1 block; 2 sub-blocks per lane (2048); lanes with unequal counts; > 32 blocks.
        let mut shapes = vec![(block, 7), (2048, 7), (1280, 7), (4096 + block, 7)];
        if block < 256 {
            shapes.push((block * 37, 7));
        }
        // The codebook types: random blocks (below) enough that each codebook row is
        // read many times over (32,768 row indices; IQ1's codebook, the largest, has
        // 2048 rows).
        if matches!(
            ty,
            T::IQ2_XXS | T::IQ2_XS | T::IQ2_S | T::IQ3_XXS | T::IQ3_S | T::IQ1_S | T::IQ1_M
        ) {
            shapes.push((4096, 64));
        }
        for (n_cols, n_rows) in shapes {
            for raw in [false, true] {
                if n_rows > 7 && !raw {
                    continue; // the quantizers' codebook search is slow, and random bytes reach more rows
                }
                let w = weights(ty, n_rows, n_cols, raw, &mut rng);
                let rb = w.len() / n_rows;
                // Activations of mixed magnitudes, a zero block and exact ties.
                let mut x: Vec<f32> = (0..n_cols).map(|i| rng.f() * (1 + i % 7) as f32).collect();
                x[..32].fill(0.0);
                if n_cols > 64 {
                    x[40] = 127.0;
                    x[41] = 0.5;
                }
                let xq = quant::quantize_act(&x);
                let mut input = Vec::new();
                for v in [0i32, n_rows as i32, n_cols as i32, rb as i32] {
                    input.extend_from_slice(&v.to_le_bytes());
                }
                let code = types.iter().position(|&t| t == ty).unwrap() as i32;
                input[..4].copy_from_slice(&code.to_le_bytes());
                input.extend_from_slice(&w);
                x.iter()
                    .for_each(|v| input.extend_from_slice(&v.to_le_bytes()));
                xq.qs.iter().for_each(|&v| input.push(v as u8));
                xq.d.iter()
                    .for_each(|v| input.extend_from_slice(&v.to_le_bytes()));
                xq.sums
                    .iter()
                    .for_each(|v| input.extend_from_slice(&v.to_le_bytes()));
                let (inp, outp) = (dir.join("in.bin"), dir.join("out.bin"));
                std::fs::write(&inp, &input).unwrap();
                let st = Command::new(&exe).arg(&inp).arg(&outp).status().unwrap();
                assert!(st.success(), "host_formats failed");
                let out: Vec<f32> = std::fs::read(&outp)
                    .unwrap()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                assert_eq!(out.len(), n_rows + n_rows * n_cols);
                for r in 0..n_rows {
                    let row = &w[r * rb..(r + 1) * rb];
                    let want = quant::dot(ty, row, &x, &xq);
                    assert_eq!(
                        out[r].to_bits(),
                        want.to_bits(),
                        "{ty} {n_cols} cols raw={raw} row {r}: dot {} vs quant {}",
                        out[r],
                        want
                    );
                    let mut deq = vec![0f32; n_cols];
                    quant::dequantize_row(ty, row, &mut deq);
                    let got = &out[n_rows + r * n_cols..n_rows + (r + 1) * n_cols];
                    for (i, (a, b)) in got.iter().zip(&deq).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{ty} {n_cols} cols raw={raw} row {r} element {i}: {a} vs {b}"
                        );
                    }
                }
                cases += 1;
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(cases >= 25 * 8 + 7);
}
