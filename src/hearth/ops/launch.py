"""Launching compiled Triton kernels for less host time than `kernel[grid](...)`.

Triton's own launch binds and specializes every argument in Python, builds a cache key, and
its C launcher calls `data_ptr()` and `cuPointerGetAttribute` for each tensor: several times
the host time of the compiled kernel's launcher given raw addresses
(`benchmarks/gpu_launch_overhead.py`). An eager prefill of a short prompt is hundreds of such
launches, and the GPU waits for them (`benchmarks/gpu_host_breakdown.py`).

`launch_kernel` keys each compiled kernel by what Triton specializes on, or finer: every tensor's
dtype and 16-byte alignment, every integer's width class and whether it is 1 or a multiple
of 16, a constexpr's value, the launch options. On a hit it launches the compiled kernel
directly with raw addresses; on a miss (a new specialization, the first call of an autotuned
key, the interpreter) it goes through Triton and keeps the kernel Triton returns. Triton's
check that a kernel's global values did not change is skipped: the kernels here read no
globals that change (every choice reaches them as an argument).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hearth.ops import HAS_TRITON

Grid = Sequence[int] | Callable[[dict[str, Any]], Sequence[int]]

if HAS_TRITON:
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - Triton before 3.4: its own launch path only
        knobs = None
else:  # pragma: no cover - depends on the install
    Autotuner = JITFunction = knobs = None

_INT32 = range(-(2**31), 2**31)


class _Signature:
    """A JIT function's parameters, read once (names, constexpr flags, defaults), and its
    compiled kernels by specialization key."""

    def __init__(self, function: Any) -> None:
        self.names: list[str] = list(function.arg_names)
        self.constexpr = [param.is_constexpr for param in function.params]
        self.defaults = [param.default for param in function.params]
        self.compiled: dict[tuple[Any, ...], Any] = {}


def launch_kernel(kernel: Any, grid: Grid, *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, for a `triton.jit` or `triton.autotune` kernel."""
    if not _fast_path_usable():
        kernel[grid](*args, **kwargs)
        return
    given_grid, given_kwargs = grid, kwargs  # for Triton's own path, if it must take over
    function = kernel
    if isinstance(kernel, Autotuner):
        config = _tuned_config(kernel, args, kwargs)
        if config is None or not isinstance(kernel.fn, JITFunction):
            kernel[grid](*args, **kwargs)  # autotunes this key (or has a pre-hook)
            return
        kwargs = {**kwargs, **config.all_kwargs()}
        function = kernel.fn
    if not isinstance(function, JITFunction):
        kernel[grid](*args, **kwargs)
        return
    signature = signature_of(function)
    bound = _bind(signature, args, kwargs)
    if bound is None:
        kernel[grid](*args, **kwargs)
        return
    values, key = bound
    device = torch.cuda.current_device()
    key = (device, key)
    if callable(grid):
        grid = grid(dict(zip(signature.names, values, strict=True)))
    compiled = signature.compiled.get(key)
    if compiled is None:
        compiled = function.run(*args, grid=grid, warmup=False, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            signature.compiled[key] = compiled
        return
    addresses = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
    size = len(grid)
    try:
        compiled.run(
            grid[0],
            grid[1] if size > 1 else 1,
            grid[2] if size > 2 else 1,
            torch._C._cuda_getCurrentRawStream(device),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *addresses,
        )
    except TypeError:
        # The compiled launcher parses its arguments before it launches: a Triton whose
        # launcher takes others is used through its own path from now on.
        _usable[:] = [False]
        kernel[given_grid](*args, **given_kwargs)


def signature_of(function: Any) -> _Signature:
    """The function's `_Signature`, kept on the function object itself."""
    signature = getattr(function, "_hearth_signature", None)
    if signature is None:
        signature = _Signature(function)
        function._hearth_signature = signature
    return signature


def _bind(
    signature: _Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], tuple[Any, ...]] | None:
    """Every parameter's value in order, and the specialization key; None where a value is
    of a kind this does not key (Triton launches it then)."""
    names = signature.names
    values = list(args)
    for index in range(len(args), len(names)):
        name = names[index]
        if name in kwargs:
            values.append(kwargs[name])
        else:
            default = signature.defaults[index]
            if default is inspect.Parameter.empty:
                return None
            values.append(default)
    parts: list[Any] = []
    for value, constexpr in zip(values, signature.constexpr, strict=True):
        if constexpr:
            parts.append(value)
        elif isinstance(value, torch.Tensor):
            parts.append((value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool):
            parts.append(("bool", value))
        elif isinstance(value, int):
            parts.append(("int", value == 1, value % 16 == 0, value in _INT32, value >= 2**63))
        elif isinstance(value, float):
            parts.append(("float",))
        elif value is None:
            parts.append(None)
        else:
            return None
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in signature.names))
    try:
        key = (tuple(parts), options)
        hash(key)
    except TypeError:
        return None
    return values, key


def _tuned_config(tuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The config Triton's autotuner picked for this call's key (its own key rule), or None
    if it has not tuned that key yet or the config has a pre-hook."""
    if len(tuner.configs) <= 1:
        config = tuner.configs[0]
    else:
        named = {**dict(zip(tuner.arg_names, args, strict=False)), **kwargs}
        named = {k: v for k, v in named.items() if k in tuner.arg_names}
        key = [named[k] for k in tuner.keys if k in named]
        key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
        config = tuner.cache.get(tuple(key))
    if config is None or config.pre_hook is not None:
        return None
    return config


_usable: list[bool] = []


def _fast_path_usable() -> bool:
    """A GPU, the torch and Triton internals this uses, and no launch hooks (a profiler that
    hooks launches sees every one through Triton's own path)."""
    if not _usable:
        _usable.append(
            HAS_TRITON
            and torch.cuda.is_available()
            and hasattr(torch._C, "_cuda_getCurrentRawStream")
            and knobs is not None
            and hasattr(knobs, "runtime")
        )
    if not _usable[0]:
        return False
    runtime = knobs.runtime
    return _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


def _idle(hook: Any) -> bool:
    """No hook: None, or an empty chain (Triton 3.6 holds hooks in a `HookChain`)."""
    if hook is None:
        return True
    calls = getattr(hook, "calls", None)
    return calls is not None and not calls
