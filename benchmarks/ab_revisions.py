"""Two source trees of Hearth timed by `hearth bench`, alternating, on one machine.

A change that must not cost speed (issue 40's redesign) is checked by running the same bench
from the tree before it and the tree after it, in alternating order, in one session on one
machine (GPUs of one kind differ by a few percent): each (model, quantization) pair is one
`hearth bench --random` process per tree and round. The table gives each tree's median
decode and prefill tok/s and the change.

    python benchmarks/ab_revisions.py --base /path/to/old/src --new src \\
        --models gemma3-12b,e4b,26b-a4b --quant none,4bit --rounds 2 --out table.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROW = re.compile(r"^\| (decode|prefill) \| (\d+) \| ([\d,.]+) \|")


def bench(tree: str, model: str, quant: str, extra: list[str]) -> dict[tuple[str, int], float]:
    """tok/s by (phase, tokens) of one `hearth bench` run from `tree`."""
    with tempfile.NamedTemporaryFile(suffix=".md") as table:
        command = [sys.executable, "-m", "hearth.cli", "bench", "--random", model]
        command += [] if quant == "none" else ["--quant", quant]
        command += [*extra, "--out", table.name]
        environment = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        subprocess.run(command, env=environment, check=True, capture_output=True, text=True)
        rows = {}
        for line in Path(table.name).read_text().splitlines():
            if match := ROW.match(line):
                rows[(match[1], int(match[2]))] = float(match[3].replace(",", ""))
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the older tree's src/ folder")
    parser.add_argument("--new", required=True, help="the newer tree's src/ folder")
    parser.add_argument("--models", default="gemma3-12b,e4b,26b-a4b")
    parser.add_argument("--quant", default="none,4bit", help="none and/or 4bit, 8bit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--bench-args", default="--contexts 512 --prefill 4096", help="passed to hearth bench"
    )
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    extra = args.bench_args.split()
    lines = [
        f"# Hearth revisions A/B ({datetime.date.today()}), `hearth bench {args.bench_args}`",
        "",
        f"base: `{args.base}`, new: `{args.new}`; {args.rounds} rounds, alternating order; "
        "median tok/s of the rounds.",
        "",
        "| model | weights | phase | tokens | base tok/s | new tok/s | change |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in args.models.split(","):
        for quant in args.quant.split(","):
            runs: dict[str, list[dict[tuple[str, int], float]]] = {"base": [], "new": []}
            for round_index in range(args.rounds):
                order = ("base", "new") if round_index % 2 == 0 else ("new", "base")
                for name in order:
                    tree = args.base if name == "base" else args.new
                    runs[name].append(bench(tree, model, quant, extra))
                    print(f"{model} {quant} round {round_index + 1} {name}: {runs[name][-1]}")
            for key in runs["base"][0]:
                base = statistics.median(run[key] for run in runs["base"])
                new = statistics.median(run[key] for run in runs["new"])
                change = f"{100 * (new / base - 1):+.1f}%"
                phase, tokens = key
                lines.append(
                    f"| {model} | {quant} | {phase} | {tokens} | {base:,.1f} | {new:,.1f} | "
                    f"{change} |"
                )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
