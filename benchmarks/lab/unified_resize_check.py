"""The unified 12B's image preprocessing against HF's own `Gemma4UnifiedImageProcessor`, where
torchvision is installed (it has no build for the CPU torch the tests pin, so CI checks the
steps around the resize and bounds the resize against Pillow; this runs the real processor).

    python benchmarks/lab/unified_resize_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hearth.media import Image
from hearth.media.image import unified_image_patches

SIZES = [(64, 64), (200, 90), (37, 301), (640, 480), (1000, 7), (1680, 1536), (4032, 3024)]


def main() -> None:
    from PIL import Image as PILImage
    from transformers import Gemma4UnifiedImageProcessor

    print("| size | budget | patches | equal | max abs diff |\n|---|---|---|---|---|")
    for width, height in SIZES:
        rng = np.random.default_rng(width * 10_007 + height)
        ys, xs = np.mgrid[0:height, 0:width]
        smooth = (np.sin(xs / 37) + np.cos(ys / 23)) * 60 + 128
        noisy = np.clip(smooth[..., None] + rng.normal(0, 20, (height, width, 3)), 0, 255)
        pixels = PILImage.fromarray(noisy.astype(np.uint8), "RGB")
        for budget in (70, 280, 1120):
            processor = Gemma4UnifiedImageProcessor(max_soft_tokens=budget)
            reference = processor(images=[pixels], return_tensors="pt")
            real = reference["image_position_ids"][0][:, 0] >= 0
            theirs = reference["pixel_values"][0][real].numpy()
            ours = unified_image_patches(Image(pixels, "0" * 64, budget), budget).pixels
            same = theirs.shape == ours.shape and np.array_equal(theirs, ours)
            worst = float(np.abs(theirs - ours).max()) if theirs.shape == ours.shape else -1.0
            print(f"| {width}x{height} | {budget} | {len(ours)} | {same} | {worst:.3g} |")


if __name__ == "__main__":
    main()
