"""Sampling tests against distributions worked out by hand on a 5-token vocabulary.

Most tests feed ``log(p)`` as logits, so the temperature-1 distribution is exactly ``p`` and the
expected result of each filter can be read off ``p`` directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from hearth.runtime.sampling import Sampler, SamplingParams

# Token i has probability P5[i]; ranked by probability the tokens are 0, 1, 2, 3, 4.
P5 = [0.4, 0.3, 0.15, 0.1, 0.05]
# Powers of two, so float32 holds every probability and partial sum exactly (checked below).
DYADIC = [0.125, 0.5, 0.0625, 0.25, 0.0625]


def logits_of(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def renormalised(probs: Sequence[float], kept: Sequence[int]) -> list[float]:
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def tempered(probs: Sequence[float], temperature: float) -> list[float]:
    """softmax(log(p) / T) is p^(1/T), normalised."""
    weights = [p ** (1 / temperature) for p in probs]
    return [w / sum(weights) for w in weights]


def distribution(params: SamplingParams, logits: torch.Tensor, history=()) -> list[float]:
    return Sampler(params).probabilities(logits, history).tolist()


# --- temperature and greedy --------------------------------------------------------------


def test_temperature_one_samples_the_softmax() -> None:
    assert distribution(SamplingParams(temperature=1.0), logits_of(P5)) == pytest.approx(P5)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_divides_the_logprobs(temperature: float) -> None:
    expected = tempered(P5, temperature)
    # By hand for T = 0.5: squares 0.16, 0.09, 0.0225, 0.01, 0.0025 over their sum 0.285.
    if temperature == 0.5:
        assert expected[0] == pytest.approx(0.16 / 0.285)
    actual = distribution(SamplingParams(temperature=temperature), logits_of(P5))
    assert actual == pytest.approx(expected)


def test_greedy_takes_the_argmax_ignores_filters_and_uses_no_randomness() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=3))
    state = sampler._generator.get_state()
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 3.0, 1.0]])

    assert sampler.sample(logits, []).tolist() == [1, 3]
    single = sampler.sample(logits[0], [])
    assert single.shape == () and single.dtype == torch.long and single.item() == 1
    assert sampler.probabilities(logits[1], []).tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert torch.equal(sampler._generator.get_state(), state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_breaks_ties_toward_the_first_token(dtype: torch.dtype) -> None:
    """Tied maxima (exact in bf16) pick the lowest id, as `argmax` does, in rows long
    enough for the vectorized scans (a 262144-token vocabulary), wherever the tie sits."""
    sampler = Sampler(SamplingParams(temperature=0.0))
    logits = torch.zeros(3, 262144, dtype=dtype)
    ties = [(7, 200_001), (131_071, 131_072), (5, 262_143)]
    for row, (first, second) in enumerate(ties):
        logits[row, [first, second]] = 2.5
    assert sampler.sample(logits, []).tolist() == [first for first, _ in ties]


# --- each filter's kept set ----------------------------------------------------------------


def test_top_k_keeps_the_k_most_likely_tokens() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0])
    e2, e1 = math.exp(2.0), math.exp(1.0)
    expected = [0.0, e2 / (e2 + e1), 0.0, e1 / (e2 + e1), 0.0]
    assert distribution(SamplingParams(temperature=1.0, top_k=2), logits) == pytest.approx(expected)


def test_top_k_of_the_whole_vocab_keeps_everything() -> None:
    assert distribution(SamplingParams(temperature=1.0, top_k=5), logits_of(P5)) == pytest.approx(
        P5
    )


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, [0]),  # token 0 alone already holds 0.4
        (0.6, [0, 1]),  # 0.4 < 0.6 <= 0.4 + 0.3
        (0.75, [0, 1, 2]),  # 0.7 < 0.75 <= 0.85
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: list[int]) -> None:
    actual = distribution(SamplingParams(temperature=1.0, top_p=top_p), logits_of(P5))
    assert actual == pytest.approx(renormalised(P5, kept))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.5, [1]),  # token 1 holds exactly 0.5: it reaches p alone
        (0.75, [1, 3]),  # 0.5 + 0.25 is exactly 0.75: the set reaching p, nothing more
        (0.7500001, [1, 3, 0]),  # just past the boundary the next token (0.125) joins
    ],
)
def test_top_p_boundary_is_inclusive(top_p: float, kept: list[int]) -> None:
    logits = logits_of(DYADIC)
    assert logits.log_softmax(-1).exp().tolist() == DYADIC  # exact, so the boundary is exact
    actual = distribution(SamplingParams(temperature=1.0, top_p=top_p), logits)
    assert actual == pytest.approx(renormalised(DYADIC, kept))


def test_min_p_drops_tokens_below_a_fraction_of_the_top_one() -> None:
    shuffled = [0.1, 0.4, 0.05, 0.3, 0.15]
    # Threshold 0.3 * 0.4 = 0.12: keeps 0.4, 0.3 and 0.15.
    actual = distribution(SamplingParams(temperature=1.0, min_p=0.3), logits_of(shuffled))
    assert actual == pytest.approx([0.0, 0.4 / 0.85, 0.0, 0.3 / 0.85, 0.15 / 0.85])


def test_min_p_boundary_is_inclusive() -> None:
    # 0.25 is exactly 0.5 * 0.5, in float32 too (log 0.25 = 2 log 0.5, and doubling is exact),
    # so token 3 sits on the threshold and stays; only tokens strictly below it go.
    actual = distribution(SamplingParams(temperature=1.0, min_p=0.5), logits_of(DYADIC))
    assert actual == pytest.approx([0.0, 2 / 3, 0.0, 1 / 3, 0.0])


def test_min_tokens_to_keep_spares_the_most_likely_tokens_from_min_p() -> None:
    shuffled = [0.1, 0.4, 0.05, 0.3, 0.15]
    params = SamplingParams(temperature=1.0, min_p=0.3, min_tokens_to_keep=4)
    # min_p alone keeps three tokens; the fourth most likely (0.1, id 0) is spared too.
    actual = distribution(params, logits_of(shuffled))
    assert actual == pytest.approx([0.1 / 0.95, 0.4 / 0.95, 0.0, 0.3 / 0.95, 0.15 / 0.95])


# --- filters combined ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_p", "min_p", "top_k", "kept"),
    [
        (0.9, 0.2, 3, [0, 1, 2]),  # top_k binds: top_p keeps 4, min_p (>= 0.08) keeps 4
        (0.6, 0.2, 4, [0, 1]),  # top_p binds
        (0.9, 0.5, 4, [0, 1]),  # min_p binds (>= 0.2)
        (1.0, 0.3, 2, [0, 1]),  # min_p keeps 3, then top_k keeps 2
    ],
)
def test_combined_filters_keep_the_intersection(
    top_p: float, min_p: float, top_k: int, kept: list[int]
) -> None:
    params = SamplingParams(temperature=1.0, top_p=top_p, min_p=min_p, top_k=top_k)
    assert distribution(params, logits_of(P5)) == pytest.approx(renormalised(P5, kept))


def test_top_p_sees_the_full_distribution_not_the_top_k() -> None:
    # mlx-lm applies top_p first. Were top_k applied first and renormalised, top_p would see
    # (4/7, 3/7) and keep token 0 alone; on the full distribution 0.4 < 0.5 keeps tokens 0, 1.
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    assert distribution(params, logits_of(P5)) == pytest.approx([4 / 7, 3 / 7, 0, 0, 0])


def test_min_tokens_to_keep_does_not_revive_tokens_top_p_removed() -> None:
    # top_p keeps {0, 1}; min_p (>= 0.36) keeps {0}; sparing the top 3 gives back token 1 only.
    params = SamplingParams(temperature=1.0, top_p=0.6, min_p=0.9, min_tokens_to_keep=3)
    assert distribution(params, logits_of(P5)) == pytest.approx([4 / 7, 3 / 7, 0, 0, 0])


def test_min_tokens_to_keep_with_top_k() -> None:
    # min_p (>= 0.36) keeps {0}, sparing the top 3 adds {1, 2}, top_k = 4 removes nothing more.
    params = SamplingParams(temperature=1.0, top_k=4, min_p=0.9, min_tokens_to_keep=3)
    assert distribution(params, logits_of(P5)) == pytest.approx(renormalised(P5, [0, 1, 2]))


def test_temperature_applies_after_the_filters() -> None:
    # At T = 1, top_p = 0.6 keeps tokens 0 and 1, which T = 2 then flattens to sqrt(p).
    # Tempering first would give about (0.30, 0.26, 0.18, ...) and top_p would keep 3 tokens.
    params = SamplingParams(temperature=2.0, top_p=0.6)
    a, b = math.sqrt(0.4), math.sqrt(0.3)
    assert distribution(params, logits_of(P5)) == pytest.approx([a / (a + b), b / (a + b), 0, 0, 0])


# --- logits processors ---------------------------------------------------------------------


LOGITS = [2.0, -1.0, 0.5, 0.0, 1.0]


def processed(params: SamplingParams, logits: Sequence[float], history) -> list[float]:
    return Sampler(params).process_logits(torch.tensor(logits), history).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    params = SamplingParams(repetition_penalty=2.0)
    # Tokens 0 (2.0), 1 (-1.0, seen twice yet penalised once) and 3 (0.0 stays 0.0).
    expected = [1.0, -2.0, 0.5, 0.0, 1.0]
    assert processed(params, LOGITS, [0, 1, 1, 3]) == expected
    assert processed(params, LOGITS, torch.tensor([0, 1, 1, 3])) == expected


def test_repetition_penalty_only_sees_the_context_window() -> None:
    params = SamplingParams(repetition_penalty=2.0, repetition_context_size=2)
    assert processed(params, LOGITS, [0, 4, 1]) == [2.0, -2.0, 0.5, 0.0, 0.5]
    # Default window of 20: token 0 lies 21 tokens back, out of reach.
    default = SamplingParams(repetition_penalty=2.0)
    assert processed(default, LOGITS, [0] + [3] * 20) == LOGITS


def test_presence_and_frequency_penalties_follow_openai() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Token 1 seen once: -0.5 - 0.25. Token 2 seen three times: -0.5 - 3 * 0.25.
    assert processed(params, [0.0] * 5, [1, 2, 2, 2]) == [0.0, -0.75, -1.25, 0.0, 0.0]


def test_presence_penalty_counts_the_whole_history() -> None:
    params = SamplingParams(presence_penalty=1.0, repetition_context_size=2)
    assert processed(params, [0.0] * 5, [4] + [0] * 30) == [-1.0, 0.0, 0.0, 0.0, -1.0]


def test_logit_bias_is_added() -> None:
    params = SamplingParams(logit_bias={0: 5.0, 3: -1.5})
    assert processed(params, [0.0, 1.0, 2.0, 3.0, 4.0], []) == [5.0, 1.0, 2.0, 1.5, 4.0]


def test_processors_run_in_mlx_lm_order() -> None:
    # Bias before repetition: (1 - 3) * 2 = -4, not 1 / 2 - 3 = -2.5.
    bias_first = SamplingParams(logit_bias={0: -3.0}, repetition_penalty=2.0)
    assert processed(bias_first, [1.0, 0.0], [0])[0] == -4.0
    # Repetition before presence: 1 / 2 - 1 = -0.5, not (1 - 1) / 2 = 0.
    repetition_first = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0)
    assert processed(repetition_first, [1.0, 0.0], [0])[0] == -0.5


def test_history_per_row_or_shared_across_the_batch() -> None:
    sampler = Sampler(SamplingParams(frequency_penalty=1.0))
    logits = torch.zeros(2, 5)
    per_row = sampler.process_logits(logits, torch.tensor([[0, 0], [1, 1]]))
    assert per_row.tolist() == [[-2.0, 0, 0, 0, 0], [0, -2.0, 0, 0, 0]]
    shared = sampler.process_logits(logits, [4])
    assert shared.tolist() == [[0, 0, 0, 0, -1.0]] * 2


def test_process_logits_leaves_the_input_alone_and_computes_in_float32() -> None:
    params = SamplingParams(logit_bias={0: 1.0}, repetition_penalty=2.0, frequency_penalty=1.0)
    logits = torch.tensor([1.0, 2.0, 3.0])
    Sampler(params).process_logits(logits, [0, 1])
    assert logits.tolist() == [1.0, 2.0, 3.0]
    assert Sampler(params).process_logits(logits.bfloat16(), [0]).dtype == torch.float32


def test_logprobs_report_the_processed_distribution_before_filters() -> None:
    # Bias ln 3 on token 0 of four equal logits: probabilities 3/6, 1/6, 1/6, 1/6.
    params = SamplingParams(temperature=0.5, top_k=1, logit_bias={0: math.log(3)})
    actual = Sampler(params).logprobs(torch.zeros(4), []).tolist()
    assert actual == pytest.approx([math.log(1 / 2)] + [math.log(1 / 6)] * 3)


# --- random draws --------------------------------------------------------------------------


def draws(seed: int | None, count: int = 200) -> list[int]:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    return sampler.sample(torch.zeros(count, 5), []).tolist()


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    assert draws(1234) == draws(1234)
    # 200 uniform draws over 5 tokens coincide with probability 5**-200.
    assert draws(1234) != draws(1235)
    assert draws(None) != draws(None)


def test_successive_calls_advance_the_generator() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    first = sampler.sample(torch.zeros(200, 5), [])
    assert first.shape == (200,) and first.device == torch.device("cpu")
    assert not torch.equal(first, sampler.sample(torch.zeros(200, 5), []))
    assert Sampler(SamplingParams(temperature=1.0, seed=5)).sample(torch.zeros(5), []).shape == ()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # top_k path (candidates from torch.topk): tokens 0-3 tempered by T = 0.7.
        (SamplingParams(temperature=0.7, top_k=4, seed=11), [*tempered(P5[:4], 0.7), 0.0]),
        # sorted path: top_p = 0.8 keeps tokens 0-2.
        (SamplingParams(temperature=1.0, top_p=0.8, seed=12), renormalised(P5, [0, 1, 2])),
        # full-vocab path: min_p = 0.2 (>= 0.08) keeps tokens 0-3, tempered by T = 1.5.
        (SamplingParams(temperature=1.5, min_p=0.2, seed=13), [*tempered(P5[:4], 1.5), 0.0]),
    ],
)
def test_sampled_frequencies_match_the_distribution(
    params: SamplingParams, expected: list[float]
) -> None:
    n = 20_000
    tokens = Sampler(params).sample(logits_of(P5).expand(n, 5), [])
    counts = torch.bincount(tokens, minlength=5).tolist()
    for count, q in zip(counts, expected, strict=True):
        if q == 0:
            assert count == 0  # a filtered token must never be drawn
            continue
        # count ~ Binomial(n, q): its frequency has standard error sqrt(q(1-q)/n), and by the
        # CLT |z| > 5 happens with probability ~6e-7 per token, so a failure means a real bias
        # (the seeds make the run deterministic anyway).
        standard_error = math.sqrt(q * (1 - q) / n)
        assert abs(count / n - q) < 5 * standard_error, (counts, expected)


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_p": math.inf}, "top_p must be a finite number"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"min_p": 1.1}, "min_p must be in [0, 1]"),
        ({"min_tokens_to_keep": 0}, "min_tokens_to_keep must be >= 1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_context_size": 0}, "repetition_context_size must be >= 1"),
        ({"presence_penalty": -math.inf}, "presence_penalty must be a finite number"),
        ({"frequency_penalty": math.nan}, "frequency_penalty must be a finite number"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id must be an integer >= 0"),
        ({"logit_bias": {5: 1.0}}, "logit_bias token id must be an integer >= 0 and < vocab"),
        ({"logit_bias": {0: math.nan}}, "logit_bias for token 0 must be a finite number"),
        ({"seed": "7"}, "seed must be an integer in [0, 2**64 - 1], -1 (random) or None"),
        # torch's generators overflow past 2**64 - 1, and wrap negatives onto valid seeds.
        ({"seed": 2**64}, "seed must be an integer in [0, 2**64 - 1]"),
        ({"seed": -2}, "seed must be an integer in [0, 2**64 - 1]"),
    ],
)
def test_validate_rejects_bad_params_in_one_line(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=r"^[^\n]*$") as error:
        SamplingParams(**fields).validate(vocab_size=5)
    assert message in str(error.value)


def test_validate_accepts_the_defaults_and_edge_values() -> None:
    SamplingParams().validate(vocab_size=5)
    SamplingParams(top_p=1.0, min_p=1.0, top_k=0, logit_bias={4: -100.0}).validate(vocab_size=5)
    for seed in (0, 2**64 - 1, -1):
        Sampler(SamplingParams(seed=seed))


def test_seed_minus_one_draws_a_fresh_seed_each_time() -> None:
    """-1 means random (llama.cpp's convention), not torch's wrap-around of -1 onto 2**64-1:
    two samplers draw different sequences (equal with probability 1000**-40), while two
    with the same seed agree."""
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0, seed=-1)

    def draws(sampler: Sampler) -> list[int]:
        return [int(sampler.sample(logits, [])) for _ in range(40)]

    assert draws(Sampler(params)) != draws(Sampler(params))
    seeded = SamplingParams(temperature=1.0, seed=2**64 - 1)
    assert draws(Sampler(seeded)) == draws(Sampler(seeded))


def test_sampler_validates_and_checks_the_bias_against_the_vocab() -> None:
    with pytest.raises(ValueError, match="temperature"):
        Sampler(SamplingParams(temperature=-1.0))
    sampler = Sampler(SamplingParams(logit_bias={7: 1.0}))
    with pytest.raises(ValueError, match="outside the vocab of 5"):
        sampler.process_logits(torch.zeros(5), [])
    with pytest.raises(ValueError, match="batch, vocab"):
        sampler.process_logits(torch.zeros(1, 1, 5), [])


# --- optional oracle -----------------------------------------------------------------------


def test_filters_match_mlx_lm() -> None:
    mx = pytest.importorskip("mlx.core", reason="mlx not installed; hand-computed tests cover this")
    sample_utils = pytest.importorskip("mlx_lm.sample_utils", reason="mlx-lm is not installed")
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    for top_p, min_p, top_k in [(0.9, 0.0, 0), (1.0, 0.1, 0), (1.0, 0.0, 8), (0.8, 0.05, 10)]:
        filtered = mx.array(logits.log_softmax(-1).numpy())[None]
        if top_p < 1:
            filtered = sample_utils.apply_top_p(filtered, top_p)
        if min_p > 0:
            filtered = sample_utils.apply_min_p(filtered, min_p, 1)
        if top_k > 0:
            filtered = sample_utils.apply_top_k(filtered, top_k)
        expected = torch.tensor(mx.softmax(filtered, axis=-1)[0].tolist())
        params = SamplingParams(temperature=1.0, top_p=top_p, min_p=min_p, top_k=top_k)
        torch.testing.assert_close(Sampler(params).probabilities(logits, []), expected)
