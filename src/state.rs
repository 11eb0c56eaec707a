//! Per-sequence caches: KV for full-attention layers, conv + recurrent state for GDN layers.

use crate::config::{LayerKind, ModelConfig};

#[derive(Clone)]
pub enum LayerState {
    /// `conv: [K−1, C]` raw inputs; `rec: [H_v, D_k, D_v]` fp32.
    Gdn { conv: Vec<f32>, rec: Vec<f32> },
    /// `k, v: [L, H_kv, D]` (k after norm and RoPE).
    Attention { k: Vec<f32>, v: Vec<f32> },
}

#[derive(Clone)]
pub struct State {
    /// Tokens processed so far (the position of the next token).
    pub pos: usize,
    pub layers: Vec<LayerState>,
}

impl State {
    pub fn new(cfg: &ModelConfig) -> State {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Gdn => LayerState::Gdn {
                    conv: vec![0.0; (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim()],
                    rec: vec![0.0; cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim],
                },
                LayerKind::Attention => LayerState::Attention { k: Vec::new(), v: Vec::new() },
            })
            .collect();
        State { pos: 0, layers }
    }

    /// Bytes held by this state.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn { conv, rec } => 4 * (conv.len() + rec.len()),
                LayerState::Attention { k, v } => 4 * (k.len() + v.len()),
            })
            .sum()
    }
}
