//! The batched prefill of a [`CudaSession`]: a prompt of several tokens runs through the layers
//! in chunks, over `[T, ·]` activations (see the module doc of `model.rs` and kernels/gemm.cu,
//! gdn_prefill.cu, attention_prefill.cu).

use super::{CudaModel, CudaSession, GFfn, GLayer, GMixer, GState};
use crate::cuda::ops::{
    gdn_chunk_floats, gdn_norm_perm_on, silu_perm_on, tma_on, wg_tall_avg, GdnPrefill, GemmKernel, Precision,
};
use crate::cuda::DevBuf;
use anyhow::{bail, Context, Result};

/// Activation scratch of a batched prefill for up to `cap` rows (fp32 unless noted).
pub(super) struct PScratch {
    /// Distinct per allocation (a new scratch may reuse some of the old one's addresses, so a
    /// captured pass that reads it checks this, not a pointer).
    pub(super) id: u64,
    pub(super) cap: usize,
    /// Logit rows it can hold (0 when the chunk only needs the last row's).
    pub(super) logit_rows: usize,
    pub(super) toks: DevBuf, // i32 [cap]
    pub(super) pos: DevBuf,  // i32 [1]: position of the chunk's first token
    pub(super) x: DevBuf,
    pub(super) xn: DevBuf,
    pub(super) proj: DevBuf,
    pub(super) conv: DevBuf,
    pub(super) qn: DevBuf,
    pub(super) kn: DevBuf,
    pub(super) kq: DevBuf,
    /// The chunked delta rule's scratch ([`gdn_chunk_floats`]).
    pub(super) gchunk: DevBuf,
    pub(super) o: DevBuf,
    pub(super) q: DevBuf,
    pub(super) router: DevBuf,
    pub(super) ids: DevBuf, // i32 [cap·K]
    pub(super) wts: DevBuf,
    pub(super) perm: DevBuf,  // i32 [cap·K]
    pub(super) inv: DevBuf,   // i32 [cap·K]
    pub(super) tiles: DevBuf, // i32, see moe_align
    pub(super) egu: DevBuf,
    pub(super) eh: DevBuf,
    pub(super) ye: DevBuf,
    pub(super) sgu: DevBuf,
    pub(super) sh: DevBuf,
    pub(super) ys: DevBuf,
    pub(super) logits: DevBuf,
}

/// Most tiles a grouped product over `pairs` routed rows can have (tiles of `bm` rows never
/// span two experts).
pub(super) fn max_tiles(pairs: usize, bm: usize, experts: usize) -> usize {
    pairs.div_ceil(bm) + experts + 1
}

impl CudaSession {
    /// Prefill scratch for chunks of `cap` rows (with `logit_rows` rows of logits), kept
    /// between calls while large enough; a new one is at least as large as the old in both
    /// (a batch's slots share one scratch, see `CudaBatch::step`).
    pub(super) fn ensure_pre(&mut self, cap: usize, logit_rows: usize) -> Result<()> {
        let (mut cap, mut logit_rows) = (cap, logit_rows);
        if let Some(p) = &self.pre {
            if p.cap >= cap && p.logit_rows >= logit_rows {
                return Ok(());
            }
            cap = cap.max(p.cap);
            logit_rows = logit_rows.max(p.logit_rows);
        }
        self.pre = None;
        let g = &self.model.gpu;
        let c = &self.model.cfg;
        let f = |n: usize| g.alloc(4 * n.max(1));
        let (h, k, e) = (c.hidden_size, c.num_experts_per_tok.max(1), c.num_experts.max(1));
        let inter = c.moe_intermediate_size.max(c.intermediate_size);
        let sinter = c.shared_expert_intermediate_size.max(c.intermediate_size);
        let proj =
            (c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads).max(c.q_proj_dim() + 2 * c.kv_dim());
        // k + 1 slots per token: the shared expert may run as one more routed choice
        let pairs = cap * (k + 1);
        let qk = c.linear_num_key_heads * c.linear_key_head_dim;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        self.pre = Some(PScratch {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            cap,
            logit_rows,
            toks: f(cap)?,
            pos: f(1)?,
            x: f(cap * h)?,
            xn: f(cap * h)?,
            proj: f(cap * proj)?,
            conv: f(cap * c.gdn_conv_dim())?,
            qn: f(cap * qk)?,
            kn: f(cap * qk)?,
            kq: f(cap * c.linear_num_key_heads)?,
            gchunk: f(gdn_chunk_floats(cap, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim))?,
            o: f(cap * c.gdn_value_dim().max(c.num_attention_heads * c.head_dim))?,
            q: f(cap * c.num_attention_heads * c.head_dim)?,
            router: f(cap * (e + 1))?,
            ids: f(pairs)?,
            wts: f(pairs)?,
            perm: f(pairs)?,
            inv: f(pairs)?,
            tiles: f(1 + 3 * max_tiles(pairs, Precision::F32.bm().min(Precision::Bf16.bm()), e + 1))?,
            egu: f(pairs * 2 * inter)?,
            eh: f(pairs * inter)?,
            ye: f(pairs * h)?,
            sgu: f(cap * 2 * sinter)?,
            sh: f(cap * sinter)?,
            ys: f(cap * h)?,
            logits: f(logit_rows * c.vocab_size)?,
        });
        Ok(())
    }

    /// Runs `tokens` as batched chunks. With `all`, returns the logits of every token; else
    /// leaves the last token's logits in the step scratch (`scratch.logits`).
    pub(super) fn prefill(&mut self, tokens: &[u32], prec: Precision, all: bool) -> Result<Vec<f32>> {
        let v = self.model.cfg.vocab_size;
        // Logits of every row need [rows, vocab] floats: smaller chunks then (about 256 MB).
        let cap = if all { self.chunk.min(((1usize << 28) / (4 * v)).max(16)) } else { self.chunk };
        let cap = cap.min(tokens.len());
        self.ensure_pre(cap, if all { cap } else { 0 })?;
        let mut out = Vec::with_capacity(if all { tokens.len() * v } else { 0 });
        let n = tokens.len();
        for (i, ch) in tokens.chunks(cap).enumerate() {
            let last = (i + 1) * cap >= n;
            self.prefill_chunk(ch, prec, all, last && !all)?;
            if all {
                out.extend(self.pre.as_ref().unwrap().logits.read_f32(0, ch.len() * v)?);
            }
        }
        Ok(out)
    }

    /// One chunk of a batched prefill at positions `pos..pos + T` (see the module doc). `all`:
    /// logits of every row into the prefill scratch; `last`: the last row's into the step scratch.
    fn prefill_chunk(&mut self, toks: &[u32], prec: Precision, all: bool, last: bool) -> Result<()> {
        let t = toks.len();
        let pos0 = self.pos;
        self.grow_kv(pos0 + t)?;
        let m = &self.model;
        let g = &m.gpu;
        let c = &m.cfg;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let p = self.pre.as_ref().context("prefill scratch")?;
        let ids: Vec<u8> = toks.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect();
        p.toks.write_bytes(0, &ids)?;
        p.pos.write_bytes(0, &(pos0 as i32).to_le_bytes())?;
        g.embed(&m.embed, p.toks.ptr, p.x.ptr, t)?;
        for i in 0..m.layers.len() {
            self.prefill_layer(i, t, prec)?;
        }
        if all {
            g.rms_norm(p.x.ptr, m.norm.ptr, p.xn.ptr, t, h, eps)?;
            g.gemm(&m.lm_head, prec, p.xn.ptr, h, p.logits.ptr, c.vocab_size, t, false)?;
        }
        if last {
            let s = self.scratch.as_ref().context("session scratch")?;
            g.rms_norm(p.x.at(4 * (t - 1) * h), m.norm.ptr, s.xn.ptr, 1, h, eps)?;
            g.gemv(&m.lm_head, s.xn.ptr, 0, s.logits.ptr, 1, 0, false)?;
        }
        self.pos += t;
        Ok(())
    }

    /// Layer `i` over the `t` rows of the prefill scratch `x` at positions `pos..pos + t`
    /// (updates that layer's caches; does not move `pos`).
    fn prefill_layer(&self, i: usize, t: usize, prec: Precision) -> Result<()> {
        let m = &self.model;
        let g = &m.gpu;
        let c = &m.cfg;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let p = self.pre.as_ref().context("prefill scratch")?;
        let (layer, st) = (&m.layers[i], &self.states[i]);
        g.rms_norm(p.x.ptr, layer.input_norm.ptr, p.xn.ptr, t, h, eps)?;
        match (&layer.mixer, st) {
            (GMixer::Gdn { proj, conv, dt_bias, neg_a, norm, out }, GState::Gdn { conv: cs, rec }) => {
                let (cd, vd, hv) = (c.gdn_conv_dim(), c.gdn_value_dim(), c.linear_num_value_heads);
                let ldp = cd + vd + 2 * hv;
                proj.run_rows(g, prec, p.xn.ptr, h, p.proj.ptr, ldp, t)?;
                g.conv_prefill(p.proj.ptr, ldp, cs.ptr, conv.ptr, p.conv.ptr, cd, c.linear_conv_kernel_dim, t)?;
                let gp = GdnPrefill {
                    step: super::gdn_step_args(c, p.proj.ptr, p.conv.ptr, [dt_bias, neg_a, norm], rec, p.o.ptr),
                    t,
                    ldy: cd,
                    ldp,
                    qn: p.qn.ptr,
                    kn: p.kn.ptr,
                    kq: p.kq.ptr,
                    chunk: p.gchunk.ptr,
                };
                // the gated norm's output as the out-projection's bf16 input where that runs on
                // gemm_wg (default; LILY_CUDA_GDN_NORM_PERM=0: no), else f32 rows in place
                let o = if gdn_norm_perm_on()
                    && c.linear_value_head_dim.is_multiple_of(64)
                    && g.gemm_takes_wg(GemmKernel::Auto, out, prec, None, t)
                {
                    g.gdn_prefill_to_wg(&gp, prec)?;
                    g.wg_ws
                } else {
                    g.gdn_prefill(&gp, prec)?;
                    p.o.ptr
                };
                g.gemm(out, prec, o, vd, p.x.ptr, h, t, true)?;
            }
            (GMixer::Attn { proj, o, q_norm, k_norm }, GState::Attn { k: kc, v: vc, .. }) => {
                let (nh, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                let (qd, kvd) = (c.q_proj_dim(), c.kv_dim());
                let ldp = qd + 2 * kvd;
                proj.run_rows(g, prec, p.xn.ptr, h, p.proj.ptr, ldp, t)?;
                let prep =
                    super::attn_prep_args(c, p.proj.ptr, [q_norm, k_norm], p.q.ptr, [kc, vc], p.pos.ptr, self.kv);
                g.attn_prep(&prep, t, ldp)?;
                g.attn_prefill(
                    prec,
                    p.q.ptr,
                    kc.ptr,
                    vc.ptr,
                    (p.proj.ptr, ldp),
                    p.o.ptr,
                    (nh, hkv, hd),
                    t,
                    p.pos.ptr,
                    c.attn_output_gate,
                    (self.kv, kc.mapped()),
                )?;
                g.gemm(o, prec, p.o.ptr, nh * hd, p.x.ptr, h, t, true)?;
            }
            _ => bail!("layer state does not match the layer kind"),
        }
        ffn_rows(m, layer, p, t, prec)
    }

    /// Test hook for layer-local error: runs layer `i` alone on the hidden rows `x` (`[t, H]`,
    /// positions `pos..pos + t`) with the batched prefill kernels, and returns its output rows.
    /// The layer's caches are updated; the position is not (run every layer on the same rows'
    /// positions, then [`CudaSession::advance`]).
    pub fn layer_rows(&mut self, i: usize, x: &[f32], prec: Precision) -> Result<Vec<f32>> {
        let h = self.model.cfg.hidden_size;
        if i >= self.model.layers.len() || x.is_empty() || !x.len().is_multiple_of(h) {
            bail!("layer_rows: layer {i} of {}, {} values for hidden size {h}", self.model.layers.len(), x.len());
        }
        let t = x.len() / h;
        self.ensure()?;
        self.ensure_pre(t, 0)?;
        self.grow_kv(self.pos + t)?;
        let p = self.pre.as_ref().context("prefill scratch")?;
        p.x.write_f32(0, x)?;
        p.pos.write_bytes(0, &(self.pos as i32).to_le_bytes())?;
        self.prefill_layer(i, t, prec)?;
        self.pre.as_ref().context("prefill scratch")?.x.read_f32(0, t * h)
    }

    /// Moves the position by `t` after [`CudaSession::layer_rows`] ran every layer.
    pub fn advance(&mut self, t: usize) {
        self.pos += t;
    }
}

/// Whether the many-row MoE runs the shared expert inside the grouped products when it is
/// stacked as expert E. `LILY_CUDA_SHARED_GROUPED=1` always, `=0` never; by default where the
/// expert tiles are skinny ([`skinny_tiles`]: the batched decode step, prompt chunks up to
/// ~1,365 tokens). Measured (docs/perf-log.md, 2026-12-03): +7% at 16 sequences and +4.5% at 64 in
/// the batched step; with 64-row tiles in prefill it was 2-9% slower (the shared expert's rows
/// then run as a few blocks of many passes), with 8-row tiles prefill at 256 tokens went from
/// 7,530-7,541 to 7,904-7,917 tok/s.
fn shared_grouped(skinny_tiles: bool) -> bool {
    static V: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = *V.get_or_init(|| match std::env::var("LILY_CUDA_SHARED_GROUPED").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    });
    forced.unwrap_or(skinny_tiles)
}

/// Whether `pairs` expert rows over `experts` experts run in skinny expert tiles of 8-32 rows
/// ([`skinny_bm`]; bf16, at most `LILY_CUDA_BM8_AVG` rows per expert on average, default 48)
/// rather than 64-row tiles on the pipelined kernel. With skinny tiles an expert's passes run
/// side by side in separate blocks. 48 (1,024-token chunks in 32-row tiles) against 24: prefill
/// at 1,024 tokens 13,397-13,419 → 14,333 tok/s (docs/perf-log.md, 2026-12-03).
fn skinny_tiles(prec: Precision, pairs: usize, experts: usize) -> bool {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let avg = crate::cuda::ops::env_usize(&V, "LILY_CUDA_BM8_AVG", 48);
    prec == Precision::Bf16 && pairs.div_ceil(experts) <= avg
}

/// Rows per expert tile where [`skinny_tiles`], by rows per expert on average: 8 up to 12, 16
/// up to 24, else 32 (`LILY_CUDA_SKINNY_BM` forces 8, 16 or 32). A tile of 16 or 32 rows runs as
/// one pass of the skinny kernel that wide, so an expert with 9-16 (17-32) rows is read once.
fn skinny_bm(pairs: usize, experts: usize) -> usize {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = *V.get_or_init(|| std::env::var("LILY_CUDA_SKINNY_BM").ok().and_then(|v| v.parse().ok()));
    match (forced, pairs.div_ceil(experts)) {
        (Some(b @ (8 | 16 | 32)), _) => b,
        (_, avg) if avg <= 12 => 8,
        (_, avg) if avg <= 24 => 16,
        _ => 32,
    }
}

/// The post-attention half of layer `layer` over the `t` rows of the prefill scratch `x`:
/// RMSNorm, then the MoE (router, top-k, experts grouped by expert, shared expert, combine +
/// residual) or the dense MLP. Shared by the batched prefill and the batched decode step.
pub(super) fn ffn_rows(m: &CudaModel, layer: &GLayer, p: &PScratch, t: usize, prec: Precision) -> Result<()> {
    let g = &m.gpu;
    let c = &m.cfg;
    let (h, eps) = (c.hidden_size, c.rms_norm_eps);
    g.rms_norm(p.x.ptr, layer.post_norm.ptr, p.xn.ptr, t, h, eps)?;
    match &layer.ffn {
        GFfn::Moe { router, experts, shared } => {
            // `inside`: the shared expert as one more routed choice (expert E of the stack,
            // weight sigmoid(gate logit)), so its t rows join the grouped products and the layer
            // has no separate shared-expert launches. With few rows per expert the tiles are 8
            // rows, so the shared expert's t rows run as t/8 blocks side by side rather than t/8
            // passes of one block.
            let (e, k) = (c.num_experts, c.num_experts_per_tok);
            let inside = experts.shared_slot && shared_grouped(skinny_tiles(prec, t * (k + 1), e + 1));
            // slots per token and experts grouped over
            let (slots, grouped) = if inside { (k + 1, e + 1) } else { (k, e) };
            let inter = experts.down.cols;
            let pairs = t * slots;
            router.run_rows(g, prec, p.xn.ptr, h, p.router.ptr, e + 1, t)?;
            g.moe_topk_rows(p.router.ptr, e + 1, t, e, k, c.norm_topk_prob, p.ids.ptr, p.wts.ptr, 0, inside)?;
            let skinny = skinny_tiles(prec, pairs, grouped);
            // Many rows per expert: 128-row tiles on gemm_wg128 (LILY_CUDA_WG_TALL_AVG).
            let tall = !skinny
                && prec == Precision::Bf16
                && wg_tall_avg() > 0
                && pairs >= wg_tall_avg() * grouped
                && g.wg_fits(&experts.gate_up, t)
                && g.wg_fits(&experts.down, pairs);
            let bm = if skinny {
                skinny_bm(pairs, grouped)
            } else if tall {
                128
            } else {
                prec.bm()
            };
            // 16- and 32-row tiles: one pass that wide (Auto caps the pass at 8 rows, the
            // batched step's best).
            let kern = match bm {
                16 | 32 => GemmKernel::Skinny(bm),
                _ if tall && tma_on() => GemmKernel::WtTall,
                _ if tall => GemmKernel::WgTall,
                _ => GemmKernel::Auto,
            };
            g.moe_align(p.ids.ptr, pairs, grouped, bm, p.perm.ptr, p.inv.ptr, p.tiles.ptr)?;
            let tl = (p.tiles.ptr, max_tiles(pairs, bm, grouped), pairs);
            let gu = (p.egu.ptr, 2 * inter);
            g.gemm_grouped_with(kern, &experts.gate_up, prec, 2 * inter, (p.xn.ptr, h, p.perm.ptr, slots), gu, tl)?;
            let eh = silu_then(g, &experts.down, prec, kern, Some(h), p.egu.ptr, p.eh.ptr, inter, pairs)?;
            g.gemm_grouped_with(kern, &experts.down, prec, h, (eh, inter, 0, 1), (p.ye.ptr, h), tl)?;
            let (ys, gate) = if inside {
                (0, (0, 0))
            } else {
                shared.gate_up.run_rows(g, prec, p.xn.ptr, h, p.sgu.ptr, 2 * shared.inter, t)?;
                let sh =
                    silu_then(g, &shared.down, prec, GemmKernel::Auto, None, p.sgu.ptr, p.sh.ptr, shared.inter, t)?;
                g.gemm(&shared.down, prec, sh, shared.inter, p.ys.ptr, h, t, false)?;
                (p.ys.ptr, (p.router.at(4 * e), e + 1))
            };
            g.moe_combine_rows(p.x.ptr, p.ye.ptr, p.inv.ptr, p.wts.ptr, ys, gate, h, slots, t)?;
        }
        GFfn::Dense(mm) => {
            mm.gate_up.run_rows(g, prec, p.xn.ptr, h, p.sgu.ptr, 2 * mm.inter, t)?;
            let sh = silu_then(g, &mm.down, prec, GemmKernel::Auto, None, p.sgu.ptr, p.sh.ptr, mm.inter, t)?;
            g.gemm(&mm.down, prec, sh, mm.inter, p.x.ptr, h, t, true)?;
        }
    }
    Ok(())
}

/// `silu(gate) ⊙ up` of `rows` gate/up pairs (width n) for the down projection `down` (grouped
/// into matrices of its output width when `grouped`): where that product runs on gemm_wg, as
/// its bf16 input straight into its workspace (the default; `LILY_CUDA_SILU_PERM=0`: no), else
/// into `h` as f32. Returns the product's input pointer.
#[allow(clippy::too_many_arguments)]
fn silu_then(
    g: &crate::cuda::Gpu,
    down: &crate::cuda::ops::GpuLinear,
    prec: Precision,
    kern: GemmKernel,
    grouped: Option<usize>,
    gu: u64,
    h: u64,
    n: usize,
    rows: usize,
) -> Result<u64> {
    if silu_perm_on() && g.gemm_takes_wg(kern, down, prec, grouped, rows) {
        g.silu_mul_pairs_perm(gu, n, rows)?;
        return Ok(g.wg_ws);
    }
    g.silu_mul_pairs(gu, h, n, rows)?;
    Ok(h)
}
