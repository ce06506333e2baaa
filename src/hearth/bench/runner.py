"""`hearth bench`: build or load the model, run every measurement, collect the report."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearth.bench.concurrency import ConcurrencyReport, measure_concurrency
from hearth.bench.measure import (
    copy_bandwidth,
    decode_bytes,
    kv_bytes,
    matmul_peak,
    prefill_flops,
    release,
    time_decode,
    time_first_token,
    time_prefill,
)
from hearth.bench.random_model import QUANT_BITS, build_random_model, resolve_config
from hearth.bench.report import (
    DECODE,
    FIRST_TOKEN,
    HF_DECODE,
    HF_PREFILL,
    PREFILL,
    BenchReport,
    Row,
)
from hearth.config import ModelConfig, parse_config
from hearth.devices import parse_device
from hearth.errors import HearthError
from hearth.kv import parse_kv_quant
from hearth.models import Model
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.runner import ModelRunner
from hearth.tokenizer import Tokenizer


@dataclass(frozen=True)
class BenchOptions:
    model: str | None = None  # a checkpoint path; None with `random` None: the embedded model
    random: str | None = None  # a preset name or a config.json path
    quant: str | None = None  # bf16 | 8bit | 4bit, for random models only
    contexts: Sequence[int] = (512, 8192, 32768)
    prefill: Sequence[int] = (512, 4096, 32768)
    steps: int = 32
    hf: bool = False
    device: str | None = None
    # The rooflines' memory bandwidth (B/s) and matmul peak (FLOP/s); None: measured on the
    # device before the run (`copy_bandwidth`, `matmul_peak`), so a percentage is of the
    # machine that ran it. The H200 figures are 4.2e12 and 790e12.
    bandwidth: float | None = None
    peak_flops: float | None = None
    kv_quant: Sequence[str] = ("off",)  # KV cache layouts decode runs over (`--kv-quant`)
    # `--concurrency`: streams run together at each level, instead of the batch-1 table.
    concurrency: Sequence[int] = ()
    prompt_tokens: int = 512
    new_tokens: int = 128


@dataclass
class _Subject:
    """What is benchmarked: a name for the title, its config dict, and how to build it."""

    name: str
    config: dict[str, Any]
    build: Callable[[], Model]
    tokenizer: Callable[[], Tokenizer]


def _check_fit(options: BenchOptions, device: torch.device, longest: int) -> None:
    """On a CPU, refuse a run the memory cannot hold before anything is allocated (the
    allocator's failure or the OOM killer would end it midway), by `hearth fit`'s count of
    `longest` tokens of K/V."""
    if device.type != "cpu":
        return
    from hearth.fit import plan_fit

    fit = plan_fit(
        options.model, longest, device=device, random=options.random, quant=options.quant
    )
    if not fit.fits:
        gb = 1e9
        raise HearthError(
            f"{fit.model.name} needs {fit.needed_bytes / gb:.3g} GB on the CPU (weights "
            f"{fit.weight_bytes / gb:.3g} GB, KV cache at {longest:,} tokens "
            f"{fit.kv_bytes / gb:.3g} GB, runtime {fit.runtime_bytes / gb:.3g} GB), over the "
            f"{fit.memory_bytes / gb:.3g} GB this machine allows (`hearth fit` says more): "
            "try --quant 4bit, shorter lengths or fewer streams, or a GPU"
        )


def _subject(options: BenchOptions, device: torch.device) -> _Subject:
    if options.random is not None:
        if options.model is not None:
            raise HearthError("give either MODEL or --random CONFIG, not both")
        quant = options.quant or "bf16"
        if quant not in QUANT_BITS:
            raise HearthError(f"--quant {quant!r}: choose from {', '.join(QUANT_BITS)}")
        config = resolve_config(options.random)
        name = f"{options.random} (random weights, {quant})"
        return _Subject(
            name, config, lambda: build_random_model(config, device, quant), _embedded_tokenizer
        )
    if options.quant is not None:
        raise HearthError("--quant applies to --random models; a checkpoint keeps its weights")
    from hearth.checkpoint import open_checkpoint
    from hearth.embedded import embedded_model_path
    from hearth.engine import Engine

    path = Path(options.model) if options.model else embedded_model_path()
    checkpoint = open_checkpoint(path)

    def load() -> Model:
        return Engine.load(path, device=device, progress=False).model

    name = f"{path.name} ({checkpoint.format})"
    return _Subject(name, checkpoint.config, load, checkpoint.tokenizer)


def _embedded_tokenizer() -> Tokenizer:
    """A random model's text goes through the embedded model's tokenizer (Gemma's 262,144
    entries), as `hearth generate --random` does."""
    from hearth.checkpoint import open_checkpoint
    from hearth.embedded import embedded_model_path

    return open_checkpoint(embedded_model_path()).tokenizer()


def _check_lengths(config: ModelConfig, options: BenchOptions) -> None:
    limit = config.max_position_embeddings
    for context in options.contexts:
        if context < 2:  # the decode loops continue from a filled cache, as after a prefill
            raise HearthError(f"context {context}: decode needs a context of at least 2")
        if context - 1 + options.steps > limit:
            raise HearthError(
                f"context {context} plus {options.steps} decode steps exceeds the model's "
                f"maximum of {limit} positions (give smaller --contexts or --steps)"
            )
    for tokens in options.prefill:
        if tokens > limit:
            raise HearthError(
                f"prefill length {tokens} exceeds the model's maximum of {limit} positions"
            )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _precision(model: Model) -> str:
    kinds = {type(m).__name__ for m in model.modules()}
    packed = [k for k in ("MLXQuantizedLinear", "Int8Linear", "Int4Linear") if k in kinds]
    weights = f", {packed[0]} weights" if packed else ""
    return f"computes in {_dtype_name(model.compute_dtype)}{weights}"


@dataclass(frozen=True)
class Rooflines:
    """The bandwidth (B/s) and matmul peak (FLOP/s) a run's percentages are of, and whether
    each was measured on the device or given by the user."""

    bandwidth: float
    peak_flops: float
    bandwidth_measured: bool
    peak_measured: bool

    def note(self, dtype: torch.dtype) -> str:
        copy = "measured copy" if self.bandwidth_measured else "given"
        peak = "measured" if self.peak_measured else "given"
        return (
            f"rooflines at {_rate(self.bandwidth, 'B/s', 3)} ({copy}) and "
            f"{_rate(self.peak_flops, 'FLOP/s', 4)} ({peak} {_dtype_name(dtype)} matmul)"
        )


def _rate(value: float, unit: str, digits: int) -> str:
    """`value` with a T or G prefix (a GPU's rates read in T, a CPU's in G)."""
    scale, prefix = (1e12, "T") if value >= 1e12 else (1e9, "G")
    return f"{value / scale:.{digits}g} {prefix}{unit}"


def _rooflines(
    options: BenchOptions,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str], None],
) -> Rooflines:
    """The rooflines `options` gives, the rest measured on `device`."""
    bandwidth, peak = options.bandwidth, options.peak_flops
    if bandwidth is None:
        bandwidth = copy_bandwidth(device)
        progress(f"bench: copy bandwidth {_rate(bandwidth, 'B/s', 3)}")
    if peak is None:
        peak = matmul_peak(device, dtype)
        progress(f"bench: {_dtype_name(dtype)} matmul peak {_rate(peak, 'FLOP/s', 4)}")
    release(device)
    return Rooflines(bandwidth, peak, options.bandwidth is None, options.peak_flops is None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_bench(options: BenchOptions, progress: Callable[[str], None]) -> BenchReport:
    """Every measurement of `options`; `progress` receives a line per step."""
    if not options.contexts or not options.prefill:
        raise HearthError("--contexts and --prefill need at least one length each")
    device = parse_device(options.device)
    subject = _subject(options, device)
    config = parse_config(subject.config)
    _check_lengths(config, options)
    _check_fit(options, device, max(*options.contexts, *options.prefill))
    progress(f"bench: building {subject.name} on {device}")
    model = subject.build()
    rooflines = _rooflines(options, device, model.compute_dtype, progress)
    report = BenchReport(
        model=f"{subject.name}, {_precision(model)}",
        date=datetime.date.today().isoformat(),
        device=_device_name(device),
        versions=f"torch {torch.__version__}, triton {_version('triton')}",
        settings=(
            f"batch 1, {options.steps} decode steps per context, KV cache "
            f"{', '.join(options.kv_quant)}, prefill in chunks of "
            f"{ExecutionPlan.for_device(device).prefill_chunk}; "
            f"{rooflines.note(model.compute_dtype)}"
        ),
    )
    _measure_hearth(model, config, options, rooflines, report, progress)
    del model
    release(device)
    if options.hf:
        _measure_hf(subject.config, options, device, report, progress)
    return report


def run_concurrency_bench(
    options: BenchOptions, progress: Callable[[str], None]
) -> ConcurrencyReport:
    """`options.concurrency`'s levels of streams run together, each measured."""
    if not options.concurrency or min(options.concurrency) < 1:
        raise HearthError("--concurrency needs stream counts of at least 1")
    device = parse_device(options.device)
    subject = _subject(options, device)
    config = parse_config(subject.config)
    per_stream = options.prompt_tokens + options.new_tokens
    if per_stream > config.max_position_embeddings:
        raise HearthError(
            f"{options.prompt_tokens} prompt plus {options.new_tokens} new tokens exceed the "
            f"model's maximum of {config.max_position_embeddings} positions"
        )
    _check_fit(options, device, max(options.concurrency) * per_stream)
    progress(f"bench: building {subject.name} on {device}")
    model = subject.build()
    tokenizer = subject.tokenizer()
    bandwidth = options.bandwidth
    if bandwidth is None:
        bandwidth = copy_bandwidth(device)
        progress(f"bench: copy bandwidth {_rate(bandwidth, 'B/s', 3)}")
    runner = ModelRunner(model)
    source = "measured copy" if options.bandwidth is None else "given"
    report = ConcurrencyReport(
        model=f"{subject.name}, {_precision(model)}",
        date=datetime.date.today().isoformat(),
        device=_device_name(device),
        settings=(
            f"torch {torch.__version__}. Each stream: {options.prompt_tokens} prompt tokens "
            f"(random ids), {options.new_tokens} new tokens, greedy; streams start together. "
            f"Roofline: weights read once per step (a MoE's experts: those its rows choose, "
            f"routed uniformly) plus each stream's K/V, at "
            f"{_rate(bandwidth, 'B/s', 3)} ({source})."
        ),
    )
    report.rows = measure_concurrency(
        runner,
        tokenizer,
        config,
        options.concurrency,
        options.prompt_tokens,
        options.new_tokens,
        bandwidth,
        progress,
    )
    return report


def _measure_hearth(
    model: Model,
    config: ModelConfig,
    options: BenchOptions,
    rooflines: Rooflines,
    report: BenchReport,
    progress: Callable[[str], None],
) -> None:
    weights = decode_bytes(model)
    element = torch.empty((), dtype=model.compute_dtype).element_size()
    layouts = list(options.kv_quant)
    for layout in layouts:
        policy = parse_kv_quant(layout)
        runner = ModelRunner(model, kv_policy=policy)
        for context in options.contexts:
            seconds, path = time_decode(runner, context, options.steps)
            kv = kv_bytes(config, context, element, policy)
            layout_name = f"KV {layout} " if layouts != ["off"] else "KV "
            mib = kv / 2**20
            path += (
                f", {layout_name}{mib:.0f} MiB" if mib >= 100 else f", {layout_name}{mib:.3g} MiB"
            )
            work = weights + kv
            row = Row(DECODE, context, seconds, path, work, work / rooflines.bandwidth)
            report.rows.append(row)
            progress(f"bench: decode at context {context}: {1 / seconds:,.1f} tok/s ({path})")
    runner = ModelRunner(model)
    for tokens in options.prefill:
        seconds, path = time_prefill(runner, tokens)
        work = prefill_flops(config, tokens, runner.plan.prefill_chunk)
        row = Row(PREFILL, tokens, seconds, path, work, work / rooflines.peak_flops)
        report.rows.append(row)
        progress(f"bench: prefill of {tokens}: {tokens / seconds:,.1f} tok/s")
    first = options.prefill[0]
    seconds = time_first_token(runner, first)
    report.rows.append(Row(FIRST_TOKEN, first, seconds, "prefill + greedy sample"))
    progress(f"bench: first token after {first}: {seconds * 1e3:,.1f} ms")


def _measure_hf(
    config: dict[str, Any],
    options: BenchOptions,
    device: torch.device,
    report: BenchReport,
    progress: Callable[[str], None],
) -> None:
    from hearth.bench.hf import HFUnavailable, build_hf_model, time_hf_decode, time_hf_prefill

    try:
        progress("bench: building the HF transformers model")
        hf = build_hf_model(config, device)
    except HFUnavailable as error:
        note = f"HF transformers skipped: {error}."
        progress(f"bench: {note}")
        report.notes.append(note)
        return
    path = f"transformers {_version('transformers')}, bf16"
    context, tokens = options.contexts[0], options.prefill[0]
    decode = time_hf_decode(hf, context, options.steps, device)
    report.rows.append(Row(HF_DECODE, context, decode, path))
    progress(f"bench: HF decode at context {context}: {1 / decode:,.1f} tok/s")
    prefill = time_hf_prefill(hf, tokens, device)
    report.rows.append(Row(HF_PREFILL, tokens, prefill, path))
    progress(f"bench: HF prefill of {tokens}: {tokens / prefill:,.1f} tok/s")
    del hf
    release(device)
    ours_decode, ours_prefill = report.row(DECODE, context), report.row(PREFILL, tokens)
    assert ours_decode is not None and ours_prefill is not None
    report.notes.append(
        f"Hearth / HF transformers: decode {decode / ours_decode.seconds:.2f}x at context "
        f"{context}, prefill {prefill / ours_prefill.seconds:.2f}x at {tokens} tokens."
    )
