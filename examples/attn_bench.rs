//! Micro-benchmark of the CUDA causal attention prefill kernels on the Qwen3.6-35B-A3B attention
//! shape (16 query heads, 2 KV heads, head dim 256, bf16 KV cache): one prefill chunk of T tokens
//! after `pos0` cached positions, as `lily`'s chunked prefill runs it at each context. Prints ms
//! per launch (best of 5 after a warm-up) and TFLOP/s (4·D·H_q multiply-adds counted as FLOPs per
//! query-key pair actually attended), and each kernel's max |Δ| over max |out| against the
//! tensor-core kernel (`attn_prefill_tc_bf16`).
//! `cargo run --release --example attn_bench [T] [pos0,pos0,...]` on a machine with a GPU.
//!
//! `attn_bench decode [L,L,...]`: the decode attention kernels instead (one token over L cached
//! positions, bf16 cache, one block per SM as the model runs them, attn_combine included): µs per
//! call (best of 5 runs of 20 back-to-back calls) and GB/s of K and V read, and each kernel's
//! max |Δ| over max |out| against the fp32-FMA packed kernel.

use anyhow::Result;
use lily::cuda::{gpu, AttnDecode, AttnKernel, KvDtype, PrefillAttn};

fn rand_bf16(n: usize, seed: u64, amp: f32) -> Vec<u8> {
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let u = (s >> 40) as f32 / (1u64 << 24) as f32;
        let v = amp * (2.0 * u - 1.0);
        out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
    }
    out
}

/// Max |Δ| over max |reference| against the first kernel's output (stored on its first call).
fn rel_err(reference: &mut Option<Vec<f32>>, out: Vec<f32>) -> f32 {
    match reference {
        None => {
            *reference = Some(out);
            0.0
        }
        Some(r) => {
            let m = r.iter().fold(0f32, |a, v| a.max(v.abs()));
            r.iter().zip(&out).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / m
        }
    }
}

fn decode(lens: &[usize]) -> Result<()> {
    let (nh, hkv, hd) = (16usize, 2usize, 256usize);
    let g = gpu()?;
    let cap = *lens.iter().max().unwrap_or(&1);
    let kc = g.upload_bytes(&rand_bf16(cap * hkv * hd, 7, 1.0))?;
    let vc = g.upload_bytes(&rand_bf16(cap * hkv * hd, 11, 1.0))?;
    let qg: Vec<f32> = rand_bf16(nh * 2 * hd, 13, 1.0)
        .chunks(2)
        .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
        .collect();
    let q: Vec<f32> = qg.iter().map(|v| v * 4.0).take(nh * hd).collect();
    let (qb, qgb) = (g.upload_f32(&q)?, g.upload_f32(&qg)?);
    let out = g.zeros(nh * hd * 4)?;
    let posb = g.upload_bytes(&[0u8; 4])?;
    let splits = g.sms as usize / hkv;
    let part = g.zeros(nh * splits * (hd + 2) * 4)?;
    println!("| L | kernel | µs | GB/s of K and V | max rel Δ vs Packed |");
    println!("|---:|---|---:|---:|---:|");
    for &l in lens {
        posb.write_bytes(0, &((l - 1) as i32).to_le_bytes())?;
        let bytes = (2 * l * hkv * hd * 2) as f64;
        let mut reference: Option<Vec<f32>> = None;
        for k in [AttnKernel::Packed, AttnKernel::Tc] {
            let a = AttnDecode {
                q: qb.ptr,
                kc: kc.ptr,
                vc: vc.ptr,
                qg: qgb.ptr,
                out: out.ptr,
                nh,
                hkv,
                hd,
                pos: posb.ptr,
                gated: true,
                part: part.ptr,
                splits,
                kv: KvDtype::Bf16,
                early: false,
            };
            let run = || (0..20).try_for_each(|_| g.attn_decode(&a, k));
            run()?;
            g.sync()?;
            let mut best = f64::MAX;
            for _ in 0..5 {
                best = best.min(g.time_ms(run)? / 20.0);
            }
            let err = rel_err(&mut reference, out.read_f32(0, nh * hd)?);
            println!("| {l} | {k:?} | {:.1} | {:.0} | {err:.2e} |", best * 1e3, bytes / (best / 1e3) / 1e9);
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("decode") {
        let lens: Vec<usize> = args
            .get(2)
            .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
            .unwrap_or_else(|| vec![8192, 32768, 131072, 262144]);
        return decode(&lens);
    }
    let t: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(2048);
    let starts: Vec<usize> = args
        .get(2)
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![0, 2048, 14336, 30720, 129024]);
    let (nh, hkv, hd) = (16usize, 2usize, 256usize);
    let g = gpu()?;
    let cap = starts.iter().max().unwrap() + t;
    let kc = g.upload_bytes(&rand_bf16(cap * hkv * hd, 7, 1.0))?;
    let vc = g.upload_bytes(&rand_bf16(cap * hkv * hd, 11, 1.0))?;
    // Queries and gates as one projection row per token ([q | gate] per head), as prefill has them.
    let ldg = nh * 2 * hd;
    let qg: Vec<f32> = rand_bf16(t * ldg, 13, 1.0)
        .chunks(2)
        .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
        .collect();
    let q: Vec<f32> = (0..t * nh * hd).map(|i| qg[(i / hd) * 2 * hd + i % hd] * 4.0).collect();
    let (qb, qgb) = (g.upload_f32(&q)?, g.upload_f32(&qg)?);
    let out = g.zeros(t * nh * hd * 4)?;
    let posb = g.upload_bytes(&[0u8; 4])?;
    println!("| pos0 | T | kernel | ms | TFLOP/s | max rel Δ vs tc |");
    println!("|---:|---:|---|---:|---:|---:|");
    for &p0 in &starts {
        posb.write_bytes(0, &(p0 as i32).to_le_bytes())?;
        let pairs: f64 = (0..t).map(|i| (p0 + i + 1) as f64).sum();
        let flops = pairs * 4.0 * (hd * nh) as f64;
        let mut reference: Option<Vec<f32>> = None;
        let mut kernels = vec![PrefillAttn::Tc, PrefillAttn::Flash];
        if g.arch == "sm_90a" {
            kernels.push(PrefillAttn::FlashWg);
        }
        for k in kernels {
            let run = || {
                g.attn_prefill_with(
                    k,
                    qb.ptr,
                    kc.ptr,
                    vc.ptr,
                    (qgb.ptr, ldg),
                    out.ptr,
                    (nh, hkv, hd),
                    t,
                    posb.ptr,
                    true,
                    (KvDtype::Bf16, kc.bytes),
                )
            };
            run()?;
            g.sync()?;
            let mut best = f64::MAX;
            for _ in 0..5 {
                best = best.min(g.time_ms(run)?);
            }
            let err = rel_err(&mut reference, out.read_f32(0, t * nh * hd)?);
            println!("| {p0} | {t} | {k:?} | {best:.3} | {:.1} | {err:.2e} |", flops / best / 1e9);
        }
    }
    Ok(())
}
