//! Micro-benchmark of the CPU quantized matrix-matrix product (prefill), best-of-N GFLOP/s.
//! `cargo run --release --example matmul [threads] [tokens]`;
//! `LILY_CPU_INT8=1` times the int8-activation kernels (x quantized once, outside the timing).
//! `ROWS` (default 4096) sets the matrix height, `REPS` (default 10) the number of runs;
//! `BF16=1` times a bf16 matrix instead of the 4-bit one (`LILY_NO_AVX512=1`: the AVX2 kernel;
//! `BF16X=1`: with bf16 activations).

use lily::linear::{FloatType, Linear};
use lily::safetensors::Bytes;
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let t: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(64);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let rows: usize = std::env::var("ROWS").ok().and_then(|s| s.parse().ok()).unwrap_or(4096);
    let cols: usize = std::env::var("COLS").ok().and_then(|s| s.parse().ok()).unwrap_or(2048);
    let group = 64usize;
    let packed: Vec<u8> = (0..rows * cols / 2).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
    let ng = rows * cols / group;
    let scales: Vec<u8> = (0..ng).flat_map(|_| 0x3c00u16.to_le_bytes()).collect();
    let bf16 = std::env::var_os("BF16").is_some();
    lily::cpu::kernels::set_bf16_activations(std::env::var_os("BF16X").is_some());
    let lin = if bf16 {
        let w: Vec<u8> = (0..rows * cols).flat_map(|i| (0x3c00u16 + (i % 251) as u16).to_le_bytes()).collect();
        Linear::dense(rows, cols, FloatType::BF16, Bytes::from_vec(w)).unwrap()
    } else {
        Linear::quant(
            rows,
            cols,
            4,
            group,
            Bytes::from_vec(packed),
            Bytes::from_vec(scales.clone()),
            Bytes::from_vec(scales),
            FloatType::BF16,
        )
        .unwrap()
    };
    let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.01).sin()).collect();
    let mut y = vec![0f32; t * rows];
    let mut best = f64::MAX;
    let xa = (!bf16 && lily::cpu::kernels::q8::cpu_int8()).then(|| lin.quantize_input(&x));
    for _ in 0..std::env::var("REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(10) {
        let s = Instant::now();
        if let Some(xa) = &xa {
            // The kernel alone: x quantized once, outside the timing.
            std::hint::black_box(lily::linear::matmul_q8_batch(&[(&lin, xa)]));
        } else {
            lin.matmul(&x, &mut y);
        }
        best = best.min(s.elapsed().as_secs_f64());
    }
    let mode = if xa.is_some() { "int8 x" } else { "fp32 x" };
    let wfmt = if bf16 { "bf16" } else { "4-bit" };
    println!(
        "threads {threads}, {mode}: matmul {rows}x{cols} {wfmt} × {t} tokens: best {:.2} ms, {:.1} GFLOP/s",
        best * 1e3,
        2.0 * (rows * cols * t) as f64 / best / 1e9
    );
}
