//! One typed wrapper per kernel of `kernels/*.cu`: argument order, launch geometry and the
//! shape checks the kernels rely on. Pointers are device addresses (`DevBuf::at`).

use super::params::{
    AddParams, EmbedParams, GemvParams, In, Out, RmsNormParams, SiluMulPairsParams, SiluMulPairsPermParams,
    SiluMulParams, Void,
};
use super::{DevBuf, Gpu};
use crate::linear::{FloatType, Linear, Weight};
use anyhow::{bail, Result};
use std::sync::Arc;

mod attention;
mod gdn;
mod gemm;
mod moe;
pub use moe::{moe_form, moe_topk_block, router_fused, MoeForm};
mod route;
pub use route::{route_sums, router_tail, RouteSums, RouterTail, TailTopk};
mod sampling;

pub use attention::{attn_fold, AttnDecode, AttnKernel, AttnPlan, AttnPrep, AttnRows, KvDtype, PrefillAttn};
pub use gdn::{gdn_chunk_floats, gdn_prefill_kernel, GdnPrefill, GdnPrefillKernel, GdnRows, GdnStep};
pub use gemm::{gdn_norm_perm_on, silu_perm_on, tma_on, wg_tall_avg, GemmKernel, Precision};
pub use sampling::{sampling_params_bytes, SAMPLE_WS_BYTES};

/// A whole-number setting read once from the environment variable `name` into `cell`
/// (`default` when unset or not a number).
pub(crate) fn env_usize(cell: &'static std::sync::OnceLock<usize>, name: &str, default: usize) -> usize {
    *cell.get_or_init(|| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default))
}

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

    /// Whether gemm_wt reads this format: MLX 4- or 8-bit codes with bf16 scales and biases in
    /// groups of a power of two from 16 columns, or dense bf16.
    pub fn wt_ok(&self) -> bool {
        match self.bits {
            4 | 8 => self.ty == 2 && self.group >= 16 && (self.group as u32).is_power_of_two(),
            0 => self.ty == 2,
            _ => false,
        }
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

/// `LILY_CUDA_ACC_RED=1` (an experiment, off until measured): the streaming GEMVs that add into
/// their output (the residual connections: out-projections, moe_fused_q's down projections)
/// do it with one fire-and-forget atomic add per row (`accumulate` 2 in the kernels) instead
/// of a load, an add and a store, so a warp does not wait an L2 round trip at each row's end.
/// Each row is added by exactly one warp per launch, so the result is the same bits as the
/// load-add-store (fp32 round to nearest; the atomic flushes subnormal sums to zero).
pub fn acc_red() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_ACC_RED").is_ok_and(|v| v == "1"))
}

/// The kernels' `accumulate` for a streaming GEMV that adds into its output (or not).
pub fn acc_code(accumulate: bool) -> i32 {
    match (accumulate, acc_red()) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
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

/// The decode step's streaming GEMVs by role, for [`gemv_for`]: the output projections (GDN
/// out-projection, attention o-projection; they add into the residual), the GDN in-projection
/// with its conv (`gemv_q2_conv`) and the attention q/k/v projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvRole {
    Out,
    In,
    Qkv,
}

/// The kernel and blocks per SM for a role: [`GemvKernel::Wide`] (one 16-warp block an SM) for
/// the roles listed in `LILY_CUDA_GEMV_WIDE` (comma-separated `out`, `in`, `qkv`; `none`; default
/// `out,in,qkv`, or none under `LILY_CUDA_GEMV=old`), else [`gemv_default`]. Alone in a chain of
/// launches (examples/gemv_bench.rs, H100) Wide takes the GDN out-projection from 4.97 to 3.77 µs
/// and the in-projection from 7.01 to 6.39, but the 8-bit router from 2.37 to 3.53 (session 28's
/// all-or-nothing `LILY_CUDA_GEMV=wide` lost 0.8%), so the router keeps gemv_q2. In the decode
/// step (H100): `out` +1.5% at 256 and 4K (session 44); over `out`, `out,in,qkv` +1.3% / +2.0% /
/// +2.0% at 256 / 4K / 32K (session 45, alternating two to four times).
pub fn gemv_for(role: GemvRole) -> (GemvKernel, u32) {
    static W: std::sync::OnceLock<Vec<GemvRole>> = std::sync::OnceLock::new();
    let wide = W.get_or_init(|| {
        let v = std::env::var("LILY_CUDA_GEMV_WIDE").unwrap_or_else(|_| {
            if matches!(gemv_default().0, GemvKernel::Old) {
                String::new()
            } else {
                "out,in,qkv".into()
            }
        });
        v.split(',')
            .filter_map(|r| match r.trim() {
                "out" => Some(GemvRole::Out),
                "in" => Some(GemvRole::In),
                "qkv" => Some(GemvRole::Qkv),
                _ => None,
            })
            .collect()
    });
    if wide.contains(&role) {
        (GemvKernel::Wide, 1)
    } else {
        gemv_default()
    }
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

    /// [`Gpu::silu_mul_pairs`] written as bf16 in gemm_wg's k order into its workspace, where the
    /// next product ([`Gpu::gemm_grouped_with`] / [`Gpu::gemm`] with x = [`Gpu::wg_ws`]) reads
    /// it without converting (n a multiple of 64; the prefill by default).
    pub fn silu_mul_pairs_perm(&self, gu: u64, n: usize, pairs: usize) -> Result<()> {
        if !n.is_multiple_of(64) || pairs * n * 2 > crate::cuda::WG_WS_BYTES || self.wg_ws == 0 {
            bail!("silu_mul_pairs_perm: {pairs} rows of {n} do not fit gemm_wg's workspace");
        }
        let p = SiluMulPairsPermParams { gu: In::new(gu), xb: Out::new(self.wg_ws), n: n as i32, pairs: pairs as i32 };
        self.launch_params("silu_mul_pairs_perm", (blocks(n / 8 * pairs, 256), 1, 1), 256, 0, &p)
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
        self.gemv_raw(gemv_default(), w, x, xstride, y, slots, ids, accumulate, (0, 0.0))
    }

    /// `y += W x` for one slot by the kernel [`gemv_for`] gives `role`, with the fused norm when
    /// `norm` has weights (the decode step's projections).
    pub fn gemv_as(
        &self,
        role: GemvRole,
        w: &GpuLinear,
        x: u64,
        y: u64,
        accumulate: bool,
        norm: (u64, f32),
    ) -> Result<()> {
        self.gemv_raw(gemv_for(role), w, x, 0, y, 1, 0, accumulate, norm)
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
        self.gemv_raw(gemv_default(), w, x, xstride, y, slots, 0, accumulate, norm)
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
        self.gemv_raw(gemv_default(), w, x, 0, y, slots, ids, accumulate, (normw, eps))
    }

    #[allow(clippy::too_many_arguments)]
    fn gemv_raw(
        &self,
        (kernel, bpsm): (GemvKernel, u32),
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
        self.gemv_variant(kernel, bpsm, w, x, xstride, y, slots, ids, accumulate, norm)
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
        self.gemv_launch(kernel, bpsm, w, (x, xstride, 1), y, slots, ids, acc_code(accumulate), norm)
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
        self.gemv_launch(k, bpsm, w, (x, xstride, xdiv.max(1)), y, slots, ids, 0, (0, 0.0))
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
        acc: i32,
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
            accumulate: acc,
            normw: In::new(normw),
            eps,
            xdiv: xdiv as i32,
        };
        let streaming = w.streams() && w.cols <= GEMV_XMAX && xstride.is_multiple_of(4);
        // the atomic accumulate is the streaming kernels' alone (linear_gemv loads, adds, stores)
        let a = GemvParams { accumulate: if streaming { acc } else { acc.min(1) }, ..a };
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

    /// `y += W x` by the streaming GEMV with its atomic accumulate ([`acc_red`]) whatever the
    /// switch says, so tests can hold it to the load-add-store's bits.
    pub fn gemv_add_atomic(&self, w: &GpuLinear, x: u64, y: u64) -> Result<()> {
        let (k, bpsm) = gemv_default();
        self.gemv_launch(k, bpsm, w, (x, 0, 1), y, 1, 0, 2, (0, 0.0))
    }

    /// Blocks per slot for the streaming GEMV: enough for every 2-row group, at most what fills
    /// the GPU once (`per_sm` blocks of `threads` on each SM, shared among the slots).
    fn stream_grid(&self, rows: usize, threads: u32, per_sm: u32, slots: usize) -> u32 {
        let need = rows.div_ceil(2).div_ceil(threads as usize / 32);
        let fill = ((self.sms * per_sm) as usize / slots.max(1)).max(1);
        need.min(fill).max(1) as u32
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

/// A 2D TMA map (`cuTensorMapEncodeTiled`) over `rows` packed rows of `inner` elements (bf16
/// when `bf16`, else bytes) at `ptr`, copied in boxes of `boxd` = (elements, rows), in the
/// 128-byte swizzle when `swizzle`; rows past `rows` read as zeros.
pub(crate) fn tma_map(
    ptr: u64,
    bf16: bool,
    inner: usize,
    rows: usize,
    boxd: (u32, u32),
    swizzle: bool,
) -> anyhow::Result<super::params::TmaMap> {
    use cudarc::driver::sys;
    let es = if bf16 { 2 } else { 1 };
    if !ptr.is_multiple_of(16) || !(inner * es).is_multiple_of(16) || rows == 0 {
        anyhow::bail!("TMA map: address {ptr:#x} or row of {} bytes not 16-byte aligned, or no rows", inner * es);
    }
    let dtype = if bf16 {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    } else {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8
    };
    let swz = if swizzle {
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
    } else {
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
    };
    let dims = [inner as u64, rows as u64];
    let strides = [(inner * es) as u64];
    let boxdim = [boxd.0, boxd.1];
    let elem = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer is to a local array of the rank's length; map is written by the call.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxdim.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swz,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| anyhow::anyhow!("TMA map ({rows} rows of {inner}, box {boxd:?}): {e:?}"))?;
    // SAFETY: initialized by the successful call above.
    Ok(super::params::TmaMap(unsafe { map.assume_init() }.opaque))
}
