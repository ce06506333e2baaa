"""`hearth fit` against real loads: the weights it sizes from headers alone (the loader run on
the meta device) equal, to the byte, what `Engine.load` holds with the same options, for each
kind of checkpoint and conversion; its context and exit code against hand-derived values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hearth.cli import EXIT_USAGE, main
from hearth.engine import Engine
from hearth.fit import plan_fit
from hearth.ops.plan import ExecutionPlan
from test_gemma4_gguf import _write, files  # noqa: F401
from test_mlx_checkpoints import _convert, _mixed_bits, _uneven_parts, tied, untied  # noqa: F401


def _loaded_weight_bytes(path: Path, **options: Any) -> int:
    return Engine.load(path, device="cpu", progress=False, **options).weight_bytes_per_token()


@pytest.mark.parametrize(
    "options",
    [{}, {"quantize": "int8"}, {"dtype": "float32", "quantize": "none"}, {"quantize": "int4"}],
    ids=["stored-auto", "int8", "float32", "int4"],
)
def test_a_gguf_files_weights_as_a_cpu_load_holds_them(
    embedded_gguf: Path, options: dict[str, str], request: pytest.FixtureRequest
) -> None:
    fit = plan_fit(embedded_gguf, context=512, memory_gb=100, device="cpu", **options)
    if options == {"dtype": "float32", "quantize": "none"}:
        # conftest's `hearth_270m` is that load (the same options): not another 1 GB of it.
        loaded = request.getfixturevalue("hearth_270m").weight_bytes_per_token()
    else:
        loaded = _loaded_weight_bytes(embedded_gguf, **options)
    assert fit.weight_bytes == loaded


def test_hf_and_mlx_checkpoints_weights_as_a_load_holds_them(
    tied: Path,  # noqa: F811
    untied: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    mixed = _convert(tied, tmp_path / "mixed", "float32", _mixed_bits)  # packed, 4/6/8 bits
    uneven = _convert(untied, tmp_path / "uneven", "float32", _uneven_parts)  # some unpacked
    cases = [(tied, {}), (tied, {"dtype": "bfloat16"}), (tied, {"quantize": "int8"})]
    cases += [(mixed, {}), (uneven, {})]
    for path, options in cases:
        fit = plan_fit(path, context=64, memory_gb=100, device="cpu", **options)
        assert fit.weight_bytes == _loaded_weight_bytes(path, **options), (path, options)


def test_the_cli_answers_with_the_longest_context_and_its_exit_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The embedded 270M in fp32, with 50 MB over what it holds at any context (weights,
    runtime, workspace): beside them, 15 sliding rings of 512 slots (2048 bytes of fp32 K/V
    and an 8-byte position each) and 3 full layers of 2048 bytes a token, grown 256 tokens
    at a time."""
    fixed = plan_fit(context=4096, memory_gb=100, device="cpu", dtype="float32").fixed_bytes
    memory = (fixed + 50_000_000) / 1e9
    cpu = ["--device", "cpu", "--dtype", "float32", "--memory", f"{memory:.9f}"]
    assert main(["fit", *cpu, "--context", "4096"]) == 0
    out = capsys.readouterr().out
    room = round(memory * 1e9) - fixed
    longest = (room - 15 * 512 * 2056) // (3 * 2048) // 256 * 256
    assert f"longest context that fits: {longest:,} tokens" in out
    assert "needed: " in out and ": fits" in out
    assert main(["fit", *cpu, "--context", str(longest + 1)]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(["fit", *cpu, "--context", "32768", "--bandwidth", "20"]) == 1
    assert "tok/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--context", "40000"], "past the model's 32768 positions"),
        pytest.param(
            ["--device", "cuda"],
            "give --memory",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="measures the GPU's"),
        ),
        (["--kv-quant", "5"], "--kv-quant"),
    ],
)
def test_bad_requests_are_one_line_and_exit_2(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fit", *arguments]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


@pytest.mark.parametrize("name", ["ple_sharing_double_wide", "moe"])
def test_gemma4_gguf_weights_as_a_cpu_load_holds_them(
    files: Any,  # noqa: F811
    name: str,
    tmp_path: Path,
) -> None:
    """Per-layer inputs, KV sharing and experts, stored Q8_0: int8 on the CPU, or fp32."""
    _, directory, _ = files(name)
    path = _write(directory, tmp_path / f"{name}.gguf", "Q8_0")
    for options in ({}, {"dtype": "float32"}):
        fit = plan_fit(path, context=64, memory_gb=100, device="cpu", **options)
        assert fit.weight_bytes == _loaded_weight_bytes(path, **options), options


def test_a_gguf_file_on_a_gpu_is_sized_as_its_blocks(
    files: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A GPU fit counts the blocks the Triton block kernels keep on the device, as a load
    under a plan with those kernels holds them (here on the CPU; nothing runs)."""
    _, directory, _ = files("ple_sharing_double_wide")
    path = _write(directory, tmp_path / "ple.gguf", "Q8_0")
    fit = plan_fit(path, context=64, memory_gb=100, device="cuda")
    assert fit.weights == "as-stored GGUF" and fit.dtype == torch.bfloat16
    plan = dataclasses.replace(ExecutionPlan.for_device("cpu"), gguf_block_kernels=True)
    engine = Engine.load(path, device="cpu", dtype="bfloat16", progress=False, plan=plan)
    assert fit.weight_bytes == engine.weight_bytes_per_token()


@pytest.mark.parametrize("quant", ["bf16", "4bit"])
def test_a_random_model_as_bench_builds_it(quant: str, tmp_path: Path) -> None:
    """`--random CONFIG --quant`: the meta-sized model against the same model built with
    random weights on the CPU."""
    from hearth.bench.random_model import build_random_model
    from tiny import tiny_gemma4_config

    config = tiny_gemma4_config(hidden_size=128, intermediate_size=256).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    fit = plan_fit(random=str(path), quant=quant, context=64, memory_gb=1, device="cpu")
    built = build_random_model(json.loads(path.read_text()), "cpu", quant)
    assert fit.weight_bytes == sum(tensor.nbytes for tensor in built.state_dict().values())
    assert fit.weights == ("bfloat16" if quant == "bf16" else "MLX 4-bit")


def test_a_model_over_the_memory_leaves_no_context(capsys: pytest.CaptureFixture[str]) -> None:
    """1.1 GB holds the int8 weights, the runtime and the workspace (1.01 GB), not the load's
    peak (1.32 GB): an int8 load widens each tensor to bf16 before packing it."""
    assert main(["fit", "--device", "cpu", "--quantize", "int8", "--memory", "1.1"]) == 1
    out = capsys.readouterr().out
    assert "loading: +0.336 GB at its peak" in out  # the 262144 x 640 table, in bf16
    assert "none, the model alone is over" in out
