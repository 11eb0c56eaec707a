//! The model on the GPU: weights uploaded once ([`CudaModel`]) and a [`CudaSession`] that runs
//! the forward pass of `src/model.rs` step by step with our kernels, activations in fp32.
//!
//! Per token (batch 1): embed → per layer {RMSNorm → mixer (GDN or gated attention) → + residual
//! (fused into the out-projection) → RMSNorm → MoE (router, device top-k, expert GEMVs that read
//! the expert ids from device memory, shared expert with sigmoid gate, combine + residual)} →
//! final RMSNorm → lm_head.
//!
//! A prompt of several tokens runs as a batched prefill in chunks ([`CudaSession::prefill`]):
//! the same layer order over `[T, ·]` activations, with many-row products (bf16 tensor cores by
//! default, or fp32 for the exact mode), the GDN conv + delta-rule scan over the chunk, causal
//! attention over the cache, and routed experts grouped by expert on the GPU (`moe_align` →
//! grouped GEMM → combine).

use super::ops::{gdn_out_fused, router_fused, AttnKernel, AttnPrep, GdnStep, GpuLinear, KvDtype, Precision};
use super::{DevBuf, Gpu, Graph, PagedBuf};
use crate::config::ModelConfig;
use crate::generate::{Session, Snapshot};
use crate::model::Logits;
use crate::sampling::SamplingParams;
use crate::state::{LayerState, State};
use anyhow::{bail, Context, Result};
use std::sync::Arc;

mod attn_step;
mod batch;
mod prefill;
mod proj;
mod pstep;
mod state;
mod upload;
pub use batch::CudaBatch;
use prefill::PScratch;
use proj::Proj;
pub use upload::{upload_cached, uploaded};

/// A SwiGLU MLP: gate and up side by side (`[gate | up]` output), then down.
struct GMlp {
    gate_up: Proj,
    inter: usize,
    down: GpuLinear,
}

impl GMlp {
    fn nbytes(&self) -> usize {
        self.gate_up.nbytes() + self.down.nbytes()
    }
}

/// All experts of a layer: gate and up interleaved per expert (`[E·2, I, H]`, so expert e's gate
/// is matrix 2e and its up 2e+1), down stacked `[E, H, I]`. When the shared expert has the
/// routed experts' shape and format it is stacked after them as expert E (`shared_slot`), so a
/// decode step runs all K + 1 experts in one gate/up GEMV and one fused down kernel.
struct GExperts {
    gate_up: GpuLinear,
    down: GpuLinear,
    shared_slot: bool,
}

enum GMixer {
    Gdn {
        /// `[qkv | z | b | a]`.
        proj: Proj,
        conv: DevBuf,
        dt_bias: DevBuf,
        neg_a: DevBuf,
        norm: DevBuf,
        out: GpuLinear,
    },
    Attn {
        /// `[q (with gate) | k | v]`.
        proj: Proj,
        o: GpuLinear,
        q_norm: DevBuf,
        k_norm: DevBuf,
    },
}

enum GFfn {
    Moe {
        /// `[router logits (E) | shared-expert gate (1)]`.
        router: Proj,
        experts: GExperts,
        shared: GMlp,
    },
    Dense(GMlp),
}

struct GLayer {
    input_norm: DevBuf,
    post_norm: DevBuf,
    mixer: GMixer,
    ffn: GFfn,
}

/// Weights in device memory, shared by every session of one model.
pub struct CudaModel {
    pub gpu: Arc<Gpu>,
    pub cfg: ModelConfig,
    embed: GpuLinear,
    lm_head: GpuLinear,
    norm: DevBuf,
    layers: Vec<GLayer>,
    /// Bytes of weights in device memory.
    pub weight_bytes: usize,
}

impl CudaModel {
    /// Why an fp8 KV cache cannot serve this model on its device ([`Gpu::fp8_kv_unsupported`]),
    /// or `None` when it can.
    pub fn fp8_kv_unsupported(&self) -> Option<String> {
        let c = &self.cfg;
        self.gpu.fp8_kv_unsupported(c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    }
}

/// The GDN step's arguments for one token row: `proj` holds `[conv input | z | b | a]` (f32),
/// `y` the conv output, `w` the layer's `[dt_bias, neg_a, norm]`.
pub(crate) fn gdn_step_args(c: &ModelConfig, proj: u64, y: u64, w: [&DevBuf; 3], state: &DevBuf, out: u64) -> GdnStep {
    let (cd, vd, hv) = (c.gdn_conv_dim(), c.gdn_value_dim(), c.linear_num_value_heads);
    let at = |off: usize| proj + 4 * off as u64;
    GdnStep {
        y,
        b: at(cd + vd),
        a: at(cd + vd + hv),
        z: at(cd),
        dt_bias: w[0].ptr,
        neg_a: w[1].ptr,
        norm: w[2].ptr,
        state: state.ptr,
        out,
        hk: c.linear_num_key_heads,
        hv,
        dk: c.linear_key_head_dim,
        dv: c.linear_value_head_dim,
        eps: c.rms_norm_eps,
    }
}

/// The attention prep arguments for token rows of `proj` (`[q | gate per head, k, v]`, f32):
/// queries to `q_out`, keys and values into the caches `kv` at the position read from `pos`.
pub(crate) fn attn_prep_args(
    c: &ModelConfig,
    proj: u64,
    norms: [&DevBuf; 2],
    q_out: u64,
    kv: [&PagedBuf; 2],
    pos: u64,
    dtype: KvDtype,
) -> AttnPrep {
    let (qd, kvd) = (c.q_proj_dim(), c.kv_dim());
    AttnPrep {
        qg: proj,
        k: proj + 4 * qd as u64,
        v: proj + 4 * (qd + kvd) as u64,
        q_norm: norms[0].ptr,
        k_norm: norms[1].ptr,
        q_out,
        kc: kv[0].ptr,
        vc: kv[1].ptr,
        nh: c.num_attention_heads,
        hkv: c.num_key_value_heads,
        hd: c.head_dim,
        gated: c.attn_output_gate,
        rot: c.rotary_dim,
        pos,
        theta: c.rope_theta,
        eps: c.rms_norm_eps,
        kv: dtype,
    }
}

/// Activation scratch of one session (fp32 unless noted).
struct Scratch {
    x: DevBuf,
    xn: DevBuf,
    /// Mixer input projections side by side: GDN `[qkv | z | b | a]`, attention `[q+gate | k | v]`.
    proj: DevBuf,
    conv: DevBuf,
    o: DevBuf,
    q: DevBuf,
    /// `[router logits (E) | shared-expert gate (1)]`.
    router: DevBuf,
    ids: DevBuf,  // i32 [K]
    ids2: DevBuf, // i32 [2K]: gate/up matrices of the chosen experts
    wts: DevBuf,
    egu: DevBuf, // [2K, I] gate/up outputs
    eh: DevBuf,  // [K, I]
    ye: DevBuf,  // [K, H]
    sgu: DevBuf, // [2, I_shared] (or the dense MLP's)
    sh: DevBuf,
    ys: DevBuf,
    logits: DevBuf,
    amax: DevBuf,
    /// Attention split partials `[H_q, splits, D + 2]`.
    part: DevBuf,
    /// i32 [token, position, count] of the step being run (read by the kernels, so graphs
    /// replay; `count` indexes the greedy loop's ring of produced tokens).
    io: DevBuf,
    /// The sampling loop's parameters (`sampling_params_bytes`) and the device token choice's
    /// workspace (`SAMPLE_WS_BYTES`).
    sp: DevBuf,
    pick_ws: DevBuf,
    /// The u64 counter moe_fused_q's blocks meet on (zeroed once).
    sync: DevBuf,
    /// The same for gdn_step_out (its own: a counter's launches must all have the same grid).
    sync_gdn: DevBuf,
}

enum GState {
    Gdn {
        conv: DevBuf,
        rec: DevBuf,
    },
    /// `k, v: [max positions, H_kv, D]`, backed by pages up to the cached length.
    Attn {
        k: PagedBuf,
        v: PagedBuf,
    },
}

/// One sequence on the GPU (implements [`Session`]).
pub struct CudaSession {
    pub model: Arc<CudaModel>,
    pos: usize,
    scratch: Option<Scratch>,
    states: Vec<GState>,
    /// Replay each step as a captured CUDA graph (default; `LILY_CUDA_GRAPHS=0` or profiling
    /// turns it off). Graphs are captured lazily, one without and one with the lm_head, and
    /// dropped whenever a cache buffer moves.
    pub use_graphs: bool,
    /// Step graphs: without logits, with logits, the greedy loop's (logits + argmax_io) and the
    /// sampling loop's (logits + sample_io).
    /// Index: kind + 4 when the step uses the long-context attention kernel.
    graphs: [Option<Graph>; 8],
    /// The greedy loop's produced tokens (i32), and its capacity.
    ring: Option<(DevBuf, usize)>,
    /// How prompts of several tokens run: batched with this precision for the many-row
    /// products, or token by token through the decode step (None). Default bf16 tensor cores;
    /// `LILY_CUDA_PREFILL=f32` (exact) or `step`.
    pub prefill: Option<Precision>,
    /// Most tokens per batched prefill chunk (`LILY_PREFILL_CHUNK`; default 8192 on GPUs of 64 GB
    /// or more, else 2048: larger chunks give the grouped expert products more rows per expert;
    /// the scratch grows with the prompt up to it, ~280 KB per row on the 35B model).
    pub chunk: usize,
    pre: Option<PScratch>,
    /// Decode with the RMSNorm fused into the GEMVs and the fused MoE tail (default;
    /// `LILY_CUDA_FUSED=0` runs the separate kernels, for comparison).
    pub fused: bool,
    /// Decode MoE routing inside the gate/up GEMV (`gemv_q2_routed`) instead of a separate top-k
    /// kernel, where the expert format allows (default; `LILY_CUDA_ROUTED=0` for comparison).
    pub routed: bool,
    /// Decode attention kernel and splits below and from `attn_from` cached positions
    /// ([`Gpu::attn_plan`]).
    attn: [(AttnKernel, usize); 2],
    /// Cached positions from which decode steps use the long-context kernel (public so tests
    /// can move the switch; graphs are keyed by the kernel, so changing it between steps is fine).
    pub attn_from: usize,
    /// Element type of the KV caches ([`CudaSession::set_kv_dtype`]).
    kv: KvDtype,
    /// Decode through the persistent kernel (`kernels/pstep.cu`) where the model allows
    /// (`LILY_CUDA_DECODE=persistent`; off by default while it is slower than the graph).
    pub persistent: bool,
    /// Its plan for the current buffers (None: not built yet; Err: why the model keeps the graph).
    ps: Option<std::result::Result<pstep::PsPlan, String>>,
}

impl CudaSession {
    pub fn new(model: Arc<CudaModel>) -> CudaSession {
        let use_graphs = !super::profiling() && std::env::var("LILY_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let prefill = match std::env::var("LILY_CUDA_PREFILL").as_deref() {
            Ok("step") => None,
            Ok("f32") => Some(Precision::F32),
            _ => Some(Precision::Bf16),
        };
        // At most 16384 (kernel grids put the chunk's tokens on the y axis, limit 65535).
        // 8192 on GPUs of 64 GB or more (~2.3 GB of scratch at 8192 rows on the 35B model), else 2048.
        let default = if model.gpu.total_mem >= 64 << 30 { 8192 } else { 2048 };
        let chunk =
            std::env::var("LILY_PREFILL_CHUNK").ok().and_then(|v| v.parse().ok()).unwrap_or(default).clamp(1, 16384);
        let c = &model.cfg;
        let kv = match KvDtype::from_env() {
            Err(e) => {
                eprintln!("warning: {e:#}; using bf16");
                KvDtype::Bf16
            }
            Ok(KvDtype::Fp8) => match model.fp8_kv_unsupported() {
                Some(why) => {
                    eprintln!("warning: LILY_CUDA_KV=fp8: {why}; using bf16");
                    KvDtype::Bf16
                }
                None => KvDtype::Fp8,
            },
            Ok(kv) => kv,
        };
        let (short, long, attn_from) =
            model.gpu.attn_plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, kv);
        CudaSession {
            attn: [short, long],
            attn_from,
            model,
            pos: 0,
            scratch: None,
            states: Vec::new(),
            use_graphs,
            graphs: Default::default(),
            ring: None,
            prefill,
            chunk,
            pre: None,
            fused: std::env::var("LILY_CUDA_FUSED").map_or(true, |v| v != "0"),
            routed: std::env::var("LILY_CUDA_ROUTED").map_or(true, |v| v != "0")
                && super::gemv_default().0 != super::GemvKernel::Old,
            kv,
            persistent: pstep::wanted(),
            ps: None,
        }
    }

    /// The KV caches' element type.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv
    }

    /// Sets the KV caches' element type (and the attention plan that goes with it); a session
    /// that has run starts over (empty caches). An fp8 cache the model's heads or the device
    /// cannot use is an error.
    pub fn set_kv_dtype(&mut self, kv: KvDtype) -> Result<()> {
        if let Some(why) = (kv == KvDtype::Fp8).then(|| self.model.fp8_kv_unsupported()).flatten() {
            bail!("{why}");
        }
        let c = &self.model.cfg;
        if kv != self.kv {
            let (short, long, from) =
                self.model.gpu.attn_plan(c.num_attention_heads, c.num_key_value_heads, c.head_dim, kv);
            (self.attn, self.attn_from) = ([short, long], from);
            self.kv = kv;
            self.scratch = None;
            self.states.clear();
            self.graphs = Default::default();
            self.pos = 0;
        }
        Ok(())
    }

    fn ensure(&mut self) -> Result<()> {
        if self.scratch.is_some() {
            return Ok(());
        }
        let g = &self.model.gpu;
        g.bind()?;
        let c = &self.model.cfg;
        let f = |n: usize| g.zeros(4 * n.max(1));
        let (h, k) = (c.hidden_size, c.num_experts_per_tok.max(1));
        let inter = c.moe_intermediate_size.max(c.intermediate_size);
        let sinter = c.shared_expert_intermediate_size.max(c.intermediate_size);
        let proj =
            (c.gdn_conv_dim() + c.gdn_value_dim() + 2 * c.linear_num_value_heads).max(c.q_proj_dim() + 2 * c.kv_dim());
        self.scratch = Some(Scratch {
            x: f(h)?,
            xn: f(h)?,
            proj: f(proj)?,
            conv: f(c.gdn_conv_dim())?,
            o: f(c.gdn_value_dim().max(c.num_attention_heads * c.head_dim))?,
            q: f(c.num_attention_heads * c.head_dim)?,
            router: f(c.num_experts + 1)?,
            ids: f(k + 1)?,
            ids2: f(2 * (k + 1))?,
            wts: f(k + 1)?,
            egu: f(2 * (k + 1) * inter)?,
            eh: f(k * inter)?,
            ye: f(k * h)?,
            sgu: f(2 * sinter)?,
            sh: f(sinter)?,
            ys: f(h)?,
            logits: f(c.vocab_size)?,
            amax: f(1)?,
            part: f(c.num_attention_heads * self.attn[0].1.max(self.attn[1].1) * (c.head_dim + 2))?,
            io: f(3)?,
            sp: f(6)?,
            pick_ws: g.zeros(super::SAMPLE_WS_BYTES)?,
            sync: g.zeros(8)?,
            sync_gdn: g.zeros(8)?,
        });
        self.states = self.fresh_states()?;
        self.graphs = Default::default();
        self.ps = None;
        Ok(())
    }

    fn fresh_states(&self) -> Result<Vec<GState>> {
        let g = &self.model.gpu;
        let c = &self.model.cfg;
        let st = State::new(c);
        st.layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn { conv, rec } => {
                    Ok(GState::Gdn { conv: g.zeros(4 * conv.len())?, rec: g.zeros(4 * rec.len())? })
                }
                LayerState::Attention { .. } => {
                    let n = c.max_position_embeddings * self.kv.pos_bytes(c.num_key_value_heads, c.head_dim);
                    Ok(GState::Attn { k: PagedBuf::new(g, n)?, v: PagedBuf::new(g, n)? })
                }
            })
            .collect()
    }

    fn check(&self, tokens: &[u32]) -> Result<()> {
        let v = self.model.cfg.vocab_size;
        if tokens.is_empty() {
            bail!("no input tokens");
        }
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= v) {
            bail!("token id {t} is out of range for this model (vocab_size {v})");
        }
        Ok(())
    }

    /// Runs one token through the model at `self.pos`; when `logits`, leaves the logits in the
    /// scratch `logits` buffer.
    fn step(&mut self, tok: u32, logits: bool) -> Result<()> {
        let g = self.model.gpu.clone();
        let pos = self.pos;
        self.grow_kv(pos + 1)?;
        let s = self.scratch.as_ref().context("session scratch")?;
        let io = [tok as i32, pos as i32];
        s.io.write_bytes(0, &io.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
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
        s.io.write_bytes(0, &io.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
        s.x.write_f32(0, x)?;
        self.record_layer(i, self.long_attn(self.pos))?;
        super::profile::op(None, 0);
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
        let sp = super::ops::sampling_params_bytes(p, seed)?;
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
        let s = self.scratch.as_ref().context("session scratch")?;
        let io = [first as i32, pos as i32, 0];
        s.io.write_bytes(0, &io.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
        if let Some(sp) = &sample {
            s.sp.write_bytes(0, sp)?;
        }
        let ring = self.ring.as_ref().unwrap().0.ptr;
        let v = self.model.cfg.vocab_size;
        let sampled = sample.is_some();
        let step = |this: &Self, long: bool| -> Result<()> {
            this.record(true, long)?;
            let s = this.scratch.as_ref().context("session scratch")?;
            super::profile::op(Some("sample"), 4 * v);
            if sampled {
                g.sample_io(s.logits.ptr, v, s.io.ptr, ring, s.sp.ptr, s.pick_ws.ptr)
            } else {
                g.argmax_io(s.logits.ptr, v, s.io.ptr, ring, s.pick_ws.ptr)
            }?;
            super::profile::op(None, 0);
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
        let out = self.ring.as_ref().unwrap().0.read_i32(n)?;
        Ok(out.into_iter().map(|t| t as u32).collect())
    }

    /// Backs the KV caches with pages for `need` positions (outside any graph; the caches'
    /// addresses do not change, so the captured graphs stay).
    fn grow_kv(&mut self, need: usize) -> Result<()> {
        let row = self.kv.pos_bytes(self.model.cfg.num_key_value_heads, self.model.cfg.head_dim);
        for st in self.states.iter_mut() {
            if let GState::Attn { k, v } = st {
                k.ensure(need * row)?;
                v.ensure(need * row)?;
            }
        }
        Ok(())
    }

    /// Hands the KV caches' pages back to the pool (a served sequence's slot when it ends; the
    /// next sequence there maps zeroed pages as it grows). For an empty session (position 0).
    pub(crate) fn release_kv(&mut self) -> Result<()> {
        if self.pos != 0 {
            bail!("release_kv on a session at position {}", self.pos);
        }
        for st in self.states.iter_mut() {
            if let GState::Attn { k, v } = st {
                k.release()?;
                v.release()?;
            }
        }
        Ok(())
    }

    /// Queues every kernel of one step (token and position come from the `io` buffer).
    /// Whether the step at position `pos` (attending over pos + 1 positions) uses the
    /// long-context attention kernel.
    fn long_attn(&self, pos: usize) -> bool {
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
        let s = self.scratch.as_ref().context("session scratch")?;
        // Op labels and the bytes each op must move, for LILY_CUDA_PROFILE=1's per-op table.
        let op = super::profile::op;
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

    /// Queues layer `li`'s kernels of the decode step: its input and output are the scratch row
    /// `x` (the residual stream), its position the `io` buffer's.
    fn record_layer(&self, li: usize, long: bool) -> Result<()> {
        let m = &self.model;
        let g = &m.gpu;
        let c = &m.cfg;
        let h = c.hidden_size;
        let eps = c.rms_norm_eps;
        let s = self.scratch.as_ref().context("session scratch")?;
        let op = super::profile::op;
        let (layer, st) = (&m.layers[li], &self.states[li]);
        // Fused: each GEMV normalizes its input; else rms_norm into xn and plain GEMVs.
        let (xin, in_norm, post_norm) = if self.fused {
            (s.x.ptr, (layer.input_norm.ptr, eps), (layer.post_norm.ptr, eps))
        } else {
            g.rms_norm(s.x.ptr, layer.input_norm.ptr, s.xn.ptr, 1, h, eps)?;
            (s.xn.ptr, (0, 0.0), (0, 0.0))
        };
        match (&layer.mixer, st) {
            (GMixer::Gdn { proj, conv, dt_bias, neg_a, norm, out }, GState::Gdn { conv: cs, rec }) => {
                let (cd, taps) = (c.gdn_conv_dim(), c.linear_conv_kernel_dim);
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
                let gs = gdn_step_args(c, s.proj.ptr, s.conv.ptr, [dt_bias, neg_a, norm], rec, s.o.ptr);
                // the recurrent state, read and written
                op(Some("gdn.state"), 2 * rec.bytes);
                if gdn_out_fused() && g.gdn_step_out_ok(&gs, out) {
                    // The state step and the output projection + residual in one launch.
                    g.gdn_step_out(&gs, out, s.x.ptr, s.sync_gdn.ptr)?;
                } else {
                    g.gdn_step(&gs)?;
                    op(Some("gdn.out_proj"), out.nbytes());
                    g.gemv(out, s.o.ptr, 0, s.x.ptr, 1, 0, true)?;
                }
            }
            (GMixer::Attn { proj, o, .. }, GState::Attn { .. }) => {
                op(Some("attn.qkv_proj"), proj.nbytes());
                proj.run(g, xin, in_norm, s.proj.ptr)?;
                // the cache's pos + 1 rows of K and V read (one written)
                let row = self.kv.pos_bytes(c.num_key_value_heads, c.head_dim);
                op(Some("attn.core"), 2 * (self.pos + 1) * row);
                self.attn_mid(li, long)?;
                op(Some("attn.o_proj"), o.nbytes());
                g.gemv(o, s.o.ptr, 0, s.x.ptr, 1, 0, true)?;
            }
            _ => bail!("layer state does not match the layer kind"),
        }
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
                    if fr.is_none() {
                        router.run(g, s.x.ptr, post_norm, s.router.ptr)?;
                    }
                    op(Some("moe.experts"), (k + 1) * per_expert);
                    let ids = (s.ids.ptr, s.wts.ptr);
                    g.moe_fused(gu, dn, fr, s.x.ptr, post_norm, s.egu.ptr, route, ids, s.sync.ptr)?;
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

    fn forward(&mut self, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.check(tokens)?;
        self.ensure()?;
        self.model.gpu.bind()?;
        let v = self.model.cfg.vocab_size;
        if let Some(prec) = self.prefill.filter(|_| tokens.len() > 1) {
            let all = self.prefill(tokens, prec, which == Logits::All)?;
            return match which {
                Logits::All => Ok(all),
                _ => self.scratch.as_ref().unwrap().logits.read_f32(0, v),
            };
        }
        let mut out = Vec::with_capacity(if which == Logits::All { tokens.len() * v } else { v });
        for (i, &t) in tokens.iter().enumerate() {
            let want = which == Logits::All || i + 1 == tokens.len();
            self.step(t, want)?;
            if want {
                out.extend(self.scratch.as_ref().unwrap().logits.read_f32(0, v)?);
            }
        }
        Ok(out)
    }

    /// Appends `tokens` and returns the greedy next token, picked on the GPU (only 4 bytes come
    /// back instead of the logits).
    pub fn forward_greedy(&mut self, tokens: &[u32]) -> Result<u32> {
        self.check(tokens)?;
        self.ensure()?;
        self.model.gpu.bind()?;
        match self.prefill.filter(|_| tokens.len() > 1) {
            Some(prec) => {
                self.prefill(tokens, prec, false)?;
            }
            None => {
                for (i, &t) in tokens.iter().enumerate() {
                    self.step(t, i + 1 == tokens.len())?;
                }
            }
        }
        let s = self.scratch.as_ref().unwrap();
        self.model.gpu.argmax(s.logits.ptr, self.model.cfg.vocab_size, s.amax.ptr)?;
        Ok(s.amax.read_i32(1)?[0] as u32)
    }
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        if super::profiling() {
            eprintln!("LILY_CUDA_PROFILE: kernel times of a session that ran {} positions", self.pos);
            super::profile_report();
        }
    }
}

impl Session for CudaSession {
    fn forward_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward(tokens, Logits::Last)
    }
    fn greedy_steps(&mut self, first: u32, n: usize) -> Result<Vec<u32>> {
        CudaSession::greedy_steps(self, first, n)
    }
    fn sampled_steps(&mut self, first: u32, n: usize, p: &SamplingParams, seed: u64) -> Result<Vec<u32>> {
        CudaSession::sampled_steps(self, first, n, p, seed)
    }
    fn forward_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward(tokens, Logits::All)
    }
    fn pos(&self) -> usize {
        self.pos
    }
    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }
    fn max_positions(&self) -> usize {
        self.model.cfg.max_position_embeddings
    }
    fn snapshot(&self) -> Snapshot {
        // The caches come back to the host as a CPU State (a failed copy gives an empty one,
        // which restore then rejects).
        let st = self.to_state().unwrap_or_else(|_| State { pos: 0, layers: Vec::new() });
        Snapshot { pos: st.pos, nbytes: st.nbytes(), data: Box::new(st) }
    }
    fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        let st = snap.data.downcast_ref::<State>().context("snapshot is not from a lily session")?;
        self.load_state(st)
    }
    fn reset(&mut self) {
        self.pos = 0;
        if self.scratch.is_some() {
            // The states zeroed where they are, after the session's queued kernels (the memset
            // is not on their stream), keeping their KV pages (`release_kv` hands them back): the
            // addresses, and so the captured decode graphs, stay. Only if that fails, new ones.
            let zeroed = self.model.gpu.sync().and_then(|_| {
                self.states.iter().try_for_each(|st| match st {
                    GState::Gdn { conv, rec } => conv.zero().and_then(|_| rec.zero()),
                    GState::Attn { k, v } => k.zero().and_then(|_| v.zero()),
                })
            });
            self.ps = None;
            if zeroed.is_err() {
                if let Ok(s) = self.fresh_states() {
                    self.states = s;
                    self.graphs = Default::default();
                }
            }
        }
    }
}
