//! The generation worker: one thread owns the engine's [`Scheduler`] and feeds it requests
//! from a bounded queue. Running requests share each forward pass (continuous batching, up to the
//! backend's slots); each streams its events back on its own channel, and when the client goes
//! away the channel closes and the scheduler drops that sequence at the next step (or skips it
//! if it is still queued).

use crate::constrain::Constraint;
use crate::engine::batch::Batched;
use crate::engine::metrics::Metrics;
use crate::engine::scheduler::{Ended, Limits, Request, Scheduler, Sink};
use crate::generate::{FinishReason, Flow, GenerateOptions, Step, StopStrings, TokenLogprobs};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use anyhow::Result;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

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

/// Starts the worker thread over `backend`; `capacity` requests may wait in the queue while
/// the backend's slots are busy.
pub fn start(
    backend: Box<dyn Batched>,
    limits: Limits,
    tok: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    capacity: usize,
) -> Result<Queue> {
    let (tx, rx) = sync_channel::<Job>(capacity);
    let m = metrics.clone();
    std::thread::Builder::new().name("lily-worker".into()).spawn(move || {
        let sched = Scheduler::new(backend, limits, m.clone());
        run(sched, rx, tok, m);
    })?;
    Ok(Queue { tx, metrics })
}

fn run(mut sched: Scheduler, rx: Receiver<Job>, tok: Arc<Tokenizer>, metrics: Arc<Metrics>) {
    let sink = |job: Job| Request {
        prompt: job.prompt,
        boundary: job.boundary,
        opts: job.opts,
        constraint: job.constraint,
        script: job.script,
        sink: Box::new(StreamSink {
            tok: tok.clone(),
            metrics: metrics.clone(),
            dec: StreamDecoder::new(),
            stops: StopStrings::new(&job.stop),
            events: job.events,
            arrived: job.arrived,
            log: job.log,
            first: None,
            stop_hit: false,
            cancelled: false,
        }),
    };
    loop {
        // Pull requests while the scheduler has no backlog of its own, so that the bounded
        // channel stays the queue (full: 503).
        if sched.idle() {
            match rx.recv() {
                Ok(job) => sched.submit(sink(job)),
                Err(_) => return,
            }
        }
        while sched.waiting() == 0 {
            match rx.try_recv() {
                Ok(job) => sched.submit(sink(job)),
                Err(_) => break,
            }
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sched.step()));
        match r {
            Ok(true) => {}
            Ok(false) => {
                // Nothing could run (requests waiting for pages that running ones hold cannot
                // happen, but do not spin): wait for a request or a moment.
                match rx.recv_timeout(Duration::from_millis(5)) {
                    Ok(job) => sched.submit(sink(job)),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) if sched.idle() => return,
                    Err(RecvTimeoutError::Disconnected) => {}
                }
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                // Whatever state the panic left behind is not trusted again.
                sched.fail_all(&format!("internal error in generation: {msg}"));
            }
        }
    }
}

/// One request's stream: detokenizes, holds back text that may start a stop string, sends
/// deltas, and the summary (or the error) at the end.
struct StreamSink {
    tok: Arc<Tokenizer>,
    metrics: Arc<Metrics>,
    dec: StreamDecoder,
    stops: StopStrings,
    events: UnboundedSender<Event>,
    arrived: Instant,
    log: Option<&'static str>,
    /// Time to the first token.
    first: Option<f64>,
    stop_hit: bool,
    cancelled: bool,
}

impl Sink for StreamSink {
    fn token(&mut self, step: &Step) -> Flow {
        if self.first.is_none() {
            let ttft = self.arrived.elapsed().as_secs_f64();
            self.metrics.ttft(ttft);
            self.first = Some(ttft);
        }
        let piece = match self.dec.push(&self.tok, step.token) {
            Ok(p) => p,
            Err(e) => {
                let _ = self.events.send(Event::Error(format!("{e:#}")));
                self.cancelled = true;
                return Flow::Stop;
            }
        };
        let (text, hit) = self.stops.push(&piece);
        let logprobs = step.logprobs.cloned().into_iter().collect();
        if self.events.send(Event::Delta { text, logprobs }).is_err() {
            self.cancelled = true;
            return Flow::Stop;
        }
        if hit {
            self.stop_hit = true;
            return Flow::Stop;
        }
        Flow::Continue
    }

    fn gone(&self) -> bool {
        self.events.is_closed()
    }

    fn done(&mut self, end: Result<Ended>) {
        let e = match end {
            Ok(e) => e,
            Err(err) => {
                let err = format!("{err:#}");
                eprintln!("lily serve: generation failed: {err}");
                let _ = self.events.send(Event::Error(err));
                return;
            }
        };
        let n = e.tokens.len();
        let log = |what: &str| {
            if let Some(endpoint) = self.log {
                tracing::info!(
                    "{endpoint} {what} | prompt {} tokens ({} cached) | completion {n} tokens | ttft {:.0} ms | {:.1} tok/s | {:.2} s",
                    e.prompt_tokens,
                    e.cached_tokens,
                    self.first.unwrap_or(0.0) * 1e3,
                    n.saturating_sub(1) as f64 / e.decode_secs.max(1e-9),
                    self.arrived.elapsed().as_secs_f64()
                );
            }
        };
        if self.cancelled {
            self.metrics.cancelled.fetch_add(1, Relaxed);
            log("cancelled (client gone)");
            return;
        }
        if !self.stop_hit {
            let rest = match self.dec.flush(&self.tok) {
                Ok(r) => r,
                Err(err) => {
                    let _ = self.events.send(Event::Error(format!("{err:#}")));
                    return;
                }
            };
            let (mut text, hit) = self.stops.push(&rest);
            self.stop_hit = hit;
            if !hit {
                text.push_str(&self.stops.finish());
            }
            if !text.is_empty() {
                let _ = self.events.send(Event::Delta { text, logprobs: Vec::new() });
            }
        }
        let finish = if self.stop_hit { FinishReason::Stopped } else { e.finish };
        log(&format!(
            "200 finish {}",
            match finish {
                FinishReason::Eos | FinishReason::Stopped => "stop",
                FinishReason::Length => "length",
            }
        ));
        let _ = self.events.send(Event::Done(Summary {
            finish,
            prompt_tokens: e.prompt_tokens,
            completion_tokens: n,
            cached_tokens: e.cached_tokens,
        }));
    }
}
