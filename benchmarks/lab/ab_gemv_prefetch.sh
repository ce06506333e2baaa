#!/usr/bin/env bash
# A/B of the affine GEMV's prefetching loop end to end: Gemma 3 12B 4-bit and 8-bit decode
# with GEMV_PREFETCH_BITS empty, then on (same process kind, same machine, back to back).
set -u
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
for quant in 4bit 8bit; do
  for prefetch in False True; do
    echo "=== $quant prefetch=$prefetch"
    timeout 100 python - "$quant" "$prefetch" "$OUT" <<'PY' 2>&1 | grep -E '^\|' | grep -v '^|---'
import sys
import hearth.ops.affine_matmul as am
quant, prefetch, out = sys.argv[1], sys.argv[2] == "True", sys.argv[3]
am.GEMV_PREFETCH_BITS = (4, 8) if prefetch else ()
from hearth.cli import main
main(["bench", "--random", "gemma3-12b", "--quant", quant, "--contexts", "512", "--prefill",
      "512", "--steps", "32", "--out", f"{out}/ab-{quant}-prefetch{prefetch}.md"])
PY
  done
done
