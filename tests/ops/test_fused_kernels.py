"""The fused elementwise kernels (norms, GeGLU, norm + RoPE, static-cache append) against
their torch references and a hand-written fp64 oracle. On a CPU machine the Triton kernels
run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")
from hearth.kv.cache import EMPTY_POSITION
from hearth.ops.activation import gelu_tanh_mul_reference, gelu_tanh_mul_triton
from hearth.ops.kv_write import (
    append_token_reference,
    append_token_triton,
    paged_append_fits,
    paged_append_reference,
    paged_append_triton,
)
from hearth.ops.norm import (
    Partials,
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    moe_add_rms_norm_reference,
    moe_add_rms_norm_triton,
    moe_combine_add_rms_norm_reference,
    moe_combine_add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from hearth.ops.rope import (
    CacheWrite,
    ValueMode,
    norm_rope_reference,
    norm_rope_triton,
    rotary_tables_reference,
    rotary_tables_triton,
)
from hearth.ops.router import (
    route_reference,
    route_triton,
    router_input_reference,
    router_input_triton,
)
from hearth.ops.slot_sum import weighted_slot_sum_reference, weighted_slot_sum_triton

pytestmark = pytest.mark.usefixtures("on_kernel_device")
EPS = 1e-6


def ulps(dtype: torch.dtype) -> float:
    """Tolerance relative to the largest |value| of the row: two units in the last place
    (an ulp is at most 2^-7 of a bf16 value, 2^-10 of an fp16 one).

    Kernel and reference round the same fp32 values to `dtype`; they differ only by the
    fp32 reduction order, which can move an element across one rounding boundary (one ulp of
    that element), and a fused op downstream (the add, the next norm, RoPE's one rounding
    against eager's three) can carry that to one more ulp of the row's scale.
    fp32: 1e-5 covers reduction-order differences over rows of ≤ 3000 elements.
    """
    return {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-7, torch.float16: 2 * 2**-10}[dtype]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.abs().float().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    error = ((actual.float() - expected.float()).abs() / scale).max().item()
    assert error <= ulps(dtype), error


def oracle_rms_norm(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    x64 = x.double()
    y = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + EPS)
    return y * weight.double() if weight is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 200])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(dtype: torch.dtype, width: int, weighted: bool) -> None:
    x = torch.randn(3, 5, width).mul(4).to(dtype)
    weight = torch.rand(width) + 0.5 if weighted else None
    expected = rms_norm_reference(x, weight, EPS)
    close(rms_norm_triton(x, weight, EPS), expected, dtype)
    close(expected, oracle_rms_norm(x, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [2, 3])
def test_norms_add_a_gemv_s_split_partials(dtype: torch.dtype, splits: int) -> None:
    """Given a K-split GEMV's fp32 partials (`Partials`), the add-norm and the MoE add-norm
    kernels add them in split order and round to the activations' dtype first: the same bits
    as fed the added output (`Partials.total`, the GEMV's own sum). Off the kernel path the
    dispatcher takes the total. (fp16 stands in for bf16: the interpreter's bf16 truncates.)"""
    residual = torch.randn(1, 2, 96).to(dtype)
    partials = Partials(torch.randn(splits, 1, 2, 96) * 3, dtype)
    weight, next_weight, other = torch.rand(3, 96) + 0.5
    scalar = torch.tensor([0.75]).to(dtype)
    added = partials.total()
    for scale in (None, scalar):
        got = add_rms_norm_triton(residual, partials, weight, EPS, next_weight, True, scale)
        want = add_rms_norm_triton(residual, added, weight, EPS, next_weight, True, scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    router_scale = torch.rand(96) + 0.5
    args = (weight, EPS, next_weight, other, router_scale)
    got = moe_add_rms_norm_triton(residual, partials, *args)
    want = moe_add_rms_norm_triton(residual, added, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if not torch.cuda.is_available():  # the dispatcher off the kernel path
        got = add_rms_norm(residual, partials, weight, EPS, next_weight, True)
        want = add_rms_norm_reference(residual, added, weight, EPS, next_weight, True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("codes_major", [(8, 4), (4, 8)])
def test_add_norm_stores_its_norm_codes_major(codes_major: tuple[int, int]) -> None:
    """With `codes_major` the kernel stores the next norm in the order the 4-bit (8 codes a
    word) or 8-bit GEMV reads x (`affine_matmul.codes_major`): the same values as the plain
    norm, each moved, the residual output unchanged. The dispatcher off the kernel path
    reorders the reference's norm. Width 96: 3 blocks of 32 (the kernel's block of 128
    holds a fourth, masked)."""
    from hearth.ops.affine_matmul import WORD_BITS
    from hearth.ops.affine_matmul import codes_major as reorder

    residual, x = torch.randn(1, 2, 96), torch.randn(1, 2, 96).mul(3)
    weight, next_weight = torch.rand(2, 96) + 0.5
    codes, words = codes_major
    plain = add_rms_norm_triton(residual, x, weight, EPS, next_weight, True)
    got = add_rms_norm_triton(residual, x, weight, EPS, next_weight, True, None, codes_major)
    assert got[1] is not None and got[1].shape == (2, 96 // (codes * words), codes, words)
    assert torch.equal(got[0], plain[0])
    assert torch.equal(got[1], reorder(plain[1].view(2, 96), WORD_BITS // codes, words))
    if not torch.cuda.is_available():  # the dispatcher off the kernel path
        out, normed = add_rms_norm(residual, x, weight, EPS, next_weight, True, None, codes_major)
        want = add_rms_norm_reference(residual, x, weight, EPS, next_weight, True)
        assert torch.equal(out, want[0])
        assert torch.equal(normed, reorder(want[1].view(2, 96), WORD_BITS // codes, words))
    for unfit in ((8, 5), (8, 8)):  # blocks of 40 inputs; of 64, which 96 is no multiple of
        with pytest.raises(ValueError, match="codes-major"):
            add_rms_norm_triton(residual, x, weight, EPS, next_weight, True, None, unfit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize_next", [True, False])
def test_add_rms_norm(dtype: torch.dtype, normalize_next: bool) -> None:
    residual, x = torch.randn(2, 3, 96).to(dtype), torch.randn(2, 3, 96).mul(9).to(dtype)
    weight, next_weight = torch.rand(96) + 0.5, torch.rand(96) + 0.5
    summed, normed = add_rms_norm_triton(residual, x, weight, EPS, next_weight, normalize_next)
    ref_summed, ref_normed = add_rms_norm_reference(
        residual, x, weight, EPS, next_weight, normalize_next
    )
    close(summed, ref_summed, dtype)
    oracle = residual.double() + oracle_rms_norm(x, weight)
    close(ref_summed, oracle, dtype)
    if normalize_next:
        assert normed is not None and ref_normed is not None
        close(normed, ref_normed, dtype)
        close(ref_normed, oracle_rms_norm(ref_summed, next_weight), dtype)
    else:
        assert normed is None and ref_normed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul(dtype: torch.dtype) -> None:
    gate_up = torch.randn(2, 3, 2 * 1500).mul(3).to(dtype)  # 1500: two blocks, one partial
    expected = gelu_tanh_mul_reference(gate_up)
    close(gelu_tanh_mul_triton(gate_up), expected, dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    close(expected, 0.5 * gate * (1 + torch.tanh(inner)) * up, dtype)


def oracle_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE as complex rotation of pairs (i, i + D/2), in fp64."""
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double())
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat([rotated.real, rotated.imag], dim=-1)


@pytest.mark.parametrize("mode", list(ValueMode))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope(mode: ValueMode, dtype: torch.dtype) -> None:
    tokens, q_heads, kv_heads, dim = 3, 4, 2, 64
    kv_parts = {ValueMode.ABSENT: 0, ValueMode.UNIT_NORM_OF_K: 1}.get(mode, 2)
    qkv = torch.randn(tokens, (q_heads + kv_parts * kv_heads) * dim).mul(2).to(dtype)
    q_weight, k_weight = torch.rand(dim) + 0.5, torch.rand(dim) + 0.5
    angles = torch.arange(tokens).double()[:, None] * 0.3 ** torch.arange(dim // 2).double()
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    args = (q_heads, kv_heads, dim, q_weight, k_weight, cos, sin, EPS, mode)
    got, expected = norm_rope_triton(qkv, *args), norm_rope_reference(qkv, *args)
    for actual, reference in zip(got, expected, strict=True):
        assert (actual is None) == (reference is None)
        if reference is not None:
            assert actual is not None
            close(actual, reference, dtype)
    # Oracle: the query heads, normed and rotated in fp64 (cos/sin rounded as the model does).
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    normed = oracle_rms_norm(q, q_weight).to(dtype)
    exact_angles = torch.atan2(sin[:, : dim // 2].double(), cos[:, : dim // 2].double())
    radius = torch.hypot(sin[:, : dim // 2].double(), cos[:, : dim // 2].double())
    oracle = oracle_rope(normed, exact_angles) * torch.cat([radius, radius], -1)[:, None, :]
    close(expected[0], oracle, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_tables(dtype: torch.dtype) -> None:
    """cos/sin tables of a chunk's positions (Gemma 4's proportional inverse frequencies: the
    unrotated pairs' zeros give cos 1, sin 0). Oracle: the torch reference. The interpreter
    takes numpy's fp32 cos/sin, which may differ from torch's CPU ones by an fp32 ulp (on the
    GPU both are the same functions: benchmarks/lab/gpu_trig_bits.py), so fp32 tables are held to
    one ulp of |value| (+ 2^-24 near zero) and fp16 ones to an fp16 ulp (a rounding that may
    land either side)."""
    positions = torch.tensor([0, 1, 7, 1000, 4095, 131071])
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, 64, 2).float() / 64)
    inv_freq[24:] = 0.0
    want = rotary_tables_reference(positions, inv_freq, dtype)
    got = rotary_tables_triton(positions, inv_freq, dtype)
    ulp = torch.finfo(dtype).eps
    for table, expected in zip(got, want, strict=True):
        assert table.shape == expected.shape == (6, 1, 64) and table.dtype == dtype
        bound = ulp * expected.float().abs() + 2.0**-24
        assert ((table.float() - expected.float()).abs() <= bound).all()
    assert torch.equal(got[0][..., 24:32], torch.ones(6, 1, 8, dtype=dtype))
    assert torch.equal(got[1][..., 24:32], torch.zeros(6, 1, 8, dtype=dtype))


@pytest.mark.parametrize("capacity, position", [(8, 3), (8, 13)])  # in order; wrapped ring
def test_append_token(capacity: int, position: int) -> None:
    heads, dim = 2, 32
    buffers = [torch.randn(1, heads, capacity, dim) for _ in range(2)]
    positions = torch.full((capacity,), EMPTY_POSITION)
    keys, values = torch.randn(1, heads, 1, dim), torch.randn(1, heads, 1, dim)
    where = torch.tensor([position])
    states = []
    for append in (append_token_triton, append_token_reference):
        counter = torch.zeros((), dtype=torch.long)
        state = [b.clone() for b in buffers] + [positions.clone(), counter]
        append(where, keys, values, *state)
        states.append(state)
    for got, expected in zip(*states, strict=True):
        assert torch.equal(got, expected)
    slot = position % capacity
    key_buffer, value_buffer, stored_positions, next_position = states[1]
    assert torch.equal(key_buffer[:, :, slot], keys[:, :, 0])
    assert torch.equal(value_buffer[:, :, slot], values[:, :, 0])
    assert stored_positions[slot] == position and int(next_position) == position + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_append_writes_each_row_into_its_block_and_slot(dtype: torch.dtype) -> None:
    """B tokens (K/V [1, Hk, B, D] as a projection's transpose lays them out, not contiguous)
    land at their (block, slot) of the pool's planes, bit for bit the indexed writes', and
    nothing else changes (a copy: no arithmetic, so no tolerance)."""
    heads, dim, rows, num_blocks, block_size = 2, 32, 5, 6, 4
    planes = [torch.randn(num_blocks, heads, block_size, dim).to(dtype) for _ in range(2)]
    keys, values = (torch.randn(1, rows, heads, dim).to(dtype).transpose(1, 2) for _ in range(2))
    assert not keys.is_contiguous() and paged_append_fits(keys, values, *planes)
    blocks = torch.tensor([3, 0, 5, 3, 1])
    slots = torch.tensor([1, 3, 0, 2, 0])
    results = []
    for append in (paged_append_triton, paged_append_reference):
        state = [plane.clone() for plane in planes]
        append(keys, values, *state, blocks, slots)
        results.append(state)
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)
    key_plane = results[0][0]
    for row in range(rows):
        assert torch.equal(key_plane[blocks[row], :, slots[row]], keys[0, :, row])
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    written[blocks, slots] = True
    untouched = ~written  # [block, slot]: the planes' dims 0 and 2
    assert torch.equal(key_plane.transpose(1, 2)[untouched], planes[0].transpose(1, 2)[untouched])
    assert not paged_append_fits(keys.float(), values.float(), *[p.half() for p in planes])


@pytest.mark.parametrize("mode", [ValueMode.RAW, ValueMode.UNIT_NORM_OF_K])
def test_norm_rope_writes_into_a_static_cache(mode: ValueMode) -> None:
    """One decode token: K/V go straight into slot position % capacity of the buffers."""
    q_heads, kv_heads, dim, capacity, position = 4, 2, 64, 8, 13
    kv_parts = 1 if mode == ValueMode.UNIT_NORM_OF_K else 2
    qkv = torch.randn(1, (q_heads + kv_parts * kv_heads) * dim, dtype=torch.bfloat16)
    weights = torch.rand(dim) + 0.5, torch.rand(dim) + 0.5
    angles = torch.rand(1, dim) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    args = (q_heads, kv_heads, dim, *weights, cos, sin, EPS, mode)
    plain_q, plain_k, plain_v = norm_rope_reference(qkv, *args)
    assert plain_k is not None and plain_v is not None
    results = []
    for run in (norm_rope_triton, norm_rope_reference):
        buffers = [torch.zeros(1, kv_heads, capacity, dim, dtype=torch.bfloat16) for _ in "kv"]
        slots = torch.full((capacity,), EMPTY_POSITION)
        counter = torch.zeros((), dtype=torch.long)
        write = CacheWrite(torch.tensor([position]), *buffers, slots, counter)
        q, k, v = run(qkv, *args, write)
        assert k is None and v is None
        close(q, plain_q, torch.bfloat16)
        slot = position % capacity
        close(buffers[0][0, :, slot], plain_k[0], torch.bfloat16)
        close(buffers[1][0, :, slot], plain_v[0], torch.bfloat16)
        assert int(slots[slot]) == position and int(counter) == position + 1
        results.append(buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_of_two_tensors(dtype: torch.dtype) -> None:
    """Gate and up apart (Gemma 4's per-layer input gate), up a strided view."""
    gate = torch.randn(1, 3, 256).mul(3).to(dtype)
    up = torch.randn(1, 3, 5, 256).to(dtype)[:, :, 2]  # one layer's slice of a stacked table
    expected = gelu_tanh_mul_reference(gate, up)
    close(gelu_tanh_mul_triton(gate, up), expected, dtype)
    close(expected, gelu_tanh_mul_reference(torch.cat([gate, up], dim=-1)), dtype)
    with pytest.raises(ValueError, match="differ"):
        gelu_tanh_mul_triton(gate, up[..., :128])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_with_layer_scalar(dtype: torch.dtype) -> None:
    """(residual + norm(x)·w)·s, rounded after the add and after the multiply, then the next
    norm of that: the end of a Gemma 4 layer and the next layer's input norm in one kernel."""
    residual, x = torch.randn(2, 3, 96).to(dtype), torch.randn(2, 3, 96).mul(9).to(dtype)
    weight, next_weight = torch.rand(96) + 0.5, torch.rand(96) + 0.5
    scalar = torch.tensor([0.37]).to(dtype)
    summed, normed = add_rms_norm_triton(residual, x, weight, EPS, next_weight, True, scalar)
    ref_summed, ref_normed = add_rms_norm_reference(
        residual, x, weight, EPS, next_weight, True, scalar
    )
    close(summed, ref_summed, dtype)
    close(normed, ref_normed, dtype)
    oracle = (residual.double() + oracle_rms_norm(x, weight)) * 0.37
    close(ref_summed, oracle, dtype)
    with pytest.raises(ValueError, match="one"):
        add_rms_norm_triton(residual, x, weight, EPS, scale=torch.ones(2, dtype=dtype))


# fp16 stands in for bf16 where an output is rounded three times: Triton's interpreter casts
# fp32 to bf16 by truncation (the GPU rounds), up to an ulp per cast; on the H200,
# benchmarks/lab/ab_decode.py --check finds 26B-A4B's bf16 logits bit-identical with and without
# the fused MoE norms.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_add_rms_norm(dtype: torch.dtype) -> None:
    """h = residual + norm(x)·w, then from one RMS of h the dense MLP's input norm(h)·w_a, the
    experts' norm(h)·w_b and the router's round(round(round(norm(h))·s)·N^-1/2); width 200
    (not a power of two: masked lanes)."""
    width = 200
    residual, x = torch.randn(2, 3, width).to(dtype), torch.randn(2, 3, width).mul(9).to(dtype)
    weight, dense_w, experts_w = (torch.rand(width) + 0.5 for _ in range(3))
    router_scale = (torch.rand(width) + 0.5).to(dtype)
    args = (residual, x, weight, EPS, dense_w, experts_w, router_scale)
    got, want = moe_add_rms_norm_triton(*args), moe_add_rms_norm_reference(*args)
    for name in ("residual", "dense", "experts", "router"):
        close(getattr(got, name), getattr(want, name), dtype)
    h = residual.double() + oracle_rms_norm(x, weight)
    close(want.residual, h, dtype)
    close(want.dense, oracle_rms_norm(want.residual, dense_w), dtype)
    close(want.experts, oracle_rms_norm(want.residual, experts_w), dtype)
    router = oracle_rms_norm(want.residual, None) * router_scale.double() / math.sqrt(width)
    close(want.router, router, dtype)
    with pytest.raises(ValueError, match="does not match"):
        moe_add_rms_norm_triton(residual, x, weight, EPS, dense_w, experts_w, router_scale[:9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_combine_add_rms_norm(dtype: torch.dtype) -> None:
    """The end of a MoE layer: ff = norm(dense)·w1 + norm(experts)·w2, h = (residual +
    norm(ff)·w)·s, and the next layer's input norm of h, in one kernel."""
    width = 200
    residual = torch.randn(2, 3, width).to(dtype)
    dense, experts = (torch.randn(2, 3, width).mul(7).to(dtype) for _ in range(2))
    dense_w, experts_w, weight, next_w = (torch.rand(width) + 0.5 for _ in range(4))
    scalar = torch.tensor([0.37]).to(dtype)
    args = (residual, dense, experts, dense_w, experts_w, weight, EPS, next_w, scalar)
    (summed, normed), (want_summed, want_normed) = (
        moe_combine_add_rms_norm_triton(*args),
        moe_combine_add_rms_norm_reference(*args),
    )
    close(summed, want_summed, dtype)
    close(normed, want_normed, dtype)
    ff = oracle_rms_norm(dense, dense_w) + oracle_rms_norm(experts, experts_w)
    close(want_summed, (residual.double() + oracle_rms_norm(ff, weight)) * 0.37, dtype)
    close(want_normed, oracle_rms_norm(want_summed, next_w), dtype)
    with pytest.raises(ValueError, match="does not match"):
        moe_combine_add_rms_norm_triton(residual, dense[..., :9], *args[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_combine_reads_the_weighted_expert_slots(dtype: torch.dtype) -> None:
    """The combine with the experts' per-slot outputs and router weights in place of their
    sum: bit for bit `weighted_slot_sum` then the combine (the same roundings in the same
    order), and the reference likewise."""
    width, slots = 200, 8
    residual = torch.randn(3, width).to(dtype)
    dense = torch.randn(3, width).mul(7).to(dtype)
    per_slot = torch.randn(3, slots, width).mul(3).to(dtype)
    slot_weights = torch.rand(3, slots)
    dense_w, experts_w, weight, next_w = (torch.rand(width) + 0.5 for _ in range(4))
    scalar = torch.tensor([0.37]).to(dtype)

    def combine(function, experts, **kwargs):
        args = (residual, dense, experts, dense_w, experts_w, weight, EPS, next_w, scalar)
        return function(*args, **kwargs)

    summed = weighted_slot_sum_triton(per_slot, slot_weights)
    fused = combine(moe_combine_add_rms_norm_triton, per_slot, slot_weights=slot_weights)
    for got, want in zip(fused, combine(moe_combine_add_rms_norm_triton, summed), strict=True):
        assert torch.equal(got, want)
    reference = combine(moe_combine_add_rms_norm_reference, per_slot, slot_weights=slot_weights)
    want_reference = combine(
        moe_combine_add_rms_norm_reference, weighted_slot_sum_reference(per_slot, slot_weights)
    )
    for got, want in zip(reference, want_reference, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(fused, reference, strict=True):
        close(got, want, dtype)
    with pytest.raises(ValueError, match="slot weights"):
        combine(moe_combine_add_rms_norm_triton, per_slot, slot_weights=slot_weights[:, :4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_slot_sum(dtype: torch.dtype) -> None:
    y = torch.randn(3, 8, 1500).to(dtype)  # 1500: two blocks, one partial
    weights = torch.rand(3, 8)
    expected = weighted_slot_sum_reference(y, weights)
    close(weighted_slot_sum_triton(y, weights), expected, dtype)
    oracle = (y.double() * weights.double()[..., None]).sum(dim=1)
    close(expected, oracle, dtype)
    with pytest.raises(ValueError, match="do not match"):
        weighted_slot_sum_triton(y, weights[:, :4])


def test_route_matches_softmax_topk() -> None:
    """Softmax, top-8 of 128, renormalise, per-expert scale: the experts in torch.topk's
    order and the weights to fp32 rounding (the sums run in another order)."""
    logits = torch.randn(5, 128).mul(3).to(torch.bfloat16)
    scale = torch.rand(128).add(0.5).to(torch.bfloat16)
    weights, experts = route_triton(logits, 8, scale)
    want_weights, want_experts = route_reference(logits, 8, scale)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
    # Hand-derived: the renormalised weights sum to 1 before the per-expert scale.
    torch.testing.assert_close((weights / scale[experts].float()).sum(-1), torch.ones(5))
    with pytest.raises(ValueError, match="top_k"):
        route_triton(logits, 200, scale)


def test_route_breaks_ties_by_the_lower_expert_id() -> None:
    """Equal probabilities go out lowest id first (a hand-built row), and a count of experts
    that is not a power of two leaves the padded lanes unchosen: 100 experts, the top 3 at
    ids 97, 40 and 41 (the last two tied), weights renormalised by hand."""
    logits = torch.full((1, 100), -4.0)
    logits[0, 97], logits[0, 40], logits[0, 41] = 3.0, 2.0, 2.0
    scale = torch.ones(100)
    weights, experts = route_triton(logits, 3, scale)
    assert experts.tolist() == [[97, 40, 41]]
    e3, e2 = math.exp(3.0), math.exp(2.0)
    expected = torch.tensor([[e3, e2, e2]]) / (e3 + 2 * e2)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_input(dtype: torch.dtype) -> None:
    """The router's input: weightless norm, · scale, · hidden^-1/2, each step rounded."""
    x = torch.randn(3, 2816).mul(5).to(dtype)
    scale = (torch.rand(2816) + 0.5).to(dtype)
    expected = router_input_reference(x, scale, EPS)
    close(router_input_triton(x, scale, EPS), expected, dtype)
    close(expected, oracle_rms_norm(x, None) * scale.double() / math.sqrt(2816), dtype)
    with pytest.raises(ValueError, match="does not match"):
        router_input_triton(x, scale[:100], EPS)


def test_pdl_launches_only_small_cuda_kernels_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    # The interpreter never sees `launch_pdl` (CPU tensors); on a GPU a decode-sized launch
    # takes it where the device has PDL (sm_90+), a long prefill's does not. A stand-in
    # object plays the CUDA tensor (is_cuda, device, numel).
    import hearth.ops as kernels

    assert kernels.pdl_options(torch.zeros(1, 3840, device="cpu")) == {"PDL": False}

    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)

        def __init__(self, numel: int) -> None:
            self._numel = numel

        def numel(self) -> int:
            return self._numel

    monkeypatch.setattr(kernels, "_device_has_pdl", lambda index: True)
    monkeypatch.setattr(kernels, "HAS_TRITON", True)
    on = {"PDL": True, "launch_pdl": True}
    assert kernels.pdl_options(FakeCuda(3840)) == on  # type: ignore[arg-type]
    assert kernels.pdl_options(FakeCuda(4096 * 3840)) == {"PDL": False}  # type: ignore[arg-type]
    monkeypatch.setattr(kernels, "_device_has_pdl", lambda index: False)  # e.g. an A100
    assert kernels.pdl_options(FakeCuda(3840)) == {"PDL": False}  # type: ignore[arg-type]
