//! Micro-benchmark of the prefill delta rule on the Qwen3.6-35B-A3B GDN shape (H_k 16, H_v 32,
//! D_k = D_v = 128): ms per `gdn_prefill` call (q/k prep + recurrence + gated norm) for the fp32
//! chunked kernels (kernels/gdn_chunk.cu), the tensor-core scan (kernels/gdn_chunk_tc.cu) and the
//! serial scan, at several T, best of 5 after a warm-up, each from the same random start state;
//! prints the NMSE of both chunked forms' output and state against the serial scan's
//! (`LILY_CUDA_PROFILE=1`: per-kernel times too). `gdn_bench T,T,..` picks the lengths.
//! `cargo run --release --example gdn_bench` on a machine with a GPU.

use anyhow::Result;
use lily::cuda::{gdn_chunk_floats, gpu, GdnPrefill, GdnPrefillKernel, GdnStep};

fn uniform(n: usize, seed: u64, a: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0) * a
        })
        .collect()
}

fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - *w as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|w| (*w as f64).powi(2)).sum::<f64>().max(1e-30);
    num / den
}

fn main() -> Result<()> {
    let g = gpu()?;
    let (hk, hv, dk, dv) = (16usize, 32usize, 128usize, 128usize);
    let (kd, vd) = (hk * dk, hv * dv);
    let cd = 2 * kd + vd;
    let ldp = vd + 2 * hv;
    println!("{}: GDN prefill, H_k {hk} H_v {hv} D_k {dk} D_v {dv}", g.name);
    let ts: Vec<usize> = match std::env::args().nth(1) {
        Some(a) => a.split(',').map(|v| v.parse()).collect::<Result<_, _>>()?,
        None => vec![64, 256, 1024, 2048, 4096, 8192],
    };
    println!("| T | chunked ms | tensor-core ms | scan ms | chunked out / state nmse | tensor-core out / state nmse |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for t in ts {
        // y = silu(conv) stand-in: q, k, v of both signs; z, b, a projections.
        let y = g.upload_f32(&uniform(t * cd, 1 + t as u64, 1.0))?;
        let proj = g.upload_f32(&uniform(t * ldp, 2 + t as u64, 2.0))?;
        let dt_bias = g.upload_f32(&uniform(hv, 3, 1.0))?;
        let neg_a: Vec<f32> = uniform(hv, 4, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect();
        let neg_a = g.upload_f32(&neg_a)?;
        let norm = g.upload_f32(&uniform(dv, 5, 1.5))?;
        let s0 = uniform(hv * dk * dv, 6, 0.3);
        let state = g.upload_f32(&s0)?;
        let out = g.alloc(4 * t * vd)?;
        let (qn, kn, kq) = (g.alloc(4 * t * kd)?, g.alloc(4 * t * kd)?, g.alloc(4 * t * hk)?);
        let chunk = g.alloc(4 * gdn_chunk_floats(t, hv, dk, dv))?;
        let p = GdnPrefill {
            step: GdnStep {
                y: y.ptr,
                b: proj.at(4 * vd),
                a: proj.at(4 * (vd + hv)),
                z: proj.ptr,
                dt_bias: dt_bias.ptr,
                neg_a: neg_a.ptr,
                norm: norm.ptr,
                state: state.ptr,
                out: out.ptr,
                hk,
                hv,
                dk,
                dv,
                eps: 1e-6,
            },
            t,
            ldy: cd,
            ldp,
            qn: qn.ptr,
            kn: kn.ptr,
            kq: kq.ptr,
            chunk: chunk.ptr,
        };
        let mut res = Vec::new();
        for kernel in [GdnPrefillKernel::Chunked, GdnPrefillKernel::ChunkedTc, GdnPrefillKernel::Scan] {
            let mut best = f64::INFINITY;
            for i in 0..6 {
                let ms = g.time_ms(|| g.gdn_prefill_with(&p, kernel))?;
                if i > 0 {
                    best = best.min(ms);
                }
            }
            // One more call from the start state for the comparison.
            state.write_bytes(0, &s0.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
            g.gdn_prefill_with(&p, kernel)?;
            res.push((best, out.read_f32(0, t * vd)?, state.read_f32(0, s0.len())?));
        }
        let (c, tc, s) = (&res[0], &res[1], &res[2]);
        println!(
            "| {t} | {:.3} | {:.3} | {:.3} | {:.1e} / {:.1e} | {:.1e} / {:.1e} |",
            c.0,
            tc.0,
            s.0,
            nmse(&c.1, &s.1),
            nmse(&c.2, &s.2),
            nmse(&tc.1, &s.1),
            nmse(&tc.2, &s.2)
        );
        // Per-kernel device times of the calls above with LILY_CUDA_PROFILE=1.
        lily::cuda::profile_report();
    }
    Ok(())
}
