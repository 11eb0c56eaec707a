//! The inside of one `<tool_call>…</tool_call>` block, in either format a Qwen template asks for:
//!
//! - XML (the real Qwen3.5/3.6 template, vLLM/SGLang `qwen3_coder`):
//!   `<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n…</function>`. Values are untyped text;
//!   the request's `tools` schema says what each becomes ([`convert`]).
//! - JSON (older Qwen templates): `{"name": NAME, "arguments": {...}}`.
//!
//! A call's arguments are kept as an ordered list of (name, value), so the streamed argument
//! fragments ([`ToolCall::fragments`]) and the non-streamed `arguments` text are one string.

use serde_json::{Map, Value};
use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub args: Vec<(String, Value)>,
}

impl ToolCall {
    /// The arguments as OpenAI streams them: `{"a":1`, `,"b":2`, `}` (or `{}` alone).
    pub fn fragments(&self) -> Vec<String> {
        if self.args.is_empty() {
            return vec!["{}".to_string()];
        }
        let mut out = Vec::with_capacity(self.args.len() + 1);
        for (i, (k, v)) in self.args.iter().enumerate() {
            let key = Value::String(k.clone()).to_string();
            out.push(format!("{}{key}:{v}", if i == 0 { "{" } else { "," }));
        }
        out.push("}".to_string());
        out
    }

    /// The arguments as one JSON object text (the fragments joined).
    pub fn arguments(&self) -> String {
        self.fragments().concat()
    }
}

/// Parameter schemas of the request's tools: function name → its `parameters` schema.
#[derive(Clone, Debug, Default)]
pub struct ToolSchemas {
    by_name: HashMap<String, Value>,
}

impl ToolSchemas {
    /// From an OpenAI `tools` array (already validated).
    pub fn from_tools(tools: &Value) -> ToolSchemas {
        let mut by_name = HashMap::new();
        for t in tools.as_array().into_iter().flatten() {
            let f = &t["function"];
            if let Some(name) = f["name"].as_str() {
                by_name.insert(name.to_string(), f.get("parameters").cloned().unwrap_or(Value::Null));
            }
        }
        ToolSchemas { by_name }
    }

    /// The schema of parameter `param` of function `name`, if declared.
    fn param(&self, name: &str, param: &str) -> Option<&Value> {
        self.by_name.get(name)?.get("properties")?.get(param)
    }
}

const FN_OPEN: &str = "<function=";
const FN_CLOSE: &str = "</function>";
const P_OPEN: &str = "<parameter=";
const P_CLOSE: &str = "</parameter>";

/// Parses a block body in whichever format it is written; None if it is malformed.
pub fn parse_body(body: &str, schemas: &ToolSchemas) -> Option<ToolCall> {
    let t = body.trim();
    if t.starts_with(FN_OPEN) {
        parse_xml(t, schemas)
    } else {
        parse_json(t)
    }
}

/// `<function=NAME>` then parameters then `</function>`, nothing else but whitespace.
fn parse_xml(t: &str, schemas: &ToolSchemas) -> Option<ToolCall> {
    let rest = t.strip_prefix(FN_OPEN)?;
    let gt = rest.find('>')?;
    let name = rest[..gt].trim();
    if name.is_empty() || name.contains(['<', '\n']) {
        return None;
    }
    let mut rest = &rest[gt + 1..];
    let mut args: Vec<(String, Value)> = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix(FN_CLOSE) {
            return after.trim().is_empty().then(|| ToolCall { name: name.to_string(), args });
        }
        let p = rest.strip_prefix(P_OPEN)?;
        let gt = p.find('>')?;
        let pname = p[..gt].trim();
        if pname.is_empty() || pname.contains(['<', '\n']) {
            return None;
        }
        let vstart = &p[gt + 1..];
        let end = value_end(vstart)?;
        let raw = vstart[..end].strip_prefix('\n').unwrap_or(&vstart[..end]);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = convert(raw, schemas.param(name, pname));
        match args.iter_mut().find(|(k, _)| k == pname) {
            Some(slot) => slot.1 = value,
            None => args.push((pname.to_string(), value)),
        }
        rest = &vstart[end + P_CLOSE.len()..];
    }
}

/// Where a parameter value ends: the first `</parameter>` followed (after whitespace) by the next
/// parameter or the end of the function, so a value may itself contain `</parameter>` or `<`.
fn value_end(v: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = v[from..].find(P_CLOSE) {
        let at = from + i;
        let after = v[at + P_CLOSE.len()..].trim_start();
        if after.starts_with(P_OPEN) || after.starts_with(FN_CLOSE) {
            return Some(at);
        }
        from = at + P_CLOSE.len();
    }
    None
}

/// `{"name": ..., "arguments": {...}}` (arguments may also be a JSON string holding an object,
/// or be called `parameters`).
fn parse_json(t: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(t).ok()?;
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.trim();
    if name.is_empty() {
        return None;
    }
    let args: Map<String, Value> = match o.get("arguments").or_else(|| o.get("parameters")) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(a)) => a.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(a)) => a,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ToolCall { name: name.to_string(), args: args.into_iter().collect() })
}

/// The JSON type names a schema declares (`"type": "x"` or `"type": ["x", "y"]`).
fn types(schema: &Value) -> Vec<&str> {
    match schema.get("type") {
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

fn has_type(v: &Value, t: &str) -> bool {
    match t {
        "string" => v.is_string(),
        "integer" => v.as_i64().is_some() || v.as_u64().is_some(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        _ => false,
    }
}

/// How a raw value of the XML format is rendered for an enum member (what the grammar offers).
pub fn raw_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Converts a raw XML parameter value to the type its schema declares. Strings, parameters
/// without a schema and values that do not read as the declared type stay strings; an `enum`
/// member whose text matches is taken as it is; a schema without a `type` takes the text as JSON
/// when it reads as JSON.
pub fn convert(raw: &str, schema: Option<&Value>) -> Value {
    let text = || Value::String(raw.to_string());
    let Some(schema) = schema else { return text() };
    if let Some(m) = schema.get("enum").and_then(Value::as_array).and_then(|e| e.iter().find(|m| raw_text(m) == raw)) {
        return m.clone();
    }
    if let Some(c) = schema.get("const").filter(|c| raw_text(c) == raw) {
        return c.clone();
    }
    let ts = types(schema);
    if ts.is_empty() {
        return serde_json::from_str::<Value>(raw.trim()).unwrap_or_else(|_| text());
    }
    if ts == ["string"] {
        return text();
    }
    let t = raw.trim();
    let lowered = t.to_ascii_lowercase();
    // Python spellings from templates that render values with `string` (Qwen3.5: `True`, `None`).
    let parsed = match lowered.as_str() {
        "true" | "false" if ts.contains(&"boolean") => Some(Value::Bool(lowered == "true")),
        "null" | "none" if ts.contains(&"null") => Some(Value::Null),
        _ => serde_json::from_str::<Value>(t).ok(),
    };
    match parsed {
        Some(v) if ts.iter().any(|ty| ty != &"string" && has_type(&v, ty)) => v,
        _ => text(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schemas() -> ToolSchemas {
        ToolSchemas::from_tools(&json!([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {
            "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
            "b": {"type": "boolean"}, "z": {"type": "null"}, "o": {"type": "object"},
            "a": {"type": "array"}, "u": {"type": ["integer", "null"]}, "e": {"enum": ["x", "42"]},
            "any": {}
        }}}}]))
    }

    fn one(name: &str, raw: &str) -> Value {
        let body = format!("<function=f>\n<parameter={name}>\n{raw}\n</parameter>\n</function>");
        let tc = parse_body(&body, &schemas()).expect("parses");
        assert_eq!(tc.args.len(), 1);
        tc.args[0].1.clone()
    }

    #[test]
    fn values_take_their_schema_type() {
        assert_eq!(one("s", "42"), json!("42"));
        assert_eq!(one("i", "42"), json!(42));
        assert_eq!(one("i", "4.5"), json!("4.5"), "not an integer: stays text");
        assert_eq!(one("n", "-1.5e3"), json!(-1500.0));
        assert_eq!(one("n", "7"), json!(7));
        assert_eq!(one("b", "true"), json!(true));
        assert_eq!(one("b", "False"), json!(false));
        assert_eq!(one("b", "maybe"), json!("maybe"));
        assert_eq!(one("z", "null"), json!(null));
        assert_eq!(one("o", "{\"k\": [1, 2]}"), json!({"k": [1, 2]}));
        assert_eq!(one("o", "[1]"), json!("[1]"), "an array is not an object");
        assert_eq!(one("a", "[1, \"x\"]"), json!([1, "x"]));
        assert_eq!(one("u", "null"), json!(null));
        assert_eq!(one("u", "3"), json!(3));
        assert_eq!(one("e", "42"), json!("42"), "the enum member, not a number");
        assert_eq!(one("any", "{\"q\": 1}"), json!({"q": 1}));
        assert_eq!(one("any", "plain words"), json!("plain words"));
        assert_eq!(one("undeclared", "12"), json!("12"), "not in the schema: text");
    }

    #[test]
    fn multi_line_values_and_angle_brackets() {
        let body = "<function=f>\n<parameter=s>\nline 1\nif a < b and c > d: </parameter> here\n</parameter>\n<parameter=i>\n5\n</parameter>\n</function>";
        let tc = parse_body(body, &schemas()).unwrap();
        assert_eq!(tc.name, "f");
        assert_eq!(
            tc.args,
            vec![("s".into(), json!("line 1\nif a < b and c > d: </parameter> here")), ("i".into(), json!(5))]
        );
        assert_eq!(tc.arguments(), r#"{"s":"line 1\nif a < b and c > d: </parameter> here","i":5}"#);
        let fr = tc.fragments();
        assert_eq!(fr.len(), 3);
        assert_eq!(fr.concat(), tc.arguments());
        assert_eq!(serde_json::from_str::<Value>(&tc.arguments()).unwrap()["i"], 5);
    }

    #[test]
    fn no_parameters_and_no_schema() {
        let tc = parse_body("\n<function=ping>\n</function>\n", &ToolSchemas::default()).unwrap();
        assert_eq!((tc.name.as_str(), tc.arguments()), ("ping", "{}".to_string()));
        let tc =
            parse_body("<function=g>\n<parameter=x>\n1\n</parameter>\n</function>", &ToolSchemas::default()).unwrap();
        assert_eq!(tc.arguments(), r#"{"x":"1"}"#);
    }

    #[test]
    fn malformed_xml_is_rejected() {
        let s = schemas();
        for bad in [
            "<function=f>\n<parameter=s>\nx\n</parameter>\n", // no </function>
            "<function=f>\n<parameter=s>\nx\n</function>",    // parameter never closed
            "<function=f>\ngarbage\n</function>",             // text between parameters
            "<function=>\n</function>",                       // no name
            "<function=f>\n</function>\ntrailing",            // text after the function
            "<function=f\n<parameter=s>\nx\n</parameter>\n</function>", // name runs into the next tag
        ] {
            assert!(parse_body(bad, &s).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn json_format_still_parses() {
        let tc =
            parse_body(r#"{"name": "f", "arguments": {"city": "Paris", "n": 2}}"#, &ToolSchemas::default()).unwrap();
        assert_eq!(tc.arguments(), r#"{"city":"Paris","n":2}"#);
        assert_eq!(
            parse_body(r#"{"name": "f", "arguments": "{\"a\": 2}"}"#, &ToolSchemas::default()).unwrap().arguments(),
            r#"{"a":2}"#
        );
        for bad in [
            r#"{"name": "", "arguments": {}}"#,
            r#"{"arguments": {}}"#,
            r#"{"name": "f", "arguments": [1]}"#,
            "not json",
        ] {
            assert!(parse_body(bad, &ToolSchemas::default()).is_none(), "{bad}");
        }
    }
}
