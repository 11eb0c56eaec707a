#!/usr/bin/env bash
# The router top-K's own latency on the GPU (scripts/topk_time.cu), in two halves like gpu.sh:
#   scripts/topk_time.sh          here: lily's kernel source (examples/kernel_source.rs) cut to
#                                 the kernel params, common.cuh and moe.cu, with the harness
#                                 appended, into .gpu/topk_time.cu (carried with .gpu).
#   scripts/topk_time.sh device   on the GPU machine: nvcc builds and runs it; prints cycles per
#                                 top-8 of 256 alone and beside 15 busy warps.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-build}" = build ]; then
  cargo build --release -q --example kernel_source
  mkdir -p .gpu
  ./target/release/examples/kernel_source | python3 -c '
import re, sys
parts = re.split(r"(?m)^// ---- (.+?) ----\n", sys.stdin.read())
keep = ("kernel params (src/cuda/params.rs)", "common.cuh", "moe.cu")
sys.stdout.write(parts[0] + "".join("// ---- %s ----\n%s" % (parts[i], parts[i + 1])
                 for i in range(1, len(parts), 2) if parts[i] in keep))' >.gpu/topk_time.cu
  cat scripts/topk_time.cu >>.gpu/topk_time.cu
  echo "device command (run tool, carry [\".gpu\"]): bash scripts/topk_time.sh device"
else
  nvcc -arch=sm_90a -std=c++17 -w -o /tmp/topk_time .gpu/topk_time.cu
  /tmp/topk_time
fi
