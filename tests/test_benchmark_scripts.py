"""The top-level benchmark scripts and the GPU suite that runs them, checked without a GPU: a
renamed option or a script moved away would otherwise surface only on the device, as a failed
stage in a call that costs device time."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from hearth.cli import build_parser

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SUITE = (BENCHMARKS / "gpu_suite.sh").read_text()
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def _suite_commands(prefix: str) -> list[list[str]]:
    """The suite's command lines that start with `prefix`, split as the shell splits them."""
    return [
        shlex.split(line.strip().split(prefix, 1)[1])
        for line in SUITE.splitlines()
        if prefix in line and not line.lstrip().startswith("#")
    ]


def test_every_hearth_bench_the_suite_runs_parses() -> None:
    lines = [line.split() for line in SUITE.splitlines() if re.match(r"\s+bench \d+ ", line)]
    assert len(lines) >= 6  # the pattern still finds the suite's tables
    parser = build_parser()
    for _, _, name, model, *options in lines:
        model = model.strip('"').replace("$m", "gemma3-12b")
        arguments = parser.parse_args(["bench", "--random", model, *options, "--out", "x.md"])
        assert arguments.command == "bench", name


def test_every_script_the_suite_runs_is_a_top_level_script_with_those_options() -> None:
    commands = _suite_commands("python benchmarks/")
    assert len(commands) >= 4
    for script, *arguments in commands:
        source = (BENCHMARKS / script).read_text()
        for option in (a for a in arguments if a.startswith("--")):
            assert f'"{option}"' in source, (script, option)


def test_every_test_file_the_suite_runs_on_the_gpu_exists() -> None:
    commands = _suite_commands("python -m pytest ")
    named = [a for command in commands for a in command if a.startswith("tests/")]
    assert named  # the pattern still finds the suite's test stage
    assert [path for path in named if not (BENCHMARKS.parent / path).exists()] == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_top_level_script_imports_nothing_from_the_lab(script: Path) -> None:
    lab_modules = {path.stem for path in (BENCHMARKS / "lab").glob("*.py")}
    imported = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & lab_modules
