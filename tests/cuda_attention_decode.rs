//! Decode attention kernels against the CPU reference: attn_prep + attn_decode token by token,
//! the split-K kernels over a long cache (fp32, bf16 and fp8 caches, the tensor-core kernel and
//! its early form). Skips (and passes, saying so) when no GPU/driver is present. Bounds as in
//! cuda_kernels.rs.

mod common;
use common::gpu::*;
use common::*;
use lily::cpu::attention::{attention, AttnDims};
use lily::cpu::norm::{rms_norm, sigmoid};
use lily::cpu::rope::Rope;
use lily::cuda::{kv_fp8, AttnDecode, AttnKernel, KvDtype};
use lily::safetensors::{bf16_to_f32, f32_to_bf16};
use lily::state::KvRows;

const TOL: f64 = 1e-9;

/// attn_prep + attn_decode token by token against Model::attention's CPU steps.
#[test]
fn attention_decode_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut r = rng(6);
    for (nh, hkv, hd, rot, steps) in [
        (4usize, 2usize, 64usize, 16usize, 9usize),
        (16, 2, 256, 64, 300),
        (3, 1, 32, 32, 17),
        (8, 8, 128, 128, 70),
        (8, 1, 96, 32, 140),
    ] {
        let theta = 1e7;
        let rope = Rope::new(rot, theta);
        let qn = uniform(&mut r, hd, 1.5);
        let kn = uniform(&mut r, hd, 1.5);
        let kvd = hkv * hd;
        let (mut kc, mut vc) = (Vec::new(), Vec::new());
        let gb = |v: &[f32]| g.upload_f32(v).unwrap();
        let (qnb, knb) = (gb(&qn), gb(&kn));
        let (gkc, gvc) = (gb(&vec![0f32; steps * kvd]), gb(&vec![0f32; steps * kvd]));
        let (qo, out) = (gb(&vec![f32::NAN; nh * hd]), gb(&vec![f32::NAN; nh * hd]));
        // More splits than positions early on: empty splits must merge as nothing.
        let splits = 32;
        let part = gb(&vec![f32::NAN; nh * splits * (hd + 2)]);
        for pos in 0..steps {
            let qg = uniform(&mut r, nh * 2 * hd, 2.0);
            let k = uniform(&mut r, kvd, 2.0);
            let v = uniform(&mut r, kvd, 2.0);
            // CPU
            let mut q = vec![0f32; nh * hd];
            let mut gate = vec![0f32; nh * hd];
            for h in 0..nh {
                q[h * hd..(h + 1) * hd].copy_from_slice(&qg[h * 2 * hd..h * 2 * hd + hd]);
                gate[h * hd..(h + 1) * hd].copy_from_slice(&qg[h * 2 * hd + hd..(h + 1) * 2 * hd]);
            }
            let mut kk = k.clone();
            rms_norm(&mut q, &qn, 1e-6);
            rms_norm(&mut kk, &kn, 1e-6);
            rope.apply(&mut q, hd, pos);
            rope.apply(&mut kk, hd, pos);
            kc.extend_from_slice(&kk);
            vc.extend_from_slice(&v);
            let mut o = vec![0f32; nh * hd];
            attention(
                &AttnDims { heads: nh, kv_heads: hkv, head_dim: hd },
                &q,
                1,
                pos,
                &KvRows::from_rows(hkv * hd, &kc),
                &KvRows::from_rows(hkv * hd, &vc),
                1.0 / (hd as f32).sqrt(),
                &mut o,
            );
            o.iter_mut().zip(&gate).for_each(|(a, b)| *a *= sigmoid(*b));
            // GPU
            let (qgb, kb, vb) = (gb(&qg), gb(&k), gb(&v));
            let posb = g.upload_bytes(&(pos as i32).to_le_bytes()).unwrap();
            g.attn_prep(
                &lily::cuda::AttnPrep {
                    qg: qgb.ptr,
                    k: kb.ptr,
                    v: vb.ptr,
                    q_norm: qnb.ptr,
                    k_norm: knb.ptr,
                    q_out: qo.ptr,
                    kc: gkc.ptr,
                    vc: gvc.ptr,
                    nh,
                    hkv,
                    hd,
                    gated: true,
                    rot,
                    pos: posb.ptr,
                    theta,
                    eps: 1e-6,
                    kv: KvDtype::F32,
                    // every other position with the angles computed before the wait
                    early: pos % 2 == 1,
                },
                1,
                0,
            )
            .unwrap();
            // Both decode kernels; the packed one only where H_q/H_kv is a power of two <= 8.
            let kernels: &[AttnKernel] = if matches!(nh / hkv, 1 | 2 | 4 | 8) {
                &[AttnKernel::PerHead, AttnKernel::Packed]
            } else {
                &[AttnKernel::PerHead]
            };
            for &kernel in kernels {
                out.write_f32(0, &vec![f32::NAN; nh * hd]).unwrap();
                let a = AttnDecode {
                    q: qo.ptr,
                    kc: gkc.ptr,
                    vc: gvc.ptr,
                    qg: qgb.ptr,
                    out: out.ptr,
                    nh,
                    hkv,
                    hd,
                    pos: posb.ptr,
                    gated: true,
                    part: part.ptr,
                    splits,
                    kv: KvDtype::F32,
                    early: false,
                };
                g.attn_decode(&a, kernel).unwrap();
                if pos < 3 || pos + 1 == steps || pos % 67 == 0 {
                    let name = format!("attention {kernel:?} H{nh} H_kv{hkv} D{hd} R{rot} pos {pos}");
                    check(&format!("{name} q"), &qo.read_f32(0, nh * hd).unwrap(), &q, TOL);
                    check(&format!("{name} k cache"), &gkc.read_f32(0, (pos + 1) * kvd).unwrap(), &kc, TOL);
                    check(&format!("{name} out"), &out.read_f32(0, nh * hd).unwrap(), &o, TOL);
                }
            }
        }
    }
}

/// GQA-packed split-K decode over a long cache (5000 positions: many 16-row tiles per split),
/// against the CPU attention; the tensor-core kernel (8 query heads per KV head, bf16 cache) at
/// head dims 256, 128 and 64, with a last tile and a last split that are only partly filled.
#[test]
fn attention_decode_long_context_matches_cpu() {
    let Some(g) = gpu() else { return };
    let mut r = rng(9);
    for (nh, hkv, hd, len, splits) in
        [(16usize, 2usize, 256usize, 5000usize, 64usize), (8, 1, 128, 3001, 40), (16, 2, 64, 777, 7)]
    {
        let kvd = hkv * hd;
        let q = uniform(&mut r, nh * hd, 1.0);
        let qg = uniform(&mut r, nh * 2 * hd, 2.0);
        let kc = uniform(&mut r, len * kvd, 1.0);
        let vc = uniform(&mut r, len * kvd, 1.0);
        // The CPU attention of the query over (k, v), gated.
        // (over the first n cached positions)
        let cpu_at = |k: &[f32], v: &[f32], n: usize| {
            let mut want = vec![0f32; nh * hd];
            let dims = AttnDims { heads: nh, kv_heads: hkv, head_dim: hd };
            let (k, v) = (KvRows::from_rows(kvd, k), KvRows::from_rows(kvd, v));
            attention(&dims, &q, 1, n - 1, &k, &v, 1.0 / (hd as f32).sqrt(), &mut want);
            for h in 0..nh {
                for d in 0..hd {
                    want[h * hd + d] *= sigmoid(qg[h * 2 * hd + hd + d]);
                }
            }
            want
        };
        let cpu = |k: &[f32], v: &[f32]| cpu_at(k, v, len);
        let want = cpu(&kc, &vc);
        let gb = |v: &[f32]| g.upload_f32(v).unwrap();
        let (qb, qgb, kb, vb) = (gb(&q), gb(&qg), gb(&kc), gb(&vc));
        let out = gb(&vec![f32::NAN; nh * hd]);
        let part = gb(&vec![f32::NAN; nh * splits * (hd + 2)]);
        let posb = g.upload_bytes(&((len - 1) as i32).to_le_bytes()).unwrap();
        // One decode over the caches at (kc, vc) of element type kv; returns the output.
        let decode = |kc: u64, vc: u64, kv: KvDtype, kernel: AttnKernel, early: bool| {
            out.write_f32(0, &vec![f32::NAN; nh * hd]).unwrap();
            let a = AttnDecode {
                q: qb.ptr,
                kc,
                vc,
                qg: qgb.ptr,
                out: out.ptr,
                nh,
                hkv,
                hd,
                pos: posb.ptr,
                gated: true,
                part: part.ptr,
                splits,
                kv,
                early,
            };
            g.attn_decode(&a, kernel).unwrap();
            out.read_f32(0, nh * hd).unwrap()
        };
        let shape = format!("H{nh} H_kv{hkv} D{hd}, {len} cached positions, {splits} splits");
        // The packed kernel twice: the second call sees the first call's partials in the scratch.
        for kernel in [AttnKernel::PerHead, AttnKernel::Packed, AttnKernel::Packed] {
            let got = decode(kb.ptr, vb.ptr, KvDtype::F32, kernel, false);
            check(&format!("attention decode {kernel:?}, {shape}"), &got, &want, TOL);
        }
        // A bf16 cache: the kernels widen each element exactly, so against the CPU attention over
        // the same bf16-rounded K/V they keep the fp32 bound (the tensor-core kernel's hi + lo
        // query and weights included); against the fp32 cache the distance is the rounding's
        // (relative 2^-9 per element: NMSE about 1e-6 on these uniform inputs; bound 1e-5).
        let round: fn(&[f32]) -> Vec<f32> = |v| v.iter().map(|&x| bf16_to_f32(f32_to_bf16(x))).collect();
        let want_r = cpu(&round(&kc), &round(&vc));
        let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|&x| f32_to_bf16(x).to_le_bytes()).collect() };
        let (kb16, vb16) = (g.upload_bytes(&bytes(&kc)).unwrap(), g.upload_bytes(&bytes(&vc)).unwrap());
        for kernel in [AttnKernel::PerHead, AttnKernel::Packed, AttnKernel::Tc, AttnKernel::Tc] {
            let got = decode(kb16.ptr, vb16.ptr, KvDtype::Bf16, kernel, false);
            let name = format!("attention decode {kernel:?}, {shape}, bf16 cache");
            check(&format!("{name} vs cpu on the rounded K/V"), &got, &want_r, TOL);
            check(&format!("{name} vs the fp32 cache"), &got, &want, 1e-5);
        }
        // The early form (the first tiles requested before the kernel's wait, the newest row
        // read after it) reads the same values into the same places: the same bits.
        let plain = decode(kb16.ptr, vb16.ptr, KvDtype::Bf16, AttnKernel::Tc, false);
        let early = decode(kb16.ptr, vb16.ptr, KvDtype::Bf16, AttnKernel::Tc, true);
        let differ = plain.iter().zip(&early).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "attention decode Tc early, {shape}: {differ} outputs differ from the plain form's");
        // The splits merged inside the decode launch (attn_decode_fold, its last blocks of each
        // KV head merging): three launches on one set of counters (the kernel moves their epoch
        // each launch), the early form second, against the CPU and attn_combine's merge of the
        // same partials (another order of the sums); then at 101 cached positions, where every
        // split past the first two is empty, and once more at the full length.
        if hkv * splits <= g.sms as usize {
            assert!(g.attn_fold_applies(nh, hkv, hd, splits), "the fold form must apply to {shape}");
            let ctr = g.zeros(8 * hkv).unwrap();
            let fold = |n: usize, early: bool| {
                out.write_f32(0, &vec![f32::NAN; nh * hd]).unwrap();
                let pb = g.upload_bytes(&((n - 1) as i32).to_le_bytes()).unwrap();
                let a = AttnDecode {
                    q: qb.ptr,
                    kc: kb16.ptr,
                    vc: vb16.ptr,
                    qg: qgb.ptr,
                    out: out.ptr,
                    nh,
                    hkv,
                    hd,
                    pos: pb.ptr,
                    gated: true,
                    part: part.ptr,
                    splits,
                    kv: KvDtype::Bf16,
                    early,
                };
                g.attn_decode_fold(&a, ctr.ptr).unwrap();
                out.read_f32(0, nh * hd).unwrap()
            };
            let runs = [fold(len, false), fold(len, true), fold(len, false)];
            for (i, got) in runs.iter().enumerate() {
                let name = format!("attention decode Tc fold (launch {i}), {shape}");
                check(&format!("{name} vs cpu on the rounded K/V"), got, &want_r, TOL);
                check(&format!("{name} vs attn_combine's merge"), got, &plain, 1e-12);
            }
            for (i, got) in runs.iter().enumerate().skip(1) {
                let differ = got.iter().zip(&runs[0]).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(
                    differ, 0,
                    "attention decode Tc fold, {shape}: launch {i} differs from launch 0 in {differ} outputs"
                );
            }
            let short = 101.min(len);
            let want_s = cpu_at(&round(&kc), &round(&vc), short);
            check(
                &format!("attention decode Tc fold, {shape} at {short} positions"),
                &fold(short, false),
                &want_s,
                TOL,
            );
            check(&format!("attention decode Tc fold after the short one, {shape}"), &fold(len, true), &want_r, TOL);
        } else {
            eprintln!("SKIPPED: the fold form needs {} SMs for {shape} ({} here)", hkv * splits, g.sms);
        }
        // An fp8 cache (the tensor-core kernel, G = 8, every shape here): the kernel widens each
        // row exactly (e4m3 value times its power-of-two scale), so against the CPU attention over
        // the same decoded K/V it keeps the fp32 bound; against the fp32 cache the distance is
        // e4m3's rounding (half a step: relative 2^-4 per element, NMSE about 1.3e-3 of the K/V
        // themselves on uniform inputs, less after the softmax's averaging; bound 5e-3).
        if !g.has_fp8() {
            eprintln!("SKIPPED: the fp8 cache needs an sm_89 or later GPU (this one is {})", g.arch);
        } else {
            assert!(g.attn_tc_applies(nh, hkv, hd, KvDtype::Fp8), "the fp8 decode kernel must apply to {shape}");
            let (k8, v8) = (kv_fp8::encode_rows(&kc, hkv, hd), kv_fp8::encode_rows(&vc, hkv, hd));
            let want8 = cpu(&kv_fp8::decode_rows(&k8, hkv, hd), &kv_fp8::decode_rows(&v8, hkv, hd));
            let (kb8, vb8) = (g.upload_bytes(&k8).unwrap(), g.upload_bytes(&v8).unwrap());
            for _ in 0..2 {
                let got = decode(kb8.ptr, vb8.ptr, KvDtype::Fp8, AttnKernel::Tc, false);
                let name = format!("attention decode Tc, {shape}, fp8 cache");
                check(&format!("{name} vs cpu on the decoded K/V"), &got, &want8, TOL);
                check(&format!("{name} vs the fp32 cache"), &got, &want, 5e-3);
            }
        }
    }
}
