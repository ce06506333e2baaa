"""Request bodies of the OpenAI and Anthropic endpoints, as strict pydantic models.

A field is accepted when it is absent, null, its documented default, an echo of what Hearth
itself returned, or purely informational (metadata, user ids, cache hints); a value that asks
for behaviour Hearth does not have is refused with a 400 naming the field. Fields no model
declares are refused too, never silently ignored. Types are strict (no "5" -> 5), numbers
finite. docs/server.md has the table of every field and its status.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hearth.media import Audio, Image, decode_audio, decode_image
from hearth.media.fetch import FetchPolicy, decode_base64, read_media_url
from hearth.runtime.constraints import ConstraintError, OutputConstraint
from hearth.server.tools import ToolChoice, function_tool

# Known fields of peer APIs that Hearth does not implement: refused with a specific message.
UNSUPPORTED_FIELDS = frozenset(
    {
        "adapters",
        "draft_model",
        "grammar",
        "json_schema",
        "top_logprobs",
        "web_search_options",
    }
)

# Files and documents are refused wherever a part or block may appear.
FILE_KINDS = {"file": "files", "input_file": "files", "document": "documents"}
# Images and audio go in user messages only (each API's own rule): refused elsewhere.
MEDIA_KINDS = {
    "image": "images",
    "image_url": "images",
    "input_image": "images",
    "input_audio": "audio inputs",
}
# OpenAI's image detail levels as soft-token budgets (docs/media.md); "auto" (or none) leaves
# the server's default.
DETAIL_BUDGETS: dict[str, int | None] = {"low": 70, "auto": None, "high": 1120, "original": 1120}
ImageDetail = Literal["auto", "low", "high", "original"]

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Probability = Annotated[float, Field(gt=0, le=1)]
UnitInterval = Annotated[float, Field(ge=0, le=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
# Beyond any context window Hearth runs; the per-model limit is checked after tokenizing.
MaxTokens = Annotated[int, Field(ge=1, le=1_048_576)]
# Alternatives reported per token (OpenAI's limit for chat; the legacy API's `logprobs` too).
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
# OpenAI's limit on choices per request.
MAX_CHOICES = 128
# Seeds are 64-bit; -1 asks for a random one, as llama.cpp users expect.
RANDOM_SEED = -1
SEED_LIMIT = 2**64


class FieldRefused(Exception):
    """A whole-request check that fails on one field (pydantic would name no field for it);
    deliberately not a ValueError, so it leaves pydantic as it is."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def only(allowed: tuple[object, ...], message: str) -> Callable[[object], object]:
    """A before-validator accepting only null and `allowed` values (a field accepted at its
    default); any other value is refused with `message` (what is not supported, and what is)."""

    def check(value: object) -> object:
        # `is` for booleans: 0 == False, and a strict field must still see the int.
        if value is not None and not any(value == ok and type(value) is type(ok) for ok in allowed):
            raise ValueError(message)
        return value

    return check


def refuse_media(kind: object, where: str | None = None) -> None:
    """Refuse a file part anywhere, and an image or audio part `where` (e.g. "in tool
    results") when given: None means images and audio may appear here."""
    if not isinstance(kind, str):
        return
    if kind in FILE_KINDS:
        raise ValueError(f"{FILE_KINDS[kind]} are not supported (images and audio are)")
    if where is not None and kind in MEDIA_KINDS:
        raise ValueError(f"{MEDIA_KINDS[kind]} are not supported {where}")


def text_of_content(content: object) -> str:
    """A message's text: a string, or a list of text parts joined (a `refusal` part counts as
    text: it is what an assistant said; `cache_control` is a hint some clients add)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        refuse_media(kind)
        key = {"text": "text", "refusal": "refusal"}.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise ValueError(
                f"a content part's type is text, refusal, image_url or input_audio, not {kind!r}"
            )
        assert isinstance(part, dict)
        if not set(part) <= {"type", key, "cache_control"} or not isinstance(part.get(key), str):
            raise ValueError(f'a {kind} part must be {{"type": "{kind}", "{key}": <string>}}')
        texts.append(part[key])
    return "".join(texts)


def optional_text_of_content(content: object) -> str | None:
    return None if content is None else text_of_content(content)


def valid_seed(seed: int | None) -> int | None:
    """-1 means a random seed (None); others must fit 64 bits."""
    if seed is None or seed == RANDOM_SEED:
        return None
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"must be -1 (random) or an integer in [0, {SEED_LIMIT - 1}]")
    return seed


@dataclass(frozen=True)
class MediaSource:
    """One image or audio part as the request gave it (nothing is read or decoded while the
    body is parsed): a URL (data: or http(s)) or base64 text; `param` is where it sits in the
    request, for errors. Neutral messages carry it as a part `{"type": "media", ...}`."""

    kind: Literal["image", "audio"]
    param: str
    url: str | None = None
    data: str | None = None
    max_tokens: int | None = None  # the request's image budget (None: the server's)

    def part(self) -> dict[str, Any]:
        return {"type": "media", "source": self}

    def decode(self, policy: FetchPolicy, default_budget: int | None) -> Image | Audio:
        """Read (from the URL or the base64 text) and decode; MediaError names the problem."""
        if self.url is not None:
            data = read_media_url(self.url, policy)
        else:
            data = decode_base64(self.data or "", policy.max_bytes)
        if self.kind == "audio":
            return decode_audio(data)
        budget = self.max_tokens if self.max_tokens is not None else default_budget
        return decode_image(data, budget)


class ImageUrl(StrictModel):
    url: str
    detail: ImageDetail | None = None


class ChatTextPart(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a caching hint some clients add


class ChatImagePart(StrictModel):
    """OpenAI chat's image: a data: or http(s) URL and a detail level."""

    type: Literal["image_url"]
    image_url: ImageUrl | str  # some clients send the URL alone
    cache_control: dict[str, Any] | None = None

    def source(self, param: str) -> MediaSource:
        image = self.image_url
        if isinstance(image, str):
            image = ImageUrl(url=image)
        budget = DETAIL_BUDGETS[image.detail] if image.detail else None
        return MediaSource("image", f"{param}.image_url", url=image.url, max_tokens=budget)


class InputAudio(StrictModel):
    data: str  # base64
    format: str  # OpenAI's "wav" or "mp3"; the decoder reads the file's own header


class ChatAudioPart(StrictModel):
    """OpenAI's audio input (chat, and the Responses API's content part of the same shape)."""

    type: Literal["input_audio"]
    input_audio: InputAudio
    cache_control: dict[str, Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a caching hint; caching is automatic

    def source(self, param: str) -> MediaSource:
        return MediaSource("audio", f"{param}.input_audio.data", data=self.input_audio.data)


ChatPart = Annotated[ChatTextPart | ChatImagePart | ChatAudioPart, Field(discriminator="type")]


def chat_content(content: object) -> object:
    """Text parts are joined (the engine sees a string); a list with images or audio stays a
    list of parts, validated as such."""
    if isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") in ("image_url", "input_audio")
        for part in content
    ):
        for part in content:
            refuse_media(part.get("type") if isinstance(part, dict) else None)
        return content
    return optional_text_of_content(content)


def neutral_parts(parts: list[Any], param: str) -> list[dict[str, Any]]:
    """Validated text, image and audio parts as neutral content parts, in order."""
    neutral = []
    for index, part in enumerate(parts):
        if hasattr(part, "source"):
            neutral.append(part.source(f"{param}.{index}").part())
        else:
            neutral.append({"type": "text", "text": part.text})
    return neutral


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # present when a client rebuilds calls from stream deltas


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatPart] | None = None
    name: str | None = None  # the participant's name; chat templates have no place for it
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # Echoes of a returned assistant message: earlier thoughts are dropped (the template drops
    # them), a refusal is what the assistant said, annotations are citations to show.
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    # Text parts are joined before validation: the engine sees a string unless there is media.
    _join_parts = field_validator("content", mode="before")(chat_content)

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and self.refusal is not None and self.role == "assistant":
            self.content = self.refusal
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required unless an assistant message has tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if isinstance(self.content, list) and self.role != "user":
            raise ValueError("images and audio go in user messages")
        return self

    def neutral(self, index: int) -> dict[str, Any]:
        # Chat templates know "system", not OpenAI's newer "developer" alias for it.
        role = "system" if self.role == "developer" else self.role
        content = self.content
        if isinstance(content, list):
            content = neutral_parts(content, f"messages.{index}.content")
        message: dict[str, Any] = {"role": role, "content": content}
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


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """OpenAI chat's `{"type": "function", "function": {"name": ...}}`: call that tool."""

    type: Literal["function"]
    function: FunctionName


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
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # padding against length side channels; none here


def checked_constraint(param: str, build: Callable[[], OutputConstraint]) -> OutputConstraint:
    """`build()`, compiled once to find what cannot be enforced: refused naming `param`."""
    try:
        constraint = build()
        constraint.to_grammar()
    except ConstraintError as error:
        raise FieldRefused(param, f"{param}: {error}") from None
    return constraint


def one_constraint(given: dict[str, OutputConstraint | None]) -> OutputConstraint | None:
    """The one constraint among the fields that may set one (field name -> its constraint);
    two at once conflict, and are refused naming the second."""
    named = [(param, constraint) for param, constraint in given.items() if constraint is not None]
    if len(named) > 1:
        first, second = named[0][0], named[1][0]
        raise FieldRefused(second, f"{first} and {second} both constrain the output: send one")
    return named[0][1] if named else None


class JsonSchemaFormat(StrictModel):
    """OpenAI chat's `response_format.json_schema` (what `chat.completions.parse` sends)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # always enforced here


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: plain text (the default), any JSON object, or JSON that
    follows a schema; the last two constrain decoding."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self

    def constraint(self, param: str) -> OutputConstraint | None:
        if self.type == "json_object":
            return OutputConstraint.any_json()
        if self.json_schema is None:
            return None
        schema = True if self.json_schema.schema_ is None else self.json_schema.schema_
        return checked_constraint(param, lambda: OutputConstraint.json_schema(schema))


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (the newer spelling of its guided_* fields): one of them."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def constraint(self) -> OutputConstraint | None:
        given = [v for v in self.model_dump(exclude_none=True).values() if v is not False]
        if len(given) > 1:
            raise FieldRefused("structured_outputs", "structured_outputs takes one of its fields")
        return guided_constraint(
            "structured_outputs",
            self.json_,
            self.regex,
            self.choice,
            self.grammar,
            bool(self.json_object),
        )


def guided_constraint(
    param: str,
    json_schema: object = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    json_object: bool = False,
) -> OutputConstraint | None:
    """The constraint of vLLM's guided_* fields (or structured_outputs), at most one given."""
    if json_schema is not None:
        return checked_constraint(param, lambda: OutputConstraint.json_schema(json_schema))
    if regex is not None:
        return checked_constraint(param, lambda: OutputConstraint.regex(regex))
    if choice is not None:
        return checked_constraint(param, lambda: OutputConstraint.choice(choice))
    if grammar is not None:
        return checked_constraint(param, lambda: OutputConstraint.grammar(grammar))
    return OutputConstraint.any_json() if json_object else None


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
    # mlx_lm.server's default 0 means "off", as 1 does.
    repetition_penalty: NonNegativeFloat | None = None
    repetition_context_size: PositiveInt | None = None
    presence_penalty: Penalty | None = None
    presence_context_size: PositiveInt | None = None
    frequency_penalty: Penalty | None = None
    frequency_context_size: PositiveInt | None = None
    xtc_probability: UnitInterval | None = None
    xtc_threshold: Annotated[float, Field(ge=0, le=0.5)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Informational: tracking ids and hints that change nothing in the output.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prompt caching is automatic
    cache_prompt: bool | None = None  # llama.cpp's cache hint; caching is automatic
    safety_identifier: str | None = None
    num_draft_tokens: NonNegativeInt | None = None  # mlx_lm.server's; no draft model here
    store: bool | None = None
    # Constrained decoding: OpenAI's field, and vLLM's that clients send for the rest.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    _seed_range = field_validator("seed")(valid_seed)
    _no_storage = field_validator("store", mode="before")(
        only((False,), "storing completions is not supported (store: false)")
    )

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_are_integers(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return bias

    @property
    def choices(self) -> int:
        return self.n or 1

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def token_bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    _constraint: OutputConstraint | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_output_constraint(self) -> OpenAIRequest:
        response_format = self.response_format
        structured = self.structured_outputs
        guided = {
            "guided_json": guided_constraint("guided_json", json_schema=self.guided_json),
            "guided_regex": guided_constraint("guided_regex", regex=self.guided_regex),
            "guided_choice": guided_constraint("guided_choice", choice=self.guided_choice),
            "guided_grammar": guided_constraint("guided_grammar", grammar=self.guided_grammar),
        }
        self._constraint = one_constraint(
            {
                "response_format": response_format.constraint("response_format")
                if response_format
                else None,
                **guided,
                "structured_outputs": structured.constraint() if structured else None,
            }
        )
        return self

    @property
    def output_constraint(self) -> OutputConstraint | None:
        """What the output must match, from whichever one field asks for it (None: free)."""
        return self._constraint

    def logprob_alternatives(self) -> int | None:
        """None: no log-probabilities; else how many alternatives to report per token."""
        raise NotImplementedError


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None  # needs logprobs: true (declared just above)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    role_mapping: dict[str, str] | None = None  # mlx_lm.server's, for models without a template
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None  # predicted output: a speed hint, same output
    audio: None = None
    functions: None = None
    function_call: None = None

    _text_modality = field_validator("modalities")(lambda value: _text_modality_only(value))
    _no_functions = field_validator("functions", "function_call", mode="before")(
        only((), "the legacy functions API is not supported: send tools and tool_choice")
    )
    _no_audio = field_validator("audio", mode="before")(
        only((), "audio output is not supported by this model")
    )

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        # As OpenAI: alternatives are only sent along with the tokens' own log-probabilities.
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top

    @model_validator(mode="after")
    def _named_tool_is_given(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, NamedToolChoice):
            require_tool(self.tool_choice.function.name, self.tool_names(), "tool_choice")
        elif self.tool_choice == "required" and not self.tools:
            raise FieldRefused("tool_choice", "tool_choice 'required' needs tools")
        return self

    def token_limit(self) -> int | None:
        # The newer name wins, as in OpenAI's API (max_tokens is its deprecated alias).
        return self.max_completion_tokens or self.max_tokens

    def limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def neutral_messages(self) -> list[dict[str, Any]]:
        return [message.neutral(index) for index, message in enumerate(self.messages)]

    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    def tool_policy(self) -> ToolChoice:
        choice = self.tool_choice
        parallel = self.parallel_tool_calls is not False
        if not self.tools or choice == "none":
            return ToolChoice(enabled=False)
        if isinstance(choice, NamedToolChoice):
            return ToolChoice(required=True, name=choice.function.name, parallel=parallel)
        return ToolChoice(required=choice == "required", parallel=parallel)

    def template_tools(self) -> list[dict[str, Any]] | None:
        # tool_choice "none": the model is not told of the tools, and calls are not parsed.
        if not self.tool_policy().enabled:
            return None
        return [tool.function.for_template() for tool in self.tools or []]

    def thinking(self) -> bool | None:
        return thinking_switch(self.chat_template_kwargs, self.reasoning_effort)


def _text_modality_only(modalities: list[str] | None) -> list[str] | None:
    if modalities is not None and set(modalities) - {"text"}:
        raise ValueError('only the "text" modality is supported by this model')
    return modalities


def require_tool(name: str, names: list[str], what: str) -> None:
    if name not in names:
        raise FieldRefused(what, f"{what} names {name!r}, which is not among the tools")


TokenIds = Annotated[list[NonNegativeInt], Field(min_length=1)]
# One prompt as text or token ids, or a batch of them: OpenAI's four shapes (mixed, as llama.cpp).
PromptInput = str | TokenIds | list[str | TokenIds]


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    )


def _prompt_shape(prompt: object) -> object:
    """One of OpenAI's four prompt shapes, none of them empty: checked up front, so a wrong
    shape gets one clear message instead of an error per shape."""
    if isinstance(prompt, str) and prompt:
        return prompt
    if _is_token_ids(prompt):
        return prompt
    # A batch may mix text and token ids, as llama.cpp's server allows.
    if (
        isinstance(prompt, list)
        and prompt
        and all((isinstance(p, str) and p) or _is_token_ids(p) for p in prompt)
    ):
        return prompt
    raise ValueError(
        "a prompt is a non-empty string, a list of token ids (integers >= 0), or a list of "
        "such strings and lists"
    )


class CompletionRequest(OpenAIRequest):
    prompt: PromptInput
    # The legacy API's logprobs is the number of alternatives per token (0: the token's only).
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    best_of: PositiveInt | None = None
    suffix: str | None = None

    _no_suffix = field_validator("suffix", mode="before")(
        only(("",), "a suffix (insertion) is not supported: Hearth completes only after the prompt")
    )

    _prompt_shape = field_validator("prompt", mode="before")(lambda value: _prompt_shape(value))

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        # best_of > n would rank candidates by log-probability, which Hearth does not do.
        if self.best_of is not None and self.best_of != self.choices:
            message = "best_of must equal n (ranking candidates is not supported)"
            raise FieldRefused("best_of", message)
        if self.echo and self.logprobs is not None:
            message = "echo with logprobs (the prompt's log-probabilities) is not supported"
            raise FieldRefused("echo", message)
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def token_limit(self) -> int | None:
        return self.max_tokens

    def limit_param(self) -> str:
        return "max_tokens"

    def logprob_alternatives(self) -> int | None:
        return self.logprobs


class CacheControl(StrictModel):
    """Anthropic's prompt-caching hint; Hearth caches prompts by itself."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class AnthropicText(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # an echo of a returned block; nothing to render


class AnthropicToolUse(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def _refuse_media(content: object, where: str | None = None) -> object:
    """Files refused in a list of blocks or parts; images and audio too when `where` says."""
    if isinstance(content, list):
        for block in content:
            refuse_media(block.get("type") if isinstance(block, dict) else None, where)
    return content


class AnthropicImageSource(StrictModel):
    """An image block's source: base64 data (with its media type) or a URL."""

    type: Literal["base64", "url"]
    media_type: str | None = None  # the decoder reads the file's own header
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _data_or_url(self) -> AnthropicImageSource:
        if self.type == "base64" and (self.data is None or self.url is not None):
            raise ValueError('a "base64" source has data (and no url)')
        if self.type == "url" and (self.url is None or self.data is not None):
            raise ValueError('a "url" source has a url (and no data)')
        return self


class AnthropicImage(StrictModel):
    type: Literal["image"]
    source: AnthropicImageSource
    cache_control: CacheControl | None = None

    def media(self, param: str) -> MediaSource:
        given = self.source
        where = f"{param}.source.{'data' if given.type == 'base64' else 'url'}"
        return MediaSource("image", where, url=given.url, data=given.data)


class AnthropicToolResult(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicText] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    _no_media = field_validator("content", mode="before")(
        lambda value: _refuse_media(value, "in tool results")
    )

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
    cache_control: CacheControl | None = None


class AnthropicRedactedThinking(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


AnthropicBlock = Annotated[
    AnthropicText
    | AnthropicImage
    | AnthropicToolUse
    | AnthropicToolResult
    | AnthropicThinking
    | AnthropicRedactedThinking,
    Field(discriminator="type"),
]


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]

    _no_media = field_validator("content", mode="before")(lambda value: _refuse_media(value))

    @model_validator(mode="after")
    def _images_from_the_user(self) -> AnthropicMessage:
        blocks = self.content if isinstance(self.content, list) else []
        if self.role != "user" and any(isinstance(b, AnthropicImage) for b in blocks):
            raise ValueError("images go in user messages")
        return self

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
        text: str | list[dict[str, Any]] = "".join(
            b.text for b in blocks if isinstance(b, AnthropicText)
        )
        if any(isinstance(b, AnthropicImage) for b in blocks):
            text = [
                b.media(f"{source}.content.{i}").part()
                if isinstance(b, AnthropicImage)
                else {"type": "text", "text": b.text}
                for i, b in enumerate(blocks)
                if isinstance(b, AnthropicImage | AnthropicText)
            ]
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
    cache_control: CacheControl | None = None


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise FieldRefused(
                "tool_choice.name", 'a name is given with type "tool", and only then'
            )
        return self


class AnthropicThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None  # accepted; max_tokens bounds it


class AnthropicMetadata(StrictModel):
    user_id: str | None = None  # the caller's tracking id; no effect on generation


def _system_text(system: object) -> object:
    """A system prompt given as text blocks (which may carry cache_control) as one string."""
    if not isinstance(system, list):
        return system
    texts = []
    for block in system:
        if not (
            isinstance(block, dict)
            and block.get("type") == "text"
            and isinstance(block.get("text"), str)
            and set(block) <= {"type", "text", "cache_control", "citations"}
        ):
            raise ValueError('system blocks must be {"type": "text", "text": <string>}')
        texts.append(block["text"])
    return "".join(texts)


class AnthropicPrompt(StrictModel):
    """What both /v1/messages and /v1/messages/count_tokens render: the conversation, the
    system prompt, the tools and the thinking switch."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None

    _join_system_blocks = field_validator("system", mode="before")(
        lambda value: _system_text(value)
    )

    @field_validator("messages")
    @classmethod
    def _no_assistant_prefill(cls, messages: list[AnthropicMessage]) -> list[AnthropicMessage]:
        # A final assistant turn asks to continue it; treating it as history would be wrong.
        if messages and messages[-1].role == "assistant":
            raise ValueError("a final assistant message (prefill) is not supported yet")
        return messages

    @model_validator(mode="after")
    def _named_tool_is_given(self) -> AnthropicPrompt:
        choice = self.tool_choice
        names = [tool.name for tool in self.tools or []]
        if choice is not None and choice.name is not None:
            require_tool(choice.name, names, "tool_choice")
        if choice is not None and choice.type == "any" and not names:
            raise FieldRefused("tool_choice", 'tool_choice "any" needs tools')
        return self

    def neutral_messages(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        turns = [part for i, m in enumerate(self.messages) for part in m.neutral(i)]
        return system + turns

    def tool_policy(self) -> ToolChoice:
        choice = self.tool_choice or AnthropicToolChoice(type="auto")
        if not self.tools or choice.type == "none":
            return ToolChoice(enabled=False)
        parallel = not choice.disable_parallel_tool_use
        required = choice.type in ("any", "tool")
        return ToolChoice(required=required, name=choice.name, parallel=parallel)

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tool_policy().enabled:
            return None
        tools = self.tools or []
        return [function_tool(t.name, t.description, t.input_schema) for t in tools]

    def thinking_on(self) -> bool | None:
        return None if self.thinking is None else self.thinking.type == "enabled"


class AnthropicOutputFormat(StrictModel):
    """Anthropic's structured output: `{"type": "json_schema", "schema": {...}}`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(StrictModel):
    format: AnthropicOutputFormat | None = None
    effort: None = None

    _no_effort = field_validator("effort", mode="before")(
        only((), "effort levels are not supported (the model's thinking switch is `thinking`)")
    )


class MessagesRequest(AnthropicPrompt):
    """POST /v1/messages (Anthropic Messages API): text, tools, thinking and structured output
    (`output_config.format`, and the beta's `output_format`)."""

    max_tokens: MaxTokens
    stop_sequences: list[str] | None = None
    temperature: NonNegativeFloat | None = None
    top_p: Probability | None = None
    top_k: NonNegativeInt | None = None
    stream: bool | None = None
    metadata: AnthropicMetadata | None = None
    service_tier: str | None = None  # informational: one local model, one tier
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = None

    _constraint: OutputConstraint | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _output_format_constraint(self) -> MessagesRequest:
        config_format = self.output_config.format if self.output_config else None
        formats = {"output_config.format": config_format, "output_format": self.output_format}
        self._constraint = one_constraint(
            {
                param: checked_constraint(
                    param, lambda given=given: OutputConstraint.json_schema(given.schema_)
                )
                if given is not None
                else None
                for param, given in formats.items()
            }
        )
        return self

    @property
    def output_constraint(self) -> OutputConstraint | None:
        return self._constraint


class ResponsesText(StrictModel):
    """A text part of a Responses message: input_text, or output_text / refusal sent back."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # output_text's citations; nothing to render
    logprobs: list[Any] | None = None  # an echo of output_text's; nothing to render

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class ResponsesImage(StrictModel):
    """An input_image part: `image_url` an http(s) or data: URL."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: None = None
    detail: ImageDetail | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a caching hint; caching is automatic

    _no_files = field_validator("file_id", mode="before")(
        only((), "uploaded files are not supported: send image_url (an http(s) or data: URL)")
    )

    @model_validator(mode="after")
    def _has_url(self) -> ResponsesImage:
        if self.image_url is None:
            raise ValueError("an input_image needs image_url (an http(s) or data: URL)")
        return self

    def source(self, param: str) -> MediaSource:
        budget = DETAIL_BUDGETS[self.detail] if self.detail else None
        return MediaSource("image", f"{param}.image_url", url=self.image_url, max_tokens=budget)


ResponsesPart = Annotated[
    ResponsesText | ResponsesImage | ChatAudioPart, Field(discriminator="type")
]


class ResponsesMessage(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesPart]
    id: str | None = None
    status: str | None = None

    @model_validator(mode="after")
    def _media_from_the_user(self) -> ResponsesMessage:
        parts = self.content if isinstance(self.content, list) else []
        if self.role != "user" and any(not isinstance(p, ResponsesText) for p in parts):
            raise ValueError("images and audio go in user messages")
        return self

    def neutral_content(self, param: str) -> str | list[dict[str, Any]]:
        """The text, or with images or audio the parts in order (text parts as text)."""
        if isinstance(self.content, str):
            return self.content
        if all(isinstance(part, ResponsesText) for part in self.content):
            return "".join(part.value() for part in self.content)  # type: ignore[union-attr]
        return [
            {"type": "text", "text": part.value()}
            if isinstance(part, ResponsesText)
            else part.source(f"{param}.{index}").part()
            for index, part in enumerate(self.content)
        ]


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
    output: str | list[ResponsesText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.value() for part in self.output)


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


def _input_items(items: object) -> object:
    """OpenAI's "easy" input messages leave out "type": they are messages. File parts (and
    images in function outputs) are refused here, before the union of input shapes would bury
    the reason."""
    if not isinstance(items, list):
        return items
    for item in items:
        if isinstance(item, dict):
            _refuse_media(item.get("content"))
            _refuse_media(item.get("output"), "in function call outputs")
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


class ResponsesNamedTool(StrictModel):
    type: Literal["function"]
    name: str


class ResponsesReasoningConfig(StrictModel):
    effort: ReasoningEffort | None = None
    # "auto" lets the model decide; Hearth's decision is no summary (summary: []).
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None

    _auto_summary = field_validator("summary", "generate_summary", mode="before")(
        only(("auto",), 'reasoning summaries are not produced ("auto" or null)')
    )


class ResponsesFormat(StrictModel):
    """Responses' `text.format`: OpenAI chat's response_format with json_schema's fields
    flattened into it."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # always enforced here

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponsesFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError('schema is given with type "json_schema", and only then')
        return self

    def constraint(self) -> OutputConstraint | None:
        if self.type == "json_object":
            return OutputConstraint.any_json()
        if self.schema_ is None:
            return None
        schema = self.schema_
        return checked_constraint("text.format", lambda: OutputConstraint.json_schema(schema))


class ResponsesTextConfig(StrictModel):
    format: ResponsesFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; other lengths are not steered
    _medium = field_validator("verbosity", mode="before")(
        only(("medium",), 'only the default verbosity "medium" is supported')
    )


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None


# `include` values that ask for nothing Hearth lacks: its reasoning is plain text, and earlier
# reasoning sent back is dropped, so no encrypted copy is needed to continue a conversation.
HARMLESS_INCLUDES = ("reasoning.encrypted_content",)


class ResponsesRequest(StrictModel):
    """POST /v1/responses (OpenAI Responses API)."""

    model: str | None = None
    input: str | list[ResponsesItem]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: NonNegativeFloat | None = None
    top_p: Probability | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ResponsesReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    metadata: dict[str, str] | None = None  # echoed back
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    text: ResponsesTextConfig | None = None
    top_logprobs: Literal[0] | None = None
    background: bool | None = None
    # Informational: tracking ids and hints that change nothing in the output.
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    _easy_messages = field_validator("input", mode="before")(_input_items)
    _no_truncation = field_validator("truncation", mode="before")(
        only(("disabled",), 'only "disabled" is supported: a prompt over the context is refused')
    )
    _no_logprobs = field_validator("top_logprobs", mode="before")(
        only((0,), "log-probabilities are not supported on the Responses API yet")
    )
    _foreground = field_validator("background", mode="before")(
        only((False,), "background responses are not supported (background: false)")
    )

    @field_validator("include")
    @classmethod
    def _harmless_includes(cls, include: list[str] | None) -> list[str] | None:
        for item in include or []:
            if item not in HARMLESS_INCLUDES:
                raise ValueError(f"{item!r} is not supported (supported: {HARMLESS_INCLUDES})")
        return include

    _constraint: OutputConstraint | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _text_format_constraint(self) -> ResponsesRequest:
        text_format = self.text.format if self.text else None
        self._constraint = text_format.constraint() if text_format else None
        return self

    @model_validator(mode="after")
    def _named_tool_is_given(self) -> ResponsesRequest:
        names = [tool.name for tool in self.tools or []]
        if isinstance(self.tool_choice, ResponsesNamedTool):
            require_tool(self.tool_choice.name, names, "tool_choice")
        elif self.tool_choice == "required" and not names:
            raise FieldRefused("tool_choice", "tool_choice 'required' needs tools")
        return self

    @property
    def output_constraint(self) -> OutputConstraint | None:
        """text.format's constraint (None: free text)."""
        return self._constraint

    def neutral_input(self) -> list[dict[str, Any]]:
        """The input items as neutral messages; consecutive calls join one assistant turn."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input, "source": "input"}]
        messages: list[dict[str, Any]] = []
        for index, item in enumerate(self.input):
            source = f"input.{index}"
            if isinstance(item, ResponsesMessage):
                role = "system" if item.role == "developer" else item.role
                content = item.neutral_content(f"{source}.content")
                messages.append({"role": role, "content": content, "source": source})
            elif isinstance(item, ResponsesFunctionCall):
                call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
                _calling_turn(messages, source)["tool_calls"].append(call)
            elif isinstance(item, ResponsesFunctionOutput):
                tool = {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
                messages.append(tool | {"source": source})
        return messages

    def tool_policy(self) -> ToolChoice:
        choice = self.tool_choice
        parallel = self.parallel_tool_calls is not False
        if not self.tools or choice == "none":
            return ToolChoice(enabled=False)
        if isinstance(choice, ResponsesNamedTool):
            return ToolChoice(required=True, name=choice.name, parallel=parallel)
        return ToolChoice(required=choice == "required", parallel=parallel)

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tool_policy().enabled:
            return None
        tools = self.tools or []
        return [function_tool(t.name, t.description, t.parameters) for t in tools]

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
