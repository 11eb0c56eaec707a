//! The batched decode step on the GPU: B sequences, one token each, in one pass.
//!
//! Each slot is a [`CudaSession`] (its KV caches, GDN states, position, its own prefill). A
//! step whose items are all single tokens of two or more sequences runs as one pass over
//! `[B, ·]` activations in the prefill scratch of a driver session:
//!
//! embed B rows → per layer {mixer input projections as one multi-slot GEMV with the RMSNorm
//! fused (the slots' blocks read each weight tile at about the same time, so it comes from HBM
//! about once) → GDN: one batched conv_step and one batched gdn_step over all rows, each row on
//! its own slot's states (address tables); attention: one batched attn_prep, attn_decode and
//! attn_combine over all rows, each on its own slot's cache (address tables; one row at a time
//! when the slots straddle the long-context kernel switch) → out-projection + residual as one
//! multi-slot GEMV → router, shared expert and routed experts as multi-slot GEMVs (one slot per
//! row and choice, the expert's matrix picked by id on the device) → combine} → final RMSNorm + lm_head (GEMV slots for up to 4 rows, else one many-row product)
//! → one argmax launch over the B rows; rows that sample draw with `sample_io` as a lone step
//! does (same parameters, seed and step count), after the pass.
//!
//! The pass is captured as a CUDA graph per row count (and attention plan), reused whichever
//! slots fill the rows: tokens, positions and the rows' state and cache addresses come from
//! device tables written before each replay (the tables only when the slots change). Slots
//! straddling the long-context attention switch run attention one row at a time with their own
//! cache addresses in the launches; that pass is captured for its exact slots. One sequence
//! alone, or a prompt chunk, takes its session's own path (the batch-1 decode graph, the
//! chunked prefill), so batch 1 keeps its fastest path.
//!
//! Products use the session's prefill precision: bf16 tensor cores by default, fp32 in the exact
//! mode (then a batched step equals the same steps alone to fp32 rounding).

use super::{attn_prep_args, gdn_step_args, CudaModel, CudaSession, GFfn, GLayer, GMixer, GState, Proj};
use crate::cuda::ops::{AttnDecode, AttnRows, GdnRows, Precision};
use crate::cuda::{DevBuf, GpuLinear, Graph, PagedBuf};
use crate::engine::batch::{Batched, Out, Work};
use crate::engine::picker::Want;
use crate::generate::{Session, Snapshot};
use anyhow::{bail, Context, Result};
use std::sync::Arc;

/// The slots in row order, each with its attention kernel choice and the addresses of its
/// caches: what the device tables were written for.
#[derive(PartialEq, Eq, Hash, Clone)]
struct Key {
    slots: Vec<(usize, bool, Vec<u64>)>,
}

/// What a captured pass depends on beyond the device tables: the row count and the one
/// attention plan of all rows (`long`: the long-context kernels), or, for rows on both sides of
/// the long-context switch (their attention launches carry each row's caches), the exact slots.
#[derive(PartialEq, Eq, Hash, Clone)]
enum GraphKey {
    Rows { b: usize, long: bool },
    Slots(Key),
}

/// Most captured passes kept (row counts x the two attention plans, plus a straddling one).
const MAX_GRAPHS: usize = 160;

/// Per-row device buffers of the batched pass, for up to `cap` rows.
struct Rows {
    cap: usize,
    /// Position of each row's token (i32).
    pos: DevBuf,
    /// Each row's argmax token (i32).
    amax: DevBuf,
    /// Attention split partials (shared by the rows, which run one after another).
    part: DevBuf,
    /// Per layer the rows' GDN conv and recurrent state addresses (u64 `[layers, 2, cap]`).
    tab: DevBuf,
    /// Gate/up matrix ids of each row's choices (i32 `[cap, 2K]`).
    ids2: DevBuf,
    /// Per layer the rows' K and V cache addresses (u64 `[layers, cap, 2]`).
    kvt: DevBuf,
    /// The sampled rows' `sample_io` state (i32 `[cap, 3]`) and parameters (`[cap, 24]` bytes).
    sio: DevBuf,
    sp: DevBuf,
}

pub struct CudaBatch {
    model: Arc<CudaModel>,
    seqs: Vec<CudaSession>,
    /// Owns the `[B, ·]` scratch of the batched pass (its prefill scratch), never a sequence.
    driver: CudaSession,
    rows: Option<Rows>,
    /// The slots the state tables were written for.
    tables_for: Option<Key>,
    graphs: std::collections::HashMap<GraphKey, Graph>,
    prec: Precision,
    /// Most rows whose lm_head runs as GEMV slots (`LILY_CUDA_LMHEAD_GEMV_ROWS`, default 4).
    lm_head_gemv_rows: usize,
    /// From this many rows the projections and experts run as many-row products (the skinny
    /// tensor-core kernel, experts grouped by expert) instead of GEMV slots
    /// (`LILY_CUDA_BATCH_GEMM_FROM`).
    gemm_from: usize,
    /// The same switch for the mixers' input and output projections
    /// (`LILY_CUDA_BATCH_PROJ_GEMM_FROM`, default `gemm_from`); the router and the shared expert
    /// follow the experts.
    proj_gemm_from: usize,
}

impl CudaBatch {
    /// `slots` sessions made by `make` (each configured as the caller's sessions are: KV type,
    /// precision); the driver is one more.
    pub fn new(model: Arc<CudaModel>, slots: usize, make: impl Fn() -> CudaSession) -> Result<CudaBatch> {
        if slots == 0 {
            bail!("no slots");
        }
        let seqs: Vec<CudaSession> = (0..slots).map(|_| make()).collect();
        let driver = make();
        let prec = driver.prefill.unwrap_or(Precision::Bf16);
        let lm_head_gemv_rows =
            std::env::var("LILY_CUDA_LMHEAD_GEMV_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
        let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
        let gemm_from = var("LILY_CUDA_BATCH_GEMM_FROM").unwrap_or(8);
        let proj_gemm_from = var("LILY_CUDA_BATCH_PROJ_GEMM_FROM").unwrap_or(gemm_from);
        Ok(CudaBatch {
            model,
            seqs,
            driver,
            rows: None,
            tables_for: None,
            graphs: Default::default(),
            prec,
            lm_head_gemv_rows,
            gemm_from,
            proj_gemm_from,
        })
    }

    /// Sets the row count from which the pass uses many-row products (drops the captured graphs).
    pub fn set_gemm_from(&mut self, rows: usize) {
        self.gemm_from = rows.max(2);
        self.proj_gemm_from = self.gemm_from;
        self.graphs.clear();
    }

    fn key(&self, slots: &[usize]) -> Key {
        let slots = slots
            .iter()
            .map(|&s| {
                let q = &self.seqs[s];
                let ptrs = q
                    .states
                    .iter()
                    .flat_map(|st| match st {
                        GState::Gdn { conv, rec } => [conv.ptr, rec.ptr],
                        GState::Attn { k, v, .. } => [k.ptr, v.ptr],
                    })
                    .collect();
                (s, q.long_attn(q.pos), ptrs)
            })
            .collect();
        Key { slots }
    }

    /// Scratch for `b` rows (kept while large enough; a new one drops the graphs).
    fn ensure_rows(&mut self, b: usize) -> Result<()> {
        if self.rows.as_ref().is_some_and(|r| r.cap >= b) {
            return Ok(());
        }
        let cap = b.next_power_of_two().max(8);
        self.driver.ensure()?;
        self.driver.ensure_pre(cap, cap)?;
        let g = &self.model.gpu;
        let c = &self.model.cfg;
        let splits = self.driver.attn[0].1.max(self.driver.attn[1].1);
        let part = g.zeros(4 * cap * c.num_attention_heads * splits * (c.head_dim + 2))?;
        let tab = g.zeros(8 * 2 * self.model.layers.len() * cap)?;
        let ids2 = g.zeros(4 * 2 * cap * c.num_experts_per_tok.max(1))?;
        let kvt = g.zeros(8 * 2 * self.model.layers.len() * cap)?;
        let (sio, sp) = (g.zeros(12 * cap)?, g.zeros(24 * cap)?);
        self.rows = Some(Rows { cap, pos: g.zeros(4 * cap)?, amax: g.zeros(4 * cap)?, part, tab, ids2, kvt, sio, sp });
        self.graphs.clear();
        self.tables_for = None;
        Ok(())
    }

    /// Writes the per-layer tables of the slots' GDN conv and recurrent state addresses (read
    /// by the batched conv_step / gdn_step of the captured pass).
    fn write_tables(&self, slots: &[usize]) -> Result<()> {
        let r = self.rows.as_ref().context("batch rows")?;
        let (cap, tab) = (r.cap, &r.tab);
        let mut t = vec![0u64; 2 * self.model.layers.len() * cap];
        let mut kv = t.clone();
        for (li, _) in self.model.layers.iter().enumerate() {
            for (i, &s) in slots.iter().enumerate() {
                match &self.seqs[s].states[li] {
                    GState::Gdn { conv, rec } => {
                        t[2 * li * cap + i] = conv.ptr;
                        t[(2 * li + 1) * cap + i] = rec.ptr;
                    }
                    GState::Attn { k, v, .. } => {
                        kv[2 * (li * cap + i)] = k.ptr;
                        kv[2 * (li * cap + i) + 1] = v.ptr;
                    }
                }
            }
        }
        let bytes = |t: &[u64]| t.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        tab.write_bytes(0, &bytes(&t))?;
        r.kvt.write_bytes(0, &bytes(&kv))
    }

    /// `out = W · rms_norm(x)` for `b` rows (output row stride `ldo`, the projection's height):
    /// one multi-slot GEMV when the parts are fused, else the norm and one many-row product per part.
    #[allow(clippy::too_many_arguments)]
    fn proj_rows(&self, proj: &Proj, x: u64, norm: (u64, f32), out: u64, ldo: usize, b: usize) -> Result<()> {
        let (g, h) = (&self.model.gpu, self.model.cfg.hidden_size);
        match &proj.fused {
            Some(f) if b < self.proj_gemm_from => g.gemv_rows(f, x, h, out, b, false, norm),
            _ => {
                let p = self.driver.pre.as_ref().context("batch scratch")?;
                g.rms_norm(x, norm.0, p.xn.ptr, b, h, norm.1)?;
                proj.run_rows(g, self.prec, p.xn.ptr, h, out, ldo, b)
            }
        }
    }

    /// `x += W · o` for `b` rows (an out-projection and its residual).
    fn out_rows(&self, w: &GpuLinear, o: u64, k: usize, x: u64, b: usize) -> Result<()> {
        let g = &self.model.gpu;
        if b < self.proj_gemm_from {
            g.gemv_rows(w, o, k, x, b, true, (0, 0.0))
        } else {
            g.gemm(w, self.prec, o, k, x, self.model.cfg.hidden_size, b, true)
        }
    }

    /// Whether every slot is on the same side of the long-context attention switch (then the
    /// rows' attention runs as batched launches over the cache table).
    fn one_plan(&self, slots: &[usize]) -> bool {
        let first = &self.seqs[slots[0]];
        slots.iter().all(|&s| self.seqs[s].long_attn(self.seqs[s].pos) == first.long_attn(first.pos))
    }

    /// Queues the batched pass over `slots` (row i = slot `slots[i]`).
    fn record(&self, slots: &[usize]) -> Result<()> {
        let m = &self.model;
        let (g, c) = (&m.gpu, &m.cfg);
        let (h, eps, b, prec) = (c.hidden_size, c.rms_norm_eps, slots.len(), self.prec);
        let p = self.driver.pre.as_ref().context("batch scratch")?;
        let rows = self.rows.as_ref().context("batch rows")?;
        let (pos, amax, part, cap, tab) = (&rows.pos, &rows.amax, &rows.part, rows.cap, &rows.tab);
        // One attention plan for all rows (every slot is on the same side of the long-context
        // switch): batched attention launches; else one row at a time.
        let first = &self.seqs[slots[0]];
        let one_plan = self.one_plan(slots);
        g.embed(&m.embed, p.toks.ptr, p.x.ptr, b)?;
        for (li, layer) in m.layers.iter().enumerate() {
            let in_norm = (layer.input_norm.ptr, eps);
            match &layer.mixer {
                GMixer::Gdn { proj, conv, dt_bias, neg_a, norm, out } => {
                    let (cd, vd, hv) = (c.gdn_conv_dim(), c.gdn_value_dim(), c.linear_num_value_heads);
                    let ldp = cd + vd + 2 * hv;
                    self.proj_rows(proj, p.x.ptr, in_norm, p.proj.ptr, ldp, b)?;
                    let GState::Gdn { rec, .. } = &self.seqs[slots[0]].states[li] else {
                        bail!("layer state does not match the layer kind");
                    };
                    let table = |k: usize| tab.at(8 * (2 * li + k) * cap);
                    let conv_rows = GdnRows { rows: b, states: table(0), ldy: cd, ldp, ldo: 0 };
                    g.conv_step_rows(p.proj.ptr, 0, conv.ptr, p.conv.ptr, cd, c.linear_conv_kernel_dim, &conv_rows)?;
                    let step = gdn_step_args(c, p.proj.ptr, p.conv.ptr, [dt_bias, neg_a, norm], rec, p.o.ptr);
                    g.gdn_step_rows(&step, &GdnRows { rows: b, states: table(1), ldy: cd, ldp, ldo: vd })?;
                    self.out_rows(out, p.o.ptr, vd, p.x.ptr, b)?;
                }
                GMixer::Attn { proj, o, q_norm, k_norm } => {
                    let (nh, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                    let (qd, kvd, od) = (c.q_proj_dim(), c.kv_dim(), nh * hd);
                    let ldp = qd + 2 * kvd;
                    self.proj_rows(proj, p.x.ptr, in_norm, p.proj.ptr, ldp, b)?;
                    let decode = |splits: usize, i: usize, kc: &PagedBuf, vc: &PagedBuf, kv| AttnDecode {
                        q: p.q.at(4 * i * od),
                        kc: kc.ptr,
                        vc: vc.ptr,
                        qg: p.proj.at(4 * i * ldp),
                        out: p.o.at(4 * i * od),
                        nh,
                        hkv,
                        hd,
                        pos: pos.at(4 * i),
                        gated: c.attn_output_gate,
                        part: part.ptr,
                        splits,
                        kv,
                        early: false,
                    };
                    if one_plan {
                        let GState::Attn { k: kc, v: vc, .. } = &first.states[li] else {
                            bail!("layer state does not match the layer kind");
                        };
                        let kvt = rows.kvt.at(8 * 2 * li * cap);
                        let prep =
                            attn_prep_args(c, p.proj.ptr, [q_norm, k_norm], p.q.ptr, [kc, vc], pos.ptr, first.kv);
                        g.attn_prep_rows(&prep, b, ldp, kvt)?;
                        let plan = first.attn[first.long_attn(first.pos) as usize];
                        let (kernel, splits) = g.attn_rows_plan(plan, nh, hkv, b);
                        let rows = AttnRows { rows: b, kvt, ldqg: ldp };
                        g.attn_decode_rows(&decode(splits, 0, kc, vc, first.kv), kernel, &rows)?;
                    } else {
                        for (i, &s) in slots.iter().enumerate() {
                            let q = &self.seqs[s];
                            let GState::Attn { k: kc, v: vc, .. } = &q.states[li] else {
                                bail!("layer state does not match the layer kind");
                            };
                            let (pr, qr) = (p.proj.at(4 * i * ldp), p.q.at(4 * i * od));
                            g.attn_prep(
                                &attn_prep_args(c, pr, [q_norm, k_norm], qr, [kc, vc], pos.at(4 * i), q.kv),
                                1,
                                0,
                            )?;
                            let (kernel, splits) = q.attn[q.long_attn(q.pos) as usize];
                            g.attn_decode(&decode(splits, i, kc, vc, q.kv), kernel)?;
                        }
                    }
                    self.out_rows(o, p.o.ptr, od, p.x.ptr, b)?;
                }
            }
            self.ffn(layer, b)?;
        }
        // The lm_head: GEMV slots for few rows, else one many-row product (over its 250+ MB the
        // slots' GEMV blocks need not meet in L2).
        if b <= self.lm_head_gemv_rows {
            g.gemv_rows(&m.lm_head, p.x.ptr, h, p.logits.ptr, b, false, (m.norm.ptr, eps))?;
        } else {
            g.rms_norm(p.x.ptr, m.norm.ptr, p.xn.ptr, b, h, eps)?;
            g.gemm(&m.lm_head, prec, p.xn.ptr, h, p.logits.ptr, c.vocab_size, b, false)?;
        }
        g.argmax_rows(p.logits.ptr, c.vocab_size, amax.ptr, b)
    }

    /// The post-attention half of a layer for the `b` rows, all as multi-slot GEMVs: router
    /// and shared expert (or the dense MLP) with the RMSNorm fused; the routed experts with one
    /// slot per (row, choice) reading the expert's matrix by id (rows that chose the same expert
    /// meet in L2), then the weighted combine + residual.
    fn ffn(&self, layer: &GLayer, b: usize) -> Result<()> {
        let m = &self.model;
        let (g, c) = (&m.gpu, &m.cfg);
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let p = self.driver.pre.as_ref().context("batch scratch")?;
        let ids2 = self.rows.as_ref().context("batch rows")?.ids2.ptr;
        let post = (layer.post_norm.ptr, eps);
        if b >= self.gemm_from {
            return super::prefill::ffn_rows(m, layer, p, b, self.prec);
        }
        match &layer.ffn {
            GFfn::Moe { router, experts, shared } => {
                let (e, k) = (c.num_experts, c.num_experts_per_tok);
                let inter = experts.down.cols;
                let pairs = b * k;
                self.proj_rows(router, p.x.ptr, post, p.router.ptr, e + 1, b)?;
                g.rms_norm(p.x.ptr, layer.post_norm.ptr, p.xn.ptr, b, h, eps)?;
                g.moe_topk_rows(p.router.ptr, e + 1, b, e, k, c.norm_topk_prob, p.ids.ptr, p.wts.ptr, ids2, false)?;
                g.gemv_pairs(&experts.gate_up, p.xn.ptr, h, 2 * k, p.egu.ptr, 2 * pairs, ids2)?;
                g.silu_mul_pairs(p.egu.ptr, p.eh.ptr, inter, pairs)?;
                g.gemv_pairs(&experts.down, p.eh.ptr, inter, 1, p.ye.ptr, pairs, p.ids.ptr)?;
                self.proj_rows(&shared.gate_up, p.x.ptr, post, p.sgu.ptr, 2 * shared.inter, b)?;
                g.silu_mul_pairs(p.sgu.ptr, p.sh.ptr, shared.inter, b)?;
                g.gemv_rows(&shared.down, p.sh.ptr, shared.inter, p.ys.ptr, b, false, (0, 0.0))?;
                let gate = (p.router.at(4 * e), e + 1);
                g.moe_combine_rows(p.x.ptr, p.ye.ptr, 0, p.wts.ptr, p.ys.ptr, gate, h, k, b)
            }
            GFfn::Dense(mm) => {
                self.proj_rows(&mm.gate_up, p.x.ptr, post, p.sgu.ptr, 2 * mm.inter, b)?;
                g.silu_mul_pairs(p.sgu.ptr, p.sh.ptr, mm.inter, b)?;
                g.gemv_rows(&mm.down, p.sh.ptr, mm.inter, p.x.ptr, b, true, (0, 0.0))
            }
        }
    }

    /// One batched pass over the single-token items `work` (two or more, distinct slots).
    fn decode_batch(&mut self, work: &[&Work]) -> Result<Vec<Out>> {
        let b = work.len();
        let slots: Vec<usize> = work.iter().map(|w| w.slot).collect();
        for &s in &slots {
            let q = &mut self.seqs[s];
            q.ensure()?;
            q.grow_kv(q.pos + 1)?;
        }
        self.ensure_rows(b)?;
        let g = self.model.gpu.clone();
        g.bind()?;
        let p = self.driver.pre.as_ref().context("batch scratch")?;
        let toks: Vec<u8> = work.iter().flat_map(|w| (w.tokens[0] as i32).to_le_bytes()).collect();
        p.toks.write_bytes(0, &toks)?;
        let pos: Vec<u8> = slots.iter().flat_map(|&s| (self.seqs[s].pos as i32).to_le_bytes()).collect();
        self.rows.as_ref().context("batch rows")?.pos.write_bytes(0, &pos)?;
        let key = self.key(&slots);
        if self.tables_for.as_ref() != Some(&key) {
            self.write_tables(&slots)?;
            self.tables_for = Some(key.clone());
        }
        if self.driver.use_graphs {
            let gk = if self.one_plan(&slots) {
                let first = &self.seqs[slots[0]];
                GraphKey::Rows { b, long: first.long_attn(first.pos) }
            } else {
                GraphKey::Slots(key)
            };
            if !self.graphs.contains_key(&gk) {
                // At most one straddling pass; a full map starts over.
                if matches!(gk, GraphKey::Slots(_)) {
                    self.graphs.retain(|k, _| matches!(k, GraphKey::Rows { .. }));
                }
                if self.graphs.len() >= MAX_GRAPHS {
                    self.graphs.clear();
                }
                let graph = g.capture(|| self.record(&slots))?;
                self.graphs.insert(gk.clone(), graph);
            }
            g.replay(&self.graphs[&gk])?;
        } else {
            self.record(&slots)?;
        }
        for &s in &slots {
            self.seqs[s].pos += 1;
        }
        let v = self.model.cfg.vocab_size;
        let p = self.driver.pre.as_ref().context("batch scratch")?;
        let rows = self.rows.as_ref().context("batch rows")?;
        // Sampled rows draw on the device as a lone session's step does (sample_io with the
        // draw's seed and step count 0), so a sequence gets the same tokens batched or alone;
        // the token lands in the row's argmax slot.
        let samples: Vec<(usize, u64)> = (0..b)
            .filter_map(|i| match work[i].want {
                Want::Sample(seed) => Some((i, seed)),
                _ => None,
            })
            .collect();
        if !samples.is_empty() {
            let mut sp = Vec::with_capacity(24 * samples.len());
            for &(i, seed) in &samples {
                sp.extend(crate::cuda::ops::sampling_params_bytes(work[i].sampling, seed)?);
            }
            rows.sp.write_bytes(0, &sp)?;
            rows.sio.write_bytes(0, &vec![0u8; 12 * samples.len()])?;
            let ws = self.driver.scratch.as_ref().context("driver scratch")?.pick_ws.ptr;
            for (j, &(i, _)) in samples.iter().enumerate() {
                g.sample_io(
                    p.logits.at(4 * i * v),
                    v,
                    rows.sio.at(12 * j),
                    rows.amax.at(4 * i),
                    rows.sp.at(24 * j),
                    ws,
                )?;
            }
        }
        let amax = rows.amax.read_i32(b)?;
        let mut outs = Vec::with_capacity(b);
        for (i, w) in work.iter().enumerate() {
            outs.push(match w.want {
                Want::Logits => Out::Logits(p.logits.read_f32(i * v, v)?),
                Want::Greedy | Want::Sample(_) => Out::Token(amax[i] as u32),
            });
        }
        Ok(outs)
    }
}

impl Batched for CudaBatch {
    fn slots(&self) -> usize {
        self.seqs.len()
    }
    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }
    fn max_positions(&self) -> usize {
        self.model.cfg.max_position_embeddings
    }
    fn pos(&self, slot: usize) -> usize {
        self.seqs[slot].pos
    }
    /// Empties the slot and hands its KV pages back to the pool (the scheduler has released
    /// their reservation).
    fn reset(&mut self, slot: usize) {
        let s = &mut self.seqs[slot];
        s.reset();
        if let Err(e) = s.release_kv() {
            eprintln!("warning: slot {slot}: KV pages not released: {e:#}");
        }
    }
    /// One page of the GPU pool per attention layer's K and V ([`crate::cuda::PagedBuf`]): the
    /// positions of one layer's cache row that fill a page.
    fn kv_page_tokens(&self) -> Option<usize> {
        let c = &self.model.cfg;
        let row = self.seqs[0].kv.pos_bytes(c.num_key_value_heads, c.head_dim);
        let (page, _, _) = self.model.gpu.kv_pages().ok()?;
        Some((page / row.max(1)).max(1))
    }
    fn limit_kv_pages(&mut self, pages: usize) {
        let tensors =
            2 * self.model.cfg.layer_kinds.iter().filter(|k| matches!(k, crate::config::LayerKind::Attention)).count();
        self.model.gpu.set_kv_page_limit(Some(pages.saturating_mul(tensors)));
    }
    fn snapshot(&self, slot: usize) -> Snapshot {
        self.seqs[slot].snapshot()
    }
    fn restore(&mut self, slot: usize, snap: &Snapshot) -> Result<()> {
        self.seqs[slot].restore(snap)
    }
    fn step(&mut self, work: &[Work]) -> Result<Vec<Out>> {
        let (n, c) = (self.seqs.len(), &self.model.cfg);
        crate::engine::batch::check_work(work, n, c.vocab_size, c.max_position_embeddings, |s| self.seqs[s].pos)?;
        let single: Vec<usize> = (0..work.len()).filter(|&i| work[i].tokens.len() == 1).collect();
        let mut outs: Vec<Option<Out>> = (0..work.len()).map(|_| None).collect();
        if single.len() >= 2 {
            let items: Vec<&Work> = single.iter().map(|&i| &work[i]).collect();
            for (&i, o) in single.iter().zip(self.decode_batch(&items)?) {
                outs[i] = Some(o);
            }
        }
        for (i, w) in work.iter().enumerate() {
            if outs[i].is_none() {
                // The slots run their prompts one after another, so they borrow the driver's
                // prefill scratch (hundreds of MB at 2,048-token chunks) instead of each keeping
                // its own; if it grows, the captured pass (which reads it) is dropped.
                let before = self.driver.pre.as_ref().map(|p| p.id);
                let q = &mut self.seqs[w.slot];
                std::mem::swap(&mut q.pre, &mut self.driver.pre);
                let out = crate::engine::batch::session_step(q, w);
                std::mem::swap(&mut q.pre, &mut self.driver.pre);
                if self.driver.pre.as_ref().map(|p| p.id) != before {
                    self.graphs.clear();
                }
                outs[i] = Some(out?);
            }
        }
        Ok(outs.into_iter().map(|o| o.expect("every item answered")).collect())
    }
}
