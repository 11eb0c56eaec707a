//! The model on the GPU: weights uploaded once ([`CudaModel`]) and a [`CudaSession`] that runs
//! the forward pass of `src/model.rs` step by step with our kernels, activations in fp32.
//!
//! Per token (batch 1): embed → per layer {RMSNorm → mixer (GDN or gated attention) → + residual
//! (fused into the out-projection) → RMSNorm → MoE (router, device top-k, expert GEMVs that read
//! the expert ids from device memory, shared expert with sigmoid gate, combine + residual)} →
//! final RMSNorm → lm_head.
//!
//! The decode step's kernels are queued in `model/decode.rs` (`record`, `record_layer`).
//!
//! A prompt of several tokens runs as a batched prefill in chunks ([`CudaSession::prefill`]):
//! the same layer order over `[T, ·]` activations, with many-row products (bf16 tensor cores by
//! default, or fp32 for the exact mode), the GDN conv + delta-rule scan over the chunk, causal
//! attention over the cache, and routed experts grouped by expert on the GPU (`moe_align` →
//! grouped GEMM → combine).

use super::ops::{AttnKernel, AttnPrep, GdnStep, GpuLinear, KvDtype, Precision};
use super::{profile, DevBuf, Gpu, Graph, PagedBuf};
use crate::config::ModelConfig;
use crate::generate::{Session, Snapshot};
use crate::model::Logits;
use crate::sampling::SamplingParams;
use crate::state::{LayerState, State};
use anyhow::{bail, Context, Result};
use std::sync::Arc;

mod attn_step;
mod batch;
mod decode;
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
        early: false,
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
    /// The two u64 counters moe_fused_q's and the q2 forms' blocks meet on (zeroed once; the third was
    /// moe_fused_qr's).
    sync: DevBuf,
    /// attn_decode_tc{D}_fold's arrival counters, one u64 per KV head (zeroed once).
    sync_attn: DevBuf,
    /// gemv_q2_route's per-block router parts `[H / 32, E + 2]` and its arrival counter
    /// (the decode default; `LILY_CUDA_MOE_ROUTER=launch` not).
    rpart: DevBuf,
    sync_route: DevBuf,
    /// `LILY_CUDA_MOE_TRACE=1`: moe_fused_q's stamps, `[layers, SMs, MOE_TRACE_SLOTS]` u64.
    moe_trace: Option<DevBuf>,
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
    /// The decode MoE launch where it takes the layer ([`super::ops::moe_form`]: `LILY_CUDA_MOE`).
    pub moe_form: super::ops::MoeForm,
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
    /// Decode attention's tensor-core kernel requests its first tiles before waiting for
    /// attn_prep ([`crate::cuda::AttnDecode::early`]; the default since session 41: +1.0% / +1.7%
    /// / +2.5% decode at 4K / 32K / 128K on an H100; `LILY_CUDA_ATTN_EARLY=0` turns it off).
    pub attn_early: bool,
    /// attn_prep computes its RoPE angles and loads its norm weights before its wait
    /// ([`crate::cuda::AttnPrep::early`]; the default since session 45, +1.2% decode at 256 and
    /// 4K on an H100; `LILY_CUDA_PREP_EARLY=0` turns it off).
    pub prep_early: bool,
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
            moe_form: super::ops::moe_form(),
            kv,
            persistent: pstep::wanted(),
            attn_early: std::env::var("LILY_CUDA_ATTN_EARLY").map_or(true, |v| v != "0"),
            prep_early: std::env::var("LILY_CUDA_PREP_EARLY").map_or(true, |v| v != "0"),
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
            sync: g.zeros(16)?,
            sync_attn: g.zeros(8 * c.num_key_value_heads.max(1))?,
            rpart: f((h.div_ceil(32) * (c.num_experts + 2)).max(2 * (c.num_experts + 1) + h.div_ceil(16) + 2))?,
            sync_route: g.zeros(8)?,
            moe_trace: if profile::moe_tracing() {
                Some(g.zeros(8 * profile::MOE_TRACE_SLOTS * g.sms as usize * self.model.layers.len())?)
            } else {
                None
            },
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
