#!/usr/bin/env bash
# A/B runs end to end on Gemma 3 12B decode: the affine GEMV's prefetching loop (4- and 8-bit)
# with GEMV_PREFETCH off, then on (same process kind, same machine, back to back).
set -u
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
for quant in 4bit 8bit; do
  for prefetch in False True; do
    echo "=== $quant prefetch=$prefetch"
    timeout 100 python - "$quant" "$prefetch" "$OUT" <<'PY' 2>&1 | grep -E '^\|' | grep -v '^|---'
import sys
import hearth.kernels.affine_matmul as am
quant, prefetch, out = sys.argv[1], sys.argv[2] == "True", sys.argv[3]
am.GEMV_PREFETCH = prefetch
from hearth.cli import main
main(["bench", "--random", "gemma3-12b", "--quant", quant, "--contexts", "512", "--prefill",
      "512", "--steps", "32", "--out", f"{out}/ab-{quant}-prefetch{prefetch}.md"])
PY
  done
done
# bf16: the down projection through hearth's GEMV instead of cuBLAS (DOWN_GEMV off, then on).
for down in False True; do
  echo "=== bf16 DOWN_GEMV=$down"
  timeout 100 python - "$down" "$OUT" <<'PY' 2>&1 | grep -E '^\|' | grep -v '^|---'
import sys
import hearth.models.gemma as gemma
gemma.DOWN_GEMV = sys.argv[1] == "True"
from hearth.cli import main
main(["bench", "--random", "gemma3-12b", "--contexts", "512", "--prefill", "512", "--steps",
      "64", "--out", f"{sys.argv[2]}/ab-bf16-down{sys.argv[1]}.md"])
PY
done
# bf16: gate/up + GeGLU as one GEMV, with the down GEMV.
echo "=== bf16 DOWN_GEMV=True GEGLU_GEMV=True"
timeout 100 python - "$OUT" <<'PY' 2>&1 | grep -E '^\|' | grep -v '^|---'
import sys
import hearth.models.gemma as gemma
gemma.DOWN_GEMV = gemma.GEGLU_GEMV = True
from hearth.cli import main
main(["bench", "--random", "gemma3-12b", "--contexts", "512", "--prefill", "512", "--steps",
      "64", "--out", f"{sys.argv[1]}/ab-bf16-down-geglu.md"])
PY
