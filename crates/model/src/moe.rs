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
        let mut idx: Vec<usize> = (0..p.len()).collect();
        // A stable sort by descending probability keeps the lower index first on ties.
        idx.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap_or(std::cmp::Ordering::Equal));
        idx.truncate(k);
        let mut sum = 0.0f32;
        for &i in &idx {
            sum += p[i];
        }
        let inv = 1.0 / sum.max(6.103_515_6e-5);
        idx.into_iter().map(|i| (i, p[i] * inv)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
