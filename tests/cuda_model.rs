//! The whole model on the GPU (fp32 activations) against mlx-lm's fp32 logits on the reference
//! fixtures: the same checks as tests/reference.rs, plus GPU-vs-CPU on a synthetic model.
//! Skips (and passes, saying so) when no GPU/driver is present.
//!
//! Bound: as in tests/reference.rs, both sides are fp32 from identical dequantized weights and
//! differ only in summation order (a few 1e-6 of the logit range); 3e-5 of the per-row range is an
//! order of magnitude above that and far below the fixtures' smallest top-1 margin (2e-3).

mod common;
use common::*;
use lily::cuda::{CudaModel, CudaSession, KvDtype, Precision};
use lily::generate::{CpuSession, Session};
use std::sync::Arc;

/// The fixtures folder; `LILY_REPO` overrides the build-time checkout path (test executables
/// carried to the GPU machine run from another folder).
fn fixtures() -> std::path::PathBuf {
    match std::env::var_os("LILY_REPO") {
        Some(r) => std::path::PathBuf::from(r).join("tests/fixtures"),
        None => common::fixtures(),
    }
}

/// The GPU is there (else a loud skip, see `common::gpu::gpu`).
fn have_gpu() -> bool {
    common::gpu::gpu().is_some()
}

/// synthetic:tiny (4-bit, vocab 1024) and its upload, or None (skipping) without a GPU.
fn tiny_on_gpu() -> Option<(Arc<lily::model::Model>, Arc<lily::cuda::CudaModel>)> {
    if !have_gpu() {
        return None;
    }
    let model = Arc::new(lily::synthetic::build("tiny", None, 1024).unwrap());
    let gm = lily::cuda::upload_cached(&model).unwrap();
    Some((model, gm))
}

/// A session in the exact mode's cache precision (fp32 K/V); the default cache is bf16.
fn exact(gm: Arc<CudaModel>) -> CudaSession {
    with_cache(gm, KvDtype::F32)
}

/// A session with the KV cache `kv` (F32: the exact mode's).
fn with_cache(gm: Arc<CudaModel>, kv: KvDtype) -> CudaSession {
    let mut s = CudaSession::new(gm);
    s.set_kv_dtype(kv).unwrap();
    s
}

/// A reference fixture of the layer-local tests: (name, CPU model, its upload, the reference
/// prompt).
type LayerFixture = (&'static str, Arc<lily::model::Model>, Arc<CudaModel>, Vec<u32>);

/// The three reference fixtures of the layer-local tests.
fn layer_fixtures() -> Vec<LayerFixture> {
    ["tiny-mlx4", "tiny-hf", "tiny-mlx8-g32"]
        .into_iter()
        .map(|dir| {
            let model = Arc::new(lily::weights::load_model(&fixtures().join(dir)).unwrap());
            let gm = lily::cuda::upload_cached(&model).unwrap();
            (dir, model, gm, reference(dir).prompt)
        })
        .collect()
}

fn check_model(dir: &str, reference_name: &str) {
    if !have_gpu() {
        return;
    }
    let Reference { prompt, logits, greedy } = reference(reference_name);
    let model = Arc::new(lily::weights::load_model(&fixtures().join(dir)).unwrap());
    let gm = lily::cuda::upload_cached(&model).unwrap_or_else(|e| panic!("upload {dir}: {e:#}"));
    let vocab = model.cfg.vocab_size;

    // The exact mode: batched prefill with fp32 products, and the token-by-token decode path.
    let session = |prefill: Option<Precision>| {
        let mut s = exact(gm.clone());
        s.prefill = prefill;
        s
    };
    for (mode, prefill) in [("batched fp32", Some(Precision::F32)), ("token by token", None)] {
        let got = session(prefill).forward_all(&prompt).unwrap();
        let worst = compare_rows(&format!("{dir} cuda one-shot {mode}"), &got, &logits, vocab);
        eprintln!("{dir}: cuda {mode} worst |Δ|/range vs mlx-lm = {worst:.2e}");
    }
    // Prompt chunks of 48 tokens (state carried between chunks) give the same logits.
    let mut chunked = session(Some(Precision::F32));
    chunked.chunk = 48;
    let got = chunked.forward_all(&prompt).unwrap();
    compare_rows(&format!("{dir} cuda batched fp32, 48-token chunks"), &got, &logits, vocab);
    // The bf16 tensor-core prefill is not held to the fp32 bound (see the issue: end-to-end
    // bf16 comparisons on random MoE weights are not meaningful); its distance is reported.
    let got = session(Some(Precision::Bf16)).forward_all(&prompt).unwrap();
    let worst = rows_worst(&got, &logits, vocab);
    eprintln!("{dir}: cuda batched bf16 (information only) worst |Δ|/range vs mlx-lm = {worst:.2e}");

    let split = 100;
    let mut s2 = session(Some(Precision::F32));
    let mut inc = s2.forward_all(&prompt[..split]).unwrap();
    for &t in &prompt[split..] {
        inc.extend(s2.forward_last(&[t]).unwrap());
    }
    compare_rows(&format!("{dir} cuda prefill-then-decode"), &inc, &logits, vocab);

    // Greedy continuation with the argmax on the GPU.
    let mut s3 = session(Some(Precision::F32));
    let mut next = s3.forward_greedy(&prompt).unwrap();
    let mut out = Vec::new();
    for _ in 0..greedy.len() {
        out.push(next);
        next = s3.forward_greedy(&[next]).unwrap();
    }
    assert_eq!(out, greedy, "{dir}: cuda greedy continuation differs from mlx-lm");

    // The same continuation from the device-resident loop (argmax fed back on the GPU, graph
    // replays, one read at the end), and from the session's state afterwards: it consumed the
    // first n - 1 produced tokens, so feeding the last one continues the sequence.
    let mut s5 = session(Some(Precision::F32));
    let first = s5.forward_greedy(&prompt).unwrap();
    assert_eq!(first, greedy[0], "{dir}: first greedy token");
    let rest = s5.greedy_steps(first, greedy.len() - 1).unwrap();
    assert_eq!(rest, greedy[1..], "{dir}: device greedy loop differs from mlx-lm");
    assert_eq!(s5.pos(), prompt.len() + greedy.len() - 1, "{dir}: position after the device loop");
    let again = s5.greedy_steps(*greedy.last().unwrap(), 1).unwrap();
    assert_eq!(again, vec![next], "{dir}: the device loop's session continues like the step-by-step one");

    // Snapshot / restore round trip: the restored session continues identically.
    let snap = s2.snapshot();
    let a = s2.forward_last(&[1]).unwrap();
    let mut s4 = exact(gm);
    s4.restore(&snap).unwrap();
    let b = s4.forward_last(&[1]).unwrap();
    assert_eq!(a, b, "{dir}: restored session differs");
}

#[test]
fn cuda_hf_bf16_matches_mlx_lm() {
    check_model("tiny-hf", "tiny-hf");
}

#[test]
fn cuda_hf_bf16_per_expert_layout_matches_mlx_lm() {
    check_model("tiny-hf-split", "tiny-hf");
}

#[test]
fn cuda_mlx_4bit_matches_mlx_lm() {
    check_model("tiny-mlx4", "tiny-mlx4");
}

#[test]
fn cuda_mlx_8bit_group32_matches_mlx_lm() {
    check_model("tiny-mlx8-g32", "tiny-mlx8-g32");
}

/// synthetic:tiny (4-bit, vocab 1024) GPU against CPU over a longer sequence (> 256 positions,
/// so the KV cache grows once).
#[test]
fn cuda_synthetic_tiny_matches_cpu() {
    let Some((model, gm)) = tiny_on_gpu() else { return };
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 7919 + 13) % 1024).collect();
    let want = CpuSession::new(model.clone()).forward_all(&prompt).unwrap();
    let mut graphs = exact(gm.clone());
    graphs.use_graphs = true;
    graphs.prefill = None;
    let got = graphs.forward_all(&prompt).unwrap();
    let worst = compare_rows("synthetic:tiny cuda vs cpu", &got, &want, 1024);
    eprintln!("synthetic:tiny: cuda (graphs) vs cpu worst |Δ|/range = {worst:.2e}");
    // The same kernels launched eagerly give bit-identical logits.
    let mut eager = exact(gm.clone());
    eager.use_graphs = false;
    eager.prefill = None;
    let got_eager = eager.forward_all(&prompt).unwrap();
    assert!(got_eager == got, "graph replay and eager launches differ");
    // The unfused decode kernels (separate norms, MoE tail) agree with the fused ones.
    let mut unfused = exact(gm.clone());
    unfused.fused = false;
    unfused.prefill = None;
    let got_unfused = unfused.forward_all(&prompt).unwrap();
    let worst = compare_rows("synthetic:tiny cuda unfused vs cpu", &got_unfused, &want, 1024);
    eprintln!("synthetic:tiny: cuda unfused decode kernels vs cpu worst |Δ|/range = {worst:.2e}");
    // The GQA-packed attention kernel from the first position, and switched to at position 150
    // (graphs for both kernels in one session).
    for from in [0usize, 150] {
        let mut packed = exact(gm.clone());
        packed.prefill = None;
        packed.attn_from = from;
        let got = packed.forward_all(&prompt).unwrap();
        let worst = compare_rows("synthetic:tiny cuda packed attention vs cpu", &got, &want, 1024);
        eprintln!("synthetic:tiny: cuda packed attention from position {from} vs cpu worst |Δ|/range = {worst:.2e}");
    }
    // Batched fp32 prefill in chunks of 128 (the KV cache grows between chunks).
    let mut batched = exact(gm);
    batched.prefill = Some(Precision::F32);
    batched.chunk = 128;
    let got = batched.forward_all(&prompt).unwrap();
    let worst = compare_rows("synthetic:tiny cuda batched fp32 vs cpu", &got, &want, 1024);
    eprintln!("synthetic:tiny: cuda batched fp32 vs cpu worst |Δ|/range = {worst:.2e}");
}

/// The device sampling loop (`sample_io` replayed in the step graph): a seed gives the same
/// tokens from two fresh sessions, another seed other tokens, top-k 1 gives the greedy loop's
/// tokens, and the session's position advances like the greedy loop's.
#[test]
fn cuda_device_sampling_loop() {
    use lily::sampling::SamplingParams;
    let Some((_, gm)) = tiny_on_gpu() else { return };
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 131 + 7) % 1024).collect();
    let run = |p: &SamplingParams, seed: u64| -> Vec<u32> {
        let mut s = CudaSession::new(gm.clone());
        let first = lily::sampling::argmax(&s.forward_last(&prompt).unwrap());
        let out = s.sampled_steps(first, 48, p, seed).unwrap();
        assert_eq!(s.pos(), prompt.len() + 48, "position after the sampling loop");
        out
    };
    let hot = SamplingParams { temperature: 1.5, top_k: 0, top_p: 0.95, min_p: 0.0, seed: 0 };
    let a = run(&hot, 11);
    assert!(a.iter().all(|&t| t < 1024));
    assert_eq!(run(&hot, 11), a, "same seed, different tokens");
    assert_ne!(run(&hot, 12), a, "another seed gave the same 48 tokens");
    let top1 = SamplingParams { temperature: 1.0, top_k: 1, ..hot.clone() };
    let mut s = CudaSession::new(gm.clone());
    let first = lily::sampling::argmax(&s.forward_last(&prompt).unwrap());
    let greedy = s.greedy_steps(first, 48).unwrap();
    assert_eq!(run(&top1, 3), greedy, "top-k 1 sampling differs from the greedy loop");
}

/// A session reset after a prompt and a decode run (its states zeroed in place, its decode graphs
/// kept) gives another prompt what a fresh session gives it. Prompt A is longer than the first KV
/// capacity (256), so the reset session's attention caches have grown; B is shorter. The same
/// kernels run on the same inputs (only the caches' capacity differs), so the logits should agree
/// to the bit; the bound, 1e-6 of the logit range, allows a different reduction order and is far
/// below what a state left over from A gives (of order the range).
#[test]
fn cuda_reset_session_equals_fresh_session() {
    let Some((_, gm)) = tiny_on_gpu() else { return };
    let a: Vec<u32> = (0..300u32).map(|i| (i * 97 + 5) % 1024).collect();
    let b: Vec<u32> = (0..40u32).map(|i| (i * 131 + 7) % 1024).collect();
    let run = |s: &mut CudaSession, p: &[u32]| {
        let logits = s.forward_last(p).unwrap();
        let first = lily::sampling::argmax(&logits);
        let toks = s.greedy_steps(first, 24).unwrap();
        (logits, toks)
    };
    let mut fresh = CudaSession::new(gm.clone());
    let want = run(&mut fresh, &b);
    let mut reused = CudaSession::new(gm.clone());
    let other = run(&mut reused, &a);
    reused.reset();
    assert_eq!(reused.pos(), 0);
    let got = run(&mut reused, &b);
    assert_ne!(other.1, want.1, "the two prompts gave the same tokens: the test cannot tell them apart");
    let range = want.0.iter().cloned().fold(f32::MIN, f32::max) - want.0.iter().cloned().fold(f32::MAX, f32::min);
    let worst = got.0.iter().zip(&want.0).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    eprintln!("reset vs fresh: worst |Δ| {worst:.3e} of range {range:.3e}");
    assert!(worst <= 1e-6 * range, "logits after reset differ: worst |Δ| {worst} of range {range}");
    assert_eq!(got.1, want.1, "greedy tokens after reset differ");
}

/// Layer-local error on the reference fixtures: every layer gets the CPU's input to that layer
/// (the prompt's rows at their positions) and its GPU output is compared with the CPU's, for the
/// batched prefill in both precisions. Compared is the layer's update (output − input), whose
/// NMSE isolates that layer's arithmetic. Bounds: fp32 differs from the CPU only in summation
/// order (1e-9; measured 5e-13 to 9e-13); bf16 rounds activations and weight tiles to 8 mantissa
/// bits before the tensor-core products, through the GDN recurrence and attention as well
/// (measured 6e-5 to 3.5e-4 on these fixtures), so 1e-3: an indexing error gives NMSE of order 1,
/// one flipped expert choice in one of the 130+ rows about 1e-2.
#[test]
fn cuda_layers_match_cpu_locally() {
    if !have_gpu() {
        return;
    }
    for (dir, model, gm, prompt) in layer_fixtures() {
        let hid = model.cfg.hidden_size;
        let mut x = vec![0f32; prompt.len() * hid];
        for (i, &tok) in prompt.iter().enumerate() {
            model.embed.row_f32(tok as usize, &mut x[i * hid..(i + 1) * hid]);
        }
        let mut st = model.new_state();
        let mut xs = vec![x.clone()];
        for i in 0..model.layers.len() {
            model.layer(i, &mut x, &mut st);
            xs.push(x.clone());
        }
        for (prec, bound) in [(Precision::F32, 1e-9), (Precision::Bf16, 1e-3)] {
            // The exact mode with the fp32 cache; bf16 products with the default bf16 cache.
            let mut s = with_cache(gm.clone(), if prec == Precision::F32 { KvDtype::F32 } else { KvDtype::Bf16 });
            let mut worst = 0f64;
            for i in 0..model.layers.len() {
                let got = s.layer_rows(i, &xs[i], prec).unwrap();
                let upd = |o: &[f32]| o.iter().zip(&xs[i]).map(|(a, b)| a - b).collect::<Vec<f32>>();
                let e = nmse(&upd(&got), &upd(&xs[i + 1]));
                worst = worst.max(e);
                assert!(e <= bound, "{dir} {prec:?} layer {i}: update nmse {e:.2e} > {bound:e}");
            }
            eprintln!("{dir}: {prec:?} batched prefill, worst layer-local update nmse {worst:.2e}");
        }
    }
}

/// Decode-local error: token by token over the reference prompts, each layer's decode-step
/// kernels get the CPU's input row to that layer at that position (the layer's GDN and conv
/// state and KV cache carried on the GPU, built from the CPU's inputs at the earlier positions),
/// and the layer's update (output − input) is compared with the CPU's. Bounds: the exact mode
/// (fp32 cache) differs from the CPU in summation order and in the decode GEMV's 4-bit code trick
/// (gemv.cu: the codes' x/2 offset removed per chunk, about one bit of the fp32 mantissa, more
/// where a layer's update is small against its input): measured 1e-11 to 8.8e-10 on the H200,
/// bound 1e-8; the default bf16 cache rounds K/V to 8 mantissa bits (relative 2^-9 per element):
/// measured 2.5e-6 to 3.2e-6, bound 1e-4. An indexing error gives NMSE of order 1, one flipped
/// expert choice about 1e-2.
#[test]
fn cuda_decode_layers_match_cpu_locally() {
    if !have_gpu() {
        return;
    }
    for (dir, model, gm, prompt) in layer_fixtures() {
        let hid = model.cfg.hidden_size;
        for (kv, bound) in [(KvDtype::F32, 1e-8), (KvDtype::Bf16, 1e-4)] {
            let mut s = with_cache(gm.clone(), kv);
            let mut st = model.new_state();
            let mut worst = 0f64;
            for (p, &tok) in prompt.iter().enumerate() {
                let mut x = vec![0f32; hid];
                model.embed.row_f32(tok as usize, &mut x);
                for i in 0..model.layers.len() {
                    let input = x.clone();
                    model.layer(i, &mut x, &mut st);
                    let got = s.decode_layer(i, &input).unwrap();
                    let upd = |o: &[f32]| o.iter().zip(&input).map(|(a, b)| a - b).collect::<Vec<f32>>();
                    let e = nmse(&upd(&got), &upd(&x));
                    worst = worst.max(e);
                    assert!(e <= bound, "{dir} {kv:?} cache, position {p}, layer {i}: update nmse {e:.2e} > {bound:e}");
                }
                st.pos += 1;
                s.advance(1);
            }
            eprintln!(
                "{dir}: decode step, {kv:?} cache, {} positions, worst layer-local update nmse {worst:.2e}",
                prompt.len()
            );
        }
    }
}

/// The default bf16 KV cache against the fp32 one, token by token over 300 positions of
/// synthetic:tiny (the cache grows once) and over the reference fixtures' prompts: K/V rounded to
/// 8 mantissa bits (relative 2^-9 per element) moves the logits by a few 1e-3 of their range at
/// most; bound 1e-2 (an indexing or layout error moves them by the whole range). Decode after a
/// batched prefill into the bf16 cache equals decode after a token-by-token prefill within the
/// same bound, and a bf16 session's snapshot restores bit-identically.
#[test]
fn cuda_bf16_kv_cache_tracks_fp32() {
    if !have_gpu() {
        return;
    }
    let tiny = Arc::new(lily::synthetic::build("tiny", None, 1024).unwrap());
    let mut cases: Vec<(String, Arc<lily::model::Model>, Vec<u32>)> =
        vec![("synthetic:tiny".into(), tiny, (0..300u32).map(|i| (i * 7919 + 13) % 1024).collect())];
    for (dir, r) in [("tiny-mlx4", "tiny-mlx4"), ("tiny-hf", "tiny-hf")] {
        let m = Arc::new(lily::weights::load_model(&fixtures().join(dir)).unwrap());
        cases.push((dir.into(), m, reference(r).prompt));
    }
    for (name, model, prompt) in cases {
        let gm = lily::cuda::upload_cached(&model).unwrap();
        let v = model.cfg.vocab_size;
        let step = |kv: KvDtype| {
            let mut s = CudaSession::new(gm.clone());
            s.set_kv_dtype(kv).unwrap();
            s.prefill = None;
            assert_eq!(s.kv_dtype(), kv);
            s
        };
        let f32_rows = step(KvDtype::F32).forward_all(&prompt).unwrap();
        let mut s16 = step(KvDtype::Bf16);
        let b16_rows = s16.forward_all(&prompt).unwrap();
        let worst = rows_worst(&b16_rows, &f32_rows, v);
        eprintln!("{name}: bf16 vs fp32 KV cache, token by token, worst |Δ|/range {worst:.2e}");
        assert!(worst <= 1e-2, "{name}: bf16 KV cache moves the logits by {worst:.2e} of their range");
        // Batched prefill of all but the last 8 tokens, then decode them.
        let split = prompt.len() - 8;
        let mut b = CudaSession::new(gm.clone());
        b.set_kv_dtype(KvDtype::Bf16).unwrap();
        b.prefill = Some(Precision::F32);
        b.forward_all(&prompt[..split]).unwrap();
        let mut tail = Vec::new();
        for &t in &prompt[split..] {
            tail.extend(b.forward_last(&[t]).unwrap());
        }
        let worst = rows_worst(&tail, &b16_rows[split * v..], v);
        eprintln!("{name}: bf16 KV, decode after batched prefill vs token by token, worst |Δ|/range {worst:.2e}");
        assert!(worst <= 1e-2, "{name}: decode after a batched bf16-cache prefill differs by {worst:.2e}");
        // Snapshot and restore of a bf16 cache.
        let snap = s16.snapshot();
        let a = s16.forward_last(&[1]).unwrap();
        let mut r = step(KvDtype::Bf16);
        r.restore(&snap).unwrap();
        assert_eq!(r.forward_last(&[1]).unwrap(), a, "{name}: restored bf16-cache session differs");
    }
}

/// The tensor-core decode attention inside the model's step: a tiny model with 8 query heads
/// per KV head (head dim 64) decodes token by token over a bf16 cache with that kernel from the
/// first position, and with the per-head kernel throughout. Both track the CPU's fp32 logits
/// within the bf16 cache's bound, and each other to accumulation order; the tensor-core
/// kernel's early form (`attn_early`) gives its bits.
#[test]
fn cuda_tensor_core_decode_attention_in_the_model() {
    if !have_gpu() {
        return;
    }
    let (model, gm) = common::gpu::tiny_g8();
    let c = &model.cfg;
    let (nh, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    assert!(gm.gpu.attn_tc_applies(nh, hkv, hd, KvDtype::Bf16), "the tensor-core kernel must apply to this shape");
    let prompt: Vec<u32> = (0..200u32).map(|i| (i * 7919 + 13) % 1024).collect();
    let want = CpuSession::new(model.clone()).forward_all(&prompt).unwrap();
    let run = |from: usize, early: bool| {
        let mut s = CudaSession::new(gm.clone());
        s.set_kv_dtype(KvDtype::Bf16).unwrap();
        s.prefill = None;
        s.attn_from = from;
        s.attn_early = early;
        s.forward_all(&prompt).unwrap()
    };
    let (tc, head) = (run(0, false), run(usize::MAX, false));
    // The early form (first tiles requested before the wait for attn_prep, which writes the
    // newest row) reads the same values: the same logits, bit for bit.
    let got = run(0, true);
    let differ = tc.iter().zip(&got).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(differ, 0, "the early tensor-core attention changes {differ} logits");
    let v = model.cfg.vocab_size;
    for (name, got) in [("tensor-core", &tc), ("per-head", &head)] {
        let worst = rows_worst(got, &want, v);
        eprintln!("G=8 tiny model, {name} decode attention, bf16 cache vs cpu fp32: worst |Δ|/range {worst:.2e}");
        assert!(worst <= 1e-2, "{name} decode attention moves the logits by {worst:.2e} of their range");
    }
    let worst = rows_worst(&tc, &head, v);
    eprintln!("G=8 tiny model, tensor-core vs per-head decode attention: worst |Δ|/range {worst:.2e}");
    assert!(worst <= 1e-4, "the tensor-core kernel differs from the per-head one by {worst:.2e}");
}

/// The fp8 KV cache (`--kv-cache-dtype fp8`) in the model, on a tiny model with 8 query heads
/// per KV head (the fp8 kernels' shape): token by token against the fp32 cache, e4m3's rounding
/// (half a step, relative 2^-4 per element, 32 times bf16's) moves the logits by a few 1e-2 of
/// their range at most; bound 0.1 (an indexing or layout error moves them by the whole range).
/// Decode after a batched prefill into the fp8 cache equals decode after a token-by-token
/// prefill within the same bound, and an fp8 session's snapshot restores bit-identically.
#[test]
fn cuda_fp8_kv_cache_tracks_fp32() {
    if !have_gpu() {
        return;
    }
    let (model, gm) = common::gpu::tiny_g8();
    if !common::gpu::fp8_ok(&gm) {
        return;
    }
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 7919 + 13) % 1024).collect();
    let v = model.cfg.vocab_size;
    let session = |kv: KvDtype, prefill: Option<Precision>| {
        let mut s = CudaSession::new(gm.clone());
        s.set_kv_dtype(kv).unwrap();
        s.prefill = prefill;
        assert_eq!(s.kv_dtype(), kv);
        s
    };
    let f32_rows = session(KvDtype::F32, None).forward_all(&prompt).unwrap();
    let mut s8 = session(KvDtype::Fp8, None);
    let f8_rows = s8.forward_all(&prompt).unwrap();
    let worst = rows_worst(&f8_rows, &f32_rows, v);
    eprintln!("G=8 tiny model: fp8 vs fp32 KV cache, token by token, worst |Δ|/range {worst:.2e}");
    assert!(worst <= 0.1, "fp8 KV cache moves the logits by {worst:.2e} of their range");
    // The long-context plan (twice the splits; from 65,536 positions by default) from position 0:
    // the same math in another summation order.
    let mut long = session(KvDtype::Fp8, None);
    long.attn_from = 0;
    let worst = rows_worst(&long.forward_all(&prompt).unwrap(), &f8_rows, v);
    eprintln!("G=8 tiny model: fp8 KV, long-context splits vs short, worst |Δ|/range {worst:.2e}");
    assert!(worst <= 1e-4, "the fp8 long-context plan differs by {worst:.2e}");
    let b16_rows = session(KvDtype::Bf16, None).forward_all(&prompt).unwrap();
    let worst16 = rows_worst(&b16_rows, &f32_rows, v);
    eprintln!("G=8 tiny model: bf16 vs fp32 KV cache, token by token, worst |Δ|/range {worst16:.2e} (for scale)");
    // Batched prefill (the flash kernel over the fp8 cache) of all but the last 8 tokens, then
    // decode them.
    let split = prompt.len() - 8;
    let mut b = session(KvDtype::Fp8, Some(Precision::Bf16));
    b.forward_all(&prompt[..split]).unwrap();
    let mut tail = Vec::new();
    for &t in &prompt[split..] {
        tail.extend(b.forward_last(&[t]).unwrap());
    }
    let worst = rows_worst(&tail, &f8_rows[split * v..], v);
    eprintln!("G=8 tiny model: fp8 KV, decode after batched prefill vs token by token, worst |Δ|/range {worst:.2e}");
    assert!(worst <= 0.1, "decode after a batched fp8-cache prefill differs by {worst:.2e}");
    // Snapshot and restore of an fp8 cache (decoded to f32 and encoded again): the same values,
    // but a row whose largest code was 224 comes back at half the scale with doubled codes (about
    // 7% of rows), so the fp16 rounding of tiny weight x scale products can differ: equal within
    // 1e-5 of the range (bf16 restores bit-identically, above).
    let snap = s8.snapshot();
    let a = s8.forward_last(&[1]).unwrap();
    let mut r = session(KvDtype::Fp8, None);
    r.restore(&snap).unwrap();
    let worst = rows_worst(&r.forward_last(&[1]).unwrap(), &a, v);
    eprintln!("G=8 tiny model: fp8 KV, restored vs original session, worst |Δ|/range {worst:.2e}");
    assert!(worst <= 1e-5, "restored fp8-cache session differs by {worst:.2e}");
}

/// A tiny model in the persistent step's shapes: 16-byte scale rows (every width a multiple of
/// 8 groups of 64), two attention layers (so the step is three launches with attention between).
fn persistent_model() -> Arc<lily::model::Model> {
    let mut cfg = lily::synthetic::config("tiny", Some(8), 1024).unwrap();
    cfg.hidden_size = 512;
    (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) = (8, 2, 64);
    (cfg.linear_num_key_heads, cfg.linear_num_value_heads) = (2, 4);
    (cfg.linear_key_head_dim, cfg.linear_value_head_dim) = (32, 128);
    (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) = (512, 512);
    Arc::new(lily::synthetic::build_config(cfg).unwrap())
}

/// The persistent decode step (kernels/pstep.cu) against the graph of per-op kernels and the
/// CPU: token-by-token decode of a prompt (every step's logits), then a batched prefill followed
/// by greedy steps on the device. Same math as the per-op kernels up to summation order, so the
/// two GPU paths agree to 1e-4 of the logit range; both track the CPU's fp32 logits within the
/// bf16 cache's bound (1e-2).
#[test]
fn cuda_persistent_step_matches_graph_and_cpu() {
    if !have_gpu() {
        return;
    }
    let model = persistent_model();
    let gm = lily::cuda::upload_cached(&model).unwrap();
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % 1024).collect();
    let want = CpuSession::new(model.clone()).forward_all(&prompt).unwrap();
    let session = |persistent: bool| {
        let mut s = CudaSession::new(gm.clone());
        s.persistent = persistent;
        if persistent {
            s.persistent_step().unwrap_or_else(|e| panic!("the persistent step must take this model: {e}"));
        }
        s
    };
    let run = |persistent: bool| {
        let mut s = session(persistent);
        s.prefill = None;
        s.forward_all(&prompt).unwrap()
    };
    let (ps, graph) = (run(true), run(false));
    let v = model.cfg.vocab_size;
    for (name, got) in [("persistent", &ps), ("graph", &graph)] {
        let worst = rows_worst(got, &want, v);
        eprintln!("persistent-step model, {name} decode vs cpu fp32: worst |Δ|/range {worst:.2e}");
        assert!(worst <= 1e-2, "{name} decode moves the logits by {worst:.2e} of their range");
    }
    let worst = rows_worst(&ps, &graph, v);
    eprintln!("persistent vs graph decode: worst |Δ|/range {worst:.2e}");
    // Sessions 32-36 the two steps staged the 4-bit products' inputs differently (pstep in fp32,
    // the graph's GEMVs as int8 parts with dp4a: 1.17e-4 measured, both within the CPU bound
    // above at 8.0e-4 and 8.1e-4); since session 37 pstep stages int8 parts too, so only
    // summation orders differ (the gated norm, the split of rows), but the bound stays until a
    // GPU run shows the new gap.
    assert!(worst <= 3e-4, "the persistent step differs from the graph step by {worst:.2e}");
    let greedy = |persistent: bool| {
        let mut s = session(persistent);
        let first = s.forward_greedy(&prompt).unwrap();
        s.greedy_steps(first, 48).unwrap()
    };
    let (a, b) = (greedy(true), greedy(false));
    assert_eq!(a, b, "greedy tokens after a batched prefill: persistent vs graph step");
}

/// A tiny model in Qwen3.6's GDN head shape (D_k = D_v = 128, two value heads per key head), the
/// shape the decode step's clustered state step (gdn_step_c4) takes.
fn qwen36_gdn_shape_model() -> Arc<lily::model::Model> {
    let mut cfg = lily::synthetic::config("tiny", Some(8), 1024).unwrap();
    cfg.hidden_size = 256;
    (cfg.linear_num_key_heads, cfg.linear_num_value_heads) = (2, 4);
    (cfg.linear_key_head_dim, cfg.linear_value_head_dim) = (128, 128);
    Arc::new(lily::synthetic::build_config(cfg).unwrap())
}

/// The default decode step in Qwen3.6's GDN head shape against the CPU: token-by-token decode of
/// a prompt, every step's logits within the bf16 cache's bound. (Until session 54 this test also
/// ran the measured-slower cluster forms gdn_in_step_cl and moe_fused_qr against it.)
#[test]
fn cuda_qwen36_gdn_shape_matches_cpu() {
    if !have_gpu() {
        return;
    }
    let model = qwen36_gdn_shape_model();
    let gm = lily::cuda::upload_cached(&model).unwrap();
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % 1024).collect();
    let want = CpuSession::new(model.clone()).forward_all(&prompt).unwrap();
    let mut s = CudaSession::new(gm.clone());
    s.prefill = None;
    let graph = s.forward_all(&prompt).unwrap();
    let v = model.cfg.vocab_size;
    let worst = rows_worst(&graph, &want, v);
    eprintln!("Qwen3.6 GDN head shape, default decode vs cpu fp32: worst |Δ|/range {worst:.2e}");
    assert!(worst <= 1e-2, "default decode moves the logits by {worst:.2e} of their range");
}
