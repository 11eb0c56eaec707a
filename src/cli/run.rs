//! `lily run` (one prompt) and `lily chat` (interactive).

use super::{parse_token_list, ModelArgs};
use anyhow::{bail, Result};
use clap::Args;
use lily::generate::{generate, Flow, GenerateOptions};
use lily::sampling::SamplingParams;
use lily::tokenizer::{StreamDecoder, Tokenizer};
use serde_json::{json, Value};
use std::io::Write;

#[derive(Args, Clone, Debug)]
pub struct SampleArgs {
    /// Maximum tokens to generate.
    #[arg(allow_negative_numbers = true, short = 'n', long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy. Unset sampling flags take the checkpoint's
    /// generation_config.json; without one, greedy.
    #[arg(allow_negative_numbers = true, long, visible_alias = "temp")]
    pub temperature: Option<f32>,
    #[arg(allow_negative_numbers = true, long)]
    pub top_p: Option<f32>,
    /// 0 = off.
    #[arg(allow_negative_numbers = true, long)]
    pub top_k: Option<usize>,
    /// 0 = off.
    #[arg(allow_negative_numbers = true, long)]
    pub min_p: Option<f32>,
    /// The checkpoint's generation_config.json sampling defaults (filled in by `resolve`).
    #[arg(skip)]
    pub defaults: Option<lily::server::Defaults>,
    #[arg(allow_negative_numbers = true, short = 's', long, default_value_t = 0)]
    pub seed: u64,
    /// Context size in tokens, prompt plus generation (default: the model's); generation stops
    /// when it is full.
    #[arg(allow_negative_numbers = true, short = 'c', long)]
    pub ctx_size: Option<usize>,
    /// Disable thinking (renders the template with enable_thinking=false).
    #[arg(long)]
    pub no_think: bool,
}

impl SampleArgs {
    /// Tokens that may be generated after a prompt of `prompt` tokens: `--max-tokens`, within
    /// `--ctx-size` (itself within the model's `limit`).
    fn room(&self, prompt: usize, limit: usize) -> Result<usize> {
        let ctx = match self.ctx_size {
            Some(0) => bail!("--ctx-size must be at least 1"),
            Some(c) if c > limit => bail!("--ctx-size {c} exceeds the model's context of {limit} tokens"),
            Some(c) => c,
            None => limit,
        };
        if prompt >= ctx {
            bail!("the prompt has {prompt} tokens and fills the context of {ctx} (--ctx-size)");
        }
        Ok(self.max_tokens.min(ctx - prompt))
    }

    /// Flags first, then the checkpoint's generation_config.json, then greedy.
    fn params(&self) -> SamplingParams {
        let d = self.defaults.clone().unwrap_or(lily::server::Defaults {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
        });
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            seed: self.seed,
        }
    }

    /// Reads the checkpoint's sampling defaults (after `load`, so a hub id is in the cache) and
    /// says on stderr how the run samples.
    fn resolve(&mut self, loaded: &lily::loader::Loaded) {
        self.defaults = loaded.dir.as_deref().and_then(super::generation_defaults);
        let p = self.params();
        let from = if self.defaults.is_some() { " (unset flags from generation_config.json)" } else { "" };
        if p.temperature == 0.0 {
            eprintln!("lily: sampling: greedy{from}");
        } else {
            eprintln!(
                "lily: sampling: temperature {}, top_k {}, top_p {}, min_p {}, seed {}{from}; --temp 0 for greedy",
                p.temperature, p.top_k, p.top_p, p.min_p, p.seed
            );
        }
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sample: SampleArgs,
    /// The prompt (a user message, rendered with the chat template unless --raw).
    #[arg(short = 'p', long, conflicts_with = "prompt_tokens")]
    pub prompt: Option<String>,
    /// Prompt as token ids, e.g. `1,2,3` (no template).
    #[arg(long)]
    pub prompt_tokens: Option<String>,
    /// Feed the prompt text as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Optional system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Print one JSON object (tokens, text, timings) as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

fn template_kwargs(no_think: bool) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("enable_thinking".into(), Value::Bool(!no_think));
    m
}

pub fn run(mut a: RunArgs) -> Result<()> {
    a.sample.params().validate()?;
    let loaded = a.model.load()?;
    a.sample.resolve(&loaded);
    a.sample.params().validate()?;
    let tok = loaded.tokenizer.as_ref();
    let prompt: Vec<u32> = match (&a.prompt, &a.prompt_tokens) {
        (_, Some(ids)) => parse_token_list(ids)?,
        (Some(text), None) => {
            let tok = loaded.tokenizer("pass --prompt-tokens instead of --prompt")?;
            if a.raw {
                tok.encode(text)?
            } else {
                let mut msgs = Vec::new();
                if let Some(s) = &a.system {
                    msgs.push(json!({"role": "system", "content": s}));
                }
                msgs.push(json!({"role": "user", "content": text}));
                let rendered =
                    tok.apply_chat_template(&Value::Array(msgs), None, true, &template_kwargs(a.sample.no_think))?;
                tok.encode(&rendered)?
            }
        }
        (None, None) => bail!("give --prompt TEXT or --prompt-tokens IDS"),
    };
    let mut session = a.model.session(&loaded);
    let eos_ids = match tok {
        Some(t) => t.eos_ids.clone(),
        None => loaded.model.cfg.eos_token_ids.clone(),
    };
    let max_tokens = a.sample.room(prompt.len(), session.max_positions())?;
    let opts = GenerateOptions { max_tokens, sampling: a.sample.params(), eos_ids, ..Default::default() };
    let mut dec = StreamDecoder::new();
    let mut text = String::new();
    let stdout = std::io::stdout();
    let gen = generate(session.as_mut(), &prompt, &opts, |id| {
        let piece = match tok {
            Some(t) => dec.push(t, id)?,
            None => format!("{id} "),
        };
        text.push_str(&piece);
        let mut out = stdout.lock();
        out.write_all(piece.as_bytes())?;
        out.flush()?;
        Ok(Flow::Continue)
    })?;
    if let Some(t) = tok {
        let rest = dec.flush(t)?;
        print!("{rest}");
        text.push_str(&rest);
    }
    println!();
    let n = gen.tokens.len();
    let decode_tps = if n > 1 { (n - 1) as f64 / gen.decode_secs.max(1e-9) } else { 0.0 };
    eprintln!(
        "[prompt {} tokens, {:.1} tok/s | generated {} tokens, {:.2} tok/s | finish: {:?}]",
        gen.prompt_tokens,
        gen.prompt_tokens as f64 / gen.prefill_secs.max(1e-9),
        n,
        decode_tps,
        gen.finish
    );
    if a.json {
        let obj = json!({
            "tokens": gen.tokens,
            "text": text,
            "prompt_tokens": gen.prompt_tokens,
            "finish_reason": match gen.finish { lily::generate::FinishReason::Eos => "stop", lily::generate::FinishReason::Length => "length", lily::generate::FinishReason::Stopped => "stop" },
            "timings": {
                "prefill_secs": gen.prefill_secs,
                "decode_secs": gen.decode_secs,
                "prefill_tokens_per_s": gen.prompt_tokens as f64 / gen.prefill_secs.max(1e-9),
                "decode_tokens_per_s": decode_tps,
            }
        });
        println!("{obj}");
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Optional system message.
    #[arg(long)]
    pub system: Option<String>,
}

const CHAT_HELP: &str = "commands:
  /help           this list
  /reset          forget the conversation (keeps --system)
  /think on|off   let the model reason before answering, or not
  /quit, /exit    leave (also Ctrl-D, or Ctrl-C twice at the prompt)
Ctrl-C during an answer stops it and keeps the conversation; Up/Down recall earlier lines.";

/// Text on a terminal: dimmed (the reasoning, the stats), else as it is.
struct Style {
    tty: bool,
}

impl Style {
    fn dim(&self, s: &str) -> String {
        if self.tty && !s.is_empty() {
            format!("\x1b[2m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
}

/// Multi-turn chat. Each turn re-renders the conversation; when the cached tokens are a prefix
/// of the new rendering only the new suffix is prefilled, otherwise the session starts over.
pub fn chat(mut a: ChatArgs) -> Result<()> {
    use rustyline::error::ReadlineError;
    use std::io::IsTerminal;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    a.sample.params().validate()?;
    let loaded = a.model.load()?;
    a.sample.resolve(&loaded);
    let tok: &Tokenizer = loaded.tokenizer("chat needs one")?;
    let mut session = a.model.session(&loaded);
    let mut cached: Vec<u32> = Vec::new();
    let mut messages: Vec<Value> = Vec::new();
    if let Some(s) = &a.system {
        messages.push(json!({"role": "system", "content": s}));
    }
    let mut think = !a.sample.no_think;
    let style = Style { tty: std::io::stdout().is_terminal() };
    // Ctrl-C while generating sets the flag (the answer stops at the next token); at the prompt
    // the line editor reads it as a key.
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        if let Err(e) = ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst)) {
            eprintln!("lily chat: Ctrl-C will end the process ({e})");
        }
    }
    let mut rl = rustyline::DefaultEditor::new()?;
    eprintln!(
        "lily chat | {} | context {} tokens | thinking {} | /help for commands",
        a.model.model,
        a.sample.ctx_size.unwrap_or(session.max_positions()),
        if think { "on" } else { "off" }
    );
    let mut interrupted = false;
    loop {
        let line = match rl.readline("> ") {
            Ok(l) => {
                interrupted = false;
                l
            }
            Err(ReadlineError::Interrupted) if !interrupted => {
                interrupted = true;
                eprintln!("(Ctrl-C again, /quit or Ctrl-D to leave)");
                continue;
            }
            Err(ReadlineError::Interrupted | ReadlineError::Eof) => break,
            Err(e) => return Err(e.into()),
        };
        let line = line.trim_end_matches(['\n', '\r']).to_string();
        if !line.trim().is_empty() {
            let _ = rl.add_history_entry(line.as_str());
        }
        let cmd: Vec<&str> = line.split_whitespace().collect();
        match cmd.as_slice() {
            [] => continue,
            ["/quit" | "/exit"] => break,
            ["/help" | "/?"] => {
                eprintln!("{CHAT_HELP}");
                continue;
            }
            ["/reset"] => {
                let n = messages.iter().filter(|m| m["role"] != "system").count();
                messages.retain(|m| m["role"] == "system");
                session = a.model.session(&loaded);
                cached.clear();
                eprintln!("conversation cleared ({n} messages forgotten)");
                continue;
            }
            ["/think", v @ ("on" | "off")] => {
                think = *v == "on";
                eprintln!("thinking {v} from the next message");
                continue;
            }
            [c, ..] if c.starts_with('/') => {
                eprintln!("unknown command {c}; /help lists them");
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": line}));
        let kwargs = template_kwargs(!think);
        let rendered = tok.apply_chat_template(&Value::Array(messages.clone()), None, true, &kwargs);
        let (rendered, full) = match rendered.and_then(|r| tok.encode(&r).map(|ids| (r, ids))) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("lily chat: {e:#}");
                messages.pop();
                continue;
            }
        };
        let suffix: Vec<u32> = if !cached.is_empty() && full.len() > cached.len() && full.starts_with(&cached) {
            full[cached.len()..].to_vec()
        } else {
            session = a.model.session(&loaded);
            full.clone()
        };
        let max_tokens = match a.sample.room(full.len(), session.max_positions()) {
            Ok(n) => n,
            Err(e) => {
                // The conversation no longer fits: say so and keep the session (/reset).
                eprintln!("lily chat: {e:#}; type /reset to start over");
                messages.pop();
                continue;
            }
        };
        let opts = GenerateOptions {
            max_tokens,
            sampling: SamplingParams { seed: a.sample.seed.wrapping_add(messages.len() as u64), ..a.sample.params() },
            eos_ids: tok.eos_ids.clone(),
            ..Default::default()
        };
        let mut dec = StreamDecoder::new();
        // The rendered prompt ends inside `<think>` when thinking is on.
        let mut in_think = rendered.trim_end().ends_with("<think>");
        let (mut reasoning, mut answer) = (String::new(), String::new());
        stop.store(false, Ordering::SeqCst);
        let mut show = |piece: &str, in_think: &mut bool| -> std::io::Result<()> {
            let mut out = std::io::stdout().lock();
            let mut rest = piece;
            while !rest.is_empty() {
                let tag = if *in_think { "</think>" } else { "<think>" };
                let (text, after) = match rest.find(tag) {
                    Some(i) => (&rest[..i], Some(&rest[i + tag.len()..])),
                    None => (rest, None),
                };
                if *in_think {
                    reasoning.push_str(text);
                    write!(out, "{}", style.dim(text))?;
                } else {
                    answer.push_str(text);
                    write!(out, "{text}")?;
                }
                match after {
                    Some(r) => {
                        *in_think = !*in_think;
                        rest = r;
                    }
                    None => break,
                }
            }
            out.flush()
        };
        let gen = generate(session.as_mut(), &suffix, &opts, |id| {
            let piece = dec.push(tok, id)?;
            show(&piece, &mut in_think)?;
            Ok(if stop.load(Ordering::SeqCst) { Flow::Stop } else { Flow::Continue })
        });
        let gen = match gen {
            Ok(g) => g,
            Err(e) => {
                // A failed turn leaves the conversation as it was before it.
                eprintln!("\nlily chat: {e:#}");
                messages.pop();
                session = a.model.session(&loaded);
                cached.clear();
                continue;
            }
        };
        let rest = dec.flush(tok)?;
        show(&rest, &mut in_think)?;
        println!();
        let stopped = stop.swap(false, Ordering::SeqCst);
        let n = gen.tokens.len();
        let tps = if n > 1 { (n - 1) as f64 / gen.decode_secs.max(1e-9) } else { 0.0 };
        eprintln!(
            "{}",
            Style { tty: std::io::stderr().is_terminal() }.dim(&format!(
                "[{}{n} tokens, {tps:.1} tok/s | prompt {} new tokens in {:.2} s | context {}/{}]",
                if stopped { "stopped (Ctrl-C) after " } else { "" },
                gen.prompt_tokens,
                gen.prefill_secs,
                full.len() + n,
                a.sample.ctx_size.unwrap_or(session.max_positions())
            ))
        );
        // The cache now holds the prompt and every generated token except a final EOS.
        cached = full;
        cached.extend(&gen.tokens);
        if let Some(eos) = gen.eos_token {
            // Feed the end-of-turn token so the next turn can continue from this state.
            session.forward_last(&[eos])?;
            cached.push(eos);
        }
        let mut msg = json!({"role": "assistant", "content": answer.trim_start()});
        if !reasoning.trim().is_empty() {
            msg["reasoning_content"] = json!(reasoning.trim());
        }
        messages.push(msg);
    }
    Ok(())
}
