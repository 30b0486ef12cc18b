//! Token selection: greedy, or temperature sampling filtered by top-k, top-p and
//! min-p, after penalties and logit bias — one definition, computed the same way
//! by the CPU (here) and the GPU (`crates/cuda/kernels/sample.cu`), so a seed gives
//! the same tokens on every device, in every batch and under speculation.
//!
//! # The definition
//! A request's [`Sampler`] turns its settings and history into a [`Draw`] for the
//! token at sequence index `pos` (prompt tokens count; the first generated token's
//! `pos` is the prompt's length). [`sample_with`] then picks from the logits:
//! 1. **Edits** ([`Edit`], one per token id, in this order): the sum of the
//!    request's logit biases for the id (in request order) is added; the repetition
//!    penalty divides a positive logit and multiplies a non-positive one, for ids
//!    among the last `repeat_last_n` tokens; `presence + frequency × count` is
//!    subtracted for generated ids. `e` = the edited logits.
//! 2. **Greedy** (temperature ≤ 0), no finite logit, or a +inf one: [`argmax`] of `e`.
//! 3. **Weights.** `m` = the largest finite `e`; a finite logit's weight is
//!    `w = ⌊exp((e − m) / T) · 2³¹⌋` (an integer; `exp` is `model::math::exp`, the
//!    CPU's and GPU's same bits; 0 below `(e − m)/T < −22`), so the best token
//!    weighs exactly 2³¹ and every later sum is an exact integer: no summation
//!    order to agree on. **min-p** zeroes weights below `⌈min_p · 2³¹⌉`.
//! 4. **Rank**: the tokens of non-zero weight by weight descending, the lower id
//!    first on ties. **top-k** keeps the first k of the rank.
//! 5. **top-p**: `need = ⌈top_p · S⌉` (f64, clamped to 1..=S; S = the kept
//!    weights' sum); the nucleus is the shortest prefix of the rank whose weights
//!    reach `need`.
//! 6. **Draw**: `r = ⌊bits · S_n / 2⁶⁴⌋` with `bits` = [`draw_bits`]`(seed, pos)`
//!    (a counter-based hash: no generator state, so a verify row, a batched row
//!    and a plain step at the same position draw the same number) and `S_n` the
//!    nucleus's weight; the token is the first id, in id order, at which the
//!    running sum of nucleus weights passes `r`.
//!
//! After step 3 everything is integer arithmetic on the weights, so a device can
//! compute it with any grouping of threads and still agree bit for bit.

mod rank;

pub use rank::top_logits;
use rank::{bucket_masses, nucleus, rank_by_weight, reach, top_k_by_weight, Masses, Nucleus};
use std::collections::{BTreeMap, HashMap};

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

pub use model::math::{sample_weight, SAMPLE_WEIGHT_ONE as WEIGHT_ONE};

/// The change one token's logit gets before sampling (module docs, step 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Edit {
    pub id: u32,
    /// Added first (the sum of the request's biases for the id; 0.0 = none).
    pub add: f32,
    /// Then a positive logit is divided by it, another multiplied (1.0 = none).
    pub repeat: f32,
    /// Then subtracted (presence and frequency penalties; 0.0 = none).
    pub sub: f32,
}

impl Edit {
    #[inline]
    pub fn apply(&self, v: f32) -> f32 {
        let mut v = v + self.add;
        if self.repeat != 1.0 {
            v = if v > 0.0 {
                v / self.repeat
            } else {
                v * self.repeat
            };
        }
        v - self.sub
    }
}

/// Everything [`sample_with`] needs for one position (module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Draw {
    pub temperature: f32,
    /// 0 = off.
    pub top_k: u32,
    /// 1.0 or more = off.
    pub top_p: f32,
    /// Weights below this are dropped (min-p; 0 = off).
    pub min_w: u32,
    /// [`draw_bits`] of the request's seed and the position.
    pub bits: u64,
    /// At most one per id, ascending ids.
    pub edits: Vec<Edit>,
}

impl Draw {
    /// The logits after the edits (a copy only when there are edits).
    fn edited<'a>(&self, logits: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        if self.edits.is_empty() {
            return std::borrow::Cow::Borrowed(logits);
        }
        let mut l = logits.to_vec();
        for e in &self.edits {
            if let Some(v) = l.get_mut(e.id as usize) {
                *v = e.apply(*v);
            }
        }
        std::borrow::Cow::Owned(l)
    }
}

/// SplitMix64's finaliser.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random number a request with `seed` draws for the token at sequence index
/// `pos`: a hash of both, so it depends on nothing else.
pub fn draw_bits(seed: u64, pos: u64) -> u64 {
    mix64(mix64(seed) ^ pos)
}

#[derive(Clone)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    /// Sequence index of the next token to be chosen.
    pos: u64,
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
            seed,
            pos: prompt.len() as u64,
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
        self.pos += 1;
        let keep = self.params.repeat_last_n;
        if self.recent.len() > keep {
            let drop = self.recent.len() - keep;
            self.recent.drain(..drop);
        }
    }

    /// The draw for the next token (module docs), for [`sample_with`] here or the
    /// same computation on a device.
    pub fn draw(&self) -> Draw {
        let p = &self.params;
        let mut edits: BTreeMap<u32, Edit> = BTreeMap::new();
        fn at(m: &mut BTreeMap<u32, Edit>, id: u32) -> &mut Edit {
            m.entry(id).or_insert(Edit {
                id,
                add: 0.0,
                repeat: 1.0,
                sub: 0.0,
            })
        }
        for &(id, bias) in &p.logit_bias {
            at(&mut edits, id).add += bias;
        }
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            for &id in &self.recent {
                at(&mut edits, id).repeat = p.repeat_penalty;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&id, &c) in &self.counts {
                at(&mut edits, id).sub = p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
        let min_w = if p.min_p > 0.0 {
            (p.min_p as f64 * WEIGHT_ONE as f64)
                .ceil()
                .min(WEIGHT_ONE as f64) as u32
        } else {
            0
        };
        Draw {
            temperature: p.temperature,
            top_k: p.top_k.min(u32::MAX as usize) as u32,
            top_p: p.top_p,
            min_w,
            bits: draw_bits(self.seed, self.pos),
            edits: edits.into_values().collect(),
        }
    }

    /// The draws of the next `drafts.len() + 1` tokens, each as if the drafts before
    /// it had been emitted (a verify step's rows).
    pub fn draws_ahead(&self, drafts: &[u32]) -> Vec<Draw> {
        let mut s = self.clone();
        let mut out = Vec::with_capacity(drafts.len() + 1);
        for &t in drafts {
            out.push(s.draw());
            s.accept(t);
        }
        out.push(s.draw());
        out
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        sample_with(&self.draw(), logits)
    }
}

/// Weights per task when a pass over the vocabulary is split across the pool's
/// threads (elementwise or integer sums: the same result in any split).
const PAR_CHUNK: usize = 16 << 10;

/// `⌈top_p · total⌉` in f64, within 1..=total (module docs, step 5).
pub fn top_p_need(top_p: f32, total: u64) -> u64 {
    ((top_p as f64 * total as f64).ceil() as u64).clamp(1, total.max(1))
}

/// The token `draw` picks from `logits` (module docs).
pub fn sample_with(draw: &Draw, logits: &[f32]) -> u32 {
    let l = draw.edited(logits);
    let l: &[f32] = &l;
    // The largest value: finite unless every value is NaN or -inf (no candidate) or
    // one is +inf; both cases, and greedy, are the argmax's.
    let best = argmax(l);
    let m = l[best as usize];
    if draw.temperature <= 0.0 || !m.is_finite() {
        return best;
    }
    thread_local! {
        static WEIGHTS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    WEIGHTS.with_borrow_mut(|w| {
        w.resize(l.len(), 0);
        let k = draw.top_k as usize;
        // top-p alone finds its nucleus from the weights' log-scale buckets.
        let by_buckets = k == 0 && draw.top_p < 1.0;
        // Elementwise, so split across the pool's threads (idle between steps) for a
        // whole vocabulary: the same weights in any split. Each chunk's sum (and
        // buckets) are taken while it is in cache.
        use rayon::prelude::*;
        let (sums, masses): (Vec<u64>, Vec<Option<Box<Masses>>>) = w
            .par_chunks_mut(PAR_CHUNK)
            .zip(l.par_chunks(PAR_CHUNK))
            .map(|(w, l)| {
                model::math::sample_weights(l, m, draw.temperature, w);
                if draw.min_w > 0 {
                    w.iter_mut()
                        .filter(|x| **x < draw.min_w)
                        .for_each(|x| *x = 0);
                }
                let sum = w.iter().map(|&x| x as u64).sum::<u64>();
                (sum, by_buckets.then(|| Box::new(bucket_masses(w))))
            })
            .unzip();
        let draw_at = |s_n: u64| ((draw.bits as u128 * s_n as u128) >> 64) as u64;
        if k > 0 {
            // top-k's candidates, (id, weight) in id order, then top-p among them.
            let mut c = top_k_by_weight(w, k);
            if draw.top_p < 1.0 {
                let need = top_p_need(draw.top_p, c.iter().map(|c| c.1 as u64).sum());
                rank_by_weight(&mut c);
                let end = reach(&c, 0, need).map_or(c.len(), |(i, _)| i + 1);
                c.truncate(end);
                c.sort_unstable_by_key(|c| c.0);
            }
            let r = draw_at(c.iter().map(|c| c.1 as u64).sum());
            let mut acc = 0u64;
            // Not reached past the end: the best candidate weighs 2^31 > r.
            return c
                .iter()
                .find(|c| {
                    acc += c.1 as u64;
                    r < acc
                })
                .map_or(best, |c| c.0);
        }
        // Without top-k the candidates are the whole vocabulary or top-p's nucleus,
        // told apart by a predicate rather than gathered: the draw finds its chunk
        // by the chunks' sums of candidates, then walks that chunk in id order.
        let total: u64 = sums.iter().sum();
        let (nucleus, sums) = if by_buckets {
            let masses: Vec<&Masses> = masses.iter().flatten().map(|m| &**m).collect();
            nucleus(w, &masses, total, draw.top_p)
        } else {
            (Nucleus::everything(total), sums)
        };
        let r = draw_at(nucleus.sum);
        let mut acc = 0u64;
        for (ci, (c, &s)) in w.chunks(PAR_CHUNK).zip(&sums).enumerate() {
            if r < acc + s {
                let base = ci * PAR_CHUNK;
                let at = c.iter().enumerate().position(|(i, &x)| {
                    acc += nucleus.weight(base + i, x) as u64;
                    r < acc
                });
                return at.map_or(best, |i| (base + i) as u32);
            }
            acc += s;
        }
        best
    })
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

    use rand::{Rng, SeedableRng};

    /// The definition in the module docs, step by step, without the shortcuts:
    /// every weight computed, every candidate sorted.
    fn reference_sample(d: &Draw, logits: &[f32]) -> u32 {
        let mut l = logits.to_vec();
        for e in &d.edits {
            if let Some(v) = l.get_mut(e.id as usize) {
                *v = e.apply(*v);
            }
        }
        let best = scan_argmax(&l);
        let m = l[best as usize];
        if d.temperature <= 0.0 || !m.is_finite() {
            return best;
        }
        let mut c: Vec<(u32, u64)> = l
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| {
                let x = (v - m) / d.temperature;
                let w = if x < -22.0 {
                    0
                } else {
                    (model::math::exp(x) as f64 * 2f64.powi(31)).floor() as u64
                };
                (i as u32, if w < d.min_w as u64 { 0 } else { w })
            })
            .filter(|c| c.1 > 0)
            .collect();
        c.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        if d.top_k > 0 {
            c.truncate(d.top_k as usize);
        }
        if d.top_p < 1.0 {
            let total: u64 = c.iter().map(|c| c.1).sum();
            let need = ((d.top_p as f64 * total as f64).ceil() as u64).clamp(1, total);
            let mut acc = 0;
            let end = c
                .iter()
                .position(|c| {
                    acc += c.1;
                    acc >= need
                })
                .unwrap();
            c.truncate(end + 1);
        }
        c.sort_by_key(|c| c.0);
        let s: u64 = c.iter().map(|c| c.1).sum();
        let r = ((d.bits as u128 * s as u128) >> 64) as u64;
        let mut acc = 0;
        for (id, x) in c {
            acc += x;
            if r < acc {
                return id;
            }
        }
        panic!("the walk passed the nucleus");
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
    fn matches_the_reference_sampler() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let mut draws = 0;
        for case in 0..120 {
            let l = logits_case(&mut rng, case);
            for temperature in [0.0f32, 0.05, 0.6, 1.0, 3.0] {
                for top_k in [0usize, 1, 20, 1000, 2000] {
                    for (top_p, min_p) in [
                        (1.0f32, 0.0f32),
                        (0.9, 0.0),
                        (0.999_999, 0.0),
                        (0.0, 0.0),
                        (1.0, 0.05),
                        (0.95, 1e-7),
                    ] {
                        let p = SamplingParams {
                            temperature,
                            top_k,
                            top_p,
                            min_p,
                            presence_penalty: if case % 3 == 0 { 0.7 } else { 0.0 },
                            repeat_penalty: if case % 4 == 1 { 1.3 } else { 1.0 },
                            logit_bias: if case % 5 == 2 {
                                vec![(0, 2.5), (1, f32::NEG_INFINITY), (0, -1.0)]
                            } else {
                                Vec::new()
                            },
                            ..Default::default()
                        };
                        let n = l.len() as u32;
                        let prompt: Vec<u32> = (0..8).map(|i| (i * 7) % n).collect();
                        let mut s = Sampler::new(&p, rng.random(), &prompt);
                        for _ in 0..2 {
                            let d = s.draw();
                            let got = s.sample(&l);
                            assert_eq!(got, reference_sample(&d, &l), "case {case}, {p:?}");
                            s.accept(got);
                            draws += 1;
                        }
                    }
                }
            }
        }
        assert!(draws > 30_000);
    }

    /// Frequencies over many positions follow the filtered softmax.
    #[test]
    fn draws_follow_the_distribution() {
        let l = [0.0f32, 1.0, 2.0, 2.0, -1.0, 0.5, f32::NEG_INFINITY, 3.0];
        let n = 200_000u64;
        let check = |p: SamplingParams, want: &[f64]| {
            let mut s = Sampler::new(&p, 5, &[]);
            let mut hits = [0u64; 8];
            for _ in 0..n {
                let t = s.sample(&l);
                s.accept(t);
                hits[t as usize] += 1;
            }
            for (i, (&h, &w)) in hits.iter().zip(want).enumerate() {
                let f = h as f64 / n as f64;
                // 6 standard deviations of a binomial frequency.
                let sd = (w * (1.0 - w) / n as f64).sqrt();
                assert!(
                    (f - w).abs() <= 6.0 * sd + 1e-9,
                    "{p:?}: id {i}: {f} vs {w}"
                );
            }
        };
        let softmax = |t: f64, keep: &[usize]| {
            let e: Vec<f64> = (0..8)
                .map(|i| {
                    if keep.contains(&i) {
                        (l[i] as f64 / t).exp()
                    } else {
                        0.0
                    }
                })
                .collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect::<Vec<_>>()
        };
        let all = [0, 1, 2, 3, 4, 5, 7];
        let base = SamplingParams {
            temperature: 1.0,
            repeat_penalty: 1.0,
            ..Default::default()
        };
        check(base.clone(), &softmax(1.0, &all));
        check(
            SamplingParams {
                temperature: 0.5,
                ..base.clone()
            },
            &softmax(0.5, &all),
        );
        // top-k 3: 7 (3.0), then 2 and 3 (2.0, tied: both, lower id first).
        check(
            SamplingParams {
                top_k: 3,
                ..base.clone()
            },
            &softmax(1.0, &[7, 2, 3]),
        );
        // top-p 0.5: 7 holds ~0.46 of the mass, with 2 it passes 0.5.
        check(
            SamplingParams {
                top_p: 0.5,
                ..base.clone()
            },
            &softmax(1.0, &[7, 2]),
        );
        // min-p 0.3: e^(l-3) >= 0.3 keeps 7, 2, 3.
        check(
            SamplingParams { min_p: 0.3, ..base },
            &softmax(1.0, &[7, 2, 3]),
        );
    }

    #[test]
    fn a_draw_depends_on_the_seed_and_the_position_only() {
        let p = SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            ..Default::default()
        };
        // The same position reached with another history draws the same bits.
        let mut a = Sampler::new(&p, 42, &[1, 2, 3]);
        a.accept(9);
        let b = Sampler::new(&p, 42, &[5, 5, 5, 5]);
        assert_eq!(a.draw().bits, b.draw().bits);
        assert_eq!(a.draw().bits, draw_bits(42, 4));
        assert_ne!(draw_bits(42, 4), draw_bits(42, 5));
        assert_ne!(draw_bits(42, 4), draw_bits(43, 4));
    }

    #[test]
    fn edits_sum_biases_then_penalise() {
        let p = SamplingParams {
            logit_bias: vec![(3, 1.5), (1, -2.0), (3, 0.25)],
            repeat_penalty: 2.0,
            repeat_last_n: 2,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        let mut s = Sampler::new(&p, 1, &[7, 3, 1]);
        s.accept(3);
        s.accept(3);
        // recent: [3, 3]; counts: {3: 2}.
        let d = s.draw();
        assert_eq!(
            d.edits,
            vec![
                Edit {
                    id: 1,
                    add: -2.0,
                    repeat: 1.0,
                    sub: 0.0
                },
                Edit {
                    id: 3,
                    add: 1.75,
                    repeat: 2.0,
                    sub: 1.0
                },
            ]
        );
        // (1 + 1.75) / 2 - 1, and (-3 + 1.75) * 2 - 1 (not positive: multiplied).
        assert_eq!(d.edits[1].apply(1.0), 0.375);
        assert_eq!(d.edits[1].apply(-3.0), -3.5);
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
            (0..40)
                .map(|_| {
                    let t = s.sample(&logits);
                    s.accept(t);
                    t
                })
                .collect::<Vec<_>>()
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
