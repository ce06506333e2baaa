#!/usr/bin/env bash
# Why the 4-bit GEMV stops near 1.3 TB/s: Nsight Compute on the v1 kernel and the tensor-core
# prototype at Gemma 3 12B's gate/up shape (30720 x 3840, MLX 4-bit g64). Both designs land
# there with 5-7 and ~2.9 instructions a code, so the limit is something they share; this
# collects DRAM throughput, sectors per request, L2 hit rate and warp stall reasons.
# Needs `ncu` and GPU performance-counter access; says so and exits 0 when either is missing.
#   benchmarks/lab/ncu_gemv_affine.sh           # v1 against the tensor-core prototype (gate/up)
#   benchmarks/lab/ncu_gemv_affine.sh x-order   # v1 with x in input order, then codes-major, at
#                                           # 12B gate/up, down, q/k/v, o; 4-bit then 8-bit
set -u
CASE=${1:-mma}
OUT=${OUT:-benchmarks/results/tmp}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
if ! command -v ncu >/dev/null; then
  echo "ncu not found: nothing profiled"; exit 0
fi
cat >"$SCRATCH/gemv_case.py" <<'PY'
import sys
sys.path.insert(0, "benchmarks/lab")
import torch
from gpu_gemv_affine_mma import _operands, mma_gemv
from hearth.ops import affine_matmul as am
x, packed, scales, biases, _ = _operands(30720, 3840, torch.device("cuda"))
for _ in range(3):  # compile, then the profiled launches
    am.affine_gemv_triton(x[None], packed, scales, biases, 4, 64)
    mma_gemv(x, packed, scales, biases, 64, 1, 4, 4, 0)
torch.cuda.synchronize()
PY
cat >"$SCRATCH/gemv_x_order.py" <<'PY'
import torch
from hearth.ops import affine_matmul as am
from hearth.quant.mlx import pack_codes
for bits in (4, 8):
    for n, k in ((30720, 3840), (3840, 15360), (12288, 3840), (3840, 4096)):
        codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, device="cuda")
        packed = pack_codes(codes, bits)
        scales = torch.rand(n, k // 64, device="cuda").to(torch.bfloat16) * 0.01
        biases = -scales * 8
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        config = am.gemv_config(n, k, bits, 64, 132)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        for ordered in (False, True):  # each: one warm-up launch, one profiled
            xs = am.codes_major(x, bits) if ordered else x
            for _ in range(2):
                am._launch_gemv(xs, packed, scales, biases, out, bits, 64, config, ordered)
torch.cuda.synchronize()
PY
if [ "$CASE" = x-order ]; then
  # 16 profiled launches: odd ones (warm-ups) skipped by the filter below.
  timeout 300 ncu --kernel-name regex:"_affine_gemv_kernel" --section SpeedOfLight \
    --section SchedulerStats --section WarpStateStats \
    python "$SCRATCH/gemv_x_order.py" >"$OUT/ncu_gemv_x_order.txt" 2>&1
  echo "ncu exit $?"
  grep -E "ERR_NVGPUCTRPERM|_affine_gemv_kernel|DRAM Throughput|L1/TEX Cache|Duration|Issued Warp" \
    "$OUT/ncu_gemv_x_order.txt" | head -120
  exit 0
fi
timeout 300 ncu --kernel-name regex:"_affine_gemv_kernel|_mma_gemv_kernel" --launch-skip 2 \
  --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section Occupancy \
  python "$SCRATCH/gemv_case.py" >"$OUT/ncu_gemv_affine.txt" 2>&1
echo "ncu exit $?"
grep -E "ERR_NVGPUCTRPERM|Memory Throughput|DRAM Throughput|L2 Hit|Stall|Issued Warp|Achieved Occupancy|Duration" \
  "$OUT/ncu_gemv_affine.txt" | head -60
