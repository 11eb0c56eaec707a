//! The generation loop over a backend session: prefill the prompt, then sample and decode until
//! an end-of-sequence token, a stop condition or the token budget.

use crate::constrain::Constraint;
use crate::engine::picker::{Picker, Want};
use crate::model::{Logits, Model};
use crate::sampling::{Sampler, SamplingParams};
use crate::state::State;
use anyhow::{bail, Context, Result};
use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

/// A saved copy of a session's caches (KV, GDN conv and recurrent state) at one position, to be
/// restored into a session of the same backend and model. The recurrent state cannot be rolled
/// back, so a snapshot is the only way to resume from an earlier point.
pub struct Snapshot {
    /// Tokens the session had processed when the snapshot was taken.
    pub pos: usize,
    /// Bytes held (for cache budgets).
    pub nbytes: usize,
    /// The backend's own state type.
    pub data: Box<dyn Any + Send + Sync>,
}

/// One sequence on one backend: owns the caches and the current position.
pub trait Session {
    /// Appends `tokens` and returns the logits after the last one (`[V]`).
    fn forward_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Appends `tokens` and returns logits after every one (`[T, V]`).
    fn forward_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Greedy decode of `n` tokens: feeds `first`, then each produced token; returns the `n`
    /// produced tokens (the last one not yet fed). The CUDA session keeps the whole loop on the
    /// device; this default goes through [`Session::forward_last`] and a host argmax.
    fn greedy_steps(&mut self, first: u32, n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        let mut next = first;
        for _ in 0..n {
            next = crate::sampling::argmax(&self.forward_last(&[next])?);
            out.push(next);
        }
        Ok(out)
    }
    /// Like [`Session::greedy_steps`], each token drawn from the filtered distribution of
    /// `p` (temperature > 0) with randomness from `seed` alone: a seed gives the same tokens on
    /// every run. The CUDA session draws on the device (kernels/sampling.cu); this default uses
    /// the host [`Sampler`] seeded with `seed`.
    fn sampled_steps(&mut self, first: u32, n: usize, p: &SamplingParams, seed: u64) -> Result<Vec<u32>> {
        let mut sampler = Sampler::new(SamplingParams { seed, ..p.clone() });
        let mut out = Vec::with_capacity(n);
        let mut next = first;
        for _ in 0..n {
            next = sampler.sample(&self.forward_last(&[next])?);
            out.push(next);
        }
        Ok(out)
    }
    /// Tokens processed so far.
    fn pos(&self) -> usize;
    fn vocab_size(&self) -> usize;
    fn max_positions(&self) -> usize;
    /// Copies the caches at the current position.
    fn snapshot(&self) -> Snapshot;
    /// Replaces the caches with a snapshot taken from a session of the same backend and model.
    fn restore(&mut self, snap: &Snapshot) -> Result<()>;
    /// Drops everything: back to position 0.
    fn reset(&mut self);
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
    fn snapshot(&self) -> Snapshot {
        Snapshot { pos: self.state.pos, nbytes: self.state.nbytes(), data: Box::new(self.state.clone()) }
    }
    fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        let state = snap.data.downcast_ref::<State>().context("snapshot is not from a CPU session")?;
        if state.layers.len() != self.state.layers.len() {
            bail!("snapshot is from a different model");
        }
        self.state = state.clone();
        Ok(())
    }
    fn reset(&mut self) {
        self.state = self.model.new_state();
    }
}

#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub eos_ids: Vec<u32>,
    /// OpenAI presence penalty: subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted per occurrence in the generated tokens.
    pub frequency_penalty: f32,
    /// vLLM's repetition penalty (None or 1: off): the logit of every token seen in
    /// `penalty_prompt` or generated so far is divided by it when positive, multiplied when not.
    pub repetition_penalty: Option<f32>,
    /// The prompt tokens the repetition penalty counts (the caller's prompt).
    pub penalty_prompt: Vec<u32>,
    /// Report the log-probability of each sampled token and this many top alternatives.
    pub logprobs: Option<usize>,
}

/// Log-probabilities under the model (log-softmax of the raw logits, before penalties and
/// temperature) of a sampled token and of the most likely tokens at that step.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// Best first.
    pub top: Vec<(u32, f32)>,
}

/// One generated token as the callback sees it.
pub struct Step<'a> {
    pub token: u32,
    pub logprobs: Option<&'a TokenLogprobs>,
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
    let t0 = Instant::now();
    let logits = session.forward_last(prompt)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let mut gen = decode(session, logits, opts, |s| on_token(s.token))?;
    gen.prompt_tokens = prompt.len();
    gen.prefill_secs = prefill_secs;
    Ok(gen)
}

/// The decode loop from the logits after an already prefilled prompt: samples (with penalties),
/// reports each token (EOS excluded) and feeds it back, until EOS, `max_tokens`, the session's
/// context limit or the callback says stop. `prompt_tokens`/`prefill_secs` are left 0.
pub fn decode(
    session: &mut dyn Session,
    logits: Vec<f32>,
    opts: &GenerateOptions,
    on_step: impl FnMut(&Step) -> Result<Flow>,
) -> Result<Generation> {
    decode_with(session, logits, opts, None, on_step)
}

/// [`decode`] under a grammar: while the constraint is active every token outside its mask is
/// excluded before sampling (the logits come to the host), and the answer ends when the grammar
/// is complete. The next mask is computed on a second thread during the forward pass.
pub fn decode_with(
    session: &mut dyn Session,
    mut logits: Vec<f32>,
    opts: &GenerateOptions,
    mut constraint: Option<&mut Constraint>,
    mut on_step: impl FnMut(&Step) -> Result<Flow>,
) -> Result<Generation> {
    let limit = session.max_positions();
    let mut picker = Picker::new(opts, constraint.is_some())?;
    let t1 = Instant::now();
    let mut tokens = Vec::new();
    let mut finish = FinishReason::Length;
    let mut eos_token = None;
    // A token the session already picked (see [`Picker::want`]); the first one, from the
    // prompt's logits, is picked here.
    let mut picked: Option<u32> = None;
    // The mask for the coming token, computed during the forward pass that produced its logits.
    let mut next_mask = None;
    while tokens.len() < opts.max_tokens {
        let (next, info) = match picked.take() {
            Some(t) => (t, None),
            None => {
                let mask = match constraint.as_deref_mut().filter(|c| c.is_active()) {
                    Some(c) => Some(match next_mask.take() {
                        Some(m) => m,
                        None => c.mask()?,
                    }),
                    None => None,
                };
                picker.pick(&mut logits, mask.as_ref())?
            }
        };
        if opts.eos_ids.contains(&next) {
            finish = FinishReason::Eos;
            eos_token = Some(next);
            break;
        }
        tokens.push(next);
        picker.accept(next);
        if let Flow::Stop = on_step(&Step { token: next, logprobs: info.as_ref() })? {
            finish = FinishReason::Stopped;
            break;
        }
        if let Some(c) = constraint.as_deref_mut() {
            c.observe(next)?;
            if c.finished() {
                finish = FinishReason::Eos;
                break;
            }
        }
        if tokens.len() == opts.max_tokens {
            break;
        }
        if session.pos() + 1 > limit {
            break;
        }
        match picker.want() {
            Want::Greedy => picked = Some(session.greedy_steps(next, 1)?[0]),
            Want::Sample(seed) => picked = Some(session.sampled_steps(next, 1, &opts.sampling, seed)?[0]),
            Want::Logits => match constraint.as_deref_mut().filter(|c| c.is_active()) {
                Some(c) => {
                    let (l, m) = std::thread::scope(|s| {
                        let mask = s.spawn(|| c.mask());
                        let l = session.forward_last(&[next]);
                        (l, mask.join())
                    });
                    logits = l?;
                    next_mask =
                        Some(m.map_err(|_| anyhow::anyhow!("constrained decoding: the mask thread panicked"))??);
                }
                None => logits = session.forward_last(&[next])?,
            },
        }
    }
    Ok(Generation {
        tokens,
        finish,
        eos_token,
        prompt_tokens: 0,
        prefill_secs: 0.0,
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}

/// The `k` largest entries as (index, value), largest first (ties: lower index first).
pub fn top_k_of(v: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<(u32, f32)> = v.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    let by =
        |a: &(u32, f32), b: &(u32, f32)| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0));
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by);
        idx.truncate(k);
    }
    idx.sort_by(by);
    idx
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `patterns` (and starts
/// on a character boundary): the part a streamer must hold back because a pattern may be starting.
pub fn partial_suffix_len(text: &str, patterns: &[impl AsRef<str>]) -> usize {
    let mut best = 0;
    for p in patterns {
        let p = p.as_ref();
        for n in (1..p.len().min(text.len() + 1)).rev() {
            let start = text.len() - n;
            if n <= best || !text.is_char_boundary(start) {
                continue;
            }
            if p.as_bytes().starts_with(&text.as_bytes()[start..]) {
                best = n;
                break;
            }
        }
    }
    best
}

/// Stop strings over streamed text: text that may be the start of a stop string is held back, so
/// a partial stop string is never emitted; the stop string itself and anything after it are dropped.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopStrings {
    /// Empty stop strings are ignored.
    pub fn new(stops: &[String]) -> StopStrings {
        StopStrings { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), ..Default::default() }
    }

    /// Adds generated text; returns what can be emitted now and whether a stop string was found.
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.pending.push_str(piece);
        let hit = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min();
        if let Some(i) = hit {
            let out = self.pending[..i].to_string();
            self.pending.clear();
            self.stopped = true;
            return (out, true);
        }
        let keep = partial_suffix_len(&self.pending, &self.stops);
        let out = self.pending[..self.pending.len() - keep].to_string();
        self.pending.drain(..self.pending.len() - keep);
        (out, false)
    }

    /// The held-back text once generation ended without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopStrings::new(&stops);
        let mut out = Vec::new();
        let mut hit = false;
        for p in pieces {
            let (o, h) = s.push(p);
            out.push(o);
            if h {
                hit = true;
                break;
            }
        }
        let rest = if hit { String::new() } else { s.finish() };
        (out, hit, rest)
    }

    #[test]
    fn stop_string_split_across_pieces_is_never_emitted() {
        let (out, hit, _) = run(&["STOP"], &["abc S", "TO", "P tail"]);
        assert!(hit);
        assert_eq!(out, vec!["abc ", "", ""]);
    }

    #[test]
    fn partial_match_that_diverges_is_released() {
        let (out, hit, rest) = run(&["STOP"], &["ST", "Ox", "y"]);
        assert!(!hit);
        assert_eq!(out.concat() + &rest, "STOxy");
        assert_eq!(out, vec!["", "STOx", "y"]);
    }

    #[test]
    fn earliest_of_several_stops_wins_and_held_text_is_flushed() {
        let (out, hit, _) = run(&["world", "lo w"], &["hello world"]);
        assert!(hit);
        assert_eq!(out, vec!["hel"]);
        let (out, hit, rest) = run(&["xyz"], &["abcx"]);
        assert!(!hit);
        assert_eq!((out.concat(), rest), ("abc".to_string(), "x".to_string()));
    }

    #[test]
    fn partial_suffix_respects_char_boundaries() {
        assert_eq!(partial_suffix_len("aé", &["é!"]), 2);
        assert_eq!(partial_suffix_len("abc", &["abc"]), 0, "a full match is not partial");
        assert_eq!(partial_suffix_len("xx<tool", &["<tool_call>", "<think>"]), 5);
        assert_eq!(partial_suffix_len("", &["a"]), 0);
    }

    /// Logits that always favour `next[pos % len]`, with a clear margin.
    struct Fake {
        pos: usize,
        next: Vec<u32>,
        vocab: usize,
    }

    impl Session for Fake {
        fn forward_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
            self.pos += tokens.len();
            let mut l = vec![0.0; self.vocab];
            l[self.next[self.pos % self.next.len()] as usize] = 5.0;
            l[1] = 4.0;
            Ok(l)
        }
        fn forward_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
            self.forward_last(tokens)
        }
        fn pos(&self) -> usize {
            self.pos
        }
        fn vocab_size(&self) -> usize {
            self.vocab
        }
        fn max_positions(&self) -> usize {
            100
        }
        fn snapshot(&self) -> Snapshot {
            Snapshot { pos: self.pos, nbytes: 8, data: Box::new(self.pos) }
        }
        fn restore(&mut self, snap: &Snapshot) -> Result<()> {
            self.pos = *snap.data.downcast_ref::<usize>().context("not mine")?;
            Ok(())
        }
        fn reset(&mut self) {
            self.pos = 0;
        }
    }

    #[test]
    fn decode_reports_logprobs_and_applies_penalties() {
        let mut s = Fake { pos: 0, next: vec![2], vocab: 4 };
        let opts = GenerateOptions { max_tokens: 3, logprobs: Some(2), ..Default::default() };
        let logits = s.forward_last(&[0]).unwrap();
        let mut seen = Vec::new();
        let g = decode(&mut s, logits, &opts, |st| {
            seen.push(st.logprobs.cloned().unwrap());
            Ok(Flow::Continue)
        })
        .unwrap();
        assert_eq!(g.tokens, vec![2, 2, 2]);
        assert_eq!(g.finish, FinishReason::Length);
        assert_eq!(seen[0].top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!((seen[0].logprob - seen[0].top[0].1).abs() < 1e-6 && seen[0].logprob < 0.0);
        // A presence penalty of 2 makes token 1 win once 2 has been generated.
        let mut s = Fake { pos: 0, next: vec![2], vocab: 4 };
        let opts = GenerateOptions { max_tokens: 3, presence_penalty: 2.0, ..Default::default() };
        let logits = s.forward_last(&[0]).unwrap();
        let g = decode(&mut s, logits, &opts, |_| Ok(Flow::Continue)).unwrap();
        assert_eq!(g.tokens, vec![2, 1, 2]);
        // vLLM's repetition penalty counts the prompt: 2 (in the prompt) drops to 5/1.5 < 4, so
        // 1 comes first; once both are seen 2 leads again.
        let mut s = Fake { pos: 0, next: vec![2], vocab: 4 };
        let opts = GenerateOptions {
            max_tokens: 3,
            repetition_penalty: Some(1.5),
            penalty_prompt: vec![0, 2],
            ..Default::default()
        };
        let logits = s.forward_last(&[0, 2]).unwrap();
        let g = decode(&mut s, logits, &opts, |_| Ok(Flow::Continue)).unwrap();
        assert_eq!(g.tokens, vec![1, 2, 2]);
        let mut l = vec![-2.0, 3.0, 1.0];
        crate::sampling::apply_repetition_penalty(&mut l, &[0u32, 1].into_iter().collect(), 2.0);
        assert_eq!(l, vec![-4.0, 1.5, 1.0]);
    }

    #[test]
    fn decode_stops_at_eos_and_on_request() {
        let mut s = Fake { pos: 0, next: vec![3], vocab: 4 };
        let opts = GenerateOptions { max_tokens: 9, eos_ids: vec![3], ..Default::default() };
        let l = s.forward_last(&[0]).unwrap();
        let g = decode(&mut s, l, &opts, |_| Ok(Flow::Continue)).unwrap();
        assert_eq!((g.tokens.len(), g.finish, g.eos_token), (0, FinishReason::Eos, Some(3)));
        let mut s = Fake { pos: 0, next: vec![2], vocab: 4 };
        let l = s.forward_last(&[0]).unwrap();
        let g =
            decode(&mut s, l, &GenerateOptions { max_tokens: 9, ..Default::default() }, |_| Ok(Flow::Stop)).unwrap();
        assert_eq!((g.tokens.len(), g.finish), (1, FinishReason::Stopped));
    }

    #[test]
    fn cpu_session_snapshot_restores_exactly() {
        let model = Arc::new(crate::synthetic::build("tiny", Some(4), 64).unwrap());
        let mut s = CpuSession::new(model);
        s.forward_last(&[1, 2, 3, 4, 5]).unwrap();
        let snap = s.snapshot();
        assert_eq!(snap.pos, 5);
        assert!(snap.nbytes > 0);
        let a = s.forward_last(&[6, 7]).unwrap();
        s.reset();
        assert_eq!(s.pos(), 0);
        s.restore(&snap).unwrap();
        assert_eq!(s.pos(), 5);
        let b = s.forward_last(&[6, 7]).unwrap();
        assert_eq!(a, b);
        let foreign = Snapshot { pos: 1, nbytes: 1, data: Box::new(1u8) };
        assert!(s.restore(&foreign).is_err());
    }

    #[test]
    fn top_k_orders_and_breaks_ties_by_index() {
        assert_eq!(top_k_of(&[0.1, 0.5, 0.5, -1.0], 3), vec![(1, 0.5), (2, 0.5), (0, 0.1)]);
        assert!(top_k_of(&[1.0], 0).is_empty());
        assert_eq!(top_k_of(&[1.0, 2.0], 5).len(), 2);
    }
}
