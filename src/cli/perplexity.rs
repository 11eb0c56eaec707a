//! `lily perplexity`: teacher-forced NLL over a token or text file, in context windows with a
//! stride (as Hugging Face's strided perplexity), with the standard error; optionally dumps logits.

use super::{parse_token_list, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use lily::progress::Progress;
use lily::safetensors::{self, Dtype};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Whitespace- or comma-separated token ids.
    #[arg(long, conflicts_with = "text_file")]
    pub tokens_file: Option<PathBuf>,
    /// Text, tokenized with the model's tokenizer.
    #[arg(long)]
    pub text_file: Option<PathBuf>,
    /// Write all logits as one f32 tensor `logits` [N, vocab] to this safetensors file (the
    /// tokens must fit one window).
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
    /// Tokens per window, each scored from a fresh state (default: the whole text when it fits
    /// the model's context, else the model's context).
    #[arg(allow_negative_numbers = true, short = 'c', long, visible_alias = "ctx-size")]
    pub ctx: Option<usize>,
    /// Tokens between window starts (default: half a window). A token is scored in the first
    /// window that predicts it, so after the first window every score has at least
    /// ctx − stride tokens of context.
    #[arg(allow_negative_numbers = true, long)]
    pub stride: Option<usize>,
    /// Tokens per forward call within a window (the state carries across calls).
    #[arg(allow_negative_numbers = true, long, default_value_t = 512)]
    pub chunk: usize,
    #[arg(long)]
    pub json: bool,
}

/// Windows `[b, end)` at b = 0, stride, 2·stride, … until one reaches the end, with the first
/// target each scores (a target is a position whose logits predict the next token): window i
/// scores the targets from where window i − 1 ended, so each is scored once, and after the first
/// window with at least ctx − stride tokens before it in its window.
pub fn windows(n: usize, ctx: usize, stride: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut b, mut scored) = (0usize, 0usize);
    loop {
        let end = (b + ctx).min(n);
        let first = scored.max(b);
        if first < end.min(n - 1) {
            out.push((b, end, first));
        }
        scored = end;
        if end == n {
            return out;
        }
        b += stride;
    }
}

/// Mean, and standard error of the mean, of per-token NLLs.
pub fn mean_and_se(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    if x.len() < 2 {
        return (mean, 0.0);
    }
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    if a.chunk == 0 {
        bail!("--chunk must be at least 1");
    }
    let loaded = a.model.load()?;
    let tokens = match (&a.tokens_file, &a.text_file) {
        (Some(f), _) => {
            let s = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            parse_token_list(&s).with_context(|| format!("in {}", f.display()))?
        }
        (None, Some(f)) => {
            let s = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            loaded.tokenizer("use --tokens-file")?.encode(&s)?
        }
        (None, None) => bail!("give --tokens-file or --text-file"),
    };
    if tokens.len() < 2 {
        bail!("need at least 2 tokens to score, got {}", tokens.len());
    }
    let mut session = a.model.session(&loaded);
    let limit = session.max_positions();
    let ctx = match a.ctx {
        Some(0) | Some(1) => bail!("--ctx-size must be at least 2"),
        Some(c) if c > limit => bail!("--ctx-size {c} exceeds the model's context of {limit} tokens"),
        Some(c) => c,
        None if tokens.len() > limit => {
            eprintln!(
                "lily perplexity: {} tokens exceed the model's context of {limit}: scoring in windows of {limit} (--ctx-size, --stride)",
                tokens.len()
            );
            limit
        }
        None => tokens.len(),
    };
    let stride = match a.stride {
        Some(0) => bail!("--stride must be at least 1"),
        Some(s) if s > ctx => {
            bail!("--stride {s} exceeds the window of {ctx} tokens (tokens between windows would go unscored)")
        }
        Some(s) => s,
        None => (ctx / 2).max(1),
    };
    let wins = windows(tokens.len(), ctx, stride);
    if a.dump_logits.is_some() && wins.len() > 1 {
        bail!("--dump-logits needs the {} tokens in one window (--ctx-size {})", tokens.len(), tokens.len());
    }
    let v = session.vocab_size();
    let keep = a.dump_logits.is_some();
    let mut all = Vec::with_capacity(if keep { tokens.len() * v } else { 0 });
    let mut nlls: Vec<f64> = Vec::with_capacity(tokens.len());
    let total_targets = tokens.len() - 1;
    let mut bar = Progress::new("perplexity", total_targets);
    let plain = !lily::progress::enabled();
    let start = std::time::Instant::now();
    let mut last_log = start;
    for (wi, &(b, end, first)) in wins.iter().enumerate() {
        if wi > 0 {
            session.reset();
        }
        let mut pos = b;
        for chunk in tokens[b..end].chunks(a.chunk) {
            let logits = session.forward_all(chunk)?;
            for (i, row) in logits.chunks_exact(v).enumerate() {
                let t = pos + i;
                if t >= first && t + 1 < tokens.len() {
                    let next = tokens[t + 1] as usize;
                    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
                    nlls.push(lse - row[next] as f64);
                    bar.tick();
                }
            }
            pos += chunk.len();
            if keep {
                all.extend_from_slice(&logits);
            }
            let (mean, se) = mean_and_se(&nlls);
            bar.message(format!("ppl {:.4} ± {:.4}", mean.exp(), mean.exp() * se));
            if plain && last_log.elapsed().as_secs_f64() > 10.0 {
                last_log = std::time::Instant::now();
                eprintln!(
                    "lily perplexity: {}/{total_targets} tokens scored (window {}/{}), ppl so far {:.4}",
                    nlls.len(),
                    wi + 1,
                    wins.len(),
                    mean.exp()
                );
            }
        }
    }
    bar.finish();
    let secs = start.elapsed().as_secs_f64();
    let (mean, se) = mean_and_se(&nlls);
    let (ppl, ppl_se) = (mean.exp(), mean.exp() * se);
    if let Some(path) = &a.dump_logits {
        let bytes: Vec<u8> = all.iter().flat_map(|x| x.to_le_bytes()).collect();
        safetensors::write(path, &[("logits", Dtype::F32, vec![tokens.len(), v], &bytes)])?;
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({"tokens": tokens.len(), "scored": nlls.len(), "mean_nll": mean, "mean_nll_stderr": se,
                "perplexity": ppl, "perplexity_stderr": ppl_se, "ctx_size": ctx, "stride": stride,
                "windows": wins.len(), "seconds": secs})
        );
    } else {
        println!(
            "tokens {}  scored {}  windows {} (ctx {ctx}, stride {stride})  mean NLL {mean:.6} ± {se:.6}  perplexity {ppl:.4} ± {ppl_se:.4}  ({secs:.2}s)",
            tokens.len(),
            nlls.len(),
            wins.len(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{mean_and_se, windows};

    #[test]
    fn windows_score_every_target_once() {
        for (n, ctx, stride) in [(10, 10, 5), (10, 4, 2), (11, 4, 4), (100, 7, 3), (5, 2, 1), (9, 4, 1), (2, 2, 1)] {
            let w = windows(n, ctx, stride);
            let mut seen = vec![0; n - 1];
            for &(b, end, first) in &w {
                assert!(end - b <= ctx && first >= b);
                (first..end.min(n - 1)).for_each(|t| seen[t] += 1);
            }
            assert!(seen.iter().all(|&c| c == 1), "n {n} ctx {ctx} stride {stride}: {w:?}");
            for &(b, _, first) in &w[1..] {
                assert!(first - b >= ctx - stride, "{w:?}");
            }
        }
        assert_eq!(windows(10, 10, 5), vec![(0, 10, 0)]);
        assert_eq!(windows(10, 4, 2), vec![(0, 4, 0), (2, 6, 4), (4, 8, 6), (6, 10, 8)]);
        assert_eq!(windows(11, 4, 4), vec![(0, 4, 0), (4, 8, 4), (8, 11, 8)]);
    }

    #[test]
    fn the_standard_error_is_the_sample_sd_over_root_n() {
        let (m, se) = mean_and_se(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m, 2.5);
        // sample variance 5/3, se = sqrt(5/3 / 4)
        assert!((se - (5.0f64 / 12.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_and_se(&[2.0]), (2.0, 0.0));
    }
}
