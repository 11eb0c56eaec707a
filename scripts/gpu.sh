#!/usr/bin/env bash
# GPU check and benchmark for the CUDA backend, in two halves:
#
#   scripts/gpu.sh            here (no GPU needed): release build of `lily` and of the CUDA test
#                             executables, stripped and packed into
#                             .gpu/bundle.tar.gz (git-ignored), then prints the device command.
#   scripts/gpu.sh device     on the GPU machine (run from the repository root): unpacks the
#                             bundle, runs the GPU tests, then `lily bench --device cuda` on the
#                             full-size synthetic Qwen3.6-35B-A3B and prints a short table last.
#                             Logs go to $OUT (or .gpu/out) when set. Knobs: ONLY_TESTS (test
#                             executables, each optionally :filter or :!skip1,skip2, e.g.
#                             cuda_attention_prefill:wgmma cuda_prefill:!new_kernels), SKIP_TESTS,
#                             BENCH_CONTEXTS, BENCH_BATCH (e.g. 1,4,16,64), BENCH_LONG, LONG_ENV, KV_AB,
#                             ATTN_BENCH, GDN_BENCH, AB_OLD (another build's lily binary: batch-1 A/B),
#                             BATCH_VARIANTS (';'-separated env settings: the batched bench per
#                             setting), ENV_AB (env settings, ';'-separated: batch-1 A/B at
#                             AB_CONTEXTS), ATTN_DEC_BENCH (decode attention kernels alone),
#                             TEST_TIMEOUT (seconds a test executable, default 600),
#                             TEST_ENV (env settings for the test executables, e.g.
#                             LILY_CUDA_SHARED_GROUPED=1), SERVE_CLIENTS (e.g. "1 16 64":
#                             scripts/serve_load.sh, AB_OLD's binary too), PROFILE_LAYERS /
#                             PROFILE_CONTEXT (LILY_CUDA_PROFILE=1: per-op decode table), ABLATE
#                             (kernel names left out, LILY_CUDA_SKIP) / ABLATE_CONTEXT, TIMELINE
#                             (contexts: the decode step's kernel timeline, src/cuda/timeline.rs;
#                             build the bundle with TIMELINE_BUILD=1 to carry its kernels;
#                             KERNEL_ENVS at build time: other env settings that change the
#                             kernel source, e.g. LILY_CUDA_GEMV_I8=0), PSTEP_TRACE (contexts:
#                             the persistent step's per-phase trace and summary), NCU (kernel
#                             names, '|'-separated: ncu's counters and SASS stalls per kernel), ...
set -euo pipefail
cd "$(dirname "$0")/.."

TESTS="cuda_compile cuda_kernels cuda_attention_decode cuda_gdn cuda_prefill cuda_attention_prefill cuda_model cuda_batch cuda_paged"

if [ "${1:-build}" = build ]; then
  cargo build --release
  cargo build --release --example gemv_bench --example attn_bench --example gdn_bench
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
  # The kernels' PTX, compiled here by NVRTC (the CI wheel, when present) into the bundle's
  # kernel cache: the GPU machine then skips NVRTC (~1-2 min of device time per fresh machine);
  # with ptxas (the nvcc wheel) also their sm_90a cubin, which skips the driver's JIT (~1 min).
  NVRTC_DIR="${LILY_NVRTC_DIR:-$HOME/.cache/lily-ci/nvrtc}"
  PTXAS="${LILY_PTXAS:-$HOME/.cache/lily-ci/nvcc/nvidia/cu13/bin/ptxas}"
  if [ -f "$NVRTC_DIR/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    if [ -x "$PTXAS" ]; then export LILY_PTXAS="$PTXAS"; else unset LILY_PTXAS; fi
    LD_LIBRARY_PATH="$NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      LILY_REQUIRE_NVRTC=1 LILY_PTX_EXPORT="$PWD/.gpu/stage/kcache" cargo test --release --test cuda_compile -q 2>&1 | tail -1
  else
    echo "(no NVRTC wheel at $NVRTC_DIR: the GPU machine compiles the kernels itself)"
  fi
  # Kernel sources that env settings change (';'-separated settings, each compiled too):
  # KERNEL_ENVS="LILY_CUDA_GEMV_I8=0"; TIMELINE_BUILD=1 adds the timeline build's
  # (LILY_CUDA_TIMELINE=1: TIMELINE on the device).
  kenvs="${KERNEL_ENVS:-}"
  [ -n "${TIMELINE_BUILD:-}" ] && kenvs="LILY_CUDA_TIMELINE=1${kenvs:+;$kenvs}"
  if [ -n "$kenvs" ] && [ -f "$NVRTC_DIR/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    IFS=';' read -ra kvs <<<"$kenvs"
    for kv in "${kvs[@]}"; do
      echo "kernels with $kv"
      env $kv LD_LIBRARY_PATH="$NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        LILY_REQUIRE_NVRTC=1 LILY_PTX_EXPORT="$PWD/.gpu/stage/kcache" cargo test --release --test cuda_compile -q 2>&1 | tail -1
    done
  fi
  bash scripts/topk_time.sh >/dev/null # .gpu/topk_time.cu, which the device half builds with nvcc
  cp target/release/lily .gpu/stage/bin/lily
  cp target/release/examples/gemv_bench .gpu/stage/bin/gemv_bench
  cp target/release/examples/attn_bench .gpu/stage/bin/attn_bench
  cp target/release/examples/gdn_bench .gpu/stage/bin/gdn_bench
  strip .gpu/stage/bin/* 2>/dev/null || true
  # written beside and renamed: a device call carrying the old bundle never reads half a new one
  tar -C .gpu/stage -czf .gpu/bundle.tar.gz.part . && mv .gpu/bundle.tar.gz.part .gpu/bundle.tar.gz
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
export LILY_KERNEL_CACHE=$PWD/.gpu/kcache
# the PTX compiled at build time (found only if this machine's NVRTC has the same version)
mkdir -p .gpu/kcache && cp .gpu/x/kcache/*.ptx .gpu/kcache/ 2>/dev/null && echo "kernel cache seeded from the bundle" || true
if cp .gpu/x/kcache/*.cubin .gpu/kcache/ 2>/dev/null; then
  # the kernels compiled and assembled at build time (tests/cuda_compile.rs ran there): no need
  # to spend a minute of device time compiling them again
  echo "(with the sm_90a cubin; cuda_compile ran at build time)"
  TESTS=${TESTS/cuda_compile /}
fi
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:/usr/local/cuda/targets/x86_64-linux/lib
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUTDIR/gpu.txt"
# SM/memory clocks, power and throttle reasons every 100 ms while this script runs
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,pstate,utilization.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 100 >"$OUTDIR/clocks.csv" 2>&1 &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null || true' EXIT
status=0
[ -n "${SKIP_TESTS:-}" ] && TESTS=""
[ -n "${ONLY_TESTS:-}" ] && TESTS="$ONLY_TESTS"
for spec in $TESTS; do
  # an entry is a test executable, or executable:filter (only the tests whose names contain the
  # filter, or with !filter all but those: a kernel that traps poisons the CUDA context of the
  # rest of its process)
  t=${spec%%:*}
  filt=""
  [ "$spec" != "$t" ] && filt=${spec#*:}
  fargs=()
  case "$filt" in
    "") ;;
    !*) IFS=',' read -ra skips <<<"${filt#!}"; for k in "${skips[@]}"; do fargs+=(--skip "$k"); done ;;
    *) fargs=("$filt") ;;
  esac
  log="$OUTDIR/$t${filt:+.$(echo "${filt#!}" | tr ',' '_')}.log"
  echo "== $t${filt:+ ($filt)}"
  if ! env ${TEST_ENV:-} timeout "${TEST_TIMEOUT:-600}" .gpu/x/bin/$t ${fargs[@]+"${fargs[@]}"} --test-threads=1 --nocapture >"$log" 2>&1; then status=1; fi
  grep -E "^test |test result|SKIPPED|worst|panicked|nmse .*e-0[0-8]" "$log" | head -60 || true
  if [ "$t" = cuda_kernels ]; then
    # the routed MoE kernels again with the block-wide top-k (route_rank), with redux (the
    # weights by one lane) and redux2 (by the lanes; the persistent step's); the default is thresh
    for form in rank redux redux2; do
      echo "== cuda_kernels moe, LILY_CUDA_ROUTE=$form"
      if ! LILY_CUDA_ROUTE=$form .gpu/x/bin/$t moe --test-threads=1 >"$OUTDIR/$t.$form.log" 2>&1; then status=1; fi
      grep -E "^test |test result|panicked" "$OUTDIR/$t.$form.log" || true
    done
    # the register top-k forms' picks and weight bits against route_topk, on random, tied, NaN,
    # signed-zero and -inf logits, then their latency (scripts/topk_time.sh; nvcc)
    if [ -f .gpu/topk_time.cu ] && command -v nvcc >/dev/null; then
      echo "== top-k forms against route_topk (scripts/topk_time.sh)"
      if ! bash scripts/topk_time.sh device >"$OUTDIR/topk_time.log" 2>&1; then status=1; fi
      grep -E "^check|mismatch|^\|" "$OUTDIR/topk_time.log" || true
    fi
  fi
done
if [ -n "${GEMV_BENCH:-}" ]; then
  echo "== decode GEMV kernels (examples/gemv_bench.rs)"
  timeout 120 .gpu/x/bin/gemv_bench 2>&1 | tee "$OUTDIR/gemv_bench.txt" || status=1
fi
if [ -n "${ATTN_BENCH:-}" ]; then
  # ATTN_BENCH="T pos0,pos0,..." (or 1 for the defaults): the prefill attention kernels alone.
  echo "== prefill attention kernels (examples/attn_bench.rs)"
  [ "$ATTN_BENCH" = 1 ] && ATTN_BENCH=""
  timeout 240 .gpu/x/bin/attn_bench $ATTN_BENCH 2>&1 | tee "$OUTDIR/attn_bench.txt" || status=1
fi
if [ -n "${GDN_BENCH:-}" ]; then
  # GDN_BENCH="T,T,..." (or 1 for the defaults): the prefill delta-rule kernels alone.
  echo "== prefill delta rule (examples/gdn_bench.rs)"
  [ "$GDN_BENCH" = 1 ] && GDN_BENCH=""
  timeout 240 .gpu/x/bin/gdn_bench $GDN_BENCH 2>&1 | tee "$OUTDIR/gdn_bench.txt" || status=1
fi
if [ -n "${ATTN_DEC_BENCH:-}" ]; then
  # ATTN_DEC_BENCH="L,L,..." (or 1 for the defaults): the decode attention kernels alone.
  echo "== decode attention kernels (examples/attn_bench.rs decode)"
  [ "$ATTN_DEC_BENCH" = 1 ] && ATTN_DEC_BENCH=""
  timeout 240 .gpu/x/bin/attn_bench decode $ATTN_DEC_BENCH 2>&1 | tee "$OUTDIR/attn_dec_bench.txt" || status=1
fi
if [ -n "${PROFILE_LAYERS:-}" ]; then
  PC=${PROFILE_CONTEXT:-256}
  echo "== per-kernel profile (LILY_CUDA_PROFILE=1, $PROFILE_LAYERS layers, context $PC, 16 decode steps)"
  LILY_CUDA_PROFILE=1 timeout 180 .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
    --layers "$PROFILE_LAYERS" --contexts "$PC" --warmup 0 --decode-steps 16 >"$OUTDIR/profile.txt" 2>&1 || status=1
  grep -E "^\||^decode step" "$OUTDIR/profile.txt" | head -80 || true
fi
if [ -n "${TIMELINE:-}" ]; then
  # TIMELINE=ctx[,ctx...]: the decode step kernel by kernel in the replayed graph (the timeline
  # build, LILY_CUDA_TIMELINE=1; its kernels come from the bundle when it was built with
  # TIMELINE_BUILD=1, else NVRTC compiles them here) with moe_fused_q's own stamps
  # (LILY_CUDA_MOE_TRACE=1). The stamps cost a little; the bench's tok/s there is not the
  # product's.
  for c in ${TIMELINE//,/ }; do
    echo "== timeline, context $c"
    LILY_CUDA_TIMELINE=1 LILY_CUDA_MOE_TRACE=1 timeout 400 .gpu/x/bin/lily bench --device cuda \
      --model synthetic:qwen3.6-35b-a3b --contexts "$c" --warmup 0 --decode-steps 16 >"$OUTDIR/timeline_$c.txt" 2>&1 || status=1
    sed -n '/^per kernel/,$p' "$OUTDIR/timeline_$c.txt" | head -60 || true
  done
fi
if [ -n "${NCU:-}" ]; then
  # NCU="name|name...": ncu's hardware counters for NCU_COUNT (default 1) decode launches of each
  # kernel named, at context NCU_CONTEXT (default 4096) of an 8-layer cut, after its first
  # NCU_SKIP (default 4) launches there (the prefill's and the first decode steps'). ncu
  # serializes the launches and leaves the clocks alone (--clock-control none): each kernel
  # alone, without the step's PDL overlap. Details in $OUTDIR/ncu_<name>.txt, the SASS lines with
  # their stall samples in $OUTDIR/ncu_<name>_sass.csv; printed here: duration, issue and stalls.
  for k in ${NCU//|/ }; do
    echo "== ncu: $k at context ${NCU_CONTEXT:-4096}"
    timeout 240 ncu --clock-control none --kernel-name "$k" --launch-skip "${NCU_SKIP:-4}" \
      --launch-count "${NCU_COUNT:-1}" --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section SourceCounters \
      --export "$OUTDIR/ncu_$k" .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b --layers 8 \
      --contexts "${NCU_CONTEXT:-4096}" --warmup 0 --decode-steps 8 >"$OUTDIR/ncu_${k}_run.txt" 2>&1 || status=1
    ncu --import "$OUTDIR/ncu_$k.ncu-rep" --page details >"$OUTDIR/ncu_$k.txt" 2>&1 || status=1
    grep -E "Duration|Executed Ipc A|Issue Slots Busy|No Eligible|Active Warps Per|Warp Cycles Per Issued|Registers Per|Memory Throughput|Block Size|Grid Size|Stall|stall" \
      "$OUTDIR/ncu_$k.txt" | head -40 || true
    ncu --import "$OUTDIR/ncu_$k.ncu-rep" --page source --print-source sass --csv >"$OUTDIR/ncu_${k}_sass.csv" 2>&1 || true
    gzip -f "$OUTDIR/ncu_${k}_sass.csv" || true
    rm -f "$OUTDIR/ncu_$k.ncu-rep"
  done
fi
if [ -n "${PSTEP_TRACE:-}" ]; then
  # PSTEP_TRACE=ctx[,ctx...]: the persistent step phase by phase (LILY_PSTEP_TRACE=1, the last
  # step of the bench's decode), then its summary per phase kind (src/cuda/model/pstep.rs).
  for c in ${PSTEP_TRACE//,/ }; do
    echo "== persistent step trace, context $c"
    LILY_CUDA_DECODE=persistent LILY_PSTEP_TRACE=1 timeout 300 .gpu/x/bin/lily bench --device cuda \
      --model synthetic:qwen3.6-35b-a3b --contexts "$c" --warmup 0 --decode-steps 16 >"$OUTDIR/pstep_trace_$c.txt" 2>&1 || status=1
    sed -n '/^| phase kind/,/^| launches/p' "$OUTDIR/pstep_trace_$c.txt" | tail -20 || true
  done
fi
BENCH_CONTEXTS=${BENCH_CONTEXTS:-256,4096}
if [ "$BENCH_CONTEXTS" != none ]; then
  echo "== bench"
  timeout "${BENCH_TIMEOUT:-420}" .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
    --contexts "$BENCH_CONTEXTS" 2>&1 | tee "$OUTDIR/bench.txt" || status=1
fi
if [ -n "${BENCH_BATCH:-}" ]; then
  # Batched decode (llama-batched-bench's shape): B sequences of 256 prompt + 128 tokens.
  echo "== bench, batched (--batch $BENCH_BATCH)"
  timeout "${BENCH_TIMEOUT:-420}" .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
    --contexts "${BATCH_CONTEXTS:-256}" --batch "$BENCH_BATCH" --decode-steps 128 --warmup "${BATCH_WARMUP:-1}" \
    2>&1 | tee "$OUTDIR/bench_batch.txt" || status=1
fi
if [ -n "${BATCH_VARIANTS:-}" ]; then
  # The batched bench once per setting (';'-separated env assignments, "-" for none), and with
  # AB_OLD's binary first when set: A/Bs of the batched step in one lease.
  IFS=';' read -ra variants <<<"$BATCH_VARIANTS"
  bins=(.gpu/x/bin/lily)
  [ -n "${AB_OLD:-}" ] && bins=("$AB_OLD" .gpu/x/bin/lily)
  for b in "${bins[@]}"; do
    for v in "${variants[@]}"; do
      [ "$b" = "${AB_OLD:-}" ] && [ "$v" != "${variants[0]}" ] && continue
      echo "-- $b $v"
      env ${v/#-/} timeout "${BENCH_TIMEOUT:-420}" "$b" bench --device cuda --model synthetic:qwen3.6-35b-a3b \
        --contexts 256 --batch "${VARIANT_BATCH:-16,64}" --decode-steps 128 --warmup 1 2>&1 \
        | grep "^|" | tail -n +3 | tee -a "$OUTDIR/batch_variants.txt" || status=1
    done
  done
fi
if [ -n "${BENCH_LONG:-}" ]; then
  # Long contexts without the exact-shape warm-up (a 128K warm-up prefill alone takes ~50 s).
  echo "== bench, long context (--warmup 0)"
  timeout "${BENCH_TIMEOUT:-420}" .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
    --contexts "$BENCH_LONG" --warmup 0 2>&1 | tee "$OUTDIR/bench_long.txt" || status=1
fi
if [ -n "${LONG_ENV:-}" ]; then
  # The long bench again under an env setting (e.g. LILY_CUDA_ATTN_PREFILL=tc), for an A/B.
  echo "== bench, long context with $LONG_ENV (--warmup 0)"
  env $LONG_ENV timeout "${BENCH_TIMEOUT:-420}" .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
    --contexts "${LONG_ENV_CONTEXTS:-$BENCH_LONG}" --warmup "${LONG_ENV_WARMUP:-0}" 2>&1 | tee "$OUTDIR/bench_long_env.txt" || status=1
fi
if [ -n "${KV_AB:-}" ]; then
  # The same long contexts with the fp32 KV cache (the exact mode's), for an A/B in one lease.
  echo "== bench, fp32 KV cache (--kv-cache-dtype f32, --warmup 0)"
  timeout "${BENCH_TIMEOUT:-420}" .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
    --contexts "$KV_AB" --warmup 0 --kv-cache-dtype f32 2>&1 | tee "$OUTDIR/bench_kv_f32.txt" || status=1
fi
if [ -n "${AB_OLD:-}" ] && [ "${AB_CONTEXTS:-256}" != none ]; then
  # Batch-1 A/B in one lease: another build's lily binary (AB_OLD) and this one, alternating.
  echo "== A/B: $AB_OLD vs this build, alternating (--contexts ${AB_CONTEXTS:-256})"
  for i in 1 2; do
    for b in "$AB_OLD" .gpu/x/bin/lily; do
      echo "-- $b"
      timeout 200 "$b" bench --device cuda --model synthetic:qwen3.6-35b-a3b --contexts "${AB_CONTEXTS:-256}" 2>&1 \
        | grep "^|" | tail -n +3 | sed "s|^|$b |" | tee -a "$OUTDIR/ab.txt" || status=1
    done
  done
fi
if [ -n "${ENV_AB:-}" ]; then
  # Batch-1 A/B of env settings (';'-separated, "-" for none) in one lease, alternating twice.
  echo "== A/B of settings, alternating (--contexts ${AB_CONTEXTS:-256})"
  IFS=';' read -ra settings <<<"$ENV_AB"
  for i in 1 2; do
    for v in "${settings[@]}"; do
      echo "-- $v"
      env ${v/#-/} timeout 200 .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
        --contexts "${AB_CONTEXTS:-256}" 2>&1 | grep "^|" | tail -n +3 | sed "s|^|$v |" | tee -a "$OUTDIR/env_ab.txt" || status=1
    done
  done
fi
if [ -n "${ABLATE:-}" ]; then
  AC=${ABLATE_CONTEXT:-256}
  echo "== ablation: decode tok/s at context $AC with kernels left out (LILY_CUDA_SKIP; garbage results)"
  for k in none $ABLATE; do
    r=$(LILY_CUDA_SKIP=$k timeout 120 .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b \
      --contexts "$AC" --json 2>/dev/null | python3 -c 'import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); print(round(d["rows"][0]["decode_tokens_per_s"], 1))' 2>&1 | tail -1)
    echo "| $k | $r |"
  done
fi
if [ -n "${SERVE_CLIENTS:-}" ]; then
  # `lily serve` under load (scripts/serve_load.sh) at each client count, with AB_OLD's binary
  # first when set (SERVE_TOKENS answer tokens, default 64).
  echo "== serve load (clients: $SERVE_CLIENTS)"
  for b in ${AB_OLD:-} .gpu/x/bin/lily; do
    echo "-- $b"
    LILY=$b ARGS="--device cuda --model synthetic:qwen3.6-35b-a3b" CLIENTS="$SERVE_CLIENTS" \
      MAX_TOKENS="${SERVE_TOKENS:-64}" PORT=8766 timeout 400 bash scripts/serve_load.sh 2>&1 | grep "^|" \
      | sed "s|^|$b |" | tee -a "$OUTDIR/serve.txt" || status=1
  done
fi
kill $SAMPLER 2>/dev/null || true
echo "== SM clock while busy (MHz: samples, min, median, max; throttle reasons seen)"
python3 - "$OUTDIR/clocks.csv" <<'PY' || true
import sys, statistics
busy, reasons = [], set()
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 7 or not f[1].split()[0].isdigit():
        continue
    if int(f[5].split()[0]) > 0:
        busy.append(int(f[1].split()[0]))
        reasons.add(f[6])
if busy:
    print(len(busy), min(busy), statistics.median(busy), max(busy), sorted(reasons))
PY
echo "== summary (tests exit status $status)"
grep -h "test result" "$OUTDIR"/cuda_*.log || true
[ -f "$OUTDIR/bench.txt" ] && tail -n 6 "$OUTDIR/bench.txt"
[ -f "$OUTDIR/bench_long.txt" ] && tail -n 3 "$OUTDIR/bench_long.txt"
[ -f "$OUTDIR/bench_long_env.txt" ] && tail -n 3 "$OUTDIR/bench_long_env.txt"
[ -f "$OUTDIR/attn_bench.txt" ] && grep "^|" "$OUTDIR/attn_bench.txt"
[ -f "$OUTDIR/gdn_bench.txt" ] && grep "^|" "$OUTDIR/gdn_bench.txt"
[ -f "$OUTDIR/bench_batch.txt" ] && grep "^|" "$OUTDIR/bench_batch.txt"
[ -f "$OUTDIR/bench_kv_f32.txt" ] && tail -n 3 "$OUTDIR/bench_kv_f32.txt"
[ -f "$OUTDIR/serve.txt" ] && cat "$OUTDIR/serve.txt"
exit $status
