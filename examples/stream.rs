//! Micro-benchmark of decode-shaped weight streaming with int8 activations: per "layer" the
//! products one decode token runs on the 35B-A3B shapes (GDN input projections, the GDN output,
//! the gate/up products of 9 experts, their down products), each a batched parallel loop, over
//! `LAYERS` (default 16, 558 MB: far more than the L3) distinct layers. Prints the `REPS` runs'
//! GB/s of weights streamed. `cargo run --release --example stream [threads]`; `HUGE=1` asks for
//! transparent huge pages (madvise) on the packed weights.

use lily::cpu::kernels::q8::Q8Act;
use lily::linear::{matmul_q8_batch, FloatType, Linear};
use lily::safetensors::Bytes;
use std::time::Instant;

fn matrix(rows: usize, cols: usize, seed: usize) -> Linear {
    let group = 64;
    let n = rows * cols / 2;
    let mut packed: Vec<u8> = Vec::with_capacity(n);
    if std::env::var_os("HUGE").is_some() {
        let (p, a) = (packed.as_mut_ptr() as usize, 2usize << 20);
        let (start, end) = (p.div_ceil(a) * a, (p + n) / a * a);
        if end > start {
            // SAFETY: advice on a range inside this allocation.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    packed.extend((0..n).map(|i| (((i + seed) * 2654435761usize) >> 7) as u8));
    let scales: Vec<u8> = (0..rows * cols / group).flat_map(|_| 0x3c00u16.to_le_bytes()).collect();
    let (s, b) = (Bytes::from_vec(scales.clone()), Bytes::from_vec(scales));
    Linear::quant(rows, cols, 4, group, Bytes::from_vec(packed), s, b, FloatType::BF16).unwrap()
}

struct Layer {
    in_proj: Linear,
    out: Linear,
    gate_up: Vec<Linear>,
    down: Vec<Linear>,
}

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().unwrap();
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|s| s.parse().ok()).unwrap_or(d);
    let (nl, reps) = (env("LAYERS", 16), env("REPS", 5));
    let (hid, inter, gdn_rows, vd) = (2048, 512, 12352, 4096);
    let layers: Vec<Layer> = (0..nl)
        .map(|l| Layer {
            in_proj: matrix(gdn_rows, hid, l),
            out: matrix(hid, vd, l + 1),
            gate_up: (0..18).map(|e| matrix(inter, hid, l * 100 + e)).collect(),
            down: (0..9).map(|e| matrix(hid, inter, l * 200 + e)).collect(),
        })
        .collect();
    let bytes: usize = layers
        .iter()
        .map(|l| {
            l.in_proj.nbytes()
                + l.out.nbytes()
                + l.gate_up.iter().map(|m| m.nbytes()).sum::<usize>()
                + l.down.iter().map(|m| m.nbytes()).sum::<usize>()
        })
        .sum();
    let xs = |n: usize| -> Vec<f32> { (0..n).map(|i| (i as f32 * 0.01).sin()).collect() };
    let (xh, xv, xi) = (xs(hid), xs(vd), xs(inter));
    let one_token = || {
        for l in &layers {
            let a = l.in_proj.quantize_input(&xh);
            std::hint::black_box(matmul_q8_batch(&[(&l.in_proj, &a)]));
            let a = l.out.quantize_input(&xv);
            std::hint::black_box(matmul_q8_batch(&[(&l.out, &a)]));
            let a = l.gate_up[0].quantize_input(&xh);
            let jobs: Vec<(&Linear, &Q8Act)> = l.gate_up.iter().map(|m| (m, &a)).collect();
            std::hint::black_box(matmul_q8_batch(&jobs));
            let acts: Vec<Q8Act> = l.down.iter().map(|m| m.quantize_input(&xi)).collect();
            let jobs: Vec<(&Linear, &Q8Act)> = l.down.iter().zip(&acts).collect();
            std::hint::black_box(matmul_q8_batch(&jobs));
        }
    };
    let mut gbs = Vec::new();
    // Inside the pool, as `Model::forward` runs.
    rayon::scope(|_| {
        for _ in 0..reps {
            let s = Instant::now();
            one_token();
            gbs.push(bytes as f64 / s.elapsed().as_secs_f64() / 1e9);
        }
    });
    gbs.sort_by(|a, b| b.total_cmp(a));
    let gbs: Vec<String> = gbs.iter().map(|g| format!("{g:.2}")).collect();
    println!(
        "threads {threads}: {nl} decode-shaped layers, {:.0} MB: GB/s, best first: {}",
        bytes as f64 / 1e6,
        gbs.join(" ")
    );
}
