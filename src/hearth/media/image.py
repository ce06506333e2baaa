"""Gemma 4's image preprocessing: pure maths on a decoded image (HF's
`Gemma4ImageProcessorPil`).

An image is resized, keeping its aspect ratio, to the largest size whose sides are multiples
of patch · pooling pixels (48) and whose patches fit the soft-token budget (budget · pooling²
patches of 16x16); Pillow's bicubic filter on the 8-bit RGB values, as HF's PIL processor
resizes. Pixels are scaled to [0, 1] (x/255 in float64, then float32), cut into patches whose
values run (row in patch, column in patch, channel), each with its (x, y) = (column, row) in
the patch grid. HF pads the patches to the budget with position (−1, −1); the tower masks
those out, so none are made here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hearth.media import Image, MediaError

IMAGE_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # what Gemma 4 was trained with
DEFAULT_IMAGE_TOKENS = 280


def check_budget(budget: int) -> None:
    if budget not in IMAGE_TOKEN_BUDGETS:
        choices = ", ".join(str(b) for b in IMAGE_TOKEN_BUDGETS)
        raise MediaError(f"an image's soft-token budget must be one of {choices}, not {budget}")


def resized_size(
    width: int, height: int, budget: int, patch: int = 16, pooling: int = 3
) -> tuple[int, int]:
    """(width, height) an image of this size is resized to for `budget` soft tokens."""
    check_budget(budget)
    max_patches = budget * pooling**2
    side = patch * pooling
    scale = math.sqrt(max_patches * patch**2 / (width * height))
    target_w = math.floor(scale * width / side) * side
    target_h = math.floor(scale * height / side) * side
    longest = (max_patches // pooling**2) * side
    # A very thin image: its short side takes one pooled row, its long side as the ratio says.
    if target_h == 0 and target_w == 0:
        raise MediaError(f"the image ({width}x{height}) is too small to cut into patches")
    if target_h == 0:
        target_h, target_w = side, min(math.floor(width / height) * side, longest)
    elif target_w == 0:
        target_w, target_h = side, min(math.floor(height / width) * side, longest)
    if target_w * target_h > max_patches * patch**2:
        raise MediaError(f"the image ({width}x{height}) cannot fit {budget} soft tokens")
    return target_w, target_h


def soft_token_count(size: tuple[int, int], budget: int, patch: int = 16, pooling: int = 3) -> int:
    """Soft tokens of an image of `size` (width, height) under `budget`."""
    width, height = resized_size(*size, budget, patch, pooling)
    return (width // patch) * (height // patch) // pooling**2


@dataclass(frozen=True)
class ImagePatches:
    """One image cut into patches: `values` [patches, patch² · 3] uint8 and `positions`
    [patches, 2] int64 (x, y), the grid's rows in order. The 8-bit values go to the device as
    they are (a quarter of the bytes, no float pass on the host); `pixels` gives them scaled
    to [0, 1] by the model's processor's rule (`rescale_in_float64`, see `scaled`)."""

    values: np.ndarray
    positions: np.ndarray
    grid: tuple[int, int]  # (columns, rows) of patches
    rescale_in_float64: bool = True

    @property
    def pixels(self) -> np.ndarray:
        """[patches, patch² · 3] float32 in [0, 1], as HF's processor gives them."""
        return scaled(self.values, self.rescale_in_float64)


def scaled(values: np.ndarray, in_float64: bool = True) -> np.ndarray:
    """8-bit values scaled to [0, 1]: x · (1/255) in float64 rounded to float32 (HF's PIL
    processor, numpy), or in float32 (HF's torchvision processors: a uint8 tensor times a
    Python float). The two differ by one unit in the last place for 126 of the 256 values; the
    model repeats the rule on the device, bit for bit."""
    if in_float64:
        return (values.astype(np.float64) * (1 / 255)).astype(np.float32)
    return values.astype(np.float32) * np.float32(1 / 255)


def image_patches(image: Image, budget: int, patch: int = 16, pooling: int = 3) -> ImagePatches:
    """`image` resized for `budget` soft tokens, scaled to [0, 1] and cut into patches."""
    return _cut(_resized_values(image, budget, patch, pooling), patch)


def unified_image_patches(
    image: Image, budget: int, patch: int = 16, pooling: int = 3
) -> ImagePatches:
    """The 12B unified model's patches (HF's `Gemma4UnifiedImageProcessor`, a torchvision
    processor): the same target size, resized by torch's antialiased bicubic on the 8-bit
    values (what torchvision's resize runs on a uint8 CPU image), scaled in float32, cut into
    squares of patch · pooling pixels (one per soft token) whose values run (row, column,
    channel) over the square, with their (x, y) places in the grid of squares. HF cuts
    16-pixel patches and merges each 3x3 group; the values and order are the same."""
    width, height = resized_size(*image.size, budget, patch, pooling)
    values = np.asarray(image.pixels, dtype=np.uint8)
    if (width, height) != image.size:
        values = _torch_resized(values, width, height)
    cut = _cut(values, patch * pooling)
    return ImagePatches(cut.values, cut.positions, cut.grid, rescale_in_float64=False)


def _torch_resized(values: np.ndarray, width: int, height: int) -> np.ndarray:
    """[height, width, 3] uint8: torch's antialiased bicubic (align_corners off) on the 8-bit
    [1, 3, H, W] image, as torchvision's `resize` computes it for a uint8 tensor on the CPU."""
    import torch
    from torch.nn.functional import interpolate

    planar = torch.from_numpy(np.ascontiguousarray(values.transpose(2, 0, 1)))[None]
    resized = interpolate(
        planar, size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )
    return resized[0].permute(1, 2, 0).numpy()


def _resized_values(image: Image, budget: int, patch: int, pooling: int) -> np.ndarray:
    """[height, width, 3] uint8 RGB of `image` resized for `budget` soft tokens."""
    from PIL import Image as PILImage

    width, height = resized_size(*image.size, budget, patch, pooling)
    pixels = image.pixels
    if (width, height) != image.size:
        pixels = pixels.resize((width, height), resample=PILImage.Resampling.BICUBIC)  # type: ignore[attr-defined]
    return np.asarray(pixels, dtype=np.uint8)


def _cut(values: np.ndarray, patch: int) -> ImagePatches:
    """[height, width, 3] values cut into `patch`-sided squares, the grid's rows in order."""
    height, width = values.shape[:2]
    columns, rows = width // patch, height // patch
    cut = values.reshape(rows, patch, columns, patch, 3).transpose(0, 2, 1, 3, 4)
    flat = np.ascontiguousarray(cut.reshape(rows * columns, patch * patch * 3))
    xs, ys = np.meshgrid(np.arange(columns), np.arange(rows), indexing="xy")
    positions = np.stack([xs, ys], axis=-1).reshape(-1, 2).astype(np.int64)
    return ImagePatches(flat, positions, (columns, rows))


def checkpoint_image_tokens(directory: Path) -> int | None:
    """The soft-token budget a checkpoint's processor config names (`max_soft_tokens` in
    processor_config.json or preprocessor_config.json), if any."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        try:
            config = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        processor = config.get("image_processor", config)
        budget = processor.get("max_soft_tokens") if isinstance(processor, dict) else None
        if isinstance(budget, int) and budget in IMAGE_TOKEN_BUDGETS:
            return budget
    return None
