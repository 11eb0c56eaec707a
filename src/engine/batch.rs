//! The backend side of batching: sequence slots and one forward pass over several sequences.
//!
//! A slot holds one sequence's caches (KV of the attention layers, conv window and recurrent
//! state of the GDN layers) and its position. A step takes, per sequence, the tokens to append
//! (one when decoding, a chunk of its prompt when prefilling) and returns for each what it asked
//! for: the logits after its last token, or a token the backend picked.
//!
//! `CpuBatch` stacks the step's tokens into one matrix ([`Model::forward_batch`]): the weights,
//! which bound CPU decode, are read once per step for all sequences. `SerialBatch` runs any
//! [`Session`] backend one sequence after another (the CUDA backend until its batched step
//! exists): sequences are interleaved step by step but do not share weight reads.

use super::picker::Want;
use crate::generate::{CpuSession, Session, Snapshot};
use crate::model::{Logits, Model, Seq};
use crate::sampling::{argmax, Sampler, SamplingParams};
use crate::state::State;
use anyhow::{bail, Context, Result};
use std::sync::Arc;

/// One sequence's part of a step.
pub struct Work<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    pub want: Want,
    /// The parameters of a `Want::Sample` draw.
    pub sampling: &'a SamplingParams,
}

#[derive(Debug)]
pub enum Out {
    Logits(Vec<f32>),
    Token(u32),
}

pub trait Batched: Send {
    /// Number of sequence slots.
    fn slots(&self) -> usize;
    fn vocab_size(&self) -> usize;
    fn max_positions(&self) -> usize;
    /// Tokens the slot's sequence has processed.
    fn pos(&self, slot: usize) -> usize;
    /// Empties a slot (position 0).
    fn reset(&mut self, slot: usize);
    fn snapshot(&self, slot: usize) -> Snapshot;
    fn restore(&mut self, slot: usize, snap: &Snapshot) -> Result<()>;
    /// Positions per page of the backend's own KV memory, when it has pages of a fixed size (the
    /// scheduler then counts its budget in them); None: the scheduler's page size stands.
    fn kv_page_tokens(&self) -> Option<usize> {
        None
    }
    /// Caps the backend's KV memory at `pages` pages of the scheduler's size.
    fn limit_kv_pages(&mut self, _pages: usize) {}
    /// Appends each item's tokens to its slot's sequence (a slot at most once per step) and
    /// returns, in order, what each item wants.
    fn step(&mut self, work: &[Work]) -> Result<Vec<Out>>;
}

/// Refuses a step that names a slot twice or out of range, has an empty or out-of-vocabulary
/// item, or would run past the context.
pub fn check_work(
    work: &[Work],
    slots: usize,
    vocab: usize,
    max_pos: usize,
    pos: impl Fn(usize) -> usize,
) -> Result<()> {
    let mut seen = vec![false; slots];
    for w in work {
        if w.slot >= slots {
            bail!("slot {} out of range ({slots} slots)", w.slot);
        }
        if std::mem::replace(&mut seen[w.slot], true) {
            bail!("slot {} appears twice in one step", w.slot);
        }
        if w.tokens.is_empty() {
            bail!("no input tokens for slot {}", w.slot);
        }
        if let Some(t) = w.tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {t} is out of range for this model (vocab_size {vocab})");
        }
        if pos(w.slot) + w.tokens.len() > max_pos {
            bail!("slot {}: {} more tokens exceed the model's context of {max_pos}", w.slot, w.tokens.len());
        }
    }
    Ok(())
}

/// What a step returns for `want`, from the logits after the sequence's last token.
fn answer(logits: &[f32], want: Want, sampling: &SamplingParams) -> Out {
    match want {
        Want::Logits => Out::Logits(logits.to_vec()),
        Want::Greedy => Out::Token(argmax(logits)),
        // As `Session::sampled_steps`' host default: a sampler seeded by this draw's seed.
        Want::Sample(seed) => Out::Token(Sampler::new(SamplingParams { seed, ..sampling.clone() }).sample(logits)),
    }
}

/// The CPU backend's slots: one [`State`] each, all stepped by one batched forward pass.
pub struct CpuBatch {
    model: Arc<Model>,
    states: Vec<State>,
}

impl CpuBatch {
    pub fn new(model: Arc<Model>, slots: usize) -> CpuBatch {
        let states = (0..slots).map(|_| model.new_state()).collect();
        CpuBatch { model, states }
    }
}

impl Batched for CpuBatch {
    fn slots(&self) -> usize {
        self.states.len()
    }
    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }
    fn max_positions(&self) -> usize {
        self.model.cfg.max_position_embeddings
    }
    fn pos(&self, slot: usize) -> usize {
        self.states[slot].pos
    }
    fn reset(&mut self, slot: usize) {
        self.states[slot] = self.model.new_state();
    }
    fn snapshot(&self, slot: usize) -> Snapshot {
        let s = &self.states[slot];
        Snapshot { pos: s.pos, nbytes: s.nbytes(), data: Box::new(s.clone()) }
    }
    fn restore(&mut self, slot: usize, snap: &Snapshot) -> Result<()> {
        let state = snap.data.downcast_ref::<State>().context("snapshot is not from a CPU session")?;
        if state.layers.len() != self.states[slot].layers.len() {
            bail!("snapshot is from a different model");
        }
        self.states[slot] = state.clone();
        Ok(())
    }
    fn step(&mut self, work: &[Work]) -> Result<Vec<Out>> {
        let c = &self.model.cfg;
        check_work(work, self.states.len(), c.vocab_size, c.max_position_embeddings, |s| self.states[s].pos)?;
        if work.is_empty() {
            return Ok(Vec::new());
        }
        // Move the slots' states out for the pass (disjoint &mut without unsafe), then back.
        let mut taken: Vec<State> = work
            .iter()
            .map(|w| std::mem::replace(&mut self.states[w.slot], State { pos: 0, layers: Vec::new() }))
            .collect();
        let mut seqs: Vec<Seq> =
            work.iter().zip(taken.iter_mut()).map(|(w, state)| Seq { tokens: w.tokens, state }).collect();
        let logits = self.model.forward_batch(&mut seqs, Logits::Last);
        drop(seqs);
        for (w, s) in work.iter().zip(taken) {
            self.states[w.slot] = s;
        }
        let v = c.vocab_size;
        Ok(work.iter().zip(logits.chunks_exact(v)).map(|(w, l)| answer(l, w.want, w.sampling)).collect())
    }
}

/// One item of a step on its own session: the prompt chunk or token through the session's own
/// path (its batched prefill, its decode step), then what the item wants.
pub fn session_step(s: &mut dyn Session, w: &Work) -> Result<Out> {
    let (head, last) = w.tokens.split_at(w.tokens.len() - 1);
    Ok(match w.want {
        Want::Logits => Out::Logits(s.forward_last(w.tokens)?),
        want => {
            if !head.is_empty() {
                s.forward_last(head)?;
            }
            Out::Token(match want {
                Want::Sample(seed) => s.sampled_steps(last[0], 1, w.sampling, seed)?[0],
                _ => s.greedy_steps(last[0], 1)?[0],
            })
        }
    })
}

/// Any [`Session`] backend as slots, one session per slot, stepped one after another.
pub struct SerialBatch {
    sessions: Vec<Box<dyn Session + Send>>,
}

impl SerialBatch {
    pub fn new(sessions: Vec<Box<dyn Session + Send>>) -> Result<SerialBatch> {
        if sessions.is_empty() {
            bail!("no sessions");
        }
        Ok(SerialBatch { sessions })
    }
    /// CPU sessions (for tests of the serial path).
    pub fn cpu(model: Arc<Model>, slots: usize) -> SerialBatch {
        let sessions = (0..slots.max(1)).map(|_| Box::new(CpuSession::new(model.clone())) as Box<dyn Session + Send>);
        SerialBatch { sessions: sessions.collect() }
    }
}

impl Batched for SerialBatch {
    fn slots(&self) -> usize {
        self.sessions.len()
    }
    fn vocab_size(&self) -> usize {
        self.sessions[0].vocab_size()
    }
    fn max_positions(&self) -> usize {
        self.sessions[0].max_positions()
    }
    fn pos(&self, slot: usize) -> usize {
        self.sessions[slot].pos()
    }
    fn reset(&mut self, slot: usize) {
        self.sessions[slot].reset()
    }
    fn snapshot(&self, slot: usize) -> Snapshot {
        self.sessions[slot].snapshot()
    }
    fn restore(&mut self, slot: usize, snap: &Snapshot) -> Result<()> {
        self.sessions[slot].restore(snap)
    }
    fn step(&mut self, work: &[Work]) -> Result<Vec<Out>> {
        let (n, v, m) = (self.sessions.len(), self.vocab_size(), self.max_positions());
        check_work(work, n, v, m, |s| self.sessions[s].pos())?;
        work.iter().map(|w| session_step(self.sessions[w.slot].as_mut(), w)).collect()
    }
}
