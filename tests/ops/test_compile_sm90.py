"""Every Triton kernel the model launches compiles for the H200 (sm_90), checked on CPU.

CI has no GPU: the kernel tests run in Triton's interpreter, which accepts code the real
compiler rejects (e.g. a kernel reading a plain Python global). Here each kernel is launched
once in the interpreter at model-like shapes, its launch arguments are recorded, and the
same function is compiled by Triton's real pipeline down to a Hopper cubin (ptxas ships with
Triton; no driver is needed). Kernels with a PDL switch are compiled as the H200 launches
them, with programmatic dependent launch on, and their PTX must hold the wait for the
previous kernel. It takes minutes, so it runs only when asked: `pytest -m sm90`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

import hearth  # noqa: E402
from hearth.kv.cache import EMPTY_POSITION  # noqa: E402
from hearth.ops import (  # noqa: E402
    activation,
    affine_matmul,
    decode_attention,
    expert_plan,
    gemv,
    gguf_matmul,
    grouped_matmul,
    kv_quantize,
    kv_write,
    norm,
    rope,
    router,
    slot_sum,
)
from hearth.quant.gguf_blocks import (  # noqa: E402
    BLOCK_FORMATS,
    PLANAR_TYPES,
    planar_layout,
    to_planar,
)
from hearth.quant.kv_codecs import AffineCodec  # noqa: E402
from hearth.quant.mlx import quantize_affine  # noqa: E402
from hearth.quant.turbo import TurboCodec  # noqa: E402

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

pytestmark = [
    pytest.mark.sm90,
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="records launches through the CPU interpreter"
    ),
]


def _recorded_launches(run: Callable[[], object]) -> list[tuple[InterpretedFunction, dict]]:
    """(kernel, arguments by name) of every Triton launch `run` makes in the interpreter."""
    launches: list[tuple[InterpretedFunction, dict]] = []
    original = InterpretedFunction.run

    def recording(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kw: Any):
        names = list(inspect.signature(self.fn).parameters)
        launches.append((self, {**dict(zip(names, args, strict=False)), **kw}))
        return original(self, *args, grid=grid, warmup=warmup, **kw)

    InterpretedFunction.run = recording  # type: ignore[method-assign]
    try:
        run()
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]
    return launches


def _spec(kernel: InterpretedFunction, arguments: dict) -> dict:
    """What the compiler needs, as JSON: where the kernel lives, its signature, constants."""
    params = inspect.signature(kernel.fn).parameters
    constexpr = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
    signature, constants = {}, {}
    for name, param in params.items():
        value = arguments.get(name, param.default)  # a constexpr left at its default
        if name in constexpr:
            signature[name], constants[name] = "constexpr", value
        else:
            signature[name] = mangle_type(value)
    options = {key: arguments[key] for key in LAUNCH_OPTIONS if key in arguments}
    if "DOT_FP32" in constants:  # the interpreter's dot runs in fp32; the GPU's in x's dtype
        constants["DOT_FP32"] = signature["x_ptr"] == "*fp32"
    if "PDL" in constants:  # compiled as Hopper launches it: with programmatic dependent launch
        constants["PDL"] = options["launch_pdl"] = True
        # and with the L2 prefetch of weight lines before the wait, whatever its defaults
        if "PREFETCH_LINES" in constants:
            constants["PREFETCH_LINES"] = 16
    return {
        "module": kernel.fn.__module__,
        "name": kernel.fn.__name__,
        "signature": signature,
        "constants": constants,
        "options": options,
    }


# Runs in a fresh interpreter without TRITON_INTERPRET, which replaces tl's builtins.
COMPILER = """
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

failures = []
for spec in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    while not isinstance(kernel, JITFunction):  # autotuner / heuristics wrappers
        kernel = kernel.fn
    source = ASTSource(kernel, spec["signature"], spec["constants"])
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
        assert compiled.asm["cubin"]
        ptx = compiled.asm["ptx"]
        if spec["constants"].get("PDL"):  # waits for the previous kernel before anything else
            assert "griddepcontrol.wait" in ptx, "no PDL wait in the PTX"
        constants = spec["constants"]
        if constants.get("PREFETCH_LINES"):  # hints first
            hint = ptx.find("prefetch.global.L2")
            assert 0 <= hint < ptx.index("griddepcontrol.wait"), "no L2 prefetch before the wait"
    except Exception as error:
        failures.append(f"{spec['name']}: {type(error).__name__}: {str(error)[-600:]}")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def _launches() -> Iterator[tuple[str, Callable[[], object]]]:
    bf16 = torch.bfloat16
    x = torch.randn(1, 256, dtype=bf16)
    weight = torch.rand(256) + 0.5
    yield "rms_norm", lambda: norm.add_rms_norm_triton(x, x, weight, 1e-6, weight, True)
    scalar = torch.ones(1, dtype=bf16)
    yield (
        "rms_norm layer scalar",
        lambda: norm.add_rms_norm_triton(x, x, weight, 1e-6, weight, True, scalar),
    )
    router_scale = torch.ones(256, dtype=bf16)
    yield (
        "moe_add_rms_norm",
        lambda: norm.moe_add_rms_norm_triton(x, x, weight, 1e-6, weight, weight, router_scale),
    )
    partials = norm.Partials(torch.randn(2, *x.shape), bf16)
    yield (
        "add_rms_norm adding a GEMV's split partials",
        lambda: norm.add_rms_norm_triton(x, partials, weight, 1e-6, weight, True),
    )
    yield (
        "moe_add_rms_norm adding a GEMV's split partials",
        lambda: norm.moe_add_rms_norm_triton(
            x, partials, weight, 1e-6, weight, weight, router_scale
        ),
    )
    yield (
        "moe_combine_add_rms_norm",
        lambda: norm.moe_combine_add_rms_norm_triton(
            x, x, x, weight, weight, weight, 1e-6, weight, scalar
        ),
    )
    yield (
        "moe_combine_add_rms_norm of weighted slots",
        lambda: norm.moe_combine_add_rms_norm_triton(
            x,
            x,
            torch.randn(1, 8, 256, dtype=bf16),
            weight,
            weight,
            weight,
            1e-6,
            weight,
            scalar,
            torch.rand(1, 8),
        ),
    )
    yield "gelu_tanh_mul", lambda: activation.gelu_tanh_mul_triton(torch.randn(1, 512, dtype=bf16))
    yield (
        "gelu_tanh_mul of two",
        lambda: activation.gelu_tanh_mul_triton(x, torch.randn(1, 4, 256, dtype=bf16)[:, 1]),
    )
    yield (
        "router input",
        lambda: router.router_input_triton(x, torch.ones(256, dtype=bf16), 1e-6),
    )
    yield (
        "route",
        lambda: router.route_triton(
            torch.randn(2, 128, dtype=bf16), 8, torch.ones(128, dtype=bf16)
        ),
    )
    yield (
        "weighted slot sum",
        lambda: slot_sum.weighted_slot_sum_triton(
            torch.randn(2, 8, 256, dtype=bf16), torch.rand(2, 8)
        ),
    )
    for geglu in (False, True):
        yield (
            f"gemv geglu={geglu}",
            lambda g=geglu: gemv.gemv_triton(
                torch.randn(1, 512 if g else 256, dtype=bf16),
                torch.randn(48, 256, dtype=bf16),
                g,
                {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2},
            ),
        )
    yield (
        "gemv with a pipelined K loop",
        lambda: gemv.gemv_triton(
            torch.randn(1, 1024, dtype=bf16),
            torch.randn(48, 1024, dtype=bf16),
            False,
            {"BLOCK_N": 8, "BLOCK_K": 128, "SPLIT_K": 2, "LOOP_STAGES": 3},
        ),
    )
    yield (
        "gemv geglu of a separate up",
        lambda: gemv.gemv_triton(
            x,
            torch.randn(48, 256, dtype=bf16),
            True,
            {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2},
            up=torch.randn(1, 4, 256, dtype=bf16)[:, 1],
        ),
    )
    yield (
        "gemv of an add-norm input (E4B's per-layer input gate launch)",
        lambda: gemv.gemv_triton(
            torch.randn(1, 2560, dtype=bf16),
            torch.randn(256, 2560, dtype=bf16),
            config={"BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": 1, "LOOP_STAGES": 4},
            add_norm=gemv.AddNorm(
                torch.randn(1, 2560, dtype=bf16), torch.rand(2560), 1e-6, torch.empty(1, 2560)
            ),
        ),
    )
    qkv = torch.randn(1, (4 + 2 * 2) * 64, dtype=bf16)
    cos = sin = torch.ones(1, 64, dtype=bf16)
    for mode in rope.ValueMode:
        yield (
            f"norm_rope {mode.name}",
            lambda mode=mode: rope.norm_rope_triton(
                qkv, 4, 2, 64, weight[:64], weight[:64], cos, sin, 1e-6, mode
            ),
        )
    yield (
        "rotary tables",
        lambda: rope.rotary_tables_triton(torch.arange(3) + 5, torch.rand(128), bf16),
    )
    buffers = [torch.zeros(1, 2, 16, 64, dtype=bf16) for _ in range(2)]
    positions = torch.full((16,), EMPTY_POSITION)
    counter = torch.zeros((), dtype=torch.long)
    k = torch.randn(1, 2, 1, 64, dtype=bf16)
    yield (
        "append_token",
        lambda: kv_write.append_token_triton(torch.tensor([3]), k, k, *buffers, positions, counter),
    )
    pool = [torch.zeros(6, 2, 16, 256, dtype=bf16) for _ in range(2)]
    rows = torch.randn(1, 4, 2, 256, dtype=bf16).transpose(1, 2)
    yield (
        "paged_append",
        lambda: kv_write.paged_append_triton(
            rows, rows, *pool, torch.tensor([0, 3, 5, 1]), torch.tensor([2, 0, 15, 7])
        ),
    )
    for bits in affine_matmul.KERNEL_BITS:
        packed, scales, biases = quantize_affine(torch.randn(48, 256, dtype=bf16), bits, 64)
        yield (
            f"affine gemv b{bits}",
            lambda p=(packed, scales, biases), b=bits: affine_matmul.affine_matmul_triton(
                x, *p, b, 64
            ),
        )
        yield (
            f"embedding rows b{bits} (the dequantize kernel gathering rows)",
            lambda p=(packed, scales, biases), b=bits: affine_matmul.affine_dequantize_triton(
                *p, b, 64, bf16, torch.tensor([[5]])
            ),
        )
    # The GEMV at each launch its heuristic picks for Gemma 3 12B's shapes, the tied head,
    # 26B-A4B's q/k/v and small weights (splits 4 and 8), at M = 1 and 4, and at groups 32 /
    # 128 (other steps). Small tensors stand in: what compiles differently is the launch, not
    # the shape.
    for bits in affine_matmul.KERNEL_BITS:
        for group in (64, 32, 128):
            shapes = GEMV_SHAPES if group == 64 else GEMV_SHAPES[:1]
            configs = {affine_matmul.gemv_config(n, k, bits, group) for n, k in shapes}
            if group == 64:  # and the prefetching loop at each of those launches
                configs |= {dataclasses.replace(c, prefetch=True) for c in configs}
            operands = quantize_affine(torch.randn(48, 256, dtype=bf16), bits, group)
            for config in sorted(configs, key=str):
                for rows in (1, 4) if group == 64 else (1,):
                    yield (
                        f"affine gemv b{bits} g{group} M={rows} {config}",
                        lambda p=operands, b=bits, g=group, c=config, m=rows: (
                            affine_matmul.affine_gemv_triton(
                                torch.randn(m, 256, dtype=bf16), *p, b, g, c
                            )
                        ),
                    )
    yield (
        "codes_major reorder",
        lambda: affine_matmul.codes_major_triton(torch.randn(1, 512, dtype=bf16), 4),
    )
    # The 4-bit MLP of a decode step: gate/up reads its norm's codes-major store and stores
    # the GeGLU.
    many_rows = affine_matmul.GemvConfig(64, 4, prefetch=True, codes_major_x=True)
    gate_up = quantize_affine(torch.randn(96, 256, dtype=bf16), 4, 64)
    stored = affine_matmul.CodesMajor(
        affine_matmul.codes_major(torch.randn(1, 256, dtype=bf16), 4), torch.Size((1, 256))
    )
    yield (
        f"affine gemv {many_rows} of a codes-major x, storing the GeGLU",
        lambda: affine_matmul.affine_gemv_geglu_out_triton(stored, *gate_up, 4, 64, many_rows),
    )
    yield (
        "add_rms_norm storing its norm codes-major",
        lambda: norm.add_rms_norm_triton(x, x, weight, 1e-6, weight, True, None, (8, 32)),
    )
    packed, scales, biases = quantize_affine(torch.randn(4, 48, 256, dtype=bf16), 4, 64)
    yield (
        "affine gemv tile M=8",
        lambda: affine_matmul.affine_gemv_triton(
            torch.randn(8, 256, dtype=bf16), packed[0], scales[0], biases[0], 4, 64
        ),
    )
    # The tensor-core kernel at each launch its heuristic picks for 12B's shapes at 8, 32 and
    # 64 rows (tiles of 16, 32 and 64; K splits), and at groups 32 / 128 (other unpackings).
    for bits in affine_matmul.KERNEL_BITS:
        for group in (64, 32, 128):
            shapes = GEMV_SHAPES[:4] if group == 64 else GEMV_SHAPES[:1]
            configs = {
                affine_matmul.mma_config(m, n, k, bits, group)
                for m in ((8, 32, 64) if group == 64 else (8,))
                for n, k in shapes
            }
            operands = quantize_affine(torch.randn(48, 512, dtype=bf16), bits, group)
            for config in sorted(configs, key=str):
                yield (
                    f"affine mma b{bits} g{group} {config}",
                    lambda p=operands, b=bits, g=group, c=config: affine_matmul.affine_mma_triton(
                        torch.randn(c.block_m, 512, dtype=bf16), *p, b, g, c
                    ),
                )
    ids = torch.tensor([[0, 3]])
    yield (
        "affine experts",
        lambda: affine_matmul.affine_expert_matmul_triton(x, packed, scales, biases, ids, 4, 64),
    )
    yield (
        "affine experts storing a geglu",
        lambda: affine_matmul.affine_expert_matmul_triton(
            x, packed, scales, biases, ids, 4, 64, geglu_out=True
        ),
    )
    yield (
        "float experts",
        lambda: affine_matmul.float_expert_matmul_triton(
            x, torch.randn(4, 48, 256, dtype=bf16), ids
        ),
    )
    yield (
        "affine experts, split",
        lambda: affine_matmul.affine_expert_matmul_triton(
            x,
            packed,
            scales,
            biases,
            ids,
            4,
            64,
            config={"BLOCK_N": 16, "BLOCK_KW": 16, "SPLIT_K": 2},
        ),
    )
    yield (
        "float experts with a geglu output",
        lambda: affine_matmul.float_expert_matmul_triton(
            x, torch.randn(4, 48, 256, dtype=bf16), ids, geglu_out=True
        ),
    )
    expert_ids = torch.tensor([[0, 3], [1, 3], [3, 2]])
    yield (
        "grouped experts",
        lambda: grouped_matmul.grouped_expert_matmul_triton(
            torch.randn(3, 256, dtype=bf16), torch.randn(4, 48, 256, dtype=bf16), expert_ids
        ),
    )
    yield (
        "grouped affine experts",
        lambda: grouped_matmul.grouped_affine_expert_matmul_triton(
            torch.randn(3, 256, dtype=bf16), packed, scales, biases, expert_ids, 4, 64
        ),
    )
    # Storing the GeGLU: two accumulators, at the tallest tile's widest GeGLU launch.
    tall_plan = grouped_matmul.plan_experts(expert_ids, 4, grouped_matmul.TALL_BLOCK_M)
    tall = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}

    def float_geglu() -> None:
        grouped_matmul.grouped_expert_matmul_triton(
            torch.randn(3, 256, dtype=bf16),
            torch.randn(4, 48, 256, dtype=bf16),
            expert_ids,
            plan=tall_plan,
            config=tall,
            geglu=True,
        )

    yield "grouped experts with a geglu output", float_geglu

    def packed_tall(geglu: bool = False) -> None:
        grouped_matmul.grouped_affine_expert_matmul_triton(
            torch.randn(3, 256, dtype=bf16),
            packed,
            scales,
            biases,
            expert_ids,
            4,
            64,
            plan=tall_plan,
            config=tall,
            geglu=geglu,
        )

    yield "grouped affine experts with a geglu output", lambda: packed_tall(geglu=True)

    # The plan's counting sort at 26B-A4B's 128 experts and top 8, over several chunks.
    yield (
        "expert plan",
        lambda: expert_plan.sort_pairs_triton(torch.randint(0, 128, (320 * 8,)), 128, 64, 168),
    )
    yield (
        "affine prefill",
        lambda: affine_matmul.affine_matmul_triton(
            torch.randn(40, 256, dtype=bf16), packed[0], scales[0], biases[0], 4, 64
        ),
    )
    for bits in kv_quantize.KERNEL_BITS:
        codec = AffineCodec(bits, 64)
        sample = torch.zeros(1, 2, 1, 64, dtype=bf16)
        kv_planes = [
            p.new_zeros((*p.shape[:2], 16, *p.shape[3:])) for p in codec.encode(sample, sample)
        ]
        yield (
            f"kv quantize b{bits}",
            lambda b=bits, planes=kv_planes: kv_quantize.quantize_append_triton(
                torch.tensor([3]), k, k, planes, positions, counter, b, 64
            ),
        )
    keys16 = torch.randn(1, 2, 1, 64, dtype=bf16)
    for scheme in ("k8v3", "t4v3", "k4v2"):
        codec = TurboCodec.parse(scheme)
        turbo_planes = [
            p.new_zeros((*p.shape[:2], 16, *p.shape[3:])) for p in codec.encode(keys16, keys16)
        ]
        yield (
            f"turbo append {scheme}",
            lambda c=codec, planes=turbo_planes: kv_quantize.turbo_append_triton(
                torch.tensor([3]), keys16, keys16, planes, positions, counter, c
            ),
        )

    # Decode attention over every plane format the caches store, at the default launches:
    # 256 slots give several splits, merged by a launch of their own; D=256 (Gemma 3 12B) takes the
    # dense 8 warps x 3 stages without block skipping, and affine 64-slot blocks.
    def attention(
        heads: int,
        kv_heads: int,
        dim: int,
        slots: int,
        codec: Any,
        window: int | None = None,
        config: decode_attention.LaunchConfig | None = None,
    ) -> Callable[[], object]:
        q = torch.randn(1, heads, dim, dtype=bf16)
        keys = torch.randn(1, kv_heads, slots, dim, dtype=bf16)
        planes = (keys, keys) if codec is None else codec.encode(keys, keys)
        key_format, value_format, count = decode_attention.formats_of(codec or _Dense())
        return lambda: decode_attention.decode_attention(
            q, planes[:count], planes[count:], key_format, value_format,
            torch.arange(slots), torch.tensor(slots - 1), window, dim**-0.5,
            config or decode_attention.LaunchConfig(),
        )  # fmt: skip

    codecs: list[Any] = [
        None, AffineCodec(4, 64), TurboCodec.parse("k8v3"), TurboCodec.parse("t4v3")
    ]  # fmt: skip
    for codec in codecs:
        name = "dense" if codec is None else codec.signature()
        yield f"decode_attention {name}", attention(4, 2, 64, 256, codec)
    for codec in (None, AffineCodec(4, 64)):
        name = "dense" if codec is None else codec.signature()
        yield f"decode_attention {name} D=256 window", attention(4, 2, 256, 256, codec, 128)
    launch = decode_attention.LaunchConfig
    yield "decode_attention one split", attention(4, 2, 64, 256, None, config=launch(splits=1))
    yield from _gguf_launches()


def _gguf_launches() -> Iterator[tuple[str, Callable[[], object]]]:
    """The GGUF block kernels of every type: the GEMV at 1, 2 and 4 rows as the GPU launches
    it (and split over K, software-pipelined), the fused dot kernel at 16 and 32 rows (fp32
    too), the dequantize kernel to bf16 (prefill) and gathering rows (token tables)."""
    bf16 = torch.bfloat16
    for type_id in gguf_matmul.KERNEL_TYPES:
        block = BLOCK_FORMATS[type_id]
        blocks = torch.randint(0, 256, (48, 512 // block.values * block.nbytes), dtype=torch.uint8)
        for rows, block_n in ((m, gguf_matmul.gemv_block_n(m, type_id)) for m in (1, 2, 4)):
            yield (
                f"gguf gemv {block.name} M={rows}",
                lambda b=blocks, t=type_id, m=rows, n=block_n: gguf_matmul.gguf_gemv_triton(
                    torch.randn(m, 512, dtype=bf16), t, b, torch.empty(m, 48, dtype=bf16), n
                ),
            )
        yield (
            f"gguf gemv {block.name} split in 4, 3 loop stages",
            lambda b=blocks, t=type_id: gguf_matmul.gguf_gemv_triton(
                torch.randn(1, 512, dtype=bf16),
                t,
                b,
                torch.empty(1, 48, dtype=bf16),
                16,
                split_k=4,
                loop_stages=3,
            ),
        )
        for rows, dtype in ((9, bf16), (20, bf16), (20, torch.float32)):
            yield (
                f"gguf dot {block.name} M={rows} {dtype}",
                lambda b=blocks, t=type_id, m=rows, d=dtype: gguf_matmul.gguf_dot_triton(
                    torch.randn(m, 512, dtype=d), t, b, torch.empty(m, 48, dtype=d)
                ),
            )
        for ids in (None, torch.tensor([3, 1])):
            yield (
                f"gguf dequantize {block.name} ids={ids is not None}",
                lambda b=blocks, t=type_id, i=ids: gguf_matmul.gguf_dequantize_triton(
                    t, b, 512, bf16, ids=i, block_n=gguf_matmul.DEQUANTIZE_BLOCK_N
                ),
            )
    yield from _planar_gguf_launches()


def _planar_gguf_launches() -> Iterator[tuple[str, Callable[[], object]]]:
    """The planar rows' kernels (Q4_0, Q8_0, Q4_K, Q6_K as a GPU load repacks them): the GEMV
    at 1, 2 and 4 rows with the GPU's rows a program (and split over K), the dot kernel, the
    dequantize kernel; K = 3840 (Gemma 3 12B's, whole steps: no masks) and 320 for the
    32-value types (a masked last step)."""
    bf16 = torch.bfloat16
    for type_id in PLANAR_TYPES:
        block = BLOCK_FORMATS[type_id]
        layout = planar_layout(type_id)
        for k in (3840, 320) if block.values == 32 else (3840,):
            raw = torch.randint(0, 256, (96, k // block.values * block.nbytes), dtype=torch.uint8)
            rows = to_planar(type_id, raw)
            for m in (1, 2, 4):
                block_n = gguf_matmul.planar_block_n(m, type_id, 1 << 20, 132)
                yield (
                    f"gguf planar gemv {block.name} K={k} M={m}",
                    lambda r=rows, t=layout, m=m, n=block_n, k=k: gguf_matmul.gguf_gemv_triton(
                        torch.randn(m, k, dtype=bf16), t, r, torch.empty(m, 96, dtype=bf16), n
                    ),
                )
            yield (
                f"gguf planar gemv {block.name} K={k} split in 3, a step ahead",
                lambda r=rows, t=layout, k=k: gguf_matmul.gguf_gemv_triton(
                    torch.randn(1, k, dtype=bf16), t, r, torch.empty(1, 96, dtype=bf16), 32,
                    split_k=3, prefetch=True,
                ),
            )  # fmt: skip
            yield (
                f"gguf planar dot {block.name} K={k}",
                lambda r=rows, t=layout, k=k: gguf_matmul.gguf_dot_triton(
                    torch.randn(20, k, dtype=bf16), t, r, torch.empty(20, 96, dtype=bf16)
                ),
            )
            yield (
                f"gguf planar dequantize {block.name} K={k}",
                lambda r=rows, t=layout, k=k: gguf_matmul.gguf_dequantize_triton(
                    t, r, k, bf16, block_n=gguf_matmul.DEQUANTIZE_BLOCK_N
                ),
            )


# (N, K): Gemma 3 12B's gate/up, down and q projections, the tied head, and two small weights.
GEMV_SHAPES = (
    (15360, 3840),
    (3840, 15360),
    (8192, 3840),
    (262144, 3840),
    (2048, 4096),
    (512, 4096),
    (8192, 2816),  # 26B-A4B's q/k/v: few short rows, unsplit
)


class _Dense:
    def signature(self) -> str:
        return "dense"


def _compiler_environment() -> dict[str, str]:
    """This environment without the interpreter, with Hearth's sources importable."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    source_root = str(Path(hearth.__file__).resolve().parents[1])
    environment["PYTHONPATH"] = os.pathsep.join([source_root, environment.get("PYTHONPATH", "")])
    return environment


def test_every_kernel_compiles_for_hopper() -> None:
    specs = []
    for name, launch in _launches():
        launches = _recorded_launches(launch)
        assert launches, f"{name} launched no Triton kernel"
        specs += [_spec(kernel, arguments) for kernel, arguments in launches]
    unique = list({json.dumps(spec, sort_keys=True): spec for spec in specs}.values())
    environment = _compiler_environment()
    result = subprocess.run(
        [sys.executable, "-c", COMPILER],
        input=json.dumps(unique),
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


# Compiles each spec for sm_90 with its `aligned` arguments marked divisible by 16, as a GPU
# launch specializes 16-byte aligned pointers and multiples of 16, and prints the number of
# cp.async instructions in each PTX, one per line.
CP_ASYNC_COUNTER = """
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

for spec in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    names = list(kernel.arg_names)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in spec["aligned"]}
    source = ASTSource(kernel, spec["signature"], spec["constants"], attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    print(compiled.asm["ptx"].count("cp.async"))
"""


def _aligned_spec(kernel: InterpretedFunction, arguments: dict) -> dict:
    """`_spec`, plus the arguments a GPU launch would specialize as multiples of 16."""
    spec = _spec(kernel, arguments)
    spec["aligned"] = [
        name
        for name, kind in spec["signature"].items()
        if kind != "constexpr"
        and (
            (isinstance(arguments[name], torch.Tensor) and arguments[name].data_ptr() % 16 == 0)
            or (type(arguments[name]) is int and arguments[name] % 16 == 0)
        )
    ]
    return spec


def _cp_async_counts(launches: list[Callable[[], object]]) -> list[int]:
    """cp.async instructions in the sm_90 PTX of the first kernel each call launches (a
    K-split affine GEMV launches its partials' sum after it)."""
    specs = []
    for launch in launches:
        (kernel, arguments), *_ = _recorded_launches(launch)
        specs.append(_aligned_spec(kernel, arguments))
    result = subprocess.run(
        [sys.executable, "-c", CP_ASYNC_COUNTER],
        input=json.dumps(specs),
        capture_output=True,
        text=True,
        env=_compiler_environment(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [int(count) for count in result.stdout.split()]


def test_loop_stages_pipeline_the_gemv_loop_for_hopper() -> None:
    """With loop stages the weight tiles of the bf16 GEMV's K loop stream into shared memory
    by cp.async (Triton's pipeliner takes loads that feed no dot only under a loop's
    num_stages); the default keeps plain vector loads. (Without the alignment a launch
    specializes, the loads are too narrow to pipeline.)"""
    bf16 = torch.bfloat16
    x, weight = torch.randn(1, 4096, dtype=bf16), torch.randn(64, 4096, dtype=bf16)
    tiles = {"BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 2}
    counts = _cp_async_counts(
        [
            lambda: gemv.gemv_triton(x, weight, False, tiles),
            lambda: gemv.gemv_triton(x, weight, False, {**tiles, "LOOP_STAGES": 3}),
        ]
    )
    assert counts[0] == 0 and counts[1] > 0, counts
