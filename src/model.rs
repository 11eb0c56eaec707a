//! The Qwen3.5/3.6 hybrid model: its weights and the forward pass, top to bottom.
//!
//! Legend: T tokens in this call, H hidden size, V vocab. Per layer:
//! `h = x + Mixer(RMSNorm_in(x)); x' = h + FFN(RMSNorm_post(h))`, where Mixer is a Gated DeltaNet
//! or a gated full-attention layer and FFN is the MoE (routed experts + gated shared expert) or a
//! dense SwiGLU MLP. Then the final RMSNorm and lm_head. All activations are fp32.

use crate::config::ModelConfig;
use crate::cpu::attention::{attention, AttnDims};
use crate::cpu::conv::causal_conv1d_silu;
use crate::cpu::gdn::{self, GdnDims, GdnInputs};
use crate::cpu::kernels::q8::{cpu_int8, Q8Act};
use crate::cpu::moe::route;
use crate::cpu::norm::{gated_rms_norm, l2_norm, rms_norm, rms_norm_into, sigmoid, silu, softplus};
use crate::cpu::rope::Rope;
use crate::linear::{matmul_q8_batch, Linear, Weight};
use crate::state::{KvRows, LayerState, State};
use rayon::prelude::*;

pub struct Mlp {
    pub gate: Linear, // [I, H]
    pub up: Linear,   // [I, H]
    pub down: Linear, // [H, I]
}

pub struct Moe {
    pub router: Linear,      // [E, H]
    pub experts: Vec<Mlp>,   // E × (I = moe_intermediate_size)
    pub shared: Mlp,         // I = shared_expert_intermediate_size
    pub shared_gate: Linear, // [1, H]
}

pub enum Ffn {
    Moe(Moe),
    Dense(Mlp),
}

pub struct Gdn {
    pub in_qkv: Linear,    // [2·H_k·D_k + H_v·D_v, H]
    pub in_z: Linear,      // [H_v·D_v, H]
    pub in_b: Linear,      // [H_v, H]
    pub in_a: Linear,      // [H_v, H]
    pub conv: Vec<f32>,    // [C, K]
    pub dt_bias: Vec<f32>, // [H_v]
    pub neg_a: Vec<f32>,   // [H_v] = −exp(A_log)
    pub norm: Vec<f32>,    // [D_v], plain multiplier (never shifted)
    pub out: Linear,       // [H, H_v·D_v]
}

pub struct Attention {
    pub q: Linear,        // [H_q·D·2, H]: per head [q | gate]
    pub k: Linear,        // [H_kv·D, H]
    pub v: Linear,        // [H_kv·D, H]
    pub o: Linear,        // [H, H_q·D]
    pub q_norm: Vec<f32>, // [D]
    pub k_norm: Vec<f32>, // [D]
}

pub enum Mixer {
    Gdn(Gdn),
    Attention(Attention),
}

pub struct Layer {
    pub input_norm: Vec<f32>, // [H]
    pub post_norm: Vec<f32>,  // [H]
    pub mixer: Mixer,
    pub ffn: Ffn,
}

pub struct Model {
    pub cfg: ModelConfig,
    pub embed: Linear, // [V, H]
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,  // [H]
    pub lm_head: Linear, // [V, H]
    pub rope: Rope,
}

/// Which logits a forward call returns.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

/// One sequence of a batched forward pass: its new tokens and its caches.
pub struct Seq<'a> {
    pub tokens: &'a [u32],
    pub state: &'a mut State,
}

/// A sequence's rows inside the stacked hidden matrix of one layer call.
struct Seg<'a> {
    t: usize,
    state: &'a mut State,
}

impl Seg<'_> {
    fn gdn(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        match &mut self.state.layers[layer] {
            LayerState::Gdn { conv, rec } => (conv, rec),
            _ => unreachable!("state built from the same config"),
        }
    }
    fn kv(&mut self, layer: usize) -> (&mut KvRows, &mut KvRows) {
        match &mut self.state.layers[layer] {
            LayerState::Attention { k, v } => (k, v),
            _ => unreachable!("state built from the same config"),
        }
    }
}

impl Model {
    pub fn new_state(&self) -> State {
        State::new(&self.cfg)
    }

    /// Bytes of weights one decode step reads (active experts only), for bandwidth reports.
    pub fn decode_bytes_per_token(&self) -> usize {
        let k = self.cfg.num_experts_per_tok;
        let mlp = |m: &Mlp| m.gate.nbytes() + m.up.nbytes() + m.down.nbytes();
        let mut total = self.lm_head.nbytes() + self.embed.nbytes() / self.cfg.vocab_size;
        for l in &self.layers {
            total += match &l.mixer {
                Mixer::Gdn(g) => {
                    g.in_qkv.nbytes() + g.in_z.nbytes() + g.in_b.nbytes() + g.in_a.nbytes() + g.out.nbytes()
                }
                Mixer::Attention(a) => a.q.nbytes() + a.k.nbytes() + a.v.nbytes() + a.o.nbytes(),
            };
            total += match &l.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(m) => m.router.nbytes() + m.shared_gate.nbytes() + mlp(&m.shared) + k * mlp(&m.experts[0]),
            };
        }
        total
    }

    /// Parameters of the weight matrices (every expert; norms and other vectors left out) and
    /// the bytes they are stored in, for the start-up banner.
    pub fn weight_totals(&self) -> (usize, usize) {
        let (mut params, mut bytes) = (0usize, 0usize);
        let mut add = |l: &crate::linear::Linear| {
            params += l.rows * l.cols;
            bytes += l.nbytes();
        };
        add(&self.embed);
        if !self.cfg.tie_word_embeddings {
            add(&self.lm_head);
        }
        for l in &self.layers {
            match &l.mixer {
                Mixer::Gdn(g) => [&g.in_qkv, &g.in_z, &g.in_b, &g.in_a, &g.out].into_iter().for_each(&mut add),
                Mixer::Attention(a) => [&a.q, &a.k, &a.v, &a.o].into_iter().for_each(&mut add),
            }
            let mlps: Vec<&Mlp> = match &l.ffn {
                Ffn::Dense(m) => vec![m],
                Ffn::Moe(m) => {
                    add(&m.router);
                    add(&m.shared_gate);
                    std::iter::once(&m.shared).chain(&m.experts).collect()
                }
            };
            for m in mlps {
                [&m.gate, &m.up, &m.down].into_iter().for_each(&mut add);
            }
        }
        (params, bytes)
    }

    /// Multiply-adds of the weight products for one token (the experts a token uses: top-k and
    /// the shared one; the lm_head; not the embedding gather).
    pub fn macs_per_token(&self) -> usize {
        let k = self.cfg.num_experts_per_tok;
        let n = |l: &crate::linear::Linear| l.rows * l.cols;
        let mlp = |m: &Mlp| n(&m.gate) + n(&m.up) + n(&m.down);
        let mut total = n(&self.lm_head);
        for l in &self.layers {
            total += match &l.mixer {
                Mixer::Gdn(g) => n(&g.in_qkv) + n(&g.in_z) + n(&g.in_b) + n(&g.in_a) + n(&g.out),
                Mixer::Attention(a) => n(&a.q) + n(&a.k) + n(&a.v) + n(&a.o),
            };
            total += match &l.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(m) => n(&m.router) + n(&m.shared_gate) + mlp(&m.shared) + k * mlp(&m.experts[0]),
            };
        }
        total
    }

    /// Bytes of recurrent state a decode step reads and writes (GDN state and conv window, fp32)
    /// and bytes of KV cache it reads per cached position (fp32 K and V of every attention layer).
    pub fn state_bytes(&self) -> (usize, usize) {
        let c = &self.cfg;
        let (mut rec, mut kv) = (0, 0);
        for l in &self.layers {
            match &l.mixer {
                Mixer::Gdn(_) => {
                    let s = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
                    rec += 2 * 4 * (s + (c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim());
                }
                Mixer::Attention(_) => kv += 2 * 4 * c.kv_dim(),
            }
        }
        (rec, kv)
    }

    /// Runs `tokens` through the model at positions `state.pos..`, updating the caches.
    /// Returns logits `[1, V]` (Last) or `[T, V]` (All).
    pub fn forward(&self, tokens: &[u32], state: &mut State, which: Logits) -> Vec<f32> {
        self.forward_batch(&mut [Seq { tokens, state }], which)
    }

    /// Runs several sequences through the model in one pass: their tokens are stacked into one
    /// `[T_total, H]` matrix, so every projection and every expert reads its weights once for all
    /// of them (the MoE groups the tokens of all sequences by expert); the mixers (conv, GDN
    /// recurrence, attention over the sequence's own cache) run per sequence on its rows.
    /// Returns logits `[S, V]`, one row per sequence (Last), or `[T_total, V]` (All).
    pub fn forward_batch(&self, seqs: &mut [Seq], which: Logits) -> Vec<f32> {
        in_pool(|| self.forward_here(seqs, which))
    }

    fn forward_here(&self, seqs: &mut [Seq], which: Logits) -> Vec<f32> {
        let cfg = &self.cfg;
        let hid = cfg.hidden_size;
        assert!(seqs.iter().all(|s| !s.tokens.is_empty()), "forward: a sequence without tokens");
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let mut x = vec![0f32; t * hid]; // [T_total, H]
        for (i, &tok) in seqs.iter().flat_map(|s| s.tokens).enumerate() {
            self.embed.row_f32(tok as usize, &mut x[i * hid..(i + 1) * hid]);
        }
        let mut segs: Vec<Seg> = seqs.iter_mut().map(|s| Seg { t: s.tokens.len(), state: &mut *s.state }).collect();
        for i in 0..self.layers.len() {
            self.layer_batch(i, &mut x, &mut segs);
        }
        for s in seqs.iter_mut() {
            s.state.pos += s.tokens.len();
        }
        let mut h = match which {
            Logits::Last => {
                let mut ends = seqs.iter().scan(0, |e, s| {
                    *e += s.tokens.len();
                    Some(*e)
                });
                ends.by_ref().flat_map(|e| x[(e - 1) * hid..e * hid].to_vec()).collect()
            }
            Logits::All => x,
        };
        rms_norm(&mut h, &self.norm, cfg.rms_norm_eps);
        let n = h.len() / hid;
        let mut logits = vec![0f32; n * cfg.vocab_size];
        self.lm_head.matmul(&h, &mut logits);
        logits
    }

    /// Layer `i` on the hidden rows `x` (`[T, H]`) of one sequence at positions `state.pos..`, in
    /// place, updating that layer's caches (the position is moved by the caller once every layer
    /// has run).
    pub fn layer(&self, i: usize, x: &mut [f32], state: &mut State) {
        let t = x.len() / self.cfg.hidden_size;
        self.layer_batch(i, x, &mut [Seg { t, state }]);
    }

    /// Layer `i` on the stacked rows of several sequences (`segs` in row order).
    fn layer_batch(&self, i: usize, x: &mut [f32], segs: &mut [Seg]) {
        let cfg = &self.cfg;
        let layer = &self.layers[i];
        let t = x.len() / cfg.hidden_size;
        let mut xn = vec![0f32; x.len()]; // [T, H]
        rms_norm_into(x, &layer.input_norm, cfg.rms_norm_eps, &mut xn);
        let mixed = match &layer.mixer {
            Mixer::Gdn(g) => self.gdn(g, &xn, t, i, segs),
            Mixer::Attention(a) => self.attention(a, &xn, t, i, segs),
        };
        add(x, &mixed);
        rms_norm_into(x, &layer.post_norm, cfg.rms_norm_eps, &mut xn);
        let ff = match &layer.ffn {
            Ffn::Moe(m) => self.moe(m, &xn, t),
            Ffn::Dense(m) => mlp(m, &xn, t),
        };
        add(x, &ff);
    }

    fn gdn(&self, g: &Gdn, xn: &[f32], t: usize, layer: usize, segs: &mut [Seg]) -> Vec<f32> {
        let cfg = &self.cfg;
        let d = GdnDims {
            hk: cfg.linear_num_key_heads,
            hv: cfg.linear_num_value_heads,
            dk: cfg.linear_key_head_dim,
            dv: cfg.linear_value_head_dim,
        };
        let (kd, vd, cd) = (cfg.gdn_key_dim(), cfg.gdn_value_dim(), cfg.gdn_conv_dim());
        let [qkv, z, b, a] = proj4([&g.in_qkv, &g.in_z, &g.in_b, &g.in_a], xn, t);
        // qkv: [T, C] = [q | k | v]; z: [T, H_v·D_v]; b, a: [T, H_v]
        let mut conv = vec![0f32; t * cd]; // [T, C]
        let mut r0 = 0;
        for s in segs.iter_mut() {
            let n = s.t;
            let (conv_state, _) = s.gdn(layer);
            let rows = r0 * cd..(r0 + n) * cd;
            causal_conv1d_silu(
                &qkv[rows.clone()],
                n,
                cd,
                &g.conv,
                cfg.linear_conv_kernel_dim,
                conv_state,
                &mut conv[rows],
            );
            r0 += n;
        }
        let mut q = vec![0f32; t * kd]; // [T, H_k, D_k]
        let mut k = vec![0f32; t * kd]; // [T, H_k, D_k]
        let mut v = vec![0f32; t * vd]; // [T, H_v, D_v]
        let rows = conv.par_chunks(cd).zip(q.par_chunks_mut(kd)).zip(k.par_chunks_mut(kd)).zip(v.par_chunks_mut(vd));
        rows.with_min_len(4).for_each(|(((row, qr), kr), vr)| {
            qr.copy_from_slice(&row[..kd]);
            kr.copy_from_slice(&row[kd..2 * kd]);
            vr.copy_from_slice(&row[2 * kd..]);
            l2_norm(qr, d.dk, 1e-6, 1.0 / (d.dk as f32).sqrt());
            l2_norm(kr, d.dk, 1e-6, 1.0);
        });
        let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect(); // [T, H_v]
        let gdec: Vec<f32> =
            a.iter().enumerate().map(|(i, &x)| g.neg_a[i % d.hv] * softplus(x + g.dt_bias[i % d.hv])).collect(); // [T, H_v]
        let mut o = vec![0f32; t * vd]; // [T, H_v, D_v]
        let mut r0 = 0;
        for s in segs.iter_mut() {
            let (r1, n) = (r0 + s.t, s.t);
            let (_, rec) = s.gdn(layer);
            let inputs = GdnInputs {
                q: &q[r0 * kd..r1 * kd],
                k: &k[r0 * kd..r1 * kd],
                v: &v[r0 * vd..r1 * vd],
                g: &gdec[r0 * d.hv..r1 * d.hv],
                beta: &beta[r0 * d.hv..r1 * d.hv],
            };
            gdn::recurrent(d, n, &inputs, rec, &mut o[r0 * vd..r1 * vd]);
            r0 = r1;
        }
        // Per head row (the norm's width is D_v): parallel for a single decode token too.
        o.par_chunks_mut(d.dv)
            .zip(z.par_chunks(d.dv))
            .with_min_len(8)
            .for_each(|(or, zr)| gated_rms_norm(or, zr, &g.norm, cfg.rms_norm_eps));
        proj(&g.out, &o, t)
    }

    fn attention(&self, a: &Attention, xn: &[f32], t: usize, layer: usize, segs: &mut [Seg]) -> Vec<f32> {
        let cfg = &self.cfg;
        let (nh, hd, kvd) = (cfg.num_attention_heads, cfg.head_dim, cfg.kv_dim());
        let mut p = proj_many(&[&a.q, &a.k, &a.v], xn, t).into_iter();
        let qg = p.next().unwrap(); // [T, H_q, 2, D] when gated (per head [q | gate])
        let mut k = p.next().unwrap(); // [T, H_kv, D]
        let v = p.next().unwrap(); // [T, H_kv, D]
        let per_head = if cfg.attn_output_gate { 2 * hd } else { hd };
        let mut q = vec![0f32; t * nh * hd]; // [T, H_q, D]
        let mut gate = vec![0f32; if cfg.attn_output_gate { t * nh * hd } else { 0 }]; // [T, H_q, D]
        for i in 0..t * nh {
            let src = &qg[i * per_head..(i + 1) * per_head];
            q[i * hd..(i + 1) * hd].copy_from_slice(&src[..hd]);
            if cfg.attn_output_gate {
                gate[i * hd..(i + 1) * hd].copy_from_slice(&src[hd..]);
            }
        }
        rms_norm(&mut q, &a.q_norm, cfg.rms_norm_eps);
        rms_norm(&mut k, &a.k_norm, cfg.rms_norm_eps);
        let mut o = vec![0f32; t * nh * hd]; // [T, H_q, D]
        let dims = AttnDims { heads: nh, kv_heads: cfg.num_key_value_heads, head_dim: hd };
        let qd = nh * hd;
        let mut r0 = 0;
        for s in segs.iter_mut() {
            let (p0, n, r1) = (s.state.pos, s.t, r0 + s.t);
            for tt in r0..r1 {
                self.rope.apply(&mut q[tt * qd..(tt + 1) * qd], hd, p0 + tt - r0);
                self.rope.apply(&mut k[tt * kvd..(tt + 1) * kvd], hd, p0 + tt - r0);
            }
            let (kc, vc) = s.kv(layer);
            kc.push(&k[r0 * kvd..r1 * kvd]);
            vc.push(&v[r0 * kvd..r1 * kvd]);
            attention(&dims, &q[r0 * qd..r1 * qd], n, p0, kc, vc, 1.0 / (hd as f32).sqrt(), &mut o[r0 * qd..r1 * qd]);
            r0 = r1;
        }
        if cfg.attn_output_gate {
            for (ov, gv) in o.iter_mut().zip(&gate) {
                *ov *= sigmoid(*gv);
            }
        }
        proj(&a.o, &o, t)
    }

    fn moe(&self, m: &Moe, xn: &[f32], t: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let hid = cfg.hidden_size;
        if cpu_int8() && all_quant(m) {
            return self.moe_q8(m, xn, t);
        }
        let per_expert = tokens_per_expert(cfg, &proj(&m.router, xn, t));
        let active: Vec<(usize, &Vec<(usize, f32)>)> =
            per_expert.iter().enumerate().filter(|(_, v)| !v.is_empty()).collect();
        let mut y = mlp(&m.shared, xn, t); // [T, H]
        let sg = proj(&m.shared_gate, xn, t); // [T, 1]
        for tt in 0..t {
            let s = sigmoid(sg[tt]);
            y[tt * hid..(tt + 1) * hid].iter_mut().for_each(|v| *v *= s);
        }
        // Each active expert runs on its own tokens; results are summed in a fixed order.
        let outs: Vec<Vec<f32>> = active
            .par_iter()
            .map(|(e, toks)| {
                let mut xe = Vec::with_capacity(toks.len() * hid); // [T_e, H]
                for (tt, _) in toks.iter() {
                    xe.extend_from_slice(&xn[tt * hid..(tt + 1) * hid]);
                }
                mlp(&m.experts[*e], &xe, toks.len())
            })
            .collect();
        for ((_, toks), out) in active.iter().zip(&outs) {
            for (i, (tt, w)) in toks.iter().enumerate() {
                for (yv, ov) in y[tt * hid..(tt + 1) * hid].iter_mut().zip(&out[i * hid..(i + 1) * hid]) {
                    *yv += w * ov;
                }
            }
        }
        y
    }
}

impl Model {
    /// The MoE with int8 activations (opt-in) for `t` tokens: the gate and up products of the
    /// shared expert and of every routed expert a token chose run as one parallel loop, then all
    /// the down products as another. Each expert sees only its tokens (`[T_e, H]`), so a prompt
    /// reads each chosen expert once; per token the results are added in expert-index order, the
    /// order of the per-expert path, so the values do not depend on how many tokens share a call.
    fn moe_q8(&self, m: &Moe, xn: &[f32], t: usize) -> Vec<f32> {
        let (cfg, hid) = (&self.cfg, self.cfg.hidden_size);
        let [logits, sg] = proj_many(&[&m.router, &m.shared_gate], xn, t).try_into().unwrap();
        let per_expert = tokens_per_expert(cfg, &logits);
        // The shared expert takes every token.
        let shared_toks: Vec<(usize, f32)> = (0..t).map(|tt| (tt, 1.0)).collect();
        let work: Vec<(&Mlp, &[(usize, f32)])> = std::iter::once((&m.shared, &shared_toks[..]))
            .chain(per_expert.iter().enumerate().filter(|(_, v)| !v.is_empty()).map(|(e, v)| (&m.experts[e], &v[..])))
            .collect();
        // Gate/up inputs: each expert's rows of xn, quantized once per weight format.
        let ins: Vec<(Q8Act, Option<Q8Act>)> = work
            .par_iter()
            .map(|(p, toks)| {
                let xe: Vec<f32> = toks.iter().flat_map(|(tt, _)| &xn[tt * hid..(tt + 1) * hid]).copied().collect();
                let a = p.gate.quantize_input(&xe);
                let b = (!p.up.fits_q8(&a)).then(|| p.up.quantize_input(&xe));
                (a, b)
            })
            .collect();
        let jobs: Vec<(&Linear, &Q8Act)> = work
            .iter()
            .zip(&ins)
            .flat_map(|((p, _), (a, b))| [(&p.gate, a), (&p.up, b.as_ref().unwrap_or(a))])
            .collect();
        let gu = matmul_q8_batch(&jobs);
        let acts: Vec<Q8Act> = work
            .par_iter()
            .zip(gu.par_chunks_exact(2))
            .map(|((p, _), pair)| {
                let h: Vec<f32> = pair[0].iter().zip(&pair[1]).map(|(g, u)| silu(*g) * u).collect();
                p.down.quantize_input(&h)
            })
            .collect();
        let jobs: Vec<(&Linear, &Q8Act)> = work.iter().map(|(p, _)| &p.down).zip(&acts).collect();
        let outs = matmul_q8_batch(&jobs); // per expert [T_e, H]
        let mut y = vec![0f32; t * hid]; // [T, H]
        for (tt, yr) in y.chunks_exact_mut(hid).enumerate() {
            let s = sigmoid(sg[tt]);
            yr.iter_mut().zip(&outs[0][tt * hid..]).for_each(|(yv, ov)| *yv = ov * s);
        }
        for ((_, toks), out) in work.iter().zip(&outs).skip(1) {
            for (i, (tt, w)) in toks.iter().enumerate() {
                let yr = &mut y[tt * hid..(tt + 1) * hid];
                yr.iter_mut().zip(&out[i * hid..]).for_each(|(yv, ov)| *yv += w * ov);
            }
        }
        y
    }
}

/// Runs `f` on a thread of rayon's pool. A forward pass runs ~300 parallel loops per token; from
/// a thread outside the pool each of them would hand its work to the pool and sleep until it is
/// done (two thread wake-ups per loop), while from a pool thread the loop runs partly on the
/// calling thread and the other threads steal the rest.
fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let mut out = None;
    rayon::scope(|_| out = Some(f()));
    out.expect("the scope ran f")
}

/// Routes every token of the router logits `[T, E]`: per expert, its (token, weight) list.
fn tokens_per_expert(cfg: &ModelConfig, logits: &[f32]) -> Vec<Vec<(usize, f32)>> {
    let mut per_expert = vec![Vec::new(); cfg.num_experts];
    for (tt, l) in logits.chunks_exact(cfg.num_experts).enumerate() {
        for (e, w) in route(l, cfg.num_experts_per_tok, cfg.norm_topk_prob) {
            per_expert[e].push((tt, w));
        }
    }
    per_expert
}

fn is_quant(w: &Linear) -> bool {
    matches!(w.w, Weight::Quant { .. })
}

fn all_quant(m: &Moe) -> bool {
    let mlp_q = |p: &Mlp| is_quant(&p.gate) && is_quant(&p.up) && is_quant(&p.down);
    is_quant(&m.router) && is_quant(&m.shared_gate) && mlp_q(&m.shared) && m.experts.iter().all(mlp_q)
}

/// Products of several matrices with one input `x: [T, cols]`. With int8 activations (opt-in) and
/// quantized weights, x is quantized once per weight format and all the products share one
/// parallel loop; otherwise each is its own `proj`.
fn proj_many(ws: &[&Linear], x: &[f32], t: usize) -> Vec<Vec<f32>> {
    if !(cpu_int8() && ws.iter().all(|w| is_quant(w))) {
        return ws.iter().map(|w| proj(w, x, t)).collect();
    }
    let mut acts: Vec<Q8Act> = Vec::new();
    let mut which = Vec::with_capacity(ws.len());
    for w in ws {
        let i = match acts.iter().position(|a| w.fits_q8(a)) {
            Some(i) => i,
            None => {
                acts.push(w.quantize_input(x));
                acts.len() - 1
            }
        };
        which.push(i);
    }
    let jobs: Vec<(&Linear, &Q8Act)> = ws.iter().zip(&which).map(|(w, &i)| (*w, &acts[i])).collect();
    matmul_q8_batch(&jobs)
}

fn proj4(ws: [&Linear; 4], x: &[f32], t: usize) -> [Vec<f32>; 4] {
    proj_many(&ws, x, t).try_into().unwrap()
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// `x: [T, cols] -> [T, rows]`.
fn proj(w: &Linear, x: &[f32], t: usize) -> Vec<f32> {
    let mut y = vec![0f32; t * w.rows];
    w.matmul(x, &mut y);
    y
}

/// SwiGLU: `down(silu(gate x) ⊙ up x)`.
fn mlp(m: &Mlp, x: &[f32], t: usize) -> Vec<f32> {
    let [mut g, u] = proj_many(&[&m.gate, &m.up], x, t).try_into().unwrap();
    g.iter_mut().zip(&u).for_each(|(a, b)| *a = silu(*a) * b);
    proj(&m.down, &g, t)
}
