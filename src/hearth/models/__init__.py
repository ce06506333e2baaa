"""Model architectures: one file per family, built from `hearth.layers`."""

from hearth.config import Gemma3Config, ModelConfig
from hearth.kv.cache import CacheSpec
from hearth.models.gemma3 import Gemma3Model
from hearth.models.gemma4 import Gemma4Model

Model = Gemma3Model | Gemma4Model  # what the runner, engine and loader handle


def model_class(config: ModelConfig) -> type[Model]:
    return Gemma3Model if isinstance(config, Gemma3Config) else Gemma4Model


def cache_specs(config: ModelConfig) -> list[CacheSpec]:
    """The caches a model of `config` declares (`Model.cache_specs`), without building it."""
    return model_class(config).specs_for(config)


__all__ = ["Gemma3Model", "Gemma4Model", "Model", "cache_specs", "model_class"]
