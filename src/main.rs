//! The `lily` command line: run, chat, perplexity, tokenize, bench, serve, download.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "lily",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("LILY_GIT_COMMIT"), "; backends: cpu, cuda via NVRTC and the driver, loaded at run time)"),
    about = "Inference engine for the Qwen3.5/3.6 family (CPU and CUDA backends)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a completion for one prompt, streamed to stdout.
    Run(cli::run::RunArgs),
    /// Interactive multi-turn chat in the terminal.
    Chat(cli::run::ChatArgs),
    /// Teacher-forced evaluation: perplexity and mean NLL of a token or text file.
    Perplexity(cli::perplexity::PerplexityArgs),
    /// Print the token ids of a text.
    Tokenize(cli::tokenize::TokenizeArgs),
    /// Prefill and decode throughput under the benchmark contract (docs/perf-log.md).
    Bench(cli::bench::BenchArgs),
    /// OpenAI-compatible HTTP server (chat completions, completions, models, health, metrics).
    Serve(cli::serve::ServeArgs),
    /// Fetch a checkpoint by Hugging Face id into the hub cache (without running it).
    Download(cli::download::DownloadArgs),
}

/// Keeps freed activation buffers in the heap instead of returning them to the kernel after
/// every layer: re-faulting and zeroing megabytes of fresh pages per projection cost up to a
/// fifth of prefill time (measured with perf on the CPU backend).
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc malloc tunables; called before any threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() {
    tune_allocator();
    let cli = Cli::parse();
    // Log lines (the server's per-request lines) on stderr; RUST_LOG filters them (default info).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.cmd {
        Cmd::Run(a) => cli::run::run(a),
        Cmd::Chat(a) => cli::run::chat(a),
        Cmd::Perplexity(a) => cli::perplexity::run(a),
        Cmd::Tokenize(a) => cli::tokenize::run(a),
        Cmd::Bench(a) => cli::bench::run(a),
        Cmd::Serve(a) => cli::serve::run(a),
        Cmd::Download(a) => cli::download::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
