//! The batched decode step on the GPU: B sequences, one token each, in one pass.
//!
//! Each slot is a [`CudaSession`] (its KV caches, GDN states, position, its own prefill). A
//! step whose items are all single tokens of two or more sequences runs as one pass over
//! `[B, ·]` activations in the prefill scratch of a driver session:
//!
//! embed B rows → per layer {RMSNorm (B rows) → mixer input projections as one many-row product
//! (weights read once for all B) → per row, on that row's own slot: conv_step + gdn_step (GDN)
//! or attn_prep + attn_decode (attention, the slot's kernel for its context) → out-projection
//! and residual as one product → the FFN of the batched prefill (router, top-k, experts grouped
//! by expert across the B sequences, shared expert, combine)} → final RMSNorm → lm_head over
//! the B rows → a device argmax per row.
//!
//! The pass is captured as a CUDA graph, reused while the same slots (with the same cache
//! buffers and attention kernels) step together; tokens and positions come from device buffers
//! written once per step. One sequence alone, or a prompt chunk, takes its session's own path
//! (the batch-1 decode graph, the chunked prefill), so batch 1 keeps its fastest path.
//!
//! Products use the session's prefill precision: bf16 tensor cores by default, fp32 in the exact
//! mode (then a batched step equals the same steps alone to fp32 rounding).

use super::{attn_prep_args, gdn_step_args, prefill::ffn_rows, CudaModel, CudaSession, GMixer, GState};
use crate::cuda::ops::{AttnDecode, Precision};
use crate::cuda::{DevBuf, Graph};
use crate::engine::batch::{Batched, Out, Work};
use crate::engine::picker::Want;
use crate::generate::{Session, Snapshot};
use crate::sampling::{Sampler, SamplingParams};
use anyhow::{bail, Context, Result};
use std::sync::Arc;

/// What a captured batch graph was recorded for: the slots in row order, each with its
/// attention kernel choice and the addresses of its caches.
#[derive(PartialEq, Eq, Clone)]
struct Key {
    slots: Vec<(usize, bool, Vec<u64>)>,
}

pub struct CudaBatch {
    model: Arc<CudaModel>,
    seqs: Vec<CudaSession>,
    /// Owns the `[B, ·]` scratch of the batched pass (its prefill scratch), never a sequence.
    driver: CudaSession,
    /// Per row: position (i32) and the argmax token (i32); attention split partials.
    rows: Option<(DevBuf, DevBuf, DevBuf, usize)>,
    graph: Option<(Key, Graph)>,
    prec: Precision,
    kv_bytes_per_token: usize,
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
        let kv = driver.kv_dtype();
        let c = &model.cfg;
        let n_attn = c.layer_kinds.iter().filter(|k| matches!(k, crate::config::LayerKind::Attention)).count();
        let kv_bytes_per_token = n_attn * 2 * c.kv_dim() * kv.bytes();
        Ok(CudaBatch { model, seqs, driver, rows: None, graph: None, prec, kv_bytes_per_token })
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

    /// Scratch for `b` rows (kept while large enough; a new one drops the graph).
    fn ensure_rows(&mut self, b: usize) -> Result<()> {
        if self.rows.as_ref().is_some_and(|r| r.3 >= b) {
            return Ok(());
        }
        let cap = b.next_power_of_two().max(8);
        self.driver.ensure()?;
        self.driver.ensure_pre(cap, cap)?;
        let g = &self.model.gpu;
        let c = &self.model.cfg;
        let splits = self.driver.attn[0].1.max(self.driver.attn[1].1);
        let part = g.zeros(4 * c.num_attention_heads * splits * (c.head_dim + 2))?;
        self.rows = Some((g.zeros(4 * cap)?, g.zeros(4 * cap)?, part, cap));
        self.graph = None;
        Ok(())
    }

    /// Queues the batched pass over `slots` (row i = slot `slots[i]`).
    fn record(&self, slots: &[usize]) -> Result<()> {
        let m = &self.model;
        let (g, c) = (&m.gpu, &m.cfg);
        let (h, eps, b, prec) = (c.hidden_size, c.rms_norm_eps, slots.len(), self.prec);
        let p = self.driver.pre.as_ref().context("batch scratch")?;
        let (pos, amax, part, _) = self.rows.as_ref().context("batch rows")?;
        g.embed(&m.embed, p.toks.ptr, p.x.ptr, b)?;
        for (li, layer) in m.layers.iter().enumerate() {
            g.rms_norm(p.x.ptr, layer.input_norm.ptr, p.xn.ptr, b, h, eps)?;
            match &layer.mixer {
                GMixer::Gdn { proj, conv, dt_bias, neg_a, norm, out } => {
                    let (cd, vd, hv) = (c.gdn_conv_dim(), c.gdn_value_dim(), c.linear_num_value_heads);
                    let ldp = cd + vd + 2 * hv;
                    proj.run_rows(g, prec, p.xn.ptr, h, p.proj.ptr, ldp, b)?;
                    for (i, &s) in slots.iter().enumerate() {
                        let GState::Gdn { conv: cs, rec } = &self.seqs[s].states[li] else {
                            bail!("layer state does not match the layer kind");
                        };
                        let (pr, cr, or) = (p.proj.at(4 * i * ldp), p.conv.at(4 * i * cd), p.o.at(4 * i * vd));
                        g.conv_step(pr, cs.ptr, conv.ptr, cr, cd, c.linear_conv_kernel_dim)?;
                        g.gdn_step(&gdn_step_args(c, pr, cr, [dt_bias, neg_a, norm], rec, or))?;
                    }
                    g.gemm(out, prec, p.o.ptr, vd, p.x.ptr, h, b, true)?;
                }
                GMixer::Attn { proj, o, q_norm, k_norm } => {
                    let (nh, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                    let (qd, kvd, od) = (c.q_proj_dim(), c.kv_dim(), nh * hd);
                    let ldp = qd + 2 * kvd;
                    proj.run_rows(g, prec, p.xn.ptr, h, p.proj.ptr, ldp, b)?;
                    for (i, &s) in slots.iter().enumerate() {
                        let q = &self.seqs[s];
                        let GState::Attn { k: kc, v: vc, .. } = &q.states[li] else {
                            bail!("layer state does not match the layer kind");
                        };
                        let (pr, qr, or, pp) = (p.proj.at(4 * i * ldp), p.q.at(4 * i * od), p.o.at(4 * i * od), pos.at(4 * i));
                        g.attn_prep(&attn_prep_args(c, pr, [q_norm, k_norm], qr, [kc, vc], pp, q.kv), 1, 0)?;
                        let long = q.long_attn(q.pos) as usize;
                        let a = AttnDecode {
                            q: qr,
                            kc: kc.ptr,
                            vc: vc.ptr,
                            qg: pr,
                            out: or,
                            nh,
                            hkv,
                            hd,
                            pos: pp,
                            gated: c.attn_output_gate,
                            part: part.ptr,
                            splits: q.attn[long].1,
                            kv: q.kv,
                        };
                        g.attn_decode(&a, q.attn[long].0)?;
                    }
                    g.gemm(o, prec, p.o.ptr, od, p.x.ptr, h, b, true)?;
                }
            }
            ffn_rows(m, layer, p, b, prec)?;
        }
        g.rms_norm(p.x.ptr, m.norm.ptr, p.xn.ptr, b, h, eps)?;
        g.gemm(&m.lm_head, prec, p.xn.ptr, h, p.logits.ptr, c.vocab_size, b, false)?;
        for i in 0..b {
            g.argmax(p.logits.at(4 * i * c.vocab_size), c.vocab_size, amax.at(4 * i))?;
        }
        Ok(())
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
        self.rows.as_ref().context("batch rows")?.0.write_bytes(0, &pos)?;
        if self.driver.use_graphs {
            let key = self.key(&slots);
            if self.graph.as_ref().is_none_or(|(k, _)| *k != key) {
                self.graph = None;
                let graph = g.capture(|| self.record(&slots))?;
                self.graph = Some((key, graph));
            }
            g.replay(&self.graph.as_ref().expect("captured").1)?;
        } else {
            self.record(&slots)?;
        }
        for &s in &slots {
            self.seqs[s].pos += 1;
        }
        let v = self.model.cfg.vocab_size;
        let p = self.driver.pre.as_ref().context("batch scratch")?;
        let amax = self.rows.as_ref().context("batch rows")?.1.read_i32(b)?;
        let mut outs = Vec::with_capacity(b);
        for (i, w) in work.iter().enumerate() {
            outs.push(match w.want {
                Want::Greedy => Out::Token(amax[i] as u32),
                Want::Logits => Out::Logits(p.logits.read_f32(i * v, v)?),
                Want::Sample(seed) => {
                    let l = p.logits.read_f32(i * v, v)?;
                    Out::Token(Sampler::new(SamplingParams { seed, ..w.sampling.clone() }).sample(&l))
                }
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
    fn reset(&mut self, slot: usize) {
        self.seqs[slot].reset()
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
                outs[i] = Some(crate::engine::batch::session_step(&mut self.seqs[w.slot], w)?);
            }
        }
        Ok(outs.into_iter().map(|o| o.expect("every item answered")).collect())
    }
    fn kv_bytes_per_token(&self) -> usize {
        self.kv_bytes_per_token
    }
    fn shares_weights(&self) -> bool {
        true
    }
}
