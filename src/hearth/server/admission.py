"""`--memory-budget`: refuse, before it runs, a request whose KV cache would not fit beside the
model's weights."""

from __future__ import annotations

from dataclasses import dataclass

from hearth.engine import Engine
from hearth.kv.footprint import KVFootprint
from hearth.server.errors import RequestError

BYTES_PER_GB = 10**9
OVER_BUDGET = "context_over_budget"


@dataclass(frozen=True)
class MemoryBudget:
    budget_bytes: int
    weight_bytes: int
    # Each layer's K/V as its cache allocates them: sliding layers their window, full layers
    # every token, in the layout --kv-quant chose.
    kv: KVFootprint
    max_context: int  # the model's positions: no request goes past them

    @classmethod
    def for_engine(cls, engine: Engine, gigabytes: float) -> MemoryBudget:
        config = engine.model.config
        return cls(
            round(gigabytes * BYTES_PER_GB),
            engine.weight_bytes_per_token(),  # every weight tensor once: the weights' footprint
            KVFootprint.of(
                engine.model.cache_specs(), engine.model.compute_dtype, engine.kv_policy
            ),
            config.max_position_embeddings,
        )

    def needed_bytes(self, tokens: int) -> int:
        return self.weight_bytes + self.kv.bytes_at(tokens)

    def kv_token_capacity(self) -> int:
        """The longest context (at most the model's) whose K/V fit beside the weights."""
        return self.kv.longest_context(self.budget_bytes - self.weight_bytes, self.max_context)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise a 400 if the prompt plus `max_tokens` of reply cannot fit the budget."""
        tokens = prompt_tokens + max_tokens
        needed = self.needed_bytes(tokens)
        if needed > self.budget_bytes:
            raise RequestError(
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} need "
                f"{_gb(needed)} GB (weights {_gb(self.weight_bytes)} GB, KV cache "
                f"{_gb(needed - self.weight_bytes)} GB), over the memory budget of "
                f"{_gb(self.budget_bytes)} GB: at most {self.kv_token_capacity()} tokens fit",
                "max_tokens",
                code=OVER_BUDGET,
            )


def _gb(size: int) -> str:
    return f"{size / BYTES_PER_GB:.3g}"
