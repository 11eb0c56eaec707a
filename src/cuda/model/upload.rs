//! Uploading a model's weights to the GPU once per process ([`CudaModel::upload`]): every
//! matrix in its device layout (gate/up side by side, experts stacked, the shared expert as
//! expert E where formats allow), and the registry that shares one upload between sessions.

use super::{CudaModel, GExperts, GFfn, GLayer, GMixer, GMlp, Proj};
use crate::cuda::ops::GpuLinear;
use crate::cuda::{gpu, Gpu};
use crate::model::{Ffn, Mixer, Mlp, Model};
use crate::progress::Progress;
use anyhow::{bail, Result};
use std::sync::{Arc, Mutex, Weak};
fn mlp(g: &Arc<Gpu>, m: &Mlp) -> Result<GMlp> {
    Ok(GMlp { gate_up: Proj::new(g, &[&m.gate, &m.up])?, inter: m.gate.rows, down: GpuLinear::upload(g, &m.down)? })
}

impl CudaModel {
    /// Uploads every weight of `model` to the GPU.
    pub fn upload(model: &Model) -> Result<CudaModel> {
        let g = gpu()?;
        g.bind()?;
        let cfg = model.cfg.clone();
        if cfg.attn_output_gate && cfg.q_proj_dim() != 2 * cfg.num_attention_heads * cfg.head_dim {
            bail!("unexpected q_proj layout");
        }
        let up = |l: &crate::linear::Linear| GpuLinear::upload(&g, l);
        let mut progress = Progress::new("uploading weights to the GPU", model.layers.len());
        let mut layers = Vec::new();
        for l in &model.layers {
            let mixer = match &l.mixer {
                Mixer::Gdn(x) => GMixer::Gdn {
                    proj: Proj::new(&g, &[&x.in_qkv, &x.in_z, &x.in_b, &x.in_a])?,
                    conv: g.upload_f32(&x.conv)?,
                    dt_bias: g.upload_f32(&x.dt_bias)?,
                    neg_a: g.upload_f32(&x.neg_a)?,
                    norm: g.upload_f32(&x.norm)?,
                    out: up(&x.out)?,
                },
                Mixer::Attention(a) => GMixer::Attn {
                    proj: Proj::new(&g, &[&a.q, &a.k, &a.v])?,
                    o: up(&a.o)?,
                    q_norm: g.upload_f32(&a.q_norm)?,
                    k_norm: g.upload_f32(&a.k_norm)?,
                },
            };
            let ffn = match &l.ffn {
                Ffn::Moe(m) => {
                    let mut gate_up: Vec<_> = m.experts.iter().flat_map(|e| [&e.gate, &e.up]).collect();
                    let mut downs: Vec<_> = m.experts.iter().map(|e| &e.down).collect();
                    let e0 = &m.experts[0];
                    let same = |a: &crate::linear::Linear, b: &crate::linear::Linear| {
                        a.rows == b.rows && a.cols == b.cols && a.w.format() == b.w.format()
                    };
                    let shared_slot = same(&m.shared.gate, &e0.gate)
                        && same(&m.shared.up, &e0.up)
                        && same(&m.shared.down, &e0.down)
                        && (cfg.num_experts_per_tok + 1) * e0.down.cols <= crate::cuda::ops::GEMV_XMAX
                        && e0.down.cols.is_multiple_of(4);
                    if shared_slot {
                        gate_up.extend([&m.shared.gate, &m.shared.up]);
                        downs.push(&m.shared.down);
                    }
                    GFfn::Moe {
                        router: Proj::new(&g, &[&m.router, &m.shared_gate])?,
                        experts: GExperts {
                            gate_up: GpuLinear::stack(&g, &gate_up)?,
                            down: GpuLinear::stack(&g, &downs)?,
                            shared_slot,
                        },
                        shared: mlp(&g, &m.shared)?,
                    }
                }
                Ffn::Dense(m) => GFfn::Dense(mlp(&g, m)?),
            };
            layers.push(GLayer {
                input_norm: g.upload_f32(&l.input_norm)?,
                post_norm: g.upload_f32(&l.post_norm)?,
                mixer,
                ffn,
            });
            progress.tick();
        }
        progress.finish();
        let embed = up(&model.embed)?;
        let lm_head = up(&model.lm_head)?;
        let norm = g.upload_f32(&model.norm)?;
        let mut weight_bytes = embed.nbytes() + lm_head.nbytes();
        for l in &layers {
            weight_bytes += match &l.mixer {
                GMixer::Gdn { proj, out, .. } => proj.nbytes() + out.nbytes(),
                GMixer::Attn { proj, o, .. } => proj.nbytes() + o.nbytes(),
            };
            let m2 = |m: &GMlp| m.gate_up.nbytes() + m.down.nbytes();
            weight_bytes += match &l.ffn {
                GFfn::Moe { router, experts, shared } => {
                    router.nbytes() + experts.gate_up.nbytes() + experts.down.nbytes() + m2(shared)
                }
                GFfn::Dense(m) => m2(m),
            };
        }
        g.sync()?;
        Ok(CudaModel { gpu: g, cfg, embed, lm_head, norm, layers, weight_bytes })
    }
}

type Registry = Vec<(Weak<Model>, Arc<CudaModel>)>;
static UPLOADED: Mutex<Registry> = Mutex::new(Vec::new());

/// Uploads `model` once per process (later calls return the same device copy).
pub fn upload_cached(model: &Arc<Model>) -> Result<Arc<CudaModel>> {
    if let Some(m) = uploaded(model) {
        return Ok(m);
    }
    let m = Arc::new(CudaModel::upload(model)?);
    let mut reg = UPLOADED.lock().unwrap();
    reg.retain(|(w, _)| w.strong_count() > 0);
    reg.push((Arc::downgrade(model), m.clone()));
    Ok(m)
}

/// The device copy of `model`, when [`upload_cached`] made one.
pub fn uploaded(model: &Arc<Model>) -> Option<Arc<CudaModel>> {
    let reg = UPLOADED.lock().unwrap();
    reg.iter().find(|(w, _)| w.as_ptr() == Arc::as_ptr(model)).map(|(_, m)| m.clone())
}
