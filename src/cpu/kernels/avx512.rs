//! AVX-512 inner loops of bf16-weight products (dispatched from `cpu::kernels` after
//! `has_avx512()`): fp32 inputs (`dot_bf16_rows4`, below) and bf16 inputs (`vdpbf16ps`, further down).
//!
//! `dot_bf16_rows4`: four bf16 weight rows against `T ≤ 8` token rows, `out[r][t] = Σ_c w_r[c] x_t[c]`.
//! One 512-bit accumulator holds two rows' 8-lane sums for one token (lanes 0-7 row a, 8-15 row
//! b), so each lane adds the same products in the same order as the one-token AVX2 `dot_dense`
//! (lane j: columns j, j+8, j+16, ..., one FMA each) and the final per-row reduction is the same
//! `hsum`: every output is bit-identical to `dot_dense` of that row and token.
//! Per 8 columns: four 16-byte row loads widened into two registers, one broadcast load of each
//! token's 8 inputs, 2T FMAs on 16 lanes. Against the one-row kernel, each token's inputs are
//! loaded once per four rows (they come from L2 once the token rows pass 32 KB), and the FMA
//! count halves.

use super::avx2::hsum;
use super::scale_at;
use crate::linear::FloatType;
use std::arch::x86_64::*;

/// Rows `w[r·rb..]` for r in 0..4 (`rb = 2·cols` bytes each), tokens `x[t·cols..]`.
#[target_feature(enable = "avx2,fma,avx512f")]
pub unsafe fn dot_bf16_rows4(w: &[u8], rb: usize, x: &[f32], cols: usize, t: usize, out: &mut [[f32; 8]; 4]) {
    by_tokens!(t, rows4(w, rb, x, cols, out))
}

/// The four rows' 8-lane sums held two per 512-bit register (rows 0, 1 in `a01`; 2, 3 in `a23`).
#[inline]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn row_sums(a01: __m512, a23: __m512) -> [__m256; 4] {
    [
        _mm512_castps512_ps256(a01),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a01), 1)),
        _mm512_castps512_ps256(a23),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a23), 1)),
    ]
}

/// 8 bf16 values at `p` and 8 at `q` widened to f32: lanes 0-7 from `p`, 8-15 from `q`.
#[inline]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn widen_pair(p: *const u8, q: *const u8) -> __m512 {
    let h = _mm256_set_m128i(_mm_loadu_si128(q as *const __m128i), _mm_loadu_si128(p as *const __m128i));
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
}

#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn rows4<const T: usize>(w: &[u8], rb: usize, x: &[f32], cols: usize, out: &mut [[f32; 8]; 4]) {
    debug_assert!(w.len() >= 3 * rb + 2 * cols && x.len() >= T * cols);
    let (pw, px) = (w.as_ptr(), x.as_ptr());
    let mut a01 = [_mm512_setzero_ps(); T];
    let mut a23 = [_mm512_setzero_ps(); T];
    let mut i = 0;
    while i + 8 <= cols {
        let o = 2 * i;
        let w01 = widen_pair(pw.add(o), pw.add(rb + o));
        let w23 = widen_pair(pw.add(2 * rb + o), pw.add(3 * rb + o));
        for t in 0..T {
            let xv = _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(px.add(t * cols + i))));
            let xv = _mm512_castpd_ps(xv);
            a01[t] = _mm512_fmadd_ps(w01, xv, a01[t]);
            a23[t] = _mm512_fmadd_ps(w23, xv, a23[t]);
        }
        i += 8;
    }
    for t in 0..T {
        for (r, h) in row_sums(a01[t], a23[t]).into_iter().enumerate() {
            let mut s = hsum(h);
            let row = &w[r * rb..r * rb + 2 * cols];
            for c in i..cols {
                s += scale_at(FloatType::BF16, row, c) * x[t * cols + c];
            }
            out[r][t] = s;
        }
    }
}

// `vdpbf16ps` kernels: bf16 rows against `T ≤ 8` bf16 inputs (`xb: [T, cols]`). Lane j of a
// row's 8-lane sum for a token adds the column pairs 16k + 2j, 16k + 2j + 1 for k = 0, 1, ...
// (one instruction step each, in k order); the 8 lanes are reduced by `hsum` and the tail
// past the last 16 columns is added per column. The one-row kernel (256-bit) and the four-row
// kernel (two rows per 512-bit register) do exactly these steps, so what a token gets does not
// depend on `T`, on the other tokens or on which kernel ran its row.

/// One row: `out[t] = Σ_c w[c] · xb[t·cols + c]` for `t < out.len() ≤ 8`.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bf16")]
pub unsafe fn dot_bf16x_row(w: &[u8], xb: &[u16], cols: usize, out: &mut [f32]) {
    by_tokens!(out.len(), bf16x_row(w, xb, cols, out))
}

#[inline]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bf16")]
unsafe fn bh(p: *const u16) -> __m256bh {
    std::mem::transmute(_mm256_loadu_si256(p as *const __m256i))
}

/// Row sum past the 16-column blocks: the tail columns of row `w` for token `t`.
#[inline]
fn bf16x_tail(w: &[u8], xb: &[u16], cols: usize, from: usize, t: usize, mut s: f32) -> f32 {
    for c in from..cols {
        s += scale_at(FloatType::BF16, w, c) * crate::safetensors::bf16_to_f32(xb[t * cols + c]);
    }
    s
}

#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bf16")]
unsafe fn bf16x_row<const T: usize>(w: &[u8], xb: &[u16], cols: usize, out: &mut [f32]) {
    debug_assert!(w.len() >= 2 * cols && xb.len() >= T * cols);
    let (pw, px) = (w.as_ptr() as *const u16, xb.as_ptr());
    let mut a = [_mm256_setzero_ps(); T];
    let mut i = 0;
    while i + 16 <= cols {
        let w0 = bh(pw.add(i));
        for t in 0..T {
            a[t] = _mm256_dpbf16_ps(a[t], w0, bh(px.add(t * cols + i)));
        }
        i += 16;
    }
    for t in 0..T {
        out[t] = bf16x_tail(w, xb, cols, i, t, hsum(a[t]));
    }
}

/// Four rows `w[r·rb..]`: `out[r][t]`, two rows per 512-bit accumulator (lanes 0-7, 8-15), each
/// token's 16 inputs broadcast to both halves.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bf16")]
pub unsafe fn dot_bf16x_rows4(w: &[u8], rb: usize, xb: &[u16], cols: usize, t: usize, out: &mut [[f32; 8]; 4]) {
    by_tokens!(t, bf16x_rows4(w, rb, xb, cols, out))
}

/// 16 bf16 at `p` in lanes 0-7 (as pairs) and 16 at `q` in lanes 8-15.
#[inline]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bf16")]
unsafe fn pair_rows(p: *const u8, q: *const u8) -> __m512bh {
    let lo = _mm256_loadu_si256(p as *const __m256i);
    let hi = _mm256_loadu_si256(q as *const __m256i);
    std::mem::transmute(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1))
}

#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bf16")]
unsafe fn bf16x_rows4<const T: usize>(w: &[u8], rb: usize, xb: &[u16], cols: usize, out: &mut [[f32; 8]; 4]) {
    debug_assert!(w.len() >= 3 * rb + 2 * cols && xb.len() >= T * cols);
    let (pw, px) = (w.as_ptr(), xb.as_ptr());
    let mut a01 = [_mm512_setzero_ps(); T];
    let mut a23 = [_mm512_setzero_ps(); T];
    let mut i = 0;
    while i + 16 <= cols {
        let o = 2 * i;
        let w01 = pair_rows(pw.add(o), pw.add(rb + o));
        let w23 = pair_rows(pw.add(2 * rb + o), pw.add(3 * rb + o));
        for t in 0..T {
            let xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(px.add(t * cols + i) as *const __m256i));
            let xv: __m512bh = std::mem::transmute(xv);
            a01[t] = _mm512_dpbf16_ps(a01[t], w01, xv);
            a23[t] = _mm512_dpbf16_ps(a23[t], w23, xv);
        }
        i += 16;
    }
    for t in 0..T {
        for (r, h) in row_sums(a01[t], a23[t]).into_iter().enumerate() {
            out[r][t] = bf16x_tail(&w[r * rb..r * rb + 2 * cols], xb, cols, i, t, hsum(h));
        }
    }
}
