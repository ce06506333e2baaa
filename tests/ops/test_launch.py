"""The fast Triton launch (`hearth.ops.launch`): its specialization key, and on a GPU the
results of launches that must not share a compiled kernel.

The key must be at least as fine as Triton's own specialization, or a launch would reuse a
kernel compiled for another case (an aligned tensor's vector loads on an unaligned one, an
argument of 1 folded into the code). The CPU tests check which calls share a key; the GPU
test launches one kernel across those cases and compares every result with torch.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hearth.ops import HAS_TRITON, launch

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
tl = pytest.importorskip("triton.language")


def _signature(*params: tuple[str, bool, Any]) -> launch._Signature:
    """A `_Signature` as read from a JIT function with these (name, constexpr, default)."""
    fake = SimpleNamespace(
        arg_names=[name for name, _, _ in params],
        params=[SimpleNamespace(is_constexpr=c, default=d) for _, c, d in params],
    )
    return launch._Signature(fake)


EMPTY = inspect.Parameter.empty
SIGNATURE = _signature(("x", False, EMPTY), ("n", False, EMPTY), ("BLOCK", True, 64))


def key(*args: Any, **kwargs: Any) -> Any:
    bound = launch._bind(SIGNATURE, args, kwargs)
    assert bound is not None
    return bound[1]


def test_key_tells_apart_what_triton_specializes_on() -> None:
    base = torch.zeros(64)
    assert key(base, 5) == key(torch.ones(64), 7)  # values of one class share a kernel
    assert key(base, 5) != key(base[1:], 5)  # 4 bytes off 16-byte alignment
    assert key(base, 5) != key(base.to(torch.float16), 5)
    assert key(base, 5) != key(base, 1)  # Triton folds an argument of 1
    assert key(base, 5) != key(base, 32)  # a multiple of 16
    assert key(base, 5) != key(base, 2**40)  # 64-bit integers
    assert key(base, 5) != key(base, 5, BLOCK=128)  # a constexpr's value
    assert key(base, 5) == key(base, 5, BLOCK=64)  # the default, given or not
    assert key(base, 5) != key(base, 5, num_warps=8)  # launch options
    assert key(base, 5) != key(base, True)


def test_bind_fills_defaults_and_refuses_what_it_cannot_key() -> None:
    values, _ = launch._bind(SIGNATURE, (torch.zeros(4), 3), {})
    assert values[2] == 64
    assert launch._bind(SIGNATURE, (torch.zeros(4),), {}) is None  # `n` is missing
    assert launch._bind(SIGNATURE, (torch.zeros(4), [1, 2]), {}) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the fast path")
def test_launches_across_specializations_match_torch() -> None:
    import triton

    @triton.jit
    def scaled_add(x, y, n, scale, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(y + offsets, tl.load(x + offsets, mask=mask) * scale + n, mask=mask)

    source = torch.randn(4096 + 3, device="cuda")
    cases = [(0, 4096), (1, 4096), (0, 1), (3, 1000), (0, 4096), (1, 17), (0, 4096)]
    for offset, n in cases:
        for block in (128, 256):
            x = source[offset : offset + n]
            y = torch.empty(n + 1, device="cuda")[1:] if offset else torch.empty(n, device="cuda")
            launch.launch_kernel(scaled_add, (triton.cdiv(n, block),), x, y, n, 0.5, BLOCK=block)
            torch.testing.assert_close(y, x * 0.5 + n, rtol=0, atol=0)
    # The repeated cases launched a kept kernel (the fast path) rather than adding one.
    kept = launch.signature_of(scaled_add).compiled
    assert 0 < len(kept) < 2 * len(cases)


def test_triton_hooks_idle_by_default() -> None:
    """Triton 3.6 keeps empty hook chains, not None: the fast path must see them as idle."""
    from triton import knobs

    assert launch._idle(knobs.runtime.launch_enter_hook)
    assert launch._idle(knobs.runtime.launch_exit_hook)
    assert launch._idle(None)
    assert not launch._idle(SimpleNamespace(calls=[print]))


def _body(x, n, BLOCK: tl.constexpr):  # a JIT function's signature, never compiled here
    pass


def test_fast_path_launches_kept_kernels_with_raw_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control flow without a GPU: a miss goes through Triton and keeps its kernel, a hit
    calls that kernel's launcher with raw addresses on the current stream, a launcher that
    rejects its arguments hands this and later launches back to Triton."""
    from triton.runtime.jit import JITFunction

    function = JITFunction(_body)
    log: list[Any] = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *args: Any) -> None:
            log.append(("fast", *args))

    compiled = Compiled()

    def triton_run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Compiled:
        log.append(("triton", args, tuple(grid), kwargs))
        return compiled

    monkeypatch.setattr(function, "run", triton_run)
    monkeypatch.setattr(launch, "_fast_path_usable", lambda: True)
    monkeypatch.setattr(launch, "_usable", [True])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    x = torch.zeros(16)
    launch.launch_kernel(function, (4,), x, 5, BLOCK=32)
    assert log[-1] == ("triton", (x, 5), (4,), {"BLOCK": 32})
    launch.launch_kernel(function, (4,), x, 9, BLOCK=32)  # same class of integer: a hit
    grid_and_stream = (4, 1, 1, 7)
    assert log[-1] == ("fast", *grid_and_stream, "function", "metadata", None, None, None,
                       x.data_ptr(), 9, 32)  # fmt: skip
    launch.launch_kernel(function, lambda meta: (meta["BLOCK"] // 8, 2), x[1:], 9, BLOCK=32)
    assert log[-1][0] == "triton" and log[-1][2] == (4, 2)  # unaligned: a miss

    def rejects(*args: Any) -> None:
        raise TypeError("another launcher")

    monkeypatch.setattr(Compiled, "run", rejects)
    launch.launch_kernel(function, (4,), x, 9, BLOCK=32)
    assert log[-1][0] == "triton" and launch._usable == [False]
