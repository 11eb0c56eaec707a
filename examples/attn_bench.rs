//! Micro-benchmark of the CUDA causal attention prefill kernels on the Qwen3.6-35B-A3B attention
//! shape (16 query heads, 2 KV heads, head dim 256, bf16 KV cache): one prefill chunk of T tokens
//! after `pos0` cached positions, as `lily`'s chunked prefill runs it at each context. Prints ms
//! per launch (best of 5 after a warm-up) and TFLOP/s (4·D·H_q multiply-adds counted as FLOPs per
//! query-key pair actually attended), and each kernel's max |Δ| over max |out| against the
//! tensor-core kernel (`attn_prefill_tc_bf16`).
//! `cargo run --release --example attn_bench [T] [pos0,pos0,...]` on a machine with a GPU.

use anyhow::Result;
use lily::cuda::{gpu, KvDtype, PrefillAttn};

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

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
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
        for k in [PrefillAttn::Tc, PrefillAttn::Flash] {
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
                    KvDtype::Bf16,
                )
            };
            run()?;
            g.sync()?;
            let mut best = f64::MAX;
            for _ in 0..5 {
                best = best.min(g.time_ms(run)?);
            }
            let o = out.read_f32(0, t * nh * hd)?;
            let err = match &reference {
                None => {
                    reference = Some(o);
                    0.0
                }
                Some(r) => {
                    let m = r.iter().fold(0f32, |a, v| a.max(v.abs()));
                    r.iter().zip(&o).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / m
                }
            };
            println!("| {p0} | {t} | {k:?} | {best:.3} | {:.1} | {err:.2e} |", flops / best / 1e9);
        }
    }
    Ok(())
}
