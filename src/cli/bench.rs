//! `lily bench`: the measurement contract of docs/performance.md on the CPU backend.
//! Batch 1, greedy; prompt token i = ((i·2654435761) mod 2³²) mod vocab; one exact-shape warm-up,
//! then one measured run: prefill tok/s = prompt tokens / time to the first token; decode tok/s
//! over exactly `--decode-steps` steps after the first token.

use super::ModelArgs;
use anyhow::{bail, Result};
use clap::Args;
use lily::generate::Session;
use lily::sampling::argmax;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths, comma-separated (e.g. 256,4096).
    #[arg(long, default_value = "256")]
    pub contexts: String,
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Warm-up runs of the exact shape before the measured one.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Also measure the machine's memory read bandwidth to put decode in context.
    #[arg(long)]
    pub membw: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn prompt_tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| (((i as u64 * 2654435761) % (1u64 << 32)) % vocab as u64) as u32).collect()
}

struct Row {
    context: usize,
    prefill_tps: f64,
    decode_tps: f64,
}

fn one_run(session: &mut dyn Session, prompt: &[u32], steps: usize) -> Result<(f64, f64)> {
    let t0 = Instant::now();
    let logits = session.forward_last(prompt)?;
    let mut next = argmax(&logits);
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..steps {
        let logits = session.forward_last(&[next])?;
        next = argmax(&logits);
    }
    Ok((prefill, t1.elapsed().as_secs_f64()))
}

/// Streams a large buffer with all threads; returns GB/s read.
fn memory_bandwidth() -> f64 {
    use rayon::prelude::*;
    let n = 1usize << 28; // 2 GiB of u64
    let buf: Vec<u64> = (0..n).into_par_iter().map(|i| i as u64).collect();
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u64 = buf.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &x| a ^ x)).reduce(|| 0, |a, b| a ^ b);
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((n * 8) as f64 / secs / 1e9);
    }
    best
}

pub fn run(a: BenchArgs) -> Result<()> {
    let contexts: Vec<usize> = a
        .contexts
        .split(',')
        .map(|s| s.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("--contexts: `{s}` is not a number")))
        .collect::<Result<_>>()?;
    if contexts.contains(&0) {
        bail!("--contexts entries must be positive");
    }
    let loaded = a.model.load()?;
    let model = &loaded.model;
    let bytes = model.decode_bytes_per_token();
    let membw = if a.membw { Some(memory_bandwidth()) } else { None };
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let prompt = prompt_tokens(ctx, model.cfg.vocab_size);
        for _ in 0..a.warmup {
            let mut s = a.model.session(&loaded);
            one_run(s.as_mut(), &prompt, a.decode_steps)?;
        }
        let mut s = a.model.session(&loaded);
        let (pf, dec) = one_run(s.as_mut(), &prompt, a.decode_steps)?;
        rows.push(Row { context: ctx, prefill_tps: ctx as f64 / pf, decode_tps: a.decode_steps as f64 / dec });
    }
    let threads = rayon::current_num_threads();
    let device = a.model.device_name(&loaded);
    if a.json {
        let r: Vec<_> = rows
            .iter()
            .map(|r| serde_json::json!({"context": r.context, "prefill_tokens_per_s": r.prefill_tps, "decode_tokens_per_s": r.decode_tps, "decode_weight_gb_per_s": r.decode_tps * bytes as f64 / 1e9}))
            .collect();
        println!(
            "{}",
            serde_json::json!({"device": device, "threads": threads, "commit": env!("LILY_GIT_COMMIT"), "model": a.model.model, "layers": model.cfg.num_hidden_layers, "decode_weight_bytes_per_token": bytes, "memory_read_gb_per_s": membw, "rows": r})
        );
        return Ok(());
    }
    println!(
        "lily bench | device {device} | commit {} | model {} ({} layers) | weights read per decode token {:.1} MB{}",
        env!("LILY_GIT_COMMIT"),
        a.model.model,
        model.cfg.num_hidden_layers,
        bytes as f64 / 1e6,
        membw.map(|b| format!(" | memory read {b:.1} GB/s")).unwrap_or_default()
    );
    println!("| context | prefill tok/s | decode tok/s | decode weight GB/s | share of memory bw |");
    println!("|---:|---:|---:|---:|---:|");
    for r in &rows {
        let gbs = r.decode_tps * bytes as f64 / 1e9;
        println!(
            "| {} | {:.1} | {:.2} | {:.2} | {} |",
            r.context,
            r.prefill_tps,
            r.decode_tps,
            gbs,
            membw.map(|b| format!("{:.0}%", 100.0 * gbs / b)).unwrap_or("-".into())
        );
    }
    Ok(())
}
