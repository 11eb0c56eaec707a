//! `lily serve`: an OpenAI-compatible HTTP server over any batched backend (`engine::batch`).
//!
//! Layout: `openai` (wire types and validation), `handlers` (chat and completions, streaming),
//! `worker` (bounded queue, the generation thread running the engine's scheduler, streams and
//! cancellation), `parse` (reasoning / tool-call splitting). The continuous-batching scheduler,
//! the prefix cache and the metrics are the engine's (`crate::engine`).

pub mod handlers;
mod head;
pub mod openai;
pub mod parse;
pub mod toolcall;
pub mod worker;

use crate::engine::batch::Batched;
use crate::engine::metrics::Metrics;
use crate::tokenizer::Tokenizer;
use anyhow::{Context, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use openai::ApiError;
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Sampling defaults for fields a request leaves out (the checkpoint's generation_config.json).
#[derive(Clone, Debug)]
pub struct Defaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
}

impl Default for Defaults {
    /// OpenAI's: temperature 1, no truncation.
    fn default() -> Self {
        Defaults { temperature: 1.0, top_p: 1.0, top_k: 0, min_p: 0.0 }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub bind: String,
    pub model_id: String,
    /// Prompt plus completion tokens per request.
    pub max_seq: usize,
    pub api_key: Option<String>,
    /// Requests that may wait while one generates; more get 503.
    pub queue_size: usize,
    pub max_body_bytes: usize,
    /// A client has this long to send its request head, and then its body (slow-client guard).
    pub read_timeout: std::time::Duration,
    pub prefix_cache_bytes: usize,
    /// Prompt tokens per engine step over all prefilling sequences.
    pub max_prefill_tokens: usize,
    /// KV-cache positions over all running sequences (admission budget).
    pub kv_budget_tokens: usize,
    pub defaults: Defaults,
    /// Test hook (`LILY_TEST_SCRIPTS`): (trigger, output) pairs; a request whose last message
    /// contains `trigger` gets `output` as its generated text.
    pub scripts: Vec<(String, String)>,
    /// Browser origins allowed by CORS (`*` for any); empty: no CORS headers.
    pub allowed_origins: Vec<String>,
    /// Completion tokens for a request that names no `max_tokens` (None: the rest of the context).
    pub max_tokens_default: Option<usize>,
    /// One log line per request on stderr.
    pub log_requests: bool,
}

pub struct App {
    pub cfg: Config,
    pub tok: Arc<Tokenizer>,
    pub queue: worker::Queue,
    pub metrics: Arc<Metrics>,
    pub started: u64,
    /// The model's logit count (constrained decoding masks that many).
    pub vocab_size: usize,
    /// Built on the first constrained request (a token trie over the vocabulary, ~1 s).
    grammars: std::sync::OnceLock<Result<Arc<crate::constrain::Grammars>, String>>,
    counter: AtomicU64,
}

impl App {
    /// llguidance's view of this server's tokenizer, built once.
    pub fn grammars(&self) -> Result<Arc<crate::constrain::Grammars>, ApiError> {
        self.grammars
            .get_or_init(|| {
                let bytes = self.tok.json_bytes().map_err(|e| format!("{e:#}"))?;
                crate::constrain::Grammars::new(&bytes, self.vocab_size, &self.tok.eos_ids)
                    .map(Arc::new)
                    .map_err(|e| format!("{e:#}"))
            })
            .clone()
            .map_err(|e| ApiError::new(500, "server_error", None, e))
    }

    /// A process-unique pseudo-random value (ids, default seeds).
    pub fn unique(&self) -> u64 {
        let n = self.counter.fetch_add(1, Relaxed);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        crate::sampling::Rng::new(t ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)).next_u64()
    }
}

pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A JSON body with its content type.
pub fn json_response(status: StatusCode, v: &serde_json::Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

pub fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = json_response(status, &e.body());
    if e.status == 503 {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// Builds the router (exposed for tests).
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model_by_id))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// The CORS headers for a request from `origin`, when it is allowed.
fn cors(app: &App, origin: Option<&HeaderValue>, r: &mut Response) {
    let Some(o) = origin.and_then(|o| o.to_str().ok()) else { return };
    let ok = app.cfg.allowed_origins.iter().any(|a| a == "*" || a.eq_ignore_ascii_case(o));
    if ok {
        let h = r.headers_mut();
        if let Ok(v) = HeaderValue::from_str(o) {
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        }
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static("Retry-After"));
    }
}

/// Authentication (everything but /health when an API key is set), CORS, request counting and
/// the request log line.
async fn guard(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let origin = req.headers().get(header::ORIGIN).cloned();
    let t0 = std::time::Instant::now();
    // A CORS preflight from an allowed origin: no authentication, no body.
    if method == axum::http::Method::OPTIONS && origin.is_some() && !app.cfg.allowed_origins.is_empty() {
        let mut r = StatusCode::NO_CONTENT.into_response();
        cors(&app, origin.as_ref(), &mut r);
        if r.headers().contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN) {
            let h = r.headers_mut();
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
            let asked = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
            h.insert(
                header::ACCESS_CONTROL_ALLOW_HEADERS,
                asked.unwrap_or(HeaderValue::from_static("authorization, content-type")),
            );
            h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
            return r;
        }
        return error_response(&ApiError::new(
            403,
            "invalid_request_error",
            None,
            "origin not allowed (--allowed-origins)",
        ));
    }
    let endpoint = match path.as_str() {
        "/v1/chat/completions" | "/v1/completions" | "/v1/models" | "/health" | "/metrics" => path.as_str(),
        p if p.starts_with("/v1/models/") => "/v1/models",
        _ => "other",
    };
    let resp = match &app.cfg.api_key {
        Some(key) if path != "/health" => {
            let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_token);
            if given.is_some_and(|g| constant_time_eq(g.trim().as_bytes(), key.as_bytes())) {
                next.run(req).await
            } else {
                let mut r = error_response(&ApiError::new(
                    401,
                    "invalid_request_error",
                    Some("invalid_api_key"),
                    "missing or invalid API key: send `Authorization: Bearer KEY`",
                ));
                r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                r
            }
        }
        _ => next.run(req).await,
    };
    let mut resp = resp;
    cors(&app, origin.as_ref(), &mut resp);
    app.metrics.request(endpoint, resp.status().as_u16());
    // A generation that was accepted is logged by the worker when it ends (tokens, TTFT, tok/s).
    let generation = matches!(path.as_str(), "/v1/chat/completions" | "/v1/completions") && resp.status().is_success();
    if app.cfg.log_requests && !generation {
        tracing::info!("{method} {path} {} | {:.1} ms", resp.status().as_u16(), t0.elapsed().as_secs_f64() * 1e3);
    }
    resp
}

/// The credentials of an `Authorization: Bearer TOKEN` header; the scheme name is
/// case-insensitive (RFC 9110 §11.1).
fn bearer_token(v: &str) -> Option<&str> {
    let (scheme, rest) = v.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
}

/// Compares without an early exit on the first differing byte (the key's length is not secret).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let v = json!({
        "status": "ok",
        "queue_depth": app.metrics.queue_depth.load(Relaxed),
        "running": app.metrics.running.load(Relaxed),
        "slots": app.metrics.slots.load(Relaxed),
        "kv_pages_used": app.metrics.kv_pages_used.load(Relaxed),
        "kv_pages_total": app.metrics.kv_pages_total.load(Relaxed),
        "kv_page_tokens": app.metrics.kv_page_tokens.load(Relaxed),
    });
    json_response(StatusCode::OK, &v)
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let v = json!({"object": "list", "data": [{
        "id": app.cfg.model_id, "object": "model", "created": app.started, "owned_by": "lily",
        "max_model_len": app.cfg.max_seq,
    }]});
    json_response(StatusCode::OK, &v)
}

/// `GET /v1/models/{id}`: this server's model, or a 404 naming the id.
async fn model_by_id(State(app): State<Arc<App>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if id != app.cfg.model_id {
        return error_response(&ApiError::new(
            404,
            "invalid_request_error",
            Some("model_not_found"),
            format!("The model `{id}` does not exist (this server serves `{}`)", app.cfg.model_id),
        ));
    }
    let v = json!({"id": app.cfg.model_id, "object": "model", "created": app.started, "owned_by": "lily",
        "max_model_len": app.cfg.max_seq});
    json_response(StatusCode::OK, &v)
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.metrics.render()).into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    let e = ApiError::new(
        405,
        "invalid_request_error",
        Some("method_not_allowed"),
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    );
    error_response(&e)
}

async fn not_found(req: Request) -> Response {
    let e = ApiError::new(
        404,
        "invalid_request_error",
        Some("not_found"),
        format!("no route for {} {}", req.method(), req.uri().path()),
    );
    error_response(&e)
}

/// Positions per KV-cache page (vLLM's default block size).
pub const PAGE_TOKENS: usize = crate::state::KV_PAGE_ROWS;

/// Runs the server until Ctrl-C / SIGTERM (open streams get 5 s to finish). Prints
/// `listening on http://ADDR` on stdout once bound.
pub fn serve(cfg: Config, tok: Tokenizer, backend: Box<dyn Batched>) -> Result<()> {
    if cfg.max_seq < 2 {
        anyhow::bail!("--max-seq must be at least 2");
    }
    let tok = Arc::new(tok);
    let metrics = Arc::new(Metrics::default());
    let vocab_size = backend.vocab_size();
    let limits = crate::engine::scheduler::Limits {
        max_prefill_tokens: cfg.max_prefill_tokens,
        kv_budget_tokens: cfg.kv_budget_tokens,
        page_tokens: PAGE_TOKENS,
        prefix_cache_bytes: cfg.prefix_cache_bytes,
    };
    let queue = worker::start(backend, limits, tok.clone(), metrics.clone(), cfg.queue_size)?;
    let app = Arc::new(App {
        cfg,
        tok,
        queue,
        metrics,
        started: now_secs(),
        vocab_size,
        grammars: std::sync::OnceLock::new(),
        counter: AtomicU64::new(0),
    });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(&app.cfg.bind).await.with_context(|| format!("binding {}", app.cfg.bind))?;
        let addr = listener.local_addr()?;
        println!("lily serve: listening on http://{addr}");
        use std::io::Write;
        std::io::stdout().flush().ok();
        let timeout = app.cfg.read_timeout;
        accept_loop(listener, router(app), timeout).await;
        Ok::<(), anyhow::Error>(())
    })?;
    // Generation in flight may hold the worker; do not wait for it.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    Ok(())
}

/// HTTP/1.1 connections (keep-alive) until a shutdown signal. hyper drops a handler whose client
/// has gone, which is what cancels a queued or running generation.
async fn accept_loop(listener: tokio::net::TcpListener, router: Router, read_timeout: std::time::Duration) {
    let mut stop = std::pin::pin!(shutdown());
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    eprintln!("lily serve: accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => return,
        };
        let svc = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let mut stream = stream;
            // The first head is checked here, so that what hyper would refuse without a body
            // gets an error object (head.rs).
            let first = match head::read_first(&mut stream, read_timeout).await {
                head::First::Head(bytes) => bytes,
                head::First::Refused(r) => return head::refuse(stream, &r).await,
                head::First::Gone => return,
            };
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(read_timeout);
            let io = hyper_util::rt::TokioIo::new(head::Replay::new(first, stream));
            let _ = b.serve_connection(io, svc).await;
        });
    }
}

async fn shutdown() {
    signal().await;
    eprintln!("lily serve: shutting down");
    // In-flight responses get a moment to finish; a long generation does not hold the exit.
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(5));
        std::process::exit(0);
    });
}

async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return ctrl_c.await,
        };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await;
}

#[cfg(test)]
mod auth_tests {
    #[test]
    fn bearer_scheme_is_case_insensitive() {
        for h in ["Bearer k", "bearer k", "BEARER  k ", " BeArEr k"] {
            assert_eq!(super::bearer_token(h), Some("k"), "{h:?}");
        }
        for h in ["Basic k", "Bearerk", "k", ""] {
            assert_eq!(super::bearer_token(h), None, "{h:?}");
        }
        assert!(super::constant_time_eq(b"abc", b"abc") && !super::constant_time_eq(b"abc", b"abd"));
        assert!(!super::constant_time_eq(b"abc", b"ab"));
    }
}
