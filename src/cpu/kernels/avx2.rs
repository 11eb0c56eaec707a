//! The AVX2 + FMA inner loops of the CPU kernels (dispatched from `cpu::kernels` after
//! `has_avx2()`): dense, quantized and multi-token row dots, row dequantization, the GEMM tiles.

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
    by_tokens!(out.len(), bf16_multi(w, x, cols, out))
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
