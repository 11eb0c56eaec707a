//! Time per token of the CPU sampler on the real vocabulary size (248,320 logits, N(0, 3)):
//! greedy, the fast `Sampler::sample` under common settings, and the reference path that sorts
//! the whole distribution (`Sampler::distribution`, what `sample` did before).
//!
//! `cargo run --release --example sampler_bench` (REPS=draws per setting)

use lily::sampling::{argmax, Rng, Sampler, SamplingParams};
use std::time::Instant;

fn main() {
    let reps: usize = std::env::var("REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let mut r = Rng::new(1);
    let v: Vec<f32> = (0..248_320)
        .map(|_| {
            let (a, b) = (r.next_f64().max(1e-12), r.next_f64());
            (3.0 * (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
        })
        .collect();
    let time = |f: &mut dyn FnMut() -> u32| {
        let t = Instant::now();
        let mut x = 0u64;
        for _ in 0..reps {
            x = x.wrapping_add(f() as u64);
        }
        std::hint::black_box(x);
        t.elapsed().as_secs_f64() * 1e3 / reps as f64
    };
    let p = |temperature, top_k, top_p, min_p| SamplingParams { temperature, top_k, top_p, min_p, seed: 5 };
    println!("| setting | fast ms/token | reference (full sort) ms/token |");
    println!("|---|---:|---:|");
    println!("| greedy (argmax) | {:.3} | |", time(&mut || argmax(&v)));
    for (name, sp) in [
        ("temperature 1", p(1.0, 0, 1.0, 0.0)),
        ("temperature 0.7, top_p 0.9", p(0.7, 0, 0.9, 0.0)),
        ("temperature 1, min_p 0.05", p(1.0, 0, 1.0, 0.05)),
        ("temperature 0.6, top_k 20, top_p 0.95 (Qwen's defaults)", p(0.6, 20, 0.95, 0.0)),
    ] {
        let mut fast = Sampler::new(sp.clone());
        let reference = Sampler::new(sp.clone());
        let mut r2 = Rng::new(9);
        let f = time(&mut || fast.sample(&v));
        let slow = time(&mut || {
            let d = reference.distribution(&v);
            let u = r2.next_f64() as f32;
            let mut acc = 0.0;
            d.iter()
                .find(|c| {
                    acc += c.1;
                    u < acc
                })
                .map(|c| c.0)
                .unwrap_or(0)
        });
        println!("| {name} | {f:.3} | {slow:.3} |");
    }
}
