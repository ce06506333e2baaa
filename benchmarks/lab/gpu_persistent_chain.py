"""Would a persistent decode kernel pay? A probe: a chain of dependent bf16 GEMVs at a model's
decode shapes, run (a) as the decode step runs them today, one `gemv_triton` launch each
(pinned tiles, PDL, L2 hints) in a CUDA graph, and (b) as one persistent kernel whose
programs (all resident at once) take each GEMV's rows in turn and meet at a grid barrier
(an atomic counter per GEMV) before the next, asking L2 for their next rows while they wait.

Each GEMV reads the first K outputs of the one before it, so no phase can start early: the
dependency of a real decoder layer (q/k/v -> o -> gate/up -> down -> per-layer gate ->
projection), without the attention, norms and GeGLU between them. The decode step pays about
2.2 µs a launch on top of its bytes at E4B's sizes (docs/benchmarks.md); this measures how
much of that a kernel that never ends would win back, before anyone writes one.

Rows: µs per layer (CUDA-graph replay of LAYERS layers, median of 20) and the share of the
copy-bandwidth floor (weight bytes / a 1 GiB copy's rate, measured in the same run). The
"streaming only" rows drop the barriers: their values are wrong (phases read inputs not yet
written), their time is what streaming the weights costs in this kernel without any sync.
Checks: every phase of a persistent run against an fp64 oracle of the input it read (bound:
an output ulp + 4 sqrt(K) eps32 of sum |x w|), on a buffer whose outputs start as NaN, twice
(the second run proves the counters were reset).

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_persistent_chain.py
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hearth.ops import prefetch_row_lines

# One decoder layer's GEMVs in order, (N, K): each reads the first K outputs of the one before.
MODELS: dict[str, tuple[tuple[int, int], ...]] = {
    # qkv (sliding), o, gate/up, down, per-layer gate, per-layer projection
    "e4b": ((3072, 2560), (2560, 2048), (20480, 2560), (2560, 10240), (256, 2560), (2560, 256)),
    # qkv (sliding), o, dense gate/up, dense down (the experts are gathered, not in the chain)
    "26b-a4b": ((8192, 2816), (2816, 4096), (4224, 2816), (2816, 2112)),
    # qkv, o, gate/up, down
    "gemma3-12b": ((8192, 3840), (3840, 4096), (30720, 3840), (3840, 15360)),
}
LAYERS = 4  # 4 x 186 MB at E4B: no layer's weights are in L2 when it starts
# Elements of a 128-byte line: each activation starts on a line of its own, so no L1 line
# read early (another phase's input) holds part of an output written later in the launch.
ACT_ALIGN = 64
_ACT_ALIGN = tl.constexpr(ACT_ALIGN)  # as kernels read it


@dataclass(frozen=True)
class Tiles:
    """One persistent launch: programs per SM, rows x columns of a weight tile, pipeline
    depth of the K loop, warps, and 128-byte lines per row asked of L2 at each barrier."""

    per_sm: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    prefetch_lines: int = 0

    def label(self) -> str:
        return (
            f"{self.per_sm}/SM, {self.block_n}x{self.block_k}, {self.stages} stages, "
            f"{self.warps} warps, {self.prefetch_lines} lines"
        )


SWEEP = (  # the decode GEMV's pinned tiles (8 x 512) and wider ones, 1 to 4 programs an SM
    Tiles(1, 8, 512, 3, 8),
    Tiles(2, 8, 512, 3, 4),
    Tiles(4, 8, 512, 3, 4),
    Tiles(2, 8, 1024, 3, 4),
    Tiles(1, 16, 512, 4, 8),
)
PREFETCH_SWEEP = (8, 32)


@triton.jit
def _phase(w_ptr, x_ptr, y_ptr, pid, N, K, PROGRAMS, BLOCK_N, BLOCK_K, LOOP_STAGES):
    """y = W x for this program's rows of W [N, K] (contiguous), rows split evenly over the
    programs; fp32 accumulation, one rounding to y's dtype. N, K and the tiles are constexprs
    (the interpreter cannot loop to runtime bounds)."""
    rows_lo = pid * N // PROGRAMS
    rows_hi = (pid + 1) * N // PROGRAMS
    CHUNKS: tl.constexpr = ((N + PROGRAMS - 1) // PROGRAMS + BLOCK_N - 1) // BLOCK_N
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    for chunk in range(CHUNKS):
        n = rows_lo + chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < rows_hi
        rows = w_ptr + n.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for step in tl.range(STEPS, num_stages=LOOP_STAGES):
            k = step * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k < K
            w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            # Other programs wrote x this launch: L2 has it, and this SM's L1 cannot hold a
            # stale copy, since x's lines hold nothing else and are first read after the
            # barrier (the pipelined loop's cp.async of a few bytes goes through L1 whatever
            # the modifier, which keeps a plain load in L2).
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0, cache_modifier=".cg")
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _chain_kernel(
    weights_ptr,
    acts_ptr,
    meta_ptr,
    counters_ptr,
    SHAPES: tl.constexpr,
    LAYERS: tl.constexpr,
    PROGRAMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    BARRIERS: tl.constexpr,
    COUNTER_BLOCK: tl.constexpr,
):
    """LAYERS x len(SHAPES) GEMVs in order; phase i reads weights, input and output at the
    element offsets meta[i] = (w, x, y). Between phases every program arrives at counter i
    (release), asks L2 for its first PREFETCH_LINES lines of each of its next rows, and
    spins until all PROGRAMS have arrived (acquire): all programs must be resident at once.
    The last program out zeroes the counters for the next launch."""
    pid = tl.program_id(0)
    PHASES: tl.constexpr = len(SHAPES)
    for layer in range(LAYERS):
        for p in tl.static_range(PHASES):
            index = layer * PHASES + p
            at = meta_ptr + index * 3
            # Aligned offsets (`Chain` makes them so) let the K loop's loads go through
            # cp.async, pipelined; of unknown alignment they stay plain loads.
            w_ptr = weights_ptr + tl.multiple_of(tl.load(at), 8)
            x_ptr = acts_ptr + tl.multiple_of(tl.load(at + 1), _ACT_ALIGN)
            y_ptr = acts_ptr + tl.multiple_of(tl.load(at + 2), _ACT_ALIGN)
            _phase(
                w_ptr, x_ptr, y_ptr, pid, SHAPES[p][0], SHAPES[p][1], PROGRAMS, BLOCK_N,
                BLOCK_K, LOOP_STAGES,
            )  # fmt: skip
            if BARRIERS and index < LAYERS * PHASES - 1:
                counter = counters_ptr + index
                tl.debug_barrier()  # every thread's stores are issued before the release
                tl.atomic_add(counter, 1, sem="release", scope="gpu")
                if PREFETCH_LINES > 0:
                    NEXT_N: tl.constexpr = SHAPES[(p + 1) % PHASES][0]
                    NEXT_K: tl.constexpr = SHAPES[(p + 1) % PHASES][1]
                    next_w = weights_ptr + tl.load(at + 3)
                    first = pid * NEXT_N // PROGRAMS + tl.arange(0, BLOCK_N)
                    first = tl.minimum(first, NEXT_N - 1).to(tl.int64)
                    prefetch_row_lines(next_w + first[:, None] * NEXT_K, 0, NEXT_K, PREFETCH_LINES)
                while tl.atomic_add(counter, 0, sem="acquire", scope="gpu") < PROGRAMS:
                    pass
                tl.debug_barrier()
    if BARRIERS:
        COUNTERS: tl.constexpr = LAYERS * PHASES
        done = tl.atomic_add(counters_ptr + COUNTERS, 1, sem="acq_rel", scope="gpu")
        if done == PROGRAMS - 1:  # every program has left every spin
            c = tl.arange(0, COUNTER_BLOCK)  # a power of two > COUNTERS
            tl.store(counters_ptr + c, tl.zeros_like(c), mask=c <= COUNTERS)


class Chain:
    """LAYERS layers of `shapes` over one flat weight buffer and one flat activation buffer:
    input first, then every phase's output in order."""

    def __init__(
        self,
        shapes: tuple[tuple[int, int], ...],
        layers: int,
        device: torch.device,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ):
        self.shapes, self.layers = shapes, layers
        phases = [shape for _ in range(layers) for shape in shapes]
        for (n, _), (_, k) in itertools.pairwise(phases):
            if k > n:
                raise ValueError(f"a GEMV of K={k} cannot follow one of N={n}")
        generator = torch.Generator(device=device).manual_seed(seed)
        sizes = [n * k for n, k in phases]
        self.weights = torch.empty(sum(sizes), device=device, dtype=dtype)
        start = 0
        for (_, k), size in zip(phases, sizes, strict=True):  # outputs of about unit size
            self.weights[start : start + size].normal_(0, k**-0.5, generator=generator)
            start += size
        # Activations start on 128-byte lines of their own (see `_chain_kernel`).
        lengths = [phases[0][1]] + [n for n, _ in phases]
        slot = [-(-length // ACT_ALIGN) * ACT_ALIGN for length in lengths]
        self.acts = torch.empty(sum(slot), device=device, dtype=dtype)
        meta, w_at, x_at, y_at = [], 0, 0, slot[0]
        for size, length in zip(sizes, slot[1:], strict=True):
            meta.append((w_at, x_at, y_at))
            w_at, x_at, y_at = w_at + size, y_at, y_at + length
        meta.append((0, 0, 0))  # read as "the next weights" by the last phase's hint
        if any(row[0] % 8 for row in meta):
            raise ValueError("every weight must start on a 16-byte boundary")
        self.meta = torch.tensor(meta, dtype=torch.int64, device=device)
        self.offsets = meta  # the same on the host: read while a CUDA graph captures
        self.phases = phases
        self.counters = torch.zeros(len(phases) + 1, dtype=torch.int32, device=device)

    def weight(self, i: int) -> torch.Tensor:
        n, k = self.phases[i]
        start = self.offsets[i][0]
        return self.weights[start : start + n * k].view(n, k)

    def view(self, i: int, which: int) -> torch.Tensor:
        """Phase i's input (which=1, K elements) or output (which=2, N elements)."""
        n, k = self.phases[i]
        start = self.offsets[i][which]
        return self.acts[start : start + (k if which == 1 else n)]

    def reset(self, seed: int) -> None:
        """A fresh input, and every output NaN (a phase that reads before the write shows)."""
        self.acts.fill_(float("nan"))
        generator = torch.Generator(device=self.acts.device).manual_seed(seed)
        self.view(0, 1).normal_(generator=generator)

    def arguments(
        self, programs: int, tiles: Tiles, barriers: bool = True
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
        """`_chain_kernel`'s arguments: positional, then its constexprs and launch options."""
        return (
            (self.weights, self.acts, self.meta, self.counters),
            {
                "SHAPES": self.shapes,
                "LAYERS": self.layers,
                "PROGRAMS": programs,
                "BLOCK_N": tiles.block_n,
                "BLOCK_K": tiles.block_k,
                "LOOP_STAGES": tiles.stages,
                "PREFETCH_LINES": tiles.prefetch_lines,
                "BARRIERS": barriers,
                "COUNTER_BLOCK": triton.next_power_of_2(len(self.phases) + 1),
                "num_warps": tiles.warps,
            },
        )

    def launch(self, programs: int, tiles: Tiles, barriers: bool = True) -> None:
        args, constants = self.arguments(programs, tiles, barriers)
        _chain_kernel[(programs,)](*args, **constants)

    def phases_within_bound(self) -> list[bool]:
        """Each phase's output against an fp64 oracle of the input it read: within an ulp of
        the output (its rounding) + 4 sqrt(K) fp32 epsilons of sum |x w| (the fp32 sum's
        order)."""
        ulp = torch.finfo(self.weights.dtype).eps
        verdicts = []
        for i, (_, k) in enumerate(self.phases):
            x, w = self.view(i, 1).double(), self.weight(i).double()
            oracle = w @ x
            bound = ulp * oracle.abs() + 4 * math.sqrt(k) * 2**-23 * (w.abs() @ x.abs())
            got = self.view(i, 2).double()
            verdicts.append(
                bool(torch.isfinite(got).all() and ((got - oracle).abs() <= bound).all())
            )
        return verdicts


def resident_per_sm(compiled, warps: int) -> int:
    """Programs of `compiled` one SM holds at once (registers, shared memory, threads)."""
    try:
        compiled._init_handles()
        registers_each, shared_each = compiled.n_regs, compiled.metadata.shared
    except (AttributeError, RuntimeError):  # this Triton keeps them elsewhere: one a SM fits
        return 1
    properties = torch.cuda.get_device_properties(0)
    registers = getattr(properties, "regs_per_multiprocessor", 65536)
    shared = getattr(properties, "shared_memory_per_multiprocessor", 228 * 1024)
    per_warp = -(-registers_each * 32 // 256) * 256  # allocated 256 registers at a time
    by_registers = registers // (per_warp * warps)
    by_shared = shared // (shared_each + 1024) if shared_each else 32
    return min(by_registers, by_shared, 2048 // (32 * warps), 32)


def replay_micros(step: Callable[[], object], replays: int = 20) -> float:
    """µs of one replay of a CUDA graph of `step`, median of `replays`."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def model_rows(name: str, bandwidth: float) -> list[str]:
    from hearth.ops.gemv import gemv_triton, has_pinned_launch

    chain = Chain(MODELS[name], LAYERS, torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    floor = chain.weights.nbytes / bandwidth * 1e6 / LAYERS
    rows = []

    def row(label: str, micros: float, check: str) -> None:
        rows.append(f"| {name} | {label} | {micros:.1f} | {floor / micros:.1%} | {check} |")
        print(rows[-1], flush=True)

    def separate() -> None:
        """As `models.gemma.project` runs them: qkv and gate/up (phases 0 and 2) on cuBLAS
        unless a GEMV launch is pinned for their shape, the rest on the GEMV."""
        x = chain.view(0, 1).view(1, -1)
        for i, (_, k) in enumerate(chain.phases):
            x, w = x[:, :k], chain.weight(i)
            wide = i % len(chain.shapes) in (0, 2)
            x = gemv_triton(x, w) if not wide or has_pinned_launch(x, w) else F.linear(x, w)

    row("a launch per GEMV, as the decode step runs them", replay_micros(separate) / LAYERS, "-")

    def persistent(tiles: Tiles) -> float | None:
        """µs per layer of the checked persistent launch; None if it failed or cannot run."""
        programs = tiles.per_sm * sms
        args, constants = chain.arguments(programs, tiles)
        compiled = _chain_kernel.warmup(*args, grid=(programs,), **constants)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # async
        resident = resident_per_sm(compiled, tiles.warps)
        if resident < tiles.per_sm:  # a barrier would wait forever for programs not started
            row(f"persistent, {tiles.label()}", float("nan"), f"skipped: {resident}/SM fit")
            return None
        verdicts = []
        for seed in (1, 2):
            chain.reset(seed)
            chain.launch(programs, tiles)
            torch.cuda.synchronize()
            verdicts += chain.phases_within_bound()
        check = "ok" if all(verdicts) else f"FAILED {verdicts.count(False)} of {len(verdicts)}"
        micros = replay_micros(lambda: chain.launch(programs, tiles)) / LAYERS
        row(f"persistent, {tiles.label()}", micros, check)
        return micros if check == "ok" else None

    timed = [(persistent(tiles), tiles) for tiles in SWEEP]
    ran = [(micros, tiles) for micros, tiles in timed if micros is not None]
    if ran:
        best = min(ran, key=lambda pair: pair[0])[1]
        for lines in PREFETCH_SWEEP:
            persistent(dataclasses.replace(best, prefetch_lines=lines))
    for tiles in SWEEP[:2]:
        programs = tiles.per_sm * sms
        micros = replay_micros(lambda t=tiles, p=programs: chain.launch(p, t, False)) / LAYERS
        row(f"streaming only (no barriers: wrong values), {tiles.label()}", micros, "-")
    return rows


def main() -> None:
    from gpu_gemv_bf16 import write_table
    from hearth.bench.measure import copy_bandwidth

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = [row for name in args.models.split(",") for row in model_rows(name, bandwidth)]
    write_table(
        "gpu_persistent_chain.md",
        "A chain of dependent GEMVs: a launch each, or one persistent kernel",
        [
            f"{LAYERS} layers of each model's decode GEMVs, bf16, one row; µs per layer "
            f"(CUDA-graph replay, median of 20) and the share of the floor (weight bytes at "
            f"{bandwidth / 1e12:.2f} TB/s, a 1 GiB copy in the same run). Check: every phase "
            "of two persistent runs against fp64 (see the script).",
            "",
            "| model | how | µs per layer | of the floor | check |",
            "|---|---|---|---|---|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
