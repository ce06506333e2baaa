"""The execution plan: every choice of how to run the model on this device, in one place.

A plan is built once when a model loads (`ExecutionPlan.for_device`), printed by
`hearth inspect --plan` and `/stats`, and read by the layers and the runner; nothing else
chooses a path. Where a kernel exists for a device (Triton on CUDA, the native C library on an
x86-64 CPU) it runs: that is a fact of the device, not a choice. What is chosen here is how
those kernels are combined: whole decode layers in one native call, CUDA graphs, padded
prefill graphs and their buckets, the chunk a prompt is prefilled in.

An A/B measurement builds two plans (`dataclasses.replace`) and runs one runner with each.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from hearth.ops import HAS_TRITON
from hearth.ops import native as native_kernels
from hearth.ops.native import bf16_gemm, huge_pages

# Batch sizes with a batched-decode graph each (`runtime.batch_graphs`): a step of B rows
# replays the smallest bucket holding B, its spare rows padding.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Padded prompt lengths with a prefill graph each; half steps past 512 keep the padding
# under a third of the prompt where it costs GPU time.
PREFILL_BUCKETS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)

# GGUF block types (GGML ids) whose decode GEMV runs on AVX512-BF16 where the CPU has it:
# Q4_K and Q6_K, the types where it measured faster than the fp32 one; Q4_0, Q5_0 and Q8_0
# have the kernel too. On by default: its mean KL against HF fp32 is ~60x below HF bf16's and
# its greedy tokens are HF fp32's (benchmarks/results/cpu_bf16dot-2026-12-07.md).
# ``HEARTH_GGUF_BF16=0`` keeps fp32 activations.
BF16_GEMV_TYPES = (12, 14)
BF16_GEMV_VARIABLE = "HEARTH_GGUF_BF16"
# Decode rows from which the GGUF head runs on AMX tiles (where the CPU has them).
AMX_HEAD_ROWS = 6


@dataclass(frozen=True)
class ExecutionPlan:
    """How a model runs on one device. Fields that do not apply to the device are off."""

    device: str
    # CPU: the native C kernels (int8/bf16 rows, norm, RoPE and attention glue, argmax).
    native_kernels: bool = False
    # CPU: a bf16 decode step as one native call per decoder layer (`runtime.native_step`).
    native_layers: bool = False
    # CPU: bf16 products as fp32 GEMMs, where the CPU has no bf16 matmul instructions.
    bf16_matmul_as_fp32: bool = False
    # CPU: the weights a decode step streams loaded into transparent huge pages.
    huge_pages: bool = False
    # CPU: GGUF block types (GGML ids) whose decode GEMV rounds its activations to bf16 and sums
    # with the bf16 dot-product instructions, the weights still the file's exact values (where
    # the CPU has AVX512-BF16, unless ``HEARTH_GGUF_BF16=0``; prefill GEMMs stay fp32).
    gguf_bf16_gemv_types: tuple[int, ...] = ()
    # CPU: GGUF block types (GGML ids) whose prefill GEMM (more rows than a decode GEMV takes)
    # runs on AMX bf16 tiles (`NativeKernels.blocks_gemm_amx`): the weights the file's exact
    # values, the activations split into two bf16 halves (~16 significant bits) unless
    # `gguf_amx_bf16_inputs`, which rounds them to one bf16 (faster, less faithful). Set where
    # the CPU has AMX-BF16 (benchmarks/results/cpu_amx_prefill-2026-12-07.md); else the tiled
    # fp32 GEMM.
    gguf_amx_prefill_types: tuple[int, ...] = ()
    gguf_amx_bf16_inputs: bool = False
    # CPU: a decode step of at least this many rows (0: none) runs the tied GGUF output head on
    # AMX bf16 tiles, its input rounded to bf16 as the oracle's bf16 rounds it (the weights
    # exact): from ~6 rows the fp32 GEMV over the 262144-row head is compute-bound
    # (benchmarks/results/cpu_amx_head-2026-12-07.md). Set with `gguf_amx_prefill_types`,
    # unless ``HEARTH_GGUF_BF16=0`` (or ``--dtype float32``) keeps fp32 activations.
    gguf_amx_head_rows: int = 0
    # GGUF blocks kept as stored computed by the Triton block kernels (`ops.gguf_matmul`), not
    # the torch/native CPU path: on CUDA (CPU tests take it under Triton's interpreter).
    gguf_block_kernels: bool = False
    # CUDA: decode steps replayed from CUDA graphs over static caches.
    cuda_graphs: bool = False
    # CUDA: a fresh one-chunk prompt prefilled from a graph per padded length (`buckets`).
    prefill_graphs: bool = False
    # CUDA: a prompt-cache hit's new tokens prefilled from a graph per padded length too.
    continuation_graphs: bool = False
    prefill_buckets: tuple[int, ...] = PREFILL_BUCKETS
    # Full-attention caches expose their keys in views of whole buckets (a decode graph each).
    view_bucket: int = 256
    # A graph decoder replacing the runner's idle one, too small for its request, takes this
    # many times its slots: a growing conversation then captures anew a logarithmic number of
    # times, not every turn.
    decoder_growth: int = 2
    # A decode step of several sequences on a paged pool (the scheduler's) as one forward
    # reading each sequence's blocks through its block table (`runtime.batch_graphs`),
    # replayed from a CUDA graph per batch-size bucket where `cuda_graphs`; off: their K/V
    # gathered side by side under a block-diagonal mask (`SequenceBatch`), or the native step.
    paged_batch_decode: bool = False
    batch_buckets: tuple[int, ...] = BATCH_BUCKETS
    # Prompt tokens per forward: large chunks keep a GPU's matrix units busy; on a CPU they
    # would spill the caches for no gain.
    prefill_chunk: int = 512

    @classmethod
    def for_device(cls, device: torch.device | str) -> ExecutionPlan:
        """The default plan of `device`: every kernel that runs there, combined as measured
        fastest (docs/benchmarks.md)."""
        device = torch.device(device)
        if device.type == "cuda":
            graphs = HAS_TRITON
            return cls(
                "cuda",
                gguf_block_kernels=HAS_TRITON,
                cuda_graphs=graphs,
                prefill_graphs=graphs,
                continuation_graphs=graphs,
                paged_batch_decode=True,
                prefill_chunk=4096,
            )
        kernels = native_kernels.kernels()
        native = kernels is not None
        bf16_inputs = os.environ.get(BF16_GEMV_VARIABLE, "1") != "0"
        bf16_gemv = ()
        if kernels is not None and bf16_inputs:
            bf16_gemv = tuple(t for t in BF16_GEMV_TYPES if t in kernels.bf16_gemv_types)
        amx_prefill = tuple(sorted(kernels.amx_gemm_types)) if kernels is not None else ()
        amx_head = bf16_inputs and bool(amx_prefill) and device.type == "cpu"
        return cls(
            device.type,
            native_kernels=native,
            native_layers=native,
            gguf_bf16_gemv_types=bf16_gemv,
            gguf_amx_prefill_types=amx_prefill if device.type == "cpu" else (),
            gguf_amx_head_rows=AMX_HEAD_ROWS if amx_head else 0,
            bf16_matmul_as_fp32=device.type == "cpu" and bf16_gemm.widen_bf16_products(),
            huge_pages=device.type == "cpu" and huge_pages.enabled(),
        )

    def describe(self) -> str:
        """One `field: value` line per field, for `hearth inspect --plan`."""
        width = max(len(name) for name in asdict(self))
        return "\n".join(f"{name:<{width}}  {value}" for name, value in asdict(self).items())
