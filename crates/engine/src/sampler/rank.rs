//! How the sampler finds its candidates without sorting the vocabulary: the
//! log-scale weight buckets and top-p's nucleus from them, top-k from groups'
//! maxima, the exact rank (weight descending, lower id first) of the few that need
//! it, and the top logits for log-probabilities. [`super::sample_with`] and the
//! GPU's `kernels/sample.cu` follow the same plan.

use super::{top_p_need, PAR_CHUNK};

/// Buckets of [`weight_bucket`]: a weight's bit length and the 3 bits below its
/// leading one (weights below 16 one bucket each); every u32 falls in one of 240.
const NUCLEUS_BUCKETS: usize = 240;

/// The log-scale bucket of weight `x`: increasing in `x`; [`bucket_floor`] is the
/// least weight in it.
fn weight_bucket(x: u32) -> usize {
    if x < 16 {
        return x as usize;
    }
    let shift = 28 - x.leading_zeros(); // bit length − 4, at least 1
    16 + (shift as usize - 1) * 8 + ((x >> shift) & 7) as usize
}

/// The least weight in bucket `b` of [`weight_bucket`] (2³² for `NUCLEUS_BUCKETS`:
/// past every weight).
fn bucket_floor(b: usize) -> u64 {
    if b < 16 {
        return b as u64;
    }
    let (shift, top) = ((b - 16) / 8 + 1, (b - 16) % 8 + 8);
    (top as u64) << shift
}

/// The candidates of a draw without top-k: every weight at least `floor`, and of the
/// weights equal to `floor` those with ids up to `last_id` (the rank puts the lower id
/// first); `sum` is their weights' sum.
pub(super) struct Nucleus {
    floor: u32,
    last_id: u32,
    pub(super) sum: u64,
}

impl Nucleus {
    /// Every weight (those of 0 add nothing); `sum` is theirs.
    pub(super) fn everything(sum: u64) -> Nucleus {
        Nucleus {
            floor: 0,
            last_id: u32::MAX,
            sum,
        }
    }

    /// Weight `x` of id `id` if it is a candidate, else 0; branch-free.
    #[inline(always)]
    pub(super) fn weight(&self, id: usize, x: u32) -> u32 {
        let kept = x > self.floor || (x == self.floor && id as u32 <= self.last_id);
        x * kept as u32
    }
}

/// Weights' sums per [`weight_bucket`].
pub(super) type Masses = [u64; NUCLEUS_BUCKETS];

/// The weights' sums per [`weight_bucket`] of one chunk of the vocabulary.
pub(super) fn bucket_masses(c: &[u32]) -> Masses {
    // Four histograms, so that neighbours in the same bucket (most of them) do not
    // wait on each other's additions.
    let mut m = [[0u64; NUCLEUS_BUCKETS]; 4];
    let quads = c.chunks_exact(4);
    for &x in quads.remainder() {
        m[0][weight_bucket(x)] += x as u64;
    }
    for q in quads {
        for (m, &x) in m.iter_mut().zip(q) {
            m[weight_bucket(x)] += x as u64;
        }
    }
    let [mut a, b, c, d] = m;
    for i in 0..NUCLEUS_BUCKETS {
        a[i] += b[i] + c[i] + d[i];
    }
    a
}

/// top-p's nucleus over every weight (module docs, step 5) without ranking them,
/// from the buckets' masses of each [`PAR_CHUNK`] of `w` (`chunk_masses`; `total` is
/// the weights' sum): the rank's running sum reaches `need` in the log-scale bucket
/// where the buckets' masses, summed from the top, do; only that bucket's weights are
/// gathered (on the pool's threads, in id order) and ranked to find the weight (and
/// id) at which it does. Every heavier weight ranks before it, every lighter one
/// after. Also returns each chunk's sum of the nucleus, from its buckets above that
/// one and its gathered members that are in: no pass over the weights.
pub(super) fn nucleus(
    w: &[u32],
    chunk_masses: &[&Masses],
    total: u64,
    top_p: f32,
) -> (Nucleus, Vec<u64>) {
    use rayon::prelude::*;
    let mut mass = [0u64; NUCLEUS_BUCKETS];
    for m in chunk_masses {
        mass.iter_mut().zip(m.iter()).for_each(|(a, b)| *a += b);
    }
    let need = top_p_need(top_p, total);
    let mut above = 0u64;
    // Bucket 0 holds the zero weights only and adds nothing; the sum reaches need.
    let b = (1..NUCLEUS_BUCKETS)
        .rev()
        .find(|&b| {
            let reach = above + mass[b] >= need;
            if !reach {
                above += mass[b];
            }
            reach
        })
        .unwrap_or(1);
    // x in [lo, hi) as one comparison (hi − lo fits in u32: lo ≥ 1, hi ≤ 2³²).
    let lo = bucket_floor(b) as u32;
    let width = (bucket_floor(b + 1) - bucket_floor(b)) as u32;
    let mut members: Vec<(u32, u32)> = w
        .par_chunks(PAR_CHUNK)
        .enumerate()
        .map(|(ci, c)| {
            let base = ci * PAR_CHUNK;
            let mut v = Vec::new();
            for (i, &x) in c.iter().enumerate() {
                if x.wrapping_sub(lo) < width {
                    v.push(((base + i) as u32, x));
                }
            }
            v
        })
        .collect::<Vec<_>>()
        .concat();
    rank_by_weight(&mut members);
    let Some((i, sum)) = reach(&members, above, need) else {
        // Unreachable: the bucket's weights bring the sum to need.
        let sums = w
            .chunks(PAR_CHUNK)
            .map(|c| c.iter().map(|&x| x as u64).sum());
        return (Nucleus::everything(total), sums.collect());
    };
    let nucleus = Nucleus {
        floor: members[i].1,
        last_id: members[i].0,
        sum,
    };
    let mut sums: Vec<u64> = chunk_masses
        .iter()
        .map(|m| m[b + 1..].iter().sum())
        .collect();
    for &(id, x) in &members {
        sums[id as usize / PAR_CHUNK] += nucleus.weight(id as usize, x) as u64;
    }
    (nucleus, sums)
}

/// Where the running sum of `ranked`'s weights (in rank order), from `above`, first
/// reaches `need`: the index and the sum there.
pub(super) fn reach(ranked: &[(u32, u32)], above: u64, need: u64) -> Option<(usize, u64)> {
    let mut acc = above;
    ranked
        .iter()
        .position(|c| {
            acc += c.1 as u64;
            acc >= need
        })
        .map(|i| (i, acc))
}

/// Weights per group whose maximum bounds top-k's cut from below.
const TOP_K_GROUP: usize = 64;

/// The `k` best of the non-zero weights `w` by the rank (weight descending, lower id
/// first), as (id, weight) in id order; all of them when there are at most `k`
/// (also the top logits', by their [`logit_key`]s). The k-th largest of the groups' maxima is a
/// weight tau that at least k weights reach, so every member is among the weights ≥
/// tau: those (few, unless many weights are equal) are gathered from the groups whose
/// maximum reaches tau and selected exactly.
pub(super) fn top_k_by_weight(w: &[u32], k: usize) -> Vec<(u32, u32)> {
    use std::cmp::Reverse;
    let maxima: Vec<u32> = w
        .chunks(TOP_K_GROUP)
        .map(|g| g.iter().copied().max().unwrap_or(0))
        .collect();
    let tau = if k <= maxima.len() {
        let mut m = maxima.clone();
        *m.select_nth_unstable_by_key(k - 1, |&x| Reverse(x)).1
    } else {
        0
    }
    .max(1);
    // Only groups whose maximum reaches tau hold candidates.
    let mut kept: Vec<(u32, u32)> = Vec::new();
    for (gi, g) in w.chunks(TOP_K_GROUP).enumerate() {
        if maxima[gi] >= tau {
            let base = gi * TOP_K_GROUP;
            kept.extend(
                g.iter()
                    .enumerate()
                    .filter(|c| *c.1 >= tau)
                    .map(|(i, &x)| ((base + i) as u32, x)),
            );
        }
    }
    if k < kept.len() {
        // A larger weight ranks first, then the lower id.
        kept.select_nth_unstable_by_key(k - 1, |c| (Reverse(c.1), c.0));
        kept.truncate(k);
    }
    kept.sort_unstable_by_key(|c| c.0);
    kept
}

/// Descending by logit; ties keep the lower id first (a total order: ids differ).
fn order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.partial_cmp(&a.1)
        .unwrap_or(std::cmp::Ordering::Equal)
        .then(a.0.cmp(&b.0))
}

/// The `k` largest logits as (id, logit), largest first; ties (−0 and +0 among them):
/// the lower id first; NaN never.
pub fn top_logits(l: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let keys: Vec<u32> = l.iter().map(|&v| logit_key(v)).collect();
    let mut top: Vec<(u32, f32)> = top_k_by_weight(&keys, k)
        .into_iter()
        .map(|(id, _)| (id, l[id as usize]))
        .collect();
    top.sort_unstable_by(order);
    top
}

/// A logit as a key that keeps its order ([`top_k_by_weight`] ranks keys as it
/// ranks weights): a larger logit has a larger key, −0 and +0 share one, and NaN's
/// is 0, which is never kept (−inf's is 0x7f_ffff).
fn logit_key(v: f32) -> u32 {
    if v.is_nan() {
        return 0;
    }
    // −0 + 0 = +0.
    let b = (v + 0.0).to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 1 << 31
    }
}

/// Sorts (id, weight) pairs by the rank: weight descending, the lower id first. `c`
/// must have ascending ids (the radix sort is stable and keys on the weight only, so
/// ties keep that id order).
pub(super) fn rank_by_weight(c: &mut [(u32, u32)]) {
    if c.len() < 1024 {
        c.sort_unstable_by_key(|&(id, x)| (std::cmp::Reverse(x), id));
        return;
    }
    // Key: ascending u32 for descending weight.
    let mut a: Vec<(u32, u32)> = c.iter().map(|&(id, x)| (!x, id)).collect();
    let mut b = vec![(0u32, 0u32); a.len()];
    // Three stable passes of 11 bits (LSD); counts for all of them in one read.
    const BITS: u32 = 11;
    const BUCKETS: usize = 1 << BITS;
    let digit = |k: u32, pass: u32| ((k >> (BITS * pass)) as usize) & (BUCKETS - 1);
    let mut hist = vec![[0usize; BUCKETS]; 3];
    for &(k, _) in &a {
        for (pass, h) in hist.iter_mut().enumerate() {
            h[digit(k, pass as u32)] += 1;
        }
    }
    for (pass, h) in hist.iter().enumerate() {
        if h.contains(&a.len()) {
            continue; // every key has the same digit here
        }
        let mut start = vec![0usize; BUCKETS];
        let mut acc = 0;
        for (s, &n) in start.iter_mut().zip(h.iter()) {
            *s = acc;
            acc += n;
        }
        for &e in &a {
            let d = digit(e.0, pass as u32);
            b[start[d]] = e;
            start[d] += 1;
        }
        std::mem::swap(&mut a, &mut b);
    }
    for (dst, &(k, id)) in c.iter_mut().zip(&a) {
        *dst = (id, !k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::math::sample_weight;
    use rand::{Rng, SeedableRng};

    #[test]
    fn weight_buckets_increase_and_start_at_their_floor() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut xs: Vec<u32> = (0..64).chain([u32::MAX, 1 << 31, (1 << 31) - 1]).collect();
        xs.extend((0..20_000).map(|_| rng.random::<u32>() >> rng.random_range(0..32)));
        xs.sort_unstable();
        let mut last = 0;
        for &x in &xs {
            let b = weight_bucket(x);
            assert!(
                b < NUCLEUS_BUCKETS && b >= last,
                "{x}: bucket {b} after {last}"
            );
            let floor = bucket_floor(b);
            assert!(floor <= x as u64, "{x}: floor {floor} of bucket {b}");
            assert_eq!(weight_bucket(floor as u32), b, "{x}");
            let next = bucket_floor(b + 1);
            assert!((x as u64) < next, "{x}: next floor {next}");
            last = b;
        }
    }

    /// top-p alone finds its nucleus from the buckets' masses and one bucket's rank:
    /// the same ids and sum as the rank of every weight, on peaked and flat
    /// distributions and with many equal weights.
    #[test]
    fn the_nucleus_from_buckets_is_the_ranked_one() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for case in 0..240 {
            // Every fifth case past one chunk of the pool's work (PAR_CHUNK).
            let n = 1 + rng.random_range(0..if case % 5 == 0 { 40_000 } else { 5000usize });
            let spread = [0.01f32, 1.0, 5.0, 30.0][case % 4];
            let w: Vec<u32> = (0..n)
                .map(|i| {
                    let e = -spread * rng.random::<f32>() - if i % 97 == 0 { 0.0 } else { 1.0 };
                    // Every third case in steps of 1/8: many equal weights.
                    let e = if case % 3 == 0 {
                        (e * 8.0).round() / 8.0
                    } else {
                        e
                    };
                    sample_weight(e, 0.0, 1.0)
                })
                .collect();
            if w.iter().all(|&x| x == 0) {
                continue;
            }
            for top_p in [0.0f32, 0.3, 0.8, 0.95, 0.999_999] {
                let total = w.iter().map(|&x| x as u64).sum();
                let masses: Vec<Masses> = w.chunks(PAR_CHUNK).map(bucket_masses).collect();
                let masses: Vec<&Masses> = masses.iter().collect();
                let (nuc, sums) = nucleus(&w, &masses, total, top_p);
                let got: Vec<u32> = (0..n)
                    .filter(|&i| nuc.weight(i, w[i]) > 0)
                    .map(|i| i as u32)
                    .collect();
                let mut rank: Vec<(u32, u32)> = w
                    .iter()
                    .enumerate()
                    .filter(|c| *c.1 > 0)
                    .map(|(i, &x)| (i as u32, x))
                    .collect();
                let need = top_p_need(top_p, rank.iter().map(|c| c.1 as u64).sum());
                rank_by_weight(&mut rank);
                let mut acc = 0u64;
                let end = rank.iter().position(|c| {
                    acc += c.1 as u64;
                    acc >= need
                });
                rank.truncate(end.expect("the weights reach need") + 1);
                let mut want: Vec<u32> = rank.iter().map(|c| c.0).collect();
                want.sort_unstable();
                assert_eq!(got, want, "case {case}, top_p {top_p}");
                assert_eq!(nuc.sum, acc, "case {case}, top_p {top_p}");
                let kept = |c: (usize, &[u32])| -> u64 {
                    let base = c.0 * PAR_CHUNK;
                    c.1.iter()
                        .enumerate()
                        .map(|(i, &x)| nuc.weight(base + i, x) as u64)
                        .sum()
                };
                let want_sums: Vec<u64> = w.chunks(PAR_CHUNK).enumerate().map(kept).collect();
                assert_eq!(sums, want_sums, "case {case}, top_p {top_p}: chunk sums");
            }
        }
    }

    #[test]
    fn radix_ranking_equals_the_comparison_sort() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        for n in [0usize, 1, 5, 1023, 1024, 5000, 70_000] {
            for spread in [3u32, 1 << 12, u32::MAX] {
                let mut c: Vec<(u32, u32)> = (0..n as u32)
                    .map(|i| (i * 3, rng.random_range(0..=spread)))
                    .collect();
                let mut want = c.clone();
                want.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                rank_by_weight(&mut c);
                assert_eq!(c, want, "n {n}, spread {spread}");
            }
        }
    }

    /// top_logits against a full sort by `order`, over logits with ties, ±0, ±inf
    /// and NaN, for k below, at and past the number of non-NaN logits.
    #[test]
    fn top_logits_are_the_first_of_the_sorted_logits() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for case in 0..300 {
            let n = 1 + rng.random_range(0..3000usize);
            let l: Vec<f32> = (0..n)
                .map(|_| match rng.random_range(0..20) {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => f32::INFINITY,
                    3 => 0.0,
                    4 => -0.0,
                    5 => -f32::MIN_POSITIVE,
                    6..=9 => (rng.random_range(-4i32..4) as f32) * 0.5,
                    _ => rng.random_range(-40.0f32..40.0),
                })
                .collect();
            let mut all: Vec<(u32, f32)> = l
                .iter()
                .enumerate()
                .filter(|c| !c.1.is_nan())
                .map(|(i, &v)| (i as u32, v))
                .collect();
            all.sort_by(order);
            for k in [1, 2, 20, n / 2 + 1, all.len(), n + 5] {
                let want: Vec<(u32, f32)> = all.iter().copied().take(k).collect();
                let got = top_logits(&l, k);
                let bits = |v: &[(u32, f32)]| -> Vec<(u32, u32)> {
                    v.iter().map(|c| (c.0, c.1.to_bits())).collect()
                };
                assert_eq!(bits(&got), bits(&want), "case {case}, k {k}");
            }
        }
    }
}
