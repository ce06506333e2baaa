"""`hearth bench` on tiny random models (CPU), its roofline arithmetic checked by hand, and
random-weight GGUF files read back by Hearth (and llama.cpp, when installed)."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hearth.bench import measure
from hearth.bench.concurrency import percentile
from hearth.bench.llama_peer import cpu_has_amx, open_llama
from hearth.bench.measure import kv_bytes, prefill_flops
from hearth.bench.random_gguf import (
    GGUF_TYPES,
    embedded_tokenizer,
    random_tensors,
    write_random_gguf,
)
from hearth.bench.report import COLUMNS
from hearth.checkpoint import open_checkpoint
from hearth.checkpoint.gguf_writer import minimal_tokenizer, tokenizer_metadata
from hearth.checkpoint.safetensors import split_expert_parts
from hearth.cli import main
from hearth.config import parse_config
from hearth.kv import parse_kv_quant
from hearth.models.loading import build_model
from tiny import TINY_VOCAB, tiny_gemma3_config, tiny_gemma4_config

BANDWIDTH = PEAK = 1e9  # round numbers make the roofline columns easy to check


def _config_file(directory: Path, config: Any, name: str = "config.json") -> Path:
    path = directory / name
    path.write_text(json.dumps(config.to_dict()))
    return path


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run `hearth bench ARGS` in this process: exit code, stdout, stderr."""
    try:
        code = main(["bench", *args])
    except SystemExit as exit_:  # argparse errors
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _table(text: str, columns: tuple[str, ...] = COLUMNS) -> list[dict[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert tuple(header) == columns
    return [
        dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        for line in lines[1:]
    ]


_PREFIX = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def _si(cell: str) -> float:
    match = re.fullmatch(r"([\d.]+) ([kMGT]?)(B|FLOP)", cell)
    assert match, cell
    return float(match[1]) * _PREFIX[match[2]]


def _number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


# ---------------------------------------------------------------------------------------------
# Roofline arithmetic, by hand for the tiny Gemma 3 config: hidden 64, MLP 96, 4 layers
# (sliding, full, sliding, full; window 8), 4 query heads and 2 KV heads of 32, vocab 256.

LAYER_MATRICES = 128 * 64 + 2 * (64 * 64) + 64 * 128 + 3 * (96 * 64)  # q, k, v, o, MLP
LAYER_NORMS = 4 * 64 + 2 * 32  # four sandwich norms, q_norm, k_norm: kept in fp32
TABLE = 256 * 64  # tied: also the head


def hand_decode_bytes(context: int) -> int:
    """bf16 matrices, fp32 norms, then 2 (K and V) x 2 heads x 32 x 2 bytes per token seen."""
    weights = 4 * (2 * LAYER_MATRICES + 4 * LAYER_NORMS) + 2 * TABLE + 4 * 64
    seen = 2 * min(context, 8) + 2 * context
    return weights + 2 * 2 * 32 * 2 * seen


def hand_prefill_flops(tokens: int) -> int:
    """One chunk: every token through the layers, the head on the last one; attention sums
    the keys each query sees (positions 0..t-1: t+1 keys, at most 8 on sliding layers)."""
    matmuls = 2 * (4 * LAYER_MATRICES * tokens + TABLE)
    full = sum(p + 1 for p in range(tokens))
    sliding = sum(min(p + 1, 8) for p in range(tokens))
    return matmuls + 4 * 4 * 32 * 2 * (full + sliding)


def test_roofline_helpers_match_the_hand_computation() -> None:
    config = parse_config(tiny_gemma3_config().to_dict())
    assert kv_bytes(config, 16, 2) == hand_decode_bytes(16) - hand_decode_bytes(0)
    assert prefill_flops(config, 16) == hand_prefill_flops(16)
    # Chunks of 4: the head runs once per chunk, attention still sees every earlier key.
    assert prefill_flops(config, 16, chunk=4) == hand_prefill_flops(16) + 2 * 3 * TABLE


def test_kv_bytes_follow_the_cache_layout() -> None:
    """TurboQuant k8v3 at head_dim 32 in bf16, per token and KV head (docs/kv-cache.md):
    keys 32 B of codes + one group's bf16 scale and bias (4 B); values 12 B of 3-bit codes
    + one fp16 σ (2 B). A decode at 16 reads 8 tokens on sliding layers, 16 on full ones."""
    config = parse_config(tiny_gemma3_config().to_dict())
    per_token_and_head = (32 + 4) + (12 + 2)
    seen = 2 * 8 + 2 * 16
    expected = per_token_and_head * 2 * seen  # 2 KV heads
    assert kv_bytes(config, 16, 2, parse_kv_quant("turbo:k8v3")) == expected
    assert kv_bytes(config, 16, 2, parse_kv_quant("off")) == kv_bytes(config, 16, 2)


def test_bench_random_tiny_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config_file(tmp_path, tiny_gemma3_config())
    out = tmp_path / "table.md"
    code, stdout, stderr = _bench(
        capsys,
        *("--random", str(config), "--device", "cpu", "--contexts", "16,32"),
        *("--prefill", "8,16", "--steps", "2", "--hf", "--out", str(out)),
        *("--bandwidth", str(BANDWIDTH), "--peak-flops", str(PEAK)),
    )
    assert code == 0, stderr
    assert out.read_text() == stdout
    assert "torch " in stdout and "triton " in stdout and "CPU" in stdout
    assert "bench: decode at context 16" in stderr  # progress goes to stderr
    rows = _table(stdout)
    phases = [(row["phase"], int(row["tokens"])) for row in rows]
    assert phases == [
        ("decode", 16),
        ("decode", 32),
        ("prefill", 8),
        ("prefill", 16),
        ("first token", 8),
        ("HF decode", 16),
        ("HF prefill", 8),
    ]
    for row in rows:
        assert _number(row["ms"]) > 0
        if row["phase"] != "first token":
            assert _number(row["tok/s"]) > 0
    for row in rows[:4]:
        tokens = int(row["tokens"])
        if row["phase"] == "decode":
            work = hand_decode_bytes(tokens)
            roofline = BANDWIDTH / work  # steps per second
        else:
            work = hand_prefill_flops(tokens)
            roofline = tokens * PEAK / work
        assert _si(row["work"]) == pytest.approx(work, rel=1e-3)  # 4 significant digits
        assert _number(row["roofline tok/s"]) == pytest.approx(roofline, abs=0.05)
        share = _number(row["tok/s"]) / roofline * 100
        # Both cells are rounded for display: the share to 0.1 (±0.05), and tok/s to its last
        # printed digit, which moves the recomputed share by half that digit / roofline.
        speed = row["tok/s"].replace(",", "")
        digit = 10.0 ** -len(speed.split(".")[1]) if "." in speed else 1.0
        bound = 0.05 + digit / 2 / roofline * 100 + 1e-9
        assert abs(_number(row["of roofline"]) - share) <= bound
    assert "Hearth / HF transformers: decode" in stdout


CONCURRENCY_COLUMNS = (
    "streams",
    "aggregate tok/s",
    "x 1 stream",
    "decode tok/s, all streams",
    "per-stream decode tok/s",
    "first token p50 / p99 ms",
    "roofline tok/s",
    "decode of roofline",
)


def test_bench_concurrency_reports_each_level_against_its_roofline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--concurrency 1,3`: one row per level; the roofline at c streams is c steps' worth of
    tokens in the time one step takes to read the weights once and each stream's K/V at its
    mean context (8 prompt + 4 new tokens: 10), by hand for the tiny config."""
    config = _config_file(tmp_path, tiny_gemma3_config())
    code, stdout, stderr = _bench(
        capsys,
        *("--random", str(config), "--device", "cpu", "--concurrency", "1,3"),
        *("--prompt-tokens", "8", "--new-tokens", "4", "--bandwidth", str(BANDWIDTH)),
    )
    assert code == 0, stderr
    assert "bench: 3 streams" in stderr
    # The pool holds the three at once: each level says so, and what sized it.
    assert "at most 3 rows a step, 0 preemptions, pool of blocks of" in stderr
    rows = _table(stdout, CONCURRENCY_COLUMNS)
    assert [int(row["streams"]) for row in rows] == [1, 3]
    weights, kv = hand_decode_bytes(0), hand_decode_bytes(10) - hand_decode_bytes(0)
    for row in rows:
        streams = int(row["streams"])
        roofline = streams * BANDWIDTH / (weights + streams * kv)
        assert _number(row["roofline tok/s"]) == pytest.approx(roofline, abs=0.5)  # integer
        aggregate = _number(row["aggregate tok/s"])
        assert aggregate > 0 and _number(row["per-stream decode tok/s"]) > 0
        assert _number(row["decode tok/s, all streams"]) > 0  # some steps decoded all streams
        p50, p99 = (_number(cell) for cell in row["first token p50 / p99 ms"].split(" / "))
        assert 0 <= p50 <= p99
    assert rows[0]["x 1 stream"] == "1.00x"


def test_percentile_is_the_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99
    assert percentile([4, 1, 3, 2], 0.5) == 2 and percentile([7.0], 0.99) == 7.0


def test_bench_decodes_over_a_quantized_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config_file(tmp_path, tiny_gemma3_config())
    code, stdout, stderr = _bench(
        capsys,
        *("--random", str(config), "--device", "cpu", "--contexts", "16"),
        *("--prefill", "8", "--steps", "2", "--kv-quant", "off,turbo:k8v3,turbo:k8v3@full"),
    )
    assert code == 0, stderr
    assert "KV cache off, turbo:k8v3, turbo:k8v3@full" in stdout
    dense, turbo, full_only = _table(stdout)[:3]
    assert "KV off " in dense["path"] and "KV turbo:k8v3 " in turbo["path"]
    assert _number(turbo["tok/s"]) > 0
    assert _si(turbo["work"]) < _si(dense["work"])  # the same weights, fewer KV bytes
    # KV memory in the path, by hand: the tiny model's layers at 16 tokens of context.
    config_dict = tiny_gemma3_config().to_dict()
    # The random model computes in bf16 (2-byte K/V); the path prints 3 significant
    # digits, so values agree to 5e-3 relative.
    per_layer_dense = 2 * config_dict["num_key_value_heads"] * config_dict["head_dim"] * 2
    windows = [
        min(16, config_dict["sliding_window"]) if kind == "sliding_attention" else 16
        for kind in config_dict["layer_types"]
    ]
    dense_bytes = sum(per_layer_dense * tokens for tokens in windows)
    assert float(dense["path"].split("KV off ")[1].split(" MiB")[0]) == pytest.approx(
        dense_bytes / 2**20, rel=5e-3
    )
    # @full: sliding layers dense, full layers k8v3: per KV head and token, 8-bit key codes
    # plus a bf16 scale and bias per 32, 3-bit value codes plus an fp16 sigma per 32.
    dim = config_dict["head_dim"]
    per_head = dim + 2 * 2 * (dim // 32) + dim * 3 // 8 + 2 * (dim // 32)
    per_layer_turbo = config_dict["num_key_value_heads"] * per_head
    full_bytes = sum(
        (per_layer_turbo if kind == "full_attention" else per_layer_dense) * tokens
        for kind, tokens in zip(config_dict["layer_types"], windows, strict=True)
    )
    assert float(
        full_only["path"].split("KV turbo:k8v3@full ")[1].split(" MiB")[0]
    ) == pytest.approx(full_bytes / 2**20, rel=5e-3)
    code, _, stderr = _bench(capsys, "--random", str(config), "--kv-quant", "k9")
    assert code == 2 and "unknown --kv-quant 'k9'" in stderr


def test_roofline_probes_count_their_bytes_and_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes' arithmetic by hand, with the clock replaced: a copy of N bytes moves 2N
    (read and write), a square matmul of size n does 2 n^3 FLOPs."""
    calls: list[int] = []

    def fake_timed(device: torch.device, work: Any) -> float:
        calls.append(len(work()))  # how many copies or matmuls one timing ran
        return 0.5

    monkeypatch.setattr(measure, "timed", fake_timed)
    cpu = torch.device("cpu")
    assert measure.copy_bandwidth(cpu, repeats=3) == 2 * 2**28 * 3 / 0.5
    assert measure.matmul_peak(cpu, torch.bfloat16, repeats=2) == 2 * 1024**3 * 2 / 0.5
    assert calls == [3, 2, 2, 2]  # one copy timing; the matmul's best of three


def test_bench_measures_its_rooflines_unless_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --bandwidth and --peak-flops the percentages are of this machine's own copy
    and matmul speed, and the table says so; a given one is used as given."""
    config = _config_file(tmp_path, tiny_gemma3_config())
    args = ("--random", str(config), "--device", "cpu", "--contexts", "16", "--prefill", "8")
    code, stdout, stderr = _bench(capsys, *args, "--steps", "2")
    assert code == 0, stderr
    match = re.search(
        r"rooflines at ([\d.]+) ([TG])B/s \(measured copy\) and ([\d.]+) ([TG])FLOP/s "
        r"\(measured bfloat16 matmul\)",
        stdout,
    )
    assert match, stdout
    prefix = {"T": 1e12, "G": 1e9}
    bandwidth = float(match[1]) * prefix[match[2]]
    peak = float(match[3]) * prefix[match[4]]
    assert "bench: copy bandwidth" in stderr and "matmul peak" in stderr
    decode, prefill = _table(stdout)[:2]
    # The note prints 3 (bandwidth) and 4 (peak) significant digits, so the columns agree
    # with it to half a unit of the last digit: 5e-3 and 5e-4 relative.
    assert _number(decode["roofline tok/s"]) == pytest.approx(
        bandwidth / hand_decode_bytes(16), rel=5e-3
    )
    assert _number(prefill["roofline tok/s"]) == pytest.approx(
        8 * peak / hand_prefill_flops(8), rel=5e-4
    )
    code, stdout, stderr = _bench(capsys, *args, "--steps", "2", "--bandwidth", str(BANDWIDTH))
    assert code == 0, stderr
    assert "rooflines at 1 GB/s (given) and " in stdout
    assert "(measured bfloat16 matmul)" in stdout and "copy bandwidth" not in stderr


@pytest.mark.parametrize("context", [5, 20])  # within and past the sliding window of 8
def test_filled_static_and_dynamic_caches_decode_alike(context: int) -> None:
    """Random K/V written into the graph decoder's static caches and into the eager loop's
    dynamic ones (same draws) give the same next-step logits: positions, ring slots and
    counters are set as a prefill would set them. fp32: summation order only (5e-5)."""
    from hearth.bench.measure import fill_caches
    from hearth.bench.random_model import build_random_model
    from hearth.kv import make_caches
    from hearth.kv.cache import LayerCache

    model = build_random_model(tiny_gemma3_config().to_dict(), "cpu", dtype=torch.float32)
    dynamic = make_caches(model.cache_specs())
    static = [LayerCache.pinned_at(64, spec.window) for spec in model.cache_specs()]
    for caches in (dynamic, static):
        torch.manual_seed(1)
        fill_caches(caches, model, context - 1)
    token = torch.tensor([[7]])
    with torch.inference_mode():
        eager = model(token, dynamic, start=context - 1)
        graphed = model(token, static, start=torch.tensor(context - 1))
    torch.testing.assert_close(graphed, eager, rtol=0, atol=5e-5)
    assert static[1].offset == context


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph path needs a GPU")
def test_bench_on_gpu_decodes_through_cuda_graphs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config_file(tmp_path, tiny_gemma3_config())
    code, stdout, stderr = _bench(
        capsys,
        *("--random", str(config), "--device", "cuda", "--contexts", "16,250"),
        *("--prefill", "8,300", "--steps", "12", "--hf"),  # 250 + 12 crosses a 256 bucket
    )
    assert code == 0, stderr
    rows = _table(stdout)
    # The path cell names the decode path, then the KV cache's size ("CUDA graph, KV 1 MiB").
    paths = [row["path"].split(",")[0] for row in rows if row["phase"] == "decode"]
    assert paths == ["CUDA graph"] * 2
    # Each prompt is one chunk: timed from the graph of its bucket (captured in the warm-up),
    # even where the bucket is longer than the decoder's caches (300 tokens, 301 positions).
    prefills = [row["path"] for row in rows if row["phase"] == "prefill"]
    assert prefills == ["CUDA graph, padded to 64", "CUDA graph, padded to 512"]
    assert all(_number(row["tok/s"]) > 0 for row in rows if row["tok/s"])


def test_a_moe_step_of_more_rows_reads_the_experts_they_choose() -> None:
    """Tiny Gemma 4 MoE (fp32, 4 layers of 4 experts, top 2, each expert 3 x 64 x 32 values): a
    step's expert bytes are E x (1 - (1 - k / E)^rows) experts' worth under uniform routing,
    a half at one row, 3/4 at two and 7/8 at three; the rest of the weights is read once
    whatever the rows."""
    from hearth.bench.random_model import build_random_model

    config = tiny_gemma4_config(
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
    )
    model = build_random_model(config.to_dict(), "cpu", dtype=torch.float32)
    experts = 4 * 4 * 3 * 64 * 32 * 4  # layers x experts x values an expert x fp32 bytes
    one, two, three = (measure.decode_bytes(model, rows) for rows in (1, 2, 3))
    assert two - one == experts // 4
    assert three - two == experts // 8
    assert measure.decode_bytes(model, 64) - one == pytest.approx(experts / 2, abs=8)


def test_bench_random_gemma4_moe_4bit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """MLX-packed random weights on every path Gemma 4 adds: MoE, PLE, KV sharing."""
    gemma4 = tiny_gemma4_config(
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=2,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=64,
    )
    config = _config_file(tmp_path, gemma4)
    code, stdout, stderr = _bench(
        capsys,
        *("--random", str(config), "--quant", "4bit", "--device", "cpu"),
        *("--contexts", "12", "--prefill", "10", "--steps", "2"),
    )
    assert code == 0, stderr
    assert "MLXQuantizedLinear weights" in stdout
    assert [row["phase"] for row in _table(stdout)] == ["decode", "prefill", "first token"]


# ---------------------------------------------------------------------------------------------
# Random GGUF files

# llama.cpp's fixed Gemma 3 layout: every 6th layer full, attention scale 1/sqrt(head_dim).
# The file keeps rms_norm_eps in float32: 2^-20 reads back as it was written.
GGUF_SHAPES = {
    "num_hidden_layers": 6,
    "layer_types": None,
    "query_pre_attn_scalar": 32,
    "rms_norm_eps": 2**-20,
}


class MemoryCheckpoint:
    """Canonical tensors held in memory, through the same loader as files."""

    format = "memory"
    stored_dtype = torch.float32

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.path = Path("memory")
        self.config = config
        self._tensors = tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensors(
        self, dtype: torch.dtype | None = None, skip: Collection[str] = ()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((name, t) for name, t in self._tensors.items() if name not in skip)


# Every Gemma 4 feature at once: per-layer inputs, KV sharing in llama.cpp's donor order
# (sliding, then full, before the sharers), k_eq_v full layers and 3-D experts in whole blocks.
GEMMA4_GGUF_SHAPES = {
    "hidden_size": 256,  # rows of whole Q4_K blocks
    "hidden_size_per_layer_input": 8,
    "num_hidden_layers": 6,
    "num_kv_shared_layers": 2,
    "layer_types": [
        *["sliding_attention"] * 3,
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "rms_norm_eps": 2**-20,
}


def _needs_gguf_writer() -> None:
    """The writer takes the `gguf` package (a dependency, so CI has it); the GPU machine's
    bare environment lacks it, and skips what writes a file there."""
    pytest.importorskip("gguf")


RANDOM_CONFIGS = {
    "gemma3": lambda: tiny_gemma3_config(**GGUF_SHAPES).to_dict(),
    "gemma4": lambda: tiny_gemma4_config(**GEMMA4_GGUF_SHAPES).to_dict(),
}


@pytest.mark.parametrize("family", list(RANDOM_CONFIGS))
@pytest.mark.parametrize("ggml_type", GGUF_TYPES)
def test_random_gguf_round_trips_through_the_loader(
    ggml_type: str, family: str, tmp_path: Path
) -> None:
    """The file's logits equal those of the same random tensors given from memory, exactly:
    both are fp32 models of the same values (the file's dequantized by the reader)."""
    _needs_gguf_writer()
    config = RANDOM_CONFIGS[family]()
    path, written = write_random_gguf(
        tmp_path / "tiny.gguf", config, minimal_tokenizer(TINY_VOCAB), ggml_type, seed=3
    )
    parsed = parse_config(written)
    stacked = {t.name: t.values() for t in random_tensors(parsed, ggml_type, seed=3)}
    tensors = dict(
        part for name, tensor in stacked.items() for part in split_expert_parts(name, tensor)
    )
    from_file = build_model(open_checkpoint(path), torch.float32, progress=False)
    from_memory = build_model(MemoryCheckpoint(written, tensors), torch.float32, progress=False)  # type: ignore[arg-type]
    assert from_file.config == from_memory.config
    ids = torch.randint(0, len(TINY_VOCAB), (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(from_file(ids), from_memory(ids), rtol=0, atol=0)


@pytest.fixture(scope="module")
def gemma3_tokenizer() -> dict[str, Any]:
    return embedded_tokenizer()


@pytest.fixture(scope="module")
def tiny_gguf_with_tokenizer(
    tmp_path_factory: pytest.TempPathFactory, gemma3_tokenizer: dict[str, Any]
) -> Path:
    """Tiny widths, Gemma 3's real tokenizer (262144 tokens: a 17 MB Q8_0 file)."""
    _needs_gguf_writer()
    config = tiny_gemma3_config(**GGUF_SHAPES).to_dict()
    path = tmp_path_factory.mktemp("gguf") / "tiny-real-vocab.gguf"
    return write_random_gguf(path, config, gemma3_tokenizer, "Q8_0")[0]


def test_random_gguf_carries_the_tokenizer(
    tiny_gguf_with_tokenizer: Path, gemma3_tokenizer: dict[str, Any]
) -> None:
    """Every tokenizer field, typed as llama.cpp reads them (the test below tokenizes with
    it; test_bench_times_a_gguf_file loads it through Hearth's tokenizer)."""
    checkpoint = open_checkpoint(tiny_gguf_with_tokenizer)
    assert tokenizer_metadata(checkpoint.metadata) == gemma3_tokenizer  # type: ignore[attr-defined]
    assert checkpoint.config["vocab_size"] == 262144  # the token count, not a padded 262208
    assert checkpoint.config["hidden_size"] == 64


def test_bench_times_a_gguf_file(
    tiny_gguf_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stdout, stderr = _bench(
        capsys,
        *(str(tiny_gguf_with_tokenizer), "--device", "cpu"),
        *("--contexts", "16", "--prefill", "8", "--steps", "2"),
    )
    assert code == 0, stderr
    assert "tiny-real-vocab.gguf (gguf)" in stdout
    assert [row["phase"] for row in _table(stdout)] == ["decode", "prefill", "first token"]


def test_llama_cpp_reads_the_random_gguf(tiny_gguf_with_tokenizer: Path) -> None:
    """Same tokens, and last-position logits within llama.cpp's own rounding (it computes
    Q8_0 dot products against 8-bit activations: ~1% of the logit scale here)."""
    pytest.importorskip("llama_cpp")
    llama = open_llama(tiny_gguf_with_tokenizer, n_ctx=64, logits_all=True, verbose=False)
    ids = llama.tokenize(b"Hello world")
    assert ids == [2, 9259, 1902]  # "<bos>Hello world" in Gemma 3's vocabulary
    llama.eval(ids)
    theirs = np.array(llama.scores[len(ids) - 1])
    model = build_model(open_checkpoint(tiny_gguf_with_tokenizer), torch.float32, progress=False)
    with torch.inference_mode():
        ours = model(torch.tensor([ids]))[0, -1].numpy()
    assert np.abs(ours - theirs).max() < 0.05 * np.abs(ours).max()


def test_cpu_has_amx_reads_the_flags(tmp_path: Path) -> None:
    """The flags line of /proc/cpuinfo, as a Sapphire Rapids Xeon and an EPYC print it."""
    xeon, epyc, missing = tmp_path / "xeon", tmp_path / "epyc", tmp_path / "none"
    xeon.write_text(
        "flags\t\t: fpu avx512_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8\n"
    )
    epyc.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert cpu_has_amx(xeon) and not cpu_has_amx(epyc) and not cpu_has_amx(missing)


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2


def _assert_one_line_error(code: int, stderr: str, needle: str) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("hearth: error: ") and needle in lines[0], lines[0]


def test_bad_inputs_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(_config_file(tmp_path, tiny_gemma3_config()))  # 512 positions at most
    (tmp_path / "broken.json").write_text("{not json")
    cpu = ("--device", "cpu")
    cases = [
        (("--random", "gemma9-1b", *cpu), "neither a preset"),
        (("--random", str(tmp_path / "broken.json"), *cpu), "not a JSON config"),
        (("--random", str(tmp_path / "absent"), *cpu), "neither a preset"),
        (("--random", config, "--contexts", "1000", *cpu), "exceeds the model's maximum"),
        (("--random", config, "--prefill", "600", *cpu), "exceeds the model's maximum"),
        (("--random", config, "--contexts", "1", *cpu), "at least 2"),
        (("--random", config, "--contexts", "16,x", *cpu), "positive integers"),
        (("--random", config, "--steps", "0", *cpu), "positive integer"),
        (("--random", config, "--quant", "3bit", *cpu), "invalid choice"),
        (("--random", config, "--out", str(tmp_path / "no" / "t.md"), *cpu), "does not exist"),
        ((config, "--random", config, *cpu), "not both"),
        ((str(tmp_path / "missing.gguf"), *cpu), "does not exist"),
        (("--random", config, "--concurrency", "0,4", *cpu), "positive integers"),
        (("--random", config, "--concurrency", "2", "--prompt-tokens", "600", *cpu), "exceed"),
        (("--random", config, "--device", "tpu"), "cpu or cuda"),
    ]
    if not torch.cuda.is_available():
        cases.append((("--random", config, "--device", "cuda"), "no CUDA device"))
    for args, needle in cases:
        _assert_one_line_error(*_bench(capsys, *args)[::2], needle)


def test_quant_applies_only_to_random_models(
    tiny_gguf_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, stderr = _bench(capsys, str(tiny_gguf_with_tokenizer), "--quant", "4bit")
    _assert_one_line_error(code, stderr, "--quant applies to --random")
