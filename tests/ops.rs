//! Each CPU op against a naive f64 version written from the formula.

mod common;
use common::*;
use lily::cpu::conv::causal_conv1d_silu;
use lily::cpu::gdn::{self, GdnDims, GdnInputs};
use lily::cpu::moe::route;
use lily::cpu::norm::{gated_rms_norm, l2_norm, rms_norm};
use lily::cpu::rope::Rope;

fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

// fp32 single-pass ops over ≤ a few hundred terms: relative error ~1e-6; NMSE bound 1e-10 leaves
// margin while catching any formula mistake (which gives NMSE ≳ 1e-3).
const F32_NMSE: f64 = 1e-10;

#[test]
fn rms_norm_matches_naive() {
    let mut r = rng(1);
    for d in [1usize, 7, 64, 257] {
        let x = uniform(&mut r, 3 * d, 3.0);
        let w = uniform(&mut r, d, 2.0);
        let mut got = x.clone();
        rms_norm(&mut got, &w, 1e-6);
        let mut want = Vec::new();
        for row in x.chunks(d) {
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            want.extend(row.iter().zip(&w).map(|(v, g)| (*v as f64 * inv * *g as f64) as f32));
        }
        assert!(nmse(&got, &want) < F32_NMSE, "d={d}");
    }
}

#[test]
fn gated_rms_norm_matches_naive() {
    let mut r = rng(2);
    let d = 128;
    let x = uniform(&mut r, 4 * d, 2.0);
    let z = uniform(&mut r, 4 * d, 4.0);
    let w = uniform(&mut r, d, 1.5);
    let mut got = x.clone();
    gated_rms_norm(&mut got, &z, &w, 1e-6);
    let mut want = Vec::new();
    for (row, zr) in x.chunks(d).zip(z.chunks(d)) {
        let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        for i in 0..d {
            want.push((w[i] as f64 * row[i] as f64 * inv * silu64(zr[i] as f64)) as f32);
        }
    }
    assert!(nmse(&got, &want) < F32_NMSE);
}

#[test]
fn l2_norm_matches_naive() {
    let mut r = rng(3);
    let x = uniform(&mut r, 5 * 32, 2.0);
    let mut got = x.clone();
    l2_norm(&mut got, 32, 1e-6, 0.25);
    let want: Vec<f32> = x
        .chunks(32)
        .flat_map(|row| {
            let n = (row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() + 1e-6).sqrt();
            row.iter().map(move |v| (0.25 * *v as f64 / n) as f32).collect::<Vec<_>>()
        })
        .collect();
    assert!(nmse(&got, &want) < F32_NMSE);
}

#[test]
fn partial_rope_rotates_only_the_first_dims_neox_style() {
    let (hd, rd, heads, theta) = (32usize, 8usize, 3usize, 1e7f64);
    let rope = Rope::new(rd, theta);
    let mut r = rng(4);
    for pos in [0usize, 1, 17, 4000] {
        let x = uniform(&mut r, heads * hd, 1.0);
        let mut got = x.clone();
        rope.apply(&mut got, hd, pos);
        let mut want = x.clone();
        for h in 0..heads {
            for i in 0..rd / 2 {
                let ang = pos as f64 * theta.powf(-(2.0 * i as f64) / rd as f64);
                let (a, b) = (x[h * hd + i] as f64, x[h * hd + i + rd / 2] as f64);
                want[h * hd + i] = (a * ang.cos() - b * ang.sin()) as f32;
                want[h * hd + i + rd / 2] = (b * ang.cos() + a * ang.sin()) as f32;
            }
        }
        assert!(max_abs_diff(&got, &want) < 1e-5, "pos={pos}");
        for h in 0..heads {
            assert_eq!(&got[h * hd + rd..(h + 1) * hd], &x[h * hd + rd..(h + 1) * hd], "dims past R must pass through");
        }
    }
}

#[test]
fn conv1d_with_state_matches_naive_and_chunking() {
    let (t, c, k) = (9usize, 5usize, 4usize);
    let mut r = rng(5);
    let x = uniform(&mut r, t * c, 1.0);
    let w = uniform(&mut r, c * k, 1.0);
    let init = uniform(&mut r, (k - 1) * c, 1.0);
    // naive over X = [state; x]
    let mut xs = init.clone();
    xs.extend(&x);
    let mut want = vec![0f32; t * c];
    for tt in 0..t {
        for ch in 0..c {
            let mut s = 0f64;
            for j in 0..k {
                s += w[ch * k + j] as f64 * xs[(tt + j) * c + ch] as f64;
            }
            want[tt * c + ch] = silu64(s) as f32;
        }
    }
    let mut state = init.clone();
    let mut got = vec![0f32; t * c];
    causal_conv1d_silu(&x, t, c, &w, k, &mut state, &mut got);
    assert!(nmse(&got, &want) < F32_NMSE);
    assert_eq!(state, xs[(t) * c..].to_vec(), "state = last K-1 raw inputs");
    // Token by token with carried state gives the same.
    let mut state2 = init.clone();
    let mut got2 = Vec::new();
    for tt in 0..t {
        let mut y = vec![0f32; c];
        causal_conv1d_silu(&x[tt * c..(tt + 1) * c], 1, c, &w, k, &mut state2, &mut y);
        got2.extend(y);
    }
    assert!(max_abs_diff(&got, &got2) < 1e-6);
    assert_eq!(state, state2);
}

/// (q, k, v, g, beta)
type GdnData = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

fn gdn_inputs(r: &mut lily::sampling::Rng, d: GdnDims, t: usize) -> GdnData {
    let mut q = uniform(r, t * d.hk * d.dk, 1.0);
    let mut k = uniform(r, t * d.hk * d.dk, 1.0);
    l2_norm(&mut q, d.dk, 1e-6, 1.0 / (d.dk as f32).sqrt());
    l2_norm(&mut k, d.dk, 1e-6, 1.0);
    let v = uniform(r, t * d.hv * d.dv, 1.0);
    // log decays spanning strong (−8) to weak (≈0) forgetting
    let g: Vec<f32> = uniform(r, t * d.hv, 1.0).iter().map(|u| -4.0 * (u + 1.0)).collect();
    let beta: Vec<f32> = uniform(r, t * d.hv, 1.0).iter().map(|u| 0.5 + 0.5 * u).collect();
    (q, k, v, g, beta)
}

/// Direct f64 transcription of the recurrence: S ← e^g S; δ = β(v − Sᵀk); S ← S + kδᵀ; o = Sᵀq.
fn gdn_naive(d: GdnDims, t: usize, x: &GdnInputs, s0: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut s: Vec<f64> = s0.iter().map(|v| *v as f64).collect();
    let mut out = vec![0f32; t * d.hv * d.dv];
    for tt in 0..t {
        for h in 0..d.hv {
            let kh = h / (d.hv / d.hk);
            let st = &mut s[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
            let a = (x.g[tt * d.hv + h] as f64).exp();
            st.iter_mut().for_each(|v| *v *= a);
            let kk = |i: usize| x.k[(tt * d.hk + kh) * d.dk + i] as f64;
            let qq = |i: usize| x.q[(tt * d.hk + kh) * d.dk + i] as f64;
            for j in 0..d.dv {
                let u: f64 = (0..d.dk).map(|i| st[i * d.dv + j] * kk(i)).sum();
                let delta = x.beta[tt * d.hv + h] as f64 * (x.v[(tt * d.hv + h) * d.dv + j] as f64 - u);
                for i in 0..d.dk {
                    st[i * d.dv + j] += kk(i) * delta;
                }
                out[(tt * d.hv + h) * d.dv + j] = (0..d.dk).map(|i| st[i * d.dv + j] * qq(i)).sum::<f64>() as f32;
            }
        }
    }
    (out, s.iter().map(|v| *v as f32).collect())
}

#[test]
fn gated_delta_rule_recurrent_matches_naive_and_chunked() {
    // H_v ≠ H_k (value head h reads key head h / 2), T not a multiple of the chunk; D_v of one
    // and of three 8-column blocks (the AVX2 step) and not a multiple of 8 (the portable one).
    for d in [
        GdnDims { hk: 2, hv: 4, dk: 16, dv: 8 },
        GdnDims { hk: 1, hv: 2, dk: 12, dv: 24 },
        GdnDims { hk: 2, hv: 2, dk: 8, dv: 12 },
    ] {
        check_gdn(d);
    }
}

fn check_gdn(d: GdnDims) {
    let t = 150;
    let mut r = rng(6);
    let (q, k, v, g, beta) = gdn_inputs(&mut r, d, t);
    let x = GdnInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
    let s0 = uniform(&mut r, d.hv * d.dk * d.dv, 0.5);
    let (want, want_s) = gdn_naive(d, t, &x, &s0);

    let mut s1 = s0.clone();
    let mut o1 = vec![0f32; t * d.hv * d.dv];
    gdn::recurrent(d, t, &x, &mut s1, &mut o1);
    assert!(nmse(&o1, &want) < 1e-10, "{d:?}: recurrent out nmse {}", nmse(&o1, &want));
    assert!(nmse(&s1, &want_s) < 1e-10, "{d:?}: recurrent state nmse {}", nmse(&s1, &want_s));

    for chunk in [64usize, 16, 1] {
        let mut s2 = s0.clone();
        let mut o2 = vec![0f32; t * d.hv * d.dv];
        gdn::chunked(d, t, &x, &mut s2, &mut o2, chunk);
        // The UT transform reorders sums; fp32 error grows with chunk length but stays ~1e-6 relative.
        assert!(nmse(&o2, &want) < 1e-9, "{d:?} chunk {chunk}: out nmse {}", nmse(&o2, &want));
        assert!(nmse(&s2, &want_s) < 1e-9, "{d:?} chunk {chunk}: state nmse {}", nmse(&s2, &want_s));
    }
}

#[test]
fn gated_delta_rule_split_calls_equal_one_call() {
    let d = GdnDims { hk: 1, hv: 2, dk: 8, dv: 8 };
    let t = 40;
    let mut r = rng(7);
    let (q, k, v, g, beta) = gdn_inputs(&mut r, d, t);
    let x = GdnInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
    let mut s_all = vec![0f32; d.hv * d.dk * d.dv];
    let mut o_all = vec![0f32; t * d.hv * d.dv];
    gdn::recurrent(d, t, &x, &mut s_all, &mut o_all);
    let mut s = vec![0f32; d.hv * d.dk * d.dv];
    let mut o = Vec::new();
    for (a, b) in [(0usize, 13usize), (13, 14), (14, 40)] {
        let n = b - a;
        let part = GdnInputs {
            q: &q[a * d.hk * d.dk..b * d.hk * d.dk],
            k: &k[a * d.hk * d.dk..b * d.hk * d.dk],
            v: &v[a * d.hv * d.dv..b * d.hv * d.dv],
            g: &g[a * d.hv..b * d.hv],
            beta: &beta[a * d.hv..b * d.hv],
        };
        let mut op = vec![0f32; n * d.hv * d.dv];
        gdn::recurrent(d, n, &part, &mut s, &mut op);
        o.extend(op);
    }
    assert_eq!(o, o_all);
    assert_eq!(s, s_all);
}

#[test]
fn moe_routing_is_softmax_topk_renormalised() {
    let mut r = rng(8);
    let logits = uniform(&mut r, 64, 5.0);
    let k = 8;
    let got = route(&logits, k, true);
    let mut idx: Vec<usize> = (0..64).collect();
    idx.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
    let m = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let p: Vec<f64> = logits.iter().map(|l| (*l as f64 - m).exp()).collect();
    let top_sum: f64 = idx[..k].iter().map(|&e| p[e]).sum();
    assert_eq!(got.len(), k);
    for (j, (e, w)) in got.iter().enumerate() {
        assert_eq!(*e, idx[j]);
        assert!((*w as f64 - p[*e] / top_sum).abs() < 1e-6);
    }
    let total: f32 = got.iter().map(|x| x.1).sum();
    assert!((total - 1.0).abs() < 1e-5);
    // Without renormalisation the weights are the plain softmax probabilities.
    let all: f64 = p.iter().sum();
    let raw = route(&logits, k, false);
    assert!((raw[0].1 as f64 - p[idx[0]] / all).abs() < 1e-6);
}
