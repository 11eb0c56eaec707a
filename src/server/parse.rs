//! Splits generated chat text into reasoning (`<think>…</think>`), content and tool calls
//! (`<tool_call>…</tool_call>` blocks, XML or JSON inside: `toolcall.rs`), one text piece at a
//! time, so streaming and non-streaming answers come from the same state machine. Text that may
//! be the start of a tag is held back until it is decided; a tool-call block that does not parse
//! (or never closes) falls back to plain content, tags and the whitespace before it included, so
//! nothing the model wrote is lost.

pub use super::toolcall::ToolCall;
use super::toolcall::{parse_body, ToolSchemas};
use crate::generate::partial_suffix_len;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";

#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Reasoning,
    Content,
    Tool,
}

pub struct OutputParser {
    mode: Mode,
    buf: String,
    /// Some: recognise tool calls, with these parameter schemas for their values.
    tools: Option<ToolSchemas>,
    /// Whitespace between content and an open tool-call block: dropped if the block parses,
    /// given back as content if it does not.
    gap: String,
    /// Nothing has been emitted as content yet (a leading `<think>` still opens reasoning).
    at_start: bool,
    /// Drop newlines at the start of the next content (after `</think>` or a tool call).
    trim_lead: bool,
    pub tool_calls: usize,
}

/// Whether a rendered prompt ends inside an open `<think>` block (the Qwen template adds
/// `<think>\n` to the generation prompt when thinking is enabled).
pub fn prompt_opens_think(prompt: &str) -> bool {
    match (prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)) {
        (Some(o), Some(c)) => o > c,
        (Some(_), None) => true,
        _ => false,
    }
}

impl OutputParser {
    /// `in_think`: the prompt left a `<think>` block open; `tools`: recognise tool calls.
    pub fn new(in_think: bool, tools: Option<ToolSchemas>) -> OutputParser {
        OutputParser {
            mode: if in_think { Mode::Reasoning } else { Mode::Content },
            buf: String::new(),
            tools,
            gap: String::new(),
            at_start: !in_think,
            trim_lead: false,
            tool_calls: 0,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(&mut out, false);
        out
    }

    /// End of generation: everything still held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        out
    }

    fn emit(out: &mut Vec<Piece>, p: Piece) {
        let empty = match &p {
            Piece::Reasoning(s) | Piece::Content(s) => s.is_empty(),
            Piece::ToolCall(_) => false,
        };
        if !empty {
            out.push(p);
        }
    }

    fn drain(&mut self, out: &mut Vec<Piece>, last: bool) {
        loop {
            match self.mode {
                Mode::Reasoning => {
                    if let Some(i) = self.buf.find(THINK_CLOSE) {
                        Self::emit(out, Piece::Reasoning(self.buf[..i].to_string()));
                        self.buf.drain(..i + THINK_CLOSE.len());
                        self.mode = Mode::Content;
                        self.trim_lead = true;
                        continue;
                    }
                    let keep = if last { 0 } else { partial_suffix_len(&self.buf, &[THINK_CLOSE]) };
                    let n = self.buf.len() - keep;
                    Self::emit(out, Piece::Reasoning(self.buf.drain(..n).collect()));
                    return;
                }
                Mode::Content => {
                    if self.trim_lead {
                        let t = self.buf.trim_start_matches(['\n', '\r']).len();
                        self.buf.drain(..self.buf.len() - t);
                        if self.buf.is_empty() && !last {
                            return;
                        }
                        self.trim_lead = false;
                    }
                    if self.at_start {
                        if self.buf.starts_with(THINK_OPEN) {
                            self.buf.drain(..THINK_OPEN.len());
                            self.mode = Mode::Reasoning;
                            self.at_start = false;
                            continue;
                        }
                        if !last && THINK_OPEN.starts_with(self.buf.as_str()) {
                            return; // may still become `<think>`
                        }
                        self.at_start = false;
                    }
                    if self.tools.is_some() {
                        if let Some(i) = self.buf.find(TOOL_OPEN) {
                            // Whitespace between content and a tool call is not content.
                            let before = self.buf[..i].trim_end();
                            self.gap = self.buf[before.len()..i].to_string();
                            Self::emit(out, Piece::Content(before.to_string()));
                            self.buf.drain(..i + TOOL_OPEN.len());
                            self.mode = Mode::Tool;
                            continue;
                        }
                    }
                    let keep = if last {
                        0
                    } else if self.tools.is_some() {
                        // Hold back a partial tag and trailing whitespace (it may precede a tool call).
                        let tag = partial_suffix_len(&self.buf, &[TOOL_OPEN]);
                        let ws = self.buf.len() - self.buf.trim_end().len();
                        let keep = tag.max(ws);
                        // Trailing whitespace then a partial tag: hold both.
                        let head = &self.buf[..self.buf.len() - tag];
                        keep.max(tag + (head.len() - head.trim_end().len()))
                    } else {
                        0
                    };
                    let n = self.buf.len() - keep;
                    let text: String = self.buf.drain(..n).collect();
                    if last && self.tool_calls > 0 && text.trim().is_empty() {
                        return;
                    }
                    Self::emit(out, Piece::Content(text));
                    return;
                }
                Mode::Tool => {
                    if let Some(i) = self.buf.find(TOOL_CLOSE) {
                        let body = self.buf[..i].to_string();
                        self.buf.drain(..i + TOOL_CLOSE.len());
                        let gap = std::mem::take(&mut self.gap);
                        match parse_body(&body, self.tools.as_ref().unwrap_or(&ToolSchemas::default())) {
                            Some(tc) => {
                                self.tool_calls += 1;
                                out.push(Piece::ToolCall(tc));
                            }
                            None => out.push(Piece::Content(format!("{gap}{TOOL_OPEN}{body}{TOOL_CLOSE}"))),
                        }
                        self.mode = Mode::Content;
                        self.trim_lead = true;
                        continue;
                    }
                    if last {
                        let body = std::mem::take(&mut self.buf);
                        let gap = std::mem::take(&mut self.gap);
                        out.push(Piece::Content(format!("{gap}{TOOL_OPEN}{body}")));
                    }
                    return;
                }
            }
        }
    }
}

/// Parses a whole text at once (what a non-streaming answer does), merging adjacent pieces.
pub fn parse_all(text: &str, in_think: bool, tools: Option<ToolSchemas>) -> Vec<Piece> {
    let mut p = OutputParser::new(in_think, tools);
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    merge(pieces)
}

/// Joins consecutive reasoning or content pieces.
pub fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::new();
    for p in pieces {
        match (out.last_mut(), p) {
            (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
            (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(text: &str, in_think: bool, tools: bool, step: usize) -> Vec<Piece> {
        let mut p = OutputParser::new(in_think, tools.then(ToolSchemas::default));
        let mut pieces = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(step) {
            pieces.extend(p.push(&chunk.iter().collect::<String>()));
        }
        pieces.extend(p.finish());
        merge(pieces)
    }

    fn check(text: &str, in_think: bool, tools: bool, want: Vec<Piece>) {
        for step in [1, 2, 3, 5, 1000] {
            assert_eq!(streamed(text, in_think, tools, step), want, "step {step}");
        }
        assert_eq!(parse_all(text, in_think, tools.then(ToolSchemas::default)), want, "parse_all");
    }

    fn r(s: &str) -> Piece {
        Piece::Reasoning(s.into())
    }
    fn c(s: &str) -> Piece {
        Piece::Content(s.into())
    }
    fn tc(name: &str, args: &str) -> Piece {
        let v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(args).unwrap();
        Piece::ToolCall(ToolCall { name: name.into(), args: v.into_iter().collect() })
    }

    #[test]
    fn thinking_split_when_prompt_opens_think() {
        check("let me think\n</think>\n\nThe answer.", true, false, vec![r("let me think\n"), c("The answer.")]);
        check("still thinking", true, false, vec![r("still thinking")]);
        check("<think>x</think>y", false, false, vec![r("x"), c("y")]);
        check("no think < tags", false, false, vec![c("no think < tags")]);
    }

    #[test]
    fn tool_calls_become_structured() {
        let text = "ok\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        check(
            text,
            true,
            true,
            vec![r("ok\n"), c("Let me check."), tc("get_weather", r#"{"city":"Paris"}"#), tc("f", "{}")],
        );
        check(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n",
            false,
            true,
            vec![tc("f", r#"{"a":1}"#)],
        );
    }

    #[test]
    fn malformed_tool_calls_fall_back_to_content() {
        let bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}\n</tool_call>";
        check(bad, false, true, vec![c(bad)]);
        check("x <tool_call>{\"name\": \"f\"", false, true, vec![c("x <tool_call>{\"name\": \"f\"")]);
        let bad = "Let me see.\n\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</tool_call> after";
        check(bad, false, true, vec![c(bad)]);
        // Without tools the tags are just text.
        let t = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        check(t, false, false, vec![c(t)]);
    }

    #[test]
    fn prompt_think_detection() {
        assert!(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_think("plain"));
    }

    #[test]
    fn xml_tool_calls_after_reasoning() {
        let text = "I should look it up.\n</think>\n\nChecking both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n<parameter=note>\nuse <b>24h</b>\nplease\n</parameter>\n</function>\n</tool_call>";
        check(
            text,
            true,
            true,
            vec![
                r("I should look it up.\n"),
                c("Checking both."),
                tc("get_weather", r#"{"city": "Paris"}"#),
                tc("get_time", r#"{"zone": "Europe/Paris", "note": "use <b>24h</b>\nplease"}"#),
            ],
        );
    }

    #[test]
    fn xml_values_follow_the_schema() {
        let schemas = ToolSchemas::from_tools(&serde_json::json!([{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}}]));
        let text = "<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\n7\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(parse_all(text, false, Some(schemas)), vec![tc("f", r#"{"n": 7, "s": "7"}"#)]);
    }
}
