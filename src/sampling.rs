//! Token sampling: greedy, temperature, top-k, top-p, min-p, with a seeded RNG.
//!
//! Order (as llama.cpp and vLLM): temperature → top-k → softmax → min-p → top-p → draw.
//! The same seed and logits always give the same token.

use anyhow::{bail, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = disabled.
    pub top_k: usize,
    /// 1 = disabled.
    pub top_p: f32,
    /// 0 = disabled.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Rejects values no sampler can honour, naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 || self.temperature > 100.0 {
            bail!("temperature must be between 0 and 100, got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", self.top_p);
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            bail!("min_p must be in [0, 1], got {}", self.min_p);
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast and reproducible across platforms.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The first index of the largest logit: what a strict `>` scan from index 0 finds (a NaN never
/// wins, and one at index 0 keeps 0). Two vectorizable passes: the maximum over 8 independent
/// lanes, then the first block of 64 that holds it.
pub fn argmax(logits: &[f32]) -> u32 {
    let Some(&first) = logits.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; 8];
    let chunks = logits.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            if c[k] > lanes[k] {
                lanes[k] = c[k];
            }
        }
    }
    let m = lanes.iter().chain(tail).fold(first, |a, &v| if v > a { v } else { a });
    for (b, c) in logits.chunks(64).enumerate() {
        if c.iter().fold(false, |hit, &v| hit | (v == m)) {
            return (64 * b + c.iter().position(|&v| v == m).unwrap_or(0)) as u32;
        }
    }
    0
}

/// `log(softmax(logits))`, computed in f64 for the normaliser.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - m) as f64).exp()).sum();
    let lse = m as f64 + sum.ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// OpenAI presence/frequency penalties: `logit[t] -= presence·[count>0] + frequency·count` for
/// every token `t` with `count` occurrences so far in the generated text.
pub fn apply_penalties(
    logits: &mut [f32],
    counts: &std::collections::HashMap<u32, u32>,
    presence: f32,
    frequency: f32,
) {
    for (&t, &c) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            if c > 0 {
                *l -= presence + frequency * c as f32;
            }
        }
    }
}

/// vLLM's repetition penalty: for every token `t` in `seen` (the prompt's and the generated
/// tokens), `logit[t] /= p` when positive, `logit[t] *= p` otherwise (p > 1 discourages repeats).
pub fn apply_repetition_penalty(logits: &mut [f32], seen: &std::collections::HashSet<u32>, p: f32) {
    for &t in seen {
        if let Some(l) = logits.get_mut(t as usize) {
            *l = if *l > 0.0 { *l / p } else { *l * p };
        }
    }
}

pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = Rng::new(params.seed);
        Sampler { params, rng }
    }

    /// The candidates that survive filtering, as (token, probability) summing to 1, best first.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        let t = p.temperature.max(1e-6);
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / t)).collect();
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| {
            b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0))
        };
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            cand.truncate(p.top_k);
        }
        cand.sort_by(by_logit);
        let m = cand[0].1;
        let mut sum = 0f64;
        for c in cand.iter_mut() {
            c.1 = (c.1 - m).exp();
            sum += c.1 as f64;
        }
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / sum) as f32;
        }
        // Masked (-inf) and underflowed tokens can never be drawn, not even by rounding below.
        cand.retain(|c| c.1 > 0.0);
        if p.min_p > 0.0 {
            let floor = p.min_p * cand[0].1;
            cand.retain(|c| c.1 >= floor);
        }
        if p.top_p < 1.0 {
            let mut acc = 0f32;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        let total: f32 = cand.iter().map(|c| c.1).sum();
        cand.iter_mut().for_each(|c| c.1 /= total);
        cand
    }

    /// Draws one token from [`Sampler::distribution`]'s distribution without sorting the whole
    /// vocabulary: one pass for the softmax weights, a threshold for min-p, and for top-p a sort
    /// of only the tokens above a cut-off that provably holds the nucleus. Without top-p the
    /// draw walks the kept tokens in id order (top-k: in the order `distribution` gives).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        if p.top_k > 0 && p.top_k < logits.len() {
            // The k best in one pass (a bounded min-heap), then the reference filters on them.
            let k = p.top_k;
            let mut heap: std::collections::BinaryHeap<std::cmp::Reverse<(Ordf, std::cmp::Reverse<u32>)>> =
                std::collections::BinaryHeap::with_capacity(k + 1);
            for (i, &l) in logits.iter().enumerate() {
                let key = (Ordf(l), std::cmp::Reverse(i as u32));
                if heap.len() < k {
                    heap.push(std::cmp::Reverse(key));
                } else if heap.peek().is_some_and(|m| key > m.0) {
                    heap.pop();
                    heap.push(std::cmp::Reverse(key));
                }
            }
            let mut sub: Vec<f32> = Vec::with_capacity(k);
            let mut ids: Vec<u32> = Vec::with_capacity(k);
            for std::cmp::Reverse((Ordf(l), std::cmp::Reverse(i))) in heap.into_vec() {
                sub.push(l);
                ids.push(i);
            }
            // The same candidates, filtered exactly as `distribution` filters them.
            let only = Sampler { params: SamplingParams { top_k: 0, ..p.clone() }, rng: Rng::new(0) };
            let cand: Vec<(u32, f32)> =
                only.distribution(&sub).into_iter().map(|(j, q)| (ids[j as usize], q)).collect();
            return draw(&cand, self.rng.next_f64());
        }
        let t = p.temperature.max(1e-6);
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) / t;
        // Weights relative to the best token (1.0); min-p keeps w >= min_p.
        let floor = if p.min_p > 0.0 { p.min_p } else { 0.0 };
        let mut all = 0f64;
        let w: Vec<f32> = logits
            .iter()
            .map(|&l| {
                let x = (l / t - m).exp();
                all += x as f64;
                if x >= floor && x > 0.0 {
                    x
                } else {
                    0.0
                }
            })
            .collect();
        let total: f64 = w.iter().map(|&x| x as f64).sum();
        let u = self.rng.next_f64();
        if p.top_p >= 1.0 {
            let target = u * total;
            let mut acc = 0f64;
            let mut last = 0u32;
            for (i, &x) in w.iter().enumerate() {
                if x > 0.0 {
                    acc += x as f64;
                    last = i as u32;
                    if acc > target {
                        return i as u32;
                    }
                }
            }
            return last;
        }
        // The nucleus: the smallest best-first prefix holding top_p of the mass. All tokens at
        // or above a cut-off `tau` come first in that order, so once they hold enough mass the
        // nucleus lies among them.
        // As in `distribution`: top-p counts probability under the softmax before min-p.
        let need = (p.top_p as f64 * all).min(total);
        let mut tau = 1e-3f32;
        let head: Vec<(u32, f32)> = loop {
            let h: Vec<(u32, f32)> =
                w.iter().enumerate().filter(|(_, &x)| x > 0.0 && x >= tau).map(|(i, &x)| (i as u32, x)).collect();
            let mass: f64 = h.iter().map(|c| c.1 as f64).sum();
            if mass >= need || tau < 1e-30 {
                break h;
            }
            tau /= 64.0;
        };
        let mut head = head;
        head.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0)));
        let mut acc = 0f64;
        let mut keep = head.len();
        for (i, c) in head.iter().enumerate() {
            acc += c.1 as f64;
            if acc >= need {
                keep = i + 1;
                break;
            }
        }
        head.truncate(keep);
        let sum: f64 = head.iter().map(|c| c.1 as f64).sum();
        let target = u * sum;
        let mut acc = 0f64;
        for c in &head {
            acc += c.1 as f64;
            if acc > target {
                return c.0;
            }
        }
        head.last().map(|c| c.0).unwrap_or(0)
    }
}

/// A float ordered totally (NaN lowest), for the top-k heap.
#[derive(Clone, Copy, PartialEq)]
struct Ordf(f32);

impl Eq for Ordf {}
impl PartialOrd for Ordf {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Ordf {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        let key = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
        key(self.0).partial_cmp(&key(o.0)).unwrap_or(std::cmp::Ordering::Equal)
    }
}

/// A draw from (token, probability) pairs that sum to 1.
fn draw(cand: &[(u32, f32)], u: f64) -> u32 {
    let u = u as f32;
    let mut acc = 0f32;
    for c in cand {
        acc += c.1;
        if u < acc {
            return c.0;
        }
    }
    cand.last().map(|c| c.0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The strict `>` scan that `argmax` must equal.
    fn argmax_scan(l: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &v) in l.iter().enumerate() {
            if v > l[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_equals_the_first_index_scan() {
        let mut r = Rng::new(5);
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![1.0],
            vec![f32::NAN, 3.0, 2.0],
            vec![1.0, f32::NAN, 3.0, f32::NAN],
            vec![-0.0, 0.0, -1.0],
            vec![f32::NEG_INFINITY; 70],
            vec![2.0; 130],
        ];
        for n in [7usize, 8, 9, 63, 64, 65, 1000, 248_320] {
            let mut v: Vec<f32> = (0..n).map(|_| (r.next_f64() * 8.0) as f32 - 4.0).collect();
            // ties: the maximum repeated in a later block and in other lanes
            let m = v.iter().copied().fold(f32::MIN, f32::max);
            v[n - 1] = m;
            v[n / 2] = m;
            cases.push(v.clone());
            // quantized values give many ties and NaNs scattered
            let q: Vec<f32> =
                v.iter().enumerate().map(|(i, x)| if i % 97 == 5 { f32::NAN } else { x.round() }).collect();
            cases.push(q);
        }
        for (i, c) in cases.iter().enumerate() {
            assert_eq!(argmax(c), argmax_scan(c), "case {i} (len {})", c.len());
        }
    }

    #[test]
    fn log_softmax_normalises() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f64 = lp.iter().map(|&x| (x as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!((lp[2] - lp[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn penalties_follow_openai_formula() {
        let mut l = vec![1.0f32, 1.0, 1.0];
        let counts = std::collections::HashMap::from([(0u32, 2u32), (2, 1), (7, 1)]);
        apply_penalties(&mut l, &counts, 0.5, 0.25);
        assert_eq!(l, vec![1.0 - 0.5 - 0.5, 1.0, 1.0 - 0.5 - 0.25]);
    }

    #[test]
    fn a_strong_penalty_changes_the_greedy_choice() {
        let mut l = vec![2.0f32, 1.5];
        apply_penalties(&mut l, &std::collections::HashMap::from([(0u32, 1u32)]), 1.0, 0.0);
        assert_eq!(argmax(&l), 1);
    }
}
