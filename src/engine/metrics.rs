//! Server counters, rendered in the Prometheus text exposition format at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

const TTFT_BUCKETS: [f64; 12] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Upper bounds of the batch-size histogram (sequences per forward pass).
const BATCH_BUCKETS: [u64; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

#[derive(Default)]
struct Timing {
    prefill_tokens: u64,
    prefill_secs: f64,
    decode_tokens: u64,
    decode_secs: f64,
    last_prefill_tps: f64,
    last_decode_tps: f64,
    ttft_counts: [u64; TTFT_BUCKETS.len()],
    ttft_sum: f64,
    ttft_count: u64,
    batch_counts: [u64; BATCH_BUCKETS.len()],
    batch_sum: u64,
    batch_count: u64,
    /// Scheduler rounds that ran a pass: their whole time, and the part inside the pass.
    round_secs: f64,
    forward_secs: f64,
}

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    timing: Mutex<Timing>,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prefix_misses: AtomicU64,
    pub cache_bytes: AtomicU64,
    pub cache_entries: AtomicU64,
    /// Requests waiting for a sequence slot (in the channel or the scheduler's queue).
    pub queue_depth: AtomicI64,
    /// Sequences in slots (prefilling or decoding).
    pub running: AtomicI64,
    /// Sequence slots (`--max-num-seqs`).
    pub slots: AtomicU64,
    pub kv_pages_used: AtomicU64,
    pub kv_pages_total: AtomicU64,
    pub kv_page_tokens: AtomicU64,
    pub cancelled: AtomicU64,
    pub rejected_busy: AtomicU64,
}

impl Metrics {
    pub fn request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_insert(0) += 1;
        }
    }

    pub fn ttft(&self, secs: f64) {
        if let Ok(mut t) = self.timing.lock() {
            for (i, b) in TTFT_BUCKETS.iter().enumerate() {
                if secs <= *b {
                    t.ttft_counts[i] += 1;
                }
            }
            t.ttft_sum += secs;
            t.ttft_count += 1;
        }
    }

    /// One forward pass over `n` sequences.
    pub fn batch(&self, n: usize) {
        if let Ok(mut t) = self.timing.lock() {
            for (i, b) in BATCH_BUCKETS.iter().enumerate() {
                if n as u64 <= *b {
                    t.batch_counts[i] += 1;
                }
            }
            t.batch_sum += n as u64;
            t.batch_count += 1;
        }
    }

    /// One scheduler round that ran a forward pass: `round` seconds in all, `forward` of them
    /// in the backend's pass (the rest is the host's: admitting, picking, detokenizing, sending).
    pub fn round(&self, round: f64, forward: f64) {
        if let Ok(mut t) = self.timing.lock() {
            t.round_secs += round;
            t.forward_secs += forward;
        }
    }

    pub fn prefill(&self, tokens: usize, secs: f64) {
        if let Ok(mut t) = self.timing.lock() {
            t.prefill_tokens += tokens as u64;
            t.prefill_secs += secs;
            if tokens > 0 {
                t.last_prefill_tps = tokens as f64 / secs.max(1e-9);
            }
        }
    }

    /// `tokens` decode steps (forward passes of one token) in `secs`.
    pub fn decode(&self, tokens: usize, secs: f64) {
        if let Ok(mut t) = self.timing.lock() {
            t.decode_tokens += tokens as u64;
            t.decode_secs += secs;
            if tokens > 0 {
                t.last_decode_tps = tokens as f64 / secs.max(1e-9);
            }
        }
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, lines: Vec<(String, String)>| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in lines {
                let _ = writeln!(s, "{name}{labels} {value}");
            }
        };
        let one = |v: String| vec![(String::new(), v)];
        let reqs: Vec<(String, String)> = match self.requests.lock() {
            Ok(m) => {
                m.iter().map(|((e, st), n)| (format!("{{endpoint=\"{e}\",status=\"{st}\"}}"), n.to_string())).collect()
            }
            Err(_) => Vec::new(),
        };
        metric("lily_requests_total", "counter", "HTTP requests by endpoint and status code.", reqs);
        let c = |a: &AtomicU64| one(a.load(Relaxed).to_string());
        metric("lily_prompt_tokens_total", "counter", "Prompt tokens of accepted generations.", c(&self.prompt_tokens));
        metric("lily_completion_tokens_total", "counter", "Generated tokens.", c(&self.completion_tokens));
        metric(
            "lily_prefix_cache_hits_total",
            "counter",
            "Generations that resumed from a prefix-cache snapshot.",
            c(&self.prefix_hits),
        );
        metric(
            "lily_prefix_cache_misses_total",
            "counter",
            "Generations that prefilled from the start.",
            c(&self.prefix_misses),
        );
        metric(
            "lily_prefix_cache_cached_tokens_total",
            "counter",
            "Prompt tokens reused from the prefix cache.",
            c(&self.cached_tokens),
        );
        metric("lily_prefix_cache_bytes", "gauge", "Bytes of saved session state.", c(&self.cache_bytes));
        metric("lily_prefix_cache_entries", "gauge", "Saved session snapshots.", c(&self.cache_entries));
        metric(
            "lily_queue_depth",
            "gauge",
            "Requests waiting for a sequence slot.",
            one(self.queue_depth.load(Relaxed).to_string()),
        );
        metric(
            "lily_requests_running",
            "gauge",
            "Sequences in slots now (prefilling or decoding).",
            one(self.running.load(Relaxed).to_string()),
        );
        let g = |a: &AtomicU64| one(a.load(Relaxed).to_string());
        metric("lily_sequence_slots", "gauge", "Sequence slots (--max-num-seqs).", g(&self.slots));
        metric("lily_kv_pages_used", "gauge", "KV-cache pages reserved by running sequences.", g(&self.kv_pages_used));
        let free = self.kv_pages_total.load(Relaxed).saturating_sub(self.kv_pages_used.load(Relaxed));
        metric("lily_kv_pages_free", "gauge", "KV-cache pages free.", one(free.to_string()));
        metric("lily_kv_page_tokens", "gauge", "Positions per KV-cache page.", g(&self.kv_page_tokens));
        metric(
            "lily_requests_cancelled_total",
            "counter",
            "Generations stopped by a client disconnect.",
            c(&self.cancelled),
        );
        metric(
            "lily_requests_rejected_total",
            "counter",
            "Requests refused with 503 (queue full).",
            c(&self.rejected_busy),
        );
        let t = match self.timing.lock() {
            Ok(t) => t,
            Err(_) => return s,
        };
        let f = |v: f64| one(format!("{v}"));
        metric(
            "lily_prefill_tokens_total",
            "counter",
            "Prompt tokens computed (not from the cache).",
            one(t.prefill_tokens.to_string()),
        );
        metric("lily_prefill_seconds_total", "counter", "Time spent in prefill.", f(t.prefill_secs));
        metric("lily_decode_tokens_total", "counter", "Decode steps run.", one(t.decode_tokens.to_string()));
        metric("lily_decode_seconds_total", "counter", "Time spent in decode.", f(t.decode_secs));
        metric(
            "lily_prefill_tokens_per_second",
            "gauge",
            "Prefill throughput of the last request.",
            f(t.last_prefill_tps),
        );
        metric(
            "lily_decode_tokens_per_second",
            "gauge",
            "Decode throughput of the last request.",
            f(t.last_decode_tps),
        );
        let mut h: Vec<(String, String)> = TTFT_BUCKETS
            .iter()
            .zip(t.ttft_counts.iter())
            .map(|(b, n)| (format!("_bucket{{le=\"{b}\"}}"), n.to_string()))
            .collect();
        h.push(("_bucket{le=\"+Inf\"}".into(), t.ttft_count.to_string()));
        h.push(("_sum".into(), format!("{}", t.ttft_sum)));
        h.push(("_count".into(), t.ttft_count.to_string()));
        metric("lily_time_to_first_token_seconds", "histogram", "From arrival to the first generated token.", h);
        let mut h: Vec<(String, String)> = BATCH_BUCKETS
            .iter()
            .zip(t.batch_counts.iter())
            .map(|(b, n)| (format!("_bucket{{le=\"{b}\"}}"), n.to_string()))
            .collect();
        h.push(("_bucket{le=\"+Inf\"}".into(), t.batch_count.to_string()));
        h.push(("_sum".into(), t.batch_sum.to_string()));
        h.push(("_count".into(), t.batch_count.to_string()));
        metric("lily_batch_size", "histogram", "Sequences per forward pass.", h);
        metric(
            "lily_round_seconds_total",
            "counter",
            "Time in scheduler rounds that ran a forward pass (lily_batch_size_count of them).",
            f(t.round_secs),
        );
        metric(
            "lily_forward_seconds_total",
            "counter",
            "The part of those rounds inside the backend's forward pass; the rest is host work.",
            f(t.forward_secs),
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.request("/v1/chat/completions", 200);
        m.ttft(0.2);
        m.prefill(10, 0.5);
        m.batch(3);
        m.batch(1);
        m.round(0.5, 0.25);
        m.round(0.25, 0.125);
        let s = m.render();
        assert!(s.contains("lily_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1"));
        assert!(s.contains("lily_time_to_first_token_seconds_bucket{le=\"0.25\"} 1"));
        assert!(s.contains("lily_time_to_first_token_seconds_bucket{le=\"0.1\"} 0"));
        assert!(s.contains("lily_prefill_tokens_per_second 20"));
        assert!(s.contains("# TYPE lily_queue_depth gauge"));
        assert!(s.contains("lily_batch_size_bucket{le=\"2\"} 1"));
        assert!(s.contains("lily_batch_size_bucket{le=\"4\"} 2"));
        assert!(s.contains("lily_batch_size_sum 4"));
        assert!(s.contains("lily_round_seconds_total 0.75"));
        assert!(s.contains("lily_forward_seconds_total 0.375"));
    }
}
