//! Routed experts on the CPU. Tokens are grouped by expert so a prompt reads
//! each expert's weights once; each (token, rank) output is kept apart and the
//! k outputs are combined in top-k rank order, so a token's result does not
//! depend on which other tokens ran beside it (docs/design.md invariants 1 and 3).

use super::{Act, CpuBackend, Job};
use model::math::{sigmoid, silu_mul};
use model::moe::route;
use model::weights::MoeWeights;
use model::ModelConfig;
use rayon::prelude::*;

pub(super) fn run(b: &CpuBackend, layer: usize, w: &MoeWeights, x: &Act) -> Act {
    let cfg = &b.cfg;
    let (t_n, e) = (x.rows, cfg.n_embd);
    let k = cfg.n_expert_used;
    let logits = b.mm_weight(&w.router, x);
    let routes: Vec<_> = (0..t_n).map(|t| route(logits.row(t), k)).collect();
    if let Some(counts) = &b.routing {
        for r in &routes {
            counts.record_token(layer, r.iter().map(|&(ex, _)| ex));
        }
    }
    if t_n == 1 {
        return decode_step(b, cfg, w, x, &routes[0]);
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
            expert_ffn(b, w, ex, &xe, cfg.n_ff_exp)
        })
        .collect();
    let mut expert_out = vec![0.0f32; t_n * k * e];
    for ((_, toks), act) in busy.iter().zip(&results) {
        for (i, &(t, rank)) in toks.iter().enumerate() {
            expert_out[(t * k + rank) * e..(t * k + rank + 1) * e].copy_from_slice(act.row(i));
        }
    }
    let mut out = Act::zeros(t_n, e);
    for t in 0..t_n {
        let o = out.row_mut(t);
        for (rank, &(_, wt)) in routes[t].iter().enumerate() {
            let src = &expert_out[(t * k + rank) * e..(t * k + rank + 1) * e];
            for (a, &b) in o.iter_mut().zip(src) {
                *a += wt * b;
            }
        }
    }
    if let Some(sh) = &w.shared {
        let g = b.mm_weight(&sh.gate, x);
        let u = b.mm_weight(&sh.up, x);
        let act = swiglu(&g, &u);
        let down = b.mm_weight(&sh.down, &act);
        for t in 0..t_n {
            let gate = sigmoid(shared_gate_logit(&sh.gate_inp, x.row(t)));
            for (a, &b) in out.row_mut(t).iter_mut().zip(down.row(t)) {
                *a += gate * b;
            }
        }
    }
    out
}

/// One token: every routed expert's gate and up (and the shared expert's) in one
/// parallel region, then every down projection in another. Same bits as the
/// grouped path, which runs the same per-row kernels.
fn decode_step(
    b: &CpuBackend,
    cfg: &ModelConfig,
    w: &MoeWeights,
    x: &Act,
    routes: &[(usize, f32)],
) -> Act {
    let (e, f) = (cfg.n_embd, cfg.n_ff_exp);
    let mut jobs = Vec::with_capacity(2 * routes.len() + 2);
    for &(ex, _) in routes {
        jobs.push(Job {
            ty: w.gate_exps.ty,
            w: w.gate_exps.matrix_bytes(ex),
            n_rows: f,
            input: 0,
        });
        jobs.push(Job {
            ty: w.up_exps.ty,
            w: w.up_exps.matrix_bytes(ex),
            n_rows: f,
            input: 0,
        });
    }
    if let Some(sh) = &w.shared {
        for m in [&sh.gate, &sh.up] {
            jobs.push(Job {
                ty: m.ty,
                w: m.bytes(),
                n_rows: m.n_rows(),
                input: 0,
            });
        }
    }
    let gu = b.mm_many(&[x], &jobs);
    let acts: Vec<Act> = gu.chunks(2).map(|p| swiglu(&p[0], &p[1])).collect();
    let act_refs: Vec<&Act> = acts.iter().collect();
    let mut jobs = Vec::with_capacity(acts.len());
    for (i, &(ex, _)) in routes.iter().enumerate() {
        jobs.push(Job {
            ty: w.down_exps.ty,
            w: w.down_exps.matrix_bytes(ex),
            n_rows: e,
            input: i,
        });
    }
    if let Some(sh) = &w.shared {
        jobs.push(Job {
            ty: sh.down.ty,
            w: sh.down.bytes(),
            n_rows: sh.down.n_rows(),
            input: routes.len(),
        });
    }
    let downs = b.mm_many(&act_refs, &jobs);
    let mut out = Act::zeros(1, e);
    for (rank, &(_, wt)) in routes.iter().enumerate() {
        for (a, &d) in out.data.iter_mut().zip(&downs[rank].data) {
            *a += wt * d;
        }
    }
    if let Some(sh) = &w.shared {
        let gate = sigmoid(shared_gate_logit(&sh.gate_inp, x.row(0)));
        for (a, &d) in out.data.iter_mut().zip(&downs[routes.len()].data) {
            *a += gate * d;
        }
    }
    out
}

/// The shared expert's scalar gate logit, gate_inp · x, in the canonical
/// 32-lane order (`model::math::dot`), as the GPU computes it.
fn shared_gate_logit(gate_inp: &[f32], x: &[f32]) -> f32 {
    model::math::dot(gate_inp, x)
}

fn swiglu(g: &Act, u: &Act) -> Act {
    let mut out = g.clone();
    silu_mul(&mut out.data, &u.data);
    out
}

/// down_e(silu(gate_e x) ⊙ up_e x) for the rows of `xe`.
fn expert_ffn(b: &CpuBackend, w: &MoeWeights, ex: usize, xe: &Act, n_ff: usize) -> Act {
    let xq = b.prepare(&[w.gate_exps.ty, w.up_exps.ty], xe);
    let g = b.mm(w.gate_exps.ty, w.gate_exps.matrix_bytes(ex), n_ff, xe, &xq);
    let u = b.mm(w.up_exps.ty, w.up_exps.matrix_bytes(ex), n_ff, xe, &xq);
    let act = swiglu(&g, &u);
    let aq = b.prepare(&[w.down_exps.ty], &act);
    b.mm(
        w.down_exps.ty,
        w.down_exps.matrix_bytes(ex),
        xe.cols,
        &act,
        &aq,
    )
}

/// The routed experts of one token, each given as its raw (type, bytes) gate, up and
/// down matrices: `down(silu(gate·x) ⊙ up·x)` per expert, in one parallel region per
/// projection. Canonical precision only: the same bits as `expert_ffn` and as the GPU
/// kernels, which is what lets the tiered GPU executor send misses here.
#[cfg(feature = "cuda")]
pub(crate) fn one_token_experts(
    x: &[f32],
    experts: &[[(quant::GgmlType, &[u8]); 3]],
    n_ff: usize,
) -> Vec<Vec<f32>> {
    let e = x.len();
    let xq = quant::quantize_act(x);
    let mut gu: Vec<Vec<f32>> = vec![vec![0.0; n_ff]; 2 * experts.len()];
    let mut jobs: Vec<quant::MatvecJob> = gu
        .iter_mut()
        .enumerate()
        .map(|(i, out)| {
            let (ty, w) = experts[i / 2][i % 2];
            quant::MatvecJob {
                ty,
                w,
                n_cols: e,
                x,
                xq: &xq,
                out,
            }
        })
        .collect();
    quant::matvec_many(&mut jobs);
    drop(jobs);
    let acts: Vec<Vec<f32>> = gu
        .chunks(2)
        .map(|p| {
            let mut a = p[0].clone();
            silu_mul(&mut a, &p[1]);
            a
        })
        .collect();
    let aqs: Vec<quant::ActQ8> = acts.iter().map(|a| quant::quantize_act(a)).collect();
    let mut outs: Vec<Vec<f32>> = vec![vec![0.0; e]; experts.len()];
    let mut jobs: Vec<quant::MatvecJob> = outs
        .iter_mut()
        .enumerate()
        .map(|(i, out)| {
            let (ty, w) = experts[i][2];
            quant::MatvecJob {
                ty,
                w,
                n_cols: n_ff,
                x: &acts[i],
                xq: &aqs[i],
                out,
            }
        })
        .collect();
    quant::matvec_many(&mut jobs);
    drop(jobs);
    outs
}
