//! quantize_act, matvec, matvec_tiles and embed against the quant crate, bit for bit.

use crate::{assert_bits, down, gpu, poisoned, up, DevActQ8, QOut, Rng};
use cuda::{ActQ8, GgmlType, Tile, TileShape};

/// Every type with kernels: the float types, the first quantized ones, then the low-bit
/// types (Q2_K .. NVFP4).
pub(crate) const TYPES: [GgmlType; 26] = quant::SUPPORTED;

fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Values per block of `ty` (the column granularity; 32 for float types).
fn block(ty: GgmlType) -> usize {
    ty.block_size().max(32)
}

/// `n_rows` rows of `ty`. Quantized rows of random values, or for block types with
/// `raw`, random bytes with finite scales (every bit pattern of the quant fields).
pub fn weights(ty: GgmlType, n_rows: usize, n_cols: usize, raw: bool, rng: &mut Rng) -> Vec<u8> {
    let rb = quant::row_bytes(ty, n_cols).expect("supported shape");
    let mut w = vec![0u8; n_rows * rb];
    if raw && crate::blocks::has_raw_form(ty) {
        crate::blocks::random_blocks(ty, &mut w, &mut || rng.next_u64());
    } else {
        let vals = rng.vec(n_rows * n_cols, 1.5);
        for (r, v) in vals.chunks_exact(n_cols).enumerate() {
            quant::quantize_row(ty, v, &mut w[r * rb..(r + 1) * rb]);
        }
    }
    w
}

/// Activations with mixed magnitudes, one all-zero block and exact rounding ties.
pub(crate) fn activations(n_tok: usize, n_cols: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(n_tok * n_cols);
    for t in 0..n_tok {
        let mut row = rng.vec(n_cols, 1.0 + t as f32);
        if n_cols >= 64 {
            row[32..64].fill(0.0);
        }
        if n_cols >= 128 {
            // amax 127 makes d = 1, so k + 0.5 are exact ties for round-half-even.
            row[64] = 127.0;
            for (i, v) in row[65..96].iter_mut().enumerate() {
                *v = (i as f32 - 15.0) + 0.5;
            }
        }
        x.extend(row);
    }
    x
}

#[test]
fn quantize_act_matches_the_cpu() {
    let Some(g) = gpu("quantize_act") else { return };
    let mut rng = Rng::new(1);
    for (rows, cols) in [(1, 32), (3, 2048), (2, 4096 + 32), (17, 256)] {
        let x = activations(rows, cols, &mut rng);
        let dx = up(&g, &x);
        let out = QOut::new(&g, rows * cols);
        g.quantize_act(dx.ptr(), rows, cols, out.q()).unwrap();
        out.assert_quantizes(&g, &x, cols, &format!("{rows}×{cols}"));
    }
}

/// The CPU's out[t·n_rows + r] for n_tok tokens.
pub(crate) fn cpu_matmul(
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    n_cols: usize,
    x: &[f32],
    n_tok: usize,
) -> Vec<f32> {
    let xqs: Vec<quant::ActQ8> = if is_float(ty) {
        Vec::new()
    } else {
        x.chunks_exact(n_cols).map(quant::quantize_act).collect()
    };
    let mut out = vec![0f32; n_tok * n_rows];
    if n_tok == 1 {
        let empty = quant::ActQ8::default();
        quant::matvec(ty, w, n_cols, x, xqs.first().unwrap_or(&empty), &mut out);
    } else {
        quant::matmul(ty, w, n_cols, x, &xqs, &mut out);
    }
    out
}

/// The CPU's output of expert tiles over `n_out` output rows of `n_rows` (rows no tile
/// writes stay poisoned: NaN bits u32::MAX).
fn cpu_tiles(
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    n_cols: usize,
    x: &[f32],
    tiles: &[Tile],
    n_out: usize,
) -> Vec<f32> {
    let rb = quant::row_bytes(ty, n_cols).expect("supported shape");
    let mut want = vec![f32::from_bits(u32::MAX); n_out * n_rows];
    for t in tiles {
        let e = t.expert as usize;
        let wm = &w[e * n_rows * rb..(e + 1) * n_rows * rb];
        for j in 0..t.n as usize {
            let xi = &x[t.in_row[j] as usize * n_cols..(t.in_row[j] as usize + 1) * n_cols];
            let o = cpu_matmul(ty, wm, n_rows, n_cols, xi, 1);
            let r0 = t.out_row[j] as usize * n_rows;
            want[r0..r0 + n_rows].copy_from_slice(&o);
        }
    }
    want
}

/// One matvec on the GPU (CPU-quantized activations, so only the matvec is tested).
fn gpu_matvec(
    g: &cuda::Gpu,
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    n_cols: usize,
    x: &[f32],
    n_tok: usize,
) -> Vec<f32> {
    let dw = up(g, w);
    let dx = up(g, x);
    let xq: Vec<quant::ActQ8> = x.chunks_exact(n_cols).map(quant::quantize_act).collect();
    let dq = DevActQ8::upload(g, &xq);
    let out = poisoned(g, n_tok * n_rows);
    let rb = (w.len() / n_rows) as u64;
    g.matvec(
        ty,
        dw.ptr(),
        rb,
        n_rows,
        n_cols,
        dx.ptr(),
        dq.q(),
        n_tok,
        out.ptr(),
    )
    .unwrap();
    down(g, &out)
}

#[test]
fn matvec_matches_the_cpu_for_every_type_and_shape() {
    let Some(g) = gpu("matvec") else { return };
    let mut rng = Rng::new(2);
    for ty in TYPES {
        let b = block(ty);
        // One block; 2048 columns (2 sub-blocks per lane); lanes with unequal counts;
        // more than 32 blocks; odd row counts (row starts at every alignment).
        let shapes = [(7, b), (300, 2048), (33, 1280), (64, 4096 + b)];
        for (i, &(n_rows, n_cols)) in shapes.iter().enumerate() {
            for raw in [false, true] {
                let w = weights(ty, n_rows, n_cols, raw, &mut rng);
                let n_tok = [1, 3, 8, 9][i];
                let x = activations(n_tok, n_cols, &mut rng);
                let got = gpu_matvec(&g, ty, &w, n_rows, n_cols, &x, n_tok);
                let want = cpu_matmul(ty, &w, n_rows, n_cols, &x, n_tok);
                assert_bits(
                    &got,
                    &want,
                    &format!("{ty} {n_rows}×{n_cols}, {n_tok} tokens, raw={raw}"),
                );
            }
        }
    }
}

#[test]
fn matvec_every_token_count_up_to_17() {
    let Some(g) = gpu("matvec tokens") else {
        return;
    };
    let mut rng = Rng::new(3);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::BF16,
        GgmlType::Q2_K,
        GgmlType::IQ2_XXS,
        GgmlType::Q5_1,
        GgmlType::IQ1_M,
    ] {
        let (n_rows, n_cols) = (96, 2048);
        let w = weights(ty, n_rows, n_cols, false, &mut rng);
        for n_tok in 1..=17 {
            let x = activations(n_tok, n_cols, &mut rng);
            let got = gpu_matvec(&g, ty, &w, n_rows, n_cols, &x, n_tok);
            let want = cpu_matmul(ty, &w, n_rows, n_cols, &x, n_tok);
            assert_bits(&got, &want, &format!("{ty} {n_tok} tokens"));
        }
    }
}

#[test]
fn matvec_lm_head_shape() {
    let Some(g) = gpu("matvec lm head") else {
        return;
    };
    let mut rng = Rng::new(4);
    // The largest head of the three archs: 248,320 rows (Qwen3.5 vocabulary).
    let (n_rows, n_cols) = (248_320, 2048);
    for (ty, n_tok) in [(GgmlType::Q6_K, 1), (GgmlType::Q8_0, 2)] {
        let w = weights(ty, n_rows, n_cols, true, &mut rng);
        let x = activations(n_tok, n_cols, &mut rng);
        let got = gpu_matvec(&g, ty, &w, n_rows, n_cols, &x, n_tok);
        let want = cpu_matmul(ty, &w, n_rows, n_cols, &x, n_tok);
        assert_bits(
            &got,
            &want,
            &format!("{ty} head {n_rows}×{n_cols}, {n_tok} tokens"),
        );
    }
}

#[test]
fn matvec_tiles_gathers_and_scatters_by_expert() {
    let Some(g) = gpu("matvec_tiles") else { return };
    let mut rng = Rng::new(5);
    for ty in TYPES {
        let (n_exp, n_rows, n_cols, n_in) = (5, 96, 512, 13);
        let w = weights(ty, n_exp * n_rows, n_cols, false, &mut rng);
        let rb = w.len() / (n_exp * n_rows);
        let expert_bytes = (n_rows * rb) as u64;
        let x = activations(n_in, n_cols, &mut rng);
        // Tiles of 1..=8 tokens, in any order, one empty; output rows are a permutation
        // of part of the output (some rows are never written and must stay poisoned).
        let n_out = 40;
        let mut out_rows: Vec<i32> = (0..n_out as i32).collect();
        for i in (1..out_rows.len()).rev() {
            out_rows.swap(i, rng.below(i + 1));
        }
        let mut next_out = 0;
        let mut tiles = Vec::new();
        for n in [3usize, 8, 1, 0, 5, 2, 7] {
            let mut t = Tile {
                expert: rng.below(n_exp) as i32,
                n: n as i32,
                ..Default::default()
            };
            for j in 0..n {
                t.in_row[j] = rng.below(n_in) as i32;
                t.out_row[j] = out_rows[next_out];
                next_out += 1;
            }
            tiles.push(t);
        }
        let dw = up(&g, &w);
        let dx = up(&g, &x);
        let xq: Vec<quant::ActQ8> = x.chunks_exact(n_cols).map(quant::quantize_act).collect();
        let dq = DevActQ8::upload(&g, &xq);
        let dt = up(&g, &tiles);
        let out = poisoned(&g, n_out * n_rows);
        g.matvec_tiles(
            ty,
            dw.ptr(),
            expert_bytes,
            rb as u64,
            n_rows,
            n_cols,
            dx.ptr(),
            dq.q(),
            dt.ptr(),
            tiles.len(),
            out.ptr(),
        )
        .unwrap();
        let got = down(&g, &out);
        let want = cpu_tiles(ty, &w, n_rows, n_cols, &x, &tiles, n_out);
        assert_bits(&got, &want, &format!("{ty} tiles"));
        assert!(next_out < n_out, "some output rows stay unwritten");
    }
}

#[test]
fn gemm_matches_the_cpu_for_every_type_and_shape() {
    // More than 8 tokens of a dense product run on the tensor-core GEMM (mmq.cu),
    // which must give every (row, token) the canonical bits: rows that are not a
    // multiple of the block's 64, token counts that are not a multiple of 32, rows of
    // fewer than 32 sub-blocks (empty accumulators, also a count that is not a power
    // of two), of more (two and more per accumulator, unequal counts).
    let Some(g) = gpu("gemm") else { return };
    let mut rng = Rng::new(7);
    for ty in TYPES.into_iter().filter(|&t| !is_float(t)) {
        let b = block(ty);
        let shapes = [
            (7, b, 100),
            (65, 768, 40),
            (130, 2048, 77),
            (33, 1280, 9),
            (64, 4096 + b, 33),
        ];
        for &(n_rows, n_cols, n_tok) in &shapes {
            for raw in [false, true] {
                let w = weights(ty, n_rows, n_cols, raw, &mut rng);
                let x = activations(n_tok, n_cols, &mut rng);
                let got = gpu_matvec(&g, ty, &w, n_rows, n_cols, &x, n_tok);
                let want = cpu_matmul(ty, &w, n_rows, n_cols, &x, n_tok);
                assert_bits(
                    &got,
                    &want,
                    &format!("gemm {ty} {n_rows}×{n_cols}, {n_tok} tokens, raw={raw}"),
                );
            }
        }
    }
}

#[test]
fn float_matmul_matches_the_cpu() {
    // More than 8 tokens of a plain float matrix whose rows are a multiple of 128
    // long (a prompt's router) run on the shared-memory matmul (`mm_*`): rows and
    // tokens that do not fill its 16 × 32 block, several stages of 128 columns, and
    // the router's shape; every (row, token) must keep the canonical bits.
    let Some(g) = gpu("float matmul") else {
        return;
    };
    let mut rng = Rng::new(11);
    for ty in TYPES.into_iter().filter(|&t| is_float(t)) {
        for (n_rows, n_cols, n_tok) in [(7, 128, 9), (33, 384, 65), (512, 2048, 100)] {
            let w = weights(ty, n_rows, n_cols, false, &mut rng);
            let x = activations(n_tok, n_cols, &mut rng);
            let got = gpu_matvec(&g, ty, &w, n_rows, n_cols, &x, n_tok);
            let want = cpu_matmul(ty, &w, n_rows, n_cols, &x, n_tok);
            assert_bits(
                &got,
                &want,
                &format!("float matmul {ty} {n_rows}×{n_cols}, {n_tok} tokens"),
            );
        }
    }
}

#[test]
fn grouped_tiles_share_an_expert() {
    // A prompt's routed experts: groups of TILE_GROUP tiles of one expert (the last
    // tiles of a group may be empty), tokens gathered from any input row and
    // scattered to any output row.
    let Some(g) = gpu("grouped tiles") else {
        return;
    };
    let mut rng = Rng::new(8);
    for ty in TYPES {
        let (n_exp, n_rows, n_cols, n_in) = (6, 80, 512, 50);
        let w = weights(ty, n_exp * n_rows, n_cols, false, &mut rng);
        let rb = w.len() / (n_exp * n_rows);
        let x = activations(n_in, n_cols, &mut rng);
        let mut tiles = Vec::new();
        let mut next_out = 0i32;
        // Tokens per expert: more than one group, exactly one, a partial one, none.
        for (e, count) in [(3usize, 70usize), (0, 32), (5, 9), (1, 1), (2, 0), (4, 40)] {
            let mut left = count;
            let groups = count.div_ceil(cuda::TILE_TOKENS * cuda::TILE_GROUP).max(1);
            for _ in 0..groups * cuda::TILE_GROUP {
                let n = left.min(cuda::TILE_TOKENS);
                let mut t = Tile {
                    expert: e as i32,
                    n: n as i32,
                    ..Default::default()
                };
                for j in 0..n {
                    t.in_row[j] = rng.below(n_in) as i32;
                    t.out_row[j] = next_out;
                    next_out += 1;
                }
                left -= n;
                tiles.push(t);
            }
        }
        let n_out = next_out as usize + 3;
        let dw = up(&g, &w);
        let dx = up(&g, &x);
        let xq: Vec<quant::ActQ8> = x.chunks_exact(n_cols).map(quant::quantize_act).collect();
        let dq = DevActQ8::upload(&g, &xq);
        let dt = up(&g, &tiles);
        let out = poisoned(&g, n_out * n_rows);
        g.matvec_tiles_as(
            TileShape::Grouped,
            ty,
            dw.ptr(),
            (n_rows * rb) as u64,
            rb as u64,
            n_rows,
            n_cols,
            dx.ptr(),
            dq.q(),
            dt.ptr(),
            tiles.len(),
            out.ptr(),
        )
        .unwrap();
        let got = down(&g, &out);
        let want = cpu_tiles(ty, &w, n_rows, n_cols, &x, &tiles, n_out);
        assert_bits(&got, &want, &format!("{ty} grouped tiles"));
    }
}

#[test]
fn embed_matches_dequantize_row() {
    let Some(g) = gpu("embed") else { return };
    let mut rng = Rng::new(6);
    for ty in TYPES {
        for raw in [false, true] {
            let (vocab, cols) = (50, 2 * block(ty) + 512);
            let table = weights(ty, vocab, cols, raw, &mut rng);
            let rb = table.len() / vocab;
            let ids: Vec<i32> = (0..11)
                .map(|i| if i == 5 { 7 } else { rng.below(vocab) as i32 })
                .collect();
            let (dt, di) = (up(&g, &table), up(&g, &ids));
            let out = poisoned(&g, ids.len() * cols);
            g.embed(
                ty,
                dt.ptr(),
                rb as u64,
                cols,
                di.ptr(),
                ids.len(),
                out.ptr(),
            )
            .unwrap();
            let got = down(&g, &out);
            let mut want = vec![0f32; ids.len() * cols];
            for (t, &id) in ids.iter().enumerate() {
                let id = id as usize;
                quant::dequantize_row(
                    ty,
                    &table[id * rb..(id + 1) * rb],
                    &mut want[t * cols..(t + 1) * cols],
                );
            }
            assert_bits(&got, &want, &format!("embed {ty} raw={raw}"));
        }
    }
}

#[test]
fn matvec_refuses_bad_shapes_by_name() {
    let Some(g) = gpu("matvec errors") else {
        return;
    };
    let w = up(&g, &[0u8; 144 * 4]);
    let x = up(&g, &[1f32; 512]);
    let out = poisoned(&g, 4);
    let e = g
        .matvec(
            GgmlType::Q4_K,
            w.ptr(),
            100,
            4,
            256,
            x.ptr(),
            ActQ8::NONE,
            1,
            out.ptr(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("matvec") && e.contains("row_bytes"), "{e}");
    let e = g
        .matvec(
            GgmlType::Q4_K,
            w.ptr(),
            144,
            4,
            200,
            x.ptr(),
            ActQ8::NONE,
            1,
            out.ptr(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("200 columns"), "{e}");
    let e = g
        .matvec(
            GgmlType::Q4_K,
            w.ptr() + 2,
            144,
            3,
            256,
            x.ptr(),
            ActQ8::NONE,
            1,
            out.ptr(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("16-byte aligned"), "{e}");
    let e = g
        .matvec(
            GgmlType::Q8_K,
            w.ptr(),
            292,
            1,
            256,
            x.ptr(),
            ActQ8::NONE,
            1,
            out.ptr(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("no CUDA kernel") && e.contains("Q8_K"), "{e}");
    // A low-bit type's rows must start where its loads can read them.
    let e = g
        .matvec(
            GgmlType::Q2_K,
            w.ptr() + 2,
            84,
            4,
            256,
            x.ptr(),
            ActQ8::NONE,
            1,
            out.ptr(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("4-byte aligned"), "{e}");
}

/// The kernels take exactly the types the quant crate has kernels for (no GPU needed).
#[test]
fn the_gpu_takes_every_type_the_cpu_takes() {
    for ty in GgmlType::ALL {
        assert_eq!(
            cuda::supports_type(ty),
            quant::is_supported(ty),
            "{ty}: the CUDA kernels and the quant crate disagree"
        );
    }
    assert!(TYPES.iter().all(|&t| cuda::supports_type(t)));
}
