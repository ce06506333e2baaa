"""MLX affine group quantization, in torch: the layout of MLX-quantized safetensors checkpoints.

A quantized ``Linear`` / ``Embedding`` at path ``p`` stores (``...`` = optional leading dims,
e.g. experts):

* ``p.weight``: uint32 ``[..., out, in * bits / 32]``, each row's codes as one bit stream,
  LSB first: code ``j`` occupies bits ``j * bits ... j * bits + bits - 1`` of the row, and a
  code may straddle two words (3, 5, 6 bits). Read as little-endian bytes, every ``bits``
  bytes hold exactly 8 codes, which is how this module unpacks all widths with one loop.
* ``p.scales``, ``p.biases``: ``[..., out, in / group_size]`` in the float dtype of the model.

The weight is ``w = scale * q + bias`` per group. ``mx.dequantize`` rounds twice, in the
scales' dtype: ``q * scale`` to that dtype, then ``+ bias`` to that dtype (no fma). Torch's
eager ``*`` and ``+`` round the same way, so ``dequantize_affine`` equals ``mx.dequantize``
bit for bit (tests/layers/test_mlx_affine.py); do not fuse the two ops (``addcmul``, torch.compile).

``quantize_affine`` follows the CPU kernel of ``mx.quantize`` (fp32 statistics per group,
the scale re-fitted so that the edge of larger magnitude is exactly representable) and equals
it bit for bit: it exists for tests and benchmarks, not for loading.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hearth.errors import CheckpointError

AFFINE_MODE = "affine"
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# What `nn.Linear.to_quantized` uses for a per-module entry that leaves a field out.
DEFAULT_GROUP_SIZE = 64
DEFAULT_BITS = 4
CODES_PER_CHUNK = 8  # 8 codes of b bits fill exactly b bytes
WORD_BITS = 32
# mx.quantize's floor on |scale|, which keeps constant groups finite.
SCALE_EPSILON = 1e-7
PACKED_TENSORS = ("weight", "scales", "biases")
_GLOBAL_KEYS = ("group_size", "bits", "mode")

# Packed words are reinterpreted as bytes in memory order; the layout is little-endian.
assert sys.byteorder == "little", "MLX packed weights are read as little-endian bytes"


def _check_bits(bits: int) -> None:
    if bits not in AFFINE_BITS:
        raise ValueError(f"affine bits must be one of {AFFINE_BITS}, got {bits}")


@dataclass(frozen=True)
class AffineSpec:
    """How one module is quantized: bits per code and inputs per (scale, bias) group."""

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        if self.group_size not in AFFINE_GROUP_SIZES:
            raise ValueError(
                f"affine group_size must be one of {AFFINE_GROUP_SIZES}, got {self.group_size}"
            )

    def packed_columns(self, in_features: int) -> int:
        return in_features * self.bits // WORD_BITS

    def groups(self, in_features: int) -> int:
        return in_features // self.group_size


# ---------------------------------------------------------------------------------------------
# Codes <-> packed words


def _code_bytes(index: int, bits: int) -> tuple[int, int, bool]:
    """Where code `index` of a chunk sits: first byte, bit offset in it, spills into the next."""
    byte, offset = divmod(index * bits, 8)
    return byte, offset, offset + bits > 8


def unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """uint8 codes ``[..., in]`` of MLX-packed words ``[..., in * bits / 32]`` (uint32)."""
    _check_bits(bits)
    if packed.element_size() != 4 or packed.dtype.is_floating_point:
        raise ValueError(f"packed MLX weights are 32-bit words, got {packed.dtype}")
    stream = packed.contiguous().view(torch.uint8)
    chunks = stream.reshape(*stream.shape[:-1], -1, bits)
    mask = (1 << bits) - 1
    codes = []
    for index in range(CODES_PER_CHUNK):
        byte, offset, spills = _code_bytes(index, bits)
        code = chunks[..., byte] >> offset
        if spills:
            # uint8 shifts drop the high bits, which the mask discards anyway.
            code = code | (chunks[..., byte + 1] << (8 - offset))
        codes.append(code & mask)
    return torch.stack(codes, dim=-1).reshape(*stream.shape[:-1], -1)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Inverse of ``unpack_codes``: codes ``[..., in]`` -> uint32 ``[..., in * bits / 32]``."""
    _check_bits(bits)
    if codes.shape[-1] * bits % WORD_BITS:
        raise ValueError(f"{codes.shape[-1]} codes of {bits} bits do not fill whole words")
    chunks = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, CODES_PER_CHUNK)
    stream = torch.zeros(*chunks.shape[:-1], bits, dtype=torch.uint8, device=codes.device)
    for index in range(CODES_PER_CHUNK):
        byte, offset, spills = _code_bytes(index, bits)
        code = chunks[..., index]
        stream[..., byte] |= code << offset
        if spills:
            stream[..., byte + 1] |= code >> (8 - offset)
    return stream.reshape(*codes.shape[:-1], -1).view(torch.uint32)


# ---------------------------------------------------------------------------------------------
# Dequantize / quantize


def dequantize_affine(
    packed: Tensor, scales: Tensor, biases: Tensor, bits: int, group_size: int
) -> Tensor:
    """Weights ``[..., out, in]`` in the scales' dtype, equal to ``mx.dequantize`` bit for bit."""
    codes = unpack_codes(packed, bits)
    groups = codes.reshape(*codes.shape[:-1], -1, group_size).to(scales.dtype)
    # Two roundings in the scales' dtype, as mlx does: keep these two separate ops.
    weights = groups * scales[..., None]
    weights = weights + biases[..., None]
    return weights.flatten(-2)


def quantize_affine(weight: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(packed uint32, scales, biases)`` of ``weight [..., in]``, as ``mx.quantize`` makes them.

    Scales and biases take the weight's dtype; the arithmetic is fp32, like mlx's CPU kernel.
    """
    AffineSpec(bits, group_size)
    if weight.shape[-1] % group_size:
        raise ValueError(f"in_features {weight.shape[-1]} is not divisible by {group_size}")
    levels = float((1 << bits) - 1)
    groups = weight.detach().float().reshape(*weight.shape[:-1], -1, group_size)
    high, low = groups.amax(dim=-1), groups.amin(dim=-1)
    # Anchor the grid on the edge of larger magnitude so that edge is hit exactly.
    low_is_edge = low.abs() > high.abs()
    step = ((high - low) / levels).clamp_min(SCALE_EPSILON)
    scale = torch.where(low_is_edge, step, -step)
    edge = torch.where(low_is_edge, low, high)
    edge_code = torch.round(edge / scale)
    anchored = edge_code != 0
    scale = torch.where(anchored, edge / edge_code, scale)
    bias = torch.where(anchored, edge, torch.zeros_like(edge))
    codes = torch.round((groups - bias[..., None]) / scale[..., None]).clamp_(0, levels)
    packed = pack_codes(codes.to(torch.uint8).flatten(-2), bits)
    return packed, scale.to(weight.dtype), bias.to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# Checkpoint metadata


def check_packed_shapes(
    spec: AffineSpec,
    weight_shape: tuple[int, ...],
    packed: Tensor,
    scales: Tensor,
    biases: Tensor,
) -> None:
    """Raise ValueError unless the three tensors quantize a ``weight_shape`` weight by ``spec``."""
    *lead, in_features = weight_shape
    if in_features % spec.group_size or in_features * spec.bits % WORD_BITS:
        raise ValueError(f"{in_features} inputs cannot be packed with {spec}")
    expected = {
        "weight": (*lead, spec.packed_columns(in_features)),
        "scales": (*lead, spec.groups(in_features)),
        "biases": (*lead, spec.groups(in_features)),
    }
    for role, tensor in zip(PACKED_TENSORS, (packed, scales, biases), strict=True):
        if tuple(tensor.shape) != expected[role]:
            raise ValueError(
                f"{role} has shape {tuple(tensor.shape)}; {spec} of a {tuple(weight_shape)} "
                f"weight needs {expected[role]}"
            )
    if packed.element_size() != 4 or packed.dtype.is_floating_point:
        raise ValueError(f"weight is {packed.dtype}, not packed 32-bit words")
    if not scales.dtype.is_floating_point or scales.dtype != biases.dtype:
        raise ValueError(
            f"scales ({scales.dtype}) and biases ({biases.dtype}) must share a float dtype"
        )


def infer_spec(in_features: int, packed: Tensor, scales: Tensor) -> AffineSpec:
    """The spec the shapes imply, for modules the config does not list (mlx-lm's rule)."""
    return AffineSpec(
        bits=packed.shape[-1] * WORD_BITS // in_features,
        group_size=in_features // max(scales.shape[-1], 1),
    )


@dataclass(frozen=True)
class MLXQuantization:
    """config.json's ``quantization``: a default and per-module entries by canonical path.

    An entry is a spec, or None for a module the converter left in float.
    """

    default: AffineSpec
    modules: Mapping[str, AffineSpec | None]

    def spec_for(self, module: str, in_features: int, packed: Tensor, scales: Tensor) -> AffineSpec:
        """The listed spec of `module`, else the one its shapes imply (as mlx-lm loads it)."""
        listed = self.modules.get(module)
        return listed if listed is not None else infer_spec(in_features, packed, scales)

    def quantized_modules(self, tensor_names: Iterable[str]) -> set[str]:
        """Modules stored packed (they have ``.scales``); raises on config/file disagreement."""
        names = set(tensor_names)
        packed = {name.removesuffix(".scales") for name in names if name.endswith(".scales")}
        for module in sorted(packed):
            if module in self.modules and self.modules[module] is None:
                raise CheckpointError(f"config.json marks {module} unquantized, but it is packed")
        for module, spec in sorted(self.modules.items()):
            if spec is not None and f"{module}.weight" in names and module not in packed:
                raise CheckpointError(f"config.json quantizes {module}, but it has no scales")
        return packed


def _mode_of(entry: Mapping[str, Any], where: str) -> None:
    mode = entry.get("mode", AFFINE_MODE)
    if mode != AFFINE_MODE:
        raise CheckpointError(
            f"MLX quantization mode {mode!r} ({where}) is not supported: only 'affine' is"
        )


def _spec_of(entry: Mapping[str, Any], where: str, default: AffineSpec | None) -> AffineSpec:
    _mode_of(entry, where)
    try:
        if default is None:
            return AffineSpec(int(entry["bits"]), int(entry["group_size"]))
        # Missing fields take mlx's per-mode defaults, as `to_quantized(**entry)` does.
        return AffineSpec(
            int(entry.get("bits", DEFAULT_BITS)), int(entry.get("group_size", DEFAULT_GROUP_SIZE))
        )
    except KeyError as error:
        raise CheckpointError(f"quantization ({where}) lacks {error.args[0]!r}") from None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"quantization ({where}): {error}") from None


def _module_entry(module: str, entry: Any, default: AffineSpec) -> AffineSpec | None:
    if entry is False:
        return None
    if entry is True:
        return default
    if isinstance(entry, Mapping):
        return _spec_of(entry, module, default)
    raise CheckpointError(f"quantization entry of {module} must be a bool or an object")


def parse_quantization(config: Mapping[str, Any]) -> MLXQuantization | None:
    """The MLX quantization of a config dict, or None for a float checkpoint.

    Refuses, with one line naming it, any mode but affine and HF-style quantization methods.
    """
    quantization = config.get("quantization")
    if quantization is None:
        hf_quantization = config.get("quantization_config")
        if isinstance(hf_quantization, Mapping) and "quant_method" in hf_quantization:
            method = hf_quantization["quant_method"]
            raise CheckpointError(f"quantization method {method!r} is not supported")
        return None
    if not isinstance(quantization, Mapping):
        raise CheckpointError("config.json's quantization must be an object")
    default = _spec_of(quantization, "the default", None)
    modules = {
        module: _module_entry(module, entry, default)
        for module, entry in quantization.items()
        if module not in _GLOBAL_KEYS
    }
    return MLXQuantization(default, modules)
