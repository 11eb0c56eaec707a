//! Helpers shared by the integration tests: a seeded RNG and error measures.
#![allow(dead_code)]

pub mod gpu;

use lily::sampling::Rng;
use std::path::PathBuf;

pub fn rng(seed: u64) -> Rng {
    Rng::new(seed)
}

/// Uniform in [-a, a).
pub fn uniform(r: &mut Rng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| ((r.next_f64() * 2.0 - 1.0) * a as f64) as f32).collect()
}

/// Normalised mean squared error of `got` against `want`.
pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let num: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>().max(1e-30);
    num / den
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The checkout the tests read their fixtures from: `LILY_REPO` when set (test executables
/// carried to another machine, where the build-time path does not exist), else the build-time one.
pub fn repo() -> PathBuf {
    match std::env::var_os("LILY_REPO") {
        Some(r) => PathBuf::from(r),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")),
    }
}

pub fn fixtures() -> PathBuf {
    let d = repo().join("tests/fixtures");
    assert!(d.is_dir(), "test fixtures missing at {} (set LILY_REPO to the checkout)", d.display());
    d
}

/// The real Qwen3.5 chat template (the copy built into lily, `assets/`).
pub fn real_template() -> PathBuf {
    let p = repo().join("assets/qwen3.5-chat_template.jinja");
    assert!(p.exists(), "the real chat template is missing at {}", p.display());
    p
}

/// Bound on logits against the stored mlx-lm fp32 references, as a fraction of each row's logit
/// range. Both sides compute in fp32 from identical (dequantized) weights and differ only in
/// summation order: measured differences are a few 1e-6 of the range; 3e-5 leaves an order of
/// magnitude of margin and stays far below the fixtures' smallest top-1 margin (2e-3 of the
/// scale), so a semantic mistake (norm, head map, RoPE, routing) fails.
pub const REL_TOL: f32 = 3e-5;

/// One stored mlx-lm reference: prompt ids, fp32 logits `[N, vocab]`, greedy continuation.
pub struct Reference {
    pub prompt: Vec<u32>,
    pub logits: Vec<f32>,
    pub greedy: Vec<u32>,
}

pub fn reference(name: &str) -> Reference {
    let path = fixtures().join("ref").join(format!("{name}.safetensors"));
    let f = lily::safetensors::SafeFile::open(&path)
        .unwrap_or_else(|e| panic!("reference fixture {}: {e:#}", path.display()));
    let get = |n: &str| f.tensors.get(n).unwrap_or_else(|| panic!("{}: no tensor `{n}`", path.display()));
    Reference {
        prompt: get("prompt").to_i32().unwrap().into_iter().map(|x| x as u32).collect(),
        logits: get("logits").to_f32().unwrap(),
        greedy: get("greedy").to_i32().unwrap().into_iter().map(|x| x as u32).collect(),
    }
}

/// Every position's logits from `prompt[..split]` prefilled at once on `s`, then the rest fed
/// one token at a time (the decode path).
pub fn prefill_then_decode(s: &mut dyn lily::generate::Session, prompt: &[u32], split: usize) -> Vec<f32> {
    let mut all = s.forward_all(&prompt[..split]).unwrap();
    for &tok in &prompt[split..] {
        all.extend(s.forward_last(&[tok]).unwrap());
    }
    all
}

/// Worst per-position max |Δ| / (that row's logit range), without asserting anything.
pub fn rows_worst(got: &[f32], want: &[f32], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len(), "logits shape");
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .map(|(g, w)| {
            let range = w.iter().cloned().fold(f32::MIN, f32::max) - w.iter().cloned().fold(f32::MAX, f32::min);
            max_abs_diff(g, w) / range
        })
        .fold(0.0, f32::max)
}

/// A fast path's logits against a reference, loosely: per position max |Δ| within `max_rel` of
/// the reference row's logit range, and the same argmax wherever the reference's top-1 margin
/// exceeds twice that position's max |Δ|. Returns every position's |Δ|/range, sorted.
pub fn loose_rows(what: &str, got: &[f32], want: &[f32], vocab: usize, max_rel: f32) -> Vec<f32> {
    assert_eq!(got.len(), want.len(), "{what}: logits shape");
    let mut rel = Vec::new();
    for (i, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let range = w.iter().cloned().fold(f32::MIN, f32::max) - w.iter().cloned().fold(f32::MAX, f32::min);
        let d = max_abs_diff(g, w);
        rel.push(d / range);
        assert!(d <= max_rel * range, "{what} position {i}: max |Δlogit| {d} > {max_rel} of range {range}");
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
        if sorted[0] - sorted[1] > 2.0 * d {
            assert_eq!(lily::sampling::argmax(g), lily::sampling::argmax(w), "{what} position {i}: argmax");
        }
    }
    rel.sort_by(|a, b| a.partial_cmp(b).unwrap());
    rel
}

/// Per position: max |Δ| within REL_TOL of that row's logit range, and the same argmax.
/// Returns the worst |Δ|/range.
pub fn compare_rows(what: &str, got: &[f32], want: &[f32], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: logits shape");
    let mut worst = 0f32;
    for (i, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let range = w.iter().cloned().fold(f32::MIN, f32::max) - w.iter().cloned().fold(f32::MAX, f32::min);
        let d = max_abs_diff(g, w);
        worst = worst.max(d / range);
        assert!(
            d <= REL_TOL * range,
            "{what}: position {i}: max |Δlogit| {d} exceeds {} (range {range})",
            REL_TOL * range
        );
        assert_eq!(lily::sampling::argmax(g), lily::sampling::argmax(w), "{what}: position {i}: argmax differs");
    }
    worst
}
