//! `POST /v1/chat/completions` and `POST /v1/completions`: validate, render and tokenize, check
//! the context, queue the job, then answer with one JSON object or a server-sent-event stream.

use super::openai::{self, ApiError, GenParams, Prompt};
use super::parse::{self, OutputParser, Piece, ToolCall};
use super::toolcall::ToolSchemas;
use super::worker::{Event, Job, SubmitError, Summary};
use super::{error_response, json_response, now_secs, App};
use crate::constrain::{self, Constraint};
use crate::generate::{FinishReason, GenerateOptions, TokenLogprobs};
use crate::sampling::SamplingParams;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tokio_stream::wrappers::ReceiverStream;

type R<T> = Result<T, ApiError>;

/// Reads the body within the read timeout and the byte limit, and parses it as JSON.
async fn read_json(app: &App, req: Request) -> R<Value> {
    let limit = app.cfg.max_body_bytes;
    let read = axum::body::to_bytes(req.into_body(), limit);
    let bytes = match tokio::time::timeout(app.cfg.read_timeout, read).await {
        Err(_) => {
            return Err(ApiError::new(408, "invalid_request_error", Some("timeout"), "the request body took too long"))
        }
        Ok(Err(e)) if e.to_string().contains("length limit") => {
            return Err(ApiError::new(
                413,
                "invalid_request_error",
                Some("request_too_large"),
                format!("the request body exceeds {limit} bytes"),
            ))
        }
        Ok(Err(e)) => return Err(ApiError::bad(format!("could not read the request body: {e}"))),
        Ok(Ok(b)) => b,
    };
    body_json(&bytes)
}

fn body_json(bytes: &[u8]) -> R<Value> {
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::new(400, "invalid_request_error", Some("invalid_json"), format!("malformed JSON body: {e}"))
    })
}

/// What a prepared request needs beyond the job.
struct Prepared {
    prompt: Vec<u32>,
    boundary: Option<usize>,
    in_think: bool,
    /// Some: the request has tools, whose calls the answer may hold.
    tools: Option<ToolSchemas>,
    script_trigger_text: String,
    constraint: Option<Constraint>,
}

fn context_check(app: &App, n: usize, asked: Option<usize>) -> R<usize> {
    let max = app.cfg.max_seq;
    if n >= max {
        return Err(ApiError::new(
            400,
            "invalid_request_error",
            Some("context_length_exceeded"),
            format!("This model's maximum context length is {max} tokens, but the prompt has {n} tokens. Shorten the prompt."),
        ));
    }
    match asked {
        Some(m) if n + m > max => Err(ApiError {
            param: Some("max_tokens".into()),
            ..ApiError::new(
                400,
                "invalid_request_error",
                Some("context_length_exceeded"),
                format!(
                    "This model's maximum context length is {max} tokens. However, you requested {} tokens ({n} in the prompt, {m} in the completion). Reduce the prompt or the completion length.",
                    n + m
                ),
            )
        }),
        Some(m) => Ok(m),
        None => Ok(app.cfg.max_tokens_default.map_or(max - n, |d| d.min(max - n))),
    }
}

fn job_options(app: &App, p: &GenParams, max_tokens: usize) -> GenerateOptions {
    let d = &app.cfg.defaults;
    let temperature = p.temperature.unwrap_or(d.temperature);
    GenerateOptions {
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_k: p.top_k.unwrap_or(d.top_k),
            top_p: p.top_p.unwrap_or(d.top_p),
            min_p: p.min_p.unwrap_or(d.min_p),
            seed: p.seed.unwrap_or_else(|| app.unique()),
        },
        eos_ids: if p.ignore_eos { Vec::new() } else { app.tok.eos_ids.clone() },
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: p.repetition_penalty,
        logprobs: p.logprobs,
        ..Default::default()
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(500, "server_error", None, format!("{e}"))
}

/// Queues the job; the receiver yields its events.
fn submit(
    app: &App,
    prep: &mut Prepared,
    p: &GenParams,
    max_tokens: usize,
    endpoint: &'static str,
) -> R<UnboundedReceiver<Event>> {
    let script = app
        .cfg
        .scripts
        .iter()
        .find(|(trigger, _)| prep.script_trigger_text.contains(trigger.as_str()))
        .map(|(_, out)| app.tok.encode(out))
        .transpose()
        .map_err(internal)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt: prep.prompt.clone(),
        boundary: prep.boundary,
        opts: GenerateOptions {
            // The repetition penalty counts the prompt's tokens too (vLLM).
            penalty_prompt: if p.repetition_penalty.is_some() { prep.prompt.clone() } else { Vec::new() },
            ..job_options(app, p, max_tokens)
        },
        stop: p.stop.clone(),
        script,
        constraint: prep.constraint.take(),
        events: tx,
        arrived: Instant::now(),
        log: app.cfg.log_requests.then_some(endpoint),
    };
    match app.queue.submit(job) {
        Ok(()) => Ok(rx),
        Err(SubmitError::Full) => {
            app.metrics.rejected_busy.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err(ApiError::new(
                503,
                "server_error",
                Some("server_overloaded"),
                "the server is busy (request queue full); retry later",
            ))
        }
        Err(SubmitError::Closed) => Err(internal("the generation worker has stopped")),
    }
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Eos | FinishReason::Stopped => "stop",
        FinishReason::Length => "length",
    }
}

fn usage(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}

fn token_entry(app: &App, id: u32, lp: f32) -> Value {
    let s = app.tok.decode(&[id]).unwrap_or_default();
    json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
}

/// Chat-format logprob entries.
fn chat_logprobs(app: &App, lps: &[TokenLogprobs]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = token_entry(app, l.token, l.logprob);
            e["top_logprobs"] = Value::Array(l.top.iter().map(|&(t, p)| token_entry(app, t, p)).collect());
            e
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completions logprobs (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
fn legacy_logprobs(app: &App, lps: &[TokenLogprobs], mut offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for l in lps {
        let s = app.tok.decode(&[l.token]).unwrap_or_default();
        offsets.push(offset);
        offset += s.len();
        tokens.push(Value::String(s));
        token_lps.push(json!(l.logprob));
        let mut m = Map::new();
        for &(t, p) in &l.top {
            m.insert(app.tok.decode(&[t]).unwrap_or_default(), json!(p));
        }
        tops.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets})
}

fn new_id(app: &App, prefix: &str) -> String {
    format!("{prefix}-{:016x}", app.unique())
}

fn call_id(app: &App) -> String {
    format!("call_{:016x}", app.unique())
}

fn tool_call_json(app: &App, tc: &ToolCall) -> Value {
    json!({"id": call_id(app), "type": "function", "function": {"name": tc.name, "arguments": tc.arguments()}})
}

/// A tool call as streamed deltas: the id, type and name with empty arguments, then one delta
/// per argument fragment. Joined, the fragments are the non-streamed `arguments`.
fn tool_call_deltas(app: &App, tc: &ToolCall, index: usize) -> Vec<Value> {
    let mut v = vec![json!({"tool_calls": [{"index": index, "id": call_id(app), "type": "function",
        "function": {"name": tc.name, "arguments": ""}}]})];
    for f in tc.fragments() {
        v.push(json!({"tool_calls": [{"index": index, "function": {"arguments": f}}]}));
    }
    v
}

/// Collects a whole generation (non-streaming).
async fn collect(mut rx: UnboundedReceiver<Event>) -> R<(String, Vec<TokenLogprobs>, Summary)> {
    let mut text = String::new();
    let mut lps = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Delta { text: t, logprobs }) => {
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Some(Event::Done(s)) => return Ok((text, lps, s)),
            Some(Event::Error(e)) => return Err(internal(e)),
            None => return Err(internal("generation ended without a result")),
        }
    }
}

fn prepare_chat(app: &App, req: &openai::ChatRequest) -> R<Prepared> {
    let tok = &app.tok;
    let msgs = Value::Array(req.messages.clone());
    let render = |gen_prompt: bool| {
        tok.apply_chat_template(&msgs, req.tools.as_ref(), gen_prompt, &req.template_kwargs)
            .map_err(|e| ApiError::new(400, "invalid_request_error", None, format!("{e:#}")))
    };
    let text = render(true)?;
    let prompt = tok.encode(&text).map_err(internal)?;
    // The conversation without the generation prompt: the next turn starts with it.
    let boundary = match render(false) {
        Ok(base) if text.starts_with(&base) && !base.is_empty() => {
            let b = tok.encode(&base).map_err(internal)?;
            (b.len() < prompt.len() && prompt.starts_with(&b)).then_some(b.len())
        }
        _ => None,
    };
    let last = req.messages.last().and_then(|m| m["content"].as_str()).unwrap_or("").to_string();
    let in_think = parse::prompt_opens_think(&text);
    let constraint = match &req.constraint {
        None => None,
        Some(c) => Some(compile_constraint(app, req, c, in_think)?),
    };
    Ok(Prepared {
        prompt,
        boundary,
        in_think,
        tools: req.tools.as_ref().map(ToolSchemas::from_tools),
        script_trigger_text: last,
        constraint,
    })
}

/// Compiles the request's constraint; a schema llguidance cannot take is a 400 naming the field.
fn compile_constraint(
    app: &App,
    req: &openai::ChatRequest,
    c: &openai::OutputConstraint,
    in_think: bool,
) -> R<Constraint> {
    let g = app.grammars()?;
    let (lark, param) = match c {
        openai::OutputConstraint::Json(schema) => (constrain::json_grammar(schema), "response_format"),
        openai::OutputConstraint::ToolCalls { only, parallel } => {
            let tools = req.tools.as_ref().ok_or_else(|| ApiError::param("tool_choice", "no `tools`"))?;
            let lark = constrain::tool_grammar(&g, tools, only.as_deref(), *parallel, app.tok.tool_format())
                .map_err(|e| ApiError::param("tools", format!("{e:#}")))?;
            (lark, "tools")
        }
    };
    let matcher = g.matcher(&lark).map_err(|e| ApiError::param(param, format!("the schema cannot be used: {e:#}")))?;
    // With thinking on, the answer starts after the reasoning block.
    let think_end = if in_think { app.tok.encode("</think>").map_err(internal)? } else { Vec::new() };
    Ok(Constraint::new(matcher, !in_think, think_end))
}

pub async fn chat(State(app): State<Arc<App>>, req: Request) -> Response {
    match chat_inner(app, req).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

async fn chat_inner(app: Arc<App>, req: Request) -> R<Response> {
    let v = read_json(&app, req).await?;
    let req = openai::parse_chat(&v)?;
    let a = app.clone();
    let (mut prep, req) =
        tokio::task::spawn_blocking(move || prepare_chat(&a, &req).map(|p| (p, req))).await.map_err(internal)??;
    let max_tokens = context_check(&app, prep.prompt.len(), req.params.max_tokens)?;
    let rx = submit(&app, &mut prep, &req.params, max_tokens, "POST /v1/chat/completions")?;
    let id = new_id(&app, "chatcmpl");
    let created = now_secs();
    if req.params.stream {
        return Ok(stream_chat(app, rx, prep, req.params, req.parallel_tool_calls, id, created));
    }
    let (text, lps, summary) = collect(rx).await?;
    let pieces = parse::parse_all(&text, prep.in_think, prep.tools.clone());
    let mut reasoning: Option<String> = None;
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Reasoning(r) => reasoning.get_or_insert_with(String::new).push_str(&r),
            Piece::Content(c) => content.push_str(&c),
            Piece::ToolCall(tc) => {
                if req.parallel_tool_calls || calls.is_empty() {
                    calls.push(tool_call_json(&app, &tc))
                }
            }
        }
    }
    let mut message = json!({"role": "assistant", "content": content});
    if let Some(r) = reasoning {
        message["reasoning_content"] = json!(r);
    }
    let mut finish = finish_str(summary.finish);
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = Value::Array(calls);
        if finish == "stop" {
            finish = "tool_calls";
        }
    }
    let logprobs = if req.params.logprobs.is_some() { chat_logprobs(&app, &lps) } else { Value::Null };
    let v = json!({
        "id": id, "object": "chat.completion", "created": created, "model": app.cfg.model_id,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": usage(&summary),
    });
    Ok(json_response(StatusCode::OK, &v))
}

fn sse(v: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

fn sse_response(rx: mpsc::Receiver<Result<SseEvent, Infallible>>) -> Response {
    Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

/// Forwards worker events to an SSE channel through `f` until the generation is done or the
/// client goes away (the SSE channel closes: dropping the worker receiver cancels the job).
async fn pump(
    mut rx: UnboundedReceiver<Event>,
    out: &mpsc::Sender<Result<SseEvent, Infallible>>,
    mut f: impl FnMut(Event) -> (Vec<Value>, bool),
) -> bool {
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = out.closed() => return false,
        };
        let Some(ev) = ev else {
            let e = internal("generation ended without a result");
            let _ = out.send(sse(&e.body())).await;
            return false;
        };
        let (values, done) = f(ev);
        for v in values {
            if out.send(sse(&v)).await.is_err() {
                return false;
            }
        }
        if done {
            return true;
        }
    }
}

fn stream_chat(
    app: Arc<App>,
    rx: UnboundedReceiver<Event>,
    prep: Prepared,
    p: GenParams,
    parallel_tool_calls: bool,
    id: String,
    created: u64,
) -> Response {
    let (out, out_rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let model = app.cfg.model_id.clone();
        let usage_field = p.include_usage;
        let chunk = |delta: Value, logprobs: Value, finish: Value| {
            let mut c = json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            });
            if usage_field {
                c["usage"] = Value::Null;
            }
            c
        };
        if out.send(sse(&chunk(json!({"role": "assistant", "content": ""}), Value::Null, Value::Null))).await.is_err() {
            return;
        }
        let mut parser = OutputParser::new(prep.in_think, prep.tools.clone());
        let mut ncalls = 0;
        let to_chunks = |pieces: Vec<Piece>, ncalls: &mut usize, lps: &mut Option<Value>| -> Vec<Value> {
            let mut v = Vec::new();
            for piece in pieces {
                let deltas = match piece {
                    Piece::Reasoning(r) => vec![json!({"reasoning_content": r})],
                    Piece::Content(c) => vec![json!({"content": c})],
                    Piece::ToolCall(_) if !parallel_tool_calls && *ncalls > 0 => continue,
                    Piece::ToolCall(tc) => {
                        *ncalls += 1;
                        tool_call_deltas(&app, &tc, *ncalls - 1)
                    }
                };
                for delta in deltas {
                    v.push(chunk(delta, lps.take().unwrap_or(Value::Null), Value::Null));
                }
            }
            if let Some(l) = lps.take() {
                v.push(chunk(json!({}), l, Value::Null));
            }
            v
        };
        let done = pump(rx, &out, |ev| match ev {
            Event::Delta { text, logprobs } => {
                let mut lps = (p.logprobs.is_some() && !logprobs.is_empty()).then(|| chat_logprobs(&app, &logprobs));
                (to_chunks(parser.push(&text), &mut ncalls, &mut lps), false)
            }
            Event::Done(s) => {
                let mut v = to_chunks(parser.finish(), &mut ncalls, &mut None);
                let mut finish = finish_str(s.finish);
                if ncalls > 0 && finish == "stop" {
                    finish = "tool_calls";
                }
                v.push(chunk(json!({}), Value::Null, json!(finish)));
                if usage_field {
                    v.push(json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage(&s)}));
                }
                (v, true)
            }
            Event::Error(e) => (vec![internal(e).body()], true),
        })
        .await;
        if done {
            let _ = out.send(Ok(SseEvent::default().data("[DONE]"))).await;
        }
    });
    sse_response(out_rx)
}

fn prepare_completion(app: &App, req: &openai::CompletionRequest) -> R<Prepared> {
    let (prompt, text) = match &req.prompt {
        Prompt::Text(s) => (app.tok.encode(s).map_err(internal)?, s.clone()),
        Prompt::Tokens(ids) => {
            let v = app.tok.vocab_size().max(1);
            if let Some(t) = ids.iter().find(|&&t| t as usize >= v) {
                return Err(ApiError::param("prompt", format!("token id {t} is out of range (vocabulary of {v})")));
            }
            (ids.clone(), String::new())
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::param("prompt", "the prompt has no tokens"));
    }
    Ok(Prepared { prompt, boundary: None, in_think: false, tools: None, script_trigger_text: text, constraint: None })
}

pub async fn completions(State(app): State<Arc<App>>, req: Request) -> Response {
    match completions_inner(app, req).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

async fn completions_inner(app: Arc<App>, req: Request) -> R<Response> {
    let v = read_json(&app, req).await?;
    let req = openai::parse_completion(&v)?;
    let a = app.clone();
    let (mut prep, req) = tokio::task::spawn_blocking(move || prepare_completion(&a, &req).map(|p| (p, req)))
        .await
        .map_err(internal)??;
    let max_tokens = context_check(&app, prep.prompt.len(), req.params.max_tokens)?;
    let rx = submit(&app, &mut prep, &req.params, max_tokens, "POST /v1/completions")?;
    let id = new_id(&app, "cmpl");
    let created = now_secs();
    let p = req.params;
    if p.stream {
        let (out, out_rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let model = app.cfg.model_id.clone();
            let chunk = |text: &str, logprobs: Value, finish: Value| {
                let mut c = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]});
                if p.include_usage {
                    c["usage"] = Value::Null;
                }
                c
            };
            let mut offset = 0;
            let done = pump(rx, &out, |ev| match ev {
                Event::Delta { text, logprobs } => {
                    let lp = if p.logprobs.is_some() { legacy_logprobs(&app, &logprobs, offset) } else { Value::Null };
                    offset += logprobs.iter().map(|l| app.tok.decode(&[l.token]).map(|s| s.len()).unwrap_or(0)).sum::<usize>();
                    (vec![chunk(&text, lp, Value::Null)], false)
                }
                Event::Done(s) => {
                    let mut v = vec![chunk("", Value::Null, json!(finish_str(s.finish)))];
                    if p.include_usage {
                        v.push(json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": usage(&s)}));
                    }
                    (v, true)
                }
                Event::Error(e) => (vec![internal(e).body()], true),
            })
            .await;
            if done {
                let _ = out.send(Ok(SseEvent::default().data("[DONE]"))).await;
            }
        });
        return Ok(sse_response(out_rx));
    }
    let (text, lps, summary) = collect(rx).await?;
    let logprobs = if p.logprobs.is_some() { legacy_logprobs(&app, &lps, 0) } else { Value::Null };
    let v = json!({
        "id": id, "object": "text_completion", "created": created, "model": app.cfg.model_id,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_str(summary.finish)}],
        "usage": usage(&summary),
    });
    Ok(json_response(StatusCode::OK, &v))
}
