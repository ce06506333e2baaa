"""The native int8 CPU kernel (hearth/ops/native/kernels.c) against an fp64 oracle, its build
cache, and how Int8Linear dispatches to it.

u = 2^-24 is the fp32 unit roundoff. The kernel forms each product x·q exactly in fp32 (8 + 8
significant bits), sums K of them in fp32 (error <= K·u·Σ|x·q|), multiplies by the scale (one
more u) and rounds to bf16 (8 significant bits: within 2^-8 of |y|). With |y| <= Σ|x|·|w|,
everything is within (2^-8 + (K + 1)·u)·(|x| @ |W|ᵀ) of the exact product, the bound below.
"""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from hearth.layers.int8 import Int8Linear
from hearth.ops import native
from hearth.ops.native import huge_pages
from hearth.quant import cpu
from native_builds import kernels_build  # noqa: F401 (a fixture)

KERNELS = native.kernels()
needs_native = pytest.mark.skipif(
    KERNELS is None, reason="no C compiler with OpenMP, or neither AVX-512 nor AVX2 here"
)


def random_int8(rows: int, in_features: int, out_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    q = torch.randint(-127, 128, (out_features, in_features), generator=generator)
    scales = (torch.rand(out_features, generator=generator) * 0.01 + 1e-4).to(torch.bfloat16)
    return x, q.to(torch.int8), scales


def exact_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.double() @ (q.double() * scales.double()[:, None]).T


@needs_native
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # Row tails (n % 4), K tails (k % 16), one 16-wide step, and the 270M's decode shapes.
    [(1, 16), (5, 24), (37, 70), (262, 640), (1030, 2048), (640, 2048)],
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_native_int8_kernel_matches_reference(rows: int, out_features: int, in_features: int):
    assert KERNELS is not None
    x, q, scales = random_int8(rows, in_features, out_features, seed=out_features + rows)
    y = KERNELS.int8_rows_matmul(x, q, scales)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    magnitude = x.double().abs() @ (q.double().abs() * scales.double()[:, None]).T
    bound = (2.0**-8 + (in_features + 1) * 2.0**-24) * magnitude
    excess = ((y.double() - exact_product(x, q, scales)).abs() - bound).max().item()
    assert excess <= 0.0, f"exceeds the bound by {excess}"


@needs_native
def test_native_int8_kernel_hand_example():
    # Small integers: every product and sum is exact, so is the bf16 result.
    assert KERNELS is not None
    x = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.5] * 4], dtype=torch.bfloat16)  # k = 20: a tail
    q = torch.tensor([[1] * 20, [-2] * 20, list(range(20))], dtype=torch.int8)
    scales = torch.tensor([1.0, 0.5, 0.25], dtype=torch.bfloat16)
    # Row 0: 4 * (1 + 2 + 3 - 1 + 0.5) = 22; row 1: -2 * 22 * 0.5 = -22;
    # row 2: block b of 5 (j = 5b + i) adds 5b * 5.5 + (0 + 2 + 6 - 3 + 2), so
    # sum_j x_j * j = 27.5 * (0 + 1 + 2 + 3) + 4 * 7 = 193, times 0.25 = 48.25 (8 bits, exact).
    expected = torch.tensor([[22.0, -22.0, 48.25]], dtype=torch.bfloat16)
    assert torch.equal(KERNELS.int8_rows_matmul(x, q, scales), expected)


@needs_native
def test_native_int8_kernel_result_does_not_depend_on_threads():
    # Each output is one thread's dot product, so the thread count changes nothing, bit for bit.
    assert KERNELS is not None
    x, q, scales = random_int8(2, 640, 1030, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = KERNELS.int8_rows_matmul(x, q, scales)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, KERNELS.int8_rows_matmul(x, q, scales))


@needs_native
def test_native_int8_kernel_refuses_what_it_cannot_take():
    assert KERNELS is not None
    x, q, scales = random_int8(17, 64, 8, seed=1)
    with pytest.raises(ValueError, match="int8_rows_matmul"):
        KERNELS.int8_rows_matmul(x, q, scales)  # 17 rows: a prefill, not a decode step
    with pytest.raises(ValueError, match="int8_rows_matmul"):
        KERNELS.int8_rows_matmul(x[:1].float(), q, scales)
    with pytest.raises(ValueError, match="int8_rows_matmul"):
        KERNELS.int8_rows_matmul(x[:1, :32], q, scales)


@needs_native
def test_int8_linear_uses_the_native_kernel_for_one_row():
    generator = torch.Generator().manual_seed(3)
    layer = Int8Linear.from_float(torch.randn(96, 40, generator=generator))  # K = 40: a tail
    assert layer.uses_native and layer.uses_kernel
    x = torch.randn(1, 40, generator=generator).to(torch.bfloat16)
    assert KERNELS is not None
    direct = KERNELS.int8_rows_matmul(x, layer.qweight, layer.scales)
    assert torch.equal(layer(x), direct)


def test_native_kernels_can_be_turned_off(monkeypatch: pytest.MonkeyPatch):
    native.kernels.cache_clear()
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    try:
        assert native.kernels() is None
        assert not Int8Linear.from_float(torch.randn(8, 32)).uses_native
    finally:
        native.kernels.cache_clear()


def _compiler() -> str:
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    return compiler


@needs_native
def test_build_compiles_once_into_the_cache(tmp_path: Path):
    compiler = _compiler()
    # Unoptimized (~3 s, not ~11 s at -O3): the cache is this test's subject, not the code;
    # the default flags' build is the one every native test loads.
    flags = tuple("-O0" if flag == "-O3" else flag for flag in native.FLAGS)
    assert flags != native.FLAGS
    built = native.build(tmp_path, compiler, flags)
    assert built.is_file() and built.parent == tmp_path
    first_mtime = built.stat().st_mtime_ns
    assert native.build(tmp_path, compiler, flags) == built
    assert built.stat().st_mtime_ns == first_mtime  # found, not rebuilt
    assert [path.name for path in tmp_path.iterdir()] == [built.name]  # no scratch left


def test_a_failing_compiler_leaves_nothing_behind(tmp_path: Path):
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc 1.0'\n[ \"$1\" = --version ] && exit 0\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    cache = tmp_path / "cache"
    with pytest.raises(subprocess.CalledProcessError):
        native.build(cache, str(fake))
    assert list(cache.iterdir()) == []


def test_int8_layers_keep_torch_kernel_without_native(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(native, "kernels", lambda: None)  # the library did not build
    layer = Int8Linear.from_float(torch.randn(64, 32))
    assert not layer.uses_native
    assert layer.uses_kernel == cpu.HAS_INT8_KERNEL


# ---------------------------------------------------------------------------------------------
# Decode glue: the same fp32 ops and bf16 roundings as the torch references, so the only
# difference is the order of a sum (of squares, of a dot product). Where that sum is exact in
# any order (small integers), results must be bit-identical; on random data each difference is
# bounded from that one source, as derived next to each check.

BF16_STEP = 2.0**-7  # adjacent bf16 numbers differ by at most 2^-7 of the larger's magnitude


def integer_bf16(shape: tuple[int, ...], seed: int, high: int = 64) -> torch.Tensor:
    """Integers in [-high, high]: exact in bf16, and their squares sum exactly in fp32."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-high, high + 1, shape, generator=generator).to(torch.bfloat16)


def random_bf16(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def norm_weight(width: int, seed: int) -> torch.Tensor:
    return torch.rand(width, generator=torch.Generator().manual_seed(seed)) + 0.5


@needs_native
@pytest.mark.parametrize("shape", [(1, 1, 640), (3, 5, 64)])
def test_add_rms_norm_is_the_reference_where_sums_are_exact(shape: tuple[int, ...]):
    from hearth.ops.norm import add_rms_norm_reference

    assert KERNELS is not None
    residual, x = integer_bf16(shape, seed=1), integer_bf16(shape, seed=2)
    weight = norm_weight(shape[-1], seed=3)
    summed, normed = KERNELS.add_rms_norm(residual, x, weight, 1e-6, None)
    expected, _ = add_rms_norm_reference(residual, x, weight, 1e-6)
    assert normed is None and torch.equal(summed, expected)


@needs_native
@pytest.mark.parametrize("shape", [(1, 1, 640), (3, 5, 64)])
def test_add_rms_norm_matches_the_reference(shape: tuple[int, ...]):
    from hearth.ops.norm import add_rms_norm_reference, rms_norm_reference

    assert KERNELS is not None
    residual, x = random_bf16(shape, seed=4) * 4, random_bf16(shape, seed=5)
    weight, next_weight = norm_weight(shape[-1], seed=6), norm_weight(shape[-1], seed=7)
    summed, normed = KERNELS.add_rms_norm(residual, x, weight, 1e-6, next_weight)
    expected_summed, expected_normed = add_rms_norm_reference(
        residual, x, weight, 1e-6, next_weight, normalize_next=True
    )
    assert normed is not None and expected_normed is not None
    # norm(x)·w: fp32 values within (H + 3)·u of each other, so at most one bf16 step apart;
    # the add rounds again: |Δsummed| <= step·(|norm(x)·w| + |summed|).
    first = rms_norm_reference(x, weight, 1e-6).float().abs()
    summed_bound = BF16_STEP * (first + expected_summed.float().abs())
    assert ((summed.float() - expected_summed.float()).abs() <= summed_bound).all()
    # The second norm scales each summed value by r·w_next (r = 1/rms): Δsummed carries over
    # scaled, and r itself moves by at most one step (each element moves by <= 2 steps of
    # itself, so Σx² by <= 4 of its 2^7): with the output's two roundings, 3 steps of |normed|.
    rms = expected_summed.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    normed_bound = summed_bound * rms * next_weight + 3 * BF16_STEP * expected_normed.float().abs()
    assert ((normed.float() - expected_normed.float()).abs() <= normed_bound).all()


@needs_native
def test_add_rms_norm_dispatches_to_native_for_cpu_bf16():
    from hearth.ops.norm import add_rms_norm

    assert KERNELS is not None
    residual, x = random_bf16((1, 1, 64), seed=8), random_bf16((1, 1, 64), seed=9)
    weight, next_weight = norm_weight(64, seed=10), norm_weight(64, seed=11)
    got = add_rms_norm(residual, x, weight, 1e-6, next_weight, normalize_next=True)
    direct = KERNELS.add_rms_norm(residual, x, weight, 1e-6, next_weight)
    assert all(torch.equal(a, b) for a, b in zip(got, direct, strict=True))


def _rope_tables(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(100, 100 + tokens, dtype=torch.float32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


@needs_native
@pytest.mark.parametrize(
    ("tokens", "q_heads", "kv_heads", "head_dim"), [(1, 4, 1, 256), (3, 4, 2, 64)]
)
def test_norm_rope_matches_the_reference(tokens: int, q_heads: int, kv_heads: int, head_dim: int):
    from hearth.ops.norm import rms_norm_reference
    from hearth.ops.rope import ValueMode, norm_rope, norm_rope_reference

    assert KERNELS is not None
    cos, sin = _rope_tables(tokens, head_dim)
    q_weight, k_weight = norm_weight(head_dim, seed=12), norm_weight(head_dim, seed=13)
    width = (q_heads + 2 * kv_heads) * head_dim
    args = (q_heads, kv_heads, head_dim, q_weight, k_weight, cos, sin, 1e-6)
    # Small integers: every sum is exact, so every result is bit for bit the reference's.
    exact = integer_bf16((tokens, width), seed=14)
    got = KERNELS.norm_rope(exact, *args)
    expected = norm_rope_reference(exact, *args, ValueMode.RAW)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # Random data: the normed head x̂ may be one bf16 step off (see add_rms_norm above); the
    # rotation rounds x̂·cos, x̂'·sin and their sum, so with the step in x̂ each output is within
    # 4 steps of |x̂·cos| + |x̂'·sin| of the reference's.
    qkv = random_bf16((tokens, width), seed=15)
    got = KERNELS.norm_rope(qkv, *args)
    expected = norm_rope_reference(qkv, *args, ValueMode.RAW)
    for index, (heads, weight) in enumerate([(q_heads, q_weight), (kv_heads, k_weight)]):
        start = 0 if index == 0 else q_heads * head_dim
        raw = qkv[:, start : start + heads * head_dim].view(tokens, heads, head_dim)
        normed = rms_norm_reference(raw, weight, 1e-6).float().abs()
        rotated = torch.cat([normed[..., head_dim // 2 :], normed[..., : head_dim // 2]], -1)
        magnitude = normed * cos.float()[:, None].abs() + rotated * sin.float()[:, None].abs()
        error = (got[index].float() - expected[index].float()).abs()
        assert (error <= 4 * BF16_STEP * magnitude).all()
    assert torch.equal(got[2], expected[2])  # v is a copy
    assert all(
        torch.equal(a, b) for a, b in zip(norm_rope(qkv, *args, ValueMode.RAW), got, strict=True)
    )


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "length", "slots", "dim"),
    # Chunks of 128 keys: a partial last chunk, less than one key block (8), exactly two
    # chunks at Gemma's head_dim 256 with a group of 8 (E2B), one key past a chunk at 512,
    # and a head_dim of 72: a partial last 16 values, and value slices past it (AVX2 and 512).
    [
        (4, 1, 430, 512, 64),
        (8, 2, 7, 16, 64),
        (8, 1, 256, 300, 256),
        (2, 1, 129, 160, 512),
        (2, 1, 20, 24, 72),
    ],
)
def test_decode_attention_matches_fp64(
    heads: int, kv_heads: int, length: int, slots: int, dim: int
):
    from hearth.layers.attention import decode_attention

    assert KERNELS is not None
    scale = dim**-0.5
    q = random_bf16((1, heads, 1, dim), seed=16) * 3
    keys, values = (
        random_bf16((1, kv_heads, slots, dim), seed=17),
        random_bf16((1, kv_heads, slots, dim), seed=18),
    )
    got = KERNELS.decode_attention(q, keys, values, scale, length)
    assert torch.equal(decode_attention(q, keys, values, scale, length), got)  # the CPU path
    group = heads // kv_heads
    k64 = keys[:, :, :length].double().repeat_interleave(group, dim=1)
    v64 = values[:, :, :length].double().repeat_interleave(group, dim=1)
    scores = (q.double() @ k64.transpose(-1, -2)) * scale
    probabilities = scores.softmax(-1)
    exact = probabilities @ v64
    # Each fp32 score is within dim·u·scale·Σ|q·k| (δ) of exact; exp and the division add a few
    # u, so each probability is within (2δ + 8u) of its own size; the weighted sum of `length`
    # terms adds length·u of Σp|v|; the output rounds to bf16 (2^-8).
    delta = (dim * 2.0**-24 * scale * (q.double().abs() @ k64.abs().transpose(-1, -2))).amax(
        -1, keepdim=True
    )
    weighted = probabilities @ v64.abs()
    bound = 2.0**-8 * exact.abs() + (2 * delta + (length + 8) * 2.0**-24) * weighted
    assert ((got.double() - exact).abs() <= bound).all()
    # Work is cut by the length, not the threads, and merged in order: one thread, same bits.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(KERNELS.decode_attention(q, keys, values, scale, length), got)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Weights in transparent huge pages


def _thp_policy() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


def _huge_kib_backing(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])
    return 0


@pytest.mark.skipif(_thp_policy() not in ("always", "madvise"), reason="no THP on this kernel")
def test_huge_page_buffer_is_backed_by_huge_pages():
    buffer = huge_pages.huge_page_buffer(3 * huge_pages.HUGE_PAGE_BYTES - 5)
    assert buffer is not None
    assert buffer.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert buffer.numel() == 3 * huge_pages.HUGE_PAGE_BYTES  # rounded up to whole huge pages
    buffer.fill_(1)  # first touch: the kernel backs the advised range now
    assert _huge_kib_backing(buffer.data_ptr()) >= 2048


def test_move_into_huge_pages_keeps_every_value():
    layers = nn.ModuleList([Int8Linear.from_float(torch.randn(out, 40)) for out in (3, 70, 5)])
    before = [layer.qweight.clone() for layer in layers]
    x = torch.randn(1, 40).to(torch.bfloat16)
    outputs = [layer(x) for layer in layers]
    moved = huge_pages.move_into_huge_pages([(layer, "qweight") for layer in layers])
    if huge_pages.huge_page_buffer(1) is None:
        assert not moved  # not Linux: nothing to move into, nothing moved
        return
    assert moved
    storage = layers[0].qweight.untyped_storage().data_ptr()
    for layer, original in zip(layers, before, strict=True):
        assert torch.equal(layer.qweight, original) and layer.qweight.is_contiguous()
        assert layer.qweight.untyped_storage().data_ptr() == storage  # one buffer for all
        assert layer.qweight.data_ptr() % huge_pages.TENSOR_ALIGNMENT == 0
    assert all(torch.equal(layer(x), y) for layer, y in zip(layers, outputs, strict=True))


def test_move_into_huge_pages_moves_parameters_and_keeps_ties():
    first, second = nn.Linear(40, 70, bias=False), nn.Linear(40, 70, bias=False)
    second.weight = first.weight  # tied: one tensor held by two modules
    other = nn.Linear(8, 3, bias=False)
    before = first.weight.detach().clone()
    slots = [(first, "weight"), (second, "weight"), (other, "weight")]
    if not huge_pages.move_into_huge_pages(slots):
        assert huge_pages.huge_page_buffer(1) is None  # only where none can be had
        return
    assert isinstance(first.weight, nn.Parameter) and first.weight.requires_grad
    assert second.weight is first.weight  # still tied, moved once
    assert torch.equal(first.weight.detach(), before)
    assert first.weight.untyped_storage().data_ptr() == other.weight.untyped_storage().data_ptr()


@needs_native
@pytest.mark.parametrize(("out_features", "in_features"), [(5, 24), (262, 640), (640, 2048)])
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_native_bf16_kernel_matches_fp64(rows: int, out_features: int, in_features: int):
    # Products of two bf16 numbers are exact in fp32; K of them summed in fp32 stay within
    # K·u of Σ|x·w|, and the bf16 output rounds within 2^-8 of |y| <= Σ|x·w|.
    assert KERNELS is not None
    x = random_bf16((rows, in_features), seed=rows)
    weight = random_bf16((out_features, in_features), seed=out_features)
    y = KERNELS.bf16_rows_matmul(x, weight)
    exact = x.double() @ weight.double().T
    bound = (2.0**-8 + in_features * 2.0**-24) * (x.double().abs() @ weight.double().abs().T)
    assert ((y.double() - exact).abs() <= bound).all()


@needs_native
def test_bf16_decode_steps_take_the_native_kernel():
    from hearth.layers.embedding import Embedding
    from hearth.layers.linear import project

    assert KERNELS is not None
    linear = nn.Linear(48, 20, bias=False).to(torch.bfloat16)
    one_row = random_bf16((1, 1, 48), seed=19)
    table = Embedding(20, 48).to(torch.bfloat16)
    with torch.inference_mode():  # as generation runs
        direct = KERNELS.bf16_rows_matmul(one_row.reshape(1, 48), linear.weight)
        assert torch.equal(project(linear, one_row), direct.reshape(1, 1, 20))
        direct = KERNELS.bf16_rows_matmul(one_row.reshape(1, 48), table.weight)
        assert torch.equal(table.head(one_row), direct.reshape(1, 1, 20))
    # Several rows (a prefill), fp32, and tensors autograd tracks keep torch's matmul.
    assert native.row_matmul(random_bf16((1, 3, 48), seed=20), linear.weight) is None
    assert native.row_matmul(one_row.float(), linear.weight.float()) is None
    assert linear.weight.requires_grad and native.row_matmul(one_row, linear.weight) is None
    with torch.no_grad():
        assert native.row_matmul(one_row, linear.weight) is not None


@pytest.mark.parametrize("enabled", [False, True])
def test_loading_moves_streamed_weights_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool
):
    from hearth.checkpoint import open_checkpoint
    from hearth.models.loading import build_model
    from tiny import save_hf, tiny_gemma3_model

    if enabled:
        monkeypatch.setenv(huge_pages.ENABLE_VARIABLE, "1")
    else:
        monkeypatch.delenv(huge_pages.ENABLE_VARIABLE, raising=False)
    checkpoint = open_checkpoint(save_hf(tiny_gemma3_model(), tmp_path))
    model = build_model(checkpoint, torch.bfloat16, "cpu", False, quantize="int8")
    layers = [module for module in model.modules() if isinstance(module, Int8Linear)]
    storages = {layer.qweight.untyped_storage().data_ptr() for layer in layers}
    moved = enabled and huge_pages.huge_page_buffer(1) is not None
    assert len(storages) == (1 if moved else len(layers))


# ---------------------------------------------------------------------------------------------
# Load-time conversions: bit for bit what the torch code computes


def _random_blocks(type_id: int, n_blocks: int, seed: int) -> np.ndarray:
    """Blocks of random bytes: every code, and fp16 scales of every kind (normal, subnormal,
    zero, inf, NaN) where the bytes fall so."""
    nbytes = native.BLOCK_TYPES[type_id][1]
    generator = np.random.default_rng(seed)
    return generator.integers(0, 256, n_blocks * nbytes, dtype=np.uint8)


def assert_same_bf16(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits, but NaN only as NaN: its payload is each library's own choice."""
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@needs_native
@pytest.mark.parametrize("type_id", sorted(native.BLOCK_TYPES))
@pytest.mark.parametrize("n_blocks", [1, 7, 2048])
def test_native_blocks_to_bf16_are_the_gguf_package_values(type_id: int, n_blocks: int) -> None:
    """Each GGML block type as the `gguf` package dequantizes it (numpy, fp32), then rounded
    to bf16 as torch rounds: bit for bit."""
    assert KERNELS is not None
    blocks = _random_blocks(type_id, n_blocks, seed=type_id * 1000 + n_blocks)
    with np.errstate(invalid="ignore", over="ignore"):
        reference = gguf.quants.dequantize(
            blocks.reshape(1, -1), gguf.GGMLQuantizationType(type_id)
        )
    expected = torch.from_numpy(np.ascontiguousarray(reference)).reshape(-1).to(torch.bfloat16)
    ours = torch.empty(expected.numel(), dtype=torch.bfloat16)
    KERNELS.blocks_to_bf16(type_id, blocks, ours)
    assert_same_bf16(ours, expected)


@needs_native
@pytest.mark.parametrize(("rows", "cols"), [(1, 16), (5, 37), (64, 640), (3, 2048)])
def test_native_int8_row_quantization_is_the_torch_one(
    rows: int, cols: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Codes and scales equal, with rows of zeros, of exact halves (round half to even) and
    of magnitudes whose scale lands between two bf16 numbers (rounded up)."""
    generator = torch.Generator().manual_seed(rows * cols)
    weight = (torch.randn(rows, cols, generator=generator) * 0.05).to(torch.bfloat16)
    weight[0, : min(cols, 4)] = torch.tensor([127.0, 0.5, 1.5, -2.5])[: min(cols, 4)]
    if rows > 1:
        weight[1] = 0.0
    if rows > 2:
        weight[2] = torch.linspace(-3.0, 3.0, cols).to(torch.bfloat16)
    ours = cpu.quantize_int8_rows(weight)
    monkeypatch.setattr(native, "kernels", lambda: None)
    expected = cpu.quantize_int8_rows(weight)
    assert torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1])


@needs_native
@pytest.mark.parametrize(("rows", "cols"), [(1, 16), (5, 37), (300, 640)])
def test_native_int8_to_bf16_is_the_torch_dequantization(rows: int, cols: int) -> None:
    """What a prefill's GEMM reads: bit for bit (q.float() * s.float()).bfloat16(), over all
    codes, tiny and huge scales and a tail of columns."""
    assert KERNELS is not None
    generator = torch.Generator().manual_seed(rows + cols)
    codes = torch.randint(-128, 128, (rows, cols), generator=generator, dtype=torch.int8)
    scales = (torch.rand(rows, generator=generator) * 1e-2).to(torch.bfloat16)
    scales[0] = 3e38 if rows > 1 else scales[0]  # products that round to inf in bf16
    expected = (codes.float() * scales.float()[:, None]).to(torch.bfloat16)
    ours = KERNELS.int8_rows_to_bf16(codes, scales)
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))


@needs_native
@pytest.mark.parametrize("width", [1, 5, 16, 17, 100, 262144, 262145])
def test_argmax_rows_is_torch_max_indices(width: int):
    """The native argmax returns what `max(dim=-1).indices` does (the oracle), on random rows,
    ties (rounded values: the first index wins), a NaN (its index), rows of -inf with a +inf
    or a tail value, and row tails past whole 16-lane blocks."""
    generator = torch.Generator().manual_seed(width)
    for case in range(8):
        rows = torch.randn(3, width, generator=generator)
        if case % 4 == 1:
            rows = rows.round()
        elif case % 4 == 2:
            rows[1, torch.randint(width, (1,), generator=generator)] = float("nan")
        elif case % 4 == 3:
            rows.fill_(-float("inf"))
            rows[2, width // 2] = float("inf")
            rows[0, -1] = -3.0  # all-negative, the maximum in the tail
        assert torch.equal(KERNELS.argmax_rows(rows), rows.max(dim=-1).indices), case


@needs_native
def test_greedy_sampling_takes_the_native_argmax(monkeypatch: pytest.MonkeyPatch):
    from hearth.runtime import sampling

    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(3)).round()
    calls = []
    original = native.NativeKernels.argmax_rows

    def counted(self, rows):  # on the class: other tests may have rebuilt `native.kernels()`
        calls.append(1)
        return original(self, rows)

    monkeypatch.setattr(native.NativeKernels, "argmax_rows", counted)
    picked = sampling.Sampler(sampling.SamplingParams()).sample(logits, [])
    assert calls and torch.equal(picked, logits.argmax(dim=-1))


# fp32 glue: torch forms the mean of squares in its own order. Summing h = 640 squares in any
# order moves it by at most γ_h ≈ h·2⁻²⁴ = 3.8e-5 relative, the inverse square root halves that,
# and three more roundings follow: every value within 2.5e-5 of the largest |value|.
FP32_RELATIVE = 2.5e-5


@needs_native
def test_fp32_add_rms_norm_matches_the_reference_and_dispatches_for_one_row():
    from hearth.ops.norm import add_rms_norm, add_rms_norm_reference

    assert KERNELS is not None
    generator = torch.Generator().manual_seed(21)
    residual, x = torch.randn(2, 1, 1, 640, generator=generator)
    weight, next_weight = torch.rand(2, 640, generator=generator) + 0.5
    summed, normed = KERNELS.add_rms_norm(residual, x, weight, 1e-6, next_weight)
    expected_summed, expected_normed = add_rms_norm_reference(
        residual, x, weight, 1e-6, next_weight, True
    )
    assert expected_normed is not None and normed is not None
    for got, expected in ((summed, expected_summed), (normed, expected_normed)):
        assert ((got - expected).abs() <= FP32_RELATIVE * expected.abs().max()).all()
    dispatched = add_rms_norm(residual, x, weight, 1e-6, next_weight, normalize_next=True)
    assert all(torch.equal(a, b) for a, b in zip(dispatched, (summed, normed), strict=True))
    many = torch.randn(1, 3, 640, generator=generator)  # a prefill keeps the reference
    got = add_rms_norm(many, many, weight, 1e-6, next_weight, normalize_next=True)
    reference = add_rms_norm_reference(many, many, weight, 1e-6, next_weight, True)
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


@needs_native
def test_fp32_norm_rope_matches_the_reference_and_dispatches_for_one_token():
    from hearth.ops.rope import ValueMode, norm_rope, norm_rope_reference

    assert KERNELS is not None
    q_heads, kv_heads, head_dim = 4, 1, 256
    cos, sin = (table.float() for table in _rope_tables(1, head_dim))
    generator = torch.Generator().manual_seed(22)
    q_weight, k_weight = torch.rand(2, head_dim, generator=generator) + 0.5
    qkv = torch.randn(1, (q_heads + 2 * kv_heads) * head_dim, generator=generator)
    args = (q_heads, kv_heads, head_dim, q_weight, k_weight, cos, sin, 1e-6)
    got = KERNELS.norm_rope(qkv, *args)
    expected = norm_rope_reference(qkv, *args, ValueMode.RAW)
    for a, b in zip(got[:2], expected[:2], strict=True):
        assert b is not None and ((a - b).abs() <= FP32_RELATIVE * b.abs().max()).all()
    assert expected[2] is not None and torch.equal(got[2], expected[2])  # v is a copy
    dispatched = norm_rope(qkv, *args, ValueMode.RAW)
    assert all(torch.equal(a, b) for a, b in zip(dispatched, got, strict=True))


@pytest.mark.usefixtures("kernels_build")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "length", "slots", "dim"),
    # As the bf16 test: a partial last chunk; under one key block; two whole chunks at 256; a
    # partial last 16 values (72).
    [(4, 1, 430, 512, 64), (8, 2, 7, 16, 64), (8, 1, 256, 300, 256), (2, 1, 20, 24, 72)],
)
def test_fp32_decode_attention_matches_fp64(
    heads: int, kv_heads: int, length: int, slots: int, dim: int
):
    """The fp32 one-query attention (the native GGUF layer's) within the bf16 test's bound
    without its output rounding, on this CPU's library and the AVX2 one."""
    kernels = native.kernels()
    assert kernels is not None
    scale = dim**-0.5
    generator = torch.Generator().manual_seed(dim + length)
    q = torch.randn(1, heads, 1, dim, generator=generator) * 3
    keys, values = (torch.randn(1, kv_heads, slots, dim, generator=generator) for _ in range(2))
    got = kernels.decode_attention_f32(q, keys, values, scale, length)
    group = heads // kv_heads
    k64 = keys[:, :, :length].double().repeat_interleave(group, dim=1)
    v64 = values[:, :, :length].double().repeat_interleave(group, dim=1)
    scores = (q.double() @ k64.transpose(-1, -2)) * scale
    probabilities = scores.softmax(-1)
    exact = probabilities @ v64
    # Each fp32 score is within dim·u·scale·Σ|q·k| (δ) of exact; exp and the division add a few
    # u, so each probability is within (2δ + 8u) of its own size; the weighted sum of `length`
    # terms adds length·u of Σp|v|.
    delta = (dim * 2.0**-24 * scale * (q.double().abs() @ k64.abs().transpose(-1, -2))).amax(
        -1, keepdim=True
    )
    bound = (2 * delta + (length + 8) * 2.0**-24) * (probabilities @ v64.abs())
    assert ((got.double() - exact).abs() <= bound).all()
    # A wrong key or value row (the last one dropped) lands outside the bound.
    dropped = kernels.decode_attention_f32(q, keys, values, scale, length - 1)
    assert not ((dropped.double() - exact).abs() <= bound).all()


@pytest.mark.usefixtures("kernels_build")
def test_fp32_geglu_is_gelu_tanh_within_its_conditioning():
    """The native GGUF layer's GeGLU, x / (1 + e^(-2u)) · up (torch's 0.5 x (1 + tanh u)
    rewritten), against fp64 over [-30, 30]: within (16 + 8|u|) ulp of the result, the
    rounding of u (relative 2^-24 |u|, doubled by e^(-2u)) being the conditioning of any fp32
    form, plus 1e-12 absolute where the result underflows toward 0. torch's own fp32 tanh form
    is off by up to ~400 ulp near x = -5 (1 + tanh u cancels), so it is not the reference."""
    kernels = native.kernels()
    assert kernels is not None
    generator = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.linspace(-30, 30, 60001), torch.randn(20000, generator=generator) * 3])
    up = torch.randn(gate.shape[0], generator=generator)
    got = kernels.geglu_f32(torch.cat([gate, up]).reshape(1, -1))[0]
    x = gate.double()
    u = 0.7978845608028654 * (x + 0.044715 * x**3)
    exact = torch.nn.functional.gelu(x, approximate="tanh") * up.double()
    bound = (16 + 8 * u.abs()) * 2.0**-24 * exact.abs() + 1e-12
    assert ((got.double() - exact).abs() <= bound).all()
