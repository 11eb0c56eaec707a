//! The whole model against mlx-lm (an implementation nobody here wrote), on tiny random-weight
//! checkpoints written in both real layouts by `scripts/gen_reference.py`.
//!
//! Bound on logits: both sides compute in fp32 from identical (dequantized) weights, differing
//! only in summation order. fp32 rounding (ε ≈ 6e-8) accumulated over dot products of ≤ 512
//! terms and 8 layers gives differences of a few 1e-6 of the logit range (measured: ≤ 1.9e-6);
//! we allow 3e-5 of the per-row range, an order of magnitude above that noise and far below the
//! fixtures' smallest top-1 margin (2e-3 of the scale), so any semantic mistake (a wrong norm,
//! head map, RoPE or routing) fails.

mod common;
use common::*;
use lily::generate::{CpuSession, Session};
use std::sync::Arc;

fn load(dir: &str) -> Arc<lily::model::Model> {
    Arc::new(lily::weights::load_model(&fixtures().join(dir)).unwrap_or_else(|e| panic!("loading {dir}: {e:#}")))
}

fn check_model(dir: &str, reference_name: &str) {
    let model = load(dir);
    let r = reference(reference_name);
    let vocab = model.cfg.vocab_size;
    assert!(r.prompt.len() >= 130, "fixture prompt must be ≥ 130 tokens");
    assert_eq!(r.logits.len(), r.prompt.len() * vocab, "fixture logits shape");

    // 1. One-shot prefill logits.
    let mut s = CpuSession::new(model.clone());
    let got = s.forward_all(&r.prompt).unwrap();
    let worst = compare_rows(&format!("{dir} one-shot"), &got, &r.logits, vocab);
    eprintln!("{dir}: worst |Δ|/range vs mlx-lm = {worst:.2e}");

    // 2. Prefill part, then decode the rest one token at a time: same logits as one-shot.
    let split = 100;
    let mut s2 = CpuSession::new(model.clone());
    let mut inc = s2.forward_all(&r.prompt[..split]).unwrap();
    for &t in &r.prompt[split..] {
        inc.extend(s2.forward_last(&[t]).unwrap());
    }
    compare_rows(&format!("{dir} prefill-then-decode vs mlx-lm"), &inc, &r.logits, vocab);
    let self_diff = compare_rows(&format!("{dir} prefill-then-decode vs one-shot"), &inc, &got, vocab);
    eprintln!("{dir}: prefill-then-decode vs one-shot worst |Δ|/range = {self_diff:.2e}");

    // 3. Greedy continuation equals mlx-lm's.
    let mut s3 = CpuSession::new(model.clone());
    let mut logits = s3.forward_last(&r.prompt).unwrap();
    let mut out = Vec::new();
    for _ in 0..r.greedy.len() {
        let next = lily::sampling::argmax(&logits);
        out.push(next);
        logits = s3.forward_last(&[next]).unwrap();
    }
    assert_eq!(out, r.greedy, "{dir}: greedy continuation differs from mlx-lm");
}

#[test]
fn hf_bf16_sharded_matches_mlx_lm() {
    check_model("tiny-hf", "tiny-hf");
}

#[test]
fn hf_bf16_per_expert_layout_matches_mlx_lm() {
    check_model("tiny-hf-split", "tiny-hf");
}

#[test]
fn mlx_4bit_matches_mlx_lm() {
    check_model("tiny-mlx4", "tiny-mlx4");
}

#[test]
fn mlx_8bit_group32_matches_mlx_lm() {
    check_model("tiny-mlx8-g32", "tiny-mlx8-g32");
}
