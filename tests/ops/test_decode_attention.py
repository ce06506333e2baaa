"""Split-K decode attention: the Triton kernel (interpreter on CPU) vs its torch reference,
and the reference vs a naive fp64 oracle that decodes the planes on its own.

The oracle shares nothing with the code under test but the layout's constants (codebook
centroids and the rotation's sign diagonal): it reads codes from each row's bit stream as
one Python integer, builds the Hadamard matrix by Sylvester's construction, and attends
head by head in fp64 with the visibility rule written out per slot.

Tolerances (outputs are softmax averages of V ~ N(0, 1), so |out| < ~4):
* fp32 kernel vs reference: 2e-5. Same fp32 data; only summation order, exp2 vs exp and
  (codebook V) averaging before rather than after the un-rotation differ, each ~1e-6.
* fp16 kernel vs reference: 2e-3. The kernel rounds softmax weights to fp16 for the P·V
  product (relative 2^-11 each, so at most ~4.9e-4·max|v|); both round the output to fp16.
* fp32 reference vs oracle: 1e-5 (fp32 rounding of decode, matmuls and softmax);
  fp16 reference vs oracle: 1e-3 (the reference's output is rounded to fp16: half an ulp
  of a value below 2 is 4.9e-4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from hearth.kv.cache import EMPTY_POSITION
from hearth.ops import decode_attention as decode_attention_module
from hearth.ops.decode_attention import (
    _WRITE_OUTPUT,
    _WRITE_PARTIALS,
    LaunchConfig,
    PlaneFormat,
    _default_tiles,
    _finish_mode,
    _Launch,
    _resolve,
    decode_attention,
    decode_attention_reference,
    formats_of,
)
from hearth.quant.kv_codecs import AffineCodec
from hearth.quant.turbo import CODEBOOKS, GROUP, TurboCodec, random_signs

KERNEL_TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}
ORACLE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3}

# These drive the kernels through Triton's interpreter on CPU tensors (CI has no GPU); on a
# GPU machine benchmarks/lab/gpu_kernels_*.py checks the compiled kernels against the references.
_interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests; the GPU scripts check compiled kernels"
)
pytestmark = _interpreter_only


# ---------------------------------------------------------------------------------------------
# Oracle


def _codes(words: torch.Tensor, bits: int, count: int) -> list[int]:
    """The row's `count` codes: word i holds stream bits 32·i .. 32·i+31, LSB first."""
    stream = sum(int(word) << (32 * index) for index, word in enumerate(words.tolist()))
    return [(stream >> (bits * j)) & ((1 << bits) - 1) for j in range(count)]


def _sylvester(dim: int) -> torch.Tensor:
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(dim)


def oracle_decode(planes: Sequence[torch.Tensor], fmt: PlaneFormat, dim: int) -> torch.Tensor:
    """K or V [B, Hkv, S, D] in fp64, un-rotated."""
    if fmt.kind == "dense":
        return planes[0].double()
    batch, heads, slots = planes[0].shape[:3]
    out = torch.empty(batch, heads, slots, dim, dtype=torch.float64)
    words = planes[0].view(torch.int32).long() & 0xFFFFFFFF
    group = fmt.group_size
    centroids = CODEBOOKS[fmt.bits][0].double() if fmt.kind == "codebook" else None
    for b in range(batch):
        for h in range(heads):
            for s in range(slots):
                codes = torch.tensor(_codes(words[b, h, s], fmt.bits, dim), dtype=torch.float64)
                scale = planes[1][b, h, s].double().repeat_interleave(group)
                if fmt.kind == "affine":
                    out[b, h, s] = codes * scale + planes[2][b, h, s].double().repeat_interleave(
                        group
                    )
                else:
                    assert centroids is not None
                    out[b, h, s] = centroids[codes.long()] * scale
    if fmt.kind == "codebook":
        # rotate(x) = H·diag(signs)·x, so x = diag(signs)·H·y (H is symmetric).
        out = (out @ _sylvester(dim)) * random_signs(dim).double()
    return out


def oracle_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    query_position: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    batch, query_heads, dim = q.shape
    groups = query_heads // keys.shape[1]
    out = torch.zeros(batch, query_heads, dim, dtype=torch.float64)
    for b in range(batch):
        for head in range(query_heads):
            kv_head = head // groups
            visible = [
                s
                for s, pos in enumerate(positions.tolist())
                if pos <= query_position and (window is None or query_position - pos < window)
            ]
            scores = [float(q[b, head].double() @ keys[b, kv_head, s]) * scale for s in visible]
            top = max(scores)
            weights = [math.exp(score - top) for score in scores]
            total = sum(weights)
            for weight, s in zip(weights, visible, strict=True):
                out[b, head] += weight / total * values[b, kv_head, s]
    return out


# ---------------------------------------------------------------------------------------------
# Cases


def ring_positions(capacity: int, offset: int) -> torch.Tensor:
    """A ring of `capacity` slots after `offset` tokens: position p sits in slot p % capacity."""
    positions = torch.full((capacity,), EMPTY_POSITION, dtype=torch.long)
    for p in range(max(0, offset - capacity), offset):
        positions[p % capacity] = p
    return positions


def check(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    positions: torch.Tensor,
    query_position: int,
    window: int | None,
    scale: float,
    config: LaunchConfig,
) -> None:
    args = (q, key_planes, value_planes, key_format, value_format, positions)
    qpos = torch.tensor(query_position)
    kernel = decode_attention(*args, qpos, window, scale, config)
    reference = decode_attention_reference(*args, qpos, window, scale)
    assert kernel.dtype == reference.dtype == q.dtype and kernel.shape == q.shape
    dim = q.shape[-1]
    keys = oracle_decode(key_planes, key_format, dim)
    values = oracle_decode(value_planes, value_format, dim)
    oracle = oracle_attention(q, keys, values, positions, query_position, window, scale)
    torch.testing.assert_close(
        kernel.float(), reference.float(), atol=KERNEL_TOLERANCE[q.dtype], rtol=0
    )
    torch.testing.assert_close(reference.double(), oracle, atol=ORACLE_TOLERANCE[q.dtype], rtol=0)


def random_qkv(
    batch: int, query_heads: int, kv_heads: int, slots: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(slots * 31 + dim + query_heads)
    shape = (batch, kv_heads, slots, dim)
    q = torch.randn(batch, query_heads, dim, generator=generator).to(dtype)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    return q, keys, values


DENSE = PlaneFormat.dense()
# Small blocks so that even short caches give several splits and fully masked blocks.
SMALL_BLOCKS = LaunchConfig(block_n=16, splits=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_gqa_full_cache(dtype: torch.dtype) -> None:
    # Hq=4 over one KV head; scale 1 makes the softmax peaky (scores ~ N(0, 64)).
    q, keys, values = random_qkv(1, 4, 1, 200, 64, dtype)
    positions = torch.arange(200)
    check(q, [keys], [values], DENSE, DENSE, positions, 199, None, 1.0, SMALL_BLOCKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_ring_with_window_smaller_than_filled(dtype: torch.dtype) -> None:
    # A ring of 128 slots after 300 tokens (unsorted positions 172..299), window 50.
    q, keys, values = random_qkv(2, 8, 2, 128, 64, dtype)
    positions = ring_positions(128, 300)
    check(q, [keys], [values], DENSE, DENSE, positions, 299, 50, 64**-0.5, SMALL_BLOCKS)


@pytest.mark.parametrize("skip", [True, False])
def test_dense_empty_slots_and_empty_splits(skip: bool) -> None:
    # 40 of 160 slots filled: whole blocks and whole splits see nothing, whether the kernel
    # branches over such blocks or runs them fully masked.
    q, keys, values = random_qkv(1, 8, 2, 160, 64, torch.float32)
    positions = ring_positions(160, 40)
    config = LaunchConfig(block_n=16, splits=4, skip_masked_blocks=skip)
    check(q, [keys], [values], DENSE, DENSE, positions, 39, None, 0.125, config)


def test_dense_slots_never_written_may_hold_any_bits() -> None:
    """A static cache's unwritten slots hold whatever the allocation held: NaN and inf there
    weigh nothing, as the loads are masked by visibility (a 2026-12-06 variant that loaded
    every slot before the positions were known, zeroing invisible V, was slower on an H100:
    it read the empty slots' bytes). The same output as with zeros there, and the
    reference's over the written slots (40 of 64)."""
    q, keys, values = random_qkv(1, 8, 2, 64, 64, torch.float32)
    positions = ring_positions(64, 40)
    args = (torch.tensor(39), None, 0.125, LaunchConfig(block_n=16, splits=2))
    clean = decode_attention(q, [keys], [values], DENSE, DENSE, positions, *args)
    keys[:, :, 40:], values[:, :, 40:] = float("nan"), float("inf")
    values[:, :, 41] = float("nan")
    dirty = decode_attention(q, [keys], [values], DENSE, DENSE, positions, *args)
    assert torch.equal(dirty, clean)
    reference = decode_attention_reference(
        q, [keys[:, :, :40]], [values[:, :, :40]], DENSE, DENSE, positions[:40], *args[:3]
    )
    torch.testing.assert_close(dirty, reference, atol=KERNEL_TOLERANCE[torch.float32], rtol=0)


def test_dense_query_in_the_middle_of_the_cache() -> None:
    # Slots after the query's position (a speculative or trimmed tail) stay hidden.
    q, keys, values = random_qkv(1, 4, 1, 96, 256, torch.float32)
    check(q, [keys], [values], DENSE, DENSE, torch.arange(96), 50, 32, 1 / 16, SMALL_BLOCKS)


@pytest.mark.parametrize(
    ("bits", "group_size", "dim"),
    # 3/5/6 bits: codes straddle words (3-bit g64: two 3-word units per scale group).
    [(4, 32, 64), (8, 64, 64), (4, 64, 256), (3, 32, 64), (3, 64, 128), (2, 32, 64), (6, 32, 64)],
)
def test_affine(bits: int, group_size: int, dim: int) -> None:
    q, keys, values = random_qkv(1, 4, 2, 96, dim, torch.float32)
    codec = AffineCodec(bits, group_size)
    fmt = PlaneFormat.affine(bits, group_size)
    planes = codec.encode(keys, values)
    positions = ring_positions(96, 150)
    check(q, planes[:3], planes[3:], fmt, fmt, positions, 149, 80, dim**-0.5, SMALL_BLOCKS)


@pytest.mark.parametrize(
    ("scheme", "dim"), [("k8v3", 64), ("k4v3", 64), ("t4v3", 64), ("k8v2", 64), ("k8v3", 256)]
)
def test_turbo(scheme: str, dim: int) -> None:
    q, keys, values = random_qkv(1, 4, 2, 80, dim, torch.float32)
    codec = TurboCodec.parse(scheme)
    key_format, value_format, key_planes = formats_of(codec)
    planes = codec.encode(keys, values)
    positions = ring_positions(80, 70)
    check(
        q, planes[:key_planes], planes[key_planes:], key_format, value_format,
        positions, 69, None, dim**-0.5, SMALL_BLOCKS,
    )  # fmt: skip


@pytest.mark.parametrize("scheme", ["dense", "affine4", "t4v3"])
def test_single_pass_without_merge(scheme: str) -> None:
    # splits=1: the split kernel normalises and writes the output itself (no merge launch).
    q, keys, values = random_qkv(1, 4, 2, 48, 64, torch.float32)
    positions = ring_positions(48, 60)
    if scheme == "dense":
        planes, key_format, value_format, key_planes = [keys, values], DENSE, DENSE, 1
    elif scheme == "affine4":
        planes = AffineCodec(4, 32).encode(keys, values)
        key_format = value_format = PlaneFormat.affine(4, 32)
        key_planes = 3
    else:
        codec = TurboCodec.parse(scheme)
        key_format, value_format, key_planes = formats_of(codec)
        planes = codec.encode(keys, values)
    check(
        q, planes[:key_planes], planes[key_planes:], key_format, value_format,
        positions, 59, 40, 0.125, LaunchConfig(block_n=16, splits=1),
    )  # fmt: skip


def test_turbo_half_precision_query() -> None:
    # fp16 q: the rotated query and the decoded tiles are rounded to fp16 in the kernel.
    q, keys, values = random_qkv(1, 8, 2, 64, 64, torch.float16)
    codec = TurboCodec.parse("t4v3")
    key_format, value_format, key_planes = formats_of(codec)
    planes = codec.encode(keys, values)
    args = (q, planes[:key_planes], planes[key_planes:], key_format, value_format)
    qpos = torch.tensor(63)
    kernel = decode_attention(*args, torch.arange(64), qpos, None, 0.125, SMALL_BLOCKS)
    reference = decode_attention_reference(*args, torch.arange(64), qpos, None, 0.125)
    # 4e-3: on top of the fp16 bound above, q·k uses the fp16-rounded rotated query and
    # fp16-rounded rotated keys (relative 2^-11 each) rather than un-rotated fp32 keys.
    torch.testing.assert_close(kernel.float(), reference.float(), atol=4e-3, rtol=0)


def test_default_launch_picks_splits_from_the_shape() -> None:
    q, keys, values = random_qkv(1, 2, 1, 300, 64, torch.float32)
    qpos = torch.tensor(299)
    args = (q, [keys], [values], DENSE, DENSE, torch.arange(300), qpos, None, 0.125)
    torch.testing.assert_close(
        decode_attention(*args), decode_attention_reference(*args), atol=2e-5, rtol=0
    )


def test_formats_of_codecs() -> None:
    assert formats_of(AffineCodec(8, 64)) == (PlaneFormat.affine(8, 64),) * 2 + (3,)
    assert formats_of(TurboCodec.parse("k4v3")) == (
        PlaneFormat.affine(4, GROUP),
        PlaneFormat.codebook(3),
        3,
    )
    assert formats_of(TurboCodec.parse("t4v2"))[::2] == (PlaneFormat.codebook(4), 2)


def test_rejects_a_host_query_position_number() -> None:
    q, keys, values = random_qkv(1, 2, 1, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="0-dim int64"):
        decode_attention(
            q, [keys], [values], DENSE, DENSE, torch.arange(32), torch.tensor([3]), None, 1.0
        )


# ---------------------------------------------------------------------------------------------
# Launch defaults and the fused merge (the last split of each KV head merges its splits)


def test_default_tiles_follow_the_h200_sweep() -> None:
    affine4, affine8 = PlaneFormat.affine(4, 64), PlaneFormat.affine(8, 64)
    turbo_keys, turbo_values, _ = formats_of(TurboCodec.parse("k4v3"))
    # Dense: 3 stages and no branch over masked blocks, at both measured head sizes.
    assert _default_tiles(256, DENSE, DENSE) == _Launch(64, 8, 3, False)
    assert _default_tiles(512, DENSE, DENSE) == _Launch(32, 4, 3, False)
    # Few (batch, KV head) rows (E4B's 2 KV heads): small blocks, so a short context splits
    # over more programs; from 3 rows on, the sweep's tiles.
    for head_dim in (256, 512):
        assert _default_tiles(head_dim, DENSE, DENSE, kv_rows=2) == _Launch(16, 4, 3, False)
    assert _default_tiles(256, DENSE, DENSE, kv_rows=8) == _Launch(64, 8, 3, False)
    assert _default_tiles(256, affine4, affine4, kv_rows=2) == _Launch(64, 4, 2, True)
    # Affine 4/8-bit: 64 slots x 4 warps up to D=256; D=512 keeps 32 (64 spilled there).
    assert _default_tiles(256, affine4, affine4) == _Launch(64, 4, 2, True)
    assert _default_tiles(256, affine8, affine8) == _Launch(64, 4, 2, True)
    assert _default_tiles(512, affine4, affine4) == _Launch(32, 4, 2, True)
    assert _default_tiles(256, turbo_keys, turbo_values) == _Launch(32, 4, 2, True)
    # Explicit fields win over the defaults.
    config = LaunchConfig(block_n=16, num_stages=2, skip_masked_blocks=True)
    assert _resolve(config, 256, DENSE, DENSE) == _Launch(16, 8, 2, True)


@pytest.mark.parametrize(("kv_heads", "block_n"), [(2, 16), (4, 64)])
def test_a_launch_takes_the_tiles_of_its_kv_head_count(
    kv_heads: int, block_n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch itself passes its (batch x KV head) rows to the tile defaults: 2 KV heads
    (E4B) take 16-slot blocks, 4 the sweep's 64 at D=64 (16384 / 64 capped at 64)."""
    launched: list[int] = []
    original = decode_attention_module.launch_kernel

    def recorded(kernel, grid, *args, **kwargs):
        if "BLOCK_N" in kwargs:
            launched.append(kwargs["BLOCK_N"])
        return original(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(decode_attention_module, "launch_kernel", recorded)
    q, keys, values = random_qkv(1, 2 * kv_heads, kv_heads, 64, 64, torch.float32)
    qpos = torch.tensor(40)
    args = (q, [keys], [values], DENSE, DENSE, torch.arange(64), qpos, None, 0.125)
    got = decode_attention(*args)
    assert launched == [block_n]
    torch.testing.assert_close(got, decode_attention_reference(*args), atol=2e-5, rtol=0)


def test_merge_policy() -> None:
    assert _finish_mode(1) == _WRITE_OUTPUT
    # Several splits: partials, merged by a launch of their own.
    assert _finish_mode(32) == _WRITE_PARTIALS


def test_merge_launch_over_six_splits() -> None:
    # 6 splits (not a power of two: part of the merge's split tile is empty) over a wrapped
    # ring under a sliding window (fully masked blocks inside the ring).
    q, keys, values = random_qkv(1, 8, 2, 96, 64, torch.float32)
    positions, query_position, window = ring_positions(96, 150), 149, 40
    config = LaunchConfig(block_n=16, splits=6)
    check(
        q, [keys], [values], DENSE, DENSE, positions, query_position, window, 0.125, config
    )  # fmt: skip
