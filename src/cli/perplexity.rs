//! `lily perplexity`: teacher-forced NLL over a token or text file, optionally dumping logits.

use super::{parse_token_list, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
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
    /// Write all logits as one f32 tensor `logits` [N, vocab] to this safetensors file.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
    /// Tokens per forward call (the state carries across chunks).
    #[arg(allow_negative_numbers = true, long, default_value_t = 512)]
    pub chunk: usize,
    #[arg(long)]
    pub json: bool,
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
    let v = session.vocab_size();
    let keep = a.dump_logits.is_some();
    let mut all = Vec::with_capacity(if keep { tokens.len() * v } else { 0 });
    let (mut nll, mut count) = (0f64, 0usize);
    let start = std::time::Instant::now();
    for (ci, chunk) in tokens.chunks(a.chunk).enumerate() {
        let logits = session.forward_all(chunk)?;
        for (i, row) in logits.chunks_exact(v).enumerate() {
            let pos = ci * a.chunk + i;
            if let Some(&next) = tokens.get(pos + 1) {
                let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
                nll += lse - row[next as usize] as f64;
                count += 1;
            }
        }
        if keep {
            all.extend_from_slice(&logits);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let mean = nll / count as f64;
    if let Some(path) = &a.dump_logits {
        let bytes: Vec<u8> = all.iter().flat_map(|x| x.to_le_bytes()).collect();
        safetensors::write(path, &[("logits", Dtype::F32, vec![tokens.len(), v], &bytes)])?;
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({"tokens": tokens.len(), "scored": count, "mean_nll": mean, "perplexity": mean.exp(), "seconds": secs})
        );
    } else {
        println!(
            "tokens {}  scored {count}  mean NLL {mean:.6}  perplexity {:.4}  ({secs:.2}s)",
            tokens.len(),
            mean.exp()
        );
    }
    Ok(())
}
