"""The MoE prefill's experts: Hearth's grouped Triton matmul against torch's `_grouped_mm`
(CUTLASS, sm90, bf16 only), at Gemma 4 26B-A4B's shapes.

`_grouped_mm` multiplies rows sorted by expert ([pairs, K], contiguous) by each expert's
weight given the experts' row offsets on the device, so it needs the activations gathered in
expert order first, and its output comes back in that order. Timed here, per layer, median of
triton.testing.do_bench:

* Hearth: plan, gate/up storing the GeGLU, down scaled by the routing weights ([T, 8, H] in
  pair order, as the norm kernel sums it);
* torch: the same plan's order, the gather, `_grouped_mm` gate/up, the GeGLU kernel,
  `_grouped_mm` down, the rows scaled and put back in pair order;
* each `_grouped_mm` alone, against Hearth's kernel alone.

Both results against an fp32 per-expert oracle (max and mean error), and the torch path
replayed from a CUDA graph once (it must not sync with the host).

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_grouped_mm_torch.py
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from datetime import date
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton

from hearth.ops import grouped_matmul as gm
from hearth.ops.activation import gelu_tanh_mul_triton

DEVICE = torch.device("cuda")
BF16 = torch.bfloat16
EXPERTS, HIDDEN, WIDTH, TOP_K = 128, 2816, 704, 8
TOKENS = (512, 1024, 4096)


def bench(fn: Callable[[], object]) -> float:
    """Median seconds per call."""
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3


def hearth_experts(x, gate_up, down, ids, route):
    plan = gm.plan_experts(ids, EXPERTS, gm.default_block_m(ids.numel(), EXPERTS))
    hidden = gm.grouped_expert_matmul_triton(x, gate_up, ids, plan=plan, geglu=True)
    return gm.grouped_expert_matmul_triton(hidden, down, ids, route, plan)


def sorted_order(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs in expert order (stable) and each expert's end row, int32 (on the device)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(EXPERTS, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync with the host
    ends = counts.cumsum(0).to(torch.int32)
    return order, ends


def torch_experts(x, gate_up_t, down_t, ids, route):
    order, ends = sorted_order(ids)
    rows = x.index_select(0, order // TOP_K)
    hidden = gelu_tanh_mul_triton(torch._grouped_mm(rows, gate_up_t, ends))
    y_sorted = torch._grouped_mm(hidden, down_t, ends)
    scaled = (y_sorted.float() * route.reshape(-1)[order, None]).to(BF16)
    y = torch.empty_like(scaled)
    y[order] = scaled
    return y.view(ids.shape[0], TOP_K, HIDDEN)


def oracle(x, gate_up, down, ids, route) -> torch.Tensor:
    torch.backends.cuda.matmul.allow_tf32 = False
    hidden = gm.grouped_expert_matmul_reference(x.float(), gate_up.float(), ids, geglu=True)
    return gm.grouped_expert_matmul_reference(hidden, down.float(), ids, route)


def error(got: torch.Tensor, exact: torch.Tensor) -> str:
    diff = (got.float() - exact).abs()
    return f"{diff.max().item():.3g} / {diff.mean().item():.3g}"


def main() -> None:
    torch.manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=DEVICE) / math.sqrt(HIDDEN)).to(BF16)
    down = (torch.randn(EXPERTS, HIDDEN, WIDTH, device=DEVICE) / math.sqrt(WIDTH)).to(BF16)
    gate_up_t, down_t = gate_up.transpose(1, 2), down.transpose(1, 2)  # [E, K, N] views
    rows = []
    for tokens in TOKENS:
        logits = torch.randn(tokens, EXPERTS, device=DEVICE) + torch.randn(EXPERTS, device=DEVICE)
        top, ids = logits.topk(TOP_K, dim=-1)
        route = top.softmax(dim=-1)
        x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=BF16)
        exact = oracle(x, gate_up, down, ids, route)
        ours = hearth_experts(x, gate_up, down, ids, route)
        theirs = torch_experts(x, gate_up_t, down_t, ids, route)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch_experts(x, gate_up_t, down_t, ids, route)
        graph.replay()
        torch.cuda.synchronize()
        replay_same = bool(torch.equal(captured, theirs))

        pairs = tokens * TOP_K
        flops = 2 * pairs * (2 * WIDTH * HIDDEN + HIDDEN * WIDTH)
        ours_s = bench(partial(hearth_experts, x, gate_up, down, ids, route))
        theirs_s = bench(partial(torch_experts, x, gate_up_t, down_t, ids, route))
        graph_s = bench(graph.replay)
        order, ends = sorted_order(ids)
        sorted_rows = x.index_select(0, order // TOP_K)
        hidden = gelu_tanh_mul_triton(torch._grouped_mm(sorted_rows, gate_up_t, ends))
        gu_flops, down_flops = 2 * pairs * 2 * WIDTH * HIDDEN, 2 * pairs * HIDDEN * WIDTH
        plan = gm.plan_experts(ids, EXPERTS, gm.default_block_m(pairs, EXPERTS))
        ours_gu = bench(partial(gm.grouped_expert_matmul_triton, x, gate_up, ids, plan=plan))
        ours_down = bench(
            partial(
                gm.grouped_expert_matmul_triton,
                hidden.view(tokens, TOP_K, -1),
                down,
                ids,
                route,
                plan,
            )
        )
        theirs_gu = bench(partial(torch._grouped_mm, sorted_rows, gate_up_t, ends))
        theirs_down = bench(partial(torch._grouped_mm, hidden, down_t, ends))
        gather_s = bench(partial(x.index_select, 0, order // TOP_K))

        def tf(f, s):
            return f"{s * 1e6:.0f} ({f / s / 1e12:.0f})"

        rows.append(
            f"| {tokens} | {tf(flops, ours_s)} | {tf(flops, theirs_s)} (graph {graph_s * 1e6:.0f})"
            f" | {tf(gu_flops, ours_gu)} / {tf(gu_flops, theirs_gu)} | "
            f"{tf(down_flops, ours_down)} / {tf(down_flops, theirs_down)} | {gather_s * 1e6:.0f} | "
            f"{error(ours, exact)} | {error(theirs, exact)} | {replay_same} |"
        )
        print(rows[-1], flush=True)

    props = torch.cuda.get_device_properties(DEVICE)
    text = (
        f"# MoE prefill experts: Hearth's grouped matmul vs torch._grouped_mm "
        f"({date.today()}, {props.name}, torch {torch.__version__}, triton {triton.__version__})"
        "\n\n26B-A4B experts (128 x [1408, 2816] gate/up, [2816, 704] down, top-8), bf16, "
        "random routing. µs per layer (TFLOP/s); errors are max / mean against an fp32 "
        "oracle over the [T, 8, 2816] scaled slot outputs.\n\n"
        "| tokens | Hearth: plan + gate/up·GeGLU + down | torch: order + gather + 2 x _grouped_mm "
        "+ GeGLU + scatter | gate/up alone, Hearth / torch | down alone, Hearth / torch | "
        "gather µs | Hearth error | torch error | graph replay equal |\n"
        "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    out = Path(os.environ.get("OUT", "."))
    name = os.environ.get("NAME", "gpu_grouped_mm_torch")
    (out / f"{name}-{date.today()}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
