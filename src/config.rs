//! `config.json` -> [`ModelConfig`]: every dimension of the model, validated once.
//!
//! Accepts the multimodal wrapper (`text_config` inside, `model_type` `qwen3_5_moe` / `qwen3_5`) and
//! flat text configs (`qwen3_5_moe_text` / `qwen3_5_text`). Field names are the Hugging Face ones.

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Which mixer a decoder layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state).
    Gdn,
    /// Gated full attention with a KV cache.
    Attention,
}

/// The feed-forward block of every layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// Routed experts plus a sigmoid-gated shared expert (`qwen3_5_moe`).
    Moe,
    /// One SwiGLU MLP (`qwen3_5` dense models).
    Dense,
}

/// Per-module quantization as `mlx_lm.convert` records it in `config.json["quantization"]`.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantConfig {
    pub bits: u32,
    pub group_size: usize,
    /// Module path (MLX naming, without `.weight`) -> Some((bits, group)) or None (left unquantized).
    pub overrides: BTreeMap<String, Option<(u32, usize)>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub layer_kinds: Vec<LayerKind>,
    pub ffn: FfnKind,
    pub rms_norm_eps: f32,
    // full attention
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub attn_output_gate: bool,
    // gated deltanet
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    // moe / mlp
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub intermediate_size: usize,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub quantization: Option<QuantConfig>,
}

/// Checked before the per-layer list is built.
const MAX_LAYERS: usize = 1024;

const MOE_TYPES: [&str; 2] = ["qwen3_5_moe", "qwen3_5_moe_text"];
const DENSE_TYPES: [&str; 2] = ["qwen3_5", "qwen3_5_text"];

struct Fields<'a> {
    text: &'a Map<String, Value>,
    top: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.text.get(name).or_else(|| self.top.get(name)).filter(|v| !v.is_null())
    }
    fn usize(&self, name: &str) -> Result<usize> {
        let v = self.get(name).with_context(|| format!("config.json: missing field `{name}`"))?;
        v.as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .with_context(|| format!("config.json: field `{name}` must be a non-negative integer, got {v}"))
    }
    fn usize_or(&self, name: &str, default: usize) -> Result<usize> {
        if self.get(name).is_some() {
            self.usize(name)
        } else {
            Ok(default)
        }
    }
    fn f64_opt(&self, name: &str) -> Result<Option<f64>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => {
                v.as_f64().map(Some).with_context(|| format!("config.json: field `{name}` must be a number, got {v}"))
            }
        }
    }
    fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => {
                v.as_bool().with_context(|| format!("config.json: field `{name}` must be true or false, got {v}"))
            }
        }
    }
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_json_str(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
        Self::from_json(&root)
    }

    pub fn from_json(root: &Value) -> Result<Self> {
        let top = root.as_object().context("config.json: top level must be a JSON object")?;
        let empty = Map::new();
        let text = match top.get("text_config") {
            Some(Value::Object(m)) => m,
            Some(v) if !v.is_null() => bail!("config.json: field `text_config` must be an object"),
            _ => &empty,
        };
        let f = Fields { text, top };
        let model_type = top
            .get("model_type")
            .and_then(Value::as_str)
            .context("config.json: missing field `model_type`")?
            .to_string();
        let ffn = if MOE_TYPES.contains(&model_type.as_str()) {
            FfnKind::Moe
        } else if DENSE_TYPES.contains(&model_type.as_str()) {
            FfnKind::Dense
        } else {
            bail!(
                "config.json: unsupported model_type `{model_type}` (lily runs {} and {})",
                MOE_TYPES.join(", "),
                DENSE_TYPES.join(", ")
            )
        };
        let num_hidden_layers = f.usize("num_hidden_layers")?;
        if num_hidden_layers > MAX_LAYERS {
            bail!("config.json: field `num_hidden_layers` = {num_hidden_layers} is larger than lily accepts (at most {MAX_LAYERS})");
        }
        let layer_kinds = parse_layer_kinds(&f, num_hidden_layers)?;
        let head_dim = f.usize("head_dim")?;
        let (rope_theta, partial) = parse_rope(&f)?;
        let rotary_dim = ((head_dim as f64) * partial).round() as usize;
        let moe = ffn == FfnKind::Moe;
        let cfg = ModelConfig {
            vocab_size: f.usize("vocab_size")?,
            hidden_size: f.usize("hidden_size")?,
            num_hidden_layers,
            layer_kinds,
            ffn,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            num_attention_heads: f.usize("num_attention_heads")?,
            num_key_value_heads: f.usize("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta,
            attn_output_gate: f.bool_or("attn_output_gate", true)?,
            linear_num_key_heads: f.usize("linear_num_key_heads")?,
            linear_num_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_head_dim: f.usize("linear_key_head_dim")?,
            linear_value_head_dim: f.usize("linear_value_head_dim")?,
            linear_conv_kernel_dim: f.usize_or("linear_conv_kernel_dim", 4)?,
            num_experts: if moe { f.usize("num_experts")? } else { 0 },
            num_experts_per_tok: if moe { f.usize("num_experts_per_tok")? } else { 0 },
            moe_intermediate_size: if moe { f.usize("moe_intermediate_size")? } else { 0 },
            shared_expert_intermediate_size: if moe { f.usize("shared_expert_intermediate_size")? } else { 0 },
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            intermediate_size: if moe { 0 } else { f.usize("intermediate_size")? },
            tie_word_embeddings: match top.get("tie_word_embeddings") {
                Some(v) if !v.is_null() => {
                    v.as_bool().context("config.json: field `tie_word_embeddings` must be true or false")?
                }
                _ => f.bool_or("tie_word_embeddings", false)?,
            },
            max_position_embeddings: f.usize_or("max_position_embeddings", 262_144)?,
            eos_token_ids: parse_eos(f.get("eos_token_id"))?,
            quantization: parse_quant(top.get("quantization").or_else(|| top.get("quantization_config")))?,
            model_type,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let nonzero = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                bail!("config.json: field `{name}` must be positive");
            }
        }
        // Upper bounds far above any real model of the family (Qwen3.5-397B-A17B: hidden 4096,
        // 60 layers, 512 experts), so that every size derived from them fits in memory
        // arithmetic without overflow, and a crafted config fails here with its field's name.
        let at_most = [
            ("vocab_size", self.vocab_size, 1 << 22),
            ("hidden_size", self.hidden_size, 1 << 16),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, 1024),
            ("num_key_value_heads", self.num_key_value_heads, 1024),
            ("head_dim", self.head_dim, 4096),
            ("linear_num_key_heads", self.linear_num_key_heads, 1024),
            ("linear_num_value_heads", self.linear_num_value_heads, 1024),
            ("linear_key_head_dim", self.linear_key_head_dim, 4096),
            ("linear_value_head_dim", self.linear_value_head_dim, 4096),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim, 64),
            ("num_experts", self.num_experts, 1 << 16),
            ("num_experts_per_tok", self.num_experts_per_tok, 1024),
            ("moe_intermediate_size", self.moe_intermediate_size, 1 << 20),
            ("shared_expert_intermediate_size", self.shared_expert_intermediate_size, 1 << 20),
            ("intermediate_size", self.intermediate_size, 1 << 20),
            ("max_position_embeddings", self.max_position_embeddings, 1 << 24),
        ];
        for (name, v, max) in at_most {
            if v > max {
                bail!("config.json: field `{name}` = {v} is larger than lily accepts (at most {max})");
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            bail!(
                "config.json: `num_attention_heads` ({}) must be a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self.linear_num_value_heads.is_multiple_of(self.linear_num_key_heads) {
            bail!(
                "config.json: `linear_num_value_heads` ({}) must be a multiple of `linear_num_key_heads` ({})",
                self.linear_num_value_heads,
                self.linear_num_key_heads
            );
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            bail!(
                "config.json: `partial_rotary_factor` gives {} rotary dims for head_dim {} (must be even and ≤ head_dim)",
                self.rotary_dim,
                self.head_dim
            );
        }
        if self.ffn == FfnKind::Moe {
            if self.num_experts == 0 || self.moe_intermediate_size == 0 {
                bail!("config.json: `num_experts` and `moe_intermediate_size` must be positive");
            }
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
                bail!(
                    "config.json: `num_experts_per_tok` ({}) must be between 1 and `num_experts` ({})",
                    self.num_experts_per_tok,
                    self.num_experts
                );
            }
        } else if self.intermediate_size == 0 {
            bail!("config.json: field `intermediate_size` must be positive");
        }
        if self.rope_theta <= 0.0 || !self.rope_theta.is_finite() {
            bail!("config.json: `rope_theta` must be positive, got {}", self.rope_theta);
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            bail!("config.json: `rms_norm_eps` must be in (0, 1), got {}", self.rms_norm_eps);
        }
        Ok(())
    }

    // ---- derived dimensions -------------------------------------------------------------------
    /// Width of the GDN key projection: H_k * D_k.
    pub fn gdn_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    /// Width of the GDN value projection: H_v * D_v.
    pub fn gdn_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the causal conv: q, k and v together.
    pub fn gdn_conv_dim(&self) -> usize {
        2 * self.gdn_key_dim() + self.gdn_value_dim()
    }
    /// Value heads per key head (value head h reads key head h / this).
    pub fn gdn_v_per_k(&self) -> usize {
        self.linear_num_value_heads / self.linear_num_key_heads
    }
    pub fn q_proj_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim * if self.attn_output_gate { 2 } else { 1 }
    }
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
    pub fn attn_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
    pub fn num_attention_layers(&self) -> usize {
        self.layer_kinds.iter().filter(|k| **k == LayerKind::Attention).count()
    }
}

fn parse_layer_kinds(f: &Fields, n: usize) -> Result<Vec<LayerKind>> {
    if let Some(v) = f.get("layer_types") {
        let list = v.as_array().context("config.json: field `layer_types` must be a list")?;
        if list.len() != n {
            bail!("config.json: `layer_types` has {} entries but `num_hidden_layers` is {n}", list.len());
        }
        return list
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("linear_attention") => Ok(LayerKind::Gdn),
                Some("full_attention") => Ok(LayerKind::Attention),
                _ => {
                    bail!("config.json: `layer_types[{i}]` is {t}, expected \"linear_attention\" or \"full_attention\"")
                }
            })
            .collect();
    }
    let interval = f.usize_or("full_attention_interval", 4)?;
    if interval == 0 {
        bail!("config.json: field `full_attention_interval` must be positive");
    }
    Ok((0..n).map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::Gdn }).collect())
}

/// rope_theta and partial_rotary_factor live in `rope_parameters` (new HF) or at the top (older).
fn parse_rope(f: &Fields) -> Result<(f64, f64)> {
    let params = match f.get("rope_parameters").or_else(|| f.get("rope_scaling")) {
        Some(Value::Object(m)) => Some(m),
        Some(_) => bail!("config.json: field `rope_parameters` must be an object"),
        None => None,
    };
    let from_params = |name: &str| -> Result<Option<f64>> {
        match params.and_then(|p| p.get(name)) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .with_context(|| format!("config.json: field `rope_parameters.{name}` must be a number")),
        }
    };
    let theta = match from_params("rope_theta")? {
        Some(t) => t,
        None => f
            .f64_opt("rope_theta")?
            .context("config.json: missing field `rope_theta` (or `rope_parameters.rope_theta`)")?,
    };
    let partial = match from_params("partial_rotary_factor")? {
        Some(p) => p,
        None => f.f64_opt("partial_rotary_factor")?.unwrap_or(0.25),
    };
    if !(partial > 0.0 && partial <= 1.0) {
        bail!("config.json: `partial_rotary_factor` must be in (0, 1], got {partial}");
    }
    Ok((theta, partial))
}

pub(crate) fn parse_eos(v: Option<&Value>) -> Result<Vec<u32>> {
    let as_id = |x: &Value| -> Result<u32> {
        x.as_u64()
            .filter(|&i| i <= u32::MAX as u64)
            .map(|i| i as u32)
            .with_context(|| format!("`eos_token_id` entries must be token ids, got {x}"))
    };
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(as_id).collect(),
        Some(x) => Ok(vec![as_id(x)?]),
    }
}

fn parse_quant(v: Option<&Value>) -> Result<Option<QuantConfig>> {
    let Some(v) = v else { return Ok(None) };
    let Some(m) = v.as_object() else { bail!("config.json: field `quantization` must be an object") };
    let read = |m: &Map<String, Value>, at: &str| -> Result<(u32, usize)> {
        let bits = m
            .get("bits")
            .and_then(Value::as_u64)
            .with_context(|| format!("config.json: `{at}.bits` missing or not an integer"))?;
        let group = m
            .get("group_size")
            .and_then(Value::as_u64)
            .with_context(|| format!("config.json: `{at}.group_size` missing or not an integer"))?;
        if bits != 4 && bits != 8 {
            bail!("config.json: `{at}.bits` = {bits} is not supported (lily reads 4- and 8-bit MLX weights)");
        }
        if ![32, 64, 128].contains(&group) {
            bail!("config.json: `{at}.group_size` = {group} is not supported (32, 64 or 128)");
        }
        Ok((bits as u32, group as usize))
    };
    if let Some(mode) = m.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            bail!("config.json: `quantization.mode` = {mode:?} is not supported (lily reads MLX affine quantization)");
        }
    }
    let (bits, group_size) = read(m, "quantization")?;
    let mut overrides = BTreeMap::new();
    for (k, val) in m {
        match val {
            Value::Object(o) => {
                overrides.insert(k.clone(), Some(read(o, &format!("quantization.{k}"))?));
            }
            Value::Bool(false) => {
                overrides.insert(k.clone(), None);
            }
            _ => {}
        }
    }
    Ok(Some(QuantConfig { bits, group_size, overrides }))
}
