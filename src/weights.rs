//! Checkpoint loading: memory-mapped safetensors (single or sharded) in the MLX affine-quantized
//! layout or the original Hugging Face layout, and the one pass that fixes up their differences:
//!
//! - names: `model.language_model.*` (HF wrapper), `language_model.model.*` (MLX), `model.*` (flat)
//!   all map to `model.*`; `mtp.*` and vision tensors are ignored;
//! - zero-centred norms: HF stores `w` for a multiplier `1 + w` on the decoder, final, q and k norms;
//!   MLX stores the multiplier. The HF layout is recognised, as mlx-lm does, by its conv1d shape
//!   `[C, 1, K]` (MLX: `[C, K, 1]`). The GDN gated norm is a plain multiplier in both;
//! - experts: MLX `switch_mlp.{gate,up,down}_proj` stacks `[E, ·, ·]`, HF fused
//!   `experts.gate_up_proj [E, 2I, H]` (gate = first I rows) + `experts.down_proj [E, H, I]`, or HF
//!   per-expert `experts.{e}.{gate,up,down}_proj.weight`;
//! - quantized matrices keep their packed words, scales and biases as mapped from the file.

use crate::config::{FfnKind, LayerKind, ModelConfig, QuantConfig};
use crate::cpu::rope::Rope;
use crate::linear::{FloatType, Linear};
use crate::model::{Attention, Ffn, Gdn, Layer, Mixer, Mlp, Model, Moe};
use crate::progress::Progress;
use crate::safetensors::{Dtype, SafeFile, TensorData};
use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Canonical tensor name, or None for tensors lily ignores (MTP head, vision tower).
pub fn canonical_name(name: &str) -> Option<String> {
    const IGNORED: [&str; 6] =
        ["mtp.", "model.mtp.", "model.visual.", "visual.", "vision_tower.", "model.vision_tower."];
    if IGNORED.iter().any(|p| name.starts_with(p)) || name.contains(".mtp.") {
        return None;
    }
    for (from, to) in [
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("language_model.", "model."),
    ] {
        if let Some(rest) = name.strip_prefix(from) {
            return Some(format!("{to}{rest}"));
        }
    }
    Some(name.to_string())
}

/// All tensors of a checkpoint directory under canonical names.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub tensors: BTreeMap<String, TensorData>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let files = shard_files(dir)?;
        let mut tensors = BTreeMap::new();
        for f in &files {
            let sf = SafeFile::open(f)?;
            for (name, t) in sf.tensors {
                if let Some(c) = canonical_name(&name) {
                    if tensors.insert(c.clone(), t).is_some() {
                        bail!("{}: tensor `{name}` appears twice in the checkpoint", f.display());
                    }
                }
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), tensors })
    }

    fn get(&self, name: &str) -> Result<&TensorData> {
        self.tensors.get(name).with_context(|| format!("checkpoint is missing tensor `{name}`"))
    }
}

/// The safetensors files of a checkpoint: from `model.safetensors.index.json`, or every
/// `*.safetensors` file in the directory.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("reading {}", index.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: missing object `weight_map`", index.display()))?;
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let f = file
                .as_str()
                .with_context(|| format!("{}: `weight_map[{tensor}]` is not a file name", index.display()))?;
            if f.contains('/') || f.contains("..") {
                bail!("{}: shard name {f:?} must be a plain file name", index.display());
            }
            files.insert(dir.join(f));
        }
        for f in &files {
            if !f.exists() {
                bail!("{} lists shard {} which does not exist", index.display(), f.display());
            }
        }
        return Ok(files.into_iter().collect());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading model directory {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("{}: no *.safetensors files (is this a model directory?)", dir.display());
    }
    Ok(files)
}

/// Loads config.json and the weights of a model directory. Non-finite scales, biases or norm
/// weights are reported on stderr (the model would load and then produce garbage).
pub fn load_model(dir: &Path) -> Result<Model> {
    let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
    let ck = Checkpoint::open(dir)?;
    for (name, n) in non_finite_tensors(&ck) {
        eprintln!(
            "warning: {}: tensor `{name}` holds {n} NaN or infinite values; the model's output will be garbage",
            dir.display()
        );
    }
    build_model(cfg, &ck)
}

/// The small float tensors (quantization scales and biases, norm weights, GDN gate parameters)
/// that hold NaN or infinite values, with their counts. The packed weights are not scanned.
pub fn non_finite_tensors(ck: &Checkpoint) -> Vec<(String, usize)> {
    use rayon::prelude::*;
    let small = |n: &str| {
        n.ends_with(".scales")
            || n.ends_with(".biases")
            || n.ends_with("norm.weight")
            || n.ends_with("A_log")
            || n.ends_with("dt_bias")
    };
    let mut out: Vec<(String, usize)> = ck
        .tensors
        .par_iter()
        .filter(|(n, _)| small(n))
        .filter_map(|(n, t)| {
            let b = t.bytes.as_slice();
            let bad = match t.dtype {
                Dtype::BF16 => {
                    b.chunks_exact(2).filter(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80).count()
                }
                Dtype::F16 => b.chunks_exact(2).filter(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00).count(),
                Dtype::F32 => {
                    b.chunks_exact(4).filter(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()).count()
                }
                _ => 0,
            };
            (bad > 0).then(|| (n.clone(), bad))
        })
        .collect();
    out.sort();
    out
}

struct Builder<'a> {
    ck: &'a Checkpoint,
    quant: Option<QuantConfig>,
}

impl Builder<'_> {
    fn quant_for(&self, module: &str) -> Result<(u32, usize)> {
        let q = self.quant.as_ref().with_context(|| {
            format!("tensor `{module}.scales` is quantized but config.json has no `quantization` section")
        })?;
        Ok(match q.overrides.get(module) {
            Some(Some(o)) => *o,
            Some(None) => bail!("config.json marks `{module}` unquantized but the checkpoint has `{module}.scales`"),
            None => (q.bits, q.group_size),
        })
    }

    /// Matrices stored under `wname` (`[rows, cols]`, or `[lead, rows, cols]` for expert stacks),
    /// dense or MLX-quantized (with `{module}.scales` / `.biases` beside the packed weight).
    fn linears(&self, wname: &str, module: &str, lead: Option<usize>, rows: usize, cols: usize) -> Result<Vec<Linear>> {
        let n = lead.unwrap_or(1);
        let mut shape: Vec<usize> = lead.into_iter().collect();
        let w = self.ck.tensors.get(wname).with_context(|| {
            let mut s = shape.clone();
            s.extend([rows, cols]);
            format!("checkpoint is missing tensor `{wname}` (expected shape {s:?})")
        })?;
        let scales_name = format!("{module}.scales");
        let big = if let Some(scales) = self.ck.tensors.get(&scales_name) {
            let (bits, group) = self.quant_for(module)?;
            let biases_name = format!("{module}.biases");
            let biases = self.ck.get(&biases_name)?;
            if !cols.is_multiple_of(group) {
                bail!("`{wname}`: input width {cols} is not a multiple of the quantization group {group}");
            }
            let mut ws = shape.clone();
            ws.extend([rows, cols * bits as usize / 32]);
            let mut ss = shape.clone();
            ss.extend([rows, cols / group]);
            expect(wname, w, &ws, Some(Dtype::U32), &format!("{bits}-bit packed, group {group}"))?;
            expect(&scales_name, scales, &ss, None, "quantization scales")?;
            expect(&biases_name, biases, &ss, Some(scales.dtype), "quantization biases")?;
            let sty = float_type(&scales_name, scales)?;
            Linear::quant(n * rows, cols, bits, group, w.bytes.clone(), scales.bytes.clone(), biases.bytes.clone(), sty)
                .with_context(|| format!("tensor `{wname}`"))?
        } else {
            shape.extend([rows, cols]);
            expect(wname, w, &shape, None, "dense weight")?;
            Linear::dense(n * rows, cols, float_type(wname, w)?, w.bytes.clone())?
        };
        Ok((0..n).map(|e| big.row_range(e * rows, rows)).collect())
    }

    fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear> {
        Ok(self.linears(&format!("{module}.weight"), module, None, rows, cols)?.remove(0))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.ck.get(name)?;
        if t.numel() != len || t.shape.iter().filter(|&&d| d != 1).count() > 1 {
            bail!("tensor `{name}` has shape {:?}, expected [{len}]", t.shape);
        }
        t.to_f32().with_context(|| format!("tensor `{name}`"))
    }

    fn mlp(&self, p: &str, inter: usize, hid: usize) -> Result<Mlp> {
        Ok(Mlp {
            gate: self.linear(&format!("{p}.gate_proj"), inter, hid)?,
            up: self.linear(&format!("{p}.up_proj"), inter, hid)?,
            down: self.linear(&format!("{p}.down_proj"), hid, inter)?,
        })
    }

    fn experts(&self, p: &str, cfg: &ModelConfig) -> Result<Vec<Mlp>> {
        let (e, i, h) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size);
        let sw = format!("{p}.switch_mlp");
        if self.ck.tensors.contains_key(&format!("{sw}.gate_proj.weight")) {
            let stack = |name: &str, r, c| {
                let m = format!("{sw}.{name}");
                self.linears(&format!("{m}.weight"), &m, Some(e), r, c)
            };
            let (g, u, d) = (stack("gate_proj", i, h)?, stack("up_proj", i, h)?, stack("down_proj", h, i)?);
            return Ok(g.into_iter().zip(u).zip(d).map(|((gate, up), down)| Mlp { gate, up, down }).collect());
        }
        let fused = format!("{p}.experts.gate_up_proj");
        if self.ck.tensors.contains_key(&fused) {
            let gu = self.linears(&fused, &fused, Some(e), 2 * i, h)?;
            let dn = format!("{p}.experts.down_proj");
            let d = self.linears(&dn, &dn, Some(e), h, i)?;
            return Ok(gu
                .into_iter()
                .zip(d)
                .map(|(gu, down)| Mlp { gate: gu.row_range(0, i), up: gu.row_range(i, i), down })
                .collect());
        }
        (0..e).map(|x| self.mlp(&format!("{p}.experts.{x}"), i, h)).collect()
    }
}

fn float_type(name: &str, t: &TensorData) -> Result<FloatType> {
    FloatType::from_dtype(t.dtype)
        .with_context(|| format!("tensor `{name}` has dtype {}, expected BF16, F16 or F32", t.dtype.name()))
}

fn expect(name: &str, t: &TensorData, shape: &[usize], dtype: Option<Dtype>, what: &str) -> Result<()> {
    if t.shape != shape {
        bail!("tensor `{name}` has shape {:?}, expected {shape:?} ({what})", t.shape);
    }
    if let Some(d) = dtype {
        if t.dtype != d {
            bail!("tensor `{name}` has dtype {}, expected {} ({what})", t.dtype.name(), d.name());
        }
    }
    Ok(())
}

/// Builds the model from a checkpoint: the single place where checkpoint quirks are resolved.
pub fn build_model(cfg: ModelConfig, ck: &Checkpoint) -> Result<Model> {
    let b = Builder { ck, quant: cfg.quantization.as_ref().map(canonical_quant) };
    let hid = cfg.hidden_size;
    let hf_norms = is_hf_layout(&cfg, ck)?;
    let shift = |mut v: Vec<f32>| {
        if hf_norms {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        v
    };
    let embed = b.linear("model.embed_tokens", cfg.vocab_size, hid)?;
    let lm_head = if cfg.tie_word_embeddings && !ck.tensors.contains_key("lm_head.weight") {
        embed.clone()
    } else {
        b.linear("lm_head", cfg.vocab_size, hid)?
    };
    let mut progress = Progress::new("loading", cfg.num_hidden_layers);
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for (i, kind) in cfg.layer_kinds.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let mixer = match kind {
            LayerKind::Gdn => Mixer::Gdn(gdn(&b, &cfg, &p)?),
            LayerKind::Attention => {
                let a = format!("{p}.self_attn");
                Mixer::Attention(Attention {
                    q: b.linear(&format!("{a}.q_proj"), cfg.q_proj_dim(), hid)?,
                    k: b.linear(&format!("{a}.k_proj"), cfg.kv_dim(), hid)?,
                    v: b.linear(&format!("{a}.v_proj"), cfg.kv_dim(), hid)?,
                    o: b.linear(&format!("{a}.o_proj"), hid, cfg.attn_dim())?,
                    q_norm: shift(b.vector(&format!("{a}.q_norm.weight"), cfg.head_dim)?),
                    k_norm: shift(b.vector(&format!("{a}.k_norm.weight"), cfg.head_dim)?),
                })
            }
        };
        let m = format!("{p}.mlp");
        let ffn = match cfg.ffn {
            FfnKind::Dense => Ffn::Dense(b.mlp(&m, cfg.intermediate_size, hid)?),
            FfnKind::Moe => Ffn::Moe(Moe {
                router: b.linear(&format!("{m}.gate"), cfg.num_experts, hid)?,
                experts: b.experts(&m, &cfg)?,
                shared: b.mlp(&format!("{m}.shared_expert"), cfg.shared_expert_intermediate_size, hid)?,
                shared_gate: b.linear(&format!("{m}.shared_expert_gate"), 1, hid)?,
            }),
        };
        layers.push(Layer {
            input_norm: shift(b.vector(&format!("{p}.input_layernorm.weight"), hid)?),
            post_norm: shift(b.vector(&format!("{p}.post_attention_layernorm.weight"), hid)?),
            mixer,
            ffn,
        });
        progress.tick();
    }
    progress.finish();
    let norm = shift(b.vector("model.norm.weight", hid)?);
    let rope = Rope::new(cfg.rotary_dim, cfg.rope_theta);
    Ok(Model { cfg, embed, layers, norm, lm_head, rope })
}

fn gdn(b: &Builder, cfg: &ModelConfig, p: &str) -> Result<Gdn> {
    let l = format!("{p}.linear_attn");
    let (hid, hv, cd, k) =
        (cfg.hidden_size, cfg.linear_num_value_heads, cfg.gdn_conv_dim(), cfg.linear_conv_kernel_dim);
    let conv_name = format!("{l}.conv1d.weight");
    let conv = b.ck.get(&conv_name)?;
    if conv.numel() != cd * k || conv.shape[0] != cd {
        bail!("tensor `{conv_name}` has shape {:?}, expected [{cd}, 1, {k}] (HF) or [{cd}, {k}, 1] (MLX)", conv.shape);
    }
    let a_log = b.vector(&format!("{l}.A_log"), hv)?;
    Ok(Gdn {
        in_qkv: b.linear(&format!("{l}.in_proj_qkv"), cd, hid)?,
        in_z: b.linear(&format!("{l}.in_proj_z"), cfg.gdn_value_dim(), hid)?,
        in_b: b.linear(&format!("{l}.in_proj_b"), hv, hid)?,
        in_a: b.linear(&format!("{l}.in_proj_a"), hv, hid)?,
        // [C,1,K] and [C,K,1] share one memory order: channel-major, K taps each.
        conv: conv.to_f32().with_context(|| format!("tensor `{conv_name}`"))?,
        dt_bias: b.vector(&format!("{l}.dt_bias"), hv)?,
        neg_a: a_log.iter().map(|a| -a.exp()).collect(),
        norm: b.vector(&format!("{l}.norm.weight"), cfg.linear_value_head_dim)?,
        out: b.linear(&format!("{l}.out_proj"), hid, cfg.gdn_value_dim())?,
    })
}

/// HF layout (zero-centred norms) iff the GDN conv weights are `[C, 1, K]`.
fn is_hf_layout(cfg: &ModelConfig, ck: &Checkpoint) -> Result<bool> {
    let Some(i) = cfg.layer_kinds.iter().position(|k| *k == LayerKind::Gdn) else {
        // No GDN layer to tell by: quantized checkpoints come from mlx_lm.convert.
        return Ok(cfg.quantization.is_none());
    };
    let name = format!("model.layers.{i}.linear_attn.conv1d.weight");
    let t = ck.get(&name)?;
    let k = cfg.linear_conv_kernel_dim;
    Ok(match t.shape.as_slice() {
        [_, 1, kk] if *kk == k => true,
        [_, kk, 1] if *kk == k => false,
        _ => bail!("tensor `{name}` has shape {:?}, expected [C, 1, {k}] (HF) or [C, {k}, 1] (MLX)", t.shape),
    })
}

fn canonical_quant(q: &QuantConfig) -> QuantConfig {
    let overrides = q.overrides.iter().filter_map(|(k, v)| canonical_name(k).map(|c| (c, *v))).collect();
    QuantConfig { bits: q.bits, group_size: q.group_size, overrides }
}
