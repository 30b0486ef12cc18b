//! Routed experts on the CPU. A prompt's tokens are grouped by expert so it reads
//! each expert's weights once (a few tokens, as in decode steps, run one product
//! per token and expert in two parallel regions); each (token, rank) output is kept
//! apart and the k outputs are combined in top-k rank order (`combine`), so a
//! token's result does not depend on which other tokens ran beside it
//! (docs/design.md invariants 1 and 3). With tiered experts (`tier.rs`) the bytes
//! come from the tier's RAM copy or a read of the file, and rows whose experts could
//! not be read are left out (their sequences' steps fail; the other rows' bits are
//! those of a step without them, by the same invariant).

use super::tier::LayerExperts;
use super::{apply_scale, each_row, Act, CpuBackend, PARALLEL_ROWS};
use model::math::{sigmoid, silu_mul};
use model::moe::route;
use model::weights::MoeWeights;
use model::ModelConfig;
use rayon::prelude::*;

/// Where a step's routed experts' bytes are.
enum Src<'a> {
    /// The mapped file (every expert resident).
    Mapped,
    /// The tier's RAM copy or this step's read.
    Tier(&'a LayerExperts<'a>),
}

impl<'a> Src<'a> {
    /// Expert `ex`'s gate, up and down bytes.
    fn mats(&self, w: &'a MoeWeights, ex: usize) -> [&'a [u8]; 3] {
        let mapped = || {
            [
                w.gate_exps.matrix_bytes(ex),
                w.up_exps.matrix_bytes(ex),
                w.down_exps.matrix_bytes(ex),
            ]
        };
        match self {
            Src::Mapped => mapped(),
            // Rows routed to an expert without bytes are left out before anything is
            // computed, so the fallback is never taken; were it taken, the mapped file
            // holds the same expert's bytes (read through the page cache instead).
            Src::Tier(le) => le.mats(ex).unwrap_or_else(mapped),
        }
    }
}

/// The MTP block's MoE: its experts are read from the mapped file whatever the tier
/// holds (the tier and the routing counts cover the trunk's layers).
pub(super) fn run_mapped(b: &CpuBackend, w: &MoeWeights, x: &Act) -> Act {
    let routes = routes(b, w, x);
    experts(b, &b.cfg, w, &Src::Mapped, x, &routes)
}

fn routes(b: &CpuBackend, w: &MoeWeights, x: &Act) -> Vec<Vec<(usize, f32)>> {
    let k = b.cfg.n_expert_used;
    let logits = b.mm_weight(&w.router, x);
    let mut routes = vec![Vec::new(); x.rows];
    quant::par::for_each_mut(&mut routes, |t, r| *r = route(logits.row(t), k));
    routes
}

pub(super) fn run(b: &CpuBackend, layer: usize, w: &MoeWeights, x: &Act) -> Act {
    let cfg = &b.cfg;
    let routes = routes(b, w, x);
    if let Some(counts) = &b.routing {
        for r in &routes {
            counts.record_token(layer, r.iter().map(|&(ex, _)| ex));
        }
    }
    let Some(tier) = &b.tier else {
        return experts(b, cfg, w, &Src::Mapped, x, &routes);
    };
    // Rows that failed in an earlier layer of this pass take no expert.
    let mut dead = vec![false; x.rows];
    for (r, _) in tier.failed_rows() {
        if let Some(d) = dead.get_mut(r) {
            *d = true;
        }
    }
    let mut uses = vec![0u32; cfg.n_expert];
    for (t, r) in routes.iter().enumerate() {
        if !dead[t] {
            for &(ex, _) in r {
                uses[ex] += 1;
            }
        }
    }
    let got = tier.fetch(layer, &uses);
    let mut failed = Vec::new();
    for (t, r) in routes.iter().enumerate() {
        if dead[t] {
            continue;
        }
        if let Some(err) = r.iter().find_map(|&(ex, _)| got.failure(ex)) {
            failed.push((t, err.clone()));
            dead[t] = true;
        }
    }
    let src = Src::Tier(&got);
    let out = if failed.is_empty() && !dead.contains(&true) {
        experts(b, cfg, w, &src, x, &routes)
    } else {
        // The rows that have their experts, computed as a step of their own (each
        // row's bits are its own); the others' outputs stay zero and are never used.
        let live: Vec<usize> = (0..x.rows).filter(|&t| !dead[t]).collect();
        let mut out = Act::zeros(x.rows, x.cols);
        if !live.is_empty() {
            let mut xs = Act::zeros(live.len(), x.cols);
            for (i, &t) in live.iter().enumerate() {
                xs.row_mut(i).copy_from_slice(x.row(t));
            }
            let rs: Vec<Vec<(usize, f32)>> = live.iter().map(|&t| routes[t].clone()).collect();
            let part = experts(b, cfg, w, &src, &xs, &rs);
            for (i, &t) in live.iter().enumerate() {
                out.row_mut(t).copy_from_slice(part.row(i));
            }
        }
        out
    };
    tier.fail_rows(failed);
    tier.done(got);
    out
}

/// The routed and shared experts of every row of `x` (`routes`: each row's top-k),
/// combined in rank order.
fn experts(
    b: &CpuBackend,
    cfg: &ModelConfig,
    w: &MoeWeights,
    src: &Src,
    x: &Act,
    routes: &[Vec<(usize, f32)>],
) -> Act {
    let (t_n, e) = (x.rows, cfg.n_embd);
    let k = cfg.n_expert_used;
    if t_n < PARALLEL_ROWS {
        return few_tokens(b, cfg, w, src, x, routes);
    }

    // tokens_of[expert] = [(token, rank)]
    let mut tokens_of: Vec<Vec<(usize, usize)>> = vec![Vec::new(); cfg.n_expert];
    for (t, r) in routes.iter().enumerate() {
        for (rank, &(ex, _)) in r.iter().enumerate() {
            tokens_of[ex].push((t, rank));
        }
    }
    // expert_out[(t * k + rank) * e ..]
    // Experts run in parallel (each also splits its rows); their outputs are
    // scattered to (token, rank) slots, so the combination order is fixed.
    let busy: Vec<(usize, &Vec<(usize, usize)>)> = tokens_of
        .iter()
        .enumerate()
        .filter(|(_, toks)| !toks.is_empty())
        .collect();
    let results: Vec<Act> = busy
        .par_iter()
        .map(|&(ex, toks)| {
            let mut xe = Act::zeros(toks.len(), e);
            for (i, &(t, _)) in toks.iter().enumerate() {
                xe.row_mut(i).copy_from_slice(x.row(t));
            }
            expert_ffn(b, w, ex, src.mats(w, ex), &xe, cfg.n_ff_exp)
        })
        .collect();
    // Where each (token, rank) output is: (index into `results`, row).
    let mut at = vec![(0usize, 0usize); t_n * k];
    for (bi, (_, toks)) in busy.iter().enumerate() {
        for (i, &(t, rank)) in toks.iter().enumerate() {
            at[t * k + rank] = (bi, i);
        }
    }
    let shared = w.shared.as_ref().map(|sh| {
        let gu = b.mm_many(x, &[&sh.gate, &sh.up]);
        (sh, b.mm_weight(&sh.down, &swiglu(&gu[0], &gu[1])))
    });
    // Each token's outputs in rank order, then the shared expert's: tokens in parallel.
    let mut out = Act::zeros(t_n, e);
    each_row(&mut out.data, e, |t, o| {
        let routed = |rank: usize| {
            let (bi, i) = at[t * k + rank];
            results[bi].row(i)
        };
        let sh = shared
            .as_ref()
            .map(|(sh, down)| (shared_gate(&sh.gate_inp, x.row(t)), down.row(t)));
        combine(o, &routes[t], routed, sh);
    });
    out
}

/// A few tokens (a decode step of one or several sequences): every token's routed
/// experts' and shared expert's gate and up products in one parallel region, then
/// every down projection in another, each product a matvec of one token. Same bits
/// as the grouped path, which runs the same per-row kernels; a token's experts are
/// its own even when two tokens share one (a batch reads it twice, from cache). The
/// products write into two flat buffers (no allocation per product).
fn few_tokens(
    b: &CpuBackend,
    cfg: &ModelConfig,
    w: &MoeWeights,
    src: &Src,
    x: &Act,
    routes: &[Vec<(usize, f32)>],
) -> Act {
    let (e, f) = (cfg.n_embd, cfg.n_ff_exp);
    // Each token's experts, token after token: its routed ones in rank order, then
    // the shared expert; each as its (type, bytes, rows, scale) gate, up and down.
    type Mat<'a> = (quant::GgmlType, &'a [u8], usize, Option<f32>);
    let per = routes.first().map_or(0, Vec::len) + usize::from(w.shared.is_some());
    let mut experts: Vec<(usize, [Mat; 3])> = Vec::with_capacity(per * x.rows);
    for (t, r) in routes.iter().enumerate() {
        experts.extend(r.iter().map(|&(ex, _)| {
            let [g, u, d] = src.mats(w, ex);
            (
                t,
                [
                    (w.gate_exps.ty, g, f, w.gate_exps.scale(ex)),
                    (w.up_exps.ty, u, f, w.up_exps.scale(ex)),
                    (w.down_exps.ty, d, e, w.down_exps.scale(ex)),
                ],
            )
        }));
        if let Some(sh) = &w.shared {
            let m = [&sh.gate, &sh.up, &sh.down].map(|m| (m.ty, m.bytes(), m.n_rows(), m.scale(0)));
            experts.push((t, m));
        }
    }
    let in_types: Vec<quant::GgmlType> =
        experts.iter().flat_map(|(_, m)| [m[0].0, m[1].0]).collect();
    let xq = b.prepare(&in_types, x);
    let empty = quant::ActQ8::default();
    // Each expert's gate rows then its up rows, expert after expert.
    let pair_sizes: Vec<usize> = experts.iter().map(|(_, m)| m[0].2 + m[1].2).collect();
    let mut gu = vec![0.0f32; pair_sizes.iter().sum()];
    let mut pairs = split_sizes(&mut gu, &pair_sizes);
    {
        let mut jobs = Vec::with_capacity(2 * experts.len());
        for ((t, m), pair) in experts.iter().zip(pairs.iter_mut()) {
            let (g, u) = pair.split_at_mut(m[0].2);
            for ((ty, bytes, _, _), out) in [(m[0], g), (m[1], u)] {
                jobs.push(quant::MatvecJob {
                    ty,
                    w: bytes,
                    n_cols: e,
                    x: x.row(*t),
                    xq: xq.get(*t).unwrap_or(&empty),
                    out,
                });
            }
        }
        b.matvecs(&mut jobs);
    }
    // SwiGLU of each pair into its gate rows, and the quantized copy its down
    // product reads, pairs in parallel (tens of µs a layer on one thread).
    let mut acts: Vec<(&mut [f32], quant::ActQ8)> = pairs
        .into_iter()
        .map(|p| (p, quant::ActQ8::default()))
        .collect();
    quant::par::for_each_mut(&mut acts, |i, (pair, q)| {
        let m = &experts[i].1;
        let (g, u) = pair.split_at_mut(m[0].2);
        apply_scale(g, m[0].3);
        apply_scale(u, m[1].3);
        silu_mul(g, u);
        *q = b.quantized(&[m[2].0], g);
    });
    let mut downs = vec![0.0f32; experts.len() * e];
    {
        let mut jobs: Vec<quant::MatvecJob> = experts
            .iter()
            .zip(&acts)
            .zip(downs.chunks_mut(e))
            .map(|(((_, m), (pair, q)), out)| quant::MatvecJob {
                ty: m[2].0,
                w: m[2].1,
                n_cols: m[0].2,
                x: &pair[..m[0].2],
                xq: q,
                out,
            })
            .collect();
        b.matvecs(&mut jobs);
    }
    for ((_, m), out) in experts.iter().zip(downs.chunks_mut(e)) {
        apply_scale(out, m[2].3);
    }
    // Each token's shared-expert gate, then the combination in column pieces in
    // parallel (each value's sum keeps its order, so the pieces do not change it).
    let gates: Vec<Option<f32>> = (0..x.rows)
        .map(|t| {
            w.shared
                .as_ref()
                .map(|sh| shared_gate(&sh.gate_inp, x.row(t)))
        })
        .collect();
    let mut out = Act::zeros(x.rows, e);
    let mut pieces: Vec<(usize, usize, &mut [f32])> = out
        .data
        .chunks_mut(e)
        .enumerate()
        .flat_map(|(t, row)| {
            row.chunks_mut(COMBINE_COLS)
                .enumerate()
                .map(move |(c, o)| (t, c * COMBINE_COLS, o))
        })
        .collect();
    quant::par::for_each_mut(&mut pieces, |_, (t, c0, o)| {
        let (t, c0, n) = (*t, *c0, o.len());
        let (r, mine) = (&routes[t], &downs[t * per * e..(t + 1) * per * e]);
        let cols = |i: usize| &mine[i * e + c0..i * e + c0 + n];
        let sh = gates[t].map(|g| (g, cols(r.len())));
        combine(o, r, cols, sh);
    });
    out
}

/// `buf` cut into consecutive pieces of the given sizes.
fn split_sizes<'a>(buf: &'a mut [f32], sizes: &[usize]) -> Vec<&'a mut [f32]> {
    let mut rest = buf;
    sizes
        .iter()
        .map(|&n| {
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            piece
        })
        .collect()
}

/// Columns of a token's MoE output combined by one task of a decode step.
const COMBINE_COLS: usize = 256;

/// One token's MoE output `o` (zeros on entry), or a run of its columns: its
/// routed experts' outputs (`routed(rank)`, the same columns) weighted in top-k
/// rank order, then the shared expert's output gated by its
/// sigmoid(gate_inp · x), given as (gate, output).
fn combine<'a>(
    o: &mut [f32],
    route: &[(usize, f32)],
    routed: impl Fn(usize) -> &'a [f32],
    shared: Option<(f32, &[f32])>,
) {
    for (rank, &(_, wt)) in route.iter().enumerate() {
        for (a, &d) in o.iter_mut().zip(routed(rank)) {
            *a += wt * d;
        }
    }
    if let Some((gate, down)) = shared {
        for (a, &d) in o.iter_mut().zip(down) {
            *a += gate * d;
        }
    }
}

/// The shared expert's gate for input `x`: sigmoid(gate_inp · x), the dot in the
/// canonical 32-lane order (`model::math::dot`), as the GPU computes it.
fn shared_gate(gate_inp: &[f32], x: &[f32]) -> f32 {
    sigmoid(model::math::dot(gate_inp, x))
}

/// silu(g) ⊙ u, rows in parallel for a prompt (elementwise: the same bits either way).
fn swiglu(g: &Act, u: &Act) -> Act {
    let mut out = Act::zeros(g.rows, g.cols);
    each_row(&mut out.data, g.cols, |r, o| {
        o.copy_from_slice(g.row(r));
        silu_mul(o, u.row(r));
    });
    out
}

/// down_e(silu(gate_e x) ⊙ up_e x) for the rows of `xe`, given expert `ex`'s gate,
/// up and down bytes; each product times its matrix's scale for `ex` when the file
/// gives them.
fn expert_ffn(
    b: &CpuBackend,
    w: &MoeWeights,
    ex: usize,
    mats: [&[u8]; 3],
    xe: &Act,
    n_ff: usize,
) -> Act {
    let xq = b.prepare(&[w.gate_exps.ty, w.up_exps.ty], xe);
    let mut g = b.mm(w.gate_exps.ty, mats[0], n_ff, xe, &xq);
    apply_scale(&mut g.data, w.gate_exps.scale(ex));
    let mut u = b.mm(w.up_exps.ty, mats[1], n_ff, xe, &xq);
    apply_scale(&mut u.data, w.up_exps.scale(ex));
    let act = swiglu(&g, &u);
    let aq = b.prepare(&[w.down_exps.ty], &act);
    let mut d = b.mm(w.down_exps.ty, mats[2], xe.cols, &act, &aq);
    apply_scale(&mut d.data, w.down_exps.scale(ex));
    d
}

/// One matrix–vector product of [`TokenExperts`]: a matrix of one type (rows of
/// `rb` bytes) and the input it reads.
#[cfg(any(feature = "cuda", test))]
struct Product<'a> {
    ty: quant::GgmlType,
    w: &'a [u8],
    rb: usize,
    x: &'a [f32],
    xq: &'a quant::ActQ8,
    /// Where its output starts in the phase's output vector.
    at: usize,
    n_rows: usize,
}

#[cfg(any(feature = "cuda", test))]
impl<'a> Product<'a> {
    /// `n_rows` rows of `(ty, w)` against `x` (quantized as `xq`), written at `at`.
    fn new(
        (ty, w, _): ExpertMat<'a>,
        x: &'a [f32],
        xq: &'a quant::ActQ8,
        n_rows: usize,
        at: usize,
    ) -> Self {
        let rb =
            quant::row_bytes(ty, x.len()).unwrap_or_else(|e| panic!("CPU expert product: {e}"));
        Product {
            ty,
            w,
            rb,
            x,
            xq,
            at,
            n_rows,
        }
    }
}

/// Rows of one task of a [`TokenExperts`] phase: about 32 KiB of weights, so a
/// phase of a few experts makes a few dozen tasks for the team's threads.
#[cfg(any(feature = "cuda", test))]
const TASK_BYTES: usize = 32 * 1024;

/// One matrix of an expert as [`TokenExperts`] takes it: its type, its bytes and its
/// second-level scale (`model::Weight::scale`).
#[cfg(any(feature = "cuda", test))]
pub(crate) type ExpertMat<'a> = (quant::GgmlType, &'a [u8], Option<f32>);

/// The routed experts of one token, each given as its raw gate, up and down matrices
/// ([`ExpertMat`]): `down(silu(gate·x) ⊙ up·x)` per expert, each product times its
/// matrix's scale as `expert_ffn` applies it, in two parallel
/// phases on a [`Team`](super::team::Team) (gate and up, then down), each of which
/// can run beside other work of the caller's thread. Canonical precision only: the
/// same bits as `expert_ffn` and as the GPU kernels, which is what lets the tiered
/// GPU executor send misses here.
#[cfg(any(feature = "cuda", test))]
pub(crate) struct TokenExperts<'a> {
    x: &'a [f32],
    experts: &'a [[ExpertMat<'a>; 3]],
    n_ff: usize,
    /// Gate and up outputs of every expert (2·n_ff values each), then SwiGLU.
    gu: Vec<f32>,
}

#[cfg(any(feature = "cuda", test))]
impl<'a> TokenExperts<'a> {
    pub fn new(x: &'a [f32], experts: &'a [[ExpertMat<'a>; 3]], n_ff: usize) -> Self {
        TokenExperts {
            x,
            experts,
            n_ff,
            gu: Vec::new(),
        }
    }

    /// Phase one: every expert's gate and up products, with `beside` run on the
    /// caller's thread meanwhile.
    pub fn gate_up<R>(&mut self, team: &super::team::Team, beside: impl FnOnce() -> R) -> R {
        let xq = quant::quantize_act(self.x);
        let n_ff = self.n_ff;
        let prods: Vec<Product> = self
            .experts
            .iter()
            .flat_map(|m| [m[0], m[1]])
            .enumerate()
            .map(|(i, m)| Product::new(m, self.x, &xq, n_ff, i * n_ff))
            .collect();
        let mut out = vec![0.0f32; prods.len() * n_ff];
        let r = run_products(team, &prods, &mut out, beside);
        for (p, m) in out.chunks_mut(2 * n_ff).zip(self.experts) {
            let (g, u) = p.split_at_mut(n_ff);
            apply_scale(g, m[0].2);
            apply_scale(u, m[1].2);
        }
        self.gu = out;
        r
    }

    /// Phase two: SwiGLU and every expert's down product, with `beside` run on the
    /// caller's thread meanwhile. Returns each expert's output and `beside`'s value.
    pub fn down<R>(
        self,
        team: &super::team::Team,
        beside: impl FnOnce() -> R,
    ) -> (Vec<Vec<f32>>, R) {
        let (n_ff, e) = (self.n_ff, self.x.len());
        let mut acts = Vec::with_capacity(self.experts.len() * n_ff);
        for p in self.gu.chunks(2 * n_ff) {
            let a = acts.len();
            acts.extend_from_slice(&p[..n_ff]);
            silu_mul(&mut acts[a..], &p[n_ff..]);
        }
        let aqs: Vec<quant::ActQ8> = acts.chunks(n_ff).map(quant::quantize_act).collect();
        let prods: Vec<Product> = self
            .experts
            .iter()
            .zip(acts.chunks(n_ff).zip(&aqs))
            .enumerate()
            .map(|(i, (m, (a, aq)))| Product::new(m[2], a, aq, e, i * e))
            .collect();
        let mut out = vec![0.0f32; prods.len() * e];
        let r = run_products(team, &prods, &mut out, beside);
        for (o, m) in out.chunks_mut(e).zip(self.experts) {
            apply_scale(o, m[2].2);
        }
        (out.chunks(e).map(<[f32]>::to_vec).collect(), r)
    }
}

/// `out[p.at + r]` = row r of product p · its input, in tasks of about
/// [`TASK_BYTES`] on the team, `beside` on the caller's thread meanwhile.
#[cfg(any(feature = "cuda", test))]
fn run_products<R>(
    team: &super::team::Team,
    prods: &[Product],
    out: &mut [f32],
    beside: impl FnOnce() -> R,
) -> R {
    // (product, first row, rows) of every task.
    let mut tasks = Vec::new();
    for (i, p) in prods.iter().enumerate() {
        let per = (TASK_BYTES / p.rb.max(1)).max(1);
        for r0 in (0..p.n_rows).step_by(per) {
            tasks.push((i, r0, per.min(p.n_rows - r0)));
        }
    }
    let out_ptr = SharedOut(out.as_mut_ptr(), out.len());
    let f = |t: usize| {
        let (i, r0, n) = tasks[t];
        let p = &prods[i];
        // SAFETY: tasks cover disjoint row ranges of disjoint products' outputs, all
        // inside `out` (checked by `slice`), and `out` outlives the loop.
        let dst = unsafe { out_ptr.slice(p.at + r0, n) };
        let w = &p.w[r0 * p.rb..(r0 + n) * p.rb];
        quant::try_matvec_serial(p.ty, w, p.x.len(), p.x, p.xq, dst)
            .unwrap_or_else(|e| panic!("CPU expert product: {e}"));
    };
    team.run_beside(tasks.len(), &f, beside)
}

/// The output of [`run_products`], written by many threads at disjoint ranges.
#[cfg(any(feature = "cuda", test))]
#[derive(Clone, Copy)]
struct SharedOut(*mut f32, usize);
// SAFETY: only disjoint ranges are handed out (see `run_products`).
#[cfg(any(feature = "cuda", test))]
unsafe impl Sync for SharedOut {}
#[cfg(any(feature = "cuda", test))]
impl SharedOut {
    /// # Safety
    /// No two live slices may overlap.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, n: usize) -> &mut [f32] {
        assert!(at + n <= self.1, "task range past the output");
        std::slice::from_raw_parts_mut(self.0.add(at), n)
    }
}

#[cfg(test)]
mod tests {
    use super::{apply_scale, ExpertMat, TokenExperts};
    use crate::cpu::team::Team;
    use model::math::silu_mul;
    use quant::GgmlType;

    /// Random rows of `ty` (n_rows × n_cols), from values in [-1, 1).
    fn matrix(ty: GgmlType, n_rows: usize, n_cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let vals: Vec<f32> = (0..n_rows * n_cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        let rb = quant::row_bytes(ty, n_cols).unwrap();
        let mut out = vec![0u8; n_rows * rb];
        for (src, dst) in vals.chunks(n_cols).zip(out.chunks_mut(rb)) {
            quant::quantize_row(ty, src, dst);
        }
        out
    }

    #[test]
    fn token_experts_on_a_team_give_the_serial_bits() {
        let (e, n_ff) = (256, 512);
        let x: Vec<f32> = (0..e)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let mats: Vec<[Vec<u8>; 3]> = (0..3)
            .map(|i| {
                [
                    matrix(GgmlType::Q4_K, n_ff, e, 3 * i + 1),
                    matrix(GgmlType::Q4_K, n_ff, e, 3 * i + 2),
                    matrix(GgmlType::Q8_0, e, n_ff, 3 * i + 3),
                ]
            })
            .collect();
        // Second-level scales on some matrices of some experts.
        let scale = |i: usize, j: usize| (i % 3 == j).then_some(0.75 + i as f32 / 8.0);
        let experts: Vec<[ExpertMat; 3]> = mats
            .iter()
            .enumerate()
            .map(|(i, m)| {
                [
                    (GgmlType::Q4_K, &m[0][..], scale(i, 0)),
                    (GgmlType::Q4_K, &m[1][..], scale(i, 1)),
                    (GgmlType::Q8_0, &m[2][..], scale(i, 2)),
                ]
            })
            .collect();
        // Row by row on one thread: the CPU executor's expert FFN.
        let xq = quant::quantize_act(&x);
        let want: Vec<Vec<f32>> = experts
            .iter()
            .map(|m| {
                let mut g = vec![0.0; n_ff];
                let mut u = vec![0.0; n_ff];
                quant::matvec(m[0].0, m[0].1, e, &x, &xq, &mut g);
                quant::matvec(m[1].0, m[1].1, e, &x, &xq, &mut u);
                apply_scale(&mut g, m[0].2);
                apply_scale(&mut u, m[1].2);
                silu_mul(&mut g, &u);
                let aq = quant::quantize_act(&g);
                let mut o = vec![0.0; e];
                quant::matvec(m[2].0, m[2].1, n_ff, &g, &aq, &mut o);
                apply_scale(&mut o, m[2].2);
                o
            })
            .collect();
        for workers in [0, 2, 5] {
            let team = Team::new(workers);
            for n in 1..=experts.len() {
                let mut te = TokenExperts::new(&x, &experts[..n], n_ff);
                assert_eq!(te.gate_up(&team, || 7), 7);
                let (got, r) = te.down(&team, || "beside");
                assert_eq!(r, "beside");
                assert_eq!(got.len(), n);
                for (a, b) in got.iter().zip(&want) {
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(a), bits(b), "{workers} workers, {n} experts");
                }
            }
        }
    }
}
