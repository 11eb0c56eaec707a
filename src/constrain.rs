//! Constrained decoding through llguidance: the answer is forced to follow a grammar, token by
//! token, by masking the logits of every token that could not continue it.
//!
//! - [`Grammars`] holds llguidance's view of the tokenizer (built once per tokenizer: a token
//!   trie over the vocabulary) and compiles grammars into matchers.
//! - [`json_grammar`] is one JSON value under a schema (`response_format`).
//! - [`tool_grammar`] is one or more tool calls in the chat template's own format (XML
//!   `<function=…>` blocks for Qwen3.5/3.6, or JSON inside `<tool_call>`), each parameter value
//!   valid under its schema (`tool_choice` required or named).
//! - [`Constraint`] is one request's matcher plus where it starts: with thinking on it waits for
//!   the end of the reasoning block (`</think>`), as vLLM and SGLang do.
//!
//! The generation loop (`generate::decode_with`) computes the next mask on a second thread while
//! the backend runs the forward pass, so a constraint costs the mask time only where it is longer
//! than the step; requests without one take the unchanged path.

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, SimpleVob};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::fmt::Write;

/// How the chat template asks the model to write a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`
    Xml,
    /// `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`
    Json,
}

impl ToolFormat {
    /// The format a chat template describes (the real Qwen3.5/3.6 template says `<function=`).
    pub fn of_template(template: &str) -> ToolFormat {
        if template.contains("<function=") {
            ToolFormat::Xml
        } else {
            ToolFormat::Json
        }
    }
}

/// llguidance's tokenizer environment and parser factory for one tokenizer.
pub struct Grammars {
    factory: ParserFactory,
    /// Tags that are single tokens of this vocabulary (written as special tokens in grammars).
    special: Vec<String>,
}

impl Grammars {
    /// `tokenizer_json`: the bytes of `tokenizer.json`; `n_vocab`: the model's logit count
    /// (may exceed the tokenizer's); `eos_ids`: the tokens that end an answer.
    pub fn new(tokenizer_json: &[u8], n_vocab: usize, eos_ids: &[u32]) -> Result<Grammars> {
        let mut bt = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(tokenizer_json)
            .map_err(|e| anyhow!("constrained decoding: reading the tokenizer: {e}"))?;
        if !eos_ids.is_empty() {
            bt.set_eos_tokens(eos_ids);
        }
        let specials: Vec<String> = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
            .iter()
            .filter(|t| bt.hf_tokenizer.token_to_id(t).is_some())
            .map(|t| t.to_string())
            .collect();
        let env = bt.into_tok_env(Some(n_vocab)).map_err(|e| anyhow!("constrained decoding: {e}"))?;
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| anyhow!("constrained decoding: {e}"))?;
        factory.quiet();
        Ok(Grammars { factory, special: specials })
    }

    /// Compiles a Lark grammar (llguidance's dialect) into a matcher; the error names what the
    /// grammar (or a schema inside it) cannot express.
    pub fn matcher(&self, lark: &str) -> Result<Matcher> {
        let parser = self.factory.create_parser(TopLevelGrammar::from_lark(lark.to_string()))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            bail!("{e}");
        }
        Ok(m)
    }

    /// A tag as a grammar element: the special token where the vocabulary has one, else text.
    fn tag(&self, t: &str) -> String {
        if self.special.iter().any(|s| s == t) {
            t.to_string()
        } else {
            lit(t)
        }
    }
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The JSON options lily fixes: compact with the usual spaces after `,` and `:` and no other
/// whitespace, so a weak model cannot wander off into blank lines inside a value.
fn with_layout(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance")
            .or_insert(json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
    }
    s
}

/// `%json {schema}` as a grammar element.
fn json_elem(schema: &Value) -> String {
    format!("%json {}", with_layout(schema))
}

/// One JSON value under `schema`, after up to two newlines (what follows `</think>`).
pub fn json_grammar(schema: &Value) -> String {
    format!("start: NL? body\nNL: /\\n{{1,2}}/\nbody: {}\n", json_elem(schema))
}

/// The schema's declared type names.
fn types(s: &Value) -> Vec<&str> {
    match s.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

/// Tool calls under `tools` (an OpenAI `tools` array), in `format`. `only`: the one function
/// allowed; `parallel`: one or more calls, else exactly one.
pub fn tool_grammar(
    g: &Grammars,
    tools: &Value,
    only: Option<&str>,
    parallel: bool,
    format: ToolFormat,
) -> Result<String> {
    let funcs: Vec<&Value> = tools
        .as_array()
        .context("`tools` is not an array")?
        .iter()
        .map(|t| &t["function"])
        .filter(|f| only.is_none_or(|n| f["name"].as_str() == Some(n)))
        .collect();
    if funcs.is_empty() {
        bail!("no tool matches the tool_choice");
    }
    let (open, close) = (g.tag("<tool_call>"), g.tag("</tool_call>"));
    let mut out = String::new();
    writeln!(out, "start: NL? calls\nNL: /\\n{{1,2}}/")?;
    if parallel {
        writeln!(out, "calls: call (\"\\n\" call)*")?;
    } else {
        writeln!(out, "calls: call")?;
    }
    let names: Vec<String> = (0..funcs.len()).map(|i| format!("f{i}")).collect();
    writeln!(out, "call: {open} \"\\n\" fn \"\\n\" {close}")?;
    writeln!(out, "fn: {}", names.join(" | "))?;
    for (i, f) in funcs.iter().enumerate() {
        let name = f["name"].as_str().context("a tool without a name")?;
        let params = f.get("parameters").cloned().unwrap_or(json!({"type": "object", "properties": {}}));
        match format {
            ToolFormat::Json => {
                // Only the declared parameters, as in the XML format.
                let mut params = params;
                if let Some(o) = params.as_object_mut().filter(|o| o.contains_key("properties")) {
                    o.entry("additionalProperties").or_insert(Value::Bool(false));
                }
                let call = json!({"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"], "additionalProperties": false});
                writeln!(out, "f{i}: {}", json_elem(&call))?;
            }
            ToolFormat::Xml => xml_function(&mut out, i, name, &params)?,
        }
    }
    Ok(out)
}

/// `<function=NAME>\n` then each declared parameter in schema order (required ones always,
/// the others optionally) then `</function>`.
fn xml_function(out: &mut String, i: usize, name: &str, params: &Value) -> Result<()> {
    let empty = serde_json::Map::new();
    let props = params.get("properties").and_then(Value::as_object).unwrap_or(&empty);
    let required: Vec<&str> =
        params.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
        bail!("tool `{name}`: required parameter `{r}` is not in `properties`");
    }
    let mut seq = Vec::new();
    for (j, (p, schema)) in props.iter().enumerate() {
        if p.is_empty() || p.contains(['>', '<', '\n']) {
            bail!("tool `{name}`: parameter name {p:?} cannot be written as <parameter=...>");
        }
        let rule = format!("f{i}_p{j}");
        let open = lit(&format!("<parameter={p}>\n"));
        let enum_members = schema
            .get("enum")
            .and_then(Value::as_array)
            .cloned()
            .or_else(|| schema.get("const").map(|c| vec![c.clone()]));
        let ts = types(schema);
        if let Some(members) = enum_members {
            let alts: Vec<String> = members.iter().map(|m| lit(&crate::server::toolcall::raw_text(m))).collect();
            writeln!(out, "{rule}: {open} ({}) \"\\n</parameter>\\n\"", alts.join(" | "))?;
        } else if ts.contains(&"string") {
            // Any text of minLength..maxLength characters holding no `</parameter>`, then the
            // close: one lexeme, so the parser's "first `</parameter>` before the next tag" reads
            // back exactly this value. `pattern` and `format` are not enforced.
            let len = |k: &str| schema.get(k).and_then(Value::as_u64).filter(|&n| n <= MAX_BOUNDED_LEN);
            let reps = match (len("minLength"), len("maxLength")) {
                (None, None) => "*".to_string(),
                (lo, hi) => format!("{{{},{}}}", lo.unwrap_or(0), hi.map(|h| h.to_string()).unwrap_or_default()),
            };
            let term = format!("F{i}_P{j}");
            writeln!(out, "{rule}: {open} {term}")?;
            writeln!(
                out,
                "{term}: /(.|\\n){reps}\\n<\\/parameter>\\n/ & ~/(.|\\n)*<\\/parameter>(.|\\n)*<\\/parameter>(.|\\n)*/"
            )?;
        } else {
            // Numbers, booleans, null, objects and arrays read the same raw as in JSON.
            writeln!(out, "{rule}: {open} {} \"\\n</parameter>\\n\"", json_elem(schema))?;
        }
        seq.push(if required.contains(&p.as_str()) { rule } else { format!("{rule}?") });
    }
    writeln!(out, "f{i}: {} {} \"</function>\"", lit(&format!("<function={name}>\n")), seq.join(" "))?;
    Ok(())
}

/// String length bounds above this are left unbounded (a long counted repetition is a large
/// automaton).
const MAX_BOUNDED_LEN: u64 = 4096;

/// One request's constraint.
pub struct Constraint {
    matcher: Matcher,
    /// Applied from the next token on; false while a reasoning block is still open.
    active: bool,
    /// The token sequence that closes the reasoning block.
    think_end: Vec<u32>,
    recent: Vec<u32>,
}

impl Constraint {
    /// `active`: applies from the first generated token; else from the token after `think_end`.
    pub fn new(matcher: Matcher, active: bool, think_end: Vec<u32>) -> Constraint {
        Constraint { matcher, active, think_end, recent: Vec::new() }
    }

    pub fn is_active(&self) -> bool {
        self.active
    }

    /// The tokens allowed next (only while active).
    pub fn mask(&mut self) -> Result<SimpleVob> {
        self.matcher.compute_mask().map_err(|e| anyhow!("constrained decoding: {e}"))
    }

    /// Masks `logits` to the allowed tokens; an error if none is allowed.
    pub fn apply(mask: &SimpleVob, logits: &mut [f32]) -> Result<()> {
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            if i < mask.len() && mask.is_allowed(i as u32) {
                any |= l.is_finite() || *l == f32::INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            bail!("constrained decoding: the grammar allows no token here");
        }
        Ok(())
    }

    /// Records a generated token: advances the matcher, or watches for the end of reasoning.
    pub fn observe(&mut self, token: u32) -> Result<()> {
        if self.active {
            return self.matcher.consume_token(token).map_err(|e| anyhow!("constrained decoding: {e}"));
        }
        self.recent.push(token);
        if self.think_end.is_empty() || self.recent.ends_with(&self.think_end) {
            self.active = true;
            self.recent.clear();
        } else if self.recent.len() > self.think_end.len() {
            self.recent.remove(0);
        }
        Ok(())
    }

    /// The grammar is complete and allows nothing more: the answer ends here.
    pub fn finished(&self) -> bool {
        self.active && self.matcher.is_stopped()
    }
}
