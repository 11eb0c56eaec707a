//! Helpers shared by the integration tests: a seeded RNG and error measures.
#![allow(dead_code)]

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

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The shared Qwen3.6 tokenizer directory; panics (fails the test loudly) when it is missing.
pub fn shared_tokenizer_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data/qwen3.6-tokenizer");
    assert!(
        d.join("tokenizer.json").exists(),
        "the shared Qwen3.6 tokenizer is missing at {} (tests need ../shared beside the checkout)",
        d.display()
    );
    d
}
