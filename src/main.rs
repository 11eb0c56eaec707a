//! The `lily` command line: run, chat, perplexity, tokenize, bench.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "lily", version, about = "Qwen3.5/3.6 MoE inference engine (CPU reference backend)")]
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
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Run(a) => cli::run::run(a),
        Cmd::Chat(a) => cli::run::chat(a),
        Cmd::Perplexity(a) => cli::perplexity::run(a),
        Cmd::Tokenize(a) => cli::tokenize::run(a),
        Cmd::Bench(a) => cli::bench::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
