"""Layers whose weights stay MLX affine-packed in memory (their maths: `quant.mlx`).

On the CPU a forward is the torch reference (dequantize bit-exactly as mlx does, then a float
matmul); on CUDA the Triton kernels of `ops.affine_matmul` read the packed codes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hearth.ops import affine_matmul as affine_kernels
from hearth.ops.norm import Partials
from hearth.quant.mlx import (
    WORD_BITS,
    AffineSpec,
    check_packed_shapes,
    dequantize_affine,
    quantize_affine,
)


class _PackedAffine(nn.Module):
    """Packed codes with their scales and biases, kept as they are in the checkpoint."""

    packed: Tensor
    scales: Tensor
    biases: Tensor

    def __init__(
        self, packed: Tensor, scales: Tensor, biases: Tensor, bits: int, group_size: int
    ) -> None:
        super().__init__()
        spec = AffineSpec(bits, group_size)
        self.bits = bits
        self.group_size = group_size
        self.out_features = packed.shape[-2]
        self.in_features = packed.shape[-1] * WORD_BITS // bits
        check_packed_shapes(spec, (*packed.shape[:-1], self.in_features), packed, scales, biases)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("biases", biases)

    def dequantize(self) -> Tensor:
        """The float weights, in the scales' dtype, exactly as mlx dequantizes them."""
        return dequantize_affine(self.packed, self.scales, self.biases, self.bits, self.group_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, dtype={self.dtype}"
        )


class MLXQuantizedLinear(_PackedAffine):
    """A bias-free linear layer whose weights stay MLX-packed in memory.

    On CPU ``forward`` is the torch reference: dequantize (bit-exact with mlx), cast to the
    activations' dtype, ``F.linear``; on CUDA a Triton kernel reads the packed codes.
    """

    @classmethod
    def from_float(cls, weight: Tensor, bits: int, group_size: int) -> MLXQuantizedLinear:
        return cls(*quantize_affine(weight, bits, group_size), bits, group_size)

    def forward(self, x: Tensor | affine_kernels.CodesMajor) -> Tensor:
        return affine_kernels.affine_linear(
            x, self.packed, self.scales, self.biases, self.bits, self.group_size
        )

    def codes_major_input(self, x: Tensor) -> tuple[int, int] | None:
        """(codes per word, words per block) where this layer's GPU GEMV would reorder x
        `codes_major` first, so that x's producer may store it so (`CodesMajor`); else None."""
        return affine_kernels.codes_major_input(x, self.packed, self.bits, self.group_size)

    def geglu_out(self, x: Tensor | affine_kernels.CodesMajor) -> Tensor | None:
        """``gelu_tanh_mul(forward(x))`` of a stacked gate/up layer, stored by its GPU GEMV (no
        GeGLU launch), where that GEMV does not split K; None elsewhere."""
        return affine_kernels.affine_gemv_geglu_out(
            x, self.packed, self.scales, self.biases, self.bits, self.group_size
        )

    def split_partials(self, x: Tensor) -> Partials | None:
        """`forward(x)` as its GEMV's split partials, for a norm kernel to add (one launch
        fewer), where the GPU's GEMV splits K for this shape; None elsewhere."""
        values = affine_kernels.affine_gemv_partials(
            x, self.packed, self.scales, self.biases, self.bits, self.group_size
        )
        return None if values is None else Partials(values, x.dtype)


class MLXQuantizedEmbedding(_PackedAffine):
    """A quantized token table that is also the tied output head (``gemma.Embedding``'s API)."""

    def embed(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows of ``ids``, dequantizing only those rows."""
        return affine_kernels.affine_embed(
            ids, self.packed, self.scales, self.biases, self.bits, self.group_size, dtype
        )

    def head(self, x: Tensor) -> Tensor:
        return affine_kernels.affine_linear(
            x, self.packed, self.scales, self.biases, self.bits, self.group_size
        )


class MLXQuantizedExperts(_PackedAffine):
    """Per-expert weights ``[experts, out, in]`` (a switch layer) kept MLX-packed.

    Indexed like the float ``[experts, out, in]`` tensor it replaces, so a MoE block reads
    either alike; ``self[expert]`` dequantizes that expert only.
    """

    def __getitem__(self, expert: int) -> Tensor:
        return dequantize_affine(
            self.packed[expert],
            self.scales[expert],
            self.biases[expert],
            self.bits,
            self.group_size,
        )

    def gathered_matmul(self, x: Tensor, expert_ids: Tensor, geglu_out: bool = False) -> Tensor:
        """``[T, top_k, out]``: x ``[T, in]`` or ``[T, top_k, in]`` times each chosen expert,
        reading only those experts (no host sync on CUDA); with `geglu_out` (stacked gate/up
        experts) ``gelu_tanh_mul`` of it, ``[T, top_k, out / 2]``."""
        return affine_kernels.affine_expert_matmul(
            x,
            self.packed,
            self.scales,
            self.biases,
            expert_ids,
            self.bits,
            self.group_size,
            geglu_out=geglu_out,
        )
