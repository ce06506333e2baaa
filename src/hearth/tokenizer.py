"""Text to token ids and back, exactly as Hugging Face's tokenizer for the same checkpoint does.

The Rust `tokenizers` library does the work. From a GGUF file we rebuild the tokenizer that
transformers builds from it (`AutoTokenizer.from_pretrained(..., gguf_file=...)`); from a Hugging
Face directory we load its `tokenizer.json` as is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache, cached_property
from importlib import resources
from operator import itemgetter
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from hearth.errors import HearthError

__all__ = ["StreamingDetokenizer", "Tokenizer", "TokenizerError"]

SPIECE_SPACE = "\u2581"  # how SentencePiece vocabularies spell a space
END_OF_TURN = "<end_of_turn>"  # Gemma ends every chat turn with it, so generation stops there too
REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) valid UTF-8
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token, one raw byte
# Texts longer than this encode with the GIL released (tokenizers' batch call, as fast on one
# 1 MB text, measured): the server's event loop and model thread keep running meanwhile.
RELEASE_GIL_CHARS = 65536

# GGUF token types (llama.cpp's llama_token_type).
UNDEFINED = 0
CONTROL = 3
USER_DEFINED = 4


class TokenizerError(HearthError, ValueError):
    """The tokenizer files are missing, malformed, or of a kind Hearth cannot rebuild."""


@dataclass(frozen=True)
class _GGUFRecipe:
    """How transformers turns one kind of GGUF vocabulary into a tokenizer."""

    respell_space_runs: bool  # Gemma files store runs of spaces as real spaces, not "▁"
    rank_merges_by_position: bool  # Gemma's scores do not follow its merge order; token order does
    add_bos_override: bool | None  # None: the file's add_bos_token flag decides
    pipeline: Callable[[tokenizers.Tokenizer], None]


def _gemma_pipeline(backend: tokenizers.Tokenizer) -> None:
    backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    # A no-op once spaces are respelled; kept so the serialized tokenizer matches transformers'.
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )


def _sentencepiece_decoder() -> decoders.Decoder:
    # The space prepended to the first word when encoding is dropped again when decoding.
    return decoders.Sequence(
        [
            decoders.Replace(SPIECE_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )


def _llama_pipeline(backend: tokenizers.Tokenizer) -> None:
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(SPIECE_SPACE, "first", split=False)
    backend.decoder = _sentencepiece_decoder()


def _phi3_pipeline(backend: tokenizers.Tokenizer) -> None:
    # Phi-3 prepends its prefix space in a normalizer, so every leading space is kept.
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPIECE_SPACE), normalizers.Replace(" ", SPIECE_SPACE)]
    )
    backend.pre_tokenizer = None
    backend.decoder = _sentencepiece_decoder()


_GEMMA = _GGUFRecipe(
    respell_space_runs=True,
    rank_merges_by_position=True,
    add_bos_override=None,
    pipeline=_gemma_pipeline,
)
_GEMMA4 = _GGUFRecipe(
    respell_space_runs=False,
    rank_merges_by_position=False,
    add_bos_override=False,  # its chat template writes <bos> itself
    pipeline=_gemma_pipeline,
)
_LLAMA = _GGUFRecipe(
    respell_space_runs=False,
    rank_merges_by_position=False,
    add_bos_override=None,
    pipeline=_llama_pipeline,
)
_PHI3 = _GGUFRecipe(
    respell_space_runs=False,
    rank_merges_by_position=False,
    add_bos_override=None,
    pipeline=_phi3_pipeline,
)
_SUPPORTED_GGUF_MODELS = ("gemma4", "llama")


def _recipe_for(model_type: object, architecture: str) -> _GGUFRecipe:
    if model_type == "gemma4":
        return _GEMMA4
    if model_type == "llama":
        if architecture.startswith("gemma"):
            return _GEMMA
        return _PHI3 if architecture == "phi3" else _LLAMA
    raise TokenizerError(
        f"Cannot build a tokenizer for GGUF tokenizer model {model_type!r} "
        f"(architecture {architecture!r}); supported: {', '.join(_SUPPORTED_GGUF_MODELS)}."
    )


def _respell_space_runs(tokens: list[str]) -> list[str]:
    return [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _derive_merges(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
    """Every cut of a token into two vocabulary pieces, as transformers' `generate_merges` orders
    them: best-ranked token first, then longer left piece, then longer right piece."""
    candidates = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((rank, cut, len(right), left, right))
    # A stable sort, as in transformers: ties keep vocabulary order.
    candidates.sort(key=itemgetter(0, 1, 2), reverse=True)
    return [(left, right) for *_, left, right in candidates]


def _merges_for(
    tokens: list[str], vocab: Mapping[str, int], metadata: Mapping[str, Any], recipe: _GGUFRecipe
) -> list[tuple[str, str]]:
    stored = metadata.get("tokenizer.ggml.merges")
    if stored is not None:
        return [_split_merge(merge) for merge in stored]
    if recipe.rank_merges_by_position:
        ranks: dict[str, float] = {token: -index for index, token in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, _required(metadata, "tokenizer.ggml.scores"), strict=True))
    return _derive_merges(vocab, ranks)


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise TokenizerError(f"GGUF metadata has no {key!r}; cannot build its tokenizer.")
    return metadata[key]


def _special_token_ids(metadata: Mapping[str, Any]) -> dict[str, int]:
    names = ("bos", "eos", "unknown", "padding")
    return {
        name: metadata[f"tokenizer.ggml.{name}_token_id"]
        for name in names
        if metadata.get(f"tokenizer.ggml.{name}_token_id") is not None
    }


def _bos_eos_processor(
    bos: str | None, eos: str | None, vocab_ids: Mapping[str, int]
) -> processors.TemplateProcessing:
    """The post-processor transformers installs: BOS and/or EOS around each sequence."""
    single = " ".join(x for x in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if x)
    second = " ".join(x for x in (bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
    specials = [(token, vocab_ids[token]) for token in (bos, eos) if token is not None]
    return processors.TemplateProcessing(
        single=single, pair=f"{single} {second}", special_tokens=specials
    )


def _build_from_gguf(metadata: Mapping[str, Any], recipe: _GGUFRecipe) -> tokenizers.Tokenizer:
    file_tokens = list(_required(metadata, "tokenizer.ggml.tokens"))
    tokens = _respell_space_runs(file_tokens) if recipe.respell_space_runs else file_tokens
    vocab = {token: index for index, token in enumerate(tokens)}
    specials = _special_token_ids(metadata)
    unk = tokens[specials["unknown"]] if "unknown" in specials else "<unk>"
    backend = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges_for(tokens, vocab, metadata, recipe),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    recipe.pipeline(backend)
    _add_gguf_added_tokens(backend, file_tokens, tokens, metadata)
    bos_id, eos_id = _gguf_bos_eos_to_add(metadata, recipe)
    backend.post_processor = _bos_eos_processor(
        tokens[bos_id] if bos_id is not None else None,
        tokens[eos_id] if eos_id is not None else None,
        vocab,
    )
    return backend


def _add_gguf_added_tokens(
    backend: tokenizers.Tokenizer,
    file_tokens: list[str],
    tokens: list[str],
    metadata: Mapping[str, Any],
) -> None:
    """Control tokens become special tokens and user-defined ones plain added tokens, so both are
    matched whole in text instead of being cut into pieces (as llama.cpp and transformers do)."""
    known = set(tokens)
    types = metadata.get("tokenizer.ggml.token_type") or [UNDEFINED] * len(tokens)
    special = {tokens[index] for index in _special_token_ids(metadata).values()}
    special.update(token for token, kind in zip(tokens, types, strict=True) if kind == CONTROL)
    # The file's spelling is looked up: a user-defined run of spaces was respelled and is skipped.
    user_defined = [
        token
        for token, kind in zip(file_tokens, types, strict=True)
        if kind == USER_DEFINED and token in known
    ]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])


def _gguf_bos_eos_to_add(
    metadata: Mapping[str, Any], recipe: _GGUFRecipe
) -> tuple[int | None, int | None]:
    """The BOS and EOS ids `encode` wraps each text in, None for those it does not add."""
    specials = _special_token_ids(metadata)
    add_bos = recipe.add_bos_override
    if add_bos is None:
        # Files without the flag get BOS, as llama.cpp gives any SentencePiece vocabulary.
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    return (
        specials.get("bos") if add_bos else None,
        specials.get("eos") if add_eos else None,
    )


def gguf_tokenizer_key(metadata: Mapping[str, Any]) -> str:
    """A cache key for the tokenizer GGUF metadata describes: a digest of what building it
    reads (the architecture and the `tokenizer.ggml.*` values), so files that share a
    vocabulary share one cached tokenizer, and a changed file never meets a stale one."""
    digest = hashlib.sha256()
    keys = sorted(k for k in metadata if k.startswith("tokenizer.ggml."))
    for key in [*keys, "general.architecture"]:
        value = metadata.get(key)
        digest.update(key.encode() + b"\0")
        # GGUF arrays hold one type, so the first item tells it.
        if isinstance(value, list) and value and isinstance(value[0], str):
            # 262k tokens: their lengths, then all joined (json.dumps of them takes ~60 ms)
            digest.update(b"s" + array("q", map(len, value)).tobytes())
            digest.update("".join(value).encode("utf-8", "surrogatepass"))
        elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
            digest.update(b"n" + array("d", value).tobytes())
        else:
            digest.update(b"j" + json.dumps(value).encode())
        digest.update(b"\0")
    return f"gguf-{digest.hexdigest()[:32]}"


def _cache_path(cache_key: str) -> Path:
    root = Path(os.environ.get("HEARTH_CACHE") or Path.home() / ".cache" / "hearth")
    safe_key = re.sub(r"[^A-Za-z0-9._-]", "_", cache_key)
    return root / "tokenizers" / f"{safe_key}.json"


def _load_cached(path: Path) -> tokenizers.Tokenizer | None:
    if not path.is_file():
        return None
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception:  # tokenizers raises a bare Exception for a damaged file: rebuild it
        return None


def _store_cached(path: Path, backend: tokenizers.Tokenizer) -> None:
    """Best effort: a cache that cannot be written only costs the next load its speed."""
    partial: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a concurrent reader never sees half a file.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            partial = Path(f.name)
            f.write(backend.to_str())
        os.replace(partial, path)
    except OSError:
        if partial is not None:
            partial.unlink(missing_ok=True)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{path} is not valid JSON: {error}") from error


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _directory_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # older files: a list of named templates
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


@cache
def _builtin_gemma3_template() -> str:
    return resources.files("hearth").joinpath("templates/gemma3.jinja").read_text("utf-8")


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates want plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(pattern: str) -> str:
    return datetime.now().strftime(pattern)


@cache
def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers renders chat templates in; templates are untrusted.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, stop ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        extra_stop_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self._bos_id = bos_id
        self._eos_id = eos_id
        stop_ids = {eos_id, backend.token_to_id(END_OF_TURN), *extra_stop_ids}
        self._eos_ids = frozenset(i for i in stop_ids if i is not None)
        self._add_bos = add_bos
        self._chat_template = chat_template

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], cache_key: str | None = None
    ) -> Tokenizer:
        """Rebuild the tokenizer described by GGUF metadata (key name -> plain Python value).

        Deriving merges from a large vocabulary takes seconds, so with a `cache_key` (anything
        that identifies the file's content) the result is kept on disk and reloaded next time.
        """
        architecture = str(metadata.get("general.architecture", ""))
        recipe = _recipe_for(metadata.get("tokenizer.ggml.model"), architecture)
        backend = None
        if cache_key is not None:
            backend = _load_cached(_cache_path(cache_key))
        if backend is None:
            backend = _build_from_gguf(metadata, recipe)
            if cache_key is not None:
                _store_cached(_cache_path(cache_key), backend)
        specials = _special_token_ids(metadata)
        # llama.cpp's end-of-turn and end-of-message ids end generation as EOS does.
        turn_ends = (metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom"))
        return cls(
            backend,
            bos_id=specials.get("bos"),
            eos_id=specials.get("eos"),
            add_bos=_gguf_bos_eos_to_add(metadata, recipe)[0] is not None,
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_stop_ids=[i for i in turn_ends if i is not None],
        )

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (tokenizer.json and its config files)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"No tokenizer.json in {path}.")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers reports every parse failure as a bare Exception
            raise TokenizerError(f"Cannot read {tokenizer_file}: {error}") from error
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        bos_text = _token_text(config.get("bos_token"))
        eos_text = _token_text(config.get("eos_token"))
        bos_id = backend.token_to_id(bos_text) if bos_text else generation.get("bos_token_id")
        generation_eos_ids = _as_id_list(generation.get("eos_token_id"))
        eos_id = backend.token_to_id(eos_text) if eos_text else None
        if eos_id is None and generation_eos_ids:
            eos_id = generation_eos_ids[0]

        # As transformers does: explicit flags rebuild the post-processor, else the file's stands.
        if "add_bos_token" in config or "add_eos_token" in config or not backend.post_processor:
            backend.post_processor = _bos_eos_processor(
                bos_text if config.get("add_bos_token") else None,
                eos_text if config.get("add_eos_token") else None,
                backend.get_vocab(),
            )
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=_post_processor_adds_bos(backend, bos_id),
            chat_template=_directory_chat_template(path, config),
            extra_stop_ids=generation_eos_ids,
        )

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS, plus Gemma's <end_of_turn> when the vocabulary has it."""
        return self._eos_ids

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence token proper (the template's `eos_token`)."""
        return self._eos_id

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` starts with BOS."""
        return self._add_bos

    @property
    def has_own_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template (else the built-in one may stand in)."""
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """The template `apply_chat_template` renders: the checkpoint's, else the built-in Gemma 3
        one when the vocabulary speaks Gemma's turn format, else None."""
        if self._chat_template is not None:
            return self._chat_template
        has_turns = self.token_to_id("<start_of_turn>") is not None
        if has_turns and self.token_to_id(END_OF_TURN) is not None:
            return _builtin_gemma3_template()
        return None

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` leaves out."""
        added = self._backend.get_added_tokens_decoder()
        return frozenset(index for index, token in added.items() if token.special)

    @cached_property
    def vocabulary_pieces(self) -> tuple[str, ...]:
        """Every token's vocabulary entry (as the vocabulary spells it: ▁, <0xNN>), by id;
        "" for an id the vocabulary leaves unused."""
        pieces = [""] * self.vocab_size
        for piece, index in self._backend.get_vocab(with_added_tokens=True).items():
            if index < len(pieces):
                pieces[index] = piece
        return tuple(pieces)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > RELEASE_GIL_CHARS:
            # The batch call releases the GIL (the single one holds it throughout).
            batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return batch[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def longest_token_chars(self) -> int:
        """The most characters a vocabulary entry spells: a token stands for at most that
        many characters of text (byte tokens <0x..> and byte-level symbols for one byte, ▁
        for one space)."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)))

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` from the text's length alone: refuses a prompt
        far beyond a context without tokenizing it. It holds for normalizers that never
        shorten a text (Gemma's replaces spaces by ▁, one for one)."""
        return -(-len(text) // self.longest_token_chars)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text with the chat template (see `chat_template`)."""
        template = self.chat_template
        if template is None:
            raise TokenizerError("This tokenizer has no chat template.")
        context = {
            "bos_token": self._token_text_or_empty(self._bos_id),
            "eos_token": self._token_text_or_empty(self._eos_id),
            **template_kwargs,
        }
        try:
            return _compile_template(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as error:
            raise TokenizerError(f"Chat template: {error}") from error

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a rendered conversation, with exactly one BOS when the model wants one:
        the template's own if it writes one, else the tokenizer's."""
        prompt = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode_rendered(prompt)

    def encode_rendered(self, prompt: str) -> list[int]:
        """Token ids of a conversation `apply_chat_template` rendered (see `encode_chat`)."""
        ids = self.encode(prompt, add_special_tokens=False)
        if self._add_bos and self._bos_id is not None and ids[:1] != [self._bos_id]:
            ids.insert(0, self._bos_id)
        return ids

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens)

    def _token_text_or_empty(self, token_id: int | None) -> str:
        token = self.id_to_token(token_id) if token_id is not None else None
        return token or ""


def _post_processor_adds_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    return backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]


class StreamingDetokenizer:
    """Turns generated ids into text as they arrive, never splitting a UTF-8 character.

    Each step decodes only a small window: the ids not yet shown, after the ids shown last time.
    Those are decoded again as context, because decoders treat the start of a text specially (e.g.
    strip its first space), and the difference between the two decodes is the new text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._window: list[int] = []
        self._shown = 0  # window[:shown] is context already emitted; the rest is pending

    def add_token(self, token_id: int) -> str:
        """Take one id; return the text it completes (often all of it, sometimes nothing yet)."""
        if token_id in self._skipped:
            return ""
        self._window.append(token_id)
        token = self._tokenizer.id_to_token(token_id)
        # A run of byte tokens is decoded as one: wait for it to end, since a later byte could
        # make the whole run invalid and decode() would then print it as replacement characters.
        if token is not None and BYTE_TOKEN.fullmatch(token):
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """Return everything still held back (at the end of generation)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        context = self._tokenizer.decode(self._window[: self._shown])
        text = self._tokenizer.decode(self._window)
        incomplete = text.endswith(REPLACEMENT_CHAR) or len(text) <= len(context)
        if incomplete and not final:
            return ""
        self._window = self._window[self._shown :]
        self._shown = len(self._window)
        return text[len(context) :]
