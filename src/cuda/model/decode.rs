//! The decode step: one token through the graph of per-op kernels (embed, each layer's kernels
//! as `record_layer` queues them, the final norm and lm_head), captured once as a CUDA graph and
//! replayed; the device-side greedy and sampling loops over it; and `decode_layer`, one layer of
//! it alone for the layer-local error test.

use super::{gdn_step_args, CudaSession, GFfn, GLayer, GMixer, GState};
use crate::cuda::ops::{
    self, route_sums, router_fused, router_tail, GemvRole, GpuLinear, RouteSums, RouterTail, TailTopk,
};
use crate::cuda::profile;
use crate::cuda::Gpu;
use crate::sampling::SamplingParams;
use anyhow::{bail, Context, Result};

impl CudaSession {
    /// Runs one token through the model at `self.pos`; when `logits`, leaves the logits in the
    /// scratch `logits` buffer.
    pub(super) fn step(&mut self, tok: u32, logits: bool) -> Result<()> {
        let g = self.model.gpu.clone();
        let pos = self.pos;
        self.grow_kv(pos + 1)?;
        let s = self.scratch.as_ref().context("session scratch")?;
        let io = [tok as i32, pos as i32];
        s.io.write_i32(0, &io)?;
        let long = self.long_attn(pos);
        self.ensure_plan();
        if self.use_graphs {
            let i = logits as usize + 4 * long as usize;
            if self.graphs[i].is_none() {
                let graph = g.capture(|| self.record(logits, long))?;
                self.graphs[i] = Some(graph);
            }
            g.replay(self.graphs[i].as_ref().unwrap())?;
        } else {
            self.record(logits, long)?;
        }
        self.pos += 1;
        Ok(())
    }

    /// Test hook for decode-local error: runs layer `i`'s kernels of the decode step alone on the
    /// hidden row `x` (`[H]`) at the session's position, and returns the layer's output row. The
    /// layer's state (recurrent and conv state, KV cache) is updated; the position is not (run
    /// every layer at the same position, then [`CudaSession::advance`]).
    pub fn decode_layer(&mut self, i: usize, x: &[f32]) -> Result<Vec<f32>> {
        let h = self.model.cfg.hidden_size;
        if i >= self.model.layers.len() || x.len() != h {
            bail!("decode_layer: layer {i} of {}, {} values for hidden size {h}", self.model.layers.len(), x.len());
        }
        if self.pos >= self.model.cfg.max_position_embeddings {
            bail!("decode_layer: position {} is past the model's context", self.pos);
        }
        self.ensure()?;
        self.model.gpu.bind()?;
        self.grow_kv(self.pos + 1)?;
        self.ensure_plan();
        let s = self.scratch.as_ref().context("session scratch")?;
        let io = [0i32, self.pos as i32];
        s.io.write_i32(0, &io)?;
        s.x.write_f32(0, x)?;
        self.record_layer(i, self.long_attn(self.pos))?;
        profile::op(None, 0);
        s.x.read_f32(0, h)
    }

    /// Greedy decode on the device: feeds `first` at the current position, then each token it
    /// produces, `n` times, as replays of one step graph that ends in `argmax_io` (the argmax is
    /// written into the next step's input slot on the GPU; the host writes nothing between
    /// tokens and reads the `n` tokens once at the end). Returns the `n` produced tokens; the
    /// session has consumed `first` and the first `n - 1` of them.
    pub fn greedy_steps(&mut self, first: u32, n: usize) -> Result<Vec<u32>> {
        self.device_steps(first, n, None)
    }

    /// [`CudaSession::greedy_steps`] with each token drawn on the device by `sample_io`
    /// (temperature, top-k, min-p, top-p; kernels/sampling.cu) from `seed` and the step index.
    pub fn sampled_steps(&mut self, first: u32, n: usize, p: &SamplingParams, seed: u64) -> Result<Vec<u32>> {
        if p.temperature == 0.0 {
            return self.device_steps(first, n, None);
        }
        let sp = ops::sampling_params_bytes(p, seed)?;
        self.device_steps(first, n, Some(sp))
    }

    fn device_steps(&mut self, first: u32, n: usize, sample: Option<[u8; 24]>) -> Result<Vec<u32>> {
        self.check(&[first])?;
        if n == 0 {
            return Ok(Vec::new());
        }
        self.ensure()?;
        let g = self.model.gpu.clone();
        g.bind()?;
        let pos = self.pos;
        if pos + n > self.model.cfg.max_position_embeddings {
            bail!("{n} more tokens exceed the model's context of {}", self.model.cfg.max_position_embeddings);
        }
        self.grow_kv(pos + n)?;
        self.ensure_plan();
        if self.ring.as_ref().is_none_or(|r| r.1 < n) {
            let cap = n.next_power_of_two().max(64);
            self.ring = Some((g.zeros(4 * cap)?, cap));
            for i in [2, 3, 6, 7] {
                self.graphs[i] = None;
            }
        }
        if let Some(t) = &g.timeline {
            t.reset()?;
        }
        let s = self.scratch.as_ref().context("session scratch")?;
        let io = [first as i32, pos as i32, 0];
        s.io.write_i32(0, &io)?;
        if let Some(sp) = &sample {
            s.sp.write_bytes(0, sp)?;
        }
        let ring = self.ring.as_ref().unwrap().0.ptr;
        let v = self.model.cfg.vocab_size;
        let sampled = sample.is_some();
        let step = |this: &Self, long: bool| -> Result<()> {
            this.record(true, long)?;
            let s = this.scratch.as_ref().context("session scratch")?;
            profile::op(Some("sample"), 4 * v);
            if sampled {
                g.sample_io(s.logits.ptr, v, s.io.ptr, ring, s.sp.ptr, s.pick_ws.ptr)
            } else {
                g.argmax_io(s.logits.ptr, v, s.io.ptr, ring, s.pick_ws.ptr)
            }?;
            profile::op(None, 0);
            Ok(())
        };
        // Steps before the long-context attention threshold, then the rest.
        let short = self.attn_from.saturating_sub(pos).min(n);
        for (long, count) in [(false, short), (true, n - short)] {
            if count == 0 {
                continue;
            }
            if self.use_graphs {
                let gi = if sampled { 3 } else { 2 } + 4 * long as usize;
                if self.graphs[gi].is_none() {
                    let graph = g.capture(|| step(self, long))?;
                    self.graphs[gi] = Some(graph);
                }
                let graph = self.graphs[gi].as_ref().unwrap();
                for _ in 0..count {
                    g.replay(graph)?;
                }
            } else {
                for _ in 0..count {
                    step(self, long)?;
                }
            }
        }
        self.pos += n;
        if let Some(Ok(plan)) = &self.ps {
            plan.print_trace(g.sms as usize)?;
        }
        // measurement reports: a failure to report is printed, not the decode's failure
        if let Some(t) = &g.timeline {
            let names: Vec<&str> = crate::cuda::all_kernels().collect();
            if let Err(e) = t.print_last_step(&names) {
                eprintln!("LILY_CUDA_TIMELINE: {e:#}");
            }
        }
        if let Some(t) = &self.scratch.as_ref().context("session scratch")?.moe_trace {
            if let Err(e) = profile::print_moe_trace(t, g.sms as usize, self.model.layers.len()) {
                eprintln!("LILY_CUDA_MOE_TRACE: {e:#}");
            }
        }
        let out = self.ring.as_ref().unwrap().0.read_i32(n)?;
        Ok(out.into_iter().map(|t| t as u32).collect())
    }

    /// Whether the step at position `pos` (attending over pos + 1 positions) uses the
    /// long-context attention kernel.
    pub(super) fn long_attn(&self, pos: usize) -> bool {
        pos >= self.attn_from
    }

    /// Records (or, without graphs, runs) one decode step; `long` picks the attention kernel
    /// (`attn[1]` instead of `attn[0]`).
    fn record(&self, logits: bool, long: bool) -> Result<()> {
        let m = &self.model;
        let g = &m.gpu;
        let c = &m.cfg;
        let h = c.hidden_size;
        let eps = c.rms_norm_eps;
        if let (true, Some(Ok(plan))) = (self.persistent, &self.ps) {
            return self.record_persistent(plan, logits, long);
        }
        if g.timeline.is_some() {
            crate::cuda::timeline::begin_step();
        }
        let s = self.scratch.as_ref().context("session scratch")?;
        // Op labels and the bytes each op must move, for LILY_CUDA_PROFILE=1's per-op table.
        let op = profile::op;
        let emb_row = m.embed.nbytes() / m.embed.rows.max(1);
        op(Some("embed"), emb_row + 4 * h);
        g.embed(&m.embed, s.io.ptr, s.x.ptr, 1)?;
        for li in 0..m.layers.len() {
            self.record_layer(li, long)?;
        }
        op(Some("lm_head"), if logits { m.lm_head.nbytes() } else { 0 });
        if logits && self.fused {
            g.gemv_norm(&m.lm_head, s.x.ptr, (m.norm.ptr, eps), s.logits.ptr, 1, 0, false)?;
        } else if logits {
            g.rms_norm(s.x.ptr, m.norm.ptr, s.xn.ptr, 1, h, eps)?;
            g.gemv(&m.lm_head, s.xn.ptr, 0, s.logits.ptr, 1, 0, false)?;
        }
        op(None, 0);
        Ok(())
    }

    /// The router whose logits the out-projection's launch computes ([`Gpu::gemv_route`]; the
    /// default, `LILY_CUDA_MOE_ROUTER=launch` not): where the layer's MoE is the one-launch form
    /// that reads its logits from memory (not `LILY_CUDA_MOE_ROUTER=fused`), and what
    /// the launch leaves ([`router_tail`]; `acc` only where the MoE is the q2s form, which reads
    /// the sums, else `tailk`).
    fn route_tail<'a>(&self, layer: &'a GLayer) -> Option<(&'a GpuLinear, RouterTail)> {
        let (g, c) = (&self.model.gpu, &self.model.cfg);
        let GFfn::Moe { router, experts, .. } = &layer.ffn else { return None };
        let (gu, dn, e, k) = (&experts.gate_up, &experts.down, c.num_experts, c.num_experts_per_tok);
        let on = self.fused && self.routed && experts.shared_slot && g.moe_fused_ok(gu, dn, e, k);
        let r = router.fused.as_ref().filter(|_| on && !router_fused())?;
        let q2s = self.moe_form == ops::MoeForm::Q2s && g.moe_fused_q2_ok(gu, dn, e, k);
        match router_tail()? {
            RouterTail::Acc if !q2s => Some((r, RouterTail::Topk)),
            t => Some((r, t)),
        }
    }

    /// The out-projection into the residual stream, `x += W o`; with `tail` (the layer's router
    /// and form, [`Self::route_tail`]) also the router on the new x, where the kernel takes the
    /// shapes: its logits, and (tailk) the MoE's top-k into `ids`/`wts`, or (acc, the default)
    /// its sums in `rpart` for the MoE. Returns what it left (None: nothing of the router).
    fn out_proj(
        &self,
        w: &GpuLinear,
        tail: Option<(&GpuLinear, RouterTail)>,
        post_norm: (u64, f32),
    ) -> Result<Option<RouterTail>> {
        let (g, s, c) = (&self.model.gpu, self.scratch.as_ref().context("session scratch")?, &self.model.cfg);
        match tail.filter(|(r, _)| post_norm.0 != 0 && g.gemv_route_ok(w, r)) {
            Some((r, form)) => {
                let (part, ctr) = (s.rpart.ptr, s.sync_route.ptr);
                let (k, renorm) = (c.num_experts_per_tok, c.norm_topk_prob);
                let topk = (form == RouterTail::Topk).then_some(TailTopk { ids: s.ids.ptr, wts: s.wts.ptr, k, renorm });
                let sums = if form == RouterTail::Acc { RouteSums::Acc } else { route_sums() };
                g.gemv_route_form(w, s.o.ptr, s.x.ptr, r, post_norm, (part, sums), s.router.ptr, ctr, topk)?;
                Ok(Some(form))
            }
            None => g.gemv_as(GemvRole::Out, w, s.o.ptr, s.x.ptr, true, (0, 0.0)).map(|_| None),
        }
    }

    /// Queues layer `li`'s kernels of the decode step: its input and output are the scratch row
    /// `x` (the residual stream), its position the `io` buffer's.
    fn record_layer(&self, li: usize, long: bool) -> Result<()> {
        let m = &self.model;
        let g = &m.gpu;
        let c = &m.cfg;
        let h = c.hidden_size;
        let eps = c.rms_norm_eps;
        let s = self.scratch.as_ref().context("session scratch")?;
        let op = profile::op;
        let (layer, st) = (&m.layers[li], &self.states[li]);
        // Fused: each GEMV normalizes its input; else rms_norm into xn and plain GEMVs.
        let (xin, in_norm, post_norm) = if self.fused {
            (s.x.ptr, (layer.input_norm.ptr, eps), (layer.post_norm.ptr, eps))
        } else {
            g.rms_norm(s.x.ptr, layer.input_norm.ptr, s.xn.ptr, 1, h, eps)?;
            (s.xn.ptr, (0, 0.0), (0, 0.0))
        };
        // the out-projection's launch computes the router's logits (LILY_CUDA_MOE_ROUTER=launch: not)
        let tail = self.route_tail(layer);
        // the mixer, then its out-projection (which may leave the router's work)
        let routed = match (&layer.mixer, st) {
            (GMixer::Gdn { proj, conv, dt_bias, neg_a, norm, out }, GState::Gdn { conv: cs, rec }) => {
                let (cd, taps) = (c.gdn_conv_dim(), c.linear_conv_kernel_dim);
                let gs = gdn_step_args(c, s.proj.ptr, s.conv.ptr, [dt_bias, neg_a, norm], rec, s.o.ptr);
                // weights, the conv taps and the conv state (read and written)
                op(Some("gdn.in_proj+conv"), proj.nbytes() + conv.bytes + 2 * cs.bytes);
                match &proj.fused {
                    // The conv runs in the projection's epilogue (one launch fewer per layer).
                    Some(f) if Gpu::gemv_conv_ok(f, cd, taps) => {
                        g.gemv_conv(f, xin, in_norm, s.proj.ptr, (cs.ptr, conv.ptr, s.conv.ptr), cd, taps)?
                    }
                    _ => {
                        proj.run(g, xin, in_norm, s.proj.ptr)?;
                        g.conv_step(s.proj.ptr, cs.ptr, conv.ptr, s.conv.ptr, cd, taps)?;
                    }
                }
                op(Some("gdn.state"), 2 * rec.bytes);
                g.gdn_step(&gs)?;
                op(Some("gdn.out_proj"), out.nbytes());
                self.out_proj(out, tail, post_norm)?
            }
            (GMixer::Attn { proj, o, .. }, GState::Attn { .. }) => {
                op(Some("attn.qkv_proj"), proj.nbytes());
                proj.run_as(g, Some(GemvRole::Qkv), xin, in_norm, s.proj.ptr)?;
                // the cache's pos + 1 rows of K and V read (one written)
                let row = self.kv.pos_bytes(c.num_key_value_heads, c.head_dim);
                op(Some("attn.core"), 2 * (self.pos + 1) * row);
                self.attn_mid(li, long)?;
                op(Some("attn.o_proj"), o.nbytes());
                self.out_proj(o, tail, post_norm)?
            }
            _ => bail!("layer state does not match the layer kind"),
        };
        match &layer.ffn {
            GFfn::Moe { router, experts, .. } if experts.shared_slot && self.fused => {
                // Router (+ shared gate logit), top-k with the shared expert as slot K, one
                // gate/up GEMV over the K + 1 experts, one fused down + combine + residual.
                let (e, k) = (c.num_experts, c.num_experts_per_tok);
                let route = (s.router.ptr, e, k, c.norm_topk_prob);
                let (gu, dn) = (&experts.gate_up, &experts.down);
                // the K routed experts' and the shared expert's matrices
                let per_expert = (gu.nbytes() + dn.nbytes()) / dn.count.max(1);
                op(Some("moe.router"), router.nbytes());
                if self.routed && g.moe_fused_ok(gu, dn, e, k) {
                    // Top-k, gate/up and down + residual in one launch (the router too with
                    // LILY_CUDA_MOE_ROUTER=fused).
                    let fr = router.fused.as_ref().filter(|r| router_fused() && g.moe_router_ok(r, gu, e));
                    if fr.is_none() && routed.is_none() {
                        router.run(g, s.x.ptr, post_norm, s.router.ptr)?;
                    }
                    op(Some("moe.experts"), (k + 1) * per_expert);
                    let ids = (s.ids.ptr, s.wts.ptr);
                    let trace = s
                        .moe_trace
                        .as_ref()
                        .map_or(0, |t| t.ptr + (8 * profile::MOE_TRACE_SLOTS * g.sms as usize * li) as u64);
                    let form = match self.moe_form {
                        ops::MoeForm::Q => ops::MoeForm::Q,
                        f if fr.is_none() && post_norm.0 != 0 && g.moe_fused_q2_ok(gu, dn, e, k) => {
                            if f == ops::MoeForm::Q2 {
                                f
                            } else {
                                ops::MoeForm::Q2s
                            }
                        }
                        _ => ops::MoeForm::Q,
                    };
                    // the out-projection's last block ran the top-k (LILY_CUDA_MOE_ROUTER=tailk),
                    // or its blocks left the router's sums (=acc) in rpart
                    let (form, route) = match (form, routed) {
                        (ops::MoeForm::Q2s, Some(RouterTail::Topk)) => (ops::MoeForm::Q2sGiven, route),
                        (ops::MoeForm::Q2s, Some(RouterTail::Acc)) => {
                            let f = if ops::moe_topk_block() { ops::MoeForm::Q2sAccB } else { ops::MoeForm::Q2sAcc };
                            (f, (s.rpart.ptr, e, k, route.3))
                        }
                        (f, Some(RouterTail::Acc)) => bail!("the router's sums were left for a MoE of the {f:?} form"),
                        (f, _) => (f, route),
                    };
                    g.moe_fused(gu, dn, fr, s.x.ptr, post_norm, s.egu.ptr, route, ids, s.sync.ptr, trace, form)?;
                } else {
                    router.run(g, s.x.ptr, post_norm, s.router.ptr)?;
                    op(Some("moe.experts"), (k + 1) * per_expert);
                    if self.routed && gu.streams() {
                        g.gemv_routed(gu, s.x.ptr, post_norm, s.egu.ptr, route, s.ids.ptr, s.wts.ptr)?;
                    } else {
                        g.moe_topk_shared(s.router.ptr, e, k, c.norm_topk_prob, s.ids.ptr, s.wts.ptr, s.ids2.ptr)?;
                        let n = 2 * (k + 1);
                        g.gemv_norm(gu, s.x.ptr, post_norm, s.egu.ptr, n, s.ids2.ptr, false)?;
                    }
                    g.moe_down(dn, s.egu.ptr, s.ids.ptr, s.wts.ptr, k + 1, s.x.ptr)?;
                }
            }
            GFfn::Moe { router, experts, shared } => {
                let (e, k) = (c.num_experts, c.num_experts_per_tok);
                let inter = experts.down.cols;
                let (gu, dn) = (&experts.gate_up, &experts.down);
                let routed = k * (gu.nbytes() + dn.nbytes()) / dn.count.max(1);
                op(Some("moe.router+experts"), router.nbytes() + routed + shared.nbytes());
                g.rms_norm(s.x.ptr, layer.post_norm.ptr, s.xn.ptr, 1, h, eps)?;
                router.run(g, s.xn.ptr, (0, 0.0), s.router.ptr)?;
                g.moe_topk(s.router.ptr, e, k, c.norm_topk_prob, s.ids.ptr, s.wts.ptr, s.ids2.ptr)?;
                g.gemv(&experts.gate_up, s.xn.ptr, 0, s.egu.ptr, 2 * k, s.ids2.ptr, false)?;
                g.silu_mul_pairs(s.egu.ptr, s.eh.ptr, inter, k)?;
                g.gemv(&experts.down, s.eh.ptr, inter, s.ye.ptr, k, s.ids.ptr, false)?;
                shared.gate_up.run(g, s.xn.ptr, (0, 0.0), s.sgu.ptr)?;
                g.silu_mul_pairs(s.sgu.ptr, s.sh.ptr, shared.inter, 1)?;
                g.gemv(&shared.down, s.sh.ptr, 0, s.ys.ptr, 1, 0, false)?;
                g.moe_combine(s.x.ptr, s.ye.ptr, s.wts.ptr, s.ys.ptr, s.router.at(4 * e), h, k)?;
            }
            GFfn::Dense(mm) => {
                op(Some("mlp"), mm.nbytes());
                if !self.fused {
                    g.rms_norm(s.x.ptr, layer.post_norm.ptr, s.xn.ptr, 1, h, eps)?;
                }
                mm.gate_up.run(g, if self.fused { s.x.ptr } else { s.xn.ptr }, post_norm, s.sgu.ptr)?;
                g.silu_mul_pairs(s.sgu.ptr, s.sh.ptr, mm.inter, 1)?;
                g.gemv(&mm.down, s.sh.ptr, 0, s.x.ptr, 1, 0, true)?;
            }
        }
        Ok(())
    }
}
