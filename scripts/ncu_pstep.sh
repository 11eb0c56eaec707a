#!/usr/bin/env bash
# Where the persistent decode kernel's warps stall (on the GPU machine, after `bash scripts/gpu.sh`
# built .gpu/bundle.tar.gz here): one `pstep` launch of a LAYERS-layer cut of the synthetic
# Qwen3.6-35B-A3B (context 256) under ncu's warp-state sampling; prints the stall reasons and the
# SASS instructions holding the most samples (report and CSV under $OUT).
set -u
mkdir -p .gpu/x && tar -C .gpu/x -xzf .gpu/bundle.tar.gz
export LILY_KERNEL_CACHE=$PWD/.gpu/kcache LILY_REPO=$PWD LILY_CUDA_DECODE=persistent
mkdir -p .gpu/kcache && cp .gpu/x/kcache/* .gpu/kcache/ 2>/dev/null || true
LAYERS=${LAYERS:-4} SKIP=${SKIP:-10}
timeout 300 ncu --clock-control none --section WarpStateStats --section SourceCounters --section SchedulerStats \
  --kernel-name pstep --launch-skip $SKIP --launch-count 1 -f -o $OUT/pstep \
  .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b --layers $LAYERS --contexts 256 \
  --decode-steps 8 --warmup 0 > $OUT/ncu_pstep.log 2>&1
echo "ncu rc=$?"
ncu -i $OUT/pstep.ncu-rep --page details --csv > $OUT/pstep_details.csv 2>&1
grep -i "stall\|issue\|warp cycles\|eligible\|active warps" $OUT/pstep_details.csv | cut -d, -f12- | head -40
ncu -i $OUT/pstep.ncu-rep --page source --csv --print-source sass > $OUT/pstep_sass.csv 2>&1
echo "sass rows: $(wc -l < $OUT/pstep_sass.csv)"
python3 - "$OUT/pstep_sass.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hi = next(i for i, r in enumerate(rows) if any("Source" == c for c in r))
h = rows[hi]; body = rows[hi + 1:]
print([c for c in h][:40])
sc = next((i for i, c in enumerate(h) if c.startswith("Warp Stall Sampling (All")), None)
src = h.index("Source")
tot = sum(float(r[sc] or 0) for r in body if len(r) > sc)
top = sorted(body, key=lambda r: -float(r[sc] or 0) if len(r) > sc else 0)[:45]
for r in top:
    print(f"{float(r[sc] or 0) / tot * 100:5.1f}%  {r[0]:>6}  {r[src][:90]}")
PY
