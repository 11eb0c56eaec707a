//! `lily bench`: the measurement contract of docs/performance.md on either backend.
//! Batch 1, greedy; prompt token i = ((i·2654435761) mod 2³²) mod vocab; one exact-shape warm-up,
//! then one measured run: prefill tok/s = prompt tokens / time to the first token; decode tok/s
//! over exactly `--decode-steps` steps after the first token. `--repeat N` measures N runs and
//! reports the median of each rate (all runs are in the JSON), for machines whose speed varies
//! from run to run. The runs of a context share one session, reset before each (caches zeroed,
//! buffers and decode graphs kept), as llama-bench reuses its context; `--fresh-session` times
//! each run on a new session instead.
//!
//! Roofline shares: decode moves, per token, the weights it uses (top-k experts), the recurrent
//! state (read and written) and the KV cache at that context; its share is those bytes times
//! tok/s over the measured memory bandwidth (`--membw`; on the GPU always measured). Prefill's
//! share is its FLOPs (2 per weight multiply-add, plus causal attention at half the context on
//! average) times tok/s over the dense bf16 tensor-core peak (from the GPU's specification).

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
    #[arg(allow_negative_numbers = true, long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Warm-up runs of the exact shape before the measured one.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1)]
    pub warmup: usize,
    /// Measured runs per context; the table shows the median of each rate.
    #[arg(allow_negative_numbers = true, long, default_value_t = 1)]
    pub repeat: usize,
    /// Time every run on a new session (its buffers allocated and its decode graphs captured
    /// inside the timed prompt and steps); by default the runs of a context share one session,
    /// reset (caches zeroed, buffers kept) before each, as llama-bench reuses its context.
    #[arg(long)]
    pub fresh_session: bool,
    /// Batch sizes, comma-separated (e.g. 1,4,16,64): B sequences at once through the batching
    /// engine, each with a `--contexts` prompt and `--decode-steps` tokens (llama-batched-bench's
    /// measurement; pass --decode-steps 128 for its usual shape).
    #[arg(long)]
    pub batch: Option<String>,
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
    /// Every measured run's (prefill, decode) tok/s.
    runs: Vec<(f64, f64)>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn one_run(session: &mut dyn Session, prompt: &[u32], steps: usize) -> Result<(f64, f64)> {
    let t0 = Instant::now();
    let logits = session.forward_last(prompt)?;
    let next = argmax(&logits);
    let prefill = t0.elapsed().as_secs_f64();
    // The decode steps as one greedy run: on CUDA the argmax is fed back on the device and
    // the host reads the tokens once, after the last step.
    let t1 = Instant::now();
    let out = session.greedy_steps(next, steps)?;
    let decode = t1.elapsed().as_secs_f64();
    if out.len() != steps {
        bail!("the decode run produced {} of {steps} tokens", out.len());
    }
    Ok((prefill, decode))
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
    if a.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    let loaded = a.model.load()?;
    let model = &loaded.model;
    // Every context is checked before any timed work (a long prefill must not run only to fail).
    let limit = model.cfg.max_position_embeddings;
    if let Some(&ctx) = contexts.iter().find(|&&c| c.saturating_add(a.decode_steps) > limit) {
        bail!(
            "--contexts {ctx}: {ctx} prompt tokens plus {} decode steps exceed the model's context of {limit} tokens \
             (the largest context that fits is {})",
            a.decode_steps,
            limit.saturating_sub(a.decode_steps)
        );
    }
    if let Some(list) = &a.batch {
        let batches: Vec<usize> = list
            .split(',')
            .map(|s| s.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("--batch: `{s}` is not a number")))
            .collect::<Result<_>>()?;
        if batches.iter().any(|&b| b == 0 || b > 1024) {
            bail!("--batch entries must be between 1 and 1024");
        }
        if !a.json {
            println!(
                "lily bench | device {} | commit {} | model {} | batched: {} decode steps per sequence",
                a.model.device_name(&loaded),
                env!("LILY_GIT_COMMIT"),
                a.model.model,
                a.decode_steps
            );
        }
        let rows = super::bench_batch::run(&a, &loaded, &contexts, &batches)?;
        if a.json {
            let r: Vec<_> = rows
                .iter()
                .map(|r| serde_json::json!({"context": r.context, "batch": r.batch, "prefill_tokens_per_s": r.prefill_tps,
                    "decode_tokens_per_s": r.decode_tps, "decode_tokens_per_s_per_sequence": r.decode_tps / r.batch as f64}))
                .collect();
            println!("{}", serde_json::json!({"commit": env!("LILY_GIT_COMMIT"), "model": a.model.model, "rows": r}));
        }
        return Ok(());
    }
    let bytes = model.decode_bytes_per_token();
    let gpu = lily::cuda::uploaded(&loaded.model).map(|m| m.gpu.clone());
    let membw = match &gpu {
        Some(g) => Some(g.measure_bandwidth()?),
        None if a.membw => Some(memory_bandwidth()),
        None => None,
    };
    let peak = gpu.as_ref().and_then(|g| g.bf16_peak_tflops());
    let (rec_bytes, kv_f32) = model.state_bytes();
    // The GPU's cache may be bf16 (the CPU's is fp32).
    let c = &model.cfg;
    let kv_per_pos =
        if gpu.is_some() { a.model.gpu_kv().from_f32_bytes(kv_f32, c.num_key_value_heads, c.head_dim) } else { kv_f32 };
    let n_attn = model.layers.iter().filter(|l| matches!(l.mixer, lily::model::Mixer::Attention(_))).count();
    // Bytes a decode step moves at context `ctx`, and FLOPs per prompt token of a `ctx` prefill.
    let step_bytes = |ctx: usize| bytes + rec_bytes + kv_per_pos * ctx;
    let prefill_flops = |ctx: usize| {
        2.0 * model.macs_per_token() as f64
            + (n_attn * 2 * 2 * c.num_attention_heads * c.head_dim) as f64 * ctx as f64 / 2.0
    };
    let threads = rayon::current_num_threads();
    let device = a.model.device_name(&loaded);
    let pct = |v: f64, of: Option<f64>| of.map(|o| format!("{:.1}%", 100.0 * v / o)).unwrap_or("-".into());
    if !a.json {
        println!(
            "lily bench | device {device} | commit {} | model {} ({} layers) | weights read per decode token {:.1} MB{}",
            env!("LILY_GIT_COMMIT"),
            a.model.model,
            model.cfg.num_hidden_layers,
            bytes as f64 / 1e6,
            membw.map(|b| format!(" | memory bandwidth {b:.0} GB/s (measured)")).unwrap_or_default()
        );
        if a.repeat > 1 {
            println!("rates are medians of {} measured runs per context", a.repeat);
        }
        if let Some(g) = &gpu {
            println!(
                "driver CUDA {} | kernels: {} | bf16 tensor-core peak {}",
                g.driver_version(),
                g.kernel_flags(),
                peak.map(|p| format!("{p:.0} TFLOP/s (specification)")).unwrap_or("unknown".into())
            );
            if let Some(m) = lily::cuda::uploaded(&loaded.model) {
                let mut s = lily::cuda::CudaSession::new(m);
                match s.persistent_step() {
                    Ok(()) => println!("decode step: persistent kernel (LILY_CUDA_DECODE=persistent)"),
                    Err(e) => println!("decode step: graph of per-op kernels (persistent kernel: {e})"),
                }
            }
        }
        println!(
            "| context | prefill tok/s | prefill TFLOP/s | share of bf16 peak | decode tok/s | decode GB/s | share of memory bw |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|");
    }
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let prompt = prompt_tokens(ctx, model.cfg.vocab_size);
        eprintln!(
            "lily bench: context {ctx}: {} warm-up and {} measured run(s) of {ctx} prompt + {} decode tokens",
            a.warmup, a.repeat, a.decode_steps
        );
        // The session of the previous run, reset, unless every run gets a new one.
        let mut kept: Option<Box<dyn Session>> = None;
        let session = |kept: Option<Box<dyn Session>>| -> Box<dyn Session> {
            match kept {
                Some(mut s) if !a.fresh_session => {
                    s.reset();
                    s
                }
                _ => a.model.session(&loaded),
            }
        };
        for _ in 0..a.warmup {
            let mut s = session(kept.take());
            one_run(s.as_mut(), &prompt, a.decode_steps)?;
            kept = Some(s);
        }
        let mut runs = Vec::with_capacity(a.repeat);
        for _ in 0..a.repeat {
            let mut s = session(kept.take());
            let (pf, dec) = one_run(s.as_mut(), &prompt, a.decode_steps)?;
            runs.push((ctx as f64 / pf, a.decode_steps as f64 / dec));
            kept = Some(s);
        }
        let prefill_tps = median(runs.iter().map(|r| r.0).collect());
        let decode_tps = median(runs.iter().map(|r| r.1).collect());
        let r = Row { context: ctx, prefill_tps, decode_tps, runs };
        if !a.json {
            // Each row as soon as it is measured (long contexts take minutes).
            let gbs = r.decode_tps * step_bytes(r.context) as f64 / 1e9;
            let tflops = r.prefill_tps * prefill_flops(r.context) / 1e12;
            println!(
                "| {} | {:.1} | {:.1} | {} | {:.2} | {:.1} | {} |",
                r.context,
                r.prefill_tps,
                tflops,
                pct(tflops, peak),
                r.decode_tps,
                gbs,
                pct(gbs, membw)
            );
            std::io::Write::flush(&mut std::io::stdout())?;
        }
        rows.push(r);
    }
    if a.json {
        let r: Vec<_> = rows
            .iter()
            .map(|r| {
                let gbs = r.decode_tps * step_bytes(r.context) as f64 / 1e9;
                let tflops = r.prefill_tps * prefill_flops(r.context) / 1e12;
                serde_json::json!({"context": r.context, "prefill_tokens_per_s": r.prefill_tps, "decode_tokens_per_s": r.decode_tps,
                    "decode_weight_gb_per_s": r.decode_tps * bytes as f64 / 1e9, "decode_bytes_per_token": step_bytes(r.context),
                    "decode_gb_per_s": gbs, "decode_share_of_bandwidth": membw.map(|b| gbs / b),
                    "prefill_tflops": tflops, "prefill_share_of_bf16_peak": peak.map(|p| tflops / p),
                    "runs": r.runs.iter().map(|(p, d)| serde_json::json!({"prefill_tokens_per_s": p, "decode_tokens_per_s": d})).collect::<Vec<_>>()})
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({"device": device, "threads": threads, "commit": env!("LILY_GIT_COMMIT"), "model": a.model.model,
                "layers": model.cfg.num_hidden_layers, "decode_weight_bytes_per_token": bytes, "memory_read_gb_per_s": membw,
                "driver": gpu.as_ref().map(|g| g.driver_version()), "kernel_flags": gpu.as_ref().map(|g| g.kernel_flags()),
                "bf16_peak_tflops": peak, "rows": r})
        );
    }
    Ok(())
}
