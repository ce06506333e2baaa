"""Hearth: a local LLM runtime on PyTorch.

import hearth
engine = hearth.load()                      # the embedded Gemma 3 270M
print(engine.generate("The capital of France is", max_tokens=20))
for chunk in engine.stream("Once upon a time"):
    print(chunk.text, end="", flush=True)
"""

from hearth.engine import Engine, GenerationRequest
from hearth.errors import CheckpointError, HearthError
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.generate import GenerationChunk, GenerationStats, stream_generate
from hearth.runtime.sampling import SamplingParams

load = Engine.load

__all__ = [
    "CheckpointError",
    "Engine",
    "ExecutionPlan",
    "GenerationChunk",
    "GenerationRequest",
    "GenerationStats",
    "HearthError",
    "SamplingParams",
    "load",
    "stream_generate",
]
__version__ = "0.1.0"
