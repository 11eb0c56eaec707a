//! Micro-benchmark of the CUDA decode GEMV kernels on the Qwen3.6-35B-A3B shapes (MLX 4-bit,
//! group 64; the router 8-bit): µs per launch and GB/s of weights (codes + scales + biases) for
//! each kernel variant and grid size, 20 launches replayed inside a CUDA graph, rotating over
//! enough copies of the matrix that each launch reads HBM rather than the L2. Every
//! variant's output is compared with `linear_gemv`'s (max |Δ| over max |y|).
//! `cargo run --release --example gemv_bench` on a machine with a GPU.

use anyhow::Result;
use lily::cuda::{gpu, GemvKernel, GpuLinear};

struct Case {
    name: &'static str,
    rows: usize,
    cols: usize,
    bits: i32,
    count: usize,
    slots: usize,
    norm: bool,
}

fn rand_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

fn bf16_vec(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<u8> {
    rand_bytes(n * 2, seed)
        .chunks(2)
        .flat_map(|c| {
            let u = (c[0] as f32 + 256.0 * c[1] as f32) / 65536.0;
            let v = lo + (hi - lo) * u;
            ((v.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

/// Max |Δ| over max |reference| against the first variant's output (stored on its first call).
fn rel_err(reference: &mut Option<Vec<f32>>, out: Vec<f32>) -> f32 {
    match reference {
        None => {
            *reference = Some(out);
            0.0
        }
        Some(r) => {
            let m = r.iter().fold(0f32, |a, v| a.max(v.abs()));
            r.iter().zip(&out).fold(0f32, |a, (p, q)| a.max((p - q).abs())) / m
        }
    }
}

/// µs per launch: 20 launches (`run(i)` for i in 0..20) captured in one graph, replayed once to
/// warm up, then the best of 5 timed replays.
fn time_graph(g: &lily::cuda::Gpu, run: impl Fn(usize) -> Result<()>) -> Result<f64> {
    let graph = g.capture(|| {
        for i in 0..20 {
            run(i)?;
        }
        Ok(())
    })?;
    g.replay(&graph)?;
    g.sync()?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        best = best.min(g.time_ms(|| g.replay(&graph))?);
    }
    Ok(best * 1e3 / 20.0)
}

fn main() -> Result<()> {
    let g = gpu()?;
    println!("{} ({} SMs)", g.name, g.sms);
    // One second of device copies first, so the clocks have left their idle state.
    let t = std::time::Instant::now();
    let mut bw = 0.0;
    while t.elapsed().as_secs_f64() < 1.0 {
        bw = g.measure_bandwidth()?;
    }
    println!("copy bandwidth after warm-up: {bw:.0} GB/s");
    let cases = [
        Case { name: "gdn in_proj + norm", rows: 12352, cols: 2048, bits: 4, count: 1, slots: 1, norm: true },
        Case { name: "gdn out_proj", rows: 2048, cols: 4096, bits: 4, count: 1, slots: 1, norm: false },
        Case { name: "attn q/k/v + norm", rows: 9216, cols: 2048, bits: 4, count: 1, slots: 1, norm: true },
        Case { name: "router+gate q8 + norm", rows: 257, cols: 2048, bits: 8, count: 1, slots: 1, norm: true },
        Case { name: "experts gate/up (18 x 512)", rows: 512, cols: 2048, bits: 4, count: 514, slots: 18, norm: true },
        Case { name: "lm_head + norm", rows: 248320, cols: 2048, bits: 4, count: 1, slots: 1, norm: true },
    ];
    let variants: Vec<(GemvKernel, u32)> =
        vec![(GemvKernel::Old, 0), (GemvKernel::Q2, 4), (GemvKernel::Wide, 1), (GemvKernel::LoadOnly, 4)];
    println!("| matrix | MB | kernel | blocks/SM | µs | GB/s | max rel Δ vs old |");
    println!("|---|---:|---|---:|---:|---:|---:|");
    for (ci, c) in cases.iter().enumerate() {
        let total_rows = c.rows * c.count;
        let wbytes = total_rows * c.cols * c.bits as usize / 8;
        let ng = total_rows * c.cols / 64;
        // Enough copies that consecutive launches read different matrices (over 240 MB: the
        // 60 MB L2 holds none of them on its next turn), as in a decode step.
        let copies = (240_000_000 / wbytes).clamp(1, 32);
        let ws: Vec<GpuLinear> = (0..copies)
            .map(|k| -> Result<GpuLinear> {
                Ok(GpuLinear {
                    rows: c.rows,
                    cols: c.cols,
                    count: c.count,
                    bits: c.bits,
                    group: 64,
                    ty: 2,
                    w: g.upload_bytes(&rand_bytes(wbytes, 11 + ci as u64 + 1000 * k as u64))?,
                    s: Some(g.upload_bytes(&bf16_vec(ng, 23 + ci as u64, 0.002, 0.02))?),
                    b: Some(g.upload_bytes(&bf16_vec(ng, 37 + ci as u64, -0.1, 0.0))?),
                })
            })
            .collect::<Result<_>>()?;
        let w = &ws[0];
        let xs: Vec<f32> = rand_bytes(c.cols, 5).iter().map(|&b| (b as f32 - 127.5) / 64.0).collect();
        let nw: Vec<f32> = rand_bytes(c.cols, 7).iter().map(|&b| 0.5 + b as f32 / 256.0).collect();
        let x = g.upload_f32(&xs)?;
        let normw = g.upload_f32(&nw)?;
        let ids: Vec<i32> = (0..c.slots).map(|z| ((z * 37 + 3) % c.count) as i32).collect();
        let idb = g.upload_bytes(&ids.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
        let y = g.zeros(4 * c.rows * c.slots)?;
        let idp = if c.count > 1 { idb.ptr } else { 0 };
        let norm = if c.norm { (normw.ptr, 1e-6f32) } else { (0, 0.0) };
        let moved = (c.rows * c.slots) as f64 * (c.cols as f64 * c.bits as f64 / 8.0 + 4.0 * c.cols as f64 / 64.0);
        let mut reference: Option<Vec<f32>> = None;
        for &(k, bpsm) in &variants {
            let run_on = |w: &GpuLinear| g.gemv_variant(k, bpsm, w, x.ptr, 0, y.ptr, c.slots, idp, false, norm);
            run_on(w)?;
            g.sync()?;
            let err = rel_err(&mut reference, y.read_f32(0, c.rows * c.slots)?);
            let us = time_graph(&g, |i| run_on(&ws[i % ws.len()]))?;
            println!(
                "| {} | {:.1} | {:?} | {} | {:.2} | {:.0} | {:.1e} |",
                c.name,
                moved / 1e6,
                k,
                bpsm,
                us,
                moved / (us * 1e-6) / 1e9,
                err
            );
        }
    }
    moe_down_cases(&g)?;
    Ok(())
}

/// The decode MoE down projection (8 routed experts + the shared one as slot 256, 2048 x 512,
/// 4-bit): `moe_down` against `moe_down_q` at several grid caps.
fn moe_down_cases(g: &std::sync::Arc<lily::cuda::Gpu>) -> Result<()> {
    let (rows, cols, count, s) = (2048usize, 512usize, 257usize, 9usize);
    let wbytes = count * rows * cols / 2;
    let ng = count * rows * cols / 64;
    let w = GpuLinear {
        rows,
        cols,
        count,
        bits: 4,
        group: 64,
        ty: 2,
        w: g.upload_bytes(&rand_bytes(wbytes, 101))?,
        s: Some(g.upload_bytes(&bf16_vec(ng, 103, 0.002, 0.02))?),
        b: Some(g.upload_bytes(&bf16_vec(ng, 107, -0.1, 0.0))?),
    };
    let gu: Vec<f32> = rand_bytes(2 * s * cols, 9).iter().map(|&b| (b as f32 - 127.5) / 32.0).collect();
    let gub = g.upload_f32(&gu)?;
    let ids: Vec<i32> = (0..s).map(|k| if k + 1 == s { 256 } else { (k * 31 + 5) as i32 }).collect();
    let idb = g.upload_bytes(&ids.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    // 20 different expert sets (the shared one last in each), so launches do not hit the L2.
    let idsets: Vec<lily::cuda::DevBuf> = (0..20)
        .map(|i| {
            let v: Vec<i32> = (0..s).map(|k| if k + 1 == s { 256 } else { ((i * 8 + k) * 7 % 256) as i32 }).collect();
            g.upload_bytes(&v.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
        })
        .collect::<Result<_>>()?;
    let wts = g.upload_f32(&[0.2, 0.15, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.7])?;
    let x = g.zeros(4 * rows)?;
    let moved = (rows * s) as f64 * (cols as f64 / 2.0 + 4.0 * cols as f64 / 64.0);
    let mut reference: Option<Vec<f32>> = None;
    println!();
    println!("| moe_down (9 x 2048 x 512) | MB | kernel | blocks/SM | µs | GB/s | max rel Δ vs old |");
    println!("|---|---:|---|---:|---:|---:|---:|");
    for (k, bpsm) in [(GemvKernel::Old, 0u32), (GemvKernel::Q2, 1), (GemvKernel::Q2, 2), (GemvKernel::Q2, 4)] {
        let run = || g.moe_down_variant(k, bpsm, &w, gub.ptr, idb.ptr, wts.ptr, s, x.ptr);
        let run_at =
            |i: usize| g.moe_down_variant(k, bpsm, &w, gub.ptr, idsets[i % idsets.len()].ptr, wts.ptr, s, x.ptr);
        x.write_f32(0, &vec![0.0; rows])?;
        run()?;
        g.sync()?;
        let err = rel_err(&mut reference, x.read_f32(0, rows)?);
        let us = time_graph(g, run_at)?;
        println!(
            "| moe_down | {:.1} | {:?} | {} | {:.2} | {:.0} | {:.1e} |",
            moved / 1e6,
            k,
            bpsm,
            us,
            moved / (us * 1e-6) / 1e9,
            err
        );
    }
    Ok(())
}
