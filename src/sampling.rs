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

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
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

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let cand = self.distribution(logits);
        let u = self.rng.next_f64() as f32;
        let mut acc = 0f32;
        for c in &cand {
            acc += c.1;
            if u < acc {
                return c.0;
            }
        }
        cand.last().map(|c| c.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
