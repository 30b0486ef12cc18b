//! Attention on the CPU: q/k per-head RMSNorm, partial NeoX RoPE, causal GQA
//! softmax attention over the cache, optional sigmoid output gate, output proj.
//!
//! The arithmetic of one query row is fixed: each score is one sequential sum over
//! the head's dims, `s = 0; s += q_i·k_i` (products and sums rounded apart), times
//! `scale`; `model::math::softmax` over the row; then `o_j += p·v_j` over the
//! positions in increasing order. A prompt of T tokens does T²/2 such rows' worth of
//! work per head, so how it runs decides how prompt speed falls with length. Two
//! things made it fall fast: every score was a chain of dependent adds, and every
//! query streamed its whole K and V history from memory on its own. Now
//! - the cache keeps keys dim-major (positions contiguous), and [`scores`] runs
//!   `LANES` positions side by side, each lane its own unchanged chain;
//! - a task takes `TOKENS_PER_TASK` queries of one head and walks the history block
//!   by block for all of them, so each block of K and V is read once per task, not
//!   once per query;
//! - the per-task code is built for the vector level the CPU has (no fused
//!   multiply-adds are formed: Rust never contracts `a * b + c`).
//!
//! None of this changes an operation or its order, so the bits are the one-query,
//! one-position-at-a-time loop's (`tests`, and the engine's prefill == decode tests).

use super::{each_row, Act, CpuBackend, KvCache, PARALLEL_ROWS};
use model::math::{mrope_table, rms_norm, rope_neox_with, rope_table, sigmoid};
use model::simd::Level;
use model::weights::AttentionWeights;

/// Positions whose scores run side by side (8 AVX2 / 4 AVX-512 registers of sums:
/// enough independent chains to hide the add latency).
const LANES: usize = 64;

/// Queries (consecutive tokens of one head) per task: each block of the history is
/// read once for all of them. A decode step has one per head.
const TOKENS_PER_TASK: usize = 16;

/// Positions per block of the value pass (`hd` floats each, shared by a task's queries).
const V_BLOCK: usize = 16;

/// The token-wise input projections of every row of `x`: q (with the output gate
/// where the arch has one), k and v.
pub(super) struct Projections {
    q: Act,
    k: Act,
    v: Act,
}

pub(super) fn project(b: &CpuBackend, w: &AttentionWeights, x: &Act) -> Projections {
    let mut outs = b.mm_many(x, &[&w.q, &w.k, &w.v]).into_iter();
    Projections {
        q: outs.next().expect("q"),
        k: outs.next().expect("k"),
        v: outs.next().expect("v"),
    }
}

/// Where a segment's rows sit: cache positions `pos0..`, rotated at those positions
/// or, in a prompt with images, at each row's multimodal position.
#[derive(Clone, Copy)]
pub(super) struct At<'a> {
    pub pos0: usize,
    pub rope: Option<&'a [[u32; 3]]>,
}

/// Attention of the `t_n` rows from `r0` of `proj`, at positions `at`, over
/// `cache` (which their keys and values join): the rows before the output
/// projection.
#[allow(clippy::too_many_arguments)]
pub(super) fn core(
    b: &CpuBackend,
    w: &AttentionWeights,
    proj: &Projections,
    r0: usize,
    t_n: usize,
    at: At,
    cache: &mut KvCache,
    n_ctx: usize,
) -> Act {
    let cfg = &b.cfg;
    let pos0 = at.pos0;
    let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
    assert!(
        pos0 + t_n <= n_ctx,
        "context overflow is checked by the engine"
    );
    let q_stride = if cfg.attn_output_gate { 2 * hd } else { hd };
    // The cache grows to hold this call's positions; K's row stride is its capacity.
    cache.reserve(pos0 + t_n, n_ctx);
    cache.wrote(pos0 + t_n);
    let stride = cache.capacity();
    let (k_cache, v_cache) = cache.k_v_mut();

    // Per token (in parallel for a prompt): its queries and keys normed and rotated
    // with one rotary table, and its gates. Keys then go into the cache dim-major
    // (key dim i of kv head h at position p is k[(h·hd + i)·stride + p]: each cache
    // row takes the call's positions as one run); values position-major.
    let kvw = nkv * hd;
    let mut q = vec![0.0f32; t_n * nh * hd];
    let mut keys = vec![0.0f32; t_n * kvw];
    let mut gate = vec![
        0.0f32;
        if cfg.attn_output_gate {
            t_n * nh * hd
        } else {
            0
        }
    ];
    {
        let key_rows = quant::par::ColumnRuns::new(&mut keys, kvw);
        let gate_rows = quant::par::ColumnRuns::new(&mut gate, nh * hd);
        each_row(&mut q, nh * hd, |t, qt| {
            let row = proj.q.row(r0 + t);
            let rope = match (at.rope, cfg.rope_sections) {
                (Some(r), Some(sections)) => mrope_table(r[t], cfg.n_rot, cfg.rope_theta, sections),
                // A model without sections has one position (the engine takes images
                // only for models with them).
                (Some(r), None) => rope_table(r[t][0] as usize, cfg.n_rot, cfg.rope_theta),
                (None, _) => rope_table(pos0 + t, cfg.n_rot, cfg.rope_theta),
            };
            for (h, dst) in qt.chunks_exact_mut(hd).enumerate() {
                dst.copy_from_slice(&row[h * q_stride..h * q_stride + hd]);
                rms_norm(dst, &w.q_norm, cfg.eps);
                rope_neox_with(dst, &rope);
            }
            // SAFETY (both): row t of keys and gates belongs to token t's call alone.
            let kt = unsafe { key_rows.run(t, 0, kvw) };
            let k_row = proj.k.row(r0 + t);
            for (h, key) in kt.chunks_exact_mut(hd).enumerate() {
                key.copy_from_slice(&k_row[h * hd..(h + 1) * hd]);
                rms_norm(key, &w.k_norm, cfg.eps);
                rope_neox_with(key, &rope);
            }
            if cfg.attn_output_gate {
                let gt = unsafe { gate_rows.run(t, 0, nh * hd) };
                for (h, dst) in gt.chunks_exact_mut(hd).enumerate() {
                    dst.copy_from_slice(&row[h * q_stride + hd..h * q_stride + 2 * hd]);
                }
            }
        });
    }
    let to_row = |j: usize, k_row: &mut [f32]| {
        for (t, dst) in k_row[pos0..pos0 + t_n].iter_mut().enumerate() {
            *dst = keys[t * kvw + j];
        }
    };
    let k_rows = k_cache.chunks_mut(stride).take(kvw);
    if t_n < PARALLEL_ROWS {
        k_rows.enumerate().for_each(|(j, r)| to_row(j, r));
    } else {
        let mut k_rows: Vec<&mut [f32]> = k_rows.collect();
        quant::par::for_each_mut(&mut k_rows, |j, r| to_row(j, r));
    }
    for t in 0..t_n {
        v_cache[(pos0 + t) * kvw..(pos0 + t + 1) * kvw].copy_from_slice(proj.v.row(r0 + t));
    }

    // Tasks: (head, first token) tiles; each returns its queries' output rows.
    let geo = Sizes {
        hd,
        kvw: nkv * hd,
        stride,
        pos0,
        scale: 1.0 / (hd as f32).sqrt(),
    };
    let group = nh / nkv;
    let tiles: Vec<(usize, usize)> = (0..nh)
        .flat_map(|h| (0..t_n).step_by(TOKENS_PER_TASK).map(move |t0| (h, t0)))
        .collect();
    let wide = model::simd::level();
    let (k_cache, v_cache) = (&*k_cache, &*v_cache);
    let mut results: Vec<Vec<f32>> = vec![Vec::new(); tiles.len()];
    quant::par::for_each_mut(&mut results, |i, result| {
        let (h, t0) = tiles[i];
        let t1 = (t0 + TOKENS_PER_TASK).min(t_n);
        let kvh = h / group;
        let tile = Tile {
            // Query (and gate) rows of tokens t0..t1 of head h: stride nh·hd.
            q: &q[(t0 * nh + h) * hd..],
            gate: if gate.is_empty() {
                &[]
            } else {
                &gate[(t0 * nh + h) * hd..]
            },
            row_stride: nh * hd,
            t0,
            n: t1 - t0,
            kt: &k_cache[kvh * hd * stride..(kvh + 1) * hd * stride],
            v: &v_cache[kvh * hd..],
        };
        *result = attend_at(wide, &geo, &tile);
    });
    // Tile (h, t0) is number h · tiles_per_head + t0 / TOKENS_PER_TASK.
    let tiles_per_head = t_n.div_ceil(TOKENS_PER_TASK);
    let mut out = Act::zeros(t_n, nh * hd);
    each_row(&mut out.data, nh * hd, |t, row| {
        let (tile, i) = (t / TOKENS_PER_TASK, t % TOKENS_PER_TASK);
        for (h, dst) in row.chunks_exact_mut(hd).enumerate() {
            dst.copy_from_slice(&results[h * tiles_per_head + tile][i * hd..(i + 1) * hd]);
        }
    });
    out
}

/// Sizes shared by every tile of a call.
struct Sizes {
    hd: usize,
    /// Floats per position of the V cache (n_head_kv · hd).
    kvw: usize,
    /// Stride of the dim-major K cache (its capacity in positions).
    stride: usize,
    /// Position of token 0 of this call.
    pos0: usize,
    scale: f32,
}

/// The queries of one task: tokens t0..t0+n of one head, and its kv head's cache.
struct Tile<'a> {
    /// Row i (token t0 + i) at `i · row_stride`, `hd` floats.
    q: &'a [f32],
    /// Empty, or the output gates laid out like `q`.
    gate: &'a [f32],
    row_stride: usize,
    t0: usize,
    n: usize,
    /// The kv head's keys, dim-major: dim i of position p at `i · stride + p`.
    kt: &'a [f32],
    /// The V cache from the kv head's first value: position p at `p · kvw`.
    v: &'a [f32],
}

/// `attend` built for `wide`: the level the model crate's loops use (`model::simd`,
/// which follows the quant kernels' level, so `SCORIA_ISA` lowers it too). Every build
/// performs the same float operations.
fn attend_at(wide: Level, g: &Sizes, t: &Tile) -> Vec<f32> {
    match wide {
        Level::Plain => attend(g, t),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => {
            assert!(wide.is_available(), "this CPU lacks AVX2/FMA");
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            unsafe { attend_avx2(g, t) }
        }
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => {
            assert!(wide.is_available(), "this CPU lacks AVX-512 F/AVX2/FMA");
            // SAFETY: the CPU has AVX-512 F, AVX2 and FMA (checked just above).
            unsafe { attend_avx512(g, t) }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_avx2(g: &Sizes, t: &Tile) -> Vec<f32> {
    attend(g, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn attend_avx512(g: &Sizes, t: &Tile) -> Vec<f32> {
    attend(g, t)
}

/// The output rows (`t.n × hd`) of a tile's queries. Query i attends to positions
/// 0..=pos0 + t0 + i. Scores go block by block of `LANES` positions for all queries,
/// values block by block of `V_BLOCK`; within a query every operation is the
/// one-query loop's, in its order.
#[inline(always)]
fn attend(g: &Sizes, t: &Tile) -> Vec<f32> {
    let hd = g.hd;
    let n_pos = |i: usize| g.pos0 + t.t0 + i + 1;
    let q_row = |i: usize| &t.q[i * t.row_stride..i * t.row_stride + hd];
    let mut probs: Vec<Vec<f32>> = (0..t.n).map(|i| vec![0.0f32; n_pos(i)]).collect();
    let last = n_pos(t.n - 1);
    for p0 in (0..last).step_by(LANES) {
        for (i, row) in probs.iter_mut().enumerate() {
            let end = (p0 + LANES).min(row.len());
            if p0 < end {
                scores(q_row(i), t.kt, g.stride, p0, g.scale, &mut row[p0..end]);
            }
        }
    }
    for row in probs.iter_mut() {
        model::math::softmax(row);
    }
    let mut out = vec![0.0f32; t.n * hd];
    for p0 in (0..last).step_by(V_BLOCK) {
        for (row, o) in probs.iter().zip(out.chunks_exact_mut(hd)) {
            let end = (p0 + V_BLOCK).min(row.len());
            for (p, &pr) in row.iter().enumerate().take(end).skip(p0) {
                let v = &t.v[p * g.kvw..p * g.kvw + hd];
                for (acc, &vv) in o.iter_mut().zip(v) {
                    *acc += pr * vv;
                }
            }
        }
    }
    if !t.gate.is_empty() {
        for (i, o) in out.chunks_exact_mut(hd).enumerate() {
            let gr = &t.gate[i * t.row_stride..i * t.row_stride + hd];
            for (acc, &gg) in o.iter_mut().zip(gr) {
                *acc *= sigmoid(gg);
            }
        }
    }
    out
}

/// `out[j] = (Σ_i q_i·k_i(p0 + j)) · scale` for j < out.len() ≤ LANES, where `kt` is
/// one kv head's keys dim-major (`k_i(p) = kt[i·stride + p]`). Each sum starts at +0.0
/// and adds the rounded products in increasing i, exactly the one-position loop; the
/// positions of a block only share the loop.
#[inline(always)]
fn scores(q: &[f32], kt: &[f32], stride: usize, p0: usize, scale: f32, out: &mut [f32]) {
    let width = out.len();
    let mut acc = [0.0f32; LANES];
    if width == LANES {
        for (i, &qi) in q.iter().enumerate() {
            let k: &[f32; LANES] = kt[i * stride + p0..i * stride + p0 + LANES]
                .try_into()
                .expect("a whole block");
            for j in 0..LANES {
                acc[j] += qi * k[j];
            }
        }
    } else {
        for (i, &qi) in q.iter().enumerate() {
            let k = &kt[i * stride + p0..i * stride + p0 + width];
            for (a, &kv) in acc.iter_mut().zip(k) {
                *a += qi * kv;
            }
        }
    }
    for (o, &a) in out.iter_mut().zip(&acc) {
        *o = a * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// One query row the way attention was first written: scores one position at a
    /// time from a position-major K, softmax, values in position order, gate.
    fn one_query(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], gate: Option<&[f32]>) -> Vec<f32> {
        let scale = 1.0 / (q.len() as f32).sqrt();
        let mut scores = Vec::with_capacity(k.len());
        for kp in k {
            let mut s = 0.0f32;
            for (a, b) in q.iter().zip(kp) {
                s += a * b;
            }
            scores.push(s * scale);
        }
        model::math::softmax(&mut scores);
        let mut o = vec![0.0f32; q.len()];
        for (p, &pr) in scores.iter().enumerate() {
            for (acc, &vv) in o.iter_mut().zip(&v[p]) {
                *acc += pr * vv;
            }
        }
        if let Some(g) = gate {
            for (acc, &gg) in o.iter_mut().zip(g) {
                *acc *= sigmoid(gg);
            }
        }
        o
    }

    /// A tile's rows equal the one-query loop bit for bit, at every build, for
    /// head dims and position counts around the block sizes, with and without gates.
    #[test]
    fn tiles_equal_the_one_query_loop_bitwise() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut r =
            |n: usize, a: f32| -> Vec<f32> { (0..n).map(|_| rng.random_range(-a..a)).collect() };
        let (nkv, kvh) = (2usize, 1usize);
        for (hd, pos0, n, gated) in [
            (40usize, 0usize, 1usize, false),
            (128, 0, 16, true),
            (256, 63, 2, false),
            (72, 130, 16, true),
            (256, 1000, 5, true),
            (40, 7, 9, false),
        ] {
            let n_ctx = pos0 + n + 3;
            let n_all = pos0 + n;
            // Keys and values of every position of kv head `kvh`, position-major.
            let k: Vec<Vec<f32>> = (0..n_all).map(|_| r(hd, 3.0)).collect();
            let v: Vec<Vec<f32>> = (0..n_all).map(|_| r(hd, 2.0)).collect();
            let mut kt = vec![f32::NAN; nkv * hd * n_ctx];
            let mut vc = vec![f32::NAN; n_ctx * nkv * hd];
            for p in 0..n_all {
                for i in 0..hd {
                    kt[(kvh * hd + i) * n_ctx + p] = k[p][i];
                }
                vc[p * nkv * hd + kvh * hd..p * nkv * hd + (kvh + 1) * hd].copy_from_slice(&v[p]);
            }
            // Query rows of 3 heads, this tile reads head 1's (row stride 3·hd).
            let q = r(n * 3 * hd, 2.0);
            let gate = if gated {
                r(n * 3 * hd, 4.0)
            } else {
                Vec::new()
            };
            let row = |m: &[f32], i: usize| m[(i * 3 + 1) * hd..(i * 3 + 2) * hd].to_vec();
            let want: Vec<u32> = (0..n)
                .flat_map(|i| {
                    let g = gated.then(|| row(&gate, i));
                    one_query(
                        &row(&q, i),
                        &k[..pos0 + i + 1],
                        &v[..pos0 + i + 1],
                        g.as_deref(),
                    )
                })
                .map(f32::to_bits)
                .collect();
            let geo = Sizes {
                hd,
                kvw: nkv * hd,
                stride: n_ctx,
                pos0,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let tile = Tile {
                q: &q[hd..],
                gate: if gated { &gate[hd..] } else { &[] },
                row_stride: 3 * hd,
                t0: 0,
                n,
                kt: &kt[kvh * hd * n_ctx..(kvh + 1) * hd * n_ctx],
                v: &vc[kvh * hd..],
            };
            for wide in Level::available() {
                let got: Vec<u32> = attend_at(wide, &geo, &tile)
                    .into_iter()
                    .map(f32::to_bits)
                    .collect();
                assert_eq!(got, want, "hd {hd}, pos0 {pos0}, {n} queries");
            }
        }
    }
}
