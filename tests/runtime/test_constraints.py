"""Grammar-constrained decoding (`runtime.constraints`) on the embedded 270M base model, which
never writes JSON by itself: every constrained output matches its constraint, checked by an
independent oracle (`jsonschema`, Python's `re`), in the single-request loop and in the
scheduler's batched step, greedy and sampled."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar

from hearth.runtime.constraints import ConstraintError, OutputConstraint, apply_bitmask
from hearth.runtime.generate import GenerationChunk, GenerationRequest, stream_generate
from hearth.runtime.sampling import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
}
CODE = r"[A-Z]{2}-\d{3}"


def _generate(engine: Any, prompt: str, constraint: OutputConstraint, **options: Any) -> Any:
    chunks = list(
        stream_generate(
            engine.runner,
            engine.tokenizer,
            engine.tokenizer.encode(prompt),
            options.pop("sampling", None),
            options.pop("max_tokens", 48),
            constraint=constraint,
            **options,
        )
    )
    return "".join(chunk.text for chunk in chunks), chunks[-1]


def test_bitmask_matches_xgrammars_own_kernel() -> None:
    """Our torch masking (a byte lookup table, any device) against xgrammar's CPU kernel on
    random masks, exactly: both only copy logits or write -inf."""
    generator = torch.Generator().manual_seed(0)
    for vocab in (262144, 300, 33):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (1, words), generator=generator).int()
        logits = torch.randn(1, vocab, generator=generator)
        expected = logits.clone()
        xgrammar.apply_token_bitmask_inplace(expected, bitmask)
        assert torch.equal(apply_bitmask(logits, bitmask), expected)


@pytest.mark.slow
def test_json_schema_greedy_and_sampled(hearth_270m: Any) -> None:
    constraint = OutputConstraint.json_schema(PERSON)
    for sampling in (None, SamplingParams(temperature=1.0, seed=7)):
        text, last = _generate(hearth_270m, "My cat", constraint, sampling=sampling)
        assert last.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.slow
def test_regex_and_choice_end_where_complete(hearth_270m: Any) -> None:
    """The end of sequence is allowed only where the grammar is complete; with no end ids at
    all, the grammar's completion ends the reply."""
    text, last = _generate(hearth_270m, "Code:", OutputConstraint.regex(CODE))
    assert re.fullmatch(CODE, text) and last.finish_reason == "stop"
    choices = ("red", 'a "quoted" answer', "blue sky")
    choice = OutputConstraint.choice(choices)
    text, last = _generate(hearth_270m, "The sky is", choice, stop_ids=())
    assert text in choices and last.finish_reason == "stop"


@pytest.mark.slow
def test_scheduler_masks_each_row_with_its_own_grammar(hearth_270m: Any) -> None:
    """Three requests decoded in one batch: two constrained differently, one free."""
    scheduler = hearth_270m.scheduler(max_running=3)
    constraints = [OutputConstraint.json_schema(PERSON), OutputConstraint.regex(CODE), None]
    outputs: list[list[GenerationChunk]] = [[], [], []]
    for constraint, chunks in zip(constraints, outputs, strict=True):
        request = GenerationRequest(
            hearth_270m.tokenizer.encode("Here it is:"), max_tokens=40, constraint=constraint
        )
        scheduler.submit(request, chunks.append, lambda: False)
    for _ in range(500):
        if scheduler.idle:
            break
        scheduler.step()
    texts = ["".join(chunk.text for chunk in chunks) for chunks in outputs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    assert re.fullmatch(CODE, texts[1])
    assert not texts[2].startswith("{")  # the free one is not held to anything
    assert [chunks[-1].finish_reason for chunks in outputs[:2]] == ["stop", "stop"]


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "#/properties/a"),
        ({"oneOf": [{"type": "string"}]}, "'oneOf'"),
        ({"type": "strng"}, "unknown type"),
        ({"type": "string", "format": "credit-card"}, "'credit-card'"),
        ({"type": "object", "required": "a"}, "#/required"),
        ("{not json", "not valid JSON"),
    ],
)
def test_unenforceable_schemas_are_refused(schema: object, named: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(named)):
        OutputConstraint.json_schema(schema)


def test_uncompilable_patterns_and_grammars_are_refused() -> None:
    for constraint, message in [
        (OutputConstraint.regex("(ab"), "the regex does not compile"),
        (OutputConstraint.regex("(?=a)b"), "Lookahead"),
        (OutputConstraint.grammar("root ::= missing_rule"), "the grammar does not compile"),
        (OutputConstraint.json_schema({"$ref": "#/$defs/nowhere"}), "the JSON schema"),
    ]:
        with pytest.raises(ConstraintError, match=re.escape(message)):
            constraint.to_grammar()
    with pytest.raises(ConstraintError, match="non-empty string"):
        OutputConstraint.choice([])
