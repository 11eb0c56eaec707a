//! Resolves a `--model` argument (a directory or `synthetic:NAME`) to a model and its tokenizer.

use crate::model::Model;
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::sync::Arc;

pub struct Loaded {
    pub model: Arc<Model>,
    pub tokenizer: Option<Tokenizer>,
    /// The checkpoint directory (None for synthetic models).
    pub dir: Option<std::path::PathBuf>,
}

impl Loaded {
    /// The tokenizer, or an error naming the file that was looked for.
    pub fn tokenizer(&self, what: &str) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().with_context(|| {
            let p = self.dir.as_ref().map(|d| d.join("tokenizer.json").display().to_string()).unwrap_or_default();
            format!("{p} does not exist: this checkpoint has no tokenizer; {what}")
        })
    }
}

/// `layers` only applies to synthetic models.
pub fn load(spec: &str, layers: Option<usize>) -> Result<Loaded> {
    if let Some(name) = spec.strip_prefix("synthetic:") {
        // LILY_TOKENIZER_DIR when set, else the built-in Qwen3.6 tokenizer and real template.
        let tokenizer = match Tokenizer::find_dir(None) {
            Some(d) => {
                let mut t = Tokenizer::load(&d, None)?;
                t.set_chat_template(crate::tokenizer::BUILTIN_TEMPLATE);
                t
            }
            None => Tokenizer::builtin()?,
        };
        // The real vocabulary (248,077 ids) padded to the real model's 248,320 rows.
        let vocab = 248_320;
        let tokenizer = Some(tokenizer);
        let model = crate::synthetic::build(name, layers, vocab)?;
        return Ok(Loaded { model: Arc::new(model), tokenizer, dir: None });
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
    Ok(Loaded { model: Arc::new(model), tokenizer, dir: Some(dir.to_path_buf()) })
}
