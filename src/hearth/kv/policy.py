"""`--kv-quant off|4|8|config|turbo[:SCHEME]` as a cache factory for `make_caches`.

* off: dense caches.
* 4, 8: MLX affine at that width (group `group_size`) on every layer.
* config: per-layer affine from the checkpoint's kv_config.json, a list of
  {"layer_idx", "bits", "group_size"}; layers it does not list stay dense.
* turbo[:SCHEME]: TurboQuant (default k8v3) on every layer.
* any of 4, 8, turbo[:SCHEME] followed by `@full`: only full-attention layers are quantized;
  sliding-window layers keep their window dense. Their memory is bounded by the window
  (Gemma 3 12B at 32k: 40 sliding layers hold 1,024 tokens each, 8 full ones 32,768), so
  leaving them exact costs little memory and spares their attention the decode work.

A prompt's first chunk attends over its exact K/V and is stored quantized right after it.
`KVPolicy.check` rejects a head_dim a layout cannot store, so a bad choice fails at start,
not at the first token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hearth.kv.cache import CacheSpec, LayerCache, make_caches
from hearth.quant.kv_codecs import DENSE, AffineCodec, KVCodec
from hearth.quant.turbo import DEFAULT_SCHEME, TurboCodec

KV_CONFIG_FILE = "kv_config.json"
UNIFORM_BITS = {"4": 4, "8": 8}
DEFAULT_GROUP_SIZE = 64
CHOICES = (
    "off, 4, 8, config, turbo or turbo:SCHEME (k8v4, k8v3, k4v3, t4v3, k8v2), "
    "the quantized ones optionally followed by @full"
)
FULL_LAYERS_ONLY = "@full"


@dataclass(frozen=True)
class KVPolicy:
    """The codec of each layer's cache: `per_layer` entries, else `codec`."""

    codec: KVCodec = DENSE
    per_layer: Mapping[int, KVCodec] = field(default_factory=dict)
    sliding_dense: bool = False  # `@full`: sliding-window layers keep dense K/V

    def codec_of(self, layer: int, window: int | None = None) -> KVCodec:
        if self.sliding_dense and window is not None:
            return DENSE
        return self.per_layer.get(layer, self.codec)

    @property
    def is_dense(self) -> bool:
        """Every layer stores plain K/V (`--kv-quant off`)."""
        return self.codec is DENSE and not self.per_layer

    def __call__(self, spec: CacheSpec) -> LayerCache:
        codec = self.codec_of(spec.index, spec.window)
        try:
            codec.check_head_dim(spec.head_dim)
        except ValueError as error:
            raise ValueError(f"--kv-quant on layer {spec.index}: {error}") from None
        return LayerCache(spec.window, codec)

    def check(self, specs: Sequence[CacheSpec]) -> None:
        """Raise ValueError if some layer's head_dim cannot be stored in its layout."""
        for spec in specs:
            self(spec)

    def make_caches(self, specs: Sequence[CacheSpec]) -> list[LayerCache]:
        return make_caches(specs, self)


def parse_kv_quant(
    choice: str,
    checkpoint: Path | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> KVPolicy:
    """The policy named by a `--kv-quant` value; ValueError with the valid forms otherwise."""
    base = choice.removesuffix(FULL_LAYERS_ONLY)
    if base != choice:
        if base in ("off", "config"):
            raise ValueError(f"--kv-quant {choice!r}: {FULL_LAYERS_ONLY} goes after 4, 8 or turbo")
        policy = parse_kv_quant(base, checkpoint, group_size)
        return replace(policy, sliding_dense=True)
    kind, _, scheme = choice.partition(":")
    if choice == "off":
        return KVPolicy()
    if choice in UNIFORM_BITS:
        codec = AffineCodec(UNIFORM_BITS[choice], group_size)
        return KVPolicy(codec)
    if choice == "config":
        per_layer = read_kv_config(checkpoint)
        return KVPolicy(per_layer=per_layer)
    if kind == "turbo" and (scheme or choice == "turbo"):
        return KVPolicy(TurboCodec.parse(scheme or DEFAULT_SCHEME))
    raise ValueError(f"unknown --kv-quant {choice!r}; expected {CHOICES}")


def read_kv_config(checkpoint: Path | None) -> dict[int, KVCodec]:
    """Per-layer affine codecs from `<checkpoint>/kv_config.json`."""
    if checkpoint is None or not (checkpoint / KV_CONFIG_FILE).is_file():
        raise ValueError(f"--kv-quant config needs a {KV_CONFIG_FILE} in the checkpoint directory")
    path = checkpoint / KV_CONFIG_FILE
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of {{layer_idx, bits, group_size}}")
    return dict(_kv_config_entry(entry, path) for entry in entries)


def _kv_config_entry(entry: Any, path: Path) -> tuple[int, KVCodec]:
    try:
        return int(entry["layer_idx"]), AffineCodec(int(entry["bits"]), int(entry["group_size"]))
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: bad entry {entry!r} ({error})") from None
