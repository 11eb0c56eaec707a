#!/usr/bin/env bash
# Where one kernel's warps stall inside the batched decode step (on the GPU machine, after
# `bash scripts/gpu.sh` built .gpu/bundle.tar.gz here): launch SKIP+1 of KERNEL (default the
# routed experts' gemm_skinny8_q4) in a LAYERS-layer cut of the synthetic Qwen3.6-35B-A3B at batch B
# (256-token prompts), under ncu's warp-state sampling with --clock-control none; prints the
# stall reasons and the SASS instructions holding the most samples (report and CSVs under $OUT).
# CMD replaces the profiled command (e.g. CMD=".gpu/x/bin/gdn_bench 4096" KERNEL=gdn_chunk_scan_tc).
set -u
mkdir -p .gpu/x && tar -C .gpu/x -xzf .gpu/bundle.tar.gz
export LILY_KERNEL_CACHE=$PWD/.gpu/kcache LILY_REPO=$PWD
mkdir -p .gpu/kcache && cp .gpu/x/kcache/* .gpu/kcache/ 2>/dev/null || true
KERNEL=${KERNEL:-gemm_skinny8_q4} LAYERS=${LAYERS:-4} SKIP=${SKIP:-8} B=${B:-16} TAG=${TAG:-k}
timeout 300 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SourceCounters --section SchedulerStats --section Occupancy --section LaunchStats \
  --kernel-name "$KERNEL" --launch-skip "$SKIP" --launch-count 1 -f -o "$OUT/$TAG" \
  ${CMD:-.gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b --layers "$LAYERS" --contexts 256 \
  --batch "$B" --decode-steps 4 --warmup 0} > "$OUT/$TAG.log" 2>&1
echo "ncu rc=$?"
ncu -i "$OUT/$TAG.ncu-rep" --page details --csv > "$OUT/${TAG}_details.csv" 2>&1
grep -i "duration\|throughput\|stall\|issue\|warp cycles\|eligible\|active warps\|registers\|grid size\|achieved occ" \
  "$OUT/${TAG}_details.csv" | cut -d, -f12- | head -50
ncu -i "$OUT/$TAG.ncu-rep" --page source --csv --print-source sass > "$OUT/${TAG}_sass.csv" 2>&1
python3 - "$OUT/${TAG}_sass.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hi = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
h = rows[hi]; body = rows[hi + 1:]
sc = next((i for i, c in enumerate(h) if c.startswith("Warp Stall Sampling (All")), None)
src = h.index("Source")
tot = sum(float(r[sc] or 0) for r in body if len(r) > sc)
print("sass instructions:", len(body))
top = sorted(body, key=lambda r: -float(r[sc] or 0) if len(r) > sc else 0)[:40]
for r in top:
    print(f"{float(r[sc] or 0) / tot * 100:5.1f}%  {r[0]:>6}  {r[src][:90]}")
PY
