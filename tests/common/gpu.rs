//! GPU test helpers: the device (or a loud skip), random weights in every checkpoint format, and
//! an NMSE check that prints what it measured.

use super::*;
use lily::cuda::Gpu;
use lily::linear::{FloatType, Linear};
use lily::safetensors::{f32_to_bf16, Bytes};
use lily::sampling::Rng;
use std::sync::Arc;

pub fn gpu() -> Option<Arc<Gpu>> {
    if let Err(e) = lily::cuda::probe() {
        eprintln!("SKIPPED (no GPU): {e:#}");
        return None;
    }
    Some(lily::cuda::gpu().unwrap_or_else(|e| panic!("CUDA libraries present but the GPU failed: {e:#}")))
}

pub fn rand_bytes(r: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| r.next_u64() as u8).collect()
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| f32_to_bf16(*x).to_le_bytes()).collect()
}

/// Random f16 bit patterns with magnitudes in about [2^-6, 2^2].
pub fn f16_bytes(r: &mut Rng, n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            let s = (r.next_u64() & 1) as u16;
            let e = 9 + (r.next_u64() % 8) as u16;
            let m = (r.next_u64() & 0x3ff) as u16;
            ((s << 15) | (e << 10) | m).to_le_bytes()
        })
        .collect()
}

pub fn quant(r: &mut Rng, rows: usize, cols: usize, bits: u32, group: usize) -> Linear {
    let packed = rand_bytes(r, rows * cols * bits as usize / 8);
    let ng = rows * cols / group;
    let s = bf16_bytes(&uniform(r, ng, 0.05));
    let b = bf16_bytes(&uniform(r, ng, 0.2));
    Linear::quant(
        rows,
        cols,
        bits,
        group,
        Bytes::from_vec(packed),
        Bytes::from_vec(s),
        Bytes::from_vec(b),
        FloatType::BF16,
    )
    .unwrap()
}

pub fn dense(r: &mut Rng, rows: usize, cols: usize, ty: FloatType) -> Linear {
    let data = match ty {
        FloatType::F32 => uniform(r, rows * cols, 1.0).iter().flat_map(|x| x.to_le_bytes()).collect(),
        FloatType::BF16 => bf16_bytes(&uniform(r, rows * cols, 1.0)),
        FloatType::F16 => f16_bytes(r, rows * cols),
    };
    Linear::dense(rows, cols, ty, Bytes::from_vec(data)).unwrap()
}

pub fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite output");
    let e = nmse(got, want);
    eprintln!("{what}: nmse {e:.2e}");
    assert!(e <= tol, "{what}: nmse {e:.3e} > {tol:.0e}");
}
