//! Inner loops of the CPU backend: dtype conversion, dequantization and dot products.
//!
//! Each hot loop has a portable version and an AVX2+FMA version chosen at run time
//! (`is_x86_feature_detected!`), so one binary runs on any x86-64 and uses the vector units where
//! they exist. Tests compare both against naive f64 sums.

use crate::linear::FloatType;
use crate::safetensors::{bf16_to_f32, f16_to_f32};

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
mod avx2 {
    use super::scale_at;
    use crate::linear::FloatType;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// 6 tokens × 16 rows per step: 12 accumulators, two tile loads and six broadcasts per k.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemm_kmajor16(
        tile: &[f32],
        k: usize,
        x: &[f32],
        ldx: usize,
        t: usize,
        out: *mut f32,
        ldo: usize,
        nr: usize,
        acc: bool,
    ) {
        let mut t0 = 0;
        while t0 < t {
            match t - t0 {
                1 => micro16::<1>(tile, k, x, ldx, t0, out, ldo, nr, acc),
                2 => micro16::<2>(tile, k, x, ldx, t0, out, ldo, nr, acc),
                3 => micro16::<3>(tile, k, x, ldx, t0, out, ldo, nr, acc),
                4 => micro16::<4>(tile, k, x, ldx, t0, out, ldo, nr, acc),
                5 => micro16::<5>(tile, k, x, ldx, t0, out, ldo, nr, acc),
                _ => micro16::<6>(tile, k, x, ldx, t0, out, ldo, nr, acc),
            }
            t0 += (t - t0).min(6);
        }
    }

    #[inline(always)]
    unsafe fn micro16<const NT: usize>(
        tile: &[f32],
        k: usize,
        x: &[f32],
        ldx: usize,
        t0: usize,
        out: *mut f32,
        ldo: usize,
        nr: usize,
        accumulate: bool,
    ) {
        let (pt, px) = (tile.as_ptr(), x.as_ptr().add(t0 * ldx));
        let mut acc = [[_mm256_setzero_ps(); 2]; NT];
        for kk in 0..k {
            let w0 = _mm256_loadu_ps(pt.add(kk * 16));
            let w1 = _mm256_loadu_ps(pt.add(kk * 16 + 8));
            for j in 0..NT {
                let xv = _mm256_broadcast_ss(&*px.add(j * ldx + kk));
                acc[j][0] = _mm256_fmadd_ps(w0, xv, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(w1, xv, acc[j][1]);
            }
        }
        for j in 0..NT {
            let o = out.add((t0 + j) * ldo);
            let mut tmp = [0f32; 16];
            if accumulate {
                std::ptr::copy_nonoverlapping(o, tmp.as_mut_ptr(), nr);
            }
            let prev = [_mm256_loadu_ps(tmp.as_ptr()), _mm256_loadu_ps(tmp.as_ptr().add(8))];
            _mm256_storeu_ps(tmp.as_mut_ptr(), _mm256_add_ps(prev[0], acc[j][0]));
            _mm256_storeu_ps(tmp.as_mut_ptr().add(8), _mm256_add_ps(prev[1], acc[j][1]));
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, nr);
        }
    }

    /// Dequantizes one packed row (8 elements per step).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dequant_row(bits: u32, group: usize, packed: &[u8], s: &[f32], b: &[f32], out: &mut [f32]) {
        let n = out.len();
        assert!(packed.len() * 8 >= n * bits as usize && s.len() * group >= n && b.len() * group >= n);
        let pp = packed.as_ptr();
        let po = out.as_mut_ptr();
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mask = _mm256_set1_epi32(15);
        for g in 0..n / group {
            let sv = _mm256_set1_ps(s[g]);
            let bv = _mm256_set1_ps(b[g]);
            let mut c = g * group;
            while c < (g + 1) * group {
                let q = if bits == 4 {
                    let w = (pp.add(c / 2) as *const u32).read_unaligned();
                    _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts), mask)
                } else {
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(pp.add(c) as *const __m128i))
                };
                _mm256_storeu_ps(po.add(c), _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sv, bv));
                c += 8;
            }
        }
    }

    /// `out[t, i] = Σ_k a[i, k] x[t, k]`, register-blocked 4 rows × 2 tokens; `k % 8 == 0`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemm_tile(a: &[f32], nr: usize, k: usize, x: &[f32], t: usize, out: *mut f32, ldo: usize) {
        assert!(a.len() >= nr * k && x.len() >= t * k && k.is_multiple_of(8));
        let (pa, px) = (a.as_ptr(), x.as_ptr());
        let mut i0 = 0;
        while i0 < nr {
            let ri = (nr - i0).min(4);
            let mut t0 = 0;
            while t0 < t {
                let tj = (t - t0).min(2);
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                let mut kk = 0;
                while kk < k {
                    let xv = [_mm256_loadu_ps(px.add(t0 * k + kk)), _mm256_loadu_ps(px.add((t0 + tj - 1) * k + kk))];
                    for r in 0..4 {
                        let av = _mm256_loadu_ps(pa.add((i0 + r.min(ri - 1)) * k + kk));
                        acc[r][0] = _mm256_fmadd_ps(av, xv[0], acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(av, xv[1], acc[r][1]);
                    }
                    kk += 8;
                }
                for r in 0..ri {
                    for j in 0..tj {
                        *out.add((t0 + j) * ldo + i0 + r) = hsum(acc[r][j]);
                    }
                }
                t0 += tj;
            }
            i0 += ri;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), acc1);
            i += 16;
        }
        if i + 8 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// See [`super::dot_bf16_multi`]: one accumulator per input, the row widened once per 8
    /// columns (T monomorphised so the accumulators stay in registers).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_bf16_multi(w: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
        match out.len() {
            1 => bf16_multi::<1>(w, x, cols, out),
            2 => bf16_multi::<2>(w, x, cols, out),
            3 => bf16_multi::<3>(w, x, cols, out),
            4 => bf16_multi::<4>(w, x, cols, out),
            5 => bf16_multi::<5>(w, x, cols, out),
            6 => bf16_multi::<6>(w, x, cols, out),
            7 => bf16_multi::<7>(w, x, cols, out),
            8 => bf16_multi::<8>(w, x, cols, out),
            _ => {}
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn bf16_multi<const T: usize>(w: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
        let (pw, px) = (w.as_ptr(), x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); T];
        let mut i = 0;
        while i + 8 <= cols {
            let h = _mm_loadu_si128(pw.add(2 * i) as *const __m128i);
            let f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(f, _mm256_loadu_ps(px.add(t * cols + i)), *a);
            }
            i += 8;
        }
        for (t, o) in out.iter_mut().enumerate() {
            let mut s = hsum(acc[t]);
            for c in i..cols {
                s += scale_at(FloatType::BF16, w, c) * x[t * cols + c];
            }
            *o = s;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_dense(ty: FloatType, w: &[u8], x: &[f32]) -> f32 {
        let n = x.len();
        let px = x.as_ptr();
        let pw = w.as_ptr();
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        match ty {
            FloatType::BF16 => {
                while i + 8 <= n {
                    let h = _mm_loadu_si128(pw.add(2 * i) as *const __m128i);
                    let f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                    acc = _mm256_fmadd_ps(f, _mm256_loadu_ps(px.add(i)), acc);
                    i += 8;
                }
            }
            FloatType::F16 => {
                while i + 8 <= n {
                    let h = _mm_loadu_si128(pw.add(2 * i) as *const __m128i);
                    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(px.add(i)), acc);
                    i += 8;
                }
            }
            FloatType::F32 => {
                while i + 8 <= n {
                    let f = _mm256_loadu_ps(pw.add(4 * i) as *const f32);
                    acc = _mm256_fmadd_ps(f, _mm256_loadu_ps(px.add(i)), acc);
                    i += 8;
                }
            }
        }
        let mut s = hsum(acc);
        while i < n {
            s += scale_at(ty, w, i) * x[i];
            i += 1;
        }
        s
    }

    /// Dispatches to a kernel monomorphised for (bits, group) with bf16 scales and biases.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_quant_bf16(
        bits: u32,
        group: usize,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        x: &[f32],
        gsum: &[f32],
    ) -> f32 {
        let n = x.len();
        assert!(packed.len() * 8 >= n * bits as usize && scales.len() * group >= 2 * n && biases.len() >= scales.len());
        assert!(gsum.len() * group >= n);
        let (p, s, b) = (packed.as_ptr(), scales.as_ptr() as *const u16, biases.as_ptr() as *const u16);
        match (bits, group) {
            (4, 32) => dot_qk::<4, 32>(p, s, b, x, gsum),
            (4, 64) => dot_qk::<4, 64>(p, s, b, x, gsum),
            (4, 128) => dot_qk::<4, 128>(p, s, b, x, gsum),
            (8, 32) => dot_qk::<8, 32>(p, s, b, x, gsum),
            (8, 64) => dot_qk::<8, 64>(p, s, b, x, gsum),
            _ => dot_qk::<8, 128>(p, s, b, x, gsum),
        }
    }

    #[inline(always)]
    unsafe fn bf16_at(p: *const u16, i: usize) -> f32 {
        f32::from_bits((p.add(i).read_unaligned() as u32) << 16)
    }

    /// One packed row · x for a fixed (BITS, GROUP): `Σ_g s_g·Σ q·x + b_g·gsum_g`.
    #[inline(always)]
    unsafe fn dot_qk<const BITS: usize, const GROUP: usize>(
        pp: *const u8,
        sp: *const u16,
        bp: *const u16,
        x: &[f32],
        gsum: &[f32],
    ) -> f32 {
        let ng = x.len() / GROUP;
        dot_qk_n::<BITS, GROUP, 1>(pp, sp, bp, x.as_ptr(), 0, gsum.as_ptr(), 0, ng)[0]
    }

    /// One packed row against NT token vectors at once (`x + j·ldx`, group sums at `gsum + j·ldg`):
    /// each weight is decoded once and multiplied into NT accumulators.
    #[inline(always)]
    unsafe fn dot_qk_n<const BITS: usize, const GROUP: usize, const NT: usize>(
        pp: *const u8,
        sp: *const u16,
        bp: *const u16,
        px: *const f32,
        ldx: usize,
        pg: *const f32,
        ldg: usize,
        ng: usize,
    ) -> [f32; NT] {
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mask = _mm256_set1_epi32(15);
        let mut tot = [_mm256_setzero_ps(); NT];
        let mut svec = _mm256_setzero_ps();
        // With one token, four accumulators hide the FMA latency; with more, the tokens do.
        const fn lanes(nt: usize) -> usize {
            if nt == 1 {
                4
            } else {
                2
            }
        }
        for g in 0..ng {
            if g % 8 == 0 {
                svec = load_bf16x8(sp, g, ng);
            }
            let base = g * GROUP;
            let mut acc = [[_mm256_setzero_ps(); 4]; NT];
            let mut j = 0;
            while j < GROUP / 8 {
                let e = base + 8 * j;
                let q = if BITS == 4 {
                    let w = (pp.add(e / 2) as *const u32).read_unaligned();
                    _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts), mask)
                } else {
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(pp.add(e) as *const __m128i))
                };
                let qf = _mm256_cvtepi32_ps(q);
                let l = j % lanes(NT);
                for t in 0..NT {
                    acc[t][l] = _mm256_fmadd_ps(qf, _mm256_loadu_ps(px.add(t * ldx + e)), acc[t][l]);
                }
                j += 1;
            }
            let s = _mm256_permutevar8x32_ps(svec, _mm256_set1_epi32((g % 8) as i32));
            for t in 0..NT {
                let sum = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3]));
                tot[t] = _mm256_fmadd_ps(sum, s, tot[t]);
            }
        }
        // Bias part Σ_g b_g·gsum_g as its own vector dot product (off the main loop's chain).
        let mut out = [0f32; NT];
        for t in 0..NT {
            let mut bacc = _mm256_setzero_ps();
            let mut g = 0;
            while g < ng {
                bacc = _mm256_fmadd_ps(load_bf16x8(bp, g, ng), load_f32x8(pg.add(t * ldg), g, ng), bacc);
                g += 8;
            }
            out[t] = hsum(_mm256_add_ps(tot[t], bacc));
        }
        out
    }

    /// `out[t] = row · x_t` for t < NT ≤ 4 tokens (`x: [NT, cols]`, `gsum: [NT, cols/group]`),
    /// bf16 scales and biases.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_quant_bf16_multi(
        bits: u32,
        group: usize,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        x: &[f32],
        cols: usize,
        gsum: &[f32],
        out: &mut [f32],
    ) {
        let nt = out.len();
        let ng = cols / group;
        assert!((1..=4).contains(&nt) && x.len() >= nt * cols && gsum.len() >= nt * ng);
        assert!(packed.len() * 8 >= cols * bits as usize && scales.len() >= 2 * ng && biases.len() >= 2 * ng);
        let (p, s, b) = (packed.as_ptr(), scales.as_ptr() as *const u16, biases.as_ptr() as *const u16);
        let (px, pg) = (x.as_ptr(), gsum.as_ptr());
        macro_rules! go {
            ($bits:literal, $group:literal) => {
                match nt {
                    1 => out.copy_from_slice(&dot_qk_n::<$bits, $group, 1>(p, s, b, px, cols, pg, ng, ng)),
                    2 => out.copy_from_slice(&dot_qk_n::<$bits, $group, 2>(p, s, b, px, cols, pg, ng, ng)),
                    3 => out.copy_from_slice(&dot_qk_n::<$bits, $group, 3>(p, s, b, px, cols, pg, ng, ng)),
                    _ => out.copy_from_slice(&dot_qk_n::<$bits, $group, 4>(p, s, b, px, cols, pg, ng, ng)),
                }
            };
        }
        match (bits, group) {
            (4, 32) => go!(4, 32),
            (4, 64) => go!(4, 64),
            (4, 128) => go!(4, 128),
            (8, 32) => go!(8, 32),
            (8, 64) => go!(8, 64),
            _ => go!(8, 128),
        }
    }

    /// Eight bf16 values from `p[i..]` as f32, zero past `n`.
    #[inline(always)]
    pub(super) unsafe fn load_bf16x8(p: *const u16, i: usize, n: usize) -> __m256 {
        if i + 8 <= n {
            let h = _mm_loadu_si128(p.add(i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        } else {
            let mut tmp = [0f32; 8];
            for (j, t) in tmp.iter_mut().enumerate().take(n - i) {
                *t = bf16_at(p, i + j);
            }
            _mm256_loadu_ps(tmp.as_ptr())
        }
    }

    /// Eight f32 values from `p[i..]`, zero past `n`.
    #[inline(always)]
    pub(super) unsafe fn load_f32x8(p: *const f32, i: usize, n: usize) -> __m256 {
        if i + 8 <= n {
            _mm256_loadu_ps(p.add(i))
        } else {
            // lanes n - i.. are zero and not read (a masked load, not a copy through memory)
            let m = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - i) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            _mm256_maskload_ps(p.add(i), m)
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_quant(
        bits: u32,
        group: usize,
        sty: FloatType,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        x: &[f32],
        gsum: &[f32],
    ) -> f32 {
        let ng = x.len() / group;
        let px = x.as_ptr();
        let pp = packed.as_ptr();
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mask = _mm256_set1_epi32(15);
        let mut tot = _mm256_setzero_ps();
        let mut bias_part = 0f32;
        // Four independent accumulators per group keep the FMA latency chains off the critical path.
        for g in 0..ng {
            let mut acc = [_mm256_setzero_ps(); 4];
            let base = g * group;
            let mut c = 0;
            while c < group {
                for j in 0..4 {
                    let e = base + c + 8 * (j % 2) + 16 * (j / 2);
                    if e >= base + group {
                        break;
                    }
                    let q = if bits == 4 {
                        let w = (pp.add(e / 2) as *const u32).read_unaligned();
                        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts), mask)
                    } else {
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64(pp.add(e) as *const __m128i))
                    };
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(px.add(e)), acc[j]);
                }
                c += 32;
            }
            // Scale the group's partial sums as vectors; one horizontal sum per row.
            let sv = _mm256_set1_ps(scale_at(sty, scales, g));
            let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            tot = _mm256_fmadd_ps(sum, sv, tot);
            bias_part += scale_at(sty, biases, g) * gsum[g];
        }
        hsum(tot) + bias_part
    }
}
