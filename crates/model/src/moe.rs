//! Expert routing, exactly as the model defines it (docs/design.md invariant 4:
//! routing is never pruned, skipped or altered).

use crate::math::softmax;
use crate::simd::multiversion;

/// One token's routing: (expert, weight) in top-k rank order.
pub type Routes = Vec<(usize, f32)>;

multiversion! {
    /// softmax over all experts (f32), the k most probable (ties: lower index first),
    /// weights renormalised to sum to one. The denominator is clamped at 6.103515625e-5
    /// as llama.cpp does; for any sane router this never binds.
    pub fn route / route_at(logits: &[f32], k: usize) -> Routes {
        let mut p = logits.to_vec();
        softmax(&mut p);
        let idx = top_k(&p, k);
        let mut sum = 0.0f32;
        for &i in &idx {
            sum += p[i];
        }
        let inv = 1.0 / sum.max(6.103_515_6e-5);
        idx.into_iter().map(|i| (i, p[i] * inv)).collect()
    }
}

/// The indices of the `k` largest values, largest first, the lower index first
/// among equal values: the first `k` of a stable sort by descending value, found in
/// one pass (a decode step routes every MoE layer on one thread).
fn top_k(p: &[f32], k: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for (i, &v) in p.iter().enumerate() {
        if best.len() == k && best.last().is_none_or(|&j| v <= p[j]) {
            continue;
        }
        // After every kept value at least as large (they have lower indices).
        let at = best.iter().position(|&j| v > p[j]).unwrap_or(best.len());
        best.insert(at, i);
        best.truncate(k);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_the_head_of_a_stable_descending_sort() {
        let mut s = 12345u64;
        for case in 0..500 {
            let n = 1 + case % 40;
            // Few distinct values, so that ties are common.
            let p: Vec<f32> = (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 60) as f32) * 0.25
                })
                .collect();
            for k in 0..=n.min(10) {
                let mut want: Vec<usize> = (0..n).collect();
                want.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap());
                want.truncate(k);
                assert_eq!(top_k(&p, k), want, "{p:?}, k {k}");
            }
        }
    }
    #[test]
    fn top_k_renormalised_in_rank_order() {
        let r = route(&[0.0, 3.0, 1.0, 3.0, -1.0], 3);
        let ids: Vec<usize> = r.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        let s: f32 = r.iter().map(|x| x.1).sum();
        assert!((s - 1.0).abs() < 1e-6);
        assert_eq!(r[0].1, r[1].1);
    }
}
