//! `lily tokenize`: token ids of a text.

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Model directory (its tokenizer.json), Hugging Face id (`ORG/NAME[@REVISION]`) or
    /// `synthetic:NAME` (the shared Qwen3.6 tokenizer).
    #[arg(long)]
    pub model: String,
    /// Revision of a Hugging Face id.
    #[arg(long)]
    pub revision: Option<String>,
    /// Hugging Face token (default: HF_TOKEN).
    #[arg(long)]
    pub token: Option<String>,
    #[arg(long)]
    pub text: String,
    /// Print `{"ids": [...], "tokens": [...]}`.
    #[arg(long)]
    pub json: bool,
}

pub fn run(mut a: TokenizeArgs) -> Result<()> {
    a.model = super::resolve_model(&a.model, a.revision.as_deref(), a.token.clone())?;
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
