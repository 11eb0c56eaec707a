//! The CLI's fast path for bf16 weights: inputs rounded to bf16 before the products with bf16
//! weights (`kernels::set_bf16_activations`), on the tiny HF checkpoint against mlx-lm's fp32
//! logits. Its own test binary because the switch is process-wide.

mod common;
use common::*;
use lily::generate::{CpuSession, Session};
use std::sync::Arc;

/// Each product's inputs carry bf16 rounding (relative error ≤ 2^-9, rms about 2^-9/√3 ≈ 0.1%),
/// compounded over 8 layers, amplified about 2x by these random-weight models (see
/// tests/int8.rs, where 0.4% injected noise gave a 0.5% median). Bounds: median |Δ|/range ≤ 1%,
/// every position ≤ 10%; the argmax equal wherever the reference's top-1 margin exceeds twice
/// the position's max |Δ|. The path must run: the logits differ from the fp32 reference mode's.
/// Prefill then decode against one-shot prefill: the bf16 products give a token the same
/// result in both (tested in `linear`), so only the fp32 paths' summation order differs.
#[test]
fn tiny_hf_in_bf16_activations_stays_close_to_fp32_reference() {
    let model = Arc::new(lily::weights::load_model(&fixtures().join("tiny-hf")).unwrap());
    let r = reference("tiny-hf");
    let vocab = model.cfg.vocab_size;
    lily::cpu::kernels::set_bf16_activations(false);
    let exact = CpuSession::new(model.clone()).forward_all(&r.prompt).unwrap();
    lily::cpu::kernels::set_bf16_activations(true);
    let got = CpuSession::new(model.clone()).forward_all(&r.prompt).unwrap();
    assert_ne!(got, exact, "bf16 activations changed nothing: the path did not run");
    let rel = loose_rows("tiny-hf bf16 activations", &got, &r.logits, vocab, 0.1);
    let (median, worst) = (rel[rel.len() / 2], rel[rel.len() - 1]);
    eprintln!("tiny-hf bf16 activations: |Δ|/range vs mlx-lm fp32: median {median:.2e}, worst {worst:.2e}");
    assert!(median <= 0.01, "median |Δ|/range {median}");

    let split = 100;
    let inc = prefill_then_decode(&mut CpuSession::new(model.clone()), &r.prompt, split);
    let worst_inc = rows_worst(&inc[split * vocab..], &got[split * vocab..], vocab);
    eprintln!("tiny-hf bf16 activations: prefill-then-decode vs one-shot worst |Δ|/range {worst_inc:.2e}");
    assert!(worst_inc <= 1e-3, "decode vs prefill {worst_inc}");
}
