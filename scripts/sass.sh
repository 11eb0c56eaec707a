#!/usr/bin/env bash
# The SASS of kernels without a GPU: disassembles KERNEL from the sm_90a cubin that
# tests/cuda_compile.rs leaves in target/lily-sm_90a.cubin (run it first, with the env settings
# of the build to inspect, e.g. LILY_CUDA_GEMV_I8=0) and prints its size, its register-spill
# traffic and, per basic block of at least MIN instructions, the instruction mix: enough to see
# what an inner loop costs per code and whether a change did what it meant to.
#   bash scripts/sass.sh gemv_q2 [MIN=40]
# Needs cuobjdump and nvdisasm: the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels,
# installed once (~1 min) under ~/.cache/lily-ci/sass.
set -euo pipefail
cd "$(dirname "$0")/.."
KERNEL=${1:?kernel name}
MIN=${2:-40}
T=$HOME/.cache/lily-ci/sass
if [ ! -x "$T/nvidia/cu13/bin/cuobjdump" ] || [ ! -x "$T/nvidia/cu13/bin/nvdisasm" ]; then
  python3 -m pip install --quiet --no-deps --target "$T" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
fi
CUBIN=${CUBIN:-target/lily-sm_90a.cubin}
[ -f "$CUBIN" ] || { echo "no $CUBIN: run tests/cuda_compile.rs with LILY_PTXAS set first" >&2; exit 1; }
OUT=$(mktemp)
PATH="$T/nvidia/cu13/bin:$PATH" cuobjdump -sass -fun "$KERNEL" "$CUBIN" >"$OUT"
python3 - "$OUT" "$MIN" <<'PY'
import collections, re, signal, sys
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
ins = []
for line in open(sys.argv[1]):
    m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
if not ins:
    sys.exit("no such kernel in the cubin")
op = lambda t: re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
print(f"{len(ins)} instructions ({16 * len(ins) // 1024} KB), local memory: "
      f"{sum(op(t) in ('LDL', 'STL') for _, t in ins)}")
targets = {int(m.group(1), 16) for _, t in ins for m in [re.search(r"BRA.*?0x([0-9a-f]+)", t)] if m}
blocks, cur = [], []
for a, t in ins:
    if a in targets and cur:
        blocks.append(cur)
        cur = []
    cur.append((a, t))
    if op(t) in ("BRA", "EXIT", "RET"):
        blocks.append(cur)
        cur = []
if cur:
    blocks.append(cur)
for b in blocks:
    if len(b) >= int(sys.argv[2]):
        c = collections.Counter(op(t) for _, t in b)
        print(f"{b[0][0]:#8x} {len(b):5d}  " + " ".join(f"{k}:{v}" for k, v in c.most_common(12)))
PY
rm -f "$OUT"
