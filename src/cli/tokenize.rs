//! `lily tokenize`: token ids of a text.

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Model directory (its tokenizer.json) or `synthetic:NAME` (the shared Qwen3.6 tokenizer).
    #[arg(long)]
    pub model: String,
    #[arg(long)]
    pub text: String,
    /// Print `{"ids": [...], "tokens": [...]}`.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: TokenizeArgs) -> Result<()> {
    let dir = if a.model.starts_with("synthetic:") {
        lily::tokenizer::Tokenizer::find_dir(None)
    } else {
        lily::tokenizer::Tokenizer::find_dir(Some(std::path::Path::new(&a.model)))
    }
    .with_context(|| format!("no tokenizer.json found for {}", a.model))?;
    let model_dir = (!a.model.starts_with("synthetic:")).then(|| std::path::Path::new(&a.model));
    let tok = lily::tokenizer::Tokenizer::load(&dir, model_dir)?;
    let ids = tok.encode(&a.text)?;
    if a.json {
        let pieces: Vec<String> = ids.iter().map(|&i| tok.decode(&[i]).unwrap_or_default()).collect();
        println!("{}", serde_json::json!({"ids": ids, "tokens": pieces}));
    } else {
        println!("{}", ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "));
    }
    Ok(())
}
