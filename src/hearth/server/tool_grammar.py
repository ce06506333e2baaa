"""A grammar that forces a well-formed Gemma 4 tool call (`tool_choice` "required" or a named
tool): `call:NAME{key:value,…}<tool_call|>` to one of the declared tools, with arguments that
satisfy that tool's JSON schema, in Gemma's argument syntax (bare keys, strings between
`<|"|>` marks, JSON numbers and literals).

The prompt already ends with the call's opening (`ToolChoice.reply_prefix`), so the grammar
covers the rest. A schema keyword this grammar cannot enforce is refused (ConstraintError).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from hearth.runtime.constraints import ConstraintError, OutputConstraint, ebnf_literal
from hearth.server.tools import STRING_MARK, TOOL_CALL_END, TOOL_CALL_START, ToolChoice

# Integer ranges up to this wide are spelled out as alternatives; wider ones are refused.
MAX_ENUMERATED_RANGE = 1000
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "strict"}
)
_KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength", "enum", "const"},
    "integer": {"type", "minimum", "maximum", "enum", "const"},
    "number": {"type", "enum", "const"},
    "boolean": {"type", "enum", "const"},
    "null": {"type"},
}
# Text inside a Gemma string: anything but the '<' that could start its closing mark.
_STRING_CHAR = "[^<]"
_GENERIC_RULES = f"""
gemma_any ::= gemma_string | gemma_number | "true" | "false" | "null" | gemma_object | gemma_array
gemma_string ::= {ebnf_literal(STRING_MARK)} {_STRING_CHAR}* {ebnf_literal(STRING_MARK)}
gemma_number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)?
gemma_key ::= [a-zA-Z_] [a-zA-Z0-9_]*
gemma_object ::= "{{" (gemma_key ":" gemma_any ("," gemma_key ":" gemma_any)*)? "}}"
gemma_array ::= "[" (gemma_any ("," gemma_any)*)? "]"
"""


def forced_call_constraint(
    policy: ToolChoice, tools: list[dict[str, Any]] | None
) -> OutputConstraint | None:
    """The grammar of the call `policy` forces (None when it forces none). `tools`: as the
    chat template takes them, `{"type": "function", "function": {"name", "parameters"}}`."""
    if not policy.required or not tools:
        return None
    functions = [tool["function"] for tool in tools]
    if policy.name is not None:
        functions = [f for f in functions if f["name"] == policy.name]
    writer = _GrammarWriter()
    calls = []  # each tool's call after `call:`: NAME{arguments}
    for function in functions:
        schema = function.get("parameters") or {"type": "object"}
        writer.defs = schema.get("$defs", {}) if isinstance(schema, Mapping) else {}
        body = writer.object_rest(schema, f"tool {function['name']!r}")
        calls.append(f"{ebnf_literal(function['name'] + '{')} {body}")
    end = ebnf_literal(TOOL_CALL_END)
    # The prompt already opened the first call with `call:` (and `NAME{` for a named tool).
    first = f"{body} {end}" if policy.name else f"call {end}"
    more = f"({ebnf_literal(TOOL_CALL_START + 'call:')} call {end})*" if policy.parallel else ""
    rules = [f"root ::= {first} {more}", f"call ::= {' | '.join(calls)}", *writer.rules]
    return OutputConstraint.grammar("\n".join([*rules, _GENERIC_RULES]))


class _GrammarWriter:
    """Writes one EBNF rule per schema node, in Gemma's argument syntax."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.defs: Mapping[str, Any] = {}
        self._def_rules: dict[str, str] = {}

    def _new_rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def rule(self, schema: Any, where: str) -> str:
        """A rule matching values of `schema` (its name, or an inline expression)."""
        if schema is True or schema == {}:
            return "gemma_any"
        if not isinstance(schema, Mapping):
            raise ConstraintError(f"{where}: a schema must be an object")
        if "$ref" in schema:
            return self._reference(schema["$ref"], where)
        if "anyOf" in schema:
            options = [self.rule(option, where) for option in schema["anyOf"]]
            return self._new_rule(" | ".join(options))
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            return self._new_rule(" | ".join(ebnf_literal(gemma_text(v)) for v in values))
        kinds = schema.get("type", "object" if "properties" in schema else None)
        if kinds is None:
            return "gemma_any"
        if isinstance(kinds, list):
            return self._new_rule(" | ".join(self._typed(schema, k, where) for k in kinds))
        return self._typed(schema, kinds, where)

    def _typed(self, schema: Mapping[str, Any], kind: str, where: str) -> str:
        if kind not in _KEYWORDS:
            raise ConstraintError(f"{where}: unknown type {kind!r}")
        unsupported = set(schema) - _KEYWORDS[kind] - _ANNOTATIONS - {"$defs"}
        if unsupported:
            keyword = sorted(unsupported)[0]
            raise ConstraintError(
                f"{where}: the keyword {keyword!r} cannot be enforced in a forced tool call"
            )
        if kind == "object":
            return self._new_rule(f'"{{" {self.object_rest(schema, where)}')
        if kind == "array":
            return self._array(schema, where)
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            count = f"{{{low},{high}}}" if high is not None else f"{{{low},}}" if low else "*"
            mark = ebnf_literal(STRING_MARK)
            return self._new_rule(f"{mark} {_STRING_CHAR}{count} {mark}")
        if kind == "integer":
            return self._integer(schema, where)
        if kind == "number":
            return "gemma_number"
        return '"true" | "false"' if kind == "boolean" else '"null"'

    def object_rest(self, schema: Mapping[str, Any], where: str) -> str:
        """An object after its `{`: its properties in declared order (the optional ones may
        be left out), then `}`. Keys are bare, as Gemma writes them in a call."""
        properties: Mapping[str, Any] = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        if unknown := required - set(properties):
            raise ConstraintError(f"{where}: required {sorted(unknown)[0]!r} has no schema")
        pairs = [
            (f"{ebnf_literal(name + ':')} {self.rule(value, f'{where}.{name}')}", name in required)
            for name, value in properties.items()
        ]
        # after_i: the properties from i on, once one is written; first_i: none written yet.
        after, first = '""', '""'
        for pair, is_required in reversed(pairs):
            skip_after, skip_first = ("", "") if is_required else (f" | {after}", f" | {first}")
            after_rule = self._new_rule(f'"," {pair} {after}{skip_after}')
            first = self._new_rule(f"{pair} {after}{skip_first}")
            after = after_rule
        return f'{first} "}}"'

    def _array(self, schema: Mapping[str, Any], where: str) -> str:
        item = self.rule(schema.get("items", True), f"{where}[]")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high == 0:
            return self._new_rule('"[" "]"')
        rest_high = "" if high is None else str(high - 1)
        rest = f'("," {item}){{{max(low - 1, 0)},{rest_high}}}'
        items = f"{item} {rest}"
        return self._new_rule(f'"[" {items} "]"' if low else f'"[" ({items})? "]"')

    def _integer(self, schema: Mapping[str, Any], where: str) -> str:
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and high is not None:
            if high - low > MAX_ENUMERATED_RANGE:
                raise ConstraintError(
                    f"{where}: an integer range wider than {MAX_ENUMERATED_RANGE} cannot be "
                    "enforced in a forced tool call"
                )
            return self._new_rule(" | ".join(f'"{n}"' for n in range(int(low), int(high) + 1)))
        if high is not None or (low is not None and low not in (0, 1)):
            raise ConstraintError(
                f"{where}: an integer bound other than minimum 0 or 1 needs both bounds"
            )
        digits = '("0" | [1-9] [0-9]*)' if low == 0 else "[1-9] [0-9]*"
        return self._new_rule(digits if low is not None else '"-"? ("0" | [1-9] [0-9]*)')

    def _reference(self, reference: str, where: str) -> str:
        match = re.fullmatch(r"#/\$defs/([^/]+)", reference)
        if match is None or match.group(1) not in self.defs:
            raise ConstraintError(f"{where}: cannot resolve $ref {reference!r}")
        name = match.group(1)
        if name not in self._def_rules:
            # Named before it is written, so a recursive definition refers to itself.
            rule = f"d{len(self._def_rules)}"
            self._def_rules[name] = rule
            self.rules.append(f"{rule} ::= {self.rule(self.defs[name], f'{where}.{name}')}")
        return self._def_rules[name]


def gemma_text(value: Any) -> str:
    """A JSON value as Gemma writes it in a call: strings between marks, keys bare."""
    if isinstance(value, str):
        return f"{STRING_MARK}{value}{STRING_MARK}"
    if isinstance(value, Mapping):
        items = ",".join(f"{key}:{gemma_text(item)}" for key, item in value.items())
        return "{" + items + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_text(item) for item in value) + "]"
    return json.dumps(value)
