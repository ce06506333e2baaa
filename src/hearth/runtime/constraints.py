"""Grammar-constrained decoding: a typed `OutputConstraint` (JSON schema, any JSON, regex, a
choice among strings, an EBNF or Lark grammar) compiled once per tokenizer by xgrammar, and a
per-request `GrammarMatcher` that masks each step's logits before sampling and advances on the
token taken.

The faces hand an `OutputConstraint` to the engine, never a mask. A schema keyword xgrammar
does not enforce is refused (`ConstraintError`) instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from hearth.errors import HearthError
from hearth.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported on first use: it costs a second (and transformers) at start-up
    import xgrammar

ConstraintKind = Literal["json_schema", "json", "regex", "choice", "grammar"]

# Special tokens a grammar may spell: Gemma 4's tool-call markup. Every other special token
# (turn markers, <unusedNN>, image tokens) is kept out of constrained output.
SPELLABLE_SPECIAL_TOKENS = ('<|"|>', "<|tool_call>", "<tool_call|>")
# Gemma 4's thought channel, which a constraint `after_thought` lets a reply open first.
THOUGHT_MARKS = ("<|channel>", "<channel|>")

# JSON schema keywords xgrammar enforces, and those that only annotate.
ENFORCED_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minProperties",
        "maxProperties",
    }
)
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "strict",
    }
)
JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# String formats xgrammar turns into a grammar (others would pass unchecked).
ENFORCED_FORMATS = frozenset(
    {"date", "time", "date-time", "duration", "email", "uuid", "ipv4", "ipv6", "uri", "hostname"}
)
# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_SUBSCHEMA = ("items", "additionalProperties")
_SUBSCHEMA_LISTS = ("anyOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties")
# xgrammar prefixes its errors with a timestamp and its source file.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class ConstraintError(HearthError, ValueError):
    """A constraint that cannot be enforced: an invalid or unsupported schema, a regex or a
    grammar that does not compile. The message names the part at fault."""


@dataclass(frozen=True)
class OutputConstraint:
    """What generated text must match. `source`: the schema as JSON text, the regex, or the
    grammar (EBNF when it has `::=` rules, else Lark); `choices`: the strings of a choice.
    `after_thought`: the reply may first think, free, in Gemma 4's thought channel
    (`<|channel>…<channel|>`); what follows the channel must match."""

    kind: ConstraintKind
    source: str = ""
    choices: tuple[str, ...] = ()
    after_thought: bool = False

    def after_thinking(self) -> OutputConstraint:
        """This constraint on the answer that follows a thought channel."""
        return dataclasses.replace(self, after_thought=True)

    @classmethod
    def json_schema(cls, schema: object) -> OutputConstraint:
        """A JSON schema (a mapping, or its JSON text), checked for what can be enforced."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ConstraintError(f"the JSON schema is not valid JSON: {error}") from None
        check_schema(schema)
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def any_json(cls) -> OutputConstraint:
        return cls("json")

    @classmethod
    def regex(cls, pattern: str) -> OutputConstraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> OutputConstraint:
        options = tuple(choices)
        if not options or not all(isinstance(option, str) and option for option in options):
            raise ConstraintError("a choice needs at least one non-empty string")
        return cls("choice", choices=options)

    @classmethod
    def grammar(cls, text: str) -> OutputConstraint:
        if not text.strip():
            raise ConstraintError("the grammar is empty")
        return cls("grammar", text)

    def to_grammar(self) -> xgrammar.Grammar:
        """The xgrammar grammar; ConstraintError when it does not compile. Kept: a request is
        checked when it arrives and compiled for the tokenizer when it runs."""
        return _grammar_of(self)

    def _build(self) -> xgrammar.Grammar:
        import xgrammar

        # Compact JSON (", " and ": " only): with free whitespace a small model can spend its
        # whole budget on blank lines and never close the object.
        if self.kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(self.source, any_whitespace=False)
        if self.kind == "json":  # OpenAI's json_object: any JSON object
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if self.kind == "regex":
            return xgrammar.Grammar.from_regex(self.source)
        if self.kind == "choice":
            options = " | ".join(ebnf_literal(option) for option in self.choices)
            return xgrammar.Grammar.from_ebnf(f"root ::= {options}")
        if "::=" in self.source:
            return xgrammar.Grammar.from_ebnf(self.source)
        return xgrammar.Grammar.from_lark(self.source)

    def _what(self) -> str:
        return {
            "json_schema": "the JSON schema",
            "json": "the JSON grammar",
            "regex": "the regex",
            "choice": "the choice",
            "grammar": "the grammar",
        }[self.kind]


@functools.lru_cache(maxsize=256)
def _grammar_of(constraint: OutputConstraint) -> xgrammar.Grammar:
    try:
        return constraint._build()
    except (RuntimeError, ValueError) as error:
        message = _XGRAMMAR_PREFIX.sub("", str(error).strip().splitlines()[0])
        raise ConstraintError(f"{constraint._what()} does not compile: {message}") from None


def ebnf_literal(text: str) -> str:
    """`text` as a quoted EBNF string (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)


def check_schema(schema: object, path: str = "#") -> None:
    """Refuse (ConstraintError, naming the place) a schema that is malformed or uses a
    keyword xgrammar would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"the JSON schema at {path} must be an object or a boolean")
    for keyword, value in schema.items():
        where = f"{path}/{keyword}"
        if keyword in ANNOTATIONS:
            continue
        if keyword not in ENFORCED_KEYWORDS:
            raise ConstraintError(
                f"the JSON schema keyword {keyword!r} (at {where}) is not supported by "
                "constrained decoding"
            )
        _check_keyword(keyword, value, where)


def _check_keyword(keyword: str, value: Any, where: str) -> None:
    if keyword == "type":
        kinds = value if isinstance(value, list) else [value]
        if not kinds or any(kind not in JSON_TYPES for kind in kinds):
            raise ConstraintError(f"{where}: unknown type {value!r}")
    elif keyword in _SUBSCHEMA:
        check_schema(value, where)
    elif keyword in _SUBSCHEMA_LISTS:
        if not isinstance(value, list) or not value:
            raise ConstraintError(f"{where} must be a non-empty list of schemas")
        for index, item in enumerate(value):
            check_schema(item, f"{where}/{index}")
    elif keyword in _SUBSCHEMA_MAPS:
        if not isinstance(value, Mapping):
            raise ConstraintError(f"{where} must be an object of schemas")
        for name, item in value.items():
            check_schema(item, f"{where}/{name}")
    elif keyword == "required":
        if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
            raise ConstraintError(f"{where} must be a list of property names")
    elif keyword in _NUMBER_KEYWORDS:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConstraintError(f"{where} must be a number")
    elif keyword in (*_COUNT_KEYWORDS, "maxProperties"):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConstraintError(f"{where} must be a non-negative integer")
    elif keyword == "enum":
        if not isinstance(value, list) or not value:
            raise ConstraintError(f"{where} must be a non-empty list")
    elif keyword == "pattern":
        if not isinstance(value, str):
            raise ConstraintError(f"{where} must be a string")
    elif keyword == "format" and value not in ENFORCED_FORMATS:
        raise ConstraintError(
            f"the string format {value!r} (at {where}) is not supported by constrained decoding"
        )
    elif keyword == "$ref" and not (isinstance(value, str) and value.startswith("#")):
        raise ConstraintError(f"{where}: only local references (#/...) are supported")


# -- compiling, once per tokenizer and constraint


@functools.lru_cache(maxsize=8)
def _compiler(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.GrammarCompiler:
    """xgrammar's view of `tokenizer`, padded to the model's `vocab_size` (its logits' width)."""
    import xgrammar

    pieces = tokenizer.vocabulary_pieces
    hidden = tokenizer.special_ids - {tokenizer.token_to_id(t) for t in SPELLABLE_SPECIAL_TOKENS}
    # An empty piece is one xgrammar never lets a grammar spell.
    encoded = ["" if index in hidden else piece for index, piece in enumerate(pieces[:vocab_size])]
    info = xgrammar.TokenizerInfo(
        encoded,
        vocab_type_of(tokenizer),
        vocab_size=vocab_size,
        stop_token_ids=sorted(tokenizer.eos_ids),
    )
    return xgrammar.GrammarCompiler(info, max_threads=1)


def vocab_type_of(tokenizer: Tokenizer) -> xgrammar.VocabType:
    """How the vocabulary spells bytes: SentencePiece's ▁ and <0xNN> (Gemma), or byte-level
    symbols (GPT-2's Ġ for a space)."""
    import xgrammar

    pieces = tokenizer.vocabulary_pieces
    if any(piece.startswith("\u2581") for piece in pieces[:5000]) or "<0x0A>" in pieces:
        return xgrammar.VocabType.BYTE_FALLBACK
    if "Ġ" in pieces or "Ċ" in pieces:
        return xgrammar.VocabType.BYTE_LEVEL
    return xgrammar.VocabType.RAW


@functools.lru_cache(maxsize=256)
def compile_constraint(
    constraint: OutputConstraint, tokenizer: Tokenizer, vocab_size: int
) -> xgrammar.CompiledGrammar:
    """`constraint` compiled for `tokenizer` (cached: a schema sent again costs nothing)."""
    if constraint.after_thought:  # the same grammar: compiled once for both
        return compile_constraint(
            dataclasses.replace(constraint, after_thought=False), tokenizer, vocab_size
        )
    grammar = constraint.to_grammar()
    return _compiler(tokenizer, vocab_size).compile_grammar(grammar)


class GrammarMatcher:
    """One request's place in its grammar: masks each step's logits and advances on the token
    taken. `stop_ids`: the tokens that end the request, allowed only where the grammar is
    complete; with none, the grammar's completion ends it (`terminated`).

    `thought` (the ids opening and closing a thought channel): the first token may open the
    channel instead of starting the grammar; inside it every token but a stop id is allowed
    (a reply cannot end mid-thought), and the grammar starts after the close."""

    def __init__(
        self,
        compiled: xgrammar.CompiledGrammar,
        stop_ids: Sequence[int],
        thought: tuple[int, int] | None = None,
    ) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(
            compiled,
            override_stop_tokens=list(stop_ids) or None,
            terminate_without_stop_token=not stop_ids,
        )
        vocab_size = compiled.tokenizer_info.vocab_size
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self._stop_ids = list(stop_ids)
        self._thought = thought
        self._phase: Literal["may_think", "thinking", "answer"] = (
            "may_think" if thought is not None else "answer"
        )

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` ([V] or [1, V]) with every token the grammar forbids at -inf."""
        if self._phase == "thinking":
            free = logits.float().clone()
            free[..., self._stop_ids] = -torch.inf
            return free
        masked = apply_bitmask(logits, self.fill_bitmask())
        if self._phase == "may_think" and self._thought is not None:
            opening = self._thought[0]
            masked[..., opening] = logits[..., opening].float()
        return masked

    def fill_bitmask(self) -> torch.Tensor:
        """The tokens allowed next, as xgrammar's bitmask (see `apply_bitmask`)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask

    def advance(self, token: int) -> None:
        if self._thought is not None and self._phase != "answer":
            opening, closing = self._thought
            if self._phase == "may_think" and token == opening:
                self._phase = "thinking"
                return
            if self._phase == "thinking":
                if token == closing:
                    self._phase = "answer"
                return
            self._phase = "answer"
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} was sampled against its grammar")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` ([V] or [1, V]) plus 0 where `bitmask` allows a token and -inf where it does
    not, in float32: a new tensor, the model's own stays untouched. The bitmask is xgrammar's,
    covering at least V tokens: int32 words of 32 tokens, least significant bit first (so, on
    a little-endian host, bytes of 8 tokens in order)."""
    octets = bitmask.reshape(-1).view(torch.uint8).to(logits.device, non_blocking=True)
    # One table row per byte value: a lookup is ~4x faster on a CPU than unpacking bits.
    additive = _byte_masks(logits.device).index_select(0, octets.long()).reshape(-1)
    return logits.float() + additive[: logits.shape[-1]]


@functools.cache
def _byte_masks(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: row b holds 0 where bit i of b is set, -inf where it is clear."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    table = torch.where(bits == 1, 0.0, -torch.inf).to(torch.float32)
    return table.to(device)


def matcher_for(
    constraint: OutputConstraint, tokenizer: Tokenizer, vocab_size: int, stop_ids: Iterable[int]
) -> GrammarMatcher:
    """A fresh matcher for one request (compiling the grammar on first use)."""
    compiled = compile_constraint(constraint, tokenizer, vocab_size)
    thought = None
    if constraint.after_thought:
        opening, closing = (tokenizer.token_to_id(mark) for mark in THOUGHT_MARKS)
        if opening is not None and closing is not None:  # else the model has no such channel
            thought = (opening, closing)
    return GrammarMatcher(compiled, sorted(stop_ids), thought)
