//! Token selection: greedy, or temperature sampling filtered by top-k, top-p and
//! min-p, after penalties and logit bias.
//!
//! Order of operations (fixed, so a seed reproduces a request): logit bias →
//! repetition penalty → presence/frequency penalties → (greedy: argmax, lowest
//! id on ties) → temperature → top-k → softmax → top-p → min-p → renormalise →
//! draw with the seeded generator.

use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Sampling settings for one request. `temperature <= 0` is greedy (argmax,
/// lowest id wins a tie) and ignores the rest except penalties and logit bias.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off.
    pub min_p: f32,
    /// OpenAI-style penalties over the generated tokens (0.0 = off).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// llama.cpp-style repetition penalty over the last `repeat_last_n` tokens (1.0 = off).
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    /// Added to the logit of each token before sampling (f32::NEG_INFINITY bans it).
    pub logit_bias: Vec<(u32, f32)>,
    /// None: a seed is drawn from the clock and reported back.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: rand::rngs::StdRng,
    /// Counts of generated tokens, for presence/frequency penalties.
    counts: HashMap<u32, u32>,
    /// Recent tokens (prompt tail and generated) for the repetition penalty.
    recent: Vec<u32>,
}

impl Sampler {
    pub fn new(params: &SamplingParams, seed: u64, prompt: &[u32]) -> Sampler {
        let keep = params.repeat_last_n;
        let recent = prompt[prompt.len().saturating_sub(keep)..].to_vec();
        Sampler {
            params: params.clone(),
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            counts: HashMap::new(),
            recent,
        }
    }

    /// True when `sample` is argmax of the raw logits (no bias, no penalties,
    /// temperature 0), so an executor may choose the token itself.
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature <= 0.0
            && p.logit_bias.is_empty()
            && (p.repeat_penalty == 1.0 || p.repeat_last_n == 0)
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
    }

    /// Records a token that was emitted (sampled or forced).
    pub fn accept(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
        self.recent.push(token);
        let keep = self.params.repeat_last_n;
        if self.recent.len() > keep {
            let drop = self.recent.len() - keep;
            self.recent.drain(..drop);
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let repeat = p.repeat_penalty != 1.0 && p.repeat_last_n > 0;
        let presence = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        // A copy only when something edits the logits.
        let mut edited = Vec::new();
        let l: &[f32] = if p.logit_bias.is_empty() && !repeat && !presence {
            logits
        } else {
            edited.extend_from_slice(logits);
            for &(id, bias) in &p.logit_bias {
                if let Some(v) = edited.get_mut(id as usize) {
                    *v += bias;
                }
            }
            if repeat {
                let mut seen: Vec<u32> = self.recent.clone();
                seen.sort_unstable();
                seen.dedup();
                for id in seen {
                    if let Some(v) = edited.get_mut(id as usize) {
                        *v = if *v > 0.0 {
                            *v / p.repeat_penalty
                        } else {
                            *v * p.repeat_penalty
                        };
                    }
                }
            }
            if presence {
                for (&id, &c) in &self.counts {
                    if let Some(v) = edited.get_mut(id as usize) {
                        *v -= p.presence_penalty + p.frequency_penalty * c as f32;
                    }
                }
            }
            &edited
        };
        if p.temperature <= 0.0 {
            return argmax(l);
        }
        let Some(mut d) = Ranked::new(l, p.temperature, p.top_k) else {
            return argmax(l);
        };
        let n = d.len();
        let mut keep = n;
        if p.top_p < 1.0 {
            // The smallest prefix whose mass reaches top_p (else everything).
            let mut acc = 0.0f32;
            let mut i = 0;
            while i < n && !d.tail_cannot_change(i, acc) {
                acc += d.prob(i);
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
                i += 1;
            }
        }
        if p.min_p > 0.0 {
            let floor = d.prob(0) * p.min_p;
            let mut k = 0;
            // Past the ranked prefix every probability is below TAIL_MAX.
            while k < keep && !(k == d.ranked && floor > TAIL_MAX) && d.prob(k) >= floor {
                k += 1;
            }
            keep = k.max(1);
        }
        let mut total = 0.0f32;
        let mut i = 0;
        while i < keep && !d.tail_cannot_change(i, total) {
            total += d.prob(i);
            i += 1;
        }
        let mut r: f32 = self.rng.random::<f32>() * total;
        for i in 0..keep {
            let pr = d.prob(i);
            if r < pr {
                return d.id(i);
            }
            r -= pr;
        }
        d.id(keep - 1)
    }
}

/// Candidates whose logit, after temperature, is more than this below the best one's
/// have e^(l − max) < 1.6e-8: added to a running sum of at least 0.5 (the softmax
/// sum starts at e^0 = 1; the mass of the ranked prefix is ≈ 1), such a term rounds
/// away (it is below half an ulp, 2^-25), wherever it comes in the sum.
const TAIL_CUTOFF: f32 = -18.0;
/// A bound on every tail probability: e^-18 / sum, sum ≥ 1.
const TAIL_MAX: f32 = 2.9e-8;

/// top-k of at most this many candidates keeps them in a heap during one pass over
/// the logits; a larger k selects over all candidates.
const HEAP_TOP_K: usize = 1024;

/// The softmax over the candidates, ranked only as far as it matters.
///
/// The sampler's arithmetic is fixed (module docs): candidates (finite logits divided
/// by the temperature) in descending order, lower id first on ties; after top-k,
/// `sum = Σ e^(l_i − max)` in that order, each probability `e^(l_i − max) / sum`, and
/// the top-p, min-p and draw walks in that order. Sorting a 150k–250k vocabulary and
/// taking every exponential each token cost more than the model step, and nearly all
/// of it is tail whose terms round away. So top-k is a selection, only candidates
/// within [`TAIL_CUTOFF`] of the best are listed and ranked up front (a radix sort
/// when there are many, as in a flat distribution), and the rest are listed and
/// ranked only if a walk reaches them with a sum their terms could still change. The
/// choices are the full sort's, bit for bit (`tests::matches_the_full_sort_sampler`).
struct Ranked<'a> {
    logits: &'a [f32],
    temperature: f32,
    /// `cand[..ranked]`: the best candidates in final order; the rest rank below them.
    cand: Vec<(u32, f32)>,
    /// Tail candidates not in `cand` yet (still only in `logits`).
    unlisted: usize,
    /// `probs[i]` for i < ranked.
    probs: Vec<f32>,
    ranked: usize,
    max: f32,
    sum: f32,
}

impl<'a> Ranked<'a> {
    /// The candidates of `logits` at `temperature`, the best `top_k` of them (0 = all);
    /// `None` when no logit is finite.
    fn new(logits: &'a [f32], temperature: f32, top_k: usize) -> Option<Ranked<'a>> {
        let cand_of = |i: usize, v: f32| (i as u32, v / temperature);
        let (n_finite, raw_max) = logits
            .iter()
            .filter(|v| v.is_finite())
            .fold((0usize, f32::NEG_INFINITY), |(n, m), &v| (n + 1, m.max(v)));
        if n_finite == 0 {
            return None;
        }
        // Dividing by a positive temperature keeps the order, so this is the
        // largest candidate exactly.
        let max = raw_max / temperature;
        let mut d = Ranked {
            logits,
            temperature,
            cand: Vec::new(),
            unlisted: 0,
            probs: Vec::new(),
            ranked: 0,
            max,
            sum: 0.0,
        };
        let finite = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| cand_of(i, v));
        if !max.is_finite() {
            // ±inf after the division: no tail bound holds; rank everything.
            d.cand = finite.collect();
            if top_k > 0 && top_k < n_finite {
                d.cand.select_nth_unstable_by(top_k - 1, order);
                d.cand.truncate(top_k);
                d.cand.sort_unstable_by_key(|c| c.0);
            }
            sort_ranked(&mut d.cand);
            d.ranked = d.cand.len();
        } else if top_k > 0 && top_k < n_finite {
            let mut kept = top_k_of(finite, top_k);
            // Stable split: ids stay ascending for the radix sort's tie order.
            let mut tail = Vec::new();
            kept.retain(|c| {
                let head = in_head(c.1, max);
                if !head {
                    tail.push(*c);
                }
                head
            });
            sort_ranked(&mut kept);
            d.ranked = kept.len();
            kept.extend(tail);
            d.cand = kept;
        } else {
            d.cand = Vec::with_capacity(n_finite);
            d.cand.extend(finite.filter(|c| in_head(c.1, max)));
            sort_ranked(&mut d.cand);
            d.ranked = d.cand.len();
            d.unlisted = n_finite - d.ranked;
        }
        d.probs = d.cand[..d.ranked]
            .iter()
            .map(|c| (c.1 - max).exp())
            .collect();
        // The tail adds nothing to this sum (see TAIL_CUTOFF), so it ends here.
        d.sum = d.probs.iter().sum();
        let sum = d.sum;
        d.probs.iter_mut().for_each(|x| *x /= sum);
        Some(d)
    }

    fn len(&self) -> usize {
        self.cand.len() + self.unlisted
    }

    /// Lists and ranks the tail (once, if a walk gets there).
    fn rank_all(&mut self) {
        if self.unlisted > 0 {
            let t = self.temperature;
            let tail: Vec<(u32, f32)> = self
                .logits
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| (i as u32, v / t))
                .filter(|c| !in_head(c.1, self.max))
                .collect();
            debug_assert_eq!(tail.len(), self.unlisted);
            self.cand.extend(tail);
            self.unlisted = 0;
        }
        if self.ranked == self.cand.len() {
            return;
        }
        self.cand[self.ranked..].sort_unstable_by(order);
        let (max, sum) = (self.max, self.sum);
        self.probs.extend(
            self.cand[self.ranked..]
                .iter()
                .map(|c| (c.1 - max).exp() / sum),
        );
        self.ranked = self.cand.len();
    }

    fn prob(&mut self, i: usize) -> f32 {
        if i >= self.ranked {
            self.rank_all();
        }
        self.probs[i]
    }

    fn id(&mut self, i: usize) -> u32 {
        if i >= self.ranked {
            self.rank_all();
        }
        self.cand[i].0
    }

    /// True when a running sum `acc` of the probabilities in rank order has reached
    /// the unranked tail (i == ranked) and no tail term can change it: each is below
    /// TAIL_MAX < 2^-25, at most half an ulp of any acc ≥ 0.5.
    fn tail_cannot_change(&self, i: usize, acc: f32) -> bool {
        i == self.ranked && i < self.len() && acc.is_finite() && acc >= 0.5
    }
}

/// Whether a candidate (logit after temperature) is within the cutoff of the best.
fn in_head(v: f32, max: f32) -> bool {
    v - max >= TAIL_CUTOFF
}

/// Descending by logit; ties keep the lower id first (a total order: ids differ).
fn order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.partial_cmp(&a.1)
        .unwrap_or(std::cmp::Ordering::Equal)
        .then(a.0.cmp(&b.0))
}

/// The `k` largest logits as (id, logit), largest first; ties: the lower id first.
pub fn top_logits(l: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let mut top = top_k_of(
        l.iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, v))
            .filter(|c| !c.1.is_nan()),
        k,
    );
    top.sort_unstable_by(order);
    top
}

/// A candidate in the top-k heap: the heap's greatest is the one that ranks last.
struct Worst((u32, f32));

impl PartialEq for Worst {
    fn eq(&self, o: &Self) -> bool {
        order(&self.0, &o.0).is_eq()
    }
}
impl Eq for Worst {}
impl PartialOrd for Worst {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Worst {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        order(&self.0, &o.0)
    }
}

/// The best `k` candidates (by [`order`], a total order, so the set is unique), in
/// ascending id order.
fn top_k_of(cand: impl Iterator<Item = (u32, f32)>, k: usize) -> Vec<(u32, f32)> {
    let mut kept: Vec<(u32, f32)> = if k <= HEAP_TOP_K {
        // One pass; nearly every candidate is turned away by one comparison.
        let mut heap = std::collections::BinaryHeap::with_capacity(k + 1);
        for c in cand {
            if heap.len() < k {
                heap.push(Worst(c));
            } else if let Some(mut worst) = heap.peek_mut() {
                if order(&c, &worst.0).is_lt() {
                    *worst = Worst(c);
                }
            }
        }
        heap.into_iter().map(|w| w.0).collect()
    } else {
        let mut all: Vec<(u32, f32)> = cand.collect();
        if k < all.len() {
            all.select_nth_unstable_by(k - 1, order);
            all.truncate(k);
        }
        all
    };
    kept.sort_unstable_by_key(|c| c.0);
    kept
}

/// Sorts candidates by [`order`]; `c` must have ascending ids (the radix sort is
/// stable and keys on the value only, so ties keep that id order).
fn sort_ranked(c: &mut [(u32, f32)]) {
    if c.len() < 1024 {
        c.sort_unstable_by(order);
        return;
    }
    // Key: ascending u32 for descending value. -0.0 and +0.0 compare equal in
    // `order`, so they get one key (`+ 0.0` turns -0.0 into +0.0); the value comes
    // back from the key, so a -0.0 returns as +0.0, which no later step tells apart
    // (it only enters `v - max`, then e^x).
    let key = |v: f32| {
        let b = (v + 0.0).to_bits();
        let asc = if b & 0x8000_0000 != 0 {
            !b
        } else {
            b | 0x8000_0000
        };
        !asc
    };
    let value = |k: u32| {
        let asc = !k;
        f32::from_bits(if asc & 0x8000_0000 != 0 {
            asc & 0x7FFF_FFFF
        } else {
            !asc
        })
    };
    let mut a: Vec<(u32, u32)> = c.iter().map(|&(id, v)| (key(v), id)).collect();
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
        *dst = (id, value(k));
    }
}

/// Index of the largest value; the lowest index wins a tie; NaN never wins (all NaN
/// or -inf: index 0).
///
/// Greedy decoding calls it on every step's logits (248k of them for Qwen3.5), on
/// one thread between passes, so it takes two scans that vectorise instead of one
/// whose every step depends on the last: each 4096-value chunk's maximum over 16
/// independent lanes, then the first index holding the largest of them, searched
/// only in the first chunk that has it.
pub fn argmax(l: &[f32]) -> u32 {
    const CHUNK: usize = 4096;
    const LANES: usize = 16;
    fn chunk_max(c: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; LANES];
        let mut it = c.chunks_exact(LANES);
        for g in &mut it {
            for (a, &v) in acc.iter_mut().zip(g) {
                // `v > a` is false for NaN: NaN never enters.
                *a = if v > *a { v } else { *a };
            }
        }
        for (a, &v) in acc.iter_mut().zip(it.remainder()) {
            *a = if v > *a { v } else { *a };
        }
        acc.into_iter()
            .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
    }
    let mut best = (f32::NEG_INFINITY, 0usize);
    for (ci, c) in l.chunks(CHUNK).enumerate() {
        let m = chunk_max(c);
        if m > best.0 {
            best = (m, ci);
        }
    }
    let (m, ci) = best;
    if m == f32::NEG_INFINITY {
        return 0;
    }
    let at = l[ci * CHUNK..]
        .iter()
        .position(|&v| v == m)
        .expect("the chunk holds its maximum");
    (ci * CHUNK + at) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sampler's temperature path as it was before the ranked softmax: every
    /// candidate sorted, every probability computed. The new one must choose the same.
    fn full_sort_sample(p: &SamplingParams, rng: &mut rand::rngs::StdRng, l: &[f32]) -> u32 {
        let mut cand: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v / p.temperature))
            .collect();
        if cand.is_empty() {
            return argmax(l);
        }
        cand.sort_by(|a, b| {
            b.1.partial_cmp(&a.1)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.0.cmp(&b.0))
        });
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, &pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            let keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
            probs.truncate(keep);
            cand.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut r: f32 = rng.random::<f32>() * total;
        for (i, &pr) in probs.iter().enumerate() {
            if r < pr {
                return cand[i].0;
            }
            r -= pr;
        }
        cand[cand.len() - 1].0
    }

    /// Random logits of many shapes: flat and peaked, ties, ±0, -inf, huge values.
    fn logits_case(rng: &mut rand::rngs::StdRng, case: usize) -> Vec<f32> {
        let n = [1usize, 2, 7, 300, 3000, 20_000][case % 6];
        let scale = [0.3f32, 1.0, 4.0, 20.0, 80.0][(case / 6) % 5];
        let mut l: Vec<f32> = (0..n)
            .map(|_| {
                let u: f32 = rng.random_range(-1.0..1.0);
                // Sums of uniforms: roughly normal, with a long-ish upper tail.
                (u + rng.random_range(-1.0f32..1.0) + rng.random_range(-1.0f32..1.0)) * scale
            })
            .collect();
        match (case / 30) % 4 {
            // Many exact ties.
            1 => l.iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0),
            // Banned tokens and signed zeros.
            2 => {
                for (i, v) in l.iter_mut().enumerate() {
                    if i % 5 == 0 {
                        *v = f32::NEG_INFINITY;
                    } else if i % 7 == 0 {
                        *v = if i % 2 == 0 { 0.0 } else { -0.0 };
                    }
                }
            }
            // One dominant token.
            3 => {
                let i = rng.random_range(0..n);
                l[i] += 30.0 * scale.max(1.0);
            }
            _ => {}
        }
        l
    }

    #[test]
    fn matches_the_full_sort_sampler() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let mut draws = 0;
        for case in 0..120 {
            let l = logits_case(&mut rng, case);
            for temperature in [0.05f32, 0.6, 1.0, 3.0] {
                for top_k in [0usize, 20, 1000, 2000] {
                    for (top_p, min_p) in [
                        (1.0f32, 0.0f32),
                        (0.9, 0.0),
                        (0.999_999, 0.0),
                        (1.0, 0.05),
                        (0.95, 1e-12),
                        (1.0, 1e-9),
                    ] {
                        let p = SamplingParams {
                            temperature,
                            top_k,
                            top_p,
                            min_p,
                            ..Default::default()
                        };
                        let seed = rng.random::<u64>();
                        let mut s = Sampler::new(&p, seed, &[]);
                        let mut old_rng = rand::rngs::StdRng::seed_from_u64(seed);
                        for _ in 0..2 {
                            let want = full_sort_sample(&p, &mut old_rng, &l);
                            assert_eq!(s.sample(&l), want, "case {case}, {p:?}");
                            draws += 1;
                        }
                    }
                }
            }
        }
        assert!(draws > 15_000);
    }

    #[test]
    fn radix_ranking_equals_the_comparison_sort() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        for case in 0..60 {
            let l = logits_case(&mut rng, case);
            let mut c: Vec<(u32, f32)> = l
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| (i as u32, v))
                .collect();
            let mut want = c.clone();
            want.sort_by(order);
            sort_ranked(&mut c);
            // The radix sort returns -0.0 as +0.0 (see sort_ranked).
            let bits = |v: &[(u32, f32)]| {
                v.iter()
                    .map(|&(i, x)| (i, (x + 0.0).to_bits()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&c), bits(&want), "case {case}");
        }
    }

    /// The argmax as it was: one scan, each step depending on the last.
    fn scan_argmax(l: &[f32]) -> u32 {
        let mut best = 0usize;
        let mut best_v = f32::NEG_INFINITY;
        for (i, &v) in l.iter().enumerate() {
            if v > best_v {
                best = i;
                best_v = v;
            }
        }
        best as u32
    }

    #[test]
    fn chunked_argmax_picks_what_one_scan_picks() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NAN; 5000],
            vec![f32::NEG_INFINITY; 9000],
            vec![-0.0, 0.0, -0.0],
            vec![0.0, -0.0],
        ];
        for n in [1, 15, 16, 17, 4095, 4096, 4097, 12_289, 248_320] {
            // Few distinct values, so the maximum recurs across chunks and lanes;
            // NaN and infinities sprinkled in.
            let v: Vec<f32> = (0..n)
                .map(|_| match rng.random_range(0..40u32) {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    _ => rng.random_range(-8..8i32) as f32,
                })
                .collect();
            cases.push(v);
            cases.push((0..n).map(|_| rng.random::<f32>() * 30.0 - 15.0).collect());
        }
        let mut top = vec![f32::NAN; 10_000];
        top[9_999] = f32::INFINITY;
        cases.push(top);
        for (i, l) in cases.iter().enumerate() {
            assert_eq!(argmax(l), scan_argmax(l), "case {i} ({} values)", l.len());
        }
    }

    #[test]
    fn log_sum_exp_matches_f64_and_top_logits_rank_with_lower_ids_first() {
        use model::math::log_sum_exp;
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for n in [1usize, 15, 16, 17, 1000, 248_320] {
            let l: Vec<f32> = (0..n).map(|_| rng.random_range(-30.0f32..30.0)).collect();
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let want = max + l.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            let got = log_sum_exp(&l) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{n}: {got} vs {want}"
            );
        }
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
        assert!(log_sum_exp(&[1.0, f32::NAN]).is_nan());
        assert_eq!(log_sum_exp(&[0.0]), 0.0);
        let l = [1.0, 3.0, 3.0, f32::NAN, -2.0, 3.0];
        assert_eq!(
            top_logits(&l, 4),
            vec![(1, 3.0), (2, 3.0), (5, 3.0), (0, 1.0)]
        );
        assert!(top_logits(&l, 0).is_empty());
        assert_eq!(top_logits(&l, 9).len(), 5);
    }

    #[test]
    fn greedy_takes_lowest_id_on_ties() {
        let p = SamplingParams::default();
        let mut s = Sampler::new(&p, 1, &[]);
        assert_eq!(s.sample(&[0.0, 2.0, 2.0, 1.0]), 1);
    }

    #[test]
    fn logit_bias_and_penalties_change_greedy() {
        let p = SamplingParams {
            logit_bias: vec![(0, 10.0)],
            ..Default::default()
        };
        let mut s = Sampler::new(&p, 1, &[]);
        assert_eq!(s.sample(&[0.0, 2.0]), 0);
        let p = SamplingParams {
            presence_penalty: 5.0,
            ..Default::default()
        };
        let mut s = Sampler::new(&p, 1, &[]);
        s.accept(1);
        assert_eq!(s.sample(&[0.0, 2.0]), 0);
    }

    #[test]
    fn seeded_sampling_reproduces_and_respects_top_k() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        };
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = Sampler::new(&p, seed, &[]);
            (0..40).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        // top-k 2: only the two best ids (6 and 13, value 1.8, ties by id) ever appear.
        assert!(draw(9).iter().all(|&t| t == 6 || t == 13));
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            ..Default::default()
        };
        let mut s = Sampler::new(&p, 3, &[]);
        for _ in 0..50 {
            assert_eq!(s.sample(&[10.0, 0.0, 0.0]), 0);
        }
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        };
        let mut s = Sampler::new(&p, 3, &[]);
        for _ in 0..50 {
            assert_eq!(s.sample(&[3.0, 0.0, 0.0]), 0);
        }
    }
}
