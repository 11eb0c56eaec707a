//! The GDN decode kernels against the CPU reference (src/cpu/gdn.rs via tests/common): the input
//! projection with the causal conv in its epilogue (gemv_q2_conv), conv_step + the state step
//! token by token, and 512 steps without drift. Skips (and passes, saying so) when no GPU/driver
//! is present.
//!
//! Bounds as tests/cuda_kernels.rs: fp32 on both sides, differing only in summation order
//! (NMSE ≲ 1e-11 for these widths); 1e-9, 1e-8 where errors compound through the recurrence.

mod common;
use common::gpu::*;
use common::*;
use lily::cpu::gdn::GdnDims;
use lily::cpu::norm::rms_norm;
use lily::cuda::GpuLinear;
use lily::sampling::Rng;

const TOL: f64 = 1e-9;

/// gemv_q2_conv (the GDN input projection with conv_step folded into its epilogue) against the
/// CPU: the projection W · rms_norm(x) over every row, then the causal conv + SiLU of rows < C
/// with the carried state, over several steps (the state must shift exactly as conv_step's).
/// Shapes: the real one (8192 conv channels of 12,352 rows, 2048 columns), odd channel counts,
/// K = 2 / 4 / 8 / 16, 8-bit codes; a K that is not a power of two is refused.
#[test]
fn gemv_conv_matches_cpu() {
    use lily::cpu::conv::causal_conv1d_silu;
    let Some(g) = gpu() else { return };
    let mut r = rng(23);
    for (c, extra, cols, k, bits, group) in [
        (8192usize, 4160usize, 2048usize, 4usize, 4u32, 64usize),
        (37, 0, 256, 4, 4, 64),
        (101, 13, 512, 2, 8, 32),
        (64, 5, 128, 8, 4, 32),
        (33, 31, 256, 16, 8, 64),
    ] {
        let name = format!("gemv_conv C{c}+{extra} K{cols} taps {k} q{bits}");
        let l = quant(&mut r, c + extra, cols, bits, group);
        let gl = GpuLinear::upload(&g, &l).unwrap();
        assert!(lily::cuda::Gpu::gemv_conv_ok(&gl, c, k), "{name}: not fused");
        let conv_w = uniform(&mut r, c * k, 0.5);
        let nw = uniform(&mut r, cols, 1.5);
        let mut cstate = uniform(&mut r, (k - 1) * c, 1.0);
        let gb = |v: &[f32]| g.upload_f32(v).unwrap();
        let (cwb, nwb, gcs) = (gb(&conv_w), gb(&nw), gb(&cstate));
        let (yb, cyb) = (gb(&vec![f32::NAN; c + extra]), gb(&vec![f32::NAN; c]));
        for step in 0..3 {
            let x = uniform(&mut r, cols, 1.0);
            let mut xn = x.clone();
            rms_norm(&mut xn, &nw, 1e-6);
            let mut proj = vec![0f32; c + extra];
            l.matvec(&xn, &mut proj);
            let mut conv = vec![0f32; c];
            causal_conv1d_silu(&proj[..c], 1, c, &conv_w, k, &mut cstate, &mut conv);
            let xb = gb(&x);
            g.gemv_conv(&gl, xb.ptr, (nwb.ptr, 1e-6), yb.ptr, (gcs.ptr, cwb.ptr, cyb.ptr), c, k).unwrap();
            let s = format!("{name} step {step}");
            check(&format!("{s} projection"), &yb.read_f32(0, c + extra).unwrap(), &proj, TOL);
            check(&format!("{s} conv"), &cyb.read_f32(0, c).unwrap(), &conv, TOL);
            check(&format!("{s} conv state"), &gcs.read_f32(0, cstate.len()).unwrap(), &cstate, TOL);
        }
    }
    let l = quant(&mut r, 40, 256, 4, 64);
    let gl = GpuLinear::upload(&g, &l).unwrap();
    assert!(!lily::cuda::Gpu::gemv_conv_ok(&gl, 32, 3), "a 3-tap conv must not be fused");
    let e = g.gemv_conv(&gl, 0, (0, 0.0), 0, (0, 0, 0), 32, 3).expect_err("3 taps must be refused");
    assert!(e.to_string().contains("not fused"), "{e}");
}

/// A GDN layer's decode weights for the tests: K = 4 conv taps over `c` channels, dt bias,
/// negative A (away from 0) and the gated norm's weights.
fn gdn_test_weights(r: &mut Rng, c: usize, hv: usize, dv: usize) -> (usize, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let k = 4;
    let conv_w = uniform(r, c * k, 0.5);
    let dt_bias = uniform(r, hv, 1.0);
    let neg_a: Vec<f32> = uniform(r, hv, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
    let normw = uniform(r, dv, 1.5);
    (k, conv_w, dt_bias, neg_a, normw)
}

/// The step's arguments over those weights on the device ((dt bias, negative A, norm)), the
/// state, the output and the conv output `y`; each token sets b, a and z.
fn gdn_test_step(
    d: GdnDims,
    (dt_bias, neg_a, norm): (u64, u64, u64),
    state: u64,
    out: u64,
    y: u64,
) -> lily::cuda::GdnStep {
    let GdnDims { hk, hv, dk, dv } = d;
    lily::cuda::GdnStep { y, b: 0, a: 0, z: 0, dt_bias, neg_a, norm, state, out, hk, hv, dk, dv, eps: 1e-6 }
}

/// conv_step + gdn_step for several tokens (state carried) against the CPU ops of model.rs; the
/// row-split kernel with a ragged last part (D_k 40) at D_v 256 and 64, and the serial one
/// (D_v x D_k too large for one block: the last shape); gdn_step_c4 where it takes the shape
/// (D_v 128: Qwen3.6's 128 x 128 and a ragged D_k 40).
#[test]
fn gdn_decode_steps_match_cpu() {
    let Some(g) = gpu() else { return };
    let mut r = rng(5);
    for (hk, hv, dk, dv) in [
        (2usize, 4usize, 32usize, 32usize),
        (16, 32, 128, 128),
        (1, 3, 40, 128),
        (2, 4, 40, 256),
        (3, 3, 64, 96),
        (2, 4, 40, 64),
        (2, 2, 256, 160),
    ] {
        let d = GdnDims { hk, hv, dk, dv };
        let (kd, vd) = (hk * dk, hv * dv);
        let c = 2 * kd + vd;
        let (k, conv_w, dt_bias, neg_a, normw) = gdn_test_weights(&mut r, c, hv, dv);
        let mut cstate = vec![0f32; (k - 1) * c];
        let mut rec = vec![0f32; hv * dk * dv];
        let gb = |v: &[f32]| g.upload_f32(v).unwrap();
        let (cw, dtb, nab, nwb) = (gb(&conv_w), gb(&dt_bias), gb(&neg_a), gb(&normw));
        let (gcs, grec) = (gb(&cstate), gb(&rec));
        let (yb, ob) = (gb(&vec![f32::NAN; c]), gb(&vec![f32::NAN; vd]));
        let base = gdn_test_step(d, (dtb.ptr, nab.ptr, nwb.ptr), grec.ptr, ob.ptr, yb.ptr);
        // gdn_step_par_e (the default; LILY_CUDA_GDN_STEP=par: gdn_step_par) on its own state,
        // where the row-split kernel takes the shape: gdn_step_par's output and state bit for bit
        let par = dv % 32 == 0 && dv * dk.div_ceil(32) <= 1024 && dk <= 256;
        let (grec_e, ob_e) = (gb(&rec), gb(&vec![f32::NAN; vd]));
        let (grec_p, ob_p) = (gb(&rec), gb(&vec![f32::NAN; vd]));
        // gdn_step_c4 (LILY_CUDA_GDN_STEP=c4: a cluster of 4 blocks per value head) on its own
        // state, where it takes the shape, against the CPU
        let (grec_c, ob_c) = (gb(&rec), gb(&vec![f32::NAN; vd]));
        let c4 = g.gdn_step_c4_ok(&base);
        for step in 0..5 {
            let qkv = uniform(&mut r, c, 2.0);
            let z = uniform(&mut r, vd, 2.0);
            let b = uniform(&mut r, hv, 3.0);
            let a = uniform(&mut r, hv, 3.0);
            // CPU reference: the same steps as Model::gdn for one token.
            let w = GdnWeights { d, conv_w: &conv_w, taps: k, neg_a: &neg_a, dt_bias: &dt_bias, norm: &normw };
            let (conv, o) = cpu_gdn(&w, 1, &qkv, &z, &b, &a, &mut cstate, &mut rec);
            // GPU.
            let (xq, zb, bb, ab) = (gb(&qkv), gb(&z), gb(&b), gb(&a));
            g.conv_step(xq.ptr, gcs.ptr, cw.ptr, yb.ptr, c, k).unwrap();
            g.gdn_step(&lily::cuda::GdnStep { b: bb.ptr, a: ab.ptr, z: zb.ptr, ..base }).unwrap();
            let name = format!("gdn H_k{hk} H_v{hv} D_k{dk} D_v{dv} step {step}");
            check(&format!("{name} conv"), &yb.read_f32(0, c).unwrap(), &conv, TOL);
            check(&format!("{name} out"), &ob.read_f32(0, vd).unwrap(), &o, 1e-8);
            check(&format!("{name} state"), &grec.read_f32(0, rec.len()).unwrap(), &rec, 1e-8);
            check(&format!("{name} conv state"), &gcs.read_f32(0, cstate.len()).unwrap(), &cstate, 0.0);
            if par {
                let st = lily::cuda::GdnStep { b: bb.ptr, a: ab.ptr, z: zb.ptr, ..base };
                g.gdn_step_par_form(&lily::cuda::GdnStep { state: grec_p.ptr, out: ob_p.ptr, ..st }, false).unwrap();
                g.gdn_step_par_form(&lily::cuda::GdnStep { state: grec_e.ptr, out: ob_e.ptr, ..st }, true).unwrap();
                let bits = |b: &lily::cuda::DevBuf, n: usize| -> Vec<u32> {
                    b.read_f32(0, n).unwrap().iter().map(|v| v.to_bits()).collect()
                };
                assert_eq!(bits(&ob_e, vd), bits(&ob_p, vd), "{name}: gdn_step_par_e output");
                assert_eq!(bits(&grec_e, rec.len()), bits(&grec_p, rec.len()), "{name}: gdn_step_par_e state");
                check(&format!("{name} early out"), &ob_e.read_f32(0, vd).unwrap(), &o, 1e-8);
            }
            if c4 {
                let st =
                    lily::cuda::GdnStep { b: bb.ptr, a: ab.ptr, z: zb.ptr, state: grec_c.ptr, out: ob_c.ptr, ..base };
                g.gdn_step_c4(&st).unwrap();
                check(&format!("{name} c4 out"), &ob_c.read_f32(0, vd).unwrap(), &o, 1e-8);
                check(&format!("{name} c4 state"), &grec_c.read_f32(0, rec.len()).unwrap(), &rec, 1e-8);
            }
        }
    }
}

/// 512 GDN decode steps (conv_step + gdn_step, state carried on the GPU) against the CPU steps on
/// the same inputs: fp32 state drift stays at rounding level over a long generation (the
/// recurrence contracts by g < 1 each step, so differences do not compound without bound).
#[test]
fn gdn_decode_512_steps_do_not_drift() {
    let Some(g) = gpu() else { return };
    let mut r = rng(10);
    let (hk, hv, dk, dv, steps) = (16usize, 32usize, 128usize, 128usize, 512usize);
    let d = GdnDims { hk, hv, dk, dv };
    let (kd, vd) = (hk * dk, hv * dv);
    let c = 2 * kd + vd;
    let (k, conv_w, dt_bias, neg_a, normw) = gdn_test_weights(&mut r, c, hv, dv);
    let qkv = uniform(&mut r, steps * c, 2.0);
    let z = uniform(&mut r, steps * vd, 2.0);
    let b = uniform(&mut r, steps * hv, 3.0);
    // Gates near 1 (slow decay): the regime where state errors would accumulate longest.
    let a: Vec<f32> = uniform(&mut r, steps * hv, 1.0).iter().map(|v| v - 4.0).collect();
    let gb = |v: &[f32]| g.upload_f32(v).unwrap();
    let (cw, dtb, nab, nwb) = (gb(&conv_w), gb(&dt_bias), gb(&neg_a), gb(&normw));
    let (xq, zb, bb, ab) = (gb(&qkv), gb(&z), gb(&b), gb(&a));
    let mut cstate = vec![0f32; (k - 1) * c];
    let mut rec = vec![0f32; hv * dk * dv];
    let (gcs, grec) = (gb(&cstate), gb(&rec));
    let (yb, ob) = (gb(&vec![f32::NAN; c]), gb(&vec![f32::NAN; vd]));
    let base = gdn_test_step(d, (dtb.ptr, nab.ptr, nwb.ptr), grec.ptr, ob.ptr, yb.ptr);
    let mut worst_out = 0f64;
    for step in 0..steps {
        let w = GdnWeights { d, conv_w: &conv_w, taps: k, neg_a: &neg_a, dt_bias: &dt_bias, norm: &normw };
        let (_, o) = cpu_gdn(
            &w,
            1,
            &qkv[step * c..(step + 1) * c],
            &z[step * vd..(step + 1) * vd],
            &b[step * hv..(step + 1) * hv],
            &a[step * hv..(step + 1) * hv],
            &mut cstate,
            &mut rec,
        );
        g.conv_step(xq.at(4 * step * c), gcs.ptr, cw.ptr, yb.ptr, c, k).unwrap();
        let (sb, sa, sz) = (bb.at(4 * step * hv), ab.at(4 * step * hv), zb.at(4 * step * vd));
        g.gdn_step(&lily::cuda::GdnStep { b: sb, a: sa, z: sz, ..base }).unwrap();
        let e = nmse(&ob.read_f32(0, vd).unwrap(), &o);
        worst_out = worst_out.max(e);
        if [0, 63, 127, 255, steps - 1].contains(&step) {
            let es = nmse(&grec.read_f32(0, rec.len()).unwrap(), &rec);
            eprintln!("gdn 512-step drift: step {step}: out nmse {e:.2e}, state nmse {es:.2e}");
            assert!(es <= 1e-8, "state drifted at step {step}: nmse {es:.3e}");
        }
    }
    assert!(worst_out <= 1e-8, "output drifted: worst nmse {worst_out:.3e}");
}
