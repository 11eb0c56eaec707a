//! The Gated DeltaNet wrappers: the decode step (conv_step + gdn_step, for one sequence or
//! several rows on state-address tables) and the prefill over t tokens (conv_prefill, then the
//! chunked delta rule or the serial scan; kernels/gdn*.cu), with their argument structs.

use super::super::params::{
    ConvPrefillParams, ConvStateParams, ConvStepParams, GdnChunkPrepParams, GdnChunkScanParams, GdnOutNormParams,
    GdnQkPrepParams, GdnScanParams, GdnStepParParams, GdnStepParRowsParams, GdnStepParams, GemvConvParams, In, Out,
};
use super::super::Gpu;
use super::{blocks, gemv_default, gemv_for, GemvKernel, GemvRole, GpuLinear, Precision, GEMV_XMAX};
use crate::cuda::{GDN_PREP_TC_SMEM, GDN_TC_SMEM};
use anyhow::{bail, Result};

impl Gpu {
    /// Causal conv1d + SiLU over t tokens (input rows of stride ldx), updating the state.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_prefill(
        &self,
        x: u64,
        ldx: usize,
        state: u64,
        w: u64,
        y: u64,
        c: usize,
        k: usize,
        t: usize,
    ) -> Result<()> {
        if !(1..=8).contains(&k) {
            bail!("conv_prefill: {k} taps unsupported (at most 8)");
        }
        let (ldx, c, k, t) = (ldx as i64, c as i32, k as i32, t as i32);
        let a = ConvPrefillParams {
            x: In::new(x),
            ldx,
            state: In::new(state),
            w: In::new(w),
            y: Out::new(y),
            C: c,
            K: k,
            T: t,
        };
        // One thread per channel and run of 16 tokens (kernels/gdn_prefill.cu, CONV_TT).
        self.launch_params("conv_prefill", (blocks(c as usize, 256), (t as u32).div_ceil(16), 1), 256, 0, &a)?;
        let a = ConvStateParams { x: In::new(x), ldx, state: Out::new(state), C: c, K: k, T: t };
        self.launch_params("conv_state", (blocks(c as usize, 256), 1, 1), 256, 0, &a)
    }

    /// The gated delta rule over t tokens: q/k normalization (kernels/gdn_prefill.cu), the
    /// recurrence by the kernel [`gdn_prefill_kernel`] picks for `prec`, and the gated RMSNorm
    /// (output `p.out`: `[t, H_v·D_v]`).
    pub fn gdn_prefill(&self, p: &GdnPrefill, prec: Precision) -> Result<()> {
        self.gdn_prefill_with(p, gdn_prefill_kernel(prec))
    }

    /// [`Gpu::gdn_prefill`] with the normalized output written as bf16 in gemm_wg's k order into
    /// its workspace ([`Gpu::wg_ws`], to be the out-projection's input there; `p.out` keeps the
    /// raw recurrence output) instead of in place (D_v a multiple of 64, the rows fitting).
    pub fn gdn_prefill_to_wg(&self, p: &GdnPrefill, prec: Precision) -> Result<()> {
        let s = &p.step;
        if self.wg_ws == 0 || !s.dv.is_multiple_of(64) || p.t * s.hv * s.dv * 2 > crate::cuda::WG_WS_BYTES {
            bail!("gdn_prefill_to_wg: {} rows of {} heads x {} do not fit gemm_wg's workspace", p.t, s.hv, s.dv);
        }
        self.gdn_prefill_opts(p, gdn_prefill_kernel(prec), self.wg_ws)
    }

    /// [`Gpu::gdn_prefill`] with the recurrence done by `kernel` (the chunked form falls back to
    /// the scan for D_k > 128).
    pub fn gdn_prefill_with(&self, p: &GdnPrefill, kernel: GdnPrefillKernel) -> Result<()> {
        self.gdn_prefill_opts(p, kernel, 0)
    }

    /// The recurrence, then the gated RMSNorm in place (xb = 0) or into xb as gemm_wg's input.
    fn gdn_prefill_opts(&self, p: &GdnPrefill, kernel: GdnPrefillKernel, xb: u64) -> Result<()> {
        let s = &p.step;
        if !s.dk.is_multiple_of(32)
            || s.dk > 256
            || !s.dv.is_multiple_of(32)
            || s.dv > 1024
            || !s.hv.is_multiple_of(s.hk)
        {
            bail!("gdn_prefill: unsupported head dims (D_v {} D_k {})", s.dv, s.dk);
        }
        let t = p.t;
        let a = GdnQkPrepParams {
            y: In::new(s.y),
            ldy: p.ldy as i64,
            qn: Out::new(p.qn),
            kn: Out::new(p.kn),
            kq: Out::new(p.kq),
            hk: s.hk as i32,
            dk: s.dk as i32,
        };
        self.launch_params("gdn_qk_prep", (s.hk as u32, t as u32, 1), 128, 0, &a)?;
        if kernel == GdnPrefillKernel::ChunkedTc && self.gdn_tc_fits(s.dk) {
            self.gdn_chunked(p, true)?;
        } else if kernel != GdnPrefillKernel::Scan && s.dk <= 128 {
            self.gdn_chunked(p, false)?;
        } else {
            self.gdn_scan(p)?;
        }
        let a = GdnOutNormParams {
            o: Out::new(s.out),
            z: In::new(s.z),
            ldz: p.ldp as i64,
            w: In::new(s.norm),
            hv: s.hv as i32,
            dv: s.dv as i32,
            eps: s.eps,
            xb: Out::new(xb),
        };
        self.launch_params("gdn_out_norm", ((t * s.hv) as u32, 1, 1), s.dv as u32, 0, &a)
    }

    /// Whether the tensor-core chunk kernels run here: their shared memory fits the device's
    /// opt-in limit and D_k is a multiple of 32 up to 128.
    pub fn gdn_tc_fits(&self, dk: usize) -> bool {
        self.smem_optin_max >= GDN_TC_SMEM.max(GDN_PREP_TC_SMEM) && dk.is_multiple_of(32) && dk <= 128
    }

    /// The chunked recurrence (kernels/gdn_chunk.cu): per-chunk preparation, then the scan over
    /// chunks (on tensor cores, kernels/gdn_chunk_tc.cu, when `tc`); writes `p.step.out` (before
    /// the norm) and updates the state.
    fn gdn_chunked(&self, p: &GdnPrefill, tc: bool) -> Result<()> {
        let s = &p.step;
        let t = p.t;
        if t == 0 {
            return Ok(());
        }
        let nch = t.div_ceil(GDN_CHUNK);
        let [wt, qt, u, mt, g] = gdn_chunk_parts(p.chunk, t, s.hv, s.dk, s.dv);
        let (hk, hv, dk, dv, tt) = (s.hk as i32, s.hv as i32, s.dk as i32, s.dv as i32, t as i32);
        let a = GdnChunkPrepParams {
            qn: In::new(p.qn),
            kn: In::new(p.kn),
            y: In::new(s.y),
            ldy: p.ldy as i64,
            bproj: In::new(s.b),
            aproj: In::new(s.a),
            ldp: p.ldp as i64,
            dt_bias: In::new(s.dt_bias),
            neg_a: In::new(s.neg_a),
            Wt: Out::new(wt),
            Qt: Out::new(qt),
            U: Out::new(u),
            Mt: Out::new(mt),
            G: Out::new(g),
            hk,
            hv,
            dk,
            dv,
            T: tt,
        };
        if tc {
            self.launch_params("gdn_chunk_prep_tc", (nch as u32, s.hv as u32, 1), 256, GDN_PREP_TC_SMEM as u32, &a)?;
        } else {
            let grid = (nch as u32, s.hv as u32, (s.dk + s.dv).div_ceil(256) as u32);
            self.launch_params("gdn_chunk_prep", grid, 256, 0, &a)?;
        }
        let a = GdnChunkScanParams {
            kn: In::new(p.kn),
            Wt: In::new(wt),
            Qt: In::new(qt),
            U: In::new(u),
            Mt: In::new(mt),
            G: In::new(g),
            S: Out::new(s.state),
            o: Out::new(s.out),
            hk,
            hv,
            dk,
            dv,
            T: tt,
        };
        let grid = (s.hv as u32, (s.dv / 32) as u32, 1);
        if tc {
            self.launch_params("gdn_chunk_scan_tc", grid, 256, GDN_TC_SMEM as u32, &a)
        } else {
            self.launch_params("gdn_chunk_scan", grid, 256, 0, &a)
        }
    }

    /// The serial recurrence (gdn_prefill.cu's gdn_scan), state in registers.
    fn gdn_scan(&self, p: &GdnPrefill) -> Result<()> {
        let s = &p.step;
        let t = p.t;
        let a = GdnScanParams {
            qn: In::new(p.qn),
            kn: In::new(p.kn),
            kq: In::new(p.kq),
            y: In::new(s.y),
            ldy: p.ldy as i64,
            bproj: In::new(s.b),
            aproj: In::new(s.a),
            ldp: p.ldp as i64,
            dt_bias: In::new(s.dt_bias),
            neg_a: In::new(s.neg_a),
            S: Out::new(s.state),
            o: Out::new(s.out),
            hk: s.hk as i32,
            hv: s.hv as i32,
            dk: s.dk as i32,
            dv: s.dv as i32,
            T: t as i32,
        };
        self.launch_params("gdn_scan", (s.hv as u32, s.dv.div_ceil(32) as u32, 1), 128, 0, &a)
    }

    /// One token of the causal conv1d + SiLU over C channels with K taps.
    pub fn conv_step(&self, x: u64, state: u64, w: u64, y: u64, c: usize, k: usize) -> Result<()> {
        self.conv_step_rows(x, state, w, y, c, k, &GdnRows::one())
    }

    /// Whether [`Gpu::gemv_conv`] takes this projection and conv width: a streaming format, at
    /// most 8192 columns (a multiple of 4), K a power of two up to 16, the streaming GEMV
    /// selected (`LILY_CUDA_GEMV`), and not switched off (`LILY_CUDA_CONV_FUSED=0`).
    pub fn gemv_conv_ok(w: &GpuLinear, c: usize, k: usize) -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| std::env::var("LILY_CUDA_CONV_FUSED").map_or(true, |v| v != "0"));
        on && w.streams()
            && w.count == 1
            && w.cols <= GEMV_XMAX
            && w.cols.is_multiple_of(4)
            && k.is_power_of_two()
            && k <= 16
            && c <= w.rows
            && matches!(gemv_default().0, GemvKernel::Q2 | GemvKernel::Wide)
    }

    /// One token of the GDN input projection with the conv folded in: `y = W · rms_norm(x)`
    /// (norm weights 0: x as it is), then rows `c' < c` of y through [`Gpu::conv_step`]'s conv
    /// + SiLU into `cy` with `state` updated, in one launch (gemv_q2_conv).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_conv(
        &self,
        w: &GpuLinear,
        x: u64,
        (normw, eps): (u64, f32),
        y: u64,
        (state, cw, cy): (u64, u64, u64),
        c: usize,
        k: usize,
    ) -> Result<()> {
        if !Gpu::gemv_conv_ok(w, c, k) {
            bail!(
                "gemv_conv: {}x{} {}-bit projection with a {k}-tap conv over {c} channels is not fused",
                w.rows,
                w.cols,
                w.bits
            );
        }
        let (wp, sp, bp, bits, group, ty) = w.weight_fields();
        let a = GemvConvParams {
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
            cstate: Out::new(state),
            cw: In::new(cw),
            cy: Out::new(cy),
            C: c as i32,
            K: k as i32,
        };
        let (kernel, bpsm) = gemv_for(GemvRole::In);
        let (threads, per_sm) = kernel.geometry(bpsm);
        let gx = self.stream_grid(w.rows, threads, per_sm, 1);
        self.launch_params("gemv_q2_conv", (gx, 1, 1), threads, w.stream_smem(), &a)
    }

    /// [`Gpu::conv_step`] for `r.rows` sequences at once: row i's input at `x + i·r.ldx`, output
    /// at `y + i·r.ldy`, state `r.states[i]` (x stride: `r.ldp`, the projection row).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_step_rows(&self, x: u64, state: u64, w: u64, y: u64, c: usize, k: usize, r: &GdnRows) -> Result<()> {
        let a = ConvStepParams {
            x: In::new(x),
            state: Out::new(state),
            w: In::new(w),
            y: Out::new(y),
            C: c as i32,
            K: k as i32,
            states: In::new(r.states),
            ldx: r.ldp as i64,
            ldy: r.ldy as i64,
        };
        self.launch_params("conv_step", (blocks(c, 256), r.rows as u32, 1), 256, 0, &a)
    }

    /// One gated-delta-rule step for every value head, with the gated RMSNorm.
    pub fn gdn_step(&self, p: &GdnStep) -> Result<()> {
        self.gdn_step_rows(p, &GdnRows::one())
    }

    /// [`Gpu::gdn_step`] through `gdn_step_par_e` (its inputs loaded in one round after the wait;
    /// the default, +1% decode alone on the H200, session 32) or `gdn_step_par`
    /// (`LILY_CUDA_GDN_STEP=par`), the same bits; for the
    /// shapes the row-split kernel takes (else an error).
    pub fn gdn_step_par_form(&self, p: &GdnStep, early: bool) -> Result<()> {
        let threads = p.dv * p.dk.div_ceil(32);
        if !p.dv.is_multiple_of(32) || threads > 1024 || p.dk > 256 || !p.hv.is_multiple_of(p.hk) {
            bail!("gdn_step_par: unsupported head dims (D_v {} D_k {})", p.dv, p.dk);
        }
        let a = GdnStepParParams::of(p);
        let name = if early { "gdn_step_par_e" } else { "gdn_step_par" };
        self.launch_params(name, (p.hv as u32, 1, 1), threads as u32, 0, &a)
    }

    /// Whether the device has thread-block clusters (sm_90 and later), which gdn_step_c4 needs.
    fn sm90(&self) -> bool {
        self.arch.trim_start_matches("sm_").trim_end_matches('a').parse::<u32>().is_ok_and(|v| v >= 90)
    }

    /// Whether [`Gpu::gdn_step_c4`] takes these heads: D_v = 128, D_k <= 128, on sm_90.
    pub fn gdn_step_c4_ok(&self, p: &GdnStep) -> bool {
        self.sm90() && p.dv == 128 && (1..=128).contains(&p.dk) && p.hk > 0 && p.hv.is_multiple_of(p.hk)
    }

    /// [`Gpu::gdn_step`] through `gdn_step_c4` (kernels/gdn_step_cl.cu, the decode default where
    /// [`Gpu::gdn_step_c4_ok`]): each value head on a cluster of 4 blocks of 512 threads, a
    /// quarter of its columns each.
    pub fn gdn_step_c4(&self, p: &GdnStep) -> Result<()> {
        if !self.gdn_step_c4_ok(p) {
            bail!("gdn_step_c4: needs D_v 128 and D_k <= 128 on sm_90 (D_v {} D_k {})", p.dv, p.dk);
        }
        let a = GdnStepParParams::of(p);
        self.launch_params("gdn_step_c4", (4 * p.hv as u32, 1, 1), 512, 0, &a)
    }

    /// [`Gpu::gdn_step`] for `r.rows` sequences at once (see [`GdnRows`]).
    pub fn gdn_step_rows(&self, p: &GdnStep, r: &GdnRows) -> Result<()> {
        if !p.dv.is_multiple_of(32) || p.dv > 1024 || p.dk > 256 || !p.hv.is_multiple_of(p.hk) {
            bail!("gdn_step: unsupported head dims (D_v {} D_k {})", p.dv, p.dk);
        }
        // The row-split kernel when D_v x ceil(D_k/32)*32 fits one block (Qwen3.6: 128 x 128);
        // its batched form up to 512 threads.
        let threads = p.dv * p.dk.div_ceil(32);
        let batched = r.rows > 1 || r.states != 0;
        let form = std::env::var("LILY_CUDA_GDN_STEP");
        let par = threads <= if batched { 512 } else { 1024 } && form.as_deref() != Ok("serial");
        // One sequence: gdn_step_c4 where it takes the heads (the default since session 41: +2.3%
        // decode at 4K on an H100), else (or `LILY_CUDA_GDN_STEP=e`) gdn_step_par_e, or
        // gdn_step_par (`=par`), or the serial kernel (`=serial`).
        if !batched && !matches!(form.as_deref(), Ok("e" | "par" | "serial")) && self.gdn_step_c4_ok(p) {
            return self.gdn_step_c4(p);
        }
        if par && !batched {
            return self.gdn_step_par_form(p, form.as_deref() != Ok("par"));
        }
        let (y, bproj, aproj, z) = (In::new(p.y), In::new(p.b), In::new(p.a), In::new(p.z));
        let (dt_bias, neg_a, normw, out) = (In::new(p.dt_bias), In::new(p.neg_a), In::new(p.norm), Out::new(p.out));
        let (hk, hv, dk, dv, eps) = (p.hk as i32, p.hv as i32, p.dk as i32, p.dv as i32, p.eps);
        let (states, ldy, ldp, ldo) = (In::new(r.states), r.ldy as i64, r.ldp as i64, r.ldo as i64);
        let grid = (p.hv as u32, r.rows as u32, 1);
        match par {
            true => {
                let a = GdnStepParRowsParams {
                    y,
                    bproj,
                    aproj,
                    z,
                    dt_bias,
                    neg_a,
                    normw,
                    out,
                    hk,
                    hv,
                    dk,
                    dv,
                    eps,
                    states,
                    ldy,
                    ldp,
                    ldo,
                };
                self.launch_params("gdn_step_par_rows", grid, threads as u32, 0, &a)
            }
            false => {
                let a = GdnStepParams {
                    y,
                    bproj,
                    aproj,
                    z,
                    dt_bias,
                    neg_a,
                    normw,
                    S: Out::new(p.state),
                    out,
                    hk,
                    hv,
                    dk,
                    dv,
                    eps,
                    states,
                    ldy,
                    ldp,
                    ldo,
                };
                self.launch_params("gdn_step", grid, p.dv as u32, 0, &a)
            }
        }
    }
}

/// Several sequences' GDN decode steps in one launch: row i reads its conv output at
/// `y + i·ldy`, its projection (b, a, z; and the conv input) at `+ i·ldp`, writes `out + i·ldo`
/// (f32 elements), and updates the state at `states[i]` (a device table of addresses; 0: the one
/// state of the arguments).
pub struct GdnRows {
    pub rows: usize,
    pub states: u64,
    pub ldy: usize,
    pub ldp: usize,
    pub ldo: usize,
}

impl GdnRows {
    pub fn one() -> GdnRows {
        GdnRows { rows: 1, states: 0, ldy: 0, ldp: 0, ldo: 0 }
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

/// Arguments of [`Gpu::gdn_prefill`]: the one-token arguments (with `y`, `z`, `b`, `a` now the
/// first of `t` rows and `out` a `[t, H_v·D_v]` buffer) plus row strides and scratch.
pub struct GdnPrefill {
    pub step: GdnStep,
    pub t: usize,
    /// Row stride of the conv output y (f32 elements).
    pub ldy: usize,
    /// Row stride of the projections holding z, b, a.
    pub ldp: usize,
    /// Scratch: normalized q, k `[t, H_k, D_k]` and k·q `[t, H_k]`.
    pub qn: u64,
    pub kn: u64,
    pub kq: u64,
    /// Scratch of the chunked recurrence: [`gdn_chunk_floats`] f32 for these t and dims (unused
    /// by the scan).
    pub chunk: u64,
}

/// Which kernel runs the recurrence of [`Gpu::gdn_prefill`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnPrefillKernel {
    /// kernels/gdn_chunk.cu: chunks of 64 tokens in the WY/UT form, fp32 (D_k <= 128; else the
    /// scan).
    Chunked,
    /// The same with the scan over chunks on tensor cores in TF32 (kernels/gdn_chunk_tc.cu;
    /// [`Chunked`](Self::Chunked) where [`Gpu::gdn_tc_fits`] says no).
    ChunkedTc,
    /// gdn_prefill.cu's gdn_scan: one token after another.
    Scan,
}

/// The recurrence kernel for a prefill in `prec`: the tensor-core scan for the bf16 prefill, the
/// fp32 chunked kernels for the exact mode. `LILY_CUDA_GDN_PREFILL` = `scan`, `chunked` or `tc`
/// picks one for both. Read once.
pub fn gdn_prefill_kernel(prec: Precision) -> GdnPrefillKernel {
    static D: std::sync::OnceLock<Option<GdnPrefillKernel>> = std::sync::OnceLock::new();
    let forced = *D.get_or_init(|| match std::env::var("LILY_CUDA_GDN_PREFILL").as_deref() {
        Ok("scan") => Some(GdnPrefillKernel::Scan),
        Ok("chunked") => Some(GdnPrefillKernel::Chunked),
        Ok("tc") => Some(GdnPrefillKernel::ChunkedTc),
        _ => None,
    });
    forced.unwrap_or(match prec {
        Precision::Bf16 => GdnPrefillKernel::ChunkedTc,
        Precision::F32 => GdnPrefillKernel::Chunked,
    })
}

/// Tokens per chunk of kernels/gdn_chunk.cu.
const GDN_CHUNK: usize = 64;

/// f32 elements of [`GdnPrefill::chunk`] for up to `t` tokens: per value head, with t rounded up
/// to a multiple of 64 (Tpad), Wt and Qt (Tpad·D_k each), U (Tpad·D_v), Mt (Tpad·64), G (Tpad).
pub fn gdn_chunk_floats(t: usize, hv: usize, dk: usize, dv: usize) -> usize {
    hv * t.div_ceil(GDN_CHUNK) * GDN_CHUNK * (2 * dk + dv + GDN_CHUNK + 1)
}

/// Device addresses of Wt, Qt, U, Mt, G inside the chunk scratch (each part a multiple of 256
/// bytes long, so every part stays 16-byte aligned).
fn gdn_chunk_parts(base: u64, t: usize, hv: usize, dk: usize, dv: usize) -> [u64; 5] {
    let tp = (hv * t.div_ceil(GDN_CHUNK) * GDN_CHUNK) as u64;
    let qt = base + 4 * tp * dk as u64;
    let u = qt + 4 * tp * dk as u64;
    let mt = u + 4 * tp * dv as u64;
    let g = mt + 4 * tp * GDN_CHUNK as u64;
    [base, qt, u, mt, g]
}

impl GdnStepParParams {
    /// One sequence's step arguments, shared by gdn_step_par, gdn_step_par_e and gdn_step_c4.
    fn of(p: &GdnStep) -> Self {
        GdnStepParParams {
            y: In::new(p.y),
            bproj: In::new(p.b),
            aproj: In::new(p.a),
            z: In::new(p.z),
            dt_bias: In::new(p.dt_bias),
            neg_a: In::new(p.neg_a),
            normw: In::new(p.norm),
            S: Out::new(p.state),
            out: Out::new(p.out),
            hk: p.hk as i32,
            hv: p.hv as i32,
            dk: p.dk as i32,
            dv: p.dv as i32,
            eps: p.eps,
        }
    }
}
