//! The session's caches to and from a CPU [`State`] (snapshots, the prefix cache): the same
//! layouts, with a bf16 KV cache widened exactly on the way out and rounded to nearest even on
//! the way in; an fp8 cache decoded exactly (value times its row's scale) and encoded as
//! attn_prep_fp8 does, so a snapshot round-trips to the same values.

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
                    let heads = (c.num_key_value_heads, c.head_dim);
                    *k = KvRows::from_rows(c.kv_dim(), &read_kv(gk, self.pos, self.kv, heads)?);
                    *v = KvRows::from_rows(c.kv_dim(), &read_kv(gv, self.pos, self.kv, heads)?);
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
                    let heads = (c.num_key_value_heads, c.head_dim);
                    write_kv(gk, &k.to_vec(), self.kv, heads)?;
                    write_kv(gv, &v.to_vec(), self.kv, heads)?;
                }
                _ => bail!("snapshot is from a different model"),
            }
        }
        self.pos = st.pos;
        Ok(())
    }
}

/// The first `npos` positions of a cache of `(hkv, hd)` heads as f32 rows of hkv·hd (bf16 and
/// fp8 widened exactly).
fn read_kv(b: &PagedBuf, npos: usize, kv: KvDtype, (hkv, hd): (usize, usize)) -> Result<Vec<f32>> {
    let bytes = b.read(npos * kv.pos_bytes(hkv, hd))?;
    Ok(match kv {
        KvDtype::F32 => bytes.chunks_exact(4).map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect(),
        KvDtype::Bf16 => {
            bytes.chunks_exact(2).map(|h| f32::from_bits((u16::from_le_bytes([h[0], h[1]]) as u32) << 16)).collect()
        }
        KvDtype::Fp8 => crate::cuda::kv_fp8::decode_rows(&bytes, hkv, hd),
    })
}

/// Writes f32 cache rows of `(hkv, hd)` heads (rounded to nearest even for a bf16 cache, encoded
/// per row for an fp8 one), mapping their pages.
fn write_kv(b: &mut PagedBuf, data: &[f32], kv: KvDtype, (hkv, hd): (usize, usize)) -> Result<()> {
    let bytes: Vec<u8> = match kv {
        KvDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        KvDtype::Bf16 => data.iter().flat_map(|&x| crate::safetensors::f32_to_bf16(x).to_le_bytes()).collect(),
        KvDtype::Fp8 => crate::cuda::kv_fp8::encode_rows(data, hkv, hd),
    };
    b.write(&bytes)
}
