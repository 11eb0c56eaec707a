//! A layer's projections that read the same input (GDN in-projections, q/k/v, the router with
//! the shared-expert gate, an MLP's gate and up), written side by side into one output buffer.

use crate::cuda::ops::{GemvRole, GpuLinear, Precision};
use crate::cuda::Gpu;
use anyhow::Result;
use std::sync::Arc;

/// Several projections of the same input written side by side into one output buffer: one
/// GEMV over the concatenated rows when the formats allow, else one GEMV per part.
pub(super) struct Proj {
    pub(super) fused: Option<GpuLinear>,
    pub(super) parts: Vec<GpuLinear>,
    /// Output offset (f32 elements) of each part.
    pub(super) offs: Vec<usize>,
}

impl Proj {
    pub(super) fn new(g: &Arc<Gpu>, parts: &[&crate::linear::Linear]) -> Result<Proj> {
        let mut offs = Vec::new();
        let mut o = 0;
        for p in parts {
            offs.push(o);
            o += p.rows;
        }
        Ok(match GpuLinear::concat(g, parts)? {
            Some(f) => Proj { fused: Some(f), parts: Vec::new(), offs },
            None => {
                Proj { fused: None, parts: parts.iter().map(|p| GpuLinear::upload(g, p)).collect::<Result<_>>()?, offs }
            }
        })
    }

    /// One token: `out = W · rms_norm(x)` (the norm `(weights, eps)` fused into the GEMV).
    /// (norm weights 0: x is used as it is).
    pub(super) fn run(&self, g: &Gpu, x: u64, norm: (u64, f32), out: u64) -> Result<()> {
        self.run_as(g, None, x, norm, out)
    }

    /// [`Proj::run`] through the kernel [`crate::cuda::ops::gemv_for`] picks for `role` (None: the default).
    pub(super) fn run_as(&self, g: &Gpu, role: Option<GemvRole>, x: u64, norm: (u64, f32), out: u64) -> Result<()> {
        let one = |w: &GpuLinear, out: u64| match (role, norm.0) {
            (Some(r), _) => g.gemv_as(r, w, x, out, false, norm),
            (None, 0) => g.gemv(w, x, 0, out, 1, 0, false),
            (None, _) => g.gemv_norm(w, x, norm, out, 1, 0, false),
        };
        match &self.fused {
            Some(f) => one(f, out),
            None => {
                for (p, o) in self.parts.iter().zip(&self.offs) {
                    one(p, out + 4 * *o as u64)?;
                }
                Ok(())
            }
        }
    }

    /// The same for `m` rows: `x` rows of stride `ldx`, output rows of stride `ldo`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_rows(
        &self,
        g: &Gpu,
        prec: Precision,
        x: u64,
        ldx: usize,
        out: u64,
        ldo: usize,
        m: usize,
    ) -> Result<()> {
        match &self.fused {
            Some(f) => g.gemm(f, prec, x, ldx, out, ldo, m, false),
            None => {
                for (p, o) in self.parts.iter().zip(&self.offs) {
                    g.gemm(p, prec, x, ldx, out + 4 * *o as u64, ldo, m, false)?;
                }
                Ok(())
            }
        }
    }

    pub(super) fn nbytes(&self) -> usize {
        self.fused.as_ref().map_or(0, |f| f.nbytes()) + self.parts.iter().map(|p| p.nbytes()).sum::<usize>()
    }
}
