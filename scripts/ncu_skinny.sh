#!/usr/bin/env bash
# Hardware counters of the batched decode step's gemm_skinny launches (on the GPU machine, after
# `bash scripts/gpu.sh` built .gpu/bundle.tar.gz here): 4 layers, B = 16 and 64, the 32 launches
# after the prefills (one decode step), ncu --clock-control none; CSVs to $OUT/ncu{16,64}.csv.
# Metrics: time, DRAM and L2 bytes, warps active, issue utilization, stall reasons per issue.
set -u
mkdir -p .gpu/x && tar -C .gpu/x -xzf .gpu/bundle.tar.gz
export LILY_KERNEL_CACHE=$PWD/.gpu/kcache LILY_REPO=$PWD
mkdir -p .gpu/kcache && cp .gpu/x/kcache/* .gpu/kcache/ 2>/dev/null || true
M="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,launch__grid_size,launch__occupancy_limit_registers,sm__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__inst_executed.sum"
for B in 16 64; do
  SKIP=$(( B * 4 * 2 + 32 ))
  timeout 200 ncu --clock-control none --kernel-name regex:gemm_skinny --launch-skip $SKIP --launch-count 32 --csv --metrics $M \
    .gpu/x/bin/lily bench --device cuda --model synthetic:qwen3.6-35b-a3b --layers 4 --contexts 256 --batch $B --decode-steps 4 --warmup 0 > $OUT/ncu$B.csv 2> $OUT/ncu$B.err
  echo "B=$B rc=$? lines=$(wc -l < $OUT/ncu$B.csv)"
done
