"""XTC and the penalty windows (mlx_lm.server's `xtc_*` and `*_context_size` fields) against
mlx-lm's own `sample_utils`, run here as the oracle, and against a hand-worked distribution."""

from __future__ import annotations

import math

import pytest
import torch

from hearth.runtime.sampling import Sampler, SamplingParams

mx = pytest.importorskip("mlx.core", reason="mlx is a dev dependency: the oracle")
sample_utils = pytest.importorskip("mlx_lm.sample_utils", reason="mlx-lm is a dev dependency")

VOCAB = 64
# Probabilities 0.487, 0.092, 0.047, 0.045, 0.032, ...: a few tokens above each threshold below.
LOGITS = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 1.5


def _mlx_distribution(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
    xtc: tuple[float, list[int]] | None = None,
) -> torch.Tensor:
    """What mlx-lm's make_sampler draws from: its filters in its own order (top_p, min_p, XTC
    applied for sure, top_k), then softmax(logprobs / temperature), categorical's law."""
    filtered = mx.array(logits.log_softmax(-1).numpy())[None]
    if 0 < top_p < 1:
        filtered = sample_utils.apply_top_p(filtered, top_p)
    if min_p > 0:
        filtered = sample_utils.apply_min_p(filtered, min_p, 1)
    if xtc is not None:
        threshold, special = xtc
        filtered = sample_utils.apply_xtc(filtered, 1.0, threshold, special)
    if top_k > 0:
        filtered = sample_utils.apply_top_k(filtered, top_k)
    return torch.tensor(mx.softmax(filtered * (1 / temperature), axis=-1)[0].tolist())


# (temperature, top_p, min_p, top_k, threshold, special): XTC alone, after each filter, before
# top_k (which then keeps the best survivors, not the best tokens), sparing special tokens.
CASES = [
    (1.0, 1.0, 0.0, 0, 0.08, []),
    (0.7, 1.0, 0.0, 0, 0.02, []),
    (1.0, 0.9, 0.0, 0, 0.04, []),
    (1.3, 1.0, 0.05, 0, 0.04, []),
    (1.0, 1.0, 0.0, 5, 0.03, []),
    (0.8, 0.95, 0.01, 6, 0.02, []),
    (1.0, 1.0, 0.0, 0, 0.02, [int(LOGITS.argmax())]),  # the top token is never removed
    (1.0, 1.0, 0.0, 0, 0.5, []),  # at most one token above: nothing removed
]


@pytest.mark.parametrize(("temperature", "top_p", "min_p", "top_k", "threshold", "special"), CASES)
def test_xtc_applied_matches_mlx_lm(
    temperature: float, top_p: float, min_p: float, top_k: int, threshold: float, special: list
) -> None:
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        min_p=min_p,
        top_k=top_k,
        xtc_probability=1.0,
        xtc_threshold=threshold,
        xtc_special_tokens=tuple(special),
    )
    expected = _mlx_distribution(
        LOGITS,
        temperature=temperature,
        top_p=top_p,
        min_p=min_p,
        top_k=top_k,
        xtc=(threshold, special),
    )
    # The XTC cases must remove something, or they would test nothing (the last one excepted).
    plain = _mlx_distribution(
        LOGITS, temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k
    )
    assert (threshold == 0.5) == torch.equal(expected > 0, plain > 0)
    # Both sides are float32 softmaxes of the same float32 log-probabilities: default tolerances.
    torch.testing.assert_close(Sampler(params).probabilities(LOGITS, []), expected)


def test_xtc_probability_mixes_the_two_distributions() -> None:
    """With probability p XTC applies at a step, so the law of one draw is the mixture."""
    params = SamplingParams(temperature=1.0, top_k=8, xtc_probability=0.3, xtc_threshold=0.05)
    with_xtc = _mlx_distribution(LOGITS, temperature=1.0, top_k=8, xtc=(0.05, []))
    without = _mlx_distribution(LOGITS, temperature=1.0, top_k=8)
    torch.testing.assert_close(
        Sampler(params).probabilities(LOGITS, []), 0.3 * with_xtc + 0.7 * without
    )


def test_xtc_draws_follow_the_mixture() -> None:
    """Worked by hand: p = [0.4, 0.3, 0.15, 0.1, 0.05], threshold 0.2: tokens 0 and 1 are above
    it, and all but the least likely of them (token 1) go, so XTC removes token 0 and the rest
    renormalise over 0.6. With xtc_probability 0.5 the draw's law is the average."""
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    removed = [0.0, 0.3 / 0.6, 0.15 / 0.6, 0.1 / 0.6, 0.05 / 0.6]
    expected = [(a + b) / 2 for a, b in zip(probs, removed, strict=True)]
    params = SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.2, seed=7)
    n = 20_000
    logits = torch.tensor([math.log(p) for p in probs]).expand(n, 5)
    counts = torch.bincount(Sampler(params).sample(logits, []), minlength=5).tolist()
    for count, q in zip(counts, expected, strict=True):
        # Binomial(n, q): |z| > 5 has probability ~6e-7 per token (the seed fixes the run).
        assert abs(count / n - q) < 5 * math.sqrt(q * (1 - q) / n), (counts, expected)


def test_greedy_ignores_xtc() -> None:
    # mlx-lm's make_sampler returns argmax at temperature 0, before any filter.
    params = SamplingParams(temperature=0.0, xtc_probability=1.0, xtc_threshold=0.01)
    assert int(Sampler(params).sample(LOGITS, [])) == int(LOGITS.argmax())


def _mlx_processed(logits: torch.Tensor, history: list[int], **kwargs: float) -> torch.Tensor:
    processors = sample_utils.make_logits_processors(**kwargs)
    tokens, out = mx.array(history), mx.array(logits.numpy())[None]
    for processor in processors:
        out = processor(tokens, out)
    return torch.tensor(out[0].tolist())


@pytest.mark.parametrize(
    "windows",
    [
        {"presence_context_size": 3, "frequency_context_size": 5, "repetition_context_size": 4},
        {"presence_context_size": 20, "frequency_context_size": 2, "repetition_context_size": 20},
        {"presence_context_size": 1, "frequency_context_size": 1, "repetition_context_size": 1},
    ],
)
def test_penalty_windows_match_mlx_lm(windows: dict[str, int]) -> None:
    """Each penalty counts only its own window of the latest tokens, as mlx-lm's processors."""
    history = [3, 7, 7, 1, 9, 7, 3, 3, 12, 7]
    penalties = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.3}
    expected = _mlx_processed(LOGITS, history, **penalties, **windows)
    params = SamplingParams(**penalties, **windows)  # type: ignore[arg-type]
    # Subtractions and one multiply per logit on float32 values: exact up to float32 rounding.
    torch.testing.assert_close(Sampler(params).process_logits(LOGITS, history), expected)


def test_without_windows_presence_counts_the_whole_history() -> None:
    """The library's default (None) keeps OpenAI's whole-history penalties."""
    history = [5, 1, 2, 3]
    processed = Sampler(SamplingParams(presence_penalty=1.0)).process_logits(LOGITS, history)
    windowed = Sampler(SamplingParams(presence_penalty=1.0, presence_context_size=2))
    assert float(LOGITS[5] - processed[5]) == 1.0
    assert float(windowed.process_logits(LOGITS, history)[5]) == float(LOGITS[5])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"xtc_probability": 1.5}, "xtc_probability must be in [0, 1]"),
        ({"xtc_threshold": 0.6}, "xtc_threshold must be in [0, 0.5]"),
        ({"xtc_threshold": math.nan}, "xtc_threshold must be a finite number"),
        ({"presence_context_size": 0}, "presence_context_size must be an integer >= 1"),
        ({"frequency_context_size": 2.0}, "frequency_context_size must be an integer >= 1"),
        ({"xtc_special_tokens": (-1,)}, "xtc_special_tokens must be token ids"),
    ],
)
def test_validate_refuses_bad_xtc_and_windows(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=r"^[^\n]*$") as error:
        SamplingParams(**fields).validate()
    assert message in str(error.value)
