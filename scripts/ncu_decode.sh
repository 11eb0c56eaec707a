#!/usr/bin/env bash
# Hardware counters of the batch-1 decode step's kernels (on the GPU machine, after
# `bash scripts/gpu.sh` built .gpu/bundle.tar.gz here): synthetic Qwen3.6-35B-A3B cut to LAYERS
# layers (default 4: three GDN + one attention), context 256, the decode kernels after the first
# SKIP matching launches; ncu --clock-control none --cache-control none (the L2 keeps what the
# step left in it, as in a real step). CSV to $OUT/ncu_decode.csv, a per-kernel summary printed.
set -u
mkdir -p .gpu/x && tar -C .gpu/x -xzf .gpu/bundle.tar.gz
export LILY_KERNEL_CACHE=$PWD/.gpu/kcache LILY_REPO=$PWD
mkdir -p .gpu/kcache && cp .gpu/x/kcache/* .gpu/kcache/ 2>/dev/null || true
LAYERS=${LAYERS:-4} SKIP=${SKIP:-40} COUNT=${COUNT:-80}
M="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,sm__cycles_active.avg,gpc__cycles_elapsed.max"
timeout 300 ncu --clock-control none --cache-control none \
  --kernel-name "regex:^(gemv|gdn_step|moe_|attn_prep|attn_dec|attn_comb|embed|argmax|conv_step|rms_norm|pstep)" \
  --launch-skip $SKIP --launch-count $COUNT --csv --print-units base --metrics $M \
  .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b --layers $LAYERS --contexts 256 \
  --decode-steps 8 --warmup 0 > $OUT/ncu_decode.csv 2> $OUT/ncu_decode.err
echo "rc=$? lines=$(wc -l < $OUT/ncu_decode.csv)"
python3 - "$OUT/ncu_decode.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; rows = rows[1:]
ix = {k: h.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
k = collections.OrderedDict()
for r in rows:
    key = (int(r[ix["ID"]]), r[ix["Kernel Name"]].split("(")[0])
    k.setdefault(key, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]].replace(",", "")
print("id kernel grid block regs us dramMB dram% warps issue% longsb barrier membar")
for (i, n), m in k.items():
    g = lambda s: m.get(s, "?")
    print(i, n[:28], g("launch__grid_size"), g("launch__block_size"), g("launch__registers_per_thread"),
          round(float(g("gpu__time_duration.sum")) / 1000, 2), round(float(g("dram__bytes_read.sum")) / 1e6, 2),
          g("dram__throughput.avg.pct_of_peak_sustained_elapsed"), g("sm__warps_active.avg.per_cycle_active"),
          g("smsp__issue_active.avg.pct_of_peak_sustained_active"),
          g("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"),
          g("smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"),
          g("smsp__average_warps_issue_stalled_membar_per_issue_active.ratio"))
PY
