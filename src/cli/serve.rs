//! `lily serve`: the OpenAI-compatible HTTP server (see `lily::server`).

use super::ModelArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use lily::server::Config;
use serde_json::Value;
use std::path::Path;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The model, as with --model (`lily serve ORG/NAME`).
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    pub model_positional: Option<String>,
    /// Address to listen on, HOST:PORT or :PORT (loopback by default; port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8000", conflicts_with_all = ["host", "port"])]
    pub bind: String,
    /// Host to listen on (with --port; default 127.0.0.1).
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on (with --host; default 8000).
    #[arg(long)]
    pub port: Option<u16>,
    /// Context limit per request, prompt plus completion (default: the model's).
    #[arg(allow_negative_numbers = true, short = 'c', long, visible_alias = "ctx-size")]
    pub max_seq: Option<usize>,
    /// Require `Authorization: Bearer KEY` (everything but /health).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests that may wait while one generates; beyond that the server answers 503.
    #[arg(allow_negative_numbers = true, long, default_value_t = 64)]
    pub queue_size: usize,
    /// Largest request body in bytes (larger: 413).
    #[arg(allow_negative_numbers = true, long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a client has to send its request head, and then its body (else the connection
    /// closes, or 408).
    #[arg(allow_negative_numbers = true, long, default_value_t = 30)]
    pub read_timeout_secs: u64,
    /// Memory for prefix-cache snapshots, in MiB (0 disables the cache). Default: 16 whole-state
    /// snapshots of this model at 4,096 tokens (or --max-seq), at most a tenth of available memory.
    #[arg(allow_negative_numbers = true, long)]
    pub prefix_cache_mb: Option<usize>,
    /// The model name reported by /v1/models and in responses (default: the directory name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Browser origins allowed to call the API (CORS), comma-separated, or `*` for any.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Completion tokens for a request that names no max_tokens, within the context (Qwen's
    /// recommended output length for thinking answers; 0: the rest of the context).
    #[arg(allow_negative_numbers = true, long, default_value_t = 32768)]
    pub max_tokens_default: usize,
    /// Sequences generated at once (continuous batching); more requests wait in the queue.
    /// Default: 8 on the CPU, 64 on the GPU.
    #[arg(allow_negative_numbers = true, long)]
    pub max_num_seqs: Option<usize>,
    /// Prompt tokens per engine step over all prefilling requests, so that a long prompt is
    /// spread over several steps and other streams keep going (default: 512 CPU, 2048 GPU).
    #[arg(allow_negative_numbers = true, long)]
    pub max_prefill_tokens: Option<usize>,
    /// KV-cache positions over all running requests; a request reserves its prompt plus
    /// max_tokens and waits while that does not fit. Default: max-num-seqs × max-seq, at most
    /// what half of the available memory holds on the CPU, and on the GPU what
    /// --gpu-memory-utilization leaves after the weights, the slots' recurrent states and 2 GiB
    /// of scratch.
    #[arg(allow_negative_numbers = true, long)]
    pub kv_budget_tokens: Option<usize>,
    /// GPU: the share of the device's memory lily may hold (weights, states, scratch and the
    /// KV cache), from which the default --kv-budget-tokens is derived (as vLLM's flag).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// No log line per request.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// `LILY_TEST_SCRIPTS='{"trigger": "output", ...}'`: a test-only hook that makes requests whose
/// last message contains `trigger` generate exactly `output` (see `lily::server::Config::scripts`).
fn scripts() -> Result<Vec<(String, String)>> {
    let Ok(s) = std::env::var("LILY_TEST_SCRIPTS") else {
        return Ok(Vec::new());
    };
    let v: serde_json::Map<String, Value> =
        serde_json::from_str(&s).context("LILY_TEST_SCRIPTS must be a JSON object")?;
    v.into_iter()
        .map(|(k, v)| match v {
            Value::String(out) => Ok((k, out)),
            _ => bail!("LILY_TEST_SCRIPTS values must be strings"),
        })
        .collect()
}

/// Bytes of available host memory (`MemAvailable`), where the system says.
fn available_memory() -> Option<usize> {
    let t = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: usize = t.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb << 10)
}

/// The default prefix-cache budget: 16 snapshots (recurrent and conv state plus the KV cache at
/// `min(max_seq, 4096)` positions), at most a tenth of `available` bytes.
fn default_cache_bytes(state: (usize, usize), max_seq: usize, available: Option<usize>) -> usize {
    let (fixed, kv_per_pos) = state;
    let snapshot = fixed + kv_per_pos * max_seq.min(4096);
    let want = 16 * snapshot;
    available.map_or(want, |a| want.min(a / 10))
}

/// The default KV budget: every slot at the full context, on the CPU at most what half of the
/// `available` bytes hold at `kv_per_token` bytes per position.
fn default_kv_budget(slots: usize, max_seq: usize, kv_per_token: usize, available: Option<usize>) -> usize {
    let full = slots.saturating_mul(max_seq);
    available.map_or(full, |a| full.min(a / 2 / kv_per_token).max(max_seq))
}

/// Scratch the GPU budget leaves aside besides the weights, states and KV cache: the shared
/// prefill scratch (~0.6 GB at 2,048-token chunks of the 35B model), the decode scratch, split-K
/// workspaces and captured graphs.
const GPU_SCRATCH_BYTES: usize = 2 << 30;

/// The default KV budget on the GPU: positions at `kv_per_token` bytes that fit in `util` of
/// `total` device bytes once `used` (weights and context, already held) and `slots` recurrent
/// states of `state` bytes and [`GPU_SCRATCH_BYTES`] are counted; at most `slots × max_seq`.
/// An error names the numbers when not even one full-context request would fit.
fn gpu_kv_budget(
    slots: usize,
    max_seq: usize,
    kv_per_token: usize,
    state: usize,
    (free, total): (usize, usize),
    util: f64,
) -> Result<usize> {
    if !(util > 0.0 && util <= 1.0) {
        bail!("--gpu-memory-utilization must be in (0, 1], got {util}");
    }
    let used = total.saturating_sub(free);
    let allowed = (total as f64 * util) as usize;
    let fixed = used + slots.saturating_mul(state) + GPU_SCRATCH_BYTES;
    let kv = allowed.saturating_sub(fixed) / kv_per_token.max(1);
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    if kv < max_seq.min(4096) {
        bail!(
            "--gpu-memory-utilization {util} allows {:.1} GiB of the device's {:.1} GiB; {:.1} GiB are in use and {slots} slots' recurrent state plus scratch take {:.1} GiB, leaving room for {kv} KV positions; lower --max-num-seqs or --max-seq, or raise --gpu-memory-utilization",
            gib(allowed),
            gib(total),
            gib(used),
            gib(slots.saturating_mul(state) + GPU_SCRATCH_BYTES)
        );
    }
    Ok(kv.min(slots.saturating_mul(max_seq)))
}

/// The listening address from --bind or --host/--port; `:PORT` means loopback.
fn bind_address(a: &ServeArgs) -> String {
    if a.host.is_some() || a.port.is_some() {
        let host = a.host.clone().unwrap_or_else(|| "127.0.0.1".into());
        let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host };
        return format!("{host}:{}", a.port.unwrap_or(8000));
    }
    match a.bind.strip_prefix(':') {
        Some(port) => format!("127.0.0.1:{port}"),
        None => a.bind.clone(),
    }
}

pub fn run(mut a: ServeArgs) -> Result<()> {
    if let Some(m) = a.model_positional.take() {
        a.model.model = m;
    }
    if a.queue_size == 0 {
        bail!("--queue-size must be at least 1");
    }
    let scripts = scripts()?;
    if !scripts.is_empty() {
        eprintln!("lily serve: LILY_TEST_SCRIPTS is set: {} scripted test outputs are active", scripts.len());
    }
    let mut loaded = a.model.load()?;
    loaded.tokenizer("serve needs one")?;
    let tok = loaded.tokenizer.take().context("no tokenizer")?;
    let gpu = lily::cuda::uploaded(&loaded.model).is_some();
    let slots = a.max_num_seqs.unwrap_or(if gpu { 64 } else { 8 });
    if slots == 0 || slots > 1024 {
        bail!("--max-num-seqs must be between 1 and 1024, got {slots}");
    }
    let model_max = loaded.model.cfg.max_position_embeddings;
    let max_seq = a.max_seq.unwrap_or(model_max);
    if max_seq > model_max {
        bail!("--max-seq {max_seq} exceeds the model's context of {model_max} tokens");
    }
    let cache_bytes = match a.prefix_cache_mb {
        Some(mb) => mb.checked_mul(1 << 20).context("--prefix-cache-mb is too large")?,
        None => default_cache_bytes(loaded.model.state_bytes(), max_seq, available_memory()),
    };
    eprintln!(
        "lily serve: prefix cache budget {} MiB{}",
        cache_bytes >> 20,
        if a.prefix_cache_mb.is_none() {
            " (16 snapshots of this model, at most 1/10 of free memory; --prefix-cache-mb sets it)"
        } else {
            ""
        }
    );
    let max_prefill_tokens = a.max_prefill_tokens.unwrap_or(if gpu { 2048 } else { 512 });
    if max_prefill_tokens == 0 {
        bail!("--max-prefill-tokens must be at least 1");
    }
    let (state, kv_f32) = loaded.model.state_bytes();
    let c = &loaded.model.cfg;
    let kv_per_token =
        if gpu { a.model.gpu_kv().from_f32_bytes(kv_f32, c.num_key_value_heads, c.head_dim) } else { kv_f32 }.max(1);
    let kv_budget_tokens = match (a.kv_budget_tokens, lily::cuda::uploaded(&loaded.model)) {
        (Some(0), _) => bail!("--kv-budget-tokens must be at least 1"),
        (Some(n), _) => n,
        (None, Some(m)) => {
            let mem = m.gpu.mem_info()?;
            gpu_kv_budget(slots, max_seq, kv_per_token, state, mem, a.gpu_memory_utilization)?
        }
        (None, None) => default_kv_budget(slots, max_seq, kv_per_token, available_memory()),
    };
    eprintln!(
        "lily serve: {slots} sequence slots, {max_prefill_tokens} prompt tokens per step, KV budget {kv_budget_tokens} tokens ({} MiB at {} bytes per position on the {})",
        (kv_budget_tokens as u128 * kv_per_token as u128) >> 20,
        kv_per_token,
        if gpu { "GPU" } else { "CPU" }
    );
    let backend = a.model.batch(&loaded, slots)?;
    // Already in the cache after `load` (a hub id is resolved once more, without the network).
    let resolved = a.model.resolve()?;
    let dir = Path::new(&resolved);
    let model_id = a.served_model_name.clone().unwrap_or_else(|| super::model_name(&a.model.model));
    let cfg = Config {
        bind: bind_address(&a),
        model_id,
        max_seq,
        api_key: a.api_key,
        queue_size: a.queue_size,
        max_body_bytes: a.max_body_bytes,
        read_timeout: std::time::Duration::from_secs(a.read_timeout_secs.max(1)),
        prefix_cache_bytes: cache_bytes,
        max_prefill_tokens,
        kv_budget_tokens,
        defaults: super::generation_defaults(dir).unwrap_or_default(),
        scripts,
        allowed_origins: a.allowed_origins.iter().map(|o| o.trim().to_string()).filter(|o| !o.is_empty()).collect(),
        max_tokens_default: (a.max_tokens_default > 0).then_some(a.max_tokens_default),
        log_requests: !a.quiet,
    };
    lily::server::serve(cfg, tok, backend)
}

#[cfg(test)]
mod tests {
    use super::{default_cache_bytes, default_kv_budget, gpu_kv_budget};

    #[test]
    fn the_gpu_kv_budget_counts_what_is_held_and_refuses_absurd_settings() {
        let gib = 1usize << 30;
        // 100 GiB device, 20 GiB in use, 0.9 allowed: 90 - 20 - 64 x 64 MiB - 2 GiB = 64 GiB.
        let kv = gpu_kv_budget(64, 262_144, 20 << 10, 64 << 20, (80 * gib, 100 * gib), 0.9).unwrap();
        assert_eq!(kv, 64 * gib / (20 << 10));
        // Never more than every slot at the full context.
        assert_eq!(gpu_kv_budget(2, 1000, 1024, 0, (100 * gib, 100 * gib), 0.9).unwrap(), 2000);
        // Nothing left: an error naming the numbers, not a budget of zero.
        let e = gpu_kv_budget(64, 4096, 20 << 10, 64 << 20, (10 * gib, 100 * gib), 0.9).unwrap_err();
        assert!(e.to_string().contains("lower --max-num-seqs"), "{e}");
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let e = gpu_kv_budget(1, 4096, 1024, 0, (gib, gib), bad).unwrap_err();
            assert!(e.to_string().contains("--gpu-memory-utilization"), "{e}");
        }
    }

    #[test]
    fn the_default_kv_budget_fits_the_slots_and_the_memory() {
        assert_eq!(default_kv_budget(8, 4096, 1024, None), 8 * 4096);
        assert_eq!(default_kv_budget(8, 4096, 1024, Some(1 << 40)), 8 * 4096);
        // Half of 64 MiB at 1 KiB per position: 32,768 positions, not 8 × 262,144.
        assert_eq!(default_kv_budget(8, 262_144, 1024, Some(64 << 20)), 262_144);
        assert_eq!(default_kv_budget(8, 4096, 1024, Some(64 << 20)), 32_768);
    }

    #[test]
    fn the_default_prefix_cache_follows_the_model_and_the_memory() {
        // 35B-A3B shape: 63 MiB of GDN + conv state, 40 KiB of fp32 KV per position.
        let big = (63 << 20, 40 << 10);
        assert_eq!(default_cache_bytes(big, 262_144, None), 16 * ((63 << 20) + (40 << 10) * 4096));
        assert_eq!(default_cache_bytes(big, 262_144, Some(8 << 30)), (8 << 30) / 10);
        // A tiny model gets a tiny cache, not 2 GiB.
        assert!(default_cache_bytes((100 << 10, 512), 1024, Some(16 << 30)) < 16 << 20);
    }
}
