//! OpenAI wire format: request validation (every field the server cannot honour is a 400 naming
//! it) and the error object. Requests are read from `serde_json::Value` by hand so that each
//! error can name the exact field (`messages[2].content`, `top_logprobs`, ...).
//!
//! Unknown top-level fields are rejected (OpenAI's own "Unrecognized request argument"), except
//! a few harmless ones clients send (`user`, `store`, `metadata`, `service_tier`), which are
//! accepted and have no effect. `parallel_tool_calls: false` is honoured by keeping the first call.

use serde_json::{json, Map, Value};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code }
    }
    /// 400 naming the offending field.
    pub fn param(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: Some("invalid_value"),
        }
    }
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", None, message)
    }
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// Sampling and output options shared by both endpoints.
#[derive(Debug, Clone, Default)]
pub struct GenParams {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// vLLM's repetition penalty (1 = off): over the prompt's and the generated tokens.
    pub repetition_penalty: Option<f32>,
    /// Some(k): report the sampled token's logprob and k alternatives.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `ignore_eos`: generate through end-of-sequence tokens until `max_tokens` (for
    /// benchmarks).
    pub ignore_eos: bool,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model decides (free text, parsed afterwards).
    Auto,
    /// At least one call, constrained to the tools' schemas.
    Required,
    /// A call of this function, constrained to its schema.
    Named(String),
}

/// What the answer must be: constrained decoding compiles this into a grammar.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    /// `response_format` json_object / json_schema: one JSON value valid under this schema.
    Json(Value),
    /// `tool_choice` required or named: tool calls in the template's format, arguments valid
    /// under their schemas. `only`: the named function; `parallel`: more than one call allowed.
    ToolCalls { only: Option<String>, parallel: bool },
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// Normalised messages (content as a string) ready for the chat template.
    pub messages: Vec<Value>,
    /// Tool definitions for the template (None with `tool_choice: "none"`).
    pub tools: Option<Value>,
    pub tool_choice: ToolChoice,
    pub template_kwargs: Map<String, Value>,
    /// false: at most one tool call per answer.
    pub parallel_tool_calls: bool,
    /// Constrained decoding (None: free text).
    pub constraint: Option<OutputConstraint>,
    pub params: GenParams,
}

#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub params: GenParams,
}

type R<T> = Result<T, ApiError>;

const HARMLESS: [&str; 4] = ["user", "store", "metadata", "service_tier"];
const SHARED: [&str; 17] = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "n",
    "stream",
    "stream_options",
    "logit_bias",
    "ignore_eos",
];

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn present<'a>(o: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

fn num(o: &Map<String, Value>, k: &str, lo: f64, hi: f64) -> R<Option<f64>> {
    match present(o, k) {
        None => Ok(None),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if !(x >= lo && x <= hi) {
                return Err(ApiError::param(k, format!("`{k}` must be between {lo} and {hi}, got {x}")));
            }
            Ok(Some(x))
        }
        Some(v) => Err(ApiError::param(k, format!("`{k}` must be a number, got {}", kind(v)))),
    }
}

fn int(o: &Map<String, Value>, k: &str, lo: i64, hi: i64) -> R<Option<i64>> {
    match present(o, k) {
        None => Ok(None),
        Some(Value::Number(n)) => {
            let Some(x) =
                n.as_i64().or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9e15).map(|f| f as i64))
            else {
                return Err(ApiError::param(k, format!("`{k}` must be an integer, got {n}")));
            };
            if x < lo || x > hi {
                return Err(ApiError::param(k, format!("`{k}` must be between {lo} and {hi}, got {x}")));
            }
            Ok(Some(x))
        }
        Some(v) => Err(ApiError::param(k, format!("`{k}` must be an integer, got {}", kind(v)))),
    }
}

fn boolean(o: &Map<String, Value>, k: &str) -> R<Option<bool>> {
    match present(o, k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::param(k, format!("`{k}` must be a boolean, got {}", kind(v)))),
    }
}

fn check_fields(o: &Map<String, Value>, own: &[&str]) -> R<()> {
    for k in o.keys() {
        let k = k.as_str();
        if !(SHARED.contains(&k) || HARMLESS.contains(&k) || own.contains(&k)) {
            return Err(ApiError::param(k, format!("Unrecognized request argument supplied: {k}")));
        }
    }
    if let Some(m) = present(o, "model") {
        if !m.is_string() {
            return Err(ApiError::param("model", format!("`model` must be a string, got {}", kind(m))));
        }
    }
    if let Some(p) = present(o, "parallel_tool_calls") {
        if !p.is_boolean() {
            return Err(ApiError::param("parallel_tool_calls", "`parallel_tool_calls` must be a boolean"));
        }
    }
    if let Some(u) = present(o, "user") {
        if !u.is_string() {
            return Err(ApiError::param("user", "`user` must be a string"));
        }
    }
    Ok(())
}

fn object(body: &Value) -> R<&Map<String, Value>> {
    body.as_object().ok_or_else(|| ApiError::bad(format!("the request body must be a JSON object, got {}", kind(body))))
}

/// The options both endpoints share. `max_tokens_key` is `max_tokens` or, for chat, also
/// `max_completion_tokens`.
fn gen_params(o: &Map<String, Value>, chat: bool) -> R<GenParams> {
    let mut p = GenParams::default();
    let mt = int(o, "max_tokens", 1, u32::MAX as i64)?;
    let mct = if chat { int(o, "max_completion_tokens", 1, u32::MAX as i64)? } else { None };
    p.max_tokens = mct.or(mt).map(|x| x as usize);
    p.temperature = num(o, "temperature", 0.0, 2.0)?.map(|x| x as f32);
    p.top_p = num(o, "top_p", 0.0, 1.0)?.map(|x| x as f32);
    if p.top_p == Some(0.0) {
        return Err(ApiError::param("top_p", "`top_p` must be in (0, 1]"));
    }
    // vLLM convention: -1 (or 0) disables top-k.
    p.top_k = int(o, "top_k", -1, 1 << 30)?.map(|x| x.max(0) as usize);
    p.min_p = num(o, "min_p", 0.0, 1.0)?.map(|x| x as f32);
    p.seed = int(o, "seed", i64::MIN, i64::MAX)?.map(|x| x as u64);
    p.presence_penalty = num(o, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    p.frequency_penalty = num(o, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    p.repetition_penalty = match num(o, "repetition_penalty", 0.0, 2.0)? {
        Some(x) if x <= 0.0 => {
            return Err(ApiError::param("repetition_penalty", "`repetition_penalty` must be in (0, 2]"))
        }
        Some(x) if x != 1.0 => Some(x as f32),
        _ => None,
    };
    p.stop = match present(o, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let mut v = Vec::new();
            for (i, s) in a.iter().enumerate() {
                match s {
                    Value::String(s) => v.push(s.clone()),
                    other => {
                        return Err(ApiError::param(
                            format!("stop[{i}]"),
                            format!("`stop` must hold strings, got {}", kind(other)),
                        ))
                    }
                }
            }
            v
        }
        Some(v) => {
            return Err(ApiError::param(
                "stop",
                format!("`stop` must be a string or an array of strings, got {}", kind(v)),
            ))
        }
    };
    if p.stop.len() > 16 {
        return Err(ApiError::param("stop", "at most 16 stop strings"));
    }
    if p.stop.iter().any(|s| s.is_empty() || s.len() > 1024) {
        return Err(ApiError::param("stop", "stop strings must be 1 to 1024 bytes long"));
    }
    if let Some(n) = int(o, "n", i64::MIN, i64::MAX)? {
        if n != 1 {
            return Err(ApiError::param("n", format!("only `n` = 1 is supported, got {n}")));
        }
    }
    p.stream = boolean(o, "stream")?.unwrap_or(false);
    p.ignore_eos = boolean(o, "ignore_eos")?.unwrap_or(false);
    if let Some(so) = present(o, "stream_options") {
        let Some(so) = so.as_object() else {
            return Err(ApiError::param("stream_options", "`stream_options` must be an object"));
        };
        if !p.stream {
            return Err(ApiError::param("stream_options", "`stream_options` is only allowed when `stream` is true"));
        }
        for k in so.keys() {
            if k != "include_usage" {
                return Err(ApiError::param(format!("stream_options.{k}"), format!("unsupported stream option `{k}`")));
            }
        }
        p.include_usage = boolean(so, "include_usage")
            .map_err(|e| ApiError { param: Some("stream_options.include_usage".into()), ..e })?
            .unwrap_or(false);
    }
    if let Some(lb) = present(o, "logit_bias") {
        match lb.as_object() {
            Some(m) if m.is_empty() => {}
            Some(_) => return Err(ApiError::param("logit_bias", "`logit_bias` is not supported")),
            None => return Err(ApiError::param("logit_bias", "`logit_bias` must be an object")),
        }
    }
    Ok(p)
}

/// Message content as text: a string, or an array of `{"type": "text", "text": ...}` parts.
fn content_text(v: Option<&Value>, at: &str, nullable: bool) -> R<String> {
    match v {
        None | Some(Value::Null) if nullable => Ok(String::new()),
        None | Some(Value::Null) => Err(ApiError::param(at, format!("`{at}` is required"))),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (j, part) in parts.iter().enumerate() {
                let here = format!("{at}[{j}]");
                let typ = part.get("type").and_then(Value::as_str);
                match (typ, part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => s.push_str(t),
                    (Some("text"), _) => return Err(ApiError::param(here, "a text part needs a string `text`")),
                    (Some(other), _) => {
                        return Err(ApiError::param(
                            here,
                            format!("content parts of type `{other}` are not supported (text only)"),
                        ))
                    }
                    (None, _) => return Err(ApiError::param(here, "a content part needs a `type`")),
                }
            }
            Ok(s)
        }
        Some(v) => {
            Err(ApiError::param(at, format!("`{at}` must be a string or an array of text parts, got {}", kind(v))))
        }
    }
}

fn message(i: usize, m: &Value) -> R<Value> {
    let at = format!("messages[{i}]");
    let Some(o) = m.as_object() else {
        return Err(ApiError::param(at.clone(), format!("`{at}` must be an object, got {}", kind(m))));
    };
    let role = match o.get("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(v) => {
            return Err(ApiError::param(format!("{at}.role"), format!("`role` must be a string, got {}", kind(v))))
        }
        None => return Err(ApiError::param(format!("{at}.role"), format!("`{at}.role` is required"))),
    };
    let role = match role {
        "system" | "developer" => "system",
        "user" | "assistant" | "tool" => role,
        other => {
            return Err(ApiError::param(
                format!("{at}.role"),
                format!("unknown role `{other}` (expected system, developer, user, assistant or tool)"),
            ))
        }
    };
    let has_calls = present(o, "tool_calls").is_some();
    let content = content_text(o.get("content"), &format!("{at}.content"), role == "assistant")?;
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.into()));
    out.insert("content".into(), Value::String(content));
    if let Some(n) = present(o, "name") {
        if !n.is_string() {
            return Err(ApiError::param(format!("{at}.name"), "`name` must be a string"));
        }
        out.insert("name".into(), n.clone());
    }
    if let Some(r) = present(o, "reasoning_content") {
        let Value::String(r) = r else {
            return Err(ApiError::param(format!("{at}.reasoning_content"), "`reasoning_content` must be a string"));
        };
        if role == "assistant" {
            out.insert("reasoning_content".into(), Value::String(r.clone()));
        }
    }
    if let Some(id) = present(o, "tool_call_id") {
        if !id.is_string() {
            return Err(ApiError::param(format!("{at}.tool_call_id"), "`tool_call_id` must be a string"));
        }
        out.insert("tool_call_id".into(), id.clone());
    }
    if has_calls {
        if role != "assistant" {
            return Err(ApiError::param(format!("{at}.tool_calls"), "only assistant messages carry `tool_calls`"));
        }
        let Some(calls) = o.get("tool_calls").and_then(Value::as_array) else {
            return Err(ApiError::param(format!("{at}.tool_calls"), "`tool_calls` must be an array"));
        };
        let mut norm = Vec::new();
        for (j, c) in calls.iter().enumerate() {
            let here = format!("{at}.tool_calls[{j}].function");
            let f = c.get("function").and_then(Value::as_object);
            let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
            let args = f.and_then(|f| f.get("arguments"));
            let (Some(name), Some(args)) = (name, args) else {
                return Err(ApiError::param(here, "a tool call needs `function.name` and `function.arguments`"));
            };
            let args = match args {
                Value::String(s) => match serde_json::from_str::<Value>(s) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => {
                        return Err(ApiError::param(
                            format!("{here}.arguments"),
                            "`arguments` must be a JSON object text",
                        ))
                    }
                },
                v @ Value::Object(_) => v.clone(),
                _ => {
                    return Err(ApiError::param(format!("{here}.arguments"), "`arguments` must be a JSON object text"))
                }
            };
            let mut call = json!({"type": "function", "function": {"name": name, "arguments": args}});
            if let Some(id) = c.get("id") {
                call["id"] = id.clone();
            }
            norm.push(call);
        }
        out.insert("tool_calls".into(), Value::Array(norm));
    }
    Ok(Value::Object(out))
}

/// OpenAI function names: letters, digits, `_`, `-` (and `.`), at most 64.
fn valid_tool_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

const SCHEMA_TYPES: [&str; 7] = ["string", "integer", "number", "boolean", "null", "object", "array"];

/// The shape of a JSON schema as far as lily reads it: `type` a known type name (or a list of
/// them), `properties` an object of schemas, `required` a list of strings, `items` a schema,
/// `enum` a list. Constrained decoding compiles the whole schema later (and names what it cannot).
pub fn check_schema(v: &Value, at: &str) -> R<()> {
    let Some(o) = v.as_object() else {
        return Err(ApiError::param(at, format!("`{at}` must be a JSON schema object, got {}", kind(v))));
    };
    let known = |t: &Value| t.as_str().is_some_and(|t| SCHEMA_TYPES.contains(&t));
    match o.get("type") {
        None => {}
        Some(t) if known(t) => {}
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(known) => {}
        Some(t) => {
            return Err(ApiError::param(
                format!("{at}.type"),
                format!("`type` must be one of {} (or a list of them), got {t}", SCHEMA_TYPES.join(", ")),
            ))
        }
    }
    if let Some(p) = o.get("properties") {
        let Some(p) = p.as_object() else {
            return Err(ApiError::param(format!("{at}.properties"), "`properties` must be an object of schemas"));
        };
        for (k, sub) in p {
            check_schema(sub, &format!("{at}.properties.{k}"))?;
        }
    }
    if let Some(r) = o.get("required") {
        if !r.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
            return Err(ApiError::param(format!("{at}.required"), "`required` must be an array of strings"));
        }
    }
    if let Some(i) = o.get("items") {
        if !i.is_boolean() {
            check_schema(i, &format!("{at}.items"))?;
        }
    }
    if let Some(e) = o.get("enum") {
        if e.as_array().is_none_or(|a| a.is_empty()) {
            return Err(ApiError::param(format!("{at}.enum"), "`enum` must be a non-empty array"));
        }
    }
    Ok(())
}

fn tools(o: &Map<String, Value>) -> R<(Option<Value>, ToolChoice)> {
    let tools = match present(o, "tools") {
        None => None,
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                let at = format!("tools[{i}]");
                if !t.is_object() {
                    return Err(ApiError::param(at.clone(), format!("`{at}` must be an object, got {}", kind(t))));
                }
                if t.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(ApiError::param(
                        format!("{at}.type"),
                        "only tools of `type` \"function\" are supported",
                    ));
                }
                let Some(f) = t.get("function").and_then(Value::as_object) else {
                    return Err(ApiError::param(format!("{at}.function"), "a tool needs a `function` object"));
                };
                let name = f.get("name").and_then(Value::as_str).unwrap_or("");
                if !valid_tool_name(name) {
                    return Err(ApiError::param(
                        format!("{at}.function.name"),
                        "`function.name` must be 1 to 64 letters, digits, `_`, `-` or `.`",
                    ));
                }
                if a[..i].iter().any(|u| u["function"]["name"].as_str() == Some(name)) {
                    return Err(ApiError::param(
                        format!("{at}.function.name"),
                        format!("two tools are named `{name}`"),
                    ));
                }
                if let Some(p) = f.get("parameters") {
                    check_schema(p, &format!("{at}.function.parameters"))?;
                }
            }
            if a.is_empty() {
                None
            } else {
                Some(Value::Array(a.clone()))
            }
        }
        Some(v) => return Err(ApiError::param("tools", format!("`tools` must be an array, got {}", kind(v)))),
    };
    let choice = match present(o, "tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => return Ok((None, ToolChoice::Auto)),
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(Value::Object(c)) => {
            let name = c.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            if c.get("type").and_then(Value::as_str) != Some("function") || name.is_none() {
                return Err(ApiError::param(
                    "tool_choice",
                    "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ));
            }
            ToolChoice::Named(name.unwrap_or_default().to_string())
        }
        Some(v) => {
            return Err(ApiError::param(
                "tool_choice",
                format!("`tool_choice` must be \"auto\", \"none\", \"required\" or a named function, got {v}"),
            ))
        }
    };
    match (&choice, &tools) {
        (ToolChoice::Required | ToolChoice::Named(_), None) => {
            Err(ApiError::param("tool_choice", "`tool_choice` asks for a tool call but `tools` is empty"))
        }
        (ToolChoice::Named(n), Some(t))
            if !t.as_array().into_iter().flatten().any(|x| x["function"]["name"] == **n) =>
        {
            Err(ApiError::param("tool_choice", format!("`tool_choice` names `{n}`, which is not in `tools`")))
        }
        _ => Ok((tools, choice)),
    }
}

/// `response_format`: None for text, else the schema the answer must follow.
fn response_format(o: &Map<String, Value>) -> R<Option<Value>> {
    let Some(rf) = present(o, "response_format") else { return Ok(None) };
    let typ = rf.get("type").and_then(Value::as_str);
    match typ {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "object"}))),
        Some("json_schema") => {
            let Some(js) = rf.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::param(
                    "response_format.json_schema",
                    "`response_format` of type json_schema needs a `json_schema` object",
                ));
            };
            match js.get("schema") {
                None | Some(Value::Null) => Ok(Some(json!({"type": "object"}))),
                Some(s) => {
                    check_schema(s, "response_format.json_schema.schema")?;
                    Ok(Some(s.clone()))
                }
            }
        }
        _ => Err(ApiError::param(
            "response_format.type",
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// Keys of the template context that the request's own fields own.
const RESERVED_KWARGS: [&str; 7] =
    ["messages", "tools", "tool_choice", "add_generation_prompt", "bos_token", "eos_token", "documents"];

pub fn parse_chat(body: &Value) -> R<ChatRequest> {
    let o = object(body)?;
    check_fields(
        o,
        &[
            "messages",
            "max_completion_tokens",
            "top_logprobs",
            "tools",
            "tool_choice",
            "chat_template_kwargs",
            "response_format",
            "parallel_tool_calls",
            "reasoning_effort",
        ],
    )?;
    let msgs = match o.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::param("messages", "`messages` must not be empty")),
        Some(v) => return Err(ApiError::param("messages", format!("`messages` must be an array, got {}", kind(v)))),
        None => return Err(ApiError::param("messages", "`messages` is required")),
    };
    let messages = msgs.iter().enumerate().map(|(i, m)| message(i, m)).collect::<R<Vec<_>>>()?;
    let mut params = gen_params(o, true)?;
    let logprobs = boolean(o, "logprobs")?.unwrap_or(false);
    let top = int(o, "top_logprobs", 0, 20)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::param("top_logprobs", "`top_logprobs` needs `logprobs` set to true"));
    }
    params.logprobs = logprobs.then_some(top.unwrap_or(0) as usize);
    let json_schema = response_format(o)?;
    let mut template_kwargs = match present(o, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(m)) => {
            if let Some(k) = m.keys().find(|k| RESERVED_KWARGS.contains(&k.as_str())) {
                return Err(ApiError::param(
                    format!("chat_template_kwargs.{k}"),
                    format!("`{k}` is set by the request itself, not through `chat_template_kwargs`"),
                ));
            }
            if let Some(v) = m.get("enable_thinking") {
                if !v.is_boolean() {
                    return Err(ApiError::param(
                        "chat_template_kwargs.enable_thinking",
                        "`enable_thinking` must be a boolean",
                    ));
                }
            }
            m.clone()
        }
        Some(v) => {
            return Err(ApiError::param(
                "chat_template_kwargs",
                format!("`chat_template_kwargs` must be an object, got {}", kind(v)),
            ))
        }
    };
    // `reasoning_effort` "none"/"minimal" switches thinking off (an explicit
    // `chat_template_kwargs.enable_thinking` wins); other levels keep it on.
    match present(o, "reasoning_effort") {
        None => {}
        Some(Value::String(e)) if matches!(e.as_str(), "none" | "minimal") => {
            template_kwargs.entry("enable_thinking").or_insert(Value::Bool(false));
        }
        Some(Value::String(e)) if matches!(e.as_str(), "low" | "medium" | "high") => {}
        Some(v) => {
            return Err(ApiError::param(
                "reasoning_effort",
                format!("`reasoning_effort` must be \"none\", \"minimal\", \"low\", \"medium\" or \"high\", got {v}"),
            ))
        }
    }
    let parallel_tool_calls = boolean(o, "parallel_tool_calls")?.unwrap_or(true);
    let (tools, tool_choice) = tools(o)?;
    let constraint = match (&tool_choice, json_schema) {
        (ToolChoice::Auto, None) => None,
        (ToolChoice::Auto, Some(s)) => Some(OutputConstraint::Json(s)),
        (_, Some(_)) => {
            return Err(ApiError::param(
                "response_format",
                "`response_format` cannot be combined with a forced `tool_choice` (the answer is a tool call)",
            ))
        }
        (ToolChoice::Required, None) => Some(OutputConstraint::ToolCalls { only: None, parallel: parallel_tool_calls }),
        (ToolChoice::Named(n), None) => Some(OutputConstraint::ToolCalls { only: Some(n.clone()), parallel: false }),
    };
    Ok(ChatRequest { messages, tools, tool_choice, template_kwargs, parallel_tool_calls, constraint, params })
}

pub fn parse_completion(body: &Value) -> R<CompletionRequest> {
    let o = object(body)?;
    check_fields(o, &["prompt", "echo", "suffix", "best_of"])?;
    let prompt = match o.get("prompt") {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Prompt::Text(a[0].as_str().unwrap_or("").to_string())
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.is_u64()) => {
            let ids: Option<Vec<u32>> = a.iter().map(|x| x.as_u64().and_then(|v| u32::try_from(v).ok())).collect();
            Prompt::Tokens(ids.ok_or_else(|| ApiError::param("prompt", "token ids must fit in 32 bits"))?)
        }
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(|x| x.is_string() || x.is_array()) => {
            return Err(ApiError::param("prompt", "only one prompt per request is supported"))
        }
        Some(v) => {
            return Err(ApiError::param(
                "prompt",
                format!("`prompt` must be a string or an array of token ids, got {}", kind(v)),
            ))
        }
        None => return Err(ApiError::param("prompt", "`prompt` is required")),
    };
    if matches!(&prompt, Prompt::Text(s) if s.is_empty()) {
        return Err(ApiError::param("prompt", "`prompt` must not be empty"));
    }
    let mut params = gen_params(o, false)?;
    if params.max_tokens.is_none() {
        params.max_tokens = Some(16); // OpenAI's default for completions
    }
    params.logprobs = int(o, "logprobs", 0, 20)?.map(|x| x as usize);
    if boolean(o, "echo")? == Some(true) {
        return Err(ApiError::param("echo", "`echo` is not supported"));
    }
    if present(o, "suffix").is_some_and(|s| s.as_str() != Some("")) {
        return Err(ApiError::param("suffix", "`suffix` is not supported"));
    }
    if let Some(b) = int(o, "best_of", i64::MIN, i64::MAX)? {
        if b != 1 {
            return Err(ApiError::param("best_of", "only `best_of` = 1 is supported"));
        }
    }
    Ok(CompletionRequest { prompt, params })
}

#[cfg(test)]
mod tests;
