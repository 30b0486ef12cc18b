//! Routed experts on the CPU. Tokens are grouped by expert so a prompt reads
//! each expert's weights once; each (token, rank) output is kept apart and the
//! k outputs are combined in top-k rank order, so a token's result does not
//! depend on which other tokens ran beside it (DESIGN.md invariants 1 and 3).

use super::{Act, CpuBackend};
use model::math::{sigmoid, silu};
use model::moe::route;
use model::weights::MoeWeights;
use model::ModelConfig;

pub(super) fn run(b: &CpuBackend, cfg: &ModelConfig, w: &MoeWeights, x: &Act) -> Act {
    let (t_n, e) = (x.rows, cfg.n_embd);
    let k = cfg.n_expert_used;
    let logits = b.mm_weight(&w.router, x);
    let routes: Vec<_> = (0..t_n).map(|t| route(logits.row(t), k)).collect();

    // tokens_of[expert] = [(token, rank)]
    let mut tokens_of: Vec<Vec<(usize, usize)>> = vec![Vec::new(); cfg.n_expert];
    for (t, r) in routes.iter().enumerate() {
        for (rank, &(ex, _)) in r.iter().enumerate() {
            tokens_of[ex].push((t, rank));
        }
    }
    // expert_out[(t * k + rank) * e ..]
    let mut expert_out = vec![0.0f32; t_n * k * e];
    for (ex, toks) in tokens_of.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let mut xe = Act::zeros(toks.len(), e);
        for (i, &(t, _)) in toks.iter().enumerate() {
            xe.row_mut(i).copy_from_slice(x.row(t));
        }
        let act = expert_ffn(b, w, ex, &xe, cfg.n_ff_exp);
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
            let mut s = 0.0f32;
            for (a, b) in sh.gate_inp.iter().zip(x.row(t)) {
                s += a * b;
            }
            let gate = sigmoid(s);
            for (a, &b) in out.row_mut(t).iter_mut().zip(down.row(t)) {
                *a += gate * b;
            }
        }
    }
    out
}

fn swiglu(g: &Act, u: &Act) -> Act {
    let mut out = g.clone();
    for (a, &b) in out.data.iter_mut().zip(&u.data) {
        *a = silu(*a) * b;
    }
    out
}

/// down_e(silu(gate_e x) ⊙ up_e x) for the rows of `xe`.
fn expert_ffn(b: &CpuBackend, w: &MoeWeights, ex: usize, xe: &Act, n_ff: usize) -> Act {
    let xq = b.prepare(w.gate_exps.ty, xe);
    let g = b.mm(w.gate_exps.ty, w.gate_exps.matrix_bytes(ex), n_ff, xe, &xq);
    let uq;
    let xq_up = if w.up_exps.ty == w.gate_exps.ty {
        &xq
    } else {
        uq = b.prepare(w.up_exps.ty, xe);
        &uq
    };
    let u = b.mm(w.up_exps.ty, w.up_exps.matrix_bytes(ex), n_ff, xe, xq_up);
    let act = swiglu(&g, &u);
    let aq = b.prepare(w.down_exps.ty, &act);
    b.mm(
        w.down_exps.ty,
        w.down_exps.matrix_bytes(ex),
        xe.cols,
        &act,
        &aq,
    )
}
