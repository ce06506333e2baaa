"""Launch sweep of the grouped MoE matmul (prefill) at Gemma 4 26B-A4B's shapes, bf16 experts.

For a 4096-token prefill (tiles of `default_block_m` rows, 128 at this size) times every
(BLOCK_N, BLOCK_K, warps, stages) of a grid, and the swizzle width GROUP_M, on the gate/up
and down projections, beside the autotuned launch the model takes. Each result is checked
against the autotuned one: the same dot products summed in other K steps, so within two bf16
roundings of the output (2 eps_bf16 |y|) plus 0.01 absolute for outputs of size ~1 (inputs
N(0, 1), weights scaled by K^-1/2), far above fp32 reordering and far below any wrong row.
Medians of triton.testing.do_bench (L2 flushed between calls).

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_grouped_sweep.py
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton

from hearth.ops import grouped_matmul as gm

EXPERTS, HIDDEN, WIDTH, TOP_K, TOKENS = 128, 2816, 704, 8, 4096
PROJECTIONS = {"gate/up": (2 * WIDTH, HIDDEN), "down": (HIDDEN, WIDTH)}  # N, K
TILES = list(itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (3, 4)))
GROUP_MS = (1, 4, 8, 16)
PEAK = 790e12
DEVICE = torch.device("cuda")


def time_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def main() -> None:
    torch.manual_seed(0)
    out_dir = Path(os.environ.get("OUT", "benchmarks/results/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    logits = torch.randn(TOKENS, EXPERTS, device=DEVICE) + torch.randn(EXPERTS, device=DEVICE)
    ids = logits.topk(TOP_K, dim=-1).indices
    block_m = gm.default_block_m(ids.numel(), EXPERTS)
    plan = gm.plan_experts(ids, EXPERTS, block_m)
    rows: list[dict] = []
    for name, (n, k) in PROJECTIONS.items():
        weight = torch.randn(EXPERTS, n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5
        x = torch.randn(TOKENS, k, device=DEVICE, dtype=torch.bfloat16)
        if name == "down":
            x = torch.randn(TOKENS, TOP_K, k, device=DEVICE, dtype=torch.bfloat16)
        flops = 2 * ids.numel() * n * k

        def run(config=None, x=x, weight=weight):
            return gm.grouped_expert_matmul_triton(x, weight, ids, plan=plan, config=config)

        reference = run()
        bound = 2 * torch.finfo(torch.bfloat16).eps * reference.float().abs() + 1e-2
        tuned = time_ms(run)
        rows.append({"shape": name, "config": "autotuned", "ms": tuned, "ok": True})
        print(f"{name} autotuned {tuned:.3f} ms", flush=True)
        for bn, bk, warps, stages in TILES:
            config = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            label = f"N{bn} K{bk} w{warps} s{stages}"
            try:
                got = run(config)
                ok = bool(((got.float() - reference.float()).abs() <= bound).all())
                ms = time_ms(lambda c=config: run(c))
            except Exception as error:  # out of shared memory, registers: not a candidate
                print(f"{name} {label}: {type(error).__name__}", flush=True)
                continue
            rows.append({"shape": name, "config": label, "ms": ms, "ok": ok, "cfg": config})
            print(f"{name} {label} {ms:.3f} ms ok={ok}", flush=True)
        best = min((r for r in rows if r["shape"] == name and "cfg" in r), key=lambda r: r["ms"])
        for group_m in GROUP_MS:
            original = gm.GROUP_M
            gm.GROUP_M = group_m
            try:
                ms = time_ms(lambda c=best["cfg"]: run(c))
            finally:
                gm.GROUP_M = original
            label = f"{best['config']} GROUP_M {group_m}"
            rows.append({"shape": name, "config": label, "ms": ms, "ok": True})
            print(f"{name} {label} {ms:.3f} ms", flush=True)
        for row in rows:
            if row["shape"] == name:
                row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    lines = [
        f"# Grouped MoE matmul launch sweep ({date}, {gpu}, torch {torch.__version__}, "
        f"triton {triton.__version__})",
        "",
        f"26B-A4B experts (E={EXPERTS}, top-{TOP_K}), bf16, {TOKENS} tokens, tiles of "
        f"{block_m} rows. ms: median of do_bench; % of {PEAK / 1e12:.0f} TFLOP/s.",
        "",
        "| shape | launch | ms | TFLOP/s | % of peak | check |",
        "|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["shape"], r["ms"])):
        tflops = row["tflops"]
        check = "ok" if row["ok"] else "MISMATCH"
        lines.append(
            f"| {row['shape']} | {row['config']} | {row['ms']:.3f} | {tflops:.0f} | "
            f"{100 * tflops * 1e12 / PEAK:.1f}% | {check} |"
        )
    (out_dir / "gpu_grouped_sweep.md").write_text("\n".join(lines) + "\n")
    clean = [{key: value for key, value in r.items() if key != "cfg"} for r in rows]
    (out_dir / "gpu_grouped_sweep.json").write_text(json.dumps(clean, indent=1))


if __name__ == "__main__":
    main()
