"""Paged decode attention on a GPU: the Triton kernel over block tables, checked against its
torch reference, timed at B = 1, 4, 16, 64 rows, contexts 512 and 4096, head_dim 256 and 512
(16 query heads over 8 KV heads, bf16 query), beside `decode_attention` over the same K/V laid
out contiguously (the batch-1 path's kernel, here batched): the cost of reading through the
table.

Each row's blocks are scattered over the pool (a random permutation), as a running server's
are. Layers: "full" (window None) at D=256 and D=512, "sliding" (window 1024) at D=256, whose
splits cover only window + 16 slots. Bandwidth counts the bytes of the K/V planes of every
visible slot (the bytes the kernel must read) against the H100's 3.0 TB/s copy bandwidth.
Every timing replays the call captured in a CUDA graph (as the batched decode step runs it);
triton.testing.do_bench flushes L2 before each replay.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_paged_attention.py \
        [--formats dense,affine4,affine8,k8v3] [--sweep]

--sweep also times dense tiles of 16/32/64 slots on 4/8 warps (the defaults come from
`decode_attention`'s sweeps over a contiguous cache). Writes $OUT/gpu_paged_attention.md
(default benchmarks/results/) and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch
import triton.testing

from hearth.ops.decode_attention import (
    LaunchConfig,
    PlaneFormat,
    decode_attention,
    formats_of,
)
from hearth.ops.paged_attention import (
    paged_decode_attention_kernel,
    paged_decode_attention_reference,
)
from hearth.quant.kv_codecs import AffineCodec
from hearth.quant.turbo import TurboCodec

COPY_BANDWIDTH = 3.0e12  # bytes/s, the H100's measured device copy
BLOCK = 16
QUERY_HEADS, KV_HEADS = 16, 8
BATCHES = (1, 4, 16, 64)
CONTEXTS = (512, 4096)
LAYERS = (("full", 256, None), ("sliding", 256, 1024), ("full", 512, None))
CODECS: dict[str, AffineCodec | TurboCodec | None] = {
    "dense": None,
    "affine8": AffineCodec(8, 64),
    "affine4": AffineCodec(4, 64),
    "k8v3": TurboCodec.parse("k8v3"),
}
# bf16 output vs an fp32-softmax reference on the same planes: the output's bf16 rounding is
# ~2e-3 relative RMS; the kernel also rounds softmax weights and decoded tiles to bf16.
RELATIVE_RMS_BOUND = 2e-2


def graph_time_us(fn: Callable[[], object]) -> float:
    """Median microseconds of `fn` replayed from a CUDA graph (L2 flushed before each)."""
    fn()  # compile, fill device caches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") * 1e3


def encode(codec: AffineCodec | TurboCodec | None, keys: torch.Tensor, values: torch.Tensor):
    """(key planes, value planes, key format, value format)."""
    if codec is None:
        return [keys], [values], PlaneFormat.dense(), PlaneFormat.dense()
    key_format, value_format, key_count = formats_of(codec)
    planes = list(codec.encode(keys, values))
    return planes[:key_count], planes[key_count:], key_format, value_format


def slot_bytes(planes: list[torch.Tensor]) -> int:
    """Bytes of one (slot, KV head) row over a plane list."""
    return sum(p[0, 0, 0].nbytes for p in planes)


def case_rows(
    scheme: str, layer: str, dim: int, window: int | None, batch: int, context: int, sweep: bool
) -> list[str]:
    blocks_per_row = context // BLOCK
    num_blocks = batch * blocks_per_row + 1
    shape = (num_blocks, KV_HEADS, BLOCK, dim)
    keys = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    key_planes, value_planes, key_format, value_format = encode(CODECS[scheme], keys, values)
    del keys, values
    order = torch.randperm(num_blocks, device="cuda")[: batch * blocks_per_row]
    tables = order.view(batch, blocks_per_row).to(torch.int32)
    positions = torch.full((batch,), context - 1, device="cuda", dtype=torch.long)
    q = torch.randn(batch, QUERY_HEADS, dim, device="cuda", dtype=torch.bfloat16)
    args = (
        q, key_planes, value_planes, key_format, value_format, tables, positions, window,
        dim**-0.5,
    )  # fmt: skip
    out = paged_decode_attention_kernel(*args)
    reference = paged_decode_attention_reference(*args)
    error = float((out.float() - reference.float()).norm() / reference.float().norm())
    verdict = "ok" if error <= RELATIVE_RMS_BOUND else "FAIL"

    visible = context if window is None else min(window, context)
    read = batch * KV_HEADS * visible * (slot_bytes(key_planes) + slot_bytes(value_planes))

    def row(label: str, micros: float) -> str:
        rate = read / (micros * 1e-6)
        return (
            f"| {scheme} | {layer} D={dim} | {batch} | {context} | {label} | {micros:.1f} "
            f"| {rate / 1e9:.0f} | {100 * rate / COPY_BANDWIDTH:.0f}% | {error:.1e} {verdict} |"
        )

    rows = [row("paged", graph_time_us(lambda: paged_decode_attention_kernel(*args)))]
    if sweep and scheme == "dense":
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                config = LaunchConfig(block_n=block_n, num_warps=warps)
                micros = graph_time_us(lambda c=config: paged_decode_attention_kernel(*args, c))
                rows.append(row(f"paged n{block_n} w{warps}", micros))

    # The same K/V contiguous, [B, Hkv, context, D] per plane, through decode_attention.
    def contiguous(planes: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p[tables.long()].transpose(1, 2).flatten(2, 3).contiguous() for p in planes]

    flat_keys, flat_values = contiguous(key_planes), contiguous(value_planes)
    slots = torch.arange(context, device="cuda")
    qpos = torch.tensor(context - 1, device="cuda")
    flat_args = (
        q, flat_keys, flat_values, key_format, value_format, slots, qpos, window, dim**-0.5
    )  # fmt: skip
    rows.append(row("contiguous", graph_time_us(lambda: decode_attention(*flat_args))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="dense,affine8,affine4,k8v3")
    parser.add_argument("--sweep", action="store_true", help="also time dense tile variants")
    options = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    lines = [
        f"# Paged decode attention ({datetime.date.today()}, {gpu})",
        "",
        f"Hq={QUERY_HEADS}, Hkv={KV_HEADS}, bf16 query, blocks of {BLOCK} scattered over the "
        "pool; CUDA-graph replay, median, L2 flushed. GB/s: K/V plane bytes of the visible "
        f"slots per second; % of {COPY_BANDWIDTH / 1e12:.1f} TB/s. `contiguous`: "
        "decode_attention over the same K/V laid out [B, Hkv, S, D].",
        "",
        "| format | layer | B | context | kernel | us | GB/s | of copy | rel. RMS vs ref |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scheme in options.formats.split(","):
        for layer, dim, window in LAYERS:
            for context in CONTEXTS:
                for batch in BATCHES:
                    try:
                        lines += case_rows(
                            scheme, layer, dim, window, batch, context, options.sweep
                        )
                    except Exception as exc:
                        traceback.print_exc()
                        message = f"{type(exc).__name__}: {exc}".replace("|", "/")[:160]
                        lines.append(
                            f"| {scheme} | {layer} D={dim} | {batch} | {context} | "
                            f"{message} | | | | |"
                        )
                    print(lines[-1], flush=True)
                    torch.cuda.empty_cache()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    lines += ["", f"Commit {commit or '?'}."]
    text = "\n".join(lines) + "\n"
    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_paged_attention.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
