#!/usr/bin/env bash
# GPU check and benchmark for the CUDA backend, in two halves:
#
#   scripts/gpu.sh            here (no GPU needed): release build of `lily` and of the CUDA test
#                             executables, stripped and packed with the Qwen3.6 tokenizer into
#                             .gpu/bundle.tar.gz (git-ignored), then prints the device command.
#   scripts/gpu.sh device     on the GPU machine (run from the repository root): unpacks the
#                             bundle, runs the GPU tests, then `lily bench --device cuda` on the
#                             full-size synthetic Qwen3.6-35B-A3B and prints a short table last.
#                             Logs go to $OUT (or .gpu/out) when set.
set -euo pipefail
cd "$(dirname "$0")/.."

TESTS="cuda_compile cuda_kernels cuda_prefill cuda_model"

if [ "${1:-build}" = build ]; then
  cargo build --release
  rm -rf .gpu/stage && mkdir -p .gpu/stage/bin .gpu/stage/tok
  args=()
  for t in $TESTS; do args+=(--test "$t"); done
  cargo test --release --no-run --message-format=json "${args[@]}" \
    | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], ".gpu/stage/bin/" + m["target"]["name"])
'
  cp target/release/lily .gpu/stage/bin/lily
  strip .gpu/stage/bin/* 2>/dev/null || true
  tok=../shared/data/qwen3.6-tokenizer
  if [ -f $tok/tokenizer.json ]; then cp $tok/tokenizer.json $tok/tokenizer_config.json .gpu/stage/tok/; fi
  tar -C .gpu/stage -czf .gpu/bundle.tar.gz .
  rm -rf .gpu/stage
  ls -la .gpu/bundle.tar.gz
  echo
  echo "device command (run tool, carry [\".gpu\"]):"
  echo "  bash scripts/gpu.sh device"
  exit 0
fi

# ---- on the device ----
OUTDIR=${OUT:-.gpu/out}
mkdir -p "$OUTDIR" .gpu/x
tar -C .gpu/x -xzf .gpu/bundle.tar.gz
export LILY_REPO=$PWD
export LILY_TOKENIZER_DIR=$PWD/.gpu/x/tok
export LILY_KERNEL_CACHE=$PWD/.gpu/kcache
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/usr/local/cuda/targets/x86_64-linux/lib
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUTDIR/gpu.txt"
status=0
[ -n "${SKIP_TESTS:-}" ] && TESTS=""
for t in $TESTS; do
  echo "== $t"
  if ! .gpu/x/bin/$t --test-threads=1 --nocapture >"$OUTDIR/$t.log" 2>&1; then status=1; fi
  grep -E "^test |test result|SKIPPED|worst|panicked|nmse .*e-0[0-8]" "$OUTDIR/$t.log" | head -60 || true
done
if [ -n "${PROFILE_LAYERS:-}" ]; then
  PC=${PROFILE_CONTEXT:-256}
  echo "== per-kernel profile (LILY_CUDA_PROFILE=1, $PROFILE_LAYERS layers, context $PC, 16 decode steps)"
  LILY_CUDA_PROFILE=1 timeout 180 .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
    --layers "$PROFILE_LAYERS" --contexts "$PC" --warmup 0 --decode-steps 16 >"$OUTDIR/profile.txt" 2>&1 || status=1
  grep -E "^\|" "$OUTDIR/profile.txt" | head -40 || true
fi
echo "== bench"
BENCH_CONTEXTS=${BENCH_CONTEXTS:-256,4096}
timeout "${BENCH_TIMEOUT:-420}" .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
  --contexts "$BENCH_CONTEXTS" 2>&1 | tee "$OUTDIR/bench.txt" || status=1
echo "== summary (tests exit status $status)"
grep -h "test result" "$OUTDIR"/cuda_*.log || true
tail -n 6 "$OUTDIR/bench.txt"
exit $status
