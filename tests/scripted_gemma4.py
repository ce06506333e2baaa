"""A tiny random Gemma 4 checkpoint that ships the real Gemma 4 chat template, whose logits are
replaced with scripted token ids: each test decides what the "model" says and checks how each
API parses and streams it. Also a live HTTP server on it, for clients that need a real socket.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import uvicorn
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from hearth.engine import Engine
from hearth.runtime.runner import ModelRunner
from hearth.server import ServerDefaults, ServerLimits, create_app
from tiny import save_hf, tiny_gemma4_model

TEMPLATE_NAME = "gemma4-it.chat_template.jinja"
# No prompt cache: ScriptedModel tells generations apart by a prefill from position 0.
NO_PROMPT_CACHE = ServerLimits(prompt_cache_size=0)
# Gemma 4's special tokens at their real ids (gemma4-architecture.md §5).
SPECIAL_IDS = {
    "<pad>": 0,
    "<eos>": 1,
    "<bos>": 2,
    "<unk>": 3,
    "<|tool>": 46,
    "<tool|>": 47,
    "<|tool_call>": 48,
    "<tool_call|>": 49,
    "<|tool_response>": 50,
    "<tool_response|>": 51,
    '<|"|>': 52,
    "<|think|>": 98,
    "<|channel>": 100,
    "<channel|>": 101,
    "<|turn>": 105,
    "<turn|>": 106,
}
END_OF_TURN = SPECIAL_IDS["<turn|>"]
VOCAB_SIZE = len(SPECIAL_IDS) + 256  # plus one token per byte: any text encodes exactly

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
CALL_MARKUP = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
CALL = f"{CALL_MARKUP}<|tool_response>"  # <|tool_response> ends generation after a call
THOUGHT = "<|channel>thought\nCold, probably.<channel|>"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def template_path() -> Path:
    """The real Gemma 4 template, vendored as test data (tests/data/README.md)."""
    return Path(__file__).parent / "data" / TEMPLATE_NAME


def write_byte_tokenizer(directory: Path, specials: dict[str, int], vocab_size: int) -> None:
    """A tokenizer with `specials` at their ids and one token per byte in the other ids below
    `vocab_size` (any text encodes exactly), as tokenizer.json and tokenizer_config.json."""
    byte_symbols = iter(sorted(pre_tokenizers.ByteLevel.alphabet()))
    vocab = dict(specials)
    taken = set(specials.values())
    vocab.update({next(byte_symbols): i for i in range(vocab_size) if i not in taken})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _write_tokenizer(directory: Path) -> None:
    write_byte_tokenizer(directory, SPECIAL_IDS, VOCAB_SIZE)
    generation = {"bos_token_id": 2, "eos_token_id": [1, 106]}
    (directory / "generation_config.json").write_text(json.dumps(generation))


class ScriptedModel:
    """The real model, with its logits replaced: each step answers the next scripted id.

    A call at position 0 starts a new generation (prompts here fit one prefill chunk). A
    script of several replies (`scripts`) answers them in turn, one per generation.
    """

    def __init__(self, model: Any, end_id: int) -> None:
        self._model = model
        self._end_id = end_id
        self.script: list[int] = []
        self.scripts: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self._step = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, ids: torch.Tensor, caches: Any, start: int, **kwargs: Any) -> torch.Tensor:
        logits = self._model(ids, caches, start=start, **kwargs)
        if start == 0:
            self.prompts.append(ids[0].tolist())
            self._step = 0
            if self.scripts:
                self.script = self.scripts.pop(0)
        token = self.script[self._step] if self._step < len(self.script) else self._end_id
        self._step += 1
        forced = torch.full_like(logits[:, -1:], -1e4)
        forced[..., token] = 0.0
        return forced


def scripted_engine(directory: Path) -> Engine:
    model = tiny_gemma4_model(vocab_size=VOCAB_SIZE, vocab_size_per_layer_input=VOCAB_SIZE)
    save_hf(model, directory)
    _write_tokenizer(directory)
    shutil.copy(template_path(), directory / "chat_template.jinja")
    loaded = Engine.load(directory, dtype="float32", device="cpu", progress=False, quantize="none")
    scripted = ScriptedModel(loaded.model, END_OF_TURN)
    # Every forward goes through the script: eager steps only (no native CPU layer step).
    plan = dataclasses.replace(loaded.plan, native_layers=False)
    runner = ModelRunner(scripted, plan, loaded.kv_policy)  # type: ignore[arg-type]
    return dataclasses.replace(loaded, model=scripted, runner=runner)


@functools.cache
def shared_engine() -> Engine:
    """One scripted engine for all the test modules of a run (building one takes seconds); its
    checkpoint lies in a temporary folder removed at exit. Tests script what they need."""
    directory = tempfile.mkdtemp(prefix="hearth-scripted-gemma4-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return scripted_engine(Path(directory))


def script_ids(engine: Engine, *texts: str) -> list[list[int]]:
    """Each text's token ids, ended by the end of turn."""
    encode = engine.tokenizer.encode
    return [[*encode(text, add_special_tokens=False), END_OF_TURN] for text in texts]


def say(engine: Engine, text: str) -> None:
    """Script every next generation's output text (the end of turn is added)."""
    engine.model.script = script_ids(engine, text)[0]  # type: ignore[attr-defined]
    engine.model.scripts = []  # type: ignore[attr-defined]


def say_in_turn(engine: Engine, *texts: str) -> None:
    """Script the next generations, one text each; after them, the last one again."""
    scripts = script_ids(engine, *texts)
    engine.model.scripts = scripts  # type: ignore[attr-defined]
    engine.model.script = scripts[-1]  # type: ignore[attr-defined]


def last_prompt(engine: Engine) -> str:
    return engine.tokenizer.decode(engine.model.prompts[-1])  # type: ignore[attr-defined]


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one intra-op thread while the tiny model serves: its matrices are 64 wide, and
    on a busy 2-core machine each op waiting for a second thread costs milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def live_server(
    engine: Engine, defaults: ServerDefaults | None = None, **app_options: Any
) -> Iterator[str]:
    """The app on a real socket (uvicorn on a thread of this process): its base URL."""
    app = create_app(engine, defaults, NO_PROMPT_CACHE, **app_options)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="hearth-test-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
