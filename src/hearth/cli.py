"""The `hearth` command: generate and chat (more subcommands arrive with their issues)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hearth.chat import COMMANDS as CHAT_COMMANDS
from hearth.errors import HearthError
from hearth.lengths import DEFAULT_MAX_TOKENS
from hearth.runtime.constraints import OutputConstraint
from hearth.runtime.sampling import is_valid_seed

EXIT_USAGE = 2
DEFAULT_SHUTDOWN_TIMEOUT = 5.0
EMBEDDED = "the embedded Gemma 3 270M"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error on one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"hearth: error: {message}\n")


def _bounded(kind: type, name: str, check: Callable[[Any], bool]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}")
        return value

    return parse


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


positive_int = _bounded(int, "a positive integer", lambda v: v > 0)
non_negative_int = _bounded(int, "an integer >= 0", lambda v: v >= 0)
non_negative_float = _bounded(float, "a number >= 0", lambda v: v >= 0 and v != float("inf"))
probability = _bounded(float, "a number in (0, 1]", lambda v: 0 < v <= 1)
unit_interval = _bounded(float, "a number in [0, 1]", lambda v: 0 <= v <= 1)
positive_float = _bounded(float, "a number > 0", lambda v: 0 < v < float("inf"))
port_number = _bounded(int, "a port number in [1, 65535]", lambda v: 0 < v < 65536)
seed_value = _bounded(int, "-1 (random) or an integer in [0, 2**64 - 1]", is_valid_seed)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (default: float32 on CPU, bfloat16 on GPU; float16 only on a GPU: "
        "Gemma's activations overflow it)",
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if present, else cpu)")
    parser.add_argument(
        "--quantize",
        choices=["auto", "none", "int8", "int4"],
        default="auto",
        help="how weights are held: auto keeps a GGUF file's blocks as stored and computes on "
        "them exactly (on the CPU in float32 unless --dtype bfloat16; on a GPU with bfloat16 "
        "activations); int8/int4 re-quantize "
        "them to Hearth's own grid (CPU, bfloat16 compute; a second rounding); none "
        "dequantizes every tensor to --dtype",
    )
    parser.add_argument(
        "--kv-quant",
        default="off",
        metavar="KIND",
        help="KV cache: off (default), 8, 4, config (the checkpoint's kv_config.json), "
        "turbo or turbo:SCHEME (k8v4, k8v3, k4v3, t4v3, k8v2; see docs/kv-cache.md). On the "
        "CPU a compressed cache decodes 2.5-4x slower than the dense one: worth it only where "
        "the K/V, not the weights, fill the memory (long contexts of large models)",
    )


IMAGE_BUDGETS = (70, 140, 280, 560, 1120)  # the soft-token budgets Gemma 4's images take


def _add_media_options(parser: argparse.ArgumentParser, inputs: bool) -> None:
    """--image-max-tokens and --allow-fetch; with `inputs`, --image/--audio too."""
    inputs_help = {"image": "an image to show the model", "audio": "audio for the model to hear"}
    for kind, what in inputs_help.items() if inputs else ():
        parser.add_argument(
            f"--{kind}",
            dest="media",
            action="append",
            type=lambda value, kind=kind: (kind, value),
            default=[],
            metavar="FILE",
            help=f"{what} (repeatable; images and audio go before the prompt's text, in the "
            "order given; an http(s) URL needs --allow-fetch)",
        )
    parser.add_argument(
        "--image-max-tokens",
        type=int,
        choices=IMAGE_BUDGETS,
        metavar="N",
        help="soft tokens an image may take: 70, 140, 280, 560 or 1120 (default: the "
        "model's, 280 for Gemma 4; more reads finer detail, e.g. text)",
    )
    parser.add_argument(
        "--mmproj",
        metavar="FILE",
        help="llama.cpp's mmproj GGUF holding the vision (and E2B/E4B audio) tower of a Gemma 4 "
        "GGUF model (default: the one mmproj*.gguf beside the model file, if there is exactly "
        "one)",
    )
    parser.add_argument(
        "--allow-fetch",
        action="store_true",
        help="fetch images and audio from http(s) URLs (off by default; never from "
        "loopback, private or link-local addresses; data: URLs need no flag)",
    )


def _add_sampling_options(parser: argparse.ArgumentParser, max_tokens_help: str) -> None:
    parser.add_argument("--max-tokens", type=positive_int, metavar="N", help=max_tokens_help)
    parser.add_argument(
        "--temp",
        type=non_negative_float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default)",
    )
    parser.add_argument(
        "--top-p",
        type=probability,
        default=1.0,
        metavar="P",
        help="sample only from the most likely tokens whose probabilities add up to P "
        "(default 1: all)",
    )
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0 disables")
    parser.add_argument(
        "--min-p",
        type=unit_interval,
        default=0.0,
        metavar="P",
        help="drop tokens less likely than P times the most likely one (default 0: off)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=1.0,
        metavar="R",
        help="make the tokens of the last 20 less likely by R, as mlx-lm does: logits above "
        "0 divided by R, below 0 multiplied (default 1: off; 1.1 is mild)",
    )
    parser.add_argument(
        "--seed",
        type=seed_value,
        help="makes sampling reproducible; -1 (as llama.cpp's) or none: a fresh random seed",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when this text appears (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hearth", description="Run open-weight LLMs locally.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser(
        "generate",
        help="complete a prompt, streaming the text",
        # Both positionals in one list (split in run_generate): argparse would give a lone
        # positional before an option to the optional MODEL, not to PROMPT (and see
        # `parse_arguments`).
        usage="hearth generate [options] [MODEL] PROMPT",
    )
    generate.add_argument(
        "args",
        nargs="+",
        metavar="[MODEL] PROMPT",
        help=f"a GGUF file or HF directory (default: {EMBEDDED}), then the prompt ('-' reads "
        "standard input)",
    )
    mode = generate.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the chat template",
    )
    mode.add_argument(
        "--raw",
        dest="chat",
        action="store_false",
        help="send the prompt as is (default unless the model ships a template)",
    )
    shape = generate.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE|JSON",
        help="constrain the output to JSON that follows this schema (a file, or the schema "
        "itself); docs/structured-output.md",
    )
    shape.add_argument(
        "--regex", metavar="PATTERN", help="constrain the output to match this regular expression"
    )
    _add_model_options(generate)
    _add_media_options(generate, inputs=True)
    _add_sampling_options(
        generate,
        f"at most N new tokens (default {DEFAULT_MAX_TOKENS}, shrunk to fit the context; a "
        "prompt or N that does not fit is an error)",
    )

    chat = commands.add_parser(
        "chat",
        help="talk with a model in the terminal",
        description="A conversation through the model's chat template. Commands: "
        f"{', '.join(CHAT_COMMANDS)}. Ctrl-C stops a reply; at the prompt it quits, as do "
        "/exit and Ctrl-D. When the conversation outgrows the model's context, the oldest "
        "turns are dropped (a notice says so).",
    )
    chat.add_argument(
        "model",
        nargs="?",
        help=f"a GGUF file or HF directory (default: {EMBEDDED}, a base model: it completes "
        "text well and chats badly)",
    )
    chat.add_argument("--system", help="a system prompt")
    _add_model_options(chat)
    _add_media_options(chat, inputs=False)
    _add_sampling_options(
        chat,
        f"at most N tokens a reply (default {DEFAULT_MAX_TOKENS}, at most half the context); "
        "older turns are dropped to keep room for them",
    )
    _add_serve_parser(commands)
    _add_inspect_parser(commands)
    _add_fit_parser(commands)
    _add_bench_parser(commands)
    return parser


def _add_serve_parser(commands: Any) -> None:
    """Flags as mlx_lm.server's, where they apply, with its defaults."""
    serve = commands.add_parser(
        "serve", help="serve the OpenAI and Anthropic HTTP APIs (a drop-in for mlx_lm.server)"
    )
    serve.add_argument(
        "model", nargs="?", help="a GGUF file or HF directory (default: the embedded Gemma 3 270M)"
    )
    serve.add_argument("--model", dest="model_flag", metavar="MODEL", help="same as MODEL")
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    serve.add_argument(
        "--chat-template-args",
        type=json_object,
        default={},
        metavar="JSON",
        help="extra chat template variables, e.g. '{\"enable_thinking\": false}'",
    )
    serve.add_argument("--adapter-path", help="LoRA adapters (not supported yet: refused)")
    serve.add_argument("--port", type=port_number, default=8080, help="default 8080")
    serve.add_argument(
        "--temp", type=non_negative_float, default=0.0, help="default temperature (0: greedy)"
    )
    serve.add_argument("--top-p", type=probability, default=1.0, help="default top_p")
    serve.add_argument("--top-k", type=non_negative_int, default=0, help="default top_k (0: off)")
    serve.add_argument("--min-p", type=unit_interval, default=0.0, help="default min_p")
    serve.add_argument(
        "--max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        help=f"default max_tokens ({DEFAULT_MAX_TOKENS}, shrunk to fit the context)",
    )
    serve.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="default INFO",
    )
    serve.add_argument(
        "--prompt-cache-size",
        type=non_negative_int,
        default=10,
        help="most prompt caches kept for reuse (default 10, 0: off)",
    )
    serve.add_argument(
        "--prompt-cache-bytes",
        type=non_negative_int,
        default=2 * 2**30,
        help="most KV bytes the prompt cache keeps (default 2 GiB, 0: off)",
    )
    serve.add_argument(
        "--max-concurrent",
        type=positive_int,
        metavar="N",
        help="requests decoded together at most (default: 8 on a CPU, 16 on a GPU; 1 "
        "decodes one request at a time, on a GPU from its own CUDA graphs)",
    )
    serve.add_argument(
        "--memory-budget",
        type=positive_float,
        metavar="GB",
        help="refuse requests whose weights + KV cache would exceed GB (10^9 bytes)",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=positive_float,
        metavar="GB",
        help="bytes (10^9) of the paged K/V pool that concurrent requests share (default: "
        "what --memory-budget leaves beside the weights, else room for --max-concurrent "
        "requests at the model's whole context, at most half the free memory)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, let running requests finish this long, then cancel them "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g}); a second Ctrl-C exits at once",
    )
    _add_model_options(serve)
    _add_media_options(serve, inputs=False)
    _add_http_compat_options(serve)


def _add_http_compat_options(serve: argparse.ArgumentParser) -> None:
    """What browsers and clients see: CORS origins and the reasoning field's name."""
    serve.add_argument(
        "--cors-origins",
        "--allowed-origins",  # mlx_lm.server's name
        dest="cors_origins",
        type=lambda text: tuple(origin for origin in text.split(",") if origin),
        default=("*",),
        metavar="ORIGINS",
        help="comma-separated origins browsers may call from (default *: any; '': none)",
    )
    serve.add_argument(
        "--reasoning-field",
        choices=["reasoning", "reasoning_content", "both"],
        default="reasoning",
        help="the chat message field for the thought channel (default reasoning, as "
        "mlx_lm.server; reasoning_content, as DeepSeek's API names it; or both)",
    )


def _add_inspect_parser(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect", help="describe a checkpoint: architecture, sizes, quantization, KV bytes"
    )
    inspect.add_argument(
        "model", nargs="?", help="a GGUF file or HF directory (default: the embedded Gemma 3 270M)"
    )
    inspect.add_argument(
        "--plan",
        action="store_true",
        help="also print the execution plan: how each op runs on this machine's device",
    )


def _add_random_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--random",
        metavar="CONFIG",
        help="random weights at a preset's shapes (gemma3-270m, gemma3-12b, e2b, e4b, 12b, "
        "26b-a4b, 31b) or a config.json's",
    )
    parser.add_argument(
        "--quant",
        choices=["bf16", "4bit", "8bit"],
        help="weights of a --random model: bf16 (default) or MLX affine 4/8-bit, group 64",
    )


def _add_fit_parser(commands: Any) -> None:
    fit = commands.add_parser(
        "fit",
        help="whether a model at a context fits the memory, from its headers (nothing loads)",
    )
    fit.add_argument(
        "model", nargs="?", help="a GGUF file, HF or MLX directory (default: the embedded model)"
    )
    fit.add_argument(
        "--context", type=positive_int, default=8192, help="tokens of context (default 8192)"
    )
    fit.add_argument(
        "--memory",
        type=positive_float,
        metavar="GB",
        help="memory the model may take, GB (10^9 bytes); default 75%% of the RAM on a CPU, "
        "90%% of the GPU's memory on CUDA",
    )
    fit.add_argument(
        "--bandwidth",
        type=positive_float,
        metavar="GB/S",
        help="memory bandwidth, GB/s: also print the decode speed it allows at --context",
    )
    _add_random_options(fit)
    _add_model_options(fit)


def length_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. 512,8192,32768."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, got {text!r}"
        )
    return values


def _add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="time batch-1 decode and prefill against the bandwidth/compute rooflines"
    )
    bench.add_argument(
        "model", nargs="?", help="a GGUF file, HF or MLX directory (default: the embedded model)"
    )
    _add_random_options(bench)
    bench.add_argument(
        "--contexts",
        type=length_list,
        default=[512, 8192, 32768],
        metavar="N,N,...",
        help="decode with this many tokens in context (default 512,8192,32768)",
    )
    bench.add_argument(
        "--prefill",
        type=length_list,
        default=[512, 4096, 32768],
        metavar="N,N,...",
        help="prompt lengths to prefill (default 512,4096,32768)",
    )
    bench.add_argument(
        "--steps", type=positive_int, default=32, help="decode steps timed per context (32)"
    )
    bench.add_argument(
        "--hf", action="store_true", help="also time HF transformers (bf16, same process)"
    )
    bench.add_argument("--device", help="cuda or cpu (default: cuda if present)")
    bench.add_argument(
        "--bandwidth",
        type=positive_float,
        metavar="B/S",
        help="memory bandwidth of the decode roofline (default: a copy's, measured on the "
        "device; the issue's H200 figure is 4.2e12)",
    )
    bench.add_argument(
        "--peak-flops",
        type=positive_float,
        metavar="FLOP/S",
        help="compute peak of the prefill roofline (default: a large matmul's in the model's "
        "dtype, measured on the device; the issue's H200 figure is 790e12)",
    )
    bench.add_argument(
        "--kv-quant",
        default="off",
        metavar="KINDS",
        help="KV cache layouts decode runs over, comma-separated: off (default), 8, 4, "
        "turbo:SCHEME; e.g. off,4,turbo:k4v3",
    )
    bench.add_argument(
        "--concurrency",
        type=length_list,
        metavar="N,N,...",
        help="instead of the batch-1 table: run N streams at once through the scheduler at each "
        "level and report aggregate and per-stream tok/s, first-token p50/p99 and the roofline",
    )
    bench.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=512,
        help="each stream's prompt with --concurrency (512)",
    )
    bench.add_argument(
        "--new-tokens",
        type=positive_int,
        default=128,
        help="tokens each stream makes with --concurrency (128)",
    )
    bench.add_argument("--out", metavar="FILE", help="also write the Markdown table to FILE")


def run_bench(args: argparse.Namespace) -> int:
    from hearth.bench import BenchOptions, render, render_concurrency, run_concurrency_bench
    from hearth.bench import run_bench as bench
    from hearth.kv import parse_kv_quant

    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise HearthError(f"--out {args.out}: the directory does not exist")
    options = BenchOptions(
        model=args.model,
        random=args.random,
        quant=args.quant,
        contexts=args.contexts,
        prefill=args.prefill,
        steps=args.steps,
        hf=args.hf,
        device=args.device,
        bandwidth=args.bandwidth,
        peak_flops=args.peak_flops,
        kv_quant=tuple(args.kv_quant.split(",")),
        concurrency=args.concurrency or (),
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
    )
    try:
        for layout in options.kv_quant:
            parse_kv_quant(layout)
    except ValueError as error:
        raise HearthError(str(error)) from None

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if options.concurrency:
        table = render_concurrency(run_concurrency_bench(options, progress))
    else:
        table = render(bench(options, progress))
    print(table, end="")
    if args.out:
        try:
            with open(args.out, "w") as handle:
                handle.write(table)
        except OSError as error:
            raise HearthError(f"cannot write {args.out}: {error.strerror}") from None
    return 0


def run_fit(args: argparse.Namespace) -> int:
    from hearth.fit import describe_fit, plan_fit

    fit = plan_fit(
        args.model,
        args.context,
        args.memory,
        args.device,
        args.dtype,
        args.quantize,
        args.kv_quant,
        args.random,
        args.quant,
    )
    print(describe_fit(fit, args.bandwidth))
    return 0 if fit.fits else 1


def run_inspect(args: argparse.Namespace) -> int:
    from hearth.embedded import embedded_model_path
    from hearth.summary import describe

    print(describe(args.model or embedded_model_path()))
    if args.plan:
        from hearth.summary import describe_plan

        print(describe_plan())
    return 0


def _sampling(args: argparse.Namespace) -> Any:
    from hearth.runtime.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )


def _load(model: str | None, args: argparse.Namespace) -> Any:
    from hearth.engine import Engine

    return Engine.load(
        model,
        dtype=args.dtype,
        device=args.device,
        quantize=args.quantize,
        kv_quant=args.kv_quant,
        mmproj=getattr(args, "mmproj", None),
    )


def warn_if_base_model(engine: Any) -> None:
    """One line on stderr when a conversation goes to a model without a chat template of its
    own: a base model, whose chat replies are poor (the embedded 270M is one)."""
    if not engine.tokenizer.has_own_chat_template:
        print(
            f"hearth: note: {engine.path.name} has no chat template of its own: it is a base "
            "model and chat replies will be poor (`hearth generate` completes text well)",
            file=sys.stderr,
        )


def run_generate(args: argparse.Namespace) -> int:
    if len(args.args) > 2:
        raise HearthError(f"expected [MODEL] PROMPT, got {len(args.args)} arguments")
    model, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    if model is None and os.path.exists(prompt):
        raise HearthError(f"no prompt given: {prompt} is a path; the prompt comes after MODEL")
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise HearthError("the prompt is empty")
    constraint = _output_constraint(args)  # checked before the model loads
    if args.media and args.chat is False:
        raise HearthError("--image and --audio need the chat template: leave out --raw")
    media = read_media_args(args)  # a bad file is told before the model loads
    engine = _load(model, args)
    if media:
        from hearth.media.parts import kind_of, refuse_untaken

        refuse_untaken([kind_of(item) for item in media], engine.modalities, engine.path.name)
    if args.chat or media:
        warn_if_base_model(engine)
    stats = None
    sampling = _sampling(args)
    if media:
        from hearth.chat import media_request
        from hearth.media.parts import media_part

        content = [*map(media_part, media), {"type": "text", "text": prompt}]
        messages = [{"role": "user", "content": content}]
        request = media_request(engine, messages, args.max_tokens, sampling, args.stop, constraint)
        chunks = engine.run(request)
    else:
        chunks = engine.stream(prompt, args.max_tokens, sampling, args.stop, args.chat, constraint)
    for chunk in chunks:
        print(chunk.text, end="", flush=True)
        stats = chunk.stats or stats
    print()
    if stats is not None:
        print(stats.summary(), file=sys.stderr)
    return 0


def read_media_args(args: argparse.Namespace) -> list[Any]:
    """The decoded --image and --audio inputs, in the order given."""
    from hearth.chat import read_media_file

    policy = _fetch_policy(args)
    return [
        read_media_file(kind, value, policy, args.image_max_tokens) for kind, value in args.media
    ]


def _fetch_policy(args: argparse.Namespace) -> Any:
    from hearth.media.fetch import FetchPolicy

    return FetchPolicy(allowed=args.allow_fetch)


def _output_constraint(args: argparse.Namespace) -> OutputConstraint | None:
    """--json-schema (a file, else the schema's text) or --regex, compiled once to refuse
    what cannot be enforced."""
    if args.regex is not None:
        constraint = OutputConstraint.regex(args.regex)
    elif args.json_schema is not None:
        source = args.json_schema
        if not source.lstrip().startswith(("{", "[")) and os.path.isfile(source):
            source = Path(source).read_text()
        constraint = OutputConstraint.json_schema(source)
    else:
        return None
    constraint.to_grammar()
    return constraint


def run_chat(args: argparse.Namespace) -> int:
    from hearth.chat import TerminalChat

    engine = _load(args.model, args)
    warn_if_base_model(engine)
    chat = TerminalChat(
        engine,
        args.system,
        args.max_tokens,
        _sampling(args),
        args.stop,
        _fetch_policy(args),
        args.image_max_tokens,
    )
    return chat.run()


def run_serve(args: argparse.Namespace) -> int:
    if args.model and args.model_flag:
        raise HearthError("give the model either as MODEL or as --model, not both")
    if args.adapter_path:
        raise HearthError("--adapter-path: LoRA adapters are not supported yet")
    from hearth.devices import parse_device
    from hearth.server import ServerDefaults, ServerLimits, listening_socket, serve

    parse_device(args.device)  # a wrong name is told before the port is taken
    # The port next: a taken one is refused at once, not after the model has loaded.
    listener = listening_socket(args.host, args.port)
    started = time.perf_counter()
    try:
        engine = _load(args.model or args.model_flag, args)
    except BaseException:
        listener.close()
        raise
    load_seconds = time.perf_counter() - started
    defaults = ServerDefaults(
        args.temp,
        args.top_p,
        args.top_k,
        args.min_p,
        args.max_tokens,
        args.chat_template_args,
        args.reasoning_field,
        args.image_max_tokens,
    )
    limits = ServerLimits(
        args.prompt_cache_bytes,
        args.prompt_cache_size,
        args.memory_budget,
        args.max_concurrent,
        args.kv_cache_memory,
    )
    return serve(
        engine,
        listener,
        defaults,
        args.log_level,
        limits,
        load_seconds=load_seconds,
        shutdown_timeout=args.shutdown_timeout,
        cors_origins=args.cors_origins,
        fetch=_fetch_policy(args),
    )


_COMMANDS = {
    "generate": run_generate,
    "chat": run_chat,
    "serve": run_serve,
    "inspect": run_inspect,
    "fit": run_fit,
    "bench": run_bench,
}


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with generate's positionals on either side of its options: argparse
    fills a positional list once, so `generate MODEL --temp 0 PROMPT` would leave PROMPT over."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    positional = all(not word.startswith("-") or word == "-" for word in extra)
    if extra and args.command == "generate" and positional:
        args.args += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        return _COMMANDS[args.command](args)
    except (HearthError, ValueError) as error:
        print(f"hearth: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`hearth ... | head`): stop quietly, as other CLI tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
