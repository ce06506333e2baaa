#!/usr/bin/env bash
# Why the 4-bit GEMV stops near 1.3 TB/s: Nsight Compute on the v1 kernel and the tensor-core
# prototype at Gemma 3 12B's gate/up shape (30720 x 3840, MLX 4-bit g64). Both designs land
# there with 5-7 and ~2.9 instructions a code, so the limit is something they share; this
# collects DRAM throughput, sectors per request, L2 hit rate and warp stall reasons.
# Needs `ncu` and GPU performance-counter access; says so and exits 0 when either is missing.
set -u
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
if ! command -v ncu >/dev/null; then
  echo "ncu not found: nothing profiled"; exit 0
fi
cat >/tmp/gemv_case.py <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import torch
from gpu_gemv_affine_mma import _operands, mma_gemv
from hearth.kernels import affine_matmul as am
x, packed, scales, biases, _ = _operands(30720, 3840, torch.device("cuda"))
for _ in range(3):  # compile, then the profiled launches
    am.affine_gemv_triton(x[None], packed, scales, biases, 4, 64)
    mma_gemv(x, packed, scales, biases, 64, 1, 4, 4, 0)
torch.cuda.synchronize()
PY
timeout 300 ncu --kernel-name regex:"_affine_gemv_kernel|_mma_gemv_kernel" --launch-skip 2 \
  --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section Occupancy \
  python /tmp/gemv_case.py >"$OUT/ncu_gemv_affine.txt" 2>&1
echo "ncu exit $?"
grep -E "ERR_NVGPUCTRPERM|Memory Throughput|DRAM Throughput|L2 Hit|Stall|Issued Warp|Achieved Occupancy|Duration" \
  "$OUT/ncu_gemv_affine.txt" | head -60
