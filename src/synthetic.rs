//! Random-weight models of the real architecture, built in memory (no download, no file):
//! `synthetic:tiny`, `synthetic:qwen3.6-35b-a3b` (full size, MLX 4-bit layout with group 64,
//! router and shared-expert gate at 8 bits, 4-bit embedding and lm_head, as mlx-community ships)
//! and `synthetic:dense-small` (a dense `qwen3_5` of ~0.6B parameters in the same layout: the
//! family's layer pattern at a small width, not the dimensions of a released checkpoint).

use crate::config::{FfnKind, LayerKind, ModelConfig};
use crate::cpu::rope::Rope;
use crate::linear::{FloatType, Linear};
use crate::model::{Attention, Ffn, Gdn, Layer, Mixer, Mlp, Model, Moe};
use crate::progress::Progress;
use crate::safetensors::{f32_to_bf16, Bytes};
use anyhow::{bail, Result};
use rayon::prelude::*;
use serde_json::json;

pub const NAMES: [&str; 4] = ["tiny", "qwen3.6-35b-a3b", "dense-small", "dense-small-bf16"];

/// The config of a synthetic model; `layers` overrides the depth (keeping the 3:1 GDN/attention
/// pattern), `vocab` the vocabulary (to match an available tokenizer).
pub fn config(name: &str, layers: Option<usize>, vocab: usize) -> Result<ModelConfig> {
    let mut c = match name {
        "qwen3.6-35b-a3b" => json!({
            "model_type": "qwen3_5_moe",
            "text_config": {
                "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
                "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
                "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "eos_token_id": 248046,
                "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
            },
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}
        }),
        "tiny" => json!({
            "model_type": "qwen3_5_moe",
            "text_config": {
                "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": 4, "full_attention_interval": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 16,
                "num_experts_per_tok": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "eos_token_id": 248046,
                "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
            },
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}
        }),
        "dense-small" | "dense-small-bf16" => json!({
            "model_type": "qwen3_5",
            "text_config": {
                "vocab_size": 248320, "hidden_size": 1024, "num_hidden_layers": 16, "full_attention_interval": 4,
                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 3584,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "eos_token_id": 248046,
                "tie_word_embeddings": false,
                "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
            },
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}
        }),
        other => bail!("unknown synthetic model `{other}` (available: {})", NAMES.join(", ")),
    };
    if name.ends_with("-bf16") {
        c.as_object_mut().expect("an object").remove("quantization");
    }
    if let Some(n) = layers {
        if n == 0 {
            bail!("--layers must be at least 1");
        }
        c["text_config"]["num_hidden_layers"] = json!(n);
    }
    ModelConfig::from_json(&c)
}

struct Gen {
    seed: u64,
    bits: u32,
    group: usize,
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        let mut s = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
        for w in c.chunks_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let b = s.to_le_bytes();
            w.copy_from_slice(&b[..w.len()]);
        }
    });
    v
}

impl Gen {
    /// A quantized `[rows, cols]` matrix with uniform codes and entries of standard deviation
    /// about `std` (scale s, bias −s·(2^bits−1)/2, so W is uniform on ±s·(2^bits−1)/2).
    fn linear(&mut self, rows: usize, cols: usize, bits: u32, std: f32) -> Linear {
        self.seed = self.seed.wrapping_add(0x2545_f491_4f6c_dd1d);
        if bits == 16 {
            // Dense bf16 (the HF layout): uniform on ±std·√3.
            let a = std * 3f32.sqrt();
            let mut data = random_bytes(rows * cols * 2, self.seed);
            data.par_chunks_mut(2).for_each(|b| {
                let u = u16::from_le_bytes([b[0], b[1]]) as f32 / 65535.0;
                b.copy_from_slice(&f32_to_bf16((2.0 * u - 1.0) * a).to_le_bytes());
            });
            return Linear::dense(rows, cols, FloatType::BF16, Bytes::from_vec(data)).expect("synthetic shapes");
        }
        let group = self.group;
        let packed = random_bytes(rows * cols * bits as usize / 8, self.seed);
        let levels = ((1u32 << bits) - 1) as f32;
        let s = std * 12f32.sqrt() / levels;
        let ng = rows * cols / group;
        let sb = f32_to_bf16(s).to_le_bytes();
        let bb = f32_to_bf16(-s * levels / 2.0).to_le_bytes();
        let scales: Vec<u8> = (0..ng).flat_map(|_| sb).collect();
        let biases: Vec<u8> = (0..ng).flat_map(|_| bb).collect();
        Linear::quant(
            rows,
            cols,
            bits,
            group,
            Bytes::from_vec(packed),
            Bytes::from_vec(scales),
            Bytes::from_vec(biases),
            FloatType::BF16,
        )
        .expect("synthetic shapes are consistent")
    }

    fn mat(&mut self, rows: usize, cols: usize) -> Linear {
        let bits = self.bits;
        self.linear(rows, cols, bits, 1.0 / (cols as f32).sqrt())
    }

    fn mlp(&mut self, inter: usize, hid: usize) -> Mlp {
        Mlp { gate: self.mat(inter, hid), up: self.mat(inter, hid), down: self.mat(hid, inter) }
    }
}

/// Builds a synthetic model (weights generated in parallel, deterministic for a given name).
pub fn build(name: &str, layers: Option<usize>, vocab: usize) -> Result<Model> {
    build_config(config(name, layers, vocab)?)
}

/// Builds a model of random weights for any config (tests that need other head shapes than the
/// named ones); deterministic for a given config.
pub fn build_config(cfg: ModelConfig) -> Result<Model> {
    let (hid, hv) = (cfg.hidden_size, cfg.linear_num_value_heads);
    let bits = if cfg.quantization.is_none() { 16 } else { 4 };
    let bits8 = if bits == 16 { 16 } else { 8 };
    let mut g = Gen { seed: 0x1111, bits, group: 64 };
    let embed = g.linear(cfg.vocab_size, hid, bits, 1.0);
    let lm_head = g.mat(cfg.vocab_size, hid);
    let mut progress = Progress::new("building synthetic weights", cfg.num_hidden_layers);
    let mut out_layers = Vec::new();
    for (i, kind) in cfg.layer_kinds.iter().enumerate() {
        let mixer = match kind {
            LayerKind::Gdn => Mixer::Gdn(Gdn {
                in_qkv: g.mat(cfg.gdn_conv_dim(), hid),
                in_z: g.mat(cfg.gdn_value_dim(), hid),
                in_b: g.mat(hv, hid),
                in_a: g.mat(hv, hid),
                conv: (0..cfg.gdn_conv_dim() * cfg.linear_conv_kernel_dim)
                    .map(|j| 0.5 * (((j * 7919 + i) % 97) as f32 / 97.0 - 0.3))
                    .collect(),
                dt_bias: (0..hv).map(|j| 0.5 + 0.1 * (j % 5) as f32).collect(),
                neg_a: (0..hv).map(|j| -(1.0 + (j % 16) as f32).ln().exp() * 0.5).collect(),
                norm: vec![1.0; cfg.linear_value_head_dim],
                out: g.mat(hid, cfg.gdn_value_dim()),
            }),
            LayerKind::Attention => Mixer::Attention(Attention {
                q: g.mat(cfg.q_proj_dim(), hid),
                k: g.mat(cfg.kv_dim(), hid),
                v: g.mat(cfg.kv_dim(), hid),
                o: g.mat(hid, cfg.attn_dim()),
                q_norm: vec![1.0; cfg.head_dim],
                k_norm: vec![1.0; cfg.head_dim],
            }),
        };
        let ffn = match cfg.ffn {
            FfnKind::Moe => {
                let (e, inter) = (cfg.num_experts, cfg.moe_intermediate_size);
                let gate = g.mat(e * inter, hid);
                let up = g.mat(e * inter, hid);
                let down = g.mat(e * hid, inter);
                let experts = (0..e)
                    .map(|x| Mlp {
                        gate: gate.row_range(x * inter, inter),
                        up: up.row_range(x * inter, inter),
                        down: down.row_range(x * hid, hid),
                    })
                    .collect();
                Ffn::Moe(Moe {
                    router: g.linear(e, hid, bits8, 4.0 / (hid as f32).sqrt()),
                    experts,
                    shared: g.mlp(cfg.shared_expert_intermediate_size, hid),
                    shared_gate: g.linear(1, hid, bits8, 1.0 / (hid as f32).sqrt()),
                })
            }
            FfnKind::Dense => Ffn::Dense(g.mlp(cfg.intermediate_size, hid)),
        };
        out_layers.push(Layer { input_norm: vec![1.0; hid], post_norm: vec![1.0; hid], mixer, ffn });
        progress.tick();
    }
    progress.finish();
    let rope = Rope::new(cfg.rotary_dim, cfg.rope_theta);
    Ok(Model { norm: vec![1.0; hid], embed, lm_head, layers: out_layers, rope, cfg })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_small_is_a_dense_qwen3_5_with_the_family_pattern() {
        let c = config("dense-small", None, 248320).unwrap();
        assert_eq!(c.ffn, FfnKind::Dense);
        assert_eq!((c.hidden_size, c.num_hidden_layers, c.intermediate_size), (1024, 16, 3584));
        let attn: Vec<usize> =
            c.layer_kinds.iter().enumerate().filter(|(_, k)| **k == LayerKind::Attention).map(|(i, _)| i).collect();
        assert_eq!(attn, vec![3, 7, 11, 15]);
        // Two layers build and run through the real model type (weights generated, not loaded).
        let m = build("dense-small", Some(2), 512).unwrap();
        assert_eq!(m.layers.len(), 2);
        assert!(matches!(m.layers[0].ffn, Ffn::Dense(_)));
    }
}
