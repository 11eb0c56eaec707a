//! Micro-benchmark of the CPU gated delta rule (`cpu::gdn::recurrent`) on the Qwen3.6-35B-A3B
//! GDN shape (H_k 16, H_v 32, D_k = D_v = 128): ms per call for T tokens, best of `REPS` (10).
//! `cargo run --release --example gdn_cpu [threads] [T]`.

use lily::cpu::gdn::{recurrent, GdnDims, GdnInputs};
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let t: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(64);
    let reps: usize = std::env::var("REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let d = GdnDims { hk: 16, hv: 32, dk: 128, dv: 128 };
    let f = |n: usize, a: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32 * 0.37).sin()) * a).collect() };
    let (q, k, v) = (f(t * d.hk * d.dk, 0.08), f(t * d.hk * d.dk, 0.08), f(t * d.hv * d.dv, 1.0));
    let g: Vec<f32> = (0..t * d.hv).map(|i| -0.1 - 0.01 * (i % 7) as f32).collect();
    let beta = vec![0.5f32; t * d.hv];
    let x = GdnInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
    let mut state = vec![0f32; d.hv * d.dk * d.dv];
    let mut out = vec![0f32; t * d.hv * d.dv];
    let mut best = f64::MAX;
    for _ in 0..reps {
        let s = Instant::now();
        recurrent(d, t, &x, &mut state, &mut out);
        best = best.min(s.elapsed().as_secs_f64());
    }
    println!("threads {threads}: gdn recurrent, {t} tokens: best {:.2} ms", best * 1e3);
}
