//! The persistent decode step (`kernels/pstep.cu`): the phase table of one session, built once
//! from the model's weights and the session's buffers, and its launches.
//!
//! A step is a few launches of `pstep` (one block per SM, resident for many layers): each runs
//! the phases from one attention layer's output projection to the next attention layer's input
//! projection (GDN layers and MoE blocks entirely inside), then the attention kernels of that
//! layer run as today, and the last launch ends with the lm_head. Opt-in while it is slower
//! than the graph of per-op kernels: `LILY_CUDA_DECODE=persistent`; models or formats it does not
//! take (weights other than MLX 4/8-bit with 16-byte scale rows, dense MLPs, shapes over its
//! limits) keep that path too.

use super::{CudaModel, CudaSession, GFfn, GMixer, GState, Scratch};
use crate::cuda::ops::GpuLinear;
use crate::cuda::params::{In, Out, PstepParams};
use crate::cuda::{DevBuf, Gpu};
use anyhow::{bail, Result};

const PS_GEMV: i32 = 0;
const PS_GDN: i32 = 1;
const PS_MOE_GU: i32 = 2;
const PS_MOE_DOWN: i32 = 3;
const PX_PLAIN: i32 = 0;
const PX_RMS: i32 = 1;
const PX_GATED: i32 = 2;
const PS_LL_OUT: i32 = 1;
const PS_LL_IN: i32 = 2;
/// Consumer warps + the producer warp.
const THREADS: u32 = 16 * 32 + 32;
/// `sizeof(PsShared)` in pstep.cu, rounded up to 128.
const SHARED_FIXED: usize = 12288;
/// u32 per (phase, block) of the trace (`PS_TW` in pstep.cu).
const TW: usize = 12;

/// One phase; the same layout as `struct PsPhase` in pstep.cu.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct PsPhase {
    kind: i32,
    xf: i32,
    rows: i32,
    cols: i32,
    group: i32,
    ty: i32,
    accumulate: i32,
    conv_c: i32,
    conv_k: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    nexp: i32,
    topk: i32,
    renorm: i32,
    eps: f32,
    bits: i32,
    /// 1: the input is the previous phase's (same x, norm, and x unchanged since): a block that
    /// staged it for the previous phase keeps that staging.
    same_x: i32,
    /// `PS_LL_OUT`: y is written as LL words (float | tag << 32); `PS_LL_IN`: the input is the
    /// previous phase's LL words, polled instead of the phase counter.
    ll: i32,
    /// 0 here; the kernel's copy of the phase holds its LL tag.
    otag: u32,
    w: u64,
    s: u64,
    b: u64,
    x: u64,
    y: u64,
    normw: u64,
    aux: [u64; 6],
}

const PHASE_BYTES: usize = std::mem::size_of::<PsPhase>();
const _: () = assert!(PHASE_BYTES == 184, "struct PsPhase in pstep.cu (its static_assert)");
const _: () = assert!(std::mem::offset_of!(PsPhase, otag) == 4 * 20, "PS_OTAG_WORD in pstep.cu");

/// One launch: phases `first..first + count`, then the attention of layer `attn` (if any).
struct Seg {
    first: usize,
    count: usize,
    attn: Option<usize>,
}

pub(super) struct PsPlan {
    table: DevBuf,
    segs: Vec<Seg>,
    /// [phase counter, exit ticket, launches so far] (u64; each launch leaves the first two zeroed).
    ctr: DevBuf,
    /// u32 per (phase, block): the launch number (+ 1) that finished the block's share of it.
    flags: DevBuf,
    slot: usize,
    slots: usize,
    xmax: usize,
    smem: usize,
    /// The last phase is the lm_head (else the step's logits come from the separate GEMV).
    lm_head: bool,
    /// `LILY_PSTEP_TRACE=1`: per (phase, block) `TW` global-timer readings of the last step (u32
    /// ns; pstep.cu lists them).
    trace: Option<DevBuf>,
    kinds: Vec<(i32, i32)>,
    /// LL words of the router's logits and of the experts' gate/up (unless `LILY_PSTEP_LL=0`), kept
    /// alive for the table's pointers.
    _ll: Option<(DevBuf, DevBuf, usize)>,
    /// `LILY_PSTEP_DEBUG` (measurement only, the `PS_DBG_*` bits of pstep.cu): 1 fixed experts, 2 the
    /// old three-fence phase end, 4 waits end with an acquire load, 8 polls without sleeping.
    debug: i32,
}

/// Whether pstep streams this matrix: MLX 4/8-bit, f16/bf16 scales, 16-byte rows of scales.
fn takes(w: &GpuLinear) -> bool {
    matches!(w.bits, 4 | 8) && w.streams() && w.cols.is_multiple_of(32) && (w.cols / w.group as usize).is_multiple_of(8)
}

/// Bytes of one row in a slot (codes, scales, biases).
fn row_bytes(w: &GpuLinear) -> usize {
    w.cols * w.bits as usize / 8 + 4 * (w.cols / w.group as usize)
}

fn gemv(w: &GpuLinear, xf: i32, x: u64, normw: u64, eps: f32, y: u64, accumulate: bool) -> PsPhase {
    PsPhase {
        kind: PS_GEMV,
        xf,
        rows: (w.rows * w.count) as i32,
        cols: w.cols as i32,
        group: w.group,
        ty: w.ty,
        accumulate: accumulate as i32,
        eps,
        bits: w.bits,
        w: w.w.ptr,
        s: w.s.as_ref().map_or(0, |s| s.ptr),
        b: w.b.as_ref().map_or(0, |b| b.ptr),
        x,
        y,
        normw,
        ..Default::default()
    }
}

/// Whether the persistent step is asked for (`LILY_CUDA_DECODE=persistent`; off by default
/// until it beats the graph: 353 against 515 tok/s at 4K on an H100 in session 40,
/// docs/perf-log.md).
pub(super) fn wanted() -> bool {
    std::env::var("LILY_CUDA_DECODE").is_ok_and(|v| v == "persistent")
}

impl PsPlan {
    /// The plan for this session's buffers, or the reason the model's step stays a graph of
    /// per-op kernels.
    pub(super) fn build(m: &CudaModel, s: &Scratch, states: &[GState]) -> Result<PsPlan> {
        let g = &m.gpu;
        let c = &m.cfg;
        if !g.arch.starts_with("sm_9") && !g.arch.starts_with("sm_1") {
            bail!("needs Hopper or newer (cp.async.bulk, mbarrier): {}", g.arch);
        }
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let (e, k) = (c.num_experts, c.num_experts_per_tok);
        let (hk, hv, dk, dv) =
            (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (cd, vd, taps) = (c.gdn_conv_dim(), c.gdn_value_dim(), c.linear_conv_kernel_dim);
        if e > 1024 || k + 1 > 64 {
            bail!("{e} experts, top-{k}: over the limits (1024, 63)");
        }
        // dv: the gated norm's one-round staging takes a head in dv / 8 lanes of a warp (pstep.cu)
        if hv > 256
            || dk > 128
            || !dk.is_multiple_of(16)
            || !matches!(dv, 32 | 64 | 128 | 256)
            || hk == 0
            || !hv.is_multiple_of(hk)
        {
            bail!("GDN heads {hk}/{hv} of {dk}/{dv}: outside the step's shapes");
        }
        if taps == 0 || taps > 4 {
            bail!("conv kernel of {taps} taps (the step takes 1 to 4)");
        }
        let f32p = |b: &DevBuf, off: usize| b.ptr + 4 * off as u64;
        // LL words for the MoE's chain (router → gate/up → down): each phase polls its input's
        // words instead of the phase counter (route_warp_smem takes up to 512 experts). On by
        // default (`LILY_PSTEP_LL=0` off): session 38, H100, 351.6 against 344.1 tok/s at 4K.
        let ll = match std::env::var("LILY_PSTEP_LL").as_deref() {
            Ok("0") => None,
            _ if e <= 512 => {
                let inter = m.layers.iter().find_map(|l| match &l.ffn {
                    GFfn::Moe { experts, .. } => Some(experts.gate_up.rows),
                    _ => None,
                });
                let inter = inter.unwrap_or(0);
                Some((g.zeros(8 * (e + 1))?, g.zeros(8 * (k + 1) * 2 * inter)?, inter))
            }
            _ => None,
        };
        let mut phases: Vec<PsPhase> = Vec::new();
        let mut segs = Vec::new();
        let mut first = 0;
        let mut mats: Vec<&GpuLinear> = Vec::new();
        let mut xmax = 0usize;
        let mut unit = 0usize; // the largest indivisible chunk (one row of every matrix it spans)
        for (li, (layer, st)) in m.layers.iter().zip(states).enumerate() {
            let (inorm, pnorm) = (layer.input_norm.ptr, layer.post_norm.ptr);
            match (&layer.mixer, st) {
                (GMixer::Gdn { proj, conv, dt_bias, neg_a, norm, out }, GState::Gdn { conv: cs, rec }) => {
                    let Some(f) = &proj.fused else { bail!("layer {li}: the GDN input projections differ in format") };
                    if f.rows < cd + vd + 2 * hv {
                        bail!("layer {li}: GDN projection of {} rows", f.rows);
                    }
                    let mut p = gemv(f, PX_RMS, s.x.ptr, inorm, eps, s.proj.ptr, false);
                    (p.conv_c, p.conv_k) = (cd as i32, taps as i32);
                    p.aux[..3].copy_from_slice(&[cs.ptr, conv.ptr, s.conv.ptr]);
                    let in_rows = p.rows;
                    phases.push(p);
                    // rows / conv_c: the input projection's, whose blocks' shares a task waits for
                    phases.push(PsPhase {
                        kind: PS_GDN,
                        rows: in_rows,
                        conv_c: cd as i32,
                        hk: hk as i32,
                        hv: hv as i32,
                        dk: dk as i32,
                        dv: dv as i32,
                        x: s.conv.ptr,
                        y: s.o.ptr,
                        aux: [f32p(&s.proj, cd + vd), f32p(&s.proj, cd + vd + hv), dt_bias.ptr, neg_a.ptr, rec.ptr, 0],
                        ..Default::default()
                    });
                    let mut p = gemv(out, PX_GATED, s.o.ptr, norm.ptr, eps, s.x.ptr, true);
                    (p.hv, p.dv) = (hv as i32, dv as i32);
                    p.aux[3] = f32p(&s.proj, cd);
                    if out.cols != vd {
                        bail!("layer {li}: GDN out-projection width {} != {vd}", out.cols);
                    }
                    phases.push(p);
                    mats.extend([f, out]);
                }
                (GMixer::Attn { proj, o, .. }, GState::Attn { .. }) => {
                    let Some(f) = &proj.fused else { bail!("layer {li}: the attention projections differ in format") };
                    phases.push(gemv(f, PX_RMS, s.x.ptr, inorm, eps, s.proj.ptr, false));
                    segs.push(Seg { first, count: phases.len() - first, attn: Some(li) });
                    first = phases.len();
                    phases.push(gemv(o, PX_PLAIN, s.o.ptr, 0, eps, s.x.ptr, true));
                    mats.extend([f, o]);
                }
                _ => bail!("layer {li}: state does not match the layer kind"),
            }
            match &layer.ffn {
                GFfn::Moe { router, experts, .. } if experts.shared_slot => {
                    let Some(r) = &router.fused else { bail!("layer {li}: router and shared gate differ in format") };
                    let (gu, dn) = (&experts.gate_up, &experts.down);
                    if r.rows * r.count != e + 1 || gu.cols != h || dn.rows != h || dn.cols != gu.rows {
                        bail!("layer {li}: MoE shapes do not match the config");
                    }
                    if ll.as_ref().is_some_and(|l| l.2 != gu.rows) {
                        bail!("layer {li}: expert widths differ across layers");
                    }
                    let (logits, egu) = ll.as_ref().map_or((s.router.ptr, s.egu.ptr), |(a, b, _)| (a.ptr, b.ptr));
                    let mut p = gemv(r, PX_RMS, s.x.ptr, pnorm, eps, logits, false);
                    p.ll = if ll.is_some() { PS_LL_OUT } else { 0 };
                    phases.push(p);
                    let mut p = gemv(gu, PX_RMS, s.x.ptr, pnorm, eps, egu, false);
                    p.ll = if ll.is_some() { PS_LL_OUT | PS_LL_IN } else { 0 };
                    (p.kind, p.rows, p.nexp, p.topk, p.renorm, p.same_x) =
                        (PS_MOE_GU, gu.rows as i32, e as i32, k as i32, c.norm_topk_prob as i32, 1);
                    p.aux[0] = logits;
                    // the router's staging serves the gate/up where both stage alike: the same
                    // format, or the float build (the int8 build stages 4-bit inputs as int8 parts)
                    p.same_x = (r.bits == gu.bits || !crate::cuda::gemv_i8()) as i32;
                    phases.push(p);
                    let mut p = gemv(dn, PX_PLAIN, egu, 0, eps, s.x.ptr, true);
                    (p.kind, p.rows, p.topk) = (PS_MOE_DOWN, dn.rows as i32, k as i32);
                    p.ll = if ll.is_some() { PS_LL_IN } else { 0 };
                    phases.push(p);
                    mats.extend([r, gu]);
                    if !takes(dn) {
                        bail!("layer {li}: expert down projections are not MLX 4/8-bit with 16-byte scale rows");
                    }
                    xmax = xmax.max((k + 1) * dn.cols);
                    unit = unit.max((k + 1) * row_bytes(dn));
                }
                _ => bail!("layer {li}: a dense MLP or an unstacked shared expert"),
            }
        }
        let lm_head = takes(&m.lm_head) && m.lm_head.count == 1;
        if lm_head {
            phases.push(gemv(&m.lm_head, PX_RMS, s.x.ptr, m.norm.ptr, eps, s.logits.ptr, false));
            mats.push(&m.lm_head);
        }
        segs.push(Seg { first, count: phases.len() - first, attn: None });
        // The consumers rank the router's logits at the end of the phase before an expert phase
        // (pstep.cu, ps_route): an expert phase cannot open a launch.
        if segs.iter().any(|sg| sg.count > 0 && phases[sg.first].kind == PS_MOE_GU) {
            bail!("an expert phase opens a launch");
        }
        // an LL tag holds a phase's index in its launch in 10 bits (pstep.cu, ps_tag)
        if segs.iter().any(|sg| sg.count >= 1024) {
            bail!("a launch of over 1,023 phases");
        }
        for w in &mats {
            if !takes(w) {
                bail!(
                    "a {}-bit matrix ({} x {}, group {}) is not MLX 4/8-bit with 16-byte scale rows",
                    w.bits,
                    w.rows,
                    w.cols,
                    w.group
                );
            }
            xmax = xmax.max(w.cols);
            unit = unit.max(row_bytes(w));
        }
        let xs = (4 * (xmax + xmax / 16)).div_ceil(128) * 128;
        // 3 slots (~65 KB each): session 37 on an H100, 350.8 tok/s at 4K against 346.5 with 5
        // and 297 with 8 (the model test passes with each)
        let slots: usize = std::env::var("LILY_PSTEP_SLOTS").ok().and_then(|v| v.parse().ok()).unwrap_or(3).clamp(2, 8);
        let ring = g.smem_optin_max.saturating_sub(SHARED_FIXED + xs);
        let slot = (ring / slots) / 128 * 128;
        if slot < unit {
            bail!("shared memory: {slots} slots of {slot} bytes cannot hold a row group of {unit} bytes");
        }
        let smem = SHARED_FIXED + xs + slots * slot;
        let bytes: Vec<u8> = phases
            .iter()
            // SAFETY: PsPhase is repr(C) plain old data (ints, floats, u64s, no padding holes read).
            .flat_map(|p| unsafe { std::slice::from_raw_parts(p as *const PsPhase as *const u8, PHASE_BYTES) }.to_vec())
            .collect();
        let table = g.upload_bytes(&bytes)?;
        let ctr = g.zeros(24)?;
        let flags = g.zeros(4 * phases.len() * g.sms as usize)?;
        let trace = match std::env::var("LILY_PSTEP_TRACE").as_deref() {
            Ok("1") => Some(g.zeros(4 * TW * phases.len() * g.sms as usize)?),
            _ => None,
        };
        let kinds = phases.iter().map(|p| (p.kind, p.rows)).collect();
        let debug = std::env::var("LILY_PSTEP_DEBUG").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        Ok(PsPlan { table, segs, ctr, flags, slot, slots, xmax, smem, lm_head, trace, kinds, _ll: ll, debug })
    }

    fn launch(&self, g: &Gpu, first: usize, count: usize) -> Result<()> {
        let a = PstepParams {
            phases: In::new(self.table.at(first * PHASE_BYTES)),
            nphase: count as i32,
            ctr: Out::new(self.ctr.ptr),
            flags: Out::new(self.flags.at(4 * first * g.sms as usize)),
            slot_bytes: self.slot as i32,
            ns: self.slots as i32,
            xmax: self.xmax as i32,
            trace: Out::new(self.trace.as_ref().map_or(0, |t| t.at(4 * TW * first * g.sms as usize))),
            dbg: self.debug,
        };
        g.launch_params("pstep", (g.sms, 1, 1), THREADS, self.smem as u32, &a)
    }
}

impl CudaSession {
    /// Builds the persistent step's plan once the session's buffers exist (kept until they
    /// change; a model it does not take keeps the reason and the graph of per-op kernels).
    pub(super) fn ensure_plan(&mut self) {
        if self.persistent && self.ps.is_none() {
            if let Some(s) = &self.scratch {
                self.ps = Some(PsPlan::build(&self.model, s, &self.states).map_err(|e| format!("{e:#}")));
            }
        }
    }

    /// Whether decode steps run the persistent kernel, or why not.
    pub fn persistent_step(&mut self) -> std::result::Result<(), String> {
        if !self.persistent {
            return Err("off (LILY_CUDA_DECODE=persistent turns it on)".into());
        }
        self.ensure().map_err(|e| format!("{e:#}"))?;
        self.ensure_plan();
        match &self.ps {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(e.clone()),
            None => Err("no plan".into()),
        }
    }

    /// One decode step through the persistent kernel (see the module doc); the lm_head runs
    /// only when `logits`.
    pub(super) fn record_persistent(&self, plan: &PsPlan, logits: bool, long: bool) -> Result<()> {
        let m = &self.model;
        let g = &m.gpu;
        let s = self.scratch.as_ref().ok_or_else(|| anyhow::anyhow!("session scratch"))?;
        g.embed(&m.embed, s.io.ptr, s.x.ptr, 1)?;
        let last = plan.segs.len() - 1;
        for (i, seg) in plan.segs.iter().enumerate() {
            let count = if i == last && plan.lm_head && !logits { seg.count - 1 } else { seg.count };
            if count > 0 {
                plan.launch(g, seg.first, count)?;
            }
            if let Some(li) = seg.attn {
                self.attn_mid(li, long)?;
            }
        }
        if logits && !plan.lm_head {
            g.gemv_norm(&m.lm_head, s.x.ptr, (m.norm.ptr, m.cfg.rms_norm_eps), s.logits.ptr, 1, 0, false)?;
        }
        Ok(())
    }
}

impl PsPlan {
    /// With `LILY_PSTEP_TRACE=1`: the last step's phases on stderr, in µs: span from the first
    /// block's start to the last block's end, mean time a block that started the phase spends in
    /// it, gap from the
    /// previous phase's last end to this one's first start; means over blocks, from that same
    /// previous end, of when the producer issued the phase's first copies, when the consumers
    /// found its first slot full (and for expert phases when the producer passed the router wait
    /// and its top-k); mean total waits of the consumers for full slots and of the producer for
    /// empty ones. Then a summary per phase kind and row count (a launch's first phase has the
    /// attention kernels and the relaunch before it in its gap, so the total is the whole step
    /// after the first phase's start).
    pub(super) fn print_trace(&self, nb: usize) -> Result<()> {
        let Some(t) = &self.trace else { return Ok(()) };
        let v = t.read_i32(TW * self.kinds.len() * nb)?;
        let names = ["gemv", "gdn", "moe_gu", "moe_down"];
        eprintln!("| phase | kind | rows | span | busy | gap | issued | full | ctr | topk | staged | wait full | wait empty |");
        let base = v[0] as u32;
        let mut prev_end: Option<f64> = None;
        // per (kind, rows): phases, span + gap before, time staging the input (the summary below)
        let mut sum: Vec<((i32, i32), usize, f64, f64)> = Vec::new();
        for (i, (k, rows)) in self.kinds.iter().enumerate() {
            let raw = |b: usize, j: usize| v[TW * (i * nb + b) + j] as u32;
            let at = |b: usize, j: usize| raw(b, j).wrapping_sub(base) as i32 as f64 / 1e3;
            // blocks that started the phase (a GDN phase's start stamp is written by the blocks
            // that took one of its tasks only; the others' stays 0)
            let started: Vec<usize> = (0..nb).filter(|&b| raw(b, 0) != 0).collect();
            let start = started.iter().map(|&b| at(b, 0)).fold(f64::MAX, f64::min);
            let start = if started.is_empty() { (0..nb).map(|b| at(b, 1)).fold(f64::MAX, f64::min) } else { start };
            let end = (0..nb).map(|b| at(b, 1)).fold(f64::MIN, f64::max);
            let mean = |f: &dyn Fn(usize) -> f64| (0..nb).map(f).sum::<f64>() / nb as f64;
            let busy = started.iter().map(|&b| at(b, 1) - at(b, 0)).sum::<f64>() / started.len().max(1) as f64;
            let p = prev_end.unwrap_or(start);
            let from =
                |j: usize| if *k == PS_MOE_GU || j < 4 { format!("{:.2}", mean(&|b| at(b, j) - p)) } else { "".into() };
            eprintln!(
                "| {i} | {} | {rows} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {:.2} | {:.2} |",
                names[*k as usize],
                end - start,
                busy,
                start - p,
                from(2),
                from(3),
                from(4),
                from(5),
                if *k == PS_GDN { String::new() } else { format!("{:.2}", mean(&|b| at(b, 8) - at(b, 0))) },
                mean(&|b| raw(b, 6) as f64 / 1e3),
                mean(&|b| raw(b, 7) as f64 / 1e3),
            );
            prev_end = Some(end);
            let staged = if *k == PS_GDN { 0.0 } else { mean(&|b| at(b, 8) - at(b, 0)) };
            match sum.iter_mut().find(|e| e.0 == (*k, *rows)) {
                Some(e) => (e.1, e.2, e.3) = (e.1 + 1, e.2 + end - p, e.3 + staged),
                None => sum.push(((*k, *rows), 1, end - p, staged)),
            }
        }
        eprintln!("| phase kind (rows) | phases | µs (span + gap before) | µs per phase | staged per phase |");
        for ((k, rows), n, t, st) in &sum {
            eprintln!(
                "| {} ({rows}) | {n} | {t:.1} | {:.2} | {:.2} |",
                names[*k as usize],
                t / *n as f64,
                st / *n as f64
            );
        }
        eprintln!("| launches' phases | {} | {:.1} | | |", self.kinds.len(), sum.iter().map(|e| e.2).sum::<f64>());
        Ok(())
    }
}
