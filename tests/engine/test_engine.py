"""Engine precision choices, and the int8 opt-in path against the exact fp32 one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hearth
from hearth.engine import resolve_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("fmt", "device", "dtype", "quantize", "expected", "stored"),
    [
        ("safetensors", CPU, None, "auto", (torch.bfloat16, None), torch.bfloat16),
        ("safetensors", CPU, torch.float32, "auto", (torch.float32, None), torch.bfloat16),
        ("safetensors", CUDA, None, "auto", (torch.float16, None), torch.float16),
        # A GGUF file on the CPU keeps its blocks as stored (fp32 unless a dtype is given);
        # the int8 re-grid only when asked for.
        ("gguf", CPU, None, "auto", (torch.float32, "stored"), None),
        ("gguf", CPU, torch.bfloat16, "auto", (torch.bfloat16, "stored"), None),
        ("gguf", CPU, torch.float32, "auto", (torch.float32, "stored"), None),
        ("gguf", CPU, None, "int8", (torch.bfloat16, "int8"), None),
        # On a GPU too, computed by the Triton block kernels in bf16; "none" dequantizes.
        ("gguf", CUDA, None, "auto", (torch.bfloat16, "stored"), None),
        ("gguf", CUDA, None, "none", (torch.bfloat16, None), None),
        ("safetensors", CPU, None, "auto", (torch.float32, None), torch.float32),
        ("safetensors", CPU, None, "int4", (torch.bfloat16, "int4"), None),
        ("gguf", CPU, None, "none", (torch.float32, None), None),
        # float16 overflows Gemma's activations: a float16 checkpoint computes in fp32 on the
        # CPU (an exact widening), and float16 asked for is refused (below).
        ("safetensors", CPU, None, "auto", (torch.float32, None), torch.float16),
    ],
)
def test_resolve_precision(
    fmt: str,
    device: torch.device,
    dtype: Any,
    quantize: str,
    expected: tuple[torch.dtype, str | None],
    stored: torch.dtype | None,
) -> None:
    assert resolve_precision(fmt, device, dtype, quantize, stored) == expected


def test_float16_compute_on_the_cpu_is_refused() -> None:
    """The 270M's residual stream passes float16's 65504 at layer 7 and decodes <pad> from
    NaN logits: refused before anything loads."""
    with pytest.raises(ValueError, match="float16 overflows Gemma's activations"):
        resolve_precision("gguf", CPU, torch.float16, "none")
    with pytest.raises(ValueError, match="float16 overflows"):
        hearth.load(dtype="float16", device="cpu", progress=False)


def test_quantize_with_a_float32_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="computes in bfloat16"):
        resolve_precision("gguf", CPU, torch.float32, "int8")
    with pytest.raises(ValueError, match="unknown quantize"):
        resolve_precision("gguf", CPU, None, "int3")


@pytest.fixture(scope="module")
def int8_engine(embedded_gguf: Path) -> Any:
    return hearth.load(embedded_gguf, device="cpu", progress=False, quantize="int8")


def test_int8_cpu_engine_keeps_weights_int8(int8_engine: Any, hearth_270m: Any) -> None:
    """int8 weights + int8 tied table: about 1 byte per weight instead of 4."""
    assert int8_engine.model.compute_dtype == torch.bfloat16
    assert int8_engine.weight_bytes_per_token() < 0.3 * hearth_270m.weight_bytes_per_token()


def test_int8_engine_stays_close_to_fp32(int8_engine: Any, hearth_270m: Any) -> None:
    """Mean KL(fp32 || int8) over 256 tokens of English below 0.02 nats.

    Requantizing the GGUF blocks to int8 per row and computing in bf16 measured 0.007 over
    1024 tokens (docs/benchmarks.md); 0.02 leaves room for the shorter text while a wrong
    scale, layout or kernel gives KL above 1.
    """
    text = Path("/usr/share/common-licenses/GPL-3").read_text()[:3000]
    ids = torch.tensor([hearth_270m.tokenizer.encode(text)[:256]])
    with torch.inference_mode():
        exact = hearth_270m.model(ids).float().log_softmax(-1)
        fast = int8_engine.model(ids).float().log_softmax(-1)
    kl = (exact.exp() * (exact - fast)).sum(-1).mean().item()
    assert kl < 0.02
    assert int8_engine.generate(
        "The capital of France is Paris. The capital of Germany is", max_tokens=3
    ).startswith(" Berlin")


def test_loading_a_model_leaves_torch_dynamo_unimported() -> None:
    """A model is built on the meta device before its checkpoint fills it; nn.Embedding's
    normal_ init there imports torch._dynamo, a second of a CPU load (the embedded model's
    load 2.65 -> 1.6 s with the string-array reader, `cpu_270m_load-2026-12-05.md`). The
    import is what the test observes."""
    code = (
        "import sys, hearth; from hearth.embedded import embedded_model_path; "
        "hearth.load(str(embedded_model_path())); print('torch._dynamo' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "False", result.stderr[-2000:]
