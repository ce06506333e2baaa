"""Triton matmuls over MLX affine-packed weights on a GPU: correctness and speed at real shapes.

Checks each kernel against its torch reference on fresh random inputs (bf16 activations,
bf16 scales and biases, bits 4 and 8, groups 64 and 32), then times (CUDA events, median of
`triton.testing.do_bench`):

* GEMV at M=1 on Gemma 3 12B shapes and the tied 262144 x 3840 head: GB/s over the bytes one
  call must move (packed + scales + biases + x + out) and its share of 4.2 TB/s, beside
  cuBLAS bf16 `F.linear` on the already-dequantized weight (its own bytes);
* prefill, M=4096 on 15360 x 3840: dequantize-once + cuBLAS, in TFLOP/s of 790;
* MoE expert gather (26B-A4B: E=128, gate/up 1408 x 2816, down 2816 x 704, top_k 8, T=1),
  packed and bf16, against the torch references (gather the experts, then bmm).

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_kernels_affine.py
    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_kernels_affine.py --sweep
    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_kernels_affine.py --experts

`--sweep` instead times GEMV launches around `gemv_config`'s choice, with the prefetching loop
(each checked against cuBLAS on the dequantized weight first).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import torch.nn.functional as F
import triton

from hearth.ops import affine_matmul as am
from hearth.ops.activation import gelu_tanh_mul
from hearth.quant.mlx import dequantize_affine, pack_codes

COPY_BANDWIDTH = 4.2e12  # bytes/s, measured device-to-device copy on the H200
BF16_PEAK = 790e12  # FLOP/s, dense bf16
DEVICE = torch.device("cuda")
BF16 = torch.bfloat16
EPS_BF16 = torch.finfo(BF16).eps
EPS32 = torch.finfo(torch.float32).eps
# (N, K): Gemma 3 12B's MLP and q projections, and the tied 262144-token head.
GEMV_SHAPES = [
    (15360, 3840, "12B gate/up"),
    (3840, 15360, "12B down"),
    (8192, 3840, "12B q"),
    (262144, 3840, "tied head"),
]
CHECK_SHAPES = [(8192, 3840), (3840, 15360)]
SPLIT_SHAPE = (2816, 15360)  # few rows, long K: the split-K path
PREFILL_SHAPE = (15360, 3840, 4096)  # N, K, M
MOE_SHAPE = (128, 2816, 704, 8)  # 26B-A4B: experts, hidden, expert width, top_k


def packed_weight(n: int, k: int, bits: int, group: int, experts: int | None = None):
    """Random codes and realistic scales/biases (w ~ scale * (q - mid)), bf16."""
    lead = () if experts is None else (experts,)
    codes = torch.randint(0, 1 << bits, (*lead, n, k), dtype=torch.uint8, device=DEVICE)
    packed = pack_codes(codes, bits)
    scales = (torch.rand(*lead, n, k // group, device=DEVICE) * 0.02 + 0.001).to(BF16)
    biases = (-scales.float() * (1 << (bits - 1)) + 0.001 * torch.randn_like(scales.float())).to(
        BF16
    )
    return packed, scales, biases


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bench(fn: Callable[[], object]) -> float:
    """Median seconds per call."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def bench_graph(calls: list[Callable[[], object]]) -> float:
    """Median seconds per call of `calls` run back to back from a CUDA graph, as decode runs
    them: without the host's launch time, which exceeds a small kernel's. Calls on distinct
    weights keep the graph's bytes past L2 (do_bench clears L2 only between replays)."""
    for call in calls:
        call()  # compiled and autotuned outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return bench(graph.replay) / len(calls)


def within_bound(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, k: int) -> str:
    """Max error over the allowed error: bf16 output rounding of both sides (2 eps |y|), the
    reference's bf16 weights (eps per weight) and fp32 accumulation (4 sqrt(K) eps32), the last
    two times sum |x w|. Returns 'ok (ratio)' or 'FAIL (ratio)'."""
    error = (got.double() - want.double()).abs()
    bound = 2 * EPS_BF16 * want.double().abs() + (EPS_BF16 + 4 * math.sqrt(k) * EPS32) * magnitude
    ratio = (error / (bound + 1e-30)).max().item()
    return f"{'ok' if ratio <= 1 else 'FAIL'} ({ratio:.2f})"


def tuned_config(kernel: object) -> str:
    best = getattr(kernel, "best_config", None)
    if best is None:
        return "-"
    return " ".join(f"{k}={v}" for k, v in best.kwargs.items()) + f" w={best.num_warps}"


def gemv_case(n: int, k: int, bits: int, group: int):
    """Packed weight, one bf16 x row, cuBLAS on the dequantized weight, and sum |x w|."""
    packed, scales, biases = packed_weight(n, k, bits, group)
    x = torch.randn(1, k, device=DEVICE, dtype=BF16)
    weight = dequantize_affine(packed, scales, biases, bits, group).to(BF16)
    magnitude = x.double().abs() @ weight.double().abs().T
    return (x, packed, scales, biases), weight, F.linear(x, weight), magnitude


def gemv_rows(rows: list[list[str]], checks: list[list[str]]) -> None:
    for n, k, label in GEMV_SHAPES:
        for bits in (4, 8):
            group = 64
            (x, packed, scales, biases), weight, want, magnitude = gemv_case(n, k, bits, group)
            got = am.affine_linear(x, packed, scales, biases, bits, group)
            checks.append(
                [f"GEMV {label} {n}x{k}", f"{bits}/{group}", within_bound(got, want, magnitude, k)]
            )
            seconds = bench(partial(am.affine_linear, x, packed, scales, biases, bits, group))
            moved = nbytes(packed, scales, biases, x, got)
            cublas = bench(partial(F.linear, x, weight))
            cublas_moved = nbytes(weight, x, got)
            rows.append(
                [
                    f"GEMV M=1 {label} {n}x{k}",
                    f"{bits}-bit g{group}",
                    f"{seconds * 1e6:.1f}",
                    f"{moved / seconds / 1e9:.0f}",
                    f"{moved / seconds / COPY_BANDWIDTH:.0%}",
                    f"{cublas * 1e6:.1f} ({cublas_moved / cublas / COPY_BANDWIDTH:.0%})",
                    f"{cublas / seconds:.2f}x",
                    str(gemv_launch(n, k, bits, group)),
                ]
            )


def sweep_configs(base: am.GemvConfig) -> list[am.GemvConfig]:
    """The heuristic's launch, it with prefetching, and prefetching neighbours of it."""
    shapes = {(base.block_n, base.block_g, base.warps)}
    shapes |= {(2 * base.block_n, base.block_g, 4), (2 * base.block_n, base.block_g, 8)}
    shapes |= {(base.block_n, 2 * base.block_g, 4), (max(8, base.block_n // 2), base.block_g, 4)}
    configs = [base]
    for block_n, block_g, warps in sorted(shapes):
        for split in sorted({base.split_k, 2 * base.split_k, max(1, base.split_k // 2)}):
            configs.append(am.GemvConfig(block_n, block_g, warps, split, prefetch=True))
    return configs


def gemv_sweep(rows: list[list[str]], checks: list[list[str]]) -> None:
    """Every sweep config per 12B shape at M=1, checked and timed (`--sweep`)."""
    for n, k, label in GEMV_SHAPES:
        for bits in (4, 8):
            group = 64
            (x, packed, scales, biases), _, want, magnitude = gemv_case(n, k, bits, group)
            base = gemv_launch(n, k, bits, group)
            timed = []
            for config in sweep_configs(base):
                run = partial(am.affine_gemv_triton, x, packed, scales, biases, bits, group, config)
                verdict = within_bound(run(), want, magnitude, k)
                if "FAIL" in verdict:
                    checks.append([f"sweep {label} {config}", f"{bits}/{group}", verdict])
                timed.append((bench(run), config))
            moved = nbytes(packed, scales, biases, x, want)
            base_seconds = timed[0][0]
            for seconds, config in sorted(timed, key=lambda item: item[0]):
                rows.append(
                    [
                        f"{label} {n}x{k}",
                        f"{bits}-bit g{group}",
                        str(config) + (" (heuristic)" if config == base else ""),
                        f"{seconds * 1e6:.1f}",
                        f"{moved / seconds / COPY_BANDWIDTH:.0%}",
                        f"{base_seconds / seconds:.2f}x",
                    ]
                )


def gemv_launch(n: int, k: int, bits: int, group: int) -> am.GemvConfig:
    """The M=1 GEMV launch hearth's heuristic picks on this GPU."""
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    return am.gemv_config(n, k, bits, group, sms)


def correctness_grid(checks: list[list[str]]) -> None:
    """Groups 32 and 64, bits 4 and 8, M in (1, 4, 16) GEMV and M=100 prefill, and bit-exact
    dequantization (the prefill path's weight) in bf16."""
    for n, k in CHECK_SHAPES:
        for bits in (4, 8):
            for group in (32, 64):
                packed, scales, biases = packed_weight(n, k, bits, group)
                reference = dequantize_affine(packed, scales, biases, bits, group)
                exact = torch.equal(
                    am.affine_dequantize_triton(packed, scales, biases, bits, group, BF16),
                    reference,
                )
                checks.append([f"dequantize {n}x{k}", f"{bits}/{group}", "ok" if exact else "FAIL"])
                weight = reference.to(BF16)
                for m in (1, 4, 16, 100):
                    x = torch.randn(m, k, device=DEVICE, dtype=BF16)
                    got = am.affine_linear(x, packed, scales, biases, bits, group)
                    magnitude = x.double().abs() @ weight.double().abs().T
                    verdict = within_bound(got, F.linear(x, weight), magnitude, k)
                    checks.append([f"linear M={m} {n}x{k}", f"{bits}/{group}", verdict])


def split_k_determinism(checks: list[list[str]]) -> None:
    """The split-K GEMV (small N, long K) run 200 times and replayed in a CUDA graph must give
    the same bits each time: the last-arriving program sums the partials in a fixed order."""
    n, k = SPLIT_SHAPE
    packed, scales, biases = packed_weight(n, k, 4, 64)
    x = torch.randn(1, k, device=DEVICE, dtype=BF16)
    first = am.affine_linear(x, packed, scales, biases, 4, 64)
    same = all(
        torch.equal(am.affine_linear(x, packed, scales, biases, 4, 64), first) for _ in range(200)
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        am.affine_linear(x, packed, scales, biases, 4, 64)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = am.affine_linear(x, packed, scales, biases, 4, 64)
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(torch.equal(captured, first))
    config = gemv_launch(n, k, 4, 64)
    verdict = "ok" if same and all(replays) else f"FAIL (repeat {same}, graph {replays})"
    checks.append([f"split-K {n}x{k} x200 + graph", f"4/64 [{config}]", verdict])


def prefill_rows(rows: list[list[str]], checks: list[list[str]]) -> None:
    n, k, m = PREFILL_SHAPE
    for bits in (4, 8):
        packed, scales, biases = packed_weight(n, k, bits, 64)
        x = torch.randn(m, k, device=DEVICE, dtype=BF16)
        weight = dequantize_affine(packed, scales, biases, bits, 64).to(BF16)
        got = am.affine_linear(x, packed, scales, biases, bits, 64)
        exact = torch.equal(got, F.linear(x, weight))
        checks.append([f"prefill M={m} {n}x{k}", f"{bits}/64", "ok (equal)" if exact else "FAIL"])
        seconds = bench(partial(am.affine_linear, x, packed, scales, biases, bits, 64))
        cublas = bench(partial(F.linear, x, weight))
        flops = 2 * m * n * k
        rows.append(
            [
                f"prefill M={m} {n}x{k}",
                f"{bits}-bit g64",
                f"{seconds * 1e6:.0f}",
                f"{flops / seconds / 1e12:.0f} TFLOP/s",
                f"{flops / seconds / BF16_PEAK:.0%} of 790",
                f"{cublas * 1e6:.0f} ({flops / cublas / BF16_PEAK:.0%})",
                f"{cublas / seconds:.2f}x",
                "dequantize + cuBLAS",
            ]
        )


def expert_rows(rows: list[list[str]], checks: list[list[str]]) -> None:
    experts, hidden, width, top_k = MOE_SHAPE
    sets = torch.randperm(experts, device=DEVICE).view(-1, 1, top_k)  # 16 disjoint choices
    ids = sets[0]
    for label, n, k, per_slot in (
        ("gate/up", 2 * width, hidden, False),
        ("down", hidden, width, True),
    ):
        x = torch.randn(1, *((top_k,) if per_slot else ()), k, device=DEVICE, dtype=BF16)
        for bits, unrolled in ((4, True), (4, False), (8, True), (8, False)):
            am.GATHERED_UNROLLED = unrolled
            kernel = "unrolled GEMV" if unrolled else "tile GEMV"
            group = 64
            packed, scales, biases = packed_weight(n, k, bits, group, experts)
            args = (x, packed, scales, biases, ids, bits, group)
            got = am.affine_expert_matmul(*args)
            want = am.affine_expert_matmul_reference(*args)
            if unrolled and not per_slot:  # the GeGLU store: the product, then the GeGLU
                stored = am.affine_expert_matmul(*args, geglu_out=True)
                same = torch.equal(stored, gelu_tanh_mul(got))
                checks.append([f"experts {label} storing the GeGLU", f"{bits}/{group}",
                               "bit-identical" if same else "FAIL: differs"])  # fmt: skip
            words = packed.view(torch.int32)[ids[0]].view(torch.uint32)  # no uint32 index on CUDA
            chosen = dequantize_affine(words, scales[ids[0]], biases[ids[0]], bits, group)
            rows_x = x.reshape(-1, k).expand(top_k, k).double().abs()
            magnitude = torch.einsum("pk,pnk->pn", rows_x, chosen.double().abs()).view(1, top_k, n)
            checks.append(
                [
                    f"experts {label} {n}x{k}, {kernel}",
                    f"{bits}/{group}",
                    within_bound(got, want, magnitude, k),
                ]
            )
            # 16 calls, each on 8 experts of its own: 16 x 8 distinct experts, past L2
            seconds = bench_graph(
                [partial(am.affine_expert_matmul, *args[:4], each, bits, group) for each in sets]
            )
            reference = bench(partial(am.affine_expert_matmul_reference, *args))
            ids_flat = ids[0]
            moved = nbytes(
                packed.view(torch.int32)[ids_flat], scales[ids_flat], biases[ids_flat], x, got
            )
            launch = am.gathered_gemv_config(k, bits, group)
            rows.append(
                [
                    f"experts {label} E={experts} top{top_k} {n}x{k}, {kernel}",
                    f"{bits}-bit g{group}",
                    f"{seconds * 1e6:.1f}",
                    f"{moved / seconds / 1e9:.0f}",
                    f"{moved / seconds / COPY_BANDWIDTH:.0%}",
                    f"torch ref {reference * 1e6:.0f}",
                    f"{reference / seconds:.1f}x",
                    str(launch) if unrolled else tuned_config(am._affine_tile_gemv_tuned),
                ]
            )
        am.GATHERED_UNROLLED = True
        weight = torch.randn(experts, n, k, device=DEVICE, dtype=BF16)
        got = am.float_expert_matmul(x, weight, ids)
        want = am.float_expert_matmul_reference(x, weight, ids)
        magnitude = torch.einsum(
            "pk,pnk->pn",
            x.reshape(-1, k).expand(top_k, k).double().abs(),
            weight[ids[0]].double().abs(),
        ).view(1, top_k, n)
        checks.append(
            [f"bf16 experts {label} {n}x{k}", "bf16", within_bound(got, want, magnitude, k)]
        )
        seconds = bench_graph([partial(am.float_expert_matmul, x, weight, each) for each in sets])
        reference = bench(partial(am.float_expert_matmul_reference, x, weight, ids))
        moved = nbytes(weight[ids[0]], x, got)
        rows.append(
            [
                f"experts {label} E={experts} top{top_k} {n}x{k}",
                "bf16",
                f"{seconds * 1e6:.1f}",
                f"{moved / seconds / 1e9:.0f}",
                f"{moved / seconds / COPY_BANDWIDTH:.0%}",
                f"torch ref {reference * 1e6:.0f}",
                f"{reference / seconds:.1f}x",
                tuned_config(am._float_gather_tuned),
            ]
        )


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    torch.manual_seed(0)
    checks: list[list[str]] = []
    rows: list[list[str]] = []
    if "--sweep" in sys.argv:
        gemv_sweep(rows, checks)
        report = "\n\n".join(
            [
                f"# Affine GEMV launch sweep (M=1, prefetching loop) on "
                f"{torch.cuda.get_device_name()}",
                f"torch {torch.__version__}, triton {triton.__version__}. Medians of "
                "triton.testing.do_bench; % of 4.2 TB/s over packed + scales + biases + x + "
                "out; speedup over the heuristic's launch (first row of each shape is the best).",
                table(["case", "quant", "config", "µs", "% of 4.2 TB/s", "speedup"], rows),
                "Failed checks: " + (", ".join(c[0] for c in checks) or "none"),
            ]
        )
        print(report)
        out = Path(os.environ.get("OUT", "benchmarks/results"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_gemv_prefetch_sweep.md").write_text(report + "\n")
        sys.exit(1 if checks else 0)
    if "--experts" not in sys.argv:  # --experts: the MoE gathered GEMVs alone
        correctness_grid(checks)
        split_k_determinism(checks)
        gemv_rows(rows, checks)
        prefill_rows(rows, checks)
    expert_rows(rows, checks)
    name = torch.cuda.get_device_name()
    report = "\n\n".join(
        [
            f"# Affine (MLX-layout) matmul kernels on {name}",
            f"torch {torch.__version__}, triton {triton.__version__}. Times are medians "
            "(triton.testing.do_bench). GB/s counts packed + scales + biases + x + out; "
            "% is of 4.2 TB/s copy bandwidth. cuBLAS = bf16 F.linear on the dequantized "
            "weight (its own bytes, % in brackets); speedup = cuBLAS or torch-reference time "
            "over the kernel's.",
            table(
                [
                    "case",
                    "quant",
                    "kernel µs",
                    "GB/s",
                    "% of 4.2 TB/s",
                    "baseline µs",
                    "speedup",
                    "config",
                ],
                rows,
            ),
            "## Correctness (max error / allowed error; allowed = 2 eps_bf16 |y| + "
            "(eps_bf16 + 4 sqrt(K) eps32) sum |x w|)",
            table(["check", "bits/group", "result"], checks),
        ]
    )
    print(report)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels_affine.md").write_text(report + "\n")
    failed = [c for c in checks if "FAIL" in c[-1]]
    if failed:
        sys.exit(f"{len(failed)} correctness checks failed")


if __name__ == "__main__":
    main()
