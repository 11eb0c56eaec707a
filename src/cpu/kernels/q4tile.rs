//! Int8-activation products with 4-bit MLX weights (bf16 scales, groups of 64 or 128: the layout
//! of every large matrix in the mlx-community checkpoints), tiled over rows and tokens.
//!
//! Math: as in [`super::q8`], per row `r`, token `t` and weight group `g`,
//! `y[t, r] = Σ_g c[t, g]·I[t, g] + Σ_g b[r, g]·sum[t, g]` with the exact integer dot
//! `I[t, g] = Σ_{c∈g} q[r, c]·xi[t, c]`, `c[t, g] = s[r, g]·dx[t, g]` and `sum = dx·Σ xi`.
//!
//! What differs from `q8::dot_q8` is where the float work happens. Per row, a prologue computes
//! `c[t, g]` for a block of up to 8 tokens into a small buffer, and the bias term as a scalar per
//! token. The main loop then costs, per 64 columns and token, two `maddubs`, one `add`, one `madd`,
//! one int-to-float conversion and one FMA with `c` broadcast from memory (a load, not an ALU
//! operation); the nibble unpacking (load, and, shift, and) is shared by the block's tokens. Only
//! the `NT` float accumulators live across the loop, so 8 tokens fit AVX2's 16 registers.
//! Group 128 adds its two 64-column halves as i16 before the `madd` (8 products of ≤ 15·127 per
//! lane, < 2^15).
//!
//! Layout: the activations come in `Q8Act`'s blocked layout (per block of 8 tokens, per 64-column
//! chunk, the block's tokens' 64 bytes one after the other), so one pointer walks all the tokens
//! of a block with constant offsets; `c` is `[8, MAXG]` for the same reason.
//!
//! Loop order (cache blocking): a task's rows are taken 32 at a time (32 KiB of packed weights at
//! 2048 columns, L1/L2-resident); for each block of 8 tokens (16 KiB of int8 activations at 2048
//! columns, L1-resident) every row of those 32 runs once. x is read from L1 per row and token,
//! weights from L2 once per token block. Launch geometry: the caller splits the rows into tasks
//! (rayon); one call is one task, single-threaded.
//!
//! Where the CPU has AVX-512 VNNI (`has_vnni`), each group's integer dot is two (group 128: four)
//! `vpdpbusd` on 256-bit registers instead of `maddubs`/`add`/`madd`: the same byte products in
//! the same i32 lanes, so the results are bit-identical to the AVX2 path.
//!
//! Measured (`examples/matmul`, 4096×2048, 2 threads, best of 10, noisy machine): 8 tokens 151–156
//! GFLOP/s against 102–121 for the row-at-a-time kernel, 64 tokens 160–171 against 148. Session
//! 12, same machine: AVX2 211.5 (8 tokens) / 230.4 (64), VNNI 234.7 / 239.7.

use super::q8::Q8Act;

/// Whether [`rows4`] computes this format (else the caller uses `q8::dot_q8`).
pub fn applies(bits: u32, group: usize, cols: usize, bf16_scales: bool) -> bool {
    super::has_avx2() && bf16_scales && bits == 4 && (group == 64 || group == 128) && cols / group <= MAXG
}

/// Most groups per row the prologue buffer holds (16,384 columns at group 64).
const MAXG: usize = 256;
/// Tokens per register block.
const TB: usize = super::q8::TOKEN_BLOCK;
/// Rows per cache block.
const RB: usize = 32;

/// Rows `[r0, r1)` of `W·x` for every token of `xa` into `out[t·ld + r]`.
///
/// `packed`, `scales`, `biases` are the whole matrix (`[rows, cols/2]` bytes, `[rows, cols/group]`
/// bf16 each).
///
/// # Safety
/// [`applies`] must hold for this format and `xa` must be laid out for it (`bits` 4, the same
/// group and columns); `out` must be valid for writes at `t·ld + r` for every token `t` and `r` in
/// `[r0, r1)`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows4(
    group: usize,
    packed: &[u8],
    scales: &[u8],
    biases: &[u8],
    xa: &Q8Act,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let (cols, ng) = (xa.cols, xa.cols / group);
    assert!(xa.bits == 4 && xa.group == group && ng <= MAXG);
    assert!(packed.len() >= r1 * cols / 2 && scales.len() >= r1 * ng * 2 && biases.len() >= r1 * ng * 2);
    #[cfg(target_arch = "x86_64")]
    {
        if super::has_vnni() {
            // SAFETY: `has_vnni` checked AVX-512 VNNI and VL (and AVX2, FMA); lengths checked above.
            return unsafe { avx2::rows4_vnni(group, packed, scales, biases, xa, r0, r1, out, ld) };
        }
        // SAFETY: `applies` checked AVX2 and FMA; slice lengths checked above.
        unsafe { avx2::rows4(group, packed, scales, biases, xa, r0, r1, out, ld) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("applies() is false without AVX2")
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::avx2::{hsum, load_bf16x8, load_f32x8};
    use super::{Q8Act, MAXG, RB, TB};
    use std::arch::x86_64::*;

    /// Software prefetch distance in bytes of packed weights (see `q8`'s measurement).
    const PF: usize = 2048;

    /// One row's pointers and its token block's prologue results.
    struct Row {
        /// Packed weights of the row.
        pp: *const u8,
        /// The token block's activations (blocked layout: per 64-column chunk, `NT` × 64 bytes).
        pq: *const i8,
        /// `c[j·MAXG + g]`.
        c: *const f32,
        ng: usize,
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows4(
        group: usize,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        xa: &Q8Act,
        r0: usize,
        r1: usize,
        out: *mut f32,
        ld: usize,
    ) {
        // SAFETY: forwarded contract; the features of this function cover the `false` path.
        unsafe { rows4_impl::<false>(group, packed, scales, biases, xa, r0, r1, out, ld) }
    }

    /// [`rows4`] with each group's integer dot as two (group 128: four) `vpdpbusd` on 256 bits
    /// instead of `maddubs`, `add`, `madd`: the same eight (sixteen) byte products per i32 lane in
    /// the same lanes, so the results are bit-identical.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows4_vnni(
        group: usize,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        xa: &Q8Act,
        r0: usize,
        r1: usize,
        out: *mut f32,
        ld: usize,
    ) {
        // SAFETY: forwarded contract; the features of this function cover the `true` path.
        unsafe { rows4_impl::<true>(group, packed, scales, biases, xa, r0, r1, out, ld) }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows4_impl<const VNNI: bool>(
        group: usize,
        packed: &[u8],
        scales: &[u8],
        biases: &[u8],
        xa: &Q8Act,
        r0: usize,
        r1: usize,
        out: *mut f32,
        ld: usize,
    ) {
        let (cols, ng) = (xa.cols, xa.cols / group);
        // Not zeroed: the prologue writes every entry the kernel reads (j < nt, g < ng).
        let mut cbuf = std::mem::MaybeUninit::<[f32; TB * MAXG]>::uninit();
        let cp = cbuf.as_mut_ptr() as *mut f32;
        let mut bias = [0f32; TB];
        let (sp, bp) = (scales.as_ptr() as *const u16, biases.as_ptr() as *const u16);
        let mut rs = r0;
        while rs < r1 {
            let re = (rs + RB).min(r1);
            let mut t0 = 0;
            while t0 < xa.t {
                let nt = (xa.t - t0).min(TB);
                for r in rs..re {
                    prologue(sp.add(r * ng), bp.add(r * ng), xa, t0, nt, cp, &mut bias);
                    let row =
                        Row { pp: packed.as_ptr().add(r * cols / 2), pq: xa.q.as_ptr().add(t0 * cols), c: cp, ng };
                    // each tile writes its tokens' results (plus the bias terms) itself: no
                    // variable-length copy through a buffer (a memmove call per row)
                    let o = out.add(t0 * ld + r);
                    macro_rules! go {
                        ($g:literal) => {
                            match nt {
                                1 => tile::<$g, 1, VNNI>(&row, o, ld, &bias),
                                2 => tile::<$g, 2, VNNI>(&row, o, ld, &bias),
                                3 => tile::<$g, 3, VNNI>(&row, o, ld, &bias),
                                4 => tile::<$g, 4, VNNI>(&row, o, ld, &bias),
                                5 => tile::<$g, 5, VNNI>(&row, o, ld, &bias),
                                6 => tile::<$g, 6, VNNI>(&row, o, ld, &bias),
                                7 => tile::<$g, 7, VNNI>(&row, o, ld, &bias),
                                _ => tile::<$g, 8, VNNI>(&row, o, ld, &bias),
                            }
                        };
                    }
                    if group == 64 {
                        go!(64)
                    } else {
                        go!(128)
                    }
                }
                t0 += nt;
            }
            rs = re;
        }
    }

    /// `c[j·MAXG + g] = s[g]·dx[t0 + j, g]` and `bias[j] = Σ_g b[g]·sum[t0 + j, g]` for one row.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn prologue(
        sp: *const u16,
        bp: *const u16,
        xa: &Q8Act,
        t0: usize,
        nt: usize,
        c: *mut f32,
        bias: &mut [f32; TB],
    ) {
        let ng = xa.cols / xa.group;
        let mut bacc = [_mm256_setzero_ps(); TB];
        let mut g = 0;
        while g < ng {
            let s8 = load_bf16x8(sp, g, ng);
            let b8 = load_bf16x8(bp, g, ng);
            for j in 0..nt {
                let d = load_f32x8(xa.d.as_ptr().add((t0 + j) * ng), g, ng);
                _mm256_storeu_ps(c.add(j * MAXG + g), _mm256_mul_ps(s8, d));
                let sm = load_f32x8(xa.sum.as_ptr().add((t0 + j) * ng), g, ng);
                bacc[j] = _mm256_fmadd_ps(b8, sm, bacc[j]);
            }
            g += 8;
        }
        for j in 0..nt {
            bias[j] = hsum(bacc[j]);
        }
    }

    /// `Σ_g c[j, g]·I[j, g]` for `NT` tokens of one row. One accumulator per token, groups in
    /// order: a token's result does not depend on how many tokens share the call, so a prompt
    /// gives the same values whether it runs as one prefill or token by token.
    /// The results go to `o[j·ld] = Σ + bias[j]`.
    #[inline(always)]
    unsafe fn tile<const GROUP: usize, const NT: usize, const VNNI: bool>(
        row: &Row,
        o: *mut f32,
        ld: usize,
        bias: &[f32; TB],
    ) {
        let mut tot = [_mm256_setzero_ps(); NT];
        for g in 0..row.ng {
            step::<GROUP, NT, VNNI>(row, g, &mut tot);
        }
        for j in 0..NT {
            *o.add(j * ld) = hsum(tot[j]) + bias[j];
        }
    }

    /// Group `g` of one row for `NT` tokens.
    #[inline(always)]
    unsafe fn step<const GROUP: usize, const NT: usize, const VNNI: bool>(row: &Row, g: usize, tot: &mut [__m256; NT]) {
        let m4 = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let e = g * GROUP; // first column
        let w = row.pp.add(e / 2);
        if GROUP == 128 || g.is_multiple_of(2) {
            // One prefetch per 64-byte line (past the row's end it reaches the next rows, which
            // are contiguous; a prefetch never faults).
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(PF) as *const i8);
        }
        let v0 = _mm256_loadu_si256(w as *const __m256i);
        let lo0 = _mm256_and_si256(v0, m4);
        let hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
        if GROUP == 64 {
            let xs = row.pq.add(e * NT); // this chunk's NT × 64 bytes
            for j in 0..NT {
                let xp = xs.add(64 * j);
                let x0 = _mm256_loadu_si256(xp as *const __m256i);
                let x1 = _mm256_loadu_si256(xp.add(32) as *const __m256i);
                let i = if VNNI {
                    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo0, x0), hi0, x1)
                } else {
                    // i16 lanes: 4 products of ≤ 15·127.
                    let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x1));
                    _mm256_madd_epi16(p, ones)
                };
                let c = _mm256_broadcast_ss(&*row.c.add(j * MAXG + g));
                tot[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), c, tot[j]);
            }
        } else {
            let v1 = _mm256_loadu_si256(w.add(32) as *const __m256i);
            let lo1 = _mm256_and_si256(v1, m4);
            let hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
            let (xs0, xs1) = (row.pq.add(e * NT), row.pq.add((e + 64) * NT));
            for j in 0..NT {
                let (a, b) = (xs0.add(64 * j), xs1.add(64 * j));
                let ld = |p: *const i8| _mm256_loadu_si256(p as *const __m256i);
                let i = if VNNI {
                    let i = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo0, ld(a));
                    let i = _mm256_dpbusd_epi32(i, hi0, ld(a.add(32)));
                    let i = _mm256_dpbusd_epi32(i, lo1, ld(b));
                    _mm256_dpbusd_epi32(i, hi1, ld(b.add(32)))
                } else {
                    let p0 =
                        _mm256_add_epi16(_mm256_maddubs_epi16(lo0, ld(a)), _mm256_maddubs_epi16(hi0, ld(a.add(32))));
                    let p1 =
                        _mm256_add_epi16(_mm256_maddubs_epi16(lo1, ld(b)), _mm256_maddubs_epi16(hi1, ld(b.add(32))));
                    // i16 lanes: 8 products of ≤ 15·127 = 15,240 < 2^15.
                    _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones)
                };
                let c = _mm256_broadcast_ss(&*row.c.add(j * MAXG + g));
                tot[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), c, tot[j]);
            }
        }
    }
}
