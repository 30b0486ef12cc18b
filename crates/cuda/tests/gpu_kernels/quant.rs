//! quantize_act, matvec, matvec_tiles and embed against the quant crate, bit for bit.

use crate::{assert_bits, down, filled, gpu, poisoned, up, DevActQ8, QOut, Rng};
use cuda::{ActQ8, GgmlType, MoeRoute, Tile, TileShape};

/// Every type with kernels: the float types, the first quantized ones, then the low-bit
/// types (Q2_K .. IQ1_M).
const TYPES: [GgmlType; 25] = quant::SUPPORTED;

fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Values per block of `ty` (the column granularity; 32 for float types).
fn block(ty: GgmlType) -> usize {
    ty.block_size().max(32)
}

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
        _ => (&[], 0),
    }
}

/// A random f16 of magnitude from subnormal to ~1 (exponent field 0..15), any sign.
fn small_f16(rng: &mut Rng) -> u16 {
    ((rng.next_u64() as u16) & 0x83ff) | (((rng.next_u64() % 16) as u16) << 10)
}

/// The scales of a random block that are not a plain f16 field: MXFP4's e8m0 exponent
/// (within 2^±20, so that products stay finite) and IQ1_M's f16, whose four nibbles
/// are the top nibbles of its four scale words.
fn finite_scales(ty: GgmlType, blk: &mut [u8], rng: &mut Rng) {
    match ty {
        GgmlType::MXFP4 => blk[0] = 108 + (rng.next_u64() % 40) as u8,
        GgmlType::IQ1_M => {
            let d = small_f16(rng);
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

/// `n_rows` rows of `ty`. Quantized rows of random values, or for block types with
/// `raw`, random bytes with finite scales (every bit pattern of the quant fields).
pub fn weights(ty: GgmlType, n_rows: usize, n_cols: usize, raw: bool, rng: &mut Rng) -> Vec<u8> {
    let rb = quant::row_bytes(ty, n_cols).expect("supported shape");
    let mut w = vec![0u8; n_rows * rb];
    let (fields, bsize) = scale_fields(ty);
    if raw && bsize > 0 {
        for b in w.iter_mut() {
            *b = rng.next_u64() as u8;
        }
        for blk in w.chunks_exact_mut(bsize) {
            for &off in fields {
                let bits = small_f16(rng);
                blk[off..off + 2].copy_from_slice(&bits.to_le_bytes());
            }
            finite_scales(ty, blk, rng);
        }
    } else {
        let vals = rng.vec(n_rows * n_cols, 1.5);
        for (r, v) in vals.chunks_exact(n_cols).enumerate() {
            quant::quantize_row(ty, v, &mut w[r * rb..(r + 1) * rb]);
        }
    }
    w
}

/// Activations with mixed magnitudes, one all-zero block and exact rounding ties.
fn activations(n_tok: usize, n_cols: usize, rng: &mut Rng) -> Vec<f32> {
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
fn cpu_matmul(
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

/// `rows` × `cols` of `ty` at `b` (a stack of such matrices for experts).
fn mat(ty: GgmlType, b: &cuda::DevBuf<u8>, rows: usize, cols: usize) -> cuda::Mat {
    let rb = quant::row_bytes(ty, cols).expect("supported shape") as u64;
    cuda::Mat {
        ty,
        ptr: b.ptr(),
        expert_bytes: rb * rows as u64,
        row_bytes: rb,
        n_rows: rows,
        n_cols: cols,
    }
}

/// One token's MoE block through the fused decode kernels (moe_gate_up, then
/// quantize_act over the activations, then moe_down_combine) against the CPU:
/// each expert's matvecs, SwiGLU, the shared gate's dot and the rank-order
/// combination, bit for bit, for every weight type as gate/up and as down of the
/// routed and of the shared expert.
#[test]
fn fused_decode_moe_matches_the_cpu() {
    let Some(g) = gpu("moe_gate_up, moe_down_combine") else {
        return;
    };
    let mut rng = Rng::new(31);
    let n = TYPES.len();
    // (routed gate/up, routed down, shared gate/up, shared down, shared, logit,
    //  n_embd, n_ff, n_sff, experts, k)
    let mut cases = vec![
        (
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            true,
            true,
            2048,
            512,
            512,
            16,
            8,
        ),
        (
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            GgmlType::Q4_K,
            false,
            false,
            1024,
            256,
            0,
            12,
            10,
        ),
    ];
    for i in 0..n {
        let shared = i % 3 != 2;
        cases.push((
            TYPES[i],
            TYPES[(i + 3) % n],
            TYPES[(i + 5) % n],
            TYPES[(i + 7) % n],
            shared,
            shared && i % 3 == 0,
            512,
            256,
            if shared { 512 } else { 0 },
            6,
            3,
        ));
    }
    for (tgu, td, stgu, std_, shared, logit, e, fe, sh, n_exp, k) in cases {
        let what = format!(
            "gate/up {tgu}, down {td}, shared {}, {e}×{fe}, top-{k} of {n_exp}",
            if shared {
                format!("{stgu}/{std_} ({sh}) logit={logit}")
            } else {
                "none".into()
            }
        );
        let gate = weights(tgu, n_exp * fe, e, false, &mut rng);
        let upw = weights(tgu, n_exp * fe, e, false, &mut rng);
        let dn = weights(td, n_exp * e, fe, false, &mut rng);
        let (sg, su, sd) = if shared {
            (
                weights(stgu, sh, e, false, &mut rng),
                weights(stgu, sh, e, false, &mut rng),
                weights(std_, e, sh, false, &mut rng),
            )
        } else {
            (Vec::new(), Vec::new(), Vec::new())
        };
        let gate_inp = rng.vec(e, 0.2);
        let (gu_rb, d_rb) = (gate.len() / (n_exp * fe), dn.len() / (n_exp * e));
        // The CPU's MoE block of a token (x) routed by the router's logits: its
        // routing (ids, weights), activations, shared gate logit and output.
        let cpu = |x: &[f32], logits: &[f32]| {
            let routes = model::moe::route(logits, k);
            let ids: Vec<i32> = routes.iter().map(|&(e, _)| e as i32).collect();
            let wts: Vec<f32> = routes.iter().map(|&(_, w)| w).collect();
            let mut act = Vec::new();
            for &id in &ids {
                let ex = id as usize * fe * gu_rb..(id as usize + 1) * fe * gu_rb;
                let gv = cpu_matmul(tgu, &gate[ex.clone()], fe, e, x, 1);
                let uv = cpu_matmul(tgu, &upw[ex], fe, e, x, 1);
                act.extend(gv.iter().zip(&uv).map(|(&a, &b)| model::math::silu(a) * b));
            }
            if shared {
                let gv = cpu_matmul(stgu, &sg, sh, e, x, 1);
                let uv = cpu_matmul(stgu, &su, sh, e, x, 1);
                act.extend(gv.iter().zip(&uv).map(|(&a, &b)| model::math::silu(a) * b));
            }
            let lg = model::math::dot(x, &gate_inp);
            let mut want = vec![0f32; e];
            for (r, &id) in ids.iter().enumerate() {
                let ex = id as usize * e * d_rb..(id as usize + 1) * e * d_rb;
                let d = cpu_matmul(td, &dn[ex], e, fe, &act[r * fe..(r + 1) * fe], 1);
                for (o, v) in want.iter_mut().zip(&d) {
                    *o += wts[r] * v;
                }
            }
            if shared {
                let d = cpu_matmul(std_, &sd, e, sh, &act[k * fe..], 1);
                let gt = model::math::sigmoid(lg);
                for (o, v) in want.iter_mut().zip(&d) {
                    *o = if logit { *o + gt * v } else { *o + v };
                }
            }
            (ids, wts, act, lg, want)
        };
        let x = activations(1, e, &mut rng);
        let logits = rng.vec(n_exp, 4.0);
        let (ids, wts, act, lg, want) = cpu(&x, &logits);

        // The GPU.
        let (dgate, dup, ddn) = (up(&g, &gate), up(&g, &upw), up(&g, &dn));
        let (dsg, dsu, dsd) = (up(&g, &sg), up(&g, &su), up(&g, &sd));
        let (dx, dgi, dlogits) = (up(&g, &x), up(&g, &gate_inp), up(&g, &logits));
        let (dwts_out, dids_out) = (poisoned(&g, k), filled::<i32>(&g, k, 0xff));
        let dq = DevActQ8::upload(&g, &[quant::quantize_act(&x)]);
        let n_act = k * fe + sh;
        let dact = poisoned(&g, n_act);
        let dlg = poisoned(&g, 1);
        let (mg, mu, md) = (
            mat(tgu, &dgate, fe, e),
            mat(tgu, &dup, fe, e),
            mat(td, &ddn, e, fe),
        );
        let (msg, msu, msd) = (
            mat(stgu, &dsg, sh, e),
            mat(stgu, &dsu, sh, e),
            mat(std_, &dsd, e, sh),
        );
        // The activations' quantized copy, written by the last block of each plane; the
        // plane counters must be zero again afterwards, so a second launch gives the same.
        let aqo = QOut::new(&g, n_act);
        let aq = aqo.q();
        let done = filled::<i32>(&g, k + 1, 0);
        // The two launches with this case's weights: gate/up for `n` tokens (x, its
        // copy, the shared logit's address, act, act's copy, the plane counts) and
        // down + combine (ids, weights, act and its copy, shared logit, out, given).
        let gate_up = |route, n, x, xq, lg: u64, act, aq, done| {
            g.moe_gate_up(
                &mg,
                &mu,
                shared.then_some((&msg, &msu)),
                if logit { dgi.ptr() } else { 0 },
                route,
                k,
                n,
                x,
                xq,
                if logit { lg } else { 0 },
                act,
                aq,
                done,
            )
            .unwrap()
        };
        let down_combine = |ids, wts, n, act, aq, lg: u64, out, given| {
            g.moe_down_combine(
                &md,
                shared.then_some(&msd),
                ids,
                wts,
                k,
                n,
                act,
                aq,
                if logit { lg } else { 0 },
                out,
                given,
            )
            .unwrap()
        };
        for launch in 0..2 {
            let route = MoeRoute::Logits {
                logits: dlogits.ptr(),
                n_expert: n_exp,
                wts_out: dwts_out.ptr(),
                ids_out: dids_out.ptr(),
            };
            gate_up(
                route,
                1,
                dx.ptr(),
                dq.q(),
                dlg.ptr(),
                dact.ptr(),
                aq,
                done.ptr(),
            );
            let what = format!("{what}, launch {launch}");
            assert_bits(&down(&g, &dact), &act, &format!("activations: {what}"));
            if logit {
                assert_bits(
                    &down(&g, &dlg),
                    &[lg],
                    &format!("shared gate logit: {what}"),
                );
            }
            aqo.assert_quantizes(&g, &act, n_act, &format!("activations: {what}"));
            assert!(
                down(&g, &done).iter().all(|&c| c == 0),
                "plane counts not reset: {what}"
            );
        }
        let out = poisoned(&g, e);
        assert_bits(
            &down(&g, &dwts_out),
            &wts,
            &format!("routing weights: {what}"),
        );
        assert_eq!(down(&g, &dids_out), ids, "routing experts: {what}");
        down_combine(
            dids_out.ptr(),
            dwts_out.ptr(),
            1,
            dact.ptr(),
            aq,
            dlg.ptr(),
            out.ptr(),
            0,
        );
        assert_bits(&down(&g, &out), &want, &format!("output: {what}"));

        // The routing given instead, every other rank computed elsewhere (negative
        // id, its down products given as rows): the same activations for the ranks
        // computed here, the others untouched, and the same output.
        let given_ids: Vec<i32> = ids
            .iter()
            .enumerate()
            .map(|(r, &id)| if r % 2 == 1 { -1 } else { id })
            .collect();
        let dgiven_ids = up(&g, &given_ids);
        let mut given = vec![f32::NAN; k * e];
        for (r, &id) in ids.iter().enumerate().filter(|(r, _)| r % 2 == 1) {
            let ex = id as usize * e * d_rb..(id as usize + 1) * e * d_rb;
            let d = cpu_matmul(td, &dn[ex], e, fe, &act[r * fe..(r + 1) * fe], 1);
            given[r * e..(r + 1) * e].copy_from_slice(&d);
        }
        let dgiven = up(&g, &given);
        let dact2 = poisoned(&g, n_act);
        let aqo2 = QOut::new(&g, n_act);
        let route = MoeRoute::Given {
            ids: dgiven_ids.ptr(),
        };
        gate_up(
            route,
            1,
            dx.ptr(),
            dq.q(),
            dlg.ptr(),
            dact2.ptr(),
            aqo2.q(),
            done.ptr(),
        );
        let got = down(&g, &dact2);
        for r in 0..k + usize::from(shared) {
            let (a, b) = (r * fe, if r < k { (r + 1) * fe } else { n_act });
            if r < k && r % 2 == 1 {
                assert!(
                    got[a..b].iter().all(|v| v.is_nan()),
                    "rank {r} computed elsewhere was written: {what}"
                );
            } else {
                assert_bits(
                    &got[a..b],
                    &act[a..b],
                    &format!("given routing, plane {r}: {what}"),
                );
            }
        }
        assert!(
            down(&g, &done).iter().all(|&c| c == 0),
            "plane counts not reset (given routing): {what}"
        );
        let out2 = poisoned(&g, e);
        down_combine(
            dgiven_ids.ptr(),
            dwts_out.ptr(),
            1,
            dact2.ptr(),
            aqo2.q(),
            dlg.ptr(),
            out2.ptr(),
            dgiven.ptr(),
        );
        assert_bits(
            &down(&g, &out2),
            &want,
            &format!("output, given routing: {what}"),
        );

        // Three tokens at once (the rows launches), the second the token above: each
        // token's routing, activations, shared logit and output are its own bits.
        let toks = [
            activations(1, e, &mut rng),
            x.clone(),
            activations(1, e, &mut rng),
        ];
        let lgts = [rng.vec(n_exp, 4.0), logits.clone(), rng.vec(n_exp, 4.0)];
        let wants: Vec<_> = toks.iter().zip(&lgts).map(|(x, l)| cpu(x, l)).collect();
        let nt = toks.len();
        let dx3 = up(&g, &toks.concat());
        let dl3 = up(&g, &lgts.concat());
        let dq3 = DevActQ8::upload(
            &g,
            &toks
                .iter()
                .map(|x| quant::quantize_act(x))
                .collect::<Vec<_>>(),
        );
        let (dw3, di3) = (poisoned(&g, nt * k), filled::<i32>(&g, nt * k, 0xff));
        let (dact3, dlg3, aqo3) = (
            poisoned(&g, nt * n_act),
            poisoned(&g, nt),
            QOut::new(&g, nt * n_act),
        );
        let done3 = filled::<i32>(&g, nt * (k + 1), 0);
        let route = MoeRoute::Logits {
            logits: dl3.ptr(),
            n_expert: n_exp,
            wts_out: dw3.ptr(),
            ids_out: di3.ptr(),
        };
        gate_up(
            route,
            nt,
            dx3.ptr(),
            dq3.q(),
            dlg3.ptr(),
            dact3.ptr(),
            aqo3.q(),
            done3.ptr(),
        );
        let out3 = poisoned(&g, nt * e);
        down_combine(
            di3.ptr(),
            dw3.ptr(),
            nt,
            dact3.ptr(),
            aqo3.q(),
            dlg3.ptr(),
            out3.ptr(),
            0,
        );
        let (gw3, gi3, ga3, gl3, go3) = (
            down(&g, &dw3),
            down(&g, &di3),
            down(&g, &dact3),
            down(&g, &dlg3),
            down(&g, &out3),
        );
        for (t, (ids, wts, act, lg, want)) in wants.iter().enumerate() {
            let what = format!("{what}, token {t} of {nt}");
            assert_eq!(
                &gi3[t * k..(t + 1) * k],
                &ids[..],
                "routing experts: {what}"
            );
            assert_bits(
                &gw3[t * k..(t + 1) * k],
                wts,
                &format!("routing weights: {what}"),
            );
            assert_bits(
                &ga3[t * n_act..(t + 1) * n_act],
                act,
                &format!("activations: {what}"),
            );
            if logit {
                assert_bits(
                    &gl3[t..t + 1],
                    &[*lg],
                    &format!("shared gate logit: {what}"),
                );
            }
            assert_bits(&go3[t * e..(t + 1) * e], want, &format!("output: {what}"));
        }
        aqo3.assert_quantizes(
            &g,
            &wants.iter().flat_map(|w| w.2.clone()).collect::<Vec<_>>(),
            n_act,
            &format!("activations' copy: {what}, {nt} tokens"),
        );
        assert!(
            down(&g, &done3).iter().all(|&c| c == 0),
            "plane counts not reset ({nt} tokens): {what}"
        );
    }
}

/// Up to four matrices against one token in one launch (matvec_multi) give each
/// matrix's matvec, bit for bit, for every type; the conv epilogue of matrix 0 gives
/// model::deltanet::conv_step's output and state.
#[test]
fn matvec_multi_matches_the_cpu() {
    let Some(g) = gpu("matvec_multi") else { return };
    let mut rng = Rng::new(33);
    let n = TYPES.len();
    for i in 0..n {
        let n_cols = 512;
        let count = 1 + i % 4;
        let shapes: Vec<(GgmlType, usize)> = (0..count)
            .map(|p| (TYPES[(i + 2 * p) % n], [96, 63, 8, 41][p]))
            .collect();
        let ws: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(ty, rows)| weights(ty, rows, n_cols, false, &mut rng))
            .collect();
        let x = activations(1, n_cols, &mut rng);
        let conv = i % 2 == 0;
        let d_conv = 4;
        let rows0 = shapes[0].1;
        let state0 = rng.vec(rows0 * (d_conv - 1), 2.0);
        let taps = rng.vec(rows0 * d_conv, 0.7);
        // The CPU.
        let mut want: Vec<Vec<f32>> = shapes
            .iter()
            .zip(&ws)
            .map(|(&(ty, rows), w)| cpu_matmul(ty, w, rows, n_cols, &x, 1))
            .collect();
        let mut state = state0.clone();
        if conv {
            let mut o = vec![0f32; rows0];
            model::deltanet::conv_step(&mut state, &taps, &want[0], d_conv, &mut o);
            want[0] = o;
        }
        // The GPU.
        let dws: Vec<_> = ws.iter().map(|w| up(&g, w)).collect();
        let mats: Vec<cuda::Mat> = shapes
            .iter()
            .zip(&dws)
            .map(|(&(ty, rows), b)| mat(ty, b, rows, n_cols))
            .collect();
        let outs: Vec<_> = shapes.iter().map(|&(_, rows)| poisoned(&g, rows)).collect();
        let (dx, dst, dtaps) = (up(&g, &x), up(&g, &state0), up(&g, &taps));
        let dq = DevActQ8::upload(&g, &[quant::quantize_act(&x)]);
        g.matvec_multi(
            &mats.iter().collect::<Vec<_>>(),
            &outs.iter().map(|o| o.ptr()).collect::<Vec<_>>(),
            dx.ptr(),
            dq.q(),
            conv.then_some((dst.ptr(), dtaps.ptr(), d_conv)),
        )
        .unwrap();
        for (p, o) in outs.iter().enumerate() {
            assert_bits(
                &down(&g, o),
                &want[p],
                &format!("matvec_multi matrix {p} of {shapes:?}, conv {conv}"),
            );
        }
        if conv {
            assert_bits(
                &down(&g, &dst),
                &state,
                &format!("conv state of {shapes:?}"),
            );
        }
        // Several tokens in one launch (matvec_multi_rows; 3, or 6 to take a second
        // group of four): each token's matvec, and with the conv, each token's conv
        // step on a state of its own (a table).
        let nt = if i % 2 == 0 { 3 } else { 6 };
        let x3 = activations(nt, n_cols, &mut rng);
        let dx3 = up(&g, &x3);
        let q3: Vec<_> = x3.chunks(n_cols).map(quant::quantize_act).collect();
        let dq3 = DevActQ8::upload(&g, &q3);
        let outs3: Vec<_> = shapes
            .iter()
            .map(|&(_, rows)| poisoned(&g, nt * rows))
            .collect();
        let states3: Vec<Vec<f32>> = (0..nt)
            .map(|_| rng.vec(rows0 * (d_conv - 1), 2.0))
            .collect();
        let dstates3: Vec<_> = states3.iter().map(|st| up(&g, st)).collect();
        let tab = up(&g, &dstates3.iter().map(|b| b.ptr()).collect::<Vec<u64>>());
        g.matvec_multi_rows(
            &mats.iter().collect::<Vec<_>>(),
            &outs3.iter().map(|o| o.ptr()).collect::<Vec<_>>(),
            dx3.ptr(),
            dq3.q(),
            nt,
            conv.then_some((tab.ptr(), dtaps.ptr(), d_conv)),
        )
        .unwrap();
        for (p, (o, (&(ty, rows), w))) in outs3.iter().zip(shapes.iter().zip(&ws)).enumerate() {
            let mut want = cpu_matmul(ty, w, rows, n_cols, &x3, nt);
            if p == 0 && conv {
                for (t, st) in states3.iter().enumerate() {
                    let mut st = st.clone();
                    let mut o = vec![0f32; rows];
                    let row = &want[t * rows..(t + 1) * rows];
                    model::deltanet::conv_step(&mut st, &taps, row, d_conv, &mut o);
                    want[t * rows..(t + 1) * rows].copy_from_slice(&o);
                    assert_bits(
                        &down(&g, &dstates3[t]),
                        &st,
                        &format!("matvec_multi_rows conv state of token {t}, {shapes:?}"),
                    );
                }
            }
            assert_bits(
                &down(&g, o),
                &want,
                &format!("matvec_multi_rows matrix {p} of {shapes:?}, conv {conv}"),
            );
        }
    }
}

/// The router kernel against the CPU's matvec, bit for bit: float routers of each
/// type, widths wider than one register load of a row (2,048 values), token counts
/// up to the most it takes (a row of blocks each), and refusals by name.
#[test]
fn router_matches_the_cpu_matvec() {
    let Some(g) = gpu("router") else { return };
    let mut rng = Rng::new(31);
    for (ty, n_expert, n_cols, n_tok) in [
        (GgmlType::F32, 256, 2048, 1),
        (GgmlType::F32, 256, 2048, 4),
        (GgmlType::F32, 512, 2048, 16),
        (GgmlType::F32, 60, 160, 3),
        (GgmlType::F32, 130, 4128, 5),
        (GgmlType::F32, 1024, 256, 2),
        (GgmlType::F16, 128, 2048, 7),
        (GgmlType::BF16, 64, 96, 9),
    ] {
        let w = weights(ty, n_expert, n_cols, false, &mut rng);
        let x = activations(n_tok, n_cols, &mut rng);
        let want = cpu_matmul(ty, &w, n_expert, n_cols, &x, n_tok);
        let (dw, dx) = (up(&g, &w), up(&g, &x));
        let logits = poisoned(&g, n_tok * n_expert);
        g.router(
            &mat(ty, &dw, n_expert, n_cols),
            dx.ptr(),
            n_tok,
            logits.ptr(),
        )
        .unwrap();
        assert_bits(
            &down(&g, &logits),
            &want,
            &format!("{ty} {n_expert}×{n_cols}, {n_tok} tokens"),
        );
        // The routed launch (at most 256 experts): the same logits, and each token's
        // model::moe::route from its last block, twice (the counts return to zero).
        if n_expert > cuda::ROUTE_IN_ROUTER_MAX_EXPERT {
            continue;
        }
        let k = n_expert.min(8);
        let counter = filled::<i32>(&g, n_tok, 0);
        for round in 0..2 {
            let logits = poisoned(&g, n_tok * n_expert);
            let (dw, di) = (poisoned(&g, n_tok * k), filled::<i32>(&g, n_tok * k, 0xff));
            let route = cuda::RouterRoute {
                k,
                weights_out: dw.ptr(),
                ids_out: di.ptr(),
                counter: counter.ptr(),
            };
            g.router_routed(
                &mat(ty, &up(&g, &w), n_expert, n_cols),
                dx.ptr(),
                n_tok,
                logits.ptr(),
                Some(route),
            )
            .unwrap();
            let what = format!("routed {ty} {n_expert}×{n_cols}, {n_tok} tokens, round {round}");
            assert_bits(&down(&g, &logits), &want, &what);
            let (gw, gi) = (down(&g, &dw), down(&g, &di));
            for t in 0..n_tok {
                let r = model::moe::route(&want[t * n_expert..(t + 1) * n_expert], k);
                let ids: Vec<i32> = r.iter().map(|x| x.0 as i32).collect();
                let wts: Vec<f32> = r.iter().map(|x| x.1).collect();
                assert_eq!(&gi[t * k..(t + 1) * k], &ids[..], "ids, {what}, token {t}");
                assert_bits(
                    &gw[t * k..(t + 1) * k],
                    &wts,
                    &format!("weights, {what}, token {t}"),
                );
            }
            assert_eq!(down(&g, &counter), vec![0; n_tok], "counts, {what}");
        }
    }
    let w = weights(GgmlType::Q8_0, 8, 64, false, &mut rng);
    let dw = up(&g, &w);
    let x = up(&g, &vec![0f32; 17 * 64]);
    let out = poisoned(&g, 17 * 8);
    let e = g
        .router(&mat(GgmlType::Q8_0, &dw, 8, 64), x.ptr(), 1, out.ptr())
        .unwrap_err();
    assert!(e.to_string().contains("F32, F16 or BF16"), "{e}");
    let wf = up(&g, &vec![0f32; 8 * 64]);
    let wf = cuda::Mat {
        ty: GgmlType::F32,
        ptr: wf.ptr(),
        expert_bytes: 8 * 256,
        row_bytes: 256,
        n_rows: 8,
        n_cols: 64,
    };
    let e = g.router(&wf, x.ptr(), 17, out.ptr()).unwrap_err();
    assert!(e.to_string().contains("17 tokens"), "{e}");
    let wb = up(&g, &vec![0f32; 512 * 64]);
    let big = cuda::Mat {
        ptr: wb.ptr(),
        expert_bytes: 512 * 256,
        n_rows: 512,
        ..wf
    };
    let route = cuda::RouterRoute {
        k: 8,
        weights_out: out.ptr(),
        ids_out: out.ptr(),
        counter: out.ptr(),
    };
    let e = g
        .router_routed(&big, x.ptr(), 2, out.ptr(), Some(route))
        .unwrap_err();
    assert!(e.to_string().contains("of 512 experts"), "{e}");
}
