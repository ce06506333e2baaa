"""L2 hints ahead of the GEMVs (`hearth.kernels.l2_ahead`): what is asked for, where, and
that the kernel compiles for Hopper in the order that keeps the stream's ordering.

The hints cannot change a value, so on the GPU the check is that logits stay bit-identical
with them on (`benchmarks/ab_decode.py --check`, variants `l2-ahead*`). Here: the byte budget
by hand, the model's calls (which weights, in which order) on a tiny Gemma 4, and the sm_90
PTX of the kernel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hearth.checkpoint import open_checkpoint
from hearth.kernels import l2_ahead
from hearth.models import gemma4
from hearth.models.loading import build_model
from test_gemma4 import CONFIGS
from test_kernels_compile import _compiler_environment
from tiny import save_hf, tiny_gemma4_model

LINE = l2_ahead.LINE_BYTES


def test_spans_take_each_weights_first_lines_within_the_budget() -> None:
    o = torch.empty(40, 64, dtype=torch.bfloat16)  # 5,120 bytes: 40 lines
    gate_up = torch.empty(100, 64, dtype=torch.bfloat16)  # 12,800 bytes
    # 64 lines in all: o's 40, then gate/up's first 24; a third weight gets nothing.
    chosen = l2_ahead.spans([o, gate_up, o], max_bytes=64 * LINE + 100)
    assert [(weight is o, lines) for weight, lines in chosen] == [(True, 40), (False, 24)]
    everything = l2_ahead.spans([o, gate_up], max_bytes=1 << 30)
    assert [lines for _, lines in everything] == [40, 100]
    assert l2_ahead.spans([o], max_bytes=LINE - 1) == []


def test_spans_refuse_a_non_contiguous_weight() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        l2_ahead.spans([torch.empty(64, 64).t()], max_bytes=1 << 20)


def test_prefetch_weights_launches_nothing_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(l2_ahead, "L2_AHEAD", True)

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("launched off the GPU")

    monkeypatch.setattr(l2_ahead, "launch_kernel", fail)
    l2_ahead.prefetch_weights([torch.empty(8, 64)], torch.empty(1, 1, 64))


@pytest.mark.parametrize("config", ["moe", "ple"])
def test_each_layer_asks_for_the_weights_it_reads_next(
    config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a decode step: after the q/k/v projection, o_proj and the MLP's gate/up (read after
    the attention); after the feed-forward, the next layer's q/k/v (none after the last)."""
    hf = tiny_gemma4_model(seed=5, **CONFIGS[config])
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, "cpu", False)
    asked: list[list[torch.Tensor]] = []
    monkeypatch.setattr(gemma4, "prefetch_weights", lambda weights, x: asked.append(list(weights)))
    with torch.inference_mode():
        model(torch.tensor([[5]]))
    expected: list[list[torch.Tensor]] = []
    layers = list(model.layers)
    for index, layer in enumerate(layers):
        expected.append([layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.proj.weight])
        following = layers[index + 1 :]
        expected.append([following[0].self_attn.qkv_proj.proj.weight] if following else [])
    assert len(asked) == len(expected)
    for got, want in zip(asked, expected, strict=True):
        assert [w.data_ptr() for w in got] == [w.data_ptr() for w in want]


# Compiles the kernel as an H200 launches it (PDL on) and prints where its first launch of
# dependents, first L2 hint and wait fall in the PTX.
COMPILER = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hearth.kernels import l2_ahead

signature = {"PDL": "constexpr"}
for name, kind in (("first", "*bf16"), ("second", "*bf16"), ("third", "*u8")):
    signature[name], signature[name + "_lines"] = kind, "i32"
source = ASTSource(l2_ahead._l2_ahead_kernel, signature, {"PDL": True})
options = {"num_warps": 4, "launch_pdl": True}
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
marks = ("griddepcontrol.launch_dependents", "prefetch.global.L2", "griddepcontrol.wait")
print(json.dumps([ptx.find(mark) for mark in marks] + [ptx.count(marks[1])]))
"""


def test_the_kernel_lets_the_next_launch_hints_then_waits_on_hopper() -> None:
    """The next kernel may launch first; this one completes only after its predecessor,
    so the next kernel's wait still follows every kernel before (see the module's doc)."""
    result = subprocess.run(
        [sys.executable, "-c", COMPILER],
        capture_output=True,
        text=True,
        env=_compiler_environment(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    launch, hint, wait, hints = json.loads(result.stdout)
    assert 0 <= launch < hint < wait
    assert hints == 3  # one hint loop per weight
