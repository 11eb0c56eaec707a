#!/usr/bin/env python3
"""Drive a running `lily serve` (or any OpenAI-compatible server) with N concurrent streaming
clients and report what a user of the server sees.

Each client sends `--requests` (default 1) streamed /v1/completions requests one after another,
with a prompt of about `--prompt-words` words (distinct per request) and `max_tokens`
`--max-tokens`, greedy, `ignore_eos` so that every request generates exactly that many tokens.
Reported: total generated tokens over the wall time of the whole run (tok/s), time to first
token (TTFT) and inter-token latency (ITL, the gaps between a stream's chunks) at p50/p99, and
per-request decode tok/s. Standard library only.

    python3 scripts/loadtest.py --url http://127.0.0.1:8000 --concurrency 8 --max-tokens 64
    python3 scripts/loadtest.py --url ... --concurrency 1,8 --json   # one row per level
"""

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls read old maps by candle light".split()


def prompt_text(i, words):
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))


def one_request(url, body):
    """Streams one completion; returns (ttft, gaps, tokens, total_secs)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, last, gaps, tokens = None, None, [], None
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            raise RuntimeError(f"stream error: {ev['error']}")
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if ev.get("choices") and ev["choices"][0].get("text"):
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    total = time.perf_counter() - t0
    conn.close()
    return ttft or total, gaps, tokens or 0, total


def pct(v, p):
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


def run_level(a, n):
    results, errors, lock = [], [], threading.Lock()

    def client(c):
        for r in range(a.requests):
            body = {
                "prompt": prompt_text(c * 1000 + r, a.prompt_words),
                "max_tokens": a.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if a.model:
                body["model"] = a.model
            try:
                res = one_request(a.url, body)
                with lock:
                    results.append(res)
            except Exception as e:  # reported, and the run fails
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    per_req = [(r[2] - 1) / (r[3] - r[0]) for r in results if r[2] > 1 and r[3] > r[0]]
    return {
        "concurrency": n,
        "requests": len(results),
        "errors": errors,
        "completion_tokens": tokens,
        "wall_s": wall,
        "total_tok_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": 1e3 * pct(ttfts, 50),
        "ttft_p99_ms": 1e3 * pct(ttfts, 99),
        "itl_p50_ms": 1e3 * pct(gaps, 50),
        "itl_p99_ms": 1e3 * pct(gaps, 99),
        "per_request_decode_tok_per_s": sum(per_req) / len(per_req) if per_req else 0.0,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", default="8", help="clients at once; comma-separated levels run in turn")
    ap.add_argument("--requests", type=int, default=1, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    if any(n < 1 for n in levels) or a.requests < 1 or a.max_tokens < 1:
        sys.exit("loadtest: --concurrency, --requests and --max-tokens must be positive")
    rows = [run_level(a, n) for n in levels]
    if a.json:
        print(json.dumps(rows))
    else:
        print("| clients | requests | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | per-request decode tok/s |")
        print("|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['concurrency']} | {r['requests']} | {r['total_tok_per_s']:.1f} | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
                f"{r['per_request_decode_tok_per_s']:.1f} |"
            )
    bad = [e for r in rows for e in r["errors"]]
    if bad:
        sys.exit(f"loadtest: {len(bad)} request(s) failed, first: {bad[0]}")


if __name__ == "__main__":
    main()
