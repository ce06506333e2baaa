"""`--memory-budget`: refuse, before it runs, a request whose KV cache would not fit beside the
model's weights."""

from __future__ import annotations

from dataclasses import dataclass

from hearth.engine import Engine
from hearth.server.errors import RequestError

BYTES_PER_GB = 10**9
OVER_BUDGET = "context_over_budget"


@dataclass(frozen=True)
class MemoryBudget:
    budget_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int  # dense K/V in the compute dtype: an upper bound for quantized caches

    @classmethod
    def for_engine(cls, engine: Engine, gigabytes: float) -> MemoryBudget:
        config = engine.model.config
        element_bytes = engine.model.compute_dtype.itemsize
        return cls(
            round(gigabytes * BYTES_PER_GB),
            engine.weight_bytes_per_token(),  # every weight tensor once: the weights' footprint
            config.kv_bytes_per_token(element_bytes),
        )

    def needed_bytes(self, tokens: int) -> int:
        return self.weight_bytes + tokens * self.kv_bytes_per_token

    def kv_token_capacity(self) -> int:
        """Tokens of dense K/V the budget holds beside the weights."""
        return max(0, self.budget_bytes - self.weight_bytes) // self.kv_bytes_per_token

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise a 400 if the prompt plus `max_tokens` of reply cannot fit the budget."""
        needed = self.needed_bytes(prompt_tokens + max_tokens)
        if needed > self.budget_bytes:
            raise RequestError(
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} need "
                f"{_gb(needed)} GB (weights {_gb(self.weight_bytes)} GB and KV cache), over the "
                f"memory budget of {_gb(self.budget_bytes)} GB",
                "max_tokens",
                code=OVER_BUDGET,
            )


def _gb(size: int) -> str:
    return f"{size / BYTES_PER_GB:.3g}"
