"""A newcomer's first hour with the real `hearth` command (issue 41): a terminal chat, a
context that runs out, device and dtype mistakes, the first native build, `hearth fit`
against a measured peak, `hearth bench` on a model the memory cannot hold.

Each case runs the command in a subprocess, as a user would; the tiny checkpoints have short
contexts (64 positions) so that running out costs nothing.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from hearth.fit import plan_fit
from hearth.ops import native
from test_cli import HEARTH, assert_usage_error, run, run_in_process
from tiny import save_tiny_with_tokenizer

CONTEXT = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 with a word tokenizer ("t5 t6 ..."), a chat template, 64 positions."""
    directory = tmp_path_factory.mktemp("tiny-chat")
    return save_tiny_with_tokenizer(directory, max_position_embeddings=CONTEXT)


def words(count: int, first: int = 4) -> str:
    return " ".join(f"t{first + i % 200}" for i in range(count))


# --- the context window (item 3) ------------------------------------------------------------


def test_generate_refuses_a_prompt_longer_than_the_context(tiny: Path) -> None:
    result = run("generate", str(tiny), words(100))
    assert_usage_error(result, "the prompt has 101 tokens", f"context holds {CONTEXT}")


def test_generate_refuses_max_tokens_past_the_context_and_shrinks_the_default(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An explicit --max-tokens is never cut; the default (512) shrinks to the room left:
    60 words and BOS leave 3 positions. (The prompt after an option, as users write it.)"""
    result = run("generate", str(tiny), "--max-tokens", "10", words(60))
    assert_usage_error(result, "max_tokens 10 plus the prompt's 61 tokens exceeds")
    result = run_in_process(capsys, "generate", str(tiny), "--temp", "0", words(60))
    assert result.returncode == 0, result.stderr
    generated = int(re.search(r"generation: (\d+) tokens", result.stderr).group(1))
    assert 1 <= generated <= 3


def _default_sigint() -> None:
    """Ctrl-C as a terminal gives it. A test run started in the background by a non-interactive
    shell (as CI's may be) has SIGINT ignored, and exec would pass that on to the child: its
    Ctrl-C would then never stop a reply."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Session:
    """A `hearth chat` process read as it writes: stdout (prompts and replies) and stderr
    (notices), each gathered from a thread so that neither pipe fills."""

    def __init__(self, *args: str) -> None:
        import threading

        self.process = subprocess.Popen(
            [*HEARTH, "chat", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            preexec_fn=_default_sigint,
        )
        self.out = bytearray()
        self.err = bytearray()
        for pipe, sink in ((self.process.stdout, self.out), (self.process.stderr, self.err)):
            threading.Thread(target=self._drain, args=(pipe, sink), daemon=True).start()

    @staticmethod
    def _drain(pipe: object, sink: bytearray) -> None:
        while chunk := os.read(pipe.fileno(), 4096):  # type: ignore[attr-defined]
            sink.extend(chunk)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def wait_for(self, sink: bytearray, needle: str, count: int = 1, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while sink.decode(errors="replace").count(needle) < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"{needle!r} x{count} not seen: {self.text()}")
            time.sleep(0.02)

    def wait_for_growth(self, sink: bytearray, size: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(sink) < size:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"output never reached {size} bytes: {self.text()}")
            time.sleep(0.02)

    def text(self) -> str:
        return f"stdout: {self.out.decode(errors='replace')!r}\nstderr: {self.err.decode()!r}"

    def finish(self) -> int:
        code = self.process.wait(timeout=60)
        time.sleep(0.1)  # the drain threads' last reads
        return code


def test_chat_drops_the_oldest_turns_when_the_context_runs_out(tiny: Path) -> None:
    """64 positions, 8 kept for each reply: 15-word messages outgrow them by the third
    turn; the conversation goes on with a notice, and a message too long on its own is not
    sent (the oldest turns stay)."""
    session = Session(str(tiny), "--max-tokens", "8", "--temp", "0")
    for turn in range(5):
        session.send(words(15, first=4 + 20 * turn))
    session.send(words(70))
    session.send("/exit")
    assert session.finish() == 0, session.text()
    err = session.err.decode()
    assert "the conversation outgrew the model's context of 64 tokens: dropped its oldest" in err
    assert "not sent: this message has 71 tokens" in err
    assert session.out.decode().count(">>> ") == 7


# --- the terminal chat (items 9 and 13) -----------------------------------------------------


def test_chat_at_the_terminal(embedded_gguf: Path) -> None:
    """The base-model note, /help and /reset, Ctrl-C stopping a reply (not the program) and
    Ctrl-C at the prompt quitting with a hint."""
    session = Session("--max-tokens", "3000", "--repetition-penalty", "1.3")
    session.wait_for(session.err, "Ctrl-C stops a reply")
    assert "has no chat template of its own: it is a base model" in session.err.decode()
    session.wait_for(session.out, ">>> ")
    before = len(session.out)
    session.send("Hello!")
    session.wait_for_growth(session.out, before + 8)  # a few tokens of the reply are out
    session.process.send_signal(signal.SIGINT)
    session.wait_for(session.err, "reply stopped")
    session.wait_for(session.out, ">>> ", count=2)  # and the chat goes on
    session.send("/help")
    session.wait_for(session.err, "/reset")
    session.send("/reset")
    session.wait_for(session.err, "conversation cleared")
    session.wait_for(session.out, ">>> ", count=4)
    session.process.send_signal(signal.SIGINT)
    assert session.finish() == 0, session.text()
    err = session.err.decode()
    assert "/help       list these commands" in err and "/image PATH" in err and "/exit" in err
    assert "bye (Ctrl-C during a reply stops just the reply" in err


def test_chat_help_names_the_default_model_and_what_ctrl_c_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = run_in_process(capsys, "chat", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "default: the embedded Gemma 3 270M, a base model" in text
    assert "Ctrl-C stops a reply; at the prompt it quits" in text
    assert "the oldest turns are dropped" in text and "/reset" in text


# --- usage, help texts, bad values (items 2, 5, 6, 12, 17) ---------------------------------


def test_generate_usage_and_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_in_process(capsys, "generate", "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: hearth generate [options] [MODEL] PROMPT\n")
    text = " ".join(result.stdout.split())
    for option in ("--top-p P", "--min-p P", "--repetition-penalty R"):
        described = re.search(re.escape(option) + r" (\w+)", text)
        assert described and described.group(1) not in ("--", "options"), option
    assert "default 512, shrunk to fit the context" in text
    assert "On the CPU a compressed cache decodes 2.5-4x slower" in text  # --kv-quant


def test_a_lone_model_path_is_not_taken_for_a_prompt(embedded_gguf: Path) -> None:
    assert_usage_error(run("generate", str(embedded_gguf)), "no prompt given")


def test_float16_on_the_cpu_is_refused() -> None:
    """Gemma's activations overflow float16 (NaN logits, <pad> text): refused up front."""
    result = run("generate", "--dtype", "float16", "--device", "cpu", "Hi")
    assert_usage_error(result, "float16 overflows Gemma's activations on the CPU")


def test_unknown_devices_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(run("generate", "--device", "tpu", "Hi"), "not a device name")
    for command in ("generate", "chat", "serve", "bench"):
        args = [command, "--device", "xpu"] + (["Hi"] if command == "generate" else [])
        result = run_in_process(capsys, *args)
        assert_usage_error(result, "Hearth runs on cpu or cuda")


def test_cuda_without_a_gpu_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_in_process(capsys, "generate", "--device", "cuda:1", "Hi")
    assert_usage_error(result, "device 'cuda:1': no CUDA device is available")


def test_a_seed_out_of_range_is_a_one_line_error() -> None:
    result = run("generate", "--seed", "99999999999999999999999", "Hi")
    assert_usage_error(result, "--seed", "-1 (random) or an integer in [0, 2**64 - 1]")


# --- memory (items 8 and 10) ----------------------------------------------------------------


def test_fit_counts_at_least_the_measured_peak_of_a_run(embedded_gguf: Path) -> None:
    """`hearth generate --chat` on the embedded model (the base-model note on stderr), and
    `hearth fit` at its context against the peak resident memory the run reports (its
    VmHWM, the load's peak included). fit must not count less; and not more than 25%
    more: its runtime constants are rounded up from one machine's measurement, with a
    margin for another CPU's build of torch (the Xeon peaked 5% above the EPYC)."""
    prompt = "The capital of France is Paris. " * 10
    result = run("generate", "--chat", "--max-tokens", "8", prompt)
    assert result.returncode == 0, result.stderr
    stats = result.stderr.strip().splitlines()[-1]
    prompt_tokens = int(re.search(r"prompt: (\d+) tokens", stats).group(1))
    peak = float(re.search(r"peak memory: ([\d.]+) GiB", stats).group(1)) * 2**30
    fit = plan_fit(embedded_gguf, context=prompt_tokens + 8, device="cpu")
    assert peak <= fit.needed_bytes <= 1.25 * peak, (fit, peak, result.stderr)
    assert "has no chat template of its own: it is a base model" in result.stderr


def test_bench_refuses_a_model_the_memory_cannot_hold() -> None:
    """Gemma 3 12B in bf16 (23.5 GB of weights) on this machine's CPU: refused with the
    numbers before anything is allocated (not an allocator traceback or the OOM killer)."""
    fit = plan_fit(random="gemma3-12b", context=32768, device="cpu")
    if fit.fits:
        pytest.skip("this machine's memory holds Gemma 3 12B in bf16: the bench would run")
    started = time.monotonic()
    result = run("bench", "--random", "gemma3-12b", "--device", "cpu")
    assert_usage_error(result, "gemma3-12b needs", f"{fit.needed_bytes / 1e9:.3g} GB on the CPU")
    assert f"over the {fit.memory_bytes / 1e9:.3g} GB this machine allows" in result.stderr
    assert time.monotonic() - started < 60


# --- the first native build (item 11) -------------------------------------------------------


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler or CPU for the kernels")
def test_the_first_native_build_says_so_and_stays_out_of_the_timing(
    tiny: Path, tmp_path: Path
) -> None:
    """A compiler that takes 2 s (it copies the library built already): one progress line
    on stderr, and the stats' prompt time (prefill to first token) well under those 2 s."""
    compiler = native._compiler()
    assert compiler is not None
    built = native.library_path(native.default_cache_dir(), compiler)
    slow = tmp_path / "slow-cc"
    slow.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "slow-cc 1"; exit 0; fi\n'
        'while [ "$1" != "-o" ]; do shift; done\n'
        f'sleep 2; cp "{built}" "$2"\n'
    )
    slow.chmod(slow.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "CC": str(slow), "HEARTH_CACHE": str(tmp_path / "cache")}
    command = [*HEARTH, "generate", str(tiny), words(3), "--temp", "0", "--max-tokens", "20"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "native CPU kernels" in line]
    assert len(notes) == 1 and notes[0].startswith("hearth: compiling native CPU kernels")
    stats = result.stderr.strip().splitlines()[-1]
    prompt_tokens, rate = re.search(r"prompt: (\d+) tokens, ([\d.]+) tok/s", stats).groups()
    assert int(prompt_tokens) / float(rate) < 1
