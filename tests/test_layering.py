"""The package's layers (docs/architecture.md): imports go down this list only, never up, and
no two modules import each other at load time.

    faces (cli, server) -> engine -> runtime -> models -> layers -> kv -> ops -> quant

`checkpoint` (file readers) sits between models and layers; config, errors, tokenizer, the
embedded model's locator, device names, generation lengths and media decoding are leaves
anyone may import.
Every import counts, also those inside functions; for cycles only the imports that run at load
time count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hearth

ROOT = Path(hearth.__file__).parent
# Lower numbers are higher layers; a module may import its own package or any lower one.
RANKS = {
    "cli": 0,
    "chat": 0,
    "server": 0,
    "__main__": 0,
    "__init__": 1,  # hearth's public API: load(), Engine, SamplingParams
    "engine": 1,
    "fit": 1,
    "summary": 1,
    "bench": 1,
    "runtime": 2,
    "models": 3,
    "checkpoint": 4,
    "layers": 5,
    "kv": 6,
    "ops": 7,
    "quant": 8,
    "config": 9,
    "errors": 9,
    "tokenizer": 9,
    "embedded": 9,
    "devices": 9,
    "lengths": 9,
    "media": 9,
}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, name: str, load_time_only: bool) -> set[str]:
    """The hearth modules `name` imports (as written, or their package where a name is taken
    from a package); `load_time_only`: not inside functions or TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped: set[int] = set()
    if load_time_only:
        for node in ast.walk(tree):
            deferred = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            )
            if deferred:
                skipped |= {id(child) for child in ast.walk(node) if child is not node}
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names if alias.name.startswith("hearth")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if not base.startswith("hearth"):
                continue
            for alias in node.names:
                targets.add(f"{base}.{alias.name}")
    return targets


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The module a target names: itself, or the module it takes a name from."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _rank(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in RANKS, f"{module}: a package the layering does not place"
    return RANKS[top]


def test_imports_only_go_down_the_layers() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(path, name, load_time_only=False):
            imported = _resolve(target, modules)
            if imported is None or imported.split(".")[:2] == name.split(".")[:2]:
                continue  # within one package
            if _rank(imported) < _rank(name):
                upward.append(f"{name} imports {imported}")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {
        name: {
            resolved
            for target in _imports(path, name, load_time_only=True)
            if (resolved := _resolve(target, modules)) not in (None, name)
        }
        for name, path in modules.items()
    }
    # A package's __init__ that re-exports its modules is imported by them through their
    # parent: count a module's edge to its own package as no edge.
    for name, edges in graph.items():
        edges -= {parent for parent in graph if name.startswith(parent + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                cycle.extend([*path[path.index(child) :], child] if child in path else [child])
                return True
            if child not in state and visit(child, [*path, child]):
                return True
        state[node] = 2
        return False

    for name in sorted(graph):
        if name not in state and visit(name, [name]):
            break
    assert not cycle, " -> ".join(cycle)


def test_model_files_import_no_kernel_and_no_switch() -> None:
    """A model file is architecture only: it imports layers, the caches' types and configs,
    never ops (kernels, native code) or the runtime."""
    modules = _modules()
    for name, path in modules.items():
        if not name.startswith("hearth.models.") or name == "hearth.models.loading":
            continue
        for target in _imports(path, name, load_time_only=False):
            imported = _resolve(target, modules) or target
            assert not imported.startswith(("hearth.ops", "hearth.runtime")), (name, imported)
