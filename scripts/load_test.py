#!/usr/bin/env python3
"""Load test for `lily serve`: N concurrent clients sending a mix of OpenAI requests.

    python3 scripts/load_test.py --url http://127.0.0.1:8000 --clients 64 --requests 10000 \
        [--pid SERVER_PID] [--api-key KEY] [--disconnect 0.1] [--max-tokens 16] [--json out.json]
    python3 scripts/load_test.py --mix throughput --clients 8 --requests 8 --max-tokens 64

With `--mix throughput` every request is the same kind: a streamed greedy completion of a short
distinct prompt with `ignore_eos`, so each generates exactly `--max-tokens` tokens (counted from
the stream's usage); the report is what batching is judged by (total tok/s, TTFT, ITL).
Otherwise (`--mix hostile`, the default) each client loops until the total number of requests is reached, picking: a streamed chat (a
share of them dropped after the first chunk, to exercise cancellation), a non-streamed chat, a
completion, a malformed or invalid request, or /health. It reports the count of every status,
generated tokens per second in total, time to first token and inter-token latency (p50/p99,
streamed requests), and with --pid the server's resident memory sampled every second.
Standard library only (asyncio streams speaking HTTP/1.1), so it runs wherever Python 3 does.
"""

import argparse
import asyncio
import collections
import json
import random
import statistics
import time
import urllib.parse


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None


class Stats:
    def __init__(self):
        self.status = collections.Counter()
        self.ttft, self.itl = [], []
        self.tokens = 0
        self.errors = collections.Counter()
        self.rss = []
        # Throughput mode counts tokens from each stream's usage, not its chunks.
        self.usage_counted = False


async def request(host, port, method, path, body, headers, stats, stream=False, drop=False):
    """One HTTP/1.1 request on its own connection; returns the status (0 = connection error)."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 30)
    except Exception as e:
        stats.errors[type(e).__name__] += 1
        return 0
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {len(data)}\r\n"
        for k, v in headers.items():
            head += f"{k}: {v}\r\n"
        writer.write(head.encode() + b"\r\n" + data)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 300)
        parts = line.split()
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        while True:  # headers
            h = await asyncio.wait_for(reader.readline(), 300)
            if h in (b"\r\n", b"", b"\n"):
                break
        if stream and status == 200:
            last = None
            while True:
                ln = await asyncio.wait_for(reader.readline(), 300)
                if not ln:
                    break
                if not ln.startswith(b"data: ") or ln.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                try:
                    d = json.loads(ln[6:])
                except ValueError:
                    continue
                if d.get("usage"):
                    stats.tokens += d["usage"].get("completion_tokens", 0)
                c0 = (d.get("choices") or [{}])[0]
                ch = c0.get("delta", {})
                if ch.get("content") or ch.get("reasoning_content") or c0.get("text"):
                    if "usage" not in d and not stats.usage_counted:
                        stats.tokens += 1
                    if last is None:
                        stats.ttft.append(now - t0)
                    else:
                        stats.itl.append(now - last)
                    last = now
                    if drop:
                        break  # the client goes away mid-stream
        else:
            raw = await asyncio.wait_for(reader.read(), 300)
            if status == 200 and raw:
                try:
                    body_start = raw.find(b"{")
                    u = json.loads(raw[body_start:]).get("usage") or {}
                    stats.tokens += u.get("completion_tokens", 0)
                except ValueError:
                    pass
        return status
    except Exception as e:
        stats.errors[type(e).__name__] += 1
        return 0
    finally:
        writer.close()


def pick(rng, args):
    if args.mix == "throughput":
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "river", "stone", "light"]) for _ in range(24))
        body = {"prompt": words, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        return "POST", "/v1/completions", body, True
    msgs = [{"role": "user", "content": rng.choice(["hello", "tell me a story", "count to ten", "why?"])}]
    r = rng.random()
    mt = args.max_tokens
    if r < 0.35:
        return "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": mt, "stream": True, "temperature": 0.7}, True
    if r < 0.55:
        return "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": mt, "temperature": 0}, False
    if r < 0.70:
        return "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": mt}, False
    if r < 0.80:
        return "POST", "/v1/chat/completions", rng.choice([b"{not json", b"[]", json.dumps({"messages": "x"}).encode(),
                                                           json.dumps({"messages": msgs, "temperature": 9}).encode()]), False
    if r < 0.85:
        return "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 10**9}, False
    return "GET", "/health", None, False


async def client(i, host, port, args, stats, counter, headers):
    rng = random.Random(args.seed * 1000 + i)
    while counter[0] < args.requests:
        counter[0] += 1
        method, path, body, stream = pick(rng, args)
        drop = stream and args.mix != "throughput" and rng.random() < args.disconnect
        st = await request(host, port, method, path, body, headers, stats, stream, drop)
        stats.status["dropped-by-client" if drop and st == 200 else st] += 1


async def sampler(pid, stats, done):
    t0 = time.perf_counter()
    while not done.is_set():
        r = rss_mib(pid)
        if r is not None:
            stats.rss.append((round(time.perf_counter() - t0, 1), round(r, 1)))
        try:
            await asyncio.wait_for(done.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of streamed requests dropped mid-stream")
    ap.add_argument("--api-key")
    ap.add_argument("--pid", type=int, help="server pid, to sample its resident memory")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mix", choices=["hostile", "throughput"], default="hostile")
    ap.add_argument("--json", help="write the full report here")
    args = ap.parse_args()
    u = urllib.parse.urlparse(args.url)
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    stats, counter, done = Stats(), [0], asyncio.Event()
    stats.usage_counted = args.mix == "throughput"
    samp = asyncio.create_task(sampler(args.pid, stats, done)) if args.pid else None
    t0 = time.perf_counter()
    await asyncio.gather(*(client(i, u.hostname, u.port or 80, args, stats, counter, headers) for i in range(args.clients)))
    wall = time.perf_counter() - t0
    done.set()
    if samp:
        await samp
    rep = {
        "mix": args.mix,
        "clients": args.clients,
        "requests": sum(stats.status.values()),
        "seconds": round(wall, 1),
        "status": {str(k): v for k, v in sorted(stats.status.items(), key=lambda kv: str(kv[0]))},
        "connection_errors": dict(stats.errors),
        "generated_tokens_per_s": round(stats.tokens / wall, 1),
        "ttft_ms_p50_p99": [round(pct(stats.ttft, 50) * 1e3, 1), round(pct(stats.ttft, 99) * 1e3, 1)],
        "itl_ms_p50_p99": [round(pct(stats.itl, 50) * 1e3, 2), round(pct(stats.itl, 99) * 1e3, 2)],
    }
    if stats.rss:
        vals = [r for _, r in stats.rss]
        rep["rss_mib_first_max_last"] = [vals[0], max(vals), vals[-1]]
        step = max(1, len(stats.rss) // 12)
        rep["rss_mib_over_time"] = stats.rss[::step] + ([stats.rss[-1]] if (len(stats.rss) - 1) % step else [])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    print(json.dumps(rep, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
