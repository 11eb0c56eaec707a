//! One typed wrapper per kernel of `kernels/*.cu`: argument order, launch geometry and the
//! shape checks the kernels rely on. Pointers are device addresses (`DevBuf::at`).

use super::{Arg, DevBuf, Gpu};
use crate::linear::{FloatType, Linear, Weight};
use anyhow::{bail, Result};
use std::sync::Arc;

fn ty_code(t: FloatType) -> i32 {
    match t {
        FloatType::F32 => 0,
        FloatType::F16 => 1,
        FloatType::BF16 => 2,
    }
}

/// A weight matrix in device memory, in its checkpoint format. `rows` is the height of one
/// matrix; a stack of `count` equal matrices (MoE experts) lies back to back.
pub struct GpuLinear {
    pub rows: usize,
    pub cols: usize,
    pub count: usize,
    /// 0 = dense, else 4 or 8.
    pub bits: i32,
    pub group: i32,
    /// Element type of dense weights, or of scales and biases.
    pub ty: i32,
    pub w: DevBuf,
    pub s: Option<DevBuf>,
    pub b: Option<DevBuf>,
}

impl GpuLinear {
    pub fn upload(gpu: &Arc<Gpu>, l: &Linear) -> Result<GpuLinear> {
        Self::stack(gpu, &[l])
    }

    /// Uploads equal-format matrices back to back (expert e's rows start at `e · rows`).
    pub fn stack(gpu: &Arc<Gpu>, parts: &[&Linear]) -> Result<GpuLinear> {
        if parts.iter().any(|p| p.rows != parts[0].rows) {
            bail!("stacked matrices differ in shape");
        }
        Self::join(gpu, parts, true)
    }

    /// One matrix whose rows are those of `parts` in order (one GEMV instead of several), or None
    /// when the parts differ in width or format.
    pub fn concat(gpu: &Arc<Gpu>, parts: &[&Linear]) -> Result<Option<GpuLinear>> {
        let f = |l: &Linear| match &l.w {
            Weight::Dense { ty, .. } => (0, 0, ty_code(*ty)),
            Weight::Quant { bits, group, sty, .. } => (*bits, *group, ty_code(*sty)),
        };
        if parts.iter().any(|p| p.cols != parts[0].cols || f(p) != f(parts[0])) {
            return Ok(None);
        }
        Self::join(gpu, parts, false).map(Some)
    }

    fn join(gpu: &Arc<Gpu>, parts: &[&Linear], stacked: bool) -> Result<GpuLinear> {
        let first = parts[0];
        let cols = first.cols;
        let total_rows: usize = parts.iter().map(|p| p.rows).sum();
        let (rows, count) = if stacked { (first.rows, parts.len()) } else { (total_rows, 1) };
        if parts.iter().any(|p| p.cols != cols) {
            bail!("joined matrices differ in width");
        }
        match &first.w {
            Weight::Dense { ty, .. } => {
                let w = gpu.alloc(total_rows * cols * ty.size())?;
                let mut off = 0;
                for p in parts {
                    match &p.w {
                        Weight::Dense { ty: t2, data } if t2 == ty => {
                            w.write_bytes(off, data.as_slice())?;
                            off += data.len();
                        }
                        _ => bail!("joined matrices differ in format"),
                    }
                }
                Ok(GpuLinear { rows, cols, count, bits: 0, group: 0, ty: ty_code(*ty), w, s: None, b: None })
            }
            Weight::Quant { bits, group, sty, .. } => {
                if !cols.is_multiple_of(32) {
                    bail!("quantized width {cols} is not a multiple of 32");
                }
                let pb = total_rows * cols * *bits as usize / 8;
                let sb = total_rows * (cols / group) * sty.size();
                let (w, s, b) = (gpu.alloc(pb)?, gpu.alloc(sb)?, gpu.alloc(sb)?);
                let (mut po, mut so) = (0, 0);
                for p in parts {
                    match &p.w {
                        Weight::Quant { bits: b2, group: g2, sty: t2, packed, scales, biases }
                            if b2 == bits && g2 == group && t2 == sty =>
                        {
                            w.write_bytes(po, packed.as_slice())?;
                            s.write_bytes(so, scales.as_slice())?;
                            b.write_bytes(so, biases.as_slice())?;
                            po += packed.len();
                            so += scales.len();
                        }
                        _ => bail!("joined matrices differ in format"),
                    }
                }
                Ok(GpuLinear {
                    rows,
                    cols,
                    count,
                    bits: *bits as i32,
                    group: *group as i32,
                    ty: ty_code(*sty),
                    w,
                    s: Some(s),
                    b: Some(b),
                })
            }
        }
    }

    pub fn nbytes(&self) -> usize {
        self.w.bytes + self.s.as_ref().map_or(0, |s| s.bytes) + self.b.as_ref().map_or(0, |b| b.bytes)
    }

    fn wargs(&self) -> [Arg; 6] {
        [
            Arg::P(self.w.ptr),
            Arg::P(self.s.as_ref().map_or(0, |s| s.ptr)),
            Arg::P(self.b.as_ref().map_or(0, |b| b.ptr)),
            Arg::I(self.bits),
            Arg::I(self.group),
            Arg::I(self.ty),
        ]
    }
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

impl Gpu {
    /// `y[r, :] = rms_norm(x[r, :]) · w` for `rows` rows of width `d` (y may equal x).
    pub fn rms_norm(&self, x: u64, w: u64, y: u64, rows: usize, d: usize, eps: f32) -> Result<()> {
        self.launch(
            "rms_norm",
            (rows as u32, 1, 1),
            256,
            &[Arg::P(x), Arg::P(w), Arg::P(y), Arg::I(d as i32), Arg::F(eps)],
        )
    }

    /// `h = silu(g) ⊙ u` over n elements.
    pub fn silu_mul(&self, g: u64, u: u64, h: u64, n: usize) -> Result<()> {
        self.launch("silu_mul", (blocks(n, 256), 1, 1), 256, &[Arg::P(g), Arg::P(u), Arg::P(h), Arg::I(n as i32)])
    }

    /// `h[k, i] = silu(gu[2k, i]) · gu[2k+1, i]` for k < pairs, i < n (gate/up pairs side by side).
    pub fn silu_mul_pairs(&self, gu: u64, h: u64, n: usize, pairs: usize) -> Result<()> {
        self.launch(
            "silu_mul_pairs",
            (blocks(n * pairs, 256), 1, 1),
            256,
            &[Arg::P(gu), Arg::P(h), Arg::I(n as i32), Arg::I(pairs as i32)],
        )
    }

    /// `x += y` over n elements.
    pub fn add(&self, x: u64, y: u64, n: usize) -> Result<()> {
        self.launch("add_inplace", (blocks(n, 256), 1, 1), 256, &[Arg::P(x), Arg::P(y), Arg::I(n as i32)])
    }

    /// Matrix-vector products for `slots` vectors: slot z uses matrix `ids[z]` of the stack (ids:
    /// device i32 array, or 0 for matrix 0), input `x + z·xstride` (f32 elements), output
    /// `y + z·rows`; `accumulate` adds into y.
    pub fn gemv(
        &self,
        w: &GpuLinear,
        x: u64,
        xstride: usize,
        y: u64,
        slots: usize,
        ids: u64,
        accumulate: bool,
    ) -> Result<()> {
        let mut a = w.wargs().to_vec();
        a.extend([
            Arg::P(x),
            Arg::L(xstride as i64),
            Arg::P(y),
            Arg::I(w.rows as i32),
            Arg::I(w.cols as i32),
            Arg::P(ids),
            Arg::I(accumulate as i32),
        ]);
        self.launch("linear_gemv", (blocks(w.rows, 32), slots as u32, 1), 256, &a)
    }

    /// `y[t, :] (+)= W x[t, :]` for t tokens (matrix 0 of the stack).
    pub fn gemm(&self, w: &GpuLinear, x: u64, y: u64, t: usize, accumulate: bool) -> Result<()> {
        let mut a = w.wargs().to_vec();
        a.extend([
            Arg::P(x),
            Arg::P(y),
            Arg::I(w.rows as i32),
            Arg::I(w.cols as i32),
            Arg::I(t as i32),
            Arg::I(accumulate as i32),
        ]);
        self.launch("linear_gemm", (blocks(w.rows, 8), blocks(t, 8), 1), 256, &a)
    }

    /// `out = W[row, :]` dequantized to f32, `row` read from the device i32 at `row_p`.
    pub fn embed(&self, w: &GpuLinear, row_p: u64, out: u64) -> Result<()> {
        let mut a = w.wargs().to_vec();
        a.extend([Arg::P(row_p), Arg::I(w.cols as i32), Arg::P(out)]);
        self.launch("embed_row", (blocks(w.cols, 256), 1, 1), 256, &a)
    }

    /// One token of the causal conv1d + SiLU over C channels with K taps.
    pub fn conv_step(&self, x: u64, state: u64, w: u64, y: u64, c: usize, k: usize) -> Result<()> {
        self.launch(
            "conv_step",
            (blocks(c, 256), 1, 1),
            256,
            &[Arg::P(x), Arg::P(state), Arg::P(w), Arg::P(y), Arg::I(c as i32), Arg::I(k as i32)],
        )
    }

    /// One gated-delta-rule step for every value head, with the gated RMSNorm.
    pub fn gdn_step(&self, p: &GdnStep) -> Result<()> {
        if !p.dv.is_multiple_of(32) || p.dv > 1024 || p.dk > 256 || !p.hv.is_multiple_of(p.hk) {
            bail!("gdn_step: unsupported head dims (D_v {} D_k {})", p.dv, p.dk);
        }
        self.launch(
            "gdn_step",
            (p.hv as u32, 1, 1),
            p.dv as u32,
            &[
                Arg::P(p.y),
                Arg::P(p.b),
                Arg::P(p.a),
                Arg::P(p.z),
                Arg::P(p.dt_bias),
                Arg::P(p.neg_a),
                Arg::P(p.norm),
                Arg::P(p.state),
                Arg::P(p.out),
                Arg::I(p.hk as i32),
                Arg::I(p.hv as i32),
                Arg::I(p.dk as i32),
                Arg::I(p.dv as i32),
                Arg::F(p.eps),
            ],
        )
    }

    /// q/k RMSNorm + partial RoPE for one token; writes q and the cache row `pos`.
    pub fn attn_prep(&self, p: &AttnPrep) -> Result<()> {
        if !p.hd.is_multiple_of(32) || p.hd > 256 || p.rot > p.hd {
            bail!("attention: head dim {} unsupported (multiple of 32, at most 256)", p.hd);
        }
        self.launch(
            "attn_prep",
            ((p.nh + p.hkv) as u32, 1, 1),
            p.hd as u32,
            &[
                Arg::P(p.qg),
                Arg::P(p.k),
                Arg::P(p.v),
                Arg::P(p.q_norm),
                Arg::P(p.k_norm),
                Arg::P(p.q_out),
                Arg::P(p.kc),
                Arg::P(p.vc),
                Arg::I(p.nh as i32),
                Arg::I(p.hkv as i32),
                Arg::I(p.hd as i32),
                Arg::I(p.gated as i32),
                Arg::I(p.rot as i32),
                Arg::P(p.pos),
                Arg::D(p.theta),
                Arg::F(p.eps),
            ],
        )
    }

    /// Attention of one query token over `pos + 1` cached positions (`pos`: device i32), split
    /// over `splits` blocks per head (partials in `part`: `[H_q, splits, D + 2]` f32), merged by
    /// a second kernel that also applies the output gate.
    pub fn attn_decode(
        &self,
        q: u64,
        kc: u64,
        vc: u64,
        qg: u64,
        out: u64,
        dims: (usize, usize, usize),
        pos: u64,
        gated: bool,
        part: u64,
        splits: usize,
    ) -> Result<()> {
        let (nh, hkv, hd) = dims;
        let scale = 1.0 / (hd as f32).sqrt();
        self.launch(
            "attn_decode",
            (nh as u32, splits as u32, 1),
            256,
            &[
                Arg::P(q),
                Arg::P(kc),
                Arg::P(vc),
                Arg::P(part),
                Arg::I(nh as i32),
                Arg::I(hkv as i32),
                Arg::I(hd as i32),
                Arg::P(pos),
                Arg::F(scale),
            ],
        )?;
        self.launch(
            "attn_combine",
            (nh as u32, 1, 1),
            256,
            &[
                Arg::P(part),
                Arg::P(qg),
                Arg::P(out),
                Arg::I(nh as i32),
                Arg::I(hd as i32),
                Arg::I(splits as i32),
                Arg::I(gated as i32),
            ],
        )
    }

    /// Softmax + top-k of E router logits into device ids (i32) and weights (f32); when `ids2` is
    /// not 0 it also gets `[2·id, 2·id + 1]` per choice (rows of an interleaved gate/up stack).
    pub fn moe_topk(&self, logits: u64, e: usize, k: usize, renorm: bool, ids: u64, w: u64, ids2: u64) -> Result<()> {
        if e > 1024 || k > 64 || k > e {
            bail!("moe_topk: {e} experts / top-{k} unsupported");
        }
        self.launch(
            "moe_topk",
            (1, 1, 1),
            32,
            &[
                Arg::P(logits),
                Arg::I(e as i32),
                Arg::I(k as i32),
                Arg::I(renorm as i32),
                Arg::P(ids),
                Arg::P(w),
                Arg::P(ids2),
            ],
        )
    }

    /// `x += Σ_k w_k ye[k] + g·ys` (g = sigmoid(sg) or 1 when sg = 0; ys = 0 skips it).
    pub fn moe_combine(&self, x: u64, ye: u64, w: u64, ys: u64, sg: u64, h: usize, k: usize) -> Result<()> {
        self.launch(
            "moe_combine",
            (blocks(h, 256), 1, 1),
            256,
            &[Arg::P(x), Arg::P(ye), Arg::P(w), Arg::P(ys), Arg::P(sg), Arg::I(h as i32), Arg::I(k as i32)],
        )
    }

    /// Index of the largest of n values into out (i32).
    pub fn argmax(&self, x: u64, n: usize, out: u64) -> Result<()> {
        self.launch("argmax", (1, 1, 1), 1024, &[Arg::P(x), Arg::I(n as i32), Arg::P(out)])
    }
}

/// Arguments of [`Gpu::gdn_step`] (device addresses).
pub struct GdnStep {
    /// Conv output `[q | k | v]`.
    pub y: u64,
    pub b: u64,
    pub a: u64,
    pub z: u64,
    pub dt_bias: u64,
    pub neg_a: u64,
    pub norm: u64,
    /// `[H_v, D_k, D_v]` fp32, updated in place.
    pub state: u64,
    pub out: u64,
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    pub eps: f32,
}

/// Arguments of [`Gpu::attn_prep`].
pub struct AttnPrep {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub q_out: u64,
    pub kc: u64,
    pub vc: u64,
    pub nh: usize,
    pub hkv: usize,
    pub hd: usize,
    pub gated: bool,
    pub rot: usize,
    /// Device i32: the position of this token.
    pub pos: u64,
    pub theta: f64,
    pub eps: f32,
}
