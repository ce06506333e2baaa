"""Model architectures: one file per family."""

from hearth.models.gemma import Gemma3Model
from hearth.models.gemma4 import Gemma4Model

Model = Gemma3Model | Gemma4Model  # what the generate loop, engine and loader handle

__all__ = ["Gemma3Model", "Gemma4Model", "Model"]
