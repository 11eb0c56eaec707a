//! The middle of an attention layer's decode step (between its input and output projections),
//! shared by the graph of per-op kernels and the persistent step.

use super::{attn_prep_args, CudaSession, GMixer, GState};
use crate::cuda::ops::{self, AttnDecode, AttnKernel, AttnPrep, KvDtype};
use anyhow::{bail, Context, Result};

impl CudaSession {
    /// Attention layer `li` between its input and output projections (the projections are in
    /// `proj`): q/k norms, RoPE and the cache write, then decode attention (gated) into `o`.
    pub(super) fn attn_mid(&self, li: usize, long: bool) -> Result<()> {
        let m = &self.model;
        let (g, c) = (&m.gpu, &m.cfg);
        let s = self.scratch.as_ref().context("session scratch")?;
        let (GMixer::Attn { q_norm, k_norm, .. }, GState::Attn { k: kc, v: vc, .. }) =
            (&m.layers[li].mixer, &self.states[li])
        else {
            bail!("layer {li} is not an attention layer");
        };
        let pos_p = s.io.at(4);
        let prep = AttnPrep {
            early: self.prep_early,
            ..attn_prep_args(c, s.proj.ptr, [q_norm, k_norm], s.q.ptr, [kc, vc], pos_p, self.kv)
        };
        let (kernel, splits) = self.attn[long as usize];
        g.attn_prep(&prep, 1, 0)?;
        let a = AttnDecode {
            q: s.q.ptr,
            kc: kc.ptr,
            vc: vc.ptr,
            qg: s.proj.ptr,
            out: s.o.ptr,
            nh: c.num_attention_heads,
            hkv: c.num_key_value_heads,
            hd: c.head_dim,
            pos: pos_p,
            gated: c.attn_output_gate,
            part: s.part.ptr,
            splits,
            kv: self.kv,
            early: self.attn_early,
        };
        // the splits merged inside the decode launch (the default; LILY_CUDA_COMBINE=ds: not)
        if kernel == AttnKernel::Tc
            && self.kv == KvDtype::Bf16
            && ops::attn_fold()
            && g.attn_fold_applies(a.nh, a.hkv, a.hd, splits)
        {
            return g.attn_decode_fold(&a, s.sync_attn.ptr);
        }
        g.attn_decode(&a, kernel)
    }
}
