//! Resolves a `--model` argument (a directory or `synthetic:NAME`) to a model and its tokenizer.

use crate::model::Model;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::sync::Arc;

pub struct Loaded {
    pub model: Arc<Model>,
    pub tokenizer: Option<Tokenizer>,
}

/// `layers` only applies to synthetic models.
pub fn load(spec: &str, layers: Option<usize>) -> Result<Loaded> {
    if let Some(name) = spec.strip_prefix("synthetic:") {
        let tok_dir = Tokenizer::find_dir(None);
        let tokenizer = match &tok_dir {
            Some(d) => {
                let mut t = Tokenizer::load(d, None)?;
                // The shared tokenizer's own template is a stand-in; the checkpoints' real one
                // (XML tool calls) sits beside it.
                if let Some(real) = d.parent().map(|p| p.join("qwen3.5-chat-template/chat_template.jinja")) {
                    if real.exists() {
                        t.set_chat_template_file(&real)?;
                    }
                }
                Some(t)
            }
            None => None,
        };
        // The real vocabulary size when the real tokenizer is here; a small one otherwise.
        let vocab = if tokenizer.is_some() { 248_320 } else { 1024 };
        let model = crate::synthetic::build(name, layers, vocab)?;
        return Ok(Loaded { model: Arc::new(model), tokenizer });
    }
    if layers.is_some() {
        bail!("--layers only applies to synthetic models");
    }
    let dir = Path::new(spec);
    let gguf = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if gguf(dir)
        || (dir.is_dir()
            && !dir.join("config.json").exists()
            && std::fs::read_dir(dir).into_iter().flatten().flatten().any(|e| gguf(&e.path())))
    {
        bail!(
            "{spec}: GGUF is not supported; lily reads safetensors checkpoints in the MLX (mlx-community) or \
             Hugging Face layout (a directory with config.json), or a Hugging Face id such as mlx-community/Qwen3.6-35B-A3B-4bit"
        );
    }
    if !dir.is_dir() {
        bail!(
            "model directory {spec} does not exist (give a checkpoint directory, a Hugging Face id ORG/NAME, \
             or synthetic:tiny)"
        );
    }
    let model = crate::weights::load_model(dir).with_context(|| format!("loading model from {spec}"))?;
    let tokenizer = match Tokenizer::find_dir(Some(dir)) {
        Some(d) if d == dir => Some(Tokenizer::load(&d, Some(dir))?),
        _ => None,
    };
    Ok(Loaded { model: Arc::new(model), tokenizer })
}
