//! Continuous batching: requests wait in a queue, are admitted into sequence slots while slots
//! and KV pages are free, and every step runs one forward pass over all of them: one token for
//! each decoding sequence and prompt chunks for the prefilling ones, at most
//! `max_prefill_tokens` prompt tokens per step, so a long prompt is spread over several steps
//! and the other sequences keep streaming. A sequence leaves at end-of-sequence, its token
//! budget, a stop (a stop string, a finished grammar) or when its client has gone; its slot and
//! pages are free for the next step.
//!
//! Per step: sweep departed clients → admit (FIFO; a request waits while its KV reservation does
//! not fit) → build the work (decode tokens first, then prompt chunks in admission order) →
//! masks of constrained sequences on a second thread during the pass → the pass → deliver each
//! sequence's token (sampled by its own [`Picker`], so a sequence gets the tokens it would get
//! alone) → snapshots for the prefix cache at prompt boundaries and at the end.

use super::batch::{Batched, Out, Work};
use super::kv::KvPages;
use super::metrics::Metrics;
use super::picker::{Picker, Want};
use super::prefix_cache::PrefixCache;
use crate::constrain::Constraint;
use crate::generate::{FinishReason, Flow, GenerateOptions, Step, TokenLogprobs};
use anyhow::{anyhow, Result};
use llguidance::toktrie::SimpleVob;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// Where a sequence's tokens and its end go (the server: an HTTP stream).
pub trait Sink: Send {
    /// A generated token (end-of-sequence excluded); `Stop` ends the sequence.
    fn token(&mut self, step: &Step) -> Flow;
    /// The client has gone: the sequence is dropped at the next step (or never admitted).
    fn gone(&self) -> bool;
    /// The sequence ended (not called for a departed client).
    fn done(&mut self, end: Result<Ended>);
}

pub struct Request {
    pub prompt: Vec<u32>,
    /// Extra point (tokens) to snapshot for the prefix cache (the end of the conversation before
    /// the generation prompt).
    pub boundary: Option<usize>,
    pub opts: GenerateOptions,
    pub constraint: Option<Constraint>,
    /// Test hook: force this token sequence (then end-of-sequence) instead of the model's choice.
    pub script: Option<Vec<u32>>,
    pub sink: Box<dyn Sink>,
}

#[derive(Clone, Debug)]
pub struct Ended {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub eos_token: Option<u32>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

pub struct Limits {
    /// Prompt tokens per step, over all prefilling sequences.
    pub max_prefill_tokens: usize,
    /// KV-cache positions over all sequences, and positions per page.
    pub kv_budget_tokens: usize,
    pub page_tokens: usize,
    /// Bytes of prefix-cache snapshots (0: off).
    pub prefix_cache_bytes: usize,
}

struct Seq {
    req: Request,
    picker: Picker,
    cached: usize,
    /// Prompt positions still to reach, each a prefix-cache snapshot point; empty once prefilled.
    ends: VecDeque<usize>,
    generated: Vec<u32>,
    /// The token the coming step feeds (decoding).
    next: Option<u32>,
    admitted: Instant,
    decode_from: Option<Instant>,
    prefill_secs: f64,
    /// The prompt's prefix-cache snapshot (its tokens and the logits after them), taken once
    /// the first token has gone out (a device session's state copy can take milliseconds), or
    /// at the end if the sequence ends with that token.
    prompt_snap: Option<(Vec<u32>, Vec<f32>)>,
}

pub struct Scheduler {
    backend: Box<dyn Batched>,
    limits: Limits,
    kv: KvPages,
    cache: PrefixCache,
    waiting: VecDeque<Request>,
    slots: Vec<Option<Seq>>,
    metrics: Arc<Metrics>,
}

impl Scheduler {
    pub fn new(mut backend: Box<dyn Batched>, mut limits: Limits, metrics: Arc<Metrics>) -> Scheduler {
        let n = backend.slots();
        if let Some(p) = backend.kv_page_tokens() {
            limits.page_tokens = p;
        }
        let pages = (limits.kv_budget_tokens / limits.page_tokens.max(1)).max(1);
        backend.limit_kv_pages(pages);
        let kv = KvPages::new(limits.page_tokens, pages, n);
        metrics.slots.store(n as u64, Relaxed);
        metrics.kv_pages_total.store(kv.total() as u64, Relaxed);
        metrics.kv_page_tokens.store(kv.page_tokens() as u64, Relaxed);
        let cache = PrefixCache::new(limits.prefix_cache_bytes);
        Scheduler {
            backend,
            limits,
            kv,
            cache,
            waiting: VecDeque::new(),
            slots: (0..n).map(|_| None).collect(),
            metrics,
        }
    }

    /// Queues a request (the caller bounds the queue; `metrics.queue_depth` counts it already).
    pub fn submit(&mut self, req: Request) {
        self.waiting.push_back(req);
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Nothing queued and nothing running.
    pub fn idle(&self) -> bool {
        self.waiting.is_empty() && self.running() == 0
    }

    /// Ends every running and waiting sequence with `msg` and empties the slots and the prefix
    /// cache (after a panic, whose leftovers are not trusted).
    pub fn fail_all(&mut self, msg: &str) {
        for slot in 0..self.slots.len() {
            if let Some(mut s) = self.slots[slot].take() {
                self.free(slot);
                s.req.sink.done(Err(anyhow!("{msg}")));
            }
            self.backend.reset(slot);
        }
        for mut r in self.waiting.drain(..) {
            self.metrics.queue_depth.fetch_sub(1, Relaxed);
            r.sink.done(Err(anyhow!("{msg}")));
        }
        self.cache = PrefixCache::new(self.limits.prefix_cache_bytes);
        self.publish_cache();
    }

    /// One round: admit, one forward pass, deliver. False when there was nothing to run.
    pub fn step(&mut self) -> bool {
        let round = std::time::Instant::now();
        let ran = self.round();
        if let Some(forward) = ran {
            self.metrics.round(round.elapsed().as_secs_f64(), forward);
        }
        ran.is_some()
    }

    /// [`Scheduler::step`]'s work: the seconds its forward pass took, None when nothing ran.
    fn round(&mut self) -> Option<f64> {
        self.sweep();
        self.admit();
        let limit = self.backend.max_positions();
        // Owned copies of the step's tokens: the mask thread below borrows the sequences.
        let mut items: Vec<(usize, Vec<u32>, Want, bool)> = Vec::new(); // (slot, tokens, want, decoding)
        for (slot, s) in self.slots.iter_mut().enumerate() {
            if let Some(s) = s.as_mut() {
                if let Some(t) = s.next {
                    let want = if s.req.script.is_some() { Want::Logits } else { s.picker.want() };
                    items.push((slot, vec![t], want, true));
                }
            }
        }
        let mut budget = self.limits.max_prefill_tokens.max(1);
        let mut order: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].is_some()).collect();
        order.sort_by_key(|&i| self.slots[i].as_ref().map(|s| s.admitted));
        for slot in order {
            let s = self.slots[slot].as_ref().expect("listed");
            if budget == 0 {
                break;
            }
            if let Some(&end) = s.ends.front() {
                let pos = self.backend.pos(slot);
                let n = (end - pos).min(budget);
                budget -= n;
                items.push((slot, s.req.prompt[pos..pos + n].to_vec(), Want::Logits, false));
            }
        }
        if items.is_empty() {
            return None;
        }
        // Masks for constrained decoding sequences whose logits come back this step.
        let masked: Vec<usize> = items
            .iter()
            .filter(|(slot, _, want, dec)| {
                *dec && *want == Want::Logits && self.slots[*slot].as_ref().is_some_and(|s| active(&s.req.constraint))
            })
            .map(|(slot, ..)| *slot)
            .collect();
        let sampling: Vec<crate::sampling::SamplingParams> = items
            .iter()
            .map(|(slot, ..)| self.slots[*slot].as_ref().expect("listed").req.opts.sampling.clone())
            .collect();
        let work: Vec<Work> = items
            .iter()
            .zip(&sampling)
            .map(|((slot, tokens, want, _), sampling)| Work { slot: *slot, tokens, want: *want, sampling })
            .collect();
        let backend = &mut self.backend;
        let slots = &mut self.slots;
        let mut forward = 0.0;
        let (outs, mut masks) = std::thread::scope(|sc| {
            let mask_job = (!masked.is_empty()).then(|| {
                let mut cs: Vec<(usize, &mut Constraint)> = slots
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| masked.contains(i))
                    .filter_map(|(i, s)| s.as_mut().and_then(|s| s.req.constraint.as_mut()).map(|c| (i, c)))
                    .collect();
                sc.spawn(move || cs.iter_mut().map(|(i, c)| (*i, c.mask())).collect::<Vec<_>>())
            });
            let t0 = std::time::Instant::now();
            let outs = backend.step(&work);
            forward = t0.elapsed().as_secs_f64();
            let masks = mask_job.map(|j| j.join().unwrap_or_default()).unwrap_or_default();
            (outs, masks)
        });
        self.metrics.batch(items.len());
        let outs = match outs {
            Ok(o) => o,
            Err(e) => {
                // The pass failed as a whole: every sequence in it ends with the error.
                let msg = format!("{e:#}");
                for (slot, ..) in &items {
                    self.end_err(*slot, anyhow!("{msg}"));
                }
                return Some(forward);
            }
        };
        for ((slot, tokens, _, decoding), out) in items.into_iter().zip(outs) {
            if self.slots[slot].is_none() {
                continue;
            }
            if decoding {
                let mask = masks.iter_mut().position(|(i, _)| *i == slot).map(|k| masks.swap_remove(k).1);
                let r = match out {
                    Out::Token(t) => Ok((t, None)),
                    Out::Logits(mut l) => self.pick(slot, &mut l, mask),
                };
                match r {
                    Ok((t, info)) => self.deliver(slot, t, info, limit),
                    Err(e) => self.end_err(slot, e),
                }
                continue;
            }
            // A prompt chunk.
            let pos = self.backend.pos(slot);
            let s = self.slots[slot].as_mut().expect("checked");
            debug_assert!(pos >= tokens.len());
            if s.ends.front() == Some(&pos) {
                s.ends.pop_front();
                let last = s.ends.is_empty();
                let prefix = s.req.prompt[..pos].to_vec();
                let Out::Logits(mut logits) = out else { unreachable!("prompt chunks ask for logits") };
                if !last {
                    self.save(slot, prefix, None);
                    continue;
                }
                if self.limits.prefix_cache_bytes > 0 {
                    s.prompt_snap = Some((prefix, logits.clone()));
                }
                // The first token goes out first; the snapshot of the state after the prompt
                // (unchanged until the next pass feeds that token) follows.
                self.prefilled(slot, &mut logits, limit);
                if let Some((tokens, l)) = self.slots[slot].as_mut().and_then(|s| s.prompt_snap.take()) {
                    self.save(slot, tokens, Some(l));
                }
            }
        }
        Some(forward)
    }

    /// Drops sequences whose clients have gone, running or waiting.
    fn sweep(&mut self) {
        for slot in 0..self.slots.len() {
            if self.slots[slot].as_ref().is_some_and(|s| s.req.sink.gone()) {
                self.slots[slot] = None;
                self.free(slot);
                self.metrics.cancelled.fetch_add(1, Relaxed);
            }
        }
        let before = self.waiting.len();
        self.waiting.retain(|r| !r.sink.gone());
        let gone = before - self.waiting.len();
        self.metrics.queue_depth.fetch_sub(gone as i64, Relaxed);
        self.metrics.cancelled.fetch_add(gone as u64, Relaxed);
    }

    fn free(&mut self, slot: usize) {
        // The slot's cache memory goes back with its reservation (for the next admitted sequence).
        self.backend.reset(slot);
        self.kv.release(slot);
        self.metrics.running.store(self.running() as i64, Relaxed);
        self.metrics.kv_pages_used.store(self.kv.used() as u64, Relaxed);
    }

    /// Admits waiting requests into free slots while their KV reservations fit (FIFO).
    fn admit(&mut self) {
        let limit = self.backend.max_positions();
        while let Some(slot) = self.slots.iter().position(|s| s.is_none()) {
            let Some(req) = self.waiting.front() else { break };
            let reserve = (req.prompt.len() + req.opts.max_tokens).min(limit);
            let problem = if req.prompt.is_empty() {
                Some(anyhow!("the prompt is empty"))
            } else if req.prompt.len() > limit {
                Some(anyhow!("the prompt ({} tokens) exceeds the model's context of {limit} tokens", req.prompt.len()))
            } else {
                self.kv.check_fits(reserve).err()
            };
            let picker = match problem {
                Some(e) => Err(e),
                None => Picker::new(&req.opts, req.constraint.is_some()),
            };
            let picker = match picker {
                Ok(p) => p,
                Err(e) => {
                    let mut req = self.waiting.pop_front().expect("front");
                    self.metrics.queue_depth.fetch_sub(1, Relaxed);
                    req.sink.done(Err(e));
                    continue;
                }
            };
            if !self.kv.reserve(slot, reserve) {
                break; // waits until running sequences free their pages
            }
            let req = self.waiting.pop_front().expect("front");
            self.metrics.queue_depth.fetch_sub(1, Relaxed);
            self.metrics.kv_pages_used.store(self.kv.used() as u64, Relaxed);
            let (start, logits) = self.resume(slot, &req.prompt);
            let m = &self.metrics;
            if start > 0 {
                m.prefix_hits.fetch_add(1, Relaxed);
                m.cached_tokens.fetch_add(start as u64, Relaxed);
            } else {
                m.prefix_misses.fetch_add(1, Relaxed);
            }
            m.prompt_tokens.fetch_add(req.prompt.len() as u64, Relaxed);
            let mut ends: VecDeque<usize> =
                req.boundary.into_iter().filter(|&b| b > start && b < req.prompt.len()).collect();
            if start < req.prompt.len() {
                ends.push_back(req.prompt.len());
            }
            self.slots[slot] = Some(Seq {
                req,
                picker,
                cached: start,
                ends,
                generated: Vec::new(),
                next: None,
                admitted: Instant::now(),
                decode_from: None,
                prefill_secs: 0.0,
                prompt_snap: None,
            });
            self.metrics.running.store(self.running() as i64, Relaxed);
            if let Some(mut l) = logits {
                // The whole prompt and its logits came from the cache.
                self.prefilled(slot, &mut l, limit);
            }
        }
    }

    /// Restores the longest cached prefix of `prompt` into `slot` (else empties it): the tokens
    /// covered and, for a hit on the whole prompt, its logits.
    fn resume(&mut self, slot: usize, prompt: &[u32]) -> (usize, Option<Vec<f32>>) {
        if let Some(hit) = self.cache.lookup(prompt) {
            if self.backend.restore(slot, hit.snap).is_ok() && self.backend.pos(slot) == hit.len {
                return (hit.len, hit.logits.map(<[f32]>::to_vec));
            }
        }
        self.backend.reset(slot);
        (0, None)
    }

    fn save(&mut self, slot: usize, tokens: Vec<u32>, logits: Option<Vec<f32>>) {
        if self.limits.prefix_cache_bytes > 0 && !self.cache.contains(&tokens, logits.is_some()) {
            let snap = self.backend.snapshot(slot);
            self.cache.insert(tokens, snap, logits);
            self.publish_cache();
        }
    }

    fn publish_cache(&self) {
        self.metrics.cache_bytes.store(self.cache.bytes() as u64, Relaxed);
        self.metrics.cache_entries.store(self.cache.len() as u64, Relaxed);
    }

    /// The prompt is in: record the prefill and pick the first token from its logits.
    fn prefilled(&mut self, slot: usize, logits: &mut [f32], limit: usize) {
        let s = self.slots[slot].as_mut().expect("running");
        s.prefill_secs = s.admitted.elapsed().as_secs_f64();
        self.metrics.prefill(s.req.prompt.len() - s.cached, s.prefill_secs);
        s.decode_from = Some(Instant::now());
        if s.req.opts.max_tokens == 0 {
            return self.end(slot, FinishReason::Length, None);
        }
        match self.pick(slot, logits, None) {
            Ok((t, info)) => self.deliver(slot, t, info, limit),
            Err(e) => self.end_err(slot, e),
        }
    }

    /// The host pick from `logits` (the script hook forces its token first), under the mask
    /// computed during the pass, or computed now if there is none.
    fn pick(
        &mut self,
        slot: usize,
        logits: &mut [f32],
        mask: Option<Result<SimpleVob>>,
    ) -> Result<(u32, Option<TokenLogprobs>)> {
        let s = self.slots[slot].as_mut().expect("running");
        if let Some(script) = &s.req.script {
            let eos = s.req.opts.eos_ids.first().copied().unwrap_or(0);
            force(logits, script.get(s.generated.len()).copied().unwrap_or(eos));
        }
        let mask = match (s.req.constraint.as_mut().filter(|c| c.is_active()), mask) {
            (Some(_), Some(m)) => Some(m?),
            (Some(c), None) => Some(c.mask()?),
            (None, _) => None,
        };
        s.picker.pick(logits, mask.as_ref())
    }

    /// A token for the sequence in `slot`: end-of-sequence ends it; else it is reported, and
    /// fed at the next step unless a stop, the token budget or the context ends the sequence.
    fn deliver(&mut self, slot: usize, t: u32, info: Option<TokenLogprobs>, limit: usize) {
        let pos = self.backend.pos(slot);
        let s = self.slots[slot].as_mut().expect("running");
        s.next = None;
        if s.req.opts.eos_ids.contains(&t) {
            return self.end(slot, FinishReason::Eos, Some(t));
        }
        s.generated.push(t);
        s.picker.accept(t);
        if let Flow::Stop = s.req.sink.token(&Step { token: t, logprobs: info.as_ref() }) {
            return self.end(slot, FinishReason::Stopped, None);
        }
        if let Some(c) = s.req.constraint.as_mut() {
            if let Err(e) = c.observe(t) {
                return self.end_err(slot, e);
            }
            if c.finished() {
                return self.end(slot, FinishReason::Eos, None);
            }
        }
        if s.generated.len() >= s.req.opts.max_tokens || pos + 1 > limit {
            return self.end(slot, FinishReason::Length, None);
        }
        s.next = Some(t);
    }

    fn end(&mut self, slot: usize, finish: FinishReason, eos_token: Option<u32>) {
        let fed = self.backend.pos(slot);
        let Some(mut s) = self.slots[slot].take() else { return };
        // Without a pending prompt snapshot, the state after the prompt and the generated
        // tokens fed back so far goes to the prefix cache.
        let fed_tokens = (s.prompt_snap.is_none() && fed > s.req.prompt.len() && s.req.script.is_none())
            .then(|| s.req.prompt.iter().chain(&s.generated).copied().take(fed).collect::<Vec<u32>>())
            .filter(|t| t.len() == fed);
        let n = s.generated.len();
        let decode_secs = s.decode_from.map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.metrics.decode(n.saturating_sub(1), decode_secs);
        self.metrics.completion_tokens.fetch_add(n as u64, Relaxed);
        let ended = Ended {
            tokens: std::mem::take(&mut s.generated),
            finish,
            eos_token,
            prompt_tokens: s.req.prompt.len(),
            cached_tokens: s.cached,
            prefill_secs: s.prefill_secs,
            decode_secs,
        };
        s.req.sink.done(Ok(ended));
        // The client has its answer; the slot's state (intact until `free`) goes to the prefix
        // cache: the prompt's own snapshot if the sequence ended with its first token, else the
        // state after the tokens fed so far.
        if let Some((tokens, logits)) = s.prompt_snap.take() {
            self.save(slot, tokens, Some(logits));
        } else if let Some(tokens) = fed_tokens {
            self.save(slot, tokens, None);
        }
        self.free(slot);
    }

    fn end_err(&mut self, slot: usize, e: anyhow::Error) {
        if let Some(mut s) = self.slots[slot].take() {
            self.free(slot);
            self.backend.reset(slot);
            s.req.sink.done(Err(e));
        }
    }
}

fn active(c: &Option<Constraint>) -> bool {
    c.as_ref().is_some_and(|c| c.is_active())
}

/// Makes `target` the clear winner of `logits` (argmax, and probability ≈ 1 when sampling).
pub fn force(logits: &mut [f32], target: u32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if let Some(l) = logits.get_mut(target as usize) {
        *l = max + 60.0;
    }
}
