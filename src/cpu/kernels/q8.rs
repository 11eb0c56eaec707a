//! Opt-in int8 activations for products with MLX affine 4- and 8-bit weights (`LILY_CPU_INT8=1`
//! or `--cpu-int8`), the trick llama.cpp's CPU backend uses for its Q8 activation dot products.
//!
//! The activation vector is quantized once per product, per weight group `g` of `G` columns:
//! `dx_g = max|x| / 127`, `xi_c = round(x_c / dx_g) ∈ [-127, 127]`, `x̂_c = dx_g·xi_c`. Then for
//! one weight row
//!
//! `Σ_c (s_g q_c + b_g) x_c ≈ Σ_c (s_g q_c + b_g) x̂_c = Σ_g s_g·dx_g·Σ_{c∈g} q_c·xi_c + b_g·dx_g·Σ_{c∈g} xi_c`
//!
//! with the inner sums in exact integer arithmetic (AVX2: `maddubs` u8 × i8 → i16 pairs, `madd`
//! → i32). Only the rounding of x is lost: `|x_c − x̂_c| ≤ dx_g/2`, so the error of one row is at
//! most `Σ_c |W[c]|·dx_g/2`. The bias term uses the sum of the *quantized* x on purpose: MLX codes
//! are unsigned (mean ~7.5 for 4 bits) with the bias carrying the offset, so with the exact `Σ x`
//! the error would be `Σ s·q·(x̂ − x)`, whose uncentred `q` makes it several times larger than
//! `Σ W·(x̂ − x)` (measured on the tiny fixtures: logits off by up to 6% of their range instead of
//! 3–5%). The default path keeps fp32 activations, which match the fp32 reference to ~2e-6.
//!
//! Layout of the quantized activations, chosen so the weights need no shuffle:
//! - 4-bit weights: byte i of a packed row holds columns 2i (low nibble) and 2i+1 (high nibble).
//!   Masking 32 packed bytes gives the 32 even columns of a 64-column chunk, shifting gives the 32
//!   odd ones; so within each 64-column chunk of x the even columns come first, then the odd ones
//!   (a trailing 32-column chunk, for group 32, likewise: 16 even, then 16 odd). See [`pos4`].
//!   For groups of 64 and 128 the tokens are also interleaved per chunk in blocks of 8 (see
//!   [`Q8Act::index`]); those products run in `kernels::q4tile`, this file's kernels take the rest.
//! - 8-bit weights: natural column order. The kernel uses `q − 128` as a signed byte (so `maddubs`
//!   cannot saturate: `2·128·127 < 2^15`) and adds back `128·Σ xi` per group (kept in `isum`).

use super::has_avx2;
use crate::linear::FloatType;
use std::sync::atomic::{AtomicU8, Ordering};

static MODE: AtomicU8 = AtomicU8::new(0); // 0: not read yet, 1: off, 2: on

/// Whether quantized products use int8 activations: `LILY_CPU_INT8=1` (any value but `0`/empty)
/// or [`set_cpu_int8`]; off by default.
#[inline]
pub fn cpu_int8() -> bool {
    match MODE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("LILY_CPU_INT8").map(|v| !v.is_empty() && v != "0").unwrap_or(false);
            // Keep an explicit set_cpu_int8 that raced with the first read.
            let _ = MODE.compare_exchange(0, if on { 2 } else { 1 }, Ordering::Relaxed, Ordering::Relaxed);
            MODE.load(Ordering::Relaxed) == 2
        }
        m => m == 2,
    }
}

/// Turns the int8-activation path on or off for the whole process (overrides `LILY_CPU_INT8`).
pub fn set_cpu_int8(on: bool) {
    MODE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Position in the quantized row of column `c` for 4-bit weights (see the module comment).
#[inline]
pub fn pos4(c: usize, cols: usize) -> usize {
    let start = c & !63;
    let n = (cols - start).min(64);
    let p = c - start;
    start + if p.is_multiple_of(2) { p / 2 } else { n / 2 + p / 2 }
}

/// Tokens per block of the blocked layout (see [`Q8Act::index`]).
pub const TOKEN_BLOCK: usize = 8;

/// Whether activations for these weights use the token-blocked layout read by
/// `kernels::q4tile` (4-bit weights in groups of 64 or 128).
pub fn blocked(bits: u32, group: usize) -> bool {
    bits == 4 && (group == 64 || group == 128)
}

/// `t` activation rows quantized to int8 for weights of `bits` bits and group `group`.
pub struct Q8Act {
    pub t: usize,
    pub cols: usize,
    pub group: usize,
    pub bits: u32,
    /// `[t, cols]` int8 values, in the layout for `bits` (see the module comment).
    pub q: Vec<i8>,
    /// `[t, cols/group]` scale per group: `dx = max|x| / 127` (0 for an all-zero group).
    pub d: Vec<f32>,
    /// `[t, cols/group]` sum of the quantized x per group, `dx·Σ xi` (the bias term).
    pub sum: Vec<f32>,
    /// `[t, cols/group]` `Σ xi` per group (8-bit weights' offset term).
    pub isum: Vec<i32>,
}

impl Q8Act {
    /// Where `xi` of token `t`, column `c` is stored in `q`. Row-major with [`pos4`] inside each
    /// row, except for [`blocked`] formats: there tokens come in blocks of [`TOKEN_BLOCK`] (the
    /// last one shorter), and inside a block of `nb` tokens each 64-column chunk holds the `nb`
    /// tokens' 64 values one after the other, so a kernel walking the columns reads one
    /// contiguous stream for all the block's tokens.
    #[inline]
    pub fn index(&self, t: usize, c: usize) -> usize {
        if !blocked(self.bits, self.group) {
            let p = if self.bits == 4 { pos4(c, self.cols) } else { c };
            return t * self.cols + p;
        }
        let (b, j) = (t / TOKEN_BLOCK, t % TOKEN_BLOCK);
        let nb = (self.t - b * TOKEN_BLOCK).min(TOKEN_BLOCK);
        b * TOKEN_BLOCK * self.cols + (c / 64) * nb * 64 + j * 64 + pos4(c % 64, 64)
    }
}

impl Q8Act {
    /// Quantizes `x: [t, cols]`, blocks of [`TOKEN_BLOCK`] tokens in parallel.
    pub fn new(x: &[f32], cols: usize, group: usize, bits: u32) -> Q8Act {
        assert!(cols.is_multiple_of(group) && [32, 64, 128].contains(&group) && x.len().is_multiple_of(cols));
        let t = x.len() / cols;
        let ng = cols / group;
        let mut a = Q8Act {
            t,
            cols,
            group,
            bits,
            q: vec![0; t * cols],
            d: vec![0.0; t * ng],
            sum: vec![0.0; t * ng],
            isum: vec![0; t * ng],
        };
        let tb = TOKEN_BLOCK;
        // Token blocks own disjoint ranges of every array in both layouts.
        let block = |b: usize, q: &mut [i8], d: &mut [f32], sum: &mut [f32], isum: &mut [i32]| {
            let nb = d.len() / ng;
            for j in 0..nb {
                let xr = &x[(b * tb + j) * cols..][..cols];
                quantize_row(
                    xr,
                    group,
                    bits,
                    j,
                    nb,
                    q,
                    &mut d[j * ng..][..ng],
                    &mut sum[j * ng..][..ng],
                    &mut isum[j * ng..][..ng],
                );
            }
        };
        if t > tb {
            use rayon::prelude::*;
            a.q.par_chunks_mut(tb * cols)
                .zip(a.d.par_chunks_mut(tb * ng))
                .zip(a.sum.par_chunks_mut(tb * ng))
                .zip(a.isum.par_chunks_mut(tb * ng))
                .enumerate()
                .for_each(|(b, (((q, d), sum), isum))| block(b, q, d, sum, isum));
        } else {
            block(0, &mut a.q, &mut a.d, &mut a.sum, &mut a.isum);
        }
        a
    }
}

/// Token `j` of a block of `nb` tokens (`q` is the block's part of [`Q8Act::q`]), per group:
/// `dx = max|x|/127`, `xi = round(x/dx)`, and the sums.
#[allow(clippy::too_many_arguments)]
fn quantize_row(
    xr: &[f32],
    group: usize,
    bits: u32,
    j: usize,
    nb: usize,
    q: &mut [i8],
    d: &mut [f32],
    sum: &mut [f32],
    isum: &mut [i32],
) {
    let cols = xr.len();
    let mut qi = [0i32; 128];
    for (g, xs) in xr.chunks_exact(group).enumerate() {
        // Written as 8 lanes so that the compiler vectorizes it.
        let mut m = [0f32; 8];
        for ch in xs.chunks_exact(8) {
            for k in 0..8 {
                m[k] = m[k].max(ch[k].abs());
            }
        }
        let amax = m.iter().fold(0f32, |a, b| a.max(*b));
        let dx = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        // Round half to even by adding and subtracting 1.5·2^23 (|x·inv| ≤ 127 + ε, so the
        // result is in [-127, 127]; this is what `round_ties_even` computes, inline).
        const MAGIC: f32 = 12_582_912.0;
        let qs = &mut qi[..group];
        for (o, v) in qs.iter_mut().zip(xs) {
            *o = ((v * inv + MAGIC) - MAGIC) as i32;
        }
        let s: i32 = qs.iter().sum();
        if blocked(bits, group) {
            // Whole 64-column chunks: evens then odds, at the chunk's place for token j.
            for (k, ch) in qs.chunks_exact(64).enumerate() {
                let at = (g * group / 64 + k) * nb * 64 + j * 64;
                let dst = &mut q[at..at + 64];
                for i in 0..32 {
                    dst[i] = ch[2 * i] as i8;
                    dst[32 + i] = ch[2 * i + 1] as i8;
                }
            }
        } else if bits == 4 {
            let qr = &mut q[j * cols..(j + 1) * cols];
            for (c, v) in qs.iter().enumerate() {
                qr[pos4(g * group + c, cols)] = *v as i8;
            }
        } else {
            let qr = &mut q[j * cols + g * group..][..group];
            for (o, v) in qr.iter_mut().zip(qs.iter()) {
                *o = *v as i8;
            }
        }
        d[g] = dx;
        sum[g] = dx * s as f32;
        isum[g] = s;
    }
}

/// `out[j] = row · x_{t0+j}` for `out.len() ≤ 4` tokens of `xa`, one packed weight row
/// (`packed`, `scales`, `biases` of that row).
#[allow(clippy::too_many_arguments)]
pub fn dot_q8(
    bits: u32,
    group: usize,
    sty: FloatType,
    packed: &[u8],
    scales: &[u8],
    biases: &[u8],
    xa: &Q8Act,
    t0: usize,
    out: &mut [f32],
) {
    let (cols, ng) = (xa.cols, xa.cols / xa.group);
    assert!(xa.bits == bits && xa.group == group && t0 + out.len() <= xa.t && out.len() <= 4);
    if blocked(bits, group) {
        for (j, o) in out.iter_mut().enumerate() {
            *o = dot_q8_portable(bits, group, sty, packed, scales, biases, xa, t0 + j);
        }
        return;
    }
    assert!(
        packed.len() * 8 >= cols * bits as usize && scales.len() >= ng * sty.size() && biases.len() >= ng * sty.size()
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && sty == FloatType::BF16 {
        // SAFETY: AVX2 and FMA were detected; the slice lengths were checked above.
        return unsafe { avx2::dot_q8_bf16(bits, group, packed, scales, biases, xa, t0, out) };
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot_q8_portable(bits, group, sty, packed, scales, biases, xa, t0 + j);
    }
}

/// Portable version of [`dot_q8`] for one token (same integer sums, so the same value up to f32
/// rounding).
#[allow(clippy::too_many_arguments)]
pub fn dot_q8_portable(
    bits: u32,
    group: usize,
    sty: FloatType,
    packed: &[u8],
    scales: &[u8],
    biases: &[u8],
    xa: &Q8Act,
    t: usize,
) -> f32 {
    let ng = xa.cols / group;
    let mut total = 0f32;
    let mut bias = 0f32;
    for g in 0..ng {
        let mut acc = 0i32;
        for c in g * group..(g + 1) * group {
            let w = if bits == 4 {
                let byte = packed[c / 2];
                if c % 2 == 0 {
                    byte & 15
                } else {
                    byte >> 4
                }
            } else {
                packed[c]
            };
            let xi = xa.q[xa.index(t, c)];
            acc += w as i32 * xi as i32;
        }
        total += super::scale_at(sty, scales, g) * xa.d[t * ng + g] * acc as f32;
        bias += super::scale_at(sty, biases, g) * xa.sum[t * ng + g];
    }
    total + bias
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::avx2::{hsum, load_bf16x8, load_f32x8};
    use super::Q8Act;
    use std::arch::x86_64::*;

    /// Software prefetch distance of the 4-bit kernel, in bytes of packed weights. Measured on the
    /// 2-core EPYC (KVM) dev machine, alternating runs, int8 decode of the full-size synthetic
    /// model: 5.64 → 6.52 tok/s (means of 3); 1024 and 4096 were within noise of 2048 (8 layers).
    /// Interleaving 4 rows per call (sharing x loads) was slower: 9 vs 13-14 GB/s on lm_head.
    const PF: usize = 2048;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_q8_bf16(
        bits: u32,
        group: usize,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        xa: &Q8Act,
        t0: usize,
        out: &mut [f32],
    ) {
        let (cols, ng) = (xa.cols, xa.cols / group);
        let (p, s, b) = (packed.as_ptr(), scales.as_ptr() as *const u16, biases.as_ptr() as *const u16);
        let a = Args {
            pp: p,
            sp: s,
            bp: b,
            pq: xa.q.as_ptr().add(t0 * cols),
            ldq: cols,
            pd: xa.d.as_ptr().add(t0 * ng),
            ps: xa.sum.as_ptr().add(t0 * ng),
            pi: xa.isum.as_ptr().add(t0 * ng),
            ldg: ng,
            ng,
        };
        macro_rules! go {
            ($f:ident $(, $group:literal)?) => {
                match out.len() {
                    1 => out.copy_from_slice(&$f::<$($group,)? 1>(&a)),
                    2 => out.copy_from_slice(&$f::<$($group,)? 2>(&a)),
                    3 => out.copy_from_slice(&$f::<$($group,)? 3>(&a)),
                    _ => out.copy_from_slice(&$f::<$($group,)? 4>(&a)),
                }
            };
        }
        match (bits, group) {
            (4, _) => go!(dot4), // group 32; groups of 64 and 128 use the blocked layout (`q4tile`)
            (8, 32) => go!(dot8, 32),
            (8, 64) => go!(dot8, 64),
            _ => go!(dot8, 128),
        }
    }

    /// Pointers of one weight row and the first token's activations (`ldq`, `ldg`: token strides).
    struct Args {
        pp: *const u8,
        sp: *const u16,
        bp: *const u16,
        pq: *const i8,
        ldq: usize,
        pd: *const f32,
        ps: *const f32,
        pi: *const i32,
        ldg: usize,
        ng: usize,
    }

    /// `s_g·dx_g` for the 8 groups from `g` (zero past `ng`).
    #[inline(always)]
    unsafe fn comb8<const NT: usize>(a: &Args, g: usize) -> [__m256; NT] {
        let sv = load_bf16x8(a.sp, g, a.ng);
        let mut c = [_mm256_setzero_ps(); NT];
        for t in 0..NT {
            c[t] = _mm256_mul_ps(sv, load_f32x8(a.pd.add(t * a.ldg), g, a.ng));
        }
        c
    }

    /// `Σ_g b_g·sum_g` per token, as a vector over groups.
    #[inline(always)]
    unsafe fn bias_part<const NT: usize>(a: &Args) -> [__m256; NT] {
        let mut acc = [_mm256_setzero_ps(); NT];
        for t in 0..NT {
            let mut g = 0;
            while g < a.ng {
                acc[t] = _mm256_fmadd_ps(load_bf16x8(a.bp, g, a.ng), load_f32x8(a.ps.add(t * a.ldg), g, a.ng), acc[t]);
                g += 8;
            }
        }
        acc
    }

    /// 4-bit weights in groups of 32 (groups of 64 and 128 go through `q4tile`): 64 columns, two
    /// groups, per step (32 packed bytes, low nibbles against the chunk's 32 even columns of x,
    /// high nibbles against its 32 odd ones; one group per 128-bit lane), and a last odd group
    /// with 128-bit operations. Steps alternate between two accumulators (named, not indexed, so
    /// they stay in registers).
    #[inline(always)]
    unsafe fn dot4<const NT: usize>(a: &Args) -> [f32; NT] {
        let ng = a.ng;
        let nsteps = ng / 2;
        let mut tot0 = [_mm256_setzero_ps(); NT];
        let mut tot1 = [_mm256_setzero_ps(); NT];
        let mut comb = [_mm256_setzero_ps(); NT];
        let mut st = 0;
        while st + 2 <= nsteps {
            step4::<NT>(a, 2 * st, &mut comb, &mut tot0);
            step4::<NT>(a, 2 * (st + 1), &mut comb, &mut tot1);
            st += 2;
        }
        if st < nsteps {
            step4::<NT>(a, 2 * st, &mut comb, &mut tot0);
        }
        if !ng.is_multiple_of(2) {
            // Last odd group of 32 columns: 16 packed bytes, 16 even then 16 odd x values.
            let g = ng - 1;
            if g.is_multiple_of(8) {
                comb = comb8::<NT>(a, g);
            }
            let e = g * 32;
            let m4h = _mm_set1_epi8(0x0f);
            let v = _mm_loadu_si128(a.pp.add(e / 2) as *const __m128i);
            let lo = _mm_and_si128(v, m4h);
            let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4h);
            let idx = _mm256_set1_epi32((g % 8) as i32);
            for t in 0..NT {
                let xp = a.pq.add(t * a.ldq + e);
                let x0 = _mm_loadu_si128(xp as *const __m128i);
                let x1 = _mm_loadu_si128(xp.add(16) as *const __m128i);
                let p = _mm_add_epi16(_mm_maddubs_epi16(lo, x0), _mm_maddubs_epi16(hi, x1));
                let s = _mm256_set_m128i(_mm_setzero_si128(), _mm_madd_epi16(p, _mm_set1_epi16(1)));
                let c = _mm256_permutevar8x32_ps(comb[t], idx);
                tot1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), c, tot1[t]);
            }
        }
        finish::<NT>(a, &tot0, &tot1)
    }

    /// `Σ tot0 + tot1 + bias part` per token.
    #[inline(always)]
    unsafe fn finish<const NT: usize>(a: &Args, tot0: &[__m256; NT], tot1: &[__m256; NT]) -> [f32; NT] {
        let bias = bias_part::<NT>(a);
        let mut out = [0f32; NT];
        for t in 0..NT {
            out[t] = hsum(_mm256_add_ps(_mm256_add_ps(tot0[t], tot1[t]), bias[t]));
        }
        out
    }

    /// One step of [`dot4`]: groups `g` and `g + 1` (64 columns).
    #[inline(always)]
    unsafe fn step4<const NT: usize>(a: &Args, g: usize, comb: &mut [__m256; NT], tot: &mut [__m256; NT]) {
        let m4 = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        if g.is_multiple_of(8) {
            *comb = comb8::<NT>(a, g);
        }
        let e = g * 32; // first column
        if (e / 2).is_multiple_of(64) {
            // One software prefetch per cache line, PF bytes ahead (past the row's end it reaches
            // the next rows, which are contiguous; a prefetch never faults).
            _mm_prefetch::<_MM_HINT_T0>(a.pp.wrapping_add(e / 2 + PF) as *const i8);
        }
        let v = _mm256_loadu_si256(a.pp.add(e / 2) as *const __m256i);
        let lo = _mm256_and_si256(v, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        let j = (g % 8) as i32;
        // The low 128-bit lane sums group g, the high lane group g + 1.
        let idx = _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
        for t in 0..NT {
            let xp = a.pq.add(t * a.ldq + e);
            let x0 = _mm256_loadu_si256(xp as *const __m256i);
            let x1 = _mm256_loadu_si256(xp.add(32) as *const __m256i);
            // Each i16 lane: 2 products of ≤ 15·127 per maddubs, 4 after the add: < 2^15.
            let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
            let c = _mm256_permutevar8x32_ps(comb[t], idx);
            tot[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), c, tot[t]);
        }
    }

    /// 8-bit weights: 32 columns per step as `|q − 128|` (u8) × `sign(q − 128)·xi` (i8), then
    /// `128·Σ xi` added per group, so the integer sum is `Σ q·xi` exactly.
    #[inline(always)]
    unsafe fn dot8<const GROUP: usize, const NT: usize>(a: &Args) -> [f32; NT] {
        let mut tot0 = [_mm256_setzero_ps(); NT];
        let mut tot1 = [_mm256_setzero_ps(); NT];
        let mut comb = [_mm256_setzero_ps(); NT];
        let mut g = 0;
        while g + 2 <= a.ng {
            step8::<GROUP, NT>(a, g, &mut comb, &mut tot0);
            step8::<GROUP, NT>(a, g + 1, &mut comb, &mut tot1);
            g += 2;
        }
        if g < a.ng {
            step8::<GROUP, NT>(a, g, &mut comb, &mut tot0);
        }
        finish::<NT>(a, &tot0, &tot1)
    }

    #[inline(always)]
    unsafe fn step8<const GROUP: usize, const NT: usize>(
        a: &Args,
        g: usize,
        comb: &mut [__m256; NT],
        tot: &mut [__m256; NT],
    ) {
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        if g.is_multiple_of(8) {
            *comb = comb8::<NT>(a, g);
        }
        let mut acc = [_mm256_setzero_si256(); NT];
        for t in 0..NT {
            let off = 128 * *a.pi.add(t * a.ldg + g);
            acc[t] = _mm256_set_m128i(_mm_setzero_si128(), _mm_cvtsi32_si128(off));
        }
        for k in 0..GROUP / 32 {
            let e = g * GROUP + 32 * k;
            let w = _mm256_xor_si256(_mm256_loadu_si256(a.pp.add(e) as *const __m256i), flip); // q − 128
            let aw = _mm256_abs_epi8(w); // |q − 128| ≤ 128, read as u8
            for t in 0..NT {
                let x = _mm256_loadu_si256(a.pq.add(t * a.ldq + e) as *const __m256i);
                // i16 lanes: 2 products of ≤ 128·127 = 32512 < 2^15.
                let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
                acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(p, ones));
            }
        }
        let idx = _mm256_set1_epi32((g % 8) as i32);
        for t in 0..NT {
            let c = _mm256_permutevar8x32_ps(comb[t], idx);
            tot[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), c, tot[t]);
        }
    }
}
