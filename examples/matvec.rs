//! Micro-benchmark of the CPU quantized matrix-vector product (lm_head-sized, 4-bit, group 64):
//! best-of-N GB/s of weights streamed. `cargo run --release --example matvec [threads] [rows]`;
//! `LILY_CPU_INT8=1` times the int8-activation kernels; `HUGE=1` asks for transparent huge pages
//! (madvise) on the weights before they are written.

use lily::linear::{FloatType, Linear};
use lily::safetensors::Bytes;
use std::time::Instant;

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let rows: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(248_320);
    let (cols, group) = (2048usize, 64usize);
    let n = rows * cols / 2;
    let mut packed: Vec<u8> = Vec::with_capacity(n);
    if std::env::var_os("HUGE").is_some() {
        let (p, a) = (packed.as_mut_ptr() as usize, 2usize << 20);
        let start = p.div_ceil(a) * a;
        let end = (p + n) / a * a;
        if end > start {
            // SAFETY: advice on a range inside this allocation.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    packed.extend((0..n).map(|i| ((i * 2654435761usize) >> 7) as u8));
    let ng = rows * cols / group;
    let scales: Vec<u8> = (0..ng).flat_map(|_| 0x3c00u16.to_le_bytes()).collect();
    let lin = Linear::quant(
        rows,
        cols,
        4,
        group,
        Bytes::from_vec(packed),
        Bytes::from_vec(scales.clone()),
        Bytes::from_vec(scales),
        FloatType::BF16,
    )
    .unwrap();
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.01).sin()).collect();
    let mut y = vec![0f32; rows];
    let mut best = f64::MAX;
    for _ in 0..(15 * 248_320 / rows).max(15) {
        let t = Instant::now();
        lin.matvec(&x, &mut y);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let mode = if lily::cpu::kernels::q8::cpu_int8() { "int8 x" } else { "fp32 x" };
    println!(
        "threads {threads}, {mode}: matvec {rows}x{cols} 4-bit: best {:.2} ms, {:.2} GB/s",
        best * 1e3,
        lin.nbytes() as f64 / best / 1e9
    );
}
