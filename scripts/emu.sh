#!/usr/bin/env bash
# The decode kernels' own source run on the CPU: `lily::cuda::kernel_source()` (examples/
# kernel_source.rs, with the defines of the env settings) preprocessed by g++, filtered by
# scripts/emu/strip.py (kernels and PTX asm out), compiled for the host with scripts/emu/shim.h
# (one std::thread per CUDA thread, the blocks of a grid concurrent, shuffles and barriers
# emulated) and run on scripts/emu/cases.cpp's cases against double-precision references, once
# for the float kernel build (LILY_CUDA_GEMV_I8=0) and once for the default int8 one. It checks
# the arithmetic and the indexing of code that may not have met a GPU yet; not timing, not memory ordering. ~1 minute
# after a debug build; needs g++ with C++20 (<barrier>). Exit status non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v g++ >/dev/null || { echo "scripts/emu.sh: needs g++" >&2; exit 1; }
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
cargo build -q --example kernel_source
for v in float i8; do
  if [ "$v" = i8 ]; then export LILY_CUDA_GEMV_I8=1; else export LILY_CUDA_GEMV_I8=0; fi
  cargo run -q --example kernel_source >"$D/src.cu"
  g++ -E -P -x c++ -DLILY_EMU "$D/src.cu" >"$D/pre.cu"
  python3 scripts/emu/strip.py "$D/pre.cu" >"$D/kernels.h"
  { echo '#include "shim.h"'; echo "#define VARIANT \"$v\""; echo '#include "kernels.h"'; cat scripts/emu/cases.cpp; } >"$D/run.cpp"
  g++ -std=c++20 -O1 -w -I scripts/emu -I "$D" -o "$D/run_$v" "$D/run.cpp" -lpthread
  "$D/run_$v"
done
