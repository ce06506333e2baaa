"""Tokenizer tests: Hearth must encode and decode exactly as Hugging Face transformers does.

The oracle is `AutoTokenizer.from_pretrained(dir, gguf_file=...)` on the embedded Gemma 3 270M,
built once per session (conftest's `hf_270m_tokenizer`). Small synthetic GGUF vocabularies cover
the other tokenizer recipes, checked against transformers' own GGUF converter.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
from transformers.integrations.gguf.reader import read_gguf_metadata

from hearth.checkpoint.gguf import GGUFCheckpoint
from hearth.embedded import embedded_model_path
from hearth.tokenizer import Tokenizer, TokenizerError, gguf_tokenizer_key

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It wasn't me!",
    "café, naïve, Zürich, Ångström, façade",
    "中文 日本語 한국어",
    "emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and 🏳️‍🌈",
    "runs  of   spaces    and " + " " * 40 + "more",
    "\ttabs\t\tand\nnewlines\n\n\nand\r\nCRLF",
    "  leading and trailing whitespace \n\t ",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "def square(x: int) -> int:\n    return x ** 2  # {braces} [brackets]\n",
    "3.14159 1,000,000 2024-01-01 0x1F 1e-9 -42",
    "rare characters fall back to bytes: 𠀀 ꙮ 𓀀",
    "",
    "     ",
]
BYTE_FALLBACK_TEXT = "ꙮ!"  # "ꙮ" is not in Gemma's vocabulary: three byte tokens


@pytest.fixture(scope="module")
def metadata(embedded_gguf: Path) -> dict[str, Any]:
    # transformers' reader returns the same plain values as gguf.GGUFReader's contents(), faster.
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    values, _ = read_gguf_metadata(str(embedded_gguf), arrays)
    return values


@pytest.fixture(scope="module")
def tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(
    tokenizer: Tokenizer, hf_270m_tokenizer: Any, text: str, add_special_tokens: bool
) -> None:
    expected = hf_270m_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", CORPUS)
def test_decode_matches_transformers(
    tokenizer: Tokenizer, hf_270m_tokenizer: Any, text: str, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(text)
    expected = hf_270m_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.parametrize("text", CORPUS)
def test_decode_inverts_encode(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_gemma_special_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 262144
    assert tokenizer.bos_id == 2
    assert tokenizer.eos_id == 1
    assert tokenizer.eos_ids == {1, tokenizer.token_to_id("<end_of_turn>")}
    assert tokenizer.add_bos
    assert tokenizer.encode("hi")[0] == 2
    assert tokenizer.encode("<start_of_turn>", add_special_tokens=False) == [105]
    assert tokenizer.id_to_token(105) == "<start_of_turn>"
    assert not tokenizer.has_own_chat_template  # the base model ships none


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detokenizer = tokenizer.detokenizer(skip_special_tokens)
    return [detokenizer.add_token(i) for i in ids] + [detokenizer.flush()]


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_never_splits_a_character(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_streaming_holds_byte_tokens_until_the_character_is_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(BYTE_FALLBACK_TEXT, add_special_tokens=False)
    assert [tokenizer.id_to_token(i) for i in ids] == ["<0xEA>", "<0x99>", "<0xAE>", "!"]
    assert stream(tokenizer, ids) == ["", "", "", "ꙮ!", ""]


def test_streaming_matches_decode_on_arbitrary_ids(tokenizer: Tokenizer) -> None:
    """Random ids, half of them raw bytes, so invalid UTF-8 and special tokens show up too."""
    rng = random.Random(0)
    byte_ids = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    for _ in range(300):
        ids = [
            rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tokenizer.vocab_size)
            for _ in range(rng.randint(1, 12))
        ]
        for skip in (False, True):
            assert "".join(stream(tokenizer, ids, skip)) == tokenizer.decode(ids, skip), ids


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there. "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
]
RENDERED = (
    "<bos><start_of_turn>user\nYou are terse.\n\nHi there.<end_of_turn>\n"
    "<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\nName a colour.<end_of_turn>\n"
    "<start_of_turn>model\n"
)


def test_builtin_gemma3_chat_template(tokenizer: Tokenizer, hf_270m_tokenizer: Any) -> None:
    assert tokenizer.apply_chat_template(CONVERSATION) == RENDERED
    without_prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert without_prompt == RENDERED.removesuffix("<start_of_turn>model\n")
    # transformers renders our template the same way.
    rendered_by_hf = hf_270m_tokenizer.apply_chat_template(
        CONVERSATION,
        chat_template=tokenizer.chat_template,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered_by_hf == RENDERED


def test_encode_chat_has_exactly_one_bos(tokenizer: Tokenizer, hf_270m_tokenizer: Any) -> None:
    ids = tokenizer.encode_chat(CONVERSATION)
    assert ids.count(tokenizer.bos_id) == 1 and ids[0] == tokenizer.bos_id
    assert ids == hf_270m_tokenizer.encode(RENDERED, add_special_tokens=False)


@pytest.mark.parametrize(
    ("messages", "complaint"),
    [
        ([{"role": "assistant", "content": "I speak first."}], "alternate"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
        ([{"role": "system", "content": "s"}, {"role": "system", "content": "t"}], "alternate"),
        ([{"role": "user", "content": None}], "string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image"}]}], "Only text content"),
    ],
)
def test_bad_conversations_are_refused(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], complaint: str
) -> None:
    with pytest.raises(TokenizerError, match=complaint):
        tokenizer.apply_chat_template(messages)


def test_from_directory_matches_transformers(
    tokenizer: Tokenizer, hf_270m_tokenizer: Any, tmp_path: Path
) -> None:
    hf_270m_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "from the config"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}from the file")

    loaded = Tokenizer.from_directory(tmp_path)
    for text in CORPUS:
        assert loaded.encode(text) == hf_270m_tokenizer.encode(text)
        assert loaded.decode(loaded.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert (loaded.bos_id, loaded.eos_id, loaded.eos_ids) == (2, 1, {1, 106})
    assert loaded.add_bos and loaded.vocab_size == tokenizer.vocab_size
    assert loaded.has_own_chat_template
    assert loaded.apply_chat_template([]) == "<bos>from the file"


def write_word_level_directory(path: Path, config: dict[str, Any]) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("add_bos", [True, False])
def test_from_directory_follows_the_add_bos_flag(tmp_path: Path, add_bos: bool) -> None:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": add_bos}
    write_word_level_directory(tmp_path, config)
    loaded = Tokenizer.from_directory(tmp_path)
    assert loaded.add_bos is add_bos
    assert loaded.encode("hello world") == ([1, 3, 4] if add_bos else [3, 4])
    assert (loaded.bos_id, loaded.eos_ids) == (1, {2})
    assert loaded.chat_template is None  # no template, and not Gemma's turn tokens either
    with pytest.raises(TokenizerError, match="no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])


def test_from_directory_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_directory(tmp_path)


def synthetic_metadata(architecture: str, model: str) -> dict[str, Any]:
    """A small SentencePiece-style vocabulary with scores that tie, byte tokens, runs of spaces
    and newlines stored as user-defined tokens, and Gemma's turn tokens."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "a", "b", "c", "h", "i", " ", "\n", "▁a", "ab", "▁ab", "bc", "abc", "▁abc"]
    pieces += ["  ", "   ", "\n\n", "hi", "▁hi", "ca", "▁c", "cab", "▁b", "ba"]
    user_defined = {" ", "  ", "   ", "\n", "\n\n"}
    types = [3] * len(specials) + [6] * 256 + [4 if p in user_defined else 1 for p in pieces]
    return {
        "general.architecture": architecture,
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.tokens": specials + byte_tokens + pieces,
        "tokenizer.ggml.scores": [0.0] * (len(specials) + 256)
        + [-(i % 4) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
    }


SYNTHETIC_TEXTS = [
    "abc ab a",
    "  abc",
    "\n\nhi  hi   hi\n",
    "cab ba bc",
    "é漢",
    "hi<end_of_turn>x",
    " ",
]


@pytest.mark.parametrize(
    ("architecture", "model"),
    [("gemma3", "llama"), ("llama", "llama"), ("phi3", "llama"), ("gemma4", "gemma4")],
)
def test_synthetic_gguf_recipes_match_transformers(architecture: str, model: str) -> None:
    metadata = synthetic_metadata(architecture, model)
    ours = Tokenizer.from_gguf_metadata(metadata)
    reference, _ = convert_gguf_tokenizer(
        architecture,
        {
            "tokenizer_type": model,
            "tokens": metadata["tokenizer.ggml.tokens"],
            "scores": metadata["tokenizer.ggml.scores"],
            "token_type": metadata["tokenizer.ggml.token_type"],
        },
    )
    for text in SYNTHETIC_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False), text
    assert ours.add_bos is (model != "gemma4")  # Gemma 4's chat template writes <bos> itself


def test_gguf_chat_template_and_stop_ids_come_from_metadata() -> None:
    metadata = synthetic_metadata("gemma3", "llama")
    metadata["tokenizer.chat_template"] = "{{ bos_token }}{{ messages[0].content }}"
    metadata["tokenizer.ggml.eot_token_id"] = 4
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.has_own_chat_template
    assert tokenizer.apply_chat_template([{"role": "user", "content": "abc"}]) == "<bos>abc"
    assert tokenizer.encode_chat([{"role": "user", "content": "abc"}]).count(2) == 1
    assert tokenizer.eos_ids == {1, 4, 5}


@pytest.mark.parametrize("model", ["gpt2", "t5", None])
def test_unsupported_gguf_tokenizer_model(model: str | None) -> None:
    metadata = synthetic_metadata("gemma3", "llama")
    metadata["tokenizer.ggml.model"] = model
    with pytest.raises(TokenizerError, match="supported: gemma4, llama"):
        Tokenizer.from_gguf_metadata(metadata)
    assert issubclass(TokenizerError, ValueError)


def test_gguf_tokenizer_is_cached_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HEARTH_CACHE", str(tmp_path))
    metadata = synthetic_metadata("gemma3", "llama")
    built = Tokenizer.from_gguf_metadata(metadata, cache_key="model-123")
    cached_file = tmp_path / "tokenizers" / "model-123.json"
    assert cached_file.is_file()

    # The cached file is what loads next time, so a changed vocabulary shows it was used.
    del metadata["tokenizer.ggml.tokens"]
    reloaded = Tokenizer.from_gguf_metadata(metadata, cache_key="model-123")
    assert reloaded.encode("abc ab") == built.encode("abc ab")

    # A damaged cache file is rebuilt, not trusted.
    cached_file.write_text("{ torn")
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.tokens"):
        Tokenizer.from_gguf_metadata(metadata, cache_key="model-123")
    rebuilt = Tokenizer.from_gguf_metadata(synthetic_metadata("gemma3", "llama"), "model-123")
    assert rebuilt.encode("abc ab") == built.encode("abc ab")
    assert tokenizers.Tokenizer.from_file(str(cached_file)).get_vocab_size() == built.vocab_size


def test_gguf_tokenizer_key_is_the_vocabulary_content() -> None:
    """Files sharing a vocabulary share one cache entry (the key is a digest of what building
    the tokenizer reads); any change to that content, however small, moves the key."""
    metadata = synthetic_metadata("gemma3", "llama")
    key = gguf_tokenizer_key(metadata)
    same_vocabulary = {**synthetic_metadata("gemma3", "llama"), "general.name": "another"}
    assert gguf_tokenizer_key(same_vocabulary) == key
    tokens = metadata["tokenizer.ggml.tokens"]
    changes: list[tuple[str, Any]] = [
        ("general.architecture", "gemma4"),
        ("tokenizer.ggml.model", "gemma4"),
        ("tokenizer.ggml.tokens", [*tokens[:-2], tokens[-2] + tokens[-1][0], tokens[-1][1:]]),
        ("tokenizer.ggml.scores", [*metadata["tokenizer.ggml.scores"][:-1], -0.5]),
        ("tokenizer.ggml.token_type", [*metadata["tokenizer.ggml.token_type"][:-1], 4]),
        ("tokenizer.ggml.add_bos_token", True),
    ]
    for name, value in changes:
        assert gguf_tokenizer_key({**metadata, name: value}) != key, name


def test_gguf_files_with_one_vocabulary_share_a_cached_tokenizer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two copies of the embedded model under other names and times: one cache entry."""
    monkeypatch.setenv("HEARTH_CACHE", str(tmp_path / "cache"))
    source = embedded_model_path()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).symlink_to(source)
        tokenizer = GGUFCheckpoint(tmp_path / name).tokenizer()
        assert tokenizer.encode("The capital of France is")[-1] > 0
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1


def test_long_texts_encode_as_short_ones_do(tokenizer: Tokenizer) -> None:
    """Past RELEASE_GIL_CHARS the batch call (which releases the GIL) encodes: the same ids
    as the single call, special tokens or not."""
    from hearth.tokenizer import RELEASE_GIL_CHARS

    text = "Über 9 Äpfel, 日本語 and   spaces\n\tend. " * (RELEASE_GIL_CHARS // 30)
    assert len(text) > RELEASE_GIL_CHARS
    for special in (True, False):
        single = tokenizer._backend.encode(text, add_special_tokens=special).ids
        assert tokenizer.encode(text, add_special_tokens=special) == single


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris. " * 50,
        " " * 4000,  # Gemma's longest entries are runs of 31 spaces, newlines, tabs
        "\n" * 999 + "\t" * 777,
        "日本語のテキスト、絵文字 🎉🎉 と記号 ✓" * 40,
        "<start_of_turn>user\nHi<end_of_turn>\n" * 30,  # special tokens, one id each
    ],
)
def test_fewest_tokens_is_a_lower_bound(tokenizer: Tokenizer, text: str) -> None:
    """The server refuses a prompt from its length alone when this bound passes the
    context; it must never exceed the real count (31 characters at most a token here)."""
    assert tokenizer.longest_token_chars == 31
    assert tokenizer.fewest_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False))
