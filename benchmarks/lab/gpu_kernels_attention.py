"""Split-K decode attention on a GPU: correctness, speed per KV format, and a small tile sweep.

Batch 1, one bf16 query token, at Gemma 3 12B shapes (Hq=16, Hkv=8, D=256) and a Gemma 4 31B
full-attention layer (Hq=32, Hkv=4, D=512). For each KV format (dense bf16, MLX affine 8/4-bit
g64, TurboQuant k8v3/k4v3/t4v3) the Triton kernel is checked against the torch reference on
fresh random planes, then timed at S = 8192, 32768, 131072 against torch SDPA on the dense
cache (enable_gqa, bool mask: the model's current path). Bandwidth counts the K/V plane bytes
of every slot (positions excluded) against the 4.2 TB/s measured copy bandwidth.

Every timing replays the call captured in a CUDA graph (as the model decodes), so host
launch overhead is not counted; triton.testing.do_bench flushes L2 before each replay.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_kernels_attention.py [--sweep-all]

Compiling ~150 kernel variants serially is slow; ATTN_WARM=i/n runs only every n-th kernel
call (from the i-th), untimed, to fill Triton's disk cache from n parallel processes first:

    for i in $(seq 0 11); do ATTN_WARM=$i/12 python benchmarks/lab/gpu_kernels_attention.py & done
    wait; python benchmarks/lab/gpu_kernels_attention.py

Writes $OUT/gpu_kernels_attention.md (default benchmarks/results/) and prints it. If
benchmarks/_decode_attention_before.py exists (a copy of an earlier kernel module), its
timings are added as "(before)" rows.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.nn.functional as F
import triton
import triton.testing
from hearth.kv.quantized import AffineCodec

from hearth.kv.cache import EMPTY_POSITION
from hearth.ops.decode_attention import (
    LaunchConfig,
    PlaneFormat,
    decode_attention,
    decode_attention_reference,
    formats_of,
)
from hearth.quant.turbo import TurboCodec

COPY_BANDWIDTH = 4.2e12  # bytes/s, measured device copy on the H200
SHAPES = {"gemma3-12b": (16, 8, 256), "gemma4-31b-full": (32, 4, 512)}  # Hq, Hkv, D
CODECS: dict[str, AffineCodec | TurboCodec | None] = {
    "dense": None,
    "affine8-g64": AffineCodec(8, 64),
    "affine4-g64": AffineCodec(4, 64),
    "turbo-k8v3": TurboCodec.parse("k8v3"),
    "turbo-k4v3": TurboCodec.parse("k4v3"),
    "turbo-t4v3": TurboCodec.parse("t4v3"),
}
LENGTHS = (8192, 32768, 131072)
# bf16 output vs an fp32 reference on the same planes: rounding the output to bf16 alone is
# ~2e-3 relative RMS; the kernel also rounds softmax weights, decoded tiles and (codebook
# keys) the rotated query to bf16, each a relative 2^-9 per element averaging out over slots.
RELATIVE_RMS_BOUND = 2e-2
WARM = os.environ.get("ATTN_WARM")  # "i/n": compile-only worker i of n
_items = 0


def item(fn: Callable[[], object]) -> object | None:
    """Run one kernel call, or in a warm worker only its share of them (then None)."""
    global _items
    _items += 1
    if WARM is None:
        return fn()
    part, parts = (int(x) for x in WARM.split("/"))
    if _items % parts == part:
        try:
            fn()
            torch.cuda.synchronize()
        except Exception:  # the timed pass reports it
            pass
    return None


def _load_before() -> object | None:
    path = Path(__file__).resolve().parent / "_decode_attention_before.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("decode_attention_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


BEFORE = _load_before()

Planes = tuple[list[torch.Tensor], list[torch.Tensor], PlaneFormat, PlaneFormat]


def make_planes(
    codec: AffineCodec | TurboCodec | None, keys: torch.Tensor, values: torch.Tensor
) -> Planes:
    if codec is None:
        return [keys], [values], PlaneFormat.dense(), PlaneFormat.dense()
    key_format, value_format, key_count = formats_of(codec)
    planes = list(codec.encode(keys, values))
    return planes[:key_count], planes[key_count:], key_format, value_format


def random_cache(kv_heads: int, slots: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, kv_heads, slots, dim)
    return (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16),
        torch.randn(shape, device="cuda", dtype=torch.bfloat16),
    )


def error_row(cells: list[str], exc: Exception, columns: int) -> str:
    """A table row for a case that raised (a blind run on new hardware: report, keep going)."""
    traceback.print_exc()
    message = f"{type(exc).__name__}: {exc}".replace("|", "/").replace("\n", " ")[:200]
    return "| " + " | ".join([*cells, message, *[""] * (columns - 1)]) + " |"


def relative_rms(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference.float()).norm() / reference.float().norm())


def plane_bytes(planes: Sequence[torch.Tensor]) -> int:
    return sum(plane.nbytes for plane in planes)


# ---------------------------------------------------------------------------------------------
# Correctness


def correctness_rows() -> list[str]:
    """Kernel vs reference on fresh planes: a full cache with an empty tail, and a ring with
    a sliding window; then a CUDA-graph replay after the positions change in place."""
    rows = []
    for shape_name, (query_heads, kv_heads, dim) in SHAPES.items():
        for case, slots, filled, window in (
            ("tail empty", 6144, 5000, None),
            ("ring+window", 4096, 9000, 1024),
        ):
            keys, values = random_cache(kv_heads, slots, dim)
            q = torch.randn(1, query_heads, dim, device="cuda", dtype=torch.bfloat16)
            positions = torch.full((slots,), EMPTY_POSITION, device="cuda", dtype=torch.long)
            written = torch.arange(max(0, filled - slots), filled, device="cuda")
            positions[written % slots] = written
            qpos = torch.tensor(filled - 1, device="cuda")
            if WARM is None:
                rows.append(
                    sdpa_row(
                        shape_name, f"{case} S={slots}", q, keys, values, positions, qpos, window
                    )
                )
            for name, codec in CODECS.items():
                # The defaults, then (dense, k4v3) both ways of merging the splits.
                variants = [("", LaunchConfig())]
                if name in ("dense", "turbo-k4v3"):
                    variants += [
                        (" (fused merge)", LaunchConfig(fused_merge=True)),
                        (" (merge launch)", LaunchConfig(fused_merge=False)),
                    ]
                for suffix, config in variants:
                    label = name + suffix
                    try:
                        key_planes, value_planes, kf, vf = make_planes(codec, keys, values)
                        args = (
                            q, key_planes, value_planes, kf, vf, positions, qpos, window, dim**-0.5
                        )  # fmt: skip
                        out = item(partial(decode_attention, *args, config))
                        if out is None:
                            continue
                        reference = decode_attention_reference(*args)
                        error = relative_rms(out, reference)
                        verdict = "ok" if error <= RELATIVE_RMS_BOUND else "FAIL"
                        rows.append(
                            f"| {shape_name} | {case} S={slots} | {label} | {error:.2e} "
                            f"| {verdict} |"
                        )
                    except Exception as exc:
                        rows.append(error_row([shape_name, f"{case} S={slots}", label], exc, 2))
    if WARM is None:
        rows.extend(graph_rows())
    return rows


def sdpa_row(
    shape_name: str,
    case: str,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    qpos: torch.Tensor,
    window: int | None,
) -> str:
    """The reference itself against torch SDPA (the model's path) on the dense cache."""
    distance = qpos - positions
    mask = (distance >= 0) & (distance < (window or 2**62))
    dim = q.shape[-1]
    sdpa = F.scaled_dot_product_attention(
        q[:, :, None], keys, values, attn_mask=mask[None, :], scale=dim**-0.5, enable_gqa=True
    )[:, :, 0]
    reference = decode_attention_reference(
        q, [keys], [values], PlaneFormat.dense(), PlaneFormat.dense(),
        positions, qpos, window, dim**-0.5,
    )  # fmt: skip
    error = relative_rms(reference, sdpa)
    verdict = "ok" if error <= RELATIVE_RMS_BOUND else "FAIL"
    return f"| {shape_name} | {case} | reference vs SDPA (dense) | {error:.2e} | {verdict} |"


def graph_rows() -> list[str]:
    """Capture two calls in one CUDA graph (they share the fused merge's arrival counters),
    move the query forward in place, replay three times: each replay must match the
    reference and be bit-identical to the first (the counters are reset by every call)."""
    rows = []
    query_heads, kv_heads, dim = SHAPES["gemma3-12b"]
    slots = 4096
    keys, values = random_cache(kv_heads, slots, dim)
    for name in ("dense", "affine4-g64", "turbo-k8v3", "turbo-t4v3"):
        try:
            key_planes, value_planes, kf, vf = make_planes(CODECS[name], keys, values)
            q = torch.randn(1, query_heads, dim, device="cuda", dtype=torch.bfloat16)
            positions = torch.full((slots,), EMPTY_POSITION, device="cuda", dtype=torch.long)
            positions[:1000] = torch.arange(1000, device="cuda")
            qpos = torch.tensor(999, device="cuda")
            args = (q, key_planes, value_planes, kf, vf, positions, qpos, None, dim**-0.5)
            # The second call: a sliding window and another split count (splits=8).
            windowed = (*args[:7], 512, dim**-0.5)
            second = LaunchConfig(splits=8)
            decode_attention(*args)  # warm-up: compiles, caches device tables
            decode_attention(*windowed, second)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = decode_attention(*args)
                out_windowed = decode_attention(*windowed, second)
            positions[:3000] = torch.arange(3000, device="cuda")
            qpos.fill_(2999)
            q.copy_(torch.randn_like(q))
            replays = []
            for _ in range(3):
                graph.replay()
                replays.append((out.clone(), out_windowed.clone()))
            error = max(
                relative_rms(out, decode_attention_reference(*args)),
                relative_rms(out_windowed, decode_attention_reference(*windowed)),
            )
            same = all(
                torch.equal(a, b)
                for replay in replays[1:]
                for a, b in zip(replay, replays[0], strict=True)
            )
            verdict = "ok" if error <= RELATIVE_RMS_BOUND and same else "FAIL"
            rows.append(
                f"| gemma3-12b | CUDA graph, 2 calls, 3 replays S={slots} | {name} | "
                f"{error:.2e}{'' if same else ' (replays differ)'} | {verdict} |"
            )
        except Exception as exc:
            rows.append(error_row(["gemma3-12b", "CUDA graph", name], exc, 2))
    return rows


# ---------------------------------------------------------------------------------------------
# Speed


def bench(fn: Callable[[], object]) -> float:
    """Median µs of a CUDA-graph replay of fn (nan in a warm worker)."""
    if item(fn) is None and WARM is not None:
        return math.nan
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    micros = 1000 * triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    del graph
    return micros


def speed_row(
    shape_name: str,
    slots: int,
    name: str,
    micros: float,
    kv_bytes: int,
    sdpa: float,
) -> str:
    rate = kv_bytes / (micros * 1e-6)
    return (
        f"| {shape_name} | {slots} | {name} | {kv_bytes // slots} | {micros:.1f} | "
        f"{rate / 1e9:.0f} "
        f"| {100 * rate / COPY_BANDWIDTH:.0f}% | {sdpa / micros:.2f}x |"
    )


def speed_rows() -> list[str]:
    rows = []
    for shape_name, dims in SHAPES.items():
        for slots in LENGTHS:
            rows += speed_rows_at(shape_name, dims, slots)
            torch.cuda.empty_cache()
    return rows


def speed_rows_at(shape_name: str, dims: tuple[int, int, int], slots: int) -> list[str]:
    query_heads, kv_heads, dim = dims
    keys, values = random_cache(kv_heads, slots, dim)
    q = torch.randn(1, query_heads, dim, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(slots, device="cuda")
    qpos = torch.tensor(slots - 1, device="cuda")
    mask = positions[None, :] <= qpos  # [queries, keys], as attention_mask builds it
    sdpa_call = partial(
        F.scaled_dot_product_attention,
        q[:, :, None], keys, values, attn_mask=mask, scale=dim**-0.5, enable_gqa=True,
    )  # fmt: skip
    sdpa = bench(sdpa_call)
    dense_bytes = keys.nbytes + values.nbytes
    rows = [speed_row(shape_name, slots, "SDPA (dense)", sdpa, dense_bytes, sdpa)]
    for name, codec in CODECS.items():
        try:
            key_planes, value_planes, kf, vf = make_planes(codec, keys, values)
            call = partial(
                decode_attention,
                q, key_planes, value_planes, kf, vf, positions, qpos, None, dim**-0.5,
            )  # fmt: skip
            kv_bytes = plane_bytes(key_planes) + plane_bytes(value_planes)
            rows.append(speed_row(shape_name, slots, name, bench(call), kv_bytes, sdpa))
            if BEFORE is not None and slots <= 32768:
                before = partial(
                    BEFORE.decode_attention,
                    q, key_planes, value_planes,
                    BEFORE.PlaneFormat(kf.kind, kf.bits, kf.group_size),
                    BEFORE.PlaneFormat(vf.kind, vf.bits, vf.group_size),
                    positions, qpos, None, dim**-0.5,
                )  # fmt: skip
                rows.append(
                    speed_row(shape_name, slots, f"{name} (before)", bench(before), kv_bytes, sdpa)
                )
        except Exception as exc:
            rows.append(error_row([shape_name, str(slots), name], exc, 5))
    return rows


def split_rows() -> list[str]:
    """Programs per SM / single pass / how the splits are merged at short caches
    (gemma3-12b's sliding layers hold 1024 slots), for choosing the split and merge policy:
    the last split merging (fused) saves a launch but reads all partials of its KV head
    alone, so wide heads (gemma4-31b-full) may be better off with the merge launch."""
    configs = [
        LaunchConfig(),
        LaunchConfig(splits=1),
        LaunchConfig(programs_per_sm=1),
        LaunchConfig(programs_per_sm=4),
        LaunchConfig(programs_per_sm=8),
        LaunchConfig(fused_merge=True),
        LaunchConfig(fused_merge=False),
    ]
    rows = []
    for shape_name, slots, names in (
        ("gemma3-12b", 1024, ("dense", "affine4-g64", "turbo-k4v3", "turbo-t4v3")),
        ("gemma3-12b", 8192, ("dense", "affine4-g64", "turbo-k4v3", "turbo-t4v3")),
        ("gemma4-31b-full", 1024, ("dense", "affine4-g64", "turbo-k4v3")),
        ("gemma4-31b-full", 8192, ("dense", "affine4-g64", "turbo-k4v3")),
    ):
        query_heads, kv_heads, dim = SHAPES[shape_name]
        keys, values = random_cache(kv_heads, slots, dim)
        q = torch.randn(1, query_heads, dim, device="cuda", dtype=torch.bfloat16)
        positions = torch.arange(slots, device="cuda")
        qpos = torch.tensor(slots - 1, device="cuda")
        for name in names:
            key_planes, value_planes, kf, vf = make_planes(CODECS[name], keys, values)
            kv_bytes = plane_bytes(key_planes) + plane_bytes(value_planes)
            args = (q, key_planes, value_planes, kf, vf, positions, qpos, None, dim**-0.5)
            cells = []
            for config in configs:
                try:
                    micros = bench(partial(decode_attention, *args, config))
                    cells.append(
                        f"{micros:.1f} ({100 * kv_bytes / (micros * 1e-6) / COPY_BANDWIDTH:.0f}%)"
                    )
                except Exception as exc:
                    cells.append(f"error: {type(exc).__name__}")
            rows.append(f"| {shape_name} | {slots} | {name} | " + " | ".join(cells) + " |")
    header = "| shape | S | format | " + " | ".join(_describe(c) for c in configs) + " |"
    return [header, "|" + "---|" * (len(configs) + 3), *rows]


def sweep_rows(all_formats: bool) -> list[str]:
    """Tile sizes / warps / stages / block skipping at S=32768, for choosing the defaults."""
    configs = [
        LaunchConfig(),
        LaunchConfig(block_n=16, num_warps=4),
        LaunchConfig(block_n=32, num_warps=2),
        LaunchConfig(block_n=64, num_warps=4),
        LaunchConfig(block_n=64, num_warps=8),
        LaunchConfig(num_stages=3),
        LaunchConfig(programs_per_sm=4),
        # Without the branch over masked blocks the loop body has no `if`, so Triton's
        # pipeliner may prefetch the next block's K/V while this one computes.
        LaunchConfig(skip_masked_blocks=False),
        LaunchConfig(skip_masked_blocks=False, num_stages=3),
        LaunchConfig(skip_masked_blocks=False, num_stages=4),
        LaunchConfig(skip_masked_blocks=False, block_n=64, num_stages=3),
        # The defaults before 2026-12-03's sweep: dense skipped masked blocks at 2 stages,
        # affine took N=32.
        LaunchConfig(skip_masked_blocks=True, num_stages=2),
        LaunchConfig(block_n=32, num_warps=4),
        LaunchConfig(fused_merge=True),
        LaunchConfig(fused_merge=False),
    ]
    slots = 32768
    rows = []
    for shape_name, (query_heads, kv_heads, dim) in SHAPES.items():
        names = (
            list(CODECS)
            if all_formats or shape_name == "gemma3-12b"
            else ["dense", "affine4-g64", "turbo-k4v3", "turbo-t4v3"]
        )
        keys, values = random_cache(kv_heads, slots, dim)
        q = torch.randn(1, query_heads, dim, device="cuda", dtype=torch.bfloat16)
        positions = torch.arange(slots, device="cuda")
        qpos = torch.tensor(slots - 1, device="cuda")
        for name in names:
            key_planes, value_planes, kf, vf = make_planes(CODECS[name], keys, values)
            kv_bytes = plane_bytes(key_planes) + plane_bytes(value_planes)
            args = (q, key_planes, value_planes, kf, vf, positions, qpos, None, dim**-0.5)
            cells = []
            for config in configs:
                try:
                    micros = bench(partial(decode_attention, *args, config))
                    cells.append(
                        f"{micros:.0f} ({100 * kv_bytes / (micros * 1e-6) / COPY_BANDWIDTH:.0f}%)"
                    )
                except Exception as exc:
                    cells.append(f"error: {type(exc).__name__}")
            rows.append(f"| {shape_name} | {name} | " + " | ".join(cells) + " |")
    header = "| shape | format | " + " | ".join(_describe(c) for c in configs) + " |"
    return [header, "|" + "---|" * (len(configs) + 2), *rows]


def _describe(config: LaunchConfig) -> str:
    parts = [
        f"{label}={value}"
        for label, value in (
            ("N", config.block_n),
            ("warps", config.num_warps),
            ("stages", config.num_stages),
            ("splits", config.splits),
            ("programs/SM", config.programs_per_sm),
        )
        if value is not None
    ]
    if config.skip_masked_blocks is not None:
        parts.append("skip" if config.skip_masked_blocks else "no skip")
    if config.fused_merge is not None:
        parts.append("fused merge" if config.fused_merge else "merge launch")
    return ", ".join(parts) or "default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep-all", action="store_true", help="sweep every format")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--sweep-only", action="store_true", help="correctness and the sweep")
    options = parser.parse_args()
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    out_dir = Path(os.environ.get("OUT", "benchmarks/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Decode attention kernels ({datetime.date.today()}, {device}, "
        f"torch {torch.__version__}, triton {triton.__version__})",
        "",
        "Batch 1, one bf16 query token; Triton split-K kernel reading each KV format directly.",
    ]
    sections: list[tuple[list[str], Callable[[], list[str]]]] = [
        (
            [
                "## Correctness (kernel vs torch reference on the same planes, relative RMS "
                f"error, bound {RELATIVE_RMS_BOUND})",
                "",
                "| shape | case | format | rel. RMS | verdict |",
                "|---|---|---|---|---|",
            ],
            correctness_rows,
        ),
        (
            [
                "## Speed (all slots visible; CUDA-graph replay, median of "
                "triton.testing.do_bench)",
                "",
                "KV bytes/token: K+V planes of one layer (all KV heads). GB/s: KV plane bytes / "
                f"time (positions excluded); % of {COPY_BANDWIDTH / 1e12:.1f} TB/s copy "
                "bandwidth. SDPA gets a prebuilt bool mask (the model also builds it per "
                "layer). (before): the previous kernel, timed the same way.",
                "",
                "| shape | S | format | KV bytes/token | µs | GB/s | % of 4.2 TB/s | vs SDPA |",
                "|---|---|---|---|---|---|---|---|",
            ],
            speed_rows,
        ),
    ]
    if options.sweep_only:
        sections = sections[:1]
    if not options.no_sweep:
        sections += [
            (["## Splits at short caches (µs, % of 4.2 TB/s)", ""], split_rows),
            (
                ["## Launch sweep at S=32768 (µs, % of 4.2 TB/s)", ""],
                partial(sweep_rows, options.sweep_all),
            ),
        ]
    for header, rows in sections:
        lines += ["", *header, *rows()]
        if WARM is None:  # written as it goes: a run cut short still reports
            (out_dir / "gpu_kernels_attention.md").write_text("\n".join(lines) + "\n")
    if WARM is None:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
