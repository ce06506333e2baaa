"""The GPU benchmark suite names only A/B variants that `benchmarks/ab_decode.py` defines:
a renamed or dropped variant would otherwise surface only on the device, as a failed stage
in a call that costs device time."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_every_variant_the_gpu_suite_names_exists() -> None:
    pytest.importorskip("triton")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import ab_decode
    finally:
        sys.path.remove(str(BENCHMARKS))
    suite = (BENCHMARKS / "gpu_suite.sh").read_text()
    named = {
        variant
        for listed in re.findall(r"--variants ([\w,.-]+)", suite)
        for variant in listed.split(",")
    }
    assert len(named) > 20  # the pattern still finds the suite's lists
    assert named <= set(ab_decode.VARIANTS), sorted(named - set(ab_decode.VARIANTS))
