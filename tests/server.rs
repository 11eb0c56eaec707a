//! `lily serve` end to end: the real binary on a free port with the tiny fixture checkpoint,
//! spoken to over plain HTTP/1.1 (no client library), including malformed input and overload.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-hf")
}

/// The real Qwen3.5 chat template (XML tool calls), the copy built into lily.
fn real_template() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/qwen3.5-chat_template.jinja")
}

/// The tiny checkpoint with the real Qwen3.5 chat template, in a fresh temp directory.
fn tools_model(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lily-serve-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "chat_template.jinja" {
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
    }
    std::fs::copy(real_template(), d.join("chat_template.jinja")).unwrap();
    d
}

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Test-only scripted outputs (`LILY_TEST_SCRIPTS`): trigger text in the last message -> output.
fn scripts() -> String {
    json!({
        "SCRIPT_THINK": "The user greets me.\n</think>\n\nHello there!",
        "SCRIPT_TOOL": "Weather needed.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "SCRIPT_BADTOOL": "Hmm.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        "SCRIPT_LONG": "word ".repeat(400),
    })
    .to_string()
}

fn start(model: &std::path::Path, args: &[&str]) -> Server {
    start_with_stderr(model, args, Stdio::null())
}

fn start_with_stderr(model: &std::path::Path, args: &[&str], stderr: Stdio) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["serve", "--model", model.to_str().unwrap(), "--bind", "127.0.0.1:0", "--threads", "2"])
        .args(args)
        // e.g. `--device cuda` to run these tests on a GPU backend.
        .args(std::env::var("LILY_SERVE_ARGS").unwrap_or_default().split_whitespace())
        .env("LILY_TEST_SCRIPTS", scripts())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("starting lily serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().rsplit("http://").next().unwrap().to_string();
    assert!(line.contains("listening on"), "{line}");
    Server { child, addr }
}

struct Resp {
    status: u16,
    headers: String,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[nl + 2 + n + 2..];
    }
    out
}

fn raw(addr: &str, bytes: &[u8]) -> Resp {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c.write_all(bytes).unwrap();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    let split = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(buf.len());
    let headers = String::from_utf8_lossy(&buf[..split]).to_string();
    let mut body = buf.get(split + 4..).unwrap_or(&[]).to_vec();
    if headers.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    let status = headers.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0);
    Resp { status, headers, body: String::from_utf8_lossy(&body).to_string() }
}

fn req(addr: &str, method: &str, path: &str, body: &str, auth: Option<&str>) -> Resp {
    let auth = auth.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    let msg = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    raw(addr, msg.as_bytes())
}

fn post(addr: &str, path: &str, body: &Value) -> Resp {
    req(addr, "POST", path, &body.to_string(), None)
}

/// The JSON events of an SSE body; asserts it ends with `data: [DONE]`.
fn events(body: &str) -> Vec<Value> {
    let datas: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(datas.last(), Some(&"[DONE]"), "{body}");
    datas[..datas.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

/// (reasoning, content, tool calls, finish_reason, usage) from stream chunks.
fn fold(ev: &[Value]) -> (String, String, Vec<Value>, String, Value) {
    let (mut r, mut c, mut calls, mut fin, mut usage) =
        (String::new(), String::new(), Vec::new(), String::new(), Value::Null);
    for e in ev {
        if !e["usage"].is_null() {
            usage = e["usage"].clone();
        }
        let Some(ch) = e["choices"].get(0) else { continue };
        r += ch["delta"]["reasoning_content"].as_str().unwrap_or("");
        c += ch["delta"]["content"].as_str().unwrap_or("");
        // A call's first delta has its index, id and name; later ones add argument fragments.
        for t in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = t["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert!(t["id"].is_string() && t["function"]["name"].is_string(), "{t}");
                calls.push(t.clone());
            } else {
                assert!(t.get("id").is_none(), "{t}");
                let a = calls[i]["function"]["arguments"].as_str().unwrap().to_string();
                calls[i]["function"]["arguments"] = json!(a + t["function"]["arguments"].as_str().unwrap());
            }
        }
        if let Some(f) = ch["finish_reason"].as_str() {
            fin = f.to_string();
        }
    }
    (r, c, calls, fin, usage)
}

#[test]
fn endpoints_and_streaming_equals_non_streaming() {
    let s = start(&fixture(), &[]);
    let h = req(&s.addr, "GET", "/health", "", None);
    assert_eq!((h.status, h.json()["status"].clone()), (200, json!("ok")));
    let m = req(&s.addr, "GET", "/v1/models", "", None).json();
    assert_eq!(m["data"][0]["id"], "tiny-hf");
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0});
    let full = post(&s.addr, "/v1/chat/completions", &body);
    assert_eq!(full.status, 200, "{}", full.body);
    let full = full.json();
    let msg = &full["choices"][0]["message"];
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let st = post(&s.addr, "/v1/chat/completions", &sb);
    assert!(st.headers.contains("text/event-stream"));
    let (r, c, _, fin, usage) = fold(&events(&st.body));
    assert_eq!(r, msg["reasoning_content"].as_str().unwrap_or(""));
    assert_eq!(c, msg["content"].as_str().unwrap_or(""));
    assert_eq!(fin, full["choices"][0]["finish_reason"].as_str().unwrap());
    assert_eq!(usage["completion_tokens"], full["usage"]["completion_tokens"]);
    // Completions, streamed and not.
    let cb = json!({"prompt": "The sky", "max_tokens": 6, "temperature": 0});
    let one = post(&s.addr, "/v1/completions", &cb).json();
    let mut cs = cb.clone();
    cs["stream"] = json!(true);
    let text: String = events(&post(&s.addr, "/v1/completions", &cs).body)
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(text, one["choices"][0]["text"].as_str().unwrap());
    let metrics = req(&s.addr, "GET", "/metrics", "", None);
    assert!(
        metrics.body.contains("lily_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2"),
        "{}",
        metrics.body
    );
    assert!(metrics.body.contains("lily_time_to_first_token_seconds_count"));
}

#[test]
fn scripted_reasoning_and_tool_calls() {
    let dir = tools_model("script");
    let s = start(&dir, &[]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let think = json!({"messages": [{"role": "user", "content": "SCRIPT_THINK"}], "max_tokens": 60, "temperature": 0});
    let m = post(&s.addr, "/v1/chat/completions", &think).json();
    assert_eq!(m["choices"][0]["message"]["reasoning_content"], "The user greets me.\n");
    assert_eq!(m["choices"][0]["message"]["content"], "Hello there!");
    let tool = json!({"messages": [{"role": "user", "content": "SCRIPT_TOOL"}], "tools": tools, "max_tokens": 200, "temperature": 0});
    let r = post(&s.addr, "/v1/chat/completions", &tool).json();
    let ch = &r["choices"][0];
    assert_eq!(ch["finish_reason"], "tool_calls");
    assert_eq!(ch["message"]["content"], Value::Null);
    assert_eq!(ch["message"]["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(ch["message"]["tool_calls"][0]["function"]["arguments"], r#"{"city":"Paris","days":2}"#);
    let mut st = tool.clone();
    st["stream"] = json!(true);
    let (r, c, calls, fin, _) = fold(&events(&post(&s.addr, "/v1/chat/completions", &st).body));
    assert_eq!((r.as_str(), c.as_str(), fin.as_str()), ("Weather needed.\n", "", "tool_calls"));
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["arguments"], r#"{"city":"Paris","days":2}"#);
    let bad = json!({"messages": [{"role": "user", "content": "SCRIPT_BADTOOL"}], "tools": tools, "max_tokens": 200, "temperature": 0});
    let b = post(&s.addr, "/v1/chat/completions", &bad).json();
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        b["choices"][0]["message"]["content"],
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_input_gets_openai_errors_and_never_crashes() {
    let s = start(&fixture(), &["--api-key", "k", "--max-seq", "64", "--max-body-bytes", "4096"]);
    let ok = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#;
    let check = |r: Resp, status: u16, param: Option<&str>| {
        assert_eq!(r.status, status, "{}", r.body);
        let e = r.json();
        let e = e["error"].as_object().unwrap_or_else(|| panic!("{}", r.body));
        assert!(e.contains_key("message") && e.contains_key("type") && e.contains_key("code"));
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{}", r.body);
        }
    };
    let chat = "/v1/chat/completions";
    check(req(&s.addr, "POST", chat, ok, None), 401, None);
    check(req(&s.addr, "POST", chat, ok, Some("wrong")), 401, None);
    assert_eq!(req(&s.addr, "POST", chat, ok, Some("k")).status, 200);
    assert_eq!(req(&s.addr, "GET", "/health", "", None).status, 200, "health needs no key");
    check(req(&s.addr, "POST", chat, "{\"messages\": [", Some("k")), 400, None);
    check(req(&s.addr, "POST", chat, "\u{0}\u{1}garbage", Some("k")), 400, None);
    check(
        req(&s.addr, "POST", chat, r#"{"messages": [{"role": "user", "content": "hi"}], "top_p": "x"}"#, Some("k")),
        400,
        Some("top_p"),
    );
    check(
        req(&s.addr, "POST", chat, r#"{"messages": [{"role": "alien", "content": "hi"}]}"#, Some("k")),
        400,
        Some("messages[0].role"),
    );
    check(
        req(&s.addr, "POST", chat, r#"{"messages": [{"role": "user", "content": "hi"}], "seed": "x"}"#, Some("k")),
        400,
        Some("seed"),
    );
    check(
        req(
            &s.addr,
            "POST",
            chat,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}"#,
            Some("k"),
        ),
        400,
        Some("max_tokens"),
    );
    let long = json!({"messages": [{"role": "user", "content": "word ".repeat(200)}]}).to_string();
    let r = req(&s.addr, "POST", chat, &long, Some("k"));
    assert!(r.body.contains("context_length_exceeded"), "{}", r.body);
    check(r, 400, None);
    let huge = json!({"messages": [{"role": "user", "content": "x".repeat(10_000)}]}).to_string();
    check(req(&s.addr, "POST", chat, &huge, Some("k")), 413, None);
    check(req(&s.addr, "POST", "/v1/completions", r#"{"prompt": [1, 2, 100000]}"#, Some("k")), 400, Some("prompt"));
    check(req(&s.addr, "GET", "/nope", "", Some("k")), 404, None);
    // Not HTTP at all, and a truncated request: the connection is dropped, the server lives on.
    let _ = raw(&s.addr, b"\x16\x03\x01 definitely not http\r\n\r\n");
    {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 500\r\n\r\n{\"messa").unwrap();
    }
    assert_eq!(req(&s.addr, "GET", "/health", "", None).status, 200);
    assert_eq!(req(&s.addr, "POST", chat, ok, Some("k")).status, 200);
}

/// What the HTTP layer refuses still carries the OpenAI error object.
#[test]
fn http_layer_errors_have_error_bodies() {
    let s = start(&fixture(), &[]);
    let many: String = (0..150).map(|i| format!("X-{i}: y\r\n")).collect();
    let huge = format!("GET /health HTTP/1.1\r\nX-Big: {}\r\n\r\n", "a".repeat(70 << 10));
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (b"\x00\x01 garbage line\r\n\r\n".to_vec(), 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n".to_vec(), 400),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc".to_vec(), 400),
        (format!("GET /health HTTP/1.1\r\n{many}\r\n").into_bytes(), 431),
        (huge.into_bytes(), 431),
    ];
    for (bytes, status) in cases {
        let r = raw(&s.addr, &bytes);
        assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&bytes[..bytes.len().min(80)]));
        let e = r.json();
        assert!(e["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", r.body);
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    // Keep-alive still works after the first head.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    assert_eq!(String::from_utf8_lossy(&buf).matches("HTTP/1.1 200").count(), 2);
}

#[test]
fn slow_clients_are_cut_off() {
    let s = start(&fixture(), &["--read-timeout-secs", "1"]);
    let t0 = std::time::Instant::now();
    // A request head that never ends: the server closes the connection.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    assert!(t0.elapsed() < Duration::from_secs(10), "header timeout");
    // A body that stops short of its Content-Length: 408.
    let t0 = std::time::Instant::now();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"").unwrap();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    let head = String::from_utf8_lossy(&buf);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(req(&s.addr, "GET", "/health", "", None).status, 200);
}

#[test]
fn prefix_cache_reuses_state_with_identical_output() {
    let warm = start(&fixture(), &[]);
    let cold = start(&fixture(), &["--prefix-cache-mb", "0"]);
    let turn1 = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first question"}]);
    let a =
        post(&warm.addr, "/v1/chat/completions", &json!({"messages": turn1, "max_tokens": 6, "temperature": 0})).json();
    let mut turn2 = turn1.as_array().unwrap().clone();
    turn2.push(json!({"role": "assistant", "content": a["choices"][0]["message"]["content"]}));
    turn2.push(json!({"role": "user", "content": "second question"}));
    for sampling in [json!({"temperature": 0}), json!({"temperature": 1.0, "seed": 3})] {
        let mut body = json!({"messages": turn2, "max_tokens": 12, "logprobs": true});
        body.as_object_mut().unwrap().extend(sampling.as_object().unwrap().clone());
        let w = post(&warm.addr, "/v1/chat/completions", &body).json();
        let c = post(&cold.addr, "/v1/chat/completions", &body).json();
        assert!(w["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{w}");
        assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let toks = |v: &Value| -> Vec<Value> {
            v["choices"][0]["logprobs"]["content"].as_array().unwrap().iter().map(|e| e["token"].clone()).collect()
        };
        assert_eq!(toks(&w), toks(&c));
        assert_eq!(w["choices"][0]["message"], c["choices"][0]["message"]);
    }
    let m = req(&warm.addr, "GET", "/metrics", "", None).body;
    assert!(!m.contains("lily_prefix_cache_hits_total 0\n"), "{m}");
}

#[test]
fn full_queue_answers_503_and_recovers() {
    let s = start(&fixture(), &["--queue-size", "1"]);
    let addr = s.addr.clone();
    // A scripted 400-token answer: no early end-of-sequence, so the queue really fills.
    let body = json!({"prompt": "SCRIPT_LONG", "max_tokens": 300, "temperature": 0}).to_string();
    let handles: Vec<_> = (0..12)
        .map(|_| {
            let (addr, body) = (addr.clone(), body.clone());
            std::thread::spawn(move || {
                let r = req(&addr, "POST", "/v1/completions", &body, None);
                (r.status, r.headers.to_ascii_lowercase().contains("retry-after: 1"))
            })
        })
        .collect();
    let results: Vec<(u16, bool)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(results.iter().all(|&(st, retry)| st == 200 || (st == 503 && retry)), "{results:?}");
    assert!(results.iter().any(|r| r.0 == 503), "{results:?}");
    assert!(results.iter().any(|r| r.0 == 200), "{results:?}");
    assert_eq!(req(&s.addr, "GET", "/health", "", None).status, 200);
    assert_eq!(post(&s.addr, "/v1/completions", &json!({"prompt": "after", "max_tokens": 2})).status, 200);
}

#[test]
fn resuming_from_a_snapshot_matches_one_shot_prefill() {
    // What makes prefix-cache answers identical to uncached ones: prefill of a prefix, snapshot,
    // restore into a fresh session and prefill of the rest gives the logits of one-shot prefill.
    use lily::generate::{CpuSession, Session};
    let model = std::sync::Arc::new(lily::weights::load_model(&fixture()).unwrap());
    let toks: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % 460).collect();
    let one_shot = CpuSession::new(model.clone()).forward_last(&toks).unwrap();
    for cut in [1, 37, 64, 149] {
        let mut a = CpuSession::new(model.clone());
        a.forward_last(&toks[..cut]).unwrap();
        let snap = a.snapshot();
        let mut b = CpuSession::new(model.clone());
        b.restore(&snap).unwrap();
        let resumed = b.forward_last(&toks[cut..]).unwrap();
        let d = one_shot.iter().zip(&resumed).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-5, "cut {cut}: max |diff| {d}");
        assert_eq!(lily::sampling::argmax(&one_shot), lily::sampling::argmax(&resumed));
    }
}

/// `lily serve MODEL --host H --port P`, as llama-server and vllm take it.
#[test]
fn serve_takes_a_positional_model_and_host_port() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["serve", fixture().to_str().unwrap(), "--host", "127.0.0.1", "--port", "0", "--threads", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let s = Server { child, addr: line.trim().rsplit("http://").next().unwrap().to_string() };
    assert!(s.addr.starts_with("127.0.0.1:"), "{line}");
    assert_eq!(req(&s.addr, "GET", "/health", "", None).status, 200);
    assert_eq!(req(&s.addr, "GET", "/v1/models", "", None).json()["data"][0]["id"], "tiny-hf");
}

#[test]
fn cors_model_by_id_and_a_default_completion_length() {
    let s = start(&fixture(), &["--allowed-origins", "http://ui.example", "--max-tokens-default", "3"]);
    let pre = raw(
        &s.addr,
        b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: http://ui.example\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n\r\n",
    );
    let h = pre.headers.to_ascii_lowercase();
    assert_eq!(pre.status, 204, "{}", pre.headers);
    assert!(h.contains("access-control-allow-origin: http://ui.example"), "{h}");
    assert!(h.contains("access-control-allow-methods"), "{h}");
    let bad = raw(
        &s.addr,
        b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: http://evil.example\r\n\r\n",
    );
    assert_eq!(bad.status, 403, "{}", bad.body);
    assert!(bad.body.contains("--allowed-origins"), "{}", bad.body);
    let m = raw(
        &s.addr,
        b"GET /v1/models/tiny-hf HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: http://ui.example\r\n\r\n",
    );
    assert_eq!((m.status, m.json()["id"].clone()), (200, json!("tiny-hf")));
    assert!(m.headers.to_ascii_lowercase().contains("access-control-allow-origin: http://ui.example"));
    let missing = req(&s.addr, "GET", "/v1/models/other", "", None);
    assert_eq!(missing.status, 404);
    assert!(missing.body.contains("`other`"), "{}", missing.body);
    // No max_tokens: the server's default (3) bounds the completion.
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "temperature": 0});
    let r = post(&s.addr, "/v1/chat/completions", &body).json();
    assert_eq!(r["usage"]["completion_tokens"], 3, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length");
}

/// One log line per request: a generation's when it ends (tokens, TTFT, tok/s), every other
/// request's (and every error's) with its status; `--quiet` turns them off.
#[test]
fn requests_are_logged_on_stderr() {
    let log = std::env::temp_dir().join(format!("lily-serve-log-{}.txt", std::process::id()));
    {
        let s = start_with_stderr(&fixture(), &[], Stdio::from(std::fs::File::create(&log).unwrap()));
        let body = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0});
        assert_eq!(post(&s.addr, "/v1/chat/completions", &body).status, 200);
        assert_eq!(req(&s.addr, "GET", "/nope", "", None).status, 404);
        assert_eq!(post(&s.addr, "/v1/chat/completions", &json!({"messages": []})).status, 400);
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let gen = text.lines().find(|l| l.contains("POST /v1/chat/completions 200")).unwrap_or_else(|| panic!("{text}"));
    for part in ["prompt", "completion 4 tokens", "ttft", "tok/s", "finish length"] {
        assert!(gen.contains(part), "{part} missing from {gen}");
    }
    assert!(text.contains("GET /nope 404"), "{text}");
    assert!(text.contains("POST /v1/chat/completions 400"), "{text}");
    {
        let s = start_with_stderr(&fixture(), &["--quiet"], Stdio::from(std::fs::File::create(&log).unwrap()));
        assert_eq!(req(&s.addr, "GET", "/nope", "", None).status, 404);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(!std::fs::read_to_string(&log).unwrap().contains("/nope"));
    std::fs::remove_file(&log).ok();
}

#[test]
fn concurrent_requests_are_batched_and_each_equals_itself_alone() {
    // 6 requests, 4 slots: 4 decode together, 2 wait and join as slots free; prompts of
    // different lengths prefilled 8 tokens per step while the others decode.
    let s = start(&fixture(), &["--max-num-seqs", "4", "--max-prefill-tokens", "8", "--prefix-cache-mb", "0"]);
    let bodies: Vec<Value> = (0..6)
        .map(|i| {
            let words = ["alpha", "beta gamma", "delta epsilon zeta eta", "theta", "iota kappa lambda", "mu nu"];
            let mut b = json!({"prompt": format!("request {i}: {}", words[i].repeat(i + 1)), "max_tokens": 16 + i,
                "ignore_eos": true, "logprobs": 1});
            if i % 2 == 1 {
                b["temperature"] = json!(0.8);
                b["seed"] = json!(11 + i);
            } else {
                b["temperature"] = json!(0);
            }
            b
        })
        .collect();
    let handles: Vec<_> = bodies
        .iter()
        .map(|b| {
            let (addr, b) = (s.addr.clone(), b.clone());
            std::thread::spawn(move || post(&addr, "/v1/completions", &b).json())
        })
        .collect();
    let together: Vec<Value> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let m = req(&s.addr, "GET", "/metrics", "", None).body;
    let batches = |le: &str| -> u64 {
        let key = format!("lily_batch_size_bucket{{le=\"{le}\"}} ");
        m.lines().find_map(|l| l.strip_prefix(&key)).unwrap().parse().unwrap()
    };
    assert!(batches("+Inf") > batches("1"), "some passes ran more than one sequence:\n{m}");
    assert!(m.contains("lily_sequence_slots 4"), "{m}");
    // A slot's pages go back after its client has the answer (the scheduler saves the state to
    // the prefix cache first), so the last pages may still be held for a moment: wait for the
    // server to settle (at most 10 s) before asserting that every page came back.
    let mut h = req(&s.addr, "GET", "/health", "", None).json();
    for _ in 0..200 {
        if h["kv_pages_used"] == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        h = req(&s.addr, "GET", "/health", "", None).json();
    }
    assert_eq!(h["slots"], 4);
    assert_eq!(h["kv_pages_used"], 0);
    // Each request alone, one after another, on the same server.
    for (b, t) in bodies.iter().zip(&together) {
        let alone = post(&s.addr, "/v1/completions", b).json();
        assert_eq!(t["choices"][0]["text"], alone["choices"][0]["text"], "{b}");
        assert_eq!(t["usage"]["completion_tokens"], b["max_tokens"], "ignore_eos generates max_tokens");
        let toks = |v: &Value| v["choices"][0]["logprobs"]["tokens"].clone();
        assert_eq!(toks(t), toks(&alone), "{b}");
    }
}
