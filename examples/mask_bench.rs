//! Times llguidance's per-token mask on the real Qwen3.6 vocabulary (248,320 logits): the CPU
//! work a constrained request adds to each decode step, which `generate::decode_with` overlaps
//! with the forward pass. Tokens are drawn at random from the mask (the costliest walk: every
//! branch of the grammar gets visited).
//!
//! `cargo run --release --example mask_bench` (TOKENIZER=path/to/tokenizer.json instead of the
//! built-in one, N=steps per grammar)

use lily::constrain::{json_grammar, tool_grammar, Constraint, Grammars, ToolFormat};
use lily::sampling::Rng;
use serde_json::json;
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let n: usize = std::env::var("N").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let bytes = match std::env::var("TOKENIZER") {
        Ok(path) => std::fs::read(path)?,
        Err(_) => lily::tokenizer::builtin_json()?,
    };
    let tok = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| anyhow::anyhow!("{e}"))?;
    let eos = vec![tok.token_to_id("<|im_end|>").unwrap_or(0)];
    let t0 = Instant::now();
    let g = Grammars::new(&bytes, 248_320, &eos)?;
    println!("tokenizer view built in {:.0} ms", t0.elapsed().as_secs_f64() * 1e3);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}, "opts": {"type": "object"}}, "required": ["city"]}}}]);
    let cases = [
        ("json_object", json_grammar(&json!({"type": "object"}))),
        (
            "json_schema",
            json_grammar(&json!({"type": "object", "properties": {"name": {"type": "string"},
            "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "n", "tags"]})),
        ),
        ("tool call (XML)", tool_grammar(&g, &tools, None, true, ToolFormat::Xml)?),
    ];
    println!("| grammar | compile ms | masks | median ms | p90 ms | max ms |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, lark) in cases {
        let t0 = Instant::now();
        let mut c = Constraint::new(g.matcher(&lark)?, true, Vec::new());
        let compile = t0.elapsed().as_secs_f64() * 1e3;
        let mut rng = Rng::new(7);
        let mut times = Vec::new();
        while times.len() < n {
            if c.finished() {
                // A complete answer: start another one (e.g. `{}` ends a json_object at once).
                c = Constraint::new(g.matcher(&lark)?, true, Vec::new());
            }
            let t = Instant::now();
            let mask = c.mask()?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            let allowed: Vec<u32> =
                (0..mask.len() as u32).filter(|&i| mask.is_allowed(i) && !eos.contains(&i)).collect();
            if allowed.is_empty() {
                c = Constraint::new(g.matcher(&lark)?, true, Vec::new());
                continue;
            }
            c.observe(allowed[(rng.next_u64() % allowed.len() as u64) as usize])?;
        }
        times.sort_by(f64::total_cmp);
        let q = |p: f64| times[((times.len() - 1) as f64 * p) as usize];
        println!("| {name} | {compile:.1} | {} | {:.3} | {:.3} | {:.3} |", times.len(), q(0.5), q(0.9), q(1.0));
    }
    Ok(())
}
