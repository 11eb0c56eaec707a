//! Tokenizer (`tokenizer.json` through the `tokenizers` crate) and chat template (Jinja, rendered
//! with minijinja under the Hugging Face conventions: `messages`, `tools`, `add_generation_prompt`,
//! `enable_thinking`, `bos_token`/`eos_token`, `tojson`, `raise_exception`).

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Ids that end generation (config.json, generation_config.json, tokenizer_config.json).
    pub eos_ids: Vec<u32>,
    /// Where `tokenizer.json` came from (constrained decoding builds its own view of it).
    source: Source,
}

#[derive(Clone, Debug)]
enum Source {
    File(PathBuf),
    Builtin,
}

/// The Qwen3.6 tokenizer and the real Qwen3.5 chat template, compiled in (assets/README.md).
const BUILTIN_JSON_GZ: &[u8] = include_bytes!("../assets/qwen3.6-tokenizer.json.gz");
pub const BUILTIN_TEMPLATE: &str = include_str!("../assets/qwen3.5-chat_template.jinja");

/// The built-in tokenizer's `tokenizer.json`.
pub fn builtin_json() -> Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::with_capacity(17 << 20);
    flate2::read::GzDecoder::new(BUILTIN_JSON_GZ).read_to_end(&mut out).context("unpacking the built-in tokenizer")?;
    Ok(out)
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Some(serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?))
}

fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` (+ template and special tokens) from `dir`; `model_dir` supplies
    /// config.json / generation_config.json EOS ids when the tokenizer lives elsewhere.
    pub fn load(dir: &Path, model_dir: Option<&Path>) -> Result<Tokenizer> {
        let tj = dir.join("tokenizer.json");
        if !tj.exists() {
            bail!("{}: no tokenizer.json", dir.display());
        }
        let inner = tokenizers::Tokenizer::from_file(&tj).map_err(|e| anyhow!("{}: {e}", tj.display()))?;
        let tc = read_json(&dir.join("tokenizer_config.json"))?;
        let mut chat_template = None;
        for d in [Some(dir), model_dir].into_iter().flatten() {
            let jinja = d.join("chat_template.jinja");
            if jinja.exists() {
                chat_template =
                    Some(std::fs::read_to_string(&jinja).with_context(|| format!("reading {}", jinja.display()))?);
                break;
            }
        }
        if chat_template.is_none() {
            chat_template = match tc.as_ref().and_then(|c| c.get("chat_template")) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .or(list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                _ => None,
            };
        }
        let bos_token = token_string(tc.as_ref().and_then(|c| c.get("bos_token")));
        let eos_token = token_string(tc.as_ref().and_then(|c| c.get("eos_token")));
        let mut eos_ids = Vec::new();
        for d in [model_dir, Some(dir)].into_iter().flatten() {
            for f in ["config.json", "generation_config.json"] {
                if let Some(v) = read_json(&d.join(f))? {
                    let e = v.get("eos_token_id").or_else(|| v.get("text_config").and_then(|t| t.get("eos_token_id")));
                    eos_ids.extend(crate::config::parse_eos(e).with_context(|| format!("{}", d.join(f).display()))?);
                }
            }
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_ids.push(id);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        Ok(Tokenizer { inner, chat_template, bos_token, eos_token, eos_ids, source: Source::File(tj) })
    }

    /// The built-in Qwen3.6 tokenizer with the real chat template (for models that carry none).
    pub fn builtin() -> Result<Tokenizer> {
        let inner =
            tokenizers::Tokenizer::from_bytes(builtin_json()?).map_err(|e| anyhow!("the built-in tokenizer: {e}"))?;
        let eos = "<|im_end|>";
        let eos_ids = inner.token_to_id(eos).into_iter().collect();
        Ok(Tokenizer {
            inner,
            chat_template: Some(BUILTIN_TEMPLATE.to_string()),
            bos_token: None,
            eos_token: Some(eos.to_string()),
            eos_ids,
            source: Source::Builtin,
        })
    }

    /// The bytes of the `tokenizer.json` this tokenizer was read from.
    pub fn json_bytes(&self) -> Result<Vec<u8>> {
        match &self.source {
            Source::File(p) => std::fs::read(p).with_context(|| format!("reading {}", p.display())),
            Source::Builtin => builtin_json(),
        }
    }

    /// Finds a tokenizer directory for a model directory: its own, else `LILY_TOKENIZER_DIR`
    /// (None: use [`Tokenizer::builtin`] for synthetic models).
    pub fn find_dir(model_dir: Option<&Path>) -> Option<PathBuf> {
        if let Some(d) = model_dir {
            if d.join("tokenizer.json").exists() {
                return Some(d.to_path_buf());
            }
        }
        std::env::var_os("LILY_TOKENIZER_DIR").map(PathBuf::from).filter(|d| d.join("tokenizer.json").exists())
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes text; special-token strings in it (e.g. `<|im_start|>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| anyhow!("detokenizing: {e}"))
    }

    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        self.inner.token_to_id(s)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Replaces the chat template.
    pub fn set_chat_template(&mut self, template: &str) {
        self.chat_template = Some(template.to_string());
    }

    /// How the chat template asks for tool calls (XML for the real Qwen3.5/3.6 template).
    pub fn tool_format(&self) -> crate::constrain::ToolFormat {
        crate::constrain::ToolFormat::of_template(self.chat_template.as_deref().unwrap_or(""))
    }

    /// Renders the chat template. `messages` and `tools` are OpenAI-style JSON values;
    /// `extra` holds template kwargs such as `enable_thinking`.
    pub fn apply_chat_template(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().context("this model has no chat template (use --raw)")?;
        render_template(
            template,
            messages,
            tools,
            add_generation_prompt,
            extra,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )
    }
}

/// Python `json.dumps(..., ensure_ascii=False)` formatting (", " and ": " separators, or indent).
fn py_json(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
    let nl = |out: &mut String, lvl: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * lvl));
        }
    };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(if indent.is_some() { "," } else { ", " });
                }
                nl(out, level + 1);
                py_json(x, indent, level + 1, out);
            }
            nl(out, level);
            out.push(']');
        }
        Value::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(if indent.is_some() { "," } else { ", " });
                }
                nl(out, level + 1);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                py_json(x, indent, level + 1, out);
            }
            nl(out, level);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).unwrap_or_default()),
    }
}

fn render_template(
    template: &str,
    messages: &Value,
    tools: Option<&Value>,
    add_generation_prompt: bool,
    extra: &serde_json::Map<String, Value>,
    bos: Option<&str>,
    eos: Option<&str>,
) -> Result<String> {
    use minijinja::{Environment, Error, ErrorKind};
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_filter("tojson", |v: minijinja::Value, kwargs: minijinja::value::Kwargs| -> Result<String, Error> {
        let indent: Option<usize> = kwargs.get("indent")?;
        let json: Value =
            serde_json::to_value(&v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
        let mut s = String::new();
        py_json(&json, indent, 0, &mut s);
        Ok(s)
    });
    env.add_template("chat", template).map_err(|e| anyhow!("chat template does not parse: {e}"))?;
    let mut ctx = serde_json::Map::new();
    for (k, v) in extra {
        ctx.insert(k.clone(), v.clone());
    }
    ctx.insert("messages".into(), messages.clone());
    if let Some(t) = tools {
        ctx.insert("tools".into(), t.clone());
    }
    ctx.insert("add_generation_prompt".into(), Value::Bool(add_generation_prompt));
    ctx.insert("bos_token".into(), bos.map(|s| Value::String(s.into())).unwrap_or(Value::String(String::new())));
    ctx.insert("eos_token".into(), eos.map(|s| Value::String(s.into())).unwrap_or(Value::String(String::new())));
    let tmpl = env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
    tmpl.render(minijinja::Value::from_serialize(&ctx)).map_err(|e| {
        let mut msg = format!("chat template: {e}");
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(&format!(": {s}"));
            src = s.source();
        }
        anyhow!(msg)
    })
}

/// Turns a growing list of token ids into text pieces, holding back incomplete UTF-8 sequences.
pub struct StreamDecoder {
    ids: Vec<u32>,
    emitted: usize,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder { ids: Vec::new(), emitted: 0 }
    }

    /// Adds one token; returns the newly completed text.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let new = text.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = text.len();
        Ok(new)
    }

    /// Whatever is still held back (an incomplete sequence at the end).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let text = tok.decode(&self.ids)?;
        let new = text.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = text.len();
        Ok(new)
    }
}
