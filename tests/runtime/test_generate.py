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


def test_one_max_tokens_default_shrunk_to_the_room_left() -> None:
    """512 (mlx_lm.server's) for the CLI, the library and the server; shrunk to what the
    prompt leaves of the context, while a given count is checked, never cut."""
    from hearth.cli import build_parser
    from hearth.lengths import DEFAULT_MAX_TOKENS, generation_limit
    from hearth.server.state import ServerDefaults

    assert DEFAULT_MAX_TOKENS == 512
    assert build_parser().parse_args(["serve"]).max_tokens == DEFAULT_MAX_TOKENS
    assert ServerDefaults().max_tokens == DEFAULT_MAX_TOKENS
    assert build_parser().parse_args(["generate", "Hi"]).max_tokens is None  # the library's
    assert generation_limit(13, None, 32768) == 512
    assert generation_limit(32765, None, 32768) == 3
    assert generation_limit(32765, 3, 32768) == 3
    with pytest.raises(ValueError, match="max_tokens 4 plus the prompt's 32765 tokens"):
        generation_limit(32765, 4, 32768)


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_below_one_is_refused(hearth_270m: Any, max_tokens: int) -> None:
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        hearth_270m.generate(PROMPT, max_tokens=max_tokens)


def test_a_prompt_the_context_cannot_hold_is_refused(hearth_270m: Any) -> None:
    """Over 40,000 tokens on a model of 32,768 positions: a ValueError before any prefill,
    where the loop used to run on past the positions and print whitespace; and a max_tokens
    that does not fit beside a prompt that does."""
    from hearth.runtime.generate import stream_generate

    prompt = "hello " * 40_000
    tokens = len(hearth_270m.encode(prompt))
    assert tokens > 40_000
    with pytest.raises(ValueError, match=f"the prompt has {tokens} tokens; this model's context"):
        hearth_270m.generate(prompt)
    ids = [2] + [9259] * 32699
    chunks = stream_generate(hearth_270m.model, hearth_270m.tokenizer, ids, max_tokens=100)
    with pytest.raises(ValueError, match="max_tokens 100 plus the prompt's 32700 tokens"):
        next(chunks)


def test_peak_memory_is_this_process_not_its_parent() -> None:
    """A process started by a large one reports its own peak: Linux carries ru_maxrss across
    fork and exec, so `hearth generate` run from a big parent (a test suite, an IDE) once
    reported the parent's peak. The parent here holds 1 GiB; the child only imports torch
    (a few hundred MiB)."""
    import subprocess
    import sys

    import torch

    held = torch.ones(2**30 // 4)  # 1 GiB, resident
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from hearth.runtime.generate import peak_resident_bytes; print(peak_resident_bytes())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert held.sum() > 0
    assert int(child.stdout) < 2**30 * 0.8, child.stdout
