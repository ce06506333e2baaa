"""TurboQuant KV layout (the vllm-metal engineering variant, without QJL).

Values: rotated by a fixed random-sign fast Walsh–Hadamard transform over head_dim
(normalised, fp32), then each coordinate coded with the Lloyd–Max codebook of N(0, 1) at
2–4 bits after dividing by its 32-group RMS σ (stored fp16); codes are bit-packed LSB first
(MLX's stream layout: code i occupies bits i·b .. i·b+b-1). Keys: either MLX affine per
32-group at 8 or 4 bits ("k8", "k4"), or rotated and codebook-coded like values ("t4").

Bytes per token and KV head at head_dim d, model dtype of e bytes:
  keys  kB: d·B/8 + 2·(d/32)·e     keys tB: d·B/8 + 2·(d/32)     values vB: d·B/8 + 2·(d/32)
e.g. k8v3 at d = 128 in bf16: 128 + 16 + 48 + 8 = 200 bytes, against 512 for bf16 K/V.

The torch reference path decodes to un-rotated K/V. Deferred-V (attend over rotated V and
inverse-rotate the output once per query) is left to the GPU kernels: see docs/kv-cache.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import pairwise

import torch

from hearth.quant.kv_codecs import AffineCodec
from hearth.quant.mlx import pack_codes, unpack_codes

GROUP = 32
CODEBOOK_BITS = (1, 2, 3, 4)
VALUE_BITS = (2, 3, 4)
AFFINE_KEY_BITS = (4, 8)
SIGN_SEED = 42  # the sign diagonal is part of the layout: never change it for stored caches
DEFAULT_SCHEME = "k8v3"
_SCHEME = re.compile(r"([kt])(\d)v(\d)")
_FP16_MAX = torch.finfo(torch.float16).max


# ---------------------------------------------------------------------------------------------
# Lloyd–Max codebooks for N(0, 1)


def _pdf(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def lloyd_max_normal(bits: int, tolerance: float = 1e-12) -> tuple[list[float], list[float]]:
    """(centroids, interior boundaries) of the MSE-optimal 2^bits-level quantizer of N(0, 1).

    Lloyd iterations on the exact density: boundaries are midpoints of centroids, and each
    centroid is the conditional mean of its cell, (φ(a) − φ(b)) / (Φ(b) − Φ(a)).
    Converges to e.g. ±{0.24509, 0.75601, 1.34391, 2.15195} at 3 bits.
    """
    levels = 1 << bits
    centroids = [-3 + 6 * (i + 0.5) / levels for i in range(levels)]
    while True:
        boundaries = [(a + b) / 2 for a, b in pairwise(centroids)]
        edges = [-math.inf, *boundaries, math.inf]
        updated = [(_pdf(a) - _pdf(b)) / (_cdf(b) - _cdf(a)) for a, b in pairwise(edges)]
        moved = max(abs(u - c) for u, c in zip(updated, centroids, strict=True))
        centroids = updated
        if moved < tolerance:
            return centroids, boundaries


def _tables() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    tables = {}
    for bits in CODEBOOK_BITS:
        centroids, boundaries = lloyd_max_normal(bits)
        tables[bits] = (torch.tensor(centroids), torch.tensor(boundaries))
    return tables


CODEBOOKS = _tables()  # bits -> (centroids, boundaries), fp32; ~10 ms at import


@cache
def _on_device(table: str, key: int, device: torch.device) -> torch.Tensor:
    """A codebook (by bits) or sign vector (by dim) copied to `device` once: a decode step
    captured in a CUDA graph must not copy from the host."""
    if table == "signs":
        return random_signs(key).to(device)
    centroids, boundaries = CODEBOOKS[key]
    return (centroids if table == "centroids" else boundaries).to(device)


def quantize_normal(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Codebook index of each element (the number of boundaries below it), as uint8."""
    boundaries = _on_device("boundaries", bits, x.device)
    return torch.bucketize(x.float().contiguous(), boundaries).to(torch.uint8)


def dequantize_normal(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return _on_device("centroids", bits, codes.device)[codes.long()]


# ---------------------------------------------------------------------------------------------
# Rotation


@cache
def random_signs(dim: int) -> torch.Tensor:
    """The fixed ±1 diagonal applied before the Hadamard transform, per head_dim."""
    generator = torch.Generator().manual_seed(SIGN_SEED)
    return torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh–Hadamard transform (Sylvester order) of the last dim, in fp32.

    Symmetric and orthonormal, hence its own inverse. fp32 throughout: half-precision
    butterflies lose the small coordinates to cancellation.
    """
    dim = x.shape[-1]
    y = x.float().reshape(-1, dim)
    half = 1
    while half < dim:
        pairs = y.view(-1, dim // (2 * half), 2, half)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((low + high, low - high), dim=2).view(-1, dim)
        half *= 2
    return y.view(x.shape) * dim**-0.5


def rotate(x: torch.Tensor) -> torch.Tensor:
    """H·diag(s)·x: spreads each vector's energy evenly, so coordinates look Gaussian."""
    return hadamard(x.float() * _on_device("signs", x.shape[-1], x.device))


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """diag(s)·H·y, the inverse of `rotate`."""
    return hadamard(y) * _on_device("signs", y.shape[-1], y.device)


# ---------------------------------------------------------------------------------------------
# Codec


def encode_rotated(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes uint32 [..., d·bits/32], σ fp16 [..., d/32]) of `x` [..., d]."""
    groups = rotate(x).unflatten(-1, (-1, GROUP))
    # σ is rounded to fp16 before normalising, so decoding uses the σ the codes were made with.
    sigma = groups.square().mean(dim=-1).sqrt().clamp(max=_FP16_MAX).to(torch.float16)
    normalised = groups / sigma.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return pack_codes(quantize_normal(normalised, bits).flatten(-2), bits), sigma


def decode_rotated(
    packed: torch.Tensor, sigma: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    levels = dequantize_normal(unpack_codes(packed, bits), bits).unflatten(-1, (-1, GROUP))
    return unrotate((levels * sigma.float()[..., None]).flatten(-2)).to(dtype)


@dataclass(frozen=True)
class TurboCodec:
    """Keys affine ("k") or rotated + codebook ("t") at `key_bits`; values rotated + codebook."""

    key_kind: str
    key_bits: int
    value_bits: int

    def __post_init__(self) -> None:
        allowed_keys = AFFINE_KEY_BITS if self.key_kind == "k" else VALUE_BITS
        if self.key_kind not in ("k", "t") or self.key_bits not in allowed_keys:
            raise ValueError(
                f"TurboQuant keys are k{AFFINE_KEY_BITS} (affine) or t{VALUE_BITS} (codebook), "
                f"got {self.key_kind}{self.key_bits}"
            )
        if self.value_bits not in VALUE_BITS:
            raise ValueError(f"TurboQuant value bits must be one of {VALUE_BITS}")

    @classmethod
    def parse(cls, scheme: str) -> TurboCodec:
        """`k8v3`-style names: key kind and bits, then value bits."""
        match = _SCHEME.fullmatch(scheme)
        if match is None:
            raise ValueError(f"unknown TurboQuant scheme {scheme!r}; expected e.g. k8v3 or t4v3")
        kind, key_bits, value_bits = match.groups()
        return cls(kind, int(key_bits), int(value_bits))

    @property
    def name(self) -> str:
        return f"{self.key_kind}{self.key_bits}v{self.value_bits}"

    @property
    def _affine_keys(self) -> AffineCodec | None:
        return AffineCodec(self.key_bits, GROUP) if self.key_kind == "k" else None

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim < GROUP or head_dim & (head_dim - 1):
            raise ValueError(
                f"TurboQuant rotates whole heads with a Hadamard transform: head_dim must be a "
                f"power of two of at least {GROUP}, got {head_dim}"
            )

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        affine = self._affine_keys
        key_planes = affine.quantize(keys) if affine else encode_rotated(keys, self.key_bits)
        return (*key_planes, *encode_rotated(values, self.value_bits))

    def decode(
        self, planes: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        *key_planes, packed_values, sigma_values = planes
        affine = self._affine_keys
        if affine:
            keys = affine.dequantize(key_planes).to(dtype)
        else:
            keys = decode_rotated(*key_planes, self.key_bits, dtype)
        return keys, decode_rotated(packed_values, sigma_values, self.value_bits, dtype)

    def signature(self) -> str:
        return f"turbo:{self.name}"
