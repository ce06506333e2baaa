"""The real `hearth` command in a subprocess: generation on the embedded model and bad input.
The long lists of bad options and bad model paths run `hearth.cli.main` in this process (the
same parser and error path, without a Python start-up each); one of each list runs as the real
command too."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HEARTH = [sys.executable, "-m", "hearth.cli"]
PROMPT = "The capital of France is Paris. The capital of Germany is"


def run(*args: str, stdin: str = "", timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [*HEARTH, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env
    )


def run_in_process(
    capsys: pytest.CaptureFixture[str], *args: str
) -> subprocess.CompletedProcess[str]:
    """`run`'s result from `hearth.cli.main` called here: its exit code (argparse's exit
    included) and what it printed."""
    from hearth.cli import main

    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)


def assert_usage_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit code 2, exactly one readable line on stderr, never a traceback."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hearth: error: ")
    for needle in needles:
        assert needle in lines[0]


def test_generate_streams_text_then_stats() -> None:
    result = run("generate", "--max-tokens", "6", PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Berlin")
    stats = result.stderr.strip().splitlines()[-1]
    assert stats.startswith("prompt: 13 tokens")
    assert "generation: 6 tokens" in stats and "peak memory" in stats


def test_generate_reads_prompt_from_stdin_and_stops_on_string() -> None:
    result = run("generate", "--max-tokens", "20", "--stop", ".", "-", stdin=PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Berlin"


@pytest.mark.parametrize(("kind", "real"), [("8", True), ("turbo:k8v4", False)])
def test_generate_with_a_quantized_kv_cache(kind: str, real: bool, capsys) -> None:
    """The affine cache through the real command, TurboQuant in this process (the same parser
    and generation path, without a second start-up)."""
    args = ("generate", "--kv-quant", kind, "--max-tokens", "4", PROMPT)
    result = run(*args) if real else run_in_process(capsys, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Berlin")


def test_generate_with_a_json_schema_file(tmp_path: Path, capsys) -> None:
    """The output validates against the schema (the `jsonschema` package is the oracle), and
    `--regex` output matches its pattern (run in this process, the schema having run as the
    real command: the same parser and constraint path, without a second start-up)."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "rank"],
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    result = run("generate", "--json-schema", str(path), "--max-tokens", "40", PROMPT)
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)
    regex = ("--regex", "[A-Z][a-z]{1,7} [0-9]{2}")
    result = run_in_process(capsys, "generate", *regex, "--max-tokens", "16", PROMPT)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch("[A-Z][a-z]{1,7} [0-9]{2}", result.stdout.strip())


def test_chat_repl_answers_and_exits(embedded_gguf: Path) -> None:
    result = run("chat", str(embedded_gguf), "--max-tokens", "5", stdin="Hello!\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(">>> ") == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-tokens", "-3", PROMPT], "--max-tokens"),
        (["--max-tokens", "many", PROMPT], "--max-tokens"),
        (["--temp", "hot", PROMPT], "--temp"),
        (["--temp", "-1", PROMPT], "--temp"),
        (["--top-p", "2", PROMPT], "--top-p"),
        (["--top-k", "-1", PROMPT], "--top-k"),
        (["--seed", "x", PROMPT], "--seed"),
        (["--dtype", "int3", PROMPT], "--dtype"),
        (["a", "b", "c"], "3 arguments"),
        (["--kv-quant", "turbo:x9", PROMPT], "TurboQuant scheme"),
        (["--kv-quant", "3", PROMPT], "--kv-quant"),
        ([""], "empty"),
        (["--regex", "(ab", PROMPT], "the regex does not compile"),
        (["--json-schema", '{"type": "strng"}', PROMPT], "unknown type"),
        (["--json-schema", '{"not": {}}', PROMPT], "'not'"),
        (["--json-schema", "{oops", PROMPT], "not valid JSON"),
        (["--json-schema", "{}", "--regex", "a", PROMPT], "not allowed with"),
    ],
)
def test_bad_options_are_one_line_errors(args: list[str], needle: str, capsys) -> None:
    assert_usage_error(run_in_process(capsys, "generate", *args), needle)


def test_a_bad_option_of_the_real_command_is_a_one_line_error() -> None:
    assert_usage_error(run("generate", "--max-tokens", "-3", PROMPT), "--max-tokens")


def test_missing_model_path(tmp_path: Path) -> None:
    assert_usage_error(run("generate", str(tmp_path / "nope.gguf"), "hi"), "does not exist")


# The bad model paths below run in this process, as the bad options do; the missing path
# above is the real command's case.


def test_unreadable_model_file(tmp_path: Path, capsys) -> None:
    """A path that exists but cannot be opened for reading (a socket; as root, mode 000 can)."""
    path = tmp_path / "model.gguf"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        result = run_in_process(capsys, "generate", str(path), "hi")
        assert_usage_error(result, "cannot read")


def test_not_a_model_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    result = run_in_process(capsys, "generate", str(path), "hi")
    assert_usage_error(result, "neither a GGUF file")


def test_corrupt_gguf(tmp_path: Path, capsys) -> None:
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + os.urandom(64))
    assert_usage_error(run_in_process(capsys, "generate", str(path), "hi"), str(path))


def test_truncated_gguf(tmp_path: Path, embedded_gguf: Path, capsys) -> None:
    path = tmp_path / "truncated.gguf"
    with embedded_gguf.open("rb") as source:
        path.write_bytes(source.read(50_000_000))
    assert_usage_error(run_in_process(capsys, "generate", str(path), "hi"), "truncated")


def test_unsupported_architecture_directory(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = run_in_process(capsys, "generate", str(tmp_path), "hi")
    assert_usage_error(result, "'llama' is not supported")


def test_inspect_describes_the_embedded_model() -> None:
    result = run("inspect")
    assert result.returncode == 0, result.stderr
    assert "architecture: gemma3_text, 18 layers" in result.stdout
    # The embedded file is Q4_K_M (its name; llama.cpp's general.file_type 15).
    assert "quantization: Q4_K_M (general.file_type 15)" in result.stdout


def test_inspect_missing_model(tmp_path: Path, capsys) -> None:
    result = run_in_process(capsys, "inspect", str(tmp_path / "nope"))
    assert_usage_error(result, "does not exist")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--adapter-path", "lora"], "not supported yet"),
        (["--chat-template-args", "[1]"], "JSON object"),
        (["--port", "99999"], "--port"),
    ],
)
def test_bad_serve_options_are_one_line_errors(args: list[str], needle: str, capsys) -> None:
    assert_usage_error(run_in_process(capsys, "serve", *args), needle)


def test_a_bad_serve_option_of_the_real_command_is_a_one_line_error() -> None:
    assert_usage_error(run("serve", "--port", "99999"), "--port")


def test_directory_without_config(tmp_path: Path, capsys) -> None:
    result = run_in_process(capsys, "generate", str(tmp_path), "hi")
    assert_usage_error(result, "no config.json")
