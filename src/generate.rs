//! The generation loop over a backend session: prefill the prompt, then sample and decode until
//! an end-of-sequence token, a stop condition or the token budget.

use crate::model::{Logits, Model};
use crate::sampling::{Sampler, SamplingParams};
use crate::state::State;
use anyhow::{bail, Result};
use std::sync::Arc;
use std::time::Instant;

/// One sequence on one backend: owns the caches and the current position.
pub trait Session {
    /// Appends `tokens` and returns the logits after the last one (`[V]`).
    fn forward_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Appends `tokens` and returns logits after every one (`[T, V]`).
    fn forward_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Tokens processed so far.
    fn pos(&self) -> usize;
    fn vocab_size(&self) -> usize;
    fn max_positions(&self) -> usize;
}

/// The CPU session: the reference model and its state.
pub struct CpuSession {
    pub model: Arc<Model>,
    pub state: State,
}

impl CpuSession {
    pub fn new(model: Arc<Model>) -> CpuSession {
        let state = model.new_state();
        CpuSession { model, state }
    }
    fn check(&self, tokens: &[u32]) -> Result<()> {
        let v = self.model.cfg.vocab_size;
        if tokens.is_empty() {
            bail!("no input tokens");
        }
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= v) {
            bail!("token id {t} is out of range for this model (vocab_size {v})");
        }
        Ok(())
    }
}

impl Session for CpuSession {
    fn forward_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check(tokens)?;
        Ok(self.model.forward(tokens, &mut self.state, Logits::Last))
    }
    fn forward_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check(tokens)?;
        Ok(self.model.forward(tokens, &mut self.state, Logits::All))
    }
    fn pos(&self) -> usize {
        self.state.pos
    }
    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }
    fn max_positions(&self) -> usize {
        self.model.cfg.max_position_embeddings
    }
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub eos_ids: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token (not included in the output).
    Eos,
    /// `max_tokens` reached.
    Length,
    /// The callback asked to stop (a stop string, a cancelled client).
    Stopped,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    /// The end-of-sequence token that ended generation (not fed to the session).
    pub eos_token: Option<u32>,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

/// What the per-token callback tells the loop.
pub enum Flow {
    Continue,
    Stop,
}

/// Runs prefill then decode. `on_token` sees each generated token (EOS excluded).
pub fn generate(
    session: &mut dyn Session,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> Result<Flow>,
) -> Result<Generation> {
    opts.sampling.validate()?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let limit = session.max_positions();
    if session.pos() + prompt.len() > limit {
        bail!("the prompt ({} tokens) exceeds the model's context of {limit} tokens", prompt.len());
    }
    let mut sampler = Sampler::new(opts.sampling.clone());
    let t0 = Instant::now();
    let mut logits = session.forward_last(prompt)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut tokens = Vec::new();
    let mut finish = FinishReason::Length;
    let mut eos_token = None;
    while tokens.len() < opts.max_tokens {
        let next = sampler.sample(&logits);
        if opts.eos_ids.contains(&next) {
            finish = FinishReason::Eos;
            eos_token = Some(next);
            break;
        }
        tokens.push(next);
        if let Flow::Stop = on_token(next)? {
            finish = FinishReason::Stopped;
            break;
        }
        if tokens.len() == opts.max_tokens {
            break;
        }
        if session.pos() + 1 > limit {
            break;
        }
        logits = session.forward_last(&[next])?;
    }
    Ok(Generation {
        tokens,
        finish,
        eos_token,
        prompt_tokens: prompt.len(),
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}
