"""Whether Triton's cos/sin (tl.cos, tl.sin, libdevice) equal torch's on the GPU, bit for bit,
for RoPE angles (positions up to 131072 times Gemma's inverse frequencies), in fp32 and
after rounding to bf16; then `rope.rotary_tables_triton` against its torch reference.

    PYTHONPATH=$PWD/src python benchmarks/lab/gpu_trig_bits.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hearth.ops.rope import rotary_tables_reference, rotary_tables_triton


@triton.jit
def _trig(x_ptr, out_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0)
    if WHICH == 0:
        y = tl.cos(x)
    elif WHICH == 1:
        y = tl.sin(x)
    elif WHICH == 2:
        y = libdevice.cos(x)
    else:
        y = libdevice.sin(x)
    tl.store(out_ptr + i, y, mask=ok)


def main() -> None:
    positions = torch.arange(0, 131072, 7, device="cuda").float()
    for theta, dim in ((10_000.0, 256), (1_000_000.0, 512)):
        exponents = torch.arange(0, dim, 2, device="cuda").float() / dim
        inv_freq = 1.0 / theta**exponents
        angles = (positions[:, None] * inv_freq[None, :]).reshape(-1).contiguous()
        n = angles.numel()
        for which, name, reference in (
            (0, "tl.cos", angles.cos()),
            (1, "tl.sin", angles.sin()),
            (2, "libdevice.cos", angles.cos()),
            (3, "libdevice.sin", angles.sin()),
        ):
            out = torch.empty_like(angles)
            _trig[(triton.cdiv(n, 1024),)](angles, out, n, WHICH=which, BLOCK=1024)
            fp32 = int((out != reference).sum())
            bf16 = int((out.bfloat16() != reference.bfloat16()).sum())
            print(f"theta {theta:g} dim {dim} {name}: fp32 differ {fp32} / {n}, bf16 {bf16}")
        for dtype in (torch.float32, torch.bfloat16):
            got = rotary_tables_triton(positions.long(), inv_freq, dtype)
            want = rotary_tables_reference(positions.long(), inv_freq, dtype)
            differ = sum(int((g != w).sum()) for g, w in zip(got, want, strict=True))
            print(f"theta {theta:g} dim {dim} rotary_tables {dtype}: differ {differ}")


if __name__ == "__main__":
    main()
