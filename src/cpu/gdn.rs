//! Gated delta rule: the recurrence of the Gated DeltaNet layers, fp32.
//!
//! Legend: T tokens, H_k key heads, H_v value heads (value head h reads key head h / (H_v/H_k)),
//! D_k, D_v head dims. Inputs: `q, k: [T, H_k, D_k]` (already L2-normed, q scaled by D_k^-½),
//! `v: [T, H_v, D_v]`, `g: [T, H_v]` (log decay, ≤ 0), `beta: [T, H_v]`.
//! State `S: [H_v, D_k, D_v]` (key-major, like HF/FLA; MLX stores the transpose).
//!
//! Per token and value head: `S ← e^g S; u = Sᵀk; δ = β(v − u); S ← S + k δᵀ; o = Sᵀq`.
//! `chunked` computes the same thing 64 tokens at a time with the WY/UT form
//! (model-and-kernels.md §2); it is the reference for the GPU prefill kernel.

use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

pub struct GdnInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

fn check(d: GdnDims, t: usize, x: &GdnInputs, state: &[f32], out: &[f32]) {
    assert_eq!(x.q.len(), t * d.hk * d.dk, "gdn: q must be [T, H_k, D_k]");
    assert_eq!(x.k.len(), t * d.hk * d.dk, "gdn: k must be [T, H_k, D_k]");
    assert_eq!(x.v.len(), t * d.hv * d.dv, "gdn: v must be [T, H_v, D_v]");
    assert_eq!(x.g.len(), t * d.hv, "gdn: g must be [T, H_v]");
    assert_eq!(x.beta.len(), t * d.hv, "gdn: beta must be [T, H_v]");
    assert_eq!(state.len(), d.hv * d.dk * d.dv, "gdn: state must be [H_v, D_k, D_v]");
    assert_eq!(out.len(), t * d.hv * d.dv, "gdn: out must be [T, H_v, D_v]");
    assert!(d.hv.is_multiple_of(d.hk), "gdn: H_v must be a multiple of H_k");
}

/// Token-by-token recurrence; parallel over value heads.
pub fn recurrent(d: GdnDims, t: usize, x: &GdnInputs, state: &mut [f32], out: &mut [f32]) {
    check(d, t, x, state, out);
    let vpk = d.hv / d.hk;
    let mut per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(d.dk * d.dv)
        .enumerate()
        .map(|(h, s)| {
            let kh = h / vpk;
            let mut o = vec![0f32; t * d.dv];
            let mut u = vec![0f32; d.dv];
            for tt in 0..t {
                let q = &x.q[(tt * d.hk + kh) * d.dk..][..d.dk];
                let k = &x.k[(tt * d.hk + kh) * d.dk..][..d.dk];
                let v = &x.v[(tt * d.hv + h) * d.dv..][..d.dv];
                let a = x.g[tt * d.hv + h].exp();
                let b = x.beta[tt * d.hv + h];
                step(s, q, k, v, a, b, &mut u, &mut o[tt * d.dv..(tt + 1) * d.dv]);
            }
            o
        })
        .collect();
    for (h, o) in per_head.iter_mut().enumerate() {
        for tt in 0..t {
            out[(tt * d.hv + h) * d.dv..][..d.dv].copy_from_slice(&o[tt * d.dv..(tt + 1) * d.dv]);
        }
    }
}

/// One token for one value head: `S ← aS; δ = b(v − Sᵀk); S ← S + kδᵀ; o = Sᵀq` (S is [D_k, D_v]).
#[inline(always)]
fn step_body(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], a: f32, b: f32, u: &mut [f32], o: &mut [f32]) {
    let dv = v.len();
    u.fill(0.0);
    for (i, row) in s.chunks_exact_mut(dv).enumerate() {
        for (sv, uv) in row.iter_mut().zip(u.iter_mut()) {
            *sv *= a;
            *uv += *sv * k[i];
        }
    }
    for (uv, vv) in u.iter_mut().zip(v) {
        *uv = b * (vv - *uv); // δ
    }
    for (i, row) in s.chunks_exact_mut(dv).enumerate() {
        for ((sv, dl), ov) in row.iter_mut().zip(u.iter()).zip(o.iter_mut()) {
            *sv += k[i] * dl;
            *ov += *sv * q[i];
        }
    }
}

/// [`step_body`] on blocks of state columns (AVX2, `D_v` a multiple of 8): 32 columns (4
/// vectors, two cache lines of each row) when `D_v` allows, else 8. For a block `J`,
/// `u_J = a·Σ_i S[i,J]·k_i` and `o_J` stay in registers: pass 1 only reads the block, pass 2
/// writes `S[i,J] = a·S[i,J] + k_i·δ_J` once and accumulates `o_J`; the block (D_k × 32 floats,
/// 16 KiB at D_k = 128) is still in L1 for pass 2. Measured on the 35B-A3B shape, 2 threads,
/// 64 tokens (`examples/gdn_cpu`): 4.1–4.2 ms against 6.4 ms for the row-wise loop; blocks of 8
/// columns were slower than the row-wise loop (9 ms).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn step_avx2(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], a: f32, b: f32, o: &mut [f32]) {
    let dv = v.len();
    assert!(s.len() == k.len() * dv && q.len() == k.len() && o.len() == dv && dv.is_multiple_of(8));
    if dv.is_multiple_of(32) {
        step_blocks::<4>(s, q, k, v, a, b, o)
    } else {
        step_blocks::<1>(s, q, k, v, a, b, o)
    }
}

/// [`step_avx2`] with blocks of `NB` vectors (8·NB columns).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn step_blocks<const NB: usize>(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], a: f32, b: f32, o: &mut [f32]) {
    use std::arch::x86_64::*;
    let (dk, dv) = (k.len(), v.len());
    let (sp, av, bv) = (s.as_mut_ptr(), _mm256_set1_ps(a), _mm256_set1_ps(b));
    for jb in (0..dv).step_by(8 * NB) {
        let mut acc = [_mm256_setzero_ps(); NB];
        for i in 0..dk {
            let ki = _mm256_set1_ps(*k.get_unchecked(i));
            for n in 0..NB {
                acc[n] = _mm256_fmadd_ps(_mm256_loadu_ps(sp.add(i * dv + jb + 8 * n)), ki, acc[n]);
            }
        }
        let mut delta = [_mm256_setzero_ps(); NB];
        for n in 0..NB {
            let u = _mm256_mul_ps(av, acc[n]);
            delta[n] = _mm256_mul_ps(bv, _mm256_sub_ps(_mm256_loadu_ps(v.as_ptr().add(jb + 8 * n)), u));
        }
        let mut oacc = [_mm256_setzero_ps(); NB];
        for i in 0..dk {
            let (ki, qi) = (_mm256_set1_ps(*k.get_unchecked(i)), _mm256_set1_ps(*q.get_unchecked(i)));
            for n in 0..NB {
                let p = sp.add(i * dv + jb + 8 * n);
                let sv = _mm256_fmadd_ps(ki, delta[n], _mm256_mul_ps(av, _mm256_loadu_ps(p)));
                _mm256_storeu_ps(p, sv);
                oacc[n] = _mm256_fmadd_ps(sv, qi, oacc[n]);
            }
        }
        for n in 0..NB {
            _mm256_storeu_ps(o.as_mut_ptr().add(jb + 8 * n), oacc[n]);
        }
    }
}

fn step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], a: f32, b: f32, u: &mut [f32], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::kernels::has_avx2() && v.len().is_multiple_of(8) {
        // SAFETY: AVX2 and FMA were detected; shapes are checked inside.
        return unsafe { step_avx2(s, q, k, v, a, b, o) };
    }
    step_body(s, q, k, v, a, b, u, o)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Chunked (WY) form with chunk length `c`; same result as [`recurrent`] up to rounding.
pub fn chunked(d: GdnDims, t: usize, x: &GdnInputs, state: &mut [f32], out: &mut [f32], c: usize) {
    check(d, t, x, state, out);
    let vpk = d.hv / d.hk;
    let (dk, dv) = (d.dk, d.dv);
    for h in 0..d.hv {
        let kh = h / vpk;
        let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
        let mut c0 = 0;
        while c0 < t {
            let l = c.min(t - c0);
            let row = |buf: &'_ [f32], r: usize, heads: usize, hh: usize, w: usize| -> Vec<f32> {
                buf[((c0 + r) * heads + hh) * w..][..w].to_vec()
            };
            let ks: Vec<Vec<f32>> = (0..l).map(|r| row(x.k, r, d.hk, kh, dk)).collect();
            let qs: Vec<Vec<f32>> = (0..l).map(|r| row(x.q, r, d.hk, kh, dk)).collect();
            let vs: Vec<Vec<f32>> = (0..l).map(|r| row(x.v, r, d.hv, h, dv)).collect();
            let beta: Vec<f32> = (0..l).map(|r| x.beta[(c0 + r) * d.hv + h]).collect();
            let mut gam = vec![0f32; l];
            let mut acc = 0f32;
            for r in 0..l {
                acc += x.g[(c0 + r) * d.hv + h];
                gam[r] = acc;
            }
            // A[r][s] = β_r (k_r·k_s) e^{γ_r−γ_s}, r > s; only exponents ≤ 0 are formed.
            let a = |r: usize, s_: usize| beta[r] * dot(&ks[r], &ks[s_]) * (gam[r] - gam[s_]).exp();
            // Forward substitution: W_r = β_r e^{γ_r} k_r − Σ_{s<r} A_rs W_s, U likewise with v.
            let mut w = vec![vec![0f32; dk]; l];
            let mut u = vec![vec![0f32; dv]; l];
            for r in 0..l {
                let eg = gam[r].exp();
                for i in 0..dk {
                    w[r][i] = beta[r] * eg * ks[r][i];
                }
                for j in 0..dv {
                    u[r][j] = beta[r] * vs[r][j];
                }
                for s_ in 0..r {
                    let ars = a(r, s_);
                    for i in 0..dk {
                        w[r][i] -= ars * w[s_][i];
                    }
                    for j in 0..dv {
                        u[r][j] -= ars * u[s_][j];
                    }
                }
            }
            // V_new = U − W S
            let mut vnew = u;
            for r in 0..l {
                for i in 0..dk {
                    let wi = w[r][i];
                    for j in 0..dv {
                        vnew[r][j] -= wi * s[i * dv + j];
                    }
                }
            }
            // O_r = e^{γ_r} q_r S + Σ_{s≤r} (q_r·k_s) e^{γ_r−γ_s} V_new_s
            for r in 0..l {
                let o = &mut out[((c0 + r) * d.hv + h) * dv..][..dv];
                o.fill(0.0);
                let eg = gam[r].exp();
                for i in 0..dk {
                    let qi = qs[r][i] * eg;
                    for j in 0..dv {
                        o[j] += qi * s[i * dv + j];
                    }
                }
                for s_ in 0..=r {
                    let f = dot(&qs[r], &ks[s_]) * (gam[r] - gam[s_]).exp();
                    for j in 0..dv {
                        o[j] += f * vnew[s_][j];
                    }
                }
            }
            // S' = e^{γ_L} S + Σ_r e^{γ_L−γ_r} k_r V_new_rᵀ
            let gl = gam[l - 1];
            s.iter_mut().for_each(|v| *v *= gl.exp());
            for r in 0..l {
                let f = (gl - gam[r]).exp();
                for i in 0..dk {
                    let ki = ks[r][i] * f;
                    for j in 0..dv {
                        s[i * dv + j] += ki * vnew[r][j];
                    }
                }
            }
            c0 += l;
        }
    }
}
