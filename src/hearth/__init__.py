"""Hearth: a local LLM runtime on PyTorch.

import hearth
engine = hearth.load()                      # the embedded Gemma 3 270M
print(engine.generate("The capital of France is", max_tokens=20))
for chunk in engine.stream("Once upon a time"):
    print(chunk.text, end="", flush=True)
schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
print(engine.generate("The largest city", constraint=hearth.OutputConstraint.json_schema(schema)))
"""

from hearth.engine import Engine, GenerationRequest
from hearth.errors import CheckpointError, HearthError
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.constraints import ConstraintError, OutputConstraint
from hearth.runtime.generate import GenerationChunk, GenerationStats, stream_generate
from hearth.runtime.sampling import SamplingParams

load = Engine.load

__all__ = [
    "CheckpointError",
    "ConstraintError",
    "Engine",
    "ExecutionPlan",
    "GenerationChunk",
    "GenerationRequest",
    "GenerationStats",
    "HearthError",
    "OutputConstraint",
    "SamplingParams",
    "load",
    "stream_generate",
]
__version__ = "0.1.0"
