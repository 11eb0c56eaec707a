//! Inner loops of the CPU backend: dtype conversion, dequantization and dot products.
//!
//! Each hot loop has a portable version and an AVX2+FMA version chosen at run time
//! (`is_x86_feature_detected!`), so one binary runs on any x86-64 and uses the vector units where
//! they exist. Tests compare both against naive f64 sums.

use crate::linear::FloatType;
use crate::safetensors::{bf16_to_f32, f16_to_f32};

/// `$f::<T>(args)` with `T` = `$t` for 1 to 8 (nothing otherwise): the multi-token kernels are
/// monomorphised per token count so their accumulators stay in registers.
macro_rules! by_tokens {
    ($t:expr, $f:ident($($a:expr),* $(,)?)) => {
        match $t {
            1 => $f::<1>($($a),*),
            2 => $f::<2>($($a),*),
            3 => $f::<3>($($a),*),
            4 => $f::<4>($($a),*),
            5 => $f::<5>($($a),*),
            6 => $f::<6>($($a),*),
            7 => $f::<7>($($a),*),
            8 => $f::<8>($($a),*),
            _ => {}
        }
    };
}

pub mod q4tile;
pub mod q8;

/// Whether the AVX2+FMA kernels run (they do where the CPU has them, unless LILY_NO_SIMD is set).
#[inline]
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::env::var_os("LILY_NO_SIMD").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the int8 products use AVX-512 VNNI (`vpdpbusd` on 256-bit registers) where the CPU
/// has it: on by default with AVX2, off with `LILY_NO_VNNI` (or [`set_vnni`]). The results are
/// bit-identical either way.
#[inline]
pub fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        VNNI.load(std::sync::atomic::Ordering::Relaxed) && vnni_detected()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

static VNNI: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns the VNNI int8 kernels off (`false`) or back on where the CPU has them (tests and
/// benchmarks compare the two paths).
pub fn set_vnni(on: bool) {
    VNNI.store(on, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(target_arch = "x86_64")]
fn vnni_detected() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        has_avx2()
            && std::env::var_os("LILY_NO_VNNI").is_none()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
    })
}

/// Little-endian float bytes of type `ty` -> f32.
pub fn to_f32(ty: FloatType, src: &[u8], out: &mut [f32]) {
    match ty {
        FloatType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        FloatType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        FloatType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
    }
}

#[inline]
fn scale_at(ty: FloatType, b: &[u8], i: usize) -> f32 {
    match ty {
        FloatType::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
        FloatType::BF16 => bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
        FloatType::F16 => f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
    }
}

/// Dequantizes one packed row: `out[c] = s[c/g]·q[c] + b[c/g]`.
pub fn dequant_row(bits: u32, group: usize, packed: &[u8], s: &[f32], b: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected above.
        return unsafe { avx2::dequant_row(bits, group, packed, s, b, out) };
    }
    dequant_row_portable(bits, group, packed, s, b, out)
}

pub fn dequant_row_portable(bits: u32, group: usize, packed: &[u8], s: &[f32], b: &[f32], out: &mut [f32]) {
    match bits {
        4 => {
            for (c, o) in out.iter_mut().enumerate() {
                let byte = packed[c / 2];
                let q = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                *o = s[c / group] * q as f32 + b[c / group];
            }
        }
        8 => {
            for (c, o) in out.iter_mut().enumerate() {
                *o = s[c / group] * packed[c] as f32 + b[c / group];
            }
        }
        _ => unreachable!("bits checked at load"),
    }
}

// ---- dense dot ------------------------------------------------------------------------------

pub fn dot_dense(ty: FloatType, w: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected above.
        return unsafe { avx2::dot_dense(ty, w, x) };
    }
    dot_dense_portable(ty, w, x)
}

/// One bf16 weight row against `t ≤ 8` inputs at once: `out[i] = Σ_c w[c] · x[i·cols + c]`
/// (`x: [t, cols]`). The row is read and widened once for all the inputs (a batched decode
/// step of a bf16 checkpoint: the weights, which bound decode, are shared by the sequences).
/// Per input the lanes and their order are [`dot_dense`]'s: each output is bit-identical to it.
pub fn dot_bf16_multi(w: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
    let t = out.len();
    assert!(t <= 8 && x.len() == t * cols && w.len() == 2 * cols, "dot_bf16_multi shapes");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected above; the shapes were checked.
        unsafe { avx2::dot_bf16_multi(w, x, cols, out) };
        return;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_dense_portable(FloatType::BF16, w, &x[i * cols..(i + 1) * cols]);
    }
}

/// Whether the AVX-512 kernels run: where the CPU has AVX-512F (with AVX2), unless
/// `LILY_NO_AVX512` is set. Their results are bit-identical to the AVX2 ones.
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx2() && std::env::var_os("LILY_NO_AVX512").is_none() && is_x86_feature_detected!("avx512f")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Four bf16 weight rows (`w[r·rb..r·rb + 2·cols]`, r < 4) against `t ≤ 8` inputs
/// (`x: [t, cols]`): `out[r][i] = Σ_c w_r[c] · x[i·cols + c]`. Each input is loaded once for
/// the four rows; every output is bit-identical to [`dot_dense`] of that row and input.
pub fn dot_bf16_rows4(w: &[u8], rb: usize, x: &[f32], cols: usize, t: usize, out: &mut [[f32; 8]; 4]) {
    assert!(t <= 8 && x.len() == t * cols && rb >= 2 * cols && w.len() >= 3 * rb + 2 * cols, "dot_bf16_rows4 shapes");
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F, AVX2 and FMA were detected above; the shapes were checked.
        unsafe { avx512::dot_bf16_rows4(w, rb, x, cols, t, out) };
        return;
    }
    for (r, o) in out.iter_mut().enumerate() {
        dot_bf16_multi(&w[r * rb..r * rb + 2 * cols], x, cols, &mut o[..t]);
    }
}

static BF16X: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether products with bf16 weights round their inputs to bf16 and use bf16 dot products (`vdpbf16ps` where the CPU has AVX512-BF16): the fast path's counterpart
/// of int8 activations for 4/8-bit weights (mlx-lm computes a bf16 model in bf16 too). Off by
/// default (the library's fp32 reference); the CLI turns it on unless `--exact`.
#[inline]
pub fn bf16_activations() -> bool {
    BF16X.load(std::sync::atomic::Ordering::Relaxed)
}

/// Turns bf16 activations for bf16 weights on or off for the whole process.
pub fn set_bf16_activations(on: bool) {
    BF16X.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the bf16 dot-product kernels ([`dot_bf16x_row`], [`dot_bf16x_rows4`]) run on the
/// CPU's `vdpbf16ps` (AVX512-BF16 and VL, with [`has_avx512`]); elsewhere callers round the
/// inputs to bf16 and use the fp32 kernels, which is what the kernels' own fallback computes.
#[inline]
pub fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx512() && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`dot_bf16x_row`] for four rows (`w[r·rb..r·rb + 2·cols]`, r < 4) at once: `out[r][i]`,
/// bit-identical to the one-row product of each row (each input loaded once for the four).
pub fn dot_bf16x_rows4(w: &[u8], rb: usize, xb: &[u16], cols: usize, t: usize, out: &mut [[f32; 8]; 4]) {
    assert!(t <= 8 && xb.len() == t * cols && rb >= 2 * cols && w.len() >= 3 * rb + 2 * cols, "dot_bf16x_rows4 shapes");
    #[cfg(target_arch = "x86_64")]
    if has_avx512_bf16() {
        // SAFETY: AVX512-BF16/VL/F, AVX2 and FMA were detected above; the shapes were checked.
        unsafe { avx512::dot_bf16x_rows4(w, rb, xb, cols, t, out) };
        return;
    }
    for (r, o) in out.iter_mut().enumerate() {
        dot_bf16x_row(&w[r * rb..r * rb + 2 * cols], xb, cols, &mut o[..t]);
    }
}

/// One bf16 row against `out.len() ≤ 8` bf16 inputs (`xb: [t, cols]`, rounded by the caller):
/// `out[i] = Σ_c w[c] · xb[i·cols + c]` in fp32, with bf16 dot products where the CPU has
/// AVX512-BF16. What an input gets does not depend on how many there are or on the others (the
/// batched-vs-alone property of the decode step), on every CPU.
pub fn dot_bf16x_row(w: &[u8], xb: &[u16], cols: usize, out: &mut [f32]) {
    assert!(out.len() <= 8 && xb.len() == out.len() * cols && w.len() == 2 * cols, "dot_bf16x_row shapes");
    #[cfg(target_arch = "x86_64")]
    if has_avx512_bf16() {
        // SAFETY: AVX512-BF16/VL/F, AVX2 and FMA were detected above; the shapes were checked.
        unsafe { avx512::dot_bf16x_row(w, xb, cols, out) };
        return;
    }
    let mut xf = vec![0f32; cols];
    for (i, o) in out.iter_mut().enumerate() {
        for (f, &b) in xf.iter_mut().zip(&xb[i * cols..(i + 1) * cols]) {
            *f = bf16_to_f32(b);
        }
        *o = dot_dense(FloatType::BF16, w, &xf);
    }
}

pub fn dot_dense_portable(ty: FloatType, w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n = x.len();
    for i in 0..n {
        acc[i % 8] += scale_at(ty, w, i) * x[i];
    }
    acc.iter().sum()
}

/// Plain f32 dot product, 8 lanes.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected above.
        return unsafe { avx2::dot_f32(a, b) };
    }
    dot_f32_portable(a, b)
}

pub fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

// ---- quantized dot --------------------------------------------------------------------------

/// `Σ_c W[c] x[c]` for one packed row, with `gsum[g] = Σ_{c in group g} x[c]`.
#[allow(clippy::too_many_arguments)]
pub fn dot_quant(
    bits: u32,
    group: usize,
    sty: FloatType,
    packed: &[u8],
    scales: &[u8],
    biases: &[u8],
    x: &[f32],
    gsum: &[f32],
) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        if sty == FloatType::BF16 {
            // SAFETY: AVX2 and FMA were detected above; slice lengths are checked inside.
            return unsafe { avx2::dot_quant_bf16(bits, group, packed, scales, biases, x, gsum) };
        }
        // SAFETY: as above.
        return unsafe { avx2::dot_quant(bits, group, sty, packed, scales, biases, x, gsum) };
    }
    dot_quant_portable(bits, group, sty, packed, scales, biases, x, gsum)
}

/// `out[t] = Σ_c W[c] x[t, c]` for `out.len() ≤ 4` tokens of width `cols` sharing one decode of
/// the packed row (`gsum: [t, cols/group]`).
pub fn dot_quant_multi(
    bits: u32,
    group: usize,
    sty: FloatType,
    packed: &[u8],
    scales: &[u8],
    biases: &[u8],
    x: &[f32],
    cols: usize,
    gsum: &[f32],
    out: &mut [f32],
) {
    let ng = cols / group;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && sty == FloatType::BF16 && out.len() <= 4 {
        // SAFETY: AVX2 and FMA were detected above; lengths are checked inside.
        return unsafe { avx2::dot_quant_bf16_multi(bits, group, packed, scales, biases, x, cols, gsum, out) };
    }
    for (t, o) in out.iter_mut().enumerate() {
        *o = dot_quant(
            bits,
            group,
            sty,
            packed,
            scales,
            biases,
            &x[t * cols..(t + 1) * cols],
            &gsum[t * ng..(t + 1) * ng],
        );
    }
}

#[allow(clippy::too_many_arguments)]
pub fn dot_quant_portable(
    bits: u32,
    group: usize,
    sty: FloatType,
    packed: &[u8],
    scales: &[u8],
    biases: &[u8],
    x: &[f32],
    gsum: &[f32],
) -> f32 {
    let mut total = 0f32;
    for g in 0..x.len() / group {
        let xs = &x[g * group..(g + 1) * group];
        let mut acc = [0f32; 8];
        if bits == 4 {
            let ps = &packed[g * group / 2..(g + 1) * group / 2];
            for (i, &byte) in ps.iter().enumerate() {
                acc[(2 * i) % 8] += (byte & 15) as f32 * xs[2 * i];
                acc[(2 * i + 1) % 8] += (byte >> 4) as f32 * xs[2 * i + 1];
            }
        } else {
            let ps = &packed[g * group..(g + 1) * group];
            for (i, &q) in ps.iter().enumerate() {
                acc[i % 8] += q as f32 * xs[i];
            }
        }
        let sq: f32 = acc.iter().sum();
        total += scale_at(sty, scales, g) * sq + scale_at(sty, biases, g) * gsum[g];
    }
    total
}

/// `out[t·ldo + i] = Σ_k tile[i, k] · x[t, k]` for a small block of dequantized rows.
///
/// # Safety
/// `out` must be valid for writes at `t·ldo + i` for every `t < t`, `i < nr`.
pub unsafe fn gemm_tile_strided(tile: &[f32], nr: usize, k: usize, x: &[f32], t: usize, out: *mut f32, ldo: usize) {
    assert!(tile.len() >= nr * k && x.len() >= t * k);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && k.is_multiple_of(8) {
        // SAFETY: AVX2 and FMA were detected above; k is a multiple of 8; `out` per the contract.
        return unsafe { avx2::gemm_tile(tile, nr, k, x, t, out, ldo) };
    }
    for tt in 0..t {
        let xr = &x[tt * k..(tt + 1) * k];
        for i in 0..nr {
            // SAFETY: per the contract.
            unsafe { *out.add(tt * ldo + i) = dot_f32(&tile[i * k..(i + 1) * k], xr) };
        }
    }
}

/// `tile[k·stride + col] = row[k]` for every k (builds a k-major tile one row at a time).
pub fn scatter_column(row: &[f32], tile: &mut [f32], stride: usize, col: usize) {
    assert!(col < stride && tile.len() >= row.len() * stride);
    let p = tile.as_mut_ptr();
    for (kk, v) in row.iter().enumerate() {
        // SAFETY: kk·stride + col < row.len()·stride ≤ tile.len(), checked above.
        unsafe { *p.add(kk * stride + col) = *v };
    }
}

/// `out[t·ldo + i] (+)= Σ_{k<kc} tile[k·16 + i] · x[t·ldx + k]` for `i < nr ≤ 16` (k-major tile of
/// 16 rows); with `accumulate` the sums are added to what `out` holds.
///
/// # Safety
/// AVX2+FMA must be available (`has_avx2()`), and `out` valid for reads/writes at `t·ldo + i`.
pub unsafe fn gemm_kmajor16(
    tile: &[f32],
    kc: usize,
    x: &[f32],
    ldx: usize,
    t: usize,
    out: *mut f32,
    ldo: usize,
    nr: usize,
    accumulate: bool,
) {
    assert!(tile.len() >= 16 * kc && nr <= 16 && kc <= ldx);
    assert!(t == 0 || x.len() >= (t - 1) * ldx + kc);
    #[cfg(target_arch = "x86_64")]
    {
        assert!(has_avx2());
        // SAFETY: checked above; `out` per the contract.
        unsafe { avx2::gemm_kmajor16(tile, kc, x, ldx, t, out, ldo, nr, accumulate) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("callers check has_avx2()")
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
