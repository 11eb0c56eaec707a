//! One typed wrapper per kernel of `kernels/*.cu`: argument order, launch geometry and the
//! shape checks the kernels rely on. Pointers are device addresses (`DevBuf::at`).

use super::params::{
    AddParams, EmbedParams, GemmParams, GemvParams, In, Out, RmsNormParams, SiluMulPairsParams, SiluMulParams, Void,
    XPermParams,
};
use super::{DevBuf, Gpu};
use crate::linear::{FloatType, Linear, Weight};
use anyhow::{bail, Result};
use std::sync::Arc;

mod attention;
mod gdn;
mod moe;
mod sampling;

pub use attention::{AttnDecode, AttnKernel, AttnPlan, AttnPrep, AttnRows, KvDtype, PrefillAttn};
pub use gdn::{gdn_chunk_floats, gdn_prefill_default, GdnPrefill, GdnPrefillKernel, GdnRows, GdnStep};
pub use sampling::{sampling_params_bytes, SAMPLE_WS_BYTES};

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

    /// Whether the streaming kernels (`gemv_q`, `moe_down_q`) take this format: MLX 4/8-bit with
    /// f16/bf16 scales, a power-of-two group of at least 32, under 2^31 16-byte chunks.
    pub fn streams(&self) -> bool {
        matches!(self.bits, 4 | 8)
            && matches!(self.ty, 1 | 2)
            && self.group >= 32
            && (self.group as u32).is_power_of_two()
            && self.count * self.rows * self.cols * (self.bits as usize) / 128 < (1 << 31)
    }

    /// Whether gemm_pipe reads this format: MLX 4-bit with bf16 scales and biases, each
    /// thread's 16 columns inside one group, whole 64-column k-tiles.
    pub fn pipe_ok(&self) -> bool {
        self.bits == 4 && self.ty == 2 && self.group >= 16 && self.group % 16 == 0 && self.cols.is_multiple_of(64)
    }

    /// Whether gemm_skinny reads this format: 4/8-bit codes in groups of a power of two from 16
    /// columns (MLX uses 32, 64, 128), or dense bf16; width a multiple of 64.
    pub fn skinny_ok(&self) -> bool {
        let fmt = match self.bits {
            4 | 8 => self.group >= 16 && (self.group as u32).is_power_of_two(),
            0 => self.ty == 2,
            _ => false,
        };
        // the kernel keeps word and scale offsets in 32 bits
        let small = (self.rows * self.count) as u64 * self.cols as u64 <= u32::MAX as u64;
        fmt && small && self.cols.is_multiple_of(64)
    }

    /// Dynamic shared memory of the streaming GEMVs: the staged input and its per-chunk sums.
    fn stream_smem(&self) -> u32 {
        (4 * (self.cols + self.cols / (128 / self.bits as usize))) as u32
    }

    /// The weight's fields of a params struct: codes (or dense values), scales, biases, bits,
    /// group, scale type.
    fn weight_fields(&self) -> (In<Void>, In<Void>, In<Void>, i32, i32, i32) {
        (
            In::new(self.w.ptr),
            In::new(self.s.as_ref().map_or(0, |s| s.ptr)),
            In::new(self.b.as_ref().map_or(0, |b| b.ptr)),
            self.bits,
            self.group,
            self.ty,
        )
    }
}

/// The decode GEMV kernel for quantized weights: `gemv_q2` (2 rows per warp, streaming from a
/// grid that fills the GPU once) in blocks of 4 warps (`Q2`, `bpsm` blocks per SM) or of 16
/// warps (`Wide`, one block per SM), or the older `linear_gemv` (one short-lived warp per 4 rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvKernel {
    Old,
    Q2,
    Wide,
    /// Timing experiment: `gemv_q2`'s loads without its arithmetic (wrong results).
    LoadOnly,
}

impl GemvKernel {
    /// Threads per block and blocks per SM of the streaming kernels.
    fn geometry(self, bpsm: u32) -> (u32, u32) {
        match self {
            GemvKernel::Wide => (512, 1),
            _ => (128, bpsm.max(1)),
        }
    }
}

/// The kernel and blocks per SM the model uses: `LILY_CUDA_GEMV=old|q2|wide` (default q2) and
/// `LILY_CUDA_GEMV_BPSM` (default 4, for q2), read once.
pub fn gemv_default() -> (GemvKernel, u32) {
    static D: std::sync::OnceLock<(GemvKernel, u32)> = std::sync::OnceLock::new();
    *D.get_or_init(|| {
        let k = match std::env::var("LILY_CUDA_GEMV").as_deref() {
            Ok("old") => GemvKernel::Old,
            Ok("wide") => GemvKernel::Wide,
            _ => GemvKernel::Q2,
        };
        let b = std::env::var("LILY_CUDA_GEMV_BPSM").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
        (k, b)
    })
}

/// Widest input the GEMV stages in shared memory (and so can normalize on the fly).
pub const GEMV_XMAX: usize = 8192;

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per).max(1) as u32
}

impl Gpu {
    /// `y[r, :] = rms_norm(x[r, :]) · w` for `rows` rows of width `d` (y may equal x).
    pub fn rms_norm(&self, x: u64, w: u64, y: u64, rows: usize, d: usize, eps: f32) -> Result<()> {
        let p = RmsNormParams { x: In::new(x), w: In::new(w), y: Out::new(y), d: d as i32, eps };
        self.launch_params("rms_norm", (rows as u32, 1, 1), 256, 0, &p)
    }

    /// `h = silu(g) ⊙ u` over n elements.
    pub fn silu_mul(&self, g: u64, u: u64, h: u64, n: usize) -> Result<()> {
        let p = SiluMulParams { g: In::new(g), u: In::new(u), h: Out::new(h), n: n as i32 };
        self.launch_params("silu_mul", (blocks(n, 256), 1, 1), 256, 0, &p)
    }

    /// `h[k, i] = silu(gu[2k, i]) · gu[2k+1, i]` for k < pairs, i < n (gate/up pairs side by side).
    pub fn silu_mul_pairs(&self, gu: u64, h: u64, n: usize, pairs: usize) -> Result<()> {
        let p = SiluMulPairsParams { gu: In::new(gu), h: Out::new(h), n: n as i32, pairs: pairs as i32 };
        self.launch_params("silu_mul_pairs", (blocks(n * pairs, 256), 1, 1), 256, 0, &p)
    }

    /// `x += y` over n elements.
    pub fn add(&self, x: u64, y: u64, n: usize) -> Result<()> {
        let p = AddParams { x: Out::new(x), y: In::new(y), n: n as i32 };
        self.launch_params("add_inplace", (blocks(n, 256), 1, 1), 256, 0, &p)
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
        self.gemv_raw(w, x, xstride, y, slots, ids, accumulate, (0, 0.0))
    }

    /// `slots` products with the same matrix, input row z at `x + z·xstride` (each row RMS-
    /// normalized first when `norm` has weights), output rows `y: [slots, rows]`: the batched
    /// decode's projections (weights read from memory about once, the slots' blocks share L2).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_rows(
        &self,
        w: &GpuLinear,
        x: u64,
        xstride: usize,
        y: u64,
        slots: usize,
        accumulate: bool,
        norm: (u64, f32),
    ) -> Result<()> {
        self.gemv_raw(w, x, xstride, y, slots, 0, accumulate, norm)
    }

    /// [`Gpu::gemv`] of the RMS-normalized input `x · rsqrt(mean(x²) + eps) · normw` (the norm
    /// computed inside, identical to [`Gpu::rms_norm`]); inputs of at most 8192 columns.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_norm(
        &self,
        w: &GpuLinear,
        x: u64,
        (normw, eps): (u64, f32),
        y: u64,
        slots: usize,
        ids: u64,
        accumulate: bool,
    ) -> Result<()> {
        self.gemv_raw(w, x, 0, y, slots, ids, accumulate, (normw, eps))
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv_raw(
        &self,
        w: &GpuLinear,
        x: u64,
        xstride: usize,
        y: u64,
        slots: usize,
        ids: u64,
        accumulate: bool,
        norm: (u64, f32),
    ) -> Result<()> {
        if norm.0 != 0 && (w.cols > GEMV_XMAX || !w.cols.is_multiple_of(4)) {
            bail!("gemv with a fused norm: {} columns (at most {GEMV_XMAX}, a multiple of 4)", w.cols);
        }
        let (k, bpsm) = gemv_default();
        self.gemv_variant(k, bpsm, w, x, xstride, y, slots, ids, accumulate, norm)
    }

    /// [`Gpu::gemv`] / [`Gpu::gemv_norm`] (`normw` 0 = no norm) through a chosen kernel, with
    /// `bpsm` blocks per SM for the streaming kernels; weights the streaming kernels do not take
    /// (dense, f32 scales, other group sizes, inputs over 8192 columns) always run `linear_gemv`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_variant(
        &self,
        kernel: GemvKernel,
        bpsm: u32,
        w: &GpuLinear,
        x: u64,
        xstride: usize,
        y: u64,
        slots: usize,
        ids: u64,
        accumulate: bool,
        norm: (u64, f32),
    ) -> Result<()> {
        self.gemv_launch(kernel, bpsm, w, (x, xstride, 1), y, slots, ids, accumulate, norm)
    }

    /// [`Gpu::gemv`] where slot z reads input row `z / xdiv` (`x + (z / xdiv)·xstride`): the
    /// batched decode's expert products, slot (token t, choice j) = t·xdiv + j.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_pairs(
        &self,
        w: &GpuLinear,
        x: u64,
        xstride: usize,
        xdiv: usize,
        y: u64,
        slots: usize,
        ids: u64,
    ) -> Result<()> {
        let (k, bpsm) = gemv_default();
        self.gemv_launch(k, bpsm, w, (x, xstride, xdiv.max(1)), y, slots, ids, false, (0, 0.0))
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv_launch(
        &self,
        kernel: GemvKernel,
        bpsm: u32,
        w: &GpuLinear,
        (x, xstride, xdiv): (u64, usize, usize),
        y: u64,
        slots: usize,
        ids: u64,
        accumulate: bool,
        (normw, eps): (u64, f32),
    ) -> Result<()> {
        let (wp, sp, bp, bits, group, ty) = w.weight_fields();
        let a = GemvParams {
            w: wp,
            sc: sp,
            bi: bp,
            bits,
            group,
            ty,
            x: In::new(x),
            xstride: xstride as i64,
            y: Out::new(y),
            rows: w.rows as i32,
            cols: w.cols as i32,
            ids: In::new(ids),
            accumulate: accumulate as i32,
            normw: In::new(normw),
            eps,
            xdiv: xdiv as i32,
        };
        let streaming = w.streams() && w.cols <= GEMV_XMAX && xstride.is_multiple_of(4);
        let name = match kernel {
            GemvKernel::Q2 | GemvKernel::Wide if streaming => "gemv_q2",
            GemvKernel::LoadOnly if streaming => "gemv_q_loadonly",
            _ => {
                let shared = if normw != 0 { 4 * w.cols as u32 } else { 0 };
                return self.launch_params("linear_gemv", (blocks(w.rows, 32), slots as u32, 1), 256, shared, &a);
            }
        };
        let shared = w.stream_smem();
        let (threads, per_sm) = kernel.geometry(bpsm);
        let gx = self.stream_grid(w.rows, threads, per_sm, slots);
        self.launch_params(name, (gx, slots as u32, 1), threads, shared, &a)
    }

    /// Blocks per slot for the streaming GEMV: enough for every 2-row group, at most what fills
    /// the GPU once (`per_sm` blocks of `threads` on each SM, shared among the slots).
    fn stream_grid(&self, rows: usize, threads: u32, per_sm: u32, slots: usize) -> u32 {
        let need = rows.div_ceil(2).div_ceil(threads as usize / 32);
        let fill = ((self.sms * per_sm) as usize / slots.max(1)).max(1);
        need.min(fill).max(1) as u32
    }

    /// `y[m, :] (+)= W x[m, :]` for m rows (matrix 0 of the stack); row strides ldx, ldy (f32
    /// elements).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        w: &GpuLinear,
        prec: Precision,
        x: u64,
        ldx: usize,
        y: u64,
        ldy: usize,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        self.gemm_with(GemmKernel::Auto, w, prec, x, ldx, y, ldy, m, accumulate)
    }

    /// [`Gpu::gemm`] with the bf16 kernel chosen by the caller (tests, benchmarks).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_with(
        &self,
        kern: GemmKernel,
        w: &GpuLinear,
        prec: Precision,
        x: u64,
        ldx: usize,
        y: u64,
        ldy: usize,
        m: usize,
        accumulate: bool,
    ) -> Result<()> {
        let tiles = m.div_ceil(prec.bm());
        let kern = kern.pick(w, m, m, 1);
        self.gemm_raw(w, prec, kern, w.rows, (x, ldx, 0, 1, m), (y, ldy), m, (0, tiles), accumulate)
    }

    /// The routed-expert product: rows grouped by expert through `tiles` (from [`Gpu::moe_align`],
    /// built for `prec.bm()`, at most `max_tiles`) over `pairs` rows in all; row m reads x row
    /// `gather[m] / gdiv` (or m when gather is 0) and uses matrix e of the stack seen as matrices
    /// of `n` rows.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_grouped(
        &self,
        w: &GpuLinear,
        prec: Precision,
        n: usize,
        x: (u64, usize, u64, usize),
        y: (u64, usize),
        (tiles, max_tiles, pairs): (u64, usize, usize),
    ) -> Result<()> {
        self.gemm_grouped_with(GemmKernel::Auto, w, prec, n, x, y, (tiles, max_tiles, pairs))
    }

    /// [`Gpu::gemm_grouped`] with the bf16 kernel chosen by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_grouped_with(
        &self,
        kern: GemmKernel,
        w: &GpuLinear,
        prec: Precision,
        n: usize,
        x: (u64, usize, u64, usize),
        y: (u64, usize),
        (tiles, max_tiles, pairs): (u64, usize, usize),
    ) -> Result<()> {
        if !(w.rows * w.count).is_multiple_of(n) {
            bail!("gemm_grouped: {n} rows per matrix do not divide the stack");
        }
        let kern = kern.pick(w, pairs, 64, (w.rows * w.count / n).max(1));
        let (xp, ldx, gather, gdiv) = x;
        // rows of x the gathered rows reach (pair p reads row p / gdiv)
        let xrows = if gather != 0 { pairs.div_ceil(gdiv.max(1)) } else { pairs };
        self.gemm_raw(w, prec, kern, n, (xp, ldx, gather, gdiv, xrows), y, 0, (tiles, max_tiles), false)
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm_raw(
        &self,
        w: &GpuLinear,
        prec: Precision,
        kern: GemmKernel,
        n: usize,
        (x, ldx, gather, gdiv, xrows): (u64, usize, u64, usize, usize),
        (y, ldy): (u64, usize),
        m: usize,
        (tiles, ntiles): (u64, usize),
        accumulate: bool,
    ) -> Result<()> {
        if w.bits != 0 && !w.cols.is_multiple_of(32) {
            bail!("gemm: quantized width {} is not a multiple of 32", w.cols);
        }
        if prec == Precision::Bf16 && (!w.cols.is_multiple_of(32) || !ldx.is_multiple_of(4) || !x.is_multiple_of(16)) {
            bail!("gemm_bf16: width {} / row stride {ldx} not aligned for the tensor-core path", w.cols);
        }
        if ntiles == 0 {
            return Ok(());
        }
        let (wp, sp, bp, bits, group, ty) = w.weight_fields();
        let mut a = GemmParams {
            w: wp,
            sc: sp,
            bi: bp,
            bits,
            group,
            ty,
            x: In::new(x),
            ldx: ldx as i64,
            gather: In::new(gather),
            gdiv: gdiv.max(1) as i32,
            y: Out::new(y),
            ldy: ldy as i64,
            m: m as i32,
            n: n as i32,
            k: w.cols as i32,
            tiles: In::new(tiles),
            accumulate: accumulate as i32,
            kq: 1,
            ksplit: 1,
            part: Out::new(0),
            tickets: Out::new(0),
        };
        match (prec, kern) {
            (Precision::F32, _) => self.launch_params("gemm_f32", (blocks(n, 8), ntiles as u32, 1), 256, 0, &a),
            (Precision::Bf16, GemmKernel::Skinny(tn) | GemmKernel::SkinnyUnsplit(tn)) => {
                if !w.skinny_ok() {
                    bail!("gemm_skinny: {}-bit weights of width {} (group {}) unsupported", w.bits, w.cols, w.group);
                }
                let tn = skinny_tn(tn, w.cols, self.smem_optin);
                let name = super::skinny_kernel(tn, w.bits);
                let kq = skinny_kq_for(w.cols, if tiles == 0 { 0 } else { ntiles });
                let bn = 256 / kq;
                let grid = if tiles == 0 { blocks(n, bn) * m.div_ceil(tn) as u32 } else { blocks(n, bn) };
                let split = tiles == 0 && !matches!(kern, GemmKernel::SkinnyUnsplit(_));
                let ksplit =
                    if split { skinny_ksplit(grid as usize, self.sms as usize, w.cols / 64, kq, m * n) } else { 1 };
                a.kq = kq as i32;
                a.ksplit = ksplit as i32;
                a.part = Out::new(self.splitk_ws);
                a.tickets = Out::new(self.splitk_ws + super::SPLITK_PART_BYTES as u64);
                let grid = if tiles == 0 { (grid, ksplit as u32, 1) } else { (grid, ntiles as u32, 1) };
                self.launch_params(name, grid, 256, skinny_smem(tn, w.cols) as u32, &a)
            }
            (Precision::Bf16, GemmKernel::Wg) if self.wg_fits(w, xrows) => {
                // the inputs as bf16 in wgmma's k order into the workspace, then the product
                let k = w.cols;
                let xp = XPermParams {
                    x: In::new(x),
                    ldx: ldx as i64,
                    xb: Out::new(self.wg_ws),
                    rows: xrows as i32,
                    k: k as i32,
                };
                self.launch_params("x_bf16_perm", ((xrows * k / 8).div_ceil(256) as u32, 1, 1), 256, 0, &xp)?;
                a.x = In::new(self.wg_ws);
                a.ldx = k as i64;
                if tiles == 0 && m >= wg128_from() {
                    let grid = (blocks(n, 128), m.div_ceil(128) as u32, 1);
                    self.launch_params("gemm_wg128", grid, 256, super::GEMM_WG_SMEM128 as u32, &a)
                } else {
                    let grid = (blocks(n, 128), ntiles as u32, 1);
                    self.launch_params("gemm_wg64", grid, 256, super::GEMM_WG_SMEM64 as u32, &a)
                }
            }
            (Precision::Bf16, GemmKernel::Pipe | GemmKernel::Wg) => {
                if !w.pipe_ok() {
                    bail!("gemm_pipe: {}-bit weights of width {} (group {}) unsupported", w.bits, w.cols, w.group);
                }
                if tiles == 0 && m >= 1024 {
                    let grid = (blocks(n, 128), m.div_ceil(128) as u32, 1);
                    self.launch_params("gemm_pipe128", grid, 256, super::GEMM_PIPE_SMEM128 as u32, &a)
                } else {
                    let grid = (blocks(n, 128), ntiles as u32, 1);
                    self.launch_params("gemm_pipe64", grid, 256, super::GEMM_PIPE_SMEM64 as u32, &a)
                }
            }
            (Precision::Bf16, _) if tiles == 0 && m >= 1024 => {
                self.launch_params("gemm_bf16_m128", (blocks(n, 128), m.div_ceil(128) as u32, 1), 256, 0, &a)
            }
            (Precision::Bf16, _) => self.launch_params("gemm_bf16", (blocks(n, 128), ntiles as u32, 1), 256, 0, &a),
        }
    }

    /// Whether this device runs gemm_wg (sm_90a, its workspace allocated).
    pub fn wg_available(&self) -> bool {
        self.wg_ws != 0
    }

    /// Whether gemm_wg takes this product: a format gemm_pipe reads in groups of a power of two,
    /// whole 128-column k-tiles,
    /// `xrows` input rows within the workspace.
    fn wg_fits(&self, w: &GpuLinear, xrows: usize) -> bool {
        self.wg_available()
            && w.pipe_ok()
            && (w.group as u32).is_power_of_two()
            && w.cols.is_multiple_of(128)
            && xrows * w.cols * 2 <= super::WG_WS_BYTES
    }

    /// `out[t] = W[rows[t], :]` dequantized to f32 for t < n, the row ids read from the device
    /// i32 array at `rows`.
    pub fn embed(&self, w: &GpuLinear, rows: u64, out: u64, n: usize) -> Result<()> {
        let (wp, sp, bp, bits, group, ty) = w.weight_fields();
        let p = EmbedParams {
            w: wp,
            sc: sp,
            bi: bp,
            bits,
            group,
            ty,
            row: In::new(rows),
            cols: w.cols as i32,
            out: Out::new(out),
        };
        self.launch_params("embed_row", (blocks(w.cols, 256), n as u32, 1), 256, 0, &p)
    }
}

/// Which bf16 kernel runs a many-row product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKernel {
    /// By shape: [`GemmKernel::Skinny`] for few rows per matrix, else [`GemmKernel::Tiles`].
    Auto,
    /// gemm_bf16: 64- or 128-row tiles of inputs against 128 weight rows.
    Tiles,
    /// gemm_skinny: weight rows on the MMA's M side, up to this many input rows (8, 16 or 32)
    /// per pass; each weight read once per pass.
    Skinny(usize),
    /// [`GemmKernel::Skinny`] with K never split over blocks (tests the one-block sums).
    SkinnyUnsplit(usize),
    /// gemm_pipe: the tiles kernel's product with the inputs in a cp.async pipeline and the 4-bit
    /// weights dequantized into the mma fragments (`LILY_CUDA_GEMM_PIPE=0`: [`GemmKernel::Tiles`]).
    Pipe,
    /// gemm_wg: the same products on Hopper's wgmma, inputs converted once to bf16 (sm_90a and
    /// inputs within [`super::WG_WS_BYTES`]; else [`GemmKernel::Pipe`]).
    Wg,
}

/// Most rows of a plain product that go to the skinny kernel (`LILY_CUDA_SKINNY_MAX_M`).
fn skinny_max_m() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_MAX_M").ok().and_then(|v| v.parse().ok()).unwrap_or(64))
}

/// Plain products with at most this many output rows go to the skinny kernel for up to 1,024
/// input rows (`LILY_CUDA_SKINNY_SMALL_N`, default 512; 0 turns it off): the 257-row router at
/// 256 tokens ran ~70 µs on the tiles kernel (a handful of blocks, each over all of K), while
/// the skinny kernel spreads it over row passes and K splits that read the 0.5 MB from L2.
fn skinny_small_n() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_SMALL_N").ok().and_then(|v| v.parse().ok()).unwrap_or(512))
}

/// Most input rows per matrix, on average, for which grouped products go to the skinny kernel
/// (`LILY_CUDA_SKINNY_MAX_AVG`).
fn skinny_max_avg() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_MAX_AVG").ok().and_then(|v| v.parse().ok()).unwrap_or(24))
}

impl GemmKernel {
    /// The kernel for `rows` input rows over `mats` matrices (at most `per_tile` in one tile).
    fn pick(self, w: &GpuLinear, rows: usize, per_tile: usize, mats: usize) -> GemmKernel {
        match self {
            GemmKernel::Auto => {
                let avg = rows.div_ceil(mats.max(1)).min(per_tile);
                let small = if mats > 1 {
                    avg <= skinny_max_avg()
                } else {
                    rows <= skinny_max_m() || (w.rows * w.count <= skinny_small_n() && rows <= 1024)
                };
                if small && w.skinny_ok() {
                    let tn = if avg <= 6 {
                        8
                    } else if avg <= 16 {
                        16
                    } else {
                        32
                    };
                    GemmKernel::Skinny(tn.min(skinny_tn_cap().max(8)))
                } else if w.pipe_ok() && wg_on() {
                    GemmKernel::Wg
                } else if w.pipe_ok() && pipe_on() {
                    GemmKernel::Pipe
                } else {
                    GemmKernel::Tiles
                }
            }
            k => k,
        }
    }
}

/// Whether Auto picks [`GemmKernel::Wg`] for what [`GemmKernel::Pipe`] reads
/// (`LILY_CUDA_GEMM_WG=0`: no).
fn wg_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_GEMM_WG").map_or(true, |v| v != "0"))
}

/// Plain gemm_wg products of at least this many rows take the 128-row tiles (gemm_wg128: each
/// weight dequantized once per 128 input rows, one block per SM) instead of 64
/// (`LILY_CUDA_WG128_FROM`, default 1024).
fn wg128_from() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_WG128_FROM").ok().and_then(|v| v.parse().ok()).unwrap_or(1024))
}

/// Whether Auto picks [`GemmKernel::Pipe`] over the tiles kernel (`LILY_CUDA_GEMM_PIPE=0`: no).
fn pipe_on() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_GEMM_PIPE").map_or(true, |v| v != "0"))
}

/// Blocks over which a plain skinny product of `grid` blocks splits K (`chunks` of 64 columns,
/// `kq` parts per block, `mn` output values): enough to give every SM a block, at most 8, each
/// warp keeping at least one chunk, within the workspace; 1 from half the SMs up
/// (`LILY_CUDA_SKINNY_SPLITK=0` turns it off).
fn skinny_ksplit(grid: usize, sms: usize, chunks: usize, kq: usize, mn: usize) -> usize {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_SPLITK").is_ok_and(|v| v == "0")) {
        return 1;
    }
    if 2 * grid >= sms || grid > super::SPLITK_TICKETS {
        return 1;
    }
    let fit = super::SPLITK_PART_BYTES / (4 * mn.max(1));
    sms.div_ceil(grid).min(8).min(chunks / kq).min(fit).max(1)
}

/// Dynamic shared memory of gemm_skinny for `tn` rows per pass and width `k`.
fn skinny_smem(tn: usize, k: usize) -> usize {
    (tn * k * 2).max(256 * (tn + 1) * 4)
}

/// [`skinny_kq`] for a grouped product of `ntiles` expert tiles (0: a plain product). Every
/// block of a tile stages the tile's inputs, and a block covers 256/kq weight rows, so with
/// many tiles (a prefill chunk's routed experts: ~546 tiles at 256 tokens) kq = 1 stages them
/// a quarter as often and still fills the GPU: prefill at 256 tokens 8,489-8,509 → 8,854-8,872
/// tok/s (kq 2: 8,356-8,361). From 384 tiles (about 112 prompt tokens); the batched decode
/// step (330 tiles at 64 sequences) keeps [`skinny_kq`]. `LILY_CUDA_SKINNY_KQ` forces both.
fn skinny_kq_for(k: usize, ntiles: usize) -> usize {
    match skinny_kq_forced() {
        None if ntiles >= 384 => 1,
        _ => skinny_kq(k),
    }
}

fn skinny_kq_forced() -> Option<usize> {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_KQ").ok().and_then(|v| v.parse().ok()))
}

/// How many parts of K the 8 warps of a gemm_skinny block split (1, 2 or 4; the block then
/// covers 256 / kq weight rows): about 8 chunks of 64 columns per warp
/// (`LILY_CUDA_SKINNY_KQ` overrides).
fn skinny_kq(k: usize) -> usize {
    match skinny_kq_forced() {
        Some(q @ (1 | 2 | 4)) => q,
        _ => match k / 64 {
            c if c >= 32 => 4,
            c if c >= 16 => 2,
            _ => 1,
        },
    }
}

/// Most input rows per pass that [`GemmKernel::Auto`] gives the skinny kernel
/// (`LILY_CUDA_SKINNY_TN`, default 8: the 8-row 4-bit pass runs three blocks per SM with two
/// chunks in flight per warp, the 16-row one two blocks with one chunk; in the batched step
/// 8 beat 16 by 6.5% at B=16 and tied at B=64 (3,041 vs 3,059 tok/s), and 16 had beaten two
/// 32-row passes at one block per SM by 4-5% at B=64).
fn skinny_tn_cap() -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_TN").ok().and_then(|v| v.parse().ok()).unwrap_or(8))
}

/// `tn` (8, 16 or 32) lowered until its shared memory fits `optin` bytes.
fn skinny_tn(tn: usize, k: usize, optin: usize) -> usize {
    let mut tn = tn.clamp(8, 32).next_power_of_two();
    while tn > 8 && skinny_smem(tn, k) > optin {
        tn /= 2;
    }
    tn
}

/// Which arithmetic the many-row products use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// fp32 FMAs (exact mode: tests against the fp32 references).
    F32,
    /// bf16 tensor cores with fp32 accumulation (the fast prefill).
    Bf16,
}

impl Precision {
    /// Rows per tile of the kernel (the `bm` that `moe_align` must use).
    pub fn bm(self) -> usize {
        match self {
            Precision::F32 => 8,
            Precision::Bf16 => 64,
        }
    }
}
