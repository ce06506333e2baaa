"""Two prefill fusions on a GPU, checked and timed at Gemma 4 26B-A4B's shapes.

* The grouped gate/up matmul storing gelu_tanh(gate) * up (`geglu=True`) against the
  [pairs, 2 * 704] product then the GeGLU kernel: elements that differ (none may: the fused
  epilogue rounds as the two launches do), at the autotuner's launch and at each GeGLU tile
  pinned for both; bf16 experts and MLX 4-bit g64; 512 and 4096 tokens. Then both timed
  (medians of triton.testing.do_bench).
* The prefill attention's output stored token-major against head-major: elements that
  differ (none may: the same values at other addresses), at head dims 256 (sliding, window
  1024) and 512 (global), 4096 tokens; timed alternating for ROUNDS rounds.
* The experts' slot outputs summed the old prefill way and the combine kernel's way, both
  against fp32.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_grouped_geglu.py
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable
from datetime import date
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton

from hearth.ops import grouped_matmul as gm
from hearth.ops import prefill_attention as pa
from hearth.ops.activation import gelu_tanh_mul_triton
from hearth.ops.slot_sum import weighted_slot_sum
from hearth.quant.mlx import pack_codes

DEVICE = torch.device("cuda")
BF16 = torch.bfloat16
EXPERTS, HIDDEN, WIDTH, TOP_K = 128, 2816, 704, 8
TOKENS = (512, 4096)
ROUNDS = 3


def bench(fn: Callable[[], object]) -> float:
    """Median seconds per call."""
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


def differing(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a != b).sum().item()} of {a.numel()}"


def experts(bits: int | None) -> tuple[Callable, str]:
    """A launcher of the grouped gate/up matmul over random experts, and its label."""
    if bits is None:
        weight = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=DEVICE) / math.sqrt(HIDDEN)).to(
            BF16
        )
        return lambda x, ids, **kw: gm.grouped_expert_matmul_triton(x, weight, ids, **kw), "bf16"
    codes = torch.randint(0, 16, (EXPERTS, 2 * WIDTH, HIDDEN), dtype=torch.uint8, device=DEVICE)
    scales = (torch.rand(EXPERTS, 2 * WIDTH, HIDDEN // 64, device=DEVICE) * 0.004 + 5e-4).to(BF16)
    biases = (-scales.float() * 8).to(BF16)
    packed = (pack_codes(codes, 4), scales, biases)

    def launch(x, ids, **kw):
        return gm.grouped_affine_expert_matmul_triton(x, *packed, ids, 4, 64, **kw)

    return launch, "4-bit g64"


def product_then_geglu(launch: Callable, x, ids, plan) -> torch.Tensor:
    return gelu_tanh_mul_triton(launch(x, ids, plan=plan))


def o_proj_input(q, k, v, positions, window) -> torch.Tensor:
    """The attention's output as the output projection reads it: [1, M, H * D]."""
    out = pa.prefill_attention_triton(q, k, v, positions, positions, window, 1.0)
    return out.transpose(1, 2).reshape(1, q.shape[2], -1)


def geglu_rows() -> list[str]:
    rows = []
    for bits in (None, 4):
        launch, label = experts(bits)
        for tokens in TOKENS:
            logits = torch.randn(tokens, EXPERTS, device=DEVICE) + torch.randn(
                EXPERTS, device=DEVICE
            )
            ids = logits.topk(TOP_K, dim=-1).indices
            x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=BF16)
            plan = gm.plan_experts(
                ids, EXPERTS, gm.default_block_m(ids.numel(), EXPERTS, bits is not None)
            )
            fused = launch(x, ids, plan=plan, geglu=True)
            apart = gelu_tanh_mul_triton(launch(x, ids, plan=plan))
            checks = [f"autotuned: {differing(fused, apart)}"]
            tiles = gm._GEGLU_TALL_TILES if plan.block_m >= 64 else gm._SHORT_TILES
            for n, k, warps, stages in tiles:
                config = {"BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}
                pinned = launch(x, ids, plan=plan, config=config, geglu=True)
                pinned_apart = gelu_tanh_mul_triton(launch(x, ids, plan=plan, config=config))
                checks.append(f"{n}x{k} w{warps} s{stages}: {differing(pinned, pinned_apart)}")
            fused_s = bench(partial(launch, x, ids, plan=plan, geglu=True))
            product_s = bench(partial(launch, x, ids, plan=plan))
            apart_s = bench(partial(product_then_geglu, launch, x, ids, plan))
            flops = 2 * tokens * TOP_K * 2 * WIDTH * HIDDEN
            rows.append(
                f"| {label} T={tokens} (BLOCK_M {plan.block_m}) | {fused_s * 1e6:.0f} "
                f"({flops / fused_s / 1e12:.0f} TFLOP/s) | {apart_s * 1e6:.0f} (product "
                f"{product_s * 1e6:.0f}) | {apart_s / fused_s - 1:+.1%} | {'; '.join(checks)} |"
            )
            print(rows[-1], flush=True)
    return rows


def attention_rows() -> list[str]:
    rows = []
    tokens = 4096
    for dim, heads, kv_heads, window in ((256, 16, 8, 1024), (512, 16, 2, None)):
        q = torch.randn(1, tokens, heads, dim, device=DEVICE, dtype=BF16).transpose(1, 2) * 0.06
        k = torch.randn(1, kv_heads, tokens, dim, device=DEVICE, dtype=BF16)
        v = torch.randn(1, kv_heads, tokens, dim, device=DEVICE, dtype=BF16)
        positions = torch.arange(tokens, device=DEVICE)
        outputs, times = {}, {True: [], False: [], "kernel": []}
        call = partial(o_proj_input, q, k, v, positions, window)
        kernel = partial(pa.prefill_attention_triton, q, k, v, positions, positions, window, 1.0)
        for _ in range(ROUNDS):  # alternating, so that clocks and heat favour neither
            for token_major in (False, True):
                pa.TOKEN_MAJOR_OUTPUT = token_major
                outputs[token_major] = call()
                times[token_major].append(bench(call))
                if not token_major:
                    times["kernel"].append(bench(kernel))
        pa.TOKEN_MAJOR_OUTPUT = True
        fast, slow, alone = (statistics.median(times[key]) for key in (True, False, "kernel"))
        rows.append(
            f"| D={dim}, {heads} heads, window {window} | {fast * 1e6:.0f} | "
            f"{slow * 1e6:.0f} (kernel {alone * 1e6:.0f}) | {slow / fast - 1:+.1%} | "
            f"{differing(outputs[True], outputs[False])} |"
        )
        print(rows[-1], flush=True)
    return rows


def slot_sum_rows() -> list[str]:
    """The down matmul's slots summed three ways against an fp32 oracle (fp32 weights and
    inputs, the same bf16 values): rows scaled in the matmul then a torch sum (the prefill
    before); unscaled rows weighted and summed with `weighted_slot_sum`'s roundings (the
    combine kernel's at a decode step: two roundings a slot); scaled rows summed by those
    roundings with unit weights (the combine kernel's at a prefill now)."""
    tokens = 4096
    weight = (torch.randn(EXPERTS, HIDDEN, WIDTH, device=DEVICE) / math.sqrt(WIDTH)).to(BF16)
    logits = torch.randn(tokens, EXPERTS, device=DEVICE) + torch.randn(EXPERTS, device=DEVICE)
    top, ids = logits.topk(TOP_K, dim=-1)
    route = top.softmax(dim=-1)
    hidden = (torch.randn(tokens, TOP_K, WIDTH, device=DEVICE) * 0.5).to(BF16)
    plan = gm.plan_experts(ids, EXPERTS)
    scaled = gm.grouped_expert_matmul(hidden, weight, ids, route, plan)
    per_slot = gm.grouped_expert_matmul(hidden, weight, ids, None, plan)
    weighted_in_combine = weighted_slot_sum(per_slot, route)
    scaled_in_combine = weighted_slot_sum(scaled, torch.ones_like(route))
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 oracle, not TF32
    exact = gm.grouped_expert_matmul_reference(hidden.float(), weight.float(), ids, route)
    exact = exact.double().sum(dim=1)
    rows = []
    for label, got in (
        ("rows scaled in the matmul, then a torch sum (before)", scaled.sum(dim=1)),
        ("rows unscaled, weighted and summed in the norm kernel", weighted_in_combine),
        ("rows scaled in the matmul, summed in the norm kernel (now)", scaled_in_combine),
    ):
        error = (got.double() - exact).abs()
        rows.append(
            f"| {label} | {error.max().item():.3g} | {error.mean().item():.3g} | "
            f"{exact.abs().max().item():.3g} |"
        )
        print(rows[-1], flush=True)
    return rows


PARTS = {
    "geglu": (
        "Experts' gate/up [128, 1408, 2816], top-8 routing; µs per call (median).",
        "| case | gate/up storing the GeGLU, µs | product + GeGLU kernel, µs | saved | elements "
        "that differ (fused vs apart) |",
        geglu_rows,
    ),
    "attention": (
        "Prefill attention, 4096 tokens, bf16, then the output projection's [1, 4096, H*D] "
        "input; µs per call (median).",
        "| shape | token-major output | head-major + copy | saved | elements that differ |",
        attention_rows,
    ),
    "slot-sum": (
        "26B-A4B's expert outputs summed over the 8 slots, 4096 tokens, bf16, against fp32 "
        "(errors in the summed [4096, 2816] output):",
        "| slot sum | max error | mean error | largest exact value |",
        slot_sum_rows,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS)
    )
    torch.manual_seed(0)
    lines = [
        f"# Prefill fusions at 26B-A4B shapes ({date.today()}, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__})",
    ]
    for part in parser.parse_args().parts.split(","):
        what, header, rows = PARTS[part]
        columns = header.count("|") - 1
        lines += ["", what, "", header, "|" + "---|" * columns, *rows()]
    out = Path(os.environ.get("OUT", "benchmarks/results/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_grouped_geglu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
