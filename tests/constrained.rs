//! Constrained decoding (llguidance) on the real Qwen3.6 vocabulary: a "model" whose logits are
//! random draws (the worst case: it knows nothing about JSON or XML) must still produce text that
//! parses and is valid under the schema, for every seed, because the mask is exact. Checked
//! with a JSON-schema validator written here for the keywords these schemas use, and with the
//! server's own tool-call parser reading the XML back.
//!
//! Uses the Qwen3.6 tokenizer built into lily (assets/).

use lily::constrain::{json_grammar, tool_grammar, Constraint, Grammars, ToolFormat};
use lily::generate::{decode_with, Flow, GenerateOptions, Session, Snapshot};
use lily::sampling::{Rng, SamplingParams};
use lily::server::parse::{parse_all, Piece};
use lily::server::toolcall::ToolSchemas;
use serde_json::{json, Value};
use std::sync::OnceLock;

const VOCAB: usize = 248_320;

struct World {
    tok: tokenizers::Tokenizer,
    grammars: Grammars,
    eos: Vec<u32>,
    think_end: u32,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let json = lily::tokenizer::builtin_json().unwrap();
        let tok = tokenizers::Tokenizer::from_bytes(&json).unwrap();
        let eos = vec![tok.token_to_id("<|im_end|>").unwrap(), tok.token_to_id("<|endoftext|>").unwrap()];
        let think_end = tok.token_to_id("</think>").unwrap();
        let grammars = Grammars::new(&json, VOCAB, &eos).unwrap();
        World { tok, grammars, eos, think_end }
    })
}

/// Random logits (N(0, 3) per token), reproducible from the seed; EOS and `</think>` are never
/// favoured unless `think_at` says at which step `</think>` wins outright.
struct RandomModel {
    rng: Rng,
    pos: usize,
    steps: usize,
    think_at: Option<usize>,
}

impl RandomModel {
    fn logits(&mut self) -> Vec<f32> {
        let mut l: Vec<f32> = (0..VOCAB)
            .map(|_| {
                // Box-Muller from two uniforms.
                let (u, v) = (self.rng.next_f64().max(1e-12), self.rng.next_f64());
                (3.0 * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect();
        let w = world();
        if let Some(k) = self.think_at {
            for &e in &w.eos {
                l[e as usize] = -50.0;
            }
            l[w.think_end as usize] = if self.steps == k { 100.0 } else { -50.0 };
        }
        self.steps += 1;
        l
    }
}

impl Session for RandomModel {
    fn forward_last(&mut self, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.pos += tokens.len();
        Ok(self.logits())
    }
    fn forward_all(&mut self, tokens: &[u32]) -> anyhow::Result<Vec<f32>> {
        self.forward_last(tokens)
    }
    fn pos(&self) -> usize {
        self.pos
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn max_positions(&self) -> usize {
        1 << 20
    }
    fn snapshot(&self) -> Snapshot {
        Snapshot { pos: self.pos, nbytes: 0, data: Box::new(()) }
    }
    fn restore(&mut self, _: &Snapshot) -> anyhow::Result<()> {
        Ok(())
    }
    fn reset(&mut self) {
        self.pos = 0;
    }
}

/// Generates under `lark` with random logits; returns the text and whether it ended by itself.
fn run(lark: &str, seed: u64, think_at: Option<usize>, temperature: f32) -> (String, bool) {
    let w = world();
    let matcher = w.grammars.matcher(lark).unwrap_or_else(|e| panic!("grammar does not compile: {e:#}\n{lark}"));
    let mut c = Constraint::new(matcher, think_at.is_none(), vec![w.think_end]);
    let mut m = RandomModel { rng: Rng::new(seed), pos: 0, steps: 0, think_at };
    let logits = m.forward_last(&[1]).unwrap();
    let opts = GenerateOptions {
        max_tokens: 600,
        sampling: SamplingParams { temperature, seed, ..Default::default() },
        eos_ids: w.eos.clone(),
        ..Default::default()
    };
    let g = decode_with(&mut m, logits, &opts, Some(&mut c), |_| Ok(Flow::Continue)).unwrap();
    let text = w.tok.decode(&g.tokens, false).unwrap();
    (text, g.finish == lily::generate::FinishReason::Eos)
}

fn type_ok(v: &Value, t: &str) -> bool {
    match t {
        "string" => v.is_string(),
        // JSON Schema: any number with a zero fractional part (`-0`, `2.0`).
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        _ => panic!("validator: unknown type {t}"),
    }
}

/// JSON-schema validation for the keywords the schemas below use.
fn validate(v: &Value, s: &Value, at: &str) -> Result<(), String> {
    let err = |m: String| Err(format!("{at}: {m} (value {v})"));
    match s.get("type") {
        Some(Value::String(t)) if !type_ok(v, t) => return err(format!("not of type {t}")),
        Some(Value::Array(ts)) if !ts.iter().any(|t| type_ok(v, t.as_str().unwrap())) => return err("no type".into()),
        _ => {}
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return err("not in enum".into());
        }
    }
    if let Some(c) = s.get("const") {
        if c != v {
            return err("not the const".into());
        }
    }
    if let Some(any) = s.get("anyOf").and_then(Value::as_array) {
        if !any.iter().any(|b| validate(v, b, at).is_ok()) {
            return err("no anyOf branch".into());
        }
    }
    if let Some(x) = v.as_str() {
        let n = x.chars().count() as u64;
        if s.get("minLength").and_then(Value::as_u64).is_some_and(|m| n < m) {
            return err("too short".into());
        }
        if s.get("maxLength").and_then(Value::as_u64).is_some_and(|m| n > m) {
            return err("too long".into());
        }
    }
    if let Some(x) = v.as_f64() {
        if s.get("minimum").and_then(Value::as_f64).is_some_and(|m| x < m) {
            return err("below minimum".into());
        }
        if s.get("maximum").and_then(Value::as_f64).is_some_and(|m| x > m) {
            return err("above maximum".into());
        }
    }
    if let Some(o) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for r in s.get("required").and_then(Value::as_array).into_iter().flatten() {
            if !o.contains_key(r.as_str().unwrap()) {
                return err(format!("missing required {r}"));
            }
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(ps) => validate(x, ps, &format!("{at}.{k}"))?,
                None if s.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return err(format!("extra property {k}"))
                }
                None => {}
            }
        }
    }
    if let Some(a) = v.as_array() {
        if s.get("minItems").and_then(Value::as_u64).is_some_and(|m| (a.len() as u64) < m) {
            return err("too few items".into());
        }
        if s.get("maxItems").and_then(Value::as_u64).is_some_and(|m| (a.len() as u64) > m) {
            return err("too many items".into());
        }
        if let Some(is) = s.get("items") {
            for (i, x) in a.iter().enumerate() {
                validate(x, is, &format!("{at}[{i}]"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn validator_rejects_what_it_should() {
    let s = json!({"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}, "required": ["a"], "additionalProperties": false});
    assert!(validate(&json!({"a": 2}), &s, "$").is_ok());
    for bad in [json!({"a": 4}), json!({}), json!({"a": 1, "b": 1}), json!({"a": "1"}), json!([1])] {
        assert!(validate(&bad, &s, "$").is_err(), "{bad}");
    }
}

fn json_schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "kind": {"enum": ["cat", "dog", "fish"]}},
            "required": ["name", "age", "kind"], "additionalProperties": false}),
        json!({"type": "object", "properties": {
            "outer": {"type": "object", "properties": {
                "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": ["number", "null"]}},
                    "required": ["ok", "n"], "additionalProperties": false},
                "list": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4}},
                "required": ["inner", "list"], "additionalProperties": false}},
            "required": ["outer"], "additionalProperties": false}),
        json!({"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}]},
            "minItems": 2, "maxItems": 5}),
        json!({"type": "object", "properties": {"mode": {"const": "fast"}, "level": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["mode", "level"], "additionalProperties": false}),
    ]
}

#[test]
fn json_schema_output_is_valid_for_every_seed() {
    for (k, schema) in json_schemas().iter().enumerate() {
        let lark = json_grammar(schema);
        for seed in 0..6u64 {
            let temperature = if seed % 3 == 2 { 0.0 } else { 1.0 };
            let (text, ended) = run(&lark, 1000 * k as u64 + seed, None, temperature);
            assert!(ended, "schema {k} seed {seed}: did not finish: {text:?}");
            let v: Value = serde_json::from_str(text.trim_start_matches('\n'))
                .unwrap_or_else(|e| panic!("schema {k} seed {seed}: {e}: {text:?}"));
            validate(&v, schema, "$").unwrap_or_else(|e| panic!("schema {k} seed {seed}: {e}: {text:?}"));
        }
    }
}

#[test]
fn json_applies_after_the_reasoning_block() {
    let schema = &json_schemas()[3];
    let lark = json_grammar(schema);
    for seed in 0..4u64 {
        let (text, ended) = run(&lark, 77 + seed, Some(5), 1.0);
        assert!(ended, "{text:?}");
        let (reasoning, answer) = text.split_once("</think>").unwrap_or_else(|| panic!("no </think>: {text:?}"));
        assert!(!reasoning.is_empty());
        let v: Value =
            serde_json::from_str(answer.trim_start_matches('\n')).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        validate(&v, schema, "$").unwrap();
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 10},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "book.trip", "parameters": {"type": "object", "properties": {
            "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31}, "flex": {"type": "boolean"}},
                "required": ["day", "flex"], "additionalProperties": false},
            "people": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 2},
            "note": {"type": ["string", "null"], "maxLength": 8}},
            "required": ["when", "people", "note"]}}},
        {"type": "function", "function": {"name": "ping"}}
    ])
}

fn check_calls(text: &str, only: Option<&str>, parallel: bool) {
    let t = tools();
    let schemas = ToolSchemas::from_tools(&t);
    let pieces = parse_all(text, false, Some(schemas));
    let calls: Vec<_> = pieces
        .iter()
        .filter_map(|p| match p {
            Piece::ToolCall(c) => Some(c),
            _ => None,
        })
        .collect();
    let rest: Vec<_> = pieces.iter().filter(|p| !matches!(p, Piece::ToolCall(_))).collect();
    assert!(rest.is_empty(), "text outside the calls: {rest:?} in {text:?}");
    assert!(!calls.is_empty() && (parallel || calls.len() == 1), "{} calls in {text:?}", calls.len());
    for c in calls {
        if let Some(n) = only {
            assert_eq!(c.name, n);
        }
        let f = t.as_array().unwrap().iter().find(|x| x["function"]["name"] == c.name.as_str()).expect("a known tool");
        let args: Value = serde_json::from_str(&c.arguments()).unwrap();
        let schema = f["function"].get("parameters").cloned().unwrap_or(json!({"type": "object"}));
        validate(&args, &schema, &c.name).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    }
}

#[test]
fn forced_tool_calls_parse_and_follow_their_schemas() {
    let w = world();
    for (only, parallel) in [(None, true), (None, false), (Some("book.trip"), false), (Some("get_weather"), false)] {
        let lark = tool_grammar(&w.grammars, &tools(), only, parallel, ToolFormat::Xml).unwrap();
        for seed in 0..5u64 {
            let (text, ended) = run(&lark, 31 * seed + 7, None, 1.0);
            assert!(ended, "{only:?} seed {seed}: did not finish: {text:?}");
            check_calls(&text, only, parallel);
        }
    }
}

#[test]
fn forced_tool_calls_in_the_json_format() {
    let w = world();
    let lark = tool_grammar(&w.grammars, &tools(), Some("get_weather"), false, ToolFormat::Json).unwrap();
    for seed in 0..4u64 {
        let (text, ended) = run(&lark, 500 + seed, None, 1.0);
        assert!(ended, "{text:?}");
        check_calls(&text, Some("get_weather"), false);
    }
}

#[test]
fn bad_grammars_are_errors_not_panics() {
    let w = world();
    let e = w.grammars.matcher(&json_grammar(&json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})));
    assert!(e.is_err());
    let t = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}, "required": ["x"]}}}]);
    let e = tool_grammar(&w.grammars, &t, None, false, ToolFormat::Xml).unwrap_err();
    assert!(format!("{e}").contains("`x`"), "{e}");
}
