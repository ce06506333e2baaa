"""Self and inclusive sample counts from py-spy's collapsed stacks, for the frames under one
function (e.g. `prefill`): which Python (or native) frames a host-bound forward spends on.

    py-spy record -f raw -o stacks.txt -r 2000 -- \
        python benchmarks/lab/gpu_host_breakdown.py --loop 40
    python benchmarks/lab/pyspy_summary.py stacks.txt prefill > summary.md
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path


def main() -> None:
    path, under = sys.argv[1], sys.argv[2]
    own, inclusive = Counter(), Counter()
    total = 0
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        marks = [i for i, frame in enumerate(frames) if frame.startswith(f"{under} (")]
        if not marks or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = frames[marks[0] :]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    print(f"# py-spy samples under `{under}`: {total}\n")
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"\n| frame ({title}) | samples | share |\n|---|---|---|")
        for frame, count in counter.most_common(40):
            print(f"| `{frame[:110]}` | {count} | {count / max(total, 1):.1%} |")


if __name__ == "__main__":
    main()
