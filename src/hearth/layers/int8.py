"""CPU weight-only int8 / int4 linear layers and tables (their maths: `quant.cpu`).

A single int8 row (batch-1 decode) runs on Hearth's native kernel where it builds
(`hearth.ops.native`), which streams the weights at up to twice the speed of torch's
``aten._weight_int8pack_mm``; several rows, and int4, run on torch's packed-matmul ops, and
where a torch build lacks them (or a shape does not fit them) on the dequantized weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from hearth.ops import native
from hearth.ops.native.bf16_gemm import linear
from hearth.quant.cpu import (
    HAS_INT4_KERNEL,
    HAS_INT8_KERNEL,
    INT4_KERNEL_OUT_MULTIPLE,
    INT8_KERNEL_IN_MULTIPLE,
    SCALE_FLOOR,
    aligned,
    check_group_size,
    codes_from_kernel_layout,
    dequantize_int4_groups,
    dequantize_int8_rows,
    pack_nibbles,
    quantize_int4_groups,
    unpack_nibbles,
)
from hearth.quant.cpu import quantize_int8_rows as quantize_int8_rows_reference


def quantize_int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`quant.cpu.quantize_int8_rows`, on the native kernel where it fits (the same numbers,
    ~10x sooner)."""
    kernels = native.for_cpu_bf16(weight)
    if kernels is not None and weight.is_contiguous() and weight.dim() == 2:
        return kernels.quantize_int8_rows(weight, SCALE_FLOOR)
    return quantize_int8_rows_reference(weight)


# From this many input rows on, forward unpacks the weight and runs a dense GEMM.
PREFILL_ROWS = 16


class _QuantizedLinear(nn.Module):
    """Shared forward: flatten leading dims, bf16 kernel when usable, optional bias, restore."""

    in_features: int
    out_features: int
    uses_kernel: bool
    bias: Tensor | None
    dense_prefill = False  # unpacking is cheap enough to run prefills as dense GEMMs

    def _init_common(
        self, in_features: int, out_features: int, bias: Tensor | None, uses_kernel: bool
    ) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.uses_kernel = uses_kernel
        self.register_buffer("bias", None if bias is None else bias.detach())

    def dequantize(self) -> Tensor:
        raise NotImplementedError

    def _kernel_matmul(self, x2d_bf16: Tensor) -> Tensor:
        raise NotImplementedError

    def dequantize_as(self, dtype: torch.dtype) -> Tensor:
        """The weight in `dtype`: the fp32 `dequantize()` rounded to it."""
        return self.dequantize().to(dtype)

    def reference_forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return linear(x, self.dequantize_as(x.dtype), bias)

    def forward(self, x: Tensor) -> Tensor:
        # Many rows (a prefill) are compute-bound: a bf16 GEMM on the unpacked weight beats
        # the weight-only kernel, which is built for one row at a time.
        many_rows = self.dense_prefill and x.numel() >= PREFILL_ROWS * self.in_features
        if not self.uses_kernel or many_rows:
            return self.reference_forward(x)
        x2d = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = self._kernel_matmul(x2d).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, uses_kernel={self.uses_kernel}"
        )


class Int8Linear(_QuantizedLinear):
    """int8 weights [out, in] with one bf16 scale per output row."""

    dense_prefill = True

    qweight: Tensor
    scales: Tensor

    def __init__(self, qweight: Tensor, scales: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        out_features, in_features = qweight.shape
        self.uses_torch_kernel = HAS_INT8_KERNEL and in_features % INT8_KERNEL_IN_MULTIPLE == 0
        self.uses_native = native.kernels() is not None
        uses_kernel = self.uses_native or self.uses_torch_kernel
        self._init_common(in_features, out_features, bias, uses_kernel)
        self.register_buffer("qweight", aligned(qweight.contiguous()))
        self.register_buffer("scales", scales.contiguous())

    @classmethod
    def from_float(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        return cls(*quantize_int8_rows(weight), bias)

    def dequantize(self) -> Tensor:
        return dequantize_int8_rows(self.qweight, self.scales)

    def dequantize_as(self, dtype: torch.dtype) -> Tensor:
        kernels = native.kernels() if dtype == torch.bfloat16 and self.uses_native else None
        if kernels is None or self.qweight.device.type != "cpu":
            return super().dequantize_as(dtype)
        return kernels.int8_rows_to_bf16(self.qweight, self.scales)  # the same bits, ~10x sooner

    def _kernel_matmul(self, x2d_bf16: Tensor) -> Tensor:
        # The native kernel wins on one row; from two rows on, torch's does (see hearth.ops.native).
        if self.uses_native and (x2d_bf16.shape[0] == 1 or not self.uses_torch_kernel):
            kernels = native.kernels()
            assert kernels is not None  # uses_native was set from it
            return kernels.int8_rows_matmul(x2d_bf16, self.qweight, self.scales)
        return torch.ops.aten._weight_int8pack_mm(aligned(x2d_bf16), self.qweight, self.scales)


class Int4Linear(_QuantizedLinear):
    """int4 weights, two per byte, with a bf16 (scale, zero) per group of inputs and output.

    ``packed`` is [out, in // 2] uint8 in the kernel's (machine-specific) tiling when
    ``uses_kernel``, else in the portable nibble layout of ``pack_nibbles``.
    """

    packed: Tensor
    scales_and_zeros: Tensor

    def __init__(
        self,
        packed: Tensor,
        scales_and_zeros: Tensor,
        group_size: int,
        uses_kernel: bool,
        bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        out_features = packed.shape[0]
        in_features = packed.shape[1] * 2
        check_group_size(in_features, group_size)
        self._init_common(in_features, out_features, bias, uses_kernel)
        self.group_size = group_size
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())

    @classmethod
    def from_float(
        cls, weight: Tensor, group_size: int = 32, bias: Tensor | None = None
    ) -> Int4Linear:
        codes, scales_and_zeros = quantize_int4_groups(weight, group_size)
        return cls.from_codes(codes, scales_and_zeros, group_size, bias)

    @classmethod
    def from_codes(
        cls,
        codes: Tensor,
        scales_and_zeros: Tensor,
        group_size: int,
        bias: Tensor | None = None,
    ) -> Int4Linear:
        """The layer of `quantize_int4_groups`'s output, packed for the kernel if it runs."""
        uses_kernel = HAS_INT4_KERNEL and codes.shape[0] % INT4_KERNEL_OUT_MULTIPLE == 0
        if uses_kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        else:
            packed = pack_nibbles(codes)
        return cls(packed, scales_and_zeros, group_size, uses_kernel, bias)

    def codes(self) -> Tensor:
        """The uint8 codes [out, in] in 0..15, whichever layout holds them."""
        if self.uses_kernel:
            return codes_from_kernel_layout(self.packed, self.in_features, self.group_size)
        return unpack_nibbles(self.packed)

    def dequantize(self) -> Tensor:
        return dequantize_int4_groups(self.codes(), self.scales_and_zeros, self.group_size)

    def _kernel_matmul(self, x2d_bf16: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2d_bf16, self.packed, self.group_size, self.scales_and_zeros
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class QuantizedEmbeddingHead(nn.Module):
    """A tied embedding / output head held once, as int8 rows with one bf16 scale per token.

    ``embed`` dequantizes only the gathered rows; ``head`` is the int8 matmul against all rows.
    """

    def __init__(self, table: Int8Linear) -> None:
        super().__init__()
        self.table = table

    @classmethod
    def from_float(cls, weight: Tensor) -> QuantizedEmbeddingHead:
        return cls(Int8Linear.from_float(weight))

    def embed(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        rows = self.table.qweight[ids].float() * self.table.scales[ids].float()[..., None]
        return rows.to(dtype)

    def head(self, x: Tensor) -> Tensor:
        return self.table(x)

    def dequantize(self) -> Tensor:
        return self.table.dequantize()

    @property
    def nbytes(self) -> int:
        return self.table.nbytes


class QuantizedEmbedding(nn.Module):
    """A lookup-only table (Gemma 4's per-layer inputs) as int8 with a bf16 scale per group of
    ``GROUP`` values: each group is quantized as an int8 row is (``quantize_int8_rows``).

    A decode step reads only a token's row, so the table costs memory, not speed: groups keep
    the error of a row that concatenates many layers' inputs local to each layer's part.
    """

    GROUP = 32
    codes: Tensor
    scales: Tensor

    def __init__(self, codes: Tensor, scales: Tensor) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    @classmethod
    def from_float(cls, weight: Tensor) -> QuantizedEmbedding:
        rows, width = weight.shape
        check_group_size(width, cls.GROUP)
        codes, scales = quantize_int8_rows(weight.reshape(-1, cls.GROUP).contiguous())
        return cls(codes.reshape(rows, width), scales.reshape(rows, width // cls.GROUP))

    def embed(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        codes = self.codes[ids].float().unflatten(-1, (-1, self.GROUP))
        return (codes * self.scales[ids].float()[..., None]).flatten(-2).to(dtype)

    def dequantize(self) -> Tensor:
        return self.embed(torch.arange(self.codes.shape[0]))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


QUANT_MODES = ("int8", "int4")


def quantized_linear(
    weight: Tensor, mode: str, group_size: int = 32, bias: Tensor | None = None
) -> _QuantizedLinear:
    """The int8 / int4 weight-only linear layer of a float `weight` [out, in]."""
    if mode == "int8":
        return Int8Linear.from_float(weight, bias)
    return Int4Linear.from_float(weight, group_size, bias)


def quantized_linear_of_parts(
    parts: Sequence[Tensor], mode: str, group_size: int = 32
) -> _QuantizedLinear:
    """`quantized_linear(torch.cat(parts), mode)` without concatenating the float parts: rows
    are quantized independently, so each part is quantized alone and their codes and scales
    are stacked, a half (int8) or a quarter (int4) of the bytes a float concatenation copies."""
    if len(parts) == 1:
        return quantized_linear(parts[0], mode, group_size)
    if mode == "int8":
        codes, scales = zip(*(quantize_int8_rows(part) for part in parts), strict=True)
        return Int8Linear(torch.cat(codes), torch.cat(scales))
    codes, scales_and_zeros = zip(
        *(quantize_int4_groups(part, group_size) for part in parts), strict=True
    )
    # scales_and_zeros is [in // group, out, 2]: the parts stack along its output axis.
    return Int4Linear.from_codes(torch.cat(codes), torch.cat(scales_and_zeros, dim=1), group_size)


def quantize_model(model: nn.Module, mode: str, group_size: int = 32) -> None:
    """Replace every ``nn.Linear`` of ``model`` in place by its int8 / int4 weight-only twin.

    Embeddings are left alone (a tied head is wired separately, see ``QuantizedEmbeddingHead``).
    The float weights are dropped with the replaced modules unless referenced elsewhere.
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"mode must be one of {QUANT_MODES}, got {mode!r}")
    if isinstance(model, nn.Linear):
        raise TypeError("quantize_model swaps submodules; wrap a bare nn.Linear in a container")
    # Collect first: replacing children while iterating named_modules would skip or revisit.
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    with torch.no_grad():
        for parent, name, linear in targets:
            setattr(parent, name, quantized_linear(linear.weight, mode, group_size, linear.bias))
