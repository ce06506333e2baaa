"""Generated tokens' log-probabilities in OpenAI's two shapes: chat's `logprobs.content`
entries ({token, logprob, bytes, top_logprobs}) and the legacy completions' parallel lists
(tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from hearth.runtime.generate import TokenLogprobs
from hearth.tokenizer import BYTE_TOKEN, Tokenizer

# OpenAI's stand-in for a probability too small to matter; also keeps -inf out of the JSON.
LOWEST_LOGPROB = -9999.0


@lru_cache(maxsize=65536)  # the same alternatives come back step after step
def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's text (the tokenizer's decode of it alone) and its bytes: the text in UTF-8,
    or the raw byte of a byte-fallback token, whose text alone is not valid UTF-8."""
    text = tokenizer.decode([token_id])
    piece = tokenizer.id_to_token(token_id)
    if piece is not None and BYTE_TOKEN.fullmatch(piece):
        return text, bytes([int(piece[3:5], 16)])
    return text, text.encode("utf-8")


def _logprob(value: float) -> float:
    return max(value, LOWEST_LOGPROB)


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = token_text(tokenizer, token_id)
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(raw)}


def chat_logprobs(tokenizer: Tokenizer, records: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
    """A chat choice's `logprobs` (None when there are no tokens to report)."""
    if not records:
        return None
    content = []
    for record in records:
        entry = _chat_token(tokenizer, record.token, record.logprob)
        ranked = zip(record.top_tokens, record.top_logprobs, strict=True)
        entry["top_logprobs"] = [_chat_token(tokenizer, t, lp) for t, lp in ranked]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Tokenizer, records: Sequence[TokenLogprobs], offset: int = 0
) -> tuple[dict[str, Any], int]:
    """A text completion choice's `logprobs`, and the offset after its last token.

    `text_offset` counts characters of the token texts from `offset` (0: the completion's
    start; the prompt is not echoed). Each `top_logprobs` dict has the alternatives, most
    likely first, plus the sampled token (so up to n + 1 entries, as OpenAI documents); two
    ids with the same text share one key, the likelier one's.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for record in records:
        text, _ = token_text(tokenizer, record.token)
        tokens.append(text)
        token_logprobs.append(_logprob(record.logprob))
        offsets.append(offset)
        offset += len(text)
        alternatives: dict[str, float] = {}
        ranked = zip(record.top_tokens, record.top_logprobs, strict=True)
        for token_id, logprob in [*ranked, (record.token, record.logprob)]:
            alternatives.setdefault(token_text(tokenizer, token_id)[0], _logprob(logprob))
        top_logprobs.append(alternatives)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return body, offset
