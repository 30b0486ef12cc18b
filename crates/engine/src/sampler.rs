//! Token selection: greedy, or temperature sampling filtered by top-k, top-p and
//! min-p, after penalties and logit bias.
//!
//! Order of operations (fixed, so a seed reproduces a request): logit bias →
//! repetition penalty → presence/frequency penalties → (greedy: argmax, lowest
//! id on ties) → temperature → top-k → softmax → top-p → min-p → renormalise →
//! draw with the seeded generator.

use crate::SamplingParams;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

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
        let mut l = logits.to_vec();
        for &(id, bias) in &p.logit_bias {
            if let Some(v) = l.get_mut(id as usize) {
                *v += bias;
            }
        }
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            let mut seen: Vec<u32> = self.recent.clone();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(v) = l.get_mut(id as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repeat_penalty
                    } else {
                        *v * p.repeat_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&id, &c) in &self.counts {
                if let Some(v) = l.get_mut(id as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        if p.temperature <= 0.0 {
            return argmax(&l);
        }
        let mut cand: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v / p.temperature))
            .collect();
        if cand.is_empty() {
            return argmax(&l);
        }
        // Descending by logit; ties keep the lower id first.
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
        let mut r: f32 = self.rng.random::<f32>() * total;
        for (i, &pr) in probs.iter().enumerate() {
            if r < pr {
                return cand[i].0;
            }
            r -= pr;
        }
        cand[cand.len() - 1].0
    }
}

/// Index of the largest value; the lowest index wins a tie; NaN never wins.
pub fn argmax(l: &[f32]) -> u32 {
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

#[cfg(test)]
mod tests {
    use super::*;

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
