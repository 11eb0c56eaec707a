//! Causal attention of a prefill chunk over a KV cache against the CPU reference: attn_prep
//! (q/k norm, RoPE, the cache rows) and every prefill attention kernel over fp32, bf16 and fp8
//! caches. Skips (and passes, saying so) when no GPU/driver is present.
//!
//! Bounds (NMSE): fp32 kernels 1e-9 (summation order only). bf16 attention: Q, K, V and the
//! probabilities P are rounded to bf16 (scores and softmax in fp32); the output is a convex
//! combination of V rows, so its NMSE stays near the bf16 rounding level of V and P, a few 1e-6;
//! we allow 1e-4 (a masking or fragment error gives ≳ 1e-2). fp8: stated where checked.

mod common;
use common::gpu::*;
use common::*;
use lily::cpu::attention::{attention, AttnDims};
use lily::cpu::norm::{rms_norm, sigmoid};
use lily::cpu::rope::Rope;
use lily::cuda::{Precision, PrefillAttn};
use lily::safetensors::{bf16_to_f32, f32_to_bf16};
use lily::state::KvRows;

const TOL: f64 = 1e-9;
const TOL_ATTN_BF16: f64 = 1e-4;

/// The CPU's causal attention of `t` queries at positions p0.. over cache rows `kc`/`vc` of
/// `(H_q, H_kv, D)` heads, times the output gate's sigmoid.
fn gated_attention(
    (nh, hkv, hd): (usize, usize, usize),
    q: &[f32],
    gate: &[f32],
    t: usize,
    p0: usize,
    kc: &[f32],
    vc: &[f32],
) -> Vec<f32> {
    let mut out = vec![0f32; t * nh * hd];
    let (k, v) = (KvRows::from_rows(hkv * hd, kc), KvRows::from_rows(hkv * hd, vc));
    let dims = AttnDims { heads: nh, kv_heads: hkv, head_dim: hd };
    attention(&dims, q, t, p0, &k, &v, 1.0 / (hd as f32).sqrt(), &mut out);
    out.iter_mut().zip(gate).for_each(|(a, b)| *a *= sigmoid(*b));
    out
}

/// attn_prep + attn_prefill for a chunk of T tokens after p0 cached positions, against the CPU
/// causal attention.
#[test]
fn attention_prefill_matches_cpu() {
    attention_cases(false);
}

/// The wgmma + TMA kernel (sm_90a; the default there over a bf16 cache) in its own test, so that a kernel that
/// faults does not take the others' results with it.
#[test]
fn attention_prefill_wgmma_matches_cpu() {
    attention_cases(true);
}

/// `wgmma`: only the wgmma flash kernels; else every other kernel and the default.
fn attention_cases(wgmma: bool) {
    let Some(g) = gpu() else { return };
    if wgmma && g.arch != "sm_90a" {
        eprintln!("SKIPPED: the wgmma attention kernels need an sm_90a device (this one is {})", g.arch);
        return;
    }
    let mut r = rng(14);
    for (nh, hkv, hd, rot, p0, t) in [
        (4usize, 2usize, 64usize, 16usize, 0usize, 9usize),
        (16, 2, 256, 64, 37, 70),
        (3, 1, 32, 32, 5, 17),
        (4, 4, 32, 32, 0, 1),
        // The flash kernel's shapes: 128-row blocks over several 64-key tiles, chunks starting
        // off a tile edge, a block of rows from more than one tile of keys, D = 128 with G = 8.
        (16, 2, 256, 64, 100, 300),
        (16, 2, 256, 64, 1000, 21),
        (8, 1, 128, 32, 3, 40),
    ] {
        let theta = 1e7;
        let rope = Rope::new(rot, theta);
        let kvd = hkv * hd;
        let ld = nh * 2 * hd + 2 * kvd + 3; // one projection row: [q+gate | k | v | 3 unused]
        let qn = uniform(&mut r, hd, 1.5);
        let kn = uniform(&mut r, hd, 1.5);
        // Cached positions before the chunk (already normalized and rotated).
        let mut kc = uniform(&mut r, p0 * kvd, 1.0);
        let mut vc = uniform(&mut r, p0 * kvd, 1.0);
        let proj = uniform(&mut r, t * ld, 2.0);
        let mut q = vec![0f32; t * nh * hd];
        let mut gate = vec![0f32; t * nh * hd];
        for tt in 0..t {
            let row = &proj[tt * ld..(tt + 1) * ld];
            for h in 0..nh {
                let (qo, go) = (h * 2 * hd, (tt * nh + h) * hd);
                q[go..go + hd].copy_from_slice(&row[qo..qo + hd]);
                gate[go..go + hd].copy_from_slice(&row[qo + hd..qo + 2 * hd]);
            }
            let qt = &mut q[tt * nh * hd..(tt + 1) * nh * hd];
            rms_norm(qt, &qn, 1e-6);
            rope.apply(qt, hd, p0 + tt);
            let mut kk = row[nh * 2 * hd..nh * 2 * hd + kvd].to_vec();
            rms_norm(&mut kk, &kn, 1e-6);
            rope.apply(&mut kk, hd, p0 + tt);
            kc.extend_from_slice(&kk);
            vc.extend_from_slice(&row[nh * 2 * hd + kvd..nh * 2 * hd + 2 * kvd]);
        }
        let heads = (nh, hkv, hd);
        let want = gated_attention(heads, &q, &gate, t, p0, &kc, &vc);
        // GPU: the cache holds the first p0 rows; attn_prep writes the chunk's.
        let gb = |v: &[f32]| g.upload_f32(v).unwrap();
        let mut k0 = kc[..p0 * kvd].to_vec();
        k0.resize((p0 + t) * kvd, f32::NAN);
        let mut v0 = vc[..p0 * kvd].to_vec();
        v0.resize((p0 + t) * kvd, f32::NAN);
        let (gkc, gvc, pb, qnb, knb) = (gb(&k0), gb(&v0), gb(&proj), gb(&qn), gb(&kn));
        let (qo, out) = (gb(&vec![f32::NAN; t * nh * hd]), gb(&vec![f32::NAN; t * nh * hd]));
        let posb = g.upload_bytes(&i32_bytes(&[p0 as i32])).unwrap();
        let prep = lily::cuda::AttnPrep {
            qg: pb.ptr,
            k: pb.at(4 * nh * 2 * hd),
            v: pb.at(4 * (nh * 2 * hd + kvd)),
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
            kv: lily::cuda::KvDtype::F32,
            early: false,
        };
        g.attn_prep(&prep, t, ld).unwrap();
        let name = format!("attention prefill H{nh} H_kv{hkv} D{hd} R{rot} p0 {p0} T {t}");
        check(&format!("{name} q"), &qo.read_f32(0, t * nh * hd).unwrap(), &q, TOL);
        check(&format!("{name} k cache"), &gkc.read_f32(0, (p0 + t) * kvd).unwrap(), &kc, TOL);
        check(&format!("{name} v cache"), &gvc.read_f32(0, (p0 + t) * kvd).unwrap(), &vc, 0.0);
        for prec in [Precision::F32, Precision::Bf16] {
            out.write_f32(0, &vec![f32::NAN; t * nh * hd]).unwrap();
            g.attn_prefill(
                prec,
                qo.ptr,
                gkc.ptr,
                gvc.ptr,
                (pb.ptr, ld),
                out.ptr,
                (nh, hkv, hd),
                t,
                posb.ptr,
                true,
                (lily::cuda::KvDtype::F32, gkc.bytes),
            )
            .unwrap();
            let bound = if prec == Precision::F32 { TOL } else { TOL_ATTN_BF16 };
            check(&format!("{name} out {prec:?}"), &out.read_f32(0, t * nh * hd).unwrap(), &want, bound);
        }
        // The same over a bf16 cache: V rows are stored rounded to nearest even (exactly the
        // host's rounding), K rows after the norm and RoPE (rounding of a value within fp32
        // ulps of the CPU's); the output is within the rounding's distance of the fp32-cache
        // result (relative 2^-9 per element: NMSE about 1e-6 here; bound 1e-5).
        let b16 = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|&x| f32_to_bf16(x).to_le_bytes()).collect() };
        // 64 positions past the prompt stay NaN (0xffff): a kernel that reads cache rows past
        // the last query's position must not let them reach the output (attention_wg.cu's TMA
        // maps span the whole allocation).
        let n = (p0 + t) * kvd;
        let (mut k16, mut v16) = (b16(&kc[..p0 * kvd]), b16(&vc[..p0 * kvd]));
        k16.resize(2 * (n + 64 * kvd), 0xff);
        v16.resize(2 * (n + 64 * kvd), 0xff);
        let (hkc, hvc) = (g.upload_bytes(&k16).unwrap(), g.upload_bytes(&v16).unwrap());
        let prep16 = lily::cuda::AttnPrep { kc: hkc.ptr, vc: hvc.ptr, kv: lily::cuda::KvDtype::Bf16, ..prep };
        g.attn_prep(&prep16, t, ld).unwrap();
        let widen = |b: &lily::cuda::DevBuf| -> Vec<f32> {
            let w = b.read_f32(0, n / 2).unwrap();
            w.iter()
                .flat_map(|x| [f32::from_bits(x.to_bits() << 16), f32::from_bits(x.to_bits() & 0xffff_0000)])
                .collect()
        };
        let vr: Vec<f32> = vc.iter().map(|&x| bf16_to_f32(f32_to_bf16(x))).collect();
        check(&format!("{name} bf16 v cache"), &widen(&hvc), &vr, 0.0);
        check(&format!("{name} bf16 k cache"), &widen(&hkc), &kc, 1e-5);
        // Every kernel explicitly (the flash kernel where its head dims allow), and the default.
        let flash = [64, 128, 256].contains(&hd);
        let kernels = match (wgmma, flash) {
            (true, true) => vec![Some(PrefillAttn::FlashWg)],
            (true, false) => vec![],
            (false, true) => vec![Some(PrefillAttn::Simt), Some(PrefillAttn::Tc), None, Some(PrefillAttn::Flash)],
            (false, false) => vec![Some(PrefillAttn::Simt), Some(PrefillAttn::Tc), None],
        };
        for k in kernels {
            out.write_f32(0, &vec![f32::NAN; t * nh * hd]).unwrap();
            let kv = lily::cuda::KvDtype::Bf16;
            let dims = (nh, hkv, hd);
            match k {
                Some(k) => g.attn_prefill_with(
                    k,
                    qo.ptr,
                    hkc.ptr,
                    hvc.ptr,
                    (pb.ptr, ld),
                    out.ptr,
                    dims,
                    t,
                    posb.ptr,
                    true,
                    (kv, hkc.bytes),
                ),
                None => g.attn_prefill(
                    Precision::Bf16,
                    qo.ptr,
                    hkc.ptr,
                    hvc.ptr,
                    (pb.ptr, ld),
                    out.ptr,
                    dims,
                    t,
                    posb.ptr,
                    true,
                    (kv, hkc.bytes),
                ),
            }
            .unwrap();
            let bound = if k == Some(PrefillAttn::Simt) { 1e-5 } else { TOL_ATTN_BF16 };
            check(&format!("{name} out {k:?}, bf16 cache"), &out.read_f32(0, t * nh * hd).unwrap(), &want, bound);
        }
        // An fp8 cache (the flash kernel): attn_prep_fp8 writes the chunk's rows. V rows decode
        // to the host encoder's values exactly (same scale, same rounding); K rows decode to within
        // e4m3's rounding of the CPU's normalized, rotated K (half a step, relative 2^-4: NMSE
        // about 1.3e-3 on these inputs; bound 5e-3). The output keeps the bf16 flash bound against
        // the CPU attention over the decoded cache, and e4m3's distance (5e-3) against fp32.
        if !wgmma && flash && g.has_fp8() {
            use lily::cuda::{kv_fp8, KvDtype};
            let row8 = KvDtype::Fp8.pos_bytes(hkv, hd);
            let (mut k8, mut v8) =
                (kv_fp8::encode_rows(&kc[..p0 * kvd], hkv, hd), kv_fp8::encode_rows(&vc[..p0 * kvd], hkv, hd));
            k8.resize((p0 + t) * row8, 0xff);
            v8.resize((p0 + t) * row8, 0xff);
            let (fkc, fvc) = (g.upload_bytes(&k8).unwrap(), g.upload_bytes(&v8).unwrap());
            g.attn_prep(&lily::cuda::AttnPrep { kc: fkc.ptr, vc: fvc.ptr, kv: KvDtype::Fp8, ..prep }, t, ld).unwrap();
            let raw = |b: &lily::cuda::DevBuf| -> Vec<u8> {
                b.read_f32(0, (p0 + t) * row8 / 4).unwrap().iter().flat_map(|x| x.to_le_bytes()).collect()
            };
            let (gk8, gv8) = (raw(&fkc), raw(&fvc));
            let (dk, dv) = (kv_fp8::decode_rows(&gk8, hkv, hd), kv_fp8::decode_rows(&gv8, hkv, hd));
            let host_v = kv_fp8::decode_rows(&kv_fp8::encode_rows(&vc, hkv, hd), hkv, hd);
            check(&format!("{name} fp8 v cache vs the host encoder"), &dv, &host_v, 0.0);
            check(&format!("{name} fp8 k cache"), &dk, &kc, 5e-3);
            let want8 = gated_attention(heads, &q, &gate, t, p0, &dk, &dv);
            for _ in 0..2 {
                out.write_f32(0, &vec![f32::NAN; t * nh * hd]).unwrap();
                let dims = (nh, hkv, hd);
                g.attn_prefill(
                    Precision::Bf16,
                    qo.ptr,
                    fkc.ptr,
                    fvc.ptr,
                    (pb.ptr, ld),
                    out.ptr,
                    dims,
                    t,
                    posb.ptr,
                    true,
                    (KvDtype::Fp8, fkc.bytes),
                )
                .unwrap();
                let got = out.read_f32(0, t * nh * hd).unwrap();
                check(&format!("{name} out, fp8 cache, vs cpu on the decoded K/V"), &got, &want8, TOL_ATTN_BF16);
                check(&format!("{name} out, fp8 cache, vs the fp32 cache"), &got, &want, 5e-3);
            }
        }
    }
}
