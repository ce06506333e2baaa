"""The grouped (MoE prefill) expert matmul, run in Triton's CPU interpreter.

Each kernel result is checked against the torch reference (one ``F.linear`` per expert) and an
independent fp64 oracle (one dot product per (token, slot) pair, weights from the codes).

Tolerances, per output y = scale * sum_k x_k w_k (scale = the optional row weight):
* rounding of the output to the activations' dtype: the kernel rounds once, the reference
  twice when it scales rows (the product, then the scaled product), so 2 eps_out |y|;
* fp32 accumulation in another order: 4 sqrt(K) eps32 * M, M = |scale| sum_k |x_k w_k|
  (a random-walk bound with a factor 4 of slack);
* packed weights only, kernel or reference vs the oracle: both round each weight as mlx does
  (``q * s``, then ``+ b`` in the scales' dtype, then to x's dtype), each rounding off by half
  an ulp of a value at most |q s| + |b|: (eps_scales + eps_x) * |scale| sum_k |x_k| (|q s| + |b|).
  Kernel vs reference has no such term: the kernel rounds the weights exactly as the reference.

fp16 and fp32 stand in for bf16, whose ``tl.dot`` the interpreter computes wrongly; the GPU
script (benchmarks/lab/gpu_kernels_grouped.py) covers bf16 at Gemma 4 26B-A4B's shapes.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from hearth.layers import experts as experts_layer
from hearth.layers.affine import MLXQuantizedExperts
from hearth.layers.experts import GROUPED_EXPERTS_MIN_TOKENS, Experts
from hearth.ops import expert_plan
from hearth.ops import grouped_matmul as gm
from hearth.ops.activation import gelu_tanh_mul_reference, gelu_tanh_mul_triton
from hearth.quant.mlx import pack_codes, quantize_affine, unpack_codes

pytestmark = [
    pytest.mark.skipif(not gm.HAS_TRITON, reason="needs triton (its interpreter)"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="interpreter tests; the GPU script checks the kernels"
    ),
]
EPS32 = torch.finfo(torch.float32).eps
EXPERTS = 12
UNUSED_EXPERTS = (3, 7)


def _routing(kind: str, tokens: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """[tokens, top_k] ids: 'ragged' (distinct per token, skewed, experts 3 and 7 unused) or
    'one' (every slot of every token on expert 5)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "one":
        return torch.full((tokens, top_k), 5)
    popularity = torch.linspace(1.0, 6.0, EXPERTS)
    popularity[list(UNUSED_EXPERTS)] = 0.0
    draws = popularity.expand(tokens, EXPERTS)
    return torch.multinomial(draws, top_k, replacement=False, generator=generator)


def _pair_rows(x: torch.Tensor, top_k: int) -> torch.Tensor:
    return (x[:, None].expand(-1, top_k, -1) if x.dim() == 2 else x).double()


def _oracle(x, weight64, ids, row_scale):
    """fp64, one dot per pair; also the magnitude sum_k |x_k w_k| (times |scale|)."""
    rows = _pair_rows(x, ids.shape[1])
    chosen = weight64[ids]  # [T, top_k, N, K]
    y = torch.einsum("tsk,tsnk->tsn", rows, chosen)
    magnitude = torch.einsum("tsk,tsnk->tsn", rows.abs(), chosen.abs())
    if row_scale is not None:
        y, magnitude = y * row_scale.double()[..., None], magnitude * row_scale.double()[..., None]
    return y, magnitude


def _assert_close(got, want, magnitude, k, extra=None):
    eps_out = torch.finfo(got.dtype).eps
    bound = 2 * eps_out * want.double().abs() + 4 * math.sqrt(k) * EPS32 * magnitude
    if extra is not None:
        bound = bound + extra
    error = (got.double() - want.double()).abs()
    assert (error <= bound + 1e-30).all(), f"max error/bound {(error / bound).max().item():.3f}"


# ---------------------------------------------------------------------------------------------
# The plan: sorted, padded tiles of one expert each


@pytest.mark.parametrize("kind", ["ragged", "one"])
@pytest.mark.parametrize(("tokens", "top_k", "block_m"), [(24, 8, 16), (24, 1, 16), (40, 8, 64)])
def test_plan_places_every_pair_once_in_its_experts_tiles(kind, tokens, top_k, block_m) -> None:
    ids = _routing(kind, tokens, top_k)
    plan = gm.plan_experts(ids, EXPERTS, block_m)
    pairs = tokens * top_k
    assert plan.tiles == -(-pairs // block_m) + min(EXPERTS, pairs)
    rows = plan.rows.long().view(plan.tiles, block_m)
    real = rows < pairs
    assert sorted(rows[real].tolist()) == list(range(pairs))
    flat = ids.reshape(-1)
    for tile in range(plan.tiles):
        expert = plan.tile_experts[tile].item()
        if expert == EXPERTS:  # past the last segment: padding only
            assert not real[tile].any()
            continue
        assert (flat[rows[tile][real[tile]]] == expert).all()
        assert real[tile].any()  # no tile is all padding inside a segment
    # Tiles come in expert order, and padding only ends a segment.
    used = plan.tile_experts[plan.tile_experts < EXPERTS]
    assert (used[1:] >= used[:-1]).all()
    assert set(used.tolist()) == set(flat.tolist())


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m", "kind"),
    [
        (24, 8, EXPERTS, 16, "ragged"),  # one chunk, unused experts
        (40, 8, EXPERTS, 64, "one"),  # every pair on one expert
        (600, 8, 128, 64, "uniform"),  # 4800 pairs: 38 chunks; 128 experts
        (1100, 8, 128, 64, "uniform"),  # 69 chunks (two count blocks), 266 tiles (three blocks)
        (5, 2, 6, 16, "uniform"),  # experts not a power of two
        (1, 1, 3, 16, "uniform"),
    ],
)
def test_triton_plan_equals_the_reference(tokens, top_k, experts, block_m, kind) -> None:
    """The counting sort gives the stable argsort's plan exactly: every row and tile expert,
    the row table's padding written by the count kernel's programs."""
    if kind == "uniform":
        ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(3))
    else:
        ids = _routing(kind, tokens, top_k)
    want = gm.plan_experts_reference(ids, experts, block_m)
    rows, tile_experts = expert_plan.sort_pairs_triton(
        ids.reshape(-1), experts, block_m, want.tiles
    )
    assert torch.equal(rows, want.rows)
    assert torch.equal(tile_experts, want.tile_experts)


def test_plan_experts_takes_the_counting_sort_for_kernel_tensors(monkeypatch) -> None:
    calls = []
    sort = expert_plan.sort_pairs_triton
    monkeypatch.setattr(gm, "kernel_enabled", lambda tensor: True)
    monkeypatch.setattr(
        expert_plan, "sort_pairs_triton", lambda *args: calls.append(args) or sort(*args)
    )
    ids = _routing("ragged", 70, 8)
    got, want = gm.plan_experts(ids, EXPERTS), gm.plan_experts_reference(ids, EXPERTS)
    assert len(calls) == 1
    assert torch.equal(got.rows, want.rows) and torch.equal(got.tile_experts, want.tile_experts)
    assert (got.block_m, got.tokens, got.top_k) == (want.block_m, want.tokens, want.top_k)


def test_default_block_m_grows_with_rows_per_expert() -> None:
    assert gm.default_block_m(512 * 8, 128) == gm.LARGE_BLOCK_M  # 32 rows per expert
    assert gm.default_block_m(2048 * 8, 128) == gm.TALL_BLOCK_M  # 128 rows per expert
    assert gm.default_block_m(1024 * 8, 128) == gm.LARGE_BLOCK_M  # 64 rows per expert
    assert gm.default_block_m(1024 * 8, 128, packed=True) == gm.TALL_BLOCK_M
    assert gm.default_block_m(64 * 8, 128) == gm.SMALL_BLOCK_M


def test_autotuning_keeps_tiles_that_fit_the_height_and_the_groups() -> None:
    def kept(block_m: int, group: int, geglu: bool = False) -> set[tuple[int, int, int, int]]:
        configs = gm._prune_configs(gm._CONFIGS, {}, BLOCK_M=block_m, GROUP=group, GEGLU=geglu)
        return {
            (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in configs
        }

    assert kept(16, 1) == set(gm._SHORT_TILES) == kept(16, 1, geglu=True)
    assert kept(64, 1) == set(gm._TALL_TILES)
    assert all(128 % k == 0 for _, k, *_ in kept(128, 128))  # whole K steps per group
    assert kept(64, 32) == kept(64, 1)
    # Two accumulators: at most 128 fp32 registers a thread for the gate and up tiles.
    assert kept(128, 1, geglu=True) == set(gm._GEGLU_TALL_TILES)
    assert all(2 * 128 * n // (32 * warps) <= 128 for n, _, warps, _ in kept(128, 1, geglu=True))


# ---------------------------------------------------------------------------------------------
# Float experts


FLOAT_CASES = [
    # dtype, kind, top_k, x per slot, row scale, block_m, config
    (torch.float16, "ragged", 8, False, False, None, None),
    (torch.float16, "ragged", 8, True, True, None, {"BLOCK_N": 16, "BLOCK_K": 64}),
    (torch.float16, "one", 8, False, True, 64, None),
    (torch.float16, "ragged", 8, False, True, 128, None),
    (torch.float16, "ragged", 1, False, False, None, None),
    (torch.float32, "ragged", 8, True, True, 64, None),
    (torch.float32, "one", 1, True, False, None, {"BLOCK_N": 64, "BLOCK_K": 16}),
]


@pytest.mark.parametrize(
    ("dtype", "kind", "top_k", "per_slot", "scaled", "block_m", "config"), FLOAT_CASES
)
def test_float_kernel_matches_reference_and_oracle(
    dtype, kind, top_k, per_slot, scaled, block_m, config
) -> None:
    torch.manual_seed(1)
    tokens, n, k = 24, 40, 96  # N and K not multiples of the blocks: masked edges
    ids = _routing(kind, tokens, top_k)
    x = torch.randn(tokens, *((top_k,) if per_slot else ()), k).to(dtype)
    weight = (torch.randn(EXPERTS, n, k) / math.sqrt(k)).to(dtype)
    row_scale = torch.rand(tokens, top_k) if scaled else None
    plan = gm.plan_experts(ids, EXPERTS, block_m)
    got = gm.grouped_expert_matmul_triton(x, weight, ids, row_scale, plan, config)
    reference = gm.grouped_expert_matmul_reference(x, weight, ids, row_scale)
    oracle, magnitude = _oracle(x, weight.double(), ids, row_scale)
    assert got.shape == reference.shape == (tokens, top_k, n)
    assert got.dtype == dtype
    _assert_close(got, reference, magnitude, k)
    _assert_close(got, oracle, magnitude, k)
    _assert_close(reference, oracle, magnitude, k)


def test_dispatcher_is_the_reference_on_cpu() -> None:
    ids = _routing("ragged", 6, 2)
    x, weight = torch.randn(6, 32), torch.randn(EXPERTS, 8, 32)
    got = gm.grouped_expert_matmul(x, weight, ids)
    assert torch.equal(got, gm.grouped_expert_matmul_reference(x, weight, ids))


# ---------------------------------------------------------------------------------------------
# MLX affine-packed experts


def _oracle_weight(packed, scales, biases, bits):
    """fp64 weights from the codes, and |q s| + |b| (the rounding magnitude of each weight)."""
    codes = unpack_codes(packed, bits).double()
    grouped = codes.unflatten(-1, (scales.shape[-1], -1))
    qs, b = grouped * scales.double()[..., None], biases.double()[..., None]
    return (qs + b).flatten(-2), (qs.abs() + b.abs()).flatten(-2)


AFFINE_CASES = [
    # bits, group, activations, scales, top_k, kind, config
    (4, 64, torch.float16, torch.float16, 8, "ragged", None),  # BLOCK_K 32 < group
    (4, 32, torch.float32, torch.float16, 1, "one", {"BLOCK_N": 32, "BLOCK_K": 128}),
    (8, 64, torch.float16, torch.float32, 8, "one", {"BLOCK_N": 16, "BLOCK_K": 128}),
    (8, 32, torch.float32, torch.float32, 8, "ragged", None),
]


@pytest.mark.parametrize(
    ("bits", "group", "dtype", "scale_dtype", "top_k", "kind", "config"), AFFINE_CASES
)
def test_affine_kernel_matches_reference_and_oracle(
    bits, group, dtype, scale_dtype, top_k, kind, config
) -> None:
    torch.manual_seed(2)
    tokens, n, k = 20, 40, 128
    ids = _routing(kind, tokens, top_k, seed=bits)
    packed, scales, biases = quantize_affine(torch.randn(EXPERTS, n, k) / 8, bits, group)
    scales, biases = scales.to(scale_dtype), biases.to(scale_dtype)
    x = torch.randn(tokens, top_k, k).to(dtype) if top_k == 8 else torch.randn(tokens, k).to(dtype)
    row_scale = torch.rand(tokens, top_k)
    args = (x, packed, scales, biases, ids, bits, group, row_scale)
    got = gm.grouped_affine_expert_matmul_triton(*args, config=config)
    reference = gm.grouped_affine_expert_matmul_reference(*args)
    weight64, rounding = _oracle_weight(packed, scales, biases, bits)
    oracle, magnitude = _oracle(x, weight64, ids, row_scale)
    weight_eps = torch.finfo(scale_dtype).eps + torch.finfo(dtype).eps
    extra = weight_eps * _oracle(x.abs(), rounding, ids, row_scale)[0]
    _assert_close(got, reference, magnitude, k)
    _assert_close(got, oracle, magnitude, k, extra)
    _assert_close(reference, oracle, magnitude, k, extra)


GEGLU_CASES = [
    # bits (None: float), activations, block_m, config
    (None, torch.float16, 16, None),
    (None, torch.float16, 128, {"BLOCK_N": 16, "BLOCK_K": 64}),
    (None, torch.float32, 64, None),
    (4, torch.float16, 64, {"BLOCK_N": 16, "BLOCK_K": 64}),  # whole groups per K step
    (8, torch.float32, 16, {"BLOCK_N": 32, "BLOCK_K": 16}),  # K steps within a group
]


@pytest.mark.parametrize(("bits", "dtype", "block_m", "config"), GEGLU_CASES)
def test_geglu_output_equals_the_product_then_the_geglu_kernel(
    bits, dtype, block_m, config
) -> None:
    """With `geglu` a program pairs gate rows n and up rows N + n of the stacked experts and
    stores gelu_tanh(gate) * up, rounding as the two launches do: equal bit for bit to the
    [pairs, 2N] product then `gelu_tanh_mul`. N = 20 is not a multiple of BLOCK_N (masked).

    Every product here is exact in fp32 (x in steps of 2^-6 up to 1, weights on a grid of
    2^-10, or codes with a power-of-two scale: at most 21 significant bits), so no order of
    summation can change it: the interpreter's dot is numpy's BLAS, whose order depends on
    the CPU and on a column's place in its tile (an AVX2 machine rounded 8 of 3840 sums
    differently that way). The product's rounding to fp16 (11 bits), which the fused epilogue
    must repeat, is still exercised. On a GPU `gpu_grouped_geglu.py` compares random inputs."""
    torch.manual_seed(4)
    tokens, n, k = 24, 20, 128
    ids = _routing("ragged", tokens, 8)
    x = (torch.randint(-64, 65, (tokens, k)) / 64).to(dtype)
    plan = gm.plan_experts(ids, EXPERTS, block_m)
    if bits is None:
        weight = (torch.randint(-64, 65, (EXPERTS, 2 * n, k)) / 1024).to(dtype)
        launch = lambda **kw: gm.grouped_expert_matmul_triton(x, weight, ids, plan=plan, **kw)  # noqa: E731
        reference = gm.grouped_expert_matmul_reference(x, weight, ids, geglu=True)
        reference_product = gm.grouped_expert_matmul_reference(x, weight, ids)
    else:
        # w = (code - 2^(bits-1)) * 2^-(bits+1): |w| <= 1/4, exact in every dtype here.
        codes = torch.randint(0, 1 << bits, (EXPERTS, 2 * n, k), dtype=torch.uint8)
        scale = 2.0 ** -(bits + 1)
        groups = (EXPERTS, 2 * n, k // 32)
        scales = torch.full(groups, scale)
        biases = torch.full(groups, -(1 << (bits - 1)) * scale)
        packed = (pack_codes(codes, bits), scales, biases)
        args = (x, *packed, ids, bits, 32)
        launch = lambda **kw: gm.grouped_affine_expert_matmul_triton(*args, plan=plan, **kw)  # noqa: E731
        reference = gm.grouped_affine_expert_matmul_reference(*args, geglu=True)
        reference_product = gm.grouped_affine_expert_matmul_reference(*args)
    got = launch(config=config, geglu=True)
    apart = gelu_tanh_mul_triton(launch(config=config))
    assert got.shape == reference.shape == (tokens, 8, n)
    assert torch.equal(got, apart)
    # The reference (the dispatcher's path on CPU) is the product's reference, then the
    # GeGLU's: each is checked against the kernel apart (above; test_kernels_fused.py).
    assert torch.equal(reference, gelu_tanh_mul_reference(reference_product))


def test_geglu_output_takes_a_stacked_gate_up_and_no_row_scale() -> None:
    ids = _routing("ragged", 4, 2)
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="even"):
        gm.grouped_expert_matmul_triton(x, torch.randn(EXPERTS, 7, 32), ids, geglu=True)
    with pytest.raises(ValueError, match="row scale"):
        gm.grouped_expert_matmul_triton(
            x, torch.randn(EXPERTS, 8, 32), ids, torch.rand(4, 2), geglu=True
        )


def test_affine_rejects_widths_without_a_kernel() -> None:
    packed, scales, biases = quantize_affine(torch.randn(2, 8, 64), 3, 32)
    with pytest.raises(ValueError, match="bits"):
        gm.grouped_affine_expert_matmul_triton(
            torch.randn(2, 64), packed, scales, biases, torch.zeros(2, 1, dtype=torch.long), 3, 32
        )


# ---------------------------------------------------------------------------------------------
# The model's MoE block


def _experts(bits: int | None, hidden: int = 64, width: int = 32) -> Experts:
    config = SimpleNamespace(
        hidden_size=hidden, moe=SimpleNamespace(num_experts=EXPERTS, intermediate_size=width)
    )
    experts = Experts(config)  # type: ignore[arg-type]  # reads only these fields
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 0.2)
        experts.down_proj.normal_(0.0, 0.2)
    if bits is not None:
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name).detach()
            delattr(experts, name)  # a Parameter's name takes no module until freed
            setattr(
                experts, name, MLXQuantizedExperts(*quantize_affine(weight, bits, 32), bits, 32)
            )
    return experts


def _spy(launcher, name: str, launched: list[str]):
    def spy(*args, **kwargs):
        launched.append(name)
        return launcher(*args, **kwargs)

    return spy


@pytest.mark.parametrize("bits", [None, 4, 8])
def test_grouped_experts_equal_the_loop(bits, monkeypatch) -> None:
    """fp32 throughout, so only summation order differs: 1e-5 of the output's scale is ~100
    eps32, room for two chained projections' reordered sums (as for the gathered path). The
    slots' outputs (each scaled by its weight), summed here, give the same."""
    torch.manual_seed(3)
    experts = _experts(bits)
    ids = _routing("ragged", 9, 4)
    x, weights = torch.randn(9, 64), torch.rand(9, 4)
    launched: list[str] = []
    monkeypatch.setattr(gm, "kernel_enabled", lambda tensor: True)
    geglu = _spy(experts_layer.gelu_tanh_mul, "geglu", launched)
    monkeypatch.setattr(experts_layer, "gelu_tanh_mul", geglu)
    for name in ("grouped_expert_matmul_triton", "grouped_affine_expert_matmul_triton"):
        monkeypatch.setattr(gm, name, _spy(getattr(gm, name), name, launched))
    grouped = experts.forward_grouped(x, weights, ids)
    per_slot = experts.forward_grouped(x, weights, ids, summed=False)
    monkeypatch.undo()
    loop = experts.forward_loop(x, weights, ids)
    kind = "grouped_expert_matmul_triton" if bits is None else "grouped_affine_expert_matmul_triton"
    # Float experts' gate/up matmul stores the GeGLU itself; packed ones' a kernel applies it.
    one_pass = [kind] * 2 if bits is None else [kind, "geglu", kind]
    assert launched == one_pass * 2
    tolerance = {"rtol": 0, "atol": 1e-5 * loop.abs().max().item()}
    torch.testing.assert_close(grouped, loop, **tolerance)
    assert per_slot.shape == (9, 4, 64)
    torch.testing.assert_close(per_slot.sum(dim=1), loop, **tolerance)


@pytest.mark.parametrize("bits", [None, 4, 3])
def test_forward_takes_the_grouped_path_for_prefill_only(bits, monkeypatch) -> None:
    """On CUDA: grouped from GROUPED_EXPERTS_MIN_TOKENS tokens, gathered below; widths the
    kernels do not read (3 bits) keep the loop."""
    experts = _experts(bits)
    taken: list[str] = []
    monkeypatch.setattr(experts_layer, "kernel_enabled", lambda tensor: True)
    for path in ("forward_grouped", "forward_gathered", "forward_loop"):
        monkeypatch.setattr(experts, path, lambda *args, _path=path: taken.append(_path))
    for tokens in (1, GROUPED_EXPERTS_MIN_TOKENS - 1, GROUPED_EXPERTS_MIN_TOKENS):
        ids = _routing("ragged", tokens, 2)
        experts(torch.randn(tokens, 64), torch.rand(tokens, 2), ids)
    if bits == 3:
        assert taken == ["forward_loop"] * 3
    else:
        assert taken == ["forward_gathered", "forward_gathered", "forward_grouped"]
