"""The L2 prefetch branch: its byte plan, that it is inert off a GPU capture, that its kernel
compiles to Hopper's bulk prefetch, and (on a GPU) that a captured step reading a prefetched
weight gives exactly what the same step gives eagerly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hearth
from hearth.kernels import l2_prefetch
from hearth.kernels.l2_prefetch import ALIGN, LANES, MAX_CHUNK, plan_prefetch


def _covered(plan: l2_prefetch.PrefetchPlan) -> list[tuple[int, int]]:
    ranges = plan.ranges()
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end == start, "lanes must tile the bytes with no gap or overlap"
    return ranges


@pytest.mark.parametrize(
    ("nbytes", "programs", "chunk", "used"),
    [
        # Gemma 3 12B o_proj (3840 x 4096 bf16) over 132 SMs: ceil(31457280 / 4224) = 7448
        # bytes a lane, rounded up to 16 -> 7456; 132 programs of 32 such lanes cover it.
        (3840 * 4096 * 2, 132, 7456, 132),
        # 100 bytes: the last 4 are not a whole 16-byte unit and are left out.
        (100, 132, 16, 1),
        # 3 GiB: lanes stop at MAX_CHUNK, so more programs than asked.
        (3 * 2**30, 132, MAX_CHUNK, 3 * 2**30 // (MAX_CHUNK * LANES)),
    ],
)
def test_plan_tiles_the_aligned_bytes(nbytes: int, programs: int, chunk: int, used: int) -> None:
    plan = plan_prefetch(nbytes, programs)
    assert (plan.chunk, plan.programs) == (chunk, used)
    assert plan.size == nbytes - nbytes % ALIGN
    ranges = _covered(plan)
    assert ranges[0][0] == 0 and ranges[-1][1] == plan.size
    assert all((end - start) % ALIGN == 0 and end - start <= MAX_CHUNK for start, end in ranges)


def test_plan_of_nothing_and_bad_input() -> None:
    assert plan_prefetch(15, 4).ranges() == []
    with pytest.raises(ValueError, match="cannot plan"):
        plan_prefetch(-1, 4)
    with pytest.raises(ValueError, match="cannot plan"):
        plan_prefetch(64, 0)


def test_branch_is_inert_off_a_gpu_capture() -> None:
    weight = torch.randn(8, 8)
    join = l2_prefetch.prefetch_branch([weight], weight)
    assert join() is None  # no stream, no launch: CPU tensors run nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="compiles through the CPU toolchain")
def test_kernel_compiles_to_hopper_bulk_prefetch() -> None:
    pytest.importorskip("triton")
    script = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hearth.kernels import l2_prefetch
source = ASTSource(
    l2_prefetch._l2_prefetch_kernel,
    {"base": "i64", "size": "i64", "chunk": "i32", "LANES": "constexpr"},
    {"LANES": l2_prefetch.LANES},
)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
print(json.dumps({"ptx": compiled.asm["ptx"], "cubin": len(compiled.asm["cubin"])}))
"""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    source_root = str(Path(hearth.__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join([source_root, environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment
    )
    assert result.returncode == 0, result.stderr[-2000:]
    compiled = json.loads(result.stdout)
    assert compiled["cubin"] > 0  # ptxas accepted it for sm_90
    assert "cp.async.bulk.prefetch.L2.global" in compiled["ptx"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_step_with_prefetch_matches_eager() -> None:
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("bulk prefetch needs Hopper")
    x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    weight = torch.randn(3840, 4096, device=device, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        join = l2_prefetch.prefetch_branch([weight], x)
        hidden = torch.tanh(x) * 2  # work beside the branch
        join()
        return hidden @ weight.T

    eager = step()  # also warms the kernel up outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
