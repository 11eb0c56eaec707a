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
    let tok = if a.model.starts_with("synthetic:") {
        match lily::tokenizer::Tokenizer::find_dir(None) {
            Some(d) => lily::tokenizer::Tokenizer::load(&d, None)?,
            None => lily::tokenizer::Tokenizer::builtin()?,
        }
    } else {
        let model_dir = std::path::Path::new(&a.model);
        let dir = lily::tokenizer::Tokenizer::find_dir(Some(model_dir))
            .with_context(|| format!("{}: no tokenizer.json", model_dir.join("tokenizer.json").display()))?;
        lily::tokenizer::Tokenizer::load(&dir, Some(model_dir))?
    };
    let ids = tok.encode(&a.text)?;
    if a.json {
        let pieces: Vec<String> = ids.iter().map(|&i| tok.decode(&[i]).unwrap_or_default()).collect();
        println!("{}", serde_json::json!({"ids": ids, "tokens": pieces}));
    } else {
        println!("{}", ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "));
    }
    Ok(())
}
