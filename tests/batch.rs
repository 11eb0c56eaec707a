//! Continuous batching on the CPU: a sequence in a batch equals the same sequence alone.
//!
//! Backend level (`CpuBatch::step`): sequences of different lengths prefilled in one pass, a
//! sequence joining while others decode (a prompt and decode tokens in the same pass), one
//! leaving early; logits against a lone `CpuSession` within a bound, tokens identical.
//! Scheduler level: requests with different sampling parameters, seeds, penalties and logprobs,
//! more requests than slots (they wait and join mid-batch), prompts chunked over several steps,
//! a client leaving mid-answer and a KV budget that admits one request at a time; each
//! request's tokens equal `generate` on a lone session.

mod common;
use common::*;
use lily::engine::batch::{Batched, CpuBatch, Out, SerialBatch, Work};
use lily::engine::metrics::Metrics;
use lily::engine::picker::Want;
use lily::engine::scheduler::{Ended, Limits, Request, Scheduler, Sink};
use lily::generate::{generate, CpuSession, FinishReason, Flow, GenerateOptions, Session, Step, TokenLogprobs};
use lily::model::Model;
use lily::sampling::SamplingParams;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

fn model(dir: &str) -> Arc<Model> {
    Arc::new(lily::weights::load_model(&fixtures().join(dir)).unwrap())
}

fn prompt(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = rng(seed);
    (0..n).map(|_| (r.next_u64() % vocab as u64) as u32).collect()
}

/// Bound on |Δlogit| / (row range) between a batched pass and the lone pass. Both are fp32 with
/// the same weights; only the products' summation order differs (a lone decode token takes the
/// matrix-vector kernel, a batch the tiled matrix-matrix one): measured a few 1e-7 here.
const BATCH_TOL: f32 = 1e-5;

fn rel(got: &[f32], want: &[f32]) -> f32 {
    let (lo, hi) = want.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    max_abs_diff(got, want) / (hi - lo).max(1e-30)
}

fn logits(o: Out) -> Vec<f32> {
    match o {
        Out::Logits(l) => l,
        Out::Token(t) => panic!("asked for logits, got token {t}"),
    }
}

/// Greedy logits of a lone session: after the prompt, then after each of `n` greedy tokens.
fn alone(m: &Arc<Model>, p: &[u32], n: usize) -> Vec<Vec<f32>> {
    let mut s = CpuSession::new(m.clone());
    let mut out = vec![s.forward_last(p).unwrap()];
    for _ in 0..n {
        let t = lily::sampling::argmax(out.last().unwrap());
        out.push(s.forward_last(&[t]).unwrap());
    }
    out
}

#[test]
fn batched_steps_equal_each_sequence_alone() {
    for dir in ["tiny-hf", "tiny-mlx4"] {
        let m = model(dir);
        let v = m.cfg.vocab_size;
        let prompts = [prompt(1, 5, v), prompt(2, 17, v), prompt(3, 33, v)];
        let want: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| alone(&m, p, 10)).collect();
        let mut b = CpuBatch::new(m.clone(), 4);
        let greedy = SamplingParams::default();
        // Slots 3, 0 and 2 (not in order); sequence 2 joins at step 4, sequence 0 leaves after 6.
        let slot = [3usize, 0, 2];
        let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
        let mut next: Vec<Option<u32>> = vec![None; 3];
        let mut worst = 0f32;
        for step in 0..16 {
            let mut items: Vec<(usize, Vec<u32>)> = Vec::new();
            for i in 0..3 {
                let joined = if i == 2 { step >= 4 } else { true };
                if !joined || got[i].len() > 10 || (i == 0 && got[i].len() > 6) {
                    continue;
                }
                let toks = match next[i] {
                    Some(t) => vec![t],
                    None => prompts[i].clone(),
                };
                items.push((i, toks));
            }
            if items.is_empty() {
                break;
            }
            let work: Vec<Work> = items
                .iter()
                .map(|(i, t)| Work { slot: slot[*i], tokens: t, want: Want::Logits, sampling: &greedy })
                .collect();
            let outs = b.step(&work).unwrap();
            for ((i, _), o) in items.iter().zip(outs) {
                let l = logits(o);
                let k = got[*i].len();
                let e = rel(&l, &want[*i][k]);
                worst = worst.max(e);
                assert!(e <= BATCH_TOL, "{dir} seq {i} step {k}: {e:.2e} of the range");
                let t = lily::sampling::argmax(&l);
                assert_eq!(t, lily::sampling::argmax(&want[*i][k]), "{dir} seq {i} step {k}: greedy token");
                next[*i] = Some(t);
                got[*i].push(l);
            }
        }
        assert_eq!(got.iter().map(|g| g.len()).collect::<Vec<_>>(), [7, 11, 11], "{dir}: steps per sequence");
        assert_eq!(b.pos(3), 5 + 6);
        eprintln!("{dir}: worst batched-vs-alone difference {worst:.2e} of the logit range");
    }
}

#[test]
fn the_serial_backend_equals_the_batched_one() {
    let m = model("tiny-mlx4");
    let v = m.cfg.vocab_size;
    let (p0, p1) = (prompt(4, 9, v), prompt(5, 3, v));
    let greedy = SamplingParams::default();
    let sampled = SamplingParams { temperature: 0.9, top_p: 0.95, ..Default::default() };
    let mut a = CpuBatch::new(m.clone(), 2);
    let mut s = SerialBatch::cpu(m.clone(), 2);
    for step in 0..4 {
        let w = [
            Work { slot: 0, tokens: &p0[..], want: Want::Greedy, sampling: &greedy },
            Work { slot: 1, tokens: &p1[..], want: Want::Sample(step), sampling: &sampled },
        ];
        let (x, y) = (a.step(&w).unwrap(), s.step(&w).unwrap());
        for (x, y) in x.iter().zip(&y) {
            match (x, y) {
                (Out::Token(x), Out::Token(y)) => assert_eq!(x, y, "step {step}"),
                other => panic!("asked for tokens, got {other:?}"),
            }
        }
    }
    assert_eq!((a.pos(0), s.pos(0), a.pos(1), s.pos(1)), (36, 36, 12, 12));
}

#[test]
fn bad_steps_are_refused_with_the_reason() {
    let m = model("tiny-mlx4");
    let mut b = CpuBatch::new(m.clone(), 2);
    let g = SamplingParams::default();
    let w = |slot, tokens| Work { slot, tokens, want: Want::Logits, sampling: &g };
    let err = |w: &[Work], b: &mut CpuBatch| b.step(w).unwrap_err().to_string();
    assert!(err(&[w(0, &[1]), w(0, &[2])], &mut b).contains("twice"));
    assert!(err(&[w(2, &[1])], &mut b).contains("out of range"));
    assert!(err(&[w(0, &[])], &mut b).contains("no input tokens"));
    let big = m.cfg.vocab_size as u32;
    assert!(err(&[w(1, &[big])], &mut b).contains("vocab_size"));
    // Nothing was applied by the refused steps.
    assert_eq!((b.pos(0), b.pos(1)), (0, 0));
}

/// Each request's end (None: its client left).
type Ends = Vec<Option<Result<Ended, String>>>;

/// Collects one request's tokens and end; `leave_after` makes the client go after that many.
struct Collect {
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
    leave_after: Option<usize>,
    out: Arc<Mutex<Ends>>,
    idx: usize,
    running_seen: Arc<Mutex<usize>>,
    metrics: Arc<Metrics>,
}

impl Sink for Collect {
    fn token(&mut self, step: &Step) -> Flow {
        self.tokens.push(step.token);
        self.logprobs.extend(step.logprobs.cloned());
        let r = self.metrics.running.load(Relaxed) as usize;
        let mut m = self.running_seen.lock().unwrap();
        *m = (*m).max(r);
        Flow::Continue
    }
    fn gone(&self) -> bool {
        self.leave_after.is_some_and(|n| self.tokens.len() >= n)
    }
    fn done(&mut self, end: anyhow::Result<Ended>) {
        let end = end.map_err(|e| format!("{e:#}"));
        if let Ok(e) = &end {
            assert_eq!(e.tokens, self.tokens, "the summary lists the streamed tokens");
        }
        self.out.lock().unwrap()[self.idx] = Some(end);
    }
}

struct Case {
    prompt: Vec<u32>,
    opts: GenerateOptions,
    leave_after: Option<usize>,
}

/// Runs `cases` through a scheduler and returns each one's end (None: the client left).
fn schedule(m: &Arc<Model>, slots: usize, limits: Limits, cases: &[Case]) -> (Ends, usize, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::default());
    let mut s = Scheduler::new(Box::new(CpuBatch::new(m.clone(), slots)), limits, metrics.clone());
    let out = Arc::new(Mutex::new(vec![None; cases.len()]));
    let seen = Arc::new(Mutex::new(0));
    for (idx, c) in cases.iter().enumerate() {
        metrics.queue_depth.fetch_add(1, Relaxed);
        s.submit(Request {
            prompt: c.prompt.clone(),
            boundary: None,
            opts: c.opts.clone(),
            constraint: None,
            script: None,
            sink: Box::new(Collect {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                leave_after: c.leave_after,
                out: out.clone(),
                idx,
                running_seen: seen.clone(),
                metrics: metrics.clone(),
            }),
        });
    }
    let mut steps = 0;
    while !s.idle() {
        assert!(s.step() || s.idle(), "the scheduler stalled with work left");
        steps += 1;
        assert!(steps < 10_000, "the scheduler does not finish");
    }
    assert_eq!(metrics.queue_depth.load(Relaxed), 0);
    assert_eq!(metrics.running.load(Relaxed), 0);
    assert_eq!(metrics.kv_pages_used.load(Relaxed), 0);
    let r = out.lock().unwrap().clone();
    let seen = *seen.lock().unwrap();
    (r, seen, metrics)
}

fn limits(max_prefill_tokens: usize, kv_budget_tokens: usize) -> Limits {
    Limits { max_prefill_tokens, kv_budget_tokens, page_tokens: 16, prefix_cache_bytes: 0 }
}

fn opts(max_tokens: usize, temperature: f32, seed: u64) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling: SamplingParams { temperature, top_k: 40, top_p: 0.9, min_p: 0.0, seed },
        ..Default::default()
    }
}

#[test]
fn scheduled_requests_get_what_they_would_get_alone() {
    let m = model("tiny-mlx4");
    let v = m.cfg.vocab_size;
    let mut cases: Vec<Case> = Vec::new();
    for i in 0..7u64 {
        let mut o = opts(6 + 3 * i as usize, if i % 2 == 0 { 0.0 } else { 0.8 }, 100 + i);
        if i == 3 {
            o.presence_penalty = 0.7;
            o.logprobs = Some(2);
        }
        if i == 5 {
            o.repetition_penalty = Some(1.3);
            o.frequency_penalty = 0.4;
        }
        cases.push(Case { prompt: prompt(10 + i, 3 + 7 * i as usize, v), opts: o, leave_after: None });
    }
    cases[6].opts.eos_ids = vec![cases[6].prompt[0]]; // may end early on its own
                                                      // 3 slots for 7 requests (the rest wait and join mid-batch); 8 prompt tokens per step, so
                                                      // the longer prompts are prefilled over several steps while others decode.
    let (ends, max_running, metrics) = schedule(&m, 3, limits(8, 1 << 20), &cases);
    assert_eq!(max_running, 3, "three sequences ran at once");
    for (i, (c, end)) in cases.iter().zip(&ends).enumerate() {
        let end = end.clone().expect("finished").unwrap_or_else(|e| panic!("request {i}: {e}"));
        let mut s = CpuSession::new(m.clone());
        let want = generate(&mut s, &c.prompt, &c.opts, |_| Ok(Flow::Continue)).unwrap();
        assert_eq!(end.tokens, want.tokens, "request {i}: tokens in the batch vs alone");
        assert_eq!(end.finish, want.finish, "request {i}");
        assert_eq!(end.prompt_tokens, c.prompt.len());
    }
    let s = metrics.render();
    assert!(s.contains("lily_batch_size_bucket{le=\"4\"}"), "{s}");
    assert!(!s.contains("lily_batch_size_bucket{le=\"2\"} 0\n") || s.contains("lily_batch_size_count 0"));
}

#[test]
fn a_departing_client_frees_its_slot_and_leaves_the_others_alone() {
    let m = model("tiny-mlx4");
    let v = m.cfg.vocab_size;
    let cases: Vec<Case> = (0..4u64)
        .map(|i| Case {
            prompt: prompt(30 + i, 4 + 5 * i as usize, v),
            opts: opts(12, 0.7, i),
            leave_after: (i == 1).then_some(3),
        })
        .collect();
    let (ends, _, metrics) = schedule(&m, 2, limits(64, 1 << 20), &cases);
    assert!(ends[1].is_none(), "the departed client gets no end");
    assert_eq!(metrics.cancelled.load(Relaxed), 1);
    for i in [0, 2, 3] {
        let end = ends[i].clone().unwrap().unwrap();
        let mut s = CpuSession::new(m.clone());
        let want = generate(&mut s, &cases[i].prompt, &cases[i].opts, |_| Ok(Flow::Continue)).unwrap();
        assert_eq!(end.tokens, want.tokens, "request {i}");
    }
}

#[test]
fn a_small_kv_budget_queues_requests_and_refuses_impossible_ones() {
    let m = model("tiny-mlx4");
    let v = m.cfg.vocab_size;
    // 64 positions: each request below reserves 20 + 24 = 44 (3 pages of 16 = 48), so only one
    // fits at a time although there are 4 slots; the last asks for more than the whole budget.
    let mut cases: Vec<Case> =
        (0..3u64).map(|i| Case { prompt: prompt(40 + i, 20, v), opts: opts(24, 0.0, 0), leave_after: None }).collect();
    cases.push(Case { prompt: prompt(50, 20, v), opts: opts(60, 0.0, 0), leave_after: None });
    let (ends, max_running, _) = schedule(&m, 4, limits(512, 64), &cases);
    assert_eq!(max_running, 1, "one request at a time fits the budget");
    for (i, end) in ends.iter().enumerate().take(3) {
        let end = end.clone().unwrap().unwrap();
        let mut s = CpuSession::new(m.clone());
        let want = generate(&mut s, &cases[i].prompt, &cases[i].opts, |_| Ok(Flow::Continue)).unwrap();
        assert_eq!(end.tokens, want.tokens, "request {i}");
        assert_eq!(end.finish, FinishReason::Length);
    }
    let e = ends[3].clone().unwrap().unwrap_err();
    assert!(e.contains("80 tokens") && e.contains("64 tokens"), "{e}");
}

/// The prompt's prefix-cache snapshot is taken after the first token goes out, and still when
/// that token ends the request: a repeat of either prompt resumes from the whole prompt
/// (cached tokens = its length) and gets what it would alone.
#[test]
fn a_repeated_prompt_resumes_from_the_snapshot_after_its_first_token() {
    let m = model("tiny-mlx4");
    let v = m.cfg.vocab_size;
    let (p1, p2) = (prompt(41, 9, v), prompt(42, 13, v));
    let cases = vec![
        Case { prompt: p1.clone(), opts: opts(1, 0.0, 1), leave_after: None }, // ends with its first token
        Case { prompt: p1.clone(), opts: opts(4, 0.0, 2), leave_after: None },
        Case { prompt: p2.clone(), opts: opts(5, 0.8, 3), leave_after: None }, // goes on after it
        Case { prompt: p2.clone(), opts: opts(5, 0.8, 3), leave_after: None },
    ];
    let mut l = limits(64, 1 << 20);
    l.prefix_cache_bytes = 64 << 20;
    // One slot: each request starts after the previous one ended.
    let (ends, _, _) = schedule(&m, 1, l, &cases);
    for (i, (c, end)) in cases.iter().zip(&ends).enumerate() {
        let end = end.clone().expect("finished").unwrap_or_else(|e| panic!("request {i}: {e}"));
        let want_cached = if i % 2 == 1 { c.prompt.len() } else { 0 };
        assert_eq!(end.cached_tokens, want_cached, "request {i}: prompt tokens from the cache");
        let mut s = CpuSession::new(m.clone());
        let want = generate(&mut s, &c.prompt, &c.opts, |_| Ok(Flow::Continue)).unwrap();
        assert_eq!(end.tokens, want.tokens, "request {i}: tokens with the cache vs alone");
    }
}
