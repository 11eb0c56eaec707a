//! The session's caches to and from a CPU [`State`] (snapshots, the prefix cache): the same
//! layouts, with a bf16 KV cache widened exactly on the way out and rounded to nearest even on
//! the way in.

use super::{CudaSession, GState};
use crate::cuda::ops::KvDtype;
use crate::cuda::DevBuf;
use crate::state::{LayerState, State};
use anyhow::{bail, Result};

impl CudaSession {
    /// The session's caches as a CPU [`State`] (same layouts).
    pub fn to_state(&self) -> Result<State> {
        let c = &self.model.cfg;
        let mut st = State::new(c);
        st.pos = self.pos;
        for (l, g) in st.layers.iter_mut().zip(&self.states) {
            match (l, g) {
                (LayerState::Gdn { conv, rec }, GState::Gdn { conv: gc, rec: gr }) => {
                    *conv = gc.read_f32(0, conv.len())?;
                    *rec = gr.read_f32(0, rec.len())?;
                }
                (LayerState::Attention { k, v }, GState::Attn { k: gk, v: gv, .. }) => {
                    let n = self.pos * c.kv_dim();
                    *k = read_kv(gk, n, self.kv)?;
                    *v = read_kv(gv, n, self.kv)?;
                }
                _ => bail!("state kinds differ"),
            }
        }
        Ok(st)
    }

    pub(super) fn load_state(&mut self, st: &State) -> Result<()> {
        self.ensure()?;
        let c = self.model.cfg.clone();
        let g = self.model.gpu.clone();
        if st.layers.len() != self.states.len() {
            bail!("snapshot is from a different model");
        }
        for (l, gs) in st.layers.iter().zip(self.states.iter_mut()) {
            match (l, gs) {
                (LayerState::Gdn { conv, rec }, GState::Gdn { conv: gc, rec: gr }) => {
                    if 4 * conv.len() != gc.bytes || 4 * rec.len() != gr.bytes {
                        bail!("snapshot is from a different model");
                    }
                    gc.write_f32(0, conv)?;
                    gr.write_f32(0, rec)?;
                }
                (LayerState::Attention { k, v }, GState::Attn { k: gk, v: gv, cap }) => {
                    let need = k.len() / c.kv_dim().max(1);
                    if need > *cap {
                        let ncap = need.next_power_of_two().max(256);
                        *gk = g.zeros(ncap * c.kv_dim() * self.kv.bytes())?;
                        *gv = g.zeros(ncap * c.kv_dim() * self.kv.bytes())?;
                        *cap = ncap;
                        self.graphs = Default::default();
                    }
                    write_kv(gk, k, self.kv)?;
                    write_kv(gv, v, self.kv)?;
                }
                _ => bail!("snapshot is from a different model"),
            }
        }
        self.pos = st.pos;
        Ok(())
    }
}

/// The first `n` cache elements as f32 (a bf16 cache widened exactly).
fn read_kv(b: &DevBuf, n: usize, kv: KvDtype) -> Result<Vec<f32>> {
    match kv {
        KvDtype::F32 => b.read_f32(0, n),
        KvDtype::Bf16 => {
            // Two bf16 per f32 word: read the words, then split them.
            let words = b.read_f32(0, n.div_ceil(2))?;
            let mut out = Vec::with_capacity(n);
            for w in words {
                let u = w.to_bits();
                out.push(f32::from_bits(u << 16));
                out.push(f32::from_bits(u & 0xffff_0000));
            }
            out.truncate(n);
            Ok(out)
        }
    }
}

/// Writes f32 cache rows (rounded to nearest even for a bf16 cache).
fn write_kv(b: &DevBuf, data: &[f32], kv: KvDtype) -> Result<()> {
    match kv {
        KvDtype::F32 => b.write_f32(0, data),
        KvDtype::Bf16 => {
            let bytes: Vec<u8> = data.iter().flat_map(|&x| crate::safetensors::f32_to_bf16(x).to_le_bytes()).collect();
            b.write_bytes(0, &bytes)
        }
    }
}
