//! The GPU's batched decode step (`CudaBatch`) against each sequence alone on a `CudaSession`.
//! Skips (and passes, saying so) when no GPU/driver is present.
//!
//! Sequences of different prompt lengths are prefilled on their own sessions, then decode
//! together in one pass per step; one joins mid-way (its prompt chunk in the same step as the
//! others' tokens) and one leaves early.
//! Bounds, as a fraction of each logit row's range: the exact mode (fp32 products, fp32 cache)
//! differs from the lone decode only in summation order (the batch uses the many-row fp32 GEMM,
//! alone the GEMV), so 3e-5 as for every fp32 comparison (tests/common REL_TOL), and greedy
//! tokens are identical. The default mode runs the routed experts (and, past 4 rows, the lm_head)
//! on bf16 tensor cores where the lone decode keeps fp32 activations; on these random weights a
//! bf16 rounding can flip an expert choice, about 1e-2 of the range each (tests/cuda_model.rs),
//! and the caches carry it into later steps, so the bound is 5e-2 (an indexing or layout error
//! moves logits by the whole range); the distance is printed. Each case runs twice: with the
//! GEMV slots these few rows take by default, and with the many-row products of 8+ rows.

mod common;
use common::*;
use lily::cuda::{CudaBatch, CudaModel, CudaSession, KvDtype, Precision};
use lily::engine::batch::{Batched, Out, Work};
use lily::engine::picker::Want;
use lily::generate::Session;
use lily::sampling::{argmax, SamplingParams};
use std::sync::Arc;

/// The GPU is there (else a loud skip, see `common::gpu::gpu`).
fn have_gpu() -> bool {
    common::gpu::gpu().is_some()
}

fn session(gm: &Arc<CudaModel>, exact: bool) -> CudaSession {
    let mut s = CudaSession::new(gm.clone());
    if exact {
        s.set_kv_dtype(KvDtype::F32).unwrap();
        s.prefill = Some(Precision::F32);
    }
    s
}

/// A default-mode session over an fp8 KV cache.
fn session_fp8(gm: &Arc<CudaModel>) -> CudaSession {
    let mut s = CudaSession::new(gm.clone());
    s.set_kv_dtype(KvDtype::Fp8).unwrap();
    s
}

fn prompt(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = rng(seed);
    (0..n).map(|_| (r.next_u64() % vocab as u64) as u32).collect()
}

fn rel(got: &[f32], want: &[f32]) -> f32 {
    let (lo, hi) = want.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    max_abs_diff(got, want) / (hi - lo).max(1e-30)
}

fn check(dir: &str, exact: bool, gemm_from: Option<usize>) {
    let model = Arc::new(lily::weights::load_model(&fixtures().join(dir)).unwrap());
    let gm = lily::cuda::upload_cached(&model).unwrap();
    check_on(dir, &gm, exact, gemm_from, &|| session(&gm, exact));
}

/// [`check`] on an uploaded model, its sessions (alone and the batch's) made by `make`.
fn check_on(dir: &str, gm: &Arc<CudaModel>, exact: bool, gemm_from: Option<usize>, make: &dyn Fn() -> CudaSession) {
    let v = gm.cfg.vocab_size;
    let prompts = [prompt(1, 5, v), prompt(2, 17, v), prompt(3, 40, v)];
    let steps = 12;
    // Alone: the prompt, then greedy tokens through the session's own decode step.
    let want: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .map(|p| {
            let mut s = make();
            let mut out = vec![s.forward_last(p).unwrap()];
            for _ in 0..steps {
                let t = argmax(out.last().unwrap());
                out.push(s.forward_last(&[t]).unwrap());
            }
            out
        })
        .collect();
    let mut b = CudaBatch::new(gm.clone(), 4, make).unwrap();
    if let Some(r) = gemm_from {
        b.set_gemm_from(r);
    }
    let g = SamplingParams::default();
    let slot = [2usize, 0, 3];
    let mut got: Vec<usize> = vec![0; 3];
    let mut next: Vec<Option<u32>> = vec![None; 3];
    let (mut worst, mut batched_steps) = (0f32, 0);
    let bound = if exact { REL_TOL } else { 5e-2 };
    for step in 0..40 {
        let mut items: Vec<(usize, Vec<u32>)> = Vec::new();
        for i in 0..3 {
            let joined = i != 2 || step >= 3;
            if !joined || got[i] > steps || (i == 0 && got[i] > 7) {
                continue;
            }
            items.push((i, next[i].map_or(prompts[i].clone(), |t| vec![t])));
        }
        if items.is_empty() {
            break;
        }
        batched_steps += (items.iter().filter(|(_, t)| t.len() == 1).count() >= 2) as usize;
        // Alternate what the steps ask for: logits (compared) and device argmax tokens.
        let want_kind = if step % 2 == 0 { Want::Logits } else { Want::Greedy };
        let work: Vec<Work> =
            items.iter().map(|(i, t)| Work { slot: slot[*i], tokens: t, want: want_kind, sampling: &g }).collect();
        let outs = b.step(&work).unwrap();
        for ((i, _), o) in items.iter().zip(outs) {
            let k = got[*i];
            let t = match o {
                Out::Logits(l) => {
                    let e = rel(&l, &want[*i][k]);
                    worst = worst.max(e);
                    assert!(e <= bound, "{dir} exact={exact} seq {i} step {k}: {e:.2e} of the range > {bound:e}");
                    argmax(&l)
                }
                Out::Token(t) => t,
            };
            if exact {
                assert_eq!(t, argmax(&want[*i][k]), "{dir} seq {i} step {k}: greedy token batched vs alone");
            }
            next[*i] = Some(argmax(&want[*i][k]));
            got[*i] += 1;
        }
    }
    assert!(batched_steps >= 8, "{batched_steps} steps ran as one batched pass");
    assert_eq!(b.pos(slot[0]), prompts[0].len() + 7);
    eprintln!("{dir} exact={exact} gemm_from={gemm_from:?}: worst batched-vs-alone |Δ|/range {worst:.2e} over {batched_steps} batched steps");
}

#[test]
fn cuda_batched_decode_equals_each_sequence_alone() {
    if !have_gpu() {
        return;
    }
    for dir in ["tiny-mlx4", "tiny-hf", "tiny-mlx8-g32"] {
        // The default switch (GEMV slots at these 2-3 rows), and many-row products from 2 rows
        // (the skinny tensor-core kernel, experts grouped by expert), as at 8+ rows.
        for gemm_from in [None, Some(2)] {
            check(dir, true, gemm_from);
            check(dir, false, gemm_from);
        }
    }
}

/// The same over an fp8 KV cache (batched attn_prep_fp8 and fp8 decode attention over the rows'
/// own caches), on a tiny model with 8 query heads per KV head (the fp8 kernels' shape), in the
/// default mode's bound.
#[test]
fn cuda_batched_fp8_decode_equals_each_sequence_alone() {
    if !have_gpu() {
        return;
    }
    let (_, gm) = common::gpu::tiny_g8();
    if !common::gpu::fp8_ok(&gm) {
        return;
    }
    for gemm_from in [None, Some(2)] {
        check_on("G=8 tiny, fp8 KV", &gm, false, gemm_from, &|| session_fp8(&gm));
    }
}

/// Seeded sampling in a batched step draws on the device exactly as a lone session's step does
/// (same parameters, seed and step count): in the exact mode, where the logits agree to fp32
/// rounding, every draw equals the lone session's.
#[test]
fn cuda_batched_sampling_equals_each_sequence_alone() {
    if !have_gpu() {
        return;
    }
    let model = Arc::new(lily::weights::load_model(&fixtures().join("tiny-mlx4")).unwrap());
    let gm = lily::cuda::upload_cached(&model).unwrap();
    let v = model.cfg.vocab_size;
    let prompts = [prompt(7, 6, v), prompt(8, 11, v), prompt(9, 3, v)];
    let params = [
        SamplingParams { temperature: 0.9, top_p: 0.95, ..Default::default() },
        SamplingParams { temperature: 1.3, top_k: 20, ..Default::default() },
        SamplingParams { temperature: 0.7, min_p: 0.05, ..Default::default() },
    ];
    let mut alone: Vec<CudaSession> = prompts.iter().map(|_| session(&gm, true)).collect();
    let mut b = CudaBatch::new(gm.clone(), 3, || session(&gm, true)).unwrap();
    let mut next: Vec<u32> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let l = alone[i].forward_last(p).unwrap();
        let g = SamplingParams::default();
        b.step(&[Work { slot: i, tokens: p, want: Want::Logits, sampling: &g }]).unwrap();
        next.push(argmax(&l));
    }
    let mut draws = 0;
    for step in 0..8u64 {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let work: Vec<Work> = (0..3)
            .map(|i| Work {
                slot: i,
                tokens: &toks[i],
                want: Want::Sample(1000 * step + i as u64),
                sampling: &params[i],
            })
            .collect();
        let outs = b.step(&work).unwrap();
        for (i, o) in outs.into_iter().enumerate() {
            let want = alone[i].sampled_steps(next[i], 1, &params[i], 1000 * step + i as u64).unwrap()[0];
            let Out::Token(got) = o else { panic!("asked for a token") };
            assert_eq!(got, want, "seq {i} step {step}: batched draw vs alone");
            next[i] = want;
            draws += 1;
        }
    }
    eprintln!("batched device sampling: {draws} draws equal to the lone sessions'");
}
