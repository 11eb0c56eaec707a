#!/usr/bin/env bash
# A dependent step's own cost on the GPU (scripts/dep_floor.cu: a chain of 223 steps as a graph
# of kernels, with PDL, and as one kernel whose blocks meet on a counter), in two halves:
#   scripts/dep_floor.sh          here: nvcc (the CI wheels under ~/.cache/lily-ci, plus the crt
#                                 and nvvm wheels) builds .gpu/dep_floor, runtime linked statically.
#   scripts/dep_floor.sh device   on the GPU machine: runs it (carry .gpu/dep_floor), or builds it
#                                 there with the machine's nvcc when it was not carried.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-build}" = build ]; then
  c=~/.cache/lily-ci
  for w in "crt nvidia-cuda-crt" "nvvm nvidia-nvvm"; do
    set -- $w
    [ -d "$c/$1/nvidia" ] || python3 -m pip install --quiet --no-deps --target "$c/$1" "$2==13.0.*"
  done
  n=$c/nvcc/nvidia/cu13
  [ -e "$n/nvvm" ] || ln -s "$c/nvvm/nvidia/cu13/nvvm" "$n/nvvm"
  mkdir -p .gpu
  PATH="$n/bin:$PATH" nvcc -arch=sm_90a -O3 -std=c++17 -I"$c/crt/nvidia/cu13/include" \
    -I"$c/nvrtc/nvidia/cu13/include" -L"$c/nvrtc/nvidia/cu13/lib" -cudart static \
    -o .gpu/dep_floor scripts/dep_floor.cu
  echo "device command (run tool, carry [\".gpu/dep_floor\"]): bash scripts/dep_floor.sh device"
else
  [ -x .gpu/dep_floor ] || nvcc -arch=sm_90a -O3 -std=c++17 -o .gpu/dep_floor scripts/dep_floor.cu
  .gpu/dep_floor
fi
