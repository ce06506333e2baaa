"""Set-up for the lab's tests (`pytest benchmarks/lab/tests`, outside the default suite): the
lab's scripts importable by name, as they import each other, and Triton's interpreter where
there is no GPU, set before any kernel module is imported (`triton.jit` reads it then)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

LAB = Path(__file__).resolve().parents[1]
ROOT = LAB.parents[1]
sys.path.insert(0, str(LAB))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def compiler_environment() -> dict[str, str]:
    """A subprocess environment that compiles the lab's kernels with Triton's real compiler
    (not its interpreter), the lab's scripts and this tree's sources first on the path."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([str(LAB), str(ROOT / "src")])
    return environment
