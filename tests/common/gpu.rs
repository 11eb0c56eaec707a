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

/// synthetic:tiny with 8 query heads per KV head (the tensor-core decode attention's and the fp8
/// cache's shape), on the CPU and uploaded.
pub fn tiny_g8() -> (Arc<lily::model::Model>, Arc<lily::cuda::CudaModel>) {
    let mut cfg = lily::synthetic::config("tiny", None, 1024).unwrap();
    cfg.num_attention_heads = 8 * cfg.num_key_value_heads;
    let model = Arc::new(lily::synthetic::build_config(cfg).unwrap());
    let gm = lily::cuda::upload_cached(&model).unwrap();
    (model, gm)
}

/// Whether `gm`'s GPU takes the fp8 KV cache (sm_89+), else a loud skip.
pub fn fp8_ok(gm: &lily::cuda::CudaModel) -> bool {
    let ok = gm.gpu.has_fp8();
    if !ok {
        eprintln!("SKIPPED: the fp8 cache needs an sm_89 or later GPU (this one is {})", gm.gpu.arch);
    }
    ok
}

pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|i| i.to_le_bytes()).collect()
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
    quant_ty(r, rows, cols, bits, group, FloatType::BF16)
}

/// [`quant`] with scales and biases of type `ty` (bf16: uniform magnitudes; f16: random bit
/// patterns of magnitude 2^-6..2^2, see [`f16_bytes`]).
pub fn quant_ty(r: &mut Rng, rows: usize, cols: usize, bits: u32, group: usize, ty: FloatType) -> Linear {
    let packed = rand_bytes(r, rows * cols * bits as usize / 8);
    let ng = rows * cols / group;
    let (s, b) = match ty {
        FloatType::F16 => (f16_bytes(r, ng), f16_bytes(r, ng)),
        _ => (bf16_bytes(&uniform(r, ng, 0.05)), bf16_bytes(&uniform(r, ng, 0.2))),
    };
    Linear::quant(rows, cols, bits, group, Bytes::from_vec(packed), Bytes::from_vec(s), Bytes::from_vec(b), ty).unwrap()
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

/// A GDN layer's fixed CPU-side weights for the reference steps below.
pub struct GdnWeights<'a> {
    pub d: lily::cpu::gdn::GdnDims,
    /// `[C, taps]` with C = 2·H_k·D_k + H_v·D_v.
    pub conv_w: &'a [f32],
    pub taps: usize,
    pub neg_a: &'a [f32],
    pub dt_bias: &'a [f32],
    pub norm: &'a [f32],
}

/// Model::gdn's CPU steps for `t` tokens after the input projections: causal conv + SiLU (conv
/// state carried), q/k L2 norms, gates, the recurrent delta rule (state carried), gated RMSNorm.
/// Inputs `qkv: [t, C]`, `z: [t, H_v·D_v]`, `b, a: [t, H_v]`; returns (conv `[t, C]`, out
/// `[t, H_v·D_v]`).
#[allow(clippy::too_many_arguments)]
pub fn cpu_gdn(
    w: &GdnWeights,
    t: usize,
    qkv: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    cstate: &mut [f32],
    rec: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    cpu_gdn_with(w, t, qkv, z, b, a, cstate, rec, None)
}

/// [`cpu_gdn`] with the delta rule in the chunked (WY) form of chunk length `chunk`, or the
/// recurrent one for `None`.
#[allow(clippy::too_many_arguments)]
pub fn cpu_gdn_with(
    w: &GdnWeights,
    t: usize,
    qkv: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    cstate: &mut [f32],
    rec: &mut [f32],
    chunk: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    use lily::cpu::conv::causal_conv1d_silu;
    use lily::cpu::gdn::{chunked, recurrent, GdnInputs};
    use lily::cpu::norm::{gated_rms_norm, l2_norm, sigmoid, softplus};
    let d = w.d;
    let (kd, vd, hv) = (d.hk * d.dk, d.hv * d.dv, d.hv);
    let cd = 2 * kd + vd;
    let mut conv = vec![0f32; t * cd];
    causal_conv1d_silu(qkv, t, cd, w.conv_w, w.taps, cstate, &mut conv);
    let mut q: Vec<f32> = conv.chunks(cd).flat_map(|row| row[..kd].to_vec()).collect();
    let mut kk: Vec<f32> = conv.chunks(cd).flat_map(|row| row[kd..2 * kd].to_vec()).collect();
    let v: Vec<f32> = conv.chunks(cd).flat_map(|row| row[2 * kd..].to_vec()).collect();
    l2_norm(&mut q, d.dk, 1e-6, 1.0 / (d.dk as f32).sqrt());
    l2_norm(&mut kk, d.dk, 1e-6, 1.0);
    let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
    let gd: Vec<f32> = a.iter().enumerate().map(|(i, &x)| w.neg_a[i % hv] * softplus(x + w.dt_bias[i % hv])).collect();
    let mut o = vec![0f32; t * vd];
    let x = GdnInputs { q: &q, k: &kk, v: &v, g: &gd, beta: &beta };
    match chunk {
        Some(c) => chunked(d, t, &x, rec, &mut o, c),
        None => recurrent(d, t, &x, rec, &mut o),
    }
    gated_rms_norm(&mut o, z, w.norm, 1e-6);
    (conv, o)
}
