#!/usr/bin/env bash
# Starts `lily serve`, runs scripts/load_test.py's throughput mix at each client count (every
# client sends REQS_PER_CLIENT streamed greedy completions of MAX_TOKENS tokens) and prints one
# table row per count, then stops the server. Works on either backend:
#   LILY=target/release/lily ARGS="--model synthetic:dense-small" CLIENTS="1 8" bash scripts/serve_load.sh
#   LILY=.gpu/x/bin/lily ARGS="--device cuda --model synthetic:qwen3.6-35b-a3b" CLIENTS="1 16 64" bash scripts/serve_load.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LILY=${LILY:-target/release/lily}
PORT=${PORT:-8765}
MAX_TOKENS=${MAX_TOKENS:-64}
REQS_PER_CLIENT=${REQS_PER_CLIENT:-2}
log=$(mktemp)
# shellcheck disable=SC2086
"$LILY" serve $ARGS --bind "127.0.0.1:$PORT" --quiet >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
  if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; then
    break
  fi
  if ! kill -0 $pid 2>/dev/null; then
    echo "lily serve exited:" >&2
    cat "$log" >&2
    exit 1
  fi
  sleep 0.5
done
grep "lily serve:" "$log" || true
# The server's rounds (GET /metrics): passes run, mean sequences per pass, and per round the
# milliseconds inside the forward pass and on the host around it (admitting, picking,
# detokenizing, streaming), as differences over each client count's run.
rounds() {
  python3 -c "
import urllib.request
m = {}
for line in urllib.request.urlopen('http://127.0.0.1:$PORT/metrics', timeout=5).read().decode().splitlines():
    if line and not line.startswith('#'):
        k, v = line.rsplit(' ', 1)
        m[k] = float(v)
print(m.get('lily_batch_size_count', 0), m.get('lily_batch_size_sum', 0), m.get('lily_round_seconds_total', 0), m.get('lily_forward_seconds_total', 0))"
}
echo "| clients | requests | generated tok/s (total) | TTFT ms p50 / p99 | ITL ms p50 / p99 | passes | rows/pass | forward / host ms per pass |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
for c in ${CLIENTS:-1 8}; do
  before=$(rounds)
  r=$(python3 scripts/load_test.py --url "http://127.0.0.1:$PORT" --mix throughput --clients "$c" \
    --requests $((c * REQS_PER_CLIENT)) --max-tokens "$MAX_TOKENS")
  after=$(rounds)
  python3 -c '
import json, sys
r = json.loads(sys.argv[1])
b, a = [list(map(float, x.split())) for x in sys.argv[2:4]]
n, rows, rs, fs = (a[i] - b[i] for i in range(4))
t, i = r["ttft_ms_p50_p99"], r["itl_ms_p50_p99"]
per = lambda v: "{:.2f}".format(1e3 * v / n) if n else "-"
print("| {} | {}/{} | {} | {} / {} | {} / {} | {:.0f} | {:.1f} | {} / {} |".format(
    r["clients"], r["status"].get("200", 0), r["requests"], r["generated_tokens_per_s"], t[0], t[1], i[0], i[1],
    n, rows / n if n else 0, per(fs), per(rs - fs)))' "$r" "$before" "$after"
done
