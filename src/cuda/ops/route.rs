//! The MoE router in the out-projection's launch (`gemv_q2_route`, kernels/gemv_route.cu): the
//! batch-1 decode step's `x += W o` also leaves the router's logits on `rms_norm(x) · nw`, one
//! launch (and one dependency) fewer per MoE layer (the default; `LILY_CUDA_MOE_ROUTER=launch`
//! keeps the router's own launch).

use super::super::params::{GemvRouteParams, In, Out};
use super::super::Gpu;
use super::{acc_red, GpuLinear, GEMV_XMAX};
use anyhow::{bail, Result};

/// The kernel's static shared memory (bytes), rounded up: the router's codes, scale and bias
/// words, the block's rows and norm weights (ptxas: 21,504 bytes).
const ROUTE_STATIC_SMEM: usize = 22 * 1024;

/// What the out-projection's launch leaves the MoE when it computes the router ([`router_tail`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterTail {
    /// The logits (`LILY_CUDA_MOE_ROUTER=tail`, +0.7% at 4K on an H100 over the router's own
    /// launch).
    Logits,
    /// The logits and the MoE's top-k, run by the last block (`=tailk`, the default from
    /// session 48 to 51: +0.9%).
    Topk,
    /// The router's sums in fixed point, with no last block: each MoE block forms the logits and
    /// routes (`gemv_q2_route_acc` and `moe_fused_q2s_acc`; the default since session 51, `=acc`:
    /// +3.4% / +3.4% / +3.9% decode at 256 / 4K / 32K over `tailk` on an H100).
    Acc,
}

/// Whether the decode step computes the router in the out-projection's launch, and what that
/// launch leaves ([`RouterTail`]); None: the router's own launch (`LILY_CUDA_MOE_ROUTER=launch`,
/// or `=fused`: [`super::router_fused`]).
pub fn router_tail() -> Option<RouterTail> {
    static V: std::sync::OnceLock<Option<RouterTail>> = std::sync::OnceLock::new();
    *V.get_or_init(|| match std::env::var("LILY_CUDA_MOE_ROUTER").as_deref() {
        Err(_) | Ok("acc") => Some(RouterTail::Acc),
        Ok("tailk") => Some(RouterTail::Topk),
        Ok("tail") => Some(RouterTail::Logits),
        _ => None,
    })
}

/// The form of gemv_q2_route's router sums (kernels/gemv_route.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteSums {
    /// Each block writes its parts; the last block adds them in block order (`gemv_q2_route`).
    Parts,
    /// Each block adds its parts into fixed-point accumulators, which the last block reads and
    /// zeroes (`gemv_q2_route_fx`).
    Fx,
    /// The fixed-point accumulators with no last block: left for [`super::MoeForm::Q2sAcc`]
    /// (`gemv_q2_route_acc`), which zeroes them.
    Acc,
}

/// The last block's form of the router sums: [`RouteSums::Fx`] (the default since session 50:
/// +2.0% / +2.2% / +1.7% decode at 256 / 4K / 32K on an H200) or [`RouteSums::Parts`]
/// (`LILY_CUDA_ROUTE_SUM=parts`).
pub fn route_sums() -> RouteSums {
    static V: std::sync::OnceLock<RouteSums> = std::sync::OnceLock::new();
    *V.get_or_init(|| match std::env::var("LILY_CUDA_ROUTE_SUM").as_deref() {
        Ok("parts") => RouteSums::Parts,
        _ => RouteSums::Fx,
    })
}

/// The rows of a gemv_q2_route block in the fixed-point forms: 16 (one a warp, grid H / 16: at
/// H 2048 128 SMs busy, not 64; the default since session 51, +0.2-0.3% at 4K / 32K with the
/// sums left for the MoE, +1.5-2.0% with the last block's, H100) or, with
/// `LILY_CUDA_ROUTE_ROWS=32`, 32 (two a warp, grid H / 32; the parts form always).
pub fn route_rows() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| if std::env::var("LILY_CUDA_ROUTE_ROWS").is_ok_and(|v| v == "32") { 32 } else { 16 })
}

/// The MoE's top-k for [`Gpu::gemv_route`]'s last block: `k` routed experts of the router's
/// first rows, the last row the shared expert's gate, `renorm` the softmax over the picks alone.
#[derive(Clone, Copy)]
pub struct TailTopk {
    pub ids: u64,
    pub wts: u64,
    pub k: usize,
    pub renorm: bool,
}

impl Gpu {
    /// The rows of a fixed-point gemv_q2_route block at H `h`: [`route_rows`], or 32 where H / 16
    /// blocks would not fit on the SMs at once.
    pub fn route_block_rows(&self, h: usize) -> usize {
        if route_rows() == 16 && h / 16 <= self.sms as usize {
            16
        } else {
            32
        }
    }

    /// Whether [`Gpu::gemv_route`] takes this out-projection `w` (H rows) and router (`R` rows,
    /// H columns): both streaming formats, H a multiple of 32 with one block per 32 rows within
    /// the SMs, R < 512, the router's 32-column slices 16-byte aligned, the shared memory within
    /// the default 48 KB, and the residual added by load-add-store (not `LILY_CUDA_ACC_RED`).
    pub fn gemv_route_ok(&self, w: &GpuLinear, router: &GpuLinear) -> bool {
        let h = w.rows;
        w.streams()
            && w.count == 1
            && w.cols <= GEMV_XMAX
            && w.cols.is_multiple_of(4)
            && router.streams()
            && router.count == 1
            && router.cols == h
            && router.rows < 512
            && h.is_multiple_of(32)
            && h / 32 <= self.sms as usize
            && (h * router.bits as usize).is_multiple_of(128)
            && w.stream_smem() as usize + ROUTE_STATIC_SMEM <= 48 * 1024
            && !acc_red()
    }

    /// `y += W x` (the out-projection into the residual stream `y`, H = `w.rows`) and the
    /// router's `logits = router · (rms_norm(y) · nw)` with the new `y`, in one launch. `part` holds
    /// `[H / 32, router.rows + 1]` floats (the fixed-point forms: `2 router.rows + H / 16`); `ctr` is a zeroed u64 that only launches of this H use.
    /// With `topk` the last block also runs the MoE's top-k into its `ids`/`wts` `[k + 1]` (for
    /// [`Gpu::moe_fused`] in [`crate::cuda::MoeForm::Q2sGiven`]). The form of the sums is
    /// [`route_sums`]'s; `part` must be zero before the first fixed-point launch (it is left
    /// zero again after each).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_route(
        &self,
        w: &GpuLinear,
        x: u64,
        y: u64,
        router: &GpuLinear,
        norm: (u64, f32),
        part: u64,
        logits: u64,
        ctr: u64,
        topk: Option<TailTopk>,
    ) -> Result<()> {
        self.gemv_route_form(w, x, y, router, norm, (part, route_sums()), logits, ctr, topk)
    }

    /// [`Gpu::gemv_route`] with the sums' form given: `(part, sums)`. [`RouteSums::Acc`] leaves
    /// the sums in `part` (u64 `[R]`, then f32 `[H / 32]` at float offset 2R) for
    /// [`crate::cuda::MoeForm::Q2sAcc`] and writes neither `logits` nor `ctr`, with no top-k.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_route_form(
        &self,
        w: &GpuLinear,
        x: u64,
        y: u64,
        router: &GpuLinear,
        (nw, eps): (u64, f32),
        (part, sums): (u64, RouteSums),
        logits: u64,
        ctr: u64,
        topk: Option<TailTopk>,
    ) -> Result<()> {
        if sums == RouteSums::Acc && topk.is_some() {
            bail!("gemv_route: the sums left for the MoE take no top-k");
        }
        if sums != RouteSums::Parts && w.rows / 32 < 2 {
            bail!("gemv_route: fixed-point sums need two blocks or more (H {} < 64)", w.rows);
        }
        if topk.is_some_and(|t| t.k == 0 || t.k + 1 > router.rows || t.k > 32) {
            bail!("gemv_route: a top-k of {:?} of {} router rows", topk.map(|t| t.k), router.rows);
        }
        if !self.gemv_route_ok(w, router) || nw == 0 {
            bail!(
                "gemv_route: an out-projection of {}x{} (q{}) with a router of {}x{} (q{}) is not taken",
                w.rows,
                w.cols,
                w.bits,
                router.rows,
                router.cols,
                router.bits
            );
        }
        let (wp, sp, bp, bits, group, ty) = w.weight_fields();
        let (wr, sr, br, bits_r, group_r, ty_r) = router.weight_fields();
        let a = GemvRouteParams {
            w: wp,
            sc: sp,
            bi: bp,
            bits,
            group,
            ty,
            x: In::new(x),
            y: Out::new(y),
            rows: w.rows as i32,
            cols: w.cols as i32,
            wr,
            sr,
            br,
            bits_r,
            group_r,
            ty_r,
            R: router.rows as i32,
            nw: In::new(nw),
            eps,
            part: Out::new(part),
            logits: Out::new(logits),
            ctr: Out::new(ctr),
            ids: Out::new(topk.map_or(0, |t| t.ids)),
            wts: Out::new(topk.map_or(0, |t| t.wts)),
            K: topk.map_or(0, |t| t.k) as i32,
            renorm: topk.is_some_and(|t| t.renorm) as i32,
            mode: super::moe::route_rank(),
        };
        let rb = if sums == RouteSums::Parts { 32 } else { self.route_block_rows(w.rows) };
        let name = match (sums, rb) {
            (RouteSums::Parts, _) => "gemv_q2_route",
            (RouteSums::Fx, 32) => "gemv_q2_route_fx",
            (RouteSums::Acc, 32) => "gemv_q2_route_acc",
            (RouteSums::Fx, _) => "gemv_q2_route16_fx",
            (RouteSums::Acc, _) => "gemv_q2_route16_acc",
        };
        self.launch_params(name, ((w.rows / rb) as u32, 1, 1), 512, w.stream_smem(), &a)
    }
}
