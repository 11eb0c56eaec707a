#!/usr/bin/env bash
# A dependent step's own cost on the GPU (scripts/dep_floor.cu: a chain of 223 steps as a graph
# of kernels, with PDL, and as one kernel whose blocks meet on a counter), and what adding every
# block's outputs into one vector by integer atomics costs (scripts/red_floor.cu), in two halves:
#   scripts/dep_floor.sh               here: nvcc (the CI wheels under ~/.cache/lily-ci, plus the
#                                      crt and nvvm wheels) builds .gpu/dep_floor and
#                                      .gpu/red_floor, runtime linked statically.
#   scripts/dep_floor.sh device [red]  on the GPU machine: runs dep_floor (or red_floor; carry
#                                      .gpu/dep_floor or .gpu/red_floor), or builds it there with
#                                      the machine's nvcc when it was not carried.
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
  for p in dep_floor red_floor; do
    PATH="$n/bin:$PATH" nvcc -arch=sm_90a -O3 -std=c++17 -I"$c/crt/nvidia/cu13/include" \
      -I"$c/nvrtc/nvidia/cu13/include" -L"$c/nvrtc/nvidia/cu13/lib" -cudart static \
      -o .gpu/$p scripts/$p.cu
  done
  echo "device commands (run tool, carry [\".gpu/dep_floor\"] or [\".gpu/red_floor\"]):"
  echo "  bash scripts/dep_floor.sh device; bash scripts/dep_floor.sh device red"
else
  p=dep_floor
  [ "${2:-}" = red ] && p=red_floor
  [ -x .gpu/$p ] || nvcc -arch=sm_90a -O3 -std=c++17 -o .gpu/$p scripts/$p.cu
  .gpu/$p
fi
