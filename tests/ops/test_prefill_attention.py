"""Prefill (flash) attention: the Triton kernel (interpreter on CPU) vs its torch reference,
and both vs a naive fp64 oracle that loops over queries and writes the visibility rule out.

Tolerances (outputs are softmax averages of V ~ N(0, 1), so |out| < ~4):
* fp32 kernel vs reference: 2e-5. Same fp32 data and fp32 (IEEE) dots; only summation
  order and exp2 vs exp differ, each ~1e-6 relative.
* fp16 kernel vs reference: 3e-3. The kernel rounds softmax weights to fp16 for the P·V
  product (relative 2^-11 each: ≤ 4.9e-4·max|v| ≈ 2e-3 at |v| ≈ 4) and both round the
  output to fp16 (half an ulp below 4 is 9.8e-4, so they may differ by one ulp).
* vs the fp64 oracle: fp32 1e-5 (fp32 rounding of matmuls and softmax); fp16 2e-3 (output
  rounded to fp16, plus the kernel's fp16 weights).
Tiles are shrunk (16×16) so a few dozen queries/keys span several blocks of each kind.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hearth.kv.cache import EMPTY_POSITION
from hearth.ops import prefill_attention as pa
from hearth.ops.prefill_attention import (
    LaunchConfig,
    key_block_bounds,
    prefill_attention,
    prefill_attention_reference,
    prefill_attention_triton,
)

triton = pytest.importorskip("triton")

KERNEL_TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3}
ORACLE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
SMALL_TILES = LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
# Largest dynamic shared memory one block may use on H100/H200 (227 KiB).
HOPPER_SHARED_MEMORY = 232448

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests; the GPU script checks compiled kernels"
)


@pytest.fixture(autouse=True)
def _interpreter_scalar_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and converts them for a
    loop bound with int(array), which numpy 2 refuses for arrays of rank 1: take the
    element instead, so the kernel's runtime-bounded loops run as they do on a GPU."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


# ---------------------------------------------------------------------------------------------
# Oracle


def _oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """fp64, one query at a time, over the keys the rule lets it see (none: zeros)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    batch, heads, queries, dim = q.shape
    groups = heads // k.shape[1]
    keys = key_positions.tolist()
    out = torch.zeros(batch, heads, queries, dim, dtype=torch.float64)
    for m, query in enumerate(query_positions.tolist()):
        seen = [
            n
            for n, key in enumerate(keys)
            if 0 <= key < EMPTY_POSITION
            and key <= query
            and (window is None or query - key < window)
        ]
        if not seen:
            continue
        for b in range(batch):
            for h in range(heads):
                scores = k64[b, h // groups, seen] @ q64[b, h, m] * scale
                weights = torch.exp(scores - scores.max())
                out[b, h, m] = (weights / weights.sum()) @ v64[b, h // groups, seen]
    return out


def _inputs(
    batch: int, heads: int, kv_heads: int, queries: int, keys: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(queries * 1000 + keys + dim + heads)
    q = torch.randn(batch, heads, queries, dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, keys, dim, generator=generator).to(dtype)
    return q, k, v


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    scale: float,
    config: LaunchConfig = SMALL_TILES,
) -> torch.Tensor:
    args = (q, k, v, query_positions, key_positions, window, scale)
    got = prefill_attention_triton(*args, config=config)
    reference = prefill_attention_reference(*args)
    oracle = _oracle(*args)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(
        got.float(), reference.float(), rtol=0, atol=KERNEL_TOLERANCE[q.dtype]
    )
    torch.testing.assert_close(reference.double(), oracle, rtol=0, atol=ORACLE_TOLERANCE[q.dtype])
    torch.testing.assert_close(
        got.double(), oracle, rtol=0, atol=KERNEL_TOLERANCE[q.dtype] + ORACLE_TOLERANCE[q.dtype]
    )
    return got


# ---------------------------------------------------------------------------------------------
# Kernel vs reference vs oracle


# (batch, Hq, Hkv, queries = keys, D, dtype, window, scale)
SELF_ATTENTION_CASES = {
    "causal-gqa1-d64-fp32": (1, 2, 2, 40, 64, torch.float32, None, 64**-0.5),
    "sliding-gqa2-d64-fp16": (2, 4, 2, 50, 64, torch.float16, 7, 64**-0.5),
    "causal-gqa8-d256-fp16": (1, 8, 1, 24, 256, torch.float16, None, 256**-0.5),
    "sliding-gqa2-d256-fp32": (1, 4, 2, 33, 256, torch.float32, 20, 256**-0.5),
    "sliding-gqa2-d512-fp16": (1, 2, 1, 20, 512, torch.float16, 9, 512**-0.5),
    # Gemma 4's scale 1.0 (its q is shrunk below so that scores stay O(1), as after its norms;
    # raw N(0, 1) scores of std 22 would leave fp32 rounding of ~1e-4 in the exponents).
    "causal-gqa2-d512-fp32-scale1": (1, 2, 1, 18, 512, torch.float32, None, 1.0),
}


@pytest.mark.parametrize("case", SELF_ATTENTION_CASES, ids=list(SELF_ATTENTION_CASES))
def test_self_attention_prefill(case: str) -> None:
    """Queries and keys at positions 0..M-1 (M not a multiple of BLOCK_M)."""
    batch, heads, kv_heads, length, dim, dtype, window, scale = SELF_ATTENTION_CASES[case]
    q, k, v = _inputs(batch, heads, kv_heads, length, length, dim, dtype)
    if scale == 1.0:
        q = q * dim**-0.5
    positions = torch.arange(length)
    _check(q, k, v, positions, positions, window, scale)


@pytest.mark.parametrize("window", [None, 40])
def test_chunked_prefill_offsets_queries(window: int | None) -> None:
    """A second chunk: queries at 100..163 over keys 0..163 (cached prefix + the chunk)."""
    q, k, v = _inputs(1, 4, 2, 64, 164, 64, torch.float16)
    _check(q, k, v, torch.arange(100, 164), torch.arange(164), window, 0.125)


def test_value_splits_share_a_query_block() -> None:
    """Two programs per query block, each writing half of the output columns (D=512)."""
    q, k, v = _inputs(1, 2, 1, 20, 20, 512, torch.float16)
    split = LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, value_splits=2)
    _check(q, k, v, torch.arange(20), torch.arange(20), 9, 512**-0.5, split)


def test_rotated_ring_positions_with_empty_and_negative_slots() -> None:
    """A ring buffer's slots: rotated positions, empty slots and a negative one, so no key
    block is ordered and correctness rests on the per-element mask."""
    slots = 48
    positions = torch.roll(torch.arange(20, 20 + slots), 13)
    positions[[3, 17, 30, 31, 47]] = EMPTY_POSITION
    positions[9] = -3
    q, k, v = _inputs(1, 4, 2, 20, slots, 64, torch.float32)
    _check(q, k, v, torch.arange(50, 70), positions, 16, 0.125)


def test_rows_without_visible_keys_are_zero() -> None:
    """Queries before every key, and keys that are all empty: exact zeros, never NaN."""
    q, k, v = _inputs(1, 2, 1, 10, 16, 64, torch.float16)
    got = _check(q, k, v, torch.arange(10), torch.arange(20, 36), None, 0.125)
    assert torch.equal(got, torch.zeros_like(got))
    empty = torch.full((16,), EMPTY_POSITION)
    got = prefill_attention_triton(q, k, v, torch.arange(10), empty, 4, 0.125, SMALL_TILES)
    assert torch.equal(got, torch.zeros_like(got))


def test_strided_inputs() -> None:
    """q/k/v as the model has them: [B, M, H, D] projections viewed as [B, H, M, D]."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 21, 4, 64, generator=generator).transpose(1, 2)
    k = torch.randn(2, 21, 2, 64, generator=generator).transpose(1, 2)
    v = torch.randn(2, 21, 2, 64, generator=generator).transpose(1, 2)
    positions = torch.arange(21)
    got = _check(q, k, v, positions, positions, 5, 0.125)
    # Stored token-major: the output projection's [B, M, H * D] input is a view, not a copy.
    tokens = got.transpose(1, 2).reshape(2, 21, 4 * 64)
    assert tokens.data_ptr() == got.data_ptr()


# ---------------------------------------------------------------------------------------------
# Block skipping: blocks no query of a program can see are never read


def _poison(x: torch.Tensor, keys: slice) -> torch.Tensor:
    poisoned = x.clone()
    poisoned[:, :, keys] = float("nan")
    return poisoned


def test_window_skips_key_blocks_behind_every_query() -> None:
    """Keys 0..63 (blocks 0-3) are outside the window of queries 100..163: NaN there would
    reach the output through 0·NaN in P·V if those blocks were read."""
    q, k, v = _inputs(1, 2, 1, 64, 164, 64, torch.float16)
    args = (torch.arange(100, 164), torch.arange(164), 32, 0.125)
    got = prefill_attention_triton(
        q, _poison(k, slice(0, 64)), _poison(v, slice(0, 64)), *args, config=SMALL_TILES
    )
    expected = prefill_attention_reference(q, k, v, *args)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=3e-3)


def test_causal_skips_key_blocks_after_every_query() -> None:
    """Queries 0..15 (one block) over keys 0..63: blocks 1-3 are in their future."""
    q, k, v = _inputs(1, 2, 2, 16, 64, 64, torch.float32)
    args = (torch.arange(16), torch.arange(64), None, 0.125)
    got = prefill_attention_triton(
        q, _poison(k, slice(16, 64)), _poison(v, slice(16, 64)), *args, config=SMALL_TILES
    )
    expected = prefill_attention_reference(q, k, v, *args)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_key_block_bounds() -> None:
    positions = torch.tensor([5, 3, EMPTY_POSITION, 4, -1, EMPTY_POSITION, 9])
    bounds = key_block_bounds(positions, 3)
    assert bounds.tolist() == [
        [3, 4, 9],  # lowest valid
        [5, 4, 9],  # highest valid
        [EMPTY_POSITION] * 3,  # highest, invalid or padding slots counting as EMPTY
    ]
    assert key_block_bounds(torch.arange(4), 2)[2].tolist() == [1, 3]


def test_dispatcher_runs_the_reference_on_cpu() -> None:
    q, k, v = _inputs(1, 2, 1, 8, 8, 64, torch.float32)
    args = (q, k, v, torch.arange(8), torch.arange(8), None, 0.125)
    assert torch.equal(prefill_attention(*args), prefill_attention_reference(*args))


def test_rejects_bad_shapes() -> None:
    q, k, v = _inputs(1, 3, 2, 4, 4, 64, torch.float32)
    with pytest.raises(ValueError, match="GQA"):
        prefill_attention_triton(q, k, v, torch.arange(4), torch.arange(4), None, 1.0)
    q, k, v = _inputs(1, 2, 1, 4, 4, 96, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention_triton(q, k, v, torch.arange(4), torch.arange(4), None, 1.0)


# ---------------------------------------------------------------------------------------------
# The default tiles compile for Hopper and fit its shared memory

SHARED_MEMORY_OF = """
import json, sys, importlib
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton

used = []
for spec in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    attrs = {(index,): [["tt.divisibility", 16]] for index in spec["aligned"]}
    source = ASTSource(kernel, spec["signature"], spec["constants"], attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    used.append(compiled.metadata.shared)
print(json.dumps(used))
"""


def _aligned(arguments: dict) -> list[int]:
    """Indices of the arguments a real launch specializes as 16-aligned (tensors whose data
    pointer is, integers that divide by 16): without them Triton cannot vectorize the K/V
    loads, does not pipeline them, and the shared memory checked here would be too small."""
    return [
        index
        for index, value in enumerate(arguments.values())
        if (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0)
        or (type(value) is int and value % 16 == 0)
    ]


@pytest.mark.sm90  # compiles for Hopper: opt-in with `pytest -m sm90`
def test_default_tiles_compile_for_hopper_within_shared_memory() -> None:
    """Compiled by Triton's real pipeline (ptxas ships with Triton; no GPU needed) at the
    shapes that matter: D=256 sliding and D=512 full in bf16, D=512 in fp32."""
    from test_kernels_compile import _recorded_launches, _spec

    specs = []
    for dim, dtype, window in ((256, torch.bfloat16, 1024), (512, torch.bfloat16, None),
                               (512, torch.float32, None)):  # fmt: skip
        q, k, v = _inputs(1, 2, 1, 32, 32, dim, dtype)
        positions = torch.arange(32)
        launches = _recorded_launches(
            lambda q=q, k=k, v=v, p=positions, w=window: prefill_attention_triton(
                q, k, v, p, p, w, 1.0
            )
        )
        for kernel, arguments in launches:
            names = list(inspect.signature(kernel.fn).parameters)
            ordered = {name: arguments[name] for name in names}
            specs.append({**_spec(kernel, arguments), "aligned": _aligned(ordered)})
    assert len(specs) == 3
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    source_root = str(Path(pa.__file__).resolve().parents[2])
    environment["PYTHONPATH"] = os.pathsep.join([source_root, environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", SHARED_MEMORY_OF],
        input=json.dumps(specs),
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    shared = json.loads(result.stdout)
    # Pipelined K/V buffers make it well over 64 KiB; the limit is Hopper's per block.
    for spec, used in zip(specs, shared, strict=True):
        assert 64 * 1024 < used <= HOPPER_SHARED_MEMORY, f"{spec['constants']}: {used} bytes"


def test_oracle_sees_what_the_rule_says() -> None:
    """The oracle itself: one query, two visible keys with equal scores -> their mean."""
    q = torch.zeros(1, 1, 1, 16)
    k = torch.zeros(1, 1, 3, 16)
    v = torch.tensor([1.0, 3.0, 100.0])[None, None, :, None].expand(1, 1, 3, 16)
    out = _oracle(q, k, v, torch.tensor([5]), torch.tensor([4, 5, 6]), None, 1.0)
    assert math.isclose(out[0, 0, 0, 0].item(), 2.0)
