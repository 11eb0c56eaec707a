//! Subcommands of the `lily` binary and the options they share.

pub mod bench;
pub mod bench_batch;
pub mod download;
pub mod perplexity;
pub mod run;
pub mod serve;
pub mod tokenize;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use lily::generate::{CpuSession, Session};
use lily::loader::Loaded;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
    Auto,
}

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model directory (MLX or Hugging Face layout), Hugging Face id (`ORG/NAME[@REVISION]`, from
    /// the hub cache or downloaded into it) or `synthetic:tiny` / `synthetic:qwen3.6-35b-a3b` /
    /// `synthetic:dense-small` / `synthetic:dense-small-bf16`.
    #[arg(short = 'm', long, default_value = "", hide_default_value = true)]
    pub model: String,
    /// Revision (branch, tag or commit) of a Hugging Face id.
    #[arg(long)]
    pub revision: Option<String>,
    /// Hugging Face token for gated or private repositories (default: HF_TOKEN, then the token
    /// file huggingface-cli writes).
    #[arg(long)]
    pub token: Option<String>,
    /// Number of layers of a synthetic model (keeps the 3:1 GDN/attention pattern).
    #[arg(allow_negative_numbers = true, long)]
    pub layers: Option<usize>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: Device,
    /// CPU threads (default: all cores).
    #[arg(allow_negative_numbers = true, short = 't', long)]
    pub threads: Option<usize>,
    /// CPU: int8 activations for the products with 4/8-bit weights (and bf16 activations for
    /// those with bf16 weights). This is the default; the flag is kept for scripts (--exact
    /// turns it off).
    #[arg(long)]
    pub cpu_int8: bool,
    /// The fp32 reference paths on every backend (also `LILY_EXACT=1`): fp32 activations on the
    /// CPU; fp32 prefill products and an fp32 KV cache on the GPU. Slower; what the reference
    /// tests compare against mlx-lm and transformers.
    #[arg(long)]
    pub exact: bool,
    /// KV cache element type on the GPU: bf16 (default; scores and softmax in fp32), fp8 (e4m3
    /// with a power-of-two scale per position and KV head: about half the bytes, for long
    /// contexts; models with 8 query heads per KV head and head dim 64/128/256) or f32 (the exact
    /// mode). The CPU backend keeps an f32 cache.
    #[arg(long, value_parser = ["auto", "bf16", "fp8", "f32"], default_value = "auto")]
    pub kv_cache_dtype: String,
}

impl ModelArgs {
    pub fn load(&self) -> Result<Loaded> {
        if let Some(n) = self.threads {
            if n == 0 {
                bail!("--threads must be at least 1");
            }
            let cores = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1);
            let limit = (8 * cores).max(16);
            if n > limit {
                bail!("--threads {n} is far above this machine's {cores} cores (at most {limit})");
            }
            rayon::ThreadPoolBuilder::new().num_threads(n).build_global().ok();
        }
        // Check for a GPU before loading (a clear error instead of a long load, then a failure).
        let use_cuda = match self.device {
            Device::Cpu => false,
            Device::Cuda => {
                lily::cuda::gpu().map_err(|e| anyhow::anyhow!("--device cuda: {e:#}"))?;
                true
            }
            Device::Auto => lily::cuda::gpu().is_ok(),
        };
        let exact = self.exact_mode();
        if exact && self.cpu_int8 {
            bail!("--exact and --cpu-int8 contradict each other (--exact uses fp32 activations)");
        }
        let low = matches!(self.kv_cache_dtype.as_str(), "bf16" | "fp8");
        if exact && low {
            bail!(
                "--exact and --kv-cache-dtype {} contradict each other (--exact keeps an fp32 KV cache)",
                self.kv_cache_dtype
            );
        }
        if !use_cuda && low {
            bail!(
                "--kv-cache-dtype {} needs the CUDA backend (the CPU backend keeps an f32 KV cache)",
                self.kv_cache_dtype
            );
        }
        // The fast path by default: int8 (bf16 for bf16 weights) activations on the CPU (the GPU defaults to its bf16
        // prefill and KV cache); --exact is the fp32 reference on both.
        lily::cpu::kernels::q8::set_cpu_int8(!exact);
        lily::cpu::kernels::set_bf16_activations(!exact);
        let why = match self.device {
            Device::Cpu => "--device cpu",
            Device::Cuda => "--device cuda",
            Device::Auto if use_cuda => "auto: a CUDA GPU was found",
            Device::Auto => "auto: no CUDA GPU/driver found",
        };
        let loaded = lily::loader::load(&self.resolve()?, self.layers)?;
        if use_cuda {
            let gm = lily::cuda::upload_cached(&loaded.model)?;
            if let Some(why) = (self.gpu_kv() == lily::cuda::KvDtype::Fp8).then(|| gm.fp8_kv_unsupported()).flatten() {
                bail!("--kv-cache-dtype fp8: {why}");
            }
        }
        eprintln!("{}", self.banner(&loaded, why));
        Ok(loaded)
    }

    /// `--exact` or `LILY_EXACT=1` (any value but `0`/empty).
    pub fn exact_mode(&self) -> bool {
        self.exact || std::env::var("LILY_EXACT").is_ok_and(|v| !v.is_empty() && v != "0")
    }

    /// The KV cache type GPU sessions get.
    pub fn gpu_kv(&self) -> lily::cuda::KvDtype {
        use lily::cuda::KvDtype;
        match self.kv_cache_dtype.as_str() {
            _ if self.exact_mode() => KvDtype::F32,
            "auto" => KvDtype::from_env().unwrap_or(KvDtype::Bf16),
            k => KvDtype::parse(k).unwrap_or(KvDtype::Bf16),
        }
    }

    /// The start-up banner: what was loaded, where it runs and why, and its memory.
    fn banner(&self, loaded: &Loaded, why: &str) -> String {
        let m = &loaded.model;
        let c = &m.cfg;
        let (params, bytes) = m.weight_totals();
        let format = match &c.quantization {
            Some(q) => format!("MLX {}-bit, group {}", q.bits, q.group_size),
            None => format!("HF {:?}", m.embed.w.format().2).to_lowercase(),
        };
        let n_attn = c.num_attention_layers();
        let ffn = if c.num_experts > 0 {
            format!("{} experts top-{} + shared", c.num_experts, c.num_experts_per_tok)
        } else {
            "dense MLP".into()
        };
        let (state, kv_f32) = m.state_bytes();
        let gpu = lily::cuda::uploaded(m).is_some();
        let kv = if gpu { self.gpu_kv().from_f32_bytes(kv_f32, c.num_key_value_heads, c.head_dim) } else { kv_f32 };
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        format!(
            "lily | {} ({}, {format}) | {} parameters, {:.2} GiB of weights | {} layers ({} Gated DeltaNet + {n_attn} attention), {ffn} | context {} | device {} ({why}) | KV cache {} KiB per token ({:.2} GiB at the full context) + {:.1} MiB recurrent state",
            self.model,
            c.model_type,
            if params >= 1_000_000_000 { format!("{:.2}B", params as f64 / 1e9) } else { format!("{:.1}M", params as f64 / 1e6) },
            gib(bytes),
            c.num_hidden_layers,
            c.num_hidden_layers - n_attn,
            c.max_position_embeddings,
            self.device_name(loaded),
            kv >> 10,
            gib(kv * c.max_position_embeddings),
            (state / 2) as f64 / (1u64 << 20) as f64,
        )
    }

    /// The directory (or `synthetic:NAME`) that `--model` names: a Hugging Face id becomes its
    /// snapshot in the hub cache, downloaded first if needed.
    pub fn resolve(&self) -> Result<String> {
        if self.model.is_empty() {
            bail!("no model given: pass --model DIR, --model ORG/NAME (a Hugging Face id) or --model synthetic:tiny");
        }
        resolve_model(&self.model, self.revision.as_deref(), self.token.clone())
    }

    /// A fresh session on the chosen device (Send, so a server worker thread can own it): the
    /// GPU when `load` uploaded the model there, else the CPU.
    pub fn session(&self, loaded: &Loaded) -> Box<dyn Session + Send> {
        match lily::cuda::uploaded(&loaded.model) {
            Some(m) => Box::new(self.cuda_session(m)),
            None => Box::new(CpuSession::new(loaded.model.clone())),
        }
    }

    /// A GPU session with this command's KV type and precision.
    fn cuda_session(&self, m: std::sync::Arc<lily::cuda::CudaModel>) -> lily::cuda::CudaSession {
        let mut s = lily::cuda::CudaSession::new(m);
        // load() checked that the model and device take this cache type
        if let Err(e) = s.set_kv_dtype(self.gpu_kv()) {
            eprintln!("warning: {e:#}; keeping the {:?} KV cache", s.kv_dtype());
        }
        if self.exact_mode() {
            s.prefill = Some(lily::cuda::Precision::F32);
        }
        s
    }

    /// `slots` sequence slots for the batching engine: the CPU's batched forward pass, or the
    /// GPU's batched decode step (`LILY_CUDA_BATCH=serial`: its sessions stepped in turn, for
    /// comparison).
    pub fn batch(&self, loaded: &Loaded, slots: usize) -> Result<Box<dyn lily::engine::batch::Batched>> {
        use lily::engine::batch::{CpuBatch, SerialBatch};
        Ok(match lily::cuda::uploaded(&loaded.model) {
            Some(_) if std::env::var("LILY_CUDA_BATCH").as_deref() == Ok("serial") => {
                Box::new(SerialBatch::new((0..slots).map(|_| self.session(loaded)).collect())?)
            }
            Some(m) => Box::new(lily::cuda::CudaBatch::new(m.clone(), slots, || self.cuda_session(m.clone()))?),
            None => Box::new(CpuBatch::new(loaded.model.clone(), slots)),
        })
    }

    /// The device sessions of this model run on, for reports.
    pub fn device_name(&self, loaded: &Loaded) -> String {
        match lily::cuda::uploaded(&loaded.model) {
            Some(m) => format!(
                "cuda ({}, {} KV cache{})",
                m.gpu.name,
                format!("{:?}", self.gpu_kv()).to_lowercase(),
                if self.exact_mode() { ", exact: fp32 prefill" } else { "" }
            ),
            None => format!(
                "cpu ({} threads{})",
                rayon::current_num_threads(),
                match (lily::cpu::kernels::q8::cpu_int8(), &loaded.model.cfg.quantization) {
                    (false, _) => ", fp32 activations (exact)",
                    (true, Some(_)) => ", int8 activations",
                    (true, None) => ", bf16 activations",
                }
            ),
        }
    }
}

/// The sampling defaults of a checkpoint's generation_config.json, if it has one (fields it
/// leaves out take OpenAI's: temperature 1, no truncation; `do_sample: false` is greedy).
pub fn generation_defaults(dir: &std::path::Path) -> Option<lily::server::Defaults> {
    use serde_json::Value;
    let mut d = lily::server::Defaults::default();
    let text = std::fs::read_to_string(dir.join("generation_config.json")).ok()?;
    let v = serde_json::from_str::<Value>(&text).ok()?;
    let f = |k: &str| v.get(k).and_then(Value::as_f64);
    if let Some(t) = f("temperature") {
        d.temperature = t as f32;
    }
    if let Some(t) = f("top_p") {
        d.top_p = t as f32;
    }
    if let Some(t) = v.get("top_k").and_then(Value::as_u64) {
        d.top_k = t as usize;
    }
    if let Some(t) = f("min_p") {
        d.min_p = t as f32;
    }
    if v.get("do_sample") == Some(&Value::Bool(false)) {
        d.temperature = 0.0;
    }
    Some(d)
}

/// `--model` as a local path (a Hugging Face id resolved through the hub cache).
pub fn resolve_model(model: &str, revision: Option<&str>, token: Option<String>) -> Result<String> {
    let opts = lily::hub::HubOptions::from_env(token);
    Ok(match lily::hub::resolve(model, revision, &opts)? {
        Some(dir) => dir.to_string_lossy().into_owned(),
        None => model.to_string(),
    })
}

/// The name a model is known by: the repository name of a hub id or of a hub-cache snapshot
/// (`models--ORG--NAME/snapshots/COMMIT`), else the directory's name.
pub fn model_name(model: &str) -> String {
    if lily::hub::HubId::parse(model, None).is_some() && !std::path::Path::new(model).exists() {
        return model.split('@').next().unwrap_or(model).to_string();
    }
    let p = std::path::Path::new(model);
    let canon = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let parts: Vec<String> = canon.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if let Some(i) = parts.iter().rposition(|c| c == "snapshots") {
        if let Some(repo) = i.checked_sub(1).and_then(|j| parts[j].strip_prefix("models--")) {
            return repo.replacen("--", "/", 1);
        }
    }
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| model.to_string())
}

/// Parses `1,2,3` or `1 2 3` (any mix of commas and whitespace) into token ids.
pub fn parse_token_list(s: &str) -> Result<Vec<u32>> {
    let ids: Result<Vec<u32>> = s
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().map_err(|_| anyhow::anyhow!("`{p}` is not a token id")))
        .collect();
    let ids = ids?;
    if ids.is_empty() {
        bail!("no token ids given");
    }
    Ok(ids)
}
