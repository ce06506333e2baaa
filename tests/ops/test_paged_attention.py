"""Decode attention over a paged K/V pool: the Triton kernel (Triton's interpreter on CPU,
compiled on a GPU) against its torch reference, and the reference against attention built by
hand from each row's visible keys, gathered slot by slot out of the pool.

Cases: rows of different lengths in one batch (one a padded row at position 0), blocks
scattered over the pool in no order, the table's unused tail and a sliding layer's freed
entries pointing at other rows' blocks or at block 0, windows shorter than the context,
GQA 2 and 4, head_dim 32/64 (Gemma's 256/512 scaled down: the interpreter is slow), and
tiles of one block (16 slots) or spanning 2-4 blocks.

Tolerances (outputs are softmax averages of V ~ N(0, 1), so |out| < ~4):
* fp32 kernel vs reference: 2e-5. Same fp32 data; only summation order (splits, tiles),
  exp2 vs exp and (codebook V) averaging before rather than after the un-rotation differ,
  each ~1e-6 (as in tests/ops/test_decode_attention.py).
* half kernel vs reference: fp16 on CPU (Triton's interpreter computes in numpy, which has no
  bfloat16), 2e-3: the kernel rounds softmax weights to fp16 for P.V (relative 2^-11 each,
  so ~4.9e-4 max|v|) and both round the output to fp16. bf16 on a GPU: 2.5e-2, the same
  two terms at bf16's precision: weights (and affine/codebook V's weight x scale) rounded
  to 2^-9 relative, <= 7.8e-3 for |v| < 4, and fp32 results that differ by that may round
  to bf16 values one ulp apart (1.6e-2 for |out| in [2, 4): a short row's output is v).
* fp32 reference vs the hand-built fp64 attention: 1e-5 (fp32 rounding of the decode, the
  matmuls and the softmax).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from hearth.ops.decode_attention import LaunchConfig, PlaneFormat, formats_of
from hearth.ops.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_kernel,
    paged_decode_attention_reference,
    paged_split_plan,
)
from hearth.quant.kv_codecs import AffineCodec
from hearth.quant.turbo import TurboCodec
from test_decode_attention import oracle_decode

BLOCK = 16
KERNEL_TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2.5e-2}
ORACLE_TOLERANCE = 1e-5
DENSE = PlaneFormat.dense()

# The small cases run in Triton's interpreter on CPU and compiled on a GPU machine.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="records launches through the CPU interpreter"
)
_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass
class Case:
    q: torch.Tensor
    key_planes: list[torch.Tensor]
    value_planes: list[torch.Tensor]
    key_format: PlaneFormat
    value_format: PlaneFormat
    tables: torch.Tensor
    positions: torch.Tensor
    window: int | None
    scale: float
    # Blocks no row's visible key lives in (never read by the kernel).
    unread_blocks: list[int]

    def args(self) -> tuple:
        return (
            self.q, self.key_planes, self.value_planes, self.key_format, self.value_format,
            self.tables, self.positions, self.window, self.scale,
        )  # fmt: skip


def _codec(scheme: str) -> object | None:
    if scheme == "dense":
        return None
    if scheme.startswith("affine"):
        return AffineCodec(int(scheme.removeprefix("affine")), 32)
    return TurboCodec.parse(scheme)


def make_case(
    lengths: Sequence[int],
    kv_heads: int,
    groups: int,
    dim: int,
    dtype: torch.dtype,
    window: int | None,
    scheme: str = "dense",
    spare_blocks: int = 3,
    tail_blocks: int = 1,
    seed: int = 0,
    device: str = DEVICE,
) -> Case:
    """A pool holding rows of `lengths` tokens (0: a padded row, position 0, table all 0),
    each row's blocks scattered over the pool; the table has `tail_blocks` unused entries
    past the longest row. Entries the kernel must not read (tail, freed out-of-window blocks)
    hold other rows' blocks or 0."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-length // BLOCK) for length in lengths) + tail_blocks
    used = [-(-length // BLOCK) for length in lengths]
    num_blocks = sum(used) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    positions = torch.zeros(len(lengths), dtype=torch.long)
    read: set[int] = set()
    taken = 0
    for row, (length, count) in enumerate(zip(lengths, used, strict=True)):
        blocks = order[taken : taken + count]
        taken += count
        garbage = torch.randint(0, num_blocks, (max_blocks,), generator=generator)
        tables[row] = garbage.to(torch.int32) if row % 2 else 0
        tables[row, :count] = torch.tensor(blocks, dtype=torch.int32)
        qpos = max(length - 1, 0)
        positions[row] = qpos
        if length == 0:
            tables[row] = 0
            read.add(0)
            continue
        first_visible = 0 if window is None else max(0, qpos - window + 1)
        for index in range(count):
            if (index + 1) * BLOCK <= first_visible:
                # Freed by a sliding layer: may point anywhere.
                tables[row, index] = int(garbage[index]) if row % 2 else 0
            else:
                read.add(blocks[index])
    on = torch.device(device)
    shape = (num_blocks, kv_heads, BLOCK, dim)
    # Encoded where the kernel runs (the GPU cases' pools are a few GB).
    keys = torch.randn(shape, generator=generator).to(on)
    values = torch.randn(shape, generator=generator).to(on)
    q = torch.randn(len(lengths), kv_heads * groups, dim, generator=generator).to(on, dtype)
    codec = _codec(scheme)
    if codec is None:
        key_format = value_format = DENSE
        key_planes, value_planes = [keys.to(dtype)], [values.to(dtype)]
    else:
        key_format, value_format, key_count = formats_of(codec)
        planes = codec.encode(keys.to(dtype), values.to(dtype))
        key_planes, value_planes = list(planes[:key_count]), list(planes[key_count:])
    return Case(
        q,
        key_planes,
        value_planes,
        key_format,
        value_format,
        tables.to(on),
        positions.to(on),
        window,
        dim**-0.5,
        sorted(set(range(num_blocks)) - read),
    )


def hand_attention(case: Case) -> torch.Tensor:
    """fp64 attention of each row over its visible keys, read slot by slot through the row's
    table (planes decoded by the test oracle of test_decode_attention)."""
    dim = case.q.shape[-1]
    keys = oracle_decode([p.cpu() for p in case.key_planes], case.key_format, dim)
    values = oracle_decode([p.cpu() for p in case.value_planes], case.value_format, dim)
    batch, query_heads, _ = case.q.shape
    groups = query_heads // keys.shape[1]
    out = torch.zeros(batch, query_heads, dim, dtype=torch.float64)
    for row in range(batch):
        qpos = int(case.positions[row])
        visible = [n for n in range(qpos + 1) if case.window is None or qpos - n < case.window]
        for head in range(query_heads):
            kv_head = head // groups
            slots = [(int(case.tables[row, n // BLOCK]), n % BLOCK) for n in visible]
            scores = [
                float(case.q[row, head].double().cpu() @ keys[b, kv_head, s]) * case.scale
                for b, s in slots
            ]
            top = max(scores)
            weights = [math.exp(score - top) for score in scores]
            total = sum(weights)
            for weight, (b, s) in zip(weights, slots, strict=True):
                out[row, head] += weight / total * values[b, kv_head, s]
    return out


def check_kernel(case: Case, config: LaunchConfig | None = None) -> torch.Tensor:
    kernel = paged_decode_attention_kernel(*case.args(), config)
    reference = paged_decode_attention_reference(*case.args())
    assert kernel.dtype == reference.dtype == case.q.dtype and kernel.shape == case.q.shape
    torch.testing.assert_close(
        kernel.float(), reference.float(), atol=KERNEL_TOLERANCE[case.q.dtype], rtol=0
    )
    return kernel


# Small tiles and forced splits, so that short contexts give several splits, empty ones
# (wholly past a short row's query) and tiles spanning the window's start.
ONE_BLOCK_TILES = LaunchConfig(block_n=16, splits=4)
TWO_BLOCK_TILES = LaunchConfig(block_n=32, splits=3)
FOUR_BLOCK_TILES = LaunchConfig(block_n=64, splits=2)


# ---------------------------------------------------------------------------------------------
# The reference against hand-built attention


@pytest.mark.parametrize(
    ("scheme", "window"), [("dense", None), ("dense", 20), ("affine4", 24), ("k8v3", None)]
)
def test_reference_equals_hand_gathered_attention(scheme: str, window: int | None) -> None:
    case = make_case([45, 0, 70, 17], 2, 2, 32, torch.float32, window, scheme)
    reference = paged_decode_attention_reference(*case.args())
    torch.testing.assert_close(
        reference.double().cpu(), hand_attention(case), atol=ORACLE_TOLERANCE, rtol=0
    )


# ---------------------------------------------------------------------------------------------
# The kernel against the reference (Triton's interpreter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("dim", "groups", "window", "config"),
    [
        (32, 2, None, ONE_BLOCK_TILES),  # full layer, 256-like
        (64, 4, 20, TWO_BLOCK_TILES),  # sliding, 512-like, GQA 4
        (32, 4, 40, FOUR_BLOCK_TILES),
    ],
)
def test_dense_rows_of_different_lengths(
    dtype: torch.dtype, dim: int, groups: int, window: int | None, config: LaunchConfig
) -> None:
    case = make_case([70, 0, 33, 5], 2, groups, dim, dtype, window)
    check_kernel(case, config)


@pytest.mark.parametrize("scheme", ["affine4", "affine8", "k8v3", "t4v3"])
def test_quantized_pools(scheme: str) -> None:
    # A sliding window shorter than the longest row; 64-slot tiles for affine (the default
    # at D <= 256), one block for codebook planes.
    config = FOUR_BLOCK_TILES if scheme.startswith("affine") else ONE_BLOCK_TILES
    case = make_case([58, 0, 21], 2, 2, 64, torch.float32, 30, scheme, seed=1)
    check_kernel(case, config)


@pytest.mark.parametrize("window", [None, 24])
def test_default_launch_and_single_split(window: int | None) -> None:
    # The shape-based defaults (8 "SMs" off the GPU), and one split writing the output
    # itself (no merge launch).
    case = make_case([50, 9, 0], 2, 2, 32, torch.float32, window, seed=2)
    check_kernel(case)
    check_kernel(case, LaunchConfig(block_n=16, splits=1))


def test_unread_blocks_may_hold_any_bits() -> None:
    """The pool is allocated uninitialised: NaN and inf in blocks no visible key lives in
    (spares, the table's tail, freed window blocks) change nothing, as loads are masked by
    visibility and the tail is never iterated."""
    case = make_case([60, 37], 2, 2, 32, torch.float32, 20, spare_blocks=2, tail_blocks=2)
    assert case.unread_blocks
    clean = check_kernel(case, TWO_BLOCK_TILES)
    dirty_keys, dirty_values = case.key_planes[0].clone(), case.value_planes[0].clone()
    dirty_keys[case.unread_blocks] = float("nan")
    dirty_values[case.unread_blocks] = float("inf")
    # Slots past each row's query inside its last block.
    for row, qpos in enumerate(case.positions.tolist()):
        block = int(case.tables[row, qpos // BLOCK])
        dirty_values[block, :, qpos % BLOCK + 1 :] = float("nan")
    case.key_planes, case.value_planes = [dirty_keys], [dirty_values]
    assert torch.equal(paged_decode_attention_kernel(*case.args(), TWO_BLOCK_TILES), clean)


def test_dispatch_takes_the_kernel_on_a_gpu_and_the_reference_elsewhere() -> None:
    case = make_case([20, 3], 1, 2, 32, torch.float32, None)
    chosen = paged_decode_attention_kernel if case.q.is_cuda else paged_decode_attention_reference
    assert torch.equal(paged_decode_attention(*case.args()), chosen(*case.args()))


def test_split_plan_depends_on_shapes_only() -> None:
    """A sliding layer splits `window + 16` slots whatever the table's length; a full one
    the whole table. Slots per split are whole tiles."""
    cpu = torch.device("cpu")
    pinned = LaunchConfig(splits=4)
    # 528 slots: 9 tiles of 64, 3 a split rounded up to 4 (a power of two), so 3 splits.
    assert paged_split_plan(1, 8, 256, BLOCK, 512, 64, cpu, pinned) == (256, 3)
    assert paged_split_plan(1, 8, 64, BLOCK, 512, 64, cpu, pinned) == (256, 3)
    assert paged_split_plan(1, 8, 256, BLOCK, None, 64, cpu, pinned) == (1024, 4)
    # A window wider than the table: the table.
    assert paged_split_plan(1, 8, 8, BLOCK, 4096, 16, cpu, pinned) == (32, 4)
    # Enough (row x KV head) programs to fill the device: one split, no merge.
    assert paged_split_plan(64, 8, 256, BLOCK, None, 64, cpu)[1] == 1


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernel at real shapes, and CUDA-graph replay as sequences grow


GPU_SHAPES = [
    # (lengths, head_dim, window): Gemma 3/4 sliding (256, window 1024 / 512) and full (512).
    ([4096, 1, 700, 2000, 0, 33], 256, 1024),
    ([4096, 1, 700, 2000, 0, 33], 512, None),
    ([512] * 63 + [0], 256, 512),
    ([4096] + [512] * 62 + [0], 512, None),
]


@_needs_cuda
@pytest.mark.parametrize(("lengths", "dim", "window"), GPU_SHAPES)
@pytest.mark.parametrize("scheme", ["dense", "affine4", "affine8", "k8v3"])
def test_gpu_real_shapes(lengths: list[int], dim: int, window: int | None, scheme: str) -> None:
    case = make_case(lengths, 8, 2, dim, torch.bfloat16, window, scheme)
    check_kernel(case)


@_needs_cuda
@pytest.mark.parametrize(("dim", "window"), [(256, 1024), (512, None)])
def test_gpu_graph_replay_as_rows_grow(dim: int, window: int | None) -> None:
    """Capture once with short rows, then move every row's query position forward (same
    table shape) and replay: the output follows the reference at each length."""
    case = make_case([3000, 1500, 200, 0], 8, 2, dim, torch.bfloat16, window)
    final = case.positions.clone()
    start = torch.tensor([100, 17, 5, 0], device="cuda")
    case.positions.copy_(start)
    args = case.args()
    paged_decode_attention(*args)  # warm-up: compiles and caches device tables
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(*args)
    for fraction in (0.0, 0.3, 0.7, 1.0):
        case.positions.copy_((start + (final - start) * fraction).long())
        graph.replay()
        reference = paged_decode_attention_reference(*args)
        torch.testing.assert_close(
            out.float(), reference.float(), atol=KERNEL_TOLERANCE[torch.bfloat16], rtol=0
        )


# ---------------------------------------------------------------------------------------------
# sm_90 compilation (opt-in, `pytest -m sm90`: minutes), as tests/ops/test_compile_sm90.py does


def _paged_launches() -> list:
    """Recorded interpreter launches of the paged kernel (and its merge) over every plane
    format, at Gemma's head sizes: full D=512, sliding D=256, and one split."""
    from test_compile_sm90 import _recorded_launches

    bf16 = torch.bfloat16
    cases = [
        (make_case([600, 40], 2, 2, 512, bf16, None, device="cpu"), LaunchConfig()),
        (make_case([600, 40], 2, 2, 256, bf16, 64, device="cpu"), LaunchConfig()),
        (make_case([40], 2, 2, 256, bf16, None, device="cpu"), LaunchConfig(splits=1)),
    ]
    cases += [
        (make_case([300, 40], 2, 2, dim, bf16, 64, scheme, device="cpu"), LaunchConfig())
        for scheme in ("affine4", "affine8", "k8v3", "t4v3")
        for dim in (256, 512)
    ]
    launches = []
    for case, config in cases:
        launches += _recorded_launches(
            lambda c=case, k=config: paged_decode_attention_kernel(*c.args(), k)
        )
    return launches


@pytest.mark.sm90
@_interpreter_only
def test_compiles_for_hopper_with_the_device_loop() -> None:
    """The GPU form of the kernel (DEVICE_LOOP: a range bounded by each row's query position,
    which the interpreter cannot run) compiles for sm_90 with PDL, for every plane format; and
    dense K/V tiles gathered through the table still stream in by cp.async (pipelined)."""
    import json
    import subprocess
    import sys

    from test_compile_sm90 import (
        COMPILER,
        CP_ASYNC_COUNTER,
        _aligned_spec,
        _compiler_environment,
        _spec,
    )

    launches = _paged_launches()
    specs = []
    for kernel, arguments in launches:
        spec = _spec(kernel, arguments)
        if "DEVICE_LOOP" in spec["constants"]:
            spec["constants"]["DEVICE_LOOP"] = True
        specs.append(spec)
    unique = list({json.dumps(spec, sort_keys=True): spec for spec in specs}.values())
    environment = _compiler_environment()
    result = subprocess.run(
        [sys.executable, "-c", COMPILER],
        input=json.dumps(unique),
        capture_output=True,
        text=True,
        env=environment,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]

    kernel, arguments = launches[0]  # dense, D=512, full layer
    spec = _aligned_spec(kernel, arguments)
    spec["constants"]["DEVICE_LOOP"] = True
    counted = subprocess.run(
        [sys.executable, "-c", CP_ASYNC_COUNTER],
        input=json.dumps([spec]),
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert counted.returncode == 0, counted.stderr[-2000:]
    assert int(counted.stdout.split()[0]) > 0, "the gathered K/V loads are not pipelined"
