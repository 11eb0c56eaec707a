//! The `lily` binary end to end on the committed tiny checkpoints.

mod common;
use common::*;
use std::process::Command;

fn lily_stdin(args: &[&str], input: &str) -> (bool, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running lily");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn lily(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lily")).args(args).output().expect("running lily");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn model(name: &str) -> String {
    fixtures().join(name).to_string_lossy().into_owned()
}

#[test]
fn run_json_gives_mlx_lm_greedy_tokens() {
    // The reference greedy continuation of the fixture prompt, through the CLI.
    let r = lily::safetensors::SafeFile::open(&fixtures().join("ref/tiny-mlx4.safetensors")).unwrap();
    let prompt: Vec<String> = r.tensors["prompt"].to_i32().unwrap().iter().map(|x| x.to_string()).collect();
    let greedy: Vec<u32> = r.tensors["greedy"].to_i32().unwrap().iter().map(|&x| x as u32).collect();
    let (ok, out, err) = lily(&[
        "run",
        "--model",
        &model("tiny-mlx4"),
        "--prompt-tokens",
        &prompt.join(","),
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--exact",
        "--json",
    ]);
    assert!(ok, "{err}");
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let toks: Vec<u32> = last["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    // Generation stops early only at an EOS id, which the reference would also have produced.
    assert!(!toks.is_empty() && toks.len() <= 8);
    assert_eq!(toks[..], greedy[..toks.len()]);
    assert!(last["timings"]["decode_tokens_per_s"].is_number());
}

#[test]
fn seeded_sampling_is_reproducible_through_the_cli() {
    let args = [
        "run",
        "--model",
        "synthetic:tiny",
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "12",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--seed",
        "42",
        "--json",
    ];
    let (ok1, a, e) = lily(&args);
    assert!(ok1, "{e}");
    let (_, b, _) = lily(&args);
    let parse = |s: &str| -> serde_json::Value { serde_json::from_str(s.lines().last().unwrap()).unwrap() };
    let (a, b) = (parse(&a), parse(&b));
    assert_eq!(a["tokens"], b["tokens"]);
    assert_eq!(a["text"], b["text"]);
}

#[test]
fn chat_template_prompt_runs() {
    let (ok, out, err) =
        lily(&["run", "--model", &model("tiny-hf"), "--prompt", "hello", "--max-tokens", "4", "--no-think", "--json"]);
    assert!(ok, "{err}");
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert!(last["prompt_tokens"].as_u64().unwrap() > 3, "template tokens were added");
}

#[test]
fn perplexity_dumps_the_reference_logits() {
    let r = lily::safetensors::SafeFile::open(&fixtures().join("ref/tiny-hf.safetensors")).unwrap();
    let prompt: Vec<String> = r.tensors["prompt"].to_i32().unwrap().iter().map(|x| x.to_string()).collect();
    let want = r.tensors["logits"].to_f32().unwrap();
    let dir = std::env::temp_dir().join(format!("lily-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toks = dir.join("tokens.txt");
    std::fs::write(&toks, prompt.join(" ")).unwrap();
    let dump = dir.join("logits.safetensors");
    let (ok, out, err) = lily(&[
        "perplexity",
        "--model",
        &model("tiny-hf"),
        "--tokens-file",
        toks.to_str().unwrap(),
        "--dump-logits",
        dump.to_str().unwrap(),
        "--chunk",
        "64",
        "--exact",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["scored"], prompt.len() - 1);
    assert!(v["perplexity"].as_f64().unwrap() > 1.0);
    let f = lily::safetensors::SafeFile::open(&dump).unwrap();
    let got = f.tensors["logits"].to_f32().unwrap();
    assert_eq!(f.tensors["logits"].shape, vec![prompt.len(), 512]);
    // Same bound as tests/reference.rs, against mlx-lm.
    assert!(max_abs_diff(&got, &want) < 1e-3, "{}", max_abs_diff(&got, &want));
    std::fs::remove_dir_all(&dir).ok();
}

/// Without sampling flags `run` takes the checkpoint's generation_config.json (the fixture's:
/// temperature 1, top_k 20, top_p 0.95), as `serve` does; flags override it.
#[test]
fn run_takes_the_generation_config_defaults() {
    let m = model("tiny-mlx4");
    let (ok, _, err) = lily(&["run", "-m", &m, "--prompt-tokens", "1,2", "-n", "2"]);
    assert!(ok, "{err}");
    assert!(err.contains("temperature 1, top_k 20, top_p 0.95") && err.contains("generation_config.json"), "{err}");
    let (ok, _, err) = lily(&["run", "-m", &m, "--prompt-tokens", "1,2", "-n", "2", "--temp", "0"]);
    assert!(ok, "{err}");
    assert!(err.contains("greedy"), "{err}");
}

#[test]
fn tokenize_prints_ids() {
    let (ok, out, err) = lily(&["tokenize", "--model", &model("tiny-hf"), "--text", "hello world", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(!v["ids"].as_array().unwrap().is_empty());
}

#[test]
fn bad_input_gives_clear_errors() {
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["run", "--model", "/nonexistent", "--prompt", "x"], "does not exist"),
        (vec!["run", "--model", "synthetic:nope", "--prompt-tokens", "1"], "unknown synthetic model"),
        (vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1,x"], "`x` is not a token id"),
        (vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "99999999"], "out of range"),
        (vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1", "--temperature=-2"], "temperature"),
        (vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1", "--top-p", "0"], "top_p"),
        (vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1", "--device", "cuda"], "cuda"),
        (vec!["perplexity", "--model", "synthetic:tiny"], "--tokens-file"),
        // A negative number is an invalid value, not an unknown argument.
        (vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1", "--temperature", "-1"], "temperature"),
        (vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1", "--max-tokens", "-3"], "invalid value '-3'"),
        (vec!["run", "--model", "/nonexistent/model.gguf", "--prompt-tokens", "1"], "GGUF is not supported"),
        (vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1", "--threads", "100000"], "far above"),
        // Low-precision KV caches are GPU-only, and not for the exact mode.
        (
            vec![
                "run",
                "--model",
                "synthetic:tiny",
                "--prompt-tokens",
                "1",
                "--device",
                "cpu",
                "--kv-cache-dtype",
                "fp8",
            ],
            "needs the CUDA backend",
        ),
        (
            vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1", "--exact", "--kv-cache-dtype", "fp8"],
            "contradict",
        ),
        (
            vec!["run", "--model", "synthetic:tiny", "--prompt-tokens", "1", "--kv-cache-dtype", "fp4"],
            "invalid value 'fp4'",
        ),
        // Contexts beyond the model's are refused before any prefill runs.
        (vec!["bench", "--model", "synthetic:tiny", "--contexts", "16,262144"], "exceed the model's context"),
    ];
    for (args, want) in cases {
        let (ok, _, err) = lily(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: stderr `{err}` should mention `{want}`");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

/// The short and familiar flags of llama.cpp / mlx-lm users are aliases of the long ones: the
/// same tokens either way.
#[test]
fn familiar_flags_are_aliases() {
    let m = model("tiny-mlx4");
    let long = [
        "run",
        "--model",
        &m,
        "--prompt",
        "hi",
        "--max-tokens",
        "4",
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--threads",
        "1",
        "--raw",
        "--json",
    ];
    let short =
        ["run", "-m", &m, "-p", "hi", "-n", "4", "--temp", "0.8", "-s", "5", "-t", "1", "--raw", "--json", "-c", "64"];
    let (ok, a, err) = lily(&long);
    assert!(ok, "{err}");
    let (ok, b, err) = lily(&short);
    assert!(ok, "{err}");
    let tokens = |out: &str| {
        serde_json::from_str::<serde_json::Value>(out.trim().lines().last().unwrap()).unwrap()["tokens"].clone()
    };
    assert_eq!(tokens(&a), tokens(&b));
    assert_eq!(tokens(&a).as_array().unwrap().len(), 4);
    // --ctx-size caps the generation, and a prompt that fills it is refused.
    let (ok, out, err) = lily(&["run", "-m", &m, "--prompt-tokens", "1,2,3", "-n", "50", "-c", "6", "--json"]);
    assert!(ok, "{err}");
    assert_eq!(tokens(&out).as_array().unwrap().len(), 3, "6 - 3 prompt tokens");
    let (ok, _, err) = lily(&["run", "-m", &m, "--prompt-tokens", "1,2,3", "-c", "3"]);
    assert!(!ok && err.contains("--ctx-size"), "{err}");
    let (ok, out, _) = lily(&["--version"]);
    assert!(ok && out.contains("commit") && out.contains("cuda"), "{out}");
}

/// The CPU runs int8 activations (bf16 for bf16 weights) unless --exact (or LILY_EXACT=1) asks
/// for the fp32 reference; the banner says which, and contradicting flags are refused.
#[test]
fn the_fast_path_is_the_default_and_exact_a_flag_away() {
    let m = model("tiny-mlx4");
    let args = ["run", "-m", &m, "--prompt-tokens", "1,2,3", "-n", "2", "--device", "cpu"];
    let (ok, _, err) = lily(&args);
    assert!(ok && err.contains("int8 activations"), "{err}");
    let (ok, _, err) = lily(&[&args[..], &["--exact"]].concat());
    assert!(ok && err.contains("fp32 activations (exact)"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_lily")).args(args).env("LILY_EXACT", "1").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("fp32 activations (exact)"));
    let hf = model("tiny-hf");
    let (ok, _, err) = lily(&["run", "-m", &hf, "--prompt-tokens", "1,2,3", "-n", "2", "--device", "cpu"]);
    assert!(ok && err.contains("bf16 activations"), "{err}");
    let (ok, _, err) = lily(&[&args[..], &["--exact", "--cpu-int8"]].concat());
    assert!(!ok && err.contains("contradict"), "{err}");
    // The banner names the model's shape and memory.
    let (_, _, err) = lily(&args);
    assert!(err.contains("qwen3_5_moe") && err.contains("MLX 4-bit") && err.contains("KV cache"), "{err}");
}

/// chat: commands answer on stderr, an overflowing context is reported and the session goes on.
#[test]
fn chat_commands_answer_and_errors_keep_the_session() {
    let input = "/help\n/think off\nhello\n/bogus\n/reset\n/quit\n";
    let (ok, out, err) = lily_stdin(&["chat", "-m", "synthetic:tiny", "-n", "3", "--device", "cpu"], input);
    assert!(ok, "{err}");
    assert!(err.contains("/think on|off") && err.contains("thinking off"), "{err}");
    assert!(err.contains("unknown command /bogus"), "{err}");
    assert!(err.contains("conversation cleared (2 messages forgotten)"), "{err}");
    assert!(err.contains("3 tokens") && err.contains("tok/s"), "per-turn stats: {err}");
    assert!(!out.is_empty());
    // A context too small for the message: reported, and the next command still runs.
    let (ok, _, err) =
        lily_stdin(&["chat", "-m", "synthetic:tiny", "-c", "4", "--device", "cpu"], "hello there\n/reset\n");
    assert!(ok, "{err}");
    assert!(err.contains("/reset to start over") && err.contains("conversation cleared (0 messages"), "{err}");
}

/// perplexity in windows with a stride: every token after the first is scored once, with a
/// standard error; windows must fit the model.
#[test]
fn perplexity_scores_in_strided_windows() {
    let dir = std::env::temp_dir().join(format!("lily-pplw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toks = dir.join("tokens.txt");
    std::fs::write(&toks, (0..100).map(|i| ((i * 37) % 500).to_string()).collect::<Vec<_>>().join(" ")).unwrap();
    let m = model("tiny-mlx4");
    let base = ["perplexity", "-m", &m, "--tokens-file", toks.to_str().unwrap(), "--json"];
    let (ok, out, err) = lily(&[&base[..], &["--ctx-size", "32", "--stride", "16"]].concat());
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["scored"], 99);
    assert_eq!(v["windows"], 6, "{v}");
    assert!(v["perplexity_stderr"].as_f64().unwrap() > 0.0 && v["perplexity"].as_f64().unwrap() > 1.0);
    let (ok, out, _) = lily(&base);
    assert!(ok);
    assert_eq!(serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["windows"], 1);
    let (ok, _, err) = lily(&[&base[..], &["--ctx-size", "300000"]].concat());
    assert!(!ok && err.contains("exceeds the model's context"), "{err}");
    let (ok, _, err) = lily(&[&base[..], &["--ctx-size", "32", "--stride", "40"]].concat());
    assert!(!ok && err.contains("--stride"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Ctrl-C (SIGINT) during an answer stops it and keeps the session: the next command still runs.
#[test]
fn ctrl_c_stops_the_answer_not_the_chat() {
    use std::io::{BufRead, BufReader, Write};
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["chat", "-m", "synthetic:tiny", "-n", "30000", "--device", "cpu", "--temp", "1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running lily");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"hello\n").unwrap();
    // Wait until the answer is streaming, then interrupt it.
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = Vec::new();
    out.read_until(b' ', &mut first).unwrap();
    // SAFETY: sends SIGINT to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "stderr ended before the turn's stats");
        if line.contains("tok/s") {
            break;
        }
    }
    assert!(line.contains("stopped (Ctrl-C)"), "{line}");
    stdin.write_all(b"/reset\n/quit\n").unwrap();
    drop(stdin);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert!(child.wait().unwrap().success());
    assert!(rest.contains("conversation cleared (2 messages forgotten)"), "{rest}");
}
