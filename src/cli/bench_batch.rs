//! `lily bench --batch 1,4,16,64`: B sequences at once through the batching engine, as
//! llama.cpp's `llama-batched-bench` measures them: each of the B sequences gets its own
//! `--contexts` prompt (token i of sequence j follows the same hash as the batch-1 prompt, shifted
//! by j·C) and `--decode-steps` greedy tokens. Prefill tok/s = B·C over the time to every
//! sequence's first token (all prompts in one step); decode tok/s = B·steps over the decode
//! time, in total and per sequence.

use super::bench::{prompt_tokens, BenchArgs};
use anyhow::{bail, Result};
use lily::engine::batch::{Batched, Out, Work};
use lily::engine::picker::Want;
use lily::sampling::{argmax, SamplingParams};
use std::time::Instant;

pub struct BatchRow {
    pub context: usize,
    pub batch: usize,
    pub prefill_tps: f64,
    pub decode_tps: f64,
}

fn one_run(b: &mut dyn Batched, prompts: &[Vec<u32>], steps: usize) -> Result<(f64, f64)> {
    let greedy = SamplingParams::default();
    let t0 = Instant::now();
    let work: Vec<Work> = prompts
        .iter()
        .enumerate()
        .map(|(slot, p)| Work { slot, tokens: p, want: Want::Greedy, sampling: &greedy })
        .collect();
    let mut next: Vec<u32> = b
        .step(&work)?
        .into_iter()
        .map(|o| match o {
            Out::Token(t) => t,
            Out::Logits(l) => argmax(&l),
        })
        .collect();
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let work: Vec<Work> = toks
            .iter()
            .enumerate()
            .map(|(slot, t)| Work { slot, tokens: t, want: Want::Greedy, sampling: &greedy })
            .collect();
        for (n, o) in next.iter_mut().zip(b.step(&work)?) {
            *n = match o {
                Out::Token(t) => t,
                Out::Logits(l) => argmax(&l),
            };
        }
    }
    Ok((prefill, t1.elapsed().as_secs_f64()))
}

pub fn run(
    a: &BenchArgs,
    loaded: &lily::loader::Loaded,
    contexts: &[usize],
    batches: &[usize],
) -> Result<Vec<BatchRow>> {
    let vocab = loaded.model.cfg.vocab_size;
    let bytes = loaded.model.decode_bytes_per_token() as f64;
    if !a.json {
        println!(
            "| context | batch | prefill tok/s (total) | decode tok/s (total) | decode tok/s per sequence | weights GB/s (read once per step) |"
        );
        println!("|---:|---:|---:|---:|---:|---:|");
    }
    let mut rows = Vec::new();
    for &ctx in contexts {
        for &bsz in batches {
            let prompts: Vec<Vec<u32>> =
                (0..bsz).map(|j| prompt_tokens((j + 1) * ctx, vocab)[j * ctx..].to_vec()).collect();
            eprintln!(
                "lily bench: context {ctx}, batch {bsz}: {} warm-up and 1 measured run of {bsz} × ({ctx} prompt + {} decode tokens)",
                a.warmup, a.decode_steps
            );
            // One batch for the warm-up and the measured run, its slots reset before each (as
            // llama-batched-bench reuses its context); `--fresh-session`: a new batch per run, so
            // its first-use allocations and graph captures fall inside the timing.
            let mut measured = None;
            let mut kept: Option<Box<dyn Batched>> = None;
            for _ in 0..=a.warmup {
                let mut b = match kept.take() {
                    Some(mut b) if !a.fresh_session => {
                        (0..bsz).for_each(|slot| b.reset(slot));
                        b
                    }
                    _ => a.model.batch(loaded, bsz)?,
                };
                measured = Some(one_run(b.as_mut(), &prompts, a.decode_steps)?);
                kept = Some(b);
            }
            let (pf, dec) = measured.expect("at least one run");
            if dec <= 0.0 && a.decode_steps > 0 {
                bail!("the decode run took no time");
            }
            let r = BatchRow {
                context: ctx,
                batch: bsz,
                prefill_tps: (bsz * ctx) as f64 / pf,
                decode_tps: (bsz * a.decode_steps) as f64 / dec,
            };
            if !a.json {
                println!(
                    "| {} | {} | {:.1} | {:.1} | {:.2} | {:.1} |",
                    r.context,
                    r.batch,
                    r.prefill_tps,
                    r.decode_tps,
                    r.decode_tps / r.batch as f64,
                    r.decode_tps / r.batch as f64 * bytes / 1e9
                );
                std::io::Write::flush(&mut std::io::stdout())?;
            }
            rows.push(r);
        }
    }
    Ok(rows)
}
