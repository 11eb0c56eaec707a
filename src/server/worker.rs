//! The generation worker: one thread owns the session (CPU today, any `Session` backend later)
//! and runs one request at a time from a bounded queue. Each request streams its events back on
//! its own channel; when the client goes away the channel closes and the worker stops that
//! generation at the next token (or skips it if it is still queued).

use super::metrics::Metrics;
use super::prefix_cache::PrefixCache;
use crate::constrain::Constraint;
use crate::generate::{
    decode_with, FinishReason, Flow, GenerateOptions, Session, Snapshot, StopStrings, TokenLogprobs,
};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use anyhow::{bail, Result};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// Prefill granularity: the worker checks for a departed client between chunks. (The CPU
/// backend's prefill is split-invariant, so chunking does not change any logit.)
const PREFILL_CHUNK: usize = 512;

pub struct Job {
    pub prompt: Vec<u32>,
    /// Extra point (tokens) to snapshot for the prefix cache: the end of the conversation before
    /// the generation prompt, which the next turn of the same conversation starts with.
    pub boundary: Option<usize>,
    pub opts: GenerateOptions,
    pub stop: Vec<String>,
    /// Test hook: force this token sequence (then end-of-sequence) instead of the model's choice.
    pub script: Option<Vec<u32>>,
    /// Constrained decoding (`response_format`, a forced tool call).
    pub constraint: Option<Constraint>,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
    /// `METHOD /path` for the log line at the end of the generation (None: no log line).
    pub log: Option<&'static str>,
}

#[derive(Debug)]
pub enum Event {
    /// Text (after stop-string hold-back) and the log-probabilities of the tokens behind it.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprobs>,
    },
    Done(Summary),
    Error(String),
}

#[derive(Clone, Debug)]
pub struct Summary {
    /// `Stopped` = a stop string matched.
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

#[derive(Clone)]
pub struct Queue {
    tx: SyncSender<Job>,
    metrics: Arc<Metrics>,
}

pub enum SubmitError {
    Full,
    Closed,
}

impl Queue {
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.metrics.queue_depth.fetch_add(1, Relaxed);
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.metrics.queue_depth.fetch_sub(1, Relaxed);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::Full,
                    TrySendError::Disconnected(_) => SubmitError::Closed,
                })
            }
        }
    }
}

/// Starts the worker thread; `capacity` requests may wait while one runs.
pub fn start(
    session: Box<dyn Session + Send>,
    tok: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    capacity: usize,
    cache_bytes: usize,
) -> Result<Queue> {
    let (tx, rx) = sync_channel::<Job>(capacity);
    let m = metrics.clone();
    std::thread::Builder::new().name("lily-worker".into()).spawn(move || {
        let mut w =
            Worker { session, tok, metrics: m, cache: PrefixCache::new(cache_bytes), cache_budget_bytes: cache_bytes };
        w.run(rx);
    })?;
    Ok(Queue { tx, metrics })
}

struct Worker {
    session: Box<dyn Session + Send>,
    tok: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    cache: PrefixCache,
    cache_budget_bytes: usize,
}

impl Worker {
    fn run(&mut self, rx: Receiver<Job>) {
        for mut job in rx {
            self.metrics.queue_depth.fetch_sub(1, Relaxed);
            if job.events.is_closed() {
                self.metrics.cancelled.fetch_add(1, Relaxed);
                continue;
            }
            self.metrics.running.fetch_add(1, Relaxed);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.job(&mut job)));
            self.metrics.running.fetch_sub(1, Relaxed);
            let err = match r {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => format!("{e:#}"),
                Err(p) => {
                    // Whatever state the panic left behind is not trusted again.
                    self.session.reset();
                    self.cache = PrefixCache::new(self.cache_budget());
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    format!("internal error in generation: {msg}")
                }
            };
            eprintln!("lily serve: generation failed: {err}");
            let _ = job.events.send(Event::Error(err));
        }
    }

    fn cache_budget(&self) -> usize {
        self.cache_budget_bytes
    }

    fn save(&mut self, tokens: &[u32], logits: Option<&[f32]>) {
        if !self.cache.contains(tokens, logits.is_some()) {
            let snap: Snapshot = self.session.snapshot();
            self.cache.insert(tokens.to_vec(), snap, logits.map(<[f32]>::to_vec));
            self.metrics.cache_bytes.store(self.cache.bytes() as u64, Relaxed);
            self.metrics.cache_entries.store(self.cache.len() as u64, Relaxed);
        }
    }

    fn job(&mut self, job: &mut Job) -> Result<()> {
        let prompt = &job.prompt;
        if prompt.is_empty() {
            bail!("the prompt is empty");
        }
        let mut logits = Vec::new();
        let start = match self.cache.lookup(prompt) {
            Some(hit) => {
                self.session.restore(hit.snap)?;
                if let Some(l) = hit.logits {
                    logits = l.to_vec();
                }
                hit.len
            }
            None => {
                self.session.reset();
                0
            }
        };
        if self.session.pos() != start {
            bail!("session position {} after restoring a {start}-token prefix", self.session.pos());
        }
        let m = &self.metrics;
        if start > 0 {
            m.prefix_hits.fetch_add(1, Relaxed);
            m.cached_tokens.fetch_add(start as u64, Relaxed);
        } else {
            m.prefix_misses.fetch_add(1, Relaxed);
        }
        m.prompt_tokens.fetch_add(prompt.len() as u64, Relaxed);
        // Prefill in segments ending at the reusable points, saving a snapshot at each.
        let mut ends: Vec<usize> = job.boundary.into_iter().filter(|&b| b > start && b < prompt.len()).collect();
        ends.push(prompt.len());
        if start == prompt.len() {
            ends.clear(); // the whole prompt and its logits came from the cache
        }
        let t0 = Instant::now();
        let mut pos = start;
        for end in ends {
            // In chunks, so that a client who leaves during a long prefill frees the worker soon.
            while pos < end {
                let e = (pos + PREFILL_CHUNK).min(end);
                logits = self.session.forward_last(&prompt[pos..e])?;
                pos = e;
                if job.events.is_closed() {
                    self.metrics.cancelled.fetch_add(1, Relaxed);
                    return Ok(());
                }
            }
            let last = end == prompt.len();
            self.save(&prompt[..end], last.then_some(&logits[..]));
        }
        self.metrics.prefill(prompt.len() - start, t0.elapsed().as_secs_f64());

        let tok = self.tok.clone();
        let mut dec = StreamDecoder::new();
        let mut stops = StopStrings::new(&job.stop);
        let mut generated: Vec<u32> = Vec::new();
        let mut cancelled = false;
        let mut stop_hit = false;
        let mut first = true;
        let metrics = self.metrics.clone();
        let mut scripted;
        let session: &mut dyn Session = match &job.script {
            Some(script) => {
                let eos = job.opts.eos_ids.first().copied().unwrap_or(0);
                force(&mut logits, script.first().copied().unwrap_or(eos));
                scripted = Scripted { inner: self.session.as_mut(), script, eos, step: 0 };
                &mut scripted
            }
            None => self.session.as_mut(),
        };
        let t1 = Instant::now();
        let mut ttft = 0.0;
        let gen = decode_with(session, logits, &job.opts, job.constraint.as_mut(), |step| {
            if first {
                ttft = job.arrived.elapsed().as_secs_f64();
                metrics.ttft(ttft);
                first = false;
            }
            generated.push(step.token);
            let piece = dec.push(&tok, step.token)?;
            let (text, hit) = stops.push(&piece);
            let logprobs = step.logprobs.cloned().into_iter().collect();
            if job.events.send(Event::Delta { text, logprobs }).is_err() {
                cancelled = true;
                return Ok(Flow::Stop);
            }
            if hit {
                stop_hit = true;
                return Ok(Flow::Stop);
            }
            Ok(Flow::Continue)
        })?;
        let n = gen.tokens.len();
        let decode_secs = t1.elapsed().as_secs_f64();
        self.metrics.decode(n.saturating_sub(1), decode_secs);
        self.metrics.completion_tokens.fetch_add(n as u64, Relaxed);
        let log = |what: &str| {
            if let Some(endpoint) = job.log {
                tracing::info!(
                    "{endpoint} {what} | prompt {} tokens ({start} cached) | completion {n} tokens | ttft {:.0} ms | {:.1} tok/s | {:.2} s",
                    prompt.len(),
                    ttft * 1e3,
                    n.saturating_sub(1) as f64 / decode_secs.max(1e-9),
                    job.arrived.elapsed().as_secs_f64()
                );
            }
        };
        if cancelled {
            self.metrics.cancelled.fetch_add(1, Relaxed);
            log("cancelled (client gone)");
            return Ok(());
        }
        if !stop_hit {
            let rest = dec.flush(&tok)?;
            let (mut text, hit) = stops.push(&rest);
            stop_hit = hit;
            if !hit {
                text.push_str(&stops.finish());
            }
            if !text.is_empty() {
                let _ = job.events.send(Event::Delta { text, logprobs: Vec::new() });
            }
        }
        // The state after the prompt and the generated tokens fed back so far.
        let fed = self.session.pos();
        if fed > prompt.len() && job.script.is_none() {
            let mut all = prompt.clone();
            all.extend(&generated);
            if fed <= all.len() {
                self.save(&all[..fed], None);
            }
        }
        let finish = if stop_hit { FinishReason::Stopped } else { gen.finish };
        log(&format!(
            "200 finish {}",
            match finish {
                FinishReason::Eos | FinishReason::Stopped => "stop",
                FinishReason::Length => "length",
            }
        ));
        let _ = job.events.send(Event::Done(Summary {
            finish,
            prompt_tokens: prompt.len(),
            completion_tokens: n,
            cached_tokens: start,
        }));
        Ok(())
    }
}

/// Makes `target` the clear winner of `logits` (argmax, and probability ≈ 1 when sampling).
fn force(logits: &mut [f32], target: u32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if let Some(l) = logits.get_mut(target as usize) {
        *l = max + 60.0;
    }
}

/// Test hook (`LILY_TEST_SCRIPTS`): runs the real model but overrides its logits so that decode
/// produces a fixed token sequence and then end-of-sequence, to drive the reasoning and
/// tool-call parsers end to end with a random-weight model.
struct Scripted<'a> {
    inner: &'a mut (dyn Session + Send),
    script: &'a [u32],
    eos: u32,
    step: usize,
}

impl Session for Scripted<'_> {
    fn forward_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut l = self.inner.forward_last(tokens)?;
        self.step += 1;
        force(&mut l, self.script.get(self.step).copied().unwrap_or(self.eos));
        Ok(l)
    }
    fn forward_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.inner.forward_all(tokens)
    }
    fn pos(&self) -> usize {
        self.inner.pos()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_positions(&self) -> usize {
        self.inner.max_positions()
    }
    fn snapshot(&self) -> Snapshot {
        self.inner.snapshot()
    }
    fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        self.inner.restore(snap)
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
}
