//! How one sequence chooses its next token: penalties, the grammar mask, logprobs and the
//! sampler, with the same randomness whether the sequence runs alone or in a batch.
//!
//! The first token always comes from the prompt's logits on the host. After that, a sequence
//! without penalties, logprobs or a grammar lets the backend pick (on the GPU: argmax or a seeded
//! draw on the device, no logits copied back); its draw `i` is seeded by the `i`-th value of a
//! generator seeded from the request's seed, so the token stream depends on the seed alone.

use crate::constrain::Constraint;
use crate::generate::{top_k_of, GenerateOptions, TokenLogprobs};
use crate::sampling::{apply_penalties, apply_repetition_penalty, log_softmax, Rng, Sampler};
use anyhow::Result;
use llguidance::toktrie::SimpleVob;
use std::collections::{HashMap, HashSet};

/// What the next forward pass of a sequence must return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// The logits (the host picks).
    Logits,
    /// The argmax token.
    Greedy,
    /// A token drawn from the filtered distribution with this seed.
    Sample(u64),
}

pub struct Picker {
    opts: GenerateOptions,
    sampler: Sampler,
    seeds: Rng,
    counts: HashMap<u32, u32>,
    seen: HashSet<u32>,
    repetition: Option<f32>,
    penalize: bool,
    /// Whether the backend may pick (no penalties, logprobs or grammar).
    on_backend: bool,
}

impl Picker {
    pub fn new(opts: &GenerateOptions, constrained: bool) -> Result<Picker> {
        opts.sampling.validate()?;
        let repetition = opts.repetition_penalty.filter(|&p| p != 1.0);
        let seen = if repetition.is_some() { opts.penalty_prompt.iter().copied().collect() } else { HashSet::new() };
        let penalize = opts.presence_penalty != 0.0 || opts.frequency_penalty != 0.0 || repetition.is_some();
        Ok(Picker {
            opts: opts.clone(),
            sampler: Sampler::new(opts.sampling.clone()),
            seeds: Rng::new(opts.sampling.seed ^ 0x6c69_6c79),
            counts: HashMap::new(),
            seen,
            repetition,
            penalize,
            on_backend: !penalize && opts.logprobs.is_none() && !constrained,
        })
    }

    /// What the forward pass that feeds the last accepted token must return (a `Sample` uses
    /// up one seed, so ask once per step).
    pub fn want(&mut self) -> Want {
        match (self.on_backend, self.opts.sampling.temperature == 0.0) {
            (false, _) => Want::Logits,
            (true, true) => Want::Greedy,
            (true, false) => Want::Sample(self.seeds.next_u64()),
        }
    }

    /// Picks from `logits` on the host: logprobs of the raw logits, then penalties, the grammar
    /// mask (pass it only while the constraint is active), and the sampler.
    pub fn pick(&mut self, logits: &mut [f32], mask: Option<&SimpleVob>) -> Result<(u32, Option<TokenLogprobs>)> {
        let lp = self.opts.logprobs.map(|k| (log_softmax(logits), k));
        if self.penalize {
            apply_penalties(logits, &self.counts, self.opts.presence_penalty, self.opts.frequency_penalty);
            if let Some(p) = self.repetition {
                apply_repetition_penalty(logits, &self.seen, p);
            }
        }
        if let Some(mask) = mask {
            Constraint::apply(mask, logits)?;
        }
        let next = self.sampler.sample(logits);
        let info = lp.map(|(lp, k)| TokenLogprobs { token: next, logprob: lp[next as usize], top: top_k_of(&lp, k) });
        Ok((next, info))
    }

    /// Records a generated (not end-of-sequence) token for the penalties.
    pub fn accept(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
        if self.repetition.is_some() {
            self.seen.insert(token);
        }
    }
}
