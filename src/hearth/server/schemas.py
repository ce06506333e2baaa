"""Request bodies of the OpenAI and Anthropic endpoints, as strict pydantic models.

Every model forbids fields it does not declare: a field Hearth does not act on is refused with
400 naming it, never silently ignored. Types are strict (no "5" -> 5), numbers finite.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Known OpenAI/Anthropic fields Hearth does not implement yet: refused with a specific message.
UNSUPPORTED_FIELDS = frozenset(
    {
        "audio",
        "best_of",
        "echo",
        "function_call",
        "functions",
        "guided_choice",
        "guided_grammar",
        "guided_regex",
        "modalities",
        "parallel_tool_calls",
        "prediction",
        "reasoning_effort",
        "response_format",
        "suffix",
        "thinking",
        "tool_choice",
        "tools",
        "top_logprobs",
        "xtc_probability",
        "xtc_threshold",
    }
)

NonNegativeFloat = Annotated[float, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Probability = Annotated[float, Field(gt=0, le=1)]
UnitInterval = Annotated[float, Field(ge=0, le=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
# Beyond any context window Hearth runs; the per-model limit is checked after tokenizing.
MaxTokens = Annotated[int, Field(ge=1, le=1_048_576)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def text_of_content(content: object) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"only text content parts are supported, got type {kind!r}")
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise ValueError('a text part must be exactly {"type": "text", "text": <string>}')
        texts.append(part["text"])
    return "".join(texts)


def optional_text_of_content(content: object) -> str | None:
    return None if content is None else text_of_content(content)


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    # Parts are joined before validation, so the engine only ever sees plain strings.
    _join_parts = field_validator("content", mode="before")(text_of_content)

    def for_template(self) -> dict[str, str]:
        # Chat templates know "system", not OpenAI's newer "developer" alias for it.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class StreamOptions(StrictModel):
    include_usage: bool = False


class OpenAIRequest(StrictModel):
    """Fields shared by /v1/chat/completions and /v1/completions; None means "server default"."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: NonNegativeFloat | None = None
    top_p: Probability | None = None
    top_k: NonNegativeInt | None = None
    min_p: UnitInterval | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    repetition_context_size: Annotated[int, Field(ge=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: int | None = None
    logprobs: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own tracking; no effect here

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported (one choice per request)")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool | None) -> bool | None:
        if logprobs:
            raise ValueError("logprobs are not supported yet")
        return logprobs

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_are_integers(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return bias

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def token_bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None

    def token_limit(self) -> int | None:
        # The newer name wins, as in OpenAI's API (max_tokens is its deprecated alias).
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [message.for_template() for message in self.messages]


class CompletionRequest(OpenAIRequest):
    prompt: str = Field(min_length=1)

    def token_limit(self) -> int | None:
        return self.max_tokens


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str

    _join_blocks = field_validator("content", mode="before")(text_of_content)


class AnthropicMetadata(StrictModel):
    user_id: str | None = None  # the caller's tracking id; no effect on generation


class MessagesRequest(StrictModel):
    """POST /v1/messages (Anthropic Messages API), text only."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: MaxTokens
    system: str | None = None
    stop_sequences: list[str] | None = None
    temperature: NonNegativeFloat | None = None
    top_p: Probability | None = None
    top_k: NonNegativeInt | None = None
    stream: bool = False
    metadata: AnthropicMetadata | None = None

    _join_system_blocks = field_validator("system", mode="before")(optional_text_of_content)

    @field_validator("messages")
    @classmethod
    def _no_assistant_prefill(cls, messages: list[AnthropicMessage]) -> list[AnthropicMessage]:
        # A final assistant turn asks to continue it; treating it as history would be wrong.
        if messages and messages[-1].role == "assistant":
            raise ValueError("a final assistant message (prefill) is not supported yet")
        return messages

    def template_messages(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": m.role, "content": m.content} for m in self.messages]
