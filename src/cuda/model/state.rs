//! The session's caches to and from a CPU [`State`] (snapshots, the prefix cache): the same
//! layouts, with a bf16 KV cache widened exactly on the way out and rounded to nearest even on
//! the way in.

use super::{CudaSession, GState};
use crate::cuda::ops::KvDtype;
use crate::cuda::PagedBuf;
use crate::state::{KvRows, LayerState, State};
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
                    *k = KvRows::from_rows(c.kv_dim(), &read_kv(gk, n, self.kv)?);
                    *v = KvRows::from_rows(c.kv_dim(), &read_kv(gv, n, self.kv)?);
                }
                _ => bail!("state kinds differ"),
            }
        }
        Ok(st)
    }

    pub(super) fn load_state(&mut self, st: &State) -> Result<()> {
        self.ensure()?;
        let c = self.model.cfg.clone();
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
                (LayerState::Attention { k, v }, GState::Attn { k: gk, v: gv }) => {
                    if k.len() != v.len() || k.width() != c.kv_dim() || v.width() != c.kv_dim() {
                        bail!("snapshot is from a different model");
                    }
                    // Exactly the snapshot's pages: a longer cache left from before goes back.
                    gk.release()?;
                    gv.release()?;
                    write_kv(gk, &k.to_vec(), self.kv)?;
                    write_kv(gv, &v.to_vec(), self.kv)?;
                }
                _ => bail!("snapshot is from a different model"),
            }
        }
        self.pos = st.pos;
        Ok(())
    }
}

/// The first `n` cache elements as f32 (a bf16 cache widened exactly).
fn read_kv(b: &PagedBuf, n: usize, kv: KvDtype) -> Result<Vec<f32>> {
    let bytes = b.read(n * kv.bytes())?;
    Ok(match kv {
        KvDtype::F32 => bytes.chunks_exact(4).map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect(),
        KvDtype::Bf16 => {
            bytes.chunks_exact(2).map(|h| f32::from_bits((u16::from_le_bytes([h[0], h[1]]) as u32) << 16)).collect()
        }
    })
}

/// Writes f32 cache rows (rounded to nearest even for a bf16 cache), mapping their pages.
fn write_kv(b: &mut PagedBuf, data: &[f32], kv: KvDtype) -> Result<()> {
    let bytes: Vec<u8> = match kv {
        KvDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        KvDtype::Bf16 => data.iter().flat_map(|&x| crate::safetensors::f32_to_bf16(x).to_le_bytes()).collect(),
    };
    b.write(&bytes)
}
