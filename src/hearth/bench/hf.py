"""HF transformers at the same shapes, random bf16 weights, in the same process: the peer.

HF runs as users run it without compilation: its default attention, a dynamic cache, one
forward call per decode step (greedy, token fed back on the device).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hearth.bench.measure import WARMUP_STEPS, release, timed

# model_type of the text config -> (transformers config class, model class)
_CLASSES = {
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
}
# Fields Hearth's configs may carry that describe storage, not the architecture.
_DROPPED = ("model_type", "quantization", "quantization_config", "architectures")


class HFUnavailable(Exception):
    """transformers cannot build this model here (missing, too old, or refuses the config)."""


def _text_fields(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    model_type = str(config.get("model_type"))
    if model_type in ("gemma3", "gemma4") and isinstance(config.get("text_config"), dict):
        text = dict(config["text_config"])
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
        return f"{model_type}_text", text
    return model_type, dict(config)


def build_hf_model(config: dict[str, Any], device: torch.device) -> Any:
    """An HF causal LM of `config` in bf16 with its own random init, on `device`."""
    try:
        import transformers
    except ImportError:
        raise HFUnavailable("transformers is not installed") from None
    model_type, fields = _text_fields(config)
    names = _CLASSES.get(model_type)
    if names is None or not hasattr(transformers, names[1]):
        raise HFUnavailable(f"transformers {transformers.__version__} has no {model_type} model")
    config_class, model_class = (getattr(transformers, name) for name in names)
    fields = {key: value for key, value in fields.items() if key not in _DROPPED}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return model_class(config_class(**fields)).eval()
    except (TypeError, ValueError, KeyError) as error:
        raise HFUnavailable(f"transformers refuses the config: {error}") from None
    finally:
        torch.set_default_dtype(previous)


def _ids(model: Any, count: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, count), device=device)


@torch.inference_mode()
def time_hf_decode(model: Any, context: int, steps: int, device: torch.device) -> float:
    """Seconds per greedy decode step after a prefill of `context - 1` tokens."""
    output = model(_ids(model, max(context - 1, 1), device), use_cache=True, logits_to_keep=1)
    # transformers renamed `past_key_values` to `cache` (both exist across 5.x releases).
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else None
    keyword = keyword or "past_key_values"
    cache = output.get(keyword)
    token = output.logits[:, -1:].argmax(-1)

    def run(count: int) -> None:
        nonlocal token
        for _ in range(count):
            out = model(token, use_cache=True, **{keyword: cache})
            token = out.logits[:, -1:].argmax(-1)

    run(WARMUP_STEPS)
    seconds = timed(device, lambda: run(steps)) / steps
    release(device)
    return seconds


@torch.inference_mode()
def time_hf_prefill(model: Any, tokens: int, device: torch.device) -> float:
    """Seconds of one forward over `tokens` tokens (HF prefills in one piece), after a warm-up."""
    ids = _ids(model, tokens, device)
    model(ids, use_cache=True, logits_to_keep=1)
    seconds = timed(device, lambda: model(ids, use_cache=True, logits_to_keep=1))
    release(device)
    return seconds
