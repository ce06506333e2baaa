"""The generation loop on the real model: streaming, stop handling, statistics."""

from __future__ import annotations

from typing import Any

import pytest

from hearth.runtime.generate import FINISH_LENGTH, FINISH_STOP, StopStrings
from hearth.runtime.sampling import SamplingParams

PROMPT = "The capital of France is Paris. The capital of Germany is"


def test_stop_strings_hold_back_partial_matches() -> None:
    stops = StopStrings(["END", "\n\n"])
    assert stops.feed("hello E") == "hello "
    assert stops.feed("N") == ""
    assert stops.feed("x more") == "ENx more"
    assert stops.feed("\n") == ""
    assert stops.feed("\nrest") == "" and stops.stopped


def test_stop_string_split_across_tokens_is_cut() -> None:
    stops = StopStrings(["Berlin."])
    pieces = [stops.feed(t) for t in (" Ber", "lin", ". The")]
    assert "".join(pieces) == " " and stops.stopped and stops.matched == "Berlin."


def test_the_earliest_stop_string_wins() -> None:
    stops = StopStrings(["b", "a"])
    assert stops.feed("xab") == "x" and stops.matched == "a"


def test_stream_matches_token_decode_and_reports_stats(hearth_270m: Any) -> None:
    chunks = list(hearth_270m.stream(PROMPT, max_tokens=12))
    tokens = [c.token for c in chunks if c.token is not None]
    text = "".join(c.text for c in chunks)
    assert text == hearth_270m.tokenizer.decode(tokens)
    final = chunks[-1]
    assert final.finish_reason == FINISH_LENGTH and final.stats is not None
    assert final.stats.prompt_tokens == 13 and final.stats.generated_tokens == 12
    assert final.stats.prefill_tokens_per_second > 0 and final.stats.peak_memory_bytes > 0


def test_stop_string_finishes_with_stop(hearth_270m: Any) -> None:
    chunks = list(hearth_270m.stream(PROMPT, max_tokens=30, stop=["!", "."]))
    assert "".join(c.text for c in chunks) == " Berlin"
    assert chunks[-1].finish_reason == FINISH_STOP and chunks[-1].stop_sequence == "."


def test_cancel_ends_the_stream_without_a_final_chunk(hearth_270m: Any) -> None:
    from hearth.runtime.generate import stream_generate

    ids = hearth_270m.tokenizer.encode(PROMPT)
    seen: list[Any] = []
    chunks = stream_generate(
        hearth_270m.model,
        hearth_270m.tokenizer,
        ids,
        max_tokens=50,
        cancelled=lambda: len(seen) >= 2,
    )
    for chunk in chunks:
        seen.append(chunk)
    assert len(seen) == 2 and all(c.finish_reason is None for c in seen)


def test_eos_id_stops_generation(hearth_270m: Any) -> None:
    """Declaring the first greedy token an end id must stop before any text."""
    first = hearth_270m.tokenizer.encode(" Berlin", add_special_tokens=False)[0]
    from hearth.runtime.generate import stream_generate

    ids = hearth_270m.tokenizer.encode(PROMPT)
    chunks = list(
        stream_generate(
            hearth_270m.model, hearth_270m.tokenizer, ids, max_tokens=10, stop_ids=[first]
        )
    )
    assert [c.text for c in chunks] == [""] and chunks[0].finish_reason == FINISH_STOP


def test_seeded_sampling_is_reproducible(hearth_270m: Any) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    first = hearth_270m.generate(PROMPT, max_tokens=10, sampling=params)
    assert hearth_270m.generate(PROMPT, max_tokens=10, sampling=params) == first


def test_invalid_sampling_is_refused(hearth_270m: Any) -> None:
    with pytest.raises(ValueError, match="top_p"):
        hearth_270m.generate(PROMPT, sampling=SamplingParams(top_p=0.0))
