"""What one launch costs the host on this machine, op by op, and whether a prefill syncs.

A short prefill (E4B, 512 tokens) ran 61-71 ms of wall time for 7-12 ms of GPU time, about
50-75 µs of host time per launch. This times the pieces alone: an allocation, a tiny torch
op, a tiny Triton kernel with and without PDL, a cuBLAS matmul; then one E4B prefill with
torch's sync debug mode on, which warns at every op that waits for the GPU.

    OUT=/tmp/out python benchmarks/lab/gpu_launch_overhead.py
"""

from __future__ import annotations

import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hearth.bench.measure import PrefillRun
from hearth.bench.random_model import PRESETS, build_random_model
from hearth.ops import wait_for_producer

CALLS = 2000


@triton.jit
def _touch_kernel(x_ptr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


@triton.jit
def _twelve_pointers_kernel(a, b, c, d, e, f, g, h, i, j, k, out, n, PDL: tl.constexpr):
    wait_for_producer(PDL)
    total = tl.load(a) + tl.load(b) + tl.load(c) + tl.load(d) + tl.load(e) + tl.load(f)
    total += tl.load(g) + tl.load(h) + tl.load(i) + tl.load(j) + tl.load(k)
    tl.store(out, total + n)


def compiled_runner(
    kernel: object, tensors: list[torch.Tensor], as_ints: bool
) -> Callable[[], object]:
    """The compiled kernel's own launcher, past Triton's argument binding; `as_ints` hands it
    raw addresses, which skips its per-pointer data_ptr() call and cuPointerGetAttribute."""
    args = [t.data_ptr() for t in tensors] if as_ints else list(tensors)
    stream = torch.cuda.current_stream().cuda_stream
    run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
    return lambda: run(1, 1, 1, stream, function, packed, None, None, None, *args, 3, False)


def host_micros(call: Callable[[], object], calls: int = CALLS) -> tuple[float, float]:
    """Host µs per call while queueing `calls` of them, and µs per call until the GPU is done."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        call()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (queued - begin) / calls * 1e6, (done - begin) / calls * 1e6


def python_loop_ms() -> float:
    begin = time.perf_counter()
    total = 0
    for index in range(1_000_000):
        total += index
    return (time.perf_counter() - begin) * 1e3


@torch.inference_mode()
def main() -> None:
    device = torch.device("cuda")
    x = torch.zeros(16, device=device)
    a = torch.randn(512, 2560, device=device, dtype=torch.bfloat16)
    w = torch.randn(2560, 2560, device=device, dtype=torch.bfloat16)
    rows = [
        ("torch.empty (no kernel)", lambda: torch.empty(16, device=device)),
        ("x.add_(1) on 16 floats", lambda: x.add_(1)),
        ("torch.arange(16)", lambda: torch.arange(16, device=device)),
        ("Triton kernel, no PDL", lambda: _touch_kernel[(1,)](x, PDL=False)),
        ("Triton kernel, PDL", lambda: _touch_kernel[(1,)](x, PDL=True, launch_pdl=True)),
        ("F.linear 512x2560 @ 2560x2560 bf16", lambda: F.linear(a, w)),
    ]
    tensors = [torch.zeros(16, device=device) + index for index in range(12)]
    twelve = _twelve_pointers_kernel[(1,)](*tensors, 3, PDL=False)
    rows += [
        (
            "Triton kernel, 12 pointers",
            lambda: _twelve_pointers_kernel[(1,)](*tensors, 3, PDL=False),
        ),
        ("the same, compiled launcher, tensors", compiled_runner(twelve, tensors, False)),
        ("the same, compiled launcher, raw addresses", compiled_runner(twelve, tensors, True)),
    ]
    lines = [
        f"# Host cost of one launch, {torch.cuda.get_device_name()}",
        "",
        f"{time.strftime('%Y-%m-%d')} · torch {torch.__version__}, triton {triton.__version__} · "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"affinity {len(os.sched_getaffinity(0))}, load {os.getloadavg()[0]:.1f} · "
        f"CUDA_LAUNCH_BLOCKING={os.environ.get('CUDA_LAUNCH_BLOCKING', '')!r} · "
        f"a 1e6-iteration Python loop: {python_loop_ms():.1f} ms",
        "",
        f"| op ({CALLS} in a row) | host µs a call (queued) | µs a call until the GPU is done |",
        "|---|---|---|",
    ]
    for name, call in rows:
        queued, done = host_micros(call, 200 if "linear" in name else CALLS)
        lines.append(f"| {name} | {queued:.1f} | {done:.1f} |")
    # Each launch stores sum(0..10) + 3 into the twelfth tensor, whichever launcher ran last.
    lines += ["", f"twelve-pointer kernel's result: {tensors[11][0].item():.0f} (expected 58)"]
    lines += ["", sync_report(device)]
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_launch_overhead.md").write_text(table)


def sync_report(device: torch.device) -> str:
    """Ops of one E4B 512-token prefill that wait for the GPU (torch's sync debug mode)."""
    model = build_random_model(PRESETS["e4b"], device)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), device=device)
    run = PrefillRun(model, ids)
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    found = [
        f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:100]}"
        for w in caught
    ]
    body = "\n".join(f"- {line}" for line in found[:20]) or "- none"
    return f"E4B bf16 prefill of 512 tokens: {len(found)} synchronizing ops\n\n{body}"


if __name__ == "__main__":
    main()
