"""Request bodies of the OpenAI and Anthropic endpoints, as strict pydantic models.

Every model forbids fields it does not declare: a field Hearth does not act on is refused with
400 naming it, never silently ignored. Types are strict (no "5" -> 5), numbers finite.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hearth.server.tools import function_tool

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
        "response_format",
        "suffix",
        "top_logprobs",
        "xtc_probability",
        "xtc_threshold",
    }
)

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Probability = Annotated[float, Field(gt=0, le=1)]
UnitInterval = Annotated[float, Field(ge=0, le=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
# Beyond any context window Hearth runs; the per-model limit is checked after tokenizing.
MaxTokens = Annotated[int, Field(ge=1, le=1_048_576)]
# Alternatives reported per token (OpenAI's limit for chat; the legacy API's `logprobs` too).
TopLogprobs = Annotated[int, Field(ge=0, le=20)]


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


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    # Parts are joined before validation, so the engine only ever sees plain strings.
    _join_parts = field_validator("content", mode="before")(optional_text_of_content)

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required unless an assistant message has tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def neutral(self, index: int) -> dict[str, Any]:
        # Chat templates know "system", not OpenAI's newer "developer" alias for it.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content}
        message["source"] = f"messages.{index}"
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionSpec(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; arguments are not constrained to the schema

    def for_template(self) -> dict[str, Any]:
        return function_tool(self.name, self.description, self.parameters)


class FunctionTool(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class ChatTemplateKwargs(StrictModel):
    enable_thinking: bool | None = None


def thinking_switch(
    kwargs: ChatTemplateKwargs | None, effort: ReasoningEffort | None
) -> bool | None:
    """enable_thinking wins; any reasoning effort but "none" turns thinking on."""
    if kwargs is not None and kwargs.enable_thinking is not None:
        return kwargs.enable_thinking
    return None if effort is None else effort != "none"


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
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own tracking; no effect here

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported (one choice per request)")
        return n

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

    def logprob_alternatives(self) -> int | None:
        """None: no log-probabilities; else how many alternatives to report per token."""
        raise NotImplementedError


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None  # needs logprobs: true (declared just above)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        # As OpenAI: alternatives are only sent along with the tokens' own log-probabilities.
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top

    def token_limit(self) -> int | None:
        # The newer name wins, as in OpenAI's API (max_tokens is its deprecated alias).
        return self.max_completion_tokens or self.max_tokens

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def neutral_messages(self) -> list[dict[str, Any]]:
        return [message.neutral(index) for index, message in enumerate(self.messages)]

    def tools_on(self) -> bool:
        # tool_choice "none": the model is not told of the tools, and calls are not parsed.
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None or self.tool_choice == "none":
            return None
        return [tool.function.for_template() for tool in self.tools]

    def thinking(self) -> bool | None:
        return thinking_switch(self.chat_template_kwargs, self.reasoning_effort)


class CompletionRequest(OpenAIRequest):
    prompt: str = Field(min_length=1)
    # The legacy API's logprobs is the number of alternatives per token (0: the token's only).
    logprobs: TopLogprobs | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_alternatives(self) -> int | None:
        return self.logprobs


class AnthropicText(StrictModel):
    type: Literal["text"]
    text: str


class AnthropicToolUse(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicToolResult(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicText] = ""
    is_error: bool = False

    def text(self) -> str:
        text = (
            self.content
            if isinstance(self.content, str)
            else "".join(block.text for block in self.content)
        )
        # The template shows a mapping's keys: an error is told apart from a result.
        return json.dumps({"error": text}) if self.is_error else text


class AnthropicThinking(StrictModel):
    """An earlier turn's thinking, sent back by clients; the template drops old thoughts."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


AnthropicBlock = Annotated[
    AnthropicText | AnthropicToolUse | AnthropicToolResult | AnthropicThinking,
    Field(discriminator="type"),
]


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]

    def neutral(self, index: int) -> list[dict[str, Any]]:
        """Tool results first (they answer the previous turn's calls), then the message."""
        source = f"messages.{index}"
        blocks = (
            [AnthropicText(type="text", text=self.content)]
            if isinstance(self.content, str)
            else self.content
        )
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text(), "source": source}
            for b in blocks
            if isinstance(b, AnthropicToolResult)
        ]
        text = "".join(b.text for b in blocks if isinstance(b, AnthropicText))
        calls = [
            {"id": b.id, "name": b.name, "arguments": json.dumps(b.input)}
            for b in blocks
            if isinstance(b, AnthropicToolUse)
        ]
        if not (text or calls) and results:
            return results
        message: dict[str, Any] = {"role": self.role, "content": text, "source": source}
        if calls:
            message["tool_calls"] = calls
        return [*results, message]


class AnthropicTool(StrictModel):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "none"]


class AnthropicThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None  # accepted; max_tokens bounds it


class AnthropicMetadata(StrictModel):
    user_id: str | None = None  # the caller's tracking id; no effect on generation


class MessagesRequest(StrictModel):
    """POST /v1/messages (Anthropic Messages API): text, tools and thinking."""

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
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None

    _join_system_blocks = field_validator("system", mode="before")(optional_text_of_content)

    @field_validator("messages")
    @classmethod
    def _no_assistant_prefill(cls, messages: list[AnthropicMessage]) -> list[AnthropicMessage]:
        # A final assistant turn asks to continue it; treating it as history would be wrong.
        if messages and messages[-1].role == "assistant":
            raise ValueError("a final assistant message (prefill) is not supported yet")
        return messages

    def neutral_messages(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        turns = [part for i, m in enumerate(self.messages) for part in m.neutral(i)]
        return system + turns

    def tools_on(self) -> bool:
        return bool(self.tools) and not (self.tool_choice and self.tool_choice.type == "none")

    def template_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None or (self.tool_choice and self.tool_choice.type == "none"):
            return None
        return [function_tool(t.name, t.description, t.input_schema) for t in self.tools]

    def thinking_on(self) -> bool | None:
        return None if self.thinking is None else self.thinking.type == "enabled"


class ResponsesText(StrictModel):
    """A text part of a Responses message: input_text, or output_text sent back as history."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text's citations; nothing to render


class ResponsesMessage(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponsesFunctionCall(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponsesFunctionOutput(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ResponsesReasoning(StrictModel):
    """An earlier reasoning item sent back; the template drops earlier thoughts."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


ResponsesItem = Annotated[
    ResponsesMessage | ResponsesFunctionCall | ResponsesFunctionOutput | ResponsesReasoning,
    Field(discriminator="type"),
]


def _messages_default_to_type_message(items: object) -> object:
    # OpenAI's "easy" input messages leave out "type": they are messages.
    if not isinstance(items, list):
        return items
    return [
        {"type": "message", **item} if isinstance(item, dict) and "type" not in item else item
        for item in items
    ]


class ResponsesTool(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; arguments are not constrained to the schema


class ResponsesReasoningConfig(StrictModel):
    effort: ReasoningEffort | None = None


class ResponsesRequest(StrictModel):
    """POST /v1/responses (OpenAI Responses API)."""

    model: str | None = None
    input: str | list[ResponsesItem]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: NonNegativeFloat | None = None
    top_p: Probability | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    reasoning: ResponsesReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None  # echoed back

    _easy_messages = field_validator("input", mode="before")(_messages_default_to_type_message)

    def neutral_input(self) -> list[dict[str, Any]]:
        """The input items as neutral messages; consecutive calls join one assistant turn."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input, "source": "input"}]
        messages: list[dict[str, Any]] = []
        for index, item in enumerate(self.input):
            source = f"input.{index}"
            if isinstance(item, ResponsesMessage):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text(), "source": source})
            elif isinstance(item, ResponsesFunctionCall):
                call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
                _calling_turn(messages, source)["tool_calls"].append(call)
            elif isinstance(item, ResponsesFunctionOutput):
                tool = {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                messages.append(tool | {"source": source})
        return messages

    def tools_on(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None or self.tool_choice == "none":
            return None
        return [function_tool(t.name, t.description, t.parameters) for t in self.tools]

    def thinking(self) -> bool | None:
        effort = self.reasoning.effort if self.reasoning else None
        return None if effort is None else effort != "none"


def _calling_turn(messages: list[dict[str, Any]], source: str) -> dict[str, Any]:
    """The assistant turn a function_call item belongs to: the last one if it is still open."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None, "source": source}
        messages.append(last)
    last.setdefault("tool_calls", [])
    return last
