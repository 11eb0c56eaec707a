//! Subcommands of the `lily` binary and the options they share.

pub mod bench;
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
    /// Model directory (MLX or Hugging Face layout) or `synthetic:tiny` / `synthetic:qwen3.6-35b-a3b`.
    #[arg(long)]
    pub model: String,
    /// Number of layers of a synthetic model (keeps the 3:1 GDN/attention pattern).
    #[arg(allow_negative_numbers = true, long)]
    pub layers: Option<usize>,
    /// Where to run.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: Device,
    /// CPU threads (default: all cores).
    #[arg(allow_negative_numbers = true, long)]
    pub threads: Option<usize>,
    /// CPU: quantize activations to int8 for the products with 4/8-bit weights (faster, less
    /// exact; also `LILY_CPU_INT8=1`). Default: fp32 activations.
    #[arg(long)]
    pub cpu_int8: bool,
}

impl ModelArgs {
    pub fn load(&self) -> Result<Loaded> {
        if let Some(n) = self.threads {
            if n == 0 {
                bail!("--threads must be at least 1");
            }
            rayon::ThreadPoolBuilder::new().num_threads(n).build_global().ok();
        }
        if self.cpu_int8 {
            lily::kernels::q8::set_cpu_int8(true);
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
        let loaded = lily::loader::load(&self.model, self.layers)?;
        if use_cuda {
            lily::cuda::upload_cached(&loaded.model)?;
        }
        Ok(loaded)
    }

    /// A fresh session on the chosen device (Send, so a server worker thread can own it): the
    /// GPU when `load` uploaded the model there, else the CPU.
    pub fn session(&self, loaded: &Loaded) -> Box<dyn Session + Send> {
        match lily::cuda::uploaded(&loaded.model) {
            Some(m) => Box::new(lily::cuda::CudaSession::new(m)),
            None => Box::new(CpuSession::new(loaded.model.clone())),
        }
    }

    /// The device sessions of this model run on, for reports.
    pub fn device_name(&self, loaded: &Loaded) -> String {
        match lily::cuda::uploaded(&loaded.model) {
            Some(m) => format!("cuda ({})", m.gpu.name),
            None => format!(
                "cpu ({} threads{})",
                rayon::current_num_threads(),
                if lily::kernels::q8::cpu_int8() { ", int8 activations" } else { "" }
            ),
        }
    }
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
