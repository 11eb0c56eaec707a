//! The MoE wrappers: the decode step's routed gate/up GEMV, expert down projections and the
//! one-launch MoE (kernels/gemv.cu), top-k routing, and the prefill's expert grouping and combine
//! (kernels/moe.cu).

use super::super::params::{
    GemvRoutedParams, In, MoeAlignParams, MoeCombineParams, MoeCombineRowsParams, MoeDownParams, MoeFusedParams,
    MoeTopkParams, Out,
};
use super::super::Gpu;
use super::{blocks, gemv_default, GemvKernel, GpuLinear, GEMV_XMAX};
use anyhow::{bail, Result};

/// How the decode MoE kernels pick the top-k: 5 one warp with the logits in registers, the picks
/// among the keys above a bound from each lane's largest, ranked by counting (`route_topk_thresh`
/// in moe.cu, "thresh", the default since session 41: 1,943 against 3,166 cycles per top-8 of 256
/// on an H100, scripts/topk_time.sh), 4 two warp reductions per pick and the weights computed by
/// the lanes (`LILY_CUDA_ROUTE=redux2`: `route_topk_redux<.., true>`, the default of sessions
/// 36-40), 3 the same picks with the weights by one lane (`LILY_CUDA_ROUTE=redux`), 0 one warp
/// over a shared copy (`LILY_CUDA_ROUTE=warp`: `route_topk`), 1 the whole block
/// (`LILY_CUDA_ROUTE=rank`: `route_rank`), 2 one warp in registers with sorted lists
/// (`LILY_CUDA_ROUTE=reg`: `route_topk_reg`). All six give the same picks and weight bits. The
/// persistent step keeps redux2: thresh inlined there raises its spills from 108 to 376 bytes
/// (out of line, to 140).
pub(super) fn route_rank() -> i32 {
    static ON: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var("LILY_CUDA_ROUTE").as_deref() {
        Ok("warp") => 0,
        Ok("rank") => 1,
        Ok("reg") => 2,
        Ok("redux") => 3,
        Ok("redux2") => 4,
        _ => 5,
    })
}

/// The decode MoE launch: `moe_fused_q2s` (moe_fused2.cu, the default where it takes the shape,
/// since session 36: +1.3% decode at 4K on the H200 over q2) is `moe_fused_q2` (`LILY_CUDA_MOE=q2`:
/// the top-k in one warp beside the input staging, gate/up rows in pairs that write
/// SiLU(gate)·up themselves; +6.3% decode alone on the H200, session 32) with the shared
/// expert's gate/up pairs first, their first loads issued before the wait for the router (the
/// same result), or `moe_fused_q` (gemv.cu; `LILY_CUDA_MOE=q`, and where q2 does not take the
/// shape or the router is fused). Removed after measuring slower (perf log): q3 (−1.5%, session
/// 36: the pairs dealt warp-major, later trips requested into the L2) and qr (−8.8%, session 35:
/// the router in the same launch by clusters of 8 blocks). `Q2sGiven` (`moe_fused_q2s_given`, not an `LILY_CUDA_MOE` setting)
/// is q2s with the routing already in `ids`/`wts` (the top-k that [`Gpu::gemv_route`]'s last block
/// ran, `LILY_CUDA_MOE_ROUTER=tailk`) instead of computing it from the logits. `Q2sAcc`
/// (`moe_fused_q2s_acc`, `LILY_CUDA_MOE_ROUTER=acc`) is q2s whose `logits` are the router's sums
/// as [`Gpu::gemv_route_form`] leaves them in [`super::RouteSums::Acc`] (u64 `[e + 1]`, then the
/// H / [`Gpu::route_block_rows`] route blocks' f32 sums of squares): each block forms the logits
/// and routes; block 0 zeroes the sums after the blocks' meeting. `Q2sAccB`
/// (`moe_fused_q2s_accb`, [`moe_topk_block`]) is `Q2sAcc` with the top-k by eight warps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeForm {
    Q,
    Q2,
    Q2s,
    Q2sGiven,
    Q2sAcc,
    Q2sAccB,
}

/// Who ranks the top-k where the MoE forms the router's logits from its sums: warp 0 alone
/// ([`MoeForm::Q2sAcc`], `LILY_CUDA_MOE_TOPK=warp`, by [`route_rank`]'s form) or eight warps
/// ([`MoeForm::Q2sAccB`], `=block`: mf2_route_block in moe_fused2.cu): the same picks and weight
/// bits.
pub fn moe_topk_block() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_MOE_TOPK").as_deref() == Ok("block"))
}

/// The decode step's [`MoeForm`] (default `Q2s`; `LILY_CUDA_MOE=q`: `Q`, `=q2`: `Q2`).
pub fn moe_form() -> MoeForm {
    static V: std::sync::OnceLock<MoeForm> = std::sync::OnceLock::new();
    *V.get_or_init(|| match std::env::var("LILY_CUDA_MOE").as_deref() {
        Ok("q") => MoeForm::Q,
        Ok("q2") => MoeForm::Q2,
        _ => MoeForm::Q2s,
    })
}

/// `LILY_CUDA_MOE_FIXED` (a measurement switch: the model's output is garbage): moe_fused_q
/// computes experts 0..K (`1`) or every (E/K)-th expert (`2`) whatever the router chose, so a
/// step's expert reads are the same pages every token; 0 (unset): the routed experts.
pub fn moe_fixed() -> i32 {
    static V: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_MOE_FIXED").ok().and_then(|v| v.parse().ok()).unwrap_or(0))
}

/// Whether the decode step computes the router inside moe_fused_q (`LILY_CUDA_MOE_ROUTER=fused`;
/// off by default until measured).
pub fn router_fused() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("LILY_CUDA_MOE_ROUTER").is_ok_and(|v| v == "fused"))
}

impl Gpu {
    /// Decode MoE gate/up with the routing inside: top-`k` of the `e` router logits (the shared
    /// expert's gate logit at `logits[e]`, its matrices at stack slot `e`), then `y[2(k+1), rows]`
    /// = the gate/up rows of the chosen experts applied to the normalized `x`; `ids`/`wts` `[k+1]`
    /// get the routing for [`Gpu::moe_down`]. Err when the streaming kernel does not take this
    /// format (the caller then routes with [`Gpu::moe_topk_shared`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_routed(
        &self,
        w: &GpuLinear,
        x: u64,
        (normw, eps): (u64, f32),
        y: u64,
        (logits, e, k, renorm): (u64, usize, usize, bool),
        ids: u64,
        wts: u64,
    ) -> Result<()> {
        if !w.streams() || w.cols > GEMV_XMAX || e > 1024 || k >= 64 || k > e {
            bail!("gemv_routed: unsupported shape or format");
        }
        let (wp, sp, bp, bits, group, ty) = w.weight_fields();
        let a = GemvRoutedParams {
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
            normw: In::new(normw),
            eps,
            logits: In::new(logits),
            E: e as i32,
            K: k as i32,
            renorm: renorm as i32,
            ids_out: Out::new(ids),
            wts_out: Out::new(wts),
            rank: route_rank(),
        };
        let shared = w.stream_smem();
        let slots = 2 * (k + 1);
        let (kernel, bpsm) = gemv_default();
        let (threads, per_sm) = kernel.geometry(bpsm);
        let gx = self.stream_grid(w.rows, threads, per_sm, slots);
        self.launch_params("gemv_q2_routed", (gx, slots as u32, 1), threads, shared, &a)
    }

    /// Whether [`Gpu::moe_fused`] takes these experts: both stacks in one streaming format, the
    /// gate/up input and the K + 1 slots' intermediate rows within 8192 floats, at most 1024
    /// experts and 63 chosen, 2(K + 1) slots within the SMs, not switched off
    /// (`LILY_CUDA_MOE_FUSED=0`), and the streaming GEMV selected.
    pub fn moe_fused_ok(&self, gate_up: &GpuLinear, down: &GpuLinear, e: usize, k: usize) -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| std::env::var("LILY_CUDA_MOE_FUSED").map_or(true, |v| v != "0"));
        on && gate_up.streams()
            && down.streams()
            && gate_up.bits == down.bits
            && gate_up.ty == down.ty
            && gate_up.cols == down.rows
            && down.cols == gate_up.rows
            && gate_up.cols <= GEMV_XMAX
            && gate_up.cols.is_multiple_of(4)
            && (k + 1) * down.cols <= GEMV_XMAX
            && down.cols.is_multiple_of(4)
            && e <= 1024
            && k < 64
            && k <= e
            && 2 * (k + 1) <= self.sms as usize
            && gemv_default().0 != GemvKernel::Old
    }

    /// Whether [`Gpu::moe_fused`] takes these experts in [`MoeForm::Q2`] (the router not fused,
    /// a normalized input): at most 512 experts, top-16, and an input of at most 480 chunks of
    /// one 128-bit load (moe_fused2.cu's staging by 15 warps).
    pub fn moe_fused_q2_ok(&self, gate_up: &GpuLinear, down: &GpuLinear, e: usize, k: usize) -> bool {
        self.moe_fused_ok(gate_up, down, e, k)
            && e <= 512
            && k <= 16
            && gate_up.cols / (128 / gate_up.bits as usize) <= 480
            && gate_up.bits == down.bits
            && gate_up.ty == down.ty
    }

    /// Whether [`Gpu::moe_fused`] can also compute this router (`e + 1` rows: the experts' logits
    /// and the shared expert's gate, over the experts' input width).
    pub fn moe_router_ok(&self, router: &GpuLinear, gate_up: &GpuLinear, e: usize) -> bool {
        router.streams() && router.count == 1 && router.rows == e + 1 && router.cols == gate_up.cols
    }

    /// Decode MoE in one launch (moe_fused_q): routing ([`Gpu::gemv_routed`]'s top-`k` with the
    /// shared expert as slot `k`), the gate/up rows of the chosen experts into `gu`
    /// `[2(k+1), inter]`, then [`Gpu::moe_down`]'s down projections, weighted sum and residual
    /// into `x`; `ids`/`wts` get the routing; `ctr` is a zeroed u64 the launch's blocks meet on.
    /// With `router`, its logits are computed first in the same launch (into `logits`). `trace`
    /// (0: none) gets 16 global-timer stamps per block ([`crate::cuda::profile::MOE_TRACE_SLOTS`]).
    /// `ctr` holds two zeroed u64: the first for [`MoeForm::Q`]'s launches, the second for the
    /// other forms' (the grids differ; a counter's launches must share one).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_fused(
        &self,
        gate_up: &GpuLinear,
        down: &GpuLinear,
        router: Option<&GpuLinear>,
        x: u64,
        (normw, eps): (u64, f32),
        gu: u64,
        (logits, e, k, renorm): (u64, usize, usize, bool),
        (ids, wts): (u64, u64),
        ctr: u64,
        trace: u64,
        form: MoeForm,
    ) -> Result<()> {
        if !self.moe_fused_ok(gate_up, down, e, k) {
            bail!("moe_fused: experts of this shape or format are not fused");
        }
        if matches!(form, MoeForm::Q2 | MoeForm::Q2s | MoeForm::Q2sGiven | MoeForm::Q2sAcc | MoeForm::Q2sAccB)
            && (router.is_some() || normw == 0 || !self.moe_fused_q2_ok(gate_up, down, e, k))
        {
            bail!("moe_fused_q2/q2s: this router, input or expert shape is not taken");
        }
        if matches!(form, MoeForm::Q2sAcc | MoeForm::Q2sAccB)
            && (!gate_up.cols.is_multiple_of(32) || gate_up.cols < 64 || e + 1 >= 512)
        {
            bail!("moe_fused_q2s_acc: route sums of {} experts over {} columns are not taken", e, gate_up.cols);
        }
        if router.is_some_and(|r| !self.moe_router_ok(r, gate_up, e)) {
            bail!("moe_fused: a router of this shape or format is not fused");
        }
        let (wr, sr, br, bits_r, group_r, ty_r) =
            router.map_or((In::new(0), In::new(0), In::new(0), 0, 0, 0), |r| r.weight_fields());
        let slots = 2 * (k + 1);
        let bps = (self.sms as usize / slots).max(1);
        let (wg, sg, bg, bits, group_g, ty) = gate_up.weight_fields();
        let (wd, sd, bd, _, group_d, _) = down.weight_fields();
        let a = MoeFusedParams {
            wg,
            sg,
            bg,
            wd,
            sd,
            bd,
            bits,
            group_g,
            group_d,
            ty,
            x: Out::new(x),
            gu: Out::new(gu),
            inter: gate_up.rows as i32,
            H: gate_up.cols as i32,
            normw: In::new(normw),
            eps,
            logits: Out::new(logits),
            E: e as i32,
            K: k as i32,
            renorm: renorm as i32,
            ids_out: Out::new(ids),
            wts_out: Out::new(wts),
            ctr: Out::new(ctr),
            bps: bps as i32,
            rank: route_rank(),
            wr,
            sr,
            br,
            bits_r,
            group_r,
            ty_r,
            R: router.map_or(0, |r| r.rows) as i32,
            trace: Out::new(trace),
            fixed: moe_fixed(),
            acc: super::acc_code(true),
            rblocks: (gate_up.cols / self.route_block_rows(gate_up.cols)) as i32,
        };
        // the staging holds the input and its chunk sums for the narrowest chunks in use
        let epv = 128 / router.map_or(gate_up.bits, |r| r.bits.max(gate_up.bits)) as usize;
        let (h, s) = (gate_up.cols, (k + 1) * down.cols);
        let shared = (4 * (h + h / epv).max(s + s / epv)) as u32;
        if form != MoeForm::Q {
            // Every SM: the (K + 1) * inter gate/up pairs over its 16 warps each (the q2 forms: the
            // same grid, so they may share the counter).
            let grid = ((k + 1) * gate_up.rows).div_ceil(16).max(down.rows.div_ceil(16)).min(self.sms as usize);
            let a = MoeFusedParams { ctr: Out::new(ctr + 8), ..a };
            let name = match form {
                MoeForm::Q2sGiven => "moe_fused_q2s_given",
                MoeForm::Q2sAcc => "moe_fused_q2s_acc",
                MoeForm::Q2sAccB => "moe_fused_q2s_accb",
                MoeForm::Q2s => "moe_fused_q2s",
                _ => "moe_fused_q2",
            };
            return self.launch_params(name, (grid as u32, 1, 1), 512, shared, &a);
        }
        // At least one block per 16 down rows (one row per warp, as moe_down_q), within the SMs.
        let grid = (bps * slots).max(down.rows.div_ceil(16)).min(self.sms as usize);
        self.launch_params("moe_fused_q", (grid as u32, 1, 1), 512, shared, &a)
    }

    /// Decode MoE down projections + weighted sum + residual: `x[r] += Σ_{k<s} wts[k] ·
    /// (W[ids[k]] h_k)[r]` with `h_k = silu(gu[2k]) ⊙ gu[2k+1]` (`gu`: `[2s, cols]`, the gate/up
    /// GEMV output); `s · cols` at most 8192.
    pub fn moe_down(&self, w: &GpuLinear, gu: u64, ids: u64, wts: u64, s: usize, x: u64) -> Result<()> {
        let (k, bpsm) = gemv_default();
        self.moe_down_variant(k, bpsm, w, gu, ids, wts, s, x)
    }

    /// [`Gpu::moe_down`] through a chosen kernel: `moe_down_q` (the streaming GEMV's machinery,
    /// blocks of 16 warps, one row per warp, `bpsm` blocks per SM at most, though only one fits)
    /// for the weights it takes, else `moe_down`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_variant(
        &self,
        kernel: GemvKernel,
        bpsm: u32,
        w: &GpuLinear,
        gu: u64,
        ids: u64,
        wts: u64,
        s: usize,
        x: u64,
    ) -> Result<()> {
        if s * w.cols > GEMV_XMAX || !w.cols.is_multiple_of(4) {
            bail!("moe_down: {s} slots of {} columns exceed {GEMV_XMAX}", w.cols);
        }
        let (wp, sp, bp, bits, group, ty) = w.weight_fields();
        let a = MoeDownParams {
            w: wp,
            sc: sp,
            bi: bp,
            bits,
            group,
            ty,
            gu: In::new(gu),
            ids: In::new(ids),
            wts: In::new(wts),
            S: s as i32,
            x: Out::new(x),
            rows: w.rows as i32,
            cols: w.cols as i32,
        };
        if kernel != GemvKernel::Old && w.streams() {
            let epv = 128 / w.bits as usize;
            let shared = (4 * (s * w.cols + s * w.cols / epv)) as u32;
            // Blocks of 16 warps (512 threads at 96 registers: one block per SM).
            let grid = w.rows.div_ceil(16).min((self.sms * bpsm.max(1)) as usize).max(1);
            return self.launch_params("moe_down_q", (grid as u32, 1, 1), 512, shared, &a);
        }
        self.launch_params("moe_down", (blocks(w.rows, 16), 1, 1), 256, 4 * (s * w.cols) as u32, &a)
    }

    /// Groups `p` routed pairs (expert ids[i], i32) by expert: `perm`, `inv` (i32 [p]) and the
    /// tile list for [`Gpu::gemm_grouped`] with tiles of at most `bm` rows (`tiles`: i32
    /// [1 + 3·(p/bm + e + 1)]).
    pub fn moe_align(&self, ids: u64, p: usize, e: usize, bm: usize, perm: u64, inv: u64, tiles: u64) -> Result<()> {
        if e > 1024 {
            bail!("moe_align: {e} experts unsupported");
        }
        let a = MoeAlignParams {
            ids: In::new(ids),
            P: p as i32,
            E: e as i32,
            bm: bm as i32,
            perm: Out::new(perm),
            inv: Out::new(inv),
            tiles: Out::new(tiles),
        };
        self.launch_params("moe_align", (1, 1, 1), 1024, 0, &a)
    }

    /// `x[t] += Σ_k w[t,k] ye[inv[t·K+k]] + sigmoid(sg[t·sgs]) ys[t]` for t tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_rows(
        &self,
        x: u64,
        ye: u64,
        inv: u64,
        w: u64,
        ys: u64,
        (sg, sgs): (u64, usize),
        h: usize,
        k: usize,
        t: usize,
    ) -> Result<()> {
        let a = MoeCombineRowsParams {
            x: Out::new(x),
            ye: In::new(ye),
            inv: In::new(inv),
            w: In::new(w),
            ys: In::new(ys),
            sg: In::new(sg),
            sgs: sgs as i64,
            H: h as i32,
            K: k as i32,
        };
        self.launch_params("moe_combine_rows", (blocks(h, 256), t as u32, 1), 256, 0, &a)
    }

    /// Softmax + top-k of E router logits into device ids (i32) and weights (f32); when `ids2` is
    /// not 0 it also gets `[2·id, 2·id + 1]` per choice (rows of an interleaved gate/up stack).
    pub fn moe_topk(&self, logits: u64, e: usize, k: usize, renorm: bool, ids: u64, w: u64, ids2: u64) -> Result<()> {
        self.moe_topk_rows(logits, 0, 1, e, k, renorm, ids, w, ids2, false)
    }

    /// [`Gpu::moe_topk`] plus slot k for the shared expert stacked as expert e: id e, weight
    /// sigmoid(logits[e]) (the gate logit after the router's), ids2 `[2e, 2e+1]`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_topk_shared(
        &self,
        logits: u64,
        e: usize,
        k: usize,
        renorm: bool,
        ids: u64,
        w: u64,
        ids2: u64,
    ) -> Result<()> {
        self.moe_topk_rows(logits, 0, 1, e, k, renorm, ids, w, ids2, true)
    }

    /// [`Gpu::moe_topk`] for t tokens (logit rows of stride `ld`; ids and weights `[t, k]`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_topk_rows(
        &self,
        logits: u64,
        ld: usize,
        t: usize,
        e: usize,
        k: usize,
        renorm: bool,
        ids: u64,
        w: u64,
        ids2: u64,
        shared: bool,
    ) -> Result<()> {
        if e > 1024 || k > 64 || k > e {
            bail!("moe_topk: {e} experts / top-{k} unsupported");
        }
        let a = MoeTopkParams {
            logits: In::new(logits),
            E: e as i32,
            K: k as i32,
            renorm: renorm as i32,
            ids: Out::new(ids),
            wout: Out::new(w),
            ids2: Out::new(ids2),
            lstride: ld as i64,
            shared: shared as i32,
        };
        self.launch_params("moe_topk", (t as u32, 1, 1), 32, 0, &a)
    }

    /// `x += Σ_k w_k ye[k] + g·ys` (g = sigmoid(sg) or 1 when sg = 0; ys = 0 skips it).
    pub fn moe_combine(&self, x: u64, ye: u64, w: u64, ys: u64, sg: u64, h: usize, k: usize) -> Result<()> {
        let a = MoeCombineParams {
            x: Out::new(x),
            ye: In::new(ye),
            w: In::new(w),
            ys: In::new(ys),
            sg: In::new(sg),
            H: h as i32,
            K: k as i32,
        };
        self.launch_params("moe_combine", (blocks(h, 256), 1, 1), 256, 0, &a)
    }
}
